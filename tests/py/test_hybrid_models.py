"""Exact hits for hybrid models, on model code we did not write (Hugging Face transformers).

Per family (sliding window + full attention, Mamba-2, Mamba-1 and gated-delta-net hybrids): a
three-turn conversation, each turn's prompt the last prompt + answer + a new message. With
hicache, turns 2 and 3 resume from host memory (full-attention pages into fresh blocks, every
other layer's state through ``state_out`` into fresh tensors, a fresh cache object) and prefill
only the rest; the logits and greedy tokens must equal a full recompute with the same chunk
boundaries, bit for bit. Negative controls show the check has teeth: the state of another
position, of another prompt, no state, or one corrupted page each change the output, and a
resume without the state is refused. On the CPU in float32; on a GPU also in bfloat16.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_hybrid  # noqa: E402
from hf_hybrid import FAMILIES, B, HybridEngine, conversation, make_model, run_conversation  # noqa: E402

DEVICES = [("cpu", torch.float32)]
if torch.cuda.is_available():
    DEVICES.append(("cuda", torch.bfloat16))


@pytest.fixture(scope="module", params=DEVICES, ids=lambda d: f"{d[0]}-{str(d[1])[6:]}")
def device(request):
    return request.param


@pytest.fixture(scope="module")
def models(device):
    return {f: make_model(f, *device) for f in FAMILIES}


@pytest.fixture(scope="module")
def recompute(models):
    """Each family's conversation without hicache: the oracle."""
    return {f: run_conversation(HybridEngine(m, use_cache=False)) for f, m in models.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_turns_resumed_from_hicache_equal_a_full_recompute_bit_for_bit(family, models, recompute) -> None:
    engine = HybridEngine(models[family], use_cache=True)
    got = run_conversation(engine)
    ref = recompute[family]
    print(
        f"{family}: layers {hf_hybrid.layer_counts(engine)}, prompt tokens {[t.prompt_tokens for t in got]}, "
        f"served from hicache {[t.served for t in got]}"
    )
    # Turn 1 stored 5 full blocks with states at 64 and 80; turn 2 (137 tokens) resumes at 80.
    # Turn 2 stored 8 full blocks with states at 112 and 128; turn 3 (196 tokens) resumes at 128.
    assert [t.served for t in got] == [0, 5 * B, 8 * B]
    for a, b in zip(got, ref, strict=True):
        assert a.tokens == b.tokens
        assert a.predictions == {p: b.predictions[p] for p in range(a.served, a.prompt_tokens)}
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    s = engine.hc.stats()
    assert (s.pages_loaded, s.states_loaded) == (5 + 8, 2)
    assert engine.hc.state_parts == [p.nbytes for p in engine.parts]
    if family != "gemma3":  # Mamba and GDN layers keep a conv state and a recurrent state
        assert {p.kind for p in engine.parts} == {"conv", "recurrent"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_resume_snaps_to_the_last_boundary_with_a_state(family, models, recompute) -> None:
    # The engine can export the state only at 64 of turn 1's boundaries (80, 64): turn 2 serves
    # 64 tokens, not 80, and stays exact.
    engine = HybridEngine(models[family], use_cache=True)
    engine.exportable = lambda pos: pos % (4 * B) == 0
    got = run_conversation(engine, turns=2)
    assert [t.served for t in got] == [0, 4 * B]
    assert [t.tokens for t in got] == [t.tokens for t in recompute[family][:2]]


def _turn2_with(engine: HybridEngine) -> hf_hybrid.Turn:
    (user1, answer1), (user2, answer2) = conversation(1, turns=2)
    t1 = engine.run(user1, answer1)
    return engine.run(user1 + t1.tokens + user2, answer2)


def _changed(turn: hf_hybrid.Turn, ref: hf_hybrid.Turn) -> int:
    """Greedy tokens that differ: generated ones, and predictions after each prefilled position
    (a tiny random model's few generated tokens alone are often insensitive)."""
    after = [ref.predictions[p] for p in turn.predictions]
    return sum(a != b for a, b in zip(turn.tokens, ref.tokens, strict=True)) + sum(
        a != b for a, b in zip(turn.predictions.values(), after, strict=True)
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_negative_controls_another_position_another_prompt_no_state_a_bad_page(
    family, models, recompute
) -> None:
    model, ref = models[family], recompute[family][1]
    # The state of another prompt at the same position: turn 1 of another conversation.
    other = HybridEngine(model, use_cache=False)
    other.run(conversation(2, turns=1)[0][0], 1)
    foreign = other.snapshots

    controls = {
        "state of another position": lambda e: setattr(
            e, "tamper_state", lambda pos, s: e.snapshots[pos - B]
        ),
        "state of another prompt": lambda e: setattr(e, "tamper_state", lambda pos, s: foreign[pos]),
        "no state": lambda e: setattr(e, "tamper_state", lambda pos, s: [torch.zeros_like(t) for t in s]),
        "one page corrupted": lambda e: setattr(
            e, "tamper_pages", lambda blocks: e.pool[0][blocks[-1]].add_(1.0)
        ),
    }
    # The harness itself, untampered, reproduces the recompute (so the controls below are what
    # changes the output).
    assert _turn2_with(HybridEngine(model, use_cache=True)).tokens == ref.tokens
    for name, apply in controls.items():
        engine = HybridEngine(model, use_cache=True)
        apply(engine)
        turn = _turn2_with(engine)
        assert turn.served == 5 * B, name
        assert not all(torch.equal(x, y) for x, y in zip(turn.logits, ref.logits, strict=True)), name
        changed = _changed(turn, ref)
        print(
            f"{family}: {name}: {changed} of {len(turn.tokens) + len(turn.predictions)} greedy tokens changed"
        )
        assert changed > 0, f"{family}: {name} left every greedy token as it was"


@pytest.mark.parametrize("family", ["gemma3", "bamba"])
def test_a_resume_without_the_state_is_refused(family, models) -> None:
    engine = HybridEngine(models[family], use_cache=True)
    _turn2_with(engine)
    prompt = list(range(200))
    with pytest.raises(ValueError, match="pass state_out"):
        engine.hc.try_resume("x", prompt, lambda n: [0] * (n // B))
    parts = [torch.zeros(p.shape, dtype=p.dtype, device=engine.device) for p in engine.parts]
    with pytest.raises(ValueError, match=f"state_out must be {len(parts)} parts"):
        engine.hc.try_resume("y", prompt, lambda n: [0] * (n // B), state_out=parts[:-1])
    bad = [*parts[:-1], torch.zeros(1, dtype=torch.uint8, device=engine.device)]
    with pytest.raises(
        ValueError, match=f"state_out part {len(parts) - 1} must be {engine.parts[-1].nbytes} bytes"
    ):
        engine.hc.try_resume("z", prompt, lambda n: [0] * (n // B), state_out=bad)
