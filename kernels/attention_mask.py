"""The attention mask beyond causality as one value: packed documents (the queries' and the keys' document
ids), a sliding window, and where the queries sit among the keys. Context parallel builds one per block it
computes (`block` slices a whole call's mask to a block's rows and columns at that block's offset) and hands
it to the kernels by `kwargs()`, flash_attention's own keywords.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class AttentionMask:
    """`q_docs` (B, Sq) and `k_docs` (B, Sk): the queries' and the keys' document ids (both or neither);
    `window`: a sliding window in tokens (None: none); `q_offset`: the first query's position among the keys
    (None: bottom-right, Sk - Sq)."""

    q_docs: Tensor | None = None
    k_docs: Tensor | None = None
    window: int | None = None
    q_offset: int | None = None

    def __post_init__(self) -> None:
        if (self.q_docs is None) != (self.k_docs is None):
            raise ValueError("an attention mask's document ids need the queries' and the keys' (or neither)")

    def block(self, rows: slice, cols: slice, q_offset: int | None = None) -> AttentionMask:
        """The mask of the block of query `rows` against key `cols`, its queries placed at `q_offset`."""
        if self.q_docs is None or self.k_docs is None:
            return AttentionMask(window=self.window, q_offset=q_offset)
        return AttentionMask(self.q_docs[:, rows], self.k_docs[:, cols], self.window, q_offset)

    def kwargs(self) -> dict[str, Any]:
        """flash_attention's and flash_attention_backward's keywords for this mask (documents only when set)."""
        out: dict[str, Any] = {"window": self.window, "q_offset": self.q_offset}
        if self.q_docs is not None:
            out.update(q_docs=self.q_docs, k_docs=self.k_docs)
        return out
