"""The plain-torch baseline (tessera.commands.baseline): a real Llama training step, self-contained (no tessera
parallel layers), that starts from tessera's weights and batch and so gives tessera's first-step loss."""

import subprocess
import sys

import pytest
import torch


def _first_steps(steps: int):
    """On one rank: tessera's one-process losses and the baseline's, same seed, data, sequence and batch (fp32)."""
    import torch

    from tessera.commands import baseline
    from tessera.config import Config
    from tessera.trainer import Trainer

    config = Config.create(model="debug", seq_len=32, global_batch=4, steps=steps, quiet=True, mixed_precision="fp32")
    trainer = Trainer(config, torch.device("cpu"))
    ours = [trainer.train_step().record() for _ in range(steps)]
    cfg, o = config.model_config, config.optimizer
    options = baseline.Options(
        mixed_precision="fp32",
        lr=o.lr,
        warmup=o.warmup,
        min_lr_ratio=o.min_lr_ratio,
        total_steps=steps,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
    )
    theirs = baseline.train(
        cfg,
        baseline.tessera_batches(cfg, 32, 4),
        steps,
        "cpu",
        lambda: baseline.tessera_state(cfg, config.runtime.seed),
        options,
    )
    return ours, theirs


def test_baseline_first_loss_is_tesseras_for_the_same_weights_and_batch():
    from tessera.launching.launch import run_ranks

    ours, theirs = run_ranks(_first_steps, 1, 2, timeout=180)[0]
    assert len(theirs) == 2
    assert theirs[0]["loss"] == pytest.approx(ours[0]["loss"], rel=1e-4)
    assert theirs[0]["grad_norm"] == pytest.approx(ours[0]["grad_norm"], rel=1e-4)
    # a real model training: the same schedule and AdamW move it the same way
    assert theirs[1]["loss"] < theirs[0]["loss"] and theirs[1]["loss"] == pytest.approx(ours[1]["loss"], rel=1e-4)
    for r in theirs:
        assert (
            r["compute_dtype"] == "float32"
            and r["step_time_s"] > 0
            and r["tokens_per_s"] > 0
            and r["peak_memory_bytes"] > 0
        )


def test_baseline_imports_no_tessera_parallel_layer_and_runs_from_its_command_line():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for ln in block.splitlines()]
    args = next(ln for ln in lines if ln.startswith("python -m tessera.commands.baseline")).split()[
        3:
    ]  # the README's command
    code = (
        f"import sys, tessera.commands.baseline as b; b.main({args!r}); "
        "bad = [m for m in sys.modules if m.startswith(('tessera.parallel', 'tessera.trainer'))]; assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(records) == int(args[args.index("--steps") + 1]) and '"compute_dtype": "float32"' in records[0]


@pytest.mark.parametrize(
    "capability, dtype, head_dim, cudnn",
    [
        ((9, 0), torch.bfloat16, 64, True),  # Hopper, the 1b preset's heads: tessera's dispatcher picks cuDNN
        ((9, 0), torch.bfloat16, 128, True),
        ((10, 0), torch.float16, 128, True),
        ((9, 0), torch.bfloat16, 256, False),  # past cuDNN's training head dims
        ((9, 0), torch.bfloat16, 60, False),  # not a multiple of 8
        ((9, 0), torch.float32, 64, False),  # fp32: SDPA's own choice
        ((8, 0), torch.bfloat16, 64, False),  # Ampere keeps SDPA's priority (tessera's Triton kernel there)
    ],
)
def test_the_baseline_picks_the_attention_backend_as_tessera_does(monkeypatch, capability, dtype, head_dim, cudnn):
    from tessera.commands import baseline

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert baseline.cudnn_serves(torch.device("cuda", 0), dtype, head_dim) is cudnn
    assert baseline.cudnn_serves(torch.device("cpu"), dtype, head_dim) is False


def test_every_baseline_record_names_the_attention_backend_that_ran_and_the_mode_that_chose_it():
    from tessera.commands import baseline
    from tessera.models import get_preset

    cfg = get_preset("debug")
    batches = baseline.tessera_batches(cfg, 32, 2)
    for mode in baseline.ATTENTION_MODES:
        records = baseline.train(cfg, batches, 1, "cpu", None, baseline.Options(attention=mode))
        # on CPU SDPA's dispatcher takes its CPU flash kernel either way (cuDNN serves CUDA only)
        assert records[0]["attention_backend"] == "flash_attention" and records[0]["attention_mode"] == mode
    with pytest.raises(ValueError, match="attention='cudnn' is not one of best, sdpa-default"):
        baseline.train(cfg, batches, 1, "cpu", None, baseline.Options(attention="cudnn"))
