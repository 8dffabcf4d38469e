//! Helpers of the kernel tests that run against the real kube-apiserver
//! (`tests/kernel_apiserver*.rs`): the forwarded ports vm-test provides, an admin kube-rs client
//! in a namespace of the test's own, the agent run as the DaemonSet's ServiceAccount, and the
//! IPVS table read back with `ipvsadm -Sn`.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

use super::{RunningAgent, free_port, ipvsadm, kube_ipvs_bin, run, wait_for};

/// Where vm-test puts the kubeconfigs and the port numbers in the guest.
pub(crate) const DIR: &str = "/etc/kube-ipvs-test";
/// The node the agent runs as (a Node object the tests create).
pub(crate) const NODE: &str = "node-1";
/// The EndpointSlice controller's annotation (kube-proxy's network programming latency).
pub(crate) const TRIGGER: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// The forwarded ports from vm-test.
pub(crate) struct Ports {
    pub(crate) apiserver: u16,
    pub(crate) control: u16,
}

pub(crate) fn ports() -> Ports {
    let text = std::fs::read_to_string(format!("{DIR}/ports")).unwrap_or_else(|e| {
        panic!(
            "{DIR}/ports: {e}; these tests need the API server that `cargo xtask vm-test` starts, \
             which it does when its filter can select a `kernel_apiserver*` target: give the \
             target with the test (`kube-ipvs/kernel_apiserver::NAME`), not the name alone"
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
pub(crate) struct Forwards(Vec<Child>);

impl Forwards {
    pub(crate) fn start(ports: &[u16]) -> Forwards {
        let mut children = Vec::new();
        for port in ports {
            children.push(relay(*port, *port));
        }
        Forwards(children)
    }
}

/// A socat relay from 127.0.0.1:`listen` in this namespace to the host's `port`, accepting
/// connections when this returns.
fn relay(listen: u16, port: u16) -> Child {
    let child = Command::new("socat")
        .arg(format!("TCP-LISTEN:{listen},bind=127.0.0.1,fork,reuseaddr"))
        .arg(format!("UNIX-CONNECT:/run/host-{port}.sock"))
        .stdin(Stdio::null())
        .spawn()
        .expect("start socat");
    wait_for(
        &format!("127.0.0.1:{listen} to forward to the host's {port}"),
        Duration::from_secs(10),
        || TcpStream::connect(("127.0.0.1", listen)).is_ok(),
    );
    child
}

impl Drop for Forwards {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `NODE` has an `InternalIP` while this lives (see [`Cluster::node_address`]).
pub(crate) struct NodeAddress<'a> {
    cluster: &'a Cluster,
}

impl Drop for NodeAddress<'_> {
    fn drop(&mut self) {
        // Not a panic: this may run while the test unwinds (a double panic aborts before the
        // Cluster cleans up), and the next Cluster clears the addresses anyway.
        if let Err(e) = self.cluster.patch_node_addresses(serde_json::Value::Null) {
            eprintln!("taking Node {NODE}'s addresses away again: {e}");
        }
    }
}

/// One test's world: the forwarded ports, an admin client, a namespace, a runtime.
pub(crate) struct Cluster {
    pub(crate) rt: tokio::runtime::Runtime,
    pub(crate) client: kube::Client,
    pub(crate) ns: String,
    pub(crate) ports: Ports,
    _forwards: Forwards,
}

impl Cluster {
    pub(crate) fn new(ns: &str) -> Cluster {
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
        let addressed = self.rt.block_on(async {
            let nodes: Api<Node> = Api::all(self.client.clone());
            let addressed = match nodes.get_opt(NODE).await.expect("get node") {
                None => {
                    nodes
                        .create(&PostParams::default(), &node)
                        .await
                        .expect("create node");
                    false
                }
                Some(n) => n.status.is_some_and(|s| s.addresses.is_some()),
            };
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
            addressed
        });
        // A test killed at its limit kept its NodeAddress: every test starts without one.
        if addressed {
            self.patch_node_addresses(serde_json::Value::Null)
                .unwrap_or_else(|e| panic!("clear Node {NODE}'s addresses: {e}"));
        }
    }

    /// Gives `NODE` this `InternalIP` (a JSON merge patch of its status) until the guard drops,
    /// which takes the addresses away again so later tests see the Node they expect. kube-proxy
    /// waits 30 s at start for its Node to have an address before it programs anything.
    pub(crate) fn node_address(&self, ip: &str) -> NodeAddress<'_> {
        let addresses = serde_json::json!([{"type": "InternalIP", "address": ip}]);
        if let Err(e) = self.patch_node_addresses(addresses) {
            panic!("patch Node {NODE}'s addresses: {e}");
        }
        NodeAddress { cluster: self }
    }

    fn patch_node_addresses(&self, addresses: serde_json::Value) -> Result<Node, kube::Error> {
        let patch = serde_json::json!({"status": {"addresses": addresses}});
        self.rt.block_on(async {
            Api::<Node>::all(self.client.clone())
                .patch_status(NODE, &PatchParams::default(), &Patch::Merge(&patch))
                .await
        })
    }

    pub(crate) fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub(crate) fn slices(&self) -> Api<EndpointSlice> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Creates Service `name` (ClusterIP allocated by the API server) on TCP `port` -> 8080,
    /// without endpoints. Returns the ClusterIP.
    pub(crate) fn create_service(&self, name: &str, port: u16) -> String {
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

    /// Creates Service `name` with one EndpointSlice holding `endpoints` (address, ready).
    /// Returns the ClusterIP.
    pub(crate) fn create_service_with(
        &self,
        name: &str,
        port: u16,
        endpoints: &[(&str, bool)],
    ) -> String {
        let ip = self.create_service(name, port);
        self.put_slice(name, endpoints, None);
        ip
    }

    /// Creates or replaces the EndpointSlice `NAME-1` of Service `name` (server-side apply)
    /// with these endpoints (address, ready) on `NODE` and, if given, this trigger-time
    /// annotation.
    pub(crate) fn put_slice(&self, name: &str, endpoints: &[(&str, bool)], trigger: Option<&str>) {
        let annotations = match trigger {
            Some(t) => format!("  annotations: {{{TRIGGER}: \"{t}\"}}\n"),
            None => String::new(),
        };
        let mut text = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
             labels: {{kubernetes.io/service-name: {name}}}\n{annotations}addressType: IPv4\n\
             ports:\n- {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n"
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

    pub(crate) fn delete_service(&self, name: &str) {
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
    pub(crate) fn restart_apiserver(&self) {
        self.control("restart-apiserver");
    }

    /// Sends one command to the host's control port (xtask/src/cluster.rs: `restart-apiserver`,
    /// `stop-apiserver`, `start-apiserver`, `compact-etcd`) and returns what follows its `ok`.
    pub(crate) fn control(&self, command: &str) -> String {
        self.try_control(command)
            .unwrap_or_else(|e| panic!("the host could not {command}: {e}"))
    }

    /// [`Cluster::control`] without panicking (for a drop guard).
    pub(crate) fn try_control(&self, command: &str) -> Result<String, String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.ports.control))
            .map_err(|e| format!("connect the control port: {e}"))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(180)))
            .map_err(|e| e.to_string())?;
        writeln!(stream, "{command}").map_err(|e| e.to_string())?;
        let mut answer = String::new();
        BufReader::new(stream)
            .read_line(&mut answer)
            .map_err(|e| e.to_string())?;
        let answer = answer.trim();
        answer
            .strip_prefix("ok")
            .map(|rest| rest.trim().to_owned())
            .ok_or_else(|| answer.to_owned())
    }
}

/// A relay of the API server's port that a test can close and reopen, so an agent whose
/// kubeconfig points here can be cut off from the API server while the test still reaches it.
pub(crate) struct Gate {
    apiserver: u16,
    pub(crate) port: u16,
    relay: Option<Child>,
}

impl Gate {
    pub(crate) fn open(apiserver: u16) -> Gate {
        let mut gate = Gate {
            apiserver,
            port: free_port(),
            relay: None,
        };
        gate.reopen();
        gate
    }

    /// A kubeconfig like `DIR/NAME`, with the server behind this gate; written to `path`.
    pub(crate) fn kubeconfig(&self, name: &str, path: &str) -> String {
        let text = std::fs::read_to_string(format!("{DIR}/{name}")).expect("read kubeconfig");
        let direct = format!("https://127.0.0.1:{}", self.apiserver);
        assert!(text.contains(&direct), "{name} does not point at {direct}");
        let gated = text.replace(&direct, &format!("https://127.0.0.1:{}", self.port));
        std::fs::write(path, gated).expect("write the gated kubeconfig");
        path.to_owned()
    }

    /// Stops accepting connections. Connections already relayed live until their far end
    /// closes (stopping the API server closes them).
    pub(crate) fn close(&mut self) {
        if let Some(mut relay) = self.relay.take() {
            let _ = relay.kill();
            let _ = relay.wait();
        }
        wait_for(
            "the gate to refuse connections",
            Duration::from_secs(10),
            || TcpStream::connect(("127.0.0.1", self.port)).is_err(),
        );
    }

    pub(crate) fn reopen(&mut self) {
        self.relay = Some(relay(self.port, self.apiserver));
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if let Some(mut relay) = self.relay.take() {
            let _ = relay.kill();
            let _ = relay.wait();
        }
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

pub(crate) fn yaml<T: serde::de::DeserializeOwned>(text: &str) -> T {
    serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("test YAML: {e}\n{text}"))
}

/// A running `kube-ipvs run` against the API server, as the DaemonSet's ServiceAccount.
pub(crate) struct Agent {
    inner: RunningAgent,
    metrics: u16,
}

impl Agent {
    pub(crate) fn start(name: &str) -> Agent {
        Agent::start_with(name, &format!("{DIR}/agent.kubeconfig"))
    }

    /// [`Agent::start`] with another kubeconfig (one behind a [`Gate`], say).
    pub(crate) fn start_with(name: &str, kubeconfig: &str) -> Agent {
        let metrics = free_port();
        let healthz = loop {
            let p = free_port();
            if p != metrics {
                break p;
            }
        };
        let log = std::path::PathBuf::from(format!("/tmp/kube-ipvs-apiserver-{name}.log"));
        let args = [
            "run".to_owned(),
            format!("--kubeconfig={kubeconfig}"),
            format!("--hostname-override={NODE}"),
            "--cluster-cidr=10.244.0.0/16".to_owned(),
            format!("--healthz-bind-address=127.0.0.1:{healthz}"),
            format!("--metrics-bind-address=127.0.0.1:{metrics}"),
            // Long enough that nothing in a test comes from the periodic reconcile: every
            // change must arrive through the watch.
            "--sync-period=1h".to_owned(),
            "--min-sync-period=0s".to_owned(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Agent {
            inner: RunningAgent::spawn(&args, log),
            metrics,
        }
    }

    pub(crate) fn log(&self) -> String {
        self.inner.log()
    }

    pub(crate) fn assert_running(&mut self) {
        self.inner.assert_running();
    }

    /// Sends SIGTERM and waits for the exit code.
    pub(crate) fn terminate(self) -> Option<i32> {
        self.inner.terminate()
    }

    /// The value of an unlabelled counter or gauge in `/metrics`.
    pub(crate) fn metric(&self, name: &str) -> Option<u64> {
        self.metrics()?.lines().find_map(|l| {
            let value = l.strip_prefix(name)?.strip_prefix(' ')?;
            value.trim().parse().ok()
        })
    }

    /// `/metrics`, or `None` while it does not answer.
    pub(crate) fn metrics(&self) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
    }
}

/// `kube-ipvs check` against the API server (as admin): exit 0 means the kernel holds exactly
/// what the API says.
pub(crate) fn check_exit() -> Option<i32> {
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
pub(crate) fn table() -> BTreeMap<String, Vec<String>> {
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

pub(crate) fn wait_for_table(
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

pub(crate) fn rs(addrs: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = addrs.iter().map(|a| format!("{a}:8080 w1")).collect();
    v.sort();
    v
}
