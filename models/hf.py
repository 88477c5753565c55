"""Hugging Face Llama checkpoints in and out: config.json <-> ModelConfig, HF parameter names <-> tessera's.

HF's Llama applies RoPE with `rotate_half` (dimension i pairs with i + D/2), which is tessera's layout, so
the q and k weights map over unchanged (Meta's original checkpoints interleave pairs; HF's conversion
script permutes them, and HF checkpoints are what this reads). Supported: LlamaForCausalLM with SiLU MLPs,
no biases, untied embeddings, head_dim = hidden / heads, plain RoPE or Llama 3.1's "llama3" scaling
(other RoPE types are refused by name). Both config.json dialects are read: rope_theta at the top (transformers
4.x) or in rope_parameters (5.x). A rank reads only its own block of each parameter from the memory-mapped
safetensors files (a parameter sharded in strides, FSDP over tp, is read whole, one at a time); no
process ever holds the full state dict.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .llama import ModelConfig

_LAYER = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
}
_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}


def hf_to_tessera_name(name: str) -> str:
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


# ----------------------------------------------------------------------------- config.json
def read_hf_config(directory: str | os.PathLike) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json; ValueError naming the file and the field for what
    tessera's Llama cannot represent."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"--init-from-hf {directory}: no config.json in it (a Hugging Face model directory)")
    try:
        c = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    # RoPE: transformers 5.x writes rope_parameters, 4.x rope_scaling; the first that is not plain decides
    candidates = [r for r in (c.get("rope_parameters"), c.get("rope_scaling")) if isinstance(r, dict)]
    kinds = [r.get("rope_type", r.get("type", "default")) for r in candidates]
    rope, rope_kind = next(((r, k) for r, k in zip(candidates, kinds) if k != "default"), ({}, "default"))
    arch = c.get("architectures") or [c.get("model_type")]
    if c.get("model_type") != "llama" or arch[0] not in ("LlamaForCausalLM", "llama"):
        raise ValueError(f"{path}: architecture {arch[0]!r} (model_type {c.get('model_type')!r}) is not supported; "
                         f"tessera loads LlamaForCausalLM checkpoints")
    for field, ok, why in (
        ("tie_word_embeddings", not c.get("tie_word_embeddings", False), "tied embeddings (tessera's head is untied)"),
        ("hidden_act", c.get("hidden_act", "silu") == "silu", f"activation {c.get('hidden_act')!r} (tessera's MLP is SwiGLU)"),
        ("attention_bias", not c.get("attention_bias", False), "biases in attention"),
        ("mlp_bias", not c.get("mlp_bias", False), "biases in the MLP"),
        ("rope_scaling", rope_kind in ("default", "llama3"), f"rope type {rope_kind!r} (default and llama3 are implemented)"),
    ):
        if not ok:
            raise ValueError(f"{path}: {field}: {why} is not supported")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise ValueError(f"{path}: head_dim {c['head_dim']} differs from hidden_size / num_attention_heads "
                         f"({c['hidden_size']} / {heads}); not supported")
    return ModelConfig(
        dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads, vocab_size=c["vocab_size"], ffn_dim=c["intermediate_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-5)), rope_theta=float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))),
        max_seq_len=int(c.get("max_position_embeddings", 8192)),
        rope_scaling=None if rope_kind == "default" else {k: rope[k] for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")},
    )


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "vocab_size": cfg.vocab_size, "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "head_dim": cfg.head_dim,
        "torch_dtype": dtype, "dtype": dtype,
        # transformers 4.x reads rope_theta, 5.x rope_parameters
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "llama3" if cfg.rope_scaling else "default",
                            **dict(cfg.rope_scaling or ())},
        "rope_scaling": {"rope_type": "llama3", **dict(cfg.rope_scaling)} if cfg.rope_scaling else None,
    }


def compare_with_preset(hf: ModelConfig, preset: ModelConfig, preset_name: str) -> None:
    differ = [f"{k} {getattr(hf, k)} vs {getattr(preset, k)}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads",
              "vocab_size", "ffn_dim") if getattr(hf, k) != getattr(preset, k)]
    if differ:
        raise ValueError(f"--model {preset_name} does not match the Hugging Face config.json ({'; '.join(differ)}); "
                         f"drop --model: the config is read from config.json")


# ----------------------------------------------------------------------------- weights
def _open_each(files: dict[str, Path], stack: contextlib.ExitStack) -> dict[Path, Any]:
    """One memory-mapped safe_open handle per shard file (not one per tensor), closed with `stack`."""
    from safetensors import safe_open

    return {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(files.values())}


def weight_files(directory: str | os.PathLike) -> dict[str, Path]:
    """HF parameter name -> the safetensors file that holds it (sharded with an index, or one file)."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        return {name: d / file for name, file in mapping.items()}
    single = d / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ValueError(f"{d}: no model.safetensors or model.safetensors.index.json (pytorch_model.bin pickles are "
                     f"not read: they can run code)")


def check_hf_weights(directory: str | os.PathLike, cfg: ModelConfig) -> None:
    """Every tessera parameter is in the files with its shape; ValueError naming the file and the tensor."""
    from .llama import build_model

    files = weight_files(directory)
    want = {n: tuple(p.shape) for n, p in build_model(cfg, device="meta").named_parameters()}
    ours = {}
    for hf_name, file in files.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        ours[hf_to_tessera_name(hf_name)] = (hf_name, file)
    missing = sorted(set(want) - set(ours))
    if missing:
        raise ValueError(f"{directory}: the checkpoint lacks {tessera_to_hf_name(missing[0])} (and {len(missing) - 1} more)")
    with contextlib.ExitStack() as stack:
        handles = _open_each(files, stack)
        for name, (hf_name, file) in ours.items():
            shape = tuple(handles[file].get_slice(hf_name).get_shape())
            if shape != want.get(name, shape):
                raise ValueError(f"{file}: {hf_name} has shape {list(shape)}, config.json implies {list(want[name])}")


@torch.no_grad()
def load_hf_weights(part: nn.Module, directory: str | os.PathLike) -> None:
    """Fill a (parallelized, materialized) model or pipeline stage with the HF checkpoint's weights. A
    parameter sharded in blocks (tp, or FSDP alone) is read as just this rank's block of the memory-mapped
    file; one sharded in strides (FSDP over tp) is read whole, one parameter at a time, and cut locally."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    files = weight_files(directory)
    with contextlib.ExitStack() as stack:
        handles = _open_each(files, stack)
        for name, p in part.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "")
            hf_name = tessera_to_hf_name(name)
            if hf_name not in files:
                raise ValueError(f"{directory}: the checkpoint lacks {hf_name}")
            f = handles[files[hf_name]]
            if isinstance(p, DTensor) and all(type(pl) in (Shard, Replicate) for pl in p.placements):
                # a block of the global tensor: read just that block from the memory-mapped file
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                block = f.get_slice(hf_name)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
                p.to_local().copy_(block.to(p.dtype))
            elif isinstance(p, DTensor):  # strided shards (FSDP over tp): the whole parameter, then this rank's part
                full = f.get_tensor(hf_name).to(p.dtype)
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(f.get_tensor(hf_name).to(p.dtype))


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, directory: str | os.PathLike) -> None:
    """Write a Hugging Face Llama directory (config.json, model.safetensors) from a full tessera state dict."""
    from tessera.parallel.safe_io import write_safetensors

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {tessera_to_hf_name(n): t for n, t in state.items() if not n.endswith(("rotary.cos", "rotary.sin"))}
    dtype = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    write_safetensors(tensors, d / "model.safetensors", {"format": "pt"})
    (d / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=1))
