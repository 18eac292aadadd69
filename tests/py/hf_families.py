"""Tiny random-weight transformers models, one per cache family (nothing downloaded).

Each builder returns a config small enough for a CPU test (4 layers, hidden 64, vocab 256) that
keeps the family's layer mix: which layers are full attention, sliding window, Mamba-1/Mamba-2,
short convolution, gated delta net or other linear attention. A wider initialization than the
default 0.02 makes the tiny models' few generated tokens depend on their state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers

COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    max_position_embeddings=2048,
)
SWA = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _cfg(cls: Any, **kw: Any) -> Any:
    return cls(**{**COMMON, **kw})


def llama() -> Any:
    return _cfg(transformers.LlamaConfig, num_hidden_layers=2)


def mistral_all_sliding() -> Any:  # every layer a sliding window: no full-attention layer at all
    # A window of 64: what the state holds still reaches the tokens generated 48 tokens later.
    return _cfg(transformers.MistralConfig, num_hidden_layers=2, sliding_window=64)


def gemma2() -> Any:
    return _cfg(
        transformers.Gemma2Config, num_hidden_layers=4, head_dim=16, sliding_window=24, layer_types=SWA
    )


def gemma3() -> Any:
    return _cfg(
        transformers.Gemma3TextConfig,
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=24,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )


def cohere2() -> Any:
    return _cfg(transformers.Cohere2Config, num_hidden_layers=4, sliding_window=24, layer_types=SWA)


def qwen2_sliding() -> Any:
    return _cfg(
        transformers.Qwen2Config,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=64,  # the top layers' windows: their state still reaches the answer
        max_window_layers=2,
        layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2,
    )


def gpt_oss() -> Any:
    return _cfg(
        transformers.GptOssConfig,
        num_hidden_layers=4,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=24,
        layer_types=SWA,
    )


def falcon_h1() -> Any:
    return _cfg(
        transformers.FalconH1Config,
        num_hidden_layers=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=16,
    )


def granitemoehybrid() -> Any:
    return _cfg(
        transformers.GraniteMoeHybridConfig,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=16,
    )


def zamba2() -> Any:
    return _cfg(
        transformers.Zamba2Config,
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=16,
        mamba_headdim=16,
        n_mamba_heads=8,
        mamba_ngroups=1,
        chunk_size=16,
        attention_head_dim=16,
        num_mem_blocks=1,
    )


def nemotron_h() -> Any:
    return _cfg(
        transformers.NemotronHConfig,
        num_hidden_layers=4,
        layers_block_type=["mamba", "attention", "mlp", "mamba"],
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=32,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=16,
    )


def lfm2() -> Any:
    return _cfg(
        transformers.Lfm2Config,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3,
    )


def qwen3_5() -> Any:
    return _cfg(
        transformers.Qwen3_5TextConfig,
        num_hidden_layers=4,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )


def qwen3_next() -> Any:
    return _cfg(
        transformers.Qwen3NextConfig,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
    )


def bamba() -> Any:
    return _cfg(
        transformers.BambaConfig,
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_chunk_size=16,
        mamba_d_conv=4,
        mamba_expand=2,
    )


def jamba() -> Any:
    return _cfg(
        transformers.JambaConfig,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        num_experts=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
    )


def mamba() -> Any:  # state only: no attention layer
    return transformers.MambaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=8,
        conv_kernel=4,
        expand=2,
        initializer_range=0.1,
    )


def mamba2() -> Any:  # state only: no attention layer
    return transformers.Mamba2Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=16,
        n_groups=1,
        state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=16,
        initializer_range=0.1,
    )


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": llama,
    "mistral_all_sliding": mistral_all_sliding,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "cohere2": cohere2,
    "qwen2_sliding": qwen2_sliding,
    "gpt_oss": gpt_oss,
    "falcon_h1": falcon_h1,
    "granitemoehybrid": granitemoehybrid,
    "zamba2": zamba2,
    "nemotron_h": nemotron_h,
    "lfm2": lfm2,
    "qwen3_5": qwen3_5,
    "qwen3_next": qwen3_next,
    "bamba": bamba,
    "jamba": jamba,
    "mamba": mamba,
    "mamba2": mamba2,
}


def make_model(family: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    cfg = FAMILIES[family]()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).eval()


def main() -> None:
    """One line a family: a 3-turn conversation through hicache.transformers.PrefixCache.generate
    against plain generate (``python tests/py/hf_families.py --device cuda --dtype bfloat16``)."""
    import argparse
    import json

    from hicache.transformers import PrefixCache, UnsupportedModelError

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    for name in FAMILIES:
        row: dict[str, Any] = {"family": name, "transformers": transformers.__version__, "dtype": args.dtype}
        try:
            model = make_model(name, args.device, getattr(torch, args.dtype))
            pc = PrefixCache(model, capacity_pages=64, block_tokens=16)
        except (AttributeError, UnsupportedModelError) as e:
            print(json.dumps({**row, "unsupported": str(e)[:200]}))
            continue
        g = torch.Generator().manual_seed(1)
        history: list[int] = []
        row.update(served=[], identical=[], max_logit_diff=[])
        for n in (87, 35, 44):
            prompt = history + torch.randint(0, 256, (n,), generator=g).tolist()
            outs = []
            for fn in (model.generate, pc.generate):
                ids = torch.tensor([prompt], device=args.device)
                outs.append(
                    fn(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=6,
                        do_sample=False,
                        output_logits=True,
                        return_dict_in_generate=True,
                        pad_token_id=0,
                    )
                )
            ref, got = outs
            new = got.sequences[0, len(prompt) :].tolist()
            row["served"].append(pc.last_served)
            row["identical"].append(new == ref.sequences[0, len(prompt) :].tolist())
            diff = (torch.stack(got.logits) - torch.stack(ref.logits)).float().abs().max()
            row["max_logit_diff"].append(round(float(diff), 6))
            history = prompt + new
        print(json.dumps(row))


if __name__ == "__main__":
    main()
