"""build_mesh agrees with Layout.group on every axis and flattened submesh: gloo ranks and the fake backend."""


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.parallel.launch import run_ranks
from tessera.topology import AXES, FLATTENED, Layout, dry_run, mesh_group_ranks, submesh

NAMES = list(AXES) + list(FLATTENED)


def _mesh_groups(layout):
    import torch.distributed as dist

    mesh = layout.build_mesh("cpu")
    rank = dist.get_rank()
    hsdp = submesh(mesh, "dp_replicate", "dp_shard_cp")
    return rank, {n: mesh_group_ranks(mesh, n) for n in NAMES}, tuple(hsdp.shape)


@pytest.mark.parametrize(
    "layout", [Layout(pp=2, dp_shard=2, cp=2, tp=2), Layout(dp_replicate=2, dp_shard=2, tp=2), Layout(pp=3, tp=2)], ids=str
)
def test_build_mesh_on_gloo_ranks_matches_layout(layout):
    for rank, groups, hsdp_shape in run_ranks(_mesh_groups, layout.world_size, layout, timeout=60):
        for name in NAMES:
            assert groups[name] == layout.group(name, rank), (name, rank)
        assert hsdp_shape == (layout.dp_replicate, layout.dp_shard * layout.cp)


big_degree = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=6, deadline=None)
@given(st.builds(Layout, pp=big_degree, dp_replicate=big_degree, dp_shard=big_degree, cp=big_degree, tp=big_degree)
       .filter(lambda l: 1024 <= l.world_size <= 4096), st.data())
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
