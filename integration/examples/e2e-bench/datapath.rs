//! The data path: how long a new TCP connection to a ClusterIP takes through what the agent
//! programmed (IPVS, or kube-proxy's nftables or iptables rules), and how many such
//! connections per second one client makes, in the agent's guest.
//!
//! Two network namespaces the driver makes: `dp-client` (10.250.0.2, routed through the
//! guest's root namespace) and `dp-server`, which holds every endpoint address of the measured
//! Services on one veth and answers on the target port with one byte (this binary's `serve`
//! mode). A connection leaves the client, meets the agent's rules or IPVS in the root
//! namespace, is sent to an endpoint in `dp-server`, and counts when its byte arrives. Each
//! measured Service is one the agent converged on, so the first, middle and last of N show
//! whether the lookup depends on where the Service sits in the table (iptables' `KUBE-SERVICES`
//! is a list; nftables' and IPVS's are hashed).

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

const IP: &str = "/usr/sbin/ip";
const CLIENT_NS: &str = "dp-client";
const SERVER_NS: &str = "dp-server";
const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 2);
const CLIENT_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 1);
const SERVER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 2);
const SERVER_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 1);
/// A connection that has not delivered its byte by then failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The client's result line (one per target), read back by the driver.
const RESULT_PREFIX: &str = "DATAPATH-TARGET ";

/// One target's figures, from the client.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Measured {
    pub(crate) target: SocketAddrV4,
    pub(crate) conns: usize,
    pub(crate) failed: usize,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    /// Connections completed per second, one after another from one client.
    pub(crate) rate: f64,
}

impl Measured {
    fn line(&self) -> String {
        format!(
            "{RESULT_PREFIX}target={} conns={} failed={} p50_us={} p99_us={} rate={:.1}",
            self.target, self.conns, self.failed, self.p50_us, self.p99_us, self.rate
        )
    }

    fn parse(line: &str) -> Result<Measured> {
        let rest = line
            .strip_prefix(RESULT_PREFIX)
            .with_context(|| format!("not a {RESULT_PREFIX}line: {line:?}"))?;
        let mut fields = std::collections::HashMap::new();
        for word in rest.split_whitespace() {
            let (k, v) = word
                .split_once('=')
                .with_context(|| format!("{word:?} in {line:?}"))?;
            fields.insert(k, v);
        }
        let get = |k: &str| {
            fields
                .get(k)
                .copied()
                .with_context(|| format!("{line:?} lacks {k}"))
        };
        Ok(Measured {
            target: get("target")?.parse().context("target")?,
            conns: get("conns")?.parse().context("conns")?,
            failed: get("failed")?.parse().context("failed")?,
            p50_us: get("p50_us")?.parse().context("p50_us")?,
            p99_us: get("p99_us")?.parse().context("p99_us")?,
            rate: get("rate")?.parse().context("rate")?,
        })
    }
}

/// `serve --port P`, in `dp-server`: every connection gets one byte and is closed.
pub(crate) fn serve(port: u16) -> Result<()> {
    let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
        .with_context(|| format!("listening on port {port}"))?;
    // A client that went away is its own problem, not the server's end.
    for mut c in listener.incoming().flatten() {
        let _ = c.write_all(b"k");
    }
    Ok(())
}

/// Nearest-rank percentile of sorted samples (0 without any); the soak's samples use it too.
pub(crate) fn rank(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let at = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[at.clamp(1, sorted.len()) - 1]
}

/// One connection: connect, read the byte; its time in microseconds, `None` if it failed.
fn one(target: SocketAddrV4) -> Option<u64> {
    let start = Instant::now();
    let mut s = TcpStream::connect_timeout(&SocketAddr::V4(target), CONNECT_TIMEOUT).ok()?;
    s.set_read_timeout(Some(CONNECT_TIMEOUT)).ok()?;
    let mut byte = [0u8; 1];
    s.read_exact(&mut byte).ok()?;
    Some(start.elapsed().as_micros() as u64)
}

/// `connect --targets A:P,B:P --count N`, in `dp-client`: one warm-up connection per target
/// (neighbour resolution), then N rounds of one connection to each target in turn, so a burst
/// of load on the host falls on every target alike; prints one result line per target. The
/// rate is that target's connections over the time they took, one after another.
pub(crate) fn connect(targets: &[SocketAddrV4], count: usize) -> Result<()> {
    for target in targets {
        let _ = one(*target);
    }
    let mut times: Vec<Vec<u64>> = vec![Vec::with_capacity(count); targets.len()];
    let mut failed = vec![0usize; targets.len()];
    let mut spent = vec![Duration::ZERO; targets.len()];
    for _ in 0..count {
        for (k, target) in targets.iter().enumerate() {
            let start = Instant::now();
            match one(*target) {
                Some(us) => times[k].push(us),
                None => failed[k] += 1,
            }
            spent[k] += start.elapsed();
        }
    }
    for (k, target) in targets.iter().enumerate() {
        times[k].sort_unstable();
        let m = Measured {
            target: *target,
            conns: count,
            failed: failed[k],
            p50_us: rank(&times[k], 50.0),
            p99_us: rank(&times[k], 99.0),
            rate: times[k].len() as f64 / spent[k].as_secs_f64().max(1e-9),
        };
        println!("{}", m.line());
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new(IP)
        .args(args)
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `ip -batch -` with `lines` on its standard input (hundreds of addresses and routes).
fn ip_batch(namespace: Option<&str>, lines: &str) -> Result<()> {
    let mut cmd = Command::new(IP);
    if let Some(ns) = namespace {
        cmd.args(["-n", ns]);
    }
    let mut child = cmd
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running ip -batch -")?;
    child
        .stdin
        .take()
        .context("ip -batch has no stdin")?
        .write_all(lines.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "ip -batch failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The two namespaces and the server; torn down on drop.
pub(crate) struct Lab {
    server: Child,
    exe: PathBuf,
}

impl Lab {
    /// Builds the namespaces with `endpoints` in `dp-server` and starts the server there on
    /// `port`.
    pub(crate) fn up(endpoints: &[Ipv4Addr], port: u16) -> Result<Lab> {
        let exe = std::env::current_exe().context("this program's path")?;
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("enabling forwarding")?;
        // Each namespace: a veth to the root namespace, the gateway address on the root's end,
        // its own on the other, and a default route back through the root.
        for (ns, outer, inner, gateway, own) in [
            (CLIENT_NS, "dpc0", "dpc1", CLIENT_GATEWAY, CLIENT_ADDR),
            (SERVER_NS, "dps0", "dps1", SERVER_GATEWAY, SERVER_ADDR),
        ] {
            let gateway_cidr = format!("{gateway}/24");
            let own_cidr = format!("{own}/24");
            let gateway = gateway.to_string();
            ip(&["netns", "add", ns])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&[
                "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns,
            ])?;
            ip(&["addr", "add", &gateway_cidr, "dev", outer])?;
            ip(&["link", "set", outer, "up"])?;
            ip(&["-n", ns, "addr", "add", &own_cidr, "dev", inner])?;
            ip(&["-n", ns, "link", "set", inner, "up"])?;
            ip(&["-n", ns, "route", "add", "default", "via", &gateway])?;
        }
        let mut addrs = String::new();
        let mut routes = String::new();
        for ep in endpoints {
            addrs.push_str(&format!("addr add {ep}/32 dev dps1\n"));
            routes.push_str(&format!("route replace {ep}/32 via {SERVER_ADDR}\n"));
        }
        ip_batch(Some(SERVER_NS), &addrs)?;
        ip_batch(None, &routes)?;
        let server = Command::new(IP)
            .args(["netns", "exec", SERVER_NS])
            .arg(&exe)
            .args(["serve", "--port", &port.to_string()])
            .stdin(Stdio::null())
            .spawn()
            .context("starting the server in dp-server")?;
        let lab = Lab { server, exe };
        // Listening before the first measured connection (under load, a client started at once
        // found nothing there: every connection refused).
        let ready = SocketAddrV4::new(SERVER_ADDR, port);
        let deadline = Instant::now() + Duration::from_secs(30);
        while one(ready).is_none() {
            if Instant::now() > deadline {
                bail!("the server in {SERVER_NS} is not answering on {ready} after 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(lab)
    }

    /// Measures `count` connections to each target from `dp-client`.
    pub(crate) fn measure(&self, targets: &[SocketAddrV4], count: usize) -> Result<Vec<Measured>> {
        let list: Vec<String> = targets.iter().map(ToString::to_string).collect();
        let out = Command::new(IP)
            .args(["netns", "exec", CLIENT_NS])
            .arg(&self.exe)
            .args(["connect", "--targets", &list.join(","), "--count"])
            .arg(count.to_string())
            .output()
            .context("running the client in dp-client")?;
        if !out.status.success() {
            bail!(
                "the client failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with(RESULT_PREFIX))
            .map(Measured::parse)
            .collect()
    }

    /// What the namespaces, routes and the kernel's Service state look like (for a failure).
    pub(crate) fn diagnose(&self, targets: &[SocketAddrV4]) -> String {
        let show = |program: &str, args: &[&str]| -> String {
            let out = Command::new(program).args(args).output();
            let text = match out {
                Ok(o) => format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => e.to_string(),
            };
            let lines: Vec<&str> = text.lines().take(40).collect();
            format!("$ {program} {}\n{}\n", args.join(" "), lines.join("\n"))
        };
        let mut out = String::new();
        out.push_str(&show(IP, &["-n", SERVER_NS, "-br", "addr"]));
        out.push_str(&show(IP, &["-n", CLIENT_NS, "route"]));
        out.push_str(&show("/bin/ps", &[]));
        for t in targets {
            let ip = t.ip().to_string();
            out.push_str(&show(IP, &["route", "get", &ip]));
            out.push_str(&show("/usr/sbin/ipvsadm", &["-Ln", "-t", &t.to_string()]));
        }
        out.push_str(&show("/usr/sbin/iptables-save", &["-c"]));
        out.push_str(&show(
            "/bin/sysctl",
            &[
                "net.ipv4.ip_forward",
                "net.ipv4.conf.all.rp_filter",
                "net.ipv4.vs.conntrack",
            ],
        ));
        out
    }

    /// The server's path, for messages.
    pub(crate) fn program(&self) -> &Path {
        &self.exe
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        for ns in [CLIENT_NS, SERVER_NS] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_line_round_trips() -> Result<()> {
        let m = Measured {
            target: "10.96.0.5:80".parse()?,
            conns: 500,
            failed: 2,
            p50_us: 410,
            p99_us: 1900,
            rate: 1234.5,
        };
        assert_eq!(Measured::parse(&m.line())?, m);
        assert!(Measured::parse("DATAPATH-TARGET target=10.96.0.5:80").is_err());
        Ok(())
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let s: Vec<u64> = (1..=200).collect();
        assert_eq!(rank(&s, 50.0), 100);
        assert_eq!(rank(&s, 99.0), 198);
        assert_eq!(rank(&[], 50.0), 0);
    }
}
