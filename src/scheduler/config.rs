//! The plugin configuration: the JSON string Envoy passes to the filter, validated up front.
//!
//! Parsing goes through `serde_json::Value` and explicit field extraction instead of
//! `#[derive(Deserialize)]` so that *every* problem is reported at once, each naming its JSON
//! path and the bound it broke (`endpoints[2].weight must be > 0, got -1`). Serde's derive stops
//! at the first error and cannot name the field of a type error.

use serde_json::{Map, Value};
use std::fmt;

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
}

impl EndpointConfig {
    pub fn serves(&self, model: &str) -> bool {
        match &self.models {
            None => true,
            Some(models) => models.iter().any(|m| m == model),
        }
    }
}

/// The validated configuration. Field docs give the JSON key's meaning; defaults are in
/// [`Config::DEFAULTS`] and documented in `docs/configuration.md`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub endpoints: Vec<EndpointConfig>,
    pub routing_header: String,
    pub session_header: String,
    pub affinity_ttl_ms: u64,
    pub affinity_max_sessions: u64,
    pub ewma_alpha: f64,
    pub success_rate_alpha: f64,
    pub stats_decay_ms: u64,
    pub cold_start_samples: u64,
    pub half_open_probes: u32,
    pub failure_threshold: u32,
    pub open_ms: u64,
    pub rate_limit_ms: u64,
    pub retry_after_max_ms: u64,
    pub max_attempts: u32,
    pub max_body_bytes: u64,
    pub expose_headers: bool,
    pub retry_budget_percent: f64,
    pub retry_budget_min_retries: f64,
    pub failover_timeout_ms: u64,
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

/// A key of the configuration: its name, type, default and bounds. The single source of truth
/// for the configuration reference (a test checks `docs/configuration.md` against it).
#[derive(Debug, Clone, Copy)]
pub struct KeyDoc {
    pub key: &'static str,
    pub kind: &'static str,
    pub default: &'static str,
    pub bounds: &'static str,
}

pub const TOP_LEVEL_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "endpoints",
        kind: "array of endpoint objects",
        default: "(required)",
        bounds: "1..=1024 entries",
    },
    KeyDoc {
        key: "routing_header",
        kind: "string",
        default: "x-computeflux-cluster",
        bounds: "HTTP header name",
    },
    KeyDoc {
        key: "session_header",
        kind: "string",
        default: "x-session-id",
        bounds: "HTTP header name",
    },
    KeyDoc {
        key: "affinity_ttl_ms",
        kind: "integer",
        default: "300000",
        bounds: "1..=86400000",
    },
    KeyDoc {
        key: "affinity_max_sessions",
        kind: "integer",
        default: "100000",
        bounds: "1..=10000000",
    },
    KeyDoc {
        key: "ewma_alpha",
        kind: "number",
        default: "0.3",
        bounds: "(0, 1]",
    },
    KeyDoc {
        key: "success_rate_alpha",
        kind: "number",
        default: "0.1",
        bounds: "(0, 1]",
    },
    KeyDoc {
        key: "stats_decay_ms",
        kind: "integer",
        default: "60000",
        bounds: "1..=86400000",
    },
    KeyDoc {
        key: "cold_start_samples",
        kind: "integer",
        default: "20",
        bounds: "0..=1000000",
    },
    KeyDoc {
        key: "half_open_probes",
        kind: "integer",
        default: "3",
        bounds: "1..=1000",
    },
    KeyDoc {
        key: "failure_threshold",
        kind: "integer",
        default: "5",
        bounds: "1..=1000",
    },
    KeyDoc {
        key: "open_ms",
        kind: "integer",
        default: "30000",
        bounds: "1..=86400000",
    },
    KeyDoc {
        key: "rate_limit_ms",
        kind: "integer",
        default: "60000",
        bounds: "1..=86400000",
    },
    KeyDoc {
        key: "retry_after_max_ms",
        kind: "integer",
        default: "300000",
        bounds: "1..=86400000",
    },
    KeyDoc {
        key: "max_attempts",
        kind: "integer",
        default: "3",
        bounds: "1..=16",
    },
    KeyDoc {
        key: "max_body_bytes",
        kind: "integer",
        default: "8388608",
        bounds: "1..=16777216",
    },
    KeyDoc {
        key: "expose_headers",
        kind: "boolean",
        default: "true",
        bounds: "",
    },
    KeyDoc {
        key: "retry_budget_percent",
        kind: "number",
        default: "20",
        bounds: "0..=100",
    },
    KeyDoc {
        key: "retry_budget_min_retries",
        kind: "number",
        default: "10",
        bounds: "0..=1000000",
    },
    KeyDoc {
        key: "failover_timeout_ms",
        kind: "integer",
        default: "120000",
        bounds: "1..=3600000",
    },
];

pub const ENDPOINT_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "name",
        kind: "string",
        default: "(required)",
        bounds: "unique, [A-Za-z0-9_-]{1,64}",
    },
    KeyDoc {
        key: "cluster",
        kind: "string",
        default: "(required)",
        bounds: "1..=255 bytes, an Envoy cluster name",
    },
    KeyDoc {
        key: "weight",
        kind: "number",
        default: "1",
        bounds: "(0, 1000000]",
    },
    KeyDoc {
        key: "models",
        kind: "array of strings",
        default: "(absent: any model)",
        bounds: "non-empty",
    },
    KeyDoc {
        key: "disabled",
        kind: "boolean",
        default: "false",
        bounds: "",
    },
    KeyDoc {
        key: "headers",
        kind: "object of string to string",
        default: "{}",
        bounds: "valid header names and values",
    },
];

/// Upper bound on endpoints: keeps per-request exclusion sets and selection cost bounded.
pub const MAX_ENDPOINTS: usize = 1024;
const MAX_MS: u64 = 86_400_000;
/// Envoy's largest sensible stream buffer; `max_body_bytes` must not exceed it.
pub const MAX_BODY_BYTES_LIMIT: u64 = 16 * 1024 * 1024;

impl Default for Config {
    fn default() -> Self {
        Config {
            endpoints: Vec::new(),
            routing_header: "x-computeflux-cluster".into(),
            session_header: "x-session-id".into(),
            affinity_ttl_ms: 300_000,
            affinity_max_sessions: 100_000,
            ewma_alpha: 0.3,
            success_rate_alpha: 0.1,
            stats_decay_ms: 60_000,
            cold_start_samples: 20,
            half_open_probes: 3,
            failure_threshold: 5,
            open_ms: 30_000,
            rate_limit_ms: 60_000,
            retry_after_max_ms: 300_000,
            max_attempts: 3,
            max_body_bytes: 8 * 1024 * 1024,
            expose_headers: true,
            retry_budget_percent: 20.0,
            retry_budget_min_retries: 10.0,
            failover_timeout_ms: 120_000,
        }
    }
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
        v.unknown_keys("", obj, TOP_LEVEL_KEYS);
        let mut c = Config::default();
        v.header_name(obj, "routing_header", &mut c.routing_header);
        v.header_name(obj, "session_header", &mut c.session_header);
        v.int(obj, "affinity_ttl_ms", 1, MAX_MS, &mut c.affinity_ttl_ms);
        v.int(
            obj,
            "affinity_max_sessions",
            1,
            10_000_000,
            &mut c.affinity_max_sessions,
        );
        v.unit_interval(obj, "ewma_alpha", &mut c.ewma_alpha);
        v.unit_interval(obj, "success_rate_alpha", &mut c.success_rate_alpha);
        v.int(obj, "stats_decay_ms", 1, MAX_MS, &mut c.stats_decay_ms);
        v.int(
            obj,
            "cold_start_samples",
            0,
            1_000_000,
            &mut c.cold_start_samples,
        );
        v.int32(obj, "half_open_probes", 1, 1000, &mut c.half_open_probes);
        v.int32(obj, "failure_threshold", 1, 1000, &mut c.failure_threshold);
        v.int(obj, "open_ms", 1, MAX_MS, &mut c.open_ms);
        v.int(obj, "rate_limit_ms", 1, MAX_MS, &mut c.rate_limit_ms);
        v.int(
            obj,
            "retry_after_max_ms",
            1,
            MAX_MS,
            &mut c.retry_after_max_ms,
        );
        v.int32(obj, "max_attempts", 1, 16, &mut c.max_attempts);
        v.int(
            obj,
            "max_body_bytes",
            1,
            MAX_BODY_BYTES_LIMIT,
            &mut c.max_body_bytes,
        );
        v.boolean(obj, "expose_headers", &mut c.expose_headers);
        v.number(
            obj,
            "retry_budget_percent",
            0.0,
            100.0,
            &mut c.retry_budget_percent,
        );
        v.number(
            obj,
            "retry_budget_min_retries",
            0.0,
            1_000_000.0,
            &mut c.retry_budget_min_retries,
        );
        v.int(
            obj,
            "failover_timeout_ms",
            1,
            3_600_000,
            &mut c.failover_timeout_ms,
        );
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
                    if let Some(e) = v.endpoint(i, ep, &c.routing_header) {
                        c.endpoints.push(e);
                    }
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
                format!(
                    "{}(cluster={} weight={} models={} disabled={} headers=[{}])",
                    e.name,
                    e.cluster,
                    e.weight,
                    models,
                    e.disabled,
                    headers.join(",")
                )
            })
            .collect();
        format!(
            "endpoints=[{}] routing_header={} session_header={} affinity_ttl_ms={} affinity_max_sessions={} \
             ewma_alpha={} success_rate_alpha={} stats_decay_ms={} cold_start_samples={} half_open_probes={} \
             failure_threshold={} open_ms={} rate_limit_ms={} retry_after_max_ms={} max_attempts={} \
             max_body_bytes={} expose_headers={} retry_budget_percent={} retry_budget_min_retries={} \
             failover_timeout_ms={}",
            endpoints.join(" "),
            self.routing_header,
            self.session_header,
            self.affinity_ttl_ms,
            self.affinity_max_sessions,
            self.ewma_alpha,
            self.success_rate_alpha,
            self.stats_decay_ms,
            self.cold_start_samples,
            self.half_open_probes,
            self.failure_threshold,
            self.open_ms,
            self.rate_limit_ms,
            self.retry_after_max_ms,
            self.max_attempts,
            self.max_body_bytes,
            self.expose_headers,
            self.retry_budget_percent,
            self.retry_budget_min_retries,
            self.failover_timeout_ms,
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

/// A JSON object key as it appears in an error's field path: as is when it is a plain name,
/// else quoted as a JSON string, so that an empty key still names something and a key with a
/// newline cannot forge a log line.
fn path_key(key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
    if plain {
        key.to_string()
    } else {
        Value::String(key.to_string()).to_string()
    }
}

fn is_endpoint_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Headers an endpoint may not set: they would break framing or routing.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "te",
    "upgrade",
];

#[derive(Default)]
struct Validator {
    errors: Vec<ConfigError>,
}

impl Validator {
    fn push(&mut self, field: &str, problem: &str) {
        self.errors.push(ConfigError {
            field: field.to_string(),
            problem: problem.to_string(),
        });
    }

    fn unknown_keys(&mut self, prefix: &str, obj: &Map<String, Value>, known: &[KeyDoc]) {
        for key in obj.keys() {
            if !known.iter().any(|k| k.key == key) {
                let names: Vec<&str> = known.iter().map(|k| k.key).collect();
                self.push(
                    &format!("{prefix}{}", path_key(key)),
                    &format!("is not a known key (known: {})", names.join(", ")),
                );
            }
        }
    }

    fn int(&mut self, obj: &Map<String, Value>, key: &str, min: u64, max: u64, out: &mut u64) {
        self.int_at(obj, key, key, min, max, out)
    }

    fn int_at(
        &mut self,
        obj: &Map<String, Value>,
        key: &str,
        path: &str,
        min: u64,
        max: u64,
        out: &mut u64,
    ) {
        let Some(v) = obj.get(key) else { return };
        match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => *out = n,
            Some(n) => self.push(path, &format!("must be in {min}..={max}, got {n}")),
            None => match v.as_f64() {
                Some(x) => self.push(
                    path,
                    &format!("must be an integer in {min}..={max}, got {x}"),
                ),
                None => self.push(path, &format!("must be an integer, got {}", type_name(v))),
            },
        }
    }

    fn int32(&mut self, obj: &Map<String, Value>, key: &str, min: u32, max: u32, out: &mut u32) {
        let mut wide = u64::from(*out);
        self.int(obj, key, u64::from(min), u64::from(max), &mut wide);
        *out = u32::try_from(wide).unwrap_or(max);
    }

    fn number(&mut self, obj: &Map<String, Value>, key: &str, min: f64, max: f64, out: &mut f64) {
        let Some(v) = obj.get(key) else { return };
        match v.as_f64() {
            Some(x) if x.is_finite() && (min..=max).contains(&x) => *out = x,
            Some(x) => self.push(key, &format!("must be in {min}..={max}, got {x}")),
            None => self.push(key, &format!("must be a number, got {}", type_name(v))),
        }
    }

    fn unit_interval(&mut self, obj: &Map<String, Value>, key: &str, out: &mut f64) {
        let Some(v) = obj.get(key) else { return };
        match v.as_f64() {
            Some(x) if x > 0.0 && x <= 1.0 => *out = x,
            Some(x) => self.push(key, &format!("must be in (0, 1], got {x}")),
            None => self.push(
                key,
                &format!("must be a number in (0, 1], got {}", type_name(v)),
            ),
        }
    }

    fn boolean(&mut self, obj: &Map<String, Value>, key: &str, out: &mut bool) {
        let Some(v) = obj.get(key) else { return };
        match v.as_bool() {
            Some(b) => *out = b,
            None => self.push(key, &format!("must be a boolean, got {}", type_name(v))),
        }
    }

    fn header_name(&mut self, obj: &Map<String, Value>, key: &str, out: &mut String) {
        let Some(v) = obj.get(key) else { return };
        match v.as_str() {
            Some(s) if is_header_name(s) && !s.starts_with(':') => *out = s.to_ascii_lowercase(),
            Some(s) => self.push(key, &format!("must be a valid HTTP header name, got {s:?}")),
            None => self.push(key, &format!("must be a string, got {}", type_name(v))),
        }
    }

    fn endpoint(
        &mut self,
        i: usize,
        value: &Value,
        routing_header: &str,
    ) -> Option<EndpointConfig> {
        let at = format!("endpoints[{i}]");
        let Some(obj) = value.as_object() else {
            self.push(&at, &format!("must be an object, got {}", type_name(value)));
            return None;
        };
        let before = self.errors.len();
        self.unknown_keys(&format!("{at}."), obj, ENDPOINT_KEYS);
        let name = match obj.get("name") {
            None => {
                self.push(&format!("{at}.name"), "is required");
                String::new()
            }
            Some(Value::String(s)) if is_endpoint_name(s) => s.clone(),
            Some(Value::String(s)) => {
                self.push(
                    &format!("{at}.name"),
                    &format!("must match [A-Za-z0-9_-]{{1,64}}, got {s:?}"),
                );
                String::new()
            }
            Some(v) => {
                self.push(
                    &format!("{at}.name"),
                    &format!("must be a string, got {}", type_name(v)),
                );
                String::new()
            }
        };
        let cluster = match obj.get("cluster") {
            None => {
                self.push(&format!("{at}.cluster"), "is required");
                String::new()
            }
            Some(Value::String(s)) if !s.is_empty() && s.len() <= 255 && is_header_value(s) => {
                s.clone()
            }
            Some(Value::String(s)) => {
                self.push(
                    &format!("{at}.cluster"),
                    &format!("must be 1..=255 printable bytes, got {s:?}"),
                );
                String::new()
            }
            Some(v) => {
                self.push(
                    &format!("{at}.cluster"),
                    &format!("must be a string, got {}", type_name(v)),
                );
                String::new()
            }
        };
        let mut weight = 1.0;
        if let Some(v) = obj.get("weight") {
            match v.as_f64() {
                Some(w) if w.is_finite() && w > 0.0 && w <= 1_000_000.0 => weight = w,
                Some(w) if w <= 0.0 => {
                    self.push(&format!("{at}.weight"), &format!("must be > 0, got {w}"))
                }
                Some(w) => self.push(
                    &format!("{at}.weight"),
                    &format!("must be <= 1000000, got {w}"),
                ),
                None => self.push(
                    &format!("{at}.weight"),
                    &format!("must be a number, got {}", type_name(v)),
                ),
            }
        }
        let models = match obj.get("models") {
            None => None,
            Some(Value::Array(list)) if list.is_empty() => {
                self.push(
                    &format!("{at}.models"),
                    "must not be empty (omit it to serve any model)",
                );
                None
            }
            Some(Value::Array(list)) => {
                let mut models = Vec::with_capacity(list.len());
                for (j, m) in list.iter().enumerate() {
                    match m.as_str() {
                        Some(s) if !s.is_empty() && s.len() <= 256 => models.push(s.to_string()),
                        Some(_) => self.push(&format!("{at}.models[{j}]"), "must be 1..=256 bytes"),
                        None => self.push(
                            &format!("{at}.models[{j}]"),
                            &format!("must be a string, got {}", type_name(m)),
                        ),
                    }
                }
                Some(models)
            }
            Some(v) => {
                self.push(
                    &format!("{at}.models"),
                    &format!("must be an array of strings, got {}", type_name(v)),
                );
                None
            }
        };
        let mut disabled = false;
        if let Some(v) = obj.get("disabled") {
            match v.as_bool() {
                Some(b) => disabled = b,
                None => self.push(
                    &format!("{at}.disabled"),
                    &format!("must be a boolean, got {}", type_name(v)),
                ),
            }
        }
        let mut headers = Vec::new();
        match obj.get("headers") {
            None => {}
            Some(Value::Object(map)) => {
                for (hn, hv) in map {
                    let path = format!("{at}.headers.{}", path_key(hn));
                    let lower = hn.to_ascii_lowercase();
                    if !is_header_name(hn) {
                        self.push(&path, "is not a valid HTTP header name");
                    } else if RESERVED_HEADERS.contains(&lower.as_str()) || lower == routing_header
                    {
                        self.push(
                            &path,
                            "may not be set by an endpoint (framing or routing header)",
                        );
                    }
                    match hv.as_str() {
                        // The value is a secret: never echo it in the error.
                        Some(s) if is_header_value(s) => headers.push((lower, s.to_string())),
                        Some(_) => self.push(
                            &path,
                            "value must be printable ASCII without CR/LF (value not shown)",
                        ),
                        None => self.push(
                            &path,
                            &format!("value must be a string, got {}", type_name(hv)),
                        ),
                    }
                }
            }
            Some(v) => self.push(
                &format!("{at}.headers"),
                &format!("must be an object, got {}", type_name(v)),
            ),
        }
        if self.errors.len() > before {
            return None;
        }
        let id = super::hash::endpoint_id(&name);
        Some(EndpointConfig {
            name,
            cluster,
            weight,
            models,
            disabled,
            headers,
            id,
        })
    }

    fn unique_names(&mut self, endpoints: &[EndpointConfig]) {
        for (i, e) in endpoints.iter().enumerate() {
            let earlier = endpoints.iter().take(i);
            if let Some(first) = earlier.clone().position(|o| o.name == e.name) {
                self.push(
                    "endpoints",
                    &format!(
                        "names must be unique: {:?} is used twice (entries {first} and {i})",
                        e.name
                    ),
                );
            } else if let Some(other) = earlier.clone().find(|o| o.id == e.id) {
                self.push(
                    "endpoints",
                    &format!(
                        "names {:?} and {:?} collide in the 32-bit endpoint id; rename one",
                        other.name, e.name
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn errors(v: Value) -> Vec<String> {
        Config::from_value(&v)
            .err()
            .unwrap_or_default()
            .iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn defaults_apply() {
        let c = Config::from_value(&json!({"endpoints":[{"name":"a","cluster":"ca"}]})).unwrap();
        assert_eq!(c.ewma_alpha, 0.3);
        assert_eq!(c.affinity_ttl_ms, 300_000);
        assert_eq!(c.cold_start_samples, 20);
        assert_eq!(c.half_open_probes, 3);
        assert_eq!(c.max_attempts, 3);
        assert_eq!(c.max_body_bytes, 8 * 1024 * 1024);
        assert_eq!(c.routing_header, "x-computeflux-cluster");
        assert_eq!(c.endpoints[0].weight, 1.0);
        assert!(c.endpoints[0].serves("anything"));
    }

    #[test]
    fn reports_every_problem_with_path_and_bound() {
        let errs = errors(json!({
            "endpoints": [
                {"name":"a","cluster":"ca"},
                {"name":"a","cluster":"cb"},
                {"name":"c","cluster":"cc","weight":-1},
                {"cluster":"cd","models":[]},
                {"name":"e","cluster":"ce","headers":{"authorization":"Bearer x\r\ny: z"}}
            ],
            "ewma_alpha": 1.5,
            "half_open_probes": 0,
            "bogus": 1,
            "max_attempts": "3"
        }));
        let has = |s: &str| errs.iter().any(|e| e.contains(s));
        assert!(has("endpoints[2].weight must be > 0, got -1"), "{errs:?}");
        assert!(has("endpoints[3].name is required"), "{errs:?}");
        assert!(has("endpoints[3].models must not be empty"), "{errs:?}");
        assert!(
            has("endpoints[4].headers.authorization value must be printable"),
            "{errs:?}"
        );
        assert!(
            !errs.iter().any(|e| e.contains("Bearer")),
            "secret leaked: {errs:?}"
        );
        assert!(has("ewma_alpha must be in (0, 1], got 1.5"), "{errs:?}");
        assert!(
            has("half_open_probes must be in 1..=1000, got 0"),
            "{errs:?}"
        );
        assert!(has("bogus is not a known key"), "{errs:?}");
        assert!(
            has("max_attempts must be an integer, got a string"),
            "{errs:?}"
        );
        assert!(has("\"a\" is used twice"), "{errs:?}");
    }

    /// Found by the `config` fuzz target: an empty key gave an error with an empty field path
    /// (`computeflux: invalid configuration:  is not a known key`).
    #[test]
    fn odd_keys_are_quoted_in_field_paths() {
        let errs = errors(json!({
            "endpoints": [{"name": "a", "cluster": "a", "": 1,
                           "headers": {"bad header": "v", "x\ny": "v"}}],
            "": 1,
            "evil\ncomputeflux: configuration accepted": 2,
        }));
        let has = |s: &str| errs.iter().any(|e| e.starts_with(s));
        assert!(has("\"\" is not a known key"), "{errs:?}");
        assert!(has("endpoints[0].\"\" is not a known key"), "{errs:?}");
        assert!(
            has("endpoints[0].headers.\"bad header\" is not a valid"),
            "{errs:?}"
        );
        assert!(
            has("endpoints[0].headers.\"x\\ny\" is not a valid"),
            "{errs:?}"
        );
        assert!(
            has("\"evil\\ncomputeflux: configuration accepted\" is not a known key"),
            "{errs:?}"
        );
        assert!(errs.iter().all(|e| !e.contains('\n')), "{errs:?}");
    }

    #[test]
    fn rejects_non_json_and_non_object() {
        assert!(Config::from_json(b"{nope").unwrap_err()[0]
            .to_string()
            .contains("not valid JSON"));
        assert!(Config::from_json(b"[]").unwrap_err()[0]
            .to_string()
            .contains("must be a JSON object"));
        assert!(errors(json!({}))
            .iter()
            .any(|e| e == "endpoints is required"));
        assert!(errors(json!({"endpoints": []}))
            .iter()
            .any(|e| e.contains("at least one")));
    }

    #[test]
    fn summary_never_contains_header_values() {
        let c = Config::from_value(
            &json!({"endpoints":[{"name":"a","cluster":"ca","headers":{"authorization":"Bearer sk-secret"}}]}),
        )
        .unwrap();
        let s = c.summary();
        assert!(s.contains("headers=[authorization]"));
        assert!(!s.contains("sk-secret"));
    }
}
