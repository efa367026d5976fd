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

/// Keys that were tried and dropped (`prefix_index`, `prefix_index_entries`, `prefix_home`;
/// see docs/adr/0006-learned-prefix-index-dropped.md) are unknown keys like any
/// other: a configuration that still sets one is refused, naming it, rather than run without
/// the behaviour it asked for.
#[test]
fn dropped_prefix_keys_are_refused_by_name() {
    let errs = errors(json!({
        "endpoints": [{"name": "a", "cluster": "ca"}],
        "prefix_index": true, "prefix_index_entries": 4096, "prefix_home": "head"
    }));
    for key in ["prefix_index", "prefix_index_entries", "prefix_home"] {
        assert!(
            errs.iter()
                .any(|e| e.starts_with(&format!("{key} is not a known key (known: endpoints,"))),
            "{key}: {errs:?}"
        );
    }
    assert_eq!(errs.len(), 3, "{errs:?}");
    // The default they left behind: placement by the whole instructions segment's key.
    let c = Config::from_value(&json!({"endpoints": [{"name": "a", "cluster": "ca"}]})).unwrap();
    assert!(c.prefix_placement);
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

/// Every declared key reads its own documented default back unchanged: a declaration whose
/// spec does not fit its field type (which would silently ignore the key) fails here.
#[test]
fn every_key_reads_its_documented_default() {
    let mut obj = serde_json::Map::new();
    obj.insert("endpoints".into(), json!([{"name": "a", "cluster": "ca"}]));
    let value = |k: &KeyDoc| match k.kind.as_str() {
        "integer" => json!(k.default.parse::<u64>().unwrap()),
        "number" => json!(k.default.parse::<f64>().unwrap()),
        "boolean" => json!(k.default.parse::<bool>().unwrap()),
        _ => json!(k.default),
    };
    // `pin_cookie_secret`'s default is its absence (a key derived from the configuration), as
    // is `fairness_header`'s (the caller's credential) and `tenants`' (none).
    for k in top_level_keys()
        .into_iter()
        .skip(1)
        .filter(|k| !["pin_cookie_secret", "tuning", "fairness_header", "tenants"].contains(&k.key))
    {
        obj.insert(k.key.to_string(), value(&k));
    }
    let tuning: serde_json::Map<String, Value> = tuning_keys()
        .iter()
        .map(|k| (k.key.to_string(), value(k)))
        .collect();
    obj.insert("tuning".into(), Value::Object(tuning));
    let read = Config::from_value(&Value::Object(obj)).unwrap();
    let expected = Config {
        endpoints: read.endpoints.clone(),
        pin_cookie_secret: read.pin_cookie_secret.clone(),
        ..Config::default()
    };
    assert_eq!(read, expected);
    assert!(!read.pin_cookie_secret.configured());
    // And each one is actually read: a value off its default changes the configuration.
    let c = Config::from_value(&json!({
        "endpoints": [{"name": "a", "cluster": "ca"}],
        "list_models": "upstream_merged", "half_open_probes": 7,
        "tuning": {"bounded_load_epsilon": 0.5, "pin_break_ratio": 4.0}
    }))
    .unwrap();
    assert_eq!(c.list_models, ListModels::UpstreamMerged);
    assert_eq!((c.half_open_probes, c.bounded_load_epsilon), (7, 0.5));
    assert_eq!(c.pin_break_ratio, 4.0);
    assert!(errors(json!({"endpoints": [{"name": "a", "cluster": "ca"}],
            "list_models": "remote"}))
    .contains(&"list_models must be one of local, upstream_merged, got \"remote\"".to_string()));
    assert_eq!(
        errors(json!({"endpoints": [{"name": "a", "cluster": "ca"}],
            "tuning": {"pin_break_ratio": 1.5}})),
        vec!["tuning.pin_break_ratio must be above the degraded exit ratio (1.5), got 1.5"]
    );
}

/// The `tuning` object: its keys are read from it, its errors name `tuning.<key>`, an unknown
/// key in it is refused, and it must be an object.
#[test]
fn tuning_keys_are_read_from_the_tuning_object() {
    let eps = json!([{"name": "a", "cluster": "ca"}]);
    let c = Config::from_value(&json!({"endpoints": eps,
        "tuning": {"quota_reserve_percent": 50, "in_flight_max_age_ms": 900_000}}))
    .unwrap();
    assert_eq!(
        (c.quota_reserve_percent, c.in_flight_max_age_ms),
        (50, 900_000)
    );
    assert!(c.summary().contains("tuning.quota_reserve_percent=50"));
    assert_eq!(
        errors(json!({"endpoints": eps, "tuning": {"quota_reserve_percent": 101}})),
        vec!["tuning.quota_reserve_percent must be in 0..=100, got 101"]
    );
    let unknown = errors(json!({"endpoints": eps, "tuning": {"ewma_alpha": 0.5}}));
    assert_eq!(unknown.len(), 1, "{unknown:?}");
    assert!(
        unknown[0]
            .starts_with("tuning.ewma_alpha is not a known key (known: retry_budget_min_retries,"),
        "{unknown:?}"
    );
    assert_eq!(
        errors(json!({"endpoints": eps, "tuning": [1]})),
        vec!["tuning must be an object, got an array"]
    );
}

/// A key that was removed is refused with an error naming it and what replaced it, not as an
/// unknown key; a key moved into `tuning` names its new place. Every other key is still read.
#[test]
fn a_removed_key_names_its_replacement() {
    let eps = json!([{"name": "a", "cluster": "ca"}]);
    let errs = errors(json!({"endpoints": eps,
        "quota_pacing": false, "success_rate_alpha": 0.5, "pin_break_ratio": 4.0,
        "bogus": 1}));
    assert!(
        errs.contains(&"quota_pacing was removed: quota pacing is always on".to_string()),
        "{errs:?}"
    );
    assert!(
        errs.contains(
            &"success_rate_alpha was removed: it is built in (0.1, `routing::select::SUCCESS_RATE_ALPHA`)"
                .to_string()
        ),
        "{errs:?}"
    );
    assert!(
        errs.contains(
            &"pin_break_ratio was moved: set it as `tuning.pin_break_ratio` (unstable)".to_string()
        ),
        "{errs:?}"
    );
    assert!(
        errs.iter()
            .any(|e| e.starts_with("bogus is not a known key")),
        "{errs:?}"
    );
    assert_eq!(errs.len(), 4, "{errs:?}");
    // Every removed key is refused, none is a current key or a tuning key.
    let current: Vec<&str> = top_level_keys().iter().map(|k| k.key).collect();
    let tuning: Vec<&str> = tuning_keys().iter().map(|k| k.key).collect();
    for (key, replacement) in REMOVED_KEYS {
        assert!(!current.contains(key) && !tuning.contains(key), "{key}");
        assert_eq!(
            errors(json!({"endpoints": eps, *key: true})),
            vec![format!("{key} was removed: {replacement}")]
        );
    }
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

/// `pin_cookie_secret`: 16..=4096 bytes, never echoed; absent, the key is derived from the
/// whole configuration, so two fleets that differ only in an endpoint's credentials have
/// different keys, and the same configuration written differently has the same key.
#[test]
fn pin_cookie_secret_is_bounded_never_shown_and_derived_when_absent() {
    let eps = json!([{"name": "a", "cluster": "ca", "headers": {"authorization": "Bearer k1"}}]);
    let short = errors(json!({"endpoints": eps, "pin_cookie_secret": "hunter2"}));
    assert_eq!(
        short,
        vec!["pin_cookie_secret must be 16..=4096 bytes long, got 7 (value not shown)"]
    );
    let wrong = errors(json!({"endpoints": eps, "pin_cookie_secret": 42}));
    assert_eq!(
        wrong,
        vec!["pin_cookie_secret must be a string, got a number"]
    );
    let set =
        Config::from_value(&json!({"endpoints": eps, "pin_cookie_secret": "0123456789abcdef0123"}))
            .unwrap();
    assert!(set.pin_cookie_secret.configured());
    assert!(!set.summary().contains("0123456789abcdef"));
    assert!(set.summary().contains("pin_cookie_secret=(set)"));
    let derived = |v: Value| Config::from_value(&v).unwrap().pin_cookie_secret;
    let k1 = derived(json!({"endpoints": eps, "pin_cookie": true}));
    let same = derived(json!({"pin_cookie": true, "endpoints": eps}));
    let other_key = derived(json!({"pin_cookie": true, "endpoints":
        [{"name": "a", "cluster": "ca", "headers": {"authorization": "Bearer k2"}}]}));
    assert!(!k1.configured());
    assert_eq!(k1, same);
    assert_ne!(k1, other_key);
    assert_ne!(k1, set.pin_cookie_secret);
    // `pin_cookie` is on by default: a configuration that does not name it gets its own
    // derived key too (not the empty configuration's placeholder).
    let by_default = derived(json!({"endpoints": eps}));
    assert!(!by_default.configured());
    assert_ne!(by_default, Config::default().pin_cookie_secret);
    assert_ne!(by_default, other_key);
}

#[test]
fn pools_are_validated_with_their_field_paths() {
    let c = Config::from_value(&json!({"endpoints":[
        {"name":"api","cluster":"api"},
        {"name":"vllm","cluster":"vllm_pool","pool":true,"models":["m"]}
    ]}))
    .unwrap();
    assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
    assert_eq!(c.endpoints[0].pool, None);
    assert_eq!(
        c.endpoints[1].pool,
        Some(PoolMember {
            pool: "vllm".into(),
            address: None,
            slot: 0
        })
    );
    assert_eq!(c.endpoints[1].address(), None);
    let long = "p".repeat(MAX_POOL_NAME_BYTES + 1);
    let e = errors(json!({
        "destination_header": "x-computeflux-cluster",
        "endpoints":[
            {"name":"a","cluster":"a","pool":"yes"},
            {"name": long,"cluster":"b","pool":true},
            {"name":"c","cluster":"c","pool":true,"metrics":{"cluster":"other"}}
        ]
    }));
    let mut e2 = errors(json!({"endpoints":[
        {"name":"a","cluster":"a"}, {"name":"b","cluster":"b"}, {"name":"c","cluster":"c"},
        {"name":"d","cluster":"d","headers":{"x-gateway-destination-endpoint":"1.2.3.4:80"}}
    ]}));
    let mut e = e;
    e.append(&mut e2);
    let expect = [
        "destination_header must differ from routing_header",
        "endpoints[0].pool must be a boolean, got a string",
        "endpoints[1].name of a pool must be at most 40 bytes",
        "endpoints[2].metrics.cluster of a pool must be the pool's own cluster \"c\"",
        "endpoints[3].headers.x-gateway-destination-endpoint may not be set by an endpoint",
    ];
    for x in expect {
        assert!(e.iter().any(|m| m.starts_with(x)), "{x}\nin {e:#?}");
    }
    // With another destination header, the default name is an ordinary header again.
    assert!(Config::from_value(&json!({
        "destination_header": "x-pick",
        "endpoints":[{"name":"d","cluster":"d","headers":{"x-gateway-destination-endpoint":"v"}}]
    }))
    .is_ok());
}
