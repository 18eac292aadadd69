"""hicache replay on a tiny trace whose hit ratios are worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache import replay

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"

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
        results = [replay.replay_optimum(trace, capacity_pages=8)]
    else:  # the replay driver and the engine-facing API
        results = [replay.replay_policy(trace, 8, policy), replay.replay_cache(trace, 8, policy)]
    hit, second, hits, evictions = EXPECT[policy]
    for res in results:
        assert (res.prompt_tokens, res.second_half_prompt_tokens) == (TOTAL, SECOND_HALF)
        assert (res.hit_tokens, res.second_half_hit_tokens, res.hits, res.evictions) == (
            hit,
            second,
            hits,
            evictions,
        )
        assert res.hit_ratio == pytest.approx(hit / TOTAL)


def test_second_sighting_declines_a_page_seen_once_while_the_pool_is_full(trace_file: Path) -> None:
    # r0 fills the pool (free slots: admitted); r1's pages 3.x are first sightings: declined, so
    # 1.x and 2.x stay and r2 hits all 8 pages; r3 sees 3.x a second time and stores them.
    trace = replay.load_trace(trace_file)
    res = replay.replay_policy(trace, 8, "second-sighting")
    assert res.served == [0, 0, 1024, 0]
    assert res.pages_stored == 8 + 4 and res.evictions == 4
    assert replay.replay_cache(trace, 8, "second-sighting").served == res.served
    # Negative control: write-through keeps 3.x and loses r2's hit.
    assert replay.replay_policy(trace, 8, "leaf-first").served == [0, 0, 512, 0]


def test_unbounded_capacity_serves_every_repeated_page(trace_file: Path) -> None:
    trace = replay.load_trace(trace_file)
    results = [replay.replay_policy(trace, 1000, p) for p in replay.POLICIES]
    for res in [*results, replay.replay_optimum(trace, 1000)]:
        assert res.served == [0, 0, 1024, 512], res.policy


@pytest.mark.parametrize("policy", list(replay.POLICIES))
def test_the_replay_driver_serves_what_the_engine_api_serves(policy: str) -> None:
    # 2000 requests of the conversation trace in a pool of 1500 pages: evictions,
    # declines and hits; the driver (keyed by page ids) and HostPrefixCache (hashing tokens) must
    # serve the same tokens to every request and store the same pages.
    trace = replay.load_trace(TRACES / "mooncake_conversation_trace.jsonl", limit=2000)
    fast, api = replay.replay_policy(trace, 1500, policy), replay.replay_cache(trace, 1500, policy)
    assert fast.served == api.served
    assert (fast.pages_stored, fast.evictions, fast.hits) == (api.pages_stored, api.evictions, api.hits)
    assert fast.evictions > 100 and fast.hit_tokens > 0


def test_pages_follow_the_block_ids(trace_file: Path) -> None:
    trace = replay.load_trace(trace_file)
    assert trace.pages(2) == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    assert trace.hit_limit(1).tolist() == [7, 3, 8, 4]  # 1025 tokens: 8 pages; 513: 4


def _write(path: Path, reqs: list[tuple[int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"input_length": n, "hash_ids": h}) + "\n" for n, h in reqs))
    return path


def test_finer_block_ids_give_the_same_result(tmp_path: Path) -> None:
    # The conversation trace re-expressed with an id per 128 and per 64 tokens (chained: a new id
    # for each sub-block of each 512-token block) replays exactly as the 512-token original.
    src = TRACES / "mooncake_conversation_trace.jsonl"
    rows = [json.loads(line) for line in src.read_text().splitlines()[:800]]
    base = replay.load_trace(src, limit=800)
    for bt in (128, 64):
        per = 512 // bt
        finer = [(r["input_length"], [h * per + j for h in r["hash_ids"] for j in range(per)]) for r in rows]
        # ids only for blocks the prompt reaches (a partial last block keeps its id)
        finer = [(n, ids[: -(-n // bt)]) for n, ids in finer]
        t = replay.load_trace(_write(tmp_path / f"b{bt}.jsonl", finer), block_tokens=bt)
        for p in ("adaptive", "leaf-first"):
            assert replay.replay_policy(t, 500, p).served == replay.replay_policy(base, 500, p).served
        assert replay.replay_optimum(t, 500).served == replay.replay_optimum(base, 500).served


def test_any_64_bit_ids_and_unhashed_tails(tmp_path: Path) -> None:
    big = [2**64 - 1, -(2**63), 2**63, 12345678901234567]
    t = replay.load_trace(
        _write(tmp_path / "big.jsonl", [(1024, big[:2]), (700, big[:1]), (1100, [*big[:2], big[2]])])
    )
    # 700 tokens with one id: the last 188 tokens are unhashed (not pages); 1100 with 3 ids: 8 pages
    assert [t.page_count(r) for r in range(3)] == [8, 4, 8]
    assert replay.replay_policy(t, 100, "leaf-first").served == [0, 512, 1024]
    assert replay.replay_cache(t, 100, "leaf-first").served == [0, 512, 1024]
    with pytest.raises(ValueError, match="64-bit"):
        replay.load_trace(_write(tmp_path / "huge.jsonl", [(600, [2**64, 1])]))
    with pytest.raises(ValueError, match="integers"):
        replay.load_trace(_write(tmp_path / "float.jsonl", [(600, [1.5, 2])]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="block_tokens"):
        replay.load_trace(tmp_path / "big.jsonl", block_tokens=100)


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
    with pytest.raises(ValueError, match="need 3 hash_ids"):
        replay.load_trace(p)


def _cli(*args: str, pre: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{pre}import sys; from hicache.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_cli_prints_json_lines_as_passes_finish_and_writes_a_plot(trace_file: Path, tmp_path: Path) -> None:
    png = tmp_path / "hit.png"
    out = _cli("replay", str(trace_file), "--capacity", "1024,inf", "--json", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2 * (1 + len(replay.POLICIES))
    at_1024 = {r["policy"]: r for r in rows if r["capacity_tokens"] == 1024}
    assert {p: r["hit_tokens"] for p, r in at_1024.items()} == {
        "optimum": 1024,
        "adaptive": 512,
        "second-sighting": 1024,
        "leaf-first": 512,
        "lru": 0,
    }
    assert at_1024["leaf-first"]["of_optimum"] == 0.5
    assert at_1024["second-sighting"]["bytes_stored"] == 12 * (16 << 20)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_checks_every_option_before_the_first_pass(trace_file: Path) -> None:
    for args in [
        ["--capacity", "lots"],
        ["--policy", "fifo"],
        ["--keep-tokens", "0"],
        ["--keep-tokens", "0", "--no-optimum"],
        ["--block-tokens", "100"],
        ["--jobs", "0"],
        ["--page-bytes", "0", "--capacity", "1GiB"],  # was a ZeroDivisionError
        ["--page-bytes", "-1"],  # was accepted ("GB stored -0")
        ["--limit", "0"],
        ["--limit", "-1"],
    ]:
        out = _cli("replay", str(trace_file), *args)
        assert out.returncode == 2 and "hicache replay:" in out.stderr, args
        assert "|" not in out.stdout, args  # no pass ran
        named = next((a for a in args if a in ("--page-bytes", "--limit")), None)
        if named:
            assert named in out.stderr, (args, out.stderr)  # the message names the option
    # --plot without matplotlib fails before any replay, not after the whole run
    no_mpl = "import sys; sys.modules['matplotlib'] = None; "
    out = _cli("replay", str(trace_file), "--plot", "x.png", pre=no_mpl)
    assert out.returncode == 2 and "matplotlib" in out.stderr and out.stdout == ""
    with pytest.raises(ValueError, match="keep_tokens"):
        list(replay.run(replay.load_trace(trace_file), [8], ["leaf-first"], keep_tokens=0, optimum=True))


def test_capacities_are_told_apart_and_run_once(trace_file: Path) -> None:
    out = _cli("replay", str(trace_file), "--capacity", "1024,1024,1000M,2000M,inf", "--policy", "lru")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    caps = [(c.strip(), p.strip()) for c, p in (line.split("|")[1:3] for line in lines)]
    caps = [row for row in caps if row[0] != "capacity (tokens)"]
    # Rows stream as passes finish, then the table repeats them sorted: each pass once in each.
    whole = "1,000,000,000 (> trace)"  # 2000M and inf hold the whole trace too: the same pass
    assert caps[len(caps) // 2 :] == [
        ("1,024", "optimum"),
        ("1,024", "lru"),
        (whole, "optimum"),
        (whole, "lru"),
    ]
    assert sorted(caps[: len(caps) // 2]) == sorted(caps[len(caps) // 2 :])
    help_text = _cli("replay", "--help").stdout
    assert "file order" in help_text and "timestamps are ignored" in help_text
    assert "--policy '' runs the optimum alone" in help_text


def test_a_shared_tier_serves_what_another_instance_stored(tmp_path: Path) -> None:
    # r0 and r1 share 1024 tokens. Round-robin puts them on instances 0 and 1: r1 misses its own
    # host pool and the shared tier serves the 8 pages r0 wrote through to it; without the tier
    # it recomputes them; one big cache serves them from its pool. Affinity routing (the page at
    # token 512, block 2 here, is the same) puts both on one instance: a host hit.
    t = replay.load_trace(_write(tmp_path / "two.jsonl", [(1024, [1, 2]), (1025, [1, 2, 9])]))
    assert replay.route_requests(t, 2, "round-robin").tolist() == [0, 1]
    rr = replay.replay_shared(t, 2, 100, 100, route="round-robin", policy="leaf-first")
    assert (rr.private_hit_tokens, rr.host_hit_tokens, rr.tier_hit_tokens) == (0, 0, 1024)
    assert rr.big_cache_hit_tokens == 1024 and rr.tier_pages_stored == 8  # r1 adds no full page
    aff = replay.replay_shared(t, 2, 100, 100, route="affinity", policy="leaf-first")
    assert len(set(replay.route_requests(t, 2, "affinity").tolist())) == 1
    assert (aff.private_hit_tokens, aff.host_hit_tokens, aff.tier_hit_tokens) == (1024, 1024, 0)
    none = replay.replay_shared(t, 2, 100, 0, route="round-robin", policy="leaf-first")
    assert none.tier_hit_tokens == 0  # negative control: no tier, no tier hits
    with pytest.raises(ValueError, match="route"):
        replay.route_requests(t, 2, "random")
    # Write-back: a page reaches the tier only when a host evicts it. Hosts of 100 pages evict
    # nothing, so r1 finds nothing there.
    back = replay.replay_shared(t, 2, 100, 100, route="round-robin", policy="leaf-first", write="back")
    assert (back.tier_hit_tokens, back.tier_pages_stored) == (0, 0)
    # Hosts of 4 pages: r2 (instance 0) evicts r0's 4 pages into the tier, where r3 (instance 1,
    # r0's prefix) finds them (and evicts r1's, 8 written back in all); written through, the tier
    # has every page stored anyway.
    t4 = replay.load_trace(
        _write(tmp_path / "four.jsonl", [(512, [1]), (512, [7]), (512, [5]), (513, [1, 9])])
    )
    small = replay.replay_shared(t4, 2, 4, 100, route="round-robin", policy="leaf-first", write="back")
    assert (small.tier_pages_stored, small.tier_hit_tokens) == (8, 512)
    thru = replay.replay_shared(t4, 2, 4, 100, route="round-robin", policy="leaf-first", write="through")
    assert (thru.tier_pages_stored, thru.tier_hit_tokens) == (12, 512)
    with pytest.raises(ValueError, match="write"):
        replay.replay_shared(t, 2, 4, 100, write="around")


def test_cli_replays_instances_over_a_shared_tier(trace_file: Path) -> None:
    out = _cli(
        "replay", str(trace_file), "--instances", "2", "--capacity", "1024", "--tier", "4096", "--json"
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.splitlines()[0])
    assert row["instances"] == 2 and row["tier_capacity_tokens"] == 4096 and "shared_hit_ratio" in row
    for args in [["--instances", "2"], ["--tier", "1M"], ["--instances", "0", "--tier", "1M"],
                 ["--instances", "2", "--tier", "1M", "--route", "random"],
                 ["--instances", "2", "--tier", "1M", "--tier-write", "around"]]:  # fmt: skip
        bad = _cli("replay", str(trace_file), *args)
        assert bad.returncode == 2 and "hicache replay:" in bad.stderr, args
