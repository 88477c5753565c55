"""Qwen3-MoE: Qwen3 (models/qwen3.py: its attention with QK-norm, its own head_dim, its norms and names) with a
mixture-of-experts block in place of every MLP, in one file with its spec. The block is models/moe.py's MoE: a
softmax router over n_experts, top-k token choice with the top-k weights renormalized (norm_topk_prob), SwiGLU
experts as grouped GEMMs.

Module names are Hugging Face's own (layers.N.mlp.gate is the router, layers.N.mlp.experts holds the
experts' stacked weights gate_proj, up_proj (E, ffn, dim) and down_proj (E, dim, ffn)); a Hugging Face
checkpoint stores each expert's matrices apart (model.layers.N.mlp.experts.E.gate_proj.weight, ...), which
the adapter below stacks and splits. Beyond transformers' Qwen3MoeForCausalLM, the block can also run
sigmoid scores, a shared expert and the auxiliary-loss-free bias (DeepSeek-V3's recipe); a config that uses
them has no Hugging Face form and is refused on export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from tessera.topology.shapes import ModelShape

from .attention import attention_tp_plan
from .decoder import decoder_shape, decoder_spec, decoder_tp_plan
from .hf_adapter import NamesUnderModel, check_architecture, refuse, require, silu_only
from .moe import MoE, moe_tp_plan
from .qwen3 import (
    DEBUG_SIZES,
    HF_ATTENTION_AND_NORMS,
    PUBLISHED_SIZES,
    Qwen3,
    Qwen3Fields,
    Qwen3Sizes,
    hf_config_entries,
    read_hf_sizes,
)
from .qwen3 import param_init_std as param_init_std  # Qwen3's: the experts' down_proj scaled as an MLP's
from .spec import HFAdapter, register


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Sizes):
    family = "qwen3_moe"  # the registered spec; a class attribute, not a field
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
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")

    @property
    def ffn_dim(self) -> int:  # what tensor parallel splits in each expert
        return self.moe_ffn_dim

    def num_params(self) -> int:
        return model_shape(self).num_params()


PRESETS: dict[str, Qwen3MoeConfig] = {
    # seconds on a laptop CPU: 8 experts, top 2, two layers
    "qwen3-moe-debug": Qwen3MoeConfig(**DEBUG_SIZES, moe_ffn_dim=32, n_experts=8, top_k=2),
    # the block's other recipe (DeepSeek-V3's): sigmoid scores, a shared expert, the auxiliary-loss-free bias;
    # tessera's only (no Hugging Face Qwen3-MoE form)
    "qwen3-moe-shared-debug": Qwen3MoeConfig(
        **DEBUG_SIZES, moe_ffn_dim=32, n_experts=8, top_k=2, score_func="sigmoid", shared_ffn_dim=64, bias_rate=0.001
    ),
    # the published shapes (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B)
    "qwen3-30b-a3b": Qwen3MoeConfig(
        **PUBLISHED_SIZES, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, moe_ffn_dim=768, n_experts=128, top_k=8
    ),
    "qwen3-235b-a22b": Qwen3MoeConfig(
        **PUBLISHED_SIZES, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, moe_ffn_dim=1536, n_experts=128, top_k=8
    ),
}


class Qwen3Moe(Qwen3):
    """The one-process Qwen3-MoE causal LM (Qwen3MoeForCausalLM without the "model." level): Qwen3 with a
    mixture of experts in every block's MLP place; forward as Qwen3's."""

    def build_mlp(self, cfg: Qwen3Fields, layer: int) -> nn.Module:
        if not isinstance(cfg, Qwen3MoeConfig):
            raise TypeError(f"Qwen3Moe is built from a Qwen3MoeConfig, not a {type(cfg).__name__}")
        return MoE(
            cfg.dim,
            cfg.moe_ffn_dim,
            cfg.n_experts,
            cfg.top_k,
            cfg.score_func,
            cfg.norm_topk_prob,
            cfg.shared_ffn_dim,
            cfg.aux_loss_coef,
            cfg.bias_rate,
        )


def model_shape(cfg: Qwen3MoeConfig) -> ModelShape:
    return decoder_shape(
        cfg,
        qk_norm=True,
        tied_embeddings=cfg.tie_word_embeddings,
        family="qwen3_moe",
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        shared_ffn_dim=cfg.shared_ffn_dim,
        moe_aux_loss=cfg.aux_loss_coef > 0,
    )


# ----------------------------------------------------------------------------- Hugging Face names and config
# Qwen3's attention and norms, the router (mlp.gate) and the stacked experts, which Hugging Face stores one
# matrix per expert
_OURS = re.compile(rf"(embed_tokens|norm|lm_head)\.weight|layers\.\d+\.({HF_ATTENTION_AND_NORMS}|mlp\.gate)\.weight")
_EXPERTS = re.compile(r"layers\.\d+\.mlp\.experts\.(gate_proj|up_proj|down_proj)")
_HF_EXPERT = re.compile(r"model\.(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_NAMES = NamesUnderModel(_OURS, "Qwen3-MoE")


def tessera_to_hf_name(name: str) -> str:
    """embed_tokens.weight -> model.embed_tokens.weight; a stacked expert weight's HF name has the expert
    index where `{}` stands: layers.0.mlp.experts.up_proj -> model.layers.0.mlp.experts.{}.up_proj.weight."""
    if _EXPERTS.fullmatch(name):
        stem, _, proj = name.rpartition(".")
        return f"model.{stem}.{{}}.{proj}.weight"
    return _NAMES.to_hf(name)


def hf_to_tessera_name(name: str) -> str | tuple[str, int] | None:
    """HF name -> tessera's; a per-expert matrix -> (the stacked parameter's name, the expert's index)."""
    expert = _HF_EXPERT.fullmatch(name)
    if expert:
        return f"{expert.group(1)}.{expert.group(3)}", int(expert.group(2))
    return _NAMES.from_hf(name)


def read_hf_config(c: dict, path: str) -> Qwen3MoeConfig:
    """Qwen3MoeConfig from config.json's contents; ValueError naming the file and the field for what this
    family cannot represent (biases, sliding windows, dense layers among the MoE ones, RoPE scaling)."""
    check_architecture(c, path, "qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM")
    refuse(
        path,
        (
            ("mlp_only_layers", not c.get("mlp_only_layers"), "dense MLP layers among the MoE layers"),
            (
                "decoder_sparse_step",
                c.get("decoder_sparse_step", 1) == 1,
                "MoE on every other layer (only every layer)",
            ),
            silu_only(c, "experts are SwiGLU"),
        ),
    )
    # transformers' Qwen3MoeConfig defaults: 4 kv heads, and without head_dim its attention and RoPE use
    # hidden_size // num_attention_heads
    sizes = read_hf_sizes(c, path, kv_heads=4, head_dim=None)
    require(c, path, ("moe_intermediate_size",))
    experts = c.get("num_experts", c.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"{path}: num_experts is missing")
    return Qwen3MoeConfig(
        **sizes,
        moe_ffn_dim=c["moe_intermediate_size"],
        n_experts=int(experts),
        top_k=int(c.get("num_experts_per_tok", 8)),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
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
        **hf_config_entries(cfg, "Qwen3MoeForCausalLM", "qwen3_moe", dtype),
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "intermediate_size": cfg.moe_ffn_dim * cfg.top_k,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": False,
    }


TP_PLAN = decoder_tp_plan(Qwen3Moe.names, attention_tp_plan(qk_norm=True), moe_tp_plan())
HF = HFAdapter(
    "qwen3_moe", "Qwen3MoeForCausalLM", read_hf_config, hf_config_dict, tessera_to_hf_name, hf_to_tessera_name
)
QWEN3_MOE = register(
    decoder_spec("qwen3_moe", Qwen3MoeConfig, Qwen3Moe, TP_PLAN, param_init_std, model_shape, PRESETS, HF, moe=True)
)


def build_model(cfg: Qwen3MoeConfig | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Qwen3Moe:
    return cast(Qwen3Moe, QWEN3_MOE.build_model(QWEN3_MOE.config(cfg) if isinstance(cfg, str) else cfg, device, seed))
