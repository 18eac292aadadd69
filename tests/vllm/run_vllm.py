"""One vLLM run for test_vllm_offloading.py (vLLM keeps global state: one run a process).

    python run_vllm.py MODEL_DIR plain|hicache|hicache-shared|hicache-shared-contested [TP]
        ->  one JSON line: outputs, what crossed hicache

Several prompts share long prefixes, in three rounds; vLLM's own prefix caching is off, so a
round can only reuse an earlier one through the host tier. HICACHE_TEST_CORRUPT=1 makes the
recording worker scramble every block it loads (the negative control). The shared modes name
the engine HICACHE_TEST_ENGINE_ID; "contested" starts, after the first round, a second engine
with the same id (another run of this script) while this one still serves, and records how it
ended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROUNDS = 3
PREFIX_TOKENS = 700  # 5 full 128-token blocks, then a partial one
SUFFIX_TOKENS = (50, 80, 110)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, mode = sys.argv[1], sys.argv[2]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    kw: dict = dict(
        model=model,
        dtype="float32",  # bf16 on vLLM's CPU backend breaks exact ties differently run to run
        enable_prefix_caching=False,
        block_size=128,
        max_model_len=2048,
        max_num_seqs=4,
        enforce_eager=True,
        tensor_parallel_size=tp,
    )
    if mode.startswith("hicache-shared"):  # hicache's own spec, each worker's slots in /dev/shm
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "engine_id": os.environ["HICACHE_TEST_ENGINE_ID"],
            "kv_connector_extra_config": {
                "spec_name": "CountingSpec",
                "spec_module_path": "recording_spec",
                "host_bytes": 64 << 20,
                "shared_memory": True,
            },
        }
    if mode == "hicache":
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "RecordingSpec",
                "spec_module_path": "recording_spec",
                "host_bytes": 64 << 20,
            },
        }
    t0 = time.time()
    llm = LLM(**kw)
    rng = np.random.default_rng(0)
    prefixes = [[int(x) for x in rng.integers(3, 500, PREFIX_TOKENS)] for _ in SUFFIX_TOKENS]
    outputs, prompt_tokens = [], 0
    rival = None
    for round_ in range(ROUNDS):
        if round_ == 1 and mode == "hicache-shared-contested":
            # Another engine, the same engine_id, on this host, while this one serves.
            out = subprocess.run(
                [sys.executable, __file__, model, "hicache-shared", str(tp)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            lines = [x for x in out.stderr.splitlines() if "in use by process" in x]
            rival = {"returncode": out.returncode, "refusal": lines[-1][-600:] if lines else None}
        prompts = [
            TokensPrompt(prompt_token_ids=p + [int(x) for x in rng.integers(3, 500, n)])
            for p, n in zip(prefixes, SUFFIX_TOKENS, strict=True)
        ]
        prompt_tokens += sum(len(p["prompt_token_ids"]) for p in prompts)
        for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False):
            outputs.append(list(o.outputs[0].token_ids))
    result = {"mode": mode, "outputs": outputs, "prompt_tokens": prompt_tokens, "seconds": time.time() - t0}
    if rival is not None:
        result["rival"] = rival
    if mode.startswith("hicache"):
        import recording_spec

        result["log"] = recording_spec.LOG
        manager = recording_spec.MANAGERS[0]
        result["catalog"] = manager.stats()
        manager.get_stats()  # what is left since vLLM's last call
        result["vllm_stats"] = recording_spec.REPORTED  # every get_stats() vLLM and we made
    print(json.dumps(result))


if __name__ == "__main__":
    main()
