"""--data hf:PATH against the shipped text: what streaming and tokenizing on the fly costs a training step, on
the small preset at dp2 (CPU ranks over gloo).

A JSONL data set of the shipped text's paragraphs (repeated to --records records) is read through the
datasets library and tokenized with a byte-level BPE tokenizer trained here on the same text (--vocab
tokens; the model gets that vocabulary, and so does the shipped-text run it is compared with). Each rank
times its data work of every step (StepData.next_step: reading the next global batch, tokenizing the records
it needs, packing, cutting this rank's rows); a step's data time and its whole time are the slowest rank's.
The figure is the data time's median over the step time's median.

    python benchmarks/bench_hf_data.py          # benchmarks/results/hf-data-small-dp2-cpu.json
    python benchmarks/bench_hf_data.py --model debug --steps 2 --warmup 1 --out /tmp   # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from tessera.config import Config  # noqa: E402
from tessera.launching.launch import run_ranks  # noqa: E402
from tessera.trainer import Trainer  # noqa: E402


def make_data(folder: Path, records: int, vocab: int) -> tuple[str, str]:
    """(hf:JSONL, tokenizer.json) of the shipped text's paragraphs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = resources.files("tessera.models").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        paragraphs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"], initial_alphabet=alphabet)
    )
    tok.save(str(folder / "tokenizer.json"))
    with open(folder / "data.jsonl", "w") as f:
        for i in range(records):
            f.write(json.dumps({"text": paragraphs[i % len(paragraphs)]}) + "\n")
    return f"hf:{folder / 'data.jsonl'}", str(folder / "tokenizer.json")


def rank_run(kw: dict[str, Any], warmup: int) -> dict[str, Any] | None:
    """Per-step data and whole-step seconds (the slowest rank's); rank 0 returns their medians."""
    torch.set_num_threads(1)
    trainer = Trainer(Config.create(**kw, quiet=True, device="cpu"), torch.device("cpu"))
    inner = trainer.batches.next_step
    data_s: list[float] = []

    def timed_next_step(data: Any) -> Any:
        started = time.perf_counter()
        out = inner(data)
        data_s.append(time.perf_counter() - started)
        return out

    trainer.batches.next_step = timed_next_step  # type: ignore[method-assign]
    records = [trainer.train_step().record() for _ in range(trainer.config.runtime.steps)]
    times = torch.tensor([data_s, [r["step_time_s"] for r in records]], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if trainer.rank != 0:
        return None
    data, step = times[0].tolist()[warmup:], times[1].tolist()[warmup:]
    return {
        "data_s": statistics.median(data),
        "step_s": statistics.median(step),
        "data_fraction_of_step": statistics.median(data) / statistics.median(step),
        "data_times_s": data,
        "step_times_s": step,
        "final_loss": records[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="timed steps after --warmup")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--records", type=int, default=20_000, help="records of the JSONL data set")
    p.add_argument("--vocab", type=int, default=4096, help="the BPE tokenizer's vocabulary (and the model's)")
    p.add_argument("--out", default=None, help="a .json file or a directory (default benchmarks/results/)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data, tokenizer = make_data(Path(tmp), args.records, args.vocab)
        common = dict(
            model=args.model,
            dp=args.dp,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            steps=args.warmup + args.steps,
            vocab_size=args.vocab,
            mixed_precision="fp32",
        )
        for name, extra in (("shipped text", {}), ("hf: streamed", dict(data=data, tokenizer=tokenizer))):
            kw = dict(common, **extra)
            world = Config.create(**kw, quiet=True).layout.world_size
            r = run_ranks(rank_run, world, kw, args.warmup, timeout=600)[0]
            rows.append({"data": name, "ranks": world, **r})
            print(
                f"{name:>13}: data {r['data_s'] * 1e3:7.2f} ms of a {r['step_s'] * 1e3:7.1f} ms step "
                f"({100 * r['data_fraction_of_step']:.2f}%)",
                flush=True,
            )
    timing = (
        f"median over {args.steps} steps after {args.warmup} warm-up; a step's (and its data work's) time is the "
        f"slowest rank's; 1 thread per rank on {torch.get_num_threads()} visible cores"
    )
    name = f"hf-data-{args.model}-dp{args.dp}-cpu"
    path = write_results(name, vars(args), {"rows": rows, "timing": timing}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
