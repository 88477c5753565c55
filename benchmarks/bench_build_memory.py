"""Host memory of building a big preset on CPU ranks: the meta-device build keeps each rank's peak
below the size of one full parameter it only holds a slice of.

Builds `--model` with `--n-layers` blocks on a tp x dp layout through the Trainer (meta build,
parallelize, materialize the local shards, initialize from the seeded tiles) and reports each rank's
peak RSS before and after, beside the bytes of the full embedding (the largest parameter).

    python benchmarks/bench_build_memory.py --model 8b --n-layers 1 --tp 2 --dp 2
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402


def build_and_measure(config):
    import torch
    from torch.distributed.tensor import DTensor

    from tessera.trainer import Trainer

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer = Trainer(config, torch.device("cpu"))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in trainer.parameters())
    return {
        "rank": trainer.rank,
        "peak_rss_before_build": before,
        "peak_rss_after_build": after,
        "local_parameter_bytes": local,
    }


def main(argv=None) -> int:
    from tessera.config import Config
    from tessera.launching.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b")
    p.add_argument("--n-layers", type=int, default=1)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    config = Config.create(
        model=args.model, n_layers=args.n_layers, tp=args.tp, dp=args.dp, seq_len=128, global_batch=args.dp, quiet=True
    )
    config.check()
    mc = config.model_config
    embedding = mc.vocab_size * mc.dim * 4
    ranks = run_ranks(build_and_measure, config.layout.world_size, config, timeout=900)
    for r in ranks:
        print(
            f"rank {r['rank']}: peak RSS {r['peak_rss_before_build'] / 2**30:.2f} GiB before the build, "
            f"{r['peak_rss_after_build'] / 2**30:.2f} GiB after; "
            f"local parameters {r['local_parameter_bytes'] / 2**30:.2f} GiB"
        )
    worst = max(r["peak_rss_after_build"] for r in ranks)
    print(
        f"full embedding: {embedding / 1e9:.2f} GB; worst rank's peak RSS: {worst / 1e9:.2f} GB "
        f"({worst / embedding:.2f}x the embedding)"
    )
    path = write_results(
        f"build-memory-{args.model}-L{args.n_layers}-tp{args.tp}-dp{args.dp}-cpu",
        vars(args),
        {"ranks": ranks, "full_embedding_bytes": embedding, "worst_peak_rss": worst, "num_params": mc.num_params()},
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
