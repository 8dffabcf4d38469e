//! Helpers shared by the kernel tests: the scenario of services and destinations "of every kind", and parsers for
//! `ipvsadm -S -n` output.

#![allow(
    dead_code,
    unreachable_pub,
    reason = "shared by several test targets, each using a part"
)]

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;

use kube_ipvs_netlink::ipvs::{
    Destination, Family, Flags, ForwardMethod, Netmask, Protocol, Request, Service, ServiceKey,
    Tunnel, TunnelType,
};

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address literal")
}

/// One service of every kind the crate must handle, with its destinations, named for fixtures.
pub struct Case {
    pub name: &'static str,
    pub service: Service,
    pub dests: Vec<Destination>,
}

pub fn dest(addr: &str, port: u16, fwd: ForwardMethod, weight: u32) -> Destination {
    let mut d = Destination::new(ip(addr), port, fwd);
    d.weight = weight;
    d
}

pub fn cases() -> Vec<Case> {
    let mut out = Vec::new();

    let mut s = Service::new(ServiceKey::tcp(ip("10.0.0.1"), 80), "wlc");
    s.flags = Flags::exactly(0);
    let mut d1 = dest("192.168.1.10", 8080, ForwardMethod::Route, 100);
    d1.upper_threshold = 100;
    d1.lower_threshold = 10;
    let d2 = dest("192.168.1.11", 80, ForwardMethod::Masq, 1);
    out.push(Case {
        name: "tcp4_wlc",
        service: s,
        dests: vec![d1, d2],
    });

    let mut s = Service::new(ServiceKey::udp(ip("10.0.0.1"), 53), "rr");
    s.flags = Flags::exactly(Flags::PERSISTENT | Flags::ONEPACKET);
    s.timeout = 10800;
    s.netmask = Netmask::V4(Ipv4Addr::new(255, 255, 255, 0));
    let mut d = dest("192.168.1.20", 53, ForwardMethod::Tunnel, 5);
    d.tunnel = Some(Tunnel {
        kind: TunnelType::Ipip,
        port: 0,
        flags: Tunnel::NOCSUM,
    });
    out.push(Case {
        name: "udp4_persist_mask_ops",
        service: s,
        dests: vec![d],
    });

    let mut s = Service::new(
        ServiceKey::Addr {
            protocol: Protocol::Sctp,
            addr: ip("10.0.0.2"),
            port: 3868,
        },
        "mh",
    );
    s.flags = Flags::exactly(Flags::PERSISTENT | Flags::SCHED1);
    s.timeout = 60;
    let d = dest("192.168.1.21", 3868, ForwardMethod::Masq, 3);
    out.push(Case {
        name: "sctp4_mh_fallback",
        service: s,
        dests: vec![d],
    });

    let mut s = Service::new(ServiceKey::tcp(ip("200.0.0.1"), 443), "sh");
    s.flags = Flags::exactly(Flags::PERSISTENT | Flags::SCHED1 | Flags::SCHED2);
    s.timeout = 300;
    let d = dest("10.1.1.1", 443, ForwardMethod::Route, 0);
    out.push(Case {
        name: "tcp4_sh_flags",
        service: s,
        dests: vec![d],
    });

    let mut s = Service::new(ServiceKey::tcp(ip("2001:db8::1"), 80), "wrr");
    s.flags = Flags::exactly(Flags::PERSISTENT);
    s.timeout = 600;
    s.netmask = Netmask::V6(64);
    let d1 = dest("2001:db8::9", 80, ForwardMethod::Masq, 2);
    let mut d2 = dest("2001:db8::10", 80, ForwardMethod::Masq, 2);
    d2.upper_threshold = 50;
    out.push(Case {
        name: "tcp6_wrr_persist_prefix",
        service: s,
        dests: vec![d1, d2],
    });

    let mut s = Service::new(
        ServiceKey::Fwmark {
            family: Family::Inet,
            mark: 100,
        },
        "wlc",
    );
    s.flags = Flags::exactly(Flags::PERSISTENT);
    s.timeout = 300;
    let mut d = dest("192.168.1.30", 0, ForwardMethod::Tunnel, 1);
    d.tunnel = Some(Tunnel {
        kind: TunnelType::Gue,
        port: 6080,
        flags: Tunnel::CSUM,
    });
    out.push(Case {
        name: "fwm4_gue",
        service: s,
        dests: vec![d],
    });

    let s = Service::new(
        ServiceKey::Fwmark {
            family: Family::Inet6,
            mark: 3_000_000_000,
        },
        "lc",
    );
    let mut d1 = dest("2001:db8::30", 0, ForwardMethod::Tunnel, 4);
    d1.tunnel = Some(Tunnel {
        kind: TunnelType::Gre,
        port: 0,
        flags: Tunnel::REMCSUM,
    });
    // A mixed-family destination: only tunnel forwarding allows an IPv4 real server behind an IPv6 service.
    let mut d2 = dest("192.168.1.40", 0, ForwardMethod::Tunnel, 2);
    d2.tunnel = Some(Tunnel {
        kind: TunnelType::Ipip,
        port: 0,
        flags: 0,
    });
    out.push(Case {
        name: "fwm6_gre_mixed",
        service: s,
        dests: vec![d1, d2],
    });

    let mut s = Service::new(
        ServiceKey::Addr {
            protocol: Protocol::Udp,
            addr: ip("2001:db8::53"),
            port: 53,
        },
        "sh",
    );
    s.flags = Flags::exactly(Flags::SCHED2);
    let d = dest("2001:db8::54", 5353, ForwardMethod::Masq, 7);
    out.push(Case {
        name: "udp6_sh_port",
        service: s,
        dests: vec![d],
    });

    out
}

/// The requests that program all cases.
pub fn program(cases: &[Case]) -> Vec<Request> {
    let mut reqs = Vec::new();
    for c in cases {
        reqs.push(Request::NewService(c.service.clone()));
        for d in &c.dests {
            reqs.push(Request::NewDest {
                service: c.service.key,
                dest: d.clone(),
            });
        }
    }
    reqs
}

/// Runs ipvsadm with fixed arguments and returns stdout.
pub fn ipvsadm(args: &[&str]) -> String {
    let bin = std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".to_owned());
    let out = Command::new(&bin)
        .args(args)
        .output()
        .expect("spawn ipvsadm");
    assert!(
        out.status.success(),
        "ipvsadm {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("ipvsadm output is UTF-8")
}

/// A service as `ipvsadm -S -n` describes it, normalised for comparison.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SavedService {
    pub spec: String,
    pub scheduler: String,
    pub persistent: Option<u32>,
    pub mask: Option<String>,
    pub pe: Option<String>,
    pub ops: bool,
    pub sched_flags: Option<String>,
    pub dests: Vec<SavedDest>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SavedDest {
    pub addr: String,
    pub fwd: String,
    pub weight: i64,
    pub tunnel: Option<String>,
}

/// Parses `ipvsadm -S -n` output into services with their destinations, sorted.
pub fn parse_save(text: &str) -> Vec<SavedService> {
    let mut services: Vec<SavedService> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let toks: Vec<&str> = line.split_whitespace().collect();
        let (spec, rest) = service_spec(&toks[1..]);
        match toks[0] {
            "-A" => {
                let mut s = SavedService {
                    spec,
                    scheduler: String::new(),
                    persistent: None,
                    mask: None,
                    pe: None,
                    ops: false,
                    sched_flags: None,
                    dests: Vec::new(),
                };
                let mut i = 0;
                while i < rest.len() {
                    match rest[i] {
                        "-s" => {
                            s.scheduler = rest[i + 1].to_owned();
                            i += 1;
                        }
                        "-p" => {
                            s.persistent = Some(rest[i + 1].parse().expect("-p value"));
                            i += 1;
                        }
                        "-M" => {
                            s.mask = Some(rest[i + 1].to_owned());
                            i += 1;
                        }
                        "--pe" => {
                            s.pe = Some(rest[i + 1].to_owned());
                            i += 1;
                        }
                        "-b" => {
                            s.sched_flags = Some(rest[i + 1].to_owned());
                            i += 1;
                        }
                        "-o" => s.ops = true,
                        other => panic!("unexpected token {other:?} in {line:?}"),
                    }
                    i += 1;
                }
                services.push(s);
            }
            "-a" => {
                let mut d = SavedDest {
                    addr: String::new(),
                    fwd: String::new(),
                    weight: 0,
                    tunnel: None,
                };
                let mut tun = Vec::new();
                let mut i = 0;
                while i < rest.len() {
                    match rest[i] {
                        "-r" => {
                            d.addr = rest[i + 1].to_owned();
                            i += 1;
                        }
                        "-w" => {
                            d.weight = rest[i + 1].parse().expect("-w value");
                            i += 1;
                        }
                        "-m" | "-i" | "-g" => d.fwd = rest[i].to_owned(),
                        t => tun.push(t.to_owned()),
                    }
                    i += 1;
                }
                if !tun.is_empty() {
                    d.tunnel = Some(tun.join(" "));
                }
                let owner = services
                    .iter_mut()
                    .rev()
                    .find(|s| s.spec == spec)
                    .unwrap_or_else(|| panic!("destination line before its service: {line:?}"));
                owner.dests.push(d);
            }
            other => panic!("unexpected line start {other:?}"),
        }
    }
    for s in &mut services {
        s.dests.sort();
    }
    services.sort();
    services
}

fn service_spec<'a>(toks: &[&'a str]) -> (String, Vec<&'a str>) {
    match toks[0] {
        "-f" => {
            if toks.get(2) == Some(&"-6") {
                (format!("-f {} -6", toks[1]), toks[3..].to_vec())
            } else {
                (format!("-f {}", toks[1]), toks[2..].to_vec())
            }
        }
        flag => (format!("{flag} {}", toks[1]), toks[2..].to_vec()),
    }
}

/// What `ipvsadm -S -n` would print for the crate's view of a service (fwmark printed signed, as Debian's 1.31).
pub fn expected_save(s: &Service, dests: &[Destination]) -> SavedService {
    let endpoint = |a: &IpAddr, p: u16| match a {
        IpAddr::V4(a) => format!("{a}:{p}"),
        IpAddr::V6(a) => format!("[{a}]:{p}"),
    };
    let spec = match s.key {
        ServiceKey::Fwmark {
            family: Family::Inet,
            mark,
        } => format!("-f {}", mark as i32),
        ServiceKey::Fwmark {
            family: Family::Inet6,
            mark,
        } => format!("-f {} -6", mark as i32),
        ServiceKey::Addr {
            protocol,
            addr,
            port,
        } => {
            let flag = match protocol {
                Protocol::Tcp => "-t",
                Protocol::Udp => "-u",
                Protocol::Sctp => "--sctp-service",
                Protocol::Other(_) => "?",
            };
            format!("{flag} {}", endpoint(&addr, port))
        }
    };
    let persistent = s.is_persistent().then_some(s.timeout);
    let mask = match (persistent, s.netmask) {
        (Some(_), Netmask::V4(m)) if m != Ipv4Addr::BROADCAST => Some(m.to_string()),
        (Some(_), Netmask::V6(p)) if p != 128 => Some(p.to_string()),
        _ => None,
    };
    let (f1, f2, f3) = match s.scheduler.as_str() {
        "sh" => ("sh-fallback", "sh-port", "flag-3"),
        "mh" => ("mh-fallback", "mh-port", "flag-3"),
        _ => ("flag-1", "flag-2", "flag-3"),
    };
    let mut flags = Vec::new();
    for (bit, name) in [
        (Flags::SCHED1, f1),
        (Flags::SCHED2, f2),
        (Flags::SCHED3, f3),
    ] {
        if s.flags.has(bit) {
            flags.push(name);
        }
    }
    let mut out = SavedService {
        spec,
        scheduler: s.scheduler.clone(),
        persistent,
        mask,
        pe: s.pe_name.clone(),
        ops: s.flags.has(Flags::ONEPACKET),
        sched_flags: (!flags.is_empty()).then(|| flags.join(",")),
        dests: dests
            .iter()
            .map(|d| SavedDest {
                addr: endpoint(&d.addr, d.port),
                fwd: match d.forward {
                    ForwardMethod::Masq => "-m",
                    ForwardMethod::Tunnel => "-i",
                    _ => "-g",
                }
                .to_owned(),
                weight: i64::from(d.weight),
                tunnel: match (d.forward, d.tunnel) {
                    (ForwardMethod::Tunnel, Some(t)) => Some(tunnel_save(&t)),
                    (ForwardMethod::Tunnel, None) => Some("--tun-type ipip".to_owned()),
                    _ => None,
                },
            })
            .collect(),
    };
    out.dests.sort();
    out
}

fn tunnel_save(t: &Tunnel) -> String {
    let csum = match t.flags {
        Tunnel::CSUM => "--tun-csum",
        Tunnel::REMCSUM => "--tun-remcsum",
        _ => "--tun-nocsum",
    };
    match t.kind {
        TunnelType::Ipip => "--tun-type ipip".to_owned(),
        TunnelType::Gue => format!("--tun-type gue --tun-port {} {csum}", t.port),
        TunnelType::Gre => format!("--tun-type gre {csum}"),
        TunnelType::Other(v) => format!("?{v}"),
    }
}

/// Destination lines of `ipvsadm -Ln`, per service line, as (service line, [(addr, forward, weight, active,
/// inactive)]).
pub type ListedDest = (String, String, i64);

pub fn parse_list(text: &str) -> Vec<(String, Vec<ListedDest>)> {
    let mut out: Vec<(String, Vec<ListedDest>)> = Vec::new();
    for line in text.lines().skip(3) {
        if let Some(rest) = line.strip_prefix("  -> ") {
            let t: Vec<&str> = rest.split_whitespace().collect();
            let entry = (
                t[0].to_owned(),
                t[1].to_owned(),
                t[2].parse().expect("weight column"),
            );
            out.last_mut()
                .expect("destination after a service")
                .1
                .push(entry);
        } else {
            out.push((line.trim_end().to_owned(), Vec::new()));
        }
    }
    for s in &mut out {
        s.1.sort();
    }
    out.sort();
    out
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Asserts the kernel's view of a service is what was programmed (HASHED is the kernel's own bit).
pub fn same_service(got: &Service, want: &Service) {
    assert_eq!(got.key, want.key);
    assert_eq!(got.scheduler, want.scheduler, "scheduler of {}", want.key);
    assert_eq!(got.pe_name, want.pe_name, "pe of {}", want.key);
    assert_eq!(
        got.flags.flags & !Flags::HASHED,
        want.flags.flags,
        "flags of {}",
        want.key
    );
    assert_eq!(got.flags.mask, u32::MAX, "mask of {}", want.key);
    assert_eq!(got.timeout, want.timeout, "timeout of {}", want.key);
    assert_eq!(got.netmask, want.netmask, "netmask of {}", want.key);
    assert!(
        got.stats.is_some() && got.stats64.is_some(),
        "stats of {}",
        want.key
    );
}

/// Asserts the kernel's view of a destination is what was programmed.
pub fn same_dest(got: &Destination, want: &Destination) {
    assert_eq!((got.addr, got.port), (want.addr, want.port));
    assert_eq!(got.forward, want.forward, "forward of {}", want.addr);
    assert_eq!(got.weight, want.weight, "weight of {}", want.addr);
    assert_eq!(got.upper_threshold, want.upper_threshold);
    assert_eq!(got.lower_threshold, want.lower_threshold);
    assert_eq!(
        got.tunnel.unwrap_or_default(),
        want.tunnel.unwrap_or_default(),
        "tunnel of {}",
        want.addr
    );
}
