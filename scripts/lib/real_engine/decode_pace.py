"""Decode pace vs the engine's batch: the analysis behind the real-engine report's discussion.

Why: the filter's slowness judges a stream by its decode phase (first byte to last, per token,
against the group's decode pace) and, on an endpoint without judged streams, plain answers and
first bytes as a low envelope. On a CPU llama.cpp engine a decode step is compute-bound: two
slots decoding together take about twice as long per step as one, so each stream's per-token
time doubles (and more when the other slot's prefill shares the step). The question is whether
that reads as "slow", and whether dividing the pace by the engine's concurrency (its scraped
`requests_processing`, or equivalently its own tokens/s) makes it load-free.

How: from each answer's own `timings` (llama.cpp's `prompt_ms`, `predicted_ms`) and its end
time, every answer's engine-side prefill and decode intervals are rebuilt; for each answer the
decode interval is then compared with the other answers on the same engine: the time-weighted
number of slots busy during it (1 = alone, 2 = the other slot busy throughout), split into the
other slot decoding and the other slot prefilling. The driver's sampled `requests_processing`
(every 0.5 s, at a random moment) gives the same from the engine's `/metrics`, coarser. Per-token
times: the engine's (`predicted_ms / completion_tokens`, every answer) and, for streams, the
client's decode phase (`(latency − ttfb) / (completion − 1)`, what the filter judges).

Usable alone: `python3 decode_pace.py latest.json` prints the section.
"""

import json
import math
import sys

# Sampled load nearer than this to an answer's decode interval counts for it.
SAMPLE_SLACK_S = 0.25


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def intervals(records):
    """Per engine: (record, prefill (t0, t1), decode (t0, t1)) from the answer's timings."""
    out = {}
    for r in records:
        if r.get("status") != 200 or not r.get("upstream") or r.get("predicted_ms") is None:
            continue
        end = r["end_s"]
        d0 = end - r["predicted_ms"] / 1000
        p0 = d0 - (r.get("prompt_ms") or 0) / 1000
        out.setdefault(r["upstream"], []).append((r, (p0, d0), (d0, end)))
    return out


def overlap(a, b):
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def annotate(p):
    """One row per answer with its per-token times and the concurrency during its decode."""
    rows = []
    samples = p.get("samples") or []
    for eng, items in intervals(p["records"]).items():
        for r, _pre, dec in items:
            span = dec[1] - dec[0]
            if span <= 0:
                continue
            o_dec = o_pre = 0.0
            w_dec = w_pre = 0.0  # the other slots' tokens in this interval (spread evenly)
            for r2, pre2, dec2 in items:
                if r2 is r:
                    continue
                od, op = overlap(dec, dec2), overlap(dec, pre2)
                o_dec += od
                o_pre += op
                if od > 0 and dec2[1] > dec2[0]:
                    w_dec += (r2.get("completion_tokens") or 0) * od / (dec2[1] - dec2[0])
                if op > 0 and pre2[1] > pre2[0]:
                    w_pre += (r2.get("evaluated") or 0) * op / (pre2[1] - pre2[0])
            loads = [s["engines"].get(eng, {}).get("requests_processing") for s in samples
                     if dec[0] - SAMPLE_SLACK_S <= s["t_s"] <= dec[1] + SAMPLE_SLACK_S]
            loads = [x for x in loads if x is not None]
            n = r.get("completion_tokens") or 0
            client = None
            if r.get("stream") and r.get("ttfb_s") is not None and n >= 2:
                client = 1000 * (r["latency_s"] - r["ttfb_s"]) / (n - 1)
            rows.append({
                "rec": r, "engine": eng, "stream": bool(r.get("stream")), "end_s": r["end_s"],
                "engine_ms_per_token": r["predicted_ms"] / max(1, n),
                "decode_ms": r["predicted_ms"], "tokens": n,
                "other_decode_tokens": w_dec, "other_prefill_tokens": w_pre,
                "client_ms_per_token": client,
                "conc": 1 + (o_dec + o_pre) / span,
                "other_decoding": o_dec / span, "other_prefilling": o_pre / span,
                "sampled_running": sum(loads) / len(loads) if loads else None,
            })
    return rows


def solve(a, b):
    """Gaussian elimination with partial pivoting (a small dense system); None if singular."""
    n = len(b)
    m = [list(a[i]) + [b[i]] for i in range(n)]
    for c in range(n):
        piv = max(range(c, n), key=lambda i: abs(m[i][c]))
        if abs(m[piv][c]) < 1e-12:
            return None
        m[c], m[piv] = m[piv], m[c]
        for i in range(n):
            if i != c:
                k = m[i][c] / m[c][c]
                m[i] = [x - k * y for x, y in zip(m[i], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_step_cost(rows):
    """decode_ms ≈ a·own tokens + b·the other slot's decode tokens + c·its prefill tokens in the
    same interval, least squares on relative errors (each row divided by its observed time)."""
    xs = [(r["tokens"], r["other_decode_tokens"], r["other_prefill_tokens"]) for r in rows if r["decode_ms"] > 0]
    ys = [r["decode_ms"] for r in rows if r["decode_ms"] > 0]
    ata = [[0.0] * 3 for _ in range(3)]
    atb = [0.0] * 3
    for x, y in zip(xs, ys):
        xr = [v / y for v in x]
        for i in range(3):
            atb[i] += xr[i]
            for j in range(3):
                ata[i][j] += xr[i] * xr[j]
    return solve(ata, atb)


def work_pace(r, coef):
    """ms per unit of the engine's work during the answer's decode (its own token = 1)."""
    a, b, c = coef
    return r["decode_ms"] / (r["tokens"] + (b / a) * r["other_decode_tokens"] + (c / a) * r["other_prefill_tokens"])


def window_ratios(rows, key, win_s=3.0, step_s=1.0, min_answers=3):
    """Per window of answers ending within win_s: the slower engine's median of `key` over the
    faster one's (what a two-engine slowness comparison would read); windows where both engines
    have min_answers."""
    if not rows:
        return []
    engines = sorted({r["engine"] for r in rows})
    if len(engines) != 2:
        return []
    t_end = max(r["end_s"] for r in rows)
    out, t = [], 0.0
    while t <= t_end:
        meds = []
        for e in engines:
            v = [key(r) for r in rows if r["engine"] == e and t - win_s < r["end_s"] <= t]
            v = [x for x in v if x is not None]
            meds.append(pct(v, 50) if len(v) >= min_answers else None)
        if None not in meds and min(meds) > 0:
            out.append(max(meds) / min(meds))
        t += step_s
    return out


# The filter's slowness rule (src/scheduler/routing/judge/slowness.rs), replayed on the recorded
# answers: its constants, and the default degraded rule (tuning.pin_break_ratio 3; built in: exit
# ratio 1.5, a gap of at least 50 ms; cold_start_samples 20).
ALPHA, QUEUE_ALPHA_UP, CLAMP, MIN_DECODE_TOKENS, FRESH_S = 0.3, 0.1, math.log(3.0), 16, 60.0
RATIO, EXIT_RATIO, MIN_EXTRA_MS, MIN_SAMPLES, WARM_MODEL = 3.0, 1.5, 50.0, 20, 32


def variant_samples(rows_by_rec, variant):
    """(record, observed ms, decode phase (ms, tokens) or None) per answer under `variant`."""
    out = []
    for r, a in rows_by_rec:
        n = r.get("completion_tokens") or 0
        dec = None
        if variant == "as on main (client times)":
            obs = 1000 * (r["ttfb_s"] if r.get("stream") else r["latency_s"])
            if r.get("stream") and n - 1 >= MIN_DECODE_TOKENS:
                dec = (1000 * (r["latency_s"] - r["ttfb_s"]), n - 1)
        else:
            d = r["predicted_ms"]
            if variant == "engine compute, decode ÷ sampled running":
                d /= max(1.0, a["sampled_running"] or 1.0)
            elif variant == "engine compute, decode ÷ engine work":
                d = a["work_pace"] * n
            obs = r["prompt_ms"] + (0 if r.get("stream") else d)
            if r.get("stream") and n - 1 >= MIN_DECODE_TOKENS:
                dec = (d * (n - 1) / n, n - 1)
        out.append((r, obs, dec))
    return out


def replay(p, variant, rows):
    """Replays the slowness EWMA and the degraded rule over the answers in the order they
    ended; returns (degraded entries, answers whose previous turn's engine was degraded when
    they started, slowness ratio at those)."""
    by_key = {(r["session"], r["turn"]): r for r in p["records"] if r.get("status") == 200}
    ann = {id(a["rec"]): a for a in rows}
    recs = [r for r in sorted(by_key.values(), key=lambda r: r["end_s"])
            if r.get("predicted_ms") is not None and r.get("prompt_ms") is not None and id(r) in ann
            and (not r.get("stream") or r.get("ttfb_s") is not None)]
    samples = variant_samples([(r, ann[id(r)]) for r in recs], variant)
    # The work model: one relative least-squares fit over the run's answers (the filter fits
    # online with forgetting; the yardstick is common to both engines either way).
    ata, atb = [[0.0] * 3 for _ in range(3)], [0.0] * 3
    dms = dtok = 0.0
    for r, obs, dec in samples:
        x = [1.0, ((r.get("prompt_tokens") or 0) - (r.get("cached_tokens") or 0)) / 1000,
             0.0 if r.get("stream") else (r.get("completion_tokens") or 0) / 100]
        xr = [v / max(obs, 1.0) for v in x]
        for i in range(3):
            atb[i] += xr[i]
            for j in range(3):
                ata[i][j] += xr[i] * xr[j]
        if dec:
            dms += dec[0]
            dtok += dec[1]
    for i in range(3):
        ata[i][i] += 1e-6
    coef = solve(ata, atb) or [1.0, 0.0, 0.0]
    if coef[2] <= 0:  # no plain answers: the decode term is the streams' pace
        coef[2] = 100 * (dms / dtok if dtok else 5.0)
    pace = dms / dtok if dtok else coef[2] / 100
    st = {}
    timeline = []  # (t, engine, degraded)
    values = []  # (t, engine, log slowness)
    judged = []  # (t, engine, log ratio of the sample, decode phase?)
    entries = 0
    for k, (r, obs, dec) in enumerate(samples):
        if k < WARM_MODEL:
            continue
        e = r["upstream"]
        s = st.setdefault(e, {"lm": 0.0, "n": 0, "exp": 0.0, "last_dec": None, "deg": False})
        x = [1.0, ((r.get("prompt_tokens") or 0) - (r.get("cached_tokens") or 0)) / 1000,
             0.0 if r.get("stream") else (r.get("completion_tokens") or 0) / 100]
        expected = max(1.0, sum(c * v for c, v in zip(coef, x)))
        t = r["end_s"]
        judged.append((t, e, math.log(max(dec[0], 10.0) / (pace * dec[1])) if dec
                       else math.log(max(obs, 10.0) / expected), bool(dec)))
        if dec:
            ln, alpha = math.log(max(dec[0], 10.0) / (pace * dec[1])), ALPHA
            s["last_dec"] = t
        elif s["last_dec"] is not None and t - s["last_dec"] <= FRESH_S:
            continue
        else:
            ln = math.log(max(obs, 10.0) / expected)
            alpha = QUEUE_ALPHA_UP if ln > s["lm"] else ALPHA
        if s["n"] == 0:
            s["lm"], s["exp"] = max(-CLAMP, min(CLAMP, ln)), expected
        else:
            s["exp"] = (1 - ALPHA) * s["exp"] + ALPHA * expected
            ln = max(s["lm"] - CLAMP, min(s["lm"] + CLAMP, ln))
            s["lm"] = (1 - alpha) * s["lm"] + alpha * ln
        s["n"] += 1
        values.append((t, e, s["lm"]))
        for name, me in st.items():
            peers = [math.exp(o["lm"]) for n2, o in st.items() if n2 != name and o["n"] >= MIN_SAMPLES]
            if me["n"] < MIN_SAMPLES or not peers:
                continue
            mine, ref = math.exp(me["lm"]), sorted(peers)[len(peers) // 2]
            extra = (mine - ref) * me["exp"]
            was = me["deg"]
            me["deg"] = (mine / ref >= EXIT_RATIO and extra >= MIN_EXTRA_MS / 2) if was \
                else (mine / ref >= RATIO and extra >= MIN_EXTRA_MS)
            if me["deg"] and not was:
                entries += 1
            timeline.append((t, name, me["deg"]))
    # Follow-ups that started while the engine of their previous turn was degraded.
    hits = 0
    for r in by_key.values():
        pr = by_key.get((r["session"], r["turn"] - 1))
        if not pr or not pr.get("upstream"):
            continue
        state = False
        for t, name, deg in timeline:
            if t > r["start_s"]:
                break
            if name == pr["upstream"]:
                state = deg
        hits += state
    return entries, hits, values, judged


def agreement(p, values):
    """How the replay's e0/e1 slowness ratio matches the filter's own gauges at the driver's
    samples: (samples, median |ln replay ratio − ln filter ratio| as a factor, share within 1.5×)."""
    diffs = []
    for smp in p.get("samples") or []:
        g = smp.get("filter") or {}
        gs = {e: (g.get(e) or {}).get("computeflux_slowness_permille") for e in ("e0", "e1")}
        if not all(gs.values()):
            continue
        cur = {}
        for t, e, lm in values:
            if t > smp["t_s"]:
                break
            cur[e] = lm
        if len(cur) < 2:
            continue
        diffs.append(abs((cur["e0"] - cur["e1"]) - math.log(gs["e0"] / gs["e1"])))
    if not diffs:
        return None
    return len(diffs), math.exp(pct(diffs, 50)), sum(d <= math.log(1.5) for d in diffs) / len(diffs)


VARIANTS = ("as on main (client times)", "engine compute (no queue)",
            "engine compute, decode ÷ sampled running", "engine compute, decode ÷ engine work")


def replay_md(res, allrows, coef):
    L = ["### The slowness rule replayed on these answers\n",
         "The filter's slowness (its constants: α 0.3, low envelope up at 0.1, clamp 3×, decode "
         f"phases judged from {MIN_DECODE_TOKENS} tokens after the first, 60 s freshness) and the "
         "default degraded rule (3× the peers' median and ≥ 50 ms a request to enter, 1.5× to "
         "leave, 20 samples) replayed in Python over each run's answers in the order they ended, "
         "against one work model fitted to the run (the filter fits online; the yardstick is "
         "common to both engines). *Follow-ups sent off* = follow-ups that started while the "
         "engine of their previous turn was degraded in the replay (what `pin_break` does), "
         "to compare with the filter's own count. Variants feed the same rule with times where "
         "the engine's queue is removed (its own `timings`: prompt_ms + predicted_ms), and "
         "then with the decode part divided by the engine's scraped `requests_processing` "
         "(sampled, ≥ 1) or by the fitted engine work of the section above.\n"]
    checks, moves, per_variant = [], {}, {}
    L.append("| policy | pin_break (filter) | " + " | ".join(f"{v}: entries / follow-ups sent off" for v in VARIANTS) + " |")
    L.append("|---|---|" + "---|" * len(VARIANTS))
    for p in res["policies"]:
        if p["policy"] not in allrows:
            continue
        rows = allrows[p["policy"]]
        for a in rows:
            a["work_pace"] = work_pace(a, coef) if coef else a["engine_ms_per_token"]
        stats = p.get("envoy_computeflux_stats") or {}
        pb = sum(v for k, v in stats.items() if k.endswith("computeflux_decisions_total.reason.pin_break"))
        cells = []
        for v in VARIANTS:
            if "running" in v and not any(a["sampled_running"] for a in rows):
                cells.append("—")
                continue
            e, h, values, judged = replay(p, v, rows)
            per_variant[v] = judged
            cells.append(f"{e} / {h}")
            if v == VARIANTS[0]:
                ag = agreement(p, values)
                if ag:
                    checks.append(f"{p['policy']}: {ag[0]} samples, median difference ×{ag[1]:.2f}, "
                                  f"{100 * ag[2]:.0f} % within 1.5×")
        L.append(f"| {p['policy']} | {pb if stats else '—'} | " + " | ".join(cells) + " |")
        moves[p["policy"]] = (p, dict(per_variant))
    L.append("")
    if checks:
        L.append("Check of the replay (as on main) against the filter's own `computeflux_slowness_permille` "
                 "gauges at the driver's samples: the ratio e0 ÷ e1 of the replay vs the filter's — "
                 + "; ".join(checks) + ".\n")
    L.append(moves_evidence_md(moves))
    return "\n".join(L)


LAST_SAMPLES = 8


def moves_evidence_md(moves):
    """Per pin_break: each engine's last judged samples before it, under three variants."""
    shown = VARIANTS[:3]
    L = [f"Which samples drove each move: for every `pin_break`, the lower quartile (what the low "
         f"envelope settles near) of the judged ratios (observed ÷ the run's work model) of each "
         f"engine's last {LAST_SAMPLES} answers before the move, under the variants above, and the "
         f"left engine's over the other's (≥ 3 is `tuning.pin_break_ratio`); *d* = how many of the left "
         f"engine's were streams judged by their decode phase.\n"]
    L.append("| policy | session/turn | from → to | " + " | ".join(f"{v}: left / to = ratio" for v in shown) + " | d |")
    L.append("|---|---|---|" + "---|" * len(shown) + "---|")
    agg = {v: [] for v in shown}
    for pol, (p, pv) in moves.items():
        by_key = {(r["session"], r["turn"]): r for r in p["records"] if r.get("status") == 200}
        for r in sorted(by_key.values(), key=lambda r: r["start_s"]):
            if r.get("affinity") != "pin_break":
                continue
            pr = by_key.get((r["session"], r["turn"] - 1))
            if not pr:
                continue
            cells, dcount = [], 0
            for v in shown:
                judged = pv.get(v) or []
                q = {}
                for e in (pr["upstream"], r["upstream"]):
                    last = [j for j in judged if j[1] == e and j[0] <= r["start_s"]][-LAST_SAMPLES:]
                    q[e] = math.exp(pct([j[2] for j in last], 25)) if last else None
                    if v == shown[0] and e == pr["upstream"]:
                        dcount = sum(j[3] for j in last)
                a, b = q[pr["upstream"]], q[r["upstream"]]
                if a and b:
                    agg[v].append(a / b)
                    cells.append(f"{a:.2f} / {b:.2f} = {a / b:.2f}")
                else:
                    cells.append("—")
            L.append(f"| {pol} | {r['session']}/{r['turn']} | {pr['upstream']} → {r['upstream']} | "
                     + " | ".join(cells) + f" | {dcount} |")
    if any(agg.values()):
        L.append("| all moves | median ratio | | " + " | ".join(
            f"{pct(agg[v], 50):.2f}" if agg[v] else "—" for v in shown) + " | |")
    L.append("")
    return "\n".join(L)


BUCKETS = ("alone", "partly shared", "batch 2, other slot decoding", "batch 2, other slot prefilling too")


def bucket(r):
    c = r["conc"]
    if c < 1.25:
        return BUCKETS[0]
    if c < 1.75:
        return BUCKETS[1]
    return BUCKETS[2] if r["other_prefilling"] < 0.05 else BUCKETS[3]


def f(v, d=1):
    return "—" if v is None else f"{v:.{d}f}"


def spread(xs):
    """p10 / p50 / p90 of xs relative to their median (the load-free question is about spread)."""
    m = pct(xs, 50)
    if not xs or not m:
        return "—"
    return f"{pct(xs, 10) / m:.2f} / 1 / {pct(xs, 90) / m:.2f}"


def decode_pace_md(res):
    L = ["### Decode pace vs the engine's batch\n",
         "Each answer's decode interval on its engine is rebuilt from its own `timings` "
         "(`predicted_ms` before its end; `prompt_ms` before that for its prefill); *concurrency* "
         "is the time-weighted number of the engine's 2 slots busy during that interval (1 = "
         "alone; 2 = the other slot busy throughout, decoding or prefilling); *sampled running* "
         "is the mean of the driver's samples of the engine's own `requests_processing` within "
         f"{SAMPLE_SLACK_S} s of the interval. Per-token times: the engine's (`predicted_ms` ÷ "
         "completion tokens, every answer) and for streams the client's decode phase "
         "((last byte − first byte) ÷ (completion − 1): what the filter's decode-phase rule would "
         "judge). Median (p10–p90), answers in brackets.\n"]
    L.append("| policy | engine | concurrency | answers | share of answers | engine ms/token | "
             "streams' decode phase ms/token | of which the other slot was prefilling |")
    L.append("|---|---|---|---|---|---|---|---|")
    allrows = {}
    for p in res["policies"]:
        rows = annotate(p)
        allrows[p["policy"]] = rows
        for eng in sorted({r["engine"] for r in rows}):
            er = [r for r in rows if r["engine"] == eng]
            for b in BUCKETS:
                br = [r for r in er if bucket(r) == b]
                if not br:
                    continue
                e = [r["engine_ms_per_token"] for r in br]
                c = [r["client_ms_per_token"] for r in br if r["client_ms_per_token"] is not None]
                pre = [r["other_prefilling"] for r in br]
                L.append(f"| {p['policy']} | {eng} | {b} | {len(br)} | {100 * len(br) / len(er):.0f} % | "
                         f"{f(pct(e, 50))} ({f(pct(e, 10))}–{f(pct(e, 90))}) | "
                         + (f"{f(pct(c, 50))} ({f(pct(c, 10))}–{f(pct(c, 90))}) [{len(c)}]" if c else "—")
                         + f" | {100 * sum(pre) / len(pre):.0f} % of the interval |")
    L.append("")
    L.append("By the engine's own scraped `requests_processing` (the signal the filter holds), and "
             "whether dividing the per-token time by it makes the pace load-free. *Ratio* = median "
             "per-token time at that load ÷ the engine's median when sampled alone (running 1):\n")
    L.append("| policy | engine | sampled running | answers | engine ms/token | ratio to running 1 | "
             "ms/token ÷ sampled running | ms/token ÷ concurrency (rebuilt) |")
    L.append("|---|---|---|---|---|---|---|---|")
    summary = []
    for pol, rows in allrows.items():
        for eng in sorted({r["engine"] for r in rows}):
            er = [r for r in rows if r["engine"] == eng and r["sampled_running"] is not None]
            groups = {}
            for r in er:
                k = "1" if r["sampled_running"] < 1.5 else ("2" if r["sampled_running"] >= 1.75 else "1.5–1.75")
                groups.setdefault(k, []).append(r)
            base = pct([r["engine_ms_per_token"] for r in groups.get("1", [])], 50)
            for k in ("1", "1.5–1.75", "2"):
                g = groups.get(k)
                if not g:
                    continue
                e = [r["engine_ms_per_token"] for r in g]
                nr = [r["engine_ms_per_token"] / max(1.0, r["sampled_running"]) for r in g]
                nc = [r["engine_ms_per_token"] / r["conc"] for r in g]
                L.append(f"| {pol} | {eng} | {k} | {len(g)} | {f(pct(e, 50))} | "
                         f"{f(pct(e, 50) / base, 2) if base else '—'} | {f(pct(nr, 50))} | {f(pct(nc, 50))} |")
    # One step-cost fit over every run of the report: the engines and the model are the same.
    every = [r for rows in allrows.values() for r in rows]
    coef = fit_step_cost(every)
    keys = {
        "raw": lambda r: r["engine_ms_per_token"],
        "÷ sampled running": lambda r: (None if r["sampled_running"] is None
                                        else r["engine_ms_per_token"] / max(1.0, r["sampled_running"])),
        "÷ concurrency (rebuilt)": lambda r: r["engine_ms_per_token"] / r["conc"],
    }
    if coef and coef[0] > 0:
        keys["÷ engine work (fitted)"] = lambda r: work_pace(r, coef)
    L.append("")
    if coef:
        a, b, c = coef
        L.append(f"A fit of each answer's decode time to the engine's work during it, over the "
                 f"{len(every)} answers of this report: decode ms ≈ {a:.2f} × own tokens + "
                 f"{b:.2f} × the other slot's decode tokens + {c:.3f} × the other slot's prefill "
                 f"tokens in the same interval (relative least squares). So one more decoding slot "
                 f"costs each token {b / a:.2f}× its own cost, and a 200-token prefill in the other "
                 f"slot adds {200 * c:.0f} ms to the interval it falls in. *÷ engine work* divides "
                 f"each answer's decode time by own tokens + {b / a:.2f} × the other's decode tokens "
                 f"+ {c / a:.3f} × its prefill tokens.\n")
    L.append("Spread of the per-token time over every answer of a run (both engines; p10 / p50 / p90 "
             "÷ the median), raw and normalized:\n")
    L.append("| policy | answers | " + " | ".join(keys) + " |")
    L.append("|---|---|" + "---|" * len(keys))
    for pol, rows in allrows.items():
        cells = []
        for k in keys.values():
            cells.append(spread([x for x in (k(r) for r in rows) if x is not None]))
        L.append(f"| {pol} | {len(rows)} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("What a comparison of the two engines reads (the filter's degraded rule compares an "
             "endpoint's slowness with its peers' median; with two engines, the other one): over "
             "windows of 3 s (every 1 s, both engines with ≥ 3 answers ending in it), the slower "
             "engine's median per-token time ÷ the faster one's. Median / p90 / max, and the share "
             "of windows at ≥ 2× and ≥ 3× (`tuning.pin_break_ratio`):\n")
    L.append("| policy | windows | " + " | ".join(keys) + " |")
    L.append("|---|---|" + "---|" * len(keys))
    for pol, rows in allrows.items():
        cells, nwin = [], 0
        for k in keys.values():
            w = window_ratios(rows, k)
            nwin = max(nwin, len(w))
            if not w:
                cells.append("—")
                continue
            cells.append(f"{pct(w, 50):.2f} / {pct(w, 90):.2f} / {max(w):.2f}; "
                         f"{100 * sum(x >= 2 for x in w) / len(w):.0f} % / {100 * sum(x >= 3 for x in w) / len(w):.0f} %")
        L.append(f"| {pol} | {nwin} | " + " | ".join(cells) + " |")
    L.append("")
    L.append(replay_md(res, allrows, coef if coef and coef[0] > 0 else None))
    return "\n".join(L)


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        sys.stdout.write(decode_pace_md(json.load(fh)) + "\n")
