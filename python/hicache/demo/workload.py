"""Workloads, deterministic from a seed. Multi-turn conversations: each turn's prompt is the
previous prompt, the previous answer and a new user message. Agent sessions have the same shape
with other proportions: a long context (system prompt, tools, a repository) and many steps, each
adding the model's last action and a short tool result, so nearly every prompt is a long cached
prefix and a short suffix."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Conversation:
    first: list[int]
    user_turns: list[list[int]]


def make_conversations(
    n: int, turns: int, vocab: int, first_tokens: int, user_tokens: int, seed: int = 0
) -> list[Conversation]:
    """n conversations; first prompts of about first_tokens, user messages of about user_tokens."""
    rng = np.random.default_rng(seed)

    def text(mean: int) -> list[int]:
        k = int(rng.integers(max(1, mean // 2), mean + mean // 2 + 1))
        return rng.integers(0, vocab, size=k).tolist()

    return [Conversation(text(first_tokens), [text(user_tokens) for _ in range(turns - 1)]) for _ in range(n)]


# The agentic workload's defaults per device: long contexts where the load dominates the time to
# the first token on a GPU, shorter ones on the CPU (whose prefill is three orders slower).
AGENTIC_DEFAULTS = {
    "cuda": {"conversations": 2, "turns": 6, "first_tokens": 32768, "user_tokens": 384, "new_tokens": 16},
    "cpu": {"conversations": 2, "turns": 6, "first_tokens": 2048, "user_tokens": 128, "new_tokens": 8},
}


def make_agent_sessions(
    n: int, steps: int, vocab: int, context_tokens: int, tool_tokens: int, seed: int = 0
) -> list[Conversation]:
    """n agent sessions of `steps` steps: a context of about context_tokens, then tool results of
    about tool_tokens (the engine's generated action goes between them, as in a conversation)."""
    return make_conversations(n, steps, vocab, context_tokens, tool_tokens, seed=seed)
