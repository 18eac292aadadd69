"""Model code from outside the project: a Hugging Face Llama (small config, random weights).

Its KV after turn 1 goes through hicache as pages, comes back into fresh tensors, becomes the
model's cache object again, and turn 2 is generated from it. The tokens must equal those from the
original cache and from a full recompute.
"""

from __future__ import annotations

import pytest

import hicache

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_hybrid import CACHE  # noqa: E402  (the model's cache keyword in this transformers)

B = 16


def greedy(model, ids: torch.Tensor, past, steps: int) -> list[int]:
    """Greedy decoding from `ids` (the tokens past does not hold yet)."""
    out = []
    for _ in range(steps):
        res = model(input_ids=ids[None], use_cache=True, **{CACHE: past})
        past = getattr(res, CACHE)
        nxt = int(res.logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.tensor([nxt])
    return out


def test_llama_kv_round_trips_through_hicache_and_generates_the_same_tokens() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    turn1 = torch.randint(0, 256, (5 * B + 7,))
    turn2 = torch.cat([turn1, torch.randint(0, 256, (40,))])
    # Paged pool of the "engine": per layer K and V, [blocks, B, kv_heads, head_dim].
    num_blocks = 32
    pool_k = [torch.zeros(num_blocks, B, kv_heads, head_dim) for _ in range(cfg.num_hidden_layers)]
    pool_v = [torch.zeros_like(t) for t in pool_k]
    cache = hicache.HostPrefixCache(
        [t for pair in zip(pool_k, pool_v, strict=True) for t in pair], block_tokens=B, capacity_pages=16
    )
    with torch.no_grad():
        first = model(input_ids=turn1[None], use_cache=True)
        original = getattr(first, CACHE)
        # Store turn 1's full blocks: the model's [1, kv_heads, T, head_dim] KV into pages.
        n1 = len(turn1) // B
        for layer in range(cfg.num_hidden_layers):
            k, v = original.layers[layer].keys[0], original.layers[layer].values[0]
            pool_k[layer][:n1] = k[:, : n1 * B].transpose(0, 1).reshape(n1, B, kv_heads, head_dim)
            pool_v[layer][:n1] = v[:, : n1 * B].transpose(0, 1).reshape(n1, B, kv_heads, head_dim)
        assert cache.store("turn1", turn1, list(range(n1))) == n1
        for t in pool_k + pool_v:
            t.zero_()  # the GPU blocks are reused: only the host copy survives
        # Turn 2: resume into other blocks, rebuild the model's cache from them.
        target = list(range(16, 16 + n1))
        got = cache.try_resume("turn2", turn2, lambda n: target[: n // B])
        assert got == n1 * B
        rebuilt = transformers.DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            k = pool_k[layer][target].reshape(got, kv_heads, head_dim).transpose(0, 1)[None]
            v = pool_v[layer][target].reshape(got, kv_heads, head_dim).transpose(0, 1)[None]
            rebuilt.update(k.contiguous(), v.contiguous(), layer)
        from_hicache = greedy(model, turn2[got:], rebuilt, 12)
        original.crop(got - len(turn1))  # drop the tokens past the cached prefix
        from_original = greedy(model, turn2[got:], original, 12)
        recompute = greedy(model, turn2, None, 12)
    assert from_hicache == from_original == recompute
    # The rebuilt cache holds exactly the bytes the model produced.
    assert cache.stats().pages_loaded == n1
