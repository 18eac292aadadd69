"""vLLM 0.32 (CPU build) serves from hicache through its OffloadingConnector.

A tiny random-weight Llama made here (nothing from a hub), float32, 128-token blocks, vLLM's own
prefix caching off: three prompts sharing 700-token prefixes, in three rounds. Outputs must equal
vLLM without hicache; rounds 2 and 3 must load their prefixes' blocks from hicache; every loaded
block must equal, byte for byte, what was stored under its key; and scrambling what hicache
returns (the negative control) must change outputs and fail the byte check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(out)
    return out


def run(model_dir: Path, mode: str, corrupt: bool = False, tp: int = 1, engine_id: str = "") -> dict:
    env = {
        **os.environ,
        "HICACHE_TEST_ENGINE_ID": engine_id,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the scheduler in this process: its counters readable
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)),
        "HICACHE_TEST_CORRUPT": "1" if corrupt else "0",
    }
    # vLLM names its ZMQ sockets ipc://<VLLM_RPC_BASE_PATH>/<uuid>, the system's temporary
    # directory by default, and leaves them there: each run gets a directory that goes with it.
    with tempfile.TemporaryDirectory(prefix="hicache-vllm-rpc-") as rpc:
        out = subprocess.run(
            [sys.executable, str(HERE / "run_vllm.py"), str(model_dir), mode, str(tp)],
            capture_output=True,
            text=True,
            env={**env, "VLLM_RPC_BASE_PATH": rpc},
            timeout=900,
        )
    assert out.returncode == 0, out.stderr[-4000:]
    # worker processes (TP > 1) may print too: the result is the line run_vllm.py writes
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith('{"mode"'))
    return json.loads(line)


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> dict:
    return run(model_dir, "plain")


def test_outputs_are_identical_and_every_loaded_block_is_byte_exact(model_dir: Path, plain: dict) -> None:
    h = run(model_dir, "hicache")
    assert h["outputs"] == plain["outputs"]
    log, cat = h["log"], h["catalog"]
    # Rounds 2 and 3 load each prefix's 5 full blocks: 3 prompts x 5 blocks x 2 rounds.
    assert log["loaded_blocks"] == 30, log
    assert log["checked_blocks"] == log["loaded_blocks"] and log["byte_mismatches"] == 0, log
    assert log["stored_blocks"] >= 15 and cat["blocks_stored"] == log["stored_blocks"], (log, cat)
    assert cat["blocks_loaded"] == 30 and cat["lookup_hits"] >= 30, cat
    # The same counters as vLLM collects them (get_stats() each step; summed here).
    assert h["vllm_stats"]["vllm:hicache_blocks_loaded"] == 30, h["vllm_stats"]
    assert h["vllm_stats"]["vllm:hicache_capacity"] == cat["capacity"], h["vllm_stats"]
    print(f"\n{h['prompt_tokens']} prompt tokens, {30 * 128} from hicache; catalog {cat}")


def test_the_negative_control_scrambling_loads_changes_outputs(model_dir: Path, plain: dict) -> None:
    bad = run(model_dir, "hicache", corrupt=True)
    differ = sum(a != b for a, b in zip(bad["outputs"], plain["outputs"], strict=True))
    assert differ >= 1, "scrambled KV blocks left every output unchanged: the comparison has no teeth"
    assert bad["log"]["byte_mismatches"] == bad["log"]["checked_blocks"] == 30
    print(f"\nscrambled loads: {differ} of {len(plain['outputs'])} outputs changed")


@pytest.mark.usefixtures("shared_region_lock")  # its engines create regions (tests/conftest.py)
def test_two_tensor_parallel_workers_with_shared_memory_slots(model_dir: Path, plain: dict) -> None:
    # hicache's spec as shipped, with shared_memory: vLLM's two CPU workers (TP=2) each copy their
    # half of every block between their KV shard and their slots in /dev/shm, while the one
    # scheduler-side catalog names the slots for both.
    # A second engine given the same engine_id on this host, started while the first serves, is
    # refused at start-up with the reason, and the first serves on, outputs unchanged (the two
    # used to map the same regions, and the first then served another engine's KV).
    engine_id = f"vtest-{uuid.uuid4().hex[:12]}"  # regions of concurrent runs never collide
    plain2 = run(model_dir, "plain", tp=2)
    h = run(model_dir, "hicache-shared-contested", tp=2, engine_id=engine_id)
    assert plain2["outputs"] == plain["outputs"]  # TP=2 changes nothing without hicache either
    assert h["outputs"] == plain2["outputs"]
    cat = h["catalog"]
    assert cat["blocks_loaded"] == 30 and cat["blocks_stored"] >= 15, cat
    rival = h["rival"]
    assert rival["returncode"] != 0 and rival["refusal"], rival
    assert f"shared memory 'hicache-{engine_id}-" in rival["refusal"], rival
    print(f"\nthe second engine with engine_id {engine_id}: {rival['refusal'][-300:]}")
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"hicache-{engine_id}")]
    assert not left, f"regions left behind: {left}"
