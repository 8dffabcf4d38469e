//! `/healthz`, `/livez` and `/metrics` over HTTP, and the health verdict behind them.
//!
//! Health means "syncs are not stalled": healthy once the first sync has finished and as long
//! as a sync finished within twice the sync period (the loop reconciles every period, so a
//! working loop always refreshes it; a loop stuck in the kernel or waiting forever does not).
//! The clock is tokio's, so paused-time tests drive it. The server answers only these paths
//! and never shows configuration or credentials.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::metrics::Metrics;

/// What the agent shares with the HTTP servers.
#[derive(Debug)]
pub struct Shared {
    /// The counters.
    pub metrics: Mutex<Metrics>,
    /// When a sync last finished; `None` before the first.
    last_sync: Mutex<Option<Instant>>,
    /// How long without a finished sync counts as stalled.
    stall_after: Duration,
    /// How many syncs have finished, for anyone who wants to wait for the next one (tests).
    syncs: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    /// Stalled after `2 * sync_period` without a finished sync.
    pub fn new(sync_period: Duration) -> Self {
        Self {
            metrics: Mutex::new(Metrics::default()),
            last_sync: Mutex::new(None),
            stall_after: sync_period.saturating_mul(2),
            syncs: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Records that a sync finished now.
    pub fn synced(&self) {
        if let Ok(mut t) = self.last_sync.lock() {
            *t = Some(Instant::now());
        }
        self.syncs.send_modify(|n| *n += 1);
    }

    /// Finished syncs so far, updated as they finish.
    pub fn syncs(&self) -> tokio::sync::watch::Receiver<u64> {
        self.syncs.subscribe()
    }

    /// `Ok(age of the last sync)` when healthy, `Err(why)` when not.
    pub fn health(&self) -> Result<Duration, String> {
        let last = self
            .last_sync
            .lock()
            .map_err(|_| "health state poisoned".to_owned())?;
        let Some(at) = *last else {
            return Err("the first sync has not finished".to_owned());
        };
        let age = at.elapsed();
        if age > self.stall_after {
            return Err(format!(
                "no sync finished for {:.1}s (limit {:.1}s)",
                age.as_secs_f64(),
                self.stall_after.as_secs_f64()
            ));
        }
        Ok(age)
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

/// What a server answers: the health paths always, `/metrics` on the metrics server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routes {
    /// `/healthz`, `/livez`.
    Health,
    /// `/metrics`, plus the health paths (as kube-proxy's metrics server has `/healthz`).
    Metrics,
}

/// The response to one request: status, content type and body. Pure, for tests.
pub fn respond(
    shared: &Shared,
    routes: Routes,
    method: &Method,
    path: &str,
) -> (StatusCode, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    if method != Method::GET && method != Method::HEAD {
        return (
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "GET only\n".to_owned(),
        );
    }
    match (routes, path) {
        (_, "/healthz" | "/livez") => match shared.health() {
            Ok(age) => (
                StatusCode::OK,
                TEXT,
                format!("ok: last sync {:.1}s ago\n", age.as_secs_f64()),
            ),
            Err(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                format!("unhealthy: {why}\n"),
            ),
        },
        (Routes::Metrics, "/metrics") => (
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            shared.with_metrics(|m| m.render()),
        ),
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
                let (status, ctype, body) =
                    respond(&shared, routes, req.method(), req.uri().path());
                let mut resp = Response::new(Full::new(Bytes::from(body)));
                *resp.status_mut() = status;
                resp.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static(ctype),
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

    #[tokio::test(start_paused = true)]
    async fn health_fails_before_the_first_sync_and_when_syncs_stall() {
        let s = Shared::new(Duration::from_secs(10));
        let get = |p: &str| respond(&s, Routes::Health, &Method::GET, p).0;
        assert_eq!(get("/healthz"), StatusCode::SERVICE_UNAVAILABLE);
        s.synced();
        assert_eq!(get("/healthz"), StatusCode::OK);
        assert_eq!(get("/livez"), StatusCode::OK);
        tokio::time::advance(Duration::from_secs(19)).await;
        assert_eq!(get("/healthz"), StatusCode::OK);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(get("/healthz"), StatusCode::SERVICE_UNAVAILABLE);
        s.synced();
        assert_eq!(get("/healthz"), StatusCode::OK);
    }

    #[test]
    fn metrics_only_on_the_metrics_server() {
        let s = Shared::new(Duration::from_secs(10));
        assert_eq!(
            respond(&s, Routes::Health, &Method::GET, "/metrics").0,
            StatusCode::NOT_FOUND
        );
        let (status, _, body) = respond(&s, Routes::Metrics, &Method::GET, "/metrics");
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("kubeproxy_sync_proxy_rules_duration_seconds_count 0"));
        assert_eq!(
            respond(&s, Routes::Metrics, &Method::POST, "/metrics").0,
            StatusCode::METHOD_NOT_ALLOWED
        );
    }
}
