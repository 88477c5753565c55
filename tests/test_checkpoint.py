"""Distributed checkpoints: faithful resume (same layout bitwise, other layouts resharded), atomic saves,
clear errors for bad checkpoints, and full state dicts."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import cli_here, first_loss, small_config
from tessera.checkpointing import checkpoint
from tessera.launching.launch import run_ranks
from tessera.training.run import train


def _cli(*args):
    return cli_here(*args)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """6 steps on dp4 with checkpoints every 3 steps: (root, per-step losses)."""
    root = tmp_path_factory.mktemp("ckpt")
    history = train(small_config(dp=4, steps=6, checkpoint_dir=str(root), checkpoint_every=3, keep_checkpoints=1))
    return root, [m["loss"] for m in history]


def test_atomic_layout_latest_and_keep(saved):
    root, _ = saved
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000006"]  # keep=1 removed step 3
    assert (root / "latest").read_text() == "step_00000006"
    manifest = checkpoint.read_manifest(root / "step_00000006")
    for key in (
        "step",
        "consumed_tokens",
        "data",
        "scheduler",
        "rng",
        "layout",
        "world_size",
        "sharding_strategy",
        "versions",
    ):
        assert key in manifest, key
    assert manifest["step"] == 6 and manifest["consumed_tokens"] == 6 * 4 * 32
    assert manifest["layout"]["dp_shard"] == 4 and manifest["world_size"] == 4
    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["config"]["parallel"]["dp"] == 4 and manifest["progress"]["step"] == 6
    assert not list(root.glob(".*.tmp"))


@pytest.fixture(scope="module")
def step3(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt3")
    history = train(small_config(dp=4, steps=6, checkpoint_dir=str(root), checkpoint_every=3))
    return root / "step_00000003", [(m["loss"], m["grad_norm"]) for m in history]


def test_resume_on_the_same_layout_is_bitwise(step3):
    path, history = step3
    resumed = train(small_config(dp=4, steps=6, resume=str(path)))
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == history[3:]


@pytest.mark.parametrize(
    "layout", [dict(dp=2, tp=2), dict(tp=2, sequence_parallel=True), dict()], ids=["dp2xtp2", "tp2+sp", "one"]
)
def test_resume_on_another_layout_reshards(step3, layout):
    path, history = step3
    resumed = train(small_config(steps=6, resume=str(path), **layout))
    assert len(resumed) == 3
    for m, (loss, norm) in zip(resumed, history[3:]):
        assert abs(m["loss"] - loss) <= 1e-5 * abs(loss) and abs(m["grad_norm"] - norm) <= 1e-5 * abs(norm)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_shard_fails_naming_the_file(step3, tmp_path):
    bad = _copy(step3[0], tmp_path / "bad")
    shard = sorted((bad / "state").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    out = _cli("train", "--dp", "4", "--seq-len", "32", "--global-batch", "4", "--steps", "6", "--resume", str(bad))
    assert out.returncode == 2
    assert f"truncated or altered checkpoint file {shard}" in out.stderr


def test_corrupt_shard_fails_naming_the_file(step3, tmp_path):
    bad = _copy(step3[0], tmp_path / "bad")
    shard = sorted((bad / "state").glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = _cli(
        "train", "--dp", "2", "--seq-len", "32", "--global-batch", "4", "--steps", "6", "--resume", str(bad),
        "--lr", "3e-3", "--warmup", "1",  # the saved run's schedule (small_config's)
    )  # fmt: skip
    assert out.returncode == 2 and f"corrupt checkpoint file {shard}" in out.stderr


def test_missing_manifest_and_other_model_fail_before_ranks_start(step3, tmp_path):
    bad = _copy(step3[0], tmp_path / "bad")
    (bad / "manifest.json").unlink()
    out = cli_here("train", "--steps", "6", "--seq-len", "32", "--resume", str(bad))
    assert out.returncode == 2 and f"no manifest.json (and no 'latest' pointer) in {bad}" in out.stderr
    out = cli_here("train", "--model", "small", "--steps", "6", "--seq-len", "32", "--resume", str(step3[0]))
    assert out.returncode == 2 and "holds model 'debug', not 'small'; resume with --model debug" in out.stderr
    assert "step" not in out.stdout
    # the same preset with a field changed names the field (it said "holds model 'debug', not 'debug'")
    out = cli_here("train", "--vocab-size", "300", "--steps", "6", "--seq-len", "32", "--resume", str(step3[0]))
    assert out.returncode == 2 and "holds 'debug' with --vocab-size 258 where this run has 300; " in out.stderr
    assert "resume with the model it saved (--vocab-size 258)" in out.stderr, out.stderr
    out = cli_here("train", "--steps", "6", "--seq-len", "16", "--resume", str(step3[0]))
    assert out.returncode == 2 and "was trained with --seq-len 32, this run uses 16; use --seq-len 32" in out.stderr
    assert "step" not in out.stdout


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(global_batch=8), "was trained with --global-batch 4, this run uses 8"),
        (dict(steps=9), "is from a run of --steps 6, this run asks for 9"),
    ],
)
def test_a_resume_that_would_not_continue_the_run_is_refused(step3, overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**{"steps": 6, "resume": str(step3[0]), **overrides}).check()


def test_resuming_a_finished_run_is_refused(saved):
    root, _ = saved
    with pytest.raises(ValueError, match="is at step 6, already at --steps 6: nothing left to train"):
        small_config(steps=6, dp=4, resume=str(root)).check()


def test_export_full_state_dict_and_load_it_into_any_layout(step3, tmp_path):
    out_file = tmp_path / "model.safetensors"
    out = _cli("export", str(step3[0]), "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    full = checkpoint.read_safetensors(out_file)
    from tessera.models import build_model

    reference = build_model("debug")
    assert {k: tuple(v.shape) for k, v in full.items()} == {
        k: tuple(v.shape) for k, v in reference.state_dict().items()
    }
    assert not torch.equal(full["output.weight"], reference.output.weight)  # trained, not the initialization
    from helpers import resumed_full_parameters

    config = small_config(dp=4, steps=6, resume=str(step3[0]))
    trained = run_ranks(resumed_full_parameters, 4, config, timeout=120)[0]  # the weights of step 3, resharded
    assert sorted(trained) == sorted(full)
    for name, value in trained.items():
        assert torch.equal(full[name], value), name
    losses = [
        run_ranks(first_loss, c.layout.world_size, c, timeout=120)[0]
        for c in (small_config(init_from=str(out_file)), small_config(dp=2, tp=2, init_from=str(out_file)))
    ]
    one = run_ranks(first_loss, 1, small_config(), timeout=120)[0]
    assert losses[0] != one  # the loaded weights are used
    assert abs(losses[1] - losses[0]) <= 1e-5 * losses[0]


def test_safetensors_round_trip_and_truncation(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2).bfloat16()}
    checkpoint.write_safetensors(tensors, tmp_path / "t.safetensors")
    back = checkpoint.read_safetensors(tmp_path / "t.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-8])
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.read_safetensors(tmp_path / "cut.safetensors")
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["a"]["dtype"] == "F32" and header["c"]["dtype"] == "BF16"


def test_a_run_that_checkpoints_saves_its_final_step_and_export_names_it(tmp_path):
    """--steps 5 --checkpoint-every 2 saved step 2 and step 4 only: the last step's training was lost. A run that
    checkpoints saves its final step too (as torchtitan does), and export says which step of the run it found."""
    root = tmp_path / "ckpt"
    train(small_config(steps=5, checkpoint_dir=str(root), checkpoint_every=2, keep_checkpoints=5))
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000005"]
    assert (root / "latest").read_text() == "step_00000005"
    last = _cli("export", str(root), "--out", str(tmp_path / "last.safetensors"))
    assert last.returncode == 0, last.stderr
    assert "model debug at step 5, the run's last" in last.stdout
    earlier = _cli("export", str(root / "step_00000004"), "--out", str(tmp_path / "earlier.safetensors"))
    assert "model debug at step 4 of the run's 5 steps" in earlier.stdout


def test_keep_checkpoints_rotates_the_step_a_resume_started_from(tmp_path):
    """--keep-checkpoints K after a resume: the checkpoint resumed from stayed for good (K=2 left three, the
    default K=3 four). Its pin keeps other writers off it while this run reads it, not this run's own rotation
    once it has saved newer ones."""
    root = tmp_path / "ckpt"
    train(small_config(steps=6, checkpoint_dir=str(root), checkpoint_every=2, keep_checkpoints=5))
    for later in ("step_00000004", "step_00000006"):  # as an interruption after step 2's save leaves it
        shutil.rmtree(root / later)
    (root / "latest").write_text("step_00000002")
    train(small_config(steps=6, checkpoint_dir=str(root), checkpoint_every=1, keep_checkpoints=2, resume=""))
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000005", "step_00000006"]
    assert not list((root / ".pins").glob("*"))  # the run's pin is gone with it


def test_a_resume_holds_every_optimizer_and_schedule_flag_as_saved(step3):
    """Issue 65 item 7: on resume --steps was refused ("the schedule would jump") while --lr 1e-2 and --warmup 0
    changed steps 4-6 silently. Each is held alike: the line names the flag, both values and the fix."""
    path = step3[0]
    base = ["train", "--dp", "4", "--steps", "6", "--seq-len", "32", "--global-batch", "4", "--resume", str(path)]
    base += ["--lr", "3e-3", "--warmup", "1"]  # small_config's, as the saved run had them
    for flag, value in (("--lr", "1e-2"), ("--warmup", "0"), ("--weight-decay", "0.5"), ("--max-grad-norm", "inf")):
        out = cli_here(*base, flag, value)
        assert out.returncode == 2 and "a resume continues the run's optimizer and schedule as saved" in out.stderr
        assert f"was trained with {flag} " in out.stderr and f"resume with {flag} " in out.stderr, out.stderr
