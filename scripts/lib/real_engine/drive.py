"""Drives the real-engine comparison for scripts/real-engine: two llama.cpp `llama-server`
processes behind Envoy, once with the computeflux filter and once with Envoy's round_robin, and a
chat client that runs sessions of growing prompts through each.

Why: the project's benchmark mocks an engine; this measures what a real engine reports about
the prompt tokens it had to evaluate and the ones its prompt cache served, under each policy,
with the engine's own counters (`/metrics` with `--metrics`) and per-answer `usage`.

How (per policy, engines restarted so caches start cold):
1. start two llama-server processes on free loopback ports (llama-server cannot bind port 0:
   a port is found by binding a socket and closing it, retried if the start fails);
2. start Envoy with a bootstrap shaped like the integration tests' (tests/support/envoy.rs
   render_bootstrap: the wasm filter writes the cluster into `x-computeflux-cluster`, the
   route forwards on it; one cluster per engine) or, for round_robin, one cluster holding
   both engines; both routes add `x-real-engine-upstream: %UPSTREAM_REMOTE_ADDRESS%` to
   answers so the client knows which engine served every request under either policy;
3. scrape both engines' `/metrics`, run the client, scrape again; keep the deltas, the raw
   final scrapes, `/slots`, and (with the filter) Envoy's `computeflux` stats;
4. stop Envoy and the engines (by PID).

The client: N sessions × T turns; all sessions share one system prompt; each turn appends a
user message of fresh words and the previous answer, so every follow-up's prompt extends the
previous one (the prefix an engine can serve from cache). Each session sends `x-session-id`.
At most C requests are in flight at once. `max_tokens` is small; the model never emits an end
token, so every answer has exactly `max_tokens` tokens.

Usage: python3 drive.py --server BIN --model GGUF --envoy BIN --wasm WASM --out DIR
       [--sessions 48] [--turns 8] [--concurrency 4] [--max-tokens 16] [--user-words 40]
       [--system-words 150] [--policies computeflux,round_robin] [--ctx 4096] [--parallel 2]
       [--threads 1] [--seed 23] [--meta JSON]
Writes DIR/latest.json and DIR/latest.md. `python3 drive.py --from-json DIR/latest.json` prints
the Markdown report of an earlier run again (after a change to the report's layout). The
report's analysis section (decode pace vs the engines' batch, a replay of the slowness rule) is
decode_pace.py's. Streams need `--max-tokens` ≥ 17 for the filter to judge their decode phase
(it needs 16 tokens after the first).
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_pace  # noqa: E402
import words as wordlist  # noqa: E402

ENGINE_NAMES = ("e0", "e1")
# computeflux: the filter with each endpoint's `metrics` (format llamacpp) so it scrapes the
# engines' load; computeflux_no_metrics: the same filter without (what it sees is only what
# passes through it); round_robin: Envoy's balancer over one cluster of both engines.
FILTER_POLICIES = ("computeflux", "computeflux_no_metrics")
POLICIES = FILTER_POLICIES + ("round_robin",)
UPSTREAM_HEADER = "x-real-engine-upstream"
COUNTERS = (
    "prompt_tokens_total",
    "prompt_tokens_cached_total",
    "tokens_predicted_total",
    "n_decode_total",
    "prompt_seconds_total",
    "tokens_predicted_seconds_total",
)


def log(msg):
    print(f"real-engine: {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, headers=None, timeout=120.0):
    """(status, headers dict lower-cased, body bytes); never raises for HTTP status codes."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def http_stream(url, body, headers, timeout=120.0):
    """A streamed (SSE) POST: (status, headers, the whole body, monotonic time of the first
    body byte or None)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    for k, v in headers.items():
        req.add_header(k, v)
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            first = r.read(1)
            ttfb = time.monotonic() if first else None
            return r.status, {k.lower(): v for k, v in r.headers.items()}, first + r.read(), ttfb
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read(), None


def sse_to_answer(raw):
    """A chat completion stream folded into the shape of a plain answer: the content of its
    deltas, and the `usage` and llama.cpp `timings` of its last chunks."""
    content, usage, timings = [], None, None
    for line in raw.decode(errors="replace").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            obj = json.loads(line[6:])
        except ValueError:
            continue
        for c in obj.get("choices") or []:
            content.append((c.get("delta") or {}).get("content") or "")
        usage = obj.get("usage") or usage
        timings = obj.get("timings") or timings
    return {"choices": [{"message": {"content": "".join(content)}}], "usage": usage,
            "timings": timings}


def wait_until(pred, timeout_s, what, proc=None, logfile=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = ""
            if logfile and os.path.exists(logfile):
                with open(logfile, errors="replace") as f:
                    tail = "".join(f.readlines()[-20:])
            raise RuntimeError(f"{what}: process exited with {proc.returncode}\n{tail}")
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready after {timeout_s} s")


class Procs:
    """Every process this driver started, stopped by PID (and listed in a pid file so the
    calling script can stop them if the driver dies)."""

    def __init__(self, pid_file):
        self.procs = []
        self.pid_file = pid_file

    def start(self, args, logfile):
        f = open(logfile, "ab")
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        f.close()
        self.procs.append(p)
        if self.pid_file:
            with open(self.pid_file, "a") as pf:
                pf.write(f"{p.pid}\n")
        return p

    def stop(self, p):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self):
        for p in list(self.procs):
            self.stop(p)


# ---------------------------------------------------------------------------------------------
# llama-server


def parse_metrics(text):
    """{name without the `llamacpp:` prefix: value} for the unlabelled llama.cpp series."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^llamacpp:([A-Za-z_]+)\s+(\S+)$", line.strip())
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


class Engine:
    def __init__(self, name, args, procs, workdir):
        self.name, self.a, self.procs = name, args, procs
        self.log = os.path.join(workdir, f"llama-server-{name}.log")
        self.port = None
        self.proc = None

    def argv(self, port):
        a = self.a
        return [
            a.server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port),
            "-c", str(a.ctx), "-np", str(a.parallel), "-t", str(a.threads), "-tb", str(a.threads),
            "--metrics", "--slots", "--no-webui", "-a", "tiny",
            # Prompt caching (on by default; said explicitly): a slot keeps its KV cache and a
            # request is given the slot whose cached prompt it extends most; idle slots are
            # saved to a host-memory prompt cache (--cache-ram, MiB) and restored from it.
            "--cache-prompt", "--slot-prompt-similarity", "0.1", "--cache-ram", str(a.cache_ram_mib),
        ]

    def start(self):
        for _ in range(5):
            port = free_port()
            self.proc = self.procs.start(self.argv(port), self.log)
            try:
                wait_until(lambda: http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200,
                           120, f"llama-server {self.name}", self.proc, self.log)
                self.port = port
                return
            except RuntimeError as e:
                self.procs.stop(self.proc)
                last = e
        raise last

    def stop(self):
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def metrics_text(self):
        status, _, body = http("GET", self.url("/metrics"), timeout=10)
        if status != 200:
            raise RuntimeError(f"{self.name} /metrics answered {status}")
        return body.decode()

    def slots(self):
        status, _, body = http("GET", self.url("/slots"), timeout=10)
        return json.loads(body) if status == 200 else {"status": status}


# ---------------------------------------------------------------------------------------------
# Envoy


def bootstrap(policy, engines, wasm, listener_port, admin_port, scrape_interval_ms):
    """Shaped like tests/support/envoy.rs render_bootstrap (same filter block, same routing
    header); round_robin is one cluster with both engines."""
    buffer = 16 * 1024 * 1024
    upstream_hdr = [{"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    high = {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                            "max_requests": 100000, "max_retries": 1000}]}

    def cluster(name, ports, lb=None):
        c = {
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "per_connection_buffer_limit_bytes": buffer, "circuit_breakers": high,
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                for p in ports]}]},
        }
        if lb:
            c["lb_policy"] = lb
        return c

    filters = []
    if policy in FILTER_POLICIES:
        plugin = {"endpoints": [{"name": e.name, "cluster": e.name} for e in engines]}
        if policy == "computeflux":
            # The engines' own load, scraped by the filter from their `--metrics` page through
            # their cluster (the same one the API goes to).
            for ep in plugin["endpoints"]:
                ep["metrics"] = {"path": "/metrics", "format": "llamacpp",
                                 "interval_ms": scrape_interval_ms}
        route = {"cluster_header": "x-computeflux-cluster", "timeout": "120s"}
        entry = {"match": {"prefix": "/"}, "route": route,
                 "request_headers_to_remove": ["x-computeflux-cluster"],
                 "response_headers_to_add": upstream_hdr}
        clusters = [cluster(e.name, [e.port]) for e in engines]
        filters.append({
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": "computeflux", "root_id": "computeflux",
                    "vm_config": {"vm_id": "computeflux", "runtime": "envoy.wasm.runtime.v8",
                                  "code": {"local": {"filename": wasm}}},
                    "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                      "value": json.dumps(plugin)},
                    "allow_on_headers_stop_iteration": True,
                    "failure_policy": "FAIL_RELOAD",
                },
            },
        })
    else:
        plugin = None
        entry = {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "120s"},
                 "response_headers_to_add": upstream_hdr}
        clusters = [cluster("pool", [e.port for e in engines], "ROUND_ROBIN")]
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "computeflux", "codec_type": "AUTO",
        "route_config": {"name": "computeflux", "virtual_hosts": [
            {"name": "all", "domains": ["*"], "routes": [entry]}]},
        "http_filters": filters,
    }
    return {
        "node": {"id": "real-engine", "cluster": "real-engine"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{"name": "computeflux",
                           "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener_port}},
                           "per_connection_buffer_limit_bytes": buffer,
                           "filter_chains": [{"filters": [{
                               "name": "envoy.filters.network.http_connection_manager",
                               "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
    }, plugin


class Envoy:
    def __init__(self, a, procs, workdir, policy, engines):
        self.a, self.procs, self.policy = a, procs, policy
        self.dir = workdir
        self.log = os.path.join(workdir, f"envoy-{policy}.log")
        self.engines = engines
        self.proc = None

    def start(self):
        for attempt in range(5):
            self.port, self.admin = free_port(), free_port()
            cfg, self.plugin = bootstrap(self.policy, self.engines, self.a.wasm, self.port, self.admin,
                                         self.a.scrape_interval_ms)
            path = os.path.join(self.dir, f"envoy-{self.policy}.json")
            with open(path, "w") as f:
                json.dump(cfg, f, indent=1)
            self.config_path = path
            self.proc = self.procs.start(
                [self.a.envoy, "-c", path, "--concurrency", "2", "--disable-hot-restart",
                 "--base-id", str(os.getpid() % 10000 * 10 + attempt), "--log-level", "warn",
                 "--log-path", self.log], self.log + ".stderr")
            try:
                wait_until(lambda: http("GET", f"http://127.0.0.1:{self.admin}/ready", timeout=2)[0] == 200,
                           60, f"envoy ({self.policy})", self.proc, self.log + ".stderr")
                wait_until(lambda: socket.create_connection(("127.0.0.1", self.port), 1).close() is None,
                           20, "envoy listener", self.proc, self.log + ".stderr")
                return
            except RuntimeError as e:
                self.procs.stop(self.proc)
                last = e
        raise last

    def stop(self):
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

    def computeflux_stats(self):
        status, _, body = http("GET", f"http://127.0.0.1:{self.admin}/stats?filter=computeflux_&format=json", timeout=10)
        if status != 200:
            return {"status": status}
        out = {}
        for s in json.loads(body).get("stats", []):
            if "name" in s and "value" in s:
                out[s["name"]] = s["value"]
        return out


# ---------------------------------------------------------------------------------------------
# Sampling the engines' load and the filter's view of it at the same moments

ENGINE_GAUGES = ("requests_processing", "requests_deferred")
# Envoy shows the filter's per-endpoint gauges as wasmcustom.<name>.endpoint.<endpoint>.
FILTER_GAUGES = ("computeflux_engine_running", "computeflux_engine_waiting",
                 "computeflux_engine_kv_usage_permille", "computeflux_scrape_age_ms",
                 "computeflux_slowness_permille", "computeflux_degraded", "computeflux_saturated",
                 "computeflux_in_flight", "computeflux_ewma_latency_ms")
FILTER_STATS_RE = re.compile(r"^wasmcustom\.(computeflux_[a-z_]+)\.endpoint\.([A-Za-z0-9_-]+)$")


def engine_load(text):
    """The engine's queue gauges and, if its page has one, its KV-cache usage (llama.cpp builds
    of some versions export `llamacpp:kv_cache_usage_ratio`; this one may not)."""
    m = parse_metrics(text)
    out = {k: m.get(k) for k in ENGINE_GAUGES}
    kv = [v for k, v in m.items() if k.startswith("kv_cache_usage")]
    out["kv_cache_usage"] = kv[0] if kv else None
    return out


class Sampler:
    """Every `period_s`, reads both engines' `/metrics` and (with the filter) Envoy's stats of
    the filter's scraped gauges concurrently, so each sample pairs what the engine says with what
    the filter holds at (nearly) the same moment. Each read's own duration is kept."""

    def __init__(self, engines, envoy, period_s, run_t0):
        self.engines, self.envoy, self.period_s, self.t0 = engines, envoy, period_s, run_t0
        self.samples = []
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(engines) + 1)

    def read_engine(self, e):
        t = time.monotonic()
        try:
            v = engine_load(e.metrics_text())
        except (OSError, RuntimeError) as err:
            v = {"error": str(err)[:100]}
        v["read_ms"] = round(1000 * (time.monotonic() - t), 1)
        return v

    def read_filter(self):
        t = time.monotonic()
        out = {}
        try:
            status, _, body = http("GET", f"http://127.0.0.1:{self.envoy.admin}/stats?format=json&filter="
                                   + urllib.request.quote("^wasmcustom\\.computeflux_"), timeout=5)
            if status == 200:
                for st in json.loads(body).get("stats", []):
                    m = FILTER_STATS_RE.match(st.get("name", ""))
                    if m and m.group(1) in FILTER_GAUGES and "value" in st:
                        out.setdefault(m.group(2), {})[m.group(1)] = st["value"]
        except (OSError, ValueError) as err:
            out = {"error": str(err)[:100]}
        return out, round(1000 * (time.monotonic() - t), 1)

    def loop(self):
        # One sample at a random moment of each period: a fixed period equal to (or a multiple
        # of) the filter's scrape interval would lock onto its phase and always look just after
        # a scrape (fresh values, ages of a few ms).
        rng = random.Random(7)
        start = time.monotonic()
        k = 0
        while not self.stop_ev.is_set():
            at = start + (k + rng.random()) * self.period_s
            k += 1
            if self.stop_ev.wait(max(0.0, at - time.monotonic())):
                break
            t = time.monotonic()
            futs = {e.name: self.pool.submit(self.read_engine, e) for e in self.engines}
            ff = self.pool.submit(self.read_filter) if self.envoy is not None else None
            sample = {"t_s": round(t - self.t0, 3),
                      "engines": {n: f.result() for n, f in futs.items()}}
            if ff is not None:
                sample["filter"], sample["filter_read_ms"] = ff.result()
            self.samples.append(sample)
            # The next window starts after this one (reads that overran it skip windows).
            k = max(k, int((time.monotonic() - start) / self.period_s))

    def start(self):
        self.thread.start()

    def stop(self):
        self.stop_ev.set()
        self.thread.join(timeout=10)
        self.pool.shutdown(wait=True)
        return self.samples


def compare_samples(samples, names, active_until_s=None):
    """Per endpoint: how the filter's scraped running/waiting matched the engine's own gauges at
    the same moments (mean and max absolute difference, share of samples equal, means of both),
    the scrape age seen, and the slowness/degraded/saturated gauges over the run. Samples after
    `active_until_s` (the client's last answer) are left out, so an idle tail does not dilute the
    difference."""
    out = {}
    for n in names:
        pairs = {"running": [], "waiting": []}
        ages, slow, degraded, saturated, in_flight_vs_engine = [], [], [], [], []
        for smp in samples:
            if active_until_s is not None and smp["t_s"] > active_until_s:
                continue
            e = smp["engines"].get(n, {})
            f = (smp.get("filter") or {}).get(n, {})
            for key, ek, fk in (("running", "requests_processing", "computeflux_engine_running"),
                                ("waiting", "requests_deferred", "computeflux_engine_waiting")):
                if e.get(ek) is not None and f.get(fk) is not None:
                    pairs[key].append((e[ek], f[fk]))
            if f.get("computeflux_scrape_age_ms") is not None:
                ages.append(f["computeflux_scrape_age_ms"])
            if f.get("computeflux_slowness_permille"):
                slow.append(f["computeflux_slowness_permille"])
            degraded.append(f.get("computeflux_degraded") or 0)
            saturated.append(f.get("computeflux_saturated") or 0)
            if f.get("computeflux_in_flight") is not None and e.get("requests_processing") is not None:
                in_flight_vs_engine.append((e["requests_processing"] + (e.get("requests_deferred") or 0),
                                            f["computeflux_in_flight"]))
        d = {}
        # Baseline for the differences: how much the engine's own gauges move between two
        # consecutive samples (what a value one sample period old would be off by).
        for key, ek in (("running", "requests_processing"), ("waiting", "requests_deferred")):
            series = [smp["engines"].get(n, {}).get(ek) for smp in samples
                      if active_until_s is None or smp["t_s"] <= active_until_s]
            series = [x for x in series if x is not None]
            if len(series) > 1:
                steps = [abs(b - a) for a, b in zip(series, series[1:])]
                d[f"engine_{key}_step_mean_abs"] = round(sum(steps) / len(steps), 3)
        for key, ps in list(pairs.items()) + [("in_flight_vs_engine_total", in_flight_vs_engine)]:
            if not ps:
                continue
            diffs = [abs(a - b) for a, b in ps]
            d[key] = {"samples": len(ps),
                      "mean_abs_diff": round(sum(diffs) / len(ps), 3),
                      "max_abs_diff": max(diffs),
                      "equal_pct": round(100.0 * sum(x == 0 for x in diffs) / len(ps), 1),
                      "engine_mean": round(sum(a for a, _ in ps) / len(ps), 3),
                      "filter_mean": round(sum(b for _, b in ps) / len(ps), 3)}
        if ages:
            d["scrape_age_ms"] = {"max": max(ages), "mean": round(sum(ages) / len(ages), 1)}
        if slow:
            ss = sorted(slow)
            d["slowness_permille"] = {"min": ss[0], "median": ss[len(ss) // 2], "max": ss[-1],
                                      "samples": len(ss)}
        d["degraded_samples"] = sum(1 for x in degraded if x)
        d["saturated_samples"] = sum(1 for x in saturated if x)
        kv = [smp["engines"].get(n, {}).get("kv_cache_usage") for smp in samples]
        d["engine_kv_cache_usage_exported"] = any(x is not None for x in kv)
        out[n] = d
    return out


# ---------------------------------------------------------------------------------------------
# The client


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(p / 100.0 * len(xs) + 0.5)) - 1))
    return xs[k]


def run_client(a, port, by_port, run_t0):
    vocab = wordlist.words()
    sysrng = random.Random(a.seed)
    system = "you are a helpful assistant . " + " ".join(sysrng.choice(vocab) for _ in range(a.system_words))
    sem = threading.Semaphore(a.concurrency)
    records = []
    lock = threading.Lock()
    errors = []

    def session(i):
        rng = random.Random(a.seed * 1000 + i)
        sid = f"s{a.seed}-{i}"
        msgs = [{"role": "system", "content": system}]
        time.sleep(rng.random() * a.stagger_s)
        for t in range(a.turns):
            msgs.append({"role": "user", "content": f"question {t + 1} : "
                         + " ".join(rng.choice(vocab) for _ in range(a.user_words))})
            body = {"model": "tiny", "messages": msgs, "max_tokens": a.max_tokens,
                    "temperature": 1.0, "seed": rng.randrange(1 << 30), "cache_prompt": True}
            # Drawn only when asked for, so that runs without streamed answers send exactly
            # the requests they sent before the option existed.
            streamed = a.stream_fraction > 0 and rng.random() < a.stream_fraction
            if streamed:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            ttfb = None
            with sem:
                t0 = time.monotonic()
                try:
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    if streamed:
                        status, hdrs, raw, ttfb = http_stream(url, body, {"x-session-id": sid}, timeout=300)
                    else:
                        status, hdrs, raw = http("POST", url, body, {"x-session-id": sid}, timeout=300)
                except OSError as e:
                    status, hdrs, raw = 0, {}, str(e).encode()
                dt = time.monotonic() - t0
            rec = {"session": i, "turn": t + 1, "status": status, "latency_s": dt, "stream": streamed,
                   "ttfb_s": None if ttfb is None else round(ttfb - t0, 4),
                   "start_s": round(t0 - run_t0, 3), "end_s": round(t0 + dt - run_t0, 3),
                   "endpoint": hdrs.get("x-computeflux-endpoint"),
                   "affinity": hdrs.get("x-computeflux-affinity"),
                   "upstream": by_port.get(hdrs.get(UPSTREAM_HEADER, "").rsplit(":", 1)[-1])}
            if status == 200:
                ans = sse_to_answer(raw) if streamed else json.loads(raw)
                u = ans.get("usage") or {}
                tm = ans.get("timings") or {}
                rec.update(prompt_tokens=u.get("prompt_tokens"),
                           cached_tokens=(u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                           completion_tokens=u.get("completion_tokens"),
                           evaluated=tm.get("prompt_n"), cache_n=tm.get("cache_n"),
                           prompt_ms=tm.get("prompt_ms"), predicted_ms=tm.get("predicted_ms"))
                content = ans["choices"][0]["message"].get("content") or ""
                msgs.append({"role": "assistant", "content": content})
            else:
                with lock:
                    errors.append({"session": i, "turn": t + 1, "status": status,
                                   "body": raw[:300].decode(errors="replace")})
                msgs.append({"role": "assistant", "content": "error"})
            with lock:
                records.append(rec)

    with concurrent.futures.ThreadPoolExecutor(max_workers=a.sessions) as ex:
        list(ex.map(session, range(a.sessions)))
    wall = time.monotonic() - run_t0
    return records, errors, wall


def summarize(records, errors, wall, deltas):
    ok = [r for r in records if r["status"] == 200]
    by_sess = {}
    for r in sorted(records, key=lambda r: (r["session"], r["turn"])):
        by_sess.setdefault(r["session"], []).append(r)
    follow, kept = 0, 0
    for rs in by_sess.values():
        for prev, cur in zip(rs, rs[1:]):
            if prev["status"] == 200 and cur["status"] == 200:
                follow += 1
                kept += prev["upstream"] is not None and prev["upstream"] == cur["upstream"]
    lat = [r["latency_s"] for r in ok]
    fl = [r["latency_s"] for r in ok if r["turn"] > 1]
    s = lambda k: sum((r.get(k) or 0) for r in ok)  # noqa: E731
    served = {}
    for r in ok:
        served[r["upstream"]] = served.get(r["upstream"], 0) + 1
    affinity = {}
    for r in ok:
        if r["affinity"]:
            affinity[r["affinity"]] = affinity.get(r["affinity"], 0) + 1
    agree = None
    if any(r["endpoint"] for r in ok):
        agree = sum(r["endpoint"] == r["upstream"] for r in ok)
    # The engine's own compute for each answer (its `timings`: prompt + decode) and the rest of
    # the client's latency: waiting in the engine's queue for a slot (`requests_deferred`),
    # HTTP and Envoy.
    compute = [(r.get("prompt_ms") or 0) + (r.get("predicted_ms") or 0) for r in ok
               if r.get("prompt_ms") is not None]
    outside = [1000 * r["latency_s"] - (r.get("prompt_ms") or 0) - (r.get("predicted_ms") or 0)
               for r in ok if r.get("prompt_ms") is not None]
    ev = sum(d.get("prompt_tokens_total", 0) for d in deltas.values())
    ca = sum(d.get("prompt_tokens_cached_total", 0) for d in deltas.values())
    return {
        "requests": len(records), "ok": len(ok), "errors": len(errors),
        "follow_ups": follow, "follow_ups_on_previous_engine": kept,
        "follow_ups_kept_pct": round(100.0 * kept / follow, 1) if follow else None,
        "served_per_engine": served,
        "filter_header_matches_upstream": agree,
        "filter_affinity_headers": affinity,
        "usage_prompt_tokens": s("prompt_tokens"), "usage_cached_tokens": s("cached_tokens"),
        "timings_prompt_n": s("evaluated"), "timings_cache_n": s("cache_n"),
        "completion_tokens": s("completion_tokens"),
        "engine_prompt_tokens_evaluated": ev, "engine_prompt_tokens_cached": ca,
        "engine_cached_pct": round(100.0 * ca / (ev + ca), 1) if ev + ca else None,
        "wall_s": round(wall, 2),
        "engine_compute_p50_ms": round(percentile(compute, 50), 1) if compute else None,
        "engine_compute_p99_ms": round(percentile(compute, 99), 1) if compute else None,
        "outside_compute_mean_ms": round(sum(outside) / len(outside), 1) if outside else None,
        "outside_compute_p99_ms": round(percentile(outside, 99), 1) if outside else None,
        "engine_prompt_ms_per_token": round(1000 * sum(d.get("prompt_seconds_total", 0) for d in deltas.values())
                                            / ev, 3) if ev else None,
        "engine_decode_ms_per_token": round(1000 * sum(d.get("tokens_predicted_seconds_total", 0) for d in deltas.values())
                                            / max(1, sum(d.get("tokens_predicted_total", 0) for d in deltas.values())), 2),
        "latency_p50_ms": round(1000 * percentile(lat, 50), 1) if lat else None,
        "latency_p99_ms": round(1000 * percentile(lat, 99), 1) if lat else None,
        "follow_up_latency_p50_ms": round(1000 * percentile(fl, 50), 1) if fl else None,
        "follow_up_latency_p99_ms": round(1000 * percentile(fl, 99), 1) if fl else None,
    }


def run_policy(a, policy, procs, workdir):
    engines = [Engine(n, a, procs, workdir) for n in ENGINE_NAMES]
    envoy = None
    try:
        for e in engines:
            e.start()
        by_port = {str(e.port): e.name for e in engines}
        envoy = Envoy(a, procs, workdir, policy, engines)
        envoy.start()
        log(f"{policy}: engines on {[e.port for e in engines]}, envoy on {envoy.port} (admin {envoy.admin})")
        before = {e.name: parse_metrics(e.metrics_text()) for e in engines}
        if policy == "computeflux":
            # Let the filter's first scrapes land before the first request.
            wait_until(lambda: all(envoy.computeflux_stats().get(
                f"wasmcustom.computeflux_scrapes_total.endpoint.{e.name}", 0) > 0 for e in engines),
                10, "the filter's first scrapes")
        stats_before = envoy.computeflux_stats() if policy in FILTER_POLICIES else {}
        run_t0 = time.monotonic()
        sampler = Sampler(engines, envoy if policy in FILTER_POLICIES else None, a.sample_period_s, run_t0)
        sampler.start()
        try:
            records, errors, wall = run_client(a, envoy.port, by_port, run_t0)
        finally:
            samples = sampler.stop()
        time.sleep(0.5)
        raw_after = {e.name: e.metrics_text() for e in engines}
        after = {n: parse_metrics(t) for n, t in raw_after.items()}
        deltas = {n: {k: round(after[n].get(k, 0) - before[n].get(k, 0), 3) for k in COUNTERS}
                  for n in after}
        # Cross-check: what the answers' `usage` says each engine did vs its own counters.
        per_engine_usage = {}
        for r in records:
            if r["status"] == 200 and r["upstream"]:
                d = per_engine_usage.setdefault(r["upstream"], {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
                d["requests"] += 1
                d["prompt_tokens"] += r.get("prompt_tokens") or 0
                d["cached_tokens"] += r.get("cached_tokens") or 0
        out = {
            "policy": policy,
            "summary": summarize(records, errors, wall, deltas),
            "engine_metric_deltas": deltas,
            "per_engine_usage": per_engine_usage,
            "engine_metrics_final_raw": raw_after,
            "engine_slots_final": {e.name: e.slots() for e in engines},
            "plugin_config": envoy.plugin,
            "errors": errors[:20],
            "records": records,
        }
        out["samples"] = samples
        last_end = max((r["end_s"] for r in records), default=None)
        out["scraped_vs_engine"] = compare_samples(samples, [e.name for e in engines], last_end)
        if policy in FILTER_POLICIES:
            out["envoy_computeflux_stats"] = envoy.computeflux_stats()
            # The stats before the client ran (the first scrapes happen before it).
            out["envoy_computeflux_stats_before"] = stats_before
        return out
    finally:
        if envoy:
            envoy.stop()
        for e in engines:
            e.stop()


# ---------------------------------------------------------------------------------------------
# Report


def fmt(v):
    return "—" if v is None else (f"{v:,}" if isinstance(v, int) else str(v))


def report_md(res):
    m = res["meta"]
    L = []
    names = [p["policy"] for p in res["policies"]]
    L.append(f"# Real engine: {' vs '.join(names) or 'no policy'} in front of two llama.cpp servers\n")
    la = res.get("load_average_start") or [0.0]
    L.append(f"Generated {res['generated_utc']} on {res.get('cpus', '?')} cores shared with other work "
             f"(load average {la[0]:.1f} at start) by `{m.get('command', 'scripts/real-engine')}` "
             f"(branch `{m.get('git_branch', '?')}`, commit `{m.get('git_commit', '?')}`).\n")
    L.append("## Setup\n")
    L.append(f"- Engines: two `llama-server` processes ({m.get('llama_server_version', '?')}), built from the "
             f"llama.cpp tree vendored in the `llama-cpp-python` {m.get('llama_cpp_python', '?')} source "
             f"distribution (cmake {m.get('cmake', '?')}, ninja {m.get('ninja', '?')} from PyPI; "
             f"build: {m.get('build_time', '?')}).")
    a = res["args"]
    L.append(f"- Engine flags: `-c {a['ctx']} -np {a['parallel']} -t {a['threads']} --metrics --slots "
             f"--cache-prompt --slot-prompt-similarity 0.1 --cache-ram {a['cache_ram_mib']}` "
             f"(each slot holds {a['ctx'] // a['parallel']} tokens).")
    L.append(f"- Model: {m.get('model', '?')}")
    L.append(f"- Envoy {m.get('envoy_version', '?')}, `--concurrency 2`; the filter: "
             f"`target/wasm32-wasip1/release/computeflux.wasm` with its default configuration plus "
             f"the two endpoints:")
    for p in res["policies"]:
        if p.get("plugin_config"):
            L.append(f"  - `{p['policy']}`: `{json.dumps(p['plugin_config'])}`")
    if "round_robin" in names:
        L.append("  - `round_robin`: no filter; one Envoy cluster holding both engines, `lb_policy: ROUND_ROBIN`.")
    L.append(f"- Client: {a['sessions']} sessions × {a['turns']} turns, at most {a['concurrency']} requests in "
             f"flight, shared system prompt of {a['system_words']} words, {a['user_words']} new words per "
             f"user turn, `max_tokens` {a['max_tokens']} (the model never stops early), `x-session-id` "
             f"per session, sessions start within {a['stagger_s']} s"
             + (f", {round(100 * a['stream_fraction'])} % of requests streamed (SSE with "
                "`stream_options.include_usage`)" if a.get("stream_fraction") else ", every answer plain (not streamed)")
             + ". Engines are restarted between "
             f"policies, so every policy starts with cold caches.\n")
    L.append("## Results\n")
    cols = ["policy", "follow-ups on previous engine", "prompt tokens evaluated (engines)",
            "served from cache (engines)", "cached share", "requests per engine", "wall", "p50", "p99",
            "follow-up p50", "follow-up p99", "errors"]
    L.append("| " + " | ".join(cols) + " |")
    L.append("|" + "---|" * len(cols))
    for p in res["policies"]:
        s = p["summary"]
        served = ", ".join(f"{k}: {v}" for k, v in sorted(s["served_per_engine"].items(), key=lambda kv: str(kv[0])))
        L.append("| " + " | ".join([
            p["policy"],
            f"{s['follow_ups_on_previous_engine']} / {s['follow_ups']} ({fmt(s['follow_ups_kept_pct'])} %)",
            fmt(int(s["engine_prompt_tokens_evaluated"])), fmt(int(s["engine_prompt_tokens_cached"])),
            f"{fmt(s['engine_cached_pct'])} %", served, f"{s['wall_s']} s",
            f"{fmt(s['latency_p50_ms'])} ms", f"{fmt(s['latency_p99_ms'])} ms",
            f"{fmt(s['follow_up_latency_p50_ms'])} ms", f"{fmt(s['follow_up_latency_p99_ms'])} ms",
            str(s["errors"])]) + " |")
    L.append("")
    L.append("Prompt tokens evaluated / served from cache are the deltas of the engines' own "
             "`llamacpp:prompt_tokens_total` (\"processed, excluding cached\") and "
             "`llamacpp:prompt_tokens_cached_total` over the run, summed over both engines. "
             "Which engine served a request comes from Envoy's upstream address "
             f"(`{UPSTREAM_HEADER}`), for every policy. Cached share = cached ÷ (evaluated + cached). "
             "p50/p99 are client-side latencies of every request (Envoy included); wall is the "
             "whole client run.\n")
    L.append("Where the time went (client latency = the engine's compute for the answer, from its "
             "`timings`, + the rest: waiting in the engine's queue for one of its slots, HTTP, Envoy), "
             "the engines' own compute speed over the run (their `prompt_seconds_total` ÷ "
             "`prompt_tokens_total`, `tokens_predicted_seconds_total` ÷ `tokens_predicted_total`), and "
             "the machine's 1-minute load average when the policy's run started and ended (other "
             "helpers' builds share its 2 cores; the engines run at nice):\n")
    L.append("| policy | engine compute p50 / p99 | outside compute mean / p99 | prompt ms per token | decode ms per token | load average start → end |")
    L.append("|---|---|---|---|---|---|")
    for p in res["policies"]:
        s = p["summary"]
        if s.get("engine_compute_p50_ms") is None:
            continue
        la0, la1 = p.get("load_average_start") or [0], p.get("load_average_end") or [0]
        L.append(f"| {p['policy']} | {fmt(s['engine_compute_p50_ms'])} / {fmt(s['engine_compute_p99_ms'])} ms | "
                 f"{fmt(s['outside_compute_mean_ms'])} / {fmt(s['outside_compute_p99_ms'])} ms | "
                 f"{fmt(s['engine_prompt_ms_per_token'])} | {fmt(s['engine_decode_ms_per_token'])} | "
                 f"{la0[0]:.1f} → {la1[0]:.1f} |")
    L.append("")
    L.append("### Cross-checks\n")
    L.append("| policy | engine | requests | Σ usage.prompt_tokens | Σ usage cached_tokens | Δ prompt_tokens_total + Δ prompt_tokens_cached_total | Δ prompt_tokens_cached_total | Δ tokens_predicted_total |")
    L.append("|---|---|---|---|---|---|---|---|")
    for p in res["policies"]:
        for n, d in sorted(p["engine_metric_deltas"].items()):
            u = p["per_engine_usage"].get(n, {})
            L.append(f"| {p['policy']} | {n} | {u.get('requests', 0)} | {fmt(u.get('prompt_tokens', 0))} | "
                     f"{fmt(u.get('cached_tokens', 0))} | "
                     f"{fmt(int(d['prompt_tokens_total'] + d['prompt_tokens_cached_total']))} | "
                     f"{fmt(int(d['prompt_tokens_cached_total']))} | {fmt(int(d['tokens_predicted_total']))} |")
    for p in res["policies"]:
        s = p["summary"]
        if s["filter_header_matches_upstream"] is not None:
            L.append(f"\n`x-computeflux-endpoint` named the engine Envoy forwarded to in "
                     f"{s['filter_header_matches_upstream']} of {s['ok']} answers ({p['policy']}); "
                     f"`x-computeflux-affinity`: "
                     + ", ".join(f"{k} {v}" for k, v in sorted(s["filter_affinity_headers"].items())) + ".")
    for p in res["policies"]:
        stats = p.get("envoy_computeflux_stats")
        if not stats:
            continue
        reasons = {k.rsplit(".", 1)[-1]: v for k, v in stats.items()
                   if ".computeflux_decisions_total.reason." in k and v}
        broken = [r for r in p["records"] if r["status"] == 200 and r.get("affinity") == "pin_break"]
        evaluated = sum((r.get("prompt_tokens") or 0) - (r.get("cached_tokens") or 0) for r in broken)
        L.append(f"\nThe filter's decisions ({p['policy']}, Envoy's `computeflux_decisions_total`): "
                 + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ".")
        zero = [r for r in ("pin_break", "degraded", "saturated", "degraded_probe") if not reasons.get(r)]
        if zero:
            L[-1] += " Zero: " + ", ".join(f"`{r}`" for r in zero) + "."
        if broken:
            L.append(f"The {len(broken)} `pin_break` requests moved a session off the engine holding "
                     f"its cache; the engines evaluated {evaluated:,} prompt tokens for them (their "
                     f"`usage`: prompt − cached).")
    L.append("")
    L.append(moves_md(res))
    L.append(scraped_md(res))
    L.append("## Analysis: decode pace, the engines' batch and the slowness rule\n")
    L.append(decode_pace.decode_pace_md(res))
    L.append("## Reproduce\n")
    L.append("```\n" + m.get("command", "scripts/real-engine") + "\n```\n")
    L.append("Raw per-request records, the engines' metric deltas and final `/slots` are in `latest.json`.")
    return "\n".join(L) + "\n"


def moves_md(res):
    """Every request the filter sent away from its session's previous engine on purpose
    (affinity `pin_break` or `saturated`), with the filter's gauges at the sample before it."""
    L = []
    for p in res["policies"]:
        moved = [r for r in p["records"] if r.get("affinity") in ("pin_break", "saturated")]
        if not moved:
            continue
        prev = {(r["session"], r["turn"]): r for r in p["records"]}
        L.append(f"#### Sessions moved by {p['policy']} ({len(moved)} request{'s' if len(moved) != 1 else ''})\n")
        L.append("Each row: the request, the engine that served the session's previous turn, where the "
                 "filter sent it, and the filter's own gauges at the last sample (every "
                 f"{res['args'].get('sample_period_s', 0.5)} s) before the request started: slowness "
                 "(‰, 1000 = as fast as the fleet's work model), degraded, and the EWMA time to first byte.\n")
        L.append("| session/turn | start | from → to | latency | prompt / cached tokens | slowness e0 / e1 | degraded e0 / e1 | ewma ms e0 / e1 | previous turn: latency (engine compute) |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for r in sorted(moved, key=lambda r: r["start_s"]):
            before = [smp for smp in p.get("samples", []) if smp["t_s"] <= r["start_s"]]
            f = (before[-1].get("filter") or {}) if before else {}
            g = lambda k: " / ".join(str(f.get(n, {}).get(k, "—")) for n in ENGINE_NAMES)  # noqa: E731
            pr = prev.get((r["session"], r["turn"] - 1), {})
            L.append(f"| {r['session']}/{r['turn']} | {r['start_s']:.2f} s | {pr.get('upstream')} → {r['upstream']} | "
                     f"{1000 * r['latency_s']:.0f} ms | {fmt(r.get('prompt_tokens'))} / {fmt(r.get('cached_tokens'))} | "
                     f"{g('computeflux_slowness_permille')} | {g('computeflux_degraded')} | "
                     f"{g('computeflux_ewma_latency_ms')} | "                     + (f"{1000 * pr['latency_s']:.0f} ms ({(pr.get('prompt_ms') or 0) + (pr.get('predicted_ms') or 0):.0f} ms) |"
                        if pr else "— |"))
        L.append("")
        L.append(before_move_md(p, moved, prev, res["args"].get("stream_fraction")))
    return "\n".join(L)


BEFORE_MOVE_S = 3.0


def engine_window(p, name, t0, t1):
    """What engine `name` did between t0 and t1: its answers that ended in the window (count,
    mean time outside its compute, mean compute, mean uncached prompt tokens, mean decode ms per
    output token) and its own load sampled in the window (mean requests_processing +
    requests_deferred)."""
    w = [r for r in p["records"] if r["status"] == 200 and r["upstream"] == name and t0 <= r["end_s"] <= t1
         and r.get("prompt_ms") is not None]
    loads = [(smp["engines"].get(name, {}).get("requests_processing") or 0)
             + (smp["engines"].get(name, {}).get("requests_deferred") or 0)
             for smp in p.get("samples", []) if t0 <= smp["t_s"] <= t1]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "answers": len(w),
        "load": mean(loads),
        "outside_ms": mean([1000 * r["latency_s"] - r["prompt_ms"] - (r.get("predicted_ms") or 0) for r in w]),
        "compute_ms": mean([r["prompt_ms"] + (r.get("predicted_ms") or 0) for r in w]),
        "uncached": mean([r.get("evaluated") or 0 for r in w]),
        "decode_ms_per_token": mean([(r.get("predicted_ms") or 0) / max(1, r.get("completion_tokens") or 1) for r in w]),
    }


def before_move_md(p, moved, prev, stream_fraction):
    """The two engines over the seconds before each move: was the engine left behind sick, or
    busier?"""
    f1 = lambda v, d=0: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
    L = [f"What the engine the session left and the engine it went to did in the {BEFORE_MOVE_S:.0f} s before "
         "each move (their answers that ended then, the driver's samples of their own "
         "`requests_processing` + `requests_deferred`): load, answers, mean time outside the engine's "
         "compute (queue, HTTP, Envoy), mean compute, uncached prompt tokens per answer, decode ms per "
         "output token (a slot's decode shares each step with the other slot's work).\n"]
    hdr = "| session/turn | left: load / answers / outside ms / compute ms / uncached / decode ms per token | went to: same |"
    if stream_fraction:
        hdr = "| session/turn | streamed (previous, this) " + hdr[len("| session/turn "):]
    L.append(hdr)
    L.append("|---|---|---|" + ("---|" if stream_fraction else ""))
    tot = {"left": [], "to": []}
    for r in sorted(moved, key=lambda r: r["start_s"]):
        pr = prev.get((r["session"], r["turn"] - 1))
        if not pr:
            continue
        cells = []
        for key, name in (("left", pr["upstream"]), ("to", r["upstream"])):
            w = engine_window(p, name, r["start_s"] - BEFORE_MOVE_S, r["start_s"])
            tot[key].append(w)
            cells.append(f"{name}: {f1(w['load'], 1)} / {w['answers']} / {f1(w['outside_ms'])} / "
                         f"{f1(w['compute_ms'])} / {f1(w['uncached'])} / {f1(w['decode_ms_per_token'], 1)}")
        st = f" {'y' if pr.get('stream') else 'n'}, {'y' if r.get('stream') else 'n'} |" if stream_fraction else ""
        L.append(f"| {r['session']}/{r['turn']} |{st} " + " | ".join(cells) + " |")
    for key in tot:
        ws = tot[key]
        agg = {}
        for k in ("load", "outside_ms", "compute_ms", "uncached", "decode_ms_per_token"):
            vals = [w[k] for w in ws if w[k] is not None]
            agg[k] = sum(vals) / len(vals) if vals else None
        tot[key] = agg
    if moved:
        L.append(f"\nMean over these moves — left: load {f1(tot['left']['load'], 2)}, outside "
                 f"{f1(tot['left']['outside_ms'])} ms, compute {f1(tot['left']['compute_ms'])} ms, "
                 f"{f1(tot['left']['uncached'])} uncached tokens, {f1(tot['left']['decode_ms_per_token'], 1)} ms "
                 f"per output token; went to: load {f1(tot['to']['load'], 2)}, outside "
                 f"{f1(tot['to']['outside_ms'])} ms, compute {f1(tot['to']['compute_ms'])} ms, "
                 f"{f1(tot['to']['uncached'])} uncached tokens, {f1(tot['to']['decode_ms_per_token'], 1)} ms per "
                 "output token.\n")
    return "\n".join(L)


def scraped_md(res):
    L = ["## The filter's scraped state vs the engines' /metrics\n"]
    with_metrics = [p for p in res["policies"] if p["policy"] == "computeflux" and p.get("scraped_vs_engine")]
    if not with_metrics:
        L.append("Not measured in this run (no `computeflux` policy with `metrics`).\n")
        return "\n".join(L)
    period = res["args"].get("sample_period_s", 0.5)
    interval = res["args"].get("scrape_interval_ms")
    for p in with_metrics:
        cmp_, stats = p["scraped_vs_engine"], p.get("envoy_computeflux_stats", {})
        before = p.get("envoy_computeflux_stats_before", {})
        n_samples = len(p.get("samples", []))
        L.append(f"During the `{p['policy']}` run the driver read, once in every {period} s window (at a "
                 "random moment in it, so the samples do not lock onto the scrapes' phase) and at the same "
                 f"moment (concurrently), both engines' `/metrics` and Envoy's `/stats` of the filter's gauges "
                 f"({n_samples} samples; those after the last answer left out). The filter scrapes each "
                 f"engine every {interval} ms (`metrics.interval_ms`) through the engine's own cluster. "
                 "Engine `requests_processing` is compared with the filter's `computeflux_engine_running`, "
                 "engine `requests_deferred` with `computeflux_engine_waiting`. The last column is the "
                 "baseline: how far the engine's own gauge moves between two consecutive samples.\n")
        L.append("| endpoint | gauge | samples | engine mean | filter mean | mean abs diff | max abs diff | equal | engine's own step between samples |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for n, d in sorted(cmp_.items()):
            for key in ("running", "waiting"):
                c = d.get(key)
                if not c:
                    continue
                L.append(f"| {n} | {key} | {c['samples']} | {c['engine_mean']:.2f} | {c['filter_mean']:.2f} | "
                         f"{c['mean_abs_diff']:.2f} | {fmt(c['max_abs_diff'])} | {c['equal_pct']} % | "
                         f"{d.get(f'engine_{key}_step_mean_abs', 0):.2f} |")
        L.append("")
        L.append("| endpoint | scrapes (after the first request / total) | scrape errors | `computeflux_scrape_age_ms` sampled: mean / max | KV-cache gauge on the engine's page |")
        L.append("|---|---|---|---|---|")
        for n, d in sorted(cmp_.items()):
            key = f"wasmcustom.computeflux_scrapes_total.endpoint.{n}"
            total = stats.get(key, 0)
            run = total - before.get(key, 0)
            errs = {k.rsplit(".", 1)[-1]: v for k, v in stats.items()
                    if k.startswith(f"wasmcustom.computeflux_scrape_errors_total.endpoint.{n}.") and v}
            age = d.get("scrape_age_ms", {})
            L.append(f"| {n} | {run} / {total} | "
                     + (", ".join(f"{k} {v}" for k, v in sorted(errs.items())) or "0")
                     + f" | {fmt(age.get('mean'))} / {fmt(age.get('max'))} ms | "
                     + ("yes" if d.get("engine_kv_cache_usage_exported") else "none") + " |")
        L.append("")
        L.append("`computeflux_scrape_age_ms` is set when a scrape lands and on every tick of the filter "
                 f"(half of `metrics.interval_ms`: {(interval or 0) // 2} ms here), so the load the "
                 "scheduler holds at a given moment can be up to one tick older than the gauge says. "
                 "The run starts once both engines have been scraped once. llama.cpp's `/metrics` "
                 "has no KV-cache usage (the last column above), so "
                 "`computeflux_engine_kv_usage_permille` stays 0 and only the queue "
                 "(`requests_deferred` ≥ 5) could make an engine saturated.\n")
    L.append("### The filter's judgement of the engines (slowness, degraded, saturated)\n")
    L.append("Sampled gauges over each filter run: `computeflux_slowness_permille` (0 until the "
             "fleet's work model is warm; the table gives the non-zero samples), and the number of "
             "samples in which `computeflux_degraded` / `computeflux_saturated` was 1.\n")
    L.append("| policy | endpoint | slowness ‰ min / median / max (samples) | degraded samples | saturated samples | final slowness ‰ | final EWMA ms |")
    L.append("|---|---|---|---|---|---|---|")
    for p in res["policies"]:
        if p["policy"] not in FILTER_POLICIES:
            continue
        stats = p.get("envoy_computeflux_stats", {})
        for n, d in sorted((p.get("scraped_vs_engine") or {}).items()):
            sl = d.get("slowness_permille")
            slt = f"{sl['min']} / {sl['median']} / {sl['max']} ({sl['samples']})" if sl else "— (never warm)"
            L.append(f"| {p['policy']} | {n} | {slt} | {d.get('degraded_samples', 0)} | "
                     f"{d.get('saturated_samples', 0)} | "
                     f"{fmt(stats.get(f'wasmcustom.computeflux_slowness_permille.endpoint.{n}'))} | "
                     f"{fmt(stats.get(f'wasmcustom.computeflux_ewma_latency_ms.endpoint.{n}'))} |")
    L.append("")
    return "\n".join(L)


def write_json(res, path):
    """Indented JSON, except that each per-request record and each sample takes one line (the
    file stays diffable and a third of the size)."""
    marks = {}
    out = json.loads(json.dumps(res))
    for p in out.get("policies", []):
        for key in ("records", "samples"):
            rows = p.get(key) or []
            for i, row in enumerate(rows):
                mark = f"@@row{len(marks)}@@"
                marks[mark] = json.dumps(row, separators=(", ", ": "))
                rows[i] = mark
    text = json.dumps(out, indent=1)
    text = re.sub(r'"(@@row\d+@@)"', lambda m: marks[m.group(1)], text)
    with open(path, "w") as f:
        f.write(text + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--wasm", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--pid-file", default=None)
    ap.add_argument("--meta", default="{}", help="JSON object merged into the report's meta")
    ap.add_argument("--policies", default="computeflux,computeflux_no_metrics,round_robin")
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--stagger-s", type=float, default=2.0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-ram-mib", type=int, default=256)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--stream-fraction", type=float, default=0.0,
                    help="share of requests sent as streams (stream_options.include_usage); 0: none")
    ap.add_argument("--scrape-interval-ms", type=int, default=500,
                    help="the filter's metrics.interval_ms for the engines (policy computeflux)")
    ap.add_argument("--sample-period-s", type=float, default=0.5,
                    help="how often the driver reads the engines' /metrics and Envoy's stats")
    if "--from-json" in sys.argv:
        # Rewrites OUT/latest.md from an earlier run's JSON (report changes without a new run).
        i = sys.argv.index("--from-json")
        with open(sys.argv[i + 1]) as f:
            res = json.load(f)
        sys.stdout.write(report_md(res))
        if "--rewrite-json" in sys.argv:
            write_json(res, sys.argv[i + 1])
        return
    a = ap.parse_args()
    policies = [p for p in a.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            sys.exit(f"drive.py: unknown policy {p}")
    os.makedirs(a.out, exist_ok=True)
    workdir = a.workdir or os.path.join(a.out, "work")
    os.makedirs(workdir, exist_ok=True)
    procs = Procs(a.pid_file)
    res = {"generated_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "load_average_start": os.getloadavg(), "cpus": os.cpu_count(),
           "meta": json.loads(a.meta), "args": vars(a).copy(), "policies": []}
    for k in ("server", "model", "envoy", "wasm", "out", "workdir", "pid_file", "meta"):
        res["args"].pop(k, None)
    try:
        for p in policies:
            log(f"running {p}")
            la0 = os.getloadavg()
            r = run_policy(a, p, procs, workdir)
            r["load_average_start"], r["load_average_end"] = la0, os.getloadavg()
            log(f"{p}: {json.dumps(r['summary'])}")
            res["policies"].append(r)
    finally:
        procs.stop_all()
    write_json(res, os.path.join(a.out, "latest.json"))
    with open(os.path.join(a.out, "latest.md"), "w") as f:
        f.write(report_md(res))
    log(f"wrote {os.path.join(a.out, 'latest.md')} and latest.json")


if __name__ == "__main__":
    main()
