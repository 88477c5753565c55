"""The ring merges' counted bytes (topology/estimators/ring_merge.py): tessera's count checked against the
bytes its own ring's operators read and write (parallel/context.py, run on one process with the attention
kernels and the passes stubbed out as a GPU runs them), and the counts' properties for every implementation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.parallel import context
from tessera.parallel.zigzag import pack
from tessera.topology.estimators.ring_merge import RING_MERGES, ring_merge_bytes

B, HQ, HKV, T, D = 1, 2, 1, 12, 16  # T: one rank's tokens (two zigzag chunks of 6)
SMALL = 64  # tensors of fewer elements are the lse's and the merge weights' (1 / D of the rest): not counted
FREE = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "expand", "alias", "as_strided", "t", "split",
        "split_with_sizes", "transpose", "permute", "detach", "unbind", "squeeze", "chunk", "reshape"}  # fmt: skip


def tensors(values) -> list[torch.Tensor]:
    """The tensors among `values`, those in lists (torch.cat's inputs) too."""
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found += tensors(v)
    return found


class CountBytes(TorchDispatchMode):
    """The bytes every data-moving operator reads and writes (its tensor inputs and outputs of at least SMALL
    elements); a copy_ reads its source and writes its destination once. `paused`: the attention kernels'."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or name in FREE:
            return out
        ins, outs = tensors([*args, *(kwargs or {}).values()]), tensors([out])
        if name == "copy_":
            dst, src = ins[0], ins[1]
            if (dst.data_ptr(), dst.stride(), dst.shape) == (src.data_ptr(), src.stride(), src.shape):
                return out  # `x[rows] += y` writes the view back onto itself: torch's copy_ returns at once
            ins, outs = [src], [dst]
        self.bytes += sum(t.numel() * t.element_size() for t in [*ins, *outs] if t.numel() >= SMALL)
        return out


@pytest.fixture
def gpu_like_ring(monkeypatch):
    """tessera's ring on one process as it runs on a GPU: bf16 block inputs kept (no CPU upcast), the
    kernels' outputs in bf16, each step's K/V and dK/dV pass handing back what it was given; returns the
    byte counter, whose count pauses inside the kernels."""
    counter = CountBytes()
    real_forward, real_backward = context.flash_attention, context.flash_attention_backward

    def paused(real, to_bf16):
        def kernel(*args, **kwargs):
            counter.paused = True
            try:
                up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                result = real(*up, **kwargs)
                return tuple(r.to(torch.bfloat16) if i in to_bf16 else r for i, r in enumerate(result))
            finally:
                counter.paused = False

        return kernel

    class Handback:
        def __init__(self, tensor, *args):
            self.tensor = tensor

        def wait(self):
            return self.tensor

    monkeypatch.setattr(context, "flash_attention", paused(real_forward, {0}))
    monkeypatch.setattr(context, "flash_attention_backward", paused(real_backward, {0, 1, 2}))
    monkeypatch.setattr(context, "_block_inputs", lambda t, acc: t)
    monkeypatch.setattr(context, "_RingPass", Handback)
    return counter


def ring_bytes(counter: CountBytes, position: int, size: int, monkeypatch) -> tuple[int, int]:
    """(forward, backward) bytes of the ring at one position of `size` ranks."""
    torch.manual_seed(position)
    q, out_grad = (torch.randn(B, HQ, T, D, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, HKV, T, D, dtype=torch.bfloat16) for _ in range(2))
    plans = [context._ring_plan(r, size, True, T) for r in range(size)]
    mask = context.RingMask()
    with counter:
        kv = pack(k, v)
        out, lse = context._ring_forward(q, k, v, [kv] * size, position, size, plans[position], D**-0.5, mask)
    forward, counter.bytes = counter.bytes, 0
    monkeypatch.setattr(context.dist, "get_rank", lambda group=None: position)
    monkeypatch.setattr(context.dist, "get_world_size", lambda group=None: size)
    monkeypatch.setattr(context, "_ring_kvs", lambda kv, group, n, what, timeout: iter([kv] * n))
    with counter:
        context._ring_backward(q, k, v, out, lse, out_grad, None, None, D**-0.5, None, plans, mask)
    backward, counter.bytes = counter.bytes, 0
    return forward, backward


@pytest.mark.parametrize("size", [2, 4, 8])
def test_tessera_count_is_the_bytes_its_ring_moves_averaged_over_the_ranks(size, gpu_like_ring, monkeypatch):
    counted = [ring_bytes(gpu_like_ring, r, size, monkeypatch) for r in range(size)]
    fwd, bwd = ring_merge_bytes("tessera", size, HQ * D, HKV * D, dtype_bytes=2)
    assert math.isclose(sum(f for f, _ in counted) / size, fwd * B * T, rel_tol=1e-9)
    assert math.isclose(sum(b for _, b in counted) / size, bwd * B * T, rel_tol=1e-9)


def test_one_rank_merges_nothing_and_an_unknown_ring_is_refused():
    assert all(ring_merge_bytes(m, 1, 4096, 1024) == (0.0, 0.0) for m in RING_MERGES)
    with pytest.raises(ValueError, match="cp_merge='ring'"):
        ring_merge_bytes("ring", 2, 4096, 1024)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(RING_MERGES),
    st.integers(2, 16),
    st.sampled_from([64, 512, 4096]),
    st.sampled_from([64, 512, 4096]),
    st.sampled_from([2, 4]),
)
def test_merges_grow_with_cp_and_the_widths_and_fused_kernels_move_the_least(merge, cp, q, kv, e):
    fwd, bwd = ring_merge_bytes(merge, cp, q, kv, e)
    more_cp = ring_merge_bytes(merge, cp + 1, q, kv, e)
    wider = ring_merge_bytes(merge, cp, 2 * q, kv, e)
    assert 0 < fwd < more_cp[0] and 0 < bwd < more_cp[1]
    assert wider[0] > fwd and wider[1] > bwd
    fused = ring_merge_bytes("fused", cp, q, kv, e)
    assert fused[0] + fused[1] <= fwd + bwd + 1e-9
