//! Latency from a watch event on the test API server to the change set handed out, with
//! 10,000 Services (and one EndpointSlice each) in the cluster. Measured through the real
//! kube-rs client over HTTP: server encode, chunked watch stream, kube-rs decode, the driver,
//! translation, slice merge and change-set computation.
//!
//! Run with `cargo bench -p kube-ipvs-watch` (or `cargo xtask bench watch`). Environment:
//! `WATCH_BENCH_SERVICES` (default 10000) and `WATCH_BENCH_SAMPLES` (default 1000 per kind).

#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    reason = "a benchmark: its inputs are our own and it reports on stdout"
)]

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube_ipvs_diff::ServiceName;
use kube_ipvs_integration::TestApiServer;
use kube_ipvs_watch::cluster::{self, ClusterWatch};
use kube_ipvs_watch::{ChangeSet, WatchConfig};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ip(i: usize, base: [u8; 2]) -> String {
    format!(
        "{}.{}.{}.{}",
        base[0],
        base[1] + (i / 65536) as u8,
        (i / 256) % 256,
        i % 256
    )
}

fn service(i: usize, port: i32) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(format!("svc-{i}")),
            namespace: Some("bench".into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(ip(i, [10, 96])),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port,
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

fn slice(i: usize, ready: bool) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("svc-{i}-abcde")),
            namespace: Some("bench".into()),
            labels: Some([("kubernetes.io/service-name".to_owned(), format!("svc-{i}"))].into()),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        endpoints: (0..3)
            .map(|k| Endpoint {
                addresses: vec![ip(i * 3 + k, [10, 128])],
                conditions: Some(EndpointConditions {
                    ready: Some(ready || k > 0),
                    serving: Some(ready || k > 0),
                    terminating: Some(false),
                }),
                node_name: Some(format!("node-{k}")),
                zone: Some(format!("zone-{k}")),
                ..Endpoint::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            ..EndpointPort::default()
        }]),
    }
}

async fn wait_for(w: &mut ClusterWatch, name: &ServiceName) -> ChangeSet {
    loop {
        let cs = tokio::time::timeout(Duration::from_secs(60), w.changes.recv())
            .await
            .expect("a change set within 60s")
            .expect("stream open");
        if cs.services.contains_key(name) {
            return cs;
        }
    }
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let pct = |p: f64| samples[((samples.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "{what:<28} n={:<5} p50={:>9.1?} p90={:>9.1?} p99={:>9.1?} max={:>9.1?}",
        samples.len(),
        pct(0.50),
        pct(0.90),
        pct(0.99),
        samples[samples.len() - 1]
    );
}

fn main() {
    let n = env("WATCH_BENCH_SERVICES", 10_000);
    let samples = env("WATCH_BENCH_SAMPLES", 1_000).min(n);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let (server, url) = TestApiServer::start().await.unwrap();
        for i in 0..n {
            server.create(&service(i, 80)).unwrap();
            server.create(&slice(i, true)).unwrap();
        }
        let mut config = kube::Config::new(url.parse().unwrap());
        config.default_retry = false;
        let client = kube::Client::try_from(config).unwrap();
        let t0 = Instant::now();
        let mut w = cluster::spawn(
            client,
            WatchConfig {
                // The pipeline's own latency; a deployment adds its --min-sync-period on top.
                min_interval: Duration::ZERO,
                ..WatchConfig::default()
            },
        );
        let first = w.changes.recv().await.unwrap();
        let initial = t0.elapsed();
        assert_eq!(first.services.len(), n);
        println!(
            "watch bench: {n} Services + {n} EndpointSlices (3 endpoints each), min interval 0"
        );
        println!("initial list to first change set: {initial:.1?}");

        let mut svc_lat = Vec::with_capacity(samples);
        for k in 0..samples {
            let i = (k * 7919) % n;
            let name = ServiceName::new("bench", format!("svc-{i}"));
            let t = Instant::now();
            server.update(&service(i, 81 + (k % 1000) as i32)).unwrap();
            wait_for(&mut w, &name).await;
            svc_lat.push(t.elapsed());
        }
        report("Service update -> change set", svc_lat);

        let mut ep_lat = Vec::with_capacity(samples);
        for k in 0..samples {
            let i = (k * 7919) % n;
            let name = ServiceName::new("bench", format!("svc-{i}"));
            let t = Instant::now();
            // Each slice is updated once (7919 is prime to n): one endpoint turns not ready.
            server.update(&slice(i, false)).unwrap();
            wait_for(&mut w, &name).await;
            ep_lat.push(t.elapsed());
        }
        report("Slice update -> change set", ep_lat);
    });
}
