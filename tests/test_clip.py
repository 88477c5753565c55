"""The global grad norm and clipping (parallel/clip.py), and the optimizer's kernels (runtime/training/optim.py).

Norms are compared with a naive float64 definition over the full gradients; the collectives are counted:
one all-reduce per distinct process group the gradients are sharded over (plus pp), whatever the number
of parameters. A step reads the device from the host a fixed number of times, never once per parameter.
"""

import math
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import small_config
from tessera.parallel.clip import clip_grad_norm_, global_grad_norm
from tessera.launching.launch import run_ranks


def _reference_norm(grads) -> float:
    """The naive definition: every full gradient in float64, one vector."""
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))


class _CountAllReduce:
    """Counts torch.distributed.all_reduce calls (and their groups) while active."""

    def __enter__(self):
        self.groups, self._orig = [], dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.groups.append(kwargs.get("group"))
            return self._orig(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


# ---------------------------------------------------------------------- one process
def test_norm_of_mixed_dtypes_matches_float64_and_clipping_reaches_max_norm():
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(n, dtype=dt))
        for n, dt in ((300, torch.float32), (17, torch.bfloat16), (64, torch.float16), (5, torch.float64))
    ]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    params.append(torch.nn.Parameter(torch.randn(4)))  # no gradient: skipped
    reference = _reference_norm(p.grad for p in params if p.grad is not None)
    with _CountAllReduce() as calls:
        norm = clip_grad_norm_(params, max_norm=1.0)
    assert calls.groups == []  # nothing sharded, no pp: no collective at all
    assert norm.dtype == torch.float32 and abs(norm.item() - reference) <= 1e-5 * reference
    clipped = _reference_norm(p.grad for p in params if p.grad is not None)
    assert abs(clipped - 1.0) <= 1e-2  # bf16/fp16 gradients round after scaling


def test_a_large_gradients_norm_on_the_cpu_matches_float64_to_fp32_rounding():
    """torch's CPU fp32 norm accumulates in one sequence (1.1e-5 off at 2^20 elements, 9e-5 at 2^22): the
    one-process reference of every comparison took its grad norm so. Each tensor's norm is taken in fp64 on the
    CPU; the norm is then exact to fp32 rounding at any size."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1 << 22, 1 << 20, 3)]
    for p in params:
        p.grad = torch.randn(p.shape) * 0.01
    want = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))
    got = float(global_grad_norm(params))
    assert abs(got - want) <= 2e-7 * want, (got, want)


def test_a_norm_below_max_norm_leaves_the_gradients_alone():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 0.1)
    norm = clip_grad_norm_([p], max_norm=1.0)
    assert norm.item() == pytest.approx(0.2) and torch.equal(p.grad, torch.full((4,), 0.1))
    assert clip_grad_norm_([p], max_norm=float("inf")).item() == pytest.approx(0.2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_norm_leaves_every_gradient_unscaled(bad):
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([1.0, bad, 2.0]), torch.tensor([30.0, 40.0])
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert not math.isfinite(norm.item())
    assert torch.equal(b.grad, torch.tensor([30.0, 40.0])) and a.grad[0].item() == 1.0


def test_no_gradients_give_a_zero_norm():
    assert global_grad_norm([torch.nn.Parameter(torch.ones(2))]).item() == 0.0


# ---------------------------------------------------------------------- meshes
def _mixed_meshes():
    """DTensors on a tp-only mesh and on the 2-D (dp, tp) mesh, in several placements and dtypes, beside a
    plain (replicated) tensor: the norm against float64, the all-reduces counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = [torch.randn(8, 6), torch.randn(4, 10), torch.randn(12), torch.randn(6, 4).bfloat16(), torch.randn(5)]
    grads = [
        distribute_tensor(full[0], mesh["tp"], [Shard(0)]),
        distribute_tensor(full[1], mesh, [Shard(0), Shard(1)]),
        distribute_tensor(full[2], mesh, [Shard(0), Replicate()]),
        distribute_tensor(full[3], mesh, [Replicate(), Shard(1)]),
        full[4],
    ]
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    reference = _reference_norm(full)
    with _CountAllReduce() as calls:
        norm = clip_grad_norm_(params, max_norm=1.0).item()
    groups = {id(g) for g in calls.groups}
    clipped = _reference_norm([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params])
    return norm, reference, len(calls.groups), len(groups), clipped


def test_mixed_meshes_and_dtypes_match_float64_with_one_all_reduce_per_group():
    for norm, reference, calls, groups, clipped in run_ranks(_mixed_meshes, 4, timeout=120):
        assert abs(norm - reference) <= 1e-5 * reference
        assert calls == groups == 2  # dp and tp (the tp-only mesh shares the 2-D mesh's tp group)
        assert abs(clipped - 1.0) <= 1e-2


def _trainer_norm_and_calls(config):
    """After one step's backward on config's layout: the norm clip_grad_norm_ computes, the float64 norm of
    the full gradients, the all-reduces clipping issued, and the distinct groups the gradients shard over."""
    from torch.distributed.tensor import DTensor

    from tessera.parallel.clip import _sharded_groups
    from tessera.parallel.loss import count_valid
    from tessera.parallel.tensor import full_tensor
    from tessera.data.batches import split_microbatches
    from tessera.topology import Meshes
    from tessera.trainer import Trainer

    from helpers import gather_by_name

    trainer = Trainer(config, torch.device("cpu"))
    inputs, targets = trainer.data.next_global_batch()
    local = trainer.local_batch(inputs, targets)
    trainer.runner.forward_backward(split_microbatches(*local, config.data.microbatches), count_valid(targets))
    params = trainer.parameters()
    full = gather_by_name(
        {n: full_tensor(p.grad) for part in trainer.parts for n, p in part.named_parameters()}, everywhere=True
    )
    expected = {id(group) for p in params if isinstance(p.grad, DTensor) for _, group in _sharded_groups(p.grad)}
    pp = Meshes.group(trainer.meshes.pp)
    with _CountAllReduce() as calls:
        norm = clip_grad_norm_(params, config.optimizer.max_grad_norm, pp).item()
    return norm, _reference_norm(full.values()), len(calls.groups), len(expected) + (pp is not None)


@pytest.mark.parametrize(
    "layout", [dict(dp=2, tp=2), dict(pp=2, tp=2, microbatches=2, n_layers=4)], ids=["dp2xtp2", "pp2xtp2"]
)
def test_a_trainer_step_norm_matches_float64_with_one_all_reduce_per_group(layout):
    config = small_config(**layout)
    results = run_ranks(_trainer_norm_and_calls, config.layout.world_size, config, timeout=180)
    for norm, reference, calls, groups in results:
        assert abs(norm - reference) <= 1e-6 * reference, (norm, reference)
        assert calls == groups == 2, (calls, groups)  # dp2xtp2: dp_shard_cp and tp; pp2xtp2: tp and pp
    assert len({r[0] for r in results}) == 1  # the same norm on every rank


# ---------------------------------------------------------------------- the optimizer and host reads
def _optimizer_options(config):
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    return [[(g["foreach"], g["fused"]) for g in o.param_groups] for o in trainer.optimizer.optimizers]


@pytest.mark.parametrize(
    "layout", [dict(), dict(dp=2, tp=2), dict(pp=2, schedule="interleaved-1f1b", virtual=2, microbatches=2, n_layers=4)]
)
def test_adamw_runs_its_multi_tensor_kernels_one_group_per_mesh(layout):
    config = small_config(**layout)
    for options in run_ranks(_optimizer_options, config.layout.world_size, config, timeout=120):
        # fused on CPU as on CUDA; each part's parameters share one mesh here, so one group per part
        assert all(groups == [(False, True)] for groups in options), options
        assert len(options) == config.parallel.virtual


def test_a_plain_tensor_beside_dtensors_gets_its_own_group():
    from tessera.training.optim import build_adamw, groups_by_mesh

    plain = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    assert groups_by_mesh(plain) == [plain]
    o = build_adamw(plain, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    state = o.state_dict()
    for g in state["param_groups"]:  # a checkpoint from before the kernels: the loop
        g["foreach"], g["fused"] = None, None
    o.load_state_dict(state)
    assert o.param_groups[0]["fused"] is True and not o.param_groups[0]["foreach"]  # the run's choice is kept


def _adamw_on_local_shards_and_through_dtensor():
    """Two AdamW over equal DTensor parameters (sharded, replicated), two steps each: one as DTensor dispatches
    it, one on the local shards; and a third over a parameter whose gradient is a pending (Partial) sum, which
    must keep DTensor's path. Returns what the test compares."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from tessera.parallel.tensor import full_tensor
    from tessera.training.optim import build_adamw, on_local_shards

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = [torch.randn(6, 3), torch.randn(4), torch.randn(5, 2)]
    placements = [[Shard(0)], [Replicate()], [Replicate()]]
    sides = []
    for _ in range(2):
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, pl)) for t, pl in zip(full, placements)]
        sides.append((params, build_adamw(params[:2], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)))
    sides.append(
        ([sides[0][0][2]], build_adamw([sides[0][0][2]], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    )

    class OpsOnDTensors(TorchDispatchMode):
        """The ops dispatched with a DTensor among their arguments (a mode sees them before DTensor does)."""

        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0]):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    decisions, partial_decisions = [], []
    for step in range(2):
        torch.manual_seed(step + 1)
        grads = [torch.randn_like(t) for t in full]
        for params, _ in sides[:2]:
            for p, g, pl in zip(params, grads, placements):
                p.grad = distribute_tensor(g, mesh, pl)
        # the third parameter's gradient as a pending sum: each rank holds half of it
        sides[0][0][2].grad = DTensor.from_local(grads[2] / 2, mesh, [Partial()], run_check=False)
        sides[0][1].step()
        with OpsOnDTensors() as seen, on_local_shards(sides[1][1]):
            sides[1][1].step()
        decisions.append(seen.ops)
        with OpsOnDTensors() as seen, on_local_shards(sides[2][1]):  # not applicable to a pending sum
            sides[2][1].step()
        partial_decisions.append(seen.ops)
    through, local = sides[0], sides[1]
    return {
        "params": [torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(through[0][:2], local[0][:2])],
        "state": [
            (
                type(local[1].state[b][k]).__name__,
                k == "step" or local[1].state[b][k].placements == b.placements,
                torch.equal(*(full_tensor(side.state[p][k]) for side, p in ((through[1], a), (local[1], b)))),
            )
            for a, b in zip(through[0][:2], local[0][:2])
            for k in ("step", "exp_avg", "exp_avg_sq")
        ],
        "decisions": decisions,
        "partial_decisions": partial_decisions,
    }


def test_adamw_on_local_shards_is_bitwise_dtensors_own_step_and_keeps_its_state_placed():
    result = run_ranks(_adamw_on_local_shards_and_through_dtensor, 2, timeout=120)[0]
    assert result["params"] == [True, True]
    for kind, placed, equal in result["state"]:
        assert equal and placed
    assert [k for k, _, _ in result["state"]] == ["Tensor", "DTensor", "DTensor"] * 2  # the step count stays plain
    assert result["decisions"] == [[], []]  # no op reached DTensor on the local path
    # a Partial gradient keeps DTensor's path (which, on torch 2.13, leaves such a parameter as it was: tessera's
    # gradients are never Partial at the step, so neither path meets one in training)
    assert all("aten._fused_adamw_.default" in ops for ops in result["partial_decisions"]), result["partial_decisions"]


def _host_reads_per_step(config):
    """Host reads of device values (item, tolist, bool, float, int) during the second training step."""
    from tessera.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    trainer.train_step()
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__", "__int__")}

    def counted(name):
        def read(self, *args, **kwargs):
            # not AdamW's step counters (torch.optim's own reads of its own state)
            if "torch/optim/" not in sys._getframe(1).f_code.co_filename.replace("\\", "/"):
                reads.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        trainer.train_step()
    finally:
        for name, f in originals.items():
            setattr(torch.Tensor, name, f)
    return sorted(reads), sum(1 for _ in trainer.parameters())


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2)], ids=["tp2", "dp2"])
def test_a_step_reads_the_device_a_fixed_number_of_times_not_once_per_parameter(layout):
    few = run_ranks(_host_reads_per_step, 2, small_config(n_layers=1, **layout), timeout=120)[0]
    many = run_ranks(_host_reads_per_step, 2, small_config(n_layers=4, **layout), timeout=120)[0]
    assert few[1] < many[1]  # more parameters ...
    assert few[0] == many[0], (few, many)  # ... the same reads (the non-finite check, the step-time exchange)
    assert len(few[0]) <= 3, few


def test_the_clip_folded_into_fused_adamw_equals_scaling_the_gradients_first():
    """Issue 64 item 6: fused AdamW divides each gradient by grad_scale (1 / the clip's coefficient) as it reads it,
    so the clip costs no pass of its own; the update equals scaling first up to rounding, exactly when no clip
    applies (coefficient 1), and foreach AdamW and Muon, which cannot fold it, get their gradients scaled."""
    from tessera.parallel.clip import clip_coefficient, scale_gradients_
    from tessera.training.optim import PartOptimizers, build_adamw

    torch.manual_seed(0)
    for max_norm in (0.5, 1e9):  # clipping, and none
        a = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        explicit, folded = (
            PartOptimizers([build_adamw(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)]) for ps in (a, b)
        )
        assert folded.folds_scale(folded.optimizers[0])
        grads = [torch.randn(p.shape) for p in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        coef = clip_coefficient(norm, max_norm)
        scale_gradients_(a, coef)
        explicit.step()
        folded.step(grad_scale=coef.reciprocal())
        for p, q in zip(a, b):
            if max_norm > 1e6:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        assert not hasattr(folded.optimizers[0], "grad_scale")  # set for the step only
    foreach = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=True)
    assert not PartOptimizers([foreach]).folds_scale(foreach)
