//! Shared-data keys stay bounded under endpoint churn (configuration reloads) and session floods.
//!
//! Envoy never deletes a shared-data key, so what matters is the set of keys ever written: the
//! endpoint table (one key, one value holding every configured endpoint keyed by endpoint id),
//! the "configuration logged" digest (one key, written by the filter glue, not modelled here),
//! and the affinity buckets (`computeflux/affinity/0..buckets`, at most 4096). A reload that adds
//! or removes endpoints rewrites the one table value; it adds no key. These tests drive the
//! scheduler over one in-memory store through many reloads and count keys and bytes.
//! (The session-flood RSS measurement through Envoy is `scripts/memory`.)

// Test code: a failed unwrap is a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use computeflux::scheduler::routing::placement::sessions::SESSIONS_KEY;
use computeflux::scheduler::routing::select::TABLE_KEY;
use computeflux::scheduler::routing::table::groups::{self, group_key};
use computeflux::scheduler::state::hash::session_key;
use computeflux::scheduler::{
    Config, Exclusions, MemStore, Outcome, Pick, Prefix, Scheduler, Store,
};
use serde_json::json;

fn config(names: &[String], max_sessions: u64) -> Config {
    let endpoints: Vec<_> = names
        .iter()
        .map(|n| json!({"name": n, "cluster": n}))
        .collect();
    Config::from_value(&json!({"endpoints": endpoints, "affinity_max_sessions": max_sessions}))
        .unwrap()
}

/// One request: pick, then finish as a success (which pins the session).
fn request(cfg: &Config, store: &MemStore, session: u64, now_ms: u64) {
    let s = Scheduler::new(cfg, store);
    let ex = Exclusions::default();
    let pick = Pick {
        model: Some("m"),
        session: Some(session),
        attempt: 1,
        exclusions: &ex,
        nonce: 0,
        body_bytes: 0,
        pin_hint: None,
        holder: None,
        prefix: Prefix::NONE,
        follow_up: false,
        max_output_tokens: 0,
    };
    let d = s.pick(&pick, now_ms).unwrap();
    s.finish(d.ticket, &Outcome::Success, 10, Some(session), now_ms + 10);
}

#[test]
fn endpoint_churn_through_reloads_adds_no_keys() {
    let store = MemStore::new();
    let max_sessions = 1_000;
    let mut now = 1_000_000;
    let mut keys_after_first = 0;
    // 2 000 reloads, each replacing one of 4 endpoints by a never-seen name.
    let mut names: Vec<String> = (0..4).map(|i| format!("ep-{i}")).collect();
    for reload in 0..2_000u64 {
        names[(reload % 4) as usize] = format!("ep-{}", reload + 4);
        let cfg = config(&names, max_sessions);
        for r in 0..5u64 {
            request(
                &cfg,
                &store,
                session_key(b"t", &(reload * 5 + r).to_le_bytes()),
                now,
            );
            now += 20;
        }
        let buckets = Scheduler::new(&cfg, &store).affinity().buckets() as usize;
        // The table (its header and one group: 4 endpoints), the count of sessions placed (one
        // key) and at most every affinity bucket: nothing per endpoint.
        assert!(
            store.keys() <= 3 + buckets,
            "reload {reload}: {} keys",
            store.keys()
        );
        // The table value holds exactly the configured endpoints.
        let table = Scheduler::new(&cfg, &store).table();
        assert_eq!(table.entries.len(), 4);
        let (stored, complete) = groups::read_stored(&store).unwrap();
        assert!(complete);
        assert_eq!(stored.entries.len(), 4);
        if reload == 0 {
            keys_after_first = store.keys();
        }
    }
    let buckets = 1_000u64.div_ceil(64) as usize;
    // The table (header and one group), the count of sessions placed, the affinity buckets.
    assert_eq!(
        store.keys(),
        3 + buckets,
        "first reload had {keys_after_first}"
    );
    // Affinity entries pointing at removed endpoints are bounded by the affinity bound too.
    let cfg = config(&names, max_sessions);
    assert!(Scheduler::new(&cfg, &store).affinity().stored_entries() <= 1_000);
}

#[test]
fn session_flood_keeps_keys_and_bytes_at_the_bound() {
    let store = MemStore::new();
    let bound = 2_000u64;
    let cfg = config(&["a".to_string(), "b".to_string()], bound);
    let sched = Scheduler::new(&cfg, &store);
    let aff = sched.affinity();
    let buckets = aff.buckets() as usize;
    let mut peak_bytes = 0;
    for i in 0..50_000u64 {
        request(
            &cfg,
            &store,
            session_key(b"flood", &i.to_le_bytes()),
            1_000_000 + i,
        );
        if i % 1_000 == 999 {
            assert!(store.keys() <= 3 + buckets);
            assert!(aff.stored_entries() as u64 <= bound);
            peak_bytes = peak_bytes.max(store.bytes());
        }
    }
    assert_eq!(aff.stored_entries() as u64, bound, "full at the end");
    // Keys + values: 32 bytes per entry, a version byte and a key per bucket, the table, and
    // the count of sessions placed (a few bytes per endpoint).
    let table = store.get(TABLE_KEY).0.unwrap().len() + store.get(&group_key(0)).0.unwrap().len();
    let sessions = store.get(SESSIONS_KEY).0.unwrap().len();
    let key_bytes: usize = (0..buckets)
        .map(|b| format!("computeflux/affinity/{b}").len())
        .sum::<usize>()
        + TABLE_KEY.len()
        + group_key(0).len()
        + SESSIONS_KEY.len();
    let expected = bound as usize * computeflux::scheduler::routing::pins::affinity::ENTRY_BYTES
        + buckets
        + key_bytes
        + table
        + sessions;
    assert_eq!(store.bytes(), expected);
    assert_eq!(peak_bytes, expected, "never above the full table");
}

#[test]
fn changing_the_bound_reuses_bucket_keys_up_to_the_largest_count() {
    // Bucket keys are `computeflux/affinity/<n>` for n < buckets: a reload to another bound
    // reuses the low keys; keys beyond a smaller new count keep their last value (never read
    // again) until Envoy restarts. Total keys stay ≤ 1 + the largest bucket count configured.
    let store = MemStore::new();
    let mut now = 1_000_000;
    let mut largest = 0usize;
    for bound in [5_000u64, 100, 20_000, 1_000, 5_000] {
        let cfg = config(&["a".to_string()], bound);
        let buckets = Scheduler::new(&cfg, &store).affinity().buckets() as usize;
        largest = largest.max(buckets);
        for i in 0..(bound * 2) {
            request(
                &cfg,
                &store,
                session_key(b"b", &(now + i).to_le_bytes()),
                now,
            );
        }
        now += bound * 2;
        assert!(store.keys() <= 3 + largest, "{} keys", store.keys());
    }
    assert_eq!(largest, 20_000usize.div_ceil(64));
}

/// Issue 41, item 5: reload churn with `metrics` configured. Each of 2 000 reloads replaces one
/// of 4 scraped engines by a never-seen name, and every scraped endpoint's scrape result is
/// stored as the scraper stores it (`scrape::fold`, the filter's only write of a result): the
/// keys of scraping stay the lease, the holder counter and one slot per scraped endpoint of
/// the configuration, plus the table and the pins, and the slots hold the configured engines
/// only. Before, each name ever scraped left
/// a record key (`computeflux/scrape/endpoint/<name>`): 2 004 keys here.
#[test]
fn endpoint_churn_with_metrics_through_reloads_adds_no_keys() {
    use computeflux::scheduler::routing::scrape::plan::{holder_id, scraped_ids};
    use computeflux::scheduler::routing::scrape::{self, LEASE_KEY};
    use computeflux::scheduler::wire::engine_load::{Engine, EngineLoad};
    let store = MemStore::new();
    let mut now = 1_000_000;
    let mut names: Vec<String> = (0..4).map(|i| format!("gpu-{i}")).collect();
    let me = holder_id(&store, 1);
    let mut first = 0;
    for reload in 0..2_000u64 {
        names[(reload % 4) as usize] = format!("gpu-{}", reload + 4);
        let endpoints: Vec<_> = names
            .iter()
            .map(|n| json!({"name": n, "cluster": n, "metrics": {"interval_ms": 1000}}))
            .collect();
        let cfg = Config::from_value(&json!({"endpoints": endpoints, "affinity_max_sessions": 64}))
            .unwrap();
        assert!(scrape::try_take(&store, LEASE_KEY, me, 1, now, 3_000));
        let keep = scraped_ids(&cfg);
        for e in &cfg.endpoints {
            let load = EngineLoad {
                engine: Engine::Vllm,
                waiting: Some(1),
                running: Some(2),
                kv_usage_permille: Some(300),
                prompt_tokens_total: None,
                prompt_tokens_cached_total: None,
                decode: None,
            };
            let _ = scrape::fold(&store, e.id, now, Ok(load), &keep);
        }
        request(&cfg, &store, session_key(b"m", &reload.to_le_bytes()), now);
        now += 50;
        // Scraping: lease, holders, four slots, the change ring; the table (header and one group), the sessions
        // placed, one affinity bucket, the request path's own (fleet-wide) keys: the same set
        // at every reload.
        if reload == 0 {
            first = store.keys();
            assert!(first <= 14, "{first} keys");
        }
        assert_eq!(store.keys(), first, "reload {reload}");
        let loads = scrape::read_loads(&store, &keep);
        assert_eq!(loads.entries.len(), 4, "reload {reload}");
    }
}
