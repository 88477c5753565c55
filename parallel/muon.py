"""Muon on sharded matrices: momentum on each shard, Newton-Schulz on each WHOLE matrix, by one owner rank.

Per matrix parameter (a 2-D weight, or a 3-D stack of matrices on dim 0 such as MoE experts, each
orthogonalized on its own):

    buf <- lerp(buf, g, 1 - mu)                     on the local shard (elementwise: stays sharded)
    u   <- lerp(g, buf, mu) if nesterov else buf    on the local shard
    U   <- gather u's shards to the matrix's owner  (a `gather` over the ranks that hold its shards)
    O   <- NS_k(U)                                   on the owner only, the whole matrix
    o   <- scatter O back to the shards              (a `scatter`)

The gathers and scatters are batched: the matrices that share a group and an owner travel together, one
gather and one scatter per (group, owner) a step (on debug's dp2 x tp2, 4 of each instead of 14).
    p   <- p (1 - lr wd) - adjusted_lr o             on the local shard

which is torch.optim.Muon's update (torch 2.13's torch/optim/_muon.py), written again here so that it
runs on torch without it (2.11) and on DTensor shards of any placement: FSDP2's Shard(0), tessera's tp
column/row shards, FSDP x tp's _StridedShard, expert parallel's expert-dim shards. Where each local
element sits in the whole matrix is read once, at construction, from the parameter's own placements
(a DTensor of flat indices redistributed from Replicate like the parameter: no layout rule written here).

A stack of matrices sharded on its dim 0 alone (experts over ep, or FSDP's Shard(0) of the stack) needs
no gather: each rank holds whole experts and orthogonalizes its own. Cut inside its matrices (tp), it
is gathered whole like any matrix.

Owners: the matrices that share one group of ranks are assigned greedily by Newton-Schulz FLOPs (the
largest first, each to the least loaded rank), so the work is spread over the group; ranks that hold
replicas (HSDP's dp_replicate, a pipeline stage's own parameters) each compute their own group's.
The one difference from torch.optim.Muon: Newton-Schulz runs in `ns_dtype` (bf16 in torch; tessera passes
the run's matmul dtype, so an fp32 run orthogonalizes in fp32 and keeps the fp32 numerics contract).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from .comm import collective
from .local_world import group_members, per_rank, rank_int, simulated_world, widest

ADJUST_LR = ("original", "match_rms_adamw")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
COMM_AXIS = "muon"  # --comm-stats accounts Muon's gathers and scatters under this name

# Test hook (tests/test_muon_contract.py's planted bug): orthogonalize each rank's shard alone, which is
# wrong whenever a matrix is sharded; never set outside that test.
SHARD_ALONE = False


def newton_schulz(g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype) -> Tensor:
    """The quintic Newton-Schulz orthogonalization of one matrix (torch.optim.Muon's, in `dtype`)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def ns_flops(shape: tuple[int, ...], steps: int) -> float:
    """Newton-Schulz FLOPs of a matrix (or a stack on dim 0): per step X X^T, G G and (.) X."""
    *stack, rows, cols = shape
    m, n = min(rows, cols), max(rows, cols)
    return float(math.prod(stack)) * steps * (4 * m * m * n + 2 * m**3)


def adjusted_lr(lr: float, adjust: str, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's learning-rate scale of a matrix (of one matrix of a stack)."""
    rows, cols = shape[-2:]
    if adjust == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


@dataclass
class _Plan:
    """Where one matrix's shards live and who orthogonalizes it."""

    group: dist.ProcessGroup | None  # None: this rank holds the whole matrix
    size: int  # the ranks that hold its shards
    owner: int  # the owner's global rank
    is_owner: bool
    local_numel: int
    width: int  # the longest shard in the group: gather and scatter carry equal pieces
    indices: list[Tensor] | None  # on the owner: each group rank's flat positions in the whole matrix
    flops: float


def _sharded_dims(p: DTensor) -> list[int]:
    """The mesh dims whose shards Muon must gather: every sharded one, but for a stack of matrices (3-D) only
    those that cut inside the matrices; a stack cut on its dim 0 alone (experts over ep, FSDP's Shard(0))
    holds whole matrices on each rank, each orthogonalized where it lies."""
    dims = [i for i, pl in enumerate(p.placements) if not pl.is_replicate() and p.device_mesh.size(i) > 1]
    if p.ndim == 3 and all(getattr(p.placements[i], "dim", None) == 0 for i in dims):
        return []
    return dims


def _group_of(p: DTensor, dims: list[int], cache: dict[tuple, dist.ProcessGroup]) -> dist.ProcessGroup:
    """The process group over the mesh dims `dims` of p's mesh (one dim: its group; several: flattened)."""
    mesh = p.device_mesh
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    assert mesh.mesh_dim_names is not None  # tessera's meshes name every dim
    names = tuple(mesh.mesh_dim_names[i] for i in dims)
    key = (id(mesh), names)
    if key not in cache:  # every rank of the mesh flattens the same dims in the same order (collective)
        cache[key] = mesh[names]._flatten("_".join(names) + "_muon").get_group()
    return cache[key]


def _local_indices(p: DTensor) -> Tensor:
    """The flat positions in the whole matrix of this rank's local elements, in local order."""
    mesh = p.device_mesh
    flat = torch.arange(p.numel(), dtype=torch.float64, device=p.to_local().device).view(p.shape)
    whole = DTensor.from_local(flat, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, p.placements).to_local().reshape(-1).long()


def _plans(params: Sequence[Tensor], ns_steps: int) -> dict[Tensor, _Plan]:
    """Each matrix's plan; owners greedy by FLOPs within each group. Collective over every rank that
    holds these parameters (at construction, before any step is counted)."""
    cache: dict[tuple, dist.ProcessGroup] = {}
    by_group: dict[Any, list[tuple[Tensor, dist.ProcessGroup | None]]] = {}
    for p in params:
        dims = _sharded_dims(p) if isinstance(p, DTensor) else []
        group = _group_of(p, dims, cache) if dims else None  # type: ignore[arg-type]
        by_group.setdefault(group, []).append((p, group))
    plans: dict[Tensor, _Plan] = {}
    for group, members in by_group.items():
        size = 1 if group is None else dist.get_world_size(group)
        load = [0.0] * size
        order = sorted(members, key=lambda m: -ns_flops(tuple(m[0].shape), ns_steps))  # stable: ties by order
        for p, _ in order:
            flops = ns_flops(tuple(_local(p).shape if group is None else p.shape), ns_steps)  # what this rank runs
            owner = min(range(size), key=lambda r: (load[r], r))
            load[owner] += flops
            plans[p] = _plan(p, group, owner, flops)
    return plans


def _plan(p: Tensor, group: dist.ProcessGroup | None, owner_in_group: int, flops: float) -> _Plan:
    if group is None:
        n = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        return _Plan(None, 1, dist.get_rank() if dist.is_initialized() else 0, True, n, n, None, flops)
    assert isinstance(p, DTensor)
    mine = _local_indices(p)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    owner = dist.get_global_rank(group, owner_in_group)
    if simulated_world() is not None:  # every simulated rank receives what the owner would (a gather is MPMD)
        # uneven shards hold a size per simulated rank: each padded to the widest, as on real ranks
        n = mine.numel()
        width = widest(n)
        padded = torch.full((width,), -1, dtype=torch.long, device=mine.device)
        padded.narrow(0, 0, n).copy_(mine)  # (narrow, not a slice: its bounds check compares one size per rank)
        rows, ints = _all_gathered(padded, group, size), per_rank(n)
        if ints is not None:  # member j's row cut to member j's own count, on each rank of each group
            of = {r: g for g in group_members(group) for r in g}
            rows = [row.narrow(0, 0, rank_int({r: ints[of[r][j]] for r in ints})) for j, row in enumerate(rows)]
        return _Plan(group, size, owner, True, n, width, rows, flops)
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(size)]
    dist.all_gather(sizes, torch.tensor(mine.numel(), dtype=torch.long), group=group)
    width = max(int(s) for s in sizes)
    padded = torch.full((width,), -1, dtype=torch.long, device=mine.device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in range(size)] if me == owner_in_group else None
    dist.gather(padded, gathered, dst=owner, group=group)
    indices = [g[: int(n)] for g, n in zip(gathered, sizes)] if gathered is not None else None
    return _Plan(group, size, owner, me == owner_in_group, mine.numel(), width, indices, flops)


class Muon(torch.optim.Optimizer):
    """Muon over matrix parameters (2-D, or 3-D stacks of matrices on dim 0), plain or DTensor shards.
    Its state is one `momentum_buffer` per parameter, shaped (and sharded) like it."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = 5,
        adjust_lr: str = "original",
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"Muon adjust_lr={adjust_lr!r} is not one of {', '.join(ADJUST_LR)}")
        if not 1 <= ns_steps <= 99:
            raise ValueError(f"Muon ns_steps={ns_steps} must be within 1-99 (5 is the usual)")
        params = list(params)
        for p in params:
            if p.ndim not in (2, 3):
                raise ValueError(f"Muon takes matrices (2-D) or stacks of them (3-D), not a {tuple(p.shape)} tensor")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr,
        )
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.plans = _plans(params, ns_steps)

    def owned_flops(self) -> float:
        """The Newton-Schulz FLOPs this rank spends per step (the balance: max / mean over ranks)."""
        return sum(plan.flops for plan in self.plans.values() if plan.is_owner)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        updates = [self._momentum(p, group) for p, group in todo]
        orthos = self._orthogonalize_all(todo, updates)
        for (p, group), ortho in zip(todo, orthos):
            param, lr = _local(p), group["lr"]
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(ortho.to(param.dtype), alpha=-adjusted_lr(lr, group["adjust_lr"], tuple(p.shape)))
        return loss

    def _momentum(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """The momentum step on this rank's shard; the (Nesterov) update it gives, local."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        assert p.grad is not None
        buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
        mu = group["momentum"]
        buf.lerp_(grad, 1 - mu)
        return grad.lerp(buf, mu) if group["nesterov"] else buf

    def _orthogonalize_all(self, todo: list[tuple[Tensor, dict[str, Any]]], updates: list[Tensor]) -> list[Tensor]:
        """Each update orthogonalized as a whole matrix. Matrices held whole run here; sharded ones go in
        buckets by (group, owner): one gather and one scatter per bucket a step, not per matrix. Buckets
        are issued in the parameters' order (the same on every rank of a group: no crossed collectives)."""
        out: list[Tensor | None] = [None] * len(todo)
        buckets: dict[tuple[int, int], list[int]] = {}
        for i, (p, group) in enumerate(todo):
            plan = self.plans[p]
            if plan.group is None or SHARD_ALONE:
                out[i] = _ns_stack(updates[i], self._ns(group))
            else:
                buckets.setdefault((id(plan.group), plan.owner), []).append(i)
        for members in buckets.values():
            for i, ortho in zip(members, self._bucket([todo[i] for i in members], [updates[i] for i in members])):
                out[i] = ortho
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]

    def _ns(self, group: dict[str, Any]) -> tuple:
        return (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

    def _bucket(self, members: list[tuple[Tensor, dict[str, Any]]], updates: list[Tensor]) -> list[Tensor]:
        """The updates of matrices that share one group and one owner: every rank's pieces (each matrix padded
        to its widest shard) in one gather to the owner, Newton-Schulz there on each whole matrix, the
        results back in one scatter."""
        plans = [self.plans[p] for p, _ in members]
        first, dtype, device = plans[0], updates[0].dtype, updates[0].device
        assert first.group is not None  # a bucket holds sharded matrices only
        offsets = [0]
        for plan in plans:
            offsets.append(offsets[-1] + plan.width)
        piece = torch.zeros(offsets[-1], dtype=dtype, device=device)
        for plan, u, at in zip(plans, updates, offsets):
            piece.narrow(0, at, plan.local_numel).copy_(u.reshape(-1))  # (narrow: a simulated uneven shard's size)
        world = simulated_world()
        pieces = [torch.empty_like(piece) for _ in range(first.size)] if first.is_owner else None
        with collective("gather (muon update)", COMM_AXIS, first.group):
            if world is not None:  # a simulated world: every rank receives the owner's pieces, and computes its part
                pieces = _all_gathered(piece, first.group, first.size)
            else:
                dist.gather(piece, pieces, dst=first.owner, group=first.group)
        chunks = None
        if first.is_owner:
            assert pieces is not None
            chunks = [torch.zeros_like(piece) for _ in range(first.size)]
            for (p, group), plan, at in zip(members, plans, offsets):
                assert plan.indices is not None
                whole = torch.empty(p.numel(), dtype=dtype, device=device)
                for got, where in zip(pieces, plan.indices):
                    whole[where] = got[at : at + where.numel()]
                ortho = _ns_stack(whole.view(p.shape), self._ns(group)).reshape(-1).to(dtype)
                for chunk, where in zip(chunks, plan.indices):
                    chunk[at : at + where.numel()] = ortho[where]
        mine = torch.empty_like(piece)
        if world is not None:  # what the owner's scatter hands each rank: its own chunk, by its place in the group
            assert chunks is not None
            with world.disable():
                place = {r: torch.tensor([g.index(r)], device=device) for g in group_members(first.group) for r in g}
            mine = torch.stack(chunks).index_select(0, world.rank_map(lambda r: place[r]))[0]
        else:
            with collective("scatter (muon update)", COMM_AXIS, first.group):
                dist.scatter(mine, chunks, src=first.owner, group=first.group)
        return [mine.narrow(0, at, plan.local_numel).view(u.shape) for plan, u, at in zip(plans, updates, offsets)]


def _all_gathered(t: Tensor, group: dist.ProcessGroup, size: int) -> list[Tensor]:
    """Every group rank's `t` (1-D, one length on all), for the simulated world's stand-in of a gather to the
    owner: all_gather_into_tensor, whose simulated form serves a world holding some groups only (a simulated
    pipeline's stage), where torch 2.13's list all_gather indexes every group's ranks and fails."""
    out = torch.empty(size * t.numel(), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return list(out.view(size, t.numel()).unbind(0))


def _ns_stack(u: Tensor, ns: tuple) -> Tensor:
    """Newton-Schulz on a matrix, or on each matrix of a stack (dim 0; a rank's share may hold none)."""
    if u.ndim == 2:
        return newton_schulz(u, *ns)
    if u.shape[0] == 0:
        return u
    return torch.stack([newton_schulz(m, *ns) for m in u])


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
