"""The Trainer: this rank's model part(s), optimizer, scheduler, data and step counter, and one step.

    global batch (host) -> this dp rank's rows -> microbatches -> runner.forward_backward
    -> global grad-norm clip (every axis, pp included) -> AdamW -> LR schedule

Each piece is Stateful (state_dict / load_state_dict), so the checkpoint manager saves and restores
them without knowing the trainer. The model is always built on the meta device, parallelized, then
materialized: a rank allocates and initializes only its own shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from tessera.metrics.dtype_probe import NOT_MEASURED
from tessera.metrics.kernel_kinds import CLIP_RANGE, OPTIMIZER_RANGE
from tessera.data.corpus import TokenStream
from tessera.models.init import one_process_name
from tessera.models.moe import reset_counters
from tessera.models.spec import shape_of, spec_of
from tessera.checkpointing import checkpoint
from tessera.parallel.mixed_precision import release_copies
from tessera.parallel.clip import clip_coefficient, global_grad_norm, scale_gradients_
from tessera.parallel.offload import offload_report
from tessera.parallel.pipeline_simulated import this_rank
from tessera.parallel.comm import CollectiveTimeout, collective, is_timeout, stalled_collective
from tessera.parallel.fsdp import PRECISIONS
from tessera.parallel.expert import expert_load, load_report, update_biases
from tessera.parallel.fault_tolerance import ReplicaSync, gradient_shards, weights_bits
from tessera.parallel.fp8 import clear_float8_scales, float8_gathered_weights, precompute_float8_scales
from tessera.parallel.loss import CrossEntropySum
from tessera.parallel.pipeline import PipelineRunner
from tessera.topology import Meshes
from tessera.topology.estimators import comm_model
from tessera.topology.errors import NonFiniteError  # named by step, rank and parameter
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from tessera.data.batches import BatchShape, StepData
from .run_config import Config
from .optim import PartOptimizers, PartSchedulers, build_adamw, build_muon, lr_lambda
from .data_sources import open_data
from .parts import build_parts
from .replicas import NothingToRejoin, drill, is_replacement, rejoin_step, replica_rows, replica_sync
from tessera.data.batches import split_microbatches

from .runners import LocalRunner, forward_only
from .step_measures import StepMeasures, no_mark
from .step_result import Progress, StepResult, peak_memory_bytes  # noqa: F401  (public here before the split)
from .straggler import StragglerWatch


# --fault-tolerant: how often a step is taken again after a replica group failed during it (each time with the
# groups that are left; one more failure than this is the run's)
MAX_REPLICA_RETRIES = 3


def _params_of(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@contextlib.contextmanager
def stalls_named(layout: Any, rank: int, step: int) -> Iterator[None]:
    """A collective that runs past --timeout inside the block: CollectiveTimeout naming this rank and the step
    (and, for tessera's own collectives, the axis and the operation; for torch's, which it may be)."""
    try:
        yield
    except CollectiveTimeout as e:
        named = str(e).replace(f"rank {rank} stalled in", f"rank {rank} stalled at training step {step} in", 1)
        raise CollectiveTimeout(named) from e
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        where = stalled_collective(e, layout, rank) or (
            "a collective that torch issued (an FSDP2 all-gather or reduce-scatter over the data axes, a "
            "DTensor redistribution, or with --compile a tp or cp collective inside a compiled block's graph)"
        )
        raise CollectiveTimeout(
            f"rank {rank} stalled at training step {step} in {where}: a peer never joined; "
            f"look for a rank that raised, exited or froze. Underlying error: {e}"
        ) from e


def current_device() -> torch.device:
    """cuda:LOCAL_RANK under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


class Trainer:
    """Everything one rank trains with. Construct inside an initialized process group."""

    def __init__(
        self,
        config: Config,
        device: torch.device | None = None,
        data: Any | None = None,
        mesh: DeviceMesh | None = None,
    ):
        """`mesh`: the world DeviceMesh of the config's layout (`config.layout.build_mesh(device_type)`),
        to share one mesh and its process groups between Trainers of one layout shape built one after
        another in a process (a sweep over configs); by default each Trainer builds its own."""
        self.config = config
        self.device = device or current_device()
        # a phase of the step ends (--profile-summary's memory; StepMeasures sets it for a profiled step)
        self.phase_mark: Callable[[str], None] = no_mark
        self.data_s = 0.0  # the last step's seconds getting its batch (StepMeasures records it)
        self.launched_at = 0.0  # when the last step's host first waited for the device
        self.layout = config.layout
        self.meshes = Meshes(self.layout, self.device.type, mesh=mesh, timeout=config.runtime.timeout)
        self.rank = this_rank(dist.get_rank)  # a simulated pipeline: its stage's first rank
        self.model_config = config.model_config
        self.spec = spec_of(self.model_config)
        self.loss_fn = CrossEntropySum(self.model_config.vocab_size, self.meshes.tp)
        d = config.data
        shape = BatchShape(d.seq_len, d.global_batch, config.microbatches, d.pack_documents)
        self.batches = StepData(self.meshes, self.rank, self.device, shape)
        built = build_parts(
            self.spec,
            self.model_config,
            self.meshes,
            config.parallel_config(),
            self.device,
            seed=config.runtime.seed,
            loss_fn=self.loss_fn,
            positions=self.batches.positions_of,
            global_rows=config.data.global_batch,
        )
        self.parts, self.runner, self.tied = built.parts, built.runner, built.tied
        # the weights FSDP2 all-gathers in FP8: their scales are computed once a step, all at once (parallel/fp8.py)
        self.float8_weights = float8_gathered_weights(self.parts) if config.parallel.fp8 else []
        o = config.optimizer
        self.optimizer = PartOptimizers(
            [
                build_muon(part, self.spec.is_matrix, o, PRECISIONS[config.mixed_precision])
                if o.optimizer == "muon"
                else build_adamw(
                    part.parameters(),
                    lr=o.lr,
                    betas=(o.beta1, o.beta2),
                    eps=o.eps,
                    weight_decay=o.weight_decay,
                    host=config.parallel.offload == "optimizer",
                )
                for part in self.parts
            ]
        )
        self.scheduler = PartSchedulers(
            [
                torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(o.warmup, config.runtime.steps, o.min_lr_ratio))
                for opt in self.optimizer.optimizers
            ]
        )

        def open_stream(global_batch: int) -> Any:
            c = dataclasses.replace(config, data=dataclasses.replace(config.data, global_batch=global_batch))
            if c.data.path:
                return open_data(c.data, "path", self.model_config.vocab_size)  # token files or an hf: data set
            return TokenStream(c.data.seq_len, global_batch, documents=c.data.pack_documents)

        if config.ft.fault_tolerant:  # a replica group reads its share of the whole run's batches
            self.data = replica_rows(config, data, open_stream)
        else:
            self.data = data if data is not None else open_stream(config.data.global_batch)
        self.progress = Progress()
        # --fault-tolerant: the replicate axis through torchft, built last (it sends the pieces above to a peer)
        self._data_before_step: dict[str, Any] = {}  # the data's position before the step (a retried step's)
        self._replicas_before: list[int] = list(range(config.ft.ft_replica_groups))  # the last step's groups
        self.replicas: ReplicaSync | None = replica_sync(self) if config.ft.fault_tolerant else None
        self._quorums_begun = 0  # this process's steps so far: its first (a start or a resume) waits for every group
        self.straggler_watch = StragglerWatch(self.device)
        # measured during rank 0's first step (dtype_probe): {"compute_dtype", "matmul_flops_by_dtype", ...}. Rank 0
        # alone writes the records, the header and the progress line; the probe is a Python call per operator,
        # which a step of a small model on CPU pays ~2x for, so the other ranks neither measure nor report one.
        # Under --compile every rank probes: the probe's step runs eagerly (dynamo skips frames under a dispatch
        # mode), and a compiled rank beside an eager one issues its collectives in another order (a deadlock)
        measures = self.rank == 0 or config.parallel.compile
        self.dtype_report: dict[str, Any] | None = None if measures else dict(NOT_MEASURED)

    @property
    def model(self) -> nn.Module:
        """The model of a run without pipeline stages (a pipeline rank holds `parts`)."""
        if len(self.parts) != 1 or self.layout.pp > 1:
            raise AttributeError(
                f"a pipeline rank (pp={self.layout.pp}) holds stage parts, not the model: use trainer.parts"
            )
        return self.parts[0]

    @property
    def step(self) -> int:
        return self.progress.step

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters the global grad norm counts: every one once (a tied weight's copy on the last
        pipeline stage is left out, as one process holds the tensor once)."""
        return self.tied.for_norm(self.parameters())

    def local_batch(self, *batch: Tensor) -> tuple[Tensor, ...]:
        """This rank's part of a global batch, on its device (runtime/data/batches.py)."""
        return self.batches.of_global_batch(*batch)

    def evaluate(self) -> float:
        """The mean loss over --eval-batches global batches of --eval-data, read from their start each time
        (every rank its own rows; the sums are added over the ranks that read different tokens)."""
        d = self.config.data
        if d.eval_data is None:
            raise ValueError("evaluate() reads --eval-data PATH (held-out token files); none was given")
        held_out = open_data(self.config.data, "eval_data", self.model_config.vocab_size)
        totals = torch.zeros(2, dtype=torch.float32, device=self.device)
        was_training = self.parts[0].training
        for part in self.parts:
            part.eval()
        try:
            for _ in range(d.eval_batches):
                if hasattr(held_out, "next_local_batch"):  # token files: this rank's rows only
                    rows_in, rows_tg, _ = held_out.next_local_batch(self.meshes.batch_index, self.layout.dp)
                    local = self.batches.local(rows_in, rows_tg, held_out)
                else:  # an hf: stream: the whole global batch, this rank's part of it
                    inputs, targets, ends = held_out.next_global_batch()
                    local = self.batches.of_global_batch(*self.batches.packed(inputs, targets, held_out, ends))
                if isinstance(self.runner, PipelineRunner):  # pp > 1: forward only, through the stages
                    # (every pp rank gets the sums)
                    loss_sum, count = self.runner.forward_only(
                        split_microbatches(local[0], local[1], self.config.microbatches, *local[2:])
                    )
                else:
                    assert isinstance(self.runner, LocalRunner)  # pp == 1 (build_parts)
                    loss_sum, count = forward_only(self.parts[0], self.loss_fn, [local], self.runner.positions)
                totals += torch.stack([loss_sum, count])
        finally:
            release_copies(self.parts)  # the evaluation's bf16 copies (no gradients), until the next forward
            for part in self.parts:
                part.train(was_training)
        if self.meshes.loss is not None:
            with collective("all_reduce (eval loss)", "dp_cp", self.meshes.loss.get_group()):
                dist.all_reduce(totals, group=self.meshes.loss.get_group())
        return (totals[0] / totals[1].clamp(min=1)).item()

    def train_step(self, on_grads: Callable[[list[nn.Module]], None] | None = None) -> StepResult:
        """One optimizer step, inside the measuring modes it asks for (StepMeasures). `on_grads(parts)` runs
        after backward, before clipping (tests read grads). A collective that runs past --timeout raises
        CollectiveTimeout naming this rank and the step (and, for tessera's own collectives, the axis and the
        operation)."""
        step = self.progress.step + 1
        with stalls_named(self.layout, self.rank, step), StepMeasures(self, step) as measured:
            try:
                measured.result = self._step(on_grads)
            finally:  # a forward outside a step (eval, generate) casts by its own amax
                clear_float8_scales(self.float8_weights)
        return measured.result

    def analytic_comm(self) -> dict[str, float]:
        """This rank's bytes per step by axis as topology.comm_model predicts them for this run."""
        c, p = self.config, self.config.parallel_config()
        act = PRECISIONS[p.data.mixed_precision].itemsize
        return comm_model.comm_bytes_per_step(
            shape_of(self.model_config),
            self.layout,
            c.data.seq_len,
            c.data.global_batch,
            c.microbatches,
            p.sequence_parallel,
            strategy=p.data.strategy,
            virtual=p.pipeline.virtual,
            ac=p.data.activation_checkpointing,
            cp_method=p.cp_method,
            rank=self.rank,
            layers_per_stage=p.pipeline.layers_per_stage,
            act_bytes=act,
            param_bytes=act,
            reduce_bytes=4,
            placement=p.pipeline.placement,
            documents=c.data.pack_documents,
        )

    def offload_report(self) -> dict[str, Any]:
        """--offload: what this rank holds in host memory, measured from its tensors (parallel/offload.py)."""
        return offload_report(self.config.parallel.offload, self.parts, self.optimizer.optimizers, self.device)

    def _forward_backward(self, on_grads: Callable[[list[nn.Module]], None] | None) -> tuple[Any, Tensor, Any]:
        """(the step's batch, its loss sum over this group's ranks, the replicate axis's ReplicaStep or None):
        the quorum (a group that is behind takes a peer's state there), the forward and backward, the loss over
        the group's ranks, and under --fault-tolerant the one all-reduce between the replica groups."""
        if self.replicas is not None:
            # this process's first step, the run's start or a whole job's resume: every group, together (a
            # resumed group that stepped alone would train on its own rows only)
            first = self._quorums_begun == 0 and not is_replacement()
            rejoin = rejoin_step() == self.progress.step + 1  # a drill's step the groups wait for a replacement at
            self.replicas.begin_step(
                wait_for=self.config.ft.ft_replica_groups if first or rejoin else 0, timeout=60.0 if rejoin else None
            )
            self._quorums_begun += 1
            if self.progress.step == 0 and is_replacement() and not self.replicas.healed:
                raise NothingToRejoin(
                    f"replica group {self.config.ft.ft_replica_id}, a replacement, found no live replica group to "
                    f"take the run's state from (the run had ended, or every group died): it stops rather than "
                    f"train alone from step 0"
                )
            self._data_before_step = self.data.state_dict()
            drill(self.config, self.progress.step + 1, "forward")
        fetched = time.perf_counter()
        step = self.batches.next_step(self.data)
        self.data_s += time.perf_counter() - fetched
        for part in self.parts if self.spec.moe else ():
            reset_counters(part)  # the MoE blocks' load counters: this step's only
        precompute_float8_scales(self.float8_weights)  # cleared after the step (train_step): never stale
        loss_sum = self.runner.forward_backward(step.microbatches, step.valid)
        release_copies(self.parts)  # the bf16 copies of a layout without data axes, until the next forward
        self.tied.synchronize()  # a tied weight's gradient: the first and last stages' parts summed
        self.phase_mark("backward")
        if on_grads is not None:
            on_grads(self.parts)
        if self.meshes.pp is not None:  # only the last stage computed it: every rank reports the true loss
            with collective("all_reduce (loss)", "pp", self.meshes.pp.get_group()):
                dist.all_reduce(loss_sum, group=self.meshes.pp.get_group())
        if self.meshes.loss is not None:  # ranks reading different tokens add their sums
            with collective("all_reduce (loss)", "dp_cp", self.meshes.loss.get_group()):
                dist.all_reduce(loss_sum, group=self.meshes.loss.get_group())
        replica = None
        if self.replicas is not None:
            replica = self.replicas.reduce(loss_sum, step.valid, gradient_shards(self.parts))
        return step, loss_sum, replica

    def _step(self, on_grads: Callable[[list[nn.Module]], None] | None) -> StepResult:
        started = time.perf_counter()
        self.data_s = 0.0  # the seconds getting this step's batch (a retried step's every attempt)
        for attempt in range(MAX_REPLICA_RETRIES + 1):
            step, loss_sum, replica = self._forward_backward(on_grads)
            if replica is None or replica.committed or attempt == MAX_REPLICA_RETRIES:
                break
            # a replica group failed during the step and no group applies it: the survivors take the same rows
            # again with the quorum that is left (no step lost, none counted twice)
            self.optimizer.zero_grad(set_to_none=True)
            self.data.load_state_dict(self._data_before_step)
        valid, global_tokens = step.valid, self.config.data.global_batch * self.config.data.seq_len
        if replica is not None:  # the replicate axis: the mean over every live group's targets
            loss_sum, valid = replica.loss_sum, int(replica.valid)
            global_tokens *= len(replica.replicas)
            replica.retries = attempt
            self._announce_quorum(replica, attempt)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        with record_function(CLIP_RANGE):
            grad_norm = global_grad_norm(self.norm_parameters(), Meshes.group(self.meshes.pp))
            coef = clip_coefficient(grad_norm, self.config.optimizer.max_grad_norm)
            # the fused AdamWs take the clip inside their kernel (their grad_scale: 1 / coef); the rest, here
            scale_gradients_(
                [p for o in self.optimizer.optimizers if not self.optimizer.folds_scale(o) for p in _params_of(o)],
                coef,
            )
        self.phase_mark("clip")
        # the forward, backward and clip are launched: the non-finite check below is the host's first wait
        self.launched_at = time.perf_counter()
        skipped, skip_report = self._skip_decision(loss_sum, grad_norm, valid, replica)
        load = self._expert_load()
        if not skipped:
            self.progress.skipped_in_a_row = 0
            with record_function(OPTIMIZER_RANGE):
                self.optimizer.step(grad_scale=coef.reciprocal())
            if load is not None and self.spec.moe:  # the auxiliary-loss-free bias follows the step it was measured in
                update_biases(self.parts, self.spec.moe, load[0])
        self.phase_mark("optimizer")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        straggler = self.straggler_watch.observe(time.perf_counter() - started)
        self.progress.step += 1
        self.progress.consumed_tokens += global_tokens
        return StepResult(
            self.progress.step,
            loss_sum / max(1, valid),
            grad_norm,
            lr,
            global_tokens,
            started,
            self.layout.as_dict(),
            self.device,
            skipped=skipped,
            skipped_steps=self.progress.skipped_steps,
            skip_report=skip_report,
            straggler=straggler,
            tokens_checksum=step.tokens_checksum,
            moe=None if load is None else load_report(*load, self.config.data.global_batch),
            documents=step.documents,
            loss_targets=step.loss_targets,
            replicas=None
            if replica is None
            else {
                **replica.record(),
                "weights_bits": weights_bits(self.parts),
                "ended_unix": time.time(),
            },
        )

    def _announce_quorum(self, replica: Any, attempt: int) -> None:
        """Rank 0 says which replica groups left the quorum during a step, and how the step ran without them."""
        left = sorted(set(self._replicas_before) - set(replica.replicas)) if replica.committed else []
        if left and self.rank == 0:
            print(
                f"tessera: step {self.progress.step + 1}: replica group(s) {left} left the quorum (died, or "
                f"stalled past --ft-timeout {self.config.ft.ft_timeout:g} s); "
                + (
                    f"the step was taken again with {replica.replicas}"
                    if attempt
                    else f"it ran with {replica.replicas}"
                ),
                file=sys.stderr,
                flush=True,
            )
        self._replicas_before = replica.replicas if replica.committed else self._replicas_before

    def _skip_decision(self, loss_sum: Tensor, grad_norm: Tensor, valid: int, replica: Any) -> tuple[bool, str | None]:
        """(whether the update is dropped, the line saying why): a non-finite loss or norm under
        --on-nonfinite skip (stop raises, as does a run that keeps skipping), or a replica group that failed
        during the step. One host sync: the loss and the norm are reduced over every rank, so all ranks
        decide alike."""
        skipped = not bool(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
        if replica is not None and not replica.committed and not skipped:  # a replica group failed mid-step
            self.progress.skipped_steps += 1
            return True, (
                f"step {self.progress.step + 1}: the replica groups did not all commit (a group failed during "
                f"it); its update was dropped on every group, its rows read by none"
            )
        if not skipped:
            return False, None
        report = self._nonfinite_report(self.progress.step + 1, loss_sum / max(1, valid), grad_norm)
        runtime = self.config.runtime
        if runtime.on_nonfinite == "stop":
            raise NonFiniteError(
                report + "; stopped before the update (nothing poisoned was applied or saved); "
                "--on-nonfinite skip drops such steps instead"
            )
        limit = runtime.skip_limit
        if self.progress.skipped_in_a_row >= limit:  # the run is not recovering: stop as `stop` does
            raise NonFiniteError(
                f"{report}; stopped before the update after {self.progress.skipped_in_a_row} skipped steps in a "
                f"row (--max-skipped-steps {limit}): nothing poisoned was applied or saved; lower --lr, or allow "
                f"more with --max-skipped-steps N"
            )
        self.progress.skipped_steps += 1
        self.progress.skipped_in_a_row += 1
        return True, (
            f"{report}; the step's update was skipped (--on-nonfinite skip: {self.progress.skipped_in_a_row} "
            f"of at most {limit} in a row)"
        )

    def _expert_load(self) -> tuple[Tensor, Tensor] | None:
        """The step's expert token counts and auxiliary loss, summed over every rank (MoE models only)."""
        if not self.spec.moe:
            return None
        return expert_load(
            self.parts,
            self.spec.moe,
            self.model_config.n_layers,
            self.layout.index("tp", self.rank),
            self.config.parallel.sequence_parallel,
            n_experts=self.spec.shape(self.model_config).n_experts,
        )

    def _nonfinite_report(self, step: int, loss: Tensor, grad_norm: Tensor) -> str:
        """Which parameters hold a NaN or inf gradient, on which rank and shard (collective)."""
        mine = []
        for part in self.parts:
            for name, p in part.named_parameters():
                if p.grad is None:
                    continue
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if not bool(torch.isfinite(local).all()):
                    where = ""
                    if isinstance(p.grad, DTensor):
                        mesh = p.grad.device_mesh
                        where = (
                            " (shard "
                            + ", ".join(
                                f"{n}={mesh.get_local_rank(i)}" for i, n in enumerate(mesh.mesh_dim_names or ())
                            )
                            + ")"
                        )
                    mine.append(f"rank {self.rank}: {one_process_name(name)}{where}")
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        found = [entry for entries in everyone for entry in entries]
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        return (
            f"non-finite values at step {step}: loss {loss.item()}, grad norm {grad_norm.item()}; "
            f"gradients: {shown or 'all finite (the loss itself)'}"
        )

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_pieces(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(sharded, small) Stateful pieces for the checkpoint manager."""
        sharded = {checkpoint.SHARDED_KEY: checkpoint.ModelOptimizerState(self.parts, self.optimizer.per_part)}
        small = {"scheduler": self.scheduler, "data": self.data, "progress": self.progress}
        return sharded, small

    def checkpoint_info(self) -> dict[str, Any]:
        c = self.config
        return {
            "consumed_sequences": self.progress.consumed_tokens // c.data.seq_len,
            "consumed_tokens": self.progress.consumed_tokens,
            "steps": c.runtime.steps,
            "model": {"preset": c.model_name, "family": self.spec.name, "config": self.model_config.as_dict()},
            "seed": c.runtime.seed,
            "layout": self.layout.as_dict(),
            "sharding_strategy": c.parallel.fsdp.upper(),
            "sequence_parallel": c.parallel.sequence_parallel,
            "mixed_precision": c.mixed_precision,
            "gradient_scaler_state": None,  # bf16/fp32 training uses no loss scaler
            "config": c.to_dict(),
        }

    def save(self, manager: checkpoint.CheckpointManager) -> str:
        sharded, small = self.checkpoint_pieces()
        return str(
            manager.save(
                self.step, sharded, small, self.checkpoint_info(), asynchronous=self.config.checkpoint.asynchronous
            )
        )

    def load(self, path: str) -> dict[str, Any]:
        """Restore every piece from a checkpoint saved on any layout; collective. Returns the manifest."""
        c = self.config

        def check(resolved, manifest):
            checkpoint.check_compatible(resolved, manifest, c.model_name, self.model_config.as_dict(), c.data.seq_len)
            checkpoint.check_optimizer(resolved, manifest, c.optimizer.optimizer)

        sharded, small = self.checkpoint_pieces()
        return checkpoint.CheckpointManager(None).load(path, sharded, small, check)
