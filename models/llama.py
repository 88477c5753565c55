"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, untied output head.

The model knows nothing of parallelism. `tessera.parallel.parallelize` makes it mesh-parallel by
swapping its linear layers and norms for the parallel layers of `parallel/tensor.py`, setting the
`input_comm` hooks and (context parallel) the attention `core` slot below; the forward code here is
the same on every layout. Head counts come from the tensors' shapes, never from attributes set from
outside. A pipeline stage is this model with some parts set to None: without `tok_embeddings` the input
is the previous stage's hidden states, without `norm`/`output` the output is hidden states. The loss is
`tessera.parallel.loss`'s: on the logits forward returns, or, given targets, inside the fused output head
that `apply_loss_head` swaps in (never the full logits). Parameter names follow Meta's Llama checkpoints
(tok_embeddings, layers.N.attention.wq, ..., norm, output), and a stage keeps the one-process names.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.topology.shapes import ModelShape

from .init import ONES
from .layers import CausalAttention, RMSNorm, Rotary
from .spec import HFAdapter, ModelSpec, PipelineSplit, get_preset, register


@dataclass(frozen=True)
class ModelConfig:
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
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

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


BYTE_VOCAB = 258  # 256 byte values + BOS + EOS (the byte-level tokenizer of models.data)

PRESETS: dict[str, ModelConfig] = {
    # runs on a laptop CPU in seconds; heads/kv/ffn divide tp in {1, 2, 4}, vocab 258 exercises padding
    "debug": ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTE_VOCAB, ffn_dim=192, max_seq_len=2048
    ),
    "small": ModelConfig(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=BYTE_VOCAB, ffn_dim=768, max_seq_len=4096
    ),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192),
    # the published Llama 3 / 3.1 shapes
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336),
    "70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672),
    "405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        # identity on one process; copy-to-tp or sequence all-gather once the block is tensor parallel
        self.input_comm: nn.Module = nn.Identity()
        self.core: nn.Module = CausalAttention()

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        x = self.input_comm(x)
        B, S, _ = x.shape
        # heads from the shapes: a tensor-parallel rank holds n_heads / tp of them
        q = self.wq(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions), rope(k, positions)
        o = self.core(q, k, v, positions)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.input_comm: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.input_comm(x)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, rope: Rotary, positions: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(
        self, inputs: Tensor, positions: Tensor | None = None, targets: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """tokens (B, S) -> logits (B, S, V): the local vocab shard (and sequence shard) when parallel.

        A stage without `tok_embeddings` takes hidden states (B, S, dim) instead of tokens; one without
        `output` returns hidden states. `positions` (S,) are the tokens' global positions (default
        0..S-1); a context-parallel rank passes those of the chunks it holds. With `targets` (B, S) the
        output module computes the loss itself and (loss sum over valid targets, their count) is returned
        instead of logits: that needs the fused head that `tessera.parallel.loss.apply_loss_head` installs
        (parallelize does, with --loss chunked), which never materializes the full logits."""
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        h = self.tok_embeddings(inputs) if self.tok_embeddings is not None else inputs
        for layer in self.layers.values():
            h = layer(h, self.rope, positions)
        if self.norm is not None:
            h = self.norm(h)
        if targets is None:
            return self.output(h) if self.output is not None else h
        if self.output is None:
            raise ValueError(
                "targets given to a model part without the output head (a pipeline stage before the "
                "last): pass targets to the last stage only"
            )
        if not getattr(self.output, "takes_targets", False):
            raise TypeError(
                f"Transformer.forward(targets=...) needs the fused loss head, and `output` is a "
                f"{type(self.output).__name__}: install it with tessera.parallel.loss.apply_loss_head(model) "
                f"(parallelize does, with loss=chunked), or call model(inputs) and a loss on the logits"
            )
        return self.output(h, targets)


def param_init_std(name: str, cfg: ModelConfig) -> float | str:
    """The truncated-normal std of a parameter (ONES: the norms). Output projections (wo, w2) are
    scaled by 1/sqrt(2 * n_layers)."""
    if name.endswith("norm.weight"):
        return ONES
    return cfg.init_std * (1.0 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0)


def model_shape(cfg: ModelConfig) -> ModelShape:
    return ModelShape(
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        ffn_dim=cfg.ffn_dim,
        family="llama",
        max_seq_len=cfg.max_seq_len,
    )


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


def read_hf_config(c: dict, path: str) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json's contents; ValueError naming the file and the field for
    what tessera's Llama cannot represent."""
    # RoPE: transformers 5.x writes rope_parameters, 4.x rope_scaling; the first that is not plain decides
    candidates = [r for r in (c.get("rope_parameters"), c.get("rope_scaling")) if isinstance(r, dict)]
    kinds = [r.get("rope_type", r.get("type", "default")) for r in candidates]
    rope, rope_kind = next(((r, k) for r, k in zip(candidates, kinds) if k != "default"), ({}, "default"))
    arch = c.get("architectures") or [c.get("model_type")]
    if c.get("model_type") != "llama" or arch[0] not in ("LlamaForCausalLM", "llama"):
        raise ValueError(
            f"{path}: architecture {arch[0]!r} (model_type {c.get('model_type')!r}) is not supported; "
            f"tessera loads LlamaForCausalLM checkpoints"
        )
    for field, ok, why in (
        ("tie_word_embeddings", not c.get("tie_word_embeddings", False), "tied embeddings (tessera's head is untied)"),
        (
            "hidden_act",
            c.get("hidden_act", "silu") == "silu",
            f"activation {c.get('hidden_act')!r} (tessera's MLP is SwiGLU)",
        ),
        ("attention_bias", not c.get("attention_bias", False), "biases in attention"),
        ("mlp_bias", not c.get("mlp_bias", False), "biases in the MLP"),
        (
            "rope_scaling",
            rope_kind in ("default", "llama3"),
            f"rope type {rope_kind!r} (default and llama3 are implemented)",
        ),
    ):
        if not ok:
            raise ValueError(f"{path}: {field}: {why} is not supported")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise ValueError(
            f"{path}: head_dim {c['head_dim']} differs from hidden_size / num_attention_heads "
            f"({c['hidden_size']} / {heads}); not supported"
        )
    return ModelConfig(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads,
        vocab_size=c["vocab_size"],
        ffn_dim=c["intermediate_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        rope_theta=float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))),
        max_seq_len=int(c.get("max_position_embeddings", 8192)),
        rope_scaling=None
        if rope_kind == "default"
        else tuple(
            sorted(
                (k, float(rope[k]))
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            )
        ),
    )


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "vocab_size": cfg.vocab_size,
        "intermediate_size": cfg.ffn_dim,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": cfg.head_dim,
        "torch_dtype": dtype,
        "dtype": dtype,
        # transformers 4.x reads rope_theta, 5.x rope_parameters
        "rope_parameters": {
            "rope_theta": cfg.rope_theta,
            "rope_type": "llama3" if cfg.rope_scaling else "default",
            **dict(cfg.rope_scaling or ()),
        },
        "rope_scaling": {"rope_type": "llama3", **dict(cfg.rope_scaling)} if cfg.rope_scaling else None,
    }


LLAMA = register(
    ModelSpec(
        name="llama",
        config_type=ModelConfig,
        build=Transformer,
        init_std=param_init_std,
        shape=model_shape,
        tp_plan=(
            ("tok_embeddings", "embedding"),
            ("layers.*.attention", "block_input"),
            ("layers.*.attention.wq", "colwise"),
            ("layers.*.attention.wk", "kv"),
            ("layers.*.attention.wv", "kv"),
            ("layers.*.attention.wo", "rowwise"),
            ("layers.*.feed_forward", "block_input"),
            ("layers.*.feed_forward.w[13]", "colwise"),
            ("layers.*.feed_forward.w2", "rowwise"),
            ("layers.*.attention_norm", "norm"),
            ("layers.*.ffn_norm", "norm"),
            ("norm", "norm"),
            # the logits stay split over the vocabulary: tessera.parallel.loss reads them so
            ("output", "colwise_gather"),
        ),
        blocks="layers.*",
        pipeline=PipelineSplit(first=("tok_embeddings",), blocks="layers", last=("norm", "output")),
        attention="layers.*.attention.core",
        head="output",
        presets=PRESETS,
        hf=HFAdapter(
            model_type="llama",
            architecture="LlamaForCausalLM",
            read_config=read_hf_config,
            config_dict=hf_config_dict,
            to_hf=tessera_to_hf_name,
            from_hf=hf_to_tessera_name,
        ),
    )
)


def build_model(cfg: ModelConfig | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Transformer:
    """Build the one-process model on `device` and initialize it from `seed`; on "meta" nothing is
    allocated (parallelize it, `to_empty` on the real device, then `init_weights`)."""
    model = LLAMA.build_model(get_preset(cfg) if isinstance(cfg, str) else cfg, device, seed)
    if not isinstance(model, Transformer):
        raise TypeError(f"the llama spec built a {type(model).__name__}, not a Transformer")
    return model
