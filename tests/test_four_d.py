"""All four axes on 16 CPU ranks, resuming across 16-rank layouts: pp2 x dp2 x cp2 x tp2 (+ sequence parallel) and
pp2 x dp_replicate2 x dp_shard2 x tp2 (HSDP). Both train like one process (losses and grad norms within 1e-5
relative, gradients by name within 1e-4: the contract table's check against its 8-layer reference), save a
checkpoint after step 2, and each resumes from the other's with the one-process step 3."""

from pathlib import Path

import pytest

from conftest import PIPELINE_BASE
from helpers import small_config, train_losses_and_grads_saving
from shared_spawns import SharedSpawns
from tessera.training.run import train
from test_contract import assert_trains_like_one_process

LAYOUTS = {
    "pp2 x dp2 x cp2 x tp2 + sp": dict(pp=2, dp=2, cp=2, tp=2, sequence_parallel=True, microbatches=2),
    "pp2 x hsdp2x2 x tp2": dict(pp=2, dp=4, dp_replicate=2, tp=2, microbatches=2),
}


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """Each 16-rank layout's 3 steps (losses, grad norms, step-1 gradients), saving its checkpoint of step 2,
    trained in the session's 16-rank spawn (tests/shared_spawns.py)."""
    tmp = session.config._tmp_path_factory  # the tmp_path_factory fixture's own object (pytest's tmpdir plugin)
    rows = {}
    for name, layout in LAYOUTS.items():
        config = small_config(**PIPELINE_BASE, **layout, checkpoint_dir=str(tmp.mktemp("ckpt")))
        rows[name] = (train_losses_and_grads_saving, 16, (config, 2))
    return SharedSpawns(rows, set(rows))


@pytest.fixture(scope="module")
def saved(runs):
    """Each layout's checkpoint of step 2 and its run."""
    return {name: (Path(runs.rows[name][2][0].checkpoint.dir) / "step_00000002", runs.result(name)) for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_16_rank_layout_trains_like_one_process(saved, deep_reference, name):
    assert_trains_like_one_process(name, saved[name][1], deep_reference)


@pytest.mark.parametrize("source, target", [tuple(LAYOUTS), tuple(reversed(LAYOUTS))], ids=["4d->hsdp", "hsdp->4d"])
def test_a_16_rank_checkpoint_resumes_on_the_other_16_rank_layout(saved, deep_reference, source, target):
    resumed = train(small_config(**PIPELINE_BASE, **LAYOUTS[target], resume=str(saved[source][0])))
    assert [m["step"] for m in resumed] == [3]
    ref_losses, ref_norms, _ = deep_reference
    loss, norm = resumed[0]["loss"], resumed[0]["grad_norm"]
    assert abs(loss - ref_losses[2]) <= 1e-5 * abs(ref_losses[2]), (
        f"{source} -> {target}: loss {loss} vs {ref_losses[2]}"
    )
    assert abs(norm - ref_norms[2]) <= 1e-5 * abs(ref_norms[2]), (
        f"{source} -> {target}: grad norm {norm} vs {ref_norms[2]}"
    )
