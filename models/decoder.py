"""The decoder-only causal LM that every model family is: token embedding -> blocks (attention and a feed-forward
block, each behind an RMSNorm, with residuals) -> final norm -> output head, and what a family's spec derives
from it (pipeline split, attention slots, tensor-parallel plan, init, sizes).

A family subclasses `DecoderLM`, names its modules (`DecoderNames`: its checkpoints' parameter names) and says
which attention and feed-forward block each layer has (`build_attention`, `build_mlp`: the layer index lets a
family vary them, e.g. DeepSeek-V3's dense first layers, gpt-oss's alternating sliding windows). The blocks are
models/attention.py's, models/mlp.py's and models/moe.py's. Nothing here knows any parallelism: parallel/
swaps modules by the spec's patterns, and a pipeline stage is this model with modules set to None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from tessera.topology.shapes import ModelShape

from .init import ONES, Init
from .layers import RMSNorm, Rotary
from .spec import HFAdapter, ModelSpec, PipelineSplit, TPPlan, matrix_patterns, prefixed


class DecoderNames(NamedTuple):
    """A family's module names (Hugging Face's by default); the repeated blocks are always `layers`. A norm's
    name ends in "norm" (`DepthScaledInit` draws it as ones)."""

    embedding: str = "embed_tokens"
    norm: str = "norm"
    head: str = "lm_head"
    pre_attention_norm: str = "input_layernorm"
    attention: str = "self_attn"
    pre_mlp_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"


class DecoderSizes(Protocol):
    """What the decoder, its spec helpers and the shared blocks read of a family's config."""

    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def ffn_dim(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def init_std(self) -> float: ...


class DecoderBlock(nn.Module):
    """x + attention(norm(x)), then h + mlp(norm(h)); the four modules under the family's names."""

    def __init__(self, names: DecoderNames, attention: nn.Module, mlp: nn.Module, dim: int, eps: float):
        super().__init__()
        self.names = names
        self.add_module(names.pre_attention_norm, RMSNorm(dim, eps))
        self.add_module(names.attention, attention)
        self.add_module(names.pre_mlp_norm, RMSNorm(dim, eps))
        self.add_module(names.mlp, mlp)

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        n = self.names
        h = x + getattr(self, n.attention)(getattr(self, n.pre_attention_norm)(x), rope, positions)
        return h + getattr(self, n.mlp)(getattr(self, n.pre_mlp_norm)(h))


class DecoderLM(nn.Module):
    """The one-process causal LM. `rope`: the rotary tables every layer's attention reads; `tied`: the head's
    weight is the embedding's (one nn.Parameter; named_parameters() names it by the embedding)."""

    names = DecoderNames()

    def __init__(self, cfg: DecoderSizes, rope: Rotary, tied: bool = False):
        super().__init__()
        self.config = cfg
        n = self.names
        self.add_module(n.embedding, nn.Embedding(cfg.vocab_size, cfg.dim))
        self.rope = rope
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderBlock(
                    self.layer_names(i), self.build_attention(cfg, i), self.build_mlp(cfg, i), cfg.dim, cfg.norm_eps
                )
                for i in range(cfg.n_layers)
            }
        )
        self.add_module(n.norm, RMSNorm(cfg.dim, cfg.norm_eps))
        self.add_module(n.head, nn.Linear(cfg.dim, cfg.vocab_size, bias=False))
        if tied:
            getattr(self, n.head).weight = getattr(self, n.embedding).weight

    def layer_names(self, layer: int) -> DecoderNames:
        """Layer `layer`'s module names: the family's `names` (DeepSeek-V3 names its dense layers' MLP apart
        from its MoE blocks, so that a tp plan's pattern tells them apart)."""
        return self.names

    def build_attention(self, cfg: Any, layer: int) -> nn.Module:
        """Layer `layer`'s attention block: (x, rope, positions) -> x."""
        raise NotImplementedError(f"{type(self).__name__} names no attention block (build_attention)")

    def build_mlp(self, cfg: Any, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block: x -> x (an MLP, or a mixture of experts)."""
        raise NotImplementedError(f"{type(self).__name__} names no feed-forward block (build_mlp)")

    def forward(
        self, inputs: Tensor, positions: Tensor | None = None, targets: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """tokens (B, S) -> logits (B, S, V): the local vocab shard (and sequence shard) when parallel.

        Floating-point inputs are the previous pipeline stage's hidden states (B, S, dim) and are not embedded
        (a tied model's last stage keeps the embedding only to own the head's weight). Without the final norm
        and head the output is hidden states. `positions` (S,) are the tokens' global positions (default
        0..S-1); a context-parallel rank passes those of the chunks it holds, and packed documents (B, S)
        positions that restart at each document. With `targets` (B, S) the head computes the loss itself and
        (loss sum over valid targets, their count) is returned instead of logits: that needs the fused head
        that `tessera.parallel.loss.apply_loss_head` installs (parallelize does, with --loss chunked), which
        never materializes the full logits."""
        n = self.names
        embedding, norm, head = getattr(self, n.embedding), getattr(self, n.norm), getattr(self, n.head)
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        if inputs.is_floating_point():
            h = inputs
        elif embedding is None:
            raise ValueError(
                f"token ids given to a model part without {n.embedding} (a pipeline stage after the first): "
                f"pass it the previous stage's hidden states"
            )
        else:
            h = embedding(inputs)
        for layer in self.layers.values():
            h = layer(h, self.rope, positions)
        if norm is not None:
            h = norm(h)
        if targets is None:
            return head(h) if head is not None else h
        if head is None:
            raise ValueError(
                "targets given to a model part without the output head (a pipeline stage before the "
                "last): pass targets to the last stage only"
            )
        if not getattr(head, "takes_targets", False):
            raise TypeError(
                f"{type(self).__name__}.forward(targets=...) needs the fused loss head, and `{n.head}` is a "
                f"{type(head).__name__}: install it with tessera.parallel.loss.apply_loss_head(model) "
                f"(parallelize does, with loss=chunked), or call model(inputs) and a loss on the logits"
            )
        return head(h, targets)


# ----------------------------------------------------------------------------- what a family's spec derives
def decoder_tp_plan(names: DecoderNames, attention: TPPlan, mlp: TPPlan) -> TPPlan:
    """The model's tensor-parallel plan from its blocks' own plans: the embedding split over the vocabulary,
    the norms replicated, the head's logits left split over the vocabulary (tessera.parallel.loss reads them
    so)."""
    n = names
    return (
        (n.embedding, "embedding"),
        *prefixed(f"layers.*.{n.attention}", attention),
        *prefixed(f"layers.*.{n.mlp}", mlp),
        (f"layers.*.{n.pre_attention_norm}", "norm"),
        (f"layers.*.{n.pre_mlp_norm}", "norm"),
        (n.norm, "norm"),
        (n.head, "colwise_gather"),
    )


@dataclass(frozen=True)
class DepthScaledInit:
    """A spec's init_std: norms ONES (their modules' names end in "norm"); the output projections (the modules,
    or stacked parameters, named in `out_projections`) cfg.init_std / sqrt(2 * n_layers), as they add to the
    residual stream once per layer; every other parameter cfg.init_std. A class, not a closure: specs travel to
    the ranks by pickle."""

    out_projections: tuple[str, ...]

    def __call__(self, name: str, cfg: Any) -> Init:
        if name.endswith("norm.weight"):
            return ONES
        scaled = name.removesuffix(".weight").rpartition(".")[2] in self.out_projections
        return cfg.init_std * (1.0 / math.sqrt(2 * cfg.n_layers) if scaled else 1.0)


def decoder_shape(cfg: DecoderSizes, **fields: Any) -> ModelShape:
    """The sizes the planner counts with: the config's, and the family's own fields (family, qk_norm, experts)."""
    return ModelShape(
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        ffn_dim=cfg.ffn_dim,
        max_seq_len=cfg.max_seq_len,
        **fields,
    )


def decoder_spec(
    name: str,
    config_type: type,
    build: type[DecoderLM],
    tp_plan: TPPlan,
    init_std: Callable[[str, Any], Init],
    shape: Callable[[Any], ModelShape],
    presets: Mapping[str, Any],
    hf: HFAdapter | None = None,
    moe: bool = False,
) -> ModelSpec:
    """A decoder family's spec: the seams parallel/ reads follow from its model's module names. The
    pipeline cuts between layers, the embedding on the first stage, the final norm and head on the last;
    context parallel fills each attention block's `core`; with `moe`, every layer's feed-forward block is a
    models/moe.py MoE (expert parallel)."""
    n = build.names
    return ModelSpec(
        name=name,
        config_type=config_type,
        build=build,
        init_std=init_std,
        shape=shape,
        tp_plan=tp_plan,
        blocks="layers.*",
        pipeline=PipelineSplit(first=(n.embedding,), blocks="layers", last=(n.norm, n.head)),
        attention=f"layers.*.{n.attention}.core",
        head=n.head,
        moe=f"layers.*.{n.mlp}" if moe else None,
        presets=presets,
        hf=hf,
        matrices=matrix_patterns(tp_plan),
    )
