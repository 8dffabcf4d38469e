//! The CPU cost of decoding one list page of Services and of EndpointSlices, shaped as a real
//! cluster's API server sends them (compact JSON; the EndpointSlice controller's slices with
//! ten endpoints each, their `targetRef`, conditions and zone, and each object's
//! `managedFields`), with k8s-openapi's decode and with the agent's lean decode
//! (`kube_ipvs_watch::lean`). The startup's listing at 50,000 Services runs this decode 200
//! times, under emulation in the bench's guest.
//!
//! Run with `cargo bench -p kube-ipvs-watch --bench decode` (`cargo xtask bench watch` runs it
//! with the watch bench). Environment: `DECODE_BENCH_ROUNDS` (default 200 per kind).

#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    reason = "a benchmark: its inputs are our own and it reports on stdout"
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::core::ObjectList;
use kube_ipvs_watch::lean::{LeanService, LeanSlice};
use serde::de::DeserializeOwned;
use serde_json::json;

const PAGE: usize = 500;
const ENDPOINTS: usize = 10;

fn ip(i: usize, a: u8, b: u8) -> String {
    format!(
        "{a}.{}.{}.{}",
        b as usize + i / 65536,
        (i / 256) % 256,
        i % 256
    )
}

fn uid(i: usize) -> String {
    format!("5f3c{i:04x}-8d2e-4b7a-9c1f-0e6a{i:08x}")
}

fn managed_fields(manager: &str, fields: serde_json::Value) -> serde_json::Value {
    json!([{
        "manager": manager, "operation": "Update", "apiVersion": "v1",
        "time": "2026-12-05T13:07:41Z", "fieldsType": "FieldsV1", "fieldsV1": fields,
    }])
}

fn service(i: usize) -> serde_json::Value {
    json!({
        "metadata": {
            "name": format!("web-{i}"), "namespace": "shop", "uid": uid(i),
            "resourceVersion": format!("{}", 100_000 + i), "creationTimestamp": "2026-12-05T13:07:41Z",
            "labels": {"app": format!("web-{i}")},
            "managedFields": managed_fields("kubectl-client-side-apply", json!({
                "f:metadata": {"f:labels": {".": {}, "f:app": {}}},
                "f:spec": {"f:internalTrafficPolicy": {}, "f:ports": {".": {},
                    "k:{\"port\":80,\"protocol\":\"TCP\"}": {".": {}, "f:name": {}, "f:port": {},
                    "f:protocol": {}, "f:targetPort": {}}}, "f:selector": {}, "f:sessionAffinity": {},
                    "f:type": {}},
            })),
        },
        "spec": {
            "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}],
            "selector": {"app": format!("web-{i}")},
            "clusterIP": ip(i, 10, 96), "clusterIPs": [ip(i, 10, 96)], "type": "ClusterIP",
            "sessionAffinity": "None", "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
            "internalTrafficPolicy": "Cluster",
        },
        "status": {"loadBalancer": {}},
    })
}

fn slice(i: usize) -> serde_json::Value {
    let endpoints: Vec<serde_json::Value> = (0..ENDPOINTS)
        .map(|e| {
            let n = i * ENDPOINTS + e;
            json!({
                "addresses": [ip(n, 10, 128)],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": format!("node-{}", n % 100),
                "targetRef": {"kind": "Pod", "namespace": "shop",
                    "name": format!("web-{i}-7d4b9c8f6-{e:05}"), "uid": uid(n)},
                "zone": format!("zone-{}", n % 3),
            })
        })
        .collect();
    json!({
        "metadata": {
            "name": format!("web-{i}-x7k2p"), "generateName": format!("web-{i}-"), "namespace": "shop",
            "uid": uid(i), "resourceVersion": format!("{}", 200_000 + i), "generation": 3,
            "creationTimestamp": "2026-12-05T13:07:41Z",
            "labels": {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": format!("web-{i}")},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-05T13:07:40Z"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": format!("web-{i}"),
                "uid": uid(i), "controller": true, "blockOwnerDeletion": true}],
            "managedFields": managed_fields("kube-controller-manager", json!({
                "f:addressType": {}, "f:endpoints": {}, "f:metadata": {"f:annotations": {".": {},
                    "f:endpoints.kubernetes.io/last-change-trigger-time": {}}, "f:generateName": {},
                    "f:labels": {".": {}, "f:endpointslice.kubernetes.io/managed-by": {},
                    "f:kubernetes.io/service-name": {}}, "f:ownerReferences": {".": {},
                    "k:{\"uid\":\"5f3c\"}": {}}}, "f:ports": {},
            })),
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
    })
}

fn page(kind: &str, api_version: &str, items: Vec<serde_json::Value>) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "kind": kind, "apiVersion": api_version,
        "metadata": {"resourceVersion": "300000", "continue": "eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ"},
        "items": items,
    }))
    .unwrap()
}

/// The median of `rounds` decodes of `bytes` as a list of `K`.
fn time<K: DeserializeOwned + Clone>(bytes: &[u8], rounds: usize) -> Duration {
    let mut samples: Vec<Duration> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            let list: ObjectList<K> = serde_json::from_slice(bytes).unwrap();
            let d = t.elapsed();
            assert_eq!(black_box(list).items.len(), PAGE);
            d
        })
        .collect();
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let rounds = std::env::var("DECODE_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let services = page("ServiceList", "v1", (0..PAGE).map(service).collect());
    let slices = page(
        "EndpointSliceList",
        "discovery.k8s.io/v1",
        (0..PAGE).map(slice).collect(),
    );
    println!(
        "one page of {PAGE} objects, each decode the median batch's median ({rounds} decodes in 5 batches, alternated):"
    );
    for (what, bytes, full, lean) in [
        (
            "Services",
            &services,
            time::<Service> as fn(&[u8], usize) -> Duration,
            time::<LeanService> as fn(&[u8], usize) -> Duration,
        ),
        (
            "EndpointSlices",
            &slices,
            time::<EndpointSlice>,
            time::<LeanSlice>,
        ),
    ] {
        // Alternate the two in batches, so drift on the host falls on both.
        let per = (rounds / 5).max(1);
        let (mut f, mut l) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            f.push(full(bytes, per));
            l.push(lean(bytes, per));
        }
        f.sort();
        l.sort();
        let (f, l) = (f[2], l[2]);
        println!(
            "{what:<15} {:>9} bytes  k8s-openapi {:>8.2?}  lean {:>8.2?}  lean/k8s-openapi {:.2}",
            bytes.len(),
            f,
            l,
            l.as_secs_f64() / f.as_secs_f64()
        );
    }
}
