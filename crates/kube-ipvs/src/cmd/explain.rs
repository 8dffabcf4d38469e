//! `kube-ipvs explain IP:PORT[/PROTO]`: which Service port an address is, every endpoint of
//! that Service (all slices merged) with its conditions, and why each is or is not a real
//! server on this node.
//!
//! **The verdict and the reason are the engine's**: whether an endpoint is a real server is
//! read from [`service_table`], the same function the daemon programs the kernel from, and why
//! from [`endpoint_decisions`], which runs the same selection. This module adds the details a
//! reason names (the endpoint's node, zone and hints, this node's zone, the policy's field) and
//! words it; it holds no rules of its own. Where the two can differ (the engine builds no
//! virtual server for the address, or another port of the Service holds the same one) the
//! reason says so instead of guessing. This module never touches the kernel.

use std::fmt;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use kube_ipvs_diff::desired::dest_keys;
use kube_ipvs_diff::{
    DestKey, Endpoint, EndpointDecision, EndpointReason, Engine, Inputs, NodeContext, Protocol,
    ServiceInfo, ServiceKind, ServiceName, ServicePort, SessionAffinity, TrafficDistribution,
    TrafficPolicy, UnknownCounts, VirtualKey, endpoint_decisions, service_table,
};

use crate::cmd::source::SourceArgs;
use kube_ipvs_watch::Skipped;

/// The options of `kube-ipvs explain`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Explain which Service an IP:PORT[/PROTO] is and why each endpoint is or is not a real server here"
)]
pub struct ExplainArgs {
    /// The virtual address: `10.96.0.10:80`, `[fd00::10]:53/udp`; the protocol defaults to tcp.
    #[arg(value_name = "IP:PORT[/PROTO]")]
    pub target: String,
    /// Where the desired state comes from, and this node.
    #[command(flatten)]
    pub source: SourceArgs,
}

/// A parsed `IP:PORT[/PROTO]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// The address.
    pub addr: IpAddr,
    /// The port.
    pub port: u16,
    /// The protocol.
    pub protocol: Protocol,
}

impl FromStr for Target {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (hostport, proto) = match s.rsplit_once('/') {
            Some((hp, p)) => (hp, p),
            None => (s, "tcp"),
        };
        let protocol = match proto.to_ascii_lowercase().as_str() {
            "tcp" => Protocol::Tcp,
            "udp" => Protocol::Udp,
            "sctp" => Protocol::Sctp,
            other => {
                return Err(format!(
                    "{s:?}: unknown protocol {other:?} (tcp, udp or sctp)"
                ));
            }
        };
        let sa: SocketAddr = hostport.parse().map_err(|_| {
            format!("{s:?}: expected IP:PORT[/PROTO], IPv6 in brackets ([fd00::1]:80)")
        })?;
        if sa.port() == 0 {
            return Err(format!("{s:?}: port 0"));
        }
        Ok(Target {
            addr: sa.ip(),
            port: sa.port(),
            protocol,
        })
    }
}

/// How a Service is reached at the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// One of its ClusterIPs.
    ClusterIp,
    /// One of its externalIPs.
    ExternalIp,
    /// One of its LoadBalancer ingress IPs.
    LoadBalancerIp,
    /// A node IP and the port's nodePort.
    NodePort,
}

impl Via {
    /// The policy that picks endpoints for this kind of address.
    fn policy(self, info: &ServiceInfo) -> (&'static str, TrafficPolicy) {
        match self {
            Via::ClusterIp => ("internalTrafficPolicy", info.internal_traffic_policy),
            _ => ("externalTrafficPolicy", info.external_traffic_policy),
        }
    }
}

impl fmt::Display for Via {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Via::ClusterIp => "ClusterIP",
            Via::ExternalIp => "externalIP",
            Via::LoadBalancerIp => "LoadBalancer IP",
            Via::NodePort => "NodePort on a node IP",
        })
    }
}

/// Why an endpoint is or is not a real server: the engine's [`EndpointReason`] with the
/// details it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// Ready, and every filter passed.
    Ready,
    /// Serving and terminating, used because no endpoint is ready (KEP-1669).
    TerminatingFallback,
    /// It has no port with the Service port's name and protocol.
    NoMatchingPort,
    /// Its address family differs from the virtual address's.
    OtherFamily,
    /// Not ready, and not serving-and-terminating.
    NotReady,
    /// Terminating and no longer serving.
    TerminatingNotServing,
    /// Serving and terminating, but ready endpoints exist, so it is not used.
    TerminatingWhileReady,
    /// On another node (or none) while the policy is Local.
    OtherNodeUnderLocal {
        /// The policy's field name.
        policy: &'static str,
        /// The endpoint's node.
        node: Option<String>,
    },
    /// Topology hints name other zones than this node's.
    ZoneHints {
        /// The hinted zones.
        hints: Vec<String>,
        /// This node's zone.
        ours: Option<String>,
    },
    /// Topology hints name other nodes.
    NodeHints {
        /// The hinted nodes.
        hints: Vec<String>,
    },
    /// `trafficDistribution` prefers this node's zone and the endpoint is elsewhere.
    OtherZoneByDistribution {
        /// The endpoint's zone.
        zone: Option<String>,
        /// This node's zone.
        ours: Option<String>,
    },
    /// `trafficDistribution: PreferSameNode` and the endpoint is on another node.
    OtherNodeByDistribution {
        /// The endpoint's node.
        node: Option<String>,
    },
    /// The virtual server the engine built and its decision for this port disagree: it builds
    /// none for the address (an ExternalName Service, or a family the Service has no ClusterIP
    /// in), or another port of the Service asked for the same one first. Shown rather than
    /// guessed.
    Unexplained {
        /// Whether the engine made it a real server.
        real_server: bool,
    },
}

impl Reason {
    /// The engine's reason with what it refers to: the endpoint's node, zone or hints, this
    /// node's zone, and the name of the `policy` field in force.
    fn from_engine(
        reason: EndpointReason,
        e: &Endpoint,
        node: &NodeContext,
        policy: &'static str,
    ) -> Reason {
        let node_name = || e.node_name.as_deref().map(str::to_owned);
        match reason {
            EndpointReason::Ready => Reason::Ready,
            EndpointReason::TerminatingFallback => Reason::TerminatingFallback,
            EndpointReason::NoMatchingPort => Reason::NoMatchingPort,
            EndpointReason::OtherFamily => Reason::OtherFamily,
            EndpointReason::NotReady => Reason::NotReady,
            EndpointReason::TerminatingNotServing => Reason::TerminatingNotServing,
            EndpointReason::TerminatingWhileReady => Reason::TerminatingWhileReady,
            EndpointReason::OtherNodeUnderLocal => Reason::OtherNodeUnderLocal {
                policy,
                node: node_name(),
            },
            EndpointReason::NodeHints => Reason::NodeHints {
                hints: e.hints_for_nodes.to_vec(),
            },
            EndpointReason::ZoneHints => Reason::ZoneHints {
                hints: e.hints_for_zones.to_vec(),
                ours: node.zone.clone(),
            },
            EndpointReason::OtherNodeByDistribution => {
                Reason::OtherNodeByDistribution { node: node_name() }
            }
            EndpointReason::OtherZoneByDistribution => Reason::OtherZoneByDistribution {
                zone: e.zone.as_deref().map(str::to_owned),
                ours: node.zone.clone(),
            },
        }
    }
}

fn opt<S: std::ops::Deref<Target = str>>(s: &Option<S>) -> &str {
    s.as_deref().unwrap_or("(none)")
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Ready => f.write_str("ready"),
            Reason::TerminatingFallback => {
                f.write_str("serving and terminating; used because no endpoint is ready")
            }
            Reason::NoMatchingPort => f.write_str("it has no port of this name and protocol"),
            Reason::OtherFamily => {
                f.write_str("its address family differs from the virtual address's")
            }
            Reason::NotReady => f.write_str("not ready"),
            Reason::TerminatingNotServing => f.write_str("terminating and no longer serving"),
            Reason::TerminatingWhileReady => f.write_str(
                "serving but terminating; terminating endpoints are used only when none is ready",
            ),
            Reason::OtherNodeUnderLocal { policy, node } => write!(
                f,
                "on node {}, not this node, and {policy} is Local",
                opt(node)
            ),
            Reason::ZoneHints { hints, ours } => write!(
                f,
                "topology hints for zone(s) {}, this node is in zone {}",
                hints.join(","),
                opt(ours)
            ),
            Reason::NodeHints { hints } => {
                write!(
                    f,
                    "topology hints for node(s) {}, not this node",
                    hints.join(",")
                )
            }
            Reason::OtherZoneByDistribution { zone, ours } => write!(
                f,
                "trafficDistribution prefers this node's zone {}; the endpoint is in zone {}",
                opt(ours),
                opt(zone)
            ),
            Reason::OtherNodeByDistribution { node } => write!(
                f,
                "trafficDistribution PreferSameNode; the endpoint is on node {}",
                opt(node)
            ),
            Reason::Unexplained { real_server: true } => {
                f.write_str("a real server, for a reason these rules do not name")
            }
            Reason::Unexplained { real_server: false } => {
                f.write_str("left out, for a reason these rules do not name")
            }
        }
    }
}

/// One endpoint's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Its port for this Service port, if it has one.
    pub target_port: Option<u16>,
    /// Whether the engine made it a real server of the virtual server.
    pub real_server: bool,
    /// Why.
    pub reason: Reason,
}

/// One Service port the target matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// The Service.
    pub service: ServiceName,
    /// Its object.
    pub info: ServiceInfo,
    /// The port.
    pub port: ServicePort,
    /// How the target reaches it.
    pub via: Via,
    /// The virtual server the engine builds for it (`None` if it builds none, e.g. an
    /// externalIP of a family the Service has no ClusterIP in).
    pub server: Option<kube_ipvs_diff::VirtualServer>,
    /// Every endpoint of the Service with its verdict.
    pub endpoints: Vec<Verdict>,
    /// The Service that holds this virtual server when another one asked for it first (the
    /// engine's conflict rule); the verdicts are then what this Service would get.
    pub taken_by: Option<ServiceName>,
}

/// Finds every Service port the target is, with each endpoint's verdict.
pub fn explain(inputs: &Inputs, target: &Target) -> Vec<Match> {
    let node = inputs.node();
    let node_ips: Vec<IpAddr> = node.node_ips().collect();
    // The engine decides contested virtual servers; run it on a copy to learn its owners.
    let mut engine = Engine::new();
    let _ = engine.sync(&mut inputs.clone(), Duration::ZERO, &UnknownCounts);
    let conflicts = engine.conflicts();
    let mut names: Vec<&ServiceName> = inputs.service_names().collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let Some(info) = inputs.service(name) else {
            continue;
        };
        for port in info.ports.iter().filter(|p| p.protocol == target.protocol) {
            let via = if port.port == target.port && info.cluster_ips.contains(&target.addr) {
                Via::ClusterIp
            } else if port.port == target.port && info.external_ips.contains(&target.addr) {
                Via::ExternalIp
            } else if port.port == target.port && info.load_balancer_ips.contains(&target.addr) {
                Via::LoadBalancerIp
            } else if port.node_port == Some(target.port) && node_ips.contains(&target.addr) {
                Via::NodePort
            } else {
                continue;
            };
            let endpoints = inputs.endpoints(name);
            let table = service_table(Some(info), endpoints, node);
            let key = VirtualKey::inet(target.protocol, target.addr, target.port);
            let server = table
                .servers
                .iter()
                .find(|(s, _)| s.key == key)
                .map(|(s, _)| *s);
            let chosen: Vec<DestKey> = dest_keys(&table, &key);
            let (policy_name, policy) = via.policy(info);
            let decisions = endpoint_decisions(info, port, policy, target.addr, endpoints, node);
            let verdicts = endpoints
                .iter()
                .zip(decisions)
                .map(|(e, d)| verdict(e, d, node, policy_name, &chosen))
                .collect();
            let taken_by = conflicts
                .iter()
                .find(|c| c.key == key && c.owner != *name)
                .map(|c| c.owner.clone());
            out.push(Match {
                taken_by,
                service: name.clone(),
                info: info.clone(),
                port: port.clone(),
                via,
                server,
                endpoints: verdicts,
            });
        }
    }
    out
}

/// One endpoint's verdict: whether the virtual server the engine built has it as a real
/// server, and the engine's reason, which agree unless that virtual server is not this port's.
fn verdict(
    e: &Endpoint,
    decision: EndpointDecision,
    node: &NodeContext,
    policy: &'static str,
    chosen: &[DestKey],
) -> Verdict {
    let real_server = decision.target_port.is_some_and(|p| {
        chosen.contains(&DestKey {
            addr: e.addr,
            port: p,
        })
    });
    let reason = if real_server == decision.real_server {
        Reason::from_engine(decision.reason, e, node, policy)
    } else {
        Reason::Unexplained { real_server }
    };
    Verdict {
        endpoint: e.clone(),
        target_port: decision.target_port,
        real_server,
        reason,
    }
}

fn policy_name(p: TrafficPolicy) -> &'static str {
    match p {
        TrafficPolicy::Cluster => "Cluster",
        TrafficPolicy::Local => "Local",
    }
}

/// The explanation as text.
pub fn render(target: &Target, matches: &[Match], node: &NodeContext) -> String {
    let mut out = String::new();
    let key = VirtualKey::inet(target.protocol, target.addr, target.port);
    if matches.is_empty() {
        out.push_str(&format!(
            "{key}: no Service port has this address (ClusterIP, externalIP, LoadBalancer IP, or node IP with a nodePort)\n"
        ));
        return out;
    }
    out.push_str(&format!(
        "node {} (zone {})\n",
        node.node_name,
        opt(&node.zone)
    ));
    for m in matches {
        let port_name = if m.port.name.is_empty() {
            "(unnamed)".to_owned()
        } else {
            m.port.name.clone()
        };
        let node_port = m
            .port
            .node_port
            .map(|p| format!(", nodePort {p}"))
            .unwrap_or_default();
        out.push_str(&format!(
            "{key} is Service {} port {port_name} ({} {}{node_port}) via {}\n",
            m.service, m.port.protocol, m.port.port, m.via
        ));
        let kind = match m.info.kind {
            ServiceKind::ClusterIp => "ClusterIP",
            ServiceKind::NodePort => "NodePort",
            ServiceKind::LoadBalancer => "LoadBalancer",
            ServiceKind::ExternalName => "ExternalName",
        };
        let affinity = match m.info.session_affinity {
            SessionAffinity::None => "None".to_owned(),
            SessionAffinity::ClientIp { timeout_seconds } => format!("ClientIP {timeout_seconds}s"),
        };
        out.push_str(&format!(
            "  type {kind}, internalTrafficPolicy {}, externalTrafficPolicy {}, sessionAffinity {affinity}\n",
            policy_name(m.info.internal_traffic_policy),
            policy_name(m.info.external_traffic_policy),
        ));
        if let Some(td) = &m.info.traffic_distribution {
            let td = match td {
                TrafficDistribution::PreferClose => "PreferClose",
                TrafficDistribution::PreferSameZone => "PreferSameZone",
                TrafficDistribution::PreferSameNode => "PreferSameNode",
                TrafficDistribution::Other(s) => s.as_str(),
            };
            out.push_str(&format!("  trafficDistribution {td}\n"));
        }
        let real = m.endpoints.iter().filter(|v| v.real_server).count();
        match &m.server {
            Some(s) => out.push_str(&format!(
                "  virtual server {s} with {real} real server{}\n",
                if real == 1 { "" } else { "s" }
            )),
            None => out.push_str("  no virtual server: the engine builds none for this address\n"),
        }
        if let Some(owner) = &m.taken_by {
            out.push_str(&format!(
                "  contested: {owner} asked for this virtual server first and holds it; \
                 {} gets it only when {owner} lets go (below is what it would get)\n",
                m.service
            ));
        }
        if m.endpoints.is_empty() {
            out.push_str("  no endpoints (no EndpointSlice lists any)\n");
        }
        for v in &m.endpoints {
            let e = &v.endpoint;
            let addr = match (e.addr, v.target_port) {
                (a, Some(p)) => DestKey { addr: a, port: p }.to_string(),
                (a, None) => a.to_string(),
            };
            let mut line = format!(
                "  {addr} ready={} serving={} terminating={} node={} zone={}",
                e.ready,
                e.serving,
                e.terminating,
                opt(&e.node_name),
                opt(&e.zone)
            );
            if !e.hints_for_zones.is_empty() {
                line.push_str(&format!(" hints.forZones={}", e.hints_for_zones.join(",")));
            }
            if !e.hints_for_nodes.is_empty() {
                line.push_str(&format!(" hints.forNodes={}", e.hints_for_nodes.join(",")));
            }
            out.push_str(&line);
            out.push('\n');
            let verdict = if v.real_server {
                "real server"
            } else {
                "not a real server"
            };
            out.push_str(&format!("    -> {verdict}: {}\n", v.reason));
        }
    }
    out
}

/// The objects translation left out that bear on the target: the EndpointSlices of a matched
/// Service (whole or some endpoints), and Services whose written addresses include the
/// target's. Empty when there are none.
pub fn render_skipped(target: &Target, matches: &[Match], skipped: &[Skipped]) -> String {
    let addr = target.addr.to_string();
    let related = skipped.iter().filter(|s| match s.kind {
        "EndpointSlice" => s
            .service
            .as_ref()
            .is_some_and(|svc| matches.iter().any(|m| &m.service == svc)),
        "Service" => {
            s.addresses.iter().any(|a| a.trim() == addr)
                || s.service
                    .as_ref()
                    .is_some_and(|svc| matches.iter().any(|m| &m.service == svc))
        }
        _ => false,
    });
    let mut out = String::new();
    for s in related {
        if out.is_empty() {
            out.push_str("left out by translation, which may be why:\n");
        }
        for m in &s.messages {
            out.push_str(&format!("  {m}\n"));
        }
    }
    out
}

/// Runs `kube-ipvs explain`: 0 when the target is a Service port, 1 when it is none, 2 on error.
pub fn main(args: &ExplainArgs) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("kube-ipvs explain: {msg}");
        ExitCode::from(2)
    };
    let target: Target = match args.target.parse() {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    // The node's addresses, when the kernel can be read, so the NodePort addresses are those
    // the agent chooses; without them, the Node's InternalIPs.
    let mut kernel = crate::kernel::RealKernel::open(kube_ipvs_netlink::link::DEFAULT_DUMMY)
        .map(|k| k.binding(crate::kernel::Binding::Either));
    let desired = match args.source.load_beside(&mut kernel) {
        Ok(v) => v,
        Err(e) => return fail(e.to_string()),
    };
    desired.report("kube-ipvs explain");
    let inputs = &desired.inputs;
    let matches = explain(inputs, &target);
    let mut text = render(&target, &matches, inputs.node());
    text.push_str(&render_skipped(&target, &matches, &desired.skipped));
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    if matches.is_empty() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_ipvs_diff::EndpointPort;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    fn http() -> Vec<EndpointPort> {
        vec![EndpointPort {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Tcp,
        }]
    }

    fn ep(addr: &str, node: &str) -> Endpoint {
        let mut e = Endpoint::ready(ip(addr), http());
        e.node_name = Some(node.into());
        e
    }

    fn service() -> ServiceInfo {
        ServiceInfo {
            kind: ServiceKind::NodePort,
            cluster_ips: vec![ip("10.96.0.10")],
            ports: vec![ServicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: Some(30080),
            }],
            ..ServiceInfo::default()
        }
    }

    fn inputs(info: ServiceInfo, endpoints: Vec<Endpoint>) -> Inputs {
        let mut node = NodeContext::new("node-1");
        node.zone = Some("zone-a".into());
        node.node_ips_v4 = vec!["192.168.56.10".parse().expect("literal")];
        let mut i = Inputs::new(node).expect("valid node");
        let name = ServiceName::new("default", "web");
        i.upsert_service(name.clone(), info).expect("valid");
        i.set_endpoints(name, endpoints).expect("valid");
        i
    }

    /// The verdicts for the ClusterIP, by endpoint address.
    fn verdicts(inputs: &Inputs, target: &str) -> Vec<(String, bool, Reason)> {
        let target: Target = target.parse().expect("valid target");
        let m = explain(inputs, &target);
        assert_eq!(m.len(), 1, "one Service port matches {target:?}");
        m[0].endpoints
            .iter()
            .map(|v| (v.endpoint.addr.to_string(), v.real_server, v.reason.clone()))
            .collect()
    }

    #[test]
    fn targets_parse_with_default_protocol_and_ipv6_brackets() {
        let t: Target = "10.96.0.10:80".parse().expect("valid");
        assert_eq!((t.port, t.protocol), (80, Protocol::Tcp));
        let t: Target = "[fd00::10]:53/UDP".parse().expect("valid");
        assert_eq!((t.addr, t.protocol), (ip("fd00::10"), Protocol::Udp));
        assert!("10.96.0.10".parse::<Target>().is_err());
        assert!("10.96.0.10:80/icmp".parse::<Target>().is_err());
        assert!("fd00::10:80".parse::<Target>().is_err());
    }

    #[test]
    fn readiness_reasons() {
        let mut not_ready = ep("10.244.2.1", "node-2");
        not_ready.ready = false;
        not_ready.serving = false;
        let mut terminating = ep("10.244.3.1", "node-3");
        terminating.ready = false;
        terminating.terminating = true;
        let mut gone = ep("10.244.4.1", "node-4");
        gone.ready = false;
        gone.serving = false;
        gone.terminating = true;
        let mut other_port = ep("10.244.5.1", "node-5");
        let mut ports = other_port.ports.to_vec();
        ports[0].name = "metrics".into();
        other_port.ports = ports.into();
        let i = inputs(
            service(),
            vec![
                ep("10.244.1.1", "node-2"),
                not_ready,
                terminating.clone(),
                gone,
                other_port,
            ],
        );
        assert_eq!(
            verdicts(&i, "10.96.0.10:80"),
            vec![
                ("10.244.1.1".into(), true, Reason::Ready),
                ("10.244.2.1".into(), false, Reason::NotReady),
                ("10.244.3.1".into(), false, Reason::TerminatingWhileReady),
                ("10.244.4.1".into(), false, Reason::TerminatingNotServing),
                ("10.244.5.1".into(), false, Reason::NoMatchingPort),
            ]
        );
        // With nothing ready, the serving-terminating endpoint is used.
        let i = inputs(service(), vec![terminating]);
        assert_eq!(
            verdicts(&i, "10.96.0.10:80"),
            vec![("10.244.3.1".into(), true, Reason::TerminatingFallback)]
        );
    }

    #[test]
    fn local_policy_reason_applies_to_the_nodeport_only() {
        let mut info = service();
        info.external_traffic_policy = TrafficPolicy::Local;
        let i = inputs(
            info,
            vec![ep("10.244.1.1", "node-1"), ep("10.244.2.1", "node-2")],
        );
        assert_eq!(
            verdicts(&i, "192.168.56.10:30080"),
            vec![
                ("10.244.1.1".into(), true, Reason::Ready),
                (
                    "10.244.2.1".into(),
                    false,
                    Reason::OtherNodeUnderLocal {
                        policy: "externalTrafficPolicy",
                        node: Some("node-2".into())
                    }
                ),
            ]
        );
        assert!(
            verdicts(&i, "10.96.0.10:80")
                .iter()
                .all(|(_, real, _)| *real),
            "the ClusterIP follows internalTrafficPolicy (Cluster)"
        );
    }

    #[test]
    fn topology_reasons() {
        let mut a = ep("10.244.1.1", "node-1");
        a.hints_for_zones = vec!["zone-a".into()].into();
        let mut b = ep("10.244.2.1", "node-2");
        b.hints_for_zones = vec!["zone-b".into()].into();
        let i = inputs(service(), vec![a.clone(), b]);
        assert_eq!(
            verdicts(&i, "10.96.0.10:80")[1],
            (
                "10.244.2.1".into(),
                false,
                Reason::ZoneHints {
                    hints: vec!["zone-b".into()],
                    ours: Some("zone-a".into())
                }
            )
        );

        let mut a = ep("10.244.1.1", "node-1");
        a.hints_for_nodes = vec!["node-1".into()].into();
        let mut b = ep("10.244.2.1", "node-2");
        b.hints_for_nodes = vec!["node-2".into()].into();
        let i = inputs(service(), vec![a, b]);
        assert_eq!(
            verdicts(&i, "10.96.0.10:80")[1].2,
            Reason::NodeHints {
                hints: vec!["node-2".into()]
            }
        );

        let mut info = service();
        info.traffic_distribution = Some(TrafficDistribution::PreferClose);
        let mut a = ep("10.244.1.1", "node-1");
        a.zone = Some("zone-a".into());
        let mut b = ep("10.244.2.1", "node-2");
        b.zone = Some("zone-b".into());
        let i = inputs(info, vec![a.clone(), b.clone()]);
        assert_eq!(
            verdicts(&i, "10.96.0.10:80")[1],
            (
                "10.244.2.1".into(),
                false,
                Reason::OtherZoneByDistribution {
                    zone: Some("zone-b".into()),
                    ours: Some("zone-a".into())
                }
            )
        );

        let mut info = service();
        info.traffic_distribution = Some(TrafficDistribution::PreferSameNode);
        let i = inputs(info, vec![a, b]);
        assert_eq!(
            verdicts(&i, "10.96.0.10:80")[1].2,
            Reason::OtherNodeByDistribution {
                node: Some("node-2".into())
            }
        );
    }

    #[test]
    fn a_contested_virtual_server_names_its_holder() {
        let mut i = inputs(service(), vec![ep("10.244.1.1", "node-1")]);
        let mut web = service();
        web.external_ips = vec![ip("203.0.113.5")];
        i.upsert_service(ServiceName::new("default", "web"), web)
            .expect("valid");
        let mut other = service();
        other.cluster_ips = vec![ip("10.96.0.11")];
        other.external_ips = vec![ip("203.0.113.5")];
        i.upsert_service(ServiceName::new("shop", "front"), other)
            .expect("valid");
        let target: Target = "203.0.113.5:80".parse().expect("valid");
        let m = explain(&i, &target);
        assert_eq!(m.len(), 2);
        let holders: Vec<Option<String>> = m
            .iter()
            .map(|m| m.taken_by.as_ref().map(ToString::to_string))
            .collect();
        // Exactly one of them holds it, and the other is told who.
        assert!(
            holders == [None, Some("default/web".to_owned())]
                || holders == [Some("shop/front".to_owned()), None],
            "{holders:?}"
        );
        assert!(render(&target, &m, i.node()).contains("contested: "));
    }

    #[test]
    fn an_address_without_a_virtual_server_says_so_instead_of_guessing() {
        // An IPv6 externalIP of an IPv4-only Service gets no virtual server (rule 6), so even
        // the endpoint the engine's selection would take is not a real server.
        let mut info = service();
        info.external_ips = vec![ip("fd00:99::1")];
        let v6 = Endpoint::ready(ip("fd00:244::1"), http());
        let i = inputs(info, vec![ep("10.244.1.1", "node-1"), v6]);
        let target: Target = "[fd00:99::1]:80".parse().expect("valid");
        let m = explain(&i, &target);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].server, None);
        assert_eq!(
            verdicts(&i, "[fd00:99::1]:80"),
            vec![
                ("10.244.1.1".into(), false, Reason::OtherFamily),
                (
                    "fd00:244::1".into(),
                    false,
                    Reason::Unexplained { real_server: false }
                ),
            ]
        );
    }

    #[test]
    fn other_family_and_no_match() {
        let mut info = service();
        info.cluster_ips.push(ip("fd00::10"));
        let v6 = Endpoint::ready(ip("fd00:244::1"), http());
        let i = inputs(info, vec![ep("10.244.1.1", "node-2"), v6]);
        assert_eq!(
            verdicts(&i, "10.96.0.10:80")[1],
            ("fd00:244::1".into(), false, Reason::OtherFamily)
        );
        assert!(
            verdicts(&i, "[fd00::10]:80")[1].1,
            "the IPv6 endpoint backs the IPv6 ClusterIP"
        );
        let target: Target = "10.96.0.10:81".parse().expect("valid");
        assert!(explain(&i, &target).is_empty());
        let target: Target = "10.96.0.10:80/udp".parse().expect("valid");
        assert!(explain(&i, &target).is_empty());
        assert!(render(&target, &[], i.node()).contains("no Service port has this address"));
    }
}
