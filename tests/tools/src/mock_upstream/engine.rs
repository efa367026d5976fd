//! The engine model: how long a request takes on one inference server, and what the server
//! reports about its load on `GET /metrics`.
//!
//! Why: a router that judges endpoints by latency or by the engines' own queue and KV usage can
//! only be measured against an upstream whose latency depends on the work and the load the way
//! an inference server's does. The constant model (`--engine constant`, the default: prefill per
//! uncached token, then a fixed `--decode-ms`) answers in nearly constant time whatever the load;
//! it stays for the overhead runs and for the tests that count on its timing. The batched model
//! (`--engine batched`) is what the routing benchmark runs against:
//! - `--max-concurrency` slots (the running batch); later requests wait in a FIFO queue;
//! - one prefill at a time per engine, `--prefill-us-per-token` per uncached prompt token
//!   (cached prefix blocks are skipped, as in the constant model);
//! - decode per output token, `--decode-ms-per-token × (1 + --batch-slowdown × (decoding − 1))`
//!   where `decoding` is how many requests are decoding at that moment, so an engine slows down
//!   as its batch grows;
//! - the output length drawn per request from a seeded generator, log-uniform in
//!   `--output-tokens-min`..`--output-tokens-max` (16..512) and capped by the request's
//!   `max_tokens`, or, with `--output-tokens max_tokens`, the request's `max_tokens` itself (the
//!   bench plans every request's length, so that every policy sees the same work);
//! - a plain answer's headers after the whole generation (as vLLM sends them), a streamed
//!   answer's first chunk after the prefill;
//! - the `slow` fault (and `--slow-factor F --slow-after-ms T`) multiplies prefill and decode
//!   from the moment it is set, requests already running included.
//!
//! How the metrics are named: [`render_metrics`] writes the Prometheus text exposition of the
//! engine chosen by `--metrics-format` (vllm, sglang, llamacpp, tgi) with the names those
//! engines publish (see /work/shared/ENGINE-METRICS.md): queue depth, running requests, KV-cache
//! usage, the prompt / cached-token counters, and the decode-pace counters — the decode time
//! the mock actually simulated (batch stretch and the `slow` fault included) and the tokens it
//! produced, as vLLM's `vllm:inter_token_latency_seconds` (and its deprecated twin
//! `vllm:time_per_output_token_seconds`), SGLang's `sglang:inter_token_latency_seconds`
//! (histograms: `_sum`, `_count` and a `+Inf` bucket) and llama.cpp's
//! `llamacpp:tokens_predicted_seconds_total` / `llamacpp:tokens_predicted_total`. KV-cache usage is the share of the cache's
//! blocks held by the requests in their slots (prompt and output), as vLLM counts it: blocks that
//! only hold an evictable cached prefix are free.

use std::fmt::Write as _;

/// Which latency model the mock runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    Constant,
    Batched,
}

impl Model {
    pub fn parse(s: &str) -> Result<Model, String> {
        match s {
            "constant" => Ok(Model::Constant),
            "batched" | "engine" => Ok(Model::Batched),
            other => Err(format!("--engine: constant or batched, got {other:?}")),
        }
    }
}

/// Where a batched engine's output lengths come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputTokens {
    /// Drawn per request (capped by `max_tokens`).
    Random,
    /// The request's `max_tokens` (drawn when it has none).
    MaxTokens,
}

impl OutputTokens {
    pub fn parse(s: &str) -> Result<OutputTokens, String> {
        match s {
            "random" => Ok(OutputTokens::Random),
            "max_tokens" => Ok(OutputTokens::MaxTokens),
            other => Err(format!(
                "--output-tokens: random or max_tokens, got {other:?}"
            )),
        }
    }
}

/// The `/metrics` dialect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Vllm,
    Sglang,
    Llamacpp,
    Tgi,
}

impl Format {
    pub fn parse(s: &str) -> Result<Format, String> {
        match s {
            "vllm" => Ok(Format::Vllm),
            "sglang" => Ok(Format::Sglang),
            "llamacpp" => Ok(Format::Llamacpp),
            "tgi" => Ok(Format::Tgi),
            other => Err(format!(
                "--metrics-format: vllm, sglang, llamacpp or tgi, got {other:?}"
            )),
        }
    }
}

/// The batched model's parameters.
#[derive(Clone, Debug)]
pub struct Params {
    pub decode_ms_per_token: f64,
    pub batch_slowdown: f64,
    pub output_min: u64,
    pub output_max: u64,
    pub output_tokens: OutputTokens,
    /// Tokens per decode step: one timer wake-up and one streamed chunk per step.
    pub step_tokens: u64,
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            decode_ms_per_token: 2.0,
            batch_slowdown: 0.05,
            output_min: 16,
            output_max: 512,
            output_tokens: OutputTokens::Random,
            step_tokens: 4,
            seed: 1,
        }
    }
}

impl Params {
    /// Decode time of one token with `decoding` requests in the batch, before any slow factor.
    pub fn per_token_ms(&self, decoding: u64) -> f64 {
        self.decode_ms_per_token * (1.0 + self.batch_slowdown * decoding.saturating_sub(1) as f64)
    }

    /// The output length of one request: `max_tokens` (the request's, if any) under
    /// [`OutputTokens::MaxTokens`], else a draw from `rng` capped by it; at least 1.
    pub fn output_len(&self, max_tokens: Option<u64>, rng: &mut SplitMix) -> u64 {
        if let (OutputTokens::MaxTokens, Some(m)) = (self.output_tokens, max_tokens) {
            return m.max(1);
        }
        let drawn = log_uniform(rng, self.output_min, self.output_max);
        drawn.min(max_tokens.unwrap_or(u64::MAX)).max(1)
    }
}

/// SplitMix64: small, seedable and the same everywhere (the bench's generator too).
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Log-uniform integer in `lo..=hi` (short answers are more common than long ones; the median
/// of 16..512 is about 90).
pub fn log_uniform(rng: &mut SplitMix, lo: u64, hi: u64) -> u64 {
    let (lo, hi) = (lo.max(1), hi.max(lo.max(1)));
    let (a, b) = ((lo as f64).ln(), ((hi + 1) as f64).ln());
    let x = (a + (b - a) * rng.unit()).exp().floor() as u64;
    x.clamp(lo, hi)
}

/// What `/metrics` reports, read at one instant.
#[derive(Clone, Debug, Default)]
pub struct Load {
    pub model: String,
    pub waiting: u64,
    pub running: u64,
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    pub block_tokens: u64,
    pub prompt_tokens_total: u64,
    pub cached_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub requests_total: u64,
    pub slots: u64,
    /// Decode time simulated so far, µs, and the output tokens it produced.
    pub decode_us_total: u64,
    pub decode_tokens_total: u64,
    /// The data-parallel rank this load is one of (an engine run with several ranks labels
    /// every series with it: vLLM `engine`, always present, `0` without ranks; SGLang
    /// `dp_rank`, only with ranks).
    pub dp_rank: Option<usize>,
}

impl Load {
    /// KV-cache usage in 0..=1 (1 when the cache has no blocks but a request holds some).
    pub fn kv_usage(&self) -> f64 {
        if self.kv_blocks_total == 0 {
            return if self.kv_blocks_used > 0 { 1.0 } else { 0.0 };
        }
        (self.kv_blocks_used as f64 / self.kv_blocks_total as f64).min(1.0)
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &str, value: f64) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {value}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// A histogram's `+Inf` bucket, `_sum` and `_count` (no finite buckets: the mock keeps no
/// distribution, and a scraper of the pace needs only the two totals).
fn histogram(out: &mut String, name: &str, help: &str, labels: &str, sum: f64, count: u64) {
    family(out, name, "histogram", help);
    let sep = if labels.is_empty() { "" } else { "," };
    let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
    sample(out, &format!("{name}_sum"), labels, sum);
    sample(out, &format!("{name}_count"), labels, count as f64);
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The Prometheus text exposition of `load` in the dialect of `format`.
pub fn render_metrics(format: Format, load: &Load) -> String {
    let mut o = String::new();
    let m = escape(&load.model);
    let f = |v: u64| v as f64;
    let decode_s = load.decode_us_total as f64 / 1e6;
    match format {
        Format::Vllm => {
            let engine = load.dp_rank.unwrap_or(0);
            let l = format!("engine=\"{engine}\",model_name=\"{m}\"");
            let g = [
                (
                    "vllm:num_requests_running",
                    "Number of requests in model execution batches.",
                    f(load.running),
                ),
                (
                    "vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.",
                    f(load.waiting),
                ),
                (
                    "vllm:kv_cache_usage_perc",
                    "KV-cache usage. 1 means 100 percent usage.",
                    load.kv_usage(),
                ),
            ];
            for (name, help, v) in g {
                family(&mut o, name, "gauge", help);
                sample(&mut o, name, &l, v);
            }
            let c = [
                (
                    "vllm:prefix_cache_queries_total",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    f(load.prompt_tokens_total),
                ),
                (
                    "vllm:prefix_cache_hits_total",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    f(load.cached_tokens_total),
                ),
                (
                    "vllm:prompt_tokens_total",
                    "Number of prefill tokens processed.",
                    f(load.prompt_tokens_total),
                ),
                (
                    "vllm:generation_tokens_total",
                    "Number of generation tokens processed.",
                    f(load.generation_tokens_total),
                ),
            ];
            for (name, help, v) in c {
                family(&mut o, name, "counter", help);
                sample(&mut o, name, &l, v);
            }
            for (name, help) in [
                (
                    "vllm:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds.",
                ),
                (
                    "vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                ),
            ] {
                histogram(&mut o, name, help, &l, decode_s, load.decode_tokens_total);
            }
            family(
                &mut o,
                "vllm:cache_config_info",
                "gauge",
                "Information of the LLMEngine CacheConfig",
            );
            sample(
                &mut o,
                "vllm:cache_config_info",
                &format!(
                    "block_size=\"{}\",engine=\"{engine}\",num_gpu_blocks=\"{}\"",
                    load.block_tokens, load.kv_blocks_total
                ),
                1.0,
            );
        }
        Format::Sglang => {
            let l = match load.dp_rank {
                Some(k) => format!("model_name=\"{m}\",dp_rank=\"{k}\""),
                None => format!("model_name=\"{m}\""),
            };
            let hit_rate = if load.prompt_tokens_total == 0 {
                0.0
            } else {
                load.cached_tokens_total as f64 / load.prompt_tokens_total as f64
            };
            let g = [
                (
                    "sglang:num_running_reqs",
                    "The number of running requests.",
                    f(load.running),
                ),
                (
                    "sglang:num_queue_reqs",
                    "The number of requests in the waiting queue.",
                    f(load.waiting),
                ),
                ("sglang:token_usage", "The token usage.", load.kv_usage()),
                (
                    "sglang:max_total_num_tokens",
                    "Maximum total number of tokens in the KV cache pool.",
                    f(load.kv_blocks_total * load.block_tokens),
                ),
                (
                    "sglang:cache_hit_rate",
                    "The prefix cache hit rate.",
                    hit_rate,
                ),
            ];
            for (name, help, v) in g {
                family(&mut o, name, "gauge", help);
                sample(&mut o, name, &l, v);
            }
            let c = [
                (
                    "sglang:prompt_tokens_total",
                    "Number of prefill tokens processed.",
                    f(load.prompt_tokens_total),
                ),
                (
                    "sglang:cached_tokens_total",
                    "Number of cached prompt tokens.",
                    f(load.cached_tokens_total),
                ),
                (
                    "sglang:generation_tokens_total",
                    "Number of generation tokens processed.",
                    f(load.generation_tokens_total),
                ),
            ];
            for (name, help, v) in c {
                family(&mut o, name, "counter", help);
                sample(&mut o, name, &l, v);
            }
            histogram(
                &mut o,
                "sglang:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &l,
                decode_s,
                load.decode_tokens_total,
            );
        }
        Format::Llamacpp => {
            let c = [
                (
                    "llamacpp:prompt_tokens_total",
                    "Number of prompt tokens processed.",
                    f(load.prompt_tokens_total),
                ),
                (
                    "llamacpp:prompt_tokens_cached_total",
                    "Number of prompt tokens served from the prompt cache.",
                    f(load.cached_tokens_total),
                ),
                (
                    "llamacpp:tokens_predicted_total",
                    "Number of generation tokens processed.",
                    f(load.decode_tokens_total),
                ),
                (
                    "llamacpp:tokens_predicted_seconds_total",
                    "Predict process time",
                    decode_s,
                ),
            ];
            for (name, help, v) in c {
                family(&mut o, name, "counter", help);
                sample(&mut o, name, "", v);
            }
            let busy = if load.slots == 0 {
                f(load.running)
            } else {
                load.running as f64 / load.slots as f64
            };
            let g = [
                (
                    "llamacpp:requests_processing",
                    "Number of requests processing.",
                    f(load.running),
                ),
                (
                    "llamacpp:requests_deferred",
                    "Number of requests deferred.",
                    f(load.waiting),
                ),
                (
                    "llamacpp:n_busy_slots_per_decode",
                    "Average number of busy slots per llama_decode() call",
                    busy,
                ),
            ];
            for (name, help, v) in g {
                family(&mut o, name, "gauge", help);
                sample(&mut o, name, "", v);
            }
        }
        Format::Tgi => {
            let g = [
                ("tgi_queue_size", "Current queue size", f(load.waiting)),
                (
                    "tgi_batch_current_size",
                    "Current batch size",
                    f(load.running),
                ),
                (
                    "tgi_batch_current_max_tokens",
                    "Maximum tokens for the current batch",
                    f(load.kv_blocks_used * load.block_tokens),
                ),
            ];
            for (name, help, v) in g {
                family(&mut o, name, "gauge", help);
                sample(&mut o, name, "", v);
            }
            family(
                &mut o,
                "tgi_request_count",
                "counter",
                "Total number of requests",
            );
            sample(&mut o, "tgi_request_count", "", f(load.requests_total));
        }
    }
    o
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn load() -> Load {
        Load {
            model: "m1".into(),
            waiting: 3,
            running: 4,
            kv_blocks_used: 25,
            kv_blocks_total: 100,
            block_tokens: 16,
            prompt_tokens_total: 1000,
            cached_tokens_total: 640,
            generation_tokens_total: 77,
            requests_total: 9,
            slots: 4,
            decode_us_total: 1_540_000,
            decode_tokens_total: 770,
            dp_rank: None,
        }
    }

    /// The value of the series `name` (with its labels as written), if present exactly once.
    fn value(text: &str, series: &str) -> Option<f64> {
        let hits: Vec<f64> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' '))
            .filter(|(s, _)| *s == series)
            .filter_map(|(_, v)| v.parse().ok())
            .collect();
        (hits.len() == 1).then(|| hits[0])
    }

    #[test]
    fn vllm_names_labels_and_values() {
        let t = render_metrics(Format::Vllm, &load());
        let l = "{engine=\"0\",model_name=\"m1\"}";
        assert_eq!(
            value(&t, &format!("vllm:num_requests_waiting{l}")),
            Some(3.0)
        );
        assert_eq!(
            value(&t, &format!("vllm:num_requests_running{l}")),
            Some(4.0)
        );
        assert_eq!(
            value(&t, &format!("vllm:kv_cache_usage_perc{l}")),
            Some(0.25)
        );
        assert_eq!(
            value(&t, &format!("vllm:prefix_cache_hits_total{l}")),
            Some(640.0)
        );
        assert!(t.contains("# TYPE vllm:num_requests_waiting gauge\n"));
        assert!(t.contains("# TYPE vllm:prefix_cache_queries_total counter\n"));
        assert!(t.contains("# HELP vllm:kv_cache_usage_perc "));
    }

    /// One rank of a data-parallel engine: its rank on every series, as vLLM (`engine`) and
    /// SGLang (`dp_rank`) write it.
    #[test]
    fn a_rank_labels_its_series() {
        let rank = Load {
            dp_rank: Some(1),
            ..load()
        };
        let t = render_metrics(Format::Vllm, &rank);
        let l = "{engine=\"1\",model_name=\"m1\"}";
        assert_eq!(
            value(&t, &format!("vllm:num_requests_waiting{l}")),
            Some(3.0)
        );
        assert!(!t.contains("engine=\"0\""));
        let t = render_metrics(Format::Sglang, &rank);
        assert_eq!(
            value(&t, "sglang:num_queue_reqs{model_name=\"m1\",dp_rank=\"1\"}"),
            Some(3.0)
        );
        assert!(!render_metrics(Format::Sglang, &load()).contains("dp_rank"));
    }

    #[test]
    fn sglang_llamacpp_tgi_names() {
        let t = render_metrics(Format::Sglang, &load());
        assert_eq!(
            value(&t, "sglang:num_queue_reqs{model_name=\"m1\"}"),
            Some(3.0)
        );
        assert_eq!(
            value(&t, "sglang:num_running_reqs{model_name=\"m1\"}"),
            Some(4.0)
        );
        assert_eq!(
            value(&t, "sglang:token_usage{model_name=\"m1\"}"),
            Some(0.25)
        );
        let t = render_metrics(Format::Llamacpp, &load());
        assert_eq!(value(&t, "llamacpp:requests_deferred"), Some(3.0));
        assert_eq!(value(&t, "llamacpp:requests_processing"), Some(4.0));
        assert_eq!(value(&t, "llamacpp:prompt_tokens_total"), Some(1000.0));
        assert_eq!(
            value(&t, "llamacpp:prompt_tokens_cached_total"),
            Some(640.0)
        );
        assert!(t.contains("# TYPE llamacpp:prompt_tokens_total counter\n"));
        let t = render_metrics(Format::Tgi, &load());
        assert_eq!(value(&t, "tgi_queue_size"), Some(3.0));
        assert!(!t.contains("seconds"));
        assert_eq!(value(&t, "tgi_batch_current_size"), Some(4.0));
    }

    /// The decode-pace counters: 770 tokens in 1.54 s in every dialect, as the real engines
    /// name them (vLLM both histogram names, with a `+Inf` bucket equal to the count).
    #[test]
    fn decode_pace_counters() {
        let t = render_metrics(Format::Vllm, &load());
        for name in [
            "vllm:inter_token_latency_seconds",
            "vllm:time_per_output_token_seconds",
        ] {
            let l = "{engine=\"0\",model_name=\"m1\"}";
            assert_eq!(value(&t, &format!("{name}_sum{l}")), Some(1.54));
            assert_eq!(value(&t, &format!("{name}_count{l}")), Some(770.0));
            assert_eq!(
                value(
                    &t,
                    &format!("{name}_bucket{{engine=\"0\",model_name=\"m1\",le=\"+Inf\"}}")
                ),
                Some(770.0)
            );
            assert!(t.contains(&format!("# TYPE {name} histogram\n")));
        }
        let t = render_metrics(Format::Sglang, &load());
        let l = "{model_name=\"m1\"}";
        assert_eq!(
            value(&t, &format!("sglang:inter_token_latency_seconds_sum{l}")),
            Some(1.54)
        );
        assert_eq!(
            value(&t, &format!("sglang:inter_token_latency_seconds_count{l}")),
            Some(770.0)
        );
        let t = render_metrics(Format::Llamacpp, &load());
        assert_eq!(
            value(&t, "llamacpp:tokens_predicted_seconds_total"),
            Some(1.54)
        );
        assert_eq!(value(&t, "llamacpp:tokens_predicted_total"), Some(770.0));
    }

    #[test]
    fn every_sample_has_help_and_type_before_it() {
        for f in [Format::Vllm, Format::Sglang, Format::Llamacpp, Format::Tgi] {
            let t = render_metrics(f, &load());
            let mut typed = std::collections::HashSet::new();
            for line in t.lines() {
                if let Some(rest) = line.strip_prefix("# TYPE ") {
                    typed.insert(rest.split(' ').next().unwrap().to_string());
                } else if !line.starts_with('#') {
                    let name = line.split(['{', ' ']).next().unwrap();
                    // A histogram's series carry its family's name and a suffix.
                    let family = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)));
                    let name = family.unwrap_or(name);
                    assert!(
                        typed.contains(name),
                        "{f:?}: {name} has no TYPE line before it"
                    );
                }
            }
        }
    }

    #[test]
    fn model_names_are_escaped() {
        let mut l = load();
        l.model = "a\"b\\c".into();
        let t = render_metrics(Format::Vllm, &l);
        assert!(t.contains("model_name=\"a\\\"b\\\\c\""));
    }

    #[test]
    fn output_lengths_are_seeded_bounded_and_follow_max_tokens() {
        let p = Params::default();
        let draws = |seed| {
            let mut r = SplitMix::new(seed);
            (0..2000)
                .map(|_| p.output_len(None, &mut r))
                .collect::<Vec<_>>()
        };
        let a = draws(7);
        assert_eq!(a, draws(7), "same seed, same lengths");
        assert_ne!(a, draws(8));
        assert!(a.iter().all(|n| (16..=512).contains(n)));
        let (lo, hi) = (
            a.iter().filter(|n| **n < 64).count(),
            a.iter().filter(|n| **n >= 256).count(),
        );
        assert!(lo > 600 && hi > 200, "log-uniform: {lo} short, {hi} long");
        let mut r = SplitMix::new(1);
        assert!(
            (0..100).all(|_| p.output_len(Some(20), &mut r) <= 20),
            "capped by max_tokens"
        );
        let exact = Params {
            output_tokens: OutputTokens::MaxTokens,
            ..Params::default()
        };
        assert_eq!(exact.output_len(Some(300), &mut r), 300);
        assert!((16..=512).contains(&exact.output_len(None, &mut r)));
    }

    #[test]
    fn decode_stretches_with_the_batch() {
        let p = Params {
            decode_ms_per_token: 4.0,
            batch_slowdown: 0.1,
            ..Params::default()
        };
        assert_eq!(p.per_token_ms(0), 4.0);
        assert_eq!(p.per_token_ms(1), 4.0);
        assert!((p.per_token_ms(11) - 8.0).abs() < 1e-9);
    }

    #[test]
    fn kv_usage_is_a_fraction() {
        let mut l = load();
        assert_eq!(l.kv_usage(), 0.25);
        l.kv_blocks_used = 1000;
        assert_eq!(l.kv_usage(), 1.0);
        l.kv_blocks_total = 0;
        assert_eq!(l.kv_usage(), 1.0);
        l.kv_blocks_used = 0;
        assert_eq!(l.kv_usage(), 0.0);
    }
}
