"""The gpt-oss family: tessera's GptOss gives transformers' GptOssForCausalLM logits with the same weights (fp32,
a sequence longer than the sliding window, biases and sinks drawn, the SwiGLU clamp reached) through a
transformers-saved directory into tessera and through tessera's export into transformers; its names are
transformers' own; config.json fields the family cannot represent and bad configs are refused by name; tp2
gives one process's logits and gradients; the presets' sizes are the published totals."""

import json

import pytest
import torch

from helpers import NEEDS_TRANSFORMERS

pytestmark = NEEDS_TRANSFORMERS

from tessera.models.hf import (  # noqa: E402
    check_hf_weights,
    hf_to_tessera_name,
    load_hf_weights,
    read_hf_config,
    save_hf,
    tessera_to_hf_name,
    weight_files,
)
from tessera.models.gpt_oss import GPT_OSS, GptOssConfig  # noqa: E402

VOCAB = 128
WINDOW = 8
TOKENS = torch.randint(0, VOCAB, (2, 29), generator=torch.Generator().manual_seed(1))  # 29 > the window
YARN = (("factor", 4.0), ("original_max_position_embeddings", 64), ("beta_fast", 32.0), ("beta_slow", 1.0))
# 4 heads x 16 = 64 = dim, 2 kv heads; layers sliding, full, sliding; 8 experts, top 2; a clamp of 0.5 that
# the gate and up projections reach
TINY = dict(
    dim=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    moe_ffn_dim=32,
    n_experts=8,
    top_k=2,
    sliding_window=WINDOW,
    swiglu_limit=0.5,
    rope_scaling=YARN + (("truncate", False),),
    max_seq_len=256,
)


def _close(got, want, tol=1e-5):
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


def _hf_config(**overrides):
    from transformers import GptOssConfig as HFGptOssConfig

    return HFGptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        swiglu_limit=0.5,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **dict(YARN), "truncate": False},
        tie_word_embeddings=False,
        attn_implementation="eager",
        **overrides,
    )


def _drawn(model, seed):
    """Every parameter drawn (biases, sinks and the norms too, which initialization leaves 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith(("sinks", "bias")) else 0.15
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def _hf_model(tmp_path):
    from transformers import GptOssForCausalLM

    theirs = _drawn(GptOssForCausalLM(_hf_config()), 0).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    return theirs


def test_a_transformers_gpt_oss_loads_into_tessera_with_its_logits(tmp_path):
    theirs = _hf_model(tmp_path)
    cfg = read_hf_config(tmp_path)
    # transformers trains no load-balancing loss without output_router_logits: neither does tessera then
    assert cfg == GptOssConfig(**TINY, aux_loss_coef=0.0, rope_theta=150000.0, norm_eps=1e-5)
    assert cfg.attention_types == ("sliding_attention", "full_attention", "sliding_attention")
    check_hf_weights(tmp_path, cfg)
    ours = GPT_OSS.build_model(cfg, seed=None)
    with torch.no_grad():
        for p in ours.parameters():
            p.fill_(float("nan"))  # every parameter must come from the files
    load_hf_weights(ours, tmp_path)
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    with torch.no_grad():
        want = theirs(TOKENS).logits
        _close(ours.eval()(TOKENS), want)
        # what the comparison rests on matters: the window, the sinks, the clamp, the router's bias
        for change in ("window", "sinks", "clamp", "router"):
            other = GPT_OSS.build_model(cfg, seed=None)
            other.load_state_dict(ours.state_dict())
            if change == "window":
                other.layers["0"].self_attn.core.window = 10**6
            elif change == "sinks":
                other.layers["1"].self_attn.sinks.zero_()
            elif change == "clamp":
                for layer in other.layers.values():
                    layer.mlp.experts.swiglu_clamp = (1.702, 7.0)
            else:
                other.layers["0"].mlp.gate.bias.mul_(-1.0)
            assert (other(TOKENS) - want).abs().max().item() > 1e-3, change
    # tessera's export of what it loaded has transformers' own names
    save_hf(ours.state_dict(), cfg, tmp_path / "again")
    assert set(weight_files(tmp_path / "again")) == set(weight_files(tmp_path))


def test_every_gradient_equals_transformers(tmp_path):
    """Backward too: the sinks' (through the kernels' log-sum-exp merge), the biases' (the router's, the
    experts' through the clamp and the grouped GEMMs) and every other parameter's, by transformers' name (no
    auxiliary loss on either side: config.json leaves output_router_logits off)."""
    theirs = _hf_model(tmp_path)
    cfg = read_hf_config(tmp_path)
    ours = GPT_OSS.build_model(cfg, seed=None)
    load_hf_weights(ours, tmp_path)
    probe = torch.randn(2, 29, VOCAB, generator=torch.Generator().manual_seed(9))
    (theirs(TOKENS).logits * probe).sum().backward()
    (ours.eval()(TOKENS) * probe).sum().backward()
    hf = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        want = hf[tessera_to_hf_name(name, cfg)].grad
        assert want is not None and want.abs().max() > 0, name
        _close(p.grad, want)


def test_tesseras_export_loads_into_transformers_with_tesseras_logits(tmp_path):
    from transformers import GptOssForCausalLM

    cfg = GptOssConfig(**TINY)
    ours = _drawn(GPT_OSS.build_model(cfg, seed=3), 5).eval()
    save_hf(ours.state_dict(), cfg, tmp_path)
    theirs = GptOssForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert theirs.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert theirs.config.sliding_window == WINDOW and theirs.config.swiglu_limit == 0.5
    with torch.no_grad():
        want = theirs(TOKENS).logits
        _close(ours(TOKENS), want)
        assert not torch.allclose(want, torch.zeros_like(want))


def test_hf_names_are_transformers_own_and_round_trip(tmp_path):
    from transformers import GptOssForCausalLM

    cfg = GptOssConfig(**TINY)
    ours = GPT_OSS.build_model(cfg, device="meta")
    hf_names = set()
    for n, _ in ours.named_parameters():
        hf = tessera_to_hf_name(n, cfg)
        assert hf_to_tessera_name(hf, cfg) == n
        hf_names.add(hf)
    assert tessera_to_hf_name("layers.0.mlp.gate.bias", cfg) == "model.layers.0.mlp.router.bias"
    torch.manual_seed(0)
    GptOssForCausalLM(_hf_config()).save_pretrained(tmp_path, safe_serialization=True)
    assert set(weight_files(tmp_path)) == hf_names
    for bad in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.gate_proj.weight"):
        with pytest.raises(ValueError, match="not a gpt-oss weight"):
            hf_to_tessera_name(bad, cfg)
    with pytest.raises(ValueError, match="has no Hugging Face gpt-oss name"):
        tessera_to_hf_name("layers.0.mlp.router.weight", cfg)


def test_decoding_with_the_kv_cache_past_the_window_equals_recomputing_the_prefix():
    from tessera.models.generation import generate

    model = GPT_OSS.build_model(GptOssConfig(**TINY), seed=4).eval()
    prompt = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cached = generate(model, prompt, 9, use_cache=True, keep_logits=True)
        whole = generate(model, prompt, 9, use_cache=False, keep_logits=True)
    assert len(cached.logits) == 9  # 11 + 9 positions: the sliding layers' window of 8 moves on
    for a, b in zip(cached.logits, whole.logits):
        _close(a, b)


# ----------------------------------------------------------------------------- config.json and bad input
def _config_json(**overrides):
    c = _hf_config().to_dict()
    c["architectures"] = ["GptOssForCausalLM"]
    return {**c, **overrides}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attention_bias", False, "attention without biases"),
        ("hidden_act", "gelu", "activation 'gelu'"),
        ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}, "rope type 'llama3'"),
        ("sliding_window", None, "sliding layers without a window"),
        ("quantization_config", {"quant_method": "mxfp4"}, r"quantized weights \(the published MXFP4 experts"),
    ],
)
def test_what_gpt_oss_cannot_represent_is_refused_by_field_name(tmp_path, field, value, message):
    (tmp_path / "config.json").write_text(json.dumps(_config_json()))
    assert read_hf_config(tmp_path).attention_types == ("sliding_attention", "full_attention", "sliding_attention")
    (tmp_path / "config.json").write_text(json.dumps(_config_json(**{field: value})))
    with pytest.raises(ValueError, match=f"config.json: {field}: {message}.* is not supported"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sliding_window": 0}, r"sliding_window=0 must be a whole number of tokens, at least 1"),
        ({"layer_types": ["full_attention"] * 2}, r"layer_types has 2 entries for n_layers=3: give one per layer"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            r"layer_types: 'chunked_attention' is not a layer type; use sliding_attention or full_attention",
        ),
    ],
)
def test_a_bad_window_or_layer_types_is_one_line_naming_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        GptOssConfig(**{**TINY, **overrides})
    (tmp_path / "config.json").write_text(json.dumps(_config_json(**overrides)))
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        read_hf_config(tmp_path)


def test_another_familys_checkpoint_is_refused_as_gpt_oss(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tessera.models.hf import compare_with_preset

    Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    ).save_pretrained(tmp_path, safe_serialization=True)
    qwen3 = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"architecture 'Qwen3ForCausalLM' .*gpt_oss family loads GptOssForCausalLM"):
        GPT_OSS.hf.read_config(qwen3, "config.json")
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    with pytest.raises(ValueError, match=r"architecture 'LlamaForCausalLM' .*gpt_oss family loads GptOssForCausalLM"):
        GPT_OSS.hf.read_config(llama, "config.json")
    with pytest.raises(ValueError, match=r"preset=gpt-oss-debug does not match the Hugging Face config.json"):
        compare_with_preset(read_hf_config(tmp_path), GPT_OSS.config("gpt-oss-debug"), "gpt-oss-debug")
    with pytest.raises(ValueError, match=r"unexpected parameter 'model.layers.0.*not a gpt-oss weight"):
        load_hf_weights(GPT_OSS.build_model(GptOssConfig(**TINY), seed=None), tmp_path)


def test_a_tp_beyond_the_kv_heads_is_refused_before_any_rank_starts():
    from tessera.parallel.parallelize import ParallelConfig
    from tessera.topology.errors import ConfigError
    from tessera.topology.layout import Layout

    cfg = GptOssConfig(**TINY)  # 2 kv heads, with biases
    ParallelConfig(Layout(tp=2)).check(cfg)
    with pytest.raises(ConfigError, match=r"^tp=4 exceeds the 2 kv heads, and the K/V projections have biases"):
        ParallelConfig(Layout(tp=4)).check(cfg)


def test_an_ep_degree_the_experts_do_not_divide_is_refused():
    from tessera.topology.errors import ConfigError
    from tessera.topology.shapes import check_expert_parallel

    with pytest.raises(ConfigError, match=r"ep=3 does not divide the 32 experts; use a divisor of 32"):
        check_expert_parallel(GPT_OSS.shape(GPT_OSS.config("gpt-oss-20b")).n_experts, 3, 3)


# ----------------------------------------------------------------------------- parallel
def build_tiny():
    """The tiny config's model (the runner seeds it): module-level, so the ranks unpickle it."""
    return GPT_OSS.build_model(GptOssConfig(**TINY), device="meta")


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp_shard=2, ep=2)], ids=["tp2", "dp2xep2"])
def test_tp2_and_ep2_train_like_one_process(layout):
    """The sinks split with the query heads, the biases (q, k, v colwise, o rowwise, the router replicated,
    the experts' split with their ffn and the down bias added once) and the experts' fused layout over tp; the
    experts and their biases over ep: two SGD steps' losses and every gradient by name equal one process's."""
    from tessera.testing import assert_layouts_equivalent
    from tessera.topology.layout import Layout

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, 25), generator=g)  # 24 positions: beyond the window of 8
    assert_layouts_equivalent(build_tiny, [Layout(**layout)], batch=(tokens[:, :-1], tokens[:, 1:]), spec=GPT_OSS)


# ----------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    "preset, total, active", [("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)]
)
def test_the_presets_have_the_published_sizes(preset, total, active):
    """OpenAI's model card: 20.91 B parameters, 3.61 B active per token (the unembedding counted, the
    embedding not); 116.83 B and 5.13 B. The shape counts every parameter the model holds."""
    cfg = GPT_OSS.config(preset)
    shape = GPT_OSS.shape(cfg)
    assert shape.num_params() == pytest.approx(total, rel=0.02)
    assert shape.matmul_params() == pytest.approx(active, rel=0.02)
    assert shape.num_params() == sum(p.numel() for p in GPT_OSS.build_model(cfg, device="meta").parameters())
    assert cfg.attention_types[:2] == ("sliding_attention", "full_attention") and cfg.sliding_window == 128
    # another depth keeps the layers alternating; layer_types of its own are kept as given
    assert GPT_OSS.config(preset, n_layers=3).attention_types[2] == "sliding_attention"
    full = GptOssConfig(**{**TINY, "layer_types": ["full_attention"] * 3})
    assert full.layer_types == ("full_attention",) * 3
    assert [layer.self_attn.core.window for layer in GPT_OSS.build_model(full, device="meta").layers.values()] == [
        None
    ] * 3


def test_a_ranks_parameter_shapes_add_up_to_the_block():
    """The planner's per-rank shapes of a gpt-oss block (biases, sinks, the router's bias, the experts' biases)
    on tp and ep: tp x ep ranks hold the block, plus what every tp rank holds whole."""
    from tessera.topology.shapes import expert_param_shapes, layer_param_shapes

    shape = GPT_OSS.shape(GptOssConfig(**TINY))
    assert sum(r * c for r, c in layer_param_shapes(shape, 1)) == shape.block_params()
    model = GPT_OSS.build_model(GptOssConfig(**TINY), device="meta")
    assert shape.block_params() == sum(p.numel() for p in model.layers["0"].parameters())
    tp, ep = 2, 4
    one = sum(r * c for r, c in expert_param_shapes(shape, tp, ep))
    experts = sum(p.numel() for p in model.layers["0"].mlp.experts.parameters())
    down_bias = shape.n_experts * shape.dim  # whole on every tp rank
    assert ep * tp * one == experts + (tp - 1) * down_bias
    # tp: every tp rank holds the norms, o's bias, the router and its bias whole; the rest is split
    whole = 2 * shape.dim + shape.dim + shape.n_experts * (shape.dim + 1)
    block = sum(r * c for r, c in layer_param_shapes(shape, tp, ep, experts=False))
    assert tp * block == shape.block_params() - experts + (tp - 1) * whole


def test_the_grouped_gemm_path_runs_the_fused_layout_and_its_biases_as_the_loop_does():
    """torch._grouped_mm (here its CPU form, in bf16 as on the GPUs) on transformers' (in, out) fused
    gate_up and down weights with the experts' biases: the outputs and gradients of the per-expert loop."""
    block = GPT_OSS.build_model(GptOssConfig(**TINY), seed=6).layers["1"].mlp.to(torch.bfloat16)
    _drawn(block, 8)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    runs = []
    for grouped in (False, True):
        block.zero_grad()
        block.experts.use_grouped_mm = grouped
        out = block(x)
        out.float().square().sum().backward()
        assert block.experts.ran_grouped_mm == grouped
        runs.append((out.detach().float(), {n: p.grad.float() for n, p in block.named_parameters()}))
    (loop, loop_grads), (gemm, gemm_grads) = runs
    _close(gemm, loop, 1e-2)  # bf16: the two paths may round the sums differently
    for name, grad in loop_grads.items():
        _close(gemm_grads[name], grad, 1e-2)
