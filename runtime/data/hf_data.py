"""`--data hf:PATH[:split]`: a data set the Hugging Face `datasets` library reads from local files (JSONL,
Parquet, Arrow, a save_to_disk folder), streamed and tokenized on the fly with a `tokenizers` tokenizer.

The global stream is the data set's documents in order, each tokenized (its text field, or with --sft its
conversation rendered by runtime/data/chat.py) and ended by the separator token, then the next epoch's. Its
sequences are read as the token files' are (runtime/data/tokens.py): sequence n is stream tokens n*S .. n*S+S
(S+1 tokens: inputs and targets), step s reads sequences s*G .. s*G+G-1, and a dp rank keeps its rows.
Every rank reads the whole global batch, so the position is one global one: (epoch, documents consumed
in it, tokens consumed of the next), saved in the checkpoint; a resume on any layout skips that many
records (untokenized) and reads what the uninterrupted run would have. Only the documents a step needs
are read (the buffer holds one global batch and the document it ends in).

Nothing the data set or model folder holds runs as code: a loading script (.py) is refused, the
`datasets` builders used are its packaged readers (json, parquet, arrow), and a chat template renders in
jinja2's sandbox. Needs the data extra: pip install -e ".[data]" in the tessera clone.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor

from tessera.topology.errors import ConfigError  # the hierarchy's: a ValueError too

from tessera.data.chat import ChatRenderer
from tessera.data.corpus import IGNORE_INDEX

PREFIX = "hf:"
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
SEPARATORS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")  # as tessera tokenize picks one
EXTRA = 'pip install -e ".[data]" in the tessera clone'


def is_hf(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse_spec(spec: str) -> tuple[Path, str | None]:
    """hf:PATH[:split] -> (PATH, split or None); a PATH that exists whole wins over a split suffix."""
    rest = spec[len(PREFIX) :]
    head, sep, tail = rest.rpartition(":")
    if sep and head and tail and "/" not in tail and not Path(rest).exists():
        return Path(head), tail
    return Path(rest), None


def _datasets(name: str) -> Any:
    # tessera reads local data only: `datasets` and the hub in offline mode, so that nothing it is handed can
    # turn into a request (a path it does not take for a file reads as a hub name)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets  # lazy: the data extra, and slow to import: only runs that read hf: data pay for it
    except ImportError:
        raise ConfigError(f"{name}=hf:... needs the datasets library: {EXTRA}") from None
    datasets.config.HF_DATASETS_OFFLINE = True  # (imported before the variables were set: offline all the same)
    try:
        import huggingface_hub.constants as hub  # lazy: datasets' own dependency

        hub.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover - datasets requires it
        pass
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def refuse_scripts(path: Path, name: str) -> None:
    """A data set loading script runs code: refused by name, never handed to `datasets`."""
    scripts = [path] if path.suffix == ".py" else sorted(path.rglob("*.py")) if path.is_dir() else []
    if scripts:
        raise ConfigError(
            f"{name}=hf:{path}: {scripts[0]} is a data set loading script, which runs code (trust_remote_code); "
            f"tessera reads data files only: convert it to JSONL, Parquet or Arrow files"
        )


def open_records(path: Path, split: str | None, name: str) -> Any:
    """The data set's records as a `datasets` IterableDataset (streamed: read as iterated)."""
    if not path.exists():
        raise ConfigError(
            f"{name}=hf:{path}: no such file or directory (tessera reads local data sets only; nothing is downloaded)"
        )
    if not (path.is_file() or path.is_dir()):  # a FIFO or a device: datasets would take its name for the hub's
        raise ConfigError(
            f"{name}=hf:{path} is not a regular file or a directory (a pipe or a device); give a .jsonl, .parquet "
            f"or .arrow file, or a data set directory"
        )
    refuse_scripts(path, name)
    datasets = _datasets(name)
    where = f"{name}=hf:{path}"
    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            saved = datasets.load_from_disk(str(path))  # memory-mapped Arrow: iterating reads as it goes
            if isinstance(saved, datasets.DatasetDict):
                wanted = split or "train"
                if wanted not in saved:
                    raise ConfigError(f"{where}: no split {wanted!r}; its splits: {', '.join(saved)}")
                saved = saved[wanted]
            elif split is not None and split != str(saved.split or "train"):
                raise ConfigError(f"{where}: no split {split!r}; its split: {saved.split or 'train'}")
            return saved.to_iterable_dataset()
        if path.is_file():
            if path.stat().st_size == 0:
                raise ConfigError(f"{where} holds no records (an empty file)")
            builder = BUILDERS.get(path.suffix)
            if builder is None:
                raise ConfigError(f"{where}: a {path.suffix or 'suffix-less'} file; use .jsonl, .parquet or .arrow")
            if split not in (None, "train"):
                raise ConfigError(f"{where}: no split {split!r}; its split: train (one file)")
            return datasets.load_dataset(builder, data_files={"train": str(path)}, split="train", streaming=True)
        return datasets.load_dataset(str(path), split=split or "train", streaming=True)
    except ConfigError:
        raise
    except Exception as e:  # datasets raises its own and the readers' types; the first line says what
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "split" in text.lower():
            raise ConfigError(f"{where}: {text} (name one as hf:PATH:SPLIT)") from None
        raise ConfigError(f"{where}: datasets cannot read it ({text})") from None


def _special(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class HFTokenizer:
    """A tokenizer.json (or a model folder's), its chat template and special tokens, and the separator."""

    def __init__(self, spec: str | None, name: str = "path"):
        if not spec:
            raise ConfigError(f"{name}=hf:... needs `tokenizer` (a tokenizer.json or a Hugging Face model folder)")
        try:
            from tokenizers import Tokenizer  # lazy: the data extra
        except ImportError:
            raise ConfigError(f"{name}=hf:... needs the tokenizers library: {EXTRA}") from None
        path = Path(spec)
        folder = path if path.is_dir() else None
        file = path / "tokenizer.json" if folder else path
        if not file.is_file():
            raise ConfigError(
                f"tokenizer={spec}: {'no tokenizer.json in the folder' if folder else 'no such file'}; name a "
                f"tokenizer.json or a model folder holding one"
            )
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises its own Exception types for malformed files
            raise ConfigError(f"tokenizer={spec} is not a tokenizer.json ({str(e).splitlines()[0]})") from None
        self.path, self.vocab_size = str(file), self.tokenizer.get_vocab_size(with_added_tokens=True)
        config: dict[str, Any] = {}
        if folder and (folder / "tokenizer_config.json").is_file():
            try:
                config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"tokenizer={folder}: its tokenizer_config.json is not JSON ({e})") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and folder and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        self.chat_template: str | None = template if isinstance(template, str) else None
        # the special tokens transformers hands a chat template (its special_tokens_map)
        named = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
        self.specials = {k: v for k in named if (v := _special(config.get(k))) is not None}
        candidates = [self.specials.get("eos_token"), *SEPARATORS]
        self.separator_token = next((t for t in candidates if t and self.tokenizer.token_to_id(t) is not None), None)
        if self.separator_token is None:
            raise ConfigError(
                f"tokenizer={spec} has none of {', '.join(SEPARATORS)} (nor an eos_token in tokenizer_config.json) "
                f"to end each document; add one to the tokenizer"
            )
        separator = self.tokenizer.token_to_id(self.separator_token)
        assert separator is not None  # picked above among the tokens it has
        self.separator: int = separator


class HFStream:
    """Sequences of a streamed, tokenized data set (see the module docstring). Stateful: its position."""

    def __init__(
        self,
        spec: str,
        tokenizer: str | None,
        seq_len: int,
        global_batch: int,
        text_field: str = "text",
        sft: bool = False,
        model_vocab: int | None = None,
        name: str = "path",
    ):
        self.spec, self.name, self.text_field, self.sft = spec, name, text_field, sft
        self.path, self.split = parse_spec(spec)
        self.tok = HFTokenizer(tokenizer, name)
        self.vocab_size, self.separator = self.tok.vocab_size, self.tok.separator
        if model_vocab is not None and self.vocab_size > model_vocab:
            raise ConfigError(
                f"tokenizer={tokenizer}: its vocabulary of {self.vocab_size} exceeds the model's {model_vocab}; "
                f"add vocab_size={self.vocab_size} (or use the model the tokenizer belongs to)"
            )
        self.renderer = (
            ChatRenderer(self.tok.tokenizer, self.tok.chat_template, self.tok.specials, f"{name}={spec}")
            if sft
            else None
        )
        self.records = open_records(self.path, self.split, name)
        self.seq_len, self.global_batch = seq_len, global_batch
        self.cursor = 0  # sequences consumed (as the other streams count)
        # the buffer: documents (epoch, index, ids, keep) from the position on; `offset` tokens of the first consumed
        self.buffer: deque[tuple[int, int, np.ndarray, np.ndarray]] = deque()
        self.offset = 0
        self.next_doc = (0, 0)  # (epoch, index) of the next record to read
        self.documents_read = 0  # records pulled and tokenized by this process (the memory-flat test reads it)
        self._iterator: Iterator[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ reading
    def _iterate(self) -> Iterator[dict[str, Any]]:
        epoch, index = self.next_doc
        records = self.records.skip(index) if index else self.records  # skipped, never tokenized
        return iter(records)

    def _record(self) -> dict[str, Any]:
        if self._iterator is None:
            self._iterator = self._iterate()
        try:
            return self._next()
        except StopIteration:
            if self.next_doc[1] == 0:
                raise ConfigError(f"{self.name}={self.spec} holds no records") from None
            self.next_doc = (self.next_doc[0] + 1, 0)  # the next epoch, from the first record
            self._iterator = self._iterate()
            return self._next()

    def _next(self) -> dict[str, Any]:
        """The next record; a file the reader fails on part-way (a JSON line cut short, an unterminated string)
        as one line naming the flag and the file, not the reader's own words alone."""
        assert self._iterator is not None
        try:
            return next(self._iterator)
        except (StopIteration, ConfigError):
            raise
        except Exception as e:  # pyarrow's and datasets' own types
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            hint = " (each line of a .jsonl file is one JSON object: a line cut short or a string left open?)"
            raise ConfigError(
                f"{self.name}={self.spec}: cannot be read ({text})" + (hint if self.path.suffix == ".jsonl" else "")
            ) from None

    def encode(self, record: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        """A record's tokens with the separator appended, and which of them the loss keeps as targets."""
        if self.renderer is not None:
            ids, keep = self.renderer.encode(record, where)
        else:
            text = record.get(self.text_field)
            if not isinstance(text, str):
                fields = ", ".join(sorted(record)) or "none"
                raise ConfigError(
                    f"{where}: no text field {self.text_field!r} (its fields: {fields}); name it with `text_field`"
                    if text is None
                    else f"{where}: field {self.text_field!r} is {type(text).__name__}, not text"
                )
            ids, keep = self.tok.tokenizer.encode(text, add_special_tokens=False).ids, []
        tokens = np.asarray([*ids, self.separator], dtype=np.int64)
        kept = np.ones(len(tokens), dtype=bool) if self.renderer is None else np.asarray([*keep, True], dtype=bool)
        return tokens, kept

    def _pull(self) -> None:
        record = self._record()
        epoch, index = self.next_doc
        where = f"{self.name}={self.spec} record {index}"
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: not a record of fields")
        ids, keep = self.encode(record, where)
        self.buffer.append((epoch, index, ids, keep))
        self.next_doc = (epoch, index + 1)
        self.documents_read += 1

    def _buffered(self) -> int:
        return sum(len(d[2]) for d in self.buffer) - self.offset

    def read(self, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next `tokens` stream tokens from the position (not advancing): ids, keep, and document ends."""
        while self._buffered() < tokens:
            self._pull()
        ids = np.concatenate([d[2] for d in self.buffer])[self.offset : self.offset + tokens]
        keep = np.concatenate([d[3] for d in self.buffer])[self.offset : self.offset + tokens]
        return ids, keep, self._ends(tokens)

    def _ends(self, tokens: int) -> np.ndarray:
        ends = np.zeros(sum(len(d[2]) for d in self.buffer), dtype=bool)
        ends[np.cumsum([len(d[2]) for d in self.buffer]) - 1] = True  # each document's last token (its separator)
        return ends[self.offset : self.offset + tokens]

    def advance(self, tokens: int) -> None:
        self.offset += tokens
        while self.buffer and self.offset >= len(self.buffer[0][2]):
            self.offset -= len(self.buffer[0][2])
            self.buffer.popleft()

    def next_global_batch(self) -> tuple[Tensor, Tensor, Tensor]:
        """(inputs, targets with the masked ones IGNORE_INDEX, document ends of the inputs), each
        (global_batch, seq_len); advances the position by global_batch * seq_len tokens."""
        G, S = self.global_batch, self.seq_len
        ids, keep, ends = self.read(G * S + 1)
        rows = np.lib.stride_tricks.sliding_window_view(np.arange(G * S + 1), S + 1)[::S]  # row i: i*S .. i*S+S
        inputs, targets = torch.from_numpy(ids[rows[:, :-1]]), torch.from_numpy(ids[rows[:, 1:]])
        targets = targets.masked_fill(~torch.from_numpy(keep[rows[:, 1:]]), IGNORE_INDEX)
        self.advance(G * S)
        self.cursor += G
        return inputs, targets, torch.from_numpy(ends[rows[:, :-1]])

    # ------------------------------------------------------------------ Stateful
    @property
    def position(self) -> dict[str, int]:
        """The global position: the epoch, the records of it consumed, the tokens consumed of the next one."""
        epoch, index = (self.buffer[0][0], self.buffer[0][1]) if self.buffer else self.next_doc
        return {"epoch": epoch, "documents": index, "offset": self.offset}

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": "hf",
            "path": self.spec,
            "text_field": None if self.sft else self.text_field,
            "sft": self.sft,
            "vocab_size": self.vocab_size,
            "separator": self.separator,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "position": self.position,
            "data": self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("data")
        mine = self.fingerprint()
        if not isinstance(saved, dict) or saved.get("kind") != "hf":
            where = "the text shipped with tessera" if saved is None else f"token files ({saved.get('path')})"
            raise ConfigError(f"the checkpoint was trained on {where}, not on {self.name}={self.spec}: resume with it")
        differ = [k for k in mine if k != "path" and saved.get(k) != mine[k]]
        if differ:
            raise ConfigError(
                f"{self.name}={self.spec}: the checkpoint was trained on {saved.get('path')} with "
                + ", ".join(f"{k}={saved.get(k)!r}" for k in differ)
                + f" (this run: {', '.join(f'{k}={mine[k]!r}' for k in differ)}); resume with the same data"
            )
        position = state["position"]
        self.cursor = int(state["cursor"])
        self.buffer.clear()
        self.next_doc = (int(position["epoch"]), int(position["documents"]))
        self.offset = int(position["offset"])
        self._iterator = None
