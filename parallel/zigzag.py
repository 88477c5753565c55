"""Context parallel's layout and the pieces both attention methods share: the zigzag shards of a sequence
(rank i keeps chunks i and 2*cp-1-i; see tessera.parallel.context), the log-sum-exp merge of partial results,
K/V packed into one message, and the document ids that travel with the shards."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import collective
from .tensor import _all_gather_flat

METHODS = ("ring", "allgather")
SEQ_DIM = 2  # attention tensors are (batch, heads, seq, head_dim)


# ----------------------------------------------------------------------------- the zigzag layout
def check_context(
    seq_len: int | None, cp: int, method: str = "ring", tp: int = 1, sequence_parallel: bool = False
) -> None:
    """ValueError naming the value and the fix, before any process group starts."""
    if method not in METHODS:
        raise ValueError(f"unknown cp_method={method!r}; use one of {', '.join(METHODS)}")
    if cp == 1 or seq_len is None:
        return
    multiple, why = 2 * cp, f"2 x cp = {2 * cp} equal chunks (zigzag context parallel)"
    if sequence_parallel and tp > 1:
        multiple = math.lcm(2 * cp, cp * tp)
        why += f" whose S/cp tokens split over tp={tp} (sequence parallel)"
    if seq_len % multiple:
        lower, upper = seq_len - seq_len % multiple, seq_len - seq_len % multiple + multiple
        nearest = f"seq_len={lower} or {upper}" if lower > 0 else f"seq_len={upper}"
        raise ValueError(f"seq_len={seq_len} does not split into {why}; use {nearest}")


def zigzag_indices(seq_len: int, rank: int, size: int, device: torch.device | str | None = None) -> Tensor:
    """The global positions rank `rank` of `size` holds: chunk rank, then chunk 2*size-1-rank."""
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, second])


def zigzag_shard(x: Tensor, dim: int, rank: int, size: int) -> Tensor:
    """This rank's two chunks of `x` along `dim` (its length divisible by 2*size)."""
    if x.shape[dim] % (2 * size):
        raise ValueError(f"length {x.shape[dim]} along dim {dim} does not split into 2 x {size} chunks")
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[Tensor], dim: int) -> Tensor:
    """The full tensor from every rank's shard (in rank order): the inverse of zigzag_shard."""
    size = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [halves[i][0] for i in range(size)] + [halves[i][1] for i in reversed(range(size))]
    return torch.cat(ordered, dim=dim)


def causal_pairs(seq_len: int, size: int, layout: str = "zigzag", positions: Tensor | None = None) -> list[int]:
    """Unmasked (query, key) pairs of causal attention each of `size` ranks computes: the attention
    work per rank, for the zigzag layout or contiguous chunks (rank i holding [i S/size, (i+1) S/size)).
    With packed documents' `positions` (seq_len,) (restarting at each document) a query sees only its
    document's keys up to itself: position p sees p + 1 keys."""
    seen = (torch.arange(seq_len) if positions is None else positions.reshape(-1)) + 1  # keys each query sees

    if layout == "zigzag":
        return [int(seen[zigzag_indices(seq_len, r, size)].sum()) for r in range(size)]
    if layout == "contiguous":
        return [int(part.sum()) for part in seen.chunk(size)]
    raise ValueError(f"unknown layout {layout!r}; use zigzag or contiguous")


# ----------------------------------------------------------------------------- merging partial results
def merge_partial(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge (out, lse) with a block's (block_out, block_lse) over other keys: the softmax over the union
    of both key sets. out (..., S, D) fp32, lse (..., S) fp32; a row with no visible key has lse -inf
    and out 0, and stays so until a block shows it a key (no NaN)."""
    new = torch.logaddexp(lse, block_lse)
    nothing = torch.isneginf(new)
    safe = torch.where(nothing, torch.zeros_like(new), new)
    keep = torch.where(nothing, torch.zeros_like(new), torch.exp(lse - safe)).unsqueeze(-1)
    take = torch.where(nothing, torch.zeros_like(new), torch.exp(block_lse - safe)).unsqueeze(-1)
    return out * keep + block_out.to(out.dtype) * take, new


# ----------------------------------------------------------------------------- messages and document ids
def pack(*tensors: Tensor) -> Tensor:
    """One flat message of several tensors (K and V, whose head dims may differ)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: Tensor, *shapes: torch.Size) -> list[Tensor]:
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def documents_meet(q_docs: Tensor, k_docs: Tensor) -> Tensor:
    """Whether any query of q_docs (B, Sq) shares a document with any key of k_docs (B, Sk), in any row: a
    0-dim bool tensor (ids tagged with their row, then one sorted-search membership test, no (Sq x Sk))."""
    span = int(max(q_docs.max(), k_docs.max())) + 1 if q_docs.numel() and k_docs.numel() else 1
    tag = torch.arange(q_docs.shape[0], device=q_docs.device).view(-1, 1) * span
    return torch.isin(q_docs + tag, k_docs + tag).any()


def gather_documents(docs: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every cp rank's document ids (cp, B, S/cp): the boundaries travel with the shards, once per layer."""
    size = dist.get_world_size(group)
    gathered = docs.new_empty((size * docs.shape[0], docs.shape[1]))
    with collective("all_gather (document ids)", "cp", group):
        _all_gather_flat(gathered, docs.contiguous(), group=group)
    return gathered.view(size, *docs.shape)
