"""Every family through `tessera convert --from-hf` -> `--init-from`: the file convert writes holds exactly the
model's state dict (gpt-oss and Qwen3-MoE lost their routing bias, `expert_bias`, which their Hugging Face
checkpoints do not carry, so `--init-from` refused the file: issue 65 item 1)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import cli_here
from tessera.models import get_preset
from tessera.models.hf import save_hf
from tessera.models.spec import build_model
from tessera.checkpointing.checkpoint import check_full_state_dict_file, tied_aliases
from tessera.checkpointing.safe_io import read_safetensors

PRESETS = ("debug", "qwen3-debug", "qwen3-moe-debug", "deepseek-v3-debug", "gpt-oss-debug")


@pytest.mark.parametrize("preset", PRESETS)
def test_convert_writes_every_name_init_from_reads(tmp_path, preset):
    cfg = get_preset(preset)
    model = build_model(cfg, seed=3)
    save_hf(model.state_dict(), cfg, tmp_path / "hf")
    out = cli_here("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "t.safetensors"))
    assert out.returncode == 0, out.stderr
    check_full_state_dict_file(tmp_path / "t.safetensors", cfg)  # what --init-from checks before any rank
    got = read_safetensors(tmp_path / "t.safetensors")
    aliases = tied_aliases(model)  # a tied head is written once, under the embedding's name
    for name, want in model.state_dict().items():
        assert torch.equal(got[aliases.get(name, name)], want), name  # the routing bias at its initial zeros too


def test_a_converted_gpt_oss_trains_from_init_from(tmp_path):
    cfg = get_preset("gpt-oss-debug")
    save_hf(build_model(cfg, seed=3).state_dict(), cfg, tmp_path / "hf")
    assert (
        cli_here("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "t.safetensors")).returncode == 0
    )
    run = cli_here(
        "train", "--model", "gpt-oss-debug", "--init-from", str(tmp_path / "t.safetensors"), "--steps", "1",
        "--seq-len", "32", "--global-batch", "2", "--quiet",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr


def test_a_converted_tied_head_loads_on_a_pipeline_whose_last_stage_holds_its_copy(tmp_path):
    """qwen3-debug ties its head to the embedding; convert writes it once. One process and pp2 (whose last stage
    holds the head apart from the embedding) both start from it, at the same first loss."""
    cfg = get_preset("qwen3-debug")
    save_hf(build_model(cfg, seed=3).state_dict(), cfg, tmp_path / "hf")
    assert (
        cli_here("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "t.safetensors")).returncode == 0
    )
    losses = []
    for layout in ([], ["--pp", "2", "--microbatches", "2"]):
        metrics = tmp_path / f"m{len(losses)}.jsonl"
        run = cli_here(
            "train", "--model", "qwen3-debug", "--init-from", str(tmp_path / "t.safetensors"), "--steps", "1",
            "--seq-len", "32", "--global-batch", "2", "--quiet", "--metrics", str(metrics), *layout,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        losses.append([r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
def test_export_to_hf_then_init_from_hf_restores_every_family(tmp_path, preset):
    """The other way (issue 65 item 1): what `tessera export --to-hf` writes (save_hf of the checkpoint's full
    state) passes --init-from-hf's check and loads back into the family's model equal, name by name, but for
    the routing bias a family's Hugging Face checkpoint does not carry (it starts at its zeros)."""
    from tessera.models.hf import check_hf_weights, load_hf_weights

    cfg = get_preset(preset)
    src = build_model(cfg, seed=5)
    save_hf(src.state_dict(), cfg, tmp_path / "hf")
    check_hf_weights(tmp_path / "hf", cfg)  # what --init-from-hf checks before any rank starts
    dst = build_model(cfg, seed=6)
    with torch.no_grad():
        load_hf_weights(dst, tmp_path / "hf")
    for name, want in src.state_dict().items():
        got = dst.state_dict()[name]
        assert torch.equal(got, want) or (name.endswith("expert_bias") and not got.any()), name
