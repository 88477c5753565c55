"""The planner's per-rank peak memory against the tensor storage a rank really allocates at its peak.

"Measured" is every live tensor storage (parameters, gradients, optimizer state, activations, FSDP2's
gathered copies, communication and temporary buffers), re-read around each operator of a training step
(tessera.metrics.memtrack.LiveTensorBytes, the same as `tessera train --track-memory`; torch's MemTracker gives
the same figures where it runs, but refuses modules called once per microbatch). The planner must be
within 10% on every layout here (tessera bench adds more on each run: ac full, pp2 x dp2), including
SHARD_GRAD_OP (sharded and gathered copies together) and tp beyond the kv heads (replicated K/V weights).

The layouts of one world size are measured one after the other in one spawn (tests/shared_spawns.py): a rank
tracks its own Trainer's tensors and what its step allocates, so the figures are those of a spawn per layout,
to the byte (all 18 compared, 2026-11-29).
"""

import sys

import pytest

from helpers import peak_tensor_bytes, small_config
from shared_spawns import SharedSpawns, selected_keys
from tessera.training.estimate import planner_estimate

BASE = dict(model="small", seq_len=128, global_batch=8)
LAYOUTS = {
    "one": {},
    "dp2 SHARD_GRAD_OP": dict(dp=2, fsdp="SHARD_GRAD_OP"),
    "tp8 > kv heads": dict(tp=8),
    "dp2 x tp2 + sp": dict(dp=2, tp=2, sequence_parallel=True),
    "pp2 interleaved v2": dict(pp=2, virtual=2, schedule="interleaved-1f1b", microbatches=4, n_layers=8),
    "cp2 x tp2 + sp": dict(cp=2, tp=2, sequence_parallel=True),
    "dp2 ac op": dict(dp=2, ac="op"),
    "dp2 microbatches2": dict(dp=2, microbatches=2),
    # mixture of experts: E / ep experts per rank, their FSDP2 unit over edp (the activations an estimate)
    "moe dp2 x ep2": dict(model="qwen3-moe-debug", dp=2, ep=2),
    "moe dp4 x ep2": dict(model="qwen3-moe-debug", dp=4, ep=2),
    # latent attention (its latents and the value head dim), dense first layers then group-limited MoE
    "deepseek-v3 one": dict(model="deepseek-v3-debug"),
    "deepseek-v3 dp2 x ep2": dict(model="deepseek-v3-debug", dp=2, ep=2),
    "deepseek-v3 tp2 + sp": dict(model="deepseek-v3-debug", tp=2, sequence_parallel=True),
    "deepseek-v3 pp2": dict(model="deepseek-v3-debug", pp=2, microbatches=2),
    # sinks, sliding windows, biased experts
    "gpt-oss one": dict(model="gpt-oss-debug"),
    "gpt-oss dp2 x ep2": dict(model="gpt-oss-debug", dp=2, ep=2),
    "gpt-oss tp2 + sp": dict(model="gpt-oss-debug", tp=2, sequence_parallel=True),
    "gpt-oss cp2": dict(model="gpt-oss-debug", cp=2),
}


def predicted_peak(config) -> dict:
    return planner_estimate(config).memory  # the layout, strategy, AC, schedule and sp the config runs, in fp32


def spawned_rows(session: pytest.Session) -> SharedSpawns:
    """Every rank's peak of each layout, one spawn per world size (tests/shared_spawns.py)."""
    rows = {}
    for case, layout in LAYOUTS.items():
        config = small_config(**{**BASE, **layout})
        rows[("test_predicted_peak_memory_is_within_10_percent_of_the_measured", case)] = (
            peak_tensor_bytes,
            config.layout.world_size,
            (config,),
        )
    return SharedSpawns(rows, selected_keys(session, sys.modules[__name__]), timeout_per_row=120.0, every_rank=True)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_predicted_peak_memory_is_within_10_percent_of_the_measured(case, runs):
    key = ("test_predicted_peak_memory_is_within_10_percent_of_the_measured", case)
    _, _, (config,) = runs.rows[key]
    measured = max(runs.result(key))
    predicted = predicted_peak(config)
    breakdown = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in predicted.items())
    assert abs(predicted["total"] - measured) <= 0.10 * measured, (
        f"{case}: predicted {predicted['total'] / 1e6:.2f} MB, measured {measured / 1e6:.2f} MB ({breakdown})"
    )


def test_shard_grad_op_holds_the_sharded_and_the_gathered_parameters():
    config = small_config(**BASE, dp=2, fsdp="SHARD_GRAD_OP")
    m = predicted_peak(config)
    full = config.model_config.num_params() * 4
    assert m["parameters"] == pytest.approx(full / 2, rel=0.01) and m["gathered_params"] == pytest.approx(
        full, rel=0.01
    )


def test_accumulated_gradients_are_held_unsharded_in_fp32_under_bf16(tmp_path):
    """bf16 compute, two microbatches on dp 2: FSDP2 keeps the earlier microbatch's gradients unsharded, upcast
    to its reduce dtype (fp32), until the last backward reduces them. Measured as the difference between that
    run and one microbatch of the same rows (everything else equal), against the planner's unsharded_grads
    (the bf16 figure would be half)."""
    from tessera.launching.launch import run_ranks

    one = small_config(**{**BASE, "global_batch": 4}, dp=2, mixed_precision="bf16")
    two = small_config(**BASE, dp=2, microbatches=2, mixed_precision="bf16")
    measured = [max(run_ranks(peak_tensor_bytes, 2, c, timeout=120)) for c in (one, two)]
    predicted = predicted_peak(two)["unsharded_grads"]
    assert predicted > 0 and predicted_peak(one)["unsharded_grads"] == 0
    assert abs((measured[1] - measured[0]) - predicted) <= 0.10 * predicted, (measured, predicted)


@pytest.mark.parametrize("model", ["1b", "qwen3-moe-debug"])
def test_a_gpus_swiglu_keeps_one_ffn_tensor_fewer_than_torchs_ops(model):
    """On a GPU the Triton SwiGLU (kernels/triton_swiglu.py) keeps gate, up and the product for its backward,
    where torch's ops also keep silu(gate): one ffn-wide tensor per MLP (per routed assignment, and the shared
    expert's) fewer, in the eager count; the CPU's count (measured above) keeps all four."""
    from tessera.models.spec import get_preset, spec_of
    from tessera.topology.estimators.rank_memory import layer_activation_bytes

    cfg = get_preset(model)
    shape = spec_of(cfg).shape(cfg)
    rows, seq = 2, 64
    layer = shape.n_layers - 1  # an MoE block where the model has dense ones first
    cpu = layer_activation_bytes(shape, rows, seq, 1, False, "none", 2, layer=layer, cpu=True)
    gpu = layer_activation_bytes(shape, rows, seq, 1, False, "none", 2, layer=layer, cpu=False)
    if shape.n_experts:
        ffn = shape.top_k * shape.ffn_dim + shape.shared_ffn_dim
    else:
        ffn = shape.ffn_dim
    # the CPU's fused attention also keeps k and v repeated to the query heads, the GPU's kernel at the kv heads
    repeated = 2 * (shape.n_heads - shape.n_kv_heads) * shape.head_dim
    assert cpu - gpu == rows * seq * (ffn + repeated) * 2  # one bf16 tensor per ffn feature and token fewer
