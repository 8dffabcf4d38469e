//! Kernel tests of the node agent (run in the VM by `cargo xtask vm-test kube-ipvs/kernel_run`):
//! the real binary `kube-ipvs run --manifests DIR` converges an empty kernel and a stale one
//! (with exactly the operations `plan` predicts), repairs `ipvsadm -C` at the next reconcile,
//! follows a manifest change, leaves the table in place on SIGTERM and adopts it on restart
//! without a single operation, serves `/healthz` and `/metrics`, applies its flags, and stops
//! with a distinct exit code for a bad config file, an unknown scheduler and a missing module.
//! A startup with hundreds of addresses binds them on a binder thread beside its IPVS requests.
//! `--service-address-binding=route` makes the ClusterIPs local with routes instead, and a
//! change of it moves the node's addresses under an open connection.
//!
//! "In sync" is `kube-ipvs check` exiting 0 (it compares the same manifests with the kernel);
//! waits poll a condition until a deadline, never a fixed sleep. Each test runs in its own
//! network namespace, so the default ports on loopback are free.
#![cfg(feature = "kernel-tests")]

mod common;
use common::*;

type Agent = RunningAgent;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What the examples need on an empty kernel (as `kernel_check` establishes with `plan`).
const EMPTY_KERNEL_OPS: u64 = 28;

fn in_sync(dir: &Path, extra: &[&str]) -> bool {
    kube_ipvs("check", dir, extra).status.code() == Some(0)
}

/// One metric's value (the first sample line starting with `name`, labels included).
fn metric(name: &str) -> Option<f64> {
    let (_, body) = http_get(10249, "/metrics")?;
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The count on the summary line of `plan`: "N operations: ...".
fn planned_ops(dir: &Path) -> u64 {
    let out = kube_ipvs("plan", dir, &[]);
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    let last = text.lines().last().expect("a summary line");
    last.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {last:?}"))
}

fn startup_ops() -> Option<f64> {
    metric("kube_ipvs_operations_total{reason=\"startup\"}")
}

#[test]
fn converges_an_empty_kernel_and_serves_health_and_metrics() {
    node_address();
    let dir = manifests("run-empty");
    assert_eq!(planned_ops(&dir), EMPTY_KERNEL_OPS);
    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    assert!(in_sync(&dir, &[]), "in sync after the first sync");
    // On the nf_tables backend (the guest's `iptables`) nothing of the agent's, its scan for
    // kube-proxy's leftovers in both backends included, makes an x_tables table in this fresh
    // namespace: one would hook into the path of every packet here (the kernel makes a legacy
    // table on first read).
    let version = stdout(&run("iptables", &["--version"]));
    assert!(
        version.contains("nf_tables"),
        "the guest's iptables: {version}"
    );
    for list in ["/proc/net/ip_tables_names", "/proc/net/ip6_tables_names"] {
        let legacy = std::fs::read_to_string(list).unwrap_or_default();
        assert_eq!(
            legacy.trim(),
            "",
            "legacy tables made in the agent's namespace ({list})"
        );
    }
    assert_eq!(startup_ops(), Some(EMPTY_KERNEL_OPS as f64));
    assert_eq!(metric("kube_ipvs_services"), Some(8.0));
    assert_eq!(metric("kube_ipvs_real_servers"), Some(15.0));
    let (status, body) = http_get(10249, "/metrics").expect("metrics answer");
    assert_eq!(status, 200);
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kube_ipvs_drift_repaired_total",
        "kube_ipvs_kernel_errors_total 0",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"}",
        "kubeproxy_sync_proxy_rules_service_changes_pending 0",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\",ip_family=\"IPv4\"}",
    ] {
        assert!(body.contains(name), "{name} missing:\n{body}");
    }
    assert_eq!(http_get(10256, "/livez").map(|r| r.0), Some(200));
    // kube-proxy's JSON and /proxyMode.
    // Every example Service was a change (the first change set holds them all).
    let changes = body
        .lines()
        .find_map(|l| l.strip_prefix("kubeproxy_sync_proxy_rules_service_changes_total "))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(changes.is_some_and(|n| n >= 5), "{changes:?}");
    let (_, healthz) = http_get(10256, "/healthz").expect("healthz answers");
    let v: serde_json::Value = serde_json::from_str(&healthz).expect("JSON");
    assert_eq!(v["healthy"], true, "{healthz}");
    assert_eq!(v["nodeEligible"], true, "{healthz}");
    assert!(v["status"]["IPv4"]["lastUpdated"].is_string(), "{healthz}");
    assert_eq!(
        http_get(10249, "/proxyMode"),
        Some((200, "ipvs".to_owned()))
    );
    assert_eq!(
        http_get(10256, "/metrics").map(|r| r.0),
        Some(404),
        "metrics only on the metrics address"
    );
    assert_eq!(agent.terminate(), Some(0));
}

#[test]
fn adopts_a_stale_table_with_only_the_needed_operations_and_survives_restart() {
    let dir = manifests("run-stale");
    let out = kube_ipvs("plan", &dir, &["--apply"]);
    assert_eq!(out.status.code(), Some(0));
    // Make it stale: one endpoint gone, one foreign endpoint, one virtual server deleted.
    ipvsadm(&["-d", "-t", "10.96.0.10:80", "-r", "10.244.2.10:8080"]);
    ipvsadm(&["-a", "-t", "10.96.0.10:80", "-r", "10.244.9.9:8080", "-m"]);
    ipvsadm(&["-D", "-u", "10.96.0.53:53"]);
    let needed = planned_ops(&dir);
    assert!(needed > 0 && needed < EMPTY_KERNEL_OPS, "{needed}");

    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    assert_eq!(
        startup_ops(),
        Some(needed as f64),
        "only the planned operations"
    );
    assert!(in_sync(&dir, &[]));
    let before = ipvsadm(&["-Ln"]);
    assert_eq!(agent.terminate(), Some(0), "SIGTERM is a clean stop");
    assert_eq!(
        ipvsadm(&["-Ln"]),
        before,
        "SIGTERM leaves the table in place"
    );

    // A restart adopts the table as it is: zero operations.
    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    assert_eq!(startup_ops(), Some(0.0), "{}", agent.log());
    assert_eq!(agent.terminate(), Some(0));
}

/// `n` ClusterIP Services (10.97.x.y:80), each with two ready endpoints, as one manifest.
fn many_services(n: u32) -> String {
    let mut yaml = String::new();
    for i in 0..n {
        let (hi, lo) = (i / 250, i % 250 + 1);
        yaml.push_str(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: many-{i}, namespace: default}}\n\
             spec:\n  clusterIP: 10.97.{hi}.{lo}\n  clusterIPs: [10.97.{hi}.{lo}]\n  ports:\n  \
             - {{name: http, port: 80, protocol: TCP, targetPort: 8080}}\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  \
             name: many-{i}-x\n  namespace: default\n  \
             labels: {{kubernetes.io/service-name: many-{i}}}\naddressType: IPv4\nendpoints:\n\
             - addresses: [10.245.{hi}.{lo}]\n  conditions: {{ready: true}}\n\
             - addresses: [10.246.{hi}.{lo}]\n  conditions: {{ready: true}}\n\
             ports:\n- {{name: http, port: 8080, protocol: TCP}}\n---\n"
        ));
    }
    yaml
}

#[test]
fn a_startup_with_many_addresses_binds_them_on_a_binder_thread_beside_the_ipvs_requests() {
    node_address();
    let dir = manifests("run-many");
    std::fs::write(dir.join("many.yaml"), many_services(300)).expect("write manifest");
    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    assert!(in_sync(&dir, &[]), "{}", agent.log());
    let log = agent.log();
    assert!(
        log.lines()
            .any(|l| l.contains("address binds and") && l.contains("IPVS requests together")),
        "the startup did not bind beside the requests:\n{log}"
    );
    // 300 addresses: above the binder's threshold, and two of its steps. Cross-checked with the
    // tools: every address on kube-ipvs0, every virtual server with both real servers.
    let addrs = run("/usr/sbin/ip", &["-4", "addr", "show", "dev", "kube-ipvs0"]);
    let addrs = String::from_utf8_lossy(&addrs.stdout);
    assert_eq!(
        addrs.lines().filter(|l| l.contains("inet 10.97.")).count(),
        300,
        "{addrs}"
    );
    let table = ipvsadm(&["-Ln"]);
    assert_eq!(
        table
            .lines()
            .filter(|l| l.starts_with("TCP  10.97."))
            .count(),
        300
    );
    assert_eq!(
        table
            .lines()
            .filter(|l| l.contains("-> 10.245.") || l.contains("-> 10.246."))
            .count(),
        600
    );
    assert_eq!(agent.terminate(), Some(0));
}

#[test]
fn ipvsadm_clear_is_repaired_by_the_next_reconcile() {
    node_address();
    let dir = manifests("run-clear");
    let mut agent = Agent::start(&dir, &["--sync-period", "2s"]);
    agent.wait_healthy();
    assert!(in_sync(&dir, &[]));
    // A reconcile's background read of the real kernel has the desired table's fingerprint:
    // what the kernel dumps converts back exactly to what the engine asked for.
    let matches = || metric("kube_ipvs_reconcile_fingerprint_matches_total").unwrap_or(0.0);
    wait_for(
        "a reconcile to match by fingerprint",
        Duration::from_secs(20),
        || matches() >= 1.0,
    );
    ipvsadm(&["-C"]);
    wait_for(
        "the reconcile to repair the table",
        Duration::from_secs(20),
        || in_sync(&dir, &[]),
    );
    // 8 virtual servers (the short circuit's fwmark service among them) and 15 real servers
    // were put back (the addresses were untouched).
    wait_for("the drift counter", Duration::from_secs(5), || {
        metric("kube_ipvs_drift_repaired_total") == Some(23.0)
    });
    // Once repaired, the kernel matches by fingerprint again.
    let repaired = matches();
    wait_for(
        "a reconcile to match again",
        Duration::from_secs(20),
        || matches() > repaired,
    );
    assert_eq!(agent.terminate(), Some(0));
}

#[test]
fn a_manifest_change_is_applied() {
    let dir = manifests("run-change");
    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    let web = dir.join("web.yaml");
    let text = std::fs::read_to_string(&web).expect("read web.yaml");
    std::fs::write(&web, text.replace("10.244.2.10", "10.244.2.99")).expect("rewrite web.yaml");
    wait_for("the new endpoint", Duration::from_secs(20), || {
        ipvsadm(&["-Ln", "-t", "10.96.0.10:80"]).contains("10.244.2.99:8080")
    });
    wait_for(
        "in sync with the new manifests",
        Duration::from_secs(20),
        || in_sync(&dir, &[]),
    );
    assert!(
        metric("kube_ipvs_operations_total{reason=\"incremental\"}").is_some_and(|n| n >= 1.0),
        "applied by an incremental sync"
    );
    assert_eq!(agent.terminate(), Some(0));
}

#[test]
fn flags_change_what_they_should() {
    let dir = manifests("run-flags");
    // A foreign virtual server inside --exclude-cidrs and a stale one outside it.
    ipvsadm(&["-A", "-t", "10.200.0.1:80", "-s", "rr"]);
    ipvsadm(&["-A", "-t", "10.96.99.1:80", "-s", "rr"]);
    // A node address inside --nodeport-addresses.
    assert!(
        run("/usr/sbin/ip", &["link", "add", "nodeif", "type", "dummy"])
            .status
            .success()
    );
    assert!(
        run(
            "/usr/sbin/ip",
            &["addr", "add", "192.168.77.5/24", "dev", "nodeif"]
        )
        .status
        .success()
    );
    let mut agent = Agent::start(
        &dir,
        &[
            "--scheduler",
            "lc",
            "--exclude-cidrs",
            "10.200.0.0/16",
            "--strict-arp",
            "--tcp-timeout",
            "901s",
            "--tcpfin-timeout",
            "61s",
            "--udp-timeout",
            "301s",
            "--nodeport-addresses",
            "192.168.77.0/24",
            "--healthz-bind-address",
            "127.0.0.1",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--conntrack-tcp-timeout-close-wait",
            "10m",
        ],
    );
    agent.wait_healthy();
    let table = ipvsadm(&["-Ln"]);
    assert!(
        table.contains("TCP  10.200.0.1:80 rr"),
        "excluded: untouched\n{table}"
    );
    assert!(!table.contains("10.96.99.1:80"), "stale: removed\n{table}");
    assert!(
        table.contains("TCP  10.96.0.10:80 lc"),
        "--scheduler\n{table}"
    );
    assert!(
        table.contains("TCP  192.168.77.5:30080"),
        "--nodeport-addresses\n{table}"
    );
    assert!(
        !table.contains("192.168.56.10:30080"),
        "the Node object's address is replaced\n{table}"
    );
    let timeouts = ipvsadm(&["-L", "--timeout"]);
    assert!(timeouts.contains("901 61 301"), "{timeouts}");
    // kube-proxy's conntrack defaults and one flag. The table size is global: outside the
    // initial network namespace (where each kernel test runs) the kernel refuses it, and the
    // agent names the sysctl and goes on.
    let log = agent.log();
    assert!(
        log.contains("tuning left as it is: sysctl net.netfilter.nf_conntrack_max="),
        "{log}"
    );
    for (sysctl, want) in [
        (
            "net/netfilter/nf_conntrack_tcp_timeout_established",
            "86400",
        ),
        ("net/netfilter/nf_conntrack_tcp_timeout_close_wait", "600"),
    ] {
        let got = std::fs::read_to_string(format!("/proc/sys/{sysctl}")).expect("read sysctl");
        assert_eq!(got.trim(), want, "{sysctl}");
    }
    for (sysctl, want) in [
        ("net/ipv4/conf/all/arp_ignore", "1"),
        ("net/ipv4/conf/all/arp_announce", "2"),
        ("net/ipv4/vs/conntrack", "1"),
        ("net/ipv4/vs/expire_nodest_conn", "1"),
        ("net/ipv4/vs/expire_quiescent_template", "1"),
        ("net/ipv4/ip_forward", "1"),
    ] {
        let got = std::fs::read_to_string(format!("/proc/sys/{sysctl}")).expect("read sysctl");
        assert_eq!(got.trim(), want, "{sysctl}");
    }
    assert_eq!(agent.terminate(), Some(0));
}

fn run_exit(args: &[&str]) -> (Option<i32>, String) {
    let out = run(&kube_ipvs_bin(), args);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn startup_errors_have_one_message_and_distinct_exit_codes() {
    let dir = manifests("run-errors");
    let d = dir.to_str().expect("utf-8");
    let bad = dir.join("bad-config.yaml");
    std::fs::write(
        &bad,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: [oops\n",
    )
    .expect("write");
    let bad = bad.to_str().expect("utf-8");
    let (code, err) = run_exit(&["run", "--manifests", d, "--config", bad]);
    assert_eq!(code, Some(3), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains(bad), "{err}");

    let (code, err) = run_exit(&["run", "--manifests", d, "--scheduler", "fastest"]);
    assert_eq!(code, Some(4), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--scheduler \"fastest\""), "{err}");

    // The VM's 6.1 kernel has no ip_vs_twos (xtask names it as skipped at boot).
    assert!(
        !Path::new("/sys/module/ip_vs_twos").exists(),
        "this test needs a kernel without ip_vs_twos"
    );
    let (code, err) = run_exit(&["run", "--manifests", d, "--scheduler", "twos"]);
    assert_eq!(code, Some(5), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("kernel module ip_vs_twos"), "{err}");
    assert_eq!(
        ipvsadm(&["-Ln"]).lines().count(),
        3,
        "nothing was programmed"
    );
}

/// One Service (10.96.0.100:80) with one endpoint (10.244.1.10:8080) on this node.
const ECHO: &str = r#"apiVersion: v1
kind: Service
metadata: {name: echo, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.100
  clusterIPs: [10.96.0.100]
  ports:
  - {name: tcp, port: 80, protocol: TCP, targetPort: 8080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: echo-1
  namespace: default
  labels: {kubernetes.io/service-name: echo}
addressType: IPv4
endpoints:
- addresses: [10.244.1.10]
  conditions: {ready: true, serving: true, terminating: false}
  nodeName: node-1
ports:
- {name: tcp, port: 8080, protocol: TCP}
"#;

fn ip_ok(args: &[&str]) {
    assert!(run("/usr/sbin/ip", args).status.success(), "ip {args:?}");
}

/// A client namespace and a backend namespace, each behind a veth, with this namespace routing
/// between them as an IPVS NAT node: the client reaches 10.96.0.100:80, the backend (an echo
/// server) answers through this namespace, whose IPVS reverses the NAT. Returns the manifest
/// directory (`ECHO`).
fn echo_network(name: &str) -> PathBuf {
    let dir = PathBuf::from(format!("/tmp/kube-ipvs-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("echo.yaml"), ECHO).expect("write manifest");
    for ns in ["run-cl", "run-be"] {
        let _ = run("/usr/sbin/ip", &["netns", "del", ns]);
        ip_ok(&["netns", "add", ns]);
        ip_ok(&["-n", ns, "link", "set", "lo", "up"]);
    }
    for (here, there, ns, mine, theirs) in [
        ("rc0", "rc1", "run-cl", "192.168.70.1/24", "192.168.70.2/24"),
        ("rb0", "rb1", "run-be", "10.244.1.1/24", "10.244.1.10/24"),
    ] {
        ip_ok(&["link", "add", here, "type", "veth", "peer", "name", there]);
        ip_ok(&["link", "set", there, "netns", ns]);
        ip_ok(&["addr", "add", mine, "dev", here]);
        ip_ok(&["link", "set", here, "up"]);
        ip_ok(&["-n", ns, "addr", "add", theirs, "dev", there]);
        ip_ok(&["-n", ns, "link", "set", there, "up"]);
        let gateway = mine.split('/').next().expect("an address");
        ip_ok(&["-n", ns, "route", "add", "default", "via", gateway]);
    }
    dir
}

/// One TCP connection from the client namespace to 10.96.0.100:80, to the echo server in the
/// backend namespace ([`echo_network`]); dropping it stops both and deletes the namespaces.
struct Echo {
    server: std::process::Child,
    client: std::process::Child,
    to_server: std::process::ChildStdin,
    from_server: std::io::BufReader<std::process::ChildStdout>,
}

impl Echo {
    fn connect() -> Self {
        let server = Command::new("/usr/sbin/ip")
            .args([
                "netns",
                "exec",
                "run-be",
                "socat",
                "TCP-LISTEN:8080,bind=10.244.1.10,reuseaddr,fork",
                "EXEC:cat",
            ])
            .spawn()
            .expect("start echo server");
        // The client retries until the server listens, so no sleep is needed.
        let mut client = Command::new("/usr/sbin/ip")
            .args([
                "netns",
                "exec",
                "run-cl",
                "socat",
                "-T",
                "60",
                "STDIO",
                "TCP:10.96.0.100:80,retry=100,interval=0.1",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start client");
        let to_server = client.stdin.take().expect("stdin");
        let from_server = std::io::BufReader::new(client.stdout.take().expect("stdout"));
        Self {
            server,
            client,
            to_server,
            from_server,
        }
    }

    /// Sends a line and returns the line that comes back.
    fn say(&mut self, word: &str) -> String {
        use std::io::BufRead as _;
        writeln!(self.to_server, "{word}").expect("send");
        self.to_server.flush().expect("flush");
        let mut line = String::new();
        self.from_server.read_line(&mut line).expect("receive");
        line.trim().to_owned()
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        for child in [&mut self.client, &mut self.server] {
            let _ = child.kill();
            let _ = child.wait();
        }
        for ns in ["run-cl", "run-be"] {
            let _ = run("/usr/sbin/ip", &["netns", "del", ns]);
        }
    }
}

/// A connection opened before a restart of the agent must carry data after it.
#[test]
fn an_open_tcp_connection_survives_a_restart() {
    let dir = echo_network("run-restart");
    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    let mut echo = Echo::connect();
    assert_eq!(
        echo.say("before"),
        "before",
        "the connection works through IPVS"
    );
    let conns = ipvsadm(&["-Lnc"]);
    assert!(conns.contains("ESTABLISHED"), "{conns}");

    assert_eq!(agent.terminate(), Some(0));
    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    assert_eq!(startup_ops(), Some(0.0), "the restart changed nothing");
    assert_eq!(
        echo.say("after"),
        "after",
        "the same connection still works"
    );
    assert_eq!(agent.terminate(), Some(0));
}

/// The IPv4 addresses on `kube-ipvs0`, and the addresses of our local routes (protocol 124),
/// as `ip` lists them.
fn bindings() -> (String, String) {
    let addrs = run(
        "/usr/sbin/ip",
        &["-4", "-o", "addr", "show", "dev", "kube-ipvs0"],
    );
    let routes = run(
        "/usr/sbin/ip",
        &["route", "show", "table", "local", "proto", "124"],
    );
    (stdout(&addrs), stdout(&routes))
}

/// `--service-address-binding=route` makes the ClusterIP local with a route of ours instead of
/// an address on `kube-ipvs0`; switching either way moves the node's addresses at start under
/// an open connection, a restart adopts the routes without an operation, `check` is in sync
/// either way, and `cleanup` removes the routes.
#[test]
fn service_addresses_move_to_local_routes_and_back_under_an_open_connection() {
    let dir = echo_network("run-binding");
    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    let mut echo = Echo::connect();
    assert_eq!(echo.say("bound"), "bound");
    let (addrs, routes) = bindings();
    assert!(addrs.contains("inet 10.96.0.100/32"), "{addrs}");
    assert!(routes.is_empty(), "no route of ours by default: {routes}");
    assert_eq!(agent.terminate(), Some(0));

    let routed = ["--service-address-binding", "route"];
    let mut agent = Agent::start(&dir, &routed);
    agent.wait_healthy();
    let log = agent.log();
    assert!(
        log.contains("service addresses to --service-address-binding=route"),
        "{log}"
    );
    let (addrs, routes) = bindings();
    assert!(!addrs.contains("10.96."), "moved off kube-ipvs0: {addrs}");
    assert!(
        routes.contains("local 10.96.0.100 dev lo scope host"),
        "{routes}"
    );
    assert!(
        stdout(&run("/usr/sbin/ip", &["route", "get", "10.96.0.100"])).starts_with("local "),
        "the ClusterIP is local"
    );
    assert_eq!(echo.say("routed"), "routed", "the same connection");
    assert!(in_sync(&dir, &[]), "check counts a route as bound");
    assert_eq!(agent.terminate(), Some(0));
    let mut agent = Agent::start(
        &dir,
        &["--service-address-binding=route", "--sync-period=2s"],
    );
    agent.wait_healthy();
    assert_eq!(startup_ops(), Some(0.0), "the restart adopted the routes");
    // A route removed behind the agent's back is put back by the next reconcile.
    ip_ok(&[
        "route",
        "del",
        "local",
        "10.96.0.100",
        "dev",
        "lo",
        "table",
        "local",
        "proto",
        "124",
    ]);
    wait_for("the route to come back", Duration::from_secs(20), || {
        bindings().1.contains("local 10.96.0.100")
    });
    assert_eq!(agent.terminate(), Some(0));

    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    let (addrs, routes) = bindings();
    assert!(addrs.contains("inet 10.96.0.100/32"), "{addrs}");
    assert!(routes.is_empty(), "moved back: {routes}");
    assert_eq!(echo.say("back"), "back");
    assert_eq!(agent.terminate(), Some(0));

    let mut agent = Agent::start(&dir, &routed);
    agent.wait_healthy();
    assert_eq!(agent.terminate(), Some(0));
    let cleanup = run(&kube_ipvs_bin(), &["cleanup"]);
    assert_eq!(cleanup.status.code(), Some(0), "{}", stdout(&cleanup));
    assert_eq!(bindings().1, "", "cleanup removed our routes");
}

/// kube-proxy's own config file drives the agent (scheduler, sync period, exclude CIDRs,
/// timeouts, bind addresses), and a flag given beside it wins.
#[test]
fn a_kube_proxy_config_file_is_applied_and_flags_win() {
    let dir = manifests("run-config");
    let config = PathBuf::from("/tmp/kube-ipvs-run-config.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
         kind: KubeProxyConfiguration\n\
         mode: ipvs\n\
         clusterCIDR: 10.244.0.0/16\n\
         healthzBindAddress: 127.0.0.1:10256\n\
         metricsBindAddress: 127.0.0.1:10249\n\
         ipvs:\n  scheduler: wlc\n  syncPeriod: 2s\n  excludeCIDRs: [10.200.0.0/16]\n  \
         tcpTimeout: 902s\n  udpTimeout: 0s\n\
         conntrack:\n  maxPerCore: 0\n  tcpEstablishedTimeout: 2h0m0s\n  \
         tcpCloseWaitTimeout: 30m0s\n  tcpBeLiberal: true\n  udpTimeout: 45s\n  \
         udpStreamTimeout: 3m\n",
    )
    .expect("write config");
    ipvsadm(&["-A", "-t", "10.200.0.1:80", "-s", "rr"]);
    let cfg = config.to_str().expect("utf-8");
    let mut agent = Agent::start(&dir, &["--config", cfg]);
    agent.wait_healthy();
    let table = ipvsadm(&["-Ln"]);
    assert!(
        table.contains("TCP  10.96.0.10:80 wlc"),
        "ipvs.scheduler\n{table}"
    );
    assert!(
        table.contains("TCP  10.200.0.1:80 rr"),
        "ipvs.excludeCIDRs\n{table}"
    );
    assert!(
        ipvsadm(&["-L", "--timeout"]).contains("902 "),
        "ipvs.tcpTimeout"
    );
    for (sysctl, want) in [
        ("nf_conntrack_tcp_timeout_established", "7200"),
        ("nf_conntrack_tcp_timeout_close_wait", "1800"),
        ("nf_conntrack_tcp_be_liberal", "1"),
        ("nf_conntrack_udp_timeout", "45"),
        ("nf_conntrack_udp_timeout_stream", "180"),
    ] {
        let got = std::fs::read_to_string(format!("/proc/sys/net/netfilter/{sysctl}"))
            .expect("read sysctl");
        assert_eq!(got.trim(), want, "conntrack: {sysctl}");
    }
    assert!(
        !agent.log().contains("nf_conntrack_max"),
        "maxPerCore 0 leaves the table size alone:\n{}",
        agent.log()
    );
    // ipvs.syncPeriod 2s: a cleared table is back within a few seconds.
    ipvsadm(&["-D", "-t", "10.96.0.10:80"]);
    wait_for("the 2s reconcile", Duration::from_secs(15), || {
        ipvsadm(&["-Ln"]).contains("TCP  10.96.0.10:80 wlc")
    });
    assert_eq!(agent.terminate(), Some(0));

    let mut agent = Agent::start(&dir, &["--config", cfg, "--scheduler", "sed"]);
    agent.wait_healthy();
    // The engine adopts the table and updates each virtual server's scheduler.
    let table = ipvsadm(&["-Ln"]);
    assert!(
        table.contains("TCP  10.96.0.10:80 sed"),
        "--scheduler wins\n{table}"
    );
    assert_eq!(agent.terminate(), Some(0));
}

/// A LoadBalancer Service with the Local policy and one ready endpoint on node-1.
const LB: &str = r#"apiVersion: v1
kind: Service
metadata: {name: lb, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.77
  clusterIPs: [10.96.0.77]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32100
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 31080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: lb-1
  namespace: default
  labels: {kubernetes.io/service-name: lb}
addressType: IPv4
endpoints:
- addresses: [10.244.1.77]
  conditions: {ready: true}
  nodeName: node-1
ports:
- {name: http, port: 8080, protocol: TCP}
"#;

#[test]
fn health_check_node_port_answers_for_local_endpoints() {
    let dir = manifests("run-hcport");
    std::fs::write(dir.join("lb.yaml"), LB).expect("write manifest");
    let mut agent = Agent::start(&dir, &[]);
    agent.wait_healthy();
    let mut answer = None;
    wait_for("the health-check port", Duration::from_secs(10), || {
        answer = http_get(32100, "/");
        answer.is_some()
    });
    let (status, body) = answer.expect("an answer");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"localEndpoints\": 1"), "{body}");
    // Both families: the same port answers on the IPv6 loopback.
    let v6 = std::net::TcpStream::connect(("::1", 32100)).is_ok();
    assert!(v6, "the health-check port listens on IPv6 too");
    // The endpoint goes away: the node must fail the check.
    std::fs::write(
        dir.join("lb.yaml"),
        LB.replace("ready: true", "ready: false"),
    )
    .expect("rewrite manifest");
    wait_for(
        "503 without a local endpoint",
        Duration::from_secs(20),
        || http_get(32100, "/").is_some_and(|(s, _)| s == 503),
    );
    assert_eq!(agent.terminate(), Some(0));
}

/// The `nat` table as the system's default iptables shows it (the backend `run` detects).
fn nat_rules() -> String {
    stdout(&run("iptables-save", &["-t", "nat"]))
}

/// Runs the `ipset` binary with fixed arguments; its stdout, asserting success.
fn ipset_ok(args: &[&str]) -> String {
    let out = run("/usr/sbin/ipset", args);
    assert!(out.status.success(), "ipset {args:?} failed");
    stdout(&out)
}

/// The addresses `a` of the IPv4 hairpin set's members `a,a`, sorted, as `ipset save` shows.
fn hairpin_members() -> Vec<String> {
    let mut m: Vec<String> = ipset_ok(&["save", "KUBE-IPVS-HAIRPIN"])
        .lines()
        .filter_map(|l| l.strip_prefix("add KUBE-IPVS-HAIRPIN "))
        .filter_map(|m| m.split_once(','))
        .filter(|(a, b)| a == b)
        .map(|(a, _)| a.to_owned())
        .collect();
    m.sort();
    m
}

fn lines_with(text: &str, needles: &[&str]) -> usize {
    text.lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .count()
}

#[test]
fn masquerade_rules_follow_the_settings_and_the_local_policy_set() {
    node_address();
    let dir = manifests("run-masq");
    // A short sync period: the reconcile repairs a flushed hairpin set.
    let mut agent = Agent::start(
        &dir,
        &["--cluster-cidr", "10.244.0.0/16", "--sync-period", "2s"],
    );
    agent.wait_healthy();
    wait_for(
        "our chains with the cluster-CIDR rule",
        Duration::from_secs(30),
        || nat_rules().contains("not a local pod"),
    );
    let nat = nat_rules();
    assert!(nat.contains(":KUBE-IPVS-POSTROUTING") && nat.contains(":KUBE-IPVS-MASQ"));
    for (builtin, chain) in [
        ("POSTROUTING", "KUBE-IPVS-POSTROUTING"),
        ("PREROUTING", "KUBE-IPVS-SERVICES"),
        ("OUTPUT", "KUBE-IPVS-SERVICES"),
    ] {
        assert_eq!(
            lines_with(&nat, &[&format!("-A {builtin} "), &format!("-j {chain}")]),
            1,
            "one jump from {builtin}:\n{nat}"
        );
    }
    // No rule names a Service: shop's Local NodePort keeps the client address by being in no
    // masquerade set, web's Cluster one is in the external set.
    assert!(!nat.contains("30080"), "{nat}");
    let external = ipset_ok(&["save", "KUBE-IPVS-EXTERNAL"]);
    assert!(
        !external.contains("192.168.56.10,tcp:30080"),
        "shop's Local NodePort is not masqueraded:\n{external}"
    );
    assert_eq!(
        lines_with(
            &nat,
            &["-A KUBE-IPVS-CLUSTER-MASQ", "-s 10.244.0.0/16", "-j RETURN"]
        ),
        1
    );
    // Without --node-pod-cidr hairpin is exact through the ipset: one rule, whose set holds
    // exactly the addresses of node-1's endpoints (of five Services).
    assert_eq!(
        lines_with(&nat, &["-A KUBE-IPVS-MASQ", "hairpin"]),
        1,
        "one hairpin rule without --node-pod-cidr:\n{nat}"
    );
    assert_eq!(
        lines_with(
            &nat,
            &[
                "-A KUBE-IPVS-MASQ",
                "-m set --match-set KUBE-IPVS-HAIRPIN src,dst",
                "hairpin"
            ]
        ),
        1,
        "{nat}"
    );
    let node1 = [
        "10.244.1.10",
        "10.244.1.20",
        "10.244.1.30",
        "10.244.1.40",
        "10.244.1.53",
    ];
    assert_eq!(hairpin_members(), node1, "the set holds node-1's endpoints");
    assert!(!nat.contains("masquerade-all"));
    assert_eq!(metric("kube_ipvs_masquerade_errors_total"), Some(0.0));

    // web's endpoint on node-1 changes address: the set follows, the rules stay one.
    let web = dir.join("web.yaml");
    let text = std::fs::read_to_string(&web).expect("read web.yaml");
    std::fs::write(
        &web,
        text.replace("addresses: [10.244.1.10]", "addresses: [10.244.1.11]"),
    )
    .expect("write web.yaml");
    wait_for(
        "the hairpin set to follow web's endpoint",
        Duration::from_secs(30),
        || hairpin_members().contains(&"10.244.1.11".to_owned()),
    );
    assert_eq!(
        hairpin_members(),
        [
            "10.244.1.11",
            "10.244.1.20",
            "10.244.1.30",
            "10.244.1.40",
            "10.244.1.53"
        ]
    );
    assert_eq!(lines_with(&nat_rules(), &["hairpin"]), 1);
    // Someone flushing the set is repaired by the next reconcile (every 2 s here).
    ipset_ok(&["flush", "KUBE-IPVS-HAIRPIN"]);
    wait_for(
        "the reconcile to refill the hairpin set",
        Duration::from_secs(30),
        || hairpin_members().len() == 5,
    );

    // shop turning Cluster policy drops its exemption without a restart.
    let shop = dir.join("shop.yaml");
    let text = std::fs::read_to_string(&shop).expect("read shop.yaml");
    std::fs::write(
        &shop,
        text.replace(
            "externalTrafficPolicy: Local",
            "externalTrafficPolicy: Cluster",
        ),
    )
    .expect("write shop.yaml");
    let rules_before = nat_rules().lines().filter(|l| l.starts_with("-A ")).count();
    wait_for(
        "shop's NodePort to join the external set",
        Duration::from_secs(30),
        || ipset_ok(&["save", "KUBE-IPVS-EXTERNAL"]).contains("192.168.56.10,tcp:30080"),
    );
    assert_eq!(
        nat_rules().lines().filter(|l| l.starts_with("-A ")).count(),
        rules_before,
        "a policy change is a set delta, not a rule change"
    );
    assert_eq!(agent.terminate(), Some(0));

    // Restarted with --masquerade-all and a node Pod CIDR: one rule marks everything; the jump
    // is not duplicated.
    let mut agent = Agent::start(
        &dir,
        &["--masquerade-all", "--node-pod-cidr", "10.244.1.0/24"],
    );
    agent.wait_healthy();
    wait_for("the masquerade-all rule", Duration::from_secs(30), || {
        nat_rules().contains("masquerade-all")
    });
    let nat = nat_rules();
    assert_eq!(lines_with(&nat, &["-A KUBE-IPVS-CLUSTER-MASQ"]), 1, "{nat}");
    assert!(!nat.contains("not a local pod"), "{nat}");
    assert_eq!(
        lines_with(&nat, &["-A POSTROUTING", "-j KUBE-IPVS-POSTROUTING"]),
        1
    );
    assert_eq!(agent.terminate(), Some(0));

    // Without masquerade-all, the node Pod CIDR gives one hairpin rule for all endpoints.
    let mut agent = Agent::start(&dir, &["--node-pod-cidr", "10.244.1.0/24"]);
    agent.wait_healthy();
    wait_for("the hairpin rule", Duration::from_secs(30), || {
        nat_rules().contains("hairpin")
    });
    let nat = nat_rules();
    assert_eq!(
        lines_with(
            &nat,
            &[
                "-A KUBE-IPVS-MASQ",
                "-s 10.244.1.0/24",
                "-d 10.244.1.0/24",
                "hairpin"
            ]
        ),
        1,
        "{nat}"
    );
    assert_eq!(lines_with(&nat, &["hairpin"]), 1);
    assert_eq!(agent.terminate(), Some(0));
}

#[test]
fn no_masquerade_leaves_the_nat_table_alone() {
    let dir = manifests("run-nomasq");
    let mut agent = Agent::start(
        &dir,
        &["--no-masquerade", "--cluster-cidr", "10.244.0.0/16"],
    );
    agent.wait_healthy();
    // The startup sync is over once healthy; its masquerade step would have followed at once.
    wait_for("a second sync", Duration::from_secs(10), || {
        in_sync(&dir, &[])
    });
    assert!(!nat_rules().contains("KUBE-IPVS"));
    assert!(
        !stdout(&run("iptables-save", &["-t", "filter"])).contains("KUBE-IPVS"),
        "nor the filter table"
    );
    assert_eq!(agent.terminate(), Some(0));
}

const UDP_SERVICE: &str = "apiVersion: v1
kind: Service
metadata: {name: dns, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.53
  clusterIPs: [10.96.0.53]
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
";

fn udp_slice(addrs: &[&str]) -> String {
    let mut s = String::from(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: dns-a1
  namespace: default
  labels: {kubernetes.io/service-name: dns}
addressType: IPv4
endpoints:
",
    );
    for a in addrs {
        s += &format!(
            "- addresses: [{a}]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  nodeName: node-1\n"
        );
    }
    s += "ports:\n- {name: dns, port: 5353, protocol: UDP}\n";
    s
}

/// A UDP Service with two endpoints in a peer namespace; a datagram from each of two client
/// ports is scheduled to each endpoint. Removing one endpoint from the EndpointSlice makes the
/// agent delete that real server and then its conntrack entry (which would otherwise pin the
/// flow to the gone endpoint for the UDP timeout, unless the kernel's `expire_nodest_conn`
/// drops it first), and keep the other's.
#[test]
fn removing_a_udp_endpoint_deletes_its_conntrack_entries() {
    use kube_ipvs_netlink::nfnl::conntrack;
    let ip = "/usr/sbin/ip";
    let ns = "run-udp";
    let _ = run(ip, &["netns", "del", ns]);
    ip_ok(&["netns", "add", ns]);
    ip_ok(&["link", "add", "ru0", "type", "veth", "peer", "name", "ru1"]);
    ip_ok(&["link", "set", "ru1", "netns", ns]);
    ip_ok(&["addr", "add", "192.168.78.1/24", "dev", "ru0"]);
    ip_ok(&["link", "set", "ru0", "up"]);
    for a in ["192.168.78.2/24", "192.168.78.3/24", "192.168.78.4/24"] {
        ip_ok(&["-n", ns, "addr", "add", a, "dev", "ru1"]);
    }
    ip_ok(&["-n", ns, "link", "set", "ru1", "up"]);
    ip_ok(&[
        "-n",
        ns,
        "route",
        "add",
        "10.96.0.0/24",
        "via",
        "192.168.78.1",
    ]);

    let dir = PathBuf::from("/tmp/kube-ipvs-run-udp");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create manifest dir");
    std::fs::write(dir.join("svc.yaml"), UDP_SERVICE).expect("write");
    let slice = dir.join("slice.yaml");
    std::fs::write(&slice, udp_slice(&["192.168.78.3", "192.168.78.4"])).expect("write");
    // The masquerade rules' nat table is what makes this namespace track connections.
    let mut agent = Agent::start(&dir, &["--cluster-cidr", "10.244.0.0/16"]);
    agent.wait_healthy();
    wait_for("the masquerade rules", Duration::from_secs(30), || {
        nat_rules().contains("not a local pod")
    });

    for sport in ["40053", "40054"] {
        let target = format!("UDP-SENDTO:10.96.0.53:53,bind=192.168.78.2:{sport}");
        let out = run(
            ip,
            &[
                "netns",
                "exec",
                ns,
                "socat",
                "-u",
                "OPEN:/proc/sys/kernel/ostype",
                &target,
            ],
        );
        assert!(out.status.success());
    }
    let ep = |a: &str| a.parse::<std::net::IpAddr>().expect("ip");
    let flows_to = |a: &str| {
        conntrack::entries(false)
            .expect("conntrack dump")
            .iter()
            .filter(|e| {
                e.orig.protocol == conntrack::IPPROTO_UDP
                    && e.reply.src == ep(a)
                    && e.reply.src_port == 5353
            })
            .count()
    };
    assert_eq!(
        flows_to("192.168.78.3"),
        1,
        "a tracked flow to each endpoint"
    );
    assert_eq!(flows_to("192.168.78.4"), 1);
    // With expire_nodest_conn (which the agent sets) the kernel drops a deleted real server's
    // IPVS connections, and with them their conntrack entries, a jiffy later on its own; turned
    // off here so that only the agent's cleanup can remove the entry.
    std::fs::write("/proc/sys/net/ipv4/vs/expire_nodest_conn", "0").expect("sysctl");

    std::fs::write(&slice, udp_slice(&["192.168.78.4"])).expect("write");
    wait_for(
        "the removed endpoint's flow to go",
        Duration::from_secs(30),
        || flows_to("192.168.78.3") == 0,
    );
    assert!(!ipvsadm(&["-Ln"]).contains("192.168.78.3:5353"));
    assert_eq!(
        flows_to("192.168.78.4"),
        1,
        "the other endpoint's flow is kept"
    );
    wait_for("the cleanup to be counted", Duration::from_secs(10), || {
        metric("kube_ipvs_conntrack_entries_deleted_total") == Some(1.0)
    });
    assert_eq!(metric("kube_ipvs_conntrack_errors_total"), Some(0.0));
    assert_eq!(agent.terminate(), Some(0));
    let _ = run(ip, &["netns", "del", ns]);
}

/// The agent's command line with only `NET_ADMIN` and `NET_RAW` (the capability bounding set,
/// so even root gets no other), `/proc/sys` read-only, as a container runtime mounts it for an
/// unprivileged container, and the root filesystem read-only (`readOnlyRootFilesystem`, with
/// `/tmp` and `/run` too where they are mounts of their own) but for `/run/xtables.lock`, which
/// the DaemonSet mounts from the host: a mount namespace of its own remounts them.
fn restricted_run(dir: &Path, log: PathBuf) -> Agent {
    let script = format!(
        "mount -o bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && \
         touch /run/xtables.lock && mount --bind /run/xtables.lock /run/xtables.lock && \
         for m in / /run /tmp; do \
           if grep -q \"^[^ ]* [^ ]* [^ ]* [^ ]* $m \" /proc/self/mountinfo; then \
             mount -o remount,bind,ro $m || exit 1; fi; done && \
         exec /usr/bin/setpriv --bounding-set=-all,+net_admin,+net_raw -- {} run --manifests {} \
         --hostname-override node-1 --cluster-cidr 10.244.0.0/16",
        kube_ipvs_bin(),
        dir.display()
    );
    Agent::spawn_program(
        "unshare",
        &["-m", "--propagation", "private", "/bin/sh", "-c", &script],
        log,
    )
}

/// `kube-ipvs run --init-only` on the manifests in `dir` as node-1, with `extra` flags: its
/// exit code and output.
fn init_only(dir: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let mut args = vec![
        "run",
        "--init-only",
        "--manifests",
        dir.to_str().expect("utf-8"),
        "--hostname-override",
        "node-1",
        "--cluster-cidr",
        "10.244.0.0/16",
    ];
    args.extend_from_slice(extra);
    run_exit(&args)
}

/// The kernel's IPVS rate estimator (`net.ipv4.vs.run_estimation`, per network namespace) is
/// left as it is, as kube-proxy leaves it, unless `--no-ipvs-rate-estimation` turns it off;
/// and nothing turns it back on.
#[test]
fn the_rate_estimator_is_left_alone_unless_turned_off() {
    node_address();
    let dir = manifests("run-rate-estimation");
    let sysctl = "/proc/sys/net/ipv4/vs/run_estimation";
    let read = || {
        std::fs::read_to_string(sysctl)
            .expect("run_estimation (kernel 5.12 or later)")
            .trim()
            .to_owned()
    };
    assert_eq!(read(), "1", "the kernel's default");
    let init = |extra: &[&str]| {
        let (code, stderr) = init_only(&dir, extra);
        assert_eq!(code, Some(0), "run --init-only {extra:?}:\n{stderr}");
        stderr
    };
    init(&[]);
    assert_eq!(read(), "1", "left alone without the flag");
    let log = init(&["--no-ipvs-rate-estimation"]);
    assert_eq!(read(), "0", "turned off with it");
    assert!(
        log.contains("net.ipv4.vs.run_estimation=0"),
        "the change is logged:\n{log}"
    );
    init(&[]);
    assert_eq!(read(), "0", "not turned back on");
}

/// kube-proxy's least-privilege split, on the real kernel: `run --init-only` (full root, as a
/// privileged init container) loads the modules and sets the sysctls, then exits 0; after it,
/// `run` with only `NET_ADMIN` and `NET_RAW`, a read-only `/proc/sys` and a read-only root
/// filesystem (`deploy/daemonset.yaml`'s containers) converges, answers health and writes its
/// iptables rules and sets. Without the init step the same restricted
/// `run` cannot set the sysctls and exits 5 naming one.
#[test]
fn init_only_then_run_with_net_admin_and_net_raw_only() {
    node_address();
    let dir = manifests("run-least-privilege");

    let mut before = restricted_run(&dir, dir.with_extension("before.log"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Ok(Some(status)) = before.child.try_wait() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "restricted run kept running without init"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = before.log();
    assert_eq!(status.code(), Some(5), "exit without --init-only:\n{log}");
    assert!(
        log.contains("sysctl"),
        "names the sysctl it could not set:\n{log}"
    );

    let (code, stderr) = init_only(&dir, &[]);
    assert_eq!(code, Some(0), "--init-only:\n{stderr}");
    assert!(
        ipvsadm(&["-Ln"]).lines().count() <= 3,
        "--init-only programs nothing"
    );

    let mut agent = restricted_run(&dir, dir.with_extension("after.log"));
    agent.wait_healthy();
    wait_for("check to say in sync", Duration::from_secs(30), || {
        in_sync(&dir, &[])
    });
    wait_for(
        "the iptables rules of the restricted agent",
        Duration::from_secs(30),
        || nat_rules().contains("not a local pod"),
    );
    let status = run_ok(
        "/bin/sh",
        &[
            "-c",
            &format!("grep CapEff /proc/{}/status", agent.child.id()),
        ],
    );
    // The shell exec'd setpriv, which exec'd the agent: same pid. NET_ADMIN is bit 12,
    // NET_RAW bit 13.
    assert!(status.contains("0000000000003000"), "{status}");
    // Its root filesystem was read-only all along (mountinfo: mount point, then options).
    let mounts = std::fs::read_to_string(format!("/proc/{}/mountinfo", agent.child.id()))
        .expect("the agent's mountinfo");
    let options = |point: &str| {
        mounts.lines().find_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.get(4) == Some(&point)).then(|| f.get(5).copied().unwrap_or_default().to_owned())
        })
    };
    for point in ["/", "/proc/sys"] {
        let o = options(point).unwrap_or_default();
        assert!(
            o.split(',').any(|w| w == "ro"),
            "{point} mounted {o:?}:\n{mounts}"
        );
    }
    assert_eq!(agent.terminate(), Some(0));
}
