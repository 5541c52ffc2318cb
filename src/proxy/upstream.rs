//! The HTTP client the proxy uses for replicas (plain HTTP/1.1, pooled keep-alive), and small
//! helpers shared by the probe and the forwarder.
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// The pooled client to every replica.
pub type Client = hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>;

/// How long an idle pooled connection is reused: under the 5 s after which `vllm serve`
/// (uvicorn, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`) closes an idle connection. A longer pool races
/// the server's close: a request written on a connection the server is closing fails after it
/// was sent, and such a failure is not retried on a replica that is still alive.
pub const POOL_IDLE: Duration = Duration::from_secs(4);

/// A keep-alive HTTP/1.1 client with `TCP_NODELAY` (small SSE frames must not wait for Nagle).
/// A connection that cannot be opened within `connect_timeout` fails as a connect error
/// (`is_connect()`): the request was never sent.
pub fn client(connect_timeout: Duration) -> Client {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE)
        .pool_max_idle_per_host(256)
        .build(connector)
}

/// A failed call to a replica; `not_sent` when the connection could not even be opened (the
/// request never reached the replica, so it may go elsewhere); `broke` when the exchange
/// itself failed (not sent, or the connection broke before the whole answer was read), as
/// opposed to an answer that came back unreadable.
#[derive(Debug, Clone)]
pub struct UpstreamError {
    /// What failed, naming the URI.
    pub message: String,
    /// The connection failed before any byte of the request was sent.
    pub not_sent: bool,
    /// The connection failed before the whole answer was read (implied by `not_sent`).
    pub broke: bool,
}

impl std::fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<UpstreamError> for String {
    fn from(e: UpstreamError) -> String {
        e.message
    }
}

/// Whether a client error means the request never left the proxy: the connection to the
/// replica could not be opened (refused, unreachable, connect timeout). A pooled connection the
/// replica had closed is retried on a new one by the client itself before that.
pub fn never_sent(e: &hyper_util::client::legacy::Error) -> bool {
    e.is_connect()
}

/// A POST of `body` to a replica's `uri`: `authority` as the Host, `authorization` (what a
/// replica run with `--api-key` expects) as the `Authorization` header if given.
pub fn post_request(
    uri: &str,
    authority: &str,
    authorization: Option<&str>,
    content_type: &str,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, hyper::http::Error> {
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::CONTENT_TYPE, content_type);
    if let Some(auth) = authorization {
        request = request.header(hyper::header::AUTHORIZATION, auth);
    }
    request.body(Full::new(body))
}

/// POSTs `body` to `{base}{path_and_query}` (`authority` as the Host, `authorization` as the
/// `Authorization` header if given) and reads the answer as JSON, whatever its status; errors
/// name the URI.
pub async fn post_for_json(
    client: &Client,
    base: &str,
    authority: &str,
    authorization: Option<&str>,
    path_and_query: &str,
    content_type: &str,
    body: Bytes,
) -> Result<(StatusCode, Value), UpstreamError> {
    let uri = format!("{base}{path_and_query}");
    let broke = |e: &dyn std::fmt::Display, not_sent: bool| UpstreamError {
        message: format!("{uri}: {e}"),
        not_sent,
        broke: true,
    };
    let request =
        post_request(&uri, authority, authorization, content_type, body).map_err(|e| {
            UpstreamError {
                message: format!("{uri}: {e}"),
                not_sent: false,
                broke: false,
            }
        })?;
    let response = client
        .request(request)
        .await
        .map_err(|e| broke(&e, never_sent(&e)))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| broke(&e, false))?
        .to_bytes();
    let value = serde_json::from_slice(&bytes).map_err(|e| UpstreamError {
        message: format!("{uri} answered {status} with non-JSON ({e})"),
        not_sent: false,
        broke: false,
    })?;
    Ok((status, value))
}

/// Percent-encodes everything but RFC 3986 unreserved characters (for query values).
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and ones the proxy sets itself: never forwarded.
pub fn is_hop_header(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_encoding_keeps_only_unreserved_bytes() {
        assert_eq!(percent_encode("a-b_c.d~e"), "a-b_c.d~e");
        assert_eq!(percent_encode("s/ä b&"), "s%2F%C3%A4%20b%26");
    }
}
