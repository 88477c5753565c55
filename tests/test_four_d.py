"""All four axes on 16 CPU ranks, resuming across 16-rank layouts: pp2 x dp2 x cp2 x tp2 (+ sequence parallel) and
pp2 x dp_replicate2 x dp_shard2 x tp2 (HSDP). Each resumes from a checkpoint the other saved, and every step's
loss and grad norm equals the one-process run's (the numerics contract; gradients by name are compared for
both layouts in test_contract.py)."""

import pytest

from conftest import PIPELINE_BASE
from helpers import small_config
from tessera.run import train

FOUR_D = dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, microbatches=2)
HSDP_4D = dict(pp=2, dp=4, dp_replicate=2, tp=2, microbatches=2)


@pytest.fixture(scope="module")
def one_process():
    return [(m["loss"], m["grad_norm"]) for m in train(small_config(**PIPELINE_BASE, steps=6))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The two 16-rank runs, 6 steps each, saving at step 3."""
    out = {}
    for name, layout, steps in (("4d", FOUR_D, 6), ("hsdp", HSDP_4D, 6)):
        root = tmp_path_factory.mktemp(name)
        history = train(small_config(**PIPELINE_BASE, **layout, steps=steps, checkpoint_dir=str(root), checkpoint_every=3))
        out[name] = (root / "step_00000003", [(m["loss"], m["grad_norm"]) for m in history])
    return out


def _assert_steps_match(case, got, want, first_step):
    assert len(got) == len(want)
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), first_step):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"{case} step {i}: loss {loss} vs one-process {ref_loss}"
        assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), f"{case} step {i}: grad norm {norm} vs one-process {ref_norm}"


def test_both_16_rank_layouts_train_like_one_process(saved, one_process):
    _assert_steps_match("pp2 x dp2 x cp2 x tp2", saved["4d"][1], one_process, 1)
    _assert_steps_match("pp2 x hsdp2x2 x tp2", saved["hsdp"][1], one_process, 1)


@pytest.mark.parametrize("source, layout", [("4d", HSDP_4D), ("hsdp", FOUR_D)], ids=["4d->hsdp", "hsdp->4d"])
def test_a_16_rank_checkpoint_resumes_on_the_other_16_rank_layout(saved, one_process, source, layout):
    path, _ = saved[source]
    resumed = train(small_config(**PIPELINE_BASE, **layout, steps=6, resume=str(path)))
    assert [m["step"] for m in resumed] == [4, 5, 6]
    _assert_steps_match(f"{source} -> {layout}", [(m["loss"], m["grad_norm"]) for m in resumed], one_process[3:], 4)
