"""Packed documents through the job as users run it: the README's command, token files packed alike on one
process and on dp2 x cp2 (the same losses, grad norms and document counts), and what the records say
measured against the batch itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from helpers import cli_here, script_here, small_config
from tessera.data.tokens import TokenFileStream, write_shard

ROOT = Path(__file__).resolve().parents[1]
SEPARATOR = 1


def _readme_command() -> list[str]:
    section = (ROOT / "docs" / "context-parallel.md").read_text().split("## Packed documents", 1)[1]
    return re.search(r"```bash\n(tessera train [^\n]*)\n```", section).group(1).split()[1:]


def test_the_readme_packing_command_trains_and_reports_its_documents(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = cli_here(*_readme_command(), "--metrics", str(metrics), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(packed documents, each attending only to itself)" in out.stdout
    steps = [ln for ln in out.stdout.splitlines() if ln.startswith("step")]
    assert steps and all(re.search(r"\| \d+ docs, mean \d+ tokens", ln) for ln in steps), out.stdout
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("type") != "header"]
    for r in records:
        d = r["documents"]
        assert d["documents"] >= 8 and d["targets_left_out"] >= 1  # every row starts one; paragraphs end in it


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory):
    """Documents of 1 to 40 tokens (ids 2..99), each ended by the separator."""
    rng = np.random.default_rng(0)
    ids = []
    while len(ids) < 3000:
        ids += rng.integers(2, 100, rng.integers(1, 41)).tolist() + [SEPARATOR]
    return write_shard(tmp_path_factory.mktemp("packed") / "docs", ids, vocab_size=100, separator=SEPARATOR)


def _history(**kw):
    from tessera.training.run import train

    return train(small_config(vocab_size=100, seq_len=32, global_batch=4, steps=3, **kw))


def test_packed_token_files_train_equally_on_dp2xcp2_and_one_process(packed_data):
    one = _history(data=str(packed_data), pack_documents=True)
    spread = _history(data=str(packed_data), pack_documents=True, dp=2, cp=2)
    unpacked = _history(data=str(packed_data))
    stream = TokenFileStream(packed_data, 32, 4)
    for step, (a, b) in enumerate(zip(one, spread)):
        assert (
            abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"]
            and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
        )
        inputs, _ = stream.global_batch_at(step * 4)  # what the records report, counted from the batch itself
        separators = int((inputs == SEPARATOR).sum())
        starts = int(((inputs[:, :-1] == SEPARATOR).sum())) + inputs.shape[0]
        assert (
            a["documents"]
            == b["documents"]
            == {"documents": starts, "mean_length": 128 / starts, "targets_left_out": separators}
        )
    assert abs(one[0]["loss"] - unpacked[0]["loss"]) > 1e-4  # the mask changes what the model computes


def test_the_documents_benchmark_smoke_run_writes_its_figures(tmp_path):
    """benchmarks/bench_documents.py --quick: its JSON holds every part, and the ratios are the times' ratios
    (figures are never asserted)."""
    out = script_here("bench_documents", "--quick", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "documents-cpu.json").read_text())
    rows = record["results"]
    assert {r["part"] for r in rows} == {"attention", "model_step", "ring"}
    for r in rows:
        if r["part"] == "ring":
            assert r["speedup"] == pytest.approx(r["t_rank_causal_s"] / r["t_rank_documents_s"])
            assert 0 <= r["ring_steps_skipped"] <= r["ring_steps"] == r["cp"] ** 2
        else:
            assert r["speedup"] == pytest.approx(r["t_causal_s"] / r["t_documents_s"])


def test_shards_that_disagree_on_the_separator_are_refused(tmp_path):
    write_shard(tmp_path / "a", [2, 3, 1] * 20, vocab_size=10, separator=1)
    write_shard(tmp_path / "b", [2, 3, 4] * 20, vocab_size=10, separator=4)
    with pytest.raises(ValueError, match=r"its shards disagree on the separator token \(\[1, 4\]\)"):
        TokenFileStream(tmp_path, 8, 2)
