"""hicache.sglang under SGLang's own cache controller: every page SGLang prefetches is the page it
backed up, byte for byte; every way a stored page can be wrong is a miss in SGLang's accounting.

Runs in build/sglang-venv (scripts/test_all.sh): SGLang 0.5.23 installed with --no-deps beside a
CPU-runnable torch. The SGLang server itself does not run on a machine without a GPU (docs/sglang.md
says what stops it); this is the deepest level of SGLang that does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_rig import PAGE, Shape, backup, hicache_config, make_rig, mha_pools, page_hashes, prefetch

TOKENS = list(range(1000, 1040))  # 10 pages of 4 tokens
HERE = Path(__file__).parent


def tier_options(tier: str, tmp_path: Path) -> dict[str, Any]:
    if tier == "disk":
        return {"tier": "disk", "path": str(tmp_path / "l3"), "capacity_bytes": 64 << 20}
    return {"tier": "memory"}


@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize(
    ("kind", "layout"),
    [("mha", "layer_first"), ("mha", "page_first"), ("mla", "layer_first"), ("mla", "page_first")],
)
def test_every_page_sglang_prefetches_is_the_page_it_backed_up(
    kind: str, layout: str, tier: str, tmp_path: Path
) -> None:
    rig = make_rig(kind, layout, extra=hicache_config(**tier_options(tier, tmp_path)))
    try:
        keys, written = backup(rig, TOKENS, seed=1)
        assert rig.backend.batch_exists(keys) == 10
        loaded, got = prefetch(rig, TOKENS, "r1")
        assert loaded == len(TOKENS) and got == written
        # A continuation: SGLang holds the first 4 pages already and prefetches the rest after
        # them, naming the last key it holds (and, with prefix keys on, the keys before).
        loaded, got = prefetch(rig, TOKENS[16:], "r2", last_hash=keys[3], prefix_keys=keys[:4])
        assert loaded == 24 and got == written[4:]
        # A prompt that shares only the first 6 pages: the hit ends where the prompts part.
        other = TOKENS[:24] + [7] * 16
        loaded, got = prefetch(rig, other, "r3")
        assert loaded == 24 and got == written[:6]
        stats = rig.backend.stats()["kv"]
        assert stats["pages_got"] == 10 + 6 + 6 and stats["pages_rejected"] == 0
    finally:
        rig.close()


def test_two_engines_share_pages_through_mooncake_store(tmp_path: Path) -> None:
    # Two SGLang controllers (two engines), each with its own Mooncake Store client, on one
    # master on 127.0.0.1: what one backs up, the other prefetches, byte for byte.
    sys.path.insert(0, str(HERE.parent / "py"))
    from mooncake_support import running_master

    with running_master(tmp_path) as m:
        options = hicache_config(
            tier="mooncake",
            mooncake_master=m.rpc,
            mooncake_metadata=m.metadata,
            mooncake_segment_bytes=64 << 20,
        )
        a = make_rig(extra=options)
        b = make_rig(extra=options)
        try:
            keys, written = backup(a, TOKENS, seed=9)
            assert b.backend.batch_exists(keys) == 10
            loaded, got = prefetch(b, TOKENS, "from-a")
            assert loaded == len(TOKENS) and got == written
            # Another model on the same store sees none of them.
            c = make_rig(extra=options, model="another-model")
            try:
                assert prefetch(c, TOKENS, "other-model") == (0, [])
            finally:
                c.close()
        finally:
            b.close()
            a.close()


def _swa_pool(rig: Any) -> Any:
    """A second host pool, as a hybrid model's sliding-window layers have (SGLang's SWA host pool is
    an MHA host pool of the SWA layers), registered through the v2 call."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    _, swa = mha_pools(Shape(layers=1, tokens=64), "layer_first")
    rig.backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    return swa


def test_a_hybrid_models_window_pages_travel_beside_the_kv_pages_through_the_v2_calls() -> None:
    # The calls SGLang's HybridCacheController makes for a sliding-window pool (TRAILING_PAGES:
    # only the last pages' windows are kept), each group's prefix keys from SGLang's own
    # _trailing_chain_groups.
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import _trailing_chain_groups

    rig = make_rig()
    try:
        swa = _swa_pool(rig)
        keys, _ = backup(rig, TOKENS, seed=13)
        src = swa.alloc(2 * PAGE)
        raw = swa.kv_buffer.view(torch.uint8)
        raw.copy_(
            torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(13))
        )
        want = [swa.get_data_page(int(src[i]), flat=True).view(torch.uint8).clone() for i in (0, PAGE)]

        def transfer(indices: torch.Tensor | None) -> PoolTransfer:
            return PoolTransfer(
                name=PoolName.SWA,
                host_indices=indices,
                keys=keys[-2:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )

        def call(fn: Any, indices: torch.Tensor | None) -> dict[str, list[bool]]:
            out: dict[str, list[bool]] = {}
            for info, group in _trailing_chain_groups([], keys, [transfer(indices)]):
                out.update(fn(group, extra_info=info))
            return out

        assert call(rig.backend.batch_set_v2, src) == {"swa": [True, True]}
        hit = rig.backend.batch_exists_v2(keys, [transfer(None)])
        assert hit.kv_hit_pages == 10 and hit.restorable_prefix_pages == [10]
        # A prompt that parts after 9 pages has no window to resume from.
        other = TOKENS[:36] + [5] * 4
        short = rig.backend.batch_exists_v2(page_hashes(other), [transfer(None)])
        assert short.extra_pool_hit_pages["kv"] == 9 and short.restorable_prefix_pages == []
        assert short.kv_hit_pages == 0  # the usable prefix
        dst = swa.alloc(2 * PAGE)
        raw.copy_(
            torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(14))
        )
        assert call(rig.backend.batch_get_v2, dst) == {"swa": [True, True]}
        got = [swa.get_data_page(int(dst[i]), flat=True).view(torch.uint8) for i in (0, PAGE)]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        # A damaged window page: not loaded, and from then on no prefix resumes from it.
        tier, store = rig.backend.tier, rig.backend._stores["swa"]
        name = store.value_name(keys[-1])
        value = bytearray(tier.value(name))
        value[3] ^= 1
        tier.set_value(name, bytes(value))
        assert call(rig.backend.batch_get_v2, dst) == {"swa": [True, False]}
        assert rig.backend.batch_exists_v2(keys, [transfer(None)]).restorable_prefix_pages == []
    finally:
        rig.close()


def test_negative_control_the_byte_check_catches_a_backend_that_loads_nothing(tmp_path: Path) -> None:
    # A backend that says every page loaded but writes none: the check above must fail for it.
    rig = make_rig(
        extra={
            "backend_name": "liar",
            "module_path": "liar_backend",
            "class_name": "LiarStorage",
            "interface_v1": 1,
        }
    )
    try:
        _, written = backup(rig, TOKENS, seed=2)
        loaded, got = prefetch(rig, TOKENS, "liar")
        assert loaded == len(TOKENS) and got != written
    finally:
        rig.close()


def _corrupt_memory_value(rig: Any, key: str, edit: str) -> None:
    tier = rig.backend.tier
    name = rig.backend._stores["kv"].value_name(key)
    if edit == "flip":
        value = bytearray(tier.value(name))
        value[17] ^= 1
        tier.set_value(name, bytes(value))
    elif edit == "truncate":
        tier.truncate(name, len(tier.value(name)) - 100)
    else:
        assert tier.erase(name)


@pytest.mark.parametrize("edit", ["flip", "truncate", "erase"])
def test_a_damaged_or_missing_page_ends_the_hit_there_and_is_never_loaded(edit: str) -> None:
    rig = make_rig()
    try:
        keys, written = backup(rig, TOKENS, seed=3)
        _corrupt_memory_value(rig, keys[5], edit)
        loaded, got = prefetch(rig, TOKENS, "r1")
        assert loaded == 5 * PAGE and got == written[:5]
        stats = rig.backend.stats()["kv"]
        if edit == "erase":  # SGLang's existence query already stops before it
            assert stats["pages_got"] == 5
        else:
            assert stats["pages_rejected"] == 1
    finally:
        rig.close()


def test_a_damaged_page_is_replaced_by_the_next_backup_of_it() -> None:
    # The backend skips pages the tier holds; one that failed its check is backed up again.
    rig = make_rig()
    try:
        keys, written = backup(rig, TOKENS, seed=12)
        _corrupt_memory_value(rig, keys[5], "flip")
        assert prefetch(rig, TOKENS, "r1")[0] == 5 * PAGE
        assert rig.backend.batch_exists(keys) == 5
        assert backup(rig, TOKENS, seed=12)[1] == written  # SGLang computes the prefix again
        loaded, got = prefetch(rig, TOKENS, "r2")
        assert loaded == len(TOKENS) and got == written
        assert rig.backend.stats()["kv"]["pages_put"] == 10 + 1
    finally:
        rig.close()


def test_sglangs_own_file_backend_serves_the_same_flipped_byte(tmp_path: Path) -> None:
    # What the check above buys: SGLang's built-in file backend, the same page damaged on disk,
    # loads the wrong bytes and counts the page as a hit.
    rig = make_rig(backend="file", extra={"file_storage_path": str(tmp_path / "file")})
    try:
        keys, written = backup(rig, TOKENS, seed=4)
        (path,) = [p for p in (tmp_path / "file").iterdir() if p.name.startswith(keys[5])]
        data = bytearray(path.read_bytes())
        data[17] ^= 1
        path.write_bytes(bytes(data))
        loaded, got = prefetch(rig, TOKENS, "r1")
        assert loaded == len(TOKENS)
        assert got[:5] == written[:5] and got[5] != written[5]
    finally:
        rig.close()


def test_pages_of_another_model_layout_or_dtype_are_never_read(tmp_path: Path) -> None:
    options = hicache_config(**tier_options("disk", tmp_path))
    rig = make_rig(extra=options)
    try:
        backup(rig, TOKENS, seed=5)
    finally:
        rig.close()
    for other in (
        {"model": "another-model"},
        {"layout": "page_first"},
        {"dtype": torch.bfloat16},
    ):
        rig = make_rig(extra=options, **other)
        try:
            assert prefetch(rig, TOKENS, "r1") == (0, []), other
        finally:
            rig.close()
    rig = make_rig(extra=options)  # and the writer's own layout still reads them
    try:
        assert prefetch(rig, TOKENS, "r1")[0] == len(TOKENS)
    finally:
        rig.close()


def test_a_new_process_serves_what_an_earlier_one_wrote_exact_to_the_byte(tmp_path: Path) -> None:
    options = hicache_config(**tier_options("disk", tmp_path))
    script = HERE / "restart_child.py"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    out = tmp_path / "written.json"
    subprocess.run(
        [sys.executable, str(script), "write", json.dumps(options), str(out)],
        check=True,
        env=env,
        timeout=300,
    )
    written = json.loads(out.read_text())
    assert len(written) == 10
    rig = make_rig(extra=options)
    try:
        loaded, got = prefetch(rig, TOKENS, "after-restart")
        assert loaded == len(TOKENS)
        assert [zlib.crc32(p) for p in got] == written
        assert rig.backend.stats()["disk"]["values"] == 10
    finally:
        rig.close()


def test_a_process_killed_while_backing_up_leaves_no_wrong_page(tmp_path: Path) -> None:
    options = hicache_config(**tier_options("disk", tmp_path))
    script = HERE / "restart_child.py"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    child = subprocess.Popen(
        [sys.executable, str(script), "write-forever", json.dumps(options), str(tmp_path / "log")], env=env
    )
    log = tmp_path / "log"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:  # a few rounds backed up
            if log.exists() and len(log.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert child.poll() is None, "the writer ended before it was killed"
        child.kill()  # SIGKILL, mid-write or not
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    rounds = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert len(rounds) >= 3
    rig = make_rig(extra=options)
    try:
        for r in rounds:  # every round the child logged as backed up is served exactly
            tokens = r["tokens"]
            loaded, got = prefetch(rig, tokens, f"round-{r['seed']}")
            assert loaded == len(tokens)
            assert [zlib.crc32(p) for p in got] == r["crc"]
        assert rig.backend.stats()["kv"]["pages_rejected"] == 0
    finally:
        rig.close()


def test_a_failing_tier_is_a_miss_never_an_exception() -> None:
    rig = make_rig()
    try:
        _, written = backup(rig, TOKENS, seed=6)
        rig.backend.tier.fail_next(1)  # the existence query fails: no hit
        assert prefetch(rig, TOKENS, "r1") == (0, [])
        loaded, got = prefetch(rig, TOKENS, "r2")
        assert loaded == len(TOKENS) and got == written
        assert rig.backend.stats()["kv"]["tier_errors"] == 10
    finally:
        rig.close()


def test_the_generic_interface_without_interface_v1_round_trips_too() -> None:
    options = hicache_config(tier="memory")
    del options["interface_v1"]
    rig = make_rig(extra=options)
    try:
        assert rig.controller.page_get_func.__name__ == "_generic_page_get"
        _, written = backup(rig, TOKENS, seed=7)
        loaded, got = prefetch(rig, TOKENS, "r1")
        assert loaded == len(TOKENS) and got == written
        assert rig.backend.stats()["kv-flat"]["pages_got"] == 10
    finally:
        rig.close()


def test_storage_metrics_are_reported_in_sglangs_terms() -> None:
    rig = make_rig(metrics=True)
    try:
        backup(rig, TOKENS, seed=8)
        prefetch(rig, TOKENS, "r1")
        m = rig.backend.get_stats()
        assert type(m).__name__ == "StorageMetrics"
        assert m.backup_pgs == [10] and m.prefetch_pgs == [10]
        assert all(bw > 0 for bw in m.backup_bandwidth + m.prefetch_bandwidth)
        assert rig.backend.get_stats().prefetch_pgs == []  # since the last call
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tier": "memory", "tierr": 1}, "unknown extra-config key(s) ['tierr']"),
        ({"tier": "floppy"}, "tier must be one of"),
        ({"tier": "disk"}, "needs 'path' and 'capacity_bytes'"),
        ({"tier": "memory", "timeout_s": 0}, "timeout_s must be"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        make_rig(extra=hicache_config(**options))
    assert message in str(e.value)


def test_what_it_cannot_store_exactly_is_refused_at_start_up(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from hicache.sglang import HicacheStorage

    mla_tp2 = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="m",
        extra_config={"tier": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 24},
    )
    with pytest.raises(NotImplementedError, match="use tier 'mooncake'"):
        HicacheStorage(mla_tp2, {})
    mla_tp2.tp_size, mla_tp2.extra_config = 1, {"tier": "memory"}
    with pytest.raises(NotImplementedError, match="no get_page_buffer_meta"):
        HicacheStorage(mla_tp2, {}).register_mem_pool_host(object())
    rig = make_rig()
    try:
        with pytest.raises(NotImplementedError, match="no get_page_buffer_meta"):
            rig.backend.register_mem_host_pool_v2(object(), "mamba")
    finally:
        rig.close()


def test_keys_are_sglangs_own_page_hashes() -> None:
    # The backend is handed SGLang's chained SHA-256 keys; a continuation's keys chain from the
    # last key before it, which is what the parent check compares.
    keys = page_hashes(TOKENS)
    assert page_hashes(TOKENS[16:], keys[3]) == keys[4:]


def test_the_memory_tier_says_it_is_unbounded(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="hicache.sglang"):
        rig = make_rig()
    rig.close()
    assert any("unbounded and never evicted" in r.getMessage() for r in caplog.records)
