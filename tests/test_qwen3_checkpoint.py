"""Qwen3's tied embedding and head through checkpoints: saved by the two pipeline ranks that each hold the
tensor (pp2 x tp2), resumed on layouts where one rank holds it (dp2, one process) with the same losses, and
exported as a Hugging Face directory that transformers loads with the trained weights."""

import pytest
import torch

from helpers import resumed_full_parameters, small_config, cli_here
from tessera.launching.launch import run_ranks
from tessera.training.run import train

BASE = dict(model="qwen3-debug", n_layers=4, global_batch=8, steps=6)


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_ckpt")
    history = train(small_config(**BASE, pp=2, tp=2, microbatches=2, checkpoint_dir=str(root), checkpoint_every=3))
    return root, [(m["loss"], m["grad_norm"]) for m in history]


@pytest.mark.parametrize("layout", [dict(dp=2), dict(), dict(pp=2, microbatches=2)], ids=["dp2", "one", "pp2"])
def test_a_tied_checkpoint_from_pp2xtp2_resumes_on_another_layout(pp_run, layout):
    root, history = pp_run
    resumed = train(small_config(**BASE, resume=str(root / "step_00000003"), **layout))
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for m, (loss, norm) in zip(resumed, history[3:]):
        assert abs(m["loss"] - loss) <= 1e-5 * abs(loss), (m["loss"], loss)
        assert abs(m["grad_norm"] - norm) <= 1e-5 * abs(norm), (m["grad_norm"], norm)


def test_the_tied_checkpoint_exports_to_a_directory_transformers_loads(pp_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, _ = pp_run
    out = cli_here("export", str(root / "step_00000006"), "--to-hf", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-2000:]
    config = small_config(**BASE, resume=str(root / "step_00000006"))
    trained = run_ranks(resumed_full_parameters, 1, config, timeout=120)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # still tied
    torch.testing.assert_close(hf.model.embed_tokens.weight, trained["embed_tokens.weight"], rtol=0, atol=0)
    torch.testing.assert_close(
        hf.model.layers[3].self_attn.q_norm.weight, trained["layers.3.self_attn.q_norm.weight"], rtol=0, atol=0
    )
