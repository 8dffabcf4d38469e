//! Kernel tests of NodePorts following the node's addresses (run in the VM by
//! `cargo xtask vm-test kube-ipvs/kernel_nodeport_watch`): `kube-ipvs run` with
//! `--nodeport-addresses` and a one-hour `--sync-period` adds and removes the NodePort virtual
//! servers of an address added or removed with iproute2 within seconds. With that sync period
//! the reconcile-time re-read cannot be what finds them, only the rtnetlink notifications.
//!
//! Waits poll `ipvsadm -Ln` until a deadline, never a fixed sleep. The test runs in its own
//! network namespace, so the default ports on loopback are free.
#![cfg(feature = "kernel-tests")]

mod common;
use common::*;

type Agent = RunningAgent;

use std::path::PathBuf;
use std::time::{Duration, Instant};

const NODE: &str = include_str!("../../../examples/cluster/node.yaml");
/// A NodePort Service (nodePort 30080) with an endpoint on node-1.
const SHOP: &str = include_str!("../../../examples/cluster/shop.yaml");

fn ip(args: &[&str]) {
    assert!(run("/usr/sbin/ip", args).status.success(), "ip {args:?}");
}

fn ipvsadm_table() -> String {
    let out = run(&ipvsadm_bin(), &["-Ln"]);
    assert!(out.status.success(), "ipvsadm -Ln");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `ipvsadm -Ln` every 100 ms until `cond` holds of it, for at most 10 s.
fn wait_table(agent: &Agent, what: &str, cond: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let table = ipvsadm_table();
        if cond(&table) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after 10s waiting for {what}:\n{table}\n--- log ---\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A virtual server line of `ipvsadm -Ln` for TCP `addr:port`.
fn has_vs(table: &str, addr_port: &str) -> bool {
    let want = format!("TCP  {addr_port} ");
    table.lines().any(|l| l.starts_with(&want))
}

#[test]
fn nodeports_follow_addresses_added_and_removed() {
    let dir = PathBuf::from("/tmp/kube-ipvs-nodeport-watch");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create manifest dir");
    std::fs::write(dir.join("node.yaml"), NODE).expect("write manifest");
    std::fs::write(dir.join("shop.yaml"), SHOP).expect("write manifest");

    ip(&["link", "add", "nodeif", "type", "dummy"]);
    ip(&["link", "set", "nodeif", "up"]);
    ip(&["addr", "add", "192.168.77.10/32", "dev", "nodeif"]);
    let mut agent = Agent::start(
        &dir,
        &[
            "--nodeport-addresses",
            "192.168.77.0/24",
            "--sync-period",
            "1h",
        ],
    );
    agent.wait_healthy();
    let table = ipvsadm_table();
    assert!(
        has_vs(&table, "192.168.77.10:30080"),
        "NodePort on the address present at start:\n{table}"
    );
    assert!(
        !has_vs(&table, "192.168.77.11:30080"),
        "no NodePort before the address exists:\n{table}"
    );

    ip(&["addr", "add", "192.168.77.11/32", "dev", "nodeif"]);
    wait_table(&agent, "the NodePort on the added 192.168.77.11", |t| {
        has_vs(t, "192.168.77.11:30080") && has_vs(t, "192.168.77.10:30080")
    });

    ip(&["addr", "del", "192.168.77.10/32", "dev", "nodeif"]);
    wait_table(
        &agent,
        "the NodePort on the removed 192.168.77.10 to go",
        |t| !has_vs(t, "192.168.77.10:30080") && has_vs(t, "192.168.77.11:30080"),
    );
    // The ClusterIP was never touched by any of this.
    assert!(has_vs(&ipvsadm_table(), "10.96.0.30:80"));
}

/// A Service with two external IPs, one of which another interface of the node will hold.
const EXT: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: ext, namespace: default}\n\
spec:\n  clusterIP: 10.96.0.90\n  clusterIPs: [10.96.0.90]\n  \
externalIPs: [192.168.77.50, 203.0.113.9]\n  \
ports:\n  - {name: http, port: 80, protocol: TCP, targetPort: 8080}\n---\n\
apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: ext-1\n  \
namespace: default\n  labels: {kubernetes.io/service-name: ext}\naddressType: IPv4\n\
endpoints:\n- addresses: [10.244.1.90]\n  conditions: {ready: true}\n  nodeName: node-1\n\
ports:\n- {name: http, port: 8080, protocol: TCP}\n";

fn kube_ipvs0() -> String {
    let out = run("/usr/sbin/ip", &["-o", "addr", "show", "dev", "kube-ipvs0"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn bound(addr: &str) -> bool {
    kube_ipvs0().contains(&format!(" {addr}/32 "))
}

/// kube-proxy's IPVS defaults, on the real kernel: without `--nodeport-addresses` NodePorts
/// listen on every local address (not loopback, not `kube-ipvs0`'s) and
/// follow them; an external IP that another interface holds is served but never bound to
/// `kube-ipvs0` (kube-proxy's `shouldBind`), also when another interface takes it later.
#[test]
fn default_nodeports_are_every_local_address_and_held_external_ips_stay_unbound() {
    let dir = PathBuf::from("/tmp/kube-ipvs-nodeport-default");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create manifest dir");
    std::fs::write(dir.join("node.yaml"), NODE).expect("write manifest");
    std::fs::write(dir.join("shop.yaml"), SHOP).expect("write manifest");
    std::fs::write(dir.join("ext.yaml"), EXT).expect("write manifest");

    node_address();
    ip(&["link", "add", "other0", "type", "dummy"]);
    ip(&["link", "set", "other0", "up"]);
    ip(&["addr", "add", "172.31.0.5/32", "dev", "other0"]);
    ip(&["addr", "add", "192.168.77.50/32", "dev", "other0"]);
    let mut agent = Agent::start(&dir, &["--sync-period", "1h"]);
    agent.wait_healthy();
    let table = ipvsadm_table();
    for addr in ["192.168.56.10", "172.31.0.5", "192.168.77.50"] {
        assert!(
            has_vs(&table, &format!("{addr}:30080")),
            "NodePort on the local address {addr}:\n{table}"
        );
    }
    assert!(
        !has_vs(&table, "127.0.0.1:30080"),
        "no NodePort on loopback:\n{table}"
    );
    // Both external IPs are served; only the one no interface holds is bound.
    assert!(has_vs(&table, "192.168.77.50:80") && has_vs(&table, "203.0.113.9:80"));
    assert!(bound("203.0.113.9"), "{}", kube_ipvs0());
    assert!(!bound("192.168.77.50"), "{}", kube_ipvs0());
    assert!(bound("10.96.0.90"), "{}", kube_ipvs0());

    // Followed through the address watch (the sync period is an hour).
    ip(&["addr", "add", "172.31.0.6/32", "dev", "other0"]);
    wait_table(&agent, "the NodePort on the added 172.31.0.6", |t| {
        has_vs(t, "172.31.0.6:30080")
    });
    ip(&["addr", "add", "203.0.113.9/32", "dev", "other0"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while bound("203.0.113.9") {
        assert!(
            Instant::now() < deadline,
            "203.0.113.9 stayed on kube-ipvs0 after other0 took it:\n{}\n--- log ---\n{}",
            kube_ipvs0(),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(has_vs(&ipvsadm_table(), "203.0.113.9:80"), "still served");
}
