//! `cargo xtask bench {netlink,dump,datapath,diff,watch}`.
//!
//! `netlink`, `dump` and `datapath` need a kernel with IPVS, so they ship release builds into the
//! VM: `ipvs-bench` of `kube-ipvs-netlink`; `dump-bench` of `kube-ipvs` together with the
//! release `kube-ipvs` binary it compares with `ipvsadm`; `datapath` runs
//! `integration/bench/datapath-cost.sh` with the release `kube-ipvs`, the `e2e-bench` example
//! (its data path's client and server) and the host's `perf`, and sums up its blocks. The others
//! are plain `cargo bench` runs.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{self, shell_quote};
use crate::vm::{self, GuestFile, Job};
use crate::vmtest::cargo_executables;

const NETLINK_PACKAGE: &str = "kube-ipvs-netlink";
const NETLINK_EXAMPLE: &str = "ipvs-bench";
const NETLINK_DEFAULT_ARGS: &[&str] = &["--services", "10000", "--dests", "10"];
const DUMP_PACKAGE: &str = "kube-ipvs";
const DUMP_EXAMPLE: &str = "dump-bench";
/// The data-path scripts' namespaces (`make_nodes`), put before `DATAPATH_SCRIPT`.
const NODES_SCRIPT: &str = include_str!("../../integration/bench/nodes.sh");
const DATAPATH_SCRIPT: &str = include_str!("../../integration/bench/datapath-cost.sh");
const ESTIMATOR_SCRIPT: &str = include_str!("../../integration/bench/estimator-cost.sh");
const BINDING_SCRIPT: &str = include_str!("../../integration/bench/binding-startup.sh");

pub(crate) fn command(args: &[String]) -> Result<()> {
    let usage = "usage: cargo xtask bench netlink [-- ARGS] | bench dump [-- ARGS] | bench datapath [--size N] [--count N] [--no-perf] | bench estimator [--services N] [--endpoints E] [--probes N] | bench binding [--sizes N,..] [--endpoints E] | bench diff [ARGS] | bench watch [ARGS] | bench e2e [--sizes N,..] [--updates U] [--agents A,..] | bench soak [--minutes M] [--services N] [--rate R]";
    let (which, rest) = args.split_first().context(usage)?;
    // `--` separates our arguments from the benchmark's; accept it with or without.
    let rest: Vec<String> = match rest.split_first() {
        Some((sep, tail)) if sep == "--" => tail.to_vec(),
        _ => rest.to_vec(),
    };
    match which.as_str() {
        "netlink" => netlink(&rest),
        "dump" => dump(&rest),
        "datapath" => datapath(&rest),
        "estimator" => estimator(&rest),
        "binding" => binding(&rest),
        "diff" => cargo_bench("kube-ipvs-diff", &rest),
        "watch" => cargo_bench("kube-ipvs-watch", &rest),
        "e2e" => crate::bench_e2e::command(&rest),
        "soak" => crate::soak::command(&rest),
        other => bail!("unknown benchmark {other:?}; {usage}"),
    }
}

fn cargo_bench(package: &str, args: &[String]) -> Result<()> {
    let mut cmd = util::cargo_cmd();
    cmd.args(["bench", "-p", package]);
    if !args.is_empty() {
        cmd.arg("--").args(args);
    }
    util::run(&mut cmd)
}

/// Whether the netlink crate has the example yet (another engineer writes it); checked before
/// building so the message says what is missing instead of showing a cargo error.
fn example_exists() -> Result<bool> {
    let text =
        util::output(util::cargo_cmd().args(["metadata", "--format-version", "1", "--no-deps"]))?;
    let meta: serde_json::Value = serde_json::from_str(&text).context("parsing cargo metadata")?;
    Ok(meta["packages"].as_array().into_iter().flatten().any(|p| {
        p["name"] == NETLINK_PACKAGE
            && p["targets"].as_array().into_iter().flatten().any(|t| {
                t["name"] == NETLINK_EXAMPLE
                    && t["kind"]
                        .as_array()
                        .is_some_and(|k| k.iter().any(|k| k == "example"))
            })
    }))
}

fn netlink(args: &[String]) -> Result<()> {
    if !example_exists()? {
        bail!(
            "bench netlink: package {NETLINK_PACKAGE} has no example `{NETLINK_EXAMPLE}` yet \
             (crates/netlink/examples/{NETLINK_EXAMPLE}.rs); nothing to run"
        );
    }
    let exe = release_executable(
        NETLINK_PACKAGE,
        &["--example", NETLINK_EXAMPLE],
        NETLINK_EXAMPLE,
    )?;
    let args: Vec<String> = if args.is_empty() {
        NETLINK_DEFAULT_ARGS
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    } else {
        args.to_vec()
    };
    let job = bench_job(
        "bench netlink",
        exec_script(NETLINK_EXAMPLE, &args),
        4096,
        vec![(exe, NETLINK_EXAMPLE)],
    );
    run_in_guest(&job).map(drop)
}

/// `kube-ipvs dump` against `ipvsadm -Ln` on a 10,000 x 10 table: ships the `dump-bench` example
/// and the release `kube-ipvs` binary.
fn dump(args: &[String]) -> Result<()> {
    let bench = release_executable(DUMP_PACKAGE, &["--example", DUMP_EXAMPLE], DUMP_EXAMPLE)?;
    let daemon = release_executable(DUMP_PACKAGE, &["--bin", "kube-ipvs"], "kube-ipvs")?;
    let job = bench_job(
        "bench dump",
        exec_script(DUMP_EXAMPLE, args),
        4096,
        vec![(bench, DUMP_EXAMPLE), (daemon, "kube-ipvs")],
    );
    run_in_guest(&job).map(drop)
}

/// The guest script that runs `/usr/local/bin/{program}` with `args`, each quoted.
fn exec_script(program: &str, args: &[String]) -> String {
    let mut script = format!("exec /usr/local/bin/{program}");
    for arg in args {
        script.push(' ');
        script.push_str(&shell_quote(arg));
    }
    script.push('\n');
    script
}

/// A benchmark's guest: `memory_mib` of memory, an hour at most, and each of `programs` (a
/// host executable and its name) installed as `/usr/local/bin/NAME`.
fn bench_job(name: &str, script: String, memory_mib: u32, programs: Vec<(PathBuf, &str)>) -> Job {
    let mut job = Job::new(name, script);
    for (host, program) in programs {
        job.executables.push(GuestFile {
            host,
            guest: PathBuf::from(format!("/usr/local/bin/{program}")),
        });
    }
    job.memory_mib = memory_mib;
    job.timeout = Duration::from_secs(3600);
    job
}

/// Boots the benchmark's guest; fails unless it booted and its script exited 0.
fn run_in_guest(job: &Job) -> Result<vm::Outcome> {
    let outcome = vm::run(job)?;
    eprintln!("xtask: console log in {}", outcome.log.display());
    if let Some(why) = outcome.failure() {
        bail!("{}: {why}", job.name);
    }
    if outcome.guest_rc != Some(0) {
        bail!(
            "{}: the guest's script exited with {:?}",
            job.name,
            outcome.guest_rc
        );
    }
    Ok(outcome)
}

/// A release build of one target of `package` (`what`: `--bin NAME` or `--example NAME`).
fn release_executable(package: &str, what: &[&str], name: &str) -> Result<PathBuf> {
    let mut cargo_args = vec!["build", "--release", "-p", package];
    cargo_args.extend_from_slice(what);
    let built = cargo_executables(&cargo_args, |m| m["target"]["name"] == name)?;
    built
        .into_iter()
        .next()
        .map(|(_, exe)| exe)
        .with_context(|| format!("cargo build produced no {name} executable"))
}

/// `bench datapath [--size N] [--count N] [--no-perf]`: a new connection through kube-ipvs's
/// ClusterIP against kube-proxy's nftables table, reduced nftables and iptables rules and IPVS
/// alone, in one guest with a node namespace per proxy, connection by connection
/// (`integration/bench/datapath-cost.sh` says how); prints the ratios of each block.
fn datapath(args: &[String]) -> Result<()> {
    let (mut size, mut count, mut perf) = (10_000u32, 3_000u32, true);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--size" => size = vm::parse_next(&mut it, "--size")?,
            "--count" => count = vm::parse_next(&mut it, "--count")?,
            "--no-perf" => perf = false,
            other => bail!("bench datapath: unknown argument {other:?}"),
        }
    }
    if !(2..=50_000).contains(&size) {
        bail!("bench datapath: --size must be 2 to 50000 (one /16 of ClusterIPs per path)");
    }
    if count == 0 {
        bail!("bench datapath: --count must be at least 1");
    }
    let agent = release_executable("kube-ipvs", &["--bin", "kube-ipvs"], "kube-ipvs")?;
    let client = release_executable(
        "kube-ipvs-integration",
        &["--example", "e2e-bench"],
        "e2e-bench",
    )?;
    let script = format!("SIZE={size}\nCOUNT={count}\n{NODES_SCRIPT}\n{DATAPATH_SCRIPT}");
    let mut programs = vec![(agent, "kube-ipvs"), (client, "e2e-bench")];
    match util::which("perf") {
        Some(host) if perf => programs.push((host, "perf")),
        _ => eprintln!("xtask: bench datapath without perf (no profiles)"),
    }
    let job = bench_job("bench datapath", script, 3072, programs);
    let outcome = run_in_guest(&job)?;
    let lines: Vec<&str> = outcome.lines.iter().map(|(_, l)| l.as_str()).collect();
    print!("{}", datapath_summary(&lines)?);
    Ok(())
}

/// `bench estimator`: `integration/bench/estimator-cost.sh` in a guest with the release
/// e2e-bench (its `ipvs-probe`); prints the script's `KERNEL`, `TABLE`, `WALK` and `BLOCK`
/// lines.
fn estimator(args: &[String]) -> Result<()> {
    let (mut services, mut endpoints, mut probes) = (10_000u32, 10u32, 100_000u32);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--services" => services = vm::parse_next(&mut it, "--services")?,
            "--endpoints" => endpoints = vm::parse_next(&mut it, "--endpoints")?,
            "--probes" => probes = vm::parse_next(&mut it, "--probes")?,
            other => bail!("bench estimator: unknown argument {other:?}"),
        }
    }
    // One /16 of virtual addresses (10.97.x.y); real server j of Service i is
    // 10.(128 + j / 256).(j % 256).(i % 256), so Services 256 apart share real servers.
    if !(1..=65_536).contains(&services) || !(1..=1_000).contains(&endpoints) || probes == 0 {
        bail!("bench estimator: --services 1 to 65536, --endpoints 1 to 1000, --probes at least 1");
    }
    let probe = release_executable(
        "kube-ipvs-integration",
        &["--example", "e2e-bench"],
        "e2e-bench",
    )?;
    let script =
        format!("SERVICES={services}\nENDPOINTS={endpoints}\nPROBES={probes}\n{ESTIMATOR_SCRIPT}");
    let job = bench_job("bench estimator", script, 3072, vec![(probe, "e2e-bench")]);
    let outcome = run_in_guest(&job)?;
    for (_, line) in &outcome.lines {
        if ["KERNEL ", "TABLE ", "WALK ", "BLOCK "]
            .iter()
            .any(|p| line.starts_with(p))
        {
            println!("{line}");
        }
    }
    Ok(())
}

/// `bench binding`: `integration/bench/binding-startup.sh` in a 6 GiB guest with the release
/// `kube-ipvs`: its startup at each size with the ClusterIPs bound as addresses and as local
/// routes, each in a fresh network namespace, and the move of a node from one to the other;
/// prints the script's `STARTUP` and `MOVE` lines.
fn binding(args: &[String]) -> Result<()> {
    let (mut sizes, mut endpoints) = (vec![10_000u32, 50_000], 10u32);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--sizes" => {
                let list: String = vm::parse_next(&mut it, "--sizes")?;
                sizes = list
                    .split(',')
                    .map(|n| n.trim().parse::<u32>())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("bench binding: --sizes {list:?}"))?;
            }
            "--endpoints" => endpoints = vm::parse_next(&mut it, "--endpoints")?,
            other => bail!("bench binding: unknown argument {other:?}"),
        }
    }
    // ClusterIPs in 10.96.0.0/12 (16 x 65,536); endpoint j of each Service in 10.(128 + j)/16.
    if sizes.is_empty() || sizes.iter().any(|n| !(1..=1_000_000).contains(n)) {
        bail!("bench binding: each of --sizes must be 1 to 1000000");
    }
    if !(1..=100).contains(&endpoints) {
        bail!("bench binding: --endpoints must be 1 to 100");
    }
    let agent = release_executable("kube-ipvs", &["--bin", "kube-ipvs"], "kube-ipvs")?;
    let list: Vec<String> = sizes.iter().map(u32::to_string).collect();
    let script = format!(
        "SIZES={}\nENDPOINTS={endpoints}\n{BINDING_SCRIPT}",
        list.join(",")
    );
    let job = bench_job("bench binding", script, 6144, vec![(agent, "kube-ipvs")]);
    let outcome = run_in_guest(&job)?;
    for (_, line) in &outcome.lines {
        if ["STARTUP", "MOVE "].iter().any(|p| line.starts_with(p)) || line.contains("-cloud-") {
            println!("{line}");
        }
    }
    Ok(())
}

/// One block's p50, p99 (microseconds) and failed connections by path name.
type Block<'a> = BTreeMap<&'a str, (u64, u64, u64)>;

/// The blocks of `datapath-cost.sh`'s output (`PATH NAME ADDR:PORT` names each target,
/// `STEP BLOCK DATAPATH-TARGET target=ADDR:PORT ... failed=N p50_us=N p99_us=N ...` measures
/// it), one line each: every path's p50 (p99), its failed connections if any, and the IPVS
/// path's (kube-ipvs, or IPVS alone before the agent) ratios to the rule paths. A block in
/// which a path never connected is an error: its ratios would mean nothing.
fn datapath_summary(lines: &[&str]) -> Result<String> {
    let mut paths: BTreeMap<&str, &str> = BTreeMap::new();
    let mut blocks: Vec<(&str, Block<'_>)> = Vec::new();
    for line in lines {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("PATH") => {
                if let (Some(name), Some(target)) = (words.next(), words.next()) {
                    paths.insert(target, name);
                }
            }
            Some("STEP") => {
                let block = words.next().context("a STEP line without its block")?;
                let field = |key: &str| {
                    line.split_whitespace()
                        .find_map(|w| w.strip_prefix(key))
                        .with_context(|| format!("{line:?} has no {key}"))
                };
                let target = field("target=")?;
                let name = *paths
                    .get(target)
                    .with_context(|| format!("{target} is not a named PATH"))?;
                let p50: u64 = field("p50_us=")?.parse().context("p50_us")?;
                let p99: u64 = field("p99_us=")?.parse().context("p99_us")?;
                let failed: u64 = field("failed=")?.parse().context("failed")?;
                let conns: u64 = field("conns=")?.parse().context("conns")?;
                if failed >= conns {
                    bail!("bench datapath: every connection to {name} failed in {block}");
                }
                if blocks.last().is_none_or(|(b, _)| *b != block) {
                    blocks.push((block, BTreeMap::new()));
                }
                if let Some((_, m)) = blocks.last_mut() {
                    m.insert(name, (p50, p99, failed));
                }
            }
            _ => {}
        }
    }
    if blocks.is_empty() {
        bail!("bench datapath: no measurement in the output");
    }
    let mut out = String::from(
        "bench datapath: new-connection p50 (p99) in ms, one client, each path in turn\n",
    );
    for (block, m) in &blocks {
        let _ = write!(out, "{block}:");
        for (name, (p50, p99, failed)) in m {
            let _ = write!(out, " {name} {:.2} ({:.1})", ms(*p50), ms(*p99));
            if *failed > 0 {
                let _ = write!(out, " [{failed} failed]");
            }
        }
        let ipvs = ["kube-ipvs", "ipvs-alone"]
            .into_iter()
            .find_map(|n| m.get(n).map(|v| (n, v.0)));
        for other in ["nftables", "nftables-min", "iptables"] {
            if let (Some((n, k)), Some((o, _, _))) = (ipvs, m.get(other)) {
                let _ = write!(out, "; {n}/{other} {:.2}", k as f64 / (*o).max(1) as f64);
            }
        }
        out.push('\n');
    }
    Ok(out)
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exec_script_quotes_each_argument() {
        let args = [
            "--services".to_owned(),
            "10000".to_owned(),
            "a b'c".to_owned(),
        ];
        assert_eq!(
            exec_script("ipvs-bench", &args),
            "exec /usr/local/bin/ipvs-bench --services 10000 'a b'\\''c'\n"
        );
    }

    #[test]
    fn the_datapath_summary_names_paths_and_divides_by_the_peers() -> Result<()> {
        let out = datapath_summary(&[
            "PATH direct 10.244.0.10:8080",
            "PATH kube-ipvs 10.96.0.10:80",
            "PATH nftables 10.98.39.15:80",
            "PATH iptables 10.99.39.15:80",
            "PATH nftables-min 10.102.39.15:80",
            "noise from the guest",
            "STEP agent-running DATAPATH-TARGET target=10.244.0.10:8080 conns=3000 failed=0 p50_us=1000 p99_us=3000 rate=700.0",
            "STEP agent-running DATAPATH-TARGET target=10.96.0.10:80 conns=3000 failed=0 p50_us=1200 p99_us=4000 rate=600.0",
            "STEP agent-running DATAPATH-TARGET target=10.98.39.15:80 conns=3000 failed=0 p50_us=1000 p99_us=3500 rate=650.0",
            "STEP agent-running DATAPATH-TARGET target=10.99.39.15:80 conns=3000 failed=2 p50_us=4800 p99_us=9000 rate=200.0",
            "STEP agent-running DATAPATH-TARGET target=10.102.39.15:80 conns=3000 failed=0 p50_us=960 p99_us=3000 rate=660.0",
            "PATH ipvs-alone 10.100.0.10:80",
            "STEP before DATAPATH-TARGET target=10.100.0.10:80 conns=10 failed=0 p50_us=1100 p99_us=2000 rate=600.0",
            "STEP before DATAPATH-TARGET target=10.98.39.15:80 conns=10 failed=0 p50_us=1000 p99_us=2000 rate=600.0",
        ])?;
        assert_eq!(
            out.lines().nth(1),
            Some(
                "agent-running: direct 1.00 (3.0) iptables 4.80 (9.0) [2 failed] kube-ipvs 1.20 (4.0) nftables 1.00 (3.5) nftables-min 0.96 (3.0); kube-ipvs/nftables 1.20; kube-ipvs/nftables-min 1.25; kube-ipvs/iptables 0.25"
            )
        );
        assert_eq!(
            out.lines().nth(2),
            Some("before: ipvs-alone 1.10 (2.0) nftables 1.00 (2.0); ipvs-alone/nftables 1.10")
        );
        let dead = [
            "PATH nftables 10.98.39.15:80",
            "STEP b DATAPATH-TARGET target=10.98.39.15:80 conns=5 failed=5 p50_us=0 p99_us=0 rate=0.0",
        ];
        assert!(
            datapath_summary(&dead).is_err(),
            "a path that never connected"
        );
        assert!(
            datapath_summary(&["STEP b DATAPATH-TARGET target=1.2.3.4:80 p50_us=1 p99_us=1"])
                .is_err()
        );
        assert!(datapath_summary(&["nothing measured"]).is_err());
        Ok(())
    }
}
