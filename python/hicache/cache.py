"""The Python face of hicache: HostPrefixCache over torch tensors or numpy arrays."""

from __future__ import annotations

import atexit
import functools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from . import _arrays
from ._core import CacheStats, Tier
from ._core import HostPrefixCache as _CoreCache
from ._core import LayerwiseLoad as _CoreLoad

_data_ptr = operator.methodcaller("data_ptr")
ArrayLike = Any  # torch.Tensor, numpy.ndarray, or anything exporting DLPack
Allocate = Callable[[int], "Sequence[int] | ArrayLike | None"]
StateExport = Callable[[int], "ArrayLike | Sequence[ArrayLike] | None"]
CopierKind = Literal["auto", "cpu", "cuda", "deferred", "null"]
Eviction = Literal["leaf-first", "lru"]
Admission = Literal["adaptive", "second-sighting", "always"]
CudaPath = Literal["auto", "dma", "staged", "kernel"]

# Caches with a tier, closed before the interpreter finalizes. Their tier thread calls the tier
# (a Python one, or Mooncake's client) holding the GIL: a thread that asks for the GIL once
# finalization began is ended by CPython through a forced unwind, which std::terminate()s the
# process ("terminate called without an active exception", measured in 4 of 12 runs of a
# script that ends with its cache alive). Closing them at exit joins that thread first.
_with_tier: weakref.WeakSet[HostPrefixCache] = weakref.WeakSet()


@atexit.register
def _close_tiered_caches() -> None:
    for cache in list(_with_tier):
        cache.__dict__.pop("_core", None)  # the last reference: the core joins its threads


class HostPrefixCache:
    """A host-memory prefix cache for an engine's paged KV blocks (and hybrid-model state).

    Args:
        segments: the engine's KV tensors, first dimension = block id, every block contiguous.
            One tensor is a page-major pool; several (per-layer K and V, MLA latents) are
            layer-major. All on one device. They must outlive the cache; the cache keeps a
            reference to each. ``[]`` with ``state_bytes``: a state-only cache, for models
            without full-attention layers (Mamba, every layer a sliding window): its pages index
            the prompt and hold no bytes, ``allocate`` and ``block_ids`` may be None, and
            ``state_device`` says where the states live.
        block_tokens: tokens per engine block (= per host page).
        capacity_pages: host pages to keep. Give this or ``host_bytes``.
        host_bytes: host memory for pages, in bytes (rounded down to whole pages).
        keep_tokens: a hit always leaves at least this many prompt tokens to compute (>= 1).
        state_bytes: bytes of one per-sequence state of a hybrid model (0: no state), or, for a
            state the engine holds in several tensors (per layer a conv and an SSM state, a
            window's K and V, in any dtypes), the bytes of each tensor in order: the cache keeps
            them back to back, and ``state_out`` / ``state_export`` take or give that list.
        capacity_states: host state slots (required when ``state_bytes > 0``).
        state_lookback: ``store`` saves states at this many block boundaries of the prompt: the
            last one and those 1, 2, 4, 8, ... blocks before it. A prompt that branches off a
            stored one resumes at the last of them inside the pages they share, or gets nothing
            (``docs/hybrid.md`` measures the default).
        salt: namespace of every chain unless a call passes its own (tenants never share).
        error_limit: consecutive cache failures after which the cache disables itself.
        copier: ``"auto"`` (CUDA for CUDA segments, else CPU), ``"cpu"``, ``"cuda"``,
            ``"deferred"`` (tests: copies run at :meth:`complete_transfers`) or ``"null"``
            (moves and allocates nothing: policy simulation, as ``hicache replay`` does).
        eviction: ``"leaf-first"`` (default: never evicts a page before its cached descendants)
            or ``"lru"`` (plain LRU, as DeepInfer's hicache; strands descendants).
        admission: which new pages may take a slot while the pool is full. ``"adaptive"``
            (the default without a tier): write-through, or only pages whose key was seen in a
            recent prompt, whichever two small simulations beside the cache currently find
            better (small pools under pressure get the second, large ones write-through).
            ``"second-sighting"``: always the second. ``"always"`` (the default with a tier,
            which receives only the pages the host stores): write-through. A declined page ends
            the store (its descendants cannot be cached without it); counted in
            ``pages_declined``.
        cuda_blocks: CTAs of the CUDA copy kernel across PCIe (small pages); the staged
            path's scatters within the GPU take one CTA per SM, or this many if more.
        cuda_staging_bytes: device memory per stream and direction through which pages of
            layer-major pools cross PCIe whole on the DMA engines (pages of 512 KiB or more
            that the DMA engines do not take chunk by chunk); the kernel scatters them at HBM
            speed. At most this much (default 64 MiB): two windows of up to half of it, each at
            least one whole page; a call's first window holds 16 pages within [8 MiB, half of
            it], each later one twice the one before. 0: no staging.
        cuda_path: how pages cross PCIe: ``"auto"`` (default: chosen from the layout),
            ``"dma"``, ``"staged"`` or ``"kernel"`` (see :attr:`copy_path`). ``"dma"`` suits
            layer-major pools whose copies run beside heavy compute: on an H200 it keeps the
            full link beside a bf16 matmul where the staged path keeps about 0.6 of its rate,
            at more CPU time per call and slower stores and loads issued together.
        pool_chunk_bytes: size of one host allocation.
        pin_upfront: CUDA only. False (default): pin the first chunk now and the rest on a
            background thread, one chunk after another until the pool is whole (pausing while
            host memory runs short; stores that outrun the pinning are skipped and counted in
            ``store_skips_unpinned``). True: pin the whole pool now (about 13 GB/s on an H200
            host).
        tier: a store shared with caches of other processes and hosts (a :class:`hicache.Tier`:
            :class:`hicache.mooncake.MooncakeTier`, or :class:`hicache.MemoryTier` in tests).
            Pages this cache stores are written to it in the background; a prompt that misses
            in host memory fetches the rest of its prefix from it, checked as exactly as a host
            page (tokens, parent, salt, model, checksum), into host memory. Pages only: a cache
            with ``state_bytes`` does not fetch.
        tier_wait_ms: how long a host miss waits for the tier (then serves what arrived); make
            it about what recomputing a long prefix would cost. 0: never wait; fetch in the
            background, for the next prompt (prefetch).
        tier_queue_pages: pages waiting to be written to the tier; beyond that, stores are not
            written there (counted in ``tier_pages_dropped``).
        tier_space: names this model (and its version, quantization, tensor-parallel rank) in
            the tier, so caches of other models sharing the store never read its pages.
        layers: for layer-wise loads (:meth:`try_resume_layerwise`): the number of layers, the
            segments split evenly among them in order (64 segments, ``layers=32``: K and V of
            each layer), or the segments of each layer (``[2, 2, ..., 1]``).
        prefill_tokens_per_s: how fast the engine prefills, in tokens a second; or
        prefill_seconds: ``(start, end) -> seconds`` to prefill prompt tokens ``[start, end)``
            with ``[0, start)`` cached (attention makes later tokens dearer). Given either, a
            hit is served only as far as loading it at the copier's measured rate
            (``stats().load_bytes_per_s``) gives an earlier first token than recomputing it,
            counted in ``hits_trimmed`` and ``pages_recomputed``; until a load was measured, hits
            are served whole. Layer-wise, the load counts as overlapped with the prefill.
        key_bits: tests only; fewer than 128 bits force hash collisions.
        state_device: a state-only cache's device, ``"cpu"`` (default) or ``"cuda:N"``; ignored
            when there are segments (theirs is the cache's device).

    Raises:
        ValueError / TypeError: a bad segment or keyword, named in the message. Host memory is
        allocated at first use on the CPU; pinned pools (CUDA) are pinned from construction on,
        in the background (the first chunk before this returns), until whole.
    """

    def __init__(
        self,
        segments: ArrayLike | Sequence[ArrayLike],
        *,
        block_tokens: int = 128,
        capacity_pages: int | None = None,
        host_bytes: int | None = None,
        keep_tokens: int = 1,
        state_bytes: int | Sequence[int] = 0,
        capacity_states: int = 0,
        state_lookback: int = 4,
        salt: bytes | str = b"",
        error_limit: int = 8,
        copier: CopierKind = "auto",
        cuda_blocks: int = 4,
        cuda_staging_bytes: int = 64 << 20,
        cuda_path: CudaPath = "auto",
        pool_chunk_bytes: int = 1 << 30,
        pin_upfront: bool = False,
        eviction: Eviction = "leaf-first",
        admission: Admission | None = None,
        tier: Tier | None = None,
        tier_wait_ms: float = 50.0,
        tier_queue_pages: int = 4096,
        tier_space: str = "default",
        layers: int | Sequence[int] | None = None,
        prefill_tokens_per_s: float | None = None,
        prefill_seconds: Callable[[int, int], float] | None = None,
        key_bits: int = 128,
        state_device: Any = None,
    ) -> None:
        if segments is None or isinstance(segments, (str, bytes)):
            raise TypeError(
                f"segments must be a tensor or a sequence of tensors, not {_arrays.show(segments)}"
            )
        segs = [segments] if hasattr(segments, "shape") or hasattr(segments, "__dlpack__") else None
        if segs is None:
            try:
                segs = list(segments)
            except TypeError:
                raise TypeError(
                    f"segments must be a tensor or a sequence of tensors, not {_arrays.show(segments)}"
                ) from None
        i64 = 2**63 - 1
        block_tokens = _arrays.int_arg("block_tokens", block_tokens, 1, i64)
        if (capacity_pages is None) == (host_bytes is None):
            raise ValueError("give exactly one of capacity_pages and host_bytes")
        keep_tokens = _arrays.int_arg("keep_tokens", keep_tokens, 1, i64)
        state_parts = _state_parts(state_bytes)
        device = _state_device(state_device)
        if not segs:
            if sum(state_parts) == 0:
                raise ValueError(
                    "segments: at least one KV segment is required (a model without full-attention "
                    "layers passes [] with state_bytes: a state-only cache)"
                )
            if host_bytes is not None:
                raise ValueError(
                    "a state-only cache (no segments) takes capacity_pages (its index entries, "
                    "no bytes each), not host_bytes; capacity_states sizes its memory"
                )
        capacity_states = _arrays.int_arg("capacity_states", capacity_states, 0, i64)
        state_lookback = _arrays.int_arg("state_lookback", state_lookback, 0, 48)
        error_limit = _arrays.int_arg("error_limit", error_limit, 1, i64)
        key_bits = _arrays.int_arg("key_bits", key_bits, 1, 128)
        cuda_blocks = _arrays.int_arg("cuda_blocks", cuda_blocks, 1, 1024)
        cuda_staging_bytes = _arrays.int_arg("cuda_staging_bytes", cuda_staging_bytes, 0, 2**64 - 1)
        pool_chunk_bytes = _arrays.int_arg("pool_chunk_bytes", pool_chunk_bytes, 1, 2**64 - 1)
        cuda_path = _arrays.choice_arg("cuda_path", cuda_path, ("auto", "dma", "staged", "kernel"))  # type: ignore[assignment]
        pin_upfront = _arrays.bool_arg("pin_upfront", pin_upfront)
        copier = _arrays.choice_arg("copier", copier, ("auto", "cpu", "cuda", "deferred", "null"))  # type: ignore[assignment]
        eviction = _arrays.choice_arg("eviction", eviction, ("leaf-first", "lru"))  # type: ignore[assignment]
        if admission is None:  # a tier gets what the host stores: with one, store every page
            admission = "always" if tier is not None else "adaptive"
        admission = _arrays.choice_arg(  # type: ignore[assignment]
            "admission", admission, ("adaptive", "second-sighting", "always")
        )
        if tier is not None and not isinstance(tier, Tier):
            raise TypeError(
                f"tier must be a hicache.Tier (e.g. hicache.mooncake.MooncakeTier), not {_arrays.show(tier)}"
            )
        if (
            isinstance(tier_wait_ms, bool)
            or not isinstance(tier_wait_ms, (int, float))
            or not 0 <= tier_wait_ms <= 3.6e6
        ):
            raise ValueError(
                f"tier_wait_ms must be a number of milliseconds in [0, 3600000], not {tier_wait_ms!r}"
            )
        tier_queue_pages = _arrays.int_arg("tier_queue_pages", tier_queue_pages, 0, i64)
        if not isinstance(tier_space, str) or not tier_space:
            raise ValueError(f"tier_space must be a non-empty string, not {_arrays.show(tier_space)}")
        try:
            tier_space = str(tier_space.encode("utf-8"), "utf-8")  # a plain str, valid UTF-8
        except UnicodeEncodeError as e:
            raise ValueError(f"tier_space must be text that encodes as UTF-8: {e}") from None
        salt_bytes = _arrays.as_salt(salt)
        if salt_bytes is None:
            raise TypeError("salt must be bytes or str, not None")
        capsules = [_arrays.dlpack_arg(s, f"segment {i}", writable=True) for i, s in enumerate(segs)]
        if host_bytes is not None:
            host_bytes = _arrays.int_arg("host_bytes", host_bytes, 1, i64)
            page = sum(_arrays.block_bytes(s) for s in segs if hasattr(s, "shape"))
            capacity_pages = host_bytes // page if page > 0 else 0
            if capacity_pages < 1:
                raise ValueError(f"host_bytes={host_bytes} holds no page of {page} bytes")
        capacity_pages = _arrays.int_arg("capacity_pages", capacity_pages, 1, i64)
        layer_segments = _layer_segments(layers, len(segs))
        if prefill_tokens_per_s is not None and prefill_seconds is not None:
            raise ValueError("give at most one of prefill_tokens_per_s and prefill_seconds")
        rate = 0.0
        if prefill_tokens_per_s is not None:
            if (
                isinstance(prefill_tokens_per_s, bool)
                or not isinstance(prefill_tokens_per_s, (int, float))
                or not 0 < prefill_tokens_per_s < float("inf")
            ):
                shown = _arrays.show(prefill_tokens_per_s)
                raise ValueError(f"prefill_tokens_per_s must be a number of tokens a second > 0, not {shown}")
            rate = float(prefill_tokens_per_s)
        seconds = None  # (start, end) -> what the engine's callable returns (the core checks it)
        if prefill_seconds is not None:
            fn = _arrays.callable_arg("prefill_seconds", prefill_seconds, "(start, end) -> seconds")
            seconds = functools.partial(_arrays.call_back, fn, "prefill_seconds")

        self._segments = segs
        # Whose device picks the default stream (torch's current one for CUDA tensors).
        self._stream_of = segs or _device_marker(device)
        self._state_only = not segs
        # Torch lets an engine reallocate a tensor in place (resize_, set_): the cache would then
        # copy through a dangling pointer. Every call that copies first checks that each segment
        # still points where it did (one data_ptr() a segment: ~6 us for 128 segments).
        self._segment_tensors = [s for s in segs if _arrays.is_torch_tensor(s)]
        self._segment_ptrs = [*map(_data_ptr, self._segment_tensors)]
        self._core = _CoreCache(
            capsules,
            block_tokens,
            capacity_pages,
            keep_tokens,
            state_parts,
            capacity_states,
            state_lookback,
            salt_bytes,
            error_limit,
            key_bits,
            pool_chunk_bytes,
            copier,
            cuda_blocks,
            cuda_staging_bytes,
            cuda_path,
            pin_upfront,
            eviction,
            admission,
            tier,
            round(tier_wait_ms * 1000),
            tier_queue_pages,
            128 << 20,  # TierOptions::buffer_bytes: a put's or a get's round, 128 MiB of pages at most
            tier_space,
            layer_segments,
            rate,
            seconds,
            device,
        )
        if tier is not None:
            _with_tier.add(self)
        self.block_tokens = block_tokens
        self.layers = len(layer_segments)
        self.state_parts = state_parts
        self.state_bytes = sum(state_parts)

    def _no_blocks(self, tokens: int) -> list[int]:
        """A state-only cache's block ids: placeholders, one a page (its pages hold no bytes)."""
        return [0] * (tokens // self.block_tokens)

    def _check_segments(self) -> None:
        if self._segment_tensors and [*map(_data_ptr, self._segment_tensors)] != self._segment_ptrs:
            pairs = zip(self._segment_tensors, self._segment_ptrs, strict=True)
            tensor = next(t for t, p in pairs if t.data_ptr() != p)
            moved = next(i for i, s in enumerate(self._segments) if s is tensor)
            raise ValueError(
                f"segment {moved} no longer points to the memory the cache was built over (resized "
                "or re-set after construction?); build a new cache over the engine's current KV tensors"
            )

    def try_resume(
        self,
        request_id: str | int,
        prompt: Sequence[int] | ArrayLike,
        allocate: Allocate,
        *,
        stream: Any = None,
        state_out: ArrayLike | Sequence[ArrayLike] | None = None,
        salt: bytes | str | None = None,
    ) -> int:
        """Serve the longest cached prefix of ``prompt`` from host memory.

        On a hit, calls ``allocate(n_tokens)`` for the engine block ids that receive the pages
        (one per ``block_tokens`` tokens, or None to defer), then enqueues the copies (and the
        state into ``state_out``: a tensor, or one per part if ``state_bytes`` is a list) on
        ``stream`` (default: torch's current stream for CUDA
        segments), so work enqueued after it on that stream sees the data. The blocks and
        ``state_out`` must stay valid until those copies completed. Pages just fetched from a
        shared tier are checked by this first load: on a GPU whose ``stream`` had nothing queued,
        the device checks them where they landed and the call returns once the load is done;
        with work queued the call does not wait for it (``docs/tier.md``).

        Returns:
            tokens served (prefill starts there), 0 on a miss or a cache failure (counted, never
            raised), -1 if ``allocate`` deferred.

        Raises:
            ValueError / TypeError / IndexError: a bad argument or ``allocate`` result, named in
            the message; nothing is copied then. Whatever ``allocate`` itself raises.
        """
        return self._resume(request_id, prompt, allocate, stream, state_out, salt, None)

    def try_resume_layerwise(
        self,
        request_id: str | int,
        prompt: Sequence[int] | ArrayLike,
        allocate: Allocate,
        *,
        stream: Any = None,
        state_out: ArrayLike | Sequence[ArrayLike] | None = None,
        salt: bytes | str | None = None,
    ) -> LayerwiseLoad:
        """:meth:`try_resume`, loading layer by layer so the engine computes while it loads.

        The copies of each layer's segments (see ``layers``) are enqueued one layer after the
        other on ``stream``, which should be a copy stream of the engine's own (a
        ``torch.cuda.Stream()``): the engine starts its forward pass at once and calls
        ``load.wait(i)`` right before layer ``i`` reads the loaded blocks, which makes its
        current stream wait on the device for that layer's copies. The state (if any) arrives
        with layer 0. Only the first layers are submitted here (512 MiB after layer 0); each
        ``load.wait(i)`` submits the layers up to ``i`` and 512 MiB beyond, so submitting a large
        hit (13 ms for 43K tokens of a Llama-3-8B shape on an H200) overlaps the prefill instead
        of delaying it. ``stream`` must stay valid until the last layer is waited for; dropping
        the load gives up the layers not yet submitted. Everything else is as
        :meth:`try_resume`: the same pages, the same checks, held until :meth:`poll` sees the
        whole load complete.

        Returns:
            a :class:`LayerwiseLoad`; its ``tokens`` is what :meth:`try_resume` returns.

        Raises:
            ValueError: the cache was built without ``layers``; as :meth:`try_resume` otherwise.
        """
        if not self.layers:
            raise ValueError(
                "try_resume_layerwise needs the cache built with layers= (the segments of each layer)"
            )
        core = _CoreLoad()
        served = self._resume(request_id, prompt, allocate, stream, state_out, salt, core)
        return LayerwiseLoad(core, served, self._segments, stream)

    def _resume(
        self,
        request_id: Any,
        prompt: Any,
        allocate: Allocate,
        stream: Any,
        state_out: Any,
        salt: Any,
        layerwise: _CoreLoad | None,
    ) -> int:
        """try_resume's arguments checked, then the core's call (layer by layer with a load)."""
        rid = _arrays.as_request_id(request_id)
        tokens = _arrays.as_tokens(prompt, "prompt")
        if allocate is None and self._state_only:
            allocate = self._no_blocks
        _arrays.callable_arg("allocate", allocate, "tokens -> block ids or None")
        handle = _arrays.stream_handle(stream, self._stream_of)
        out = None if state_out is None else _state_capsules(state_out, "state_out", writable=True)
        chain_salt = _arrays.as_salt(salt)

        def alloc(n: int) -> list[int] | None:
            got = _arrays.call_back(allocate, "allocate", n)
            if got is None:
                return None
            blocks = _arrays.block_id_list(got, f"allocate({n})'s result")
            self._check_segments()  # on a hit only, just before the copies: a miss costs nothing
            return blocks

        return self._core.try_resume(rid, tokens, alloc, handle, out, chain_salt, layerwise)

    def store(
        self,
        request_id: str | int,
        tokens: Sequence[int] | ArrayLike,
        block_ids: Sequence[int] | ArrayLike,
        *,
        stream: Any = None,
        state_export: StateExport | None = None,
        salt: bytes | str | None = None,
    ) -> int:
        """Write-through after prefill: copy every full block of ``tokens`` not yet cached.

        ``block_ids[i]`` holds tokens ``[i*B, (i+1)*B)``. ``state_export(pos)`` returns the
        engine's state at ``pos`` (a tensor of ``state_bytes`` bytes, or a list of tensors, one
        per part, if ``state_bytes`` is a list) or None; the tensors must stay valid in stream
        order until the copy ran (its copy is enqueued before the next
        position is asked for, so one staging tensor may serve every call). Entries become
        hit-able after :meth:`poll` sees the copy complete. Best effort: stops when no slot is
        free, or at host memory not pinned yet (both counted).

        Returns:
            pages newly enqueued.

        Raises:
            ValueError / TypeError / IndexError: a bad argument or ``state_export`` result, named
            in the message. Whatever ``state_export`` itself raises. A call that raises
            publishes nothing.
        """
        rid = _arrays.as_request_id(request_id)
        toks = _arrays.as_tokens(tokens, "tokens")
        if block_ids is None and self._state_only:
            block_ids = self._no_blocks(len(toks))
        blocks = _arrays.as_block_ids(block_ids)
        handle = _arrays.stream_handle(stream, self._stream_of)
        chain_salt = _arrays.as_salt(salt)
        export = None
        if state_export is not None:
            _arrays.callable_arg("state_export", state_export, "position -> tensor or None")

            def export(pos: int) -> Any:
                buf = _arrays.call_back(state_export, "state_export", pos)
                what = f"state_export({pos})'s result"
                return None if buf is None else _state_capsules(buf, what, writable=False)

        self._check_segments()
        return self._core.store(rid, toks, blocks, handle, export, chain_salt)

    def prefetch(self, prompt: Sequence[int] | ArrayLike, *, salt: bytes | str | None = None) -> int:
        """With a tier: start fetching, in the background, the part of ``prompt``'s prefix that
        host memory lacks, so that a later :meth:`try_resume` of it finds the pages in host
        memory and never waits for the tier. Call it when a request arrives, before it is
        scheduled. Never blocks on the tier.

        Returns:
            pages asked of the tier (0: host memory has the prefix, there is no tier, or the
            tier's queue is full).
        """
        tokens = _arrays.as_tokens(prompt, "prompt")
        if len(tokens) == 0:
            raise ValueError("prompt is empty")
        return self._core.prefetch(tokens, _arrays.as_salt(salt))

    def flush_tier(self, timeout_s: float | None = None) -> None:
        """Wait until every page stored before this call has reached its end in the tier:
        written, failed or dropped (``stats().tier_pages_written`` / ``_failed`` /
        ``_dropped``). Stores whose copies are still running are waited for first. Without a
        tier it only retires completed transfers, as :meth:`poll`. Shutdown does the same.

        Raises:
            TimeoutError: ``timeout_s`` seconds passed first; the message says how many pages
                were still on their way (``stats().tier_pages_queued``).
        """
        number = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
        if timeout_s is not None and not (number and 0 <= timeout_s <= 1e9):
            raise ValueError(f"timeout_s must be a number of seconds >= 0 or None, not {timeout_s!r}")
        if not self._core.flush_tier(timeout_s):
            s = self._core.stats()
            raise TimeoutError(
                f"flush_tier: {s.tier_pages_queued} pages not yet written to the tier after "
                f"{timeout_s} s (written {s.tier_pages_written}, failed {s.tier_pages_failed}, "
                f"dropped {s.tier_pages_dropped})"
            )

    def tier_name(self, key: bytes) -> str:
        """The name of a page's value in the tier (a key from :func:`hicache.chain_keys`); ""
        without a tier. For operators and tests."""
        return self._core.tier_name(key)

    def poll(self) -> int:
        """Retire completed transfers (non-blocking). Returns how many were retired."""
        return self._core.poll()

    def forget(self, request_id: str | int) -> None:
        """The request finished or was aborted: its GPU blocks may be reused.

        Its stores still in flight are discarded when they complete.

        Raises:
            UnknownRequestError (a KeyError): the id was never seen or already forgotten.
        """
        self._core.forget(_arrays.as_request_id(request_id))

    def stats(self) -> CacheStats:
        """A snapshot of the counters (see :class:`CacheStats`)."""
        return self._core.stats()

    def stats_dict(self) -> dict[str, object]:
        """The counters as a plain dict (for logs and JSON)."""
        s = self._core.stats()
        names = [n for n in dir(s) if not n.startswith("_")]
        return {n: getattr(s, n) for n in names}

    def complete_transfers(self, stream: int | None = None) -> int:
        """Tests with ``copier="deferred"``: run queued copies (of one stream, or all)."""
        if stream is not None:
            stream = _arrays.int_arg("stream", stream, 0, 2**64 - 1)
        return self._core.complete_transfers(stream)

    def page_lru_order(self) -> list[bytes]:
        """Keys of cached pages, least recently used first (tests and debugging)."""
        return self._core.page_lru_order()

    @property
    def page_bytes(self) -> int:
        return self._core.page_bytes

    @property
    def copy_path(self) -> str:
        """How pages move: ``"cpu"``; on a GPU ``"dma"`` (chunks >= 1 MiB, or pages >= 256 KiB of
        one or two chunks >= 128 KiB), ``"staged"`` (other pages >= 512 KiB: DMA through a device
        staging buffer + an HBM scatter kernel) or ``"kernel"`` (a copy kernel across PCIe);
        ``"deferred"`` or ``"null"`` for those copiers."""
        return self._core.copy_path

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def device(self) -> str:
        return self._core.device


class LayerwiseLoad:
    """A hit loaded layer by layer (:meth:`HostPrefixCache.try_resume_layerwise`)."""

    def __init__(self, core: _CoreLoad, tokens: int, segments: Sequence[Any], stream: Any = None) -> None:
        self._core = core
        self._segments = segments
        self._stream = stream  # later layers are submitted to it: kept alive while this is
        #: tokens served (prefill starts there), 0 on a miss, -1 if ``allocate`` deferred.
        self.tokens = tokens

    @property
    def layers(self) -> int:
        """Layers with copies to wait for (0 on a miss)."""
        return int(self._core.layers)

    def ready(self, layer: int) -> bool:
        """Whether layer ``layer``'s copies completed (non-blocking; True on a miss). Submits
        them first if they were not yet.

        Raises:
            hicache.CacheError: as :meth:`wait`.
        """
        return bool(self._core.ready(_arrays.int_arg("layer", layer, 0, 2**63 - 1)))

    def wait(self, layer: int, stream: Any = None) -> None:
        """Makes work enqueued on ``stream`` (default: torch's current stream) after this call
        wait until layer ``layer`` is loaded, on the device: the calling thread does not block
        (on the CPU, where copies are synchronous, there is nothing to wait for). Submits the
        layer's copies (and 512 MiB of the next layers') first if they were not yet.

        Raises:
            hicache.CacheError: the layer's copies could not be submitted (a device failure, counted
                in ``stats().errors``), or the cache was destroyed first: the hit is lost from
                this layer on, and the engine must recompute the request.
        """
        layer = _arrays.int_arg("layer", layer, 0, 2**63 - 1)
        self._core.wait(layer, _arrays.stream_handle(stream, self._segments))

    def synchronize(self) -> None:
        """Submits what is left and blocks until every layer is loaded (raises as :meth:`wait`)."""
        self._core.synchronize()


def _layer_segments(layers: Any, n_segments: int) -> list[int]:
    """Segments per layer from ``layers=``: a count splitting them evenly, or a list."""
    if layers is None:
        return []
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        n = _arrays.int_arg("layers", layers, 1, n_segments)
        if n_segments % n:
            raise ValueError(
                f"layers={n} does not split the {n_segments} segments evenly; give the segments of each layer"
            )
        return [n_segments // n] * n
    try:
        counts = [_arrays.int_arg(f"layers[{i}]", c, 1, n_segments) for i, c in enumerate(layers)]
    except TypeError:
        raise TypeError(
            f"layers must be a number of layers or a list of segments per layer, not {_arrays.show(layers)}"
        ) from None
    if sum(counts) != n_segments:
        raise ValueError(
            f"layers={counts} must add up to the {n_segments} segments (they add up to {sum(counts)})"
        )
    return counts


def _state_parts(state_bytes: Any) -> list[int]:
    """The bytes of each part of a state: [] without states, [n] for one tensor."""
    i64 = 2**63 - 1
    if isinstance(state_bytes, (list, tuple)):
        if not state_bytes:
            raise ValueError("state_bytes: an empty list; give 0 for a model without state")
        return [_arrays.int_arg(f"state_bytes[{i}]", n, 1, i64) for i, n in enumerate(state_bytes)]
    n = _arrays.int_arg("state_bytes", state_bytes, 0, i64)
    return [n] if n > 0 else []


def _state_capsules(state: Any, what: str, *, writable: bool) -> list[Any]:
    """DLPack capsules of a state: one tensor, or a list or tuple of them (one per part)."""
    if isinstance(state, (list, tuple)):
        return [_arrays.dlpack_arg(t, f"{what} part {i}", writable=writable) for i, t in enumerate(state)]
    return [_arrays.dlpack_arg(state, what, writable=writable)]


def _device_marker(device: str) -> list[Any]:
    """For a state-only cache on CUDA: a tensor on that device, whose current stream is the
    default one (a cache with segments uses its first segment)."""
    if not device.startswith("cuda"):
        return [None]
    import torch

    return [torch.empty(0, device=device)]


def _state_device(device: Any) -> str:
    """``state_device`` as the core's "cpu" or "cuda:N" (a str or a torch.device)."""
    if device is None:
        return "cpu"
    if hasattr(device, "type") and hasattr(device, "index") and not isinstance(device, str):
        device = device.type if device.index is None else f"{device.type}:{device.index}"
    if not isinstance(device, str):
        raise TypeError(f"state_device must be 'cpu', 'cuda:N' or a torch.device, not {_arrays.show(device)}")
    if device == "cuda":
        return "cuda:0"
    head, _, index = device.partition(":")
    if device != "cpu" and not (head == "cuda" and index.isdigit() and index.isascii()):
        raise ValueError(f"state_device must be 'cpu' or 'cuda:N', not {device!r}")
    return device
