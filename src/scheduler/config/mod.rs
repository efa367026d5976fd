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
//! `tests/repo/config_reference.rs`) are all generated from that one declaration. The checks
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
pub mod tenants;
mod validate;

use secret::PinCookieKey;
use tenants::{FairnessHeader, TenantConfig};

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
    /// `Some` for an entry with `"pool": true` (every host of its cluster is an endpoint, see
    /// `routing::pools`) and for each host it expands to; `None` for a plain endpoint.
    pub pool: Option<PoolMember>,
    /// The data-parallel rank this endpoint stands for (`data_parallel_size` > 1, see
    /// [`ranks`]); `None`: the whole engine.
    pub data_parallel: Option<ranks::DataParallel>,
}

/// What makes an endpoint part of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMember {
    /// The pool entry's `name` (the metrics label of all its hosts).
    pub pool: String,
    /// The host's `ip:port`, written into `destination_header`; `None` for the pool entry
    /// itself, which stands for the whole cluster (no host named: Envoy's fallback policy
    /// picks) while no host of it is known.
    pub address: Option<String>,
    /// The host's place in its pool's slot tables (`routing::pools::Host::slot`).
    pub slot: u16,
}

impl EndpointConfig {
    /// The host's `ip:port` when this endpoint is one host of a pool.
    pub fn address(&self) -> Option<&str> {
        self.pool.as_ref().and_then(|p| p.address.as_deref())
    }

    /// The name its metrics are labelled with: its pool's for a pool's hosts (a pool of 1 000
    /// hosts defines the series of one endpoint), else its own.
    pub fn metrics_label(&self) -> &str {
        self.pool.as_ref().map_or(&self.name, |p| &p.pool)
    }

    pub fn serves(&self, model: &str) -> bool {
        match &self.models {
            None => true,
            Some(models) => models.iter().any(|m| m == model),
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

choice_scalar!(ListModels);

/// Declares every scalar key once: `field: type = default, spec, "effect";`, the public
/// top-level keys under `keys`, the unstable ones of the `tuning` object under `tuning`. Both
/// become flat fields of [`Config`].
macro_rules! config_keys {
    (
        keys { $( $(#[$meta:meta])* $field:ident : $ty:ty = $default:expr, $spec:expr, $effect:literal; )* }
        tuning { $( $(#[$tmeta:meta])* $tfield:ident : $tty:ty = $tdefault:expr, $tspec:expr, $teffect:literal; )* }
    ) => {
        /// The validated configuration. Each field is the JSON key of the same name (a
        /// `tuning` field: the key of the same name in the `tuning` object); its default,
        /// bounds and effect are declared with it and documented in `docs/configuration.md`.
        #[derive(Debug, Clone, PartialEq)]
        pub struct Config {
            pub endpoints: Vec<EndpointConfig>,
            /// Not a key: the generation of this configuration's endpoint-table layout,
            /// claimed in shared data when the plugin is configured
            /// (`table::claim_layout`); 0 when never claimed (tests, tools). A writer never
            /// rewrites a table laid out by a newer generation to its own layout.
            pub layout_generation: u64,
            /// The `tenants` list: priorities granted per fairness id (see `tenants`).
            pub tenants: Vec<TenantConfig>,
            $( $(#[$meta])* pub $field: $ty, )*
            $( $(#[$tmeta])* pub $tfield: $tty, )*
        }

        impl Default for Config {
            fn default() -> Self {
                Config {
                    endpoints: Vec::new(),
                    layout_generation: 0,
                    tenants: Vec::new(),
                    $( $field: $default, )*
                    $( $tfield: $tdefault, )*
                }
            }
        }

        /// The top-level keys, `endpoints` first, in declaration order, `tuning` last.
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
                KeyDoc {
                    key: "tenants",
                    kind: "array of tenant objects".into(),
                    default: "[]".into(),
                    bounds: format!("0..={} entries", tenants::MAX_TENANTS),
                    effect: TENANTS_EFFECT,
                },
                $( KeyDoc {
                    key: stringify!($field),
                    kind: $spec.kind().into(),
                    default: Scalar::show(&d.$field),
                    bounds: $spec.bounds(),
                    effect: $effect,
                }, )*
                KeyDoc {
                    key: "tuning",
                    kind: "object".into(),
                    default: "{}".into(),
                    bounds: "keys below".into(),
                    effect: TUNING_EFFECT,
                },
            ]
        }

        /// The keys of the unstable `tuning` object, in declaration order.
        pub fn tuning_keys() -> Vec<KeyDoc> {
            let d = Config::default();
            vec![
                $( KeyDoc {
                    key: stringify!($tfield),
                    kind: $tspec.kind().into(),
                    default: Scalar::show(&d.$tfield),
                    bounds: $tspec.bounds(),
                    effect: $teffect,
                }, )*
            ]
        }

        impl Config {
            fn read_scalars(v: &mut Validator, obj: &Map<String, Value>, c: &mut Config) {
                $( Scalar::read(&mut c.$field, v, obj, stringify!($field), $spec); )*
            }

            /// Reads the `tuning` object's keys; errors name them `tuning.<key>`.
            fn read_tuning(v: &mut Validator, obj: &Map<String, Value>, c: &mut Config) {
                v.scope = "tuning.";
                $( Scalar::read(&mut c.$tfield, v, obj, stringify!($tfield), $tspec); )*
                v.scope = "";
            }

            /// `key=value` for every scalar key, in declaration order (`tuning.key=value` for
            /// the tuning keys).
            fn scalar_summary(&self) -> Vec<String> {
                vec![
                    $( format!("{}={}", stringify!($field), Scalar::show(&self.$field)), )*
                    $( format!("tuning.{}={}", stringify!($tfield), Scalar::show(&self.$tfield)), )*
                ]
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
const TENANTS_EFFECT: &str = "Priorities granted per tenant, used only when the fleet is full (see [admission](routing.md#admission)): `[{\"id\": \"team-a\", \"priority\": 2, \"label\": \"team_a\"}]`. `id` is compared with the request's fairness id (the `fairness_header` value, else the caller's credential: `authorization` with a leading `Bearer ` removed, else `x-api-key`); `priority` is an integer in -8..=8 (default 0, also for every tenant not listed; negative: sheddable, refused rather than queued when the fleet is full); `label` (optional, `[a-z0-9_]{1,32}`) tags the tenant's admission metrics. A request's `x-computeflux-priority` header can lower its priority, never raise it above the granted one.";
const TUNING_EFFECT: &str = "**Unstable.** Model parameters a deployment may need to adjust, see [Tuning keys](#tuning-keys-unstable). Their names, bounds and defaults may change in any release; leave them out unless a measurement says otherwise.";

config_keys! {
    keys {
        routing_header: String = "x-computeflux-cluster".into(), Spec::HeaderName,
            "Request header the filter writes the chosen endpoint's `cluster` into; the Envoy route must forward on it (`cluster_header`, or header-match routes in Istio). A value sent by the client is always removed first. Must differ from `session_header`.";
        destination_header: String = "x-gateway-destination-endpoint".into(), Spec::HeaderName,
            "Request header the filter writes the chosen host of a pool (an endpoint with `pool: true`) into, as `ip:port`, followed comma-separated by the hosts of that pool it would try next; the pool's Envoy cluster must use the `envoy.load_balancing_policies.override_host` load-balancing policy reading it (see [pools](#pools)). The same header as the Gateway API Inference Extension's endpoint picker. A value sent by the client is always removed first. Must differ from `routing_header` and `session_header`.";
        session_header: String = "x-session-id".into(), Spec::HeaderName,
            "Request header carrying the client's session id: the first source of the session key. Without it the body's `prompt_cache_key`, else an agent harness's session header (`x-claude-code-session-id`, `session_id`, `session-id`, `thread-id`, `x-opencode-session`), else the body's `user`, else a fingerprint of the model, first system and first user message, is the session (see [routing](routing.md#session-keys)). Any length is accepted (hashed). Every session is scoped by the caller's `authorization` / `x-api-key`.";
        fairness_header: FairnessHeader = FairnessHeader::default(), Spec::HeaderName,
            "Request header naming the tenant for fairness when the fleet is full (see [admission](routing.md#admission)), for deployments where a filter in front of this one (`jwt_authn`, `ext_authz`) sets it. Absent: the caller's credential (`authorization`, else `x-api-key`), the value sessions are scoped by. Requests with neither share one anonymous tenant.";
        affinity_ttl_ms: u64 = 300_000, MS,
            "How long a session stays pinned to the endpoint that last served it successfully, counted from its last use. Set it near the endpoints' KV-cache lifetime.";
        affinity_max_sessions: u64 = 100_000, Spec::Int { min: 1, max: 10_000_000 },
            "Upper bound on remembered sessions (shared memory of about 32 bytes each, never freed by Envoy). Past it, the least recently used session of a bucket is forgotten.";
        ewma_alpha: f64 = 0.3, Spec::UnitInterval,
            "Weight of each new sample in the raw latency estimate (time to the answer's headers; for a streamed answer, to its first body byte). Reported as a metric and used in the score of requests without a session; pin breaking and placement judge endpoints by their slowness for the work instead (see [routing](routing.md#judging-endpoints)).";
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
            "Adds `x-computeflux-endpoint`, `x-computeflux-attempts` and `x-computeflux-affinity` to responses (see [routing](routing.md)). Turn off to hide endpoint names from clients.";
        usage_accounting: bool = true, Spec::Bool,
            "Counts the prompt, cached-prompt and completion tokens of every successful answer from its `usage` (JSON answers, and the final event of streams), per endpoint and affinity result (see [metrics](metrics.md)). The answer is never held back: the filter keeps its last 4 KiB as it passes. Turn off to skip reading answers.";
        retry_budget_percent: f64 = 20.0, Spec::Number { min: 0.0, max: 100.0 },
            "Failovers after an endpoint failure (5xx, connect failure, reset, timeout) allowed as a share of recent requests (10 s decaying window), so an outage does not multiply load on the surviving endpoints. Failovers after 401/403/429 are not charged.";
        failover_timeout_ms: u64 = 120_000, Spec::Int { min: 1, max: 3_600_000 },
            "Timeout of each failover call the filter makes itself (the first attempt uses the Envoy route's timeout).";
        list_models: ListModels = ListModels::Local, Spec::Choice(&["local", "upstream_merged"]),
            "Who answers `GET /v1/models`: `local`, the filter from its configuration (the union of the enabled endpoints' `models`, no upstream call); `upstream_merged`, one endpoint's own list (fetched with a call, failing over like a request) followed by the configured models it did not list, for fleets whose endpoints know more than the configuration says.";
        prefix_placement: bool = true, Spec::Bool,
            "Places a new session (no pin, no pin cookie) whose instructions — `system` / `developer` messages before the first other message, top-level `system` or `instructions`, `tools` and `functions` — are at least `tuning.prefix_min_bytes` long by rendezvous on a key of those instructions (with the model, scoped by the caller's credential) instead of its session key: every Envoy replica sends one application's new sessions to the same endpoint, where its instructions are already cached, and a popular one spills in the prefix's rendezvous order under bounded load. Once served the session is pinned as before; pinned sessions and requests without a session are placed as before (see [routing](routing.md#placement-by-prefix)). Off: every new session is placed by its session key.";
        pin_cookie: bool = true, Spec::Bool,
            "Carries a session's place in a cookie: a successful answer sets `cf_pin_<slot>` (one of 8 names: the session's key, the endpoint's id and an expiry, signed with `pin_cookie_secret`; `Max-Age` = `affinity_ttl_ms`, `HttpOnly`, `Path=/`) unless the request carried it with at least half its lifetime left, and any Envoy replica, also one that never saw the session or just restarted, follows it like a pin. A session's home can change under it (replicas learn engines' slots and saturation, and a pool's hosts, at their own moments; a failover moves it), so the client carries where it is ([routing](routing.md#after-a-failover)). Clients that keep cookies (browsers, the OpenAI Python SDK's client) carry it; others ignore it. Set `false` only when clients must not receive cookies (no `set-cookie` is added then, and replicas that never saw a session place it by their own view).";
        pin_cookie_secret: PinCookieKey = PinCookieKey::default(), Spec::Secret,
            "The key of the pin cookie's MAC (HMAC-SHA256): only cookies the filter signed, for the request's own session and not expired, are followed; others are ignored and counted in `computeflux_pin_cookies_ignored_total`. Give every replica the same value (a random string of at least 32 characters). Absent: the key is derived from the whole configuration, which is secret from clients while endpoints inject credentials (`headers`); when they inject none, a client that knows the configuration could derive it and sign its own cookies (which gets it no more than a pin it could earn, see [hardening](hardening.md#signed-pin-cookies)): set this key to rule that out. Any configuration change changes a derived key, and cookies issued before are ignored once. Never logged.";
        quota_aware: bool = true, Spec::Bool,
            "Quota-aware routing: reads the remaining-quota headers of successful answers — OpenAI / Azure OpenAI `x-ratelimit-remaining-requests`, `x-ratelimit-remaining-tokens`, `x-ratelimit-reset-requests`, `x-ratelimit-reset-tokens` (durations such as `6m0s`), Anthropic `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{remaining,reset}` (reset as RFC 3339) — and skips an endpoint whose remaining requests or tokens are below the floors (`tuning.quota_min_requests`, `tuning.quota_min_tokens`, `tuning.quota_reserve_percent`) or below the request's estimated tokens (4 body bytes a token), until the reset (capped by `retry_after_max_ms`; `rate_limit_ms` without a reset). New sessions go to the next endpoint in rendezvous order; a pinned session moves only when staying is a certain 429 (no request left, or fewer tokens than its estimate). Pacing: an endpoint whose stated tokens or requests, used at the rate of its window so far or of the last window's length, plus what the new sessions placed on it in this window will spend in the next, would run out before the reset gets no new sessions, so the sessions already pinned there keep their quota. New sessions are placed in proportion to the keys' stated limits (`x-ratelimit-limit-*`, `anthropic-ratelimit-*-limit`; a session's home is still computed from the plain weights). Values that are not plain decimal counts up to 10^12 are ignored (see [routing](routing.md#quota)).";
    }
    tuning {
        retry_budget_min_retries: f64 = 10.0, Spec::Number { min: 0.0, max: 1_000_000.0 },
            "Failovers always allowed on top of the percentage (so low traffic can still fail over).";
        in_flight_max_age_ms: u64 = 600_000, Spec::Int { min: 1_000, max: MAX_MS },
            "An attempt that has not reported back this long after its start is presumed leaked (a worker's VM crashed between its start and its end, so its in-flight count would never go down) and stops counting toward its endpoint's load, between 1 and 1.5 times this after its start, however busy the endpoint. Keep it above the longest answer you serve (the route timeout, e.g. 300 s in `envoy/envoy.yaml`): a longer one stops counting early.";
        bounded_load_epsilon: f64 = 1.0, Spec::Number { min: 0.0, max: 100.0 },
            "Bounded-load placement: an endpoint whose load (its engine's scraped running + waiting requests where known, else the in-flight attempts this Envoy counts) would exceed `(1 + epsilon) ×` its weighted share of all in-flight attempts plus `tuning.bounded_load_slack` is skipped for new placements, in rendezvous order (consistent hashing with bounded loads).";
        bounded_load_slack: u64 = 8, Spec::Int { min: 1, max: 1_000_000 },
            "The constant added to the bounded-load limit, so that light traffic and short bursts never spill: a spill costs the session a full prefill elsewhere, one more request in an inference engine's batch costs little.";
        prefix_min_bytes: u64 = 1024, Spec::Int { min: 64, max: 1_048_576 },
            "Shortest instructions segment, in bytes of the request's JSON, that places a new session by prefix (`prefix_placement`). Shorter instructions cost little to prefill anywhere, and grouping every short-prompt session on one endpoint would only add load there.";
        pin_break_ratio: f64 = 3.0, Spec::Number { min: 1.5, max: 1000.0 },
            "A warm endpoint whose slowness (observed ÷ expected time for the work of each answer, smoothed) reaches this multiple of the median slowness of its peers serving the same models is degraded: its pinned sessions are placed again elsewhere (`pin_break`) and it gets no new sessions but probes (see [routing](routing.md#judging-endpoints)). Must be above 1.5, the multiple below which a degraded endpoint is whole again. `1000` in effect turns pin breaking off.";
        degraded_probe_interval_ms: u64 = 5_000, MS,
            "A degraded endpoint gets one new placement as a probe per this interval (per Envoy; where its engine is scraped, per fleet of replicas: the interval runs from the engine's last decoding and doubles with every replica's probes as that decoding shows them), so that its latency estimate can show its recovery. The interval doubles after each probe that is still slow (up to `tuning.degraded_probe_max_interval_ms`) and starts again from this value after a fast one.";
        degraded_probe_max_interval_ms: u64 = 60_000, MS,
            "The longest probe interval of an endpoint that stays degraded (never below `tuning.degraded_probe_interval_ms`): a probe is a real client's request, and one that stays slow costs that client the slowdown, so an endpoint that keeps failing its probes is probed ever less often.";
        quota_min_requests: u64 = 1, Spec::Int { min: 1, max: 1_000_000 },
            "An endpoint with fewer remaining requests than this (as its last answer said, minus the picks since) gets no new sessions until its reset.";
        quota_min_tokens: u64 = 0, Spec::Int { min: 0, max: 1_000_000_000 },
            "An endpoint with fewer remaining tokens than this, or than the request's estimate, gets no new sessions until its reset. `0`: the estimate alone.";
        quota_reserve_percent: u64 = 0, Spec::Int { min: 0, max: 100 },
            "Share of an endpoint's stated quota limit (`x-ratelimit-limit-*`, `anthropic-ratelimit-*-limit`) kept for its pinned sessions: with fewer requests or tokens left than this percentage of the limit it gets no new sessions, so that the sessions whose prompts it has cached need not move when the quota runs out. `0`: no reserve.";
        payoff_floor: f64 = 0.1, Spec::Number { min: 0.0, max: 1.0 },
            "Closed loop of the affinity payoff (the smoothed cached share of an endpoint's pinned turns' prompts, `computeflux_affinity_payoff_permille`; needs `usage_accounting`): an endpoint whose payoff is below this after 5 pinned answers (prefix caching off, or a cache that forgets sessions before their pins expire) weighs 1/8 of its weight when sessions are placed, so conversations go to endpoints that cache. Pins are kept; requests without a session are placed as before. `0` turns it off.";
        payoff_min_prompt_tokens: u64 = 1024, Spec::Int { min: 1, max: 1_000_000 },
            "Pinned answers with fewer prompt tokens are not payoff samples: hosted APIs cache nothing below about 1024 tokens (OpenAI from 1024, Anthropic from 1024 or 2048), so a short prompt says nothing of the endpoint's cache. Self-hosted engines cache from one block (vLLM: 16 tokens).";
        admission_queue_max: u64 = 256, Spec::Int { min: 1, max: 10_000 },
            "Requests that may wait for admission at once in one Envoy process while every endpoint serving their model is full. A request arriving to a full queue takes the place of the worst-ranked waiting one (lowest priority, then the tenant served the most tokens, then the newest) if it ranks better; the one left out gets a 429 with `Retry-After`.";
        admission_max_wait_ms: u64 = 10_000, Spec::Int { min: 1, max: 600_000 },
            "Longest a request waits for admission; past it the request gets a 429 `queue_timeout` with `Retry-After`. Keep it below your clients' timeouts.";
    }
}

/// A degraded endpoint is whole again once its slowness falls below this multiple of its
/// peers' median (hysteresis: `tuning.pin_break_ratio` must be above it); a probe whose answer
/// is below it for its work resets the probe backoff. Not a key: the measured default.
pub const DEGRADED_EXIT_RATIO: f64 = 1.5;

/// Longest name of a pool entry: its hosts' names add `-` and their address (at most 64 bytes
/// in all, see `routing::pools::host_name`).
pub const MAX_POOL_NAME_BYTES: usize = 40;
/// Upper bound on endpoints: keeps per-request exclusion sets and selection cost bounded.
pub const MAX_ENDPOINTS: usize = 1024;
/// Envoy's largest sensible stream buffer; `max_body_bytes` must not exceed it.
pub const MAX_BODY_BYTES_LIMIT: u64 = 16 * 1024 * 1024;

/// Top-level keys that are no longer keys, each with what replaced it. A configuration that
/// sets one is refused with an error naming the key and its replacement (keys moved into
/// `tuning` are found from [`tuning_keys`] and need no entry).
pub const REMOVED_KEYS: &[(&str, &str)] = &[
    // Rules whose comparison was decided by the bench: the winner is always on.
    ("pin_spilled_new_sessions", "a new session that spilled past its home is always pinned where it was served"),
    ("after_failover", "a session always stays on the endpoint that served its failover (`stay`; `return_home` measured fewer cached tokens and a worse p99)"),
    ("prefix_session_spill", "a session passed over at a busy prefix home always goes to the least-counted candidate (`least_counted`)"),
    ("prefix_popular_share", "the popular-prefix bound is gone: computed from each replica's own counts it moved follow-ups between replicas"),
    ("saturated_pin_moves", "pinned sessions never move off a saturated engine (moves measured fewer cached tokens and no better p99); new sessions still avoid it"),
    ("relieve_last_server", "the last healthy server of a model is always relieved of other models' sessions while an endpoint is degraded"),
    ("pin_break_overdue", "only answers make an endpoint degraded (the overdue watch fired on long healthy generations)"),
    ("quota_pacing", "quota pacing is always on"),
    ("quota_limit_weighting", "new sessions are always placed in proportion to the keys' stated quota limits"),
    ("quota_session_growth", "quota pacing always counts the growth of the new sessions placed in a window"),
    // Model internals: the measured default is built in.
    ("success_rate_alpha", "it is built in (0.1, `routing::select::SUCCESS_RATE_ALPHA`)"),
    ("stats_decay_ms", "it is built in (60000, `routing::placement::score::STATS_DECAY_MS`)"),
    ("placement_quantum", "it is built in (1, `routing::placement::PLACEMENT_QUANTUM`)"),
    ("prefix_session_epsilon", "it is built in (0.25, `routing::placement::sessions::SESSION_EPSILON`)"),
    ("prefix_session_busy_load", "it is built in (8, `routing::placement::sessions::SESSION_BUSY_LOAD`)"),
    ("prefix_session_half_life_ms", "it is built in (60000, `routing::placement::sessions::SESSION_HALF_LIFE_MS`)"),
    ("pin_break_min_ms", "it is built in (50, `routing::judge::slowness::PIN_BREAK_MIN_MS`)"),
    ("degraded_exit_ratio", "it is built in (1.5, `config::DEGRADED_EXIT_RATIO`)"),
    ("quota_bytes_per_token", "it is built in (4, `routing::quota::BYTES_PER_TOKEN`)"),
    ("payoff_min_samples", "it is built in (5, `routing::judge::payoff::PAYOFF_MIN_SAMPLES`)"),
    ("payoff_weight", "it is built in (0.125, `routing::judge::payoff::PAYOFF_WEIGHT`)"),
];

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
        row("pool", "boolean", "false", "",
            "The entry is a pool: every host of its Envoy `cluster` is an endpoint, learned at run time as Envoy's membership changes (EDS, DNS, static), and its other keys apply to each host. Its cluster must use the `override_host` load-balancing policy (see [pools](#pools)). Its hosts are named `<name>-<address>` and counted in metrics under the pool's `name`."),
        row("headers", "object of string to string", "{}", "valid header names and values",
            "Request headers set on requests routed to this endpoint (e.g. a hosted provider's `authorization`). Values are never logged. Framing headers and the routing header are refused."),
        row("data_parallel_size", "integer", "1", "1..=64",
            "Data-parallel ranks the endpoint's engine runs (vLLM `--data-parallel-size`, SGLang `--dp-size`), each with its own prefix cache. Above 1 the endpoint becomes one endpoint per rank, named `<name>-r<k>` in metrics and headers, each placed, pinned and load-bounded on its own; the filter sends `x-data-parallel-rank: <k>` (a client's own value is always removed), so every turn of a session reaches the same rank. Each rank's saturation is judged on its own series where the engine's `/metrics` labels them by rank (vLLM `engine`, SGLang `dp_rank`); on a page without rank labels the engine's queue and batch are split evenly over its ranks."),
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
        // A removed key gets an error naming its replacement instead of "not a known key".
        let tuning = tuning_keys();
        let removed: Vec<&String> = obj.keys().filter(|k| v.removed_key(k, &tuning)).collect();
        v.unknown_keys_except("", obj, &top_level_keys(), &removed);
        let mut c = Config::default();
        Config::read_scalars(&mut v, obj, &mut c);
        c.tenants = tenants::read(&mut v, obj.get("tenants"));
        match obj.get("tuning") {
            None => {}
            Some(Value::Object(t)) => {
                v.unknown_keys("tuning.", t, &tuning);
                Config::read_tuning(&mut v, t, &mut c);
            }
            Some(other) => v.push(
                "tuning",
                &format!("must be an object, got {}", type_name(other)),
            ),
        }
        // Only pin cookies use the key: derive it only for them (a configuration digest at
        // every configure, otherwise).
        if c.pin_cookie && !c.pin_cookie_secret.configured() {
            c.pin_cookie_secret = PinCookieKey::derived(value);
        }
        for (key, other) in [
            ("routing_header", &c.routing_header),
            ("session_header", &c.session_header),
        ] {
            if c.destination_header == *other {
                v.push("destination_header", &format!("must differ from {key}"));
            }
        }
        if c.pin_break_ratio <= DEGRADED_EXIT_RATIO {
            v.push(
                "tuning.pin_break_ratio",
                &format!(
                    "must be above the degraded exit ratio ({DEGRADED_EXIT_RATIO}), got {}",
                    c.pin_break_ratio
                ),
            );
        }
        if c.routing_header == c.session_header {
            v.push("session_header", "must differ from routing_header");
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
                    if let Some((e, ranks)) =
                        v.endpoint(i, ep, &[&c.routing_header, &c.destination_header])
                    {
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
                    "{}(cluster={}{} weight={} models={} disabled={} headers=[{}]{})",
                    e.name,
                    e.cluster,
                    if e.pool.is_some() { " pool=true" } else { "" },
                    e.weight,
                    models,
                    e.disabled,
                    headers.join(","),
                    metrics
                )
            })
            .collect();
        // Tenant ids may be credentials: only their count and granted priorities are shown.
        let tenants: Vec<String> = self
            .tenants
            .iter()
            .map(|t| format!("{}:{}", t.label.as_deref().unwrap_or("-"), t.priority))
            .collect();
        format!(
            "endpoints=[{}] tenants=[{}] {}",
            endpoints.join(" "),
            tenants.join(","),
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
