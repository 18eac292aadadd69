"""A decoder-only transformer written for clarity: RMSNorm, RoPE, grouped-query attention,
SwiGLU. Some layers may use sliding-window attention (hybrid models). Weights are random.

The model never owns KV: the engine hands each layer the keys and values to attend to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 256
    window: int = 0  # sliding-window size of the hybrid layers (0: every layer is full attention)
    sliding_every: int = 2  # with window > 0: layers 1, 3, ... (l % sliding_every == 1) slide

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_sliding(self, layer: int) -> bool:
        return self.window > 0 and layer % self.sliding_every == 1


PRESETS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(vocab=4096, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1536),
    # Llama-3-8B's shapes (random weights): 32 layers, 32 query heads, 8 KV heads, 128-dim heads.
    "llama3-8b": ModelConfig(vocab=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336),
}


def _causal_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the last T of S positions over all S, causal, on a GPU: q [T, heads, dim],
    k and v [S, kv_heads, dim] -> [T, heads, dim]. Flash attention aligns the causal mask to the
    bottom right (query i sits at position S - T + i) without materializing it, and takes grouped
    K/V as they are. The same shapes always run the same kernel, so a chunk computes the same
    bits whether the keys before it were loaded or computed."""
    from torch.nn.attention.bias import causal_lower_right

    T, S = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=causal_lower_right(T, S), enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, dim] at absolute positions [T]."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyTransformer:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        # Drawn on the target device (an 8B model drawn on the CPU would take minutes): the same
        # seed gives the same model on one kind of device.
        g = torch.Generator(device=device).manual_seed(seed)

        def w(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        d, kv, hd = cfg.d_model, cfg.n_kv_heads, cfg.head_dim
        self.embed = w(cfg.vocab, d, scale=1.0)
        self.layers = []
        for _ in range(cfg.n_layers):
            self.layers.append(
                {
                    "wq": w(d, cfg.n_heads * hd, scale=d**-0.5),
                    "wk": w(d, kv * hd, scale=d**-0.5),
                    "wv": w(d, kv * hd, scale=d**-0.5),
                    "wo": w(cfg.n_heads * hd, d, scale=(cfg.n_heads * hd) ** -0.5),
                    "w1": w(d, cfg.d_ff, scale=d**-0.5),
                    "w3": w(d, cfg.d_ff, scale=d**-0.5),
                    "w2": w(cfg.d_ff, d, scale=cfg.d_ff**-0.5),
                }
            )
        self.head = w(d, cfg.vocab, scale=d**-0.5)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens]

    def qkv(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys, values of hidden states h [T, d] at absolute positions."""
        L, cfg = self.layers[layer], self.cfg
        x = self._norm(h)
        q = (x @ L["wq"]).view(-1, cfg.n_heads, cfg.head_dim)
        k = (x @ L["wk"]).view(-1, cfg.n_kv_heads, cfg.head_dim)
        v = (x @ L["wv"]).view(-1, cfg.n_kv_heads, cfg.head_dim)
        return _rope(q, positions), _rope(k, positions), v

    def attend_and_mlp(
        self,
        layer: int,
        h: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
    ) -> torch.Tensor:
        """h + attention(q over k, v at their positions) + MLP. Causal, and windowed when sliding.

        A full-attention layer on a GPU whose keys are positions 0.. up to the queries' last
        takes flash attention (_causal_flash); otherwise an explicit mask (the CPU, windows)."""
        L, cfg = self.layers[layer], self.cfg
        if self.device.type == "cuda" and not cfg.is_sliding(layer):
            out = _causal_flash(q, k, v)
        else:
            allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)
            if cfg.is_sliding(layer):
                allowed &= k_pos[None, :] > q_pos[:, None] - cfg.window
            # [heads, T, hd] layouts; grouped-query attention without materializing repeated K/V.
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, enable_gqa=True
            ).transpose(0, 1)
        h = h + out.reshape(h.shape[0], -1) @ L["wo"]
        x = self._norm(h)
        return h + (torch.nn.functional.silu(x @ L["w1"]) * (x @ L["w3"])) @ L["w2"]

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        return self._norm(h_last) @ self.head
