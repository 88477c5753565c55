"""Checkpoint save: how long training waits, synchronous against --checkpoint-async, side by side.

A Llama-shaped model of a few hundred MB of state (parameters and AdamW's two moments, fp32) trains one step
on 2 CPU ranks (dp2, FSDP2), then saves it again and again, alternating the two modes: a synchronous save
blocks for the whole write (DCP save, checksums, manifest, rename); an async one blocks only while DCP
stages the state into host memory and plans the write, and the files follow in a background thread. Each
round records the blocked time and, for async, the time until the checkpoint is complete (`finish`).

    python benchmarks/bench_checkpoint.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

import torch  # noqa: E402

from tessera.models.llama import LlamaConfig, hf_config_dict  # noqa: E402
from tessera.launching.launch import run_ranks  # noqa: E402


def model(quick: bool) -> LlamaConfig:
    # 35.4M parameters: 142 MB of fp32 weights, 425 MB with AdamW's moments (quick: 4.3M, 52 MB)
    if quick:
        return LlamaConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=4096, ffn_dim=768, max_seq_len=256)
    return LlamaConfig(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=16000, ffn_dim=1536, max_seq_len=256)


def _saves(model_dir: str, out: str, rounds: int) -> dict | None:
    import torch.distributed as dist

    from tessera.config import Config
    from tessera.checkpointing.checkpoint import CheckpointManager
    from tessera.trainer import Trainer

    config = Config.create(
        model=f"hf:{model_dir}",
        dp=2,
        seq_len=64,
        global_batch=4,
        steps=2,
        checkpoint_dir=out,
        checkpoint_every=1,
        quiet=True,
    )
    trainer = Trainer(config, torch.device("cpu"))
    trainer.train_step()  # the optimizer's moments exist from here
    sharded, small = trainer.checkpoint_pieces()
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(sharded))
    manager = CheckpointManager(out, keep=1)
    rows = []
    for r in range(rounds):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):  # interleaved, alternating first
            dist.barrier()
            started = time.perf_counter()
            manager.save(trainer.step, sharded, small, trainer.checkpoint_info(), asynchronous=mode == "async")
            blocked = time.perf_counter() - started
            manager.finish()
            rows.append({"round": r, "mode": mode, "blocked_s": blocked, "complete_s": time.perf_counter() - started})
    total = torch.tensor([float(state_bytes)])
    dist.all_reduce(total)
    return {"rows": rows, "state_bytes_all_ranks": int(total.item())} if dist.get_rank() == 0 else None


def _tensors(state):
    from torch.distributed.tensor import DTensor

    if isinstance(state, torch.Tensor):
        yield state.to_local() if isinstance(state, DTensor) else state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)
    elif hasattr(state, "state_dict"):
        yield from _tensors(state.state_dict())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a 4M-parameter model and 1 round (a smoke test)")
    p.add_argument("--out", default=None, help="results file or directory (default benchmarks/results/)")
    args = p.parse_args(argv)
    cfg = model(args.quick)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model").mkdir()
        (Path(d) / "model" / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
        result = run_ranks(_saves, 2, str(Path(d) / "model"), str(Path(d) / "ckpt"), rounds, timeout=1200)[0]
    by_mode = {m: [r for r in result["rows"] if r["mode"] == m] for m in ("sync", "async")}
    summary = {
        m: {
            "blocked_s_median": statistics.median(r["blocked_s"] for r in rows),
            "complete_s_median": statistics.median(r["complete_s"] for r in rows),
        }
        for m, rows in by_mode.items()
    }
    summary["blocked_ratio_async_to_sync"] = summary["async"]["blocked_s_median"] / summary["sync"]["blocked_s_median"]
    path = write_results(
        "checkpoint_async_cpu" + ("_quick" if args.quick else ""),
        {
            "model": vars(cfg) if hasattr(cfg, "__dict__") else cfg.as_dict(),
            "params": cfg.num_params(),
            "ranks": 2,
            "layout": "dp2 (FSDP2)",
            "rounds": rounds,
            "state_bytes_all_ranks": result["state_bytes_all_ranks"],
        },
        {"summary": summary, "rows": result["rows"]},
        args.out,
    )
    print(
        f"state {result['state_bytes_all_ranks'] / 1e6:.0f} MB over 2 ranks: training waits "
        f"{summary['sync']['blocked_s_median']:.2f} s for a synchronous save, "
        f"{summary['async']['blocked_s_median']:.2f} s for an async one "
        f"({summary['blocked_ratio_async_to_sync']:.2f}x; "
        f"complete after {summary['async']['complete_s_median']:.2f} s) -> {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
