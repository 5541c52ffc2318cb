//! Request handling: find the session, route it, acquire its replica's gate (the
//! [`ReplicaGate`](super::replica_gate::ReplicaGate), wherever it runs), forward the request
//! unchanged, and stream the answer back while holding the lease.
//!
//! The lease lives inside the response body ([`Tracked`]): it is released when the upstream
//! answer has been passed on completely, when the upstream fails, or when the client goes away
//! (the body is dropped; dropping the upstream body closes that connection, and vLLM aborts the
//! request). Every request is answered by vLLM at most once: only a request whose connection
//! to its replica could not be opened (nothing was sent), or whose exchange broke before any
//! answer while the replica then refuses connections (it is gone, and its work with it), is
//! placed again, its session moving. Upstream calls have a connect, a response and an idle
//! timeout (flags).
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};

use super::Proxy;
use super::metrics::Outcome;
use super::placing;
use super::placing::Grade;
use super::replica_gate::{AdmitError, ReplicaLease};
use super::replicas::{self, Health, InFlight, Placing, Replica, Route};
use super::upstream::{self, is_hop_header, never_sent, post_request};
use super::waiting::{self, Admission};
use crate::gate::Probe;
use crate::gate::placement;
use crate::gate::routers::Router;

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
    body: Result<Bytes, BytesRejection>,
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
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(proxy, Some(session), rest, method, headers, body).await
}

/// `POST /sess/{session_id}/finish`: ends the session's idle grace window on its replica.
pub async fn finish(
    State(proxy): State<Arc<Proxy>>,
    Path(session): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(denied) = unauthorized(&proxy, &headers) {
        return denied;
    }
    proxy.metrics.finish_session(&session);
    let Some(index) = proxy.replicas.forget_session(&session) else {
        return axum::Json(json!({ "session_id": session, "finished": false })).into_response();
    };
    let replica = &proxy.replicas.get(index);
    let ended = match proxy.replica_gate.finish_session(replica, &session).await {
        Ok(ended) => ended,
        Err(e) => return error(StatusCode::BAD_GATEWAY, "BadGatewayError", e),
    };
    axum::Json(json!({
        "session_id": session,
        "finished": ended,
        "replica": replica.url.base,
    }))
    .into_response()
}

/// The query of vllm-router's `POST /finish_session?session_id=<id>`.
#[derive(Debug, serde::Deserialize)]
pub struct FinishQuery {
    session_id: Option<String>,
}

/// `POST /finish_session?session_id=<id>`: vllm-router's release call, which prime-rl and SkyRL
/// send at each episode's end, so that a stack that points its router calls at the proxy
/// ends its sessions with nothing changed. The same as `/sess/{id}/finish`.
pub async fn finish_session(
    State(proxy): State<Arc<Proxy>>,
    Query(query): Query<FinishQuery>,
    headers: HeaderMap,
) -> Response {
    if let Some(denied) = unauthorized(&proxy, &headers) {
        return denied;
    }
    match query.session_id.filter(|s| !s.is_empty()) {
        Some(session) => finish(State(proxy), Path(session), headers).await,
        None => error(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            "session_id is required (a non-empty query parameter)",
        ),
    }
}

/// `GET /metrics`.
pub async fn metrics(State(proxy): State<Arc<Proxy>>, headers: HeaderMap) -> Response {
    if let Some(denied) = unauthorized(&proxy, &headers) {
        return denied;
    }
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
    if proxy.replicas.listed().iter().any(|r| r.is_healthy()) {
        StatusCode::OK.into_response()
    } else {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableError",
            "no healthy replica",
        )
    }
}

/// How one attempt on one replica ended.
enum Attempt {
    /// An answer for the client (the replica's, or the proxy's error).
    Done(Response),
    /// The replica could not be reached: nothing of the request was sent to it.
    NotSent(String),
}

/// The proxy's JSON error for a body that could not be read (too large: 413).
fn body_rejected(proxy: &Proxy, rejection: BytesRejection) -> Response {
    let status = rejection.status();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!(
            "the request body is larger than this proxy's limit of {} bytes \
                 (--max-body-bytes)",
            proxy.config.max_body_bytes
        )
    } else {
        format!(
            "the request body could not be read: {}",
            rejection.body_text()
        )
    };
    proxy
        .metrics
        .request("none", "body", status.as_u16(), Outcome::Rejected, 0, 0.0);
    let mut response = error(status, "BadRequestError", message);
    // The unread rest of the body makes the connection unusable: hyper closes it after this
    // answer, and a client must not pick it from its pool for the next request.
    response.headers_mut().insert(
        axum::http::header::CONNECTION,
        HeaderValue::from_static("close"),
    );
    response
}

/// `Some(401)` when the proxy has an `--api-key` and `headers` do not carry it as a bearer
/// token (the check vLLM's own `--api-key` makes: scheme case-insensitive, exact key).
fn unauthorized(proxy: &Proxy, headers: &HeaderMap) -> Option<Response> {
    let key = proxy.config.api_key.as_deref()?;
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token);
    let ok = given.is_some_and(|token| {
        // Constant time in the key's content.
        token.len() == key.len()
            && token
                .bytes()
                .zip(key.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    });
    (!ok).then(|| {
        error(
            StatusCode::UNAUTHORIZED,
            "AuthenticationError",
            "this route of the proxy needs `Authorization: Bearer <key>` with its --api-key",
        )
    })
}

async fn handle(
    proxy: Arc<Proxy>,
    session: Option<String>,
    rest: String,
    method: Method,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let body = match body {
        Ok(b) => b,
        Err(rejection) => return body_rejected(&proxy, rejection),
    };
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
            let (proxy, path, method, headers, body) = (&proxy, &path, &method, &headers, &body);
            return each_replica(
                proxy,
                kind,
                || proxy.replicas.route_ungated(),
                move |replica, route| async move {
                    let (method, body) = (method.clone(), body.clone());
                    forward(
                        proxy, &replica, kind, path, method, headers, body, None, route, started,
                    )
                    .await
                },
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
    let turn = Turn {
        session: &session,
        kind,
        path: &path,
        method: &method,
        headers: &headers,
        body: &body,
        request: &request,
        max_tokens,
        started,
    };
    serve_turn(&proxy, turn).await
}

/// A gated turn: tokenized (on its home, else any replica: they serve one model, and placement
/// needs the prompt's length), placed ([`place_turn`]), tokenized again on the replica chosen
/// if that is another one (a replica that cannot answer `/tokenize` gets no turn: it may accept
/// connections and drop requests), then admitted and forwarded there. A replica that could not
/// be reached (at tokenize, admit or forward) has seen nothing of the turn: it is marked
/// unhealthy and the turn is placed again, its session moving.
async fn serve_turn(proxy: &Arc<Proxy>, t: Turn<'_>) -> Response {
    let mut last_failure = String::new();
    // The prompt's ids and the replica that tokenized them.
    let mut prompt: Option<(Vec<u32>, usize)> = None;
    // Where the turn moved while it waited for admission, to be admitted there instead.
    let mut moved: Option<Spot> = None;
    let mut moves = 0;
    let mut attempts = 0;
    while attempts <= proxy.replicas.snapshot().len() * 2 {
        let Some(index) = prompt
            .as_ref()
            .map(|p| p.1)
            .or_else(|| proxy.replicas.tokenizer(t.session))
        else {
            return no_replica(proxy, t.kind);
        };
        if prompt.is_none() {
            match tokenize(proxy, index, t).await {
                Ok(ids) => prompt = Some((ids, index)),
                Err(Attempt::Done(response)) => return response,
                Err(Attempt::NotSent(why)) => {
                    attempts += 1;
                    last_failure = why;
                    continue;
                }
            }
        }
        let Some((ids, tokenized_on)) = &prompt else {
            continue;
        };
        let spot = match moved.take() {
            Some(spot) => spot,
            None => match place_turn(proxy, t, ids).await {
                Some(spot) => spot,
                None => return no_replica(proxy, t.kind),
            },
        };
        let route = &spot.route;
        let replica = proxy.replicas.get(route.index);
        // Counted as waiting there (placement's queue and backlog) until the gate answers.
        let waiting = replica.awaiting_admission(route.is_first());
        if let Some(from) = route.moved_from {
            leave_replica(proxy, from, t.session);
        }
        if route.index != *tokenized_on {
            match tokenize(proxy, route.index, t).await {
                Ok(ids) => prompt = Some((ids, route.index)),
                Err(Attempt::Done(response)) => return response,
                Err(Attempt::NotSent(why)) => {
                    attempts += 1;
                    last_failure = why;
                    continue;
                }
            }
        }
        let ids = prompt.as_ref().map_or(&[][..], |p| &p.0[..]);
        // Only `gate` moves waiting turns, and a turn at most once per replica: a move goes
        // only to a replica that would admit it now, so a second one is rare and a third a
        // sign of churn.
        let may_move = proxy.replicas.policy().moves_waiting_turns()
            && moves < proxy.replicas.snapshot().len();
        let admission = waiting::admit_or_move(proxy, &replica, t, ids, &spot, may_move).await;
        drop(waiting);
        let admitted = match admission {
            Admission::Moved(next) => {
                moves += 1;
                moved = Some(next);
                continue;
            }
            Admission::Answered(admitted) => admitted,
        };
        match gated(proxy, &replica, t, admitted, spot.route).await {
            Attempt::Done(response) => return response,
            Attempt::NotSent(why) => {
                attempts += 1;
                replica.mark_unhealthy(&why);
                last_failure = why;
            }
        }
    }
    unreachable_replicas(proxy, t.kind, &last_failure)
}

/// The turn's prompt ids from replica `index`: `Err(Done)` for the client (the replica's own
/// error, counted rejected), `Err(NotSent)` when the replica could not be reached (counted
/// rerouted, marked unhealthy: the caller goes on elsewhere).
async fn tokenize(proxy: &Arc<Proxy>, index: usize, t: Turn<'_>) -> Result<Vec<u32>, Attempt> {
    let replica = proxy.replicas.get(index);
    match prompt_ids(proxy, &replica, t.kind, t.request).await {
        Ok(ids) => Ok(ids),
        Err(Attempt::Done(response)) => {
            proxy.metrics.request(
                &replica.url.base,
                t.kind.route(),
                response.status().as_u16(),
                Outcome::Rejected,
                0,
                0.0,
            );
            Err(Attempt::Done(response))
        }
        Err(Attempt::NotSent(why)) => {
            rerouted(proxy, &replica, t.kind);
            replica.mark_unhealthy(&why);
            Err(Attempt::NotSent(why))
        }
    }
}

/// Where this turn goes, by the placement policy ([`Replicas::place`]). A session this proxy
/// has not seen is first looked for on the replicas ([`find_home`]). A new session that no
/// replica would take now (each has its backlog of new sessions waiting) is held here and asked
/// about again when a turn is admitted or finishes, a replica's health or the list changes, or
/// every `wait_poll_sec`; held `max_wait_sec` (the gate's), it goes where it would go were no
/// replica backlogged. `None`: no replica is up.
async fn place_turn(proxy: &Arc<Proxy>, t: Turn<'_>, prompt_ids: &[u32]) -> Option<Spot> {
    let gate = &proxy.config.gate;
    let max_tokens = t.max_tokens.unwrap_or(gate.default_max_tokens);
    let mut view = placing::session_view(prompt_ids.len(), max_tokens, proxy.replicas.block_size());
    let found = find_home(proxy, t.session, prompt_ids, view.prompt_blocks).await;
    if let Some((placing::Lookup::New { shared_blocks }, _)) = &found {
        view.shared_blocks = (*shared_blocks).min(view.prompt_blocks);
    }
    let poll = Duration::from_secs_f64(gate.wait_poll_sec);
    let deadline = gate
        .max_wait_sec
        .map(|s| Instant::now() + Duration::from_secs_f64(s));
    loop {
        let changed = proxy.replicas.changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let home_hit = home_hit(proxy, t.session, prompt_ids, &view).await;
        let past = deadline.is_some_and(|d| Instant::now() >= d);
        let lookup = found.as_ref().map(|(l, hits)| (*l, &hits[..]));
        match proxy
            .replicas
            .place(t.session, &view, home_hit, lookup, past)
        {
            Placing::Route(route) => {
                let hits = found.map(|(_, hits)| hits).unwrap_or_default();
                return Some(Spot { route, view, hits });
            }
            Placing::NoReplica => return None,
            Placing::Hold => {
                let wake = deadline.map_or(poll, |d| {
                    poll.min(d.saturating_duration_since(Instant::now()))
                });
                let _ = tokio::time::timeout(wake, changed).await;
            }
        }
    }
}

/// What the replicas say of a session this proxy has not seen (`None` when it has, when fewer
/// than two replicas are up, or under `hash`, which every proxy computes alike): every up
/// replica's prefix probe is asked for the prompt at once, each bounded by
/// `probe_timeout_sec`; the hits (per replica index, `None` for one down or silent) and what
/// [`placing::find_home`] makes of them.
async fn find_home(
    proxy: &Proxy,
    session: &str,
    prompt_ids: &[u32],
    prompt_blocks: u64,
) -> Option<(placing::Lookup, Vec<Option<u64>>)> {
    if proxy.replicas.policy() == Router::Hash || proxy.replicas.session_replica(session).is_some()
    {
        return None;
    }
    let list = proxy.replicas.snapshot();
    let up: Vec<usize> = (0..list.len())
        .filter(|&i| list[i].grade() != Grade::Down)
        .collect();
    if up.len() < 2 {
        return None;
    }
    let timeout = Duration::from_secs_f64(proxy.config.gate.probe_timeout_sec);
    let asked = up.iter().map(|&i| {
        let replica = list[i].clone();
        async move {
            let answer = tokio::time::timeout(timeout, replica.probe.prefix(session, prompt_ids));
            match answer.await {
                Ok(Ok(report)) => (i, Some(report.hit_blocks)),
                _ => (i, None),
            }
        }
    });
    let mut hits = vec![None; list.len()];
    for (i, hit) in futures_util::future::join_all(asked).await {
        hits[i] = hit;
    }
    Some((placing::find_home(&hits, prompt_blocks), hits))
}

/// The prompt blocks of a returning session resident on its home: all of them while its gate
/// in this proxy holds the session's reservation, else what the home's prefix probe finds (0
/// when it cannot tell, or the home is not healthy: placement moves it or counts it cold).
pub(super) async fn home_hit(
    proxy: &Proxy,
    session: &str,
    prompt_ids: &[u32],
    view: &placement::SessionView,
) -> u64 {
    let Some(home) = proxy.replicas.session_replica(session) else {
        return 0;
    };
    let replica = proxy.replicas.get(home);
    if replica.grade() != Grade::Healthy {
        return 0;
    }
    if replica.gate.inspect(|core| core.has_reservation(session)) {
        return view.prompt_blocks;
    }
    let timeout = Duration::from_secs_f64(proxy.config.gate.probe_timeout_sec);
    match tokio::time::timeout(timeout, replica.probe.prefix(session, prompt_ids)).await {
        Ok(Ok(report)) => report.hit_blocks,
        _ => 0,
    }
}

/// Counts a turn that reached nothing on `replica` (it could not be reached).
fn rerouted(proxy: &Proxy, replica: &Replica, kind: Kind) {
    proxy.metrics.request(
        &replica.url.base,
        kind.route(),
        502,
        Outcome::Rerouted,
        0,
        0.0,
    );
}

/// Tries the request on one replica after another, as `next` routes it (at most once per
/// replica), until one answers. A replica that cannot be reached (at tokenize, admit or
/// forward) has seen nothing of the request: it is marked unhealthy, so the next route (a
/// session is re-pinned) goes to another healthy one. Anything that may have reached vLLM is
/// answered as it ended, never replayed.
async fn each_replica<F: Future<Output = Attempt>>(
    proxy: &Arc<Proxy>,
    kind: Kind,
    mut next: impl FnMut() -> Option<Route>,
    mut attempt: impl FnMut(Arc<Replica>, Route) -> F,
) -> Response {
    let mut last_failure = String::new();
    for _ in 0..proxy.replicas.snapshot().len() {
        let Some(route) = next() else {
            return no_replica(proxy, kind);
        };
        let replica = proxy.replicas.get(route.index);
        match attempt(replica.clone(), route).await {
            Attempt::Done(response) => return response,
            Attempt::NotSent(why) => {
                replica.mark_unhealthy(&why);
                last_failure = why;
            }
        }
    }
    unreachable_replicas(proxy, kind, &last_failure)
}

/// Ends a session's window on the replica it just left (that replica is unhealthy): its
/// reservation there must not wait out the idle grace. In the background: the replica may be
/// dead, and a probe to it can take the probe timeout.
fn leave_replica(proxy: &Arc<Proxy>, index: usize, session: &str) {
    let proxy = proxy.clone();
    let session = session.to_string();
    tokio::spawn(async move {
        let replica = &proxy.replicas.get(index);
        // Whether it had a window does not matter, nor does an engine that cannot be asked:
        // a dead engine frees this proxy's leases one TTL after its last call.
        let _ = proxy.replica_gate.finish_session(replica, &session).await;
    });
}

/// One gated request, as the handler read it.
#[derive(Clone, Copy)]
pub(super) struct Turn<'a> {
    pub(super) session: &'a str,
    kind: Kind,
    path: &'a str,
    method: &'a Method,
    headers: &'a HeaderMap,
    body: &'a Bytes,
    request: &'a Value,
    pub(super) max_tokens: Option<usize>,
    started: Instant,
}

/// Where placement put a turn, and what it read of the turn to decide (kept to ask again
/// while the turn waits for admission: [`waiting::admit_or_move`]).
pub(super) struct Spot {
    pub(super) route: Route,
    /// The turn's blocks as placement saw them.
    pub(super) view: placement::SessionView,
    /// Per replica, the leading blocks of the prompt resident there when a session this proxy
    /// had not seen was looked for ([`find_home`]); empty otherwise.
    pub(super) hits: Vec<Option<u64>>,
}

/// One attempt of a gated turn on the replica placement chose, its gate's answer in: forward
/// it when admitted, else the client's error.
async fn gated(
    proxy: &Arc<Proxy>,
    replica: &Arc<Replica>,
    t: Turn<'_>,
    admitted: Result<ReplicaLease, AdmitError>,
    route: Route,
) -> Attempt {
    // Nothing of the turn reached this replica's vLLM (admit could not be done there): counted
    // as rerouted, and the caller places it again.
    let rerouted = |why: String| {
        rerouted(proxy, replica, t.kind);
        Attempt::NotSent(why)
    };
    let lease = match admitted {
        Ok(lease) => lease,
        Err(AdmitError::NotSent(why)) => return rerouted(why),
        Err(AdmitError::Preempted { .. }) => {
            proxy.metrics.preempted(t.session);
            proxy.metrics.request(
                &replica.url.base,
                t.kind.route(),
                409,
                Outcome::Preempted,
                0,
                0.0,
            );
            let mut response = error(
                StatusCode::CONFLICT,
                "preempted",
                format!(
                    "a newer request of session {:?} arrived while this one waited for \
                     admission; this attempt was dropped and never reached vLLM",
                    t.session
                ),
            );
            // OpenAI's clients retry 409 by default; a preempted attempt must not come back.
            response
                .headers_mut()
                .insert("x-should-retry", HeaderValue::from_static("false"));
            return Attempt::Done(response);
        }
        Err(AdmitError::Failed { status, message }) => {
            let kind_name = if status == StatusCode::BAD_REQUEST {
                "BadRequestError"
            } else {
                "InternalServerError"
            };
            return Attempt::Done(error(status, kind_name, message));
        }
    };
    forward(
        proxy,
        replica,
        t.kind,
        t.path,
        t.method.clone(),
        t.headers,
        t.body.clone(),
        Some(lease),
        route,
        t.started,
    )
    .await
}

fn unreachable_replicas(proxy: &Proxy, kind: Kind, why: &str) -> Response {
    proxy
        .metrics
        .request("none", kind.route(), 502, Outcome::Rejected, 0, 0.0);
    error(
        StatusCode::BAD_GATEWAY,
        "BadGatewayError",
        format!("no vLLM replica could be reached (the request was sent to none): {why}"),
    )
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
) -> Result<Vec<u32>, Attempt> {
    let done = |r: Response| Attempt::Done(r);
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
                    done(error(
                        StatusCode::BAD_REQUEST,
                        "BadRequestError",
                        "prompt token ids must be integers in 0..2^32",
                    ))
                });
            }
            _ => {
                return Err(done(error(
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    "a session's completions request needs one prompt: a string or a list of \
                     token ids (batched prompts are not gated)",
                )));
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
                return Err(done(error(
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    "a chat request needs messages",
                )));
            }
            Value::Object(body)
        }
        Kind::Models => return Ok(Vec::new()),
    };
    let bytes = serde_json::to_vec(&tokenize_body).unwrap_or_default();
    let uri = format!("{}/tokenize", replica.url.base);
    let req = post_request(
        &uri,
        &replica.url.authority,
        proxy.config.replica_authorization.as_deref(),
        "application/json",
        Bytes::from(bytes),
    )
    .map_err(|e| {
        done(error(
            StatusCode::BAD_GATEWAY,
            "BadGatewayError",
            e.to_string(),
        ))
    })?;
    let upstream_error = |e: &dyn std::fmt::Display| {
        done(error(
            StatusCode::BAD_GATEWAY,
            "BadGatewayError",
            format!("{uri}: {e}"),
        ))
    };
    let timeout = Duration::from_secs_f64(proxy.config.response_timeout_sec);
    // `/tokenize` changes nothing in vLLM, so any transport failure (refused, or a pooled
    // connection the dead replica had closed: hyper's `SendRequest`) leaves the turn unsent:
    // it is tokenized again on another replica rather than answered 502.
    let resp = match tokio::time::timeout(timeout, proxy.client.request(req)).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => return Err(Attempt::NotSent(format!("{uri}: {e}"))),
        Err(_) => {
            return Err(done(gateway_timeout(
                &uri,
                proxy.config.response_timeout_sec,
            )));
        }
    };
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Attempt::NotSent(format!("{uri}: {e}")))?
        .to_bytes();
    if !status.is_success() {
        // vLLM's own error (unknown model, bad messages, …) goes back as it is.
        let mut r = Response::new(Body::from(bytes));
        *r.status_mut() = status;
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return Err(done(r));
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| upstream_error(&e))?;
    v.get("tokens")
        .and_then(ids_of)
        .ok_or_else(|| upstream_error(&"tokenize answered without tokens"))
}

fn gateway_timeout(uri: &str, secs: f64) -> Response {
    error(
        StatusCode::GATEWAY_TIMEOUT,
        "GatewayTimeoutError",
        format!(
            "{uri} sent no response within {secs} s (--response-timeout-sec); the request may \
             have reached vLLM and is not retried"
        ),
    )
}

/// vLLM's header naming the data-parallel rank a request must run on.
const DP_RANK_HEADER: &str = "x-data-parallel-rank";

#[allow(clippy::too_many_arguments)]
async fn forward(
    proxy: &Arc<Proxy>,
    replica: &Arc<Replica>,
    kind: Kind,
    path: &str,
    method: Method,
    headers: &HeaderMap,
    body: Bytes,
    lease: Option<ReplicaLease>,
    route: Route,
    started: Instant,
) -> Attempt {
    let uri = format!("{}{}", replica.url.base, path);
    let mut builder = hyper::Request::builder()
        .method(method)
        .uri(&uri)
        .header(hyper::header::HOST, &replica.url.authority);
    // A turn the replica's own engine gate admitted must not be admitted there again.
    let keep_session = lease
        .as_ref()
        .is_none_or(ReplicaLease::forwards_session_header);
    let dp_rank = lease.as_ref().and_then(ReplicaLease::dp_rank);
    for (name, value) in headers {
        let drop_session = !keep_session && name.as_str() == proxy.config.session_header;
        let replaced = dp_rank.is_some() && name.as_str() == DP_RANK_HEADER;
        if !is_hop_header(name.as_str()) && !drop_session && !replaced {
            builder = builder.header(name, value);
        }
    }
    if let Some(rank) = dp_rank {
        builder = builder.header(DP_RANK_HEADER, rank);
    }
    let request = match builder.body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => {
            return Attempt::Done(error(
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                e.to_string(),
            ));
        }
    };
    let mut guard = Guard {
        proxy: proxy.clone(),
        _in_flight: replica.in_flight(),
        replica: replica.clone(),
        route: kind.route(),
        status: 502,
        turn: route.turn,
        started,
        lease,
        done: false,
    };
    let timeout = Duration::from_secs_f64(proxy.config.response_timeout_sec);
    let upstream = match tokio::time::timeout(timeout, proxy.client.request(request)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) if never_sent(&e) => {
            guard.finish(Outcome::Rerouted);
            return Attempt::NotSent(format!("{uri}: {e}"));
        }
        Ok(Err(e)) => {
            let e = e.to_string();
            return guard.broke(&uri, &e, "after the request was sent").await;
        }
        Err(_) => return guard.timed_out(&uri),
    };
    let (parts, mut incoming) = upstream.into_parts();
    // The answer is passed on from its first body frame, not its headers: a turn whose replica
    // dies between the two (vLLM sends a stream's headers before its first token) has given
    // the client nothing, and is placed again like one never sent. A replica still alive that
    // failed there answers 502, as any failure after sending.
    let first = match tokio::time::timeout(timeout, incoming.frame()).await {
        Ok(Some(Ok(frame))) => Some(frame),
        Ok(None) => None,
        Ok(Some(Err(e))) => {
            let e = e.to_string();
            return guard.broke(&uri, &e, "before its answer began").await;
        }
        Err(_) => return guard.timed_out(&uri),
    };
    // Counted with the replica's status only once it is what the client gets: a failure before
    // the first frame answers the client 502 (or 504), and is counted so.
    guard.status = parts.status.as_u16();
    let idle_timeout = Duration::from_secs_f64(proxy.config.idle_timeout_sec);
    let mut response = Response::new(Body::new(Tracked {
        first,
        inner: incoming,
        guard,
        idle: Box::pin(tokio::time::sleep(idle_timeout)),
        idle_timeout,
    }));
    *response.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        if !is_hop_header(name.as_str()) {
            response.headers_mut().append(name, value.clone());
        }
    }
    Attempt::Done(response)
}

/// Whether `replica` refuses a new connection now (asked on a connection of its own: a pooled
/// one the dead replica's end closed would only fail again, and say nothing).
async fn gone(proxy: &Proxy, replica: &Replica) -> bool {
    let fresh = upstream::client(Duration::from_secs_f64(proxy.config.connect_timeout_sec));
    match replicas::check(&fresh, replica).await {
        Health::Unreachable => true,
        Health::Ok => false,
        Health::Failed => {
            // A replica in the middle of dying resets its connections before its listening
            // socket closes, so the check can still connect and then be reset: look once more
            // when its exit has had time to finish. A replica that is alive but failing stays
            // reachable and keeps its 502.
            tokio::time::sleep(DYING_RECHECK).await;
            replicas::check(&fresh, replica).await == Health::Unreachable
        }
    }
}

/// How long [`gone`] waits before it checks a replica whose health check failed again.
const DYING_RECHECK: Duration = Duration::from_millis(250);

/// Releases the lease and records the request, exactly once, however the answer ends.
struct Guard {
    proxy: Arc<Proxy>,
    /// Counts the request in the replica's load until the answer is dropped.
    _in_flight: InFlight,
    replica: Arc<Replica>,
    route: &'static str,
    status: u16,
    turn: u64,
    started: Instant,
    lease: Option<ReplicaLease>,
    done: bool,
}

impl Guard {
    /// Ends a turn whose exchange with the replica broke (`e`, `when` it broke) before the
    /// client got anything. A replica that now refuses connections is gone, and whatever of
    /// the request it got died with it (nothing was answered, and a client that vanished has
    /// its request aborted by vLLM): the turn is placed again (`NotSent`) rather than lost
    /// with it. A replica still alive answers 502, not retried.
    async fn broke(&mut self, uri: &str, e: &str, when: &str) -> Attempt {
        if gone(&self.proxy, &self.replica).await {
            self.finish(Outcome::Rerouted);
            return Attempt::NotSent(format!("{uri}: {e} (the replica is gone)"));
        }
        self.finish(Outcome::UpstreamFailed);
        let base = &self.replica.url.base;
        Attempt::Done(error(
            StatusCode::BAD_GATEWAY,
            "BadGatewayError",
            format!("replica {base} failed {when} (not retried): {e}"),
        ))
    }

    /// Ends a turn whose replica sent nothing within `--response-timeout-sec`: 504.
    fn timed_out(&mut self, uri: &str) -> Attempt {
        self.status = 504;
        self.finish(Outcome::UpstreamFailed);
        Attempt::Done(gateway_timeout(uri, self.proxy.config.response_timeout_sec))
    }

    fn finish(&mut self, outcome: Outcome) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        if let Some(lease) = self.lease.take() {
            lease.release();
            // Room freed: a turn held by placement may go now.
            self.proxy.replicas.notify_changed();
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
/// lease until the answer is complete or abandoned. A body silent for longer than the idle
/// timeout is cut off (the client sees the answer end early; it is not retried).
struct Tracked {
    /// The body's first frame, read before the answer was passed on ([`forward`]).
    first: Option<Frame<Bytes>>,
    inner: Incoming,
    guard: Guard,
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_timeout: Duration,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = &mut *self;
        if let Some(frame) = this.first.take() {
            if this.inner.is_end_stream() {
                this.guard.finish(Outcome::Completed);
            }
            return Poll::Ready(Some(Ok(frame)));
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.guard.finish(Outcome::Completed),
            Poll::Ready(Some(Err(_))) => this.guard.finish(Outcome::UpstreamFailed),
            // The server may stop polling once the body says it is complete.
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => {
                this.guard.finish(Outcome::Completed)
            }
            Poll::Ready(Some(Ok(_))) => {
                let deadline = tokio::time::Instant::now() + this.idle_timeout;
                this.idle.as_mut().reset(deadline);
            }
            Poll::Pending => {
                if this.idle.as_mut().poll(cx).is_ready() {
                    this.guard.status = 504;
                    this.guard.finish(Outcome::UpstreamFailed);
                    let secs = this.idle_timeout.as_secs_f64();
                    return Poll::Ready(Some(Err(format!(
                        "replica {} sent nothing for {secs} s (--idle-timeout-sec)",
                        this.guard.replica.url.base
                    )
                    .into())));
                }
            }
        }
        polled.map(|p| p.map(|r| r.map_err(axum::BoxError::from)))
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let mut hint = self.inner.size_hint();
        let first = self
            .first
            .as_ref()
            .and_then(Frame::data_ref)
            .map_or(0, |d| d.len() as u64);
        if first > 0 {
            // Upper first: a lower bound above the upper one panics.
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper + first);
            }
            hint.set_lower(hint.lower() + first);
        }
        hint
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let outcome = if self.is_end_stream() {
            Outcome::Completed
        } else {
            Outcome::ClientDisconnected
        };
        self.guard.finish(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::placement::PlaceReason;
    use crate::proxy::config::{ProxyArgs, ProxyConfig};
    use crate::proxy::replicas::Awaiting;

    /// A proxy over two replicas nobody listens on (nothing here connects to them).
    fn proxy(wait_poll_sec: f64, max_wait_sec: Option<f64>) -> Arc<Proxy> {
        let args = ProxyArgs {
            replicas: vec!["http://127.0.0.1:9".into(), "http://127.0.0.1:10".into()],
            wait_poll_sec: Some(wait_poll_sec),
            max_wait_sec,
            ..Default::default()
        };
        Proxy::new(ProxyConfig::from_toml(&args, "").unwrap()).unwrap()
    }

    /// Fills every replica's backlog: two new sessions waiting for admission on each.
    fn backlog(proxy: &Proxy) -> Vec<Awaiting> {
        let turn = placing::session_view(64, 16, 16);
        (0..4)
            .map(|k| {
                match proxy
                    .replicas
                    .place(&format!("w{k}"), &turn, 0, None, false)
                {
                    Placing::Route(route) => {
                        proxy.replicas.get(route.index).awaiting_admission(true)
                    }
                    other => panic!("w{k}: {other:?}"),
                }
            })
            .collect()
    }

    async fn placed(proxy: &Arc<Proxy>, session: &str) -> Option<Route> {
        let (method, headers, body, request) = (
            Method::POST,
            HeaderMap::new(),
            Bytes::new(),
            json!({ "prompt": "x" }),
        );
        let t = Turn {
            session,
            kind: Kind::Completions,
            path: "/v1/completions",
            method: &method,
            headers: &headers,
            body: &body,
            request: &request,
            max_tokens: Some(16),
            started: Instant::now(),
        };
        place_turn(proxy, t, &[7; 64]).await.map(|spot| spot.route)
    }

    #[tokio::test]
    async fn a_held_new_session_goes_as_soon_as_a_first_turn_is_admitted() {
        // A poll far longer than the test: only the wake can place it in time.
        let proxy = proxy(60.0, None);
        let mut waiting = backlog(&proxy);
        let held = tokio::spawn({
            let proxy = proxy.clone();
            async move { placed(&proxy, "late").await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !held.is_finished(),
            "placed while every replica had its backlog"
        );
        // The last one's first turn is admitted: the held session goes where it waited.
        let freed_index = proxy.replicas.session_replica("w3").unwrap();
        drop(waiting.pop());
        let route = tokio::time::timeout(Duration::from_secs(5), held)
            .await
            .expect("woken by the admission")
            .unwrap()
            .expect("a replica");
        assert_eq!(route.index, freed_index);
        assert_eq!(route.reason, Some(PlaceReason::New));
        let (stats, timeouts) = proxy.replicas.placement_stats();
        assert!(stats.held >= 1, "{stats:?}");
        assert_eq!((stats.new, timeouts), (5, 0));
    }

    #[tokio::test]
    async fn a_held_new_session_is_placed_past_the_backlogs_after_max_wait() {
        let proxy = proxy(60.0, Some(0.3));
        let _waiting = backlog(&proxy);
        let started = Instant::now();
        let route = tokio::time::timeout(Duration::from_secs(5), placed(&proxy, "late"))
            .await
            .expect("placed after max_wait_sec")
            .expect("a replica");
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(route.reason, Some(PlaceReason::New));
        assert_eq!(proxy.replicas.placement_stats().1, 1);
    }
}
