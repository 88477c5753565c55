"""What one training step measures, as one context manager around it (`StepMeasures`): the dtype the matmuls
ran in (rank 0's first step), the bytes each collective sent (--comm-stats, every step or the first), the
live tensor bytes (--track-memory, step 2: the optimizer state exists), the step's profile (--profile-summary),
and always the seconds this rank waited in tessera's collectives and what its host did besides launching the step
(garbage collections, the CUDA allocator's driver calls, the batch's and the launch's seconds:
runtime/metrics/host_account.py). On exit each is written into the step's StepResult; a step that raised records
nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from tessera.metrics.dtype_probe import MatmulDtypes
from tessera.metrics.host_account import HostAccount
from tessera.metrics.memtrack import LiveTensorBytes
from tessera.metrics.step_profile import ProfiledStep
from tessera.parallel.comm import WAIT_SECONDS
from tessera.parallel.comm_stats import CommCounter
from tessera.parallel.fsdp import layout_for_strategy
from tessera.topology.estimators import comm_model

from .step_result import StepResult


def no_mark(phase: str) -> None:
    """The phase marker outside a profiled step: nothing to mark."""


class StepMeasures:
    """`with StepMeasures(trainer, step) as measured: measured.result = trainer's step` enters the measuring
    modes `step` asks for around it, innermost the profiler (the other modes' own work stays out of its
    figures), and fills `measured.result` with their figures once they have exited."""

    def __init__(self, trainer: Any, step: int):
        runtime = trainer.config.runtime
        self.trainer = trainer
        self.counting = runtime.comm_stats == "every" or (runtime.comm_stats == "first" and step == 1)
        self.tracking = runtime.track_memory and step == 2
        self.profiling = runtime.profile_summary == step
        self.probing = trainer.dtype_report is None  # rank 0's first step: what the matmuls ran in
        self.result: StepResult | None = None
        self._modes = contextlib.ExitStack()
        self._waits: dict[str, float] = {}

    @property
    def any_mode(self) -> bool:
        return self.probing or self.counting or self.tracking or self.profiling

    def __enter__(self) -> StepMeasures:
        try:
            return self._enter()
        except BaseException:
            self._modes.close()  # the modes entered before the one that failed (the gc callback among them)
            raise

    def _enter(self) -> StepMeasures:
        t, modes = self.trainer, self._modes
        token = WAIT_SECONDS.set(self._waits)
        modes.callback(WAIT_SECONDS.reset, token)
        self._host = modes.enter_context(HostAccount(t.device))
        if self.probing:
            self._probe = modes.enter_context(MatmulDtypes())
        if self.tracking:
            self._tracker = modes.enter_context(LiveTensorBytes())
            self._tracker.track_existing(t.parts, t.optimizer.optimizers)
        if self.counting:
            data_layout = layout_for_strategy(t.layout, t.config.parallel_config().data.strategy)
            self._counter = modes.enter_context(CommCounter(data_layout, t.rank))
        if self.profiling:
            self._profiled = modes.enter_context(ProfiledStep(t.device, t.parts, t.optimizer.optimizers))
            t.phase_mark = self._profiled.mark
            modes.callback(setattr, t, "phase_mark", no_mark)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: Any) -> None:
        self._modes.close()
        if kind is None:
            assert self.result is not None, "StepMeasures: set .result to the step's StepResult inside the block"
            self._record(self.result)

    def _record(self, result: StepResult) -> None:
        t = self.trainer
        result.collective_wait_s = self._waits
        # launch_s: until the host first waited for the device (the non-finite check reads the loss and the norm):
        # the forward, backward and clip launched; a host-bound step's launch grows with it, a device-bound one's not
        result.host = {**self._host.figures(), "launch_s": t.launched_at - result.started, "data_s": t.data_s}
        if self.probing:
            t.dtype_report = self._probe.report()
            result.matmul_flops_by_dtype = t.dtype_report["matmul_flops_by_dtype"]
        result.compute_dtype = t.dtype_report["compute_dtype"]
        if self.any_mode and t.config.parallel.compile:
            # dynamo skips (and marks skipped for good) a frame first seen under a dispatch mode: forget
            # that, so the blocks compile from the next step on
            torch._dynamo.reset()
        if self.tracking:
            result.peak_tensor_bytes = self._tracker.peak
        if self.counting:
            analytic = t.analytic_comm()
            if t.optimizer.muon():  # Muon's gathers and scatters, by the matrices it plans
                analytic["muon"] = comm_model.muon_bytes(
                    [(p.numel(), plan.size) for o in t.optimizer.muon() for p, plan in o.plans.items()]
                )
            result.comm = {**self._counter.report(), "analytic_bytes_by_axis": analytic}
        if self.profiling:
            result.profile = self._profiled.summary()
