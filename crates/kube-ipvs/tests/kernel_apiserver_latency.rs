//! `kubeproxy_network_programming_duration_seconds` against a real kube-apiserver (run in the VM
//! by `cargo xtask vm-test kube-ipvs/kernel_apiserver_latency`; vm-test starts etcd and
//! kube-apiserver on the host and skips these tests, saying why, when there is no Go toolchain).
//!
//! The test plays the EndpointSlice controller: it writes slices annotated with
//! `endpoints.kubernetes.io/last-change-trigger-time`, waits until the kernel holds each change,
//! and reads the agent's `/metrics`. The trigger times are taken from the guest's clock, the
//! one the agent measures with (the host's may differ), so the observed latencies are bounded
//! by what the test itself measured.
//!
//! The plumbing (forwarded ports, the socat relay, the admin client, the agent process, the
//! IPVS table reader) is a trimmed copy of `kernel_apiserver.rs`'s, kept separate so the two
//! files can change independently; they could move to `tests/common/` together.
//!
//! Proved here: each annotated slice change the agent programs is observed exactly once; a
//! change without the annotation, with a malformed one (a warning naming the slice) or with a
//! trigger time from before the agent started is not observed; the observed sum is more than
//! zero and less than the time the test spent making the changes.
#![cfg(feature = "kernel-tests")]

mod common;

use std::time::{Duration, Instant};

use common::apiserver::{Agent, Cluster, rs, table, wait_for_table};
use common::wait_for;

const METRIC: &str = "kubeproxy_network_programming_duration_seconds";

/// The histogram's count and sum.
fn histogram(agent: &Agent) -> (u64, f64) {
    let text = agent.metrics().expect("/metrics answers");
    let value = |suffix: &str| -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{METRIC}_{suffix}{{ip_family=\"IPv4\"}} ")))
            .unwrap_or_else(|| panic!("no {METRIC}_{suffix} in /metrics:\n{text}"))
            .to_owned()
    };
    let count = value("count").parse().expect("a count");
    let sum = value("sum").parse().expect("a sum");
    (count, sum)
}

/// These addresses as ready endpoints.
fn ready<'a>(addrs: &[&'a str]) -> Vec<(&'a str, bool)> {
    addrs.iter().map(|a| (*a, true)).collect()
}

/// Waits until the virtual server `vip` has exactly these real servers (port 8080).
fn wait_for_real_servers(vip: &str, addrs: &[&str]) {
    let want = rs(addrs);
    wait_for_table(&format!("{vip} -> {want:?}"), |t| t.get(vip) == Some(&want));
}

/// Waits (at most 10 s) until the histogram has counted `n` observations.
fn wait_for_count(agent: &Agent, n: u64) {
    wait_for(
        &format!("{METRIC}_count to reach {n}"),
        Duration::from_secs(10),
        || histogram(agent).0 >= n,
    );
}

/// Now on the guest's clock, as the EndpointSlice controller writes it (RFC 3339, UTC, with
/// nanoseconds).
fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

#[test]
fn each_annotated_slice_change_is_observed_once_within_the_measured_time() {
    let cluster = Cluster::new("latency");
    let mut agent = Agent::start("latency");
    // Converged: the API server's own Service is programmed and /metrics answers.
    wait_for("the agent's first sync", Duration::from_secs(60), || {
        table().contains_key("10.96.0.1:443") && agent.metrics().is_some()
    });
    let (count0, sum0) = histogram(&agent);
    println!("before: count {count0}, sum {sum0}");

    let vip = format!("{}:80", cluster.create_service("web", 80));
    wait_for_real_servers(&vip, &[]);

    // Two changes annotated with their trigger times: each is observed once. The agent
    // observes at the end of the sync that programmed a change, so the count is waited for,
    // then the time measured: each trigger time is taken after the previous change was in
    // the kernel, so the latencies add up to less than the time from the first trigger time
    // to now.
    let t0 = Instant::now();
    cluster.put_slice("web", &ready(&["10.244.1.10"]), Some(&now_rfc3339()));
    wait_for_real_servers(&vip, &["10.244.1.10"]);
    cluster.put_slice(
        "web",
        &ready(&["10.244.1.10", "10.244.2.10"]),
        Some(&now_rfc3339()),
    );
    wait_for_real_servers(&vip, &["10.244.1.10", "10.244.2.10"]);
    wait_for_count(&agent, count0 + 2);
    let measured = t0.elapsed();
    let (count, sum) = histogram(&agent);
    let observed = sum - sum0;
    println!(
        "after two annotated changes: count {count} (+{}), sum {sum} (+{observed:.6} s); the \
         test measured {:.6} s",
        count - count0,
        measured.as_secs_f64()
    );
    assert_eq!(count, count0 + 2, "{}", agent.metrics().unwrap_or_default());
    assert!(
        observed > 0.0 && observed < measured.as_secs_f64(),
        "the observed latencies add up to {observed} s, the test measured {measured:?}"
    );

    // Three that are not observed: a malformed annotation, a trigger time from before the
    // agent started, none at all. Each is programmed all the same.
    let mut addrs = vec!["10.244.1.10", "10.244.2.10", "10.244.3.10"];
    cluster.put_slice("web", &ready(&addrs), Some("not-a-time"));
    wait_for_real_servers(&vip, &addrs);
    addrs.push("10.244.4.10");
    cluster.put_slice("web", &ready(&addrs), Some("2020-01-01T00:00:00Z"));
    wait_for_real_servers(&vip, &addrs);
    addrs.push("10.244.5.10");
    cluster.put_slice("web", &ready(&addrs), None);
    wait_for_real_servers(&vip, &addrs);
    // A last annotated change: syncs run one after another, so once it is observed any
    // observation of the three before it would have been made too.
    addrs.push("10.244.6.10");
    cluster.put_slice("web", &ready(&addrs), Some(&now_rfc3339()));
    wait_for_real_servers(&vip, &addrs);
    wait_for_count(&agent, count0 + 3);
    let (count, sum) = histogram(&agent);
    println!(
        "after all six changes: count {count} (+{}), sum {sum}",
        count - count0
    );
    assert_eq!(
        count,
        count0 + 3,
        "three annotated changes:\n{}",
        agent.metrics().unwrap_or_default()
    );
    let log = agent.log();
    assert!(
        log.contains("EndpointSlice latency/web-1") && log.contains("\"not-a-time\""),
        "the malformed annotation is a warning naming the slice:\n{log}"
    );
    agent.assert_running();
}
