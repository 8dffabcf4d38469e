//! The path every Kubernetes object takes in the agent, as the targets drive it: tracker,
//! change set, input store, engine, and the kernel table the engine's ops build.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_ipvs::ipvsadm::{self, Counters, Dest};
use kube_ipvs_diff::{Engine, Inputs, NodeContext, Table, UnknownCounts};
use kube_ipvs_watch::{Tracker, TranslateOptions};

/// One agent's state: what it was told, what it computed, and the kernel table its ops built.
pub(crate) struct Agent {
    pub(crate) tracker: Tracker,
    pub(crate) inputs: Inputs,
    pub(crate) engine: Engine,
    pub(crate) table: Table,
}

/// The node every target's agent runs on.
pub(crate) const NODE: &str = "node-a";

impl Agent {
    pub(crate) fn new() -> Self {
        let mut ctx = NodeContext::new(NODE);
        ctx.set_node_ips([
            IpAddr::V4(Ipv4Addr::new(192, 168, 56, 10)),
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10)),
        ]);
        Agent {
            tracker: Tracker::new(TranslateOptions::default()),
            inputs: Inputs::new(ctx).expect("the fixed node context is valid"),
            engine: Engine::new(),
            table: Table::default(),
        }
    }

    /// Hands the tracker's change set to the input store and the engine at `now`, and applies the
    /// ops to the table. What must hold for any objects:
    /// * the input store accepts everything translation let through (translation screens for
    ///   what the model rejects);
    /// * the ops apply in order to the table the earlier ops built (no add of what exists, no
    ///   delete or edit of what does not), and leave exactly the engine's desired table.
    pub(crate) fn sync(&mut self, now: Duration) {
        if let Some(cs) = self.tracker.take_change_set() {
            let rejected = cs.apply_to(&mut self.inputs);
            assert!(
                rejected.is_empty(),
                "the model rejected what translation let through: {rejected:?}"
            );
        }
        let ops = self.engine.sync(&mut self.inputs, now, &UnknownCounts);
        if let Err(e) = self.table.apply_all(&ops) {
            panic!("the engine's ops do not apply in order: {e}\nops: {ops:#?}");
        }
        assert!(
            self.table == self.engine.desired_table(),
            "the ops did not build the engine's desired table\nops: {ops:#?}"
        );
        let _ = kube_ipvs::agent::sets::desired_members(&self.inputs);
    }
}

/// One agent told `services`, `slices` and its Node, synced once.
pub(crate) fn converge(
    services: &[Service],
    slices: &[EndpointSlice],
    node: Option<&Node>,
) -> Agent {
    let mut agent = Agent::new();
    agent.tracker.relist_services(services);
    agent.tracker.relist_slices(slices);
    if let Some(n) = node {
        agent.tracker.apply_node(n);
    }
    agent.sync(Duration::ZERO);
    agent
}

/// The table `dump_args` renders: a TCP and a UDP service of each family and a fwmark service.
pub(crate) fn dump_table() -> ipvsadm::Table {
    let v4 = |s: &str| IpAddr::V4(s.parse().expect("literal"));
    let v6 = |s: &str| IpAddr::V6(s.parse().expect("literal"));
    let dest = |addr: IpAddr, port: u16| Dest {
        af: if addr.is_ipv4() {
            ipvsadm::AF_INET
        } else {
            ipvsadm::AF_INET6
        },
        addr,
        port,
        fwd: 0,
        weight: 1,
        u_threshold: 0,
        l_threshold: 0,
        active_conns: 0,
        inact_conns: 0,
        persist_conns: 0,
        tun_type: 0,
        tun_port: 0,
        tun_flags: 0,
        stats: Counters::default(),
    };
    let svc =
        |protocol: u16, addr: IpAddr, port: u16, fwmark: u32, dests: Vec<Dest>| ipvsadm::Service {
            af: if addr.is_ipv4() {
                ipvsadm::AF_INET
            } else {
                ipvsadm::AF_INET6
            },
            protocol,
            addr,
            port,
            fwmark,
            scheduler: "rr".to_owned(),
            flags: 0x2,
            timeout: 0,
            netmask: if addr.is_ipv4() { 0xffff_ffff } else { 128 },
            pe_name: String::new(),
            stats: Counters::default(),
            dests,
        };
    ipvsadm::Table {
        version: 0x01_02_01,
        conn_tab_size: 4096,
        services: vec![
            svc(
                6,
                v4("10.96.0.1"),
                443,
                0,
                vec![dest(v4("10.244.1.2"), 6443)],
            ),
            svc(
                17,
                v4("10.96.0.10"),
                53,
                0,
                vec![dest(v4("10.244.1.3"), 53)],
            ),
            svc(
                6,
                v6("fd00:96::1"),
                80,
                0,
                vec![dest(v6("fd00:244::2"), 8080)],
            ),
            svc(0, v4("0.0.0.0"), 0, 7, vec![dest(v4("10.244.1.4"), 0)]),
        ],
    }
}
