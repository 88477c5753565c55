"""Data parallel: FSDP2 (`fully_shard`) over the data axes, with activation checkpointing.

Sharding runs over the flattened ("dp_shard", "cp") mesh: cp ranks hold the same parameters, so they
shard them too. With dp_replicate > 1 the mesh is 2-D (dp_replicate, dp_shard_cp): HSDP, sharded within
a group and replicated across groups (gradients reduce-scattered in the group, all-reduced across).

The FSDP1 strategy names map onto FSDP2 settings as in the FSDP2 tutorial:
    FULL_SHARD      reshard_after_forward=True   (ZeRO-3)
    SHARD_GRAD_OP   reshard_after_forward=False  (ZeRO-2: parameters stay gathered from forward to backward)
    HYBRID_SHARD    FULL_SHARD on the 2-D (dp_replicate, dp_shard_cp) mesh (needs dp_replicate > 1)
    NO_SHARD        every dp rank a replica: the 2-D mesh with all dp ranks on dp_replicate (DDP)
With pp > 1 parameters are never resharded after forward (each microbatch's backward would re-gather).

Units are wrapped bottom-up: the embedding, each block, the final norm with the output head, the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tessera.models.moe import moe_blocks
from tessera.models.spec import spec_of
from tessera.topology import Layout
from tessera.topology.memory import AC_MODES, FSDP_STRATEGIES

from .offload import check_offload, fsdp_offload_policy
from .tp_plan import find_modules, replace_module, spec_plan

STRATEGIES = tuple(FSDP_STRATEGIES)  # FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (topology/memory.py)
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DataParallelConfig:
    strategy: str = "FULL_SHARD"
    mixed_precision: str = "fp32"  # parameters' compute dtype; gradients always reduce in fp32
    activation_checkpointing: str = "none"
    prefetch: int = 0  # explicit forward/backward prefetch of this many blocks (0: FSDP2's implicit prefetch)
    offload: str = "none"  # model states in host memory: none, optimizer or params (parallel/offload.py)


def check_data_parallel(config: DataParallelConfig, layout: Layout) -> None:
    """Raise ValueError naming the value and the fix; called before any process group starts."""
    if config.strategy not in STRATEGIES:
        raise ValueError(f"unknown FSDP strategy {config.strategy!r}; use one of {', '.join(STRATEGIES)}")
    if config.activation_checkpointing not in AC_MODES:
        raise ValueError(
            f"unknown activation checkpointing {config.activation_checkpointing!r}; use one of {', '.join(AC_MODES)}"
        )
    if config.mixed_precision not in PRECISIONS:
        raise ValueError(f"unknown mixed precision {config.mixed_precision!r}; use one of {', '.join(PRECISIONS)}")
    check_offload(config.offload)
    if config.prefetch < 0:
        raise ValueError(f"prefetch={config.prefetch} must be >= 0 (blocks to all-gather ahead)")
    if config.strategy == "HYBRID_SHARD" and layout.dp_replicate == 1:
        raise ValueError(
            f"HYBRID_SHARD needs replica groups: dp={layout.dp} with dp_replicate=1; "
            f"pass dp_replicate=R with R dividing {layout.dp} (e.g. dp_replicate=2), or use FULL_SHARD"
        )
    if config.strategy == "NO_SHARD" and layout.dp_shard > 1:
        raise ValueError(
            f"NO_SHARD replicates every dp rank: use dp_replicate={layout.dp} and dp_shard=1 "
            f"(layout_for_strategy(layout, 'NO_SHARD') gives that layout), not dp_shard={layout.dp_shard}"
        )


def layout_for_strategy(layout: Layout, strategy: str) -> Layout:
    """NO_SHARD puts every dp rank on dp_replicate; the other strategies keep the layout."""
    if strategy == "NO_SHARD" and layout.dp_shard > 1:
        d = layout.as_dict()
        d.update(dp_replicate=layout.dp, dp_shard=1)
        return Layout(**d)
    return layout


def _saved_by_op_policy() -> set:
    """The ops whose outputs `--ac op` keeps: matmuls and attention (torchtitan's policy); the norms,
    RoPE, SwiGLU's elementwise ops and the collectives are recomputed."""
    aten = torch.ops.aten
    ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.linear.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    tessera_ops = getattr(torch.ops, "tessera", None)
    if tessera_ops is not None and hasattr(tessera_ops, "flash_attention_fwd"):
        ops.add(tessera_ops.flash_attention_fwd.default)
    return ops


def _op_policy_context():
    saved = _saved_by_op_policy()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str, blocks: str = "layers.*") -> None:
    """full: recompute every block (the modules matching the plan pattern `blocks`) in backward.
    selective: every other block (half the activation memory saved at half the recompute).
    op: every block, but the outputs of its matmuls and attention are kept, so backward recomputes only
    the cheap ops (norms, RoPE, SwiGLU's elementwise ops) and the collectives between them.
    Wrapping keeps parameter names (checkpoint_wrapper's prefix is stripped from state dicts)."""
    if mode == "none":
        return

    for i, (name, block) in enumerate(find_modules(model, blocks)):
        if mode == "op":
            replace_module(
                model, name, checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_op_policy_context)
            )
        elif mode == "full" or i % 2 == 0:
            replace_module(model, name, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    config: DataParallelConfig,
    pipelined: bool = False,
    plan=None,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """fully_shard bottom-up over the data axes, in place: the plan's units in order (a family's spec:
    the embedding, each block, the final norm with the output head), then the root. `fsdp_mesh` is
    Meshes.fsdp (1-D, or 2-D for HSDP); parts a pipeline stage lacks are skipped. A unit that shares a
    parameter with another (a tied embedding and head) is left to the root: FSDP2 shards a tensor once.
    `expert_mesh` (expert parallel): each MoE block's experts are their own unit on it, inside their block's."""
    if plan is None:
        spec = spec_of(model.config)
        plan = spec_plan(spec, spec.shape(model.config), 1)
    reshard = config.strategy in ("FULL_SHARD", "HYBRID_SHARD") and not pipelined
    policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[config.mixed_precision], reduce_dtype=torch.float32)
    offload = fsdp_offload_policy(config.offload, fsdp_mesh.device_type)
    options: dict[str, Any] = dict(reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    if expert_mesh is not None:  # expert parallel: each MoE block's experts, sharded over what ep leaves
        for _, moe in moe_blocks(model):
            fully_shard(moe.experts, mesh=expert_mesh, **options)
    units = without_shared(plan.units(model))
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=fsdp_mesh, **options)
    fully_shard(model, mesh=fsdp_mesh, **options)
    if config.prefetch:
        blocks = _fsdp_units(
            [m for _, m in find_modules(model, plan.checkpoint_blocks)]
            if plan.checkpoint_blocks
            else [u[0] for u in units]
        )
        for i, block in enumerate(blocks):
            ahead = blocks[i + 1 : i + 1 + config.prefetch]
            behind = blocks[max(0, i - config.prefetch) : i][::-1]
            if ahead:
                block.set_modules_to_forward_prefetch(ahead)
            if behind:
                block.set_modules_to_backward_prefetch(behind)
    return model


def _fsdp_units(modules: list[nn.Module]) -> list[FSDPModule]:
    """The modules prefetch is set on, each an FSDP2 unit (fully_shard applied to it)."""
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"prefetch: {type(m).__name__} is not an FSDP2 unit (the plan's units are)")
    return [m for m in modules if isinstance(m, FSDPModule)]


def without_shared(units: list[list[nn.Module]]) -> list[list[nn.Module]]:
    owners: dict[int, set[int]] = {}
    for i, unit in enumerate(units):
        for m in unit:
            for p in m.parameters():
                owners.setdefault(id(p), set()).add(i)
    shared = {i for holders in owners.values() if len(holders) > 1 for i in holders}
    return [unit for i, unit in enumerate(units) if i not in shared]


def model_state_bytes_on_rank(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds now: parameters as registered on the modules (the gathered tensors of units
    that are unsharded, else the local shards), local gradient shards, and optimizer state shards."""

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optim += sum(local_bytes(v) for k, v in state.items() if torch.is_tensor(v) and k != "step")
    return {"parameters": params, "gradients": grads, "optimizer": optim, "total": params + grads + optim}
