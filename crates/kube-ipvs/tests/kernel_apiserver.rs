//! The agent against a real kube-apiserver (run in the VM by `cargo xtask vm-test
//! kube-ipvs/kernel_apiserver`; vm-test starts etcd and kube-apiserver on the host, built by
//! `cargo xtask tools`, and skips these tests, saying why, when there is no Go toolchain).
//!
//! The guest reaches the API server through QEMU's guestfwd: a socat relay in this test's
//! network namespace makes `https://127.0.0.1:PORT` the host's API server (xtask/src/vm.rs). The
//! test writes Services and EndpointSlices with the kube-rs client as `admin`; the agent runs as
//! the DaemonSet's ServiceAccount with only the RBAC of `deploy/clusterrole.yaml` (vm-test applies
//! it), so a missing permission fails these tests. What the kernel holds is read back with
//! `ipvsadm -Sn` and `kube-ipvs check`.
//!
//! Proved here: the agent converges on what exists before it starts, follows creates, endpoint
//! updates and deletes, and rides out an API server restart (SIGTERM, same store) without a
//! single change to the IPVS table, then follows changes made after it.
//!
//! Tests run one after another against one API server, so each uses a namespace of its own and
//! deletes its objects when it ends (there is no namespace controller to do it).
#![cfg(feature = "kernel-tests")]

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{ipvsadm, kube_ipvs_bin, run, wait_for};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

const DIR: &str = "/etc/kube-ipvs-test";
const NODE: &str = "node-1";

/// The forwarded ports from vm-test.
struct Ports {
    apiserver: u16,
    control: u16,
}

fn ports() -> Ports {
    let text = std::fs::read_to_string(format!("{DIR}/ports")).unwrap_or_else(|e| {
        panic!(
            "{DIR}/ports: {e}; these tests need the API server that `cargo xtask vm-test` starts"
        )
    });
    let get = |key: &str| -> u16 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{DIR}/ports has no {key}"))
    };
    Ports {
        apiserver: get("apiserver"),
        control: get("control"),
    }
}

/// Relays making 127.0.0.1:PORT in this namespace the host's port (through the guest's
/// `/run/host-PORT.sock`, see xtask/src/vm.rs), killed on drop.
struct Forwards(Vec<Child>);

impl Forwards {
    fn start(ports: &[u16]) -> Forwards {
        let mut children = Vec::new();
        for port in ports {
            let child = Command::new("socat")
                .arg(format!("TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr"))
                .arg(format!("UNIX-CONNECT:/run/host-{port}.sock"))
                .stdin(Stdio::null())
                .spawn()
                .expect("start socat");
            children.push(child);
            wait_for(
                &format!("127.0.0.1:{port} to forward"),
                Duration::from_secs(10),
                || TcpStream::connect(("127.0.0.1", *port)).is_ok(),
            );
        }
        Forwards(children)
    }
}

impl Drop for Forwards {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One test's world: the forwarded ports, an admin client, a namespace, a runtime.
struct Cluster {
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    ns: String,
    ports: Ports,
    _forwards: Forwards,
}

impl Cluster {
    fn new(ns: &str) -> Cluster {
        let ports = ports();
        let forwards = Forwards::start(&[ports.apiserver, ports.control]);
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
            ports,
            _forwards: forwards,
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
    /// with one EndpointSlice holding `endpoints` (address, ready). Returns the ClusterIP.
    fn create_service(&self, name: &str, port: u16, endpoints: &[(&str, bool)]) -> String {
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
        let ip = created
            .spec
            .and_then(|s| s.cluster_ip)
            .expect("the API server allocated a ClusterIP");
        self.put_slice(name, endpoints);
        ip
    }

    /// Creates or replaces the EndpointSlice `NAME-1` of Service `name` (server-side apply).
    fn put_slice(&self, name: &str, endpoints: &[(&str, bool)]) {
        let mut text = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
             labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n\
             - {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n"
        );
        for (addr, ready) in endpoints {
            text.push_str(&format!(
                "- addresses: [\"{addr}\"]\n  conditions: {{ready: {ready}}}\n  nodeName: {NODE}\n"
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

    fn delete_service(&self, name: &str) {
        self.rt.block_on(async {
            self.services()
                .delete(name, &DeleteParams::default())
                .await
                .unwrap_or_else(|e| panic!("delete Service {}/{name}: {e}", self.ns));
            self.slices()
                .delete(&format!("{name}-1"), &DeleteParams::default())
                .await
                .unwrap_or_else(|e| panic!("delete EndpointSlice {}/{name}-1: {e}", self.ns));
        });
    }

    /// Asks the host to restart kube-apiserver (SIGTERM, same etcd) and waits until it is
    /// ready again.
    fn restart_apiserver(&self) {
        let mut stream =
            TcpStream::connect(("127.0.0.1", self.ports.control)).expect("connect control port");
        stream
            .set_read_timeout(Some(Duration::from_secs(180)))
            .expect("timeout");
        stream
            .write_all(b"restart-apiserver\n")
            .expect("send restart");
        let mut answer = String::new();
        BufReader::new(stream)
            .read_line(&mut answer)
            .expect("read restart answer");
        assert_eq!(
            answer.trim(),
            "ok",
            "the host could not restart kube-apiserver"
        );
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
            // Long enough that nothing in a test comes from the periodic reconcile: every
            // change must arrive through the watch.
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
        Agent { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("kube-ipvs run exited ({status}):\n{}", self.log());
        }
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

/// `kube-ipvs check` against the API server (as admin): exit 0 means the kernel holds exactly
/// what the API says.
fn check_exit() -> Option<i32> {
    run(
        &kube_ipvs_bin(),
        &[
            "check",
            &format!("--kubeconfig={DIR}/admin.kubeconfig"),
            &format!("--hostname-override={NODE}"),
        ],
    )
    .status
    .code()
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
            ["-a", "-t", vip, "-r", rs, .., "-w", w] => {
                out.entry((*vip).to_owned())
                    .or_default()
                    .push(format!("{rs} w{w}"));
            }
            _ => {}
        }
    }
    for rs in out.values_mut() {
        rs.sort();
    }
    out
}

fn wait_for_table(
    what: &str,
    mut cond: impl FnMut(&BTreeMap<String, Vec<String>>) -> bool,
) -> BTreeMap<String, Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let last = table();
        if cond(&last) {
            return last;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; table: {last:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn rs(addrs: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = addrs.iter().map(|a| format!("{a}:8080 w1")).collect();
    v.sort();
    v
}

#[test]
fn the_agent_converges_then_follows_creates_updates_and_deletes() {
    let cluster = Cluster::new("converge");
    let web = cluster.create_service("web", 80, &[("10.244.1.10", true), ("10.244.2.10", true)]);
    let api = cluster.create_service("api", 8443, &[("10.244.1.20", true)]);
    let web_vip = format!("{web}:80");
    let api_vip = format!("{api}:8443");

    let mut agent = Agent::start("converge");
    let converged = wait_for_table("the existing Services", |t| {
        t.get(&web_vip) == Some(&rs(&["10.244.1.10", "10.244.2.10"]))
            && t.get(&api_vip) == Some(&rs(&["10.244.1.20"]))
    });
    println!("converged: {converged:#?}");
    // The `kubernetes` Service the API server made for itself is programmed too.
    assert!(
        converged.contains_key("10.96.0.1:443"),
        "default/kubernetes is missing: {converged:#?}"
    );
    wait_for("check to exit 0", Duration::from_secs(30), || {
        check_exit() == Some(0)
    });
    let addrs = run("/usr/sbin/ip", &["-4", "addr", "show", "dev", "kube-ipvs0"]);
    let addrs = String::from_utf8_lossy(&addrs.stdout);
    assert!(
        addrs.contains(&format!("{web}/32")) && addrs.contains(&format!("{api}/32")),
        "ClusterIPs on kube-ipvs0:\n{addrs}"
    );

    // Created after the agent started: arrives through the watch (the sync period is 1 h).
    let db = cluster.create_service("db", 5432, &[("10.244.3.30", true)]);
    let db_vip = format!("{db}:5432");
    wait_for_table("the new Service", |t| {
        t.get(&db_vip) == Some(&rs(&["10.244.3.30"]))
    });

    // An endpoint added, one turned not ready.
    cluster.put_slice(
        "web",
        &[
            ("10.244.1.10", false),
            ("10.244.2.10", true),
            ("10.244.3.10", true),
        ],
    );
    wait_for_table("the endpoint update", |t| {
        t.get(&web_vip) == Some(&rs(&["10.244.2.10", "10.244.3.10"]))
    });

    // Deleted: the virtual server and its address go.
    cluster.delete_service("api");
    let after = wait_for_table("the deleted Service to go", |t| !t.contains_key(&api_vip));
    assert_eq!(after.get(&db_vip), Some(&rs(&["10.244.3.30"])));
    wait_for(
        "the deleted ClusterIP to leave kube-ipvs0",
        Duration::from_secs(30),
        || {
            let out = run("/usr/sbin/ip", &["-4", "addr", "show", "dev", "kube-ipvs0"]);
            !String::from_utf8_lossy(&out.stdout).contains(&format!("{api}/32"))
        },
    );
    wait_for(
        "check to exit 0 after the changes",
        Duration::from_secs(30),
        || check_exit() == Some(0),
    );
    agent.assert_running();
}

#[test]
fn an_api_server_restart_leaves_the_kernel_untouched() {
    let cluster = Cluster::new("restart");
    let web = cluster.create_service("web", 80, &[("10.244.1.10", true), ("10.244.2.10", true)]);
    let web_vip = format!("{web}:80");
    let mut agent = Agent::start("restart");
    wait_for_table("the Service", |t| {
        t.get(&web_vip) == Some(&rs(&["10.244.1.10", "10.244.2.10"]))
    });
    wait_for("check to exit 0", Duration::from_secs(30), || {
        check_exit() == Some(0)
    });
    let before = ipvsadm(&["-Sn"]);

    // Sample the table the whole time the API server is away and while the agent's watches
    // reconnect and relist.
    let done = Arc::new(AtomicBool::new(false));
    let sampler_done = Arc::clone(&done);
    let sampler = std::thread::spawn(move || {
        let mut samples = Vec::new();
        let stop = Instant::now() + Duration::from_secs(600);
        while Instant::now() < stop && !sampler_done.load(Ordering::SeqCst) {
            let out = Command::new(common::ipvsadm_bin())
                .arg("-Sn")
                .output()
                .expect("ipvsadm -Sn");
            samples.push(String::from_utf8_lossy(&out.stdout).into_owned());
            std::thread::sleep(Duration::from_millis(100));
        }
        samples
    });
    let t0 = Instant::now();
    cluster.restart_apiserver();
    println!("kube-apiserver restarted in {:?}", t0.elapsed());

    // A change made after the restart arrives, so the agent's watches are back...
    let api = cluster.create_service("api", 8443, &[("10.244.1.20", true)]);
    let api_vip = format!("{api}:8443");
    wait_for_table("a Service created after the restart", |t| {
        t.contains_key(&api_vip)
    });
    done.store(true, Ordering::SeqCst);
    let samples = sampler.join().expect("sampler");

    // ...and until that change, every sample of our Service's entries was exactly the one
    // from before. (The `kubernetes` Service is left out: a stopping kube-apiserver really does
    // withdraw its own endpoint, and the agent follows that, as it should.)
    let ours = |table: &str| -> Vec<String> {
        table
            .lines()
            .filter(|l| l.contains(&format!(" {web_vip} ")) || l.ends_with(&format!(" {web_vip}")))
            .map(str::to_owned)
            .collect()
    };
    let expected = ours(&before);
    assert_eq!(
        expected.len(),
        3,
        "the virtual server and its two real servers:\n{before}"
    );
    assert!(samples.len() > 5, "the sampler ran {} times", samples.len());
    let differing: Vec<Vec<String>> = samples
        .iter()
        .map(|s| ours(s))
        .filter(|o| *o != expected)
        .collect();
    assert!(
        differing.is_empty(),
        "{web_vip} changed during the API server restart:\nbefore: {expected:#?}\ndiffering samples: {differing:#?}"
    );
    println!("{} samples of {web_vip}, all identical", samples.len());
    wait_for("check to exit 0", Duration::from_secs(30), || {
        check_exit() == Some(0)
    });
    agent.assert_running();
}
