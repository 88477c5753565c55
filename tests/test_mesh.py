"""build_mesh agrees with Layout.group on every axis and flattened submesh: gloo ranks and the fake backend."""

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.launching.launch import run_ranks
from tessera.topology import AXES, FLATTENED, Layout, dry_run, mesh_group_ranks, submesh

NAMES = list(AXES) + list(FLATTENED)


def _mesh_groups(layout):
    import torch.distributed as dist

    mesh = layout.build_mesh("cpu")
    rank = dist.get_rank()
    hsdp = submesh(mesh, "dp_replicate", "dp_shard_cp")
    return rank, {n: mesh_group_ranks(mesh, n) for n in NAMES}, tuple(hsdp.shape)


@pytest.mark.parametrize(
    "layout",
    [Layout(pp=2, dp_shard=2, cp=2, tp=2), Layout(dp_replicate=2, dp_shard=2, tp=2), Layout(pp=3, tp=2)],
    ids=str,
)
def test_build_mesh_on_gloo_ranks_matches_layout(layout):
    for rank, groups, hsdp_shape in run_ranks(_mesh_groups, layout.world_size, layout, timeout=60):
        for name in NAMES:
            assert groups[name] == layout.group(name, rank), (name, rank)
        assert hsdp_shape == (layout.dp_replicate, layout.dp_shard * layout.cp)


big_degree = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=6, deadline=None)
@given(
    st.builds(Layout, pp=big_degree, dp_replicate=big_degree, dp_shard=big_degree, cp=big_degree, tp=big_degree).filter(
        lambda lay: 1024 <= lay.world_size <= 4096
    ),
    st.data(),
)
def test_build_mesh_on_fake_backend_at_scale(layout, data):
    for _ in range(2):
        rank = data.draw(st.integers(0, layout.world_size - 1))
        with dry_run(layout, rank=rank) as mesh:
            for name in NAMES:
                assert mesh_group_ranks(mesh, name) == layout.group(name, rank), (name, rank)


def test_dry_run_4096_ranks():
    layout = Layout.infer(4096, tp=8, pp=8, cp=2, dp_replicate=2)
    with dry_run(layout, rank=4095) as mesh:
        assert mesh.shape == (8, 2, 16, 2, 8)
        assert mesh_group_ranks(mesh, "tp") == list(range(4088, 4096))


def test_build_mesh_refuses_without_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Layout(tp=2).build_mesh("cpu")


@pytest.mark.parametrize(
    "layout, on",
    [
        (Layout(), set()),
        (Layout(tp=2), {"tp"}),
        (Layout(dp_shard=2, tp=2), {"tp", "fsdp", "batch", "loss"}),
        (Layout(dp_replicate=2, dp_shard=2), {"fsdp", "batch", "loss"}),
        (Layout(pp=2, cp=2, tp=2), {"pp", "cp", "tp", "fsdp", "loss"}),
    ],
)
def test_meshes_by_purpose_are_none_when_their_axes_are_off(layout, on):
    from tessera.topology import Meshes

    with dry_run(layout, rank=layout.world_size - 1) as mesh:
        meshes = Meshes(layout, mesh=mesh)
        assert {n for n in ("tp", "pp", "cp", "fsdp", "batch", "loss") if getattr(meshes, n) is not None} == on
        if meshes.fsdp is not None:
            assert meshes.fsdp_size == layout.dp_shard * layout.cp * layout.dp_replicate
            assert meshes.fsdp.ndim == (2 if layout.dp_replicate > 1 else 1)
        if meshes.loss is not None:
            assert mesh_group_ranks(mesh, "dp_cp") == dist.get_process_group_ranks(meshes.loss.get_group())
        assert meshes.batch_index == layout.index("dp", layout.world_size - 1)


def test_every_purpose_mesh_is_declared_with_its_type():
    """Meshes sets its purpose meshes by name from topology/axes.py's table; the class declares each (for
    the type checker), so a purpose added to the table needs its declaration too."""
    from tessera.topology import Meshes

    declared = set(Meshes.__annotations__) - {"PURPOSES"}
    assert set(Meshes.PURPOSES) | {"precision", "expert_fsdp"} == declared


def test_a_mesh_of_another_layout_shape_is_refused_in_one_line():
    """Meshes (and so Trainer's `mesh`) takes a prebuilt world mesh only of the layout's own shape."""
    from tessera.topology import Meshes

    with dry_run(Layout(dp_shard=2, tp=2)) as mesh:
        with pytest.raises(ValueError, match=r"is not the mesh of layout .*build it with layout\.build_mesh") as err:
            Meshes(Layout(dp_shard=4), mesh=mesh)
        assert "\n" not in str(err.value)
        with pytest.raises(ValueError, match=r"is a cpu mesh and the run computes on cuda; .*build_mesh\('cuda'\)"):
            Meshes(Layout(dp_shard=2, tp=2), "cuda", mesh=mesh)
        assert Meshes(Layout(dp_shard=2, tp=2), mesh=mesh).tp is not None  # its own shape is taken


def _trainers_on_one_mesh(steps: int):
    """Losses and grad norms of a dp2 x tp2 config trained by its own Trainer, then by two Trainers one after
    the other on one shared world mesh (the second a fresh model on the groups the first used)."""
    import torch

    from helpers import small_config
    from tessera.trainer import Trainer

    config = small_config(dp=2, tp=2, sequence_parallel=True, steps=steps)

    def run(trainer):
        return [(r["loss"], r["grad_norm"]) for r in (trainer.train_step().record() for _ in range(steps))]

    alone = run(Trainer(config, torch.device("cpu")))
    mesh = config.layout.build_mesh("cpu")
    shared = [run(Trainer(config, torch.device("cpu"), mesh=mesh)) for _ in range(2)]
    return alone, shared


def test_trainers_sharing_one_world_mesh_train_bitwise_like_a_trainer_on_its_own():
    for alone, shared in run_ranks(_trainers_on_one_mesh, 4, 2, timeout=120):
        assert shared == [alone, alone]
