"""Rank functions shared by the multi-rank tests (module level, so the rank launcher can pickle them)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

from tessera.config import Config
from tessera.data.corpus import TokenStream
from tessera.parallel.tensor import full_tensor
from tessera.trainer import Trainer

# modules that need an optional package skip without it, found without importing it: every worker collects every
# file, and the import (transformers 1.3 s, torchao.float8 1.6 s) is paid only by the worker running such a file
NEEDS_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (pip install -e '.[test]')"
)
NEEDS_TORCHAO = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs torchao for FP8 (pip install -e '.[test]')"
)


def small_config(**kw) -> Config:
    base = dict(model="debug", seq_len=32, global_batch=4, steps=3, lr=3e-3, warmup=1, quiet=True)
    base.update(kw)
    return Config.create(**base)


class MaskedStream(TokenStream):
    """The token stream with targets masked (-100) unevenly over the rows of each global batch: the
    first half of the rows keeps only every 8th target, the rest keep all. Under the mean-of-means rule
    a dp rank holding the masked rows would weigh its few targets like another rank's many."""

    def global_batch_at(self, cursor: int):
        inputs, targets = super().global_batch_at(cursor)
        targets = targets.clone()
        half = targets.shape[0] // 2
        keep = torch.zeros_like(targets[:half], dtype=torch.bool)
        keep[:, ::8] = True
        targets[:half][~keep] = -100
        return inputs, targets


# the world meshes this rank built, by layout shape and process group: the rows of one spawn that share a
# shape share one mesh and its process groups (Trainer's `mesh`), as a sweep over configs would
_WORLD_MESHES: dict = {}


def trainer_for(config: Config, data=None) -> Trainer:
    """A CPU Trainer of `config` on this spawn's world mesh of the config's layout shape (built on first use)."""
    import torch.distributed as dist

    key = (config.layout.shape, id(dist.group.WORLD))
    mesh = _WORLD_MESHES.get(key)
    if mesh is None:
        mesh = _WORLD_MESHES[key] = config.layout.build_mesh("cpu")
    return Trainer(config, torch.device("cpu"), data=data, mesh=mesh)


def clean_name(name: str) -> str:
    """Parameter name as the one-process model spells it (tessera's own rule)."""
    from tessera.models.init import one_process_name

    return one_process_name(name)


def gather_by_name(local: dict[str, torch.Tensor], everywhere: bool = False, layout=None) -> dict[str, torch.Tensor]:
    """Every rank's {name: full tensor} merged (pipeline ranks hold different stages): on rank 0 ({} on the
    others), or on every rank with `everywhere` (each rank then unpickles every other's tensors: on 16 ranks
    that was 2.5% of the suite's CPU where only rank 0 reads them). With the run's `layout`, the tensors are
    full ones every rank of a pipeline stage holds alike, so only the stage's last rank sends them (the copy
    the merge keeps either way) and the others send nothing: a 16-rank row pickled and read 16 copies."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return local
    if layout is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
        stage = layout.index("pp", rank)
        if rank != max(r for r in range(world) if layout.index("pp", r) == stage):
            local = {}
    everyone: list = [None] * dist.get_world_size()
    if everywhere:
        dist.all_gather_object(everyone, local)
    else:
        dist.gather_object(local, everyone if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return {}
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part)
    return merged


def _records_and_grads(config: Config, data=None, tp_rounding: int = 1):
    """(rank, step records, full gradients of step 1 before clipping gathered by name) of config's steps;
    `tp_rounding` > 1: one process rounding its matmuls' partial sums where that many tp ranks would."""
    trainer = trainer_for(config, data)
    if tp_rounding > 1:
        round_like_tp(trainer, tp_rounding)
    grads: dict[str, torch.Tensor] = {}

    def keep(parts):
        for part in parts:
            for name, p in part.named_parameters():
                grads[clean_name(name)] = full_tensor(p.grad).detach().clone()

    records = [trainer.train_step(on_grads=keep if s == 0 else None).record() for s in range(config.runtime.steps)]
    return trainer.rank, records, gather_by_name(grads, layout=trainer.layout)


def train_losses_and_grads(config: Config, masked: bool = False):
    """Run config's steps; return (per-step losses, per-step grad norms, full gradients of step 1 before
    clipping) on rank 0 and None elsewhere. Every rank takes part in gathering the gradients."""
    data = MaskedStream(config.data.seq_len, config.data.global_batch) if masked else None
    rank, records, grads = _records_and_grads(config, data)
    if rank != 0:
        return None
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], grads


def measured_model_states(config: Config):
    """Per-rank bytes held: parameters right after forward (gathered if the strategy keeps them so),
    gradients after backward, optimizer state after the step."""
    from tessera.parallel.fsdp import model_state_bytes_on_rank

    trainer = trainer_for(config)
    inputs, targets = trainer.local_batch(*trainer.data.next_global_batch())
    loss_sum, count = trainer.loss_fn(trainer.model(inputs), targets)
    params = model_state_bytes_on_rank(trainer.model)["parameters"]
    (loss_sum / count).backward()
    grads = model_state_bytes_on_rank(trainer.model)["gradients"]
    trainer.optimizer.step()
    optim = model_state_bytes_on_rank(trainer.model, trainer.optimizer)["optimizer"]
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": optim,
        "num_params": trainer.model_config.num_params(),
    }


def _first_batch_loss(trainer: Trainer) -> float:
    """The global-batch mean loss of the first batch, no step taken."""
    inputs, targets = trainer.data.next_global_batch()
    local_inputs, local_targets = trainer.local_batch(inputs, targets)
    with torch.no_grad():
        loss_sum, _ = trainer.loss_fn(trainer.model(local_inputs), local_targets)
    if trainer.meshes.loss is not None:
        torch.distributed.all_reduce(loss_sum, group=trainer.meshes.loss.get_group())
    return loss_sum.item() / int((targets != -100).sum())


def first_loss(config: Config):
    """The loss of the first batch, no step taken (after --init-from, if set)."""
    from tessera.checkpointing import checkpoint

    trainer = trainer_for(config)
    if config.checkpoint.init_from:
        checkpoint.load_full_state_dict(trainer.model, config.checkpoint.init_from)
    return _first_batch_loss(trainer)


def full_parameters(config: Config):
    """Every parameter's full value after the meta build, parallelize and materialize (rank 0)."""
    trainer = trainer_for(config)
    out = gather_by_name(named_full_parameters(trainer), layout=trainer.layout)
    return out if trainer.rank == 0 else None


def named_full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        clean_name(n): full_tensor(p).detach().clone() for part in trainer.parts for n, p in part.named_parameters()
    }


def resumed_full_parameters(config: Config):
    """Every parameter's full value after loading config's --resume checkpoint (rank 0)."""
    trainer = trainer_for(config)
    trainer.load(config.resume_path)
    out = gather_by_name(named_full_parameters(trainer), layout=trainer.layout)
    return out if trainer.rank == 0 else None


def comm_of_first_step(config: Config):
    """This rank's --comm-stats record of one step: bytes by axis counted, and predicted."""
    trainer = trainer_for(config)
    comm = trainer.train_step().comm
    return comm["bytes_by_axis"], comm["analytic_bytes_by_axis"], comm["bytes_by_collective"]


def peak_tensor_bytes(config: Config) -> float:
    """This rank's peak tensor storage during its second training step (the optimizer state exists by then)."""
    from tessera.metrics.memtrack import LiveTensorBytes

    trainer = trainer_for(config)
    trainer.train_step()
    tracker = LiveTensorBytes()
    tracker.track_existing(trainer.parts, trainer.optimizer.optimizers)
    with tracker:
        trainer.train_step()
    return float(tracker.peak)


def train_losses_and_grads_saving(config: Config, save_after: int):
    """`train_losses_and_grads`, also saving a checkpoint into config's --checkpoint-dir after step `save_after`."""
    from tessera.checkpointing.checkpoint import CheckpointManager

    trainer = trainer_for(config)
    manager = CheckpointManager(config.checkpoint.dir, keep=config.checkpoint.keep)
    grads: dict[str, torch.Tensor] = {}

    def keep(parts):
        for part in parts:
            for name, p in part.named_parameters():
                grads[clean_name(name)] = full_tensor(p.grad).detach().clone()

    records = []
    for s in range(config.runtime.steps):
        records.append(trainer.train_step(on_grads=keep if s == 0 else None).record())
        if s + 1 == save_after:
            trainer.save(manager)
    grads = gather_by_name(grads, layout=trainer.layout)
    if trainer.rank != 0:
        return None
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], grads


def train_with_dtypes(config: Config, tp_rounding: int = 1):
    """`train_losses_and_grads` plus the matmul dtype each step's record reports (measured on step 1); with
    `tp_rounding` > 1 (one process), rounding as on that many tp ranks (`round_like_tp`)."""
    rank, records, grads = _records_and_grads(config, tp_rounding=tp_rounding)
    if rank != 0:
        return None
    return (
        [r["loss"] for r in records],
        [r["grad_norm"] for r in records],
        grads,
        [r["compute_dtype"] for r in records],
        records[0]["matmul_flops_by_dtype"],
    )


def train_with_dtypes_and_graphs(config: Config):
    """`train_with_dtypes` plus what dynamo compiled meanwhile in this process: (graphs, {graph break: count})."""
    from torch._dynamo.utils import counters

    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    run = train_with_dtypes(config)
    new_breaks = {k: n - breaks.get(k, 0) for k, n in counters["graph_break"].items() if n > breaks.get(k, 0)}
    return None if run is None else (*run, counters["stats"]["unique_graphs"] - graphs, new_breaks)


def train_with_records(config: Config):
    """`train_losses_and_grads` plus every step's record (rank 0's)."""
    rank, records, grads = _records_and_grads(config)
    if rank != 0:
        return None
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], grads, records


@contextlib.contextmanager
def _captured_here(cwd: str | os.PathLike | None, env: dict[str, str] | None) -> Iterator[list[str]]:
    """This process's fds 1 and 2 (and sys.stdout, sys.stderr) into files meanwhile, in `cwd` if given, with `env`
    added to the environment; the list it yields holds (stdout, stderr) after. The ranks a run starts write to
    fds 1 and 2 (tessera.launching.launch hands them over), so they are captured too."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        saved = os.dup(1), os.dup(2)
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        out = open(1, "w", buffering=1, closefd=False)
        err = open(2, "w", buffering=1, closefd=False)
        texts: list[str] = []
        try:
            place = contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), place:
                with mock.patch.dict(os.environ, env or {}):
                    yield texts
        finally:
            out.flush()
            err.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            for f in (out_file, err_file):
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))


def cli_here(
    *argv: str, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`tessera ARGV` through the command line's own main() in this process, captured as a subprocess run
    would be (exit code, stdout, stderr), in `cwd` if given, with `env` added to this process's environment
    meanwhile (the command reads it; ranks forked from the running forkserver do not see it).
    A fresh interpreter costs ~5 s a call here (its imports, then the forkserver's); the tests that are
    about the interpreter (`python -m tessera`, the console script, torchrun, signals) still start one."""
    from tessera.commands.main import exit_code, main  # lazy: the rank functions above are pickled without the CLI

    with _captured_here(cwd, env) as texts:
        try:
            code = main(list(map(str, argv)))
        except SystemExit as e:  # argparse's usage errors (2), --help (0)
            code = exit_code(e)  # a message to stderr, which points at err meanwhile
    return subprocess.CompletedProcess(["tessera", *map(str, argv)], code, *texts)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script_here(
    name: str, *argv: str | os.PathLike, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """`python benchmarks/NAME.py ARGV` through the script's own main(argv) in this process, captured as
    cli_here captures a command: the script imported as module NAME, which is how its ranks import it too
    (conftest puts benchmarks/ on the path of the forkserver they fork from), instead of a fresh interpreter
    and its own forkserver (~5 CPU seconds a call here: bench_muon's tiny run 7.5 -> 2.6). torch's thread
    count, which a benchmark sets for its timing, is put back after. Not for a script that changes this
    process beyond that (bench_planner_check.py starts a process group here and adds presets to tessera's
    table: tests/test_calibration.py runs it as a command); a script run as `python SCRIPT`, whose ranks
    import it as `__mp_main__`, stays tested by gpu_suite.py's and the examples' tests."""
    from tessera.commands.main import exit_code  # lazy: as in cli_here

    path = BENCHMARKS / f"{name}.py"
    module = sys.modules.get(name)
    if module is None or Path(module.__file__ or "") != path:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        with _captured_here(cwd, None) as texts:
            try:
                code = module.main(list(map(str, argv)))
            except SystemExit as e:  # argparse's usage errors (2), a script's own sys.exit
                code = exit_code(e)  # as the interpreter makes of it: None is 0, a message goes to stderr and is 1
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["python", str(path), *map(str, argv)], code, *texts)


# One process rounding where tensor parallel rounds (the bf16 contract's tolerance, tests/test_contract_bf16.py).
# A tp rank's row-parallel matmul sums its share of the inner dimension and rounds it to bf16, and the ranks'
# shares are added in bf16 (the all-reduce or reduce-scatter), where one process sums the whole dimension and
# rounds once; a column-parallel matmul's input gradient likewise. Below, the same partial sums in one process,
# with no collective: a run on which the bf16 rounding of a tp layout is measured without its parallel code.


class _RowParallelRounding(torch.autograd.Function):
    """x @ w.T as `parts` partial sums over the inner dimension, each rounded to x's dtype, added in it."""

    @staticmethod
    def forward(ctx, x, w, parts):
        ctx.save_for_backward(x, w)
        return sum_rounded(torch.nn.functional.linear(a, b) for a, b in zip(x.chunk(parts, -1), w.chunk(parts, 1)))

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.flatten(0, -2).t() @ x.flatten(0, -2), None


class _ColumnParallelRounding(torch.autograd.Function):
    """x @ w.T as one process computes it; the input's gradient as `parts` rounded partial sums over the output
    dimension (each rank's columns), added in the gradient's dtype."""

    @staticmethod
    def forward(ctx, x, w, parts):
        ctx.save_for_backward(x, w)
        ctx.parts = parts
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        dx = sum_rounded(g @ part for g, part in zip(grad.chunk(ctx.parts, -1), w.chunk(ctx.parts, 0)))
        return dx, grad.flatten(0, -2).t() @ x.flatten(0, -2), None


def sum_rounded(partials) -> torch.Tensor:
    partials = iter(partials)
    total = next(partials)
    for partial in partials:
        total = total + partial  # in the partials' dtype: rounded at each addition, as a bf16 all-reduce adds
    return total


def round_like_tp(trainer: Trainer, tp: int) -> None:
    """Make a one-process trainer's bias-free linear layers round as on `tp` ranks, by the family's tp plan:
    rowwise layers in the forward, colwise ones (and the K/V projections where tp splits the kv heads) in the
    backward. Not emulated: the output head (the fused loss multiplies by its weight without calling it) and
    K/V projections that tp replicates (tp beyond the kv heads), whose input gradients tp ranks also add up."""
    from tessera.parallel.tp_plan import matches

    if trainer.layout.world_size != 1:
        raise ValueError(f"round_like_tp emulates tp ranks in one process; this trainer has {trainer.layout}")
    splits_kv = trainer.model_config.n_kv_heads % tp == 0
    rows_rounded = 0
    for part in trainer.parts:
        for name, module in part.named_modules():
            style = next((s for p, s in trainer.spec.tp_plan if matches(p, name)), None)
            row, column = style == "rowwise", style == "colwise" or (style == "kv" and splits_kv)
            if isinstance(module, torch.nn.Linear) and module.bias is None and (row or column):
                rounding = _RowParallelRounding if row else _ColumnParallelRounding
                module.forward = _rounded_forward(rounding, module, tp)
                rows_rounded += row
    if not rows_rounded:
        # a renamed module or a wrapper in the names (activation checkpointing's) must not leave a plain run
        raise ValueError(f"round_like_tp found no rowwise layer of {trainer.spec.name}'s tp plan to round")


def _rounded_forward(rounding, module: torch.nn.Linear, tp: int):
    return lambda x: rounding.apply(x, module.weight, tp)
