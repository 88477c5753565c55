"""A Llama-style decoder and its size presets, and the deterministic token stream."""

from .llama import PRESETS, ModelConfig, Transformer, build_model, get_preset, init_weights

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "get_preset", "init_weights"]
