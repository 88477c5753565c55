"""Which stream the config's data section names for --data or --eval-data (token files from tessera.data.tokens,
or an hf: data set from tessera.data.hf_data), and its checks before any rank starts."""

from __future__ import annotations

import warnings
from typing import Any

from tessera.data.hf_data import HFStream, is_hf
from tessera.data.tokens import TokenFileStream
from tessera.checkpointing import checkpoint

from .sections import DataSection

FIELDS = ("path", "eval_data")  # the config fields that may name hf: data


def open_data(d: DataSection, field: str, model_vocab: int | None = None) -> Any:
    """The stream of the data section's `field` (path or eval_data): an HFStream for hf:PATH, else token files."""
    path = getattr(d, field)
    if is_hf(path):
        return HFStream(path, d.tokenizer, d.seq_len, d.global_batch, d.text_field, d.sft, model_vocab, field)
    return TokenFileStream(path, d.seq_len, d.global_batch, model_vocab, name=field)


def check_hf_data(d: DataSection, model_vocab: int, resume: str | None) -> None:
    """The hf: flags go together, and each hf: data set opens and yields a first global batch: its split
    exists, its records hold the text field (or, with --sft, a conversation), its tokenizer fits the model.
    `resume`: the checkpoint path a --resume names (None when not resuming)."""
    hf = [field for field in FIELDS if is_hf(getattr(d, field))]
    if not hf:
        given = [
            f
            for f, on in (("--tokenizer", d.tokenizer), ("--sft", d.sft), ("--text-field", d.text_field != "text"))
            if on
        ]
        if given:
            raise ValueError(f"{given[0]} applies to hf: data (--data hf:PATH[:split]); add it, or drop {given[0]}")
    if d.sft and not is_hf(d.path):
        raise ValueError(f"--sft reads conversations from hf: data; --data {d.path or '(the shipped text)'} is not")
    for field in hf:
        open_data(d, field, model_vocab).next_global_batch()
    check_resumed_data(d, model_vocab, resume)


def check_resumed_data(d: DataSection, model_vocab: int, resume: str | None) -> None:
    """A resume reads the data its checkpoint was trained on: an hf: checkpoint resumes on hf: data whose
    position it restores here (the same text field, --sft, tokenizer and separator), and only there."""
    if resume is None:
        return
    with warnings.catch_warnings():  # a fallback to an older checkpoint is announced by run.train
        warnings.simplefilter("ignore")
        path = checkpoint.resolve(resume)
    state = checkpoint.read_manifest(path).get("data") or {}
    saved = state.get("data")
    was_hf = isinstance(saved, dict) and saved.get("kind") == "hf"
    if was_hf != is_hf(d.path):
        if was_hf and isinstance(saved, dict):
            raise ValueError(
                f"checkpoint {path} was trained on {saved['path']}, and this run reads "
                f"{d.path or 'the shipped text'}: resume with --data {saved['path']}"
            )
        trained = f"token files ({saved.get('path')})" if isinstance(saved, dict) else "the shipped text"
        raise ValueError(f"checkpoint {path} was trained on {trained}, not on hf: data: resume with that data")
    if was_hf:
        open_data(d, "path", model_vocab).load_state_dict(state)  # the same data set, at its position
