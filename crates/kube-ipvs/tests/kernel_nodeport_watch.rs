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

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

/// A running `kube-ipvs run`; killed (and its log printed) if the test ends without stopping it.
struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    fn start(dir: &Path, extra: &[&str]) -> Agent {
        let log = dir.with_extension("log");
        let file = std::fs::File::create(&log).expect("create log");
        let mut args = vec![
            "run",
            "--manifests",
            dir.to_str().expect("utf-8 path"),
            "--hostname-override",
            "node-1",
        ];
        args.extend_from_slice(extra);
        println!("$ kube-ipvs {} &", args.join(" "));
        let child = Command::new(kube_ipvs_bin())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start kube-ipvs run");
        Agent { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `/healthz` says 200 (the first sync finished).
    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if healthz_ok() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("kube-ipvs run exited ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "not healthy in 30s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Polls `ipvsadm -Ln` every 100 ms until `cond` holds of it, for at most 10 s.
    fn wait_table(&self, what: &str, cond: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let table = ipvsadm_table();
            if cond(&table) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after 10s waiting for {what}:\n{table}\n--- log ---\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        println!("--- kube-ipvs run log ---\n{}", self.log());
    }
}

fn healthz_ok() -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", 10256)) else {
        return false;
    };
    if s.set_read_timeout(Some(Duration::from_secs(5))).is_err()
        || s.write_all(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .is_err()
    {
        return false;
    }
    let mut text = String::new();
    s.read_to_string(&mut text).is_ok() && text.split_whitespace().nth(1) == Some("200")
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
    agent.wait_table("the NodePort on the added 192.168.77.11", |t| {
        has_vs(t, "192.168.77.11:30080") && has_vs(t, "192.168.77.10:30080")
    });

    ip(&["addr", "del", "192.168.77.10/32", "dev", "nodeif"]);
    agent.wait_table("the NodePort on the removed 192.168.77.10 to go", |t| {
        !has_vs(t, "192.168.77.10:30080") && has_vs(t, "192.168.77.11:30080")
    });
    // The ClusterIP was never touched by any of this.
    assert!(has_vs(&ipvsadm_table(), "10.96.0.30:80"));
}
