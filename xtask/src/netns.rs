//! Network namespaces of xtask's own: the lab's (`cargo xtask cluster`) and the e2e bench's
//! (`--net tap`). Each is made with iproute2, entered by running this xtask again inside it, and
//! removed with whatever still runs in it. Nothing in one has a route out of the namespaces
//! xtask made, so no test traffic reaches any other address.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

use crate::util;

/// `ip` from iproute2 (busybox's applet lacks `netns` and `tuntap`).
pub(crate) fn ip() -> Command {
    Command::new("/usr/sbin/ip")
}

/// Whether the namespace `name` exists.
pub(crate) fn exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

/// Why this machine cannot make a namespace with tap devices for QEMU, if it cannot: that needs
/// root and the tun device.
pub(crate) fn unavailable() -> Option<String> {
    if !util::is_root() {
        return Some("it needs root (a network namespace, a bridge, tap devices)".into());
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("it needs /dev/net/tun for the guests' tap devices".into());
    }
    None
}

/// Removes the namespace `name` and everything running in it (nothing if it does not exist).
pub(crate) fn down(name: &str) -> Result<()> {
    if !exists(name) {
        return Ok(());
    }
    // Processes in the namespace keep it (and its taps) alive after `ip netns del`.
    if let Ok(pids) = util::output(ip().args(["netns", "pids", name])) {
        let pids: Vec<&str> = pids.split_whitespace().collect();
        if !pids.is_empty() {
            eprintln!("xtask: stopping {} process(es) in {name}", pids.len());
            let _ = Command::new("kill").arg("-KILL").args(&pids).status();
        }
    }
    util::run(ip().args(["netns", "del", name]))
}

/// A namespace of bridged tap devices for QEMU guests: the bridge holds the host side's address.
pub(crate) struct Bridged<'a> {
    pub(crate) name: &'a str,
    pub(crate) bridge: &'a str,
    /// With prefix length, e.g. `10.88.0.1/24`.
    pub(crate) address: String,
    pub(crate) taps: Vec<String>,
    /// Added after the taps: `(destination, via)`.
    pub(crate) routes: Vec<(String, String)>,
}

/// Makes the namespace with its loopback, bridge, taps and routes. `cleanup` (which removes it)
/// runs if a signal stops xtask; a failed step removes it at once. The caller has refused an
/// existing namespace of that name, with its own advice.
pub(crate) fn up(net: &Bridged<'_>, cleanup: fn()) -> Result<()> {
    util::run(ip().args(["netns", "add", net.name]))?;
    crate::reaper::at_exit(cleanup);
    let inside = |args: &[&str]| util::run(ip().args(["-n", net.name]).args(args));
    let made = (|| {
        inside(&["link", "set", "lo", "up"])?;
        inside(&["link", "add", net.bridge, "type", "bridge"])?;
        inside(&["addr", "add", &net.address, "dev", net.bridge])?;
        inside(&["link", "set", net.bridge, "up"])?;
        for tap in &net.taps {
            inside(&["tuntap", "add", tap, "mode", "tap"])?;
            inside(&["link", "set", tap, "master", net.bridge, "up"])?;
        }
        for (destination, via) in &net.routes {
            inside(&["route", "add", destination, "via", via])?;
        }
        Ok(())
    })();
    if made.is_err() {
        cleanup();
    }
    made
}

/// Runs `cargo xtask ARGS...` again inside the namespace `name`, with `inside_env` set so the
/// inner run knows it is there, and waits for it.
pub(crate) fn run_inside(name: &str, inside_env: &str, args: &[String]) -> Result<()> {
    // A copy of this very binary: `cargo xtask ci` rebuilds target/debug/xtask with other
    // features while it runs, so the path may name a deleted file by now (CI failed exactly
    // so); /proc/self/exe still reads the running one.
    let exe = util::target_dir()?.join(format!("netns/xtask-{}", std::process::id()));
    fs::create_dir_all(exe.parent().context("no parent")?)?;
    fs::copy("/proc/self/exe", &exe).context("copying /proc/self/exe")?;
    let mut cmd = ip();
    cmd.args(["netns", "exec", name])
        .arg(&exe)
        .args(args)
        .env(inside_env, "1")
        .stdin(Stdio::inherit());
    let result = util::run(&mut cmd);
    let _ = fs::remove_file(&exe);
    result
}
