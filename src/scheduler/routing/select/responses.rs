//! Responses API affinity: a follow-up goes to the endpoint that holds its previous response.
//!
//! Why: with the Responses API a follow-up names its predecessor (`previous_response_id`) and
//! the server continues from the state it stored for it (`store`, true by default). That state
//! lives on the one endpoint that produced the response; anywhere else the follow-up is not a
//! cache miss but an error (`404 previous_response_not_found`). Session keys cannot find that
//! endpoint: each follow-up's `input` holds only the new turn.
//!
//! How:
//! - **Learn.** When an answer to `POST /v1/responses` succeeds, its `id` is read from the
//!   body's first bytes (JSON `{"id":…}`, or the first SSE event, `response.created`, whose
//!   `response.id` it is; see [`IdScan`]) and [`remember`]ed as `id → endpoint` in the same
//!   bounded affinity table as sessions, under a tenant-scoped hash of the id
//!   ([`response_key`]), with the same idle TTL (`affinity_ttl_ms`) and LRU bound
//!   (`affinity_max_sessions`). Only the hash is stored. Answers to requests with
//!   `"store": false` are not remembered: nothing was kept for them.
//! - **Follow.** A request with `previous_response_id` ([`parse_follow_up`]) uses that key as
//!   its session, and a live entry binds the pick to the holder (`Pick::holder`): it is taken
//!   whatever its degraded or saturated verdict, its quota or a pin cookie (each
//!   of those used to send the follow-up elsewhere, to a certain 404), or the pick fails. The
//!   success refreshes the entry. No entry (never seen, expired, or produced behind another
//!   Envoy): routed as usual; the upstream answers 404 if it does not hold the state, as
//!   OpenAI does.
//! - **Holder unavailable.** If the entry names an endpoint that cannot take the request now,
//!   [`check_holder`] says why and the client gets an OpenAI-shaped error naming the reason
//!   ([`HolderUnavailable::status`]): `404 previous_response_not_found` when the holder is gone
//!   for good (removed from the configuration, disabled, or no longer serving the model: its
//!   state cannot be reached through this gateway), `503 previous_response_unavailable` with
//!   `Retry-After` when it is cooling down (breaker open or rate limited) or already failed in
//!   this request. The request is not sent where its state does not exist, and a failed
//!   attempt on the holder is not failed over elsewhere.
//! - **Unless the request carries its whole input.** A follow-up whose `input` replays the
//!   conversation (it contains an earlier model turn: an `assistant` message or a
//!   `reasoning` / `function_call` item; see [`FollowUp::whole_input`]) does not need the
//!   stored state. When its holder is unavailable it is routed like a new conversation, with
//!   `previous_response_id` removed from the body ([`without_previous_response_id`]) so that
//!   the endpoint that gets it does not look for state it lacks — on its first attempt too:
//!   the filter replaces the body Envoy buffered (`Flow::rewritten_body`).

use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::Admission;
use crate::scheduler::routing::select::{Exclusions, Scheduler};
use crate::scheduler::state::hash::session_key;
use crate::scheduler::wire::json_scan::{self, Scan};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Longest response id accepted (OpenAI's are about 50 bytes).
pub const MAX_RESPONSE_ID_BYTES: usize = 256;
/// How much of an answer's body [`IdScan`] reads at most before giving up.
pub const ID_SCAN_BYTES: usize = 64 * 1024;

/// The affinity key of a response id: scoped by the caller's credential like a session, and
/// in a namespace of its own (no session key can equal it).
pub fn response_key(tenant: Option<&[u8]>, response_id: &str) -> u64 {
    let mut id = Vec::with_capacity(2 + response_id.len());
    id.extend_from_slice(b"r:");
    id.extend_from_slice(response_id.as_bytes());
    session_key(tenant.unwrap_or(b""), &id)
}

/// Remembers that `endpoint_id` holds the response `response_id` (after a successful answer
/// to a request that did not say `"store": false`). False if the CAS retries ran out.
pub fn remember(
    sched: &Scheduler<'_>,
    tenant: Option<&[u8]>,
    response_id: &str,
    endpoint_id: u32,
    now_ms: u64,
) -> bool {
    sched
        .affinity()
        .remember(response_key(tenant, response_id), endpoint_id, now_ms)
}

/// The endpoint id holding `response_id`, if a live entry says so.
pub fn holder(
    sched: &Scheduler<'_>,
    tenant: Option<&[u8]>,
    response_id: &str,
    now_ms: u64,
) -> Option<u32> {
    sched
        .affinity()
        .lookup(response_key(tenant, response_id), now_ms)
}

/// What a `POST /v1/responses` body says about the state it builds on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowUp {
    /// `previous_response_id`, if the request continues a stored response.
    pub previous_response_id: Option<String>,
    /// `store` (default true): whether the answer will be stored, so worth remembering.
    pub store: bool,
    /// The `input` replays an earlier model turn: the request does not need the stored state.
    pub whole_input: bool,
}

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    store: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "type")]
    kind: Option<&'a RawValue>,
}

/// Reads the follow-up fields of a Responses API body. Call it after `request::parse_chat`
/// accepted the body (which reports malformed JSON); here anything unreadable reads as "not a
/// follow-up". A `previous_response_id` that is not a string of at most
/// [`MAX_RESPONSE_ID_BYTES`] is ignored (the upstream refuses it).
pub fn parse_follow_up(body: &[u8]) -> FollowUp {
    let Ok(b) = serde_json::from_slice::<Body<'_>>(body) else {
        return FollowUp {
            previous_response_id: None,
            store: true,
            whole_input: false,
        };
    };
    let previous_response_id = b
        .previous_response_id
        .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        .filter(|id| !id.is_empty() && id.len() <= MAX_RESPONSE_ID_BYTES);
    let store = b.store.is_none_or(|raw| raw.get() != "false");
    let whole_input = b
        .input
        .and_then(|raw| serde_json::from_str::<Vec<Item<'_>>>(raw.get()).ok())
        .is_some_and(|items| items.iter().any(is_model_turn));
    FollowUp {
        previous_response_id,
        store,
        whole_input,
    }
}

fn is_model_turn(item: &Item<'_>) -> bool {
    let role = item.role.map(RawValue::get);
    let kind = item.kind.map(RawValue::get);
    role == Some("\"assistant\"")
        || matches!(
            kind,
            Some("\"reasoning\"" | "\"function_call\"" | "\"output_text\"")
        )
}

/// The body without `previous_response_id`, every other byte kept (for a whole-input
/// follow-up sent to an endpoint other than the holder). `None` if there is no such member.
pub fn without_previous_response_id(body: &[u8]) -> Option<Vec<u8>> {
    json_scan::remove_member(body, "previous_response_id")
}

/// Why the endpoint holding a previous response cannot take the follow-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HolderUnavailable {
    /// Not in the configuration any more (its name is unknown).
    NotConfigured,
    /// Disabled by the operator.
    Disabled { name: String },
    /// No longer serves the requested model.
    ModelNotServed { name: String },
    /// Failed earlier in this request (dead key, rate limited, or a failed attempt).
    FailedInRequest { name: String },
    /// Its breaker is open until `retry_at_ms`.
    CoolingDown {
        name: String,
        retry_at_ms: u64,
        rate_limited: bool,
    },
}

/// Can the endpoint `holder_id` take this follow-up now? `Ok(index)` into `cfg.endpoints`:
/// it can, and the scheduler will pick it for the response key (unless its breaker changes
/// in between: check that the pick was an affinity hit). Reads the endpoint table once.
pub fn check_holder(
    sched: &Scheduler<'_>,
    holder_id: u32,
    model: Option<&str>,
    exclusions: &Exclusions,
    now_ms: u64,
) -> Result<usize, HolderUnavailable> {
    let cfg: &Config = sched.cfg;
    let i = cfg
        .endpoint_index(holder_id)
        .ok_or(HolderUnavailable::NotConfigured)?;
    let Some(ep) = cfg.endpoints.get(i) else {
        return Err(HolderUnavailable::NotConfigured);
    };
    let name = ep.name.clone();
    if ep.disabled {
        return Err(HolderUnavailable::Disabled { name });
    }
    if model.is_some_and(|m| !ep.serves(m)) {
        return Err(HolderUnavailable::ModelNotServed { name });
    }
    if exclusions.dead.contains(&i) || exclusions.used.contains(&i) || exclusions.tried.contains(&i)
    {
        return Err(HolderUnavailable::FailedInRequest { name });
    }
    let table = sched.table();
    if let Some((_, st)) = table.entries.get(i) {
        if let Admission::Rejected {
            retry_at_ms,
            rate_limited,
        } = st.breaker.peek(now_ms, &sched.breaker_config())
        {
            return Err(HolderUnavailable::CoolingDown {
                name,
                retry_at_ms,
                rate_limited,
            });
        }
    }
    Ok(i)
}

impl HolderUnavailable {
    /// 404 when the holder is gone for good, 503 when waiting may help.
    pub fn status(&self) -> u16 {
        match self {
            HolderUnavailable::NotConfigured
            | HolderUnavailable::Disabled { .. }
            | HolderUnavailable::ModelNotServed { .. } => 404,
            _ => 503,
        }
    }

    pub fn code(&self) -> &'static str {
        match self.status() {
            404 => "previous_response_not_found",
            _ => "previous_response_unavailable",
        }
    }

    /// The OpenAI error `type`.
    pub fn kind(&self) -> &'static str {
        match self.status() {
            404 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// Seconds for `Retry-After`, when waiting helps.
    pub fn retry_after_s(&self, now_ms: u64) -> Option<u64> {
        match self {
            HolderUnavailable::CoolingDown { retry_at_ms, .. } => {
                Some(retry_at_ms.saturating_sub(now_ms).div_ceil(1000).max(1))
            }
            HolderUnavailable::FailedInRequest { .. } => Some(1),
            _ => None,
        }
    }

    pub fn message(&self, response_id: &str, now_ms: u64) -> String {
        self.message_naming(response_id, now_ms, true)
    }

    /// [`HolderUnavailable::message`], naming the endpoint only if `name_endpoints`
    /// (`expose_headers`: an operator who hides endpoint names hides them here too).
    pub fn message_naming(&self, response_id: &str, now_ms: u64, name_endpoints: bool) -> String {
        let who = |name: &str| {
            if name_endpoints {
                format!("endpoint {name}")
            } else {
                "its endpoint".to_string()
            }
        };
        let why = match self {
            HolderUnavailable::NotConfigured => {
                "was stored by an endpoint that is no longer configured".to_string()
            }
            HolderUnavailable::Disabled { name } => {
                format!("was stored by {}, which is disabled", who(name))
            }
            HolderUnavailable::ModelNotServed { name } => {
                format!(
                    "was stored by {}, which no longer serves this model",
                    who(name)
                )
            }
            HolderUnavailable::FailedInRequest { name } => {
                format!("is stored by {}, which failed this request", who(name))
            }
            HolderUnavailable::CoolingDown {
                name, rate_limited, ..
            } => {
                let state = if *rate_limited {
                    "rate limited"
                } else {
                    "unavailable"
                };
                let secs = self.retry_after_s(now_ms).unwrap_or(1);
                format!(
                    "is stored by {}, which is {state} for {secs} s more",
                    who(name)
                )
            }
        };
        format!(
            "Previous response `{response_id}` {why}; it cannot be continued elsewhere. \
             Retry later, or send the whole conversation as `input` without \
             `previous_response_id`."
        )
    }

    /// The error body (`param` is `previous_response_id`).
    pub fn body(&self, response_id: &str, now_ms: u64) -> String {
        serde_json::json!({"error": {
            "message": self.message(response_id, now_ms),
            "type": self.kind(),
            "param": "previous_response_id",
            "code": self.code(),
        }})
        .to_string()
    }
}

/// The format of an answer, from its `content-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerFormat {
    Json,
    EventStream,
}

impl AnswerFormat {
    pub fn from_content_type(content_type: &str) -> Option<AnswerFormat> {
        match crate::scheduler::wire::api::media_type(content_type).as_str() {
            "application/json" => Some(AnswerFormat::Json),
            "text/event-stream" => Some(AnswerFormat::EventStream),
            _ => None,
        }
    }
}

/// Reads a response id from the first bytes of a successful answer, fed chunk by chunk as
/// they pass: at most [`ID_SCAN_BYTES`] are kept, then it gives up ([`Scan::Absent`]). Call
/// [`IdScan::finish`] at the end of the body.
///
/// The prefix is scanned again from its start only when it has doubled since the last scan
/// (or is full, or the body ended), so the work stays linear in the bytes kept however small
/// the chunks; the id is known at most one doubling after its last byte arrived.
#[derive(Debug, Clone)]
pub struct IdScan {
    format: AnswerFormat,
    buf: Vec<u8>,
    /// Buffer length at the last scan.
    scanned: usize,
    done: Option<Scan<String>>,
}

impl IdScan {
    pub fn new(format: AnswerFormat) -> IdScan {
        IdScan {
            format,
            buf: Vec::new(),
            scanned: 0,
            done: None,
        }
    }

    /// The next chunk of the answer body. `Found` and `Absent` are final.
    pub fn feed(&mut self, chunk: &[u8]) -> Scan<String> {
        self.step(chunk, false)
    }

    fn step(&mut self, chunk: &[u8], end: bool) -> Scan<String> {
        if let Some(d) = &self.done {
            return d.clone();
        }
        let room = ID_SCAN_BYTES.saturating_sub(self.buf.len());
        self.buf
            .extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or(&[]));
        let full = self.buf.len() >= ID_SCAN_BYTES;
        if !end && !full && self.buf.len() < self.scanned.saturating_mul(2).max(1) {
            return Scan::NeedMore;
        }
        self.scanned = self.buf.len();
        let scan = match self.format {
            AnswerFormat::Json => json_scan::string_at(&self.buf, &["id"], MAX_RESPONSE_ID_BYTES),
            AnswerFormat::EventStream => sse_response_id(&self.buf),
        };
        match scan {
            Scan::NeedMore if !full && !end => Scan::NeedMore,
            Scan::NeedMore => self.settle(Scan::Absent),
            s => self.settle(s),
        }
    }

    /// The end of the body: the id, if the answer had one.
    pub fn finish(&mut self) -> Option<String> {
        match self.step(&[], true) {
            Scan::Found(id) => Some(id),
            _ => {
                self.settle(Scan::Absent);
                None
            }
        }
    }

    fn settle(&mut self, s: Scan<String>) -> Scan<String> {
        self.buf = Vec::new();
        self.done = Some(s.clone());
        s
    }
}

/// The `response.id` of the first complete SSE event that has one (`response.created` comes
/// first). Events are separated by a blank line; multi-line `data` is joined with `\n`.
fn sse_response_id(stream: &[u8]) -> Scan<String> {
    let mut rest = stream;
    loop {
        let Some((event, after)) = next_event(rest) else {
            return Scan::NeedMore;
        };
        rest = after;
        let mut data: Vec<u8> = Vec::new();
        for line in event.split(|b| *b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(d) = line.strip_prefix(b"data:") {
                if !data.is_empty() {
                    data.push(b'\n');
                }
                data.extend_from_slice(d.strip_prefix(b" ").unwrap_or(d));
            }
        }
        if data.is_empty() || data == b"[DONE]" {
            continue;
        }
        if let Scan::Found(id) =
            json_scan::string_at(&data, &["response", "id"], MAX_RESPONSE_ID_BYTES)
        {
            return Scan::Found(id);
        }
    }
}

/// The first event (before its blank line) and what follows it, if the blank line is there.
fn next_event(s: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut i = 0;
    while let Some(&b) = s.get(i) {
        if b == b'\n' {
            let rest = s.get(i + 1..).unwrap_or(&[]);
            let blank = match rest.first() {
                Some(b'\n') => Some(1),
                Some(b'\r') if rest.get(1) == Some(&b'\n') => Some(2),
                _ => None,
            };
            if let Some(n) = blank {
                let event = s.get(..i).unwrap_or(&[]);
                return Some((event, rest.get(n..).unwrap_or(&[])));
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests;
