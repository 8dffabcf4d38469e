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
//!    it falls back to all endpoints when a node has no local one. Local clients (this node's
//!    Pods and the node itself) are sent elsewhere by rule 11.
//! 5. **Topology** (KEP-2433 hints, KEP-4444 `trafficDistribution`): for Cluster policies, if
//!    every ready endpoint has node hints and one names this node, only those are used;
//!    otherwise if every ready endpoint has zone hints and one names this node's zone, only
//!    those are used; otherwise all. Without any hints (no EndpointSlice controller, e.g. from
//!    manifests) `PreferClose`/`PreferSameZone` derive zone hints from each endpoint's zone and
//!    `PreferSameNode` node and zone hints from its node and zone, as the controller would.
//! 6. **Dual-stack**: an endpoint only backs virtual servers of its own family; externalIPs, LB
//!    IPs and NodePorts exist only for families the Service has a ClusterIP of; and rules 2 and
//!    5 are decided per family, over that family's endpoints only (a ready IPv4 endpoint does
//!    not stop the IPv6 fallback to terminating endpoints; IPv6 hints do not set the IPv4
//!    topology mode), as kube-proxy's per-family proxiers do.
//! 7. **Session affinity `ClientIP`**: persistent virtual servers with the affinity timeout and a
//!    full-length netmask (one client address).
//! 8. **Scheduler**: the Service's annotation if set, else the node default (`--scheduler`).
//! 9. **NodePorts** listen on each node IP of the Service's families; node IPs are not bound
//!    to `kube-ipvs0`; ClusterIPs, externalIPs and LB IPs are.
//! 10. **Ports**: an endpoint backs a Service port when it has a port with the same name and
//!     protocol; its number is the real server's port. Every real server has weight 1 and NAT.
//! 11. **Local clients of Local-policy external addresses** (the short circuit, see
//!     [`crate::marks`]): a port of an `externalTrafficPolicy: Local` Service with a mark gets,
//!     per family it has an external address or NodePort in, a fwmark virtual server of that
//!     mark holding the endpoints the Cluster policy would pick (topology and the terminating
//!     fallback included), whatever `internalTrafficPolicy` says, as kube-proxy's iptables
//!     mode sends "pod traffic for external destinations" to the Service's cluster chain.
//!     [`ServiceTable::marked`] lists the external virtual servers whose local clients the host
//!     rules mark. External clients still get rule 4.
//!
//! `loadBalancerSourceRanges` and `healthCheckNodePort` are not IPVS state: they are carried by
//! the model for the firewall and health-check parts of the daemon.
//!
//! [`endpoint_decisions`] tells, for one Service port under one traffic policy, whether each
//! endpoint is a real server and which rule decided it ([`EndpointReason`]), for tools such as
//! `kube-ipvs explain`. It runs the selection [`service_table`] runs, not a copy of its rules,
//! so the two cannot disagree; on the sync path that selection computes the same reasons,
//! which are plain values, and allocates nothing for them.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::model::{
    Endpoint, NodeContext, Protocol, ServiceInfo, ServiceKind, ServicePort, SessionAffinity,
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
    /// The Local-policy short circuit (rule 11): each external virtual server (address or
    /// NodePort) whose local clients are sent to a fwmark virtual server, with that mark;
    /// sorted, unique.
    pub marked: Vec<(VirtualKey, u32)>,
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

/// Endpoints of one Service port, with their target ports.
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
    let node_ips: Vec<IpAddr> = node.node_ips().collect();

    let external: Vec<IpAddr> = info
        .external_ips
        .iter()
        .chain(&info.load_balancer_ips)
        .copied()
        .filter(family_ok)
        .collect();

    // Node IPs already belong to the node; binding them to the dummy interface would steal them.
    // Nor is an external or load-balancer IP that another interface holds bound (kube-proxy's
    // `shouldBind`): the node already accepts it, and unbinding it later would not be ours.
    let mut addresses: Vec<IpAddr> = info
        .cluster_ips
        .iter()
        .copied()
        .chain(
            external
                .iter()
                .copied()
                .filter(|ip| node.held_addresses.binary_search(ip).is_err()),
        )
        .filter(|ip| !node_ips.contains(ip))
        .collect();
    addresses.sort_unstable();
    addresses.dedup();

    // Rule 6 with rules 2 and 5: the fallback and the topology mode are decided per family,
    // over that family's endpoints only, as kube-proxy's per-family proxiers do.
    // Only for the families the Service has: the other one's selection is never made.
    let derive_for = |wanted, family| {
        if wanted {
            derived_hints(info, endpoints, family)
        } else {
            Derive::Given
        }
    };
    let derive = [
        derive_for(has_v4, Family::V4),
        derive_for(has_v6, Family::V6),
    ];
    let mut servers: Vec<(VirtualServer, Vec<RealServer>)> = Vec::new();
    let mut marked: Vec<(VirtualKey, u32)> = Vec::new();
    for port in &info.ports {
        let backends = port_backends(endpoints, port);
        // Rule 11: the port's short-circuit mark, under the Local external policy only.
        let mark = info
            .local_marks
            .iter()
            .find(|m| (m.protocol, m.port) == (port.protocol, port.port))
            .map(|m| m.mark)
            .filter(|_| info.external_traffic_policy == TrafficPolicy::Local);
        // Each list is only built if a policy uses it and the Service has that family;
        // Cluster/Cluster in one family is the common case. The short circuit uses the
        // cluster-wide endpoints.
        let uses = |p| {
            info.internal_traffic_policy == p
                || info.external_traffic_policy == p
                || (p == TrafficPolicy::Cluster && mark.is_some())
        };
        let select = |policy, family: Family| {
            let wanted = match family {
                Family::V4 => has_v4,
                Family::V6 => has_v6,
            };
            if !(uses(policy) && wanted) {
                return Vec::new();
            }
            let own = of_family(&backends, family);
            Selection::new(&own, policy, node, derive[family as usize]).pick(&own)
        };
        let cluster = [
            select(TrafficPolicy::Cluster, Family::V4),
            select(TrafficPolicy::Cluster, Family::V6),
        ];
        let local = [
            select(TrafficPolicy::Local, Family::V4),
            select(TrafficPolicy::Local, Family::V6),
        ];
        let internal = match info.internal_traffic_policy {
            TrafficPolicy::Cluster => &cluster,
            TrafficPolicy::Local => &local,
        };
        let external_backends = match info.external_traffic_policy {
            TrafficPolicy::Cluster => &cluster,
            TrafficPolicy::Local => &local,
        };
        let mut add = |addr: IpAddr, vport: u16, by_family: &[Backends<'_>; 2]| {
            let backends = &by_family[Family::of(addr) as usize];
            let server = VirtualServer {
                key: VirtualKey::inet(port.protocol, addr, vport),
                scheduler,
                persistence,
                netmask: if addr.is_ipv4() { 32 } else { 128 },
            };
            let dests = backends
                .iter()
                .filter(|(e, _)| same_family(e.addr, addr))
                .map(|(e, p)| RealServer::masq(e.addr, *p, WEIGHT))
                .collect();
            servers.push((server, dests));
        };
        for ip in &info.cluster_ips {
            add(*ip, port.port, internal);
        }
        // The external ways in of this port (addresses, then NodePorts), walked without
        // collecting them: most Services have no mark and are on the sync path.
        let ways_in = || {
            let node_ports = port.node_port.into_iter().flat_map(|np| {
                node_ips
                    .iter()
                    .filter(|ip| family_ok(ip))
                    .map(move |ip| (*ip, np))
            });
            external.iter().map(|ip| (*ip, port.port)).chain(node_ports)
        };
        for (ip, vport) in ways_in() {
            add(ip, vport, external_backends);
        }
        if let Some(mark) = mark {
            for family in [Family::V4, Family::V6] {
                let before = marked.len();
                marked.extend(
                    ways_in()
                        .filter(|(ip, _)| Family::of(*ip) == family)
                        .map(|(ip, vport)| (VirtualKey::inet(port.protocol, ip, vport), mark)),
                );
                if marked.len() == before {
                    continue;
                }
                let ipv6 = family == Family::V6;
                let server = VirtualServer {
                    key: VirtualKey::Fwmark { ipv6, mark },
                    scheduler,
                    persistence,
                    netmask: if ipv6 { 128 } else { 32 },
                };
                let dests = cluster[family as usize]
                    .iter()
                    .map(|(e, p)| RealServer::masq(e.addr, *p, WEIGHT))
                    .collect();
                servers.push((server, dests));
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
    marked.sort_unstable();
    marked.dedup_by_key(|m| m.0);
    ServiceTable {
        servers,
        addresses,
        marked,
    }
}

/// Why an endpoint is or is not a real server of a virtual server, as [`endpoint_decisions`]
/// gives it: the first rule of [`service_table`]'s selection that decides it.
///
/// The variants carry no data; the endpoint, its Service and the node hold the details (its
/// node, zone and hints).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EndpointReason {
    /// A real server: ready, and the policy's filter admits it.
    Ready,
    /// A real server: serving and terminating, used because no ready endpoint is admitted
    /// (rule 2, KEP-1669).
    TerminatingFallback,
    /// Not one: it has no port with the Service port's name and protocol (rule 10).
    NoMatchingPort,
    /// Not one: its address family differs from the virtual address's (rule 6).
    OtherFamily,
    /// Not one: not ready, and not serving-and-terminating (rule 2).
    NotReady,
    /// Not one: terminating and no longer serving (rule 2).
    TerminatingNotServing,
    /// Not one: serving and terminating, but a ready endpoint is admitted, so the fallback is
    /// not taken (rule 2).
    TerminatingWhileReady,
    /// Not one: on another node (or on none) while the policy is Local (rules 3 and 4).
    OtherNodeUnderLocal,
    /// Not one: the node hints (`hints.forNodes`) are in use and do not name this node (rule 5).
    NodeHints,
    /// Not one: the zone hints (`hints.forZones`) are in use and do not name this node's zone
    /// (rule 5).
    ZoneHints,
    /// Not one: `trafficDistribution: PreferSameNode` is in use, no endpoint has hints, and
    /// the endpoint is on another node (rule 5).
    OtherNodeByDistribution,
    /// Not one: `trafficDistribution` prefers this node's zone, no endpoint has hints, and the
    /// endpoint is in another zone (or in none) (rule 5).
    OtherZoneByDistribution,
}

impl EndpointReason {
    /// Whether an endpoint with this reason is a real server.
    pub fn is_real_server(self) -> bool {
        matches!(
            self,
            EndpointReason::Ready | EndpointReason::TerminatingFallback
        )
    }
}

/// What the engine makes of one endpoint for one virtual server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EndpointDecision {
    /// Its port for the Service port (the real server's port), if it has one.
    pub target_port: Option<u16>,
    /// Whether it is a real server; the same as `reason.is_real_server()`.
    pub real_server: bool,
    /// Why.
    pub reason: EndpointReason,
}

/// For each of `endpoints` (in their order), whether it is a real server of a virtual server
/// of `port` in `virtual_addr`'s family under `policy`, and why.
///
/// `policy` is the one for the way the virtual server is reached: `internalTrafficPolicy`
/// for a ClusterIP, `externalTrafficPolicy` for an externalIP, a LoadBalancer IP or a
/// NodePort. Only `virtual_addr`'s family is used. Whether [`service_table`] builds such a
/// virtual server at all is its own business (rules 1 and 6); when it does, the endpoints
/// marked here as real servers are exactly its real servers, since both take them from the
/// same selection.
pub fn endpoint_decisions(
    info: &ServiceInfo,
    port: &ServicePort,
    policy: TrafficPolicy,
    virtual_addr: IpAddr,
    endpoints: &[Endpoint],
    node: &NodeContext,
) -> Vec<EndpointDecision> {
    let family = Family::of(virtual_addr);
    let all = port_backends(endpoints, port);
    let backends = of_family(&all, family);
    let selection = Selection::new(
        &backends,
        policy,
        node,
        derived_hints(info, endpoints, family),
    );
    endpoints
        .iter()
        .map(|e| {
            let target_port = e.port_for(&port.name, port.protocol);
            let reason = match target_port {
                None => EndpointReason::NoMatchingPort,
                Some(_) if !same_family(e.addr, virtual_addr) => EndpointReason::OtherFamily,
                Some(_) => selection.decide(e),
            };
            EndpointDecision {
                target_port,
                real_server: reason.is_real_server(),
                reason,
            }
        })
        .collect()
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

fn derived_hints(info: &ServiceInfo, endpoints: &[Endpoint], family: Family) -> Derive {
    let any_hints = endpoints
        .iter()
        .filter(|e| Family::of(e.addr) == family)
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

/// How the endpoints of one Service port are chosen under one traffic policy (rules 2 to 5).
///
/// [`service_table`] and [`endpoint_decisions`] both go through [`Selection::decide`], so the
/// real servers the engine programs and the reasons it gives for them cannot disagree.
#[derive(Debug, Clone, Copy)]
struct Selection<'n> {
    policy: TrafficPolicy,
    node: &'n NodeContext,
    derive: Derive,
    /// The topology filter; always [`Topology::None`] under a Local policy, which ignores hints.
    mode: Topology,
    /// Whether some ready endpoint passes the policy's filter; if none does, serving and
    /// terminating endpoints are used instead (KEP-1669).
    any_ready: bool,
}

impl<'n> Selection<'n> {
    fn new(
        backends: &Backends<'_>,
        policy: TrafficPolicy,
        node: &'n NodeContext,
        derive: Derive,
    ) -> Self {
        let mode = match policy {
            TrafficPolicy::Cluster => topology(backends, node, derive),
            TrafficPolicy::Local => Topology::None,
        };
        let mut selection = Selection {
            policy,
            node,
            derive,
            mode,
            any_ready: false,
        };
        selection.any_ready = backends
            .iter()
            .any(|(e, _)| e.ready && selection.admits(e).is_ok());
        selection
    }

    /// The policy's filter: this node's endpoints under Local (rules 3 and 4), the topology
    /// filter under Cluster (rule 5).
    fn admits(&self, e: &Endpoint) -> Result<(), EndpointReason> {
        let node_name = self.node.node_name.as_str();
        match (self.policy, self.mode) {
            (TrafficPolicy::Local, _) if e.node_name.as_deref() == Some(node_name) => Ok(()),
            (TrafficPolicy::Local, _) => Err(EndpointReason::OtherNodeUnderLocal),
            (TrafficPolicy::Cluster, Topology::None) => Ok(()),
            (TrafficPolicy::Cluster, Topology::Node) => {
                if node_hinted(e, self.derive, node_name) == Some(true) {
                    Ok(())
                } else if self.derive == Derive::Node {
                    Err(EndpointReason::OtherNodeByDistribution)
                } else {
                    Err(EndpointReason::NodeHints)
                }
            }
            (TrafficPolicy::Cluster, Topology::Zone) => {
                let zone = self.node.zone.as_deref();
                if zone.is_some_and(|z| zone_hinted(e, self.derive, z) == Some(true)) {
                    Ok(())
                } else if self.derive == Derive::Given {
                    Err(EndpointReason::ZoneHints)
                } else {
                    Err(EndpointReason::OtherZoneByDistribution)
                }
            }
        }
    }

    /// What becomes of one endpoint that has the port. The reason is the first test of the
    /// selection that it fails: its conditions, then (for a serving-terminating endpoint)
    /// whether the fallback is taken at all, then the policy's filter.
    fn decide(&self, e: &Endpoint) -> EndpointReason {
        if e.ready {
            return match self.admits(e) {
                Ok(()) => EndpointReason::Ready,
                Err(why) => why,
            };
        }
        if !(e.serving && e.terminating) {
            return if e.terminating {
                EndpointReason::TerminatingNotServing
            } else {
                EndpointReason::NotReady
            };
        }
        if self.any_ready {
            return EndpointReason::TerminatingWhileReady;
        }
        match self.admits(e) {
            Ok(()) => EndpointReason::TerminatingFallback,
            Err(why) => why,
        }
    }

    /// The endpoints that are real servers, in the order given.
    fn pick<'a>(&self, backends: &Backends<'a>) -> Backends<'a> {
        backends
            .iter()
            .filter(|(e, _)| self.decide(e).is_real_server())
            .copied()
            .collect()
    }
}

/// The endpoints that have a port of the Service port's name and protocol (rule 10).
fn port_backends<'a>(endpoints: &'a [Endpoint], port: &ServicePort) -> Backends<'a> {
    endpoints
        .iter()
        .filter_map(|e| e.port_for(&port.name, port.protocol).map(|p| (e, p)))
        .collect()
}

/// An address family, as an index into per-family pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4 = 0,
    V6 = 1,
}

impl Family {
    fn of(addr: IpAddr) -> Self {
        if addr.is_ipv4() { Self::V4 } else { Self::V6 }
    }
}

/// The backends of one family. Most Services are single-stack with endpoints of one family, so
/// the list is borrowed as it is unless it mixes families (the incremental sync is measured in
/// allocations: `cargo bench -p kube-ipvs-diff`).
fn of_family<'b, 'a>(backends: &'b Backends<'a>, family: Family) -> Cow<'b, Backends<'a>> {
    if backends.iter().all(|(e, _)| Family::of(e.addr) == family) {
        Cow::Borrowed(backends)
    } else {
        Cow::Owned(
            backends
                .iter()
                .filter(|(e, _)| Family::of(e.addr) == family)
                .copied()
                .collect(),
        )
    }
}

/// Whether a real server address can back a virtual address (rule 6).
fn same_family(real: IpAddr, virtual_addr: IpAddr) -> bool {
    real.is_ipv4() == virtual_addr.is_ipv4()
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

/// Whether a protocol's destinations drain gracefully: TCP connections and SCTP associations
/// are waited for (IPVS counts both); UDP has none, and its flows move at once.
pub fn drains(protocol: Protocol) -> bool {
    matches!(protocol, Protocol::Tcp | Protocol::Sctp)
}
