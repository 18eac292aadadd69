"""Prometheus metrics for any engine: a collector over hicache's counters.

    from prometheus_client import REGISTRY
    from hicache.metrics import HicacheCollector
    REGISTRY.register(HicacheCollector(cache))          # a HostPrefixCache
    REGISTRY.register(HicacheCollector(manager.stats))  # or any callable returning the counters

Every scrape reads one consistent snapshot (``stats_dict()``). Needs the optional
``prometheus_client`` package (``pip install 'hicache[metrics]'``); importing this module without
it raises ImportError naming the package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.registry import Collector
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise ImportError("hicache.metrics needs prometheus_client: pip install 'hicache[metrics]'") from e

# name -> help. Counters only grow; gauges are levels.
COUNTERS: dict[str, str] = {
    "lookups": "try_resume calls (HostPrefixCache) or block lookups (BlockCatalog)",
    "lookup_tokens": "prompt tokens looked up",
    "hits": "lookups that served tokens from host memory",
    "hit_tokens": "prompt tokens served from host memory",
    "deferred": "lookups deferred because the engine could not allocate blocks",
    "hits_trimmed": "hits served shorter than found: recomputing the rest was faster",
    "pages_recomputed": "pages of hits left to recompute because loading them was slower",
    "layerwise_loads": "hits loaded layer by layer beside the prefill",
    "stores": "store calls",
    "store_skips": "stores cut short because no slot could be freed",
    "store_skips_unpinned": "stores cut short because pinning had not reached their slots",
    "collisions": "chain keys found holding other tokens (never served)",
    "pages_stored": "pages written to host memory",
    "pages_discarded": "pages copied to host memory but never published (request forgotten, store raised)",
    "pages_loaded": "pages copied back to the engine",
    "pages_evicted": "pages evicted",
    "pages_declined": "pages the admission policy declined",
    "states_stored": "hybrid-model states written to host memory",
    "states_discarded": "hybrid-model states copied but never published",
    "states_loaded": "hybrid-model states copied back",
    "errors": "cache failures (the cache disables itself after too many in a row)",
    # a shared tier (HostPrefixCache(tier=...))
    "tier_pages_written": "pages the shared tier confirmed",
    "tier_pages_dropped": "pages not written to the tier: its write queue was full",
    "tier_pages_fetched": "pages fetched from the tier into host memory",
    "tier_hit_tokens": "prompt tokens served that came from the tier",
    "tier_pages_missing": "pages asked of the tier that it did not have",
    "tier_pages_rejected": "values from the tier that were not exactly the page asked for (never served)",
    "tier_fetches_late": "tier fetches cut short by their deadline",
    "tier_pages_checked_on_device": "fetched pages whose bytes the GPU checked where their first load landed",
    "tier_errors": "failed tier calls (the cache goes on without them)",
    # BlockCatalog (the index half, e.g. vLLM's manager)
    "lookup_hits": "block lookups that found a loadable block",
    "blocks_loaded": "blocks handed out for loading",
    "blocks_offered": "blocks offered for storing",
    "blocks_stored": "blocks stored",
    "blocks_declined": "blocks the admission policy declined",
    "blocks_no_room": "blocks not stored because every slot was held",
    "stores_failed": "blocks whose store failed",
    "evictions": "blocks evicted",
}
GAUGES: dict[str, str] = {
    "pages_used": "host page slots holding a page",
    "pages_capacity": "host page slots",
    "pages_busy": "pages held by a transfer in flight",
    "states_used": "host state slots in use",
    "transfers_in_flight": "transfers not yet retired",
    "load_bytes_per_s": "the copier's measured load rate (bytes/s; 0 until measured)",
    "host_bytes": "host memory allocated (pinned, for a GPU cache)",
    "host_bytes_capacity": "host memory the pools hold once whole",
    "requests": "requests seen and not forgotten",
    "disabled": "1 if the cache disabled itself",
    "admitting_second_sightings_only": "1 while admission stores only pages seen in a recent prompt",
    "used": "host slots holding a block",
    "pending": "blocks being stored or loaded",
    "capacity": "host slots",
}
HISTOGRAMS: dict[str, str] = {
    "load_latency": "seconds from try_resume to the poll that found its copy complete",
    "store_latency": "seconds from store to the poll that found its copy complete",
}

Source = Any  # an object with stats_dict(), or a callable returning a mapping


class HicacheCollector(Collector):
    """Exports ``hicache_<counter>_total``, ``hicache_<gauge>`` and latency histograms."""

    def __init__(
        self, source: Source, prefix: str = "hicache", labels: Mapping[str, str] | None = None
    ) -> None:
        read: Callable[[], Mapping[str, Any]]
        if hasattr(source, "stats_dict"):
            read = source.stats_dict
        elif callable(source):
            read = source
        else:
            raise TypeError("source must have stats_dict() (a HostPrefixCache) or be a callable")
        self._read = read
        self._prefix = prefix
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Any]:
        s = self._read()
        names, values = list(self._labels), list(self._labels.values())
        for key, text in COUNTERS.items():
            if key in s:
                m = CounterMetricFamily(f"{self._prefix}_{key}", text, labels=names)
                m.add_metric(values, float(s[key]))
                yield m
        for key, text in GAUGES.items():
            if key in s:
                m = GaugeMetricFamily(f"{self._prefix}_{key}", text, labels=names)
                m.add_metric(values, float(s[key]))
                yield m
        for key, text in HISTOGRAMS.items():
            h = s.get(key)
            if not h:
                continue
            buckets, total = [], 0
            for bound, count in zip([*h["bounds_us"], float("inf")], h["counts"], strict=True):
                total += count
                le = "+Inf" if bound == float("inf") else repr(bound / 1e6)
                buckets.append((le, float(total)))
            m = HistogramMetricFamily(f"{self._prefix}_{key}_seconds", text, labels=names)
            m.add_metric(values, buckets, h["sum_us"] / 1e6)
            yield m
