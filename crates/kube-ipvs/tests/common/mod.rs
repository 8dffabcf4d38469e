//! Helpers shared by the kernel tests (`tests/kernel*.rs`, run in the VM by `cargo xtask
//! vm-test`): where the binaries are, running a command with its output in the test log, the
//! example cluster's manifests, and polling with a deadline. Each test file uses a subset.
#![allow(dead_code)]

pub(crate) mod apiserver;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The example cluster (`examples/cluster/`), compiled in: the guest has no checkout.
pub(crate) const EXAMPLES: [(&str, &str); 6] = [
    (
        "node.yaml",
        include_str!("../../../../examples/cluster/node.yaml"),
    ),
    (
        "web.yaml",
        include_str!("../../../../examples/cluster/web.yaml"),
    ),
    (
        "sticky.yaml",
        include_str!("../../../../examples/cluster/sticky.yaml"),
    ),
    (
        "shop.yaml",
        include_str!("../../../../examples/cluster/shop.yaml"),
    ),
    (
        "dns.yaml",
        include_str!("../../../../examples/cluster/dns.yaml"),
    ),
    (
        "api.yaml",
        include_str!("../../../../examples/cluster/api.yaml"),
    ),
];

/// The agent binary in the guest (`CARGO_BIN_EXE_*` paths point into the host's target dir).
pub(crate) fn kube_ipvs_bin() -> String {
    std::env::var("KUBE_IPVS_BIN").unwrap_or_else(|_| "/usr/local/bin/kube-ipvs".into())
}

pub(crate) fn ipvsadm_bin() -> String {
    std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".into())
}

/// Runs `bin args` (an argument list, never a shell string) and prints the command with its
/// output, so a failing test's log shows what it saw.
pub(crate) fn run(bin: &str, args: &[&str]) -> Output {
    let out = Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {bin} {args:?}: {e}"));
    println!(
        "$ {bin} {}\n{}{}(exit {:?})",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        out.status.code()
    );
    out
}

pub(crate) fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `ipvsadm ARGS`, which must succeed; its stdout.
pub(crate) fn ipvsadm(args: &[&str]) -> String {
    let out = run(&ipvsadm_bin(), args);
    assert!(out.status.success(), "ipvsadm {args:?}");
    stdout(&out)
}

/// The example manifests in a fresh directory `/tmp/kube-ipvs-{name}` of the test's own.
pub(crate) fn manifests(name: &str) -> PathBuf {
    let dir = PathBuf::from(format!("/tmp/kube-ipvs-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create manifest dir");
    for (file, text) in EXAMPLES {
        std::fs::write(dir.join(file), text).expect("write manifest");
    }
    dir
}

/// `kube-ipvs <cmd> --manifests DIR --hostname-override node-1 [extra]` (plan, check, ...).
pub(crate) fn kube_ipvs(cmd: &str, dir: &Path, extra: &[&str]) -> Output {
    let dir = dir.to_str().expect("utf-8 path");
    let mut args = vec![cmd, "--manifests", dir, "--hostname-override", "node-1"];
    args.extend_from_slice(extra);
    run(&kube_ipvs_bin(), &args)
}

/// Polls `cond` every 100 ms until it holds or `limit` passes.
pub(crate) fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A free TCP port on loopback (the kernel picks it; nothing holds it afterwards).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}
