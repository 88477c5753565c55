"""Peak memory and time of the loss at a 128k vocabulary: today's full logits against the chunked head.

One forward + backward of the output projection and the loss over N tokens, on one process:
    logits    logits = h @ W^T (fp32, N x V), then cross_entropy_sum (tessera.parallel.loss)
    chunked   LinearCrossEntropyHead(h, targets): chunk logits only, gradients in the forward (Liger style)
Memory is the peak storage of live tensors (tessera.metrics.memtrack.LiveTensorBytes, re-read around every
operator), with h and W registered before the pass: `peak_bytes` counts them, `peak_above_inputs_bytes`
is what the loss adds on top (logits, softmax, gradients of h and W). Times are medians (and minima) over
repeats without the tracker, the two kinds alternating. Losses and gradients of both paths are compared
with each other and with a float64 computation of the same inputs.

    python benchmarks/bench_loss_memory.py                       # 2048 tokens x dim 512, vocab 128256
    python benchmarks/bench_loss_memory.py --tokens 4096 --dims 256,512 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_results  # noqa: E402

from tessera.metrics.memtrack import LiveTensorBytes  # noqa: E402
from tessera.parallel.loss import (  # noqa: E402
    CHUNK_ELEMENTS,
    LinearCrossEntropyHead,
    chunk_tokens,
    cross_entropy_sum,
    linear_cross_entropy_sum,
)


def make_inputs(tokens: int, dim: int, vocab: int, chunk_elements: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, dim, generator=gen).requires_grad_()
    head = LinearCrossEntropyHead(
        torch.nn.Parameter(torch.randn(vocab, dim, generator=gen) * dim**-0.5), chunk_elements=chunk_elements
    )
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[::7] = -100  # some ignored positions, as masked data has
    return h, head, targets


def one_pass(kind: str, h: torch.Tensor, head: LinearCrossEntropyHead, targets: torch.Tensor) -> torch.Tensor:
    h.grad = head.weight.grad = None
    if kind == "logits":
        total, count = cross_entropy_sum(head(h), targets)  # today's: the full logits, then the loss
    else:
        total, count = head(h, targets)
    (total / count).backward()
    return total.detach()


def measure_memory(kind: str, tokens: int, dim: int, vocab: int, chunk_elements: int) -> dict:
    h, head, targets = make_inputs(tokens, dim, vocab, chunk_elements)
    tracker = LiveTensorBytes()
    tracker.track(h)
    tracker.track(targets)
    tracker.track_existing([head])
    inputs = tracker.now
    with tracker:
        loss = one_pass(kind, h, head, targets)
    return {
        "inputs_bytes": inputs,
        "peak_bytes": tracker.peak,
        "peak_above_inputs_bytes": tracker.peak - inputs,
        "loss_sum": loss.item(),
        "grad_h": h.grad,
        "grad_w": head.weight.grad,
    }


def float64_reference(tokens: int, dim: int, vocab: int, chunk_elements: int) -> dict:
    """The same inputs in float64 through the chunked function (tests/test_fused_loss.py checks it against
    a naive float64 log_softmax to 1e-12): the figure both fp32 paths' errors are read against."""
    h, head, targets = make_inputs(tokens, dim, vocab, chunk_elements)
    h64 = h.detach().double().requires_grad_()
    w64 = head.weight.detach().double().requires_grad_()
    total, count = linear_cross_entropy_sum(h64, w64, targets, chunk_elements=chunk_elements)
    (total / count).backward()
    return {"loss_sum": total.item(), "grad_h": h64.grad, "grad_w": w64.grad}


def time_interleaved(tokens: int, dim: int, vocab: int, chunk_elements: int, repeats: int) -> dict[str, list[float]]:
    """Wall time of one forward + backward of each kind, alternating, so machine noise hits both alike."""
    h, head, targets = make_inputs(tokens, dim, vocab, chunk_elements)
    times: dict[str, list[float]] = {"logits": [], "chunked": []}
    for _ in range(repeats):
        for kind in times:
            started = time.perf_counter()
            one_pass(kind, h, head, targets)
            times[kind].append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens in the microbatch (rows x seq)")
    p.add_argument("--dims", default="512", help="hidden sizes, comma-separated")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary (Llama 3's 128256)")
    p.add_argument("--chunk-elements", type=int, default=CHUNK_ELEMENTS, help="fp32 logits per chunk")
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each kind (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--out", default=str(RESULTS / "loss_memory_cpu.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dim in (int(d) for d in args.dims.split(",")):
        runs = {
            kind: measure_memory(kind, args.tokens, dim, args.vocab, args.chunk_elements)
            for kind in ("logits", "chunked")
        }
        exact = float64_reference(args.tokens, dim, args.vocab, args.chunk_elements)
        times = time_interleaved(args.tokens, dim, args.vocab, args.chunk_elements, args.repeats)
        old, new = runs["logits"], runs["chunked"]
        row = {
            "tokens": args.tokens,
            "dim": dim,
            "vocab": args.vocab,
            "chunk_tokens": chunk_tokens(args.tokens, args.vocab, args.chunk_elements),
            "full_logits_fp32_bytes": args.tokens * args.vocab * 4,
        }
        for kind, r in runs.items():
            row.update(
                {f"{kind}_{k}": r[k] for k in ("inputs_bytes", "peak_bytes", "peak_above_inputs_bytes", "loss_sum")}
            )
            row[f"{kind}_time_s_median"] = statistics.median(times[kind])
            row[f"{kind}_time_s_min"] = min(times[kind])
            row[f"{kind}_times_s"] = times[kind]
            # errors against float64, relative to the reference's largest magnitude
            row[f"{kind}_loss_rel_err_vs_fp64"] = abs(r["loss_sum"] - exact["loss_sum"]) / abs(exact["loss_sum"])
            for g in ("grad_h", "grad_w"):
                ref = exact[g]
                row[f"{kind}_{g}_rel_err_vs_fp64"] = ((r[g].double() - ref).abs().max() / ref.abs().max()).item()
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
        row.update(
            {
                "peak_ratio": old["peak_bytes"] / new["peak_bytes"],
                "peak_above_inputs_ratio": old["peak_above_inputs_bytes"] / new["peak_above_inputs_bytes"],
                "time_ratio_chunked_over_logits": row["chunked_time_s_median"] / row["logits_time_s_median"],
                "loss_rel_diff": abs(new["loss_sum"] - old["loss_sum"]) / abs(old["loss_sum"]),
                "grad_h_rel_diff": rel(new["grad_h"], old["grad_h"]),
                "grad_w_rel_diff": rel(new["grad_w"], old["grad_w"]),
            }
        )
        rows.append(row)
        print(
            f"dim {dim}: peak {old['peak_bytes'] / 2**20:.0f} MiB -> {new['peak_bytes'] / 2**20:.0f} MiB "
            f"({row['peak_ratio']:.2f}x; above the inputs {row['peak_above_inputs_ratio']:.2f}x), time "
            f"{row['logits_time_s_median']:.2f} s -> {row['chunked_time_s_median']:.2f} s, loss rel diff "
            f"{row['loss_rel_diff']:.1e}"
        )
    config = {
        "tokens": args.tokens,
        "dims": args.dims,
        "vocab": args.vocab,
        "chunk_elements": args.chunk_elements,
        "repeats": args.repeats,
        "threads": args.threads,
        "dtype": "float32",
        "tracker": "tessera.metrics.memtrack.LiveTensorBytes (live tensor storage, h and W registered first)",
    }
    print(write_results("loss_memory_cpu", config, rows, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
