"""The ``hicache`` command."""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import __version__, cuda_available


def _demo(args: argparse.Namespace) -> int:
    """A paged-attention engine over multi-turn conversations (or agent sessions), with and
    without hicache, and with layer-wise loads when asked."""
    import dataclasses

    import torch

    from .demo import AGENTIC_DEFAULTS, PRESETS, PagedEngine, TinyTransformer, make_conversations
    from .demo.runner import run_workload, summarize

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("hicache demo: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    defaults = AGENTIC_DEFAULTS[device.type] if args.workload == "agentic" else CONVERSATION_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    cfg = PRESETS[args.model]
    if args.window:
        cfg = dataclasses.replace(cfg, window=args.window)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(args.seed)
    model = TinyTransformer(cfg, device, dtype, seed=args.seed)
    convs = make_conversations(
        args.conversations, args.turns, cfg.vocab, args.first_tokens, args.user_tokens, seed=args.seed
    )
    longest = args.first_tokens * 3 // 2 + (args.turns - 1) * (args.user_tokens * 3 // 2 + args.new_tokens)
    blocks = (longest + args.new_tokens) // args.block_tokens + 2
    log = None if args.json else (lambda s: (sys.stderr.write(s), sys.stderr.flush()))
    common = {"num_blocks": blocks, "block_tokens": args.block_tokens, "prefill_chunk": args.prefill_chunk}
    try:
        plain = PagedEngine(model, **common)
        cached = PagedEngine(
            model, cache_pages=args.cache_pages, measure_load=device.type == "cuda", **common
        )
    except ValueError as e:
        print(f"hicache demo: {e}", file=sys.stderr)
        return 2
    run_workload(plain, convs[:1], args.new_tokens, "warm-up")  # kernels, allocator
    if args.disk:
        return _demo_disk(args, model, plain, convs, common, log, cfg, device)
    t0 = time.perf_counter()
    without = run_workload(plain, convs, args.new_tokens, "without cache", log)
    with_cache = run_workload(cached, convs, args.new_tokens, "with cache", log)
    stats = cached.cache.stats_dict() if cached.cache else {}
    copy_path = cached.cache.copy_path if cached.cache else None
    layerwise = None
    if args.layerwise:
        del cached  # its pinned pool goes before the next one is pinned
        lw_engine = PagedEngine(model, cache_pages=args.cache_pages, layerwise=True, **common)
        layerwise = run_workload(lw_engine, convs, args.new_tokens, "with cache, layer-wise", log)
        stats_lw = lw_engine.cache.stats_dict() if lw_engine.cache else {}
    elapsed = time.perf_counter() - t0
    # The ideal moves the hit bytes at the contiguous cudaMemcpyAsync rate measured on an H200.
    rate = 55.3e9 if device.type == "cuda" else None
    summary = summarize(with_cache, without, rate, layerwise)
    result = {
        "model": args.model,
        "workload": args.workload,
        "hybrid_window": cfg.window,
        "device": str(device),
        "copy_path": copy_path,
        "prefill_chunk": plain.C,
        **dataclasses.asdict(summary),
        "prefill_tokens_per_s_without_cache": round(
            sum(r.prompt_tokens for r in without) / sum(r.ttft_s for r in without)
        ),
        "cache": stats,
        "seconds": round(elapsed, 1),
    }
    if layerwise is not None:
        result["cache_layerwise"] = stats_lw
    identical = summary.tokens_identical and summary.layerwise_tokens_identical is not False
    if args.json:
        print(json.dumps(result, default=str))
    else:
        s = summary
        kind = f"hybrid, sliding window {cfg.window}" if cfg.window else "full attention"
        path = copy_path or "none"
        lw = layerwise is not None
        print(
            f"\nhicache demo: {args.model} model ({kind}) on {device}, {args.workload} workload, "
            f"{args.block_tokens}-token blocks, {plain.C}-token prefill chunks, {path} copies\n"
        )
        head = "|                     | without cache | with hicache |" + (" layer-wise |" if lw else "")
        print(head)
        print("| ------------------- | ------------- | ------------ |" + (" ---------- |" if lw else ""))

        def row(name: str, a: object, b: object, c: object = "") -> None:
            print(f"| {name:<19} | {a!s:>13} | {b!s:>12} |" + (f" {c!s:>10} |" if lw else ""))

        row("requests", s.requests, s.requests, s.requests)
        row("prompt tokens", s.prompt_tokens, s.prompt_tokens, s.prompt_tokens)
        lw_cached = sum(r.cached_tokens for r in layerwise) if layerwise else ""
        row("tokens from cache", 0, s.cached_tokens, lw_cached)
        row("TTFT p50 (ms)", s.ttft_p50_without_ms, s.ttft_p50_with_ms, s.ttft_p50_layerwise_ms)
        row("TTFT p90 (ms)", s.ttft_p90_without_ms, s.ttft_p90_with_ms, s.ttft_p90_layerwise_ms)
        same = "yes" if s.tokens_identical else f"NO ({s.mismatched_requests} requests differ)"
        print(f"\nevery generated token identical with and without the cache: {same}")
        if lw:
            print(f"... and with layer-wise loads: {'yes' if s.layerwise_tokens_identical else 'NO'}")
        print(f"prefill without the cache: {result['prefill_tokens_per_s_without_cache']} prompt tokens/s")
        if s.ideal_ratio_p50 is not None:
            ideal = "suffix prefill + hit bytes at 55.3 GB/s"
            print(f"TTFT with cache / ideal ({ideal}), median: {s.ideal_ratio_p50}")
        if s.overlap_ratio_p50 is not None:
            print(
                "TTFT layer-wise / max(hit bytes at 55.3 GB/s, suffix prefill), "
                f"p50 {s.overlap_ratio_p50}, p90 {s.overlap_ratio_p90}"
            )
        if s.resume_call_p50_layerwise_ms is not None:
            ms = s.resume_call_p50_layerwise_ms
            print(f"try_resume_layerwise's own time on the engine thread, median: {ms} ms")
        print(f"({elapsed:.1f} s)")
    return 0 if identical else 1


def _demo_disk(args, model, plain, convs, common, log, cfg, device) -> int:  # type: ignore[no-untyped-def]
    """--disk DIR: the workload round by round, the engine restarted before each round (empty host
    memory) over a DiskTier in DIR, against the same workload without a cache."""
    from .demo import PagedEngine
    from .demo.runner import run_restarted, run_workload
    from .disk_tier import DiskTier

    # The tier space names everything the KV depends on: a directory kept across runs with other
    # weights (another seed) must never serve them.
    space = f"demo/{args.model}/seed{args.seed}/window{cfg.window}/{model.dtype}/{args.prefill_chunk}"

    def restarted() -> PagedEngine:
        tier = DiskTier(args.disk, args.disk_bytes)
        return PagedEngine(model, cache_pages=args.cache_pages, tier=tier, tier_space=space, **common)

    t0 = time.perf_counter()
    without = run_workload(plain, convs, args.new_tokens, "without cache", log)
    try:
        with_disk, rounds = run_restarted(restarted, convs, args.new_tokens, "with a disk tier", log)
    except (ValueError, RuntimeError) as e:
        print(f"hicache demo: --disk {args.disk}: {e}", file=sys.stderr)
        return 2
    identical = all(a.generated == b.generated for a, b in zip(with_disk, without, strict=True))
    result = {
        "model": args.model,
        "device": str(device),
        "disk": args.disk,
        "requests": len(with_disk),
        "prompt_tokens": sum(r.prompt_tokens for r in with_disk),
        "tokens_from_cache": sum(r.cached_tokens for r in with_disk),
        "tokens_from_disk": sum(int(r["tier_hit_tokens"]) for r in rounds),
        "rounds": [
            {k: r[k] for k in ("hit_tokens", "tier_hit_tokens", "tier_pages_written", "tier_pages_rejected")}
            for r in rounds
        ],
        "tokens_identical": identical,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(
            f"\nhicache demo --disk {args.disk}: {args.model} model on {device}; the engine restarted before "
            f"each of {len(rounds)} rounds (empty host memory)\n"
        )
        print(
            "| round | requests | tokens from the cache | of them from the disk | pages written to the disk |"
        )
        print("| --- | --- | --- | --- | --- |")
        per = len(convs)
        for t, r in enumerate(rounds):
            served = sum(x.cached_tokens for x in with_disk[t * per : (t + 1) * per])
            print(f"| {t + 1} | {per} | {served} | {r['tier_hit_tokens']} | {r['tier_pages_written']} |")
        print(
            f"\n{result['tokens_from_disk']} of {result['prompt_tokens']} prompt tokens served from the "
            f"disk; every generated token identical to the run without a cache: "
            f"{'yes' if identical else 'NO'}"
        )
        print(f"({result['seconds']} s)")
    return 0 if identical else 1


CONVERSATION_DEFAULTS = {
    "conversations": 8,
    "turns": 8,
    "first_tokens": 600,
    "user_tokens": 150,
    "new_tokens": 8,
}


def _replay(args: argparse.Namespace) -> int:
    from . import replay

    # Every option is checked before the first (possibly hour-long) pass starts.
    try:
        if args.keep_tokens < 1:
            raise ValueError("--keep-tokens must be >= 1 (the last token must be computed)")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError("--jobs must be >= 1")
        if args.page_bytes < 1:
            raise ValueError(f"--page-bytes must be >= 1 (bytes of a 128-token page), not {args.page_bytes}")
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1 (the requests to replay), not {args.limit}")
        if args.instances:
            instances = [int(n) for n in args.instances.split(",")]
            if any(n < 1 for n in instances):
                raise ValueError("--instances: each count must be >= 1")
            if args.tier is None:
                raise ValueError("--instances needs --tier (the shared tier's capacity)")
            if args.route not in replay.ROUTES:
                raise ValueError(f"--route must be one of {', '.join(replay.ROUTES)}")
        elif args.tier is not None:
            raise ValueError("--tier needs --instances")
        if args.disk is not None and args.instances:
            raise ValueError("--disk replays one engine: give it without --instances")
        for w in args.tier_write.split(","):
            if w not in replay.TIER_WRITES:
                raise ValueError(f"--tier-write must be one of {', '.join(replay.TIER_WRITES)}, not {w!r}")
        if args.plot:
            replay.check_plot_support()
        capacities = [replay.parse_capacity(c, args.page_bytes) for c in args.capacity.split(",")]
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        for p in policies:
            if p not in replay.POLICIES:
                raise ValueError(f"unknown policy {p!r}: choose from {', '.join(replay.POLICIES)}")
        traces = [replay.load_trace(t, args.limit, args.block_tokens) for t in args.trace]
    except (OSError, ValueError, RuntimeError) as e:
        print(f"hicache replay: {e}", file=sys.stderr)
        return 2
    if args.instances:
        return _replay_shared(args, traces, capacities, policies)
    if args.disk is not None:
        return _replay_disk(args, traces, capacities, policies)
    by_trace: dict[str, list] = {}
    try:
        for trace in traces:
            results = by_trace.setdefault(trace.name, [])
            if not args.json:
                print(f"{trace.name}: {len(trace)} requests, {trace.pages_total:,} pages", flush=True)
                print(replay.TABLE_HEADER, flush=True)
            # Each result is printed as it finishes: an interrupted sweep keeps what it had.
            for res in replay.run(
                trace, capacities, policies, args.keep_tokens, not args.no_optimum, args.jobs
            ):
                results.append(res)
                if args.json:
                    print(json.dumps({"trace": trace.name, **res.as_dict(args.page_bytes)}), flush=True)
                else:
                    print(replay.format_row(res, args.page_bytes), flush=True)
            if not args.json:
                print("\n" + replay.format_table(trace, results, args.page_bytes) + "\n", flush=True)
    except KeyboardInterrupt:
        print("hicache replay: interrupted; the results above are complete", file=sys.stderr)
        return 130
    if args.plot:
        replay.plot(by_trace, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _replay_shared(args: argparse.Namespace, traces: list, capacities: list[int], policies: list[str]) -> int:
    from . import replay

    tier = replay.parse_capacity(args.tier, args.page_bytes)
    policy = policies[0] if policies else "adaptive"
    try:
        for trace in traces:
            if not args.json:
                print(f"{trace.name}: {len(trace)} requests; policy {policy}", flush=True)
                print(replay.SHARED_HEADER, flush=True)
            for n in (int(x) for x in args.instances.split(",")):
                for cap in capacities:
                    for write in args.tier_write.split(","):
                        res = replay.replay_shared(
                            trace, n, cap, tier, args.route, policy, args.keep_tokens, write
                        )
                        if args.json:
                            print(json.dumps({"trace": trace.name, **res.as_dict()}), flush=True)
                        else:
                            print(replay.format_shared_row(res), flush=True)
    except KeyboardInterrupt:
        print("hicache replay: interrupted; the results above are complete", file=sys.stderr)
        return 130
    return 0


def _replay_disk(args: argparse.Namespace, traces: list, capacities: list[int], policies: list[str]) -> int:
    from . import replay

    try:
        disks = [replay.parse_capacity(c, args.page_bytes) for c in args.disk.split(",")]
    except ValueError as e:
        print(f"hicache replay: --disk: {e}", file=sys.stderr)
        return 2
    policy = policies[0] if policies else "adaptive"
    try:
        for trace in traces:
            if not args.json:
                print(f"{trace.name}: {len(trace)} requests; host policy {policy}", flush=True)
                print(replay.DISK_HEADER, flush=True)
            for cap in capacities:
                for disk in disks:
                    for write in args.tier_write.split(","):
                        res = replay.replay_disk(trace, cap, disk, policy, args.keep_tokens, write)
                        if args.json:
                            print(json.dumps({"trace": trace.name, **res.as_dict()}), flush=True)
                        else:
                            print(replay.format_disk_row(res), flush=True)
    except KeyboardInterrupt:
        print("hicache replay: interrupted; the results above are complete", file=sys.stderr)
        return 130
    return 0


def _trace(args: argparse.Namespace) -> int:
    import dataclasses

    from .agentic_trace import AgenticParams, write_trace

    try:
        params = AgenticParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(AgenticParams)})
        params.check()
        n, tokens = write_trace(params, args.out)
    except (OSError, ValueError) as e:
        print(f"hicache trace: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {n} requests, {tokens:,} prompt tokens", file=sys.stderr)
    return 0


def _info(args: argparse.Namespace) -> int:
    print(json.dumps({"version": __version__, "cuda_available": cuda_available()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hicache", description="host-memory KV prefix cache")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="a paged-attention engine over multi-turn conversations, with and without the cache"
    )
    d.add_argument("--model", choices=["tiny", "small", "llama3-8b"], default="tiny")
    d.add_argument("--window", type=int, default=0, help="hybrid model: sliding-window layers of this window")
    d.add_argument(
        "--workload",
        choices=["conversation", "agentic"],
        default="conversation",
        help="conversation: chats of short turns (defaults 8 x 8 turns, 600-token first prompts, "
        "150-token messages, 8 new tokens); agentic: a few agent sessions of long contexts and short "
        "tool results (2 x 6 steps; contexts of ~32K tokens on a GPU, ~2K on the CPU; 384/128-token "
        "tool results; 16/8 new tokens). Each option below overrides its default",
    )
    d.add_argument("--conversations", type=int, default=None, help="conversations (or agent sessions)")
    d.add_argument("--turns", type=int, default=None, help="turns (or agent steps) of each")
    d.add_argument("--first-tokens", type=int, default=None, help="mean length of each first prompt")
    d.add_argument(
        "--user-tokens", type=int, default=None, help="mean length of each later user message (tool result)"
    )
    d.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request")
    d.add_argument(
        "--layerwise",
        action="store_true",
        help="also run the cached engine with layer-wise loads (try_resume_layerwise), beside the prefill",
    )
    d.add_argument("--block-tokens", type=int, default=128)
    d.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prefill chunk in tokens, a multiple of --block-tokens (default: one block); larger is "
        "faster and leaves up to a chunk of each prompt uncached (plain models only)",
    )
    d.add_argument("--cache-pages", type=int, default=4096, help="host pages of the cache")
    d.add_argument("--device", default="auto", help="auto, cpu or cuda")
    d.add_argument(
        "--disk",
        metavar="DIR",
        help="restart the engine before every round, over a DiskTier in DIR: hits come from the disk",
    )
    d.add_argument(
        "--disk-bytes", type=int, default=4 << 30, help="with --disk: the tier's capacity in bytes"
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=_demo)
    r = sub.add_parser(
        "replay",
        help="replay traces through the index: policies vs the optimum",
        description="Replays each trace's requests through hicache's index, one after another in "
        "file order (timestamps are ignored), once per capacity and policy, beside Belady's optimum "
        "over the same pages. --policy '' runs the optimum alone; --no-optimum the policies alone.",
    )
    r.add_argument("trace", nargs="+", help="trace in Mooncake's format (JSON lines)")
    r.add_argument(
        "--capacity",
        default="1M,3M,10M,30M",
        help="comma-separated: tokens (3M), bytes (64GiB, see --page-bytes) or inf",
    )
    r.add_argument(
        "--policy",
        default="adaptive,second-sighting,leaf-first,lru",
        help="comma-separated: adaptive (the default admission), second-sighting, leaf-first "
        "(write-through), lru (write-through, plain LRU eviction)",
    )
    r.add_argument("--keep-tokens", type=int, default=1, help="tokens always left to compute (>= 1)")
    r.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        help="tokens per hash id in the trace (Mooncake: 512; 16, 32, 64, 128, 256 ... too)",
    )
    r.add_argument(
        "--page-bytes",
        type=int,
        default=16 << 20,
        help="bytes of one 128-token page, for byte capacities and bytes stored (default: Llama-3-8B bf16)",
    )
    r.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    r.add_argument("--jobs", type=int, default=None, help="passes run at once (default: every core)")
    r.add_argument(
        "--instances",
        help="comma-separated engine counts: replay N instances with private host pools (--capacity "
        "each) over one shared tier (--tier), beside N private pools and one big cache",
    )
    r.add_argument("--tier", help="the shared tier's capacity (tokens, bytes or inf), with --instances")
    r.add_argument(
        "--route",
        default="affinity",
        help="with --instances: affinity (a conversation stays on one instance) or round-robin",
    )
    r.add_argument(
        "--disk",
        help="comma-separated disk capacities (tokens or bytes): replay one engine's host pool "
        "(--capacity) over a DiskTier, with DiskTier's eviction (oldest segment first, pages read "
        "from the older half moved up), beside the host pool alone",
    )
    r.add_argument(
        "--tier-write",
        default="through",
        help="with --instances or --disk: when pages reach the tier, 'through' (each page a host "
        "stores, as hicache does) or 'back' (when a host evicts it); comma-separated to compare",
    )
    r.add_argument("--no-optimum", action="store_true", help="skip Belady's offline optimum")
    r.add_argument("--plot", metavar="PNG", help="write hit ratio vs capacity (needs matplotlib)")
    r.add_argument("--json", action="store_true", help="one JSON object a line, as each pass finishes")
    r.set_defaults(func=_replay)
    from .agentic_trace import AgenticParams

    trace_defaults = AgenticParams()  # one place for the defaults: the dataclass
    t = sub.add_parser("trace", help="write a synthetic agentic trace in Mooncake's format")
    t.add_argument("out", help="the JSON-lines file to write")
    for name, text in (
        ("sessions", "agent sessions"),
        ("steps", "mean steps (requests) per session"),
        ("system_tokens", "each system prompt's length"),
        ("system_prompts", "distinct system prompts (agents)"),
        ("task_tokens", "mean length of a session's task"),
        ("tool_tokens", "mean tool output per step"),
        ("output_tokens", "mean model output per step"),
        ("max_context", "a session ends at this length"),
        ("branch", "chance a step retries from an earlier one"),
        ("abandon", "chance a session ends after a step"),
        ("concurrency", "sessions interleaved at once"),
        ("block_tokens", "tokens per hash id"),
        ("seed", "random seed"),
    ):
        default = getattr(trace_defaults, name)
        t.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, help=text)
    t.set_defaults(func=_trace)
    i = sub.add_parser("info", help="version and CUDA availability")
    i.set_defaults(func=_info)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
