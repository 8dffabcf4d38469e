//! `cargo xtask cluster up|down`: a real Kubernetes cluster on this machine (issue 15).
//!
//! * **Network.** A network namespace of its own (`kube-ipvs-lab`) holds a bridge with the
//!   control plane's address and one tap device per node. Everything on the host side runs in
//!   that namespace (xtask re-executes itself there), so the API server reaches the kubelets and
//!   the Pod IPs, and no lab traffic can leave namespaces the lab made: the namespace has no
//!   route anywhere else.
//! * **Control plane.** etcd, kube-apiserver (Node and RBAC authorisation, NodeRestriction) on
//!   the bridge's address, kube-controller-manager and kube-scheduler (on the namespace's
//!   loopback), from the pinned release.
//! * **Nodes.** QEMU guests (TCG) booting Debian's kernel from a tmpfs root, each with Debian's
//!   containerd, runc and CNI plugins and the pinned kubelet. Pod networking is the standard
//!   `bridge` plugin with `host-local` addresses from the node's Pod CIDR and static routes
//!   between nodes. The host creates the Node objects with their Pod CIDRs before the kubelets
//!   register, so every address is known before anything boots.
//! * **Images.** Nothing is pulled: `testimages.rs` builds every image the `[sig-network]`
//!   tests run (pause, busybox, agnhost, glibc-dns-testing, nginx, regression-issue-74839,
//!   distroless-iptables) and CoreDNS under the pinned manifest's references, and `cargo xtask
//!   image` the agent's; the nodes import them before the kubelet starts.
//!
//! What a lab differs in from a production cluster, all forced by running on one machine
//! without a registry: kubelets authorise every request from a client certificate of the lab's
//! CA (`authorization: AlwaysAllow`, anonymous off), serve a self-signed certificate, and use
//! static tokens; the agent's DaemonSet reaches the API server by address
//! (`integration/lab/kube-ipvs`), as any service proxy must before Services work.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::cluster::{self, ControlPlane, Lab, SERVICE_CIDR};
use crate::netns;
use crate::testimages::{self, Archive};
use crate::tools::{self, ClusterTools, Tools};
use crate::util::{self, secs};
use crate::vm::{self, GuestFile, Job, Tap};

/// The lab's network namespace.
pub(crate) const NETNS: &str = "kube-ipvs-lab";
/// The bridge in it, holding [`GATEWAY`] and the nodes' taps.
const BRIDGE: &str = "lab0";
/// The control plane's address: the bridge's.
const GATEWAY: &str = "10.88.0.1";
const PREFIX_LEN: u8 = 24;
/// kube-apiserver's port (fixed: nothing else binds in the lab's namespace).
const API_PORT: u16 = 6443;
/// The `kubernetes` Service's ClusterIP: the first address of [`SERVICE_CIDR`].
const SERVICE_IP: &str = "10.96.0.1";
/// The cluster DNS Service's ClusterIP, as kubeadm picks it.
const DNS_IP: &str = "10.96.0.10";
/// Set in the re-executed xtask that runs inside [`NETNS`].
const INSIDE_ENV: &str = "KUBE_IPVS_LAB_INSIDE";
/// The agent's lab overlay of `deploy/`.
const KUBE_IPVS_OVERLAY: &str = "integration/lab/kube-ipvs";
/// kube-proxy in IPVS mode, for comparison runs.
const KUBE_PROXY_MANIFEST: &str = "integration/lab/kube-proxy.yaml";
/// The lab's DNS.
const COREDNS_MANIFEST: &str = "integration/lab/coredns.yaml";

/// One node of the lab.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    /// 1-based; picks the address, the tap, the MAC and the Pod CIDR.
    pub(crate) index: u8,
}

impl Node {
    pub(crate) fn name(&self) -> String {
        format!("node-{}", self.index)
    }
    pub(crate) fn address(&self) -> String {
        format!("10.88.0.{}", 10 + u16::from(self.index))
    }
    fn tap(&self) -> String {
        format!("lab-tap{}", self.index)
    }
    fn mac(&self) -> String {
        format!("52:54:00:88:00:{:02x}", 10 + u16::from(self.index))
    }
    pub(crate) fn pod_cidr(&self) -> String {
        format!("10.244.{}.0/24", self.index)
    }
    /// The node's `topology.kubernetes.io/zone`: three zones, dealt out in turn (node-1 in
    /// zone-a, node-2 in zone-b, node-3 in zone-c, node-4 in zone-a again), so that three
    /// nodes make the three zones the topology tests ask for, and six make two nodes in each.
    pub(crate) fn zone(&self) -> String {
        let letter = char::from(b'a' + (self.index - 1) % 3);
        format!("zone-{letter}")
    }
}

/// The service proxy the lab runs on every node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proxy {
    /// `deploy/` through [`KUBE_IPVS_OVERLAY`].
    KubeIpvs,
    /// The pinned `kube-proxy --proxy-mode=ipvs`, as kubeadm deploys it ([`KUBE_PROXY_MANIFEST`]).
    KubeProxy,
}

impl Proxy {
    fn parse(text: &str) -> Result<Self> {
        match text {
            "kube-ipvs" => Ok(Self::KubeIpvs),
            "kube-proxy" => Ok(Self::KubeProxy),
            other => bail!("--proxy {other:?}: want kube-ipvs or kube-proxy"),
        }
    }
    /// The DaemonSet's name in `kube-system`.
    fn daemonset(self) -> &'static str {
        match self {
            Self::KubeIpvs => "kube-ipvs",
            Self::KubeProxy => "kube-proxy",
        }
    }
}

/// What `cluster up` was asked for.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) nodes: u8,
    pub(crate) proxy: Proxy,
    /// Node guests' memory.
    pub(crate) memory_mib: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            nodes: 2,
            proxy: Proxy::KubeIpvs,
            memory_mib: 3072,
        }
    }
}

impl Options {
    pub(crate) fn nodes(&self) -> Vec<Node> {
        (1..=self.nodes).map(|index| Node { index }).collect()
    }
}

/// Removes the lab's namespace and everything running in it.
pub(crate) fn down() -> Result<()> {
    netns::down(NETNS)
}

/// Makes the namespace: loopback, the bridge with [`GATEWAY`], a tap per node on it, and a
/// route to each node's Pod CIDR through the node.
fn netns_up(nodes: &[Node]) -> Result<()> {
    if let Some(why) = unavailable() {
        bail!("cluster: {why}");
    }
    if netns::exists(NETNS) {
        // Another lab on this host (a developer's, CI's) or what a killed run left: never
        // take it over; the fixed names and port 6443 are the lab's.
        bail!(
            "cluster: network namespace {NETNS} exists (a lab is running, or a killed run left \
             it): stop that lab or run `cargo xtask cluster down`"
        );
    }
    netns::up(
        &netns::Bridged {
            name: NETNS,
            bridge: BRIDGE,
            address: format!("{GATEWAY}/{PREFIX_LEN}"),
            taps: nodes.iter().map(Node::tap).collect(),
            routes: nodes.iter().map(|n| (n.pod_cidr(), n.address())).collect(),
        },
        || {
            let _ = down();
        },
    )
}

/// Why this machine cannot run the lab, if it cannot: it needs root and the tun device.
pub(crate) fn unavailable() -> Option<String> {
    netns::unavailable().map(|why| format!("the lab cannot run here: {why}"))
}

/// Everything built on the host before entering the namespace (where the Go module proxy and
/// crates.io are out of reach): the tools, the images and the agent's archive.
struct Artifacts {
    tools: Tools,
    cluster: ClusterTools,
    images: Vec<Archive>,
    /// The proxy's image archive and the reference containerd files it under.
    proxy_image: PathBuf,
    proxy_reference: String,
    pause: String,
}

fn artifacts(proxy: Proxy) -> Result<Artifacts> {
    crate::host::ensure_lab_packages()?;
    // The guest kernel and base image, once, before the nodes' threads would both make them
    // (and outside the namespace, where apt cannot download a new kernel).
    vm::prepare()?;
    let tools = match tools::ensure()? {
        Ok(t) => t,
        Err(tools::Unavailable(why)) => bail!("cluster: {why}"),
    };
    let cluster = match tools::ensure_cluster()? {
        Ok(t) => t,
        Err(tools::Unavailable(why)) => bail!("cluster: {why}"),
    };
    let coredns = match tools::coredns()? {
        Ok(t) => t,
        Err(tools::Unavailable(why)) => bail!("cluster: {why}"),
    };
    let refs = testimages::refs()?;
    let images = testimages::ensure(&cluster, &coredns, &refs)?;
    let (proxy_image, proxy_reference) = match proxy {
        Proxy::KubeIpvs => {
            let (path, reference) = crate::image::build_archive()?;
            (path, format!("docker.io/library/{reference}"))
        }
        Proxy::KubeProxy => {
            let archive = testimages::kube_proxy(&tools)?;
            (archive.path, archive.reference.to_string())
        }
    };
    Ok(Artifacts {
        tools,
        cluster,
        images,
        proxy_image,
        proxy_reference,
        pause: refs.pause.to_string(),
    })
}

/// Builds the lab's Go programs (kubelet, controllers, agnhost, e2e.test, CoreDNS) if the
/// cache lacks them; nothing else (no apt, no images), so it can run beside other work.
pub(crate) fn prebuild() -> Result<()> {
    for built in [
        tools::ensure_cluster()?.map(drop),
        tools::coredns()?.map(drop),
    ] {
        if let Err(tools::Unavailable(why)) = built {
            bail!("cluster: {why}");
        }
    }
    Ok(())
}

/// containerd's configuration on a node: the CRI plugin with runc under the cgroupfs driver,
/// the overlayfs snapshotter, the standard CNI plugins, and the pause image built here.
fn containerd_config(pause: &str) -> String {
    format!(
        r#"version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
"#
    )
}

/// The node's CNI network: a bridge with the node's Pod CIDR, hairpin on (a Pod reaching itself
/// through a Service comes back on its own port), and portmap for `hostPort`.
fn cni_config(node: &Node) -> String {
    let cidr = node.pod_cidr();
    format!(
        r#"{{
  "cniVersion": "0.4.0",
  "name": "lab",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{"subnet": "{cidr}"}}]],
        "routes": [{{"dst": "0.0.0.0/0"}}]
      }}
    }},
    {{"type": "portmap", "capabilities": {{"portMappings": true}}}}
  ]
}}
"#
    )
}

/// The kubelet's configuration (see the module docs for what a lab differs in).
fn kubelet_config() -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
cgroupDriver: cgroupfs
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: /lab/ca.crt
authorization:
  mode: AlwaysAllow
clusterDomain: cluster.local
clusterDNS:
  - {DNS_IP}
resolvConf: ""
failSwapOn: false
# The node's disk is its memory (a tmpfs root): evict only when it is really gone.
evictionHard:
  memory.available: 50Mi
  nodefs.available: "1%"
  imagefs.available: "1%"
  nodefs.inodesFree: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
rotateCertificates: false
"#
    )
}

/// The node's boot script: cgroup v2, the modules and sysctls a node needs, containerd with
/// the images imported, routes to the other nodes' Pods, then the kubelet.
fn node_script(node: &Node, all: &[Node], images: &[String]) -> String {
    let name = node.name();
    let address = node.address();
    let mut routes = String::new();
    for other in all.iter().filter(|o| *o != node) {
        routes.push_str(&format!(
            "/usr/sbin/ip route add {} via {}\n",
            other.pod_cidr(),
            other.address()
        ));
    }
    let images = images.join(" ");
    let modules = crate::kernel::NODE_MODULES.join(" ");
    format!(
        r###"set -eu
hostname {name}
mount -t cgroup2 cgroup2 /sys/fs/cgroup
for c in cpuset cpu io memory pids hugetlb; do
    echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || echo "lab: no cgroup controller $c"
done
modprobe -a {modules}
sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1
mkdir -p /var/lib/kubelet /var/log/pods /var/lib/containerd /run/containerd
{routes}
containerd --config /lab/containerd.toml > /var/log/containerd.log 2>&1 &
tries=0
until ctr version > /dev/null 2>&1; do
    tries=$((tries + 1))
    if [ "$tries" -gt 600 ]; then echo "lab: containerd did not start"; tail -n 30 /var/log/containerd.log; exit 1; fi
    sleep 0.1
done
for archive in /lab/images/*.tar; do
    ctr -n k8s.io images import "$archive" > /dev/null
    rm "$archive"
done
for image in {images}; do
    ctr -n k8s.io images ls -q | grep -qx "$image" || {{ echo "lab: image $image was not imported"; exit 1; }}
done
kubelet --config=/lab/kubelet.yaml --kubeconfig=/lab/kubelet.kubeconfig \
    --hostname-override={name} --node-ip={address} --v=2 > /var/log/kubelet.log 2>&1 &
kubelet=$!
echo "##lab:kubelet-started {name}"
# The console carries the kubelet's errors; everything else is read through the API server.
tail -F /var/log/kubelet.log 2>/dev/null | grep '^E' &
rc=0
wait "$kubelet" || rc=$?
echo "lab: kubelet exited with $rc"
tail -n 40 /var/log/kubelet.log
exit 1
"###
    )
}

/// The guest job of one node.
fn node_job(
    node: &Node,
    all: &[Node],
    plane: &ControlPlane,
    artifacts: &Artifacts,
    options: &Options,
    log: PathBuf,
) -> Result<Job> {
    let mut images: Vec<String> = artifacts
        .images
        .iter()
        .map(|a| a.reference.to_string())
        .collect();
    images.push(artifacts.proxy_reference.clone());
    let mut job = Job::new(&node.name(), node_script(node, all, &images));
    job.memory_mib = options.memory_mib;
    // One vCPU: the host has two cores for both nodes and the control plane, and a guest's two
    // vCPU threads preempted under TCG left a node in a 280 s soft lockup (kubelet and
    // iptables each spinning on one vCPU) in one run of three.
    job.cpus = 1;
    // The node runs until `cluster` stops it.
    job.timeout = Duration::from_secs(7 * 24 * 3600);
    job.tmpfs_root = true;
    job.echo = false;
    job.log = Some(log);
    job.tap = Some(Tap {
        ifname: node.tap(),
        mac: node.mac(),
        address: format!("{}/{PREFIX_LEN}", node.address()),
        gateway: GATEWAY.to_owned(),
    });
    let exe = |host: &Path, guest: &str| GuestFile {
        host: host.to_path_buf(),
        guest: PathBuf::from(guest),
    };
    job.executables = vec![
        exe(&artifacts.cluster.kubelet, "/usr/local/bin/kubelet"),
        exe(Path::new("/usr/bin/containerd"), "/usr/bin/containerd"),
        exe(
            Path::new("/usr/bin/containerd-shim-runc-v2"),
            "/usr/bin/containerd-shim-runc-v2",
        ),
        exe(Path::new("/usr/bin/ctr"), "/usr/bin/ctr"),
        exe(Path::new("/usr/sbin/runc"), "/usr/sbin/runc"),
    ];
    for plugin in ["bridge", "host-local", "loopback", "portmap"] {
        let path = Path::new("/usr/lib/cni").join(plugin);
        job.executables
            .push(exe(&path, &format!("/usr/lib/cni/{plugin}")));
    }
    for image in &artifacts.images {
        let name = image
            .path
            .file_name()
            .context("an image archive has no file name")?
            .to_string_lossy()
            .into_owned();
        job.files
            .push(exe(&image.path, &format!("/lab/images/{name}")));
    }
    job.files
        .push(exe(&artifacts.proxy_image, "/lab/images/proxy.tar"));
    let server = format!("https://{GATEWAY}:{API_PORT}");
    let ca = plane.dir().join("ca.crt");
    job.data = vec![
        ("/lab/ca.crt".into(), fs::read(&ca)?),
        (
            "/lab/kubelet.kubeconfig".into(),
            plane
                .node_kubeconfig(&node.name(), &server, "/lab/ca.crt")?
                .into_bytes(),
        ),
        ("/lab/kubelet.yaml".into(), kubelet_config().into_bytes()),
        (
            "/lab/containerd.toml".into(),
            containerd_config(&artifacts.pause).into_bytes(),
        ),
        (
            "/etc/cni/net.d/10-lab.conflist".into(),
            cni_config(node).into_bytes(),
        ),
        (
            "/etc/hosts".into(),
            format!("127.0.0.1 localhost\n{} {}\n", node.address(), node.name()).into_bytes(),
        ),
        (
            "/etc/machine-id".into(),
            format!(
                "{:032x}\n",
                0x6b75_6265_6970_7673_u128 + u128::from(node.index)
            )
            .into_bytes(),
        ),
    ];
    Ok(job)
}

/// A running lab: the control plane, its two controllers and the node guests.
pub(crate) struct Cluster {
    pub(crate) plane: ControlPlane,
    controllers: Vec<Child>,
    /// Each node's name and the thread running its guest.
    nodes: Vec<(String, Option<std::thread::JoinHandle<Result<vm::Outcome>>>)>,
    stopped: Arc<AtomicBool>,
    pub(crate) dir: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        for (_, handle) in &mut self.nodes {
            if let Some(handle) = handle.take() {
                let _ = handle.join();
            }
        }
        for child in &mut self.controllers {
            cluster::terminate(child);
        }
    }
}

impl Cluster {
    /// A `kubectl` with the admin kubeconfig.
    pub(crate) fn kubectl(&self) -> Result<Command> {
        self.plane.kubectl()
    }

    /// Fails if a node guest has stopped (none should while the lab runs), saying why.
    fn check_nodes(&mut self) -> Result<()> {
        for (name, handle) in &mut self.nodes {
            if !handle.as_ref().is_some_and(|h| h.is_finished()) {
                continue;
            }
            let Some(handle) = handle.take() else {
                continue;
            };
            let log = self.dir.join(format!("{name}.log"));
            let why = match handle.join() {
                Ok(Ok(outcome)) => outcome
                    .failure()
                    .unwrap_or_else(|| format!("its job ended with {:?}", outcome.guest_rc)),
                Ok(Err(err)) => format!("{err:#}"),
                Err(_) => "its thread panicked".to_owned(),
            };
            bail!("node {name} stopped: {why} (console: {})", log.display());
        }
        Ok(())
    }
}

/// Brings the lab up inside its namespace (the caller is already in it) and waits until every
/// node is Ready and the agent runs on each.
fn start(options: &Options, artifacts: &Artifacts) -> Result<Cluster> {
    let started = Instant::now();
    let nodes = options.nodes();
    let dir = util::target_dir()?.join("lab/run");
    let lab = Lab {
        address: GATEWAY.to_owned(),
        port: API_PORT,
        nodes: nodes.iter().map(Node::name).collect(),
        service_ip: SERVICE_IP.to_owned(),
    };
    let plane = ControlPlane::start_lab(&artifacts.tools, &dir.join("control-plane"), &lab)?;
    let kubeconfig = plane.host_kubeconfig()?;
    let d = |name: &str| plane.dir().join(name).display().to_string();
    // Both controllers talk to the API server as the admin, serve their own ports on the
    // namespace's loopback and run alone (no leader election).
    let component = |port: u16, extra: &[String]| -> Vec<String> {
        let mut args: Vec<String> = ["", "authentication-", "authorization-"]
            .iter()
            .map(|which| format!("--{which}kubeconfig={}", kubeconfig.display()))
            .collect();
        args.extend([
            "--leader-elect=false".to_owned(),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={port}"),
        ]);
        args.extend_from_slice(extra);
        args
    };
    let kcm_args = component(
        10257,
        &[
            format!("--service-account-private-key-file={}", d("sa.key")),
            format!("--root-ca-file={}", d("ca.crt")),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            "--use-service-account-credentials=false".to_owned(),
            // The Nodes carry their Pod CIDRs from creation (see the module docs).
            "--allocate-node-cidrs=false".to_owned(),
        ],
    );
    let mut controllers = vec![cluster::spawn_logged(
        &artifacts.cluster.kube_controller_manager,
        &kcm_args,
        &plane.dir().join("kube-controller-manager.log"),
    )?];
    controllers.push(cluster::spawn_logged(
        &artifacts.cluster.kube_scheduler,
        &component(10259, &[]),
        &plane.dir().join("kube-scheduler.log"),
    )?);

    // The Nodes, with their Pod CIDRs, before any kubelet registers.
    let mut objects = String::new();
    for node in &nodes {
        objects.push_str(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n  labels:\n    kubernetes.io/hostname: {}\n    topology.kubernetes.io/zone: {}\nspec:\n  podCIDR: {}\n  podCIDRs: [\"{}\"]\n---\n",
            node.name(),
            node.name(),
            node.zone(),
            node.pod_cidr(),
            node.pod_cidr()
        ));
    }
    let nodes_yaml = dir.join("nodes.yaml");
    fs::write(&nodes_yaml, objects)?;
    util::output(plane.kubectl()?.arg("apply").arg("-f").arg(&nodes_yaml))?;

    let stopped = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for node in &nodes {
        let log = dir.join(format!("{}.log", node.name()));
        let mut job = node_job(node, &nodes, &plane, artifacts, options, log)?;
        job.stop = Some(stopped.clone());
        handles.push((node.name(), Some(std::thread::spawn(move || vm::run(&job)))));
    }
    let mut cluster = Cluster {
        plane,
        controllers,
        nodes: handles,
        stopped,
        dir: dir.clone(),
    };
    cluster.wait_nodes_ready(&nodes, Duration::from_secs(900))?;
    eprintln!(
        "xtask: {} node(s) Ready in {}",
        nodes.len(),
        secs(started.elapsed())
    );
    cluster.deploy_proxy(options.proxy, nodes.len(), Duration::from_secs(600))?;
    eprintln!(
        "xtask: {} running on every node after {}",
        options.proxy.daemonset(),
        secs(started.elapsed())
    );
    cluster.deploy_coredns(Duration::from_secs(600))?;
    eprintln!("xtask: CoreDNS ready after {}", secs(started.elapsed()));
    Ok(cluster)
}

impl Cluster {
    /// Asks `jsonpath` of `kubectl get ARGS` every 2 s until `done` holds for its output (the
    /// kubelets and controllers post status; nothing pushes it to us), failing at once if a
    /// node stopped and after `timeout` with `what` and the last output.
    fn poll(
        &mut self,
        what: &str,
        args: &[&str],
        jsonpath: &str,
        timeout: Duration,
        done: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_nodes()?;
            let out = util::output(
                self.kubectl()?
                    .arg("get")
                    .args(args)
                    .arg(format!("-o=jsonpath={jsonpath}")),
            )?;
            if done(out.trim()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let pods = util::output(self.kubectl()?.args(["get", "pods", "-A", "-o", "wide"]))
                    .unwrap_or_default();
                bail!("{what} after {} (last: {out:?}):\n{pods}", secs(timeout));
            }
            std::thread::sleep(Duration::from_secs(2));
        }
    }

    /// Waits for every node's Ready condition.
    fn wait_nodes_ready(&mut self, nodes: &[Node], timeout: Duration) -> Result<()> {
        self.poll(
            "nodes not Ready",
            &["nodes"],
            "{range .items[*]}{.metadata.name}={.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}",
            timeout,
            |out| out.lines().filter(|l| l.ends_with("=True")).count() == nodes.len(),
        )
    }

    /// Applies the proxy (`kubectl apply -k` of the agent's lab overlay, or kube-proxy's
    /// manifest), then waits for its DaemonSet to be available on every node.
    fn deploy_proxy(&mut self, proxy: Proxy, nodes: usize, timeout: Duration) -> Result<()> {
        let root = util::workspace_root();
        let (how, path) = match proxy {
            Proxy::KubeIpvs => ("-k", root.join(KUBE_IPVS_OVERLAY)),
            Proxy::KubeProxy => ("-f", root.join(KUBE_PROXY_MANIFEST)),
        };
        util::output(self.kubectl()?.args(["apply", how]).arg(path))?;
        let daemonset = proxy.daemonset();
        self.poll(
            &format!("{daemonset} not available on {nodes} node(s)"),
            &["-n", "kube-system", "daemonset", daemonset],
            "{.status.numberAvailable}",
            timeout,
            |out| out.parse::<usize>().is_ok_and(|n| n == nodes),
        )
    }

    /// Applies the DNS and waits for its Deployment to be available: CoreDNS reads the API
    /// through the `kubernetes` Service, so this is also the first proof the proxy works.
    fn deploy_coredns(&mut self, timeout: Duration) -> Result<()> {
        let manifest = util::workspace_root().join(COREDNS_MANIFEST);
        util::output(self.kubectl()?.arg("apply").arg("-f").arg(&manifest))?;
        self.poll(
            "CoreDNS not available",
            &["-n", "kube-system", "deployment", "coredns"],
            "{.status.availableReplicas}",
            timeout,
            |out| out.parse::<u32>().is_ok_and(|n| n > 0),
        )
    }
}

/// Parses `--nodes N`, `--mem MIB` and `--proxy kube-ipvs|kube-proxy`, leaving the rest to the
/// caller.
fn parse_options<'a>(
    args: &'a [String],
    mut other: impl FnMut(&'a str, &mut std::slice::Iter<'a, String>) -> Result<()>,
) -> Result<Options> {
    let mut options = Options::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--nodes" => options.nodes = vm::parse_next(&mut it, "--nodes")?,
            "--mem" => options.memory_mib = vm::parse_next(&mut it, "--mem")?,
            "--proxy" => {
                options.proxy = Proxy::parse(it.next().context("--proxy needs a value")?)?;
            }
            a => other(a, &mut it)?,
        }
    }
    if !(1..=8).contains(&options.nodes) {
        bail!("--nodes must be 1 to 8");
    }
    Ok(options)
}

/// Outside the lab's namespace: builds everything, makes the namespace, runs `cargo xtask
/// <command> <args>` again inside it, and removes the namespace. Inside: `None`, go on.
fn enter(command: &str, args: &[String], options: &Options) -> Option<Result<()>> {
    if std::env::var_os(INSIDE_ENV).is_some() {
        return None;
    }
    let result = (|| {
        // Build outside: the namespace has no route to the package registries.
        artifacts(options.proxy)?;
        netns_up(&options.nodes())?;
        let mut inner = vec![command.to_owned()];
        inner.extend_from_slice(args);
        let result = netns::run_inside(NETNS, INSIDE_ENV, &inner);
        let _ = down();
        crate::reaper::forget_at_exit();
        result
    })();
    Some(result)
}

/// `cargo xtask cluster up [--proxy kube-ipvs|kube-proxy] [--nodes N] [--mem MIB] | down`.
pub(crate) fn command(args: &[String]) -> Result<()> {
    const USAGE: &str = "usage: cargo xtask cluster up [--proxy kube-ipvs|kube-proxy] [--nodes N] [--mem MIB] | down";
    let Some((verb, rest)) = args.split_first() else {
        bail!(USAGE);
    };
    match verb.as_str() {
        "down" => down(),
        "up" => {
            let options = parse_options(rest, |a, _| bail!("cluster up: unknown argument {a:?}"))?;
            if let Some(outer) = enter("cluster", args, &options) {
                return outer;
            }
            let mut cluster = start(&options, &artifacts(options.proxy)?)?;
            let kubeconfig = cluster.plane.host_kubeconfig()?;
            println!(
                "cluster: up. In another terminal:\n  ip netns exec {NETNS} {} --kubeconfig {} get pods -A -o wide\n\
                 Node consoles: {}/node-N.log. Ctrl-C stops the cluster.",
                cluster.plane.kubectl()?.get_program().to_string_lossy(),
                kubeconfig.display(),
                cluster.dir.display()
            );
            loop {
                cluster.check_nodes()?;
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        other => bail!("cluster: unknown verb {other:?}\n{USAGE}"),
    }
}

/// `cargo xtask conformance [--proxy kube-ipvs|kube-proxy] [--focus RE] [--skip RE] [--smoke]
/// [--timeout S] [--nodes N] [--mem MIB]`.
pub(crate) fn conformance_command(args: &[String]) -> Result<()> {
    let mut focus = None;
    let mut skip = None;
    let mut smoke = false;
    let mut timeout_secs = crate::conformance::DEFAULT_TIMEOUT_SECS;
    let mut shard: Option<crate::conformance::Shard> = None;
    let options = parse_options(args, |a, it| {
        match a {
            "--timeout" => timeout_secs = vm::parse_next(it, "--timeout")?,
            "--shard" => shard = Some(it.next().context("--shard needs I/N")?.parse()?),
            "--focus" => focus = Some(it.next().context("--focus needs a value")?.clone()),
            "--skip" => skip = Some(it.next().context("--skip needs a value")?.clone()),
            "--smoke" => smoke = true,
            other => bail!("conformance: unknown argument {other:?}"),
        }
        Ok(())
    })?;
    let focus = match (focus, smoke) {
        (Some(_), true) => bail!("conformance: --smoke is a focus of its own; give one"),
        (Some(f), false) => f,
        (None, true) => crate::conformance::focus_of(crate::conformance::SMOKE),
        (None, false) => crate::conformance::DEFAULT_FOCUS.to_owned(),
    };
    if timeout_secs == 0 {
        bail!("conformance: --timeout must be at least 1 second");
    }
    if let Some(outer) = enter("conformance", args, &options) {
        return outer;
    }
    let started = Instant::now();
    let artifacts = artifacts(options.proxy)?;
    let mut run = crate::conformance::Run {
        focus,
        skip,
        timeout_secs,
    };
    if let Some(shard) = shard {
        // The shard's tests by their whole names: `$` so that a name that begins another
        // (the Conntrack ClusterIP tests) selects only itself.
        let all = crate::conformance::selected(&artifacts.cluster.e2e_test, &run)?;
        let mine = crate::conformance::shard_of(&all, shard);
        if mine.is_empty() {
            bail!(
                "conformance: shard {}/{} of the {} tests the focus selects is empty",
                shard.index,
                shard.count,
                all.len()
            );
        }
        eprintln!(
            "xtask: shard {}/{}: {} of the {} tests the focus selects",
            shard.index,
            shard.count,
            mine.len(),
            all.len()
        );
        run.focus = format!("{}$", crate::conformance::focus_of(&mine));
    }
    let cluster = start(&options, &artifacts)?;
    let report = crate::conformance::report_dir()?;
    let cases = crate::conformance::run_suite(
        &artifacts.cluster.e2e_test,
        &artifacts.tools.kubectl,
        &cluster.plane.host_kubeconfig()?,
        &run,
        &report,
    )?;
    drop(cluster);
    let summary = crate::conformance::summary(&cases);
    println!("{}", crate::conformance::table(&cases));
    println!(
        "conformance: {summary} in {} (report: {})",
        secs(started.elapsed()),
        report.display()
    );
    if cases.is_empty() {
        bail!("conformance: the focus selected no test");
    }
    if cases
        .iter()
        .any(|c| matches!(c.outcome, crate::conformance::Outcome::Failed(_)))
    {
        bail!("conformance: {summary}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_get_distinct_addresses_taps_and_pod_cidrs() {
        let nodes = Options {
            nodes: 3,
            ..Options::default()
        }
        .nodes();
        let mut seen = std::collections::BTreeSet::new();
        for n in &nodes {
            for v in [n.name(), n.address(), n.tap(), n.mac(), n.pod_cidr()] {
                assert!(seen.insert(v.clone()), "{v} repeats");
            }
            // A tap name must fit IFNAMSIZ.
            assert!(n.tap().len() < 16);
        }
        assert_eq!(nodes[0].address(), "10.88.0.11");
        assert_eq!(nodes[1].pod_cidr(), "10.244.2.0/24");
    }

    #[test]
    fn three_nodes_make_three_zones_and_six_make_two_nodes_in_each() {
        let zones = |n| {
            let mut count = std::collections::BTreeMap::new();
            for node in (Options {
                nodes: n,
                ..Options::default()
            })
            .nodes()
            {
                *count.entry(node.zone()).or_insert(0) += 1;
            }
            count.into_values().collect::<Vec<_>>()
        };
        assert_eq!(zones(2), [1, 1]);
        assert_eq!(zones(3), [1, 1, 1]);
        assert_eq!(zones(6), [2, 2, 2]);
        assert_eq!(zones(8), [3, 3, 2]);
    }

    #[test]
    fn the_dns_manifest_runs_the_pinned_coredns_at_the_kubelets_cluster_dns() -> Result<()> {
        let manifest = fs::read_to_string(util::workspace_root().join(COREDNS_MANIFEST))?;
        let image = testimages::coredns_ref()?.to_string();
        assert!(manifest.contains(&format!("image: {image}\n")), "{image}");
        assert!(manifest.contains(&format!("clusterIP: {DNS_IP}\n")));
        assert!(kubelet_config().contains(&format!("- {DNS_IP}\n")));
        Ok(())
    }

    #[test]
    fn the_kube_proxy_manifest_runs_the_pinned_release_in_ipvs_mode() -> Result<()> {
        let manifest = fs::read_to_string(util::workspace_root().join(KUBE_PROXY_MANIFEST))?;
        let go_mod = fs::read_to_string(util::workspace_root().join("integration/tools/go.mod"))?;
        let version = go_mod
            .lines()
            .find_map(|l| l.trim().strip_prefix("k8s.io/kubernetes "))
            .and_then(|r| r.split_whitespace().next())
            .context("no k8s.io/kubernetes pin")?;
        assert!(manifest.contains(&format!("image: registry.k8s.io/kube-proxy:{version}\n")));
        assert!(manifest.contains("mode: ipvs\n"));
        assert!(manifest.contains(&format!("server: https://{GATEWAY}:{API_PORT}\n")));
        Ok(())
    }

    #[test]
    fn each_node_routes_to_every_other_nodes_pods_but_not_its_own() {
        let nodes = Options::default().nodes();
        let script = node_script(&nodes[0], &nodes, &["registry.k8s.io/pause:3.10.2".into()]);
        assert!(script.contains("route add 10.244.2.0/24 via 10.88.0.12"));
        assert!(!script.contains("route add 10.244.1.0/24"));
        assert!(script.contains("--node-ip=10.88.0.11"));
        // The node loads what the kernel stage put in the guest for it, no more, no less.
        let modprobe = script.lines().find_map(|l| l.strip_prefix("modprobe -a "));
        assert_eq!(
            modprobe,
            Some(crate::kernel::NODE_MODULES.join(" ").as_str())
        );
    }
}
