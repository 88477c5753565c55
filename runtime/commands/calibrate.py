"""Calibrating the planner's step-time model on this device (`tessera plan --calibrate`).

Measures, at a model's own shapes and in the compute dtype, the four figures topology/estimators/step_time.py uses: the
achieved matmul rate of the model's linear layers (forward and both backward matmuls), tessera's attention
forward + backward, the memory bandwidth the step's elementwise operators reach (a copy of an
activation-sized tensor and the operator mix a block runs on such tensors: broadcast multiplies as RMSNorm
and RoPE do, a two-input multiply and add, SiLU, a squared mean; the model uses the mix's rate, the copy's
is kept beside it), and the host's cost of one dispatched operator. Each is the median of a few repetitions
after a warm-up. The figures go into a small JSON file keyed by device kind and dtype (default
~/.cache/tessera/calibration.json, or $TESSERA_CALIBRATION, or --calibration PATH), which `tessera plan
--device-kind KIND` and `tessera bench` read. On CPU a measurement uses the threads of one tessera rank (1,
as the local launcher gives each rank) unless told otherwise; the figures are of this machine at this moment
(other processes included).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tessera.kernels import flash_attention
from tessera.metrics.results import cpu_name, versions
from tessera.models.spec import shape_of as model_shape
from tessera.paths import calibration_path as default_path
from tessera.paths import read_calibration as load  # noqa: F401  (tessera.commands.calibrate.load, as before)
from tessera.topology.estimators.step_time import SCHEMA, Calibration, attention_flops_per_token, entry_key
from torch.utils._python_dispatch import TorchDispatchMode

from .baseline import Block, Shape

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}
# the most FLOPs one measured matmul shape may take (forward + backward): the calibration stays quick
MAX_FLOPS = {"cpu": 1.5e9, "cuda": 3e13}
QUICK_MAX_FLOPS = {"cpu": 3e8, "cuda": 5e12}
# ... but never at fewer tokens than this (or the step's, if fewer): tiny matmuls run far below the rate
MIN_TOKENS = {"cpu": 256, "cuda": 2048}


def device_kind(device: torch.device, threads: int | None = None) -> str:
    """A GPU's name (e.g. 'NVIDIA H100 80GB HBM3'), or 'cpu: <model name>, N thread(s)'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = threads or torch.get_num_threads()
    return f"cpu: {cpu_name()}, {n} thread{'s' if n > 1 else ''}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def linear_shapes(model) -> list[tuple[int, int, int]]:
    """(in, out, count) of the model's linear layers: the block's per layer (q, k, v, o and the MLP's two or
    three matrices) and the output head. `model`: a ModelShape, a family's config or a preset name."""
    cfg = model_shape(model)
    hd = cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    shapes = {(cfg.dim, q): 0, (cfg.dim, kv): 0, (q, cfg.dim): 0, (cfg.dim, cfg.ffn_dim): 0, (cfg.ffn_dim, cfg.dim): 0}
    for key, n in (
        ((cfg.dim, q), 1),
        ((cfg.dim, kv), 2),
        ((q, cfg.dim), 1),
        ((cfg.dim, cfg.ffn_dim), cfg.mlp_matrices - 1),
        ((cfg.ffn_dim, cfg.dim), 1),
    ):
        shapes[key] += n * cfg.n_layers
    out = [(i, o, n) for (i, o), n in shapes.items()]
    out.append((cfg.dim, cfg.vocab_size, 1))
    return out


def measure(
    cfg,
    seq_len: int,
    rows: int,
    device: torch.device | str = "cpu",
    dtype: str = "fp32",
    quick: bool = False,
    reps: int | None = None,
) -> dict[str, Any]:
    """One calibration entry measured here: see the module docstring. `rows` x `seq_len` tokens (the
    step's microbatch); each matmul shape is measured at no more than MAX_FLOPS (QUICK_MAX_FLOPS with
    `quick`) by taking fewer tokens, and the entry says how many it took. `cfg`: a family's config, a
    preset name or a ModelShape."""
    cfg = model_shape(cfg)
    device = torch.device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    dt = DTYPES[dtype]
    reps = reps or (3 if quick else 5)
    started = time.perf_counter()
    tokens = rows * seq_len
    budget = (QUICK_MAX_FLOPS if quick else MAX_FLOPS)[kind]

    # matmuls: F.linear forward + backward (dx and dW) at each of the model's shapes
    total_flops = total_seconds = 0.0
    by_shape = []
    for d_in, d_out, count in linear_shapes(cfg):
        t = min(tokens, max(MIN_TOKENS[kind], int(budget // (6 * d_in * d_out))))
        x = torch.randn(t, d_in, device=device, dtype=dt, requires_grad=True)
        w = torch.randn(d_out, d_in, device=device, dtype=dt, requires_grad=True)
        dy = torch.randn(t, d_out, device=device, dtype=dt)

        def fwd_bwd(x=x, w=w, dy=dy):  # bound now: the tensors are deleted after the loop body
            F.linear(x, w).backward(dy)
            x.grad = w.grad = None

        seconds = _median_seconds(fwd_bwd, device, reps)
        flops = 6.0 * t * d_in * d_out
        by_shape.append({"in": d_in, "out": d_out, "count": count, "tokens": t, "flops_per_s": flops / seconds})
        # weighted as the step weights them: each shape's time at the step's tokens, count times
        total_flops += count * 6.0 * tokens * d_in * d_out
        total_seconds += count * seconds * (tokens / t)
        del x, w, dy

    # attention: tessera's kernel (its own dispatch picks the backend), causal, at the model's heads
    hd = cfg.head_dim
    att_flops_call = lambda b: attention_flops_per_token(cfg, seq_len) / cfg.n_layers * b * seq_len  # noqa: E731
    b = max(1, min(rows, int(budget // max(1.0, att_flops_call(1)))))
    q = torch.randn(b, cfg.n_heads, seq_len, hd, device=device, dtype=dt, requires_grad=True)
    k = torch.randn(b, cfg.n_kv_heads, seq_len, hd, device=device, dtype=dt, requires_grad=True)
    v = torch.randn(b, cfg.n_kv_heads, seq_len, hd, device=device, dtype=dt, requires_grad=True)
    do = torch.randn_like(q)

    def attention(q=q, k=k, v=v, do=do):  # bound now: the tensors are deleted after timing
        flash_attention(q, k, v, causal=True).backward(do)
        q.grad = k.grad = v.grad = None

    attention_rate = att_flops_call(b) / _median_seconds(attention, device, reps)
    del q, k, v, do

    copy, mix, copy_bytes = bandwidths(cfg, tokens, device, dt, reps)

    overhead = op_overhead(device)
    entry = {
        "device_kind": device_kind(device),
        "dtype": str(dt).replace("torch.", ""),
        "matmul_flops_per_s": total_flops / total_seconds,
        "attention_flops_per_s": attention_rate,
        "memory_bytes_per_s": mix,
        "copy_bytes_per_s": copy,
        "op_overhead_s": overhead,
        "device_type": device.type,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "measured_at": {
            "dim": cfg.dim,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "mlp": cfg.mlp,
            "ffn_dim": cfg.ffn_dim,
            "vocab_size": cfg.vocab_size,
            "seq_len": seq_len,
            "rows": rows,
            "attention_rows": b,
            "copy_bytes": copy_bytes,
            "quick": quick,
            "reps": reps,
        },
        "matmul_by_shape": by_shape,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": time.perf_counter() - started,
    }
    Calibration.from_entry(entry)  # the figures it holds are usable
    return entry


def bandwidths(cfg, tokens: int, device: torch.device, dt: torch.dtype, reps: int) -> tuple[float, float, int]:
    """(copy bytes/s, elementwise-mix bytes/s, bytes copied): a copy (read + write) of the ffn-wide activation,
    and the operators a block runs on its activations, counted as the elements each reads and writes. On a
    GPU the tensors are at least 256 MiB (HBM, not the L2); the tokens are capped at 2^27 / ffn elements."""
    rows = max(1, min(tokens, (2**27) // cfg.ffn_dim))
    if device.type == "cuda":
        rows = max(rows, min(2**27 // cfg.ffn_dim, 256 * 2**20 // (dt.itemsize * cfg.ffn_dim)))
    src = torch.randn(rows, cfg.ffn_dim, device=device, dtype=dt)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * dt.itemsize / _median_seconds(lambda: dst.copy_(src), device, reps * 2)
    other = torch.randn_like(src)
    x = torch.randn(rows, cfg.dim, device=device, dtype=dt)
    rstd = torch.randn(rows, 1, device=device, dtype=dt)
    w = torch.randn(cfg.dim, device=device, dtype=dt)
    F_, D = src.numel(), x.numel()

    def mix():
        torch.mul(x, rstd)  # RMSNorm's x * rstd (read D, write D)
        torch.mul(x, w)  # its weight (read D, write D)
        x.pow(2).mean(-1, keepdim=True)  # its statistics (read D, write D; read D)
        torch.add(x, x)  # a residual add (read 2 D, write D)
        torch.mul(src, other)  # SwiGLU's product (read 2 F, write F)
        F.silu(src)  # (read F, write F)

    moved = (2 * D + 2 * D + 3 * D + 3 * D + 3 * F_ + 2 * F_) * dt.itemsize
    elementwise = moved / _median_seconds(mix, device, reps * 2)
    return copy, elementwise, 2 * src.numel() * dt.itemsize


def op_overhead(device: torch.device, reps: int = 5) -> float:
    """Seconds of host time per dispatched operator: a plain-torch Llama block (tessera.commands.baseline's) at a tiny
    size (dim 64, 8 tokens), forward and backward, whose kernels take next to nothing, over the operators
    the dispatcher saw (views included, as the step's count is)."""
    shape = Shape(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=192)
    block = Block(shape).to(device)
    x = torch.randn(1, 8, 64, device=device, requires_grad=True)
    angles = torch.outer(torch.arange(8.0, device=device), torch.ones(8, device=device))
    cos, sin = angles.cos(), angles.sin()

    def run():
        block(x, cos, sin).sum().backward()
        x.grad = None
        for p in block.parameters():
            p.grad = None

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    run()
    with Count():
        run()
    seconds = _median_seconds(run, device, reps)
    return seconds / max(1, Count.n)


def save(entry: dict[str, Any], path: str | Path | None = None) -> Path:
    """Add (or replace) the entry of its device kind and dtype in the calibration file; written atomically."""
    path = Path(path) if path else default_path()
    data: dict[str, Any] = {"schema": SCHEMA, "entries": {}}
    if path.exists():
        try:
            old = json.loads(path.read_text())
            if old.get("schema") == SCHEMA and isinstance(old.get("entries"), dict):
                data = old
        except (OSError, ValueError):
            pass  # an unreadable file is replaced
    data["entries"][entry_key(entry["device_kind"], entry["dtype"])] = {**entry, "versions": versions()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def describe(entry: dict[str, Any]) -> str:
    return (
        f"{entry['device_kind']}, {entry['dtype']}: matmul {entry['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s, "
        f"attention {entry['attention_flops_per_s'] / 1e12:.3g} TFLOP/s, "
        f"elementwise {entry['memory_bytes_per_s'] / 1e9:.3g} GB/s "
        f"(copy {entry.get('copy_bytes_per_s', float('nan')) / 1e9:.3g}), "
        f"{entry['op_overhead_s'] * 1e6:.2f} us per operator"
    )
