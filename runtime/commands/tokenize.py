"""`tessera tokenize`: text or JSONL files to token files (runtime/data/tokens.py) with a tokenizer.json.

The user provides the tokenizer file (Hugging Face `tokenizers` format); nothing is downloaded. A .txt
file is one document; a .jsonl file holds one document per line, in the field `--field` (default
"text"). Documents are joined with the separator token (`--separator`, default the tokenizer's first
of <|end_of_text|>, <|endoftext|>, </s>, <eos>) and written in shards of up to `--shard-tokens` tokens.
Needs the `data` extra: pip install -e ".[data]" in the tessera clone (tokenizers, tqdm).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from tessera.data.tokens import write_shard
from tessera.paths import check_writable_dir

SEPARATORS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


def _not_utf8(where: str, e: UnicodeDecodeError) -> ValueError:
    return ValueError(
        f"{where}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); tokenize text "
        f"(.txt) or JSONL files, saved as UTF-8"
    )


def documents(files: list[str], field: str) -> Iterator[str]:
    for name in files:
        path = Path(name)
        try:
            if path.suffix == ".jsonl":
                with open(path, "rb") as f:
                    for lineno, raw in enumerate(f, 1):
                        try:
                            line = raw.decode("utf-8")
                        except UnicodeDecodeError as e:
                            raise _not_utf8(f"{path}:{lineno}", e) from None
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
                try:
                    yield path.read_bytes().decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _not_utf8(str(path), e) from None
        except OSError as e:
            raise ValueError(f"{path}: cannot be read ({e.strerror})") from None


def check_input_file(flag: str, name: str) -> None:
    """A file to read: ValueError naming it (and `flag`, when it is an option's) unless it is a readable file."""
    said = f"{flag} {name}" if flag else name
    path = Path(name)
    if not name:
        raise ValueError(
            f"{flag} '' is an empty file name; name a file"
            if flag
            else "an input file is named '' (empty); name the .txt or .jsonl files to read"
        )
    if path.is_dir():
        raise ValueError(
            f"{said} is a directory; name a file in it"
            if flag
            else f"{said} is a directory; name the files in it (e.g. {name.rstrip('/') or '/'}/*.txt: the "
            f"shell expands it)"
        )
    if not path.is_file():
        raise ValueError(f"{said}: no such file" if not path.exists() else f"{said} is not a regular file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{said} is not readable (permission denied)")


def check_out_dir(flag: str, name: str) -> Path:
    """Create the output directory `name` of option `flag` if needed; ValueError naming it and the fix if it
    cannot be created or written (never a bare OSError)."""
    if not name:
        raise ValueError(f"{flag} '' is an empty path; name the directory to write into")
    path = Path(name)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {name} is a file, not a directory; name a directory (it is created if missing)")
    blocker = next((p for p in path.absolute().parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ValueError(f"{flag} {name}: {blocker} is a file, not a directory; name a directory elsewhere")
    check_writable_dir(flag, name)  # created, then a file written and removed in it
    return path


def tokenize(
    tokenizer_file: str,
    out: str,
    files: list[str],
    separator: str | None = None,
    field: str = "text",
    shard_tokens: int = 100_000_000,
    progress: bool = True,
) -> list[Path]:
    """Write the token files; returns the .bin paths. ValueError naming the file for bad input."""
    try:
        from tokenizers import Tokenizer  # lazy: tokenizers is optional (the data extra)
    except ImportError:
        raise ValueError(
            'tessera tokenize needs the tokenizers library: pip install -e ".[data]" in the tessera clone'
        ) from None
    check_input_file("--tokenizer", tokenizer_file)
    for name in files:
        check_input_file("", name)
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
            raise ValueError(
                f"--tokenizer {tokenizer_file} has none of {', '.join(SEPARATORS)}; name the document "
                f"separator with --separator TOKEN"
            )
    sep_id = tok.token_to_id(separator)
    if sep_id is None:
        raise ValueError(f"--separator {separator!r} is not a token of {tokenizer_file}")
    out_dir = check_out_dir("--out", out)
    docs = documents(files, field)
    if progress:
        try:
            from tqdm import tqdm  # lazy: tqdm is optional (the data extra): no bar without it

            docs = tqdm(docs, unit=" docs", desc=f"tokenize {len(files)} file(s)")
        except ImportError:
            pass  # tqdm is optional: no bar
    written: list[Path] = []
    buffer: list[int] = []
    try:
        for text in docs:
            buffer.extend(tok.encode(text, add_special_tokens=False).ids)
            buffer.append(sep_id)
            while len(buffer) >= shard_tokens:
                written.append(write_shard(out_dir / f"shard_{len(written):05d}", buffer[:shard_tokens], vocab, sep_id))
                buffer = buffer[shard_tokens:]
        if buffer or not written:
            written.append(write_shard(out_dir / f"shard_{len(written):05d}", buffer, vocab, sep_id))
    except OSError as e:  # the input's read errors are ValueErrors already (documents): this is a write
        raise ValueError(
            f"--out {out}: writing {e.filename or 'a shard'} failed ({e.strerror}); free space or choose "
            f"another directory"
        ) from None
    return written
