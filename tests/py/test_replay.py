"""hicache replay on a tiny trace whose hit ratios are worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache import replay

# Blocks of 512 tokens = 4 pages of 128; the pool holds 8 pages (1024 tokens); keep_tokens = 1.
#   r0 [1, 2]  1024 tokens: miss; stores 8 pages (1.0-1.3, 2.0-2.3): the pool is full.
#   r1 [3]      512 tokens: miss; stores 3.0-3.3, evicting 4 pages:
#       lru        touches chains root first, so 1.0-1.3 are oldest: 2.x are stranded.
#       leaf-first touches leaf first and evicts only childless pages: 2.3, 2.2, 2.1, 2.0.
#       optimum    3.x are needed (r3) after everything cached (r2): not cached at all.
#   r2 [1, 2]  1025 tokens (cap: 8 pages):
#       lru        1.0 missing: 0 tokens; re-stores 8 pages (8 evictions: stale 2.x, then 3.x).
#       leaf-first 1.0-1.3 hit, 2.0 missing: 512 tokens; stores 2.x evicting 3.x (4 evictions).
#       optimum    all 8 pages: 1024 tokens.
#   r3 [3]      513 tokens: 3.x are gone under every policy: 0 tokens; 4 more evictions each.
TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [3]},
    {"timestamp": 2, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2, 9]},
    {"timestamp": 3, "input_length": 513, "output_length": 1, "hash_ids": [3, 7]},
]
TOTAL = 1024 + 512 + 1025 + 513
SECOND_HALF = 1025 + 513
EXPECT = {  # policy: (hit tokens, second-half hit tokens, requests hit, evictions)
    "lru": (0, 0, 0, 16),
    "leaf-first": (512, 512, 1, 12),
    "optimum": (1024, 1024, 1, 4),
}


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return p


@pytest.mark.parametrize("policy", ["lru", "leaf-first", "optimum"])
def test_hand_computed_hit_ratios(trace_file: Path, policy: str) -> None:
    trace = replay.load_trace(trace_file)
    if policy == "optimum":
        res = replay.replay_optimum(trace, capacity_pages=8)
    else:
        res = replay.replay_cache(trace, capacity_pages=8, eviction=policy)
    hit, second, hits, evictions = EXPECT[policy]
    assert (res.prompt_tokens, res.second_half_prompt_tokens) == (TOTAL, SECOND_HALF)
    assert (res.hit_tokens, res.second_half_hit_tokens, res.hits, res.evictions) == (
        hit,
        second,
        hits,
        evictions,
    )
    assert res.hit_ratio == pytest.approx(hit / TOTAL)


def test_unbounded_capacity_serves_every_repeated_page(trace_file: Path) -> None:
    trace = replay.load_trace(trace_file)
    for res in [
        replay.replay_cache(trace, 1000, "leaf-first"),
        replay.replay_cache(trace, 1000, "lru"),
        replay.replay_optimum(trace, 1000),
    ]:
        assert res.served == [0, 0, 1024, 512], res.policy


def test_pages_and_prompt_tokens_follow_the_block_ids(trace_file: Path) -> None:
    trace = replay.load_trace(trace_file)
    assert trace.pages(2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    p = trace.prompt(2)
    assert len(p) == 1025 and p[0] == 4 * 128 and p[1024] == 9 * 4 * 128


def test_capacity_parsing() -> None:
    assert replay.parse_capacity("1M", 1 << 20) == 1_000_000 // 128
    assert replay.parse_capacity("300k", 1 << 20) == 300_000 // 128
    assert replay.parse_capacity("2GiB", 1 << 20) == 2048
    assert replay.parse_capacity("inf", 1) >= 2**60
    for bad in ["abc", "10", "0M"]:
        with pytest.raises(ValueError):
            replay.parse_capacity(bad, 1 << 20)


def test_malformed_traces_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input_length": 600, "hash_ids": [1, 2]}\n{"input_length": 700}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        replay.load_trace(p)
    p.write_text('{"input_length": 2000, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="need 4 hash_ids"):
        replay.load_trace(p)


def test_cli_prints_json_and_writes_a_plot(trace_file: Path, tmp_path: Path) -> None:
    png = tmp_path / "hit.png"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache.cli",
            "replay",
            str(trace_file),
            "--capacity",
            "1024,inf",
            "--json",
            "--quiet",
            "--plot",
            str(png),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    rows = json.loads(out.stdout)["tiny.jsonl"]
    assert [(r["policy"], r["hit_tokens"]) for r in rows[:3]] == [
        ("leaf-first", 512),
        ("lru", 0),
        ("optimum", 1024),
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_arguments(trace_file: Path) -> None:
    for args in [["--capacity", "lots"], ["--policy", "fifo"]]:
        out = subprocess.run(
            [sys.executable, "-m", "hicache.cli", "replay", str(trace_file), *args],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2 and "hicache replay:" in out.stderr
