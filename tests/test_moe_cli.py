"""The README's mixture-of-experts command, as a user runs it, and the CLI's refusals of expert-parallel
flags that cannot work (one line each, before any rank starts)."""

import json
import re
from pathlib import Path

import pytest

from helpers import cli_here

ROOT = Path(__file__).resolve().parents[1]


def _readme_moe_command() -> list[str]:
    section = (ROOT / "docs" / "moe.md").read_text().split("# Mixture of experts and expert parallelism", 1)[1]
    line = re.search(r"```bash\n(tessera train [^\n]*)\n```", section).group(1)
    return line.split()[1:]


def test_the_readme_moe_command_trains_and_shows_the_load(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = cli_here(*_readme_moe_command(), "--metrics", str(metrics), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("step")]
    assert len(lines) == 4 and all(re.search(r"moe aux \d\.\d\de-0\d imbalance \d+\.\d\d", ln) for ln in lines), (
        out.stdout
    )
    assert "tp2 x ep2" in lines[0]
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("type") != "header"]
    assert len(records) == 4
    for r in records:
        moe = r["moe"]
        assert len(moe["tokens_per_expert"]) == 2 and all(len(c) == 8 for c in moe["tokens_per_expert"])
        assert moe["max_imbalance"] == pytest.approx(max(moe["imbalance"]), rel=1e-3) and moe["max_imbalance"] >= 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dp", "2", "--ep", "2"], "--ep 2 needs a mixture-of-experts model (llama has no experts)"),
        (["--model", "qwen3-moe-debug", "--dp", "3", "--ep", "3"], "--ep 3 does not divide the 8 experts"),
        (["--model", "qwen3-moe-debug", "--dp", "2", "--ep", "4"], "--ep 4 must divide dp_shard x cp = 2"),
        (["--moe-aux-loss", "0.1"], "--moe-aux-loss needs a mixture-of-experts model, and debug has no experts"),
        (["--model", "qwen3-moe-debug", "--moe-bias-rate", "-1"], "--moe-bias-rate -1.0 must be a number >= 0"),
        (
            ["--model", "qwen3-moe-debug", "--dp", "2", "--ep", "2", "--ac", "op"],
            "activation checkpointing 'op' with --ep 2",
        ),
    ],
)
def test_expert_flags_that_cannot_work_are_refused_in_one_line(args, message):
    out = cli_here("train", "--steps", "1", *args)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.strip().splitlines() == [f"tessera train: error: {out.stderr.split('error: ', 1)[1].strip()}"]
    assert message in out.stderr


def test_a_model_named_hf_dir_is_named_so_in_its_messages(tmp_path):
    """--model hf:DIR errors say --model hf:DIR, not --init-from-hf (which the user did not give)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    for model, message in (
        (f"hf:{tmp_path}", "--model hf:DIR takes a complete Hugging Face config.json"),
        (f"hf:{tmp_path / 'absent'}", f"--model hf:{tmp_path / 'absent'}: no such directory"),
    ):
        out = cli_here("train", "--steps", "1", "--model", model)
        assert out.returncode == 2 and message in out.stderr and "--init-from-hf" not in out.stderr, out.stderr
