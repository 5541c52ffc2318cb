//! Request handling: find the session, route it, acquire its replica's gate, forward the
//! request unchanged, and stream the answer back while holding the lease.
//!
//! The lease lives inside the response body ([`Tracked`]): it is released when the upstream
//! answer has been passed on completely, when the upstream fails, or when the client goes away
//! (the body is dropped; dropping the upstream body closes that connection, and vLLM aborts the
//! request). Nothing is retried upstream: every request reaches vLLM at most once.
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};

use super::Proxy;
use super::config::GateAt;
use super::engine_gate::{self, AdmitError, Held};
use super::metrics::Outcome;
use super::replicas::{Replica, Route};
use super::upstream::is_hop_header;
use crate::error::Error;

/// Keys of a chat body that change its tokenization (sent to vLLM's `/tokenize`).
const CHAT_TOKENIZE_KEYS: [&str; 8] = [
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
];

/// A JSON error in vLLM's / OpenAI's shape.
pub fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({
        "error": { "message": message.into(), "type": kind, "code": status.as_u16() }
    });
    (status, axum::Json(body)).into_response()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completions,
    Chat,
    Models,
}

impl Kind {
    fn route(self) -> &'static str {
        match self {
            Kind::Completions => "/v1/completions",
            Kind::Chat => "/v1/chat/completions",
            Kind::Models => "/v1/models",
        }
    }
}

/// `/v1/{*rest}`: the session id (if any) comes from the session header.
pub async fn v1(
    State(proxy): State<Arc<Proxy>>,
    Path(rest): Path<String>,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let session = headers
        .get(proxy.config.session_header.as_str())
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(str::to_string);
    handle(proxy, session, rest, method, headers, body).await
}

/// `/sess/{session_id}/v1/{*rest}`.
pub async fn sess_v1(
    State(proxy): State<Arc<Proxy>>,
    Path((session, rest)): Path<(String, String)>,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(proxy, Some(session), rest, method, headers, body).await
}

/// `POST /sess/{session_id}/finish`: ends the session's idle grace window on its replica.
pub async fn finish(State(proxy): State<Arc<Proxy>>, Path(session): Path<String>) -> Response {
    proxy.metrics.finish_session(&session);
    let Some(index) = proxy.replicas.forget_session(&session) else {
        return axum::Json(json!({ "session_id": session, "finished": false })).into_response();
    };
    let replica = &proxy.replicas.list[index];
    replica.probe.released();
    let ended = match proxy.config.gate_at {
        GateAt::Proxy => replica.gate.finish_session(&session).await,
        GateAt::Engine => match engine_gate::finish(&proxy, replica, &session).await {
            Ok(ended) => ended,
            Err(e) => return error(StatusCode::BAD_GATEWAY, "BadGatewayError", e),
        },
    };
    axum::Json(json!({
        "session_id": session,
        "finished": ended,
        "replica": replica.url.base,
    }))
    .into_response()
}

/// `GET /metrics`.
pub async fn metrics(State(proxy): State<Arc<Proxy>>) -> Response {
    let text = proxy.metrics.render(&proxy.replicas);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
}

/// `GET /health`: 200 while at least one replica is healthy.
pub async fn health(State(proxy): State<Arc<Proxy>>) -> Response {
    if proxy.replicas.list.iter().any(|r| r.is_healthy()) {
        StatusCode::OK.into_response()
    } else {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableError",
            "no healthy replica",
        )
    }
}

async fn handle(
    proxy: Arc<Proxy>,
    session: Option<String>,
    rest: String,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let started = Instant::now();
    let kind = match (&method, rest.as_str()) {
        (&Method::POST, "completions") => Kind::Completions,
        (&Method::POST, "chat/completions") => Kind::Chat,
        (&Method::GET, "models") => Kind::Models,
        _ => {
            return error(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                format!(
                    "{method} /v1/{rest} is not proxied (completions, chat/completions, models)"
                ),
            );
        }
    };
    let path = format!("/v1/{rest}");
    let (session, kind) = match (session, kind) {
        (Some(s), Kind::Completions | Kind::Chat) => (s, kind),
        (_, kind) => {
            // Ungated: no session, or a route the gate does not guard.
            let Some(route) = proxy.replicas.route_ungated() else {
                return no_replica(&proxy, kind);
            };
            let replica = proxy.replicas.list[route.index].clone();
            return forward(
                &proxy, &replica, kind, &path, method, &headers, body, None, route, started,
            )
            .await;
        }
    };
    let request: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return bad_request(&proxy, kind, "the request body must be a JSON object"),
        Err(e) => {
            return bad_request(
                &proxy,
                kind,
                format!("the request body is not valid JSON: {e}"),
            );
        }
    };
    // None (neither field, or null): the gate counts its default_max_tokens knob.
    let max_tokens = request
        .get("max_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| request.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    let Some(route) = proxy.replicas.route_session(&session) else {
        return no_replica(&proxy, kind);
    };
    let replica = proxy.replicas.list[route.index].clone();
    let prompt_ids = match prompt_ids(&proxy, &replica, kind, &request).await {
        Ok(ids) => ids,
        Err(response) => {
            proxy.metrics.request(
                &replica.url.base,
                kind.route(),
                response.status().as_u16(),
                Outcome::Rejected,
                0,
                0.0,
            );
            return response;
        }
    };
    let acquired = match proxy.config.gate_at {
        GateAt::Proxy => replica
            .gate
            .acquire(
                &session,
                &prompt_ids,
                max_tokens,
                proxy.config.retain_session,
            )
            .await
            .map(Held::Local)
            .map_err(|e| match e {
                Error::Preempted { .. } => AdmitError::Preempted { num_preempted: 0 },
                e => AdmitError::Failed {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: e.to_string(),
                },
            }),
        GateAt::Engine => {
            engine_gate::acquire(
                &proxy,
                &replica,
                &session,
                &prompt_ids,
                max_tokens,
                proxy.config.retain_session,
            )
            .await
        }
    };
    let lease = match acquired {
        Ok(lease) => lease,
        Err(AdmitError::Preempted { .. }) => {
            proxy.metrics.preempted(&session);
            proxy.metrics.request(
                &replica.url.base,
                kind.route(),
                409,
                Outcome::Preempted,
                0,
                0.0,
            );
            let mut response = error(
                StatusCode::CONFLICT,
                "preempted",
                format!(
                    "a newer request of session {session:?} arrived while this one waited for \
                     admission; this attempt was dropped and never reached vLLM"
                ),
            );
            // OpenAI's clients retry 409 by default; a preempted attempt must not come back.
            response
                .headers_mut()
                .insert("x-should-retry", HeaderValue::from_static("false"));
            return response;
        }
        Err(AdmitError::Failed { status, message }) => {
            let kind_name = if status == StatusCode::BAD_REQUEST {
                "BadRequestError"
            } else {
                "InternalServerError"
            };
            return error(status, kind_name, message);
        }
    };
    forward(
        &proxy,
        &replica,
        kind,
        &path,
        method,
        &headers,
        body,
        Some(lease),
        route,
        started,
    )
    .await
}

fn no_replica(proxy: &Proxy, kind: Kind) -> Response {
    proxy
        .metrics
        .request("none", kind.route(), 503, Outcome::Rejected, 0, 0.0);
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailableError",
        "no healthy vLLM replica",
    )
}

fn bad_request(proxy: &Proxy, kind: Kind, message: impl Into<String>) -> Response {
    proxy
        .metrics
        .request("none", kind.route(), 400, Outcome::Rejected, 0, 0.0);
    error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

fn ids_of(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

/// The prompt's token ids: given (a completions `prompt` of ids), or from the replica's own
/// `/tokenize` (text prompts and chat messages, with its tokenizer and chat template).
async fn prompt_ids(
    proxy: &Proxy,
    replica: &Replica,
    kind: Kind,
    request: &Value,
) -> Result<Vec<u32>, Response> {
    let tokenize_body = match kind {
        Kind::Completions => match request.get("prompt") {
            Some(Value::String(text)) => {
                let mut body = json!({ "prompt": text });
                for key in ["model", "add_special_tokens"] {
                    if let Some(v) = request.get(key) {
                        body[key] = v.clone();
                    }
                }
                body
            }
            Some(p @ Value::Array(a)) if a.first().is_some_and(Value::is_u64) => {
                return ids_of(p).ok_or_else(|| {
                    error(
                        StatusCode::BAD_REQUEST,
                        "BadRequestError",
                        "prompt token ids must be integers in 0..2^32",
                    )
                });
            }
            _ => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    "a session's completions request needs one prompt: a string or a list of \
                     token ids (batched prompts are not gated)",
                ));
            }
        },
        Kind::Chat => {
            let mut body = serde_json::Map::new();
            for key in CHAT_TOKENIZE_KEYS {
                if let Some(v) = request.get(key) {
                    body.insert(key.to_string(), v.clone());
                }
            }
            if !body.contains_key("messages") {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    "a chat request needs messages",
                ));
            }
            Value::Object(body)
        }
        Kind::Models => return Ok(Vec::new()),
    };
    let bytes = serde_json::to_vec(&tokenize_body).unwrap_or_default();
    let uri = format!("{}/tokenize", replica.url.base);
    let req = hyper::Request::builder()
        .method(Method::POST)
        .uri(&uri)
        .header(hyper::header::HOST, &replica.url.authority)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(bytes)))
        .map_err(|e| error(StatusCode::BAD_GATEWAY, "BadGatewayError", e.to_string()))?;
    let upstream_error = |e: &dyn std::fmt::Display| {
        error(
            StatusCode::BAD_GATEWAY,
            "BadGatewayError",
            format!("{uri}: {e}"),
        )
    };
    let resp = proxy
        .client
        .request(req)
        .await
        .map_err(|e| upstream_error(&e))?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| upstream_error(&e))?
        .to_bytes();
    if !status.is_success() {
        // vLLM's own error (unknown model, bad messages, …) goes back as it is.
        let mut r = Response::new(Body::from(bytes));
        *r.status_mut() = status;
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return Err(r);
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| upstream_error(&e))?;
    v.get("tokens")
        .and_then(ids_of)
        .ok_or_else(|| upstream_error(&"tokenize answered without tokens"))
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    proxy: &Arc<Proxy>,
    replica: &Arc<Replica>,
    kind: Kind,
    path: &str,
    method: Method,
    headers: &HeaderMap,
    body: Bytes,
    lease: Option<Held>,
    route: Route,
    started: Instant,
) -> Response {
    let mut builder = hyper::Request::builder()
        .method(method)
        .uri(format!("{}{}", replica.url.base, path))
        .header(hyper::header::HOST, &replica.url.authority);
    // Admitted by the replica's engine gate already: without the session header, the replica's
    // gating middleware (if it runs one) does not admit the same turn a second time.
    let gated_at_engine = matches!(lease, Some(Held::Engine(_)));
    for (name, value) in headers {
        let drop_session = gated_at_engine && name.as_str() == proxy.config.session_header;
        if !is_hop_header(name.as_str()) && !drop_session {
            builder = builder.header(name, value);
        }
    }
    let request = match builder.body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    };
    let mut guard = Guard {
        proxy: proxy.clone(),
        replica: replica.clone(),
        route: kind.route(),
        status: 502,
        turn: route.turn,
        started,
        lease,
        done: false,
    };
    let upstream = match proxy.client.request(request).await {
        Ok(r) => r,
        Err(e) => {
            guard.finish(Outcome::UpstreamFailed);
            return error(
                StatusCode::BAD_GATEWAY,
                "BadGatewayError",
                format!("replica {} failed: {e}", replica.url.base),
            );
        }
    };
    let (parts, incoming) = upstream.into_parts();
    guard.status = parts.status.as_u16();
    let mut response = Response::new(Body::new(Tracked {
        inner: incoming,
        guard,
    }));
    *response.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        if !is_hop_header(name.as_str()) {
            response.headers_mut().append(name, value.clone());
        }
    }
    response
}

/// Releases the lease and records the request, exactly once, however the answer ends.
struct Guard {
    proxy: Arc<Proxy>,
    replica: Arc<Replica>,
    route: &'static str,
    status: u16,
    turn: u64,
    started: Instant,
    lease: Option<Held>,
    done: bool,
}

impl Guard {
    fn finish(&mut self, outcome: Outcome) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        if let Some(mut lease) = self.lease.take() {
            // Before the release wakes any waiter: readings taken until now are pre-release.
            self.replica.probe.released();
            lease.release();
        }
        self.proxy.metrics.request(
            &self.replica.url.base,
            self.route,
            self.status,
            outcome,
            self.turn,
            self.started.elapsed().as_secs_f64(),
        );
    }
}

/// The upstream body passed through frame by frame (SSE included, unbuffered), holding the
/// lease until the answer is complete or abandoned.
struct Tracked {
    inner: Incoming,
    guard: Guard,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.guard.finish(Outcome::Completed),
            Poll::Ready(Some(Err(_))) => this.guard.finish(Outcome::UpstreamFailed),
            // The server may stop polling once the body says it is complete.
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => {
                this.guard.finish(Outcome::Completed)
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let outcome = if self.inner.is_end_stream() {
            Outcome::Completed
        } else {
            Outcome::ClientDisconnected
        };
        self.guard.finish(outcome);
    }
}
