//! Client sessions for the affinity tests: a session id sent in `x-session-id`, one request per
//! turn, and a record of where and how each turn was served.
//!
//! Why: placement, pin breaking and replica consistency are judged per session over its turns
//! (was a follow-up served where the session started? through which replica? what did the filter
//! say about its decision?), over hundreds of sessions sent concurrently.
//!
//! Every request of every session costs the mock the same: its body is one user message of a
//! fixed size whose first cache block is unique to (session, turn), so the mock's prefix cache
//! never hits and the latency before the response headers is `prompt tokens × prefill cost`.
//! Equal endpoints then have equal latency estimates (up to machine noise), which is what makes
//! their score-based weights comparable across replicas, and a `slow` fault scales that latency
//! by exactly its factor. Routing looks at the session header only, so the body's shape does not
//! matter to the filter.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::chat_body;
use super::http::{try_post_chat, CookieJar};
use super::mock::MockUpstream;

pub const H_ENDPOINT: &str = "x-computeflux-endpoint";
pub const H_AFFINITY: &str = "x-computeflux-affinity";
pub const H_ATTEMPTS: &str = "x-computeflux-attempts";
/// The session header (the filter's default `session_header`).
pub const H_SESSION: &str = "x-session-id";

/// Bytes of user text per request: with the mock's 4 bytes per token, about 80 prompt tokens.
pub const PROMPT_BYTES: usize = 320;

/// A mock endpoint (any model) on which every [`Session`] turn costs the same: about
/// `PROMPT_BYTES / 4` prompt tokens × `prefill_us_per_token` before the response headers (none
/// of them cached), then 1 ms for the body.
pub fn steady_mock(name: &str, prefill_us_per_token: u64) -> MockUpstream {
    let prefill = prefill_us_per_token.to_string();
    MockUpstream::start(
        name,
        &[],
        &["--prefill-us-per-token", &prefill, "--decode-ms", "1"],
    )
}

/// What one turn got back.
#[derive(Clone, Debug)]
pub struct Turn {
    /// Which replica (index chosen by the caller) the request went through.
    pub via: usize,
    /// HTTP status; 0 when the request failed at the transport level (see `error`).
    pub status: u16,
    /// `x-computeflux-endpoint`: the endpoint that served the answer.
    pub endpoint: Option<String>,
    /// `x-computeflux-affinity`: the filter's view of the session at the first attempt.
    pub affinity: Option<String>,
    /// `x-computeflux-attempts`.
    pub attempts: Option<u32>,
    /// When the request was sent.
    pub sent: Instant,
    /// From sending the request to the end of the response.
    pub elapsed: Duration,
    /// The transport error, if any.
    pub error: Option<String>,
}

impl Turn {
    /// Served successfully (2xx).
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn endpoint(&self) -> &str {
        self.endpoint.as_deref().unwrap_or("-")
    }

    pub fn affinity(&self) -> &str {
        self.affinity.as_deref().unwrap_or("-")
    }
}

/// One client session and its turns so far.
#[derive(Clone, Debug)]
pub struct Session {
    pub id: String,
    pub model: String,
    pub turns: Vec<Turn>,
    /// The cookies this client keeps (`name=value`), if it keeps cookies at all (a browser, an
    /// SDK client per conversation); `None` for a client that ignores them.
    pub jar: Option<CookieJar>,
}

impl Session {
    pub fn new(id: impl Into<String>, model: &str) -> Session {
        Session {
            id: id.into(),
            model: model.to_string(),
            turns: Vec::new(),
            jar: None,
        }
    }

    /// `count` sessions `<prefix>-0 …` for `model`.
    pub fn many(prefix: &str, count: usize, model: &str) -> Vec<Session> {
        (0..count)
            .map(|i| Session::new(format!("{prefix}-{i}"), model))
            .collect()
    }

    /// Sends the next turn to `127.0.0.1:port` (labelled `via` in the record) and records it.
    pub fn send(&mut self, via: usize, port: u16) -> &Turn {
        self.send_with(via, port, Value::Null)
    }

    /// [`Session::send`] with more body keys (e.g. `stream`, `max_tokens`).
    pub fn send_with(&mut self, via: usize, port: u16, extra: Value) -> &Turn {
        let text = turn_text(&self.id, self.turns.len());
        let body = chat_body(&self.model, &[text.as_str()], extra);
        let sent = Instant::now();
        let cookie = self.jar.as_ref().and_then(CookieJar::header);
        let mut headers = vec![(H_SESSION, self.id.as_str())];
        if let Some(c) = cookie.as_deref() {
            headers.push(("cookie", c));
        }
        let res = try_post_chat(port, &headers, &body);
        if let (Ok(r), Some(jar)) = (&res, self.jar.as_mut()) {
            jar.store(r);
        }
        let turn = match res {
            Ok(r) => Turn {
                via,
                status: r.status,
                endpoint: r.header(H_ENDPOINT).map(str::to_string),
                affinity: r.header(H_AFFINITY).map(str::to_string),
                attempts: r.header(H_ATTEMPTS).and_then(|a| a.parse().ok()),
                sent,
                elapsed: r.elapsed,
                error: None,
            },
            Err(e) => Turn {
                via,
                status: 0,
                endpoint: None,
                affinity: None,
                attempts: None,
                sent,
                elapsed: sent.elapsed(),
                error: Some(e.to_string()),
            },
        };
        self.turns.push(turn);
        &self.turns[self.turns.len() - 1]
    }

    /// The endpoint that served the first turn.
    pub fn first_endpoint(&self) -> Option<&str> {
        self.turns.first().and_then(|t| t.endpoint.as_deref())
    }

    /// Every turn as `replica:endpoint/affinity` (`!status` when it failed), for messages.
    pub fn trail(&self) -> String {
        let turns: Vec<String> = self
            .turns
            .iter()
            .map(|t| {
                let failed = if t.ok() {
                    String::new()
                } else {
                    format!("!{}", t.status)
                };
                format!("{}:{}/{}{failed}", t.via, t.endpoint(), t.affinity())
            })
            .collect();
        format!("{} [{}]", self.id, turns.join(" "))
    }

    /// The endpoint that served the latest turn.
    pub fn last_endpoint(&self) -> Option<&str> {
        self.turns.last().and_then(|t| t.endpoint.as_deref())
    }
}

/// `turn`'s user text for session `id`: unique from its first bytes, padded to [`PROMPT_BYTES`].
fn turn_text(id: &str, turn: usize) -> String {
    const FILLER: &str = "the quick brown fox jumps over the lazy dog; ";
    let head = format!("session {id} turn {turn}: ");
    let mut text = head.clone();
    while text.len() < PROMPT_BYTES {
        text.push_str(FILLER);
    }
    // ASCII filler: any length is a char boundary.
    text.truncate(PROMPT_BYTES.max(head.len()));
    text
}

/// Runs `f(index, item)` for every item on `threads` client threads and returns when all are
/// done. Thread `j` takes items `j, j + threads, j + 2·threads, …` in order, so the threads work
/// on neighbouring items at any moment (with items sent round-robin over replicas, `threads`
/// equal to the replica count puts one request in flight per replica), and no item is touched
/// by two threads (a session's turns never overlap).
pub fn for_each_parallel<T: Send>(
    items: &mut [T],
    threads: usize,
    f: impl Fn(usize, &mut T) + Sync,
) {
    let threads = threads.max(1);
    let mut lanes: Vec<Vec<(usize, &mut T)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, item) in items.iter_mut().enumerate() {
        lanes[i % threads].push((i, item));
    }
    let f = &f;
    std::thread::scope(|s| {
        for lane in lanes.into_iter().filter(|l| !l.is_empty()) {
            s.spawn(move || {
                for (i, item) in lane {
                    f(i, item);
                }
            });
        }
    });
}

/// Occurrences of each value, in name order (for printing figures and checking spreads).
pub fn tally<S: AsRef<str>>(values: impl IntoIterator<Item = S>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for v in values {
        *out.entry(v.as_ref().to_string()).or_insert(0) += 1;
    }
    out
}

/// `part / whole` in percent (0 when `whole` is 0).
pub fn percent(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}
