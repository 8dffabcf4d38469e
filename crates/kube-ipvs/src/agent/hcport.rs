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

/// kube-proxy's answer (`service_health.go`): 200 when the Service has a ready local endpoint
/// and the proxy is healthy (`/livez`'s verdict), else 503; the body is its JSON, byte for
/// byte (tab-indented, no final newline), and the endpoint count also goes in the
/// `X-Load-Balancing-Endpoint-Weight` header (the last value returned). A port no longer served
/// answers 503 with no Service (kube-proxy answers an empty 200 there; the port closes next).
pub fn respond(check: Option<&Check>, proxy_healthy: bool) -> (StatusCode, String, usize) {
    let Some(c) = check else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "{\"localEndpoints\":0}\n".to_owned(),
            0,
        );
    };
    // `%q` of a namespace or name: both are DNS labels, so JSON string quoting is the same.
    let quote = |s: &str| serde_json::Value::from(s).to_string();
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {}\n}}",
        quote(&c.service.namespace),
        quote(&c.service.name),
        c.local_endpoints,
        proxy_healthy
    );
    let status = if c.local_endpoints > 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body, c.local_endpoints)
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
                let (status, body, weight) = respond(
                    checks.borrow().get(&port),
                    shared.health().not_ready.is_none(),
                );
                let mut resp = Response::new(Full::new(Bytes::from(body)));
                *resp.status_mut() = status;
                let headers = resp.headers_mut();
                headers.insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/json"),
                );
                headers.insert(
                    hyper::header::X_CONTENT_TYPE_OPTIONS,
                    hyper::header::HeaderValue::from_static("nosniff"),
                );
                headers.insert(
                    "x-load-balancing-endpoint-weight",
                    hyper::header::HeaderValue::from(weight),
                );
                async move { Ok::<_, Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// The listeners of one port on `addr`. For the IPv4 wildcard both families are served, as
/// kube-proxy's per-family servers do: `[::]` (dual-stack on Linux unless
/// `net.ipv6.bindv6only` is set) and `0.0.0.0` (which a dual-stack `[::]` already covers: its
/// `EADDRINUSE` is then expected). Errors only when nothing could be bound.
async fn bind_port(addr: IpAddr, port: u16) -> std::io::Result<Vec<TcpListener>> {
    if addr != IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED) {
        return Ok(vec![TcpListener::bind((addr, port)).await?]);
    }
    let mut listeners = Vec::new();
    let v6 = TcpListener::bind((std::net::Ipv6Addr::UNSPECIFIED, port)).await;
    if let Ok(l) = v6 {
        listeners.push(l);
    }
    match TcpListener::bind((addr, port)).await {
        Ok(l) => listeners.push(l),
        Err(e) if listeners.is_empty() => return Err(e),
        Err(_) => {}
    }
    Ok(listeners)
}

/// Opens listeners on `addr` for each port in the checks (both families for the IPv4
/// wildcard, see [`bind_port`]) and closes those no longer there, until the sending side is
/// dropped. A port that cannot be bound is logged, reported once with kube-proxy's
/// `FailedToStartServiceHealthcheck` Event (when `events` is given), and tried again at the
/// next change.
pub async fn serve_all(
    mut checks: watch::Receiver<Checks>,
    addr: IpAddr,
    shared: Arc<Shared>,
    events: Option<super::events::Recorder>,
) {
    let mut running: HashMap<u16, Vec<tokio::task::JoinHandle<()>>> = HashMap::new();
    // Failures already reported, by port and Service, so a retry does not repeat the Event.
    let mut reported: std::collections::HashSet<(u16, ServiceName)> = Default::default();
    loop {
        let ports: Vec<u16> = checks.borrow_and_update().keys().copied().collect();
        running.retain(|port, tasks| {
            let keep = ports.contains(port);
            if !keep {
                tasks.iter().for_each(tokio::task::JoinHandle::abort);
            }
            keep
        });
        reported.retain(|(port, _)| ports.contains(port));
        for port in ports {
            if running.contains_key(&port) {
                continue;
            }
            match bind_port(addr, port).await {
                Ok(listeners) => {
                    reported.retain(|(p, _)| *p != port);
                    let tasks = listeners
                        .into_iter()
                        .map(|l| tokio::spawn(serve_port(l, port, checks.clone(), shared.clone())))
                        .collect();
                    running.insert(port, tasks);
                }
                Err(e) => {
                    tracing::warn!("healthCheckNodePort {addr}:{port}: {e}");
                    let service = checks.borrow().get(&port).map(|c| c.service.clone());
                    if let (Some(rec), Some(svc)) = (&events, service)
                        && reported.insert((port, svc.clone()))
                    {
                        let note = format!(
                            "node {} failed to start healthcheck \"{svc}\" on port {port}: {e}",
                            rec.node()
                        );
                        rec.emit(
                            super::events::service_ref(&svc.namespace, &svc.name),
                            super::events::Kind::Warning,
                            "FailedToStartServiceHealthcheck",
                            "Listen",
                            &note,
                        );
                    }
                }
            }
        }
        if checks.changed().await.is_err() {
            running
                .values()
                .flatten()
                .for_each(tokio::task::JoinHandle::abort);
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
        // kube-proxy's body: its Go template after dedent, trimmed of newlines.
        let (status, body, weight) = respond(Some(&check), true);
        assert_eq!((status, weight), (StatusCode::OK, 1));
        assert_eq!(
            body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"default\",\n\t\t\"name\": \"lb\"\n\t},\n\t\"localEndpoints\": 1,\n\t\"serviceProxyHealthy\": true\n}"
        );
        // An unhealthy proxy fails the check even with a local endpoint.
        let (status, body, _) = respond(Some(&check), false);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body.ends_with("\"serviceProxyHealthy\": false\n}"),
            "{body}"
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
        shared.synced(std::time::SystemTime::now());
        let server = tokio::spawn(serve_all(
            rx,
            "127.0.0.1".parse().expect("literal"),
            shared,
            None,
        ));
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
        assert!(first.contains("\"localEndpoints\": 2"), "{first}");
        assert!(
            first
                .to_ascii_lowercase()
                .contains("x-load-balancing-endpoint-weight: 2"),
            "{first}"
        );
        tx.send_replace([(port, check(0))].into_iter().collect());
        let second = get(port).await.expect("still listening");
        assert!(second.starts_with("HTTP/1.0 503"), "{second}");
        drop(tx);
        server.await.expect("serve_all ends with its sender");
    }
}
