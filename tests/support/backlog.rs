//! Load from elsewhere: clients sending requests straight to one engine, not through Envoy (as
//! another gateway's traffic would), so that its slots and queue fill and Envoy learns of it
//! only from the engine's `/metrics`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::json;

use super::http::request;

/// Clients sending plain chat requests straight to one engine, one after the other, until
/// stopped. Stopped (each client finishing its request) by [`Backlog::halt`] or on drop.
pub struct Backlog {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    clients: Vec<JoinHandle<()>>,
}

impl Backlog {
    /// `clients` clients, each sending `max_tokens`-token requests for `model` to `port`; with
    /// `pause_ms > 0` each waits a varying 0..pause_ms between two requests and varies its
    /// request's length (a load that changes all the time).
    pub fn start(
        model: &str,
        port: u16,
        clients: usize,
        max_tokens: u64,
        pause_ms: u64,
    ) -> Backlog {
        Backlog::start_with(model, port, &[], clients, max_tokens, pause_ms)
    }

    /// [`Backlog::start`] with `headers` on every request (e.g. the data-parallel rank that
    /// is to fill up).
    pub fn start_with(
        model: &str,
        port: u16,
        headers: &[(&str, &str)],
        clients: usize,
        max_tokens: u64,
        pause_ms: u64,
    ) -> Backlog {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let clients = (0..clients)
            .map(|k| {
                let (stop, sent) = (stop.clone(), sent.clone());
                let (model, headers) = (model.to_string(), headers.clone());
                std::thread::spawn(move || {
                    let headers: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let mut n = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        n += 1;
                        // A small deterministic spread (k, n) → 0..1.
                        let spread = ((k as u64 * 7919 + n * 104_729) % 1000) as f64 / 1000.0;
                        let tokens = if pause_ms > 0 {
                            (max_tokens as f64 * (0.25 + spread)).round() as u64
                        } else {
                            max_tokens
                        };
                        let body = json!({"model": model, "max_tokens": tokens.max(1),
                            "messages": [{"role": "user", "content": format!("backlog {k} {n}")}]})
                        .to_string();
                        let r = request(
                            port,
                            "POST",
                            "/v1/chat/completions",
                            &headers,
                            Some(body.as_bytes()),
                            Duration::from_secs(30),
                        );
                        sent.fetch_add(1, Ordering::SeqCst);
                        if r.is_err() {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        if pause_ms > 0 {
                            std::thread::sleep(Duration::from_millis(
                                (spread * pause_ms as f64) as u64,
                            ));
                        }
                    }
                })
            })
            .collect();
        Backlog {
            stop,
            sent,
            clients,
        }
    }

    /// Requests sent so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// Stops every client once its request is answered (each has a 30 s deadline).
    pub fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for c in self.clients.drain(..) {
            let _ = c.join();
        }
    }
}

impl Drop for Backlog {
    fn drop(&mut self) {
        self.halt();
    }
}
