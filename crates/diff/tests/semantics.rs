//! Table tests of the Service API semantics, one rule each; the comment or name of every test
//! says which rule of the API it checks. The numbering follows the list in `desired.rs`.

mod common;

use std::collections::BTreeSet;
use std::net::IpAddr;

use common::{ep, ip, node, on_node, svc, terminating};
use kube_ipvs_diff::desired::dest_keys;
use kube_ipvs_diff::{
    DestKey, Endpoint, EndpointPort, PortMark, Protocol, Scheduler, SchedulerKind, ServiceKind,
    ServicePort, ServiceTable, SessionAffinity, TrafficDistribution, TrafficPolicy, VirtualKey,
    service_table,
};

fn tcp(addr: &str, port: u16) -> VirtualKey {
    VirtualKey::inet(Protocol::Tcp, ip(addr), port)
}

fn dests(t: &ServiceTable, key: VirtualKey) -> BTreeSet<IpAddr> {
    dest_keys(t, &key).into_iter().map(|d| d.addr).collect()
}

fn set(addrs: &[&str]) -> BTreeSet<IpAddr> {
    addrs.iter().map(|a| ip(a)).collect()
}

fn keys(t: &ServiceTable) -> Vec<VirtualKey> {
    t.servers.iter().map(|(s, _)| s.key).collect()
}

/// Rule 1: `clusterIP: None` (headless) gets no virtual IP, so no virtual server and no address.
#[test]
fn rule1_headless_service_produces_nothing() {
    let mut s = svc("10.96.0.10");
    s.cluster_ips.clear();
    s.external_ips = vec![ip("203.0.113.1")];
    let t = service_table(Some(&s), &[ep("10.1.0.1")], &node());
    assert_eq!(t, ServiceTable::default());
}

/// Rule 1: `type: ExternalName` is a DNS alias and is never proxied.
#[test]
fn rule1_external_name_produces_nothing() {
    let mut s = svc("10.96.0.10");
    s.kind = ServiceKind::ExternalName;
    let t = service_table(Some(&s), &[ep("10.1.0.1")], &node());
    assert_eq!(t, ServiceTable::default());
}

/// Rule 2: only ready endpoints receive traffic while any endpoint is ready; terminating ones
/// (ready=false) are left out.
#[test]
fn rule2_ready_endpoints_first() {
    let s = svc("10.96.0.10");
    let eps = [ep("10.1.0.1"), terminating(ep("10.1.0.2"), true)];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
}

/// Rule 2 (KEP-1669): with no ready endpoint, serving-and-terminating endpoints are used so
/// rolling updates of the last replica do not drop traffic.
#[test]
fn rule2_serving_terminating_only_when_none_ready() {
    let s = svc("10.96.0.10");
    let eps = [
        terminating(ep("10.1.0.2"), true),
        terminating(ep("10.1.0.3"), false),
    ];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.2"]));
}

/// Rule 2: an endpoint that is neither ready nor serving-terminating (e.g. not yet ready) is
/// never used; with only such endpoints the virtual server has no real servers.
#[test]
fn rule2_unready_endpoints_are_never_used() {
    let s = svc("10.96.0.10");
    let mut e = ep("10.1.0.1");
    e.ready = false;
    e.serving = false;
    let t = service_table(Some(&s), &[e], &node());
    assert_eq!(keys(&t), vec![tcp("10.96.0.10", 80)]);
    assert!(dests(&t, tcp("10.96.0.10", 80)).is_empty());
}

/// Rule 3: `internalTrafficPolicy: Local` routes ClusterIP traffic only to endpoints on this node.
#[test]
fn rule3_internal_local_uses_only_node_local_endpoints() {
    let mut s = svc("10.96.0.10");
    s.internal_traffic_policy = TrafficPolicy::Local;
    let eps = [
        on_node(ep("10.1.0.1"), "node-a"),
        on_node(ep("10.1.0.2"), "node-b"),
    ];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
}

/// Rule 3: with `internalTrafficPolicy: Local` and no local endpoint, traffic is dropped (no
/// real servers), not sent elsewhere.
#[test]
fn rule3_internal_local_without_local_endpoints_drops() {
    let mut s = svc("10.96.0.10");
    s.internal_traffic_policy = TrafficPolicy::Local;
    let eps = [on_node(ep("10.1.0.2"), "node-b")];
    let t = service_table(Some(&s), &eps, &node());
    assert!(dests(&t, tcp("10.96.0.10", 80)).is_empty());
}

/// Rule 3 with rule 2: a Local policy uses local serving-terminating endpoints when no local
/// endpoint is ready, even if remote ready ones exist.
#[test]
fn rule3_local_policy_falls_back_to_local_terminating() {
    let mut s = svc("10.96.0.10");
    s.internal_traffic_policy = TrafficPolicy::Local;
    let eps = [
        terminating(on_node(ep("10.1.0.1"), "node-a"), true),
        on_node(ep("10.1.0.2"), "node-b"),
    ];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
}

fn lb_service() -> kube_ipvs_diff::ServiceInfo {
    let mut s = svc("10.96.0.10");
    s.kind = ServiceKind::LoadBalancer;
    s.ports[0].node_port = Some(30080);
    s.external_ips = vec![ip("203.0.113.1")];
    s.load_balancer_ips = vec![ip("198.51.100.7")];
    s
}

/// Rule 4: `externalTrafficPolicy: Local` routes NodePort, externalIP and LoadBalancer traffic
/// only to endpoints on this node, while the ClusterIP keeps using all endpoints.
#[test]
fn rule4_external_local_applies_to_external_vips_only() {
    let mut s = lb_service();
    s.external_traffic_policy = TrafficPolicy::Local;
    let eps = [
        on_node(ep("10.1.0.1"), "node-a"),
        on_node(ep("10.1.0.2"), "node-b"),
    ];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(
        dests(&t, tcp("10.96.0.10", 80)),
        set(&["10.1.0.1", "10.1.0.2"])
    );
    for k in [
        tcp("203.0.113.1", 80),
        tcp("198.51.100.7", 80),
        tcp("192.168.0.10", 30080),
    ] {
        assert_eq!(dests(&t, k), set(&["10.1.0.1"]), "{k}");
    }
}

/// Rule 4: with `externalTrafficPolicy: Local` and no local endpoint, external traffic is
/// dropped; kube-proxy's IPVS mode historically fell back to all endpoints here (documented
/// difference), the API does not.
#[test]
fn rule4_external_local_without_local_endpoints_drops() {
    let mut s = lb_service();
    s.external_traffic_policy = TrafficPolicy::Local;
    let eps = [on_node(ep("10.1.0.2"), "node-b")];
    let t = service_table(Some(&s), &eps, &node());
    assert!(dests(&t, tcp("192.168.0.10", 30080)).is_empty());
    assert!(dests(&t, tcp("198.51.100.7", 80)).is_empty());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.2"]));
}

/// Rule 11: with a mark, local clients of a Local-policy Service's external addresses and
/// NodePorts are sent to a fwmark virtual server holding the cluster-wide endpoints (even under
/// `internalTrafficPolicy: Local`), while the external virtual servers keep rule 4.
#[test]
fn rule11_local_clients_of_local_external_addresses_reach_every_endpoint() {
    let mut s = lb_service();
    s.external_traffic_policy = TrafficPolicy::Local;
    s.internal_traffic_policy = TrafficPolicy::Local;
    s.local_marks = vec![PortMark {
        protocol: Protocol::Tcp,
        port: 80,
        mark: 0x10_0000,
    }];
    let eps = [
        on_node(ep("10.1.0.1"), "node-b"),
        on_node(ep("10.1.0.2"), "node-c"),
    ];
    let t = service_table(Some(&s), &eps, &node());
    let fwm = VirtualKey::Fwmark {
        ipv6: false,
        mark: 0x10_0000,
    };
    assert_eq!(dests(&t, fwm), set(&["10.1.0.1", "10.1.0.2"]));
    assert!(dests(&t, tcp("192.168.0.10", 30080)).is_empty(), "rule 4");
    assert!(dests(&t, tcp("10.96.0.10", 80)).is_empty(), "rule 3");
    let marked: Vec<VirtualKey> = t.marked.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        marked,
        [
            tcp("192.168.0.10", 30080),
            tcp("198.51.100.7", 80),
            tcp("203.0.113.1", 80)
        ]
    );
    assert!(t.marked.iter().all(|(_, m)| *m == 0x10_0000));
    // No IPv6 way in (the Service is IPv4), so no IPv6 fwmark virtual server.
    assert!(!keys(&t).contains(&VirtualKey::Fwmark {
        ipv6: true,
        mark: 0x10_0000
    }));

    // Under the Cluster policy a stale mark is ignored: nothing is marked.
    s.external_traffic_policy = TrafficPolicy::Cluster;
    let t = service_table(Some(&s), &eps, &node());
    assert!(t.marked.is_empty());
    assert!(!keys(&t).contains(&fwm));
}

fn hinted(addr: &str, zones: &[&str]) -> Endpoint {
    let mut e = ep(addr);
    e.hints_for_zones = zones.iter().map(|z| (*z).to_owned()).collect();
    e
}

/// Rule 5 (topology-aware hints): when every ready endpoint has zone hints and some name this
/// node's zone, only those are used.
#[test]
fn rule5_zone_hints_restrict_to_this_zone() {
    let s = svc("10.96.0.10");
    let eps = [
        hinted("10.1.0.1", &["zone-a"]),
        hinted("10.1.0.2", &["zone-b"]),
    ];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
}

/// Rule 5: hints are ignored unless every ready endpoint has them (a slice mid-update).
#[test]
fn rule5_zone_hints_ignored_when_some_endpoint_lacks_them() {
    let s = svc("10.96.0.10");
    let eps = [hinted("10.1.0.1", &["zone-a"]), ep("10.1.0.2")];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(
        dests(&t, tcp("10.96.0.10", 80)),
        set(&["10.1.0.1", "10.1.0.2"])
    );
}

/// Rule 5: hints are ignored when none name this node's zone (no endpoint would be left).
#[test]
fn rule5_zone_hints_ignored_when_none_match_this_zone() {
    let s = svc("10.96.0.10");
    let eps = [
        hinted("10.1.0.1", &["zone-b"]),
        hinted("10.1.0.2", &["zone-c"]),
    ];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(
        dests(&t, tcp("10.96.0.10", 80)),
        set(&["10.1.0.1", "10.1.0.2"])
    );
}

/// Rule 5: node hints (`hints.forNodes`, `PreferSameNode`) win over zone hints when every ready
/// endpoint has them and one names this node.
#[test]
fn rule5_node_hints_restrict_to_this_node() {
    let s = svc("10.96.0.10");
    let mut a = hinted("10.1.0.1", &["zone-a"]);
    a.hints_for_nodes = vec!["node-a".into()].into();
    let mut b = hinted("10.1.0.2", &["zone-a"]);
    b.hints_for_nodes = vec!["node-b".into()].into();
    let t = service_table(Some(&s), &[a, b], &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
}

/// Rule 5: `trafficDistribution: PreferClose` without hints (no EndpointSlice controller)
/// prefers endpoints in this node's zone, as the controller's hints would.
#[test]
fn rule5_prefer_close_without_hints_prefers_same_zone() {
    let mut s = svc("10.96.0.10");
    s.traffic_distribution = Some(TrafficDistribution::PreferClose);
    let mut a = ep("10.1.0.1");
    a.zone = Some("zone-a".into());
    let mut b = ep("10.1.0.2");
    b.zone = Some("zone-b".into());
    let t = service_table(Some(&s), &[a.clone(), b.clone()], &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
    // Without trafficDistribution the same endpoints are all used.
    s.traffic_distribution = None;
    let t = service_table(Some(&s), &[a, b], &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)).len(), 2);
}

/// Rule 5: topology does not apply to Local policies (they are already node-local).
#[test]
fn rule5_topology_ignored_for_local_policy() {
    let mut s = svc("10.96.0.10");
    s.internal_traffic_policy = TrafficPolicy::Local;
    let a = on_node(hinted("10.1.0.1", &["zone-b"]), "node-a");
    let b = on_node(hinted("10.1.0.2", &["zone-a"]), "node-b");
    let t = service_table(Some(&s), &[a, b], &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
}

/// Rule 6 (dual-stack): an endpoint backs only virtual servers of its own family, and NodePorts
/// open on the node IPs of each family the Service has.
#[test]
fn rule6_dual_stack_keeps_families_apart() {
    let mut s = svc("10.96.0.10");
    s.cluster_ips.push(ip("fd00:96::10"));
    s.ports[0].node_port = Some(30080);
    let eps = [ep("10.1.0.1"), ep("fd00:1::1")];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
    assert_eq!(dests(&t, tcp("fd00:96::10", 80)), set(&["fd00:1::1"]));
    assert_eq!(dests(&t, tcp("192.168.0.10", 30080)), set(&["10.1.0.1"]));
    assert_eq!(dests(&t, tcp("fd00:1::10", 30080)), set(&["fd00:1::1"]));
    let v6 = t
        .servers
        .iter()
        .find(|(s, _)| s.key == tcp("fd00:96::10", 80))
        .expect("IPv6 virtual server");
    assert_eq!(v6.0.netmask, 128);
}

/// Rule 6 with rule 2 (dual-stack): the terminating fallback is decided per family, as
/// kube-proxy's per-family proxiers do: a ready IPv4 endpoint does not keep the IPv6 virtual
/// server from falling back to its serving, terminating IPv6 endpoint.
#[test]
fn rule6_the_terminating_fallback_is_per_family() {
    let mut s = svc("10.96.0.10");
    s.cluster_ips.push(ip("fd00:96::10"));
    let eps = [ep("10.1.0.1"), terminating(ep("fd00:1::1"), true)];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
    assert_eq!(dests(&t, tcp("fd00:96::10", 80)), set(&["fd00:1::1"]));
}

/// Rule 6 with rule 5 (dual-stack): the topology mode is decided per family. An IPv6 endpoint
/// without a node does not turn `PreferSameNode` into zone mode for IPv4, where the only ready
/// endpoint is on this node (in another zone than the node's).
#[test]
fn rule6_the_topology_mode_is_per_family() {
    let mut s = svc("10.96.0.10");
    s.cluster_ips.push(ip("fd00:96::10"));
    s.traffic_distribution = Some(TrafficDistribution::PreferSameNode);
    let mut here = on_node(ep("10.1.0.1"), "node-a");
    here.zone = Some("zone-b".into());
    let mut v6 = ep("fd00:1::1");
    v6.zone = Some("zone-a".into());
    let t = service_table(Some(&s), &[here, v6], &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
    assert_eq!(dests(&t, tcp("fd00:96::10", 80)), set(&["fd00:1::1"]));
}

/// Rule 6: a single-stack Service gets no virtual servers in the other family, not even for an
/// externalIP or a NodePort there.
#[test]
fn rule6_single_stack_service_ignores_other_family() {
    let mut s = svc("10.96.0.10");
    s.ports[0].node_port = Some(30080);
    s.external_ips = vec![ip("2001:db8::1")];
    let t = service_table(Some(&s), &[ep("10.1.0.1")], &node());
    assert_eq!(
        keys(&t),
        vec![tcp("10.96.0.10", 80), tcp("192.168.0.10", 30080)]
    );
    assert_eq!(t.addresses, vec![ip("10.96.0.10")]);
}

/// Rule 7: `sessionAffinity: ClientIP` makes every virtual server persistent with
/// `sessionAffinityConfig.clientIP.timeoutSeconds`.
#[test]
fn rule7_client_ip_affinity_is_persistence_with_timeout() {
    let mut s = lb_service();
    s.session_affinity = SessionAffinity::ClientIp {
        timeout_seconds: 600,
    };
    let t = service_table(Some(&s), &[ep("10.1.0.1")], &node());
    assert_eq!(t.servers.len(), 4);
    for (v, _) in &t.servers {
        assert_eq!(v.persistence, Some(600), "{}", v.key);
        assert_eq!(v.netmask, 32);
        assert_eq!(v.flags() & kube_ipvs_diff::table::FLAG_PERSISTENT, 1);
    }
    s.session_affinity = SessionAffinity::None;
    let t = service_table(Some(&s), &[ep("10.1.0.1")], &node());
    assert!(t.servers.iter().all(|(v, _)| v.persistence.is_none()));
}

/// Rule 8: the Service's scheduler annotation overrides the node's `--scheduler`.
#[test]
fn rule8_scheduler_override_else_node_default() {
    let mut n = node();
    n.default_scheduler = Scheduler::new(SchedulerKind::Lc);
    let mut s = svc("10.96.0.10");
    let t = service_table(Some(&s), &[], &n);
    assert_eq!(t.servers[0].0.scheduler.kind(), SchedulerKind::Lc);
    s.scheduler = Some("mh:fallback".parse().expect("valid"));
    let t = service_table(Some(&s), &[], &n);
    assert_eq!(t.servers[0].0.scheduler.to_string(), "mh:fallback");
    assert_eq!(t.servers[0].0.flags(), kube_ipvs_diff::table::FLAG_SCHED1);
}

/// Rule 9: a NodePort opens on every node IP; ClusterIPs, externalIPs and LB IPs are bound to
/// `kube-ipvs0`, node IPs are not.
#[test]
fn rule9_node_ports_on_each_node_ip_and_addresses_exclude_node_ips() {
    let mut n = node();
    n.node_ips_v4.push("192.168.1.10".parse().expect("literal"));
    let mut s = lb_service();
    // An externalIP that is also a node IP must not be bound to the dummy interface.
    s.external_ips.push(ip("192.168.1.10"));
    let t = service_table(Some(&s), &[ep("10.1.0.1")], &n);
    assert!(keys(&t).contains(&tcp("192.168.0.10", 30080)));
    assert!(keys(&t).contains(&tcp("192.168.1.10", 30080)));
    assert_eq!(
        t.addresses,
        vec![ip("10.96.0.10"), ip("198.51.100.7"), ip("203.0.113.1")]
    );
}

/// Rule 9, kube-proxy's `shouldBind`: an external or load-balancer IP that another interface of
/// the node holds is served (its virtual servers are there) but not bound to `kube-ipvs0`; a
/// ClusterIP is bound whatever holds it.
#[test]
fn rule9_addresses_other_interfaces_hold_are_served_but_not_bound() {
    let mut n = node();
    n.held_addresses = vec![ip("10.96.0.10"), ip("198.51.100.7")];
    let s = lb_service();
    let t = service_table(Some(&s), &[ep("10.1.0.1")], &n);
    assert!(keys(&t).contains(&tcp("198.51.100.7", 80)));
    assert_eq!(t.addresses, vec![ip("10.96.0.10"), ip("203.0.113.1")]);
}

/// Rule 10: an endpoint backs a Service port through the endpoint port with the same name and
/// protocol, and the real server uses that (target) port; every real server is NAT, weight 1.
#[test]
fn rule10_ports_match_by_name_and_protocol() {
    let mut s = svc("10.96.0.10");
    s.ports.push(ServicePort {
        name: "dns".into(),
        protocol: Protocol::Udp,
        port: 53,
        node_port: None,
    });
    // Each endpoint also serves a port named "dns" on 5353, with this protocol.
    let with_dns = |addr: &str, protocol| {
        let mut e = ep(addr);
        let dns = EndpointPort {
            name: "dns".into(),
            port: 5353,
            protocol,
        };
        e.ports = e.ports.iter().cloned().chain([dns]).collect();
        e
    };
    let both = with_dns("10.1.0.1", Protocol::Udp);
    let wrong_proto = with_dns("10.1.0.2", Protocol::Tcp);
    let t = service_table(Some(&s), &[both, wrong_proto], &node());
    let udp = VirtualKey::inet(Protocol::Udp, ip("10.96.0.10"), 53);
    assert_eq!(
        dest_keys(&t, &udp),
        vec![DestKey {
            addr: ip("10.1.0.1"),
            port: 5353
        }]
    );
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)).len(), 2);
    for (_, ds) in &t.servers {
        for d in ds {
            assert_eq!((d.weight, d.forward), (1, kube_ipvs_diff::Forward::Masq));
        }
    }
}

/// A removed Service (no object) produces nothing, even if its endpoints linger.
#[test]
fn removed_service_produces_nothing() {
    let t = service_table(None, &[ep("10.1.0.1")], &node());
    assert_eq!(t, ServiceTable::default());
}

/// Rule 5: `trafficDistribution: PreferSameNode` without hints prefers this node's endpoints,
/// and falls back to this zone's when the node has none.
#[test]
fn rule5_prefer_same_node_without_hints_prefers_node_then_zone() {
    let mut s = svc("10.96.0.10");
    s.traffic_distribution = Some(TrafficDistribution::PreferSameNode);
    let placed = |addr: &str, node: &str, zone: &str| {
        let mut e = on_node(ep(addr), node);
        e.zone = Some(zone.into());
        e
    };
    let eps = [
        placed("10.1.0.1", "node-a", "zone-a"),
        placed("10.1.0.2", "node-b", "zone-a"),
        placed("10.1.0.3", "node-c", "zone-b"),
    ];
    let t = service_table(Some(&s), &eps, &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.1"]));
    let t = service_table(Some(&s), &eps[1..], &node());
    assert_eq!(dests(&t, tcp("10.96.0.10", 80)), set(&["10.1.0.2"]));
}
