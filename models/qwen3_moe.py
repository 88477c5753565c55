"""Qwen3-MoE: Qwen3's attention (QK-norm, its own head_dim) with a mixture-of-experts block in place of every
MLP, in one file with its spec. The block is tessera.models.moe.MoE: a softmax router over n_experts, top-k
token choice with the top-k weights renormalized (norm_topk_prob), SwiGLU experts as grouped GEMMs.

Module names are Hugging Face's own (layers.N.mlp.gate is the router, layers.N.mlp.experts holds the
experts' stacked weights gate_proj, up_proj (E, ffn, dim) and down_proj (E, dim, ffn)); a Hugging Face
checkpoint stores each expert's matrices apart (model.layers.N.mlp.experts.E.gate_proj.weight, ...), which
the adapter below stacks and splits. Beyond transformers' Qwen3MoeForCausalLM, the block can also run
sigmoid scores, a shared expert and the auxiliary-loss-free bias (DeepSeek-V3's recipe); a config that uses
them has no Hugging Face form and is refused on export.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tessera.topology.shapes import ModelShape

from .init import ONES
from .llama import BYTE_VOCAB
from .moe import MoE
from .qwen3 import Qwen3, Qwen3DecoderLayer, Qwen3Fields
from .spec import HFAdapter, ModelSpec, PipelineSplit, register


@dataclass(frozen=True)
class Qwen3MoeConfig:
    family = "qwen3_moe"  # the registered spec; a class attribute, not a field
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    moe_ffn_dim: int  # each expert's SwiGLU width (moe_intermediate_size)
    n_experts: int
    top_k: int
    norm_topk_prob: bool = True
    score_func: str = "softmax"
    shared_ffn_dim: int = 0  # a shared expert's width (0: none; Qwen3-MoE has none)
    aux_loss_coef: float = 0.001  # the sequence-level auxiliary loss's weight (0: off)
    bias_rate: float = 0.0  # the auxiliary-loss-free bias's step (0: off; DeepSeek-V3 uses 0.001)
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
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")

    @property
    def ffn_dim(self) -> int:  # what tensor parallel splits in each expert
        return self.moe_ffn_dim

    def num_params(self) -> int:
        return model_shape(self).num_params()

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, Qwen3MoeConfig] = {
    # seconds on a laptop CPU: 8 experts, top 2, two layers
    "qwen3-moe-debug": Qwen3MoeConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=BYTE_VOCAB,
        moe_ffn_dim=32,
        n_experts=8,
        top_k=2,
        max_seq_len=2048,
    ),
    # the block's other recipe (DeepSeek-V3's): sigmoid scores, a shared expert, the auxiliary-loss-free bias;
    # tessera's only (no Hugging Face Qwen3-MoE form)
    "qwen3-moe-shared-debug": Qwen3MoeConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=BYTE_VOCAB,
        moe_ffn_dim=32,
        n_experts=8,
        top_k=2,
        score_func="sigmoid",
        shared_ffn_dim=64,
        bias_rate=0.001,
        max_seq_len=2048,
    ),
    # the published shapes (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B)
    "qwen3-30b-a3b": Qwen3MoeConfig(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        moe_ffn_dim=768,
        n_experts=128,
        top_k=8,
    ),
    "qwen3-235b-a22b": Qwen3MoeConfig(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        moe_ffn_dim=1536,
        n_experts=128,
        top_k=8,
    ),
}


class Qwen3Moe(Qwen3):
    """The one-process Qwen3-MoE causal LM (Qwen3MoeForCausalLM without the "model." level): Qwen3 with a
    mixture of experts in every block's MLP place; forward as Qwen3's."""

    @staticmethod
    def decoder_layer(cfg: Qwen3Fields) -> nn.Module:
        if not isinstance(cfg, Qwen3MoeConfig):
            raise TypeError(f"Qwen3Moe is built from a Qwen3MoeConfig, not a {type(cfg).__name__}")
        return Qwen3DecoderLayer(
            cfg,
            mlp=MoE(
                cfg.dim,
                cfg.moe_ffn_dim,
                cfg.n_experts,
                cfg.top_k,
                cfg.score_func,
                cfg.norm_topk_prob,
                cfg.shared_ffn_dim,
                cfg.aux_loss_coef,
                cfg.bias_rate,
            ),
        )


def param_init_std(name: str, cfg: Qwen3MoeConfig) -> float | str:
    """Norms ONES; the output projections (o_proj, each expert's and the shared expert's down_proj) scaled
    by 1/sqrt(2 * n_layers); everything else (the router too) cfg.init_std."""
    if name.endswith("norm.weight"):
        return ONES
    scaled = name.endswith(("o_proj.weight", "down_proj", "down_proj.weight"))
    return cfg.init_std * (1.0 / math.sqrt(2 * cfg.n_layers) if scaled else 1.0)


def model_shape(cfg: Qwen3MoeConfig) -> ModelShape:
    return ModelShape(
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        ffn_dim=cfg.moe_ffn_dim,
        qk_norm=True,
        tied_embeddings=cfg.tie_word_embeddings,
        family="qwen3_moe",
        max_seq_len=cfg.max_seq_len,
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        shared_ffn_dim=cfg.shared_ffn_dim,
        moe_aux_loss=cfg.aux_loss_coef > 0,
    )


# ----------------------------------------------------------------------------- Hugging Face names and config
_OURS = re.compile(
    r"(embed_tokens|norm|lm_head)\.weight"
    r"|layers\.\d+\.(input_layernorm|post_attention_layernorm"
    r"|self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)|mlp\.gate)\.weight"
    r"|layers\.\d+\.mlp\.experts\.(gate_proj|up_proj|down_proj)"
)
_HF_EXPERT = re.compile(r"model\.(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def tessera_to_hf_name(name: str) -> str:
    """embed_tokens.weight -> model.embed_tokens.weight; a stacked expert weight's HF name has the expert
    index where `{}` stands: layers.0.mlp.experts.up_proj -> model.layers.0.mlp.experts.{}.up_proj.weight."""
    if not _OURS.fullmatch(name):
        raise ValueError(f"parameter {name!r} has no Hugging Face Qwen3-MoE name")
    if ".mlp.experts." in name:
        stem, _, proj = name.rpartition(".")
        return f"model.{stem}.{{}}.{proj}.weight"
    return name if name == "lm_head.weight" else f"model.{name}"


def hf_to_tessera_name(name: str) -> str | tuple[str, int] | None:
    """HF name -> tessera's; a per-expert matrix -> (the stacked parameter's name, the expert's index)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight":
        return name
    expert = _HF_EXPERT.fullmatch(name)
    if expert:
        return f"{expert.group(1)}.{expert.group(3)}", int(expert.group(2))
    ours = name[len("model.") :]
    if not name.startswith("model.") or ours == "lm_head.weight" or not _OURS.fullmatch(ours) or ".experts." in ours:
        raise ValueError(
            f"unexpected parameter {name!r} in the Hugging Face checkpoint (not a Qwen3-MoE weight tessera knows)"
        )
    return ours


def read_hf_config(c: dict, path: str) -> Qwen3MoeConfig:
    """Qwen3MoeConfig from config.json's contents; ValueError naming the file and the field for what this
    family cannot represent (biases, sliding windows, dense layers among the MoE ones, RoPE scaling)."""
    arch = (c.get("architectures") or ["Qwen3MoeForCausalLM"])[0]
    if c.get("model_type") != "qwen3_moe" or arch != "Qwen3MoeForCausalLM":
        raise ValueError(
            f"{path}: architecture {arch!r} (model_type {c.get('model_type')!r}) is not supported; "
            f"tessera's qwen3_moe family loads Qwen3MoeForCausalLM checkpoints"
        )
    ropes = [(f, r) for f in ("rope_parameters", "rope_scaling") if isinstance(r := c.get(f), dict)]
    scaled = next(
        (
            (f, r.get("rope_type", r.get("type", "default")))
            for f, r in ropes
            if r.get("rope_type", r.get("type", "default")) != "default"
        ),
        None,
    )
    for field, ok, why in (
        ("attention_bias", not c.get("attention_bias", False), "biases in attention"),
        ("use_sliding_window", not c.get("use_sliding_window", False), "sliding-window attention"),
        ("mlp_only_layers", not c.get("mlp_only_layers"), "dense MLP layers among the MoE layers"),
        ("decoder_sparse_step", c.get("decoder_sparse_step", 1) == 1, "MoE on every other layer (only every layer)"),
        (
            "hidden_act",
            c.get("hidden_act", "silu") == "silu",
            f"activation {c.get('hidden_act')!r} (experts are SwiGLU)",
        ),
        (
            scaled[0] if scaled else "rope_scaling",
            scaled is None,
            f"rope type {scaled[1] if scaled else ''!r} (plain RoPE only)",
        ),
    ):
        if not ok:
            raise ValueError(f"{path}: {field}: {why} is not supported")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "moe_intermediate_size"):
        if key not in c:
            raise ValueError(f"{path}: {key} is missing")
    experts = c.get("num_experts", c.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"{path}: num_experts is missing")
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads", 4)  # transformers' Qwen3MoeConfig defaults: 4 kv heads, no head_dim field
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    return Qwen3MoeConfig(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv if kv is not None else heads,
        # without head_dim, transformers' Qwen3-MoE attention and RoPE use hidden_size // num_attention_heads
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        vocab_size=c["vocab_size"],
        moe_ffn_dim=c["moe_intermediate_size"],
        n_experts=int(experts),
        top_k=int(c.get("num_experts_per_tok", 8)),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_seq_len=int(c.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def hf_config_dict(cfg: Qwen3MoeConfig, dtype: str = "float32") -> dict[str, Any]:
    beyond = [
        (f, v)
        for f, v, plain in (
            ("score_func", cfg.score_func, "softmax"),
            ("shared_ffn_dim", cfg.shared_ffn_dim, 0),
            ("bias_rate", cfg.bias_rate, 0.0),
        )
        if v != plain
    ]
    if beyond:
        raise ValueError(
            f"{beyond[0][0]}={beyond[0][1]!r} has no Hugging Face Qwen3-MoE form (Qwen3MoeForCausalLM has "
            f"softmax routing, no shared expert, no routing bias); keep the checkpoint in tessera's format"
        )
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "intermediate_size": cfg.moe_ffn_dim * cfg.top_k,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": False,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
    }


QWEN3_MOE = register(
    ModelSpec(
        name="qwen3_moe",
        config_type=Qwen3MoeConfig,
        build=Qwen3Moe,
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
            # the MoE block: its input and routing gathered once, the experts' ffn split, one output reduce
            ("layers.*.mlp", "moe"),
            ("layers.*.mlp.gate", "replicated"),
            ("layers.*.mlp.experts", "experts"),
            ("layers.*.mlp.shared_expert", "block_input"),
            ("layers.*.mlp.shared_expert.gate_proj", "colwise"),
            ("layers.*.mlp.shared_expert.up_proj", "colwise"),
            ("layers.*.mlp.shared_expert.down_proj", "rowwise"),
            ("layers.*.input_layernorm", "norm"),
            ("layers.*.post_attention_layernorm", "norm"),
            ("norm", "norm"),
            ("lm_head", "colwise_gather"),
        ),
        blocks="layers.*",
        pipeline=PipelineSplit(first=("embed_tokens",), blocks="layers", last=("norm", "lm_head")),
        attention="layers.*.self_attn.core",
        head="lm_head",
        moe="layers.*.mlp",
        presets=PRESETS,
        hf=HFAdapter(
            model_type="qwen3_moe",
            architecture="Qwen3MoeForCausalLM",
            read_config=read_hf_config,
            config_dict=hf_config_dict,
            to_hf=tessera_to_hf_name,
            from_hf=hf_to_tessera_name,
        ),
    )
)


def build_model(cfg: Qwen3MoeConfig | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Qwen3Moe:
    model = QWEN3_MOE.build_model(QWEN3_MOE.config(cfg) if isinstance(cfg, str) else cfg, device, seed)
    if not isinstance(model, Qwen3Moe):
        raise TypeError(f"the qwen3_moe spec built a {type(model).__name__}, not a Qwen3Moe")
    return model
