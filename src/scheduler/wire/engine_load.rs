//! Reading an inference engine's own load from its Prometheus `/metrics` page.
//! (Over 600 lines with its unit tests: one bounded single-pass parser and the four engines' sample pages it is tested on; the code itself is about 730 lines, a third of it the family tables.)
//!
//! Why: the filter sees only the requests that pass through its own process and the latencies
//! of answers already finished. The engine knows its queue depth, its running batch and how
//! full its KV cache is; every router built for self-hosted engines reads them. This module
//! turns one scraped body into an [`EngineLoad`]: waiting, running, KV usage (and llama.cpp's
//! prompt-token counters), summed over data-parallel ranks and filtered by served model.
//!
//! How: one pass over the bytes of the text exposition format (0.0.4), line by line, without
//! copying the input and with a fixed amount of memory whatever the body holds: a
//! [`SERIES_SLOTS`]-entry table that folds duplicate series, and one accumulator per metric
//! family it knows. Only the families in the table below are looked at; every other line is checked
//! for shape (so garbage is counted) and dropped. At most `max_bytes` are read; a final line
//! cut by that limit (or by a body the caller did not get whole) is not used, since its value
//! may be a prefix of the real one.
//!
//! | format     | waiting                       | running                     | KV usage (0..1)                                          |
//! |------------|-------------------------------|-----------------------------|----------------------------------------------------------|
//! | `vllm`     | `vllm:num_requests_waiting`   | `vllm:num_requests_running` | `vllm:kv_cache_usage_perc`, else `vllm:gpu_cache_usage_perc` |
//! | `sglang`   | `sglang:num_queue_reqs`       | `sglang:num_running_reqs`   | `sglang:token_usage` (`sglang_` prefix accepted too)     |
//! | `llamacpp` | `llamacpp:requests_deferred`  | `llamacpp:requests_processing` | none                                                  |
//! | `tgi`      | `tgi_queue_size`              | `tgi_batch_current_size`    | none                                                     |
//!
//! `auto` reads the engine whose names the body holds most families of. llama.cpp's
//! `llamacpp:prompt_tokens_total` and `llamacpp:prompt_tokens_cached_total` are read too.
//!
//! **Decode pace** ([`DecodeTotals`]): each engine also publishes its own decode time as a pair
//! of cumulative counters, seconds spent and tokens (or observations) they were spent on; the
//! scraper differences two scrapes into the pace of the window between them (`scrape.rs`).
//!
//! | format     | seconds (sum)                                  | count                                            |
//! |------------|------------------------------------------------|--------------------------------------------------|
//! | `vllm`     | `vllm:inter_token_latency_seconds_sum`, else `vllm:time_per_output_token_seconds_sum` (deprecated, same values), else `vllm:request_time_per_output_token_seconds_sum` (one observation per request) | the same histogram's `_count` |
//! | `sglang`   | `sglang:inter_token_latency_seconds_sum`, else `sglang:time_per_output_token_seconds_sum` | the same histogram's `_count` |
//! | `llamacpp` | `llamacpp:tokens_predicted_seconds_total`      | `llamacpp:tokens_predicted_total`                |
//! | `tgi`      | none                                           |                                                  |
//!
//! The two halves of a pair come from the same family (a `_sum` of one name is never divided
//! by the `_count` of another); seconds are summed in microseconds.
//!
//! Counts are summed over the distinct series of a family (vLLM's `engine` label, SGLang's
//! `dp_rank`: one series per rank); KV usage is the mean over series (each rank has its own
//! cache). A series whose `model_name` label is not in the model filter is left out; a series
//! without that label counts. Values are clamped: NaN drops the series, negatives read as 0,
//! `+Inf` and huge values saturate, KV usage is clamped to 0..1. Sums are over integers (counts,
//! and KV usage in millionths), so they do not depend on the order of the lines.

use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use crate::scheduler::config::metrics::Format;

mod engine;
mod lex;
use engine::engine_of;
pub use engine::Engine;
use lex::{classify, label_value_eq, Labels, Line};

/// An engine's load as its `/metrics` reported it. `None`: the engine does not publish that
/// value (llama.cpp and TGI have no KV gauge) or the body did not hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLoad {
    pub engine: Engine,
    /// Requests queued, not yet scheduled (summed over ranks).
    pub waiting: Option<u32>,
    /// Requests in the running batch (summed over ranks).
    pub running: Option<u32>,
    /// KV-cache usage in thousandths (0..=1000), the mean over ranks.
    pub kv_usage_permille: Option<u16>,
    /// llama.cpp's `llamacpp:prompt_tokens_total` (a counter).
    pub prompt_tokens_total: Option<u64>,
    /// llama.cpp's `llamacpp:prompt_tokens_cached_total` (a counter).
    pub prompt_tokens_cached_total: Option<u64>,
    /// The engine's cumulative decode time and what it was spent on (see the module doc).
    pub decode: Option<DecodeTotals>,
}

/// An engine's cumulative decode counters: time spent decoding and the tokens (for vLLM's
/// per-request histogram, the requests) it was spent on. Both only grow while the engine runs;
/// a decrease means it restarted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodeTotals {
    /// Seconds spent, in microseconds (summed over series).
    pub seconds_us: u64,
    /// Tokens or observations (summed over series).
    pub count: u64,
}

/// Why a body gave no load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadError {
    /// None of the format's queue, running or KV families was in the body.
    NoSeries,
    /// They were there, but every series belonged to a model outside the filter.
    ModelNotServed,
}

/// What the scan saw, for metrics and logs (whatever the outcome).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScanStats {
    /// Bytes looked at (at most `max_bytes`).
    pub bytes_read: usize,
    /// Lines looked at (blank and comment lines included).
    pub lines: u32,
    /// Well-formed sample lines, of any family.
    pub samples: u32,
    /// Samples of a wanted family that were used.
    pub used: u32,
    /// Lines that are neither blank, a comment nor a well-formed sample.
    pub garbage_lines: u32,
    /// Samples of a wanted family left out for their `model_name`.
    pub other_model: u32,
    /// Samples of a wanted family left out for their data-parallel rank (`parse_rank`).
    pub other_rank: u32,
    /// Samples of a wanted family labelled with the data-parallel rank asked for.
    pub own_rank: u32,
    /// Samples of a wanted family repeating a series already seen (the larger value is kept).
    pub duplicates: u32,
    /// Samples of a wanted family with a NaN value (left out).
    pub nan_values: u32,
    /// Distinct series beyond the fold table (summed without duplicate detection).
    pub overflow: u32,
    /// The body was cut (by `max_bytes` or by the caller); a last partial line was dropped.
    pub truncated: bool,
}

/// The outcome of [`parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parsed {
    pub load: Result<EngineLoad, LoadError>,
    pub stats: ScanStats,
}

/// How many distinct series of wanted families are folded exactly (duplicates detected, the
/// result independent of line order). Beyond it, series are still summed, but a repeated one
/// would count twice. A vLLM or SGLang server has a handful of ranks per family.
pub const SERIES_SLOTS: usize = 64;

/// Longest value or timestamp token read as a number; longer tokens make the line garbage.
const MAX_NUMBER_BYTES: usize = 64;

/// The label that names the served model (vLLM and SGLang).
const MODEL_LABEL: &[u8] = b"model_name";
/// The labels that name a series' data-parallel rank: vLLM's engine index, SGLang's `dp_rank`.
const RANK_LABELS: [&[u8]; 2] = [b"engine", b"dp_rank"];

const SERIES_SEED: u64 = 0x7365_7269_6573_6b79; // "serieskY"

/// The metric families this module reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    VllmWaiting,
    VllmRunning,
    VllmKv,
    VllmKvOld,
    SglangWaiting,
    SglangRunning,
    SglangKv,
    LlamaWaiting,
    LlamaRunning,
    LlamaPrompt,
    LlamaPromptCached,
    TgiWaiting,
    TgiRunning,
    VllmItlSum,
    VllmItlCount,
    VllmTpotSum,
    VllmTpotCount,
    VllmReqTpotSum,
    VllmReqTpotCount,
    SglangItlSum,
    SglangItlCount,
    SglangTpotSum,
    SglangTpotCount,
    LlamaPredictedSeconds,
    LlamaPredicted,
}

const FAMILIES: usize = 25;

impl Family {
    /// Every family, in declaration order.
    const ALL: [Family; FAMILIES] = [
        Family::VllmWaiting,
        Family::VllmRunning,
        Family::VllmKv,
        Family::VllmKvOld,
        Family::SglangWaiting,
        Family::SglangRunning,
        Family::SglangKv,
        Family::LlamaWaiting,
        Family::LlamaRunning,
        Family::LlamaPrompt,
        Family::LlamaPromptCached,
        Family::TgiWaiting,
        Family::TgiRunning,
        Family::VllmItlSum,
        Family::VllmItlCount,
        Family::VllmTpotSum,
        Family::VllmTpotCount,
        Family::VllmReqTpotSum,
        Family::VllmReqTpotCount,
        Family::SglangItlSum,
        Family::SglangItlCount,
        Family::SglangTpotSum,
        Family::SglangTpotCount,
        Family::LlamaPredictedSeconds,
        Family::LlamaPredicted,
    ];
}

/// The decode `(seconds, count)` family pairs of each engine, in order of preference.
const DECODE_PAIRS: [(Family, Family); 6] = {
    use Family::*;
    [
        (VllmItlSum, VllmItlCount),
        (VllmTpotSum, VllmTpotCount),
        (VllmReqTpotSum, VllmReqTpotCount),
        (SglangItlSum, SglangItlCount),
        (SglangTpotSum, SglangTpotCount),
        (LlamaPredictedSeconds, LlamaPredicted),
    ]
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A count of requests: summed, clamped to u32 per series.
    Count,
    /// A fraction 0..1: mean over series, in millionths.
    Fraction,
    /// A token counter: summed, clamped to u64.
    Counter,
    /// A cumulative time in seconds: summed in microseconds, clamped to u64.
    Seconds,
}

impl Family {
    fn index(self) -> usize {
        self as usize
    }

    fn engine(self) -> Engine {
        use Family::*;
        match self {
            VllmWaiting | VllmRunning | VllmKv | VllmKvOld | VllmItlSum | VllmItlCount
            | VllmTpotSum | VllmTpotCount | VllmReqTpotSum | VllmReqTpotCount => Engine::Vllm,
            SglangWaiting | SglangRunning | SglangKv | SglangItlSum | SglangItlCount
            | SglangTpotSum | SglangTpotCount => Engine::Sglang,
            LlamaWaiting
            | LlamaRunning
            | LlamaPrompt
            | LlamaPromptCached
            | LlamaPredictedSeconds
            | LlamaPredicted => Engine::Llamacpp,
            TgiWaiting | TgiRunning => Engine::Tgi,
        }
    }

    fn kind(self) -> Kind {
        use Family::*;
        match self {
            VllmKv | VllmKvOld | SglangKv => Kind::Fraction,
            LlamaPrompt | LlamaPromptCached | VllmItlCount | VllmTpotCount | VllmReqTpotCount
            | SglangItlCount | SglangTpotCount | LlamaPredicted => Kind::Counter,
            VllmItlSum
            | VllmTpotSum
            | VllmReqTpotSum
            | SglangItlSum
            | SglangTpotSum
            | LlamaPredictedSeconds => Kind::Seconds,
            _ => Kind::Count,
        }
    }
}

/// The family a metric name belongs to, if it is one this module reads.
fn family(name: &[u8]) -> Option<Family> {
    use Family::*;
    let f = match name {
        b"vllm:num_requests_waiting" => VllmWaiting,
        b"vllm:num_requests_running" => VllmRunning,
        b"vllm:kv_cache_usage_perc" => VllmKv,
        b"vllm:gpu_cache_usage_perc" => VllmKvOld,
        b"llamacpp:requests_deferred" => LlamaWaiting,
        b"llamacpp:requests_processing" => LlamaRunning,
        b"llamacpp:prompt_tokens_total" => LlamaPrompt,
        b"llamacpp:prompt_tokens_cached_total" => LlamaPromptCached,
        b"llamacpp:tokens_predicted_seconds_total" => LlamaPredictedSeconds,
        b"llamacpp:tokens_predicted_total" => LlamaPredicted,
        b"vllm:inter_token_latency_seconds_sum" => VllmItlSum,
        b"vllm:inter_token_latency_seconds_count" => VllmItlCount,
        b"vllm:time_per_output_token_seconds_sum" => VllmTpotSum,
        b"vllm:time_per_output_token_seconds_count" => VllmTpotCount,
        b"vllm:request_time_per_output_token_seconds_sum" => VllmReqTpotSum,
        b"vllm:request_time_per_output_token_seconds_count" => VllmReqTpotCount,
        b"tgi_queue_size" => TgiWaiting,
        b"tgi_batch_current_size" => TgiRunning,
        _ => {
            let rest = name
                .strip_prefix(b"sglang:")
                .or_else(|| name.strip_prefix(b"sglang_"))?;
            match rest {
                b"num_queue_reqs" => SglangWaiting,
                b"num_running_reqs" => SglangRunning,
                b"token_usage" => SglangKv,
                b"inter_token_latency_seconds_sum" => SglangItlSum,
                b"inter_token_latency_seconds_count" => SglangItlCount,
                b"time_per_output_token_seconds_sum" => SglangTpotSum,
                b"time_per_output_token_seconds_count" => SglangTpotCount,
                _ => return None,
            }
        }
    };
    Some(f)
}

/// Per-family totals.
#[derive(Debug, Clone, Copy, Default)]
struct Acc {
    /// Samples seen, those left out for their model included.
    seen: u32,
    /// Distinct series used (folded slots plus overflow).
    series: u32,
    /// Sum over overflowed series (folded slots are summed at the end).
    overflow_sum: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    family: u8,
    key: u64,
    value: u64,
}

/// The fixed-size state of one scan.
struct Fold {
    slots: [Slot; SERIES_SLOTS],
    used_slots: usize,
    accs: [Acc; FAMILIES],
}

impl Fold {
    fn new() -> Self {
        Fold {
            slots: [Slot::default(); SERIES_SLOTS],
            used_slots: 0,
            accs: [Acc::default(); FAMILIES],
        }
    }

    /// Adds one series' value (already clamped to its kind's integer scale).
    fn add(&mut self, f: Family, key: u64, value: u64, stats: &mut ScanStats) {
        let fi = f.index() as u8;
        let live = self.slots.get_mut(..self.used_slots).unwrap_or(&mut []);
        if let Some(slot) = live.iter_mut().find(|s| s.family == fi && s.key == key) {
            // The same series twice: not valid exposition, keep the larger value so that the
            // result does not depend on which came first.
            slot.value = slot.value.max(value);
            stats.duplicates = stats.duplicates.saturating_add(1);
            return;
        }
        let Some(acc) = self.accs.get_mut(f.index()) else {
            return;
        };
        acc.series = acc.series.saturating_add(1);
        match self.slots.get_mut(self.used_slots) {
            Some(slot) => {
                *slot = Slot {
                    family: fi,
                    key,
                    value,
                };
                self.used_slots += 1;
            }
            None => {
                acc.overflow_sum = acc.overflow_sum.saturating_add(value);
                stats.overflow = stats.overflow.saturating_add(1);
            }
        }
    }

    fn acc(&self, f: Family) -> Acc {
        self.accs.get(f.index()).copied().unwrap_or_default()
    }

    /// The family's sum over its distinct series, `None` when it had none.
    fn sum(&self, f: Family) -> Option<u64> {
        let acc = self.acc(f);
        if acc.series == 0 {
            return None;
        }
        let fi = f.index() as u8;
        let folded = self
            .slots
            .get(..self.used_slots)
            .unwrap_or(&[])
            .iter()
            .filter(|s| s.family == fi)
            .fold(0u64, |sum, s| sum.saturating_add(s.value));
        Some(folded.saturating_add(acc.overflow_sum))
    }

    fn count(&self, f: Family) -> Option<u32> {
        self.sum(f).map(|s| u32::try_from(s).unwrap_or(u32::MAX))
    }

    /// The mean fraction over series, in thousandths (rounded half up).
    fn permille(&self, f: Family) -> Option<u16> {
        let sum = self.sum(f)?;
        let n = u64::from(self.acc(f).series.max(1));
        // sum/n is in millionths (≤ 1_000_000): thousandths, rounded.
        let micro = sum / n;
        let permille = (micro.saturating_add(500) / 1000).min(1000);
        Some(u16::try_from(permille).unwrap_or(1000))
    }
}

/// Clamps a sample value onto its family's integer scale; `None` for NaN.
fn scale(kind: Kind, v: f64) -> Option<u64> {
    if v.is_nan() {
        return None;
    }
    let v = v.max(0.0);
    Some(match kind {
        // `as` saturates (and +Inf becomes the maximum).
        Kind::Count => v.round().min(f64::from(u32::MAX)) as u64,
        Kind::Counter => v.round() as u64,
        Kind::Seconds => (v * 1_000_000.0).round() as u64,
        Kind::Fraction => (v.min(1.0) * 1_000_000.0).round() as u64,
    })
}

/// Parses one `/metrics` body.
///
/// Reads at most `max_bytes` of `body`. `full_len` is the length of the whole response body
/// (pass `body.len()` when `body` is all of it): when the bytes looked at stop short of it, the
/// last line without its `\n` is dropped rather than read as a possibly shorter number.
/// `models` is the served-model filter (empty: every model counts).
pub fn parse<S: AsRef<str>>(
    body: &[u8],
    full_len: usize,
    format: Format,
    models: &[S],
    max_bytes: usize,
) -> Parsed {
    parse_rank(body, full_len, format, models, None, max_bytes)
}

/// [`parse`] for one data-parallel rank: series labelled with another rank (vLLM `engine`,
/// SGLang `dp_rank`) are left out. Whether the page labels its series per rank at all shows in
/// [`ScanStats::own_rank`]: when it does not, nothing is left out and the load is the engine's.
pub fn parse_rank<S: AsRef<str>>(
    body: &[u8],
    full_len: usize,
    format: Format,
    models: &[S],
    rank: Option<u32>,
    max_bytes: usize,
) -> Parsed {
    let mut stats = ScanStats::default();
    let cut = body.len().min(max_bytes);
    let bytes = body.get(..cut).unwrap_or(&[]);
    let whole = cut >= body.len() && body.len() >= full_len;
    stats.bytes_read = bytes.len();
    stats.truncated = !whole;
    let want = engine_of(format);
    let mut fold = Fold::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let (line, next, terminated) = match rest.iter().position(|&b| b == b'\n') {
            Some(p) => (
                rest.get(..p).unwrap_or(&[]),
                rest.get(p + 1..).unwrap_or(&[]),
                true,
            ),
            None => (rest, &[][..], false),
        };
        rest = next;
        if !terminated && !whole {
            break;
        }
        stats.lines = stats.lines.saturating_add(1);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let sample = match classify(line) {
            Line::Blank | Line::Comment => continue,
            Line::Garbage => {
                stats.garbage_lines = stats.garbage_lines.saturating_add(1);
                continue;
            }
            Line::Sample(s) => s,
        };
        stats.samples = stats.samples.saturating_add(1);
        let Some(f) = family(sample.name) else {
            continue;
        };
        if want.is_some_and(|e| e != f.engine()) {
            continue;
        }
        if let Some(acc) = fold.accs.get_mut(f.index()) {
            acc.seen = acc.seen.saturating_add(1);
        }
        let (key, model_ok, rank_of) = series_key(sample.labels, models, rank);
        if !model_ok {
            stats.other_model = stats.other_model.saturating_add(1);
            continue;
        }
        match rank_of {
            RankOf::Other => {
                stats.other_rank = stats.other_rank.saturating_add(1);
                continue;
            }
            RankOf::Own => stats.own_rank = stats.own_rank.saturating_add(1),
            RankOf::Unlabelled => {}
        }
        let Some(value) = scale(f.kind(), sample.value) else {
            stats.nan_values = stats.nan_values.saturating_add(1);
            continue;
        };
        stats.used = stats.used.saturating_add(1);
        fold.add(f, key, value, &mut stats);
    }
    Parsed {
        load: finish(&fold, want),
        stats,
    }
}

/// The load of the chosen engine from the folded families.
fn finish(fold: &Fold, want: Option<Engine>) -> Result<EngineLoad, LoadError> {
    use Family::*;
    let engine = match want {
        Some(e) => e,
        None => {
            // The engine with the most families present; `max_by_key` keeps the last maximum,
            // so walk the engines in reverse to let the first in `Engine::ALL` win ties.
            let families_seen = |e: Engine| {
                Family::ALL
                    .iter()
                    .filter(|f| f.engine() == e && fold.acc(**f).seen > 0)
                    .count()
            };
            let (e, n) = Engine::ALL
                .into_iter()
                .rev()
                .map(|e| (e, families_seen(e)))
                .max_by_key(|(_, n)| *n)
                .unwrap_or((Engine::Vllm, 0));
            if n == 0 {
                return Err(LoadError::NoSeries);
            }
            e
        }
    };
    let (waiting, running, kv) = match engine {
        Engine::Vllm => (VllmWaiting, VllmRunning, Some((VllmKv, Some(VllmKvOld)))),
        Engine::Sglang => (SglangWaiting, SglangRunning, Some((SglangKv, None))),
        Engine::Llamacpp => (LlamaWaiting, LlamaRunning, None),
        Engine::Tgi => (TgiWaiting, TgiRunning, None),
    };
    let kv_usage_permille = kv.and_then(|(new, old)| {
        fold.permille(new)
            .or_else(|| old.and_then(|o| fold.permille(o)))
    });
    let load = EngineLoad {
        engine,
        waiting: fold.count(waiting),
        running: fold.count(running),
        kv_usage_permille,
        prompt_tokens_total: (engine == Engine::Llamacpp)
            .then(|| fold.sum(LlamaPrompt))
            .flatten(),
        prompt_tokens_cached_total: (engine == Engine::Llamacpp)
            .then(|| fold.sum(LlamaPromptCached))
            .flatten(),
        decode: decode_totals(fold, engine),
    };
    if load.waiting.is_some() || load.running.is_some() || load.kv_usage_permille.is_some() {
        return Ok(load);
    }
    let relevant: &[Family] = match engine {
        Engine::Vllm => &[VllmWaiting, VllmRunning, VllmKv, VllmKvOld],
        Engine::Sglang => &[SglangWaiting, SglangRunning, SglangKv],
        Engine::Llamacpp => &[LlamaWaiting, LlamaRunning],
        Engine::Tgi => &[TgiWaiting, TgiRunning],
    };
    if relevant.iter().any(|f| fold.acc(*f).seen > 0) {
        Err(LoadError::ModelNotServed)
    } else {
        Err(LoadError::NoSeries)
    }
}

/// The engine's decode counters: the first of its [`DECODE_PAIRS`] whose sum and count were
/// both in the body.
fn decode_totals(fold: &Fold, engine: Engine) -> Option<DecodeTotals> {
    DECODE_PAIRS
        .iter()
        .filter(|(sum, _)| sum.engine() == engine)
        .find_map(|(sum, count)| {
            Some(DecodeTotals {
                seconds_us: fold.sum(*sum)?,
                count: fold.sum(*count)?,
            })
        })
}

/// A series' data-parallel rank against the one asked for ([`parse_rank`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RankOf {
    /// No rank asked for, or the series names none.
    Unlabelled,
    Own,
    Other,
}

/// An order-independent key of a series' label set (a sum of per-pair hashes, so `{a,b}` and
/// `{b,a}` are the same series), whether its `model_name` (if any) passes the filter, and its
/// rank against `rank`. `labels` has been validated by [`classify`].
fn series_key<S: AsRef<str>>(
    labels: &[u8],
    models: &[S],
    rank: Option<u32>,
) -> (u64, bool, RankOf) {
    let mut key = 0u64;
    let mut model_ok = true;
    let mut rank_of = RankOf::Unlabelled;
    for (name, raw) in Labels::new(labels).map_while(Result::ok) {
        let h = xxh3_64_with_seed(raw, xxh3_64_with_seed(name, SERIES_SEED));
        key = key.wrapping_add(h);
        if name == MODEL_LABEL && !models.is_empty() {
            model_ok = models
                .iter()
                .any(|m| label_value_eq(raw, m.as_ref().as_bytes()));
        }
        if let Some(want) = rank {
            if RANK_LABELS.contains(&name) {
                let own = std::str::from_utf8(raw)
                    .ok()
                    .and_then(|v| v.parse::<u32>().ok())
                    == Some(want);
                rank_of = if own { RankOf::Own } else { RankOf::Other };
            }
        }
    }
    (key, model_ok, rank_of)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const ANY: &[&str] = &[];
    const MIB: usize = 1 << 20;

    /// vLLM V1 with two data-parallel ranks of `llama-8b` and one of `qwen-7b`, both KV names.
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-8b"} 3.0
vllm:num_requests_running{engine="1",model_name="llama-8b"} 4.0
vllm:num_requests_running{engine="0",model_name="qwen-7b"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-8b"} 2.0
vllm:num_requests_waiting{engine="1",model_name="llama-8b"} 5.0
vllm:num_requests_waiting{engine="0",model_name="qwen-7b"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-8b"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama-8b"} 0.5
vllm:kv_cache_usage_perc{engine="0",model_name="qwen-7b"} 0.9
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage (deprecated).
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="llama-8b"} 0.125
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama-8b"} 12345.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="llama-8b"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama-8b"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama-8b"} 3.25
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama-8b"} 12.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048"} 1.0
"#;

    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="qwen-7b",tp_rank="0"} 6.0
sglang:num_running_reqs{dp_rank="1",model_name="qwen-7b",tp_rank="0"} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="qwen-7b",tp_rank="0"} 3.0
sglang:num_queue_reqs{dp_rank="1",model_name="qwen-7b",tp_rank="0"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="qwen-7b",tp_rank="0"} 0.41
sglang:token_usage{dp_rank="1",model_name="qwen-7b",tp_rank="0"} 0.2
sglang:cache_hit_rate{dp_rank="0",model_name="qwen-7b",tp_rank="0"} 0.5
sglang:max_total_num_tokens{dp_rank="0",model_name="qwen-7b",tp_rank="0"} 500000.0
"#;

    const LLAMACPP: &str = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 4096
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 1.25
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 512
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 6.4
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 3000
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1.5
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 146.28
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 2048
";

    const TGI: &str = "# TYPE tgi_queue_size gauge
tgi_queue_size 4
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 12
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 16000
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le=\"0.5\"} 3
tgi_request_duration_bucket{le=\"+Inf\"} 9
tgi_request_duration_sum 4.5
tgi_request_duration_count 9
";

    fn load<S: AsRef<str>>(body: &str, format: Format, models: &[S]) -> Parsed {
        parse(body.as_bytes(), body.len(), format, models, MIB)
    }

    #[test]
    fn vllm_sums_ranks_and_filters_models() {
        let p = load(VLLM, Format::Vllm, &["llama-8b"]);
        let l = p.load.unwrap();
        assert_eq!(l.engine, Engine::Vllm);
        assert_eq!(l.waiting, Some(2 + 5));
        assert_eq!(l.running, Some(3 + 4));
        // Mean of 0.25 and 0.5; the deprecated gauge (0.125) is ignored.
        assert_eq!(l.kv_usage_permille, Some(375));
        assert_eq!(l.prompt_tokens_total, None);
        // Two ranks of three families, and the deprecated gauge's one series.
        assert_eq!(p.stats.used, 7);
        assert_eq!(p.stats.other_model, 3);
        assert_eq!(p.stats.garbage_lines, 0);
        assert_eq!(p.stats.samples, 16);
        assert!(!p.stats.truncated);

        let all = load(VLLM, Format::Vllm, ANY).load.unwrap();
        assert_eq!(all.waiting, Some(14));
        assert_eq!(all.running, Some(8));
        // (0.25 + 0.5 + 0.9) / 3 = 0.55.
        assert_eq!(all.kv_usage_permille, Some(550));

        let two = load(VLLM, Format::Vllm, &["qwen-7b", "llama-8b"]).load;
        assert_eq!(two.unwrap().waiting, Some(14));
        let qwen = load(VLLM, Format::Auto, &["qwen-7b".to_string()]).load;
        assert_eq!(qwen.unwrap().waiting, Some(7));
    }

    #[test]
    fn one_rank_reads_its_own_series() {
        let rank = |body: &str, format, r| {
            parse_rank(
                body.as_bytes(),
                body.len(),
                format,
                &["llama-8b"],
                Some(r),
                usize::MAX,
            )
        };
        // vLLM labels each data-parallel engine's series `engine="k"`.
        let p = rank(VLLM, Format::Vllm, 1);
        let l = p.load.unwrap();
        assert_eq!(
            (l.waiting, l.running, l.kv_usage_permille),
            (Some(5), Some(4), Some(500))
        );
        assert!(
            p.stats.own_rank > 0 && p.stats.other_rank > 0,
            "{:?}",
            p.stats
        );
        let l = rank(VLLM, Format::Vllm, 0).load.unwrap();
        assert_eq!(
            (l.waiting, l.running, l.kv_usage_permille),
            (Some(2), Some(3), Some(250))
        );
        // SGLang labels them `dp_rank="k"`.
        let l = parse_rank(
            SGLANG.as_bytes(),
            SGLANG.len(),
            Format::Sglang,
            &["qwen-7b"],
            Some(1),
            usize::MAX,
        )
        .load
        .unwrap();
        assert_eq!((l.waiting, l.running), (Some(0), Some(2)));
        // A page without rank labels: nothing left out, and it says so.
        let body = "vllm:num_requests_waiting 6\nvllm:num_requests_running 2\n";
        let p = rank(body, Format::Vllm, 1);
        assert_eq!(p.stats.own_rank, 0);
        assert_eq!(p.load.unwrap().waiting, Some(6));
        // A rank no series names: every labelled series is another rank's.
        let p = rank(VLLM, Format::Vllm, 7);
        assert_eq!(p.stats.own_rank, 0);
        assert!(p.stats.other_rank > 0);
    }

    #[test]
    fn vllm_old_kv_name_when_the_new_is_absent() {
        let body = "vllm:num_requests_waiting{engine=\"0\"} 1\n\
                    vllm:gpu_cache_usage_perc{engine=\"0\"} 0.3\n\
                    vllm:gpu_cache_usage_perc{engine=\"1\"} 0.4\n";
        let l = load(body, Format::Vllm, ANY).load.unwrap();
        assert_eq!(l.kv_usage_permille, Some(350));
        assert_eq!(l.running, None);
    }

    #[test]
    fn sglang_both_prefixes_and_crlf() {
        let l = load(SGLANG, Format::Sglang, &["qwen-7b"]).load.unwrap();
        assert_eq!(l.engine, Engine::Sglang);
        assert_eq!((l.waiting, l.running), (Some(3), Some(8)));
        // (0.41 + 0.2) / 2 = 0.305.
        assert_eq!(l.kv_usage_permille, Some(305));

        let underscored = SGLANG.replace("sglang:", "sglang_").replace('\n', "\r\n");
        let p = load(&underscored, Format::Auto, ANY);
        assert_eq!(p.load, Ok(l));
        assert_eq!(p.stats.garbage_lines, 0);
    }

    #[test]
    fn llamacpp_queue_and_prompt_counters() {
        let p = load(LLAMACPP, Format::Auto, &["ignored: no model label"]);
        let l = p.load.unwrap();
        assert_eq!(
            l,
            EngineLoad {
                engine: Engine::Llamacpp,
                waiting: Some(1),
                running: Some(2),
                kv_usage_permille: None,
                prompt_tokens_total: Some(4096),
                prompt_tokens_cached_total: Some(3000),
                decode: Some(DecodeTotals {
                    seconds_us: 6_400_000,
                    count: 512
                }),
            }
        );
    }

    /// Decode counters: vLLM's newest histogram wins over the deprecated name (its `_sum` and
    /// `_count` are never mixed with another's), summed over ranks and filtered by model;
    /// SGLang's under either prefix; a sum without its count gives no pair.
    #[test]
    fn decode_counters_per_engine() {
        let vllm = format!(
            "{VLLM}vllm:time_per_output_token_seconds_sum{{engine=\"0\",model_name=\"llama-8b\"}} 99.0
vllm:time_per_output_token_seconds_count{{engine=\"0\",model_name=\"llama-8b\"}} 9
vllm:inter_token_latency_seconds_sum{{engine=\"0\",model_name=\"llama-8b\"}} 1.5
vllm:inter_token_latency_seconds_sum{{engine=\"1\",model_name=\"llama-8b\"}} 0.25
vllm:inter_token_latency_seconds_sum{{engine=\"0\",model_name=\"qwen-7b\"}} 70
vllm:inter_token_latency_seconds_count{{engine=\"0\",model_name=\"llama-8b\"}} 300
vllm:inter_token_latency_seconds_count{{engine=\"1\",model_name=\"llama-8b\"}} 50
vllm:inter_token_latency_seconds_count{{engine=\"0\",model_name=\"qwen-7b\"}} 7
vllm:inter_token_latency_seconds_bucket{{engine=\"0\",le=\"0.01\",model_name=\"llama-8b\"}} 300
"
        );
        let d = |p: Parsed| p.load.ok().and_then(|l| l.decode);
        let want = Some(DecodeTotals {
            seconds_us: 1_750_000,
            count: 350,
        });
        assert_eq!(d(load(&vllm, Format::Vllm, &["llama-8b"])), want);
        assert_eq!(d(load(&vllm, Format::Auto, &["llama-8b"])), want);
        // Only the deprecated name: used.
        let old = format!(
            "{VLLM}vllm:time_per_output_token_seconds_sum{{engine=\"0\",model_name=\"llama-8b\"}} 0.5
vllm:time_per_output_token_seconds_count{{engine=\"0\",model_name=\"llama-8b\"}} 100
vllm:inter_token_latency_seconds_sum{{engine=\"0\",model_name=\"llama-8b\"}} 1.5
"
        );
        assert_eq!(
            d(load(&old, Format::Vllm, &["llama-8b"])),
            Some(DecodeTotals {
                seconds_us: 500_000,
                count: 100
            })
        );
        assert_eq!(d(load(VLLM, Format::Vllm, ANY)), None);
        for prefix in ["sglang:", "sglang_"] {
            let body = format!(
                "{SGLANG}{prefix}inter_token_latency_seconds_sum{{model_name=\"qwen-7b\"}} 2.0
{prefix}inter_token_latency_seconds_count{{model_name=\"qwen-7b\"}} 1000
"
            );
            assert_eq!(
                d(load(&body, Format::Sglang, ANY)),
                Some(DecodeTotals {
                    seconds_us: 2_000_000,
                    count: 1000
                })
            );
        }
        // Another engine's counters are not read.
        let mixed = format!(
            "{TGI}llamacpp:tokens_predicted_seconds_total 1\nllamacpp:tokens_predicted_total 9\n"
        );
        assert_eq!(d(load(&mixed, Format::Tgi, ANY)), None);
        // Garbage values clamp: negative reads as 0, +Inf saturates, NaN drops the series.
        let odd = format!(
            "{SGLANG}sglang:inter_token_latency_seconds_sum -3\nsglang:inter_token_latency_seconds_count +Inf\n"
        );
        assert_eq!(
            d(load(&odd, Format::Sglang, ANY)),
            Some(DecodeTotals {
                seconds_us: 0,
                count: u64::MAX
            })
        );
        let nan = format!(
            "{SGLANG}sglang:inter_token_latency_seconds_sum NaN\nsglang:inter_token_latency_seconds_count 5\n"
        );
        assert_eq!(d(load(&nan, Format::Sglang, ANY)), None);
    }

    #[test]
    fn tgi_queue_and_batch() {
        let l = load(TGI, Format::Tgi, ANY).load.unwrap();
        assert_eq!(l.engine, Engine::Tgi);
        assert_eq!(
            (l.waiting, l.running, l.kv_usage_permille),
            (Some(4), Some(12), None)
        );
    }

    #[test]
    fn auto_detects_each_engine() {
        for (body, engine) in [
            (VLLM, Engine::Vllm),
            (SGLANG, Engine::Sglang),
            (LLAMACPP, Engine::Llamacpp),
            (TGI, Engine::Tgi),
        ] {
            assert_eq!(load(body, Format::Auto, ANY).load.unwrap().engine, engine);
        }
        // A fixed format ignores another engine's names.
        assert_eq!(load(TGI, Format::Vllm, ANY).load, Err(LoadError::NoSeries));
        // Two engines in one body (an aggregator): the one with more families wins.
        let mixed = format!("{TGI}{SGLANG}");
        assert_eq!(
            load(&mixed, Format::Auto, ANY).load.unwrap().engine,
            Engine::Sglang
        );
    }

    #[test]
    fn nothing_relevant_and_model_not_served() {
        assert_eq!(load("", Format::Auto, ANY).load, Err(LoadError::NoSeries));
        let p = load("# only a comment\nfoo 1\n", Format::Auto, ANY);
        assert_eq!(p.load, Err(LoadError::NoSeries));
        assert_eq!(p.stats.samples, 1);
        assert_eq!(
            load(VLLM, Format::Vllm, &["mistral"]).load,
            Err(LoadError::ModelNotServed)
        );
    }

    #[test]
    fn numbers_exponents_nan_inf_negative_timestamps() {
        let body = "vllm:num_requests_waiting{engine=\"0\"} 1.2e1 1700000000000\n\
                    vllm:num_requests_waiting{engine=\"1\"} NaN\n\
                    vllm:num_requests_waiting{engine=\"2\"} -3\n\
                    vllm:num_requests_running{engine=\"0\"} +Inf\n\
                    vllm:num_requests_running{engine=\"1\"} 5\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 1.7\n\
                    vllm:kv_cache_usage_perc{engine=\"1\"} -0.2\n";
        let p = load(body, Format::Vllm, ANY);
        let l = p.load.unwrap();
        assert_eq!(l.waiting, Some(12));
        assert_eq!(l.running, Some(u32::MAX));
        // Clamped to 1 and 0: mean 0.5.
        assert_eq!(l.kv_usage_permille, Some(500));
        assert_eq!(p.stats.nan_values, 1);
        assert_eq!(p.stats.used, 6);
        let huge = load("tgi_queue_size 1e300\n", Format::Tgi, ANY)
            .load
            .unwrap();
        assert_eq!(huge.waiting, Some(u32::MAX));
        let counter = "llamacpp:prompt_tokens_total +Inf\nllamacpp:requests_deferred 0\n";
        let c = load(counter, Format::Llamacpp, ANY).load.unwrap();
        assert_eq!(c.prompt_tokens_total, Some(u64::MAX));
        assert_eq!(c.waiting, Some(0));
    }

    #[test]
    fn labels_with_escapes_spaces_and_trailing_comma() {
        let body = "vllm:num_requests_waiting{model_name=\"we\\\"ird}, m\",engine=\"0\",} 4\n\
                    vllm:num_requests_waiting { engine = \"1\" , model_name=\"a\\\\b\\nc\" } 6\n\
                    vllm:num_requests_waiting{model_name=\"other\"} 100\n";
        let p = load(body, Format::Vllm, &["we\"ird}, m", "a\\b\nc"]);
        assert_eq!(p.stats.garbage_lines, 0);
        assert_eq!(p.stats.other_model, 1);
        assert_eq!(p.load.unwrap().waiting, Some(4 + 6));
        // Without the filter the third series counts too.
        assert_eq!(
            load(body, Format::Vllm, ANY).load.unwrap().waiting,
            Some(110)
        );
    }

    #[test]
    fn garbage_lines_are_counted_and_skipped() {
        let body = "garbage here\n\
                    {\"json\": true}\n\
                    vllm:num_requests_waiting{engine=\"0\" 3\n\
                    vllm:num_requests_waiting{engine=0} 3\n\
                    vllm:num_requests_waiting{engine=\"0\"} three\n\
                    vllm:num_requests_waiting{engine=\"0\"} 3 12 13\n\
                    vllm:num_requests_waiting{engine=\"0\"} 3 1.5\n\
                    vllm:num_requests_waiting\n\
                    9lives 1\n\
                    \u{feff}\u{2603} 1\n\
                    \n   \t\n\
                    vllm:num_requests_waiting{engine=\"1\"} 2\n";
        let p = load(body, Format::Auto, ANY);
        assert_eq!(p.stats.garbage_lines, 10);
        assert_eq!(p.stats.lines, 13);
        assert_eq!(p.load.unwrap().waiting, Some(2));
    }

    #[test]
    fn duplicate_series_count_once_whatever_the_label_order() {
        let body = "tgi_queue_size{a=\"1\",b=\"2\"} 3\n\
                    tgi_queue_size{b=\"2\",a=\"1\"} 5\n\
                    tgi_queue_size{a=\"2\",b=\"1\"} 1\n";
        let p = load(body, Format::Tgi, ANY);
        assert_eq!(p.load.unwrap().waiting, Some(5 + 1));
        assert_eq!(p.stats.duplicates, 1);
    }

    #[test]
    fn series_beyond_the_fold_table_are_still_summed() {
        let body: String = (0..100)
            .map(|i| format!("vllm:num_requests_running{{engine=\"{i}\"}} 2\n"))
            .collect();
        let p = load(&body, Format::Vllm, ANY);
        assert_eq!(p.load.unwrap().running, Some(200));
        assert_eq!(p.stats.overflow, 100 - SERIES_SLOTS as u32);
    }

    #[test]
    fn truncated_input_drops_the_partial_line() {
        let body = "tgi_queue_size 12\ntgi_batch_current_size 34\n";
        // Cut by the limit inside "34": the running value is not read as 3.
        let cut = body.find("34").unwrap() + 1;
        let p = parse(body.as_bytes(), body.len(), Format::Tgi, ANY, cut);
        assert_eq!(p.stats.bytes_read, cut);
        assert!(p.stats.truncated);
        let l = p.load.unwrap();
        assert_eq!((l.waiting, l.running), (Some(12), None));
        // The caller got only a prefix of a longer body.
        let prefix = &body.as_bytes()[..cut];
        let p = parse(prefix, body.len(), Format::Tgi, ANY, MIB);
        assert!(p.stats.truncated);
        assert_eq!(p.load.unwrap().running, None);
        // A whole body without its final newline is read to its end.
        let whole = body.trim_end();
        let p = parse(whole.as_bytes(), whole.len(), Format::Tgi, ANY, MIB);
        assert!(!p.stats.truncated);
        assert_eq!(p.load.unwrap().running, Some(34));
    }

    #[test]
    fn ten_mib_of_junk_is_bounded_by_the_limit() {
        let line = "junk junk {{{ \"\\ 1e999 vllm:num_requests_waiting\r\n";
        let mut body = line.repeat(10 * MIB / line.len() + 1).into_bytes();
        body.extend_from_slice(b"vllm:num_requests_waiting 9\n");
        assert!(body.len() > 10 * MIB);
        let p = parse(&body, body.len(), Format::Auto, ANY, MIB);
        assert_eq!(p.stats.bytes_read, MIB);
        assert!(p.stats.truncated);
        assert_eq!(p.load, Err(LoadError::NoSeries));
        assert_eq!(p.stats.garbage_lines, (MIB / line.len()) as u32);
        // With no limit, the whole body is read and the last line found.
        let p = parse(&body, body.len(), Format::Auto, ANY, usize::MAX);
        assert_eq!(p.load.unwrap().waiting, Some(9));
        assert_eq!(p.stats.garbage_lines, (10 * MIB / line.len() + 1) as u32);
        assert!(!p.stats.truncated);
    }

    #[test]
    fn label_value_comparison_resolves_escapes() {
        assert!(label_value_eq(br#"a\"b"#, b"a\"b"));
        assert!(label_value_eq(br"a\\b", b"a\\b"));
        assert!(label_value_eq(br"a\nb", b"a\nb"));
        assert!(!label_value_eq(br"a\nb", b"a\\nb"));
        assert!(!label_value_eq(b"ab", b"abc"));
        assert!(!label_value_eq(b"abc", b"ab"));
        assert!(label_value_eq(b"", b""));
    }

    #[test]
    fn format_names() {
        assert_eq!(Format::from_name("vllm"), Some(Format::Vllm));
        assert_eq!(Format::from_name("auto"), Some(Format::Auto));
        assert_eq!(Format::from_name("VLLM"), None);
        for e in Engine::ALL {
            assert_eq!(Engine::from_code(e.code()), Some(e));
            assert_eq!(Format::from_name(e.name()).and_then(engine_of), Some(e));
        }
    }
}
