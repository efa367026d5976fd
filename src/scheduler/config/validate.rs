//! The checks behind [`Config::from_json`](super::Config::from_json): a [`Validator`] collects
//! every problem, each naming its JSON path and the bound it broke, instead of stopping at the
//! first. The keys themselves (types, defaults, bounds) are declared in `config/mod.rs`.

use super::*;

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
pub(super) struct Validator {
    pub(super) errors: Vec<ConfigError>,
    /// Prepended to every field an error names: `tuning.` while the `tuning` object is read.
    pub(super) scope: &'static str,
}

impl Validator {
    pub(super) fn push(&mut self, field: &str, problem: &str) {
        self.errors.push(ConfigError {
            field: format!("{}{field}", self.scope),
            problem: problem.to_string(),
        });
    }

    /// Whether the top-level `key` is one that was removed ([`REMOVED_KEYS`]) or moved into
    /// `tuning`; if so, reports it with what replaced it.
    pub(super) fn removed_key(&mut self, key: &str, tuning: &[KeyDoc]) -> bool {
        if let Some((_, replacement)) = REMOVED_KEYS.iter().find(|(k, _)| *k == key) {
            self.push(key, &format!("was removed: {replacement}"));
            true
        } else if tuning.iter().any(|k| k.key == key) {
            self.push(
                key,
                &format!("was moved: set it as `tuning.{key}` (unstable)"),
            );
            true
        } else {
            false
        }
    }

    pub(super) fn unknown_keys(
        &mut self,
        prefix: &str,
        obj: &Map<String, Value>,
        known: &[KeyDoc],
    ) {
        self.unknown_keys_except(prefix, obj, known, &[]);
    }

    /// [`Validator::unknown_keys`], silent about the keys in `reported`.
    pub(super) fn unknown_keys_except(
        &mut self,
        prefix: &str,
        obj: &Map<String, Value>,
        known: &[KeyDoc],
        reported: &[&String],
    ) {
        for key in obj.keys() {
            if !known.iter().any(|k| k.key == key) && !reported.contains(&key) {
                let names: Vec<&str> = known.iter().map(|k| k.key).collect();
                self.push(
                    &format!("{prefix}{}", path_key(key)),
                    &format!("is not a known key (known: {})", names.join(", ")),
                );
            }
        }
    }

    pub(super) fn int(
        &mut self,
        obj: &Map<String, Value>,
        key: &str,
        min: u64,
        max: u64,
        out: &mut u64,
    ) {
        self.int_at(obj, key, key, min, max, out)
    }

    pub(super) fn int_at(
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

    pub(super) fn number(
        &mut self,
        obj: &Map<String, Value>,
        key: &str,
        min: f64,
        max: f64,
        out: &mut f64,
    ) {
        let Some(v) = obj.get(key) else { return };
        match v.as_f64() {
            Some(x) if x.is_finite() && (min..=max).contains(&x) => *out = x,
            Some(x) => self.push(key, &format!("must be in {min}..={max}, got {x}")),
            None => self.push(key, &format!("must be a number, got {}", type_name(v))),
        }
    }

    pub(super) fn unit_interval(&mut self, obj: &Map<String, Value>, key: &str, out: &mut f64) {
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

    pub(super) fn boolean(&mut self, obj: &Map<String, Value>, key: &str, out: &mut bool) {
        let Some(v) = obj.get(key) else { return };
        match v.as_bool() {
            Some(b) => *out = b,
            None => self.push(key, &format!("must be a boolean, got {}", type_name(v))),
        }
    }

    pub(super) fn header_name(&mut self, obj: &Map<String, Value>, key: &str, out: &mut String) {
        let Some(v) = obj.get(key) else { return };
        match v.as_str() {
            Some(s) if is_header_name(s) && !s.starts_with(':') => *out = s.to_ascii_lowercase(),
            Some(s) => self.push(key, &format!("must be a valid HTTP header name, got {s:?}")),
            None => self.push(key, &format!("must be a string, got {}", type_name(v))),
        }
    }

    /// A secret string of `MIN_SECRET_BYTES..=MAX_SECRET_BYTES` bytes; returns it when it is.
    /// The value is never echoed in an error.
    pub(super) fn secret<'v>(&mut self, obj: &'v Map<String, Value>, key: &str) -> Option<&'v str> {
        use super::secret::{MAX_SECRET_BYTES, MIN_SECRET_BYTES};
        let v = obj.get(key)?;
        match v.as_str() {
            Some(s) if (MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&s.len()) => Some(s),
            Some(s) => {
                self.push(
                    key,
                    &format!(
                        "must be {MIN_SECRET_BYTES}..={MAX_SECRET_BYTES} bytes long, got {} (value not shown)",
                        s.len()
                    ),
                );
                None
            }
            None => {
                self.push(key, &format!("must be a string, got {}", type_name(v)));
                None
            }
        }
    }

    /// A string that must be one of `spec`'s options; returns it when it is.
    pub(super) fn choice<'v>(
        &mut self,
        obj: &'v Map<String, Value>,
        key: &str,
        spec: Spec,
    ) -> Option<&'v str> {
        let Spec::Choice(options) = spec else {
            return None;
        };
        let v = obj.get(key)?;
        match v.as_str() {
            Some(s) if options.contains(&s) => Some(s),
            Some(s) => {
                self.push(
                    key,
                    &format!("must be one of {}, got {s:?}", options.join(", ")),
                );
                None
            }
            None => {
                self.push(key, &format!("must be a string, got {}", type_name(v)));
                None
            }
        }
    }

    pub(super) fn endpoint(
        &mut self,
        i: usize,
        value: &Value,
        routing_headers: &[&str],
    ) -> Option<(EndpointConfig, u32)> {
        let at = format!("endpoints[{i}]");
        let Some(obj) = value.as_object() else {
            self.push(&at, &format!("must be an object, got {}", type_name(value)));
            return None;
        };
        let before = self.errors.len();
        // The dotted rows (`metrics.path`) document keys of the nested object, not of this one.
        let keys: Vec<KeyDoc> = endpoint_keys()
            .into_iter()
            .filter(|k| !k.key.contains('.'))
            .collect();
        self.unknown_keys(&format!("{at}."), obj, &keys);
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
        let mut ranks = 1u64;
        let ranks_at = format!("{at}.data_parallel_size");
        let max_ranks = u64::from(super::ranks::MAX_DATA_PARALLEL_SIZE);
        self.int_at(
            obj,
            "data_parallel_size",
            &ranks_at,
            1,
            max_ranks,
            &mut ranks,
        );
        let ranks = u32::try_from(ranks).unwrap_or(1);
        if ranks > 1 && !name.is_empty() {
            let longest = super::ranks::rank_name(&name, ranks - 1);
            if !is_endpoint_name(&longest) {
                self.push(
                    &format!("{at}.name"),
                    &format!(
                        "must leave room for its ranks' names (`<name>-r<k>`, at most 64 bytes) with data_parallel_size {ranks}, got {} bytes",
                        name.len()
                    ),
                );
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
                    } else if RESERVED_HEADERS.contains(&lower.as_str())
                        || routing_headers.contains(&lower.as_str())
                    {
                        self.push(
                            &path,
                            "may not be set by an endpoint (framing or routing header)",
                        );
                    } else if ranks > 1 && lower == super::ranks::RANK_HEADER {
                        self.push(
                            &path,
                            "is set by the filter for each rank (data_parallel_size > 1)",
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
        let mut pool = None;
        if let Some(v) = obj.get("pool") {
            match v.as_bool() {
                Some(true) => {
                    if name.len() > MAX_POOL_NAME_BYTES {
                        self.push(
                            &format!("{at}.name"),
                            &format!(
                                "of a pool must be at most {} bytes (its hosts' names add their address), got {}",
                                MAX_POOL_NAME_BYTES,
                                name.len()
                            ),
                        );
                    }
                    pool = Some(PoolMember {
                        pool: name.clone(),
                        address: None,
                        slot: 0,
                    });
                }
                Some(false) => {}
                None => self.push(
                    &format!("{at}.pool"),
                    &format!("must be a boolean, got {}", type_name(v)),
                ),
            }
        }
        let metrics = obj.get("metrics").and_then(|m| {
            crate::scheduler::config::metrics::parse(
                &format!("{at}.metrics"),
                m,
                &cluster,
                &mut self.errors,
            )
        });
        if let (Some(_), Some(m)) = (&pool, &metrics) {
            if m.cluster != cluster {
                self.push(
                    &format!("{at}.metrics.cluster"),
                    &format!(
                        "of a pool must be the pool's own cluster {cluster:?} (each host is scraped through it), got {:?}",
                        m.cluster
                    ),
                );
            }
        }
        if ranks > 1 && pool.is_some() {
            self.push(
                &ranks_at,
                "is not supported on a pool yet (each host of a pool is one endpoint); run the pool's engines with one rank each or list them as endpoints",
            );
        }
        if self.errors.len() > before {
            return None;
        }
        let id = crate::scheduler::state::hash::endpoint_id(&name);
        let ep = EndpointConfig {
            name,
            cluster,
            weight,
            models,
            disabled,
            headers,
            id,
            metrics,
            pool,
            data_parallel: None,
        };
        Some((ep, ranks))
    }

    pub(super) fn unique_names(&mut self, endpoints: &[EndpointConfig]) {
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
