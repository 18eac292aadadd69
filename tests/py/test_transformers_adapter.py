"""hicache.transformers on model code we did not write: every cache family, exact, with controls.

Tiny random-weight models (``hf_families.py``): full attention, sliding windows, Mamba-1 and
Mamba-2, short convolutions, gated delta nets, and models with no full-attention layer at all.
A three-turn conversation (each prompt = the last prompt, its answer and a new message) through
``PrefixCache.generate`` gives the greedy tokens of a plain ``model.generate`` and logits within
float32 rounding of it; the resumed turns are served from hicache. Negative controls show that
what hicache loads is what the outputs depend on.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hicache  # noqa: E402
from hf_families import FAMILIES, make_model  # noqa: E402
from hicache import transformers as hct  # noqa: E402

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")

B = 16
NEW_TOKENS = 6
# Bamba's own code (transformers 5.24, torch path) computes a token differently when it is
# decoded after a prefill than when it ends a longer prefill, and a prompt differently in chunks
# than in one pass (logits off by 0.1-0.2 with no hicache involved: test_bamba_alone_depends_on_
# its_chunks), enough to change a greedy token even on a turn with no hit. Its adapter runs are
# checked against the same chunk boundaries (test_same_boundaries_bit_exact) instead.
SELF_INCONSISTENT = {"bamba"}


def conversation(seed: int = 1) -> list[list[int]]:
    """New user tokens per turn."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (87, 35, 44)]


def generate(fn: Any, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    out = fn(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert out.sequences[0, : len(ids)].tolist() == ids, "the result starts with the prompt"
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits).float()


def run(pc: Any, model: Any) -> list[dict[str, Any]]:
    history: list[int] = []
    turns = []
    for user in conversation():
        prompt = history + user
        ref_tokens, ref_logits = generate(model.generate, prompt)
        tokens, logits = generate(pc.generate, prompt)
        turns.append(
            dict(served=pc.last_served, tokens=tokens, ref_tokens=ref_tokens, logits=logits, ref=ref_logits)
        )
        history = prompt + tokens
    return turns


# The release the test command installs: every family must work there. Another release (the
# GPU host's image) may keep some families' state in cache classes of their own; those are
# refused by name, and skipped here with that message.
PINNED = "5.24.0"


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: Any) -> tuple[str, Any]:
    model = make_model(request.param)
    try:
        hct.describe(model, B)
    except hct.UnsupportedModelError as e:
        if transformers.__version__ == PINNED:
            raise
        pytest.skip(f"transformers {transformers.__version__}: {e}")
    return request.param, model


def test_generate_matches_plain_generate(family: tuple[str, Any]) -> None:
    name, model = family
    pc = hct.PrefixCache(model, capacity_pages=64, block_tokens=B)
    turns = run(pc, model)
    # Turn 1 stores up to its last boundary below 87 tokens; turns 2 and 3 resume from there.
    assert [t["served"] for t in turns] == [0, 80, 112]
    for i, t in enumerate(turns):
        if name in SELF_INCONSISTENT:
            continue  # see SELF_INCONSISTENT: the same boundaries are checked bit for bit instead
        assert t["tokens"] == t["ref_tokens"], f"{name} turn {i + 1}"
        diff = float((t["logits"] - t["ref"]).abs().max())
        assert diff < 1e-4, f"{name} turn {i + 1}: logits off by {diff}"
    st = pc.cache.stats()
    assert st.hits == 2 and st.errors == 0


def test_same_boundaries_bit_exact(family: tuple[str, Any]) -> None:
    """A resumed turn's logits equal, bit for bit, a run without hicache at the same chunk
    boundaries (the adapter's ``cuts``): the pages and the state are exactly what was stored."""
    name, model = family
    pc = hct.PrefixCache(model, capacity_pages=64, block_tokens=B)
    first, second = conversation()[0], conversation()[0] + conversation()[1]
    with torch.no_grad():
        pc.prefill(first)
        cache = pc.prefill(second)
        assert pc.last_served == 80
        m = pc.last_length
        got = hct._forward(model, torch.tensor(second[m:]), cache).logits[0]
        # Without hicache: the first turn's boundaries up to 80, then the second turn's.
        stop1 = max(len(first) - 1, 80) if pc.layout.tokenwise else 80
        cuts = [c for c in pc.cuts(0, 80, stop1) if c <= 80] + pc.cuts(80, 112, m)[1:]
        ref_cache = hct.fresh_cache(model)
        t = torch.tensor(second)
        for c0, c1 in itertools.pairwise(cuts):
            hct._forward(model, t[c0:c1], ref_cache)
        ref = hct._forward(model, t[m:], ref_cache).logits[0]
    assert torch.equal(got, ref), f"{name}: {float((got - ref).abs().max())}"


def test_bamba_alone_depends_on_its_chunks() -> None:
    """Why Bamba is checked at the same boundaries only: without hicache, the prefill the adapter
    runs on turn 1 (chunks ending at its stored boundaries) and one pass over the same 80 tokens
    give different logits, while a family without this defect gives the same to rounding."""
    diffs = {}
    for name in ("bamba", "granitemoehybrid"):  # both Mamba-2 hybrids
        model = make_model(name)
        pc = hct.PrefixCache(model, capacity_pages=64, block_tokens=B)
        ids = torch.tensor(conversation()[0][:80])
        with torch.no_grad():
            whole = hct._forward(model, ids, hct.fresh_cache(model)).logits[0, -1]
            cache = hct.fresh_cache(model)
            for c0, c1 in itertools.pairwise(pc.cuts(0, 80, 80)):
                chunked = hct._forward(model, ids[c0:c1], cache).logits[0, -1]
        diffs[name] = float((whole - chunked).abs().max())
    assert diffs["bamba"] > 1e-2 and diffs["granitemoehybrid"] < 1e-4, diffs


def _tampered(model: Any, tamper: Any) -> float:
    """Turn 2's logits with `tamper(pc, position, state)` applied to what hicache loaded,
    against an untampered run: the largest difference."""
    logits = []
    for t in (None, tamper):
        pc = hct.PrefixCache(model, capacity_pages=64, block_tokens=B)
        if t is not None:
            rebuild = pc._rebuild

            def patched(position: int, state: Any, pc: Any = pc, t: Any = t, rebuild: Any = rebuild) -> Any:
                return t(pc, rebuild, position, [s.clone() for s in state])

            pc._rebuild = patched  # type: ignore[method-assign]
        user = conversation()
        generate(pc.generate, user[0])
        logits.append(generate(pc.generate, user[0] + [1, 2, 3, 4, 5, 6] + user[1])[1])
        assert pc.last_served == 80
    return float((logits[0] - logits[1]).abs().max())


def test_negative_controls(family: tuple[str, Any]) -> None:
    """Each of these changes the outputs: the state zeroed, the state flag transformers needs
    dropped (a silent discard of the loaded state), one page of KV corrupted."""
    name, model = family
    layout = hct.describe(model, B)
    controls: dict[str, Any] = {}
    if layout.parts:
        controls["state zeroed"] = lambda pc, rebuild, pos, st: rebuild(
            pos, [torch.zeros_like(s) for s in st]
        )
    if any(p.kind in ("conv", "recurrent") for p in layout.parts):

        def no_flag(pc: Any, rebuild: Any, pos: int, st: Any) -> Any:
            cache = rebuild(pos, st)
            for layer in cache.layers:
                if isinstance(layer, hct._LINEAR):
                    layer.has_previous_state = dict.fromkeys(layer.has_previous_state, False)
            return cache

        controls["has_previous_state dropped"] = no_flag
    if layout.paged:

        def bad_page(pc: Any, rebuild: Any, pos: int, st: Any) -> Any:
            pc.staging[0][2] += 1.0  # block 2's keys of the first full-attention layer
            return rebuild(pos, st)

        controls["one page corrupted"] = bad_page
    assert controls
    for what, tamper in controls.items():
        diff = _tampered(model, tamper)
        assert diff > 1e-3, f"{name}: {what} changed the logits by {diff} only"


@pytest.mark.skipif(transformers.__version__ != PINNED, reason=f"the layouts of transformers {PINNED}")
def test_layouts_found() -> None:
    """What the adapter reads from each family (pins the families' mixes)."""
    kinds = {}
    for name in ("llama", "gemma3", "falcon_h1", "nemotron_h", "lfm2", "mamba", "mistral_all_sliding"):
        lay = hct.describe(make_model(name), B)
        kinds[name] = (len(lay.paged), sorted({p.kind for p in lay.parts}), lay.tokenwise)
    assert kinds == {
        "llama": (2, [], False),
        "gemma3": (1, ["window_k", "window_v"], False),
        "falcon_h1": (2, ["conv", "recurrent"], False),  # attention and Mamba-2 in each layer
        "nemotron_h": (1, ["conv", "recurrent"], False),  # one MLP-only layer holds nothing
        "lfm2": (2, ["conv"], False),  # short convolutions: no recurrent state
        "mamba": (0, ["conv", "recurrent"], True),
        "mistral_all_sliding": (0, ["window_k", "window_v"], False),
    }


@pytest.mark.skipif(transformers.__version__ != PINNED, reason=f"transformers {PINNED}'s Mamba-1 code")
@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_mamba1_continues_one_token_at_a_time(name: str) -> None:
    """Why the adapter prefills Mamba-1 families one token at a time after a cached state:
    transformers' multi-token scan there ignores the state it continues from. When this fails,
    transformers has fixed it and ``_TOKENWISE_MIXERS`` can go."""
    model = make_model(name)
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hct._forward(model, ids, hct.fresh_cache(model)).logits[0, -1]
        chunked = hct.fresh_cache(model)
        hct._forward(model, ids[:16], chunked)
        chunk = hct._forward(model, ids[16:], chunked).logits[0, -1]
        tokenwise = hct.fresh_cache(model)
        hct._forward(model, ids[:16], tokenwise)
        for i in range(16, 48):
            one = hct._forward(model, ids[i : i + 1], tokenwise).logits[0, -1]
    assert float((chunk - ref).abs().max()) > 1e-3
    assert float((one - ref).abs().max()) < 1e-4
    assert hct.describe(model, B).tokenwise


@pytest.mark.skipif(
    not hasattr(transformers.cache_utils, "DynamicIndexedLayer"),
    reason="no DynamicIndexedLayer in this release",
)
def test_unsupported_layers_named(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("llama")
    n = model.config.num_hidden_layers

    def indexed(model: Any) -> Any:  # the DeepSeek-V3.2 / GLM-DSA indexer cache
        cache = transformers.DynamicCache()
        cache.layers = [transformers.cache_utils.DynamicIndexedLayer() for _ in range(n)]
        return cache

    monkeypatch.setattr(hct, "fresh_cache", indexed)
    with pytest.raises(hct.UnsupportedModelError, match=r"llama: layer 0 is a DynamicIndexedLayer"):
        hct.PrefixCache(model, capacity_pages=8)

    def static(model: Any) -> Any:
        return transformers.StaticCache(config=model.config, max_cache_len=64)

    monkeypatch.setattr(hct, "fresh_cache", static)
    with pytest.raises(hct.UnsupportedModelError, match=r"llama: .*StaticCache"):
        hct.PrefixCache(model, capacity_pages=8)


def test_bad_arguments() -> None:
    model = make_model("llama")
    with pytest.raises(ValueError, match="chunk_tokens=24 must be a multiple of block_tokens=16"):
        hct.PrefixCache(model, capacity_pages=8, chunk_tokens=24)
    with pytest.raises(ValueError, match="block_tokens must be a positive int"):
        hct.PrefixCache(model, capacity_pages=8, block_tokens=0)
    pc = hct.PrefixCache(model, capacity_pages=8)
    with pytest.raises(ValueError, match="batch 1"):
        pc.prefill(torch.zeros(2, 40, dtype=torch.long))
    with pytest.raises(TypeError, match="not text"):
        pc.prefill("hello")


def test_store_after_generate_serves_the_answer() -> None:
    """Full attention: ``store`` after ``generate`` caches the answer's pages too."""
    model = make_model("llama")
    pc = hct.PrefixCache(model, capacity_pages=64, block_tokens=B)
    prompt = conversation()[0]
    cache = pc.prefill(prompt)
    out = model.generate(torch.tensor([prompt]), **{hct.CACHE_ARG: cache}, max_new_tokens=30, do_sample=False)
    assert pc.store(out[0], cache) > 0
    pc.prefill([*out[0].tolist(), 7, 8, 9])
    assert pc.last_served == (len(out[0]) - 1) // B * B > 80


def test_max_tokens_bounds_what_is_served() -> None:
    model = make_model("gemma3")
    pc = hct.PrefixCache(model, capacity_pages=64, block_tokens=B, max_tokens=48)
    prompt = conversation()[0]
    ref_tokens, _ = generate(model.generate, prompt)
    generate(pc.generate, prompt)
    tokens, _ = generate(pc.generate, prompt)
    assert pc.last_served == 48 and tokens == ref_tokens


# --- state-only caches in the core (no KV segment) -------------------------------------------


def test_state_only_cache_roundtrip() -> None:
    """A cache without segments: pages index the prompt (checked token by token), states hold
    the bytes; a different prompt or a prefix without a state gets nothing."""
    parts = [torch.zeros(5, 7), torch.zeros(3, dtype=torch.float64)]
    c = hicache.HostPrefixCache(
        [],
        block_tokens=4,
        capacity_pages=64,
        state_bytes=[p.nbytes for p in parts],
        capacity_states=4,
        state_lookback=2,
    )
    prompt = list(range(100, 117))  # 17 tokens: 4 pages
    states = {
        pos: [torch.full((5, 7), float(pos)), torch.arange(3, dtype=torch.float64) + pos] for pos in (12, 16)
    }
    assert c.store("a", prompt, None, state_export=lambda pos: states.get(pos)) == 4
    c.poll()
    c.forget("a")
    out = [torch.empty(5, 7), torch.empty(3, dtype=torch.float64)]
    assert c.try_resume("b", [*prompt, 1], None, state_out=out) == 16
    assert torch.equal(out[0], states[16][0]) and torch.equal(out[1], states[16][1])
    c.forget("b")
    assert c.try_resume("c", prompt[:14], None, state_out=out) == 12  # the earlier boundary
    assert torch.equal(out[0], states[12][0])
    c.forget("c")
    other = [*prompt[:5], 9, *prompt[6:]]
    assert c.try_resume("d", other, None, state_out=out) == 0  # pages checked token by token
    c.forget("d")
    st = c.stats()
    assert st.states_stored == 2 and st.errors == 0
    assert st.host_bytes < 64 * 64 + 4 * 4096  # pages hold no bytes: states are the memory


def test_state_only_cache_refusals() -> None:
    with pytest.raises(ValueError, match=r"at least one KV segment is required .*state-only"):
        hicache.HostPrefixCache([], block_tokens=4, capacity_pages=8)
    with pytest.raises(ValueError, match=r"takes capacity_pages .* not host_bytes"):
        hicache.HostPrefixCache([], block_tokens=4, host_bytes=1 << 20, state_bytes=64, capacity_states=2)
    with pytest.raises(ValueError, match="no pages for a tier"):
        hicache.HostPrefixCache(
            [], block_tokens=4, capacity_pages=8, state_bytes=64, capacity_states=2, tier=hicache.MemoryTier()
        )
    with pytest.raises(ValueError, match="state_device must be 'cpu' or 'cuda:N'"):
        hicache.HostPrefixCache(
            [], block_tokens=4, capacity_pages=8, state_bytes=64, capacity_states=2, state_device="tpu"
        )
