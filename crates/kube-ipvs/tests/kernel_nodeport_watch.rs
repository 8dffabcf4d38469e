//! Kernel test of NodePorts following the node's addresses (run in the VM by
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
