//! Who is asking: a request's fairness id and its priority.
//!
//! Why: admission orders waiting requests across tenants, so it must know whose each one is,
//! and a tenant's claim on the fleet must come from the operator. The fairness id is the
//! `fairness_header` value when configured, else the caller's credential (`authorization`,
//! else `x-api-key`) — the value sessions are already scoped by. It is hashed here and never
//! stored or logged; a request with neither shares the anonymous id. The priority is the one
//! `tenants` grants the id (0 when not listed), lowered — never raised — by the request header
//! [`PRIORITY_HEADER`]: a client can make itself sheddable, not jump the queue.

use crate::scheduler::config::tenants::{TenantConfig, MAX_PRIORITY, MIN_PRIORITY};
use crate::scheduler::config::Config;
use crate::scheduler::state::hash::hash_parts;
use crate::scheduler::wire::headers::HeaderSource;

/// The request header that lowers a request's priority.
pub const PRIORITY_HEADER: &str = "x-computeflux-priority";

/// Seed of the fairness-id hash (fixed: every worker and replica agrees).
const FAIRNESS_SEED: u64 = 0x6661_6972_6e65_7373; // "fairness"

/// Who a request is, for admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asker {
    /// Hash of the fairness id.
    pub tenant: u64,
    /// Effective priority, `MIN_PRIORITY..=MAX_PRIORITY`.
    pub priority: i8,
    /// Index of the matching `tenants` entry, if any (its `label` tags metrics).
    pub configured: Option<usize>,
}

/// The credential as a tenant id: `authorization` without a leading `Bearer `, else `x-api-key`.
fn credential<H: HeaderSource + ?Sized>(headers: &H) -> Option<Vec<u8>> {
    if let Some(a) = headers.header("authorization") {
        let v: &[u8] = &a;
        let token = match v.get(..7) {
            Some(p) if p.eq_ignore_ascii_case(b"bearer ") => v.get(7..).unwrap_or(&[]),
            _ => v,
        };
        return Some(token.to_vec());
    }
    headers.header("x-api-key").map(|k| k.into_owned())
}

/// The priority a header value asks for, if it is an integer (clamped to the range).
fn asked_priority(v: &[u8]) -> Option<i8> {
    let n: i64 = std::str::from_utf8(v).ok()?.trim().parse().ok()?;
    Some(n.clamp(i64::from(MIN_PRIORITY), i64::from(MAX_PRIORITY)) as i8)
}

/// Who sent a request with `headers`, under `cfg`.
pub fn asker<H: HeaderSource + ?Sized>(cfg: &Config, headers: &H) -> Asker {
    let id: Vec<u8> = match &cfg.fairness_header.0 {
        Some(name) => headers.header(name).map(|v| v.into_owned()),
        None => credential(headers),
    }
    .unwrap_or_default();
    let configured = find(&cfg.tenants, &id);
    let granted = configured
        .and_then(|i| cfg.tenants.get(i))
        .map_or(0, |t| t.priority);
    let priority = headers
        .header(PRIORITY_HEADER)
        .and_then(|v| asked_priority(&v))
        .map_or(granted, |asked| asked.min(granted));
    Asker {
        tenant: tenant_hash(&id),
        priority,
        configured,
    }
}

/// The hash a fairness id is known by (a configured tenant's `id` hashes to its requests').
pub fn tenant_hash(id: &[u8]) -> u64 {
    hash_parts(FAIRNESS_SEED, &[id])
}

fn find(tenants: &[TenantConfig], id: &[u8]) -> Option<usize> {
    if id.is_empty() {
        return None;
    }
    tenants.iter().position(|t| t.id.as_bytes() == id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::wire::headers::HeaderList;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg(extra: &str) -> Config {
        Config::from_json(
            format!(r#"{{"endpoints":[{{"name":"a","cluster":"a"}}]{extra}}}"#).as_bytes(),
        )
        .unwrap()
    }

    fn h(pairs: &[(&str, &str)]) -> HeaderList {
        HeaderList::from(
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn credential_is_the_default_id_and_priority_is_capped() {
        let c = cfg(r#","tenants":[{"id":"sk-gold","priority":3},{"id":"batch","priority":-2}]"#);
        let gold = asker(&c, &h(&[("authorization", "Bearer sk-gold")]));
        assert_eq!((gold.priority, gold.configured), (3, Some(0)));
        // The same credential by x-api-key is the same tenant.
        let same = asker(&c, &h(&[("x-api-key", "sk-gold")]));
        assert_eq!(same.tenant, gold.tenant);
        // A client may lower its priority, never raise it.
        let lower = asker(
            &c,
            &h(&[("authorization", "Bearer sk-gold"), (PRIORITY_HEADER, "-5")]),
        );
        assert_eq!(lower.priority, -5);
        let raise = asker(
            &c,
            &h(&[("authorization", "Bearer other"), (PRIORITY_HEADER, "8")]),
        );
        assert_eq!((raise.priority, raise.configured), (0, None));
        let batch = asker(
            &c,
            &h(&[("authorization", "batch"), (PRIORITY_HEADER, "7")]),
        );
        assert_eq!(batch.priority, -2);
        // Nonsense and out-of-range values: ignored or clamped.
        let junk = asker(
            &c,
            &h(&[("x-api-key", "sk-gold"), (PRIORITY_HEADER, "high")]),
        );
        assert_eq!(junk.priority, 3);
        let low = asker(
            &c,
            &h(&[("x-api-key", "sk-gold"), (PRIORITY_HEADER, "-999")]),
        );
        assert_eq!(low.priority, MIN_PRIORITY);
        // Different credentials, different tenants; none at all is one anonymous tenant.
        assert_ne!(
            asker(&c, &h(&[("x-api-key", "a")])).tenant,
            asker(&c, &h(&[("x-api-key", "b")])).tenant
        );
        assert_eq!(
            asker(&c, &h(&[])).tenant,
            asker(&c, &h(&[("x-other", "1")])).tenant
        );
    }

    #[test]
    fn fairness_header_replaces_the_credential() {
        let c = cfg(r#","fairness_header":"X-Tenant","tenants":[{"id":"team-a","priority":1}]"#);
        let a1 = asker(&c, &h(&[("x-tenant", "team-a"), ("authorization", "k1")]));
        let a2 = asker(&c, &h(&[("x-tenant", "team-a"), ("authorization", "k2")]));
        assert_eq!(a1.tenant, a2.tenant);
        assert_eq!(a1.priority, 1);
        let b = asker(&c, &h(&[("x-tenant", "team-b"), ("authorization", "k1")]));
        assert_ne!(a1.tenant, b.tenant);
        assert_eq!(b.priority, 0);
    }
}
