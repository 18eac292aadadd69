"""Conversions at the Python boundary: tokens, block ids, streams, segment sizes.

Everything an engine may hand us (lists, numpy arrays, torch tensors) is turned into the exact
dtype and layout the C++ core takes, with a clear error when it cannot be, before any copy starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

_INT32 = np.iinfo(np.int32)


def _is_torch_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_numpy_1d(x: Any, what: str) -> np.ndarray:
    if _is_torch_tensor(x):
        if x.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(x.shape)}")
        if x.is_floating_point() or x.is_complex() or str(x.dtype) == "torch.bool":
            raise TypeError(f"{what} must hold integers, got {x.dtype}")
        return x.detach().cpu().numpy()
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of ints, not {type(x).__name__}")
    try:
        arr = np.asarray(x)
    except Exception as e:
        raise TypeError(f"{what} must be a sequence of ints, not {type(x).__name__}") from e
    if arr.ndim != 1:
        if arr.ndim == 0:
            raise TypeError(f"{what} must be a sequence of ints, not {type(x).__name__}")
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    return arr


def as_tokens(x: Any, what: str = "tokens") -> np.ndarray:
    """Token ids as a contiguous int32 array (the hash chain hashes int32 little-endian)."""
    arr = _to_numpy_1d(x, what)
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ValueError(f"{what} must fit in int32 (token ids are hashed as int32)")
    return np.ascontiguousarray(arr, dtype=np.int32)


def as_block_ids(x: Any, what: str = "block_ids") -> np.ndarray:
    """Block ids as a contiguous int64 array."""
    return np.ascontiguousarray(_to_numpy_1d(x, what), dtype=np.int64)


def block_id_list(x: Any) -> list[int]:
    """What allocate() returned, as a list of ints (the core checks count and range)."""
    return as_block_ids(x, "allocate's result").tolist()


def as_salt(salt: bytes | str | None) -> bytes | None:
    if salt is None or isinstance(salt, bytes):
        return salt
    if isinstance(salt, str):
        return salt.encode()
    raise TypeError(f"salt must be bytes or str, not {type(salt).__name__}")


def as_request_id(request_id: str | int) -> str:
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise TypeError(f"request_id must be str or int, not {type(request_id).__name__}")
    return str(request_id)


def block_bytes(segment: Any) -> int:
    """Bytes of one block of a segment (its first dimension is the block id)."""
    shape = tuple(segment.shape)
    if len(shape) < 1:
        raise ValueError("a segment needs a block dimension (ndim >= 1)")
    itemsize = segment.element_size() if _is_torch_tensor(segment) else segment.itemsize
    return math.prod(shape[1:]) * int(itemsize)


def stream_handle(stream: Any, segments: Sequence[Any]) -> int:
    """A cudaStream_t as an int. None means torch's current stream for CUDA segments, else 0."""
    if stream is None:
        first = segments[0]
        if _is_torch_tensor(first) and first.is_cuda:
            import torch

            return int(torch.cuda.current_stream(first.device).cuda_stream)
        return 0
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(f"stream must be an int handle or a torch.cuda.Stream, not {type(stream).__name__}")
    if stream < 0:
        raise ValueError("stream handle must be >= 0")
    return stream
