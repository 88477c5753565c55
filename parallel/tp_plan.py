"""Sharding plans: which module of a model becomes which tensor-parallel layer, by module-name pattern.

A `Plan` maps patterns to styles and names the blocks that FSDP2 wraps one by one (and activation
checkpointing recomputes). A model family's spec (models/spec.py) names its tp plan as data and
`spec_plan` turns it into a Plan; a user's model may also pass a plan written for it directly. Patterns
match module names segment by segment: `*` is one segment (`layers.*.mlp` matches `layers.3.mlp`, not
`layers.3.x.mlp`), fnmatch inside a segment (`w[13]`).

    plan = Plan({
        "blocks.*.attn": PrepareInput(),             # one collective in front of the block's column layers
        "blocks.*.attn.qkv": ColwiseParallel(gather_input=False),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.norm": ReplicatedNorm(),
        "embed": VocabEmbedding(),
    }, blocks=["blocks.*"])
    parallelize(model, mesh, ParallelConfig(layout), plan=plan)

Styles (all keep the parameter names of the one-process model, so checkpoints and gradients compare by name):
    ColwiseParallel   nn.Linear split on its output features (Shard(0), uneven splits as torch.chunk
                      makes them); the input is copied to the tp
                      ranks (all-reduce of its gradient), or all-gathered over the sequence under sequence
                      parallel, unless `gather_input=False` (a PrepareInput above did it once).
    RowwiseParallel   nn.Linear split on its input features (Shard(1)); the partial outputs are summed:
                      all-reduce, or reduce-scatter onto sequence shards under sequence parallel.
    VocabEmbedding    nn.Embedding split over rows; all-reduce (or reduce-scatter) of the partial lookups.
    ReplicatedNorm    RMSNorm / LayerNorm with replicated weights; under sequence parallel each rank
                      normalizes its own tokens and the weight gradients are all-reduced.
    PrepareInput      the sequence-parallel boundary in front of a block: its input is copied (or
                      gathered) once for every column-parallel layer inside.
    PrepareInputHeads PrepareInput, and the block's per-head parameters (attention sinks) split over tp.
    ReplicatedHeads   a K/V projection when tp exceeds the kv heads: replicated, each rank uses its head.
    HeadNorm          a norm over head_dim on each rank's own heads (QK-norm): replicated weights whose
                      gradients are partial sums on every layout, so always all-reduced.
    Replicated        nn.Linear held whole by every rank (an MoE router); gradients all-reduced under SP.
    MoEBlock          a mixture-of-experts block: one input and routing collective, one output reduce.
    Experts           grouped experts' stacked weights split over each expert's ffn.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from tessera.models.moe import GroupedExperts, MoE
from tessera.models.spec import spec_of
from tessera.topology.shapes import kv_heads_split

from .expert import apply_moe_tp, shard_experts
from .tensor import (
    BlockInput,
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    TPRMSNorm,
    VocabParallelEmbedding,
    _shard_param,
    check_tensor_parallel,
    copy_weight_to_tp,
)
from .tied import retie, shared_parameters


# ----------------------------------------------------------------------------- matching
@functools.lru_cache(maxsize=1 << 16)  # a model's names against a plan's patterns, again on every rebuild
def matches(pattern: str, name: str) -> bool:
    """Segment-wise match of a module name against a plan pattern."""
    parts, segs = pattern.split("."), name.split(".")
    return len(parts) == len(segs) and all(fnmatch.fnmatchcase(s, p) for p, s in zip(parts, segs))


def find_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    return _find(list(model.named_modules()), pattern)


def _find(named: list[tuple[str, nn.Module]], pattern: str) -> list[tuple[str, nn.Module]]:
    """`find_modules` over a model's `named_modules()` listed once (a plan matches many patterns)."""
    return [(n, m) for n, m in named if n and matches(pattern, n)]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


# ----------------------------------------------------------------------------- styles
class Style:
    """Turns one module into its tensor-parallel form; returns the replacement (or the module itself)."""

    takes: tuple[type, ...] = (nn.Module,)

    def apply(self, module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
        raise NotImplementedError

    def check(self, name: str, module: nn.Module, tp: int) -> None:
        if not isinstance(module, self.takes):
            kinds = " or ".join(t.__name__ for t in self.takes)
            raise ValueError(f"plan: {type(self).__name__} on {name!r} needs a {kinds}, got {type(module).__name__}")

    def __repr__(self) -> str:
        return type(self).__name__ + "(" + ", ".join(f"{k}={v!r}" for k, v in vars(self).items()) + ")"


def _linear_weight(module: nn.Module) -> torch.Tensor:
    if not isinstance(module, nn.Linear):  # the styles that call this take nn.Linear (Style.check)
        raise TypeError(f"an nn.Linear's weight, not a {type(module).__name__}'s")
    return module.weight


def _bias_of(module: nn.Module) -> torch.Tensor | None:
    return getattr(module, "bias", None)


@dataclass(repr=False)
class ColwiseParallel(Style):
    gather_input: bool = True
    takes = (nn.Linear,)

    def apply(self, module, tp_mesh, sequence_parallel):
        comm = BlockInput(tp_mesh.get_group(), sequence_parallel) if self.gather_input else None
        return ColumnParallelLinear(_linear_weight(module), tp_mesh, comm, _bias_of(module))


@dataclass(repr=False)
class RowwiseParallel(Style):
    takes = (nn.Linear,)

    def apply(self, module, tp_mesh, sequence_parallel):
        return RowParallelLinear(_linear_weight(module), tp_mesh, sequence_parallel, _bias_of(module))


@dataclass(repr=False)
class VocabEmbedding(Style):
    takes = (nn.Embedding,)

    def apply(self, module, tp_mesh, sequence_parallel):
        return VocabParallelEmbedding(module.weight, tp_mesh, sequence_parallel)


class TPLayerNorm(nn.Module):
    """nn.LayerNorm with replicated weight and bias (their gradients all-reduced under sequence parallel)."""

    def __init__(self, module: nn.LayerNorm, tp_mesh: DeviceMesh, sequence_parallel: bool):
        super().__init__()
        self.normalized_shape, self.eps = module.normalized_shape, module.eps
        self.weight = None if module.weight is None else _shard_param(module.weight, tp_mesh, Replicate())
        self.bias = None if module.bias is None else _shard_param(module.bias, tp_mesh, Replicate())
        self.group, self.sequence_parallel = tp_mesh.get_group(), sequence_parallel

    def _local(self, p):
        if p is None:
            return None
        return copy_weight_to_tp(p.to_local(), self.group) if self.sequence_parallel else p.to_local()

    def forward(self, x):
        return torch.nn.functional.layer_norm(
            x, self.normalized_shape, self._local(self.weight), self._local(self.bias), self.eps
        )


@dataclass(repr=False)
class ReplicatedNorm(Style):
    def apply(self, module, tp_mesh, sequence_parallel):
        if isinstance(module, nn.LayerNorm):
            return TPLayerNorm(module, tp_mesh, sequence_parallel)
        eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
        return TPRMSNorm(module.weight, eps, tp_mesh, sequence_parallel)

    def check(self, name, module, tp):
        if isinstance(module, nn.LayerNorm):
            return
        if not (hasattr(module, "weight") and hasattr(module, "eps")) or len(list(module.parameters())) != 1:
            raise ValueError(
                f"plan: ReplicatedNorm on {name!r} needs an RMSNorm (one weight and eps) or nn.LayerNorm, "
                f"got {type(module).__name__}"
            )


@dataclass(repr=False)
class HeadNorm(Style):
    def apply(self, module, tp_mesh, sequence_parallel):
        eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
        # each rank normalizes only its heads: the weight's gradient is a partial sum even without SP
        return TPRMSNorm(module.weight, eps, tp_mesh, sequence_parallel=True)

    def check(self, name, module, tp):
        if not (hasattr(module, "weight") and hasattr(module, "eps")) or len(list(module.parameters())) != 1:
            raise ValueError(
                f"plan: HeadNorm on {name!r} needs an RMSNorm (one weight and eps), got {type(module).__name__}"
            )


class ReplicatedLinear(nn.Module):
    """nn.Linear (with or without a bias) every tp rank holds whole, e.g. an MoE router; under sequence
    parallel each rank reads its own tokens with it, so its gradients are all-reduced."""

    def __init__(self, weight, tp_mesh: DeviceMesh, sequence_parallel: bool, bias=None):
        super().__init__()
        self.weight = _shard_param(weight, tp_mesh, Replicate())
        self.bias = None if bias is None else _shard_param(bias, tp_mesh, Replicate())
        self.group, self.sequence_parallel = tp_mesh.get_group(), sequence_parallel

    def _read(self, p):
        return copy_weight_to_tp(p.to_local(), self.group) if self.sequence_parallel else p.to_local()

    def forward(self, x):
        return torch.nn.functional.linear(
            x, self._read(self.weight), None if self.bias is None else self._read(self.bias)
        )


@dataclass(repr=False)
class Replicated(Style):
    takes = (nn.Linear,)

    def apply(self, module, tp_mesh, sequence_parallel):
        return ReplicatedLinear(module.weight, tp_mesh, sequence_parallel, module.bias)


@dataclass(repr=False)
class MoEBlock(Style):
    """A mixture-of-experts block (models/moe.py): its tokens and routing copied or gathered once, its
    experts' partial outputs summed once (parallel/expert.py)."""

    def apply(self, module, tp_mesh, sequence_parallel):
        return apply_moe_tp(module, tp_mesh, sequence_parallel)

    def check(self, name, module, tp):
        if not isinstance(module, MoE):
            raise ValueError(f"plan: MoEBlock on {name!r} needs a tessera.models.moe.MoE, got {type(module).__name__}")


@dataclass(repr=False)
class Experts(Style):
    """Grouped experts: each expert's ffn split (gate and up on their rows, down on its columns)."""

    def apply(self, module, tp_mesh, sequence_parallel):
        if "down_proj_bias" in getattr(module, "ffn_dims", {}):  # added once: each rank its 1/tp share
            module.down_bias_comm = BiasShare(tp_mesh.get_group())
        return shard_experts(module, None, tp_mesh)

    def check(self, name, module, tp):
        if not isinstance(module, GroupedExperts):
            raise ValueError(
                f"plan: Experts on {name!r} needs a tessera.models.moe.GroupedExperts, got {type(module).__name__}"
            )


class BiasShare(nn.Module):
    """A bias added to partial outputs that tp sums (grouped experts' down bias): each rank adds 1/tp of it,
    and its gradient (1/tp of the whole on each rank) is all-reduced."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, bias):
        return copy_weight_to_tp(bias, self.group) / dist.get_world_size(self.group)


@dataclass(repr=False)
class PrepareInput(Style):
    """A module's input is copied to (or gathered over) the tp ranks once. The module's own `input_comm`
    slot is used when it has one (tessera's blocks); otherwise a forward pre-hook on its first argument."""

    def apply(self, module, tp_mesh, sequence_parallel):
        comm = BlockInput(tp_mesh.get_group(), sequence_parallel)
        if isinstance(getattr(module, "input_comm", None), nn.Module):
            module.input_comm = comm
        else:
            module.register_forward_pre_hook(lambda _m, args: (comm(args[0]), *args[1:]))
        return module


@dataclass(repr=False)
class PrepareInputHeads(PrepareInput):
    """PrepareInput, and the block's per-head parameters (its `head_params`, e.g. attention sinks: one value
    per query head) split over tp with the query heads (Shard(0)): each rank reads its own heads' values."""

    def apply(self, module, tp_mesh, sequence_parallel):
        for name in getattr(module, "head_params", ()):
            setattr(module, name, _shard_param(getattr(module, name), tp_mesh, Shard(0)))
        return super().apply(module, tp_mesh, sequence_parallel)


@dataclass(repr=False)
class ReplicatedHeads(Style):
    n_kv_heads: int = 1
    head_dim: int = 1
    takes = (nn.Linear,)

    def check(self, name, module, tp):
        super().check(name, module, tp)
        if module.bias is not None:  # each rank would need its head's rows of the bias too
            raise ValueError(
                f"plan: {name!r} has a bias, and tp={tp} exceeds its {self.n_kv_heads} kv heads (replicated "
                f"K/V heads take no bias); use a tp that divides n_kv_heads={self.n_kv_heads}"
            )

    def apply(self, module, tp_mesh, sequence_parallel):
        head = tp_mesh.get_local_rank() * self.n_kv_heads // tp_mesh.size()
        return ReplicatedHeadsLinear(module.weight, tp_mesh, head, self.head_dim)


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """rules: pattern -> Style, applied in the order given (a module takes the first rule it matches).
    blocks: patterns of the FSDP2 units, wrapped one by one in this order (a tuple groups its matches into
    one unit), then the root; the first pattern's modules are also what activation checkpointing wraps.
    allow_unmatched: a rule that matches no module is an error unless set (a pipeline stage lacks some)."""

    rules: dict[str, Style] = field(default_factory=dict)
    blocks: tuple = ()
    checkpoint_blocks: str | None = None
    allow_unmatched: bool = False

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(self.blocks))
        for pattern, style in self.rules.items():
            if not isinstance(style, Style):
                raise TypeError(
                    f"plan rule {pattern!r}: {style!r} is not a Style (ColwiseParallel(), RowwiseParallel(), ...)"
                )

    def assignments(self, model: nn.Module) -> list[tuple[str, nn.Module, Style]]:
        """(module name, module, style) for every module a rule takes; errors for rules that match nothing."""
        taken: dict[str, tuple[nn.Module, Style]] = {}
        named = list(model.named_modules())
        for pattern, style in self.rules.items():
            found = [(n, m) for n, m in _find(named, pattern) if n not in taken]
            if not found and not self.allow_unmatched:
                names = ", ".join(n for n, _ in named[1:12])
                raise ValueError(
                    f"plan rule {pattern!r} matches no module of {type(model).__name__} (its modules: {names}, ...)"
                )
            for n, m in found:
                taken[n] = (m, style)
        return [(n, m, s) for n, (m, s) in taken.items()]

    def check(self, model: nn.Module, tp: int) -> list[tuple[str, nn.Module, Style]]:
        """Each assigned module checked against its style; returns the assignments."""
        assigned = self.assignments(model)
        for name, module, style in assigned:
            style.check(name, module, tp)
        return assigned

    def units(self, model: nn.Module) -> list[list[nn.Module]]:
        """The FSDP2 units, in wrapping order (the root excluded)."""
        named = list(model.named_modules())
        out = []
        for entry in self.blocks:
            if isinstance(entry, tuple):
                group = [m for p in entry for _, m in _find(named, p)]
                if group:
                    out.append(group)
            else:
                out.extend([m] for _, m in _find(named, entry))
        return out


def apply_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: Plan, sequence_parallel: bool = False) -> nn.Module:
    """Swap the modules a plan names for their tensor-parallel forms, in place (children before the
    PrepareInput hooks of their parents do not matter: each style touches only its own module). Tied
    weights (one parameter under two names) are one tensor again afterwards."""
    assigned = plan.check(model, tp_mesh.size())
    tied = shared_parameters(model)
    for name, module, style in assigned:
        new = style.apply(module, tp_mesh, sequence_parallel)
        if new is not module:
            replace_module(model, name, new)
    retie(model, tied)
    return model


def _style(kind: str, shape, tp: int) -> Style:
    """A spec's style name (models.spec.TP_STYLES) as the Style that applies it."""
    if kind == "kv":  # split the kv heads when tp divides them, else replicate, each rank its head
        if kv_heads_split(shape.n_kv_heads, tp):
            return ColwiseParallel(gather_input=False)
        return ReplicatedHeads(shape.n_kv_heads, shape.head_dim)
    return {
        "embedding": VocabEmbedding,
        "block_input": PrepareInput,
        "block_input_heads": PrepareInputHeads,
        "rowwise": RowwiseParallel,
        "colwise": lambda: ColwiseParallel(gather_input=False),
        "colwise_gather": lambda: ColwiseParallel(gather_input=True),
        "norm": ReplicatedNorm,
        "head_norm": HeadNorm,
        "replicated": Replicated,
        "moe": MoEBlock,
        "experts": Experts,
    }[kind]()


def spec_plan(spec, shape, tp: int) -> Plan:
    """A model family's plan (its spec's tp_plan, blocks and pipeline split) for `tp` ranks; `shape` is
    spec.shape(config). FSDP2 units: the first-stage modules, each block, the last-stage modules together
    (units that hold a tied weight go to the root: apply_fsdp)."""
    split = spec.pipeline
    return Plan(
        rules={pattern: _style(kind, shape, tp) for pattern, kind in spec.tp_plan},
        blocks=(*split.first, spec.blocks, tuple(split.last)),
        checkpoint_blocks=spec.blocks,
        allow_unmatched=True,  # a pipeline stage lacks some modules
    )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, spec=None) -> nn.Module:
    """Swap a spec'd model's (or stage's) one-process layers for tensor-parallel ones, in place: its
    family's plan, the same mechanism users' plans go through. Tied weights stay one tensor."""
    spec = spec or spec_of(model.config)
    shape = spec.shape(model.config)
    check_tensor_parallel(shape, tp_mesh.size(), sequence_parallel)
    return apply_plan(model, tp_mesh, spec_plan(spec, shape, tp_mesh.size()), sequence_parallel)
