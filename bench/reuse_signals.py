"""What a trace tells an online policy about reuse: whether a conversation continues, and when.

At small host budgets most of the optimum's extra hits are next turns of conversations that it
keeps because it knows they come back (`BENCHMARKS.md`, replay). An online policy can only
guess which ones will, from what it has seen. This script measures how well each signal a
trace offers does that. For every request it asks whether a later request extends its prompt,
i.e. starts with all of its blocks but the last, partial one (``policy_bounds.conversation_parents``,
which the turns of ``bench/policy_bounds.py`` come from too). Signals:

- the request's turn;
- its answer's length;
- its prompt's length;
- the tokens it added to its conversation;
- the time since its previous turn.

For each one it prints the AUC of "continues" (0.5: no signal; 1.0: separates perfectly), and the
same for a logistic model on all of them, fit on the trace's first half and scored on its second.
It also prints the spread of the gaps to the next turn, in seconds and in pools' worth of
traffic at the given capacity.

    python bench/reuse_signals.py data/traces/mooncake_conversation_trace.jsonl --capacity 1M
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from policy_bounds import conversation_parents  # bench/ is on the path when run

from hicache import replay


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """The chance that a random positive scores above a random negative (ties count half)."""
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    for v in np.unique(score):  # average ranks over ties
        tie = score == v
        ranks[tie] = ranks[tie].mean()
    pos = label.astype(bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logistic_fit(x: np.ndarray, y: np.ndarray, iterations: int = 25) -> np.ndarray:
    w = np.zeros(x.shape[1])
    for _ in range(iterations):  # Newton's method, a touch of ridge for stability
        p = 1 / (1 + np.exp(-x @ w))
        hess = (x * (p * (1 - p))[:, None]).T @ x + 1e-6 * np.eye(len(w))
        w += np.linalg.solve(hess, x.T @ (y - p))
    return w


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
    turn = [0] * len(rows)
    continues = np.zeros(len(rows))
    for i, j in enumerate(parent):
        if j is not None:
            turn[i] = turn[j] + 1
            continues[j] = 1
    signals = {
        "turn": [float(min(t, 10)) for t in turn],
        "answer length": [math.log1p(r["output_length"]) for r in rows],
        "prompt length": [math.log1p(r["input_length"]) for r in rows],
        "tokens added this turn": [
            math.log1p(abs(r["input_length"] - (0 if j is None else rows[j]["input_length"])))
            for r, j in zip(rows, parent, strict=True)
        ],
        "seconds since the previous turn": [
            -1.0 if j is None else math.log1p((r["timestamp"] - rows[j]["timestamp"]) / 1000)
            for r, j in zip(rows, parent, strict=True)
        ],
    }
    x = np.column_stack([np.ones(len(rows))] + [np.array(v) for v in signals.values()])
    half = len(rows) // 2
    print(f"{args.trace}: {len(rows)} requests, {continues.mean():.3f} of them continued later")
    print("| signal | AUC of 'the conversation continues' |\n| --- | --- |")
    for name, values in signals.items():
        a = auc(np.array(values), continues)
        print(f"| {name} | {max(a, 1 - a):.3f} |")
    w = logistic_fit(x[:half], continues[:half])
    print(
        f"| all of them (logistic, fit on the first half, scored on the second) | "
        f"{auc(x[half:] @ w, continues[half:]):.3f} |"
    )
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
