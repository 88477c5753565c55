"""Text generation from a causal LM: greedy decoding and top-p (nucleus) sampling, with a KV cache or by
recomputing the whole prefix at every step (the reference the cache is tested against).

    prefill: the prompt (B, P) at positions 0..P-1, every attention block's keys and values cached
          -> step: the last token at position P + i, attending to the cache; its logits -> the next token

The model is any family's (or a user's spec'd model) whose attention blocks have the `kv_cache` slot
(models/kv_cache.py). Nothing here knows a parallelism: a tensor-parallel model's head gives this rank's
vocabulary slice, and the caller passes `full_logits` that gathers the whole vocabulary (the same on every
rank, so every rank draws the same token from the same seeded generator and no token is broadcast).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from .kv_cache import KVCache, kv_caches, next_positions


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: `temperature` 0 is greedy (the most likely token); above 0 the logits
    are divided by it and a token drawn from the smallest set of most likely tokens whose probability
    reaches `top_p` (1: every token), from a generator seeded with `seed`."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} is outside (0, 1]; use e.g. 0.9 (1 keeps every token)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(
                f"temperature={self.temperature} must be a finite number >= 0 (0: greedy; e.g. 0.8 to sample)"
            )
        if self.temperature == 0.0 and self.top_p < 1.0:  # greedy takes the most likely token: top_p would do nothing
            raise ValueError(
                f"top_p={self.top_p} samples, and temperature=0 is greedy; give a temperature above 0 (e.g. "
                f"temperature=0.8) to sample, or keep top_p=1"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """probs (..., V) -> the same with every token outside the nucleus zeroed and the rest renormalized. The
    nucleus: the most likely tokens, in order, up to and including the one whose cumulative probability
    reaches `top_p` (so it is never empty); ties are broken by token id."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more likely tokens
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs.masked_fill(~keep, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def next_token(logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> Tensor:
    """logits (B, V) -> the next token ids (B,)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        probs = top_p_filter(probs, sampling.top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generated:
    """What `generate` produced: each row's new tokens (cut after its first stop token), the logits of each
    step when asked for (B, V) float32, and the measured seconds of the prefill (the prompt's forward and
    the first token) and of the steps after it."""

    tokens: list[list[int]]
    logits: list[Tensor] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(row) for row in self.tokens)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    use_cache: bool = True,
    stop: tuple[int, ...] = (),
    full_logits: Callable[[Tensor], Tensor] | None = None,
    on_token: Callable[[int, float], None] | None = None,
    keep_logits: bool = False,
    prefill_context: contextlib.AbstractContextManager | None = None,
) -> Generated:
    """Continue `prompt` (B, P) token ids by up to `max_new_tokens` tokens. `use_cache`: prefill the KV
    caches and feed one token per step; else recompute the whole prefix each step. `stop`: token ids that
    end a row (included in its tokens); generation ends when every row has stopped. `full_logits`: the
    model's output (B, S, V_local) -> (B, S, V) (a tensor-parallel head's gather). `on_token(done, seconds)`
    is called after each step; `prefill_context` is entered around the prompt's forward only (a probe of
    what it runs, e.g. the matmuls' dtype, without slowing the steps after it). The positions stay below
    the model's RoPE tables: the caller checks that P + max_new_tokens fits the model's context."""
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"the prompt must be (batch, tokens) with at least one token, got {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    gather = full_logits or (lambda x: x)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=prompt.device).manual_seed(sampling.seed)
    B, P = prompt.shape
    rows: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    out = Generated(rows)
    start = time.perf_counter()

    def last_logits(output: Tensor) -> Tensor:
        logits = gather(output[:, -1:])[:, -1].float()
        if keep_logits:
            out.logits.append(logits.clone())
        return logits

    def take(token: Tensor) -> Tensor:
        for b, t in enumerate(token.tolist()):
            if not done[b]:
                rows[b].append(t)
                done[b] = t in stop
        return token

    caching: contextlib.AbstractContextManager[list[KVCache]] = (
        kv_caches(model, P + max_new_tokens) if use_cache else contextlib.nullcontext([])
    )
    with caching as caches:
        ids = prompt
        with prefill_context or contextlib.nullcontext():
            output = model(prompt, torch.arange(P, device=prompt.device))
        token = take(next_token(last_logits(output), sampling, generator))
        out.prefill_s = time.perf_counter() - start
        if on_token is not None:
            on_token(1, out.prefill_s)
        for step in range(1, max_new_tokens):
            if all(done):
                break
            if caches:
                new = token.view(B, 1)
                output = model(new, next_positions(caches, 1, prompt.device))
            else:
                ids = torch.cat([ids, token.view(B, 1)], dim=1)
                output = model(ids, torch.arange(ids.shape[1], device=prompt.device))
            token = take(next_token(last_logits(output), sampling, generator))
            if on_token is not None:
                on_token(step + 1, time.perf_counter() - start)
    out.decode_s = time.perf_counter() - start - out.prefill_s
    return out
