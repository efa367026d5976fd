//! The multi-turn chat workload: which sessions arrive when, what each turn sends, and a driver
//! that plays it against a listener and records what every request got back.
//!
//! Why: the filter's value is measured in KV-cache hits, and hits only exist for a conversation
//! whose later prompts repeat the earlier ones. So every session is a growing transcript: turn k
//! resends the k−1 earlier user messages and fixed assistant replies, then a new user message.
//! By default no two sessions share a prefix (no common system prompt): a hit can only come from
//! routing the session back to an endpoint that served it; `--system-prompts N` gives every
//! session one of N shared system prompts (`--system-tokens` long), as agents and apps do.
//! Which one is uniform by default; `--system-zipf S` (S > 0) makes prompt k's popularity
//! proportional to 1/(k+1)^S, as applications' traffic is (a few popular, a long tail): the
//! shared-prefix scenarios use it (issue 20). `system_head_tokens` > 0 puts one more system
//! message before every application's own: a preamble all applications share (a corporate
//! policy, tool descriptions), as the `shared_preamble` scenario does (issue 20, item 3).
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
    /// Zipf exponent of the system prompts' popularity (0: uniform).
    pub system_zipf_s: f64,
    /// Tokens of a system message every application's sessions send before their own system
    /// prompt (0: none).
    pub system_head_tokens: usize,
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
    /// The shared system prompt this session starts with, if any, and its index (the
    /// "application"; 0 is the most popular under a Zipf draw).
    pub system: Option<String>,
    pub app: Option<usize>,
    /// The preamble every application shares, sent as a system message before `system`.
    pub system_head: Option<String>,
}

impl SessionPlan {
    /// The chat-completion body of turn `turn` (0-based): the whole transcript so far.
    pub fn body(&self, turn: usize) -> String {
        let mut messages = Vec::with_capacity(2 * turn + 3);
        if let Some(head) = self.system_head.as_ref().filter(|_| self.system.is_some()) {
            messages.push(json!({"role": "system", "content": head}));
        }
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

/// Cumulative Zipf weights of `n` ranks with exponent `s`, normalised to end at 1 (rank k's
/// weight is 1/(k+1)^s; `s = 0` is uniform).
pub fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let weights: Vec<f64> = (0..n).map(|k| ((k + 1) as f64).powf(-s)).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect()
}

/// A rank drawn from `cdf` (see [`zipf_cdf`]) with one uniform number.
pub fn zipf_draw(rng: &mut Rng, cdf: &[f64]) -> usize {
    let u = rng.unit();
    cdf.iter()
        .position(|c| u < *c)
        .unwrap_or(cdf.len().saturating_sub(1))
}

/// The shared system prompts of a workload: prompt i starts with its own lead (so two prompts
/// share no block) and is exactly `system_tokens` × 4 bytes (mock tokens) long.
pub fn system_prompts(p: &WorkloadParams) -> Vec<String> {
    // Their own generator, so that the sessions' texts stay what they were without them.
    let mut sys_rng = Rng::new(p.seed ^ 0x5157_E3D0);
    (0..p.system_prompts)
        .map(|i| {
            let lead = format!("[system prompt {i}] You are a helpful assistant.");
            text(&mut sys_rng, &lead, p.system_tokens * 4)
        })
        .collect()
}

/// The preamble all applications share (`system_head_tokens` × 4 bytes), if any.
pub fn system_head(p: &WorkloadParams) -> Option<String> {
    let mut head_rng = Rng::new(p.seed ^ 0x4EAD_0001);
    (p.system_head_tokens > 0).then(|| {
        text(
            &mut head_rng,
            "[shared preamble] Company policy and tools for every assistant.",
            p.system_head_tokens * 4,
        )
    })
}

/// The sessions of a run: identical for every policy given the same parameters.
pub fn plan(p: &WorkloadParams) -> Vec<SessionPlan> {
    let mut rng = Rng::new(p.seed);
    let systems = system_prompts(p);
    let head = system_head(p);
    let cdf = zipf_cdf(systems.len(), p.system_zipf_s);
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
        let app = match systems.len() {
            0 => None,
            // Uniform as before the Zipf option (the same draw, so older plans are unchanged).
            n if p.system_zipf_s <= 0.0 => Some((xrng.next_u64() % n as u64) as usize),
            _ => Some(zipf_draw(&mut xrng, &cdf)),
        };
        let system = app.and_then(|i| systems.get(i).cloned());
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
            app,
            system_head: head.clone(),
        });
    }
    out
}

/// What one request got back.
#[derive(Clone, Debug)]
pub struct Record {
    pub session: usize,
    /// The session's system prompt (application), if any.
    pub app: Option<usize>,
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
            "session": self.session, "app": self.app, "model": self.model, "turn": self.turn,
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
        app: plan.app,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(sessions: usize, apps: usize, zipf_s: f64, seed: u64) -> WorkloadParams {
        WorkloadParams {
            sessions,
            turns: 2,
            rate_per_s: 13.5,
            think_ms: 400,
            user_tokens: 300,
            second_model_share: 0.0,
            stream_share: 0.5,
            output_min: 16,
            output_max: 512,
            system_prompts: apps,
            system_tokens: 3_000,
            system_zipf_s: zipf_s,
            system_head_tokens: 0,
            seed,
        }
    }

    #[test]
    fn zipf_cdf_is_increasing_ends_at_one_and_is_uniform_at_s_zero() {
        let cdf = zipf_cdf(48, 1.0);
        assert_eq!(cdf.len(), 48);
        assert!(cdf.windows(2).all(|w| w[0] < w[1]));
        assert!((cdf[47] - 1.0).abs() < 1e-12);
        // Rank 0's weight is 1 / H_48 (H_48 ≈ 4.4747).
        assert!((cdf[0] - 1.0 / 4.4747).abs() < 1e-3, "{}", cdf[0]);
        let flat = zipf_cdf(4, 0.0);
        for (k, c) in flat.iter().enumerate() {
            assert!((c - (k + 1) as f64 / 4.0).abs() < 1e-12);
        }
        assert!(zipf_cdf(0, 1.0).is_empty());
    }

    #[test]
    fn zipf_draws_follow_the_weights() {
        let cdf = zipf_cdf(48, 1.0);
        let mut rng = Rng::new(11);
        let n = 200_000;
        let mut counts = [0u64; 48];
        for _ in 0..n {
            counts[zipf_draw(&mut rng, &cdf)] += 1;
        }
        let h: f64 = (1..=48).map(|k| 1.0 / k as f64).sum();
        for (k, c) in counts.iter().enumerate() {
            let expect = n as f64 / ((k + 1) as f64 * h);
            // Within 5 standard deviations of a binomial count.
            let sd = (expect * (1.0 - expect / n as f64)).sqrt();
            assert!(
                (*c as f64 - expect).abs() < 5.0 * sd,
                "rank {k}: {c} draws, expected {expect:.0}"
            );
        }
        assert!(counts[47] > 0, "the tail is drawn at all");
    }

    #[test]
    fn system_prompts_have_the_asked_length_and_share_no_leading_block() {
        let p = params(10, 48, 1.0, 7);
        let systems = system_prompts(&p);
        assert_eq!(systems.len(), 48);
        for s in &systems {
            assert_eq!(
                s.len(),
                3_000 * 4,
                "every prompt is system_tokens mock tokens"
            );
        }
        // The mock's first cache block is 16 tokens (64 bytes) of "system\n" + the prompt: two
        // applications must differ inside it, or they would share a cached block.
        let mut heads: Vec<&str> = systems.iter().map(|s| &s[..57]).collect();
        heads.sort_unstable();
        heads.dedup();
        assert_eq!(heads.len(), 48);
    }

    #[test]
    fn sessions_get_their_application_by_zipf_and_carry_its_prompt() {
        let p = params(2_000, 48, 1.0, 7);
        let plans = plan(&p);
        let systems = system_prompts(&p);
        let mut counts = [0usize; 48];
        for s in &plans {
            let app = s.app.expect("every session has an application");
            counts[app] += 1;
            assert_eq!(s.system.as_deref(), Some(systems[app].as_str()));
            let body: Value = serde_json::from_str(&s.body(1)).unwrap();
            assert_eq!(body["messages"][0]["role"], "system");
            assert_eq!(body["messages"][0]["content"], systems[app].as_str());
            assert_eq!(body["messages"].as_array().unwrap().len(), 4);
        }
        // ≈ 22 % of the sessions are the first application's, ≈ 0.5 % the last's.
        assert!((380..520).contains(&counts[0]), "{counts:?}");
        assert!(
            counts[0] > counts[3] && counts[3] > counts[40],
            "{counts:?}"
        );
        // Without system prompts there is no application.
        assert!(plan(&params(5, 0, 1.0, 7))
            .iter()
            .all(|s| s.app.is_none() && s.system.is_none()));
    }

    #[test]
    fn a_shared_preamble_comes_first_and_changes_nothing_else() {
        let plain = plan(&params(50, 48, 1.0, 7));
        let mut p = params(50, 48, 1.0, 7);
        p.system_head_tokens = 2_000;
        let with = plan(&p);
        let head = system_head(&p).unwrap();
        assert_eq!(head.len(), 8_000);
        for (a, b) in plain.iter().zip(&with) {
            assert_eq!((&a.id, a.app, &a.system), (&b.id, b.app, &b.system));
            let v: Value = serde_json::from_str(&b.body(1)).unwrap();
            let msgs = v["messages"].as_array().unwrap();
            assert_eq!(msgs.len(), 5);
            assert_eq!(msgs[0]["content"], head.as_str());
            assert_eq!(msgs[1]["content"], b.system.as_deref().unwrap());
            assert_eq!(msgs[2]["role"], "user");
        }
        assert_eq!(system_head(&params(1, 1, 1.0, 7)), None);
    }

    #[test]
    fn the_plan_is_fixed_by_its_seed() {
        let a = plan(&params(300, 48, 1.0, 7));
        let b = plan(&params(300, 48, 1.0, 7));
        let c = plan(&params(300, 48, 1.0, 8));
        let bodies = |v: &[SessionPlan]| -> Vec<(u64, Option<usize>, String, String)> {
            v.iter()
                .map(|s| (s.arrival_ms, s.app, s.body(0), s.body(1)))
                .collect()
        };
        assert_eq!(bodies(&a), bodies(&b));
        assert_ne!(bodies(&a), bodies(&c));
        // The Zipf option changes which prompt a session gets, nothing else of the session.
        let uniform = plan(&params(300, 48, 0.0, 7));
        for (z, u) in a.iter().zip(&uniform) {
            assert_eq!(
                (z.arrival_ms, &z.id, &z.user_msgs, &z.max_tokens),
                (u.arrival_ms, &u.id, &u.user_msgs, &u.max_tokens)
            );
        }
        assert_ne!(
            a.iter().map(|s| s.app).collect::<Vec<_>>(),
            uniform.iter().map(|s| s.app).collect::<Vec<_>>()
        );
    }
}
