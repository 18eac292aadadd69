"""A synthetic agentic trace in Mooncake's format: many-step sessions over long shared prefixes.

An agent session starts from one of a few system prompts (shared by every session of that
agent), adds its task, then runs steps: each step is one request whose prompt is the whole
context so far; the model's output and a tool's result are appended before the next step. So
every request reuses its predecessor's whole prompt, contexts grow to tens of thousands of
tokens, and the part worth caching dwarfs the part to compute. Sessions interleave (several run
at once), sometimes retry from an earlier step (a branch: the context is cut back there) and
sometimes stop early (abandoned). Lengths are drawn from exponential distributions around their
means, so a few steps carry very long tool outputs.

Hash ids are chained as in Mooncake's traces: one id per ``block_tokens`` tokens, equal ids
meaning an equal prefix. A block that ends mid-prompt gets an id of its own for that request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_COUNTS = (
    "sessions",
    "steps",
    "system_tokens",
    "task_tokens",
    "tool_tokens",
    "output_tokens",
    "max_context",
    "concurrency",
    "system_prompts",
    "block_tokens",
)
Request = dict[str, Any]  # one trace line: timestamp, input_length, output_length, hash_ids


@dataclass
class AgenticParams:
    sessions: int = 400  # agent sessions in the trace
    steps: int = 40  # mean requests per session (geometric)
    system_tokens: int = 4096  # length of each system prompt
    task_tokens: int = 2048  # mean length of a session's task (exponential)
    tool_tokens: int = 1500  # mean tool output appended per step (exponential)
    output_tokens: int = 300  # mean model output per step (exponential)
    max_context: int = 131072  # a session ends when its context would pass this
    branch: float = 0.05  # chance that a step retries from an earlier step's context
    abandon: float = 0.02  # chance that a session ends after any step
    concurrency: int = 64  # sessions running at once (their requests interleave)
    system_prompts: int = 4  # distinct agents (system prompts)
    block_tokens: int = 512
    seed: int = 0

    def check(self) -> None:
        for name in _COUNTS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("branch", "abandon"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1) (got {getattr(self, name)})")
        if self.max_context <= self.system_tokens:
            raise ValueError("max_context must exceed system_tokens")


class _Context:
    """A prompt as chained block ids: full blocks, plus the length of a trailing partial one."""

    def __init__(self, ids: list[int], tail: int) -> None:
        self.ids, self.tail = ids, tail

    def tokens(self, block: int) -> int:
        return len(self.ids) * block + self.tail

    def copy(self) -> _Context:
        return _Context(list(self.ids), self.tail)


@dataclass
class _Session:
    ctx: _Context
    steps_left: int
    history: list[_Context] = field(default_factory=list)  # each step's prompt, for branches


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def fresh(self) -> int:
        self.next += 1
        return self.next - 1


def _append(ctx: _Context, n: int, block: int, ids: _Ids) -> None:
    total = ctx.tail + n  # the partial block's tokens and the new ones: new content
    ctx.ids.extend(ids.fresh() for _ in range(total // block))
    ctx.tail = total % block


def generate(p: AgenticParams) -> list[Request]:
    """The trace's requests in arrival order."""
    p.check()
    rng = np.random.default_rng(p.seed)
    ids = _Ids()
    B = p.block_tokens
    systems = []
    for _ in range(p.system_prompts):
        c = _Context([], 0)
        _append(c, p.system_tokens, B, ids)
        systems.append(c)

    def draw(mean: int) -> int:
        return max(1, int(rng.exponential(mean)))

    def start() -> _Session:
        ctx = systems[int(rng.integers(p.system_prompts))].copy()
        _append(ctx, draw(p.task_tokens), B, ids)
        return _Session(ctx, steps_left=int(rng.geometric(1.0 / p.steps)))

    started, out = 0, []
    active: list[_Session] = []
    t_ms = 0
    while active or started < p.sessions:
        while len(active) < p.concurrency and started < p.sessions:
            active.append(start())
            started += 1
        s = active[int(rng.integers(len(active)))]
        ctx = s.ctx
        if s.history and rng.random() < p.branch:  # retry from an earlier step
            ctx = s.history[int(rng.integers(len(s.history)))].copy()
        hash_ids = list(ctx.ids) + ([ids.fresh()] if ctx.tail else [])
        output = draw(p.output_tokens)
        out.append(
            {"timestamp": t_ms, "input_length": ctx.tokens(B), "output_length": output, "hash_ids": hash_ids}
        )
        t_ms += int(rng.integers(50, 500))
        s.history.append(ctx.copy())
        s.ctx = ctx.copy()
        _append(s.ctx, output + draw(p.tool_tokens), B, ids)
        s.steps_left -= 1
        if s.steps_left <= 0 or rng.random() < p.abandon or s.ctx.tokens(B) > p.max_context:
            active.remove(s)
    return out


def write_trace(p: AgenticParams, path: str | Path) -> tuple[int, int]:
    """Writes the trace; returns (requests, prompt tokens)."""
    reqs = generate(p)
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(r) + "\n")
    return len(reqs), sum(int(r["input_length"]) for r in reqs)
