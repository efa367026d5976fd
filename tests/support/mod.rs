//! Shared harness of the integration tests: real Envoy processes, real mock upstreams, and a
//! small blocking HTTP client.
//!
//! Why: the filter's behaviour (routing by body, affinity, failover, metrics) only exists inside
//! Envoy, so the tests that say a feature works start Envoy 1.40 with the built wasm module in
//! front of `mock_upstream` processes (tests/tools) and talk to it over loopback.
//!
//! How: every process binds port 0 and reports its port (mock: its `LISTENING` line; Envoy: the
//! admin address file, then the admin `/listeners` endpoint); every process is killed when its
//! handle drops, also when a test panics; every network call has a timeout. Binaries are built
//! at most once per test process, under a file lock shared with other test processes.
//!
//! Several Envoys as the replicas of one gateway (restartable with empty shared data):
//! [`Replicas`]. Client sessions that record where and how each turn was served: [`Session`].
//! Expectations reported together at the end of a measuring test: [`Checks`]. Load on an
//! engine from elsewhere (clients straight to a mock): [`Backlog`].
//!
//! Declared once by each test binary's `main.rs`; its files `use crate::support;` (each test file uses a part, hence `dead_code` allowed).

#![allow(dead_code, unused_imports)]
// Test support: failing loudly (panic with context) is the point here.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

pub mod artifacts;
pub mod backlog;
pub mod checks;
pub mod ecds;
pub mod envoy;
pub mod http;
pub mod mock;
pub mod placement;
pub mod pool;
pub mod python;
pub mod raw;
pub mod replicas;
pub mod session;

use serde_json::{json, Value};

pub use artifacts::{envoy_bin, mock_bin, repo_root, target_dir, wasm_path};
pub use backlog::Backlog;
pub use checks::Checks;
pub use ecds::EcdsEnvoy;
pub use envoy::{render_bootstrap, Envoy, EnvoyConfig, DEFAULT_STAT_TAGS};
pub use http::{curl_h2, get, post_chat, CookieJar, Response};
pub use mock::MockUpstream;
pub use replicas::Replicas;
pub use session::{for_each_parallel, percent, steady_mock, tally, Session, Turn};

/// An OpenAI chat-completion body for a conversation whose user turns are `user_msgs`.
///
/// Between consecutive user turns an assistant turn `"reply <i>"` is inserted, so the body for
/// turns `[u1, u2]` extends the body for `[u1]` exactly as a client replaying its history does
/// (and the mock's prefix cache sees the earlier prompt as a prefix). The keys of `extra` (an
/// object, e.g. `{"stream": true, "user": "s1"}`) are added to the top level; `Value::Null` adds
/// nothing.
pub fn chat_body(model: &str, user_msgs: &[&str], extra: Value) -> String {
    let mut messages = Vec::new();
    for (i, m) in user_msgs.iter().enumerate() {
        if i > 0 {
            messages.push(json!({"role": "assistant", "content": format!("reply {i}")}));
        }
        messages.push(json!({"role": "user", "content": m}));
    }
    let mut body = json!({"model": model, "messages": messages});
    if let (Some(obj), Value::Object(more)) = (body.as_object_mut(), extra) {
        obj.extend(more);
    }
    body.to_string()
}

/// A process-unique small number (for temp dir names and Envoy base ids).
pub fn unique_u32() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    ((std::process::id() & 0x000F_FFFF) << 10) | (n & 0x3FF)
}
