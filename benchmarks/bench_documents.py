"""Packed documents benchmark: document-masked attention against full causal attention over the same tokens,
a whole model's training step with and without the document mask, and context parallel's ring with
documents (steps skipped, time, and the zigzag balance of the work).

    speedup = t_causal / t_documents      above 1: the masked step is faster

For each mean document length (seq/2, seq/4, ...) the documents' lengths are drawn (seeded, geometric
around the mean, cut to the sequence) and every row packs them. Attention is timed forward + backward with
what training runs: on CPU ATen's fused flash attention (full causal) against tessera's per-document path
(the same kernel per document); on CUDA the Triton kernel with and without document ids, and
flash-attn's varlen kernel when that package is installed. The model step is the `small` Llama's forward
+ backward at the same shapes. The ring runs on cp CPU ranks (gloo) with and without documents; the
skipped steps come from the ring's own count.

    python benchmarks/bench_documents.py --seq-len 4096 --cp 2,4
    python benchmarks/bench_documents.py --quick      # small shapes: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import timed, write_results  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tessera.kernels import document_ids, flash_attention  # noqa: E402
from tessera.data.corpus import pack_documents  # noqa: E402
from tessera.parallel.context import causal_pairs, ring_attention, zigzag_indices, zigzag_shard  # noqa: E402

SEPARATOR = 257


def document_positions(seq: int, rows: int, mean: int, seed: int = 0) -> torch.Tensor:
    """Positions (rows, seq) of documents with lengths drawn around `mean` (geometric), packed back to back."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (rows, seq + 1), generator=gen)
    p = 1.0 / mean
    for r in range(rows):
        pos = -1
        while True:
            u = float(torch.rand((), generator=gen).clamp(min=1e-12))
            pos += max(1, int(torch.log(torch.tensor(u)) / torch.log(torch.tensor(1 - p))) + 1)
            if pos >= seq:
                break
            tokens[r, pos] = SEPARATOR
    _, positions = pack_documents(tokens[:, :-1], tokens[:, 1:], SEPARATOR)
    return positions


def _median_seconds(fn, steps: int, warmup: int, device) -> float:
    return statistics.median(timed(fn, steps, warmup, device))


def _qkv(rows, seq, heads, kv_heads, head_dim, device, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(rows, h, seq, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads, heads))
    return [t.to(device, dtype) for t in (q, k, v, do)]


def attention_rows(args, device, dtype) -> list[dict]:
    q, k, v, do = _qkv(args.rows, args.seq_len, args.heads, args.kv_heads, args.head_dim, device, dtype)

    def step(**docs):
        def run():
            q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
            flash_attention(q_, k_, v_, causal=True, **docs).backward(do)

        return run

    t_causal = _median_seconds(step(), args.steps, args.warmup, device)
    out = []
    for divisor in args.divisors:
        mean = args.seq_len // divisor
        positions = document_positions(args.seq_len, args.rows, mean).to(device)
        docs = document_ids(positions, torch.arange(args.seq_len))
        row = {
            "part": "attention",
            "mean_doc_len": mean,
            "seq_over_mean": divisor,
            "documents": int((positions == 0).sum()),
            "t_causal_s": t_causal,
            "t_documents_s": _median_seconds(step(q_docs=docs), args.steps, args.warmup, device),
            "visible_pairs_ratio": float((positions + 1).sum() / (args.rows * args.seq_len * (args.seq_len + 1) / 2)),
        }
        row["speedup"] = row["t_causal_s"] / row["t_documents_s"]
        flash_varlen = _flash_attn_varlen(q, k, v, do, positions, args) if device.type == "cuda" else None
        if flash_varlen is not None:
            row["t_flash_attn_varlen_s"] = flash_varlen
        out.append(row)
        print(
            f"attention, mean document {mean:5d} ({row['documents']} documents): causal {t_causal * 1e3:8.2f} ms, "
            f"documents {row['t_documents_s'] * 1e3:8.2f} ms, speedup {row['speedup']:.2f}x"
            + (f", flash-attn varlen {flash_varlen * 1e3:.2f} ms" if flash_varlen else ""),
            flush=True,
        )
    return out


def _flash_attn_varlen(q, k, v, do, positions, args) -> float | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    lengths = []
    for row in positions:
        starts = (row == 0).nonzero().flatten().tolist() + [row.numel()]
        lengths += [b - a for a, b in zip(starts[:-1], starts[1:])]
    cu = torch.tensor([0] + lengths, device=q.device).cumsum(0).to(torch.int32)
    flat = [t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).contiguous() for t in (q, k, v, do)]

    def run():
        q_, k_, v_ = (t.clone().requires_grad_() for t in flat[:3])
        flash_attn_varlen_func(q_, k_, v_, cu, cu, max(lengths), max(lengths), causal=True).backward(flat[3])

    return _median_seconds(run, args.steps, args.warmup, q.device)


def model_rows(args, device) -> list[dict]:
    from tessera.models.spec import get_spec

    spec = get_spec("llama")
    model = spec.build_model(spec.config(args.model, max_seq_len=max(args.seq_len, 256)), device=device, seed=0)
    tokens = torch.randint(0, 256, (args.rows, args.seq_len), generator=torch.Generator().manual_seed(0)).to(device)

    def step(positions):
        def run():
            model(tokens, positions).float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        return run

    t_causal = _median_seconds(step(None), args.steps, args.warmup, device)
    out = []
    for divisor in args.divisors:
        mean = args.seq_len // divisor
        positions = document_positions(args.seq_len, args.rows, mean).to(device)
        row = {
            "part": "model_step",
            "model": args.model,
            "mean_doc_len": mean,
            "seq_over_mean": divisor,
            "t_causal_s": t_causal,
            "t_documents_s": _median_seconds(step(positions), args.steps, args.warmup, device),
        }
        row["speedup"] = row["t_causal_s"] / row["t_documents_s"]
        out.append(row)
        print(
            f"{args.model} forward + backward, mean document {mean:5d}: causal {t_causal * 1e3:8.1f} ms, documents "
            f"{row['t_documents_s'] * 1e3:8.1f} ms, speedup {row['speedup']:.2f}x",
            flush=True,
        )
    return out


def ring_rank(seq, rows, heads, kv_heads, head_dim, mean, steps, warmup):
    """One cp rank: the ring's forward + backward with documents (mean length `mean`; 0: none)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    q, k, v, do = (
        zigzag_shard(t, 2, rank, size) for t in _qkv(rows, seq, heads, kv_heads, head_dim, device, torch.float32)
    )
    docs = None
    if mean:
        positions = zigzag_shard(document_positions(seq, rows, mean), 1, rank, size)
        docs = document_ids(positions, zigzag_indices(seq, rank, size))
    stats: dict = {}

    def run():
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        ring_attention(q_, k_, v_, dist.group.WORLD, causal=True, docs=docs, stats=stats).backward(do)

    seconds = _median_seconds(run, steps, warmup, device)
    calls = steps + warmup
    counts = torch.tensor([stats.get("ring_steps", 0), stats.get("ring_steps_skipped", 0)], dtype=torch.int64)
    dist.all_reduce(counts)
    return {"t_rank_s": seconds, "ring_steps": int(counts[0]) // calls, "ring_steps_skipped": int(counts[1]) // calls}


def ring_rows(args) -> list[dict]:
    from tessera.launching.launch import run_ranks

    out = []
    for cp in args.cp:
        shape = (args.seq_len, args.rows, args.heads, args.kv_heads, args.head_dim)
        base = run_ranks(ring_rank, cp, *shape, 0, args.steps, args.warmup, timeout=3600)[0]
        for divisor in args.divisors:
            mean = args.seq_len // divisor
            got = run_ranks(ring_rank, cp, *shape, mean, args.steps, args.warmup, timeout=3600)[0]
            # the work each rank does over a global batch of --balance-rows rows packed alike
            pairs = [
                sum(x)
                for x in zip(
                    *(
                        causal_pairs(args.seq_len, cp, "zigzag", p)
                        for p in document_positions(args.seq_len, args.balance_rows, mean)
                    )
                )
            ]
            row = {
                "part": "ring",
                "cp": cp,
                "mean_doc_len": mean,
                "seq_over_mean": divisor,
                "t_rank_causal_s": base["t_rank_s"],
                "t_rank_documents_s": got["t_rank_s"],
                "speedup": base["t_rank_s"] / got["t_rank_s"],
                "ring_steps": got["ring_steps"],
                "ring_steps_skipped": got["ring_steps_skipped"],
                "pairs_per_rank": pairs,
                "pairs_max_over_mean": max(pairs) / (sum(pairs) / len(pairs)),
            }
            out.append(row)
            print(
                f"ring cp{cp}, mean document {mean:5d}: {row['ring_steps_skipped']} of {row['ring_steps']} block "
                f"steps skipped (all ranks, forward); per rank {base['t_rank_s'] * 1e3:.1f} ms causal, "
                f"{got['t_rank_s'] * 1e3:.1f} ms documents ({row['speedup']:.2f}x); work max/mean "
                f"{row['pairs_max_over_mean']:.3f} over {args.balance_rows} rows",
                flush=True,
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--divisors", default="2,4,8,16", help="mean document lengths as seq / N, comma-separated")
    p.add_argument("--model", default="small", help="a Llama preset for the model step")
    p.add_argument("--cp", default="2,4", help="ring degrees on CPU ranks, comma-separated ('' for none)")
    p.add_argument("--balance-rows", type=int, default=8, help="rows of the global batch the work balance sums over")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="small shapes, one step: a smoke run")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.seq_len, args.heads, args.kv_heads, args.head_dim, args.steps, args.warmup = 256, 2, 1, 16, 1, 0
        args.model, args.cp = "debug", "2"
    args.divisors = [int(d) for d in args.divisors.split(",")]
    args.cp = [int(c) for c in args.cp.split(",") if c]
    for d in args.divisors:
        if args.seq_len % d or args.seq_len // d < 1:
            raise SystemExit(f"--divisors {d}: --seq-len {args.seq_len} must be a multiple of it")
    for cp in args.cp:
        if args.seq_len % (2 * cp):
            raise SystemExit(f"--cp {cp}: --seq-len {args.seq_len} must split into 2 x {cp} chunks")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = attention_rows(args, device, dtype) + model_rows(args, device) + ring_rows(args)
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"dtype": str(dtype).removeprefix("torch.")}
    path = write_results(f"documents-{device.type}", config, rows, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
