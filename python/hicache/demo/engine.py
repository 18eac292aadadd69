"""A paged-attention engine that calls hicache exactly as a production scheduler would:
``try_resume`` before prefill, ``store`` after it, ``poll`` every step, ``forget`` at the end.

KV of full-attention layers lives in a block pool (one K and one V tensor per layer, first
dimension = block id; 128-token blocks by default) addressed through per-request block tables.
Sliding-window layers keep, per request, a ring of the last ``window`` tokens' K and V: that ring
is the model's *state*, exported to hicache at block boundaries and imported on a hit.

Prefill runs in chunks of ``prefill_chunk`` tokens (a multiple of the block; one block by
default) aligned to multiples of it. Only whole chunks are stored and a hit is used up to a chunk
boundary, so every cached token was computed in a full chunk, exactly as a recompute computes it:
a resumed request performs the same computations on the same inputs as a full recompute for
every token after the hit (matrix products can depend on how many rows they get, so chunk sizes
must match too), and its outputs are bit-identical. This is what lets the demo compare generated
tokens with and without the cache. Larger chunks prefill faster (bigger matrix products) and
leave up to a chunk of each prompt uncached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .._core import Tier
from ..cache import HostPrefixCache
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


@dataclass
class _Sequence:
    table: list[int]
    ring_k: dict[int, torch.Tensor] = field(default_factory=dict)
    ring_v: dict[int, torch.Tensor] = field(default_factory=dict)
    # The request's K/V of full-attention layers, contiguous, next to the paged pool: attention
    # reads a prefix view of these instead of gathering the blocks again for every chunk.
    k_buf: dict[int, torch.Tensor] = field(default_factory=dict)
    v_buf: dict[int, torch.Tensor] = field(default_factory=dict)


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
            )
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in self.k_pool.values()) * 2

    # --- the forward pass, one aligned chunk at a time -------------------------------------

    def _chunk(self, seq: _Sequence, tokens: torch.Tensor, c0: int) -> torch.Tensor:
        """Runs tokens at positions [c0, c0 + n) (a prefill chunk, or one decoded token); returns
        the last hidden state. Writes their K/V into the pool and advances the rings."""
        m, cfg, B = self.model, self.cfg, self.B
        n = tokens.shape[0]
        c1 = c0 + n
        pos = torch.arange(c0, c1, device=m.device)
        h = m.embed_tokens(tokens)
        for layer in range(cfg.n_layers):
            q, k, v = m.qkv(layer, h, pos)
            if cfg.is_sliding(layer):
                kk = torch.cat([seq.ring_k[layer], k])
                vv = torch.cat([seq.ring_v[layer], v])
                kpos = torch.arange(c0 - cfg.window, c1, device=m.device)
                h = m.attend_and_mlp(layer, h, q, kk, vv, pos, kpos)
                seq.ring_k[layer], seq.ring_v[layer] = kk[-cfg.window :], vv[-cfg.window :]
            else:
                for p0 in range(c0, c1, B):  # block by block: what hicache stores
                    p1 = min(c1, (p0 // B + 1) * B)
                    block, off = seq.table[p0 // B], p0 % B
                    self.k_pool[layer][block, off : off + p1 - p0] = k[p0 - c0 : p1 - c0]
                    self.v_pool[layer][block, off : off + p1 - p0] = v[p0 - c0 : p1 - c0]
                seq.k_buf[layer][c0:c1] = k
                seq.v_buf[layer][c0:c1] = v
                kk, vv = seq.k_buf[layer][:c1], seq.v_buf[layer][:c1]
                h = m.attend_and_mlp(layer, h, q, kk, vv, pos, torch.arange(0, c1, device=m.device))
        return h[-1]

    # --- state: the rings of the sliding layers, flattened into the staging tensor --------

    def _snapshot(self, seq: _Sequence) -> torch.Tensor:
        parts = [
            t.reshape(-1) for layer in self.sliding_layers for t in (seq.ring_k[layer], seq.ring_v[layer])
        ]
        return torch.cat(parts)

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
        seq = _Sequence([self.free.pop() for _ in range(need)])
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
        start, load_s, got = 0, 0.0, 0
        C = self.C
        if self.cache is not None:
            got = self.cache.try_resume(
                request_id,
                tokens,
                lambda n: seq.table[: n // B],
                state_out=self.staging if self.state_elems else None,
            )
            # Used up to a chunk boundary (a chain cut by eviction can end inside a chunk): the
            # rest of the loaded blocks is recomputed, as a recompute would compute it.
            start = got // C * C
            if start > 0:
                hit = seq.table[: start // B]  # the blocks hicache filled, on this stream
                for layer in self.full_layers:
                    seq.k_buf[layer][:start] = self.k_pool[layer][hit].reshape(
                        start, cfg.n_kv_heads, cfg.head_dim
                    )
                    seq.v_buf[layer][:start] = self.v_pool[layer][hit].reshape(
                        start, cfg.n_kv_heads, cfg.head_dim
                    )
                if self.state_elems:
                    self._import_state(seq)
            if self.measure_load:
                self._sync()
                load_s = time.perf_counter() - t0
        # Prefill the rest, chunk by chunk; keep the states store() may ask for.
        n_full = L // C * C // B  # blocks of whole chunks: the only ones stored
        wanted = {(n_full - j) * B for j in range(self.state_lookback)} if self.state_elems else set()
        snapshots: dict[int, torch.Tensor] = {}
        h = None
        for c0 in range(start, L, C):
            h = self._chunk(seq, tokens[c0 : min(c0 + C, L)], c0)
            if c0 + B in wanted and c0 + B <= L:
                snapshots[c0 + B] = self._snapshot(seq)
        assert h is not None, "keep_tokens >= 1 leaves at least one token to compute"
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
        return RequestResult(request_id, L, start, generated, ttft, load_s, (got // B) * self.page_bytes)
