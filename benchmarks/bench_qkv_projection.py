"""The attention block's q, k and v projections as three GEMMs or one, bf16 and FP8, forward + backward: the
measurement behind fusing them (the GPU suite's profile puts matmuls at 68% of the compiled 1b step, and the
planner's calibration measures the 2048 -> 512 K/V projections at a third of the large GEMMs' TFLOP/s).

Rows, each compiled (torch.compile of the projection alone) and timed side by side in one process:
    separate        three nn.Linear, as models/attention.py's GroupedQueryAttention runs them today
    fused           the three weights concatenated each call, one GEMM, the output split (same parameters)
    fp8 separate    torchao's tensorwise Float8Linear for all three
    fp8 q only      Float8Linear for q, bf16 K/V (torchao's own filter skips layers this small)
    fp8 fused       one Float8Linear over the concatenated weight
Each row's output and gradients are compared with the separate bf16 row (max |diff| / max |ref|).

    python benchmarks/bench_qkv_projection.py                    # one GPU: the 1b preset's shapes
    python benchmarks/bench_qkv_projection.py --smoke --out /tmp/q.json   # the plumbing on CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import device_slug, timed, write_results  # noqa: E402
from gpu_suite_parts import relative_error  # noqa: E402

from tessera.parallel.fp8 import float8_config  # noqa: E402


class Projections(nn.Module):
    """q, k and v projections of one block; `fused` computes them with one GEMM on the same parameters."""

    def __init__(self, dim: int, q_out: int, kv_out: int, fused: bool):
        super().__init__()
        self.q_proj = nn.Linear(dim, q_out, bias=False)
        self.k_proj = nn.Linear(dim, kv_out, bias=False)
        self.v_proj = nn.Linear(dim, kv_out, bias=False)
        self.fused = fused

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        if not self.fused:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        return F.linear(x, w).split(sizes, dim=-1)


class FusedFloat8(nn.Module):
    """One Float8Linear over the three projections' weights stacked (FP8 needs the fused GEMM to be a module)."""

    def __init__(self, base: Projections, emulate: bool):
        super().__init__()
        from torchao.float8.float8_linear import Float8Linear  # lazy: the fp8 rows only

        w = torch.cat([base.q_proj.weight, base.k_proj.weight, base.v_proj.weight]).detach()
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        linear.weight.data.copy_(w)
        self.qkv = Float8Linear.from_float(linear, config=float8_config("tensorwise", emulate))
        self.sizes = [base.q_proj.out_features, base.k_proj.out_features, base.v_proj.out_features]

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return self.qkv(x).split(self.sizes, dim=-1)


def build(kind: str, base: Projections, emulate: bool) -> nn.Module:
    """A row's module on the base's weights (copies: each row starts from the same parameters)."""

    if kind in ("separate", "fused"):
        m = copy.deepcopy(base)
        m.fused = kind == "fused"
        return m
    if kind == "fp8 fused":
        return FusedFloat8(base, emulate)
    from torchao.float8 import convert_to_float8_training  # lazy: the fp8 rows only

    m = copy.deepcopy(base)
    only_q: Callable[[nn.Module, str], bool] = lambda _, name: name == "q_proj"  # noqa: E731
    config = float8_config("tensorwise", emulate)
    return convert_to_float8_training(m, config=config, module_filter_fn=only_q if kind == "fp8 q only" else None)


def grads_of(m: nn.Module) -> Tensor:
    """The weight gradients in q, k, v order as one (out, in) matrix, whichever way the module holds them."""
    if isinstance(m, FusedFloat8):
        return m.qkv.weight.grad
    return torch.cat([m.q_proj.weight.grad, m.k_proj.weight.grad, m.v_proj.weight.grad])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16 * 2048, help="rows of x (the suite's batch 16 x seq 2048)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--q-out", type=int, default=2048, help="n_heads * head_dim (1b: 32 x 64)")
    p.add_argument("--kv-out", type=int, default=512, help="n_kv_heads * head_dim (1b: 8 x 64)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="eager rows (the compiled ones are the default)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in float32, FP8 emulated")
    p.add_argument("--out", default=None, help="a .json file or a directory")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; --smoke runs the plumbing on CPU")
    if args.smoke:
        args.tokens, args.dim, args.q_out, args.kv_out, args.reps = 64, 32, 32, 16, 2
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    kinds = ["separate", "fused", "fp8 separate", "fp8 q only", "fp8 fused"]

    torch.manual_seed(0)
    base = Projections(args.dim, args.q_out, args.kv_out, fused=False).to(device, dtype)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=dtype, requires_grad=True)
    dy = [torch.randn(args.tokens, n, device=device, dtype=dtype) for n in (args.q_out, args.kv_out, args.kv_out)]
    flops = 6 * args.tokens * args.dim * (args.q_out + 2 * args.kv_out)  # forward 2, backward 4 per MAC

    reference: tuple[list[Tensor], Tensor, Tensor] | None = None
    rows: dict[str, dict] = {}
    for kind in kinds:
        module = build(kind, base, emulate=args.smoke)
        run = module if args.no_compile else torch.compile(module)

        def step() -> list[Tensor]:
            x.grad = None
            for prm in module.parameters():
                prm.grad = None
            outs = run(x)
            torch.autograd.backward(outs, dy)
            return [o.detach() for o in outs]

        outs = step()
        if reference is None:
            reference = (outs, x.grad.clone(), grads_of(module).clone())
        seconds = timed(step, args.reps, 3, device)
        median = statistics.median(seconds)
        rows[kind] = {
            "forward_backward_s": median,
            "tflops": flops / median / 1e12,
            "out_rel_diff": max(relative_error(o, r) for o, r in zip(outs, reference[0])),
            "dx_rel_diff": relative_error(x.grad, reference[1]),
            "dw_rel_diff": relative_error(grads_of(module), reference[2]),
        }
        print(
            f"{kind:14s} {median * 1e3:8.3f} ms  {rows[kind]['tflops']:7.1f} TFLOP/s  diffs "
            f"out {rows[kind]['out_rel_diff']:.1e} dx {rows[kind]['dx_rel_diff']:.1e} "
            f"dw {rows[kind]['dw_rel_diff']:.1e}",
            flush=True,
        )
    ratios = {f"{k} / separate": rows[k]["forward_backward_s"] / rows["separate"]["forward_backward_s"] for k in rows}
    print(ratios)
    config = {k: getattr(args, k) for k in ("tokens", "dim", "q_out", "kv_out", "reps", "no_compile", "smoke")}
    config["dtype"] = str(dtype).removeprefix("torch.")
    name = "qkv-projection-" + ("cpu-smoke" if args.smoke else device_slug(torch.cuda.get_device_name()))
    results = {"rows": rows, "step_time_ratios": ratios, "flops_per_call": flops}
    path = write_results(name, config, results, args.out)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
