"""Pipeline parallel over the "pp" axis: stage splitting, stage-only builds, and the executor.

    split_layers        n_layers -> one range of layer indices per (virtual) stage, even or --pp-layers
    build_stage         the one-process model with only stage s's blocks (the spec's first-stage modules on
                        the first stage, its last-stage modules on the last), built on the meta device;
                        names unchanged, so block 5's parameters have one name on every pp degree
    PipelineRunner      runs this rank's actions of a schedule (`tessera.topology.schedules.schedule`): F, B and W
                        over batched isend/irecv on the pp group

The schedule says only what to compute; the messages follow from it. F of stage s sends its output to
the rank of stage s + 1; B of stage s sends its input gradient to the rank of stage s - 1. Between two
ranks, messages in one direction are received in the order they were sent (NCCL matches point-to-point
operations in order, without tags), so a rank posts its receives from a peer in that peer's send order,
which it computes from the schedule like the peer does. The next action's receive is posted before the
current action computes (gloo), or goes out in one batch with the current action's sends (NCCL, where
a peer's operations run in order and a receive posted ahead of a send could wait on a neighbour's);
sends are waited for at the end of the step; nothing synchronizes the device.
Each microbatch's activations are dropped when its backward (W for split kinds) has run.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from tessera.models.spec import spec_of
from tessera.topology.schedules.schedule import placement_of, stage_rank, stages_on_rank
from tessera.topology.schedules.simulator import fused_backwards
from tessera.topology.schedules.schedule_files import action_text, check_fits
from tessera.topology.shapes import split_layers  # the stage split's one rule (re-exported here)

from .comm import collective
from .loss import LinearCrossEntropyHead, model_loss
from .pipeline_simulated import simulated_pipeline
from .split_backward import capture_weight_users, reduce_gradients_now, set_gradient_sync
from .tied import shared_parameters

from tessera.topology.schedules.schedule import SPLIT_BACKWARD, Action, build_schedule, check_schedule

from tessera.topology.schedules.simulator import simulate, validate

__all__ = [
    "build_schedule",
    "PipelineConfig",
    "split_layers",
    "stages_of_rank",
    "build_stage",
    "check_pipeline",
    "PipelineRunner",
]

Microbatch = tuple[Tensor, ...]  # (inputs, targets) or (inputs, targets, positions): packed documents
LossFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class PipelineConfig:
    # a kind's name, or the schedule as data: one tuple of Actions per pp rank (e.g. read from --schedule-file)
    schedule: str | tuple[tuple[Action, ...], ...] = "1f1b"
    virtual: int = 1  # stages per pp rank
    layers_per_stage: tuple[int, ...] | None = None  # None: an even split
    microbatches: int = 1  # per step, per dp rank
    source: str | None = None  # where a schedule given as data came from, for messages ("schedule_file=s.csv")

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, str):  # tuples: the config stays frozen and hashable
            object.__setattr__(self, "schedule", tuple(tuple(Action(*a) for a in row) for row in self.schedule))

    @property
    def kind(self) -> str | None:
        """The built-in kind's name, or None for a schedule given as data."""
        return self.schedule if isinstance(self.schedule, str) else None

    @property
    def placement(self) -> str:
        """Where the stages live: "v" for zbv and dualpipev (rank r holds r and 2 pp - 1 - r), else "loop"."""
        return placement_of(self.kind)

    def actions(self, pp: int) -> list[list[Action]]:
        """The schedule as data for `pp` ranks: the kind built, or the given actions."""
        if self.kind is not None:
            return build_schedule(self.kind, pp, self.microbatches, self.virtual)
        assert not isinstance(self.schedule, str)
        return [list(row) for row in self.schedule]


# ----------------------------------------------------------------------------- stages
def stages_of_rank(pp_rank: int, pp: int, virtual: int = 1, placement: str = "loop") -> list[int]:
    """The virtual stages pp rank r holds: r, r + pp, r + 2 pp, ...; on the V r and 2 pp - 1 - r."""
    return stages_on_rank(pp_rank, pp, virtual, placement)


def build_stage(
    model_config, stage: int, n_stages: int, layers: range, device: torch.device | str = "meta", spec=None
) -> nn.Module:
    """The one-process model cut down to one stage, by its family's spec (`spec`, or the registered one of
    `model_config`): the blocks in `layers`, the spec's first-stage modules on stage 0 only, its last-stage
    modules on the last stage only; the others are set to None. A module that owns a weight tied to a kept
    one (the embedding of a tied head) stays on the stage, so the tensor keeps its one-process name. Built
    on the meta device nothing is allocated; `parallelize` and `materialize` then give it its shards of
    the one-process initialization (seeded by parameter name, so the stage's values are the one-process
    values)."""
    spec = spec or spec_of(model_config)
    model = spec.build_model(model_config, device=device, seed=None if str(device) == "meta" else 0)
    split = spec.pipeline
    blocks = model.get_submodule(split.blocks)
    kept = nn.ModuleDict({str(i): blocks[str(i)] for i in layers})
    parent, _, attr = split.blocks.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, kept)
    drop = ([] if stage == 0 else list(split.first)) + ([] if stage == n_stages - 1 else list(split.last))
    kept_names = {n for n in split.first + split.last if n not in drop}
    for owner, *aliases in shared_parameters(model):  # keep the owner of a weight that a kept module shares
        owner_module = owner.rpartition(".")[0]
        if {a.rpartition(".")[0] for a in aliases} & kept_names:
            drop = [m for m in drop if m != owner_module]
    for name in drop:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, None)
    return model


def check_pipeline(
    config: PipelineConfig, pp: int, n_layers: int, fsdp: bool, activation_checkpointing: str, compile: bool = False
) -> None:
    """Every pipeline input error, before any process group starts. A schedule given as data is proven by the
    simulator (dependencies, deadlocks) and must fit pp, virtual and the microbatches."""
    kind = config.kind
    if kind is not None:
        check_schedule(kind, pp, config.microbatches, config.virtual)
        split = kind in SPLIT_BACKWARD
    else:  # a file's errors spell actions as the file does (0F1)
        assert not isinstance(config.schedule, str)
        source = config.source or "the schedule"
        split = check_fits(
            config.schedule, pp, config.virtual, config.microbatches, source, action_text if config.source else str
        )[2]
    split_layers(n_layers, pp * config.virtual, config.layers_per_stage)
    if not split:
        return
    what, other = (
        (f"schedule={kind}", "schedule=1f1b")
        if kind is not None
        else (f"{config.source or 'a schedule'} (W actions)", "a schedule without W actions")
    )
    if activation_checkpointing != "none":
        raise ValueError(
            f"{what} with activation_checkpointing={activation_checkpointing} is not supported (the W pass "
            f"would recompute the block again); use activation_checkpointing=none or {other}"
        )
    if compile:  # W would find the modules' outputs inside one compiled graph, and rerun it per module
        raise ValueError(
            f"{what} with `compile` is not supported: a compiled block's backward is one graph, which the W pass "
            f"cannot run apart from B; use {other} (or gpipe, interleaved-1f1b, looped-bfs), or drop `compile`"
        )


# ----------------------------------------------------------------------------- the executor
def _messages_sent(actions: Sequence[Action], me: int, rank_of_stage: Callable[[int], int], n_stages: int):
    """(peer, key) of each message `actions` send, in order; key = ("act" | "grad", microbatch, stage it is for)."""
    for a in actions:
        if a.op == "F" and a.stage < n_stages - 1 and rank_of_stage(a.stage + 1) != me:
            yield rank_of_stage(a.stage + 1), ("act", a.microbatch, a.stage + 1)
        if a.op == "B" and a.stage > 0 and rank_of_stage(a.stage - 1) != me:
            yield rank_of_stage(a.stage - 1), ("grad", a.microbatch, a.stage - 1)


class PipelineRunner:
    """pp > 1: this rank's stage parts run its actions of the schedule.

    `stages` maps each virtual stage this rank holds to its part. `schedule` is a kind's name, or any
    schedule as data (one list of Actions per pp rank, e.g. hand-written): it is validated and simulated
    first, so one that would deadlock is refused before any message is sent. The loss of the last stage is its sum
    over valid targets times grad_scale / global valid tokens (as in LocalRunner), so the accumulated
    gradients are those of the one-process global-batch mean. `activation` gives the (shape, dtype) of
    the hidden states between stages for a microbatch of `rows` x `seq` tokens."""

    now: PipelineStep  # set by forward_backward: the step running, or the last one run

    def __init__(
        self,
        stages: dict[int, nn.Module],
        schedule: str | Sequence[Sequence[Action]],
        pp_group: dist.ProcessGroup,
        microbatches: int,
        virtual: int,
        loss_fn: LossFn,
        activation: Callable[[int, int], tuple[tuple[int, ...], torch.dtype]],
        device: torch.device,
        grad_scale: float = 1.0,
        timeout: float = 600.0,
        positions: Callable[[Tensor], Tensor | None] | None = None,
    ):
        self.placement = placement_of(schedule if isinstance(schedule, str) else None)
        self.stages, self.group = stages, pp_group
        self.pp = dist.get_world_size(pp_group)
        self.n_stages = self.pp * virtual
        # a simulated pipeline runs each pp rank's stages in a thread of its own; their messages are its posts
        self.simulated = simulated_pipeline()
        self.me = dist.get_rank(pp_group) if self.simulated is None else self.simulated[1]
        self.peers = dist.get_process_group_ranks(pp_group)  # pp rank -> global rank
        self.loss_fn, self.activation, self.device = loss_fn, activation, device
        self.positions_of = positions  # tokens -> their global positions (context parallel); default 0..S-1
        self.grad_scale, self.timeout = grad_scale, timedelta(seconds=timeout)
        if isinstance(schedule, str):
            schedule = build_schedule(schedule, self.pp, microbatches, virtual)
        schedule = [list(row) for row in schedule]  # data may come as tuples (PipelineConfig's)
        n_stages, n_microbatches, self.split = validate(schedule)
        simulate(schedule)  # ValueError naming the stuck ranks if it would deadlock
        for head in (m for part in stages.values() for m in part.modules() if isinstance(m, LinearCrossEntropyHead)):
            head.reuse_backward = self.split  # W runs the fused loss head's backward again, after B
        if len(schedule) != self.pp or n_stages != self.n_stages or n_microbatches != microbatches:
            raise ValueError(
                f"the schedule has {len(schedule)} ranks, {n_stages} stages and {n_microbatches} "
                f"microbatches; this pipeline has {self.pp}, {self.n_stages} and {microbatches}"
            )
        if any(self.rank_of_stage(a.stage) != r for r, actions in enumerate(schedule) for a in actions):
            where = "on the V (rank r: r and 2 pp - 1 - r)" if self.placement == "v" else f"s % {self.pp}"
            raise ValueError(f"stage s must run on pp rank {where}, where its parameters are")
        self.actions = schedule[self.me]
        if set(stages) != {a.stage for a in self.actions}:
            raise ValueError(
                f"pp rank {self.me} holds stages {sorted(stages)}; its actions run stages "
                f"{sorted({a.stage for a in self.actions})}"
            )
        self.microbatches = microbatches
        # (start, end, action) of each action of the last step: the rank is busy from start to end, idle only
        # while it waits for a message (the time before start), so the bookkeeping between computes counts
        # as its action's work and the trace's idle time is the bubble as the simulator counts it (host
        # clock: meaningful on CPU ranks; on a GPU the kernels run asynchronously); off by default
        self.record_trace = False
        # what each peer sends this rank, in its order (its receives must be posted in that order)
        self.incoming: dict[int, list[tuple]] = defaultdict(list)
        for peer, actions in enumerate(schedule):
            for to, key in _messages_sent(actions, peer, self.rank_of_stage, self.n_stages):
                if to == self.me:
                    self.incoming[peer].append(key)
        # gradient sync (FSDP2) on each part's last backward of the step only
        self.last_backward = {
            s: max(k for k, a in enumerate(self.actions) if a.op == "B" and a.stage == s) for s in stages
        }
        # positions of the W's that run with their B (listed right before) as one backward pass: where no
        # other rank waits for the B's input gradient, or where the simulator finds nobody idles longer for it
        # (dualpipev's full backwards); elsewhere B sends first and W runs after (`fused_backwards`)
        self.fused = {k + 1 for k in fused_backwards(schedule, self.placement)[self.me]}
        # When the next action's receive is posted. gloo runs each operation on its own: posting it before
        # this action computes lets the message arrive meanwhile. NCCL runs a peer's operations in order on
        # one stream, where a receive posted ahead of a send can wait on a neighbour whose receive waits on
        # that send: there it goes out in one group with this action's sends (torch's pipelining does so).
        self.receive_early = device.type != "cuda"
        if device.type == "cuda":  # NCCL: create the pp communicator with every rank present, before P2P
            dist.all_reduce(torch.zeros(1, device=device), group=pp_group)

    def rank_of_stage(self, stage: int) -> int:
        return stage_rank(stage, self.pp, self.placement)

    @property
    def trace(self) -> list[tuple[float, float, Action]]:
        """(start, end, action) of each action of the last step, with record_trace on (else empty)."""
        last = self.__dict__.get("now")
        return [] if last is None else last.trace

    @property
    def peak_in_flight(self) -> int:
        """The most microbatch-stages whose activations this rank held at once in the last step."""
        last = self.__dict__.get("now")
        return 0 if last is None else last.peak_in_flight

    # ------------------------------------------------------------------ one step
    def forward_backward(self, microbatches: Sequence[Microbatch], global_valid_tokens: int) -> Tensor:
        if len(microbatches) != self.microbatches:
            raise ValueError(f"the schedule was built for {self.microbatches} microbatches, got {len(microbatches)}")
        rows, seq = microbatches[0][0].shape
        act_shape, act_dtype = self.activation(rows, seq)
        self.now = now = PipelineStep(
            microbatches,
            self._positions(microbatches),
            self.grad_scale / max(1, global_valid_tokens),
            tuple(act_shape),
            act_dtype,
            torch.zeros((), dtype=torch.float32, device=self.device),
        )
        previous_end = time.perf_counter()
        for k, action in enumerate(self.actions):
            following = self.actions[k + 1] if k + 1 < len(self.actions) else None
            if action.op == "W" and k in self.fused:
                continue  # ran with its B
            if following is not None and self.receive_early:
                self._queue_receive_for(following)
                self._flush()
            key = self._input_key(action)
            received = self._receive(key) if key is not None else None
            getattr(self, f"_{action.op}")(action, k, received)  # queues its sends
            if following is not None and not self.receive_early:
                self._queue_receive_for(following)
            self._flush()
            if self.record_trace:
                end = time.perf_counter()
                now.trace.append((previous_end + now.waited, end, action))
                now.waited, previous_end = 0.0, end
        for work, _ in now.sends:
            with collective("send (pipeline)", "pp", self.group):
                work.wait(self.timeout)
        now.sends.clear()
        if self.split:  # every W has run: now FSDP2 reduces each stage's accumulated gradients
            for part in self.stages.values():
                reduce_gradients_now(part)
        assert not now.saved and not now.posted, "every activation is consumed by the end of the step"
        return now.loss

    def _positions(self, microbatches: Sequence[Microbatch]) -> list[Tensor]:
        """Each microbatch's token positions, which every stage rotates (and packed documents mask) by:
        stages past the first see only hidden states, so they come from the microbatch (its own positions
        with packed documents; else context parallel's zigzag indices, else 0..S-1)."""
        out = []
        for microbatch in microbatches:
            if len(microbatch) > 2:
                out.append(microbatch[2])
                continue
            given = self.positions_of(microbatch[0]) if self.positions_of else None
            out.append(given if given is not None else torch.arange(microbatch[0].shape[1], device=self.device))
        return out

    def _F(self, a: Action, k: int, received: Tensor | None) -> None:
        part = self.stages[a.stage]
        inputs, targets = self.now.data[a.microbatch][:2]
        positions = self.now.positions[a.microbatch]
        x = inputs if a.stage == 0 else received
        assert x is not None  # a stage past the first receives its input
        captured: list[tuple[GradientEdge, list[nn.Parameter]]] = []
        last = a.stage == self.n_stages - 1
        with capture_weight_users(part, captured) if self.split else contextlib.nullcontext():
            if last:  # through the fused loss head when the stage has one (no full logits)
                loss_sum, _ = model_loss(self.loss_fn, part, x, positions, targets)
            else:
                out = part(x, positions)
        if last:
            self.now.loss += loss_sum.detach().float()
            out = loss_sum * self.now.scale  # backward starts here, with no output gradient
        else:
            self._send(out.detach(), ("act", a.microbatch, a.stage + 1))
        self.now.saved[(a.microbatch, a.stage)] = {
            "input": x if a.stage > 0 else None,
            "output": out,
            "weight_users": captured,
        }
        # activations held: F run, B (or W) not yet
        self.now.peak_in_flight = max(self.now.peak_in_flight, len(self.now.saved))

    def _B(self, a: Action, k: int, grad: Tensor | None) -> None:
        saved = self.now.saved[(a.microbatch, a.stage)]
        part, x, out = self.stages[a.stage], saved["input"], saved["output"]
        # split kinds: FSDP2 would reduce when the input gradient is ready, before W; they reduce after W
        set_gradient_sync(part, k == self.last_backward[a.stage] and not self.split)
        if self.split and k + 1 not in self.fused:  # input gradient now; the weight gradient waits for W
            users = [edge for edge, _ in saved["weight_users"]]
            wanted = ([x] if x is not None else []) + users
            grads = torch.autograd.grad(
                [out], wanted, None if grad is None else [grad], retain_graph=True, allow_unused=True
            )
            input_grad = grads[0] if x is not None else None
            saved["weight_grads"] = list(grads[1:] if x is not None else grads)
            saved["output"] = saved["input"] = None
        else:  # the whole backward: a kind without W, or a B whose W follows it at once
            torch.autograd.backward(out, grad)
            input_grad = x.grad if x is not None else None
            del self.now.saved[(a.microbatch, a.stage)]
        if a.stage > 0:
            assert input_grad is not None  # the stage's input requires grad (_receive)
            self._send(input_grad, ("grad", a.microbatch, a.stage - 1))

    def _W(self, a: Action, k: int, received: None) -> None:
        saved = self.now.saved.pop((a.microbatch, a.stage))
        for (edge, params), dy in zip(saved["weight_users"], saved["weight_grads"]):
            if dy is not None:  # only this module's own weights: the path from its output to them, nothing upstream
                torch.autograd.backward(edge, dy, inputs=params)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def forward_only(self, microbatches: Sequence[Microbatch]) -> tuple[Tensor, Tensor]:
        """(summed loss, valid targets) of `microbatches` without gradients: each microbatch passes the stages
        in order (each rank runs its stages in ascending order, so every receive's sender has already run);
        the last stage's sums, summed over pp (the other stages add zeros), so every pp rank returns them."""
        rows, seq = microbatches[0][0].shape
        all_positions = self._positions(microbatches)
        shape, dtype = self.activation(rows, seq)
        totals = torch.zeros(2, dtype=torch.float32, device=self.device)
        local: dict[int, Tensor] = {}
        for mb, microbatch in enumerate(microbatches):
            inputs, targets, positions = microbatch[0], microbatch[1], all_positions[mb]
            for stage in sorted(self.stages):
                if stage == 0:
                    x = inputs
                elif self.rank_of_stage(stage - 1) == self.me:
                    x = local.pop(stage)
                elif self.simulated is not None:
                    x = self.simulated[0].take(self.me, ("act", mb, stage))
                else:
                    x = torch.empty(shape, dtype=dtype, device=self.device)
                    with collective(f"recv act of microbatch {mb} for stage {stage} (eval)", "pp", self.group):
                        _wait(dist.irecv(x, self.peers[self.rank_of_stage(stage - 1)], self.group), self.timeout)
                part = self.stages[stage]
                if stage == self.n_stages - 1:
                    loss_sum, valid = model_loss(self.loss_fn, part, x, positions, targets)
                    totals += torch.stack(
                        [loss_sum.float(), torch.as_tensor(valid, dtype=torch.float32, device=self.device)]
                    )
                    continue
                out = part(x, positions)
                if self.rank_of_stage(stage + 1) == self.me:
                    local[stage + 1] = out
                elif self.simulated is not None:
                    self.simulated[0].post(self.me, self.rank_of_stage(stage + 1), ("act", mb, stage + 1), out)
                else:
                    with collective(f"send act of microbatch {mb} for stage {stage + 1} (eval)", "pp", self.group):
                        to = self.peers[self.rank_of_stage(stage + 1)]
                        _wait(dist.isend(out.contiguous(), to, self.group), self.timeout)
        with collective("all_reduce (eval loss)", "pp", self.group):
            dist.all_reduce(totals, group=self.group)
        return totals[0], totals[1]

    # ------------------------------------------------------------------ messages
    def _send(self, tensor: Tensor, key: tuple) -> None:
        kind, mb, stage = key
        if tuple(tensor.shape) != self.now.act_shape or tensor.dtype != self.now.act_dtype:
            raise RuntimeError(
                f"pipeline stage {stage - 1 if kind == 'act' else stage + 1} produced {kind} of "
                f"{tuple(tensor.shape)} {tensor.dtype} for microbatch {mb}; stage boundaries carry "
                f"{self.now.act_shape} {self.now.act_dtype}"
            )
        to = self.rank_of_stage(stage)
        if to == self.me:
            self.now.local[key] = tensor.detach()
            return
        if self.simulated is not None:
            self.simulated[0].post(self.me, to, key, tensor)
            return
        self.now.outbox.append((dist.P2POp(dist.isend, tensor.contiguous(), self.peers[to], self.group), None))

    def _queue_receive_for(self, a: Action) -> None:
        key = self._input_key(a)
        if key is not None and self._sender(key) != self.me and self.simulated is None:
            self._queue_receives_up_to(key)

    def _sender(self, key: tuple) -> int:
        return self.rank_of_stage(key[2] - 1 if key[0] == "act" else key[2] + 1)

    def _input_key(self, a: Action) -> tuple | None:
        if a.op == "F" and a.stage > 0:
            return ("act", a.microbatch, a.stage)
        if a.op == "B" and a.stage < self.n_stages - 1:
            return ("grad", a.microbatch, a.stage)
        return None

    def _queue_receives_up_to(self, key: tuple) -> None:
        """Queue receives from the key's sender, in its send order, up to and including `key`."""
        peer = self._sender(key)
        queued = {k for _, k in self.now.outbox}
        if key in self.now.posted or key in queued:
            return
        queue = self.incoming[peer]
        while True:
            nxt = queue[self.now.next_to_post[peer]]
            self.now.next_to_post[peer] += 1
            buffer = torch.empty(self.now.act_shape, dtype=self.now.act_dtype, device=self.device)
            self.now.outbox.append((dist.P2POp(dist.irecv, buffer, self.peers[peer], self.group), nxt))
            if nxt == key:
                return

    def _flush(self) -> None:
        """Issue the queued sends and receives as one batch (on NCCL one group: sends and receives of
        neighbouring ranks cannot block each other)."""
        if not self.now.outbox:
            return
        ops = [op for op, _ in self.now.outbox]
        with collective("send/recv (post)", "pp", self.group):
            works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # backends that return one work for the batch: wait on it for all
            works = [works[-1]] * len(ops)
        for (op, key), work in zip(self.now.outbox, works):
            if key is None:
                self.now.sends.append((work, op.tensor))  # the tensor must live until the send completes
            else:
                self.now.posted[key] = (op.tensor, work)
        self.now.outbox.clear()

    def _receive(self, key: tuple) -> Tensor:
        if key in self.now.local:
            tensor = self.now.local.pop(key)
        elif self.simulated is not None:
            waiting = time.perf_counter()
            tensor = self.simulated[0].take(self.me, key)
            self.now.waited += time.perf_counter() - waiting
        else:
            if key not in self.now.posted:
                self._queue_receives_up_to(key)
                self._flush()
            tensor, work = self.now.posted.pop(key)
            kind, mb, stage = key
            waiting = time.perf_counter()
            with collective(f"recv {kind} of microbatch {mb} for stage {stage}", "pp", self.group):
                work.wait(self.timeout)
            self.now.waited += time.perf_counter() - waiting
        return tensor.requires_grad_() if key[0] == "act" else tensor


@dataclass
class PipelineStep:
    """One forward_backward's state, made fresh for each step: its microbatches (data), their positions and
    the loss scale, the activations' shape and dtype between stages, the messages in flight, the saved
    activations of the F's whose B (or W) has not run, and what the step measured."""

    data: Sequence[Microbatch]
    positions: list[Tensor]
    scale: float
    act_shape: tuple[int, ...]
    act_dtype: torch.dtype
    loss: Tensor  # the last stage's loss sum over valid targets
    posted: dict[tuple, tuple[Tensor, dist.Work]] = field(default_factory=dict)  # receives issued, by message
    next_to_post: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # per peer: messages posted
    local: dict[tuple, Tensor] = field(default_factory=dict)  # messages between two stages of this rank
    outbox: list[tuple[dist.P2POp, tuple | None]] = field(default_factory=list)  # (op, key of a receive) to issue
    sends: list[tuple[dist.Work, Tensor]] = field(default_factory=list)  # sends issued, with the tensors they read
    saved: dict[tuple[int, int], dict] = field(default_factory=dict)  # (microbatch, stage) -> F's activations
    peak_in_flight: int = 0  # the most microbatch-stages whose activations this rank held at once
    trace: list[tuple[float, float, Action]] = field(default_factory=list)  # with record_trace on
    waited: float = 0.0  # seconds waited for messages since the last action ended


def _wait(work: dist.Work | None, timeout: timedelta) -> None:
    assert work is not None, "this rank is in the pp group"  # torch returns None to ranks outside the group
    work.wait(timeout)
