"""Context parallel over the "cp" axis: each rank holds a slice of every sequence; attention sees it all.

    zigzag_shard / zigzag_unshard   the sequence cut into 2*cp chunks; rank i keeps chunks i and 2*cp-1-i
    ring_attention                  K/V blocks travel the ring; partial results merge by log-sum-exp
    allgather_attention             K/V gathered once per layer (Llama 3's choice for few kv heads)
    apply_cp                        puts one of them in every attention slot the model's spec names

Why zigzag: under a causal mask, the queries late in the sequence see more keys. Contiguous chunks
would give the last rank cp times the first one's work; chunk i paired with chunk 2*cp-1-i gives every
rank the same. Positions travel with the tokens, so RoPE rotates each token at its true place.

    seq of 8 chunks, cp = 4:   0 1 2 3 4 5 6 7
    rank 0 keeps 0 and 7, rank 1 keeps 1 and 6, rank 2 keeps 2 and 5, rank 3 keeps 3 and 4

Ring attention, causal: at step t a rank holds the K/V of rank src = rank - t (mod cp). Step 0 is its own
block, causal. When src < rank, both of its query chunks see all of src's first chunk and none of its
second; when src > rank, only its second query chunk sees src, all of it. So every step after the
first computes exactly half a block, never a masked full one (the ring-flash-attention zigzag rule).
The next block's send/receive is posted before the current block's attention and waited for after it.
Partial (out, lse) pairs merge in fp32: lse = logaddexp(lse, lse_b), out = out e^(lse_old-lse) +
out_b e^(lse_b-lse), rows that see nothing yet kept at 0. The backward recomputes each block's share from
the merged out and lse (the kernel's backward with a given lse), accumulates dq locally, and sends the
dk/dv accumulator around the ring with the K/V so that it arrives home with every rank's share.
Grouped-query K/V travel as kv heads, never repeated (K and V packed in one message: v's head dim may differ).

A sliding window splits each step into the pairs of this rank's two chunks and src's, each at its true
offset (the kernels' q_offset), runs only the pairs some query's window reaches and skips a step with none
(its K/V still pass on). Attention sinks join the merged softmax once, after the last step. The layout and
the merge live in zigzag.py, all-gather attention in context_allgather.py; both are named here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh

from tessera.kernels import apply_sinks, document_ids, flash_attention, flash_attention_backward
from tessera.kernels.attention_mask import AttentionMask
from tessera.kernels.checks import check_sinks, check_window
from tessera.models.spec import spec_of

from .comm import collective
from .context_allgather import allgather_attention
from .context_simulated import SIMULATED_DOCUMENTS, simulated_ring_backward, simulated_ring_forward
from .local_world import simulated_world
from .tp_plan import find_modules, replace_module
from .zigzag import (  # the layout and the merge, named here too (tessera.parallel.context is their public home)
    METHODS,
    SEQ_DIM,
    causal_pairs,
    check_context,
    documents_meet,
    gather_documents,
    merge_partial,
    pack,
    unpack,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "METHODS",
    "check_context",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
    "causal_pairs",
    "merge_partial",
    "ring_attention",
    "allgather_attention",
    "ContextParallelAttention",
    "apply_cp",
]


# ----------------------------------------------------------------------------- ring attention
def _half_blocks(step: int, rank: int, size: int, causal: bool, local: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) this rank computes at `step` with the K/V of rank - step: the
    zigzag rule (see the module docstring)."""
    every, chunk = slice(0, local), local // 2
    if not causal:
        return every, every, False
    src = (rank - step) % size
    if step == 0:
        return every, every, True
    if src < rank:
        return every, slice(0, chunk), False
    return slice(chunk, local), every, False


class _RingPass:
    """One asynchronous send to the next rank and receive from the previous one (a single batch)."""

    def __init__(self, tensor: Tensor, group: dist.ProcessGroup, what: str, timeout: timedelta | None):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.received = torch.empty_like(tensor)
        self.group, self.what, self.timeout = group, what, timeout
        with collective(f"ring {what} (post)", "cp", group):
            self.works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group),
                    dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % size), group),
                ]
            )

    def wait(self) -> Tensor:
        with collective(f"ring {self.what}", "cp", self.group):
            for work in self.works:
                work.wait() if self.timeout is None else work.wait(self.timeout)
        return self.received


Block = tuple[slice, slice, bool, "int | None"]  # (query rows, key rows, causal, q_offset: None is bottom-right)


@dataclass(frozen=True)
class RingMask:
    """The ring's attention mask as one value: a sliding `window` (tokens) and packed documents, `docs` this
    rank's tokens' ids and `all_docs` every cp rank's (both or neither); `at(src)`: the mask of the step that
    reads rank `src`'s K/V, which each block slices (AttentionMask.block)."""

    window: int | None = None
    docs: Tensor | None = None
    all_docs: Tensor | None = None

    def at(self, src: int) -> AttentionMask:
        keys = None if self.all_docs is None else self.all_docs[src]
        return AttentionMask(self.docs, keys, self.window)


def _window_blocks(step: int, rank: int, size: int, local: int, window: int) -> list[Block]:
    """A sliding window's blocks at `step`: one per (query chunk, key chunk) pair of this rank's two zigzag
    chunks and rank - step's, placed at their true positions (q_offset), and only those some query's window
    reaches (the rest of the step is skipped, not masked)."""
    chunk, src = local // 2, (rank - step) % size
    starts = lambda r: (r * chunk, (2 * size - 1 - r) * chunk)  # noqa: E731  the two chunks' first positions
    blocks = []
    for qi, qa in enumerate(starts(rank)):
        for ki, ka in enumerate(starts(src)):
            if ka > qa or qa - (ka + chunk - 1) >= window:  # after the queries, or beyond every query's window
                continue
            rows, cols = slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk)
            blocks.append((rows, cols, True, qa - ka))
    return blocks


def _ring_plan(
    rank: int,
    size: int,
    causal: bool,
    local: int,
    window: int | None = None,
    docs: Tensor | None = None,
    all_docs: Tensor | None = None,
) -> list[list[Block]]:
    """Per ring step, the blocks this rank computes with the K/V of rank - step: the zigzag halves (see the
    module docstring), or with a window its chunk pairs within reach. With packed documents a block in which
    every (query, key) pair lies in different documents is dropped too. A step with no block is skipped
    (its K/V still pass on)."""
    plan: list[list[Block]] = []
    for step in range(size):
        if window is None:
            rows, cols, block_causal = _half_blocks(step, rank, size, causal, local)
            plan.append([(rows, cols, block_causal, None)])
        else:
            plan.append(_window_blocks(step, rank, size, local, window))
    if docs is None or all_docs is None:
        return plan
    found = [
        (step, i)
        for step, blocks in enumerate(plan)
        for i, (_, _, block_causal, q_offset) in enumerate(blocks)
        if not (step == 0 and block_causal and not q_offset)  # a diagonal block: every query sees itself
    ]
    meets = torch.stack(
        [
            documents_meet(docs[:, plan[step][i][0]], all_docs[(rank - step) % size][:, plan[step][i][1]])
            for step, i in found
        ]
        or [torch.ones((), dtype=torch.bool)]
    ).tolist()  # one host sync for the whole layer
    dropped = {where for where, meet in zip(found, meets) if not meet}
    return [[b for i, b in enumerate(blocks) if (step, i) not in dropped] for step, blocks in enumerate(plan)]


def _block_inputs(t: Tensor, acc: torch.dtype) -> Tensor:
    """A block's attention input: as it is on CUDA (the kernel's tensor cores take bf16; its block results come
    back in bf16 before the fp32 merge, as in ring-flash-attention), but upcast to `acc` elsewhere, where the
    attention computes in fp32 anyway (the torch reference upcasts its inputs): the block's output and
    gradients then reach the fp32 merge unrounded, and cp rounds attention once, as one process does."""
    return t if t.is_cuda else t.to(acc)


def _forward_blocks(qb, kv, k, v, acc, blocks, out, lse, scale, mask: RingMask, src) -> None:
    """One ring step of the forward: this rank's `blocks` against the K/V `kv` of rank `src`, merged into
    (out, lse) in place."""
    k_s, v_s = (_block_inputs(t, acc) for t in unpack(kv, k.shape, v.shape))
    step_mask = mask.at(src)
    for rows, cols, block_causal, q_offset in blocks:
        o_b, lse_b = flash_attention(
            qb[:, :, rows],
            k_s[:, :, cols],
            v_s[:, :, cols],
            causal=block_causal,
            scale=scale,
            return_lse=True,
            **step_mask.block(rows, cols, q_offset).kwargs(),
        )
        out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows], o_b, lse_b)


def _backward_blocks(doutb, qb, outb, lse, dlse, kv, k, v, acc, blocks, dq, scale, mask: RingMask, src):
    """One ring step of the backward: dq of this rank's `blocks` against rank `src`'s K/V added in place;
    returns the step's (key rows, dk, dv) shares for src's accumulator."""
    k_s, v_s = (_block_inputs(t, acc) for t in unpack(kv, k.shape, v.shape))
    step_mask = mask.at(src)
    shares = []
    for rows, cols, block_causal, q_offset in blocks:
        dq_b, dk_b, dv_b = flash_attention_backward(
            doutb[:, :, rows],
            qb[:, :, rows],
            k_s[:, :, cols],
            v_s[:, :, cols],
            outb[:, :, rows],
            lse[:, :, rows],
            None if dlse is None else dlse[:, :, rows],
            causal=block_causal,
            scale=scale,
            **step_mask.block(rows, cols, q_offset).kwargs(),
        )
        dq[:, :, rows] += dq_b.to(acc)
        shares.append((cols, dk_b, dv_b))
    return shares


def _add_shares(dkv, shares, k, v, acc) -> None:
    """A step's dk/dv shares added to the accumulator of the block they belong to, in place."""
    dk_acc, dv_acc = unpack(dkv, k.shape, v.shape)
    for cols, dk_b, dv_b in shares:
        dk_acc[:, :, cols] += dk_b.to(acc)
        dv_acc[:, :, cols] += dv_b.to(acc)


def _ring_kvs(kv: Tensor, group: dist.ProcessGroup, size: int, what: str, timeout):
    """Each ring step's K/V on real ranks: the next block's send/receive is posted before the step computes
    (the caller runs between the yield and the wait) and waited for after it."""
    for step in range(size):
        ring = _RingPass(kv, group, what, timeout) if step + 1 < size else None  # overlaps the block
        yield kv
        if ring is not None:
            kv = ring.wait()


def _ring_forward(q, k, v, kvs, position, size, plan, scale, mask: RingMask):
    """(out, lse) of one rank's queries over the ring; `kvs` yields each step's K/V (rank position - step's)."""
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 merges (fp64 stays fp64)
    out = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    qb = _block_inputs(q, acc)
    for step, kv in enumerate(kvs):
        src = (position - step) % size
        _forward_blocks(qb, kv, k, v, acc, plan[step], out, lse, scale, mask, src)
    return out.to(q.dtype), lse


def _backward_state(q, out, dout):
    """(acc, dq, and the block inputs of q, out, dout) a rank's ring backward starts from."""
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    return (acc, dq, *(_block_inputs(t, acc) for t in (q, out, dout)))


class _RingAttention(Function):
    """`plans`: each ring position's blocks per step (this rank's alone on real ranks; every position's in a
    simulated world, where context_simulated.py runs every rank of every cp group here)."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, timeout, plans, mask: RingMask):
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None: the kernels' faster path
        if simulated_world() is not None:

            def rank_forward(i, size, q_r, k_r, v_r, kvs):  # step t's K/V: position i - t's, unchanged
                steps = (kvs[(i - step) % size] for step in range(size))
                return _ring_forward(q_r, k_r, v_r, steps, i, size, plans[i], scale, mask)

            out, lse = simulated_ring_forward(q, k, v, group, rank_forward)
        else:
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            kvs = _ring_kvs(pack(k, v), group, size, "K/V", timeout)  # one message a step; kv heads, never repeated
            out, lse = _ring_forward(q, k, v, kvs, rank, size, plans[rank], scale, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.timeout, ctx.plans, ctx.mask = group, scale, timeout, plans, mask
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        scale, plans, mask = ctx.scale, ctx.plans, ctx.mask
        if simulated_world() is None:
            dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, dlse, ctx.group, scale, ctx.timeout, plans, mask)
            return dq, dk, dv, None, None, None, None, None

        def rank_shares(i, size, q_r, k_r, v_r, out_r, lse_r, dout_r, dlse_r, kvs):
            acc, dq, qb, outb, doutb = _backward_state(q_r, out_r, dout_r)
            shares = []  # by step; context_simulated.py sums them in the ring's order of holders
            for step, blocks in enumerate(plans[i]):
                src = (i - step) % size
                args = (doutb, qb, outb, lse_r, dlse_r, kvs[src], k_r, v_r, acc, blocks, dq, scale, mask)
                shares.append(_backward_blocks(*args, src))
            return dq.to(q_r.dtype), shares

        dq, dk, dv = simulated_ring_backward(q, k, v, out, lse, dout, dlse, ctx.group, rank_shares, _add_shares)
        return dq, dk, dv, None, None, None, None, None


def _ring_backward(q, k, v, out, lse, dout, dlse, group, scale, timeout, plans, mask: RingMask):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    plan = plans[rank]
    acc, dq, qb, outb, doutb = _backward_state(q, out, dout)
    kv = pack(k, v)
    dkv_pass: _RingPass | None = None
    dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)
    for step, kv in enumerate(_ring_kvs(kv, group, size, "K/V (backward)", timeout)):
        src = (rank - step) % size
        shares = _backward_blocks(doutb, qb, outb, lse, dlse, kv, k, v, acc, plan[step], dq, scale, mask, src)
        # the dk/dv of the block held now: what the ranks before added, plus this rank's share
        if dkv_pass is not None:
            dkv = dkv_pass.wait()
        _add_shares(dkv, shares, k, v, acc)
        if size > 1:  # on to the next holder; home after `size` passes
            dkv_pass = _RingPass(dkv, group, "dK/dV", timeout)
    if dkv_pass is not None:
        dkv = dkv_pass.wait()
    dk, dv = unpack(dkv, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@overload
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[False] = ...,
    timeout: float | None = ...,
    docs: Tensor | None = ...,
    stats: dict | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
) -> Tensor: ...
@overload
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    causal: bool = ...,
    scale: float | None = ...,
    *,
    return_lse: Literal[True],
    timeout: float | None = ...,
    docs: Tensor | None = ...,
    stats: dict | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...
@overload
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: bool = ...,
    timeout: float | None = ...,
    docs: Tensor | None = ...,
    stats: dict | None = ...,
    window: int | None = ...,
    sinks: Tensor | None = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    timeout: float | None = None,
    docs: Tensor | None = None,
    stats: dict | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of this rank's zigzag queries over the whole sequence, whose K/V the cp ranks hold in
    zigzag shards: equals zigzag_shard(flash_attention(q, k, v, causal, window=window, sinks=sinks), dim=2) of
    the full tensors, forward and backward (lse included). q (B, Hq, S/cp, D); k (B, Hkv, S/cp, D), v (B, Hkv,
    S/cp, Dv).

    Packed documents: `docs` (B, S/cp) this rank's tokens' document ids (tessera.kernels.document_ids);
    each block is masked to its documents, and a step whose block no query sees is skipped, forward and
    backward. A sliding `window` (tokens, causal): each step runs the pairs of query and key chunks within
    reach, at their true positions, and a step with none is skipped (its K/V still pass on). `sinks` (Hq,)
    join the merged softmax once, after the last step. `stats` (a dict) counts the steps computed and skipped
    ("ring_steps", "ring_steps_skipped") when documents or a window can skip some."""
    check_window(window, causal)
    check_sinks(sinks, q)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    all_docs = None
    simulated = simulated_world() is not None
    if simulated:  # every ring position's plan: each simulated rank runs its own (context_simulated.py)
        if docs is not None:
            raise ValueError(SIMULATED_DOCUMENTS)
        plans = {i: _ring_plan(i, size, causal, q.shape[SEQ_DIM], window) for i in range(size)}
    else:
        if docs is not None:
            all_docs = gather_documents(docs, group)
        plans = {rank: _ring_plan(rank, size, causal, q.shape[SEQ_DIM], window, docs, all_docs)}
    if stats is not None and (docs is not None or window is not None):
        plan = plans[0 if simulated else rank]  # simulated: position 0's counts stand for the group's
        stats["ring_steps"] = stats.get("ring_steps", 0) + len(plan)
        stats["ring_steps_skipped"] = stats.get("ring_steps_skipped", 0) + sum(not blocks for blocks in plan)
    mask = RingMask(window, docs, all_docs)
    out, lse = _RingAttention.apply(
        q, k, v, group, scale, None if timeout is None else timedelta(seconds=timeout), plans, mask
    )
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- the model seam
class ContextParallelAttention(nn.Module):
    """The attention `core` of a block under context parallel: (q, k, v) of this rank's zigzag tokens. It
    keeps the replaced slot's sliding `window`; `sinks` come with each call, as to CausalAttention."""

    def __init__(
        self, group: dist.ProcessGroup, method: str = "ring", timeout: float | None = None, window: int | None = None
    ):
        super().__init__()
        check_window(window, causal=True)
        self.group, self.method, self.timeout, self.window = group, method, timeout, window
        self.stats: dict[str, int] = {}  # documents or a window: ring steps computed and skipped (ring_attention)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None, sinks: Tensor | None = None
    ) -> Tensor:
        """`positions` as the model got them (this rank's tokens'): (B, S/cp) per-document positions mask
        each token to its document (tessera.kernels.document_ids at the tokens' zigzag sequence indices)."""
        docs = None
        if positions is not None and positions.dim() == 2:
            rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
            docs = document_ids(positions, zigzag_indices(q.shape[SEQ_DIM] * size, rank, size, positions.device))
        if self.method == "ring":
            return ring_attention(
                q, k, v, self.group, causal=True, timeout=self.timeout, docs=docs, stats=self.stats,
                window=self.window, sinks=sinks,
            )  # fmt: skip
        return allgather_attention(q, k, v, self.group, causal=True, docs=docs, window=self.window, sinks=sinks)

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return f"method={self.method}, cp={dist.get_world_size(self.group)}{window}"


def apply_cp(
    model: nn.Module, cp_mesh: DeviceMesh, method: str = "ring", timeout: float | None = None, slots: str | None = None
) -> nn.Module:
    """Swap every attention slot (the modules matching `slots`, the spec's `attention` pattern; by default
    the model's family spec's) for context-parallel attention over `cp_mesh`, in place."""
    if method not in METHODS:
        raise ValueError(f"unknown cp_method={method!r}; use one of {', '.join(METHODS)}")

    slots = slots or spec_of(model.config).attention
    group = cp_mesh.get_group()
    found = find_modules(model, slots)
    if not found:  # a stage always holds a block: a pattern that finds no slot would leave attention local
        raise ValueError(
            f"context parallel: the attention pattern {slots!r} matches no module of "
            f"{type(model).__name__}; the spec's `attention` must name the (q, k, v) -> o slots"
        )
    for name, module in found:  # a sliding window is the slot's own (gpt-oss alternates them by layer)
        replace_module(model, name, ContextParallelAttention(group, method, timeout, getattr(module, "window", None)))
    return model
