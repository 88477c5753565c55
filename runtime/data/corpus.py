"""A deterministic token stream from the text shipped with tessera, with a byte-level tokenizer, and the
packing of documents into sequences (`pack_documents`).

Step s of a run with global batch G and sequence length S reads sequences s*G .. s*G+G-1 of the stream;
sequence n starts at token (n * S) mod (len - S - 1). The dp rank d of D reads rows d*G/D .. (d+1)*G/D - 1
of the global batch. The only state is the number of sequences consumed (the data cursor), so a resumed
run on any layout reads exactly what the uninterrupted run would have read.
"""

from __future__ import annotations

from importlib import resources

import torch
from torch import Tensor

from tessera.topology.errors import ConfigError  # the hierarchy's: a ValueError too

from tessera.models.spec import BOS, BYTE_VOCAB, EOS  # noqa: F401  (the byte vocabulary the families' presets name)


def encode(text: str) -> list[int]:
    return [BOS] + list(text.encode("utf-8")) + [EOS]


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def corpus_tokens(documents: bool = False) -> Tensor:
    """The shipped text as one document (BOS text EOS), or with `documents` as its paragraphs, each one a
    document ended by EOS (what --pack-documents trains on without --data)."""
    text = resources.files("tessera.models").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    if not documents:
        return torch.tensor(encode(text), dtype=torch.long)
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    return torch.tensor([t for p in paragraphs for t in list(p.encode("utf-8")) + [EOS]], dtype=torch.long)


IGNORE_INDEX = -100  # a target the loss skips (tessera.parallel.loss uses the same value)


def pack_documents(
    inputs: Tensor, targets: Tensor, separator: int, ends: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Sequences of packed documents, each ended by the `separator` token: (targets, positions).
    `ends` (B, S), when the stream knows where its documents end (an hf: stream), marks them instead of
    the separator token (a chat template may use that token inside an example).

    A document runs from a row's start or the token after a separator to the next separator (included) or
    the row's end, so a document longer than a row is cut, and each piece is a document of its row.
    positions (B, S) restart at 0 at each document (RoPE, and the attention mask: a token sees only its
    own document, tessera.kernels.document_ids). The target of a separator is the next document's first
    token: it is set to IGNORE_INDEX, out of the loss."""
    ends = inputs == separator if ends is None else ends
    B, S = inputs.shape
    index = torch.arange(S, device=inputs.device).expand(B, S)
    starts = torch.zeros_like(ends)
    starts[:, 0] = True
    starts[:, 1:] = ends[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # each token's document start
    return targets.masked_fill(ends, IGNORE_INDEX), index - first


class TokenStream:
    def __init__(self, seq_len: int, global_batch: int, tokens: Tensor | None = None, documents: bool = False):
        self.tokens = corpus_tokens(documents) if tokens is None else tokens
        self.separator = EOS
        self.seq_len, self.global_batch = seq_len, global_batch
        self.span = len(self.tokens) - seq_len - 1
        if self.span <= 0:
            raise ValueError(
                f"seq_len={seq_len} is longer than the corpus ({len(self.tokens)} tokens); "
                f"use seq_len={len(self.tokens) - 2} or less"
            )
        self.cursor = 0  # sequences consumed so far

    def global_batch_at(self, cursor: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of shape (global_batch, seq_len) starting at sequence number `cursor`."""
        starts = [((cursor + i) * self.seq_len) % self.span for i in range(self.global_batch)]
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
        return rows[:, :-1], rows[:, 1:]

    def next_global_batch(self) -> tuple[Tensor, Tensor]:
        """The whole next global batch (every rank reads it and keeps its rows); advances the cursor."""
        batch = self.global_batch_at(self.cursor)
        self.cursor += self.global_batch
        return batch

    def next_batch(self, dp_rank: int = 0, dp_size: int = 1) -> tuple[Tensor, Tensor]:
        """This dp rank's rows of the next global batch; advances the cursor."""
        inputs, targets = self.global_batch_at(self.cursor)
        self.cursor += self.global_batch
        rows = self.global_batch // dp_size
        sl = slice(dp_rank * rows, (dp_rank + 1) * rows)
        return inputs[sl], targets[sl]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seq_len": self.seq_len, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("data") is not None:
            raise ConfigError(
                f"the checkpoint was trained on token files: resume with path={state['data'].get('path')}"
            )
        self.cursor = int(state["cursor"])
