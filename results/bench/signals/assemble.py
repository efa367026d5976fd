#!/usr/bin/env python3
"""Assembles results/bench/signals/README.md from the runs' results.json (see the commands in
the README). Usage: assemble.py RUN_DIR... (each a scripts/bench --out directory)."""
import json, sys, os

def load(d):
    p = os.path.join(d, "results.json")
    if not os.path.exists(p):
        return []
    v = json.load(open(p))
    return v.get("routing", [])

def label(r):
    return r["policy"] + (" ×%d" % r["replicas"] if r["replicas"] > 1 else "")

def cell(r):
    if r is None:
        return "–"
    return "%.1f %% · %.1f %% · %.0f ms · %.1f %%" % (r["cached_ratio"] * 100, r["same_endpoint_share"] * 100, r["latency_ms"]["p99"], (r.get("error_rate") or 0) * 100)

ORDER = ["computeflux", "computeflux_nometrics", "computeflux_rulesoff", "ring_hash", "least_request"]

def table(rows, scenarios):
    out = "| policy | " + " | ".join(scenarios) + " |\n|---|" + "---|" * len(scenarios) + "\n"
    keys = sorted({(r["replicas"], r["policy"]) for r in rows}, key=lambda k: (k[0], ORDER.index(k[1]) if k[1] in ORDER else 99))
    for n, p in keys:
        cells = []
        for sc in scenarios:
            r = next((x for x in rows if x["replicas"] == n and x["policy"] == p and x["scenario"] == sc), None)
            cells.append(cell(r))
        out += "| %s | %s |\n" % (label({"policy": p, "replicas": n}), " | ".join(cells))
    return out

REASONS = ["affinity_hit", "home", "backup", "spill", "pin_break", "degraded", "saturated", "degraded_probe"]

def decisions(rows, scenarios):
    out = "| run | " + " | ".join(REASONS) + " |\n|---|" + "---|" * len(REASONS) + "\n"
    for sc in scenarios:
        for r in rows:
            if r["scenario"] != sc or not r.get("decisions"):
                continue
            out += "| %s, %s | %s |\n" % (label(r), sc, " | ".join(str(r["decisions"].get(k, 0)) for k in REASONS))
    return out

def spread(rows, sc):
    out = "| run | endpoint | samples | p10 | p50 | p90 | p90/p10 | min…max |\n|---|---|---|---|---|---|---|---|\n"
    for r in rows:
        if r["scenario"] != sc:
            continue
        for e, s in sorted((r.get("slowness_permille") or {}).items()):
            out += "| %s | %s | %d | %.0f | %.0f | %.0f | %.2f | %.0f…%.0f |\n" % (
                label(r), e, s["samples"], s["p10"], s["p50"], s["p90"], s["p90"] / s["p10"], s["min"], s["max"])
    return out

def row(rows, n, p, sc):
    return next((x for x in rows if x["replicas"] == n and x["policy"] == p and x["scenario"] == sc), None)

def checks(rows, slow_rows):
    out = []
    for n in (1, 3):
        st = row(rows, n, "computeflux", "steady")
        off = row(rows, n, "computeflux_rulesoff", "steady")
        if st:
            d = st.get("decisions", {})
            ok = st["same_endpoint_share"] >= 0.995 and (off is None or abs(st["cached_ratio"] - off["cached_ratio"]) <= 0.005) and d.get("pin_break", 0) == 0 and d.get("degraded", 0) == 0
            out.append("- steady, %s: follow-ups %.1f %% (≥ 99.5 %%), cached %.1f %% vs rules off %s, pin_break %d, degraded %d: **%s**" % (
                "one Envoy" if n == 1 else "×3", st["same_endpoint_share"] * 100, st["cached_ratio"] * 100,
                "%.1f %%" % (off["cached_ratio"] * 100) if off else "–", d.get("pin_break", 0), d.get("degraded", 0), "met" if ok else "missed"))
        mf = row(rows, n, "computeflux", "mixed_fleet")
        rh = row(rows, n, "ring_hash", "mixed_fleet")
        bal = [x for x in rows if x["scenario"] == "mixed_fleet" and x["policy"] in ("ring_hash", "least_request", "round_robin", "maglev") and x["replicas"] == n]
        if n == 3:  # least_request runs with one Envoy only: the best balancer of either topology
            bal += [x for x in rows if x["scenario"] == "mixed_fleet" and x["policy"] == "least_request"]
        if mf and rh and bal:
            best = min(x["latency_ms"]["p99"] for x in bal)
            ok = mf["cached_ratio"] >= rh["cached_ratio"] and mf["latency_ms"]["p99"] <= 0.6 * best
            out.append("- mixed_fleet, %s: cached %.1f %% vs ring_hash %.1f %%, p99 %.0f ms vs 0.6 × best balancer (%.0f ms) = %.0f ms: **%s**" % (
                "one Envoy" if n == 1 else "×3", mf["cached_ratio"] * 100, rh["cached_ratio"] * 100, mf["latency_ms"]["p99"], best, 0.6 * best, "met" if ok else "missed"))
    for n in (1, 3):
        st = row(slow_rows, n, "computeflux", "steady")
        sl = row(slow_rows, n, "computeflux", "slow")
        if st and sl:
            ok = sl["latency_ms"]["p99"] <= 1.5 * st["latency_ms"]["p99"] and abs(sl["cached_ratio"] - st["cached_ratio"]) <= 0.03
            out.append("- slow (850 sessions, 5× from ≈ 12.7 s), %s: p99 %.0f ms vs 1.5 × steady %.0f ms = %.0f ms; cached %.1f %% vs steady %.1f %%: **%s**" % (
                "one Envoy" if n == 1 else "×3", sl["latency_ms"]["p99"], st["latency_ms"]["p99"], 1.5 * st["latency_ms"]["p99"], sl["cached_ratio"] * 100, st["cached_ratio"] * 100, "met" if ok else "missed"))
    return "\n".join(out) + "\n"

if __name__ == "__main__":
    main_dir, other_dir, slow_dir = sys.argv[1:4]
    rows, other, slow = load(main_dir), load(other_dir), load(slow_dir)
    s = "Each table cell: cached-token ratio · follow-ups on the previous endpoint · p99 · client-visible errors.\n\n## Targets (computed from the runs below)\n\n" + checks(rows, slow) + "\n"
    s += "## Steady and mixed fleet (200 sessions × 6 turns)\n\ncached-token ratio · follow-ups on the previous endpoint · p99 · client-visible errors\n\n" + table(rows, ["steady", "mixed_fleet"]) + "\n"
    s += "Decisions (`computeflux_decisions_total`, summed over the replicas):\n\n" + decisions(rows, ["steady", "mixed_fleet"]) + "\n"
    if slow:
        s += "## Slow endpoint (850 sessions × 6 turns: `a` 5× slower from ≈ 12.7 s)\n\n" + table(slow, ["steady", "slow"]) + "\n" + decisions(slow, ["steady", "slow"]) + "\n"
    if other:
        s += "## 429 window, outage, join, rolling restart, quota (200 sessions × 6 turns)\n\n`computeflux_nometrics` is the filter as on main before this branch in this bench (no endpoint has `metrics`, so nothing is saturated and the changed pin rule never runs): \"today\".\n\n" + table(other, ["rate_limited", "down", "join", "rolling_restart", "quota"]) + "\n" + decisions(other, ["rate_limited", "down", "join", "rolling_restart", "quota"]) + "\n"
    s += "## Slowness estimate on the endpoints in steady (`computeflux_slowness_permille`, sampled once a second from a fifth of the run on, all replicas pooled)\n\n" + spread(rows + slow, "steady") + "\n"
    print(s)
