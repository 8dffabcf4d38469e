//! Table tests of `endpoint_decisions`: every reason it gives is reached by some case, each
//! case names the rule of `desired.rs` it exercises, and every case also checks that the
//! endpoints it calls real servers are exactly the ones `service_table` programs.

mod common;

use std::collections::BTreeSet;

use common::{ep, ip, node, on_node, svc, terminating};
use kube_ipvs_diff::desired::dest_keys;
use kube_ipvs_diff::{
    DestKey, Endpoint, EndpointDecision, EndpointPort, EndpointReason, Protocol, ServiceInfo,
    TrafficDistribution, TrafficPolicy, VirtualKey, endpoint_decisions, service_table,
};

use EndpointReason::*;

/// The decisions for the ClusterIP `vip` port 80 of `s` under `policy` (set as the Service's
/// internalTrafficPolicy), after checking them against `service_table` for that virtual
/// server.
fn at_cluster_ip(
    mut s: ServiceInfo,
    policy: TrafficPolicy,
    vip: &str,
    eps: &[Endpoint],
) -> Vec<EndpointDecision> {
    s.internal_traffic_policy = policy;
    let vip = ip(vip);
    assert!(s.cluster_ips.contains(&vip), "{vip} is a ClusterIP");
    let d = endpoint_decisions(&s, &s.ports[0], policy, vip, eps, &node());
    agrees_with_table(&s, &d, eps, VirtualKey::inet(Protocol::Tcp, vip, 80));
    d
}

/// The decisions mark as real servers what `service_table` programs for `key`, and
/// `real_server` is what the reason says.
fn agrees_with_table(s: &ServiceInfo, d: &[EndpointDecision], eps: &[Endpoint], key: VirtualKey) {
    assert_eq!(d.len(), eps.len(), "one decision per endpoint");
    for x in d {
        assert_eq!(x.real_server, x.reason.is_real_server(), "{x:?}");
    }
    let decided: BTreeSet<DestKey> = d
        .iter()
        .zip(eps)
        .filter(|(x, _)| x.real_server)
        .map(|(x, e)| DestKey {
            addr: e.addr,
            port: x.target_port.expect("a real server has a port"),
        })
        .collect();
    let table = service_table(Some(s), eps, &node());
    let programmed: BTreeSet<DestKey> = dest_keys(&table, &key).into_iter().collect();
    assert_eq!(decided, programmed, "decisions and service_table for {key}");
}

fn reasons(d: &[EndpointDecision]) -> Vec<EndpointReason> {
    d.iter().map(|x| x.reason).collect()
}

fn in_zone(mut e: Endpoint, zone: &str) -> Endpoint {
    e.zone = Some(zone.into());
    e
}

fn with_zone_hints(mut e: Endpoint, zones: &[&str]) -> Endpoint {
    e.hints_for_zones = zones.iter().map(|z| (*z).to_owned()).collect();
    e
}

fn with_node_hints(mut e: Endpoint, nodes: &[&str]) -> Endpoint {
    e.hints_for_nodes = nodes.iter().map(|n| (*n).to_owned()).collect();
    e
}

fn not_ready(mut e: Endpoint, serving: bool) -> Endpoint {
    e.ready = false;
    e.serving = serving;
    e
}

/// Rules 2 and 10: readiness and the port, with a ready endpoint present.
#[test]
fn conditions_and_ports() {
    let mut metrics = ep("10.1.0.6");
    metrics.ports = vec![EndpointPort {
        name: "metrics".into(),
        port: 9090,
        protocol: Protocol::Tcp,
    }]
    .into();
    let mut udp = ep("10.1.0.7");
    udp.ports = vec![EndpointPort {
        name: "http".into(),
        port: 8080,
        protocol: Protocol::Udp,
    }]
    .into();
    let eps = [
        ep("10.1.0.1"),
        not_ready(ep("10.1.0.2"), false),
        // Serving without terminating is not the fallback: only terminating endpoints are.
        not_ready(ep("10.1.0.3"), true),
        terminating(ep("10.1.0.4"), true),
        terminating(ep("10.1.0.5"), false),
        metrics,
        udp,
    ];
    let d = at_cluster_ip(
        svc("10.96.0.10"),
        TrafficPolicy::Cluster,
        "10.96.0.10",
        &eps,
    );
    assert_eq!(
        reasons(&d),
        [
            Ready,
            NotReady,
            NotReady,
            TerminatingWhileReady,
            TerminatingNotServing,
            NoMatchingPort,
            NoMatchingPort
        ]
    );
    let ports: Vec<Option<u16>> = d.iter().map(|x| x.target_port).collect();
    assert_eq!(ports[..5], [Some(8080); 5]);
    assert_eq!(ports[5..], [None, None]);
}

/// Rule 2: with no ready endpoint, serving-and-terminating ones are used (KEP-1669).
#[test]
fn terminating_fallback_when_none_is_ready() {
    let eps = [
        terminating(ep("10.1.0.1"), true),
        terminating(ep("10.1.0.2"), false),
        not_ready(ep("10.1.0.3"), false),
    ];
    let d = at_cluster_ip(
        svc("10.96.0.10"),
        TrafficPolicy::Cluster,
        "10.96.0.10",
        &eps,
    );
    assert_eq!(
        reasons(&d),
        [TerminatingFallback, TerminatingNotServing, NotReady]
    );
}

/// Rule 6: an endpoint backs only virtual servers of its own family.
#[test]
fn other_family() {
    let mut s = svc("10.96.0.10");
    s.cluster_ips.push(ip("fd00:96::10"));
    let eps = [ep("10.1.0.1"), ep("fd00:1::1")];
    let d = at_cluster_ip(s.clone(), TrafficPolicy::Cluster, "10.96.0.10", &eps);
    assert_eq!(reasons(&d), [Ready, OtherFamily]);
    let d = at_cluster_ip(s, TrafficPolicy::Cluster, "fd00:96::10", &eps);
    assert_eq!(reasons(&d), [OtherFamily, Ready]);
}

/// Rule 3: `internalTrafficPolicy: Local` keeps this node's endpoints; a serving-terminating
/// endpoint is out because a local one is ready, before its node is looked at.
#[test]
fn local_policy_keeps_this_node() {
    let eps = [
        on_node(ep("10.1.0.1"), "node-a"),
        on_node(ep("10.1.0.2"), "node-b"),
        ep("10.1.0.3"),
        on_node(terminating(ep("10.1.0.4"), true), "node-b"),
        on_node(terminating(ep("10.1.0.5"), true), "node-a"),
    ];
    let d = at_cluster_ip(svc("10.96.0.10"), TrafficPolicy::Local, "10.96.0.10", &eps);
    assert_eq!(
        reasons(&d),
        [
            Ready,
            OtherNodeUnderLocal,
            OtherNodeUnderLocal,
            TerminatingWhileReady,
            TerminatingWhileReady
        ]
    );
    // The same endpoints under Cluster are all ready ones, and the fallback is not taken.
    let d = at_cluster_ip(
        svc("10.96.0.10"),
        TrafficPolicy::Cluster,
        "10.96.0.10",
        &eps,
    );
    assert_eq!(
        reasons(&d),
        [
            Ready,
            Ready,
            Ready,
            TerminatingWhileReady,
            TerminatingWhileReady
        ]
    );
}

/// Rules 2 and 3: with no local ready endpoint, only local serving-terminating ones are used;
/// a ready endpoint elsewhere does not stop the fallback.
#[test]
fn local_policy_fallback_is_local_too() {
    let eps = [
        on_node(terminating(ep("10.1.0.1"), true), "node-a"),
        on_node(terminating(ep("10.1.0.2"), true), "node-b"),
        on_node(ep("10.1.0.3"), "node-b"),
    ];
    let d = at_cluster_ip(svc("10.96.0.10"), TrafficPolicy::Local, "10.96.0.10", &eps);
    assert_eq!(
        reasons(&d),
        [
            TerminatingFallback,
            OtherNodeUnderLocal,
            OtherNodeUnderLocal
        ]
    );
}

/// Rule 4: `externalTrafficPolicy: Local` applies to a NodePort, and the decisions for it match
/// the NodePort's virtual server.
#[test]
fn external_policy_at_a_node_port() {
    let mut s = svc("10.96.0.10");
    s.ports[0].node_port = Some(30080);
    s.external_traffic_policy = TrafficPolicy::Local;
    let eps = [
        on_node(ep("10.1.0.1"), "node-a"),
        on_node(ep("10.1.0.2"), "node-b"),
    ];
    let node_ip = ip("192.168.0.10");
    let d = endpoint_decisions(
        &s,
        &s.ports[0],
        s.external_traffic_policy,
        node_ip,
        &eps,
        &node(),
    );
    agrees_with_table(
        &s,
        &d,
        &eps,
        VirtualKey::inet(Protocol::Tcp, node_ip, 30080),
    );
    assert_eq!(reasons(&d), [Ready, OtherNodeUnderLocal]);
}

/// Rule 5: zone hints name this node's zone, so endpoints hinted elsewhere are out; a
/// serving-terminating endpoint without hints is out because ready ones exist.
#[test]
fn zone_hints() {
    let eps = [
        with_zone_hints(ep("10.1.0.1"), &["zone-a"]),
        with_zone_hints(ep("10.1.0.2"), &["zone-b"]),
        // Node hints that do not name this node do not matter in zone mode: not every ready
        // endpoint has node hints.
        with_zone_hints(
            with_node_hints(ep("10.1.0.3"), &["node-b"]),
            &["zone-a", "zone-b"],
        ),
        terminating(ep("10.1.0.4"), true),
    ];
    let d = at_cluster_ip(
        svc("10.96.0.10"),
        TrafficPolicy::Cluster,
        "10.96.0.10",
        &eps,
    );
    assert_eq!(
        reasons(&d),
        [Ready, ZoneHints, Ready, TerminatingWhileReady]
    );
}

/// Rule 5: in zone mode an endpoint whose node hints and zone hints both name elsewhere is out
/// for its zone hints, the filter in use.
#[test]
fn zone_mode_reports_zone_hints_over_node_hints() {
    let eps = [
        with_zone_hints(ep("10.1.0.1"), &["zone-a"]),
        with_zone_hints(with_node_hints(ep("10.1.0.2"), &["node-b"]), &["zone-b"]),
    ];
    let d = at_cluster_ip(
        svc("10.96.0.10"),
        TrafficPolicy::Cluster,
        "10.96.0.10",
        &eps,
    );
    assert_eq!(reasons(&d), [Ready, ZoneHints]);
}

/// Rule 5: node hints win when every ready endpoint has them and one names this node.
#[test]
fn node_hints() {
    let eps = [
        with_zone_hints(with_node_hints(ep("10.1.0.1"), &["node-a"]), &["zone-b"]),
        with_zone_hints(with_node_hints(ep("10.1.0.2"), &["node-b"]), &["zone-a"]),
    ];
    let d = at_cluster_ip(
        svc("10.96.0.10"),
        TrafficPolicy::Cluster,
        "10.96.0.10",
        &eps,
    );
    assert_eq!(reasons(&d), [Ready, NodeHints]);
}

/// Rule 5: hints that name neither this node nor its zone are ignored, and so is topology
/// under a Local policy.
#[test]
fn hints_that_cannot_apply_are_ignored() {
    let eps = [
        with_zone_hints(ep("10.1.0.1"), &["zone-b"]),
        with_zone_hints(ep("10.1.0.2"), &["zone-c"]),
    ];
    let d = at_cluster_ip(
        svc("10.96.0.10"),
        TrafficPolicy::Cluster,
        "10.96.0.10",
        &eps,
    );
    assert_eq!(reasons(&d), [Ready, Ready]);
    let eps = [on_node(
        with_zone_hints(ep("10.1.0.1"), &["zone-b"]),
        "node-a",
    )];
    let d = at_cluster_ip(svc("10.96.0.10"), TrafficPolicy::Local, "10.96.0.10", &eps);
    assert_eq!(reasons(&d), [Ready]);
}

/// Rule 5: `PreferClose` without hints derives zone hints from each endpoint's zone.
#[test]
fn prefer_close_by_zone() {
    let mut s = svc("10.96.0.10");
    s.traffic_distribution = Some(TrafficDistribution::PreferClose);
    let eps = [
        in_zone(ep("10.1.0.1"), "zone-a"),
        in_zone(ep("10.1.0.2"), "zone-b"),
    ];
    let d = at_cluster_ip(s.clone(), TrafficPolicy::Cluster, "10.96.0.10", &eps);
    assert_eq!(reasons(&d), [Ready, OtherZoneByDistribution]);
    // One endpoint with hints turns derivation off; the hints as given then apply.
    let eps = [
        in_zone(ep("10.1.0.1"), "zone-a"),
        with_zone_hints(in_zone(ep("10.1.0.2"), "zone-b"), &["zone-a"]),
    ];
    let d = at_cluster_ip(s, TrafficPolicy::Cluster, "10.96.0.10", &eps);
    assert_eq!(reasons(&d), [Ready, Ready]);
}

/// Rule 5: `PreferSameNode` without hints derives node and zone hints; the node ones apply
/// when this node has an endpoint, else the zone ones.
#[test]
fn prefer_same_node_by_node_then_zone() {
    let mut s = svc("10.96.0.10");
    s.traffic_distribution = Some(TrafficDistribution::PreferSameNode);
    let eps = [
        on_node(in_zone(ep("10.1.0.1"), "zone-a"), "node-a"),
        on_node(in_zone(ep("10.1.0.2"), "zone-a"), "node-b"),
    ];
    let d = at_cluster_ip(s.clone(), TrafficPolicy::Cluster, "10.96.0.10", &eps);
    assert_eq!(reasons(&d), [Ready, OtherNodeByDistribution]);
    let eps = [
        on_node(in_zone(ep("10.1.0.1"), "zone-a"), "node-b"),
        on_node(in_zone(ep("10.1.0.2"), "zone-b"), "node-c"),
    ];
    let d = at_cluster_ip(s, TrafficPolicy::Cluster, "10.96.0.10", &eps);
    assert_eq!(reasons(&d), [Ready, OtherZoneByDistribution]);
}

/// Every reason is reachable: the cases above, gathered, give each of them.
#[test]
fn every_reason_is_reached() {
    // An exhaustive match, so a new reason fails to compile here until a case reaches it.
    fn slot(r: EndpointReason) -> usize {
        match r {
            Ready => 0,
            TerminatingFallback => 1,
            NoMatchingPort => 2,
            OtherFamily => 3,
            NotReady => 4,
            TerminatingNotServing => 5,
            TerminatingWhileReady => 6,
            OtherNodeUnderLocal => 7,
            NodeHints => 8,
            ZoneHints => 9,
            OtherNodeByDistribution => 10,
            OtherZoneByDistribution => 11,
        }
    }
    let mut dual = svc("10.96.0.10");
    dual.cluster_ips.push(ip("fd00:96::10"));
    let mut close = svc("10.96.0.10");
    close.traffic_distribution = Some(TrafficDistribution::PreferClose);
    let mut same_node = svc("10.96.0.10");
    same_node.traffic_distribution = Some(TrafficDistribution::PreferSameNode);
    let mut other_port = ep("10.1.0.9");
    other_port.ports = vec![].into();
    let cases: Vec<(ServiceInfo, TrafficPolicy, Vec<Endpoint>)> = vec![
        (
            dual,
            TrafficPolicy::Cluster,
            vec![
                ep("10.1.0.1"),
                ep("fd00:1::1"),
                other_port,
                not_ready(ep("10.1.0.2"), false),
                terminating(ep("10.1.0.3"), false),
                terminating(ep("10.1.0.4"), true),
            ],
        ),
        (
            svc("10.96.0.10"),
            TrafficPolicy::Local,
            vec![
                on_node(terminating(ep("10.1.0.1"), true), "node-a"),
                on_node(ep("10.1.0.2"), "node-b"),
            ],
        ),
        (
            svc("10.96.0.10"),
            TrafficPolicy::Cluster,
            vec![
                with_node_hints(ep("10.1.0.1"), &["node-a"]),
                with_node_hints(ep("10.1.0.2"), &["node-b"]),
            ],
        ),
        (
            svc("10.96.0.10"),
            TrafficPolicy::Cluster,
            vec![
                with_zone_hints(ep("10.1.0.1"), &["zone-a"]),
                with_zone_hints(ep("10.1.0.2"), &["zone-b"]),
            ],
        ),
        (
            close,
            TrafficPolicy::Cluster,
            vec![
                in_zone(ep("10.1.0.1"), "zone-a"),
                in_zone(ep("10.1.0.2"), "zone-b"),
            ],
        ),
        (
            same_node,
            TrafficPolicy::Cluster,
            vec![
                on_node(in_zone(ep("10.1.0.1"), "zone-a"), "node-a"),
                on_node(in_zone(ep("10.1.0.2"), "zone-a"), "node-b"),
            ],
        ),
    ];
    let mut seen = [false; 12];
    for (s, policy, eps) in cases {
        for x in at_cluster_ip(s, policy, "10.96.0.10", &eps) {
            seen[slot(x.reason)] = true;
        }
    }
    let missing: Vec<usize> = (0..seen.len()).filter(|i| !seen[*i]).collect();
    assert!(missing.is_empty(), "reasons not reached: slots {missing:?}");
}

/// One decision per endpoint, in the caller's order, also for an address listed twice.
#[test]
fn one_decision_per_endpoint_in_order() {
    let eps = [
        ep("10.1.0.2"),
        not_ready(ep("10.1.0.1"), false),
        ep("10.1.0.2"),
    ];
    let d = at_cluster_ip(
        svc("10.96.0.10"),
        TrafficPolicy::Cluster,
        "10.96.0.10",
        &eps,
    );
    assert_eq!(reasons(&d), [Ready, NotReady, Ready]);
}
