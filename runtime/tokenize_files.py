"""`tessera tokenize`: text or JSONL files to token files (models/tokens.py) with a tokenizer.json.

The user provides the tokenizer file (Hugging Face `tokenizers` format); nothing is downloaded. A .txt
file is one document; a .jsonl file holds one document per line, in the field `--field` (default
"text"). Documents are joined with the separator token (`--separator`, default the tokenizer's first
of <|end_of_text|>, <|endoftext|>, </s>, <eos>) and written in shards of up to `--shard-tokens` tokens.
Needs the `data` extra: pip install "tessera-4d[data]" (tokenizers, tqdm).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from tessera.models.tokens import write_shard

SEPARATORS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


def documents(files: list[str], field: str) -> Iterator[str]:
    for name in files:
        path = Path(name)
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
                    if not isinstance(record, dict) or not isinstance(record.get(field), str):
                        raise ValueError(f"{path}:{lineno}: no string field {field!r}; pass --field NAME")
                    yield record[field]
        else:
            yield path.read_text(encoding="utf-8")


def tokenize(tokenizer_file: str, out: str, files: list[str], separator: str | None = None, field: str = "text",
             shard_tokens: int = 100_000_000, progress: bool = True) -> list[Path]:
    """Write the token files; returns the .bin paths. ValueError naming the file for bad input."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError('tessera tokenize needs the tokenizers library: pip install "tessera-4d[data]"') from None
    if not Path(tokenizer_file).is_file():
        raise ValueError(f"--tokenizer {tokenizer_file}: no such file")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise ValueError(f"{missing[0]}: no such file")
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens} must be positive")
    try:
        tok = Tokenizer.from_file(tokenizer_file)
    except Exception as e:  # the library raises its own Exception types for malformed files
        raise ValueError(f"--tokenizer {tokenizer_file} is not a tokenizer.json ({str(e).splitlines()[0]})") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if separator is None:
        separator = next((s for s in SEPARATORS if tok.token_to_id(s) is not None), None)
        if separator is None:
            raise ValueError(f"--tokenizer {tokenizer_file} has none of {', '.join(SEPARATORS)}; name the document "
                             f"separator with --separator TOKEN")
    sep_id = tok.token_to_id(separator)
    if sep_id is None:
        raise ValueError(f"--separator {separator!r} is not a token of {tokenizer_file}")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = documents(files, field)
    if progress:
        try:
            from tqdm import tqdm

            docs = tqdm(docs, unit=" docs", desc=f"tokenize {len(files)} file(s)")
        except ImportError:
            pass  # tqdm is optional: no bar
    written, buffer = [], []
    for text in docs:
        buffer.extend(tok.encode(text, add_special_tokens=False).ids)
        buffer.append(sep_id)
        while len(buffer) >= shard_tokens:
            written.append(write_shard(out_dir / f"shard_{len(written):05d}", buffer[:shard_tokens], vocab, sep_id))
            buffer = buffer[shard_tokens:]
    if buffer or not written:
        written.append(write_shard(out_dir / f"shard_{len(written):05d}", buffer, vocab, sep_id))
    return written
