"""The config and every input check, in-process: each bad input raises a one-line ValueError naming
the value and the fix, before any rank starts. One subprocess test checks the CLI's exit code and
that nothing ran."""

import json
import os
import subprocess
import sys

import pytest

from helpers import small_config, cli_here
from tessera.config import Config, add_arguments, config_from_args


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tp=3), "--tp 3 does not divide the 4 attention heads"),
        (dict(tp=2, sequence_parallel=True, seq_len=33), "--seq-len 33, --tp 2; use --seq-len 32"),
        (dict(model="llama9"), "unknown model preset 'llama9'"),
        # pipeline parallel
        (dict(pp=2, n_layers=4, microbatches=3), "--microbatches 3 does not divide the 4 rows each dp rank reads"),
        (
            dict(pp=4, n_layers=4, microbatches=2),
            "needs at least as many microbatches as stages: --microbatches 2 < --pp 4",
        ),
        (dict(pp=4, microbatches=4), "4 pipeline stages (pp x virtual) but only 2 layers"),
        (
            dict(pp=2, n_layers=4, microbatches=4, schedule="interleaved-1f1b", virtual=4),
            "8 pipeline stages (pp x virtual) but only 4 layers",
        ),
        (
            dict(pp=2, n_layers=4, microbatches=2, pp_layers="3,2"),
            "--pp-layers 3,2 must be positive counts summing to --n-layers 4",
        ),
        (dict(pp=2, n_layers=4, microbatches=2, pp_layers="1,1,2"), "--pp-layers 1,1,2 lists 3 stages; the run has 2"),
        # issue 40: 0,2 said "summing to --n-layers 2 (they sum to 2)"
        (
            dict(pp=2, n_layers=2, microbatches=2, pp_layers="0,2"),
            "--pp-layers 0,2 leaves stage 0 without a layer (0); each stage needs at least one (e.g. --pp-layers 1,1)",
        ),
        (
            dict(pp=3, n_layers=2, microbatches=3, global_batch=3, pp_layers="2,0,0"),
            "--pp-layers 2,0,0 leaves stages 1 and 2 without a layer (0, 0); each stage needs at least one, and 3 "
            "stages need --n-layers 3 or more",
        ),
        (
            dict(pp=2, n_layers=4, microbatches=2, pp_layers="2,x"),
            "--pp-layers '2,x' must be comma-separated layer counts",
        ),
        (dict(pp=2, n_layers=4, microbatches=2, schedule="pipedream"), "unknown pipeline --schedule pipedream"),
        (dict(pp=2, n_layers=4, microbatches=2, virtual=2), "--virtual 2 needs --schedule interleaved-1f1b"),
        (dict(schedule="gpipe"), "--schedule applies to pipeline parallel, and --pp is 1: add --pp 2"),
        (dict(virtual=2), "--virtual applies to pipeline parallel, and --pp is 1"),
        (dict(pp_layers="1,1"), "--pp-layers applies to pipeline parallel, and --pp is 1"),
        (
            dict(cp=3, seq_len=32),
            "--seq-len 32 does not split into 2 x cp = 6 equal chunks (zigzag context parallel); "
            "use --seq-len 30 or 36",
        ),
        (
            dict(cp=2, tp=4, sequence_parallel=True, seq_len=36),
            "whose S/cp tokens split over --tp 4 (sequence parallel); use --seq-len 32 or 40",
        ),
        (dict(cp=2, cp_method="ulysses"), "unknown --cp-method 'ulysses'; use one of ring, allgather"),
        (dict(cp_method="ring"), "--cp-method ring applies to context parallel, and --cp is 1: add --cp 2"),
        (dict(loss="fused"), "unknown --loss 'fused'; use chunked (fused linear cross-entropy"),
        (dict(tp=0), "--tp 0 must be a positive integer"),
        (dict(dp=4, fsdp="HYBRID_SHARD"), "HYBRID_SHARD needs replica groups: --dp 4 with --dp-replicate 1"),
        (dict(dp=2, fsdp="ZERO9"), "unknown FSDP strategy 'ZERO9'"),
        (dict(dp=4, dp_replicate=3), "--dp-replicate 3 must divide --dp 4"),
        (dict(dp=3, global_batch=8), "global batch 8 does not split over --dp 3"),
        (dict(dp=2, ac="most"), "unknown activation checkpointing 'most'"),
        (dict(checkpoint_every=2), "--checkpoint-every needs --checkpoint-dir"),
        (dict(microbatches=3), "--microbatches 3 does not divide the 4 rows each dp rank reads"),
        (dict(dp=2, microbatches=4), "--microbatches 4 does not divide the 2 rows each dp rank reads"),
        (dict(microbatches=0), "--microbatches 0 must be positive"),
        (dict(max_grad_norm=0.0), "--max-grad-norm 0.0 must be positive"),
        (
            dict(max_grad_norm=-1.0),
            "--max-grad-norm -1.0 must be positive (the global norm the gradients are clipped to)",
        ),
        (dict(lr=-1e-3), "--lr -0.001 must be a positive number"),
        (dict(warmup=-1), "--warmup -1 must be >= 0"),
        (dict(timeout=0.0), "--timeout 0.0 must be a positive number of seconds"),
        (dict(seq_len=4096), "--seq-len 4096 exceeds the debug preset's max_seq_len=2048"),
        (dict(n_layers=0), "--n-layers 0 must be at least 1"),
        (dict(device="tpu"), "--device 'tpu'; use auto, cpu or cuda"),
        (dict(kernels="cudnn"), "--kernels 'cudnn'; use auto, torch or triton"),
        (dict(resume="/x", init_from="/y"), "--init-from and --resume together"),
        # issue 65 item 7: accepted, and did nothing (or promised an eta of 413,313,689,980,057 hours)
        (dict(muon_lr=0.5), "--muon-lr 0.5 applies to --optimizer muon, and this run's optimizer is adamw"),
        (
            dict(dp=4, dp_replicate=2, fsdp="NO_SHARD"),
            "--fsdp NO_SHARD replicates over all --dp 4 ranks, so --dp-replicate 2 would do nothing",
        ),
        (dict(muon_momentum=0.5), "--muon-momentum 0.5 applies to --optimizer muon"),
        (dict(steps=10**20), "--steps 100,000,000,000,000,000,000 is more than any run takes (at most 10,000,000,000)"),
    ],
)
def test_bad_input_is_one_clear_line(overrides, message):
    with pytest.raises(ValueError) as e:
        small_config(**overrides).check()
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "batch, fix",
    [
        # issue 40: "use --dp 3", which the batch of 8 then refused
        (
            8,
            "no multiple of 3 splits --global-batch 8 either: use --dp-replicate 2 or 4 (dividing --dp 4), or --dp 3 "
            "with --global-batch 9",
        ),
        (12, "use --dp 3"),
        (24, "use --dp 3"),
        (18, "use --dp 3"),
    ],
)
def test_a_dp_the_replicas_do_not_divide_is_answered_with_a_fix_that_passes(batch, fix):
    """--dp 4 --dp-replicate 3: the --dp suggested also splits the global batch, or the line names both rules;
    and the command the fix gives passes every check."""
    with pytest.raises(ValueError) as e:
        small_config(dp=4, dp_replicate=3, global_batch=batch).check()
    assert str(e.value) == f"--dp-replicate 3 must divide --dp 4 (dp = dp_replicate x dp_shard); {fix}"
    if fix.startswith("no multiple"):
        fixed = [dict(dp=4, dp_replicate=2, global_batch=batch), dict(dp=4, dp_replicate=4, global_batch=batch)]
        fixed.append(dict(dp=3, dp_replicate=3, global_batch=9))
    else:
        fixed = [dict(dp=int(fix.split()[-1]), dp_replicate=3, global_batch=batch)]
    for kw in fixed:
        small_config(**kw, device="cpu").check()


def test_triton_kernels_on_cpu_ranks_are_refused_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--kernels triton on CPU ranks: the Triton kernels need CUDA tensors"):
        small_config(kernels="triton", device="cpu").check()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    small_config(kernels="triton", device="cpu").check()


def test_no_gpu_is_refused_when_cuda_is_asked_for():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="--device cuda: this machine has no CUDA GPU"):
        small_config(device="cuda").check()


def test_paths_are_checked_before_any_rank_starts(tmp_path):
    with pytest.raises(ValueError, match=f"--metrics {tmp_path}/no/run.jsonl: directory {tmp_path}/no does not exist"):
        small_config(metrics=str(tmp_path / "no" / "run.jsonl")).check()
    with pytest.raises(ValueError, match="is a directory"):
        small_config(metrics=str(tmp_path)).check()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"--checkpoint-dir {blocker}/ckpt cannot be created"):
        small_config(checkpoint_dir=str(blocker / "ckpt"), checkpoint_every=1).check()
    with pytest.raises(ValueError, match="saves nothing"):
        small_config(checkpoint_dir=str(tmp_path / "c")).check()
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            small_config(metrics=str(ro / "m.jsonl")).check()
    with pytest.raises(ValueError, match="no such file"):
        small_config(init_from=str(tmp_path / "none.safetensors")).check()


def test_init_from_a_file_of_another_models_shapes_is_refused(tmp_path):
    import torch

    from tessera.models import build_model
    from tessera.checkpointing.checkpoint import write_safetensors

    small = {k: v for k, v in build_model("small", seed=0).state_dict().items()}
    write_safetensors(small, tmp_path / "small.safetensors")
    with pytest.raises(ValueError, match="does not hold this model's weights"):
        small_config(init_from=str(tmp_path / "small.safetensors")).check()
    small_config(model="small", init_from=str(tmp_path / "small.safetensors")).check()  # the right model passes
    (tmp_path / "junk.safetensors").write_bytes(b"\x05" * 40)
    with pytest.raises(ValueError, match="is not a safetensors file"):
        small_config(init_from=str(tmp_path / "junk.safetensors")).check()
    assert torch.is_tensor(small["output.weight"])


def _parse(argv, world=None):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv), world)


def test_cli_flags_map_onto_the_nested_config_and_round_trip():
    c = _parse(
        [
            "--model",
            "small",
            "--n-layers",
            "2",
            "--tp",
            "2",
            "--dp",
            "4",
            "--dp-replicate",
            "2",
            "--fsdp",
            "HYBRID_SHARD",
            "--microbatches",
            "2",
            "--lr",
            "1e-3",
            "--beta2",
            "0.99",
            "--min-lr-ratio",
            "0.05",
            "--checkpoint-dir",
            "/tmp/x",
            "--checkpoint-every",
            "5",
            "--resume",
            "--metrics",
            "m.jsonl",
        ]
    )
    assert c.model.preset == "small" and c.model_config.n_layers == 2
    assert (c.parallel.tp, c.parallel.dp, c.parallel.dp_replicate, c.parallel.fsdp) == (2, 4, 2, "HYBRID_SHARD")
    assert c.data.microbatches == 2 and c.optimizer.beta2 == 0.99 and c.optimizer.min_lr_ratio == 0.05
    assert c.checkpoint.resume == "" and c.resume_path == "/tmp/x"
    assert json.loads(json.dumps(c.to_dict()))["parallel"]["tp"] == 2
    defaults = _parse([])
    assert defaults == Config()  # the CLI restates no default


def test_degrees_not_given_are_inferred_from_the_torchrun_world():
    assert _parse(["--tp", "2"], world=8).layout.as_dict() == dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=1)
    assert _parse([], world=4).layout.dp_shard == 4
    assert _parse(["--dp", "2"], world=4).layout.world_size == 2  # given degrees are kept; check_world_size refuses
    with pytest.raises(ValueError, match="WORLD_SIZE=6 is not divisible by pp x cp x tp = 4"):
        _parse(["--tp", "4"], world=6)


def test_the_cli_exits_2_with_one_line_and_runs_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tessera", "train", "--steps", "1", "--tp", "3"],  # the command's own exit
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "tessera train: error: --tp 3 does not divide the 4 attention heads; use a tp that divides 4"
    ]
    # the same command's other paths in this process (a fresh interpreter costs ~3 s a call)
    version = cli_here("--version")
    assert version.returncode == 0 and version.stdout.startswith("tessera ")
    missing = cli_here("export", str(tmp_path), "--out", str(tmp_path / "no" / "m.safetensors"))
    assert missing.returncode == 2 and "does not exist; create it first" in missing.stderr


def test_the_command_exits_without_the_teardown_yet_joins_threads_runs_atexit_and_flushes(tmp_path):
    """`tessera` (commands.cli.run) leaves by os._exit after main(): the code main returned, every line printed,
    after another thread's last write and the atexit handlers, as a normal exit would."""
    script = f"""
import atexit, pathlib, sys, threading, time
from tessera.commands.main import run
out = pathlib.Path({str(tmp_path)!r})
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("joined"))).start()
sys.stdout.write("no newline yet")
sys.argv = ["tessera", "--version"]
run()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("no newline yettessera ") and done.stdout.endswith("\n")
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"


def test_the_parallel_config_is_built_once_per_config_and_not_shipped_to_the_ranks():
    import dataclasses
    import pickle

    from tessera.config import Config

    config = Config.create(model="debug", dp=2, tp=2)
    view = config.parallel_config()
    assert config.parallel_config() is view  # built once, kept on the config
    shipped = pickle.loads(pickle.dumps(config))
    assert shipped == config and "_parallel_config" not in vars(shipped)  # the ranks build their own
    changed = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, sequence_parallel=True))
    assert changed.parallel_config() is not view and changed.parallel_config().sequence_parallel


def test_the_layout_is_computed_once_per_config():
    import dataclasses
    import pickle

    from tessera.config import Config

    config = Config.create(model="debug", dp=2, tp=2)
    layout = config.layout
    assert config.layout is layout and (layout.dp_shard, layout.tp) == (2, 2)
    assert "_layout" not in vars(pickle.loads(pickle.dumps(config)))
    changed = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tp=1, dp=4))
    assert (changed.layout.dp_shard, changed.layout.tp) == (4, 1)
