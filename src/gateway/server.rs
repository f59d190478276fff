//! The routes and what each request goes through: the key, the body (at
//! most `max_body_bytes`), the mapping, the model's check, then a chat job
//! of the key's tenant (its user the key's, never the body's), answered in
//! the API's shape, streamed or not.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_config::FleetConfig;
use toolfleet_protocol::{ChatEventBody, ChatJob, Subjects};
use toolfleet_store::CitationStore;
use toolfleet_store::api_keys::ApiKeyRecord;

use super::answer::{Answer, Collected};
use super::auth::{authenticate, check_model, models};
use super::error::ApiError;
use super::job::Follow;
use super::metrics::{GatewayMetrics, track};
use super::request::{self, Ask};
use super::stream::{INVOCATION_HEADER, Meta, respond};
use super::{chat, responses};

/// What a gateway serves with, parsed before it starts.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub subjects: Subjects,
    /// The profiles file: which models exist and which tenants may use
    /// them.
    pub profiles: Arc<FleetConfig>,
    /// How long a request may take; also its job's deadline.
    pub timeout: Duration,
    /// The largest request body taken.
    pub max_body_bytes: usize,
    /// How often a quiet stream sends a keep-alive comment.
    pub keep_alive: Duration,
}

impl GatewayConfig {
    /// The defaults but for what must be given.
    pub fn new(subjects: Subjects, profiles: FleetConfig) -> Self {
        Self {
            subjects,
            profiles: Arc::new(profiles),
            timeout: Duration::from_secs(super::DEFAULT_TIMEOUT_SECS),
            max_body_bytes: toolfleet_protocol::MAX_JOB_BYTES,
            keep_alive: Duration::from_secs(10),
        }
    }
}

/// What every request shares.
struct Gateway {
    client: async_nats::Client,
    store: CitationStore,
    config: GatewayConfig,
    /// Unix seconds at start: the models' `created`.
    started: u64,
    tracker: TaskTracker,
}

/// Serves the gateway on `listener` until `shutdown` (letting requests in
/// flight finish), its tasks on `tracker`, its metrics on `registry`.
/// Returns the address it serves on once it accepts connections.
///
/// # Errors
///
/// A metric already registered, or a listener without an address.
pub async fn start(
    listener: tokio::net::TcpListener,
    client: async_nats::Client,
    store: CitationStore,
    config: GatewayConfig,
    registry: &prometheus::Registry,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let metrics = GatewayMetrics::register(registry)?;
    let addr = listener.local_addr()?;
    let gateway = Arc::new(Gateway {
        client,
        store,
        config,
        started: toolfleet_protocol::now_ms() / 1000,
        tracker: tracker.clone(),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(create_response))
        .route("/v1/responses/{id}", get(get_response))
        .route("/v1/models", get(list_models))
        .fallback(|| async { ApiError::not_found("Unknown path.").into_response() })
        .with_state(gateway)
        .layer(axum::middleware::from_fn_with_state(metrics, track));
    tracker.spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the gateway stopped");
        }
    });
    tracing::info!(%addr, "the OpenAI-compatible gateway serves");
    Ok(addr)
}

async fn chat_completions(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(&gw, &headers, body, Api::Chat).await
}

async fn create_response(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(&gw, &headers, body, Api::Responses).await
}

#[derive(Clone, Copy)]
enum Api {
    Chat,
    Responses,
}

/// A request of either API, from its key to its answer.
async fn answer(gw: &Gateway, headers: &HeaderMap, body: Body, api: Api) -> Response {
    let (ask, key) = match read(gw, headers, body, api).await {
        Ok(read) => read,
        Err(e) => return e.into_response(),
    };
    // NATS away: say so at once rather than wait for its return.
    if gw.client.connection_state() != async_nats::connection::State::Connected {
        return ApiError::unavailable(
            "The gateway cannot reach the fleet (NATS) now; try again shortly.",
        )
        .into_response();
    }
    let job = chat_job(&ask, &key, headers, gw.config.timeout);
    tracing::info!(
        invocation = %job.invocation_id,
        tenant = %key.tenant,
        key = %key.id,
        model = %ask.model,
        stream = ask.stream,
        "gateway request"
    );
    let meta = Meta {
        invocation_id: job.invocation_id.clone(),
        model: ask.model.clone(),
        created: toolfleet_protocol::now_ms() / 1000,
    };
    let mut follow = Follow::start(&gw.client, &gw.config.subjects, job, gw.config.timeout);
    let keep_alive = gw.config.keep_alive;
    match (api, ask.stream) {
        (Api::Chat, true) => {
            let frames = chat::ChatChunks::new(meta, ask.include_usage);
            respond(follow, frames, keep_alive, &gw.tracker).await
        }
        (Api::Responses, true) => {
            let frames = responses::ResponseEvents::new(meta);
            respond(follow, frames, keep_alive, &gw.tracker).await
        }
        (api, false) => match follow.collect().await {
            Ok(c) => whole(api, &meta, &c),
            Err(e) => e.into_response(),
        },
    }
}

fn whole(api: Api, meta: &Meta, c: &Collected) -> Response {
    let body = match api {
        Api::Chat => chat::completion(meta, c),
        Api::Responses => responses::complete(meta, c),
    };
    (
        [(INVOCATION_HEADER, meta.invocation_id.clone())],
        axum::Json(body),
    )
        .into_response()
}

/// The key, the body and the model, checked in that order.
async fn read(
    gw: &Gateway,
    headers: &HeaderMap,
    body: Body,
    api: Api,
) -> Result<(Ask, ApiKeyRecord), ApiError> {
    let key = authenticate(&gw.store, headers).await?;
    let object = read_body(headers, body, gw.config.max_body_bytes).await?;
    let ask = match api {
        Api::Chat => request::chat_completions(&object)?,
        Api::Responses => request::responses(&object)?,
    };
    check_model(&gw.config.profiles, &key, &ask.model)?;
    Ok((ask, key))
}

async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Map<String, Value>, ApiError> {
    let too_large = || {
        ApiError::too_large(format!(
            "The request body is larger than the {limit} bytes the gateway takes."
        ))
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    // Past the limit the read stops with an error: a body sent without its
    // length, or with a false one.
    let bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| too_large())?;
    request::object(&bytes)
}

/// The chat job of a request: the key's tenant and user, the profile the
/// request names, the gateway's deadline, the caller's trace.
fn chat_job(ask: &Ask, key: &ApiKeyRecord, headers: &HeaderMap, timeout: Duration) -> ChatJob {
    let mut job = toolfleet_protocol::client::question("");
    job.messages = ask.messages.clone();
    job.profile = Some(ask.model.clone());
    job.tenant = Some(key.tenant.clone());
    job.user = key.user.clone();
    job.timeout_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
    job.traceparent = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .filter(|t| is_traceparent(t))
        .map(str::to_string);
    job
}

/// `00-<32 hex>-<16 hex>-<2 hex>`, the W3C shape.
fn is_traceparent(t: &str) -> bool {
    let parts: Vec<&str> = t.split('-').collect();
    parts.len() == 4
        && [2, 32, 16, 2]
            .iter()
            .zip(&parts)
            .all(|(n, p)| p.len() == *n && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// `GET /v1/models`: the profiles the key may use.
async fn list_models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    let key = match authenticate(&gw.store, &headers).await {
        Ok(key) => key,
        Err(e) => return e.into_response(),
    };
    let data: Vec<Value> = models(&gw.config.profiles, &key)
        .into_iter()
        .map(|id| json!({ "id": id, "object": "model", "created": gw.started, "owned_by": "toolfleet" }))
        .collect();
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

/// `GET /v1/responses/{id}`: a response of the key's tenant, from the
/// invocation's latest event the fleet keeps (two hours): its answer once
/// completed (after an approval too), `in_progress` while it runs or
/// waits, `failed` with the error.
async fn get_response(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let key = match authenticate(&gw.store, &headers).await {
        Ok(key) => key,
        Err(e) => return e.into_response(),
    };
    let not_found = || ApiError::not_found(format!("No response with id {id:?}.")).into_response();
    let Some(invocation_id) = id
        .strip_prefix("resp_")
        .filter(|i| toolfleet_protocol::valid_invocation_id(i))
    else {
        return not_found();
    };
    let event = toolfleet_protocol::client::last_event(
        &gw.client,
        &gw.config.subjects,
        &key.tenant,
        invocation_id,
    )
    .await;
    let event = match event {
        Ok(Some(event)) => event,
        Ok(None) => return not_found(),
        Err(e) => {
            return ApiError::unavailable(format!("The fleet cannot be read now ({e})."))
                .into_response();
        }
    };
    let meta = Meta {
        invocation_id: invocation_id.to_string(),
        model: String::new(),
        created: toolfleet_protocol::now_ms() / 1000,
    };
    let body = match event.body {
        body @ ChatEventBody::Completed { .. } => {
            let mut c = Collected::default();
            for out in Answer::default().on_event(body) {
                let _ = c.add(out);
            }
            responses::complete(&meta, &c)
        }
        ChatEventBody::Error { code, message, .. } => responses::response(
            &meta,
            "failed",
            Vec::new(),
            None,
            Some(json!({ "code": code, "message": message })),
        ),
        _ => responses::response(&meta, "in_progress", Vec::new(), None, None),
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_w3c_traceparent_is_passed_on() {
        assert!(is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "00-xyz-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(!is_traceparent(bad), "{bad}");
        }
    }
}
