#!/usr/bin/env python3
"""Per-request diagnosis of the issue 20 runs (shared_prefix, mixed_prefix): where each
application's new sessions went and what their first turns found cached.

Why: the summary table gives one cached-token ratio per run; whether a policy places by prefix
shows in the first turns (a follow-up turn is cached wherever its session stays). Reads the
bench's per-request records (`scripts/bench ... --raw-dir DIR`, one `<policy>[-x3]-<scenario>.jsonl`
per run) and prints one line per run:

  first-turn cached ratio · follow-up cached ratio · endpoints per application (mean over
  applications with ≥ 4 new sessions) · the most popular application's new sessions by endpoint ·
  the filter's affinity results (`x-computeflux-affinity`) of the first turns

usage: results/bench/prefix/diagnose.py DIR [DIR...]
"""

import collections
import json
import pathlib
import sys


def ratio(a, b):
    return f"{100.0 * a / b:5.1f} %" if b else "    –"


def run(path):
    recs = [json.loads(line) for line in path.open()]
    ok = [r for r in recs if 200 <= r["status"] < 300]
    first = [r for r in ok if r["turn"] == 0]
    later = [r for r in ok if r["turn"] > 0]
    ft = ratio(sum(r["cached_tokens"] for r in first), sum(r["prompt_tokens"] for r in first))
    fu = ratio(sum(r["cached_tokens"] for r in later), sum(r["prompt_tokens"] for r in later))
    by_app = collections.defaultdict(collections.Counter)
    for r in first:
        if r.get("app") is not None:
            by_app[r["app"]][r["endpoint"]] += 1
    busy = [c for c in by_app.values() if sum(c.values()) >= 4]
    spread = sum(len(c) for c in busy) / len(busy) if busy else float("nan")
    top = by_app.get(0, collections.Counter())
    top_s = " ".join(f"{e}:{n}" for e, n in sorted(top.items()))
    aff = collections.Counter(r.get("affinity") or "-" for r in first)
    aff_s = " ".join(f"{k}:{v}" for k, v in aff.most_common())
    errors = len(recs) - len(ok)
    return (
        f"{path.stem:44} first turns {ft} · follow-ups {fu} · endpoints/app {spread:4.2f} · "
        f"app 0 [{top_s}] · errors {errors} · affinity {aff_s}"
    )


def main():
    dirs = [pathlib.Path(d) for d in sys.argv[1:]] or [pathlib.Path("results/tmp/bench")]
    for d in dirs:
        for p in sorted(d.glob("*.jsonl")):
            print(run(p))


if __name__ == "__main__":
    main()
