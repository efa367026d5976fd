//! Who is asking: the `fairness_header` key and the `tenants` list (priorities granted per
//! fairness id), validated.
//!
//! Why configured here and not by the client: a priority is a claim on the fleet that other
//! tenants pay for, so only the operator grants it; a client may only lower its own (the
//! request header `x-computeflux-priority`, see `admission::who`).

use super::validate::Validator;
use super::{type_name, Scalar, Spec};
use serde_json::{Map, Value};

/// Priorities are integers in `MIN_PRIORITY..=MAX_PRIORITY`; negative ones are sheddable.
pub const MIN_PRIORITY: i8 = -8;
pub const MAX_PRIORITY: i8 = 8;
/// Upper bound on `tenants` entries.
pub const MAX_TENANTS: usize = 1000;
/// Longest `tenants[].id`, bytes.
pub const MAX_TENANT_ID_BYTES: usize = 1024;

/// One `tenants` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantConfig {
    /// Compared with the request's fairness id (see `admission::who`).
    pub id: String,
    /// Granted priority, `MIN_PRIORITY..=MAX_PRIORITY`.
    pub priority: i8,
    /// The metrics tag of this tenant, `[a-z0-9_]{1,32}`.
    pub label: Option<String>,
}

/// The `fairness_header` key: `None` (the default) takes the caller's credential.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FairnessHeader(pub Option<String>);

impl Scalar for FairnessHeader {
    fn read(&mut self, v: &mut Validator, obj: &Map<String, Value>, key: &str, _spec: Spec) {
        if obj.contains_key(key) {
            let mut name = String::new();
            v.header_name(obj, key, &mut name);
            if !name.is_empty() {
                self.0 = Some(name);
            }
        }
    }
    fn show(&self) -> String {
        self.0.clone().unwrap_or_else(|| "(credential)".into())
    }
}

fn is_label(s: &str) -> bool {
    (1..=32).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Reads `tenants` (absent: none); every problem is pushed, naming `tenants[i].<key>`.
pub(super) fn read(v: &mut Validator, value: Option<&Value>) -> Vec<TenantConfig> {
    let Some(value) = value else {
        return Vec::new();
    };
    let Some(list) = value.as_array() else {
        v.push(
            "tenants",
            &format!("must be an array, got {}", type_name(value)),
        );
        return Vec::new();
    };
    if list.len() > MAX_TENANTS {
        v.push(
            "tenants",
            &format!(
                "must list at most {MAX_TENANTS} tenants, got {}",
                list.len()
            ),
        );
    }
    let mut out: Vec<TenantConfig> = Vec::new();
    for (i, t) in list.iter().take(MAX_TENANTS).enumerate() {
        let at = |k: &str| format!("tenants[{i}].{k}");
        let Some(obj) = t.as_object() else {
            v.push(
                &format!("tenants[{i}]"),
                &format!("must be an object, got {}", type_name(t)),
            );
            continue;
        };
        for key in obj.keys() {
            if !["id", "priority", "label"].contains(&key.as_str()) {
                v.push(&at(key), "is not a known key (known: id, priority, label)");
            }
        }
        let id = match obj.get("id").map(|x| x.as_str()) {
            Some(Some(s)) if !s.is_empty() && s.len() <= MAX_TENANT_ID_BYTES => s.to_string(),
            Some(_) => {
                v.push(
                    &at("id"),
                    &format!(
                        "must be a string of 1..={MAX_TENANT_ID_BYTES} bytes (value not shown)"
                    ),
                );
                continue;
            }
            None => {
                v.push(&at("id"), "is required");
                continue;
            }
        };
        if out.iter().any(|o| o.id == id) {
            v.push(&at("id"), "is listed twice (value not shown)");
        }
        let priority = match obj.get("priority") {
            None => 0,
            Some(p) => match p.as_i64() {
                Some(n) if (i64::from(MIN_PRIORITY)..=i64::from(MAX_PRIORITY)).contains(&n) => {
                    i8::try_from(n).unwrap_or(0)
                }
                _ => {
                    v.push(
                        &at("priority"),
                        &format!("must be an integer in {MIN_PRIORITY}..={MAX_PRIORITY}, got {p}"),
                    );
                    0
                }
            },
        };
        let label = match obj.get("label") {
            None => None,
            Some(Value::String(s)) if is_label(s) => Some(s.clone()),
            Some(other) => {
                v.push(
                    &at("label"),
                    &format!("must be a string of [a-z0-9_]{{1,32}}, got {other}"),
                );
                None
            }
        };
        out.push(TenantConfig {
            id,
            priority,
            label,
        });
    }
    out
}
