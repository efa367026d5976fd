//! Every call into Envoy, none of which can panic.
//!
//! Why: the proxy-wasm SDK (0.2.5) panics on any host status it does not expect — each
//! `hostcalls::*` function ends in `status => panic!`, the `Context` traits' methods
//! `.unwrap()` them, its header-map decoder indexes and `unwrap`s, and the logger installed by
//! `proxy_wasm::set_log_level` unwraps `hostcalls::log`. A panic kills the worker's VM. So this
//! module declares the host's `proxy_*` imports itself, reads what the host returns without
//! trusting it (statuses as plain numbers, header lists decoded by
//! [`crate::scheduler::wire::headers::decode_pairs`]), and maps every failure to a documented
//! fallback. `tests/repo/host_boundary.rs` fails if any other file calls the host.
//!
//! One call goes through the SDK: [`dispatch`]. Its dispatcher must register a failover
//! call's token, or it panics ("invalid token_id") when the answer arrives, and that
//! registration is private to the SDK. `hostcalls::dispatch_http_call` panics only on a status
//! other than `Ok`, `BadArgument` and `InternalFailure`; Envoy's `proxy_http_call` returns only
//! those (proxy-wasm-cpp-host `exports.cc` adds `InvalidMemoryAccess` for pointers outside the
//! VM's memory, which slices never are).
//!
//! Buffers the host returns were allocated in the VM through the SDK's exported
//! `proxy_on_memory_allocate` (a boxed slice of exactly the requested length), so they are
//! taken over with `Vec::from_raw_parts(ptr, len, len)`, as the SDK does.

use crate::scheduler::state::store::CasMismatch;
use crate::scheduler::wire::headers::{decode_pairs, encode_pairs, HeaderList, Pairs};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType};
use std::ptr::{null, null_mut};
use std::time::Duration;

// proxy-wasm ABI 0.2.1 statuses.
const OK: u32 = 0;
const NOT_FOUND: u32 = 1;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_log_level(return_level: *mut u32) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
}

/// Takes over a buffer the host allocated in the VM (empty if there is none).
///
/// # Safety
/// `data` is null or was returned by the host with `size` for this call, allocated through
/// `proxy_on_memory_allocate(size)`.
unsafe fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        // SAFETY: the caller's contract: a boxed slice of exactly `size` bytes, now ours.
        unsafe { Vec::from_raw_parts(data, size, size) }
    }
}

// ---------------------------------------------------------------------------------------------
// Logging
// ---------------------------------------------------------------------------------------------

pub fn log(level: LogLevel, message: &str) {
    // SAFETY: pointer and length describe a live &str for the duration of the call.
    unsafe {
        proxy_log(level as u32, message.as_ptr(), message.len());
    }
}

/// Envoy's log level for this plugin (Info if the host cannot tell).
pub fn envoy_log_level() -> LogLevel {
    let mut level = u32::MAX;
    // SAFETY: the host writes one u32 into `level`.
    let status = unsafe { proxy_get_log_level(&mut level) };
    match (status, level) {
        (OK, 0) => LogLevel::Trace,
        (OK, 1) => LogLevel::Debug,
        (OK, 2) => LogLevel::Info,
        (OK, 3) => LogLevel::Warn,
        (OK, 4) => LogLevel::Error,
        (OK, 5) => LogLevel::Critical,
        _ => LogLevel::Info,
    }
}

/// The `log` crate's sink: Envoy's log, through [`log`] (the SDK's logger unwraps the host
/// status).
struct HostLogger;

static LOGGER: HostLogger = HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Trace => LogLevel::Trace,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Info => LogLevel::Info,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Error => LogLevel::Error,
        };
        log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}

/// Routes the `log` macros to Envoy and formats only what Envoy keeps at `level`. Idempotent.
pub fn init_logging(level: LogLevel) {
    // Err only when already installed: then only the level changes.
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(match level {
        LogLevel::Trace => log::LevelFilter::Trace,
        LogLevel::Debug => log::LevelFilter::Debug,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Critical => log::LevelFilter::Off,
    });
}

// ---------------------------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------------------------

/// Wall-clock Unix milliseconds (0 if the host cannot tell, which only delays time-based
/// transitions).
pub fn now_ms() -> u64 {
    let mut ns = 0u64;
    // SAFETY: the host writes one u64 into `ns`.
    let status = unsafe { proxy_get_current_time_nanoseconds(&mut ns) };
    if status == OK {
        ns / 1_000_000
    } else {
        0
    }
}

/// Calls the root context's `on_tick` every `period` (false if the host refused).
pub fn tick_every(period: Duration) -> bool {
    let ms = u32::try_from(period.as_millis()).unwrap_or(u32::MAX);
    // SAFETY: plain value arguments.
    unsafe { proxy_set_tick_period_milliseconds(ms) == OK }
}

// ---------------------------------------------------------------------------------------------
// Buffers and header maps
// ---------------------------------------------------------------------------------------------

/// Up to `max` bytes of a buffer from `start` (empty if absent or on any error).
pub fn buffer(kind: BufferType, start: usize, max: usize) -> Vec<u8> {
    let mut data = null_mut();
    let mut size = 0usize;
    // SAFETY: the host writes a pointer and a size into the two out-parameters.
    let status = unsafe { proxy_get_buffer_bytes(kind as u32, start, max, &mut data, &mut size) };
    // SAFETY: on any status the host either left `data` null or handed us the buffer.
    let bytes = unsafe { take(data, size) };
    if status == OK {
        bytes
    } else {
        Vec::new()
    }
}

/// Replaces the whole of a buffer (`size` its current length, or more) with `data`. False if
/// the host refused (e.g. the buffer is not available in this callback).
pub fn replace_buffer(kind: BufferType, size: usize, data: &[u8]) -> bool {
    // SAFETY: `data` is live for the call; Envoy copies it (start 0 and a non-zero size drain
    // the buffer, then the data is prepended).
    unsafe { proxy_set_buffer_bytes(kind as u32, 0, size.max(1), data.as_ptr(), data.len()) == OK }
}

/// Every header of `map` (empty if the map is unavailable or its encoding is malformed).
pub fn header_pairs(map: MapType) -> Pairs {
    header_map_bytes(map)
        .and_then(|bytes| decode_pairs(&bytes))
        .unwrap_or_default()
}

/// Every header of `map`, read in place ([`HeaderList`]; empty if the map is unavailable or
/// its encoding is malformed).
pub fn header_list(map: MapType) -> HeaderList {
    header_map_bytes(map)
        .and_then(HeaderList::decode)
        .unwrap_or_default()
}

/// The host's serialized header map `map` (`None` if it is unavailable).
fn header_map_bytes(map: MapType) -> Option<Vec<u8>> {
    let mut data = null_mut();
    let mut size = 0usize;
    // SAFETY: the host writes into the out-parameters.
    let status = unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) };
    // SAFETY: as in `buffer`.
    let bytes = unsafe { take(data, size) };
    (status == OK).then_some(bytes)
}

/// Sets (replaces) header `name`. False if the host refused (e.g. the headers were sent).
/// Adds a header value, keeping any the map has under that name (`set-cookie`).
pub fn add_header(map: MapType, name: &str, value: &[u8]) -> bool {
    // SAFETY: both slices are live for the call.
    unsafe {
        proxy_add_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        ) == OK
    }
}

pub fn set_header(map: MapType, name: &str, value: &[u8]) -> bool {
    // SAFETY: both slices are live for the call.
    unsafe {
        proxy_replace_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        ) == OK
    }
}

pub fn remove_header(map: MapType, name: &str) -> bool {
    // SAFETY: `name` is live for the call.
    unsafe { proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()) == OK }
}

// ---------------------------------------------------------------------------------------------
// Shared data
// ---------------------------------------------------------------------------------------------

/// A CAS token no stored value has (Envoy counts tokens up from 1): a write based on a read
/// that failed then fails too, instead of overwriting the value unconditionally.
const UNREADABLE_CAS: u32 = u32::MAX;

/// The value of `key` and its CAS token; `(None, None)` if it was never written.
pub fn shared_get(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    let mut data = null_mut();
    let mut size = 0usize;
    let mut cas = 0u32;
    // SAFETY: `key` is live for the call; the host writes into the out-parameters.
    let status =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    // SAFETY: as in `buffer`.
    let bytes = unsafe { take(data, size) };
    match status {
        OK => (Some(bytes), (cas != 0).then_some(cas)),
        NOT_FOUND => (None, None),
        _ => (None, Some(UNREADABLE_CAS)),
    }
}

/// Writes `value` if the CAS token still matches (`None`: unconditionally).
pub fn shared_set(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
    // SAFETY: both slices are live for the call.
    let status = unsafe {
        proxy_set_shared_data(
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
            cas.unwrap_or(0),
        )
    };
    // CasMismatch, or anything unexpected: the write did not happen.
    if status == OK {
        Ok(())
    } else {
        Err(CasMismatch)
    }
}

// ---------------------------------------------------------------------------------------------
// Replies and failover calls
// ---------------------------------------------------------------------------------------------

/// The response code details of every reply the filter sends (its own errors and relayed
/// failover answers). Envoy's `local_reply_config` must leave these alone: response flags such
/// as `UF` stay set on the stream after a failed first attempt, so a mapper that matches on
/// flags alone would also rewrite the answer of the endpoint the request failed over to.
/// envoy/envoy.yaml excludes this value with a CEL filter.
pub const REPLY_DETAILS: &str = "computeflux_reply";

/// Sends a local reply. False if the host refused (e.g. the stream is already gone).
pub fn send_response(status: u32, headers: &[(&str, &[u8])], body: &[u8]) -> bool {
    let map = encode_pairs(headers);
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
    st == OK
}

/// Sends a failover call (see the module docs for why through the SDK). False if the host
/// refused it (e.g. the cluster is unknown to Envoy). Header and trailer values that are not
/// UTF-8 are left out (the SDK takes `&str`; Envoy only accepts visible ASCII anyway).
pub fn dispatch(
    cluster: &str,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
    trailers: &[(String, Vec<u8>)],
    timeout_ms: u64,
) -> bool {
    let body = (!body.is_empty()).then_some(body);
    hostcalls::dispatch_http_call(
        cluster,
        text(headers),
        body,
        text(trailers),
        Duration::from_millis(timeout_ms),
    )
    .is_ok()
}

/// A property as text (`["upstream", "address"]`); `None` when absent or unreadable.
pub fn property_text(path: &[&str]) -> Option<String> {
    hostcalls::get_property(path.to_vec())
        .ok()
        .flatten()
        .and_then(|b| String::from_utf8(b).ok())
}

/// Sends a call whose answer comes back to the calling context's `on_http_call_response`
/// with the returned token (a root context's scrape). None if the host refused it.
pub fn dispatch_call(cluster: &str, headers: &[(String, Vec<u8>)], timeout_ms: u64) -> Option<u32> {
    hostcalls::dispatch_http_call(
        cluster,
        text(headers),
        None,
        Vec::new(),
        Duration::from_millis(timeout_ms),
    )
    .ok()
}

fn text(pairs: &[(String, Vec<u8>)]) -> Vec<(&str, &str)> {
    pairs
        .iter()
        .filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.as_str(), v)))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------------

/// Defines a metric; None if the host refused (the metric is then simply not recorded).
pub fn metric(kind: MetricType, name: &str) -> Option<u32> {
    let mut id = 0u32;
    // SAFETY: `name` is live for the call; the host writes one u32 into `id`.
    let status = unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) };
    (status == OK).then_some(id)
}

pub fn metric_add(id: u32, offset: i64) {
    // SAFETY: plain value arguments.
    unsafe {
        proxy_increment_metric(id, offset);
    }
}

pub fn metric_set(id: u32, value: u64) {
    // SAFETY: plain value arguments.
    unsafe {
        proxy_record_metric(id, value);
    }
}

// ---------------------------------------------------------------------------------------------
// Paused requests (admission)
// ---------------------------------------------------------------------------------------------

/// Makes the HTTP context `context_id` of this VM the target of the host calls that follow
/// (headers, local replies, resuming) within the current callback. False if the host refused
/// (the stream is gone).
pub fn set_effective_context(context_id: u32) -> bool {
    // SAFETY: a plain value argument.
    unsafe { proxy_set_effective_context(context_id) == OK }
}

/// Resumes the effective context's paused request (after [`set_effective_context`]).
pub fn resume_request() -> bool {
    // Stream type 0: the request (proxy-wasm ABI `WasmStreamType::Request`).
    // SAFETY: a plain value argument.
    unsafe { proxy_continue_stream(0) == OK }
}
