//! A small blocking HTTP/1.1 client (one connection per request, `Connection: close`) and an
//! HTTP/2 client that shells out to curl with prior knowledge (h2c).
//!
//! Everything has a deadline ([`DEFAULT_TIMEOUT`] unless given), so a broken proxy fails a test
//! instead of hanging it.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);

/// A client's cookie jar (a browser, an SDK client per conversation): name → value of what the
/// responses set, sent back as one `cookie` header. Attributes other than `Max-Age=0` (which
/// removes the cookie) are ignored: the tests talk to one host.
#[derive(Clone, Debug, Default)]
pub struct CookieJar(BTreeMap<String, String>);

impl CookieJar {
    /// The `cookie` header value, if the jar holds any.
    pub fn header(&self) -> Option<String> {
        (!self.0.is_empty()).then(|| {
            self.0
                .iter()
                .map(|(n, v)| format!("{n}={v}"))
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    /// Keeps what `r`'s `set-cookie` headers say (joined with ", " by [`request`]; the filter's
    /// cookies carry no comma).
    pub fn store(&mut self, r: &Response) {
        for one in r.header("set-cookie").unwrap_or_default().split(", ") {
            let mut attrs = one.split(';');
            let Some((name, value)) = attrs.next().and_then(|p| p.trim().split_once('=')) else {
                continue;
            };
            if attrs.any(|a| a.trim().eq_ignore_ascii_case("max-age=0")) {
                self.0.remove(name);
            } else {
                self.0.insert(name.to_string(), value.to_string());
            }
        }
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A complete response.
#[derive(Clone, Debug, Default)]
pub struct Response {
    pub status: u16,
    /// Lowercase header names; repeated headers joined with `", "`.
    pub headers: BTreeMap<String, String>,
    pub body: String,
    /// From sending the request to having the response headers.
    pub ttfb: Duration,
    /// From sending the request to having the whole body.
    pub elapsed: Duration,
    /// For a chunked HTTP/1.1 body: when each chunk had arrived (from sending the request).
    /// Shows whether a stream was relayed chunk by chunk or buffered. Empty otherwise.
    pub chunk_times: Vec<Duration>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// The body as JSON; panics with the body in the message if it is not JSON.
    pub fn json(&self) -> Value {
        match serde_json::from_str(&self.body) {
            Ok(v) => v,
            Err(e) => panic!(
                "response body is not JSON ({e}); status {}: {}",
                self.status, self.body
            ),
        }
    }

    /// The `data:` payloads of an SSE body, in order (including the final `[DONE]`).
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .flat_map(|event| event.lines())
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.trim_start().to_string())
            .collect()
    }
}

/// Sends one HTTP/1.1 request to `127.0.0.1:port`. `body` gets a `Content-Length` and, unless
/// `headers` has one, `content-type: application/json`.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<Response> {
    let start = Instant::now();
    let deadline = start + timeout;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(timeout))?;

    let mut head =
        format!("{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n");
    let has = |n: &str| headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        if !has("content-type") {
            head.push_str("content-type: application/json\r\n");
        }
        if !has("content-length") && !has("transfer-encoding") {
            head.push_str(&format!("content-length: {}\r\n", b.len()));
        }
    } else if method == "POST" || method == "PUT" {
        head.push_str("content-length: 0\r\n");
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    if let Some(b) = body {
        out.extend_from_slice(b);
    }
    stream.write_all(&out)?;

    let mut r = Reader {
        stream,
        buf: Vec::new(),
        pos: 0,
        deadline,
    };
    let mut resp = Response::default();
    // Skip interim 1xx responses.
    loop {
        let status_line = r.line()?;
        let status = parse_status(&status_line)?;
        let mut headers = BTreeMap::new();
        loop {
            let l = r.line()?;
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                let k = k.trim().to_ascii_lowercase();
                let v = v.trim().to_string();
                headers
                    .entry(k)
                    .and_modify(|old: &mut String| {
                        old.push_str(", ");
                        old.push_str(&v);
                    })
                    .or_insert(v);
            }
        }
        if (100..200).contains(&status) {
            continue;
        }
        resp.status = status;
        resp.headers = headers;
        break;
    }
    resp.ttfb = start.elapsed();

    let no_body = method == "HEAD" || resp.status == 204 || resp.status == 304;
    let chunked = resp
        .header("transfer-encoding")
        .is_some_and(|te| te.to_ascii_lowercase().contains("chunked"));
    let body = if no_body {
        Vec::new()
    } else if chunked {
        let mut body = Vec::new();
        loop {
            let size_line = r.line()?;
            let size_hex = size_line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_hex, 16).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad chunk size {size_line:?}"),
                )
            })?;
            if size == 0 {
                // Trailers, then the empty line.
                while !r.line()?.is_empty() {}
                break;
            }
            body.extend_from_slice(&r.exact(size)?);
            resp.chunk_times.push(start.elapsed());
            r.line()?;
        }
        body
    } else if let Some(len) = resp.header("content-length") {
        let n: usize = len
            .trim()
            .parse()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad content-length"))?;
        r.exact(n)?
    } else {
        r.read_to_end()?
    };
    resp.body = String::from_utf8_lossy(&body).into_owned();
    resp.elapsed = start.elapsed();
    Ok(resp)
}

fn parse_status(line: &str) -> io::Result<u16> {
    let mut parts = line.split_whitespace();
    let proto = parts.next().unwrap_or("");
    let code = parts.next().and_then(|c| c.parse::<u16>().ok());
    match code {
        Some(c) if proto.starts_with("HTTP/") => Ok(c),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad status line {line:?}"),
        )),
    }
}

struct Reader {
    stream: TcpStream,
    buf: Vec<u8>,
    pos: usize,
    deadline: Instant,
}

impl Reader {
    /// Reads more bytes into the buffer; Ok(0) at EOF.
    fn fill(&mut self) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "HTTP response deadline passed",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut chunk = [0u8; 16 * 1024];
        let n = match self.stream.read(&mut chunk) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "HTTP response deadline passed",
                ))
            }
            Err(e) => return Err(e),
        };
        self.buf.extend_from_slice(chunk.get(..n).unwrap_or(&[]));
        Ok(n)
    }

    fn pending(&self) -> &[u8] {
        self.buf.get(self.pos..).unwrap_or(&[])
    }

    /// One line without its CRLF.
    fn line(&mut self) -> io::Result<String> {
        loop {
            if let Some(i) = self.pending().windows(2).position(|w| w == b"\r\n") {
                let line =
                    String::from_utf8_lossy(self.pending().get(..i).unwrap_or(&[])).into_owned();
                self.pos += i + 2;
                return Ok(line);
            }
            if self.fill()? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before the end of a line",
                ));
            }
        }
    }

    fn exact(&mut self, n: usize) -> io::Result<Vec<u8>> {
        while self.pending().len() < n {
            if self.fill()? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "connection closed {} bytes into a {n}-byte body",
                        self.pending().len()
                    ),
                ));
            }
        }
        let out = self.pending().get(..n).unwrap_or(&[]).to_vec();
        self.pos += n;
        Ok(out)
    }

    fn read_to_end(&mut self) -> io::Result<Vec<u8>> {
        while self.fill()? > 0 {}
        let out = self.pending().to_vec();
        self.pos = self.buf.len();
        Ok(out)
    }
}

/// `POST /v1/chat/completions` with `body` (JSON) and extra `headers`. Panics on I/O errors
/// (connection refused, timeout), not on error statuses.
pub fn post_chat(port: u16, headers: &[(&str, &str)], body: &str) -> Response {
    match try_post_chat(port, headers, body) {
        Ok(r) => r,
        Err(e) => panic!("POST /v1/chat/completions to 127.0.0.1:{port} failed: {e}"),
    }
}

/// Like [`post_chat`], returning the I/O error instead (for tests that expect resets).
pub fn try_post_chat(port: u16, headers: &[(&str, &str)], body: &str) -> io::Result<Response> {
    request(
        port,
        "POST",
        "/v1/chat/completions",
        headers,
        Some(body.as_bytes()),
        DEFAULT_TIMEOUT,
    )
}

/// `GET path`. Panics on I/O errors.
pub fn get(port: u16, path: &str) -> Response {
    match request(port, "GET", path, &[], None, DEFAULT_TIMEOUT) {
        Ok(r) => r,
        Err(e) => panic!("GET {path} from 127.0.0.1:{port} failed: {e}"),
    }
}

/// `POST path` with a JSON body. Panics on I/O errors.
pub fn post_json(port: u16, path: &str, body: &str) -> Response {
    match request(
        port,
        "POST",
        path,
        &[],
        Some(body.as_bytes()),
        DEFAULT_TIMEOUT,
    ) {
        Ok(r) => r,
        Err(e) => panic!("POST {path} to 127.0.0.1:{port} failed: {e}"),
    }
}

/// One HTTP/2 (h2c, prior knowledge) request through `/usr/bin/curl` (`$CURL` overrides), with a
/// [`DEFAULT_TIMEOUT`] limit. `chunk_times` stays empty. Panics if curl fails (including
/// connection errors and timeouts).
pub fn curl_h2(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Response {
    let curl = std::env::var("CURL").unwrap_or_else(|_| "/usr/bin/curl".into());
    let mut cmd = Command::new(&curl);
    cmd.args(["-sS", "-i", "--http2-prior-knowledge", "--max-time"])
        .arg(DEFAULT_TIMEOUT.as_secs().to_string())
        .args(["-X", method]);
    let has_ct = headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"));
    for (k, v) in headers {
        cmd.arg("-H").arg(format!("{k}: {v}"));
    }
    if body.is_some() {
        if !has_ct {
            cmd.args(["-H", "content-type: application/json"]);
        }
        cmd.args(["--data-binary", "@-"]);
    }
    cmd.arg(format!("http://127.0.0.1:{port}{path}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => panic!("cannot run {curl}: {e}"),
    };
    if let Some(mut stdin) = child.stdin.take() {
        if let Some(b) = body {
            let _ = stdin.write_all(b.as_bytes());
        }
    }
    let out = match child.wait_with_output() {
        Ok(o) => o,
        Err(e) => panic!("waiting for curl: {e}"),
    };
    let elapsed = start.elapsed();
    if !out.status.success() {
        panic!(
            "curl --http2-prior-knowledge {method} 127.0.0.1:{port}{path} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    match parse_curl_output(&out.stdout) {
        Some(mut r) => {
            r.elapsed = elapsed;
            r.ttfb = elapsed;
            r
        }
        None => panic!(
            "cannot parse curl output: {}",
            String::from_utf8_lossy(&out.stdout)
        ),
    }
}

/// Parses `curl -i` output: header blocks (interim 1xx ones skipped), a blank line, the body.
fn parse_curl_output(raw: &[u8]) -> Option<Response> {
    let mut rest = raw;
    loop {
        let end = rest.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(rest.get(..end)?).into_owned();
        rest = rest.get(end + 4..)?;
        let mut lines = head.split("\r\n");
        let status = parse_status(lines.next()?).ok()?;
        if (100..200).contains(&status) {
            continue;
        }
        let mut headers = BTreeMap::new();
        for l in lines {
            if let Some((k, v)) = l.split_once(':') {
                let v = v.trim().to_string();
                headers
                    .entry(k.trim().to_ascii_lowercase())
                    .and_modify(|old: &mut String| {
                        old.push_str(", ");
                        old.push_str(&v);
                    })
                    .or_insert(v);
            }
        }
        return Some(Response {
            status,
            headers,
            body: String::from_utf8_lossy(rest).into_owned(),
            ..Response::default()
        });
    }
}
