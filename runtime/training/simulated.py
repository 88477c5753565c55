"""A simulated world: torch's LocalTensorMode holds every rank's shard in this one process and computes each
collective for all ranks at once (torch.distributed._local_tensor), on the fake process group. The real Trainer
runs once, over every rank's values; the few places where tessera's own Python differs by rank (the rows a rank
reads, its positions under cp, the region of a parameter it initializes) ask parallel/local_world.py and run once per
simulated rank. `trace` trains a layout so at its real world size, or one process (tests/test_simulated_world.py).

What it cannot run yet (refused by name, UNSIMULATED): point-to-point sends (the pipeline's stages, the cp ring),
which torch's LocalTensorMode takes only inside its LocalRunnerMode threads, one per rank, and the experts'
all-to-all, whose split sizes differ by rank."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from tessera.parallel.local_world import world_disabled

# the ranks' degrees a simulated world refuses, with why (each a send/recv between ranks)
UNSIMULATED = {
    "pp": "the pipeline's stages hand activations on with send/recv, which LocalTensorMode runs only in a thread "
    "per rank (LocalRunnerMode); prove pp on real ranks (tessera.testing, tests/test_contract.py)",
    "cp": "the cp ring passes K/V with send/recv, which LocalTensorMode runs only in a thread per rank "
    "(LocalRunnerMode); prove cp on real ranks (tessera.testing, tests/test_contract.py)",
    "ep": "the experts' dispatch is an all-to-all whose split sizes differ by rank, which LocalTensorMode's "
    "collectives do not take (torch 2.13); prove ep on real ranks (tessera.testing, tests/test_contract_moe.py)",
}


def require_local_tensor() -> None:
    """ValueError naming the torch a simulated world needs, when this one lacks LocalTensorMode."""
    import torch  # lazy: (checked before a simulated run builds anything)

    try:
        # lazy: (as above)
        from torch.distributed._local_tensor import LocalTensorMode  # noqa: F401
    except ImportError:
        raise ValueError(
            f"a simulated world needs torch's LocalTensorMode (torch.distributed._local_tensor; checked on torch "
            f"2.13); this torch is {torch.__version__}: upgrade torch, or prove the layout on real ranks"
        ) from None


def unsimulated_axes(layout: Any) -> list[str]:
    """The layout's axes a simulated world cannot run yet (UNSIMULATED's)."""
    return [axis for axis in UNSIMULATED if getattr(layout, axis) > 1]


def shard_multiple(layout: Any) -> int:
    """What a tiny model's vocabulary must be a multiple of for `layout` to shard it evenly: the embedding's
    rows over tp and the FSDP ranks (dp_shard x cp; ep's edp for experts is coarser). LocalTensorMode holds
    every rank's shard at one shape, so an uneven last shard (FSDP2's padding) is not simulated."""
    return layout.tp * layout.dp_shard * layout.cp * layout.dp_replicate


@contextlib.contextmanager
def fsdp2_storage_per_rank() -> Iterator[None]:
    """FSDP2 frees and re-allocates a gathered parameter by resizing its storage; a LocalTensor's storage is
    its ranks' tensors', and resizing the wrapper raises (torch 2.13: "Attempted to call resize_() on an invalid
    python storage"). For the block, FSDP2's two helpers resize each simulated rank's tensor instead."""
    # lazy: FSDP2's internals, patched only around a simulated run
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
    from torch.distributed._local_tensor import LocalTensor

    alloc, free = fsdp_param.alloc_storage, fsdp_param.free_storage

    def each(helper: Callable[[Any], None]) -> Callable[[Any], None]:
        def run(tensor: Any) -> None:
            for t in tensor._local_tensors.values() if isinstance(tensor, LocalTensor) else (tensor,):
                helper(t)

        return run

    for module, name, helper in ((fsdp_param, "alloc_storage", alloc), (fsdp_group, "alloc_storage", alloc)):
        setattr(module, name, each(helper))
    setattr(fsdp_param, "free_storage", each(free))
    try:
        yield
    finally:
        setattr(fsdp_param, "alloc_storage", alloc)
        setattr(fsdp_group, "alloc_storage", alloc)
        setattr(fsdp_param, "free_storage", free)


def check_simulated(config: Any, world: int) -> None:
    """ValueError naming what a simulated world of `world` ranks cannot run of `config`, before anything is
    built: a world that is not the layout's, an axis UNSIMULATED names, a vocabulary the shards do not split
    evenly, a torch without LocalTensorMode."""
    layout = config.layout
    if world != layout.world_size:
        raise ValueError(f"world={world} is not the world of {layout} ({layout.world_size} ranks)")
    off = unsimulated_axes(layout)
    if off:
        raise ValueError(f"{off[0]}={getattr(layout, off[0])} is not simulated yet: {UNSIMULATED[off[0]]}")
    vocab, multiple = config.model_config.vocab_size, shard_multiple(layout)
    if vocab % multiple:
        raise ValueError(
            f"vocab_size={vocab} does not split evenly over {layout}'s {multiple} shards (tp x dp_shard x cp x "
            f"dp_replicate): use vocab_size={-(-vocab // multiple) * multiple}"
        )
    require_local_tensor()


def trace(config: Any, world: int) -> dict[str, Any]:
    """{"losses", "grad_norms", "grads"} of `config` trained for its steps on `world` simulated ranks (1: one
    process) in this process, on the fake process group: each step's loss and grad norm, and its gradients
    before clipping, whole, by their one-process names."""
    import torch  # lazy: a simulated run needs torch (tessera check's parser does not)
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor import DTensor

    from tessera.models.init import one_process_name

    from .trainer import Trainer

    if dist.is_initialized():
        raise RuntimeError("a simulated world runs in a process with no process group of its own")
    if world > 1:
        check_simulated(config, world)
    # gathering FSDP-over-tp gradients whole makes DTensor note its two all-gathers once per parameter
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("fake", rank=0, world_size=world)
    losses: list[float] = []
    norms: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    try:
        mode = LocalTensorMode(world) if world > 1 else contextlib.nullcontext()
        with warnings.catch_warnings(), mode, fsdp2_storage_per_rank():
            # the fake backend takes no timeout (each collective is computed here, nothing waits)
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            trainer = Trainer(config, torch.device("cpu"), mesh=config.layout.build_mesh("cpu"))

            def keep(parts: list) -> None:
                step: dict[str, torch.Tensor] = {}
                for part in parts:
                    for name, p in part.named_parameters():
                        g = p.grad
                        full = torch.zeros(p.shape) if g is None else (g.full_tensor() if isinstance(g, DTensor) else g)
                        if isinstance(full, LocalTensor):  # every simulated rank holds it whole: rank 0's copy
                            with world_disabled():
                                full = full._local_tensors[0]
                        step[one_process_name(name)] = full.detach().clone()
                grads.append(step)

            for _ in range(config.runtime.steps):
                record = trainer.train_step(on_grads=keep).record()
                losses.append(float(record["loss"]))
                norms.append(float(record["grad_norm"]))
    finally:
        dist.destroy_process_group()
    return {"losses": losses, "grad_norms": norms, "grads": grads}
