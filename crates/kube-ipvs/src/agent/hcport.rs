//! Health-check servers on each `healthCheckNodePort`, as kube-proxy runs them: for a Service
//! with `externalTrafficPolicy: Local`, the cloud load balancer asks every node on that port and
//! sends traffic only to nodes answering 200, which are those with a ready local endpoint.
//!
//! [`Checks`] is worked out from the engine's inputs for the Services a change set touched (so
//! it costs what the change costs) and published on a watch channel; [`serve_all`] opens and
//! closes one listener per port to match. The answer is kube-proxy's JSON. This module never
//! touches IPVS.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kube_ipvs_diff::{Endpoint, Inputs, ServiceInfo, ServiceName, TrafficPolicy};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::health::Shared;

/// What one health-check port reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The Service.
    pub service: ServiceName,
    /// Its ready endpoints on this node.
    pub local_endpoints: usize,
}

/// Every health-check port this node serves.
pub type Checks = BTreeMap<u16, Check>;

/// The port and check of a Service, if it has a health-check node port under the Local policy.
pub fn check_for(
    name: &ServiceName,
    info: Option<&ServiceInfo>,
    endpoints: &[Endpoint],
    node: &str,
) -> Option<(u16, Check)> {
    let info = info?;
    if info.external_traffic_policy != TrafficPolicy::Local {
        return None;
    }
    let port = info.health_check_node_port?;
    let local_endpoints = endpoints
        .iter()
        .filter(|e| e.ready && e.node_name.as_deref() == Some(node))
        .count();
    Some((
        port,
        Check {
            service: name.clone(),
            local_endpoints,
        },
    ))
}

/// Keeps [`Checks`] up to date with the inputs and publishes it.
#[derive(Debug)]
pub struct HealthChecks {
    by_service: BTreeMap<ServiceName, u16>,
    checks: Checks,
    tx: watch::Sender<Checks>,
}

impl HealthChecks {
    /// No checks yet, and the receiver [`serve_all`] follows.
    pub fn new() -> (Self, watch::Receiver<Checks>) {
        let (tx, rx) = watch::channel(Checks::new());
        let hc = Self {
            by_service: BTreeMap::new(),
            checks: Checks::new(),
            tx,
        };
        (hc, rx)
    }

    /// Recomputes the checks of these Services and publishes the result if it changed.
    pub fn update<'a>(
        &mut self,
        names: impl IntoIterator<Item = &'a ServiceName>,
        inputs: &Inputs,
    ) {
        let node = inputs.node().node_name.as_str();
        for name in names {
            if let Some(old) = self.by_service.remove(name)
                && self.checks.get(&old).is_some_and(|c| &c.service == name)
            {
                self.checks.remove(&old);
            }
            let Some((port, check)) =
                check_for(name, inputs.service(name), inputs.endpoints(name), node)
            else {
                continue;
            };
            // The API server allocates each port once; should two Services claim one anyway,
            // the first keeps it.
            if self.checks.get(&port).is_some_and(|c| &c.service != name) {
                tracing::warn!(
                    "{name}: healthCheckNodePort {port} is already served for another Service"
                );
                continue;
            }
            self.by_service.insert(name.clone(), port);
            self.checks.insert(port, check);
        }
        let next = &self.checks;
        self.tx.send_if_modified(|cur| {
            let changed = cur != next;
            if changed {
                cur.clone_from(next);
            }
            changed
        });
    }
}

/// kube-proxy's answer: 200 with a ready local endpoint, 503 without (or for a port no longer
/// served), with the Service and the count as JSON.
pub fn respond(check: Option<&Check>, proxy_healthy: bool) -> (StatusCode, String) {
    let Some(c) = check else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "{\"localEndpoints\":0}\n".to_owned(),
        );
    };
    let body = serde_json::json!({
        "service": {"namespace": c.service.namespace, "name": c.service.name},
        "localEndpoints": c.local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    });
    let status = if c.local_endpoints > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, format!("{body}\n"))
}

async fn serve_port(
    listener: TcpListener,
    port: u16,
    checks: watch::Receiver<Checks>,
    shared: Arc<Shared>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let checks = checks.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |_: Request<hyper::body::Incoming>| {
                let (status, body) = respond(checks.borrow().get(&port), shared.health().is_ok());
                let mut resp = Response::new(Full::new(Bytes::from(body)));
                *resp.status_mut() = status;
                resp.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/json"),
                );
                async move { Ok::<_, Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Opens a listener on `addr` for each port in the checks and closes those no longer there,
/// until the sending side is dropped. A port that cannot be bound is logged and tried again at
/// the next change.
pub async fn serve_all(mut checks: watch::Receiver<Checks>, addr: IpAddr, shared: Arc<Shared>) {
    let mut running: HashMap<u16, tokio::task::JoinHandle<()>> = HashMap::new();
    loop {
        let ports: Vec<u16> = checks.borrow_and_update().keys().copied().collect();
        running.retain(|port, task| {
            let keep = ports.contains(port);
            if !keep {
                task.abort();
            }
            keep
        });
        for port in ports {
            if running.contains_key(&port) {
                continue;
            }
            match TcpListener::bind((addr, port)).await {
                Ok(l) => {
                    let task = tokio::spawn(serve_port(l, port, checks.clone(), shared.clone()));
                    running.insert(port, task);
                }
                Err(e) => tracing::warn!("healthCheckNodePort {addr}:{port}: {e}"),
            }
        }
        if checks.changed().await.is_err() {
            for task in running.values() {
                task.abort();
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    fn info(policy: TrafficPolicy, port: Option<u16>) -> ServiceInfo {
        ServiceInfo {
            external_traffic_policy: policy,
            health_check_node_port: port,
            ..ServiceInfo::default()
        }
    }

    fn endpoint(node: &str, ready: bool) -> Endpoint {
        Endpoint {
            ready,
            serving: ready,
            node_name: Some(node.into()),
            ..Endpoint::ready("10.244.1.5".parse().expect("literal"), Vec::new())
        }
    }

    #[test]
    fn only_local_policy_services_with_a_port_are_checked_and_only_ready_local_endpoints_count() {
        let name = ServiceName::new("default", "lb");
        let eps = [
            endpoint("node-1", true),
            endpoint("node-1", false),
            endpoint("node-2", true),
        ];
        let local = info(TrafficPolicy::Local, Some(32000));
        let (port, check) = check_for(&name, Some(&local), &eps, "node-1").expect("checked");
        assert_eq!((port, check.local_endpoints), (32000, 1));
        assert!(
            check_for(
                &name,
                Some(&info(TrafficPolicy::Cluster, Some(32000))),
                &eps,
                "node-1"
            )
            .is_none()
        );
        assert!(
            check_for(
                &name,
                Some(&info(TrafficPolicy::Local, None)),
                &eps,
                "node-1"
            )
            .is_none()
        );
        assert!(check_for(&name, None, &eps, "node-1").is_none());
        let (status, body) = respond(Some(&check), true);
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            body,
            "{\"localEndpoints\":1,\"service\":{\"name\":\"lb\",\"namespace\":\"default\"},\"serviceProxyHealthy\":true}\n"
        );
        let none = Check {
            local_endpoints: 0,
            ..check
        };
        assert_eq!(
            respond(Some(&none), true).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    async fn get(port: u16) -> Option<String> {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        Some(out)
    }

    #[tokio::test]
    async fn listeners_follow_the_checks() {
        // A port the OS just handed out is free.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let (tx, rx) = watch::channel(Checks::new());
        let shared = Arc::new(Shared::new(Duration::from_secs(30)));
        let server = tokio::spawn(serve_all(rx, "127.0.0.1".parse().expect("literal"), shared));
        let check = |n| Check {
            service: ServiceName::new("default", "lb"),
            local_endpoints: n,
        };
        tx.send_replace([(port, check(2))].into_iter().collect());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let first = loop {
            if let Some(r) = get(port).await {
                break r;
            }
            assert!(tokio::time::Instant::now() < deadline, "never listened");
            tokio::task::yield_now().await;
        };
        assert!(first.starts_with("HTTP/1.0 200"), "{first}");
        assert!(first.contains("\"localEndpoints\":2"), "{first}");
        tx.send_replace([(port, check(0))].into_iter().collect());
        let second = get(port).await.expect("still listening");
        assert!(second.starts_with("HTTP/1.0 503"), "{second}");
        drop(tx);
        server.await.expect("serve_all ends with its sender");
    }
}
