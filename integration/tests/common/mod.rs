//! Shared builders for the API-server tests: realistic Service, EndpointSlice and Node objects,
//! a kube client for a test server, and a receive helper with a failure deadline.

#![allow(
    dead_code,
    unreachable_pub,
    reason = "shared by several test targets, each using a part"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Node, NodeAddress, NodeStatus, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube_ipvs_watch::ChangeSet;
use tokio::sync::mpsc;

pub fn meta(ns: &str, name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: (!ns.is_empty()).then(|| ns.into()),
        labels: (!labels.is_empty()).then(|| {
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>()
        }),
        ..ObjectMeta::default()
    }
}

pub fn service(ns: &str, name: &str, ip: &str, port: i32) -> Service {
    Service {
        metadata: meta(ns, name, &[]),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some(ip.into()),
            cluster_ips: Some(vec![ip.into()]),
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

pub fn slice(ns: &str, name: &str, service: &str, addrs: &[(&str, bool)]) -> EndpointSlice {
    EndpointSlice {
        metadata: meta(
            ns,
            name,
            &[
                ("kubernetes.io/service-name", service),
                (
                    "endpointslice.kubernetes.io/managed-by",
                    "endpointslice-controller.k8s.io",
                ),
            ],
        ),
        address_type: "IPv4".into(),
        endpoints: addrs
            .iter()
            .map(|(a, ready)| Endpoint {
                addresses: vec![(*a).into()],
                conditions: Some(EndpointConditions {
                    ready: Some(*ready),
                    serving: Some(*ready),
                    terminating: Some(false),
                }),
                node_name: Some("node-a".into()),
                zone: Some("zone-a".into()),
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

pub fn node(name: &str, zone: &str, ip: &str) -> Node {
    Node {
        metadata: meta("", name, &[("topology.kubernetes.io/zone", zone)]),
        spec: None,
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                address: ip.into(),
                type_: "InternalIP".into(),
            }]),
            ..NodeStatus::default()
        }),
    }
}

/// A kube client for the test server. The client's own retry of 503s (15 attempts with
/// exponential delays) is turned off so outage tests see each failure at once; the watch
/// crate's backoff is what is under test.
pub fn client(url: &str) -> kube::Client {
    let uri = url.parse().expect("the test server URL is a valid URI");
    let mut config = kube::Config::new(uri);
    config.default_retry = false;
    kube::Client::try_from(config).expect("a client for the test server")
}

/// Waits for the next change set; the deadline only turns a hang into a failure.
pub async fn next(rx: &mut mpsc::Receiver<ChangeSet>) -> ChangeSet {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("a change set within 30s")
        .expect("the change stream is open")
}
