//! The input model: what the engine needs to know about Services, their endpoints and this
//! node, as plain Rust types.
//!
//! This module owns the vocabulary shared with the watch layer, which converts Kubernetes
//! objects into these types. It must not depend on `k8s-openapi` or any client: the engine is
//! pure, and tests build inputs by hand. Values are validated on the way in
//! ([`Inputs::upsert_service`], [`Inputs::set_endpoints`]) so nothing malformed reaches the
//! kernel, and every error names the Service it came from.
//!
//! [`Inputs`] is the store the engine reads. It records which Services changed since the engine
//! last looked, which is what makes a sync cost work for the changed Services only.

use std::collections::{HashMap, HashSet};

use foldhash::fast::RandomState;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::marks::{MarkHint, MarkSpace, MarkTable, PortMark};

/// The annotation a Service may carry to choose its own IPVS scheduler, overriding the node's
/// `--scheduler`. Its value is parsed with [`Scheduler::from_str`], e.g. `wrr` or `mh:fallback,port`.
pub const SCHEDULER_ANNOTATION: &str = "kube-ipvs.io/scheduler";

/// The API's default ClientIP affinity timeout (`sessionAffinityConfig.clientIP.timeoutSeconds`).
pub const DEFAULT_AFFINITY_TIMEOUT_SECONDS: u32 = 10_800;

/// The API's upper bound for the ClientIP affinity timeout (one day).
pub const MAX_AFFINITY_TIMEOUT_SECONDS: u32 = 86_400;

/// A Service's identity: namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceName {
    /// The namespace, e.g. `default`.
    pub namespace: String,
    /// The Service's name, e.g. `web`.
    pub name: String,
}

impl ServiceName {
    /// Builds a name from its two parts.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of one Service, as kube-proxy names it: `namespace/name:port` plus the protocol.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    /// The Service the port belongs to.
    pub service: ServiceName,
    /// The port's name; empty when the Service has a single unnamed port.
    pub port: String,
    /// The port's protocol.
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{} {}", self.service, self.protocol)
        } else {
            write!(f, "{}:{} {}", self.service, self.port, self.protocol)
        }
    }
}

/// A transport protocol IPVS can balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// TCP (IP protocol 6).
    Tcp,
    /// UDP (IP protocol 17).
    Udp,
    /// SCTP (IP protocol 132).
    Sctp,
}

impl Protocol {
    /// The IP protocol number, as IPVS netlink carries it.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// The Service's `spec.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ServiceKind {
    /// `ClusterIP` (also headless when [`ServiceInfo::cluster_ips`] is empty).
    #[default]
    ClusterIp,
    /// `NodePort`.
    NodePort,
    /// `LoadBalancer`.
    LoadBalancer,
    /// `ExternalName`: a DNS alias, never programmed into IPVS.
    ExternalName,
}

/// One entry of `spec.ports`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServicePort {
    /// The port's name (`spec.ports[].name`); empty for a single unnamed port. Endpoint ports
    /// are matched to it by this name and the protocol.
    pub name: String,
    /// The protocol (`spec.ports[].protocol`).
    pub protocol: Protocol,
    /// The Service port (`spec.ports[].port`), used on ClusterIPs, externalIPs and LB IPs.
    pub port: u16,
    /// The node port (`spec.ports[].nodePort`), used on every node IP, if allocated.
    pub node_port: Option<u16>,
}

/// `spec.sessionAffinity` with its timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SessionAffinity {
    /// No affinity: each connection is scheduled on its own.
    #[default]
    None,
    /// `ClientIP`: connections from one client go to the same endpoint for `timeout_seconds`
    /// (`sessionAffinityConfig.clientIP.timeoutSeconds`, 1..=86400, default 10800).
    ClientIp {
        /// How long the affinity lasts after the last connection, in seconds.
        timeout_seconds: u32,
    },
}

/// `spec.externalTrafficPolicy` or `spec.internalTrafficPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TrafficPolicy {
    /// Route to endpoints anywhere in the cluster.
    #[default]
    Cluster,
    /// Route only to endpoints on this node.
    Local,
}

/// `spec.trafficDistribution`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TrafficDistribution {
    /// `PreferClose`: prefer endpoints topologically close to the client (the same zone).
    PreferClose,
    /// `PreferSameZone`: prefer endpoints in the client's zone (1.34 name of `PreferClose`).
    PreferSameZone,
    /// `PreferSameNode`: prefer endpoints on the client's node.
    PreferSameNode,
    /// A value this version does not know; treated as unset, as the API says implementations must.
    Other(String),
}

/// Everything the engine needs from one Service object.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceInfo {
    /// `spec.type`. `ExternalName` Services produce nothing.
    pub kind: ServiceKind,
    /// `spec.clusterIPs`: at most one per family. Empty for a headless Service (`None`), which
    /// produces nothing.
    pub cluster_ips: Vec<IpAddr>,
    /// `spec.ports`.
    pub ports: Vec<ServicePort>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`, already without entries whose `ipMode` is `Proxy`
    /// (those are handled by the load balancer itself, not by the node).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.sessionAffinity` and its timeout.
    pub session_affinity: SessionAffinity,
    /// `spec.externalTrafficPolicy`: which endpoints NodePorts, externalIPs and LB IPs use.
    pub external_traffic_policy: TrafficPolicy,
    /// `spec.internalTrafficPolicy`: which endpoints ClusterIPs use.
    pub internal_traffic_policy: TrafficPolicy,
    /// `spec.healthCheckNodePort` (only with `externalTrafficPolicy: Local`). Served by the
    /// daemon's health server, not by IPVS; carried so the daemon has one source of truth.
    pub health_check_node_port: Option<u16>,
    /// `spec.loadBalancerSourceRanges`. IPVS cannot filter by source; a firewall layer enforces
    /// these. Carried here so a change is seen as a change of the Service.
    pub load_balancer_source_ranges: Vec<Cidr>,
    /// `spec.trafficDistribution`.
    pub traffic_distribution: Option<TrafficDistribution>,
    /// The per-Service scheduler from [`SCHEDULER_ANNOTATION`]; `None` means the node default.
    pub scheduler: Option<Scheduler>,
    /// The firewall marks of its ports for the Local-policy short circuit ([`crate::marks`]).
    /// Not from the object: [`Inputs::upsert_service`] assigns them, replacing what the caller
    /// put here.
    pub local_marks: Vec<PortMark>,
}

/// One port of an endpoint (`EndpointSlice.ports[]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointPort {
    /// The port's name, matched against [`ServicePort::name`].
    pub name: String,
    /// The target port number.
    pub port: u16,
    /// The protocol, matched against [`ServicePort::protocol`].
    pub protocol: Protocol,
}

/// One backend address of a Service, merged over all its EndpointSlices.
///
/// 100,000 of them at 10,000 Services, held by the watch's per-slice state and by these inputs
/// (one list shared by both when a Service has one slice, as most do; two when it has more):
/// what repeats across a slice's endpoints (its ports, a node's name) is shared through an
/// `Arc`, not copied into each.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// The endpoint's address (`endpoints[].addresses[0]`).
    pub addr: IpAddr,
    /// The ports this address serves (the slice's `ports`), sorted; shared by the endpoints of
    /// one slice.
    pub ports: Arc<[EndpointPort]>,
    /// `conditions.ready` (an absent condition counts as ready, as the API says).
    pub ready: bool,
    /// `conditions.serving` (absent: same as `ready`).
    pub serving: bool,
    /// `conditions.terminating` (absent: false).
    pub terminating: bool,
    /// `nodeName`, used by the Local traffic policies; shared by a slice's endpoints on one node.
    pub node_name: Option<Arc<str>>,
    /// `zone`, used to derive zone hints for `trafficDistribution` when the slice has none;
    /// shared by a slice's endpoints in one zone.
    pub zone: Option<Arc<str>>,
    /// `hints.forZones[].name` (a boxed slice: most endpoints have none, and it never grows).
    pub hints_for_zones: Box<[String]>,
    /// `hints.forNodes[].name`.
    pub hints_for_nodes: Box<[String]>,
}

impl Endpoint {
    /// A ready, serving endpoint with the given ports and no topology, for tests and tools.
    pub fn ready(addr: IpAddr, mut ports: Vec<EndpointPort>) -> Self {
        ports.sort();
        Self {
            addr,
            ports: ports.into(),
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone: None,
            hints_for_zones: Box::default(),
            hints_for_nodes: Box::default(),
        }
    }

    /// The target port for a Service port: the endpoint port with the same name and protocol.
    pub fn port_for(&self, name: &str, protocol: Protocol) -> Option<u16> {
        self.ports
            .iter()
            .find(|p| p.name == name && p.protocol == protocol)
            .map(|p| p.port)
    }
}

/// An IP network, e.g. `10.0.0.0/8` or `fd00::/64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Builds a network; host bits of `addr` are cleared. Fails if `prefix` is too long.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Self> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(Error::InvalidCidr {
                input: format!("{addr}/{prefix}"),
                reason: format!("prefix length {prefix} is longer than {max}"),
            });
        }
        let addr = match addr {
            IpAddr::V4(a) => IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask32(prefix))),
            IpAddr::V6(a) => IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask128(prefix))),
        };
        Ok(Self { addr, prefix })
    }

    /// The network address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether `ip` lies in this network (never across families).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => u32::from(a) & mask32(self.prefix) == u32::from(n),
            (IpAddr::V6(n), IpAddr::V6(a)) => u128::from(a) & mask128(self.prefix) == u128::from(n),
            _ => false,
        }
    }
}

fn mask32(prefix: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)
}

fn mask128(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

impl FromStr for Cidr {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| Error::InvalidCidr {
            input: s.to_owned(),
            reason: reason.to_owned(),
        };
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| bad("not an IPv4 or IPv6 address"))?;
        let prefix = match prefix {
            Some(p) => p
                .trim()
                .parse::<u8>()
                .map_err(|_| bad("the prefix length is not a number from 0 to 128"))?,
            None if addr.is_ipv4() => 32,
            None => 128,
        };
        Cidr::new(addr, prefix)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A kernel IPVS scheduling algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SchedulerKind {
    /// Round robin.
    Rr,
    /// Weighted round robin.
    Wrr,
    /// Least connection.
    Lc,
    /// Weighted least connection.
    Wlc,
    /// Locality-based least connection.
    Lblc,
    /// Locality-based least connection with replication.
    Lblcr,
    /// Destination hashing.
    Dh,
    /// Source hashing.
    Sh,
    /// Maglev hashing.
    Mh,
    /// Shortest expected delay.
    Sed,
    /// Never queue.
    Nq,
    /// Weighted failover.
    Fo,
    /// Weighted overflow.
    Ovf,
    /// Weighted random twos choice.
    Twos,
}

impl SchedulerKind {
    const ALL: [SchedulerKind; 14] = [
        SchedulerKind::Rr,
        SchedulerKind::Wrr,
        SchedulerKind::Lc,
        SchedulerKind::Wlc,
        SchedulerKind::Lblc,
        SchedulerKind::Lblcr,
        SchedulerKind::Dh,
        SchedulerKind::Sh,
        SchedulerKind::Mh,
        SchedulerKind::Sed,
        SchedulerKind::Nq,
        SchedulerKind::Fo,
        SchedulerKind::Ovf,
        SchedulerKind::Twos,
    ];

    /// The kernel's name for it (`SCHED_NAME`), e.g. `rr`.
    pub fn name(self) -> &'static str {
        match self {
            SchedulerKind::Rr => "rr",
            SchedulerKind::Wrr => "wrr",
            SchedulerKind::Lc => "lc",
            SchedulerKind::Wlc => "wlc",
            SchedulerKind::Lblc => "lblc",
            SchedulerKind::Lblcr => "lblcr",
            SchedulerKind::Dh => "dh",
            SchedulerKind::Sh => "sh",
            SchedulerKind::Mh => "mh",
            SchedulerKind::Sed => "sed",
            SchedulerKind::Nq => "nq",
            SchedulerKind::Fo => "fo",
            SchedulerKind::Ovf => "ovf",
            SchedulerKind::Twos => "twos",
        }
    }

    /// Looks a kernel scheduler name up; `None` if the kernel has no such scheduler.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// A validated scheduler: the algorithm plus the `sh`/`mh` flags (`SCHED1` fallback,
/// `SCHED2` port). The flags are only accepted for `sh` and `mh`, the two schedulers that read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scheduler {
    kind: SchedulerKind,
    fallback: bool,
    port: bool,
}

impl Scheduler {
    /// A scheduler without flags.
    pub const fn new(kind: SchedulerKind) -> Self {
        Self {
            kind,
            fallback: false,
            port: false,
        }
    }

    /// Round robin, kube-proxy's default.
    pub const RR: Scheduler = Scheduler::new(SchedulerKind::Rr);

    /// A scheduler with flags; fails for flags on a scheduler other than `sh` or `mh`.
    pub fn with_flags(kind: SchedulerKind, fallback: bool, port: bool) -> Result<Self> {
        if (fallback || port) && !matches!(kind, SchedulerKind::Sh | SchedulerKind::Mh) {
            return Err(Error::InvalidScheduler {
                input: Scheduler {
                    kind,
                    fallback,
                    port,
                }
                .to_string(),
                reason: "the fallback and port flags apply only to sh and mh".to_owned(),
            });
        }
        Ok(Self {
            kind,
            fallback,
            port,
        })
    }

    /// The algorithm.
    pub fn kind(&self) -> SchedulerKind {
        self.kind
    }

    /// The kernel name, e.g. `mh`.
    pub fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// `sh-fallback` / `mh-fallback` (`IP_VS_SVC_F_SCHED1`).
    pub fn fallback(&self) -> bool {
        self.fallback
    }

    /// `sh-port` / `mh-port` (`IP_VS_SVC_F_SCHED2`).
    pub fn port(&self) -> bool {
        self.port
    }
}

impl Default for Scheduler {
    fn default() -> Self {
        Scheduler::RR
    }
}

/// Parses `name[:flag[,flag]]`, e.g. `rr`, `mh`, `mh:fallback,port`. Names are the kernel's;
/// flags are `fallback` and `port`, only for `sh` and `mh`.
impl FromStr for Scheduler {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: String| Error::InvalidScheduler {
            input: s.to_owned(),
            reason,
        };
        let (name, flags) = match s.trim().split_once(':') {
            Some((n, f)) => (n.trim(), Some(f)),
            None => (s.trim(), None),
        };
        let kind = SchedulerKind::from_name(name).ok_or_else(|| {
            let known: Vec<&str> = SchedulerKind::ALL.iter().map(|k| k.name()).collect();
            bad(format!(
                "unknown scheduler {name:?}; expected one of {}",
                known.join(", ")
            ))
        })?;
        let (mut fallback, mut port) = (false, false);
        for flag in flags.into_iter().flat_map(|f| f.split(',')) {
            match flag.trim() {
                "fallback" => fallback = true,
                "port" => port = true,
                other => {
                    return Err(bad(format!(
                        "unknown flag {other:?}; expected fallback or port"
                    )));
                }
            }
        }
        Scheduler::with_flags(kind, fallback, port).map_err(|_| {
            bad(format!(
                "the fallback and port flags apply only to sh and mh, not {name}"
            ))
        })
    }
}

impl fmt::Display for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())?;
        match (self.fallback, self.port) {
            (false, false) => Ok(()),
            (true, false) => f.write_str(":fallback"),
            (false, true) => f.write_str(":port"),
            (true, true) => f.write_str(":fallback,port"),
        }
    }
}

/// Engine options that come from the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// How long a removed TCP or SCTP destination with connections keeps weight 0 before it is
    /// deleted anyway (`--graceful-termination-timeout`, 15 minutes by default).
    pub graceful_termination_timeout: Duration,
    /// Virtual servers and interface addresses in these networks are never touched: they belong
    /// to someone else (`--ipvs-exclude-cidrs`).
    pub exclude_cidrs: Vec<Cidr>,
    /// The marks of the Local-policy short circuit's fwmark virtual servers
    /// (`--local-fwmark-mask`); `None` turns the short circuit off, so local clients of a
    /// Local-policy Service's external addresses get its local endpoints only, as in
    /// kube-proxy's IPVS mode. Fwmark virtual servers of marks in this space are the engine's.
    pub local_marks: Option<MarkSpace>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            graceful_termination_timeout: Duration::from_secs(15 * 60),
            exclude_cidrs: Vec::new(),
            local_marks: Some(MarkSpace::DEFAULT),
        }
    }
}

/// What the engine knows about the node it runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeContext {
    /// This node's name, compared with [`Endpoint::node_name`] and node hints.
    pub node_name: String,
    /// This node's `topology.kubernetes.io/zone` label, compared with zone hints.
    pub zone: Option<String>,
    /// IPv4 addresses NodePorts listen on.
    pub node_ips_v4: Vec<Ipv4Addr>,
    /// IPv6 addresses NodePorts listen on.
    pub node_ips_v6: Vec<Ipv6Addr>,
    /// Addresses other interfaces of the node hold (sorted): an external or load-balancer IP
    /// among them is served but not bound to `kube-ipvs0`, as kube-proxy does not bind it.
    pub held_addresses: Vec<IpAddr>,
    /// The scheduler for Services without an override (`--scheduler`).
    pub default_scheduler: Scheduler,
    /// Engine options.
    pub options: Options,
    /// The Node's `spec.podCIDRs` (not used by the engine; `detectLocalMode: NodeCIDR` reads
    /// it).
    pub pod_cidrs: Vec<Cidr>,
}

impl NodeContext {
    /// A node with the given name and defaults for everything else.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            zone: None,
            node_ips_v4: Vec::new(),
            node_ips_v6: Vec::new(),
            held_addresses: Vec::new(),
            default_scheduler: Scheduler::RR,
            options: Options::default(),
            pod_cidrs: Vec::new(),
        }
    }

    /// The node's addresses, IPv4 first (the NodePort addresses, when set).
    pub fn node_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.node_ips_v4
            .iter()
            .map(|a| IpAddr::V4(*a))
            .chain(self.node_ips_v6.iter().map(|a| IpAddr::V6(*a)))
    }

    /// Sets the node's addresses from one list of both families, each address to its family's
    /// list, in the order given.
    pub fn set_node_ips(&mut self, ips: impl IntoIterator<Item = IpAddr>) {
        self.node_ips_v4.clear();
        self.node_ips_v6.clear();
        for ip in ips {
            match ip {
                IpAddr::V4(a) => self.node_ips_v4.push(a),
                IpAddr::V6(a) => self.node_ips_v6.push(a),
            }
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |reason: &str| Error::InvalidNode {
            node: self.node_name.clone(),
            reason: reason.to_owned(),
        };
        if self.node_name.is_empty() {
            return Err(bad("the node name is empty"));
        }
        for ip in self.node_ips() {
            if let Some(why) = unusable_vip(ip) {
                return Err(bad(&format!("node IP {ip} {why}")));
            }
        }
        Ok(())
    }
}

/// Whether an address is link-local (`169.254.0.0/16`, `fe80::/10`): never an endpoint, a
/// Service address or a NodePort address.
#[must_use]
pub fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => a.segments()[0] & 0xffc0 == 0xfe80,
    }
}

/// Why an address cannot be a virtual server address (nor a node address), if it cannot.
#[must_use]
pub fn unusable_vip(ip: IpAddr) -> Option<&'static str> {
    if ip.is_unspecified() {
        Some("is the unspecified address")
    } else if ip.is_loopback() {
        Some("is a loopback address")
    } else if ip.is_multicast() {
        Some("is a multicast address")
    } else if ip == IpAddr::V4(Ipv4Addr::BROADCAST) {
        Some("is the broadcast address")
    } else {
        None
    }
}

fn valid_label(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Checks a Service name and object so nothing malformed reaches the kernel.
pub fn validate_service(name: &ServiceName, info: &ServiceInfo) -> Result<()> {
    let bad = |reason: String| Error::InvalidService {
        service: name.clone(),
        reason,
    };
    if !valid_label(&name.namespace, 63) {
        return Err(bad(format!("invalid namespace {:?}", name.namespace)));
    }
    if !valid_label(&name.name, 253) {
        return Err(bad(format!("invalid name {:?}", name.name)));
    }
    if info.cluster_ips.len() > 2
        || (info.cluster_ips.len() == 2
            && info.cluster_ips[0].is_ipv4() == info.cluster_ips[1].is_ipv4())
    {
        return Err(bad(format!(
            "clusterIPs {:?}: at most one address per family",
            info.cluster_ips
        )));
    }
    let vips = info
        .cluster_ips
        .iter()
        .map(|ip| ("clusterIP", ip))
        .chain(info.external_ips.iter().map(|ip| ("externalIP", ip)))
        .chain(
            info.load_balancer_ips
                .iter()
                .map(|ip| ("load balancer IP", ip)),
        );
    for (what, ip) in vips {
        if let Some(why) = unusable_vip(*ip) {
            return Err(bad(format!("{what} {ip} {why}")));
        }
    }
    let mut seen_names = HashSet::new();
    let mut seen_ports = HashSet::new();
    for p in &info.ports {
        let label = if p.name.is_empty() {
            format!("port {}", p.port)
        } else {
            format!("port {:?}", p.name)
        };
        if !p.name.is_empty() && !valid_label(&p.name, 63) {
            return Err(bad(format!("{label}: invalid port name")));
        }
        if p.port == 0 {
            return Err(bad(format!("{label}: port 0")));
        }
        if p.node_port == Some(0) {
            return Err(bad(format!("{label}: nodePort 0")));
        }
        if !seen_names.insert((p.name.as_str(), p.protocol)) {
            return Err(bad(format!(
                "{label}: duplicate port name for {}",
                p.protocol
            )));
        }
        if !seen_ports.insert((p.port, p.protocol)) {
            return Err(bad(format!(
                "{label}: duplicate {} port {}",
                p.protocol, p.port
            )));
        }
    }
    if let SessionAffinity::ClientIp { timeout_seconds } = info.session_affinity
        && !(1..=MAX_AFFINITY_TIMEOUT_SECONDS).contains(&timeout_seconds)
    {
        return Err(bad(format!(
            "session affinity timeout {timeout_seconds}s is outside 1..={MAX_AFFINITY_TIMEOUT_SECONDS}"
        )));
    }
    if info.health_check_node_port == Some(0) {
        return Err(bad("healthCheckNodePort 0".to_owned()));
    }
    Ok(())
}

/// Checks the endpoints of a Service.
pub fn validate_endpoints(name: &ServiceName, endpoints: &[Endpoint]) -> Result<()> {
    for ep in endpoints {
        let bad = |reason: String| Error::InvalidEndpoint {
            service: name.clone(),
            endpoint: ep.addr.to_string(),
            reason,
        };
        if let Some(why) = endpoint_address_problem(ep.addr) {
            return Err(bad(why.to_owned()));
        }
        if let Some(p) = ep.ports.iter().find(|p| p.port == 0) {
            return Err(bad(format!("port {:?} is 0", p.name)));
        }
    }
    Ok(())
}

/// Why an address cannot be an endpoint, if it cannot: not unicast, or loopback or link-local
/// (the EndpointSlice API rejects these too; from manifests they would let a Service reach into
/// the node itself).
#[must_use]
pub fn endpoint_address_problem(addr: IpAddr) -> Option<&'static str> {
    if addr.is_unspecified() || addr.is_multicast() {
        Some("not a unicast address")
    } else if addr.is_loopback() || is_link_local(addr) {
        Some("loopback and link-local addresses cannot be endpoints")
    } else {
        None
    }
}

/// Merges endpoints by address: slices of one Service may repeat an address (during a move
/// between slices); a ready copy wins over a not-ready one, and ports are united.
fn merge_endpoints(mut endpoints: Vec<Endpoint>) -> Vec<Endpoint> {
    // A stable sort keeps the caller's order among copies, so "first ready copy wins" is
    // deterministic. Merging in place avoids a second large allocation on every update.
    endpoints.sort_by_key(|e| (e.addr, !e.ready));
    endpoints.dedup_by(|later, kept| {
        if later.addr != kept.addr {
            return false;
        }
        if later.ports != kept.ports {
            let mut united = kept.ports.to_vec();
            for p in later.ports.iter() {
                if !united.contains(p) {
                    united.push(p.clone());
                }
            }
            kept.ports = united.into();
        }
        true
    });
    // Only a list that is not sorted already (slices from elsewhere than translation, a union
    // above) is copied to sort it.
    for ep in &mut endpoints {
        if !ep.ports.is_sorted() {
            let mut sorted = ep.ports.to_vec();
            sorted.sort();
            ep.ports = sorted.into();
        }
    }
    endpoints
}

/// Whether `endpoints` are merged already (what [`Inputs::set_endpoints`] makes of them): sorted
/// by address with one endpoint per address, each one's ports sorted. The watch hands them over
/// merged, so the store keeps the list it is given.
pub fn endpoints_merged(endpoints: &[Endpoint]) -> bool {
    endpoints.windows(2).all(|w| w[0].addr < w[1].addr)
        && endpoints.iter().all(|e| e.ports.is_sorted())
}

/// The engine's input store: every Service, its endpoints and the node, plus the set of
/// Services changed since the engine last took it.
#[derive(Debug, Clone)]
pub struct Inputs {
    node: NodeContext,
    // foldhash: these maps are on every sync's path and SipHash showed up in profiles; its
    // per-process random seed keeps keys from the API server from being chosen to collide.
    services: HashMap<ServiceName, ServiceInfo, RandomState>,
    /// Shared with the watch's copy when the Service has one EndpointSlice (most do): at
    /// 10,000 Services x 10 endpoints a second copy was 10 MiB of the agent's memory.
    endpoints: HashMap<ServiceName, Arc<[Endpoint]>, RandomState>,
    changed: HashSet<ServiceName, RandomState>,
    node_changed: bool,
    marks: MarkTable,
}

/// What changed since the last [`Inputs::take_changes`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services whose object or endpoints changed (including removed ones).
    pub services: Vec<ServiceName>,
    /// Whether the node context changed; then every Service must be recomputed.
    pub node: bool,
}

impl Inputs {
    /// An empty store for this node. Fails if the node context is unusable.
    pub fn new(node: NodeContext) -> Result<Self> {
        node.validate()?;
        Ok(Self {
            marks: MarkTable::new(node.options.local_marks),
            node,
            services: HashMap::default(),
            endpoints: HashMap::default(),
            changed: HashSet::default(),
            node_changed: true,
        })
    }

    /// The node context.
    pub fn node(&self) -> &NodeContext {
        &self.node
    }

    /// Replaces the node context (node IPs, zone, default scheduler, options). A real change
    /// marks every Service changed, since each may depend on it.
    pub fn set_node(&mut self, node: NodeContext) -> Result<()> {
        node.validate()?;
        if node != self.node {
            let space = node.options.local_marks;
            self.node = node;
            self.node_changed = true;
            if space != self.marks.space() {
                // Every Service's marks come from the new space.
                self.marks = MarkTable::new(space);
                let mut names: Vec<ServiceName> = self.services.keys().cloned().collect();
                names.sort_unstable();
                for name in names {
                    if let Some(info) = self.services.get_mut(&name) {
                        self.marks.assign(&name, info, &[]);
                    }
                }
            }
        }
        Ok(())
    }

    /// Adds or replaces a Service. Validates it first; an identical object is not a change, so
    /// a watch relist costs nothing downstream.
    pub fn upsert_service(&mut self, name: ServiceName, mut info: ServiceInfo) -> Result<()> {
        validate_service(&name, &info)?;
        // One lookup: the marks come from the stored object, then it is compared and replaced.
        match self.services.get_mut(&name) {
            Some(existing) => {
                self.marks.assign(&name, &mut info, &existing.local_marks);
                if *existing == info {
                    return Ok(());
                }
                *existing = info;
            }
            None => {
                self.marks.assign(&name, &mut info, &[]);
                self.services.insert(name.clone(), info);
            }
        }
        self.changed.insert(name);
        Ok(())
    }

    /// Removes a Service (its endpoints are kept until [`Inputs::set_endpoints`] clears them,
    /// since slices and Services are watched separately).
    pub fn remove_service(&mut self, name: &ServiceName) {
        if let Some(info) = self.services.remove(name) {
            self.marks.release(&info.local_marks);
            self.changed.insert(name.clone());
        }
    }

    /// The marks the kernel already maps ways in to (the short circuit's sets, read at start),
    /// preferred by the Service ports upserted after this call: a restarted agent, and
    /// `check`, assign the marks the running agent did (see [`crate::marks`]).
    pub fn set_mark_hints(&mut self, hints: HashMap<MarkHint, u32>) {
        self.marks.set_hints(hints);
    }

    /// How many Service ports needed a Local-policy short-circuit mark and got none because
    /// the mark space was full (see [`crate::marks`]), over this store's life.
    pub fn marks_short(&self) -> usize {
        self.marks.short()
    }

    /// Sets the merged endpoints of a Service (all its slices together). An empty list removes
    /// them. Validates first; duplicates by address are merged (a list merged already, see
    /// [`endpoints_merged`], is kept as it is, shared with the caller).
    pub fn set_endpoints(
        &mut self,
        name: ServiceName,
        endpoints: impl Into<Arc<[Endpoint]>>,
    ) -> Result<()> {
        let endpoints: Arc<[Endpoint]> = endpoints.into();
        validate_endpoints(&name, &endpoints)?;
        let merged = if endpoints_merged(&endpoints) {
            endpoints
        } else {
            merge_endpoints(endpoints.to_vec()).into()
        };
        // Replacing in place keeps the map's key, so the name is cloned only for a new Service.
        match self.endpoints.get_mut(&name) {
            Some(_) if merged.is_empty() => {
                self.endpoints.remove(&name);
            }
            Some(existing) if **existing == *merged => {
                // Nothing changed; holding the caller's list keeps one shared with the watch's
                // shared after the watch replaced its own with an equal one (a relist).
                *existing = merged;
                return Ok(());
            }
            Some(existing) => *existing = merged,
            None if merged.is_empty() => return Ok(()),
            None => {
                self.endpoints.insert(name.clone(), merged);
            }
        }
        self.changed.insert(name);
        Ok(())
    }

    /// A Service, if known.
    pub fn service(&self, name: &ServiceName) -> Option<&ServiceInfo> {
        self.services.get(name)
    }

    /// The merged endpoints of a Service (empty if none).
    pub fn endpoints(&self, name: &ServiceName) -> &[Endpoint] {
        self.endpoints.get(name).map_or(&[], |e| &e[..])
    }

    /// Every known Service name.
    pub fn service_names(&self) -> impl Iterator<Item = &ServiceName> {
        self.services.keys()
    }

    /// The number of known Services.
    pub fn len(&self) -> usize {
        self.services.len()
    }

    /// Whether no Service is known.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// Whether anything changed since the last [`Inputs::take_changes`].
    pub fn has_changes(&self) -> bool {
        self.node_changed || !self.changed.is_empty()
    }

    /// Takes the set of changes, leaving it empty.
    pub fn take_changes(&mut self) -> Changes {
        Changes {
            // `take` rather than `drain`: a drained set keeps its capacity, and after the
            // initial load that is every Service, which each later drain would walk.
            services: std::mem::take(&mut self.changed).into_iter().collect(),
            node: std::mem::replace(&mut self.node_changed, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> ServiceName {
        ServiceName::new("default", "web")
    }

    fn info() -> ServiceInfo {
        ServiceInfo {
            cluster_ips: vec!["10.96.0.10".parse().expect("literal")],
            ports: vec![ServicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: None,
            }],
            ..ServiceInfo::default()
        }
    }

    #[test]
    fn scheduler_parses_kernel_names_and_flags() {
        assert_eq!(
            "wrr".parse::<Scheduler>(),
            Ok(Scheduler::new(SchedulerKind::Wrr))
        );
        let mh: Scheduler = "mh:fallback,port".parse().expect("valid");
        assert_eq!(mh.kind(), SchedulerKind::Mh);
        assert!(mh.fallback() && mh.port());
        assert_eq!(mh.to_string(), "mh:fallback,port");
        let sh: Scheduler = "sh:port".parse().expect("valid");
        assert!(!sh.fallback() && sh.port());
    }

    #[test]
    fn scheduler_rejects_unknown_names_and_misplaced_flags() {
        let err = "roundrobin".parse::<Scheduler>().expect_err("unknown");
        assert!(err.to_string().contains("\"roundrobin\""), "{err}");
        let err = "rr:fallback".parse::<Scheduler>().expect_err("flag on rr");
        assert!(err.to_string().contains("only to sh and mh"), "{err}");
        let err = "sh:sticky".parse::<Scheduler>().expect_err("unknown flag");
        assert!(err.to_string().contains("\"sticky\""), "{err}");
    }

    #[test]
    fn cidr_parses_and_contains() {
        let c: Cidr = "10.1.2.3/8".parse().expect("valid");
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert!(c.contains("10.255.0.1".parse().expect("literal")));
        assert!(!c.contains("11.0.0.1".parse().expect("literal")));
        assert!(!c.contains("::a00:1".parse().expect("literal")));
        let all: Cidr = "::/0".parse().expect("valid");
        assert!(all.contains("fd00::1".parse().expect("literal")));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("ten/8".parse::<Cidr>().is_err());
    }

    #[test]
    fn upsert_validates_and_names_the_service() {
        let mut inputs = Inputs::new(NodeContext::new("n1")).expect("valid node");
        let mut bad = info();
        bad.ports[0].port = 0;
        let err = inputs.upsert_service(web(), bad).expect_err("port 0");
        assert!(
            err.to_string().starts_with("service default/web: "),
            "{err}"
        );

        let mut bad = info();
        bad.cluster_ips.push("10.96.0.11".parse().expect("literal"));
        assert!(
            inputs.upsert_service(web(), bad).is_err(),
            "two IPv4 clusterIPs"
        );

        let mut bad = info();
        bad.session_affinity = SessionAffinity::ClientIp {
            timeout_seconds: 86_401,
        };
        assert!(
            inputs.upsert_service(web(), bad).is_err(),
            "timeout over a day"
        );

        let mut bad = info();
        bad.external_ips.push("0.0.0.0".parse().expect("literal"));
        assert!(
            inputs.upsert_service(web(), bad).is_err(),
            "unspecified externalIP"
        );
        assert!(inputs.is_empty());
    }

    #[test]
    fn endpoints_in_loopback_or_link_local_are_rejected() {
        let mut inputs = Inputs::new(NodeContext::new("n1")).expect("valid node");
        for bad in ["127.0.0.1", "::1", "169.254.169.254", "fe80::1"] {
            let ep = Endpoint::ready(bad.parse().expect("literal"), vec![]);
            let err = inputs.set_endpoints(web(), vec![ep]).expect_err(bad);
            assert!(
                err.to_string()
                    .starts_with(&format!("service default/web: endpoint {bad}: ")),
                "{err}"
            );
        }
        let mut bad = info();
        bad.cluster_ips = vec!["127.0.0.1".parse().expect("literal")];
        assert!(
            inputs.upsert_service(web(), bad).is_err(),
            "loopback ClusterIP"
        );
    }

    #[test]
    fn changes_are_recorded_once_and_identical_upserts_are_not_changes() {
        let mut inputs = Inputs::new(NodeContext::new("n1")).expect("valid node");
        assert!(
            inputs.take_changes().node,
            "a new store starts with a node change"
        );
        inputs.upsert_service(web(), info()).expect("valid");
        let ch = inputs.take_changes();
        assert_eq!(ch.services, vec![web()]);
        inputs.upsert_service(web(), info()).expect("valid");
        assert!(!inputs.has_changes(), "an identical upsert is not a change");
        let ep = Endpoint::ready(
            "10.0.0.1".parse().expect("literal"),
            vec![EndpointPort {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Tcp,
            }],
        );
        inputs
            .set_endpoints(web(), vec![ep.clone()])
            .expect("valid");
        assert!(inputs.take_changes().services.contains(&web()));
        inputs.set_endpoints(web(), vec![ep]).expect("valid");
        assert!(!inputs.has_changes());
        inputs.remove_service(&web());
        assert!(inputs.take_changes().services.contains(&web()));
    }

    #[test]
    fn duplicate_endpoints_merge_and_ready_copy_wins() {
        let addr: IpAddr = "10.0.0.1".parse().expect("literal");
        let port = |n: &str, p| EndpointPort {
            name: n.into(),
            port: p,
            protocol: Protocol::Tcp,
        };
        let mut not_ready = Endpoint::ready(addr, vec![port("a", 1)]);
        not_ready.ready = false;
        let ready = Endpoint::ready(addr, vec![port("b", 2)]);
        let merged = merge_endpoints(vec![not_ready, ready]);
        assert_eq!(merged.len(), 1);
        assert!(merged[0].ready);
        assert_eq!(*merged[0].ports, [port("a", 1), port("b", 2)]);
    }
}
