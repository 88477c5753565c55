"""Sibling linear layers share their input's FP8 cast in an eager step (parallel/fp8_shared_casts.py), and an
RMSNorm's output carries its row amaxes to the cast (kernels/fp8_amax.py): the same bits as every layer casting
for itself, fewer casts and fewer amax reductions, counted here; a cast is found again only for the same,
unchanged tensor."""

import gc
import os

import pytest
import torch

from helpers import NEEDS_TORCHAO

pytestmark = NEEDS_TORCHAO

from tessera.kernels.fp8_amax import attach_row_amax, row_amax  # noqa: E402
from tessera.parallel.fp8 import FP8_RECIPES, Float8Matmul, apply_fp8, float8_config, float8_matmuls  # noqa: E402
from tessera.parallel.fp8_shared_casts import CastShare  # noqa: E402

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton RMSNorm runs on CPU under TRITON_INTERPRET=1"
)


class Counts:
    """The one-pass casts and full amax reductions an FP8 step runs (parallel/fp8.py calls both by attribute)."""

    def __init__(self, monkeypatch):
        import tessera.kernels.triton_fp8_cast as cast_module

        self.casts = self.amaxes = 0
        cast, norm = cast_module.scaled_cast_fp8, torch.linalg.vector_norm

        def counted_cast(*args, **kwargs):
            self.casts += 1
            return cast(*args, **kwargs)

        def counted_norm(*args, **kwargs):
            self.amaxes += 1
            return norm(*args, **kwargs)

        monkeypatch.setattr(cast_module, "scaled_cast_fp8", counted_cast)
        monkeypatch.setattr(torch.linalg, "vector_norm", counted_norm)


def _siblings(x, weights, grads, recipe, share):
    """q, k, v of one input, each its own Float8Matmul (one share between them, or none), and their gradients."""
    config = float8_config(recipe, emulate=True)
    outs = [Float8Matmul(config, fused_cast=True, share=share, siblings=len(weights))(x, w) for w in weights]
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, grads))
    return outs, torch.autograd.grad(loss, (x, *weights))


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 24, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    weights = [(torch.randn(n, 64, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_() for n in (64, 32, 32)]
    grads = [torch.randn(2, 24, n, generator=gen).to(torch.bfloat16) for n in (64, 32, 32)]
    return x, weights, grads


# per recipe: (casts, full amaxes) of three siblings' forward and backward, each for itself and sharing. Each
# layer casts 6 operands (input, weight; output gradient twice, weight, input); sharing, the input is cast once
# in the forward and once in the backward (4 fewer); its amax is found once under tensorwise (the backward
# reuses the forward's: 5 fewer), once per direction under rowwise (per token, then per feature: 4 fewer)
EXPECTED = {"tensorwise": ((18, 18), (14, 13)), "rowwise": ((18, 18), (14, 14))}


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_siblings_share_their_input_cast_at_the_same_bits(recipe, monkeypatch):
    x, weights, grads = _case()
    counts = Counts(monkeypatch)
    runs = []
    for share in (None, CastShare()):
        counts.casts = counts.amaxes = 0
        runs.append((*_siblings(x, weights, grads, recipe, share), (counts.casts, counts.amaxes), share))
    (outs0, grads0, counted0, _), (outs1, grads1, counted1, share) = runs
    assert all(torch.equal(a, b) for a, b in zip(outs0, outs1))
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))  # dx, and every weight's gradient
    assert (counted0, counted1) == EXPECTED[recipe]
    assert share.hits == 4 and share.made == 2 and len(share) == 0  # the last reader took each out


@interpreted
@pytest.mark.parametrize("producer", ["rmsnorm", "swiglu"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_a_producer_kernel_brings_its_outputs_amax_to_the_cast(recipe, producer, monkeypatch):
    """The Triton RMSNorm and SwiGLU note each row's max |y|: under tensorwise the input's amax is their max,
    under rowwise the rows themselves, so the forward reads its input once (the cast) instead of twice."""
    from tessera.kernels.triton_rmsnorm import rms_norm
    from tessera.kernels.triton_swiglu import swiglu

    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, 24, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    other = (1 + 0.1 * torch.randn(64 if producer == "rmsnorm" else (2, 24, 64), generator=gen)).to(torch.bfloat16)
    _, weights, grads = _case(5)
    counts = Counts(monkeypatch)
    results = []
    for seeded in (False, True):
        x = rms_norm(h, other) if producer == "rmsnorm" else swiglu(h, other)
        if not seeded:
            x = x.clone()  # a tensor no kernel noted anything on
        counts.casts = counts.amaxes = 0
        results.append((_siblings(x, weights, grads, recipe, CastShare())[0], counts.amaxes))
    (outs0, amaxes0), (outs1, amaxes1) = results
    assert all(torch.equal(a, b) for a, b in zip(outs0, outs1))
    assert amaxes0 - amaxes1 == 1  # the forward's amax of the input came with it


@interpreted
def test_the_rmsnorm_row_amax_is_torchs_amax_of_its_output_nan_included():
    from tessera.kernels.triton_rmsnorm import rms_norm

    gen = torch.Generator().manual_seed(6)
    h = torch.randn(5, 40, generator=gen).to(torch.bfloat16)
    h[3, 7] = float("nan")
    y = rms_norm(h, torch.ones(40, dtype=torch.bfloat16))
    rows = row_amax(y)
    want = y.float().abs().amax(dim=-1, keepdim=True)
    assert rows is not None and rows.dtype == y.dtype and rows.shape == (5, 1)
    assert torch.equal(rows[[0, 1, 2, 4]].float(), want[[0, 1, 2, 4]]) and torch.isnan(rows[3]).all()
    y.mul_(2)  # an in-place change voids what the kernel noted
    assert row_amax(y) is None


def test_a_cast_is_found_again_only_for_the_same_unchanged_tensor():
    share = CastShare(capacity=2)
    a = torch.ones(4, 4)
    share.put(a, ("k",), "cast of a", uses=2)
    assert share.get(a, ("k",)) == "cast of a" and share.get(a, ("other",)) is None
    a.add_(1)  # changed in place: its cast is not it any more
    assert share.get(a, ("k",)) is None and len(share) == 0
    share.put(a, ("k",), "cast of a now", uses=2)
    assert [share.get(a, ("k",)) for _ in range(3)] == ["cast of a now"] * 2 + [None]  # its two readers, then gone
    b = torch.ones(4, 4)
    share.put(b, ("k",), "cast of b", uses=1)
    address = id(b)
    del b
    gc.collect()
    c = torch.ones(4, 4)  # may take b's id: it is still not b
    assert id(c) != address or share.get(c, ("k",)) is None
    for n in range(3):  # past capacity the oldest goes
        share.put(c, (n,), n, uses=1)
    assert share.get(c, (0,)) is None and share.get(c, (2,)) == 2
    with pytest.raises(ValueError, match="CastShare: capacity=0 must be at least 1"):
        CastShare(capacity=0)
    with pytest.raises(ValueError, match=r"attach_row_amax: row_amax shape \(4,\) for a tensor of \(4, 4\)"):
        attach_row_amax(torch.ones(4, 4), torch.ones(4))


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_a_model_sharing_its_casts_trains_as_one_that_does_not(recipe):
    """apply_fp8 gives the model's layers one share: with the one-pass cast forced on (as on CUDA in eager), the
    loss and every gradient equal those of the same model whose layers each cast for themselves."""
    from tessera.models.spec import get_preset, spec_of

    cfg = get_preset("debug")
    spec = spec_of(cfg)
    results = []
    for shared in (True, False):
        torch.manual_seed(0)
        model = spec.build_model(cfg).to(torch.bfloat16)
        apply_fp8(model, recipe, spec, emulate=True)
        matmuls = float8_matmuls(model)
        shares = {id(m.share) for m in matmuls.values()}
        assert len(shares) == 1 and None not in {m.share for m in matmuls.values()}
        for m in matmuls.values():
            m.fused_cast = True
            if not shared:
                m.share = None
        tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        share = next(iter(matmuls.values())).share
        # per block: q, k, v share the normed input twice (forward, backward), gate and up once each way
        assert share is None or (share.hits == cfg.n_layers * (2 * 2 + 2 * 1) and len(share) == 0)
        siblings = [m.siblings for m in matmuls.values()]  # per block: wo, w2 alone; w1, w3; wq, wk, wv
        assert sorted(siblings) == sorted([1, 1, 2, 2, 3, 3, 3] * cfg.n_layers)
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[n], grads1[n]) for n in grads0)


@interpreted
def test_inference_tensors_are_left_unnoted_and_cast_for_each_layer():
    """torch.inference_mode's tensors track no version: the kernels note nothing on them and the matmuls share
    nothing, and both still run (a generation's forward)."""
    from tessera.kernels.triton_rmsnorm import rms_norm
    from tessera.kernels.triton_swiglu import swiglu

    x, weights, _ = _case(8)
    config = float8_config("tensorwise", emulate=True)
    with torch.inference_mode():
        y = rms_norm(x.detach(), torch.ones(64, dtype=torch.bfloat16))
        h = swiglu(y, y)
        assert row_amax(y) is None and row_amax(h) is None
        share = CastShare()
        outs = [Float8Matmul(config, fused_cast=True, share=share, siblings=3)(y, w.detach()) for w in weights]
    want = [Float8Matmul(config, fused_cast=True)(y.clone(), w.detach()) for w in weights]
    assert share.made == 0 and all(torch.equal(a, b) for a, b in zip(outs, want))
