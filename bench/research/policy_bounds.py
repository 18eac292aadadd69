"""How much of the optimum eviction could recover at small host budgets: sampled-eviction bounds.

Leaf-first chains of 128-token pages with the replay's hit rule (keep_tokens = 1), as in
``bench/research/policy_prototypes.py``, but eviction takes the best of 32 random evictable leaves (never
the storing request's own pages) by a score, so that scores which are not an order can be tried:

- ``lru``: the least recently used (sampled LRU; ``ghost4+lru`` matches the prototypes' exact
  ``ghost4+lru`` to within a thousandth of the optimum on the conversation trace);
- ``next-use``: the page read again farthest in the future, or never (an oracle: what perfect
  prediction of reuse would gain with this admission);
- ``hazard``: the page least likely to be read within the next 4 pools' worth of traffic, given
  how long it has waited, from the distribution of reuse gaps of its class measured on the whole
  trace beforehand (an oracle on the distribution, not on each page's future). A page's class is
  its prompt's: how much of the prompt was seen before (quarters), how often its deepest seen
  page was seen (the conversation's turn, up to 8), and how long ago (log2 buckets);
- ``hazard-out``: the same, the classes split further by the request's output length (log2
  buckets of 25 tokens, from the trace's ``output_length``): a conversation's next turn comes
  later after a longer answer (median gap on the conversation trace: 50 s after answers under 100
  tokens, 96 s after 300-600, 129 s after 600-2000);
- ``hazard-online``, ``hazard-out-online``: the same classes, their distributions learned as the
  trace goes instead of known beforehand (per class, a histogram of the gaps seen so far in
  quarter-octave buckets; a reference not followed by another within 16 pools' worth of traffic
  counts as never read again);
- ``hazard-cout``, ``hazard-cturn``, ``hazard-coutturn`` (each also ``-online``): a few coarse
  classes instead, so that each learns from many gaps: the request's output length alone (log2
  buckets of 100 tokens, 5 classes), the conversation's turn alone (how often its deepest seen
  page was seen, up to 3: 4 classes), or both (20 classes).

- ``lruturn<x>``: the least recently used, its age scaled by P(turn)^-x, where P(turn) is the
  chance that a conversation at the page's turn continues, learned as the trace goes (requests
  seen at the next turn over requests seen at this one, up to turn 7). A request's turn is how
  many earlier prompts it extends (a prompt extends another when it starts with all of that
  prompt's blocks but its last, partial one): on the conversation trace 0.25 of first turns
  continue, 0.39 of second turns, 0.49 of third and 0.73 of seventh.

Admission: ``always``; ``ghost<k>`` (while the pool is full, only pages whose key was in the last
k pools' worth of prompt keys); ``oracle`` (only pages read again); ``sample<q>`` (ghost4, and
only a fraction q of conversations, chosen by a hash of the first page a prompt does not share
with the prompts before it, so that a subset is kept longer); ``compare<m>`` (a page in the ghost,
or one whose chance of a read within the horizon, by its class, beats the victim's by more than
m: TinyLFU's comparison with the hazard's estimate); ``noisya<auc>@<t>`` (how good a guess of
"this page is read again" the ghost would need: while full, a page in the ghost whose guess
passes, the guess being the truth blurred by one normal draw per request, so that it separates
pages read again from the others with the given AUC, passing above the midpoint plus t standard
deviations; ``noisyg`` takes a page in the ghost or one whose guess passes, ``noisy`` the guess
alone); ``learned<p>`` (an online guess: a page in the ghost if a logistic model of "the
conversation continues" on the request's SIGNALS, refit every 256 requests on those 16 pools'
worth of traffic old, gives at least p).

    python bench/research/policy_bounds.py data/traces/mooncake_conversation_trace.jsonl --capacity 1M
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from statistics import NormalDist

import numpy as np
from policy_prototypes import sweep  # the shared command line (its folder is on the path when run)

from hicache import replay

Page = tuple[int, int]
NEVER = 1 << 62
SAMPLES = 32


class Trace:
    """The trace's pages per request, each reference's time (pages seen before it) and the time
    of its page's next reference."""

    def __init__(self, trace: replay.Trace) -> None:
        self.reqs = [trace.pages(r) for r in range(len(trace))]
        self.limit = trace.hit_limit(1)
        self.starts: list[int] = []
        t = 0
        for req in self.reqs:
            self.starts.append(t)
            t += len(req)
        self.next_use: list[dict[Page, int]] = [{} for _ in self.reqs]
        last: dict[Page, int] = {}
        for r in range(len(self.reqs) - 1, -1, -1):
            self.next_use[r] = {p: last.get(p, NEVER) for p in self.reqs[r]}
            for p in self.reqs[r]:
                last[p] = self.starts[r]


OUTPUTS: list[int] = []  # each request's output_length, read from the trace by main()
TURNS: list[int] = []  # each request's turn: how many earlier prompts it extends (main())
FEATURES: list[list[float]] = []  # per request, 1 and its SIGNALS: what learned<p> admits by (main())
PARENTS: list[int | None] = []  # per request, the request whose prompt it extends (main())


MAX_TURN = 7


def conversation_parents(hash_ids: list[list[int]]) -> list[int | None]:
    """Per request, the latest earlier request whose prompt it extends (all of that prompt's
    blocks but the last, at least two of them, so that a shared system prompt alone does not make
    a conversation), or None."""
    ends: dict[tuple[int, ...], int] = {}
    parents: list[int | None] = []
    for i, ids in enumerate(hash_ids):
        found = None
        for n in range(len(ids) - 1, 1, -1):
            found = ends.get(tuple(ids[:n]))
            if found is not None:
                break
        parents.append(found)
        ends[tuple(ids[:-1])] = i
    return parents


def conversation_turns(parents: list[int | None]) -> list[int]:
    """Per request, the turn of its conversation: 0, or one more than its parent's
    (``conversation_parents``)."""
    turns: list[int] = []
    for j in parents:
        turns.append(0 if j is None else turns[j] + 1)
    return turns


SIGNALS = (
    "turn",
    "tokens added this turn",
    "seconds since the previous turn",
    "answer length",
    "prompt length",
)


def request_features(rows: list[dict], parents: list[int | None]) -> list[list[float]]:
    """What a request tells an online policy of its conversation's future, one value per name in
    SIGNALS (logs of lengths and times; -1 seconds for a first turn)."""
    out = []
    for r, j, turn in zip(rows, parents, conversation_turns(parents), strict=True):
        added = abs(r["input_length"] - (0 if j is None else rows[j]["input_length"]))
        since = -1.0 if j is None else math.log1p((r["timestamp"] - rows[j]["timestamp"]) / 1000)
        lengths = [math.log1p(r["output_length"]), math.log1p(r["input_length"])]
        out.append([float(min(turn, 10)), math.log1p(added), since, *lengths])
    return out


def logistic_fit(x: np.ndarray, y: np.ndarray, iterations: int = 25) -> np.ndarray:
    """Weights w (x's first column a constant) for P(y) = 1 / (1 + exp(-x @ w))."""
    w = np.zeros(x.shape[1])
    for _ in range(iterations):  # Newton's method, a touch of ridge for stability
        p = 1 / (1 + np.exp(-x @ w))
        hess = (x * (p * (1 - p))[:, None]).T @ x + 1e-6 * np.eye(len(w))
        w += np.linalg.solve(hess, x.T @ (y - p))
    return w


COARSE = [""]  # the coarse classes simulate() uses now: "", "out", "turn" or "outturn"


def coarse_class(req: list[Page], seen: Counter[Page], last: dict[Page, int], output: int) -> tuple[int, ...]:
    out = min(int(math.log2(output / 100 + 1)), 4)
    deepest = max((i for i, p in enumerate(req) if p in last), default=-1)
    turn = 0 if deepest < 0 else min(seen[req[deepest]], 3)
    return {"out": (out,), "turn": (turn,), "outturn": (out, turn)}[COARSE[0]]


def prompt_class(
    req: list[Page], seen: Counter[Page], last: dict[Page, int], now: int, output: int | None = None
) -> tuple[int, ...]:
    if COARSE[0]:
        return coarse_class(req, seen, last, output or 0)
    extra = () if output is None else (min(int(math.log2(output / 25 + 1)), 9),)
    deepest = -1
    for i, p in enumerate(req):
        if p in last:
            deepest = i
    if deepest < 0:
        return (-1, *extra)
    p = req[deepest]
    return (
        min(4 * (deepest + 1) // len(req), 3),
        min(seen[p], 8),
        min(int(math.log2((now - last[p]) / 2000 + 1)), 8),
        *extra,
    )


def gap_distributions(tr: Trace, outputs: bool) -> dict[tuple[int, ...], list[int]]:
    """Per prompt class, the sorted gaps from each reference to its page's next one (NEVER)."""
    seen: Counter[Page] = Counter()
    last: dict[Page, int] = {}
    gaps: dict[tuple[int, ...], list[int]] = {}
    for r, req in enumerate(tr.reqs):
        now = tr.starts[r]
        k = prompt_class(req, seen, last, now, OUTPUTS[r] if outputs else None)
        for p in req:
            nxt = tr.next_use[r][p]
            gaps.setdefault(k, []).append(NEVER if nxt == NEVER else nxt - now)
        for p in req:
            seen[p] += 1
            last[p] = now
    for g in gaps.values():
        g.sort()
    return gaps


def simulate(tr: Trace, capacity: int, admission: str, eviction: str, horizon: int, seed: int = 1) -> int:
    rnd = random.Random(seed)
    online = eviction.endswith("-online")
    COARSE[0] = ""
    for coarse in ("outturn", "turn", "out"):
        if eviction.startswith(f"hazard-c{coarse}"):
            COARSE[0] = coarse
            eviction = "hazard-online" if online else "hazard"
            break
    outputs = eviction.startswith("hazard-out") or COARSE[0] in ("out", "outturn")
    hazards = eviction.startswith("hazard") or admission.startswith("compare")
    gaps = gap_distributions(tr, outputs) if hazards and not online else {}
    # Online: per class, a histogram of the gaps seen so far (quarter-octave buckets), and
    # references not followed by another within `expire` counted as never read again.
    buckets = 80
    expire = 16 * capacity
    hist: dict[tuple[int, ...], list[float]] = {}
    never: Counter[tuple[int, ...]] = Counter()
    pending: dict[Page, tuple[int, tuple[int, ...]]] = {}
    queue: list[tuple[int, Page]] = []
    qhead = 0

    def bucket(g: int) -> int:
        return min(int(4 * math.log2(g / 16 + 1)), buckets - 1)

    def note_gap(k: tuple[int, ...], g: int | None) -> None:
        if g is None:
            never[k] += 1
        else:
            hist.setdefault(k, [0.0] * buckets)[bucket(g)] += 1

    parent: dict[Page, Page | None] = {}
    children: Counter[Page] = Counter()
    last_use: dict[Page, int] = {}
    klass: dict[Page, tuple[int, ...]] = {}
    next_use: dict[Page, int] = {}
    leaves: list[Page] = []
    leaf_at: dict[Page, int] = {}

    def leaf_add(p: Page) -> None:
        if p not in leaf_at:
            leaf_at[p] = len(leaves)
            leaves.append(p)

    def leaf_drop(p: Page) -> None:
        i = leaf_at.pop(p, None)
        if i is None:
            return
        moved = leaves.pop()
        if i < len(leaves):
            leaves[i] = moved
            leaf_at[moved] = i

    def hazard_online(p: Page, now: int) -> float:
        k = klass[p]
        h = hist.get(k)
        nv = never[k]
        if h is None and nv == 0:
            return 0.5
        h = h or [0.0] * buckets
        w = now - last_use[p]
        b0, b1 = bucket(w), bucket(w + horizon)
        surv = sum(h[b0:]) + nv
        if surv <= 0:
            return 2.0
        return 1.0 - sum(h[b0:b1]) / surv

    def hazard(p: Page, now: int) -> float:  # chance of no reference within the horizon
        if online:
            return hazard_online(p, now)
        g = gaps[klass[p]]
        waited = now - last_use[p]
        i = bisect.bisect_right(g, waited)
        if i == len(g):
            return 2.0
        return 1.0 - (bisect.bisect_right(g, waited + horizon) - i) / (len(g) - i)

    scores: dict[str, Callable[[Page, int], float]] = {
        "lru": lambda p, now: now - last_use[p],
        "next-use": lambda p, now: next_use[p],
        "hazard": hazard,
        "hazard-out": hazard,
        "hazard-online": hazard,
        "hazard-out-online": hazard,
    }
    # lruturn: requests seen per turn so far; a conversation at turn t continues with about
    # requests[t + 1] / requests[t] (a prior of one in two while few are seen)
    requests = [0] * (MAX_TURN + 2)
    page_turn: dict[Page, int] = {}

    def continues(t: int) -> float:
        if t >= MAX_TURN:
            t = MAX_TURN - 1
        return max((requests[t + 1] + 1) / (requests[t] + 2), 0.05)

    if eviction.startswith("lruturn"):
        x = float(eviction[7:] or 1)
        score = lambda p, now: (now - last_use[p]) * continues(page_turn[p]) ** -x  # noqa: E731
    else:
        score = scores[eviction]
    ghost: OrderedDict[Page, None] = OrderedDict()
    pools = float(admission[5:]) if admission.startswith("ghost") else 4.0
    share = float(admission[6:]) if admission.startswith("sample") else 1.0
    seen: Counter[Page] = Counter()
    last_seen: dict[Page, int] = {}
    left = Counter(p for req in tr.reqs for p in req) if admission == "oracle" else Counter()
    learned = admission.startswith("learned")
    cut_p = float(admission[7:] or 0.3) if learned else 0.0
    continued = np.zeros(len(tr.reqs))
    matured = 0
    weights: np.ndarray | None = None
    guess = 1.0
    noisy = admission.startswith("noisy")
    if noisy:
        spec = admission[5:]
        ghost_rule = spec[0] if spec[0] in "ga" else ""  # g: the ghost or the guess; a: both
        auc_text, _, thr_text = spec.lstrip("ga").partition("@")
        sep = math.sqrt(2) * NormalDist().inv_cdf(float(auc_text))
        cut = sep / 2 + float(thr_text or 0)
        noise = random.Random(seed + 7)
    served = 0
    for r, req in enumerate(tr.reqs):
        now = tr.starts[r]
        next_use.update(tr.next_use[r])
        h = 0
        while h < tr.limit[r] and req[h] in parent:
            h += 1
        served += h
        k = prompt_class(req, seen, last_seen, now, OUTPUTS[r] if outputs else None)
        turn = min(TURNS[r], MAX_TURN)
        requests[turn] += 1
        own = next((i for i, q in enumerate(req) if seen[q] < seen[req[0]]), len(req))
        sampled = own == len(req) or random.Random(hash(req[own])).random() < share
        if online:
            while qhead < len(queue) and queue[qhead][0] < now - expire:
                t0, q0 = queue[qhead]
                qhead += 1
                pend = pending.get(q0)
                if pend is not None and pend[0] == t0:
                    note_gap(pend[1], None)
                    del pending[q0]
            for q in req:
                pend = pending.get(q)
                if pend is not None:
                    note_gap(pend[1], now - pend[0])
                pending[q] = (now, k)
                queue.append((now, q))
        n_r = noise.gauss(0, 1) if noisy else 0.0
        if learned:
            if PARENTS[r] is not None:
                continued[PARENTS[r]] = 1.0
            while matured < r and tr.starts[matured] < now - expire:
                matured += 1
            if matured >= 200 and r % 256 == 0:
                weights = logistic_fit(np.array(FEATURES[:matured]), continued[:matured], 15)
            if weights is not None:
                guess = 1 / (1 + math.exp(-float(np.dot(weights, FEATURES[r]))))
        in_ghost = set()
        for q in req:
            if q in ghost:
                in_ghost.add(q)
                ghost.move_to_end(q)
            ghost[q] = None
            seen[q] += 1
            last_seen[q] = now
            klass[q] = k
            page_turn[q] = turn
            left[q] -= 1
        while len(ghost) > pools * capacity:
            ghost.popitem(last=False)
        own_pages: set[Page] = set()
        prev: Page | None = None
        for i, p in enumerate(req):
            if p not in parent:
                if admission == "oracle" and left[p] == 0:
                    break  # never read again
                if len(parent) >= capacity:
                    if admission.startswith(("ghost", "sample")) and p not in in_ghost:
                        break
                    if learned and (p not in in_ghost or guess < cut_p):
                        break
                    if noisy:
                        passes = sep * (next_use[p] != NEVER) + n_r > cut
                        in_g = p in in_ghost
                        if not {"g": in_g or passes, "a": in_g and passes, "": passes}[ghost_rule]:
                            break
                    if admission.startswith("sample") and i >= own and not sampled:
                        break
                    picks = [leaves[rnd.randrange(len(leaves))] for _ in range(SAMPLES)] if leaves else []
                    picks = [x for x in picks if x not in own_pages]
                    if not picks:
                        break
                    victim = max(picks, key=lambda x: score(x, now))
                    if admission.startswith("compare") and p not in in_ghost:
                        last_use[p] = now  # a new page's chance, as if it had just been read
                        mine = hazard(p, now)
                        del last_use[p]
                        if mine >= hazard(victim, now) - float(admission[7:] or 0):
                            break
                    leaf_drop(victim)
                    up = parent.pop(victim)
                    del last_use[victim]
                    if up is not None:
                        children[up] -= 1
                        if children[up] == 0:
                            leaf_add(up)
                parent[p] = prev
                if prev is not None:
                    if children[prev] == 0:
                        leaf_drop(prev)
                    children[prev] += 1
                leaf_add(p)
            last_use[p] = now
            own_pages.add(p)
            prev = p
    return served * replay.PAGE_TOKENS


def main() -> None:
    traces: dict[int, Trace] = {}  # the page references' next uses, computed once per trace
    path = argparse.ArgumentParser(add_help=False)
    path.add_argument("trace")
    with open(path.parse_known_args()[0].trace) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    OUTPUTS.extend(int(row.get("output_length", 0)) for row in rows)
    PARENTS.extend(conversation_parents([row["hash_ids"] for row in rows]))
    TURNS.extend(conversation_turns(PARENTS))
    FEATURES.extend([1.0, *f] for f in request_features(rows, PARENTS))

    def run(raw: replay.Trace, cap: int, admission: str, eviction: str) -> int:
        tr = traces.setdefault(id(raw), Trace(raw))
        return simulate(tr, cap, admission, eviction, horizon=4 * cap)

    sweep(
        __doc__.splitlines()[0],
        "ghost4+lru,always+next-use,ghost4+next-use,oracle+next-use,always+hazard,ghost4+hazard,"
        "sample0.5+lru,sample0.25+lru,compare+hazard,compare0.05+hazard,compare0.1+hazard-out,"
        "compare0.1+hazard-out-online",
        run,
    )


if __name__ == "__main__":
    main()
