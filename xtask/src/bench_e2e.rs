//! `cargo xtask bench e2e`: kube-ipvs against kube-proxy's IPVS, nftables and iptables modes end
//! to end, on a real kube-apiserver and a real kernel.
//!
//! One control plane on the host serves every run. For each size (ascending) the driver
//! (`integration/examples/e2e-bench.rs`) fills the API from the host, where it runs at native
//! speed; then each agent gets a fresh VM whose job runs the driver in `guest` mode, which starts
//! the agent, times convergence, EndpointSlice-update latency (at the largest size only) and reads
//! the agent's CPU time and peak RSS. The driver prints one `E2E-RESULT` line per VM; this module
//! parses those and prints a side-by-side table. Nothing is written to `docs/`: a run is
//! recorded there by hand, with the host's load.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::charts;
use crate::cluster::{ControlPlane, GUEST_DIR};
use crate::netns;
use crate::util::{self, secs, shell_quote};
use crate::vm::{self, GuestFile, Job, Tap};
use crate::vmtest::cargo_executables;

pub(crate) const DRIVER_PACKAGE: &str = "kube-ipvs-integration";
pub(crate) const DRIVER: &str = "e2e-bench";
/// kube-ipvs and its peers, each run on a fresh guest against the same API server. The
/// driver reads the IPVS agents' table through netlink and the rule-based modes' rules with
/// `nft` / `iptables` (`integration/src/rules.rs`).
const AGENTS: &[&str] = &[
    "kube-ipvs",
    ROUTES_AGENT,
    "kube-proxy-ipvs",
    "kube-proxy-nftables",
    "kube-proxy-iptables",
];
/// kube-ipvs with `--service-address-binding=route`: only when `--agents` names it.
const ROUTES_AGENT: &str = "kube-ipvs-routes";
/// What `--agents` accepted before the other modes: kube-proxy's IPVS mode.
const OLD_KUBE_PROXY: &str = "kube-proxy";
const RESULT_PREFIX: &str = "E2E-RESULT ";
/// Where the guest finds the `populate --out` list.
const GUEST_SERVICES: &str = "/etc/e2e-bench/services";

const USAGE: &str = "usage: cargo xtask bench e2e [--sizes 1000,5000,10000] [--updates 100] \
     [--endpoints 10] [--nodes 1] [--datapath 300] [--churn-rate 50] [--churn-seconds 60] \
     [--charts DIR] \
     [--agents kube-ipvs,kube-proxy-ipvs,kube-proxy-nftables,kube-proxy-iptables,kube-ipvs-routes] \
     [--update-budget SECS] [--settle-timeout SECS] [--converge-timeout SECS] [--mem MIB] \
     [--store DIR] [--net tap|user] [--no-ipvs-rate-estimation] [--agent-env NAME=VALUE]... \
     [--apiserver-memory-limit SIZE|go]";

/// How the guests reach the API server on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Net {
    /// QEMU's user networking (slirp), with `socat` carrying each connection to the API server
    /// on the host's loopback (`guestfwd`).
    User,
    /// A tap device on a bridge in a network namespace of the bench's own, where the control
    /// plane runs too: the guest's connections reach kube-apiserver through the guest kernel,
    /// the tap and the bridge only, as on a node.
    Tap,
}

impl Net {
    fn describe(self) -> &'static str {
        match self {
            Net::User => "user networking",
            Net::Tap => "tap networking",
        }
    }
}

/// The bench's network namespace (`--net tap`).
const NETNS: &str = "kube-ipvs-bench";
/// The bridge in it, holding [`vm::HOST_ALIAS`] (the address the guests' kubeconfigs name).
const BRIDGE: &str = "bench0";
/// The guests' tap device: one guest runs at a time.
const TAP: &str = "bench-tap0";
/// Set in the xtask run again inside [`NETNS`].
const INSIDE_ENV: &str = "KUBE_IPVS_BENCH_INSIDE";

#[derive(Debug, Clone, PartialEq)]
struct Options {
    sizes: Vec<usize>,
    updates: usize,
    agents: Vec<String>,
    /// Endpoints per Service.
    endpoints: usize,
    /// Nodes the endpoints are spread over (1: all on the agent's node, the hairpin worst case).
    nodes: usize,
    /// New connections timed per measured Service (first, middle, last) after converging; 0:
    /// the data path is not measured.
    datapath: usize,
    /// Where the SVG charts go (besides the run's directory under `target/`).
    charts: Option<PathBuf>,
    /// Open-loop churn at the largest size: updates per second, for this many seconds (0: none).
    churn_rate: f64,
    churn_seconds: u64,
    /// Wall-clock cap on the update series per agent (kube-proxy resyncs everything each time).
    update_budget: u64,
    /// How long the driver waits for an agent to go idle after converging.
    settle_timeout: u64,
    /// How long the driver waits for an agent to converge (`None`: 600 s plus a second per 4
    /// Services).
    converge_timeout: Option<u64>,
    memory_mib: u32,
    /// `net.ipv4.vs.run_estimation` set to 0 in every agent's guest before the agent starts
    /// (the same for every agent of the run).
    no_estimation: bool,
    /// A populated API server kept across runs (see [`KeptStore`]).
    store: Option<PathBuf>,
    net: Net,
    /// `NAME=VALUE` settings for every agent's environment, checked by [`env_setting`] before
    /// anything starts (a bad one would otherwise fail in the guest, after the populate).
    agent_env: Vec<String>,
    /// kube-apiserver runs with `GOGC=off` and this `GOMEMLIMIT` (`None`, the default, or
    /// `--apiserver-memory-limit go`: Go's default collector). An experiment, not the bench's
    /// conditions: the control plane shares this host's two cores with the guest under test,
    /// and with Go's default the API server collected every 12 s under churn at 10,000
    /// Services, 0.6 s of two threads' marking each time, while the guest stalled with it; but
    /// at 50,000 the API server answered PATCHes about twice as slowly with `6GiB` (likely the
    /// fresh pages a growing heap takes; not measured; twentieth session, `docs/benchmarks.md`).
    apiserver_memory_limit: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sizes: vec![1000, 5000, 10000],
            updates: 100,
            agents: AGENTS
                .iter()
                .filter(|a| **a != ROUTES_AGENT)
                .map(|a| (*a).to_owned())
                .collect(),
            endpoints: 10,
            nodes: 1,
            datapath: 300,
            charts: None,
            churn_rate: 50.0,
            churn_seconds: 60,
            update_budget: 300,
            settle_timeout: 600,
            converge_timeout: None,
            memory_mib: 4096,
            no_estimation: false,
            store: None,
            net: Net::Tap,
            agent_env: Vec::new(),
            apiserver_memory_limit: None,
        }
    }
}

/// `v` if it is a `GOMEMLIMIT` size (a whole number and `B`, `KiB`, `MiB`, `GiB` or `TiB`);
/// `None` for `go` (Go's default collector).
fn memory_limit(v: &str) -> Result<Option<String>> {
    if v == "go" {
        return Ok(None);
    }
    let digits = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &v[digits.len()..];
    if digits.is_empty()
        || !digits.chars().all(|c| c.is_ascii_digit())
        || !["B", "KiB", "MiB", "GiB", "TiB"].contains(&unit)
    {
        bail!(
            "bench e2e: --apiserver-memory-limit {v:?}: a size such as 6GiB (B, KiB, MiB, GiB, \
             TiB), or go for Go's default collector"
        );
    }
    Ok(Some(v.to_owned()))
}

/// kube-apiserver's environment for [`Options::apiserver_memory_limit`].
fn apiserver_env(limit: Option<&str>) -> Vec<(String, String)> {
    limit
        .map(|l| {
            vec![
                ("GOGC".to_owned(), "off".to_owned()),
                ("GOMEMLIMIT".to_owned(), l.to_owned()),
            ]
        })
        .unwrap_or_default()
}

/// `v` if it is `NAME=VALUE` with a shell-style name and a value without NUL.
fn env_setting(v: &str) -> Result<String> {
    let (name, value) = v
        .split_once('=')
        .with_context(|| format!("bench e2e: --agent-env {v:?}: NAME=VALUE"))?;
    let valid_name = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid_name || value.contains('\0') {
        bail!(
            "bench e2e: --agent-env {v:?}: NAME is letters, digits and _, not starting with a \
             digit, and VALUE has no NUL"
        );
    }
    Ok(v.to_owned())
}

fn parse_options(args: &[String]) -> Result<Options> {
    let mut o = Options::default();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--no-ipvs-rate-estimation" {
            o.no_estimation = true;
            continue;
        }
        let value = it
            .next()
            .with_context(|| format!("bench e2e: {flag} needs a value; {USAGE}"))?;
        let number = |v: &str| -> Result<usize> {
            v.trim()
                .parse()
                .with_context(|| format!("bench e2e: {flag} {v:?} is not a whole number"))
        };
        match flag.as_str() {
            "--sizes" => {
                o.sizes = value.split(',').map(number).collect::<Result<_>>()?;
            }
            "--updates" => o.updates = number(value)?,
            "--endpoints" => o.endpoints = number(value)?,
            "--nodes" => o.nodes = number(value)?,
            "--datapath" => o.datapath = number(value)?,
            "--charts" => o.charts = Some(PathBuf::from(value)),
            "--store" => o.store = Some(PathBuf::from(value)),
            "--agent-env" => o.agent_env.push(env_setting(value)?),
            "--apiserver-memory-limit" => o.apiserver_memory_limit = memory_limit(value)?,
            "--net" => {
                o.net = match value.as_str() {
                    "user" => Net::User,
                    "tap" => Net::Tap,
                    other => bail!("bench e2e: --net {other:?}: user or tap"),
                }
            }
            "--churn-seconds" => o.churn_seconds = number(value)? as u64,
            "--churn-rate" => {
                o.churn_rate = value
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|r| r.is_finite() && *r > 0.0 && *r <= 1000.0)
                    .with_context(|| {
                        format!(
                            "bench e2e: --churn-rate {value:?}: updates per second, 0 < R <= 1000"
                        )
                    })?;
            }
            "--update-budget" => o.update_budget = number(value)? as u64,
            "--settle-timeout" => o.settle_timeout = number(value)? as u64,
            "--converge-timeout" => o.converge_timeout = Some(number(value)? as u64),
            "--mem" => {
                o.memory_mib = u32::try_from(number(value)?)
                    .with_context(|| format!("bench e2e: --mem {value} is too large"))?;
            }
            "--agents" => {
                o.agents = Vec::new();
                for a in value.split(',').map(str::trim) {
                    let a = if a == OLD_KUBE_PROXY {
                        "kube-proxy-ipvs"
                    } else {
                        a
                    };
                    if !AGENTS.contains(&a) {
                        bail!("bench e2e: unknown agent {a:?} ({})", AGENTS.join(", "));
                    }
                    if !o.agents.iter().any(|x| x == a) {
                        o.agents.push(a.to_owned());
                    }
                }
            }
            other => bail!("bench e2e: unknown option {other:?}; {USAGE}"),
        }
    }
    if !(1..=1000).contains(&o.endpoints) {
        bail!("bench e2e: --endpoints must be 1..=1000 (one EndpointSlice per Service)");
    }
    if !(1..=5000).contains(&o.nodes) {
        bail!("bench e2e: --nodes must be 1..=5000");
    }
    if o.sizes.is_empty() || o.sizes.contains(&0) {
        bail!("bench e2e: --sizes needs positive numbers");
    }
    if o.sizes.iter().any(|n| *n > 60_000) {
        bail!("bench e2e: sizes above 60,000 do not fit the 10.96.0.0/16 Service CIDR");
    }
    o.sizes.sort_unstable();
    o.sizes.dedup();
    if o.agents.is_empty() {
        bail!("bench e2e: --agents is empty");
    }
    Ok(o)
}

/// One VM's measurements, as the driver's `E2E-RESULT` line gives them.
#[derive(Debug, Clone, PartialEq)]
struct RunResult {
    agent: String,
    services: usize,
    endpoints: usize,
    converge_ms: u64,
    converge_err_ms: u64,
    full_read_ms: u64,
    updates_requested: usize,
    update_timeouts: usize,
    /// The slower of the warm-up updates before the series, not in `updates_us` (see the driver's
    /// `Updates::warmup_us`); `None` in lines from before it existed, or if it timed out.
    warmup_us: Option<u64>,
    updates_us: Vec<u64>,
    /// The API server's answer to each PATCH (included in `updates_us`).
    patch_us: Vec<u64>,
    /// Agent CPU seconds when the table had converged (before any update).
    cpu_converge_s: f64,
    /// Time after convergence until the agent was idle (CPU), and whether it got there.
    settle_ms: u64,
    settled: bool,
    cpu_s: f64,
    rss_kib: u64,
    /// The data path to the first, middle and last Service (`E2E-DATAPATH` lines).
    datapath: Vec<Datapath>,
    /// The open-loop churn (`E2E-CHURN`), at the largest size.
    churn: Option<ChurnRun>,
    /// How long the guest waited for the host's CPUs during the churn (measured on the host).
    host_waits: Option<HostWaits>,
}

/// One `E2E-CHURN` line: updates sent at a fixed rate, each timed to the kernel.
#[derive(Debug, Clone, PartialEq)]
struct ChurnRun {
    rate: f64,
    seconds: u64,
    sent: usize,
    timeouts: usize,
    superseded: usize,
    errors: usize,
    /// The reader's mean time to check one pending update, and the most in flight at once.
    check_us: u64,
    max_pending: usize,
    updates_us: Vec<u64>,
    /// Until the driver saw each PATCH answered (absent from the first churn lines).
    patch_us: Vec<u64>,
    /// When each update was sent, from the churn's start (absent before 4322ea2).
    sent_us: Vec<u64>,
}

const CHURN_PREFIX: &str = "E2E-CHURN ";

fn parse_churn_line(line: &str) -> Result<ChurnRun> {
    let f = fields(line, CHURN_PREFIX)?;
    let updates_us = samples(
        "updates_us",
        f.get("updates_us")
            .with_context(|| format!("{line:?} lacks updates_us"))?,
    )?;
    // (Absent from the first churn lines.)
    let patch_us = samples("patch_us", f.get("patch_us").copied().unwrap_or("-"))?;
    // (Absent before the driver gave each update's send time.)
    let sent_us = samples("sent_us", f.get("sent_us").copied().unwrap_or("-"))?;
    Ok(ChurnRun {
        rate: number(&f, "rate")?,
        seconds: number(&f, "seconds")?,
        sent: number(&f, "sent")?,
        timeouts: number(&f, "timeouts")?,
        superseded: number(&f, "superseded")?,
        errors: number(&f, "errors")?,
        // (Absent from the first churn lines.)
        check_us: if f.contains_key("check_us") {
            number(&f, "check_us")?
        } else {
            0
        },
        max_pending: if f.contains_key("max_pending") {
            number(&f, "max_pending")?
        } else {
            0
        },
        updates_us,
        patch_us,
        sent_us,
    })
}

/// How long the guest's vCPUs waited for one of the host's CPUs during the open-loop churn:
/// QEMU's threads as the host's scheduler counts them ([`vm::Job::sample_threads`]), each
/// churned update placed on the host's clock by the console line that starts the churn and
/// its send time (`sent_us`). On this project's two-core machine the API server and etcd
/// share the cores the guest runs on, and the churn's slow updates were found to be those
/// during which the guest waited (`docs/benchmarks.md`, twenty-first session).
#[derive(Debug, Clone, PartialEq)]
struct HostWaits {
    /// The two QEMU threads that ran most during the churn (the guest's vCPUs): nanoseconds
    /// run and waited, each.
    run_ns: [u64; 2],
    wait_ns: [u64; 2],
    /// The updates over [`SLOW_UPDATE_US`], and the two threads' waits while each update was
    /// in flight, summed, per unit of the updates' own time: for those and for the others
    /// (`None` without any).
    slow: usize,
    slow_rate: Option<f64>,
    other_rate: Option<f64>,
}

/// An update of the churn slower than this is counted apart in [`HostWaits`].
const SLOW_UPDATE_US: u64 = 50_000;

/// What the driver prints when the open-loop churn starts (`e2e-bench.rs`).
const CHURN_STARTED: &str = "e2e-bench: churn started at ";

/// [`HostWaits`] of `churn`, which started `start` after QEMU (the console line
/// [`CHURN_STARTED`], on the clock of `taken`, QEMU's threads' samples); `None` without
/// updates in the kernel, without their send times (a driver from before them) or without
/// samples.
fn churn_host_waits(
    start: Duration,
    churn: &ChurnRun,
    taken: &[vm::ThreadSample],
) -> Option<HostWaits> {
    let (took, sent) = (&churn.updates_us, &churn.sent_us);
    if took.is_empty() || took.len() != sent.len() || taken.is_empty() {
        return None;
    }
    // The last sample at or before `t` (the first, before any).
    let at = |t: Duration| &taken[taken.partition_point(|s| s.at <= t).saturating_sub(1)];
    let of = |s: &vm::ThreadSample, tid: u32| {
        s.threads
            .iter()
            .find(|t| t.0 == tid)
            .map_or((0, 0), |t| (t.1, t.2))
    };
    let end = start + Duration::from_micros(sent.iter().zip(took).map(|(s, t)| s + t).max()?);
    let (first, last) = (at(start), at(end));
    let mut ran: Vec<(u64, u32)> = last
        .threads
        .iter()
        .map(|&(tid, run, _)| (run.saturating_sub(of(first, tid).0), tid))
        .collect();
    ran.sort_unstable_by(|a, b| b.cmp(a));
    let vcpus: Vec<u32> = ran.iter().take(2).map(|r| r.1).collect();
    let waited = |from: Duration, to: Duration| -> u64 {
        let (a, b) = (at(from), at(to));
        vcpus
            .iter()
            .map(|&v| of(b, v).1.saturating_sub(of(a, v).1))
            .sum()
    };
    // (waited ns, in flight ns) of the slow updates and of the others.
    let (mut slow, mut other) = ((0u64, 0u64, 0usize), (0u64, 0u64));
    for (&s, &t) in sent.iter().zip(took) {
        let from = start + Duration::from_micros(s);
        let w = waited(from, from + Duration::from_micros(t));
        if t > SLOW_UPDATE_US {
            slow = (slow.0 + w, slow.1 + t * 1000, slow.2 + 1);
        } else {
            other = (other.0 + w, other.1 + t * 1000);
        }
    }
    let rate = |w: u64, d: u64| (d > 0).then(|| w as f64 / d as f64);
    // Each vCPU's time run and waited over the whole churn.
    let over_churn = |i: usize| {
        vcpus.get(i).map_or((0, 0), |&v| {
            let (a, b) = (of(first, v), of(last, v));
            (b.0.saturating_sub(a.0), b.1.saturating_sub(a.1))
        })
    };
    let (v0, v1) = (over_churn(0), over_churn(1));
    Some(HostWaits {
        run_ns: [v0.0, v1.0],
        wait_ns: [v0.1, v1.1],
        slow: slow.2,
        slow_rate: rate(slow.0, slow.1),
        other_rate: rate(other.0, other.1),
    })
}

/// One `E2E-DATAPATH` line: new connections to one Service's ClusterIP from a client namespace.
#[derive(Debug, Clone, PartialEq)]
struct Datapath {
    /// `first`, `middle` or `last` of the Services.
    which: String,
    conns: usize,
    failed: usize,
    p50_us: u64,
    p99_us: u64,
    /// Connections per second, one after another from one client.
    rate: f64,
}

const DATAPATH_PREFIX: &str = "E2E-DATAPATH ";

fn parse_datapath_line(line: &str) -> Result<Datapath> {
    let f = fields(line, DATAPATH_PREFIX)?;
    Ok(Datapath {
        which: f
            .get("which")
            .with_context(|| format!("{line:?} lacks which"))?
            .to_string(),
        conns: number(&f, "conns")?,
        failed: number(&f, "failed")?,
        p50_us: number(&f, "p50_us")?,
        p99_us: number(&f, "p99_us")?,
        rate: number(&f, "rate")?,
    })
}

/// The `key=value` words after `prefix` in a console line.
pub(crate) fn fields<'a>(
    line: &'a str,
    prefix: &str,
) -> Result<std::collections::HashMap<&'a str, &'a str>> {
    let body = line
        .trim()
        .strip_prefix(prefix)
        .with_context(|| format!("not a {} line: {line:?}", prefix.trim()))?;
    let mut fields = std::collections::HashMap::new();
    for word in body.split_whitespace() {
        let (k, v) = word
            .split_once('=')
            .with_context(|| format!("result field {word:?} has no `=`"))?;
        fields.insert(k, v);
    }
    Ok(fields)
}

/// A numeric field of [`fields`], naming the field when it is missing or not a number.
pub(crate) fn number<T: std::str::FromStr>(
    fields: &std::collections::HashMap<&str, &str>,
    key: &str,
) -> Result<T> {
    let v = fields
        .get(key)
        .with_context(|| format!("result line lacks {key}"))?;
    v.parse()
        .map_err(|_| anyhow::anyhow!("result field {key}={v:?} is not a number"))
}

fn parse_result_line(line: &str) -> Result<RunResult> {
    let fields = fields(line, RESULT_PREFIX)?;
    let get = |k: &str| -> Result<&str> {
        fields
            .get(k)
            .copied()
            .with_context(|| format!("result line lacks {k}: {line:?}"))
    };
    fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T> {
        v.parse()
            .map_err(|_| anyhow::anyhow!("result field {k}={v:?} is not a number"))
    }
    Ok(RunResult {
        agent: get("agent")?.to_owned(),
        services: num("services", get("services")?)?,
        endpoints: num("endpoints", get("endpoints")?)?,
        converge_ms: num("converge_ms", get("converge_ms")?)?,
        converge_err_ms: num("converge_err_ms", get("converge_err_ms")?)?,
        full_read_ms: num("full_read_ms", get("full_read_ms")?)?,
        updates_requested: num("updates_requested", get("updates_requested")?)?,
        update_timeouts: num("update_timeouts", get("update_timeouts")?)?,
        warmup_us: match fields.get("warmup_us").copied() {
            None | Some("-") => None,
            Some(v) => Some(num("warmup_us", v)?),
        },
        updates_us: samples("updates_us", get("updates_us")?)?,
        patch_us: samples("patch_us", get("patch_us")?)?,
        cpu_converge_s: num("cpu_converge_s", get("cpu_converge_s")?)?,
        settle_ms: num("settle_ms", get("settle_ms")?)?,
        settled: num("settled", get("settled")?)?,
        cpu_s: num("cpu_s", get("cpu_s")?)?,
        rss_kib: num("rss_kib", get("rss_kib")?)?,
        datapath: Vec::new(),
        churn: None,
        host_waits: None,
    })
}

/// A result field holding microsecond samples: a comma list, or `-` for none.
fn samples(key: &str, list: &str) -> Result<Vec<u64>> {
    if list == "-" {
        return Ok(Vec::new());
    }
    list.split(',')
        .map(|v| {
            v.parse()
                .map_err(|_| anyhow::anyhow!("result field {key}={v:?} is not a number"))
        })
        .collect()
}

/// Nearest-rank percentile (`p` in 0..=100) of unsorted samples; `None` without samples.
pub(crate) fn percentile(samples: &[u64], p: f64) -> Option<u64> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

fn ms(us: u64) -> String {
    format!("{:.1} ms", us as f64 / 1000.0)
}

/// The value of a metric that is a count, not a figure to compare: its ratio is `-`.
const NO_RATIO: f64 = f64::NAN;

/// `peer / kube-ipvs`, or `-` when either side is missing, zero or [`NO_RATIO`].
fn ratio(ipvs: Option<f64>, peer: Option<f64>) -> String {
    match (ipvs, peer) {
        (Some(a), Some(b)) if a > 0.0 && b.is_finite() => format!("{:.1}x", b / a),
        _ => "-".to_owned(),
    }
}

/// `a / b / c` ms over the data path's Services; ratios are of the last Service's figure (the
/// deepest in iptables' list).
fn datapath_cell(r: &RunResult, f: impl Fn(&Datapath) -> u64) -> Option<(String, f64)> {
    let last = r.datapath.iter().find(|d| d.which == "last")?;
    let cells: Vec<String> = r
        .datapath
        .iter()
        .map(|d| format!("{:.2}", f(d) as f64 / 1000.0))
        .collect();
    Some((format!("{} ms", cells.join(" / ")), f(last) as f64))
}

/// One metric of a run: its cell text and the value ratios are taken of (`None`: no cell).
type Metric = dyn Fn(&RunResult) -> Option<(String, f64)>;

/// The side-by-side table: one block per size, one row per metric, a column per agent (in
/// [`AGENTS`] order) and one ratio column `peer / kube-ipvs` per peer (above 1 means kube-ipvs
/// is faster or smaller).
fn table(results: &[RunResult]) -> String {
    let mut sizes: Vec<usize> = results.iter().map(|r| r.services).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut agents: Vec<&str> = AGENTS
        .iter()
        .copied()
        .filter(|a| results.iter().any(|r| r.agent == *a))
        .collect();
    // Results of an agent this xtask does not know (an old log) still get a column.
    for r in results {
        if !agents.contains(&r.agent.as_str()) {
            agents.push(&r.agent);
        }
    }
    let peers: Vec<&str> = agents
        .iter()
        .copied()
        .filter(|a| *a != "kube-ipvs")
        .collect();
    let mut header: Vec<String> = vec!["size".into(), "metric".into()];
    header.extend(agents.iter().map(|a| (*a).to_owned()));
    header.extend(peers.iter().map(|p| format!("{p} / kube-ipvs")));
    let mut rows: Vec<Vec<String>> = vec![header];
    let metrics: Vec<(&str, Box<Metric>)> = vec![
        (
            "converge (+ uncertainty)",
            Box::new(|r| {
                Some((
                    format!(
                        "{:.2} s (+{:.2} s)",
                        r.converge_ms as f64 / 1000.0,
                        r.converge_err_ms as f64 / 1000.0
                    ),
                    r.converge_ms as f64,
                ))
            }),
        ),
        (
            "idle after converging",
            Box::new(|r| {
                let busy = if r.settled { "" } else { " (still busy)" };
                Some((
                    format!("{:.1} s{busy}", r.settle_ms as f64 / 1000.0),
                    r.settle_ms as f64,
                ))
            }),
        ),
        (
            "one full table read",
            Box::new(|r| {
                Some((
                    format!("{:.2} s", r.full_read_ms as f64 / 1000.0),
                    r.full_read_ms as f64,
                ))
            }),
        ),
        (
            "update p50",
            Box::new(|r| percentile(&r.updates_us, 50.0).map(|v| (ms(v), v as f64))),
        ),
        (
            "update p99",
            Box::new(|r| percentile(&r.updates_us, 99.0).map(|v| (ms(v), v as f64))),
        ),
        (
            "  of which PATCH answered, p50",
            Box::new(|r| percentile(&r.patch_us, 50.0).map(|v| (ms(v), v as f64))),
        ),
        (
            "update max",
            Box::new(|r| r.updates_us.iter().max().map(|v| (ms(*v), *v as f64))),
        ),
        (
            "warm-up: slower of 2 updates before them (not above)",
            Box::new(|r| r.warmup_us.map(|v| (ms(v), v as f64))),
        ),
        (
            "updates measured / asked",
            Box::new(|r| {
                (r.updates_requested > 0).then(|| {
                    let timeouts = if r.update_timeouts > 0 {
                        format!(" ({} timed out)", r.update_timeouts)
                    } else {
                        String::new()
                    };
                    (
                        format!("{} / {}{timeouts}", r.updates_us.len(), r.updates_requested),
                        NO_RATIO,
                    )
                })
            }),
        ),
        (
            "churn: p50 / p99 / max (open loop)",
            Box::new(|r| {
                let c = r.churn.as_ref()?;
                let p99 = percentile(&c.updates_us, 99.0)?;
                Some((
                    format!(
                        "{} / {} / {} at {}/s",
                        ms(percentile(&c.updates_us, 50.0)?),
                        ms(p99),
                        ms(c.updates_us.iter().copied().max()?),
                        c.rate
                    ),
                    p99 as f64,
                ))
            }),
        ),
        (
            "churn: in the kernel / sent (timed out, superseded, refused)",
            Box::new(|r| {
                let c = r.churn.as_ref()?;
                Some((
                    format!(
                        "{} / {} in {} s ({}, {}, {})",
                        c.updates_us.len(),
                        c.sent,
                        c.seconds,
                        c.timeouts,
                        c.superseded,
                        c.errors
                    ),
                    NO_RATIO,
                ))
            }),
        ),
        (
            "churn: of which PATCH answered, p50 / p99",
            Box::new(|r| {
                let c = r.churn.as_ref()?;
                let p99 = percentile(&c.patch_us, 99.0)?;
                Some((
                    format!("{} / {}", ms(percentile(&c.patch_us, 50.0)?), ms(p99)),
                    p99 as f64,
                ))
            }),
        ),
        (
            "churn: reader's check of one update, mean (most in flight)",
            Box::new(|r| {
                let c = r.churn.as_ref()?;
                Some((
                    format!("{} ({})", ms(c.check_us), c.max_pending),
                    c.check_us as f64,
                ))
            }),
        ),
        (
            "churn: guest's vCPUs waiting for a host CPU: run / waited; waits per ms of updates over 50 ms / of the others",
            Box::new(|r| {
                let h = r.host_waits.as_ref()?;
                let s = |ns: u64| format!("{:.1}", ns as f64 / 1e9);
                let rate = |r: Option<f64>| r.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}"));
                Some((
                    format!(
                        "{} + {} s / {} + {} s; {} ({}) / {}",
                        s(h.run_ns[0]),
                        s(h.run_ns[1]),
                        s(h.wait_ns[0]),
                        s(h.wait_ns[1]),
                        rate(h.slow_rate),
                        h.slow,
                        rate(h.other_rate)
                    ),
                    NO_RATIO,
                ))
            }),
        ),
        (
            "CPU until converged",
            Box::new(|r| Some((format!("{:.2} s", r.cpu_converge_s), r.cpu_converge_s))),
        ),
        (
            "CPU at the end (user+sys, with children)",
            Box::new(|r| Some((format!("{:.2} s", r.cpu_s), r.cpu_s))),
        ),
        (
            "new connection p50: first / middle / last Service / an endpoint directly",
            Box::new(|r| datapath_cell(r, |d| d.p50_us)),
        ),
        (
            "new connection p99: first / middle / last Service / an endpoint directly",
            Box::new(|r| datapath_cell(r, |d| d.p99_us)),
        ),
        (
            "connections/s from one client, last Service (ratio: time per connection)",
            Box::new(|r| {
                let d = r.datapath.iter().find(|d| d.which == "last")?;
                let failed = if d.failed > 0 {
                    format!(" ({} of {} failed)", d.failed, d.conns)
                } else {
                    String::new()
                };
                Some((format!("{:.0}{failed}", d.rate), 1.0 / d.rate.max(1e-9)))
            }),
        ),
        (
            "peak RSS (VmHWM)",
            Box::new(|r| {
                Some((
                    format!("{:.1} MiB", r.rss_kib as f64 / 1024.0),
                    r.rss_kib as f64,
                ))
            }),
        ),
    ];
    for size in sizes {
        let find = |agent: &str| {
            results
                .iter()
                .find(|r| r.services == size && r.agent == agent)
        };
        for (label, f) in &metrics {
            let cell = |agent: &str| find(agent).and_then(f);
            let mut row = vec![format!("{size}"), (*label).to_owned()];
            row.extend(
                agents
                    .iter()
                    .map(|a| cell(a).map_or_else(|| "-".to_owned(), |(t, _)| t)),
            );
            let base = cell("kube-ipvs").map(|(_, v)| v);
            row.extend(peers.iter().map(|p| ratio(base, cell(p).map(|(_, v)| v))));
            rows.push(row);
        }
    }
    let mut widths = vec![0usize; rows[0].len()];
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out
}

pub(crate) fn release_build(package: &str, what: &[&str], name: &str) -> Result<PathBuf> {
    let mut args = vec!["build", "--release", "-p", package];
    args.extend_from_slice(what);
    cargo_executables(&args, |m| m["target"]["name"] == name)?
        .into_iter()
        .next()
        .map(|(_, exe)| exe)
        .with_context(|| format!("cargo build produced no {name} executable"))
}

/// How the Services' endpoints look: how many each, over how many Nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) endpoints: usize,
    pub(crate) nodes: usize,
}

impl Shape {
    /// Ten endpoints per Service, all on the agent's node.
    pub(crate) const LOCAL: Shape = Shape {
        endpoints: 10,
        nodes: 1,
    };

    /// The driver's options for it (populate and guest take the same).
    pub(crate) fn args(self) -> Vec<String> {
        vec![
            "--endpoints".into(),
            self.endpoints.to_string(),
            "--nodes".into(),
            self.nodes.to_string(),
        ]
    }
}

/// `--store DIR`: an API server's store populated by an earlier run, so a run at 50,000 Services
/// does not spend the 85 minutes its populate takes (kube-apiserver's ClusterIP allocator counts
/// every allocated address on each allocation: quadratic). `DIR/etcd` is etcd's data directory,
/// `DIR/populated` what it holds (`services=N endpoints=E nodes=M`). A run starts etcd on a copy
/// of it, so the kept store itself never changes but by a save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KeptStore {
    services: usize,
    shape: Shape,
}

impl KeptStore {
    const META: &'static str = "populated";

    /// The store kept in `dir`, if there is one.
    fn read(dir: &Path) -> Result<Option<KeptStore>> {
        let meta = dir.join(Self::META);
        if !meta.exists() || !dir.join("etcd").is_dir() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&meta)?;
        Self::parse(&text)
            .with_context(|| format!("{}: not a kept store ({text:?})", meta.display()))
            .map(Some)
    }

    fn parse(text: &str) -> Option<KeptStore> {
        let mut fields = std::collections::HashMap::new();
        for word in text.split_whitespace() {
            let (k, v) = word.split_once('=')?;
            fields.insert(k, v.parse::<usize>().ok()?);
        }
        Some(KeptStore {
            services: *fields.get("services")?,
            shape: Shape {
                endpoints: *fields.get("endpoints")?,
                nodes: *fields.get("nodes")?,
            },
        })
    }

    fn render(&self) -> String {
        format!(
            "services={} endpoints={} nodes={}\n",
            self.services, self.shape.endpoints, self.shape.nodes
        )
    }

    /// Whether a run of `shape` whose smallest size is `smallest` can start from it: a Service
    /// more than a size holds would be measured as part of it.
    fn check(&self, shape: Shape, smallest: usize) -> Result<()> {
        if self.shape != shape {
            bail!(
                "bench e2e: the kept store holds {} endpoints per Service over {} Nodes, not {} over {}",
                self.shape.endpoints,
                self.shape.nodes,
                shape.endpoints,
                shape.nodes
            );
        }
        if self.services > smallest {
            bail!(
                "bench e2e: the kept store holds {} Services, more than the size {smallest}",
                self.services
            );
        }
        Ok(())
    }

    fn save(plane: &ControlPlane, dir: &Path, services: usize, shape: Shape) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        let _ = std::fs::remove_file(dir.join(Self::META));
        plane.save_store(&dir.join("etcd"))?;
        std::fs::write(dir.join(Self::META), KeptStore { services, shape }.render())?;
        Ok(())
    }
}

/// Fills the API server with `size` Services (the driver's `populate`, on the host) and returns
/// the list the guest reads.
pub(crate) fn populate(
    driver: &Path,
    plane: &ControlPlane,
    size: usize,
    shape: Shape,
    work: &Path,
) -> Result<PathBuf> {
    let list = work.join(format!("services-{size}.txt"));
    let mut populate = Command::new(driver);
    populate
        .arg("populate")
        .arg("--kubeconfig")
        .arg(plane.host_kubeconfig()?)
        .args(["--services", &size.to_string()])
        .args(shape.args())
        .arg("--out")
        .arg(&list);
    util::run(&mut populate).with_context(|| format!("populating {size} Services"))?;
    Ok(list)
}

/// The guest's side of `--net tap`: the address user networking gives it (the driver's node
/// IP), with the bridge's address, where kube-apiserver listens, as its gateway.
fn guest_tap() -> Tap {
    Tap {
        ifname: TAP.to_owned(),
        mac: "52:54:00:12:34:56".to_owned(),
        address: "10.0.2.15/24".to_owned(),
        gateway: vm::HOST_ALIAS.to_owned(),
    }
}

/// Whether `--net tap` can run here: checked before anything is built, and again just before
/// the namespace is made.
fn netns_check() -> Result<()> {
    if let Some(why) = netns::unavailable() {
        bail!("bench e2e --net tap: {why} (--net user needs neither)");
    }
    if netns::exists(NETNS) {
        bail!(
            "bench e2e --net tap: network namespace {NETNS} exists (another run holds it, or a \
             killed run left it: `ip netns pids {NETNS} | xargs -r kill -KILL; ip netns del {NETNS}`)"
        );
    }
    Ok(())
}

fn netns_down() {
    let _ = netns::down(NETNS);
}

/// Makes the bench's namespace: loopback, the bridge with [`vm::HOST_ALIAS`] and the guests'
/// tap on it. Removed at exit, also when a signal stops xtask.
fn netns_up() -> Result<()> {
    netns_check()?;
    netns::up(
        &netns::Bridged {
            name: NETNS,
            bridge: BRIDGE,
            address: format!("{}/24", vm::HOST_ALIAS),
            taps: vec![TAP.to_owned()],
            routes: Vec::new(),
        },
        netns_down,
    )
}

pub(crate) fn command(args: &[String]) -> Result<()> {
    let opts = parse_options(args)?;
    let outside = opts.net == Net::Tap && std::env::var_os(INSIDE_ENV).is_none();
    if outside {
        netns_check()?;
    }
    let tools = match crate::tools::ensure()? {
        Ok(t) => t,
        Err(crate::tools::Unavailable(why)) => bail!("bench e2e: {why}"),
    };
    let driver = release_build(DRIVER_PACKAGE, &["--example", DRIVER], DRIVER)?;
    let daemon = if opts
        .agents
        .iter()
        .any(|a| a == "kube-ipvs" || a == ROUTES_AGENT)
    {
        Some(release_build(
            "kube-ipvs",
            &["--bin", "kube-ipvs"],
            "kube-ipvs",
        )?)
    } else {
        None
    };
    if outside {
        // Built above, outside, with the VM's packages, kernel and base image: the namespace
        // has no route to the package registries.
        vm::prepare()?;
        netns_up()?;
        let mut inner = vec!["bench".to_owned(), "e2e".to_owned()];
        inner.extend_from_slice(args);
        let result = netns::run_inside(NETNS, INSIDE_ENV, &inner);
        netns_down();
        crate::reaper::forget_at_exit();
        return result;
    }
    let work = util::target_dir()?.join(format!("bench-e2e/{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let largest = opts.sizes.last().copied().unwrap_or_default();
    let shape = Shape {
        endpoints: opts.endpoints,
        nodes: opts.nodes,
    };
    let kept = match &opts.store {
        Some(dir) => KeptStore::read(dir)?,
        None => None,
    };
    if let Some(k) = &kept {
        k.check(shape, opts.sizes[0])?;
    }
    let store = match (&opts.store, &kept) {
        (Some(dir), Some(k)) => {
            eprintln!(
                "xtask: bench e2e: etcd starts on a copy of the kept store {} ({} Services)",
                dir.display(),
                k.services
            );
            Some(dir.join("etcd"))
        }
        _ => None,
    };
    match &opts.apiserver_memory_limit {
        Some(limit) => eprintln!(
            "xtask: bench e2e: kube-apiserver collects garbage only near {limit} (GOGC=off, \
             GOMEMLIMIT={limit}; --apiserver-memory-limit go for Go's default)"
        ),
        None => eprintln!("xtask: bench e2e: kube-apiserver with Go's default garbage collector"),
    }
    let plane = ControlPlane::start_for_bench(
        &tools,
        &work.join("control-plane"),
        store.as_deref(),
        opts.net == Net::Tap,
        apiserver_env(opts.apiserver_memory_limit.as_deref()),
    )?;
    plane.apply_rbac()?;
    // Saved once, after the largest size's first populate (before any agent changes a slice).
    let mut save_to = opts
        .store
        .as_deref()
        .filter(|_| kept.as_ref().map(|k| k.services) != Some(largest));
    let mut results = Vec::new();
    let mut failures = Vec::new();
    for &size in &opts.sizes {
        let updates = if size == largest { opts.updates } else { 0 };
        for agent in &opts.agents {
            // Before every agent, not once per size: it also puts back the endpoints the
            // previous agent's updates changed (each agent is timed until it holds the initial
            // ones; without this, an agent after one that ran updates waited forever at the
            // first updated Service).
            let list = populate(&driver, &plane, size, shape, &work)?;
            if size == largest
                && let Some(dir) = save_to.take()
            {
                let started = std::time::Instant::now();
                KeptStore::save(&plane, dir, largest, shape)?;
                eprintln!(
                    "xtask: bench e2e: kept the populated store in {} ({:.1} s)",
                    dir.display(),
                    started.elapsed().as_secs_f64()
                );
            }
            match run_agent(
                &opts,
                &plane,
                &driver,
                daemon.as_deref(),
                &tools.kube_proxy,
                agent,
                size,
                updates,
                &list,
            ) {
                Ok(r) => {
                    println!("{}", table(std::slice::from_ref(&r)));
                    results.push(r);
                }
                Err(e) => {
                    eprintln!("xtask: bench e2e: {agent} at {size} Services failed: {e:#}");
                    failures.push(format!("{agent} at {size}: {e:#}"));
                }
            }
        }
    }
    println!(
        "\nbench e2e ({} endpoints per Service over {} node(s); TCG guest, 2 vCPUs, {}; kube-proxy {}{}):\n{}",
        opts.endpoints,
        opts.nodes,
        opts.net.describe(),
        tools.kubernetes_version,
        if opts.no_estimation {
            "; IPVS rate estimator off in every guest"
        } else {
            ""
        },
        table(&results)
    );
    for dir in std::iter::once(work.join("charts")).chain(opts.charts.clone()) {
        for path in write_charts(&dir, &results)? {
            println!("xtask: bench e2e: chart {}", path.display());
        }
    }
    if !failures.is_empty() {
        bail!(
            "bench e2e: {} run(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(())
}

/// The charts of a run: convergence, update p99, peak RSS and the data path against the Service
/// count, one line per agent.
fn write_charts(dir: &Path, results: &[RunResult]) -> Result<Vec<PathBuf>> {
    type Figure = dyn Fn(&RunResult) -> Option<f64>;
    let series = |f: &Figure| -> Vec<charts::Series> {
        AGENTS
            .iter()
            .map(|agent| charts::Series {
                agent: (*agent).to_owned(),
                points: results
                    .iter()
                    .filter(|r| r.agent == *agent)
                    .filter_map(|r| f(r).map(|v| (r.services as f64, v)))
                    .collect(),
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    let specs: [(&str, &str, &str, &Figure); 4] = [
        (
            "converge.svg",
            "Converge from empty (agent start to every Service whole)",
            "seconds",
            &|r| Some(r.converge_ms as f64 / 1000.0),
        ),
        (
            "update-p99.svg",
            "EndpointSlice update to the kernel, p99",
            "milliseconds",
            &|r| percentile(&r.updates_us, 99.0).map(|v| v as f64 / 1000.0),
        ),
        ("rss.svg", "Peak RSS of the agent", "MiB", &|r| {
            Some(r.rss_kib as f64 / 1024.0)
        }),
        (
            "connect-p50.svg",
            "New connection to the last Service's ClusterIP, p50",
            "milliseconds",
            &|r| {
                r.datapath
                    .iter()
                    .find(|d| d.which == "last")
                    .map(|d| d.p50_us as f64 / 1000.0)
            },
        ),
    ];
    let mut written = Vec::new();
    for (file, title, unit, f) in specs {
        if let Some(path) = charts::write(dir, file, title, unit, &series(f))? {
            written.push(path);
        }
    }
    Ok(written)
}

#[allow(
    clippy::too_many_arguments,
    reason = "one run's settings, passed as the driver takes them"
)]
fn run_agent(
    opts: &Options,
    plane: &ControlPlane,
    driver: &Path,
    daemon: Option<&Path>,
    kube_proxy: &Path,
    agent: &str,
    size: usize,
    updates: usize,
    list: &Path,
) -> Result<RunResult> {
    // Generous: kube-proxy under TCG at 10,000 Services takes many minutes per full sync.
    let converge_timeout = opts.converge_timeout.unwrap_or(600 + size as u64 / 4);
    let mut args: Vec<String> = vec![
        "--updates".into(),
        updates.to_string(),
        "--update-budget".into(),
        opts.update_budget.to_string(),
        "--converge-timeout".into(),
        converge_timeout.to_string(),
        "--settle-timeout".into(),
        opts.settle_timeout.to_string(),
    ];
    args.extend(
        Shape {
            endpoints: opts.endpoints,
            nodes: opts.nodes,
        }
        .args(),
    );
    args.extend(["--datapath".into(), opts.datapath.to_string()]);
    if opts.no_estimation {
        args.push("--no-ipvs-rate-estimation".into());
    }
    for e in &opts.agent_env {
        args.extend(["--agent-env".into(), e.clone()]);
    }
    if updates > 0 && opts.churn_seconds > 0 {
        args.extend([
            "--churn-seconds".into(),
            opts.churn_seconds.to_string(),
            "--churn-rate".into(),
            opts.churn_rate.to_string(),
        ]);
    }
    let guest = GuestRun {
        plane,
        driver,
        agent_binary: match agent {
            "kube-ipvs" | ROUTES_AGENT => daemon.context("kube-ipvs was not built")?,
            _ => kube_proxy,
        },
        agent,
        list,
        memory_mib: opts.memory_mib,
        tap: (opts.net == Net::Tap).then(guest_tap),
    };
    // The driver's own limits (convergence, settling, the update budget) plus boot.
    let timeout =
        Duration::from_secs(converge_timeout + opts.settle_timeout + opts.update_budget + 600);
    let (lines, churn_started, threads) =
        guest.run_sampled(&format!("bench e2e {agent} {size}"), &args, timeout)?;
    let mut result = parse_result_line(result_line(&lines, RESULT_PREFIX)?)?;
    for line in &lines {
        if let Some(at) = line.find(DATAPATH_PREFIX) {
            result.datapath.push(parse_datapath_line(&line[at..])?);
        }
        if let Some(at) = line.find(CHURN_PREFIX) {
            result.churn = Some(parse_churn_line(&line[at..])?);
        }
    }
    if opts.datapath > 0 && result.datapath.is_empty() {
        bail!("the driver printed no {DATAPATH_PREFIX}line");
    }
    result.host_waits = churn_started
        .zip(result.churn.as_ref())
        .and_then(|(start, churn)| churn_host_waits(start, churn, &threads));
    Ok(result)
}

/// One VM running the driver in `guest` mode against the host's control plane.
pub(crate) struct GuestRun<'a> {
    pub(crate) plane: &'a ControlPlane,
    pub(crate) driver: &'a Path,
    /// The host binary installed as the agent.
    pub(crate) agent_binary: &'a Path,
    pub(crate) agent: &'a str,
    /// The `populate --out` list.
    pub(crate) list: &'a Path,
    pub(crate) memory_mib: u32,
    /// The guest's network on this tap device (xtask runs in the device's namespace);
    /// `None`: QEMU's user networking with the API server's port forwarded.
    pub(crate) tap: Option<Tap>,
}

impl GuestRun<'_> {
    /// Runs the driver with `extra` after the common arguments and returns the console lines;
    /// fails unless the driver exited 0.
    pub(crate) fn run(
        &self,
        name: &str,
        extra: &[String],
        timeout: Duration,
    ) -> Result<Vec<String>> {
        let outcome = self.boot(name, extra, timeout, false)?;
        Ok(outcome.lines.into_iter().map(|(_, l)| l).collect())
    }

    /// [`GuestRun::run`], with QEMU's threads sampled on the host ([`vm::Job::sample_threads`])
    /// and, on their clock, when the driver's churn started, if it churned.
    fn run_sampled(
        &self,
        name: &str,
        extra: &[String],
        timeout: Duration,
    ) -> Result<(Vec<String>, Option<Duration>, Vec<vm::ThreadSample>)> {
        let outcome = self.boot(name, extra, timeout, true)?;
        let started = outcome.first(CHURN_STARTED);
        let lines = outcome.lines.into_iter().map(|(_, l)| l).collect();
        Ok((lines, started, outcome.thread_samples))
    }

    fn boot(
        &self,
        name: &str,
        extra: &[String],
        timeout: Duration,
        sample_threads: bool,
    ) -> Result<vm::Outcome> {
        let mut args: Vec<String> = vec![
            "guest".into(),
            "--agent".into(),
            self.agent.into(),
            "--services-file".into(),
            GUEST_SERVICES.into(),
            "--kubeconfig".into(),
            format!("{GUEST_DIR}/admin-direct.kubeconfig"),
        ];
        args.extend_from_slice(extra);
        let mut script = format!("exec /usr/local/bin/{DRIVER}");
        for arg in &args {
            script.push(' ');
            script.push_str(&shell_quote(arg));
        }
        script.push('\n');
        let mut job = Job::new(name, script);
        job.executables.push(GuestFile {
            host: self.driver.to_owned(),
            guest: PathBuf::from(format!("/usr/local/bin/{DRIVER}")),
        });
        // Every kube-proxy mode is the one kube-proxy binary.
        let guest = match self.agent {
            "kube-ipvs" | ROUTES_AGENT => "/usr/local/bin/kube-ipvs",
            _ => "/usr/local/bin/kube-proxy",
        };
        job.executables.push(GuestFile {
            host: self.agent_binary.to_owned(),
            guest: PathBuf::from(guest),
        });
        job.data.extend(self.plane.guest_files()?);
        job.data.push((
            GUEST_SERVICES.to_owned(),
            std::fs::read(self.list).with_context(|| format!("reading {}", self.list.display()))?,
        ));
        // (The base image carries /etc/protocols, which kube-proxy's ipset needs: vm.rs.)
        match &self.tap {
            Some(tap) => job.tap = Some(tap.clone()),
            None => job.forward_ports.push(self.plane.port),
        }
        job.memory_mib = self.memory_mib;
        job.timeout = timeout;
        job.sample_threads = sample_threads;
        let outcome = vm::run(&job)?;
        eprintln!(
            "xtask: {} took {} (console log {})",
            job.name,
            secs(outcome.elapsed),
            outcome.log.display()
        );
        if let Some(why) = outcome.failure() {
            bail!("{why}");
        }
        if outcome.guest_rc != Some(0) {
            bail!("the driver exited with {:?}", outcome.guest_rc);
        }
        Ok(outcome)
    }
}

/// The first console line holding `prefix`, from the prefix on.
pub(crate) fn result_line<'a>(lines: &'a [String], prefix: &str) -> Result<&'a str> {
    lines
        .iter()
        .find_map(|l| l.find(prefix).map(|at| &l[at..]))
        .with_context(|| format!("the driver printed no {} line", prefix.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_store_names_what_it_holds_and_refuses_other_shapes_and_smaller_sizes() {
        let spread = Shape {
            endpoints: 10,
            nodes: 100,
        };
        let kept = KeptStore {
            services: 50_000,
            shape: spread,
        };
        assert_eq!(KeptStore::parse(&kept.render()), Some(kept));
        assert_eq!(KeptStore::parse("services=5 endpoints=x nodes=1"), None);
        assert_eq!(KeptStore::parse("services=5 nodes=1"), None);
        assert!(kept.check(spread, 50_000).is_ok());
        // A size below what the store holds would measure the extra Services too.
        let err = kept.check(spread, 10_000).unwrap_err().to_string();
        assert!(err.contains("50000 Services"), "{err}");
        let err = kept.check(Shape::LOCAL, 50_000).unwrap_err().to_string();
        assert!(
            err.contains("10 endpoints per Service over 100 Nodes"),
            "{err}"
        );
    }

    const LINE: &str = "E2E-RESULT agent=kube-ipvs services=1000 endpoints=10 converge_ms=5230 \
        converge_err_ms=110 full_read_ms=340 cpu_converge_s=1.50 settle_ms=2100 settled=true updates_requested=4 \
        update_timeouts=0 warmup_us=25000 updates_us=900,1200,15000,3000 patch_us=500,600,700,800 \
        cpu_s=3.25 rss_kib=51200";

    #[test]
    fn a_result_line_parses_with_console_noise_trimmed() -> Result<()> {
        let r = parse_result_line(&format!("{LINE}\r"))?;
        assert_eq!(r.agent, "kube-ipvs");
        assert_eq!((r.services, r.endpoints), (1000, 10));
        assert_eq!(
            (r.converge_ms, r.converge_err_ms, r.full_read_ms),
            (5230, 110, 340)
        );
        assert_eq!(r.updates_us, vec![900, 1200, 15000, 3000]);
        assert_eq!(r.patch_us, vec![500, 600, 700, 800]);
        assert_eq!(r.warmup_us, Some(25000));
        // Lines from before the warm-up, and a warm-up that timed out.
        let old = parse_result_line(&LINE.replace(" warmup_us=25000", ""))?;
        let lost = parse_result_line(&LINE.replace("warmup_us=25000", "warmup_us=-"))?;
        assert_eq!((old.warmup_us, lost.warmup_us), (None, None));
        assert!(parse_result_line(&LINE.replace("warmup_us=25000", "warmup_us=x")).is_err());
        assert!((r.cpu_converge_s - 1.5).abs() < 1e-9);
        assert_eq!((r.settle_ms, r.settled), (2100, true));
        assert_eq!((r.updates_requested, r.update_timeouts), (4, 0));
        assert!((r.cpu_s - 3.25).abs() < 1e-9);
        assert_eq!(r.rss_kib, 51200);
        Ok(())
    }

    #[test]
    fn no_updates_is_a_dash_and_bad_lines_name_the_field() -> Result<()> {
        let r = parse_result_line(&LINE.replace("900,1200,15000,3000", "-"))?;
        assert!(r.updates_us.is_empty());
        let err = parse_result_line(&LINE.replace("cpu_s=3.25", "cpu_s=lots"))
            .err()
            .context("a bad number parsed")?;
        assert!(format!("{err:#}").contains("cpu_s"), "{err:#}");
        let err = parse_result_line(&LINE.replace(" rss_kib=51200", ""))
            .err()
            .context("a missing field parsed")?;
        assert!(format!("{err:#}").contains("rss_kib"), "{err:#}");
        assert!(parse_result_line("agent=kube-ipvs").is_err());
        Ok(())
    }

    /// The ratio column of a table row.
    fn last_cell(row: &str) -> &str {
        row.trim_end()
            .trim_end_matches('|')
            .rsplit('|')
            .next()
            .unwrap_or_default()
            .trim()
    }

    #[test]
    fn data_path_lines_fill_the_connection_rows() -> Result<()> {
        let mut r = parse_result_line(LINE)?;
        for (which, p50) in [("first", 400), ("middle", 420), ("last", 900)] {
            r.datapath.push(parse_datapath_line(&format!(
                "E2E-DATAPATH agent=kube-ipvs services=1000 which={which} index=0 \
                 target=10.96.0.5:80 conns=300 failed=0 p50_us={p50} p99_us=2000 rate=1500.0"
            ))?);
        }
        let text = table(&[r]);
        let row = text
            .lines()
            .find(|l| l.contains("new connection p50"))
            .context("no data path row")?;
        assert!(row.contains("0.40 / 0.42 / 0.90 ms"), "{row}");
        assert!(parse_datapath_line("E2E-DATAPATH which=last conns=x").is_err());
        let churn = parse_churn_line(
            "E2E-CHURN agent=kube-ipvs services=1000 rate=50 seconds=60 sent=3000 timeouts=1 \
             superseded=0 errors=0 updates_us=1000,2000,30000",
        )?;
        assert_eq!(
            (churn.sent, churn.timeouts, churn.updates_us.len()),
            (3000, 1, 3)
        );
        // A line from before the send times has none.
        assert!(churn.sent_us.is_empty());
        Ok(())
    }

    /// QEMU's threads every 10 ms for 2 s: two vCPUs running 8 ms in each 10, and each waiting
    /// 5 ms in each 10 from 1.0 s to 1.2 s; a third thread that barely runs.
    fn waiting_guest() -> Vec<vm::ThreadSample> {
        (0..=200u64)
            .map(|k| {
                let waited = k.clamp(100, 120) - 100;
                let vcpu = |tid| (tid, k * 8_000_000, waited * 5_000_000);
                vm::ThreadSample {
                    at: Duration::from_millis(k * 10),
                    threads: vec![vcpu(1), vcpu(2), (3, k * 10_000, 0)],
                }
            })
            .collect()
    }

    #[test]
    fn host_waits_fall_on_the_updates_in_flight_while_the_guest_waited() -> Result<()> {
        // The churn starts at 0.5 s: the slow update is in flight from 1.0 to 1.1 s, while
        // both vCPUs wait half the time; the others, at 0.5 s and 1.7 s, while none do.
        let churn = parse_churn_line(
            "E2E-CHURN agent=kube-ipvs services=10 rate=50 seconds=2 sent=3 timeouts=0 \
             superseded=0 errors=0 check_us=700 max_pending=2 updates_us=100000,10000,10000 \
             patch_us=9000,9000,9000 sent_us=500000,0,1200000",
        )?;
        let start = Duration::from_millis(500);
        let h = churn_host_waits(start, &churn, &waiting_guest()).context("no waits")?;
        assert_eq!(h.slow, 1);
        // 50 ms each of the two vCPUs during its 100 ms.
        assert!(
            (h.slow_rate.context("no slow rate")? - 1.0).abs() < 1e-9,
            "{h:?}"
        );
        assert_eq!(h.other_rate, Some(0.0));
        // The vCPUs, not the third thread, over the churn (0.5 s to 1.71 s): 121 periods.
        assert_eq!(h.run_ns, [121 * 8_000_000, 121 * 8_000_000]);
        assert_eq!(h.wait_ns, [20 * 5_000_000, 20 * 5_000_000]);
        // A driver from before the send times, or no samples: nothing to say.
        let old = ChurnRun {
            sent_us: Vec::new(),
            ..churn.clone()
        };
        assert_eq!(churn_host_waits(start, &old, &waiting_guest()), None);
        assert_eq!(churn_host_waits(start, &churn, &[]), None);
        Ok(())
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples: Vec<u64> = (1..=100).rev().collect();
        assert_eq!(percentile(&samples, 50.0), Some(50));
        assert_eq!(percentile(&samples, 99.0), Some(99));
        assert_eq!(percentile(&samples, 100.0), Some(100));
        assert_eq!(percentile(&[7, 3], 50.0), Some(3));
        assert_eq!(percentile(&[7, 3], 99.0), Some(7));
        assert_eq!(percentile(&[5], 0.0), Some(5));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn the_table_puts_agents_side_by_side_with_proxy_over_ipvs_ratios() -> Result<()> {
        let ipvs = parse_result_line(LINE)?;
        let proxy = parse_result_line(
            &LINE
                .replace("agent=kube-ipvs", "agent=kube-proxy-ipvs")
                .replace("converge_ms=5230", "converge_ms=52300")
                .replace("rss_kib=51200", "rss_kib=153600"),
        )?;
        let nft = parse_result_line(
            &LINE
                .replace("agent=kube-ipvs", "agent=kube-proxy-nftables")
                .replace("converge_ms=5230", "converge_ms=10460"),
        )?;
        let text = table(&[nft, proxy, ipvs]);
        let header = text.lines().next().context("no header")?;
        let columns: Vec<&str> = header.split('|').map(str::trim).collect();
        assert_eq!(
            columns[3..7],
            [
                "kube-ipvs",
                "kube-proxy-ipvs",
                "kube-proxy-nftables",
                "kube-proxy-ipvs / kube-ipvs"
            ],
            "{header}"
        );
        let converge = text
            .lines()
            .find(|l| l.contains("converge"))
            .context("no converge row")?;
        assert!(converge.contains("5.23 s"), "{converge}");
        assert!(converge.contains("52.30 s"), "{converge}");
        let cells: Vec<&str> = converge.split('|').map(str::trim).collect();
        assert_eq!(cells[6..8], ["10.0x", "2.0x"], "{converge}");
        assert_eq!(last_cell(converge), "2.0x", "{converge}");
        let rss = text
            .lines()
            .find(|l| l.contains("peak RSS"))
            .context("no RSS row")?;
        assert!(
            rss.contains("50.0 MiB") && rss.contains("150.0 MiB"),
            "{rss}"
        );
        assert!(rss.contains("3.0x"), "{rss}");
        Ok(())
    }

    #[test]
    fn a_missing_agent_leaves_dashes_not_ratios() -> Result<()> {
        let text = table(&[parse_result_line(
            &LINE.replace("agent=kube-ipvs", "agent=kube-proxy-iptables"),
        )?]);
        let converge = text
            .lines()
            .find(|l| l.contains("converge"))
            .context("no converge row")?;
        assert_eq!(last_cell(converge), "-", "{converge}");
        Ok(())
    }

    #[test]
    fn options_sort_sizes_and_reject_unknown_agents() -> Result<()> {
        let args = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        let o = parse_options(&args(
            "--sizes 5000,1000 --updates 7 --agents kube-proxy,kube-proxy-iptables,kube-proxy-ipvs",
        ))?;
        assert_eq!(o.sizes, vec![1000, 5000]);
        assert_eq!(o.updates, 7);
        // The old name is the IPVS mode, once.
        assert_eq!(
            o.agents,
            vec![
                "kube-proxy-ipvs".to_owned(),
                "kube-proxy-iptables".to_owned()
            ]
        );
        assert_eq!(parse_options(&[])?.agents.len(), 4);
        assert!(parse_options(&args("--agents cilium")).is_err());
        assert!(parse_options(&args("--sizes 0")).is_err());
        assert!(parse_options(&args("--updates")).is_err());
        let o = parse_options(&args("--settle-timeout 120 --converge-timeout 900"))?;
        assert_eq!((o.settle_timeout, o.converge_timeout), (120, Some(900)));
        assert_eq!(parse_options(&[])?.converge_timeout, None);
        // The one flag without a value, anywhere among the others.
        let o = parse_options(&args("--updates 3 --no-ipvs-rate-estimation --sizes 10"))?;
        assert!(o.no_estimation && o.updates == 3 && o.sizes == vec![10]);
        assert!(!parse_options(&[])?.no_estimation);
        let o = parse_options(&args("--store /tmp/kept-50000"))?;
        assert_eq!(o.store, Some(PathBuf::from("/tmp/kept-50000")));
        assert_eq!(parse_options(&[])?.store, None);
        assert_eq!(parse_options(&[])?.net, Net::Tap);
        assert_eq!(parse_options(&args("--net tap"))?.net, Net::Tap);
        assert_eq!(parse_options(&args("--net user"))?.net, Net::User);
        let err = parse_options(&args("--net bridge"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--net \"bridge\": user or tap"), "{err}");
        let o = parse_options(&args(
            "--agent-env KUBE_FEATURE_WatchListClient=false --agent-env A=1",
        ))?;
        assert_eq!(o.agent_env, ["KUBE_FEATURE_WatchListClient=false", "A=1"]);
        assert!(parse_options(&[])?.agent_env.is_empty());
        for bad in ["NOEQUALS", "=v", "1A=v", "A-B=v", "A=\0"] {
            let err = parse_options(&["--agent-env".into(), bad.into()])
                .expect_err(bad)
                .to_string();
            assert!(err.contains("--agent-env"), "{bad}: {err}");
        }
        Ok(())
    }

    #[test]
    fn the_api_servers_collector_is_gos_unless_given_a_memory_limit() -> Result<()> {
        let args = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(parse_options(&[])?.apiserver_memory_limit, None);
        let go = parse_options(&args("--apiserver-memory-limit go"))?;
        assert!(apiserver_env(go.apiserver_memory_limit.as_deref()).is_empty());
        let o = parse_options(&args("--apiserver-memory-limit 6GiB"))?;
        assert_eq!(
            apiserver_env(o.apiserver_memory_limit.as_deref()),
            [
                ("GOGC".to_owned(), "off".to_owned()),
                ("GOMEMLIMIT".to_owned(), "6GiB".to_owned())
            ]
        );
        for bad in ["", "6", "GiB", "6GB", "6 GiB", "-1GiB", "6gib", "off"] {
            let err = parse_options(&["--apiserver-memory-limit".into(), bad.into()])
                .expect_err(bad)
                .to_string();
            assert!(err.contains("--apiserver-memory-limit"), "{bad:?}: {err}");
        }
        Ok(())
    }
}
