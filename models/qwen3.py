"""Qwen3 (dense): Llama's decoder with QK-norm, its own head_dim and (on the small models) a head tied to the
token embedding, in one file with its spec.

The family is the shared decoder (models/decoder.py) with GroupedQueryAttention (models/attention.py) with
QK-norm and a SwiGLU MLP (models/mlp.py) in every block, under Hugging Face's own module names (embed_tokens,
layers.N.self_attn.q_proj, ..., norm, lm_head), so a Hugging Face checkpoint maps over with "model." added or
removed (lm_head stays). Qwen3-MoE (models/qwen3_moe.py) is this model with a mixture of experts in the MLP's
place, so its config, presets and Hugging Face reading and writing build on the pieces here. A pipeline stage
is this model with modules set to None (`embed_tokens` on later stages, unless tied: then the last stage keeps
it to own the head's weight and it embeds only integer inputs; `norm`/`lm_head` before the last stage).

QK-norm follows transformers' modeling_qwen3.py: q and k are projected, viewed as heads, RMS-normalized
over head_dim (one weight of head_dim shared by every head, eps = rms_norm_eps), and only then rotated.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from tessera.topology.shapes import ModelShape

from .attention import AttentionNames, GroupedQueryAttention, attention_tp_plan, check_heads
from .spec import BYTE_VOCAB
from .decoder import DecoderLM, DecoderNames, DecoderSizes, DepthScaledInit, decoder_shape, decoder_spec
from .decoder import decoder_tp_plan
from .hf_adapter import NamesUnderModel, check_architecture, decoder_entries, off, plain_rope_only, refuse
from .hf_adapter import require, rope_theta, silu_only
from .layers import Rotary
from .mlp import MLPNames, SwiGLU, swiglu_tp_plan
from .spec import HFAdapter, register


@dataclass(frozen=True)
class Qwen3Sizes:
    """The fields every Qwen3 config opens with, Qwen3-MoE's too: the attention's sizes and the vocabulary."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # its own field: n_heads * head_dim need not be dim (Qwen3-0.6B: 16 x 128 vs 1024)
    vocab_size: int

    def __post_init__(self) -> None:
        check_heads(self.n_heads, self.n_kv_heads, self.head_dim)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Qwen3Config(Qwen3Sizes):
    family = "qwen3"  # the registered spec (models/spec.py); a class attribute, not a field
    ffn_dim: int
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    init_std: float = 0.02
    tie_word_embeddings: bool = False

    def num_params(self) -> int:
        """Exact parameter count (unpadded vocab; a tied head counted once)."""
        return model_shape(self).num_params()


# the debug presets' attention and vocabulary (Qwen3-MoE's debug presets have them too)
DEBUG_SIZES: dict[str, Any] = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=BYTE_VOCAB, max_seq_len=2048
)

# what the published models share (Qwen3-MoE's too): 128-wide heads, Qwen's vocabulary
PUBLISHED_SIZES: dict[str, Any] = dict(head_dim=128, vocab_size=151936)

PRESETS: dict[str, Qwen3Config] = {
    # runs on a laptop CPU in seconds; n_heads x head_dim (128) != dim (64) exercises the separate head_dim
    "qwen3-debug": Qwen3Config(**DEBUG_SIZES, ffn_dim=192, tie_word_embeddings=True),
    # the published Qwen3 shapes (config.json of Qwen/Qwen3-0.6B, -1.7B, -8B)
    "qwen3-0.6b": Qwen3Config(
        **PUBLISHED_SIZES, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_word_embeddings=True
    ),
    "qwen3-1.7b": Qwen3Config(
        **PUBLISHED_SIZES, dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_word_embeddings=True
    ),
    "qwen3-8b": Qwen3Config(
        **PUBLISHED_SIZES, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, tie_word_embeddings=False
    ),
}


class Qwen3Fields(DecoderSizes, Protocol):
    """What Qwen3's modules read of a config: Qwen3Config's fields, which Qwen3-MoE's config has too (its
    ffn_dim: each expert's width)."""

    @property
    def rope_theta(self) -> float: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


class Qwen3(DecoderLM):
    """The one-process Qwen3 causal LM (Hugging Face's Qwen3ForCausalLM, without the "model." level): GQA
    attention with QK-norm and a SwiGLU MLP in every block, plain RoPE, the head tied to the embedding or not."""

    names = DecoderNames()  # Hugging Face's
    embed_tokens: nn.Module | None  # None on a pipeline stage after the first (unless tied: see the docstring)
    norm: nn.Module | None  # these two: None on a stage before the last
    lm_head: nn.Module | None

    def __init__(self, cfg: Qwen3Fields):
        rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        super().__init__(cfg, rope, tied=cfg.tie_word_embeddings)

    def build_attention(self, cfg: Qwen3Fields, layer: int) -> nn.Module:
        return GroupedQueryAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, qk_norm_eps=cfg.norm_eps)

    def build_mlp(self, cfg: Qwen3Fields, layer: int) -> nn.Module:
        """A SwiGLU MLP (a family built on Qwen3 puts another block here: Qwen3-MoE its experts)."""
        return SwiGLU(cfg.dim, cfg.ffn_dim)


# Norms ONES (q_norm and k_norm included); the output projections (o_proj, down_proj: a dense MLP's, an MoE
# block's experts' and shared expert's) scaled by 1/sqrt(2 * n_layers)
param_init_std = DepthScaledInit((AttentionNames().o, MLPNames().down))


def model_shape(cfg: Qwen3Config) -> ModelShape:
    return decoder_shape(cfg, qk_norm=True, tied_embeddings=cfg.tie_word_embeddings, family="qwen3")


# ----------------------------------------------------------------------------- Hugging Face names and config
# Qwen3's parameter names (Qwen3-MoE's attention and norms have them too); Hugging Face's under "model."
HF_ATTENTION_AND_NORMS = (
    r"input_layernorm|post_attention_layernorm|self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)"
)
_OURS = re.compile(
    r"(embed_tokens|norm|lm_head)\.weight"
    rf"|layers\.\d+\.({HF_ATTENTION_AND_NORMS}|mlp\.(gate_proj|up_proj|down_proj))\.weight"
)
_NAMES = NamesUnderModel(_OURS, "Qwen3")
tessera_to_hf_name, hf_to_tessera_name = _NAMES.to_hf, _NAMES.from_hf


def read_hf_sizes(c: dict, path: str, kv_heads: int, head_dim: int | None) -> dict[str, Any]:
    """The fields of a Qwen3 config (Qwen3-MoE's too) that config.json's attention, norms, vocabulary and RoPE
    give, refusing attention biases, sliding windows and scaled RoPE by field name. `kv_heads` and `head_dim`:
    what transformers' config class defaults them to (head_dim None: hidden_size // num_attention_heads)."""
    refuse(
        path,
        (
            off(c, "attention_bias", "biases in attention"),
            off(c, "use_sliding_window", "sliding-window attention"),
            plain_rope_only(c),
        ),
    )
    require(c, path, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"))
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", kv_heads)
    return dict(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv if kv is not None else heads,
        head_dim=c.get("head_dim") or head_dim or c["hidden_size"] // heads,
        vocab_size=c["vocab_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta(c),
        max_seq_len=int(c.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def hf_config_entries(cfg: Any, architecture: str, model_type: str, dtype: str) -> dict[str, Any]:
    """The config.json entries of Qwen3's attention, norms, vocabulary and RoPE (Qwen3-MoE's too)."""
    return {
        **decoder_entries(cfg, architecture, model_type, dtype, tied=cfg.tie_word_embeddings),
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": cfg.init_std,
        # transformers 4.x reads rope_theta, 5.x rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
    }


def read_hf_config(c: dict, path: str) -> Qwen3Config:
    """Qwen3Config from a Hugging Face config.json's contents; ValueError naming the file and the field for
    what this file cannot represent (biases, sliding-window attention, another activation, RoPE scaling)."""
    check_architecture(c, path, "qwen3", "qwen3", "Qwen3ForCausalLM")
    layer_types = c.get("layer_types") or []
    refuse(
        path,
        (
            off(c, "mlp_bias", "biases in the MLP"),
            (
                "layer_types",
                all(t == "full_attention" for t in layer_types),
                f"layer types {sorted(set(layer_types) - {'full_attention'})} (only full_attention)",
            ),
            silu_only(c, "tessera's MLP is SwiGLU"),
        ),
    )
    # transformers' Qwen3Config defaults: 32 kv heads, head_dim 128
    sizes = read_hf_sizes(c, path, kv_heads=32, head_dim=128)
    require(c, path, ("intermediate_size",))
    return Qwen3Config(**sizes, ffn_dim=c["intermediate_size"])


def hf_config_dict(cfg: Qwen3Config, dtype: str = "float32") -> dict[str, Any]:
    return {
        **hf_config_entries(cfg, "Qwen3ForCausalLM", "qwen3", dtype),
        "intermediate_size": cfg.ffn_dim,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
    }


TP_PLAN = decoder_tp_plan(Qwen3.names, attention_tp_plan(qk_norm=True), swiglu_tp_plan())
HF = HFAdapter("qwen3", "Qwen3ForCausalLM", read_hf_config, hf_config_dict, tessera_to_hf_name, hf_to_tessera_name)
QWEN3 = register(decoder_spec("qwen3", Qwen3Config, Qwen3, TP_PLAN, param_init_std, model_shape, PRESETS, HF))


def build_model(cfg: Qwen3Config | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Qwen3:
    """Build the one-process model on `device` and initialize it from `seed` (on "meta" nothing is allocated)."""
    return cast(Qwen3, QWEN3.build_model(QWEN3.config(cfg) if isinstance(cfg, str) else cfg, device, seed))
