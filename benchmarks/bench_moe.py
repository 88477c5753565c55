"""Mixture of experts: expert parallel's training step on CPU ranks, and grouped GEMMs against a per-expert loop.

(a) ep: one Qwen3-MoE model (a Qwen3MoeConfig built here: qwen3-moe-debug's attention with more and wider
    experts, so the experts carry most of the FLOPs and parameters) trained through tessera's own job on
    --ranks CPU ranks (gloo, one thread each), dp --ranks with --ep 1 (the experts FSDP-sharded over the dp
    ranks like every other weight) against --ep 2 and --ep 4 (each rank holds experts / ep of them and
    all-to-alls its tokens to them). The layouts run interleaved, --repeats rounds of one run each, the order
    rotated every round, so machine noise hits them alike. Per layout: the median step time over the steps
    after --warmup of every round, and its ratio to ep 1 (> 1: slower than ep 1); the first round also counts
    the bytes rank 0 sent in step 1 (the Trainer's comm record, tessera train --comm-stats first): by axis
    and collective, the ep all-to-alls (token dispatch and combine, forward and backward, and the split
    exchanges) among them. Every layout trains the same model on the same batches: the losses are compared.

(b) gemm: one MoE block's experts (models/moe.py GroupedExperts.run_local: SwiGLU as three grouped products)
    on tokens routed by a random router, forward and forward + backward, the two ways the block can run:
    torch._grouped_mm (one kernel for every expert; the model picks it where grouped_mm_supported says so:
    CUDA sm90+, bf16) and the per-expert loop (one matmul per expert with tokens). On CPU, at the ep model's
    expert shapes in fp32, against a naive token-by-token reference too (each routed row times its expert's
    matrices, one row at a time); torch._grouped_mm's CPU path is tried there as well and whatever it does
    is recorded (times, or the error). On a GPU (torch.cuda.is_available()), in bf16 at Qwen3-30B-A3B's
    expert shapes (128 experts, dim 2048, ffn 768, top-8 routing of 4096 tokens): grouped against the loop,
    TFLOP/s and the ratio (benchmarks/gpu_suite.py runs this part as its "moe" row).

    python benchmarks/bench_moe.py            # benchmarks/results/moe_cpu.json (about 2 min on 2 cores)
    python benchmarks/bench_moe.py --quick    # tiny sizes, 2 ranks, one round: the plumbing (moe_cpu_quick.json)

JSON (results): "model" (the config, its parameter and FLOP shares), "ep" {"rows": one per ep: step_time_s,
step_times_s, per_round_median_s, ratio_to_ep1, ratio_to_ep1_per_round, comm_bytes_step1_rank0 (by_axis,
by_collective, all_to_all_bytes), final_loss, max_loss_diff_vs_ep1, expert_load (the last step's record
entry)}, "gemm" {"cpu": ..., "cuda": ... (GPU only)}: each with shapes, counts, rows per implementation
(forward_s, forward_backward_s, TFLOP/s, or error), ratios and max differences; "grouped_mm_probe" (what
torch._grouped_mm's backward does here with a contiguous and an expanded gradient).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_slug, write_results  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from tessera.models.llama import BYTE_VOCAB  # noqa: E402
from tessera.models.moe import GroupedExperts, grouped_mm_supported, route  # noqa: E402
from tessera.models.qwen3_moe import Qwen3MoeConfig, hf_config_dict  # noqa: E402

# (a): qwen3-moe-debug's attention (dim 64 -> 128 to keep head_dim 32 x 4 heads) with 16 experts of ffn 256
EP_MODEL = dict(
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    vocab_size=BYTE_VOCAB,
    moe_ffn_dim=256,
    n_experts=16,
    top_k=2,
    max_seq_len=2048,
)
QUICK_MODEL = dict(EP_MODEL, dim=64, moe_ffn_dim=32, n_experts=8)  # qwen3-moe-debug's shapes
# (b) on a GPU: Qwen3-30B-A3B's experts (config.json of Qwen/Qwen3-30B-A3B), a 4096-token batch
GPU_GEMM = dict(n_experts=128, dim=2048, ffn=768, tokens=4096, top_k=8)


# ----------------------------------------------------------------------------- (a) expert parallel
def model_figures(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    """The model's parameter count and the experts' shares of the parameters and of the matmul FLOPs per
    token (active experts: top_k of them), from its shapes."""
    from tessera.models.qwen3_moe import model_shape

    shape = model_shape(cfg)
    attention = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    experts_active = cfg.top_k * 3 * cfg.dim * cfg.moe_ffn_dim
    per_token = cfg.n_layers * (attention + experts_active + cfg.dim * cfg.n_experts) + cfg.dim * cfg.vocab_size
    params = shape.num_params()
    expert_params = cfg.n_layers * cfg.n_experts * 3 * cfg.dim * cfg.moe_ffn_dim
    return {
        "config": cfg.as_dict(),
        "params": params,
        "expert_params": expert_params,
        "expert_param_share": expert_params / params,
        "expert_matmul_flop_share": cfg.n_layers * experts_active / per_token,
    }


def ep_config(model_dir: str, ranks: int, ep: int, args: argparse.Namespace, count: bool):
    from tessera.config import Config

    config = Config.create(
        model=f"hf:{model_dir}",
        dp=ranks,
        ep=ep,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        steps=args.warmup + args.steps,
        quiet=True,
        device="cpu",
        mixed_precision="fp32",
        comm_stats="first" if count else None,
    )
    config.check()
    return config


def bench_ep(cfg: Qwen3MoeConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Each ep layout once per round, --repeats rounds, the order rotated each round; rank 0's records."""
    from tessera.training.run import train

    eps = [int(e) for e in args.eps.split(",")]
    if eps[0] != 1:
        raise ValueError(f"--eps {args.eps} must start with 1: the ratios are to ep 1")
    runs: dict[int, list[list[dict]]] = {ep: [] for ep in eps}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tessera-bench-moe-") as model_dir:
        # the ranks read the model from a Hugging Face config.json: the only way a config that is no preset
        # reaches tessera's own training job (--model hf:DIR); no weights, they are initialized as any preset's
        (Path(model_dir) / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
        for round_ in range(args.repeats):
            order = eps[round_ % len(eps) :] + eps[: round_ % len(eps)]
            for ep in order:
                history = train(ep_config(model_dir, args.ranks, ep, args, count=round_ == 0))
                runs[ep].append(history)
                timed = [m["step_time_s"] for m in history[args.warmup :]]
                print(
                    f"ep [round {round_ + 1}/{args.repeats}] dp{args.ranks} ep{ep}: median step "
                    f"{statistics.median(timed) * 1e3:.1f} ms over {len(timed)} steps, loss {history[-1]['loss']:.4f}",
                    flush=True,
                )
    base_losses = [m["loss"] for m in runs[1][0]]
    rows = []
    for ep in eps:
        timed = [[m["step_time_s"] for m in h[args.warmup :]] for h in runs[ep]]
        first = runs[ep][0][0]["comm"]
        by_collective = first["bytes_by_collective"]
        rows.append(
            {
                "ep": ep,
                "layout": f"dp{args.ranks}" + (f"xep{ep}" if ep > 1 else ""),
                "ranks": args.ranks,
                "step_time_s": statistics.median([t for ts in timed for t in ts]),
                "step_times_s": timed,
                "per_round_median_s": [statistics.median(ts) for ts in timed],
                "comm_bytes_step1_rank0": {
                    "by_axis": {a: b for a, b in first["bytes_by_axis"].items() if b},
                    "by_collective": by_collective,
                    "calls": first["calls"],
                    "all_to_all_bytes": by_collective.get("ep", {}).get("all_to_all", 0.0),
                    "total_bytes": sum(first["bytes_by_axis"].values()),
                },
                "final_loss": runs[ep][0][-1]["loss"],
                "max_loss_diff_vs_ep1": max(abs(m["loss"] - b) for m, b in zip(runs[ep][0], base_losses)),
                "expert_load": runs[ep][0][-1].get("moe"),
            }
        )
    base = rows[0]
    for r in rows:
        r["ratio_to_ep1"] = r["step_time_s"] / base["step_time_s"]
        # side by side within one round: the same minute of machine noise
        r["ratio_to_ep1_per_round"] = [m / b for m, b in zip(r["per_round_median_s"], base["per_round_median_s"])]
    return {
        "rows": rows,
        "seconds": time.perf_counter() - started,
        "timing": f"rank 0's step_time_s (a step ends on every rank alike: its loss and grad norm are reduced "
        f"over all ranks); median over the {args.steps} steps after --warmup {args.warmup} of each of "
        f"{args.repeats} rounds; ranks: 1 thread each, {args.ranks} of them on this machine's cores",
        "comm_counting": "step 1 of round 1 only (the counter slows the step it runs in; step 1 is a warm-up step); "
        "bytes rank 0 sent, by the counter's axis names (parallel/comm_stats.py): 'ep' holds the "
        "all-to-alls, 'dp_shard_cp' FSDP's traffic (the experts' FSDP over the edp ranks included "
        "where the counter names it so; a 'group[...]' name is a group it has no axis for)",
    }


# ----------------------------------------------------------------------------- (b) grouped GEMM vs loop
def routed_inputs(
    n_experts: int, dim: int, ffn: int, tokens: int, top_k: int, device: str, dtype: torch.dtype, seed: int = 0
) -> tuple[GroupedExperts, Tensor, Tensor, Tensor]:
    """Experts (std 0.02 weights), the routed rows sorted by expert (tokens x top_k, dim), the counts per
    expert and an upstream gradient; a random router (scaled to unit-variance logits) picks the experts."""
    gen = torch.Generator().manual_seed(seed)
    experts = GroupedExperts(n_experts, dim, ffn)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    experts = experts.to(device, dtype)
    x = torch.randn(tokens, dim, generator=gen)
    router = torch.randn(n_experts, dim, generator=gen) / dim**0.5
    _, ids, _ = route(x @ router.T, top_k)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=n_experts)
    rows = x[torch.argsort(flat, stable=True) // top_k]
    dout = torch.randn(rows.shape[0], dim, generator=gen)
    return experts, rows.to(device, dtype), counts.to(device), dout.to(device, dtype)


def token_by_token(experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
    """The naive reference: each routed row through its expert's SwiGLU alone."""
    which = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts).tolist()
    out = [
        (F.silu(x[i] @ experts.gate_proj[e].T) * (x[i] @ experts.up_proj[e].T)) @ experts.down_proj[e].T
        for i, e in enumerate(which)
    ]
    return torch.stack(out) if out else x[:0]


def _seconds(fn: Callable[[], Any], reps: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def grouped_vs_loop(
    n_experts: int,
    dim: int,
    ffn: int,
    tokens: int,
    top_k: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    reps: int = 5,
    warmup: int = 1,
    naive: bool = False,
) -> dict[str, Any]:
    """One block's experts forward and forward + backward: torch._grouped_mm, the per-expert loop and (with
    `naive`) the token-by-token reference. Each implementation's row has its median times and TFLOP/s, or the
    error it raised; outputs and gradients are compared with the loop's."""
    experts, x, counts, dout = routed_inputs(n_experts, dim, ffn, tokens, top_k, device, dtype)
    m = x.shape[0]
    flops = 2 * m * dim * ffn * 3  # three products per routed row, forward; backward twice that

    def run(impl: str, backward: bool) -> tuple[Tensor, list[Tensor]]:
        xx = x.detach().requires_grad_(backward)
        if impl == "token_by_token":
            y = token_by_token(experts, xx, counts)
        else:
            experts.use_grouped_mm = impl == "grouped_mm"
            y = experts.run_local(xx, counts)
        if not backward:
            return y, []
        grads = torch.autograd.grad(y, [xx, *experts.parameters()], dout)
        return y, list(grads)

    impls = ["grouped_mm", "loop"] + (["token_by_token"] if naive else [])
    rows: dict[str, dict[str, Any]] = {}
    reference = run("loop", True)
    for impl in impls:
        try:
            out = run(impl, True)
            fwd = _seconds(lambda impl=impl: run(impl, False), reps, warmup, device)
            fwd_bwd = _seconds(lambda impl=impl: run(impl, True), reps, warmup, device)
        except Exception as e:  # noqa: BLE001 - what this implementation does here is the measurement
            rows[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            continue
        scale = max(reference[0].abs().max().item(), 1e-30)
        rows[impl] = {
            "forward_s": fwd,
            "forward_backward_s": fwd_bwd,
            "forward_tflops": flops / fwd / 1e12,
            "forward_backward_tflops": 3 * flops / fwd_bwd / 1e12,
            "max_abs_diff_vs_loop": max(
                (a.float() - b.float()).abs().max().item()
                for a, b in zip([out[0], *out[1]], [reference[0], *reference[1]])
            ),
            "output_scale": scale,
        }
    result: dict[str, Any] = {
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "n_experts": n_experts,
        "dim": dim,
        "ffn": ffn,
        "tokens": tokens,
        "top_k": top_k,
        "routed_rows": m,
        "tokens_per_expert": counts.tolist(),
        "imbalance": counts.max().item() / max(counts.float().mean().item(), 1e-9),
        "grouped_mm_supported": grouped_mm_supported(x, experts.gate_proj),
        "forward_flops": flops,
        "reps": reps,
        "warmup": warmup,
        "rows": rows,
        "timing": "median of reps after warmup calls; forward runs with autograd recording, as in training; "
        "forward_backward adds the gradients of the rows and of the three weights",
    }
    loop = rows["loop"]
    for impl in impls:
        r = rows[impl]
        if impl != "loop" and "error" not in r and "error" not in loop:
            r["forward_vs_loop"] = r["forward_s"] / loop["forward_s"]  # > 1: slower than the loop
            r["forward_backward_vs_loop"] = r["forward_backward_s"] / loop["forward_backward_s"]
    return result


def grouped_mm_probe(device: str, dtype: torch.dtype) -> dict[str, str]:
    """What torch._grouped_mm does on this device: forward, backward with a contiguous gradient (what the
    experts' backward passes it) and with an expanded one (y.sum().backward(): stride 0)."""
    out: dict[str, str] = {}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(2, 16, 16, generator=gen).to(device, dtype).requires_grad_()
    offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
    for what, grad in (("forward", None), ("backward_contiguous_grad", "randn"), ("backward_expanded_grad", "sum")):
        try:
            y = torch._grouped_mm(x, w, offs=offs)
            if grad == "randn":
                y.backward(torch.randn_like(y))
            elif grad == "sum":
                y.sum().backward()
            out[what] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded
            out[what] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return out


# ----------------------------------------------------------------------------- main
def _say_gemm(name: str, r: dict[str, Any]) -> None:
    parts = []
    for impl, row in r["rows"].items():
        if "error" in row:
            parts.append(f"{impl}: {row['error'][:120]}")
        else:
            parts.append(
                f"{impl} {row['forward_s'] * 1e3:.2f} / {row['forward_backward_s'] * 1e3:.2f} ms"
                + (f" ({row['forward_backward_vs_loop']:.2f}x the loop)" if "forward_backward_vs_loop" in row else "")
            )
    print(
        f"gemm [{name}] {r['n_experts']} experts, dim {r['dim']}, ffn {r['ffn']}, {r['routed_rows']} rows, "
        f"{r['dtype']} (forward / forward+backward): " + "; ".join(parts),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 ranks, one round (the plumbing, about 30 s)")
    p.add_argument(
        "--ranks", type=int, default=None, help="CPU ranks of the ep runs, all data parallel (default 4; --quick 2)"
    )
    p.add_argument("--eps", default=None, help="comma-separated ep degrees, 1 first (default 1,2,4; --quick 1,2)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds of the ep runs (default 3; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 8; --quick 1)")
    p.add_argument(
        "--warmup", type=int, default=2, help="steps per run left out of the medians (step 1 counts the bytes)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="default 128; --quick 32")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 8; --quick 2)")
    p.add_argument(
        "--gemm-reps", type=int, default=None, help="timed calls per gemm measurement (default 5; --quick 1)"
    )
    p.add_argument("--threads", type=int, default=1, help="threads of the CPU gemm part (default 1: one rank's)")
    p.add_argument("--skip-ep", action="store_true", help="only the gemm part")
    p.add_argument("--out", default=None, help="a .json file or a directory (default benchmarks/results/)")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (
        ("ranks", 4, 2),
        ("eps", "1,2,4", "1,2"),
        ("repeats", 3, 1),
        ("steps", 8, 1),
        ("seq_len", 128, 32),
        ("global_batch", 8, 2),
        ("gemm_reps", 5, 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    torch.set_num_threads(args.threads)
    cfg = Qwen3MoeConfig(**(QUICK_MODEL if quick else EP_MODEL))
    started = time.perf_counter()
    results: dict[str, Any] = {"model": model_figures(cfg)}
    print(
        f"model: {cfg.n_experts} experts of ffn {cfg.moe_ffn_dim}, top {cfg.top_k}, dim {cfg.dim}, "
        f"{cfg.n_layers} layers: "
        f"{results['model']['params'] / 1e6:.2f} M parameters, experts {results['model']['expert_param_share']:.0%} "
        f"of them and {results['model']['expert_matmul_flop_share']:.0%} of the matmul FLOPs per token",
        flush=True,
    )
    if not args.skip_ep:
        results["ep"] = bench_ep(cfg, args)
        print(
            "ep: "
            + ", ".join(
                f"{r['layout']} {r['step_time_s'] * 1e3:.1f} ms ({r['ratio_to_ep1']:.2f}x ep1, all-to-all "
                f"{r['comm_bytes_step1_rank0']['all_to_all_bytes'] / 1e3:.0f} kB)"
                for r in results["ep"]["rows"]
            ),
            flush=True,
        )
    gemm_tokens = args.seq_len * args.global_batch  # one step's tokens at the ep model's expert shapes
    cpu = grouped_vs_loop(
        cfg.n_experts,
        cfg.dim,
        cfg.moe_ffn_dim,
        gemm_tokens,
        cfg.top_k,
        "cpu",
        torch.float32,
        reps=args.gemm_reps,
        warmup=1,
        naive=True,
    )
    cpu["threads"] = args.threads
    naive, loop = cpu["rows"]["token_by_token"], cpu["rows"]["loop"]
    if "error" not in naive:  # the loop's speedup over one row at a time
        cpu["loop_speedup_over_token_by_token"] = {
            "forward": naive["forward_s"] / loop["forward_s"],
            "forward_backward": naive["forward_backward_s"] / loop["forward_backward_s"],
        }
    results["gemm"] = {"cpu": cpu}
    results["grouped_mm_probe"] = {"cpu_float32": grouped_mm_probe("cpu", torch.float32)}
    _say_gemm("cpu", cpu)
    if torch.cuda.is_available():
        sizes = dict(GPU_GEMM, tokens=512) if quick else GPU_GEMM
        gpu = grouped_vs_loop(
            **sizes, device="cuda", dtype=torch.bfloat16, reps=max(args.gemm_reps, 3 if quick else 20), warmup=5
        )
        results["gemm"]["cuda"] = gpu
        results["grouped_mm_probe"]["cuda_bfloat16"] = grouped_mm_probe("cuda", torch.bfloat16)
        _say_gemm("cuda", gpu)
    results["seconds"] = time.perf_counter() - started

    device = "cpu" if not torch.cuda.is_available() else device_slug(torch.cuda.get_device_name(0))
    path = write_results(f"moe_{device}" + ("_quick" if quick else ""), dict(vars(args)), results, args.out)
    print(f"wrote {path} ({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
