//! Host calls that never panic.
//!
//! The SDK's wrappers panic on any host status they do not expect (and its `String` header
//! getters on non-UTF-8 values). A panic kills the worker's VM, so the calls on the request
//! path go through these wrappers, which map every failure to a fallback.

use proxy_wasm::hostcalls;
use proxy_wasm::types::{Bytes, LogLevel, MapType, Status};
use std::ptr::null;
use std::time::UNIX_EPOCH;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> Status;
    fn proxy_get_log_level(return_level: *mut LogLevel) -> Status;
    fn proxy_log(level: LogLevel, message_data: *const u8, message_size: usize) -> Status;
}

pub fn log(level: LogLevel, message: &str) {
    // SAFETY: pointer and length describe a live &str for the duration of the call.
    unsafe {
        let _ = proxy_log(level, message.as_ptr(), message.len());
    }
}

/// Envoy's log level for this plugin, so the SDK does not format lines Envoy will drop.
pub fn envoy_log_level() -> LogLevel {
    let mut level = LogLevel::Info;
    // SAFETY: the host writes one LogLevel value into `level`.
    let status = unsafe { proxy_get_log_level(&mut level) };
    if status == Status::Ok {
        level
    } else {
        LogLevel::Info
    }
}

/// Wall-clock Unix milliseconds (0 if the host cannot tell, which only delays time-based
/// transitions).
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

/// proxy-wasm map serialization: count, then (key len, value len) pairs, then NUL-terminated
/// keys and values.
fn serialize_map(pairs: &[(&str, &[u8])]) -> Vec<u8> {
    let mut size = 4;
    for (k, v) in pairs {
        size += 8 + k.len() + v.len() + 2;
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// The response code details of every reply the filter sends (its own errors and relayed
/// failover answers). Envoy's `local_reply_config` must leave these alone: response flags such
/// as `UF` stay set on the stream after a failed first attempt, so a mapper that matches on
/// flags alone would also rewrite the answer of the endpoint the request failed over to.
/// envoy/envoy.yaml excludes this value with a CEL filter.
pub const REPLY_DETAILS: &str = "computeflux_reply";

/// Sends a local reply. Returns false if the host refused (e.g. the stream is already gone).
pub fn send_response(status: u32, headers: &[(&str, &[u8])], body: &[u8]) -> bool {
    let map = serialize_map(headers);
    // SAFETY: all pointers describe live buffers for the duration of the call.
    let st = unsafe {
        proxy_send_local_response(
            status,
            REPLY_DETAILS.as_ptr(),
            REPLY_DETAILS.len(),
            if body.is_empty() {
                null()
            } else {
                body.as_ptr()
            },
            body.len(),
            map.as_ptr(),
            map.len(),
            -1,
        )
    };
    st == Status::Ok
}

pub fn header_bytes(map: MapType, name: &str) -> Option<Bytes> {
    hostcalls::get_map_value_bytes(map, name).ok().flatten()
}

pub fn header_str(map: MapType, name: &str) -> Option<String> {
    header_bytes(map, name).and_then(|b| String::from_utf8(b).ok())
}

pub fn headers(map: MapType) -> Vec<(String, Bytes)> {
    hostcalls::get_map_bytes(map).unwrap_or_default()
}

pub fn set_header(map: MapType, name: &str, value: Option<&[u8]>) {
    let _ = hostcalls::set_map_value_bytes(map, name, value);
}

pub fn remove_header(map: MapType, name: &str) {
    let _ = hostcalls::remove_map_value(map, name);
}
