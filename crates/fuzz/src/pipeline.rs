//! The path every Kubernetes object takes in the agent, as the targets drive it: tracker,
//! change set, input store, engine, and the kernel table the engine's ops build.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_ipvs::ipvsadm::{self, view::service_view};
use kube_ipvs_diff::{Engine, Inputs, NodeContext, Table, UnknownCounts};
use kube_ipvs_netlink::ipvs::{Destination, IpvsMessage, Service as IpvsService};
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

/// The table `dump_args` renders: the service and destination dumps captured from the kernel
/// for the netlink fixtures (TCP and UDP of both families, a fwmark service), through the
/// renderer's own view of the netlink types.
pub(crate) fn dump_table() -> ipvsadm::Table {
    macro_rules! fixture {
        ($name:literal) => {
            include_str!(concat!("../../netlink/tests/fixtures/", $name, ".hex"))
        };
    }
    let captured: [(&str, &[&str]); 4] = [
        (
            fixture!("service_tcp4_wlc"),
            &[fixture!("dest_tcp4_wlc_0"), fixture!("dest_tcp4_wlc_1")],
        ),
        (
            fixture!("service_udp6_sh_port"),
            &[fixture!("dest_udp6_sh_port_0")],
        ),
        (
            fixture!("service_tcp6_wrr_persist_prefix"),
            &[
                fixture!("dest_tcp6_wrr_persist_prefix_0"),
                fixture!("dest_tcp6_wrr_persist_prefix_1"),
            ],
        ),
        (fixture!("service_fwm4_gue"), &[fixture!("dest_fwm4_gue_0")]),
    ];
    let services = captured
        .iter()
        .map(|(svc, dests)| {
            let svc = IpvsMessage::<IpvsService>::parse(&crate::unhex(svc).expect("fixture hex"))
                .expect("a captured service")
                .body;
            let family = svc.key.family();
            let dests: Vec<_> = dests
                .iter()
                .map(|d| {
                    IpvsMessage::<Destination>::parse(
                        &crate::unhex(d).expect("fixture hex"),
                        family,
                    )
                    .expect("a captured destination")
                    .body
                })
                .collect();
            service_view(&svc, &dests)
        })
        .collect();
    ipvsadm::Table {
        version: 0x01_02_01,
        conn_tab_size: 4096,
        services,
    }
}
