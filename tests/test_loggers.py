"""--tensorboard DIR and --wandb PROJECT: the scalars each writes equal the JSONL step records, step by step,
read back with tensorboard's own reader and from W&B's offline run files; a --resume continues the same
curves; a missing library, an unwritable directory or a bad project name is one line before any rank."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from helpers import cli_here
from tessera.metrics import loggers
from tessera.metrics.loggers import check_loggers, mfu_per_token, scalars

HAS_WANDB = importlib.util.find_spec("wandb") is not None
NO_WANDB = "wandb is not installed (pip install wandb, or the wandb extra)"
RUN = ["train", "--steps", "3", "--dp", "2", "--global-batch", "4", "--seq-len", "32", "--comm-stats", "--quiet"]


def _tessera(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from tessera.commands.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """3 steps on dp2 saving at step 2, then a --resume that repeats step 3: one metrics file, one
    TensorBoard directory and (when wandb is installed) one W&B project, shared by both."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    root = tmp_path_factory.mktemp("loggers")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true"}
    args = RUN + ["--metrics", "m.jsonl", "--tensorboard", "tb", "--checkpoint-dir", "ck", "--checkpoint-every", "2"]
    args += ["--wandb", "tessera-test"] if HAS_WANDB else []
    for extra in ([], ["--resume"]):
        done = _tessera(args + extra, root, env)
        assert done.returncode == 0, done.stderr
        if not extra:  # the run saved its final step too: drop it, as a crash after step 3's record and before
            # its save leaves the directory, so that the resume repeats step 3 from step 2's checkpoint
            shutil.rmtree(root / "ck" / "step_00000003")
            (root / "ck" / "latest").write_text("step_00000002")
    return root


def _steps(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("type") != "header"]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30)  # TensorBoard's scalars are float32


def test_tensorboard_scalars_equal_the_jsonl_step_by_step(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = _steps(resumed_run / "m.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]  # the resume cut the repeated step 3 from the JSONL
    events = EventAccumulator(str(resumed_run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {tag for r in records for tag in scalars(r)}
    assert tags == expected
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "peak_memory_bytes", "skipped_steps"} <= tags
    assert any(t.startswith("comm/bytes_by_axis/") for t in tags)  # --comm-stats: each axis's bytes
    for tag in tags:
        written = {e.step: e.value for e in events.Scalars(tag)}
        want = {r["step"]: scalars(r)[tag] for r in records if tag in scalars(r)}
        assert written.keys() == want.keys(), tag
        for step, value in want.items():  # step 3 too: the first attempt's (another tokens/s) was purged
            assert _close(written[step], value), (tag, step, written[step], value)


def test_a_resume_continues_the_same_curves(resumed_run):
    # two attempts wrote into the same directory: one event file each, one curve of steps 1..3
    assert len(list((resumed_run / "tb").glob("events.out.tfevents.*"))) == 2
    if HAS_WANDB:
        run_id = (resumed_run / "ck" / loggers.WANDB_ID_FILE).read_text().strip()
        runs = sorted((resumed_run / "wandb").glob("offline-run-*"))
        assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file (its LevelDB-log framing: 32 KiB blocks of chunks with a
    7-byte header, after the file's own 7-byte header)."""
    data, pos, buf = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk


@pytest.mark.skipif(not HAS_WANDB, reason=NO_WANDB)
def test_wandb_offline_history_equals_the_jsonl(resumed_run):
    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict] = {}
    for run in sorted((resumed_run / "wandb").glob("offline-run-*")):  # by start time: the resume's last
        (file,) = run.glob("run-*.wandb")
        for data in _wandb_records(file):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                history[row["_step"]] = row
            elif record.WhichOneof("record_type") == "run":
                assert record.run.project == "tessera-test"
    records = _steps(resumed_run / "m.jsonl")
    assert sorted(history) == [r["step"] for r in records]
    for r in records:
        logged = {k: v for k, v in history[r["step"]].items() if not k.startswith("_")}
        assert logged.keys() == scalars(r).keys()
        assert all(_close(logged[k], v) for k, v in scalars(r).items()), r["step"]


def test_scalars_of_a_record():
    record = {
        "step": 4,
        "loss": float("nan"),  # a skipped step's: null in the JSONL, no point
        "grad_norm": 2.0,
        "eval_loss": 3.5,
        "skipped": True,
        "layout": {"dp_shard": 2},
        "compute_dtype": "float32",
        "tokens_checksum": 123,
        "comm": {"bytes_by_axis": {"tp": 10, "pp": 0}},
        "straggler": None,
    }
    assert scalars(record) == {
        "grad_norm": 2.0,
        "eval_loss": 3.5,
        "skipped": 1.0,
        "comm/bytes_by_axis/tp": 10.0,
        "comm/bytes_by_axis/pp": 0.0,
    }


def test_mfu_needs_a_known_peak_and_bf16():
    assert mfu_per_token("NVIDIA H100 80GB HBM3", "bfloat16", 6e9, 8) == pytest.approx(6e9 / (8 * 989e12))
    assert mfu_per_token("NVIDIA H100 80GB HBM3", "float32", 6e9, 8) is None
    assert mfu_per_token("cpu", "bfloat16", 6e9, 1) is None


def test_bad_logger_input_is_one_line(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"^--wandb needs the wandb package.*pip install wandb"):
        check_loggers(None, "project")
    monkeypatch.undo()
    if HAS_WANDB:
        with pytest.raises(ValueError, match="no W&B project name"):
            check_loggers(None, "a/b")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ValueError, match="--tensorboard"):
        check_loggers(str(blocked / "tb"), None)  # under a file: cannot be created
    with pytest.raises(ValueError, match="cannot be created"):
        check_loggers(str(blocked / "tb"), None)


def test_the_command_says_one_line_before_any_rank(tmp_path):
    # tensorboard made unimportable in the command's process: the pip command, no traceback, exit 2
    with mock.patch.dict(sys.modules, {"tensorboard": None}):
        done = cli_here("train", "--steps", "1", "--tensorboard", "tb", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "tessera train: error: --tensorboard needs the tensorboard package, which is not installed: "
        "pip install tensorboard (or pip install -e '.[tensorboard]' in the tessera clone)"
    )
