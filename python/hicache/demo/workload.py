"""Multi-turn conversations, deterministic from a seed: each turn's prompt is the previous prompt,
the previous answer and a new user message."""

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
