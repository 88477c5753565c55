"""--fault-tolerant's pure parts, without ranks: the recovery's wire format (nothing read executes code), a
replica group's rows and config, and the planner's and tessera memory's account of it."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import cli_here
from tessera.config import Config
from tessera.models import get_preset
from tessera.data.corpus import TokenStream
from tessera.models.spec import shape_of
from tessera.parallel.fault_tolerance import ReplicaRows
from tessera.topology import Layout
from tessera.topology.estimators.plan_inputs import Candidate, Hardware
from tessera.topology.estimators.step_estimate import estimate

torchft = pytest.importorskip("torchft")  # the transport subclasses torchft's CheckpointTransport

leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=8),
    st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=5).map(lambda xs: torch.tensor(xs)),
)  # fmt: skip
states = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.one_of(st.text(max_size=5), st.integers(0, 9)), inner, max_size=3)
    ),
    max_leaves=12,
)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


@settings(max_examples=80, deadline=None)
@given(states)
def test_the_recovery_wire_carries_any_state_back_as_it_went(state):
    from tessera.parallel.replica_transport import decode, encode, state_bytes

    assert same(decode(encode(state)), state)
    assert state_bytes(state) >= 0


def test_the_recovery_wire_reads_no_pickle_and_refuses_objects():
    from tessera.parallel.replica_transport import encode

    with pytest.raises(TypeError, match="cannot be sent"):
        encode({"fn": object()})
    payload = encode({"w": torch.ones(2), "step": 3})
    assert b"\x80\x04" not in payload[:64]  # no pickle protocol header: JSON text, then safetensors
    tree = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])
    assert tree == {"__dict__": [["w", {"__tensor__": "0"}], ["step", 3]]}


def test_a_replica_group_reads_its_rows_of_the_whole_batch_and_its_config_halves_the_layout():
    from tessera.training.replicas import group_config

    whole = TokenStream(16, 8)
    inputs, _ = TokenStream(16, 8).next_global_batch()
    for r in range(2):
        mine = ReplicaRows(TokenStream(16, 8), r, 2).next_global_batch()
        assert torch.equal(mine[0], inputs[r * 4 : (r + 1) * 4])
    assert ReplicaRows(whole, 0, 2).state_dict() == whole.state_dict()
    config = Config.create(model="debug", dp=4, dp_replicate=2, global_batch=8, fault_tolerant=True)
    group = group_config(config)
    assert (group.layout.world_size, group.layout.dp_replicate, group.data.global_batch) == (2, 1, 4)
    assert group.ft.ft_replica_groups == 2 and group_config(group) is group


def test_the_planner_exposes_the_replicate_all_reduce_and_counts_its_buffer():
    cfg = shape_of(get_preset("8b"))
    cand = Candidate(Layout(dp_replicate=8, dp_shard=8), "FULL_SHARD", "full", "1f1b", 1)
    hsdp, ft = (
        estimate(cfg, cand, Hardware.from_profile("h100-sxm-80gb", 64, fault_tolerant=on), 8192, 64)
        for on in (False, True)
    )
    assert "replicas" not in hsdp.time and ft.time["replicas"] > 0.1  # 4 GB of shards over 8 nodes, in series
    assert ft.time["step"] > hsdp.time["step"]
    assert ft.memory["buffers"] - hsdp.memory["buffers"] == pytest.approx(8 * 8e9 / 8, rel=0.05)


def test_memory_and_plan_say_what_fault_tolerance_adds():
    text = cli_here("memory", "--params", "8e9", "--dp", "8", "--fault-tolerant").stdout
    assert "--fault-tolerant, per rank (FULL_SHARD's shard): 8.00 GB of GPU" in text and "24.00 GB of host" in text
    out = cli_here(
        "plan", "--model", "8b", "--gpus", "64", "--seq-len", "8192", "--global-batch", "64", "--layout", "dpr8xdp8",
        "--top", "0", "--fault-tolerant", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["layout"]["estimate"]["split_s"]["replicas"] > 0.1


def test_a_missing_torchft_and_a_replica_count_that_does_not_divide_are_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` now fails as it does without the extra
    out = cli_here("train", "--model", "debug", "--steps", "1", "--dp", "2", "--dp-replicate", "2", "--fault-tolerant")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "--fault-tolerant needs torchft, which is not installed: pip install -e '.[ft]'" in lines[0]
    monkeypatch.delitem(sys.modules, "torchft")
    out = cli_here("train", "--model", "debug", "--steps", "1", "--dp", "2", "--dp-replicate", "3", "--fault-tolerant")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "dp_replicate" in lines[0].replace("-", "_"), out.stderr


class _Result:
    """A torchft quorum result, as the lighthouse hands it to one member."""

    def __init__(self, quorum_id, members, store, heal=False, send=()):
        self.quorum_id, self.replica_ids, self.store_address = quorum_id, list(members), store
        self.heal, self.recover_dst_replica_ranks = heal, list(send)


class _Client:
    def __init__(self):
        self.next = None

    def _quorum(self, **kwargs):
        return self.next


class _Manager:
    def __init__(self):
        self._client, self._quorum_id = _Client(), 7


def test_a_restarted_lighthouses_reused_quorum_id_gets_fresh_keys_and_every_member_reconfigures():
    """The drill's failure, replayed: the old lighthouse's quorum 2 held A and B; the restarted one gave A alone
    quorum 1 (A stepped), then A and B quorum 2 again, B behind. Both must reconfigure, onto one address that no
    earlier configuration used; a repeated quorum reconfigures nobody."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from tessera.parallel.quorum_ids import FreshQuorums

    primary = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = f"127.0.0.1:{primary.port}"
    a, b = _Manager(), _Manager()
    fa, fb = (FreshQuorums(m, 0, timedelta(seconds=5)) for m in (a, b))

    def ask(fresh, manager, result):
        """(the store address torchft is handed, whether it was told to reconfigure)"""
        manager._quorum_id = result.quorum_id  # the id torchft would compare with (it reconfigures on -1)
        before = fresh.reconfigured
        fresh._client.next = result
        got = fresh._quorum()
        assert (manager._quorum_id == -1) == (fresh.reconfigured > before)
        return got.store_address, fresh.reconfigured > before

    used = set()
    first, changed = ask(fa, a, _Result(1, ["A"], store))
    assert changed
    used.add(first)
    old_a, _ = ask(fa, a, _Result(2, ["A", "B"], store, send=[1]))
    old_b, _ = ask(fb, b, _Result(2, ["A", "B"], store, heal=True))
    assert old_a == old_b and old_a not in used
    used.add(old_a)
    assert ask(fa, a, _Result(2, ["A", "B"], store)) == (old_a, False)  # the same quorum: nothing to configure
    assert ask(fb, b, _Result(2, ["A", "B"], store)) == (old_b, False)
    # the lighthouse restarted: its ids from 1 again
    solo, changed = ask(fa, a, _Result(1, ["A"], store))
    assert changed and solo not in used
    used.add(solo)
    new_a, changed_a = ask(fa, a, _Result(2, ["A", "B"], store, send=[1]))
    new_b, changed_b = ask(fb, b, _Result(2, ["A", "B"], store, heal=True))  # B's id unchanged: it must heal
    assert changed_a and changed_b and new_a == new_b and new_a not in used
