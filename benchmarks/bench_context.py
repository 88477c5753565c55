"""Context-parallel attention benchmark: ring and all-gather attention over cp ranks against one rank
attending the whole sequence, forward + backward, and the per-rank work balance of zigzag against
contiguous chunks.

    efficiency = t_full / (cp * t_rank)     1.0: cp ranks split the work perfectly, with no overhead

t_full runs on one rank alone (same threads per rank) with what one process trains with, and the
context-parallel blocks run the same kernels (CPU: ATen's fused flash attention forward and backward,
given the merged LSE; CUDA: the Triton kernels). The balance is measured too: each rank's share of
causal attention (its queries against the keys before them) is timed one rank after another in one
process, for the zigzag layout and for contiguous chunks, with one implementation for every span (the
blockwise torch reference, whose cost follows the blocks it computes), beside the pair counts of the
work model.

    python benchmarks/bench_context.py --seq-len 2048 --cp 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import timed, write_results  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tessera.kernels import attention_reference, flash_attention  # noqa: E402
from tessera.parallel.context import (  # noqa: E402
    allgather_attention,
    causal_pairs,
    ring_attention,
    zigzag_indices,
    zigzag_shard,
)


def _inputs(seq: int, heads: int, kv_heads: int, head_dim: int, device):
    gen = torch.Generator().manual_seed(0)
    shape = lambda h: (1, h, seq, head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=gen) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(shape(heads), generator=gen)
    return [t.to(device) for t in (q, k, v, dout)]


def _device():
    if dist.is_initialized() and dist.get_backend() == "nccl":
        torch.cuda.set_device(dist.get_rank())
        return torch.device("cuda", dist.get_rank())
    return torch.device("cpu")


def full_attention(seq, heads, kv_heads, head_dim, steps, warmup):
    device = _device()
    q, k, v, dout = _inputs(seq, heads, kv_heads, head_dim, device)

    def step():  # what one process trains with: CPU, torch's fused flash attention; CUDA, the Triton kernel
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        flash_attention(q_, k_, v_, causal=True).backward(dout)

    return timed(step, steps, warmup, device)


def context_attention(method, seq, heads, kv_heads, head_dim, steps, warmup):
    device = _device()
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (zigzag_shard(t, 2, rank, size) for t in _inputs(seq, heads, kv_heads, head_dim, device))
    fn = ring_attention if method == "ring" else allgather_attention

    def step():
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        fn(q_, k_, v_, dist.group.WORLD, causal=True).backward(dout)

    return timed(step, steps, warmup, device)


def balance(seq, heads, kv_heads, head_dim, cp, steps):
    """Per-rank seconds of each rank's causal share (its queries over the keys up to each), one rank
    after another: zigzag (two chunks) and contiguous (one chunk of 2 chunks' length)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    q, k, v, _ = _inputs(seq, heads, kv_heads, head_dim, device)
    chunk = seq // (2 * cp)

    def share(spans):  # [(query start, stop)]: each attends keys [0, stop), causal bottom-right
        for start, stop in spans:
            attention_reference(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], causal=True)

    def seconds(spans):
        share(spans)  # warm-up
        samples = []
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            share(spans)
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    out = {}
    for layout in ("zigzag", "contiguous"):
        per_rank = []
        for r in range(cp):
            if layout == "zigzag":
                spans = [(r * chunk, (r + 1) * chunk), ((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
            else:
                spans = [(2 * r * chunk, 2 * (r + 1) * chunk)]
            per_rank.append(seconds(spans))
        pairs = causal_pairs(seq, cp, layout)
        out[layout] = {
            "seconds_per_rank": per_rank,
            "max_over_min": max(per_rank) / min(per_rank),
            "pairs_per_rank": pairs,
            "pairs_max_over_min": max(pairs) / min(pairs),
        }
    assert torch.equal(zigzag_indices(seq, 0, cp)[:chunk], torch.arange(chunk))
    return out


def main(argv=None) -> int:
    from tessera.launching.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cp", default="2", help="comma-separated cp degrees")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    shape = (args.seq_len, args.heads, args.kv_heads, args.head_dim)
    t_full = statistics.median(run_ranks(full_attention, 1, *shape, args.steps, args.warmup, timeout=3600)[0])
    print(f"full sequence on one rank: {t_full * 1e3:.1f} ms (forward + backward)", flush=True)
    rows = []
    for cp in (int(c) for c in args.cp.split(",")):
        for method in ("ring", "allgather"):
            t_rank = statistics.median(
                run_ranks(context_attention, cp, method, *shape, args.steps, args.warmup, timeout=3600)[0]
            )
            row = dict(method=method, cp=cp, t_full_s=t_full, t_rank_s=t_rank, efficiency=t_full / (cp * t_rank))
            rows.append(row)
            print(f"cp{cp} {method:<9} {t_rank * 1e3:8.1f} ms per rank, efficiency {row['efficiency']:.3f}", flush=True)
        bal = balance(*shape, cp, args.steps)
        rows.append(dict(method="balance", cp=cp, **bal))
        print(
            f"cp{cp} balance: zigzag max/min {bal['zigzag']['max_over_min']:.3f} (pairs "
            f"{bal['zigzag']['pairs_max_over_min']:.3f}), contiguous {bal['contiguous']['max_over_min']:.3f} (pairs "
            f"{bal['contiguous']['pairs_max_over_min']:.3f})",
            flush=True,
        )
    device = "gpu" if torch.cuda.is_available() else "cpu"
    path = write_results(f"context-attention-{device}", vars(args), rows, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
