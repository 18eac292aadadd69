"""What a trace tells an online policy about reuse: whether a conversation continues, and when.

At small host budgets most of the optimum's extra hits are next turns of conversations that it
keeps because it knows they come back (`docs/performance.md`). An online policy can only
guess which ones will, from what it has seen. This script measures how well each signal a
trace offers does that. For every request it asks whether a later request extends its prompt,
i.e. starts with all of its blocks but the last, partial one (``policy_bounds.conversation_parents``,
which the turns of ``bench/research/policy_bounds.py`` come from too). Signals
(``policy_bounds.request_features``, which ``learned<p>`` admission there predicts from):

- the request's turn;
- the tokens it added to its conversation;
- the time since its previous turn;
- its answer's length;
- its prompt's length.

For each one it prints the AUC of "continues" (0.5: no signal; 1.0: separates perfectly), and the
same for a logistic model on all of them, fit on the trace's first half and scored on its second.
A second column asks the same where a ghost's admission is decided: among later turns only, each
weighted by the pages its prompt shares with its parent's (the pages seen before), so that it
compares with ``policy_bounds``' ``noisya<auc>`` admission.
It also prints the spread of the gaps to the next turn, in seconds and in pools' worth of
traffic at the given capacity.

    python bench/research/reuse_signals.py data/traces/mooncake_conversation_trace.jsonl --capacity 1M
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from policy_bounds import (  # its folder is on the path when run
    SIGNALS,
    conversation_parents,
    conversation_turns,
    logistic_fit,
    request_features,
)

from hicache import replay


def auc(score: np.ndarray, label: np.ndarray, weight: np.ndarray | None = None) -> float:
    """The chance that a random positive scores above a random negative (ties count half),
    each drawn in proportion to its weight (1 if none)."""
    w = np.ones(len(score)) if weight is None else np.asarray(weight, dtype=float)
    pos = label.astype(bool)
    values, group = np.unique(score, return_inverse=True)
    neg_in = np.bincount(group, weights=w * ~pos, minlength=len(values))
    pos_in = np.bincount(group, weights=w * pos, minlength=len(values))
    neg_below = np.cumsum(neg_in) - neg_in
    return float((pos_in * (neg_below + neg_in / 2)).sum() / (pos_in.sum() * neg_in.sum()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--capacity", default="1M", help="tokens: gaps are also given in pools of this size")
    args = ap.parse_args()
    with open(args.trace) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    pool_pages = replay.parse_capacity(args.capacity, 1)
    parent = conversation_parents([row["hash_ids"] for row in rows])
    pages_before = np.cumsum([0] + [-(-int(r["input_length"]) // replay.PAGE_TOKENS) for r in rows])
    turn = conversation_turns(parent)
    continues = np.zeros(len(rows))
    continues[[j for j in parent if j is not None]] = 1
    features = np.array(request_features(rows, parent))
    signals = dict(zip(SIGNALS, features.T, strict=True))
    x = np.column_stack([np.ones(len(rows)), features])
    half = len(rows) // 2
    print(f"{args.trace}: {len(rows)} requests, {continues.mean():.3f} of them continued later")
    # The pages a ghost admits are those seen before: a later turn's pages that its parent's
    # prompt had. Among them, how well does each signal tell the ones read again?
    later = np.array([j is not None for j in parent])
    seen_pages = np.array([0 if j is None else pages_before[j + 1] - pages_before[j] for j in parent])
    print("| signal | AUC of 'the conversation continues' | among later turns, by pages seen before |")
    print("| --- | --- | --- |")

    def both(score: np.ndarray, rows_in: np.ndarray) -> str:
        a = auc(score, continues[rows_in])
        ghost = rows_in[later[rows_in]]
        b = auc(score[later[rows_in]], continues[ghost], seen_pages[ghost])
        return f"{max(a, 1 - a):.3f} | {max(b, 1 - b):.3f}"

    everyone = np.arange(len(rows))
    for name, values in signals.items():
        print(f"| {name} | {both(values, everyone)} |")
    w = logistic_fit(x[:half], continues[:half])
    logistic = both(x[half:] @ w, everyone[half:])
    print(f"| all of them (logistic, fit on the first half, scored on the second) | {logistic} |")
    by_turn = [(t, continues[[k for k in range(len(rows)) if min(turn[k], 7) == t]]) for t in range(8)]
    print("\n| turn | requests | continued |\n| --- | --- | --- |")
    for t, c in by_turn:
        if len(c):
            print(f"| {t}{'+' if t == 7 else ''} | {len(c)} | {c.mean():.2f} |")
    kids = [i for i, j in enumerate(parent) if j is not None]
    seconds = np.array([(rows[i]["timestamp"] - rows[parent[i]]["timestamp"]) / 1000 for i in kids])
    pools = np.array([(pages_before[i] - pages_before[parent[i]]) / pool_pages for i in kids])
    qs = (5, 10, 25, 50, 75, 90, 95)
    print(f"\n| gap to the next turn | {' | '.join(f'{q} %' for q in qs)} |")
    print(f"| --- |{' --- |' * len(qs)}")
    print(f"| seconds | {' | '.join(f'{np.percentile(seconds, q):.0f}' for q in qs)} |")
    print(f"| pools of {args.capacity} tokens | {' | '.join(f'{np.percentile(pools, q):.2f}' for q in qs)} |")
    corr = np.corrcoef(np.log1p(np.array(_pairs(rows, parent))).T)[0, 1]
    print(f"\nconsecutive gaps of one conversation, correlation of their logs: {corr:.2f}")


def _pairs(rows: list[dict], parent: list[int | None]) -> list[tuple[float, float]]:
    """(previous gap, next gap) in seconds for every turn whose parent had a parent too."""
    out = []
    for i, j in enumerate(parent):
        if j is not None and parent[j] is not None:
            k = parent[j]
            out.append(
                (
                    (rows[j]["timestamp"] - rows[k]["timestamp"]) / 1000,
                    (rows[i]["timestamp"] - rows[j]["timestamp"]) / 1000,
                )
            )
    return out


if __name__ == "__main__":
    main()
