//! Property tests of the engine-metrics parser (`scheduler::engine_load`) and the scrape
//! bookkeeping (`scheduler::scrape`).
//!
//! The unit tests pin exact numbers on real-looking pages; these check what must hold for any
//! page: the parser never panics and never reads past its limit, the load does not depend on
//! the order of the lines, on CRLF or on interleaved comments and garbage, a body cut anywhere
//! reads like the same body cut at its last complete line, the model filter partitions the sum,
//! the record codec is exact, and a lease never has two workers that believe they hold it.

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use computeflux::scheduler::routing::scrape::{
    self, LoadState, Pace, ScrapeError, Scraped, PACE_MIN_TOKENS,
};
use computeflux::scheduler::state::store::CAS_RETRIES;
use computeflux::scheduler::wire::engine_load::{
    parse, DecodeTotals, Engine, EngineLoad, Format, Parsed, SERIES_SLOTS,
};
use computeflux::scheduler::{MemStore, Store};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

const NONE: &[&str] = &[];
const MODELS: [&str; 2] = ["llama-8b", "qwen-7b"];

fn props(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..ProptestConfig::default()
    }
}

const FORMATS: [Format; 5] = [
    Format::Vllm,
    Format::Sglang,
    Format::Llamacpp,
    Format::Tgi,
    Format::Auto,
];

/// Metric names, wanted and not, of every engine.
const NAMES: [&str; 14] = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:num_queue_reqs",
    "sglang_num_running_reqs",
    "sglang:token_usage",
    "llamacpp:requests_deferred",
    "llamacpp:requests_processing",
    "llamacpp:prompt_tokens_total",
    "tgi_queue_size",
    "tgi_batch_current_size",
    "vllm:num_preemptions_total",
    "sglang:cache_hit_rate",
];

/// One sample line: a name, a rank, an optional model, a value.
#[derive(Debug, Clone)]
struct SampleLine {
    name: usize,
    rank: u8,
    model: Option<usize>,
    value: String,
}

impl SampleLine {
    fn render(&self) -> String {
        let model = self
            .model
            .map(|m| format!(",model_name=\"{}\"", MODELS[m]))
            .unwrap_or_default();
        format!(
            "{}{{engine=\"{}\"{model}}} {}\n",
            NAMES[self.name], self.rank, self.value
        )
    }
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u32..1000).prop_map(|v| v.to_string()),
        (0u32..1000).prop_map(|v| format!("{v}.0")),
        (0u32..=100).prop_map(|v| format!("{}", f64::from(v) / 100.0)),
        (0u32..100).prop_map(|v| format!("{v}e0")),
        Just("NaN".to_string()),
        Just("+Inf".to_string()),
        Just("-2".to_string()),
    ]
}

/// Distinct series (name, rank, model) so that the fold table is not exceeded and no series
/// repeats with two values.
fn lines() -> impl Strategy<Value = Vec<SampleLine>> {
    vec(
        (
            0..NAMES.len(),
            0u8..4,
            proptest::option::of(0..2usize),
            value(),
        ),
        0..40,
    )
    .prop_map(|v| {
        let mut seen = std::collections::HashSet::new();
        v.into_iter()
            .filter(|(n, r, m, _)| seen.insert((*n, *r, *m)))
            .take(SERIES_SLOTS)
            .map(|(name, rank, model, value)| SampleLine {
                name,
                rank,
                model,
                value,
            })
            .collect()
    })
}

fn garbage_line() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("# HELP vllm:num_requests_waiting waiting {engine=\"9\"} 100\n".to_string()),
        Just("# TYPE tgi_queue_size gauge\n".to_string()),
        Just("\n".to_string()),
        Just("vllm:num_requests_waiting{engine=\"9\" 100\n".to_string()),
        Just("tgi_queue_size 100 not-a-timestamp\n".to_string()),
        "[^\n]{0,30}".prop_map(|s| format!("#{s}\n")),
    ]
}

fn loads(p: &Parsed) -> Result<EngineLoad, computeflux::scheduler::wire::engine_load::LoadError> {
    p.load
}

fn run<S: AsRef<str>>(body: &[u8], format: Format, models: &[S]) -> Parsed {
    parse(body, body.len(), format, models, usize::MAX)
}

proptest! {
    #![proptest_config(props(512))]

    #[test]
    fn never_panics_and_stays_within_the_limit(
        body in vec(any::<u8>(), 0..2048),
        max in 0usize..3000,
        short in 0usize..64,
        format in 0..FORMATS.len(),
    ) {
        let full = body.len() + short;
        let p = parse(&body, full, FORMATS[format], &["m"], max);
        prop_assert!(p.stats.bytes_read <= max.min(body.len()));
        prop_assert!(p.stats.garbage_lines <= p.stats.lines);
        prop_assert!(p.stats.used <= p.stats.samples);
        prop_assert_eq!(p.stats.truncated, max < body.len() || short > 0);
        if let Ok(l) = p.load {
            prop_assert!(l.kv_usage_permille.is_none_or(|k| k <= 1000));
            prop_assert!(l.waiting.is_some() || l.running.is_some() || l.kv_usage_permille.is_some());
        }
    }

    #[test]
    fn never_panics_on_near_valid_lines(
        parts in vec(prop_oneof![
            Just("vllm:num_requests_waiting".to_string()),
            Just("{".to_string()), Just("}".to_string()), Just("\"".to_string()),
            Just("\\".to_string()), Just("=".to_string()), Just(",".to_string()),
            Just(" ".to_string()), Just("\r\n".to_string()), Just("\n".to_string()),
            Just("model_name".to_string()), Just("1e9".to_string()), Just("-Inf".to_string()),
            "[ -~]{0,4}",
        ], 0..60),
        format in 0..FORMATS.len(),
    ) {
        let body = parts.concat();
        let p = run(body.as_bytes(), FORMATS[format], &["1e9"]);
        prop_assert!(p.stats.lines as usize <= body.len());
    }

    #[test]
    fn order_crlf_comments_and_garbage_do_not_change_the_load(
        lines in lines(),
        garbage in vec(garbage_line(), 0..8),
        rotate in 0usize..64,
        seed in any::<u64>(),
        format in 0..FORMATS.len(),
        filter in 0..3usize,
    ) {
        let models: &[&str] = match filter { 0 => &[], 1 => &MODELS[..1], _ => &MODELS[1..] };
        let format = FORMATS[format];
        let body: String = lines.iter().map(SampleLine::render).collect();
        let base = run(body.as_bytes(), format, models);

        // Shuffled (a seeded Fisher–Yates), garbage spliced in, CRLF.
        let mut shuffled: Vec<String> = lines.iter().map(SampleLine::render).collect();
        let mut s = seed | 1;
        for i in (1..shuffled.len()).rev() {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            shuffled.swap(i, (s % (i as u64 + 1)) as usize);
        }
        for (i, g) in garbage.iter().enumerate() {
            let at = (rotate + i * 7) % (shuffled.len() + 1);
            shuffled.insert(at, g.clone());
        }
        let other = shuffled.concat().replace('\n', "\r\n");
        let p = run(other.as_bytes(), format, models);
        prop_assert_eq!(loads(&p), loads(&base));
        prop_assert_eq!(p.stats.used, base.stats.used);
    }

    #[test]
    fn a_cut_body_reads_like_its_complete_lines(
        lines in lines(),
        cut in any::<prop::sample::Index>(),
        format in 0..FORMATS.len(),
    ) {
        let body: String = lines.iter().map(SampleLine::render).collect();
        let bytes = body.as_bytes();
        let at = cut.index(bytes.len() + 1);
        let whole_lines = bytes[..at].iter().rposition(|b| *b == b'\n').map_or(0, |p| p + 1);
        let format = FORMATS[format];
        // Cut by the limit, and cut by the caller.
        let by_limit = parse(bytes, bytes.len(), format, NONE, at);
        let by_caller = parse(&bytes[..at], bytes.len(), format, NONE, usize::MAX);
        let reference = run(&bytes[..whole_lines], format, NONE);
        prop_assert_eq!(loads(&by_limit), loads(&reference));
        prop_assert_eq!(loads(&by_caller), loads(&reference));
        prop_assert_eq!(by_limit.stats.truncated, at < bytes.len());
    }

    #[test]
    fn the_model_filter_partitions_counts(
        lines in lines(),
    ) {
        // Only count families of vLLM, with finite small values, every series labelled.
        let lines: Vec<SampleLine> = lines
            .into_iter()
            .filter(|l| l.name <= 1)
            .map(|mut l| {
                l.model = Some(l.model.unwrap_or(0));
                l.value = l.value.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
                    .map_or("1".to_string(), |v| v.round().to_string());
                l
            })
            .collect();
        let body: String = lines.iter().map(SampleLine::render).collect();
        let all = run(body.as_bytes(), Format::Vllm, NONE).load;
        let a = run(body.as_bytes(), Format::Vllm, &MODELS[..1]).load;
        let b = run(body.as_bytes(), Format::Vllm, &MODELS[1..]).load;
        let both = run(body.as_bytes(), Format::Vllm, &MODELS).load;
        prop_assert_eq!(both, all);
        let waiting = |l: &Result<EngineLoad, _>| l.as_ref().ok().and_then(|l| l.waiting).unwrap_or(0);
        let running = |l: &Result<EngineLoad, _>| l.as_ref().ok().and_then(|l| l.running).unwrap_or(0);
        prop_assert_eq!(waiting(&a) + waiting(&b), waiting(&all));
        prop_assert_eq!(running(&a) + running(&b), running(&all));
    }

    #[test]
    fn record_decode_never_panics_and_is_canonical(bytes in vec(any::<u8>(), 0..140)) {
        if let Some(r) = Scraped::decode(&bytes) {
            prop_assert_eq!(&r.encode(), &bytes);
        }
        if let Some(l) = scrape::Lease::decode(&bytes) {
            prop_assert_eq!(&l.encode(), &bytes);
        }
    }

    #[test]
    fn record_round_trips(
        load in proptest::option::of((
            0..4usize,
            proptest::option::of(any::<u32>()),
            proptest::option::of(any::<u32>()),
            proptest::option::of(0u16..=1000),
            proptest::option::of(any::<u64>()),
            proptest::option::of(any::<u64>()),
        )),
        times in (any::<u64>(), any::<u64>(), any::<u32>()),
        error in proptest::option::of(0..ScrapeError::ALL.len()),
        flip in (any::<prop::sample::Index>(), any::<u8>()),
        decode in proptest::option::of((
            any::<(u64, u64)>(),
            any::<(u64, u64)>(),
            proptest::option::of((1..=u32::MAX, any::<u64>())),
        )),
    ) {
        let decode = decode.filter(|_| load.is_some());
        let totals = |(seconds_us, count): (u64, u64)| DecodeTotals { seconds_us, count };
        let r = Scraped {
            last: load.map(|(e, waiting, running, kv, prompt, cached)| EngineLoad {
                engine: Engine::ALL[e],
                waiting,
                running,
                kv_usage_permille: kv,
                prompt_tokens_total: prompt,
                prompt_tokens_cached_total: cached,
                decode: decode.map(|(d, _, _)| totals(d)),
            }),
            scraped_at_ms: times.0,
            attempted_at_ms: times.1,
            consecutive_failures: times.2,
            last_error: error.map(|e| ScrapeError::ALL[e]),
            decode_base: decode.map(|(_, b, _)| totals(b)),
            pace: decode.and_then(|(_, _, p)| p).map(|(us_per_token, at_ms)| Pace { us_per_token, at_ms }),
        };
        prop_assert_eq!(Scraped::decode(&r.encode()), Some(r));
        // One byte changed: refused, or another record with exactly those bytes.
        let mut bytes = r.encode();
        let i = flip.0.index(bytes.len());
        bytes[i] ^= flip.1.max(1);
        if let Some(other) = Scraped::decode(&bytes) {
            prop_assert_eq!(other.encode(), bytes);
        }
        // Known only when the last scrape succeeded and is fresh.
        if let LoadState::Known(l) = r.state_at(times.0.saturating_add(5), 10) {
            prop_assert_eq!(Some(l), r.last);
            prop_assert_eq!(r.consecutive_failures, 0);
        }
    }

    /// The pace derivation over any sequence of scraped decode counters (steps that grow,
    /// stand still or go down, tiny and huge): never panics; a pace is set only by a window
    /// of at least `PACE_MIN_TOKENS` tokens since the last (re)start and equals that window's
    /// Δseconds ÷ Δtokens (at least 1 µs); a decrease leaves no pace; the record round-trips.
    #[test]
    fn pace_is_the_last_full_window(
        steps in vec((0u8..8, any::<u64>(), any::<u64>(), 0u64..5_000_000, 0u64..200), 1..60),
    ) {
        let store = MemStore::new();
        let (mut sec, mut count) = (0u64, 0u64);
        // The model: the window's base, and the pace expected.
        let mut base: Option<(u64, u64)> = None;
        let mut pace: Option<u32> = None;
        for (i, (kind, raw_s, raw_n, ds, dn)) in steps.into_iter().enumerate() {
            let now = 1_000 * (i as u64 + 1);
            let with = |d: Option<DecodeTotals>| EngineLoad {
                engine: Engine::Vllm,
                waiting: Some(0),
                running: Some(1),
                kv_usage_permille: None,
                prompt_tokens_total: None,
                prompt_tokens_cached_total: None,
                decode: d,
            };
            let load = match kind {
                // A restart (or garbage): arbitrary counters.
                0 => { sec = raw_s; count = raw_n; Some(with(Some(DecodeTotals { seconds_us: sec, count }))) }
                // No counters at all this time.
                1 => Some(with(None)),
                // A failed scrape.
                2 => None,
                _ => {
                    sec = sec.saturating_add(ds);
                    count = count.saturating_add(dn);
                    Some(with(Some(DecodeTotals { seconds_us: sec, count })))
                }
            };
            let rec = match load {
                Some(l) => scrape::fold(&store, 7, now, Ok(l), &[7]).unwrap(),
                None => scrape::fold(&store, 7, now, Err(ScrapeError::Timeout), &[7]).unwrap(),
            };
            match load.map(|l| l.decode) {
                None => {}
                Some(None) => { base = None; pace = None; }
                Some(Some(d)) => match base {
                    None => base = Some((d.seconds_us, d.count)),
                    Some((bs, bn)) if d.seconds_us < bs || d.count < bn => {
                        base = Some((d.seconds_us, d.count));
                        pace = None;
                    }
                    Some((bs, bn)) if d.count - bn >= PACE_MIN_TOKENS => {
                        let us = (d.seconds_us - bs) / (d.count - bn);
                        pace = Some(u32::try_from(us).unwrap_or(u32::MAX).max(1));
                        base = Some((d.seconds_us, d.count));
                    }
                    Some(_) => {}
                },
            }
            prop_assert_eq!(rec.pace.map(|p| p.us_per_token), pace);
            prop_assert_eq!(rec.decode_base.map(|b| (b.seconds_us, b.count)), base);
            prop_assert!(rec.pace.is_none_or(|p| p.us_per_token >= 1));
            prop_assert_eq!(Scraped::decode(&rec.encode()), Some(rec));
            // The scheduler sees the pace only on a fresh, successful scrape.
            let seen = rec.pace_at(now, 10_000);
            prop_assert_eq!(seen, pace.filter(|_| load.is_some()));
        }
    }

    #[test]
    fn a_lease_has_at_most_one_holder(
        steps in vec((0..3usize, 0u64..1500, 0u32..(CAS_RETRIES as u32 + 2)), 1..60),
        garbage_at in proptest::option::of(0..60usize),
    ) {
        const LEASE_MS: u64 = 1000;
        let store = MemStore::new();
        let mut now = 0u64;
        // What each worker believes: it holds the lease until this instant.
        let mut believes = [0u64; 3];
        for (i, (worker, dt, conflicts)) in steps.into_iter().enumerate() {
            now += dt;
            if garbage_at == Some(i) {
                store.set(scrape::LEASE_KEY, b"\x07junk", None).unwrap();
                // Garbage in shared data: a holder cannot know; it finds out at its next take.
                believes = [0; 3];
            }
            store.inject_conflicts.set(conflicts);
            let me = 100 + worker as u64;
            if scrape::try_take(&store, scrape::LEASE_KEY, me, 1, now, LEASE_MS) {
                for (other, until) in believes.iter().enumerate() {
                    prop_assert!(other == worker || *until <= now,
                        "worker {worker} took the lease at {now} while {other} holds it to {until}");
                }
                believes[worker] = now + LEASE_MS;
            } else if believes[worker] > now {
                // A renewal that lost every CAS race: the worker stops trusting its lease.
                believes[worker] = 0;
            }
            store.inject_conflicts.set(0);
        }
    }
}
