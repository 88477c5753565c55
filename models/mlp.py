"""The dense feed-forward block the model families share, with the tensor-parallel plan of its modules: SwiGLU,
down(silu(gate(x)) * up(x)). It is the MLP of Llama and Qwen3, and the shared expert of the MoE block
(models/moe.py). Its `input_comm` slot is the identity on one process; parallel/ puts the copy to (or gather
over) the tp ranks there, once for both column-parallel projections. gpt-oss's clamped SwiGLU activation
(`clamped_swiglu`) is here too; its experts (models/moe.py) use it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from tessera.kernels.dispatch import swiglu


class MLPNames(NamedTuple):
    """The projections' module names (Hugging Face's by default)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, names: MLPNames = MLPNames()):
        super().__init__()
        self.names = names
        self.add_module(names.gate, nn.Linear(dim, ffn_dim, bias=False))
        self.add_module(names.up, nn.Linear(dim, ffn_dim, bias=False))
        self.add_module(names.down, nn.Linear(ffn_dim, dim, bias=False))
        self.input_comm: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.input_comm(x)
        n = self.names
        return getattr(self, n.down)(swiglu(getattr(self, n.gate)(x), getattr(self, n.up)(x)))


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's SwiGLU (transformers' GptOssExperts): the gate clamped above at `limit`, up to [-limit, limit],
    then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def swiglu_tp_plan(names: MLPNames = MLPNames()) -> tuple[tuple[str, str], ...]:
    """The block's tensor-parallel plan, relative to the block: its input prepared once, gate and up split on
    their output features, down on its input features (one reduce of the partial sums)."""
    return (("", "block_input"), (names.gate, "colwise"), (names.up, "colwise"), (names.down, "rowwise"))
