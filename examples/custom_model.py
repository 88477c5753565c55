"""Your own transformer on all four axes: a small GPT-style model unlike Llama (LayerNorm with biases, a
GELU MLP, learned positions, biased projections), its spec, and the proof that pp2 x cp2 x tp2 (8 CPU ranks)
trains it like one process.

    python examples/custom_model.py

tessera's axes never name a model's modules: they read a spec (tessera.models.spec.ModelSpec). The model
keeps the spec's contract: forward(inputs, positions=None, targets=None), where positions are the tokens'
global positions (context parallel hands each rank its zigzag chunks, so the position table is read at
the true positions), modules of the first and last stage may be None on a pipeline stage, the blocks are
an nn.ModuleDict, and attention runs in CausalAttention slots that context parallel replaces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.models.init import ONES, ZEROS
from tessera.models.layers import CausalAttention
from tessera.models.spec import ModelSpec, PipelineSplit
from tessera.topology.shapes import ModelShape


@dataclass(frozen=True)
class GPTConfig:
    family = "gpt-mini"  # any name: this spec is passed explicitly, not registered
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 96
    max_seq_len: int = 64
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.core = CausalAttention()  # the slot context parallel fills

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape  # heads from the shapes: a tp rank holds n_heads / tp of them
        q, k, v = (f(x).view(B, S, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.proj(self.core(q, k, v).transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up, self.down = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.dim), SelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.dim), MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe: nn.Module | None = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f: nn.Module | None = nn.LayerNorm(cfg.dim)
        self.head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, inputs: Tensor, positions: Tensor | None = None, targets: Tensor | None = None):
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        h = inputs if inputs.is_floating_point() else self.wte(inputs) + self.wpe(positions)
        for block in self.blocks.values():
            h = block(h)
        if self.ln_f is None:
            return h  # a stage before the last: hidden states
        h = self.ln_f(h)
        return self.head(h) if targets is None else self.head(h, targets)  # the fused loss head takes targets


def init_std(name: str, cfg: GPTConfig):
    if name.endswith("bias"):
        return ZEROS
    if ".ln" in name or name.startswith("ln_"):
        return ONES
    return cfg.init_std / (math.sqrt(2 * cfg.n_layers) if name.endswith(("proj.weight", "down.weight")) else 1)


def shape(c: GPTConfig) -> ModelShape:
    return ModelShape(
        dim=c.dim,
        n_layers=c.n_layers,
        n_heads=c.n_heads,
        n_kv_heads=c.n_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        ffn_dim=4 * c.dim,
        mlp="gelu",
        norm="layer",
        bias=True,
        learned_positions=c.max_seq_len,
        family="gpt-mini",
    )


GPT_SPEC = ModelSpec(
    name="gpt-mini",
    config_type=GPTConfig,
    build=GPT,
    init_std=init_std,
    shape=shape,
    tp_plan=(
        ("wte", "embedding"),
        ("blocks.*.attn", "block_input"),
        ("blocks.*.attn.[qkv]", "colwise"),
        ("blocks.*.attn.proj", "rowwise"),
        ("blocks.*.mlp", "block_input"),
        ("blocks.*.mlp.up", "colwise"),
        ("blocks.*.mlp.down", "rowwise"),
        ("blocks.*.ln[12]", "norm"),
        ("ln_f", "norm"),
        ("head", "colwise_gather"),
    ),
    blocks="blocks.*",
    pipeline=PipelineSplit(first=("wte", "wpe"), blocks="blocks", last=("ln_f", "head")),
    attention="blocks.*.attn.core",
    head="head",
    # the hidden weight matrices `--optimizer muon` orthogonalizes (one-process names, fnmatch); the
    # embeddings, the head, the LayerNorms and the biases stay on AdamW. Without it Muon is refused.
    matrices=(
        "blocks.*.attn.[qkv].weight",
        "blocks.*.attn.proj.weight",
        "blocks.*.mlp.up.weight",
        "blocks.*.mlp.down.weight",
    ),
)


def build_gpt() -> GPT:
    return GPT(GPTConfig())


def batch(rows: int = 4, seq: int = 32, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, GPTConfig.vocab_size, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


if __name__ == "__main__":
    from tessera.testing import assert_layouts_equivalent
    from tessera.topology import Layout

    layout = Layout(pp=2, cp=2, tp=2)
    assert_layouts_equivalent(build_gpt, [layout], batch=batch(), steps=2, spec=GPT_SPEC)
    print(f"gpt-mini on {layout} trains like one process (losses and every gradient within 1e-5)")
