"""What one training step reports: its figures (StepResult, read into a record at logging time) and the run's
progress counters (Progress), both apart from the Trainer that produces them (runtime/training/training_loop.py)."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .straggler import Straggler


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS on CPU


@dataclass
class Progress:
    """Steps taken, tokens consumed, steps skipped for non-finite values (Stateful)."""

    step: int = 0
    consumed_tokens: int = 0
    skipped_steps: int = 0
    skipped_in_a_row: int = 0  # the latest steps, all skipped (--max-skipped-steps bounds it)

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "consumed_tokens": self.consumed_tokens,
            "skipped_steps": self.skipped_steps,
            "skipped_in_a_row": self.skipped_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.consumed_tokens = int(state["step"]), int(state["consumed_tokens"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))


@dataclass
class StepResult:
    """One step's figures, as tensors until `record()` reads them (one host sync, at logging time)."""

    step: int
    loss: Tensor
    grad_norm: Tensor
    lr: float
    tokens: int
    started: float
    layout: dict[str, int]
    device: torch.device = field(repr=False, default=torch.device("cpu"))
    skipped: bool = False  # the update was dropped (a non-finite value, --on-nonfinite skip)
    skipped_steps: int = 0  # such steps so far in the run
    skip_report: str | None = None  # a skipped step's one line: which values were non-finite (not in the record)
    straggler: Straggler | None = None  # a rank the others have waited for, several steps in a row
    tokens_checksum: int | None = None  # of the global batch's tokens (token files only)
    comm: dict[str, Any] | None = None  # --comm-stats: bytes sent by axis and collective, beside the analytic ones
    # time inside tessera's eager collectives, by axis (those of a compiled block are ops of its graph, untimed)
    collective_wait_s: dict[str, float] = field(default_factory=dict)
    peak_tensor_bytes: int | None = None  # --track-memory, on step 2: live tensor storage at its peak
    # the dtype that carried most matmul FLOPs, read from the tensors during this process's first step
    compute_dtype: str | None = None
    matmul_flops_by_dtype: dict[str, int] | None = None  # that first step's breakdown (its record only)
    moe: dict[str, Any] | None = None  # MoE models: expert load and auxiliary loss (parallel/expert.py's load_report)
    # --pack-documents: the global batch's documents (pieces of documents in its rows) and targets left out
    documents: dict[str, Any] | None = None
    loss_targets: dict[str, int] | None = None  # --sft: the global batch's targets the loss kept and masked
    profile: dict[str, Any] | None = None  # --profile-summary, on its step: time by kind, top kernels, memory
    # --fault-tolerant: whose rows the step read, the quorum, the commit, a recovery, the weights' sum after it
    replicas: dict[str, Any] | None = None
    # the host's step (runtime/metrics/host_account.py): its garbage collections, the CUDA allocator's driver calls,
    # the seconds getting the batch and until the whole step was launched
    host: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        loss, grad_norm = self.loss.item(), self.grad_norm.item()  # waits for the step to finish
        elapsed = time.perf_counter() - self.started
        return {
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": self.lr,
            "tokens_per_s": self.tokens / elapsed,
            "step_time_s": elapsed,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "layout": self.layout,
            "compute_dtype": self.compute_dtype,
            **({"matmul_flops_by_dtype": self.matmul_flops_by_dtype} if self.matmul_flops_by_dtype is not None else {}),
            "skipped": self.skipped,
            "skipped_steps": self.skipped_steps,
            **({"tokens_checksum": self.tokens_checksum} if self.tokens_checksum is not None else {}),
            **({"comm": self.comm} if self.comm is not None else {}),
            "collective_wait_s": self.collective_wait_s,
            **({"moe": self.moe} if self.moe is not None else {}),
            **({"documents": self.documents} if self.documents is not None else {}),
            **({"loss_targets": self.loss_targets} if self.loss_targets is not None else {}),
            **({"peak_tensor_bytes": self.peak_tensor_bytes} if self.peak_tensor_bytes is not None else {}),
            **({"profile": self.profile} if self.profile is not None else {}),
            **({"replicas": self.replicas} if self.replicas is not None else {}),
            **({"host": self.host} if self.host is not None else {}),
            "straggler": None
            if self.straggler is None
            else {"rank": self.straggler.rank, "lag_s": self.straggler.lag_s, "steps": self.straggler.steps},
        }
