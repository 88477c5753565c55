"""CPU offload: model states in host memory, on every layout FSDP2 is on (`--offload optimizer|params`).

`params` is FSDP2's own `CPUOffloadPolicy` (the FSDP2 tutorial's map of FSDP1's CPUOffload): each rank's
parameter shards, their gradients and the optimizer state live in pinned host memory; FSDP2 copies a unit's
shards to the GPU for its all-gather and the reduce-scattered gradients back, and the optimizer steps on the
host (torch's fused CPU AdamW). The GPU keeps only gathered units and activations.

`optimizer` is the variant FSDP2 has none of (DeepSpeed's ZeRO-Offload, built on torch's own pieces): the
weights and gradients stay on the GPU, AdamW's moments and an fp32 copy of each shard live in pinned host
memory, and `HostAdamW.step` moves the gradients down and the updated shards back up with non-blocking copies
on a side stream, the step between them running on the host. The moments stay DTensors placed as their
parameters (their local tensors on the host), so checkpoints see an ordinary optimizer and load both ways.

On CPU (the tests) the mechanism still runs: the host buffers are separate tensors, the copies real.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.distributed.tensor import DTensor

from tessera.topology.estimators.offload_model import check_offload_mode as check_offload

HOST = torch.device("cpu")


def fsdp_offload_policy(mode: str, device_type: str) -> OffloadPolicy:
    """FSDP2's policy for `mode`: CPUOffloadPolicy for params (host buffers pinned where a GPU copies them)."""
    if check_offload(mode) == "params":
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def move_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Buffers (RoPE tables) to the compute device: under `params` the parameters are materialized on the host
    (FSDP2 requires its offloaded shards there) but the forward reads the buffers on the GPU."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != torch.device(device):
                module._buffers[name] = buffer.to(device)


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _host_buffer(like: Tensor, pinned: bool) -> Tensor:
    out = torch.empty(like.shape, dtype=like.dtype, device=HOST)
    return out.pin_memory() if pinned else out


def _as_host(key: str, value: Any, param: Tensor) -> Any:
    """An optimizer state value on the host, placed as its parameter (a DTensor whose local tensor is there);
    the step count a plain host scalar (the fused CPU kernel reads it beside the parameter)."""
    if not isinstance(value, Tensor):
        return value
    local = _local(value)
    if local.device != HOST:
        local = local.to(HOST)
    if key != "step" and isinstance(param, DTensor) and local.shape == param._local_tensor.shape:
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local


class HostAdamW(torch.optim.AdamW):
    """AdamW whose moments live on the host and whose update runs there (torch's fused CPU kernel), for
    parameters that stay on the GPU. Each parameter's local shard has a host master copy, refreshed from the
    device whenever anything else wrote the shard (a checkpoint load: its version counter moved), and a host
    gradient buffer; both pinned on CUDA. The shards' update is exactly AdamW's: the same kernel, the same fp32."""

    def __init__(self, params: Any, **kwargs: Any):
        kwargs.update(fused=True, foreach=False)
        super().__init__(params, **kwargs)
        self._masters: dict[Tensor, tuple[Tensor, int]] = {}  # param -> (host fp32 copy of its shard, version)
        self._grads: dict[Tensor, Tensor] = {}
        self._stream: Any = None
        self.register_load_state_dict_post_hook(lambda o: o._state_to_host())  # type: ignore[attr-defined]

    def host_bytes(self) -> int:
        """What this optimizer holds in host memory now: masters, gradient buffers and the state."""
        tensors = [m for m, _ in self._masters.values()] + list(self._grads.values())
        tensors += [_local(v) for s in self.state.values() for v in s.values() if isinstance(v, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors if t.device == HOST)

    def _state_to_host(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    self.state[p] = {k: _as_host(k, v, p) for k, v in state.items()}

    def _copies(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The side stream the copies run on (CUDA); on CPU they run in place, synchronously."""
        return torch.cuda.stream(self._stream) if device.type == "cuda" else contextlib.nullcontext()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure (the update runs on the host, once)")
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            if isinstance(p, DTensor) and type(p._local_tensor) is not torch.Tensor:
                raise ValueError(
                    f"offload=optimizer: a parameter of shape {tuple(p.shape)} wraps its shard in "
                    f"{type(p._local_tensor).__name__} (FP8 all-gather): use fp8=rowwise or offload=params"
                )
        if not params:
            return None
        device = _local(params[0]).device
        pinned = device.type == "cuda"
        if pinned:
            self._stream_ready(device)
        with self._copies(device):  # down: stale masters and this step's gradients
            for p in params:
                local = _local(p)
                master = self._masters.get(p)
                if master is None or master[1] != local._version:
                    buffer = master[0] if master is not None else _host_buffer(local, pinned)
                    buffer.copy_(local, non_blocking=pinned)
                    self._masters[p] = (buffer, local._version)
                if p.grad is not None:
                    grad = self._grads.get(p)
                    if grad is None:
                        grad = self._grads[p] = _host_buffer(local, pinned)
                    grad.copy_(_local(p.grad), non_blocking=pinned)
        if pinned:
            self._stream.synchronize()  # the host step reads what the copies wrote
        with self._on_host():
            super().step()
        with self._copies(device):  # up: the updated shards
            for p in params:
                local, host_copy = _local(p), self._masters[p][0]
                local.copy_(host_copy, non_blocking=pinned)
                self._masters[p] = (host_copy, local._version)
        if pinned:
            torch.cuda.current_stream(device).wait_stream(self._stream)  # the next forward reads them
        return None

    def _stream_ready(self, device: torch.device) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the gradients are final

    @contextlib.contextmanager
    def _on_host(self) -> Iterator[None]:
        """Within: each group holds its parameters' host masters (gradients: the host buffers; state: its
        local host tensors, the step count too); on the way out the parameters again, the state placed as
        they are (state the first step created wrapped likewise)."""
        swapped: list[tuple[dict[str, Any], list[Tensor]]] = []
        for group in self.param_groups:
            params, masters = group["params"], []
            for p in params:
                master = self._masters[p][0]
                master.grad = self._grads.get(p) if p.grad is not None else None
                state = self.state.pop(p, {})
                if state:
                    self.state[master] = {
                        k: _local(v).to(HOST) if isinstance(v, Tensor) else v for k, v in state.items()
                    }
                masters.append(master)
            group["params"] = masters
            swapped.append((group, params))
        try:
            yield
        finally:
            for group, params in swapped:
                group["params"] = params
                for p in params:
                    master = self._masters[p][0]
                    master.grad = None
                    state = self.state.pop(master, {})
                    if state:
                        self.state[p] = {k: _as_host(k, v, p) for k, v in state.items()}


def offload_report(mode: str, parts: list[nn.Module], optimizers: list[Any], device: torch.device) -> dict[str, Any]:
    """What this rank holds in host memory now, measured from the tensors (distinct storages once): the
    parameter shards, gradients and optimizer state whose local tensors lie on the host, HostAdamW's master
    copies and gradient buffers; and the same on the device. On a CPU run both are host memory: the record
    says so (the mechanism ran, the copies were real, nothing left a GPU)."""
    seen: set[int] = set()
    held = {"host": 0, "device": 0}

    def count(t: Any) -> None:
        if not isinstance(t, Tensor):
            return
        local = _local(t)
        key = local.untyped_storage().data_ptr()
        if key in seen or local.device.type == "meta":
            return
        seen.add(key)
        held["host" if local.device == HOST and device.type != "cpu" else "device"] += local.untyped_storage().nbytes()

    host_side: dict[str, int] = {}
    for o in optimizers:
        if isinstance(o, HostAdamW):
            before = sum(held.values())
            for master, _ in o._masters.values():
                count(master)
            for grad in o._grads.values():
                count(grad)
            for state in o.state.values():
                for v in state.values():
                    count(v)
            host_side["optimizer_bytes"] = host_side.get("optimizer_bytes", 0) + sum(held.values()) - before
    params = [p for part in parts for p in part.parameters()]
    for p in params:
        count(p)
        count(p.grad)
    for o in optimizers:
        for state in o.state.values():
            for v in state.values():
                count(v)
    on_host = {
        "parameters": all(_local(p).device == HOST for p in params),
        "optimizer_state": all(
            _local(v).device == HOST
            for o in optimizers
            for s in o.state.values()
            for v in s.values()
            if isinstance(v, Tensor)
        ),
    }
    return {
        "mode": mode,
        "states_on_host": on_host,  # where the tensors lie, read from them
        "fsdp_offloaded_parameters": fsdp_offloaded_parameters(parts),
        "host_bytes": held["host"] if device.type != "cpu" else None,
        "device_bytes": held["device"] if device.type != "cpu" else None,
        "host_copies_bytes": host_side.get("optimizer_bytes"),  # HostAdamW's masters, gradient buffers, moments
        "measured_as": "the tensors' storages after the first step"
        + (
            "; a CPU run: host and device are one memory (the host copies are separate tensors)"
            if device.type == "cpu"
            else ""
        ),
    }


def fsdp_offloaded_parameters(parts: list[nn.Module]) -> int:
    """How many parameters FSDP2 holds under its CPUOffloadPolicy (read from its units' parameter groups:
    torch 2.13's list of them, or 2.11's one)."""
    count = 0
    for part in parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            count += sum(bool(getattr(fp, "offload_to_cpu", False)) for g in groups for fp in g.fsdp_params)
    return count
