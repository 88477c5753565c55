"""Expert parallel (and the tensor-parallel form of a mixture-of-experts block).

The ep ranks are a subgroup of dp_shard x cp (topology/axes.py: ep borrows them, cp innermost): the flattened
"dp_shard_cp" mesh is unflattened into (edp, ep), ep innermost. Each ep rank holds n_experts / ep experts of
every MoE block (a DTensor sharded on the expert dim, over the (ep, tp) mesh when tp is on), and FSDP2
shards them further over edp (with dp_replicate: HSDP), as torchtitan does.

A step of one MoE block on an ep rank (models/moe.py computes the routing; `AllToAllDispatch` is its
experts' `dispatch`):

    assignments sorted by expert --all-to-all (variable splits)--> my experts' tokens, from every ep rank
    --regroup by local expert--> grouped GEMMs --ungroup--> --all-to-all back--> combine at the source

The splits are exchanged first (one all-to-all of E counts). Backward runs the same all-to-alls with the
splits swapped. Gradients: each rank's experts see the tokens of all ep ranks, so FSDP2's mean over the ranks
holding the same experts (edp x dp_replicate) would count them ep times over; the experts' gradients are
scaled by 1/ep on the way (GroupedExperts.grad_scale), which makes it the mean over all data ranks, as for
every other parameter. Tensor parallel: each rank of a tp group dispatches the same tokens to its peers
of the same tp index, whose experts hold the same slice of ffn.

    op                   forward                      backward
    all_to_all           tokens to their experts      gradients back to the tokens
    RoutingComm (tp)     gather / copy the routing    reduce-scatter / all-reduce the weights' gradient
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tessera.models.init import one_process_name
from tessera.models.moe import MoE, moe_blocks, update_expert_bias
from tessera.topology.shapes import check_expert_parallel  # re-exported: the rule lives with the shapes

from .comm import collective
from .expert_simulated import simulated_dispatch
from .local_world import simulated_world
from .tensor import BlockInput, _all_gather, copy_to_tp, gather_sequence, reduce_from_tp, scatter_sequence

SEQ_DIM = 1


# ----------------------------------------------------------------------------- all-to-all with autograd
def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    with collective("all_to_all", "ep", group):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.splits, ctx.group), None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Rows of x: in_splits[i] of them to rank i; out_splits[i] rows come from rank i (autograd: the reverse)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatch(nn.Module):
    """The experts' dispatch under expert parallel: sorted assignments to the ranks that hold their experts
    and the results back (see the module docstring). `sent` and `received`: the rows of the last call."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int):
        super().__init__()
        self.group, self.n_experts = group, n_experts
        self.size = dist.get_world_size(group)
        self.sent, self.received = 0, 0

    def forward(self, x: Tensor, counts: Tensor, run_experts) -> Tensor:
        if simulated_world() is not None:  # every rank's routing held here: equal splits, padded (module doc)
            out, (self.sent, self.received) = simulated_dispatch(x, counts, run_experts, self.group, self.n_experts)
            return out
        P, local = self.size, self.n_experts // self.size
        # how many rows each rank sends me for each of my experts: (P, local)
        recv_counts = counts.new_empty(P * local)
        with collective("all_to_all", "ep", self.group):
            dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        recv_counts = recv_counts.view(P, local)
        in_splits = counts.view(P, local).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        self.sent, self.received = sum(in_splits) - in_splits[dist.get_rank(self.group)], sum(out_splits)
        received = all_to_all(x, out_splits, in_splits, self.group)  # by source rank, then by expert
        segment = torch.repeat_interleave(torch.arange(P * local, device=x.device), recv_counts.flatten())
        order = torch.argsort((segment % local) * P + segment // local, stable=True)  # by expert, then source
        out = run_experts(received[order], recv_counts.sum(0))
        out = torch.empty_like(out).index_copy_(0, order, out)
        return all_to_all(out, in_splits, out_splits, self.group)

    def extra_repr(self) -> str:
        return f"all-to-all over {self.size} ep ranks, {self.n_experts // self.size} experts each"


# ----------------------------------------------------------------------------- tensor parallel of the block
class RoutingComm(nn.Module):
    """The routing of the tokens the experts see under tp: gathered along the sequence (sequence parallel:
    each rank routed its own tokens) or as it is (every rank routed all of them). The weights' gradient is
    a partial sum on each rank (the experts' outputs are), so it is reduce-scattered or all-reduced."""

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, weights: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        if self.sequence_parallel:
            return gather_sequence(weights, self.group), _all_gather(ids, SEQ_DIM, self.group)
        return copy_to_tp(weights, self.group), ids


class OutputReduce(nn.Module):
    """The experts' partial outputs summed over tp: all-reduce, or reduce-scatter onto sequence shards."""

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return scatter_sequence(x, self.group) if self.sequence_parallel else reduce_from_tp(x, self.group)


class SequenceSum(nn.Module):
    """Per-sequence expert counts summed over the ranks that hold parts of each sequence (cp), for the
    sequence-level auxiliary loss (no gradient: counts)."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, counts: Tensor) -> Tensor:
        counts = counts.clone()
        with collective("all_reduce", "cp", self.group):
            dist.all_reduce(counts, group=self.group)
        return counts


def apply_moe_tp(block: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool) -> MoE:
    """The "moe" style: one input gather (or copy), the routing with it, one output reduce."""
    group = tp_mesh.get_group()
    block.input_comm = BlockInput(group, sequence_parallel)
    block.routing_comm = RoutingComm(group, sequence_parallel)
    block.output_comm = OutputReduce(group, sequence_parallel)
    return block


# the stacked weights and the dim of each that holds ffn (split over tp)
EXPERT_WEIGHTS = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}


def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None) -> nn.Module:
    """The experts' stacked weights as DTensors: split on the expert dim over ep and on ffn over tp (a mesh
    of the two when both are on). Each rank keeps only its piece (no communication on the meta device)."""
    meshes = [m for m in (ep_mesh, tp_mesh) if m is not None]
    if not meshes:
        return experts
    mesh = meshes[0] if len(meshes) == 1 else DeviceMesh._concatenate(meshes)
    # the module's own stacked parameters (gpt-oss's fused layout and biases: GroupedExperts.ffn_dims)
    for name, ffn_dim in getattr(experts, "ffn_dims", EXPERT_WEIGHTS).items():
        p = getattr(experts, name)
        full = p.full_tensor() if isinstance(p, DTensor) and p.device.type != "meta" else p
        if isinstance(full, DTensor):  # on meta: the global tensor's shape is all there is
            full = torch.empty(p.shape, dtype=p.dtype, device="meta")
        split = Shard(ffn_dim) if ffn_dim is not None else Replicate()  # None: whole on every tp rank
        placements = ([Shard(0)] if ep_mesh is not None else []) + ([split] if tp_mesh is not None else [])
        setattr(experts, name, nn.Parameter(distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)))
    return experts


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> nn.Module:
    """Expert parallel on every MoE block of a model (or pipeline stage), in place: its experts sharded over
    `ep_mesh` (and tp), its dispatch an all-to-all, their gradients scaled by 1/ep (module docstring)."""
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    for _, block in moe_blocks(model):
        check_expert_parallel(block.n_experts, ep, ep)
        shard_experts(block.experts, ep_mesh, tp_mesh)
        block.experts.dispatch = AllToAllDispatch(group, block.n_experts)
        block.experts.grad_scale = 1.0 / ep
    return model


def apply_sequence_sum(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Context parallel splits each sequence: the MoE blocks sum their per-sequence counts over cp."""
    for _, block in moe_blocks(model):
        block.sequence_sum = SequenceSum(cp_mesh.get_group())


# ----------------------------------------------------------------------------- load balance over the mesh
def block_index(name: str, pattern: str) -> int:
    """The layer of an MoE block's name: the number where its spec pattern has `*` (layers.*.mlp)."""
    parts, segs = pattern.split("."), one_process_name(name).split(".")
    return next(int(s) for p, s in zip(parts, segs) if p == "*" and s.isdigit())


def expert_load(
    parts: list[nn.Module],
    pattern: str,
    n_layers: int,
    tp_rank: int,
    sequence_parallel: bool,
    group: dist.ProcessGroup | None = None,
    n_experts: int = 0,
) -> tuple[Tensor, Tensor] | None:
    """(tokens routed to each expert (n_layers, E), the auxiliary loss's sum over sequences (n_layers,)) of
    the whole step on every rank, summed from every rank's MoE counters in one all-reduce; None without
    MoE blocks. A tp group routes the same tokens (counted once, on tp rank 0), and without sequence
    parallel computes the same auxiliary loss (counted once too); pipeline stages fill their own layers.
    `n_experts` (the model's): a pipeline stage without MoE blocks (DeepSeek-V3's dense first layers) still
    joins the all-reduce, with zeros."""
    blocks = [(n, b) for part in parts for n, b in moe_blocks(part)]
    if not blocks and not n_experts:
        return None
    E = blocks[0][1].n_experts if blocks else n_experts
    device = blocks[0][1].tokens_per_expert.device if blocks else next(p for m in parts for p in m.parameters()).device
    table = torch.zeros(n_layers, E + 1, device=device)
    for name, block in blocks:
        row = table[block_index(name, pattern)]
        if tp_rank == 0:
            row[:E] += block.tokens_per_expert
        if tp_rank == 0 or sequence_parallel:
            row[E] += block.aux_loss_sum
    with collective("all_reduce (expert load)", "world", group):
        dist.all_reduce(table, group=group)
    return table[:, :E], table[:, E]


def update_biases(parts: list[nn.Module], pattern: str, tokens: Tensor) -> None:
    """The auxiliary-loss-free step of every MoE block here, from the step's global counts (same on every
    rank, so every replica of a block moves its bias alike)."""
    for part in parts:
        for name, block in moe_blocks(part):
            update_expert_bias(block, tokens[block_index(name, pattern)])


def load_report(tokens: Tensor, aux_sum: Tensor, sequences: int) -> dict:
    """The record's "moe" entry: per-layer expert token counts, each layer's max/mean imbalance (1.0: perfectly
    balanced), the worst layer's, and the auxiliary loss (mean over the step's sequences, summed over layers)."""
    mean = tokens.mean(dim=1).clamp_min(1e-9)
    imbalance = tokens.max(dim=1).values / mean
    return {
        "tokens_per_expert": tokens.round().long().tolist(),
        "imbalance": [round(x, 4) for x in imbalance.tolist()],
        "max_imbalance": float(imbalance.max()),
        "aux_loss": float(aux_sum.sum() / max(1, sequences)),
    }
