"""The planner against published runs (issue 62): hardware profiles as data, any model by hf:DIR, one layout
scored alone with `--top 0`, the physics step model's pure functions, and bench_published.py's table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import cli_here, script_here
from tessera.models.spec import shape_of
from tessera.topology import Layout
from tessera.topology.errors import PlanError
from tessera.topology.hardware import load_profile, profile_names
from tessera.topology.estimators.planner import Candidate, Hardware, estimate
from tessera.topology.estimators.scoring import score_one
from tessera.topology.estimators.step_model import exposed_comm, gemm_share

ROOT = Path(__file__).resolve().parents[1]
RUNS = json.loads((ROOT / "benchmarks" / "published" / "runs.json").read_text())
PLAN_8B = ["plan", "--model", "8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16"]


def test_every_profile_names_a_source_for_each_datasheet_figure():
    names = profile_names()
    for wanted in ("h100-sxm-80gb", "h200-sxm", "a100-sxm-80gb", "h100-96gb-500w", "dgx-h100", "nvidia-h200"):
        assert wanted in names
    for name in names:
        p = load_profile(name)
        assert p.bf16_tflops > 0 and p.hbm_gbps > 0 and p.gpus_per_node >= 1
        assert p.sources.get("bf16_tflops") or p.sources.get("base"), name
    # the torchtitan tables' 500 W HBM2e part is not the 700 W SXM part
    assert load_profile("h100-96gb-500w").bf16_tflops < load_profile("h100-sxm-80gb").bf16_tflops
    assert load_profile("h100-96gb-500w").hbm_gb == 96 and load_profile("h100-96gb-500w").hbm_gbps == 2400


def test_a_users_profile_file_takes_a_base_and_overrides_a_figure(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"profiles": {"my-h100": {"base": "h100-sxm-80gb", "inter_node_gbps": 25.0}}}))
    mine, base = load_profile(str(path)), load_profile("h100-sxm-80gb")
    assert mine.inter_node_gbps == 25.0 and mine.bf16_tflops == base.bf16_tflops
    slow = cli_here(*PLAN_8B, "--layout", "dp8+ac_op", "--top", "0", "--json", "--hardware", str(path))
    fast = cli_here(*PLAN_8B, "--layout", "dp8+ac_op", "--top", "0", "--json")
    assert slow.returncode == fast.returncode == 0, slow.stderr
    est = [json.loads(x.stdout)["layout"]["estimate"] for x in (slow, fast)]
    assert est[0]["step_time_s"] >= est[1]["step_time_s"]  # one node: the inter-node links are not on its path


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hardware", "nope"], r"--hardware 'nope' is not a profile: use one of a100-sxm-80gb, .*h200-sxm"),
        (["--hardware", "{dir}"], r"--hardware .* is a directory; name a hardware profile file \(JSON\)"),
        (["--hardware", "{bad}"], r"is not JSON \(.*\); fix it or name another"),
        (["--hardware", "a100-sxm-80gb", "--fp8", "tensorwise"], r"has no FP8 tensor cores"),
        (["--top", "0"], r"--top 0 scores --layout's layout alone; name one"),
        (["--microbatches", "4"], r"fix a setting of --layout's layout; name one"),
        (["--layout", "dp8", "--top", "0", "--microbatches", "3"], r"does not divide the 2 rows of a dp rank"),
        (["--layout", "dp8", "--top", "0", "--schedule", "1f1b"], r"--layout dp8 has none \(pp 1\); drop them"),
        (["--layout", "pp2xdp4", "--top", "0", "--virtual", "0"], r"--virtual 0 must be at least 1"),
        (["--layout", "dp8+async_tp", "--top", "0"], r"\+async_tp overlaps tensor-parallel traffic, and tp is 1"),
        (["--layout", "dp4xtp2+sp+ep_over_tp", "--top", "0"], r"\+ep_over_tp folds tp into the expert group, which"),
        (["--layout", "pp2xdp4", "--top", "0", "--schedule", "nope"], r"unknown pipeline --schedule nope"),
        (["--layout", "dp8", "--efficiency", "2"], r"--efficiency 2 must be in \(0, 1\]: the framework's software"),
    ],
)
def test_bad_hardware_and_scoring_requests_get_one_line(tmp_path, extra, message):
    import re

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    argv = [a.format(dir=tmp_path, bad=bad) for a in extra]
    out = cli_here(*PLAN_8B, *argv)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), out.stderr


def test_top_0_scores_one_layout_alone_with_the_step_split_and_mfu():
    out = cli_here(*PLAN_8B, "--layout", "dp8+ac_op+compile", "--top", "0", "--microbatches", "1", "--json",
                   "--fp8", "tensorwise", "--hardware", "h100-96gb-500w")  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert "ranked" not in doc  # alone: nothing else was ranked
    e = doc["layout"]["estimate"]
    assert e["microbatches"] == 1 and e["ac"] == "op" and e["layout"]["dp_shard"] == 8
    for key in ("compute", "recompute", "optimizer", "bubble", "tp", "cp", "pp", "ep", "fsdp"):
        assert key in e["split_s"]
    assert sum(e["split_s"].values()) == pytest.approx(e["step_time_s"])
    assert e["tokens_per_s_per_gpu"] == pytest.approx(16 * 8192 / e["step_time_s"] / 8)
    # MFU against the bf16 peak, the FP8 peak (half of it) and a peak blended by the FLOPs in FP8, in between
    assert e["mfu_fp8"] == pytest.approx(e["mfu_bf16"] / 2, rel=1e-3)
    assert e["mfu_fp8"] < e["mfu_fp8_blended"] < e["mfu_bf16"]
    assert set(e["memory_gib"]) >= {"parameters", "optimizer", "activations", "total"}
    # compiled blocks and FP8 matmuls each shorten the step the planner predicts
    plain = json.loads(cli_here(*PLAN_8B, "--layout", "dp8+ac_op", "--top", "0", "--microbatches", "1", "--json",
                                "--hardware", "h100-96gb-500w").stdout)["layout"]["estimate"]  # fmt: skip
    assert e["step_time_s"] < plain["step_time_s"]


def test_a_named_layout_beside_the_ranking_carries_the_same_estimate():
    on = ["--hardware", "h100-96gb-500w"]  # the published row's machine (on 80 GB it does not fit)
    alone = json.loads(cli_here(*PLAN_8B, *on, "--layout", "dp8+ac_op", "--top", "0", "--json").stdout)
    ranked = json.loads(cli_here(*PLAN_8B, *on, "--layout", "dp8+ac_op", "--top", "3", "--json").stdout)
    assert ranked["layout"]["estimate"] == alone["layout"]["estimate"]
    assert ranked["layout"]["rank"] >= 1 and len(ranked["ranked"]) == 3


@pytest.mark.parametrize("preset", ["8b", "qwen3-30b-a3b"])
def test_a_hugging_face_config_plans_as_its_preset(tmp_path, preset):
    from tessera.models import get_preset
    from tessera.models.hf import hf_config_dict

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(get_preset(preset), "bfloat16")))
    layout = "dp8+ac_full" if preset == "8b" else "dp8xep8+ac_full"
    got = [
        json.loads(cli_here(*PLAN_8B[:2], m, *PLAN_8B[3:], "--layout", layout, "--top", "0", "--json").stdout)
        for m in (f"hf:{tmp_path}", preset)
    ]
    assert got[0]["layout"]["estimate"]["time_s"] == got[1]["layout"]["estimate"]["time_s"]
    assert got[0]["layout"]["estimate"]["memory_bytes"] == got[1]["layout"]["estimate"]["memory_bytes"]


def test_a_hugging_face_config_of_an_unknown_family_is_refused_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    out = cli_here(*PLAN_8B[:2], f"hf:{tmp_path}", *PLAN_8B[3:])
    assert out.returncode == 2 and "model_type 'mamba'" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("option", ["async_tp", "ep_over_tp"])
def test_bench_refuses_what_tessera_does_not_run(tmp_path, option):
    out = cli_here("bench", "--model", "debug", "--layouts", f"tp2+{option}", "--steps", "4", "--out", str(tmp_path))
    assert out.returncode == 2 and f"+{option} is a `tessera plan` option" in out.stderr


# ----------------------------------------------------------------------------- the step model's pure parts
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 1 << 16), st.integers(1, 1 << 16), st.integers(1, 1 << 16), st.integers(1, 8))
def test_a_gemm_reaches_more_of_the_peak_as_its_smallest_dimension_grows(m, n, k, grow):
    p = load_profile("h100-sxm-80gb")
    share = gemm_share(p, m, n, k)
    assert 0 < share <= p.achieved.gemm_share
    assert gemm_share(p, m * grow, n * grow, k * grow) >= share


@settings(max_examples=60, deadline=None)
@given(st.integers(64, 1 << 20), st.sampled_from([64, 96, 128, 192, 256]), st.sampled_from(["cudnn", "flash2"]))
def test_attention_reaches_more_of_the_peak_on_longer_sequences(seq, head_dim, backend):
    a = load_profile("h200-sxm").achieved
    assert 0 < a.attention(backend, seq, head_dim) <= a.attention(backend, 2 * seq, head_dim) <= 1


@settings(max_examples=80, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["tp", "cp", "pp", "ep", "dp_shard_cp", "dp_replicate"]), st.floats(0, 10)),
    st.floats(0.01, 10),
    st.floats(0.0, 5),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 8]),
    st.integers(1, 64),
    st.booleans(),
)
def test_exposed_traffic_is_never_more_than_the_traffic(seconds, matmul, attention, tp, pp, microbatches, async_tp):
    parts = {"matmul": matmul, "attention": attention, "optimizer": 0.1, "compute": matmul + attention + 0.1}
    exposed = exposed_comm(seconds, parts, tp=tp, pp=pp, microbatches=microbatches, units=34, async_tp=async_tp)
    data = seconds.get("dp_shard_cp", 0.0) + seconds.get("dp_replicate", 0.0)
    for name, limit in (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("ep", "ep")):
        assert 0 <= exposed[name] <= seconds.get(limit, 0.0) + 1e-12
    assert 0 <= exposed["fsdp"] <= data + 1e-12
    if async_tp and tp > 1:  # overlapped, it never costs more than synchronous
        sync = exposed_comm(seconds, parts, tp=tp, pp=pp, microbatches=microbatches, units=34, async_tp=False)
        assert exposed["tp"] <= sync["tp"] + 1e-12


@settings(max_examples=80, deadline=None)
@given(
    st.floats(0, 10),
    st.floats(0.0, 5),
    st.sampled_from([2, 4, 8, 16]),
    st.sampled_from([2, 4]),
    st.booleans(),
)
def test_a_gather_hidden_by_the_first_step_alone_exposes_at_least_the_ring_and_at_most_the_traffic(
    t_cp, attention, cp, dtype_bytes, recomputed
):
    """torch's all-gather rotater (cp_overlap first_step): its K/V gathers hide behind one of cp steps, so it
    exposes no less than tessera's ring (every pass behind its step's attention) and never more than the
    traffic; the gathers' share is comm_model's ring volumes' (cp - 1) K/V passes beside cp dK/dV passes."""
    from tessera.topology.estimators.step_estimate import cp_gather_share

    share = cp_gather_share(cp, dtype_bytes, recomputed)
    passes = 3 if recomputed else 2
    assert math.isclose(share, (cp - 1) * dtype_bytes * passes / ((cp - 1) * dtype_bytes * passes + 4 * cp))
    parts = {"matmul": 1.0, "attention": attention, "optimizer": 0.1, "compute": 1.1 + attention}
    kw = dict(tp=1, pp=1, microbatches=1, units=34, async_tp=False, cp=cp)
    ring = exposed_comm({"cp": t_cp}, parts, **kw)["cp"]
    first = exposed_comm({"cp": t_cp}, parts, **kw, cp_overlap="first_step", cp_gather_share=share)["cp"]
    assert ring - 1e-12 <= first <= t_cp + 1e-12


def test_cp_passes_of_query_heads_carry_n_heads_over_n_kv_heads_times_the_kv_bytes():
    """cp_kv_heads "query" (torchtitan's Llama repeats K/V to the query heads before attention): 8B's cp
    traffic is n_heads / n_kv_heads = 4 times tessera's own, at tp 1 and tp 2."""
    from tessera.topology.estimators.comm_model import comm_bytes_per_step
    from tessera.topology.preset_shapes import preset_shape

    shape = preset_shape("8b")
    for layout in (Layout(dp_shard=2, cp=4), Layout(cp=4, tp=2)):
        own = comm_bytes_per_step(shape, layout, 131072, 2, ac="full", act_bytes=2)["cp"]
        repeated = comm_bytes_per_step(shape, layout, 131072, 2, ac="full", act_bytes=2, cp_kv_heads="query")["cp"]
        assert own > 0 and math.isclose(repeated, own * shape.n_heads / shape.n_kv_heads)
    with pytest.raises(ValueError, match="cp_kv_heads='heads'"):
        comm_bytes_per_step(shape, Layout(cp=2), 8192, 2, cp_kv_heads="heads")


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([40.0, 100.0, 360.0, 720.0]), st.sampled_from([5.0, 25.0, 50.0, 100.0]))
def test_faster_links_never_slow_a_step(intra, inter):
    shape = shape_of("8b")
    cand = Candidate(Layout(dp_shard=8, tp=2), "FULL_SHARD", "full", "1f1b", 1, 1)
    step = [
        estimate(
            shape, cand, Hardware.from_profile("h100-sxm-80gb", 16, intra_node_gbps=a, inter_node_gbps=b), 8192, 32
        ).time["step"]
        for a, b in ((intra, inter), (2 * intra, 2 * inter))
    ]
    assert step[1] <= step[0] and math.isfinite(step[0])


def test_scoring_refuses_a_layout_tessera_would_not_run():
    with pytest.raises(PlanError, match="tessera would not run .*does not split into"):
        score_one(shape_of("8b"), Hardware.from_profile("h100-sxm-80gb", 8), 8190, 16, Layout(cp=8))


# ----------------------------------------------------------------------------- the published rows
def test_every_published_row_names_its_source_and_what_it_assumes():
    sources = RUNS["sources"]
    assert {r["id"] for r in RUNS["rows"]} >= {s["anchor"] for s in sources.values()}
    for r in RUNS["rows"]:
        s = sources[r["source"]]
        assert s["repository"] and s["file"] and s["commit"] and r["published_tokens_per_s_per_gpu"] > 0
        load_profile(r["hardware"])
        assert isinstance(r["assumptions"], list)
        assert s["data_parallel"] == ("megatron" if s["framework"] == "Megatron-Bridge" else "fsdp2")
        # Megatron-Bridge's performance scripts reduce in bf16 (grad_reduce_in_fp32 = False); FSDP2's in fp32
        assert (
            s["grad_reduce"] == ("bf16" if s["framework"] == "Megatron-Bridge" else "fp32") and s["grad_reduce_source"]
        )


@settings(max_examples=40, deadline=None)
@given(dp=st.sampled_from([2, 4, 8, 16]), tp=st.sampled_from([1, 2, 4]), microbatches=st.sampled_from([1, 4]))
def test_megatrons_distributed_optimizer_holds_6_plus_12_over_dp_bytes_a_parameter(dp, tp, microbatches):
    """Megatron's DDP with its distributed optimizer and fp32 gradients (its docs' table: 6 + 12/d bytes a
    parameter): one bf16 parameter buffer, one fp32 gradient buffer held the whole step, the master and Adam
    moments sharded; FSDP2's SHARD_GRAD_OP, accumulating, holds a sharded copy beside the gathered one, the
    unsharded fp32 gradients and then sharded ones: 6 + 16/d (without accumulation no fp32 buffer, which
    Megatron's keeps)."""
    shape = shape_of("8b")
    cand = Candidate(Layout(dp_shard=dp, tp=tp), "SHARD_GRAD_OP", "full", None, microbatches)
    seen = {}
    for states in ("fsdp2", "megatron"):
        hw = Hardware.from_profile("dgx-h100", dp * tp, data_parallel=states)
        seen[states] = estimate(shape, cand, hw, 4096, dp * microbatches).memory
    m, f = seen["megatron"], seen["fsdp2"]
    params = f["gathered_params"] / 2  # this rank's parameters after tp (the gathered bf16 copy holds them)
    assert m["parameters"] == 2 * params and m["gradients"] == 4 * params and m["gathered_params"] == 0
    assert m["optimizer"] == f["optimizer"] and m["unsharded_grads"] == 0
    states = m["parameters"] + m["gradients"] + m["optimizer"]
    assert states == pytest.approx((6 + 12 / dp) * params, rel=0.01)  # (FSDP2's padding of the shards)
    assert m["activations"] == f["activations"]
    if microbatches > 1:  # FSDP2 accumulates in unsharded fp32 gradients beside its two parameter copies
        fsdp2 = sum(f[k] for k in ("parameters", "gathered_params", "unsharded_grads", "gradients", "optimizer"))
        assert fsdp2 == pytest.approx((6 + 16 / dp) * params, rel=0.01) and m["total"] < f["total"]


@settings(max_examples=20, deadline=None)
@given(dp=st.sampled_from([2, 8, 32]), tp=st.sampled_from([1, 4]))
def test_megatrons_bf16_gradient_buffer_holds_4_plus_12_over_dp_bytes_a_parameter(dp, tp):
    """With grad_reduce_in_fp32 off (Megatron-Bridge's performance scripts) the gradient buffer is bf16: 2 bytes a
    parameter fewer than the fp32 one, 4 + 12/d in all (Megatron's distributed-optimizer table), and the data
    axis's reduce-scatter sends half its bytes."""
    shape = shape_of("8b")
    cand = Candidate(Layout(dp_shard=dp, tp=tp), "SHARD_GRAD_OP", "full", None, 4)
    seen = {}
    for grad_bytes in (4, 2):
        hw = Hardware.from_profile("dgx-h100", dp * tp, data_parallel="megatron", grad_reduce_bytes=grad_bytes)
        seen[grad_bytes] = estimate(shape, cand, hw, 4096, dp * 4)
    fp32, bf16 = seen[4].memory, seen[2].memory
    params = fp32["parameters"] / 2
    assert bf16["gradients"] == 2 * params and fp32["gradients"] == 4 * params
    states = bf16["parameters"] + bf16["gradients"] + bf16["optimizer"]
    assert states == pytest.approx((4 + 12 / dp) * params, rel=0.01)
    assert bf16["total"] < fp32["total"]
    assert seen[2].comm_bytes["dp_shard_cp"] < seen[4].comm_bytes["dp_shard_cp"]  # the reduce-scatter's half
    with pytest.raises(PlanError, match="grad_reduce_bytes=8: use 4 .fp32. or 2 .bf16."):
        Hardware(gpus=8, grad_reduce_bytes=8)


def test_a_data_parallel_states_model_other_than_fsdp2_or_megatron_is_refused():
    with pytest.raises(PlanError, match="data_parallel='zero1': use one of fsdp2, megatron"):
        Hardware(gpus=8, data_parallel="zero1")


def test_bench_published_predicts_every_row_with_one_constant_per_source(tmp_path):
    # the command docs/layouts.md shows, run into this test's folder
    page = (ROOT / "docs" / "layouts.md").read_text()
    shown = "python benchmarks/bench_published.py --out /tmp/published"
    assert f"<!-- run by tests/test_published.py -->\n```bash\n{shown}\n```" in page
    out = script_here("bench_published", "--out", str(tmp_path), "--no-ranking")
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "published.json").read_text())
    assert (tmp_path / "published.png").is_file()
    rows = doc["results"]["rows"]
    assert [r["id"] for r in rows] == [r["id"] for r in RUNS["rows"]]
    for r in rows:
        for key in ("published_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu", "published_memory_gib",
                    "predicted_memory_gib", "anchor"):  # fmt: skip
            assert key in r
        # one constant per source, the one fitted on its anchor
        assert r["software_efficiency"] == doc["results"]["constants"][r["source"]]["software_efficiency"]
        assert r["id"] in out.stdout
    anchors = [r for r in rows if r["anchor"]]
    assert len(anchors) == len(RUNS["sources"])
    for r in anchors:  # fitted exactly, unless the kernels' rates alone fall short of it (efficiency 1)
        assert abs(r["tokens_error"]) < 1e-3 or r["software_efficiency"] == 1.0
    # the one-GPU truth: the lent H200's bf16 eager, compiled and FP8 compiled rows within 10% of the step
    by_id = {r["id"]: r for r in rows}
    for name in ("tessera-h200-1b-eager", "tessera-h200-1b-compiled", "tessera-h200-1b-fp8-compiled"):
        assert abs(by_id[name]["tokens_error"]) <= 0.10, by_id[name]


def test_bench_published_ranks_the_authors_layout_among_the_planners(tmp_path):
    """Where each job's own configuration stands among every layout the planner runs for that job, and what
    the planner's best would gain (two one-node jobs, with their sources' anchors)."""
    out = script_here("bench_published", "--out", str(tmp_path), "--rows", "tessera-h200-1b-compiled,tt-t1-8b-fsdp8")
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "published.json").read_text())["results"]
    rows = {r["id"]: r for r in doc["rows"]}
    assert set(rows) == {"tessera-h200-1b-compiled", "tessera-h200-1b-eager", "tt-t1-8b-fsdp8"}
    for r in rows.values():
        assert 1 <= r["authors_rank"] <= r["layouts_ranked"] and r["planner_best"]
        if r["authors_rank"] > 1:  # the best is predicted faster, by how much and why
            assert r["planner_best_speedup"] > 1 and r["planner_best_why"]
    ranking = doc["ranking"]
    assert ranking["jobs"] == 3 and ranking["authors_in_top_5"] == sum(r["authors_rank"] <= 5 for r in rows.values())
    assert f"in the planner's top 5 for {ranking['authors_in_top_5']} of 3 jobs" in out.stdout
    near = sum(r.get("planner_best_speedup", 1.0) <= 1.10 for r in rows.values())
    assert ranking["authors_within_10_percent_of_best"] == near


def test_a_gpus_calibration_overlays_the_shares_of_its_profile(tmp_path):
    """--calibration-overlay KIND: the lent H200's measured rates (the suite's calibration entry) become the
    profile's achieved shares; a CPU's calibration is refused in one line."""
    from tessera.topology.hardware import with_calibration

    entry = json.loads((ROOT / "benchmarks" / "results" / "gpu_suite_h200.json").read_text())["results"]["planner"][
        "calibration"
    ]
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"schema": 1, "entries": {"h200 | bfloat16": entry}}))
    profile = load_profile("nvidia-h200")
    overlaid = with_calibration(profile, entry)
    dim = entry["measured_at"]["dim"]
    expected = entry["matmul_flops_per_s"] / (profile.bf16_tflops * 1e12) * (dim + 128) / dim
    assert overlaid.achieved.gemm_share == pytest.approx(expected)
    assert overlaid.achieved.elementwise_share == pytest.approx(entry["memory_bytes_per_s"] / 4.8e12)
    assert "measured on NVIDIA H200" in overlaid.sources["achieved.gemm_share"]
    argv = ["plan", "--model", "1b", "--gpus", "1", "--seq-len", "2048", "--global-batch", "16", "--layout", "one",
            "--top", "0", "--json", "--hardware", "nvidia-h200", "--calibration", str(path)]  # fmt: skip
    plain, over = cli_here(*argv), cli_here(*argv, "--calibration-overlay", "H200")
    assert plain.returncode == over.returncode == 0, over.stderr
    steps = [json.loads(x.stdout)["layout"]["estimate"]["step_time_s"] for x in (plain, over)]
    assert steps[0] != steps[1] and all(math.isfinite(t) for t in steps)
    cpu = {**entry, "device_kind": "cpu: test", "device_type": "cpu", "dtype": "float32"}
    path.write_text(json.dumps({"schema": 1, "entries": {"cpu | float32": cpu}}))
    out = cli_here(*argv, "--calibration-overlay", "cpu")
    assert out.returncode == 2 and "no calibration for device kind 'cpu' in bfloat16" in out.stderr
    with pytest.raises(PlanError, match="is not a GPU's in bf16"):
        with_calibration(profile, cpu)


def test_the_docs_and_the_readme_show_what_the_committed_results_say():
    """docs/layouts.md's generated spans are docs/gen_published.py's rendering of the committed JSON, and the
    README's planner figures are that JSON's."""
    import sys

    sys.path.insert(0, str(ROOT / "docs"))
    from gen_published import PAGE, RESULTS, figures, render

    results = json.loads(RESULTS.read_text())["results"]
    page = PAGE.read_text()
    assert render(page, figures(results)) == page, "run python docs/gen_published.py"
    t = results["tokens"]
    readme = (ROOT / "README.md").read_text()
    assert f"median {t['median_abs_error']:.1%} error, worst {t['worst_abs_error']:.0%}" in readme
    assert (
        f"median |error| {t['median_abs_error']:.1%}, {t['within_25_percent']} of\n  {t['rows']} within 25%" in readme
    )


def test_the_layouts_page_quotes_the_refusal_the_planner_prints():
    """docs/layouts.md quotes the line a request that cannot fit gets (issue 65 item 13: the page said 226.5 GB
    where the command printed 258.2): the quote is what the command prints now."""
    import re

    page = " ".join((ROOT / "docs" / "layouts.md").read_text().split())
    quoted = re.search(r"`(70b does not fit on 8 GPUs of 80 GB .*? at least 15 GPUs of 80 GB)`", page).group(1)
    out = cli_here("plan", "--model", "70b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "256")
    assert out.returncode == 2 and quoted in out.stderr, out.stderr
