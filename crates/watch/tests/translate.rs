//! Translation of real-world object YAML (in `tests/data/`) into the engine's model, each
//! asserting the exact model produced.

use std::net::IpAddr;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::Service;
use kube_ipvs_diff::{
    Cidr, Endpoint, EndpointPort, Inputs, NodeContext, Protocol, Scheduler, ServiceInfo,
    ServiceKind, ServiceName, ServicePort, SessionAffinity, TrafficDistribution, TrafficPolicy,
};
use kube_ipvs_watch::manifest::{self, Manifests};
use kube_ipvs_watch::{TranslateOptions, translate_service, translate_slice, translate_slices};

fn data(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(file)
}

fn load(file: &str) -> Manifests {
    manifest::load(&data(file)).expect("test data parses")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("literal")
}

fn port(name: &str, port: u16, protocol: Protocol) -> EndpointPort {
    EndpointPort {
        name: name.into(),
        port,
        protocol,
    }
}

fn ep(addr: &str, ports: Vec<EndpointPort>, node: Option<&str>, zone: Option<&str>) -> Endpoint {
    Endpoint {
        node_name: node.map(Into::into),
        zone: zone.map(Into::into),
        ..Endpoint::ready(ip(addr), ports)
    }
}

fn the_service(m: &Manifests, name: &str, opts: &TranslateOptions) -> ServiceInfo {
    let svc = find(m, name);
    translate_service(svc, opts)
        .expect("valid")
        .expect("for this proxy")
        .info
}

fn find<'a>(m: &'a Manifests, name: &str) -> &'a Service {
    m.services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some(name))
        .expect("in the test data")
}

#[test]
fn multi_slice_merges_duplicates_and_named_ports_that_differ_per_slice() {
    let m = load("multi-slice.yaml");
    let opts = TranslateOptions::default();
    assert_eq!(
        the_service(&m, "web", &opts),
        ServiceInfo {
            kind: ServiceKind::ClusterIp,
            cluster_ips: vec![ip("10.96.14.20")],
            ports: vec![
                ServicePort {
                    name: "http".into(),
                    protocol: Protocol::Tcp,
                    port: 80,
                    node_port: None
                },
                ServicePort {
                    name: "metrics".into(),
                    protocol: Protocol::Tcp,
                    port: 9090,
                    node_port: None
                },
            ],
            ..ServiceInfo::default()
        }
    );
    let (eps, errors) = translate_slices(&m.slices, &opts);
    assert!(errors.is_empty(), "{errors:?}");
    let web = ServiceName::new("shop", "web");
    assert_eq!(eps.keys().collect::<Vec<_>>(), [&web]);
    assert_eq!(
        *eps[&web],
        vec![
            ep(
                "10.244.1.5",
                vec![
                    port("http", 8080, Protocol::Tcp),
                    port("metrics", 9090, Protocol::Tcp)
                ],
                Some("node-a"),
                Some("europe-west1-b"),
            ),
            // In both slices: the ready copy (web-q9v4d) wins with its metrics port 9191; http is
            // only in the other copy and is added.
            ep(
                "10.244.1.7",
                vec![
                    port("http", 8080, Protocol::Tcp),
                    port("metrics", 9191, Protocol::Tcp)
                ],
                Some("node-a"),
                Some("europe-west1-b"),
            ),
            ep(
                "10.244.2.9",
                vec![port("metrics", 9191, Protocol::Tcp)],
                Some("node-b"),
                Some("europe-west1-c"),
            ),
        ]
    );
}

#[test]
fn merge_order_of_slices_does_not_change_the_result() {
    let m = load("multi-slice.yaml");
    let opts = TranslateOptions::default();
    let mut reversed = m.slices.clone();
    reversed.reverse();
    assert_eq!(
        translate_slices(&m.slices, &opts).0,
        translate_slices(&reversed, &opts).0
    );
}

#[test]
fn dual_stack_node_port_service_with_affinity_and_scheduler() {
    let m = load("dual-stack.yaml");
    let opts = TranslateOptions::default();
    assert_eq!(
        the_service(&m, "dns-cache", &opts),
        ServiceInfo {
            kind: ServiceKind::NodePort,
            cluster_ips: vec![ip("fd00:10:96::53"), ip("10.96.0.53")],
            ports: vec![
                ServicePort {
                    name: "dns".into(),
                    protocol: Protocol::Udp,
                    port: 53,
                    node_port: Some(30053)
                },
                ServicePort {
                    name: "dns-tcp".into(),
                    protocol: Protocol::Tcp,
                    port: 53,
                    node_port: Some(30054)
                },
            ],
            external_ips: vec![ip("203.0.113.53")],
            load_balancer_ips: vec![],
            session_affinity: SessionAffinity::ClientIp {
                timeout_seconds: 600
            },
            external_traffic_policy: TrafficPolicy::Local,
            internal_traffic_policy: TrafficPolicy::Cluster,
            health_check_node_port: Some(31953),
            load_balancer_source_ranges: vec![],
            traffic_distribution: None,
            scheduler: Some("mh:fallback,port".parse::<Scheduler>().expect("valid")),
            local_marks: vec![],
        }
    );
    let (eps, errors) = translate_slices(&m.slices, &opts);
    assert!(errors.is_empty(), "{errors:?}");
    let ports = vec![
        port("dns", 5353, Protocol::Udp),
        port("dns-tcp", 5353, Protocol::Tcp),
    ];
    assert_eq!(
        *eps[&ServiceName::new("kube-system", "dns-cache")],
        vec![
            ep("10.244.0.12", ports.clone(), Some("node-a"), None),
            ep("fd00:10:244::c", ports, Some("node-a"), None),
        ]
    );
}

#[test]
fn terminating_endpoints_and_condition_defaults() {
    let m = load("terminating.yaml");
    let opts = TranslateOptions::default();
    assert_eq!(
        the_service(&m, "api", &opts),
        ServiceInfo {
            cluster_ips: vec![ip("10.96.33.1")],
            ports: vec![ServicePort {
                name: String::new(),
                protocol: Protocol::Tcp,
                port: 443,
                node_port: None
            }],
            ..ServiceInfo::default()
        }
    );
    let (eps, _) = translate_slices(&m.slices, &opts);
    let ports = vec![port("", 8443, Protocol::Tcp)];
    let cond = |addr: &str, node, ready, serving, terminating| Endpoint {
        ready,
        serving,
        terminating,
        ..ep(addr, ports.clone(), node, None)
    };
    assert_eq!(
        *eps[&ServiceName::new("default", "api")],
        vec![
            cond("10.244.3.1", Some("node-c"), false, true, true),
            cond("10.244.3.2", Some("node-c"), false, false, true),
            // No conditions: ready, serving (= ready), not terminating.
            cond("10.244.3.3", Some("node-d"), true, true, false),
            // ready false, serving unset: serving follows ready.
            cond("10.244.3.4", None, false, false, false),
        ]
    );
}

#[test]
fn hints_and_load_balancer_ingress() {
    let m = load("hints.yaml");
    let opts = TranslateOptions::default();
    assert_eq!(
        the_service(&m, "checkout", &opts),
        ServiceInfo {
            kind: ServiceKind::LoadBalancer,
            cluster_ips: vec![ip("10.96.40.2")],
            ports: vec![ServicePort {
                name: "https".into(),
                protocol: Protocol::Tcp,
                port: 443,
                node_port: Some(31443)
            }],
            // The Proxy-mode and hostname-only ingresses are not VIPs of this node.
            load_balancer_ips: vec![ip("192.0.2.10")],
            load_balancer_source_ranges: vec!["198.51.100.0/24".parse::<Cidr>().expect("valid")],
            traffic_distribution: Some(TrafficDistribution::PreferClose),
            ..ServiceInfo::default()
        }
    );
    let (eps, _) = translate_slices(&m.slices, &opts);
    let ports = vec![port("https", 8443, Protocol::Tcp)];
    assert_eq!(
        *eps[&ServiceName::new("shop", "checkout")],
        vec![
            Endpoint {
                hints_for_zones: vec!["zone-a".into()].into(),
                ..ep("10.244.4.1", ports.clone(), Some("node-a"), Some("zone-a"))
            },
            Endpoint {
                hints_for_zones: vec!["zone-b".into(), "zone-c".into()].into(),
                hints_for_nodes: vec!["node-b".into()].into(),
                ..ep("10.244.5.1", ports, Some("node-b"), Some("zone-b"))
            },
        ]
    );
}

#[test]
fn headless_external_name_and_other_proxies_are_skipped() {
    let m = load("skipped.yaml");
    let default = TranslateOptions::default();
    let named = |n: &str| TranslateOptions {
        service_proxy_name: Some(n.into()),
    };
    let ours = |name: &str, opts: &TranslateOptions| {
        translate_service(find(&m, name), opts)
            .expect("valid")
            .is_some()
    };
    assert!(!ours("headless", &default));
    assert!(!ours("alias", &default));
    assert!(!ours("other-proxy", &default));
    assert!(!ours("ours-by-name", &default));
    assert!(ours("ours-by-name", &named("kube-ipvs")));
    assert!(!ours("other-proxy", &named("kube-ipvs")));
    assert!(ours("other-proxy", &named("cilium")));
    assert_eq!(
        default.label_selector(),
        "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    );
}

#[test]
fn bad_objects_are_errors_naming_the_object_and_field() {
    let m = load("skipped.yaml");
    let opts = TranslateOptions::default();
    let err = |name: &str| {
        translate_service(find(&m, name), &opts)
            .expect_err("bad object")
            .to_string()
    };
    assert_eq!(
        err("bad-ip"),
        "Service default/bad-ip: clusterIP \"10.96.500.1\" is not an IP address"
    );
    assert_eq!(
        err("bad-port"),
        "Service default/bad-port: ports[0]: port 70000 is out of range 1..=65535"
    );
    assert_eq!(
        err("bad-protocol"),
        "Service default/bad-protocol: ports[0]: unknown protocol \"ICMP\""
    );

    // An invalid scheduler annotation is reported and the node default (None) used.
    let t = translate_service(find(&m, "bad-scheduler"), &opts)
        .expect("valid")
        .expect("ours");
    assert_eq!(t.info.scheduler, None);
    assert_eq!(t.warnings.len(), 1);
    assert!(
        t.warnings[0].contains("\"roundrobin\""),
        "{}",
        t.warnings[0]
    );

    // Slices: the headless one and the FQDN one are not ours; the broken one's only endpoint
    // (an IPv6 address in an IPv4 slice) is skipped with a warning naming it, not the slice,
    // and the good one still flows.
    let (eps, errors) = translate_slices(&m.slices, &opts);
    assert_eq!(
        eps.keys().collect::<Vec<_>>(),
        [&ServiceName::new("default", "bad-scheduler")]
    );
    assert_eq!(
        eps[&ServiceName::new("default", "bad-scheduler")]
            .iter()
            .map(|e| e.addr)
            .collect::<Vec<_>>(),
        [ip("10.244.9.2"), ip("10.244.9.3")]
    );
    assert!(errors.is_empty(), "{errors:?}");
    let broken = m
        .slices
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("bad-scheduler-broken"))
        .expect("the broken slice");
    let t = translate_slice(broken, &opts)
        .expect("valid")
        .expect("ours");
    assert!(t.endpoints.is_empty());
    assert_eq!(
        t.warnings,
        [
            "endpoints[0] address fd00::1 does not match addressType IPv4; this endpoint is \
          skipped, the slice's others stay"
        ]
    );
}

#[test]
fn snapshot_of_the_whole_directory_applies_to_the_engine_cleanly() {
    let cs = manifest::snapshot(&data(""), &TranslateOptions::default(), None).expect("loads");
    assert!(cs.initial);
    let with_service: Vec<String> = cs
        .services
        .iter()
        .filter(|(_, c)| c.service.is_some())
        .map(|(n, _)| n.to_string())
        .collect();
    assert_eq!(
        with_service,
        [
            "default/api",
            "default/bad-scheduler",
            "kube-system/dns-cache",
            "shop/checkout",
            "shop/web"
        ]
    );
    let mut inputs = Inputs::new(NodeContext::new("node-a")).expect("node");
    assert!(cs.apply_to(&mut inputs).is_empty());
    assert_eq!(inputs.len(), 5);
    assert_eq!(inputs.endpoints(&ServiceName::new("shop", "web")).len(), 3);
}

#[test]
fn a_slices_endpoints_share_its_ports_and_each_nodes_name() {
    let m = load("terminating.yaml");
    let slice = m
        .slices
        .iter()
        .find(|s| {
            s.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/service-name"))
                .is_some_and(|n| n == "api")
        })
        .expect("api's slice");
    let t = kube_ipvs_watch::translate_slice(slice, &TranslateOptions::default())
        .expect("valid")
        .expect("ours");
    let e = &t.endpoints;
    assert_eq!(e.len(), 4);
    // One allocation of the ports for the whole slice, one of each node's name.
    assert!(
        e.iter()
            .all(|x| std::sync::Arc::ptr_eq(&x.ports, &e[0].ports))
    );
    let node = |i: usize| e[i].node_name.clone().expect("a node");
    assert_eq!((&*node(0), &*node(2)), ("node-c", "node-d"));
    assert!(std::sync::Arc::ptr_eq(&node(0), &node(1)), "both on node-c");
    assert!(!std::sync::Arc::ptr_eq(&node(0), &node(2)));
}
