//! Builders shared by the integration tests.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "shared by several test targets, each using a part"
)]

use std::net::IpAddr;

use kube_ipvs_diff::{
    Endpoint, EndpointPort, NodeContext, Protocol, ServiceInfo, ServiceName, ServicePort,
};

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("test literal")
}

pub fn name(n: &str) -> ServiceName {
    ServiceName::new("default", n)
}

pub fn node() -> NodeContext {
    let mut n = NodeContext::new("node-a");
    n.zone = Some("zone-a".into());
    n.node_ips_v4 = vec!["192.168.0.10".parse().expect("test literal")];
    n.node_ips_v6 = vec!["fd00:1::10".parse().expect("test literal")];
    n
}

/// A ClusterIP Service with one TCP port `http` 80.
pub fn svc(cluster_ip: &str) -> ServiceInfo {
    ServiceInfo {
        cluster_ips: vec![ip(cluster_ip)],
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 80,
            node_port: None,
        }],
        ..ServiceInfo::default()
    }
}

/// A ready endpoint serving `http` on 8080.
pub fn ep(addr: &str) -> Endpoint {
    Endpoint::ready(
        ip(addr),
        vec![EndpointPort {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Tcp,
        }],
    )
}

pub fn on_node(mut e: Endpoint, node: &str) -> Endpoint {
    e.node_name = Some(node.into());
    e
}

pub fn terminating(mut e: Endpoint, serving: bool) -> Endpoint {
    e.ready = false;
    e.serving = serving;
    e.terminating = true;
    e
}
