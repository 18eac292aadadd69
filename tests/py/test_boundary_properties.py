"""Property-based test of the Python boundary (hypothesis).

Every argument of every public method and constructor keyword, and every value the engine's
callbacks return, is replaced in turn by generated hostile values: every wrong type, dtype,
shape, device, stride, value and producer we can think of. Whatever it gets, the call must
either behave correctly or raise ValueError / TypeError / IndexError / KeyError whose message
names the argument; never another exception type and never a crash (pytest runs under its fault
handler, so a crash fails the run with a traceback). Canary bytes around the engine's buffers
stay intact throughout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache

torch = pytest.importorskip("torch")
B = 16
EXAMPLES = 300
ALLOWED = (ValueError, TypeError, IndexError, KeyError)
ran: Counter[str] = Counter()


# --- hostile values -------------------------------------------------------------------------------


class RaisingProducer:
    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("producer failed")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class SameCapsuleTwice:
    def __init__(self) -> None:
        self.arr = np.zeros((8, 64), np.uint8)
        self.capsule = self.arr.__dlpack__()

    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class NotACapsule:
    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        return 5

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


NP_DTYPES = [np.int8, np.uint8, np.int32, np.int64, np.uint64, np.float16, np.float32, np.bool_, np.complex64]
TORCH_DTYPES = ["int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "bool", "complex64"]


def make_array(kind: str, dtype_i: int, shape: list[int], layout: str, readonly: bool) -> Any:
    shape_t = tuple(shape)
    if kind == "numpy":
        a = np.zeros(shape_t, NP_DTYPES[dtype_i])
        if layout == "transpose" and a.ndim >= 2:
            a = a.T
        elif layout == "step" and a.ndim >= 1:
            a = a[::2]
        elif layout == "bytes" and a.ndim == 2 and a.itemsize > 1 and a.shape[1] > 0:
            a = np.ndarray(
                a.shape,
                a.dtype,
                np.zeros(a.nbytes + 64, np.uint8),
                0,
                (a.shape[1] * a.itemsize + 1, a.itemsize),
            )
        if readonly:
            a.flags.writeable = False
        return a
    t = torch.zeros(
        shape_t, dtype=getattr(torch, TORCH_DTYPES[dtype_i]), device="meta" if kind == "meta" else "cpu"
    )
    if layout == "transpose" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif layout == "step" and t.dim() >= 1:
        t = t[::2]
    elif layout == "grad" and t.is_floating_point():
        t.requires_grad_(True)
    return t


arrays = st.builds(
    make_array,
    st.sampled_from(["numpy", "torch", "meta"]),
    st.integers(0, len(NP_DTYPES) - 1),
    st.lists(st.integers(0, 40), min_size=0, max_size=3),
    st.sampled_from(["plain", "transpose", "step", "bytes", "grad"]),
    st.booleans(),
)
texts = st.one_of(st.text(max_size=6), st.sampled_from(["\ud800", "a\udc80b", "", "x" * 300]))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(max_magnitude=10),
    texts,
    st.binary(max_size=6),
    st.builds(lambda v: np.int64(v), st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda v: np.float32(v), st.floats(width=32)),
)
producers = st.sampled_from(
    [RaisingProducer, SameCapsuleTwice, NotACapsule, object, dict, set, lambda: lambda: 1]
).map(lambda f: f())
sequences = st.one_of(
    st.lists(st.integers(-(2**65), 2**65), max_size=40),
    st.lists(st.integers(0, 40), min_size=1, max_size=40),
    st.lists(st.one_of(st.none(), st.floats(), texts, st.integers(0, 8)), min_size=1, max_size=5),
    st.lists(st.lists(st.integers(0, 8), max_size=3), min_size=1, max_size=3),
    st.tuples(st.integers(0, 8), st.integers(0, 8)),
    st.builds(lambda n: range(n), st.integers(0, 40)),
    st.builds(lambda n: (i for i in range(n)), st.integers(0, 5)),
)
hostile = st.one_of(scalars, arrays, producers, sequences)


# --- the engine's buffers, with canaries -----------------------------------------------------------


class Engine:
    """A KV segment and a state buffer, each a view into a larger tensor whose guards hold a
    pattern; nothing the cache does may change the guards."""

    def __init__(self) -> None:
        self.backing = torch.full((2 + 8 + 2, B, 4), 7.0)
        self.seg = self.backing[2:10]
        self.state_backing = torch.full((48,), 0x5A, dtype=torch.uint8)
        self.state = self.state_backing[16:32]

    def intact(self) -> bool:
        return bool(
            (self.backing[:2] == 7.0).all()
            and (self.backing[10:] == 7.0).all()
            and (self.state_backing[:16] == 0x5A).all()
            and (self.state_backing[32:] == 0x5A).all()
        )

    def cache(self, **kwargs: Any) -> hicache.HostPrefixCache:
        args: dict[str, Any] = dict(block_tokens=B, capacity_pages=8, state_bytes=16, capacity_states=4)
        args.update(kwargs)
        return hicache.HostPrefixCache(
            kwargs.pop("segments", self.seg), **{k: v for k, v in args.items() if k != "segments"}
        )

    def primed(self, **kwargs: Any) -> hicache.HostPrefixCache:
        c = self.cache(**kwargs)
        c.store("warm", PROMPT, [0, 1, 2], state_export=lambda pos: self.state)
        c.complete_transfers() if kwargs.get("copier") == "deferred" else None
        return c


PROMPT = np.arange(2 * B + 1, dtype=np.int32)
CONSTRUCTOR_KEYWORDS = [
    "block_tokens", "capacity_pages", "host_bytes", "keep_tokens", "state_bytes", "capacity_states",
    "state_lookback", "salt", "error_limit", "copier", "cuda_blocks", "cuda_staging_bytes",
    "cuda_path", "pool_chunk_bytes", "pin_upfront", "eviction", "admission",
    "tier", "tier_wait_ms", "tier_queue_pages", "tier_space", "layers", "prefill_tokens_per_s",
    "prefill_seconds", "key_bits", "state_device",
]  # fmt: skip
# Arguments a keyword's bad value may be reported under: related settings checked together.
ALSO_NAMED = {
    "host_bytes": ("capacity_pages",),
    "capacity_pages": ("host_bytes",),
    "state_bytes": ("capacity_states", "state_lookback"),
    "capacity_states": ("state_bytes",),
    "state_lookback": ("state_bytes",),
}


def constructor_call(engine: Engine, name: str, value: Any) -> Callable[[], Any]:
    def call() -> Any:
        if name == "host_bytes":
            return engine.cache(capacity_pages=None, host_bytes=value)
        if name == "segments":
            return engine.cache(segments=value)
        if name == "segments[1]":
            return engine.cache(segments=[engine.seg, value])
        return engine.cache(**{name: value})

    return call


def method_call(engine: Engine, name: str, value: Any) -> Callable[[], Any]:
    kwargs: dict[str, Any] = {}
    if name.startswith("complete_transfers"):
        kwargs["copier"] = "deferred"
    if name.startswith(("try_resume_layerwise", "wait")):
        kwargs["layers"] = 1
    if name == "try_resume.prefill_seconds()":
        kwargs["prefill_seconds"] = lambda start, end: value
    c = engine.primed(**kwargs)
    out = engine.state
    good_alloc = lambda n: [3, 4, 5][: n // B]  # noqa: E731

    def decided() -> Any:  # the first hit measures the copy rate, the second asks the engine
        c.try_resume("m", PROMPT, good_alloc, state_out=out)
        return c.try_resume("r", PROMPT, good_alloc, state_out=out)

    def wait() -> Any:
        load = c.try_resume_layerwise("r", PROMPT, good_alloc, state_out=out)
        load.wait(value)
        return load.tokens

    calls: dict[str, Callable[[], Any]] = {
        "try_resume.request_id": lambda: c.try_resume(value, PROMPT, good_alloc, state_out=out),
        "try_resume.prompt": lambda: c.try_resume("r", value, good_alloc, state_out=out),
        "try_resume.allocate": lambda: c.try_resume("r", PROMPT, value, state_out=out),
        "try_resume.allocate()": lambda: c.try_resume("r", PROMPT, lambda n: value, state_out=out),
        "try_resume.stream": lambda: c.try_resume("r", PROMPT, good_alloc, state_out=out, stream=value),
        "try_resume.state_out": lambda: c.try_resume("r", PROMPT, good_alloc, state_out=value),
        "try_resume.salt": lambda: c.try_resume("r", PROMPT, good_alloc, state_out=out, salt=value),
        "try_resume.prefill_seconds()": decided,
        "try_resume_layerwise.request_id": lambda: (
            c.try_resume_layerwise(value, PROMPT, good_alloc, state_out=out).tokens
        ),
        "try_resume_layerwise.stream": lambda: (
            c.try_resume_layerwise("r", PROMPT, good_alloc, state_out=out, stream=value).tokens
        ),
        "wait.layer": wait,
        "store.request_id": lambda: c.store(value, PROMPT + 1, [5, 6]),
        "store.tokens": lambda: c.store("s", value, [5, 6, 7]),
        "store.block_ids": lambda: c.store("s", PROMPT + 1, value),
        "store.stream": lambda: c.store("s", PROMPT + 1, [5, 6], stream=value),
        "store.state_export": lambda: c.store("s", PROMPT + 1, [5, 6], state_export=value),
        "store.state_export()": lambda: c.store("s", PROMPT + 1, [5, 6], state_export=lambda pos: value),
        "store.salt": lambda: c.store("s", PROMPT + 1, [5, 6], salt=value),
        "forget.request_id": lambda: c.forget(value),
        "complete_transfers.stream": lambda: c.complete_transfers(value),
        "prefetch.prompt": lambda: c.prefetch(value),
        "prefetch.salt": lambda: c.prefetch(PROMPT, salt=value),
        "flush_tier.timeout_s": lambda: c.flush_tier(value),
        "chain_keys.tokens": lambda: hicache.chain_keys(value, B),
        "chain_keys.block_tokens": lambda: hicache.chain_keys(PROMPT, value),
        "chain_keys.salt": lambda: hicache.chain_keys(PROMPT, B, salt=value),
        "chain_keys.key_bits": lambda: hicache.chain_keys(PROMPT, B, key_bits=value),
    }
    return calls[name]


def names_for(target: str) -> tuple[str, ...]:
    arg = target.split(".")[-1]
    if target.startswith("segments"):
        return ("segment",)
    if arg == "allocate()":
        return ("allocate",)
    if arg == "state_export()":
        return ("state_export",)
    if arg == "prefill_seconds()":
        return ("prefill_seconds",)
    if target == "forget.request_id":
        return ("request_id", "unknown request")
    return (arg, *ALSO_NAMED.get(arg, ()))


TARGETS = [
    "segments", "segments[1]", *CONSTRUCTOR_KEYWORDS,
    "try_resume.request_id", "try_resume.prompt", "try_resume.allocate", "try_resume.allocate()",
    "try_resume.stream", "try_resume.state_out", "try_resume.salt", "try_resume.prefill_seconds()",
    "try_resume_layerwise.request_id", "try_resume_layerwise.stream", "wait.layer",
    "store.request_id", "store.tokens",
    "store.block_ids", "store.stream", "store.state_export", "store.state_export()", "store.salt",
    "forget.request_id", "complete_transfers.stream", "prefetch.prompt", "prefetch.salt",
    "flush_tier.timeout_s", "chain_keys.tokens", "chain_keys.block_tokens",
    "chain_keys.salt", "chain_keys.key_bits",
]  # fmt: skip


def check_outcome(target: str, result: Any) -> None:
    """What correct behaviour means when a generated value happens to be acceptable."""
    if target.startswith(("try_resume", "wait")):
        assert isinstance(result, int) and result in (-1, 0, B, 2 * B), result
    elif target.startswith("store"):
        assert isinstance(result, int) and 0 <= result <= 3, result
    elif target.startswith("prefetch"):
        assert result == 0, result  # no tier: nothing to fetch
    elif target.startswith("flush_tier"):
        assert result is None, result
    elif target.startswith("chain_keys"):
        assert isinstance(result, list) and all(isinstance(k, bytes) and len(k) == 16 for k in result)


def use_constructed(engine: Engine, cache: hicache.HostPrefixCache) -> None:
    """A cache that accepted a generated keyword must work (or refuse by the rules)."""
    engine.seg.zero_()
    try:
        cache.store("u", PROMPT, [0, 1, 2], state_export=lambda pos: engine.state)
        cache.poll()
        cache.try_resume("v", PROMPT, lambda n: [3, 4, 5][: n // B], state_out=engine.state)
        # A second hit: the first measured the copy rate, so a prefill model is asked now.
        cache.try_resume("w", PROMPT, lambda n: [3, 4, 5][: n // B], state_out=engine.state)
        cache.stats()
    except ALLOWED:
        pass


@pytest.mark.parametrize("target", TARGETS)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(value=hostile)
def test_every_argument_takes_any_value_without_harm(target: str, value: Any) -> None:
    ran[target] += 1
    engine = Engine()
    constructor = target.startswith("segments") or target in CONSTRUCTOR_KEYWORDS
    call = constructor_call(engine, target, value) if constructor else method_call(engine, target, value)
    try:
        result = call()
    except ALLOWED as e:
        message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        where = f"{target}={value!r}: {type(e).__name__}: {message}"
        assert any(n in message for n in names_for(target)), where
        assert "incompatible function arguments" not in message, where  # nanobind's overload dump
    else:
        if constructor:
            use_constructed(engine, result)
        else:
            check_outcome(target, result)
    assert engine.intact(), f"{target}={value!r} wrote outside the engine's buffers"


def test_every_target_ran_its_examples() -> None:
    # Runs after the property test (pytest keeps file order): each target saw every example.
    missing = {t: ran[t] for t in TARGETS if ran[t] < EXAMPLES}
    assert not missing, missing
    print(f"\n{sum(ran.values())} generated values over {len(TARGETS)} arguments and callback results:")
    methods = ("HostPrefixCache()", "try_resume", "try_resume_layerwise", "wait", "store", "forget")
    for method in (*methods, "complete_transfers", "prefetch", "flush_tier", "chain_keys"):
        mine = {
            t: n
            for t, n in ran.items()
            if t.split(".")[0] == method or (method == "HostPrefixCache()" and "." not in t)
        }
        print(f"  {method}: " + ", ".join(f"{t.split('.')[-1]} {n}" for t, n in mine.items()))
