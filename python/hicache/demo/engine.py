"""A paged-attention engine that calls hicache exactly as a production scheduler would:
``try_resume`` before prefill, ``store`` after it, ``poll`` every step, ``forget`` at the end.

KV of full-attention layers lives in a block pool (one K and one V tensor per layer, first
dimension = block id; 128-token blocks by default) addressed through per-request block tables.
Sliding-window layers keep, per request, a ring of the last ``window`` tokens' K and V: that ring
is the model's *state*, exported to hicache at block boundaries and imported on a hit.

Prefill runs in chunks of ``prefill_chunk`` tokens (a multiple of the block; one block by
default) aligned to multiples of it, layer by layer: each layer runs over every chunk of the
prompt's uncached part before the next layer starts, as one forward pass over the whole suffix.
Only whole chunks are stored and a hit is used up to a chunk boundary, so every cached token
was computed in a full chunk, exactly as a recompute computes it: a resumed request performs
the same computations on the same inputs as a full recompute for every token after the hit
(matrix products can depend on how many rows they get, so chunk sizes must match too), and its
outputs are bit-identical. This is what lets the demo compare generated tokens with and without
the cache. Larger chunks prefill faster (bigger matrix products) and leave up to a chunk of each
prompt uncached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._core import Tier
from ..cache import HostPrefixCache, LayerwiseLoad
from .model import TinyTransformer


@dataclass
class RequestResult:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    generated: list[int]
    ttft_s: float
    load_s: float = 0.0  # try_resume, with the copies finished (GPU: synchronized)
    hit_bytes: int = 0
    loaded_tokens: int = 0  # tokens hicache loaded (cached_tokens is what the prefill skipped)
    resume_s: float = 0.0  # the engine thread's time inside try_resume (copies enqueued, not done)


@dataclass
class _Sequence:
    table: list[int]
    # The same block ids on the model's device, made before the request's clock starts: an
    # index built from a list during the prefill is a synchronous host-to-device copy, which
    # stalls the GPU at every layer and queues behind a large load on the DMA engines.
    blocks: torch.Tensor
    ring_k: dict[int, torch.Tensor] = field(default_factory=dict)
    ring_v: dict[int, torch.Tensor] = field(default_factory=dict)
    # The request's K/V of full-attention layers, contiguous, next to the paged pool: attention
    # reads a prefix view of these instead of gathering the blocks again for every chunk.
    k_buf: dict[int, torch.Tensor] = field(default_factory=dict)
    v_buf: dict[int, torch.Tensor] = field(default_factory=dict)
    # A layer-wise load in flight: each full-attention layer waits for its copies before its
    # first chunk touches its blocks (and takes the served prefix into k_buf/v_buf then).
    load: LayerwiseLoad | None = None
    served: int = 0  # tokens of the load the prefill uses
    waiting: set[int] = field(default_factory=set)  # full layers not yet waited for


class PagedEngine:
    def __init__(
        self,
        model: TinyTransformer,
        *,
        num_blocks: int,
        block_tokens: int = 128,
        cache_pages: int = 0,
        state_slots: int = 0,
        state_lookback: int = 2,
        keep_tokens: int = 1,
        cuda_blocks: int = 4,
        measure_load: bool = False,
        prefill_chunk: int | None = None,
        tier: Tier | None = None,
        tier_space: str = "demo",
        layerwise: bool = False,
        prefill_tokens_per_s: float | None = None,
        prefill_seconds: Callable[[int, int], float] | None = None,
    ) -> None:
        self.model, self.cfg, self.B = model, model.cfg, block_tokens
        cfg, dev, dt = model.cfg, model.device, model.dtype
        self.C = prefill_chunk or block_tokens
        if self.C % block_tokens != 0 or self.C < block_tokens:
            raise ValueError(f"prefill_chunk={self.C} must be a multiple of block_tokens={block_tokens}")
        if self.C != block_tokens and cfg.window:
            raise ValueError(
                "a hybrid model prefills block by block: its states are taken at block boundaries"
            )
        self.full_layers = [layer for layer in range(cfg.n_layers) if not cfg.is_sliding(layer)]
        self.sliding_layers = [layer for layer in range(cfg.n_layers) if cfg.is_sliding(layer)]
        if not self.full_layers:
            raise ValueError("the demo model needs at least one full-attention layer")
        shape = (num_blocks, block_tokens, cfg.n_kv_heads, cfg.head_dim)
        self.k_pool = {layer: torch.zeros(shape, device=dev, dtype=dt) for layer in self.full_layers}
        self.v_pool = {layer: torch.zeros(shape, device=dev, dtype=dt) for layer in self.full_layers}
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ring_elems = cfg.window * cfg.n_kv_heads * cfg.head_dim
        self.state_elems = 2 * len(self.sliding_layers) * self.ring_elems
        self.staging = torch.zeros(max(self.state_elems, 1), device=dev, dtype=dt)
        self.state_lookback = state_lookback
        self.measure_load = measure_load
        self.layerwise = layerwise
        # Layer-wise loads run on a copy stream of their own, beside the prefill.
        self.copy_stream = torch.cuda.Stream(dev) if layerwise and dev.type == "cuda" else None
        self.cache: HostPrefixCache | None = None
        if cache_pages > 0:
            segments = [t for layer in self.full_layers for t in (self.k_pool[layer], self.v_pool[layer])]
            state_bytes = self.state_elems * self.staging.element_size()
            self.cache = HostPrefixCache(
                segments,
                block_tokens=block_tokens,
                capacity_pages=cache_pages,
                keep_tokens=keep_tokens,
                state_bytes=state_bytes,
                capacity_states=(state_slots or cache_pages) if state_bytes else 0,
                state_lookback=state_lookback,
                cuda_blocks=cuda_blocks,
                tier=tier,
                tier_space=tier_space,
                tier_wait_ms=1000.0,  # the demo shows what the tier serves, not its deadline
                layers=len(self.full_layers),  # K and V of each full-attention layer
                prefill_tokens_per_s=prefill_tokens_per_s,
                prefill_seconds=prefill_seconds,
            )
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in self.k_pool.values()) * 2

    # --- the forward pass: aligned chunks, layer by layer ------------------------------------

    def _forward(
        self, seq: _Sequence, spans: list[tuple[torch.Tensor, int]], rings_at: set[int] | None = None
    ) -> tuple[list[torch.Tensor], dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]]:
        """Runs consecutive spans (tokens, first position): the prefill's aligned chunks, or one
        decoded token. Layer by layer, each layer over every span in order, as an engine runs one
        forward pass over a whole suffix: a layer-wise load then overlaps every span's compute of
        layer i with the copies of later layers, not only the first span's. Each (span, layer)
        step computes exactly what span by span would (same inputs, same shapes), so the order
        leaves every output bit-identical. Writes the spans' K/V into the pool and advances the
        rings; returns each span's hidden states and, for each position in `rings_at` that ends a
        span, each sliding layer's ring there."""
        m, cfg, B = self.model, self.cfg, self.B
        steps = []
        for tokens, c0 in spans:
            c1 = c0 + tokens.shape[0]
            # The pool slot of each token: its block's id * B + its offset in the block.
            table = seq.blocks[c0 // B : (c1 - 1) // B + 1]
            slots = (table[:, None] * B + torch.arange(B, device=m.device)[None, :]).reshape(-1)
            slots = slots[c0 % B : c0 % B + (c1 - c0)]
            steps.append((c0, c1, torch.arange(c0, c1, device=m.device), slots))
        hs = [m.embed_tokens(tokens) for tokens, _ in spans]
        rings: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for layer in range(cfg.n_layers):
            if layer in seq.waiting:
                self._take_layer(seq, layer)
            for i, (c0, c1, pos, slots) in enumerate(steps):
                q, k, v = m.qkv(layer, hs[i], pos)
                if cfg.is_sliding(layer):
                    kk = torch.cat([seq.ring_k[layer], k])
                    vv = torch.cat([seq.ring_v[layer], v])
                    kpos = torch.arange(c0 - cfg.window, c1, device=m.device)
                    hs[i] = m.attend_and_mlp(layer, hs[i], q, kk, vv, pos, kpos)
                    seq.ring_k[layer], seq.ring_v[layer] = kk[-cfg.window :], vv[-cfg.window :]
                    if rings_at and c1 in rings_at:
                        rings.setdefault(c1, {})[layer] = (seq.ring_k[layer], seq.ring_v[layer])
                else:
                    # Into the paged pool (what hicache stores), and the request's contiguous copy.
                    self.k_pool[layer].view(-1, cfg.n_kv_heads, cfg.head_dim).index_copy_(0, slots, k)
                    self.v_pool[layer].view(-1, cfg.n_kv_heads, cfg.head_dim).index_copy_(0, slots, v)
                    seq.k_buf[layer][c0:c1] = k
                    seq.v_buf[layer][c0:c1] = v
                    kk, vv = seq.k_buf[layer][:c1], seq.v_buf[layer][:c1]
                    kpos = torch.arange(0, c1, device=m.device)
                    hs[i] = m.attend_and_mlp(layer, hs[i], q, kk, vv, pos, kpos)
        return hs, rings

    def _chunk(self, seq: _Sequence, tokens: torch.Tensor, c0: int) -> torch.Tensor:
        """One span (a decoded token): its last hidden state."""
        return self._forward(seq, [(tokens, c0)])[0][0][-1]

    def _take_served(self, seq: _Sequence, layer: int) -> None:
        """The served prefix of a full layer's loaded blocks into the request's contiguous K/V."""
        cfg, start = self.cfg, seq.served
        if start == 0:
            return
        hit = seq.blocks[: start // self.B]
        shape = (start, cfg.n_kv_heads, cfg.head_dim)
        seq.k_buf[layer][:start] = self.k_pool[layer][hit].reshape(shape)
        seq.v_buf[layer][:start] = self.v_pool[layer][hit].reshape(shape)

    def _take_layer(self, seq: _Sequence, layer: int) -> None:
        """Layer-wise: this layer's copies must land before the compute stream touches its
        blocks (reads the served ones, or overwrites loaded ones past a chunk boundary)."""
        assert seq.load is not None
        seq.load.wait(self.full_layers.index(layer))  # the device waits, not this thread
        seq.waiting.discard(layer)
        self._take_served(seq, layer)

    # --- state: the rings of the sliding layers, flattened into the staging tensor --------

    def _snapshot(self, rings: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for layer in self.sliding_layers for t in rings[layer]])

    def _import_state(self, seq: _Sequence) -> None:
        cfg, e = self.cfg, self.ring_elems
        for i, layer in enumerate(self.sliding_layers):
            shape = (cfg.window, cfg.n_kv_heads, cfg.head_dim)
            seq.ring_k[layer] = self.staging[2 * i * e : (2 * i + 1) * e].view(shape).clone()
            seq.ring_v[layer] = self.staging[(2 * i + 1) * e : (2 * i + 2) * e].view(shape).clone()

    # --- one request ------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def run_request(self, request_id: str, prompt: list[int], max_new_tokens: int) -> RequestResult:
        """Prefill (from the cache when it can) and greedy decoding; returns tokens and TTFT."""
        m, cfg, B = self.model, self.cfg, self.B
        L = len(prompt)
        need = (L + max_new_tokens + B - 1) // B
        if need > len(self.free):
            raise RuntimeError(f"request {request_id} needs {need} blocks, {len(self.free)} free")
        table = [self.free.pop() for _ in range(need)]
        seq = _Sequence(table, torch.tensor(table, device=m.device))
        zeros = torch.zeros(cfg.window, cfg.n_kv_heads, cfg.head_dim, device=m.device, dtype=m.dtype)
        for layer in self.sliding_layers:
            seq.ring_k[layer], seq.ring_v[layer] = zeros.clone(), zeros.clone()
        kv_shape = (need * B, cfg.n_kv_heads, cfg.head_dim)
        for layer in self.full_layers:
            seq.k_buf[layer] = torch.empty(kv_shape, device=m.device, dtype=m.dtype)
            seq.v_buf[layer] = torch.empty(kv_shape, device=m.device, dtype=m.dtype)
        tokens = torch.tensor(prompt, device=m.device)
        self._sync()
        t0 = time.perf_counter()
        start, load_s, resume_s, got = 0, 0.0, 0.0, 0
        C = self.C
        if self.cache is not None:
            state_out = self.staging if self.state_elems else None
            alloc = lambda n: seq.table[: n // B]  # noqa: E731
            if self.layerwise:
                seq.load = self.cache.try_resume_layerwise(
                    request_id, tokens, alloc, stream=self.copy_stream, state_out=state_out
                )
                got = seq.load.tokens
            else:
                got = self.cache.try_resume(request_id, tokens, alloc, state_out=state_out)
            resume_s = time.perf_counter() - t0
            # Used up to a chunk boundary (a chain cut by eviction can end inside a chunk): the
            # rest of the loaded blocks is recomputed, as a recompute would compute it.
            start = got // C * C
            seq.served = start
            if got > 0 and self.layerwise:
                seq.waiting = set(self.full_layers)
                if self.state_elems:
                    assert seq.load is not None
                    seq.load.wait(0)  # the state arrives with layer 0
            elif start > 0:
                for layer in self.full_layers:  # on this stream, after the copies
                    self._take_served(seq, layer)
            if start > 0 and self.state_elems:
                self._import_state(seq)
            if self.measure_load:
                self._sync()
                load_s = time.perf_counter() - t0
        # Prefill the rest: its aligned chunks, layer by layer; keep the states store() may ask for.
        n_full = L // C * C // B  # blocks of whole chunks: the only ones stored
        wanted = {(n_full - j) * B for j in range(self.state_lookback)} if self.state_elems else set()
        spans = [(tokens[c0 : min(c0 + C, L)], c0) for c0 in range(start, L, C)]
        assert spans, "keep_tokens >= 1 leaves at least one token to compute"
        hs, rings = self._forward(seq, spans, wanted)
        snapshots = {p: self._snapshot(r) for p, r in rings.items()}
        h = hs[-1][-1]
        nxt = int(torch.argmax(m.logits(h)))
        ttft = time.perf_counter() - t0
        generated = [nxt]
        if self.cache is not None:

            def export(pos: int) -> torch.Tensor | None:
                if pos not in snapshots:
                    return None  # the ring has moved past this position
                self.staging.copy_(snapshots[pos])
                return self.staging

            stored = tokens if C == B else tokens[: n_full * B]  # whole chunks only
            if len(stored) > 0:
                self.cache.store(
                    request_id, stored, seq.table[:n_full], state_export=export if self.state_elems else None
                )
        for p in range(L, L + max_new_tokens - 1):
            h = self._chunk(seq, torch.tensor([nxt], device=m.device), p)
            nxt = int(torch.argmax(m.logits(h)))
            generated.append(nxt)
        if self.cache is not None:
            self._sync()  # the request's blocks are reused after this
            self.cache.poll()
            self.cache.forget(request_id)
        self.free.extend(reversed(seq.table))
        got = max(got, 0)
        return RequestResult(
            request_id, L, start, generated, ttft, load_s, (got // B) * self.page_bytes, got, resume_s
        )
