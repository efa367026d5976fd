use super::*;
use crate::scheduler::wire::headers::Pairs;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn h(pairs: &[(&str, &str)]) -> Pairs {
    pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.as_bytes().to_vec()))
        .collect()
}

const NO_MARK: QuotaMark = QuotaMark {
    requests: None,
    tokens: None,
    taken: 0,
    placed: 0,
};

const RULE: QuotaRule = QuotaRule {
    min_requests: 1,
    min_tokens: 0,
    reserve_percent: 0,
    default_reset_ms: 60_000,
    max_reset_ms: 300_000,
};

/// Pacing: a key that used 60 % of its limit in the first 40 % of its window is on course
/// to need 90 % more before the reset: short for new sessions although 40 % is left; the
/// same use over 90 % of the window projects little more, so it is not.
#[test]
fn pacing_keeps_new_sessions_off_a_key_on_course_to_run_out() {
    let paced = RULE;
    let at = |left: u64, elapsed: u64| {
        let r = Remaining {
            left,
            reset_at_ms: 10_000 - elapsed + 1_000,
            limit: Some(1_000),
            span_ms: 10_000,
            assumed: false,
            stated_ms: 0,
            prev_used: 0,
            picked: 0,
            placed: 0,
        };
        Quota {
            requests: None,
            tokens: Some(r),
        }
    };
    // 1 000 ms in: window began at 1 000 - elapsed... now = 1 000.
    let q = at(400, 4_000);
    assert_eq!(q.tokens.map(|r| r.projected_use(1_000)), Some(900));
    assert!(q.short(10, &paced, 1_000));
    // Without pacing only the floors would apply: 400 left covers them.
    assert!(q.tokens.is_some_and(|r| r.left >= 10));
    let late = at(400, 9_000);
    assert_eq!(late.tokens.map(|r| r.projected_use(1_000)), Some(66));
    assert!(!late.short(10, &paced, 1_000));
    // Too early in the window to extrapolate from it: only the last span's use (this
    // window's, the one before unknown) at that rate; unknown limit: nothing projected.
    assert_eq!(
        at(900, 500).tokens.map(|r| r.projected_use(1_000)),
        Some(95)
    );
    let mut unknown = at(400, 4_000);
    if let Some(t) = unknown.tokens.as_mut() {
        t.limit = None;
    }
    assert!(!unknown.short(10, &paced, 1_000));
}

#[test]
fn openai_headers() {
    let hint = QuotaHint::read(
        &h(&[
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]),
        0,
    );
    assert_eq!(
        hint,
        QuotaHint {
            requests: Some(Stated {
                left: 59,
                reset_in_ms: Some(1_000),
                limit: None
            }),
            tokens: Some(Stated {
                left: 149_984,
                reset_in_ms: Some(360_000),
                limit: None
            }),
            at_ms: Some(0),
        }
    );
}

#[test]
fn anthropic_headers_fold_to_the_tightest_token_count() {
    // 2026-11-30T16:00:00Z = 1_796_054_400_000 ms.
    let now = 1_796_054_400_000;
    assert_eq!(parse_rfc3339_ms(b"2026-11-30T16:00:00Z"), Some(now));
    assert_eq!(
        parse_rfc3339_ms(b"2026-11-30T17:00:01.5+01:00"),
        Some(now + 1_500)
    );
    let hint = QuotaHint::read(
        &h(&[
            ("anthropic-ratelimit-requests-remaining", "3"),
            ("anthropic-ratelimit-requests-reset", "2026-11-30T16:00:20Z"),
            ("anthropic-ratelimit-tokens-remaining", "9000"),
            ("anthropic-ratelimit-tokens-reset", "2026-11-30T16:00:30Z"),
            ("anthropic-ratelimit-input-tokens-remaining", "700"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2026-11-30T16:00:05Z",
            ),
        ]),
        now,
    );
    assert_eq!(
        hint.requests,
        Some(Stated {
            left: 3,
            reset_in_ms: Some(20_000),
            limit: None
        })
    );
    assert_eq!(
        hint.tokens,
        Some(Stated {
            left: 700,
            reset_in_ms: Some(5_000),
            limit: None
        })
    );
}

#[test]
fn malformed_values_are_ignored() {
    for bad in [
        "",
        "abc",
        "-5",
        "1.5",
        "1e9",
        "99999999999999999999",
        "１２",
        "10000000000001",
    ] {
        let hint = QuotaHint::read(
            &h(&[
                ("x-ratelimit-remaining-requests", bad),
                ("x-ratelimit-remaining-tokens", bad),
            ]),
            0,
        );
        assert!(hint.is_empty(), "{bad:?}");
    }
    for bad in [
        "",
        "tomorrow",
        "2026-13-01T00:00:00Z",
        "2026-11-30T25:00:00Z",
        "2026-11-30T16:00:00",
        "1969-12-31T23:59:59Z",
        "2026-11-30T16:00:00+99:00",
    ] {
        assert_eq!(parse_rfc3339_ms(bad.as_bytes()), None, "{bad:?}");
    }
    // A far reset is capped, not believed.
    let mut q = Quota::default();
    let far = QuotaHint::read(
        &h(&[
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", "9999-12-31T23:59:59Z"),
        ]),
        1_000,
    );
    q.observe(&far, &NO_MARK, &RULE, 1_000);
    assert_eq!(q.requests.map(|r| r.reset_at_ms), Some(301_000));
    assert_eq!(q.requests_left(301_000), None);
}

#[test]
fn the_rule_with_worked_numbers() {
    // 4 bytes a token: a 2 000-byte body is 500 tokens.
    let est = estimate_tokens(2_000, 4);
    assert_eq!(est, 500);
    assert_eq!(estimate_tokens(2_001, 4), 501);
    let mut q = Quota::default();
    assert!(!q.short(est, &RULE, 0) && !q.certain_429(est, 0));
    q.observe(
        &QuotaHint {
            requests: Some(Stated {
                left: 2,
                reset_in_ms: Some(10_000),
                limit: None,
            }),
            tokens: Some(Stated {
                left: 1_200,
                reset_in_ms: None,
                limit: None,
            }),
            at_ms: None,
        },
        &NO_MARK,
        &RULE,
        0,
    );
    // 2 requests and 1 200 tokens left: room for this one.
    assert!(!q.short(est, &RULE, 0));
    q.consume(est, 0); // 1 request, 700 tokens
    assert!(!q.short(est, &RULE, 0));
    q.consume(est, 0); // 0 requests, 200 tokens
    assert_eq!((q.requests_left(0), q.tokens_left(0)), (Some(0), Some(200)));
    assert!(q.short(est, &RULE, 0) && q.certain_429(est, 0));
    // A small request still fits the tokens, but no request is left.
    assert!(q.certain_429(10, 0));
    // The request window resets after 10 s; the tokens' (no hint) after rate_limit_ms.
    assert_eq!(q.requests_left(10_000), None);
    assert!(q.short(est, &RULE, 10_000) && !q.short(100, &RULE, 10_000));
    assert!(!q.certain_429(200, 10_000));
    assert!(!q.short(est, &RULE, 60_000));
    // A floor makes an endpoint short before a 429 is certain.
    let floor = QuotaRule {
        min_tokens: 1_000,
        ..RULE
    };
    let mut f = Quota::default();
    f.observe(
        &QuotaHint {
            requests: None,
            tokens: Some(Stated {
                left: 900,
                reset_in_ms: None,
                limit: None,
            }),
            at_ms: None,
        },
        &NO_MARK,
        &floor,
        0,
    );
    assert!(f.short(10, &floor, 0) && !f.certain_429(10, 0));
}

#[test]
fn a_late_answer_about_the_same_window_does_not_undo_the_picks_since() {
    let mut q = Quota::default();
    let st = |left, reset_in_ms| QuotaHint {
        requests: Some(Stated {
            left,
            reset_in_ms: Some(reset_in_ms),
            limit: None,
        }),
        tokens: None,
        at_ms: None,
    };
    q.observe(&st(10, 5_000), &NO_MARK, &RULE, 0); // window ends at 5 000
    q.consume(1, 0);
    q.consume(1, 0); // 8 left here
                     // An answer admitted before those two picks says 9, ends at ≈ 5 000: still 8.
    q.observe(&st(9, 4_900), &NO_MARK, &RULE, 100);
    assert_eq!(q.requests_left(100), Some(8));
    // A lower count is taken at once.
    q.observe(&st(3, 4_800), &NO_MARK, &RULE, 200);
    assert_eq!(q.requests_left(200), Some(3));
    // The next window's count replaces it.
    q.observe(&st(10, 5_000), &NO_MARK, &RULE, 5_000);
    assert_eq!(q.requests_left(5_000), Some(10));
}

#[test]
fn with_a_limit_a_reset_count_is_assumed_full_and_counted_down_until_an_answer() {
    let mut q = Quota::default();
    let hint = |left| QuotaHint {
        requests: Some(Stated {
            left,
            reset_in_ms: Some(1_000),
            limit: Some(10),
        }),
        tokens: None,
        at_ms: None,
    };
    q.observe(&hint(0), &NO_MARK, &RULE, 0); // spent until 1 000
    assert!(q.certain_429(1, 999));
    // After the reset: 10 assumed, and each pick counts, with no answer yet.
    assert_eq!(q.requests_left(1_000), Some(10));
    for _ in 0..10 {
        q.consume(1, 1_100);
    }
    assert!(q.certain_429(1, 1_200));
    // Two windows later it is assumed full again (window: the 1 000 ms stated).
    assert_eq!(q.requests_left(3_500), Some(10));
    // The first answer of a window only lowers the assumed count, and sets the reset.
    q.consume(1, 3_500); // 9 assumed, window to 4 000
    q.observe(&hint(9), &NO_MARK, &RULE, 3_600); // that pick's answer
    assert_eq!(
        q.requests.map(|r| (r.left, r.reset_at_ms, r.assumed)),
        Some((9, 4_600, false))
    );
    q.observe(&hint(4), &NO_MARK, &RULE, 3_700);
    assert_eq!(q.requests_left(3_700), Some(4));
    // A limit below the count is not believed.
    let odd = QuotaHint::read(
        &h(&[
            ("x-ratelimit-remaining-requests", "5"),
            ("x-ratelimit-limit-requests", "4"),
        ]),
        0,
    );
    assert_eq!(odd.requests.map(|s| s.limit), Some(None));
}

/// A 30 % reserve of a key's stated limit keeps new placements off it before it runs out, on
/// top of what pacing projects (late in the window: little), while a pinned turn still goes
/// (no certain 429).
#[test]
fn a_reserve_keeps_new_sessions_off_before_the_key_runs_out() {
    let reserve = QuotaRule {
        reserve_percent: 30,
        ..RULE
    };
    // 9 s into a 10 s window of 1 000 tokens: 1 s to the reset at 1 000.
    let at = |left: u64| Quota {
        requests: None,
        tokens: Some(Remaining {
            left,
            reset_at_ms: 2_000,
            limit: Some(1_000),
            span_ms: 10_000,
            assumed: false,
            stated_ms: 0,
            prev_used: 0,
            picked: 0,
            placed: 0,
        }),
    };
    // 400 left, 66 projected: above the reserve of 300.
    assert!(!at(400).short(1, &reserve, 1_000));
    // 350 left, 72 projected: below it; without the reserve, not short.
    assert!(at(350).short(1, &reserve, 1_000));
    assert!(!at(350).short(1, &RULE, 1_000));
    assert!(!at(350).certain_429(1, 1_000));
}

#[test]
fn round_trip() {
    let q = Quota {
        requests: Some(Remaining::new(7, 9)),
        tokens: Some(Remaining {
            left: 1,
            reset_at_ms: 2,
            limit: Some(3),
            span_ms: 4,
            assumed: true,
            stated_ms: 5,
            prev_used: 6,
            picked: 7,
            placed: 8,
        }),
    };
    let mut w = Writer::with_capacity(Quota::BYTES);
    q.encode(&mut w);
    assert_eq!(w.buf.len(), Quota::BYTES);
    assert_eq!(Quota::decode(&mut Reader::new(&w.buf)), Some(q));
}

/// The answer's `usage` replaces the pick's estimate in the remembered count: a
/// request that used more takes the rest, one that used less gives it back, never past the
/// stated limit, and an unknown or forgotten count stays unknown.
#[test]
fn settle_replaces_the_estimate_by_the_reported_usage() {
    let at = |left: u64| Quota {
        requests: None,
        tokens: Some(Remaining {
            left,
            reset_at_ms: 10_000,
            limit: Some(50_000),
            span_ms: 10_000,
            assumed: false,
            stated_ms: 0,
            prev_used: 0,
            picked: 0,
            placed: 0,
        }),
    };
    let mut q = at(40_000);
    q.consume(3_000, 1_000);
    assert_eq!(q.tokens_left(1_000), Some(37_000));
    // Used 3 500: 500 more.
    q.settle(3_000, 3_500, 1_000, 2_000);
    assert_eq!(q.tokens_left(2_000), Some(36_500));
    // An estimate of 10 000 for a request that used 200: 9 800 back.
    q.settle(10_000, 200, 1_000, 2_000);
    assert_eq!(q.tokens_left(2_000), Some(46_300));
    // Never past the limit.
    q.settle(10_000, 0, 1_000, 2_000);
    assert_eq!(q.tokens_left(2_000), Some(50_000));
    // Unknown stays unknown.
    let mut none = Quota::default();
    none.settle(10, 1_000, 1_000, 2_000);
    assert_eq!(none, Quota::default());
}

/// A key with fixed windows that charges each request (prompt and completion) when it admits
/// it and states what is left then, as hosted APIs and the bench's mock do.
struct Upstream {
    budget: u64,
    window_ms: u64,
    window_start_ms: u64,
    used: u64,
}

impl Upstream {
    fn roll(&mut self, now_ms: u64) {
        let start = now_ms - now_ms % self.window_ms;
        if start != self.window_start_ms {
            self.window_start_ms = start;
            self.used = 0;
        }
    }

    fn left(&mut self, now_ms: u64) -> u64 {
        self.roll(now_ms);
        self.budget - self.used
    }

    /// The statement of an admitted request: tokens left, and the reset in ms from admission.
    fn admit(&mut self, tokens: u64, now_ms: u64) -> Option<Stated> {
        self.roll(now_ms);
        if self.used + tokens > self.budget {
            return None;
        }
        self.used += tokens;
        Some(Stated {
            left: self.budget - self.used,
            reset_in_ms: Some(self.window_start_ms + self.window_ms - now_ms),
            limit: Some(self.budget),
        })
    }
}

/// One Envoy's quota bench once moved 66 follow-ups between keys that both had quota):
/// the remembered count must follow the key's real use, not drift below it. Requests are sent
/// every 40 ms, each answered after 0.1–3.6 s (plain answers' headers come at their end), so
/// answers end out of the order the key admitted them, and some after the window they were
/// charged to. Before: resets counted from when the headers were read (late by a whole
/// generation, so a window's count outlived its reset), a statement relayed after the reset
/// lowered the new window's count, and an answer's `usage` was taken off again when a
/// statement of a request sent after it (which the key had charged it in) was already merged:
/// the count fell thousands of tokens below the key's and turns left a key that had quota.
#[test]
fn the_count_follows_a_keys_real_use_when_answers_end_out_of_order() {
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let window_ms = 4_000;
    let mut key = Upstream {
        budget: 170_000,
        window_ms,
        window_start_ms: 0,
        used: 0,
    };
    let rule = QuotaRule {
        default_reset_ms: window_ms,
        ..RULE
    };
    let mut q = Quota::default();
    // (end, sent, estimate, used, statement) of the answers in flight.
    let mut flight: Vec<(u64, u64, u64, u64, Stated)> = Vec::new();
    let (mut worst_low, mut worst_high, mut checks) = (0_i64, 0_i64, 0);
    let t0 = 1_796_054_400_000_u64 + 1_234;
    for i in 0..3_000_u64 {
        let now = t0 + i * 40;
        // The answers that ended by now, in the order they ended.
        flight.sort_by_key(|f| f.0);
        while flight.first().is_some_and(|f| f.0 <= now) {
            let (end, sent, estimate, used, stated) = flight.remove(0);
            q.settle(estimate, used, sent, end);
            let hint = QuotaHint {
                requests: None,
                tokens: Some(stated),
                at_ms: Some(sent),
            };
            q.observe(&hint, &NO_MARK, &rule, end);
        }
        // What the key has left vs what the count says, at each pick from the second window on
        // (picks before the first statement cannot be counted).
        if let Some(counted) = q.tokens_left(now).filter(|_| now >= t0 + window_ms) {
            let real = key.left(now) as i64;
            // The requests in flight, charged by the key: the count may not know them yet (a
            // statement merged since replaced its picks' estimates).
            let unsettled: i64 = flight
                .iter()
                .filter(|f| f.1 >= key.window_start_ms)
                .map(|f| f.3 as i64)
                .sum();
            worst_low = worst_low.max(real - counted as i64);
            worst_high = worst_high.max(counted as i64 - real - unsettled);
            checks += 1;
        }
        let prompt = 500 + next(1_500);
        let completion = 30 + next(200);
        let took = 100 + next(3_500);
        q.consume(prompt, now);
        let stated = key.admit(prompt + completion, now);
        let Some(stated) = stated else {
            panic!("the budget is meant to hold: request {i} refused");
        };
        flight.push((now + took, now, prompt, prompt + completion, stated));
    }
    assert!(checks > 2_800, "{checks}");
    assert!(
        worst_low <= 0,
        "the count fell {worst_low} tokens below what the key had left"
    );
    assert!(
        worst_high <= 0,
        "the count was {worst_high} tokens above the key's beyond the answers in flight"
    );
}

/// A plain answer's headers come after its whole generation; the reset they state counts from
/// when the key admitted the request (when it was sent), not from when they were read. And an
/// answer relayed after its window ended says nothing about the next one.
#[test]
fn resets_count_from_when_the_request_was_sent() {
    let mut q = Quota::default();
    let hint = |left, reset_in_ms, sent| QuotaHint {
        requests: None,
        tokens: Some(Stated {
            left,
            reset_in_ms: Some(reset_in_ms),
            limit: Some(10_000),
        }),
        at_ms: Some(sent),
    };
    q.observe(&hint(9_000, 4_000, 0), &NO_MARK, &RULE, 100); // a 4 s window, ends at 4 000
                                                             // Sent at 3 000, "1s" to the reset, relayed at 3 900: the window still ends at 4 000
                                                             // (counted from 3 900 it would have lasted to 4 900, with 2 000 left instead of 10 000).
    q.observe(&hint(2_000, 1_000, 3_000), &NO_MARK, &RULE, 3_900);
    assert_eq!(q.tokens.map(|r| r.reset_at_ms), Some(4_000));
    assert_eq!(q.tokens_left(3_900), Some(2_000));
    assert_eq!(
        q.tokens_left(4_000),
        Some(10_000),
        "assumed back at its limit"
    );
    q.consume(500, 4_100);
    // A straggler of the ended window, relayed in the next: passed over.
    q.observe(&hint(300, 200, 3_800), &NO_MARK, &RULE, 6_000);
    assert_eq!(q.tokens_left(6_000), Some(9_500));
    // An answer of this window lowers it.
    q.observe(&hint(9_000, 3_900, 4_100), &NO_MARK, &RULE, 6_100);
    assert_eq!(q.tokens_left(6_100), Some(9_000));
}

/// The quota bench, three replicas: a 429 that said 1 808 tokens were left cooled the
/// key whole on the replica that got it, and a pinned turn of 1 431 tokens moved. The 429's
/// statement explains it (fewer tokens than the request's estimate): it is remembered, and
/// only requests that do not fit are kept off; one that does not explain it (enough left by
/// its own count, no reset, no statement) is left to the breaker.
#[test]
fn a_429_that_its_statement_explains_sets_the_count_instead_of_the_breaker() {
    let hint = |left: u64, reset: Option<u64>| QuotaHint {
        requests: None,
        tokens: Some(Stated {
            left,
            reset_in_ms: reset,
            limit: Some(60_000),
        }),
        at_ms: Some(1_000),
    };
    let mut q = Quota::default();
    assert!(q.refused(&hint(1_808, Some(1_449)), 1_903, &NO_MARK, &RULE, 1_010));
    assert_eq!(q.tokens_left(1_010), Some(1_808));
    assert!(!q.certain_429(1_431, 1_020), "a turn that fits stays");
    assert!(q.certain_429(1_903, 1_020), "one that does not moves");
    // After the reset, the limit again (assumed): nothing waits for a breaker's probes.
    assert_eq!(q.tokens_left(2_449), Some(60_000));
    // No request left, with a reset: explained too.
    let mut r = Quota::default();
    let requests = QuotaHint {
        requests: Some(Stated {
            left: 0,
            reset_in_ms: Some(500),
            limit: None,
        }),
        tokens: None,
        at_ms: Some(0),
    };
    assert!(r.refused(&requests, 10, &NO_MARK, &RULE, 5));
    assert_eq!(r.requests_left(5), Some(0));
    // Not explained: the count untouched.
    for (h, estimate) in [
        (hint(1_808, Some(1_449)), 1_808),
        (hint(10, None), 1_903),
        (QuotaHint::default(), 1_903),
    ] {
        let mut q = Quota::default();
        assert!(!q.refused(&h, estimate, &NO_MARK, &RULE, 1_010), "{h:?}");
        assert_eq!(q, Quota::default());
    }
}

/// Pacing across a reset: a key whose pinned sessions used 80 % of its limit in the last
/// window will use as much in this one, although this one has barely begun. Before, the new
/// window looked empty (nothing to extrapolate from in its first tenth), and new sessions were
/// placed on a key that its pinned sessions then ran dry (the quota bench, three
/// replicas: 30 pinned turns moved off keys with nothing left).
#[test]
fn pacing_carries_the_last_windows_use_into_the_next() {
    let paced = QuotaRule {
        reserve_percent: 50,
        ..RULE
    };
    let stated = |left: u64| QuotaHint {
        requests: None,
        tokens: Some(Stated {
            left,
            reset_in_ms: Some(4_000),
            limit: Some(10_000),
        }),
        at_ms: None,
    };
    // Window [0, 4 000): 8 000 of 10 000 used by its end.
    let mut q = Quota::default();
    q.observe(&stated(2_000), &NO_MARK, &paced, 0);
    // 100 ms into the next window (assumed at the limit): 8 000 projected, short.
    assert_eq!(
        q.tokens.and_then(|r| r.current(4_100)).map(|r| r.prev_used),
        Some(8_000)
    );
    assert!(q.short(10, &paced, 4_100));
    // Its first answer (a new window's statement) keeps what the last one used.
    q.observe(&stated(9_500), &NO_MARK, &paced, 4_100);
    assert_eq!(q.tokens.map(|r| r.prev_used), Some(8_000));
    assert!(q.short(10, &paced, 4_200));
    // A window used lightly before: the new one is open to new sessions.
    let mut light = Quota::default();
    light.observe(&stated(9_000), &NO_MARK, &paced, 0);
    assert!(!light.short(10, &paced, 4_100));
    // Late in a window, what is left covers the reserve and the use until the reset, but the
    // pinned sessions use more per window than the limit less the reserve: sessions placed
    // now would spend in the next window, which they would run dry. Short.
    let mut late = Quota::default();
    late.observe(&stated(2_000), &NO_MARK, &paced, 0);
    let mut third = stated(6_500);
    if let Some(t) = third.tokens.as_mut() {
        t.reset_in_ms = Some(1_000);
    }
    late.observe(&third, &NO_MARK, &paced, 7_000);
    let r = late.tokens.unwrap();
    assert_eq!((r.prev_used, r.projected_use(7_000)), (8_000, 1_375));
    assert_eq!(r.span_use(7_000), 5_500);
    assert!(late.short(10, &paced, 7_000));
    // A whole window passed unseen: nothing carried.
    assert_eq!(
        q.tokens
            .and_then(|r| r.current(12_500))
            .map(|r| r.prev_used),
        Some(0)
    );
    assert!(!q.short(10, &paced, 12_500));
}

/// A key with a 4 s window and a stated limit of 10 000 tokens, stated full by an answer to a
/// request sent at 0; `stated(left, sent)`: an answer's statement about that window.
fn reconcile_setup() -> (Quota, impl Fn(u64, u64) -> QuotaHint) {
    let stated = |left: u64, sent: u64| QuotaHint {
        requests: None,
        tokens: Some(Stated {
            left,
            reset_in_ms: Some(4_000 - sent),
            limit: Some(10_000),
        }),
        at_ms: Some(sent),
    };
    let mut q = Quota::default();
    q.observe(&stated(10_000, 0), &NO_MARK, &RULE, 0);
    (q, stated)
}

/// The quota bench, one Envoy (a key with 2 827 tokens left looked short for a pinned
/// turn of 2 387 and the turn moved): a fresher statement about the same window raises the
/// count to what the key states less the picks made after the stated request. Here a pick of
/// 3 000 whose attempt failed (nothing charged, no `usage` to settle it) stays in the count;
/// the next answer states 9 000 left. Before: only lowered, the count stayed at 6 000 (a
/// 6 500-token pinned turn was a "certain 429"); after: 9 000, less the 1 100 picked after it.
#[test]
fn a_fresher_statement_raises_the_count_to_the_statement_less_the_picks_since() {
    let (mut q, stated) = reconcile_setup();
    q.consume(3_000, 10); // failed: never charged, never settled
    let b = q.consume(1_100, 20); // charged 1 000
    q.settle(1_100, 1_000, 20, 300);
    assert_eq!(q.tokens_left(300), Some(6_000));
    let c = q.consume(1_100, 400); // in flight, not in b's statement
    q.observe(&stated(9_000, 20), &b, &RULE, 500);
    assert_eq!(q.tokens_left(500), Some(7_900));
    assert!(!q.certain_429(6_500, 500));
    // c's answer: what it states holds every pick before it; c itself settles first.
    q.settle(1_100, 1_000, 400, 900);
    assert_eq!(q.tokens_left(900), Some(8_000));
    q.observe(&stated(8_000, 400), &c, &RULE, 900);
    assert_eq!(q.tokens_left(900), Some(8_000));
    // Without marks (a statement that cannot be placed among the picks) it is only lowered.
    let (mut old, stated) = reconcile_setup();
    old.consume(3_000, 10);
    old.consume(1_100, 20);
    old.settle(1_100, 1_000, 20, 300);
    old.observe(&stated(9_000, 20), &NO_MARK, &RULE, 500);
    assert_eq!(old.tokens_left(500), Some(6_000));
}

/// A statement below the count (another replica spent on the key) lowers it to the statement
/// less the picks made after the stated request: merged as the lower of the two, those picks
/// were forgotten and the count stood above what the key had left (4 000 vs 2 900).
#[test]
fn a_lower_statement_keeps_the_picks_made_after_it() {
    let (mut q, stated) = reconcile_setup();
    let a = q.consume(1_100, 10);
    q.consume(1_100, 20); // in flight
    assert_eq!(q.tokens_left(20), Some(7_800));
    // a's answer: 5 000 spent elsewhere, and a's 1 000.
    q.settle(1_100, 1_000, 10, 300);
    q.observe(&stated(4_000, 10), &a, &RULE, 300);
    assert_eq!(q.tokens_left(300), Some(2_900));
}

/// The count stands when it lies between the reconciled count and the statement (it has given
/// back what the picks since that have settled overshot); and a mark is used only in its own
/// window, with no fresher statement merged: else the statement only lowers, as before.
#[test]
fn reconciling_keeps_settled_overshoot_and_needs_a_mark_of_this_window() {
    let (mut q, stated) = reconcile_setup();
    let a = q.consume(1_100, 10); // long answer
    q.consume(1_100, 20); // short answer, settled first
    q.settle(1_100, 1_000, 20, 200);
    assert_eq!(q.tokens_left(200), Some(7_900));
    q.settle(1_100, 1_000, 10, 900);
    // Reconciled: 9 000 − 1 100 = 7 900 < the count's 8 000, which stands.
    q.observe(&stated(9_000, 10), &a, &RULE, 900);
    assert_eq!(q.tokens_left(900), Some(8_000));
    // A mark of the window before: not reconciled (the picks counted restarted at the reset).
    let (mut q, stated) = reconcile_setup();
    let old_window = q.consume(3_000, 3_900);
    q.consume(500, 4_100); // assumed back at 10 000: 9 500
    let late = |left| QuotaHint {
        at_ms: Some(4_050),
        ..stated(left, 0)
    };
    let mut hint = late(9_900);
    if let Some(t) = hint.tokens.as_mut() {
        t.reset_in_ms = Some(3_950);
    }
    q.observe(&hint, &old_window, &RULE, 4_200);
    assert_eq!(q.tokens_left(4_200), Some(9_500));
    // A statement older than one already merged: only lowers.
    let (mut q, stated) = reconcile_setup();
    let first = q.consume(1_000, 10);
    let second = q.consume(1_000, 20);
    q.consume(3_000, 30);
    q.observe(&stated(8_000, 20), &second, &RULE, 100);
    assert_eq!(q.tokens_left(100), Some(5_000));
    q.observe(&stated(9_000, 10), &first, &RULE, 150);
    assert_eq!(q.tokens_left(150), Some(5_000));
}

/// Placement weights by stated limits, with worked numbers: the ratio to the largest stated
/// limit among the candidates, per family (the smaller ratio), rounded up to a level
/// `2^(-k/2)`, at least the floor; no limit stated, the weight stands.
#[test]
fn weights_follow_the_stated_limits_in_levels_down_to_the_floor() {
    let mut w = vec![
        (0, 10, 1.0),
        (1, 11, 1.0),
        (2, 12, 2.0),
        (3, 13, 1.0),
        (4, 14, 1.0),
    ];
    // a: 400 000 tokens; b: 60 000 (0.15, rounded up to 2^-2.5 = 0.177); c: nothing stated;
    // d: 1 000 (0.0025, the floor); e: tokens at the largest, but 10 of 100 requests (0.1 →
    // 2^-3 = 0.125); a key with 80 % of the largest limit weighs 1 (0.8 > 2^-0.5).
    let limits = |i: usize| match i {
        0 => (100, 400_000),
        1 => (0, 60_000),
        3 => (0, 1_000),
        4 => (10, 400_000),
        5 => (0, 320_000),
        _ => (0, 0),
    };
    w.push((5, 15, 1.0));
    let w = weigh_by_limits(&w, limits).unwrap();
    let got: Vec<String> = w.iter().map(|x| format!("{:.4}", x.2)).collect();
    assert_eq!(
        got,
        vec!["1.0000", "0.1768", "2.0000", "0.1250", "0.1250", "1.0000"]
    );
    assert_eq!(w[3].2, LIMIT_WEIGHT_FLOOR);
    // Nothing stated anywhere, or equal limits: nothing changes.
    let same = vec![(0, 10, 1.0), (1, 11, 3.0)];
    assert_eq!(weigh_by_limits(&same, |_| (0, 5_000)), None);
    assert_eq!(weigh_by_limits(&same, |_| (0, 0)), None);
    // A stated limit of 0 is not a limit to compare with.
    // Over `LIMIT_WEIGHT_MAX_CANDIDATES` candidates: skipped (its cost).
    let many: Vec<(usize, u32, f64)> = (0..=LIMIT_WEIGHT_MAX_CANDIDATES)
        .map(|i| (i, i as u32, 1.0))
        .collect();
    assert_eq!(weigh_by_limits(&many, |i| (0, 1_000 + i as u64)), None);
    assert!(weigh_by_limits(&many[1..], |i| (0, 1_000 + i as u64)).is_some());
    let zero = vec![(0, 10, 1.0), (1, 11, 1.0)];
    assert_eq!(
        weigh_by_limits(&zero, |i| (0, if i == 0 { 0 } else { 50 })),
        None
    );
}

/// The quota bench, one Envoy (`quota6-2`): late in a window a small key (`d`, a fifth
/// of the others' limit) took 22 new sessions as a backup while its own use was light, ran dry
/// in the next window (each of those sessions spent about four times its first turn there),
/// and 23 follow-ups moved. With the new sessions' growth counted
/// ([`Remaining::growth`]), pacing closes the key while the next window still holds them; off,
/// it takes 30 and runs dry.
#[test]
fn new_sessions_placed_late_in_a_window_count_for_the_next() {
    let rule = QuotaRule {
        reserve_percent: 50,
        ..RULE
    };
    // Window [8 000, 12 000) of a key of 80 000 tokens with 4 s windows: the window before
    // used 20 000, this one 15 000 by 11 500 (the answer stating it was sent then).
    // `own`: what this replica picked of the window's 15 000 (the rest: other replicas').
    // `growth` false: the placements are not told to the key (`Quota::place`), as if their
    // growth did not count.
    let placed_until_short = |growth: bool, own: u64| {
        let r = rule;
        let mut q = Quota::default();
        let stated = |left: u64, sent: u64, reset_in: u64| QuotaHint {
            requests: None,
            tokens: Some(Stated {
                left,
                reset_in_ms: Some(reset_in),
                limit: Some(80_000),
            }),
            at_ms: Some(sent),
        };
        q.observe(&stated(80_000, 4_000, 4_000), &NO_MARK, &r, 4_000);
        q.observe(&stated(60_000, 7_900, 100), &NO_MARK, &r, 7_900);
        q.consume(own, 8_100);
        q.observe(&stated(65_000, 11_500, 500), &NO_MARK, &r, 11_500);
        assert_eq!(q.tokens.map(|t| t.prev_used), Some(20_000));
        let mut n = 0u64;
        // New sessions whose first turns are estimated at 650 tokens each, 5 ms apart.
        while n < 60 && !q.short(650, &r, 11_500 + n * 5) {
            q.consume(650, 11_500 + n * 5);
            if growth {
                q.place(650, &mut QuotaMark::default(), 11_500 + n * 5);
            }
            n += 1;
        }
        n
    };
    let (on, off) = (
        placed_until_short(true, 15_000),
        placed_until_short(false, 15_000),
    );
    // Next window: the sessions pinned before spend about what they did in this one (15 000),
    // each new one about 2 800 (4.3 × its first turn). The key's 80 000 hold 23 new ones.
    let next_window = |n: u64| 15_000 + n * 2_800;
    assert!(
        next_window(on) <= 80_000 - 80_000 / 4,
        "with growth: {on} placed"
    );
    assert!(on >= 5, "the key still takes new sessions: {on}");
    assert!(
        next_window(off) > 80_000,
        "without it the key runs dry: {off} placed"
    );
    // One of three replicas (it picked a third of the key's use): each of its placements
    // stands for more than one (the key's use over its picks, 3 at first), so it closes the
    // key sooner than a lone Envoy (counting only its own, it placed as many: 9 each).
    let third = placed_until_short(true, 5_000);
    assert!(third >= 3 && third <= on * 2 / 3, "{third} of {on}");
    // The growth is per window: forgotten at the reset (the sessions' use counts then).
    let mut q = Quota::default();
    let r = rule;
    q.observe(
        &QuotaHint {
            requests: None,
            tokens: Some(Stated {
                left: 80_000,
                reset_in_ms: Some(500),
                limit: Some(80_000),
            }),
            at_ms: Some(11_500),
        },
        &NO_MARK,
        &r,
        11_500,
    );
    q.place(650, &mut QuotaMark::default(), 11_600);
    assert_eq!(q.tokens.map(Remaining::growth), Some(1_950));
    assert_eq!(
        q.tokens
            .and_then(|t| t.current(12_100))
            .map(Remaining::growth),
        Some(0)
    );
    // Headroom: the limit less the forecast (no reserve), negative when over.
    assert_eq!(q.headroom(11_600), Some(80_000 - 1_950));
    assert_eq!(Quota::default().headroom(11_600), None);
}

/// A key stating 50 000 of 50 000 tokens left, window 60 s from `at`.
fn fresh_key(at: u64) -> Quota {
    let mut q = Quota::default();
    q.observe(
        &QuotaHint {
            requests: None,
            tokens: Some(Stated {
                left: 50_000,
                reset_in_ms: Some(60_000),
                limit: Some(50_000),
            }),
            at_ms: Some(at),
        },
        &NO_MARK,
        &RULE,
        at,
    );
    q
}

/// A request of 10 000 000 `max_tokens` is charged at most the key's limit,
/// and a refusal (a provider's 400, a 5xx, a client gone) gives it all back, placements
/// included: the key is as it was, and a pinned turn of 1 000 tokens is not a certain 429.
#[test]
fn an_unserved_attempt_gives_its_estimate_back() {
    let mut q = fresh_key(1_000);
    let before = q;
    // Charged the limit, not ten million: the key's window cannot hold more.
    assert!(!q.certain_429(10_000_000, 1_100));
    let mut mark = q.consume(10_000_000, 1_100);
    q.place(10_000_000, &mut mark, 1_100);
    assert_eq!((mark.taken, mark.placed), (50_000, 50_000));
    assert_eq!(q.tokens_left(1_100), Some(0));
    assert!(q.certain_429(1_000, 1_150), "drained while in flight");
    q.give_back(&mark, 1_100, 1_200);
    assert_eq!(q.tokens_left(1_200), Some(50_000));
    assert!(!q.certain_429(1_000, 1_200));
    let t = q.tokens.unwrap();
    assert_eq!((t.picked, t.placed), (0, 0));
    assert_eq!(q.tokens.map(|t| t.left), before.tokens.map(|t| t.left));
    // Given back once only in effect: never past the limit.
    q.give_back(&mark, 1_100, 1_300);
    assert_eq!(q.tokens_left(1_300), Some(50_000));
    // Not when a statement about a later request was merged since (it counts what the key
    // really had), nor into a later window.
    let mut q = fresh_key(1_000);
    let mark = q.consume(2_000, 1_100);
    q.observe(
        &QuotaHint {
            requests: None,
            tokens: Some(Stated {
                left: 45_000,
                reset_in_ms: Some(59_000),
                limit: Some(50_000),
            }),
            at_ms: Some(1_500),
        },
        &NO_MARK,
        &RULE,
        1_600,
    );
    let left = q.tokens_left(1_700);
    q.give_back(&mark, 1_100, 1_700);
    assert_eq!(q.tokens_left(1_700), left);
}

/// A new session's placement counts what its first turn spent (the
/// answer's `usage`), not its whole `max_tokens`: one large valid `max_tokens` no longer
/// closes a small key to new sessions for its window.
#[test]
fn a_placement_counts_what_the_turn_spent() {
    let mut q = fresh_key(1_000);
    let mut mark = q.consume(40_000, 1_100);
    q.place(40_000, &mut mark, 1_100);
    assert_eq!(q.tokens.map(|t| t.placed), Some(40_000));
    q.settle_pick(&mark, 700, 1_100, 2_000);
    assert_eq!(q.tokens.map(|t| t.placed), Some(700));
    assert_eq!(q.tokens_left(2_000), Some(49_300));
}
