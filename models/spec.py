"""Model specs: everything the parallel axes, the planner and the runtime need to know about a model family,
as data, so that none of them names a family's modules.

A family (models/llama.py, models/qwen3.py, or a user's own file) builds one `ModelSpec` and registers it by
name. parallel/ reads the spec (never the family's classes), topology/ reads `spec.shape(config)` (plain
numbers), and the runtime finds a spec by preset name, by a config's `family`, or by a Hugging Face
config.json's model_type. A user's model that is not registered passes its spec to `parallelize` and to
the equivalence runner.

The contract a spec'd model keeps (tessera's families do, and a user's model must):
- `forward(inputs, positions=None, targets=None)`: integer token ids (B, S), or on a pipeline stage after
  the first the previous stage's floating-point hidden states (B, S, dim); `positions` (S,) are the
  tokens' global positions (context parallel passes its zigzag chunks'; default 0..S-1). It returns
  logits (B, S, vocab) (the local vocabulary shard under tp), hidden states when the last-stage modules
  are None, or with `targets` the (loss sum, valid count) of the fused head installed in `head`.
- the modules named in `pipeline.first` and `pipeline.last` may be None (a stage that lacks them), and
  `pipeline.blocks` names an nn.ModuleDict of the repeated blocks keyed "0".."n_layers-1";
- the modules matching `attention` take (q, k, v) -> o with q (B, Hq, S, D), k and v (B, Hkv, S, D), the
  sequence being this rank's tokens at `positions` (`tessera.models.layers.CausalAttention`);
- tied weights are one nn.Parameter shared by two modules (a tied embedding and head): tessera finds them
  by identity, keeps the first name (`named_parameters()`'s) everywhere, and on a pipeline the last stage
  keeps the owner's module too (so a stage must embed only integer inputs), its gradient summed with the
  first stage's;
- the config is a frozen dataclass with `family` (the spec's name), `n_layers`, `dim`, `vocab_size`
  and `max_seq_len`, and every other size the family needs.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from tessera.topology.shapes import ModelShape

from .init import Init, init_parameters

# The tensor-parallel styles a spec's plan may name (parallel/tp_plan.py turns each into its Style):
# the byte-level vocabulary (tessera.data.corpus): 256 byte values + BOS + EOS, that of the families' debug presets
BOS, EOS = 256, 257
BYTE_VOCAB = 258

TP_STYLES = {
    "embedding": "nn.Embedding split over vocabulary rows; partial lookups summed (scattered under SP)",
    "block_input": "a block's input copied to (or gathered over) the tp ranks once, for every column layer inside",
    "block_input_heads": "block_input, and the block's per-head parameters (its `head_params`: attention sinks) "
    "split over tp with its query heads",
    "colwise": "nn.Linear split on output features; its input already prepared by a block_input above",
    "colwise_gather": "nn.Linear split on output features that prepares its own input (the output head)",
    "rowwise": "nn.Linear split on input features; partial outputs summed (scattered under SP)",
    "kv": "a K or V projection: split over kv heads when tp divides them, else replicated, each rank its head",
    "norm": "a norm over the model dim with replicated weights (gradients summed under SP)",
    "head_norm": "a norm over head_dim applied to each rank's own heads (QK-norm): weight gradients always summed",
    "replicated": "an nn.Linear every tp rank holds whole (an MoE router): gradients summed under SP",
    "moe": "a mixture-of-experts block (models/moe.py): its tokens and routing copied to (or gathered over) the "
    "tp ranks once, the experts' partial outputs summed once",
    "experts": "grouped experts (models/moe.py): each expert's ffn split, as colwise gate/up and rowwise down",
}


TPPlan = tuple[tuple[str, str], ...]  # (module-name pattern, TP_STYLES key), first match wins

# The tp styles of a block's hidden weight matrices (attention projections, MLP and expert weights): Muon
# orthogonalizes their updates; the embedding, the head, norms and routers stay on AdamW (as Moonlight does)
MATRIX_STYLES = ("colwise", "rowwise", "kv", "experts")


def matrix_patterns(plan: TPPlan) -> tuple[str, ...]:
    """The `matrices` rule a plan implies: every parameter of a module whose style is a MATRIX_STYLES one."""
    return tuple(f"{pattern}.*" for pattern, style in plan if style in MATRIX_STYLES)


def prefixed(prefix: str, plan: TPPlan) -> TPPlan:
    """A block's own plan (names relative to it, "" the block itself) under the block's pattern in the model."""
    return tuple((f"{prefix}.{name}" if name else prefix, style) for name, style in plan)


@dataclass(frozen=True)
class PipelineSplit:
    """How a model is cut into pipeline stages: the first stage runs `first`, every stage some of the
    `blocks`, the last stage `last`. Parameter names are unchanged on a stage."""

    first: tuple[str, ...]  # e.g. ("tok_embeddings",): token embedding, learned positions
    blocks: str  # the nn.ModuleDict of repeated blocks, e.g. "layers"
    last: tuple[str, ...]  # e.g. ("norm", "output"): final norm and head


@dataclass(frozen=True)
class HFAdapter:
    """Hugging Face in and out for a family: config.json <-> config, parameter names <-> the family's."""

    model_type: str  # config.json's model_type this family reads
    architecture: str  # what config.json's architectures names (e.g. "Qwen3ForCausalLM")
    read_config: Callable[[dict, str], Any]  # (config.json as a dict, its path for messages) -> config
    config_dict: Callable[[Any, str], dict]  # (config, dtype name) -> config.json dict
    # the family's parameter name -> HF's (ValueError for one it does not know); a parameter HF stores as
    # one tensor per index of its dim 0 (stacked experts) -> a template with {} where the index goes
    to_hf: Callable[[str], str]
    # HF's name -> the family's (None: not a parameter, e.g. rotary buffers; (name, index): a slice of a stack)
    from_hf: Callable[[str], str | tuple[str, int] | None]


@dataclass(frozen=True)
class ModelSpec:
    """One model family, as the parallel axes, planner and runtime see it (see the module docstring)."""

    name: str
    config_type: type
    build: Callable[[Any], nn.Module]  # config -> the one-process model, on the current torch.device
    init_std: Callable[[str, Any], Init]  # (one-process parameter name, config) -> std, ONES or ZEROS
    shape: Callable[[Any], ModelShape]  # config -> sizes as plain numbers (memory model, planner, MFU)
    tp_plan: TPPlan
    blocks: str  # the pattern of one repeated block: FSDP2 units, activation checkpointing, compile
    pipeline: PipelineSplit
    attention: str  # the pattern of the attention slots (context parallel, kernels)
    head: str  # the output projection (the fused loss head replaces it); a pipeline.last module
    moe: str | None = None  # the pattern of the mixture-of-experts blocks (models/moe.py's MoE): expert parallel
    presets: Mapping[str, Any] = field(default_factory=dict)
    hf: HFAdapter | None = None
    # patterns (fnmatch) of the one-process parameter names that are hidden weight matrices, the ones
    # `--optimizer muon` orthogonalizes (of them, those of 2 dims, or 3: a stack of matrices on dim 0, such
    # as experts); empty: none, and Muon is refused. decoder families: matrix_patterns(tp_plan)
    matrices: tuple[str, ...] = ()

    def is_matrix(self, name: str, ndim: int) -> bool:
        """Whether the parameter of one-process name `name` (of `ndim` dims) is one of the spec's matrices."""
        return ndim in (2, 3) and any(fnmatch.fnmatchcase(name, pattern) for pattern in self.matrices)

    def __post_init__(self) -> None:
        unknown = [(p, s) for p, s in self.tp_plan if s not in TP_STYLES]
        if unknown:
            raise ValueError(
                f"spec {self.name!r}: tp style {unknown[0][1]!r} (for {unknown[0][0]!r}) is not one of "
                f"{', '.join(TP_STYLES)}"
            )
        if self.head not in self.pipeline.last:
            raise ValueError(
                f"spec {self.name!r}: head {self.head!r} must be one of pipeline.last {self.pipeline.last}"
            )

    def config(self, preset: str, **overrides) -> Any:
        """The config of one of this family's presets, with fields replaced."""
        key = preset.lower()
        if key not in self.presets:
            raise ValueError(f"unknown {self.name} preset {preset!r}; choose one of {', '.join(self.presets)}")
        return dataclasses.replace(self.presets[key], **overrides) if overrides else self.presets[key]

    def build_model(self, config: Any, device: Any = "cpu", seed: int | None = 0) -> nn.Module:
        """The one-process model on `device`, initialized from `seed` (nothing allocated on "meta")."""
        with torch.device(device):
            model = self.build(config)
        if str(device) != "meta" and seed is not None:
            self.init_weights(model, seed, config)
        return model

    def init_weights(self, model: nn.Module, seed: int, config: Any | None = None) -> None:
        """Initialize every parameter (or shard of one) this rank holds: see models/init.py."""
        config = config if config is not None else model.config
        init_parameters(model, seed, lambda name: self.init_std(name, config))


# ----------------------------------------------------------------------------- the registry
_FAMILIES: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Make a family findable by name, by its presets' names and (with `hf`) by config.json's model_type.
    Preset names are one namespace across families."""
    for other in _FAMILIES.values():
        if other.name != spec.name:
            clash = sorted(set(other.presets) & set(spec.presets))
            if clash:
                raise ValueError(
                    f"spec {spec.name!r}: preset {clash[0]!r} is already {other.name!r}'s; name it "
                    f"{spec.name}-{clash[0]}"
                )
    _FAMILIES[spec.name] = spec
    return spec


def families() -> dict[str, ModelSpec]:
    return dict(_FAMILIES)


def get_spec(name: str) -> ModelSpec:
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def spec_of(config: Any) -> ModelSpec:
    """The registered spec of a family's config (its `family` field)."""
    family = getattr(config, "family", None)
    if family is None:
        raise TypeError(f"{type(config).__name__} has no `family`: pass the model's ModelSpec explicitly")
    return get_spec(family)


def spec_for_hf(model_type: str, where: str) -> ModelSpec:
    for spec in _FAMILIES.values():
        if spec.hf is not None and spec.hf.model_type == model_type:
            return spec
    known = ", ".join(s.hf.model_type for s in _FAMILIES.values() if s.hf is not None)
    raise ValueError(f"{where}: model_type {model_type!r} is not supported; tessera reads {known}")


def all_presets() -> dict[str, tuple[ModelSpec, Any]]:
    return {name: (spec, cfg) for spec in _FAMILIES.values() for name, cfg in spec.presets.items()}


def get_preset(name: str, **overrides) -> Any:
    """A preset of any registered family by name (debug, 8b, qwen3-0.6b, ...), with fields replaced."""
    presets = all_presets()
    key = name.lower()
    if key not in presets:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(presets)}")
    return presets[key][0].config(key, **overrides)


def build_model(config: Any, device: Any = "cpu", seed: int | None = 0) -> nn.Module:
    """The one-process model of a registered family's config (or preset name)."""
    config = get_preset(config) if isinstance(config, str) else config
    return spec_of(config).build_model(config, device, seed)


def init_weights(model: nn.Module, seed: int) -> None:
    """Initialize a registered family's model (or a part of one) from `seed`."""
    spec_of(model.config).init_weights(model, seed)


def shape_of(model: Any) -> ModelShape:
    """The ModelShape the planner, the memory model and MFU count with, of a preset name (any registered
    family's), a family's config (found by its `family`) or a ModelShape (as it is). The config's
    max_seq_len gives the rotary tables' length when the family's shape leaves it out."""
    if isinstance(model, ModelShape):
        return model
    cfg = get_preset(model) if isinstance(model, str) else model
    shape = spec_of(cfg).shape(cfg)
    max_seq_len = getattr(cfg, "max_seq_len", 0)
    if not shape.max_seq_len and not shape.learned_positions and max_seq_len:
        shape = dataclasses.replace(shape, max_seq_len=max_seq_len)
    return shape
