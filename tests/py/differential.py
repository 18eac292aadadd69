"""Random operations on the C++ cache and on the pure-Python reference.

After every operation the return values, every counter, the LRU order, the engine's KV bytes
and the state buffers must be identical.
"""

from __future__ import annotations

import numpy as np

import hicache
from fake_engine import FakeEngine
from hicache.reference import ReferenceCache

B = 16
NUM_BLOCKS = 48


def conversation_prompts(rng: np.random.Generator, vocab: int, long: bool = False) -> list[np.ndarray]:
    """Prompts that share prefixes: 2 system prompts, 6 conversations, 5 turns each. Long: system
    prompts of 16-50 pages, so stores run in several installments (16, 32, 64 pages...)."""
    lo, hi = (16 * B, 50 * B) if long else (B, 3 * B)
    systems = [rng.integers(0, vocab, size=int(rng.integers(lo, hi))) for _ in range(2)]
    prompts = []
    for c in range(6):
        prompt = systems[c % 2]
        for _ in range(5):
            prompt = np.concatenate([prompt, rng.integers(0, vocab, size=int(rng.integers(5, 2 * B)))])
            prompts.append(prompt.astype(np.int32))
    return prompts


def run_differential(
    copier: str,
    state_bytes: int,
    key_bits: int,
    capacity: int,
    seed: int,
    eviction: str,
    steps: int,
    admission: str = "always",
    long_prompts: bool = False,
    stored: list[int] | None = None,
) -> hicache.CacheStats:
    """Runs `steps` random operations on the C++ cache and on the reference, comparing after each.
    `stored`, if given, receives what each store returned."""
    rng = np.random.default_rng(seed)
    vocab = 4 if key_bits < 128 else 1000
    prompts = conversation_prompts(rng, vocab, long_prompts)
    num_blocks = 2 * NUM_BLOCKS if long_prompts else NUM_BLOCKS
    shapes = [(B, 4), (B, 2, 3)]
    eng_c, eng_r = FakeEngine(num_blocks, B, shapes), FakeEngine(num_blocks, B, shapes)
    common = dict(
        block_tokens=B,
        capacity_pages=capacity,
        keep_tokens=int(rng.integers(1, 20)),
        state_bytes=state_bytes,
        capacity_states=5 if state_bytes else 0,
        state_lookback=3 + seed % 3,  # not from rng: each seed keeps its operations
        copier=copier,
        key_bits=key_bits,
        eviction=eviction,
        admission=admission,
    )
    c = hicache.HostPrefixCache(eng_c.segments, **common)  # type: ignore[arg-type]
    r = ReferenceCache(eng_r.segments, **common)  # type: ignore[arg-type]
    keep_alive: list[np.ndarray] = []  # deferred copies read state buffers after the call
    state_out_c = np.zeros(max(state_bytes, 1), np.uint8)
    state_out_r = np.zeros(max(state_bytes, 1), np.uint8)
    ops = 0

    def state_export_for(prompt: np.ndarray, missing: set[int]):
        def export(pos: int) -> np.ndarray | None:
            if pos in missing:
                return None
            buf = np.frombuffer(
                np.random.default_rng(int(prompt[:pos].sum()) + pos).bytes(state_bytes), np.uint8
            )
            keep_alive.append(buf)
            return buf

        return export

    for step in range(steps):
        op = rng.choice(["resume", "store", "poll", "forget", "complete"], p=[0.38, 0.32, 0.1, 0.1, 0.1])
        rid = f"r{int(rng.integers(0, 8))}"
        prompt = prompts[int(rng.integers(0, len(prompts)))]
        if rng.random() < 0.2:
            prompt = prompt[: int(rng.integers(1, len(prompt) + 1))]
        stream = int(rng.integers(0, 3))
        salt = [None, b"t1"][int(rng.random() < 0.1)]
        if op == "resume":
            blocks = [int(b) for b in rng.permutation(num_blocks)[: len(prompt) // B + 1]]
            refuse = rng.random() < 0.15
            got = []
            for cache, out in ((c, state_out_c), (r, state_out_r)):
                got.append(
                    cache.try_resume(
                        rid,
                        prompt,
                        lambda n, refuse=refuse, blocks=blocks: None if refuse else blocks[: n // B],
                        stream=stream,
                        state_out=out[:state_bytes] if state_bytes else None,
                        salt=salt,
                    )
                )
            assert got[0] == got[1], f"step {step}: try_resume {got}"
        elif op == "store":
            blocks = [int(b) for b in rng.permutation(num_blocks)[: len(prompt) // B + 1]]
            eng_c.prefill(prompt, blocks)
            eng_r.prefill(prompt, blocks)
            missing = {int(p) for p in rng.choice(np.arange(1, 12) * B, size=3)}
            got = [
                cache.store(
                    rid,
                    prompt,
                    blocks,
                    stream=stream,
                    salt=salt,
                    state_export=state_export_for(prompt, missing) if state_bytes else None,
                )
                for cache in (c, r)
            ]
            assert got[0] == got[1], f"step {step}: store {got}"
            if stored is not None:
                stored.append(got[0])
        elif op == "poll":
            assert c.poll() == r.poll(), f"step {step}: poll"
        elif op == "forget":
            outcome = []
            for cache in (c, r):
                try:
                    cache.forget(rid)
                    outcome.append("ok")
                except KeyError:
                    outcome.append("unknown")
            assert outcome[0] == outcome[1], f"step {step}: forget {outcome}"
        elif op == "complete" and copier == "deferred":
            s = None if rng.random() < 0.5 else stream
            assert c.complete_transfers(s) == r.complete_transfers(s)
        ops += 1
        sc, sr = c.stats(), r.stats()
        sr["admitting_second_sightings_only"] = r.admission.second_sighting
        for k, v in sr.items():
            assert getattr(sc, k) == v, f"step {step} ({op}): {k} C++ {getattr(sc, k)} reference {v}"
        assert c.page_lru_order() == r.page_lru_order(), f"step {step}: LRU order"
        for a, b in zip(eng_c.segments, eng_r.segments, strict=True):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"step {step}: engine KV differs"
        assert np.array_equal(state_out_c, state_out_r), f"step {step}: state differs"
    assert ops == steps
    return c.stats()
