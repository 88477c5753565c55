"""What the families' Hugging Face adapters (ModelSpec.hf) share: config.json's architecture, RoPE and required
fields read, what a family cannot represent refused by field name, the config.json entries every decoder
writes, and the parameter names of a family whose modules are Hugging Face's own. models/hf.py moves the
checkpoints themselves; this module is what a family file builds its adapter from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable


def check_architecture(c: dict, path: str, family: str, model_type: str, architecture: str) -> None:
    """ValueError unless config.json names `model_type` and (if it names one) `architecture`."""
    arch = (c.get("architectures") or [architecture])[0]
    if c.get("model_type") != model_type or arch != architecture:
        raise ValueError(
            f"{path}: architecture {arch!r} (model_type {c.get('model_type')!r}) is not supported; "
            f"tessera's {family} family loads {architecture} checkpoints"
        )


def refuse(path: str, checks: Iterable[tuple[str, bool, str]]) -> None:
    """ValueError naming the first (field, supported, what it asks for) whose `supported` is False."""
    for field, ok, why in checks:
        if not ok:
            raise ValueError(f"{path}: {field}: {why} is not supported")


def off(c: dict, field: str, why: str) -> tuple[str, bool, str]:
    """The `refuse` check of a config.json flag that must be absent or false (attention_bias, ...)."""
    return field, not c.get(field, False), why


def silu_only(c: dict, why: str) -> tuple[str, bool, str]:
    """The `refuse` check of a family whose MLPs are SwiGLU (hidden_act silu); `why` says so."""
    return "hidden_act", c.get("hidden_act", "silu") == "silu", f"activation {c.get('hidden_act')!r} ({why})"


def require(c: dict, path: str, keys: Iterable[str]) -> None:
    for key in keys:
        if key not in c:
            raise ValueError(f"{path}: {key} is missing")


def rope_theta(c: dict) -> float:
    """RoPE's base: transformers 5.x writes it in rope_parameters, 4.x as rope_theta."""
    return float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0)))


def scaled_rope(c: dict) -> tuple[str, dict, str] | None:
    """(field, its parameters, rope type) of the first of rope_parameters (5.x) and rope_scaling (4.x) that is
    not plain RoPE; None for plain RoPE."""
    for field in ("rope_parameters", "rope_scaling"):
        r = c.get(field)
        kind = str(r.get("rope_type", r.get("type", "default"))) if isinstance(r, dict) else "default"
        if isinstance(r, dict) and kind != "default":
            return field, r, kind
    return None


def plain_rope_only(c: dict) -> tuple[str, bool, str]:
    """The `refuse` check of a family that has plain RoPE only."""
    scaled = scaled_rope(c)
    return (
        scaled[0] if scaled else "rope_scaling",
        scaled is None,
        f"rope type {scaled[2] if scaled else ''!r} (plain RoPE only)",
    )


def decoder_entries(cfg: Any, architecture: str, model_type: str, dtype: str, tied: bool = False) -> dict[str, Any]:
    """The config.json entries of a decoder's architecture, attention, norms and vocabulary, as transformers
    names them (a family adds its MLP and RoPE entries)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


@dataclass(frozen=True)
class NamesUnderModel:
    """The parameter names of a family whose modules are Hugging Face's own, without the "model." level
    (lm_head.weight as it is); `ours` matches every name the family has (ValueError for any other). Its methods
    are the family's HFAdapter.to_hf and from_hf (a class, not closures: specs travel to the ranks by pickle)."""

    ours: re.Pattern
    family: str

    def to_hf(self, name: str) -> str:
        """embed_tokens.weight -> model.embed_tokens.weight, ...; lm_head.weight stays."""
        if not self.ours.fullmatch(name):
            raise ValueError(f"parameter {name!r} has no Hugging Face {self.family} name")
        return name if name == "lm_head.weight" else f"model.{name}"

    def from_hf(self, name: str) -> str | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight":
            return name
        inner = name[len("model.") :]
        if not name.startswith("model.") or inner == "lm_head.weight" or not self.ours.fullmatch(inner):
            raise ValueError(
                f"unexpected parameter {name!r} in the Hugging Face checkpoint (not a {self.family} weight tessera "
                f"knows)"
            )
        return inner
