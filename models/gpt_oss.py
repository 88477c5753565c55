"""gpt-oss (OpenAI's open-weight MoE models), in one file with its spec, composed from the shared blocks as
transformers' modeling_gpt_oss.py defines the model:

- attention (models/attention.py's GroupedQueryAttention): grouped-query attention with biases on q, k, v and
  o, attention sinks (a learned logit per query head, `sinks`) and layers that alternate between a sliding
  window (`sliding_window` tokens, `layer_types`) and full causal attention;
- a mixture of experts in every layer (models/moe.py's MoE): a router with a bias (top-k of its logits, a
  softmax over the chosen k: the same weights as a softmax over all experts renormalized over the k), experts
  with biases in transformers' own layout (gate_up_proj (E, dim, 2 ffn) with gate and up interleaved,
  down_proj (E, ffn, dim)) and the clamped SwiGLU (models/mlp.py's clamped_swiglu);
- YaRN RoPE (models/layers.py's ROPE_SCALINGS["yarn"], with its attention factor; gpt-oss does not truncate
  the ramp), RMSNorm, an untied head.

Module names are Hugging Face's (without the "model." level) but for the router, which the MoE block calls
`gate` (layers.N.mlp.gate <-> model.layers.N.mlp.router); the experts' tensors are transformers' own, so a
checkpoint maps over by name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, cast

import torch
from torch import nn

from tessera.topology.shapes import ModelShape

from .attention import AttentionNames, GroupedQueryAttention, attention_tp_plan, check_heads
from .spec import BYTE_VOCAB
from .decoder import DecoderLM, DecoderNames, DepthScaledInit, decoder_shape, decoder_spec, decoder_tp_plan
from .hf_adapter import NamesUnderModel, check_architecture, decoder_entries, refuse, require
from .hf_adapter import scaled_rope
from .init import ZEROS, Init
from .layers import Rotary
from .mlp import MLPNames
from .moe import MoE, moe_tp_plan
from .spec import HFAdapter, matrix_patterns, register

LAYER_TYPES = ("sliding_attention", "full_attention")
# the YaRN parameters tessera reads (config.json's rope_parameters / rope_scaling, transformers' names)
YARN_FIELDS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)


def alternating_layers(n_layers: int) -> tuple[str, ...]:
    """transformers' default layer_types: sliding on even layers, full on odd ones."""
    return tuple(LAYER_TYPES[i % 2] for i in range(n_layers))


# the published models' RoPE: YaRN, factor 32 over an original context of 4096 (131072 positions), no truncation
PUBLISHED_YARN = (
    ("factor", 32.0),
    ("original_max_position_embeddings", 4096),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("truncate", False),
)


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    family = "gpt_oss"  # the registered spec; a class attribute, not a field
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    moe_ffn_dim: int  # each expert's SwiGLU width (intermediate_size)
    n_experts: int
    top_k: int
    sliding_window: int = 128  # the tokens a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] | None = None  # per layer, LAYER_TYPES; None: alternating_layers
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    aux_loss_coef: float = 0.001  # the sequence-level auxiliary loss's weight (0: off)
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = PUBLISHED_YARN  # YaRN's (name, value) pairs; None: plain
    max_seq_len: int = 131072
    init_std: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        check_heads(self.n_heads, self.n_kv_heads, self.head_dim)
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(
                f"sliding_window={self.sliding_window!r} must be a whole number of tokens, at least 1 (a sliding "
                f"layer's query sees itself and sliding_window - 1 tokens before it; gpt-oss has 128)"
            )
        types = self.attention_types
        if len(types) != self.n_layers:
            raise ValueError(
                f"layer_types has {len(types)} entries for n_layers={self.n_layers}: give one per layer (or None "
                f"for sliding and full layers alternating)"
            )
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer_types: {unknown[0]!r} is not a layer type; use {' or '.join(LAYER_TYPES)}")
        if self.layer_types is not None:  # a manifest's JSON gives a list: held as a tuple (hashable)
            object.__setattr__(self, "layer_types", types)
        if self.rope_scaling is not None:
            scaling = tuple((str(k), v) for k, v in self.rope_scaling)
            unread = [k for k, _ in scaling if k not in YARN_FIELDS]
            if unread:
                raise ValueError(f"rope_scaling: {unread[0]!r} is not a YaRN parameter; use {', '.join(YARN_FIELDS)}")
            object.__setattr__(self, "rope_scaling", scaling)

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Each layer's attention (LAYER_TYPES): layer_types, or alternating (None keeps a replaced n_layers
        alternating too)."""
        return alternating_layers(self.n_layers) if self.layer_types is None else tuple(self.layer_types)

    @property
    def ffn_dim(self) -> int:  # what tensor parallel splits in each expert
        return self.moe_ffn_dim

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def num_params(self) -> int:
        return model_shape(self).num_params()


_SIZES_20B: dict[str, Any] = dict(
    dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088, moe_ffn_dim=2880, top_k=4
)

PRESETS: dict[str, GptOssConfig] = {
    # seconds on a CPU: 4 layers (sliding, full, sliding, full), a window of 16 that matters at seq 64-128,
    # 8 experts top 2, YaRN over an original context of 512
    "gpt-oss-debug": GptOssConfig(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=BYTE_VOCAB,
        moe_ffn_dim=32,
        n_experts=8,
        top_k=2,
        sliding_window=16,
        rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 512), ("truncate", False)),
        max_seq_len=2048,
    ),
    # the published shapes (config.json of openai/gpt-oss-20b and openai/gpt-oss-120b)
    "gpt-oss-20b": GptOssConfig(**_SIZES_20B, n_layers=24, n_experts=32),
    "gpt-oss-120b": GptOssConfig(**_SIZES_20B, n_layers=36, n_experts=128),
}


class GptOss(DecoderLM):
    """The one-process gpt-oss causal LM (transformers' GptOssForCausalLM without the "model." level)."""

    names = DecoderNames()  # Hugging Face's
    embed_tokens: nn.Module | None  # None on a pipeline stage after the first
    norm: nn.Module | None  # these two: None on a stage before the last
    lm_head: nn.Module | None

    def __init__(self, cfg: GptOssConfig):
        rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling, rope_type="yarn")
        super().__init__(cfg, rope, tied=cfg.tie_word_embeddings)

    def build_attention(self, cfg: GptOssConfig, layer: int) -> nn.Module:
        sliding = cfg.attention_types[layer] == "sliding_attention"
        return GroupedQueryAttention(
            cfg.dim,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            bias=True,
            sinks=True,
            window=cfg.sliding_window if sliding else None,
        )

    def build_mlp(self, cfg: GptOssConfig, layer: int) -> nn.Module:
        return MoE(
            cfg.dim,
            cfg.moe_ffn_dim,
            cfg.n_experts,
            cfg.top_k,
            aux_loss_coef=cfg.aux_loss_coef,
            bias=True,
            fused_gate_up=True,
            swiglu_clamp=(cfg.swiglu_alpha, cfg.swiglu_limit),
        )


@dataclasses.dataclass(frozen=True)
class GptOssInit:
    """Biases zero (as transformers initializes its linears' and experts'); the sinks and every weight
    cfg.init_std, the output projections (o_proj, the experts' down_proj) scaled by 1/sqrt(2 n_layers)."""

    weights: DepthScaledInit = DepthScaledInit((AttentionNames().o, MLPNames().down))

    def __call__(self, name: str, cfg: Any) -> Init:
        if name.endswith("bias") and not name.endswith("expert_bias"):
            return ZEROS
        return self.weights(name, cfg)


def model_shape(cfg: GptOssConfig) -> ModelShape:
    return decoder_shape(
        cfg,
        tied_embeddings=cfg.tie_word_embeddings,
        family="gpt_oss",
        bias=True,  # q, k, v and o
        moe_bias=True,  # the router and the experts
        attention_sinks=True,
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        moe_aux_loss=cfg.aux_loss_coef > 0,
        # the planner's attention FLOPs and saved activations: which blocks slide, and the experts' clamp
        sliding_window=cfg.sliding_window,
        sliding_layers=tuple(i for i, t in enumerate(cfg.attention_types) if t == "sliding_attention"),
        swiglu_clamp=True,
    )


# ----------------------------------------------------------------------------- Hugging Face names and config
# Hugging Face's names under "model." (the router as transformers names it: mlp.router)
_HF_INNER = re.compile(
    r"(embed_tokens|norm|lm_head)\.weight|layers\.\d+\.("
    r"(input_layernorm|post_attention_layernorm)\.weight|self_attn\.((q|k|v|o)_proj\.(weight|bias)|sinks)"
    r"|mlp\.(router\.(weight|bias)|experts\.(gate_up_proj|down_proj)(_bias)?))"
)
_NAMES = NamesUnderModel(_HF_INNER, "gpt-oss")
_OUR_ROUTER, _HF_ROUTER = re.compile(r"^(layers\.\d+\.mlp)\.gate\."), re.compile(r"^(layers\.\d+\.mlp)\.router\.")


def tessera_to_hf_name(name: str) -> str:
    """layers.0.mlp.gate.weight -> model.layers.0.mlp.router.weight; every other name gains "model."."""
    if _HF_ROUTER.match(name):  # transformers' name for what tessera calls gate
        raise ValueError(f"parameter {name!r} has no Hugging Face gpt-oss name")
    return _NAMES.to_hf(_OUR_ROUTER.sub(r"\1.router.", name))


def hf_to_tessera_name(name: str) -> str | None:
    inner = _NAMES.from_hf(name)
    return None if inner is None else _HF_ROUTER.sub(r"\1.gate.", inner)


def _read_rope(c: dict, path: str) -> tuple[tuple[str, Any], ...] | None:
    """YaRN's parameters from config.json (None: plain RoPE); ValueError for another scaling."""
    scaled = scaled_rope(c)
    if scaled is None:
        return None
    field, params, kind = scaled
    refuse(path, ((field, kind == "yarn", f"rope type {kind!r} (gpt-oss has YaRN or plain RoPE)"),))
    require(params, f"{path}: {field}", ("factor", "original_max_position_embeddings"))
    return tuple((k, params[k]) for k in YARN_FIELDS if params.get(k) is not None)


def read_hf_config(c: dict, path: str) -> GptOssConfig:
    """GptOssConfig from config.json's contents; ValueError naming the file and the field for what this family
    cannot represent (attention without biases, another activation or RoPE scaling, unknown layer types)."""
    check_architecture(c, path, "gpt_oss", "gpt_oss", "GptOssForCausalLM")
    refuse(
        path,
        (
            ("attention_bias", c.get("attention_bias", True) is True, "attention without biases (gpt-oss has them)"),
            ("hidden_act", c.get("hidden_act", "silu") == "silu", f"activation {c.get('hidden_act')!r}"),
            ("sliding_window", c.get("sliding_window", 128) is not None, "sliding layers without a window"),
            (
                "quantization_config",
                "quantization_config" not in c,
                "quantized weights (the published MXFP4 experts: load them in transformers with "
                "Mxfp4Config(dequantize=True) and save_pretrained a dequantized directory)",
            ),
        ),
    )
    require(c, path, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"))
    heads, types = c["num_attention_heads"], c.get("layer_types")
    experts = c.get("num_local_experts", c.get("num_experts", 128))
    try:
        return GptOssConfig(
            dim=c["hidden_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab_size=c["vocab_size"],
            moe_ffn_dim=c["intermediate_size"],
            n_experts=int(experts),
            top_k=int(c.get("num_experts_per_tok", 4)),
            sliding_window=c.get("sliding_window", 128),
            # transformers' default (alternating) as None: a preset's, and kept alternating if n_layers changes
            layer_types=None if types == list(alternating_layers(c["num_hidden_layers"])) else types,
            swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(c.get("swiglu_limit", 7.0)),
            # transformers adds its load-balancing loss only with output_router_logits (the published configs
            # name a coefficient, 0.9, but leave it off): tessera's auxiliary loss likewise
            aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)) if c.get("output_router_logits") else 0.0,
            norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            # transformers 5.x writes it in rope_parameters, 4.x as rope_theta; gpt-oss's default 150000
            rope_theta=float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 150000.0))),
            rope_scaling=_read_rope(c, path),
            max_seq_len=int(c.get("max_position_embeddings", 131072)),
            init_std=float(c.get("initializer_range", 0.02)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
    except ValueError as e:  # the config's own checks (layer_types, sliding_window): name the file
        raise ValueError(f"{path}: {e}") from None


def hf_config_dict(cfg: GptOssConfig, dtype: str = "float32") -> dict[str, Any]:
    rope = {"rope_type": "yarn", **dict(cfg.rope_scaling)} if cfg.rope_scaling else {"rope_type": "default"}
    return {
        **decoder_entries(cfg, "GptOssForCausalLM", "gpt_oss", dtype, tied=cfg.tie_word_embeddings),
        "attention_bias": True,
        "attention_dropout": 0.0,
        "intermediate_size": cfg.moe_ffn_dim,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.attention_types),
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": cfg.aux_loss_coef > 0,  # a load-balancing loss when training, as tessera's
        "initializer_range": cfg.init_std,
        # transformers 4.x reads rope_theta, 5.x rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
    }


TP_PLAN = decoder_tp_plan(GptOss.names, attention_tp_plan(sinks=True), moe_tp_plan())
HF = HFAdapter("gpt_oss", "GptOssForCausalLM", read_hf_config, hf_config_dict, tessera_to_hf_name, hf_to_tessera_name)
# Muon's matrices: the plan's, but of the experts only their weights (their biases are stacks of vectors)
_EXPERTS = f"layers.*.{GptOss.names.mlp}.experts.*"
MATRICES = tuple(p for p in matrix_patterns(TP_PLAN) if p != _EXPERTS) + tuple(
    _EXPERTS.removesuffix("*") + w for w in ("gate_up_proj", "down_proj")
)
GPT_OSS = register(
    dataclasses.replace(
        decoder_spec("gpt_oss", GptOssConfig, GptOss, TP_PLAN, GptOssInit(), model_shape, PRESETS, HF, moe=True),
        matrices=MATRICES,
    )
)


def build_model(cfg: GptOssConfig | str, device: torch.device | str = "cpu", seed: int | None = 0) -> GptOss:
    """Build the one-process model on `device` and initialize it from `seed` (on "meta" nothing is allocated)."""
    return cast(GptOss, GPT_OSS.build_model(GPT_OSS.config(cfg) if isinstance(cfg, str) else cfg, device, seed))
