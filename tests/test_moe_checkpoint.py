"""Mixture-of-experts checkpoints reshard across expert-parallel degrees: a run saved on dp2 x ep2 (each rank
holding half of every block's experts, and the auxiliary-loss-free bias moving every step) resumes on ep4, on
one process and on pp2 x ep2 with the same losses and grad norms; a run without the bias exports to a Hugging
Face directory that transformers loads with the trained experts."""

import pytest
import torch

from helpers import resumed_full_parameters, small_config, cli_here
from tessera.launching.launch import run_ranks
from tessera.training.run import train

BASE = dict(model="qwen3-moe-debug", global_batch=8, steps=6, moe_aux_loss=0.1, moe_bias_rate=0.01)


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ckpt")
    history = train(small_config(**BASE, dp=2, ep=2, checkpoint_dir=str(root), checkpoint_every=3))
    return root, [(m["loss"], m["grad_norm"], m["moe"]) for m in history]


@pytest.mark.parametrize(
    "layout", [dict(dp=4, ep=4), dict(), dict(pp=2, dp=2, ep=2, microbatches=2)], ids=["ep4", "one", "pp2xep2"]
)
def test_an_ep2_checkpoint_resumes_on_another_expert_layout(ep_run, layout):
    root, history = ep_run
    resumed = train(small_config(**BASE, resume=str(root / "step_00000003"), **layout))
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for m, (loss, norm, moe) in zip(resumed, history[3:]):
        assert abs(m["loss"] - loss) <= 1e-5 * abs(loss), (m["loss"], loss)
        assert abs(m["grad_norm"] - norm) <= 1e-5 * abs(norm), (m["grad_norm"], norm)
        # the same routing: the bias came back with the experts
        assert m["moe"]["tokens_per_expert"] == moe["tokens_per_expert"]


def test_the_bias_is_in_the_checkpoint_and_moved(ep_run):
    root, _ = ep_run
    trained = run_ranks(_biases, 1, small_config(**BASE, resume=str(root / "step_00000006")), timeout=120)[0]
    assert set(trained) == {"layers.0.mlp.expert_bias", "layers.1.mlp.expert_bias"}
    assert all(b.abs().sum() > 0 for b in trained.values())  # six sign steps of 0.01 each


def _biases(config):
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    trainer.load(config.resume_path)
    return {n: b.detach().clone() for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")}


def test_a_biased_run_is_refused_on_export_by_name(ep_run, tmp_path):
    root, _ = ep_run
    out = cli_here("export", str(root / "step_00000006"), "--to-hf", str(tmp_path / "hf"))
    assert out.returncode != 0 and "bias_rate=0.01 has no Hugging Face Qwen3-MoE form" in out.stderr
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_an_ep2_checkpoint_exports_to_a_directory_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    base = dict(BASE, steps=2, moe_bias_rate=None)
    train(small_config(**base, dp=2, ep=2, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2))
    out = cli_here("export", str(tmp_path / "ckpt" / "step_00000002"), "--to-hf", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-2000:]
    trained = run_ranks(
        resumed_full_parameters, 1, small_config(**base, resume=str(tmp_path / "ckpt" / "step_00000002")), timeout=120
    )[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    experts = hf.model.layers[1].mlp.experts
    gate_up = torch.cat([trained["layers.1.mlp.experts.gate_proj"], trained["layers.1.mlp.experts.up_proj"]], dim=1)
    torch.testing.assert_close(experts.gate_up_proj, gate_up, rtol=0, atol=0)
    torch.testing.assert_close(experts.down_proj, trained["layers.1.mlp.experts.down_proj"], rtol=0, atol=0)
    torch.testing.assert_close(hf.model.layers[0].mlp.gate.weight, trained["layers.0.mlp.gate.weight"], rtol=0, atol=0)
