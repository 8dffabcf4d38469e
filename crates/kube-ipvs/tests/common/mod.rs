//! Helpers shared by the kernel tests (`tests/kernel*.rs`, run in the VM by `cargo xtask
//! vm-test`): where the binaries are, running a command with its output in the test log, the
//! example cluster's manifests, and polling with a deadline. Each test file uses a subset.
#![allow(
    dead_code,
    reason = "shared by several test targets, each using a part"
)]

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

/// `bin args`, which must succeed; its stdout.
pub(crate) fn run_ok(bin: &str, args: &[&str]) -> String {
    let out = run(bin, args);
    assert!(out.status.success(), "{bin} {args:?} failed");
    stdout(&out)
}

/// `ipvsadm ARGS`, which must succeed; its stdout.
pub(crate) fn ipvsadm(args: &[&str]) -> String {
    run_ok(&ipvsadm_bin(), args)
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

/// Gives this test's network namespace the node's InternalIP (examples/cluster/node.yaml,
/// 192.168.56.10) on a dummy link `node0`: NodePorts listen on the node's own addresses, as
/// kube-proxy's IPVS mode's do.
pub(crate) fn node_address() {
    for args in [
        &["link", "add", "node0", "type", "dummy"][..],
        &["link", "set", "node0", "up"],
        &["addr", "add", "192.168.56.10/32", "dev", "node0"],
    ] {
        let out = run("/usr/sbin/ip", args);
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
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

/// A running `kube-ipvs ARGS` with its stderr in a log file: the agent as the kernel tests start
/// it. Killed, and its log printed, when dropped.
pub(crate) struct RunningAgent {
    pub(crate) child: std::process::Child,
    log: PathBuf,
}

impl RunningAgent {
    /// Starts `kube-ipvs ARGS` (an argument list, never a shell string), stderr to `log`.
    pub(crate) fn spawn(args: &[&str], log: PathBuf) -> RunningAgent {
        RunningAgent::spawn_program(&kube_ipvs_bin(), args, log)
    }

    /// [`RunningAgent::spawn`] of `program` (the binary under another name, say).
    pub(crate) fn spawn_program(program: &str, args: &[&str], log: PathBuf) -> RunningAgent {
        let file = std::fs::File::create(&log).expect("create log");
        println!("$ {program} {} &", args.join(" "));
        let child = Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start kube-ipvs run");
        RunningAgent { child, log }
    }

    /// `kube-ipvs run --manifests DIR --hostname-override node-1 [extra]`, logging beside DIR.
    pub(crate) fn start(dir: &Path, extra: &[&str]) -> RunningAgent {
        let mut args = vec![
            "run",
            "--manifests",
            dir.to_str().expect("utf-8 path"),
            "--hostname-override",
            "node-1",
        ];
        args.extend_from_slice(extra);
        RunningAgent::spawn(&args, dir.with_extension("log"))
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics with the log if the agent has exited.
    pub(crate) fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("kube-ipvs run exited ({status}):\n{}", self.log());
        }
    }

    /// Waits until the default `/healthz` (port 10256) says 200, the first sync done. The
    /// limit only catches an agent that never gets there, not a slow one (speed is measured in
    /// benchmarks): CI's guest shares the host with the lab's Go builds, and there a startup of
    /// 300 Services once took 15 s to get from its sysctls to its first sync (0.5 s otherwise)
    /// and was not healthy after 30 s.
    pub(crate) fn wait_healthy(&mut self) {
        const LIMIT: Duration = Duration::from_secs(120);
        let deadline = Instant::now() + LIMIT;
        while http_status(10256, "/healthz") != Some(200) {
            self.assert_running();
            assert!(
                Instant::now() < deadline,
                "not healthy in {LIMIT:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sends SIGTERM and waits for the exit code.
    pub(crate) fn terminate(mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        assert!(run("kill", &["-TERM", &pid]).status.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code();
            }
            assert!(Instant::now() < deadline, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        println!("--- kube-ipvs run log ---\n{}", self.log());
    }
}

/// A minimal HTTP/1.0 GET on loopback: the status and the body, or `None` if nothing answers.
pub(crate) fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// Just the status of [`http_get`].
pub(crate) fn http_status(port: u16, path: &str) -> Option<u16> {
    http_get(port, path).map(|(s, _)| s)
}
