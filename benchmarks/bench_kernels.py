"""Kernel benchmark: tessera's Triton attention, RMSNorm and SwiGLU against torch, side by side in one run.

Attention: TFLOP/s of forward and forward+backward, bf16, sequence 1k-16k, head dim 64 and 128, causal and
not, against torch SDPA's flash and cuDNN backends on the same inputs. RMSNorm: GB/s and the fraction of
the device's HBM bandwidth, against torch eager and torch.compile; SwiGLU's activation, silu(gate) * up, the
same way (at the least traffic: 3 tensors forward, 5 backward). Writes JSON (and a PNG plot when
matplotlib is installed) under benchmarks/results/.

    python benchmarks/bench_kernels.py                # on a GPU machine
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke   # CPU: exercises the code paths only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_info, write_results  # noqa: E402

from tessera.kernels import flash_attention, rms_norm, rms_norm_reference  # noqa: E402
from tessera.kernels.dispatch import swiglu  # noqa: E402


def timed_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median milliseconds of fn (CUDA: triton.testing.do_bench, which flushes L2 between runs)."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=reps, return_mode="median"))
    for _ in range(max(1, warmup // 25)):
        fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def attention_impls(causal: bool) -> dict[str, Callable]:
    impls: dict[str, Callable] = {
        "tessera_triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="triton")
    }
    if torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(backend):
            def run(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            return run

        impls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        impls["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    return impls


def bench_attention(args, device, dtype) -> list[dict]:
    rows = []
    for d in args.head_dims:
        heads = args.hidden // d
        for seq in args.seq_lens:
            batch = max(1, args.tokens // seq)
            for causal in getattr(args, "masks", (True, False)):  # the GPU suite runs causal only
                flops_fwd = 4 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
                q, k, v = (
                    torch.randn(batch, heads, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
                )
                do = torch.randn_like(q)
                for name, impl in attention_impls(causal).items():
                    row = dict(
                        impl=name, seq_len=seq, head_dim=d, heads=heads, batch=batch, causal=causal, dtype=str(dtype)
                    )
                    try:
                        fwd = timed_ms(lambda: impl(q, k, v), args.warmup, args.reps)

                        def fwd_bwd():
                            q.grad = k.grad = v.grad = None
                            impl(q, k, v).backward(do)

                        both = timed_ms(fwd_bwd, args.warmup, args.reps)
                        row.update(
                            fwd_ms=fwd,
                            fwd_bwd_ms=both,
                            fwd_tflops=flops_fwd / fwd / 1e9,
                            fwd_bwd_tflops=3.5 * flops_fwd / both / 1e9,  # backward does 2.5x the forward's matmuls
                        )
                    except Exception as e:  # a backend that cannot run this shape is recorded, not fatal
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    rows.append(row)
                    print(_fmt_attention(row), flush=True)
    return rows


def _fmt_attention(r: dict) -> str:
    head = f"attention {r['impl']:<15} S={r['seq_len']:>6} D={r['head_dim']:>3} {'causal' if r['causal'] else 'full  '}"
    if "error" in r:
        return f"{head}  {r['error']}"
    return f"{head}  fwd {r['fwd_tflops']:7.1f} TFLOP/s  fwd+bwd {r['fwd_bwd_tflops']:7.1f} TFLOP/s"


def bench_rms_norm(args, device, dtype) -> list[dict]:
    rows = []
    bandwidth = device_info().get("hbm_bandwidth_bytes_per_s")
    compiled = torch.compile(rms_norm_reference) if torch.cuda.is_available() else None
    impls = {
        "tessera_triton": lambda x, w: rms_norm(x, w, 1e-5, backend="triton"),
        "torch_eager": lambda x, w: rms_norm_reference(x, w, 1e-5),
    }
    if compiled is not None:
        impls["torch_compile"] = lambda x, w: compiled(x, w, 1e-5)
    for tokens, hidden in args.norm_shapes:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        size = x.numel() * x.element_size()
        for name, impl in impls.items():
            fwd = timed_ms(lambda: impl(x, w), args.warmup, args.reps)

            def fwd_bwd():
                x.grad = w.grad = None
                impl(x, w).backward(dy)

            both = timed_ms(fwd_bwd, args.warmup, args.reps)
            # minimum traffic: forward reads x, writes y; backward reads x and dy, writes dx
            row = dict(
                impl=name,
                tokens=tokens,
                hidden=hidden,
                dtype=str(dtype),
                fwd_ms=fwd,
                fwd_bwd_ms=both,
                fwd_gb_s=2 * size / fwd / 1e6,
                fwd_bwd_gb_s=5 * size / both / 1e6,
            )
            if bandwidth:
                row["fwd_fraction_of_hbm"] = row["fwd_gb_s"] * 1e9 / bandwidth
                row["fwd_bwd_fraction_of_hbm"] = row["fwd_bwd_gb_s"] * 1e9 / bandwidth
            rows.append(row)
            print(
                f"rms_norm {name:<15} {tokens}x{hidden}  fwd {row['fwd_gb_s']:8.1f} GB/s  "
                f"fwd+bwd {row['fwd_bwd_gb_s']:8.1f} GB/s",
                flush=True,
            )
    return rows


def _swiglu_torch(gate, up):
    return F.silu(gate) * up


def bench_swiglu(args, device, dtype) -> list[dict]:
    """silu(gate) * up: GB/s forward and forward+backward at the least traffic (forward reads gate and up and
    writes h; backward reads dh, gate and up and writes both gradients), and the fraction of HBM."""
    rows = []
    bandwidth = device_info().get("hbm_bandwidth_bytes_per_s")
    impls = {"tessera_triton": lambda g, u: swiglu(g, u, backend="triton"), "torch_eager": _swiglu_torch}
    if torch.cuda.is_available():
        impls["torch_compile"] = torch.compile(_swiglu_torch)
    for tokens, ffn in args.norm_shapes:
        g = torch.randn(tokens, ffn, device=device, dtype=dtype, requires_grad=True)
        u = torch.randn(tokens, ffn, device=device, dtype=dtype, requires_grad=True)
        dh = torch.randn_like(g)
        size = g.numel() * g.element_size()
        for name, impl in impls.items():
            fwd = timed_ms(lambda: impl(g, u), args.warmup, args.reps)

            def fwd_bwd():
                g.grad = u.grad = None
                impl(g, u).backward(dh)

            both = timed_ms(fwd_bwd, args.warmup, args.reps)
            row = dict(
                impl=name,
                tokens=tokens,
                ffn=ffn,
                dtype=str(dtype),
                fwd_ms=fwd,
                fwd_bwd_ms=both,
                fwd_gb_s=3 * size / fwd / 1e6,
                fwd_bwd_gb_s=8 * size / both / 1e6,
            )
            if bandwidth:
                row["fwd_fraction_of_hbm"] = row["fwd_gb_s"] * 1e9 / bandwidth
                row["fwd_bwd_fraction_of_hbm"] = row["fwd_bwd_gb_s"] * 1e9 / bandwidth
            rows.append(row)
            print(
                f"swiglu {name:<15} {tokens}x{ffn}  fwd {row['fwd_gb_s']:8.1f} GB/s  "
                f"fwd+bwd {row['fwd_bwd_gb_s']:8.1f} GB/s",
                flush=True,
            )
    return rows


def swiglu_ratios(rows: list[dict]) -> list[dict]:
    """tessera's SwiGLU against torch eager's and torch.compile's, each shape's rows of this run."""
    out = []
    for r in rows:
        if r["impl"] != "tessera_triton":
            continue
        same = {o["impl"]: o for o in rows if (o["tokens"], o["ffn"]) == (r["tokens"], r["ffn"])}
        entry = dict(tokens=r["tokens"], ffn=r["ffn"], fwd_bwd_fraction_of_hbm=r.get("fwd_bwd_fraction_of_hbm"))
        for other in ("torch_eager", "torch_compile"):
            if other in same:
                entry[f"fwd_bwd_vs_{other}"] = same[other]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        out.append(entry)
    return out


def ratios(attention: list[dict], norms: list[dict]) -> dict:
    """The acceptance ratios, each from rows measured in this run."""

    def find(rows, **kw):
        return next((r for r in rows if all(r.get(k) == v for k, v in kw.items()) and "error" not in r), None)

    out: dict = {"attention_fwd_bwd_vs_sdpa_flash": [], "attention_fwd_bwd_vs_sdpa_cudnn": [], "rms_norm": []}
    for r in attention:
        if r["impl"] != "tessera_triton" or "error" in r:
            continue
        for other, key in (
            ("sdpa_flash", "attention_fwd_bwd_vs_sdpa_flash"),
            ("sdpa_cudnn", "attention_fwd_bwd_vs_sdpa_cudnn"),
        ):
            o = find(attention, impl=other, seq_len=r["seq_len"], head_dim=r["head_dim"], causal=r["causal"])
            if o:
                out[key].append(
                    dict(
                        seq_len=r["seq_len"],
                        head_dim=r["head_dim"],
                        causal=r["causal"],
                        ratio=r["fwd_bwd_tflops"] / o["fwd_bwd_tflops"],
                    )
                )
    for r in norms:
        if r["impl"] == "tessera_triton":
            c = find(norms, impl="torch_compile", tokens=r["tokens"], hidden=r["hidden"])
            out["rms_norm"].append(
                dict(
                    tokens=r["tokens"],
                    hidden=r["hidden"],
                    fwd_fraction_of_hbm=r.get("fwd_fraction_of_hbm"),
                    fwd_vs_compile=(c["fwd_ms"] / r["fwd_ms"]) if c else None,
                    fwd_bwd_vs_compile=(c["fwd_bwd_ms"] / r["fwd_bwd_ms"]) if c else None,
                )
            )
    return out


def plot(attention: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (d, causal) in zip(axes, [(64, True), (64, False), (128, True), (128, False)]):
        for impl in sorted({r["impl"] for r in attention}):
            pts = [
                (r["seq_len"], r["fwd_bwd_tflops"])
                for r in attention
                if r["impl"] == impl and r["head_dim"] == d and r["causal"] == causal and "error" not in r
            ]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=impl)
        ax.set(
            xscale="log",
            title=f"fwd+bwd, D={d}, {'causal' if causal else 'non-causal'}",
            xlabel="sequence",
            ylabel="TFLOP/s",
        )
        ax.legend()
    fig.suptitle(f"attention on {device_info()['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head_dim")
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq_len")
    p.add_argument(
        "--norm-shapes",
        type=lambda s: [tuple(int(v) for v in x.split("x")) for x in s.split(",")],
        default=[(16384, 4096), (16384, 8192), (32768, 8192)],
    )
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the code paths"
    )
    args = p.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print(
                "bench_kernels: --smoke runs the kernels on CPU and needs TRITON_INTERPRET=1 in the environment",
                file=sys.stderr,
            )
            return 2
        args.seq_lens, args.head_dims, args.hidden, args.tokens = [32], [16], 32, 32
        args.norm_shapes, args.warmup, args.reps = [(8, 64)], 1, 1
        device, dtype = "cpu", torch.float32
    elif not torch.cuda.is_available():
        print(
            "bench_kernels: no CUDA GPU found; the figures are GPU figures. Run it on a GPU machine, "
            "or use --smoke (with TRITON_INTERPRET=1) to check the code on CPU",
            file=sys.stderr,
        )
        return 2
    else:
        device, dtype = "cuda", torch.bfloat16
    attention = bench_attention(args, device, dtype)
    norms = bench_rms_norm(args, device, dtype)
    swiglus = bench_swiglu(args, device, dtype)
    name = "kernels-smoke" if args.smoke else f"kernels-{device_info()['device'].replace(' ', '_')}"
    config = {k: v for k, v in vars(args).items() if k != "out"}
    found = {**ratios(attention, norms), "swiglu": swiglu_ratios(swiglus)}
    path = write_results(
        name, config, {"attention": attention, "rms_norm": norms, "swiglu": swiglus, "ratios": found}, args.out
    )
    print(f"wrote {path}")
    if not args.smoke:
        png = plot(attention, path.with_suffix(".png"))
        if png:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
