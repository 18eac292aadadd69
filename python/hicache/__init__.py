"""hicache: a host-memory KV prefix cache for LLM inference engines."""

from ._core import CacheError, CacheStats, MemoryTier, PageStore, Tier, UnknownRequestError, cuda_available
from .cache import HostPrefixCache, LayerwiseLoad
from .disk_tier import DiskTier
from .hash_chain import chain_keys

__version__ = "0.1.0"

__all__ = [
    "CacheError",
    "CacheStats",
    "DiskTier",
    "HostPrefixCache",
    "LayerwiseLoad",
    "MemoryTier",
    "PageStore",
    "Tier",
    "UnknownRequestError",
    "__version__",
    "chain_keys",
    "cuda_available",
]
