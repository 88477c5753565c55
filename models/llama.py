"""Llama: RMSNorm, RoPE (Llama 3.1's scaling), grouped-query attention, SwiGLU MLP, untied output head, in one
file with its spec.

The family is the shared decoder (models/decoder.py) with models/attention.py's GroupedQueryAttention and
models/mlp.py's SwiGLU in every block, under Meta's module names (tok_embeddings, layers.N.attention.wq, ...,
layers.N.feed_forward.w1, ..., norm, output): what is Llama's own here is those names, its config and presets,
its Hugging Face name mapping and config.json, and its spec. The model knows nothing of parallelism:
`tessera.parallel.parallelize` swaps its linear layers and norms following the spec's tp plan, sets the
`input_comm` slots and (context parallel) the attention `core`. A pipeline stage is this model with parts set to
None (`tok_embeddings` after the first stage, `norm`/`output` before the last), keeping the one-process names.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from torch import nn

from tessera.topology.shapes import ModelShape

from .attention import AttentionNames, GroupedQueryAttention, attention_tp_plan, check_heads
from .spec import BYTE_VOCAB  # noqa: F401  (the debug presets' vocabulary; imported from here too)
from .decoder import DecoderLM, DecoderNames, DepthScaledInit, decoder_shape, decoder_spec, decoder_tp_plan
from .hf_adapter import check_architecture, decoder_entries, off, refuse, rope_theta, scaled_rope, silu_only
from .layers import Rotary
from .mlp import MLPNames, SwiGLU, swiglu_tp_plan
from .spec import HFAdapter, get_preset, register


@dataclass(frozen=True)
class LlamaConfig:
    family = "llama"  # the registered spec (models/spec.py); a class attribute, not a field
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    init_std: float = 0.02
    # Llama 3.1's "llama3" RoPE scaling: (("factor", f), ("high_freq_factor", h), ("low_freq_factor", l),
    # ("original_max_position_embeddings", n)); None for plain RoPE. A dict is accepted and stored sorted.
    rope_scaling: tuple | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted((k, float(v)) for k, v in self.rope_scaling.items())))
        if self.rope_scaling is not None:
            keys = {k for k, _ in self.rope_scaling}
            need = {"factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings"}
            if keys != need:
                raise ValueError(f"rope_scaling needs exactly {sorted(need)}, got {sorted(keys)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        check_heads(self.n_heads, self.n_kv_heads, self.head_dim)

    def num_params(self) -> int:
        """Exact parameter count (unpadded vocab)."""
        return model_shape(self).num_params()

    def as_dict(self) -> dict:
        out = asdict(self)
        if self.rope_scaling is None:  # plain RoPE: the dict checkpoints have always held
            del out["rope_scaling"]
        else:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out


PRESETS: dict[str, LlamaConfig] = {
    # runs on a laptop CPU in seconds; heads/kv/ffn divide tp in {1, 2, 4}, vocab 258 exercises padding
    "debug": LlamaConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTE_VOCAB, ffn_dim=192, max_seq_len=2048
    ),
    "small": LlamaConfig(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=BYTE_VOCAB, ffn_dim=768, max_seq_len=4096
    ),
    "1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192),
    # the published Llama 3 / 3.1 shapes
    "8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336),
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672),
    "405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248),
}


# Meta's module names (Llama's checkpoints' parameter names)
NAMES = DecoderNames(
    embedding="tok_embeddings",
    norm="norm",
    head="output",
    pre_attention_norm="attention_norm",
    attention="attention",
    pre_mlp_norm="ffn_norm",
    mlp="feed_forward",
)
ATTENTION = AttentionNames(q="wq", k="wk", v="wv", o="wo")
MLP = MLPNames(gate="w1", up="w3", down="w2")


class Llama(DecoderLM):
    """The one-process Llama: GQA attention and a SwiGLU MLP in every block, RoPE with Llama 3.1's scaling."""

    names = NAMES
    tok_embeddings: nn.Module | None  # None on a pipeline stage after the first
    norm: nn.Module | None  # these two: None on a stage before the last
    output: nn.Module | None

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling))

    def build_attention(self, cfg: LlamaConfig, layer: int) -> nn.Module:
        return GroupedQueryAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ATTENTION)

    def build_mlp(self, cfg: LlamaConfig, layer: int) -> nn.Module:
        return SwiGLU(cfg.dim, cfg.ffn_dim, MLP)


# Norms ONES; the output projections (wo, w2) scaled by 1/sqrt(2 * n_layers)
param_init_std = DepthScaledInit((ATTENTION.o, MLP.down))


def model_shape(cfg: LlamaConfig) -> ModelShape:
    return decoder_shape(cfg, family="llama")


# ----------------------------------------------------------------------------- Hugging Face names and config
_LAYER = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_tessera_name(name: str) -> str | None:
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    raise ValueError(f"unexpected parameter {name!r} in the Hugging Face checkpoint (not a Llama weight tessera knows)")


def tessera_to_hf_name(name: str) -> str:
    for hf, ours in _TOP.items():
        if name == ours:
            return hf
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    inverse = {v: k for k, v in _LAYER.items()}
    if m and m.group(2) in inverse:
        return f"model.layers.{m.group(1)}.{inverse[m.group(2)]}.weight"
    raise ValueError(f"parameter {name!r} has no Hugging Face Llama name")


def read_hf_config(c: dict, path: str) -> LlamaConfig:
    """LlamaConfig from a Hugging Face config.json's contents; ValueError naming the file and the field for
    what tessera's Llama cannot represent."""
    check_architecture(c, path, "llama", "llama", "LlamaForCausalLM")
    field, rope, rope_kind = scaled_rope(c) or ("rope_scaling", {}, "default")
    refuse(
        path,
        (
            off(c, "tie_word_embeddings", "tied embeddings (tessera's head is untied)"),
            silu_only(c, "tessera's MLP is SwiGLU"),
            off(c, "attention_bias", "biases in attention"),
            off(c, "mlp_bias", "biases in the MLP"),
            (
                field,
                rope_kind in ("default", "llama3"),
                f"rope type {rope_kind!r} (default and llama3 are implemented)",
            ),
        ),
    )
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise ValueError(
            f"{path}: head_dim {c['head_dim']} differs from hidden_size / num_attention_heads "
            f"({c['hidden_size']} / {heads}); not supported"
        )
    scaling_keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return LlamaConfig(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads,
        vocab_size=c["vocab_size"],
        ffn_dim=c["intermediate_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta(c),
        max_seq_len=int(c.get("max_position_embeddings", 8192)),
        rope_scaling=None if rope_kind == "default" else tuple(sorted((k, float(rope[k])) for k in scaling_keys)),
    )


def hf_config_dict(cfg: LlamaConfig, dtype: str = "float32") -> dict[str, Any]:
    return {
        **decoder_entries(cfg, "LlamaForCausalLM", "llama", dtype),
        "intermediate_size": cfg.ffn_dim,
        "mlp_bias": False,
        # transformers 4.x reads rope_theta and rope_scaling, 5.x rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {
            "rope_theta": cfg.rope_theta,
            "rope_type": "llama3" if cfg.rope_scaling else "default",
            **dict(cfg.rope_scaling or ()),
        },
        "rope_scaling": {"rope_type": "llama3", **dict(cfg.rope_scaling)} if cfg.rope_scaling else None,
    }


TP_PLAN = decoder_tp_plan(NAMES, attention_tp_plan(ATTENTION), swiglu_tp_plan(MLP))
HF = HFAdapter("llama", "LlamaForCausalLM", read_hf_config, hf_config_dict, tessera_to_hf_name, hf_to_tessera_name)
LLAMA = register(decoder_spec("llama", LlamaConfig, Llama, TP_PLAN, param_init_std, model_shape, PRESETS, HF))


def build_model(cfg: LlamaConfig | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Llama:
    """Build the one-process model on `device` and initialize it from `seed`; on "meta" nothing is
    allocated (parallelize it, `to_empty` on the real device, then `init_weights`)."""
    return cast(Llama, LLAMA.build_model(get_preset(cfg) if isinstance(cfg, str) else cfg, device, seed))


# the names before the families were named one way (2026-12): Llama's config and model, as users' code imports them
ModelConfig = LlamaConfig
Transformer = Llama
