"""Attention accuracy: each implementation's bf16 error against attention computed in float64, side by side.

For each head dim and mask, the same bf16 inputs go through tessera's Triton kernel, torch SDPA's flash
and cuDNN backends, and torch's math in bf16; out, dq, dk and dv are compared with the float64 result
(max absolute error, and the error's root mean square). This is the calibration behind the GPU kernel
test's error budget: a bf16 kernel is judged against what the other bf16 kernels achieve on the same inputs.

    python benchmarks/bench_attention_accuracy.py          # on a GPU machine
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from tessera.kernels import flash_attention  # noqa: E402


def definition(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v in float64, kv heads repeated for their query-head group."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def implementations(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        return run

    return {
        "tessera_triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="triton"),
        "tessera_auto": lambda q, k, v: flash_attention(q, k, v, causal=causal),  # a training step's path
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "torch_math_bf16": sdpa(SDPBackend.MATH),
    }


def errors(fn, q, k, v, do, want):
    args = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    try:
        out = fn(*args)
    except RuntimeError as e:  # a backend that does not take this shape (GQA, head dim) on this build
        return {"unsupported": str(e).splitlines()[0][:160]}
    out.backward(do)
    row = {}
    for name, got, ref in zip(["out", "dq", "dk", "dv"], [out] + [t.grad for t in args], want):
        diff = got.double() - ref
        row[name] = {"max_abs": diff.abs().max().item(), "rms": diff.square().mean().sqrt().item()}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1041)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a .json file or a directory")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention_accuracy: no CUDA GPU found; these are GPU figures", file=sys.stderr)
        return 2
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (True, False):
            g = torch.Generator(device="cuda").manual_seed(args.seed)
            shape_q, shape_kv = (args.batch, args.heads, args.seq_len, d), (args.batch, args.kv_heads, args.seq_len, d)
            q, do = (torch.randn(shape_q, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(shape_kv, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            out = definition(*ref, causal)
            out.backward(do.double())
            want = [out.detach()] + [t.grad for t in ref]
            for name, fn in implementations(causal).items():
                row = {"implementation": name, "head_dim": d, "causal": causal, **errors(fn, q, k, v, do, want)}
                rows.append(row)
                figures = "  ".join(
                    f"{n} {row[n]['max_abs']:.2e}/{row[n]['rms']:.1e}" for n in ("out", "dq", "dk", "dv") if n in row
                )
                print(
                    f"D={d:<4} {'causal' if causal else 'full':<6} {name:<16} {figures or row.get('unsupported')}",
                    flush=True,
                )
    config = {k: v for k, v in vars(args).items() if k != "out"}
    path = write_results(
        "attention-accuracy-" + torch.cuda.get_device_name(0).replace(" ", "_"),
        config,
        {"rows": rows, "metric": "max_abs / rms of (bf16 result - float64 definition)"},
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
