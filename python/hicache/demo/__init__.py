"""The demo engine: a small paged-attention transformer that uses hicache as an engine would."""

from .engine import PagedEngine, RequestResult
from .model import PRESETS, ModelConfig, TinyTransformer
from .workload import Conversation, make_conversations

__all__ = [
    "PRESETS",
    "Conversation",
    "ModelConfig",
    "PagedEngine",
    "RequestResult",
    "TinyTransformer",
    "make_conversations",
]
