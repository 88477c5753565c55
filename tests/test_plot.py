"""`tessera plot`: two runs' metrics files -> one PNG of loss and tokens/s, each run labelled by its layout;
bad input (a missing file, a file that is not tessera's JSONL, no matplotlib) is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_here
from tessera.commands.main import main
from tessera.commands.plot import read_run


def _write_run(path: Path, layout: dict[str, int], optimizer: str = "adamw", steps: int = 4) -> Path:
    """A metrics file as tessera train writes it: a header (the fields plot reads, as run.header_record
    writes them), then one record per step (a skipped step's loss is null)."""
    full = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, **layout}
    header = {
        "type": "header",
        "run_id": "0" * 32,
        "config": {"parallel": {"sequence_parallel": False}, "optimizer": {"optimizer": optimizer}},
        "layout": full,
        "world_size": 2,
        "nonfinite_as": "null",
        "restart": 0,
    }
    lines = [header]
    for step in range(1, steps + 1):
        loss = None if step == 3 else 5.5 - 0.1 * step
        record = {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0 + step}
        lines.append({**record, "layout": full, "skipped": loss is None, **({"eval_loss": 5.0} if step == 4 else {})})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_two_layouts_in_one_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the bench extra)")
    a = _write_run(tmp_path / "dp.jsonl", {"dp_shard": 2})
    b = _write_run(tmp_path / "tp.jsonl", {"tp": 2}, optimizer="muon")
    assert read_run(a).label == "dp_shard2" and read_run(b).label == "tp2, muon"
    assert read_run(a).steps == [1, 2, 3, 4] and read_run(a).eval_loss == [(4, 5.0)]
    out = tmp_path / "runs.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert capsys.readouterr().out.startswith(f"wrote {out}")


def _one_line_exit_2(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tessera plot: error: ")
    return err


def test_bad_input_is_one_line(tmp_path, capsys):
    good = _write_run(tmp_path / "good.jsonl", {"dp_shard": 2})
    assert "does not exist" in _one_line_exit_2(["plot", str(tmp_path / "missing.jsonl")], capsys)
    text = tmp_path / "notes.txt"
    text.write_text("hello\nworld\n")
    assert "not JSON" in _one_line_exit_2(["plot", str(good), str(text)], capsys)
    other = tmp_path / "other.jsonl"
    other.write_text('{"a": 1}\n')
    assert "neither a header" in _one_line_exit_2(["plot", str(other)], capsys)
    headless = tmp_path / "headless.jsonl"
    headless.write_text('{"step": 1, "loss": 2.0}\n')
    assert "no header record" in _one_line_exit_2(["plot", str(headless)], capsys)


def test_without_matplotlib_one_line(tmp_path, capsys, monkeypatch):
    run = _write_run(tmp_path / "run.jsonl", {"dp_shard": 2})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    assert "pip install matplotlib" in _one_line_exit_2(["plot", str(run)], capsys)
    assert not (tmp_path / "run.png").exists()


def test_plot_imports_no_torch():
    code = "import sys, tessera.commands.plot; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_a_file_two_new_runs_were_written_into_plots_two_curves(tmp_path):
    """Before a new run refused an existing metrics file, two runs appended to one file drew as one curve (steps
    1, 2, 3 of the second over the first's): each header of a new run (not a resume, not a restart) starts a
    curve of its own; a resume continues the curve before it."""
    from tessera.commands.plot import read_runs

    def header(resume=None, restart=0):
        layout = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}
        return {"type": "header", "layout": layout, "config": {"checkpoint": {"resume": resume}}, "restart": restart}

    lines = [
        header(),
        {"step": 1, "loss": 5.0},
        {"step": 2, "loss": 4.0},
        header(resume="ck"),
        {"step": 3, "loss": 3.0},
    ]
    lines += [header(), {"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    runs = read_runs(path)
    assert [r.steps for r in runs] == [[1, 2, 3], [1, 2]] and [r.loss for r in runs] == [[5.0, 4.0, 3.0], [9.0, 8.0]]
    assert runs[0].label.endswith("(run 1 of 2 in m.jsonl)")
    out = cli_here("plot", str(path), "--out", str(tmp_path / "p.png"))
    assert out.returncode == 0, out.stderr
    new = tmp_path / "new.jsonl"
    new.write_text(json.dumps(header()) + "\n" + json.dumps({"step": 1, "loss": 1.0}) + "\n")
    refused = cli_here("train", "--model", "debug", "--steps", "1", "--metrics", str(new))
    assert refused.returncode == 2 and "new.jsonl already holds a run's records" in refused.stderr


def test_an_out_matplotlib_cannot_write_is_one_line_and_a_bare_name_says_its_png(tmp_path):
    """Issue 65 item 8: --out p.txt gave a 24-line matplotlib traceback; --out noext printed 'wrote noext' and
    wrote noext.png."""
    layout = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}
    run = tmp_path / "m.jsonl"
    run.write_text(
        json.dumps({"type": "header", "layout": layout}) + "\n" + json.dumps({"step": 1, "loss": 2.0}) + "\n"
    )
    out = cli_here("plot", str(run), "--out", str(tmp_path / "p.txt"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "matplotlib writes no .txt figure; end it in .png" in out.stderr
    bare = cli_here("plot", str(run), "--out", str(tmp_path / "noext"))
    assert bare.returncode == 0 and f"wrote {tmp_path / 'noext.png'}:" in bare.stdout
    assert (tmp_path / "noext.png").is_file()
