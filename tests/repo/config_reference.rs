//! docs/configuration.md is the configuration reference users read; its tables are generated
//! from the keys' declarations in `src/scheduler/config/mod.rs` (`CONFIG_DOC_WRITE=1 cargo test --test
//! config_reference` rewrites them). This test fails if a key is missing or stale, or if its type,
//! default, bounds or effect differ; it also
//! checks the documented top-level defaults against `Config::default()` and that the example
//! configuration in the doc is accepted.
// Test helpers fail loudly: that is their job.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;

use computeflux::scheduler::config::{endpoint_keys, top_level_keys, tuning_keys, Config, KeyDoc};

fn doc() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap()
}

/// The rows of the table under the heading `## {heading}`: key → (type, default, bounds, effect).
fn table(text: &str, heading: &str) -> BTreeMap<String, [String; 4]> {
    let start = text
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("no '## {heading}' section"));
    let section = &text[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
    let mut rows = BTreeMap::new();
    let mut header_seen = false;
    for line in section[..end].lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<String> = line
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().trim_matches('`').to_string())
            .collect();
        if !header_seen {
            assert_eq!(
                cells,
                ["Key", "Type", "Default", "Bounds", "Effect"],
                "{heading}"
            );
            header_seen = true;
            continue;
        }
        if cells.iter().all(|c| c.chars().all(|ch| ch == '-')) {
            continue;
        }
        assert_eq!(cells.len(), 5, "{heading}: {line}");
        let key = cells[0].clone();
        let row = [
            cells[1].clone(),
            cells[2].clone(),
            cells[3].clone(),
            cells[4].clone(),
        ];
        assert!(
            rows.insert(key.clone(), row).is_none(),
            "{heading}: {key} twice"
        );
    }
    rows
}

fn compare(heading: &str, rows: &BTreeMap<String, [String; 4]>, keys: &[KeyDoc]) {
    for k in keys {
        let row = rows
            .get(k.key)
            .unwrap_or_else(|| panic!("docs/configuration.md ({heading}) lacks `{}`", k.key));
        assert_eq!(row[0], k.kind, "type of {}", k.key);
        assert_eq!(row[1], k.default, "default of {}", k.key);
        assert_eq!(row[2], k.bounds, "bounds of {}", k.key);
        assert_eq!(row[3], k.effect, "effect of {}", k.key);
    }
    for key in rows.keys() {
        assert!(
            keys.iter().any(|k| k.key == key),
            "docs/configuration.md ({heading}) documents `{key}`, which the code does not know"
        );
    }
}

#[test]
fn top_level_keys_match_the_code() {
    compare(
        "Top-level keys",
        &table(&doc(), "Top-level keys"),
        &top_level_keys(),
    );
}

#[test]
fn tuning_keys_match_the_code() {
    compare(
        "Tuning keys (unstable)",
        &table(&doc(), "Tuning keys (unstable)"),
        &tuning_keys(),
    );
}

/// The public configuration stays small: a key is a promise to users (the tuning object is
/// one row, and unstable).
#[test]
fn the_top_level_table_stays_small() {
    let rows = table(&doc(), "Top-level keys");
    assert!(rows.len() <= 30, "{} top-level keys", rows.len());
}

#[test]
fn endpoint_keys_match_the_code() {
    compare(
        "Endpoint keys",
        &table(&doc(), "Endpoint keys"),
        &endpoint_keys(),
    );
}

#[test]
fn documented_defaults_are_the_real_defaults() {
    // `Config::summary` prints every top-level value but `endpoints` as key=value.
    let summary = Config::default().summary();
    let values: BTreeMap<&str, &str> = summary
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .collect();
    let top = table(&doc(), "Top-level keys");
    let tuning = table(&doc(), "Tuning keys (unstable)");
    let rows = top
        .iter()
        .filter(|(key, _)| *key != "endpoints" && *key != "tuning")
        .map(|(key, row)| (key.clone(), row))
        .chain(
            tuning
                .iter()
                .map(|(key, row)| (format!("tuning.{key}"), row)),
        );
    for (key, row) in rows {
        let actual = values
            .get(key.as_str())
            .unwrap_or_else(|| panic!("{key} not in Config::default().summary(): {summary}"));
        assert_eq!(
            &row[1], actual,
            "documented default of {key} vs Config::default()"
        );
    }
}

#[test]
fn a_stale_or_missing_key_is_detected() {
    let mut rows = table(&doc(), "Top-level keys");
    rows.remove("max_attempts");
    rows.insert("max_retries".into(), Default::default());
    let r = std::panic::catch_unwind(|| compare("Top-level keys", &rows, &top_level_keys()));
    assert!(r.is_err());
}

#[test]
fn the_example_configuration_is_accepted() {
    let text = doc();
    let start = text.find("```json\n").unwrap() + 8;
    let end = start + text[start..].find("```").unwrap();
    let json = text[start..end].replace("sk-…", "sk-example");
    let cfg = Config::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e:?}\n{json}"));
    assert_eq!(cfg.endpoints.len(), 2);
}

/// The markdown table of `keys`, as docs/configuration.md holds it.
fn render(keys: &[KeyDoc]) -> String {
    let cell = |s: &str| {
        if s.starts_with('(') || s.is_empty() {
            s.to_string()
        } else {
            format!("`{s}`")
        }
    };
    let mut out =
        String::from("| Key | Type | Default | Bounds | Effect |\n|---|---|---|---|---|\n");
    for k in keys {
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} |\n",
            k.key,
            k.kind,
            cell(&k.default),
            k.bounds,
            k.effect
        ));
    }
    out
}

/// With `CONFIG_DOC_WRITE=1`, rewrites the tables of docs/configuration.md from the code.
#[test]
fn write_tables_when_asked() {
    if std::env::var_os("CONFIG_DOC_WRITE").is_none() {
        return;
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
    let mut text = doc();
    for (heading, keys) in [
        ("Top-level keys", top_level_keys()),
        ("Tuning keys (unstable)", tuning_keys()),
        ("Endpoint keys", endpoint_keys()),
    ] {
        let start = text.find(&format!("\n## {heading}\n")).unwrap();
        let table_start = start + text[start..].find("\n| Key").unwrap() + 1;
        let table_end = table_start
            + text[table_start..]
                .find("\n\n")
                .map_or(text.len() - table_start, |e| e + 1);
        text.replace_range(table_start..table_end, &render(&keys));
    }
    std::fs::write(path, text).unwrap();
}
