"""Mixture of experts: a token-choice top-k router, routed experts run as grouped GEMMs, an optional shared
expert, the sequence-level auxiliary loss and DeepSeek-V3's auxiliary-loss-free bias. Dropless: every
token reaches each of its k experts, however unbalanced the routing.

    x (B, S, D) -> router: scores s = softmax(x Wg^T) or sigmoid(...), top-k of s + bias, weights = s at
                   the chosen experts (normalized over k when `norm_topk`)
                -> assignments sorted by expert -> dispatch (identity here; all-to-all over the ep ranks
                   under expert parallelism, parallel/expert.py) -> each expert's SwiGLU as grouped GEMMs
                -> combine: y[t] = sum_j weight[t, j] * expert_j(x[t])   (+ shared expert(x))

The block knows no parallelism; it has slots that parallel/ fills, each the identity on one process:
    input_comm      the tokens the experts see: copied to / gathered over the tp ranks
    routing_comm    the routing (weights, expert ids) for those tokens: the same copy / gather
    output_comm     the experts' partial outputs summed over tp (all-reduce or reduce-scatter)
    sequence_sum    per-sequence expert counts summed over the ranks that split a sequence (cp)
    experts.dispatch  how sorted assignments reach their experts (ExpertDispatch here)

Auxiliary loss (DeepSeek-V3, eq. 17-20), per sequence of T tokens and per layer:
    f_i = E / (k T) * (tokens of the sequence routed to expert i),   P_i = 1/T * sum_t s'_{t,i}
    L = coef * sum_i f_i P_i, averaged over the sequences of the batch
(s' = scores normalized over the experts). It enters backward without changing the model's outputs: the
block attaches its gradient to its output (`_AttachAuxLoss`), weighted by `aux_weight` (1 / sequences of the
call by default; the runners set grad_scale / the global batch's sequences), so every layout, pipeline
stage and recomputation gets the same gradient. The bias (`expert_bias`) only steers the choice of experts,
never the weights; `update_expert_bias` moves it after each step by `bias_rate` toward balance.

Counters for load balance: `tokens_per_expert` (this rank's routed assignments since the last reset, as
the experts see them) and `aux_loss_sum` (this rank's share of the auxiliary loss, summed over sequences).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd import Function

from tessera.kernels.dispatch import swiglu

from .mlp import SwiGLU, clamped_swiglu, swiglu_tp_plan
from .spec import TPPlan, prefixed

SCORE_FUNCS = ("softmax", "sigmoid")


def _local(t: Tensor) -> Tensor:
    """A parameter's local tensor (a DTensor's shard, e.g. this rank's experts under ep)."""
    return t.to_local() if hasattr(t, "to_local") else t


def grouped_mm_supported(x: Tensor, w: Tensor) -> bool:
    """Whether torch._grouped_mm runs x (M, K) @ w (G, K, N) here: CUDA with compute capability >= 9.0
    (H100, H200), bf16, and every stride a multiple of 16 bytes (K and N multiples of 8)."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.shape[-1] % 8 == 0
        and w.shape[-1] % 8 == 0
    )


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, use_grouped: bool | None = None) -> Tensor:
    """Rows of x grouped by expert (counts[g] rows for group g, in order) times w[g] (G, K, N): (M, N).

    torch._grouped_mm where the device supports it (one kernel for every group), else one matmul per group
    (the same product: each row meets one matrix). An empty group contributes nothing."""
    if use_grouped is None:
        use_grouped = grouped_mm_supported(x, w)
    if use_grouped:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    sizes = counts.tolist()
    parts = [x_g @ w[g] for g, x_g in enumerate(x.split(sizes)) if sizes[g]]
    # no rows at all: still a product of x and w, so backward reaches them (under expert parallel every rank
    # must run the all-to-alls of backward, whether or not its experts got tokens)
    return torch.cat(parts) if parts else x[:0] @ w[0]


class ExpertDispatch(nn.Module):
    """One process (or ep 1): the sorted assignments are already with their experts."""

    def forward(self, x: Tensor, counts: Tensor, run_experts) -> Tensor:
        return run_experts(x, counts)


class GroupedExperts(nn.Module):
    """n_experts SwiGLU experts as stacked weights: gate_proj, up_proj (E, ffn, dim) and down_proj
    (E, dim, ffn) (nn.Linear's (out, in) per expert, as transformers stores them). Under expert parallelism
    each rank holds E / ep of them (a DTensor sharded on dim 0); under tp each expert's ffn is split.

    gpt-oss's options: `fused_gate_up`, the layout transformers' GptOssExperts stores: gate_up_proj
    (E, dim, 2 ffn) with gate and up interleaved on the last dim (columns 2i and 2i+1 are unit i's, so a tp
    split of contiguous columns keeps the pairs) and down_proj (E, ffn, dim), both (in, out); `bias`: a bias
    (E, out features) beside each weight, `<weight>_bias`; `swiglu_clamp`: (alpha, limit) of
    mlp.clamped_swiglu (None: silu(gate) * up)."""

    def __init__(
        self,
        n_experts: int,
        dim: int,
        ffn_dim: int,
        fused_gate_up: bool = False,
        bias: bool = False,
        swiglu_clamp: tuple[float, float] | None = None,
    ):
        super().__init__()
        self.n_experts, self.fused_gate_up, self.swiglu_clamp = n_experts, fused_gate_up, swiglu_clamp
        # each stacked parameter -> its dim that holds ffn (split over tp); None: not split (the down bias)
        self.ffn_dims: dict[str, int | None]
        if fused_gate_up:
            self.gate_up_proj = nn.Parameter(torch.empty(n_experts, dim, 2 * ffn_dim))
            self.down_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
            self.ffn_dims = {"gate_up_proj": 2, "down_proj": 1}
        else:
            self.gate_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
            self.up_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
            self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
            self.ffn_dims = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}
        if bias:
            for name in list(self.ffn_dims):
                down = name == "down_proj"
                setattr(
                    self,
                    f"{name}_bias",
                    nn.Parameter(torch.empty(n_experts, dim if down else ffn_dim * (1 + fused_gate_up))),
                )
                self.ffn_dims[f"{name}_bias"] = None if down else 1
        # the down bias as each rank adds it: itself on one process; under tp its 1/tp share (parallel/tp_plan.py)
        self.down_bias_comm: nn.Module | None = nn.Identity() if bias else None
        self.dispatch: nn.Module = ExpertDispatch()
        self.use_grouped_mm: bool | None = None  # None: torch._grouped_mm where supported (grouped_mm_supported)
        self.ran_grouped_mm = False  # what the last forward ran: grouped kernel or the per-expert loop
        self.grad_scale = 1.0  # the weights' gradients are multiplied by it (expert parallel: 1 / ep)

    def run_local(self, x: Tensor, counts: Tensor) -> Tensor:
        """This rank's experts on their tokens: x (M, dim) grouped by local expert, counts (local experts,)."""
        w = {
            name: _local(p) if self.grad_scale == 1.0 else _ScaleGrad.apply(_local(p), self.grad_scale)
            for name, p in ((n, getattr(self, n)) for n in self.ffn_dims)
        }
        first = w["gate_up_proj" if self.fused_gate_up else "gate_proj"]
        use = self.use_grouped_mm if self.use_grouped_mm is not None else grouped_mm_supported(x, first)
        self.ran_grouped_mm = bool(use)

        def project(h: Tensor, name: str, transposed: bool) -> Tensor:
            out = grouped_mm(h, w[name].transpose(-2, -1) if transposed else w[name], counts, use)
            bias = w.get(f"{name}_bias")
            if bias is None:
                return out
            if name == "down_proj" and self.down_bias_comm is not None:
                bias = self.down_bias_comm(bias)
            return out + torch.repeat_interleave(bias, counts, dim=0, output_size=h.shape[0]).to(out.dtype)

        if self.fused_gate_up:
            gate_up = project(x, "gate_up_proj", False)
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = project(x, "gate_proj", True), project(x, "up_proj", True)
        h = swiglu(gate, up) if self.swiglu_clamp is None else clamped_swiglu(gate, up, *self.swiglu_clamp)
        return project(h, "down_proj", not self.fused_gate_up)

    # eager under torch.compile: the groups' sizes are data (host-read for the loop, all-to-all splits under
    # ep), and compiled blocks would re-trace them every step. torch's own lazy form of torch.compiler.disable:
    # the decorator imports dynamo when first called, not here (1.7 CPU seconds in every process that imports
    # tessera.models, each `tessera` command and each rank server among them, where nothing compiles)
    @torch._disable_dynamo
    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (M, dim): every assignment of this rank's tokens, sorted by (global) expert; counts (E,)."""
        return self.dispatch(x, counts, self.run_local)


class _ScaleGrad(Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


# DeepSeek's shared expert: a dense SwiGLU MLP every token passes through beside its routed experts
SharedExpert = SwiGLU


class _AttachAuxLoss(Function):
    """Forward: `out` unchanged. Backward: `out`'s gradient, and d(loss)/d(aux) = weight for `aux`, so the
    auxiliary loss is trained without passing through the model's outputs (Megatron's aux-loss scaler)."""

    @staticmethod
    def forward(ctx, out, aux, weight):
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


def route(
    logits: Tensor,
    top_k: int,
    score_func: str = "softmax",
    norm_topk: bool = True,
    bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(scores (N, E), expert ids (N, k), weights (N, k)) of router logits (N, E), in fp32 (or the logits'
    wider dtype). The bias only
    steers which experts are chosen; the weights are the scores of the chosen ones, times `scale`.

    Group-limited routing (DeepSeek-V3, as transformers' DeepseekV3TopkRouter), with n_group > 1: the experts
    split into n_group groups of consecutive ids, each group scored by the sum of its two best biased scores,
    and only the topk_group best groups' experts eligible."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least (fp64 stays)
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    choose = scores if bias is None else scores + bias.to(scores.dtype)
    if n_group > 1:
        grouped = choose.view(*choose.shape[:-1], n_group, -1)
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(-1), topk_group, dim=-1).indices
        eligible = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best, True)
        choose = grouped.masked_fill(~eligible.unsqueeze(-1), float("-inf")).view_as(choose)
    ids = torch.topk(choose, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, ids)
    if norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if score_func == "sigmoid" else 0.0))
    return scores, ids, weights * scale if scale != 1.0 else weights


def check_groups(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """ValueError naming the field for a group-limited routing that cannot choose top_k experts (a config's
    and the block's check)."""
    if n_group < 1 or n_experts % n_group:
        raise ValueError(
            f"n_group={n_group} must divide n_experts={n_experts}; use a divisor of {n_experts} (1: no groups)"
        )
    if n_group == 1:
        return
    per_group = n_experts // n_group
    if per_group < 2:  # a group is scored by its two best experts
        raise ValueError(f"n_group={n_group} leaves {per_group} expert per group; groups need 2 or more")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={n_group}")
    if top_k > topk_group * per_group:
        raise ValueError(
            f"top_k={top_k} is more than the topk_group={topk_group} groups of {per_group} experts hold; "
            f"use top_k <= {topk_group * per_group} or a larger topk_group"
        )


class MoE(nn.Module):
    """The mixture-of-experts block (the module a family puts where its MLP goes; the spec's `moe`)."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        score_func: str = "softmax",
        norm_topk: bool = True,
        shared_ffn_dim: int = 0,
        aux_loss_coef: float = 0.0,
        bias_rate: float = 0.0,
        bias: bool = False,
        fused_gate_up: bool = False,
        swiglu_clamp: tuple[float, float] | None = None,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
    ):
        """`bias`, `fused_gate_up`, `swiglu_clamp`: gpt-oss's router and experts (a router with a bias, experts
        with biases in transformers' fused gate_up layout and the clamped SwiGLU: GroupedExperts); the
        defaults are Qwen3-MoE's and DeepSeek-V3's block. `n_group`, `topk_group`, `routed_scaling_factor`:
        DeepSeek-V3's group-limited routing and the factor its routed weights are multiplied by (`route`)."""
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={score_func!r}: use one of {', '.join(SCORE_FUNCS)}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.n_experts, self.top_k, self.score_func, self.norm_topk = n_experts, top_k, score_func, norm_topk
        self.aux_loss_coef, self.bias_rate = aux_loss_coef, bias_rate
        check_groups(n_experts, top_k, n_group, topk_group)
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.gate = nn.Linear(dim, n_experts, bias=bias)  # the router (transformers' name)
        self.experts = GroupedExperts(n_experts, dim, ffn_dim, fused_gate_up, bias, swiglu_clamp)
        self.shared_expert: nn.Module | None = SharedExpert(dim, shared_ffn_dim) if shared_ffn_dim else None
        # the aux-loss-free bias: a buffer (checkpointed, not trained by the optimizer)
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.aux_weight: float | None = None  # d(training loss)/d(aux of one sequence); None: 1 / rows
        self.input_comm: nn.Module = nn.Identity()
        self.output_comm: nn.Module = nn.Identity()
        self.routing_comm: nn.Module = _Pass()
        self.sequence_sum: nn.Module = nn.Identity()

    def reset_buffers(self, device: torch.device) -> None:
        """The counters and the bias on `device`, zero (at initialization: init_parameters calls it)."""
        self.tokens_per_expert = torch.zeros(self.n_experts, device=device)
        self.aux_loss_sum = torch.zeros((), device=device)
        self.expert_bias = torch.zeros(self.n_experts, device=device)  # a checkpoint's is loaded after

    def forward(self, x: Tensor) -> Tensor:
        B, S, D = x.shape
        k, E = self.top_k, self.n_experts
        scores, ids, weights = route(
            self.gate(x).reshape(B * S, E),
            k,
            self.score_func,
            self.norm_topk,
            self.expert_bias,
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor,
        )
        weights, ids = self.routing_comm(weights.view(B, S, k), ids.view(B, S, k))
        h = self.input_comm(x)  # the tokens the experts see: (B, S', D), S' = S, or S x tp gathered
        tokens = h.reshape(-1, D)
        flat_ids = ids.reshape(-1)
        counts = torch.bincount(flat_ids, minlength=E)
        recomputing = torch._C._current_graph_task_id() != -1  # activation checkpointing's second forward
        # counted once per forward, not again when activation checkpointing recomputes it; the add runs either
        # way, so a recomputation issues the same ops as the forward (selective checkpointing matches them)
        self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype), alpha=0.0 if recomputing else 1.0)
        order = torch.argsort(flat_ids, stable=True)
        out_sorted = self.experts(tokens[order // k], counts)
        out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)  # back to (token, j) order
        out = (out.view(-1, k, D) * weights.reshape(-1, k, 1).to(out.dtype)).sum(1).view(h.shape)
        out = self.output_comm(out)
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = self._attach_aux_loss(out, scores.view(B, S, E), ids, recomputing)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def _attach_aux_loss(self, out: Tensor, scores: Tensor, ids: Tensor, recomputing: bool) -> Tensor:
        """This rank's share of the sequence-level auxiliary loss, attached to `out`'s backward."""
        k, E = self.top_k, self.n_experts
        rows = ids.shape[0]
        with torch.no_grad():  # per sequence: assignments to each expert over the whole sequence
            per_row = torch.zeros(rows, E, device=ids.device).scatter_add_(
                1, ids.reshape(rows, -1), torch.ones(ids.reshape(rows, -1).shape, device=ids.device)
            )
            per_row = self.sequence_sum(per_row)
            T = per_row.sum(-1, keepdim=True) / k  # tokens of each whole sequence
            f = per_row * E / (k * T)
        normalized = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        share = self.aux_loss_coef * (f * normalized.sum(1) / T).sum()  # this rank's tokens' part
        self.aux_loss_sum.add_(share.detach(), alpha=0.0 if recomputing else 1.0)
        weight = self.aux_weight if self.aux_weight is not None else 1.0 / rows
        return _AttachAuxLoss.apply(out, share, weight)


def moe_tp_plan() -> TPPlan:
    """The block's tensor-parallel plan, relative to it: its tokens and routing copied (or gathered) once, the
    router replicated, each expert's ffn split, one reduce of the outputs; the shared expert as any SwiGLU."""
    return (("", "moe"), ("gate", "replicated"), ("experts", "experts"), *prefixed("shared_expert", swiglu_tp_plan()))


class _Pass(nn.Module):
    """routing_comm on one process: the routing as it is."""

    def forward(self, weights: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        return weights, ids


# ----------------------------------------------------------------------------- counters and the bias
def moe_blocks(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def reset_counters(model: nn.Module) -> None:
    for _, m in moe_blocks(model):
        m.tokens_per_expert.zero_()
        m.aux_loss_sum.zero_()


def set_aux_weight(model: nn.Module, weight: float | None) -> None:
    """d(training loss)/d(one sequence's auxiliary loss) for the next forward passes (None: 1 / rows)."""
    for _, m in moe_blocks(model):
        m.aux_weight = weight


@torch.no_grad()
def update_expert_bias(block: MoE, tokens_per_expert: Tensor) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of experts that got fewer tokens than
    the mean in the step, lower it for those that got more, by `bias_rate` (sign update)."""
    if block.bias_rate:
        load = tokens_per_expert.to(block.expert_bias.device, torch.float32)
        block.expert_bias += block.bias_rate * torch.sign(load.mean() - load)
