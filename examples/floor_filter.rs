//! The floor: the least a proxy-wasm filter that routes on the request body can do, so that the
//! overhead benchmark can say how much of the computeflux filter's cost is its own logic.
//!
//! Why: a filter that chooses the upstream from the body must pause the request headers, let
//! Envoy buffer the body, copy it into the module, set a routing header and continue. Those
//! host round trips, the V8 calls and the buffering cost the same whatever the filter decides;
//! `scripts/bench` measures this module beside Envoy without wasm and beside the real filter in
//! the same run (no wasm → floor: what any such filter pays; floor → filter: computeflux's own
//! work).
//!
//! What it does, nothing more:
//! - `on_http_request_headers`: with a body to come, `Pause` (needs
//!   `allow_on_headers_stop_iteration: true` in the Wasm filter's config, as the real filter);
//!   without one, set the header and `Continue`.
//! - `on_http_request_body`: before end of stream `Pause` (Envoy buffers); at end of stream copy
//!   the whole body into the module (as a filter reading `model` must), set the routing header to
//!   the configured cluster (replacing any client-sent value) and `Continue`.
//! - No response callbacks, no shared data, no metrics, no timers, no parsing of the body
//!   (unless `"read_model"`, below).
//!
//! Configuration (the plugin's `configuration` string): `{"cluster": "<name>"}`, optionally
//! `"header": "<routing header>"` (default `x-computeflux-cluster`, the real filter's). Read by
//! hand (this module depends on `proxy-wasm` alone); a configuration without a cluster is
//! refused at start.
//!
//! With `"read_model": true` it also parses the body for its `model` (serde_json, the whole body
//! validated, every other field skipped unread) before routing: the least a filter that routes
//! on the model does, so that the exact cost harness (`tests/cost`) can say what reading the
//! routing field alone costs beside the floor's copy. The model is not used (the route stays the
//! configured cluster, so the harness's scenarios run unchanged); a body that is not a JSON object
//! with a string `model` is routed the same (a real filter answers 400 there).
//!
//! With `"clusters": N` (N ≥ 1) it spreads requests over the N clusters `<cluster>0` …
//! `<cluster>N-1` by an FNV-1a hash of the `x-session-id` request header (absent: of ""), as
//! the overhead-against-fleet-size benchmark needs: Envoy's own cost of routing among N clusters
//! (a connection pool and stats per cluster) is then measured without the filter's logic. The
//! one header read and the hash are a few hundred instructions.
//!
//! It never panics: the SDK's `hostcalls` helpers panic on an unexpected host status, so the
//! few host calls go straight to the proxy-wasm ABI and a failed one is ignored (the request then
//! goes on without the header, and Envoy answers it as it would any unroutable request).
//!
//! Build: `cargo build --release --target wasm32-wasip1 --example floor_filter` →
//! `target/wasm32-wasip1/release/examples/floor_filter.wasm`. Natively this example is empty
//! (the proxy-wasm host functions exist only in Envoy).

#[cfg(target_arch = "wasm32")]
mod floor {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType};
    use std::rc::Rc;

    const OK: u32 = 0;
    /// `proxy_wasm::types::BufferType::HttpRequestBody` / `PluginConfiguration`.
    const BUFFER_HTTP_REQUEST_BODY: u32 = 0;
    const BUFFER_PLUGIN_CONFIGURATION: u32 = 7;
    /// `proxy_wasm::types::MapType::HttpRequestHeaders`.
    const MAP_HTTP_REQUEST_HEADERS: u32 = 0;
    /// `proxy_wasm::types::LogLevel::Error`.
    const LOG_ERROR: u32 = 4;
    const DEFAULT_HEADER: &str = "x-computeflux-cluster";

    // The host functions, with raw u32 statuses (the SDK's typed ones panic on surprises).
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_log(level: u32, data: *const u8, size: usize) -> u32;
        fn proxy_get_buffer_bytes(
            kind: u32,
            start: usize,
            max: usize,
            data: *mut *mut u8,
            size: *mut usize,
        ) -> u32;
        fn proxy_get_header_map_value(
            map: u32,
            key: *const u8,
            key_size: usize,
            value: *mut *mut u8,
            value_size: *mut usize,
        ) -> u32;
        fn proxy_replace_header_map_value(
            map: u32,
            key: *const u8,
            key_size: usize,
            value: *const u8,
            value_size: usize,
        ) -> u32;
    }

    fn log_error(msg: &str) {
        // SAFETY: `msg` is live for the call.
        let _ = unsafe { proxy_log(LOG_ERROR, msg.as_ptr(), msg.len()) };
    }

    /// The bytes a host call handed over through its `data` / `size` out-parameters, owned now
    /// (freed here on an error status); empty when it handed nothing or failed.
    fn handed_over(status: u32, data: *mut u8, size: usize) -> Vec<u8> {
        if data.is_null() {
            return Vec::new();
        }
        // SAFETY: the host allocated `size` bytes with the module's allocator
        // (`proxy_on_memory_allocate`) and handed them over: we own them now.
        let bytes = unsafe { Vec::from_raw_parts(data, size, size) };
        if status == OK {
            bytes
        } else {
            Vec::new()
        }
    }

    /// `max` bytes of a host buffer from `start`; empty on any error.
    fn buffer(kind: u32, start: usize, max: usize) -> Vec<u8> {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: the host writes a pointer and a size into the out-parameters.
        let status = unsafe { proxy_get_buffer_bytes(kind, start, max, &mut data, &mut size) };
        handed_over(status, data, size)
    }

    /// A request header's value; empty when absent or on any error.
    fn request_header(name: &str) -> Vec<u8> {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: `name` is live for the call; the host writes a pointer and a size.
        let status = unsafe {
            proxy_get_header_map_value(
                MAP_HTTP_REQUEST_HEADERS,
                name.as_ptr(),
                name.len(),
                &mut data,
                &mut size,
            )
        };
        handed_over(status, data, size)
    }

    /// FNV-1a, 64 bits.
    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    fn set_request_header(name: &str, value: &str) -> bool {
        // SAFETY: both strings are live for the call.
        unsafe {
            proxy_replace_header_map_value(
                MAP_HTTP_REQUEST_HEADERS,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            ) == OK
        }
    }

    /// The string value of `"key"` in a flat JSON object (no escapes needed in cluster or
    /// header names, which Envoy restricts to plain characters anyway).
    fn string_field(json: &str, key: &str) -> Option<String> {
        let quoted = format!("\"{key}\"");
        let after_key = json.split_once(quoted.as_str())?.1;
        let after_colon = after_key.trim_start().strip_prefix(':')?.trim_start();
        let value = after_colon.strip_prefix('"')?;
        let (v, _) = value.split_once('"')?;
        (!v.is_empty() && !v.contains('\\')).then(|| v.to_string())
    }

    /// Whether `"key": true` is in a flat JSON object.
    fn true_field(json: &str, key: &str) -> bool {
        let quoted = format!("\"{key}\"");
        json.split_once(quoted.as_str())
            .and_then(|(_, after)| after.trim_start().strip_prefix(':'))
            .is_some_and(|v| v.trim_start().starts_with("true"))
    }

    /// The routing field of a request body, borrowed where it has no escapes.
    #[derive(serde::Deserialize)]
    struct Routing<'a> {
        #[serde(borrow)]
        model: Option<std::borrow::Cow<'a, str>>,
    }

    /// The body's `model`, if it is a JSON object with a string one.
    fn model(body: &[u8]) -> Option<std::borrow::Cow<'_, str>> {
        serde_json::from_slice::<Routing<'_>>(body).ok()?.model
    }

    /// The unsigned integer value of `"key"` in a flat JSON object.
    fn number_field(json: &str, key: &str) -> Option<u64> {
        let quoted = format!("\"{key}\"");
        let after_key = json.split_once(quoted.as_str())?.1;
        let after_colon = after_key.trim_start().strip_prefix(':')?.trim_start();
        let digits: &str = after_colon
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap_or("");
        digits.parse().ok()
    }

    struct Route {
        header: String,
        cluster: String,
        /// Spread over `<cluster>0 … <cluster>{clusters-1}` by session (0: the one cluster).
        clusters: u64,
        /// Parse the body for its `model` before routing.
        read_model: bool,
    }

    #[derive(Default)]
    struct Root {
        route: Option<Rc<Route>>,
    }

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, size: usize) -> bool {
            let raw = buffer(BUFFER_PLUGIN_CONFIGURATION, 0, size);
            let text = String::from_utf8_lossy(&raw);
            match string_field(&text, "cluster") {
                Some(cluster) => {
                    let header = string_field(&text, "header")
                        .unwrap_or_else(|| DEFAULT_HEADER.to_string())
                        .to_ascii_lowercase();
                    let clusters = number_field(&text, "clusters").unwrap_or(0);
                    self.route = Some(Rc::new(Route {
                        header,
                        cluster,
                        clusters,
                        read_model: true_field(&text, "read_model"),
                    }));
                    true
                }
                None => {
                    log_error("floor_filter: configuration needs {\"cluster\": \"<name>\"}");
                    false
                }
            }
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Request {
                route: self.route.clone(),
            }))
        }
    }

    struct Request {
        route: Option<Rc<Route>>,
    }

    impl Request {
        fn route(&self) {
            if let Some(r) = &self.route {
                if r.clusters == 0 {
                    let _ = set_request_header(&r.header, &r.cluster);
                } else {
                    let k = fnv1a(&request_header("x-session-id")) % r.clusters;
                    let _ = set_request_header(&r.header, &format!("{}{k}", r.cluster));
                }
            }
        }
    }

    impl Context for Request {}

    impl HttpContext for Request {
        fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
            if end_of_stream {
                self.route();
                return Action::Continue;
            }
            Action::Pause
        }

        fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
            if !end_of_stream {
                return Action::Pause;
            }
            // What a body-routing filter must do before it can decide: have the whole body.
            let body = buffer(BUFFER_HTTP_REQUEST_BODY, 0, body_size);
            if self.route.as_ref().is_some_and(|r| r.read_model) {
                std::hint::black_box(model(&body));
            }
            std::hint::black_box(&body);
            self.route();
            Action::Continue
        }
    }

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
    }}
}
