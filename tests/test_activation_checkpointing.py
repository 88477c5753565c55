"""Activation checkpointing modes recompute what they say: op-level (--ac op) keeps matmul and attention
outputs, so backward reruns no matmul and no attention; full reruns both; none reruns nothing."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.models import build_model, get_preset, init_weights
from tessera.parallel.fsdp import apply_activation_checkpointing, check_data_parallel, DataParallelConfig
from tessera.topology import Layout


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> tuple[dict[str, int], torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(get_preset("debug"), device="cpu")
    init_weights(model, 0)
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).float().pow(2).mean()
    with OpCounter() as counter:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return counter.counts, loss.detach(), grads


def test_op_level_checkpointing_recomputes_only_the_cheap_ops():
    none, loss_none, grads_none = backward_ops("none")
    op, loss_op, grads_op = backward_ops("op")
    full, _, _ = backward_ops("full")
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert op["mm"] == none["mm"] < full["mm"]  # no matmul recomputed under op; full reruns the block's forward
    assert op.get(attention, 0) == none.get(attention, 0) == 0 < full[attention]
    assert op["rsqrt"] > none.get("rsqrt", 0) and op["silu"] > none.get("silu", 0)  # norms and SwiGLU rerun
    assert torch.equal(loss_op, loss_none)
    for name, g in grads_none.items():
        torch.testing.assert_close(grads_op[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_unknown_ac_mode_is_refused_naming_the_choices():
    with pytest.raises(
        ValueError, match="unknown activation checkpointing 'ops'; use one of none, full, selective, op"
    ):
        check_data_parallel(DataParallelConfig(activation_checkpointing="ops"), Layout(dp_shard=2))
