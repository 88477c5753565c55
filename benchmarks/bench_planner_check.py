"""The planner's one-device step time against the real step, side by side in one run.

For each model size and batch: build tessera's Trainer in this process (one rank, the device's compute
dtype), warm it up, then repeat ROUNDS times, back to back: calibrate this device at the model's shapes
(tessera.commands.calibrate.measure, what `tessera plan --calibrate --quick` measures), predict the step with the
planner (topology/estimators/planner.py estimate with that calibration: step_time.py), and time STEPS real
training steps. Reported per configuration: the medians of the predicted and the measured step and of
their per-round ratio (measured / predicted), with the predicted components. Calibrating in every round,
next to the steps it predicts, keeps both under the same machine load (a shared CPU drifts by 2x within
minutes); the medians are what to read.

    python benchmarks/bench_planner_check.py                      # CPU: writes results/planner_check_cpu.json
    python benchmarks/bench_planner_check.py --device cuda --configs 1b:4:2048:1,1b:4:2048:2   # a GPU
    python benchmarks/bench_planner_check.py --smoke              # seconds: the plumbing only

A configuration is PRESET:LAYERS:SEQ:BATCH; the presets include two made here for the check, check-512 and
check-768 (dim 512 / 768, 8 / 12 heads over 4 kv heads, ffn 3 x dim, the byte vocabulary).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from tessera.models import PRESETS, LlamaConfig  # noqa: E402
from tessera.models.llama import BYTE_VOCAB  # noqa: E402

EXTRA_PRESETS = {
    "check-512": LlamaConfig(
        dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=BYTE_VOCAB, ffn_dim=1536, max_seq_len=4096
    ),
    "check-768": LlamaConfig(
        dim=768, n_layers=4, n_heads=12, n_kv_heads=4, vocab_size=BYTE_VOCAB, ffn_dim=2304, max_seq_len=4096
    ),
}
DEFAULT_CONFIGS = "debug:2:64:8,small:4:128:4,small:4:128:16,small:8:256:8,check-512:4:128:8,check-768:4:128:8"


def parse_configs(text: str) -> list[tuple[str, int, int, int]]:
    out = []
    for item in text.split(","):
        try:
            name, layers, seq, batch = item.split(":")
            out.append((name, int(layers), int(seq), int(batch)))
        except ValueError:
            raise SystemExit(
                f"bench_planner_check: --configs item {item!r} is not PRESET:LAYERS:SEQ:BATCH (e.g. small:4:128:8)"
            )
    return out


def check_one(
    name: str,
    layers: int,
    seq: int,
    batch: int,
    device: torch.device,
    rounds: int,
    steps: int,
    warmup: int,
    mixed_precision: str | None,
) -> dict:
    from tessera.training.estimate import planner_estimate
    from tessera.commands.calibrate import measure
    from tessera.config import Config
    from tessera.topology.estimators.step_time import Calibration
    from tessera.trainer import Trainer

    config = Config.create(
        model=name,
        n_layers=layers,
        seq_len=seq,
        global_batch=batch,
        steps=10**6,
        quiet=True,
        device=device.type,
        mixed_precision=mixed_precision,
    )
    config.check()
    trainer = Trainer(config, device)
    records = [trainer.train_step().record() for _ in range(warmup)]
    per_round = []
    for _ in range(rounds):
        entry = measure(config.model_config, seq, batch, device, config.mixed_precision, quick=True)
        est = planner_estimate(config, Calibration.from_entry(entry))
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            records.append(trainer.train_step().record())
            times.append(time.perf_counter() - started)
        measured = statistics.median(times)
        per_round.append(
            {
                "predicted_s": est.time["step"],
                "measured_s": measured,
                "ratio": measured / est.time["step"],
                "parts_s": est.compute_parts,
                "calibration": {
                    k: entry[k]
                    for k in ("matmul_flops_per_s", "attention_flops_per_s", "memory_bytes_per_s", "op_overhead_s")
                },
            }
        )
    med = lambda key: statistics.median(r[key] for r in per_round)  # noqa: E731
    parts = {k: statistics.median(r["parts_s"][k] for r in per_round) for k in per_round[0]["parts_s"]}
    cfg = config.model_config
    return {
        "config": f"{name}:{layers}:{seq}:{batch}",
        "model": name,
        "n_layers": layers,
        "dim": cfg.dim,
        "ffn_dim": cfg.ffn_dim,
        "params": cfg.num_params(),
        "seq_len": seq,
        "global_batch": batch,
        "tokens": seq * batch,
        "compute_dtype": next((r.get("compute_dtype") for r in records if r.get("compute_dtype")), None),
        "predicted_step_s": med("predicted_s"),
        "measured_step_s": med("measured_s"),
        "ratio": med("ratio"),
        "ratios": [r["ratio"] for r in per_round],
        "predicted_parts_s": parts,
        "rounds": per_round,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="PRESET:LAYERS:SEQ:BATCH,... (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="calibrate-predict-measure rounds per configuration")
    p.add_argument("--steps", type=int, default=3, help="training steps timed per round")
    p.add_argument("--warmup", type=int, default=2, help="steps before the first round")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: one tessera rank's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--mixed-precision", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument("--smoke", action="store_true", help="one tiny configuration, one round: checks the plumbing")
    p.add_argument("--out", default=None, help="a .json file or a directory (default benchmarks/results/)")
    args = p.parse_args(argv)
    if args.smoke:
        args.configs, args.rounds, args.steps, args.warmup = "debug:1:32:2", 1, 1, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_planner_check: needs a CUDA GPU for --device cuda: torch sees none here", file=sys.stderr)
        return 2
    PRESETS.update(EXTRA_PRESETS)  # this process only: Config.create finds them by name
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(tempfile.mktemp(prefix="tessera-check-"), 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    rows = []
    try:
        for name, layers, seq, batch in parse_configs(args.configs):
            row = check_one(
                name, layers, seq, batch, device, args.rounds, args.steps, args.warmup, args.mixed_precision
            )
            rows.append(row)
            parts = ", ".join(
                f"{k} {v * 1e3:.1f}"
                for k, v in row["predicted_parts_s"].items()
                if k in ("matmul", "attention", "memory", "host")
            )
            print(
                f"{row['config']:<22} measured {row['measured_step_s'] * 1e3:8.1f} ms  predicted "
                f"{row['predicted_step_s'] * 1e3:8.1f} ms ({parts} ms)  measured / predicted {row['ratio']:.3f} "
                f"(rounds {', '.join(f'{r:.2f}' for r in row['ratios'])})",
                flush=True,
            )
    finally:
        dist.destroy_process_group()
    within = [r["config"] for r in rows if abs(r["ratio"] - 1) <= 0.15]
    summary = {
        "within_15_percent": within,
        "max_abs_error": max(abs(r["ratio"] - 1) for r in rows),
        "method": "per round: calibrate (quick) at the model's shapes, predict, time the steps; medians over rounds",
    }
    name = "planner_check_smoke" if args.smoke else f"planner_check_{device.type}"
    path = write_results(name, {k: v for k, v in vars(args).items()}, {"rows": rows, "summary": summary}, args.out)
    print(f"{len(within)} of {len(rows)} configurations within 15%; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
