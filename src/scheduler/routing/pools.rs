//! Pools: the hosts of one Envoy cluster as endpoints, learned while Envoy's membership changes.
//!
//! Why: self-hosted engines are pods behind one Service, scaled and replaced all day, and Envoy
//! already knows them (EDS). An endpoint entry with `"pool": true` stands for every host of its
//! cluster; the filter names the host it picked in `destination_header` (`ip:port`, then the
//! hosts it would try next), and the cluster's `override_host` load-balancing policy sends the
//! request there (a host no longer in the cluster falls through to the next one listed; no
//! host listed, or none left, to the policy's fallback).
//!
//! Upstream proxy-wasm cannot list a cluster's hosts, so the filter learns them from answers:
//! - a client answer's `upstream.address` names the host that served it;
//! - a callout's answer (failover, scrape, discovery) names it in [`STAMP_HEADER`], which the
//!   pool cluster's upstream `header_mutation` filter sets to `%UPSTREAM_REMOTE_ADDRESS%`;
//! - discovery callouts sent with no host named are served wherever the fallback policy
//!   picks, so each one may teach a new host (see `filter::pools`).
//!
//! Membership ([`Membership`], one shared-data value per pool, [`membership_key`]) changes on
//! evidence ([`Membership::observe`]):
//! - **join**: an answer served by a host not known yet (not within [`DEPARTED_QUIET_MS`] of
//!   its departure: an answer already in flight when it left must not bring it back);
//! - **departure**: an answer to a request that named host H first, served by another host:
//!   `override_host` passes over a host only when it is not (or no longer healthy) in the
//!   cluster.
//!
//! A departed host that had no traffic stays listed until a request or a scrape names it:
//! harmless, as Envoy never sends anything to a host outside the cluster and the list's next
//! host (the next in rendezvous order, where every replica would place the session) serves.
//!
//! Every replica computes the same endpoints from the same membership: a host's endpoint name
//! is [`host_name`] (pool name and address), its id the hash of that name, and the hosts are
//! laid out sorted by address ([`expand`]). The effective configuration is the configured one
//! with each pool entry replaced by one endpoint per known host (the entry itself while none
//! is known); it is installed as a configuration reload is (the endpoint table re-laid out by
//! its generation, state kept by endpoint id), so the scheduler treats a host like any endpoint.
//!
//! Bounds: at most [`MAX_POOL_HOSTS`] hosts per pool and `MAX_ENDPOINTS` endpoints in all
//! (hosts past it are left out, in address order), [`MAX_DEPARTED`] departures remembered.
//! Per-host shared state is bounded and keyed so that nothing of a departed host is left
//! behind: the endpoint table by layout position; the scraped engine loads in one value by
//! endpoint id (`scrape::Loads`), from which the next scrape's write drops every id no longer
//! in the configuration. [`Host::slot`] numbers a pool's hosts (the lowest free one when it
//! joined, reused by the next host to join).

use crate::scheduler::config::{Config, EndpointConfig, PoolMember, MAX_ENDPOINTS};
use crate::scheduler::routing::placement;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::hash::{endpoint_id, hash_parts};
use crate::scheduler::state::store::{update_if, Store};
use std::collections::BTreeSet;
use std::net::SocketAddr;

pub use crate::scheduler::config::MAX_POOL_NAME_BYTES;
/// Hosts one pool holds at most.
pub const MAX_POOL_HOSTS: usize = 1024;
/// Departed hosts remembered per pool (the newest).
pub const MAX_DEPARTED: usize = 64;
/// An answer served by a host that departed less than this ago does not bring it back (it was
/// in flight when the host left).
pub const DEPARTED_QUIET_MS: u64 = 5_000;
/// Response header naming the host that served a callout, set by the pool cluster's upstream
/// `header_mutation` filter to `%UPSTREAM_REMOTE_ADDRESS%`; removed before any answer reaches
/// a client.
pub const STAMP_HEADER: &str = "x-computeflux-upstream-host";
/// A pool settles this long after this Envoy's start and after each change of its membership:
/// discovery rounds come every tick with more calls ([`discovery_calls`]), so that replicas,
/// which learn a change at different moments, disagree on the hosts as briefly as possible.
pub const SETTLE_MS: u64 = 3_000;
/// Discovery calls per pool and round at most (outside settling: [`MAX_STEADY_CALLS`]).
pub const MAX_SETTLING_CALLS: usize = 32;
/// Discovery calls per pool and round at most once the pool has settled.
pub const MAX_STEADY_CALLS: usize = 8;

/// Discovery calls of one round for a pool of `known` hosts: two more than the hosts known
/// once settled (2..=[`MAX_STEADY_CALLS`]); while settling, twice the known hosts and four
/// more (8..=[`MAX_SETTLING_CALLS`]). Sent together, the calls are spread by the cluster's
/// fallback policy (least_request counts them in flight), so a round of at least as many calls
/// as hosts reaches most of them.
pub fn discovery_calls(known: usize, settling: bool) -> usize {
    if settling {
        known
            .saturating_mul(2)
            .saturating_add(4)
            .clamp(8, MAX_SETTLING_CALLS)
    } else {
        known.saturating_add(2).clamp(2, MAX_STEADY_CALLS)
    }
}

/// Longest address kept (`[` IPv6 `]:` port).
const MAX_ADDRESS_BYTES: usize = 64;
const VERSION: u8 = 1;

/// The shared-data key of a pool's membership (one per pool entry of the configuration).
pub fn membership_key(pool: &str) -> String {
    format!("computeflux/pool/v{VERSION}/{pool}")
}

/// `s` as a canonical `ip:port` (IPv6 in brackets), if it is one.
pub fn address(s: &str) -> Option<String> {
    let a: SocketAddr = s.trim().parse().ok()?;
    let text = a.to_string();
    (a.port() != 0 && text.len() <= MAX_ADDRESS_BYTES).then_some(text)
}

/// The endpoint name of the host at `address` in pool `pool`: `<pool>-<address>` with the
/// port's `:` as `-` and every other byte outside `[A-Za-z0-9]` as `_`
/// (`vllm-127_0_0_1-8001`); when that is longer than 64 bytes (IPv6),
/// `<pool>-<16 hex digits of a hash of the address>`.
pub fn host_name(pool: &str, address: &str) -> String {
    let port_at = address.rfind(':');
    let tail: String = address
        .char_indices()
        .map(|(i, c)| {
            if Some(i) == port_at {
                '-'
            } else if c.is_ascii_alphanumeric() {
                c
            } else {
                '_'
            }
        })
        .collect();
    if pool.len() + 1 + tail.len() <= 64 {
        format!("{pool}-{tail}")
    } else {
        format!("{pool}-{:016x}", hash_parts(0, &[address.as_bytes()]))
    }
}

/// One known host of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// `ip:port`, canonical ([`address`]).
    pub address: String,
    /// Its place in the pool's slot tables (the lowest free one when it joined).
    pub slot: u16,
    /// When it joined.
    pub joined_ms: u64,
}

/// A host that left, remembered for [`DEPARTED_QUIET_MS`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departed {
    pub address: String,
    pub at_ms: u64,
}

/// What this Envoy knows of a pool's hosts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Membership {
    /// Sorted by address.
    pub hosts: Vec<Host>,
    pub departed: Vec<Departed>,
}

/// What one piece of evidence changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Change {
    /// The slot of a host that joined (its slot tables start afresh).
    pub joined: Option<u16>,
    pub departed: bool,
}

impl Change {
    pub fn any(&self) -> bool {
        self.joined.is_some() || self.departed
    }
}

impl Membership {
    pub fn knows(&self, address: &str) -> bool {
        self.find(address).is_ok()
    }

    fn find(&self, address: &str) -> Result<usize, usize> {
        self.hosts
            .binary_search_by(|h| h.address.as_str().cmp(address))
    }

    /// An answer to a request that named `listed` first (`None`: no host named), served by
    /// `served` (`None`: unknown). See the module doc for the rules.
    pub fn observe(&mut self, listed: Option<&str>, served: Option<&str>, now_ms: u64) -> Change {
        let mut change = Change::default();
        let served = served.and_then(address);
        if let (Some(l), Some(s)) = (listed, served.as_deref()) {
            if l != s {
                change.departed = self.depart(l, now_ms);
            }
        }
        if let Some(s) = served {
            change.joined = self.join(s, now_ms);
        }
        change
    }

    fn depart(&mut self, address: &str, now_ms: u64) -> bool {
        let Ok(at) = self.find(address) else {
            return false;
        };
        self.hosts.remove(at);
        self.departed.retain(|d| d.address != address);
        if self.departed.len() >= MAX_DEPARTED {
            // The oldest departure goes.
            if let Some((i, _)) = self
                .departed
                .iter()
                .enumerate()
                .min_by_key(|(_, d)| d.at_ms)
            {
                self.departed.remove(i);
            }
        }
        self.departed.push(Departed {
            address: address.to_string(),
            at_ms: now_ms,
        });
        true
    }

    fn join(&mut self, address: String, now_ms: u64) -> Option<u16> {
        let Err(at) = self.find(&address) else {
            return None;
        };
        let quiet = self
            .departed
            .iter()
            .any(|d| d.address == address && now_ms.saturating_sub(d.at_ms) < DEPARTED_QUIET_MS);
        if quiet || self.hosts.len() >= MAX_POOL_HOSTS {
            return None;
        }
        let mut used = vec![false; MAX_POOL_HOSTS];
        for h in &self.hosts {
            if let Some(u) = used.get_mut(usize::from(h.slot)) {
                *u = true;
            }
        }
        let slot = u16::try_from(used.iter().position(|u| !u)?).ok()?;
        self.departed.retain(|d| d.address != address);
        self.hosts.insert(
            at,
            Host {
                address,
                slot,
                joined_ms: now_ms,
            },
        );
        Some(slot)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(8 + self.hosts.len() * 32);
        w.u8(VERSION);
        w.u32(self.hosts.len() as u32);
        for h in &self.hosts {
            put_str(&mut w, &h.address);
            w.u32(u32::from(h.slot));
            w.u64(h.joined_ms);
        }
        w.u32(self.departed.len() as u32);
        for d in &self.departed {
            put_str(&mut w, &d.address);
            w.u64(d.at_ms);
        }
        w.buf
    }

    /// `None` for bytes that do not decode (another version, corruption): read as empty.
    pub fn decode(bytes: &[u8]) -> Option<Membership> {
        let mut r = Reader::new(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let n = r.u32()? as usize;
        if n > MAX_POOL_HOSTS {
            return None;
        }
        let mut hosts = Vec::with_capacity(n);
        for _ in 0..n {
            let address = get_str(&mut r)?;
            let slot = u16::try_from(r.u32()?).ok()?;
            if usize::from(slot) >= MAX_POOL_HOSTS {
                return None;
            }
            hosts.push(Host {
                address,
                slot,
                joined_ms: r.u64()?,
            });
        }
        let n = r.u32()? as usize;
        if n > MAX_DEPARTED {
            return None;
        }
        let mut departed = Vec::with_capacity(n);
        for _ in 0..n {
            departed.push(Departed {
                address: get_str(&mut r)?,
                at_ms: r.u64()?,
            });
        }
        let sorted = hosts.windows(2).all(|w| match w {
            [a, b] => a.address < b.address,
            _ => true,
        });
        (r.is_empty() && sorted).then_some(Membership { hosts, departed })
    }
}

fn put_str(w: &mut Writer, s: &str) {
    let bytes = s.as_bytes();
    let n = bytes.len().min(MAX_ADDRESS_BYTES);
    w.u8(n as u8);
    w.buf.extend_from_slice(bytes.get(..n).unwrap_or_default());
}

fn get_str(r: &mut Reader<'_>) -> Option<String> {
    let n = usize::from(r.u8()?);
    if n > MAX_ADDRESS_BYTES {
        return None;
    }
    let mut bytes = Vec::with_capacity(n);
    for _ in 0..n {
        bytes.push(r.u8()?);
    }
    String::from_utf8(bytes).ok()
}

/// A pool's membership as stored (empty when absent or undecodable).
pub fn read(store: &dyn Store, pool: &str) -> Membership {
    store
        .get(&membership_key(pool))
        .0
        .and_then(|b| Membership::decode(&b))
        .unwrap_or_default()
}

/// Applies one piece of evidence to the stored membership of `pool` (bounded CAS retries;
/// written only when it changes something). `Err` when every retry lost its race.
pub fn observe(
    store: &dyn Store,
    pool: &str,
    listed: Option<&str>,
    served: Option<&str>,
    now_ms: u64,
) -> Result<Change, Change> {
    update_if(store, &membership_key(pool), |bytes| {
        let mut m = bytes.and_then(Membership::decode).unwrap_or_default();
        let change = m.observe(listed, served, now_ms);
        (change.any().then(|| m.encode()), change)
    })
}

/// The configuration in effect: `base` with each pool entry replaced by one endpoint per host
/// of `memberships[pool name]` (the entry itself while none is known). Hosts are laid out in
/// address order; past `MAX_ENDPOINTS` endpoints in all, or on a name taken by another
/// endpoint, a host is left out.
pub fn expand(base: &Config, memberships: &[(String, Membership)]) -> Config {
    let mut endpoints: Vec<EndpointConfig> = Vec::with_capacity(base.endpoints.len());
    let statics = base.endpoints.iter().filter(|e| e.pool.is_none()).count();
    let mut room = MAX_ENDPOINTS.saturating_sub(statics);
    // Every configured name is taken (a pool entry's too, whether it is replaced or not).
    let mut ids: BTreeSet<u32> = base.endpoints.iter().map(|e| e.id).collect();
    for e in &base.endpoints {
        let Some(p) = &e.pool else {
            endpoints.push(e.clone());
            continue;
        };
        let hosts = memberships
            .iter()
            .find(|(name, _)| *name == p.pool)
            .map(|(_, m)| m.hosts.as_slice())
            .unwrap_or_default();
        if hosts.is_empty() || room == 0 {
            endpoints.push(e.clone());
            room = room.saturating_sub(1);
            continue;
        }
        for h in hosts.iter().take(room) {
            let name = host_name(&p.pool, &h.address);
            let id = endpoint_id(&name);
            // Equal names have equal ids: one look-up per host (a pool of 1 000 hosts is laid
            // out in a million comparisons otherwise).
            if !ids.insert(id) {
                continue;
            }
            let mut host = e.clone();
            host.name = name;
            host.id = id;
            host.pool = Some(PoolMember {
                pool: p.pool.clone(),
                address: Some(h.address.clone()),
                slot: h.slot,
            });
            endpoints.push(host);
            room = room.saturating_sub(1);
        }
    }
    Config {
        endpoints,
        ..base.clone()
    }
}

/// The pool entries of a configuration (their names).
pub fn pool_names(cfg: &Config) -> Vec<String> {
    cfg.endpoints
        .iter()
        .filter_map(|e| e.pool.as_ref())
        .filter(|p| p.address.is_none())
        .map(|p| p.pool.clone())
        .collect()
}

/// The `destination_header` value for endpoint `i`: its address, then up to `max - 1` other
/// enabled hosts of its pool that `skip` keeps, in rendezvous order for `key` (where every
/// replica would place the session next). `None` when `i` is not a host of a pool.
pub fn destination(
    cfg: &Config,
    i: usize,
    key: u64,
    max: usize,
    skip: impl Fn(usize) -> bool,
) -> Option<String> {
    let ep = cfg.endpoints.get(i)?;
    let first = ep.address()?;
    let pool = ep.pool.as_ref().map(|p| p.pool.as_str());
    let mut out = first.to_string();
    if max <= 1 {
        return Some(out);
    }
    let others: Vec<(usize, u32, f64)> = cfg
        .endpoints
        .iter()
        .enumerate()
        .filter(|(j, e)| {
            *j != i
                && !e.disabled
                && e.address().is_some()
                && e.pool.as_ref().map(|p| p.pool.as_str()) == pool
                && !skip(*j)
        })
        .map(|(j, e)| (j, e.id, e.weight))
        .collect();
    for j in placement::order(key, &others).into_iter().take(max - 1) {
        if let Some(a) = cfg.endpoints.get(j).and_then(EndpointConfig::address) {
            out.push(',');
            out.push_str(a);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::state::store::MemStore;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg() -> Config {
        Config::from_json(
            br#"{"endpoints":[
                {"name":"api","cluster":"api"},
                {"name":"vllm","cluster":"vllm_pool","pool":true,"models":["m"],"weight":2}
            ]}"#,
        )
        .unwrap()
    }

    fn members(addrs: &[&str]) -> Membership {
        let mut m = Membership::default();
        for a in addrs {
            m.observe(None, Some(a), 0);
        }
        m
    }

    #[test]
    fn discovery_asks_more_while_a_pool_settles_and_stays_bounded() {
        assert_eq!(discovery_calls(0, false), 2);
        assert_eq!(discovery_calls(4, false), 6);
        assert_eq!(discovery_calls(1000, false), MAX_STEADY_CALLS);
        assert_eq!(discovery_calls(0, true), 8);
        assert_eq!(discovery_calls(8, true), 20);
        assert_eq!(discovery_calls(1000, true), MAX_SETTLING_CALLS);
        for known in 0..100 {
            assert!(discovery_calls(known, true) >= discovery_calls(known, false));
        }
    }

    #[test]
    fn names_are_derived_from_pool_and_address() {
        assert_eq!(host_name("vllm", "127.0.0.1:8001"), "vllm-127_0_0_1-8001");
        assert_eq!(host_name("v", "[::1]:8000"), "v-___1_-8000");
        let long = host_name(&"p".repeat(40), "[2001:db8::1234:5678:9abc:def0]:65535");
        assert!(
            long.len() <= 64 && long.starts_with(&"p".repeat(40)),
            "{long}"
        );
        assert_eq!(address(" 10.0.0.1:80 "), Some("10.0.0.1:80".into()));
        assert_eq!(address("[::1]:80"), Some("[::1]:80".into()));
        assert_eq!(address("10.0.0.1"), None);
        assert_eq!(address("10.0.0.1:0"), None);
        assert_eq!(address("pod:80"), None);
    }

    #[test]
    fn a_served_host_joins_and_a_passed_over_host_departs() {
        let mut m = Membership::default();
        let c = m.observe(None, Some("10.0.0.2:80"), 10);
        assert_eq!(c.joined, Some(0));
        assert_eq!(m.observe(None, Some("10.0.0.1:80"), 11).joined, Some(1));
        // Confirmations change nothing.
        assert!(!m
            .observe(Some("10.0.0.1:80"), Some("10.0.0.1:80"), 12)
            .any());
        assert_eq!(
            m.hosts
                .iter()
                .map(|h| h.address.as_str())
                .collect::<Vec<_>>(),
            ["10.0.0.1:80", "10.0.0.2:80"]
        );
        // Named first, served by another: it left.
        let c = m.observe(Some("10.0.0.2:80"), Some("10.0.0.1:80"), 20);
        assert!(c.departed && c.joined.is_none());
        assert!(!m.knows("10.0.0.2:80"));
        // An answer in flight when it left does not bring it back...
        assert!(!m
            .observe(None, Some("10.0.0.2:80"), 20 + DEPARTED_QUIET_MS - 1)
            .any());
        // ...a later one does, in the lowest free slot.
        let c = m.observe(None, Some("10.0.0.2:80"), 20 + DEPARTED_QUIET_MS);
        assert_eq!(c.joined, Some(0));
        assert!(m.departed.is_empty());
        // Garbage from the wire is no host.
        assert!(!m.observe(None, Some("not an address"), 99).any());
    }

    #[test]
    fn membership_is_bounded_and_round_trips() {
        let mut m = Membership::default();
        for i in 0..(MAX_POOL_HOSTS + 10) {
            m.observe(None, Some(&format!("10.{}.{}.1:80", i / 256, i % 256)), 1);
        }
        assert_eq!(m.hosts.len(), MAX_POOL_HOSTS);
        for i in 0..(MAX_DEPARTED + 5) {
            let a = m.hosts[0].address.clone();
            m.observe(Some(&a), Some("10.200.0.1:80"), i as u64);
        }
        assert_eq!(m.departed.len(), MAX_DEPARTED);
        let bytes = m.encode();
        assert_eq!(Membership::decode(&bytes), Some(m));
        assert_eq!(Membership::decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(Membership::decode(b"\x09"), None);
    }

    #[test]
    fn stored_evidence_is_written_only_when_it_changes_something() {
        let store = MemStore::default();
        assert_eq!(
            observe(&store, "vllm", None, Some("10.0.0.1:80"), 1),
            Ok(Change {
                joined: Some(0),
                departed: false
            })
        );
        let (_, cas) = store.get(&membership_key("vllm"));
        assert!(
            !observe(&store, "vllm", Some("10.0.0.1:80"), Some("10.0.0.1:80"), 2)
                .unwrap()
                .any()
        );
        assert_eq!(store.get(&membership_key("vllm")).1, cas);
        assert!(read(&store, "vllm").knows("10.0.0.1:80"));
    }

    #[test]
    fn expansion_replaces_a_pool_by_its_hosts_in_address_order() {
        let base = cfg();
        // No host known: the pool entry stands for its cluster.
        assert_eq!(expand(&base, &[]), base);
        let m = members(&["10.0.0.9:80", "10.0.0.1:80"]);
        let eff = expand(&base, &[("vllm".into(), m.clone())]);
        let names: Vec<&str> = eff.endpoints.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["api", "vllm-10_0_0_1-80", "vllm-10_0_0_9-80"]);
        let h = &eff.endpoints[1];
        assert_eq!(h.cluster, "vllm_pool");
        assert_eq!(h.weight, 2.0);
        assert_eq!(h.models.as_deref(), Some(&["m".to_string()][..]));
        assert_eq!(h.id, endpoint_id("vllm-10_0_0_1-80"));
        assert_eq!(h.address(), Some("10.0.0.1:80"));
        assert_eq!(h.metrics_label(), "vllm");
        assert_eq!(pool_names(&base), ["vllm"]);
        // Another replica, the same membership learned in another order: the same endpoints.
        let other = members(&["10.0.0.1:80", "10.0.0.9:80"]);
        let eff2 = expand(&base, &[("vllm".into(), other)]);
        let ids = |c: &Config| c.endpoints.iter().map(|e| e.id).collect::<Vec<_>>();
        assert_eq!(ids(&eff), ids(&eff2));
    }

    #[test]
    fn expansion_stays_within_the_endpoint_bound() {
        let base = cfg();
        let mut m = Membership::default();
        for i in 0..MAX_POOL_HOSTS {
            m.observe(None, Some(&format!("10.{}.{}.1:80", i / 256, i % 256)), 1);
        }
        let eff = expand(&base, &[("vllm".into(), m)]);
        assert_eq!(eff.endpoints.len(), MAX_ENDPOINTS);
        assert_eq!(eff.endpoints[0].name, "api");
    }

    #[test]
    fn the_destination_lists_the_pick_then_the_pool_in_rendezvous_order() {
        let base = cfg();
        let m = members(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"]);
        let eff = expand(&base, &[("vllm".into(), m)]);
        assert_eq!(destination(&eff, 0, 7, 3, |_| false), None);
        let d = destination(&eff, 2, 7, 3, |_| false).unwrap();
        let parts: Vec<&str> = d.split(',').collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0], "10.0.0.2:80");
        let cands: Vec<(usize, u32, f64)> = [1, 3, 4]
            .iter()
            .map(|&j| (j, eff.endpoints[j].id, eff.endpoints[j].weight))
            .collect();
        let order = placement::order(7, &cands);
        assert_eq!(parts[1], eff.endpoints[order[0]].address().unwrap());
        assert_eq!(parts[2], eff.endpoints[order[1]].address().unwrap());
        // Skipped endpoints (already tried) are not listed; one host alone is the whole list.
        let d = destination(&eff, 2, 7, 16, |j| j != 4).unwrap();
        assert_eq!(d, "10.0.0.2:80,10.0.0.4:80");
        assert_eq!(
            destination(&eff, 2, 7, 1, |_| false).unwrap(),
            "10.0.0.2:80"
        );
    }
}
