//! Complete request lifecycles, driven as Envoy drives a Wasm HTTP filter, and measured.
//!
//! Each suite starts a fresh VM (root context, `on_vm_start`, `on_configure`), warms it with a
//! few ordinary requests (so that one-time work — the endpoint table's creation, lazy
//! initialisation, the allocator's first growth — is not charged to a scenario), then runs the
//! measured scenarios in a fixed order on a controlled clock. Everything is deterministic: the
//! same module and configuration give the same counts on every run and machine.
//!
//! Envoy's behaviour reproduced (see /work/shared/ENVOY-NOTES.md and the SDK):
//! - request headers with `end_of_stream` false when a body follows; while the filter pauses,
//!   each body callback sees the whole body buffered so far (chunks of [`CHUNK_BYTES`]); once it
//!   continues, each later callback sees one chunk;
//! - the upstream is the cluster named in the routing header (checked: a scenario whose request
//!   was not routed is an error);
//! - a filter-dispatched call (failover) is answered by the harness; the module's local reply
//!   then passes through its own response callbacks, as Envoy's local replies do;
//! - `on_log`, `on_done`, `on_delete` end every request.

use crate::host::{self, Host, Traffic};
use crate::vm::{Fuel, Loaded, Vm};
use wasmtime::{bail, Result};

pub const ROOT: u32 = 1;
/// Envoy hands a buffered body to the filter in pieces of about this size.
pub const CHUNK_BYTES: usize = 16 * 1024;
pub const ROUTING_HEADER: &str = "x-computeflux-cluster";

/// The measured scenarios, in the order they run.
pub const SCENARIOS: [&str; 8] = [
    "new_session",
    "affinity_hit",
    "body_32k",
    "streamed_usage",
    "multipart",
    "failover",
    "new_session_prefix",
    "affinity_hit_prefix",
];

/// The system prompt of the `*_prefix` scenarios, in bytes: an application's instructions,
/// long enough to make a prefix key (`tuning.prefix_min_bytes`, 1024 by default), as issue 20's
/// benchmark sends (3 000 tokens there; 3 000 bytes here).
pub const PREFIX_SYSTEM_BYTES: usize = 3_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Module {
    Filter,
    Floor,
    /// The floor module parsing the body for its `model` (`"read_model": true`).
    FloorModel,
}

impl Module {
    pub fn name(self) -> &'static str {
        match self {
            Module::Filter => "filter",
            Module::Floor => "floor",
            Module::FloorModel => "floor_model",
        }
    }
}

/// The filter's configuration switches the harness varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setup {
    /// Endpoints configured, or with `pool`, the hosts the pool's membership holds.
    pub endpoints: usize,
    pub usage_accounting: bool,
    pub quota_aware: bool,
    pub prefix_placement: bool,
    /// Every endpoint scraped (`metrics`, vLLM format) at this interval; see [`crate::fleet`].
    pub scrape_interval_ms: Option<u64>,
    /// One `"pool": true` entry whose membership holds `endpoints` hosts (see [`crate::fleet`]).
    pub pool: bool,
}

impl Setup {
    pub fn new(endpoints: usize) -> Setup {
        Setup {
            endpoints,
            usage_accounting: true,
            quota_aware: true,
            prefix_placement: true,
            scrape_interval_ms: None,
            pool: false,
        }
    }
}

/// The plugin configuration of `envoy/envoy.yaml`, with `n` endpoints.
pub fn filter_config(s: Setup) -> String {
    let metrics = match s.scrape_interval_ms {
        Some(ms) => format!(r#", "metrics": {{"format": "vllm", "interval_ms": {ms}}}"#),
        None => String::new(),
    };
    let endpoints: Vec<String> = if s.pool {
        vec![format!(
            r#"{{"name": "{}", "cluster": "{}", "pool": true, "models": ["llama-3-8b", "qwen-7b", "whisper-1"]{metrics}}}"#,
            crate::fleet::POOL,
            crate::fleet::POOL_CLUSTER
        )]
    } else {
        (0..s.endpoints)
            .map(|i| {
                let mut models = vec!["\"llama-3-8b\""];
                if i % 2 == 0 {
                    models.push("\"qwen-7b\"");
                }
                if i % 4 == 0 {
                    models.push("\"whisper-1\"");
                }
                format!(
                    r#"{{"name": "gpu-{i}", "cluster": "gpu_{i}", "models": [{}]{metrics}}}"#,
                    models.join(", ")
                )
            })
            .collect()
    };
    format!(
        r#"{{
  "endpoints": [
    {}
  ],
  "affinity_ttl_ms": 300000,
  "ewma_alpha": 0.3,
  "cold_start_samples": 20,
  "half_open_probes": 3,
  "max_attempts": 3,
  "max_body_bytes": 8388608,
  "usage_accounting": {},
  "quota_aware": {},
  "prefix_placement": {}
}}"#,
        endpoints.join(",\n    "),
        s.usage_accounting,
        s.quota_aware,
        s.prefix_placement
    )
}

pub fn floor_config() -> String {
    r#"{"cluster": "gpu_0"}"#.to_string()
}

/// The floor reading the body's `model` before it routes.
pub fn floor_model_config() -> String {
    r#"{"cluster": "gpu_0", "read_model": true}"#.to_string()
}

/// One measured piece of work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    pub name: String,
    /// Instructions (fuel) executed by the module.
    pub instructions: u64,
    pub traffic: Traffic,
    /// Instructions per callback.
    pub by_callback: Fuel,
    /// What the client got and from where, for the reader ("200 gpu_3").
    pub outcome: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suite {
    pub module: Module,
    pub setup: Setup,
    pub startup: Measured,
    pub tick: Measured,
    pub requests: Vec<Measured>,
    /// Scraping and pool figures, shared data, metrics defined (printed, not budgeted).
    pub fleet: crate::fleet::Figures,
}

impl Suite {
    pub fn request(&self, name: &str) -> Option<&Measured> {
        self.requests.iter().find(|m| m.name == name)
    }
}

pub(crate) struct Request {
    path: &'static str,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

#[derive(Clone)]
pub(crate) struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    chunks: Vec<Vec<u8>>,
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub(crate) fn chat_request(session: Option<&str>, body: String) -> Request {
    let mut headers = owned(&[
        ("content-type", "application/json"),
        ("authorization", "Bearer sk-test-0123456789"),
        ("user-agent", "OpenAI/Python 1.99.0"),
        ("accept", "application/json"),
    ]);
    if let Some(s) = session {
        headers.push(("x-session-id".into(), s.into()));
    }
    Request {
        path: "/v1/chat/completions",
        headers,
        body: body.into_bytes(),
    }
}

pub(crate) fn messages_body(turns: usize, filler_bytes: usize, stream: bool) -> String {
    with_system(
        r#"{"role":"system","content":"You are a helpful assistant."}"#.to_string(),
        turns,
        filler_bytes,
        stream,
    )
}

/// Applications with long instructions whose new sessions the warm-up sends (more than the
/// 32 prefix keys `computeflux/sessions` holds), so that a measured new session of an
/// application reads, updates and writes a full count table, as in steady traffic.
pub const WARM_PREFIX_APPS: usize = 40;

/// [`messages_body`] whose system message is `bytes` long as sent (an application's
/// instructions: a prefix key when at least `tuning.prefix_min_bytes`).
fn prefix_body(turns: usize, bytes: usize) -> String {
    app_body("", turns, bytes)
}

/// [`prefix_body`] of the application named `app` (its instructions start with its name).
fn app_body(app: &str, turns: usize, bytes: usize) -> String {
    let bare = r#"{"role":"system","content":""}"#.len();
    let text: String = app
        .chars()
        .chain(
            "You are the support assistant of Example Corp. Follow the policy. "
                .chars()
                .cycle(),
        )
        .take(bytes.saturating_sub(bare))
        .collect();
    with_system(
        format!(r#"{{"role":"system","content":"{text}"}}"#),
        turns,
        0,
        false,
    )
}

fn with_system(system: String, turns: usize, filler_bytes: usize, stream: bool) -> String {
    let mut msgs = vec![system];
    for t in 0..turns {
        if t > 0 {
            msgs.push(format!(
                r#"{{"role":"assistant","content":"Answer number {t}: the sky is blue because of Rayleigh scattering."}}"#
            ));
        }
        msgs.push(format!(
            r#"{{"role":"user","content":"Question number {t}: why is the sky blue?"}}"#
        ));
    }
    if filler_bytes > 0 {
        let filler: String = "lorem ipsum dolor sit amet "
            .chars()
            .cycle()
            .take(filler_bytes)
            .collect();
        msgs.push(format!(r#"{{"role":"user","content":"{filler}"}}"#));
    }
    let stream = if stream {
        r#","stream":true,"stream_options":{"include_usage":true}"#
    } else {
        ""
    };
    format!(
        r#"{{"model":"llama-3-8b","messages":[{}],"temperature":0.7,"max_tokens":256{stream}}}"#,
        msgs.join(",")
    )
}

/// A body of exactly `bytes` bytes (the filler is sized to fit).
fn sized_body(bytes: usize) -> String {
    let bare = messages_body(1, 0, false).len() + r#",{"role":"user","content":""}"#.len();
    messages_body(1, bytes.saturating_sub(bare), false)
}

fn quota_headers() -> Vec<(String, String)> {
    owned(&[
        ("x-ratelimit-limit-requests", "10000"),
        ("x-ratelimit-remaining-requests", "9993"),
        ("x-ratelimit-reset-requests", "42ms"),
        ("x-ratelimit-limit-tokens", "2000000"),
        ("x-ratelimit-remaining-tokens", "1998765"),
        ("x-ratelimit-reset-tokens", "37ms"),
    ])
}

pub(crate) fn json_answer(cached_tokens: u64) -> Answer {
    let body = format!(
        r#"{{"id":"chatcmpl-abc123","object":"chat.completion","created":1767225600,"model":"llama-3-8b","choices":[{{"index":0,"message":{{"role":"assistant","content":"The sky is blue because of Rayleigh scattering."}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":120,"completion_tokens":12,"total_tokens":132,"prompt_tokens_details":{{"cached_tokens":{cached_tokens}}}}}}}"#
    );
    let mut headers = owned(&[
        ("content-type", "application/json"),
        ("date", "Thu, 01 Jan 2026 00:00:00 GMT"),
        ("server", "uvicorn"),
        ("x-request-id", "req-0123456789abcdef"),
    ]);
    headers.push(("content-length".into(), body.len().to_string()));
    headers.extend(quota_headers());
    Answer {
        status: 200,
        headers,
        chunks: vec![body.into_bytes()],
    }
}

fn sse_answer(events: usize) -> Answer {
    let mut chunks = Vec::new();
    for i in 0..events {
        chunks.push(format!(
            "data: {{\"id\":\"chatcmpl-abc123\",\"object\":\"chat.completion.chunk\",\"created\":1767225600,\"model\":\"llama-3-8b\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{i} \"}},\"finish_reason\":null}}]}}\n\n"
        ).into_bytes());
    }
    chunks.push(
        b"data: {\"id\":\"chatcmpl-abc123\",\"object\":\"chat.completion.chunk\",\"created\":1767225600,\"model\":\"llama-3-8b\",\"choices\":[],\"usage\":{\"prompt_tokens\":120,\"completion_tokens\":16,\"total_tokens\":136,\"prompt_tokens_details\":{\"cached_tokens\":96}}}\n\ndata: [DONE]\n\n"
            .to_vec(),
    );
    let mut headers = owned(&[
        ("content-type", "text/event-stream"),
        ("date", "Thu, 01 Jan 2026 00:00:00 GMT"),
        ("server", "uvicorn"),
        ("x-request-id", "req-0123456789abcdef"),
    ]);
    headers.extend(quota_headers());
    Answer {
        status: 200,
        headers,
        chunks,
    }
}

fn rate_limited() -> Answer {
    let body = br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#.to_vec();
    let mut headers = owned(&[
        ("content-type", "application/json"),
        ("retry-after", "2"),
        ("x-ratelimit-limit-requests", "10000"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "2s"),
    ]);
    headers.push(("content-length".into(), body.len().to_string()));
    Answer {
        status: 429,
        headers,
        chunks: vec![body],
    }
}

fn multipart_request(file_bytes: usize) -> Request {
    let boundary = "----computefluxcostboundary7MA4YWxkTrZu0gW";
    let mut body = Vec::new();
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"response_format\"\r\n\r\njson\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"speech.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend((0..file_bytes).map(|i| (i * 131 % 251) as u8));
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    Request {
        path: "/v1/audio/transcriptions",
        headers: vec![
            (
                "content-type".into(),
                format!("multipart/form-data; boundary={boundary}"),
            ),
            ("authorization".into(), "Bearer sk-test-0123456789".into()),
            ("user-agent".into(), "OpenAI/Python 1.99.0".into()),
        ],
        body,
    }
}

fn transcription_answer() -> Answer {
    let body = br#"{"text":"The quick brown fox jumps over the lazy dog.","usage":{"type":"duration","seconds":3}}"#.to_vec();
    let mut headers = owned(&[("content-type", "application/json")]);
    headers.push(("content-length".into(), body.len().to_string()));
    Answer {
        status: 200,
        headers,
        chunks: vec![body],
    }
}

/// A fresh VM of `loaded`, configured, measured through warm-up and every scenario.
pub fn run_suite(loaded: &Loaded, module: Module, setup: Setup) -> Result<Suite> {
    run_suite_sampling(loaded, module, setup, None).map(|(suite, _)| suite)
}

/// [`run_suite`], sampling wasm stacks while the scenario `sampled` runs (`--profile`).
pub fn run_suite_sampling(
    loaded: &Loaded,
    module: Module,
    setup: Setup,
    sampled: Option<&str>,
) -> Result<(Suite, std::collections::BTreeMap<Vec<String>, u64>)> {
    run_suite_vm(loaded, module, setup, sampled).map(|(suite, samples, _)| (suite, samples))
}

/// [`run_suite_sampling`], handing back the VM to go on with (see `crate::fleet::departures`).
pub fn run_suite_vm(
    loaded: &Loaded,
    module: Module,
    setup: Setup,
    sampled: Option<&str>,
) -> Result<(Suite, std::collections::BTreeMap<Vec<String>, u64>, Vm)> {
    let config = match module {
        Module::Filter => filter_config(setup),
        Module::Floor => floor_config(),
        Module::FloorModel => floor_model_config(),
    };
    let mut vm = Vm::new(loaded)?;
    vm.host().echo = std::env::var_os("COMPUTEFLUX_COST_ECHO").is_some();
    vm.host().buffers[host::BUF_PLUGIN_CONFIGURATION] = config.into_bytes();
    if setup.pool && module == Module::Filter {
        // Every host known, as discovery leaves the membership (see `crate::fleet`).
        let hosts: Vec<usize> = (0..setup.endpoints).collect();
        vm.host().put_shared(
            crate::fleet::membership_key(crate::fleet::POOL).as_bytes(),
            crate::fleet::membership(&hosts, &[]),
        );
    }

    let startup = measure(&mut vm, "startup", |vm| {
        vm.context_create(ROOT, 0)?;
        if !vm.vm_start(ROOT)? {
            bail!("proxy_on_vm_start returned false");
        }
        if !vm.configure(ROOT)? {
            let logs: Vec<String> = vm.host().logs.iter().map(|(_, m)| m.clone()).collect();
            bail!("proxy_on_configure refused the configuration: {logs:?}");
        }
        Ok(String::new())
    })?;

    let mut ctx = ROOT + 1;
    let mut next = || {
        ctx += 1;
        ctx
    };
    // Warm-up: ordinary turns of distinct sessions, every endpoint's first answers.
    for i in 0..16 {
        let session = format!("warm-{i}");
        let req = chat_request(Some(&session), messages_body(1, 0, false));
        exchange(&mut vm, next(), &req, &[json_answer(0)])?;
        vm.host().advance_ms(100);
    }
    // New sessions of applications with long instructions: a full table of prefix counts
    // (when `prefix_placement` is on), the measured application's (`new_session_prefix`)
    // held in it with the last two sessions, the others with one.
    for i in 0..WARM_PREFIX_APPS + 2 {
        let session = format!("warm-app-{i}");
        let app = match i {
            n if n < WARM_PREFIX_APPS => format!("Application {n}. "),
            _ => String::new(),
        };
        let req = chat_request(Some(&session), app_body(&app, 1, PREFIX_SYSTEM_BYTES));
        exchange(&mut vm, next(), &req, &[json_answer(0)])?;
        vm.host().advance_ms(100);
    }
    vm.host().sampling = sampled == Some("tick");
    let tick = measure(&mut vm, "tick", |vm| {
        vm.tick(ROOT)?;
        Ok(String::new())
    })?;
    vm.host().sampling = false;
    let mut fleet = crate::fleet::Figures::default();
    if setup.scrape_interval_ms.is_some() {
        // The tick above took the lease and sent a scrape to every endpoint: their answers,
        // then a tick with nothing due.
        let (answers, traffic) = crate::fleet::answer_scrapes(&mut vm, ROOT)?;
        if answers.len() != setup.endpoints {
            bail!(
                "{} scrapes answered, {} endpoints",
                answers.len(),
                setup.endpoints
            );
        }
        fleet.answers = answers;
        fleet.answers_traffic = traffic;
        // One timer period on (the plugin's own, at least 500 ms): the tick does its periodic
        // work (a tick sooner than its period returns at once and would measure nothing).
        let period = u64::from(vm.host().tick_period_ms).max(500);
        vm.host().advance_ms(period);
        let idle = measure(&mut vm, "tick_idle", |vm| {
            vm.tick(ROOT)?;
            Ok(String::new())
        })?;
        if !vm.host().calls.is_empty() {
            bail!("the idle tick sent {} calls", vm.host().calls.len());
        }
        fleet.tick_idle = Some((idle.instructions, idle.traffic));
        // The first request after the round pays for every load that changed (its worker
        // derives the loads, rooms and verdicts again, and learns the slots they show):
        // measured apart. One more session then, and the scenarios below measure requests
        // whose loads are as the last request left them: the steady state between two
        // scrapes of the endpoints they involve.
        let c = next();
        let req = chat_request(Some("after-round"), messages_body(1, 0, false));
        let first = measure(&mut vm, "after_round", |vm| {
            exchange(vm, c, &req, &[json_answer(0)])
        })?;
        fleet.after_round = Some(first.instructions);
        for turns in [2, 1] {
            vm.host().advance_ms(20);
            let session = if turns == 2 {
                "after-round"
            } else {
                "after-round-2"
            };
            let req = chat_request(Some(session), messages_body(turns, 0, false));
            exchange(&mut vm, next(), &req, &[json_answer(0)])?;
        }
    }

    let mut requests = Vec::new();
    for name in SCENARIOS {
        vm.host().advance_ms(250);
        vm.host().sampling = sampled == Some(name);
        let c = next();
        let m = match name {
            "new_session" => {
                let req = chat_request(Some("conv-1"), messages_body(1, 0, false));
                measure(&mut vm, name, |vm| exchange(vm, c, &req, &[json_answer(0)]))?
            }
            "affinity_hit" => {
                let req = chat_request(Some("conv-1"), messages_body(2, 0, false));
                measure(&mut vm, name, |vm| {
                    exchange(vm, c, &req, &[json_answer(96)])
                })?
            }
            "body_32k" => {
                let req = chat_request(Some("conv-2"), sized_body(32 * 1024));
                measure(&mut vm, name, |vm| exchange(vm, c, &req, &[json_answer(0)]))?
            }
            "streamed_usage" => {
                let req = chat_request(Some("conv-3"), messages_body(1, 0, true));
                measure(&mut vm, name, |vm| exchange(vm, c, &req, &[sse_answer(16)]))?
            }
            "multipart" => {
                let req = multipart_request(24 * 1024);
                measure(&mut vm, name, |vm| {
                    exchange(vm, c, &req, &[transcription_answer()])
                })?
            }
            "failover" => {
                let req = chat_request(Some("conv-4"), messages_body(1, 0, false));
                measure(&mut vm, name, |vm| {
                    exchange(vm, c, &req, &[rate_limited(), json_answer(0)])
                })?
            }
            // A new session of an application with long instructions (placed by its prefix
            // key when `prefix_placement` is on), then its second turn (a pin hit).
            "new_session_prefix" => {
                let req = chat_request(Some("conv-5"), prefix_body(1, PREFIX_SYSTEM_BYTES));
                measure(&mut vm, name, |vm| exchange(vm, c, &req, &[json_answer(0)]))?
            }
            "affinity_hit_prefix" => {
                let req = chat_request(Some("conv-5"), prefix_body(2, PREFIX_SYSTEM_BYTES));
                measure(&mut vm, name, |vm| {
                    exchange(vm, c, &req, &[json_answer(96)])
                })?
            }
            other => bail!("unknown scenario {other}"),
        };
        vm.host().sampling = false;
        requests.push(m);
    }
    let samples = std::mem::take(&mut vm.host().samples);
    fleet.shared = crate::fleet::Shared::of(vm.host());
    fleet.metrics_defined = vm.host().metrics.len();
    fleet.tick_period_ms = vm.host().tick_period_ms;
    Ok((
        Suite {
            module,
            setup,
            startup,
            tick,
            requests,
            fleet,
        },
        samples,
        vm,
    ))
}

fn measure(vm: &mut Vm, name: &str, f: impl FnOnce(&mut Vm) -> Result<String>) -> Result<Measured> {
    let fuel_before = vm.fuel_used()?;
    if vm.host().echo {
        eprintln!("[measure {name} fuel {fuel_before}]");
    }
    let traffic_before = vm.host().traffic.clone();
    let by_callback_before = vm.fuel.clone();
    let outcome = f(vm)?;
    let instructions = vm.fuel_used()? - fuel_before;
    let traffic = vm.host().traffic.since(&traffic_before);
    let by_callback = vm
        .fuel
        .iter()
        .filter_map(|(k, v)| {
            let d = v - by_callback_before.get(k).copied().unwrap_or(0);
            (d > 0).then_some((*k, d))
        })
        .collect();
    Ok(Measured {
        name: name.to_string(),
        instructions,
        traffic,
        by_callback,
        outcome,
    })
}

fn set_pairs(host: &mut Host, kind: usize, pairs: &[(String, String)]) {
    host.maps[kind] = pairs
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect();
}

fn answer_headers(a: &Answer) -> Vec<(String, String)> {
    let mut h = vec![(":status".to_string(), a.status.to_string())];
    h.extend(a.headers.iter().cloned());
    h
}

/// One request's whole life. `answers[0]` is the routed upstream's answer; each later one
/// answers a call the module dispatches (failover). Returns "STATUS CLUSTER".
pub(crate) fn exchange(vm: &mut Vm, ctx: u32, req: &Request, answers: &[Answer]) -> Result<String> {
    {
        let h = vm.host();
        h.maps = Default::default();
        h.buffers[host::BUF_REQUEST_BODY].clear();
        h.buffers[host::BUF_RESPONSE_BODY].clear();
        h.buffers[host::BUF_CALL_RESPONSE_BODY].clear();
        h.local_response = None;
        h.calls.clear();
        let mut headers = vec![
            (":method".to_string(), "POST".to_string()),
            (":path".to_string(), req.path.to_string()),
            (":authority".to_string(), "llm.example.com".to_string()),
            (":scheme".to_string(), "https".to_string()),
            ("content-length".to_string(), req.body.len().to_string()),
            ("x-forwarded-proto".to_string(), "https".to_string()),
            (
                "x-request-id".to_string(),
                format!("7c1e9a52-0000-4000-8000-{ctx:012}"),
            ),
        ];
        headers.extend(req.headers.iter().cloned());
        set_pairs(h, host::MAP_REQUEST_HEADERS, &headers);
    }
    vm.context_create(ctx, ROOT)?;
    let mut paused = !vm.request_headers(ctx, req.body.is_empty())?;
    let mut outcome = None;
    if vm.host().local_response.is_none() {
        let chunks: Vec<&[u8]> = req.body.chunks(CHUNK_BYTES).collect();
        let mut buffered = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            vm.host().advance_ms(1);
            if paused {
                buffered.extend_from_slice(chunk);
            } else {
                buffered = chunk.to_vec();
            }
            vm.host().buffers[host::BUF_REQUEST_BODY] = buffered.clone();
            paused = !vm.request_body(ctx, buffered.len(), last)?;
            if vm.host().local_response.is_some() {
                break;
            }
        }
    }
    if vm.host().local_response.is_some() {
        outcome = Some(format!("{} local", local_reply(vm, ctx)?));
    } else if paused {
        bail!("request left paused after its body");
    }
    if outcome.is_none() {
        let Some(cluster) = vm
            .host()
            .header(host::MAP_REQUEST_HEADERS, ROUTING_HEADER)
            .map(|v| String::from_utf8_lossy(v).into_owned())
        else {
            bail!("request not routed: no {ROUTING_HEADER} header");
        };
        let Some(first) = answers.first() else {
            bail!("no upstream answer given");
        };
        vm.host().advance_ms(40);
        // The host that served it, as Envoy says: the first one the request named (a pool's
        // host), read by the glue only for pool endpoints.
        let served = vm
            .host()
            .header(host::MAP_REQUEST_HEADERS, crate::fleet::DESTINATION_HEADER)
            .map(first_host);
        match served {
            Some(a) => {
                vm.host()
                    .properties
                    .insert(b"upstream\0address".to_vec(), a);
            }
            None => {
                vm.host().properties.remove(&b"upstream\0address"[..]);
            }
        }
        set_pairs(
            vm.host(),
            host::MAP_RESPONSE_HEADERS,
            &answer_headers(first),
        );
        let headers_continue = vm.response_headers(ctx, first.chunks.is_empty())?;
        let n = first.chunks.len();
        for (i, chunk) in first.chunks.iter().enumerate() {
            vm.host().advance_ms(5);
            vm.host().buffers[host::BUF_RESPONSE_BODY] = chunk.clone();
            vm.response_body(ctx, chunk.len(), i + 1 == n)?;
        }
        // Calls the module dispatched (failover), answered in order.
        let mut answered = 0;
        let mut rest = answers.iter().skip(1);
        while answered < vm.host().calls.len() {
            let call = vm.host().calls[answered].clone();
            answered += 1;
            let Some(a) = rest.next() else {
                bail!(
                    "the module dispatched a call to {} with no answer left",
                    call.cluster
                );
            };
            vm.host().advance_ms(40);
            let mut headers = answer_headers(a);
            // A pool cluster stamps the host that served a call.
            if let Some((_, v)) = call
                .headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(crate::fleet::DESTINATION_HEADER.as_bytes()))
            {
                headers.push((
                    crate::fleet::STAMP_HEADER.to_string(),
                    String::from_utf8_lossy(&first_host(v)).into_owned(),
                ));
            }
            set_pairs(vm.host(), host::MAP_CALL_RESPONSE_HEADERS, &headers);
            let body: Vec<u8> = a.chunks.concat();
            vm.host().buffers[host::BUF_CALL_RESPONSE_BODY] = body.clone();
            let nh = vm.host().maps[host::MAP_CALL_RESPONSE_HEADERS].len();
            vm.http_call_response(ctx, call.token, nh, body.len())?;
            if vm.host().local_response.is_some() {
                let status = local_reply(vm, ctx)?;
                outcome = Some(format!("{cluster} → {} (call to {})", status, call.cluster));
            }
        }
        if outcome.is_none() {
            if !headers_continue && answered == 0 {
                bail!("response headers left paused");
            }
            outcome = Some(format!("{cluster} {}", first.status));
        }
    }
    vm.host().advance_ms(1);
    vm.log(ctx)?;
    vm.done(ctx)?;
    vm.delete(ctx)?;
    Ok(outcome.unwrap_or_default())
}

/// The first host of a destination header's list.
fn first_host(v: &[u8]) -> Vec<u8> {
    v.split(|b| *b == b',').next().unwrap_or_default().to_vec()
}

/// The module's local reply passes through its own response callbacks.
fn local_reply(vm: &mut Vm, ctx: u32) -> Result<String> {
    let Some(lr) = vm.host().local_response.take() else {
        bail!("no local reply");
    };
    let mut h = vec![(b":status".to_vec(), lr.status.to_string().into_bytes())];
    h.extend(lr.headers.iter().cloned());
    h.push((
        b"content-length".to_vec(),
        lr.body.len().to_string().into_bytes(),
    ));
    vm.host().maps[host::MAP_RESPONSE_HEADERS] = h;
    vm.response_headers(ctx, lr.body.is_empty())?;
    if !lr.body.is_empty() {
        vm.host().buffers[host::BUF_RESPONSE_BODY] = lr.body.clone();
        vm.response_body(ctx, lr.body.len(), true)?;
    }
    Ok(lr.status.to_string())
}
