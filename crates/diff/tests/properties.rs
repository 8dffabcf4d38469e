//! Property tests of the four promises in the issue:
//! 1. applying `full_diff(desired, observed)` to `observed` gives `desired`;
//! 2. `full_diff(x, x)` is empty (and a sync with no changes is empty);
//! 3. no op touches a Service whose inputs did not change;
//! 4. the number of ops equals the number of entries that differ (minimal).
//!
//! And one promise of `endpoint_decisions`: the endpoints it calls real servers are exactly
//! those `service_table` programs, for every virtual server and the policy that reaches it.
//!
//! Tables are drawn from small pools of addresses and ports so that overlaps (same key, other
//! attributes) are common. The engine properties drive random input changes through
//! [`Engine::sync`] and check the result against a kernel model and a from-scratch recompute.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use kube_ipvs_diff::desired::dest_keys;
use kube_ipvs_diff::{
    ConnectionCounts, DestKey, Endpoint, EndpointPort, Engine, Fingerprint, Inputs, Op, Ownership,
    Protocol, RealServer, Scheduler, ServiceEntry, ServiceInfo, ServiceName, ServicePort,
    SessionAffinity, Table, TrafficDistribution, TrafficPolicy, VirtualKey, VirtualServer,
    endpoint_decisions, full_diff, service_table,
};
use proptest::prelude::*;

fn pool_addr(i: u8) -> IpAddr {
    if i % 3 == 2 {
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, u16::from(i)))
    } else {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, i))
    }
}

fn arb_server(key: VirtualKey) -> impl Strategy<Value = VirtualServer> {
    (
        prop_oneof![
            Just(Scheduler::RR),
            Just("wrr".parse::<Scheduler>().expect("valid")),
            Just("mh:fallback".parse::<Scheduler>().expect("valid")),
        ],
        prop_oneof![Just(None), Just(Some(10u32)), Just(Some(10_800u32))],
    )
        .prop_map(move |(scheduler, persistence)| VirtualServer {
            key,
            scheduler,
            persistence,
            netmask: if key.addr().is_some_and(|a| a.is_ipv6()) {
                128
            } else {
                32
            },
        })
}

fn arb_key() -> impl Strategy<Value = VirtualKey> {
    (
        prop_oneof![Just(Protocol::Tcp), Just(Protocol::Udp)],
        0u8..6,
        prop_oneof![Just(80u16), Just(443u16)],
    )
        .prop_map(|(p, a, port)| VirtualKey::inet(p, pool_addr(a), port))
}

fn arb_entry(key: VirtualKey) -> impl Strategy<Value = ServiceEntry> {
    let dests = prop::collection::btree_map(
        (0u8..6, prop_oneof![Just(8080u16), Just(9090u16)]),
        0u32..3,
        0..5,
    );
    (arb_server(key), dests).prop_map(|(server, dests)| ServiceEntry {
        server,
        dests: dests
            .into_iter()
            .map(|((a, port), weight)| {
                let addr = IpAddr::V4(Ipv4Addr::new(10, 1, 0, a));
                (DestKey { addr, port }, RealServer::masq(addr, port, weight))
            })
            .collect(),
    })
}

fn arb_table() -> impl Strategy<Value = Table> {
    let services = prop::collection::btree_set(arb_key(), 0..6).prop_flat_map(|keys| {
        keys.into_iter()
            .map(|k| arb_entry(k).prop_map(move |e| (k, e)))
            .collect::<Vec<_>>()
    });
    let addrs = prop::collection::btree_set((0u8..6).prop_map(pool_addr), 0..4);
    (services, addrs).prop_map(|(services, addresses)| Table {
        services: services.into_iter().collect(),
        addresses,
    })
}

/// Entries that differ between two tables, counted independently of `full_diff`: each
/// address, virtual server and real server on its own, except that the real servers of a
/// virtual server that is only in `observed` go with it.
fn differing_entries(desired: &Table, observed: &Table) -> usize {
    let addrs = desired
        .addresses
        .symmetric_difference(&observed.addresses)
        .count();
    let keys: BTreeSet<&VirtualKey> = desired
        .services
        .keys()
        .chain(observed.services.keys())
        .collect();
    let mut n = addrs;
    for k in keys {
        match (desired.services.get(k), observed.services.get(k)) {
            (Some(d), None) => n += 1 + d.dests.len(),
            (None, Some(_)) => n += 1,
            (Some(d), Some(o)) => {
                n += usize::from(d.server != o.server);
                let dk: BTreeSet<_> = d.dests.keys().chain(o.dests.keys()).collect();
                n += dk
                    .into_iter()
                    .filter(|k| d.dests.get(k) != o.dests.get(k))
                    .count();
            }
            (None, None) => {}
        }
    }
    n
}

/// Cases to run; failures are not persisted to files (integration tests have no `lib.rs` for
/// proptest to put them next to), the seed is printed instead.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// Promise 1: the diff, applied in its order by the kernel's rules, gives the desired table.
    #[test]
    fn applying_the_diff_gives_desired(desired in arb_table(), observed in arb_table()) {
        let ops = full_diff(&desired, &observed, Ownership::default());
        let mut kernel = observed.clone();
        kernel.apply_all(&ops).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(kernel, desired);
    }

    /// Promise 2: a table diffed against itself needs nothing.
    #[test]
    fn diff_of_a_table_with_itself_is_empty(x in arb_table()) {
        prop_assert!(full_diff(&x, &x, Ownership::default()).is_empty());
    }

    /// Promise 4: one op per differing entry, no more.
    #[test]
    fn diff_is_minimal(desired in arb_table(), observed in arb_table()) {
        let ops = full_diff(&desired, &observed, Ownership::default());
        prop_assert_eq!(ops.len(), differing_entries(&desired, &observed));
    }
}

/// Counts that say every real server is idle, so removals are immediate and the kernel ends up
/// exactly at the desired table.
struct Idle;

impl ConnectionCounts for Idle {
    fn connections(&self, _: &VirtualKey, _: &DestKey) -> Option<u64> {
        Some(0)
    }
}

/// One Service's inputs, drawn so each Service `i` has VIPs of its own (10.96.i.x, its own LB
/// IP and nodePort) and conflicts between Services cannot occur: every op can then be traced
/// to exactly one Service.
#[derive(Debug, Clone)]
struct SvcInput {
    info: Option<ServiceInfo>,
    endpoints: Vec<Endpoint>,
}

fn arb_svc_input(i: u8, shared_lb: bool) -> impl Strategy<Value = SvcInput> {
    let ports = prop::collection::btree_map(0u8..3, any::<bool>(), 1..3);
    let eps = prop::collection::btree_map(
        0u8..8,
        (0u8..4, any::<bool>(), prop::option::of(0u8..2)),
        0..6,
    );
    (
        any::<bool>(),
        ports,
        eps,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::option::weighted(0.8, Just(())),
    )
        .prop_map(
            move |(dual, ports, eps, affinity, etp_local, lb, present)| {
                let mut cluster_ips = vec![IpAddr::V4(Ipv4Addr::new(10, 96, i, 1))];
                if dual {
                    cluster_ips.push(IpAddr::V6(Ipv6Addr::new(
                        0xfd00,
                        0x96,
                        0,
                        0,
                        0,
                        0,
                        u16::from(i),
                        1,
                    )));
                }
                let info = ServiceInfo {
                    cluster_ips,
                    ports: ports
                        .iter()
                        .map(|(p, np)| ServicePort {
                            name: format!("p{p}"),
                            protocol: if *p == 2 {
                                Protocol::Udp
                            } else {
                                Protocol::Tcp
                            },
                            port: 80 + u16::from(*p),
                            node_port: np.then_some(30_000 + u16::from(i) * 10 + u16::from(*p)),
                        })
                        .collect(),
                    load_balancer_ips: if lb {
                        // Shared: every Service's LB IP is one of two, so they contest them.
                        let host = if shared_lb { i % 2 } else { i };
                        vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, host))]
                    } else {
                        vec![]
                    },
                    session_affinity: if affinity {
                        SessionAffinity::ClientIp {
                            timeout_seconds: 60,
                        }
                    } else {
                        SessionAffinity::None
                    },
                    external_traffic_policy: if etp_local {
                        TrafficPolicy::Local
                    } else {
                        TrafficPolicy::Cluster
                    },
                    ..ServiceInfo::default()
                };
                let endpoints = eps
                    .into_iter()
                    .map(|(a, (state, v6, node))| {
                        let addr = if v6 {
                            IpAddr::V6(Ipv6Addr::new(
                                0xfd00,
                                1,
                                0,
                                0,
                                0,
                                0,
                                u16::from(i),
                                u16::from(a),
                            ))
                        } else {
                            IpAddr::V4(Ipv4Addr::new(10, 1, i, a))
                        };
                        let mut e = Endpoint::ready(
                            addr,
                            (0u8..3)
                                .map(|p| EndpointPort {
                                    name: format!("p{p}"),
                                    port: 8000 + u16::from(p),
                                    protocol: if p == 2 { Protocol::Udp } else { Protocol::Tcp },
                                })
                                .collect(),
                        );
                        // 0 ready, 1 serving-terminating, 2 not serving, 3 ready.
                        e.ready = state == 0 || state == 3;
                        e.serving = state != 2;
                        e.terminating = state == 1 || state == 2;
                        e.node_name = node.map(|n| {
                            if n == 0 {
                                "node-a".into()
                            } else {
                                "node-b".into()
                            }
                        });
                        e
                    })
                    .collect();
                SvcInput {
                    info: present.map(|()| info),
                    endpoints,
                }
            },
        )
}

const N: u8 = 5;

fn arb_world() -> impl Strategy<Value = Vec<SvcInput>> {
    (0..N).map(|i| arb_svc_input(i, false)).collect::<Vec<_>>()
}

fn arb_contested_world() -> impl Strategy<Value = Vec<SvcInput>> {
    (0..N).map(|i| arb_svc_input(i, true)).collect::<Vec<_>>()
}

fn svc_name(i: usize) -> ServiceName {
    ServiceName::new("default", format!("s{i}"))
}

fn load(inputs: &mut Inputs, i: usize, s: &SvcInput) -> Result<(), TestCaseError> {
    let name = svc_name(i);
    match &s.info {
        Some(info) => inputs
            .upsert_service(name.clone(), info.clone())
            .map_err(|e| TestCaseError::fail(e.to_string()))?,
        None => inputs.remove_service(&name),
    }
    inputs
        .set_endpoints(name, s.endpoints.clone())
        .map_err(|e| TestCaseError::fail(e.to_string()))
}

/// Which Service owns each key and address, from a from-scratch compute.
fn owners(
    inputs: &Inputs,
    world_len: usize,
) -> (HashMap<VirtualKey, usize>, HashMap<IpAddr, usize>) {
    let mut keys = HashMap::new();
    let mut addrs = HashMap::new();
    for i in 0..world_len {
        let n = svc_name(i);
        let t = service_table(inputs.service(&n), inputs.endpoints(&n), inputs.node());
        for (s, _) in &t.servers {
            keys.insert(s.key, i);
        }
        for a in &t.addresses {
            addrs.insert(*a, i);
        }
    }
    (keys, addrs)
}

proptest! {
    #![proptest_config(config(256))]

    /// Promises 1-4 through the incremental engine: after each round of random changes, the ops
    /// are accepted by the kernel model and bring it to what a fresh engine computes from
    /// scratch; ops only touch Services that changed in that round, one op per changed entry;
    /// a round without changes yields no ops.
    #[test]
    fn incremental_sync_matches_full_recompute_and_touches_only_changed(
        start in arb_world(),
        rounds in prop::collection::vec(
            (prop::collection::btree_set(0..usize::from(N), 0..3), arb_world()), 1..5),
    ) {
        let mut inputs = Inputs::new(common::node()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (i, s) in start.iter().enumerate() {
            load(&mut inputs, i, s)?;
        }
        let mut engine = Engine::new();
        let mut kernel = Table::default();
        let now = Duration::from_secs(1);
        let ops = engine.sync(&mut inputs, now, &Idle);
        kernel.apply_all(&ops).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(engine.sync(&mut inputs, now, &Idle).is_empty(), "no changes, no ops");

        for (changed, world) in rounds {
            let (old_keys, old_addrs) = owners(&inputs, usize::from(N));
            for i in &changed {
                load(&mut inputs, *i, &world[*i])?;
            }
            let (new_keys, new_addrs) = owners(&inputs, usize::from(N));
            let ops = engine.sync(&mut inputs, now, &Idle);
            for op in &ops {
                let owner = match op {
                    Op::AddAddress(a) | Op::RemoveAddress(a) => {
                        old_addrs.get(a).or_else(|| new_addrs.get(a))
                    }
                    other => other.service().and_then(|k| old_keys.get(k).or_else(|| new_keys.get(k))),
                };
                let owner = owner.copied();
                prop_assert!(
                    owner.is_some_and(|o| changed.contains(&o)),
                    "op {} touches service {:?}, changed were {:?}", op, owner, changed
                );
            }
            let before = kernel.clone();
            kernel.apply_all(&ops).map_err(|e| TestCaseError::fail(e.to_string()))?;
            // Promise 4 on the incremental path: one op per entry that changed.
            prop_assert_eq!(ops.len(), differing_entries(&kernel, &before));

            // From scratch: a fresh engine resyncing against an empty kernel.
            let mut fresh = Engine::new();
            let mut scratch = Table::default();
            let all = fresh.resync(&mut inputs.clone(), &Table::default(), now, &Idle);
            scratch.apply_all(&all).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&kernel, &scratch);
            prop_assert_eq!(&kernel, &engine.desired_table());
            // The fingerprint kept through the changes is the desired table's.
            prop_assert_eq!(engine.fingerprint(), Fingerprint::of_table(&kernel, Ownership::of(&inputs.node().options)));
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// A resync given the observed table's fingerprint gives the same ops as one that diffs,
    /// and leaves the same real servers draining, whether the kernel holds the desired table
    /// (with real servers draining after a round of changes) or drifted from it (extra, missing
    /// or changed entries from a random table laid over it), with idle or unknown connection
    /// counts; it matches exactly when the kernel's part the engine owns is the desired table.
    #[test]
    fn a_fingerprinted_resync_gives_the_ops_of_a_diffed_one(
        world in arb_world(),
        changed in prop::collection::btree_set(0..usize::from(N), 0..4),
        next in arb_world(),
        drift in prop::option::of(arb_table()),
        idle in any::<bool>(),
    ) {
        // The same history twice: a sync of `world`, then of the changed Services with
        // unknown counts (so removed TCP real servers drain).
        let history = || -> Result<(Engine, Inputs, Table), TestCaseError> {
            let mut inputs = Inputs::new(common::node()).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for (i, s) in world.iter().enumerate() {
                load(&mut inputs, i, s)?;
            }
            let mut engine = Engine::new();
            let mut kernel = Table::default();
            let unknown = kube_ipvs_diff::UnknownCounts;
            let ops = engine.sync(&mut inputs, Duration::from_secs(1), &unknown);
            kernel.apply_all(&ops).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for i in &changed {
                load(&mut inputs, *i, &next[*i])?;
            }
            let ops = engine.sync(&mut inputs, Duration::from_secs(2), &unknown);
            kernel.apply_all(&ops).map_err(|e| TestCaseError::fail(e.to_string()))?;
            Ok((engine, inputs, kernel))
        };
        let (mut diffed, mut inputs, mut observed) = history()?;
        let (mut fingerprinted, mut same_inputs, _) = history()?;
        if let Some(drift) = drift {
            observed.services.extend(drift.services);
            observed.addresses.extend(drift.addresses);
            if let Some(first) = observed.addresses.first().copied() {
                observed.addresses.remove(&first);
            }
        }
        let options = inputs.node().options.clone();
        let owned = Ownership::of(&options);
        let mut ours = observed.clone();
        ours.services.retain(|k, _| owned.key(k));
        ours.addresses.retain(|a| owned.addr(*a));
        let desired = fingerprinted.desired_table();
        // One virtual server of the desired table at a time, as a reconcile takes the engine's
        // word for those it changed during its read.
        // Its fingerprint too, without building it.
        for (k, e) in &desired.services {
            prop_assert_eq!(fingerprinted.asked_entry(k), Some(e.clone()));
            prop_assert_eq!(
                fingerprinted.asked_fingerprint(k),
                Fingerprint::of_entry(&e.server, e.dests.values())
            );
        }
        for k in observed.services.keys().filter(|k| !desired.services.contains_key(k)) {
            prop_assert_eq!(fingerprinted.asked_entry(k), None);
            prop_assert_eq!(fingerprinted.asked_fingerprint(k), Fingerprint::default());
        }
        let f = Fingerprint::of_table(&observed, owned);
        // Whether the resync will match is known before it, with nothing left to sync.
        prop_assert_eq!(fingerprinted.holds_desired(&same_inputs, f), ours == desired);
        let now = Duration::from_secs(3);
        let unknown = kube_ipvs_diff::UnknownCounts;
        let counts: &dyn ConnectionCounts = if idle { &Idle } else { &unknown };
        let want = diffed.resync(&mut inputs, &observed, now, counts);
        let (got, matched) = fingerprinted.resync_fingerprinted(&mut same_inputs, &observed, f, now, counts);
        prop_assert_eq!(matched, ours == desired);
        prop_assert_eq!(got, want);
        prop_assert_eq!(
            fingerprinted.draining().collect::<Vec<_>>(),
            diffed.draining().collect::<Vec<_>>()
        );
    }
}

/// The minimality promise for the engine path too, on a hand-made case: changing one endpoint
/// of one Service among many yields exactly the ops for that endpoint.
#[test]
fn one_endpoint_change_is_one_op_per_virtual_server_it_backs() {
    let mut inputs = Inputs::new(common::node()).expect("valid node");
    for i in 0..50u8 {
        let name = svc_name(usize::from(i));
        inputs
            .upsert_service(name.clone(), common::svc(&format!("10.96.0.{i}")))
            .expect("valid");
        inputs
            .set_endpoints(name, vec![common::ep("10.1.0.1"), common::ep("10.1.0.2")])
            .expect("valid");
    }
    let mut engine = Engine::new();
    engine.sync(&mut inputs, Duration::ZERO, &Idle);
    inputs
        .set_endpoints(
            svc_name(7),
            vec![common::ep("10.1.0.1"), common::ep("10.1.0.3")],
        )
        .expect("valid");
    let ops = engine.sync(&mut inputs, Duration::ZERO, &Idle);
    let key = VirtualKey::inet(Protocol::Tcp, common::ip("10.96.0.7"), 80);
    assert_eq!(
        ops,
        vec![
            Op::AddDest {
                service: key,
                dest: RealServer::masq(common::ip("10.1.0.3"), 8080, 1)
            },
            Op::DeleteDest {
                service: key,
                dest: DestKey {
                    addr: common::ip("10.1.0.2"),
                    port: 8080
                }
            },
        ]
    );
}

proptest! {
    #![proptest_config(config(256))]

    /// Services contesting LB IPs (same address and port): every batch is accepted by the
    /// kernel model, the kernel equals the engine's view, every wanted virtual server exists,
    /// and each one is exactly what one of the Services wanting it computes.
    #[test]
    fn contested_virtual_servers_stay_consistent(
        start in arb_contested_world(),
        rounds in prop::collection::vec(
            (prop::collection::btree_set(0..usize::from(N), 0..3), arb_contested_world()), 1..5),
    ) {
        let mut inputs = Inputs::new(common::node()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (i, s) in start.iter().enumerate() {
            load(&mut inputs, i, s)?;
        }
        let mut engine = Engine::new();
        let mut kernel = Table::default();
        let now = Duration::from_secs(1);
        for (changed, world) in std::iter::once((BTreeSet::new(), start.clone())).chain(rounds) {
            for i in &changed {
                load(&mut inputs, *i, &world[*i])?;
            }
            let ops = engine.sync(&mut inputs, now, &Idle);
            kernel.apply_all(&ops).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&kernel, &engine.desired_table());
            prop_assert_eq!(engine.desired_size(), (kernel.services.len(), kernel.dest_count()));
            let mut wanted: HashMap<VirtualKey, Vec<ServiceEntry>> = HashMap::new();
            for i in 0..usize::from(N) {
                let n = svc_name(i);
                let t = service_table(inputs.service(&n), inputs.endpoints(&n), inputs.node());
                for (server, dests) in t.servers {
                    wanted.entry(server.key).or_default().push(ServiceEntry {
                        server,
                        dests: dests.into_iter().map(|d| (d.key, d)).collect(),
                    });
                }
            }
            prop_assert_eq!(
                kernel.services.keys().copied().collect::<BTreeSet<_>>(),
                wanted.keys().copied().collect::<BTreeSet<_>>()
            );
            for (key, entry) in &kernel.services {
                prop_assert!(wanted[key].contains(entry), "{} is nobody's version", key);
            }
            // Owners handing a virtual server over keep the fingerprint the kernel's.
            prop_assert_eq!(
                engine.fingerprint(),
                Fingerprint::of_table(&kernel, Ownership::of(&inputs.node().options))
            );
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Graceful termination under random changes with unknown connection counts and a clock
    /// that moves 400 s per round (the timeout is 900 s): every batch is accepted, the kernel
    /// always equals the engine's view (desired plus draining at weight 0), and once the
    /// timeout has passed with no further change the kernel is exactly the desired table.
    #[test]
    fn draining_converges_to_desired_after_the_timeout(
        start in arb_world(),
        rounds in prop::collection::vec(
            (prop::collection::btree_set(0..usize::from(N), 1..4), arb_world(), any::<bool>()),
            2..6),
    ) {
        let mut inputs = Inputs::new(common::node()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (i, s) in start.iter().enumerate() {
            load(&mut inputs, i, s)?;
        }
        let mut engine = Engine::new();
        let mut kernel = Table::default();
        let mut now = Duration::from_secs(1);
        let counts = kube_ipvs_diff::UnknownCounts;
        kernel
            .apply_all(&engine.sync(&mut inputs, now, &counts))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (changed, world, back) in rounds {
            now += Duration::from_secs(400);
            // Going back to the start state makes endpoints return while they drain.
            let source = if back { &start } else { &world };
            for i in &changed {
                load(&mut inputs, *i, &source[*i])?;
            }
            let ops = engine.sync(&mut inputs, now, &counts);
            kernel.apply_all(&ops).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&kernel, &engine.desired_table());
            for (_, _, d) in engine.draining() {
                prop_assert_eq!(d.dest.weight, 0);
            }
            prop_assert_eq!(engine.desired_size(), (kernel.services.len(), kernel.dest_count()));
        }
        now += Duration::from_secs(900);
        let ops = engine.sync(&mut inputs, now, &counts);
        kernel.apply_all(&ops).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(engine.draining().count(), 0);
        prop_assert_eq!(engine.fingerprint(), Fingerprint::of_table(&kernel, Ownership::of(&inputs.node().options)));
        let mut scratch = Table::default();
        let all = Engine::new().resync(&mut inputs.clone(), &Table::default(), now, &Idle);
        scratch.apply_all(&all).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&kernel, &scratch);
    }
}

/// A Service from [`arb_svc_input`] with more of what the selection reads: an
/// internalTrafficPolicy, a trafficDistribution, endpoint nodes and zones, hints on none, some
/// or all endpoints (all is what turns a hint mode on), endpoints that are only not ready, and
/// endpoints without the first port.
fn arb_topology_svc(i: u8) -> impl Strategy<Value = SvcInput> {
    let per_endpoint = prop::collection::vec((0u8..3, 0u8..3, 0u8..3, 0u8..4, 0u8..8), 8);
    (
        arb_svc_input(i, false),
        any::<bool>(),
        0u8..5,
        0u8..5,
        per_endpoint,
    )
        .prop_map(|(mut s, itp_local, distribution, hint_mode, extra)| {
            if let Some(info) = &mut s.info {
                info.internal_traffic_policy = if itp_local {
                    TrafficPolicy::Local
                } else {
                    TrafficPolicy::Cluster
                };
                info.traffic_distribution = match distribution {
                    0 => None,
                    1 => Some(TrafficDistribution::PreferClose),
                    2 => Some(TrafficDistribution::PreferSameZone),
                    3 => Some(TrafficDistribution::PreferSameNode),
                    _ => Some(TrafficDistribution::Other("Elsewhere".into())),
                };
            }
            let zone = |z: u8| ["zone-a", "zone-b", "zone-c"][usize::from(z)];
            for (e, (z, hz, hn, node, twist)) in s.endpoints.iter_mut().zip(extra) {
                // Half on this node (node-a of `common::node`), a quarter elsewhere or on none.
                e.node_name = ["node-a", "node-b", "node-a"]
                    .get(usize::from(node))
                    .map(|n| (*n).into());
                e.zone = (z != 2).then(|| zone(z).into());
                // 0 and 4: no hints; 1: zone hints on some; 2: zone hints on all; 3: node and
                // zone hints on all.
                let zones: Vec<String> = match (hint_mode, hz) {
                    (0 | 4, _) | (1, 2) => vec![],
                    (_, 2) => vec![zone(0).into(), zone(1).into()],
                    (_, z) => vec![zone(z).into()],
                };
                e.hints_for_zones = zones.into();
                if hint_mode == 3 {
                    let node = ["node-a", "node-b", "node-c"][usize::from(hn)];
                    e.hints_for_nodes = vec![node.to_owned()].into();
                }
                match twist {
                    0 => (e.ready, e.serving, e.terminating) = (false, false, false),
                    1 => e.ports = e.ports.iter().filter(|p| p.name != "p0").cloned().collect(),
                    _ => {}
                }
            }
            s
        })
}

/// The node IPs of the test node, in both families.
fn node_ips(node: &kube_ipvs_diff::NodeContext) -> Vec<IpAddr> {
    node.node_ips_v4
        .iter()
        .map(|a| IpAddr::V4(*a))
        .chain(node.node_ips_v6.iter().map(|a| IpAddr::V6(*a)))
        .collect()
}

proptest! {
    #![proptest_config(config(1024))]

    /// `endpoint_decisions` and `service_table` agree: for every virtual server the table has,
    /// reached through the port and policy the rules give it (a ClusterIP by
    /// internalTrafficPolicy; an externalIP, LB IP or node IP with a nodePort, in a family the
    /// Service has, by externalTrafficPolicy; the first of a repeated key wins), the endpoints
    /// marked as real servers are exactly its real servers.
    #[test]
    fn endpoint_decisions_name_the_real_servers_service_table_programs(
        s in arb_topology_svc(0),
    ) {
        let node = common::node();
        let Some(info) = &s.info else {
            return Ok(());
        };
        let table = service_table(Some(info), &s.endpoints, &node);
        let family_ok = |ip: &&IpAddr| info.cluster_ips.iter().any(|c| c.is_ipv4() == ip.is_ipv4());
        let node_ips = node_ips(&node);
        let mut reached: Vec<(VirtualKey, &ServicePort, TrafficPolicy, IpAddr)> = Vec::new();
        for port in &info.ports {
            let key = |ip: IpAddr, p: u16| VirtualKey::inet(port.protocol, ip, p);
            for ip in &info.cluster_ips {
                reached.push((key(*ip, port.port), port, info.internal_traffic_policy, *ip));
            }
            for ip in info.external_ips.iter().chain(&info.load_balancer_ips).filter(family_ok) {
                reached.push((key(*ip, port.port), port, info.external_traffic_policy, *ip));
            }
            if let Some(np) = port.node_port {
                for ip in node_ips.iter().filter(family_ok) {
                    reached.push((key(*ip, np), port, info.external_traffic_policy, *ip));
                }
            }
        }
        let mut keys = BTreeSet::new();
        reached.retain(|(k, ..)| keys.insert(*k));
        let table_keys: BTreeSet<VirtualKey> = table.servers.iter().map(|(v, _)| v.key).collect();
        prop_assert_eq!(&keys, &table_keys);
        for (key, port, policy, vip) in reached {
            let decisions = endpoint_decisions(info, port, policy, vip, &s.endpoints, &node);
            prop_assert_eq!(decisions.len(), s.endpoints.len());
            let mut decided = BTreeSet::new();
            for (d, e) in decisions.iter().zip(&s.endpoints) {
                prop_assert_eq!(d.real_server, d.reason.is_real_server());
                if d.real_server {
                    let port = d.target_port.ok_or_else(|| TestCaseError::fail("no port"))?;
                    decided.insert(DestKey { addr: e.addr, port });
                }
            }
            let programmed: BTreeSet<DestKey> = dest_keys(&table, &key).into_iter().collect();
            prop_assert_eq!(decided, programmed, "{}", key);
        }
    }
}
