"""A layout trained on a simulated world (torch's LocalTensorMode: every rank's shard in one process, each
collective computed for all ranks at once; runtime/training/simulated.py) equals one process: each step's loss,
grad norm and every gradient by name, at the fp32 contract's 1e-5. Each run is a fresh interpreter: a simulated
world needs a process with no process group of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch  # noqa: E402

pytest.importorskip("torch.distributed._local_tensor", reason="a simulated world needs torch's LocalTensorMode")
# checked on torch 2.13 (the GPU machines' 2.11 may carry an earlier LocalTensorMode: not run there until checked)
pytestmark = pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13), reason="simulated worlds checked on torch 2.13"
)

CHILD = """
import json, sys
from tessera.config import Config
from tessera.testing.equivalence import compare_runs
from tessera.training.simulated import tp_vocab, trace
kw = json.loads(sys.argv[1])
probe = Config.create(model="debug", quiet=True, **kw)
both = {"vocab_size": tp_vocab(258, probe.layout.tp), **(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})}
common = dict(model="debug", seq_len=32, global_batch=2 * probe.layout.dp, steps=2, lr=3e-3, warmup=1, device="cpu",
              mixed_precision="fp32", quiet=True, **both)
one = trace(Config.create(**common), 1)
world = trace(Config.create(**common, **kw), probe.layout.world_size)
compare_runs(one, world, "simulated", 1e-5)
print(json.dumps({"one": one["grad_norms"], "world": world["grad_norms"], "losses": world["losses"],
                  "grads": len(world["grads"][0])}))
"""


def simulate(both: dict | None = None, **kw) -> dict:
    """The layout `kw` on its simulated ranks against one process, both with the options `both`."""
    argv = [json.dumps(kw), *([json.dumps(both)] if both else [])]
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_norms_equal(got: dict) -> None:
    for a, b in zip(got["world"], got["one"]):
        assert abs(a - b) <= 1e-5 * abs(b), got
    assert len(got["losses"]) == 2 and got["grads"] == 21


def test_fsdp2_over_tp_with_sequence_parallel_on_four_simulated_ranks_equals_one_process():
    assert_norms_equal(simulate(dp=2, tp=2, sequence_parallel=True))


def test_uneven_fsdp2_shards_on_simulated_ranks_equal_one_process():
    """dp 3: FSDP2 pads every tensor whose rows 3 does not divide (the norms' and dim-wide rows, 64: shards of
    22, 22 and 20), and each simulated rank holds its own shard (runtime/training/simulated_shards.py)."""
    from tessera.models import get_preset
    from tessera.topology import Layout
    from tessera.training.simulated import uneven_shards

    assert "64 x 64" in uneven_shards(get_preset("debug"), Layout(dp_shard=3))
    assert_norms_equal(simulate(dp=3))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw, both",
    [
        (dict(dp=24), {"optimizer": "muon"}),  # empty shards (rows 32 over 24 ranks: the last ones hold none)
        (dict(dp=6, dp_replicate=2), None),  # HSDP, shards of 3
        (dict(dp=3, pp=2, microbatches=2), None),
    ],
    ids=["dp24-muon-empty", "hsdp-3", "pp2xdp3"],
)
def test_uneven_and_empty_shards_at_scale_equal_one_process(kw, both):
    """Shapes no degree divides: FSDP2's padded and empty shards (Muon's owner gathers the uneven pieces whole),
    HSDP's replicas, a pipeline (FSDP2 over tp's uneven vocabulary shards: the fast dp2 x tp2 + SP test)."""
    assert_norms_equal(simulate(both, **kw))


def check(*argv: str) -> dict:
    """`tessera check ... --json`'s record (the contract's judge: every step's loss and grad norm, step 1's
    gradients by name; later steps' gradients recorded, AdamW's first update amplifying reassociation)."""
    out = subprocess.run(
        [sys.executable, "-m", "tessera", "check", *argv, "--json"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_the_cp_ring_and_expert_parallel_on_simulated_ranks_equal_one_process():
    """cp 2 and ep 4 inside FSDP2 over tp 2 with sequence parallel (8 ranks): the ring's K/V and dK/dV passes,
    sends LocalTensorMode does not take, run as every rank's ring steps (parallel/context_simulated.py), and
    the experts' all-to-all of uneven splits as padded equal ones (parallel/expert_simulated.py), on the MoE
    debug model an ep layout takes unless one is named."""
    record = check("--layout", "dp2xcp2xtp2xep4+sp")
    assert record["verdict"].startswith("equal to one process: dp2xcp2xtp2xep4+sp on 8 simulated ranks")
    assert record["shape"]["n_experts"] == 8 and "8 experts (top 2)" in record["verdict"]
    for a, b in zip(record["grad_norms"], record["one_process_grad_norms"]):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise"])  # rowwise: the same path with torchao's other recipe
def test_a_layout_in_fp8_is_held_to_the_fp8_contract(recipe):
    """--fp8: both sides in FP8 (torchao's float8 emulated), the layout within 2 E of one-process FP8, E one
    process's own FP8 error (its runs on 1, 2 and 4 microbatches against fp32), the records saying FP8."""
    pytest.importorskip("torchao")
    record = check("--layout", "dp2xtp2+sp", "--fp8", recipe)
    assert record["verdict"].startswith(f"equal to one process: dp2xtp2+sp on 4 simulated ranks in FP8 ({recipe})")
    assert set(record["compute_dtypes"]) == {"float8_emulated"}
    assert 0 < record["fp8_error"]["loss"] and 0 < record["fp8_error"]["grad norm"]
    for a, b in zip(record["losses"], record["one_process_losses"]):
        assert abs(a - b) <= 2 * record["fp8_error"]["loss"]


def test_an_unknown_fp8_recipe_is_refused_before_anything_is_built():
    from tessera.testing import prove_layout

    with pytest.raises(ValueError, match="fp8='nope' is not an FP8 recipe: use one of tensorwise, rowwise"):
        prove_layout("dp2", fp8="nope")


@pytest.mark.slow
@pytest.mark.parametrize("layout, fsdp", [("dp4", "NO_SHARD"), ("dpr2xdp2", "HYBRID_SHARD"), ("dp4+zero2", None)])
def test_every_fsdp2_strategy_on_simulated_ranks_equals_one_process(layout, fsdp):
    """FSDP2's strategies as tessera train's --fsdp takes them: DDP-like NO_SHARD, HSDP, SHARD_GRAD_OP."""
    record = check("--layout", layout, *(["--fsdp", fsdp] if fsdp else []))
    assert record["verdict"].startswith(f"equal to one process: {layout} on 4 simulated ranks"), record["verdict"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp8", "dp16xep16"])
def test_the_cp_ring_and_expert_parallel_at_scale_equal_one_process(layout):
    """The cp ring at 8 (torchtitan's 256k layout) and ep 16 (Megatron-Bridge's Qwen3-30B-A3B layout, its
    experts raised to 16 so each rank holds one)."""
    assert check("--layout", layout)["verdict"].startswith(f"equal to one process: {layout} on ")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2xcp4", "cp4xtp2+sp"])
def test_all_gather_context_parallel_on_simulated_ranks_equals_one_process(layout):
    """cp_method=allgather: each simulated rank attends over its group's gathered K/V by its own blocks, and
    its dK/dV is every member's share of it summed (context_simulated.py); with tp + SP too."""
    record = check("--layout", layout, "--cp-method", "allgather")
    assert record["cp_method"] == "allgather"
    assert record["verdict"].startswith(f"equal to one process: {layout} on 8 simulated ranks"), record["verdict"]


@pytest.mark.slow
def test_an_all_gather_bug_only_a_rank_past_the_first_shows_is_caught_by_name():
    """A planted bug: every rank attends with position 0's blocks (its own chunks' place ignored). The
    simulated world runs each rank's own blocks, so the first wrong gradient is named."""
    child = (
        "import tessera.parallel.context_allgather as a\n"
        "from tessera.testing.equivalence import LayoutsDiverge\n"
        "from tessera.testing.simulated_world import prove_layout\n"
        "honest = a._rank_forward\n"
        "a._rank_forward = lambda q, k, v, rank, size, *rest: honest(q, k, v, 0, size, *rest)\n"
        "try:\n"
        "    prove_layout('dp2xcp2', cp_method='allgather', steps=1)\n"
        "    print('not caught')\n"
        "except LayoutsDiverge as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 1: gradient of parameter" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw", [dict(dp=8, dp_replicate=2), dict(dp=16, tp=4, sequence_parallel=True)], ids=["hsdp-8", "dp16xtp4-64"]
)
def test_larger_simulated_worlds_equal_one_process(kw):
    """HSDP on 8 ranks, and 64 ranks of FSDP2 over tp 4 with sequence parallel (about 30 s here)."""
    assert_norms_equal(simulate(**kw))


def test_a_bug_only_a_world_of_eight_shows_is_caught_by_name():
    """A planted bug: the rows of data rank 7 read as rank 3's (a batch index taken modulo 4). Every real-rank
    test up to dp 4 reads the right rows; the simulated dp 8 world names the first differing gradient."""
    child = CHILD.replace(
        "kw = json.loads(sys.argv[1])",
        "import tessera.data.batches as b\n"
        "real = b.rank_rows\n"
        "b.rank_rows = lambda batch, layout, i, c: real(batch, layout, i % 4, c)\n"
        "kw = json.loads(sys.argv[1])",
    )
    out = subprocess.run(
        [sys.executable, "-c", child, json.dumps({"dp": 8})], capture_output=True, text=True, timeout=600
    )
    assert out.returncode != 0 and "LayoutsDiverge" in out.stderr, out.stderr[-2000:]
    assert "simulated, step 1: gradient of parameter" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(cp=2, pack_documents=True), "pack_documents=True with cp=2: packed documents under cp are not"),
        (dict(dp=2, tp=2, vocab_size=259), "vocab_size=259 splits unevenly over tp=2, and FSDP2 shards those rows"),
    ],
)
def test_what_a_simulated_world_cannot_run_is_refused_by_name_before_anything_is_built(kw, message):
    from tessera.config import Config
    from tessera.training.simulated import check_simulated

    config = Config.create(model="debug", quiet=True, global_batch=8, **kw)
    with pytest.raises(ValueError, match=message):
        check_simulated(config, config.layout.world_size)
    with pytest.raises(ValueError, match="is not the world of"):
        check_simulated(config, 3)


# ----------------------------------------------------------------------------- tessera check, the user's command
def test_tessera_check_proves_a_layout_and_its_record_says_what_was_measured():
    """The command a user runs: one verdict, and with --json the record behind it (both runs' figures, the
    model it sized, the seconds and the process's peak memory beside the estimate it was admitted by)."""
    out = subprocess.run(
        [sys.executable, "-m", "tessera", "check", "--layout", "dp2xtp2+sp", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout)
    assert record["verdict"].startswith("equal to one process: dp2xtp2+sp on 4 simulated ranks, 2 steps")
    assert record["world"] == 4 and record["shape"]["dim"] == 64 and record["shape"]["vocab_size"] == 258
    # the debug model's own vocabulary: 129 rows a tp rank, which FSDP2's two ranks shard unevenly (65 and 64)
    assert "129 x 64" in record["uneven_shards"] and "uneven shards" in record["verdict"]
    for a, b in zip(record["grad_norms"], record["one_process_grad_norms"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert record["gradient_error_by_step"][0] <= 1e-5
    # measured, not configured: the process's memory before and at its peak, beside the admission estimate (its
    # accuracy is the bench's to measure: the allocator's growth under a loaded suite is not the run's)
    assert 0 < record["rss_before_bytes"] < record["peak_rss_bytes"] and record["estimated_bytes"] > 0


def _one_error(capsys, *argv: str) -> str:
    from tessera.cli import main

    code = main(["check", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert err.startswith("tessera check: error: ")
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layout", "dp4", "--world", "8"], "--world 8 is not the world of --layout dp4 (4 ranks)"),
        (["--layout", "dp2", "--schedule", "zbv"], "a pipeline option needs a pp layout"),
        (
            ["--layout", "dp2", "--cp-method", "allgather"],
            "--cp-method allgather with --layout dp2: it needs a cp layout",
        ),
        (["--layout", "dp2+zero2", "--fsdp", "NO_SHARD"], "whose +zero2 is SHARD_GRAD_OP: name one of them"),
        (["--layout", "dp2", "--fsdp", "BOGUS"], "unknown FSDP strategy 'BOGUS'"),
        # a preset named is taken as it is: 4 stages need 4 layers
        (["--layout", "pp4", "--model", "qwen3-debug"], "4 pipeline stages (pp x virtual) but only 2 layers"),
        (["--layout", "dp2xep2", "--model", "debug"], "--ep 2 needs a mixture-of-experts model"),
        (["--layout", "dp8+compile"], "+compile: torch.compile is not traced under LocalTensorMode"),
        (["--layout", "dp8", "--steps", "0"], "--steps 0 must be 1..20"),
        (["--layout", "dp8", "--seq-len", "100000"], "--seq-len 100000 must be 1..2048"),
        (["--layout", "dp2xtp2", "--model", "8b"], "GB here (every rank's shards"),
        (["--layout", "dp8", "--global-batch", "1000000000"], "lower --global-batch 1000000000"),
        (["--layout", "xx"], "layout 'xx'"),
    ],
)
def test_tessera_check_refuses_what_it_cannot_prove_in_one_line(capsys, argv, message):
    assert message in _one_error(capsys, *argv)


def test_a_world_too_large_whose_batch_and_sequence_are_already_the_least_names_the_memory_it_needs(capsys):
    from tessera.training.simulated import available_bytes

    if available_bytes() > 45e9:  # admitted there: it would run (for hours), not refuse
        pytest.skip("this machine has the memory for the 4,096-rank layout")
    said = _one_error(capsys, "--layout", "pp16xdp16xtp16", "--world", "4096")
    assert "on 4096 simulated ranks needs about" in said and "GB here" in said, said
    assert "--global-batch 256 and --seq-len 32 are the least this layout's proof runs: it needs a machine" in said
    assert "lower" not in said  # no fix that would not lower the estimate


LAYOUTS = st.builds(
    dict,
    pp=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 3, 4, 8]),
    dp_shard=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
    dp_replicate=st.sampled_from([1, 2]),
)


@given(LAYOUTS)
@settings(max_examples=60, deadline=None)
def test_the_sized_model_is_the_debug_model_where_tp_divides_it_and_else_the_smallest_that_tp_splits(degrees):
    """sized_model (pure): the heads and widths split over tp, the layers over the pp stages; the debug model's
    widths where tp already splits them, whatever the FSDP ranks (their uneven shards run as FSDP2 pads them)."""
    from tessera.models import get_preset
    from tessera.topology import Layout
    from tessera.topology.shapes import check_tensor_parallel
    from tessera.training.simulated import pipeline_layers, sized_model

    layout = Layout(**degrees)
    base = get_preset("debug")
    cfg = sized_model(base, layout)
    check_tensor_parallel(cfg, layout.tp)
    assert cfg.n_heads // cfg.n_kv_heads == base.n_heads // base.n_kv_heads
    assert cfg.vocab_size % layout.tp == 0 and cfg.vocab_size - layout.tp < base.vocab_size <= cfg.vocab_size
    assert cfg.n_layers == pipeline_layers(base.n_layers, layout.pp)  # a layer or more per stage, evenly
    try:
        check_tensor_parallel(base, layout.tp)
        fits = True
    except ValueError:
        fits = False
    assert (cfg.dim, cfg.ffn_dim) == (base.dim, base.ffn_dim) if fits else cfg.dim > base.dim


MOE_LAYOUTS = st.fixed_dictionaries(
    dict(
        pp=st.sampled_from([1, 2, 4, 8]),
        tp=st.sampled_from([1, 2, 4]),
        dp_shard=st.sampled_from([1, 2, 4, 8, 16, 32]),
        ep=st.sampled_from([2, 4, 8, 16, 32]),
    )
).filter(lambda d: d["dp_shard"] % d["ep"] == 0)


@given(MOE_LAYOUTS)
@settings(max_examples=60, deadline=None)
def test_the_sized_moe_model_has_the_fewest_experts_ep_splits(degrees):
    """sized_moe_model (pure): experts the fewest multiple of ep at or above the base's (one or more per ep
    rank), the layers over the pp stages, the rest the base's whatever the FSDP ranks."""
    from tessera.models import get_preset
    from tessera.topology import Layout
    from tessera.training.simulated import pipeline_layers, sized_moe_model

    layout = Layout(**degrees)
    base = get_preset("qwen3-moe-debug")
    cfg = sized_moe_model(base, layout)
    assert cfg.n_experts % layout.ep == 0 and cfg.n_experts >= max(base.n_experts, layout.ep)
    assert cfg.n_experts - layout.ep < max(base.n_experts, layout.ep)  # no smaller multiple of ep would do
    assert cfg.n_layers == pipeline_layers(base.n_layers, layout.pp)
    assert (cfg.dim, cfg.moe_ffn_dim) == (base.dim, base.moe_ffn_dim) and cfg.vocab_size % layout.tp == 0


@given(cp=st.sampled_from([1, 2, 3, 4, 8, 16]), tp=st.sampled_from([1, 2, 4, 8]), sp=st.booleans())
def test_the_default_sequence_is_the_least_from_32_the_layout_splits(cp, tp, sp):
    """least_seq_len (pure) against parallel/zigzag.py's own check: it passes, and no shorter sequence of at
    least 32 tokens does."""
    from tessera.parallel.zigzag import check_context
    from tessera.testing.simulated_world import least_seq_len

    seq = least_seq_len(cp, tp, sp)
    assert seq >= 32
    check_context(seq, cp, tp=tp, sequence_parallel=sp)
    for shorter in range(32, seq):
        with pytest.raises(ValueError):
            check_context(shorter, cp, tp=tp, sequence_parallel=sp)


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 8), rounds=st.integers(1, 3), extra=st.integers(0, 7), virtual=st.sampled_from([1, 2, 4]))
def test_the_admission_estimate_holds_what_each_schedule_holds_at_its_peak(pp, rounds, extra, virtual):
    """The estimate's activations follow the schedule's own peak of forwards held (the admission estimate took
    min(m, pp) microbatches for every kind, half of what GPipe holds at m = 2 pp). Against definitions written
    from the kinds' orders: 1F1B holds min(m, pp) microbatches on rank 0, GPipe and looped BFS all m, zb-h1
    1F1B's; interleaved 1F1B never fewer than 1F1B at the same m; and the estimate grows with what is held."""
    from types import SimpleNamespace

    from tessera.models.llama import PRESETS
    from tessera.training.simulated import estimate_bytes, held_microbatches

    m = pp * rounds + (0 if virtual > 1 else extra)  # interleaved kinds run rounds of pp
    assert held_microbatches("1f1b", pp, m) == min(m, pp)
    assert held_microbatches("zb-h1", pp, m) == min(m, pp)
    assert held_microbatches("gpipe", pp, m) == m
    assert held_microbatches("looped-bfs", pp, m, virtual) == m
    assert held_microbatches("interleaved-1f1b", pp, m, virtual) >= min(m, pp)
    layout = SimpleNamespace(pp=pp, tp=1, cp=1, dp_replicate=1, dp_shard=1, world_size=pp)
    cfg = PRESETS["debug"]
    by_kind = {k: estimate_bytes(cfg, layout, 32, m, m, k) for k in ("1f1b", "gpipe")}
    assert (by_kind["gpipe"] > by_kind["1f1b"]) == (m > pp)


def test_a_torch_before_2_13_is_refused_naming_the_version_needed(monkeypatch):
    from tessera.training.simulated import require_local_tensor

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    with pytest.raises(ValueError, match=r"needs torch 2.13 or later .* this torch is 2.11.0\+cu128"):
        require_local_tensor()


# planted bugs that real ranks (at most 16 here, every FSDP degree a power of two) never show: each passes the
# simulated world at a size the real-rank tests run and fails it, by name, at the size where it bites
PLANTED = {
    # a shard's tile index kept in 4 bits: shards 16 and up initialize shard (index mod 16)'s region (planted in the
    # tensors whose rows 16 and 32 ranks split evenly, where offset / size is the shard's index)
    "init-index-wraps-at-16": (
        "import tessera.models.init as m\n"
        "real = m._init_shard\n"
        "def wrapped(name, shape, local, offset, size, std, seed, **tiles):\n"
        "    if size[0] and shape[0] % 32 == 0 and offset[0] // size[0] >= 16:\n"
        "        offset = (offset[0] - 16 * size[0], *offset[1:])\n"
        "    real(name, shape, local, offset, size, std, seed, **tiles)\n"
        "m._init_shard = wrapped\n"
    ),
    # a rank's second zigzag chunk (2 cp - 1 - rank) kept in 3 bits: from cp 8 (16 chunks) on, rank i reads
    # chunk 7 - i twice instead of chunk 15 - i, and its tokens no longer sit where their positions say
    "zigzag-chunk-wraps-at-8": (
        "import torch\n"
        "import tessera.data.batches as b\n"
        "def shard(x, dim, rank, size):\n"
        "    chunks = x.chunk(2 * size, dim=dim)\n"
        "    return torch.cat([chunks[rank], chunks[(2 * size - 1 - rank) % 8]], dim=dim)\n"
        "b.zigzag_shard = shard\n"
    ),
    # the loss scale that undoes FSDP2's averaging rounded to a power of two
    "grad-scale-a-power-of-two": (
        "import math\n"
        "from tessera.topology.mesh import Meshes\n"
        "real = Meshes.fsdp_size.fget\n"
        "Meshes.fsdp_size = property(lambda self: 2 ** int(math.log2(real(self))))\n"
    ),
}
PLANTED_CHILD = """
import json, sys
{plant}
from tessera.testing import LayoutsDiverge, prove_layout
def proved(layout):
    try:
        return {{"equal": True, "verdict": prove_layout(layout)["verdict"]}}
    except LayoutsDiverge as e:
        return {{"equal": False, "verdict": str(e)}}
print(json.dumps([proved(layout) for layout in sys.argv[1:]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "bug, passes, fails, named",
    [
        ("init-index-wraps-at-16", "dp16", "dp32", "step 1: gradient of parameter"),
        ("grad-scale-a-power-of-two", "dp8", "dp24", "step 1: gradient of parameter"),
        ("zigzag-chunk-wraps-at-8", "dp2xcp4", "cp8", "step 1: gradient of parameter"),
    ],
)
def test_a_planted_bug_passes_at_the_real_ranks_size_and_is_caught_by_name_at_scale(bug, passes, fails, named):
    child = PLANTED_CHILD.format(plant=PLANTED[bug])
    out = subprocess.run(
        [sys.executable, "-c", child, passes, fails], capture_output=True, text=True, timeout=600
    )  # both worlds in one interpreter: a simulated run leaves no process group behind
    assert out.returncode == 0, out.stderr[-3000:]
    small, large = json.loads(out.stdout.strip().splitlines()[-1])
    assert small["equal"], small
    assert not large["equal"] and named in large["verdict"], large


SAME_COORDINATES = """
import gc, json, weakref
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from tessera.training.simulated import mesh_coordinates_once, mesh_groups_once
SHAPES = ((8,), (2, 4), (2, 2, 2))
KEPT = []  # every mesh alive to the end: torch's own cache (the reference) keys coordinates by id(mesh), and a
# freed mesh's id handed to the next mesh gave the reference its coordinates once under load (pytorch/pytorch#184526)
def coordinates():
    meshes = [init_device_mesh("cpu", s) for s in SHAPES]
    KEPT.extend(meshes)
    groups = {str(s): [dist.get_process_group_ranks(m.get_group(d)) for d in range(len(s))]
              for s, m in zip(SHAPES, meshes)}
    return {str(s): [c.node._local_ints for c in m.get_coordinate()] for s, m in zip(SHAPES, meshes)}, groups
dist.init_process_group("fake", rank=0, world_size=8)
with LocalTensorMode(8):
    plain = coordinates()
with mesh_coordinates_once(), mesh_groups_once(), LocalTensorMode(8):  # as trace enters them
    fast = coordinates()
    m = init_device_mesh("cpu", (4, 2))
    m.get_coordinate()
    gone = weakref.ref(m)
    del m
    gc.collect()
    held = gone() is not None
print(json.dumps({"same": plain == fast, "held": held}))
"""


@pytest.mark.slow
def test_the_coordinates_derived_once_are_torchs_and_their_mesh_is_held():
    """mesh_coordinates_once gives torch's own coordinates, mesh_groups_once torch's own process groups (built
    from one rank's copy of the rank tensor), and each mesh the coordinates were derived for is held: torch's
    cache keys them by id(mesh) alone, and a mesh freed mid-run can hand its id to a new mesh of another shape
    (an IndexError in DTensor's shard offsets, seen once in the suite at dp4 x tp2 x ep4)."""
    out = subprocess.run([sys.executable, "-c", SAME_COORDINATES], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"same": True, "held": True}


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), count=st.integers(1, 48), cols=st.integers(1, 3), dim=st.integers(0, 1))
def test_chunks_cut_on_demand_are_fsdp2s_chunks(rows, count, cols, dim):
    """simulated_shards' on-demand chunks are FSDP2's _chunk_with_empty's, piece by piece: the same rows (views
    of the same storage at the same offset), the same empty padding, the same count."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from tessera.training.simulated_shards import _TorchChunks

    tensor = torch.arange(rows * cols, dtype=torch.float32).reshape((rows, cols) if dim == 0 else (cols, rows))
    theirs, ours = _chunk_with_empty(tensor, count, dim), _TorchChunks(tensor, count, dim)
    assert len(ours) == len(theirs) == count
    for i in [*range(count), -1]:
        mine, their = ours[i], theirs[i]
        assert mine.shape == their.shape and torch.equal(mine, their)
        if their.numel():
            assert mine.storage_offset() == their.storage_offset() and mine.stride() == their.stride()
            assert mine.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
