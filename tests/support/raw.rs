//! Raw clients for what the blocking client and curl cannot send or keep: request bytes
//! written by hand on HTTP/1.1 (chunked bodies, chunked trailers, non-UTF-8 header bytes), and
//! HTTP/2 (h2c, prior knowledge) with the `h2` crate (responses Envoy follows with
//! `RST_STREAM(NO_ERROR)`, request trailers).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::http::Response;

/// A response read off a raw socket.
#[derive(Debug)]
pub struct Raw {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Raw {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }

    pub fn as_response(&self) -> Response {
        let mut r = Response {
            status: self.status,
            body: String::from_utf8_lossy(&self.body).into_owned(),
            ..Response::default()
        };
        for l in self.head.lines().skip(1) {
            if let Some((k, v)) = l.split_once(':') {
                r.headers
                    .insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
        r
    }
}

/// Writes `parts` one after another on a fresh connection (pausing `gap` between them; a write
/// error stops the writing, as when Envoy answers before the upload is complete), then reads one
/// response (`content-length` framed, or up to EOF).
pub fn raw_exchange(port: u16, parts: &[Vec<u8>], gap: Duration) -> std::io::Result<Raw> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    s.set_write_timeout(Some(Duration::from_secs(15)))?;
    for (i, p) in parts.iter().enumerate() {
        if i > 0 && !gap.is_zero() {
            std::thread::sleep(gap);
        }
        if s.write_all(p).is_err() {
            break;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        assert!(Instant::now() < deadline, "no response head");
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "closed before a response head: {:?}",
                    String::from_utf8_lossy(&buf)
                ),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    let mut raw = Raw {
        status,
        head,
        body: Vec::new(),
    };
    match raw
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(len) => {
            while body.len() < len {
                let n = s.read(&mut chunk)?;
                if n == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..n]);
            }
            body.truncate(len);
        }
        None => loop {
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => body.extend_from_slice(&chunk[..n]),
            }
        },
    }
    raw.body = body;
    Ok(raw)
}

/// The request head of a chat POST with extra raw header lines (bytes, not necessarily UTF-8).
pub fn head(extra: &[&[u8]], framing: &str) -> Vec<u8> {
    let mut h = b"POST /v1/chat/completions HTTP/1.1\r\nhost: llm\r\nconnection: close\r\n\
content-type: application/json\r\n"
        .to_vec();
    h.extend_from_slice(framing.as_bytes());
    h.extend_from_slice(b"\r\n");
    for line in extra {
        h.extend_from_slice(line);
        h.extend_from_slice(b"\r\n");
    }
    h.extend_from_slice(b"\r\n");
    h
}

pub fn chunk(data: &[u8]) -> Vec<u8> {
    let mut c = format!("{:x}\r\n", data.len()).into_bytes();
    c.extend_from_slice(data);
    c.extend_from_slice(b"\r\n");
    c
}

/// One HTTP/2 (h2c, prior knowledge) request with the `h2` crate. Unlike curl, it keeps a
/// complete response that Envoy follows with `RST_STREAM(NO_ERROR)` (what Envoy sends when it
/// answers before the request body is complete). `Err` if the stream or connection failed
/// without a response.
pub fn h2_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Response, String> {
    h2_request_with_trailers(port, method, path, headers, body, &[])
}

/// [`h2_request`], ending the request with a trailers frame (`HEADERS` with `END_STREAM`)
/// when `trailers` is not empty, so the body's last `DATA` frame does not end the stream.
pub fn h2_request_with_trailers(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    trailers: &[(&str, &str)],
) -> Result<Response, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let body = bytes::Bytes::copy_from_slice(body);
    let method = method.to_string();
    let path = path.to_string();
    let owned = |list: &[(&str, &str)]| -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let headers = owned(headers);
    let trailers = owned(trailers);
    let exchange = async move {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| e.to_string())?;
        let (client, conn) = h2::client::handshake(tcp)
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut client = client.ready().await.map_err(|e| e.to_string())?;
        let mut req = ::http::Request::builder()
            .method(method.as_str())
            .uri(format!("http://127.0.0.1:{port}{path}"));
        for (k, v) in &headers {
            req = req.header(k.as_str(), v.as_str());
        }
        if !body.is_empty() {
            req = req.header("content-length", body.len().to_string());
        }
        let req = req.body(()).map_err(|e| e.to_string())?;
        let ends_at_headers = body.is_empty() && trailers.is_empty();
        let (response, mut send) = client
            .send_request(req, ends_at_headers)
            .map_err(|e| e.to_string())?;
        if !body.is_empty() {
            // Buffered by h2 and sent as flow control allows; an early answer stops it.
            let _ = send.send_data(body, trailers.is_empty());
        }
        if !trailers.is_empty() {
            let mut map = ::http::HeaderMap::new();
            for (k, v) in &trailers {
                let name =
                    ::http::HeaderName::from_bytes(k.as_bytes()).map_err(|e| e.to_string())?;
                let value = ::http::HeaderValue::from_str(v).map_err(|e| e.to_string())?;
                map.append(name, value);
            }
            let _ = send.send_trailers(map);
        }
        let response = response.await.map_err(|e| format!("no response: {e}"))?;
        let mut r = Response {
            status: response.status().as_u16(),
            ..Response::default()
        };
        for (k, v) in response.headers() {
            r.headers.insert(
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            );
        }
        let mut recv = response.into_body();
        let mut out = Vec::new();
        while let Some(data) = recv.data().await {
            let data = data.map_err(|e| format!("body: {e}"))?;
            let _ = recv.flow_control().release_capacity(data.len());
            out.extend_from_slice(&data);
        }
        r.body = String::from_utf8_lossy(&out).into_owned();
        Ok::<Response, String>(r)
    };
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(15), exchange).await })
        .map_err(|_| "HTTP/2 exchange timed out".to_string())?
}
