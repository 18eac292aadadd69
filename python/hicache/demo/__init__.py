"""The demo engine: a small paged-attention transformer that uses hicache as an engine would."""

from .engine import PagedEngine, RequestResult
from .model import PRESETS, ModelConfig, TinyTransformer
from .workload import AGENTIC_DEFAULTS, Conversation, make_agent_sessions, make_conversations

__all__ = [
    "AGENTIC_DEFAULTS",
    "PRESETS",
    "Conversation",
    "ModelConfig",
    "PagedEngine",
    "RequestResult",
    "TinyTransformer",
    "make_agent_sessions",
    "make_conversations",
]
