//! Programs N services x M destinations through the crate (batched), through a raw sender (the
//! kernel's own cost: the same messages in socket-sized `sendmsg`s, no acknowledgement but one
//! fence at the end) and through `ipvsadm -R`, reads the table back, checks the tables match, and
//! prints the times and ratios.
//!
//! Each program runs on a fresh table: the crate in the namespace the bench starts in (fresh
//! when the guest boots), the raw sender and `ipvsadm -R` each in a network namespace of its own
//! (`unshare -n`, re-running this binary with `--phase`). IPVS keeps deleted destinations in a
//! per-namespace trash that every add scans for about a minute, so a program run right after
//! another's flush pays for the first one's table.
//!
//! Run it in the VM with `cargo xtask bench netlink [-- --services N --dests M [--ack-mode every|errors-only]]`.
//! It needs root, IPVS and `unshare`, and it flushes the IPVS table of its network namespace.

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
    /// Run only this program, in the current namespace, and print its time (`raw`, `ipvsadm`).
    phase: Option<String>,
    /// The crate's send buffer request (bounds the bytes of one `sendmsg`); default the crate's.
    sndbuf: Option<usize>,
    /// Skip `ipvsadm -R` (minutes at 10,000 x 10), for experiments on the crate alone.
    no_ipvsadm: bool,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        services: 10_000,
        dests: 10,
        ack_mode: IpvsConfig::default().ack_mode,
        read_only: false,
        phase: None,
        sndbuf: None,
        no_ipvsadm: false,
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
            "--phase" => args.phase = Some(value()?),
            "--sndbuf" => args.sndbuf = Some(value()?.parse().context("--sndbuf")?),
            "--no-ipvsadm" => args.no_ipvsadm = true,
            "--" => {}
            other => bail!(
                "unknown argument {other:?}; usage: ipvs-bench [--services N] [--dests M] [--ack-mode every|errors-only] [--sndbuf BYTES] [--no-ipvsadm] [--read-only]"
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

/// Alternating rounds of programming a fresh table through the crate, the raw sender and
/// `ipvsadm -R`.
const PROGRAM_ROUNDS: usize = 3;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Every request of the table, services first then their destinations, in program order.
fn requests(args: &Args) -> Vec<Request> {
    let ops = args.services as usize * (1 + args.dests as usize);
    let mut reqs = Vec::with_capacity(ops);
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
    reqs
}

/// The requests as `ipvsadm -R` input, and the sorted `ipvsadm -S -n` lines they give.
fn rules(reqs: &[Request]) -> (String, Vec<String>) {
    let mut rules = String::with_capacity(reqs.len() * 64);
    let mut want = Vec::with_capacity(reqs.len());
    for r in reqs {
        let line = match r {
            Request::NewService(s) => service_line(&s.key, &s.scheduler),
            Request::NewDest { service, dest } => dest_line(service, dest),
            _ => continue,
        };
        let _ = writeln!(rules, "{line}");
        want.push(line);
    }
    want.sort();
    (rules, want)
}

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLMSG_ERROR: u16 = 2;

/// The raw cost: the requests encoded as they are built into socket-sized `sendmsg`s without
/// acknowledgements, the last one asking for an acknowledgement as a fence (the kernel handles a
/// batch in order, in `sendmsg`). Returns the time (build + send + fence), the `sendmsg` calls
/// and the requests the kernel refused.
fn raw_program(args: &Args, family: u16) -> Result<(Duration, usize, usize)> {
    use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_GENERIC};
    let mut sock = Socket::new(NETLINK_GENERIC).context("netlink socket")?;
    sock.bind_auto().context("bind")?;
    sock.connect(&SocketAddr::new(0, 0)).context("connect")?;
    sock.set_rx_buf_sz(16usize << 20).context("SO_RCVBUF")?;
    // The default send buffer (net.core.wmem_default): a sendmsg must stay below it.
    let chunk_bytes = 160 << 10;
    let t = Instant::now();
    let reqs = requests(args);
    let mut buf = Vec::with_capacity(chunk_bytes + 4096);
    let mut sends = 0;
    let mut last_seq = 0;
    let total = reqs.len();
    for (i, req) in reqs.iter().enumerate() {
        let seq = u32::try_from(i + 1).context("seq")?;
        let last = i + 1 == total;
        let flags = if last {
            NLM_F_REQUEST | NLM_F_ACK
        } else {
            NLM_F_REQUEST
        };
        req.encode_into(&mut buf, family, flags, seq);
        last_seq = seq;
        if buf.len() >= chunk_bytes || last {
            sock.send(&buf, 0).context("sendmsg")?;
            sends += 1;
            buf.clear();
        }
    }
    // Read until the fence's acknowledgement; count the errors before it.
    let mut refused = 0;
    let mut first_error = None;
    let mut rbuf = vec![0u8; 64 << 10];
    'fence: loop {
        let n = match sock.recv(&mut &mut rbuf[..], 0) {
            Ok(n) => n,
            // Errors overflowed the receive buffer: some were lost, keep reading to the fence.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                refused += 1;
                continue;
            }
            Err(e) => return Err(e).context("recv"),
        };
        let mut off = 0;
        while off + 16 <= n {
            let len = u32::from_ne_bytes(rbuf[off..off + 4].try_into()?) as usize;
            let kind = u16::from_ne_bytes(rbuf[off + 4..off + 6].try_into()?);
            let seq = u32::from_ne_bytes(rbuf[off + 8..off + 12].try_into()?);
            if kind == NLMSG_ERROR && off + 20 <= n {
                let code = i32::from_ne_bytes(rbuf[off + 16..off + 20].try_into()?);
                if code != 0 {
                    refused += 1;
                    first_error.get_or_insert((seq, code));
                }
                if seq == last_seq {
                    break 'fence;
                }
            }
            if len < 16 {
                break;
            }
            off += (len + 3) & !3;
        }
    }
    if let Some((seq, code)) = first_error {
        eprintln!("raw sender: first refusal: request {seq} errno {}", -code);
    }
    Ok((t.elapsed(), sends, refused))
}

/// Runs this binary with `--phase NAME` in a network namespace of its own (a fresh IPVS table)
/// and returns the milliseconds it reports.
fn in_fresh_namespace(args: &Args, phase: &str) -> Result<f64> {
    let exe = std::env::current_exe().context("this binary's path")?;
    // With loopback up: until then the namespace has no local routing table, and IPVS refuses
    // every IPv4 masquerade destination with EINVAL (`inet_addr_type` answers broadcast).
    let out = Command::new("unshare")
        .args([
            "-n",
            "/bin/sh",
            "-c",
            "/usr/sbin/ip link set lo up && exec \"$0\" \"$@\"",
        ])
        .arg(&exe)
        .args(["--phase", phase, "--services"])
        .arg(args.services.to_string())
        .arg("--dests")
        .arg(args.dests.to_string())
        .arg("--ack-mode")
        .arg(match args.ack_mode {
            AckMode::Every => "every",
            AckMode::ErrorsOnly => "errors-only",
        })
        .args(
            args.sndbuf
                .map(|b| ["--sndbuf".to_owned(), b.to_string()])
                .into_iter()
                .flatten(),
        )
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run unshare -n ipvs-bench --phase {phase}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    if !out.status.success() {
        bail!("phase {phase} failed: {}", out.status);
    }
    text.lines()
        .find_map(|l| {
            l.strip_prefix(&format!("phase {phase} ms "))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .with_context(|| format!("phase {phase} reported no time"))
}

/// The crate's handle as the arguments configure it, on an emptied table.
fn open_crate(args: &Args) -> Result<Ipvs> {
    let defaults = IpvsConfig::default();
    let mut ipvs = Ipvs::with_config(IpvsConfig {
        ack_mode: args.ack_mode,
        sndbuf: args.sndbuf.unwrap_or(defaults.sndbuf),
        ..defaults
    })
    .context("open IPVS handle")?;
    ipvs.flush().context("flush before the run")?;
    Ok(ipvs)
}

/// One program on the table of the current namespace, checked against the requests.
fn phase(args: &Args, name: &str) -> Result<()> {
    let reqs = requests(args);
    let (rules, want) = rules(&reqs);
    drop(reqs);
    match name {
        "raw" => {
            let mut ipvs = Ipvs::new().context("open IPVS handle")?;
            ipvs.flush().context("flush before the run")?;
            let (took, sends, refused) = raw_program(args, ipvs.family_id())?;
            let (got, _) = crate_lines(&mut ipvs)?;
            if refused != 0 || got != want {
                bail!(
                    "the raw sender's table differs ({refused} refused, {} vs {} lines)",
                    got.len(),
                    want.len()
                );
            }
            ipvs.flush().context("flush after the run")?;
            println!("phase raw ms {:.1} sendmsg {sends}", ms(took));
        }
        "crate" => {
            let mut ipvs = open_crate(args)?;
            let t = Instant::now();
            let reqs = requests(args);
            let failed = ipvs.apply(&reqs).iter().filter(|r| r.is_err()).count();
            let took = t.elapsed();
            let (got, _) = crate_lines(&mut ipvs)?;
            if failed != 0 || got != want {
                bail!("the crate's table differs ({failed} failed)");
            }
            ipvs.flush().context("flush after the run")?;
            println!("phase crate ms {:.1}", ms(took));
        }
        "ipvsadm" => {
            let path = "/tmp/ipvs-bench.rules";
            std::fs::write(path, &rules).with_context(|| format!("write {path}"))?;
            let took = time_ipvsadm(&["-R"], Some(path))?;
            if ipvsadm_save_lines()? != want {
                bail!("the table after ipvsadm -R differs from the requests");
            }
            time_ipvsadm(&["-C"], None)?;
            println!("phase ipvsadm ms {:.1}", ms(took));
        }
        other => bail!("--phase {other:?}: expected crate, raw or ipvsadm"),
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = parse_args()?;
    if let Some(name) = &args.phase {
        return phase(&args, name);
    }
    let ops = u64::from(args.services) * (1 + u64::from(args.dests));
    let mut ipvs = open_crate(&args)?;

    // Through the crate, batched; building the requests is part of the measured time.
    let t = Instant::now();
    let reqs = requests(&args);
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
    let (_, want) = rules(&reqs);
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
    ipvs.flush().context("flush after the run")?;

    // The crate, the raw sender and ipvsadm in turn, each round of each on a fresh table in a
    // namespace of its own (the first program of a guest also pays for the kernel's slab caches
    // growing, which is why the crate's run above is not compared), the best of each kept.
    let mut crate_rounds = Vec::new();
    let mut raw_rounds = Vec::new();
    let mut ipvsadm_rounds = Vec::new();
    for _ in 0..PROGRAM_ROUNDS {
        crate_rounds.push(in_fresh_namespace(&args, "crate")?);
        raw_rounds.push(in_fresh_namespace(&args, "raw")?);
        if !args.no_ipvsadm {
            ipvsadm_rounds.push(in_fresh_namespace(&args, "ipvsadm")?);
        }
    }
    let best = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::min);
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "program rounds (ms), fresh namespaces: crate [{}], raw [{}], ipvsadm -R [{}]; first run in the boot namespace: crate {:.0}",
        fmt(&crate_rounds),
        fmt(&raw_rounds),
        fmt(&ipvsadm_rounds),
        ms(crate_program)
    );
    let raw = best(&raw_rounds);
    // NaN (not measured) with --no-ipvsadm.
    let ipvsadm_program = best(&ipvsadm_rounds);
    let crate_ms = best(&crate_rounds);

    println!(
        "ipvs-bench: {} services x {} destinations = {ops} operations, ack mode {:?}, each program on a fresh table",
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
        "program (build + apply, best round)",
        crate_ms,
        ipvsadm_program,
        ipvsadm_program / crate_ms
    );
    println!(
        "{:<34} {:>12.1} {:>12.1} {:>7.1}x",
        "read whole table (best of rounds)",
        ms(crate_read),
        ms(ipvsadm_read),
        ipvsadm_read.as_secs_f64() / crate_read.as_secs_f64()
    );
    println!(
        "program: crate {crate_ms:.1} ms against the raw cost {raw:.1} ms (no acknowledgements, one fence) = {:.2}x",
        crate_ms / raw
    );
    println!(
        "(building the {ops} requests took {:.1} ms of the crate's program time)",
        ms(built)
    );
    println!(
        "tables matched: crate read-back and ipvsadm -S -n; the raw sender's and ipvsadm -R's, each in its namespace"
    );
    Ok(())
}
