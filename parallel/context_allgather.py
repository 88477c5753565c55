"""All-gather context parallel attention: K/V (and document ids) gathered once per layer, dK/dV
reduce-scattered home (Llama 3's choice for few kv heads); the ring's result by another route."""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

from tessera.kernels import apply_sinks, flash_attention, flash_attention_backward
from tessera.kernels.attention_mask import AttentionMask
from tessera.kernels.checks import check_sinks, check_window

from .comm import collective
from .context_simulated import SIMULATED_DOCUMENTS, simulated_allgather_backward, simulated_allgather_forward
from .local_world import simulated_world
from .tensor import _all_gather_flat, _reduce_scatter_flat
from .zigzag import SEQ_DIM, documents_meet, gather_documents, merge_partial, pack, unpack, zigzag_shard, zigzag_unshard


def _allgather_blocks(
    rank: int, size: int, causal: bool, local: int, seq: int, window: int | None = None
) -> list[tuple[slice, slice, bool]]:
    """(query rows, key positions, causal) blocks of a rank's queries over the gathered sequence: each
    query chunk sees the keys before it (one unmasked block) and its own chunk (causal, on the diagonal).
    With a window, one causal block per query chunk over the keys from the first its window reaches to its
    own last (bottom-right aligned, so the window applies as is; the keys before are never read)."""
    if not causal:
        return [(slice(0, local), slice(0, seq), False)]
    chunk, blocks = local // 2, []
    for half, index in ((0, rank), (1, 2 * size - 1 - rank)):
        rows = slice(half * chunk, (half + 1) * chunk)
        if window is not None:
            blocks.append((rows, slice(max(0, index * chunk - window + 1), (index + 1) * chunk), True))
            continue
        if index > 0:
            blocks.append((rows, slice(0, index * chunk), False))
        blocks.append((rows, slice(index * chunk, (index + 1) * chunk), True))
    return blocks


def _rank_forward(q, full_k, full_v, rank, size, causal, scale, mask: AttentionMask):
    """(out, lse, blocks) of the rank at cp position `rank` of `size`: its queries over the gathered K/V, under
    `mask` (its queries' and the gathered keys' document ids, the window)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros((*q.shape[:3], full_v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    blocks = _allgather_blocks(rank, size, causal, q.shape[SEQ_DIM], full_k.shape[SEQ_DIM], mask.window)
    docs, full_docs = mask.q_docs, mask.k_docs
    if docs is not None and full_docs is not None:  # blocks whose queries share no document with their keys: skipped
        meets = torch.stack([documents_meet(docs[:, rows], full_docs[:, cols]) for rows, cols, _ in blocks]).tolist()
        blocks = [block for block, meet in zip(blocks, meets) if meet]
    for rows, cols, block_causal in blocks:
        o_b, lse_b = flash_attention(
            q[:, :, rows],
            full_k[:, :, cols],
            full_v[:, :, cols],
            causal=block_causal,
            scale=scale,
            return_lse=True,
            **mask.block(rows, cols).kwargs(),
        )
        out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
    return out.to(q.dtype), lse, blocks


def _rank_backward(q, full_k, full_v, out, lse, dout, dlse, blocks, size, scale, mask: AttentionMask):
    """(dq, every cp rank's packed zigzag share of this rank's dK/dV, in rank order): what its reduce-scatter
    sends (in fp32)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dfull_k = torch.zeros(full_k.shape, dtype=acc, device=q.device)
    dfull_v = torch.zeros(full_v.shape, dtype=acc, device=q.device)
    for rows, cols, block_causal in blocks:
        dq_b, dk_b, dv_b = flash_attention_backward(
            dout[:, :, rows],
            q[:, :, rows],
            full_k[:, :, cols],
            full_v[:, :, cols],
            out[:, :, rows],
            lse[:, :, rows],
            None if dlse is None else dlse[:, :, rows],
            causal=block_causal,
            scale=scale,
            **mask.block(rows, cols).kwargs(),
        )
        dq[:, :, rows] += dq_b.to(acc)
        dfull_k[:, :, cols] += dk_b.to(acc)
        dfull_v[:, :, cols] += dv_b.to(acc)
    shares = torch.cat(
        [pack(zigzag_shard(dfull_k, SEQ_DIM, r, size), zigzag_shard(dfull_v, SEQ_DIM, r, size)) for r in range(size)]
    )
    return dq.to(q.dtype), shares


def _local_kv(mine: Tensor, full_k: Tensor, full_v: Tensor, local: int) -> tuple[Tensor, Tensor]:
    """This rank's dK and dV from its reduced share (the full shapes with its `local` positions)."""
    dk, dv = unpack(
        mine,
        torch.Size((*full_k.shape[:2], local, full_k.shape[3])),
        torch.Size((*full_v.shape[:2], local, full_v.shape[3])),
    )
    return dk, dv


class _AllGatherAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, mask: AttentionMask):
        ctx.set_materialize_grads(False)
        ctx.group, ctx.scale, ctx.mask, ctx.causal = group, scale, mask, causal
        ctx.simulated = simulated_world() is not None
        if ctx.simulated:  # every rank of every cp group here, each over its group's gathered K/V
            if mask.q_docs is not None:
                raise ValueError(SIMULATED_DOCUMENTS)
            out, lse = simulated_allgather_forward(q, k, v, group, causal, scale, mask, _rank_forward)
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        kv = pack(k, v)
        gathered = kv.new_empty((size * kv.numel(),))
        with collective("all_gather (K/V)", "cp", group):
            _all_gather_flat(gathered, kv, group=group)
        shards = [unpack(part, k.shape, v.shape) for part in gathered.view(size, -1).unbind(0)]
        full_k = zigzag_unshard([ks for ks, _ in shards], dim=SEQ_DIM)  # sequence order
        full_v = zigzag_unshard([vs for _, vs in shards], dim=SEQ_DIM)
        out, lse, ctx.blocks = _rank_forward(q, full_k, full_v, rank, size, causal, scale, mask)
        ctx.save_for_backward(q, full_k, full_v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if ctx.simulated:
            q, k, v, out, lse = ctx.saved_tensors
            dout = torch.zeros_like(out) if dout is None else dout
            rank_args = (ctx.causal, ctx.scale, ctx.mask)
            dq, dk, dv = simulated_allgather_backward(
                q, k, v, out, lse, dout, dlse, ctx.group, rank_args, _allgather_blocks, _rank_backward, _local_kv
            )
            return dq, dk, dv, None, None, None, None
        q, full_k, full_v, out, lse = ctx.saved_tensors
        group, size = ctx.group, dist.get_world_size(ctx.group)
        dout = torch.zeros_like(out) if dout is None else dout
        dq, shares = _rank_backward(q, full_k, full_v, out, lse, dout, dlse, ctx.blocks, size, ctx.scale, ctx.mask)
        # every rank's zigzag share of dK/dV, summed over the ranks onto its owner (in fp32)
        mine = shares.new_empty(shares.shape[0] // size)
        with collective("reduce_scatter (dK/dV)", "cp", group):
            _reduce_scatter_flat(mine, shares, group=group)
        dk, dv = _local_kv(mine, full_k, full_v, q.shape[SEQ_DIM])
        return dq, dk.to(full_k.dtype), dv.to(full_v.dtype), None, None, None, None


@overload
def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[False] = ...,
    docs: Tensor | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
) -> Tensor: ...
@overload
def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    causal: bool = ...,
    scale: float | None = ...,
    *,
    return_lse: Literal[True],
    docs: Tensor | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...
@overload
def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: bool = ...,
    docs: Tensor | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...
def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    docs: Tensor | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """ring_attention's result with K/V gathered once per layer (one all-gather forward, one
    reduce-scatter of dK/dV backward): each query chunk attends the keys before it in one unmasked block
    and its own chunk causally, so no masked work beyond the diagonal. Packed documents (`docs`, as in
    ring_attention): the ids are gathered with K/V, and blocks no query sees are skipped. A sliding `window`:
    each query chunk reads only the keys its window reaches. `sinks` (Hq,) join the merged softmax once."""
    check_window(window, causal)
    check_sinks(sinks, q)
    full_docs = None
    if docs is not None:
        gathered = gather_documents(docs, group)
        full_docs = zigzag_unshard(list(gathered.unbind(0)), dim=1)  # sequence order
    mask = AttentionMask(docs, full_docs, window)
    out, lse = _AllGatherAttention.apply(q, k, v, group, causal, scale, mask)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out
