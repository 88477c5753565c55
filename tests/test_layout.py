import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.topology import AXES, FLATTENED, Layout

degree = st.sampled_from([1, 1, 2, 3, 4])
layouts = st.builds(Layout, pp=degree, dp_replicate=degree, dp_shard=degree, cp=degree, tp=degree)
ALL_AXES = list(AXES) + list(FLATTENED)


def test_contract_names():
    assert Layout.AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    layout = Layout(pp=2, dp_shard=2, cp=2, tp=2)
    assert layout.shape == (2, 1, 2, 2, 2) and layout.world_size == 16
    assert Layout.infer(16, tp=2, pp=2, cp=2) == layout


@given(layouts)
def test_coords_and_rank_of_are_inverse_bijections(layout):
    seen = set()
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert list(c) == list(AXES)
        assert layout.rank_of(c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == layout.world_size  # injective onto the full coordinate box
    assert all(all(0 <= v < s for v, s in zip(c, layout.shape)) for c in seen)


@given(layouts, st.sampled_from(ALL_AXES), st.data())
def test_groups_have_the_degree_contain_the_rank_and_partition(layout, axis, data):
    r = data.draw(st.integers(0, layout.world_size - 1))
    g = layout.group(axis, r)
    assert len(g) == layout.degree(axis) and r in g
    members = sorted(x for grp in layout.groups(axis) for x in grp)
    assert members == list(range(layout.world_size))
    for other in g:  # a group is the same group from each of its members
        assert layout.group(axis, other) == g
    assert g[layout.index(axis, r)] == r
    fixed = [a for a in AXES if a not in layout._axes_of(axis)]
    for other in g:  # members differ only along the axis
        assert all(layout.coords(other)[a] == layout.coords(r)[a] for a in fixed)


@given(layouts, st.data())
def test_tp_groups_are_consecutive_ranks(layout, data):
    r = data.draw(st.integers(0, layout.world_size - 1))
    g = layout.group("tp", r)
    assert g == list(range(g[0], g[0] + layout.tp)) and g[0] % layout.tp == 0


@given(st.integers(1, 4096), st.sampled_from(AXES), st.integers(1, 64))
@settings(max_examples=200)
def test_infer_gives_the_rest_to_dp_shard_or_explains(world, axis, d):
    if world % d == 0:
        layout = Layout.infer(world, **{axis: d})
        assert layout.world_size == world and getattr(layout, axis) == d
    else:
        with pytest.raises(ValueError, match=f"{axis}={d}"):
            Layout.infer(world, **{axis: d})


def test_infer_error_names_numbers_and_alternative():
    with pytest.raises(ValueError, match=r"16 ranks cannot hold tp=3: tp must divide 16; try tp=2 or tp=4"):
        Layout.infer(16, tp=3)
    with pytest.raises(ValueError, match=r"12 ranks cannot hold tp=4 x cp=6 = 24 ranks: 24 does not divide 12"):
        Layout.infer(12, tp=4, cp=6)
    with pytest.raises(ValueError, match=r"must multiply to 16"):
        Layout.infer(16, tp=2, dp_shard=4, dp_replicate=1)
    assert Layout.infer(16, tp=2, dp_shard=4) == Layout(dp_replicate=2, dp_shard=4, tp=2)
    with pytest.raises(ValueError, match=r"unknown axis 'dp'"):
        Layout.infer(16, dp=2)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True, None])
def test_bad_degrees_are_rejected_with_the_value(bad):
    with pytest.raises(ValueError, match="tp="):
        Layout(tp=bad)
    with pytest.raises(ValueError, match="world_size="):
        Layout.infer(bad)


def test_world_size_mismatch_names_both_numbers():
    with pytest.raises(ValueError, match=r"uses 8 ranks but WORLD_SIZE is 6"):
        Layout(dp_shard=2, tp=4).check_world_size(6)


def test_tp_spanning_nodes_warns():
    with pytest.warns(UserWarning, match="tp=16 groups span nodes of 8 GPUs"):
        Layout(tp=16).check_nodes(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Layout(tp=8, dp_shard=4).check_nodes(8)


def test_flattened_groups_match_their_axes():
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert layout.group("dp_shard_cp", 0) == [0, 2, 4, 6]
    assert layout.group("dp", 0) == [0, 4, 8, 12]
    assert layout.group("dp_cp", 0) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert math.prod(layout.shape) == 32
