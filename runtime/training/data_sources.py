"""Which stream a --data or --eval-data value names (token files, or an hf: data set), and its checks
before any rank starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.models.hf_data import HFStream, is_hf
from tessera.models.tokens import TokenFileStream

if TYPE_CHECKING:  # annotations only
    from .config import Config

FLAGS = {"path": "--data", "eval_data": "--eval-data"}


def open_data(config: Config, field: str, model_vocab: int | None = None) -> Any:
    """The stream of config.data's `field` (path or eval_data): an HFStream for hf:PATH, else token files."""
    d = config.data
    path = getattr(d, field)
    if is_hf(path):
        return HFStream(path, d.tokenizer, d.seq_len, d.global_batch, d.text_field, d.sft, model_vocab, FLAGS[field])
    return TokenFileStream(path, d.seq_len, d.global_batch, model_vocab, name=field)


def check_hf_data(config: Config, model_vocab: int) -> None:
    """The hf: flags go together, and each hf: data set opens and yields a first global batch: its split
    exists, its records hold the text field (or, with --sft, a conversation), its tokenizer fits the model."""
    d = config.data
    hf = [field for field in FLAGS if is_hf(getattr(d, field))]
    if not hf:
        given = [
            f
            for f, on in (("--tokenizer", d.tokenizer), ("--sft", d.sft), ("--text-field", d.text_field != "text"))
            if on
        ]
        if given:
            raise ValueError(f"{given[0]} applies to hf: data (--data hf:PATH[:split]); add it, or drop {given[0]}")
        return
    if d.sft and not is_hf(d.path):
        raise ValueError(f"--sft reads conversations from hf: data; --data {d.path or '(the shipped text)'} is not")
    for field in hf:
        open_data(config, field, model_vocab).next_global_batch()
