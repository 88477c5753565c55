"""Rank functions shared by the multi-rank tests (module level, so the rank launcher can pickle them)."""

from __future__ import annotations

import torch

from parallel.tensor import full_tensor
from parallel.train import Job, TrainConfig


def train_losses_and_grads(config: TrainConfig, steps: int = 3):
    """Run `steps` AdamW steps; return (per-step losses, full gradients of step 1 before clipping) on
    rank 0 and None elsewhere. Every rank takes part in gathering the gradients."""
    job = Job(config, torch.device("cpu"))
    grads: dict[str, torch.Tensor] = {}

    def keep(model):
        for name, p in model.named_parameters():
            grads[clean_name(name)] = full_tensor(p.grad).detach().clone()

    losses = [job.train_step(on_grads=keep if s == 0 else None)["loss"] for s in range(steps)]
    return (losses, grads) if job.rank == 0 else None


def small_config(**kw) -> TrainConfig:
    base = dict(model="debug", seq_len=32, global_batch=4, steps=3, lr=3e-3, warmup=1, quiet=True)
    base.update(kw)
    return TrainConfig(**base)


def clean_name(name: str) -> str:
    """Parameter name as the one-process model spells it (activation checkpointing adds a wrapper)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def measured_model_states(config: TrainConfig):
    """Per-rank bytes held: parameters right after forward (gathered if the strategy keeps them so),
    gradients after backward, optimizer state after the step."""
    from parallel.data import model_state_bytes_on_rank

    job = Job(config, torch.device("cpu"))
    inputs, targets = job.data.next_batch(job.dp_rank, job.layout.dp)
    loss = job.model.loss(inputs, targets)
    params = model_state_bytes_on_rank(job.model)["parameters"]
    loss.backward()
    grads = model_state_bytes_on_rank(job.model)["gradients"]
    job.optimizer.step()
    optim = model_state_bytes_on_rank(job.model, job.optimizer)["optimizer"]
    return {"parameters": params, "gradients": grads, "optimizer": optim, "num_params": job.model.config.num_params()}


def _first_batch_loss(model, config: TrainConfig) -> float:
    """The loss of the first global batch, averaged over the ranks reading different slices of it."""
    from models.data import TokenStream

    layout = config.layout
    inputs, targets = TokenStream(config.seq_len, config.global_batch).next_batch(
        layout.index("dp", torch.distributed.get_rank()), layout.dp
    )
    loss = model.loss(inputs, targets).detach()
    torch.distributed.all_reduce(loss)
    return loss.item() / torch.distributed.get_world_size()


def first_loss(config: TrainConfig):
    """The loss of the first batch, no step taken (after --init-from, if set)."""
    from parallel import checkpoint

    job = Job(config, torch.device("cpu"))
    if config.init_from:
        checkpoint.load_full_state_dict(job.model, config.init_from)
    return _first_batch_loss(job.model, config)


def meta_built_first_loss(config: TrainConfig):
    """Build on meta, parallelize, materialize, init from the seed: the first batch's loss."""
    from models import build_model, init_weights
    from parallel import parallelize

    mesh = config.layout.build_mesh("cpu")
    model = parallelize(build_model(config.model, device="meta"), mesh, config.parallel)
    model.to_empty(device="cpu")
    init_weights(model, config.seed)
    return _first_batch_loss(model, config)
