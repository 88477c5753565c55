"""bf16 without a data axis (parallel/mixed_precision.py): the compute copies train bit for bit as FSDP2's bf16
policy on the degree-1 mesh did (the reference, parallelize.PRECISION_ALONE = "fsdp2"), every step's loss, grad
norm, step-1 gradients and the weights after the last step, on one process and on the layouts without data axes
(tp, pp in 1F1B and ZB-H1's split backward), with AC, a tied head, FP8 and compile; and a step runs none of
FSDP2's gather and reduce copies."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import clean_name, small_config, trainer_for
from tessera.launching.launch import run_ranks
from tessera.parallel.tensor import full_tensor

# the ops FSDP2 runs to gather and reduce, even on one rank (torch 2.11 and 2.13)
FSDP2_COPY_OPS = ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat", "reduce_scatter", "all_gather")


class OpNames(TorchDispatchMode):
    """The names of the aten and c10d ops run meanwhile."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def trained(config, precision_alone: str, count_ops: bool = False):
    """(losses, grad norms, step-1 gradients by name, the weights after the last step by name, the matmul dtypes,
    the ops of step 2) of `config` trained with parallelize.PRECISION_ALONE set to `precision_alone`."""
    # the module (tessera.parallel's `parallelize` attribute is the function of that name)
    parallelize = importlib.import_module("tessera.parallel.parallelize")
    parallelize.PRECISION_ALONE = precision_alone
    trainer = trainer_for(config)
    grads: dict[str, torch.Tensor] = {}

    def keep(parts):
        for part in parts:
            for name, p in part.named_parameters():
                grads[clean_name(name)] = full_tensor(p.grad).detach().clone()

    records, ops = [], []
    for step in range(config.runtime.steps):
        if count_ops and step == 1:
            with OpNames() as seen:
                records.append(trainer.train_step().record())
            ops = seen.names
        else:
            records.append(trainer.train_step(on_grads=keep if step == 0 else None).record())
    weights = {
        clean_name(n): full_tensor(p).detach().clone() for part in trainer.parts for n, p in part.named_parameters()
    }
    return (
        [r["loss"] for r in records],
        [r["grad_norm"] for r in records],
        grads,
        weights,
        [r["compute_dtype"] for r in records],
        ops,
    )


def _run(world: int, config, mode: str, count_ops: bool = False):
    """Rank 0's run, with every rank's gradients and weights (a pipeline stage holds its own)."""
    ranks = run_ranks(trained, world, config, mode, count_ops, timeout=300)
    grads = {k: v for r in ranks for k, v in r[2].items()}
    weights = {k: v for r in ranks for k, v in r[3].items()}
    return (ranks[0][0], ranks[0][1], grads, weights, ranks[0][4], ranks[0][5])


def _both(world: int, **kw):
    config = small_config(mixed_precision="bf16", **kw)
    return [_run(world, config, mode) for mode in ("fsdp2", "copies")]


def _assert_bitwise(reference, copies):
    for what, a, b in zip(("losses", "grad norms"), reference[:2], copies[:2]):
        assert a == b, f"{what}: FSDP2 {a}, copies {b}"
    for what, a, b in zip(("step-1 gradient", "weight"), reference[2:4], copies[2:4]):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype == torch.float32, (what, name, a[name].dtype, b[name].dtype)
            assert torch.equal(a[name], b[name]), f"{what} {name}: {(a[name] - b[name]).abs().max().item()} apart"
    assert reference[4] == copies[4] and "float32" not in copies[4], (reference[4], copies[4])  # the records' dtypes


def test_one_process_bf16_equals_fsdp2s_degree_one_policy_bit_for_bit_and_copies_nothing_for_it():
    reference, copies = _both(1, microbatches=2, ac="full")
    _assert_bitwise(reference, copies)
    config = small_config(mixed_precision="bf16", microbatches=2)
    fsdp_ops, copy_ops = [_run(1, config, mode, count_ops=True)[5] for mode in ("fsdp2", "copies")]
    assert any(name in FSDP2_COPY_OPS for name in fsdp_ops), sorted(set(fsdp_ops))  # the reference does run them
    assert not [name for name in copy_ops if name in FSDP2_COPY_OPS]
    # one cast a parameter a step: the masters' count of _to_copy ops to bf16 at most, against FSDP2's copies
    assert copy_ops.count("_to_copy") < fsdp_ops.count("_to_copy") + fsdp_ops.count("copy_")


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, kw",
    [
        (1, dict(ac="op", microbatches=2)),
        (1, dict(model="qwen3-debug", microbatches=2)),  # the tied head: one copy, two uses
        (1, dict(fp8="tensorwise")),
        (1, dict(compile=True)),
        (2, dict(tp=2, sequence_parallel=True, microbatches=2)),
        (2, dict(pp=2, schedule="1f1b", microbatches=4)),
        (2, dict(pp=2, schedule="zb-h1", microbatches=4)),
    ],
    ids=["ac_op", "tied", "fp8", "compile", "tp2+sp", "pp2-1f1b", "pp2-zb-h1"],
)
def test_layouts_without_data_axes_equal_fsdp2s_policy_bit_for_bit(world, kw):
    reference, copies = _both(world, **kw)
    _assert_bitwise(reference, copies)


def _with_weights_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The two-layer model's output computed from its fp32 masters cast to bf16 now (the definition)."""
    h = x.to(torch.bfloat16)
    for layer in model:
        h = torch.nn.functional.linear(
            h, layer._parameters["weight"].to(h.dtype), layer._parameters["bias"].to(h.dtype)
        )
    return h


def test_a_loop_of_ones_own_computes_with_the_weights_an_optimizer_or_a_load_just_changed():
    from tessera.parallel.mixed_precision import apply_compute_copies

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    apply_compute_copies(model, torch.bfloat16, [[m] for m in model])
    # torch's fused AdamW writes the parameters in place without bumping their version counters
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    x = torch.randn(2, 8)
    for _ in range(2):
        out = model(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, _with_weights_of(model, x))
        out.float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # an evaluation, a checkpoint loaded, another evaluation: no backward between them
        model(x)
        changed = {k: v + 1 for k, v in model.state_dict().items()}
        model.load_state_dict(changed)
        assert torch.equal(model(x), _with_weights_of(model, x))
    assert model[0].weight is model[0]._parameters["weight"] or model[0].weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters, for the optimizer and state
