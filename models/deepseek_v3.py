"""DeepSeek-V3: multi-head latent attention (models/attention.py's LatentAttention) with YaRN RoPE on its rotated
part, dense SwiGLU MLPs in the first `first_k_dense_replace` layers and then models/moe.py's MoE: sigmoid
scores, the auxiliary-loss-free bias, group-limited routing (n_group, topk_group), routed weights times
routed_scaling_factor, and shared experts. One file with its config, presets, spec and Hugging Face names.

Module names are transformers' (modeling_deepseek_v3.py), without the "model." level, but two: the MoE block's
shared experts are the block's `shared_expert` (transformers: `shared_experts`), and a dense layer's MLP is
`layers.N.dense_mlp` (transformers: `mlp`, as the MoE blocks), so that a tp plan's pattern and expert parallel's
`layers.*.mlp` find the MoE blocks alone whatever first_k_dense_replace is. The routing bias, transformers'
buffer `mlp.gate.e_score_correction_bias`, is the block's `expert_bias`. The adapter below maps the names,
and stacks (and splits) the experts' per-expert matrices.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tessera.topology.shapes import ModelShape

from .attention import LatentAttention, latent_attention_tp_plan
from .spec import BYTE_VOCAB
from .decoder import DecoderLM, DecoderNames, DepthScaledInit, decoder_shape, decoder_spec, decoder_tp_plan
from .hf_adapter import check_architecture, decoder_entries, off, refuse, require, rope_theta, scaled_rope, silu_only
from .layers import Rotary, yarn_mscale
from .mlp import SwiGLU, swiglu_tp_plan
from .moe import MoE, check_groups, moe_tp_plan
from .spec import HFAdapter, prefixed, register

# YaRN's parameters a config may give (models/layers.py's yarn_scaled)
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
)


@dataclass(frozen=True)
class DeepseekV3Config:
    family = "deepseek_v3"  # the registered spec; a class attribute, not a field
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    dense_ffn_dim: int  # the first layers' SwiGLU width (intermediate_size)
    moe_ffn_dim: int  # each routed and shared expert's width (moe_intermediate_size)
    n_experts: int  # routed experts (n_routed_experts)
    top_k: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    q_lora_rank: int | None = None  # None: one q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # YaRN's parameters as (name, value) pairs (YARN_KEYS); None: plain RoPE
    rope_interleave: bool = True
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    init_std: float = 0.02
    aux_loss_coef: float = 0.0001  # the paper's sequence-wise balance loss (alpha); 0: off
    bias_rate: float = 0.001  # the auxiliary-loss-free bias's step (gamma); 0: off
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        unknown = sorted({k for k, _ in self.rope_scaling or ()} - set(YARN_KEYS))
        if unknown:
            raise ValueError(f"rope_scaling: {unknown[0]!r} is not a YaRN parameter; use {', '.join(YARN_KEYS)}")
        if self.rope_scaling is not None and "factor" not in dict(self.rope_scaling):
            raise ValueError("rope_scaling: YaRN needs factor and original_max_position_embeddings")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        check_groups(self.n_experts, self.top_k, self.n_group, self.topk_group)
        if not 0 <= self.first_k_dense_replace <= self.n_layers:
            raise ValueError(
                f"first_k_dense_replace={self.first_k_dense_replace} must be between 0 and n_layers={self.n_layers}"
            )

    # what the decoder, the planner and tp's checks read: every head has its own keys and values
    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def head_dim(self) -> int:  # the query and key heads' width
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def ffn_dim(self) -> int:  # what tensor parallel splits in each expert
        return self.moe_ffn_dim

    @property
    def softmax_scale(self) -> float:
        """head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared (transformers' yarn_apply_mscale)."""
        scale = self.head_dim**-0.5
        yarn = dict(self.rope_scaling or ())
        if yarn.get("mscale_all_dim"):
            scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
        return scale

    def as_dict(self) -> dict:
        out = asdict(self)
        out["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)
        return out

    def num_params(self) -> int:
        return model_shape(self).num_params()


# DeepSeek-V3's published YaRN (config.json's rope_scaling): 4096 positions stretched 40 times
V3_YARN = dict(
    factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
)

PRESETS: dict[str, DeepseekV3Config] = {
    # seconds on a CPU: one dense layer, then two MoE layers of 8 experts in 2 groups; YaRN 4x over 512 positions
    "deepseek-v3-debug": DeepseekV3Config(
        dim=64,
        n_layers=3,
        n_heads=4,
        vocab_size=BYTE_VOCAB,
        dense_ffn_dim=128,
        moe_ffn_dim=32,
        n_experts=8,
        top_k=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_scaling=tuple(sorted(dict(V3_YARN, factor=4.0, original_max_position_embeddings=512).items())),
        max_seq_len=2048,
    ),
    # ~16B total, 3B active: Moonlight-16B-A3B's published config.json (moonshotai; model_type deepseek_v3):
    # no query latent, 64 routed experts of 1408 and 2 shared, top 6, no groups, one dense layer
    "deepseek-v3-lite": DeepseekV3Config(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=163840,
        dense_ffn_dim=11264,
        moe_ffn_dim=1408,
        n_experts=64,
        top_k=6,
        n_shared_experts=2,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        q_lora_rank=None,
        rope_theta=50000.0,
        norm_eps=1e-5,
        max_seq_len=8192,
        aux_loss_coef=0.001,
    ),
    # deepseek-ai/DeepSeek-V3's published config.json
    "deepseek-v3-671b": DeepseekV3Config(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        dense_ffn_dim=18432,
        moe_ffn_dim=2048,
        n_experts=256,
        top_k=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        q_lora_rank=1536,
        rope_scaling=tuple(sorted(V3_YARN.items())),
        max_seq_len=163840,
    ),
}

# a dense layer's MLP sits under its own name (see the module docstring)
DENSE_NAMES = DecoderNames(mlp="dense_mlp")


class DeepseekV3(DecoderLM):
    """The one-process DeepSeek-V3 causal LM (transformers' DeepseekV3ForCausalLM without the "model." level and
    its multi-token-prediction layers)."""

    names = DecoderNames()
    config: DeepseekV3Config

    def __init__(self, cfg: DeepseekV3Config):
        rope = Rotary(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling, rope_type="yarn")
        super().__init__(cfg, rope, tied=cfg.tie_word_embeddings)

    def layer_names(self, layer: int) -> DecoderNames:
        return DENSE_NAMES if layer < self.config.first_k_dense_replace else self.names

    def build_attention(self, cfg: DeepseekV3Config, layer: int) -> nn.Module:
        return LatentAttention(
            cfg.dim,
            cfg.n_heads,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.softmax_scale,
            cfg.rope_interleave,
        )

    def build_mlp(self, cfg: DeepseekV3Config, layer: int) -> nn.Module:
        if layer < cfg.first_k_dense_replace:
            return SwiGLU(cfg.dim, cfg.dense_ffn_dim)
        return MoE(
            cfg.dim,
            cfg.moe_ffn_dim,
            cfg.n_experts,
            cfg.top_k,
            score_func="sigmoid",
            norm_topk=cfg.norm_topk_prob,
            shared_ffn_dim=cfg.moe_ffn_dim * cfg.n_shared_experts,
            aux_loss_coef=cfg.aux_loss_coef,
            bias_rate=cfg.bias_rate,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )


# norms ONES (the latents' norms too); o_proj and every down_proj scaled by 1/sqrt(2 * n_layers)
param_init_std = DepthScaledInit(("o_proj", "down_proj"))


def model_shape(cfg: DeepseekV3Config) -> ModelShape:
    return decoder_shape(
        cfg,
        tied_embeddings=cfg.tie_word_embeddings,
        family="deepseek_v3",
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        shared_ffn_dim=cfg.moe_ffn_dim * cfg.n_shared_experts,
        moe_aux_loss=cfg.aux_loss_coef > 0,
        q_lora_rank=cfg.q_lora_rank or 0,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_dense_layers=cfg.first_k_dense_replace,
        dense_ffn_dim=cfg.dense_ffn_dim,
    )


# ----------------------------------------------------------------------------- Hugging Face names and config
_ATTENTION = r"q_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj"
_SAME = re.compile(
    r"(embed_tokens|norm|lm_head)\.weight"
    rf"|layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.({_ATTENTION})|mlp\.gate)\.weight"
)
_PROJ = r"(gate_proj|up_proj|down_proj)"
_RENAMED = (  # (tessera's name, transformers' name under "model."), each a pattern of the other
    (rf"layers\.(\d+)\.dense_mlp\.{_PROJ}\.weight", r"layers.\1.mlp.\2.weight"),
    (rf"layers\.(\d+)\.mlp\.shared_expert\.{_PROJ}\.weight", r"layers.\1.mlp.shared_experts.\2.weight"),
    (r"layers\.(\d+)\.mlp\.expert_bias", r"layers.\1.mlp.gate.e_score_correction_bias"),
)
_HF_RENAMED = (
    (rf"layers\.(\d+)\.mlp\.{_PROJ}\.weight", r"layers.\1.dense_mlp.\2.weight"),
    (rf"layers\.(\d+)\.mlp\.shared_experts\.{_PROJ}\.weight", r"layers.\1.mlp.shared_expert.\2.weight"),
    (r"layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", r"layers.\1.mlp.expert_bias"),
)
_EXPERTS = re.compile(rf"layers\.\d+\.mlp\.experts\.{_PROJ}")
_HF_EXPERT = re.compile(rf"model\.(layers\.\d+\.mlp\.experts)\.(\d+)\.{_PROJ}\.weight")
# the multi-token-prediction module's own tensors (published checkpoints hold one after the last layer)
_HF_MTP = re.compile(r"model\.layers\.\d+\.(enorm|hnorm|eh_proj|shared_head\.(norm|head)|embed_tokens)\.weight")


def tessera_to_hf_name(name: str) -> str:
    """tessera's name -> transformers'; a stacked expert weight's has the expert index where `{}` stands."""
    if _EXPERTS.fullmatch(name):
        stem, _, proj = name.rpartition(".")
        return f"model.{stem}.{{}}.{proj}.weight"
    if name == "lm_head.weight":
        return name
    if _SAME.fullmatch(name):
        return f"model.{name}"
    for ours, theirs in _RENAMED:
        if re.fullmatch(ours, name):
            return "model." + re.sub(ours, theirs, name)
    raise ValueError(f"parameter {name!r} has no Hugging Face DeepSeek-V3 name")


def hf_to_tessera_name(name: str) -> str | tuple[str, int] | None:
    """transformers' name -> tessera's; a per-expert matrix -> (the stacked parameter's name, the expert's index);
    None for what is not the model's (rotary buffers, the multi-token-prediction module)."""
    expert = _HF_EXPERT.fullmatch(name)
    if expert:
        return f"{expert.group(1)}.{expert.group(3)}", int(expert.group(2))
    if name.endswith("rotary_emb.inv_freq") or _HF_MTP.fullmatch(name):
        return None
    if name == "lm_head.weight":
        return name
    inner = name.removeprefix("model.")
    if name.startswith("model.") and _SAME.fullmatch(inner):
        return inner
    for theirs, ours in _HF_RENAMED:
        if name.startswith("model.") and re.fullmatch(theirs, inner):
            return re.sub(theirs, ours, inner)
    raise ValueError(
        f"unexpected parameter {name!r} in the Hugging Face checkpoint (not a DeepSeek-V3 weight tessera knows)"
    )


def read_hf_config(c: dict, path: str) -> DeepseekV3Config:
    """DeepseekV3Config from config.json's contents; ValueError naming the file and the field for what this
    family cannot represent."""
    check_architecture(c, path, "deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM")
    scaled = scaled_rope(c)
    heads = c.get("num_attention_heads")
    refuse(
        path,
        (
            off(c, "attention_bias", "biases in attention"),
            silu_only(c, "tessera's MLPs and experts are SwiGLU"),
            ("scoring_func", c.get("scoring_func", "sigmoid") == "sigmoid", "scores other than sigmoid"),
            ("topk_method", c.get("topk_method", "noaux_tc") == "noaux_tc", f"routing {c.get('topk_method')!r}"),
            (
                "num_key_value_heads",
                c.get("num_key_value_heads") in (None, heads),
                f"{c.get('num_key_value_heads')} key/value heads for {heads} query heads (latent attention has one "
                f"per head)",
            ),
            (
                scaled[0] if scaled else "rope_scaling",
                scaled is None or scaled[2] == "yarn",
                f"rope type {scaled[2] if scaled else ''!r} (plain RoPE or YaRN only)",
            ),
        ),
    )
    require(
        c,
        path,
        (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "intermediate_size",
            "moe_intermediate_size",
            "n_routed_experts",
        ),
    )
    yarn = None
    if scaled is not None:
        yarn = tuple(sorted((k, v) for k, v in scaled[1].items() if k in YARN_KEYS and v is not None))
    return DeepseekV3Config(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"],
        vocab_size=c["vocab_size"],
        dense_ffn_dim=c["intermediate_size"],
        moe_ffn_dim=c["moe_intermediate_size"],
        n_experts=c["n_routed_experts"],
        top_k=int(c.get("num_experts_per_tok", 8)),
        n_shared_experts=int(c.get("n_shared_experts", 1)),
        # absent fields take transformers' DeepseekV3Config defaults (DeepSeek-V3's own); null groups: none
        n_group=int(c.get("n_group", 8) or 1),
        topk_group=int(c.get("topk_group", 4) or 1),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        first_k_dense_replace=int(c.get("first_k_dense_replace", 3)),
        q_lora_rank=c.get("q_lora_rank", 1536),
        kv_lora_rank=int(c.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(c.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(c.get("qk_rope_head_dim", 64)),
        v_head_dim=int(c.get("v_head_dim", 128)),
        rope_theta=rope_theta(c),
        rope_scaling=yarn,
        rope_interleave=bool(c.get("rope_interleave", True)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(c.get("max_position_embeddings", 4096)),
        init_std=float(c.get("initializer_range", 0.02)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def hf_config_dict(cfg: DeepseekV3Config, dtype: str = "float32") -> dict[str, Any]:
    yarn = dict(cfg.rope_scaling or ())
    rope = {"rope_type": "yarn" if yarn else "default", "rope_theta": cfg.rope_theta, **yarn}
    return {
        **decoder_entries(cfg, "DeepseekV3ForCausalLM", "deepseek_v3", dtype, tied=cfg.tie_word_embeddings),
        "head_dim": cfg.qk_rope_head_dim,  # transformers' DeepseekV3Config sets it so (RoPE's width)
        "intermediate_size": cfg.dense_ffn_dim,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "n_routed_experts": cfg.n_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.top_k,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": cfg.rope_interleave,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction module
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
        # transformers 4.x reads rope_theta and rope_scaling, 5.x rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_scaling": {"type": "yarn", **yarn} if yarn else None,
        "rope_parameters": rope,
    }


TP_PLAN = (
    *decoder_tp_plan(DeepseekV3.names, latent_attention_tp_plan(), moe_tp_plan()),
    *prefixed(f"layers.*.{DENSE_NAMES.mlp}", swiglu_tp_plan()),
)
HF = HFAdapter(
    "deepseek_v3", "DeepseekV3ForCausalLM", read_hf_config, hf_config_dict, tessera_to_hf_name, hf_to_tessera_name
)
DEEPSEEK_V3 = register(
    decoder_spec(
        "deepseek_v3", DeepseekV3Config, DeepseekV3, TP_PLAN, param_init_std, model_shape, PRESETS, HF, moe=True
    )
)


def build_model(cfg: DeepseekV3Config | str, device: torch.device | str = "cpu", seed: int | None = 0) -> DeepseekV3:
    model = DEEPSEEK_V3.build_model(DEEPSEEK_V3.config(cfg) if isinstance(cfg, str) else cfg, device, seed)
    assert isinstance(model, DeepseekV3)
    return model
