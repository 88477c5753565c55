import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.kernels import attention_reference, flash_attention, naive_attention, rms_norm
from tessera.models import PRESETS, build_model, get_preset
from tessera.data.corpus import TokenStream, decode, encode


@pytest.mark.parametrize("name, published", [("8b", 8.03e9), ("70b", 70.6e9), ("405b", 405.9e9)])
def test_preset_parameter_counts_match_llama3(name, published):
    assert abs(get_preset(name).num_params() - published) / published < 0.005


def test_presets_build_on_meta_with_exact_counts():
    for name in PRESETS:
        model = build_model(name, device="meta")
        assert sum(p.numel() for p in model.parameters()) == model.config.num_params()
        assert all(p.is_meta for p in model.parameters())


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'tiny'; choose one of debug"):
        get_preset("tiny")


def test_init_depends_only_on_seed_and_name():
    a, b = build_model("debug", seed=3), build_model("debug", seed=3)
    c = build_model("debug", seed=4)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(p, r), n
    # the values of a tensor do not depend on what else the model holds (e.g. the number of layers)
    deeper = build_model(get_preset("debug", n_layers=3), seed=3)
    assert torch.equal(deeper.tok_embeddings.weight, a.tok_embeddings.weight)


shapes = st.tuples(
    st.integers(1, 2),
    st.sampled_from([(2, 1), (4, 2), (2, 2)]),
    st.integers(1, 40),
    st.integers(1, 40),
    st.sampled_from([8, 16]),
)


@settings(max_examples=40, deadline=None)
@given(shapes, st.booleans(), st.integers(0, 2**16))
def test_blockwise_reference_matches_naive_attention(shape, causal, seed):
    B, (hq, hkv), sq, sk, d = shape
    if causal:
        sk = max(sk, sq)  # bottom-right causal: every query sees at least one key
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, s, d, generator=g, dtype=torch.float64) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    out, lse = attention_reference(q, k, v, causal=causal, block=7)
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def test_reference_gradients_match_naive():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 19, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 19, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 19, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 4, 19, 16, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda: attention_reference(q, k, v, True, None, 5)[0], lambda: naive_attention(q, k, v, True)[0]):
        (fn() * w).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "q, k, v, message",
    [
        ((1, 3, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), "must be a multiple of kv heads"),
        ((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 9, 16), "same shape"),
        ((2, 8, 16), (2, 8, 16), (2, 8, 16), "4-D"),
    ],
)
def test_attention_bad_input(q, k, v, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(torch.randn(q), torch.randn(k), torch.randn(v))
    with pytest.raises(ValueError, match="share a dtype"):
        flash_attention(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).double(), torch.randn(1, 2, 4, 8))


def test_rms_norm_matches_definition():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(15))


def test_token_stream_is_deterministic_and_sliced_by_dp():
    s = TokenStream(seq_len=16, global_batch=4)
    full_in, full_tg = s.global_batch_at(0)
    assert torch.equal(full_in[:, 1:], full_tg[:, :-1])
    parts = []
    for d in range(2):
        s2 = TokenStream(seq_len=16, global_batch=4)
        parts.append(s2.next_batch(d, 2)[0])
        assert s2.cursor == 4
    assert torch.equal(torch.cat(parts), full_in)
    assert decode(encode("tessera")) == "tessera"


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 700), st.integers(1, 600), st.data())
def test_tiled_init_of_a_region_is_that_slice_of_the_whole(rows, cols, data):
    from tessera.models.init import init_region

    r0 = data.draw(st.integers(0, rows - 1))
    c0 = data.draw(st.integers(0, cols - 1))
    nr = data.draw(st.integers(1, rows - r0))
    nc = data.draw(st.integers(1, cols - c0))
    whole = init_region("w", (rows, cols), (0, 0), (rows, cols), 0.02, 7)
    part = init_region("w", (rows, cols), (r0, c0), (nr, nc), 0.02, 7)
    assert torch.equal(part, whole[r0 : r0 + nr, c0 : c0 + nc])
    assert whole.abs().max() <= 3 * 0.02  # truncated at 3 std


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 20), st.integers(1, 200), st.floats(0, 1))
def test_lr_schedule_warms_up_then_decays_to_the_floor(warmup, steps, floor):
    from tessera.trainer import lr_lambda

    steps = steps + warmup  # the cosine part has at least one step
    f = lr_lambda(warmup, steps, floor)
    values = [f(s) for s in range(steps + 5)]
    assert all(0 < v <= 1 + 1e-12 for v in values[:steps])
    if warmup:
        assert values[:warmup] == sorted(values[:warmup]) and values[warmup - 1] == 1.0
    after = values[warmup:]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))  # never rises after warm-up
    assert abs(values[-1] - floor) < 1e-9 and min(after) >= floor - 1e-12  # decays to the floor, not below


def test_a_pipeline_stage_runs_without_embedding_or_head():
    model = build_model("debug", seed=0)
    tokens = torch.randint(0, 258, (2, 16))
    full = model(tokens)
    first, last = build_model("debug", seed=0), build_model("debug", seed=0)
    first.layers = torch.nn.ModuleDict({"0": first.layers["0"]})
    first.norm = first.output = None
    last.layers = torch.nn.ModuleDict({"1": last.layers["1"]})
    last.tok_embeddings = None
    torch.testing.assert_close(last(first(tokens)), full, rtol=0, atol=0)
