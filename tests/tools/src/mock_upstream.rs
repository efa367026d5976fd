//! A mock OpenAI-compatible inference upstream for ComputeFlux's integration tests and benches.
//!
//! Why: the filter's whole point is KV-cache affinity, failover and breaking, so the tests need an
//! upstream that behaves like ONE inference instance (vLLM-style automatic prefix caching, prefill
//! cost proportional to the uncached prompt) and that fails on command. Each process is one
//! endpoint; tests start several.
//!
//! ```text
//! cargo run --release -p computeflux-tools --bin mock_upstream -- --port 0 --name a [--models m1,m2]
//!     [--prefill-us-per-token 200] [--decode-ms 20] [--cache-tokens 200000]
//! ```
//!
//! Once bound it prints exactly one line, `LISTENING 127.0.0.1:<port>`, to stdout and flushes it
//! (`--port 0` lets the OS pick). With `--control-port P` it then prints a second line,
//! `CONTROL 127.0.0.1:<port>`: a listener that serves the same endpoints but is never closed by
//! the `refuse` fault, so `/_mock/*` stays reachable while the main port refuses connections.
//!
//! Flags (all optional):
//! - `--port N` (0): main port. `--host IP` (127.0.0.1).
//! - `--name S` ("mock"): endpoint name, sent back in `x-mock-endpoint` and in the answer text.
//! - `--models a,b`: served models; another model gets a 404 `model_not_found`. Without it any
//!   model is accepted.
//! - `--prefill-us-per-token N` (200): prefill cost per *uncached* prompt token, in µs.
//! - `--decode-ms N` (20): decode time of a whole answer (streamed answers spread it over chunks).
//! - `--cache-tokens N` (200000): KV-cache capacity in tokens (LRU over blocks), per rank.
//! - `--data-parallel-size N` (1): data-parallel ranks, each with its own prefix cache, slots,
//!   queue and prefill; the request header `x-data-parallel-rank` picks one, else the least
//!   loaded (see `mock_upstream/ranks.rs`). Answers carry `x-mock-rank`; `/_mock/stats` has
//!   `ranks`; the vLLM and SGLang `/metrics` write every series per rank, with the rank's own
//!   queue, batch and KV usage (vLLM `engine="<k>"`, SGLang `dp_rank="<k>"`).
//! - `--block-tokens N` (16): tokens per cache block (vLLM's default block size).
//! - `--completion-tokens N` (16): answer length; capped by the request's `max_tokens` /
//!   `max_completion_tokens`.
//! - `--max-concurrency N` (0 = unlimited): requests processed at once (slots), per rank; the
//!   rest wait in the rank's FIFO queue (and count as in flight).
//! - `--engine constant|batched` (constant): the latency model. `batched` behaves like an
//!   inference engine (see `mock_upstream/engine.rs`): one prefill at a time, decode per output
//!   token slowed by the batch, plain answers' headers after the generation. Its flags:
//!   `--decode-ms-per-token F` (2), `--batch-slowdown F` (0.05), `--output-tokens
//!   random|max_tokens` (random: log-uniform in `--output-tokens-min`..`--output-tokens-max`,
//!   16..512, capped by `max_tokens`; max_tokens: the request's own), `--decode-step-tokens N`
//!   (4 tokens per timer step and streamed chunk), `--seed N` (1).
//! - `--metrics-format vllm|sglang|llamacpp|tgi` (vllm): the dialect of `GET /metrics`.
//! - `--slow-factor F --slow-after-ms T`: every request F× slower (prefill and decode) from T ms
//!   after the start (both models; the `slow` fault does the same on command).
//! - `--history N` (1000): how many requests `/_mock/requests` keeps.
//! - `--control-port N`: see above.
//! - `--exit-on-stdin-eof`: exit when stdin closes (the test harness uses it so a killed test
//!   process leaves no mock behind).
//!
//! Tokens: one token is 4 bytes of the prompt text (the last may be shorter); the prompt text is,
//! per message, its role, `\n`, its content's text, `\n` (an inline image or audio part counts as
//! 340 bytes, 85 tokens, whatever its encoded size, as hosted APIs charge it). Cache hits are counted in whole blocks
//! of `--block-tokens` tokens (see `mock_upstream/cache.rs`). Latency of a served request in the
//! constant model is `prefill_us_per_token × (prompt_tokens − cached_tokens)` before the response
//! headers, then `decode_ms` for the body; the batched model's is in `mock_upstream/engine.rs`.
//!
//! Endpoints:
//! - `POST /v1/chat/completions`: OpenAI chat completion (or an SSE stream with `"stream": true`:
//!   a role chunk, one chunk per completion token, a finish chunk, a usage chunk with empty
//!   `choices`, then `data: [DONE]`). Headers `x-mock-endpoint`, `x-mock-prompt-tokens`,
//!   `x-mock-cached-tokens`, `x-mock-request-seq`, `x-mock-queued-ms` (the batched model: how
//!   long it waited in the engine, for a slot and for the prefill of others, before its own
//!   prefill), `x-mock-slot-wait` (`1`: it found every slot taken on arrival).
//!   `usage.prompt_tokens_details.cached_tokens`.
//! - `POST /v1/embeddings`: deterministic vectors per input text (`encoding_format` `float` or
//!   `base64`, `dimensions`, default 8).
//! - `POST /v1/audio/transcriptions`, `/v1/audio/translations` (multipart form): the text names
//!   the endpoint, the file's size and the `model` field received (`response_format` `json`,
//!   `text`, `verbose_json`).
//! - `POST /v1/responses` (Responses API, also streamed: `response.created` first): each
//!   response is stored unless `"store": false` (the last 10 000); a `previous_response_id`
//!   continues the stored conversation (its transcript is the prompt prefix, so the prefix
//!   cache sees it) and an unknown one gets OpenAI's `404 previous_response_not_found`. The
//!   answer text is `[<name>] turn=<n> …`, n counting the turns of the stored chain.
//! - `POST /v1/messages` (Anthropic Messages, also streamed); `metadata.user_id` counts as the
//!   session in `by_session`.
//! - `GET /v1/models`.
//! - `GET /metrics`: the engine's load in the Prometheus text exposition of `--metrics-format`,
//!   with the real engines' names (vLLM `vllm:num_requests_waiting`, `…_running`,
//!   `vllm:kv_cache_usage_perc`; SGLang `sglang:num_queue_reqs`, `…num_running_reqs`,
//!   `…token_usage`; llama.cpp `llamacpp:requests_deferred`, `…requests_processing`,
//!   `…prompt_tokens_total`, `…prompt_tokens_cached_total`; TGI `tgi_queue_size`,
//!   `tgi_batch_current_size`): the actual queue, running requests, KV blocks held and token
//!   counters, in either model.
//!
//! Every `POST` API above goes through the same fault injection, request log and (except
//! embeddings and audio) the prefix-cache latency model as chat completions.
//! - `GET /_mock/stats`: `{"name","port","requests","status_counts","prompt_tokens",
//!   "cached_tokens","completion_tokens","in_flight","by_session","cache_blocks","fault",
//!   "stored_responses",...}`.
//!   `requests` counts every inference request received (faulted ones too); `status_counts`
//!   is keyed by status, or `"reset"` / `"hang"`. `by_session` counts requests by the body's
//!   `user` (else the `x-session-id` header).
//! - `GET /_mock/requests[?limit=N]`: the last requests, oldest first:
//!   `{"seq","t_ms","path","headers":{lowercase name: value},"model","stream","user","status",
//!   "fault","prompt_tokens","cached_tokens","body_bytes"}` (`POST /v1/files` is logged and
//!   faulted too) (`status` is null for reset / hang).
//! - `POST /_mock/fault` (body: the fault, replacing the current one; answers once it is in force),
//!   `GET /_mock/fault`:
//!   `{"mode":"none"}`, `{"mode":"status","status":429,"retry_after":"2","headers":{..},"body":".."}`,
//!   `{"mode":"slow","factor":5}`, `{"mode":"delay_ms","ms":300}`, `{"mode":"pad","bytes":N}`
//!   (served normally, with an `x_padding` field of N bytes in a non-streamed answer),
//!   `{"mode":"no_usage"}` (served normally, without `usage`), `{"mode":"cut"}` (a streamed
//!   answer's first half, then TCP RST; its tokens are counted in the stats all the same),
//!   `{"mode":"reset"}` (TCP RST,
//!   no answer), `{"mode":"hang"}` (no answer ever), `{"mode":"refuse"}` (stop listening and drop
//!   open connections; any other mode re-binds the same port). Optional `"when_header":"name"`
//!   faults only the requests carrying that header. Optional `"count":N` limits a
//!   mode to the next N requests; `"for_ms":N` on `refuse` re-binds after N ms.
//! - `POST /_mock/reset_stats` (counters and request log), `POST /_mock/flush_cache`.
//! - `POST /_mock/quota` (body: `{"requests":N,"tokens":N,"window_ms":N,
//!   "headers_family":"openai|anthropic|none","headers":{..},"per_model":bool,
//!   "models":{"m1":{"requests":N,"tokens":N}}}`, replacing the budget and
//!   restarting its window), `GET /_mock/quota`: an API key's quota (see
//!   `mock_upstream/quota.rs`). `GET /_mock/quota_usage`: `[[unix ms, tokens used in the
//!   window after it], …]` for each admitted request, oldest first. Also `--quota-requests N --quota-tokens N --quota-window-ms N
//!   --quota-headers openai|anthropic|none`. Its 429s count in `status_counts` and in
//!   `quota_rejected` of `/_mock/stats`.

#[path = "mock_upstream/apis.rs"]
mod apis;
#[path = "mock_upstream/cache.rs"]
mod cache;
#[path = "mock_upstream/engine.rs"]
mod engine;
#[path = "mock_upstream/fault.rs"]
mod fault;
#[path = "mock_upstream/openai.rs"]
mod openai;
#[path = "mock_upstream/quota.rs"]
mod quota;
#[path = "mock_upstream/ranks.rs"]
mod ranks;

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};

use cache::token_count;
use fault::{Fault, Mode};

type Body = BoxBody<Bytes, Infallible>;

const USAGE: &str = "usage: mock_upstream [--port N] [--host IP] [--name S] [--models a,b] \
[--prefill-us-per-token N] [--decode-ms N] [--cache-tokens N] [--block-tokens N] \
[--completion-tokens N] [--max-concurrency N] [--history N] [--control-port N] \
[--quota-requests N] [--quota-tokens N] [--quota-window-ms N] [--quota-headers openai|anthropic|none] \
[--engine constant|batched] [--decode-ms-per-token F] [--batch-slowdown F] \
[--output-tokens random|max_tokens] [--output-tokens-min N] [--output-tokens-max N] \
[--decode-step-tokens N] [--seed N] [--metrics-format vllm|sglang|llamacpp|tgi] \
[--slow-factor F] [--slow-after-ms N] [--exit-on-stdin-eof]";

/// Distinct sessions remembered in `by_session`.
const MAX_SESSIONS: usize = 10_000;
/// Responses kept for `previous_response_id`.
const MAX_STORED_RESPONSES: usize = 10_000;

struct Args {
    host: IpAddr,
    port: u16,
    name: String,
    models: Vec<String>,
    prefill_us_per_token: u64,
    decode_ms: u64,
    cache_tokens: u64,
    data_parallel_size: usize,
    block_tokens: usize,
    completion_tokens: u64,
    max_concurrency: usize,
    history: usize,
    control_port: Option<u16>,
    exit_on_stdin_eof: bool,
    quota: quota::Quota,
    /// The latency model (`--engine`).
    engine: engine::Model,
    /// The batched model's parameters.
    params: engine::Params,
    metrics_format: engine::Format,
    /// `--slow-factor F --slow-after-ms T`: every request F× slower from T ms after the start.
    slow_factor: Option<f64>,
    slow_after_ms: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        host: IpAddr::V4(Ipv4Addr::LOCALHOST),
        port: 0,
        name: "mock".into(),
        models: Vec::new(),
        prefill_us_per_token: 200,
        decode_ms: 20,
        cache_tokens: 200_000,
        data_parallel_size: 1,
        block_tokens: 16,
        completion_tokens: 16,
        max_concurrency: 0,
        history: 1000,
        control_port: None,
        exit_on_stdin_eof: false,
        quota: quota::Quota::default(),
        engine: engine::Model::Constant,
        params: engine::Params::default(),
        metrics_format: engine::Format::Vllm,
        slow_factor: None,
        slow_after_ms: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if flag == "--exit-on-stdin-eof" {
            a.exit_on_stdin_eof = true;
            continue;
        }
        if flag == "--help" || flag == "-h" {
            return Err("help".into());
        }
        let value = match inline {
            Some(v) => v,
            None => it.next().ok_or_else(|| format!("{flag} needs a value"))?,
        };
        let num = |v: &str| -> Result<u64, String> {
            v.parse::<u64>()
                .map_err(|_| format!("{flag} must be a non-negative integer, got {v:?}"))
        };
        let float = |v: &str| -> Result<f64, String> {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| format!("{flag} must be a non-negative number, got {v:?}"))
        };
        match flag.as_str() {
            "--port" => a.port = u16::try_from(num(&value)?).map_err(|_| "--port > 65535")?,
            "--host" => {
                a.host = value
                    .parse()
                    .map_err(|_| format!("--host: bad IP {value:?}"))?
            }
            "--name" => a.name = value,
            "--models" => {
                a.models = value
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            }
            "--prefill-us-per-token" => a.prefill_us_per_token = num(&value)?,
            "--decode-ms" => a.decode_ms = num(&value)?,
            "--cache-tokens" => a.cache_tokens = num(&value)?,
            "--data-parallel-size" => {
                a.data_parallel_size = usize::try_from(num(&value)?)
                    .ok()
                    .filter(|n| (1..=ranks::MAX_RANKS).contains(n))
                    .ok_or_else(|| {
                        format!("--data-parallel-size {value}: 1..={}", ranks::MAX_RANKS)
                    })?
            }
            "--block-tokens" => a.block_tokens = num(&value)?.max(1) as usize,
            "--completion-tokens" => a.completion_tokens = num(&value)?.max(1),
            "--max-concurrency" => a.max_concurrency = num(&value)? as usize,
            "--history" => a.history = num(&value)? as usize,
            "--quota-requests" => a.quota.requests = Some(num(&value)?),
            "--quota-tokens" => a.quota.tokens = Some(num(&value)?),
            "--quota-window-ms" => a.quota.window_ms = num(&value)?.max(1),
            "--quota-headers" => a.quota.family = quota::Family::parse(&value)?,
            "--engine" => a.engine = engine::Model::parse(&value)?,
            "--decode-ms-per-token" => a.params.decode_ms_per_token = float(&value)?,
            "--batch-slowdown" => a.params.batch_slowdown = float(&value)?,
            "--output-tokens" => a.params.output_tokens = engine::OutputTokens::parse(&value)?,
            "--output-tokens-min" => a.params.output_min = num(&value)?.max(1),
            "--output-tokens-max" => a.params.output_max = num(&value)?.max(1),
            "--decode-step-tokens" => a.params.step_tokens = num(&value)?.max(1),
            "--seed" => a.params.seed = num(&value)?,
            "--metrics-format" => a.metrics_format = engine::Format::parse(&value)?,
            "--slow-factor" => a.slow_factor = Some(float(&value)?),
            "--slow-after-ms" => a.slow_after_ms = num(&value)?,
            "--control-port" => {
                a.control_port =
                    Some(u16::try_from(num(&value)?).map_err(|_| "--control-port > 65535")?)
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.params.output_max < a.params.output_min {
        return Err("--output-tokens-max must be >= --output-tokens-min".into());
    }
    if HeaderValue::from_str(&a.name).is_err() {
        return Err(format!("--name {:?} is not a valid header value", a.name));
    }
    Ok(a)
}

#[derive(Default)]
struct Stats {
    requests: u64,
    status_counts: BTreeMap<String, u64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    by_session: BTreeMap<String, u64>,
}

struct State {
    stats: Stats,
    log: VecDeque<Value>,
    /// The data-parallel ranks, each with its prefix cache (one rank by default).
    ranks: ranks::Ranks,
    fault: Fault,
    fault_gen: u64,
    responses: apis::ResponseStore,
    quota: quota::Quota,
    /// Output lengths of the batched model (seeded by `--seed` and the name).
    rng: engine::SplitMix,
}

struct Mock {
    args: Args,
    port: u16,
    started: Instant,
    seq: AtomicU64,
    in_flight: AtomicI64,
    /// Each rank's slots (`--max-concurrency`; none: unlimited).
    slots: Vec<Option<Arc<Semaphore>>>,
    /// Each rank's load: its queue, running batch, decoding requests and KV blocks held
    /// (`ranks.rs`; the state's `ranks` shares it).
    loads: ranks::Loads,
    /// The engine's requests waiting for a slot (the queue), holding one (the running batch):
    /// the sums over its ranks.
    waiting: AtomicI64,
    running: AtomicI64,
    /// KV-cache blocks held by the requests in their slots (prompt and output), all ranks.
    kv_blocks_used: AtomicI64,
    /// The decode time simulated so far (µs) and the output tokens it produced: the engines'
    /// decode-pace counters on `/metrics`.
    decode_us_total: AtomicU64,
    decode_tokens_total: AtomicU64,
    /// The batched model's one-prefill-at-a-time lock of each rank (tokio's mutex is FIFO).
    prefill: Vec<tokio::sync::Mutex<()>>,
    /// Wanted: is the main port listening? Written by `/_mock/fault`.
    listening: watch::Sender<bool>,
    /// Actual: is the main port bound? Written by the accept loop.
    bound: watch::Sender<bool>,
    state: Mutex<State>,
}

impl Mock {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, st: &mut State, entry: Record) {
        if self.args.history == 0 {
            return;
        }
        while st.log.len() >= self.args.history {
            st.log.pop_front();
        }
        st.log.push_back(entry.to_json());
    }

    fn stats_json(&self) -> Value {
        let st = self.lock();
        json!({
            "name": self.args.name,
            "port": self.port,
            "requests": st.stats.requests,
            "status_counts": st.stats.status_counts,
            "prompt_tokens": st.stats.prompt_tokens,
            "cached_tokens": st.stats.cached_tokens,
            "completion_tokens": st.stats.completion_tokens,
            "quota_rejected": st.quota.rejected,
            "in_flight": self.in_flight.load(Ordering::SeqCst),
            "by_session": st.stats.by_session,
            "cache_blocks": st.ranks.blocks(),
            "cache_capacity_blocks": st.ranks.capacity_blocks(),
            "block_tokens": self.args.block_tokens,
            "ranks": st.ranks.to_json(),
            "fault": st.fault.to_json(),
            "listening": *self.bound.borrow(),
            "stored_responses": st.responses.len(),
            "engine": match self.args.engine {
                engine::Model::Constant => "constant",
                engine::Model::Batched => "batched",
            },
            "waiting": self.waiting.load(Ordering::SeqCst),
            "running": self.running.load(Ordering::SeqCst),
            "kv_blocks_used": self.kv_blocks_used.load(Ordering::SeqCst),
        })
    }

    /// What `/metrics` reports now.
    fn load(&self) -> engine::Load {
        let st = self.lock();
        let n = |a: &AtomicI64| a.load(Ordering::SeqCst).max(0) as u64;
        engine::Load {
            model: self
                .args
                .models
                .first()
                .cloned()
                .unwrap_or_else(|| "mock".into()),
            waiting: n(&self.waiting),
            running: n(&self.running),
            kv_blocks_used: n(&self.kv_blocks_used),
            kv_blocks_total: st.ranks.capacity_blocks() as u64,
            block_tokens: self.args.block_tokens as u64,
            prompt_tokens_total: st.stats.prompt_tokens,
            cached_tokens_total: st.stats.cached_tokens,
            generation_tokens_total: st.stats.completion_tokens,
            requests_total: st.stats.requests,
            slots: self.args.max_concurrency as u64,
            decode_us_total: self.decode_us_total.load(Ordering::SeqCst),
            decode_tokens_total: self.decode_tokens_total.load(Ordering::SeqCst),
            dp_rank: None,
        }
    }

    /// `/metrics`: with several ranks in the vLLM or SGLang dialect, every series per rank,
    /// labelled with it (its cache, its token counters, its own queue, running batch and KV
    /// blocks held; the decode-pace counters shared out evenly); otherwise the engine's one
    /// exposition (llama.cpp and TGI run no data-parallel ranks: their page sums the ranks).
    fn metrics_text(&self) -> String {
        let load = self.load();
        let n = self.args.data_parallel_size;
        let format = self.args.metrics_format;
        if n <= 1 || !matches!(format, engine::Format::Vllm | engine::Format::Sglang) {
            return engine::render_metrics(format, &load);
        }
        let st = self.lock();
        let share = |v: u64, k: usize| v / n as u64 + u64::from((k as u64) < v % n as u64);
        let per_rank: Vec<String> = (0..n)
            .map(|k| {
                let r = st.ranks.stats.get(k).copied().unwrap_or_default();
                let gauge = |which: ranks::Which| ranks::read(&self.loads, k, which);
                let rank = engine::Load {
                    waiting: gauge(|l| &l.waiting),
                    running: gauge(|l| &l.running),
                    kv_blocks_used: gauge(|l| &l.kv_blocks),
                    kv_blocks_total: st
                        .ranks
                        .caches
                        .get(k)
                        .map_or(0, |c| c.capacity_blocks() as u64),
                    prompt_tokens_total: r.prompt_tokens,
                    cached_tokens_total: r.cached_tokens,
                    generation_tokens_total: r.completion_tokens,
                    requests_total: r.requests,
                    decode_us_total: share(load.decode_us_total, k),
                    decode_tokens_total: share(load.decode_tokens_total, k),
                    dp_rank: Some(k),
                    ..load.clone()
                };
                engine::render_metrics(format, &rank)
            })
            .collect();
        ranks::interleave(&per_rank)
    }

    /// Counts `tokens` output tokens decoded in `time` (the simulated decode, slowdowns
    /// included), once that time has passed.
    fn decoded(&self, time: Duration, tokens: u64) {
        let us = u64::try_from(time.as_micros()).unwrap_or(u64::MAX);
        self.decode_us_total.fetch_add(us, Ordering::SeqCst);
        self.decode_tokens_total.fetch_add(tokens, Ordering::SeqCst);
    }

    /// The slowdown in force now: the `slow` fault (read at every step of the batched model,
    /// so it also slows requests already running) times `--slow-factor` once
    /// `--slow-after-ms` has passed.
    fn slow_now(&self, fault: bool) -> f64 {
        let mut f = 1.0;
        if fault {
            if let Mode::Slow { factor } = self.lock().fault.mode {
                f *= factor;
            }
        }
        if let Some(sf) = self.args.slow_factor {
            if self.started.elapsed() >= Duration::from_millis(self.args.slow_after_ms) {
                f *= sf;
            }
        }
        f
    }
}

/// Adds `delta` to a gauge now and takes it back when dropped.
struct Gauge {
    counter: Arc<Mock>,
    which: fn(&Mock) -> &AtomicI64,
    delta: i64,
}

impl Gauge {
    fn new(mock: &Arc<Mock>, which: fn(&Mock) -> &AtomicI64, delta: i64) -> Self {
        which(mock).fetch_add(delta, Ordering::SeqCst);
        Gauge {
            counter: mock.clone(),
            which,
            delta,
        }
    }
}

impl Drop for Gauge {
    fn drop(&mut self) {
        (self.which)(&self.counter).fetch_sub(self.delta, Ordering::SeqCst);
    }
}

/// Counts a chat request as in flight until dropped (also when hyper drops a cancelled request).
struct InFlight(Arc<Mock>);

impl InFlight {
    fn new(mock: &Arc<Mock>) -> Self {
        mock.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(mock.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One accepted connection: a duplicate of its socket (to set SO_LINGER 0 for a reset) and the
/// signal that makes its task drop it.
struct Conn {
    dup: std::net::TcpStream,
    kill: Notify,
}

impl Conn {
    /// Closes the connection with a TCP RST, without writing anything more.
    fn reset(&self) {
        let _ = socket2::SockRef::from(&self.dup).set_linger(Some(Duration::ZERO));
        self.kill.notify_one();
    }
}

/// A streamed response body fed by a channel.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

fn set_header(r: &mut Response<Body>, name: &str, value: &str) {
    if let (Ok(n), Ok(v)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(value),
    ) {
        r.headers_mut().insert(n, v);
    }
}

fn json_response(status: u16, v: &Value) -> Response<Body> {
    let mut r = Response::new(full(v.to_string()));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    set_header(&mut r, "content-type", "application/json");
    r
}

fn now_unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One entry of `/_mock/requests`.
struct Record {
    seq: u64,
    t_ms: u64,
    path: String,
    headers: BTreeMap<String, String>,
    model: Option<String>,
    stream: bool,
    user: Option<String>,
    status: Option<u16>,
    fault: Option<&'static str>,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    /// Bytes of the request body received.
    body_bytes: usize,
    /// The data-parallel rank that served it (once chosen).
    rank: Option<usize>,
}

impl Record {
    fn to_json(&self) -> Value {
        json!({
            "seq": self.seq,
            "t_ms": self.t_ms,
            "path": self.path,
            "headers": self.headers,
            "model": self.model,
            "stream": self.stream,
            "user": self.user,
            "status": self.status,
            "fault": self.fault,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "body_bytes": self.body_bytes,
            "rank": self.rank,
        })
    }
}

/// What to do with one chat request, decided under the state lock.
enum Plan {
    Respond(Response<Body>),
    Reset,
    Hang,
    Serve(Serve),
}

struct Serve {
    seq: u64,
    api: apis::Api,
    /// Responses API: the response's id, its predecessor, whether it is stored, its turn.
    response_id: String,
    previous_response_id: Option<String>,
    store: bool,
    turns: u64,
    model: String,
    stream: bool,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    hashes: Vec<u64>,
    /// The data-parallel rank serving it.
    rank: usize,
    factor: f64,
    extra_delay_ms: u64,
    pad_bytes: u64,
    /// No `usage` in the answer.
    no_usage: bool,
    /// Cut a streamed answer mid-way (TCP RST).
    cut: bool,
    /// What is left of the key's quota, in the configured header family.
    quota_headers: Vec<(String, String)>,
    /// How long it waited in this engine before its own prefill started (for a slot, then
    /// for the prefill of others): `x-mock-queued-ms`.
    queued_ms: f64,
    /// It found every slot taken on arrival: `x-mock-slot-wait: 1`.
    slot_wait: bool,
}

async fn chat(mock: Arc<Mock>, conn: Arc<Conn>, req: Request<Incoming>) -> Response<Body> {
    let guard = InFlight::new(&mock);
    let arrived = std::time::Instant::now();
    let path = req.uri().path().to_string();
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in req.headers() {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        headers
            .entry(name.as_str().to_string())
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(&value);
            })
            .or_insert(value);
    }
    let body = req.into_body().collect().await.map(|c| c.to_bytes());
    // The rank first: a request waits for a slot of its own rank only (a wrong rank waits for
    // none, and `decide` refuses it).
    let header = headers.get(ranks::RANK_HEADER).map(String::as_str);
    let rank = mock.lock().ranks.choose(header);
    let on_rank = |which: ranks::Which| {
        rank.as_ref()
            .ok()
            .map(|&k| ranks::hold(&mock.loads, k, which, 1))
    };
    let queued = (
        Gauge::new(&mock, |m| &m.waiting, 1),
        on_rank(|l| &l.waiting),
    );
    let slots = rank.as_ref().ok().and_then(|&k| mock.slots.get(k)).cloned();
    // Whether it found every slot taken (and waited in the engine's queue).
    let mut slot_wait = false;
    let permit = match slots.flatten() {
        Some(s) => match s.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                slot_wait = true;
                s.acquire_owned().await.ok()
            }
        },
        None => None,
    };
    drop(queued);
    let slot = (
        Gauge::new(&mock, |m| &m.running, 1),
        on_rank(|l| &l.running),
    );
    let seq = mock.seq.fetch_add(1, Ordering::SeqCst) + 1;
    let mut plan = decide(&mock, seq, &path, headers, body.ok(), rank);
    if let Plan::Serve(s) = &mut plan {
        s.queued_ms = arrived.elapsed().as_secs_f64() * 1000.0;
        s.slot_wait = slot_wait;
    }
    match plan {
        Plan::Respond(r) => r,
        Plan::Reset => {
            conn.reset();
            std::future::pending().await
        }
        Plan::Hang => std::future::pending().await,
        Plan::Serve(s) => {
            let blocks = (s.prompt_tokens + s.completion_tokens)
                .div_ceil(mock.args.block_tokens.max(1) as u64);
            let busy = Busy {
                _in_flight: guard,
                _permit: permit,
                _slot: slot,
                _kv: (
                    Gauge::new(&mock, |m| &m.kv_blocks_used, blocks as i64),
                    ranks::hold(&mock.loads, s.rank, |l| &l.kv_blocks, blocks as i64),
                ),
            };
            match mock.args.engine {
                engine::Model::Constant => serve(mock, conn, busy, s).await,
                engine::Model::Batched => serve_batched(mock, conn, busy, s).await,
            }
        }
    }
}

fn decide(
    mock: &Arc<Mock>,
    seq: u64,
    path: &str,
    headers: BTreeMap<String, String>,
    body: Option<Bytes>,
    rank: Result<usize, String>,
) -> Plan {
    let api = apis::Api::from_path(path).unwrap_or(apis::Api::Chat);
    let form = match api {
        apis::Api::Transcriptions | apis::Api::Translations => apis::parse_form(
            headers.get("content-type").map_or("", String::as_str),
            body.as_deref().unwrap_or_default(),
        ),
        _ => None,
    };
    let parsed: Option<Value> = body
        .as_deref()
        .and_then(|b| serde_json::from_slice::<Value>(b).ok())
        .filter(Value::is_object);
    let field = |k: &str| parsed.as_ref().and_then(|v| v.get(k));
    let model = match &form {
        Some(f) => f.fields.get("model").cloned(),
        None => field("model").and_then(Value::as_str).map(str::to_string),
    };
    let stream = field("stream").and_then(Value::as_bool).unwrap_or(false);
    let user = field("user")
        .and_then(Value::as_str)
        .or_else(|| {
            field("metadata")
                .and_then(|m| m.get("user_id"))
                .and_then(Value::as_str)
        })
        .map(str::to_string)
        .or_else(|| headers.get("x-session-id").cloned());
    let mut entry = Record {
        seq,
        t_ms: mock.started.elapsed().as_millis() as u64,
        path: path.to_string(),
        headers,
        model: model.clone(),
        stream,
        user: user.clone(),
        status: None,
        fault: None,
        prompt_tokens: None,
        cached_tokens: None,
        body_bytes: body.as_ref().map_or(0, Bytes::len),
        rank: None,
    };

    let mut guard = mock.lock();
    let st: &mut State = &mut guard;
    st.stats.requests += 1;
    if let Some(u) = &user {
        let known = st.stats.by_session.contains_key(u);
        if known || st.stats.by_session.len() < MAX_SESSIONS {
            *st.stats.by_session.entry(u.clone()).or_insert(0) += 1;
        }
    }
    let mode = st.fault.take(|h| entry.headers.contains_key(h));
    let finish = |st: &mut State, entry: &mut Record, status: Option<u16>, label: &str| {
        let key = status
            .map(|s| s.to_string())
            .unwrap_or_else(|| label.to_string());
        *st.stats.status_counts.entry(key).or_insert(0) += 1;
        entry.status = status;
    };

    let (mut factor, mut extra_delay_ms, mut pad_bytes) = (1.0, 0, 0);
    let (mut no_usage, mut cut) = (false, false);
    match &mode {
        Mode::None => {}
        Mode::Status {
            status,
            retry_after,
            headers: extra,
            body,
        } => {
            entry.fault = Some("status");
            finish(st, &mut entry, Some(*status), "");
            mock.record(st, entry);
            let text = body.clone().unwrap_or_else(|| {
                openai::error(
                    *status,
                    &format!("mock {} injected status {status}", mock.args.name),
                )
                .to_string()
            });
            let mut r = Response::new(full(text));
            *r.status_mut() =
                StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            set_header(&mut r, "content-type", "application/json");
            set_header(&mut r, "x-mock-endpoint", &mock.args.name);
            set_header(&mut r, "x-mock-request-seq", &seq.to_string());
            if let Some(ra) = retry_after {
                set_header(&mut r, "retry-after", ra);
            }
            for (k, v) in extra {
                set_header(&mut r, k, v);
            }
            return Plan::Respond(r);
        }
        Mode::Slow { factor: f } => {
            entry.fault = Some("slow");
            factor = *f;
        }
        Mode::DelayMs { ms } => {
            entry.fault = Some("delay_ms");
            extra_delay_ms = *ms;
        }
        Mode::Pad { bytes } => {
            entry.fault = Some("pad");
            pad_bytes = *bytes;
        }
        Mode::NoUsage => {
            entry.fault = Some("no_usage");
            no_usage = true;
        }
        Mode::Cut => {
            entry.fault = Some("cut");
            cut = true;
        }
        Mode::Reset | Mode::Hang | Mode::Refuse => {
            // `refuse` only reaches here on the control port: answer it like `reset`.
            let label = Fault::label(&mode).unwrap_or("reset");
            entry.fault = Some(label);
            finish(st, &mut entry, None, label);
            mock.record(st, entry);
            return if mode == Mode::Hang {
                Plan::Hang
            } else {
                Plan::Reset
            };
        }
    }

    let error = |st: &mut State, mut entry: Record, status: u16, msg: String| {
        finish(st, &mut entry, Some(status), "");
        mock.record(st, entry);
        let mut r = json_response(status, &openai::error(status, &msg));
        set_header(&mut r, "x-mock-endpoint", &mock.args.name);
        set_header(&mut r, "x-mock-request-seq", &seq.to_string());
        Plan::Respond(r)
    };
    let model_ok = |m: &str| mock.args.models.is_empty() || mock.args.models.iter().any(|x| x == m);
    let respond = |st: &mut State, mut entry: Record, status: u16, ct: &str, body: String| {
        finish(st, &mut entry, Some(status), "");
        mock.record(st, entry);
        let mut r = Response::new(full(body));
        *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
        set_header(&mut r, "content-type", ct);
        set_header(&mut r, "x-mock-endpoint", &mock.args.name);
        set_header(&mut r, "x-mock-request-seq", &seq.to_string());
        Plan::Respond(r)
    };
    if matches!(api, apis::Api::Transcriptions | apis::Api::Translations) {
        let Some(form) = form else {
            return error(st, entry, 400, "the body is not a multipart form".into());
        };
        let Some(model) = model.filter(|m| !m.is_empty()) else {
            return error(st, entry, 400, "you must provide a model form field".into());
        };
        if !model_ok(&model) {
            let msg = format!("The model `{model}` does not exist on {}", mock.args.name);
            return error(st, entry, 404, msg);
        }
        let (ct, text) = apis::transcription(api, &mock.args.name, &model, &form);
        return respond(st, entry, 200, ct, text);
    }
    let Some(req) = parsed else {
        return error(st, entry, 400, "request body is not a JSON object".into());
    };
    let model = model.unwrap_or_default();
    if !model_ok(&model) {
        let msg = format!("The model `{model}` does not exist on {}", mock.args.name);
        return error(st, entry, 404, msg);
    }
    let mut previous_response_id = None;
    let mut turns = 1;
    let prompt = match api {
        apis::Api::Embeddings => {
            let Some(texts) = apis::embedding_inputs(req.get("input")) else {
                return error(
                    st,
                    entry,
                    400,
                    "`input` must be a string or an array".into(),
                );
            };
            let prompt_tokens: u64 = texts.iter().map(|t| token_count(t.len())).sum();
            st.stats.prompt_tokens += prompt_tokens;
            entry.prompt_tokens = Some(prompt_tokens);
            let body = apis::embeddings(&req, &model, &texts, prompt_tokens);
            return respond(st, entry, 200, "application/json", body.to_string());
        }
        apis::Api::Responses => {
            let previous = req.get("previous_response_id").and_then(Value::as_str);
            let history = match previous {
                None => String::new(),
                Some(id) => match st.responses.get(id) {
                    Some(stored) => {
                        turns = stored.turns + 1;
                        stored.transcript.clone()
                    }
                    None => {
                        let body = apis::previous_not_found(id).to_string();
                        return respond(st, entry, 404, "application/json", body);
                    }
                },
            };
            previous_response_id = previous.map(str::to_string);
            let Some(added) = apis::responses_prompt(&req) else {
                return error(
                    st,
                    entry,
                    400,
                    "`input` must be a string or an array".into(),
                );
            };
            history + &added
        }
        apis::Api::Messages => match apis::messages_prompt(&req) {
            Some(p) => p,
            None => return error(st, entry, 400, "`messages` must be an array".into()),
        },
        _ => {
            let Some(messages) = req.get("messages").and_then(Value::as_array) else {
                return error(st, entry, 400, "`messages` must be an array".into());
            };
            openai::prompt_text(messages)
        }
    };
    let prompt_tokens = token_count(prompt.len());
    let rank = match rank {
        Ok(k) => k,
        Err(msg) => return error(st, entry, 400, msg),
    };
    entry.rank = Some(rank);
    let Some(cache) = st.ranks.cache(rank) else {
        return error(st, entry, 500, format!("rank {rank} has no cache"));
    };
    let hashes = cache.block_hashes(&model, prompt.as_bytes());
    let cached_tokens = (cache.cached_blocks(&hashes) * cache.block_tokens()) as u64;
    let max_tokens = req
        .get("max_completion_tokens")
        .or_else(|| req.get("max_tokens"))
        .or_else(|| req.get("max_output_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(u64::MAX);
    let completion_tokens = match mock.args.engine {
        engine::Model::Constant => mock.args.completion_tokens.min(max_tokens).max(1),
        engine::Model::Batched => {
            let asked = (max_tokens != u64::MAX).then_some(max_tokens);
            mock.args.params.output_len(asked, &mut st.rng)
        }
    };
    let mut quota_headers = Vec::new();
    if st.quota.enabled() {
        match st.quota.charge(prompt_tokens + completion_tokens, &model) {
            quota::Verdict::Admit(h) => quota_headers = h,
            quota::Verdict::Reject(retry_after_s, h) => {
                entry.fault = Some("quota");
                finish(st, &mut entry, Some(429), "");
                mock.record(st, entry);
                let msg = format!("mock {}: rate limit reached for this key", mock.args.name);
                let mut r = json_response(429, &openai::error(429, &msg));
                set_header(&mut r, "x-mock-endpoint", &mock.args.name);
                set_header(&mut r, "x-mock-request-seq", &seq.to_string());
                set_header(&mut r, "retry-after", &retry_after_s.to_string());
                for (k, v) in &h {
                    set_header(&mut r, k, v);
                }
                return Plan::Respond(r);
            }
        }
    }
    st.stats.prompt_tokens += prompt_tokens;
    st.stats.cached_tokens += cached_tokens;
    st.stats.completion_tokens += completion_tokens;
    if let Some(r) = st.ranks.stats.get_mut(rank) {
        r.requests += 1;
        r.prompt_tokens += prompt_tokens;
        r.cached_tokens += cached_tokens;
        r.completion_tokens += completion_tokens;
    }
    entry.prompt_tokens = Some(prompt_tokens);
    entry.cached_tokens = Some(cached_tokens);
    let response_id = format!("resp_{}_{seq}", mock.args.name);
    let store = req.get("store").and_then(Value::as_bool).unwrap_or(true);
    if api == apis::Api::Responses && store {
        let text = apis::responses_text(&mock.args.name, turns, completion_tokens);
        let transcript = format!("{prompt}assistant\n{text}\n");
        st.responses
            .insert(response_id.clone(), apis::Stored { transcript, turns });
    }
    finish(st, &mut entry, Some(200), "");
    mock.record(st, entry);
    Plan::Serve(Serve {
        seq,
        api,
        response_id,
        previous_response_id,
        store,
        turns,
        model,
        stream,
        prompt_tokens,
        cached_tokens,
        completion_tokens,
        hashes,
        rank,
        factor,
        extra_delay_ms,
        pad_bytes,
        no_usage,
        cut,
        quota_headers,
        queued_ms: 0.0,
        slot_wait: false,
    })
}

fn scaled(d: Duration, factor: f64) -> Duration {
    Duration::from_secs_f64(d.as_secs_f64() * factor)
}

/// Holds a request's in-flight count, concurrency slot and KV blocks (the engine's and its
/// rank's) until dropped.
struct Busy {
    _in_flight: InFlight,
    _permit: Option<OwnedSemaphorePermit>,
    _slot: (Gauge, Option<ranks::Held>),
    _kv: (Gauge, ranks::Held),
}

/// A `text/event-stream` answer whose events are what `rx` receives.
fn event_stream(rx: mpsc::Receiver<Bytes>) -> Response<Body> {
    let mut r = Response::new(ChannelBody { rx }.boxed());
    set_header(&mut r, "content-type", "text/event-stream");
    set_header(&mut r, "cache-control", "no-cache");
    r
}

/// A streamed chat completion's last events: the `stop` chunk, the usage chunk when the
/// answer reports usage, and `[DONE]`. A client gone by then is no error.
async fn end_chat_stream(
    tx: &mpsc::Sender<Bytes>,
    id: &str,
    created: u64,
    model: &str,
    usage: Option<&openai::Usage>,
) {
    let ev = |v: Value| Bytes::from(openai::sse(&v));
    let fin = openai::chunk(id, created, model, json!({}), Some("stop"));
    let _ = tx.send(ev(fin)).await;
    if let Some(usage) = usage {
        let _ = tx
            .send(ev(openai::usage_chunk(id, created, model, usage)))
            .await;
    }
    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
}

async fn serve(mock: Arc<Mock>, conn: Arc<Conn>, guard: Busy, s: Serve) -> Response<Body> {
    let a = &mock.args;
    let uncached = s.prompt_tokens.saturating_sub(s.cached_tokens);
    let prefill = Duration::from_micros(a.prefill_us_per_token.saturating_mul(uncached));
    let factor = s.factor * mock.slow_now(false);
    let wait = scaled(prefill, factor) + Duration::from_millis(s.extra_delay_ms);
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    if let Some(c) = mock.lock().ranks.cache(s.rank) {
        c.touch(&s.hashes);
    }

    let decode = scaled(Duration::from_millis(a.decode_ms), factor);
    let id = format!("chatcmpl-{}-{}", a.name, s.seq);
    let created = now_unix_s();
    let usage = openai::Usage {
        prompt_tokens: s.prompt_tokens,
        cached_tokens: s.cached_tokens,
        completion_tokens: s.completion_tokens,
    };
    let words = openai::completion_words(&a.name, s.completion_tokens);
    let (cut, no_usage) = (s.cut, s.no_usage);
    let mut r = if matches!(s.api, apis::Api::Responses | apis::Api::Messages) {
        other_api_answer(&mock, guard, &s, decode, created).await
    } else if s.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let per_chunk = decode / (words.len().max(1) as u32);
        let model = s.model.clone();
        let m = mock.clone();
        tokio::spawn(async move {
            let _guard = guard;
            let ev = |v: Value| Bytes::from(openai::sse(&v));
            let role = openai::chunk(
                &id,
                created,
                &model,
                json!({"role": "assistant", "content": ""}),
                None,
            );
            if tx.send(ev(role)).await.is_err() {
                return;
            }
            for (i, w) in words.iter().enumerate() {
                if cut && i == words.len() / 2 {
                    // Let what was sent reach the client, then cut.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    conn.reset();
                    return;
                }
                tokio::time::sleep(per_chunk).await;
                m.decoded(per_chunk, 1);
                let c = openai::chunk(&id, created, &model, json!({"content": w}), None);
                if tx.send(ev(c)).await.is_err() {
                    return;
                }
            }
            let usage = (!no_usage).then_some(&usage);
            end_chat_stream(&tx, &id, created, &model, usage).await;
        });
        event_stream(rx)
    } else {
        if !decode.is_zero() {
            tokio::time::sleep(decode).await;
        }
        mock.decoded(decode, s.completion_tokens);
        drop(guard);
        plain_answer(&mock, &s, &words, &usage, &id, created)
    };
    answer_headers(&mut r, &mock, &s);
    r
}

/// A non-streamed chat completion of `words`.
fn plain_answer(
    mock: &Mock,
    s: &Serve,
    words: &[String],
    usage: &openai::Usage,
    id: &str,
    created: u64,
) -> Response<Body> {
    let text: String = words.concat();
    let mut body = openai::completion(
        id,
        created,
        &s.model,
        &format!("mock-{}", mock.args.name),
        &text,
        usage,
    );
    if s.no_usage {
        if let Some(obj) = body.as_object_mut() {
            obj.remove("usage");
        }
    }
    if s.pad_bytes > 0 {
        if let Some(obj) = body.as_object_mut() {
            let pad = "x".repeat(usize::try_from(s.pad_bytes).unwrap_or(usize::MAX));
            obj.insert("x_padding".into(), Value::String(pad));
        }
    }
    json_response(200, &body)
}

/// The mock's headers on a served answer.
fn answer_headers(r: &mut Response<Body>, mock: &Mock, s: &Serve) {
    set_header(r, "x-mock-endpoint", &mock.args.name);
    set_header(r, "x-mock-prompt-tokens", &s.prompt_tokens.to_string());
    set_header(r, "x-mock-cached-tokens", &s.cached_tokens.to_string());
    set_header(r, "x-mock-rank", &s.rank.to_string());
    set_header(r, "x-mock-request-seq", &s.seq.to_string());
    set_header(r, "x-mock-queued-ms", &format!("{:.1}", s.queued_ms));
    set_header(r, "x-mock-slot-wait", if s.slot_wait { "1" } else { "0" });
    for (k, v) in &s.quota_headers {
        set_header(r, k, v);
    }
}

/// Paces the batched model's decode: each step of tokens takes the per-token time of the batch
/// as it is when the step starts, times the slowdown in force. Counts the request as decoding
/// while it lives.
struct Pacer {
    mock: Arc<Mock>,
    rank: usize,
    next: tokio::time::Instant,
    _decoding: ranks::Held,
}

impl Pacer {
    /// The pacer of a request decoding on `rank` (its batch is the rank's).
    fn new(mock: &Arc<Mock>, rank: usize) -> Self {
        Pacer {
            mock: mock.clone(),
            rank,
            next: tokio::time::Instant::now(),
            _decoding: ranks::hold(&mock.loads, rank, |l| &l.decoding, 1),
        }
    }

    /// Waits until `tokens` more tokens are decoded.
    async fn tokens(&mut self, tokens: u64) {
        let decoding = ranks::read(&self.mock.loads, self.rank, |l| &l.decoding).max(1);
        let ms =
            self.mock.args.params.per_token_ms(decoding) * tokens as f64 * self.mock.slow_now(true);
        let step = Duration::from_secs_f64(ms / 1000.0);
        self.next += step;
        tokio::time::sleep_until(self.next).await;
        self.mock.decoded(step, tokens);
    }
}

/// Serves a request under the batched model (see `mock_upstream/engine.rs`): the one-at-a-time
/// prefill of its rank, then decode in steps paced by the rank's batch; a plain answer's headers after the whole
/// generation, a streamed answer's first chunk after the prefill.
async fn serve_batched(
    mock: Arc<Mock>,
    conn: Arc<Conn>,
    guard: Busy,
    mut s: Serve,
) -> Response<Body> {
    {
        let asked = std::time::Instant::now();
        let _prefill = match mock.prefill.get(s.rank) {
            Some(m) => Some(m.lock().await),
            None => None,
        };
        s.queued_ms += asked.elapsed().as_secs_f64() * 1000.0;
        let uncached = s.prompt_tokens.saturating_sub(s.cached_tokens);
        let us =
            mock.args.prefill_us_per_token.saturating_mul(uncached) as f64 * mock.slow_now(true);
        let wait = Duration::from_secs_f64(us / 1e6) + Duration::from_millis(s.extra_delay_ms);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        if let Some(c) = mock.lock().ranks.cache(s.rank) {
            c.touch(&s.hashes);
        }
    }
    let a = &mock.args;
    let id = format!("chatcmpl-{}-{}", a.name, s.seq);
    let created = now_unix_s();
    let usage = openai::Usage {
        prompt_tokens: s.prompt_tokens,
        cached_tokens: s.cached_tokens,
        completion_tokens: s.completion_tokens,
    };
    let step = a.params.step_tokens.max(1) as usize;
    let mut r = if matches!(s.api, apis::Api::Responses | apis::Api::Messages) {
        // Not paced step by step: the whole decode at the batch's current per-token time.
        let decoding = ranks::read(&mock.loads, s.rank, |l| &l.decoding) + 1;
        let ms = a.params.per_token_ms(decoding) * s.completion_tokens as f64 * mock.slow_now(true);
        let decode = Duration::from_secs_f64(ms / 1000.0);
        other_api_answer(&mock, guard, &s, decode, created).await
    } else if s.stream {
        let words = openai::completion_words(&a.name, s.completion_tokens);
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let model = s.model.clone();
        let (cut, no_usage, rank) = (s.cut, s.no_usage, s.rank);
        let m = mock.clone();
        tokio::spawn(async move {
            let _guard = guard;
            let mut pacer = Pacer::new(&m, rank);
            let ev = |v: Value| Bytes::from(openai::sse(&v));
            let role = openai::chunk(
                &id,
                created,
                &model,
                json!({"role": "assistant", "content": ""}),
                None,
            );
            if tx.send(ev(role)).await.is_err() {
                return;
            }
            let steps: Vec<&[String]> = words.chunks(step).collect();
            for (i, ws) in steps.iter().enumerate() {
                if cut && i == steps.len() / 2 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    conn.reset();
                    return;
                }
                pacer.tokens(ws.len() as u64).await;
                let c = openai::chunk(&id, created, &model, json!({"content": ws.concat()}), None);
                if tx.send(ev(c)).await.is_err() {
                    return;
                }
            }
            let usage = (!no_usage).then_some(&usage);
            end_chat_stream(&tx, &id, created, &model, usage).await;
        });
        event_stream(rx)
    } else {
        let mut pacer = Pacer::new(&mock, s.rank);
        let mut left = s.completion_tokens;
        while left > 0 {
            let n = left.min(step as u64);
            pacer.tokens(n).await;
            left -= n;
        }
        drop(pacer);
        drop(guard);
        let words = openai::completion_words(&a.name, s.completion_tokens);
        plain_answer(&mock, &s, &words, &usage, &id, created)
    };
    answer_headers(&mut r, &mock, &s);
    r
}

/// The answer of the Responses and Messages APIs, streamed or not.
async fn other_api_answer(
    mock: &Arc<Mock>,
    guard: Busy,
    s: &Serve,
    decode: Duration,
    created: u64,
) -> Response<Body> {
    let name = &mock.args.name;
    let usage_id = format!("msg_{name}_{}", s.seq);
    let (events, body) = if s.api == apis::Api::Responses {
        let text = apis::responses_text(name, s.turns, s.completion_tokens);
        let meta = apis::ResponseMeta {
            id: &s.response_id,
            created,
            model: &s.model,
            previous_response_id: s.previous_response_id.as_deref(),
            store: s.store,
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
            completion_tokens: s.completion_tokens,
        };
        // Stream the same text word by word.
        let words: Vec<String> = text.split_inclusive(' ').map(str::to_string).collect();
        (
            apis::response_events(&meta, &words),
            apis::response_object(&meta, Some(&text)),
        )
    } else {
        let words = openai::completion_words(name, s.completion_tokens);
        let meta = apis::MessageMeta {
            id: &usage_id,
            model: &s.model,
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
            completion_tokens: s.completion_tokens,
        };
        (
            apis::message_events(&meta, &words),
            apis::message_object(&meta, &words.concat()),
        )
    };
    if !s.stream {
        if !decode.is_zero() {
            tokio::time::sleep(decode).await;
        }
        mock.decoded(decode, s.completion_tokens);
        drop(guard);
        return json_response(200, &body);
    }
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let per_event = decode / (events.len().max(1) as u32);
    // The decode's tokens spread over the events after the first.
    let (m, tokens, steps) = (
        mock.clone(),
        s.completion_tokens,
        events.len().max(2) as u64 - 1,
    );
    tokio::spawn(async move {
        let _guard = guard;
        for (i, e) in events.into_iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(per_event).await;
                let k = i as u64;
                m.decoded(per_event, tokens * k / steps - tokens * (k - 1) / steps);
            }
            if tx.send(Bytes::from(e)).await.is_err() {
                return;
            }
        }
    });
    event_stream(rx)
}

async fn read_json(req: Request<Incoming>) -> Result<Value, Response<Body>> {
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| json_response(400, &json!({"error": format!("reading body: {e}")})))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| json_response(400, &json!({"error": format!("bad JSON: {e}")})))
}

/// Replaces the fault; for `refuse` / leaving `refuse`, waits (≤ 5 s) until the listener state
/// matches so the caller can rely on it when this returns.
async fn apply_fault(mock: &Arc<Mock>, f: Fault) -> Result<(), String> {
    let refuse = f.mode == Mode::Refuse;
    let for_ms = f.for_ms;
    let gen = {
        let mut st = mock.lock();
        st.fault = f;
        st.fault_gen += 1;
        st.fault_gen
    };
    mock.listening.send_replace(!refuse);
    if let (true, Some(ms)) = (refuse, for_ms) {
        let m = mock.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let lifted = {
                let mut st = m.lock();
                if st.fault_gen == gen {
                    st.fault = Fault::none();
                    st.fault_gen += 1;
                    true
                } else {
                    false
                }
            };
            if lifted {
                m.listening.send_replace(true);
            }
        });
    }
    let mut rx = mock.bound.subscribe();
    let wanted = !refuse;
    let ok = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|b| *b == wanted)).await;
    match ok {
        Ok(Ok(_)) => Ok(()),
        _ => Err(format!(
            "listener did not become {}",
            if wanted { "bound" } else { "closed" }
        )),
    }
}

async fn handle(
    mock: Arc<Mock>,
    conn: Arc<Conn>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let method = req.method().clone();
    let r = match (method, path.as_str()) {
        (Method::POST, p) if apis::Api::from_path(p).is_some() => chat(mock, conn, req).await,
        // An upload (not inference): logged with its body size and faulted like the APIs
        // above, answered as a chat completion when not faulted.
        (Method::POST, "/v1/files") => chat(mock, conn, req).await,
        (Method::GET, "/v1/models") => {
            let ids: Vec<String> = if mock.args.models.is_empty() {
                vec!["mock".into()]
            } else {
                mock.args.models.clone()
            };
            let data: Vec<Value> = ids
                .iter()
                .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": mock.args.name}))
                .collect();
            json_response(200, &json!({"object": "list", "data": data}))
        }
        (Method::GET, "/health") | (Method::GET, "/_mock/health") => {
            json_response(200, &json!({"ok": true}))
        }
        (Method::GET, "/_mock/stats") => json_response(200, &mock.stats_json()),
        (Method::GET, "/metrics") => {
            let text = mock.metrics_text();
            let mut r = Response::new(full(text));
            set_header(
                &mut r,
                "content-type",
                "text/plain; version=0.0.4; charset=utf-8",
            );
            r
        }
        (Method::GET, "/_mock/requests") => {
            let limit = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("limit="))
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(usize::MAX);
            let st = mock.lock();
            let skip = st.log.len().saturating_sub(limit);
            let items: Vec<&Value> = st.log.iter().skip(skip).collect();
            json_response(200, &json!(items))
        }
        (Method::GET, "/_mock/fault") => json_response(200, &mock.lock().fault.to_json()),
        (Method::POST, "/_mock/fault") => match read_json(req).await {
            Err(r) => r,
            Ok(v) => match Fault::parse(&v) {
                Err(e) => json_response(400, &json!({"error": e})),
                Ok(f) => {
                    let shown = f.to_json();
                    match apply_fault(&mock, f).await {
                        Ok(()) => json_response(200, &json!({"ok": true, "fault": shown})),
                        Err(e) => json_response(500, &json!({"error": e, "fault": shown})),
                    }
                }
            },
        },
        (Method::GET, "/_mock/quota") => json_response(200, &mock.lock().quota.to_json()),
        (Method::GET, "/_mock/quota_usage") => {
            json_response(200, &mock.lock().quota.usage_log_json())
        }
        (Method::POST, "/_mock/quota") => match read_json(req).await {
            Err(r) => r,
            Ok(v) => {
                let mut st = mock.lock();
                match st.quota.configure(&v) {
                    Ok(()) => json_response(200, &json!({"ok": true, "quota": st.quota.to_json()})),
                    Err(e) => json_response(400, &json!({"error": e})),
                }
            }
        },
        (Method::POST, "/_mock/reset_stats") => {
            let mut st = mock.lock();
            st.stats = Stats::default();
            st.quota.rejected = 0;
            st.log.clear();
            drop(st);
            json_response(200, &json!({"ok": true}))
        }
        (Method::POST, "/_mock/flush_cache") => {
            mock.lock().ranks.flush();
            json_response(200, &json!({"ok": true}))
        }
        (_, p) => json_response(
            404,
            &openai::error(404, &format!("mock {}: no route for {p}", mock.args.name)),
        ),
    };
    Ok(r)
}

async fn serve_conn(mock: Arc<Mock>, stream: TcpStream, epoch: Option<watch::Receiver<u64>>) {
    let _ = stream.set_nodelay(true);
    let Ok(std_stream) = stream.into_std() else {
        return;
    };
    let Ok(dup) = std_stream.try_clone() else {
        return;
    };
    let Ok(stream) = TcpStream::from_std(std_stream) else {
        return;
    };
    let conn = Arc::new(Conn {
        dup,
        kill: Notify::new(),
    });
    let c = conn.clone();
    let m = mock.clone();
    let svc = service_fn(move |req| handle(m.clone(), c.clone(), req));
    let builder = auto::Builder::new(TokioExecutor::new());
    let serving = builder.serve_connection(TokioIo::new(stream), svc);
    let dropped = async move {
        match epoch {
            Some(mut rx) => {
                let _ = rx.changed().await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = serving => {}
        _ = conn.kill.notified() => {}
        _ = dropped => {}
    }
}

fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Serves the main port; closes it while `listening` is false and re-binds the same address.
async fn main_accept_loop(mock: Arc<Mock>, first: TcpListener, addr: SocketAddr) {
    let (epoch_tx, _) = watch::channel(0u64);
    let mut want = mock.listening.subscribe();
    let mut listener = Some(first);
    loop {
        if let Some(l) = listener.take() {
            mock.bound.send_replace(true);
            loop {
                tokio::select! {
                    r = l.accept() => match r {
                        Ok((s, _)) => {
                            tokio::spawn(serve_conn(mock.clone(), s, Some(epoch_tx.subscribe())));
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    },
                    r = want.changed() => {
                        if r.is_err() {
                            return;
                        }
                        if !*want.borrow_and_update() {
                            break;
                        }
                    }
                }
            }
            drop(l);
            epoch_tx.send_modify(|e| *e += 1);
            mock.bound.send_replace(false);
        }
        if want.wait_for(|w| *w).await.is_err() {
            return;
        }
        loop {
            match bind(addr) {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(e) => {
                    eprintln!(
                        "mock_upstream {}: re-bind {addr}: {e}; retrying",
                        mock.args.name
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

async fn control_accept_loop(mock: Arc<Mock>, l: TcpListener) {
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                tokio::spawn(serve_conn(mock.clone(), s, None));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let main_l = bind(SocketAddr::new(args.host, args.port))
        .map_err(|e| format!("bind {}:{}: {e}", args.host, args.port))?;
    let addr = main_l.local_addr().map_err(|e| e.to_string())?;
    let control = match args.control_port {
        Some(p) => {
            let l = bind(SocketAddr::new(args.host, p))
                .map_err(|e| format!("bind control {}:{p}: {e}", args.host))?;
            let a = l.local_addr().map_err(|e| e.to_string())?;
            Some((l, a))
        }
        None => None,
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "LISTENING {addr}");
    if let Some((_, a)) = &control {
        let _ = writeln!(out, "CONTROL {a}");
    }
    let _ = out.flush();
    drop(out);

    let (listening, _) = watch::channel(true);
    let (bound, _) = watch::channel(true);
    let ranks = ranks::Ranks::new(
        args.data_parallel_size,
        args.cache_tokens,
        args.block_tokens,
    );
    let mock = Arc::new(Mock {
        port: addr.port(),
        started: Instant::now(),
        seq: AtomicU64::new(0),
        in_flight: AtomicI64::new(0),
        slots: (0..ranks.size())
            .map(|_| {
                (args.max_concurrency > 0).then(|| Arc::new(Semaphore::new(args.max_concurrency)))
            })
            .collect(),
        loads: ranks.loads(),
        waiting: AtomicI64::new(0),
        running: AtomicI64::new(0),
        kv_blocks_used: AtomicI64::new(0),
        decode_us_total: AtomicU64::new(0),
        decode_tokens_total: AtomicU64::new(0),
        prefill: (0..ranks.size())
            .map(|_| tokio::sync::Mutex::new(()))
            .collect(),
        listening,
        bound,
        state: Mutex::new(State {
            stats: Stats::default(),
            log: VecDeque::new(),
            ranks,
            fault: Fault::none(),
            fault_gen: 0,
            responses: apis::ResponseStore::new(MAX_STORED_RESPONSES),
            quota: args.quota.clone(),
            rng: engine::SplitMix::new(
                args.params.seed ^ xxhash_rust::xxh3::xxh3_64(args.name.as_bytes()),
            ),
        }),
        args,
    });
    if let Some((l, _)) = control {
        tokio::spawn(control_accept_loop(mock.clone(), l));
    }
    main_accept_loop(mock, main_l, addr).await;
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) if e == "help" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("mock_upstream: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if args.exit_on_stdin_eof {
        std::thread::spawn(|| {
            let mut buf = [0u8; 256];
            let mut stdin = std::io::stdin();
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => std::process::exit(0),
                    Ok(_) => {}
                }
            }
        });
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mock_upstream: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mock_upstream: {e}");
            ExitCode::FAILURE
        }
    }
}
