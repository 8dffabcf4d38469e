//! The incremental engine: ops for changes, graceful termination with injected time, shared
//! addresses, contested virtual servers, and full resync against an observed table.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{ep, ip, name, node, svc};
use kube_ipvs_diff::{
    ConnectionCounts, DestKey, Engine, Inputs, Op, Protocol, RealServer, ServiceEntry, Table,
    UnknownCounts, VirtualKey,
};

const T0: Duration = Duration::from_secs(1000);

fn tcp(addr: &str, port: u16) -> VirtualKey {
    VirtualKey::inet(Protocol::Tcp, ip(addr), port)
}

fn dest(addr: &str) -> DestKey {
    DestKey {
        addr: ip(addr),
        port: 8080,
    }
}

fn counts(entries: &[(VirtualKey, &str, u64)]) -> HashMap<(VirtualKey, DestKey), u64> {
    entries
        .iter()
        .map(|(k, a, n)| ((*k, dest(a)), *n))
        .collect()
}

/// An engine and a kernel model kept in step: every op is applied to the model, which must
/// accept it, and the model must then equal the engine's desired table.
struct Rig {
    inputs: Inputs,
    engine: Engine,
    kernel: Table,
}

impl Rig {
    fn new() -> Self {
        Self {
            inputs: Inputs::new(node()).expect("valid node"),
            engine: Engine::new(),
            kernel: Table::default(),
        }
    }

    fn sync(&mut self, now: Duration, counts: &dyn ConnectionCounts) -> Vec<Op> {
        let ops = self.engine.sync(&mut self.inputs, now, counts);
        self.kernel.apply_all(&ops).expect("kernel accepts the ops");
        assert_eq!(self.kernel, self.engine.desired_table());
        ops
    }
}

#[test]
fn first_sync_creates_address_service_and_dests_in_kernel_order() {
    let mut rig = Rig::new();
    rig.inputs
        .upsert_service(name("web"), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(name("web"), vec![ep("10.1.0.1")])
        .expect("valid");
    let ops = rig.sync(T0, &UnknownCounts);
    let text: Vec<String> = ops.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        vec![
            "add address 10.96.0.10 to kube-ipvs0",
            "add service TCP 10.96.0.10:80 rr",
            "add dest TCP 10.96.0.10:80 -> 10.1.0.1:8080 masq weight 1",
        ]
    );
    assert!(rig.sync(T0, &UnknownCounts).is_empty(), "nothing changed");
}

#[test]
fn removed_tcp_dest_drains_at_weight_zero_then_goes_when_idle() {
    let mut rig = Rig::new();
    let web = name("web");
    rig.inputs
        .upsert_service(web.clone(), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1"), ep("10.1.0.2")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);

    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1")])
        .expect("valid");
    let key = tcp("10.96.0.10", 80);
    let busy = counts(&[(key, "10.1.0.2", 3)]);
    let ops = rig.sync(T0, &busy);
    assert_eq!(
        ops,
        vec![Op::UpdateDest {
            service: key,
            dest: RealServer::masq(ip("10.1.0.2"), 8080, 0)
        }]
    );
    assert_eq!(
        rig.engine.next_deadline(&rig.inputs),
        Some(T0 + Duration::from_secs(900))
    );
    // Still busy a minute later: nothing to do.
    assert!(rig.sync(T0 + Duration::from_secs(60), &busy).is_empty());
    // Drained: deleted.
    let idle = counts(&[(key, "10.1.0.2", 0)]);
    let ops = rig.sync(T0 + Duration::from_secs(61), &idle);
    assert_eq!(
        ops,
        vec![Op::DeleteDest {
            service: key,
            dest: dest("10.1.0.2")
        }]
    );
    assert_eq!(rig.engine.next_deadline(&rig.inputs), None);
}

#[test]
fn draining_dest_is_deleted_after_the_timeout_even_with_connections() {
    let mut rig = Rig::new();
    let web = name("web");
    rig.inputs
        .upsert_service(web.clone(), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs.set_endpoints(web, vec![]).expect("valid");
    let key = tcp("10.96.0.10", 80);
    let busy = counts(&[(key, "10.1.0.1", 1)]);
    rig.sync(T0, &busy);
    let timeout = rig.inputs.node().options.graceful_termination_timeout;
    assert!(
        rig.sync(T0 + timeout - Duration::from_secs(1), &busy)
            .is_empty()
    );
    assert!(rig.engine.take_timed_out().is_empty(), "not yet");
    let ops = rig.sync(T0 + timeout, &busy);
    assert_eq!(
        ops,
        vec![Op::DeleteDest {
            service: key,
            dest: dest("10.1.0.1")
        }]
    );
    // The deletion at the cap is reported once, for the caller to log and count.
    assert_eq!(rig.engine.take_timed_out(), vec![(key, dest("10.1.0.1"))]);
    assert!(rig.engine.take_timed_out().is_empty());
}

#[test]
fn a_drained_dest_is_not_reported_as_timed_out() {
    let mut rig = Rig::new();
    let web = name("web");
    rig.inputs
        .upsert_service(web.clone(), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs.set_endpoints(web, vec![]).expect("valid");
    let key = tcp("10.96.0.10", 80);
    rig.sync(T0, &counts(&[(key, "10.1.0.1", 1)]));
    let timeout = rig.inputs.node().options.graceful_termination_timeout;
    // Idle exactly when the time is up: drained, not cut off.
    let ops = rig.sync(T0 + timeout, &counts(&[(key, "10.1.0.1", 0)]));
    assert_eq!(ops.len(), 1);
    assert!(rig.engine.take_timed_out().is_empty());
}

#[test]
fn removed_sctp_dest_drains_like_tcp() {
    let (mut rig, sig) = one_endpoint_service("sig", "10.96.0.60", Protocol::Sctp);
    rig.inputs.set_endpoints(sig, vec![]).expect("valid");
    let key = VirtualKey::inet(Protocol::Sctp, ip("10.96.0.60"), 80);
    let ops = rig.sync(T0, &counts(&[(key, "10.1.0.1", 2)]));
    assert_eq!(
        ops,
        vec![Op::UpdateDest {
            service: key,
            dest: RealServer::masq(ip("10.1.0.1"), 8080, 0)
        }],
        "an SCTP association keeps its real server at weight 0"
    );
    let ops = rig.sync(
        T0 + Duration::from_secs(5),
        &counts(&[(key, "10.1.0.1", 0)]),
    );
    assert_eq!(
        ops,
        vec![Op::DeleteDest {
            service: key,
            dest: dest("10.1.0.1")
        }]
    );
}

#[test]
fn tcp_dest_known_idle_is_deleted_at_once() {
    let mut rig = Rig::new();
    let web = name("web");
    rig.inputs
        .upsert_service(web.clone(), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs.set_endpoints(web, vec![]).expect("valid");
    let key = tcp("10.96.0.10", 80);
    let ops = rig.sync(T0, &counts(&[(key, "10.1.0.1", 0)]));
    assert_eq!(
        ops,
        vec![Op::DeleteDest {
            service: key,
            dest: dest("10.1.0.1")
        }]
    );
}

#[test]
fn udp_dest_goes_at_once() {
    let (mut rig, dns) = one_endpoint_service("dns", "10.96.0.53", Protocol::Udp);
    rig.inputs.set_endpoints(dns, vec![]).expect("valid");
    let ops = rig.sync(T0, &UnknownCounts);
    assert_eq!(
        ops,
        vec![Op::DeleteDest {
            service: VirtualKey::inet(Protocol::Udp, ip("10.96.0.53"), 80),
            dest: dest("10.1.0.1")
        }]
    );
}

/// A rig with one Service of `protocol` at `vip`:80 and its one endpoint 10.1.0.1, synced.
fn one_endpoint_service(
    svc_name: &str,
    vip: &str,
    protocol: Protocol,
) -> (Rig, kube_ipvs_diff::ServiceName) {
    let mut rig = Rig::new();
    let n = name(svc_name);
    let mut s = svc(vip);
    s.ports[0].protocol = protocol;
    let mut e = ep("10.1.0.1");
    let mut ports = e.ports.to_vec();
    ports[0].protocol = protocol;
    e.ports = ports.into();
    rig.inputs.upsert_service(n.clone(), s).expect("valid");
    rig.inputs.set_endpoints(n.clone(), vec![e]).expect("valid");
    rig.sync(T0, &UnknownCounts);
    (rig, n)
}

#[test]
fn endpoint_that_comes_back_while_draining_is_restored() {
    let mut rig = Rig::new();
    let web = name("web");
    rig.inputs
        .upsert_service(web.clone(), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs
        .set_endpoints(web.clone(), vec![])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs
        .set_endpoints(web, vec![ep("10.1.0.1")])
        .expect("valid");
    let key = tcp("10.96.0.10", 80);
    let ops = rig.sync(T0 + Duration::from_secs(5), &UnknownCounts);
    assert_eq!(
        ops,
        vec![Op::UpdateDest {
            service: key,
            dest: RealServer::masq(ip("10.1.0.1"), 8080, 1)
        }]
    );
    assert_eq!(rig.engine.draining().count(), 0);
}

#[test]
fn deleting_a_service_deletes_its_dests_with_it_and_forgets_draining() {
    let mut rig = Rig::new();
    let web = name("web");
    rig.inputs
        .upsert_service(web.clone(), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1"), ep("10.1.0.2")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs.remove_service(&web);
    let ops = rig.sync(T0, &UnknownCounts);
    assert_eq!(
        ops,
        vec![
            Op::DeleteService(tcp("10.96.0.10", 80)),
            Op::RemoveAddress(ip("10.96.0.10"))
        ]
    );
    assert_eq!(rig.engine.draining().count(), 0);
}

#[test]
fn an_address_shared_by_two_services_stays_until_both_are_gone() {
    let mut rig = Rig::new();
    let mut a = svc("10.96.0.10");
    a.external_ips = vec![ip("203.0.113.1")];
    let mut b = svc("10.96.0.11");
    b.external_ips = vec![ip("203.0.113.1")];
    b.ports[0].port = 443;
    rig.inputs.upsert_service(name("a"), a).expect("valid");
    rig.inputs.upsert_service(name("b"), b).expect("valid");
    let ops = rig.sync(T0, &UnknownCounts);
    let adds = ops
        .iter()
        .filter(|o| **o == Op::AddAddress(ip("203.0.113.1")))
        .count();
    assert_eq!(adds, 1);
    rig.inputs.remove_service(&name("a"));
    let ops = rig.sync(T0, &UnknownCounts);
    assert!(!ops.contains(&Op::RemoveAddress(ip("203.0.113.1"))));
    assert!(rig.kernel.addresses.contains(&ip("203.0.113.1")));
    rig.inputs.remove_service(&name("b"));
    let ops = rig.sync(T0, &UnknownCounts);
    assert!(ops.contains(&Op::RemoveAddress(ip("203.0.113.1"))));
}

#[test]
fn contested_virtual_server_goes_to_the_first_and_passes_to_the_waiter() {
    let mut rig = Rig::new();
    let mut a = svc("10.96.0.10");
    a.external_ips = vec![ip("203.0.113.1")];
    let mut b = svc("10.96.0.11");
    b.external_ips = vec![ip("203.0.113.1")];
    rig.inputs.upsert_service(name("a"), a).expect("valid");
    rig.inputs
        .set_endpoints(name("a"), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.inputs.upsert_service(name("b"), b).expect("valid");
    rig.inputs
        .set_endpoints(name("b"), vec![ep("10.1.0.2")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    let contested = tcp("203.0.113.1", 80);
    let conflicts = rig.engine.conflicts();
    assert_eq!(conflicts.len(), 1);
    assert_eq!(conflicts[0].key, contested);
    assert_eq!(conflicts[0].owner, name("a"));
    assert_eq!(conflicts[0].waiting, vec![name("b")]);
    rig.inputs.remove_service(&name("a"));
    // The rig checks the kernel accepts the delete-then-add of the same key.
    rig.sync(T0, &UnknownCounts);
    let entry = rig.kernel.services.get(&contested).expect("b has it now");
    assert_eq!(
        entry.dests.keys().copied().collect::<Vec<_>>(),
        vec![dest("10.1.0.2")]
    );
    assert!(rig.engine.conflicts().is_empty());
}

#[test]
fn node_change_recomputes_node_ports() {
    let mut rig = Rig::new();
    let mut s = svc("10.96.0.10");
    s.ports[0].node_port = Some(30080);
    rig.inputs.upsert_service(name("np"), s).expect("valid");
    rig.sync(T0, &UnknownCounts);
    let mut n = node();
    n.node_ips_v4 = vec!["192.168.0.11".parse().expect("literal")];
    rig.inputs.set_node(n).expect("valid");
    let ops = rig.sync(T0, &UnknownCounts);
    assert!(ops.contains(&Op::DeleteService(tcp("192.168.0.10", 30080))));
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::AddService(v) if v.key == tcp("192.168.0.11", 30080)))
    );
}

#[test]
fn resync_adopts_a_matching_kernel_without_ops_and_repairs_drift() {
    let mut rig = Rig::new();
    rig.inputs
        .upsert_service(name("web"), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(name("web"), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    let snapshot = rig.kernel.clone();

    // A fresh engine (a restart) adopts the same kernel table with no ops.
    let mut fresh = Engine::new();
    let ops = fresh.resync(&mut rig.inputs, &snapshot, T0, &UnknownCounts);
    assert!(ops.is_empty(), "{ops:?}");

    // Drift: someone changed a weight, added a stray service, and removed our address.
    let mut drifted = snapshot.clone();
    let key = tcp("10.96.0.10", 80);
    if let Some(e) = drifted.services.get_mut(&key) {
        e.dests
            .insert(dest("10.1.0.1"), RealServer::masq(ip("10.1.0.1"), 8080, 5));
    }
    let stray = tcp("10.96.0.99", 80);
    let server = kube_ipvs_diff::VirtualServer {
        key: stray,
        ..snapshot.services[&key].server
    };
    drifted.services.insert(
        stray,
        ServiceEntry {
            server,
            dests: Default::default(),
        },
    );
    drifted.addresses.clear();
    let ops = fresh.resync(&mut rig.inputs, &drifted, T0, &UnknownCounts);
    let mut repaired = drifted.clone();
    repaired.apply_all(&ops).expect("kernel accepts");
    assert_eq!(repaired, snapshot);
}

#[test]
fn resync_drains_unknown_tcp_dests_and_keeps_their_start_time() {
    let mut rig = Rig::new();
    rig.inputs
        .upsert_service(name("web"), svc("10.96.0.10"))
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    let key = tcp("10.96.0.10", 80);
    let mut observed = rig.kernel.clone();
    if let Some(e) = observed.services.get_mut(&key) {
        e.dests
            .insert(dest("10.1.0.9"), RealServer::masq(ip("10.1.0.9"), 8080, 1));
    }
    let ops = rig
        .engine
        .resync(&mut rig.inputs, &observed, T0, &UnknownCounts);
    assert_eq!(
        ops,
        vec![Op::UpdateDest {
            service: key,
            dest: RealServer::masq(ip("10.1.0.9"), 8080, 0)
        }]
    );
    observed.apply_all(&ops).expect("kernel accepts");
    // A later resync sees it at weight 0 and leaves it draining from T0, then deletes it at
    // the timeout.
    let later = T0 + Duration::from_secs(10);
    assert!(
        rig.engine
            .resync(&mut rig.inputs, &observed, later, &UnknownCounts)
            .is_empty()
    );
    let timeout = rig.inputs.node().options.graceful_termination_timeout;
    let ops = rig
        .engine
        .resync(&mut rig.inputs, &observed, T0 + timeout, &UnknownCounts);
    assert_eq!(
        ops,
        vec![Op::DeleteDest {
            service: key,
            dest: dest("10.1.0.9")
        }]
    );
}

#[test]
fn endpoint_back_in_the_sync_where_its_drain_times_out_is_restored_not_readded() {
    let mut rig = Rig::new();
    let web = name("web");
    rig.inputs
        .upsert_service(web.clone(), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs
        .set_endpoints(web.clone(), vec![])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs
        .set_endpoints(web, vec![ep("10.1.0.1")])
        .expect("valid");
    let timeout = rig.inputs.node().options.graceful_termination_timeout;
    // The rig checks the kernel accepts the batch; a delete plus add would be refused.
    let ops = rig.sync(T0 + timeout, &UnknownCounts);
    assert_eq!(
        ops,
        vec![Op::UpdateDest {
            service: tcp("10.96.0.10", 80),
            dest: RealServer::masq(ip("10.1.0.1"), 8080, 1)
        }]
    );
}

#[test]
fn zero_drain_timeout_deletes_tcp_dests_at_once() {
    let mut rig = Rig::new();
    let mut n = node();
    n.options.graceful_termination_timeout = Duration::ZERO;
    rig.inputs.set_node(n).expect("valid");
    let web = name("web");
    rig.inputs
        .upsert_service(web.clone(), svc("10.96.0.10"))
        .expect("valid");
    rig.inputs
        .set_endpoints(web.clone(), vec![ep("10.1.0.1")])
        .expect("valid");
    rig.sync(T0, &UnknownCounts);
    rig.inputs.set_endpoints(web, vec![]).expect("valid");
    let ops = rig.sync(T0, &UnknownCounts);
    assert_eq!(
        ops,
        vec![Op::DeleteDest {
            service: tcp("10.96.0.10", 80),
            dest: dest("10.1.0.1")
        }]
    );
}
