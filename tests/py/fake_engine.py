"""A stand-in engine for the tests: KV bytes that are a function of the token prefix."""

from __future__ import annotations

import zlib

import numpy as np


class FakeEngine:
    """Numpy KV segments whose block contents are a function of the whole token prefix."""

    def __init__(
        self, num_blocks: int, block_tokens: int, shapes: list[tuple[int, ...]], dtype: str = "float16"
    ):
        self.B = block_tokens
        self.segments = [np.zeros((num_blocks, *shape), dtype=dtype) for shape in shapes]

    def block_content(self, prefix: np.ndarray) -> list[np.ndarray]:
        rng = np.random.default_rng(zlib.crc32(np.asarray(prefix, dtype="<i4").tobytes()))
        return [
            rng.integers(0, 256, size=s[0].nbytes, dtype=np.uint8).view(s.dtype).reshape(s[0].shape)
            for s in self.segments
        ]

    def prefill(self, tokens: np.ndarray, blocks: list[int], start: int = 0) -> None:
        for i in range(start // self.B, len(tokens) // self.B):
            for seg, val in zip(self.segments, self.block_content(tokens[: (i + 1) * self.B]), strict=True):
                seg[blocks[i]] = val

    def page(self, block: int) -> bytes:
        return b"".join(s[block].tobytes() for s in self.segments)
