"""A paged engine over Hugging Face hybrid models, with hicache as its host tier.

Model code we did not write (transformers, random weights, tiny configs, nothing downloaded):
sliding-window + full attention (Gemma-3), Mamba-2 (Bamba), Mamba-1 (Jamba) and gated-delta-net
(Qwen3-Next) hybrids. The engine prefills in block-aligned chunks. Full-attention layers keep
their KV in a paged block pool, which hicache stores as pages. Every other layer keeps
per-sequence state (a sliding window's last W-1 keys and values, a Mamba or GDN layer's
convolution and recurrent state); the engine snapshots it at block boundaries and hicache stores
it through ``state_export``, one tensor a part, each in its own dtype. A resumed turn loads the
pages into fresh blocks and the state parts into fresh tensors, rebuilds a fresh cache object
from them, and prefills only the rest.

Run as a script for the table of the closing note:
``python tests/py/hf_hybrid.py [--device cuda --dtype bfloat16]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

import hf_families
import hicache
from hicache.transformers import CACHE_ARG

B = 16  # tokens per block (and per prefill chunk)

# The model's cache keyword ("cache" from transformers 5.24 on, "past_key_values" before).
CACHE = CACHE_ARG

# The tiny models (random weights, a wider initialization than the default so that their few
# generated tokens depend on their state) are hf_families.py's.
FAMILIES = ("gemma3", "bamba", "jamba", "qwen3_next")


def make_model(family: str, device: str, dtype: torch.dtype) -> Any:
    return hf_families.make_model(family, device, dtype)


@dataclass
class Part:
    """One tensor of the state: where it lives in the model's cache object."""

    layer: int
    kind: str  # "window_k", "window_v", "conv", "recurrent"
    index: int  # the state index of a linear-attention layer
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass
class Turn:
    tokens: list[int]  # generated
    prompt_tokens: int
    served: int  # prompt tokens served from hicache
    logits: list[torch.Tensor] = field(default_factory=list)  # before each generated token
    # The model's greedy prediction after each prompt position it prefilled (position -> token):
    # a resumed turn has those from `served` on.
    predictions: dict[int, int] = field(default_factory=dict)


class HybridEngine:
    """One sequence at a time, greedy, chunked prefill of B tokens; ``cache=None`` recomputes."""

    def __init__(
        self, model: Any, *, use_cache: bool, num_blocks: int = 64, capacity_pages: int = 64
    ) -> None:
        self.model = model
        self.cfg = model.config
        dev = next(model.parameters()).device
        self.device = dev
        probe = self._forward(torch.zeros(B, dtype=torch.long, device=dev), self._fresh_cache())
        layers = probe.layers
        self.kinds = [type(layer).__name__ for layer in layers]
        self.paged: list[int] = []
        self.parts: list[Part] = []
        for i, layer in enumerate(layers):
            kind = self.kinds[i]
            if kind == "DynamicLayer":
                self.paged.append(i)
            elif kind == "DynamicSlidingWindowLayer":
                shape = (layer.keys.shape[1], layer.sliding_window - 1, layer.keys.shape[3])
                self.parts += [Part(i, "window_k", 0, shape, layer.keys.dtype)]
                self.parts += [Part(i, "window_v", 0, shape, layer.values.dtype)]
            elif kind == "LinearAttentionLayer":
                for j in range(layer.number_of_states):
                    if layer.is_conv_states_initialized[j]:
                        t = layer.conv_states[j]
                        self.parts.append(Part(i, "conv", j, tuple(t.shape), t.dtype))
                    if layer.is_recurrent_states_initialized[j]:
                        t = layer.recurrent_states[j]
                        self.parts.append(Part(i, "recurrent", j, tuple(t.shape), t.dtype))
            else:
                raise NotImplementedError(f"layer {i}: {kind}")
        ref = layers[self.paged[0]]
        self.kv_heads, self.head_dim, self.dtype = ref.keys.shape[1], ref.keys.shape[3], ref.keys.dtype
        # The engine's paged pool: per full-attention layer K and V, [block, B, kv_heads, head_dim].
        shape = (num_blocks, B, self.kv_heads, self.head_dim)
        self.pool = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(2 * len(self.paged))]
        self.num_blocks = num_blocks
        self.hc: hicache.HostPrefixCache | None = None
        if use_cache:
            self.hc = hicache.HostPrefixCache(
                self.pool,
                block_tokens=B,
                capacity_pages=capacity_pages,
                state_bytes=[p.nbytes for p in self.parts],
                capacity_states=capacity_pages,
                state_lookback=2,
                admission="always",
            )
        # Tests: called with the state parts hicache loaded, may replace them (negative controls).
        self.tamper_state: Callable[[int, list[torch.Tensor]], list[torch.Tensor]] | None = None
        self.tamper_pages: Callable[[list[int]], None] | None = None
        # Tests: the boundaries whose state the engine can still export (None: all of them).
        self.exportable: Callable[[int], bool] | None = None
        self.snapshots: dict[int, list[torch.Tensor]] = {}  # position -> state parts (last turn)
        self._turn = 0

    # --- the model and its cache object ---------------------------------------------------------

    def _fresh_cache(self) -> Any:
        return transformers.DynamicCache(config=self.cfg)

    def _forward(self, ids: torch.Tensor, cache: Any) -> Any:
        out = self.model(input_ids=ids[None], use_cache=True, **{CACHE: cache})
        self._logits = out.logits[0, -1].float()
        self._predictions = out.logits[0].argmax(-1).tolist()
        return getattr(out, CACHE)

    def state_of(self, cache: Any) -> list[torch.Tensor]:
        """The state parts at the cache's current position (copies)."""
        out = []
        for p in self.parts:
            layer = cache.layers[p.layer]
            if p.kind in ("window_k", "window_v"):
                t = (layer.keys if p.kind == "window_k" else layer.values)[0]
                buf = torch.zeros(p.shape, dtype=p.dtype, device=self.device)
                n = t.shape[1]
                if n:  # fewer than W-1 tokens so far: the window's tail holds them
                    buf[:, p.shape[1] - n :] = t
                out.append(buf)
            elif p.kind == "conv":
                out.append(layer.conv_states[p.index].clone())
            else:
                out.append(layer.recurrent_states[p.index].clone())
        return out

    def rebuild(self, position: int, blocks: list[int], state: list[torch.Tensor]) -> Any:
        """A fresh cache object at `position` from paged KV in `blocks` and the state parts."""
        cache = self._fresh_cache()
        for n, layer_idx in enumerate(self.paged):
            k = self.pool[2 * n][blocks].reshape(position, self.kv_heads, self.head_dim)
            v = self.pool[2 * n + 1][blocks].reshape(position, self.kv_heads, self.head_dim)
            cache.layers[layer_idx].update(
                k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()
            )
        windows: dict[int, dict[str, torch.Tensor]] = {}
        for p, t in zip(self.parts, state, strict=True):
            layer = cache.layers[p.layer]
            if p.kind in ("window_k", "window_v"):
                n = min(position, p.shape[1])  # tokens the window holds at this position
                windows.setdefault(p.layer, {})[p.kind] = t[:, p.shape[1] - n :][None].contiguous()
            elif p.kind == "conv":
                layer.lazy_initialization(conv_states=t, state_idx=p.index, conv_kernel_size=p.shape[-1])
                layer.conv_states[p.index].copy_(t)
                layer.has_previous_state[p.index] = True
            else:
                layer.lazy_initialization(recurrent_states=t, state_idx=p.index)
                layer.recurrent_states[p.index].copy_(t)
        for layer_idx, kv in windows.items():
            layer = cache.layers[layer_idx]
            layer.update(kv["window_k"], kv["window_v"])
            layer.cumulative_length = position  # the window's tokens end at `position`
        return cache

    # --- one turn --------------------------------------------------------------------------------

    def run(self, prompt: list[int], new_tokens: int) -> Turn:
        """Prefill `prompt` (resuming from hicache if it has a prefix), then decode greedily."""
        self._turn += 1
        rid = f"turn{self._turn}"
        ids = torch.tensor(prompt, device=self.device)
        # Fresh blocks each turn, in an order unlike the last one's: only hicache's copy survives.
        for t in self.pool:
            t.zero_()
        perm = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(self._turn)).tolist()
        table = perm[: (len(prompt) + B - 1) // B]
        served = 0
        cache = self._fresh_cache()
        if self.hc is not None:
            staging = [torch.zeros(p.shape, dtype=p.dtype, device=self.device) for p in self.parts]
            served = self.hc.try_resume(rid, prompt, lambda n: table[: n // B], state_out=staging)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            if served > 0:
                if self.tamper_pages is not None:
                    self.tamper_pages(table[: served // B])
                if self.tamper_state is not None:
                    staging = self.tamper_state(served, staging)
                cache = self.rebuild(served, table[: served // B], staging)
        snapshots: dict[int, list[torch.Tensor]] = {}
        logits = []
        predictions = {}
        with torch.no_grad():
            for c0 in range(served, len(prompt), B):
                c1 = min(c0 + B, len(prompt))
                cache = self._forward(ids[c0:c1], cache)
                predictions.update(zip(range(c0, c1), self._predictions, strict=True))
                self._write_pages(cache, table, c0, c1)
                if c1 % B == 0:
                    snapshots[c1] = self.state_of(cache)
            self.snapshots = snapshots
            if self.hc is not None:

                def export(pos: int) -> list[torch.Tensor] | None:
                    if self.exportable is not None and not self.exportable(pos):
                        return None
                    return snapshots.get(pos)

                self.hc.store(rid, prompt, table, state_export=export)
            out = []
            for _ in range(new_tokens):
                logits.append(self._logits.cpu())
                nxt = int(self._logits.argmax())
                out.append(nxt)
                cache = self._forward(torch.tensor([nxt], device=self.device), cache)
        if self.hc is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.hc.poll()
            self.hc.forget(rid)
        return Turn(out, len(prompt), served, logits, predictions)

    def _write_pages(self, cache: Any, table: list[int], c0: int, c1: int) -> None:
        """The chunk's keys and values of full-attention layers into the block pool."""
        b0, b1 = c0 // B, (c1 + B - 1) // B
        for n, layer_idx in enumerate(self.paged):
            layer = cache.layers[layer_idx]
            for pool, kv in ((self.pool[2 * n], layer.keys), (self.pool[2 * n + 1], layer.values)):
                for b in range(b0, b1):
                    t0, t1 = b * B, min((b + 1) * B, c1)
                    pool[table[b], : t1 - t0] = kv[0, :, t0:t1].transpose(0, 1)


def conversation(seed: int, first: int = 5 * B + 7, turns: int = 3) -> list[tuple[list[int], int]]:
    """Turns of (new user tokens, answer length): each prompt extends the last prompt + answer."""
    g = torch.Generator().manual_seed(seed)
    sizes = [first] + [2 * B + 3 + 9 * i for i in range(1, turns)]
    return [(torch.randint(0, 256, (n,), generator=g).tolist(), 6) for n in sizes]


def run_conversation(engine: HybridEngine, seed: int = 1, turns: int = 3) -> list[Turn]:
    history: list[int] = []
    out = []
    for user, answer in conversation(seed, turns=turns):
        prompt = history + user
        t = engine.run(prompt, answer)
        out.append(t)
        history = prompt + t.tokens
    return out


def layer_counts(engine: HybridEngine) -> dict[str, int]:
    names = {
        "DynamicLayer": "full attention",
        "DynamicSlidingWindowLayer": "sliding window",
        "LinearAttentionLayer": "linear/SSM",
    }
    counts: dict[str, int] = {}
    for k in engine.kinds:
        counts[names[k]] = counts.get(names[k], 0) + 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    for family in FAMILIES:
        model = make_model(family, args.device, dtype)
        ref = run_conversation(HybridEngine(model, use_cache=False))
        eng = HybridEngine(model, use_cache=True)
        got = run_conversation(eng)
        print(
            json.dumps(
                {
                    "family": family,
                    "model": type(model).__name__,
                    "device": args.device,
                    "dtype": args.dtype,
                    "layers": layer_counts(eng),
                    "state_parts": [f"{p.kind}:{p.dtype}".replace("torch.", "") for p in eng.parts],
                    "prompt_tokens": [t.prompt_tokens for t in got],
                    "served": [t.served for t in got],
                    "identical": [a.tokens == b.tokens for a, b in zip(got, ref, strict=True)],
                }
            )
        )


if __name__ == "__main__":
    main()
