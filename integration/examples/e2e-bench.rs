//! `e2e-bench`: the driver behind `cargo xtask bench e2e` (kube-ipvs against kube-proxy
//! `--proxy-mode=ipvs` on a real kernel and a real API server).
//!
//! Two modes, one program so the object names and endpoint addresses are defined once:
//!
//! * `populate` runs on the host (native speed) and fills the API server with N Services of 10
//!   ready endpoints each (one EndpointSlice per Service) plus the Node `node-1`, creating only
//!   what is missing so ascending sizes build on each other. It writes `NAME CLUSTER-IP` lines
//!   for the guest.
//! * `guest` runs in the VM: it starts the agent as its child, measures how long until the
//!   kernel's IPVS table holds every Service with all its real servers, then (optionally) the
//!   latency from an EndpointSlice update to the kernel, and finally the agent's CPU time and
//!   peak RSS. It prints one `E2E-RESULT key=value ...` line that xtask parses.
//!
//! The IPVS agents (kube-ipvs, kube-proxy's IPVS mode) are read through `kube-ipvs-netlink`, so
//! both are judged by the same reader; kube-proxy's nftables and iptables modes keep Services in
//! rules and are read with `nft` and `iptables` (`kube_ipvs_integration::rules`).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube_ipvs_integration::rules;
#[path = "e2e-bench/datapath.rs"]
mod datapath;
use kube_ipvs_netlink::ipvs::{Ipvs, ServiceKey};

const NAMESPACE: &str = "bench";
const NODE: &str = "node-1";
/// The guest's address (xtask/src/vm.rs), given to the Node so kube-proxy finds its node IP
/// at once instead of waiting 30 s for one and falling back to loopback.
const NODE_IP: &str = "10.0.2.15";
const SERVICE_PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
/// Endpoint addresses cycle through 10.244.0.1 - 10.244.249.250; updates use 10.244.250.0/23 and
/// up, so an updated address never equals one the table already holds.
const ENDPOINT_CYCLE: usize = 250 * 250;
/// Linux reports /proc/PID/stat times in USER_HZ, which is 100 on every architecture we run.
const USER_HZ: f64 = 100.0;
/// Pause between polls of the kernel table while converging, so the poller does not starve the
/// agent of the guest's two vCPUs.
const CONVERGE_POLL: Duration = Duration::from_millis(100);
/// How often convergence progress is printed, so a slow agent is visibly alive.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);
/// After convergence, the agent counts as settled once it used less than this much CPU over
/// [`SETTLE_WINDOW`]; updates start then, so they time a steady-state agent, not the tail of
/// its first sync.
const SETTLE_CPU: f64 = 0.1;
const SETTLE_WINDOW: Duration = Duration::from_secs(2);
/// Pause between GET_DEST polls of one service after an update.
/// `GLIBC_TUNABLES` as `deploy/daemonset.yaml` sets it for the agent (a test keeps them equal).
const KUBE_IPVS_GLIBC_TUNABLES: &str =
    "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=131072";
const UPDATE_POLL: Duration = Duration::from_millis(2);
/// An update the kernel has not shown after this long counts as a timeout and ends the series.
const UPDATE_TIMEOUT: Duration = Duration::from_secs(180);

fn usage() -> &'static str {
    "usage: e2e-bench populate --kubeconfig PATH --services N [--endpoints E] [--nodes N] [--concurrency C] --out PATH\n       \
     e2e-bench guest --agent kube-ipvs|kube-ipvs-routes|kube-proxy-ipvs|kube-proxy-nftables|kube-proxy-iptables --services-file PATH --kubeconfig PATH \
     [--endpoints E] [--nodes N] [--updates U] [--update-budget SECS] [--converge-timeout SECS] \
     [--flush-repair] [--soak-seconds S [--churn-rate R] [--sample-seconds S]] [--datapath N] \
     [--churn-seconds S [--churn-rate R]] [--no-ipvs-rate-estimation] [--agent-env NAME=VALUE]...\n       \
     e2e-bench serve --port P                      (the data path's server, run by guest)\n       \
     e2e-bench connect --targets IP:P,... --count N (the data path's client, run by guest)\n       \
     e2e-bench ipvs-probe --count N                 (N real server adds and deletes, each timed)"
}

/// `ipvs-probe`: adds a real server to the first TCP/UDP/SCTP virtual server of the table and
/// deletes it again, `count` requests in all, each timed from the request's send to the
/// kernel's acknowledgement; prints their distribution (one `PROBE` line). What an agent's
/// one-operation change costs in the kernel at the table's size, without a process start.
fn ipvs_probe(count: usize) -> Result<()> {
    use kube_ipvs_netlink::ipvs::{Destination, ForwardMethod};
    let mut ipvs = Ipvs::new().context("opening the IPVS netlink socket")?;
    let key = ipvs
        .services()?
        .into_iter()
        .map(|s| s.key)
        .find(|k| !matches!(k, ServiceKey::Fwmark { .. }))
        .context("ipvs-probe: the table has no address virtual server")?;
    let addr = IpAddr::V4(Ipv4Addr::new(10, 246, 0, 1));
    let dest = Destination::new(addr, 8080, ForwardMethod::Masq);
    let mut took = Vec::with_capacity(count);
    for i in 0..count {
        let t = Instant::now();
        if i % 2 == 0 {
            ipvs.new_dest(&key, &dest)
        } else {
            ipvs.del_dest(&key, addr, 8080)
        }
        .with_context(|| {
            // Best effort, so the next run does not find the real server already there.
            let _ = ipvs.del_dest(&key, addr, 8080);
            format!("ipvs-probe: request {i}")
        })?;
        took.push(t.elapsed().as_micros() as u64);
    }
    if count % 2 == 1 {
        ipvs.del_dest(&key, addr, 8080)?;
    }
    took.sort_unstable();
    let at = |q: f64| {
        took.get(((took.len() as f64 * q) as usize).min(took.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "PROBE count={count} p50_us={} p99_us={} p999_us={} max_us={} over_10ms={}",
        at(0.5),
        at(0.99),
        at(0.999),
        took.last().copied().unwrap_or(0),
        took.iter().filter(|t| **t > 10_000).count()
    );
    Ok(())
}

/// `serve` and `connect`: the data path's two ends, each run by `guest` in its namespace; and
/// `ipvs-probe`, the other mode run by a guest script with one flag.
fn datapath_mode(mode: &str, args: &[String]) -> Result<()> {
    let value = |flag: &str| -> Result<&str> {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
            .with_context(|| format!("{mode} needs {flag}\n{}", usage()))
    };
    match mode {
        "serve" => datapath::serve(value("--port")?.parse().context("--port")?),
        "ipvs-probe" => ipvs_probe(value("--count")?.parse().context("--count")?),
        _ => {
            let targets = value("--targets")?
                .split(',')
                .map(|t| t.parse().with_context(|| format!("--targets: {t:?}")))
                .collect::<Result<Vec<std::net::SocketAddrV4>>>()?;
            datapath::connect(&targets, value("--count")?.parse().context("--count")?)
        }
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((mode, rest)) = args.split_first() else {
        bail!("{}", usage());
    };
    if matches!(mode.as_str(), "serve" | "connect" | "ipvs-probe") {
        return datapath_mode(mode, rest);
    }
    let opts = Options::parse(rest)?;
    match mode.as_str() {
        "populate" => populate(&opts),
        "guest" => {
            raise_open_files_limit();
            guest(&opts)
        }
        other => bail!("unknown mode {other:?}\n{}", usage()),
    }
}

/// Open files the guest mode asks for: the open-loop churn keeps one connection per PATCH in
/// flight (HTTP/1.1), and against an agent that starves the guest's CPUs thousands are in
/// flight at once (50/s for 60 s is 3,000). Under the guest's default of 1,024 the driver's
/// `nft` then failed with EMFILE and the run with it (kube-proxy's nftables mode, 2026-12-07).
const OPEN_FILES: u64 = 65_536;

/// Raises this process's open-file limit to [`OPEN_FILES`] (the hard limit too: the driver
/// runs as root), or as far as it may, and says so when it cannot. The agents it starts
/// inherit it, every agent alike (kube-ipvs keeps a few dozen files open; kube-proxy, in Go,
/// raises its own soft limit to the hard one at startup anyway).
fn raise_open_files_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    if now.current.is_none_or(|c| c >= OPEN_FILES) {
        return;
    }
    let want = Rlimit {
        current: Some(OPEN_FILES),
        // `None` is no limit, which stays.
        maximum: now.maximum.map(|m| m.max(OPEN_FILES)),
    };
    if let Err(e) = setrlimit(Resource::Nofile, want) {
        let fallback = Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        };
        let kept = setrlimit(Resource::Nofile, fallback).map_or(now.current, |()| now.maximum);
        eprintln!(
            "e2e-bench: open files limited to {kept:?} (asked for {OPEN_FILES}: {e}); a churn with more PATCHes in flight fails"
        );
    }
}

/// Command-line options of both modes (each mode checks the ones it needs).
#[derive(Debug)]
struct Options {
    kubeconfig: Option<PathBuf>,
    services: usize,
    endpoints: usize,
    /// Nodes the endpoints are spread over (`node-1`, the agent's, is one of them; 1: every
    /// endpoint is local).
    nodes: usize,
    concurrency: usize,
    out: Option<PathBuf>,
    agent: Option<String>,
    services_file: Option<PathBuf>,
    updates: usize,
    update_budget: Duration,
    converge_timeout: Duration,
    settle_timeout: Duration,
    /// `ipvsadm -C` behind the agent's back after it converged, timing the repair.
    flush_repair: bool,
    /// Soak: how long to churn endpoints after converging (zero: no soak).
    soak: Duration,
    /// Soak: endpoint updates per second.
    churn_rate: f64,
    /// Soak: how often the agent's resources are sampled.
    sample_every: Duration,
    /// Data path: connections per measured Service after converging (0: not measured).
    datapath: usize,
    /// Open-loop churn at `--churn-rate` for this long after the update series (zero: none).
    churn: Duration,
    /// `--no-ipvs-rate-estimation`: `net.ipv4.vs.run_estimation` set to 0 before the agent starts.
    no_estimation: bool,
    /// `--agent-env NAME=VALUE`: set in the agent's environment.
    agent_env: Vec<(String, String)>,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options> {
        let mut o = Options {
            kubeconfig: None,
            services: 0,
            endpoints: 10,
            nodes: 1,
            concurrency: 32,
            out: None,
            agent: None,
            services_file: None,
            updates: 0,
            update_budget: Duration::from_secs(300),
            converge_timeout: Duration::from_secs(1800),
            settle_timeout: Duration::from_secs(600),
            flush_repair: false,
            soak: Duration::ZERO,
            churn_rate: 5.0,
            sample_every: Duration::from_secs(60),
            datapath: 0,
            churn: Duration::ZERO,
            no_estimation: false,
            agent_env: Vec::new(),
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut value = || {
                it.next()
                    .with_context(|| format!("{flag} needs a value\n{}", usage()))
            };
            let number = |v: &String| -> Result<usize> {
                v.parse()
                    .with_context(|| format!("{flag} {v:?}: not a whole number"))
            };
            match flag.as_str() {
                "--kubeconfig" => o.kubeconfig = Some(PathBuf::from(value()?)),
                "--services" => o.services = number(value()?)?,
                "--endpoints" => o.endpoints = number(value()?)?,
                "--nodes" => o.nodes = number(value()?)?,
                "--concurrency" => o.concurrency = number(value()?)?.max(1),
                "--out" => o.out = Some(PathBuf::from(value()?)),
                "--agent" => o.agent = Some(value()?.clone()),
                "--services-file" => o.services_file = Some(PathBuf::from(value()?)),
                "--updates" => o.updates = number(value()?)?,
                "--update-budget" => {
                    o.update_budget = Duration::from_secs(number(value()?)? as u64);
                }
                "--settle-timeout" => {
                    o.settle_timeout = Duration::from_secs(number(value()?)? as u64);
                }
                "--converge-timeout" => {
                    o.converge_timeout = Duration::from_secs(number(value()?)? as u64);
                }
                "--flush-repair" => o.flush_repair = true,
                "--no-ipvs-rate-estimation" => o.no_estimation = true,
                "--agent-env" => o.agent_env.push(env_setting(value()?)?),
                "--datapath" => o.datapath = number(value()?)?,
                "--churn-seconds" => o.churn = Duration::from_secs(number(value()?)? as u64),
                "--soak-seconds" => o.soak = Duration::from_secs(number(value()?)? as u64),
                "--sample-seconds" => {
                    o.sample_every = Duration::from_secs(number(value()?)?.max(1) as u64);
                }
                "--churn-rate" => {
                    let v = value()?;
                    o.churn_rate = v
                        .parse::<f64>()
                        .ok()
                        .filter(|r| r.is_finite() && *r > 0.0 && *r <= 1000.0)
                        .with_context(|| {
                            format!("--churn-rate {v:?}: updates per second, 0 < R <= 1000")
                        })?;
                }
                other => bail!("unknown option {other:?}\n{}", usage()),
            }
        }
        if o.endpoints == 0 || o.endpoints > 1000 {
            bail!("--endpoints {}: must be 1..=1000", o.endpoints);
        }
        if o.nodes == 0 || o.nodes > 5000 {
            bail!("--nodes {}: must be 1..=5000", o.nodes);
        }
        Ok(o)
    }

    fn kubeconfig(&self) -> Result<&Path> {
        self.kubeconfig
            .as_deref()
            .with_context(|| format!("--kubeconfig is required\n{}", usage()))
    }
}

/// `NAME=VALUE` for the agent's environment (`cargo xtask bench e2e` checks the name first).
fn env_setting(v: &str) -> Result<(String, String)> {
    let (name, value) = v
        .split_once('=')
        .with_context(|| format!("--agent-env {v:?}: NAME=VALUE"))?;
    Ok((name.to_owned(), value.to_owned()))
}

fn service_name(i: usize) -> String {
    format!("svc-{i:05}")
}

fn slice_name(i: usize) -> String {
    format!("{}-1", service_name(i))
}

/// The Service index of a slice named by [`slice_name`].
fn slice_index(name: &str) -> Option<usize> {
    let i: usize = name
        .strip_prefix("svc-")?
        .strip_suffix("-1")?
        .parse()
        .ok()?;
    (slice_name(i) == name).then_some(i)
}

/// Endpoint `j` of Service `i`: a pod address in 10.244.0.0/16 (repeating across Services once
/// 62,500 are used, which is fine: real servers are per virtual server).
fn endpoint_addr(i: usize, j: usize, per_service: usize) -> Ipv4Addr {
    let k = (i * per_service + j) % ENDPOINT_CYCLE;
    Ipv4Addr::new(10, 244, (k / 250) as u8, (k % 250 + 1) as u8)
}

/// The address update `u` gives a Service that holds `held`: [`update_addr`]`(u)`, or the next
/// one it does not hold. update_addr repeats every 1,250 updates and the stride comes back to a
/// Service after N, so at N = 10,000 the plain `update_addr(u)` would put back the address the
/// Service already has: a PATCH that changes nothing (the first soak churned for 33 minutes,
/// then only PATCHed).
fn fresh_update_addr(u: usize, held: &[Ipv4Addr]) -> Ipv4Addr {
    (u..)
        .map(update_addr)
        .find(|a| !held.contains(a))
        .unwrap_or_else(|| update_addr(u))
}

/// The new address of update `u`, outside the range [`endpoint_addr`] uses.
fn update_addr(u: usize) -> Ipv4Addr {
    let k = u % (5 * 250);
    Ipv4Addr::new(10, 244, 250 + (k / 250) as u8, (k % 250 + 1) as u8)
}

fn service_json(i: usize) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(i), "namespace": NAMESPACE},
        "spec": {"ports": [{"name": "http", "port": SERVICE_PORT, "protocol": "TCP",
                            "targetPort": TARGET_PORT}]},
    })
}

/// Node `k` (1-based) of the spread; `node-1` is the agent's.
fn node_name(k: usize) -> String {
    format!("node-{k}")
}

/// The Node of the endpoint at `addr` when endpoints are spread over `nodes` Nodes: consecutive
/// addresses go round the Nodes, so a Service's endpoints are on different Nodes and about
/// 1/`nodes` of all endpoints are on the agent's.
fn node_of(addr: Ipv4Addr, nodes: usize) -> String {
    node_name(1 + u32::from(addr) as usize % nodes.max(1))
}

/// The endpoints at `addrs`, each as the EndpointSlice controller writes a ready Pod's: its
/// three conditions, its Node and a `targetRef` to the Pod (named as a Deployment's Pods are).
fn endpoints_json(addrs: &[Ipv4Addr], nodes: usize) -> serde_json::Value {
    let list: Vec<serde_json::Value> = addrs
        .iter()
        .map(|a| {
            let n = u32::from(*a);
            serde_json::json!({
                "addresses": [a.to_string()],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": node_of(*a, nodes),
                "targetRef": {
                    "kind": "Pod",
                    "namespace": NAMESPACE,
                    "name": format!("backend-7d4b9c8f6-{n:08x}"),
                    "uid": format!("{n:08x}-5f3c-4b7a-9c1f-0e6a{n:08x}"),
                },
            })
        })
        .collect();
    serde_json::Value::Array(list)
}

fn slice_json(i: usize, addrs: &[Ipv4Addr], nodes: usize) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": slice_name(i),
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": service_name(i)},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}],
        "endpoints": endpoints_json(addrs, nodes),
    })
}

fn initial_addrs(i: usize, per_service: usize) -> Vec<Ipv4Addr> {
    (0..per_service)
        .map(|j| endpoint_addr(i, j, per_service))
        .collect()
}

async fn client(kubeconfig: &Path) -> Result<kube::Client> {
    let config = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading kubeconfig {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(config, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("kubeconfig {}", kubeconfig.display()))?;
    // The TLS cipher order a Go client (the EndpointSlice controller's) would pick here.
    kube_ipvs_watch::tls::install_default_provider();
    kube::Client::try_from(config).context("building the kube client")
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

/// Creates `obj` unless it exists already (populate resumes and builds on earlier sizes);
/// errors name `what`.
async fn create_if_missing<K>(api: &Api<K>, obj: &K, what: &str) -> Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(e) if already_exists(&e) => Ok(()),
        Err(e) => Err(e).context(format!("creating {what}")),
    }
}

/// Whether a create failed only because the object is there already (a resumed populate).
fn already_exists(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 409)
}

fn populate(opts: &Options) -> Result<()> {
    let out = opts
        .out
        .as_deref()
        .with_context(|| format!("--out is required\n{}", usage()))?;
    let kubeconfig = opts.kubeconfig()?;
    let started = Instant::now();
    let lines = runtime()?.block_on(async {
        let client = client(kubeconfig).await?;
        // The agent's Node has the guest's address; the others one of their own.
        for k in 1..=opts.nodes {
            let name = node_name(k);
            let node: Node = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            }))?;
            create_if_missing(&Api::<Node>::all(client.clone()), &node, &format!("Node {name}"))
                .await?;
            let address = if name == NODE {
                NODE_IP.to_owned()
            } else {
                format!("10.0.{}.{}", 3 + k / 250, k % 250 + 1)
            };
            let status = serde_json::json!({
                "status": {"addresses": [{"type": "InternalIP", "address": address}]},
            });
            Api::<Node>::all(client.clone())
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .with_context(|| format!("setting the addresses of Node {name}"))?;
        }
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE},
        }))?;
        create_if_missing(
            &Api::<Namespace>::all(client.clone()),
            &ns,
            &format!("Namespace {NAMESPACE}"),
        )
        .await?;
        let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
        let existing: HashSet<String> = services
            .list_metadata(&ListParams::default())
            .await
            .context("listing Services in namespace bench")?
            .items
            .into_iter()
            .filter_map(|m| m.metadata.name)
            .collect();
        let missing: Vec<usize> = (0..opts.services)
            .filter(|i| !existing.contains(&service_name(*i)))
            .collect();
        let created = missing.len();
        futures::stream::iter(missing)
            .map(|i| {
                let services = services.clone();
                let slices = slices.clone();
                let per = opts.endpoints;
                let nodes = opts.nodes;
                async move {
                    let svc: Service = serde_json::from_value(service_json(i))?;
                    create_if_missing(
                        &services,
                        &svc,
                        &format!("Service {NAMESPACE}/{}", service_name(i)),
                    )
                    .await?;
                    let slice: EndpointSlice =
                        serde_json::from_value(slice_json(i, &initial_addrs(i, per), nodes))?;
                    create_if_missing(
                        &slices,
                        &slice,
                        &format!("EndpointSlice {NAMESPACE}/{}", slice_name(i)),
                    )
                    .await
                }
            })
            .buffer_unordered(opts.concurrency)
            .try_collect::<Vec<()>>()
            .await?;
        // Every slice back to its initial endpoints: an earlier agent's updates changed some,
        // and the next agent is timed until it holds exactly the initial ones.
        let mut stale = Vec::new();
        for slice in slices
            .list(&ListParams::default())
            .await
            .context("listing EndpointSlices in namespace bench")?
            .items
        {
            let Some(i) = slice
                .metadata
                .name
                .as_deref()
                .and_then(slice_index)
                .filter(|i| *i < opts.services)
            else {
                continue;
            };
            let wanted: Vec<Endpoint> = serde_json::from_value(endpoints_json(
                &initial_addrs(i, opts.endpoints),
                opts.nodes,
            ))?;
            if slice.endpoints != wanted {
                stale.push(i);
            }
        }
        let reset = stale.len();
        futures::stream::iter(stale)
            .map(|i| {
                let slices = slices.clone();
                let patch = serde_json::json!({
                    "endpoints": endpoints_json(&initial_addrs(i, opts.endpoints), opts.nodes),
                });
                async move {
                    slices
                        .patch(&slice_name(i), &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .with_context(|| {
                            format!("resetting EndpointSlice {NAMESPACE}/{}", slice_name(i))
                        })
                        .map(|_| ())
                }
            })
            .buffer_unordered(opts.concurrency)
            .try_collect::<Vec<()>>()
            .await?;
        let listed = services
            .list(&ListParams::default())
            .await
            .context("listing Services in namespace bench")?;
        let ips: HashMap<String, String> = listed
            .items
            .into_iter()
            .filter_map(|s| Some((s.metadata.name?, s.spec?.cluster_ip?)))
            .collect();
        let mut lines = String::new();
        for i in 0..opts.services {
            let name = service_name(i);
            let ip = ips
                .get(&name)
                .with_context(|| format!("Service {NAMESPACE}/{name} has no ClusterIP"))?;
            let _ = writeln!(lines, "{name} {ip}");
        }
        eprintln!(
            "e2e-bench: populate: {} Services in {NAMESPACE} ({created} created, {reset} EndpointSlices reset) in {:.1} s",
            opts.services,
            started.elapsed().as_secs_f64()
        );
        anyhow::Ok(lines)
    })?;
    std::fs::write(out, lines).with_context(|| format!("writing {}", out.display()))
}

/// The Services the guest waits for, from `populate --out`: index order, ClusterIP parsed.
fn read_services(path: &Path) -> Result<Vec<Ipv4Addr>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let (name, ip) = line
            .split_once(' ')
            .with_context(|| format!("{} line {}: {line:?}", path.display(), n + 1))?;
        if name != service_name(n) {
            bail!(
                "{} line {}: expected {}, found {name}",
                path.display(),
                n + 1,
                service_name(n)
            );
        }
        let ip: Ipv4Addr = ip
            .parse()
            .with_context(|| format!("Service {NAMESPACE}/{name}: ClusterIP {ip:?}"))?;
        out.push(ip);
    }
    Ok(out)
}

fn key(ip: Ipv4Addr) -> ServiceKey {
    ServiceKey::tcp(IpAddr::V4(ip), SERVICE_PORT)
}

/// Whether the kernel holds exactly `want` (address set, port TARGET_PORT) behind `key`.
fn holds(ipvs: &mut Ipvs, key: &ServiceKey, want: &[Ipv4Addr]) -> Result<bool> {
    let dests = ipvs.destinations(key)?;
    if dests.len() != want.len() {
        return Ok(false);
    }
    let got: HashSet<(IpAddr, u16)> = dests.iter().map(|d| (d.addr, d.port)).collect();
    Ok(want
        .iter()
        .all(|a| got.contains(&(IpAddr::V4(*a), TARGET_PORT))))
}

/// Whether new connections to `key` can reach only `want`: every address in `want` is a real
/// server with a weight, and any other real server has weight 0. Both agents keep a removed
/// endpoint at weight 0 while its connections drain (kube-proxy deletes it up to a minute
/// later), so an exact match would time the drain instead of the update.
fn serves(ipvs: &mut Ipvs, key: &ServiceKey, want: &[Ipv4Addr]) -> Result<bool> {
    let dests = ipvs.destinations(key)?;
    let wanted: HashSet<IpAddr> = want.iter().map(|a| IpAddr::V4(*a)).collect();
    let mut live = 0;
    for d in &dests {
        if wanted.contains(&d.addr) && d.port == TARGET_PORT {
            if d.weight == 0 {
                return Ok(false);
            }
            live += 1;
        } else if d.weight != 0 {
            return Ok(false);
        }
    }
    Ok(live == wanted.len())
}

/// Where the agent under test keeps its Services, and the driver's reader for it.
enum Dataplane {
    /// kube-ipvs and kube-proxy's IPVS mode: the IPVS table through netlink.
    Ipvs(Ipvs),
    /// kube-proxy's nftables and iptables modes: their rules through `nft` / `iptables`.
    Rules(rules::Reader),
}

impl Dataplane {
    /// The reader for `agent` (a name [`Agent::start`] accepts); `ipvs` is the socket already
    /// opened to check the table is empty.
    fn for_agent(agent: &str, ipvs: Ipvs) -> Result<Dataplane> {
        Ok(match agent {
            "kube-ipvs" | "kube-ipvs-routes" | "kube-proxy" | "kube-proxy-ipvs" => {
                Dataplane::Ipvs(ipvs)
            }
            "kube-proxy-nftables" => Dataplane::Rules(rules::Reader::new(rules::Mode::Nftables)),
            "kube-proxy-iptables" => Dataplane::Rules(rules::Reader::new(rules::Mode::Iptables)),
            other => bail!("unknown agent {other:?}"),
        })
    }

    /// The IPVS table, for what only makes sense there (the flush repair, the soak).
    fn ipvs(&mut self, what: &str) -> Result<&mut Ipvs> {
        match self {
            Dataplane::Ipvs(ipvs) => Ok(ipvs),
            Dataplane::Rules(_) => bail!("{what} needs an IPVS agent"),
        }
    }

    /// Whether new connections to the Service at `ip` reach only `want` (see [`serves`]).
    fn serves(&mut self, ip: Ipv4Addr, want: &[Ipv4Addr]) -> Result<bool> {
        match self {
            Dataplane::Ipvs(ipvs) => serves(ipvs, &key(ip), want),
            Dataplane::Rules(reader) => {
                let got = reader
                    .service(std::net::SocketAddrV4::new(ip, SERVICE_PORT))
                    .with_context(|| format!("reading the rules of {ip}:{SERVICE_PORT}"))?;
                Ok(got == Some(backends(want)))
            }
        }
    }
}

/// `want` at the target port, as the rules reader gives endpoints.
fn backends(want: &[Ipv4Addr]) -> rules::Backends {
    want.iter()
        .map(|a| std::net::SocketAddrV4::new(*a, TARGET_PORT))
        .collect()
}

/// The running agent: its process, and where its output goes.
struct Agent {
    child: Child,
    log: PathBuf,
    name: String,
}

impl Agent {
    fn start(name: &str, env: &[(String, String)]) -> Result<Agent> {
        let mut cmd = match name {
            "kube-ipvs" | "kube-ipvs-routes" => {
                let mut c = Command::new("/usr/local/bin/kube-ipvs");
                c.args([
                    "run",
                    "--kubeconfig",
                    "/etc/kube-ipvs-test/agent-direct.kubeconfig",
                    "--hostname-override",
                    NODE,
                    "--cluster-cidr",
                    "10.244.0.0/16",
                ]);
                if name == "kube-ipvs-routes" {
                    c.arg("--service-address-binding=route");
                }
                // The malloc settings the DaemonSet gives it, so this is the agent as shipped.
                c.env("GLIBC_TUNABLES", KUBE_IPVS_GLIBC_TUNABLES);
                c
            }
            "kube-proxy" | "kube-proxy-ipvs" | "kube-proxy-nftables" | "kube-proxy-iptables" => {
                let mode = name.strip_prefix("kube-proxy-").unwrap_or("ipvs");
                let mut c = Command::new("/usr/local/bin/kube-proxy");
                c.arg(format!("--proxy-mode={mode}"));
                c.args([
                    "--kubeconfig",
                    "/etc/kube-ipvs-test/admin-direct.kubeconfig",
                    "--hostname-override",
                    NODE,
                    "--cluster-cidr",
                    "10.244.0.0/16",
                ]);
                c
            }
            other => bail!(
                "unknown agent {other:?}: kube-ipvs, kube-ipvs-routes, kube-proxy-ipvs, kube-proxy-nftables or kube-proxy-iptables"
            ),
        };
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let log = PathBuf::from(format!("/tmp/{name}.log"));
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = file.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Agent {
            child,
            log,
            name: name.to_owned(),
        })
    }

    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// How long the agent's log is now, for [`Agent::since`].
    fn log_len(&self) -> u64 {
        std::fs::metadata(&self.log).map_or(0, |m| m.len())
    }

    /// The agent's log from `at` (a [`Agent::log_len`]) on, the first 80 lines: what it did
    /// while the driver measured the data path and timed the one-at-a-time updates.
    fn since(&self, at: u64) -> String {
        let text = std::fs::read(&self.log).unwrap_or_default();
        let from = usize::try_from(at).map_or(text.len(), |a| a.min(text.len()));
        String::from_utf8_lossy(&text[from..])
            .lines()
            .take(80)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The agent's log lines about its periodic reconciles (kube-ipvs logs where each one's
    /// time went), the last 20.
    fn reconciles(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("reconcile")).collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// kube-ipvs's incremental syncs that took over [`SLOW_SYNC_MS`], the last 40, each with the
    /// two lines before it (at debug level, its diff's and its apply's time): under churn, which
    /// slow updates the agent's loop made and which it did not.
    fn slow_syncs(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let slow: Vec<String> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| sync_ms(l).is_some_and(|ms| ms > SLOW_SYNC_MS))
            .map(|(i, _)| lines[i.saturating_sub(2)..=i].join("\n"))
            .collect();
        slow[slow.len().saturating_sub(40)..].join("\n")
    }

    /// The first lines of the agent's log: where its startup's time went (kube-ipvs logs the
    /// list, the startup sync and its apply with timestamps).
    fn head(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines().take(25).collect::<Vec<_>>().join("\n")
    }

    /// Fails, with the end of the agent's log, if it has exited.
    fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("{} exited ({status}):\n{}", self.name, self.tail());
        }
        Ok(())
    }

    /// CPU seconds (user + system of the agent and its reaped children) and peak RSS in KiB.
    fn usage(&self) -> Result<(f64, u64)> {
        let pid = self.child.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .with_context(|| format!("reading /proc/{pid}/stat of {}", self.name))?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .with_context(|| format!("reading /proc/{pid}/status of {}", self.name))?;
        let ticks = stat_cpu_ticks(&stat)
            .with_context(|| format!("/proc/{pid}/stat of {}: {stat:?}", self.name))?;
        let hwm = status_kib(&status, "VmHWM")
            .with_context(|| format!("/proc/{pid}/status of {} has no VmHWM", self.name))?;
        Ok((ticks as f64 / USER_HZ, hwm))
    }
}

/// What a soak samples besides CPU time.
struct Resources {
    rss_kib: u64,
    fds: usize,
    threads: u64,
}

impl Agent {
    fn resources(&self) -> Result<Resources> {
        let pid = self.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .with_context(|| format!("reading /proc/{pid}/status of {}", self.name))?;
        let field = |name: &str| {
            status_kib(&status, name)
                .with_context(|| format!("/proc/{pid}/status of {} has no {name}", self.name))
        };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .with_context(|| format!("listing /proc/{pid}/fd of {}", self.name))?
            .count();
        Ok(Resources {
            rss_kib: field("VmRSS")?,
            fds,
            threads: field("Threads")?,
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Command lines of the processes whose parent is `pid` (what an agent is waiting on).
/// See [`Agent::slow_syncs`].
const SLOW_SYNC_MS: f64 = 20.0;

/// The duration of kube-ipvs's `incremental sync: applied N of M operations in X ms` line.
fn sync_ms(line: &str) -> Option<f64> {
    let rest = line.split_once("incremental sync: applied ")?.1;
    rest.strip_suffix(" ms")?
        .rsplit_once(" in ")?
        .1
        .parse()
        .ok()
}

fn children(pid: u32) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
            continue;
        };
        // Field 4 (ppid) is the second word after the command name's closing parenthesis.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            let cmd = std::fs::read(path.join("cmdline")).unwrap_or_default();
            let cmd: String = String::from_utf8_lossy(&cmd)
                .replace('\0', " ")
                .chars()
                .take(120)
                .collect();
            out.push(cmd.trim().to_owned());
        }
    }
    out
}

/// utime + stime + cutime + cstime (fields 14-17) of a /proc/PID/stat line. The command name
/// (field 2) may contain spaces, so fields are counted after its closing parenthesis.
fn stat_cpu_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state), so field N is at index N - 3.
    let mut sum = 0u64;
    for n in 14..=17 {
        sum += fields.get(n - 3)?.parse::<u64>().ok()?;
    }
    Some(sum)
}

/// The number of a `Name:   123 kB` (or `Threads:  9`) line of /proc/PID/status.
fn status_kib(status: &str, name: &str) -> Option<u64> {
    status.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// How convergence went: when the last check succeeded, how long before that the last failed
/// check began (the true moment lies between), and how long one verifying full read took.
struct Converged {
    at: Duration,
    uncertainty: Duration,
    full_read: Duration,
}

/// Waits until the agent's dataplane holds every Service with exactly its initial endpoints.
fn converge(
    plane: &mut Dataplane,
    agent: &mut Agent,
    ips: &[Ipv4Addr],
    per: usize,
    started: Instant,
    timeout: Duration,
) -> Result<Converged> {
    match plane {
        Dataplane::Ipvs(ipvs) => converge_ipvs(ipvs, agent, ips, per, started, timeout),
        Dataplane::Rules(reader) => converge_rules(reader, agent, ips, per, started, timeout),
    }
}

/// [`converge`] for the rules modes: one whole read of the table per poll. The time is taken
/// when the read that found every Service whole returned, and the uncertainty runs from the
/// start of the last read that did not.
fn converge_rules(
    reader: &mut rules::Reader,
    agent: &mut Agent,
    ips: &[Ipv4Addr],
    per: usize,
    started: Instant,
    timeout: Duration,
) -> Result<Converged> {
    let want: Vec<(std::net::SocketAddrV4, rules::Backends)> = ips
        .iter()
        .enumerate()
        .map(|(i, ip)| {
            (
                std::net::SocketAddrV4::new(*ip, SERVICE_PORT),
                backends(&initial_addrs(i, per)),
            )
        })
        .collect();
    let mut last_fail = started;
    let mut last_progress = started;
    // A read that waits behind the agent's transaction must not hold the run past its limit.
    reader.set_deadline(Some(started + timeout));
    loop {
        agent.check_running()?;
        let poll = Instant::now();
        let snapshot = match reader.snapshot() {
            Ok(s) => s,
            Err(e @ rules::ReadError::TimedOut { .. }) => {
                bail!("not converged after {} s: {e}", timeout.as_secs())
            }
            Err(e) => return Err(e).context("reading the rules"),
        };
        let read = poll.elapsed();
        let whole = want
            .iter()
            .filter(|(vip, b)| snapshot.get(vip) == Some(b))
            .count();
        if whole == want.len() {
            let done = Instant::now();
            reader.set_deadline(None);
            return Ok(Converged {
                at: done - started,
                uncertainty: done - last_fail,
                full_read: read,
            });
        }
        last_fail = poll;
        let present = want
            .iter()
            .filter(|(vip, _)| snapshot.contains_key(vip))
            .count();
        // The first Service not whole, with what the reader found for it.
        let example = want
            .iter()
            .find(|(vip, b)| snapshot.get(vip) != Some(b))
            .map(|(vip, b)| {
                let got: Vec<String> = snapshot
                    .get(vip)
                    .map(|g| g.iter().map(ToString::to_string).collect())
                    .unwrap_or_default();
                format!("{vip} has [{}] of {} wanted", got.join(" "), b.len())
            })
            .unwrap_or_default();
        let what = format!(
            "{present} of {} Services in the rules, {whole} with all {per} endpoints (a read takes {:.1} s; {example})",
            want.len(),
            read.as_secs_f64()
        );
        if Instant::now() > started + timeout {
            bail!("not converged after {} s: {what}", timeout.as_secs());
        }
        if last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            let log = agent.tail();
            let last: Vec<&str> = log.lines().rev().take(12).collect();
            eprintln!(
                "e2e-bench: {} after {:.0} s: {what}; running children: [{}]; its log ends:\n{}",
                agent.name,
                started.elapsed().as_secs_f64(),
                children(agent.child.id()).join("; "),
                last.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        std::thread::sleep(CONVERGE_POLL);
    }
}

fn converge_ipvs(
    ipvs: &mut Ipvs,
    agent: &mut Agent,
    ips: &[Ipv4Addr],
    per: usize,
    started: Instant,
    timeout: Duration,
) -> Result<Converged> {
    let wanted: HashSet<ServiceKey> = ips.iter().map(|ip| key(*ip)).collect();
    let mut last_fail = started;
    let mut last_progress = started;
    let name = agent.name.clone();
    let log = agent.log.clone();
    let pid = agent.child.id();
    let mut progress = |what: String| {
        if last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let last: String = text
                .lines()
                .last()
                .unwrap_or_default()
                .chars()
                .take(200)
                .collect();
            eprintln!(
                "e2e-bench: {name} after {:.0} s: {what}; running children: [{}]; its log ends: {last}",
                started.elapsed().as_secs_f64(),
                children(pid).join("; ")
            );
        }
    };
    let deadline = started + timeout;
    let give_up = |what: String| -> Result<()> {
        if Instant::now() > deadline {
            bail!("not converged after {} s: {what}", timeout.as_secs());
        }
        Ok(())
    };
    // Cheap phase: one service dump per poll until every virtual server exists.
    loop {
        agent.check_running()?;
        let poll = Instant::now();
        let present = ipvs
            .services()?
            .iter()
            .filter(|s| wanted.contains(&s.key))
            .count();
        if present == wanted.len() {
            break;
        }
        last_fail = poll;
        let what = format!("{present} of {} virtual servers", wanted.len());
        give_up(what.clone())?;
        progress(what);
        std::thread::sleep(CONVERGE_POLL);
    }
    // Real servers: resume at the first Service not yet complete. The agents only add during
    // startup, so a Service seen complete stays complete; the verifying read below checks that.
    let mut next = 0;
    while next < ips.len() {
        let poll = Instant::now();
        if holds(ipvs, &key(ips[next]), &initial_addrs(next, per))? {
            next += 1;
            continue;
        }
        last_fail = poll;
        agent.check_running()?;
        let what = format!(
            "{next} of {} Services have all {per} real servers",
            ips.len()
        );
        give_up(what.clone())?;
        progress(what);
        std::thread::sleep(CONVERGE_POLL);
    }
    let done = Instant::now();
    for (i, ip) in ips.iter().enumerate() {
        if !holds(ipvs, &key(*ip), &initial_addrs(i, per))? {
            bail!(
                "Service {NAMESPACE}/{} ({ip}:{SERVICE_PORT}) lost real servers after converging",
                service_name(i)
            );
        }
    }
    Ok(Converged {
        at: done - started,
        uncertainty: done - last_fail,
        full_read: done.elapsed(),
    })
}

/// Waits until the agent is idle after convergence (see [`SETTLE_CPU`]); returns how long that
/// took and whether it happened within `limit`.
fn settle(agent: &mut Agent, limit: Duration) -> Result<(Duration, bool)> {
    let start = Instant::now();
    let mut before = agent.usage()?.0;
    loop {
        std::thread::sleep(SETTLE_WINDOW);
        agent.check_running()?;
        let now = agent.usage()?.0;
        if now - before < SETTLE_CPU {
            return Ok((start.elapsed(), true));
        }
        if start.elapsed() > limit {
            return Ok((start.elapsed(), false));
        }
        before = now;
    }
}

/// EndpointSlice updates, each timed until the kernel serves the new endpoint set: the update
/// series and the soak share it.
struct Churn {
    rt: tokio::runtime::Runtime,
    slices: Api<EndpointSlice>,
    /// The endpoints each updated Service has now.
    current: HashMap<usize, Vec<Ipv4Addr>>,
    per: usize,
    /// As `--nodes`: updated endpoints go to Nodes as populate's do.
    nodes: usize,
    sent: usize,
}

/// One update's timings in microseconds from sending its PATCH.
struct Timed {
    /// Until new connections could reach only the new endpoint set (see [`serves`]); `None` if
    /// the kernel did not show it within [`UPDATE_TIMEOUT`].
    kernel_us: Option<u64>,
    /// Until the API server answered the PATCH (part of the above), to tell a slow API server
    /// from a slow agent.
    patch_us: u64,
}

impl Churn {
    /// A churn whose client has `connections` connections to the API server open already.
    ///
    /// They are made now, with that many GETs at once, so no update's time is the driver's TLS
    /// handshake (it was 160 ms of every run's first update). The client speaks HTTP/1.1, one
    /// request per connection at a time, so an open loop that finds every pooled connection
    /// busy opens another, a handshake in the guest under emulation while updates wait: the
    /// open-loop churn asks for more connections than it has updates in flight (its runs
    /// stalled for seconds at their start while the pool grew).
    fn new(opts: &Options, connections: usize) -> Result<Churn> {
        let rt = runtime()?;
        let client = rt.block_on(client(opts.kubeconfig()?))?;
        let slices: Api<EndpointSlice> = Api::namespaced(client, NAMESPACE);
        let name = slice_name(0);
        rt.block_on(futures::future::try_join_all(
            (0..connections.max(1)).map(|_| slices.get(&name)),
        ))
        .with_context(|| format!("reading EndpointSlice {name}"))?;
        Ok(Churn {
            rt,
            slices,
            current: HashMap::new(),
            per: opts.endpoints,
            nodes: opts.nodes,
            sent: 0,
        })
    }

    /// This churn after `sent` updates of another on the same agent: it goes on from there,
    /// so its first changes are not those already sent (a PATCH that changes nothing brings
    /// no event, and the kernel "serves" it at once: a sample at PATCH time).
    fn starting_after(mut self, sent: usize) -> Churn {
        self.sent = sent;
        self
    }

    /// The next change: the next Service (a prime stride visits Services spread over the
    /// table, each once per N updates) with its first endpoint replaced, its new endpoint set,
    /// and the merge patch that sets it.
    fn next_change(&mut self, services: usize) -> (usize, Vec<Ipv4Addr>, serde_json::Value) {
        let u = self.sent;
        self.sent += 1;
        let i = (u * 7919) % services;
        let per = self.per;
        let addrs = self
            .current
            .entry(i)
            .or_insert_with(|| initial_addrs(i, per));
        addrs[0] = fresh_update_addr(u, addrs);
        let want = addrs.clone();
        let patch = serde_json::json!({"endpoints": endpoints_json(&want, self.nodes)});
        (i, want, patch)
    }

    /// The next update of the open-loop churn: its Service, endpoint set, and the PATCH
    /// running on the runtime, which notes when its answer came.
    fn start_update(&mut self, ips: &[Ipv4Addr]) -> (usize, Vec<Ipv4Addr>, PatchTask) {
        let (i, want, patch) = self.next_change(ips.len());
        let slices = self.slices.clone();
        let name = slice_name(i);
        let task = self.rt.spawn(async move {
            let answer = slices
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            (answer, Instant::now())
        });
        (i, want, task)
    }

    /// Sends the next change (see [`Churn::next_change`]) and waits until the kernel serves it.
    fn update(&mut self, plane: &mut Dataplane, ips: &[Ipv4Addr]) -> Result<Timed> {
        let u = self.sent;
        let (i, want, patch) = self.next_change(ips.len());
        let name = slice_name(i);
        let sent = Instant::now();
        self.rt
            .block_on(
                self.slices
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .with_context(|| format!("patching EndpointSlice {NAMESPACE}/{name}"))?;
        let patch_us = sent.elapsed().as_micros() as u64;
        loop {
            if plane.serves(ips[i], &want)? {
                return Ok(Timed {
                    kernel_us: Some(sent.elapsed().as_micros() as u64),
                    patch_us,
                });
            }
            if sent.elapsed() > UPDATE_TIMEOUT {
                eprintln!(
                    "e2e-bench: update {u} (EndpointSlice {NAMESPACE}/{name}) not in the kernel after {} s",
                    UPDATE_TIMEOUT.as_secs()
                );
                return Ok(Timed {
                    kernel_us: None,
                    patch_us,
                });
            }
            std::thread::sleep(UPDATE_POLL);
        }
    }
}

/// The data path to the first, middle and last Service (see `datapath.rs`); prints one
/// `E2E-DATAPATH` line each and hands back its lab, which the caller keeps until the agent's
/// run ends, so that deleting the two namespaces (whose cleanup the kernel defers to a worker
/// that takes the RTNL lock) does not fall into the timed updates and churn that follow.
fn measure_datapath(agent_name: &str, ips: &[Ipv4Addr], opts: &Options) -> Result<datapath::Lab> {
    let mut picks = vec![
        ("first", 0),
        ("middle", ips.len() / 2),
        ("last", ips.len() - 1),
    ];
    picks.dedup_by_key(|(_, i)| *i);
    let endpoints: Vec<Ipv4Addr> = picks
        .iter()
        .flat_map(|(_, i)| initial_addrs(*i, opts.endpoints))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut targets: Vec<std::net::SocketAddrV4> = picks
        .iter()
        .map(|(_, i)| std::net::SocketAddrV4::new(ips[*i], SERVICE_PORT))
        .collect();
    // The baseline: straight to one endpoint of the last Service, no Service rules on the way.
    picks.push(("direct", ips.len() - 1));
    targets.push(std::net::SocketAddrV4::new(
        initial_addrs(ips.len() - 1, opts.endpoints)[0],
        TARGET_PORT,
    ));
    let lab = datapath::Lab::up(&endpoints, TARGET_PORT).context("building the data path lab")?;
    let measured = lab
        .measure(&targets, opts.datapath)
        .with_context(|| format!("measuring the data path ({})", lab.program().display()))?;
    if measured.len() != picks.len() {
        bail!(
            "the data path client measured {} of {} targets",
            measured.len(),
            picks.len()
        );
    }
    if measured.iter().any(|m| m.failed == m.conns) {
        eprintln!(
            "e2e-bench: data path: every connection to a target failed:\n{}",
            lab.diagnose(&targets)
        );
    }
    for ((which, i), m) in picks.iter().zip(&measured) {
        println!(
            "E2E-DATAPATH agent={agent_name} services={} which={which} index={i} target={} conns={} failed={} p50_us={} p99_us={} rate={:.1}",
            ips.len(),
            m.target,
            m.conns,
            m.failed,
            m.p50_us,
            m.p99_us,
            m.rate
        );
    }
    Ok(lab)
}

/// Above this many updates in flight, the open-loop churn checks a rules agent's updates
/// against one whole read of its table instead of one chain listing each.
const WHOLE_READ_ABOVE: usize = 8;

/// A PATCH in flight on the driver's runtime: the API server's answer and when it came.
type PatchTask =
    tokio::task::JoinHandle<(std::result::Result<EndpointSlice, kube::Error>, Instant)>;

/// Connections the open-loop churn opens before it starts (see [`Churn::new`]):
/// more than the most updates in flight in a run that kept up (16).
const WARM_CONNECTIONS: usize = 32;

/// An update sent by the open-loop churn and not yet seen in the kernel.
struct Pending {
    service: usize,
    want: Vec<Ipv4Addr>,
    sent: Instant,
    /// The PATCH in flight (`None` once the API server accepted it).
    patch: Option<PatchTask>,
    /// How long the API server took to answer (stamped by the task itself, so a late look
    /// by the driver does not count).
    answered_us: Option<u64>,
}

/// What the open-loop churn measured.
#[derive(Default)]
struct OpenLoop {
    sent: usize,
    kernel_us: Vec<u64>,
    /// Of each update in `kernel_us`, until the API server's answer came (part of it: a
    /// slow API server or connection, not the agent; the whole time when the kernel served
    /// the update before the driver saw the answer).
    patch_us: Vec<u64>,
    /// Of each update in `kernel_us`, when it was sent, from the churn's start (whose time on
    /// the guest's clock the driver prints): places each update against the agent's log and
    /// against what else the guest or the host did meanwhile.
    sent_us: Vec<u64>,
    /// Not in the kernel within [`UPDATE_TIMEOUT`].
    timeouts: usize,
    /// Replaced by a later update to the same Service before the kernel showed them.
    superseded: usize,
    /// PATCHes the API server refused.
    errors: usize,
    /// The reader's cost: checks of one pending update, their total time, and the most
    /// updates in flight at once (a check per update per round, so with slow checks the
    /// latencies include waiting for the reader).
    checks: usize,
    check_time: Duration,
    max_pending: usize,
}

/// Open-loop churn (`--churn-seconds`): EndpointSlice updates go out at `--churn-rate` per
/// second whether or not the agent keeps up (each PATCH in flight on the runtime, so a slow
/// API server answer does not hold the next one back), and every update is timed from its
/// PATCH until the kernel serves its endpoint set, many in flight at once.
fn open_loop(
    opts: &Options,
    plane: &mut Dataplane,
    agent: &mut Agent,
    ips: &[Ipv4Addr],
    sent_before: usize,
) -> Result<OpenLoop> {
    let mut churn = Churn::new(opts, WARM_CONNECTIONS)?.starting_after(sent_before);
    let period = Duration::from_secs_f64(1.0 / opts.churn_rate);
    let start = Instant::now();
    // On the agent's log clock (the same guest), as the series' updates.
    eprintln!("e2e-bench: churn started at {} (Unix s)", unix_now());
    let mut next = start;
    let mut pending: Vec<Pending> = Vec::new();
    let mut out = OpenLoop::default();
    // A round checks every pending update once. Sending on schedule may interrupt it; the next
    // look goes on from `cursor`, so every update is checked in turn however many are in flight
    // (restarting at the first starved the rest until sending ended). After a round the reader
    // rests as long as the round's checks took: it shares the agent's guest and takes at most
    // half of one CPU from it.
    let (mut cursor, mut busy, mut rest_until) = (0, Duration::ZERO, start);
    loop {
        agent.check_running()?;
        let now = Instant::now();
        let sending = now - start < opts.churn;
        if sending && now >= next {
            let (service, want, patch) = churn.start_update(ips);
            if let Some(at) = pending.iter().position(|p| p.service == service) {
                // In order, so the updates after it that this round has not looked at yet
                // stay after the cursor.
                pending.remove(at);
                if at < cursor {
                    cursor -= 1;
                }
                out.superseded += 1;
            }
            pending.push(Pending {
                service,
                want,
                sent: now,
                patch: Some(patch),
                answered_us: None,
            });
            out.sent += 1;
            out.max_pending = out.max_pending.max(pending.len());
            next += period;
            continue;
        }
        if !sending && pending.is_empty() {
            return Ok(out);
        }
        if now < rest_until {
            let wake = if sending {
                rest_until.min(next)
            } else {
                rest_until
            };
            std::thread::sleep(wake - now);
            continue;
        }
        let round = Instant::now();
        // With many updates in flight, a rules reader checks them all against one read of the
        // whole table rather than listing a chain each (a process per check).
        let snapshot = match plane {
            Dataplane::Rules(reader) if pending.len() > WHOLE_READ_ABOVE => {
                let check = Instant::now();
                let snap = reader.snapshot().context("reading the rules")?;
                out.checks += 1;
                out.check_time += check.elapsed();
                Some(snap)
            }
            _ => None,
        };
        let mut k = cursor.min(pending.len());
        while k < pending.len() {
            if let Some(task) = pending[k].patch.take_if(|t| t.is_finished()) {
                // A refused PATCH changes nothing in the kernel: count it and stop waiting.
                let Ok((Ok(_), at)) = churn.rt.block_on(task) else {
                    out.errors += 1;
                    pending.swap_remove(k);
                    continue;
                };
                let took = at.saturating_duration_since(pending[k].sent);
                pending[k].answered_us = Some(took.as_micros() as u64);
            }
            let p = &pending[k];
            let served = match &snapshot {
                Some(snap) => {
                    snap.get(&std::net::SocketAddrV4::new(ips[p.service], SERVICE_PORT))
                        == Some(&backends(&p.want))
                }
                None => {
                    let check = Instant::now();
                    let served = plane.serves(ips[p.service], &p.want)?;
                    out.checks += 1;
                    out.check_time += check.elapsed();
                    served
                }
            };
            if served {
                let us = p.sent.elapsed().as_micros() as u64;
                out.kernel_us.push(us);
                out.patch_us.push(p.answered_us.unwrap_or(us));
                out.sent_us
                    .push(p.sent.saturating_duration_since(start).as_micros() as u64);
                pending.swap_remove(k);
            } else if p.sent.elapsed() > UPDATE_TIMEOUT {
                out.timeouts += 1;
                pending.swap_remove(k);
            } else {
                k += 1;
            }
            // Sending stays on schedule while many are in flight.
            if snapshot.is_none() && sending && Instant::now() >= next {
                break;
            }
        }
        busy += round.elapsed();
        if k < pending.len() {
            cursor = k;
            continue;
        }
        cursor = 0;
        rest_until = Instant::now() + std::mem::take(&mut busy).max(UPDATE_POLL);
    }
}

/// The wall-clock time now as Unix seconds with microseconds, as the agent's log gives it (the
/// driver's lines then fall between the agent's).
fn unix_now() -> String {
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{:06}", at.as_secs(), at.subsec_micros())
}

/// Updates sent and timed before the series, not in it (see [`Updates::warmup_us`]).
const WARMUP_UPDATES: usize = 2;

/// What the update series measured.
#[derive(Default)]
struct Updates {
    /// The slower of the [`WARMUP_UPDATES`] before the series, not in it (`None`: no series,
    /// or the kernel never showed one). Under TCG the first run of each code path in the
    /// guest, the agent's and the kernel's, is translated first, and (on the host) the API
    /// server's first merge patch of an EndpointSlice takes about twice its usual: in
    /// kube-ipvs's debug log (1,000 Services, 2026-12-05) each step of the first update (the
    /// watch's delivery, taking the change in, the diff, the apply) took 2-6 times what it
    /// took from the third update on, and the second update, the first to read a draining
    /// virtual server's connections and delete the real server the first one drained, synced
    /// in 7.6 ms (16.7 and 7.4 ms in two runs at 10,000) against 1.3-2.9 ms from the third
    /// on. Two updates of other Services first warm the paths the series' updates take (an
    /// add, a drain, a delete), for every agent alike.
    warmup_us: Option<u64>,
    kernel_us: Vec<u64>,
    patch_us: Vec<u64>,
    /// Updates the kernel never showed (at most one: the series stops there).
    timeouts: usize,
    /// PATCHes sent, warm-ups included: the churn after the series starts past them (see
    /// [`Churn::starting_after`]).
    sent: usize,
}

fn updates(
    opts: &Options,
    plane: &mut Dataplane,
    agent: &mut Agent,
    ips: &[Ipv4Addr],
) -> Result<Updates> {
    let mut churn = Churn::new(opts, 1)?;
    let mut out = Updates::default();
    for w in 0..if opts.updates > 0 { WARMUP_UPDATES } else { 0 } {
        agent.check_running()?;
        let warmup = churn.update(plane, ips)?;
        eprintln!(
            "e2e-bench: warm-up update {w} (not in the series): PATCH answered +{} us, kernel +{} us",
            warmup.patch_us,
            warmup
                .kernel_us
                .map_or_else(|| "-".to_owned(), |us| us.to_string())
        );
        let Some(us) = warmup.kernel_us else {
            out.warmup_us = None;
            out.timeouts = 1;
            out.sent = churn.sent;
            return Ok(out);
        };
        out.warmup_us = Some(out.warmup_us.map_or(us, |w| w.max(us)));
    }
    // The budget is the series': a peer's slow warm-ups do not shorten it.
    let budget_end = Instant::now() + opts.update_budget;
    for u in 0..opts.updates {
        if Instant::now() > budget_end {
            eprintln!(
                "e2e-bench: update budget of {} s spent after {u} updates",
                opts.update_budget.as_secs()
            );
            break;
        }
        agent.check_running()?;
        let at = unix_now();
        let timed = churn.update(plane, ips)?;
        // On the agent's log clock (the same guest), to place its own lines between the two.
        eprintln!(
            "e2e-bench: update {u} sent at {at} (Unix s): PATCH answered +{} us, kernel +{} us",
            timed.patch_us,
            timed
                .kernel_us
                .map_or_else(|| "-".to_owned(), |us| us.to_string())
        );
        out.patch_us.push(timed.patch_us);
        match timed.kernel_us {
            Some(us) => out.kernel_us.push(us),
            None => {
                out.timeouts = 1;
                break;
            }
        }
    }
    out.sent = churn.sent;
    Ok(out)
}

/// What [`flush_repair`] measured, each from the flush.
struct Repair {
    /// Until a virtual server was back (the agent noticed, at its next periodic sync).
    noticed: Duration,
    /// Until every Service had at least one real server (new connections work everywhere).
    serving: Duration,
    /// Until every Service had all its real servers.
    whole: Converged,
}

/// `ipvsadm -C` behind the converged agent's back, timing the repair (see [`Repair`]): the
/// real servers are re-added while the kernel's destination trash still holds the flushed ones.
fn flush_repair(
    ipvs: &mut Ipvs,
    agent: &mut Agent,
    ips: &[Ipv4Addr],
    per: usize,
    timeout: Duration,
) -> Result<Repair> {
    ipvs.flush().context("flushing the IPVS table")?;
    let flushed = Instant::now();
    eprintln!("e2e-bench: flushed the IPVS table behind the agent's back");
    loop {
        agent.check_running()?;
        if !ipvs.services()?.is_empty() {
            break;
        }
        if flushed.elapsed() > timeout {
            bail!(
                "no virtual server back {} s after the flush",
                timeout.as_secs()
            );
        }
        std::thread::sleep(CONVERGE_POLL);
    }
    let noticed = flushed.elapsed();
    // Read from /proc/net/ip_vs, not netlink: the agent's requests hold the generic netlink
    // lock for most of the repair, and a dump per Service waited behind them.
    let wanted: HashSet<(Ipv4Addr, u16)> = ips.iter().map(|ip| (*ip, SERVICE_PORT)).collect();
    loop {
        agent.check_running()?;
        let text = std::fs::read_to_string("/proc/net/ip_vs").context("reading /proc/net/ip_vs")?;
        let serving = serving_services(&text, &wanted);
        if serving == wanted.len() {
            break;
        }
        if flushed.elapsed() > timeout {
            bail!(
                "{serving} of {} Services serve again {} s after the flush",
                wanted.len(),
                timeout.as_secs()
            );
        }
        std::thread::sleep(CONVERGE_POLL);
    }
    let serving = flushed.elapsed();
    let whole = converge_ipvs(ipvs, agent, ips, per, flushed, timeout)?;
    Ok(Repair {
        noticed,
        serving,
        whole,
    })
}

/// How many of `wanted` (TCP address and port) have at least one real server, from the text of
/// /proc/net/ip_vs: a `TCP  0A600001:0050 rr` line per virtual server (address and port in hex),
/// then one `  -> ...` line per real server.
fn serving_services(text: &str, wanted: &HashSet<(Ipv4Addr, u16)>) -> usize {
    // A set, not a count: a virtual server added while the file is read can be listed twice.
    let mut serving: HashSet<(Ipv4Addr, u16)> = HashSet::new();
    let mut current: Option<(Ipv4Addr, u16)> = None;
    let mut counted = false;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("TCP  ") {
            current = rest.split_whitespace().next().and_then(|hex| {
                let (addr, port) = hex.split_once(':')?;
                let addr = u32::from_str_radix(addr, 16).ok()?;
                let port = u16::from_str_radix(port, 16).ok()?;
                Some((Ipv4Addr::from(addr), port))
            });
            counted = false;
        } else if line.trim_start().starts_with("->") && !line.contains("RemoteAddress") {
            if let Some(vs) = current
                && !counted
                && wanted.contains(&vs)
            {
                serving.insert(vs);
                counted = true;
            }
        } else if !line.starts_with(' ') {
            current = None;
        }
    }
    serving.len()
}

/// One soak sample of the agent's resources and the update latencies since the last sample.
fn soak_sample(
    agent: &Agent,
    since_start: Duration,
    window: &mut Vec<u64>,
    timeouts: &mut usize,
    errors: &mut usize,
) -> Result<String> {
    let (cpu, _) = agent.usage()?;
    let r = agent.resources()?;
    window.sort_unstable();
    let rank = |p: f64| datapath::rank(window, p);
    let line = format!(
        "SOAK-SAMPLE t_s={} rss_kib={} fds={} threads={} cpu_s={cpu:.2} updates={} timeouts={} errors={} p50_us={} p99_us={} max_us={}",
        since_start.as_secs(),
        r.rss_kib,
        r.fds,
        r.threads,
        window.len(),
        timeouts,
        errors,
        rank(50.0),
        rank(99.0),
        window.last().copied().unwrap_or(0),
    );
    window.clear();
    *timeouts = 0;
    *errors = 0;
    Ok(line)
}

/// The soak: endpoint updates at `--churn-rate` per second for `--soak-seconds`, each timed to
/// the kernel, with the agent's RSS, file descriptors, threads and CPU sampled every
/// `--sample-seconds`. Prints one `SOAK-SAMPLE` line per sample (xtask parses them); returns
/// how many updates were sent.
fn soak(
    opts: &Options,
    plane: &mut Dataplane,
    agent: &mut Agent,
    ips: &[Ipv4Addr],
    sent_before: usize,
) -> Result<usize> {
    let mut churn = Churn::new(opts, 1)?.starting_after(sent_before);
    let period = Duration::from_secs_f64(1.0 / opts.churn_rate);
    let start = Instant::now();
    let mut next_update = start;
    let mut next_sample = start;
    let mut window = Vec::new();
    let mut timeouts = 0;
    let mut errors = 0;
    loop {
        agent.check_running()?;
        let now = Instant::now();
        if now >= next_sample {
            println!(
                "{}",
                soak_sample(agent, now - start, &mut window, &mut timeouts, &mut errors)?
            );
            // After a slow update, no burst of samples with empty windows.
            next_sample = (next_sample + opts.sample_every).max(now);
            if now - start >= opts.soak {
                return Ok(churn.sent);
            }
        }
        if now < next_update {
            std::thread::sleep((next_update - now).min(next_sample.saturating_duration_since(now)));
            continue;
        }
        // A slow update delays the next ones instead of being followed by a burst.
        next_update = (next_update + period).max(now);
        // A failed PATCH (an API server hiccup) is reported and counted, not the end of hours
        // of soak.
        match churn.update(plane, ips) {
            Ok(Timed {
                kernel_us: Some(us),
                ..
            }) => window.push(us),
            Ok(Timed {
                kernel_us: None, ..
            }) => timeouts += 1,
            Err(e) => {
                eprintln!("e2e-bench: soak update failed: {e:#}");
                errors += 1;
            }
        }
    }
}

/// Microsecond samples as a comma list, `-` for none (the result line has no empty values).
fn list(samples: &[u64]) -> String {
    if samples.is_empty() {
        return "-".to_owned();
    }
    let words: Vec<String> = samples.iter().map(u64::to_string).collect();
    words.join(",")
}

/// The IPVS rate estimator's switch (a sysctl of the network namespace).
const RUN_ESTIMATION: &str = "/proc/sys/net/ipv4/vs/run_estimation";

fn guest(opts: &Options) -> Result<()> {
    let agent_name = opts
        .agent
        .as_deref()
        .with_context(|| format!("--agent is required\n{}", usage()))?;
    let file = opts
        .services_file
        .as_deref()
        .with_context(|| format!("--services-file is required\n{}", usage()))?;
    let ips = read_services(file)?;
    if ips.is_empty() {
        bail!("{}: no Services", file.display());
    }
    let mut ipvs = Ipvs::new().context("opening the IPVS netlink socket")?;
    let before = ipvs.services()?.len();
    if before != 0 {
        bail!("the IPVS table is not empty before the agent starts ({before} virtual servers)");
    }
    let mut plane = Dataplane::for_agent(agent_name, ipvs)?;
    if opts.no_estimation {
        // Before 6.2 the kernel's rate estimator walks every virtual and real server under one
        // lock every 2 s, in a timer; 0 stops the walk (and with it the counters `ipvsadm
        // --stats` and /proc/net/ip_vs_stats show, which the walk sums).
        std::fs::write(RUN_ESTIMATION, "0")
            .with_context(|| format!("writing 0 to {RUN_ESTIMATION}"))?;
    }
    eprintln!(
        "e2e-bench: {RUN_ESTIMATION} = {}",
        std::fs::read_to_string(RUN_ESTIMATION)
            .map_or_else(|e| format!("unreadable ({e})"), |v| v.trim().to_owned())
    );
    let started = Instant::now();
    if !opts.agent_env.is_empty() {
        eprintln!(
            "e2e-bench: the agent's environment adds {:?}",
            opts.agent_env
        );
    }
    let mut agent = Agent::start(agent_name, &opts.agent_env)?;
    let run = (|| -> Result<String> {
        let conv = converge(
            &mut plane,
            &mut agent,
            &ips,
            opts.endpoints,
            started,
            opts.converge_timeout,
        )?;
        eprintln!(
            "e2e-bench: {agent_name} converged on {} Services x {} in {:.3} s (last miss {:.3} s before; full read {:.3} s)",
            ips.len(),
            opts.endpoints,
            conv.at.as_secs_f64(),
            conv.uncertainty.as_secs_f64(),
            conv.full_read.as_secs_f64()
        );
        let (cpu_converged, rss_converged) = agent.usage()?;
        eprintln!(
            "e2e-bench: {agent_name} peak RSS when converged {:.1} MiB\n--- {agent_name} log (start) ---\n{}\n---",
            rss_converged as f64 / 1024.0,
            agent.head()
        );
        let (settle_time, settled) = settle(&mut agent, opts.settle_timeout)?;
        eprintln!(
            "e2e-bench: {agent_name} {} {:.1} s after converging",
            if settled { "idle" } else { "still busy" },
            settle_time.as_secs_f64()
        );
        let before_datapath = agent.log_len();
        let datapath_lab = if opts.datapath > 0 {
            let lab = measure_datapath(agent_name, &ips, opts)?;
            // The data path's links gave the node new addresses, which the agents act on
            // (kube-ipvs rewrites its NodePort rules): the updates start from an idle agent,
            // as they do without the data path.
            let (took, idle) = settle(&mut agent, opts.settle_timeout)?;
            eprintln!(
                "e2e-bench: {agent_name} {} {:.1} s after the data path",
                if idle { "idle" } else { "still busy" },
                took.as_secs_f64()
            );
            Some(lab)
        } else {
            None
        };
        if opts.flush_repair {
            let r = flush_repair(
                plane.ipvs("--flush-repair")?,
                &mut agent,
                &ips,
                opts.endpoints,
                opts.converge_timeout,
            )?;
            println!(
                "E2E-REPAIR noticed_ms={} serving_ms={} repaired_ms={} repaired_err_ms={}",
                r.noticed.as_millis(),
                r.serving.as_millis(),
                r.whole.at.as_millis(),
                r.whole.uncertainty.as_millis()
            );
        }
        let up = if opts.updates > 0 {
            updates(opts, &mut plane, &mut agent, &ips)?
        } else {
            Updates::default()
        };
        eprintln!(
            "--- {agent_name} log from the data path to the last update ---\n{}\n---",
            agent.since(before_datapath)
        );
        let mut sent_before = up.sent;
        if !opts.churn.is_zero() {
            let c = open_loop(opts, &mut plane, &mut agent, &ips, sent_before)?;
            sent_before += c.sent;
            println!(
                "E2E-CHURN agent={agent_name} services={} rate={} seconds={} sent={} timeouts={} superseded={} errors={} check_us={} max_pending={} updates_us={} patch_us={} sent_us={}",
                ips.len(),
                opts.churn_rate,
                opts.churn.as_secs(),
                c.sent,
                c.timeouts,
                c.superseded,
                c.errors,
                c.check_time.as_micros() / c.checks.max(1) as u128,
                c.max_pending,
                list(&c.kernel_us),
                list(&c.patch_us),
                list(&c.sent_us)
            );
        }
        if !opts.soak.is_zero() {
            let sent = soak(opts, &mut plane, &mut agent, &ips, sent_before)?;
            eprintln!(
                "e2e-bench: soak of {} s sent {sent} updates",
                opts.soak.as_secs()
            );
        }
        agent.check_running()?;
        let (cpu, rss) = agent.usage()?;
        drop(datapath_lab);
        eprintln!("--- {agent_name} log (end) ---\n{}\n---", agent.tail());
        eprintln!(
            "--- {agent_name} log, reconciles ---\n{}\n---",
            agent.reconciles()
        );
        eprintln!(
            "--- {agent_name} log, incremental syncs over {SLOW_SYNC_MS} ms ---\n{}\n---",
            agent.slow_syncs()
        );
        Ok(format!(
            "E2E-RESULT agent={agent_name} services={} endpoints={} converge_ms={} converge_err_ms={} full_read_ms={} cpu_converge_s={cpu_converged:.2} settle_ms={} settled={settled} updates_requested={} update_timeouts={} warmup_us={} updates_us={} patch_us={} cpu_s={cpu:.2} rss_kib={rss}",
            ips.len(),
            opts.endpoints,
            conv.at.as_millis(),
            conv.uncertainty.as_millis(),
            conv.full_read.as_millis(),
            settle_time.as_millis(),
            opts.updates,
            up.timeouts,
            up.warmup_us
                .map_or_else(|| "-".to_owned(), |us| us.to_string()),
            list(&up.kernel_us),
            list(&up.patch_us),
        ))
    })();
    match run {
        Ok(line) => {
            println!("{line}");
            Ok(())
        }
        Err(e) => {
            eprintln!("--- {agent_name} log (end) ---\n{}", agent.tail());
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_gets_the_daemonsets_malloc_settings() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/daemonset.yaml");
        let manifest = std::fs::read_to_string(path).expect("deploy/daemonset.yaml");
        let at = manifest
            .find("- name: GLIBC_TUNABLES")
            .expect("the DaemonSet sets GLIBC_TUNABLES");
        let value = manifest[at..]
            .lines()
            .nth(1)
            .and_then(|l| l.trim().strip_prefix("value: "))
            .expect("a value line after the name");
        assert_eq!(value, KUBE_IPVS_GLIBC_TUNABLES);
    }

    #[test]
    fn an_incremental_syncs_duration_is_read_from_its_line() {
        let line = "2026-12-07T01:29:35.166829Z  INFO kube_ipvs::agent::sync: incremental sync: \
                    applied 3 of 3 operations in 23.8 ms";
        assert_eq!(sync_ms(line), Some(23.8));
        assert_eq!(
            sync_ms("... incremental sync: applied 1 of 1 operation in 0.4 ms"),
            Some(0.4)
        );
        assert_eq!(
            sync_ms("... reconcile sync: applied 0 operations in 0.2 ms"),
            None
        );
        assert_eq!(
            sync_ms("... incremental sync: 3 operations ready to apply after 1.3 ms"),
            None
        );
    }

    #[test]
    fn slice_names_give_back_their_index() {
        assert_eq!(slice_index(&slice_name(42)), Some(42));
        assert_eq!(slice_index("svc-00042-2"), None);
        assert_eq!(slice_index("svc-42-1"), None);
        assert_eq!(slice_index("kubernetes"), None);
    }

    #[test]
    fn spread_endpoints_are_on_different_nodes_and_one_in_a_hundred_is_local() {
        let all: Vec<Ipv4Addr> = (0..1000).flat_map(|i| initial_addrs(i, 10)).collect();
        let local = all.iter().filter(|a| node_of(**a, 100) == NODE).count();
        assert!((90..=110).contains(&local), "{local} of 10,000 local");
        let nodes: HashSet<String> = initial_addrs(7, 10)
            .iter()
            .map(|a| node_of(*a, 100))
            .collect();
        assert_eq!(nodes.len(), 10);
        assert!(all.iter().all(|a| node_of(*a, 1) == NODE));
    }

    #[test]
    fn a_service_visited_again_gets_an_address_it_does_not_hold() {
        let n = 10_000;
        let i = 3;
        // The stride visits Service i at some u and again at u + n.
        let u = (0..n).find(|u| (u * 7919) % n == i).expect("visited");
        assert_eq!((u + n) * 7919 % n, i);
        let mut held = initial_addrs(i, 10);
        held[0] = fresh_update_addr(u, &held);
        let first = held[0];
        held[0] = fresh_update_addr(u + n, &held);
        assert_ne!(held[0], first, "the second visit must change the endpoint");
        assert_eq!(update_addr(u + n), first, "without the check it would not");
    }

    #[test]
    fn proc_ip_vs_counts_wanted_services_with_a_real_server() {
        let text = "IP Virtual Server version 1.2.1 (size=4096)\n\
            Prot LocalAddress:Port Scheduler Flags\n  \
            -> RemoteAddress:Port Forward Weight ActiveConn InActConn\n\
            TCP  0A600001:0050 rr\n  \
            -> 0AF40001:1F90      Masq    1      0          0\n  \
            -> 0AF40002:1F90      Masq    1      0          0\n\
            TCP  0A600002:0050 rr\n\
            UDP  0A600003:0050 rr\n  \
            -> 0AF40003:1F90      Masq    1      0          0\n\
            TCP  0A600004:0050 rr\n  \
            -> 0AF40004:1F90      Masq    1      0          0\n";
        let wanted: HashSet<(Ipv4Addr, u16)> = [1, 2, 3]
            .iter()
            .map(|d| (Ipv4Addr::new(10, 96, 0, *d), 80))
            .collect();
        // .1 has two real servers (counted once), .2 none, .3 only as UDP, .4 not wanted.
        assert_eq!(serving_services(text, &wanted), 1);
    }

    #[test]
    fn stat_fields_14_to_17_are_summed_after_the_command_name() {
        // Field 2 with a space and a parenthesis, as a process may name itself.
        let stat = "42 (kube (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 150 25 7 3 20 0 8 0 5 0 0";
        assert_eq!(stat_cpu_ticks(stat), Some(150 + 25 + 7 + 3));
    }
}
