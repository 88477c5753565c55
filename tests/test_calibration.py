"""The planner's calibrated step time: the calibration file's schema, the planner using a calibration's
rates (a fake one: arithmetic, not performance), `tessera plan --calibrate` on this CPU, and the counts the
step-time model states (recounted at the dispatcher). Figures are never asserted here, only plumbing."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_here

from tessera.models import get_preset
from tessera.commands.plan import model_shape
from tessera.topology import Layout
from tessera.topology.estimators.planner import Candidate, Hardware, estimate
from tessera.topology.estimators.step_time import (
    OPS_PER_BLOCK,
    SCHEMA,
    Calibration,
    block_elements_per_token,
    find_entry,
    matmul_flops_per_token,
    step_parts,
)

ROOT = Path(__file__).resolve().parents[1]
FAKE = dict(
    device_kind="Fake GPU 9000",
    dtype="bfloat16",
    matmul_flops_per_s=500e12,
    attention_flops_per_s=250e12,
    memory_bytes_per_s=2.5e12,
    op_overhead_s=10e-6,
    device_type="cuda",
)


def _tessera(*args, env=None):
    return cli_here(*args, env=env)


def test_calibration_entries_parse_and_are_found_by_device_kind():
    cal = Calibration.from_entry({**FAKE, "measured_at": {"dim": 2048}, "created": "2026-01-01T00:00:00Z"})
    assert cal.matmul_flops_per_s == 500e12 and cal.host_overlaps
    data = {
        "schema": SCHEMA,
        "entries": {
            "Fake GPU 9000 | bfloat16": FAKE,
            "cpu: Some CPU, 1 thread | float32": {**FAKE, "device_kind": "cpu: Some CPU, 1 thread", "dtype": "float32"},
        },
    }
    assert find_entry(data, "fake gpu")["device_kind"] == "Fake GPU 9000"
    assert find_entry(data, "cpu", "float32")["dtype"] == "float32"
    with pytest.raises(ValueError, match=r"no calibration for device kind 'H100'.*Fake GPU 9000 \| bfloat16"):
        find_entry(data, "H100")
    with pytest.raises(ValueError, match="not a tessera calibration file"):
        find_entry({"entries": {}}, "cpu")
    with pytest.raises(ValueError, match="lacks op_overhead_s"):
        Calibration.from_entry({k: v for k, v in FAKE.items() if k != "op_overhead_s"})
    with pytest.raises(ValueError, match="matmul_flops_per_s 0 must be positive"):
        Calibration.from_entry({**FAKE, "matmul_flops_per_s": 0})
    with pytest.raises(ValueError, match="device_type 'tpu' must be cpu or cuda"):
        Calibration.from_entry({**FAKE, "device_type": "tpu"})


def test_the_planner_uses_a_calibrations_rates():
    cfg = model_shape("1b")
    cand = Candidate(Layout())
    plain = estimate(cfg, cand, Hardware(gpus=1), 2048, 4)
    cal = Calibration(**FAKE)
    calibrated = estimate(cfg, cand, Hardware(gpus=1, calibration=cal), 2048, 4)
    parts = calibrated.compute_parts
    tokens = 4 * 2048
    assert parts["matmul"] == pytest.approx(matmul_flops_per_token(cfg) * tokens / cal.matmul_flops_per_s)
    assert parts["attention"] == pytest.approx(6 * cfg.n_layers * cfg.dim * 2048 * tokens / cal.attention_flops_per_s)
    assert parts["memory"] == pytest.approx(parts["memory_traffic_bytes"] / cal.memory_bytes_per_s)
    assert parts["host"] == pytest.approx(parts["operators"] * cal.op_overhead_s)
    # a GPU's host overlaps the device: the step is the larger of the two
    assert parts["step"] == pytest.approx(max(parts["matmul"] + parts["attention"] + parts["memory"], parts["host"]))
    assert calibrated.time["compute"] == parts["step"] and calibrated.time["step"] == pytest.approx(parts["step"])
    assert not plain.compute_parts and plain.time["compute"] != calibrated.time["compute"]
    # twice the matmul rate: the matmul share halves, nothing else moves
    faster = estimate(
        cfg, cand, Hardware(gpus=1, calibration=Calibration(**{**FAKE, "matmul_flops_per_s": 1000e12})), 2048, 4
    )
    assert faster.compute_parts["matmul"] == pytest.approx(parts["matmul"] / 2)
    assert faster.compute_parts["memory"] == parts["memory"]
    # on a CPU one thread does both: device + host
    cpu = Calibration(**{**FAKE, "device_type": "cpu"})
    p = step_parts(cfg, cpu, tokens, 2048, cfg.num_params(), 9 * cfg.n_layers + 3, cfg.n_layers, 2)
    assert p["step"] == pytest.approx(p["matmul"] + p["attention"] + p["memory"] + p["host"])
    # the operators dispatched for the parameter tensors: Llama's 9 per block, the embedding, final norm and head
    assert parts["operators"] == p["operators"]
    # the planner splits the FLOPs over the ranks: dp2 does half a step's matmuls per rank
    dp2 = estimate(cfg, Candidate(Layout(dp_shard=2)), Hardware(gpus=2, calibration=cal), 2048, 4)
    assert dp2.compute_parts["matmul"] == pytest.approx(parts["matmul"] / 2)


def test_the_step_time_model_reads_the_shape():
    """Qwen3's attention is heads x head_dim wide (2048 for a dim of 1024), its qk-norms add elementwise
    traffic; a GELU MLP moves less than SwiGLU's; the calibration's matmul shapes follow the MLP."""
    from dataclasses import replace

    from tessera.commands.calibrate import linear_shapes
    from tessera.topology.estimators.step_time import attention_flops_per_token

    qwen = model_shape("qwen3-0.6b")
    assert attention_flops_per_token(qwen, 4096) == 6 * 28 * 16 * 128 * 4096
    assert block_elements_per_token(qwen) > block_elements_per_token(replace(qwen, qk_norm=False))
    assert block_elements_per_token(replace(qwen, mlp="gelu")) < block_elements_per_token(qwen)
    assert matmul_flops_per_token(replace(qwen, mlp="gelu")) == matmul_flops_per_token(qwen) - 6 * 28 * 1024 * 3072
    counts = {(i, o): n for i, o, n in linear_shapes(replace(qwen, mlp="gelu"))}
    assert counts[(1024, 3072)] == 28 and counts[(3072, 1024)] == 28 and counts[(1024, 2048)] == 28
    assert {(i, o): n for i, o, n in linear_shapes(qwen)}[(1024, 3072)] == 2 * 28


def test_bench_planner_check_smoke(tmp_path):
    """benchmarks/bench_planner_check.py's plumbing: calibrate, predict, measure, the ratio of the two."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_planner_check.py"),
            "--smoke",
            "--out",
            str(tmp_path / "check.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads((tmp_path / "check.json").read_text())["results"]["rows"][0]
    assert row["config"] == "debug:1:32:2" and row["compute_dtype"] == "float32"
    for r in row["rounds"]:
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])
        assert r["predicted_s"] == pytest.approx(r["parts_s"]["step"])


def test_plan_calibrate_on_this_cpu_writes_the_file_the_planner_then_reads(tmp_path):
    path = tmp_path / "calibration.json"
    out = _tessera(
        "plan",
        "--calibrate",
        "--model",
        "small",
        "--seq-len",
        "128",
        "--global-batch",
        "8",
        "--quick",
        "--calibration",
        str(path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("calibrated cpu: ") and f"wrote {path}" in out.stdout
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and len(data["entries"]) == 1
    entry = next(iter(data["entries"].values()))
    rates = Calibration.from_entry(entry)
    assert (rates.measured_rows, rates.measured_seq_len) == (8, 128)  # a GEMM's rate depends on its tokens
    assert entry["dtype"] == "float32" and entry["threads"] == 1 and entry["device_type"] == "cpu"
    assert entry["measured_at"]["dim"] == 256 and entry["measured_at"]["rows"] == 8 and entry["versions"]["torch"]
    assert {s["in"] for s in entry["matmul_by_shape"]} == {256, 768}
    planned = _tessera(
        "plan",
        "--model",
        "small",
        "--gpus",
        "1",
        "--seq-len",
        "128",
        "--global-batch",
        "8",
        "--device-kind",
        "cpu",
        "--calibration",
        str(path),
        "--json",
        "--top",
        "1",
    )
    assert planned.returncode == 0, planned.stderr[-3000:]
    top = json.loads(planned.stdout)["ranked"][0]
    assert top["compute_parts_s"]["step"] == pytest.approx(top["time_s"]["compute"])
    assert json.loads(planned.stdout)["request"]["hardware"]["calibration"]["device_kind"] == entry["device_kind"]
    request = ["--model", "small", "--gpus", "1", "--seq-len", "128", "--global-batch", "8"]
    text = _tessera("plan", *request, "--device-kind", "cpu", "--calibration", str(path), "--top", "1")
    assert "(float32) at 8 x 128 tokens a microbatch" in text.stdout.splitlines()[-1], text.stdout
    missing = _tessera(
        "plan",
        "--model",
        "small",
        "--gpus",
        "1",
        "--seq-len",
        "128",
        "--global-batch",
        "8",
        "--device-kind",
        "H100",
        "--calibration",
        str(path),
    )
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "no calibration for device kind 'H100'" in missing.stderr


def test_plan_without_gpus_asks_for_them_in_one_line():
    out = _tessera("plan", "--model", "8b", "--seq-len", "4096")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--gpus, --global-batch required (or --calibrate" in out.stderr


def readme_commands(prefix: str) -> list[str]:
    """The README's command lines (in its bash blocks) that start with `prefix`."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "layouts.md").read_text(), re.S)
    return [ln.split(" #")[0].strip() for b in blocks for ln in b.splitlines() if ln.startswith(prefix)]


def test_the_readme_calibration_commands_run_as_written(tmp_path):
    calibrate = readme_commands("tessera plan --calibrate")[0]
    plan = next(c for c in readme_commands("tessera plan ") if "--device-kind" in c)
    env = {"TESSERA_CALIBRATION": str(tmp_path / "calibration.json")}
    for command in (calibrate, plan):
        out = _tessera(*command.split()[1:], env=env)
        assert out.returncode == 0, (command, out.stderr[-3000:])
    assert "the rates measured on cpu: " in out.stdout


def _counting_mode():
    """A dispatch mode counting operators, and elements read + written by the elementwise ones."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = self.elements = self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if not outs and func._schema.is_mutable:  # in-place foreach ops return nothing: they write their self
                written = [
                    a for a, spec in zip(args, func._schema.arguments) if spec.alias_info and spec.alias_info.is_write
                ]
                outs = [t for t in tree_flatten(written)[0] if isinstance(t, torch.Tensor)]
            aliased = {t.untyped_storage().data_ptr() for t in ins}
            if (
                func in matmuls
                or "attention" in str(func)
                or not outs
                or (all(o.untyped_storage().data_ptr() in aliased for o in outs) and not func._schema.is_mutable)
            ):
                return out  # matmuls, attention and views move no elementwise traffic
            moved = [t for t in ins + outs if t.dim() > 0]
            self.elements += sum(t.numel() for t in moved)
            self.bytes += sum(t.numel() * t.element_size() for t in moved)
            return out

    return Count()


def test_the_optimizer_bytes_the_step_time_model_states_hold_for_tesseras_clip_and_adamw():
    import torch

    from tessera.models import build_model
    from tessera.training.optim import build_adamw
    from tessera.parallel.clip import clip_grad_norm_
    from tessera.topology.estimators.step_time import OPTIMIZER_BYTES_PER_PARAM

    model = build_model(get_preset("small"), seed=0)
    params = list(model.parameters())
    opt = build_adamw(params, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    for _ in range(2):  # the second step: the moments exist
        for p in params:
            p.grad = torch.randn_like(p)
        with _counting_mode() as counted:
            clip_grad_norm_(params, 1.0)
            opt.step()
    n = sum(p.numel() for p in params)
    assert counted.bytes / n == pytest.approx(OPTIMIZER_BYTES_PER_PARAM["cpu"], rel=0.25)


def _count_step(n_layers: int, tokens: int):
    """Elements read + written by elementwise operators and operators dispatched, in a forward + backward of
    tessera's one-process model (fp32, on CPU) with its loss."""
    import torch

    from tessera.models import build_model
    from tessera.parallel.loss import cross_entropy_sum

    cfg = get_preset("small", n_layers=n_layers)
    model = build_model(cfg, seed=0)
    tokens_in = torch.randint(0, cfg.vocab_size, (tokens // 64, 64))
    with _counting_mode() as counted:
        loss, _ = cross_entropy_sum(model(tokens_in), tokens_in)
        loss.backward()
    return counted.elements, counted.ops


def test_the_counts_the_step_time_model_states_hold_for_tesseras_block():
    """A block's elementwise traffic and operators, recounted (two layers minus one), against the model's
    stated counts: within 25% (they are a model's round figures, not the exact op list)."""
    tokens = 256
    (e2, o2), (e1, o1) = _count_step(2, tokens), _count_step(1, tokens)
    cfg = get_preset("small")
    assert (e2 - e1) / tokens == pytest.approx(block_elements_per_token(cfg), rel=0.25)
    assert o2 - o1 == pytest.approx(OPS_PER_BLOCK, rel=0.25)
