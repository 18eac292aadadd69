"""A pure-Python model of HostPrefixCache: the oracle of the differential tests.

It implements the policy of DESIGN.md with plain dicts and an OrderedDict LRU, over numpy
segments, and models the copiers: "cpu" copies at once; "deferred" queues copies per stream and
runs them at :meth:`complete_transfers`, as DeferredCopier does. Every return value and counter
must equal the C++ core's after every operation; bytes move exactly as the core moves them.
It is written for clarity, not speed, and has no failure injection.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .hash_chain import reference_chain_keys


@dataclass(eq=False)
class _Entry:
    key: bytes
    serial: int
    parent_serial: int
    tokens: tuple[int, ...] = ()
    data: bytes = b""
    refs: int = 1
    ready: bool = False


class _Index:
    def __init__(self, capacity: int, leaf_first: bool = False) -> None:
        self.capacity = capacity
        self.leaf_first = leaf_first
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.children: dict[int, int] = {}  # parent serial -> cached children
        self.evictions = 0

    def _evictable(self, e: _Entry) -> bool:
        return e.refs == 0 and not (self.leaf_first and e.serial in self.children)

    def _drop(self, e: _Entry) -> None:
        left = self.children.get(e.parent_serial, 0) - 1
        if left > 0:
            self.children[e.parent_serial] = left
        else:
            self.children.pop(e.parent_serial, None)
        del self.entries[e.key]

    def find(self, key: bytes) -> _Entry | None:
        return self.entries.get(key)

    def insert(self, key: bytes, serial: int, parent_serial: int) -> _Entry | None:
        if len(self.entries) >= self.capacity:
            victim = next((e for e in self.entries.values() if self._evictable(e)), None)
            if victim is None:
                return None
            self._drop(victim)
            self.evictions += 1
        e = _Entry(key, serial, parent_serial)
        self.entries[key] = e
        self.children[parent_serial] = self.children.get(parent_serial, 0) + 1
        return e

    def erase(self, e: _Entry) -> None:
        assert e.refs == 0
        self._drop(e)

    def touch(self, e: _Entry) -> None:
        self.entries.move_to_end(e.key)

    def busy(self) -> int:
        return sum(1 for e in self.entries.values() if e.refs > 0)


def _fingerprint(key: bytes) -> int:
    fp = int.from_bytes(key[:8], "little")
    return 1 if fp == 0 else fp  # the C++ tables store fingerprint 0 as 1


class _Ghost:
    """GhostKeys: two generations of fingerprints; the newer is retired when it fills."""

    def __init__(self, generation: int) -> None:
        self.generation = max(1, generation)
        self.newer: set[int] = set()
        self.older: set[int] = set()

    def __contains__(self, fp: int) -> bool:
        return fp in self.newer or fp in self.older

    def record(self, fp: int) -> None:
        if fp in self.newer:
            return
        self.newer.add(fp)
        if len(self.newer) >= self.generation:
            self.older, self.newer = self.newer, set()


class _MiniLru:
    def __init__(self, capacity: int, ghost_generation: int) -> None:
        self.capacity = max(1, capacity)
        self.ghost = _Ghost(ghost_generation) if ghost_generation else None
        self.lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.hits = 0.0

    def access(self, fp: int) -> None:
        if fp in self.lru:
            self.lru.move_to_end(fp)
            self.hits += 1.0
            return
        if len(self.lru) >= self.capacity:
            if self.ghost is not None and fp not in self.ghost:
                self.ghost.record(fp)
                return
            self.lru.popitem(last=False)
        self.lru[fp] = None


class _Admission:
    """AdmissionPolicy: "always", "second-sighting" or "adaptive", as admission_policy.cpp."""

    def __init__(self, kind: str, capacity: int) -> None:
        self.kind = kind
        self.ghost = _Ghost(4 * capacity)
        self.seen: list[bool] = []
        self.sample = min(max(capacity // 256, 1), 32)
        self.write_through = _MiniLru(capacity // self.sample, 0)
        self.second = _MiniLru(capacity // self.sample, max(1, 4 * (capacity // self.sample)))
        self.second_sighting = kind == "second-sighting"

    def observe(self, keys: list[bytes]) -> None:
        """A store begins: its first keys (observe_more adds the rest of its installments)."""
        if self.kind == "always":
            return
        if self.kind == "adaptive":  # chosen from the stores before this one
            self.write_through.hits *= 0.999
            self.second.hits *= 0.999
            self.second_sighting = self.second.hits > self.write_through.hits
        self.seen = []
        self.observe_more(keys)

    def observe_more(self, keys: list[bytes]) -> None:
        if self.kind == "always":
            return
        fps = [_fingerprint(k) for k in keys]
        if self.kind == "adaptive":
            for k, fp in zip(keys, fps, strict=True):
                if (int.from_bytes(k[:8], "little") >> 32) % self.sample != 0:
                    continue
                self.write_through.access(fp)
                self.second.access(fp)
        for fp in fps:  # key by key: seen, then recorded (GhostKeys::check_and_record)
            self.seen.append(fp in self.ghost)
            self.ghost.record(fp)

    def admit(self, i: int, pool_full: bool) -> bool:
        if self.kind == "always":
            return True
        return not pool_full or not self.second_sighting or (i < len(self.seen) and self.seen[i])


@dataclass(eq=False)
class _Transfer:
    request: str
    is_store: bool
    stream: int
    serial: int
    pages: list[_Entry] = field(default_factory=list)
    states: list[_Entry] = field(default_factory=list)
    discard: bool = False
    open: bool = False  # its store() is still running: not retired, so never published yet


class _Stream:
    def __init__(self) -> None:
        self.queue: list[Callable[[], None]] = []
        self.recorded = 0
        self.completed = 0


class ReferenceCache:
    """Same constructor arguments and methods as :class:`hicache.HostPrefixCache` (numpy only)."""

    def __init__(
        self,
        segments: Sequence[np.ndarray],
        *,
        block_tokens: int = 128,
        capacity_pages: int,
        keep_tokens: int = 1,
        state_bytes: int = 0,
        capacity_states: int = 0,
        state_lookback: int = 4,
        salt: bytes = b"",
        copier: str = "cpu",
        key_bits: int = 128,
        eviction: str = "leaf-first",
        admission: str = "adaptive",
    ) -> None:
        self.segments = list(segments)
        self.block_tokens = block_tokens
        self.keep_tokens = keep_tokens
        self.state_bytes = state_bytes
        self.state_lookback = state_lookback
        self.salt = salt
        self.deferred = copier == "deferred"
        self.key_bits = key_bits
        self.leaf_first = eviction == "leaf-first"
        self.pages = _Index(capacity_pages, self.leaf_first)
        self.admission = _Admission(admission, capacity_pages)
        self.states = _Index(capacity_states if state_bytes > 0 else 0)
        self.transfers: list[_Transfer] = []
        self.requests: dict[str, int] = {}
        self.roots: dict[bytes, int] = {}
        self.next_serial = 1
        self.streams: dict[int, _Stream] = {}
        self.c = dict.fromkeys(
            "lookups lookup_tokens hits hit_tokens deferred stores store_skips collisions pages_declined "
            "pages_stored pages_discarded pages_loaded states_stored states_discarded states_loaded".split(),
            0,
        )

    # --- the copier model -----------------------------------------------------------------

    def _num_blocks(self) -> int:
        return self.segments[0].shape[0]

    def _read_page(self, block: int) -> bytes:
        return b"".join(s[block].tobytes() for s in self.segments)

    def _write_page(self, block: int, data: bytes) -> None:
        off = 0
        for s in self.segments:
            n = s[block].nbytes
            s[block] = np.frombuffer(data[off : off + n], dtype=s.dtype).reshape(s[block].shape)
            off += n

    def _enqueue(self, stream: int, op: Callable[[], None]) -> None:
        if self.deferred:
            self.streams.setdefault(stream, _Stream()).queue.append(op)
        else:
            op()

    def _record(self, stream: int) -> int:
        st = self.streams.setdefault(stream, _Stream())
        st.recorded += 1
        if not self.deferred:
            st.completed = st.recorded
        return st.recorded

    def complete_transfers(self, stream: int | None = None) -> int:
        n = 0
        for handle, st in sorted(self.streams.items()):  # DeferredCopier runs streams by handle
            if stream is not None and handle != stream:
                continue
            n += len(st.queue)
            for op in st.queue:
                op()
            st.queue.clear()
            st.completed = st.recorded
        return n

    # --- bookkeeping ----------------------------------------------------------------------

    def _serial(self) -> int:
        s = self.next_serial
        self.next_serial += 1
        return s

    def _root(self, salt: bytes) -> int:
        if salt not in self.roots:
            self.roots[salt] = self._serial()
        return self.roots[salt]

    def _register(self, t: _Transfer) -> None:
        self.requests[t.request] = self.requests.get(t.request, 0) + 1
        self.transfers.append(t)

    def _retire(self) -> int:
        n = 0
        for t in list(self.transfers):
            if t.open or self.streams[t.stream].completed < t.serial:
                continue
            if t.is_store:  # what a store did is known now: published, or discarded
                kind = "discarded" if t.discard else "stored"
                self.c[f"pages_{kind}"] += len(t.pages)
                self.c[f"states_{kind}"] += len(t.states)
            for index, entries in ((self.pages, t.pages), (self.states, t.states)):
                for e in entries:
                    e.refs -= 1
                    if not t.is_store:
                        continue
                    if not t.discard:
                        e.ready = True
                    elif e.refs == 0:
                        index.erase(e)
            if t.request in self.requests:
                self.requests[t.request] -= 1
            self.transfers.remove(t)
            n += 1
        return n

    def _touch_chain(self, chain: list[_Entry]) -> None:
        # The last page touched becomes the most recently used: leaf-first ages leaves first.
        for e in reversed(chain) if self.leaf_first else chain:
            self.pages.touch(e)

    def _keys(self, tokens: np.ndarray, salt: bytes, max_pages: int | None = None) -> list[bytes]:
        keys = reference_chain_keys(tokens, self.block_tokens, salt, self.key_bits)
        return keys if max_pages is None else keys[: max(0, max_pages)]

    # --- the policy -----------------------------------------------------------------------

    def try_resume(
        self,
        request_id: str,
        prompt: np.ndarray,
        allocate: Callable[[int], Sequence[int] | None],
        *,
        stream: int = 0,
        state_out: np.ndarray | None = None,
        salt: bytes | None = None,
    ) -> int:
        prompt = np.asarray(prompt, dtype=np.int32)
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if self.state_bytes > 0 and (state_out is None or state_out.nbytes != self.state_bytes):
            raise ValueError("state_out required")
        B = self.block_tokens
        chain_salt = self.salt if salt is None else salt
        keys = self._keys(prompt, chain_salt, max(0, len(prompt) - self.keep_tokens) // B)
        self._retire()
        self.requests.setdefault(request_id, 0)
        self.c["lookups"] += 1
        self.c["lookup_tokens"] += len(prompt)
        if not keys:
            return 0
        matched: list[_Entry] = []
        parent = self._root(chain_salt)
        for i, key in enumerate(keys):
            e = self.pages.find(key)
            page = tuple(int(x) for x in prompt[i * B : (i + 1) * B])
            if e is None or not e.ready or e.parent_serial != parent or e.tokens != page:
                break
            matched.append(e)
            parent = e.serial
        h = len(matched)
        state = None
        if self.state_bytes > 0:
            while h > 0:
                s = self.states.find(keys[h - 1])
                if s is not None and s.ready and s.parent_serial == matched[h - 1].serial:
                    state = s
                    break
                h -= 1
        if h == 0:
            return 0
        matched = matched[:h]
        blocks = allocate(h * B)
        if blocks is None:
            self.c["deferred"] += 1
            return -1
        blocks = [int(b) for b in blocks]
        if len(blocks) != h:
            raise ValueError("wrong number of block ids")
        if any(b < 0 or b >= self._num_blocks() for b in blocks):
            raise IndexError("block id out of range")
        if len(set(blocks)) != len(blocks):
            raise ValueError("duplicate block id")
        for e in matched:
            e.refs += 1
        if state is not None:
            state.refs += 1
        pairs = list(zip(matched, blocks, strict=True))
        self._enqueue(stream, lambda: [self._write_page(b, e.data) for e, b in pairs])
        if state is not None:
            out = state_out
            assert out is not None
            self._enqueue(
                stream,
                lambda s=state: (
                    out.view(np.uint8).reshape(-1).__setitem__(slice(None), np.frombuffer(s.data, np.uint8))
                ),
            )
        t = _Transfer(request_id, False, stream, self._record(stream), matched, [state] if state else [])
        self._register(t)
        self._touch_chain(matched)
        if state is not None:
            self.states.touch(state)
        self.c["hits"] += 1
        self.c["hit_tokens"] += h * B
        self.c["pages_loaded"] += h
        self.c["states_loaded"] += 1 if state is not None else 0
        return h * B

    def store(
        self,
        request_id: str,
        tokens: np.ndarray,
        block_ids: Sequence[int],
        *,
        stream: int = 0,
        state_export: Callable[[int], np.ndarray | None] | None = None,
        salt: bytes | None = None,
    ) -> int:
        tokens = np.asarray(tokens, dtype=np.int32)
        B = self.block_tokens
        n_full = len(tokens) // B
        if len(block_ids) < n_full:
            raise ValueError("too few block ids")
        if any(b < 0 or b >= self._num_blocks() for b in block_ids[:n_full]):
            raise IndexError("block id out of range")
        chain_salt = self.salt if salt is None else salt
        keys = self._keys(tokens, chain_salt)
        self._retire()
        self.requests.setdefault(request_id, 0)
        self.c["stores"] += 1
        # The cached prefix (found by content in C++, without hashing), then installments: the
        # prefix and 16 pages, then as many again as the store has so far, each admitted and
        # copied before the next is observed, as HostPrefixCache::store does.
        cached, parent = 0, self._root(chain_salt)
        for i in range(n_full):
            e = self.pages.find(keys[i])
            page = tuple(int(x) for x in tokens[i * B : (i + 1) * B])
            if e is None or e.parent_serial != parent or e.tokens != page:
                break
            cached, parent = i + 1, e.serial
        bounds = [0, min(n_full, cached + 16)]
        while bounds[-1] < n_full:
            bounds.append(min(n_full, 2 * bounds[-1]))
        self.admission.observe(keys[: bounds[1]])
        new: list[_Entry] = []
        chain: list[_Entry] = []
        held: list[_Entry] = []
        skipped = False
        stopped = False
        parent = self._root(chain_salt)
        for lo, hi in itertools.pairwise(bounds):
            if lo > 0:
                self.admission.observe_more(keys[lo:hi])
            moves: list[tuple[int, _Entry]] = []
            fresh: list[_Entry] = []
            for i in range(lo, hi):
                page = tuple(int(x) for x in tokens[i * B : (i + 1) * B])
                e = self.pages.find(keys[i])
                if e is not None:
                    same = e.tokens == page
                    if same and e.parent_serial == parent:
                        e.refs += 1
                        held.append(e)
                        chain.append(e)
                        parent = e.serial
                        continue
                    if not same:
                        self.c["collisions"] += 1
                        skipped = stopped = True
                        break
                    if e.refs != 0:
                        skipped = stopped = True
                        break
                full = len(self.pages.entries) >= self.pages.capacity and e is None
                if not self.admission.admit(i, full):
                    self.c["pages_declined"] += n_full - i
                    stopped = True
                    break
                if e is not None:
                    self.pages.erase(e)
                e = self.pages.insert(keys[i], self._serial(), parent)
                if e is None:
                    skipped = stopped = True
                    break
                e.tokens = page
                moves.append((int(block_ids[i]), e))
                fresh.append(e)
                chain.append(e)
                parent = e.serial
            if moves:
                batch = list(moves)  # one copy op per installment, as the copiers do
                self._enqueue(stream, lambda b=batch: [setattr(e, "data", self._read_page(k)) for k, e in b])
                self._register(_Transfer(request_id, True, stream, self._record(stream), fresh, open=True))
                new += fresh
            if stopped:
                self.admission.observe_more(keys[hi:n_full])  # the rest, as C++ does
                break
        for e in held:
            e.refs -= 1
        self._touch_chain(chain)
        try:
            if self.state_bytes > 0 and state_export is not None:
                serials = [e.serial for e in chain]
                for j in range(self.state_lookback):
                    idx = n_full - 1 - state_boundary_distance(j)
                    if idx < 0:
                        break
                    if idx >= len(serials):
                        continue
                    if not self._store_state(
                        request_id, keys[idx], serials[idx], (idx + 1) * B, stream, state_export
                    ):
                        skipped = True
        except BaseException:
            for t in self.transfers:  # still open: this call's; a store that raises publishes nothing
                if t.open:
                    t.open, t.discard = False, True
            raise
        for t in self.transfers:  # a nested store (from state_export) closed its own already
            t.open = False
        if skipped:
            self.c["store_skips"] += 1
        return len(new)

    def _store_state(
        self,
        request_id: str,
        key: bytes,
        page_serial: int,
        position: int,
        stream: int,
        state_export: Callable[[int], np.ndarray | None],
    ) -> bool:
        s = self.states.find(key)
        if s is not None and s.parent_serial == page_serial:
            self.states.touch(s)
            return True
        buf = state_export(position)
        if buf is None:
            return True
        if buf.nbytes != self.state_bytes:
            raise ValueError("state_export returned the wrong size")
        if s is not None:
            if s.refs != 0:
                return False
            self.states.erase(s)
        e = self.states.insert(key, self._serial(), page_serial)
        if e is None:
            return False
        src = buf
        self._enqueue(stream, lambda: setattr(e, "data", src.tobytes()))
        self._register(_Transfer(request_id, True, stream, self._record(stream), [], [e], open=True))
        return True

    def poll(self) -> int:
        return self._retire()

    def forget(self, request_id: str) -> None:
        self._retire()
        if request_id not in self.requests:
            raise KeyError(request_id)
        for t in self.transfers:
            if t.is_store and t.request == request_id:
                t.discard = True
        del self.requests[request_id]

    def stats(self) -> dict[str, int]:
        return {
            **self.c,
            "pages_evicted": self.pages.evictions,
            "states_evicted": self.states.evictions,
            "transfers_in_flight": len(self.transfers),
            "pages_used": len(self.pages.entries),
            "pages_busy": self.pages.busy(),
            "states_used": len(self.states.entries),
            "states_busy": self.states.busy(),
            "requests": len(self.requests),
        }

    def page_lru_order(self) -> list[bytes]:
        return list(self.pages.entries.keys())


def state_boundary_distance(j: int) -> int:
    """Blocks between a prompt's last boundary and the j-th whose state is stored: 0, 1, 2, 4..."""
    return j if j < 2 else 1 << (j - 1)
