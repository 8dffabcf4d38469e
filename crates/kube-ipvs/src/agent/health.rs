//! `/healthz`, `/livez`, `/proxyMode` and `/metrics` over HTTP, and the health verdict
//! behind them.
//!
//! kube-proxy's rules (`pkg/proxy/healthcheck/proxy_health.go`), with its JSON bodies:
//! unhealthy when a change has waited for a sync longer than the health timeout (twice the sync
//! period, kube-proxy's `2 * syncPeriod`) — "the queued-update rule"; `/healthz` is also 503 when
//! the Node is going away (deletion timestamp, or the cluster autoscaler's
//! `ToBeDeletedByClusterAutoscaler` taint: `nodeEligible: false`), so load balancers drain the
//! node first, while `/livez` ignores that. Two rules are stricter than kube-proxy's:
//! `/healthz` (and the health-check node ports) answer 503 until the first sync has finished
//! (kube-proxy answers 200 until its first queued update times out; `/livez` does too, so an
//! agent waiting for an unreachable API server is not restarted), and both answer 503 when no
//! sync at all finished within the health timeout after the first (the loop reconciles every
//! period, so a loop stuck in the kernel is seen even without changes). A sync in which every
//! operation failed, for more than one Service, does not count as finished (one Service the
//! kernel keeps refusing is retried, not a reason to drain the node).
//!
//! The monotonic clock is tokio's, so paused-time tests drive it; the wall times in the bodies
//! are the caller's. The server answers only these paths and never shows configuration or
//! credentials.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::jiff::Timestamp;
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::metrics::Metrics;

/// The health state the loop keeps and the servers read.
#[derive(Debug, Default)]
struct State {
    /// When a sync last finished (monotonic), and the wall time of it; `None` before the first.
    last_sync: Option<(Instant, SystemTime)>,
    /// When the oldest change not yet applied by a sync arrived.
    queued: Option<Instant>,
    /// Whether the Node is going away (`nodeEligible: false`).
    node_draining: bool,
    /// The families this node proxies, as kube-proxy names them (`IPv4`, `IPv6`).
    families: Vec<&'static str>,
}

/// What the agent shares with the HTTP servers.
#[derive(Debug)]
pub struct Shared {
    /// The counters.
    pub metrics: Mutex<Metrics>,
    state: Mutex<State>,
    /// How long a queued change may wait, and how long without a finished sync is a stall.
    timeout: Duration,
    /// How many syncs have finished, for anyone who wants to wait for the next one (tests).
    syncs: tokio::sync::watch::Sender<u64>,
    /// The `/configz` body, once set.
    configz: std::sync::OnceLock<String>,
}

/// The verdict at one moment, with what kube-proxy's JSON reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// `None` when live (`/livez`), else why not.
    pub problem: Option<String>,
    /// `None` when ready (`/healthz`, the Node's state aside), else why not: also not before
    /// the first sync.
    pub not_ready: Option<String>,
    /// The wall time of the last finished sync.
    pub last_updated: Option<SystemTime>,
    /// Whether the Node is going away.
    pub node_draining: bool,
    /// The families proxied.
    pub families: Vec<&'static str>,
}

impl Health {
    /// Healthy for `/livez` and the health-check node ports (the Node's state aside).
    pub fn healthy(&self) -> bool {
        self.problem.is_none()
    }
}

impl Shared {
    /// A health timeout of `2 * sync_period`, as kube-proxy's.
    pub fn new(sync_period: Duration) -> Self {
        Self {
            metrics: Mutex::new(Metrics::default()),
            state: Mutex::new(State {
                families: vec!["IPv4"],
                ..State::default()
            }),
            timeout: sync_period.saturating_mul(2),
            syncs: tokio::sync::watch::Sender::new(0),
            configz: std::sync::OnceLock::new(),
        }
    }

    /// Sets the `/configz` body (once; later calls change nothing).
    pub fn set_configz(&self, body: String) {
        let _ = self.configz.set(body);
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock still holds usable plain data.
        match self.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        }
    }

    /// A change arrived that a sync must apply (kube-proxy's `QueuedUpdate`): only the oldest
    /// unapplied one counts.
    pub fn queued(&self) {
        let mut s = self.state();
        if s.queued.is_none() {
            s.queued = Some(Instant::now());
        }
    }

    /// A sync finished at wall time `wall` and applied what was queued (kube-proxy's `Updated`).
    pub fn synced(&self, wall: SystemTime) {
        {
            let mut s = self.state();
            s.last_sync = Some((Instant::now(), wall));
            s.queued = None;
        }
        self.syncs.send_modify(|n| *n += 1);
    }

    /// A sync finished without applying anything it tried (every operation failed): counted
    /// as finished for [`Shared::syncs`], not for health.
    pub fn sync_failed(&self) {
        self.syncs.send_modify(|n| *n += 1);
    }

    /// Whether the Node is going away.
    pub fn set_node_draining(&self, draining: bool) {
        self.state().node_draining = draining;
    }

    /// The families proxied (IPv6 on a node with IPv6 NodePort addresses).
    pub fn set_families(&self, ipv6: bool) {
        self.state().families = if ipv6 {
            vec!["IPv4", "IPv6"]
        } else {
            vec!["IPv4"]
        };
    }

    /// Finished syncs so far, updated as they finish.
    pub fn syncs(&self) -> tokio::sync::watch::Receiver<u64> {
        self.syncs.subscribe()
    }

    /// The verdict now.
    pub fn health(&self) -> Health {
        let s = self.state();
        let now = Instant::now();
        let problem = match (s.last_sync, s.queued) {
            (_, Some(q)) if now.duration_since(q) >= self.timeout => Some(format!(
                "a change has waited {:.1}s for a sync (limit {:.1}s)",
                now.duration_since(q).as_secs_f64(),
                self.timeout.as_secs_f64()
            )),
            (Some((at, _)), _) if now.duration_since(at) > self.timeout => Some(format!(
                "no sync finished for {:.1}s (limit {:.1}s)",
                now.duration_since(at).as_secs_f64(),
                self.timeout.as_secs_f64()
            )),
            _ => None,
        };
        // Readiness only: before the first sync the node has no rules to offer, but a liveness
        // probe failing then would restart an agent that waits for an unreachable API server.
        let not_ready = match (&problem, s.last_sync) {
            (Some(p), _) => Some(p.clone()),
            (None, None) => Some("the first sync has not finished".to_owned()),
            (None, Some(_)) => None,
        };
        Health {
            problem,
            not_ready,
            last_updated: s.last_sync.map(|(_, wall)| wall),
            node_draining: s.node_draining,
            families: s.families.clone(),
        }
    }

    /// Runs `f` on the metrics (a poisoned lock still holds usable counters).
    pub fn with_metrics<T>(&self, f: impl FnOnce(&mut Metrics) -> T) -> T {
        let mut m = match self.metrics.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        f(&mut m)
    }
}

/// A wall time as Go's `encoding/json` writes a `time.Time` (RFC 3339 with as many fraction
/// digits as needed, UTC); Go's zero time for `None`.
fn go_time(t: Option<SystemTime>) -> String {
    t.and_then(|t| Timestamp::try_from(t).ok())
        .map_or_else(|| "0001-01-01T00:00:00Z".to_owned(), |t| t.to_string())
}

/// kube-proxy's `ProxyHealth` JSON, field for field and in its order: `lastUpdated` (now when
/// healthy, as kube-proxy writes it), `currentTime`, `nodeEligible` (`/healthz` only),
/// `healthy`, and `status` per family (left out before the first sync).
pub fn health_json(h: &Health, healthz: bool, now: SystemTime) -> (bool, String) {
    #[derive(serde::Serialize)]
    struct Family {
        #[serde(rename = "lastUpdated")]
        last_updated: String,
        healthy: bool,
    }
    #[derive(serde::Serialize)]
    struct Body {
        #[serde(rename = "lastUpdated")]
        last_updated: String,
        #[serde(rename = "currentTime")]
        current_time: String,
        #[serde(rename = "nodeEligible", skip_serializing_if = "Option::is_none")]
        node_eligible: Option<bool>,
        healthy: bool,
        // Go's encoding/json writes map keys sorted, as a BTreeMap does.
        #[serde(skip_serializing_if = "BTreeMap::is_empty")]
        status: BTreeMap<&'static str, Family>,
    }
    let healthy = if healthz {
        h.not_ready.is_none() && !h.node_draining
    } else {
        h.healthy()
    };
    let status = if h.last_updated.is_some() {
        h.families
            .iter()
            .map(|f| {
                let family = Family {
                    last_updated: go_time(h.last_updated),
                    healthy: h.healthy(),
                };
                (*f, family)
            })
            .collect()
    } else {
        BTreeMap::new()
    };
    let body = Body {
        last_updated: go_time(if healthy { Some(now) } else { h.last_updated }),
        current_time: go_time(Some(now)),
        node_eligible: healthz.then_some(!h.node_draining),
        healthy,
        status,
    };
    // Serialising strings and bools cannot fail.
    (healthy, serde_json::to_string(&body).unwrap_or_default())
}

/// What a server answers: the health paths always, `/metrics` on the metrics server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routes {
    /// `/healthz`, `/livez`.
    Health,
    /// `/metrics`, `/proxyMode` and `/configz`, plus the health paths (as kube-proxy's metrics server has
    /// `/healthz`).
    Metrics,
}

/// The JSON content type of the health answers.
pub const JSON: &str = "application/json";

/// The response to one request: status, content type and body. Pure apart from the state it
/// reads, for tests; `now` is the wall time the bodies report.
pub fn respond(
    shared: &Shared,
    routes: Routes,
    method: &Method,
    path: &str,
    now: SystemTime,
) -> (StatusCode, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    if method != Method::GET && method != Method::HEAD {
        return (
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "GET only\n".to_owned(),
        );
    }
    let status = |ok: bool| {
        if ok {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        }
    };
    match (routes, path) {
        (_, "/healthz" | "/livez") => {
            let health = shared.health();
            if let Some(why) = health.not_ready.as_ref().or(health.problem.as_ref()) {
                tracing::debug!("{path}: {why}");
            }
            let (ok, body) = health_json(&health, path == "/healthz", now);
            shared.with_metrics(|m| m.count_health(path == "/healthz", ok));
            (status(ok), JSON, body)
        }
        (Routes::Metrics, "/metrics") => (
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            shared.with_metrics(|m| m.render()),
        ),
        // kube-proxy's metrics server names its mode.
        (Routes::Metrics, "/proxyMode") => (StatusCode::OK, TEXT, "ipvs".to_owned()),
        (Routes::Metrics, "/configz") => match shared.configz.get() {
            Some(body) => (StatusCode::OK, JSON, body.clone()),
            None => (StatusCode::NOT_FOUND, TEXT, "not found\n".to_owned()),
        },
        _ => (StatusCode::NOT_FOUND, TEXT, "not found\n".to_owned()),
    }
}

/// Binds `addr`; an error says which setting's address could not be bound.
pub async fn bind(addr: SocketAddr, setting: &str) -> Result<TcpListener, String> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| format!("{setting} {addr}: {e}"))
}

/// Serves requests on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>, routes: Routes) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: pause instead of spinning.
                tracing::warn!("accepting an HTTP connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let (status, ctype, body) = respond(
                    &shared,
                    routes,
                    req.method(),
                    req.uri().path(),
                    SystemTime::now(),
                );
                let mut resp = Response::new(Full::new(Bytes::from(body)));
                *resp.status_mut() = status;
                let headers = resp.headers_mut();
                headers.insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static(ctype),
                );
                headers.insert(
                    hyper::header::X_CONTENT_TYPE_OPTIONS,
                    hyper::header::HeaderValue::from_static("nosniff"),
                );
                async move { Ok::<_, Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn get(s: &Shared, path: &str) -> (StatusCode, String) {
        let (status, _, body) = respond(s, Routes::Metrics, &Method::GET, path, at(1_800_000_000));
        (status, body)
    }

    #[tokio::test(start_paused = true)]
    async fn the_queued_update_rule_and_the_stricter_start_and_stall_rules() {
        let s = Shared::new(Duration::from_secs(10));
        assert_eq!(
            get(&s, "/healthz").0,
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready before the first sync"
        );
        assert_eq!(
            get(&s, "/livez").0,
            StatusCode::OK,
            "but live: an agent waiting for the API server is not restarted"
        );
        s.synced(at(1_799_999_990));
        assert_eq!(get(&s, "/healthz").0, StatusCode::OK);
        // A change waits: fine for 20 s (2 x the sync period), not at 20 s.
        s.queued();
        tokio::time::advance(Duration::from_secs(15)).await;
        s.queued();
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(
            get(&s, "/livez").0,
            StatusCode::OK,
            "19 s after the oldest change"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        let (status, body) = get(&s, "/livez");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        s.synced(at(1_800_000_000));
        assert_eq!(get(&s, "/livez").0, StatusCode::OK, "the sync applied it");
        // No change, but no sync either: a stuck loop.
        tokio::time::advance(Duration::from_secs(21)).await;
        assert_eq!(get(&s, "/healthz").0, StatusCode::SERVICE_UNAVAILABLE);
    }

    /// The bodies as `proxy_health.go` of the pinned kube-proxy writes them: `json.Marshal` of
    /// `ProxyHealth` (fields in struct order, `nodeEligible` only from `/healthz`, `status`
    /// omitted while empty, `lastUpdated` set to now when healthy).
    #[tokio::test(start_paused = true)]
    async fn bodies_are_kube_proxys_json() {
        let s = Shared::new(Duration::from_secs(30));
        assert_eq!(
            get(&s, "/healthz").1,
            r#"{"lastUpdated":"0001-01-01T00:00:00Z","currentTime":"2027-01-15T08:00:00Z","nodeEligible":true,"healthy":false}"#
        );
        assert_eq!(
            get(&s, "/livez").1,
            r#"{"lastUpdated":"2027-01-15T08:00:00Z","currentTime":"2027-01-15T08:00:00Z","healthy":true}"#
        );
        s.synced(at(1_799_999_999) + Duration::from_millis(250));
        assert_eq!(
            get(&s, "/healthz").1,
            r#"{"lastUpdated":"2027-01-15T08:00:00Z","currentTime":"2027-01-15T08:00:00Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2027-01-15T07:59:59.25Z","healthy":true}}}"#
        );
        // A node going away fails /healthz only.
        s.set_node_draining(true);
        s.set_families(true);
        let (status, body) = get(&s, "/healthz");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body,
            r#"{"lastUpdated":"2027-01-15T07:59:59.25Z","currentTime":"2027-01-15T08:00:00Z","nodeEligible":false,"healthy":false,"status":{"IPv4":{"lastUpdated":"2027-01-15T07:59:59.25Z","healthy":true},"IPv6":{"lastUpdated":"2027-01-15T07:59:59.25Z","healthy":true}}}"#
        );
        assert_eq!(get(&s, "/livez").0, StatusCode::OK);
    }

    #[test]
    fn metrics_and_proxy_mode_only_on_the_metrics_server() {
        let s = Shared::new(Duration::from_secs(10));
        let now = at(0);
        assert_eq!(
            respond(&s, Routes::Health, &Method::GET, "/metrics", now).0,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            respond(&s, Routes::Health, &Method::GET, "/proxyMode", now).0,
            StatusCode::NOT_FOUND
        );
        let (status, _, body) = respond(&s, Routes::Metrics, &Method::GET, "/metrics", now);
        assert_eq!(status, StatusCode::OK);
        assert!(
            body.contains(
                "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 0"
            )
        );
        assert_eq!(
            respond(&s, Routes::Metrics, &Method::GET, "/proxyMode", now).2,
            "ipvs"
        );
        assert_eq!(
            respond(&s, Routes::Metrics, &Method::POST, "/metrics", now).0,
            StatusCode::METHOD_NOT_ALLOWED
        );
    }
}
