"""Model families, each one file with its spec (models/spec.py), registered by name: Llama, Qwen3, Qwen3-MoE,
DeepSeek-V3 and gpt-oss.

A family composes the blocks that live once here: the decoder (decoder.py), attention variants (attention.py),
MLPs (mlp.py), the mixture-of-experts block (moe.py), norms and RoPE (layers.py). Adding a family is one file
that subclasses `decoder.DecoderLM` with its blocks and names, builds and registers a `ModelSpec`
(`decoder.decoder_spec`), and its import line below.
"""

from . import llama  # noqa: F401  (registers the family)
from . import qwen3  # noqa: F401  (registers the family)
from . import qwen3_moe  # noqa: F401  (registers the family)
from . import deepseek_v3  # noqa: F401  (registers the family)
from . import gpt_oss  # noqa: F401  (registers the family)
from .init import init_parameters
from .llama import PRESETS, Llama, LlamaConfig, ModelConfig, Transformer
from .qwen3 import Qwen3, Qwen3Config
from .spec import (
    HFAdapter,
    ModelSpec,
    PipelineSplit,
    build_model,
    families,
    get_preset,
    get_spec,
    init_weights,
    register,
    spec_of,
)

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "ModelConfig",  # Llama's former names (models/llama.py)
    "Transformer",
    "build_model",
    "get_preset",
    "init_weights",
    "ModelSpec",
    "PipelineSplit",
    "HFAdapter",
    "register",
    "get_spec",
    "spec_of",
    "families",
    "init_parameters",
    "Qwen3",
    "Qwen3Config",
]
