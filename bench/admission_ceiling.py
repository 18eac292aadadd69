"""How far can admission alone go? Leaf-first LRU with an oracle that admits exactly the pages
that will be read again, against Belady's optimum.

A pure-Python simulator on page ids (the same hit rule and leaf-first order as the C++ index);
with admission "always" it must reproduce ``hicache replay``'s leaf-first result exactly, which
this script checks before it prints the oracle's.

    python bench/admission_ceiling.py data/traces/mooncake_conversation_trace.jsonl --capacity 1M,3M
"""

from __future__ import annotations

import argparse
from collections import Counter, OrderedDict

from hicache import replay


def simulate(trace: replay.Trace, capacity: int, oracle: bool) -> int:
    """Pages served; leaf-first LRU; admission: all pages, or those used again later."""
    reqs = [trace.pages(r) for r in range(len(trace))]
    left = Counter(p for req in reqs for p in req)  # uses not yet seen
    limit = trace.hit_limit(1)
    lru: OrderedDict[tuple[int, int], None] = OrderedDict()  # least recently used first
    children: Counter[tuple[int, int]] = Counter()
    parent: dict[tuple[int, int], tuple[int, int] | None] = {}
    served = 0
    for r, req in enumerate(reqs):
        h = 0
        while h < limit[r] and req[h] in lru:
            h += 1
        served += h
        for p in req:
            left[p] -= 1
        pinned: set[tuple[int, int]] = set()
        chain: list[tuple[int, int]] = []
        prev = None
        for p in req:
            if p in lru:
                chain.append(p)
                pinned.add(p)
                prev = p
                continue
            if oracle and left[p] == 0:
                break  # never read again: not admitted
            if len(lru) >= capacity:
                victim = next((q for q in lru if children[q] == 0 and q not in pinned), None)
                if victim is None:
                    break
                del lru[victim]
                up = parent.pop(victim)
                if up is not None:
                    children[up] -= 1
            lru[p] = None
            parent[p] = prev
            if prev is not None:
                children[prev] += 1
            chain.append(p)
            pinned.add(p)
            prev = p
        for p in reversed(chain):  # leaf first: the root ends most recently used
            lru.move_to_end(p)
    return served


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--capacity", default="1M,3M")
    args = ap.parse_args()
    trace = replay.load_trace(args.trace)
    print(f"{trace.name}: {len(trace)} requests, {trace.pages_total:,} pages")
    print("| capacity (tokens) | leaf-first | oracle admission + leaf-first | optimum | oracle of optimum |")
    print("| --- | --- | --- | --- | --- |")
    for text in args.capacity.split(","):
        cap = replay.parse_capacity(text, 1)
        lf = replay.replay_policy(trace, cap, "leaf-first")
        mine = simulate(trace, cap, oracle=False) * replay.PAGE_TOKENS
        assert mine == lf.hit_tokens, f"simulator {mine} != hicache replay {lf.hit_tokens}"
        best = replay.replay_optimum(trace, cap).hit_tokens
        ceiling = simulate(trace, cap, oracle=True) * replay.PAGE_TOKENS
        print(f"| {text} | {lf.hit_tokens:,} | {ceiling:,} | {best:,} | {ceiling / best:.3f} |")


if __name__ == "__main__":
    main()
