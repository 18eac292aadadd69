"""hicache under a Hugging Face transformers model: resume a prompt into a fresh cache object.

``PrefixCache(model, ...)`` wraps a ``HostPrefixCache`` for one causal LM: it finds what each
layer of the model keeps (a full-attention layer: keys and values that grow by token, stored as
pages; a sliding-window layer: the last ``W - 1`` keys and values; a Mamba, short-convolution or
linear-attention layer: its convolution and recurrent states), sizes hicache's pages and state
parts from it, and then, per turn::

    cache = pc.prefill(input_ids)          # the cached prefix from host memory, the rest computed
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64, do_sample=False)

``prefill`` serves the longest cached prefix into a fresh ``DynamicCache`` (pages into the
full-attention layers, the state at that position into every other layer, with the flags that
make transformers use it), prefills the prompt up to its last block boundary in block-aligned
chunks, stores the new pages and the states at the last boundaries in hicache, and returns the
cache, which leaves the prompt's last tokens (at least one) to ``generate``.

Transformers creates a layer's state only on the first forward pass, with shapes that each
family computes its own way (convolution widths, state sizes, window lengths), so the adapter
runs the model once, on a block of zeros, when it is built, and reads every shape and dtype from
the cache object that pass left. Layer kinds without a defined state at a token position (the
sparse-attention indexer of DeepSeek-V3.2 and GLM-DSA, DeepSeek-V4's compressed attention, a
quantized or offloaded cache) are refused at construction with an error naming the family and the
layer.

Exactness: the pages are checked token by token and the state is the one stored for the page
that ends at the served position (see ``docs/hybrid.md``). A resumed turn computes what a
prefill from token 0 with the same chunk boundaries computes, bit for bit; against a prefill of
other boundaries (one pass over the whole prompt) it differs by floating-point rounding, as any
prefix cache's hit does, and greedy tokens agree unless two logits tie within that rounding.

One sequence at a time (batch 1). ``transformers`` is an optional dependency
(``pip install 'hicache[transformers]'``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import cache_utils

from .cache import HostPrefixCache
from .reference import state_boundary_distance

__all__ = ["ModelLayout", "PrefixCache", "StatePart", "UnsupportedModelError", "describe"]


class UnsupportedModelError(ValueError):
    """The model keeps something per layer that the adapter cannot store or rebuild exactly."""


@dataclass(frozen=True)
class StatePart:
    """One tensor of a sequence's state: where it lives in the transformers cache object."""

    layer: int
    kind: str  # "window_k", "window_v", "conv", "recurrent"
    index: int  # the state index within a linear-attention layer (0 for the others)
    shape: tuple[int, ...]  # without the batch dimension
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PagedLayer:
    """A layer whose keys and values grow by token: its K and V go to hicache as pages."""

    layer: int
    key_shape: tuple[int, int]  # (kv heads, key head dim)
    value_shape: tuple[int, int]  # (kv heads, value head dim): MLA-style layers differ from K
    dtype: torch.dtype


@dataclass(frozen=True)
class ModelLayout:
    """What a model's cache object holds per layer, read from one forward pass."""

    family: str  # the config's model_type
    paged: tuple[PagedLayer, ...]
    parts: tuple[StatePart, ...]
    kinds: tuple[str, ...]  # the cache layer class of every layer
    # Mamba-1 layers in transformers continue a cached state exactly one token at a time only:
    # their multi-token scan starts from a zero SSM state (measured: logits off by 0.01-0.17
    # against one pass; one token at a time matches to 1e-6).
    tokenwise: bool = False

    @property
    def state_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


# Cache layer classes and what of them the adapter moves. Order matters: the combined classes
# derive from both of their halves.
# Older releases (before 5.2x) lack some of them: their hybrid models keep their own cache
# classes, which describe() refuses by name.


class _Absent:
    """Stands for a cache layer class this transformers release does not have."""


def _layer_class(name: str) -> type:
    return getattr(cache_utils, name, _Absent)


_SLIDING = cache_utils.DynamicSlidingWindowLayer
_FULL = cache_utils.DynamicLayer
_LINEAR = _layer_class("LinearAttentionLayer")
_DUMMY = _layer_class("DummyLayer")
_REFUSED: dict[str, str] = {
    "DynamicIndexedLayer": "a sparse-attention indexer cache (its indexer keys are not stored)",
    "StaticLayer": "a static cache (pass a model that uses DynamicCache)",
    "StaticSlidingWindowLayer": "a static cache (pass a model that uses DynamicCache)",
}


def _cache_arg() -> str:
    """The model's cache keyword: "cache" from transformers 5.24 on, "past_key_values" before."""
    import inspect

    params = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_ARG = _cache_arg()


def _family(model: Any) -> str:
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "model_type", type(model).__name__))


def fresh_cache(model: Any) -> Any:
    """An empty cache object of the kind ``generate`` would create for this model."""
    return transformers.DynamicCache(config=model.config)


def _forward(model: Any, ids: torch.Tensor, cache: Any) -> Any:
    return model(input_ids=ids[None], use_cache=True, **{CACHE_ARG: cache})


def describe(model: Any, block_tokens: int = 16) -> ModelLayout:
    """Run ``model`` once on ``block_tokens`` zeros and read what its cache object holds.

    Raises:
        UnsupportedModelError: a layer kind the adapter cannot store exactly, or a cache object
            that is not a ``DynamicCache``; the message names the family and the layer.
    """
    family = _family(model)
    if not hasattr(model, "config") or not callable(model):
        raise TypeError(f"model must be a transformers causal LM, not {type(model).__name__}")
    device = next(model.parameters()).device
    cache = fresh_cache(model)
    with torch.no_grad():
        out = _forward(model, torch.zeros(block_tokens, dtype=torch.long, device=device), cache)
    cache = getattr(out, CACHE_ARG, None) or cache
    if not isinstance(cache, transformers.DynamicCache):
        raise UnsupportedModelError(
            f"{family}: the model returned a {type(cache).__name__}, not a DynamicCache; "
            "the adapter rebuilds DynamicCache objects only"
        )
    paged: list[PagedLayer] = []
    parts: list[StatePart] = []
    kinds: list[str] = []
    for i, layer in enumerate(cache.layers):
        name = type(layer).__name__
        kinds.append(name)
        if name in _REFUSED or isinstance(layer, _layer_class("QuantizedLayer")):
            why = _REFUSED.get(name, "a quantized cache")
            raise UnsupportedModelError(f"{family}: layer {i} is a {name}, {why}; not supported")
        if type(layer) not in _KNOWN_CLASSES:
            raise UnsupportedModelError(f"{family}: layer {i} is a {name}, which the adapter does not know")
        if isinstance(layer, _DUMMY):
            continue  # no cache (an MLP-only layer, or one that reads another layer's KV)
        if isinstance(layer, _LINEAR):
            for j in range(layer.number_of_states):
                if layer.is_conv_states_initialized[j]:
                    t = layer.conv_states[j]
                    parts.append(StatePart(i, "conv", j, tuple(t.shape[1:]), t.dtype))
                if layer.is_recurrent_states_initialized[j]:
                    t = layer.recurrent_states[j]
                    parts.append(StatePart(i, "recurrent", j, tuple(t.shape[1:]), t.dtype))
        if isinstance(layer, _SLIDING):
            if not layer.is_initialized:
                raise UnsupportedModelError(f"{family}: layer {i} ({name}) held nothing after a forward pass")
            shape = (layer.keys.shape[1], layer.sliding_window - 1, layer.keys.shape[3])
            vshape = (layer.values.shape[1], layer.sliding_window - 1, layer.values.shape[3])
            parts.append(StatePart(i, "window_k", 0, shape, layer.keys.dtype))
            parts.append(StatePart(i, "window_v", 0, vshape, layer.values.dtype))
        elif isinstance(layer, _FULL):
            if not layer.is_initialized:
                raise UnsupportedModelError(f"{family}: layer {i} ({name}) held nothing after a forward pass")
            k, v = layer.keys, layer.values
            paged.append(PagedLayer(i, (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), k.dtype))
    if not paged and not parts:
        raise UnsupportedModelError(
            f"{family}: its {type(cache).__name__} held nothing after a forward pass "
            "(this transformers release keeps the model's cache elsewhere)"
        )
    tokenwise = any(type(m).__name__ in _TOKENWISE_MIXERS for m in model.modules())
    return ModelLayout(family, tuple(paged), tuple(parts), tuple(kinds), tokenwise)


_TOKENWISE_MIXERS = {"MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"}

_KNOWN_CLASSES = tuple(
    _layer_class(name)
    for name in (
        "DummyLayer",
        "LinearAttentionLayer",
        "DynamicLayer",
        "DynamicSlidingWindowLayer",
        "LinearAttentionAndFullAttentionLayer",
        "LinearAttentionAndSlidingWindowAttentionLayer",
    )
)


def _all_linear(cache: Any) -> bool:
    """Whether every layer keeps a state alone (then the cache does not know its length)."""
    flags = getattr(cache, "is_linear", None)
    if flags is None:
        flags = [isinstance(layer, _LINEAR) and not isinstance(layer, _FULL) for layer in cache.layers]
    return bool(flags) and all(flags)


def _token_list(input_ids: Any) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(
                    f"input_ids: one sequence at a time (batch 1), not a batch of {input_ids.shape[0]}"
                )
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [n] or [1, n], not of shape {tuple(input_ids.shape)}")
        return [int(t) for t in input_ids.tolist()]
    if isinstance(input_ids, (str, bytes)):
        raise TypeError("input_ids must be token ids (a tensor or a list of ints), not text")
    return [int(t) for t in input_ids]


class PrefixCache:
    """A host-memory prefix cache for one transformers model (see the module's docstring).

    Args:
        model: a causal LM whose ``generate`` uses a ``DynamicCache`` (its weights on the
            device where the turns run).
        capacity_pages / host_bytes: exactly one: the host memory for pages (one page = one
            block of every full-attention layer's keys and values).
        capacity_states: host slots for states (one slot = one sequence's state at one block
            boundary; ``ModelLayout.state_bytes`` each). Default: one per 16 pages, at least 4.
            Ignored for models without state (full attention only).
        block_tokens: tokens per page and per prefill chunk of the stored boundaries.
        max_tokens: the longest prefix served or stored; the adapter's device staging blocks
            hold that many tokens of every full-attention layer.
        chunk_tokens: the prefill runs in chunks of this many tokens (a multiple of
            ``block_tokens``), cut also at each boundary whose state is stored (the last one and
            those 1, 2, 4, ... blocks before it, ``state_lookback`` of them).
        **options: passed to :class:`hicache.HostPrefixCache` (``state_lookback``, ``salt``,
            ``tier``, ``admission``...).
    """

    def __init__(
        self,
        model: Any,
        *,
        capacity_pages: int | None = None,
        host_bytes: int | None = None,
        capacity_states: int | None = None,
        block_tokens: int = 16,
        max_tokens: int = 8192,
        chunk_tokens: int = 512,
        **options: Any,
    ) -> None:
        for name, value in (
            ("block_tokens", block_tokens),
            ("max_tokens", max_tokens),
            ("chunk_tokens", chunk_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        if chunk_tokens % block_tokens:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be a multiple of block_tokens={block_tokens}")
        if max_tokens < block_tokens:
            raise ValueError(f"max_tokens={max_tokens} holds no block of block_tokens={block_tokens}")
        self.model = model
        self.layout = describe(model, block_tokens)
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self.device = next(model.parameters()).device
        self.max_blocks = max_tokens // block_tokens
        # Device staging blocks, per full-attention layer K then V: [block, B, heads, dim].
        self.staging: list[torch.Tensor] = []
        for p in self.layout.paged:
            for heads, dim in (p.key_shape, p.value_shape):
                shape = (self.max_blocks, block_tokens, heads, dim)
                self.staging.append(torch.zeros(shape, dtype=p.dtype, device=self.device))
        parts = self.layout.parts
        # The boundaries whose states store() asks for (the core's defaults unless given).
        self.state_lookback = int(options.get("state_lookback", 4))
        sizes: dict[str, Any] = {"capacity_pages": capacity_pages, "host_bytes": host_bytes}
        if not self.layout.paged:
            # State only (Mamba, every layer a sliding window): pages index the prompt and hold
            # nothing; host memory is the states'.
            if host_bytes is not None:
                if capacity_states is not None:
                    raise ValueError(
                        "a model without full-attention layers: give host_bytes or capacity_states"
                    )
                capacity_states = max(1, host_bytes // self.layout.state_bytes)
            sizes = {"capacity_pages": capacity_pages or 1 << 16, "state_device": str(self.device)}
        if capacity_states is None:
            capacity_states = max(4, (capacity_pages or 0) // 16) if parts else 0
        state_kw: dict[str, Any] = {}
        if parts:
            state_kw = {"state_bytes": [p.nbytes for p in parts], "capacity_states": capacity_states}
        self.cache = HostPrefixCache(self.staging, block_tokens=block_tokens, **sizes, **state_kw, **options)
        self._requests = itertools.count()
        self.last_served = 0  # prompt tokens the last prefill took from hicache
        self.last_length = 0  # prompt tokens in the cache the last prefill returned

    # --- one turn --------------------------------------------------------------------------------

    def prefill(self, input_ids: Any) -> Any:
        """Resume ``input_ids`` from hicache and prefill it up to its last block boundary.

        Returns a ``DynamicCache`` holding ``input_ids[:m]`` with ``m`` the last multiple of
        ``block_tokens`` below ``len(input_ids)`` (or fewer, beyond ``max_tokens``), for
        ``model.generate(input_ids, past_key_values=cache, ...)`` or a forward pass of
        ``input_ids[m:]``. ``self.last_served`` is how many of those tokens came from hicache.
        """
        ids = _token_list(input_ids)
        B = self.block_tokens
        target = min((len(ids) - 1) // B, self.max_blocks) * B if ids else 0
        rid = f"hf{next(self._requests)}"
        parts = self.layout.parts
        state_out = [torch.empty(p.shape, dtype=p.dtype, device=self.device) for p in parts]
        with torch.no_grad():
            served = self.cache.try_resume(
                rid, ids[: target + 1], lambda n: list(range(n // B)), state_out=state_out or None
            )
            served = max(served, 0)
            cache = self._rebuild(served, state_out) if served else fresh_cache(self.model)
            # A family whose multi-token continuation is inexact stops one token short, so that
            # generate's first step is a one-token decode.
            stop = max(len(ids) - 1, target) if self.layout.tokenwise else target
            snapshots = self._prefill(ids, served, target, stop, cache)
            if target > served:
                self._copy_pages(cache, served // B, target // B)

                def export(pos: int) -> list[torch.Tensor] | None:
                    return snapshots.get(pos)

                self.cache.store(
                    rid, ids[:target], list(range(target // B)), state_export=export if parts else None
                )
                self._sync()
            self.cache.poll()
            self.cache.forget(rid)
        self.last_served = served
        self.last_length = stop
        return cache

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        """``model.generate(input_ids, **kwargs)`` with the prompt resumed from hicache: the same
        result (the prompt's tokens followed by the generated ones), one sequence.

        A model whose every layer keeps a state alone (Mamba) cannot tell ``generate`` how many
        tokens its cache holds, and ``generate`` then takes ``input_ids`` as new tokens only;
        this passes it the uncached ones and puts the prompt back in front of the result.
        """
        ids = torch.as_tensor(_token_list(input_ids), dtype=torch.long, device=self.device)[None]
        cache = self.prefill(ids)
        if not _all_linear(cache):
            return self.model.generate(ids, **{CACHE_ARG: cache}, **kwargs)
        m = self.last_length
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = kwargs["attention_mask"][:, m:]
        out = self.model.generate(ids[:, m:], **{CACHE_ARG: cache}, **kwargs)
        if isinstance(out, torch.Tensor):
            return torch.cat([ids[:, :m], out], dim=1)
        out.sequences = torch.cat([ids[:, :m], out.sequences], dim=1)
        return out

    def store(self, token_ids: Any, cache: Any) -> int:
        """Store the full pages of ``cache`` (which holds ``token_ids[:cache length]``), e.g. a
        prompt and its answer after ``generate``, with the state at the cache's position when
        that is a block boundary. Returns pages newly stored. For a model with state, pages past
        the last stored state are never served (see ``state_lookback``), so this is most useful
        for full-attention models.
        """
        ids = _token_list(token_ids)
        length = self._length(cache)
        if length > len(ids):
            raise ValueError(f"the cache holds {length} tokens but token_ids has {len(ids)}")
        B = self.block_tokens
        n = min(length // B, self.max_blocks)
        if n == 0:
            return 0
        rid = f"hf{next(self._requests)}"
        with torch.no_grad():
            self._copy_pages(cache, 0, n)
            at_end = self._state_of(cache) if self.layout.parts and length == n * B else None

            def export(pos: int) -> list[torch.Tensor] | None:
                return at_end if pos == n * B else None

            stored = self.cache.store(
                rid, ids[: n * B], list(range(n)), state_export=export if self.layout.parts else None
            )
            self._sync()
            self.cache.poll()
            self.cache.forget(rid)
        return stored

    # --- the cache object ------------------------------------------------------------------------

    def _length(self, cache: Any) -> int:
        for p in self.layout.paged:
            return int(cache.layers[p.layer].get_seq_length())
        for p in self.layout.parts:
            layer = cache.layers[p.layer]
            if isinstance(layer, _SLIDING):
                return int(layer.cumulative_length)
        raise ValueError(
            f"{self.layout.family}: a cache of state alone does not record its length; store it from prefill"
        )

    def _prefill(
        self, ids: list[int], start: int, end: int, stop: int, cache: Any
    ) -> dict[int, list[torch.Tensor]]:
        """Forward ``ids[start:stop]``; returns the states at the boundaries up to ``end`` (the
        stored part) that ``store`` asks for."""
        wanted = self._snapshot_positions(start, end)
        t = torch.tensor(ids[:stop], dtype=torch.long, device=self.device)
        snapshots: dict[int, list[torch.Tensor]] = {}
        for c0, c1 in itertools.pairwise(self.cuts(start, end, stop)):
            _forward(self.model, t[c0:c1], cache)
            if c1 in wanted:
                snapshots[c1] = self._state_of(cache)
        return snapshots

    def _snapshot_positions(self, start: int, end: int) -> set[int]:
        """Where store() will ask for a state: ``end`` and 1, 2, 4, ... blocks before it,
        ``state_lookback`` of them, past ``start`` (earlier ones were stored before)."""
        if not self.layout.parts or end <= start:
            return set()
        B = self.block_tokens
        positions = (end - state_boundary_distance(j) * B for j in range(self.state_lookback))
        return {p for p in positions if p > start}

    def cuts(self, start: int, end: int, stop: int) -> list[int]:
        """The chunk boundaries of a prefill of ``[start, stop)`` that stores ``[0, end)``: every
        ``chunk_tokens`` and at each boundary whose state is stored (one token a chunk after a
        fresh first chunk, for a family that needs it). A run without the adapter that prefills
        at these boundaries computes the same logits, bit for bit."""
        wanted = self._snapshot_positions(start, end)
        if self.layout.tokenwise:
            # A fresh prefill is exact; every continuation runs one token at a time.
            first = min(min(wanted, default=stop), stop) if start == 0 else start
            cuts = {start, first, *range(first, stop + 1)}
        else:
            cuts = {start, stop, *range(start, stop, self.chunk_tokens), *wanted}
        return sorted(c for c in cuts if start <= c <= stop)

    def _state_of(self, cache: Any) -> list[torch.Tensor]:
        """The state parts at the cache's current position (copies, batch dimension dropped)."""
        out = []
        for p in self.layout.parts:
            layer = cache.layers[p.layer]
            if p.kind in ("window_k", "window_v"):
                t = (layer.keys if p.kind == "window_k" else layer.values)[0]
                buf = torch.zeros(p.shape, dtype=p.dtype, device=self.device)
                n = min(t.shape[1], p.shape[1])
                if n:  # fewer than W - 1 tokens so far: the window's tail holds them
                    buf[:, p.shape[1] - n :] = t[:, t.shape[1] - n :]
                out.append(buf)
            elif p.kind == "conv":
                out.append(layer.conv_states[p.index][0].clone())
            else:
                out.append(layer.recurrent_states[p.index][0].clone())
        return out

    def _copy_pages(self, cache: Any, b0: int, b1: int) -> None:
        """Blocks ``[b0, b1)`` of every full-attention layer's keys and values into staging."""
        B = self.block_tokens
        for n, p in enumerate(self.layout.paged):
            layer = cache.layers[p.layer]
            for pool, kv in ((self.staging[2 * n], layer.keys), (self.staging[2 * n + 1], layer.values)):
                # kv: [1, heads, tokens, dim] -> [blocks, B, heads, dim]
                src = (
                    kv[0, :, b0 * B : b1 * B].transpose(0, 1).reshape(b1 - b0, B, *kv.shape[1:2], kv.shape[3])
                )
                pool[b0:b1].copy_(src)

    def _rebuild(self, position: int, state: Sequence[torch.Tensor]) -> Any:
        """A fresh cache object at ``position``: pages from staging, every other layer's state."""
        cache = fresh_cache(self.model)
        B = self.block_tokens
        nb = position // B
        for n, p in enumerate(self.layout.paged):
            k = self.staging[2 * n][:nb].reshape(position, *p.key_shape)
            v = self.staging[2 * n + 1][:nb].reshape(position, *p.value_shape)
            cache.layers[p.layer].update(
                k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()
            )
        windows: dict[int, dict[str, torch.Tensor]] = {}
        for p, t in zip(self.layout.parts, state, strict=True):
            layer = cache.layers[p.layer]
            if p.kind in ("window_k", "window_v"):
                n = min(position, p.shape[1])  # tokens the window holds at this position
                windows.setdefault(p.layer, {})[p.kind] = t[:, p.shape[1] - n :][None].contiguous()
            elif p.kind == "conv":
                layer.lazy_initialization(
                    conv_states=t[None], state_idx=p.index, conv_kernel_size=p.shape[-1]
                )
                layer.conv_states[p.index].copy_(t[None])
                # Without this flag transformers treats the next chunk as a first prefill and drops
                # the loaded state (its outputs then equal a zeroed state's, with no error).
                layer.has_previous_state[p.index] = True
            else:
                layer.lazy_initialization(recurrent_states=t[None], state_idx=p.index)
                layer.recurrent_states[p.index].copy_(t[None])
                layer.has_previous_state[p.index] = True
        for layer_idx, kv in windows.items():
            layer = cache.layers[layer_idx]
            layer.update(kv["window_k"], kv["window_v"])
            layer.cumulative_length = position  # the window's tokens end at `position`
        return cache

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
