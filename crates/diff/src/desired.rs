//! From one Service and its endpoints to the virtual servers, real servers and addresses it
//! needs on this node: the Service API's semantics, in one pure function.
//!
//! The rules, with the API text they implement (the iptables/nftables modes of kube-proxy are
//! the reference; where kube-proxy's IPVS mode differs it is said here):
//!
//! 1. **Headless and ExternalName Services produce nothing** (`clusterIP: None` gets no
//!    virtual IP; `ExternalName` is a DNS alias).
//! 2. **Endpoint readiness**: ready endpoints are used; serving-and-terminating endpoints are
//!    used only when no endpoint is ready (KEP-1669 "ProxyTerminatingEndpoints"); other
//!    endpoints never.
//! 3. **`internalTrafficPolicy: Local`**: ClusterIPs use only endpoints on this node; with none,
//!    the ClusterIP has no real servers (traffic is dropped), as the API documents.
//! 4. **`externalTrafficPolicy: Local`**: NodePorts, externalIPs and LoadBalancer IPs use only
//!    endpoints on this node; with none they have no real servers. *kube-proxy IPVS differs*:
//!    it falls back to all endpoints when a node has no local one. And since a virtual server
//!    cannot tell a pod's traffic from external traffic, pod traffic to external IPs is not
//!    short-circuited to cluster endpoints as iptables mode does.
//! 5. **Topology** (KEP-2433 hints, KEP-4444 `trafficDistribution`): for Cluster policies, if
//!    every ready endpoint has node hints and one names this node, only those are used;
//!    otherwise if every ready endpoint has zone hints and one names this node's zone, only
//!    those are used; otherwise all. Without any hints (no EndpointSlice controller, e.g. from
//!    manifests) `PreferClose`/`PreferSameZone` derive zone hints from each endpoint's zone and
//!    `PreferSameNode` node and zone hints from its node and zone, as the controller would.
//! 6. **Dual-stack**: an endpoint only backs virtual servers of its own family; externalIPs, LB
//!    IPs and NodePorts exist only for families the Service has a ClusterIP of (as kube-proxy's
//!    per-family proxiers do).
//! 7. **Session affinity `ClientIP`**: persistent virtual servers with the affinity timeout and a
//!    full-length netmask (one client address).
//! 8. **Scheduler**: the Service's annotation if set, else the node default (`--scheduler`).
//! 9. **NodePorts** listen on each node IP of the Service's families; node IPs are not bound
//!    to `kube-ipvs0`; ClusterIPs, externalIPs and LB IPs are.
//! 10. **Ports**: an endpoint backs a Service port when it has a port with the same name and
//!     protocol; its number is the real server's port. Every real server has weight 1 and NAT.
//!
//! `loadBalancerSourceRanges` and `healthCheckNodePort` are not IPVS state: they are carried by
//! the model for the firewall and health-check parts of the daemon.

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::model::{
    Endpoint, NodeContext, Protocol, ServiceInfo, ServiceKind, SessionAffinity,
    TrafficDistribution, TrafficPolicy,
};
use crate::table::{DestKey, RealServer, VirtualKey, VirtualServer};

/// The weight of every real server the engine adds.
pub const WEIGHT: u32 = 1;

/// What one Service needs: its virtual servers (sorted by key, unique) with their real servers
/// (sorted by key, unique), and its addresses for `kube-ipvs0` (sorted, unique).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceTable {
    /// Virtual servers with their real servers.
    pub servers: Vec<(VirtualServer, Vec<RealServer>)>,
    /// Addresses to bind.
    pub addresses: Vec<IpAddr>,
}

impl ServiceTable {
    /// The number of real servers.
    pub fn dest_count(&self) -> usize {
        self.servers.iter().map(|(_, d)| d.len()).sum()
    }
}

/// Which topology filter applies (kube-proxy's `topologyModeFromHints`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Topology {
    None,
    Node,
    Zone,
}

/// The endpoints of one Service port that passed every filter, with their target ports.
type Backends<'a> = Vec<(&'a Endpoint, u16)>;

/// Computes what one Service needs on this node. `info` is `None` for a removed Service.
pub fn service_table(
    info: Option<&ServiceInfo>,
    endpoints: &[Endpoint],
    node: &NodeContext,
) -> ServiceTable {
    let Some(info) = info else {
        return ServiceTable::default();
    };
    // Rule 1: headless and ExternalName Services have no virtual IP.
    if info.kind == ServiceKind::ExternalName || info.cluster_ips.is_empty() {
        return ServiceTable::default();
    }
    let scheduler = info.scheduler.unwrap_or(node.default_scheduler);
    let persistence = match info.session_affinity {
        SessionAffinity::None => None,
        SessionAffinity::ClientIp { timeout_seconds } => Some(timeout_seconds),
    };
    let has_v4 = info.cluster_ips.iter().any(IpAddr::is_ipv4);
    let has_v6 = info.cluster_ips.iter().any(IpAddr::is_ipv6);
    let family_ok = |ip: &IpAddr| if ip.is_ipv4() { has_v4 } else { has_v6 };
    let node_ips: Vec<IpAddr> = node
        .node_ips_v4
        .iter()
        .map(|a| IpAddr::V4(*a))
        .chain(node.node_ips_v6.iter().map(|a| IpAddr::V6(*a)))
        .collect();

    let external: Vec<IpAddr> = info
        .external_ips
        .iter()
        .chain(&info.load_balancer_ips)
        .copied()
        .filter(family_ok)
        .collect();

    // Node IPs already belong to the node; binding them to the dummy interface would steal them.
    let mut addresses: Vec<IpAddr> = info
        .cluster_ips
        .iter()
        .chain(&external)
        .copied()
        .filter(|ip| !node_ips.contains(ip))
        .collect();
    addresses.sort_unstable();
    addresses.dedup();

    let topology_zone_hints = derived_hints(info, endpoints);
    let mut servers: Vec<(VirtualServer, Vec<RealServer>)> = Vec::new();
    for port in &info.ports {
        let backends: Backends<'_> = endpoints
            .iter()
            .filter_map(|e| e.port_for(&port.name, port.protocol).map(|p| (e, p)))
            .collect();
        // Each list is only built if a policy uses it; Cluster/Cluster is the common case.
        let uses = |p| info.internal_traffic_policy == p || info.external_traffic_policy == p;
        let cluster = if uses(TrafficPolicy::Cluster) {
            cluster_backends(&backends, node, &topology_zone_hints)
        } else {
            Vec::new()
        };
        let local = if uses(TrafficPolicy::Local) {
            local_backends(&backends, node)
        } else {
            Vec::new()
        };
        let internal = match info.internal_traffic_policy {
            TrafficPolicy::Cluster => &cluster,
            TrafficPolicy::Local => &local,
        };
        let external_backends = match info.external_traffic_policy {
            TrafficPolicy::Cluster => &cluster,
            TrafficPolicy::Local => &local,
        };
        let mut add = |addr: IpAddr, vport: u16, backends: &Backends<'_>| {
            let server = VirtualServer {
                key: VirtualKey::inet(port.protocol, addr, vport),
                scheduler,
                persistence,
                netmask: if addr.is_ipv4() { 32 } else { 128 },
            };
            let dests = backends
                .iter()
                .filter(|(e, _)| e.addr.is_ipv4() == addr.is_ipv4())
                .map(|(e, p)| RealServer::masq(e.addr, *p, WEIGHT))
                .collect();
            servers.push((server, dests));
        };
        for ip in &info.cluster_ips {
            add(*ip, port.port, internal);
        }
        for ip in &external {
            add(*ip, port.port, external_backends);
        }
        if let Some(np) = port.node_port {
            for ip in node_ips.iter().filter(|ip| family_ok(ip)) {
                add(*ip, np, external_backends);
            }
        }
    }
    // A key can repeat (an externalIP equal to a node IP with port == nodePort); the first
    // wins, which is the ClusterIP/external one since those were pushed first.
    let mut seen = BTreeSet::new();
    servers.retain(|(s, _)| seen.insert(s.key));
    servers.sort_by_key(|(s, _)| s.key);
    for (_, dests) in &mut servers {
        dests.sort_by_key(|d| d.key);
        dests.dedup_by_key(|d| d.key);
    }
    ServiceTable { servers, addresses }
}

/// Hints derived from `trafficDistribution` when no endpoint carries any (rule 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Derive {
    /// Use the hints as given.
    Given,
    /// Each endpoint is hinted for its own zone.
    Zone,
    /// Each endpoint is hinted for its own node and its own zone.
    Node,
}

fn derived_hints(info: &ServiceInfo, endpoints: &[Endpoint]) -> Derive {
    let any_hints = endpoints
        .iter()
        .any(|e| !e.hints_for_zones.is_empty() || !e.hints_for_nodes.is_empty());
    if any_hints {
        return Derive::Given;
    }
    match info.traffic_distribution {
        Some(TrafficDistribution::PreferClose | TrafficDistribution::PreferSameZone) => {
            Derive::Zone
        }
        Some(TrafficDistribution::PreferSameNode) => Derive::Node,
        Some(TrafficDistribution::Other(_)) | None => Derive::Given,
    }
}

fn zone_hinted(e: &Endpoint, derive: Derive, zone: &str) -> Option<bool> {
    match derive {
        // PreferSameNode's controller sets zone hints too, as the fallback when this node has
        // no endpoint.
        Derive::Zone | Derive::Node => e.zone.as_deref().map(|z| z == zone),
        _ if e.hints_for_zones.is_empty() => None,
        _ => Some(e.hints_for_zones.iter().any(|z| z == zone)),
    }
}

fn node_hinted(e: &Endpoint, derive: Derive, node: &str) -> Option<bool> {
    match derive {
        Derive::Node => e.node_name.as_deref().map(|n| n == node),
        Derive::Zone => None,
        Derive::Given if e.hints_for_nodes.is_empty() => None,
        Derive::Given => Some(e.hints_for_nodes.iter().any(|n| n == node)),
    }
}

/// kube-proxy's `topologyModeFromHints`: node hints win if every ready endpoint has them and
/// one names this node; then zone hints likewise; else no topology.
fn topology(backends: &Backends<'_>, node: &NodeContext, derive: Derive) -> Topology {
    // Per hint kind: whether every ready endpoint has hints, and whether one names us.
    let (mut all_node, mut any_node) = (true, false);
    let (mut all_zone, mut any_zone) = (true, false);
    let zone = node.zone.as_deref();
    for (e, _) in backends.iter().filter(|(e, _)| e.ready) {
        match node_hinted(e, derive, &node.node_name) {
            None => all_node = false,
            Some(hit) => any_node |= hit,
        }
        match zone.map(|z| zone_hinted(e, derive, z)) {
            None | Some(None) => all_zone = false,
            Some(Some(hit)) => any_zone |= hit,
        }
    }
    if all_node && any_node {
        Topology::Node
    } else if all_zone && any_zone {
        Topology::Zone
    } else {
        Topology::None
    }
}

/// Endpoints for a Cluster policy (rules 2 and 5).
fn cluster_backends<'a>(
    backends: &Backends<'a>,
    node: &NodeContext,
    derive: &Derive,
) -> Backends<'a> {
    let mode = topology(backends, node, *derive);
    let fits = |e: &Endpoint| match mode {
        Topology::None => true,
        Topology::Node => node_hinted(e, *derive, &node.node_name) == Some(true),
        Topology::Zone => node
            .zone
            .as_deref()
            .is_some_and(|z| zone_hinted(e, *derive, z) == Some(true)),
    };
    let ready: Backends<'a> = backends
        .iter()
        .filter(|(e, _)| e.ready && fits(e))
        .copied()
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    backends
        .iter()
        .filter(|(e, _)| e.serving && e.terminating && fits(e))
        .copied()
        .collect()
}

/// Endpoints for a Local policy (rules 2, 3 and 4): local ready ones, else local
/// serving-terminating ones.
fn local_backends<'a>(backends: &Backends<'a>, node: &NodeContext) -> Backends<'a> {
    let is_local = |e: &Endpoint| e.node_name.as_deref() == Some(node.node_name.as_str());
    let ready: Backends<'a> = backends
        .iter()
        .filter(|(e, _)| e.ready && is_local(e))
        .copied()
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    backends
        .iter()
        .filter(|(e, _)| e.serving && e.terminating && is_local(e))
        .copied()
        .collect()
}

/// The keys of one Service's real servers, for tests and tools.
pub fn dest_keys(table: &ServiceTable, key: &VirtualKey) -> Vec<DestKey> {
    table
        .servers
        .iter()
        .find(|(s, _)| &s.key == key)
        .map(|(_, d)| d.iter().map(|r| r.key).collect())
        .unwrap_or_default()
}

/// Whether a protocol's destinations drain gracefully: only TCP has connections to wait for.
pub fn drains(protocol: Protocol) -> bool {
    protocol == Protocol::Tcp
}
