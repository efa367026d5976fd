//! Slowness: how long an endpoint takes *for the work it was given*, compared with its peers.
//! (Over 600 lines with its unit tests: the work model and the per-endpoint slowness share one codec and one set of worked examples; the code itself is about 620 lines with the running-stream pace.)
//!
//! Why: a raw latency estimate mixes unlike samples. A plain (non-streamed) answer's latency is
//! its whole generation; a streamed one's is its first token; both grow with the uncached part
//! of the prompt, and a plain one with its completion. On a healthy endpoint consecutive raw
//! samples differ by 10–25×, so any rule comparing raw estimates ("3× the fastest") fires in
//! steady state and breaks sessions away from the endpoint that holds their cache.
//! Judging each sample against the work it asked for removes most of that spread.
//!
//! **The work model** ([`WorkModel`], one per model group, fitted from every endpoint's
//! samples): the time a request should take on a typical endpoint of the group,
//!
//! ```text
//! streamed (observed = time to first byte):  expected = base + prefill · uncached
//! plain    (observed = time to last byte):   expected = base + prefill · uncached
//!                                                       + decode · completion
//! uncached = prompt − cached tokens (from the answer's `usage`)
//! ```
//!
//! fitted online by exponentially forgetting weighted least squares on the features
//! `[1, uncached, completion if plain]`, with non-negative coefficients and a small ridge pull
//! toward a prior (so that a term with no recent samples, e.g. decode while every answer is
//! streamed, keeps a sane value). Each sample weighs `(1 s / expected)²`, so the fit minimises
//! *relative* errors, which is what a ratio is judged on (on the synthetic fleet an unweighted
//! fit measured the same; the weighting guards against a few long generations dominating when
//! the linear model fits less well). The model keeps only its weighted sums (`Σ w·x·xᵀ`,
//! `Σ w·x·y`, forgotten by [`FORGET`] per sample) and the solution: a fixed-width value for
//! shared data. Samples whose tokens were estimated (no `usage`: prompt from body bytes / 4,
//! nothing cached) do not teach the model, since the cached share they omit is exactly what the
//! model must separate. Feed it only the samples of endpoints not degraded, so that a slow
//! endpoint does not drag the yardstick. A stream's decode phase is judged as soon as the
//! group's decode rate is measured ([`WorkModel::decode_judged`]: what it is judged against),
//! a queue-prone time once the whole fit has [`MODEL_WARM_SAMPLES`] answers.
//!
//! **Slowness** ([`Slowness`], one per endpoint): an EWMA in the log domain of
//! `observed / expected` (α = [`ALPHA`]), so that 2× and ½× weigh alike, with its mean
//! deviation — fed only by what a queue cannot touch. A stream's first byte and a plain
//! answer's end both wait for a slot and for the engine's serialized prefills: on the
//! engine-like bench they read a loaded healthy endpoint as 2–4× "slower" than its peers
//! (first byte ÷ expected p10/p90 up to 1.1/13), and the degraded rule broke pins in
//! steady traffic. A stream's **decode phase** (first byte to last, against the group's fitted
//! decode time per token, [`WorkModel::stream_decode_ms_per_token`]) happens once the engine
//! runs the request: p10/p90 0.86–1.22 on every endpoint of the same runs. So a stream with
//! `usage` and at least [`MIN_DECODE_TOKENS`] decode tokens is judged by its decode phase; a
//! *queue-prone* time (a plain answer, a stream's first byte without a judged decode phase)
//! counts only on an endpoint without a judged stream for [`DECODE_FRESH_MS`], and then as a
//! **low envelope** — a sample below the estimate moves it at α, one above at
//! [`QUEUE_ALPHA_UP`]: waiting only adds time, so the estimate settles near the lower quartile
//! of its ratios, the endpoint when it did not wait. One sample moves the log-mean by at most
//! `α · ln`[`CLAMP_RATIO`] (an outlier such as a 10 s stall shifts the estimate by ×1.4, or
//! ×1.12 if queue-prone), yet a real 5× slowdown is reflected after four streams (twelve plain
//! answers). The model is a common yardstick, so its absolute calibration cancels out: what is
//! judged is an endpoint's slowness over its peers'.
//!
//! **A running stream's pace** ([`WorkModel::pace_ratio`], [`Slowness::observe_pace`]): a
//! stream is judged when it ends, and on an endpoint turned 5× slower its streams last 3–7 s,
//! so the four slow samples the estimate needs came 5 s after the onset on the bench's `slow`
//! run, and every turn sent there meanwhile paid the slowdown. So a stream is also judged
//! while it runs, at doubling sizes of what it relayed after its first chunk (from
//! [`PACE_FIRST_CHECK_BYTES`]): its tokens so far are estimated from those bytes with the
//! group's mean tokens per byte (learned from finished streams with `usage`), *over*-estimated
//! by [`PACE_TOKEN_MARGIN`] — too many tokens read the pace as fast, the safe error; counting
//! `data:` events would read every chunk, and counting chunks undercounts when Envoy coalesces
//! them — and its time since the first byte is compared with what those tokens take at the
//! group's decode rate. A pace that has reached `pin_break_ratio` × the median slowness of the
//! endpoint's peers (the degraded rule's threshold) is folded in as that stream's decode-phase
//! sample, and its end is not judged again (one sample per stream); a
//! faster one is left to its end. Only a pace that alone says "degraded" is folded early: a
//! lower bar (2× the group's rate was tried) also folded the streams of a healthy peer that
//! took the slowed endpoint's sessions (its batches stretch decode), which raised the peers'
//! median and delayed the verdict (docs/adr/0009-judging-endpoints-by-their-work.md).
//!
//! **Degraded** ([`degraded`]): a warm endpoint (at least `min_samples` answers judged — folded,
//! or queue-prone and skipped because its streams judge it; cold endpoints never are) whose slowness reaches `ratio` × the median slowness of its warm peers serving
//! the same model *and* whose excess costs at least `min_extra_ms` per request (its smoothed
//! expected time × the slowness gap: a ratio of small numbers is noise). Hysteresis: it stays
//! degraded until it falls below `exit_ratio` × the peers' median or within half of
//! `min_extra_ms`. The median, not the best, of the peers: the best of several noisy estimates
//! is biased low, and one lucky peer would make every other endpoint look slow.
//!
//! **The engine's own decode pace comes first where it is published** ([`pace_degraded`],
//! called by `signals::judge_with`). Everything above is learned from this Envoy process's own
//! answers: with three replicas each sees a third of them and needs three times as long to be
//! convinced, and the requests a slowed engine serves meanwhile are the slow run's p99 (2.13×
//! steady with one Envoy, 3.57× with three). Self-hosted engines publish their decode time as
//! cumulative counters; the scraper turns them into the pace of the last window of at least
//! `scrape::PACE_MIN_TOKENS` tokens (`scrape.rs`), which every replica derives alike from all
//! of the engine's traffic. Where an endpoint and at least one of its peers have a fresh pace,
//! the degraded rule is taken on own pace ÷ the peers' median pace with the same thresholds
//! (`ratio`, `exit_ratio`, and `min_extra_ms` on a typical answer of [`PACE_ANSWER_TOKENS`]) —
//! as the primary signal, not folded into this EWMA, which would bring back the per-replica
//! history and the α-paced onset it replaces. The batch stretches a healthy engine's decode by
//! at most 1.75× (the bench's 16 slots): far from 3×. Endpoints without a pace (hosted keys,
//! TGI, a failed or stale scrape, a restarted engine before its first window) keep the
//! slowness below.
//!
//! Measured (`tests/props/slowness_props.rs`, a synthetic fleet of 4 engines, half the answers
//! streamed, prompts 200–8000 tokens 0–95 % cached, 16–512 output tokens, batch stretch and a
//! 0–300 ms queue; `--nocapture` prints the figures): a healthy endpoint's slowness has p5/p50/
//! p95 0.88/0.99/1.10, the judged ratio (own ÷ peers' median) 0.87/1.00/1.15 with a maximum of
//! 1.37 over 5000 answers, and no endpoint is ever degraded at ratio 3 — where the raw EWMA rule
//! (ratio to the fastest p95 2.7, max 4.9–6.4) enters the degraded state about 320 times in
//! 20 000 answers. With two of the four engines busy (an exponential 2 s queue, full batches)
//! their judged ratio is 1.06/1.16/1.29 (max 1.45), never degraded; the raw rule has one
//! degraded 97 % of the time. An endpoint turned 5× slower is degraded after 12–17 of its
//! answers (half of them streams).

use crate::scheduler::config::Config;
use crate::scheduler::state::codec::{Reader, Writer};

/// Gain of each sample in an endpoint's log-slowness.
pub const ALPHA: f64 = 0.3;

/// Gain of the mean deviation of the log-slowness (TCP's β, as `ewma::DEVIATION_ALPHA`).
pub const DEVIATION_ALPHA: f64 = 0.25;

/// A sample's ratio is clamped to within this factor of the current estimate before it is
/// folded in (robustness against one stall; a sustained change still converges).
pub const CLAMP_RATIO: f64 = 3.0;

/// Per-sample forgetting factor of the work model: its memory is about `1 / (1 − FORGET)` =
/// 200 samples of the whole group.
pub const FORGET: f64 = 0.995;

/// The ridge pull toward [`PRIOR`], in sample-equivalents per coefficient.
pub const RIDGE: f64 = 0.5;

/// Measured samples the work model needs before slowness is judged against it.
pub const MODEL_WARM_SAMPLES: u32 = 32;

/// Gain of a *queue-prone* sample (a plain answer's total time, a stream's first byte) that is
/// above the current estimate; one below it moves the estimate by [`ALPHA`]. Waiting in an
/// engine's queue only ever adds time, so the low envelope of these samples is what measures
/// the endpoint's speed: with gains 0.1 up and 0.3 down the estimate settles near the lower
/// quartile of the sample ratios, whatever the queue adds above it (see the module doc).
pub const QUEUE_ALPHA_UP: f64 = 0.1;

/// How long an endpoint's last judged decode phase keeps it judged by its streams only: its
/// queue-prone samples (plain answers, first bytes) are not counted meanwhile.
pub const DECODE_FRESH_MS: u64 = 60_000;

/// Decode tokens a stream needs (after its first) for its decode phase to be judged: shorter
/// phases are a few chunks, dominated by network and scheduling noise.
pub const MIN_DECODE_TOKENS: u64 = 16;

/// Decode tokens (forgotten like the work model) the model's stream decode rate needs before it
/// is used; before, the fitted decode coefficient of plain answers stands in.
const DECODE_WARM_TOKENS: f64 = 256.0;

/// A running stream is judged by its pace ([`WorkModel::pace_ratio`]) once its relayed bytes
/// stand for at least this many (over-estimated) tokens.
pub const PACE_MIN_TOKENS: f64 = 32.0;

/// A running stream's pace is first checked once this many bytes were relayed after its first
/// chunk, then at every doubling (a few checks per stream, whatever its length). The bench's
/// streams relay about 54 bytes per token after their first chunk (38 tokens here, 46 with the
/// margin); events of ~170 bytes reach [`PACE_MIN_TOKENS`] at the third check (8 KiB). A
/// first check at 6 KiB came 115 tokens into the bench's streams: most were never checked.
pub const PACE_FIRST_CHECK_BYTES: u64 = 2048;

/// The factor by which a running stream's tokens are over-estimated from its bytes: events
/// vary in size around the group's mean, and a pace that reads too fast is the safe error.
pub const PACE_TOKEN_MARGIN: f64 = 1.2;

/// A running stream's pace is folded in once it reaches `pin_break_ratio` × its endpoint's
/// peers' median slowness (the degraded rule's own threshold, see `select::judge_pace`); a pace
/// below this share of `pin_break_ratio` is not compared with the peers at all (no table read):
/// a peers' median below one half would be no fleet's.
pub const PACE_PEERS_FLOOR: f64 = 0.5;

/// Times below this are treated as equal (network noise), as `score::LATENCY_FLOOR_MS`.
pub const FLOOR_MS: f64 = 10.0;

/// Feature scales: coefficients are fitted per 1000 uncached tokens and per 100 completion
/// tokens, so the three are of comparable size (a well-conditioned 3×3 system).
const PREFILL_UNIT: f64 = 1000.0;
const DECODE_UNIT: f64 = 100.0;
/// Sample weight `(REF_MS / expected)²`.
const REF_MS: f64 = 1000.0;

/// The model before any sample: base 50 ms, prefill 0.2 ms and decode 10 ms per token (in the
/// fitted units: per sample, per 1000 uncached, per 100 completion tokens).
pub const PRIOR: [f64; 3] = [50.0, 0.2 * PREFILL_UNIT, 10.0 * DECODE_UNIT];

/// One finished answer, as the slowness model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Streamed answers are timed to their first byte, plain ones to their last.
    pub streamed: bool,
    /// Time to first byte (streamed) or to the last byte (plain), in ms.
    pub observed_ms: f64,
    pub prompt_tokens: u64,
    /// Prompt tokens the endpoint had cached (`<= prompt_tokens`; 0 when estimated).
    pub cached_tokens: u64,
    /// Completion tokens (only used for plain answers).
    pub completion_tokens: u64,
    /// The tokens were estimated (no `usage`): the sample is judged but does not teach the
    /// work model.
    pub estimated: bool,
    /// A stream's decode phase: from its first byte to its last, in ms (`None` for a plain
    /// answer, or a stream whose end was not timed).
    pub decode_ms: Option<f64>,
}

impl Sample {
    /// Prompt tokens the endpoint had to compute.
    pub fn uncached(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }

    /// A sample without `usage`: prompt tokens from the request body (bytes / 4, nothing
    /// cached), completion tokens from the relayed answer bytes (bytes / 4).
    pub fn estimated(
        streamed: bool,
        observed_ms: f64,
        body_bytes: u64,
        relayed_bytes: u64,
    ) -> Self {
        Sample {
            streamed,
            observed_ms,
            prompt_tokens: body_bytes / 4,
            cached_tokens: 0,
            completion_tokens: relayed_bytes / 4,
            estimated: true,
            decode_ms: None,
        }
    }

    /// The stream's decode phase, `(ms, tokens after the first)`, when it is long enough to
    /// judge: measured tokens (from `usage`), at least [`MIN_DECODE_TOKENS`] of them, and at
    /// least [`FLOOR_MS`] long.
    pub fn decode_phase(&self) -> Option<(f64, f64)> {
        let ms = self
            .decode_ms
            .filter(|_| self.streamed && !self.estimated)?;
        let tokens = self.completion_tokens.saturating_sub(1);
        (ms.is_finite() && ms >= FLOOR_MS && tokens >= MIN_DECODE_TOKENS)
            .then_some((ms.min(3_600_000.0), tokens as f64))
    }

    /// The fitted features `[1, uncached / 1000, completion / 100 if plain]`.
    fn features(&self) -> [f64; 3] {
        let completion = if self.streamed {
            0.0
        } else {
            self.completion_tokens as f64
        };
        [
            1.0,
            self.uncached() as f64 / PREFILL_UNIT,
            completion / DECODE_UNIT,
        ]
    }

    fn usable(&self) -> bool {
        self.observed_ms.is_finite() && self.observed_ms >= 0.0
    }
}

/// The fleet-wide work model of one model group (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkModel {
    /// `Σ w·x·xᵀ`, upper triangle: (0,0) (0,1) (0,2) (1,1) (1,2) (2,2).
    xx: [f64; 6],
    /// `Σ w·x·y`.
    xy: [f64; 3],
    /// The current solution: base ms, ms per 1000 uncached, ms per 100 completion tokens.
    theta: [f64; 3],
    /// Measured samples folded in (saturating).
    pub samples: u32,
    /// Streams' decode phases: `Σ ms` and `Σ tokens` after the first, forgotten by [`FORGET`]
    /// per stream; their ratio is the group's decode time per token once the engine runs the
    /// request (no queue, no prefill in it).
    stream_decode: [f64; 2],
    /// The same streams' decode phases as relayed bytes: `Σ tokens` after the first and
    /// `Σ bytes` after the first chunk, forgotten together by [`FORGET`] per stream; their
    /// ratio turns a running stream's relayed bytes into tokens ([`WorkModel::pace_ratio`]).
    stream_bytes: [f64; 2],
}

impl Default for WorkModel {
    fn default() -> Self {
        WorkModel {
            xx: [0.0; 6],
            xy: [0.0; 3],
            theta: PRIOR,
            samples: 0,
            stream_decode: [0.0; 2],
            stream_bytes: [0.0; 2],
        }
    }
}

const MODEL_VERSION: u8 = 3;
const SLOWNESS_VERSION: u8 = 2;

impl WorkModel {
    /// Bytes of [`WorkModel::encode_into`] (without version byte).
    pub const BYTES: usize = 16 * 8 + 4;

    /// Fixed overhead per request, ms (queueing and network included).
    pub fn base_ms(&self) -> f64 {
        self.theta[0]
    }
    /// Prefill cost, ms per uncached prompt token.
    pub fn prefill_ms_per_token(&self) -> f64 {
        self.theta[1] / PREFILL_UNIT
    }
    /// Decode cost, ms per completion token.
    pub fn decode_ms_per_token(&self) -> f64 {
        self.theta[2] / DECODE_UNIT
    }

    /// A stream's decode time per token after its first, ms: fitted from streams' decode
    /// phases, or the plain answers' decode coefficient until enough were seen.
    pub fn stream_decode_ms_per_token(&self) -> f64 {
        let [ms, tokens] = self.stream_decode;
        if tokens >= DECODE_WARM_TOKENS && ms > 0.0 {
            ms / tokens
        } else {
            self.decode_ms_per_token()
        }
    }

    /// What `s`'s decode phase should take on a typical endpoint of the group, ms (`None`
    /// when `s` has no judged decode phase).
    pub fn expected_decode_ms(&self, s: &Sample) -> Option<f64> {
        let (_, tokens) = s.decode_phase()?;
        let e = self.stream_decode_ms_per_token() * tokens;
        (e.is_finite() && e > 0.0).then(|| e.max(FLOOR_MS))
    }

    /// Folds in the relayed size of `s`'s decode phase (bytes after its first chunk), which
    /// calibrates [`WorkModel::pace_ratio`]; ignored unless `s` has a judged decode phase.
    pub fn observe_decode_bytes(&mut self, s: &Sample, bytes: u64) {
        let Some((_, tokens)) = s.decode_phase().filter(|_| bytes > 0) else {
            return;
        };
        let [acc_tokens, acc_bytes] = &mut self.stream_bytes;
        *acc_tokens = FORGET * *acc_tokens + tokens;
        *acc_bytes = FORGET * *acc_bytes + (bytes as f64).min(1e9);
    }

    /// The pace of a stream still running, against the group's: its decode phase so far
    /// (`decode_ms` since its first byte, `decode_bytes` relayed after its first chunk) ÷ what
    /// the tokens in those bytes should take. The tokens are *over*estimated
    /// ([`PACE_TOKEN_MARGIN`] above the group's mean tokens per byte), so the pace reads fast
    /// rather than slow. `None` while the model is cold for decode phases
    /// ([`WorkModel::decode_judged`]), before [`DECODE_WARM_TOKENS`] of streams calibrated the
    /// bytes, or below [`PACE_MIN_TOKENS`].
    pub fn pace_ratio(&self, decode_ms: f64, decode_bytes: u64) -> Option<f64> {
        let [tokens, bytes] = self.stream_bytes;
        if !self.decode_judged()
            || tokens < DECODE_WARM_TOKENS
            || bytes <= 0.0
            || !decode_ms.is_finite()
        {
            return None;
        }
        let estimated = decode_bytes as f64 * tokens / bytes * PACE_TOKEN_MARGIN;
        if estimated < PACE_MIN_TOKENS {
            return None;
        }
        let expected = (self.stream_decode_ms_per_token() * estimated).max(FLOOR_MS);
        let ratio = decode_ms.max(FLOOR_MS) / expected;
        ratio.is_finite().then_some(ratio)
    }

    /// Whether slowness may be judged against this model yet.
    pub fn warm(&self) -> bool {
        self.samples >= MODEL_WARM_SAMPLES
    }

    /// Whether a stream's decode phase may be judged against this model: the whole model is
    /// warm, or its streams' decode rate alone is ([`DECODE_WARM_TOKENS`] measured), which is
    /// all that a decode phase is judged against ([`WorkModel::expected_decode_ms`]). The
    /// [`MODEL_WARM_SAMPLES`] answers the fit of base and prefill needs are counted on this
    /// Envoy's own traffic: with three replicas, each had them of a model with a quarter of
    /// the traffic only 22–30 s into the bench's `slow` run (one Envoy: 9 s), and every decode
    /// phase of the endpoint slowed at 12 s was dropped meanwhile, uncounted.
    pub fn decode_judged(&self) -> bool {
        let [ms, tokens] = self.stream_decode;
        self.warm() || (tokens >= DECODE_WARM_TOKENS && ms > 0.0)
    }

    /// What `s` should take on a typical endpoint of the group, ms (at least [`FLOOR_MS`]).
    pub fn expected_ms(&self, s: &Sample) -> f64 {
        let [a, b, c] = s.features();
        let [t0, t1, t2] = self.theta;
        let e = t0 * a + t1 * b + t2 * c;
        if e.is_finite() {
            e.max(FLOOR_MS)
        } else {
            FLOOR_MS
        }
    }

    /// Expected service time of a request of this size run to its end (prefill and decode),
    /// ms: what [`crate::scheduler::routing::judge::saturation::keep_pin`] uses as the mean service time.
    pub fn service_ms(&self, uncached_tokens: u64, completion_tokens: u64) -> f64 {
        self.expected_ms(&Sample {
            streamed: false,
            observed_ms: 0.0,
            prompt_tokens: uncached_tokens,
            cached_tokens: 0,
            completion_tokens,
            estimated: false,
            decode_ms: None,
        })
    }

    /// Folds in one sample and refits. Estimated samples and non-finite times are ignored
    /// (returns false).
    pub fn observe(&mut self, s: &Sample) -> bool {
        if s.estimated || !s.usable() {
            return false;
        }
        if let Some((ms, tokens)) = s.decode_phase() {
            let [acc_ms, acc_tokens] = &mut self.stream_decode;
            *acc_ms = FORGET * *acc_ms + ms;
            *acc_tokens = FORGET * *acc_tokens + tokens;
        }
        let x = s.features();
        let y = s.observed_ms.min(3_600_000.0);
        let w = (REF_MS / self.expected_ms(s)).powi(2);
        let [x0, x1, x2] = x;
        let outer = [x0 * x0, x0 * x1, x0 * x2, x1 * x1, x1 * x2, x2 * x2];
        for (acc, v) in self.xx.iter_mut().zip(outer) {
            *acc = FORGET * *acc + w * v;
        }
        for (acc, v) in self.xy.iter_mut().zip(x) {
            *acc = FORGET * *acc + w * v * y;
        }
        if let Some(t) = self.solve() {
            self.theta = t;
        }
        self.samples = self.samples.saturating_add(1);
        true
    }

    /// Non-negative ridge least squares: the best of the feasible solutions over every subset
    /// of free coefficients (the others held at 0); with three coefficients, eight 3×3 solves.
    fn solve(&self) -> Option<[f64; 3]> {
        let [s00, s01, s02, s11, s12, s22] = self.xx;
        let a = [
            [s00 + RIDGE, s01, s02],
            [s01, s11 + RIDGE, s12],
            [s02, s12, s22 + RIDGE],
        ];
        let [p0, p1, p2] = PRIOR;
        let [b0, b1, b2] = self.xy;
        let b = [b0 + RIDGE * p0, b1 + RIDGE * p1, b2 + RIDGE * p2];
        let mut best: Option<([f64; 3], f64)> = None;
        for mask in 0u8..8 {
            let free = [mask & 1 != 0, mask & 2 != 0, mask & 4 != 0];
            let Some(t) = solve_masked(&a, &b, free) else {
                continue;
            };
            if t.iter().any(|v| !v.is_finite() || *v < 0.0) {
                continue;
            }
            // Objective up to a constant: θᵀAθ − 2bᵀθ.
            let at = mul(&a, &t);
            let obj = dot(&t, &at) - 2.0 * dot(&b, &t);
            if best.is_none_or(|(_, o)| obj < o) {
                best = Some((t, obj));
            }
        }
        best.map(|(t, _)| t)
    }

    /// Appends the model without a version byte (for embedding in a versioned value).
    pub fn encode_into(&self, w: &mut Writer) {
        for v in self
            .xx
            .iter()
            .chain(&self.xy)
            .chain(&self.theta)
            .chain(&self.stream_decode)
            .chain(&self.stream_bytes)
        {
            w.f64(*v);
        }
        w.u32(self.samples);
    }

    /// Reads what [`WorkModel::encode_into`] wrote; `None` on anything implausible (non-finite
    /// or negative sums and coefficients).
    pub fn decode_from(r: &mut Reader) -> Option<WorkModel> {
        let mut m = WorkModel::default();
        for v in
            m.xx.iter_mut()
                .chain(m.xy.iter_mut())
                .chain(m.theta.iter_mut())
                .chain(m.stream_decode.iter_mut())
                .chain(m.stream_bytes.iter_mut())
        {
            *v = r.f64()?;
        }
        m.samples = r.u32()?;
        let [s00, _, _, s11, _, s22] = m.xx;
        if [s00, s11, s22]
            .iter()
            .chain(&m.theta)
            .chain(&m.stream_decode)
            .chain(&m.stream_bytes)
            .any(|v| *v < 0.0 || !v.is_finite())
        {
            return None;
        }
        Some(m)
    }

    /// The shared-data value: a version byte and [`WorkModel::BYTES`] bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(1 + Self::BYTES);
        w.u8(MODEL_VERSION);
        self.encode_into(&mut w);
        w.buf
    }

    /// `None` for anything but a complete value of this version.
    pub fn decode(bytes: &[u8]) -> Option<WorkModel> {
        let mut r = Reader::new(bytes);
        if r.u8()? != MODEL_VERSION {
            return None;
        }
        let m = WorkModel::decode_from(&mut r)?;
        r.is_empty().then_some(m)
    }
}

/// The smoothed slowness of one endpoint (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Slowness {
    /// EWMA of `ln(observed / expected)`.
    pub log_mean: f64,
    /// EWMA of `|ln(observed / expected) − log_mean|`.
    pub log_dev: f64,
    /// EWMA of the expected time of its samples, ms (what a slowness gap costs per request).
    pub expected_ms: f64,
    /// Answers judged (saturating): the samples folded in, and the queue-prone times of an
    /// endpoint judged by its streams, which are not folded but count toward its warm-up
    /// (`cold_start_samples`). Counting only folded samples made an endpoint with half its
    /// answers plain take twice as many answers to be judged: on the bench's `slow` run, whose
    /// slowdown starts at 3 s, the slowed endpoint became warm only at 6.8 s.
    pub samples: u32,
    /// When the last one arrived.
    pub last_sample_ms: u64,
    /// When the last judged decode phase arrived (0: never).
    pub last_decode_ms: u64,
    /// Judged degraded at the last evaluation (kept for the hysteresis).
    pub degraded: bool,
}

impl Slowness {
    /// Bytes of [`Slowness::encode_into`] (without version byte).
    pub const BYTES: usize = 3 * 8 + 4 + 8 + 8 + 1;

    /// `observed / expected`, smoothed: 1 for an endpoint as fast as the model, 5 for one 5×
    /// slower; `None` before the first sample.
    pub fn value(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.log_mean.exp())
    }

    /// Folds in `s`, judged against `model` (see the module doc): a stream's decode phase as
    /// a symmetric sample; a queue-prone time (a plain answer's whole time, a stream's first
    /// byte without a judged decode phase) as a low-envelope one, and only while the endpoint
    /// has had no decode phase for [`DECODE_FRESH_MS`] (its streams measure it better).
    /// A decode phase is judged once the model's decode rate is warm
    /// ([`WorkModel::decode_judged`]), a queue-prone time once the whole model is.
    /// Returns the sample's judged ratio, or `None` when it was not counted (a model cold for
    /// it, a non-finite time, a queue-prone time on an endpoint judged by its streams).
    pub fn observe(&mut self, s: &Sample, model: &WorkModel, now_ms: u64) -> Option<f64> {
        if !model.decode_judged() || !s.usable() {
            return None;
        }
        let expected = model.expected_ms(s);
        let decode = s
            .decode_phase()
            .zip(model.expected_decode_ms(s))
            .map(|((ms, _), e)| (ms.max(FLOOR_MS) / e).ln());
        let judged_by_streams = self.last_decode_ms > 0
            && now_ms.saturating_sub(self.last_decode_ms) <= DECODE_FRESH_MS;
        let (ln, alpha) = match decode {
            Some(ln) => {
                self.last_decode_ms = now_ms.max(1);
                (ln, ALPHA)
            }
            None if judged_by_streams => {
                // Not folded, but seen: the endpoint's answers make it warm (see `samples`).
                self.samples = self.samples.saturating_add(1);
                return None;
            }
            // A queue-prone time needs the whole fit (base and prefill): not counted.
            None if !model.warm() => return None,
            None => {
                let ln = (s.observed_ms.max(FLOOR_MS) / expected).ln();
                // Down at ALPHA, up at QUEUE_ALPHA_UP: the low envelope.
                (
                    ln,
                    if ln > self.log_mean {
                        QUEUE_ALPHA_UP
                    } else {
                        ALPHA
                    },
                )
            }
        };
        let judged = if self.samples == 0 {
            let clamp = CLAMP_RATIO.ln();
            self.log_mean = ln.clamp(-clamp, clamp);
            self.log_dev = 0.0;
            self.expected_ms = expected;
            self.log_mean
        } else {
            self.expected_ms = (1.0 - ALPHA) * self.expected_ms + ALPHA * expected;
            self.fold(ln, alpha)
        };
        self.samples = self.samples.saturating_add(1);
        self.last_sample_ms = now_ms;
        Some(judged.exp())
    }

    /// Folds in the pace of a stream still running (`ratio` from [`WorkModel::pace_ratio`]) as
    /// a decode-phase sample: the caller folds only a pace past the degraded threshold, and
    /// that stream's end is then not judged again (one sample per stream). A cold endpoint
    /// (no sample yet) is left to its answers. Returns the folded (clamped) ratio.
    pub fn observe_pace(&mut self, ratio: f64, now_ms: u64) -> Option<f64> {
        if self.samples == 0 || !ratio.is_finite() || ratio <= 0.0 {
            return None;
        }
        let judged = self.fold(ratio.ln(), ALPHA);
        self.last_decode_ms = now_ms.max(1);
        self.samples = self.samples.saturating_add(1);
        self.last_sample_ms = now_ms;
        Some(judged.exp())
    }

    /// Folds one log-ratio in at gain `alpha`, clamped to within [`CLAMP_RATIO`] of the
    /// estimate; returns the clamped log-ratio.
    fn fold(&mut self, ln: f64, alpha: f64) -> f64 {
        let clamp = CLAMP_RATIO.ln();
        let ln = ln.clamp(self.log_mean - clamp, self.log_mean + clamp);
        self.log_dev =
            (1.0 - DEVIATION_ALPHA) * self.log_dev + DEVIATION_ALPHA * (ln - self.log_mean).abs();
        self.log_mean = (1.0 - alpha) * self.log_mean + alpha * ln;
        ln
    }

    /// Appends the state without a version byte (for embedding in the endpoint table).
    pub fn encode_into(&self, w: &mut Writer) {
        w.f64(self.log_mean);
        w.f64(self.log_dev);
        w.f64(self.expected_ms);
        w.u32(self.samples);
        w.u64(self.last_sample_ms);
        w.u64(self.last_decode_ms);
        w.u8(u8::from(self.degraded));
    }

    /// Reads what [`Slowness::encode_into`] wrote; `None` on implausible values.
    pub fn decode_from(r: &mut Reader) -> Option<Slowness> {
        let s = Slowness {
            log_mean: r.f64()?,
            log_dev: r.f64()?,
            expected_ms: r.f64()?,
            samples: r.u32()?,
            last_sample_ms: r.u64()?,
            last_decode_ms: r.u64()?,
            degraded: match r.u8()? {
                0 => false,
                1 => true,
                _ => return None,
            },
        };
        // |ln| beyond 50 (e^50) or a negative deviation or expectation is corruption.
        let plausible =
            s.log_mean.abs() <= 50.0 && (0.0..=100.0).contains(&s.log_dev) && s.expected_ms >= 0.0;
        plausible.then_some(s)
    }

    /// The shared-data value: a version byte and [`Slowness::BYTES`] bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(1 + Self::BYTES);
        w.u8(SLOWNESS_VERSION);
        self.encode_into(&mut w);
        w.buf
    }

    /// `None` for anything but a complete value of this version.
    pub fn decode(bytes: &[u8]) -> Option<Slowness> {
        let mut r = Reader::new(bytes);
        if r.u8()? != SLOWNESS_VERSION {
            return None;
        }
        let s = Slowness::decode_from(&mut r)?;
        r.is_empty().then_some(s)
    }
}

/// The thresholds of the degraded rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DegradeRule {
    /// Enter at this multiple of the peers' median slowness (`pin_break_ratio`).
    pub ratio: f64,
    /// Leave below this multiple (`config::DEGRADED_EXIT_RATIO`, below `ratio`).
    pub exit_ratio: f64,
    /// Also needed: the gap costs this many ms per request ([`PIN_BREAK_MIN_MS`]; half to stay).
    pub min_extra_ms: f64,
    /// Samples an endpoint (and each peer counted) needs to be judged (`cold_start_samples`).
    pub min_samples: u32,
}

/// Also needed to degrade an endpoint: its slowness gap over its peers costs at least this
/// much per request (its typical expected time × the gap; leaving the degraded state needs it
/// below half of it). A ratio of small numbers is noise, and a few milliseconds a turn never
/// repay the re-prefill a moved session pays once. Not a key: the measured default.
pub const PIN_BREAK_MIN_MS: u64 = 50;

impl DegradeRule {
    /// The rule the configuration asks for, from the existing keys.
    pub fn from_config(cfg: &Config) -> DegradeRule {
        DegradeRule {
            ratio: cfg.pin_break_ratio,
            exit_ratio: crate::scheduler::config::DEGRADED_EXIT_RATIO,
            min_extra_ms: PIN_BREAK_MIN_MS as f64,
            min_samples: u32::try_from(cfg.cold_start_samples).unwrap_or(u32::MAX),
        }
    }
}

/// The median slowness of the warm peers (those with at least `min_samples` samples), the mean
/// of the two middle ones for an even count; `None` without a warm peer. The caller passes the
/// endpoints that serve the same model, without the one judged.
pub fn peer_median<'a>(
    peers: impl IntoIterator<Item = &'a Slowness>,
    min_samples: u32,
) -> Option<f64> {
    let mut v: Vec<f64> = peers
        .into_iter()
        .filter(|p| p.samples >= min_samples)
        .filter_map(Slowness::value)
        .filter(|x| x.is_finite())
        .collect();
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    let upper = *v.get(n / 2)?;
    if n.is_multiple_of(2) {
        Some((upper + v.get(n / 2 - 1).copied().unwrap_or(upper)) / 2.0)
    } else {
        Some(upper)
    }
}

/// The degraded rule with hysteresis (see the module doc): `own.degraded` is the previous
/// verdict, `reference` the peers' [`peer_median`]. Cold endpoints, and endpoints without a
/// warm peer, are never degraded. The caller stores the result in `own.degraded`.
pub fn degraded(own: &Slowness, reference: Option<f64>, rule: &DegradeRule) -> bool {
    let (Some(mine), Some(peers)) = (own.value(), reference) else {
        return false;
    };
    if own.samples < rule.min_samples || peers.is_nan() || peers <= 0.0 || !mine.is_finite() {
        return false;
    }
    let ratio = mine / peers;
    let extra_ms = (mine - peers) * own.expected_ms;
    if own.degraded {
        ratio >= rule.exit_ratio && extra_ms >= rule.min_extra_ms / 2.0
    } else {
        ratio >= rule.ratio && extra_ms >= rule.min_extra_ms
    }
}

/// Output tokens of a typical answer, for the cost of an engine pace gap in
/// [`pace_degraded`]: the median of the log-uniform 16–512 output lengths of the bench's
/// engines is about 90.
pub const PACE_ANSWER_TOKENS: f64 = 100.0;

/// The degraded rule on the engines' own decode pace (see the module doc): `mine_us` is the
/// endpoint's engine-reported decode time per token, `peers_us` its peers' median, `was` the
/// previous verdict. Enter at `ratio` × the peers' pace, stay until below `exit_ratio`, as
/// [`degraded`]; and the gap must cost `min_extra_ms` ([`PACE_ANSWER_TOKENS`] × the per-token
/// gap; half to stay), so that a 5× gap between engines that decode in microseconds does not
/// move sessions. No warm-up: every counted window already averages
/// `scrape::PACE_MIN_TOKENS` tokens or more.
pub fn pace_degraded(mine_us: f64, peers_us: f64, was: bool, rule: &DegradeRule) -> bool {
    if !mine_us.is_finite() || !peers_us.is_finite() || peers_us <= 0.0 {
        return false;
    }
    let ratio = mine_us / peers_us;
    let extra_ms = (mine_us - peers_us) / 1000.0 * PACE_ANSWER_TOKENS;
    if was {
        ratio >= rule.exit_ratio && extra_ms >= rule.min_extra_ms / 2.0
    } else {
        ratio >= rule.ratio && extra_ms >= rule.min_extra_ms
    }
}

mod solve;
use solve::{dot, mul, solve_masked};

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The pace rule with the default thresholds (enter 3×, leave below 1.5×, 50 ms): a
    /// batch-stretched healthy engine (1.75× its peers) is never degraded, a 5× slower one is,
    /// and stays until it is back under 1.5×; a large ratio of tiny paces costs nothing.
    #[test]
    fn pace_rule_thresholds_and_hysteresis() {
        let rule = DegradeRule {
            ratio: 3.0,
            exit_ratio: 1.5,
            min_extra_ms: 50.0,
            min_samples: 20,
        };
        assert!(!pace_degraded(3_500.0, 2_000.0, false, &rule));
        assert!(!pace_degraded(5_999.0, 2_000.0, false, &rule));
        assert!(pace_degraded(6_000.0, 2_000.0, false, &rule));
        assert!(pace_degraded(10_000.0, 2_000.0, false, &rule));
        // Hysteresis: 1.75× keeps it degraded, 1.45× releases it.
        assert!(pace_degraded(3_500.0, 2_000.0, true, &rule));
        assert!(!pace_degraded(2_900.0, 2_000.0, true, &rule));
        // 5× of 50 µs: 20 ms per answer, below 50 ms.
        assert!(!pace_degraded(250.0, 50.0, false, &rule));
        // 5× of 200 µs: 80 ms per answer.
        assert!(pace_degraded(1_000.0, 200.0, false, &rule));
        // Garbage never degrades.
        assert!(!pace_degraded(f64::NAN, 2_000.0, false, &rule));
        assert!(!pace_degraded(10_000.0, 0.0, false, &rule));
        assert!(!pace_degraded(f64::INFINITY, 2_000.0, true, &rule));
    }

    fn sample(
        streamed: bool,
        observed_ms: f64,
        prompt: u64,
        cached: u64,
        completion: u64,
    ) -> Sample {
        Sample {
            streamed,
            observed_ms,
            prompt_tokens: prompt,
            cached_tokens: cached,
            completion_tokens: completion,
            estimated: false,
            decode_ms: None,
        }
    }

    /// Exact data from base 40 ms, prefill 0.1 ms/token, decode 5 ms/token: the fit recovers
    /// the three costs (the ridge pull toward the prior costs decode 0.2 %).
    #[test]
    fn fit_recovers_exact_costs() {
        let mut m = WorkModel::default();
        for i in 0..400u64 {
            let prompt = 200 + (i * 7919) % 7800;
            let cached = prompt * ((i * 31) % 95) / 100;
            let completion = 16 + (i * 104_729) % 496;
            let streamed = i % 2 == 0;
            let mut ms = 40.0 + 0.1 * (prompt - cached) as f64;
            if !streamed {
                ms += 5.0 * completion as f64;
            }
            assert!(m.observe(&sample(streamed, ms, prompt, cached, completion)));
        }
        assert!((m.base_ms() - 40.0).abs() < 0.5, "{m:?}");
        assert!((m.prefill_ms_per_token() - 0.1).abs() < 0.001, "{m:?}");
        assert!((m.decode_ms_per_token() - 5.0).abs() < 0.05, "{m:?}");
        assert!(m.warm());
        // 1000 uncached, plain, 100 completion: 40 + 100 + 500.
        assert!((m.service_ms(1000, 100) - 640.0).abs() < 2.0);
    }

    /// Data that would need a negative base (a pure per-token cost, minus a constant) gets a
    /// base of exactly 0, not a negative one.
    #[test]
    fn coefficients_stay_non_negative() {
        let mut m = WorkModel::default();
        for i in 0..300u64 {
            let prompt = 1000 + (i * 37) % 5000;
            let ms = (0.2 * prompt as f64 - 150.0).max(0.0);
            m.observe(&sample(true, ms, prompt, 0, 0));
        }
        assert_eq!(m.base_ms(), 0.0, "{m:?}");
        assert!(m.prefill_ms_per_token() > 0.0);
        // Decode never seen: stays near the prior (pulled by the ridge only).
        assert!((m.decode_ms_per_token() - 10.0).abs() < 1e-6, "{m:?}");
    }

    #[test]
    fn estimated_samples_do_not_teach_the_model() {
        let mut m = WorkModel::default();
        let s = Sample::estimated(false, 900.0, 4000, 800);
        assert_eq!(
            (s.prompt_tokens, s.cached_tokens, s.completion_tokens),
            (1000, 0, 200)
        );
        assert!(!m.observe(&s));
        assert_eq!(m, WorkModel::default());
        assert!(!m.observe(&sample(true, f64::NAN, 1, 0, 0)));
    }

    fn warm_model() -> WorkModel {
        let mut m = WorkModel::default();
        for _ in 0..MODEL_WARM_SAMPLES {
            m.samples += 1;
        }
        m
    }

    /// A model that has measured its streams' decode rate (300 decode tokens, three
    /// answers) but not the 32 answers of a warm fit — what each of three replicas holds of a
    /// model with a quarter of the traffic long after one Envoy's is warm — judges decode
    /// phases and running streams' paces against that rate, and nothing else: a plain
    /// answer's time needs the fitted base and prefill. A model with neither judges nothing.
    #[test]
    fn decode_phases_are_judged_once_the_decode_rate_is_measured() {
        let stream = |decode_ms: f64| Sample {
            streamed: true,
            observed_ms: 100.0,
            prompt_tokens: 1000,
            cached_tokens: 800,
            completion_tokens: 101,
            estimated: false,
            decode_ms: Some(decode_ms),
        };
        let plain = sample(false, 900.0, 1000, 800, 100);
        let mut m = WorkModel::default();
        let mut cold = Slowness::default();
        assert_eq!(cold.observe(&stream(150.0), &m, 1), None);
        assert_eq!(m.pace_ratio(1_000.0, 10_000), None);
        for _ in 0..3 {
            assert!(m.observe(&stream(150.0)));
            m.observe_decode_bytes(&stream(150.0), 5_000);
        }
        assert!(!m.warm() && m.decode_judged(), "{m:?}");
        assert!((m.stream_decode_ms_per_token() - 1.5).abs() < 1e-9);

        // A plain answer on an endpoint without a judged stream: not counted.
        let mut s = Slowness::default();
        assert_eq!(s.observe(&plain, &m, 1), None);
        assert_eq!(s.samples, 0);
        // A decode phase 5× slower: judged (the first sample clamped to 3×), and counted.
        let r = s.observe(&stream(750.0), &m, 2).unwrap();
        assert!((r - 3.0).abs() < 1e-9, "{r}");
        assert_eq!(s.samples, 1);
        // Then the plain answer is seen (the endpoint is judged by its streams).
        assert_eq!(s.observe(&plain, &m, 3), None);
        assert_eq!(s.samples, 2);
        // A running stream 5× slower: 50 bytes a token, 100 tokens (120 with the margin) in
        // 750 ms against 180 ms.
        let pace = m.pace_ratio(750.0, 5_000).unwrap();
        assert!((pace - 750.0 / 180.0).abs() < 1e-9, "{pace}");
    }

    /// Worked numbers: the prior model expects 50 + 0.2 × 1000 = 250 ms of a streamed answer
    /// with 1000 uncached tokens. 500 ms → ratio 2, log 0.693; then 250 ms → log 0 pulls it
    /// to 0.7 × 0.693 = 0.485 (slowness 1.624), deviation 0.25 × 0.693 = 0.173.
    #[test]
    fn slowness_worked_example() {
        let m = warm_model();
        let s = sample(true, 500.0, 3000, 2000, 999);
        assert_eq!(m.expected_ms(&s), 250.0);
        let mut sl = Slowness::default();
        assert_eq!(sl.value(), None);
        assert!((sl.observe(&s, &m, 7).unwrap() - 2.0).abs() < 1e-12);
        assert!((sl.value().unwrap() - 2.0).abs() < 1e-12);
        sl.observe(&sample(true, 250.0, 3000, 2000, 999), &m, 9);
        assert!((sl.log_mean - 0.7 * 2f64.ln()).abs() < 1e-12);
        assert!((sl.value().unwrap() - 1.624_504_8).abs() < 1e-6, "{sl:?}");
        assert!((sl.log_dev - 0.25 * 2f64.ln()).abs() < 1e-12);
        assert_eq!((sl.samples, sl.last_sample_ms), (2, 9));
        // A cold model teaches nothing.
        let mut cold = Slowness::default();
        assert_eq!(cold.observe(&s, &WorkModel::default(), 1), None);
        assert_eq!(cold, Slowness::default());
    }

    /// A stream of `completion` tokens whose decode phase took `decode_ms`.
    fn stream(first_byte_ms: f64, completion: u64, decode_ms: f64) -> Sample {
        Sample {
            decode_ms: Some(decode_ms),
            ..sample(true, first_byte_ms, 1000, 0, completion)
        }
    }

    /// One queue-prone stall of 100× moves the estimate by at most ×3^0.1 = ×1.12, one
    /// decode-phase stall by ×3^0.3 = ×1.39.
    #[test]
    fn one_stall_moves_little() {
        let m = warm_model();
        let mut sl = Slowness::default();
        for _ in 0..10 {
            sl.observe(&sample(true, 250.0, 1000, 0, 0), &m, 0);
        }
        sl.observe(&sample(true, 25_000.0, 1000, 0, 0), &m, 0);
        assert!(
            (sl.value().unwrap() - 3f64.powf(QUEUE_ALPHA_UP)).abs() < 1e-9,
            "{sl:?}"
        );
        // The prior decodes a token in 10 ms: 100 tokens after the first in 1 s is 1×.
        let mut sl = Slowness::default();
        for _ in 0..10 {
            sl.observe(&stream(250.0, 101, 1000.0), &m, 0);
        }
        assert!((sl.value().unwrap() - 1.0).abs() < 1e-9, "{sl:?}");
        sl.observe(&stream(250.0, 101, 100_000.0), &m, 0);
        assert!(
            (sl.value().unwrap() - 3f64.powf(ALPHA)).abs() < 1e-9,
            "{sl:?}"
        );
        // Its plain answers, however slow, are not counted while its streams judge it.
        assert_eq!(
            sl.observe(&sample(false, 99_000.0, 1000, 0, 0), &m, 60_000),
            None
        );
        assert!(
            (sl.value().unwrap() - 3f64.powf(ALPHA)).abs() < 1e-9,
            "{sl:?}"
        );
        // Once its streams stop for longer than DECODE_FRESH_MS, they are.
        assert!(sl
            .observe(&sample(false, 99_000.0, 1000, 0, 0), &m, 60_002)
            .is_some());
    }

    /// Load is not slowness: queue-prone samples that wait 1–20× their work (an engine with a
    /// queue) barely move an endpoint whose streams decode at the model's pace, and even
    /// without streams the estimate stays near the low envelope of its samples.
    #[test]
    fn queueing_does_not_read_as_slowness() {
        let m = warm_model();
        let waits = [1.0, 3.0, 20.0, 1.5, 8.0, 1.0, 12.0, 2.0];
        let mut with_streams = Slowness::default();
        let mut plain_only = Slowness::default();
        for k in 0..400 {
            let w = waits[k % waits.len()];
            with_streams.observe(&stream(250.0 * w, 101, 1000.0), &m, 0);
            plain_only.observe(&sample(true, 250.0 * w, 1000, 0, 0), &m, 0);
        }
        let (a, b) = (with_streams.value().unwrap(), plain_only.value().unwrap());
        assert!(a < 1.6, "{with_streams:?}");
        assert!(b < 2.2, "{plain_only:?}");
    }

    /// A sustained 5× shows within 10 streams (their decode phases), and within 30 plain
    /// answers (the low envelope rises at QUEUE_ALPHA_UP); the degraded ratio 3 is crossed
    /// after 12 plain answers.
    #[test]
    fn sustained_slowness_is_reached() {
        let m = warm_model();
        let mut sl = Slowness::default();
        for _ in 0..10 {
            sl.observe(&stream(250.0, 101, 1000.0), &m, 0);
        }
        for _ in 0..10 {
            sl.observe(&stream(1250.0, 101, 5000.0), &m, 0);
        }
        assert!((sl.value().unwrap() / 5.0 - 1.0).abs() < 0.1, "{sl:?}");
        let mut sl = Slowness::default();
        for _ in 0..10 {
            sl.observe(&sample(false, 250.0, 1000, 0, 0), &m, 0);
        }
        let mut crossed = None;
        for k in 1..=30 {
            sl.observe(&sample(false, 1250.0, 1000, 0, 0), &m, 0);
            if crossed.is_none() && sl.value().unwrap() >= 3.0 {
                crossed = Some(k);
            }
        }
        assert_eq!(crossed, Some(12), "{sl:?}");
        assert!(sl.value().unwrap() > 4.5, "{sl:?}");
    }

    /// The stream decode rate: the plain answers' decode coefficient until 256 tokens of
    /// streams were seen, then `Σ ms / Σ tokens` of the decode phases.
    #[test]
    fn stream_decode_rate_is_fitted_from_decode_phases() {
        let mut m = WorkModel::default();
        assert_eq!(m.stream_decode_ms_per_token(), 10.0);
        // Too short to judge (15 tokens after the first): not taught.
        assert!(m.observe(&stream(100.0, 16, 60.0)));
        assert_eq!(m.stream_decode_ms_per_token(), 10.0);
        for _ in 0..3 {
            m.observe(&stream(100.0, 101, 200.0));
        }
        let r = m.stream_decode_ms_per_token();
        assert!((r - 2.0).abs() < 1e-9, "{r}");
        assert_eq!(m.expected_decode_ms(&stream(1.0, 51, 0.0)), None); // 0 ms: unjudged
        assert!((m.expected_decode_ms(&stream(1.0, 51, 99.0)).unwrap() - 100.0).abs() < 1e-9);
        // Round trip with the new sums.
        assert_eq!(WorkModel::decode(&m.encode()), Some(m));
    }

    /// A running stream's pace: bytes calibrated from finished streams (100 tokens in 17 000
    /// bytes: 170 per token), tokens over-estimated by the margin (6000 bytes → 35.3 × 1.2 =
    /// 42.4 tokens), judged against the group's decode rate (2 ms per token: 84.7 ms).
    #[test]
    fn running_pace_worked_example() {
        let mut m = warm_model();
        assert_eq!(m.pace_ratio(500.0, 6000), None); // bytes not calibrated yet
        for _ in 0..3 {
            let s = stream(100.0, 101, 200.0);
            m.observe(&s);
            m.observe_decode_bytes(&s, 17_000);
        }
        // A stream too short to judge calibrates nothing.
        m.observe_decode_bytes(&stream(100.0, 10, 20.0), 1);
        let expected = 6000.0 / 170.0 * PACE_TOKEN_MARGIN * 2.0;
        let r = m.pace_ratio(500.0, 6000).unwrap();
        assert!(
            (r - 500.0 / expected).abs() < 1e-9,
            "{r} vs {}",
            500.0 / expected
        );
        // Below PACE_MIN_TOKENS (4000 bytes: 28 tokens): not judged.
        assert_eq!(m.pace_ratio(500.0, 4000), None);
        assert_eq!(m.pace_ratio(f64::NAN, 6000), None);
        assert_eq!(WorkModel::decode(&m.encode()), Some(m));

        // Folded as a decode-phase sample: a cold endpoint is left to its answers; a warm one
        // moves at ALPHA and is judged by its streams from now on.
        let mut cold = Slowness::default();
        assert_eq!(cold.observe_pace(5.0, 10), None);
        assert_eq!(cold, Slowness::default());
        let mut sl = Slowness::default();
        for _ in 0..10 {
            sl.observe(&stream(250.0, 101, 200.0), &m, 0);
        }
        let before = sl.value().unwrap();
        assert!((before - 1.0).abs() < 1e-9, "{sl:?}");
        // 5× is clamped to CLAMP_RATIO × the estimate, like any sample.
        assert!((sl.observe_pace(5.0, 10).unwrap() - CLAMP_RATIO).abs() < 1e-9);
        let after = sl.value().unwrap();
        assert!((after - CLAMP_RATIO.powf(ALPHA)).abs() < 1e-9, "{sl:?}");
        assert_eq!((sl.samples, sl.last_decode_ms), (11, 10));
        assert_eq!(
            sl.observe(&sample(false, 99_000.0, 1000, 0, 0), &m, 20),
            None
        );
    }

    fn warm_at(value: f64, expected_ms: f64) -> Slowness {
        Slowness {
            log_mean: value.ln(),
            log_dev: 0.1,
            expected_ms,
            samples: 20,
            last_sample_ms: 0,
            last_decode_ms: 0,
            degraded: false,
        }
    }

    #[test]
    fn peer_median_of_warm_peers() {
        let peers = [warm_at(1.0, 1.0), warm_at(3.0, 1.0), warm_at(2.0, 1.0)];
        assert!((peer_median(&peers, 20).unwrap() - 2.0).abs() < 1e-12);
        assert!((peer_median(&peers[..2], 20).unwrap() - 2.0).abs() < 1e-12);
        let cold = Slowness {
            samples: 19,
            ..warm_at(100.0, 1.0)
        };
        assert!((peer_median([&peers[0], &cold], 20).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(peer_median([&cold], 20), None);
        assert_eq!(peer_median([], 0), None);
    }

    #[test]
    fn degraded_has_hysteresis_floor_and_ignores_cold() {
        let rule = DegradeRule::from_config(&Config::default()); // 3.0 / 1.5 / 50 ms / 20
        assert_eq!(
            (
                rule.ratio,
                rule.exit_ratio,
                rule.min_extra_ms,
                rule.min_samples
            ),
            (3.0, 1.5, 50.0, 20)
        );
        // 2.9x of the peers: not yet; 3x with 100 ms of expected work (200 ms extra): yes.
        // (Just above 3.0: the value goes through ln/exp, whose last bit differs between the
        // native libm and wasm32's, so exactly 3.0 may read as 2.9999999999999996 there.)
        assert!(!degraded(&warm_at(2.9, 100.0), Some(1.0), &rule));
        assert!(degraded(&warm_at(3.000_001, 100.0), Some(1.0), &rule));
        // 3x of tiny work (20 ms expected → 40 ms extra) is noise.
        assert!(!degraded(&warm_at(3.0, 20.0), Some(1.0), &rule));
        // Cold, or without warm peers: never.
        let cold = Slowness {
            samples: 19,
            ..warm_at(10.0, 100.0)
        };
        assert!(!degraded(&cold, Some(1.0), &rule));
        assert!(!degraded(&warm_at(10.0, 100.0), None, &rule));
        // Once degraded: stays at 1.6x, leaves at 1.4x or when the gap is below 25 ms.
        let was = |v: f64, e: f64| Slowness {
            degraded: true,
            ..warm_at(v, e)
        };
        assert!(degraded(&was(1.6, 100.0), Some(1.0), &rule));
        assert!(!degraded(&was(1.4, 100.0), Some(1.0), &rule));
        assert!(!degraded(&was(2.0, 20.0), Some(1.0), &rule));
    }

    #[test]
    fn codecs_round_trip_and_reject_garbage() {
        let mut m = WorkModel::default();
        for i in 0..50u64 {
            m.observe(&sample(
                i % 2 == 0,
                100.0 + i as f64 * 10.0,
                1000 + i * 10,
                i,
                100,
            ));
        }
        let bytes = m.encode();
        assert_eq!(bytes.len(), 1 + WorkModel::BYTES);
        assert_eq!(WorkModel::decode(&bytes), Some(m));
        assert_eq!(WorkModel::decode(&bytes[..bytes.len() - 1]), None);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(WorkModel::decode(&longer), None);
        let mut wrong = bytes.clone();
        wrong[0] = 9;
        assert_eq!(WorkModel::decode(&wrong), None);

        let sl = Slowness {
            degraded: true,
            last_sample_ms: 123,
            ..warm_at(2.5, 300.0)
        };
        let bytes = sl.encode();
        assert_eq!(bytes.len(), 1 + Slowness::BYTES);
        assert_eq!(Slowness::decode(&bytes), Some(sl));
        let mut bad_flag = bytes.clone();
        *bad_flag.last_mut().unwrap() = 2;
        assert_eq!(Slowness::decode(&bad_flag), None);
        assert_eq!(Slowness::decode(&bytes[1..]), None);
    }
}
