"""The cp ring in a simulated world (torch's LocalTensorMode: every rank's tensors held in this one process,
runtime/training/simulated.py). A real ring passes K/V forward, and K/V with the dK/dV accumulators backward,
by send/recv, which LocalTensorMode takes only in a thread per rank. Here no message is sent: every rank of
every cp group computes its ring steps on its own tensors, with the K/V its ring would have handed it at each
step (rank i - step's: K/V travel unchanged), and each block's dK/dV accumulator is summed in the order the
ring visits its holders (its owner first, then the next rank, ...), as the real passes would sum it. The
arithmetic of a step is context.py's (`rank_forward`, `rank_shares`), with each rank's own ring plan, so a
simulated rank computes what a real one does.

All-gather attention (context_allgather.py) likewise: each rank attends over its group's K/V in sequence order
(what the all-gather hands every member), and each rank's dK/dV is the sum of every member's share of it in
rank order, as the reduce-scatter adds them.

Packed documents are refused here (SIMULATED_DOCUMENTS): their plan needs every rank's document ids first."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from .local_world import group_members, simulated_world
from .zigzag import SEQ_DIM, pack, unpack, zigzag_unshard

SIMULATED_DOCUMENTS = (
    "packed documents under cp are not simulated yet (a ring plan reads every rank's document ids): prove "
    "them on real ranks (tessera.testing, tests/test_contract.py)"
)


def _of(t: Tensor | None, rank: int) -> Tensor | None:
    return None if t is None else t._local_tensors[rank]  # type: ignore[attr-defined]


def _every_group(group: Any, per_group: Callable[[list[int]], dict[int, tuple]], outputs: int) -> tuple:
    """The loop every simulated cp path shares: `per_group(members)` (each member's outputs by global rank) run
    for every cp group with the world's dispatch off (plain tensors: each rank's own), and each of the
    `outputs` returned as one simulated tensor holding every rank's."""
    world = simulated_world()
    results: dict[int, tuple] = {}
    with world.disable():
        for members in group_members(group):
            results.update(per_group(members))
        return tuple(world.rank_map(lambda r, n=n: results[r][n]) for n in range(outputs))


def simulated_ring_forward(
    q: Tensor, k: Tensor, v: Tensor, group: Any, rank_forward: Callable[..., tuple[Tensor, Tensor]]
) -> tuple[Tensor, Tensor]:
    """(out, lse) of every simulated rank: `rank_forward(position, size, q, k, v, kvs)` on each rank's own
    tensors, `kvs` its group's packed K/V by ring position."""

    def per_group(members: list[int]) -> dict[int, tuple]:
        kvs = [pack(k._local_tensors[r], v._local_tensors[r]) for r in members]  # type: ignore[attr-defined]
        return {r: rank_forward(i, len(members), _of(q, r), _of(k, r), _of(v, r), kvs) for i, r in enumerate(members)}

    return _every_group(group, per_group, 2)  # type: ignore[return-value]


def simulated_ring_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    group: Any,
    rank_shares: Callable[..., tuple[Tensor, list]],
    add_shares: Callable[..., None],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of every simulated rank. `rank_shares(position, size, q, k, v, out, lse, dout, dlse, kvs)`
    gives a rank's dq and, per ring step, its dK/dV shares of the block it held; block j's accumulator then
    sums the shares of its holders in ring order (rank j at step 0, rank j + 1 at step 1, ...), as the
    real ring passes it on, with `add_shares(dkv, shares, k, v, acc)`."""

    def per_group(members: list[int]) -> dict[int, tuple]:
        size = len(members)
        kvs = [pack(k._local_tensors[r], v._local_tensors[r]) for r in members]  # type: ignore[attr-defined]
        dqs, shares = {}, {}
        for i, r in enumerate(members):
            tensors = (_of(t, r) for t in (q, k, v, out, lse, dout, dlse))
            dqs[i], shares[i] = rank_shares(i, size, *tensors, kvs)
        acc = torch.promote_types(q.dtype, torch.float32)
        grads = {}
        for j, r in enumerate(members):
            k_r, v_r = _of(k, r), _of(v, r)
            dkv = torch.zeros(kvs[j].shape, dtype=acc, device=kvs[j].device)
            for step in range(size):
                add_shares(dkv, shares[(j + step) % size][step], k_r, v_r, acc)
            dk, dv = unpack(dkv, k_r.shape, v_r.shape)  # type: ignore[union-attr]
            grads[r] = (dqs[j], dk.to(k.dtype), dv.to(v.dtype))
        return grads

    return _every_group(group, per_group, 3)  # type: ignore[return-value]


def _gathered(k: Tensor, v: Tensor, members: list[int]) -> tuple[Tensor, Tensor]:
    """A cp group's K and V in sequence order: what the all-gather hands each of its members."""
    full_k = zigzag_unshard([k._local_tensors[r] for r in members], dim=SEQ_DIM)  # type: ignore[attr-defined]
    full_v = zigzag_unshard([v._local_tensors[r] for r in members], dim=SEQ_DIM)  # type: ignore[attr-defined]
    return full_k, full_v


def simulated_allgather_forward(
    q: Tensor, k: Tensor, v: Tensor, group: Any, causal: bool, scale: Any, mask: Any, rank_forward: Callable
) -> tuple[Tensor, Tensor]:
    """(out, lse) of every simulated rank: `rank_forward(q, full_k, full_v, position, size, causal, scale,
    mask)` on each rank's queries over its group's gathered K/V (`mask`: the window alone; no documents)."""

    def per_group(members: list[int]) -> dict[int, tuple]:
        full_k, full_v = _gathered(k, v, members)
        size = len(members)
        return {
            r: rank_forward(_of(q, r), full_k, full_v, i, size, causal, scale, mask)[:2] for i, r in enumerate(members)
        }

    return _every_group(group, per_group, 2)  # type: ignore[return-value]


def simulated_allgather_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    group: Any,
    rank_args: tuple,
    rank_blocks: Callable,
    rank_backward: Callable,
    local_kv: Callable,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of every simulated rank: each member's blocks (`rank_blocks(position, size, causal, local,
    seq, window)`, as its forward ran them; rank_args: (causal, scale, mask)) give its dq and every member's
    share of its dK/dV; a rank's dK/dV is its shares summed over the members in rank order."""
    causal, scale, mask = rank_args

    def per_group(members: list[int]) -> dict[int, tuple]:
        size = len(members)
        full_k, full_v = _gathered(k, v, members)
        dqs, shares = {}, {}
        for i, r in enumerate(members):
            q_r = _of(q, r)
            blocks = rank_blocks(i, size, causal, q_r.shape[SEQ_DIM], full_k.shape[SEQ_DIM], mask.window)  # type: ignore[union-attr]
            tensors = (q_r, full_k, full_v, _of(out, r), _of(lse, r), _of(dout, r), _of(dlse, r), blocks)
            dqs[i], shares[i] = rank_backward(*tensors, size, scale, mask)
        grads = {}
        for j, r in enumerate(members):
            mine = sum(shares[i].chunk(size)[j] for i in range(size))
            dk, dv = local_kv(mine, full_k, full_v, _of(q, r).shape[SEQ_DIM])  # type: ignore[union-attr]
            grads[r] = (dqs[j], dk.to(k.dtype), dv.to(v.dtype))
        return grads

    return _every_group(group, per_group, 3)  # type: ignore[return-value]
