//! Which API a request is, and so what the filter does with it before routing.
//!
//! A gateway in front of vLLM / TGI / hosted keys sees more than chat completions. Reading every
//! POST body as JSON breaks the APIs that are not JSON (audio uploads are multipart forms) and
//! the ones that are not inference at all (file uploads, batches), and answering `GET /v1/models`
//! from one endpoint hides models served elsewhere in the fleet. So the filter first looks at
//! the method, the path (the query is ignored) and the content type, and decides one of:
//!
//! | method | path | handling |
//! |---|---|---|
//! | POST | `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses`, `/v1/messages` | [`Handling::Json`]: buffer, read `model` and the session, route by model |
//! | POST | `/v1/audio/transcriptions`, `/v1/audio/translations` | [`Handling::Multipart`]: buffer, read the `model` form field, route by model; no session unless a header gives one |
//! | GET | `/v1/models` | [`Handling::ListModels`]: answered by the filter from its configuration |
//! | GET | `/v1/models/{id}` | [`Handling::RetrieveModel`]: answered from the configuration when it knows the model |
//! | any | `/v1/responses/{id}` and below | [`Handling::StoredResponse`]: routed to the endpoint that produced response `id` |
//! | any | anything else (`/v1/files`, `/v1/batches`, `/v1/uploads`, unknown paths, other methods on the paths above) | [`Handling::PassThrough`]: routed at once without a model, the body never read |
//!
//! A body whose content type contradicts its path (a multipart form sent to a JSON API, or a
//! JSON body sent to an audio API) is refused with `415 unsupported_content_type`: forwarding it
//! would only get the same refusal from the upstream, after a routing decision made without a
//! model. JSON APIs accept any other content type (curl's `-d` sends
//! `application/x-www-form-urlencoded`), as they always did.
//!
//! Paths are matched exactly after dropping the query and one trailing `/`; the `/v1` prefix is
//! required (it is what every OpenAI-compatible server and SDK uses). Before that, a path that
//! is not in canonical form (`/v1/%63hat/completions`, `//v1/…`, dot segments) or is ambiguous
//! (`%2F` that names another API once decoded, `%25`, backslashes, control bytes) is refused
//! with `400 invalid_path` ([`Handling::InvalidPath`], see `path`): an upstream that decodes
//! the path would otherwise serve a request the filter classified as something else.

use super::path::{canonical, check, has_encoded_slash, path_part, PathError};

/// The inference APIs the filter routes by model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Completions,
    Embeddings,
    /// The Responses API: follow-ups name their predecessor with `previous_response_id`.
    Responses,
    /// Anthropic Messages (vLLM serves it too): the session may be `metadata.user_id`.
    Messages,
    AudioTranscriptions,
    AudioTranslations,
}

impl Api {
    /// A short, stable label (for logs and metrics).
    pub fn label(&self) -> &'static str {
        match self {
            Api::ChatCompletions => "chat_completions",
            Api::Completions => "completions",
            Api::Embeddings => "embeddings",
            Api::Responses => "responses",
            Api::Messages => "messages",
            Api::AudioTranscriptions => "audio_transcriptions",
            Api::AudioTranslations => "audio_translations",
        }
    }

    /// The body format the API takes.
    pub fn body(&self) -> BodyFormat {
        match self {
            Api::AudioTranscriptions | Api::AudioTranslations => BodyFormat::Multipart,
            _ => BodyFormat::Json,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    Json,
    Multipart,
}

/// What the filter does with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handling<'a> {
    /// An inference request with a JSON body: parse it (`request::parse_chat`), route by model.
    Json(Api),
    /// An inference request with a `multipart/form-data` body: read its `model` field
    /// (`multipart::read_model`), route by model, no session from the body.
    Multipart(Api),
    /// `GET /v1/models`: answered locally (`models::list`).
    ListModels,
    /// `GET /v1/models/{id}`: answered locally when the configuration knows the model
    /// (`models::retrieve`). `id` is still percent-encoded as it came in the path.
    RetrieveModel { id: &'a str },
    /// `/v1/responses/{id}…` (retrieve, delete, cancel, input items): only the endpoint that
    /// produced the response has it (`responses::holder`). `id` as it came in the path.
    StoredResponse { id: &'a str },
    /// Not inference, or not known: route at once without a model, never read the body.
    PassThrough,
    /// The content type contradicts the path: answer
    /// `RequestError::UnsupportedContentType(api)` (415).
    WrongContentType { api: Api },
    /// The path is ambiguous or not canonical (`path::check`): answer
    /// `RequestError::InvalidPath` (400) before anything else is read.
    InvalidPath(PathError),
}

/// Decides what to do with a request from its method, `:path` and `content-type` header.
///
/// The path is checked first (`path::check`): only a canonical path is classified, so what
/// goes upstream is what was classified; and a path whose encoded `/` (`%2F`) would name
/// another API once decoded (as Starlette-based servers do) is refused too.
pub fn policy<'a>(method: &str, path: &'a str, content_type: Option<&str>) -> Handling<'a> {
    if let Err(e) = check(path) {
        return Handling::InvalidPath(e);
    }
    let handling = classify(method, path, content_type);
    if has_encoded_slash(path) {
        let same = canonical(path, true)
            .is_ok_and(|decoded| same_kind(&handling, &classify(method, &decoded, content_type)));
        if !same {
            return Handling::InvalidPath(PathError::EncodedSlash);
        }
    }
    handling
}

/// Whether two handlings do the same thing, ids aside (an id may hold an encoded `/`).
fn same_kind(a: &Handling<'_>, b: &Handling<'_>) -> bool {
    use Handling as H;
    match (a, b) {
        (H::RetrieveModel { .. }, H::RetrieveModel { .. })
        | (H::StoredResponse { .. }, H::StoredResponse { .. }) => true,
        _ => a == b,
    }
}

/// [`policy`] on a path already checked.
fn classify<'a>(method: &str, path: &'a str, content_type: Option<&str>) -> Handling<'a> {
    let path = clean_path(path);
    let Some(rest) = path.strip_prefix("/v1/") else {
        return Handling::PassThrough;
    };
    let is_post = method == "POST";
    let is_get = method == "GET";
    let api = match rest {
        "chat/completions" => Some(Api::ChatCompletions),
        "completions" => Some(Api::Completions),
        "embeddings" => Some(Api::Embeddings),
        "responses" => Some(Api::Responses),
        "messages" => Some(Api::Messages),
        "audio/transcriptions" => Some(Api::AudioTranscriptions),
        "audio/translations" => Some(Api::AudioTranslations),
        _ => None,
    };
    if let Some(api) = api {
        if !is_post {
            return Handling::PassThrough;
        }
        let multipart = content_type.is_some_and(is_multipart_form);
        return match (api.body(), multipart) {
            (BodyFormat::Json, false) => Handling::Json(api),
            (BodyFormat::Multipart, true) => Handling::Multipart(api),
            _ => Handling::WrongContentType { api },
        };
    }
    if rest == "models" && is_get {
        return Handling::ListModels;
    }
    if let Some(id) = rest.strip_prefix("models/").filter(|id| !id.is_empty()) {
        if is_get {
            return Handling::RetrieveModel { id };
        }
        return Handling::PassThrough;
    }
    if let Some(tail) = rest.strip_prefix("responses/") {
        let id = tail.split('/').next().unwrap_or("");
        if !id.is_empty() {
            return Handling::StoredResponse { id };
        }
    }
    Handling::PassThrough
}

/// The path without its query (and fragment) and without one trailing `/`.
fn clean_path(path: &str) -> &str {
    let p = path_part(path);
    match p.strip_suffix('/') {
        Some(stripped) if !stripped.is_empty() => stripped,
        _ => p,
    }
}

/// The media type of a `content-type` value, lowercased, without parameters.
pub fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

fn is_multipart_form(content_type: &str) -> bool {
    media_type(content_type) == "multipart/form-data"
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const JSON: Option<&str> = Some("application/json");
    const FORM: Option<&str> = Some("multipart/form-data; boundary=abc");

    #[test]
    fn json_inference_paths() {
        for (path, api) in [
            ("/v1/chat/completions", Api::ChatCompletions),
            ("/v1/completions", Api::Completions),
            ("/v1/embeddings", Api::Embeddings),
            ("/v1/responses", Api::Responses),
            ("/v1/messages", Api::Messages),
        ] {
            assert_eq!(policy("POST", path, JSON), Handling::Json(api), "{path}");
            // Query and a trailing slash do not change the API; any non-multipart type is JSON.
            let q = format!("{path}/?api-version=1");
            assert_eq!(policy("POST", &q, None), Handling::Json(api), "{q}");
            let form = Some("application/x-www-form-urlencoded");
            assert_eq!(policy("POST", path, form), Handling::Json(api));
            assert_eq!(
                policy("POST", path, FORM),
                Handling::WrongContentType { api }
            );
            // Listing stored chat completions etc. is not inference.
            assert_eq!(policy("GET", path, None), Handling::PassThrough);
        }
    }

    #[test]
    fn multipart_inference_paths() {
        for (path, api) in [
            ("/v1/audio/transcriptions", Api::AudioTranscriptions),
            ("/v1/audio/translations", Api::AudioTranslations),
        ] {
            assert_eq!(policy("POST", path, FORM), Handling::Multipart(api));
            let upper = Some("Multipart/Form-Data ; boundary=\"x y\"");
            assert_eq!(policy("POST", path, upper), Handling::Multipart(api));
            assert_eq!(
                policy("POST", path, JSON),
                Handling::WrongContentType { api }
            );
            assert_eq!(
                policy("POST", path, None),
                Handling::WrongContentType { api }
            );
            // multipart/mixed is not a form.
            let mixed = Some("multipart/mixed; boundary=abc");
            assert_eq!(
                policy("POST", path, mixed),
                Handling::WrongContentType { api }
            );
        }
    }

    #[test]
    fn models_are_answered_locally() {
        assert_eq!(policy("GET", "/v1/models", None), Handling::ListModels);
        assert_eq!(policy("GET", "/v1/models?x=1", None), Handling::ListModels);
        assert_eq!(
            policy("GET", "/v1/models/meta-llama%2FLlama-3", None),
            Handling::RetrieveModel {
                id: "meta-llama%2FLlama-3"
            }
        );
        // Hugging Face ids keep their slash unencoded in some clients.
        assert_eq!(
            policy("GET", "/v1/models/org/model", None),
            Handling::RetrieveModel { id: "org/model" }
        );
        assert_eq!(
            policy("DELETE", "/v1/models/ft-1", None),
            Handling::PassThrough
        );
        assert_eq!(policy("POST", "/v1/models", JSON), Handling::PassThrough);
    }

    #[test]
    fn stored_responses_and_pass_through() {
        assert_eq!(
            policy("GET", "/v1/responses/resp_1", None),
            Handling::StoredResponse { id: "resp_1" }
        );
        assert_eq!(
            policy("POST", "/v1/responses/resp_1/cancel", None),
            Handling::StoredResponse { id: "resp_1" }
        );
        assert_eq!(
            policy("GET", "/v1/responses/resp_1/input_items?limit=2", None),
            Handling::StoredResponse { id: "resp_1" }
        );
        for (method, path) in [
            ("POST", "/v1/files"),
            ("GET", "/v1/files/file-1/content"),
            ("POST", "/v1/batches"),
            ("POST", "/v1/uploads/up_1/parts"),
            ("POST", "/v1/images/generations"),
            ("POST", "/chat/completions"),
            ("POST", "/v2/chat/completions"),
            ("POST", "/v1/chat/completionsX"),
            ("POST", "/v1"),
            ("POST", ""),
            ("GET", "/"),
        ] {
            assert_eq!(
                policy(method, path, FORM),
                Handling::PassThrough,
                "{method} {path}"
            );
        }
    }

    #[test]
    fn encoded_and_ambiguous_paths_are_refused_not_passed_through() {
        let chat = Handling::Json(Api::ChatCompletions);
        for path in [
            "/v1/%63hat/completions",
            "//v1/chat/completions",
            "/v1/files/../chat/completions",
            "/v1/./chat/completions",
            "/v1/responses//",
            "/v1%2Fchat%2Fcompletions",
            "/v1/responses/x%2F..%2F..%2Fchat%2Fcompletions",
            "/v1/chat/completions%00",
            "/v1/chat%5Ccompletions",
            "/v1/%2563hat/completions",
            "/v1/%6",
        ] {
            let h = policy("POST", path, JSON);
            assert!(matches!(h, Handling::InvalidPath(_)), "{path}: {h:?}");
            assert_ne!(h, chat);
        }
        // An encoded `/` inside an id does not change the API: still served.
        assert_eq!(
            policy("GET", "/v1/responses/a%2Fb/input_items", None),
            Handling::StoredResponse { id: "a%2Fb" }
        );
        // The query is not the path.
        assert_eq!(
            policy("POST", "/v1/chat/completions?p=%2F..%25", JSON),
            chat
        );
    }

    #[test]
    fn media_type_is_case_and_space_insensitive() {
        assert_eq!(
            media_type(" Multipart/Form-Data;boundary=x"),
            "multipart/form-data"
        );
        assert_eq!(media_type(""), "");
    }
}
