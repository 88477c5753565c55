"""Token files: what `tessera tokenize` writes and `tessera train --data PATH` reads.

Format (version 1). A data set is one shard or a directory of shards. A shard is two files:
    NAME.bin    the token ids, little-endian uint16 (vocabularies up to 65,536) or uint32, back to back;
                documents are separated by the separator token
    NAME.json   {"format": "tessera-tokens", "version": 1, "dtype": "uint16" | "uint32",
                 "vocab_size": V, "separator": S, "tokens": N}
A directory's shards are read in the sorted order of their names, as one stream.

The stream is read as `models.data.TokenStream` reads the shipped text: step s with global batch G and
sequence length L reads sequences s*G .. s*G+G-1, sequence n starting at token (n * L) mod (N - L - 1).
The files are memory-mapped and a dp rank reads only its own rows; the only state is the cursor (the
sequences consumed), kept in the checkpoint, so a resume on any layout reads what the uninterrupted
run would have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import Tensor

from tessera.topology.errors import ConfigError  # the hierarchy's: a ValueError too

FORMAT, VERSION = "tessera-tokens", 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class Shard:
    path: Path  # the .bin file
    tokens: np.ndarray  # memory-mapped
    vocab_size: int
    separator: int


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def write_shard(path: str | Path, ids: Iterable[int] | np.ndarray, vocab_size: int, separator: int) -> Path:
    """Write NAME.bin and NAME.json for the ids (path: NAME or NAME.bin); returns the .bin path."""
    path = Path(path)
    path = path if path.suffix == ".bin" else path.with_suffix(".bin")
    dtype = dtype_for(vocab_size)
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        bad = int(array[(array < 0) | (array >= vocab_size)][0])
        raise ValueError(f"{path}: token id {bad} is outside the vocabulary of {vocab_size}")
    array.astype(np.dtype(DTYPES[dtype]).newbyteorder("<")).tofile(path)  # little-endian on any host
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "vocab_size": int(vocab_size),
        "separator": int(separator),
        "tokens": int(array.size),
    }
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    return path


def open_shard(path: Path) -> Shard:
    meta_path = path.with_suffix(".json")
    if not meta_path.exists():
        raise ValueError(
            f"{path}: no {meta_path.name} beside it (the shard's dtype, vocab_size, separator, tokens); "
            f"write token files with `tessera tokenize`"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: not JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"{meta_path}: cannot be read ({e.strerror})") from None
    if not isinstance(meta, dict):
        raise ValueError(
            f"{meta_path}: not a token shard's description (a JSON object); write token files with `tessera tokenize`"
        )
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r}; "
            f"tessera reads {FORMAT!r} version {VERSION}"
        )
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{meta_path}: dtype {meta.get('dtype')!r}; use uint16 or uint32")
    for field in ("vocab_size", "separator", "tokens"):
        value = meta.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if field == "vocab_size" else 0):
            raise ValueError(
                f"{meta_path}: field {field!r} is {value!r}, not a whole number"
                f"{' above 0' if field == 'vocab_size' else ' of 0 or more'} (a damaged file); "
                f"write the shard again with `tessera tokenize`"
            )
    itemsize = np.dtype(DTYPES[meta["dtype"]]).itemsize
    size, want = path.stat().st_size, meta["tokens"] * itemsize
    if size != want:
        raise ValueError(
            f"{path} is truncated or altered: {size} bytes, its {meta_path.name} says {meta['tokens']} "
            f"{meta['dtype']} tokens ({want} bytes)"
        )
    tokens = (
        np.memmap(path, dtype=np.dtype(DTYPES[meta["dtype"]]).newbyteorder("<"), mode="r")
        if size
        else np.zeros(0, np.uint16)
    )
    return Shard(path, tokens, meta["vocab_size"], meta["separator"])


def open_dataset(path: str | Path, name: str = "path") -> list[Shard]:
    path = Path(path)
    if path.is_dir():
        bins = sorted(p for p in path.glob("*.bin") if p.is_file())
        if not bins:
            raise ValueError(
                f"{name}={path}: the directory holds no .bin token files; write some with `tessera tokenize`"
            )
    elif path.exists():
        bins = [path]
    elif path.with_suffix(".bin").exists():
        bins = [path.with_suffix(".bin")]
    else:
        raise ValueError(f"{name}={path}: no such file or directory")
    shards = [open_shard(b) for b in bins]
    vocab = {s.vocab_size for s in shards}
    if len(vocab) > 1:
        raise ValueError(
            f"{name}={path}: its shards disagree on vocab_size ({sorted(vocab)}); tokenize them with one tokenizer"
        )
    return shards


class TokenFileStream:
    """Sequences of `seq_len + 1` tokens from memory-mapped token files (see the module docstring)."""

    def __init__(
        self, path: str | Path, seq_len: int, global_batch: int, model_vocab: int | None = None, name: str = "path"
    ):
        # `name`: the parameter that gave the path, which the messages name (eval_data for held-out files)
        self.path, self.name, self.shards = str(path), name, open_dataset(path, name)
        self.vocab_size = self.shards[0].vocab_size
        separators = {s.separator for s in self.shards}
        if len(separators) > 1:
            raise ValueError(
                f"{self.name}={path}: its shards disagree on the separator token ({sorted(separators)}); "
                f"tokenize them with one separator (tessera tokenize --separator)"
            )
        self.separator = self.shards[0].separator  # ends each document (--pack-documents)
        if model_vocab is not None and self.vocab_size > model_vocab:
            raise ValueError(
                f"{self.name}={path}: its vocab_size {self.vocab_size} exceeds the model's {model_vocab}; "
                f"use a model whose vocabulary holds the tokenizer's"
            )
        self.starts = np.cumsum([0] + [len(s.tokens) for s in self.shards])
        self.total = int(self.starts[-1])
        self.seq_len, self.global_batch = seq_len, global_batch
        self.span = self.total - seq_len - 1
        if self.span <= 0:
            raise ValueError(
                f"{self.name}={path} holds {self.total} tokens, too few for seq_len={seq_len}; use a shorter "
                f"sequence or more data"
            )
        self.cursor = 0

    def _tokens(self, start: int, length: int) -> np.ndarray:
        out, pos = [], start
        while length > 0:
            i = int(np.searchsorted(self.starts, pos, side="right")) - 1
            shard = self.shards[i]
            offset = pos - int(self.starts[i])
            take = min(length, len(shard.tokens) - offset)
            out.append(np.asarray(shard.tokens[offset : offset + take], dtype=np.int64))
            pos, length = pos + take, length - take
        return np.concatenate(out)

    def rows_at(self, cursor: int, rows: range) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of the global batch's `rows` at sequence number `cursor`."""
        seqs = []
        for i in rows:
            start = ((cursor + i) * self.seq_len) % self.span
            seq = self._tokens(start, self.seq_len + 1)
            if seq.max(initial=0) >= self.vocab_size:
                raise ConfigError(
                    f"{self.name}={self.path}: token id {int(seq.max())} near token {start} is outside the "
                    f"vocabulary of {self.vocab_size} (a damaged file)"
                )
            seqs.append(seq)
        batch = torch.from_numpy(np.stack(seqs)) if seqs else torch.empty(0, self.seq_len + 1, dtype=torch.long)
        return batch[:, :-1], batch[:, 1:]

    def global_batch_at(self, cursor: int) -> tuple[Tensor, Tensor]:
        return self.rows_at(cursor, range(self.global_batch))

    def next_local_batch(self, dp_index: int, dp_size: int) -> tuple[Tensor, Tensor, int]:
        """This dp rank's rows of the next global batch, and the global number of targets (every target of
        packed token data counts); advances the cursor."""
        rows = self.global_batch // dp_size
        batch = self.rows_at(self.cursor, range(dp_index * rows, (dp_index + 1) * rows))
        self.cursor += self.global_batch
        return (*batch, self.global_batch * self.seq_len)

    def next_global_batch(self) -> tuple[Tensor, Tensor]:
        batch = self.global_batch_at(self.cursor)
        self.cursor += self.global_batch
        return batch

    def fingerprint(self) -> dict:
        return {"path": self.path, "tokens": self.total, "vocab_size": self.vocab_size}

    def state_dict(self) -> dict:
        return {
            "cursor": self.cursor,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "data": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("data")
        if saved is None:
            raise ConfigError(
                f"the checkpoint was trained on the text shipped with tessera, not on {self.name}={self.path}; "
                f"resume without it, or start a new run"
            )
        if saved.get("tokens") != self.total:
            raise ConfigError(
                f"{self.name}={self.path} holds {self.total} tokens; the checkpoint was trained on "
                f"{saved.get('path')} with {saved.get('tokens')}: resume with the same data"
            )
        self.cursor = int(state["cursor"])
