"""What --optimizer muon changes in a rank's memory, for the planner (topology/estimators/planner.py's `_rank_memory`).

Muon (parallel/muon.py) keeps one momentum buffer per hidden weight matrix (the memory recipes mixed_muon and
fp32_muon count that on every parameter), but the parameters that stay on AdamW (embeddings, learned
positions, the head, norms, biases, MoE routers) keep Adam's two moments: `adamw_params_of` counts them, so
the planner adds their second moment back. And during the step the owner of a matrix gathers it whole, runs
Newton-Schulz on it and scatters it back: `largest_matrix_numel` is the whole matrix (or, under tp, stack of
experts, gathered whole as parallel/muon.py does) whose transient topology.memory.muon_gather_bytes counts.
"""

from __future__ import annotations

from tessera.topology.estimators.comm_model import stage_layer_counts
from tessera.topology.memory import get_recipe, muon_gather_bytes
from tessera.topology.schedules.schedule import stages_on_rank
from tessera.topology.shapes import as_shape, fsdp_shard_numel, layer_shard_groups, stage_param_shapes

# each Muon recipe, and the AdamW recipe its non-matrix parameters follow
MUON_RECIPES = {"mixed_muon": "mixed_adam", "fp32_muon": "fp32_adam"}


def adamw_params_of(
    shape, tp: int, pp: int, virtual: int, fsdp: int, pp_rank: int, ep: int = 1, placement: str = "loop"
) -> tuple[int, int]:
    """(before FSDP, after FSDP) the parameters on pipeline rank `pp_rank` that --optimizer muon leaves on
    AdamW, counted as planner.rank_params_of counts every parameter: each block's vectors (norms, biases,
    qk-norms) and router, and the first and last stages' embedding, positions, final norm and head."""
    cfg = as_shape(shape)
    n_stages = pp * virtual
    layers = stage_layer_counts(cfg.n_layers, n_stages)
    stages = stages_on_rank(pp_rank, pp, virtual, placement)
    n_blocks = sum(layers[s] for s in stages)
    groups = layer_shard_groups(cfg, tp, ep, fsdp)
    rest = [(r, c, n) for shapes, n in groups for r, c in shapes if c == 1]  # vectors are (n, 1)
    if cfg.n_experts:  # the router (E x dim, replicated over tp), in the block's own unit
        rest.append((cfg.n_experts, cfg.dim, fsdp))
    extra = [(r, c) for s in stages for u in stage_param_shapes(cfg, tp, s == 0, s == n_stages - 1, 0) for r, c in u]
    numel = n_blocks * sum(r * c for r, c, _ in rest) + sum(r * c for r, c in extra)
    sharded = n_blocks * sum(fsdp_shard_numel(r, c, n) for r, c, n in rest)
    return numel, sharded + sum(fsdp_shard_numel(r, c, fsdp) for r, c in extra)


def largest_matrix_numel(shape, tp: int = 1) -> int:
    """The largest parameter Muon orthogonalizes, whole (over every tp, FSDP and ep shard): an attention
    projection, a dense MLP matrix, a shared expert's, or under tp one MoE block's stack of routed experts
    (cut inside its matrices, it is gathered whole; without tp each rank orthogonalizes its own experts)."""
    cfg = as_shape(shape)
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    mlp = cfg.n_experts * cfg.ffn_dim if cfg.n_experts and tp > 1 else cfg.ffn_dim
    return cfg.dim * max(q, kv, mlp, cfg.shared_ffn_dim)


def recipe_for(element_bytes: int, optimizer: str) -> str:
    """The memory recipe of a run: mixed (bf16 elements) or fp32, Adam or Muon (`--optimizer adamw|muon`)."""
    return f"{'mixed' if element_bytes == 2 else 'fp32'}_{'muon' if optimizer == 'muon' else 'adam'}"


def muon_extra_bytes(
    shape,
    recipe: str,
    tp: int,
    pp: int,
    virtual: int,
    fsdp: int,
    pp_rank: int,
    ep: int = 1,
    placement: str = "loop",
    sharded: bool = True,
) -> tuple[float, float]:
    """What a Muon recipe's per-parameter count leaves out on pipeline rank `pp_rank`: (the second Adam moment
    of the parameters AdamW keeps, FSDP-sharded or not; the largest matrix an owner gathers whole at the step)."""
    adam, muon = get_recipe(MUON_RECIPES[recipe]), get_recipe(recipe)
    rest, rest_sharded = adamw_params_of(shape, tp, pp, virtual, fsdp, pp_rank, ep, placement)
    moment = (rest_sharded if sharded else rest) * (adam.optimizer - muon.optimizer)
    return float(moment), float(muon_gather_bytes(largest_matrix_numel(shape, tp)))
