"""--checkpoint-async: DCP's async save, the loop blocked only while the state is staged. A checkpoint saved
in the background resumes exactly as a synchronous one does, and a run killed while its files are being
written leaves `latest` on the previous complete checkpoint, from which the next start resumes."""

import json
import os
import time

import pytest
import torch

from helpers import script_here, small_config
from tessera.launching.launch import RankFailure, run_ranks
from tessera.training.run import train

BASE = dict(steps=4, checkpoint_every=2)


def test_an_async_checkpoint_resumes_like_a_synchronous_one(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        root = tmp_path / mode
        history = train(small_config(**BASE, dp=2, checkpoint_dir=str(root), checkpoint_async=mode == "async"))
        resumed = train(small_config(**BASE, dp=2, checkpoint_dir=str(root), resume=str(root / "step_00000002")))
        runs[mode] = ([m["loss"] for m in history], [m["loss"] for m in resumed])
        assert (root / "latest").read_text() == "step_00000004"
        assert json.loads((root / "step_00000004" / "manifest.json").read_text())["step"] == 4
        assert not list(root.glob(".step_*.tmp"))
    assert runs["async"] == runs["sync"]  # bitwise: the same state was written
    assert runs["async"][1] == runs["async"][0][2:]


def _killed_while_writing(config, root):
    """Step 1 saved in the background and completed; step 2's save staged, then every rank killed while its
    files are being written (the writes made slow)."""
    import torch.distributed.checkpoint.filesystem as fs

    from tessera.checkpointing.checkpoint import CheckpointManager
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    manager = CheckpointManager(root, keep=3)
    trainer.train_step()
    trainer.save(manager)
    assert manager.pending is not None  # in the background
    manager.finish()
    write = fs.FileSystemWriter.write_data

    def slow(self, plan, planner):
        time.sleep(60)
        return write(self, plan, planner)

    fs.FileSystemWriter.write_data = slow
    trainer.train_step()
    trainer.save(manager)  # returns once staged
    time.sleep(1.0)
    os._exit(0)  # killed mid-save


def test_a_run_killed_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    config = small_config(steps=3, checkpoint_every=1, checkpoint_dir=str(root), checkpoint_async=True, dp=2)
    with pytest.raises(RankFailure):
        run_ranks(_killed_while_writing, 2, config, str(root), timeout=120)
    assert (root / "latest").read_text() == "step_00000001"  # never the incomplete one
    incomplete = root / ".step_00000002.tmp"
    assert incomplete.is_dir() and not (incomplete / "manifest.json").exists()
    resumed = train(
        small_config(steps=3, checkpoint_every=1, checkpoint_dir=str(root), checkpoint_async=True, dp=2, resume="")
    )
    straight = train(small_config(steps=3, dp=2))
    assert [m["step"] for m in resumed] == [2, 3]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight[1:]]
    assert (root / "latest").read_text() == "step_00000003" and not list(root.glob(".step_*.tmp"))


def test_checkpoint_async_without_checkpoints_is_refused():
    with pytest.raises(ValueError, match="--checkpoint-async changes how checkpoints are saved, and none would be"):
        small_config(checkpoint_async=True).check()


def test_the_checkpoint_benchmark_runs_and_records_both_modes(tmp_path):
    out = script_here("bench_checkpoint", "--quick", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "checkpoint_async_cpu_quick.json").read_text())
    summary = result["results"]["summary"]
    assert {r["mode"] for r in result["results"]["rows"]} == {"sync", "async"}
    assert summary["async"]["blocked_s_median"] > 0 and summary["sync"]["blocked_s_median"] > 0
    assert result["config"]["state_bytes_all_ranks"] > 10e6 and "versions" in result
