"""Packed-document batches and the ground truth they are held to: each document run alone through the
one-process model (shared by test_documents and test_packed_documents)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.data.corpus import IGNORE_INDEX, pack_documents
from tessera.models.init import one_process_name
from tessera.models.spec import get_spec

SEPARATOR = 257  # the byte tokenizer's EOS
SEED = 0


def small_config(n_layers: int = 2):
    return get_spec("llama").config("debug", n_layers=n_layers, max_seq_len=256)


def build_small():
    """The model's structure and config (module level: the ranks import it; each rank builds it on meta)."""
    return get_spec("llama").build(small_config())


def one_process_model():
    """The one-process model every layout starts from: the spec's init under SEED."""
    return get_spec("llama").build_model(small_config(), seed=SEED)


def packed_row(lengths: list[int], seq: int, generator: torch.Generator, ends_open: bool = True) -> torch.Tensor:
    """seq + 1 tokens of documents with these lengths, each ended by the separator; the last one runs past
    the row's end (a document cut by the row) when `ends_open`."""
    tokens = torch.randint(0, 256, (seq + 1,), generator=generator)
    pos = -1
    for i, n in enumerate(lengths):
        pos += n
        if pos >= seq + 1 or (ends_open and i == len(lengths) - 1):
            break
        tokens[pos] = SEPARATOR
    return tokens


def packed_batch(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets with each separator's target masked, positions) of rows of seq + 1 tokens."""
    stacked = torch.stack(rows)
    targets, positions = pack_documents(stacked[:, :-1], stacked[:, 1:], SEPARATOR)
    return stacked[:, :-1], targets, positions


def documents_of(positions: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, each document's (start, end): a document starts where its position is 0."""
    out = []
    for row in positions:
        starts = (row == 0).nonzero().flatten().tolist() + [row.numel()]
        out.append(list(zip(starts[:-1], starts[1:])))
    return out


def run_alone(model, inputs, targets, positions) -> tuple[torch.Tensor, dict]:
    """Per-token losses (B, S) (0 where the target is masked) and the gradients of their mean, each document
    run alone through `model` (its own sequence, positions 0..len-1): the ground truth of packing."""
    model.zero_grad(set_to_none=True)
    losses = torch.zeros(targets.shape)
    total = 0.0
    for b, docs in enumerate(documents_of(positions)):
        for s, e in docs:
            logits = model(inputs[b : b + 1, s:e])
            per_token = F.cross_entropy(logits[0].float(), targets[b, s:e], ignore_index=IGNORE_INDEX, reduction="none")
            losses[b, s:e] = per_token.detach()
            total = total + per_token.sum()
    count = int((targets != IGNORE_INDEX).sum())
    (total / count).backward()
    grads = {one_process_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
    return losses, grads
