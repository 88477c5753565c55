"""Qwen3 (dense): a Llama-style decoder with QK-norm, its own head_dim and (on the small models) a head
tied to the token embedding, in one file with its spec.

Module names are Hugging Face's own (embed_tokens, layers.N.self_attn.q_proj, ..., norm, lm_head), so a
Hugging Face checkpoint maps over with "model." added or removed (lm_head stays). As in models/llama.py
the model knows nothing of parallelism: `tessera.parallel.parallelize` swaps the linear layers and norms
for parallel ones following the spec's tp plan, sets the `input_comm` slots and (context parallel) the
attention `core`; head counts come from the tensors' shapes. A pipeline stage is this model with modules
set to None (`embed_tokens` on later stages, unless tied: then the last stage keeps it to own the head's
weight and it embeds only integer inputs; `norm`/`lm_head` before the last stage).

QK-norm follows transformers' modeling_qwen3.py: q and k are projected, viewed as heads, RMS-normalized
over head_dim (one weight of head_dim shared by every head, eps = rms_norm_eps), and only then rotated.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.topology.shapes import ModelShape

from .init import ONES
from .layers import CausalAttention, RMSNorm, Rotary
from .llama import BYTE_VOCAB  # the byte tokenizer's vocabulary, shared by the debug presets
from .spec import HFAdapter, ModelSpec, PipelineSplit, register


@dataclass(frozen=True)
class Qwen3Config:
    family = "qwen3"  # the registered spec (models/spec.py); a class attribute, not a field
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # its own field: n_heads * head_dim need not be dim (Qwen3-0.6B: 16 x 128 vs 1024)
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    init_std: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def num_params(self) -> int:
        """Exact parameter count (unpadded vocab; a tied head counted once)."""
        return model_shape(self).num_params()

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, Qwen3Config] = {
    # runs on a laptop CPU in seconds; n_heads x head_dim (128) != dim (64) exercises the separate head_dim
    "qwen3-debug": Qwen3Config(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=BYTE_VOCAB,
        ffn_dim=192,
        max_seq_len=2048,
        tie_word_embeddings=True,
    ),
    # the published Qwen3 shapes (config.json of Qwen/Qwen3-0.6B, -1.7B, -8B)
    "qwen3-0.6b": Qwen3Config(
        dim=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        ffn_dim=3072,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": Qwen3Config(
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        ffn_dim=6144,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": Qwen3Config(
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        ffn_dim=12288,
        tie_word_embeddings=False,
    ),
}


class Qwen3Fields(Protocol):
    """What Qwen3's modules read of a config: Qwen3Config's fields, which Qwen3-MoE's config has too (its
    ffn_dim: each expert's width)."""

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
    def rope_theta(self) -> float: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Fields):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.q_norm = RMSNorm(hd, cfg.norm_eps)  # over head_dim, each head
        self.k_norm = RMSNorm(hd, cfg.norm_eps)
        # identity on one process; copy-to-tp or sequence all-gather once the block is tensor parallel
        self.input_comm: nn.Module = nn.Identity()
        self.core: nn.Module = CausalAttention()

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        x = self.input_comm(x)
        B, S, _ = x.shape
        # heads from the shapes: a tensor-parallel rank holds n_heads / tp of them; QK-norm before RoPE
        q = self.q_norm(self.q_proj(x).view(B, S, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, S, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions), rope(k, positions)
        o = self.core(q, k, v, positions)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Fields):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.input_comm: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.input_comm(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    """Attention and an MLP, each behind a norm, with residuals; `mlp`: another feed-forward block in the MLP's
    place (Qwen3-MoE's mixture of experts)."""

    def __init__(self, cfg: Qwen3Fields, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = mlp if mlp is not None else Qwen3MLP(cfg)

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3(nn.Module):
    """The one-process Qwen3 causal LM (Hugging Face's Qwen3ForCausalLM, without the "model." level)."""

    def __init__(self, cfg: Qwen3Fields):
        super().__init__()
        self.config = cfg
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleDict({str(i): self.decoder_layer(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # one nn.Parameter; named_parameters() names it embed_tokens.weight
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def decoder_layer(cfg: Qwen3Fields) -> nn.Module:
        """One block (a family built on Qwen3 gives its own: Qwen3-MoE's has experts for its MLP)."""
        return Qwen3DecoderLayer(cfg)

    def forward(
        self, inputs: Tensor, positions: Tensor | None = None, targets: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """tokens (B, S) -> logits (B, S, V): the local vocab shard (and sequence shard) when parallel.

        Floating-point inputs are the previous pipeline stage's hidden states (B, S, dim) and are not
        embedded (a tied model's last stage keeps `embed_tokens` only to own the head's weight). Without
        `norm`/`lm_head` the output is hidden states. `positions` (S,) are the tokens' global positions
        (default 0..S-1). With `targets` (B, S) the fused loss head installed as `lm_head`
        (`tessera.parallel.loss.apply_loss_head`) returns (loss sum over valid targets, their count)."""
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        if inputs.is_floating_point():
            h = inputs
        elif self.embed_tokens is None:
            raise ValueError(
                "token ids given to a model part without embed_tokens (a pipeline stage after the first): "
                "pass it the previous stage's hidden states"
            )
        else:
            h = self.embed_tokens(inputs)
        for layer in self.layers.values():
            h = layer(h, self.rope, positions)
        if self.norm is not None:
            h = self.norm(h)
        if targets is None:
            return self.lm_head(h) if self.lm_head is not None else h
        if self.lm_head is None:
            raise ValueError(
                "targets given to a model part without the output head (a pipeline stage before the "
                "last): pass targets to the last stage only"
            )
        if not getattr(self.lm_head, "takes_targets", False):
            raise TypeError(
                f"{type(self).__name__}.forward(targets=...) needs the fused loss head, and `lm_head` is a "
                f"{type(self.lm_head).__name__}: install it with tessera.parallel.loss.apply_loss_head(model) "
                f"(parallelize does, with loss=chunked), or call model(inputs) and a loss on the logits"
            )
        return self.lm_head(h, targets)


def param_init_std(name: str, cfg: Qwen3Config) -> float | str:
    """The truncated-normal std of a parameter (ONES: every norm, q_norm and k_norm included). The output
    projections (o_proj, down_proj) are scaled by 1/sqrt(2 * n_layers)."""
    if name.endswith("norm.weight"):
        return ONES
    scaled = name.endswith(("o_proj.weight", "down_proj.weight"))
    return cfg.init_std * (1.0 / math.sqrt(2 * cfg.n_layers) if scaled else 1.0)


def model_shape(cfg: Qwen3Config) -> ModelShape:
    return ModelShape(
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        ffn_dim=cfg.ffn_dim,
        qk_norm=True,
        tied_embeddings=cfg.tie_word_embeddings,
        family="qwen3",
        max_seq_len=cfg.max_seq_len,
    )


# ----------------------------------------------------------------------------- Hugging Face names and config
_OURS = re.compile(
    r"(embed_tokens|norm|lm_head)\.weight"
    r"|layers\.\d+\.(input_layernorm|post_attention_layernorm"
    r"|self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)|mlp\.(gate_proj|up_proj|down_proj))\.weight"
)


def tessera_to_hf_name(name: str) -> str:
    """embed_tokens.weight -> model.embed_tokens.weight, ...; lm_head.weight stays."""
    if not _OURS.fullmatch(name):
        raise ValueError(f"parameter {name!r} has no Hugging Face Qwen3 name")
    return name if name == "lm_head.weight" else f"model.{name}"


def hf_to_tessera_name(name: str) -> str | None:
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight":
        return name
    ours = name[len("model.") :]
    if not name.startswith("model.") or ours == "lm_head.weight" or not _OURS.fullmatch(ours):
        raise ValueError(
            f"unexpected parameter {name!r} in the Hugging Face checkpoint (not a Qwen3 weight tessera knows)"
        )
    return ours


def read_hf_config(c: dict, path: str) -> Qwen3Config:
    """Qwen3Config from a Hugging Face config.json's contents; ValueError naming the file and the field for
    what this file cannot represent (biases, sliding-window attention, another activation, RoPE scaling)."""
    arch = (c.get("architectures") or ["Qwen3ForCausalLM"])[0]
    if c.get("model_type") != "qwen3" or arch != "Qwen3ForCausalLM":
        raise ValueError(
            f"{path}: architecture {arch!r} (model_type {c.get('model_type')!r}) is not supported; "
            f"tessera's qwen3 family loads Qwen3ForCausalLM checkpoints"
        )
    layer_types = c.get("layer_types") or []
    ropes = [(f, r) for f in ("rope_parameters", "rope_scaling") if isinstance(r := c.get(f), dict)]
    rope_kinds = [(f, r.get("rope_type", r.get("type", "default"))) for f, r in ropes]
    scaled = next(((f, k) for f, k in rope_kinds if k != "default"), None)
    for field, ok, why in (
        ("attention_bias", not c.get("attention_bias", False), "biases in attention"),
        ("mlp_bias", not c.get("mlp_bias", False), "biases in the MLP"),
        ("use_sliding_window", not c.get("use_sliding_window", False), "sliding-window attention"),
        (
            "layer_types",
            all(t == "full_attention" for t in layer_types),
            f"layer types {sorted(set(layer_types) - {'full_attention'})} (only full_attention)",
        ),
        (
            "hidden_act",
            c.get("hidden_act", "silu") == "silu",
            f"activation {c.get('hidden_act')!r} (tessera's MLP is SwiGLU)",
        ),
        (
            scaled[0] if scaled else "rope_scaling",
            scaled is None,
            f"rope type {scaled[1] if scaled else ''!r} (plain RoPE only)",
        ),
    ):
        if not ok:
            raise ValueError(f"{path}: {field}: {why} is not supported")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if key not in c:
            raise ValueError(f"{path}: {key} is missing")
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads", 32)  # transformers' Qwen3Config defaults: 32 kv heads, head_dim 128
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    return Qwen3Config(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv if kv is not None else heads,
        head_dim=c.get("head_dim") or 128,
        vocab_size=c["vocab_size"],
        ffn_dim=c["intermediate_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_seq_len=int(c.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def hf_config_dict(cfg: Qwen3Config, dtype: str = "float32") -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "intermediate_size": cfg.ffn_dim,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
        # transformers 4.x reads rope_theta, 5.x rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
    }


QWEN3 = register(
    ModelSpec(
        name="qwen3",
        config_type=Qwen3Config,
        build=Qwen3,
        init_std=param_init_std,
        shape=model_shape,
        tp_plan=(
            ("embed_tokens", "embedding"),
            ("layers.*.self_attn", "block_input"),
            ("layers.*.self_attn.q_proj", "colwise"),
            ("layers.*.self_attn.k_proj", "kv"),
            ("layers.*.self_attn.v_proj", "kv"),
            ("layers.*.self_attn.o_proj", "rowwise"),
            ("layers.*.self_attn.q_norm", "head_norm"),
            ("layers.*.self_attn.k_norm", "head_norm"),
            ("layers.*.mlp", "block_input"),
            ("layers.*.mlp.gate_proj", "colwise"),
            ("layers.*.mlp.up_proj", "colwise"),
            ("layers.*.mlp.down_proj", "rowwise"),
            ("layers.*.input_layernorm", "norm"),
            ("layers.*.post_attention_layernorm", "norm"),
            ("norm", "norm"),
            # the logits stay split over the vocabulary: tessera.parallel.loss reads them so
            ("lm_head", "colwise_gather"),
        ),
        blocks="layers.*",
        pipeline=PipelineSplit(first=("embed_tokens",), blocks="layers", last=("norm", "lm_head")),
        attention="layers.*.self_attn.core",
        head="lm_head",
        presets=PRESETS,
        hf=HFAdapter(
            model_type="qwen3",
            architecture="Qwen3ForCausalLM",
            read_config=read_hf_config,
            config_dict=hf_config_dict,
            to_hf=tessera_to_hf_name,
            from_hf=hf_to_tessera_name,
        ),
    )
)


def build_model(cfg: Qwen3Config | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Qwen3:
    """Build the one-process model on `device` and initialize it from `seed` (on "meta" nothing is allocated)."""
    model = QWEN3.build_model(QWEN3.config(cfg) if isinstance(cfg, str) else cfg, device, seed)
    if not isinstance(model, Qwen3):
        raise TypeError(f"the qwen3 spec built a {type(model).__name__}, not a Qwen3")
    return model
