//! Test support for kube-ipvs: a test API server speaking the Kubernetes list/watch protocol,
//! used by the API-server rung of the test ladder (see `tests/`) and by the watch benchmark.

pub mod apiserver;
pub mod rules;

pub use apiserver::{Kind, TestApiServer};

/// Sends `SIGTERM` to this test process with `kill(1)`, so that a unit test in a crate that
/// may not do process or kernel I/O itself (the tidy rule) can prove its signal handling.
///
/// # Panics
/// If `kill` cannot run or fails: the test could prove nothing then.
pub fn sigterm_this_process() {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -TERM {} failed", std::process::id());
}
