//! Pools in the real module under the fake host (`computeflux_cost::fleet`): a departed host
//! leaves nothing behind in shared data. The figures themselves are printed by
//! `cargo run -p computeflux-cost -- --fleet`.

use computeflux_cost::fleet::{departures, host_address, Shared};
use computeflux_cost::Modules;

/// 1 000 hosts known and used, then 999 leave: after the reload and more traffic, shared data
/// holds what a pool that only ever had the one host holds, but for the endpoint table's group
/// keys (Envoy never frees a key: they stay, emptied) and the membership's bounded memory of
/// the newest 64 departures. Affinity buckets are left out of the comparison: their keys and
/// bytes follow the sessions (hashed buckets within `affinity_max_sessions`), whatever the
/// hosts; a pin to a departed host is replaced at the session's next request or expires. Before
/// the table emptied the groups a smaller layout no longer uses, 62 groups kept the departed
/// hosts' entries (332 KB).
#[test]
fn departed_hosts_leave_nothing_behind_in_shared_data() {
    let modules = Modules::locate_and_compile().expect("wasm modules");
    let d = departures(modules.filter(), 1_000, 1).expect("departures");
    println!("{d:#?}");
    assert_eq!(d.named_after, vec![host_address(0)], "the host that stayed");
    const TABLE_GROUPS: &str = "computeflux/endpoints/17/*";
    const AFFINITY: &str = "computeflux/affinity/*";
    let family = |s: &Shared, f: &str| s.by_family.get(f).copied().unwrap_or((0, 0));
    // Group keys of the table at 1 000 endpoints (16 each).
    let groups = 1_000usize.div_ceil(16);
    for (f, &(keys, _)) in &d.after.by_family {
        let bound = match f.as_str() {
            TABLE_GROUPS => groups,
            AFFINITY => continue,
            _ => family(&d.small, f).0,
        };
        assert!(
            keys <= bound,
            "{f}: {keys} keys after the departures, at most {bound} expected"
        );
    }
    let without_affinity = |s: &Shared| s.value_bytes - family(s, AFFINITY).1;
    let empty_group_bytes = 1 + 8 + 4;
    let departed_bytes: usize = (1..1_000)
        .rev()
        .take(64)
        .map(|i| 1 + host_address(i).len() + 8)
        .sum();
    let slack = ((groups - 1) * empty_group_bytes + departed_bytes) as u64;
    assert!(
        without_affinity(&d.after) <= without_affinity(&d.small) + slack,
        "value bytes (affinity buckets aside): {} after the departures, {} for a pool of one \
         (+{slack} allowed): {:#?}",
        without_affinity(&d.after),
        without_affinity(&d.small),
        d.after.by_family
    );
    assert!(
        without_affinity(&d.before) > 10 * without_affinity(&d.small),
        "the fleet was not used"
    );
}
