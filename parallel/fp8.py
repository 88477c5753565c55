"""FP8 training: torchao's float8 matmuls on the spec's linear layers, composed with tessera's tensor parallel.

torchao's module swap (`convert_to_float8_training`) turns nn.Linear into its Float8Linear, and its tensor
parallel styles wrap those. tessera's tp layers (parallel/tensor.py) are its own modules, so `apply_fp8`
gives each qualifying layer a `Float8Matmul` instead: torchao's float8 linear (the same casts, its
Float8TrainingTensor and its op table, `torch._scaled_mm` on a GPU, its fp32 emulation on CPU), with
the amax of an operand that tp splits taken over the tp group.

Where scales are computed, the decision: over the whole logical tensor, as one process computes them,
across tp; per data shard across dp and cp. A tensorwise scale of a tp-split operand (a column-parallel
layer's weight and output gradient, a row-parallel layer's input and weight) is max |x| over every tp
rank's shard: one MAX all-reduce of a scalar (counted under tp), so tp does not change what a layer
rounds. A rowwise (axiswise) scale is reduced only when its axis is the split one (a row-parallel
layer's output gemm, a column-parallel layer's grad-input gemm). Across dp and cp each rank's tokens
are its own batch, as torchao and torchtitan do (one process's scale over all tokens would need an
all-reduce per activation cast per layer over the data axes); the FP8 contract's derived tolerance
covers that difference. FSDP2's float8 all-gather (tensorwise, FSDP2 without tp: torchao's
enable_fsdp_float8_all_gather) casts each weight shard with the amax all-reduced over the FSDP mesh: one
process's scale too. Under tp the weights all-gather in the compute dtype (tessera's tp layers read their
DTensor's local shard, which torchao's weight subclass does not wrap).

Left in high precision, as the anchors leave them: the output head, the MoE router, the experts' grouped
GEMMs (torchao's float8 grouped GEMM is a CUDA-only prototype), the K/V projections replicated over tp
beyond the kv heads, and any layer whose (global or tp-local) dims are not multiples of 16.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.kernels.fp8_amax import row_amax

from .comm import collective
from .fp8_shared_casts import CastShare, remember_whole_amax, whole_amax

FP8_RECIPES = ("tensorwise", "rowwise")
# tp-style names of a spec's plan whose layers run in FP8 (the head, router and kv-beyond stay high precision)
FP8_STYLES = ("colwise", "rowwise", "kv")
PER_SHARD = False  # tests plant the bug of each tp rank scaling its own shard (the design says: global)


class _NoCpuKernelNoise(logging.Filter):
    """torchao's import warns once per process for each of its CUDA extensions it cannot load ("Failed to load
    .../_C_cutlass_90a.abi3.so"); on a machine without CUDA nothing could use them, so the lines say nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return torch.cuda.is_available() or not record.getMessage().startswith("Failed to load")


logging.getLogger("torchao").addFilter(_NoCpuKernelNoise())


class _NoEnumRegistrationNotice(logging.Filter):
    """torchao registers its KernelPreference enum with torch's pytree, which torch 2.13 logs as deprecated once
    per process ("... is an Enum subclass and is now natively supported"): torchao's matter, said on every FP8
    run's every rank; the registration works."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("KernelPreference" in message and "Enum subclass" in message)


logging.getLogger("torch.utils._pytree").addFilter(_NoEnumRegistrationNotice())


def torchao_missing() -> str | None:
    """None when torchao's float8 training path imports, else the one line that says how to get it."""
    try:
        # lazy: optional dependency, checked before any rank starts
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"`fp8` needs torchao (not importable here: {e}); install tessera's fp8 extra: pip install -e '.[fp8]'"
    return None


def float8_config(recipe: str, emulate: bool, fsdp_all_gather: bool = False) -> Any:
    """torchao's Float8LinearConfig of a recipe name, emulated (fp32 matmuls of the dequantized values) on CPU."""
    from torchao.float8 import Float8LinearConfig  # lazy: optional dependency

    if recipe not in FP8_RECIPES:
        raise ValueError(f"unknown `fp8` recipe {recipe!r}; use one of {', '.join(FP8_RECIPES)}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise"
    )


def qualifies(in_features: int, out_features: int) -> bool:
    """torch._scaled_mm needs both dims of the weight to be multiples of 16 (torchtitan's filter)."""
    return in_features % 16 == 0 and out_features % 16 == 0


@dataclass
class Float8Matmul:
    """y = x @ w.T in FP8 by torchao's float8 linear; `split` is how tp splits this layer ("col": the
    weight's output features, "row": its input features, None: not split) and `group` the tp group whose
    ranks hold the other pieces. With `record` on, each cast's scale is appended to `scales` as
    (gemm, operand, scale)."""

    config: Any
    group: dist.ProcessGroup | None = None
    split: str | None = None
    record: bool = False
    scales: list = field(default_factory=list)
    # the one-pass Triton cast (kernels/triton_fp8_cast.py, torchao's bits) and a one-kernel amax; None: on CUDA in
    # eager steps, where torchao's eager cast runs four kernels (under torch.compile inductor fuses torchao's)
    fused_cast: bool | None = None
    # the casts this layer shares with its siblings (parallel/fp8_shared_casts.py), where the one-pass cast runs;
    # None: each layer casts its own input
    share: CastShare | None = None
    siblings: int = 1  # the layers that read this one's input, itself included (q, k, v: 3); apply_fp8 counts them

    def __post_init__(self) -> None:
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig  # lazy: optional dependency

        c = self.config
        self.mm_config = LinearMMConfig(
            *(
                ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
                for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
            )
        )

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        return _Float8Linear.apply(x, weight.t(), self)

    # the dim of each operand that tp splits, counted from the end (input (m, k), weight_t (k, n), grad_out (m, n))
    def split_dim(self, operand: str) -> int | None:
        splits: dict[tuple[str | None, str], int] = {
            ("col", "weight"): -1,
            ("col", "grad_output"): -1,
            ("row", "input"): -1,
            ("row", "weight"): -2,
        }
        return splits.get((self.split, operand))

    def fused(self, t: Tensor) -> bool:
        """Whether `t` is cast by the one-pass kernel (the field's comment)."""
        from torch.distributed.tensor import DTensor  # lazy: as in float8_gathered_weights

        if isinstance(t, DTensor) or not t.is_floating_point():
            return False
        return (t.is_cuda and not torch.compiler.is_compiling()) if self.fused_cast is None else self.fused_cast

    def cast(self, t: Tensor, cc: Any, operand: str, gemm: str, axis: int, source: Tensor | None = None) -> Tensor:
        """t in FP8 as torchao's hp_tensor_to_float8_dynamic casts it, the amax over the tp group where
        the scale covers the split dim; the same bits by the one-pass kernel where `fused` says so, there an
        input's cast shared with the sibling layers that read the same tensor (`share`; `source`: the tensor
        t is a reshape of, by which the share finds it)."""
        from torchao.float8.config import ScalingGranularity, ScalingType  # lazy: optional dependency
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8  # lazy: as above
        from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8  # lazy
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax  # lazy: as above

        if tensor_already_casted_to_fp8(t) or cc.scaling_type is ScalingType.DISABLED:
            return t
        axiswise = cc.scaling_granularity is ScalingGranularity.AXISWISE
        dim = axis if axiswise else None
        fused = self.fused(t)
        source = t if source is None else source
        # an input's amax noted on it (from its producer, or this layer's forward for its backward); its cast
        # shared with the sibling layers that read it. (Inference tensors track no version: neither there.)
        noted = fused and operand == "input" and self.share is not None and not source.is_inference()
        share = self.share if noted and self.siblings > 1 else None
        key = (gemm, axis, id(cc), tuple(t.shape), self.split, id(self.group))
        if share is not None and (held := share.get(source, key)) is not None:
            if self.record:
                self.scales.append((gemm, operand, held._scale.detach().clone()))
            return held
        if fused:  # max |t| in one reduction (torchao's takes abs into a temporary, then its max): the same value
            amax = known_amax(t, source, dim) if noted else None
            if amax is None:
                amax = torch.linalg.vector_norm(t, ord=math.inf, dim=dim, keepdim=dim is not None)
                if noted and dim is None:
                    remember_whole_amax(source, amax)
        else:
            amax = tensor_to_amax(t, scaling_granularity=cc.scaling_granularity, axiswise_dim=dim)
        split = self.split_dim(operand)
        covers_split = split is not None and (not axiswise or axis - (t.dim() if axis >= 0 else 0) == split)
        if covers_split and self.group is not None and not PER_SHARD:
            amax = amax.contiguous().clone()
            with collective("all_reduce", "tp", self.group):
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        scale = amax_to_scale(amax, cc.target_dtype, self.config.round_scales_to_power_of_2)
        if self.record:
            self.scales.append((gemm, operand, scale.detach().clone()))
        role = {"input": GemmInputRole.INPUT, "weight": GemmInputRole.WEIGHT}.get(operand, GemmInputRole.GRAD_OUTPUT)
        if fused:
            from torchao.float8.float8_training_tensor import Float8TrainingTensor  # lazy: optional dependency

            from tessera.kernels.triton_fp8_cast import scaled_cast_fp8  # lazy: Triton, where FP8 runs

            bits = scaled_cast_fp8(t, scale, cc.target_dtype, SCALED_MM_LAYOUT.get((gemm, operand)))
            cast = Float8TrainingTensor(bits, scale, t.dtype, self.mm_config, role, dim)
            if share is not None:
                share.put(source, key, cast, uses=self.siblings - 1)
            return cast
        return hp_tensor_and_scale_to_float8(t, scale, cc.target_dtype, self.mm_config, role, dim)


def known_amax(t: Tensor, source: Tensor, dim: int | None) -> Tensor | None:
    """max |t| (over `dim`, kept; None: all of it) where it is known without reading t: noted by an earlier
    cast of the same input (the forward's, for the backward), or from the row amaxes the kernel that wrote it
    noted (kernels/fp8_amax.py: the Triton RMSNorm's): their max, or under rowwise scaling the rows themselves."""
    if dim is None:
        whole = whole_amax(source)
        if whole is None and (rows := row_amax(source)) is not None:
            whole = rows.amax()
            remember_whole_amax(source, whole)
        return whole
    if t is source and dim in (-1, t.dim() - 1):
        return row_amax(source)
    return None


# The memory order torch._scaled_mm takes an operand in where _Float8Linear hands it over in the other (torchao's mm
# copies it there otherwise: preprocess_addmm makes the first operand row-major, the second column-major): the
# weight for the input gradient reaches it transposed (so cast row-major), the output gradient transposed and the
# input as they are for the weight gradient (so cast column-major). The others arrive in the order they need.
SCALED_MM_LAYOUT = {
    ("grad_input", "weight"): "row",
    ("grad_weight", "grad_output"): "col",
    ("grad_weight", "input"): "col",
}


class _Float8Linear(torch.autograd.Function):
    """torchao's matmul_with_hp_or_float8_args (float8/float8_linear.py) with Float8Matmul's casts: the same
    three gemms, each operand cast by its gemm's cast config along the same axis."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp_t, mm: Float8Matmul):
        ctx.save_for_backward(input_hp, weight_hp_t)
        ctx.mm = mm
        c = mm.config
        x = mm.cast(input_hp, c.cast_config_input, "input", "output", -1)
        w = mm.cast(weight_hp_t, c.cast_config_weight, "weight", "output", 0)
        shape = x.shape
        out = torch.mm(x.reshape(-1, shape[-1]), w)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        input_hp, weight_hp_t = ctx.saved_tensors
        mm = ctx.mm
        c = mm.config
        shape = grad_output.shape
        go = grad_output.reshape(-1, shape[-1])
        go_gi = mm.cast(go, c.cast_config_grad_output, "grad_output", "grad_input", -1)
        w_gi = mm.cast(weight_hp_t, c.cast_config_weight_for_grad_input, "weight", "grad_input", -1)
        grad_input = torch.mm(go_gi, w_gi.t()).reshape(*shape[:-1], -1)
        x2 = input_hp.reshape(-1, input_hp.shape[-1])
        go_gw = mm.cast(go, c.cast_config_grad_output_for_grad_weight, "grad_output", "grad_weight", 0)
        x_gw = mm.cast(x2, c.cast_config_input_for_grad_weight, "input", "grad_weight", 0, source=input_hp)
        grad_weight = torch.mm(go_gw.t(), x_gw)
        return grad_input, grad_weight.t(), None


class Float8Linear(nn.Linear):
    """A one-process (or dp-only) nn.Linear whose matmul is a Float8Matmul; the same `weight` parameter."""

    matmul: Float8Matmul

    def forward(self, x: Tensor) -> Tensor:
        out = self.matmul(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.matmul.config.cast_config_weight.short_str()}"


def to_float8(linear: nn.Linear, matmul: Float8Matmul, float8_all_gather: bool = False) -> Float8Linear:
    """`linear` as a Float8Linear (the same parameters). `float8_all_gather`: its weight becomes torchao's
    WeightWithDynamicFloat8CastTensor, which FSDP2 all-gathers in FP8 (cast once per shard, the amax
    all-reduced over the FSDP mesh: one process's scale) instead of in the compute dtype."""
    with torch.device("meta"):
        new = Float8Linear(linear.in_features, linear.out_features, bias=False)
    new.weight, new.bias, new.matmul = linear.weight, linear.bias, matmul
    if float8_all_gather:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # lazy: optional dependency

        target = matmul.config.cast_config_weight.target_dtype
        wrapped = WeightWithDynamicFloat8CastTensor(linear.weight.detach(), matmul.mm_config, target)
        new.weight = nn.Parameter(wrapped, requires_grad=linear.weight.requires_grad)
    return new


def float8_gathered_weights(parts: list[nn.Module]) -> list[Any]:
    """The parameters of `parts` that FSDP2 all-gathers in FP8 (DTensors over torchao's
    WeightWithDynamicFloat8CastTensor), in a fixed order."""
    from torch.distributed.tensor import DTensor  # lazy: as the rest of this module's torch.distributed

    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # lazy: optional dependency

    return [
        p
        for part in parts
        for p in part.parameters()
        if isinstance(p, DTensor) and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]


@torch.no_grad()
def precompute_float8_scales(weights: list[Any]) -> None:
    """This step's FP8 scale of every weight FSDP2 all-gathers in FP8, set on its shard before the step's
    first all-gather: max |w| of all of them at once (one foreach kernel) and one all-reduce of the stacked
    maxima over the FSDP mesh, instead of an amax kernel and an all-reduce per weight in every all-gather
    (the forward's, and the backward's again where FSDP reshards). The same scale the all-gather computes
    without it (torchao's amax_to_scale of the same global amax: torchtitan's
    precompute_float8_dynamic_scale_for_fsdp), so nothing a layer rounds changes."""
    if not weights:  # before any import: a run without FP8 weights never loads torchao
        return
    from torch.distributed.tensor import DTensor  # lazy: as in float8_gathered_weights

    from torchao.float8.float8_utils import amax_to_scale  # lazy: optional dependency

    amax = torch.stack(torch._foreach_norm(weights, ord=math.inf))  # a DTensor, Partial(max) over the shards
    assert isinstance(amax, DTensor)
    global_amax = amax.full_tensor()  # one all-reduce over the FSDP mesh
    # the all-gather's own cast (hp_tensor_to_float8_dynamic in fsdp_pre_all_gather) never rounds scales
    scales = amax_to_scale(global_amax, weights[0]._local_tensor._dtype)
    for weight, scale in zip(weights, scales):
        weight._local_tensor._precomputed_scale = scale


def clear_float8_scales(weights: list[Any]) -> None:
    """Drop the precomputed scales once the update has changed the weights: a later all-gather outside a
    training step (evaluation, generation) computes its own, as it would without them."""
    for weight in weights:
        weight._local_tensor._precomputed_scale = None


@dataclass
class Fp8Report:
    """What apply_fp8 did: the layers in FP8, and the ones left in high precision with why."""

    converted: list[str] = field(default_factory=list)
    split: dict[str, int] = field(default_factory=dict)  # the weight dim tp splits of each converted layer
    float8_all_gather: int = 0  # layers whose weights FSDP2 all-gathers in FP8
    kept: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        kept = "; ".join(f"{n} ({why})" for n, why in sorted(self.kept.items()))
        return f"{len(self.converted)} linear layers in FP8" + (f"; high precision: {kept}" if kept else "")


def apply_fp8(
    model: nn.Module,
    recipe: str,
    spec: Any,
    tp_mesh: Any = None,
    emulate: bool = False,
    float8_all_gather: bool = False,
) -> Fp8Report:
    """Put the spec's qualifying linear layers of `model` (a whole model or a pipeline stage, after tp)
    in FP8, in place; parameters and their names unchanged. Returns what it converted and kept.
    `float8_all_gather` (tensorwise, FSDP2 without tp): their weights all-gather in FP8."""
    from tessera.models.moe import moe_blocks  # lazy: keeps this module's import light for preflight

    from .tp_plan import find_modules, replace_module  # lazy: as above
    from .tensor import ColumnParallelLinear, ReplicatedHeadsLinear, RowParallelLinear  # lazy: as above

    config = float8_config(recipe, emulate)
    group = tp_mesh.get_group() if tp_mesh is not None else None
    share = CastShare()  # the model's sibling layers' input casts (eager, on CUDA)
    readers: dict[str, list[Float8Matmul]] = {}  # a block's column-parallel layers: they read its one input
    report = Fp8Report()
    for pattern, style in spec.tp_plan:
        for name, module in find_modules(model, pattern):
            if style not in FP8_STYLES:
                if style in ("colwise_gather", "replicated"):  # the head, a router: as the anchors leave them
                    report.kept[pattern] = "the output head" if pattern == spec.head else "the router"
                continue
            if isinstance(module, ReplicatedHeadsLinear):
                report.kept[pattern] = "kv heads replicated over tp"
                continue
            if not isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
                continue
            out_f, in_f = module.weight.shape  # the global (one-process) dims
            local = module.weight.to_local().shape if hasattr(module.weight, "to_local") else module.weight.shape
            if not (qualifies(in_f, out_f) and qualifies(local[1], local[0])):
                report.kept[pattern] = f"dims {out_f}x{in_f} (tp-local {local[0]}x{local[1]}) not multiples of 16"
                continue
            if isinstance(module, nn.Linear):
                matmul = Float8Matmul(config, share=share)
                replace_module(model, name, to_float8(module, matmul, float8_all_gather))
                report.float8_all_gather += float8_all_gather
            else:
                split = "col" if isinstance(module, ColumnParallelLinear) else "row"
                module.matmul = matmul = Float8Matmul(config, group, split, share=share)
            if style != "rowwise":  # q, k and v (or gate and up) of one block read its one input
                readers.setdefault(name.rpartition(".")[0], []).append(matmul)
            report.converted.append(name)
            report.split[name] = 1 if style == "rowwise" else 0
    for siblings in readers.values():
        for matmul in siblings:
            matmul.siblings = len(siblings)
    for name, _ in moe_blocks(model):
        report.kept[re.sub(r"\.\d+(?=\.|$)", ".*", name) + ".experts"] = (
            "grouped GEMM: torchao's float8 one is CUDA-only"
        )
    return report


def float8_matmuls(model: nn.Module) -> dict[str, Float8Matmul]:
    """Every Float8Matmul of a model by module name (the tests record and compare their scales)."""
    out = {}
    for name, module in model.named_modules():
        matmul = getattr(module, "matmul", None)
        if isinstance(matmul, Float8Matmul):
            out[name] = matmul
    return out


def check_fp8(recipe: str | None, model_config: Any, spec: Any, tp: int, device_type: str) -> None:
    """Every --fp8 refusal, one line each, before any rank starts: an unknown recipe, torchao missing, a GPU
    without FP8 matmuls (compute capability below 8.9), a model none of whose layers qualifies."""
    if recipe is None:
        return
    if recipe not in FP8_RECIPES:
        raise ValueError(f"unknown `fp8` recipe {recipe!r}; use one of {', '.join(FP8_RECIPES)}")
    missing = torchao_missing()
    if missing:
        raise ValueError(missing)
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ValueError(
                f"fp8={recipe} on a GPU of compute capability {major}.{minor} ({torch.cuda.get_device_name()}): "
                f"FP8 matmuls need 8.9 or newer (Ada, Hopper, Blackwell); drop `fp8`"
            )
    built = spec.build_model(model_config, device="meta")
    report = apply_fp8(built, recipe, spec, emulate=True)
    local = [n for n in report.converted if _dims(built, n)[report.split[n]] % (16 * tp) == 0]
    if not local:
        kept = "; ".join(f"{n}: {why}" for n, why in sorted(report.kept.items()))
        raise ValueError(
            f"fp8={recipe}: no linear layer of this model qualifies (both dims, tp-local with tp={tp}, must be "
            f"multiples of 16; {kept or 'no linear layers'}); drop `fp8`"
        )


def _dims(model: nn.Module, name: str) -> tuple[int, ...]:
    weight = model.get_submodule(name).weight
    assert isinstance(weight, Tensor)
    return tuple(weight.shape)
