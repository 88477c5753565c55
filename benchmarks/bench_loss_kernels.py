"""The chunked loss's softmax in torch passes against the Triton kernels, side by side in one run.

One forward + backward of the chunked linear cross-entropy (tessera.parallel.loss.linear_cross_entropy_sum, the
loss head every training run uses) at the 1b preset's head: 32768 tokens (batch 16 x seq 2048) x dim 2048 x
vocab 128256, bf16, the default chunk rule (16 chunks of 2048 tokens). The two paths alternate:
    torch    --kernels torch: upcast each chunk's logits to fp32, then max, exp, sum, divide, scatter, multiply
    triton   the default on CUDA: kernels/triton_cross_entropy.py's row statistics and gradient over the logits
Times are medians (and minima) of the timed repeats. Correctness: the two paths' loss and gradients against
each other at this size, and both against a float64 definition on a 512-token slice.

    python benchmarks/bench_loss_kernels.py                      # on CUDA, the 1b head
    python benchmarks/bench_loss_kernels.py --device cpu --tokens 64 --dim 32 --vocab 1000 --repeats 2
        (CPU: the kernels run only under TRITON_INTERPRET=1; checks the plumbing, times mean nothing)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_slug, timed, write_results  # noqa: E402

from tessera.kernels import set_default_backend  # noqa: E402
from tessera.parallel.loss import linear_cross_entropy_sum  # noqa: E402


def make_inputs(tokens: int, dim: int, vocab: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, dim, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, dim, device=device, generator=gen) * dim**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    targets[::7] = -100  # some ignored positions, as masked data has
    return h, w, targets


def one_pass(backend: str, h, w, targets) -> tuple[float, torch.Tensor, torch.Tensor]:
    set_default_backend(backend)
    h.grad = w.grad = None
    total, count = linear_cross_entropy_sum(h, w, targets)
    (total / count).backward()
    return total.item(), h.grad, w.grad


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def float64_check(h, w, targets, backends) -> dict:
    """Each path against log_softmax in float64 on the same (sliced) inputs: relative max errors."""
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    valid = targets != -100
    logp = torch.log_softmax(h64 @ w64.t(), dim=-1)
    loss = -logp[valid].gather(-1, targets[valid].unsqueeze(-1)).sum()
    (loss / valid.sum()).backward()
    out = {}
    for backend in backends:
        hb, wb = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        total, dh, dw = one_pass(backend, hb, wb, targets)
        out[backend] = {
            "loss_rel_error": abs(total - loss.item()) / abs(loss.item()),
            "dh_rel_error": relative(dh, h64.grad),
            "dw_rel_error": relative(dw, w64.grad),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="a .json file or a directory")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; use --device cpu (with TRITON_INTERPRET=1) to check the plumbing")
    dtype = torch.bfloat16
    backends = ("torch", "triton")
    h, w, targets = make_inputs(args.tokens, args.dim, args.vocab, device, dtype)
    runs: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(args.repeats):  # alternating, so drift hits both alike
        for backend in backends:
            runs[backend] += timed(lambda b=backend: one_pass(b, h, w, targets), 1, 1, device)
    results_by_path = {}
    for backend in backends:
        total, dh, dw = one_pass(backend, h, w, targets)
        results_by_path[backend] = {
            "median_s": statistics.median(runs[backend]),
            "min_s": min(runs[backend]),
            "loss": total,
            "dh": dh.clone(),
            "dw": dw.clone(),
        }
    ref, fused = results_by_path["torch"], results_by_path["triton"]
    agreement = {
        "loss_rel_diff": abs(fused["loss"] - ref["loss"]) / abs(ref["loss"]),
        "dh_rel_diff": relative(fused["dh"], ref["dh"]),
        "dw_rel_diff": relative(fused["dw"], ref["dw"]),
    }
    rows = min(512, args.tokens)
    exact = float64_check(h[:rows], w, targets[:rows], backends)
    set_default_backend(None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "paths": {b: {k: v for k, v in results_by_path[b].items() if k not in ("dh", "dw")} for b in backends},
        "triton_over_torch_time": fused["median_s"] / ref["median_s"],
        "agreement_at_this_size": agreement,
        "float64_check_rows": rows,
        "float64_check": exact,
        "timing": f"median and min of {args.repeats} timed passes per path, alternating, after one warm-up each",
    }
    print(
        f"chunked loss fwd+bwd, {args.tokens} x {args.dim} x {args.vocab} bf16 on {name}: "
        f"torch {ref['median_s'] * 1e3:.1f} ms, triton {fused['median_s'] * 1e3:.1f} ms "
        f"({results['triton_over_torch_time']:.3f}x); loss/dh/dw differ by {agreement['loss_rel_diff']:.1e} / "
        f"{agreement['dh_rel_diff']:.1e} / {agreement['dw_rel_diff']:.1e}; float64 errors {exact}"
    )
    config = {"tokens": args.tokens, "dim": args.dim, "vocab": args.vocab, "repeats": args.repeats}
    write_results(f"loss-kernels-{device_slug(name)}", config, results, args.out)
    return results


if __name__ == "__main__":
    main()
