"""What ``state_lookback`` buys and costs: hits of branching prompts on a hybrid model.

A hybrid model resumes only at a block boundary that has a stored state, and ``store`` keeps
states at the last ``state_lookback`` boundaries of each prompt. A prompt that extends an earlier
one (the next turn of a conversation, an agent's next step) resumes at the earlier prompt's last
boundary whatever the lookback. A prompt that branches off ``d`` tokens before the end of an
earlier one (an edited message, a retried tool call, another sample from a shared prompt) gets
its shared pages only if a state lies within them: with ``d`` past ``state_lookback`` blocks it
gets nothing, with a larger lookback it gets the pages down to the boundary below the branch.

Two measurements:

- ``python bench/research/state_lookback.py model``: a base prompt then a branch of it, for each lookback
  and branch distance, through ``hicache.transformers.PrefixCache`` (a tiny random-weight
  Qwen3-Next, gated delta nets and full attention, on the CPU): the tokens served against the
  pages the two prompts share.
- ``python bench/research/state_lookback.py trace FILE``: a Mooncake trace (``hash_ids`` one per
  512-token block) replayed in file order through an index of unbounded pages and an LRU of
  ``--states`` state slots, an engine of ``--block-tokens`` blocks storing states the way
  ``store`` does (or, to compare, N states S blocks apart): the share of prompt tokens served.
  A request shares with earlier ones what the trace says (whole 512-token blocks), so a state
  must lie on or below a shared 512-token boundary to be served.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import transformers

from hicache.transformers import PrefixCache

# The tests' tiny random-weight models (nothing downloaded).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "py"))
import hf_families


def model_branches(args: argparse.Namespace) -> None:
    transformers.logging.set_verbosity_error()
    model = hf_families.make_model("qwen3_next")
    B = args.block_tokens
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (args.prompt,), generator=g).tolist()
    for lookback in map(int, args.lookbacks.split(",")):
        row: dict[str, object] = {"state_lookback": lookback}
        for d in map(int, args.branches.split(",")):
            pc = PrefixCache(
                model, capacity_pages=1024, capacity_states=64, block_tokens=B, state_lookback=lookback
            )
            pc.prefill(base)
            cut = args.prompt - d
            branch = base[:cut] + [(t + 1) % 256 for t in base[cut:]]
            pc.prefill([*branch, 0])  # the branch, plus a token of its own
            row[f"d={d}"] = f"{pc.last_served}/{cut // B * B}"  # served / whole pages shared
        row["states_stored_of_both"] = pc.cache.stats().states_stored
        row["state_bytes"] = pc.layout.state_bytes
        print(json.dumps(row))


def trace_replay(args: argparse.Namespace) -> None:
    reqs = [json.loads(line) for line in open(args.file)]
    E, T = args.block_tokens, 512
    per = T // E  # engine blocks a trace block
    total = sum(r["input_length"] for r in reqs)
    for spec in args.grid.split(","):
        lookback, spacing = spec.split(":") if ":" in spec else (spec, "geometric")
        distances = [
            _distance(j) if spacing == "geometric" else j * int(spacing) for j in range(int(lookback))
        ]
        row: dict[str, object] = {"state_lookback": int(lookback), "spacing": spacing}
        for cap in map(int, args.states.split(",")):
            present: set[int] = set()
            states: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
            served = 0
            for r in reqs:
                h, n = r["hash_ids"], r["input_length"]
                shared = 0
                while shared < min(len(h), n // T) and h[shared] in present:
                    shared += 1
                for b in range(min(shared * per, (n - 1) // E), 0, -1):
                    key = (h[(b - 1) // per], (b - 1) % per)  # boundary b, named by its block
                    if key in states:
                        served += b * E
                        states.move_to_end(key)
                        break
                present.update(h[: n // T])
                for dist in distances:
                    b = n // E - dist
                    if b <= 0 or (b - 1) // per >= len(h):
                        continue
                    states[(h[(b - 1) // per], (b - 1) % per)] = None
                    states.move_to_end((h[(b - 1) // per], (b - 1) % per))
                    while len(states) > cap:
                        states.popitem(last=False)
            row[f"states={cap}"] = round(served / total, 3)
        print(json.dumps(row), flush=True)


def _distance(j: int) -> int:
    """hicache's spacing (hicache.reference.state_boundary_distance): 0, 1, 2, 4, 8... blocks."""
    return j if j < 2 else 1 << (j - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("model", help="branches of one prompt through hicache.transformers")
    m.add_argument("--block-tokens", type=int, default=16)
    m.add_argument("--prompt", type=int, default=512, help="tokens of the base prompt")
    m.add_argument("--lookbacks", default="1,2,4,6,8")
    m.add_argument("--branches", default="1,24,40,72,136,264", help="where branches differ, from the end")
    t = sub.add_parser("trace", help="a Mooncake trace through an index of pages and an LRU of states")
    t.add_argument("file")
    t.add_argument("--block-tokens", type=int, default=128, help="the engine's block (a divisor of 512)")
    t.add_argument(
        "--grid",
        default="2:1,4:1,4,5,6,8,4:4",
        help="lookbacks, comma-separated; N:S spaces N states S blocks apart (hicache: 0, 1, 2, 4...)",
    )
    t.add_argument("--states", default="1000,4000,1000000000", help="state slots, comma-separated")
    args = ap.parse_args()
    (model_branches if args.what == "model" else trace_replay)(args)


if __name__ == "__main__":
    main()
