"""The ``hicache`` command."""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib

import numpy as np

from . import __version__, cuda_available
from .cache import HostPrefixCache


def _demo(args: argparse.Namespace) -> int:
    """Store/resume round trips over multi-turn conversations on CPU segments.

    PLACEHOLDER: this exercises the real cache (hash chain, index, copier) with a stand-in for the
    model (KV bytes derived from the prefix). The paged-attention engine demo replaces it.
    """
    rng = np.random.default_rng(args.seed)
    B, layers = args.block_tokens, 4
    num_blocks = 2048
    # Layer-major pool: one K and one V tensor per layer, [num_blocks, B, heads*dim] float16.
    segments = [np.zeros((num_blocks, B, 64), dtype=np.float16) for _ in range(2 * layers)]
    cache = HostPrefixCache(segments, block_tokens=B, capacity_pages=args.capacity_pages)

    def prefill(tokens: np.ndarray, blocks: list[int], start: int) -> None:
        # Stand-in for the model: every block's KV is a function of its whole prefix.
        for i in range(start // B, len(tokens) // B):
            seed = zlib.crc32(tokens[: (i + 1) * B].tobytes())
            vals = np.random.default_rng(seed).standard_normal((len(segments), B, 64))
            for s, seg in enumerate(segments):
                seg[blocks[i]] = vals[s].astype(np.float16)

    free = list(range(num_blocks))
    served = total = mismatched = 0
    t0 = time.perf_counter()
    for conv in range(args.conversations):
        prompt = rng.integers(0, 32000, size=int(rng.integers(B, 4 * B)), dtype=np.int32)
        for turn in range(args.turns):
            rid = f"c{conv}t{turn}"
            n_blocks = (len(prompt) + B - 1) // B
            blocks = [free.pop() for _ in range(n_blocks)]
            got = cache.try_resume(rid, prompt, lambda n, b=blocks: b[: n // B])
            got = max(got, 0)
            expect = {i: [s[blocks[i]].copy() for s in segments] for i in range(got // B)}
            prefill(prompt, blocks, got)
            for i, saved in expect.items():  # what the cache loaded must equal a recompute
                mismatched += any(
                    not np.array_equal(a, s[blocks[i]]) for a, s in zip(saved, segments, strict=True)
                )
            cache.store(rid, prompt, blocks)
            cache.poll()
            cache.forget(rid)
            free.extend(blocks)
            served += got
            total += len(prompt)
            answer = rng.integers(0, 32000, size=int(rng.integers(16, B)), dtype=np.int32)
            user = rng.integers(0, 32000, size=int(rng.integers(16, 2 * B)), dtype=np.int32)
            prompt = np.concatenate([prompt, answer, user])
    elapsed = time.perf_counter() - t0
    s = cache.stats()
    result = {
        "placeholder": True,
        "requests": s.lookups,
        "prompt_tokens": total,
        "tokens_from_cache": served,
        "token_hit_rate": round(served / total, 4) if total else 0.0,
        "pages_stored": s.pages_stored,
        "pages_loaded": s.pages_loaded,
        "pages_evicted": s.pages_evicted,
        "mismatched_pages": mismatched,
        "seconds": round(elapsed, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print("hicache demo (PLACEHOLDER: cache round trips with a stand-in model; the engine demo")
        print("replaces it)\n")
        for k, v in result.items():
            print(f"  {k:<18} {v}")
        print("\n  every loaded page identical to a recompute:", "yes" if mismatched == 0 else "NO")
    return 0 if mismatched == 0 else 1


def _replay(args: argparse.Namespace) -> int:
    from . import replay

    try:
        capacities = [replay.parse_capacity(c, args.page_bytes) for c in args.capacity.split(",")]
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        for p in policies:
            if p not in ("leaf-first", "lru"):
                raise ValueError(f"unknown policy {p!r}: choose from leaf-first, lru")
        traces = [replay.load_trace(t, args.limit) for t in args.trace]
    except (OSError, ValueError) as e:
        print(f"hicache replay: {e}", file=sys.stderr)
        return 2
    log = None if args.quiet else replay.log_stderr
    by_trace = {}
    for trace in traces:
        results = replay.run(trace, capacities, policies, args.keep_tokens, not args.no_optimum, log)
        by_trace[trace.name] = results
        if not args.json:
            print(replay.format_table(trace, results) + "\n")
    if args.json:
        print(json.dumps({name: [r.as_dict() for r in rs] for name, rs in by_trace.items()}))
    if args.plot:
        replay.plot(by_trace, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _info(args: argparse.Namespace) -> int:
    print(json.dumps({"version": __version__, "cuda_available": cuda_available()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hicache", description="host-memory KV prefix cache")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the demo workload with the cache")
    d.add_argument("--conversations", type=int, default=8)
    d.add_argument("--turns", type=int, default=6)
    d.add_argument("--block-tokens", type=int, default=128)
    d.add_argument("--capacity-pages", type=int, default=4096)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=_demo)
    r = sub.add_parser("replay", help="replay Mooncake traces through the index; policies vs the optimum")
    r.add_argument("trace", nargs="+", help="Mooncake FAST'25 trace (JSON lines)")
    r.add_argument(
        "--capacity",
        default="1M,3M,10M,30M",
        help="comma-separated: tokens (3M), bytes (64GiB, see --page-bytes) or inf",
    )
    r.add_argument("--policy", default="leaf-first,lru", help="comma-separated: leaf-first, lru")
    r.add_argument("--keep-tokens", type=int, default=1, help="tokens always left to compute (>= 1)")
    r.add_argument(
        "--page-bytes",
        type=int,
        default=16 << 20,
        help="bytes of one 128-token page, for byte capacities (default: Llama-3-8B bf16)",
    )
    r.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    r.add_argument("--no-optimum", action="store_true", help="skip Belady's offline optimum")
    r.add_argument("--plot", metavar="PNG", help="write hit ratio vs capacity, per policy")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--quiet", action="store_true", help="no progress on stderr")
    r.set_defaults(func=_replay)
    i = sub.add_parser("info", help="version and CUDA availability")
    i.set_defaults(func=_info)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
