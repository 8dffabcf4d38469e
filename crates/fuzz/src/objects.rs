//! The `objects` target: arbitrary Services, EndpointSlices and a Node, built from the input's
//! bytes out of values the API server can hand the agent (valid ones, and malformed ones a
//! hand-written manifest or a buggy controller can carry), through two rounds of changes.
//!
//! What must hold, beside [`Agent::sync`]'s invariants: after the second round and the
//! expiry of every draining real server, the agent that synced after each round holds the same
//! kernel table as a fresh agent told both rounds and synced once (the engine's incremental
//! path and its from-scratch path agree), unless two Services contest a virtual server, which
//! stays with the first to hold it.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use arbitrary::{Result, Unstructured};
use k8s_openapi::api::core::v1::{
    ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Node, NodeAddress, NodeSpec,
    NodeStatus, Service, ServicePort, ServiceSpec, ServiceStatus, SessionAffinityConfig, Taint,
};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode, ForZone,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use kube_ipvs_diff::{Table, VirtualKey};

use crate::pipeline::{Agent, NODE};

const NAMES: &[&str] = &["a", "b", "c", "kubernetes", ""];
const NAMESPACES: &[&str] = &["default", "kube-system"];
const IPS: &[&str] = &[
    "10.96.0.1",
    "10.96.0.2",
    "10.244.1.2",
    "10.244.1.3",
    "192.168.56.10",
    "192.168.56.11",
    "fd00:96::1",
    "fd00:244::2",
    "fd00::10",
    "fe80::1",
    "127.0.0.1",
    "::1",
    "169.254.1.1",
    "0.0.0.0",
    "::",
    "224.0.0.1",
    "255.255.255.255",
    "::ffff:10.244.1.2",
    "10.96.0.1 ",
    "010.096.000.001",
    "1.2.3",
    "None",
    "",
];
const CIDRS: &[&str] = &[
    "10.0.0.0/8",
    "0.0.0.0/0",
    "192.168.56.0/24",
    "fd00::/8",
    "::/0",
    "10.0.0.1/33",
    "10.0.0.1",
    "bad",
];
const PORTS: &[i32] = &[
    0,
    1,
    53,
    80,
    443,
    8080,
    30080,
    32767,
    65535,
    65536,
    -1,
    i32::MAX,
];
const PROTOCOLS: &[&str] = &["TCP", "UDP", "SCTP", "tcp", "ICMP", ""];
const SERVICE_TYPES: &[&str] = &[
    "ClusterIP",
    "NodePort",
    "LoadBalancer",
    "ExternalName",
    "Bogus",
];
const AFFINITIES: &[&str] = &["None", "ClientIP", "Sticky"];
const POLICIES: &[&str] = &["Cluster", "Local", "Bogus"];
const DISTRIBUTIONS: &[&str] = &[
    "PreferClose",
    "PreferSameZone",
    "PreferSameNode",
    "Elsewhere",
];
const SCHEDULERS: &[&str] = &[
    "rr",
    "lc",
    "sh",
    "sh,fallback",
    "mh,port",
    "wrr",
    "nope",
    "",
];
const ADDRESS_TYPES: &[&str] = &["IPv4", "IPv6", "FQDN", "ipv4", ""];
const NODES: &[&str] = &[NODE, "node-b", ""];
const ZONES: &[&str] = &["zone-a", "zone-b", ""];

/// A string from `pool`, or now and then whatever the bytes spell.
fn text(u: &mut Unstructured<'_>, pool: &[&str]) -> Result<String> {
    if u.ratio(1, 16)? {
        return u.arbitrary();
    }
    Ok((*u.choose(pool)?).to_owned())
}

fn maybe<T>(
    u: &mut Unstructured<'_>,
    f: impl FnOnce(&mut Unstructured<'_>) -> Result<T>,
) -> Result<Option<T>> {
    if u.arbitrary()? {
        f(u).map(Some)
    } else {
        Ok(None)
    }
}

fn list<T>(
    u: &mut Unstructured<'_>,
    max: u32,
    mut f: impl FnMut(&mut Unstructured<'_>) -> Result<T>,
) -> Result<Vec<T>> {
    let n = u.int_in_range(0..=max)?;
    (0..n).map(|_| f(u)).collect()
}

fn port(u: &mut Unstructured<'_>) -> Result<i32> {
    if u.ratio(1, 8)? {
        return u.arbitrary();
    }
    Ok(*u.choose(PORTS)?)
}

fn ip(u: &mut Unstructured<'_>) -> Result<String> {
    text(u, IPS)
}

fn meta(
    u: &mut Unstructured<'_>,
    name: String,
    labels: BTreeMap<String, String>,
) -> Result<ObjectMeta> {
    Ok(ObjectMeta {
        name: Some(name),
        namespace: Some(text(u, NAMESPACES)?),
        labels: (!labels.is_empty()).then_some(labels),
        ..ObjectMeta::default()
    })
}

fn service(u: &mut Unstructured<'_>) -> Result<Service> {
    let name = text(u, NAMES)?;
    let mut labels = BTreeMap::new();
    if u.ratio(1, 8)? {
        labels.insert(
            kube_ipvs_watch::translate::SERVICE_PROXY_NAME_LABEL.to_owned(),
            text(u, &["kube-ipvs", "other"])?,
        );
    }
    let mut metadata = meta(u, name, labels)?;
    if u.ratio(1, 4)? {
        metadata.annotations = Some(BTreeMap::from([(
            kube_ipvs_diff::model::SCHEDULER_ANNOTATION.to_owned(),
            text(u, SCHEDULERS)?,
        )]));
    }
    // Now and then a Service with very many ports, as a generated manifest can have.
    let max_ports = if u.ratio(1, 32)? { 300 } else { 4 };
    let ports = list(u, max_ports, |u| {
        Ok(ServicePort {
            name: maybe(u, |u| text(u, &["http", "dns", "", "HTTP"]))?,
            port: port(u)?,
            protocol: maybe(u, |u| text(u, PROTOCOLS))?,
            target_port: maybe(u, |u| {
                Ok(if u.arbitrary()? {
                    IntOrString::Int(port(u)?)
                } else {
                    IntOrString::String(text(u, &["http", "dns", "8080", ""])?)
                })
            })?,
            node_port: maybe(u, port)?,
            ..ServicePort::default()
        })
    })?;
    let spec = ServiceSpec {
        type_: maybe(u, |u| text(u, SERVICE_TYPES))?,
        cluster_ip: maybe(u, ip)?,
        cluster_ips: maybe(u, |u| list(u, 3, ip))?,
        ports: Some(ports),
        external_ips: maybe(u, |u| list(u, 3, ip))?,
        load_balancer_source_ranges: maybe(u, |u| list(u, 3, |u| text(u, CIDRS)))?,
        session_affinity: maybe(u, |u| text(u, AFFINITIES))?,
        session_affinity_config: maybe(u, |u| {
            Ok(SessionAffinityConfig {
                client_ip: Some(ClientIPConfig {
                    timeout_seconds: maybe(u, |u| {
                        Ok(*u.choose(&[0, 1, 10_800, 86_400, 86_401, -5, i32::MAX])?)
                    })?,
                }),
            })
        })?,
        external_traffic_policy: maybe(u, |u| text(u, POLICIES))?,
        internal_traffic_policy: maybe(u, |u| text(u, POLICIES))?,
        health_check_node_port: maybe(u, port)?,
        traffic_distribution: maybe(u, |u| text(u, DISTRIBUTIONS))?,
        ..ServiceSpec::default()
    };
    let status = maybe(u, |u| {
        Ok(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(list(u, 2, |u| {
                    Ok(LoadBalancerIngress {
                        ip: maybe(u, ip)?,
                        ..LoadBalancerIngress::default()
                    })
                })?),
            }),
            ..ServiceStatus::default()
        })
    })?;
    Ok(Service {
        metadata,
        spec: Some(spec),
        status,
    })
}

fn slice(u: &mut Unstructured<'_>, i: usize) -> Result<EndpointSlice> {
    let mut labels = BTreeMap::new();
    if u.ratio(7, 8)? {
        labels.insert(
            kube_ipvs_watch::translate::SERVICE_NAME_LABEL.to_owned(),
            text(u, NAMES)?,
        );
    }
    let metadata = meta(u, format!("slice-{i}"), labels)?;
    let max_endpoints = if u.ratio(1, 32)? { 300 } else { 6 };
    let endpoints = list(u, max_endpoints, |u| {
        Ok(Endpoint {
            addresses: list(u, 2, ip)?,
            conditions: maybe(u, |u| {
                Ok(EndpointConditions {
                    ready: u.arbitrary()?,
                    serving: u.arbitrary()?,
                    terminating: u.arbitrary()?,
                })
            })?,
            node_name: maybe(u, |u| text(u, NODES))?,
            zone: maybe(u, |u| text(u, ZONES))?,
            hints: maybe(u, |u| {
                Ok(EndpointHints {
                    for_zones: maybe(u, |u| {
                        list(u, 2, |u| {
                            Ok(ForZone {
                                name: text(u, ZONES)?,
                            })
                        })
                    })?,
                    for_nodes: maybe(u, |u| {
                        list(u, 2, |u| {
                            Ok(ForNode {
                                name: text(u, NODES)?,
                            })
                        })
                    })?,
                })
            })?,
            ..Endpoint::default()
        })
    })?;
    Ok(EndpointSlice {
        metadata,
        address_type: text(u, ADDRESS_TYPES)?,
        endpoints,
        ports: maybe(u, |u| {
            list(u, 4, |u| {
                Ok(EndpointPort {
                    name: maybe(u, |u| text(u, &["http", "dns", ""]))?,
                    port: maybe(u, port)?,
                    protocol: maybe(u, |u| text(u, PROTOCOLS))?,
                    ..EndpointPort::default()
                })
            })
        })?,
    })
}

fn node(u: &mut Unstructured<'_>) -> Result<Node> {
    let mut labels = BTreeMap::new();
    if u.arbitrary()? {
        labels.insert(
            kube_ipvs_watch::translate::ZONE_LABEL.to_owned(),
            text(u, ZONES)?,
        );
    }
    Ok(Node {
        metadata: ObjectMeta {
            name: Some(NODE.to_owned()),
            labels: (!labels.is_empty()).then_some(labels),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            pod_cidrs: maybe(u, |u| list(u, 2, |u| text(u, CIDRS)))?,
            taints: maybe(u, |u| {
                list(u, 1, |u| {
                    Ok(Taint {
                        key: text(
                            u,
                            &[kube_ipvs_watch::translate::TO_BE_DELETED_TAINT, "other"],
                        )?,
                        effect: "NoSchedule".to_owned(),
                        ..Taint::default()
                    })
                })
            })?,
            ..NodeSpec::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(list(u, 3, |u| {
                Ok(NodeAddress {
                    address: ip(u)?,
                    type_: text(u, &["InternalIP", "ExternalIP", "Hostname"])?,
                })
            })?),
            ..NodeStatus::default()
        }),
    })
}

/// The objects of one round.
struct Round {
    services: Vec<Service>,
    slices: Vec<EndpointSlice>,
    node: Option<Node>,
}

fn round(u: &mut Unstructured<'_>) -> Result<Round> {
    let services = list(u, 4, service)?;
    let mut i = 0;
    let slices = list(u, 4, |u| {
        i += 1;
        slice(u, i)
    })?;
    Ok(Round {
        services,
        slices,
        node: maybe(u, node)?,
    })
}

/// The table with every firewall mark set to 0, as sorted entries. The input store hands a
/// Service the Local-policy short circuit's marks first come, first served, and keeps them
/// across updates, so which mark a Service has depends on history; what it is used for does not.
fn marks_aside(table: &Table) -> (Vec<String>, Vec<IpAddr>) {
    let mut entries: Vec<String> = table
        .services
        .values()
        .map(|e| {
            let mut e = e.clone();
            if let VirtualKey::Fwmark { mark, .. } = &mut e.server.key {
                *mark = 0;
            }
            format!("{e:?}")
        })
        .collect();
    entries.sort();
    (entries, table.addresses.iter().copied().collect())
}

/// Long enough for every draining real server to time out.
const LATER: Duration = Duration::from_secs(86_400);

/// The target: two rounds of objects, the second told as relists to the agent that holds the first.
pub(crate) fn run(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let (Ok(first), Ok(second)) = (round(&mut u), round(&mut u)) else {
        return;
    };
    let mut agent = crate::pipeline::converge(&first.services, &first.slices, first.node.as_ref());
    agent.tracker.relist_services(&second.services);
    agent.tracker.relist_slices(&second.slices);
    if let Some(n) = &second.node {
        agent.tracker.apply_node(n);
    }
    agent.sync(Duration::from_secs(1));
    agent.sync(LATER);

    // The same history told to a tracker at once, and one sync: the same inputs (a bad object
    // keeps its previous translation in both), computed from scratch.
    let mut fresh = Agent::new();
    for round in [&first, &second] {
        fresh.tracker.relist_services(&round.services);
        fresh.tracker.relist_slices(&round.slices);
        if let Some(n) = &round.node {
            fresh.tracker.apply_node(n);
        }
    }
    fresh.sync(LATER);
    // A virtual server two Services ask for stays with the one that had it first
    // ([`kube_ipvs_diff::Conflict`]): history decides it, so only conflict-free states compare.
    if !agent.engine.conflicts().is_empty() || !fresh.engine.conflicts().is_empty() {
        return;
    }
    assert!(
        marks_aside(&agent.table) == marks_aside(&fresh.table),
        "incremental and from-scratch agents disagree\nincremental: {:#?}\nfrom scratch: {:#?}",
        agent.table,
        fresh.table
    );
}
