"""The synthetic agentic trace: the shape its parameters promise, in a format replay reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache import replay
from hicache.agentic_trace import AgenticParams, generate, write_trace


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


def test_steps_extend_their_context_and_sessions_share_system_prompts() -> None:
    p = AgenticParams(sessions=30, steps=10, concurrency=4, branch=0.0, abandon=0.0, seed=1)
    reqs = generate(p)
    assert len(reqs) > 30 * 3
    system_blocks = p.system_tokens // p.block_tokens
    # every request starts with one of the system prompts' blocks
    starts = {tuple(r["hash_ids"][:system_blocks]) for r in reqs}
    assert 1 < len(starts) <= p.system_prompts
    # without branching, each request (but a session's first) extends an earlier request's full blocks
    extended = 0
    fulls = [r["hash_ids"][: r["input_length"] // p.block_tokens] for r in reqs]
    for i, full in enumerate(fulls):
        earlier = fulls[max(0, i - 50) : i]
        if any(len(e) > system_blocks and _is_prefix(e, full) for e in earlier):
            extended += 1
    assert extended >= len(reqs) - 30 - 5
    assert generate(p) == reqs  # seeded: the same trace every time


def test_branches_cut_the_context_back(tmp_path: Path) -> None:
    linear = generate(AgenticParams(sessions=20, steps=20, branch=0.0, abandon=0.0, seed=3))
    branchy = generate(AgenticParams(sessions=20, steps=20, branch=0.5, abandon=0.0, seed=3))
    mean = lambda rs: sum(int(r["input_length"]) for r in rs) / len(rs)  # noqa: E731
    assert mean(branchy) < mean(linear)  # retries from earlier steps keep contexts shorter
    n, tokens = write_trace(AgenticParams(sessions=20, steps=20, branch=0.5, seed=3), tmp_path / "a.jsonl")
    t = replay.load_trace(tmp_path / "a.jsonl")
    assert len(t) == n and int(t.input_lengths.sum()) == tokens
    res = replay.replay_policy(t, 10**6, "leaf-first")
    assert res.hit_ratio > 0.5  # long shared prefixes: most of every prompt is cached


@pytest.mark.parametrize(
    "field,value", [("sessions", 0), ("branch", 1.0), ("abandon", -0.1), ("max_context", 100)]
)
def test_bad_parameters_are_named(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        AgenticParams(**{field: value}).check()  # type: ignore[arg-type]


def test_the_shipped_agentic_trace_is_what_the_defaults_write(tmp_path: Path) -> None:
    shipped = Path(__file__).resolve().parents[2] / "data" / "traces" / "agentic_synthetic_trace.jsonl"
    write_trace(AgenticParams(), tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_bytes() == shipped.read_bytes()
