//! The plugin configuration: the JSON string Envoy passes to the filter, validated up front.
//!
//! Parsing goes through `serde_json::Value` and explicit field extraction instead of
//! `#[derive(Deserialize)]` so that *every* problem is reported at once, each naming its JSON
//! path and the bound it broke (`endpoints[2].weight must be > 0, got -1`). Serde's derive stops
//! at the first error and cannot name the field of a type error.
//!
//! Every top-level key is declared once, in the [`config_keys!`] invocation below: its field,
//! type, default, bounds and documented effect. The struct, its `Default`, the validation, the
//! start-up summary and the reference table of `docs/configuration.md` (checked by
//! `tests/config_reference.rs`) are all generated from that one declaration. The checks
//! themselves are in `validate.rs`.
//!
//! A room of its own, read by every room above it; it imports only `state` (endpoint ids are
//! hashes of their names).

use serde_json::{Map, Value};
use std::fmt;
use validate::Validator;

pub mod metrics;
pub mod ranks;
pub mod secret;
mod validate;

use secret::PinCookieKey;

/// One routing target: an API key of a hosted provider or a self-hosted GPU instance.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointConfig {
    /// Unique, `[A-Za-z0-9_-]{1,64}`: used in metrics labels and response headers.
    pub name: String,
    /// The Envoy cluster written into the routing header.
    pub cluster: String,
    /// Static priority; the whole score while the endpoint is cold.
    pub weight: f64,
    /// Models served; `None` serves any model.
    pub models: Option<Vec<String>>,
    /// Taken out of rotation by the operator.
    pub disabled: bool,
    /// Headers set on requests routed to this endpoint (e.g. the provider's API key).
    pub headers: Vec<(String, String)>,
    /// `hash::endpoint_id(name)`: how the affinity table refers to this endpoint.
    pub id: u32,
    /// How its engine's own `/metrics` is scraped; `None`: not scraped (hosted APIs).
    pub metrics: Option<metrics::MetricsConfig>,
    /// The data-parallel rank this endpoint stands for (`data_parallel_size` > 1, see
    /// [`ranks`]); `None`: the whole engine.
    pub data_parallel: Option<ranks::DataParallel>,
}

impl EndpointConfig {
    pub fn serves(&self, model: &str) -> bool {
        match &self.models {
            None => true,
            Some(models) => models.iter().any(|m| m == model),
        }
    }
}

/// What a session pinned by a failover does once its home endpoint is available again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterFailover {
    /// Stay on the endpoint that served the failover (its newest prefix is cached there): the
    /// failover's success re-pins the session.
    Stay,
    /// Go back to the rendezvous home as soon as it admits traffic: a failover's success does
    /// not move the pin.
    ReturnHome,
}

impl AfterFailover {
    pub const ALL: &'static [AfterFailover] = &[AfterFailover::Stay, AfterFailover::ReturnHome];

    pub fn label(&self) -> &'static str {
        match self {
            AfterFailover::Stay => "stay",
            AfterFailover::ReturnHome => "return_home",
        }
    }
}

/// Where a new session goes that the session bound passes over at a busy prefix home (see
/// `routing::sessions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSpill {
    /// The candidate that took the fewest new sessions for its weight (this process's counts;
    /// ties in the prefix's rendezvous order).
    LeastCounted,
    /// The next candidate of the prefix's rendezvous order that takes the session.
    PrefixOrder,
}

impl SessionSpill {
    pub const ALL: &'static [SessionSpill] =
        &[SessionSpill::LeastCounted, SessionSpill::PrefixOrder];

    pub fn label(&self) -> &'static str {
        match self {
            SessionSpill::LeastCounted => "least_counted",
            SessionSpill::PrefixOrder => "prefix_order",
        }
    }
}

/// Who answers `GET /v1/models`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListModels {
    /// The filter, from its configuration: the union of the enabled endpoints' models.
    Local,
    /// One endpoint's own list (a failover call), merged with the configured models it lacks.
    UpstreamMerged,
}

impl ListModels {
    pub const ALL: &'static [ListModels] = &[ListModels::Local, ListModels::UpstreamMerged];

    pub fn label(&self) -> &'static str {
        match self {
            ListModels::Local => "local",
            ListModels::UpstreamMerged => "upstream_merged",
        }
    }
}

/// One configuration problem: the JSON path of the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.field, self.problem)
    }
}

/// How a scalar key is read and what it accepts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Spec {
    /// An integer in `min..=max`.
    Int {
        min: u64,
        max: u64,
    },
    /// A finite number in `min..=max`.
    Number {
        min: f64,
        max: f64,
    },
    /// A number in `(0, 1]`.
    UnitInterval,
    Bool,
    /// An HTTP header name (stored lower-cased).
    HeaderName,
    /// One of a fixed set of strings.
    Choice(&'static [&'static str]),
    /// A secret string of `secret::MIN_SECRET_BYTES..=secret::MAX_SECRET_BYTES` bytes,
    /// never shown.
    Secret,
}

impl Spec {
    fn kind(&self) -> &'static str {
        match self {
            Spec::Int { .. } => "integer",
            Spec::Number { .. } | Spec::UnitInterval => "number",
            Spec::Bool => "boolean",
            Spec::HeaderName | Spec::Choice(_) | Spec::Secret => "string",
        }
    }

    fn bounds(&self) -> String {
        match self {
            Spec::Int { min, max } => format!("{min}..={max}"),
            Spec::Number { min, max } => format!("{min}..={max}"),
            Spec::UnitInterval => "(0, 1]".into(),
            Spec::Bool => String::new(),
            Spec::HeaderName => "HTTP header name".into(),
            Spec::Choice(options) => format!("one of {}", options.join(", ")),
            Spec::Secret => format!(
                "{}..={} bytes",
                secret::MIN_SECRET_BYTES,
                secret::MAX_SECRET_BYTES
            ),
        }
    }
}

/// A key of the configuration as documented: name, type, default, bounds and effect. The
/// configuration reference (`docs/configuration.md`) is checked against these rows.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyDoc {
    pub key: &'static str,
    pub kind: String,
    pub default: String,
    pub bounds: String,
    pub effect: &'static str,
}

/// A field type a scalar key can have: how it is read under its [`Spec`] and shown.
trait Scalar: Sized {
    fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, spec: Spec);
    fn show(&self) -> String;
}

impl Scalar for u64 {
    fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, spec: Spec) {
        if let Spec::Int { min, max } = spec {
            v.int(obj, key, min, max, self);
        }
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Scalar for u32 {
    fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, spec: Spec) {
        if let Spec::Int { min, max } = spec {
            let mut wide = u64::from(*self);
            v.int(obj, key, min, max, &mut wide);
            *self = u32::try_from(wide).unwrap_or(u32::MAX);
        }
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Scalar for f64 {
    fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, spec: Spec) {
        match spec {
            Spec::Number { min, max } => v.number(obj, key, min, max, self),
            Spec::UnitInterval => v.unit_interval(obj, key, self),
            _ => {}
        }
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Scalar for bool {
    fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, _spec: Spec) {
        v.boolean(obj, key, self);
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Scalar for String {
    fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, _spec: Spec) {
        v.header_name(obj, key, self);
    }
    fn show(&self) -> String {
        self.clone()
    }
}

impl Scalar for PinCookieKey {
    fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, _spec: Spec) {
        if let Some(secret) = v.secret(obj, key) {
            *self = PinCookieKey::from_secret(secret.as_bytes());
        }
    }
    fn show(&self) -> String {
        PinCookieKey::show(self)
    }
}

/// A [`Scalar`] for an enum read from one of its labels (`ALL` and `label()`).
macro_rules! choice_scalar {
    ($($ty:ty),*) => {$(
        impl Scalar for $ty {
            fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, spec: Spec) {
                if let Some(label) = v.choice(obj, key, spec) {
                    if let Some(p) = <$ty>::ALL.iter().find(|p| p.label() == label) {
                        *self = *p;
                    }
                }
            }
            fn show(&self) -> String {
                self.label().to_string()
            }
        }
    )*};
}

choice_scalar!(AfterFailover, ListModels, SessionSpill);

/// Declares every top-level scalar key once: `field: type = default, spec, "effect";`.
macro_rules! config_keys {
    ($( $(#[$meta:meta])* $field:ident : $ty:ty = $default:expr, $spec:expr, $effect:literal; )*) => {
        /// The validated configuration. Each field is the JSON key of the same name; its
        /// default, bounds and effect are declared with it and documented in
        /// `docs/configuration.md`.
        #[derive(Debug, Clone, PartialEq)]
        pub struct Config {
            pub endpoints: Vec<EndpointConfig>,
            /// Not a key: the generation of this configuration's endpoint-table layout,
            /// claimed in shared data when the plugin is configured
            /// (`table::claim_layout`); 0 when never claimed (tests, tools). A writer never
            /// rewrites a table laid out by a newer generation to its own layout.
            pub layout_generation: u64,
            $( $(#[$meta])* pub $field: $ty, )*
        }

        impl Default for Config {
            fn default() -> Self {
                Config { endpoints: Vec::new(), layout_generation: 0, $( $field: $default, )* }
            }
        }

        /// The top-level keys, `endpoints` first, in declaration order.
        pub fn top_level_keys() -> Vec<KeyDoc> {
            let d = Config::default();
            vec![
                KeyDoc {
                    key: "endpoints",
                    kind: "array of endpoint objects".into(),
                    default: "(required)".into(),
                    bounds: format!("1..={MAX_ENDPOINTS} entries"),
                    effect: ENDPOINTS_EFFECT,
                },
                $( KeyDoc {
                    key: stringify!($field),
                    kind: $spec.kind().into(),
                    default: Scalar::show(&d.$field),
                    bounds: $spec.bounds(),
                    effect: $effect,
                }, )*
            ]
        }

        impl Config {
            fn read_scalars(v: &mut Validator, obj: &Map<String, Value>, c: &mut Config) {
                $( Scalar::read(&mut c.$field, v, obj, stringify!($field), $spec); )*
            }

            /// `key=value` for every scalar key, in declaration order.
            fn scalar_summary(&self) -> Vec<String> {
                vec![ $( format!("{}={}", stringify!($field), Scalar::show(&self.$field)), )* ]
            }
        }
    };
}

const MAX_MS: u64 = 86_400_000;
const MS: Spec = Spec::Int {
    min: 1,
    max: MAX_MS,
};

const ENDPOINTS_EFFECT: &str = "The routing targets, see [Endpoint keys](#endpoint-keys). Order does not matter; names must be unique.";

config_keys! {
    routing_header: String = "x-computeflux-cluster".into(), Spec::HeaderName,
        "Request header the filter writes the chosen endpoint's `cluster` into; the Envoy route must forward on it (`cluster_header`, or header-match routes in Istio). A value sent by the client is always removed first. Must differ from `session_header`.";
    session_header: String = "x-session-id".into(), Spec::HeaderName,
        "Request header carrying the client's session id: the first source of the session key. Without it the body's `prompt_cache_key`, else an agent harness's session header (`x-claude-code-session-id`, `session_id`, `session-id`, `thread-id`, `x-opencode-session`), else the body's `user`, else a fingerprint of the model, first system and first user message, is the session (see [decisions](decisions.md#session-keys)). Any length is accepted (hashed). Every session is scoped by the caller's `authorization` / `x-api-key`.";
    affinity_ttl_ms: u64 = 300_000, MS,
        "How long a session stays pinned to the endpoint that last served it successfully, counted from its last use. Set it near the endpoints' KV-cache lifetime.";
    affinity_max_sessions: u64 = 100_000, Spec::Int { min: 1, max: 10_000_000 },
        "Upper bound on remembered sessions (shared memory of about 28 bytes each, never freed by Envoy). Past it, the least recently used session of a bucket is forgotten.";
    ewma_alpha: f64 = 0.3, Spec::UnitInterval,
        "Weight of each new sample in the raw latency estimate (time to the answer's headers; for a streamed answer, to its first body byte). Reported as a metric and used in the score of requests without a session; pin breaking and placement judge endpoints by their slowness for the work instead (see [decisions](decisions.md#judging-endpoints)).";
    success_rate_alpha: f64 = 0.1, Spec::UnitInterval,
        "Weight of each new outcome (1 success, 0 failure) in the endpoint's success-rate estimate, which multiplies its score.";
    stats_decay_ms: u64 = 60_000, MS,
        "Time constant with which an idle endpoint's latency and failure penalties fade back toward neutral, so an endpoint that was slow once is tried again.";
    cold_start_samples: u64 = 20, Spec::Int { min: 0, max: 1_000_000 },
        "Until an endpoint has this many samples its score is its `weight` alone (no latency or success signal yet). `0` scores on live signals from the first sample.";
    half_open_probes: u32 = 3, Spec::Int { min: 1, max: 1000 },
        "Requests a recovering (half-open) endpoint receives; all must succeed to close its breaker, the first failure re-opens it.";
    failure_threshold: u32 = 5, Spec::Int { min: 1, max: 1000 },
        "Consecutive endpoint failures (500/502/503/504, connect failure, reset, timeout) that open the breaker.";
    open_ms: u64 = 30_000, MS,
        "How long an endpoint's breaker stays open after `failure_threshold` failures before it is probed.";
    rate_limit_ms: u64 = 60_000, MS,
        "How long an endpoint is left alone after a 429 that carried no reset hint (`Retry-After`, `retry-after-ms`, `x-ratelimit-reset-*`). A 429 opens the breaker at once.";
    retry_after_max_ms: u64 = 300_000, MS,
        "Cap on a 429's reset hint, so a bogus `Retry-After` cannot take an endpoint out for days.";
    max_attempts: u32 = 3, Spec::Int { min: 1, max: 16 },
        "Endpoints tried for one client request, the first included. `1` turns in-request failover off.";
    max_body_bytes: u64 = 8 * 1024 * 1024, Spec::Int { min: 1, max: MAX_BODY_BYTES_LIMIT },
        "Largest request body the filter buffers to read `model`; larger requests get a 413. Keep Envoy's `per_connection_buffer_limit_bytes` and HTTP/2 stream window at or above it.";
    expose_headers: bool = true, Spec::Bool,
        "Adds `x-computeflux-endpoint`, `x-computeflux-attempts` and `x-computeflux-affinity` to responses (see [decisions](decisions.md)). Turn off to hide endpoint names from clients.";
    usage_accounting: bool = true, Spec::Bool,
        "Counts the prompt, cached-prompt and completion tokens of every successful answer from its `usage` (JSON answers, and the final event of streams), per endpoint and affinity result (see [metrics](metrics.md)). The answer is never held back: the filter keeps its last 4 KiB as it passes. Turn off to skip reading answers.";
    retry_budget_percent: f64 = 20.0, Spec::Number { min: 0.0, max: 100.0 },
        "Failovers after an endpoint failure (5xx, connect failure, reset, timeout) allowed as a share of recent requests (10 s decaying window), so an outage does not multiply load on the surviving endpoints. Failovers after 401/403/429 are not charged.";
    retry_budget_min_retries: f64 = 10.0, Spec::Number { min: 0.0, max: 1_000_000.0 },
        "Failovers always allowed on top of the percentage (so low traffic can still fail over).";
    failover_timeout_ms: u64 = 120_000, Spec::Int { min: 1, max: 3_600_000 },
        "Timeout of each failover call the filter makes itself (the first attempt uses the Envoy route's timeout).";
    in_flight_max_age_ms: u64 = 600_000, Spec::Int { min: 1_000, max: MAX_MS },
        "An attempt that has not reported back this long after its start is presumed leaked (a worker's VM crashed between its start and its end, so its in-flight count would never go down) and stops counting toward its endpoint's load, between 1 and 1.5 times this after its start, however busy the endpoint. Keep it above the longest answer you serve (the route timeout, e.g. 300 s in `envoy/envoy.yaml`): a longer one stops counting early.";
    list_models: ListModels = ListModels::Local, Spec::Choice(&["local", "upstream_merged"]),
        "Who answers `GET /v1/models`: `local`, the filter from its configuration (the union of the enabled endpoints' `models`, no upstream call); `upstream_merged`, one endpoint's own list (fetched with a call, failing over like a request) followed by the configured models it did not list, for fleets whose endpoints know more than the configuration says.";
    placement_quantum: f64 = 1.0, Spec::Number { min: 0.0, max: 4.0 },
        "Step, in halvings, of the success-rate levels that weigh an endpoint in rendezvous placement: with `1`, an endpoint that succeeds more than half the time weighs exactly its `weight`, one at 25–50 % half of it, and so on (a dead API key weighs next to nothing). Latency never weighs placement: degraded, saturated, open and short endpoints are skipped instead, so every Envoy replica computes the same home (see [decisions](decisions.md#judging-endpoints)). `0` uses the raw success rate.";
    bounded_load_epsilon: f64 = 1.0, Spec::Number { min: 0.0, max: 100.0 },
        "Bounded-load placement: an endpoint whose load (its engine's scraped running + waiting requests where known, else the in-flight attempts this Envoy counts) would exceed `(1 + epsilon) ×` its weighted share of all in-flight attempts plus `bounded_load_slack` is skipped for new placements, in rendezvous order (consistent hashing with bounded loads).";
    bounded_load_slack: u64 = 8, Spec::Int { min: 1, max: 1_000_000 },
        "The constant added to the bounded-load limit, so that light traffic and short bursts never spill: a spill costs the session a full prefill elsewhere, one more request in an inference engine's batch costs little.";
    pin_spilled_new_sessions: bool = true, Spec::Bool,
        "A new session (its first turn) that spilled past its home over the bounded load is pinned where it was served (with `pin_cookie`, the cookie tells every replica): its whole first turn is cached there and nothing at its home, so its next turn going home would prefill the transcript again. Off, only a spill by prefix, by slots or from a home kept off for its quota is pinned, and the next turn of any other spilled session goes home (issue 22's quota bench, `confirm9-quota` ×3: 3 sessions spilled on their first turn by one replica, their next turns went home on another, between keys that both had quota). A later turn that spills is still not pinned: its home holds its conversation.";
    after_failover: AfterFailover = AfterFailover::Stay, Spec::Choice(&["stay", "return_home"]),
        "Where a session goes once the endpoint it failed over from is available again: `stay` keeps it on the endpoint that served the failover (where its newest prefix is cached), `return_home` sends it back to its rendezvous home (see [decisions](decisions.md#after-a-failover)).";
    prefix_placement: bool = true, Spec::Bool,
        "Places a new session (no pin, no pin cookie) whose instructions — `system` / `developer` messages before the first other message, top-level `system` or `instructions`, `tools` and `functions` — are at least `prefix_min_bytes` long by rendezvous on a key of those instructions (with the model, scoped by the caller's credential) instead of its session key: every Envoy replica sends one application's new sessions to the same endpoint, where its instructions are already cached, and a popular one spills in the prefix's rendezvous order under bounded load. Once served the session is pinned as before; pinned sessions and requests without a session are placed as before (see [decisions](decisions.md#placement-by-prefix)). Off: every new session is placed by its session key.";
    prefix_min_bytes: u64 = 1024, Spec::Int { min: 64, max: 1_048_576 },
        "Shortest instructions segment, in bytes of the request's JSON, that places a new session by prefix (`prefix_placement`). Shorter instructions cost little to prefill anywhere, and grouping every short-prompt session on one endpoint would only add load there.";
    prefix_session_epsilon: f64 = 0.25, Spec::Number { min: 0.0, max: 100.0 },
        "Bound on the sessions a busy prefix home takes: a new session placed by prefix (`prefix_placement`) passes over an endpoint of the prefix's rendezvous order (to the endpoint `prefix_session_spill` names) whose count of new sessions this Envoy placed there recently (`prefix_session_half_life_ms`) would exceed `(1 + epsilon) ×` its weighted share of those placed on the candidates, while that endpoint is busy (`prefix_session_busy_load`). A session's later turns come back where it was placed, so a home that took more than its share keeps its load long after the load it showed at the placement; an idle fleet is never spread (see [decisions](decisions.md#bounding-a-busy-prefix-home-by-the-sessions-placed-there)). Pinned sessions never move for it.";
    prefix_session_busy_load: u64 = 8, Spec::Int { min: 0, max: 1_000_000 },
        "The load (its engine's scraped running + waiting where known, else the in-flight attempts this Envoy counts) from which an endpoint is busy enough for `prefix_session_epsilon` to pass over it; with known slots, at most half of them. Below it a prefix home takes every new session of its prefixes, however many it was given, but for popular ones (`prefix_popular_share`). `0`: always busy.";
    prefix_session_spill: SessionSpill = SessionSpill::LeastCounted, Spec::Choice(&["least_counted", "prefix_order"]),
        "Where a new session goes that `prefix_session_epsilon` passes over at a busy endpoint: `least_counted`, the candidate (admitted, healthy, within its bounded load) that took the fewest new sessions for its weight, ties in the prefix's rendezvous order; `prefix_order`, the next candidate of the prefix's order. An endpoint serving several models carries every model's sessions in its count, so a model's sessions fill the endpoints the others leave (see [decisions](decisions.md#bounding-a-busy-prefix-home-by-the-sessions-placed-there)).";
    prefix_popular_share: f64 = 0.25, Spec::Number { min: 0.0, max: 100.0 },
        "A popular prefix is bounded by `prefix_session_epsilon` before its home is busy: one whose new sessions counted recently (at least; a summary of the 32 heaviest prefix keys, fading like the endpoints' counts) are at least this fraction of the candidate's weighted share of all new sessions counted, and at least 2, is bounded at a candidate with any load (one running or waiting request; `prefix_session_busy_load` for the others). Its home then takes no more than its share before the spill goes to the least-counted candidate, so the most popular applications' homes are not filled before any load shows (the rendezvous draw can put two of them on one endpoint); rarer prefixes keep every session at home until it is busy, their prompts cached in one place (see [decisions](decisions.md#a-popular-prefix-bounded-before-its-home-is-busy)). `0`: off (only busy endpoints are bounded). Pinned sessions, later turns and sessions without a prefix key never move for it.";
    prefix_session_half_life_ms: u64 = 60_000, Spec::Int { min: 0, max: MAX_MS },
        "Half-life of the per-endpoint count of new sessions that `prefix_session_epsilon` bounds (about how long a session keeps sending turns). `0` turns the session bound off: a prefix home then spills by its load alone.";
    pin_cookie: bool = false, Spec::Bool,
        "Carries a session's place in a cookie when it is not its rendezvous home (after a failover or a pin break): the answer sets `cf_pin_<slot>` (one of 8 names: the session's key, the endpoint's id and an expiry, signed with `pin_cookie_secret`; `Max-Age` = `affinity_ttl_ms`, `HttpOnly`, `Path=/`), and any Envoy replica, also one that never saw the session or just restarted, follows it like a pin. For clients that keep cookies (browsers, the OpenAI Python SDK's client); only sessions away from home get one (see [decisions](decisions.md#after-a-failover)).";
    pin_cookie_secret: PinCookieKey = PinCookieKey::default(), Spec::Secret,
        "The key of the pin cookie's MAC (HMAC-SHA256): only cookies the filter signed, for the request's own session and not expired, are followed; others are ignored and counted in `computeflux_pin_cookies_ignored_total`. Give every replica the same value (a random string of at least 32 characters). Absent: the key is derived from the whole configuration, which is secret from clients while endpoints inject credentials (`headers`); when they inject none, a client that knows the configuration could derive it, so set this key. Any configuration change changes a derived key, and cookies issued before are ignored once (see [hardening](hardening.md#signed-pin-cookies)). Never logged.";
    pin_break_ratio: f64 = 3.0, Spec::Number { min: 1.5, max: 1000.0 },
        "A warm endpoint whose slowness (observed ÷ expected time for the work of each answer, smoothed) reaches this multiple of the median slowness of its peers serving the same models is degraded: its pinned sessions are placed again elsewhere (`pin_break`) and it gets no new sessions but probes (see [decisions](decisions.md#judging-endpoints)). `1000` in effect turns pin breaking off.";
    pin_break_min_ms: u64 = 50, Spec::Int { min: 0, max: MAX_MS },
        "Also needed to degrade an endpoint: its slowness gap over its peers costs at least this much per request (its typical expected time × the gap; leaving the degraded state needs it below half of it). A ratio of small numbers is noise, and a few milliseconds a turn never repay the re-prefill a moved session pays once.";
    degraded_exit_ratio: f64 = 1.5, Spec::Number { min: 1.0, max: 1000.0 },
        "A degraded endpoint is whole again once its slowness falls below this multiple of its peers' median (hysteresis: must be below `pin_break_ratio`); a probe whose answer is below it for its work resets the probe backoff.";
    degraded_probe_interval_ms: u64 = 5_000, MS,
        "A degraded endpoint gets one new placement as a probe per this interval (per Envoy), so that its latency estimate can show its recovery. The interval doubles after each probe that is still slow (up to `degraded_probe_max_interval_ms`) and starts again from this value after a fast one.";
    degraded_probe_max_interval_ms: u64 = 60_000, MS,
        "The longest probe interval of an endpoint that stays degraded (never below `degraded_probe_interval_ms`): a probe is a real client's request, and one that stays slow costs that client the slowdown, so an endpoint that keeps failing its probes is probed ever less often.";
    saturated_pin_moves: bool = false, Spec::Bool,
        "Off by default. A session pinned to a *saturated* engine (scraped `metrics`: a queue of at least 5, or 90 % KV-cache usage) moves when the expected wait there exceeds re-prefilling its prompt at an endpoint with a free slot plus the wait there (`saturation::keep_pin`). Off because it measured worse: on the bench's mixed fleet near saturation (one Envoy, same run) moves cost 3.8 points of cached tokens and 5 % of follow-ups for no better p99 (65.9 % · 94.2 % · 2974 ms with them, 69.7 % · 99.2 % · 2791 ms without; `results/bench/herd`). New sessions avoid saturated engines either way (see [decisions](decisions.md#judging-endpoints)).";
    relieve_last_server: bool = true, Spec::Bool,
        "When a degraded endpoint leaves one endpoint as the last healthy server of a model (the bench's `slow` run: `a` and `b` serve `m2`, `a` is slow), that endpoint takes all of the model's sessions: sessions of the *other* models it serves, which have other places to go, are steered off it. A new session passes over it while another candidate has a lower load (running + waiting); a pinned session (or a later turn whose home it is) moves once per TTL when its queue is at least a batch deep and another candidate's is at most a quarter of it in batches (scraped `metrics` only). Never acts while no endpoint is degraded (see [decisions](decisions.md#judging-endpoints)).";
    pin_break_overdue: u64 = 0, Spec::Int { min: 0, max: 4 },
        "Off by default. Affinity hits still waiting for their answer past the degraded threshold for the endpoint's typical work (its smoothed expected time × `pin_break_ratio` × its peers' median slowness, `pin_break_min_ms` above that, and above its own slowness spread) that make a warm endpoint count as degraded while they wait, before its slow answers arrive. Off by default because the filter cannot know at the pick how long a plain answer will generate: a long generation on a healthy endpoint looks overdue (see [decisions](decisions.md#judging-endpoints)). `0`: only answers count.";
    quota_aware: bool = true, Spec::Bool,
        "Quota-aware routing: reads the remaining-quota headers of successful answers — OpenAI / Azure OpenAI `x-ratelimit-remaining-requests`, `x-ratelimit-remaining-tokens`, `x-ratelimit-reset-requests`, `x-ratelimit-reset-tokens` (durations such as `6m0s`), Anthropic `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{remaining,reset}` (reset as RFC 3339) — and skips an endpoint whose remaining requests or tokens are below the floors below or below the request's estimated tokens, until the reset (capped by `retry_after_max_ms`; `rate_limit_ms` without a reset). New sessions go to the next endpoint in rendezvous order; a pinned session moves only when staying is a certain 429 (no request left, or fewer tokens than its estimate). Values that are not plain decimal counts up to 10^12 are ignored.";
    quota_pacing: bool = true, Spec::Bool,
        "Quota pacing: an endpoint that, at the rate its stated tokens or requests were used since its window began or over the last window's length (the previous window's use carried in), would run out before the reset (that rate × time to reset above what remains, on top of the floors), or whose use over the last window's length exceeds its limit less `quota_reserve_percent`, gets no new sessions, so the sessions already pinned there keep their quota instead of moving when it runs out. Needs the answers' limit and reset headers; off, only the floors below apply.";
    quota_limit_weighting: bool = true, Spec::Bool,
        "New sessions are placed in proportion to the keys' stated limits (`x-ratelimit-limit-*`, `anthropic-ratelimit-*-limit`): an endpoint's placement weight is multiplied by its stated limit over the largest stated by the request's candidates (tokens and requests, the smaller ratio), rounded up to a level 2^(-k/2) (1, 0.71, 0.5, …) and at least 1/8. Endpoints that state no limit keep their weight; pinned sessions stay where they are, and a session's home (where a later turn without a pin goes, on any replica) is still computed from the plain weights: a placement away from it sets the pin cookie. Skipped for models served by more than 64 endpoints (a fleet of engines, not keys; it costs a pass over every candidate). Pacing has nothing to go by before a key has spent anything in a window, and sessions placed then spend most in the windows after: placed evenly, a key with a sixth of its peers' limit ran dry in the next window and its pinned sessions moved (see [decisions](decisions.md#quota)). A stated limit is the same on every replica, so homes stay the same everywhere. Needs `quota_aware`.";
    quota_session_growth: bool = true, Spec::Bool,
        "Pacing counts what the new sessions placed on a key in its current window will spend in the next: a conversation resends its transcript, so a session placed now spends about four times its first turn's estimate in the next window (the bench's sessions: about 650 tokens at the first turn, 1 400 in their first window, 2 800 in the next). A key whose use over the last window's length plus three times the first turns placed on it in this window exceeds (behind several replicas each counts its own placements times the key's use over its own picks, at most 4: the others' share) its limit less `quota_reserve_percent` gets no new sessions; when every candidate is short, a new session goes to the one with the most tokens left after that forecast, not the first of its order; and a new session that spilled (over its bounded load) from a home kept off for its quota is pinned where it was served, so that its next turn does not move home. Pinned sessions are never moved by it. Needs `quota_pacing` and the answers' limit headers (see [decisions](decisions.md#quota)).";
    quota_min_requests: u64 = 1, Spec::Int { min: 1, max: 1_000_000 },
        "An endpoint with fewer remaining requests than this (as its last answer said, minus the picks since) gets no new sessions until its reset.";
    quota_min_tokens: u64 = 0, Spec::Int { min: 0, max: 1_000_000_000 },
        "An endpoint with fewer remaining tokens than this, or than the request's estimate, gets no new sessions until its reset. `0`: the estimate alone.";
    quota_reserve_percent: u64 = 0, Spec::Int { min: 0, max: 100 },
        "Share of an endpoint's stated quota limit (`x-ratelimit-limit-*`, `anthropic-ratelimit-*-limit`) kept for its pinned sessions: with fewer requests or tokens left than this percentage of the limit it gets no new sessions, so that the sessions whose prompts it has cached need not move when the quota runs out. `0`: no reserve.";
    quota_bytes_per_token: u64 = 4, Spec::Int { min: 1, max: 1_000 },
        "Request body bytes per estimated token: a request is taken to cost `ceil(body bytes / quota_bytes_per_token)` tokens of an endpoint's quota.";
    payoff_floor: f64 = 0.1, Spec::Number { min: 0.0, max: 1.0 },
        "Closed loop of the affinity payoff (the smoothed cached share of an endpoint's pinned turns' prompts, `computeflux_affinity_payoff_permille`; needs `usage_accounting`): an endpoint whose payoff is below this after `payoff_min_samples` pinned answers (prefix caching off, or a cache that forgets sessions before their pins expire) weighs `payoff_weight` × its weight when sessions are placed, so conversations go to endpoints that cache. Pins are kept; requests without a session are placed as before. `0` turns it off.";
    payoff_min_samples: u64 = 5, Spec::Int { min: 1, max: 1_000_000 },
        "Pinned answers with `usage` an endpoint needs before `payoff_floor` judges it.";
    payoff_min_prompt_tokens: u64 = 1024, Spec::Int { min: 1, max: 1_000_000 },
        "Pinned answers with fewer prompt tokens are not payoff samples: hosted APIs cache nothing below about 1024 tokens (OpenAI from 1024, Anthropic from 1024 or 2048), so a short prompt says nothing of the endpoint's cache. Self-hosted engines cache from one block (vLLM: 16 tokens).";
    payoff_weight: f64 = 0.125, Spec::UnitInterval,
        "Multiplier of the session placement weight of an endpoint below `payoff_floor`. Above zero, so that a few sessions still go there and show when its cache works again.";
}

/// Upper bound on endpoints: keeps per-request exclusion sets and selection cost bounded.
pub const MAX_ENDPOINTS: usize = 1024;
/// Envoy's largest sensible stream buffer; `max_body_bytes` must not exceed it.
pub const MAX_BODY_BYTES_LIMIT: u64 = 16 * 1024 * 1024;

/// The endpoint keys (validated by hand in `Validator::endpoint`).
pub fn endpoint_keys() -> Vec<KeyDoc> {
    let row = |key, kind: &str, default: &str, bounds: &str, effect| KeyDoc {
        key,
        kind: kind.into(),
        default: default.into(),
        bounds: bounds.into(),
        effect,
    };
    let mut keys = vec![
        row("name", "string", "(required)", "unique, [A-Za-z0-9_-]{1,64}",
            "The endpoint's name in metrics labels, logs and the `x-computeflux-endpoint` header; sessions are pinned and placed by (a hash of) it, so renaming one moves its sessions."),
        row("cluster", "string", "(required)", "1..=255 bytes, an Envoy cluster name",
            "The Envoy cluster written into the routing header and used for failover calls. It must exist in Envoy (else the request gets a 503 and failover skips it)."),
        row("weight", "number", "1", "(0, 1000000]",
            "Static preference: an endpoint's share of new sessions in rendezvous placement is its weight (times its health level once warm) over the sum."),
        row("models", "array of strings", "(absent: any model)", "non-empty",
            "Models the endpoint serves; requests for other models never go there. A model no endpoint serves gets a 404 `model_not_found`."),
        row("disabled", "boolean", "false", "",
            "Takes the endpoint out of rotation without deleting it (its sessions move elsewhere)."),
        row("headers", "object of string to string", "{}", "valid header names and values",
            "Request headers set on requests routed to this endpoint (e.g. a hosted provider's `authorization`). Values are never logged. Framing headers and the routing header are refused."),
        row("data_parallel_size", "integer", "1", "1..=64",
            "Data-parallel ranks the endpoint's engine runs (vLLM `--data-parallel-size`, SGLang `--dp-size`), each with its own prefix cache. Above 1 the endpoint becomes one endpoint per rank, named `<name>-r<k>` in metrics and headers, each placed, pinned and load-bounded on its own; the filter sends `x-data-parallel-rank: <k>` (a client's own value is always removed), so every turn of a session reaches the same rank. A scraped engine's queue and batch are split evenly over its ranks."),
    ];
    keys.extend(metrics::metrics_keys());
    keys
}

impl Config {
    /// Parses and validates the plugin configuration. On failure returns every problem found.
    pub fn from_json(bytes: &[u8]) -> Result<Config, Vec<ConfigError>> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| {
            vec![ConfigError {
                field: "configuration".into(),
                problem: format!("is not valid JSON: {e}"),
            }]
        })?;
        Config::from_value(&value)
    }

    pub fn from_value(value: &Value) -> Result<Config, Vec<ConfigError>> {
        let mut v = Validator::default();
        let Some(obj) = value.as_object() else {
            return Err(vec![ConfigError {
                field: "configuration".into(),
                problem: format!("must be a JSON object, got {}", type_name(value)),
            }]);
        };
        v.unknown_keys("", obj, &top_level_keys());
        let mut c = Config::default();
        Config::read_scalars(&mut v, obj, &mut c);
        // Only pin cookies use the key: derive it only for them (a configuration digest at
        // every configure, otherwise).
        if c.pin_cookie && !c.pin_cookie_secret.configured() {
            c.pin_cookie_secret = PinCookieKey::derived(value);
        }
        if c.routing_header == c.session_header {
            v.push("session_header", "must differ from routing_header");
        }
        if c.degraded_exit_ratio >= c.pin_break_ratio {
            v.push(
                "degraded_exit_ratio",
                &format!(
                    "must be below pin_break_ratio ({}), got {}",
                    c.pin_break_ratio, c.degraded_exit_ratio
                ),
            );
        }
        match obj.get("endpoints") {
            None => v.push("endpoints", "is required"),
            Some(Value::Array(list)) => {
                if list.is_empty() {
                    v.push("endpoints", "must list at least one endpoint");
                } else if list.len() > MAX_ENDPOINTS {
                    v.push(
                        "endpoints",
                        &format!(
                            "must list at most {MAX_ENDPOINTS} endpoints, got {}",
                            list.len()
                        ),
                    );
                }
                for (i, ep) in list.iter().take(MAX_ENDPOINTS).enumerate() {
                    if let Some((e, ranks)) = v.endpoint(i, ep, &c.routing_header) {
                        c.endpoints.extend(ranks::expand(e, ranks));
                    }
                }
                if c.endpoints.len() > MAX_ENDPOINTS {
                    v.push(
                        "endpoints",
                        &format!(
                            "with their data-parallel ranks must be at most {MAX_ENDPOINTS} endpoints, got {}",
                            c.endpoints.len()
                        ),
                    );
                }
                v.unique_names(&c.endpoints);
            }
            Some(other) => v.push(
                "endpoints",
                &format!("must be an array, got {}", type_name(other)),
            ),
        }
        if v.errors.is_empty() {
            Ok(c)
        } else {
            Err(v.errors)
        }
    }

    /// The effective values, one `key=value` pair each, for the start-up log line. Endpoint
    /// header values (API keys) are never included: only their names.
    pub fn summary(&self) -> String {
        let endpoints: Vec<String> = self
            .endpoints
            .iter()
            .map(|e| {
                let models = match &e.models {
                    None => "*".to_string(),
                    Some(m) => m.join("|"),
                };
                let headers: Vec<&str> = e.headers.iter().map(|(n, _)| n.as_str()).collect();
                let metrics = e.metrics.as_ref().map_or(String::new(), |m| {
                    format!(
                        " metrics={}:{}{}@{}ms/{}ms",
                        m.format_name(),
                        m.cluster,
                        m.path,
                        m.interval_ms,
                        m.timeout_ms
                    )
                });
                format!(
                    "{}(cluster={} weight={} models={} disabled={} headers=[{}]{})",
                    e.name,
                    e.cluster,
                    e.weight,
                    models,
                    e.disabled,
                    headers.join(","),
                    metrics
                )
            })
            .collect();
        format!(
            "endpoints=[{}] {}",
            endpoints.join(" "),
            self.scalar_summary().join(" ")
        )
    }

    pub fn endpoint_index(&self, id: u32) -> Option<usize> {
        self.endpoints.iter().position(|e| e.id == id)
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// RFC 7230 `token` characters, the alphabet of header names.
pub fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Header values: visible ASCII, space and tab; no CR, LF or NUL (header injection).
pub fn is_header_value(value: &str) -> bool {
    value.len() <= 8192
        && value
            .bytes()
            .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
}

#[cfg(test)]
mod tests;
