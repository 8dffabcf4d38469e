//! Programs N services x M destinations through the crate (batched) and through `ipvsadm -R`, reads the table back
//! with both, checks the tables match, and prints the times and ratios.
//!
//! Run it in the VM with `cargo xtask bench netlink [-- --services N --dests M [--ack-mode every|errors-only]]`.
//! It needs root and IPVS, and it flushes the IPVS table of its network namespace.

use std::fmt::Write as _;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kube_ipvs_netlink::ipvs::{
    AckMode, Destination, ForwardMethod, Ipvs, IpvsConfig, Request, Service, ServiceKey,
};

struct Args {
    services: u32,
    dests: u32,
    ack_mode: AckMode,
    read_only: bool,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        services: 10_000,
        dests: 10,
        ack_mode: AckMode::Every,
        read_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--services" => args.services = value()?.parse().context("--services")?,
            "--dests" => args.dests = value()?.parse().context("--dests")?,
            "--ack-mode" => {
                args.ack_mode = match value()?.as_str() {
                    "every" => AckMode::Every,
                    "errors-only" => AckMode::ErrorsOnly,
                    other => bail!("--ack-mode {other:?}: expected every or errors-only"),
                }
            }
            "--read-only" => args.read_only = true,
            "--" => {}
            other => bail!(
                "unknown argument {other:?}; usage: ipvs-bench [--services N] [--dests M] [--ack-mode every|errors-only]"
            ),
        }
    }
    if args.services == 0 || args.services > 1 << 20 || args.dests > 1 << 10 {
        bail!("--services must be 1..=1048576 and --dests at most 1024");
    }
    Ok(args)
}

fn vip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0001 + i))
}

fn rip(i: u32, j: u32, dests: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0xac10_0001 + i * dests + j))
}

fn service_line(key: &ServiceKey, sched: &str) -> String {
    format!("-A -t {} -s {sched}", endpoint(key))
}

fn dest_line(key: &ServiceKey, d: &Destination) -> String {
    format!(
        "-a -t {} -r {}:{} -m -w {}",
        endpoint(key),
        d.addr,
        d.port,
        d.weight
    )
}

fn endpoint(key: &ServiceKey) -> String {
    match key {
        ServiceKey::Addr { addr, port, .. } => format!("{addr}:{port}"),
        ServiceKey::Fwmark { mark, .. } => format!("fwmark {mark}"),
    }
}

/// The table as sorted `ipvsadm -S -n` lines, from the crate's view.
fn crate_lines(ipvs: &mut Ipvs) -> Result<(Vec<String>, Duration)> {
    let t = Instant::now();
    let table = ipvs.table().context("read table through the crate")?;
    let took = t.elapsed();
    let mut lines = Vec::new();
    for (s, ds) in &table {
        lines.push(service_line(&s.key, &s.scheduler));
        for d in ds {
            lines.push(dest_line(&s.key, d));
        }
    }
    lines.sort();
    Ok((lines, took))
}

fn ipvsadm() -> String {
    std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".to_owned())
}

fn ipvsadm_save_lines() -> Result<Vec<String>> {
    let out = Command::new(ipvsadm())
        .args(["-S", "-n"])
        .output()
        .context("run ipvsadm -S -n")?;
    if !out.status.success() {
        bail!(
            "ipvsadm -S -n failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut lines: Vec<String> = String::from_utf8(out.stdout)?
        .lines()
        .map(str::to_owned)
        .collect();
    lines.sort();
    Ok(lines)
}

fn time_ipvsadm(args: &[&str], stdin: Option<&str>) -> Result<Duration> {
    let mut cmd = Command::new(ipvsadm());
    cmd.args(args).stdout(Stdio::null());
    if let Some(path) = stdin {
        cmd.stdin(File::open(path).with_context(|| format!("open {path}"))?);
    }
    let t = Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("run ipvsadm {args:?}"))?;
    let took = t.elapsed();
    if !status.success() {
        bail!("ipvsadm {args:?} exited with {status}");
    }
    Ok(took)
}

/// Alternating rounds of reading the table through the crate and through `ipvsadm -Ln`.
const READ_ROUNDS: usize = 3;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let ops = u64::from(args.services) * (1 + u64::from(args.dests));
    let mut ipvs = Ipvs::with_config(IpvsConfig {
        ack_mode: args.ack_mode,
        ..IpvsConfig::default()
    })
    .context("open IPVS handle")?;
    ipvs.flush().context("flush before the run")?;

    // Through the crate, batched; building the requests is part of the measured time.
    let t = Instant::now();
    let mut reqs = Vec::with_capacity(ops as usize);
    for i in 0..args.services {
        let key = ServiceKey::tcp(vip(i), 80);
        reqs.push(Request::NewService(Service::new(key, "rr")));
        for j in 0..args.dests {
            let mut d = Destination::new(rip(i, j, args.dests), 8080, ForwardMethod::Masq);
            d.weight = 1 + j % 5;
            reqs.push(Request::NewDest {
                service: key,
                dest: d,
            });
        }
    }
    let built = t.elapsed();
    let results = ipvs.apply(&reqs);
    let crate_program = t.elapsed();
    let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    if let Some(e) = failed.first() {
        bail!(
            "{} of {ops} requests failed through the crate; first: {e}",
            failed.len()
        );
    }
    let stats = ipvs.batch_stats();

    // The same rules as an ipvsadm -R input.
    let mut rules = String::with_capacity(ops as usize * 64);
    let mut want = Vec::with_capacity(ops as usize);
    for r in &reqs {
        let line = match r {
            Request::NewService(s) => service_line(&s.key, &s.scheduler),
            Request::NewDest { service, dest } => dest_line(service, dest),
            _ => continue,
        };
        let _ = writeln!(rules, "{line}");
        want.push(line);
    }
    want.sort();
    drop(reqs);

    let (got, first_read) = crate_lines(&mut ipvs)?;
    if got != want {
        bail!(
            "the crate's read-back differs from what it programmed ({} vs {} lines)",
            got.len(),
            want.len()
        );
    }
    if ipvsadm_save_lines()? != want {
        bail!("ipvsadm -S -n differs from what the crate programmed");
    }
    // Reads are repeated, alternating, and the fastest of each kept: the host that runs the VM is shared, and
    // load from outside moves single measurements by a factor of two or more.
    let mut crate_reads = vec![first_read];
    let mut ipvsadm_reads = Vec::new();
    for _ in 0..READ_ROUNDS {
        ipvsadm_reads.push(time_ipvsadm(&["-Ln"], None)?);
        let t = Instant::now();
        ipvs.table().context("read table through the crate")?;
        crate_reads.push(t.elapsed());
    }
    let crate_read = crate_reads.iter().copied().min().unwrap_or(first_read);
    let ipvsadm_read = ipvsadm_reads.iter().copied().min().unwrap_or_default();
    let list = |v: &[Duration]| {
        v.iter()
            .map(|d| format!("{:.0}", ms(*d)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "read rounds (ms): crate [{}], ipvsadm -Ln [{}]",
        list(&crate_reads),
        list(&ipvsadm_reads)
    );
    if args.read_only {
        // Break the read down and repeat it, to see where the time goes and how much load from outside the VM
        // moves the numbers, without the minutes `ipvsadm -R` takes.
        for round in 1..=3 {
            let t = Instant::now();
            let services = ipvs.services()?;
            let services_only = t.elapsed();
            for s in &services {
                ipvs.destinations(&s.key)?;
            }
            let sequential = t.elapsed();
            let adm = time_ipvsadm(&["-Ln"], None)?;
            println!(
                "read round {round}: services dump {:.1} ms, whole table {:.1} ms, ipvsadm -Ln {:.1} ms",
                ms(services_only),
                ms(sequential),
                ms(adm)
            );
        }
        ipvs.flush()?;
        return Ok(());
    }

    ipvs.flush().context("flush between runs")?;
    let path = "/tmp/ipvs-bench.rules";
    std::fs::write(path, &rules).with_context(|| format!("write {path}"))?;
    let ipvsadm_program = time_ipvsadm(&["-R"], Some(path))?;
    let (got, _) = crate_lines(&mut ipvs)?;
    if got != want {
        bail!(
            "the table after ipvsadm -R differs from the crate's ({} vs {} lines)",
            got.len(),
            want.len()
        );
    }
    ipvs.flush().context("flush after the run")?;

    println!(
        "ipvs-bench: {} services x {} destinations = {ops} operations, ack mode {:?}",
        args.services, args.dests, args.ack_mode
    );
    println!(
        "crate batching: {} sendmsg calls, {} overruns, limits {:?} (bytes, messages), buffers {:?}",
        stats.sends,
        stats.overruns,
        ipvs.batch_limits(),
        ipvs.socket_buffers()
    );
    println!(
        "{:<34} {:>12} {:>12} {:>8}",
        "", "crate (ms)", "ipvsadm (ms)", "ratio"
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>7.1}x",
        "program (crate: build + apply)",
        ms(crate_program),
        ms(ipvsadm_program),
        ipvsadm_program.as_secs_f64() / crate_program.as_secs_f64()
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>7.1}x",
        "read whole table (best of rounds)",
        ms(crate_read),
        ms(ipvsadm_read),
        ipvsadm_read.as_secs_f64() / crate_read.as_secs_f64()
    );
    println!(
        "(building the {ops} requests took {:.1} ms of the crate's program time)",
        ms(built)
    );
    println!("tables matched: crate read-back, ipvsadm -S -n, and the table ipvsadm -R built");
    Ok(())
}
