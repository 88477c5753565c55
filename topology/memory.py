"""Model-state memory per rank under ZeRO stages and FSDP strategies.

Model states are parameters, gradients and optimizer state (fp32 master copy and Adam moments where the
recipe has them). Activations, communication buffers and allocator slack come on top and are not
modelled here. Figures are in bytes; the CLI prints decimal GB (1e9) as the ZeRO analysis does.

ZeRO stage k shards, over the data-parallel ranks that hold identical parameters:
    0: nothing (DDP)    1: optimizer state    2: + gradients    3: + parameters
FSDP strategies map onto stages: NO_SHARD = 0, SHARD_GRAD_OP = 2, FULL_SHARD = 3, and HYBRID_SHARD = 3
within a shard group (dp_shard ranks) with replicas across dp_replicate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each model-state component."""

    parameters: int
    gradients: int
    optimizer: int
    description: str
    master: int = 0  # of `optimizer`, the bytes of an fp32 master copy of the parameters

    @property
    def bytes_per_param(self) -> int:
        return self.parameters + self.gradients + self.optimizer


RECIPES: dict[str, Recipe] = {
    # bf16/fp16 weights and gradients, fp32 master weights + Adam m and v (4 + 4 + 4): the ZeRO paper's 16 B
    "mixed_adam": Recipe(2, 2, 12, "bf16 params + bf16 grads + fp32 master and Adam moments", master=4),
    # fp32 weights and gradients; Adam m and v in fp32, no separate master copy
    "fp32_adam": Recipe(4, 4, 8, "fp32 params + fp32 grads + fp32 Adam moments"),
    # bf16 params and grads with an fp32 master, fp32 Adam moments, and fp32 gradient accumulation buffer
    "mixed_adam_fp32_grads": Recipe(2, 4, 12, "bf16 params + fp32 grads + fp32 master and Adam moments", master=4),
    # --optimizer muon: one fp32 momentum buffer instead of Adam's two moments, counted on every parameter
    # (the embeddings, head and norms that stay on AdamW hold 4 B more each: an under-count of their share)
    "mixed_muon": Recipe(2, 2, 8, "bf16 params + bf16 grads + fp32 master and Muon momentum", master=4),
    "fp32_muon": Recipe(4, 4, 4, "fp32 params + fp32 grads + fp32 Muon momentum"),
}


def muon_gather_bytes(largest_matrix_numel: int, elem_bytes: int = 4) -> int:
    """The transient bytes a Muon owner holds while orthogonalizing its largest matrix whole: the gathered
    update, its Newton-Schulz iterate and the scattered pieces (about three copies), on top of the model states."""
    return 3 * largest_matrix_numel * elem_bytes


# which components each ZeRO stage shards
SHARDED_BY_STAGE: dict[int, frozenset[str]] = {
    0: frozenset(),
    1: frozenset({"optimizer"}),
    2: frozenset({"optimizer", "gradients"}),
    3: frozenset({"optimizer", "gradients", "parameters"}),
}

# the FSDP strategies tessera runs (parallel/fsdp.py) and the ZeRO stage each is; the activation checkpointing
# modes (none, every block, every other block, every block keeping its matmuls): one list for the training
# checks, the planner and the memory model
FSDP_STRATEGIES: dict[str, int] = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3}
AC_MODES: tuple[str, ...] = ("none", "full", "selective", "op")
# `--offload` (parallel/offload.py): none; optimizer (AdamW's moments, an fp32 copy of each shard and a gradient
# buffer in host memory, stepped there; weights and gradients stay on the GPU); params (FSDP2's CPUOffloadPolicy:
# parameter shards, gradients and optimizer state in host memory, the step there)
OFFLOAD_MODES: tuple[str, ...] = ("none", "optimizer", "params")


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown memory recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


def zero_stage_of(strategy: str) -> int:
    key = strategy.upper()
    if key not in FSDP_STRATEGIES:
        raise ValueError(f"unknown FSDP strategy {strategy!r}; choose one of {', '.join(FSDP_STRATEGIES)}")
    return FSDP_STRATEGIES[key]


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name}={value!r} must be a positive finite number")
    return value


def model_state_bytes(
    num_params: float,
    dp: int = 1,
    zero_stage: int | None = None,
    recipe: str = "mixed_adam",
    *,
    strategy: str | None = None,
    shard_size: int | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    expert_params: float = 0.0,
) -> dict[str, float]:
    """Per-rank model-state bytes: {"parameters", "gradients", "optimizer", "total"}.

    num_params: parameters of the whole model. dp: data-parallel ranks holding identical parameters.
    zero_stage (0-3) or strategy (an FSDP name) picks what is sharded. HYBRID_SHARD shards over
    `shard_size` ranks (the dp_shard degree) and replicates across the rest. tp and pp divide the
    parameters first (each rank holds 1/(tp*pp) of the model, an even split). Expert parallel: of the
    parameters, `expert_params` (the routed experts, ModelShape.expert_params) are split over ep as well
    and sharded over the shard group's ep-th part (the ranks ep leaves: edp); ep borrows the shard group's
    ranks, so it must divide it.

    >>> round(model_state_bytes(70e9, dp=256, zero_stage=3)["total"] / 1e9, 2)
    4.38
    """
    _positive("num_params", num_params)
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if (
        isinstance(expert_params, bool)
        or not isinstance(expert_params, (int, float))
        or not 0 <= expert_params <= num_params
    ):
        raise ValueError(f"expert_params={expert_params!r} must be between 0 and num_params={num_params!r}")
    if strategy is not None and zero_stage is not None:
        raise ValueError("give zero_stage or strategy, not both")
    stage = zero_stage_of(strategy) if strategy is not None else (0 if zero_stage is None else zero_stage)
    if stage not in SHARDED_BY_STAGE:
        raise ValueError(f"zero_stage={stage!r} must be 0, 1, 2 or 3")
    shard = dp
    if strategy is not None and strategy.upper() == "HYBRID_SHARD":
        if shard_size is None or dp % shard_size:
            raise ValueError(
                f"HYBRID_SHARD needs shard_size dividing dp={dp} (the dp_shard degree), got {shard_size!r}"
            )
        shard = shard_size
    if ep > 1 and shard % ep:
        raise ValueError(
            f"ep={ep} must divide the {shard} ranks parameters are sharded over (dp_shard x cp): "
            f"ep borrows them; use an ep dividing {shard}"
        )
    r = get_recipe(recipe)
    dense, experts = (num_params - expert_params) / (tp * pp), expert_params / (tp * pp * ep)
    out: dict[str, float] = {}
    for component in ("parameters", "gradients", "optimizer"):
        b = getattr(r, component)
        out[component] = (
            (dense / shard + experts / (shard // ep)) * b
            if component in SHARDED_BY_STAGE[stage]
            else (dense + experts) * b
        )
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer"]
    return out


def offload_split(states: dict[str, float], offload: str, recipe: str = "fp32_adam") -> dict[str, dict[str, float]]:
    """Where a rank's model states live under `offload`: {"device": {...}, "host": {...}}, each with the
    components of `states` (model_state_bytes' per-rank figures) and its "total".

    optimizer: the moments go to the host, with an fp32 copy of the shard the optimizer updates (unless the
    recipe's optimizer state already holds that master copy, as mixed_adam's 12 B do) and a 4-byte gradient
    buffer the gradients are copied into; the device keeps parameters and gradients. params: every component
    goes to the host (the device holds gathered units only, counted with the activations).

    >>> s = model_state_bytes(8e9, dp=1, zero_stage=3, recipe="fp32_adam")
    >>> {k: round(v["total"] / 1e9) for k, v in offload_split(s, "optimizer").items()}
    {'device': 64, 'host': 128}
    """
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload={offload!r} is not one of {', '.join(OFFLOAD_MODES)}: use one of them")
    r = get_recipe(recipe)
    components = ("parameters", "gradients", "optimizer")
    device = {c: float(states[c]) for c in components}
    host = dict.fromkeys(components, 0.0)
    if offload == "optimizer":
        elements = states["optimizer"] / r.optimizer  # what the optimizer steps on this rank
        host["optimizer"] = device.pop("optimizer") + elements * (0 if r.master else 4)
        host["gradients"] = states["gradients"] / r.gradients * 4  # the host buffer the gradients land in
        device["optimizer"] = 0.0
    elif offload == "params":
        host, device = device, dict.fromkeys(components, 0.0)
    for side in (device, host):
        side["total"] = sum(side[c] for c in components)
    return {"device": device, "host": host}


def min_gpus(num_params: float, gpu_memory_gb: float, recipe: str = "mixed_adam") -> int:
    """The raw floor: GPUs needed to hold the model states alone when fully sharded (no activations)."""
    _positive("gpu_memory_gb", gpu_memory_gb)
    total = _positive("num_params", num_params) * get_recipe(recipe).bytes_per_param
    return math.ceil(total / (gpu_memory_gb * GB) - 1e-9)


def parameter_count(n: float) -> str:
    """A parameter count as people write it: 70B, 8.03B, 66.1M, 131.8K, 12."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def gigabytes(n_bytes: float) -> str:
    """Bytes in decimal GB: two decimals; three significant digits below 0.1 GB (a small model's states are not
    0.00 GB); scientific notation from 10 million GB on, so a cell stays short."""
    gb = n_bytes / GB
    if gb >= 1e7:
        return f"{gb:.3e}"
    return f"{gb:.2f}" if gb >= 0.1 or gb == 0 else f"{gb:.3g}"


def memory_table(num_params: float, dp: int, recipe: str = "mixed_adam", gpu_memory_gb: float | None = None) -> str:
    """The ZeRO table of the reference chapter: per-rank GB for stages 0-3, one row per component."""
    r = get_recipe(recipe)
    stages = [model_state_bytes(num_params, dp=dp, zero_stage=s, recipe=recipe) for s in range(4)]
    names = {0: "ZeRO-0", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    fsdp = {0: "NO_SHARD", 1: "-", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
    lines = [
        f"model states per rank: {parameter_count(num_params)} parameters, dp={dp}, recipe {recipe} "
        f"({r.parameters}+{r.gradients}+{r.optimizer} = {r.bytes_per_param} bytes/parameter: {r.description})",
        f"{'':<12}" + "".join(f"{names[s]:>15}" for s in range(4)),
        f"{'FSDP':<12}" + "".join(f"{fsdp[s]:>15}" for s in range(4)),
    ]
    for component in ("parameters", "gradients", "optimizer", "total"):
        lines.append(f"{component:<12}" + "".join(f"{gigabytes(st[component]):>12} GB" for st in stages))
    if gpu_memory_gb is not None:
        total = num_params * r.bytes_per_param / GB
        floor = min_gpus(num_params, gpu_memory_gb, recipe)
        lines.append(
            f"raw floor: {floor} GPUs of {gpu_memory_gb:g} GB hold the {gigabytes(total * GB)} GB of model states "
            f"(fully sharded, before activations and buffers)"
        )
    return "\n".join(lines)
