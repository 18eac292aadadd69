"""The demo engine: every generated token identical with and without the cache (on the CPU, and
on a GPU in bf16 when there is one)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from hicache.demo import PRESETS, PagedEngine, TinyTransformer, make_conversations  # noqa: E402
from hicache.demo.runner import run_workload, summarize  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("window", [0, 24], ids=["plain", "hybrid"])
@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=needs_gpu)],
    ids=["cpu", "cuda-bf16"],
)
def test_generated_tokens_are_identical_with_and_without_the_cache(
    window: int, device: str, dtype: torch.dtype
) -> None:
    cfg = dataclasses.replace(PRESETS["tiny"], window=window)
    model = TinyTransformer(cfg, torch.device(device), dtype, seed=1)
    convs = make_conversations(6, 9, cfg.vocab, first_tokens=120, user_tokens=40, seed=1)  # 54 requests
    plain = PagedEngine(model, num_blocks=64, block_tokens=32)
    cached = PagedEngine(model, num_blocks=64, block_tokens=32, cache_pages=400)
    without = run_workload(plain, convs, 6, "without")
    with_cache = run_workload(cached, convs, 6, "with")
    s = summarize(with_cache, without)
    assert s.requests == 54
    assert s.tokens_identical, f"{s.mismatched_requests} requests generated other tokens"
    assert s.cached_tokens > s.prompt_tokens // 2  # the cache did serve most of the prompts
    stats = cached.cache.stats()
    assert stats.hits >= 45 and stats.errors == 0
    if window:
        assert stats.states_loaded == stats.hits  # every hit restored the sliding-window rings
    # Greedy outputs of this random model are not constant: the comparison has teeth.
    assert len({tuple(r.generated) for r in without}) > 40


@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=needs_gpu)],
    ids=["cpu", "cuda-bf16"],
)
def test_larger_prefill_chunks_are_still_identical_and_hit_on_chunk_boundaries(
    device: str, dtype: torch.dtype
) -> None:
    cfg = PRESETS["tiny"]
    model = TinyTransformer(cfg, torch.device(device), dtype, seed=3)
    convs = make_conversations(6, 9, cfg.vocab, first_tokens=200, user_tokens=50, seed=3)  # 54 requests
    plain = PagedEngine(model, num_blocks=96, block_tokens=16, prefill_chunk=64)
    cached = PagedEngine(model, num_blocks=96, block_tokens=16, cache_pages=600, prefill_chunk=64)
    without = run_workload(plain, convs, 6, "without")
    with_cache = run_workload(cached, convs, 6, "with")
    s = summarize(with_cache, without)
    assert s.tokens_identical, f"{s.mismatched_requests} requests generated other tokens"
    assert s.cached_tokens > s.prompt_tokens // 3
    assert all(r.cached_tokens % 64 == 0 for r in with_cache)
    assert any(r.cached_tokens > 0 for r in with_cache)
    assert len({tuple(r.generated) for r in without}) > 40


@pytest.mark.parametrize(
    ("window", "chunk"), [(0, 16), (0, 64), (24, 16)], ids=["plain", "chunk64", "hybrid"]
)
@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=needs_gpu)],
    ids=["cpu", "cuda-bf16"],
)
def test_layerwise_loads_generate_identical_tokens(
    window: int, chunk: int, device: str, dtype: torch.dtype
) -> None:
    cfg = dataclasses.replace(PRESETS["tiny"], window=window)
    model = TinyTransformer(cfg, torch.device(device), dtype, seed=4)
    convs = make_conversations(4, 6, cfg.vocab, first_tokens=200, user_tokens=40, seed=4)  # 24 requests
    plain = PagedEngine(model, num_blocks=96, block_tokens=16, prefill_chunk=chunk)
    layerwise = PagedEngine(
        model, num_blocks=96, block_tokens=16, prefill_chunk=chunk, cache_pages=600, layerwise=True
    )
    without = run_workload(plain, convs, 6, "without")
    with_layers = run_workload(layerwise, convs, 6, "layer-wise")
    s = summarize(with_layers, without)
    assert s.tokens_identical, f"{s.mismatched_requests} requests generated other tokens"
    assert s.cached_tokens > s.prompt_tokens // 3
    stats = layerwise.cache.stats()
    assert stats.layerwise_loads == stats.hits >= 18 and stats.errors == 0
    if window:
        assert stats.states_loaded == stats.hits
    assert len({tuple(r.generated) for r in without}) > 18


def test_the_layerwise_comparison_has_teeth(monkeypatch: pytest.MonkeyPatch) -> None:
    # An engine that takes every layer's loaded blocks but the last one's generates other tokens:
    # the identity above depends on every layer's loaded bytes.
    cfg = PRESETS["tiny"]
    model = TinyTransformer(cfg, torch.device("cpu"), torch.float32, seed=4)
    convs = make_conversations(4, 6, cfg.vocab, first_tokens=200, user_tokens=40, seed=4)
    plain = PagedEngine(model, num_blocks=96, block_tokens=16)
    layerwise = PagedEngine(model, num_blocks=96, block_tokens=16, cache_pages=600, layerwise=True)
    take = PagedEngine._take_served

    def all_but_the_last(self: PagedEngine, seq: object, layer: int) -> None:
        if layer != self.full_layers[-1]:
            take(self, seq, layer)  # type: ignore[arg-type]

    monkeypatch.setattr(PagedEngine, "_take_served", all_but_the_last)
    s = summarize(run_workload(layerwise, convs, 6, "broken"), run_workload(plain, convs, 6, "without"))
    assert s.mismatched_requests >= 10


def test_load_or_recompute_keeps_tokens_identical_and_declines_when_prefill_is_faster() -> None:
    cfg = PRESETS["tiny"]
    model = TinyTransformer(cfg, torch.device("cpu"), torch.float32, seed=5)
    convs = make_conversations(3, 4, cfg.vocab, first_tokens=200, user_tokens=40, seed=5)  # 12 requests
    plain = PagedEngine(model, num_blocks=96, block_tokens=16)
    without = run_workload(plain, convs, 4, "without")
    fast = PagedEngine(model, num_blocks=96, block_tokens=16, cache_pages=600, prefill_tokens_per_s=1e15)
    slow = PagedEngine(model, num_blocks=96, block_tokens=16, cache_pages=600, prefill_tokens_per_s=1.0)
    started = time.monotonic()
    declined = run_workload(fast, convs, 4, "recompute")
    took = time.monotonic() - started
    served = run_workload(slow, convs, 4, "load")
    for runs in (declined, served):
        assert summarize(runs, without).tokens_identical
    d, s = fast.cache.stats(), slow.cache.stats()
    # The first hit measures the copy rate; every later one is declined by an engine this fast,
    # except that a rate unmeasured for 5 s is forgotten (CopyRate's stale_after_s) and measured
    # again by the next hit: on a loaded machine (two test runs at once) the 12 requests can take
    # longer than that, and each 5 s may serve one more hit.
    remeasured = int(took // 5.0)
    assert 1 <= d.hits <= 1 + remeasured and d.hits + d.hits_trimmed == 9 and d.pages_recomputed > 8
    assert s.hits == 9 and s.hits_trimmed == 0 and s.load_bytes_per_s > 0
    assert sum(r.cached_tokens for r in declined) < sum(r.cached_tokens for r in served) // 4


def test_progress_lines_cover_the_longer_ones_before_them() -> None:
    cfg = PRESETS["tiny"]
    model = TinyTransformer(cfg, torch.device("cpu"), torch.float32, seed=1)
    convs = make_conversations(6, 2, cfg.vocab, first_tokens=120, user_tokens=40, seed=1)
    out: list[str] = []
    run_workload(PagedEngine(model, num_blocks=64, block_tokens=32), convs, 1, "w", progress=out.append)
    assert out[-1] == "\n" and all(s.startswith("\r") for s in out[:-1]) and len(out) == 13
    lines = [s[1:] for s in out[:-1]]
    texts = [line.rstrip() for line in lines]
    # Some message is shorter than the one before it (a 3-digit prompt after a 4-digit one)...
    assert any(len(b) < len(a) for a, b in itertools.pairwise(texts))
    # ...and is padded so that, after a carriage return, nothing of the longer one stays visible.
    assert all(len(b) >= len(a) for a, b in itertools.pairwise(lines))


def test_prefill_chunks_must_be_whole_blocks_and_plain() -> None:
    model = TinyTransformer(PRESETS["tiny"], torch.device("cpu"), torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of block_tokens"):
        PagedEngine(model, num_blocks=8, block_tokens=16, prefill_chunk=24)
    hybrid = TinyTransformer(
        dataclasses.replace(PRESETS["tiny"], window=8), torch.device("cpu"), torch.float32
    )
    with pytest.raises(ValueError, match="hybrid"):
        PagedEngine(hybrid, num_blocks=8, block_tokens=16, prefill_chunk=32)


def test_hybrid_hits_snap_to_a_boundary_with_a_stored_state() -> None:
    cfg = dataclasses.replace(PRESETS["tiny"], window=16)
    model = TinyTransformer(cfg, torch.device("cpu"), torch.float32, seed=2)
    eng = PagedEngine(model, num_blocks=32, block_tokens=16, cache_pages=64, state_lookback=1)
    prompt = torch.randint(0, cfg.vocab, (5 * 16 + 3,)).tolist()
    eng.run_request("a", prompt, 2)  # stores 5 pages, and the state at 80 only
    longer = eng.run_request("b", prompt + [7] * 20, 2)
    assert longer.cached_tokens == 80
    shorter = eng.run_request("c", prompt[: 4 * 16 + 5], 2)  # 4 pages match, no state at 64 ... 16
    assert shorter.cached_tokens == 0


def test_demo_command_reports_identical_tokens_as_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache.cli",
            "demo",
            "--json",
            "--conversations",
            "3",
            "--turns",
            "3",
            "--first-tokens",
            "200",
            "--user-tokens",
            "60",
            "--block-tokens",
            "32",
            "--window",
            "16",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(out.stdout)
    assert result["tokens_identical"] is True and result["requests"] == 9
    assert result["workload"] == "conversation" and "cache_layerwise" not in result
    assert result["cached_tokens"] > 0 and result["cache"]["states_loaded"] > 0
    # The default device is the GPU when there is one: the JSON must say which ran.
    if torch.cuda.is_available():
        assert result["device"] == "cuda" and result["copy_path"] in ("kernel", "staged", "dma")
    else:
        assert result["device"] == "cpu" and result["copy_path"] == "cpu"


def test_demo_command_runs_the_agentic_workload_layer_by_layer() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "demo", "--json", "--workload", "agentic", "--layerwise",
         "--device", "cpu", "--first-tokens", "600", "--user-tokens", "60", "--turns", "4"],
        check=True,
        capture_output=True,
        text=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert result["workload"] == "agentic" and result["requests"] == 8  # 2 sessions x 4 steps
    assert result["tokens_identical"] is True and result["layerwise_tokens_identical"] is True
    assert result["cache_layerwise"]["layerwise_loads"] == result["cache_layerwise"]["hits"] == 6
    assert result["ttft_p50_layerwise_ms"] > 0


def test_demo_with_a_disk_serves_every_restarted_round_from_the_disk_identically(tmp_path) -> None:
    def demo(seed: int) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "hicache.cli", "demo", "--json", "--device", "cpu", "--disk",
             str(tmp_path / "disk"), "--conversations", "2", "--turns", "3", "--first-tokens", "300",
             "--user-tokens", "60", "--seed", str(seed)],
            check=True,
            capture_output=True,
            text=True,
        )  # fmt: skip
        return json.loads(out.stdout)

    first = demo(0)
    assert first["tokens_identical"] is True and first["requests"] == 6
    rounds = first["rounds"]
    assert rounds[0]["tier_hit_tokens"] == 0 and rounds[0]["tier_pages_written"] > 0
    # Every later round ran on a restarted engine (empty host memory): all it served came from disk.
    assert all(r["tier_hit_tokens"] == r["hit_tokens"] > 0 for r in rounds[1:]), rounds
    # The directory outlives the process: a new run serves its first round from it too...
    again = demo(0)
    assert again["tokens_identical"] is True and again["rounds"][0]["tier_hit_tokens"] > 0
    # ...and another model (other weights, the same shapes) over it is never served its KV.
    other = demo(1)
    assert other["tokens_identical"] is True and other["rounds"][0]["tier_hit_tokens"] == 0
    assert all(r["tier_pages_rejected"] == 0 for r in other["rounds"])
