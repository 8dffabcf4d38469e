//! `kube-ipvs dump`: the kernel's IPVS table as `ipvsadm -Ln` prints it, or as JSON.
//!
//! This module owns the command line of `dump` and the JSON output schema
//! (`docs/dump-json.md`). Rendering the text is [`crate::ipvsadm`]'s job; reading the kernel is
//! the caller's (see `main.rs`), so everything here is testable without a kernel.

use std::net::IpAddr;

use std::io::Write as _;
use std::process::ExitCode;

use kube_ipvs_netlink::ipvs::Ipvs;
use serde::Serialize;

use crate::ipvsadm::{self, AF_INET6, Columns, Format, Service, Table};

/// The options of `kube-ipvs dump`, named as ipvsadm names them.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(about = "Print the kernel's IPVS table exactly as `ipvsadm -Ln` does")]
pub struct DumpArgs {
    /// Accepted for compatibility: output is always numeric (`ipvsadm -Ln`).
    #[arg(short = 'n', long = "numeric")]
    pub numeric: bool,
    /// Counters: connections, packets and bytes.
    #[arg(long, conflicts_with_all = ["thresholds", "persistent_conn", "tun_info"])]
    pub stats: bool,
    /// Rates: connections, packets and bytes per second.
    #[arg(long, conflicts_with_all = ["thresholds", "persistent_conn", "tun_info"])]
    pub rate: bool,
    /// Print counters unscaled (with --stats or --rate).
    #[arg(long)]
    pub exact: bool,
    /// Upper and lower connection thresholds of each real server.
    #[arg(long, conflicts_with_all = ["persistent_conn", "tun_info"])]
    pub thresholds: bool,
    /// Persistent connection counts of each real server.
    #[arg(long = "persistent-conn", conflicts_with = "tun_info")]
    pub persistent_conn: bool,
    /// Tunnel type, port and checksum flags of each real server.
    #[arg(long = "tun-info")]
    pub tun_info: bool,
    /// Keep the kernel's order instead of ipvsadm's sort.
    #[arg(long)]
    pub nosort: bool,
    /// Print the TCP, TCP FIN and UDP timeouts instead of the table.
    #[arg(long, conflicts_with_all = ["save", "json"])]
    pub timeout: bool,
    /// Print the rules as `ipvsadm -S -n` does (input for `ipvsadm -R`).
    #[arg(short = 'S', long, conflicts_with = "json")]
    pub save: bool,
    /// Machine-readable output (schema in docs/dump-json.md).
    #[arg(long)]
    pub json: bool,
    /// Only this TCP service (ADDR:PORT, IPv6 in brackets).
    #[arg(
        short = 't',
        long = "tcp-service",
        value_name = "ADDR:PORT",
        group = "one"
    )]
    pub tcp_service: Option<String>,
    /// Only this UDP service.
    #[arg(
        short = 'u',
        long = "udp-service",
        value_name = "ADDR:PORT",
        group = "one"
    )]
    pub udp_service: Option<String>,
    /// Only this SCTP service.
    #[arg(long = "sctp-service", value_name = "ADDR:PORT", group = "one")]
    pub sctp_service: Option<String>,
    /// Only this firewall-mark service.
    #[arg(
        short = 'f',
        long = "fwmark-service",
        value_name = "MARK",
        group = "one"
    )]
    pub fwmark_service: Option<u32>,
    /// With -f: the IPv6 firewall-mark service.
    #[arg(short = '6', long = "ipv6", requires = "fwmark_service")]
    pub ipv6: bool,
}

/// Which service `-t/-u/--sctp-service/-f` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selector {
    Addr {
        protocol: u16,
        addr: IpAddr,
        port: u16,
    },
    Fwmark {
        af: u16,
        mark: u32,
    },
}

/// A bad command line, named so the operator sees which flag was wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgError {
    #[error("{flag} {value:?}: expected ADDR:PORT (IPv6 as [ADDR]:PORT)")]
    BadService { flag: &'static str, value: String },
    #[error("-f 0: firewall mark must be non-zero")]
    ZeroMark,
}

impl DumpArgs {
    /// The output format these flags ask for.
    pub fn format(&self) -> Format {
        // ipvsadm lets --stats win over --rate when both are given.
        let columns = if self.save {
            Columns::Save
        } else if self.stats {
            Columns::Stats
        } else if self.rate {
            Columns::Rate
        } else if self.thresholds {
            Columns::Thresholds
        } else if self.persistent_conn {
            Columns::PersistentConn
        } else if self.tun_info {
            Columns::TunInfo
        } else {
            Columns::Default
        };
        Format {
            columns,
            exact: self.exact,
            nosort: self.nosort,
        }
    }

    /// The one service asked for, if any.
    pub fn selector(&self) -> Result<Option<Selector>, ArgError> {
        let by_addr = [
            ("-t", 6u16, &self.tcp_service),
            ("-u", 17, &self.udp_service),
            ("--sctp-service", 132, &self.sctp_service),
        ];
        for (flag, protocol, value) in by_addr {
            if let Some(value) = value {
                let (addr, port) = parse_addr_port(value).ok_or_else(|| ArgError::BadService {
                    flag,
                    value: value.clone(),
                })?;
                return Ok(Some(Selector::Addr {
                    protocol,
                    addr,
                    port,
                }));
            }
        }
        match self.fwmark_service {
            Some(0) => Err(ArgError::ZeroMark),
            Some(mark) => Ok(Some(Selector::Fwmark {
                af: if self.ipv6 {
                    AF_INET6
                } else {
                    ipvsadm::AF_INET
                },
                mark,
            })),
            None => Ok(None),
        }
    }
}

/// `10.0.0.1:80` or `[2001:db8::1]:80`.
pub fn parse_addr_port(s: &str) -> Option<(IpAddr, u16)> {
    let sock: std::net::SocketAddr = s.parse().ok()?;
    Some((sock.ip(), sock.port()))
}

impl Selector {
    /// Whether `svc` is the service this selector names.
    pub fn matches(&self, svc: &Service) -> bool {
        match *self {
            Selector::Addr {
                protocol,
                addr,
                port,
            } => {
                svc.fwmark == 0 && svc.protocol == protocol && svc.addr == addr && svc.port == port
            }
            Selector::Fwmark { af, mark } => svc.fwmark == mark && svc.af == af,
        }
    }
}

/// What `dump` prints for a table that was read: text or JSON, or "No such service".
pub fn render(table: &Table, args: &DumpArgs) -> Result<String, DumpError> {
    let selector = args.selector()?;
    let format = args.format();
    let selected: Option<&Service> = match selector {
        Some(sel) => Some(
            table
                .services
                .iter()
                .find(|s| sel.matches(s))
                .ok_or(DumpError::NoSuchService)?,
        ),
        None => None,
    };
    if args.json {
        let services: Vec<&Service> = match selected {
            Some(s) => vec![s],
            None => table.services.iter().collect(),
        };
        let doc = JsonTable::new(table, &services);
        return serde_json::to_string_pretty(&doc)
            .map(|mut s| {
                s.push('\n');
                s
            })
            .map_err(|e| DumpError::Json(e.to_string()));
    }
    Ok(match selected {
        Some(svc) => ipvsadm::render_one(svc, format),
        None => ipvsadm::render_table(table, format),
    })
}

/// Why `dump` printed no table.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DumpError {
    #[error(transparent)]
    Args(#[from] ArgError),
    /// ipvsadm's own wording, so scripts that match on it keep working.
    #[error("No such service")]
    NoSuchService,
    #[error("encoding JSON: {0}")]
    Json(String),
}

/// Schema version of the JSON output; bump on any incompatible change.
pub const JSON_SCHEMA: &str = "kube-ipvs.dump/v1";

#[derive(Debug, Serialize)]
struct JsonTable<'a> {
    schema: &'static str,
    version: String,
    conn_tab_size: u32,
    services: Vec<JsonService<'a>>,
}

#[derive(Debug, Serialize)]
struct JsonService<'a> {
    family: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    protocol: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fwmark: Option<u32>,
    scheduler: &'a str,
    flags: Vec<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    persistence: Option<JsonPersistence<'a>>,
    stats: JsonCounters,
    destinations: Vec<JsonDest>,
}

#[derive(Debug, Serialize)]
struct JsonPersistence<'a> {
    timeout_seconds: u32,
    /// Dotted mask for IPv4, prefix length for IPv6, as text either way.
    netmask: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    pe: &'a str,
}

#[derive(Debug, Serialize)]
struct JsonDest {
    address: String,
    port: u16,
    forward: &'static str,
    weight: i32,
    active_conns: u32,
    inactive_conns: u32,
    persistent_conns: u32,
    upper_threshold: u32,
    lower_threshold: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    tunnel: Option<JsonTunnel>,
    stats: JsonCounters,
}

#[derive(Debug, Serialize)]
struct JsonTunnel {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    checksum: &'static str,
}

#[derive(Debug, Serialize)]
struct JsonCounters {
    conns: u64,
    in_packets: u64,
    out_packets: u64,
    in_bytes: u64,
    out_bytes: u64,
    cps: u64,
    in_pps: u64,
    out_pps: u64,
    in_bps: u64,
    out_bps: u64,
}

impl From<&ipvsadm::Counters> for JsonCounters {
    fn from(c: &ipvsadm::Counters) -> Self {
        // JSON carries the full 64-bit counters: ipvsadm's 32-bit truncation is a text quirk.
        JsonCounters {
            conns: c.conns,
            in_packets: c.inpkts,
            out_packets: c.outpkts,
            in_bytes: c.inbytes,
            out_bytes: c.outbytes,
            cps: c.cps,
            in_pps: c.inpps,
            out_pps: c.outpps,
            in_bps: c.inbps,
            out_bps: c.outbps,
        }
    }
}

impl<'a> JsonTable<'a> {
    fn new(table: &Table, services: &[&'a Service]) -> Self {
        let v = table.version;
        JsonTable {
            schema: JSON_SCHEMA,
            version: format!("{}.{}.{}", (v >> 16) & 0xff, (v >> 8) & 0xff, v & 0xff),
            conn_tab_size: table.conn_tab_size,
            services: services.iter().map(|s| JsonService::new(s)).collect(),
        }
    }
}

impl<'a> JsonService<'a> {
    fn new(s: &'a Service) -> Self {
        let v6 = s.af == AF_INET6;
        let fw = s.fwmark != 0;
        let mut flags = Vec::new();
        if s.flags & 0x1 != 0 {
            flags.push("persistent");
        }
        if s.flags & 0x4 != 0 {
            flags.push("one-packet");
        }
        let sched_names: [&'static str; 3] = match s.scheduler.as_str() {
            "sh" => ["sh-fallback", "sh-port", "flag-3"],
            "mh" => ["mh-fallback", "mh-port", "flag-3"],
            _ => ["flag-1", "flag-2", "flag-3"],
        };
        for (bit, name) in [0x8u32, 0x10, 0x20].into_iter().zip(sched_names) {
            if s.flags & bit != 0 {
                flags.push(name);
            }
        }
        let persistence = (s.flags & 0x1 != 0).then(|| JsonPersistence {
            timeout_seconds: s.timeout,
            netmask: if v6 {
                s.netmask.to_string()
            } else {
                std::net::Ipv4Addr::from(s.netmask).to_string()
            },
            pe: &s.pe_name,
        });
        let mut dests: Vec<&ipvsadm::Dest> = s.dests.iter().collect();
        dests.sort_by_key(|d| (d.addr, d.port));
        JsonService {
            family: if v6 { "ipv6" } else { "ipv4" },
            protocol: (!fw).then(|| protocol_name(s.protocol)),
            address: (!fw).then(|| s.addr.to_string()),
            port: (!fw).then_some(s.port),
            fwmark: fw.then_some(s.fwmark),
            scheduler: &s.scheduler,
            flags,
            persistence,
            stats: (&s.stats).into(),
            destinations: dests.into_iter().map(JsonDest::new).collect(),
        }
    }
}

fn protocol_name(p: u16) -> &'static str {
    match p {
        6 => "TCP",
        17 => "UDP",
        132 => "SCTP",
        _ => "unknown",
    }
}

impl JsonDest {
    fn new(d: &ipvsadm::Dest) -> Self {
        let fwd = d.fwd & 0x7;
        let checksum = match d.tun_flags {
            0 => "none",
            1 => "csum",
            2 => "remcsum",
            _ => "unknown",
        };
        let tunnel = (fwd == 2).then_some(match d.tun_type {
            0 => JsonTunnel {
                kind: "ipip",
                port: None,
                checksum: "none",
            },
            1 => JsonTunnel {
                kind: "gue",
                port: Some(d.tun_port),
                checksum,
            },
            2 => JsonTunnel {
                kind: "gre",
                port: None,
                checksum,
            },
            _ => JsonTunnel {
                kind: "unknown",
                port: None,
                checksum,
            },
        });
        JsonDest {
            address: d.addr.to_string(),
            port: d.port,
            forward: match fwd {
                0 => "masq",
                1 => "local",
                2 => "tunnel",
                3 => "route",
                _ => "unknown",
            },
            weight: d.weight,
            active_conns: d.active_conns,
            inactive_conns: d.inact_conns,
            persistent_conns: d.persist_conns,
            upper_threshold: d.u_threshold,
            lower_threshold: d.l_threshold,
            tunnel,
            stats: (&d.stats).into(),
        }
    }
}

/// `kube-ipvs dump`: read the kernel, print, and exit like ipvsadm (1 for "No such service" or a
/// kernel error, 2 for a bad command line).
pub fn main(args: &DumpArgs) -> ExitCode {
    // Check the command line before touching the kernel, so a typo is reported as a typo.
    if let Err(e) = args.selector() {
        eprintln!("kube-ipvs dump: {e}");
        return ExitCode::from(2);
    }
    let mut ipvs = match Ipvs::new() {
        Ok(ipvs) => ipvs,
        Err(e) => {
            eprintln!("kube-ipvs dump: {e}");
            return ExitCode::from(1);
        }
    };
    let text = if args.timeout {
        ipvs.timeouts()
            .map(|t| ipvsadm::render_timeouts(t.tcp, t.tcp_fin, t.udp))
            .map_err(|e| e.to_string())
    } else {
        match crate::ipvsadm::view::read_table(&mut ipvs) {
            Ok(table) => render(&table, args).map_err(|e| match e {
                DumpError::NoSuchService => e.to_string(),
                other => format!("kube-ipvs dump: {other}"),
            }),
            Err(e) => Err(format!("kube-ipvs dump: {e}")),
        }
    };
    match text {
        Ok(text) => {
            let mut out = std::io::stdout().lock();
            // A closed pipe (`kube-ipvs dump | head`) is not an error worth a message.
            let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
            ExitCode::SUCCESS
        }
        Err(msg) => {
            eprintln!("{msg}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipvsadm::{Counters, Dest};
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        dump: DumpArgs,
    }

    fn args(argv: &[&str]) -> DumpArgs {
        Cli::try_parse_from(std::iter::once("dump").chain(argv.iter().copied()))
            .unwrap()
            .dump
    }

    fn table() -> Table {
        let dest = Dest {
            af: 2,
            addr: "10.244.1.5".parse().unwrap(),
            port: 8080,
            fwd: 0,
            weight: 1,
            u_threshold: 0,
            l_threshold: 0,
            active_conns: 2,
            inact_conns: 3,
            persist_conns: 0,
            tun_type: 0,
            tun_port: 0,
            tun_flags: 0,
            stats: Counters {
                conns: 5_000_000_001,
                ..Counters::default()
            },
        };
        let web = Service {
            af: 2,
            protocol: 6,
            addr: "10.96.0.10".parse().unwrap(),
            port: 80,
            fwmark: 0,
            scheduler: "rr".into(),
            flags: 0x3,
            timeout: 10800,
            netmask: 0xffff_ffff,
            pe_name: String::new(),
            stats: Counters::default(),
            dests: vec![dest],
        };
        let mark = Service {
            af: 10,
            fwmark: 7,
            protocol: 6,
            addr: "::".parse().unwrap(),
            port: 0,
            flags: 0x2,
            netmask: 128,
            dests: vec![],
            ..web.clone()
        };
        Table {
            version: 0x010201,
            conn_tab_size: 4096,
            services: vec![web, mark],
        }
    }

    #[test]
    fn flags_pick_columns_like_ipvsadm() {
        assert_eq!(args(&["-n"]).format().columns, Columns::Default);
        assert_eq!(
            args(&["--stats", "--rate"]).format().columns,
            Columns::Stats
        );
        assert_eq!(args(&["-S", "-n"]).format().columns, Columns::Save);
        assert_eq!(args(&["--tun-info"]).format().columns, Columns::TunInfo);
        assert!(
            Cli::try_parse_from(["dump", "--stats", "--thresholds"]).is_err(),
            "ipvsadm's list formats exclude each other"
        );
        assert!(Cli::try_parse_from(["dump", "-6"]).is_err(), "-6 needs -f");
    }

    #[test]
    fn one_service_by_address_or_mark() {
        let t = table();
        let out = render(&t, &args(&["-t", "10.96.0.10:80"])).unwrap();
        assert!(
            out.starts_with("Prot LocalAddress:Port"),
            "no version line: {out}"
        );
        assert!(out.contains("TCP  10.96.0.10:80 rr persistent 10800"));
        let out = render(&t, &args(&["-f", "7", "-6"])).unwrap();
        assert!(out.contains("FWM  7 IPv6 rr"), "{out}");
        assert_eq!(
            render(&t, &args(&["-u", "10.96.0.10:80"])),
            Err(DumpError::NoSuchService)
        );
        assert_eq!(
            render(&t, &args(&["-f", "7"])),
            Err(DumpError::NoSuchService),
            "the IPv4 mark-7 service does not exist"
        );
    }

    #[test]
    fn bad_selectors_name_the_flag() {
        let err = render(&table(), &args(&["-t", "10.96.0.10"])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "-t \"10.96.0.10\": expected ADDR:PORT (IPv6 as [ADDR]:PORT)"
        );
        assert_eq!(
            render(&table(), &args(&["-f", "0"])),
            Err(DumpError::Args(ArgError::ZeroMark))
        );
    }

    #[test]
    fn json_schema() {
        let out = render(&table(), &args(&["--json"])).unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["schema"], JSON_SCHEMA);
        assert_eq!(v["version"], "1.2.1");
        let web = &v["services"][0];
        assert_eq!(web["protocol"], "TCP");
        assert_eq!(web["address"], "10.96.0.10");
        assert_eq!(web["flags"], serde_json::json!(["persistent"]));
        assert_eq!(web["persistence"]["timeout_seconds"], 10800);
        assert_eq!(web["persistence"]["netmask"], "255.255.255.255");
        let d = &web["destinations"][0];
        assert_eq!(d["address"], "10.244.1.5");
        assert_eq!(d["forward"], "masq");
        assert_eq!(d["inactive_conns"], 3);
        assert_eq!(
            d["stats"]["conns"], 5_000_000_001u64,
            "JSON keeps full 64-bit counters"
        );
        let mark = &v["services"][1];
        assert_eq!(mark["fwmark"], 7);
        assert_eq!(mark["family"], "ipv6");
        assert!(mark.get("address").is_none());
    }
}
