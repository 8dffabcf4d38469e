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

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ipvsadm, kube_ipvs_bin, wait_for};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

const DIR: &str = "/etc/kube-ipvs-test";
const NODE: &str = "node-1";
const METRIC: &str = "kubeproxy_network_programming_duration_seconds";
const TRIGGER: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// The API server's forwarded port, from vm-test.
fn apiserver_port() -> u16 {
    let text = std::fs::read_to_string(format!("{DIR}/ports")).unwrap_or_else(|e| {
        panic!(
            "{DIR}/ports: {e}; these tests need the API server that `cargo xtask vm-test` starts"
        )
    });
    text.lines()
        .find_map(|l| l.strip_prefix("apiserver="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{DIR}/ports has no apiserver"))
}

/// A relay making 127.0.0.1:PORT in this namespace the host's port (through the guest's
/// `/run/host-PORT.sock`, see xtask/src/vm.rs), killed on drop.
struct Forward(Child);

impl Forward {
    fn start(port: u16) -> Forward {
        let child = Command::new("socat")
            .arg(format!("TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr"))
            .arg(format!("UNIX-CONNECT:/run/host-{port}.sock"))
            .stdin(Stdio::null())
            .spawn()
            .expect("start socat");
        wait_for(
            &format!("127.0.0.1:{port} to forward"),
            Duration::from_secs(10),
            || TcpStream::connect(("127.0.0.1", port)).is_ok(),
        );
        Forward(child)
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One test's world: an admin client, a namespace, a runtime.
struct Cluster {
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    ns: String,
    _forward: Forward,
}

impl Cluster {
    fn new(ns: &str) -> Cluster {
        let forward = Forward::start(apiserver_port());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let client = rt.block_on(async {
            let kubeconfig =
                Kubeconfig::read_from(format!("{DIR}/admin.kubeconfig")).expect("admin kubeconfig");
            let config =
                kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                    .await
                    .expect("kube config");
            kube::Client::try_from(config).expect("kube client")
        });
        let cluster = Cluster {
            rt,
            client,
            ns: ns.to_owned(),
            _forward: forward,
        };
        cluster.create_node_and_namespace();
        cluster
    }

    fn create_node_and_namespace(&self) {
        let node: Node = yaml(&format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE}}}\n"
        ));
        let namespace: Namespace = yaml(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {}}}\n",
            self.ns
        ));
        self.rt.block_on(async {
            let nodes: Api<Node> = Api::all(self.client.clone());
            if nodes.get_opt(NODE).await.expect("get node").is_none() {
                nodes
                    .create(&PostParams::default(), &node)
                    .await
                    .expect("create node");
            }
            let namespaces: Api<Namespace> = Api::all(self.client.clone());
            if namespaces
                .get_opt(&self.ns)
                .await
                .expect("get namespace")
                .is_none()
            {
                namespaces
                    .create(&PostParams::default(), &namespace)
                    .await
                    .expect("create namespace");
            }
        });
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn slices(&self) -> Api<EndpointSlice> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Creates Service `name` (ClusterIP allocated by the API server) on TCP `port` -> 8080,
    /// without endpoints. Returns the ClusterIP.
    fn create_service(&self, name: &str, port: u16) -> String {
        let svc: Service = yaml(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec:\n  ports:\n  \
             - {{name: http, port: {port}, protocol: TCP, targetPort: 8080}}\n"
        ));
        let created = self.rt.block_on(async {
            self.services()
                .create(&PostParams::default(), &svc)
                .await
                .unwrap_or_else(|e| panic!("create Service {}/{name}: {e}", self.ns))
        });
        created
            .spec
            .and_then(|s| s.cluster_ip)
            .expect("the API server allocated a ClusterIP")
    }

    /// Creates or replaces the EndpointSlice `NAME-1` of Service `name` (server-side apply) with
    /// these ready endpoints and, if given, this trigger-time annotation.
    fn put_slice(&self, name: &str, endpoints: &[&str], trigger: Option<&str>) {
        let annotations = match trigger {
            Some(t) => format!("  annotations: {{{TRIGGER}: \"{t}\"}}\n"),
            None => String::new(),
        };
        let mut text = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
             labels: {{kubernetes.io/service-name: {name}}}\n{annotations}addressType: IPv4\n\
             ports:\n- {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n"
        );
        for addr in endpoints {
            text.push_str(&format!(
                "- addresses: [\"{addr}\"]\n  conditions: {{ready: true}}\n  nodeName: {NODE}\n"
            ));
        }
        let slice: EndpointSlice = yaml(&text);
        let slice_name = format!("{name}-1");
        self.rt.block_on(async {
            self.slices()
                .patch(
                    &slice_name,
                    &PatchParams::apply("kube-ipvs-test").force(),
                    &Patch::Apply(&slice),
                )
                .await
                .unwrap_or_else(|e| panic!("apply EndpointSlice {}/{slice_name}: {e}", self.ns))
        });
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let services = self.services();
        let slices = self.slices();
        self.rt.block_on(async {
            let lp = ListParams::default();
            let _ = services
                .delete_collection(&DeleteParams::default(), &lp)
                .await;
            let _ = slices
                .delete_collection(&DeleteParams::default(), &lp)
                .await;
        });
    }
}

fn yaml<T: serde::de::DeserializeOwned>(text: &str) -> T {
    serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("test YAML: {e}\n{text}"))
}

/// A running `kube-ipvs run` against the API server, as the DaemonSet's ServiceAccount.
struct Agent {
    child: Child,
    log: std::path::PathBuf,
    metrics: u16,
}

impl Agent {
    fn start(name: &str) -> Agent {
        let metrics = free_port();
        let healthz = loop {
            let p = free_port();
            if p != metrics {
                break p;
            }
        };
        let log = std::path::PathBuf::from(format!("/tmp/kube-ipvs-apiserver-{name}.log"));
        let file = std::fs::File::create(&log).expect("create log");
        let args = [
            "run".to_owned(),
            format!("--kubeconfig={DIR}/agent.kubeconfig"),
            format!("--hostname-override={NODE}"),
            "--cluster-cidr=10.244.0.0/16".to_owned(),
            format!("--healthz-bind-address=127.0.0.1:{healthz}"),
            format!("--metrics-bind-address=127.0.0.1:{metrics}"),
            // Every change arrives through the watch and is its own sync.
            "--sync-period=1h".to_owned(),
            "--min-sync-period=0s".to_owned(),
        ];
        println!("$ kube-ipvs {} &", args.join(" "));
        let child = Command::new(kube_ipvs_bin())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start kube-ipvs run");
        Agent {
            child,
            log,
            metrics,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("kube-ipvs run exited ({status}):\n{}", self.log());
        }
    }

    /// `/metrics`, or `None` while it does not answer.
    fn metrics(&self) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
    }

    /// The histogram's count and sum.
    fn histogram(&self) -> (u64, f64) {
        let text = self.metrics().expect("/metrics answers");
        let value = |suffix: &str| -> String {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{METRIC}_{suffix} ")))
                .unwrap_or_else(|| panic!("no {METRIC}_{suffix} in /metrics:\n{text}"))
                .to_owned()
        };
        let count = value("count").parse().expect("a count");
        let sum = value("sum").parse().expect("a sum");
        (count, sum)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        println!("--- kube-ipvs run log ---\n{}", self.log());
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The real servers of each TCP virtual server, from `ipvsadm -Sn`.
fn table() -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in ipvsadm(&["-Sn"]).lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["-A", "-t", vip, ..] => {
                out.entry((*vip).to_owned()).or_default();
            }
            ["-a", "-t", vip, "-r", rs, ..] => {
                out.entry((*vip).to_owned())
                    .or_default()
                    .push((*rs).to_owned());
            }
            _ => {}
        }
    }
    for rs in out.values_mut() {
        rs.sort();
    }
    out
}

/// Waits until the virtual server `vip` has exactly these real servers (port 8080).
fn wait_for_real_servers(vip: &str, addrs: &[&str]) {
    let mut want: Vec<String> = addrs.iter().map(|a| format!("{a}:8080")).collect();
    want.sort();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let last = table();
        if last.get(vip) == Some(&want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {vip} -> {want:?}; table: {last:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (at most 10 s) until the histogram has counted `n` observations.
fn wait_for_count(agent: &Agent, n: u64) {
    wait_for(
        &format!("{METRIC}_count to reach {n}"),
        Duration::from_secs(10),
        || agent.histogram().0 >= n,
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
    let (count0, sum0) = agent.histogram();
    println!("before: count {count0}, sum {sum0}");

    let vip = format!("{}:80", cluster.create_service("web", 80));
    wait_for_real_servers(&vip, &[]);

    // Two changes annotated with their trigger times: each is observed once. The agent
    // observes at the end of the sync that programmed a change, so the count is waited for,
    // then the time measured: each trigger time is taken after the previous change was in
    // the kernel, so the latencies add up to less than the time from the first trigger time
    // to now.
    let t0 = Instant::now();
    cluster.put_slice("web", &["10.244.1.10"], Some(&now_rfc3339()));
    wait_for_real_servers(&vip, &["10.244.1.10"]);
    cluster.put_slice("web", &["10.244.1.10", "10.244.2.10"], Some(&now_rfc3339()));
    wait_for_real_servers(&vip, &["10.244.1.10", "10.244.2.10"]);
    wait_for_count(&agent, count0 + 2);
    let measured = t0.elapsed();
    let (count, sum) = agent.histogram();
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
    cluster.put_slice("web", &addrs, Some("not-a-time"));
    wait_for_real_servers(&vip, &addrs);
    addrs.push("10.244.4.10");
    cluster.put_slice("web", &addrs, Some("2020-01-01T00:00:00Z"));
    wait_for_real_servers(&vip, &addrs);
    addrs.push("10.244.5.10");
    cluster.put_slice("web", &addrs, None);
    wait_for_real_servers(&vip, &addrs);
    // A last annotated change: syncs run one after another, so once it is observed any
    // observation of the three before it would have been made too.
    addrs.push("10.244.6.10");
    cluster.put_slice("web", &addrs, Some(&now_rfc3339()));
    wait_for_real_servers(&vip, &addrs);
    wait_for_count(&agent, count0 + 3);
    let (count, sum) = agent.histogram();
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
