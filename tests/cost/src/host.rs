//! The host side of the proxy-wasm ABI 0.2.1 (and the few WASI functions a `wasm32-wasip1`
//! module imports), in memory, counting every call and every byte that crosses the boundary.
//!
//! Why: Envoy's host is what the module talks to in production, but it cannot count what the
//! module executes. This host answers the same calls with the same statuses and memory
//! conventions (a buffer returned to the module is allocated in it through its exported
//! `proxy_on_memory_allocate`, as proxy-wasm-cpp-host does), so the module runs the same code
//! paths, and wasmtime's fuel counts the instructions exactly.
//!
//! Bytes "in" are payload bytes the host writes into the module's memory (header maps, buffers,
//! shared data, properties, random bytes); bytes "out" are payload bytes it reads from the
//! module (keys, values, bodies, log lines). The 4- and 8-byte out-parameters are not counted.

use std::collections::BTreeMap;
use wasmtime::{bail, Caller, Extern, Linker, Memory, Module, Result};

/// proxy-wasm statuses.
pub const OK: i32 = 0;
pub const NOT_FOUND: i32 = 1;
pub const BAD_ARGUMENT: i32 = 2;
pub const CAS_MISMATCH: i32 = 8;

/// Map types (`proxy_wasm::types::MapType`).
pub const MAP_REQUEST_HEADERS: usize = 0;
pub const MAP_REQUEST_TRAILERS: usize = 1;
pub const MAP_RESPONSE_HEADERS: usize = 2;
pub const MAP_CALL_RESPONSE_HEADERS: usize = 6;
const MAP_KINDS: usize = 8;

/// Buffer types (`proxy_wasm::types::BufferType`).
pub const BUF_REQUEST_BODY: usize = 0;
pub const BUF_RESPONSE_BODY: usize = 1;
pub const BUF_CALL_RESPONSE_BODY: usize = 4;
pub const BUF_VM_CONFIGURATION: usize = 6;
pub const BUF_PLUGIN_CONFIGURATION: usize = 7;
const BUF_KINDS: usize = 9;

pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// A `proxy_http_call` the module made; the harness answers it.
#[derive(Debug, Clone)]
pub struct HttpCall {
    pub token: u32,
    pub cluster: String,
    pub headers: Pairs,
    pub body: Vec<u8>,
}

/// A `proxy_send_local_response`.
#[derive(Debug, Clone)]
pub struct LocalResponse {
    pub status: u32,
    pub headers: Pairs,
    pub body: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct Metric {
    pub name: String,
    pub kind: u32,
    pub value: i64,
}

/// What crossed the boundary: host calls by name, payload bytes in and out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Traffic {
    pub calls: BTreeMap<&'static str, u64>,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

impl Traffic {
    pub fn total_calls(&self) -> u64 {
        self.calls.values().sum()
    }

    /// `self - earlier` (counters only grow).
    pub fn since(&self, earlier: &Traffic) -> Traffic {
        let mut calls = BTreeMap::new();
        for (k, v) in &self.calls {
            let d = v - earlier.calls.get(k).copied().unwrap_or(0);
            if d > 0 {
                calls.insert(*k, d);
            }
        }
        Traffic {
            calls,
            bytes_in: self.bytes_in - earlier.bytes_in,
            bytes_out: self.bytes_out - earlier.bytes_out,
        }
    }
}

/// The host's whole state, owned by the wasmtime `Store`.
pub struct Host {
    pub maps: [Pairs; MAP_KINDS],
    pub buffers: [Vec<u8>; BUF_KINDS],
    /// key → (value, cas); cas starts at 1 and grows on every write of any key.
    pub shared: BTreeMap<Vec<u8>, (Vec<u8>, u32)>,
    next_cas: u32,
    /// NUL-separated path → value.
    pub properties: BTreeMap<Vec<u8>, Vec<u8>>,
    pub tick_period_ms: u32,
    /// The controlled clock (wall and monotonic alike).
    pub now_ns: u64,
    pub metrics: Vec<Metric>,
    pub calls: Vec<HttpCall>,
    next_token: u32,
    pub local_response: Option<LocalResponse>,
    pub logs: Vec<(u32, String)>,
    /// `proxy_continue_stream` / `proxy_close_stream` (stream type, continue?).
    pub stream_ops: Vec<(u32, bool)>,
    pub traffic: Traffic,
    rng: u64,
    /// Envoy's log level for the plugin (info).
    pub log_level: u32,
    /// Echo the module's log lines and WASI stdout/stderr to stderr.
    pub echo: bool,
    /// Sample wasm stacks now (`--profile`, see `vm::Profile`).
    pub sampling: bool,
    /// Sampled stacks (innermost function first) and how often each was seen.
    pub samples: BTreeMap<Vec<String>, u64>,
}

impl Default for Host {
    fn default() -> Self {
        Host {
            maps: Default::default(),
            buffers: Default::default(),
            shared: BTreeMap::new(),
            next_cas: 1,
            properties: BTreeMap::new(),
            tick_period_ms: 0,
            // 2026-01-01T00:00:00Z
            now_ns: 1_767_225_600_000_000_000,
            metrics: Vec::new(),
            calls: Vec::new(),
            next_token: 1,
            sampling: false,
            samples: BTreeMap::new(),
            local_response: None,
            logs: Vec::new(),
            stream_ops: Vec::new(),
            traffic: Traffic::default(),
            rng: 0x9E37_79B9_7F4A_7C15,
            log_level: 2,
            echo: false,
        }
    }
}

impl Host {
    pub fn advance_ms(&mut self, ms: u64) {
        self.now_ns += ms * 1_000_000;
    }

    /// Writes a shared-data value as the host's set does (the next CAS token).
    pub fn put_shared(&mut self, key: &[u8], value: Vec<u8>) {
        let cas = self.next_cas;
        self.next_cas += 1;
        self.shared.insert(key.to_vec(), (value, cas));
    }

    pub fn set_map(&mut self, kind: usize, pairs: &[(&str, &str)]) {
        self.maps[kind] = pairs
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect();
    }

    pub fn header(&self, kind: usize, name: &str) -> Option<&[u8]> {
        self.maps[kind]
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v.as_slice())
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*: deterministic on every run.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// proxy-wasm's header map wire format: count, (key len, value len)*, then key\0value\0 each.
pub fn serialize_map(pairs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

pub fn deserialize_map(bytes: &[u8]) -> Result<Pairs> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let u32_at = |at: usize| -> Result<usize> {
        match bytes.get(at..at + 4) {
            Some(b) => Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize),
            None => bail!("header map truncated at {at}"),
        }
    };
    let n = u32_at(0)?;
    let mut p = 4 + n * 8;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let kl = u32_at(4 + i * 8)?;
        let vl = u32_at(8 + i * 8)?;
        let Some(k) = bytes.get(p..p + kl) else {
            bail!("header map key {i} out of bounds")
        };
        p += kl + 1;
        let Some(v) = bytes.get(p..p + vl) else {
            bail!("header map value {i} out of bounds")
        };
        p += vl + 1;
        out.push((k.to_vec(), v.to_vec()));
    }
    Ok(out)
}

fn count(caller: &mut Caller<'_, Host>, name: &'static str) {
    *caller.data_mut().traffic.calls.entry(name).or_insert(0) += 1;
    if caller.data().echo && name != "proxy_log" {
        // Every host call with the fuel used so far (COMPUTEFLUX_COST_ECHO=1): the cost of
        // the code between two calls, exactly, without touching the module.
        let used = crate::vm::FUEL.saturating_sub(caller.get_fuel().unwrap_or(0));
        eprintln!("[host {name} fuel {used}]");
    }
}

fn memory(caller: &mut Caller<'_, Host>) -> Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => bail!("module exports no memory"),
    }
}

/// Reads `len` bytes at `ptr` from the module (counted as bytes out).
fn read(caller: &mut Caller<'_, Host>, ptr: i32, len: i32) -> Result<Vec<u8>> {
    let mem = memory(caller)?;
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    let Some(bytes) = mem.data(&*caller).get(ptr..ptr + len) else {
        bail!("read of {len} bytes at {ptr} outside memory")
    };
    let bytes = bytes.to_vec();
    caller.data_mut().traffic.bytes_out += len as u64;
    Ok(bytes)
}

fn write_raw(caller: &mut Caller<'_, Host>, ptr: i32, bytes: &[u8]) -> Result<()> {
    let mem = memory(caller)?;
    let ptr = ptr as u32 as usize;
    let Some(dst) = mem.data_mut(&mut *caller).get_mut(ptr..ptr + bytes.len()) else {
        bail!("write of {} bytes at {ptr} outside memory", bytes.len())
    };
    dst.copy_from_slice(bytes);
    Ok(())
}

fn write_u32(caller: &mut Caller<'_, Host>, ptr: i32, v: u32) -> Result<()> {
    write_raw(caller, ptr, &v.to_le_bytes())
}

fn write_u64(caller: &mut Caller<'_, Host>, ptr: i32, v: u64) -> Result<()> {
    write_raw(caller, ptr, &v.to_le_bytes())
}

/// Copies `data` into a buffer the module allocates (`proxy_on_memory_allocate`) and writes its
/// address and size to the out-parameters (counted as bytes in). Empty data: a null pointer.
fn give(caller: &mut Caller<'_, Host>, data: &[u8], ptr_out: i32, size_out: i32) -> Result<()> {
    let addr = if data.is_empty() {
        0
    } else {
        let Some(Extern::Func(alloc)) = caller.get_export("proxy_on_memory_allocate") else {
            bail!("module exports no proxy_on_memory_allocate")
        };
        let alloc = alloc.typed::<i32, i32>(&*caller)?;
        let addr = alloc.call(&mut *caller, data.len() as i32)?;
        if addr == 0 {
            bail!("proxy_on_memory_allocate({}) returned null", data.len());
        }
        write_raw(caller, addr, data)?;
        caller.data_mut().traffic.bytes_in += data.len() as u64;
        addr
    };
    write_u32(caller, ptr_out, addr as u32)?;
    write_u32(caller, size_out, data.len() as u32)
}

fn map_kind(kind: i32) -> Option<usize> {
    usize::try_from(kind).ok().filter(|k| *k < MAP_KINDS)
}

fn lower(bytes: Vec<u8>) -> Vec<u8> {
    bytes.to_ascii_lowercase()
}

/// Defines every host function the modules import; any other import traps when called.
pub fn link(linker: &mut Linker<Host>, module: &Module) -> Result<()> {
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut c: Caller<'_, Host>, level: i32, ptr: i32, len: i32| -> Result<i32> {
            count(&mut c, "proxy_log");
            let msg = read(&mut c, ptr, len)?;
            let msg = String::from_utf8_lossy(&msg).into_owned();
            if c.data().echo {
                // The fuel used so far: log lines placed around a piece of code give its
                // exact cost (COMPUTEFLUX_COST_ECHO=1, see docs/performance.md).
                let used = crate::vm::FUEL.saturating_sub(c.get_fuel().unwrap_or(0));
                eprintln!("[wasm log {level} fuel {used}] {msg}");
            }
            c.data_mut().logs.push((level as u32, msg));
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_log_level",
        |mut c: Caller<'_, Host>, out: i32| -> Result<i32> {
            count(&mut c, "proxy_get_log_level");
            let level = c.data().log_level;
            write_u32(&mut c, out, level)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut c: Caller<'_, Host>, out: i32| -> Result<i32> {
            count(&mut c, "proxy_get_current_time_nanoseconds");
            let now = c.data().now_ns;
            write_u64(&mut c, out, now)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: Caller<'_, Host>, period: i32| -> Result<i32> {
            count(&mut c, "proxy_set_tick_period_milliseconds");
            c.data_mut().tick_period_ms = period as u32;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, Host>,
         kind: i32,
         start: i32,
         max: i32,
         ptr_out: i32,
         size_out: i32|
         -> Result<i32> {
            count(&mut c, "proxy_get_buffer_bytes");
            let Some(buf) = usize::try_from(kind)
                .ok()
                .and_then(|k| c.data().buffers.get(k))
            else {
                return Ok(BAD_ARGUMENT);
            };
            let (start, max) = (start as u32 as usize, max as u32 as usize);
            let end = start.saturating_add(max).min(buf.len());
            let data = buf.get(start.min(end)..end).unwrap_or(&[]).to_vec();
            give(&mut c, &data, ptr_out, size_out)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |mut c: Caller<'_, Host>,
         kind: i32,
         start: i32,
         size: i32,
         ptr: i32,
         len: i32|
         -> Result<i32> {
            count(&mut c, "proxy_set_buffer_bytes");
            let data = read(&mut c, ptr, len)?;
            let Some(buf) = usize::try_from(kind)
                .ok()
                .and_then(|k| c.data_mut().buffers.get_mut(k))
            else {
                return Ok(BAD_ARGUMENT);
            };
            let start = (start as u32 as usize).min(buf.len());
            let end = start.saturating_add(size as u32 as usize).min(buf.len());
            buf.splice(start..end, data);
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, Host>, kind: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            count(&mut c, "proxy_get_header_map_pairs");
            let Some(k) = map_kind(kind) else {
                return Ok(BAD_ARGUMENT);
            };
            let data = serialize_map(&c.data().maps[k]);
            give(&mut c, &data, ptr_out, size_out)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut c: Caller<'_, Host>, kind: i32, ptr: i32, len: i32| -> Result<i32> {
            count(&mut c, "proxy_set_header_map_pairs");
            let data = read(&mut c, ptr, len)?;
            let Some(k) = map_kind(kind) else {
                return Ok(BAD_ARGUMENT);
            };
            c.data_mut().maps[k] = deserialize_map(&data)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: Caller<'_, Host>,
         kind: i32,
         kptr: i32,
         klen: i32,
         ptr_out: i32,
         size_out: i32|
         -> Result<i32> {
            count(&mut c, "proxy_get_header_map_value");
            let key = read(&mut c, kptr, klen)?;
            let Some(k) = map_kind(kind) else {
                return Ok(BAD_ARGUMENT);
            };
            let value = c.data().maps[k]
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(&key))
                .map(|(_, v)| v.clone());
            match value {
                Some(v) => {
                    give(&mut c, &v, ptr_out, size_out)?;
                    Ok(OK)
                }
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_replace_header_map_value",
        |mut c: Caller<'_, Host>,
         kind: i32,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32|
         -> Result<i32> {
            count(&mut c, "proxy_replace_header_map_value");
            let key = lower(read(&mut c, kptr, klen)?);
            let value = read(&mut c, vptr, vlen)?;
            let Some(k) = map_kind(kind) else {
                return Ok(BAD_ARGUMENT);
            };
            let map = &mut c.data_mut().maps[k];
            map.retain(|(n, _)| !n.eq_ignore_ascii_case(&key));
            map.push((key, value));
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_add_header_map_value",
        |mut c: Caller<'_, Host>,
         kind: i32,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32|
         -> Result<i32> {
            count(&mut c, "proxy_add_header_map_value");
            let key = lower(read(&mut c, kptr, klen)?);
            let value = read(&mut c, vptr, vlen)?;
            let Some(k) = map_kind(kind) else {
                return Ok(BAD_ARGUMENT);
            };
            c.data_mut().maps[k].push((key, value));
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, Host>, kind: i32, kptr: i32, klen: i32| -> Result<i32> {
            count(&mut c, "proxy_remove_header_map_value");
            let key = read(&mut c, kptr, klen)?;
            let Some(k) = map_kind(kind) else {
                return Ok(BAD_ARGUMENT);
            };
            c.data_mut().maps[k].retain(|(n, _)| !n.eq_ignore_ascii_case(&key));
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: Caller<'_, Host>,
         pptr: i32,
         plen: i32,
         ptr_out: i32,
         size_out: i32|
         -> Result<i32> {
            count(&mut c, "proxy_get_property");
            let path = read(&mut c, pptr, plen)?;
            match c.data().properties.get(&path).cloned() {
                Some(v) => {
                    give(&mut c, &v, ptr_out, size_out)?;
                    Ok(OK)
                }
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: Caller<'_, Host>, pptr: i32, plen: i32, vptr: i32, vlen: i32| -> Result<i32> {
            count(&mut c, "proxy_set_property");
            let path = read(&mut c, pptr, plen)?;
            let value = read(&mut c, vptr, vlen)?;
            c.data_mut().properties.insert(path, value);
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: Caller<'_, Host>,
         kptr: i32,
         klen: i32,
         ptr_out: i32,
         size_out: i32,
         cas_out: i32|
         -> Result<i32> {
            count(&mut c, "proxy_get_shared_data");
            let key = read(&mut c, kptr, klen)?;
            if c.data().echo {
                eprintln!(
                    "[host   get {} {}]",
                    String::from_utf8_lossy(&key),
                    c.data().shared.get(&key).map_or(0, |v| v.0.len())
                );
            }
            match c.data().shared.get(&key).cloned() {
                Some((value, cas)) => {
                    give(&mut c, &value, ptr_out, size_out)?;
                    write_u32(&mut c, cas_out, cas)?;
                    Ok(OK)
                }
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: Caller<'_, Host>,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32,
         cas: i32|
         -> Result<i32> {
            count(&mut c, "proxy_set_shared_data");
            let key = read(&mut c, kptr, klen)?;
            let value = read(&mut c, vptr, vlen)?;
            if c.data().echo {
                eprintln!(
                    "[host   set {} {}]",
                    String::from_utf8_lossy(&key),
                    value.len()
                );
            }
            let host = c.data_mut();
            let cas = cas as u32;
            // Envoy: a non-zero cas must match the key's current one (an absent key matches any).
            if cas != 0 {
                if let Some((_, current)) = host.shared.get(&key) {
                    if *current != cas {
                        return Ok(CAS_MISMATCH);
                    }
                }
            }
            let next = host.next_cas;
            host.next_cas += 1;
            host.shared.insert(key, (value, next));
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: Caller<'_, Host>,
         status: i32,
         dptr: i32,
         dlen: i32,
         bptr: i32,
         blen: i32,
         hptr: i32,
         hlen: i32,
         _grpc: i32|
         -> Result<i32> {
            count(&mut c, "proxy_send_local_response");
            let _details = read(&mut c, dptr, dlen)?;
            let body = read(&mut c, bptr, blen)?;
            let headers = deserialize_map(&read(&mut c, hptr, hlen)?)?;
            c.data_mut().local_response = Some(LocalResponse {
                status: status as u32,
                headers,
                body,
            });
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Caller<'_, Host>,
         uptr: i32,
         ulen: i32,
         hptr: i32,
         hlen: i32,
         bptr: i32,
         blen: i32,
         tptr: i32,
         tlen: i32,
         _timeout_ms: i32,
         token_out: i32|
         -> Result<i32> {
            count(&mut c, "proxy_http_call");
            let cluster = String::from_utf8_lossy(&read(&mut c, uptr, ulen)?).into_owned();
            let headers = deserialize_map(&read(&mut c, hptr, hlen)?)?;
            let body = read(&mut c, bptr, blen)?;
            let _trailers = read(&mut c, tptr, tlen)?;
            let host = c.data_mut();
            let token = host.next_token;
            host.next_token += 1;
            host.calls.push(HttpCall {
                token,
                cluster,
                headers,
                body,
            });
            write_u32(&mut c, token_out, token)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_continue_stream",
        |mut c: Caller<'_, Host>, stream: i32| -> Result<i32> {
            count(&mut c, "proxy_continue_stream");
            c.data_mut().stream_ops.push((stream as u32, true));
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_close_stream",
        |mut c: Caller<'_, Host>, stream: i32| -> Result<i32> {
            count(&mut c, "proxy_close_stream");
            c.data_mut().stream_ops.push((stream as u32, false));
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_effective_context",
        |mut c: Caller<'_, Host>, _ctx: i32| -> Result<i32> {
            count(&mut c, "proxy_set_effective_context");
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_done",
        |mut c: Caller<'_, Host>| -> Result<i32> {
            count(&mut c, "proxy_done");
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_status",
        |mut c: Caller<'_, Host>, code_out: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            count(&mut c, "proxy_get_status");
            write_u32(&mut c, code_out, 0)?;
            give(&mut c, &[], ptr_out, size_out)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Caller<'_, Host>, kind: i32, nptr: i32, nlen: i32, id_out: i32| -> Result<i32> {
            count(&mut c, "proxy_define_metric");
            let name = String::from_utf8_lossy(&read(&mut c, nptr, nlen)?).into_owned();
            let host = c.data_mut();
            let id = match host.metrics.iter().position(|m| m.name == name) {
                Some(i) => i,
                None => {
                    host.metrics.push(Metric {
                        name,
                        kind: kind as u32,
                        value: 0,
                    });
                    host.metrics.len() - 1
                }
            };
            write_u32(&mut c, id_out, id as u32)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |mut c: Caller<'_, Host>, id: i32, offset: i64| -> Result<i32> {
            count(&mut c, "proxy_increment_metric");
            match c.data_mut().metrics.get_mut(id as u32 as usize) {
                Some(m) if m.kind != 2 => {
                    m.value = m.value.saturating_add(offset);
                    Ok(OK)
                }
                Some(_) => Ok(BAD_ARGUMENT),
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_record_metric",
        |mut c: Caller<'_, Host>, id: i32, value: i64| -> Result<i32> {
            count(&mut c, "proxy_record_metric");
            match c.data_mut().metrics.get_mut(id as u32 as usize) {
                Some(m) => {
                    m.value = value;
                    Ok(OK)
                }
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_metric",
        |mut c: Caller<'_, Host>, id: i32, out: i32| -> Result<i32> {
            count(&mut c, "proxy_get_metric");
            let Some(v) = c.data().metrics.get(id as u32 as usize).map(|m| m.value) else {
                return Ok(NOT_FOUND);
            };
            write_u64(&mut c, out, v as u64)?;
            Ok(OK)
        },
    )?;

    // WASI preview 1: what Rust's std on wasm32-wasip1 imports, answered minimally.
    const WASI: &str = "wasi_snapshot_preview1";
    linker.func_wrap(
        WASI,
        "clock_time_get",
        |mut c: Caller<'_, Host>, _id: i32, _precision: i64, out: i32| -> Result<i32> {
            count(&mut c, "wasi:clock_time_get");
            let now = c.data().now_ns;
            write_u64(&mut c, out, now)?;
            Ok(0)
        },
    )?;
    linker.func_wrap(
        WASI,
        "random_get",
        |mut c: Caller<'_, Host>, ptr: i32, len: i32| -> Result<i32> {
            count(&mut c, "wasi:random_get");
            let mut bytes = Vec::with_capacity(len as u32 as usize);
            while bytes.len() < len as u32 as usize {
                bytes.extend_from_slice(&c.data_mut().next_random().to_le_bytes());
            }
            bytes.truncate(len as u32 as usize);
            write_raw(&mut c, ptr, &bytes)?;
            c.data_mut().traffic.bytes_in += bytes.len() as u64;
            Ok(0)
        },
    )?;
    for name in ["environ_sizes_get", "args_sizes_get"] {
        linker.func_wrap(
            WASI,
            name,
            move |mut c: Caller<'_, Host>, count_out: i32, size_out: i32| -> Result<i32> {
                count(&mut c, "wasi:sizes_get");
                write_u32(&mut c, count_out, 0)?;
                write_u32(&mut c, size_out, 0)?;
                Ok(0)
            },
        )?;
    }
    for name in ["environ_get", "args_get"] {
        linker.func_wrap(
            WASI,
            name,
            |mut c: Caller<'_, Host>, _a: i32, _b: i32| -> Result<i32> {
                count(&mut c, "wasi:get");
                Ok(0)
            },
        )?;
    }
    linker.func_wrap(
        WASI,
        "fd_write",
        |mut c: Caller<'_, Host>, fd: i32, iovs: i32, n: i32, written_out: i32| -> Result<i32> {
            count(&mut c, "wasi:fd_write");
            let mut total = 0u32;
            for i in 0..n {
                let iov = read(&mut c, iovs + i * 8, 8)?;
                c.data_mut().traffic.bytes_out -= 8;
                let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
                let data = read(&mut c, ptr, len)?;
                if c.data().echo {
                    eprint!("[wasm fd {fd}] {}", String::from_utf8_lossy(&data));
                }
                total += len as u32;
            }
            write_u32(&mut c, written_out, total)?;
            Ok(0)
        },
    )?;
    linker.func_wrap(
        WASI,
        "proc_exit",
        |_c: Caller<'_, Host>, code: i32| -> Result<()> { bail!("proc_exit({code})") },
    )?;
    linker.func_wrap(
        WASI,
        "sched_yield",
        |mut c: Caller<'_, Host>| -> Result<i32> {
            count(&mut c, "wasi:sched_yield");
            Ok(0)
        },
    )?;
    linker.define_unknown_imports_as_traps(module)?;
    Ok(())
}
