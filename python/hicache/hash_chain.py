"""The hash chain, in C++ (fast) and in pure Python (the oracle the tests compare against)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _arrays, _core


def chain_keys(
    tokens: Sequence[int] | Any, block_tokens: int = 128, salt: bytes | str = b"", key_bits: int = 128
) -> list[bytes]:
    """16-byte keys of every full block of ``tokens`` (computed by the C++ core)."""
    salt_bytes = _arrays.as_salt(salt)
    if salt_bytes is None:
        raise TypeError("salt must be bytes or str, not None")
    block_tokens = _arrays.int_arg("block_tokens", block_tokens, 1, 2**63 - 1)
    key_bits = _arrays.int_arg("key_bits", key_bits, 1, 128)
    return _core.chain_keys(salt_bytes, _arrays.as_tokens(tokens), block_tokens, key_bits)


def truncate_key(key: bytes, key_bits: int) -> bytes:
    """Keep the first ``key_bits`` bits (most significant first in each byte); zero the rest."""
    if key_bits >= 128:
        return key
    out = bytearray(key)
    for i in range(16):
        keep = min(max(key_bits - 8 * i, 0), 8)
        out[i] &= (0xFF00 >> keep) & 0xFF
    return bytes(out)


def reference_chain_keys(
    tokens: Sequence[int] | np.ndarray, block_tokens: int = 128, salt: bytes = b"", key_bits: int = 128
) -> list[bytes]:
    """``key_i = blake2b(tokens_i as <i4 || key_{i-1}, digest_size=16)``, ``key_{-1} = salt``."""
    arr = np.asarray(tokens, dtype="<i4")
    keys: list[bytes] = []
    prev = salt
    for i in range(len(arr) // block_tokens):
        page = arr[i * block_tokens : (i + 1) * block_tokens].tobytes()
        prev = truncate_key(hashlib.blake2b(page + prev, digest_size=16).digest(), key_bits)
        keys.append(prev)
    return keys
