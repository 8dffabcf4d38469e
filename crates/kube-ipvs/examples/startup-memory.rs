//! `startup-memory`: the agent's startup at N Services x E endpoints against the in-memory
//! kernel, on the host, for a heap profiler (`heaptrack`, `valgrind --tool=massif`): where the
//! startup's peak memory goes without a VM, an API server or a kernel.
//!
//! The objects are built as the API server would hand them to the watch (Services and
//! EndpointSlices through the tracker, one initial change set), then the sync loop runs its
//! startup sync and its masquerade sync, and stops before its first reconcile. The agent logs
//! its resident and peak memory at each step, as in a real run.
//!
//!     cargo build --release -p kube-ipvs --example startup-memory
//!     heaptrack target/release/examples/startup-memory 10000 10
//!
//! With a third argument R, the agent also has the service sets and a background reader, and
//! runs R reconciles 2 s apart before it stops; each logs how long its diff and its masquerade
//! sync took on the loop (for `perf record --call-graph dwarf`):
//!
//!     target/release/examples/startup-memory 10000 10 3
//!
//! The in-memory kernel keeps its own copy of the table, so the process's totals are above the
//! agent's; the profiler's per-call-site figures are what to read.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_ipvs::agent::health::Shared;
use kube_ipvs::agent::masq::{DetectLocal, Fixed, Masq};
use kube_ipvs::agent::sync::{Agent, AgentConfig};
use kube_ipvs::kernel::mem::MemKernel;
use kube_ipvs_diff::{Inputs, NodeContext};
use kube_ipvs_watch::{Tracker, TranslateOptions};

fn service(i: usize) -> Service {
    let ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("svc-{i}"), "namespace": "bench", "resourceVersion": "1"},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    }))
    .expect("a valid Service")
}

fn slice(i: usize, per: usize) -> EndpointSlice {
    let endpoints: Vec<serde_json::Value> = (0..per)
        .map(|j| {
            let n = i * per + j;
            serde_json::json!({
                "addresses": [format!("10.{}.{}.{}", 128 + n / 65536, (n / 256) % 256, n % 256)],
                "conditions": {"ready": true},
                "nodeName": format!("node-{}", n % 100 + 1),
            })
        })
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": format!("svc-{i}-abcde"),
            "namespace": "bench",
            "resourceVersion": "1",
            "labels": {"kubernetes.io/service-name": format!("svc-{i}")},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }))
    .expect("a valid EndpointSlice")
}

fn node() -> Node {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "node-1", "resourceVersion": "1"},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.56.10"}]},
    }))
    .expect("a valid Node")
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut number = |default: usize| {
        args.next().map_or(default, |a| {
            a.parse()
                .expect("usage: startup-memory [SERVICES [ENDPOINTS [RECONCILES]]]")
        })
    };
    let (services, per, reconciles) = (number(10_000), number(10), number(0));
    tracing_subscriber::fmt().with_target(false).init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async move {
        let mut tracker = Tracker::new(TranslateOptions::default());
        tracker.relist_services(&(0..services).map(service).collect::<Vec<_>>());
        tracker.relist_slices(&(0..services).map(|i| slice(i, per)).collect::<Vec<_>>());
        tracker.apply_node(&node());
        let cs = tracker.take_change_set().expect("an initial change set");

        let kernel = MemKernel::default();
        kernel.state().node_addresses = vec!["192.168.56.10".parse().expect("literal")];
        let period = Duration::from_secs(if reconciles > 0 { 2 } else { 3600 });
        let shared = Arc::new(Shared::new(period));
        let cfg = AgentConfig::every(period);
        let mut masq = Masq::new(Fixed {
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            node_pod_cidrs: Vec::new(),
            backend: kube_ipvs_host::masquerade::Backend::Legacy,
            detect_local: DetectLocal::ClusterCidr,
            mark_bit: 14,
            random_fully: true,
            local_marks: Some(0x3ff0_0000),
        });
        if reconciles > 0 {
            masq = masq.with_service_sets(&mut kernel.clone());
        }
        let mut agent = Agent::new(
            kernel.clone(),
            Inputs::new(NodeContext::new("node-1")).expect("a valid node"),
            cfg,
            shared.clone(),
        )
        .with_masquerade(masq);
        if reconciles > 0 {
            agent = agent
                .with_background_reads(Box::new(kernel.clone()))
                .expect("a reader thread");
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            agent
                .run(rx, async {
                    let _ = stopped.await;
                })
                .await
        });
        tx.send(cs).await.expect("the agent takes the change set");
        shared
            .syncs()
            .wait_for(|n| *n > reconciles as u64)
            .await
            .expect("the agent is running");
        let _ = stop.send(());
        task.await
            .expect("the agent's task")
            .expect("the agent stops cleanly");
        drop(tracker);
    });
}
