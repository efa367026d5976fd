//! The multi-turn chat workload: which sessions arrive when, what each turn sends, and a driver
//! that plays it against a listener and records what every request got back.
//!
//! Why: the filter's value is measured in KV-cache hits, and hits only exist for a conversation
//! whose later prompts repeat the earlier ones. So every session is a growing transcript: turn k
//! resends the k−1 earlier user messages and fixed assistant replies, then a new user message.
//! By default no two sessions share a prefix (no common system prompt): a hit can only come from
//! routing the session back to an endpoint that served it; `--system-prompts N` gives every
//! session one of N shared system prompts (`--system-tokens` long), as agents and apps do.
//!
//! What the engines are asked to do varies per request, as in real traffic: half of the answers
//! are streamed (`stream_share`), half plain, decided per request by the seed; every request
//! asks for its own `max_tokens`, log-uniform in `output_min..=output_max` (16..512), which the
//! batched mock generates exactly (`--output-tokens max_tokens`), so that every policy faces
//! the same work whichever endpoint serves it.
//!
//! How: the plan is fixed by a seed (the same sessions, texts, arrival and think times for every
//! policy). Sessions arrive open-loop (exponential gaps at a fixed mean rate, independent of how
//! fast earlier requests were answered); inside a session the next turn starts a think time after
//! the previous answer. Each live session is one thread with a blocking HTTP/1.1 client (one
//! connection per request), so the driver never batches or delays a request of its own accord.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::support::http::{self, CookieJar};

/// SplitMix64: a small, fixed, seedable generator (the plan must be identical in every run).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
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

/// What the workload looks like.
#[derive(Clone, Debug)]
pub struct WorkloadParams {
    pub sessions: usize,
    pub turns: usize,
    /// Mean session arrivals per second (Poisson).
    pub rate_per_s: f64,
    /// Mean think time between an answer and the session's next turn (uniform in ±50 %).
    pub think_ms: u64,
    /// Tokens of each new user message (the mock counts 4 bytes as one token).
    pub user_tokens: usize,
    /// Share of sessions that ask for the second model (served by two endpoints only).
    pub second_model_share: f64,
    /// Share of requests whose answer is streamed.
    pub stream_share: f64,
    /// Each request's `max_tokens`: log-uniform in this range.
    pub output_min: u64,
    pub output_max: u64,
    /// Shared system prompts (0: none) and their length in tokens.
    pub system_prompts: usize,
    pub system_tokens: usize,
    pub seed: u64,
}

pub const MODEL: &str = "m1";
pub const SECOND_MODEL: &str = "m2";
pub const SESSION_HEADER: &str = "x-session-id";

/// One planned conversation.
#[derive(Clone, Debug)]
pub struct SessionPlan {
    pub index: usize,
    pub id: String,
    pub model: &'static str,
    pub arrival_ms: u64,
    /// Think time before turn k+1 (k = 0..turns-1; the last entry is unused).
    pub think_ms: Vec<u64>,
    pub user_msgs: Vec<String>,
    pub replies: Vec<String>,
    /// Per turn: `max_tokens` and whether the answer is streamed.
    pub max_tokens: Vec<u64>,
    pub stream: Vec<bool>,
    /// The shared system prompt this session starts with, if any.
    pub system: Option<String>,
}

impl SessionPlan {
    /// The chat-completion body of turn `turn` (0-based): the whole transcript so far.
    pub fn body(&self, turn: usize) -> String {
        let mut messages = Vec::with_capacity(2 * turn + 2);
        if let Some(sys) = &self.system {
            messages.push(json!({"role": "system", "content": sys}));
        }
        for k in 0..=turn {
            if k > 0 {
                if let Some(r) = self.replies.get(k - 1) {
                    messages.push(json!({"role": "assistant", "content": r}));
                }
            }
            if let Some(u) = self.user_msgs.get(k) {
                messages.push(json!({"role": "user", "content": u}));
            }
        }
        let max_tokens = self.max_tokens.get(turn).copied().unwrap_or(16);
        if self.streamed(turn) {
            json!({"model": self.model, "messages": messages, "max_tokens": max_tokens,
                   "stream": true, "stream_options": {"include_usage": true}})
            .to_string()
        } else {
            json!({"model": self.model, "messages": messages, "max_tokens": max_tokens}).to_string()
        }
    }

    pub fn streamed(&self, turn: usize) -> bool {
        self.stream.get(turn).copied().unwrap_or(false)
    }

    /// Arrival of the last session's first request, in ms from the start of the run.
    pub fn last_arrival_ms(plans: &[SessionPlan]) -> u64 {
        plans.iter().map(|p| p.arrival_ms).max().unwrap_or(0)
    }
}

const WORDS: &[&str] = &[
    "alpha", "bravo", "carbon", "delta", "ember", "fjord", "gamma", "harbor", "indigo", "juniper",
    "kernel", "lumen", "matrix", "nebula", "orbit", "prism", "quartz", "raster", "sierra",
    "tensor", "umbra", "vector", "willow", "xenon", "yonder", "zephyr", "anchor", "beacon",
    "cobalt", "dynamo", "eclipse", "falcon", "glacier", "horizon", "ion", "jasper", "kinetic",
    "lattice", "meadow", "nimbus", "onyx", "pulsar", "quiver", "ripple", "saffron", "tundra",
    "uplink", "valley", "wander", "xylem", "yield", "zenith", "acorn", "basalt", "cipher", "drift",
    "echo", "flux", "grove", "helix", "iris", "jolt", "knot", "ledger",
];

/// `bytes` bytes of words from `rng`, starting with `lead` (ASCII, so bytes = characters).
fn text(rng: &mut Rng, lead: &str, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    s.push_str(lead);
    while s.len() < bytes {
        let w = WORDS
            .get((rng.next_u64() % WORDS.len() as u64) as usize)
            .copied()
            .unwrap_or("word");
        s.push(' ');
        s.push_str(w);
    }
    s.truncate(bytes);
    s
}

/// Log-uniform integer in `lo..=hi` (the mock's draw: short answers more common than long).
pub fn log_uniform(rng: &mut Rng, lo: u64, hi: u64) -> u64 {
    let (lo, hi) = (lo.max(1), hi.max(lo.max(1)));
    let (a, b) = ((lo as f64).ln(), ((hi + 1) as f64).ln());
    let x = (a + (b - a) * rng.unit()).exp().floor() as u64;
    x.clamp(lo, hi)
}

/// The sessions of a run: identical for every policy given the same parameters.
pub fn plan(p: &WorkloadParams) -> Vec<SessionPlan> {
    let mut rng = Rng::new(p.seed);
    // The shared system prompts come from their own generator, so that the sessions' texts stay
    // what they were without them.
    let mut sys_rng = Rng::new(p.seed ^ 0x5157_E3D0);
    let systems: Vec<String> = (0..p.system_prompts)
        .map(|i| {
            let lead = format!("[system prompt {i}] You are a helpful assistant.");
            text(&mut sys_rng, &lead, p.system_tokens * 4)
        })
        .collect();
    let mut t_ms = 0.0f64;
    let mean_gap_ms = 1000.0 / p.rate_per_s.max(0.001);
    let mut out = Vec::with_capacity(p.sessions);
    for i in 0..p.sessions {
        if i > 0 {
            // Exponential inter-arrival gap (Poisson arrivals).
            t_ms += -mean_gap_ms * (1.0 - rng.unit()).ln();
        }
        let mut srng = Rng::new(rng.next_u64());
        let id = format!("s{:04}-{:08x}", i, srng.next_u64() as u32);
        let model = if srng.unit() < p.second_model_share {
            SECOND_MODEL
        } else {
            MODEL
        };
        let think_ms = (0..p.turns)
            .map(|_| (p.think_ms as f64 * (0.5 + srng.unit())).round() as u64)
            .collect();
        let user_msgs = (0..p.turns)
            .map(|k| {
                let lead = format!("[{id} turn {}]", k + 1);
                text(&mut srng, &lead, p.user_tokens * 4)
            })
            .collect();
        let replies = (0..p.turns)
            .map(|k| {
                let lead = format!("reply {} to {id}:", k + 1);
                text(&mut srng, &lead, 64)
            })
            .collect();
        // Per-request shape from a generator of its own (same reason as the system prompts).
        let mut xrng = Rng::new(srng.clone().next_u64() ^ 0x0A75_0F57);
        let max_tokens = (0..p.turns)
            .map(|_| log_uniform(&mut xrng, p.output_min, p.output_max))
            .collect();
        let stream = (0..p.turns).map(|_| xrng.unit() < p.stream_share).collect();
        let system = match systems.len() {
            0 => None,
            n => systems.get((xrng.next_u64() % n as u64) as usize).cloned(),
        };
        out.push(SessionPlan {
            index: i,
            id,
            model,
            arrival_ms: t_ms.round() as u64,
            think_ms,
            user_msgs,
            replies,
            max_tokens,
            stream,
            system,
        });
    }
    out
}

/// What one request got back.
#[derive(Clone, Debug)]
pub struct Record {
    pub session: usize,
    pub model: &'static str,
    /// 0-based.
    pub turn: usize,
    /// Request start, ms from the start of the run.
    pub start_ms: f64,
    /// Until the whole response body was read.
    pub latency_ms: f64,
    /// Until the first byte of the response (headers) arrived.
    pub ttfb_ms: f64,
    /// The answer was asked for as a stream.
    pub stream: bool,
    pub completion_tokens: u64,
    /// 0: no HTTP response (connect error, reset, timeout).
    pub status: u16,
    /// `x-mock-endpoint`: which upstream produced the answer.
    pub endpoint: Option<String>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// `x-computeflux-attempts` (filter only).
    pub attempts: Option<u32>,
    /// `x-computeflux-affinity` (filter only): how the first attempt was placed.
    pub affinity: Option<String>,
    /// `x-bench-replica` (replicated topology only): the replica that served the request.
    pub replica: Option<String>,
    pub error: Option<String>,
}

impl Record {
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn to_json(&self) -> Value {
        json!({
            "session": self.session, "model": self.model, "turn": self.turn,
            "start_ms": self.start_ms, "latency_ms": self.latency_ms, "ttfb_ms": self.ttfb_ms,
            "stream": self.stream, "completion_tokens": self.completion_tokens,
            "status": self.status,
            "endpoint": self.endpoint, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "attempts": self.attempts,
            "affinity": self.affinity, "replica": self.replica, "error": self.error,
        })
    }
}

/// `(prompt, cached, completion)` tokens from an answer's `usage` (a plain answer's body, or
/// the stream's usage chunk).
fn usage_of(r: &http::Response, stream: bool) -> (u64, u64, u64) {
    let v: Value = if stream {
        r.sse_data()
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find(|v| v.get("usage").is_some_and(|u| !u.is_null()))
            .unwrap_or(Value::Null)
    } else {
        serde_json::from_str(&r.body).unwrap_or(Value::Null)
    };
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    (
        n("/usage/prompt_tokens"),
        n("/usage/prompt_tokens_details/cached_tokens"),
        n("/usage/completion_tokens"),
    )
}

fn send(
    port: u16,
    plan: &SessionPlan,
    turn: usize,
    t0: Instant,
    timeout: Duration,
    jar: &mut CookieJar,
) -> Record {
    let body = plan.body(turn);
    let start = Instant::now();
    let start_ms = start.duration_since(t0).as_secs_f64() * 1000.0;
    let cookie = jar.header();
    let mut headers = vec![(SESSION_HEADER, plan.id.as_str())];
    if let Some(c) = cookie.as_deref() {
        headers.push(("cookie", c));
    }
    let res = http::request(
        port,
        "POST",
        "/v1/chat/completions",
        &headers,
        Some(body.as_bytes()),
        timeout,
    );
    let latency_ms = start.elapsed().as_secs_f64() * 1000.0;
    let mut rec = Record {
        session: plan.index,
        model: plan.model,
        turn,
        start_ms,
        latency_ms,
        ttfb_ms: latency_ms,
        stream: plan.streamed(turn),
        completion_tokens: 0,
        status: 0,
        endpoint: None,
        prompt_tokens: 0,
        cached_tokens: 0,
        attempts: None,
        affinity: None,
        replica: None,
        error: None,
    };
    match res {
        Ok(r) => {
            rec.status = r.status;
            rec.ttfb_ms = r.ttfb.as_secs_f64() * 1000.0;
            jar.store(&r);
            rec.endpoint = r.header("x-mock-endpoint").map(str::to_string);
            rec.attempts = r
                .header("x-computeflux-attempts")
                .and_then(|a| a.trim().parse().ok());
            rec.affinity = r.header("x-computeflux-affinity").map(str::to_string);
            rec.replica = r.header("x-bench-replica").map(str::to_string);
            if rec.ok() {
                let (p, c, o) = usage_of(&r, rec.stream);
                rec.prompt_tokens = p;
                rec.cached_tokens = c;
                rec.completion_tokens = o;
            } else {
                let code = serde_json::from_str::<Value>(&r.body)
                    .ok()
                    .and_then(|v| v.pointer("/error/code").cloned())
                    .and_then(|c| c.as_str().map(str::to_string));
                rec.error = Some(code.unwrap_or_else(|| format!("http {}", r.status)));
            }
        }
        Err(e) => rec.error = Some(format!("io: {:?}", e.kind())),
    }
    rec
}

/// Plays `plans` against `127.0.0.1:port`; returns every request's record (unordered).
/// `t0` is the run's time origin (fault schedules use the same one).
pub fn drive(port: u16, plans: &[SessionPlan], t0: Instant, timeout: Duration) -> Vec<Record> {
    let (tx, rx) = mpsc::channel::<Record>();
    let mut handles = Vec::with_capacity(plans.len());
    let mut order: Vec<&SessionPlan> = plans.iter().collect();
    order.sort_by_key(|p| p.arrival_ms);
    for plan in order {
        let due = t0 + Duration::from_millis(plan.arrival_ms);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let plan = plan.clone();
        let tx = tx.clone();
        let h = std::thread::Builder::new()
            .name(format!("session-{}", plan.index))
            .stack_size(256 * 1024)
            .spawn(move || {
                // Each session is its own client and keeps the cookies it is given.
                let mut jar = CookieJar::default();
                for turn in 0..plan.user_msgs.len() {
                    let rec = send(port, &plan, turn, t0, timeout, &mut jar);
                    let _ = tx.send(rec);
                    if turn + 1 < plan.user_msgs.len() {
                        let think = plan.think_ms.get(turn).copied().unwrap_or(0);
                        std::thread::sleep(Duration::from_millis(think));
                    }
                }
            });
        match h {
            Ok(h) => handles.push(h),
            Err(e) => eprintln!("bench: cannot start session thread: {e}"),
        }
    }
    drop(tx);
    for h in handles {
        let _ = h.join();
    }
    rx.into_iter().collect()
}
