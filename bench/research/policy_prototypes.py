"""Admission and eviction policies tried before choosing hicache's default, in pure Python.

Each simulates leaf-first chains of 128-token pages with the replay's hit rule (keep_tokens = 1):
a page is never evicted while it has a cached child or belongs to the request being stored.
``always+lru`` reproduces ``hicache replay``'s leaf-first result exactly (checked first).

    python bench/research/policy_prototypes.py data/traces/mooncake_conversation_trace.jsonl --capacity 1M

Admission: ``always``; ``ghost<k>`` (while full, only pages whose key was in the last k pools'
worth of prompt keys; free slots take anything); ``freq<w>`` (TinyLFU-like: while full, a page
only if its count, over a window of w pools' worth of sightings halved at each window, beats
the victim's); ``cont<x>`` (second sightings, and every page of a prompt whose pages were at
least x seen before: the next turn of a conversation, whose chance of another turn grows with
its turns on the conversation trace, 0.35 after the first to 0.8 after the ninth); ``oracle``
(exactly the pages that will be read again). Eviction: ``lru``
(leaf-first LRU), ``slru<p>`` (a protected segment of p of the pool for pages hit before),
``classes`` (the leaf with the fewest hits goes first, LRU among equals).
"""

from __future__ import annotations

import argparse
from collections import Counter, OrderedDict
from collections.abc import Callable

from hicache import replay

Page = tuple[int, int]


class Pool:
    """Leaf-first chains in eviction queues, scanned in order for the first evictable page:
    lru: one queue; slru<p>: probation, then a protected queue of at most p of the pool for pages
    hit before; classes: one queue per hit count (0, 1, 2+), fewest hits first."""

    def __init__(self, capacity: int, eviction: str) -> None:
        self.capacity = capacity
        self.eviction = eviction
        n = {"lru": 1, "classes": 3}.get(eviction, 2)
        self.queues: list[OrderedDict[Page, None]] = [OrderedDict() for _ in range(n)]
        self.where: dict[Page, int] = {}
        self.children: Counter[Page] = Counter()
        self.parent: dict[Page, Page | None] = {}
        self.pinned: set[Page] = set()

    def __contains__(self, p: Page) -> bool:
        return p in self.parent

    def full(self) -> bool:
        return len(self.parent) >= self.capacity

    def victim(self) -> Page | None:
        for q in self.queues:
            for p in q:
                if self.children[p] == 0 and p not in self.pinned:
                    return p
        return None

    def evict(self, p: Page) -> None:
        del self.queues[self.where.pop(p)][p]
        up = self.parent.pop(p)
        if up is not None:
            self.children[up] -= 1

    def insert(self, p: Page, parent: Page | None) -> None:
        self.queues[0][p] = None
        self.where[p] = 0
        self.parent[p] = parent
        if parent is not None:
            self.children[parent] += 1

    def _move(self, p: Page, q: int) -> None:
        del self.queues[self.where[p]][p]
        self.queues[q][p] = None
        self.where[p] = q

    def touch(self, chain: list[Page], hit: int) -> None:
        for i in range(len(chain) - 1, -1, -1):  # leaf first: the root ends most recent
            p = chain[i]
            q = self.where[p]
            if self.eviction == "classes" and i < hit:
                q = min(q + 1, 2)
            elif self.eviction.startswith("slru") and i < hit:
                q = 1
            self._move(p, q)
            if self.eviction.startswith("slru"):
                while len(self.queues[1]) > float(self.eviction[4:]) * self.capacity:
                    old = next(iter(self.queues[1]))
                    self._move(old, 0)  # demoted to probation, most recent there


def simulate(trace: replay.Trace, capacity: int, admission: str, eviction: str) -> int:
    reqs = [trace.pages(r) for r in range(len(trace))]
    limit = trace.hit_limit(1)
    pool = Pool(capacity, eviction)
    ghost: OrderedDict[Page, None] = OrderedDict()
    counts: Counter[Page] = Counter()
    sightings = 0
    left = Counter(p for req in reqs for p in req) if admission == "oracle" else Counter()
    served = 0
    for r, req in enumerate(reqs):
        h = 0
        while h < limit[r] and req[h] in pool:
            h += 1
        served += h
        seen_before: set[Page] = set()
        continuing = False
        if admission.startswith(("ghost", "cont")):
            for q in req:
                if q in ghost:
                    seen_before.add(q)
                    ghost.move_to_end(q)
                ghost[q] = None
            pools = int(admission[5:]) if admission.startswith("ghost") else 4
            while len(ghost) > pools * capacity:
                ghost.popitem(last=False)
            # cont<x>: second sightings, and every page of a prompt whose pages were mostly seen
            # before (at least x of them: the next turn of a conversation, which continues
            # more often the longer it has gone on).
            if admission.startswith("cont"):
                continuing = len(seen_before) >= float(admission[4:]) * len(req)
        elif admission.startswith("freq"):
            for q in req:
                counts[q] += 1
            sightings += len(req)
            if sightings >= int(admission[4:]) * capacity:
                sightings //= 2
                counts = Counter({k: v // 2 for k, v in counts.items() if v > 1})
        elif admission == "oracle":
            for q in req:
                left[q] -= 1
        pool.pinned = set()
        chain: list[Page] = []
        prev: Page | None = None
        for p in req:
            if p in pool:
                chain.append(p)
                pool.pinned.add(p)
                prev = p
                continue
            if admission == "oracle" and left[p] == 0:
                break  # never read again
            if pool.full():
                if admission.startswith("ghost") and p not in seen_before:
                    break
                if admission.startswith("cont") and p not in seen_before and not continuing:
                    break
                victim = pool.victim()
                if victim is None:
                    break
                if admission.startswith("freq") and counts[p] <= counts[victim]:
                    break
                pool.evict(victim)
            pool.insert(p, prev)
            chain.append(p)
            pool.pinned.add(p)
            prev = p
        pool.touch(chain, h)
    return served * replay.PAGE_TOKENS


def sweep(
    description: str,
    default_policies: str,
    run: Callable[[replay.Trace, int, str, str], int],
    check: Callable[[replay.Trace, int, str, int], None] | None = None,
) -> None:
    """The command line both prototype scripts share: a trace, capacities and admission+eviction
    policies; prints each policy's hit tokens and share of the optimum as it finishes.
    run(trace, capacity, admission, eviction) returns hit tokens; check(trace, capacity, policy,
    hit tokens) may assert on them."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("trace")
    ap.add_argument("--capacity", default="1M")
    ap.add_argument("--policies", default=default_policies)
    args = ap.parse_args()
    trace = replay.load_trace(args.trace)
    print("| capacity | policy (admission+eviction) | hit tokens | of optimum |")
    print("| --- | --- | --- | --- |")
    for text in args.capacity.split(","):
        cap = replay.parse_capacity(text, 1)
        best = replay.replay_optimum(trace, cap).hit_tokens
        for policy in args.policies.split(","):
            admission, eviction = policy.split("+")
            got = run(trace, cap, admission, eviction)
            if check is not None:
                check(trace, cap, policy, got)
            print(f"| {text} | {policy} | {got:,} | {got / best:.3f} |", flush=True)


def check_leaf_first(trace: replay.Trace, cap: int, policy: str, got: int) -> None:
    """always+lru must serve what hicache replay's leaf-first serves."""
    if policy == "always+lru":
        lf = replay.replay_policy(trace, cap, "leaf-first").hit_tokens
        assert got == lf, f"simulator {got} != hicache replay's leaf-first {lf}"


def main() -> None:
    sweep(
        __doc__.splitlines()[0],
        "always+lru,always+slru0.5,ghost4+lru,ghost4+slru0.5,ghost4+classes,freq10+lru,freq30+lru,oracle+lru",
        simulate,
        check_leaf_first,
    )


if __name__ == "__main__":
    main()
