"""A user's own transformer (examples/custom_model.py: LayerNorm, GELU MLP, learned positions, biases) gets
every axis through its spec: the example runs as a user runs it, pp2 x cp2 x tp2 on 8 CPU ranks against one
process, and a planted bug in its spec is caught by the same runner."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.config import Config
from tessera.models.spec import matrix_patterns
from tessera.topology import Layout
from tessera.training.optim import build_muon, split_matrices

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import custom_model  # noqa: E402
from helpers import cli_here


def test_the_custom_model_example_trains_like_one_process_on_pp2_cp2_tp2():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "custom_model.py")], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gpt-mini on pp2 x cp2 x tp2 trains like one process" in out.stdout
    assert "Traceback" not in out.stderr


def test_the_readme_qwen3_command_trains_on_pp2_tp2(tmp_path):
    import json

    cmd = "tessera train --model qwen3-debug --pp 2 --tp 2 --sequence-parallel --microbatches 2 --steps 4"
    readme = (EXAMPLES.parent / "docs" / "models.md").read_text()
    assert cmd in readme
    metrics = tmp_path / "run.jsonl"
    out = cli_here(*cmd.split()[1:], "--metrics", str(metrics))
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert len(steps) == 4 and all(r["loss"] > 0 and r["grad_norm"] > 0 for r in steps)
    assert "qwen3-debug" in out.stdout + out.stderr


def test_the_runner_takes_dp_and_cp_with_a_spec_and_names_a_wrong_spec():
    import dataclasses

    from tessera.testing import LayoutsDiverge, assert_layouts_equivalent

    inputs, targets = custom_model.batch(rows=4, seq=16)
    assert_layouts_equivalent(
        custom_model.build_gpt, [Layout(dp_shard=2, cp=2)], batch=(inputs, targets), steps=2, spec=custom_model.GPT_SPEC
    )
    # a planted bug: the MLP's block_input left out of the spec, so nothing sums the MLP input's gradient
    # over tp in backward; the forward is right, the gradients upstream are not: the runner names one
    wrong = dataclasses.replace(
        custom_model.GPT_SPEC, tp_plan=tuple((p, s) for p, s in custom_model.GPT_SPEC.tp_plan if p != "blocks.*.mlp")
    )
    with pytest.raises(LayoutsDiverge, match=r"layout tp2, step 1: gradient of parameter '.*' differs"):
        assert_layouts_equivalent(custom_model.build_gpt, [Layout(tp=2)], batch=(inputs, targets), steps=1, spec=wrong)


def test_pp_and_cp_without_a_spec_are_refused_by_name():
    from tessera.testing import assert_layouts_equivalent

    with pytest.raises(ValueError, match="pass spec=ModelSpec"):
        assert_layouts_equivalent(custom_model.build_gpt, [Layout(pp=2)], batch=custom_model.batch())


def test_the_custom_models_spec_marks_its_matrices_and_muon_steps_them_as_torch_does():
    """--optimizer muon on a user's model: its spec's `matrices` picks the hidden weights (not the
    embeddings, head, norms or biases), and tessera's optimizer pair (Muon on those, AdamW on the rest)
    steps them as torch.optim.Muon does on one process."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip(f"torch {torch.__version__} has no torch.optim.Muon (added in 2.9): nothing to compare with")
    spec = custom_model.GPT_SPEC
    torch.manual_seed(0)
    model = custom_model.build_gpt()
    matrices, rest = split_matrices(model, spec.is_matrix)
    names = {id(p): n for n, p in model.named_parameters()}
    marked = sorted(names[id(p)] for p in matrices)
    assert marked == sorted(
        n for n, p in model.named_parameters() if p.ndim == 2 and any(k in n for k in (".attn.", ".mlp."))
    )
    assert {names[id(p)].split(".")[0] for p in rest} == {"wte", "wpe", "blocks", "ln_f", "head"}
    assert all(p.ndim == 1 for p in rest if names[id(p)].startswith("blocks"))  # biases and LayerNorms
    # the explicit rule says what the tp plan implies for these 2-D weights
    implied = dataclasses.replace(spec, matrices=matrix_patterns(spec.tp_plan))
    assert marked == sorted(n for n, p in model.named_parameters() if implied.is_matrix(n, p.ndim))

    options = Config.create(model="debug", optimizer="muon").optimizer
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in matrices]
    reference = torch.optim.Muon(
        theirs,
        lr=options.muon_lr,
        weight_decay=options.muon_weight_decay,
        momentum=options.muon_momentum,
        nesterov=options.muon_nesterov,
        ns_steps=options.muon_ns_steps,
        adjust_lr_fn=options.muon_update_scale,
    )
    optimizers = build_muon(model, spec.is_matrix, options, torch.bfloat16)  # torch's Newton-Schulz dtype
    assert [type(o).__name__ for o in optimizers] == ["AdamW", "Muon"]
    inputs, targets = custom_model.batch(rows=2, seq=16)
    for _ in range(2):
        for o in optimizers:
            o.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        for p, q in zip(matrices, theirs):
            q.grad = p.grad.clone()
        for o in optimizers:
            o.step()
        reference.step()
        for p, q in zip(matrices, theirs):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
