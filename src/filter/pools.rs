//! Pools in Envoy: the evidence of answers written to the shared membership, the membership
//! followed by every VM, and the discovery calls (see `scheduler::routing::pools`).
//!
//! - [`learn`]: an answer named the host that served it (a client answer's `upstream.address`,
//!   a call's [`STAMP_HEADER`]); written to the pool's membership only when it joins or shows
//!   a departure (a confirmation costs no shared-data write).
//! - [`Pools::changed`]: each tick every VM reads its pools' memberships (one key per pool) and,
//!   when one changed, the root context installs the expanded configuration as a reload.
//! - [`Pools::on_tick`]: one VM per Envoy (a lease, as the scraper's) sends a few
//!   discovery calls per pool and second with no host named: the cluster's fallback policy
//!   serves them, and the stamp of each answer names a host, new ones included. While a
//!   pool's membership is settling (this Envoy just started, or a host joined or left within
//!   [`pools::SETTLE_MS`]) a round comes every tick with more calls
//!   ([`pools::discovery_calls`]): replicas learn a change at different moments, and each
//!   moment of disagreement is a session placed differently by two of them. Without the
//!   stamp (no upstream `header_mutation` on the cluster) answers name nothing: discovery then
//!   backs off to one call per [`UNSTAMPED_RECHECK_MS`] and hosts are learned from client
//!   answers alone (those sent to the cluster with no host known, or failed over).

use super::host;
use super::shared::SharedData;
use crate::scheduler::config::Config;
use crate::scheduler::routing::pools::{self, Membership, STAMP_HEADER};
use crate::scheduler::routing::scrape;
use crate::scheduler::state::store::Store;
use crate::scheduler::wire::headers::HeaderSource;
use proxy_wasm::types::MapType;

/// Shared-data key of the discovery lease.
const LEASE_KEY: &str = "computeflux/pools/lease";
/// Discovery rounds are this far apart (every tick while a pool settles).
pub const ROUND_MS: u64 = 1_000;
/// A pool whose answers carry no stamp is asked once this often.
pub const UNSTAMPED_RECHECK_MS: u64 = 30_000;
const CALL_TIMEOUT_MS: u64 = 2_000;

/// Writes one piece of evidence about `pool` (see `pools::observe`). A joining host needs no
/// clearing: scraped loads live in the one loads value, by endpoint id.
pub fn learn(pool: &str, listed: Option<&str>, served: Option<&str>, now_ms: u64) {
    let store = SharedData;
    let change = match pools::observe(&store, pool, listed, served, now_ms) {
        Ok(c) => c,
        Err(c) => {
            log::warn!(
                "computeflux: membership of pool {pool} not written (CAS retries exhausted)"
            );
            c
        }
    };
    if change.joined.is_some() {
        log::info!(
            "computeflux: pool {pool}: host {} joined",
            served.unwrap_or_default()
        );
    }
    if change.departed {
        log::info!(
            "computeflux: pool {pool}: host {} left (served by {})",
            listed.unwrap_or_default(),
            served.unwrap_or_default()
        );
    }
}

/// The host named by an answer's stamp, if any.
pub fn stamp<H: HeaderSource + ?Sized>(headers: &H) -> Option<String> {
    headers.header_str(STAMP_HEADER)
}

/// Learns from a routed client answer of endpoint `i`: the host that served it, as Envoy says
/// (`upstream.address`). Costs a property read; a shared-data write only for news.
pub fn learn_from_answer(cfg: &Config, i: usize, now_ms: u64) {
    let Some(ep) = cfg.endpoints.get(i) else {
        return;
    };
    let Some(p) = &ep.pool else { return };
    let Some(served) = host::property_text(&["upstream", "address"]) else {
        return;
    };
    news(cfg, &p.pool, p.address.as_deref(), &served, now_ms);
}

/// Writes the evidence if it is news: a host served that was not the one listed first, or
/// one this configuration does not know.
pub fn news(cfg: &Config, pool: &str, listed: Option<&str>, served: &str, now_ms: u64) {
    let Some(served) = pools::address(served) else {
        return;
    };
    let confirmed = listed == Some(served.as_str());
    let known = cfg.endpoints.iter().any(|e| e.address() == Some(&served));
    if !confirmed || !known {
        learn(pool, listed, Some(&served), now_ms);
    }
}

struct PoolCalls {
    name: String,
    cluster: String,
    path: String,
    authority: String,
    /// The membership bytes last installed.
    seen: Option<Vec<u8>>,
    /// Answers without a stamp were seen: ask once per [`UNSTAMPED_RECHECK_MS`] only.
    unstamped_until_ms: u64,
    /// Settling until then (`None`: from this Envoy's first round on).
    settle_until_ms: Option<u64>,
    warned: bool,
}

/// One VM's view of its pools.
pub struct Pools {
    me: u64,
    pools: Vec<PoolCalls>,
    next_round_ms: u64,
    holding: bool,
    /// Discovery calls in flight: token, pool index, when sent.
    calls: Vec<(u32, usize, u64)>,
}

impl Pools {
    /// `None` when the configuration has no pool.
    pub fn new(base: &Config, me: u64) -> Option<Pools> {
        let pools: Vec<PoolCalls> = base
            .endpoints
            .iter()
            .filter(|e| e.pool.as_ref().is_some_and(|p| p.address.is_none()))
            .map(|e| {
                let (path, authority) = e.metrics.as_ref().map_or_else(
                    || ("/health".to_string(), e.cluster.clone()),
                    |m| (m.path.clone(), m.authority.clone()),
                );
                PoolCalls {
                    name: e.name.clone(),
                    cluster: e.cluster.clone(),
                    path,
                    authority,
                    seen: None,
                    unstamped_until_ms: 0,
                    settle_until_ms: None,
                    warned: false,
                }
            })
            .collect();
        (!pools.is_empty()).then_some(Pools {
            me,
            pools,
            next_round_ms: 0,
            holding: false,
            calls: Vec::new(),
        })
    }

    /// Every pool's membership when one changed since the last call (the first call always
    /// reports), else `None`. A pool whose membership changed settles from `now_ms` on.
    pub fn changed(&mut self, now_ms: u64) -> Option<Vec<(String, Membership)>> {
        let store = SharedData;
        let mut any = false;
        let mut out = Vec::with_capacity(self.pools.len());
        for p in &mut self.pools {
            let bytes = store.get(&pools::membership_key(&p.name)).0;
            if p.seen.is_none() || bytes != p.seen {
                any = true;
            }
            if p.seen.is_some() && bytes != p.seen {
                p.settle_until_ms = Some(now_ms.saturating_add(pools::SETTLE_MS));
            }
            let m = bytes
                .as_deref()
                .and_then(Membership::decode)
                .unwrap_or_default();
            p.seen = Some(bytes.unwrap_or_default());
            out.push((p.name.clone(), m));
        }
        any.then_some(out)
    }

    /// Gives the discovery lease up if this VM holds it.
    pub fn release(&mut self) {
        if self.holding {
            scrape::release(&SharedData, LEASE_KEY, self.me);
        }
        self.holding = false;
    }

    /// A discovery round, when due and this VM holds the lease: every tick while a pool
    /// settles, else once per [`ROUND_MS`].
    pub fn on_tick(&mut self, cfg: &Config, now_ms: u64) {
        for p in &mut self.pools {
            p.settle_until_ms
                .get_or_insert(now_ms.saturating_add(pools::SETTLE_MS));
        }
        let is_settling = |p: &PoolCalls| p.settle_until_ms.is_some_and(|t| now_ms < t);
        if now_ms < self.next_round_ms && !self.pools.iter().any(is_settling) {
            return;
        }
        self.next_round_ms = now_ms.saturating_add(ROUND_MS);
        let store = SharedData;
        self.holding = scrape::try_take(
            &store,
            LEASE_KEY,
            self.me,
            cfg.layout_generation,
            now_ms,
            3 * ROUND_MS,
        );
        if !self.holding {
            return;
        }
        // Calls lost (their answer never came) are forgotten after their timeout.
        self.calls
            .retain(|c| now_ms < c.2.saturating_add(CALL_TIMEOUT_MS));
        for (k, p) in self.pools.iter_mut().enumerate() {
            if now_ms < p.unstamped_until_ms {
                continue;
            }
            let settling = is_settling(p);
            let known = cfg
                .endpoints
                .iter()
                .filter(|e| {
                    e.address().is_some() && e.pool.as_ref().is_some_and(|m| m.pool == p.name)
                })
                .count();
            let n = pools::discovery_calls(known, settling);
            let headers = vec![
                (":method".to_string(), b"GET".to_vec()),
                (":path".to_string(), p.path.as_bytes().to_vec()),
                (":authority".to_string(), p.authority.as_bytes().to_vec()),
                ("user-agent".to_string(), b"computeflux-discovery".to_vec()),
            ];
            for _ in 0..n {
                match host::dispatch_call(&p.cluster, &headers, CALL_TIMEOUT_MS) {
                    Some(token) => self.calls.push((token, k, now_ms)),
                    None => {
                        log::warn!(
                            "computeflux: discovery call to pool {} refused; is cluster {:?} defined in Envoy?",
                            p.name, p.cluster
                        );
                        break;
                    }
                }
            }
        }
    }

    /// A discovery call's answer. False when `token` is not one of this VM's discovery calls.
    pub fn on_response(&mut self, token: u32, num_headers: usize, now_ms: u64) -> bool {
        let Some(at) = self.calls.iter().position(|(t, _, _)| *t == token) else {
            return false;
        };
        let (_, k, _) = self.calls.swap_remove(at);
        let Some(p) = self.pools.get_mut(k) else {
            return true;
        };
        if num_headers == 0 {
            return true;
        }
        let headers = host::header_pairs(MapType::HttpCallResponseHeaders);
        match stamp(&headers) {
            Some(served) => {
                p.unstamped_until_ms = 0;
                learn(&p.name, None, Some(&served), now_ms);
            }
            None => {
                p.unstamped_until_ms = now_ms.saturating_add(UNSTAMPED_RECHECK_MS);
                if !p.warned {
                    p.warned = true;
                    log::warn!(
                        "computeflux: pool {}: answers of cluster {:?} carry no {STAMP_HEADER} header; hosts are learned from client answers only (see docs/configuration.md#pools)",
                        p.name, p.cluster
                    );
                }
            }
        }
        true
    }
}
