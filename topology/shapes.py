"""Parameter shapes as one tensor-parallel rank holds them, and FSDP2's rule for cutting them: the pure
arithmetic the planner and the communication model both count with (checked against the fake-backend
build in tests/test_planner.py)."""

from __future__ import annotations

import math


def _kv_local(cfg, tp: int) -> int:
    """Output features of the k (or v) projection on one tp rank: kv heads split, or all of them
    replicated when tp exceeds the kv heads (tessera's ReplicatedHeads keeps the whole weight)."""
    return cfg.n_kv_heads * cfg.head_dim // tp if cfg.n_kv_heads % tp == 0 else cfg.n_kv_heads * cfg.head_dim


def layer_param_shapes(cfg, tp: int) -> list[tuple[int, int]]:
    """(rows, cols) of each parameter of one block on one tp rank, in the rows FSDP2 shards (dim 0)."""
    h, hd = cfg.dim, cfg.head_dim
    kv = _kv_local(cfg, tp)
    return [(h, 1), (cfg.n_heads * hd // tp, h), (kv, h), (kv, h), (h, cfg.n_heads * hd // tp), (h, 1),
            (cfg.ffn_dim // tp, h), (cfg.ffn_dim // tp, h), (h, cfg.ffn_dim // tp)]


def stage_param_shapes(cfg, tp: int, first: bool, last: bool, n_layers: int) -> list[list[tuple[int, int]]]:
    """One list of (rows, cols) per FSDP unit of a stage on one tp rank: embedding, blocks, norm + head."""
    vocab_rows = -(-cfg.vocab_size // tp)  # torch.chunk rows: ceil(V / tp)
    units = [[(vocab_rows, cfg.dim)]] if first else []
    units += [layer_param_shapes(cfg, tp) for _ in range(n_layers)]
    if last:
        units.append([(cfg.dim, 1), (vocab_rows, cfg.dim)])
    return units


def fsdp_shard_numel(rows: int, cols: int, shards: int, index: int = 0) -> int:
    """Elements FSDP2 leaves on shard `index` of a (rows, cols) tensor: torch.chunk of dim 0."""
    if shards == 1:
        return rows * cols
    per = -(-rows // shards)
    return max(0, min(per, rows - index * per)) * cols


# fp32 logits one chunk may hold: 2^24 elements (64 MiB), up to 130 tokens at a 128256 vocabulary. Large
# enough that the chunk's matmuls, not re-reading dW once per chunk, dominate the time (and that MKL keeps
# its blocked kernels: below ~32 rows its dh sums over the vocabulary measured ~5x less accurate); small
# enough that the chunk is a few percent of the full logits at training sizes.
CHUNK_ELEMENTS = 2**24


def chunk_tokens(n_tokens: int, vocab_rows: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk: the fewest chunks whose fp32 logits (tokens x vocab_rows) stay within
    `chunk_elements`, k = ceil(N * V / budget), cut as evenly as they go, ceil(N / k) tokens each (at least
    1: a vocabulary row wider than the budget still runs one token at a time). Under tp `vocab_rows` is the
    padded shard ceil(V / tp), so every tp rank cuts the same chunks and their collectives pair up."""
    if n_tokens <= 0:
        return 1
    chunks = max(1, math.ceil(n_tokens * max(1, vocab_rows) / max(1, chunk_elements)))
    return max(1, math.ceil(n_tokens / chunks))
