"""Fault-tolerant data parallel over replica groups (`--fault-tolerant` with `--dp-replicate R`), on torchft.

Each replica group is its own set of ranks (its own launch), training the layout without dp_replicate (FSDP2,
tp, pp, cp, ep inside it as always) on its share of every global batch (`ReplicaRows`). Rank i of every group
is, with torchft's Manager, one replicate axis: a quorum each step (torchft's lighthouse decides who is in it),
then ONE all-reduce over the replicas in it of the step's loss sum, its target count, a one-hot of who took
part, and every gradient shard weighted by its group's targets, then a commit vote before the optimizer steps.

A group that died (any of its ranks) leaves the quorum: the others finish the step with the live ones, the
gradient the mean over the targets of the rows they read. The dead group's rows are skipped, and the step's
record says whose rows were read (`replicas`), so nothing is counted twice and the run equals one process
trained on exactly those rows. A restarted group joins at a step boundary and receives its peer's live state
(weights, optimizer state, schedule, data position, RNG) from the same rank of a live group, over the network
(parallel/replica_transport.py), not from disk.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

FT_EXTRA = "pip install -e '.[ft]' (torchft 0.2.0)"


def quiet_torchft() -> None:
    """torchft's Rust side at warnings only (every quorum at INFO otherwise), unless the user set RUST_LOG; it
    reads the level once, when the module first loads, so this runs before any torchft import."""
    os.environ.setdefault("RUST_LOG", "warn")


def require_torchft() -> None:
    """ValueError naming the extra to install when torchft is missing (before any rank starts)."""
    quiet_torchft()  # this import is the first in a run
    try:
        # lazy: torchft is the `ft` extra, loaded only by fault-tolerant runs
        import torchft  # noqa: F401
    except ImportError:
        raise ValueError(f"fault_tolerant=True needs torchft, which is not installed: {FT_EXTRA}") from None


class _NoFlightRecorderOnGloo(logging.Filter):
    """torchft's manager warns at every reconfigure that it cannot reset NCCL's flight recorder, on gloo too."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


@dataclass(frozen=True)
class FaultTolerance:
    replicas: int  # R: the replica groups (the layout's dp_replicate)
    replica_id: int  # this group's, 0..R-1
    lighthouse: str  # torchft's lighthouse, http://HOST:PORT
    timeout: float = 30.0  # seconds a quorum or an all-reduce between replica groups may take
    min_replicas: int = 1  # the fewest groups a step may commit with


@dataclass
class ReplicaStep:
    """What the replicate axis did in one step, for the step's record."""

    replicas: list[int]  # the groups whose rows this step read (the one-hot's sum)
    participants: int  # torchft's count of the quorum's members
    committed: bool  # every participant voted to apply the step
    healed: bool  # this group received its state from a peer at this step's start
    loss_sum: Tensor
    valid: Tensor
    recovered_bytes: int = 0  # the state bytes this group received, when it healed
    retries: int = 0  # the step taken again after a group failed during it (the trainer's count)

    def record(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas if self.committed else [],  # whose rows the applied update read
            "retries": self.retries,
            "participants": self.participants,
            "committed": self.committed,
            "healed": self.healed,
            "recovered_bytes": self.recovered_bytes,
        }


@dataclass
class ReplicaSync:
    """This rank's side of its replicate axis: torchft's Manager over the same group rank of every replica
    group, with tessera's safe transport for recoveries. `state` and `load` give and take this rank's state."""

    ft: FaultTolerance
    group_rank: int
    group_world: int
    store_host: str
    store_port: int
    device_type: str
    state: Callable[[], dict[str, Any]]
    load: Callable[[dict[str, Any]], None]
    # a fault drill's hook (runtime/training/ft_launch.py): called at "reduce" and "recover"
    point: Callable[[str], None] = lambda at: None
    manager: Any = field(init=False)
    healed: bool = field(init=False, default=False)
    recovered_bytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        quiet_torchft()
        from torchft import Manager  # lazy: the ft extra
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from .quorum_ids import FreshQuorums
        from .replica_transport import SafeTransport, state_bytes

        timeout = timedelta(seconds=self.ft.timeout)
        pg = ProcessGroupNCCL(timeout=timeout) if self.device_type == "cuda" else ProcessGroupGloo(timeout=timeout)
        if self.device_type != "cuda":  # NCCL's flight recorder has nothing to record on gloo: no warning of it
            manager_log = logging.getLogger("torchft.manager")
            if not any(isinstance(f, _NoFlightRecorderOnGloo) for f in manager_log.filters):
                manager_log.addFilter(_NoFlightRecorderOnGloo())

        def load(state: dict[str, Any]) -> None:
            self.point("recover")
            self.healed, self.recovered_bytes = True, state_bytes(state)
            self.load(state)

        self.manager = Manager(
            pg=pg,
            load_state_dict=load,
            state_dict=self.state,
            min_replica_size=self.ft.min_replicas,
            use_async_quorum=False,  # the quorum (and any recovery) before the step's forward
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=self.group_rank,
            world_size=self.group_world,
            store_addr=self.store_host,
            store_port=self.store_port,
            lighthouse_addr=self.ft.lighthouse,
            replica_id=f"tessera_replica_{self.ft.replica_id}",
            checkpoint_transport=SafeTransport(timeout),
            # a quorum request the lighthouse misses (it restarted) is asked again rather than failing the group
            quorum_retries=10,
            init_sync=False,  # every group initializes from the same seed: equal weights, nothing to send
        )
        # fresh rendezvous keys for every process group, a restarted lighthouse's reused quorum ids included
        self.manager._client = FreshQuorums(self.manager, self.group_rank, timeout)

    def begin_step(self, wait_for: int = 0, timeout: float | None = None) -> None:
        """The step's quorum; a group that is behind receives a peer's state here (then `healed`). `wait_for`:
        ask again (for up to the timeout) until the quorum holds that many groups: the run's first step, so
        that groups started apart (separate torchrun jobs) begin together instead of each alone."""
        self.healed, self.recovered_bytes = False, 0
        self.manager.start_quorum()
        deadline = time.monotonic() + (self.ft.timeout if timeout is None else timeout)
        while self.manager.num_participants() < wait_for and time.monotonic() < deadline and not self.healed:
            time.sleep(0.1)
            self.manager.start_quorum()

    def reduce(self, loss_sum: Tensor, valid: int, grads: list[Tensor]) -> ReplicaStep:
        """Sum over the quorum, in one all-reduce, of the loss sum, the target count, who took part and each
        gradient shard times this group's targets; the shards then hold the mean over every target read."""
        from torch.distributed import ReduceOp  # lazy: (as above) only fault-tolerant runs reduce here

        device = loss_sum.device
        who = torch.zeros(self.ft.replicas, dtype=torch.float32, device=device)
        who[self.ft.replica_id] = 1.0
        head = torch.cat([loss_sum.detach().float().reshape(1), torch.tensor([float(valid)], device=device), who])
        flat = [g.detach().float().flatten() * float(valid) for g in grads]
        buffer = torch.cat([head, *flat]) if flat else head
        self.point("reduce")
        self.manager.allreduce(buffer, reduce_op=ReduceOp.SUM).wait()
        total = buffer[1]
        offset = head.numel()
        if float(total) > 0:
            for g in grads:
                n = g.numel()
                g.copy_((buffer[offset : offset + n] / total).view_as(g).to(g.dtype))
                offset += n
        replicas = [r for r in range(self.ft.replicas) if float(buffer[2 + r]) > 0.5]
        committed = bool(self.manager.should_commit())
        return ReplicaStep(
            replicas,
            int(self.manager.num_participants()),
            committed,
            self.healed,
            buffer[0].clone(),
            total.clone(),
            self.recovered_bytes,
        )

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class ReplicaRows:
    """Replica group `replica` of `replicas`'s rows of each global batch of `stream` (built for the whole
    global batch): rows [r B / R, (r + 1) B / R) of the built-in text, the same rows of token files (read as
    the dp ranks of the whole run would read them). Its state is the stream's: the position in the data."""

    def __init__(self, stream: Any, replica: int, replicas: int):
        self.stream, self.replica, self.replicas = stream, replica, replicas
        self.separator = getattr(stream, "separator", None)
        if hasattr(stream, "next_local_batch"):  # token files: each dp rank reads its own rows (batches.py)
            self.next_local_batch = self._next_local_batch

    def next_global_batch(self) -> tuple[Tensor, ...]:
        batch = self.stream.next_global_batch()
        rows = batch[0].shape[0] // self.replicas
        return tuple(t[self.replica * rows : (self.replica + 1) * rows] for t in batch)

    def _next_local_batch(self, batch_index: int, dp: int) -> Any:
        return self.stream.next_local_batch(self.replica * dp + batch_index, self.replicas * dp)

    def __getattr__(self, name: str) -> Any:  # the stream's other attributes (vocab_size, ...)
        if name in ("stream", "next_local_batch"):
            raise AttributeError(name)
        return getattr(self.stream, name)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def gradient_shards(parts: list[nn.Module]) -> list[Tensor]:
    """Every parameter's local gradient shard, in a fixed order (the same on the same rank of every group)."""
    return [_local(p.grad) for part in parts for p in part.parameters() if p.grad is not None]


def weights_bits(parts: list[nn.Module]) -> int:
    """A checksum of the bits of this rank's weight shards (each element's bit pattern as an integer, summed in
    int64 on the device): the same on two groups exactly when their weights are bitwise the same, but for
    collisions."""
    sums = []
    for part in parts:
        for p in part.parameters():
            local = _local(p).detach().contiguous()
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
            sums.append(local.view(bits).to(torch.int64).sum())
    return int(torch.stack(sums).sum()) if sums else 0  # one host sync


def rank_state(parts: list[nn.Module], optimizers: list[Any], small: dict[str, Any]) -> dict[str, Any]:
    """This rank's state as a peer sends it: its weight shards by part and name, each optimizer's state
    dict (its tensors the local shards), the small pieces' state dicts (schedule, data, progress) and the RNG."""
    return {
        "weights": [{name: _local(p).detach() for name, p in part.named_parameters()} for part in parts],
        "optimizers": [o.state_dict() for o in optimizers],
        "small": {name: piece.state_dict() for name, piece in small.items()},
        "rng": torch.get_rng_state(),
    }


@torch.no_grad()
def load_rank_state(parts: list[nn.Module], optimizers: list[Any], small: dict[str, Any], state: dict) -> None:
    """Take a peer's `rank_state`: weights copied into this rank's shards, optimizer state loaded and placed as
    its parameters (DTensors where they are), the small pieces and the RNG restored."""
    for part, weights in zip(parts, state["weights"]):
        for name, p in part.named_parameters():
            _local(p).copy_(weights[name])
    for optimizer, saved in zip(optimizers, state["optimizers"]):
        optimizer.load_state_dict(_with_int_keys(saved))
        for group in optimizer.param_groups:
            for p in group["params"]:
                entry = optimizer.state.get(p)
                if not entry or not isinstance(p, DTensor):
                    continue
                for key, value in entry.items():
                    if key != "step" and isinstance(value, Tensor) and not isinstance(value, DTensor):
                        entry[key] = DTensor.from_local(
                            value.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape
                        )
    for name, piece in small.items():
        piece.load_state_dict(state["small"][name])
    torch.set_rng_state(state["rng"])


def _with_int_keys(saved: dict) -> dict:
    """An optimizer state dict whose state keys came back as they went (ints; JSON keeps them, but be sure)."""
    out = dict(saved)
    out["state"] = {int(k): v for k, v in saved["state"].items()}
    return out
