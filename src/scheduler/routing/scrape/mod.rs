//! The bookkeeping around scraping engines' `/metrics`: who scrapes, what was scraped, and
//! whether it can still be trusted.
//! Lease, record and quantization here, the slot keys and their readers in `slots.rs`: one
//! shared-data protocol, tested together below.
//!
//! Why: an Envoy process runs one VM per worker thread, and every one of them has a root
//! context with a timer. If each scraped, an engine would be asked `workers` times per
//! interval, and each worker would hold a slightly different picture. Instead the workers share
//! a **lease** in shared data: the worker holding it scrapes every endpoint and folds each
//! endpoint's **record** into its own slot key ([`fold`], [`slot_key`]: bounded by the
//! configuration); every worker reads them into its [`LoadsMemo`] at its tick. A lease that is not renewed (its VM
//! was torn down, its timer stalled) lapses after `lease_ms`, and the next worker to ask takes
//! it over.
//!
//! - [`try_take`]: takes the lease when it is free, expired or undecodable, renews it when the
//!   caller already holds it; a live lease of another holder is left alone. Every write is a
//!   CAS, so two workers racing for a lapsed lease cannot both win.
//! - [`Scraped`]: the per-endpoint record (last good load, when it was scraped, consecutive
//!   failures and the last error), in a versioned fixed-width codec; bytes that do not decode
//!   read as absent.
//! - [`Scraped::state_at`]: a load is [`LoadState::Known`] only when the last scrape succeeded
//!   and is at most `stale_after_ms` old. Anything else is [`LoadState::Unknown`] — never
//!   "healthy" and never "dead": the scheduler then falls back to what it knew without metrics.
//! - [`quantize`]: queue lengths in power-of-two buckets and KV usage in 10 % steps, so that
//!   Envoy replicas scraping the same engines a moment apart usually agree on the inputs of
//!   rendezvous placement (values near a bucket edge can still differ for one interval).
//! - [`Scraped::pace`]: the engine's own **decode pace**, from the cumulative decode counters
//!   it publishes ([`DecodeTotals`]: seconds and tokens). The record keeps the counters at the
//!   start of the current window; once the engine has decoded at least [`PACE_MIN_TOKENS`]
//!   since, the window closes: its pace is Δseconds ÷ Δtokens, and the next window starts at
//!   the counters just read. A smaller window stays open across scrapes (a few tokens are
//!   noise), and the last closed window's pace stands meanwhile: an idle engine keeps the pace
//!   it last showed, since nothing it did since says otherwise. A counter that went down is an
//!   engine restart: the window restarts from the new counters and the old pace is dropped (it
//!   measured another process). The pace is usable only while the record's load is
//!   [`LoadState::Known`] (fresh): every Envoy replica scraping the same engine derives nearly
//!   the same pace, where each replica's own answers see a third of the traffic.

pub mod plan;
mod slots;
pub use slots::*;

use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::store::{update, update_if, Store};
use crate::scheduler::wire::engine_load::{DecodeTotals, Engine, EngineLoad, LoadError};

/// Tokens (Δcount of the engine's decode counters) a window needs before its pace is taken.
/// 32 tokens are a fraction of one answer on an engine serving traffic (one scrape interval of
/// the bench's engines decodes hundreds), and enough that per-token jitter averages out.
pub const PACE_MIN_TOKENS: u64 = 32;

/// An engine's decode pace over its last closed window (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// Decode time per token (per observation), µs, at least 1.
    pub us_per_token: u32,
    /// When the window closed (the scrape that read its end).
    pub at_ms: u64,
}

/// The shared-data key of the scrape lease (one per Envoy process: the VM's shared data).
pub const LEASE_KEY: &str = "computeflux/scrape/lease";

const LEASE_VERSION: u8 = 1;
const LEASE_BYTES: usize = 1 + 8 + 8;

/// Bits of the lease's holder word that hold the holder id; the bits above hold the
/// configuration generation (see [`Lease`]).
pub const HOLDER_BITS: u32 = 48;
const HOLDER_MASK: u64 = (1 << HOLDER_BITS) - 1;
/// The largest generation a lease records (later ones count as this).
pub const MAX_LEASE_GENERATION: u64 = (1 << (64 - HOLDER_BITS)) - 1;

/// The scrape lease: which VM scrapes, for which configuration, until when.
///
/// Codec: version `1`, the holder word (u64: the configuration generation in its top 16 bits,
/// the holder id in the low [`HOLDER_BITS`]), the expiry (u64). The generation shares the
/// holder word so that a module of the previous landing (which reads the word as a holder id)
/// still takes a newer module's live lease for another holder's and leaves it alone; its own
/// leases read here as generation 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The holder's id: a nonce drawn once per VM (at most [`HOLDER_BITS`] bits).
    pub holder: u64,
    /// The holder's configuration generation (`Config::layout_generation`, at most
    /// [`MAX_LEASE_GENERATION`]): a newer configuration takes a live lease over from an older
    /// one still draining.
    pub generation: u64,
    /// The lease is free from this instant on.
    pub expires_ms: u64,
}

impl Lease {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(LEASE_BYTES);
        w.u8(LEASE_VERSION);
        w.u64(
            (self.generation.min(MAX_LEASE_GENERATION) << HOLDER_BITS)
                | (self.holder & HOLDER_MASK),
        );
        w.u64(self.expires_ms);
        w.buf
    }

    /// `None` for anything but a current-version lease of the exact length.
    pub fn decode(bytes: &[u8]) -> Option<Lease> {
        let mut r = Reader::new(bytes);
        if r.u8()? != LEASE_VERSION {
            return None;
        }
        let word = r.u64()?;
        let lease = Lease {
            holder: word & HOLDER_MASK,
            generation: word >> HOLDER_BITS,
            expires_ms: r.u64()?,
        };
        r.is_empty().then_some(lease)
    }

    /// Whether the lease is in force at `now_ms`.
    pub fn live_at(&self, now_ms: u64) -> bool {
        now_ms < self.expires_ms
    }
}

/// The lease as stored, if it decodes and is in force at `now_ms`.
pub fn current_lease(store: &dyn Store, key: &str, now_ms: u64) -> Option<Lease> {
    store
        .get(key)
        .0
        .as_deref()
        .and_then(Lease::decode)
        .filter(|l| l.live_at(now_ms))
}

/// Takes (or renews) the lease for `me`, of configuration `generation`, until `now_ms +
/// lease_ms`. True: `me` holds it now and should scrape. False: another holder's lease of the
/// same or a newer generation is in force, or every CAS attempt lost a race (someone else is
/// taking it; scrape next tick if it is still free then). A live lease of an *older*
/// generation is taken over: the configuration that replaced it scrapes its own endpoints,
/// while the old one's requests drain (before, the old one kept the lease as long as its
/// root context lived, and the endpoints the new one added went unscraped).
pub fn try_take(
    store: &dyn Store,
    key: &str,
    me: u64,
    generation: u64,
    now_ms: u64,
    lease_ms: u64,
) -> bool {
    let me = me & HOLDER_MASK;
    let generation = generation.min(MAX_LEASE_GENERATION);
    let taken = update_if(store, key, |bytes| {
        let held_by_other = bytes
            .and_then(Lease::decode)
            .is_some_and(|l| l.holder != me && l.live_at(now_ms) && l.generation >= generation);
        if held_by_other {
            return (None, false);
        }
        let lease = Lease {
            holder: me,
            generation,
            expires_ms: now_ms.saturating_add(lease_ms),
        };
        (Some(lease.encode()), true)
    });
    taken.unwrap_or(false)
}

/// Gives the lease up if `me` holds it (a VM shutting down), so the next worker need not wait
/// for it to lapse. True when it was released.
pub fn release(store: &dyn Store, key: &str, me: u64) -> bool {
    let me = me & HOLDER_MASK;
    let released = update_if(store, key, |bytes| match bytes.and_then(Lease::decode) {
        Some(l) if l.holder == me && l.expires_ms > 0 => {
            (Some(Lease { expires_ms: 0, ..l }.encode()), true)
        }
        _ => (None, false),
    });
    released.unwrap_or(false)
}

/// Why a scrape gave no load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrapeError {
    /// `dispatch_http_call` refused the call (unknown cluster, bad headers).
    Dispatch,
    /// No answer within the timeout, or the connection failed.
    Timeout,
    /// An answer with a non-2xx status.
    Status,
    /// A 2xx answer without any of the format's families.
    NoSeries,
    /// The families were there, for other models only.
    ModelNotServed,
    /// The body was larger than the scraper reads (it is not read at all).
    TooLarge,
}

impl ScrapeError {
    pub const ALL: [ScrapeError; 6] = [
        ScrapeError::Dispatch,
        ScrapeError::Timeout,
        ScrapeError::Status,
        ScrapeError::NoSeries,
        ScrapeError::ModelNotServed,
        ScrapeError::TooLarge,
    ];

    pub fn code(self) -> u8 {
        match self {
            ScrapeError::Dispatch => 1,
            ScrapeError::Timeout => 2,
            ScrapeError::Status => 3,
            ScrapeError::NoSeries => 4,
            ScrapeError::ModelNotServed => 5,
            ScrapeError::TooLarge => 6,
        }
    }

    pub fn from_code(code: u8) -> Option<ScrapeError> {
        ScrapeError::ALL.into_iter().find(|e| e.code() == code)
    }

    /// A metric tag value.
    pub fn name(self) -> &'static str {
        match self {
            ScrapeError::Dispatch => "dispatch",
            ScrapeError::Timeout => "timeout",
            ScrapeError::Status => "status",
            ScrapeError::NoSeries => "no_series",
            ScrapeError::ModelNotServed => "model_not_served",
            ScrapeError::TooLarge => "too_large",
        }
    }
}

impl From<LoadError> for ScrapeError {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::NoSeries => ScrapeError::NoSeries,
            LoadError::ModelNotServed => ScrapeError::ModelNotServed,
        }
    }
}

/// Why a load is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// No scrape has succeeded yet (and none has failed either).
    NeverScraped,
    /// The last scrape failed (however fresh the one before it).
    Failed(ScrapeError),
    /// The last success is older than `stale_after_ms` (the scraper stopped).
    Stale,
}

/// An endpoint's load as the scheduler may use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadState {
    Known(EngineLoad),
    Unknown(Unknown),
}

const RECORD_VERSION: u8 = 2;
/// version, flags, engine, waiting, running, kv, prompt, cached, scraped_at, attempted_at,
/// failures, last error, decode totals (seconds, count), window base (seconds, count), pace
/// (µs per token, at).
const RECORD_BYTES: usize = 1 + 1 + 1 + 4 + 4 + 4 + 8 + 8 + 8 + 8 + 4 + 1 + 16 + 16 + 4 + 8;

const HAS_LOAD: u8 = 1;
const HAS_WAITING: u8 = 1 << 1;
const HAS_RUNNING: u8 = 1 << 2;
const HAS_KV: u8 = 1 << 3;
const HAS_PROMPT: u8 = 1 << 4;
const HAS_CACHED: u8 = 1 << 5;
/// The last load has decode totals (and then the record has a window base).
const HAS_DECODE: u8 = 1 << 6;
const HAS_PACE: u8 = 1 << 7;
const ALL_FLAGS: u8 =
    HAS_LOAD | HAS_WAITING | HAS_RUNNING | HAS_KV | HAS_PROMPT | HAS_CACHED | HAS_DECODE | HAS_PACE;

/// One endpoint's scrape record, as kept in shared data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Scraped {
    /// The load of the last successful scrape.
    pub last: Option<EngineLoad>,
    /// When the last successful scrape answered (0: never).
    pub scraped_at_ms: u64,
    /// When the last scrape, successful or not, ended.
    pub attempted_at_ms: u64,
    /// Failed scrapes since the last success.
    pub consecutive_failures: u32,
    /// The error of the last failed scrape (kept after a success, for the logs).
    pub last_error: Option<ScrapeError>,
    /// The engine's decode counters at the start of the open pace window (present exactly
    /// when the last load has decode totals).
    pub decode_base: Option<DecodeTotals>,
    /// The pace of the last closed window (only with a window base).
    pub pace: Option<Pace>,
}

impl Scraped {
    /// Folds in a successful scrape.
    pub fn succeeded(&mut self, load: EngineLoad, now_ms: u64) {
        self.advance_pace(load.decode, now_ms);
        self.last = Some(load);
        self.scraped_at_ms = now_ms;
        self.attempted_at_ms = now_ms;
        self.consecutive_failures = 0;
    }

    /// Moves the pace window to the counters `now` (see the module doc): closes it once
    /// [`PACE_MIN_TOKENS`] were decoded since its base, restarts it (dropping the pace) when a
    /// counter went down, and forgets both when the engine stopped publishing the counters.
    fn advance_pace(&mut self, now: Option<DecodeTotals>, now_ms: u64) {
        let Some(now) = now else {
            self.decode_base = None;
            self.pace = None;
            return;
        };
        let Some(base) = self.decode_base else {
            self.decode_base = Some(now);
            return;
        };
        if now.seconds_us < base.seconds_us || now.count < base.count {
            self.decode_base = Some(now);
            self.pace = None;
            return;
        }
        let tokens = now.count - base.count;
        if tokens < PACE_MIN_TOKENS {
            return;
        }
        let us = (now.seconds_us - base.seconds_us) / tokens;
        self.pace = Some(Pace {
            us_per_token: u32::try_from(us).unwrap_or(u32::MAX).max(1),
            at_ms: now_ms,
        });
        self.decode_base = Some(now);
    }

    /// The engine's decode pace, µs per token, when its load is known at `now_ms` (see
    /// [`Scraped::state_at`]) and a window has closed since it last (re)started.
    pub fn pace_at(&self, now_ms: u64, stale_after_ms: u64) -> Option<u32> {
        match self.state_at(now_ms, stale_after_ms) {
            LoadState::Known(_) => self.pace.map(|p| p.us_per_token),
            LoadState::Unknown(_) => None,
        }
    }

    /// Folds in a failed scrape; the last good load is kept but no longer [`LoadState::Known`].
    pub fn failed(&mut self, error: ScrapeError, now_ms: u64) {
        self.attempted_at_ms = now_ms;
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.last_error = Some(error);
    }

    /// Time since the last successful scrape, `None` before the first (a gauge of age).
    pub fn age_ms(&self, now_ms: u64) -> Option<u64> {
        self.last.map(|_| now_ms.saturating_sub(self.scraped_at_ms))
    }

    /// The load the scheduler may use at `now_ms`: the last scrape's, when it succeeded and is
    /// at most `stale_after_ms` old.
    pub fn state_at(&self, now_ms: u64, stale_after_ms: u64) -> LoadState {
        if self.consecutive_failures > 0 {
            let e = self.last_error.unwrap_or(ScrapeError::Timeout);
            return LoadState::Unknown(Unknown::Failed(e));
        }
        let Some(load) = self.last else {
            return LoadState::Unknown(Unknown::NeverScraped);
        };
        if now_ms.saturating_sub(self.scraped_at_ms) > stale_after_ms {
            return LoadState::Unknown(Unknown::Stale);
        }
        LoadState::Known(load)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(RECORD_BYTES);
        w.u8(RECORD_VERSION);
        let l = self.last;
        let mut flags = 0;
        let mut set = |bit: u8, on: bool| {
            if on {
                flags |= bit;
            }
        };
        set(HAS_LOAD, l.is_some());
        set(HAS_WAITING, l.is_some_and(|l| l.waiting.is_some()));
        set(HAS_RUNNING, l.is_some_and(|l| l.running.is_some()));
        set(HAS_KV, l.is_some_and(|l| l.kv_usage_permille.is_some()));
        set(
            HAS_PROMPT,
            l.is_some_and(|l| l.prompt_tokens_total.is_some()),
        );
        set(
            HAS_CACHED,
            l.is_some_and(|l| l.prompt_tokens_cached_total.is_some()),
        );
        let decode = l.and_then(|l| l.decode);
        set(HAS_DECODE, decode.is_some());
        set(HAS_PACE, self.pace.is_some());
        w.u8(flags);
        w.u8(l.map_or(0, |l| l.engine.code()));
        w.u32(l.and_then(|l| l.waiting).unwrap_or(0));
        w.u32(l.and_then(|l| l.running).unwrap_or(0));
        w.u32(l.and_then(|l| l.kv_usage_permille).map_or(0, u32::from));
        w.u64(l.and_then(|l| l.prompt_tokens_total).unwrap_or(0));
        w.u64(l.and_then(|l| l.prompt_tokens_cached_total).unwrap_or(0));
        w.u64(self.scraped_at_ms);
        w.u64(self.attempted_at_ms);
        w.u32(self.consecutive_failures);
        w.u8(self.last_error.map_or(0, ScrapeError::code));
        let d = decode.unwrap_or_default();
        w.u64(d.seconds_us);
        w.u64(d.count);
        let b = self.decode_base.unwrap_or_default();
        w.u64(b.seconds_us);
        w.u64(b.count);
        w.u32(self.pace.map_or(0, |p| p.us_per_token));
        w.u64(self.pace.map_or(0, |p| p.at_ms));
        w.buf
    }

    /// `None` unless the bytes are exactly what [`Scraped::encode`] writes for some record
    /// (current version, known codes, KV ≤ 1000, absent fields zero, a window base exactly
    /// with decode totals, a pace only with a base and at least 1 µs, nothing trailing).
    pub fn decode(bytes: &[u8]) -> Option<Scraped> {
        let mut r = Reader::new(bytes);
        if r.u8()? != RECORD_VERSION {
            return None;
        }
        let flags = r.u8()?;
        let engine = r.u8()?;
        let waiting = r.u32()?;
        let running = r.u32()?;
        let kv = r.u32()?;
        let prompt = r.u64()?;
        let cached = r.u64()?;
        let scraped_at_ms = r.u64()?;
        let attempted_at_ms = r.u64()?;
        let consecutive_failures = r.u32()?;
        let error = r.u8()?;
        let decode = DecodeTotals {
            seconds_us: r.u64()?,
            count: r.u64()?,
        };
        let base = DecodeTotals {
            seconds_us: r.u64()?,
            count: r.u64()?,
        };
        let pace_us = r.u32()?;
        let pace_at_ms = r.u64()?;
        // Every flag bit has a meaning: no unknown bits to reject.
        const _: () = assert!(ALL_FLAGS == u8::MAX);
        if !r.is_empty() {
            return None;
        }
        let has_decode = flags & HAS_DECODE != 0;
        let has_pace = flags & HAS_PACE != 0;
        let zero = DecodeTotals::default();
        // Decode totals and a window base go together (with a load: checked below); a pace
        // needs them; absent values are zero (one encoding per record).
        let consistent = if has_decode {
            !has_pace || pace_us >= 1
        } else {
            decode == zero && base == zero && !has_pace
        } && (has_pace || (pace_us == 0 && pace_at_ms == 0));
        if !consistent {
            return None;
        }
        let (decode_base, pace) = if has_decode {
            let pace = has_pace.then_some(Pace {
                us_per_token: pace_us,
                at_ms: pace_at_ms,
            });
            (Some(base), pace)
        } else {
            (None, None)
        };
        let last_error = match error {
            0 => None,
            c => Some(ScrapeError::from_code(c)?),
        };
        // A field is present when its flag is set; an absent field must be zero (one encoding
        // per record).
        fn field<T: Copy + PartialEq + Default>(flags: u8, bit: u8, v: T) -> Option<Option<T>> {
            match (flags & bit != 0, v == T::default()) {
                (true, _) => Some(Some(v)),
                (false, true) => Some(None),
                (false, false) => None,
            }
        }
        let last = if flags & HAS_LOAD != 0 {
            let kv = field(flags, HAS_KV, kv)?;
            if kv.is_some_and(|k| k > 1000) {
                return None;
            }
            Some(EngineLoad {
                engine: Engine::from_code(engine)?,
                waiting: field(flags, HAS_WAITING, waiting)?,
                running: field(flags, HAS_RUNNING, running)?,
                kv_usage_permille: kv.map(|k| u16::try_from(k).unwrap_or(1000)),
                prompt_tokens_total: field(flags, HAS_PROMPT, prompt)?,
                prompt_tokens_cached_total: field(flags, HAS_CACHED, cached)?,
                decode: has_decode.then_some(decode),
            })
        } else {
            if has_decode {
                return None;
            }
            let zero = flags == 0
                && engine == 0
                && waiting == 0
                && running == 0
                && kv == 0
                && prompt == 0
                && cached == 0;
            if !zero {
                return None;
            }
            None
        };
        Some(Scraped {
            last,
            scraped_at_ms,
            attempted_at_ms,
            consecutive_failures,
            last_error,
            decode_base,
            pace,
        })
    }
}

/// Folds one scrape's result into endpoint `id`'s record, in its own slot key
/// ([`slot_key`] of its place among `keep`, the scraped ids), and publishes it, in one
/// read-modify-write with bounded CAS retries. Returns the record written; `Err` with the
/// record it would have written when every attempt lost a race, or when `id` is not among
/// `keep` (it has no slot: nothing written).
///
/// Why a key per slot, not one value for every endpoint (as the module before this one
/// wrote): with one combined value every answer decoded and re-encoded every endpoint's
/// record (2 M instructions per answer at 1 024 endpoints, 8.6 G per second at a 250 ms
/// interval), and every reader decoded all of them when one changed. A slot is the endpoint's
/// place in the sorted scraped ids, so the keys are bounded by the configuration, whatever
/// names come and go (a key per *name*, as modules before wrote it, grew without bound: Envoy
/// never frees a key); the record carries its endpoint's id, and a slot holding another id
/// (the configuration changed) reads as never scraped. Slots a smaller configuration no
/// longer uses are emptied by the next lease holder ([`retire_slots`]).
#[allow(clippy::result_large_err)]
pub fn fold(
    store: &dyn Store,
    id: u32,
    now_ms: u64,
    result: Result<EngineLoad, ScrapeError>,
    keep: &[u32],
) -> Result<Scraped, Scraped> {
    let apply = |mut s: Scraped| {
        match result {
            Ok(load) => s.succeeded(load, now_ms),
            Err(e) => s.failed(e, now_ms),
        }
        s
    };
    let Some(slot) = sorted_ids(keep).binary_search(&id).ok() else {
        return Err(apply(Scraped::default()));
    };
    let written = update(store, &slot_key(slot), |bytes| {
        let s = apply(
            bytes
                .and_then(decode_slot)
                .filter(|(k, _)| *k == id)
                .map(|(_, r)| r)
                .unwrap_or_default(),
        );
        (encode_slot(id, &s), s)
    });
    // After the slot: a reader that sees the new count finds the slot written.
    if written.is_ok() {
        note_change(store, slot);
    }
    written
}

/// Queue lengths in power-of-two buckets: 0 → 0, 1 → 1, 2–3 → 2, 4–7 → 3, …, up to 32.
pub fn queue_bucket(n: u32) -> u8 {
    // 32 - leading_zeros is at most 32: fits a u8.
    u8::try_from(u32::BITS - n.leading_zeros()).unwrap_or(u8::MAX)
}

/// The smallest count in a [`queue_bucket`]: 0, 1, 2, 4, 8, …
pub fn bucket_floor(bucket: u8) -> u32 {
    match bucket {
        0 => 0,
        b => 1u32.checked_shl(u32::from(b) - 1).unwrap_or(1 << 31),
    }
}

/// KV usage in 10 % steps: 0–99 ‰ → 0, …, 900–999 ‰ → 9, 1000 ‰ → 10.
pub fn kv_step(permille: u16) -> u8 {
    u8::try_from(permille.min(1000) / 100).unwrap_or(10)
}

/// An engine's load as placement sees it: coarse enough that replicas agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Quantized {
    pub waiting_bucket: Option<u8>,
    pub running_bucket: Option<u8>,
    pub kv_step: Option<u8>,
}

impl Quantized {
    /// Waiting + running at their buckets' floors, where known (for bounded load).
    pub fn requests_floor(&self) -> Option<u32> {
        match (self.waiting_bucket, self.running_bucket) {
            (None, None) => None,
            (w, r) => Some(
                w.map_or(0, bucket_floor)
                    .saturating_add(r.map_or(0, bucket_floor)),
            ),
        }
    }
}

pub fn quantize(load: &EngineLoad) -> Quantized {
    Quantized {
        waiting_bucket: load.waiting.map(queue_bucket),
        running_bucket: load.running.map(queue_bucket),
        kv_step: load.kv_usage_permille.map(kv_step),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::{CasMismatch, MemStore, CAS_RETRIES};
    use std::cell::Cell;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The endpoint the record tests fold into (the loads value holds only it).
    const E: u32 = 7;

    /// Folds one scrape of `E`, as the scraper does.
    #[allow(clippy::result_large_err)]
    fn record(
        s: &dyn Store,
        now_ms: u64,
        result: Result<EngineLoad, ScrapeError>,
    ) -> Result<Scraped, Scraped> {
        fold(s, E, now_ms, result, &[E])
    }

    /// `E`'s record as published (absent: never scraped).
    fn read(s: &dyn Store) -> Scraped {
        read_loads(s, &[E]).get(E).copied().unwrap_or_default()
    }

    const A: u64 = 0xaaaa;
    const B: u64 = 0xbbbb;
    const LEASE_MS: u64 = 3_000;

    fn vllm(waiting: u32, running: u32, kv: u16) -> EngineLoad {
        EngineLoad {
            engine: Engine::Vllm,
            waiting: Some(waiting),
            running: Some(running),
            kv_usage_permille: Some(kv),
            prompt_tokens_total: None,
            prompt_tokens_cached_total: None,
            decode: None,
        }
    }

    #[test]
    fn lease_one_holder_renewal_and_handover() {
        let s = MemStore::new();
        assert!(try_take(&s, LEASE_KEY, A, 1, 1_000, LEASE_MS));
        // B cannot take a live lease, any number of times.
        assert!(!try_take(&s, LEASE_KEY, B, 1, 1_001, LEASE_MS));
        assert!(!try_take(&s, LEASE_KEY, B, 1, 3_999, LEASE_MS));
        // A renews: its lease now runs to 2_500 + 3_000.
        assert!(try_take(&s, LEASE_KEY, A, 1, 2_500, LEASE_MS));
        assert_eq!(
            current_lease(&s, LEASE_KEY, 2_500),
            Some(Lease {
                holder: A,
                generation: 1,
                expires_ms: 5_500
            })
        );
        assert!(!try_take(&s, LEASE_KEY, B, 1, 5_499, LEASE_MS));
        // A's VM is gone: at expiry B takes over, and A, back, cannot take it.
        assert!(try_take(&s, LEASE_KEY, B, 1, 5_500, LEASE_MS));
        assert!(!try_take(&s, LEASE_KEY, A, 1, 5_501, LEASE_MS));
        assert_eq!(
            current_lease(&s, LEASE_KEY, 5_501).map(|l| l.holder),
            Some(B)
        );
        assert_eq!(current_lease(&s, LEASE_KEY, 8_500), None);
        // Failed attempts did not write: A's take, A's renewal, B's takeover.
        assert_eq!(s.writes.get(), 3);
    }

    #[test]
    fn lease_release_frees_it_at_once() {
        let s = MemStore::new();
        assert!(try_take(&s, LEASE_KEY, A, 1, 0, LEASE_MS));
        assert!(!release(&s, LEASE_KEY, B));
        assert!(release(&s, LEASE_KEY, A));
        assert!(!release(&s, LEASE_KEY, A));
        assert!(try_take(&s, LEASE_KEY, B, 1, 1, LEASE_MS));
    }

    #[test]
    fn lease_cas_conflicts_retry_then_give_up() {
        let s = MemStore::new();
        s.inject_conflicts.set(CAS_RETRIES as u32 - 1);
        assert!(try_take(&s, LEASE_KEY, A, 1, 0, LEASE_MS));
        s.inject_conflicts.set(CAS_RETRIES as u32);
        // Every write lost: A does not believe it renewed, and the store still says A until 3_000.
        assert!(!try_take(&s, LEASE_KEY, A, 1, 1_000, LEASE_MS));
        assert_eq!(
            current_lease(&s, LEASE_KEY, 1_000).unwrap().expires_ms,
            3_000
        );
    }

    /// A store where another worker's write lands between this worker's read and write.
    struct Racing {
        inner: MemStore,
        rival: Cell<Option<(u64, u64)>>,
    }

    impl Store for Racing {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
            if let Some((holder, now_ms)) = self.rival.take() {
                assert!(try_take(&self.inner, key, holder, 1, now_ms, LEASE_MS));
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn two_workers_racing_for_a_lapsed_lease_one_wins() {
        let s = Racing {
            inner: MemStore::new(),
            rival: Cell::new(None),
        };
        assert!(try_take(&s.inner, LEASE_KEY, A, 1, 0, LEASE_MS));
        // At 3_000 A's lease lapsed; B takes it just after A read it.
        s.rival.set(Some((B, 3_000)));
        assert!(!try_take(&s, LEASE_KEY, A, 1, 3_000, LEASE_MS));
        assert_eq!(current_lease(&s, LEASE_KEY, 3_000).unwrap().holder, B);
    }

    /// A configuration that replaced another takes the live lease over from
    /// it (the old one's root context lives on while its requests drain), and the old one
    /// cannot take it back while the new one renews it. Same generation: the holder keeps it.
    #[test]
    fn a_newer_configuration_takes_the_lease_from_one_draining() {
        let s = MemStore::new();
        assert!(try_take(&s, LEASE_KEY, A, 1, 0, LEASE_MS));
        assert!(
            !try_take(&s, LEASE_KEY, B, 1, 100, LEASE_MS),
            "same generation"
        );
        assert!(
            try_take(&s, LEASE_KEY, B, 2, 200, LEASE_MS),
            "newer generation"
        );
        let l = current_lease(&s, LEASE_KEY, 200).unwrap();
        assert_eq!((l.holder, l.generation), (B, 2));
        for now in [300, 1_000, 3_100] {
            assert!(
                !try_take(&s, LEASE_KEY, A, 1, now, LEASE_MS),
                "old took it back"
            );
            assert!(try_take(&s, LEASE_KEY, B, 2, now, LEASE_MS), "new lost it");
        }
        // The new one gone (its lease lapsed): the old one may scrape again.
        assert!(try_take(&s, LEASE_KEY, A, 1, 3_100 + LEASE_MS, LEASE_MS));
    }

    /// The generation shares the holder word: a lease of the previous landing's format (the
    /// word all holder id) reads as generation 0, and a new lease's word, read as the previous
    /// landing reads it, is a holder id other than its own (so it leaves a live one alone).
    #[test]
    fn the_lease_stays_readable_by_the_previous_landing() {
        let mut old = vec![LEASE_VERSION];
        old.extend(5u64.to_le_bytes());
        old.extend(9_000u64.to_le_bytes());
        assert_eq!(
            Lease::decode(&old),
            Some(Lease {
                holder: 5,
                generation: 0,
                expires_ms: 9_000
            })
        );
        let new = Lease {
            holder: 5,
            generation: 2,
            expires_ms: 9_000,
        }
        .encode();
        assert_eq!(new.len(), old.len());
        let word = u64::from_le_bytes(new[1..9].try_into().unwrap());
        assert_ne!(word, 5, "the old reader would renew it as its own");
        let s = MemStore::new();
        s.set(LEASE_KEY, &old, None).unwrap();
        assert!(try_take(&s, LEASE_KEY, A, 1, 1_000, LEASE_MS), "taken over");
    }

    #[test]
    fn undecodable_lease_is_free() {
        let s = MemStore::new();
        s.set(LEASE_KEY, b"\x02garbage", None).unwrap();
        assert!(try_take(&s, LEASE_KEY, B, 1, 0, LEASE_MS));
        let l = Lease {
            holder: A,
            generation: 3,
            expires_ms: 7,
        };
        assert_eq!(Lease::decode(&l.encode()), Some(l));
        assert_eq!(l.encode().len(), LEASE_BYTES);
        let mut longer = l.encode();
        longer.push(0);
        assert_eq!(Lease::decode(&longer), None);
    }

    #[test]
    fn record_success_failure_and_freshness() {
        let s = MemStore::new();
        let none = read(&s);
        assert_eq!(
            none.state_at(0, 1_000),
            LoadState::Unknown(Unknown::NeverScraped)
        );
        assert_eq!(none.age_ms(50), None);

        let r = record(&s, 10_000, Ok(vllm(3, 8, 420))).unwrap();
        assert_eq!(read(&s), r);
        assert_eq!(r.state_at(10_500, 1_000), LoadState::Known(vllm(3, 8, 420)));
        assert_eq!(r.state_at(11_000, 1_000), LoadState::Known(vllm(3, 8, 420)));
        assert_eq!(
            r.state_at(11_001, 1_000),
            LoadState::Unknown(Unknown::Stale)
        );
        assert_eq!(r.age_ms(11_001), Some(1_001));

        // A failure makes it unknown at once; the last good load is kept for the record.
        let f = record(&s, 10_200, Err(ScrapeError::Timeout)).unwrap();
        assert_eq!(
            f.state_at(10_200, 1_000),
            LoadState::Unknown(Unknown::Failed(ScrapeError::Timeout))
        );
        let f = record(&s, 10_400, Err(ScrapeError::Status)).unwrap();
        assert_eq!(f.consecutive_failures, 2);
        assert_eq!(f.last, Some(vllm(3, 8, 420)));
        assert_eq!(f.scraped_at_ms, 10_000);
        assert_eq!(f.attempted_at_ms, 10_400);
        assert_eq!(f.age_ms(10_400), Some(400));

        let ok = record(&s, 10_600, Ok(vllm(0, 1, 50))).unwrap();
        assert_eq!(ok.consecutive_failures, 0);
        assert_eq!(ok.last_error, Some(ScrapeError::Status));
        assert_eq!(ok.state_at(10_600, 1_000), LoadState::Known(vllm(0, 1, 50)));
        assert_eq!(
            read(&s).state_at(10_600, 1_000),
            LoadState::Known(vllm(0, 1, 50))
        );
    }

    #[test]
    fn record_survives_conflicts_and_garbage() {
        let s = MemStore::new();
        s.set(&slot_key(0), b"\x01short", None).unwrap();
        assert_eq!(read(&s), Scraped::default());
        s.inject_conflicts.set(2);
        let r = record(&s, 5, Err(ScrapeError::Dispatch)).unwrap();
        assert_eq!(r.consecutive_failures, 1);
        // Failing before any success: unknown for the failure, not "never scraped".
        assert_eq!(
            r.state_at(5, 1_000),
            LoadState::Unknown(Unknown::Failed(ScrapeError::Dispatch))
        );
        assert_eq!(r.age_ms(5), None);
        s.inject_conflicts.set(CAS_RETRIES as u32);
        let lost = record(&s, 6, Err(ScrapeError::Dispatch));
        assert_eq!(lost.map_err(|r| r.consecutive_failures), Err(2));
        assert_eq!(read(&s).consecutive_failures, 1);
    }

    fn with_decode(seconds_us: u64, count: u64) -> EngineLoad {
        EngineLoad {
            decode: Some(DecodeTotals { seconds_us, count }),
            ..vllm(0, 4, 100)
        }
    }

    /// The pace windows: the first scrape only sets the base; a window closes at
    /// `PACE_MIN_TOKENS` (exactly 32 here), smaller ones stay open and keep the last pace; a
    /// counter going down (restart) drops the pace and restarts the window; a load without the
    /// counters forgets both; a failed or stale scrape hides the pace.
    #[test]
    fn pace_windows_resets_and_freshness() {
        let s = MemStore::new();
        let at = |now: u64, sec_us: u64, n: u64| {
            record(&s, now, Ok(with_decode(sec_us, n))).map_err(|_| ())
        };
        let r = at(1_000, 5_000_000, 2_000).unwrap();
        assert_eq!(r.pace, None);
        assert_eq!(
            r.decode_base,
            Some(DecodeTotals {
                seconds_us: 5_000_000,
                count: 2_000
            })
        );
        // 31 tokens: the window stays open.
        let r = at(2_000, 5_062_000, 2_031).unwrap();
        assert_eq!((r.pace, r.decode_base.unwrap().count), (None, 2_000));
        // 32 tokens in 64 ms since the base: 2 ms per token.
        let r = at(3_000, 5_064_000, 2_032).unwrap();
        assert_eq!(
            r.pace,
            Some(Pace {
                us_per_token: 2_000,
                at_ms: 3_000
            })
        );
        assert_eq!(r.pace_at(3_500, 1_000), Some(2_000));
        // Idle: the same counters keep the pace.
        let r = at(4_000, 5_064_000, 2_032).unwrap();
        assert_eq!(r.pace_at(4_000, 1_000), Some(2_000));
        // Five times slower over 100 tokens.
        let r = at(5_000, 6_064_000, 2_132).unwrap();
        assert_eq!(r.pace_at(5_000, 1_000), Some(10_000));
        // Stale or failed: no pace for the scheduler (the record keeps it).
        assert_eq!(r.pace_at(6_001, 1_000), None);
        let f = record(&s, 5_500, Err(ScrapeError::Timeout)).unwrap();
        assert_eq!(f.pace_at(5_500, 1_000), None);
        assert!(f.pace.is_some());
        // The engine restarted: smaller counters, no pace, the window restarts there.
        let r = at(6_000, 40_000, 20).unwrap();
        assert_eq!(r.pace, None);
        assert_eq!(r.decode_base.unwrap().count, 20);
        // Only one counter went down (the seconds): a restart too.
        let r = at(6_500, 39_000, 100).unwrap();
        assert_eq!((r.pace, r.decode_base.unwrap().count), (None, 100));
        let r = at(7_000, 39_000 + 32 * 3_000, 132).unwrap();
        assert_eq!(r.pace.map(|p| p.us_per_token), Some(3_000));
        // No time at all for many tokens reads as the floor of 1 µs, not 0.
        let r = at(7_500, 39_000 + 32 * 3_000, 10_132).unwrap();
        assert_eq!(r.pace.map(|p| p.us_per_token), Some(1));
        // Counters near the top: saturates at u32::MAX µs per token, no overflow.
        let r = at(8_000, u64::MAX, 10_164).unwrap();
        assert_eq!(r.pace.map(|p| p.us_per_token), Some(u32::MAX));
        // The engine stopped publishing the counters: both forgotten.
        let r = record(&s, 9_000, Ok(vllm(0, 1, 0))).unwrap();
        assert_eq!((r.pace, r.decode_base), (None, None));
        assert_eq!(Scraped::decode(&r.encode()), Some(r));
    }

    #[test]
    fn record_codec_is_exact() {
        let full = Scraped {
            last: Some(EngineLoad {
                engine: Engine::Llamacpp,
                waiting: Some(1),
                running: Some(0),
                kv_usage_permille: None,
                prompt_tokens_total: Some(4096),
                prompt_tokens_cached_total: Some(3000),
                decode: Some(DecodeTotals {
                    seconds_us: 9_000_000,
                    count: 4_500,
                }),
            }),
            scraped_at_ms: 123,
            attempted_at_ms: 456,
            consecutive_failures: 7,
            last_error: Some(ScrapeError::ModelNotServed),
            decode_base: Some(DecodeTotals {
                seconds_us: 8_000_000,
                count: 4_000,
            }),
            pace: Some(Pace {
                us_per_token: 2_000,
                at_ms: 120,
            }),
        };
        for r in [
            full,
            Scraped::default(),
            Scraped {
                last: Some(vllm(u32::MAX, 0, 1000)),
                ..Scraped::default()
            },
        ] {
            let bytes = r.encode();
            assert_eq!(bytes.len(), RECORD_BYTES);
            assert_eq!(Scraped::decode(&bytes), Some(r));
            assert_eq!(Scraped::decode(&bytes[..bytes.len() - 1]), None);
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(Scraped::decode(&longer), None);
        }
        let mut bad = vllm(1, 1, 1).into_record().encode();
        bad[0] = 1; // the previous version
        assert_eq!(Scraped::decode(&bad), None);
        let mut bad = vllm(1, 1, 1).into_record().encode();
        // KV is at bytes 11..15 (after version, flags, engine, waiting, running): 1001 ‰.
        bad[11] = 0xe9;
        bad[12] = 0x03;
        assert_eq!(Scraped::decode(&bad), None);
        let mut bad = vllm(1, 1, 1).into_record().encode();
        bad[RECORD_BYTES - 1] = 9; // unknown error code
        assert_eq!(Scraped::decode(&bad), None);
        let mut bad = full.encode();
        bad[1] &= !HAS_PROMPT; // absent but non-zero
        assert_eq!(Scraped::decode(&bad), None);
        let mut bad = full.encode();
        bad[2] = 0; // no engine
        assert_eq!(Scraped::decode(&bad), None);
        // A pace without decode totals, decode totals without a pace's zeros, a zero pace.
        let no_decode = Scraped {
            last: Some(vllm(1, 1, 1)),
            ..Scraped::default()
        };
        let mut bad = no_decode.encode();
        bad[1] |= HAS_PACE;
        bad[RECORD_BYTES - 12] = 1;
        assert_eq!(Scraped::decode(&bad), None);
        let mut bad = no_decode.encode();
        bad[RECORD_BYTES - 20] = 1; // a window base without decode totals
        assert_eq!(Scraped::decode(&bad), None);
        let mut bad = full.encode();
        bad[RECORD_BYTES - 12..RECORD_BYTES - 8].copy_from_slice(&[0; 4]);
        assert_eq!(Scraped::decode(&bad), None);
        let mut bad = full.encode();
        bad[1] &= !HAS_PACE; // pace bytes left non-zero
        assert_eq!(Scraped::decode(&bad), None);
        let mut bad = full.encode();
        bad[1] &= !HAS_LOAD;
        assert_eq!(Scraped::decode(&bad), None);
        for e in ScrapeError::ALL {
            assert_eq!(ScrapeError::from_code(e.code()), Some(e));
        }
    }

    trait IntoRecord {
        fn into_record(self) -> Scraped;
    }
    impl IntoRecord for EngineLoad {
        fn into_record(self) -> Scraped {
            Scraped {
                last: Some(self),
                ..Scraped::default()
            }
        }
    }

    #[test]
    fn quantization_steps() {
        let buckets: Vec<u8> = [0, 1, 2, 3, 4, 7, 8, 15, 16, 1000, u32::MAX]
            .into_iter()
            .map(queue_bucket)
            .collect();
        assert_eq!(buckets, [0, 1, 2, 2, 3, 3, 4, 4, 5, 10, 32]);
        let floors: Vec<u32> = [0, 1, 2, 3, 10, 32].into_iter().map(bucket_floor).collect();
        assert_eq!(floors, [0, 1, 2, 4, 512, 1 << 31]);
        for n in [0, 1, 5, 99, 12345, u32::MAX] {
            assert_eq!(queue_bucket(bucket_floor(queue_bucket(n))), queue_bucket(n));
        }
        let steps: Vec<u8> = [0, 99, 100, 420, 799, 800, 999, 1000, u16::MAX]
            .into_iter()
            .map(kv_step)
            .collect();
        assert_eq!(steps, [0, 0, 1, 4, 7, 8, 9, 10, 10]);
        // Two replicas that scraped 5 and 6 waiting, 41 % and 47 % KV agree.
        assert_eq!(quantize(&vllm(5, 9, 410)), quantize(&vllm(6, 10, 470)));
        assert_ne!(quantize(&vllm(5, 9, 410)), quantize(&vllm(8, 9, 410)));
        let q = quantize(&vllm(5, 9, 410));
        assert_eq!(q.requests_floor(), Some(4 + 8));
        let tgi = EngineLoad {
            engine: Engine::Tgi,
            waiting: None,
            running: None,
            kv_usage_permille: None,
            prompt_tokens_total: None,
            prompt_tokens_cached_total: None,
            decode: None,
        };
        assert_eq!(quantize(&tgi).requests_floor(), None);
    }

    /// The memo returns what `read_loads` returns, decoding only the slots the change ring
    /// names (every slot when it cannot say).
    #[test]
    fn loads_memo_equals_read_loads_and_decodes_changes_only() {
        let s = MemStore::new();
        let mut memo = LoadsMemo::default();
        let ids = [30, 3, 7];
        assert_eq!(*memo.read(&s, &ids), read_loads(&s, &ids));
        let mut decoded = memo.decoded;
        for (n, id) in [30u32, 7, 3, 7, 30].into_iter().enumerate() {
            let at = 1_000 + 100 * n as u64;
            fold(&s, id, at, Ok(vllm(n as u32, 2, 100)), &ids).unwrap();
            let version = memo.version;
            assert_eq!(
                *memo.read(&s, &ids),
                read_loads(&s, &ids),
                "after answer {n}"
            );
            assert_eq!(memo.decoded, decoded + 1, "one slot decoded");
            assert_eq!(memo.version, version + 1);
            decoded = memo.decoded;
            for _ in 0..3 {
                assert_eq!(*memo.read(&s, &ids), read_loads(&s, &ids));
            }
            assert_eq!(memo.decoded, decoded, "unchanged slots are not");
        }
        // Undecodable, then another endpoint's record in a slot (writes the ring does not
        // name: the tick, which reads every slot, finds them): both read as absent.
        s.set(&slot_key(0), b"junk", None).unwrap();
        assert_eq!(*memo.tick(&s, &ids), read_loads(&s, &ids));
        assert_eq!(memo.read(&s, &ids).get(3), None);
        s.set(&slot_key(1), &encode_slot(99, &Scraped::default()), None)
            .unwrap();
        assert_eq!(memo.tick(&s, &ids).get(7), None);
        assert_eq!(read_loads(&s, &ids).entries.len(), 1);
        assert_eq!(*memo.read(&s, &ids), read_loads(&s, &ids));
        fold(&s, 3, 9_000, Err(ScrapeError::Timeout), &ids).unwrap();
        let decoded = memo.decoded;
        assert_eq!(memo.read(&s, &ids).get(3).unwrap().consecutive_failures, 1);
        assert_eq!(memo.decoded, decoded + 1, "the slot the ring names, alone");
        // More answers than the ring keeps: every slot read, still equal.
        for k in 0..CHANGES_KEPT as u64 + 1 {
            fold(&s, 30, 10_000 + k, Ok(vllm(1, 1, 1)), &ids).unwrap();
        }
        assert_eq!(*memo.read(&s, &ids), read_loads(&s, &ids));
        let c = Changes::decode(&s.get(CHANGES_KEY).0.unwrap()).unwrap();
        assert_eq!(Changes::decode(&c.encode()), Some(c.clone()));
        assert_eq!(c.count, 5 + 1 + CHANGES_KEPT as u64 + 1);
        assert_eq!(Changes::decode(b"junk"), None);
    }

    #[test]
    fn loads_one_slot_per_scraped_endpoint() {
        let s = MemStore::new();
        let ids = [30, 7];
        assert_eq!(read_loads(&s, &ids), Loads::default());
        let mut a = vllm(5, 9, 410).into_record();
        a.scraped_at_ms = 1_000;
        a.attempted_at_ms = 1_000;
        let mut b = Scraped::default();
        b.failed(ScrapeError::TooLarge, 1_100);
        assert_eq!(fold(&s, 30, 1_000, Ok(vllm(5, 9, 410)), &ids), Ok(a));
        assert_eq!(fold(&s, 7, 1_100, Err(ScrapeError::TooLarge), &ids), Ok(b));
        // Slots in id order: 7 in slot 0, 30 in slot 1; nothing else written.
        assert_eq!(
            s.get(&slot_key(0)).0.as_deref().and_then(decode_slot),
            Some((7, b))
        );
        assert_eq!(s.get(&slot_key(1)).0.map(|v| v.len()), Some(SLOT_BYTES));
        assert_eq!(s.get(&slot_key(2)).0, None);
        let loads = read_loads(&s, &ids);
        assert_eq!(loads.entries, vec![(7, b), (30, a)]);
        assert_eq!(
            loads.state(30, 1_500, 1_000),
            LoadState::Known(vllm(5, 9, 410))
        );
        assert_eq!(
            loads.quantized(30, 1_500, 1_000),
            Some(Quantized {
                waiting_bucket: Some(3),
                running_bucket: Some(4),
                kv_step: Some(4)
            })
        );
        assert_eq!(loads.quantized(30, 2_001, 1_000), None);
        assert_eq!(
            loads.state(7, 1_500, 1_000),
            LoadState::Unknown(Unknown::Failed(ScrapeError::TooLarge))
        );
        assert_eq!(
            loads.state(99, 1_500, 1_000),
            LoadState::Unknown(Unknown::NeverScraped)
        );
        // An id not scraped has no slot: nothing written.
        assert!(fold(&s, 99, 1_200, Ok(vllm(1, 1, 1)), &ids).is_err());
        // A configuration of endpoint 7 alone: its slot 0 is read, the retired slot 1 is
        // emptied by the next lease holder (and the combined value of older modules).
        assert_eq!(read_loads(&s, &[7]).entries, vec![(7, b)]);
        s.set(LEGACY_LOADS_KEY, b"old", None).unwrap();
        assert_eq!(retire_slots(&s, 2), 0, "the first holder records its count");
        assert_eq!(s.get(LEGACY_LOADS_KEY).0.as_deref(), Some(&b""[..]));
        assert_eq!(retire_slots(&s, 1), 1);
        assert_eq!(s.get(&slot_key(1)).0.as_deref(), Some(&b""[..]));
        assert_eq!(retire_slots(&s, 1), 0, "once");
        // A renamed endpoint in slot 0 reads as never scraped until its first answer.
        assert_eq!(read_loads(&s, &[8]), Loads::default());
        let mut c = Scraped::default();
        c.failed(ScrapeError::Status, 1_300);
        assert_eq!(fold(&s, 8, 1_300, Err(ScrapeError::Status), &[8]), Ok(c));
        // The slot codec takes exactly what it writes.
        let bytes = encode_slot(7, &b);
        assert_eq!(decode_slot(&bytes), Some((7, b)));
        assert_eq!(decode_slot(&bytes[..bytes.len() - 1]), None);
        let mut bad = bytes.clone();
        bad[0] = 2;
        assert_eq!(decode_slot(&bad), None);
        assert_eq!(decode_slot(&[]), None);
    }
}
