//! `kube-ipvs dump` against `ipvsadm -Ln` on a large table: programs N services x M destinations
//! (batched, through kube-ipvs-netlink), then times both programs printing the whole table, and
//! checks that they printed the same bytes.
//!
//! Run it in the VM with `cargo xtask bench dump [-- --services N --dests M --repeat R]`. It
//! needs root and IPVS, and it flushes the IPVS table of its network namespace.

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kube_ipvs_netlink::ipvs::{Destination, ForwardMethod, Ipvs, Request, Service, ServiceKey};

struct Args {
    services: u32,
    dests: u32,
    repeat: u32,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        services: 10_000,
        dests: 10,
        repeat: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || -> Result<u32> {
            it.next()
                .with_context(|| format!("{a} needs a value"))?
                .parse()
                .with_context(|| format!("{a} needs a number"))
        };
        match a.as_str() {
            "--services" => args.services = value()?,
            "--dests" => args.dests = value()?,
            "--repeat" => args.repeat = value()?,
            "--" => {}
            other => bail!(
                "unknown argument {other:?}; usage: dump-bench [--services N] [--dests M] [--repeat R]"
            ),
        }
    }
    if args.services == 0 || args.services > 1 << 20 || args.dests > 1 << 10 || args.repeat == 0 {
        bail!("--services 1..=1048576, --dests at most 1024, --repeat at least 1");
    }
    Ok(args)
}

fn program(ipvs: &mut Ipvs, args: &Args) -> Result<()> {
    let mut requests = Vec::with_capacity((args.services * (args.dests + 1)) as usize);
    for i in 0..args.services {
        let key = ServiceKey::tcp(IpAddr::V4(Ipv4Addr::from(0x0a60_0001 + i)), 80);
        requests.push(Request::NewService(Service::new(key, "rr")));
        for j in 0..args.dests {
            let addr = IpAddr::V4(Ipv4Addr::from(0x0af4_0001 + i * args.dests + j));
            requests.push(Request::NewDest {
                service: key,
                dest: Destination::new(addr, 8080, ForwardMethod::Masq),
            });
        }
    }
    let failed = ipvs
        .apply(&requests)
        .into_iter()
        .filter(Result::is_err)
        .count();
    if failed > 0 {
        bail!("{failed} of {} requests failed", requests.len());
    }
    Ok(())
}

/// Runs `bin args`, returns its stdout and how long it took.
fn timed(bin: &str, args: &[&str]) -> Result<(Vec<u8>, Duration)> {
    let t = Instant::now();
    let out = Command::new(bin)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {bin}"))?;
    let took = t.elapsed();
    if !out.status.success() {
        bail!("{bin} {args:?} exited with {}", out.status);
    }
    Ok((out.stdout, took))
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let ipvsadm = std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".into());
    let ours = std::env::var("KUBE_IPVS_BIN").unwrap_or_else(|_| "/usr/local/bin/kube-ipvs".into());

    let mut ipvs = Ipvs::new().context("open IPVS")?;
    ipvs.flush().context("flush")?;
    let t = Instant::now();
    program(&mut ipvs, &args)?;
    println!(
        "programmed {} services x {} destinations in {:.0} ms",
        args.services,
        args.dests,
        t.elapsed().as_secs_f64() * 1e3
    );

    // Where our time goes, in process: the netlink read, then the rendering.
    let t = Instant::now();
    let table = kube_ipvs::ipvsadm::view::read_table(&mut ipvs).context("read the table")?;
    let read = t.elapsed();
    let t = Instant::now();
    let text = kube_ipvs::ipvsadm::render_table(&table, kube_ipvs::ipvsadm::Format::default());
    println!(
        "in process: netlink read {:.0} ms, render {:.0} ms ({} bytes)",
        read.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3,
        text.len()
    );

    let mut best_theirs = Duration::MAX;
    let mut best_ours = Duration::MAX;
    for round in 0..args.repeat {
        let (theirs, t_theirs) = timed(&ipvsadm, &["-L", "-n"])?;
        let (mine, t_ours) = timed(&ours, &["dump", "-n"])?;
        if theirs != mine {
            bail!(
                "round {round}: kube-ipvs dump and ipvsadm -Ln differ ({} vs {} bytes)",
                mine.len(),
                theirs.len()
            );
        }
        best_theirs = best_theirs.min(t_theirs);
        best_ours = best_ours.min(t_ours);
        println!(
            "round {round}: ipvsadm -Ln {:.0} ms, kube-ipvs dump {:.0} ms ({} bytes, identical)",
            t_theirs.as_secs_f64() * 1e3,
            t_ours.as_secs_f64() * 1e3,
            mine.len()
        );
    }
    println!(
        "best of {}: ipvsadm -Ln {:.0} ms, kube-ipvs dump {:.0} ms, ratio {:.1}x",
        args.repeat,
        best_theirs.as_secs_f64() * 1e3,
        best_ours.as_secs_f64() * 1e3,
        best_theirs.as_secs_f64() / best_ours.as_secs_f64()
    );
    ipvs.flush().context("flush")?;
    Ok(())
}
