"""Checks and conversions at the Python boundary: integers, tokens, block ids, streams, buffers.

Everything an engine may hand us (lists, numpy arrays, torch tensors, any DLPack producer) is
checked and turned into exactly what the C++ core takes before any copy starts. A bad argument
raises ValueError or TypeError (IndexError for a block id out of range, from the core) whose
message names the argument, its value and what was expected; the core never sees it.
"""

from __future__ import annotations

import ctypes
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

_INT32 = np.iinfo(np.int32)
_INT64 = np.iinfo(np.int64)

_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid.restype = ctypes.c_int


def show(x: Any) -> str:
    """A short description of a value for an error message."""
    if isinstance(x, (bool, int, float, complex, type(None))):
        return repr(x)
    if isinstance(x, (str, bytes)):
        r = repr(x)
        return r if len(r) <= 40 else r[:37] + "..."
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"{type(x).__name__} of shape {tuple(shape)}, dtype {getattr(x, 'dtype', '?')}"
    return f"a {type(x).__name__}"


def is_torch_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def int_arg(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """An integer argument (bool refused), within [lo, hi] where given."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool ({value!r})")
    try:
        v = operator.index(value)
    except Exception as e:  # a type without __index__, or one whose __index__ fails (a meta tensor)
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({show(value)})") from e
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo} (got {v})")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi} (got {v})")
    return v


def bool_arg(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__} ({show(value)})")
    return bool(value)


def choice_arg(name: str, value: Any, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}, not {show(value)}")
    return value


def callable_arg(name: str, value: Any, signature: str) -> Any:
    if not callable(value):
        raise TypeError(f"{name} must be a callable ({signature}), not {show(value)}")
    return value


def call_back(fn: Any, name: str, *args: int) -> Any:
    """Calls an engine callback with its arguments. Its own exceptions pass unchanged; a callable
    that cannot take the call (wrong arity) is reported under the argument's name."""
    try:
        return fn(*args)
    except TypeError as e:
        if e.__traceback__ is not None and e.__traceback__.tb_next is None:  # failed at the call
            what = "one argument" if len(args) == 1 else f"{len(args)} arguments"
            shown = ", ".join(map(str, args))
            raise TypeError(f"{name} must take {what} ({shown}); calling it raised: {e}") from e
        raise


def _to_numpy_1d(x: Any, what: str) -> np.ndarray:
    if is_torch_tensor(x):
        # The cheapest torch attributes (this runs on every call: a 16-page store's whole Python
        # side is ~15 us): is_meta, not device.type; numpy(force=True), not detach().cpu().numpy().
        if x.is_meta:
            raise ValueError(f"{what} is a meta tensor: it has no data")
        if x.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(x.shape)}")
        dtype = x.dtype
        if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
            raise TypeError(f"{what} must hold integers, got {dtype}")
        return x.numpy(force=True)
    if isinstance(x, (str, bytes, bytearray, memoryview)) or x is None:
        raise TypeError(f"{what} must be a sequence of ints, not {type(x).__name__}")
    try:
        arr = np.asarray(x)
    except Exception as e:
        raise TypeError(f"{what} must be a sequence of ints, not {show(x)}: {e}") from e
    if arr.ndim != 1:
        if arr.ndim == 0:
            raise TypeError(f"{what} must be a sequence of ints, not {show(x)}")
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == object:
        # Python ints beyond int64, or a mix of types.
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in arr.tolist()):
            raise TypeError(f"{what} must hold integers, got {show(x)}")
        raise ValueError(f"{what} holds integers outside the int64 range")
    if arr.dtype.kind not in "iu":  # signed or unsigned integers (np.issubdtype: 10x slower)
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.max() > _INT64.max:
        raise ValueError(f"{what} holds integers outside the int64 range")
    return arr


_FIT_INT32 = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16)}


def as_tokens(x: Any, what: str = "tokens") -> np.ndarray:
    """Token ids as a contiguous int32 array (the hash chain hashes int32 little-endian)."""
    arr = _to_numpy_1d(x, what)
    fits = arr.dtype in _FIT_INT32  # no value of these types is out of range: no pass over them
    if arr.size and not fits and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ValueError(f"{what} must fit in int32 (token ids are hashed as int32)")
    return np.ascontiguousarray(arr, dtype=np.int32)


def as_block_ids(x: Any, what: str = "block_ids") -> np.ndarray:
    """Block ids as a contiguous int64 array (the core checks their range)."""
    return np.ascontiguousarray(_to_numpy_1d(x, what), dtype=np.int64)


def block_id_list(x: Any, what: str) -> list[int]:
    """What allocate() returned, as a list of ints (the core checks count and range)."""
    return as_block_ids(x, what).tolist()


def as_salt(salt: Any, what: str = "salt") -> bytes | None:
    if salt is None or isinstance(salt, bytes):
        return salt
    if isinstance(salt, str):
        try:
            return salt.encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} {show(salt)} cannot be encoded as UTF-8: {e.reason}") from None
    raise TypeError(f"{what} must be bytes or str, not {type(salt).__name__}")


def as_request_id(request_id: Any) -> str:
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise TypeError(f"request_id must be str or int, not {type(request_id).__name__}")
    if isinstance(request_id, int):
        return str(request_id)
    try:
        request_id.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"request_id {show(request_id)} cannot be encoded as UTF-8: {e.reason}") from None
    return request_id


def block_bytes(segment: Any) -> int:
    """Bytes of one block of a segment (its first dimension is the block id)."""
    shape = tuple(segment.shape)
    itemsize = segment.element_size() if is_torch_tensor(segment) else segment.itemsize
    return math.prod(shape[1:]) * int(itemsize)


def stream_handle(stream: Any, segments: Sequence[Any]) -> int:
    """A cudaStream_t as an int. None means torch's current stream for CUDA segments, else 0."""
    if stream is None:
        first = segments[0]
        if is_torch_tensor(first) and first.is_cuda:
            import torch

            return int(torch.cuda.current_stream(first.device).cuda_stream)
        return 0
    if hasattr(stream, "cuda_stream"):
        stream = stream.cuda_stream
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise TypeError(f"stream must be an int handle or a torch.cuda.Stream, not {show(stream)}")
    if not 0 <= stream < 2**64:
        raise ValueError(f"stream handle must be in [0, 2**64) (a cudaStream_t), not {stream}")
    return int(stream)


def _writable(x: Any) -> bool | None:
    """Whether x can be written through (None: cannot tell from here)."""
    if isinstance(x, np.ndarray):
        return bool(x.flags.writeable)
    if isinstance(x, memoryview):
        return not x.readonly
    if isinstance(x, bytes):
        return False
    return None


def dlpack_arg(x: Any, what: str, *, writable: bool) -> Any:
    """What to hand the core for a tensor argument: a fresh DLPack capsule of x.

    The capsule is taken here, so the producer's own errors surface (named after the argument)
    and a capsule handed out twice is refused: nanobind renames a capsule it consumes, so one
    returned again (by a buggy ``__dlpack__``) would otherwise get two owners and be freed twice.
    """
    if x is None:
        raise TypeError(f"{what} is None; expected a tensor or array")
    if is_torch_tensor(x):
        if x.device.type == "meta":
            raise ValueError(f"{what} is a meta tensor: it has no data")
        if x.requires_grad:
            x = x.detach()
    if writable and _writable(x) is False:
        raise ValueError(f"{what} is read-only; the cache writes into it")
    if not hasattr(x, "__dlpack__"):
        if _writable(x) is None and not isinstance(x, (bytearray, memoryview)):
            raise TypeError(f"{what} must be a tensor or array (DLPack or buffer protocol), not {show(x)}")
        try:
            x = np.asarray(x)
        except Exception as e:
            raise TypeError(f"{what}: not an array: {e}") from e
        if writable and not x.flags.writeable:
            raise ValueError(f"{what} is read-only; the cache writes into it")
    try:
        capsule = x.__dlpack__()
    except BufferError as e:
        if writable:
            raise ValueError(f"{what} cannot be exported through DLPack: {e}") from e
        try:  # read-only producers export only versioned capsules, which carry the flag
            capsule = x.__dlpack__(max_version=(1, 0))
        except Exception as e2:
            raise ValueError(f"{what} cannot be exported through DLPack: {e2}") from e2
    except Exception as e:
        raise ValueError(f"{what}: its __dlpack__() raised {type(e).__name__}: {e}") from e
    if type(capsule).__name__ != "PyCapsule":
        raise TypeError(f"{what}: its __dlpack__() returned {show(capsule)}, not a DLPack capsule")
    if not (_capsule_is_valid(capsule, b"dltensor") or _capsule_is_valid(capsule, b"dltensor_versioned")):
        raise ValueError(
            f"{what}: its __dlpack__() returned a capsule that was already consumed "
            "(each call must return a new one)"
        )
    return capsule
