"""--optimizer muon: one process equals torch.optim.Muon, the spec's matrices rule, the checks before any rank
starts, checkpoints (bitwise resume, no optimizer switch), the bytes --comm-stats counts against the model,
the planner's count of Muon's memory, and benchmarks/bench_muon.py's JSON. The layouts' numerics contract
(and checkpoints moving between layouts) is tests/test_muon_contract.py."""

import dataclasses
import json

import pytest
import torch

from helpers import measured_model_states, script_here, small_config
from muon_ranks import muon_comm, resume_bitwise
from tessera.models.spec import get_spec, shape_of
from tessera.launching.launch import run_ranks
from tessera.parallel.muon import Muon, ns_flops
from tessera.topology.memory import muon_gather_bytes
from tessera.topology.estimators.muon_memory import largest_matrix_numel
from tessera.training.estimate import planner_estimate

CASES = {
    "defaults": dict(lr=0.02),
    "plain momentum, match_rms_adamw, 3 steps of other coefficients": dict(
        lr=0.01,
        momentum=0.9,
        nesterov=False,
        adjust_lr="match_rms_adamw",
        ns_steps=3,
        ns_coefficients=(3.0, -3.2, 1.2),
        weight_decay=0.05,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_muon_equals_torch_optim_muon(case):
    if not hasattr(torch.optim, "Muon"):
        pytest.skip(f"torch {torch.__version__} has no torch.optim.Muon (added in 2.9): nothing to compare with")
    options = dict(CASES[case])
    torch_options = {("adjust_lr_fn" if k == "adjust_lr" else k): v for k, v in options.items()}
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32, 96), (48, 48)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = Muon(ours, **options), torch.optim.Muon(theirs, **torch_options)  # bf16 Newton-Schulz, as torch's
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"], rtol=0, atol=1e-6)


def test_a_stack_of_matrices_is_orthogonalized_matrix_by_matrix():
    gen = torch.Generator().manual_seed(1)
    stack = torch.nn.Parameter(torch.randn(3, 16, 8, generator=gen))
    singles = [torch.nn.Parameter(m.detach().clone()) for m in stack]
    grad = torch.randn(stack.shape, generator=gen)
    stack.grad = grad
    for m, g in zip(singles, grad):
        m.grad = g.clone()
    Muon([stack], ns_dtype=torch.float32).step()
    Muon(singles, ns_dtype=torch.float32).step()
    torch.testing.assert_close(stack.detach(), torch.stack([m.detach() for m in singles]), rtol=0, atol=0)
    assert ns_flops((3, 16, 8), 5) == 3 * ns_flops((16, 8), 5)


def test_the_families_mark_their_hidden_matrices():
    llama, moe = get_spec("llama"), get_spec("qwen3_moe")
    assert llama.is_matrix("layers.3.attention.wq.weight", 2) and llama.is_matrix("layers.0.feed_forward.w2.weight", 2)
    for name in ("tok_embeddings.weight", "output.weight", "layers.0.attention_norm.weight", "norm.weight"):
        assert not llama.is_matrix(name, 2 if "embeddings" in name or "output" in name else 1), name
    assert moe.is_matrix("layers.0.mlp.experts.gate_proj", 3)
    assert not moe.is_matrix("layers.0.mlp.gate.weight", 2)  # the router stays on AdamW
    assert not moe.is_matrix("layers.0.self_attn.q_norm.weight", 1)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(muon_update_scale="rms"), r"--muon-update-scale 'rms' is not one of original, match_rms_adamw"),
        (dict(muon_ns_steps=0), r"--muon-ns-steps 0 must be within 1-99"),
        (dict(muon_ns_steps=100), r"--muon-ns-steps 100 must be within 1-99"),
        (dict(muon_ns_coefficients="1,2"), r"--muon-ns-coefficients '1,2' is not three numbers"),
    ],
)
def test_bad_muon_options_get_one_line_before_any_rank(flags, message):
    with pytest.raises(ValueError, match=message) as e:
        small_config(optimizer="muon", **flags).check()
    assert "\n" not in str(e.value)


def test_muon_on_a_spec_that_marks_no_matrix_is_refused(monkeypatch):
    from tessera.training import preflight

    bare = dataclasses.replace(get_spec("llama"), matrices=())
    monkeypatch.setattr(preflight, "spec_of", lambda config: bare)
    with pytest.raises(ValueError, match=r"marks no matrix .*ModelSpec.matrices, or use --optimizer adamw"):
        small_config(optimizer="muon").check()


def test_muon_resumes_bitwise_and_refuses_another_optimizer(tmp_path):
    straight, resumed, path = run_ranks(resume_bitwise, 2, str(tmp_path), timeout=120)[0]
    assert sorted(straight) == sorted(resumed)
    for name, p in straight.items():
        assert torch.equal(p, resumed[name]), name
    with pytest.raises(ValueError, match=r"trained with --optimizer muon, this run asks for --optimizer adamw"):
        small_config(dp=2, resume=str(path)).check()


def test_comm_stats_count_muons_bytes_as_the_model_predicts():
    """dp2 x tp2: every matrix splits evenly over the 4 ranks, so the ranks' counted bytes add up to 4 x the
    predicted mean (who owns what moves bytes between ranks, not their sum)."""
    counted = run_ranks(muon_comm, 4, dict(dp=2, tp=2), timeout=120)
    predicted = counted[0][1]
    assert predicted > 0 and all(p == predicted for _, p in counted)
    assert sum(c for c, _ in counted) == pytest.approx(4 * predicted, rel=1e-12)


@pytest.mark.parametrize("kw", [dict(dp=2), dict(dp=2, tp=2), dict(model="qwen3-moe-debug", dp=2, ep=2)], ids=str)
def test_the_planner_counts_muons_state_and_the_owners_gathered_matrix(kw):
    """--optimizer muon in the planner (`tessera train`'s memory check, the bench's estimate): one momentum on
    the matrices and AdamW's two moments on the rest, as a rank measures after a step, and the whole largest
    matrix its owner gathers during the step."""
    config = small_config(optimizer="muon", **kw)
    predicted, adamw = planner_estimate(config).memory, planner_estimate(small_config(**kw)).memory
    measured = max(m["optimizer"] for m in run_ranks(measured_model_states, config.layout.world_size, config))
    assert predicted["optimizer"] == pytest.approx(measured, rel=0.01), (predicted["optimizer"], measured)
    assert predicted["optimizer"] < adamw["optimizer"]
    whole = muon_gather_bytes(largest_matrix_numel(shape_of(config.model_config), config.layout.tp))
    assert predicted["muon_gathered"] == whole > 0 and "muon_gathered" not in adamw


def test_bench_muon_writes_its_json(tmp_path):
    """benchmarks/bench_muon.py on a tiny setting: its JSON names the device and versions, and holds each
    layout's optimizer-step time, Muon's counted bytes beside the prediction, and the FLOPs' balance."""
    tiny = ["--model", "debug", "--seq-len", "32", "--global-batch", "4", "--steps", "1", "--warmup", "0"]
    out = script_here("bench_muon", *tiny, "--layouts", "one,dp2xtp2", "--out", str(tmp_path / "m.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["device"]["device"] and data["versions"]["torch"] and data["config"]["model"] == "debug"
    rows = {(r["layout"], r["optimizer"]): r for r in data["results"]["rows"]}
    assert sorted(rows) == [("dp2xtp2", "adamw"), ("dp2xtp2", "muon"), ("one", "adamw"), ("one", "muon")]
    assert all(r["optimizer_step_s"] > 0 and r["train_step_s"] > 0 for r in rows.values())
    muon = rows["dp2xtp2", "muon"]
    assert muon["muon_bytes_counted_mean_per_rank"] == muon["muon_bytes_predicted_mean_per_rank"] > 0
    assert (
        rows["one", "muon"]["muon_bytes_counted_mean_per_rank"] == 0 == rows["dp2xtp2", "adamw"]["ns_flops_per_rank"][0]
    )
    assert len(muon["ns_flops_per_rank"]) == 4 and 1 <= muon["ns_flops_max_over_mean"] <= 1.25
