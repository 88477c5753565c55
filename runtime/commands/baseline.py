"""The baseline tessera is measured against: a plain torch training step on one device, written the way a
careful user would write it without tessera.

    the Llama of tessera.models written directly (same parameter names, so a tessera state dict loads as is)
    F.scaled_dot_product_attention (causal, grouped-query) on the best backend the device offers, chosen as
        tessera chooses (cuDNN's on Hopper for 16-bit head dims up to 128), or torch's own priority when asked
        (`attention="sdpa-default"`: FlashAttention-2 first on Hopper); the backend that ran is recorded
    F.rms_norm, RoPE in fp32
    torch.compile per block (on CUDA by default; on CPU when asked)
    FSDP2 fully_shard per block and at the root on a one-rank mesh, MixedPrecisionPolicy(param_dtype = the
        compute dtype, reduce_dtype = fp32): fp32 master weights, matmuls in bf16 (GPU default) or fp32
    F.cross_entropy on the logits in fp32 (the mean over the batch's targets), torch's clip_grad_norm_,
    AdamW (fused on CUDA and CPU, as tessera's) with tessera's defaults and its schedule (linear warm-up, cosine decay)

It imports torch only: never tessera's parallel layers, kernels or trainer. Its command line takes the
initial weights and the token stream from tessera.models, so "same weights, same data" holds:

    python -m tessera.commands.baseline --model debug --seq-len 64 --global-batch 4 --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# "best": what tessera's dispatcher picks (kernels/cudnn_attention.py's rule, restated here: the baseline imports
# torch only): cuDNN's fused attention on compute capability >= 9.0 for bf16/fp16 head dims up to 128, else SDPA's
# own choice; "sdpa-default": SDPA's own priority everywhere (on Hopper, FlashAttention-2 before cuDNN)
ATTENTION_MODES = ("best", "sdpa-default")


def cudnn_serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether tessera's rule sends this step's attention to cuDNN (causal, Sq == Sk, no window or documents)."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (9, 0)
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim % 8 == 0
        and head_dim <= 128
    )


def cudnn_first() -> contextlib.AbstractContextManager:
    """SDPA with cuDNN's backend first, then flash, memory-efficient and math: tessera's order on Hopper."""
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def sdpa_choice(q: Tensor, k: Tensor, v: Tensor) -> str:
    """The backend SDPA's dispatcher picks for these inputs (causal, grouped-query when the heads differ), by
    name: the function its dispatch calls (torch._fused_sdp_choice)."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    except (RuntimeError, TypeError):  # a torch whose choice function takes other arguments
        return "unknown"
    return SDPBackend(choice).name.lower() if not isinstance(choice, SDPBackend) else choice.name.lower()


@dataclass(frozen=True)
class Shape:
    """The model's shape: the fields of tessera.models.LlamaConfig the baseline reads (that config
    itself can be passed)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (i, i + D/2) by the position's angles, in fp32 (x: B, H, S, D)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: Shape, cudnn: bool = False):
        super().__init__()
        self.cudnn = cudnn  # SDPA with cuDNN first (ATTENTION_MODES' "best", where tessera's rule sends it there)
        self.head_dim = s.dim // s.n_heads
        self.wq = nn.Linear(s.dim, s.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.n_heads * self.head_dim, s.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        with cudnn_first() if self.cudnn else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.ffn_dim, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn_dim, bias=False)
        self.w2 = nn.Linear(s.ffn_dim, s.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, s: Shape, cudnn: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(s.dim, s.norm_eps)
        self.attention = Attention(s, cudnn)
        self.ffn_norm = RMSNorm(s.dim, s.norm_eps)
        self.feed_forward = FeedForward(s)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Parameter names as tessera's Llama (tok_embeddings, layers.N.attention.wq, ..., norm, output)."""

    def __init__(self, s: Shape, cudnn: bool = False):
        super().__init__()
        self.shape = s
        self.tok_embeddings = nn.Embedding(s.vocab_size, s.dim)
        self.layers = nn.ModuleList(Block(s, cudnn) for _ in range(s.n_layers))
        self.norm = RMSNorm(s.dim, s.norm_eps)
        self.output = nn.Linear(s.dim, s.vocab_size, bias=False)

    def rope_tables(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        hd = self.shape.dim // self.shape.n_heads
        inv = 1.0 / (self.shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv)
        return angles.cos().float(), angles.sin().float()

    def forward(self, tokens: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, cos, sin)
        return self.output(self.norm(h))


def _shape_of(cfg: Any) -> Shape:
    return Shape(**{f: getattr(cfg, f) for f in Shape.__dataclass_fields__})


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass(frozen=True)
class Options:
    mixed_precision: str = "fp32"  # the compute dtype: fp32 or bf16
    compile: bool = False  # torch.compile each block
    lr: float = 3e-3
    warmup: int = 5
    min_lr_ratio: float = 0.1
    total_steps: int | None = None  # the cosine's end (None: the steps run)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    attention: str = "best"  # ATTENTION_MODES


State = dict[str, Tensor] | Callable[[], dict[str, Tensor]] | None


def build(cfg: Any, state: State, device: torch.device, options: Options) -> Llama:
    """The model on `device`, weights from `state` (a tessera state dict, or a function returning one, called
    here and dropped once loaded; None: torch's default init), compiled per block if asked, then FSDP2 on a
    one-rank mesh with the mixed-precision policy. Needs an initialized one-rank process group."""
    if options.attention not in ATTENTION_MODES:
        raise ValueError(f"attention={options.attention!r} is not one of {', '.join(ATTENTION_MODES)}")
    shape = _shape_of(cfg)
    cudnn = options.attention == "best" and cudnn_serves(
        device, DTYPES[options.mixed_precision], shape.dim // shape.n_heads
    )
    with torch.device("meta"):
        model = Llama(shape, cudnn)
    model.to_empty(device=device)
    if state is not None:
        weights = state() if callable(state) else state
        model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("rope.")}, strict=True)
        del weights
    else:
        for m in model.modules():
            reset = getattr(m, "reset_parameters", None)
            if reset is not None:
                reset()
    if options.compile:
        for block in model.layers:
            block.compile()
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[options.mixed_precision], reduce_dtype=torch.float32)
    for block in model.layers:  # one rank: nothing to save by resharding between forward and backward
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def train(
    cfg: Any,
    batches: Callable[[int], tuple[Tensor, Tensor]],
    steps: int,
    device: torch.device | str = "cpu",
    state: State = None,
    options: Options = Options(),
) -> list[dict[str, Any]]:
    """`steps` optimizer steps of the baseline on `batches(step)` -> (inputs, targets) (B, S) each; one record
    per step: step, loss (before the update), grad_norm, step_time_s (the wall time of the whole step, host
    sync included), tokens_per_s, peak_memory_bytes (the CUDA allocator's peak since the model was built,
    or the process peak RSS on CPU) and compute_dtype (the dtype of the output head's matmul operands, read
    from the tensors during the first step). Starts a one-rank process group if none is running (and ends it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    own_group = not dist.is_initialized()
    if own_group:
        store = dist.FileStore(tempfile.mktemp(prefix="tessera-baseline-"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        return _train(cfg, batches, steps, device, state, options)
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(cfg, batches, steps, device, state, options) -> list[dict[str, Any]]:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build(cfg, state, device, options)
    del state
    if device.type == "cuda":  # the weights' load is not the step's memory
        torch.cuda.reset_peak_memory_stats(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        params,
        lr=options.lr,
        betas=options.betas,
        eps=options.eps,
        weight_decay=options.weight_decay,
        **({"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}),
    )
    total = options.total_steps or steps

    def lr_factor(step: int) -> float:  # tessera's schedule: linear warm-up, then cosine to min_lr_ratio
        if step < options.warmup:
            return (step + 1) / options.warmup
        progress = min(1.0, (step - options.warmup) / max(1, total - options.warmup))
        return options.min_lr_ratio + (1 - options.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    seen: dict[str, str] = {}

    def probe(module, args):
        if not seen:
            x = args[0]
            seen["compute_dtype"] = str(torch.promote_types(x.dtype, module.weight.dtype)).replace("torch.", "")

    handle = model.output.register_forward_pre_hook(probe)
    attention_backend = _attention_backend(model, device, DTYPES[options.mixed_precision])
    records = []
    max_seq = None
    cos = sin = None
    for step in range(1, steps + 1):
        inputs, targets = batches(step - 1)
        started = time.perf_counter()
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if max_seq != inputs.shape[1]:
            max_seq = inputs.shape[1]
            cos, sin = model.rope_tables(max_seq, device)
        logits = model(inputs, cos, sin)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        del logits
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm, foreach=True)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # the host sync: the step is done
        norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        elapsed = time.perf_counter() - started
        if step == 1:
            handle.remove()
        tokens = inputs.numel()
        records.append(
            {
                "step": step,
                "loss": loss_value,
                "grad_norm": norm_value,
                "step_time_s": elapsed,
                "tokens_per_s": tokens / elapsed,
                "peak_memory_bytes": _peak_memory(device),
                "compute_dtype": seen.get("compute_dtype"),
                "attention_backend": attention_backend,
                "attention_mode": options.attention,
            }
        )
    return records


def _attention_backend(model: Llama, device: torch.device, dtype: torch.dtype) -> str:
    """The SDPA backend the step's attention runs on: the dispatcher's pick (under the priority the model's
    attention sets) for q/k/v of the model's heads in this dtype."""
    s = model.shape
    hd = s.dim // s.n_heads
    q = torch.zeros(1, s.n_heads, 128, hd, device=device, dtype=dtype)
    kv = torch.zeros(1, s.n_kv_heads, 128, hd, device=device, dtype=dtype)
    first: Any = model.layers[0]
    with cudnn_first() if first.attention.cudnn else contextlib.nullcontext():
        return sdpa_choice(q, kv, kv)


def tessera_batches(cfg: Any, seq_len: int, global_batch: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """Step -> (inputs, targets) of tessera's default token stream (the shipped text, byte-tokenized; token
    ids folded into the vocabulary for presets wider than bytes are not needed: ids < 258 always fit)."""
    # lazy: the baseline itself imports torch only (never tessera's kernels, which tessera.models loads)
    from tessera.data.corpus import TokenStream

    stream = TokenStream(seq_len, global_batch)
    return lambda step: stream.global_batch_at(step * global_batch)


def tessera_state(cfg: Any, seed: int, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """tessera's one-process initial weights for `seed` (equal to every layout's, shard by shard)."""
    from tessera.models import build_model  # lazy: (as in tessera_batches) the baseline imports torch only

    return build_model(cfg, device=device, seed=seed).state_dict()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tessera.commands.baseline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="debug")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (CUDA when there is a GPU)")
    p.add_argument("--mixed-precision", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="per block (auto: on CUDA only)")
    p.add_argument(
        "--attention",
        choices=ATTENTION_MODES,
        default="best",
        help="best: the backend tessera picks (cuDNN on Hopper); sdpa-default: torch's own priority",
    )
    args = p.parse_args(argv)
    from tessera.models import get_preset  # lazy: (as in tessera_batches) the baseline imports torch only

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    cfg = get_preset(args.model, **({"n_layers": args.n_layers} if args.n_layers else {}))
    options = Options(
        mixed_precision=args.mixed_precision or ("bf16" if device.type == "cuda" else "fp32"),
        compile=args.compile == "on" or (args.compile == "auto" and device.type == "cuda"),
        attention=args.attention,
    )
    records = train(
        cfg,
        tessera_batches(cfg, args.seq_len, args.global_batch),
        args.steps,
        device,
        lambda: tessera_state(cfg, args.seed),
        options,
    )
    for r in records:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
