//! `GET /v1/models` answered from the configuration: the models the whole fleet serves.
//!
//! Why: clients discover models with `GET /v1/models`. Forwarded, it reaches one endpoint and
//! lists that endpoint's models only, so a model served elsewhere in the fleet looks missing.
//! The configuration already says which endpoint serves which model, so the filter answers
//! itself: complete, and without an upstream call.
//!
//! What is listed: the union of the `models` of every endpoint that is not `disabled`, in
//! configuration order, each model once, in the OpenAI list shape
//! (`{"object":"list","data":[{"id","object":"model","created","owned_by"}]}`). Breaker state
//! does not matter: a model whose endpoints are all cooling down still exists. An endpoint
//! without a `models` list serves any model but names none, so it adds nothing to the list:
//! a fleet made only of such endpoints answers an empty list locally; forward and
//! [`merge`] instead, or list the models in the configuration. `created` is 0 (the configuration
//! does not know when a model was made) and `owned_by` is [`OWNED_BY`].
//!
//! For fleets that prefer the upstream's answer, [`merge`] takes one endpoint's list and adds
//! the configured models it lacks: upstream entries are kept as they came (with their own
//! metadata), nothing is picked over the other. [`retrieve`] answers `GET /v1/models/{id}`.

use crate::scheduler::config::Config;
use crate::scheduler::wire::request::{openai_error, MAX_MODEL_BYTES};
use serde_json::{json, Value};

/// `owned_by` of the models the filter lists.
pub const OWNED_BY: &str = "computeflux";
/// Entries kept from an upstream's list in [`merge`].
pub const MAX_UPSTREAM_MODELS: usize = 4096;

/// The models of the enabled endpoints, in configuration order, each once.
pub fn fleet_models(cfg: &Config) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for ep in cfg.endpoints.iter().filter(|e| !e.disabled) {
        for m in ep.models.iter().flatten() {
            if !out.contains(&m.as_str()) {
                out.push(m);
            }
        }
    }
    out
}

/// Whether an enabled endpoint serves any model (has no `models` list).
pub fn serves_any_model(cfg: &Config) -> bool {
    cfg.endpoints
        .iter()
        .any(|e| !e.disabled && e.models.is_none())
}

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": OWNED_BY})
}

/// The body of the answer to `GET /v1/models` (status 200, `application/json`).
pub fn list(cfg: &Config) -> String {
    let data: Vec<Value> = fleet_models(cfg).into_iter().map(model_object).collect();
    json!({"object": "list", "data": data}).to_string()
}

/// The answer to `GET /v1/models/{id}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retrieved {
    /// 200 with this body: a configured model.
    Found(String),
    /// 404 with this body (`model_not_found`): no enabled endpoint can serve it.
    NotFound(String),
    /// An enabled endpoint serves any model: forward the request, routed with the model `id`
    /// (decoded) so that it reaches an endpoint that may serve it.
    AskUpstream(String),
}

/// Answers `GET /v1/models/{id}`; `raw_id` is the path segment as it came (percent-encoded).
pub fn retrieve(cfg: &Config, raw_id: &str) -> Retrieved {
    let id = match percent_decode(raw_id) {
        Some(id) if !id.is_empty() && id.len() <= MAX_MODEL_BYTES => id,
        _ => return Retrieved::NotFound(not_found(raw_id)),
    };
    if fleet_models(cfg).contains(&id.as_str()) {
        return Retrieved::Found(model_object(&id).to_string());
    }
    if serves_any_model(cfg) {
        return Retrieved::AskUpstream(id);
    }
    Retrieved::NotFound(not_found(&id))
}

fn not_found(id: &str) -> String {
    let shown: String = id.chars().take(MAX_MODEL_BYTES).collect();
    openai_error(
        &format!("The model `{shown}` does not exist or no endpoint serves it."),
        "invalid_request_error",
        "model_not_found",
    )
}

/// The result of [`merge`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Merged {
    /// The upstream's entries, then the configured models it did not list.
    Merged(String),
    /// The upstream's body is not a model list: the local [`list`] alone (log it).
    UpstreamUnreadable(String),
}

/// Merges an upstream's `GET /v1/models` body with the fleet's models.
pub fn merge(cfg: &Config, upstream: &[u8]) -> Merged {
    let Some(items) = serde_json::from_slice::<Value>(upstream)
        .ok()
        .and_then(|mut v| v.get_mut("data").map(Value::take))
        .and_then(|d| match d {
            Value::Array(items) => Some(items),
            _ => None,
        })
    else {
        return Merged::UpstreamUnreadable(list(cfg));
    };
    let mut data: Vec<Value> = Vec::new();
    let mut ids: Vec<String> = Vec::new();
    for item in items {
        if data.len() >= MAX_UPSTREAM_MODELS {
            break;
        }
        let Some(id) = item.get("id").and_then(Value::as_str) else {
            continue;
        };
        if ids.iter().any(|i| i == id) {
            continue;
        }
        ids.push(id.to_string());
        data.push(item);
    }
    for m in fleet_models(cfg) {
        if !ids.iter().any(|i| i == m) {
            data.push(model_object(m));
        }
    }
    Merged::Merged(json!({"object": "list", "data": data}).to_string())
}

/// Decodes `%XX` escapes; `None` if the result is not UTF-8. Invalid escapes stay as they are.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let hex = |j: usize| bytes.get(j).and_then(|c| (*c as char).to_digit(16));
        match (b, hex(i + 1), hex(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cfg(endpoints: Value) -> Config {
        Config::from_value(&json!({ "endpoints": endpoints })).unwrap()
    }

    fn fleet() -> Config {
        cfg(json!([
            {"name": "a", "cluster": "a", "models": ["llama", "qwen"]},
            {"name": "b", "cluster": "b", "models": ["qwen", "whisper"]},
            {"name": "c", "cluster": "c", "models": ["old"], "disabled": true},
        ]))
    }

    fn ids(body: &str) -> Vec<String> {
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["object"], "list");
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn lists_the_union_of_enabled_endpoints() {
        let body = list(&fleet());
        assert_eq!(ids(&body), ["llama", "qwen", "whisper"]);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["data"][0],
            json!({"id": "llama", "object": "model", "created": 0, "owned_by": "computeflux"})
        );
    }

    #[test]
    fn serve_any_endpoints_add_nothing() {
        let c = cfg(json!([
            {"name": "a", "cluster": "a"},
            {"name": "b", "cluster": "b", "models": ["m"]},
        ]));
        assert_eq!(ids(&list(&c)), ["m"]);
        assert!(serves_any_model(&c));
        let only_any = cfg(json!([{"name": "a", "cluster": "a"}]));
        assert!(ids(&list(&only_any)).is_empty());
        assert!(!serves_any_model(&fleet()));
    }

    #[test]
    fn retrieve_known_unknown_and_encoded() {
        let c = cfg(json!([
            {"name": "a", "cluster": "a", "models": ["org/model-1", "m"]},
        ]));
        match retrieve(&c, "org%2Fmodel-1") {
            Retrieved::Found(b) => {
                let v: Value = serde_json::from_str(&b).unwrap();
                assert_eq!(
                    (v["id"].as_str(), v["object"].as_str()),
                    (Some("org/model-1"), Some("model"))
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(retrieve(&c, "org/model-1"), Retrieved::Found(_)));
        match retrieve(&c, "nope") {
            Retrieved::NotFound(b) => assert!(b.contains("model_not_found")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(retrieve(&c, "%ff"), Retrieved::NotFound(_)));
        assert!(matches!(retrieve(&c, "%zz"), Retrieved::NotFound(_)));
        let any = cfg(json!([{"name": "a", "cluster": "a"}]));
        assert_eq!(
            retrieve(&any, "x%20y"),
            Retrieved::AskUpstream("x y".into())
        );
    }

    #[test]
    fn merge_keeps_upstream_entries_and_adds_the_rest() {
        let upstream = br#"{"object":"list","data":[
            {"id":"qwen","object":"model","created":5,"owned_by":"vllm","max_model_len":8192},
            {"id":"qwen","object":"model"},
            {"object":"model"},
            {"id":"extra","object":"model","created":6,"owned_by":"vllm"}]}"#;
        let Merged::Merged(body) = merge(&fleet(), upstream) else {
            panic!("unreadable");
        };
        assert_eq!(ids(&body), ["qwen", "extra", "llama", "whisper"]);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["data"][0]["max_model_len"], 8192);
        assert_eq!(v["data"][0]["owned_by"], "vllm");
        for bad in [&b"not json"[..], b"{}", b"{\"data\":{}}", b"[]"] {
            assert_eq!(
                merge(&fleet(), bad),
                Merged::UpstreamUnreadable(list(&fleet()))
            );
        }
        let many: Vec<Value> = (0..MAX_UPSTREAM_MODELS + 50)
            .map(|i| json!({"id": format!("m{i}")}))
            .collect();
        let big = json!({"data": many}).to_string();
        let Merged::Merged(body) = merge(&fleet(), big.as_bytes()) else {
            panic!("unreadable");
        };
        assert_eq!(ids(&body).len(), MAX_UPSTREAM_MODELS + 3);
    }
}
