//! Children that must not outlive xtask. A SIGTERM, SIGINT or SIGHUP to xtask (a CI timeout, a
//! `kill`, a closed terminal) would otherwise leave etcd, kube-apiserver, QEMU or a benchmark
//! driver running, holding ports, CPU and disk: the processes xtask starts are registered here
//! while they run, and on one of those signals each gets SIGTERM, then SIGKILL after a short
//! grace, and xtask exits with 128 + 15.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

static CHILDREN: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

/// Cleanups run after the children are gone, in order (e.g. removing a network namespace and
/// what still runs in it).
static AT_EXIT: Mutex<Vec<fn()>> = Mutex::new(Vec::new());

/// Runs `cleanup` when a signal stops xtask, after its children have been stopped. Owners that
/// finish normally clean up themselves and call [`forget_at_exit`].
pub(crate) fn at_exit(cleanup: fn()) {
    AT_EXIT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(cleanup);
}

/// Drops every command [`at_exit`] registered.
pub(crate) fn forget_at_exit() {
    AT_EXIT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clear();
}

fn children() -> std::sync::MutexGuard<'static, BTreeSet<u32>> {
    // A poisoned lock still holds usable pids.
    CHILDREN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Registers a running child until the guard drops.
#[must_use = "the child is unregistered when the guard drops"]
pub(crate) struct Registered(u32);

impl Drop for Registered {
    fn drop(&mut self) {
        untrack(self.0);
    }
}

/// Registers the child `pid` until the guard drops: it is terminated if xtask is.
pub(crate) fn register(pid: u32) -> Registered {
    track(pid);
    Registered(pid)
}

/// Registers the child `pid` until [`untrack`] (for children owned by a struct).
pub(crate) fn track(pid: u32) {
    children().insert(pid);
}

/// Unregisters the child `pid` (once it has exited).
pub(crate) fn untrack(pid: u32) {
    children().remove(&pid);
}

/// Whether `pid` still runs: it exists and is not a zombie (a child its owner has not reaped).
fn alive(pid: u32) -> bool {
    Command::new("ps")
        .args(["-o", "stat=", "-p", &pid.to_string()])
        .output()
        .is_ok_and(|o| {
            let stat = String::from_utf8_lossy(&o.stdout);
            let stat = stat.trim();
            !stat.is_empty() && !stat.starts_with('Z')
        })
}

fn signal(sig: &str, pids: &BTreeSet<u32>) {
    if pids.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(sig)
        .args(pids.iter().map(u32::to_string))
        .status();
}

/// Installs the signal handler; call once, first thing.
pub(crate) fn install() {
    let installed = ctrlc::set_handler(|| {
        let pids = children().clone();
        if !pids.is_empty() {
            eprintln!("xtask: stopping {} child process(es) {pids:?}", pids.len());
        }
        signal("-TERM", &pids);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && pids.iter().any(|p| alive(*p)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let left: BTreeSet<u32> = pids.into_iter().filter(|p| alive(*p)).collect();
        signal("-KILL", &left);
        let cleanups = AT_EXIT
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for cleanup in cleanups {
            cleanup();
        }
        std::process::exit(128 + 15);
    });
    if let Err(e) = installed {
        eprintln!("xtask: no signal handler ({e}); children may outlive an interrupted run");
    }
}
