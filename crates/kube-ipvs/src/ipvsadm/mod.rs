//! A byte-exact re-implementation of `ipvsadm -Ln` (1.31, as Debian ships it) and its variants.
//!
//! Operators' scripts parse `ipvsadm` output, so `kube-ipvs dump` must print the same bytes for the
//! same kernel table: column widths, trailing spaces, number scaling, glibc's IPv6 text, and the
//! sort order that falls out of ipvsadm's wrapping C comparators. This module is pure: it renders a
//! [`Table`] that the caller read from the kernel, and never talks to the kernel itself.
//!
//! The reference for every rule here is `shared/docs/ipvs-netlink-and-ipvsadm.md` §2; the VM tests
//! compare this renderer with the real `ipvsadm` on the same table.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Address family numbers as the kernel reports them.
pub const AF_INET: u16 = 2;
/// IPv6's address family number.
pub const AF_INET6: u16 = 10;

const IPPROTO_TCP: u16 = 6;
const IPPROTO_UDP: u16 = 17;
const IPPROTO_SCTP: u16 = 132;

const F_PERSISTENT: u32 = 0x1;
const F_ONEPACKET: u32 = 0x4;
const F_SCHED1: u32 = 0x8;
const F_SCHED2: u32 = 0x10;
const F_SCHED3: u32 = 0x20;
const F_SCHED_ANY: u32 = F_SCHED1 | F_SCHED2 | F_SCHED3;

const FWD_MASK: u32 = 0x7;
const FWD_MASQ: u32 = 0;
const FWD_LOCAL: u32 = 1;
const FWD_TUNNEL: u32 = 2;
const FWD_ROUTE: u32 = 3;

const TUN_IPIP: u8 = 0;
const TUN_GUE: u8 = 1;
const TUN_GRE: u8 = 2;

/// The ten counters the kernel keeps per service and destination (its `STATS64` nest).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub conns: u64,
    pub inpkts: u64,
    pub outpkts: u64,
    pub inbytes: u64,
    pub outbytes: u64,
    pub cps: u64,
    pub inpps: u64,
    pub outpps: u64,
    pub inbps: u64,
    pub outbps: u64,
}

/// One virtual service as read from the kernel, with its destinations in kernel order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    /// [`AF_INET`] or [`AF_INET6`].
    pub af: u16,
    /// IP protocol number; ignored for fwmark services.
    pub protocol: u16,
    /// The virtual address (unspecified for fwmark services).
    pub addr: IpAddr,
    pub port: u16,
    /// Non-zero for a firewall-mark service.
    pub fwmark: u32,
    pub scheduler: String,
    /// `IP_VS_SVC_F_*` bits.
    pub flags: u32,
    /// Persistence timeout in seconds.
    pub timeout: u32,
    /// IPv4: the mask as a host-order integer (255.255.255.0 = 0xffffff00). IPv6: a prefix length.
    pub netmask: u32,
    /// Persistence engine, empty when none.
    pub pe_name: String,
    pub stats: Counters,
    pub dests: Vec<Dest>,
}

/// One real server of a [`Service`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dest {
    pub af: u16,
    pub addr: IpAddr,
    pub port: u16,
    /// `IP_VS_CONN_F_*` forwarding method bits (masked with 0x7 when shown).
    pub fwd: u32,
    pub weight: i32,
    pub u_threshold: u32,
    pub l_threshold: u32,
    pub active_conns: u32,
    pub inact_conns: u32,
    pub persist_conns: u32,
    pub tun_type: u8,
    pub tun_port: u16,
    pub tun_flags: u16,
    pub stats: Counters,
}

/// The whole table: what `GET_INFO` and the service dump return.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Table {
    /// `IP_VS_VERSION_CODE`, e.g. 0x010201.
    pub version: u32,
    pub conn_tab_size: u32,
    pub services: Vec<Service>,
}

/// Which columns to print; mirrors ipvsadm's mutually exclusive list formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Columns {
    /// `ipvsadm -Ln`.
    #[default]
    Default,
    /// `--stats`.
    Stats,
    /// `--rate`.
    Rate,
    /// `--thresholds`.
    Thresholds,
    /// `--persistent-conn`.
    PersistentConn,
    /// `--tun-info`.
    TunInfo,
    /// `-S` (save): the rules as `ipvsadm -R` input.
    Save,
}

/// The list options that change output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Format {
    pub columns: Columns,
    /// `--exact`: print counters unscaled.
    pub exact: bool,
    /// `--nosort`: keep kernel order.
    pub nosort: bool,
}

/// `ipvsadm -Ln [options]`: the version line (not for `--save`), the titles, every service.
pub fn render_table(table: &Table, format: Format) -> String {
    let mut out = String::new();
    if format.columns != Columns::Save {
        let v = table.version;
        let _ = writeln!(
            out,
            "IP Virtual Server version {}.{}.{} (size={})",
            (v >> 16) & 0xff,
            (v >> 8) & 0xff,
            v & 0xff,
            // ipvsadm prints the size with %d.
            table.conn_tab_size as i32
        );
    }
    render_title(&mut out, format.columns);
    let mut services: Vec<&Service> = table.services.iter().collect();
    if !format.nosort {
        glibc_msort(&mut services, |a, b| cmp_services(a, b));
    }
    for svc in services {
        render_service(&mut out, svc, format);
    }
    out
}

/// `ipvsadm -Ln -t VIP:PORT` and friends: the titles and one service, no version line.
pub fn render_one(svc: &Service, format: Format) -> String {
    let mut out = String::new();
    render_title(&mut out, format.columns);
    render_service(&mut out, svc, format);
    out
}

/// `ipvsadm -Ln --timeout`.
pub fn render_timeouts(tcp: u32, tcp_fin: u32, udp: u32) -> String {
    format!(
        "Timeout (tcp tcpfin udp): {} {} {}\n",
        tcp as i32, tcp_fin as i32, udp as i32
    )
}

fn render_title(out: &mut String, columns: Columns) {
    let second = "  -> RemoteAddress:Port\n";
    match columns {
        Columns::Stats => {
            let _ = writeln!(
                out,
                "{:<33} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "Prot LocalAddress:Port", "Conns", "InPkts", "OutPkts", "InBytes", "OutBytes"
            );
            out.push_str(second);
        }
        Columns::Rate => {
            let _ = writeln!(
                out,
                "{:<33} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "Prot LocalAddress:Port", "CPS", "InPPS", "OutPPS", "InBPS", "OutBPS"
            );
            out.push_str(second);
        }
        Columns::Thresholds => {
            let _ = writeln!(
                out,
                "{:<33} {:<10} {:<10} {:<10} {:<10}",
                "Prot LocalAddress:Port", "Uthreshold", "Lthreshold", "ActiveConn", "InActConn"
            );
            out.push_str(second);
        }
        Columns::PersistentConn => {
            let _ = writeln!(
                out,
                "{:<33} {:<9} {:<11} {:<10} {:<10}",
                "Prot LocalAddress:Port", "Weight", "PersistConn", "ActiveConn", "InActConn"
            );
            out.push_str(second);
        }
        Columns::TunInfo => out.push_str(
            "Prot LocalAddress:Port Scheduler Flags\n  -> RemoteAddress:Port           Forward TunnelInfo    Weight ActiveConn InActConn\n",
        ),
        Columns::Default => out.push_str(
            "Prot LocalAddress:Port Scheduler Flags\n  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n",
        ),
        Columns::Save => {}
    }
}

fn render_service(out: &mut String, svc: &Service, format: Format) {
    let save = format.columns == Columns::Save;
    let svc_name = service_name(svc, save);

    if save {
        let _ = write!(out, "-A {svc_name} -s {}", svc.scheduler);
        if svc.flags & F_PERSISTENT != 0 {
            let _ = write!(out, " -p {}", svc.timeout);
            write_mask(out, svc, " -M ");
        }
        if !svc.pe_name.is_empty() {
            let _ = write!(out, " --pe {}", svc.pe_name);
        }
        if svc.flags & F_ONEPACKET != 0 {
            out.push_str(" -o");
        }
        if svc.flags & F_SCHED_ANY != 0 {
            out.push_str(" -b ");
            out.push_str(&sched_flags(svc));
        }
    } else if format.columns == Columns::Stats {
        let _ = write!(out, "{svc_name:<33}");
        let s = &svc.stats;
        for v in [s.conns, s.inpkts, s.outpkts, s.inbytes, s.outbytes] {
            largenum(out, v, format.exact);
        }
    } else if format.columns == Columns::Rate {
        let _ = write!(out, "{svc_name:<33}");
        let s = &svc.stats;
        for v in [s.cps, s.inpps, s.outpps, s.inbps, s.outbps] {
            largenum(out, v, format.exact);
        }
    } else {
        let _ = write!(out, "{svc_name} {}", svc.scheduler);
        if svc.flags & F_SCHED_ANY != 0 {
            let _ = write!(out, " ({})", sched_flags(svc));
        }
        if svc.flags & F_PERSISTENT != 0 {
            let _ = write!(out, " persistent {}", svc.timeout);
            write_mask(out, svc, " mask ");
            if !svc.pe_name.is_empty() {
                let _ = write!(out, " pe {}", svc.pe_name);
            }
        }
        if svc.flags & F_ONEPACKET != 0 {
            out.push_str(" ops");
        }
    }
    out.push('\n');

    let mut dests: Vec<&Dest> = svc.dests.iter().collect();
    if !format.nosort {
        glibc_msort(&mut dests, |a, b| cmp_dests(a, b));
    }
    for d in dests {
        render_dest(out, &svc_name, d, format);
    }
}

fn render_dest(out: &mut String, svc_name: &str, d: &Dest, format: Format) {
    let mut dname = addrport(d.af, d.addr, d.port);
    let fwd = d.fwd & FWD_MASK;
    match format.columns {
        Columns::Save => {
            let _ = write!(
                out,
                "-a {svc_name} -r {dname} {} -w {}",
                fwd_switch(fwd),
                d.weight
            );
            if fwd == FWD_TUNNEL {
                match d.tun_type {
                    TUN_IPIP => out.push_str(" --tun-type ipip"),
                    TUN_GUE => {
                        let _ = write!(
                            out,
                            " --tun-type gue --tun-port {} {}",
                            d.tun_port,
                            tun_flag(
                                d.tun_flags,
                                &["--tun-nocsum", "--tun-csum", "--tun-remcsum"]
                            )
                        );
                    }
                    TUN_GRE => {
                        let _ = write!(
                            out,
                            " --tun-type gre {}",
                            tun_flag(
                                d.tun_flags,
                                &["--tun-nocsum", "--tun-csum", "--tun-remcsum"]
                            )
                        );
                    }
                    _ => {}
                }
            }
            out.push('\n');
            return;
        }
        _ => {
            // ipvsadm cuts IPv4 destination names at 28 bytes (they never reach it).
            if d.af != AF_INET6 {
                dname.truncate(28);
            }
        }
    }
    match format.columns {
        Columns::Stats => {
            let _ = write!(out, "  -> {dname:<28}");
            // libipvs reads a destination's STATS64 with its 32-bit reader: only the byte
            // counters keep their high half. Copied on purpose (see the module docs).
            let s = &d.stats;
            for v in [
                low32(s.conns),
                low32(s.inpkts),
                low32(s.outpkts),
                s.inbytes,
                s.outbytes,
            ] {
                largenum(out, v, format.exact);
            }
            out.push('\n');
        }
        Columns::Rate => {
            let s = &d.stats;
            let _ = write!(
                out,
                "  -> {dname:<28} {:>8} {:>8} {:>8}",
                low32(s.cps),
                low32(s.inpps),
                low32(s.outpps)
            );
            largenum(out, low32(s.inbps), format.exact);
            largenum(out, low32(s.outbps), format.exact);
            out.push('\n');
        }
        Columns::Thresholds => {
            let _ = writeln!(
                out,
                "  -> {dname:<28} {:<10} {:<10} {:<10} {:<10}",
                d.u_threshold, d.l_threshold, d.active_conns, d.inact_conns
            );
        }
        Columns::PersistentConn => {
            // %-9u of an int weight: a negative weight would print as its u32 value.
            let _ = writeln!(
                out,
                "  -> {dname:<28} {:<9} {:<11} {:<10} {:<10}",
                d.weight as u32, d.persist_conns, d.active_conns, d.inact_conns
            );
        }
        Columns::TunInfo => {
            let info = tun_info(d);
            let _ = writeln!(
                out,
                "  -> {dname:<28} {:<7} {info:<13} {:<6} {:<10} {:<10}",
                fwd_name(fwd),
                d.weight,
                d.active_conns,
                d.inact_conns
            );
        }
        Columns::Default | Columns::Save => {
            // The hot path of `dump` on large tables: plain pushes instead of `write!` padding.
            out.push_str("  -> ");
            push_padded(out, &dname, 28);
            out.push(' ');
            push_padded(out, fwd_name(fwd), 7);
            out.push(' ');
            push_padded(out, itoa(&mut NumBuf::default(), i64::from(d.weight)), 6);
            out.push(' ');
            push_padded(
                out,
                itoa(&mut NumBuf::default(), i64::from(d.active_conns)),
                10,
            );
            out.push(' ');
            push_padded(
                out,
                itoa(&mut NumBuf::default(), i64::from(d.inact_conns)),
                10,
            );
            out.push('\n');
        }
    }
}

/// `%-Ns`: the text, then spaces up to `width` bytes (never cut).
fn push_padded(out: &mut String, text: &str, width: usize) {
    out.push_str(text);
    for _ in text.len()..width {
        out.push(' ');
    }
}

/// Room for any `i64` in decimal.
#[derive(Default)]
struct NumBuf([u8; 20]);

/// Decimal text of `v` in `buf`, without going through `fmt`.
fn itoa(buf: &mut NumBuf, v: i64) -> &str {
    let mut n = v.unsigned_abs();
    let mut i = buf.0.len();
    loop {
        i -= 1;
        buf.0[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if v < 0 {
        i -= 1;
        buf.0[i] = b'-';
    }
    // Only ASCII digits and '-' were written.
    std::str::from_utf8(&buf.0[i..]).unwrap_or("?")
}

fn low32(v: u64) -> u64 {
    v & 0xffff_ffff
}

/// The service's name column: `TCP  10.0.0.1:80`, `FWM  100 IPv6`, or `-t 10.0.0.1:80` for save.
fn service_name(svc: &Service, save: bool) -> String {
    if svc.fwmark != 0 {
        // Debian's 1.31 prints the mark with %d, so marks above 2^31 come out negative.
        let mark = svc.fwmark as i32;
        let v6 = svc.af == AF_INET6;
        return match (save, v6) {
            (true, true) => format!("-f {mark} -6"),
            (true, false) => format!("-f {mark}"),
            (false, true) => format!("FWM  {mark} IPv6"),
            (false, false) => format!("FWM  {mark}"),
        };
    }
    let vname = addrport(svc.af, svc.addr, svc.port);
    if save {
        let opt = match svc.protocol {
            IPPROTO_TCP => "-t",
            IPPROTO_UDP => "-u",
            IPPROTO_SCTP => "--sctp-service",
            _ => "--xxx-service",
        };
        format!("{opt} {vname}")
    } else {
        let proto = match svc.protocol {
            IPPROTO_TCP => "TCP",
            IPPROTO_UDP => "UDP",
            IPPROTO_SCTP => "SCTP",
            _ => "?",
        };
        let mut name = format!("{proto:<4} {vname}");
        if svc.af != AF_INET6 {
            name.truncate(33);
        }
        name
    }
}

fn write_mask(out: &mut String, svc: &Service, prefix: &str) {
    if svc.af == AF_INET && svc.netmask != 0xffff_ffff {
        let _ = write!(out, "{prefix}{}", Ipv4Addr::from(svc.netmask));
    } else if svc.af == AF_INET6 && svc.netmask != 128 {
        let _ = write!(out, "{prefix}{}", svc.netmask as i32);
    }
}

fn sched_flags(svc: &Service) -> String {
    let names: [&str; 3] = match svc.scheduler.as_str() {
        // ipvsadm names only the first two bits for sh and mh and drops the third.
        "sh" => ["sh-fallback", "sh-port", ""],
        "mh" => ["mh-fallback", "mh-port", ""],
        _ => ["flag-1", "flag-2", "flag-3"],
    };
    [F_SCHED1, F_SCHED2, F_SCHED3]
        .iter()
        .zip(names)
        .filter(|(bit, name)| svc.flags & **bit != 0 && !name.is_empty())
        .map(|(_, name)| name)
        .collect::<Vec<_>>()
        .join(",")
}

fn fwd_name(fwd: u32) -> &'static str {
    match fwd {
        FWD_MASQ => "Masq",
        FWD_LOCAL => "Local",
        FWD_TUNNEL => "Tunnel",
        FWD_ROUTE => "Route",
        // glibc's printf prints a NULL string as "(null)".
        _ => "(null)",
    }
}

fn fwd_switch(fwd: u32) -> &'static str {
    match fwd {
        FWD_MASQ => "-m",
        FWD_TUNNEL => "-i",
        FWD_LOCAL | FWD_ROUTE => "-g",
        _ => "(null)",
    }
}

fn tun_flag(flags: u16, names: &[&'static str; 3]) -> &'static str {
    names.get(usize::from(flags)).copied().unwrap_or("(null)")
}

fn tun_info(d: &Dest) -> String {
    if d.fwd & FWD_MASK != FWD_TUNNEL {
        return "n/a".into();
    }
    let flags = tun_flag(d.tun_flags, &["-c", "+c", "r+c"]);
    match d.tun_type {
        TUN_IPIP => "ipip".into(),
        TUN_GUE => format!("gue:{}:{flags}", d.tun_port),
        TUN_GRE => format!("gre:{flags}"),
        _ => "n/a".into(),
    }
}

/// ipvsadm's `print_largenum`: a leading space and 8 columns, scaled unless `--exact`.
fn largenum(out: &mut String, v: u64, exact: bool) {
    if exact {
        let _ = write!(out, " {v:>8}");
        return;
    }
    let _ = match v {
        0..100_000_000 => write!(out, "{v:>9}"),
        100_000_000..1_000_000_000 => write!(out, "{:>8}K", v / 1_000),
        1_000_000_000..100_000_000_000 => write!(out, "{:>8}M", v / 1_000_000),
        100_000_000_000..100_000_000_000_000 => write!(out, "{:>8}G", v / 1_000_000_000),
        _ => write!(out, "{:>8}T", v / 1_000_000_000_000),
    };
}

/// `addr:port` with glibc's text for the address; IPv6 in brackets.
pub fn addrport(af: u16, addr: IpAddr, port: u16) -> String {
    match (af, addr) {
        (AF_INET6, IpAddr::V6(a)) => format!("[{}]:{port}", glibc_ntop6(&a)),
        (AF_INET6, IpAddr::V4(a)) => format!("[{}]:{port}", glibc_ntop6(&a.to_ipv6_compatible())),
        (_, IpAddr::V4(a)) => {
            let mut s = String::with_capacity(21);
            let _ = write!(s, "{a}:{port}");
            s
        }
        (_, IpAddr::V6(a)) => {
            // An AF_INET entry holding a v6 address cannot come from the kernel; print the
            // first four bytes as ipvsadm would.
            let o = a.octets();
            format!("{}:{port}", Ipv4Addr::new(o[0], o[1], o[2], o[3]))
        }
    }
}

/// glibc's `inet_ntop(AF_INET6)`: like RFC 5952 text, except that IPv4-compatible addresses
/// (`::a.b.c.d` with a non-zero seventh group) keep the dotted form that Rust's `Display` drops.
pub fn glibc_ntop6(addr: &Ipv6Addr) -> String {
    let words = addr.segments();
    // The longest run of zero words (the first one on a tie), if it is at least two long.
    let (mut best_base, mut best_len) = (usize::MAX, 0usize);
    let (mut cur_base, mut cur_len) = (usize::MAX, 0usize);
    for (i, w) in words.iter().enumerate() {
        if *w == 0 {
            if cur_len == 0 {
                cur_base = i;
            }
            cur_len += 1;
        } else if cur_len > 0 {
            if cur_len > best_len {
                (best_base, best_len) = (cur_base, cur_len);
            }
            cur_len = 0;
        }
    }
    if cur_len > best_len {
        (best_base, best_len) = (cur_base, cur_len);
    }
    if best_len < 2 {
        best_base = usize::MAX;
    }

    let mut out = String::with_capacity(40);
    let mut i = 0;
    while i < 8 {
        if best_base != usize::MAX && i >= best_base && i < best_base + best_len {
            if i == best_base {
                out.push(':');
            }
            i += 1;
            continue;
        }
        if i != 0 {
            out.push(':');
        }
        if i == 6 && best_base == 0 && (best_len == 6 || (best_len == 5 && words[5] == 0xffff)) {
            let o = addr.octets();
            let _ = write!(out, "{}.{}.{}.{}", o[12], o[13], o[14], o[15]);
            return out;
        }
        let _ = write!(out, "{:x}", words[i]);
        i += 1;
    }
    if best_base != usize::MAX && best_base + best_len == 8 {
        out.push(':');
    }
    out
}

/// The C `int` difference of two host-order words, wrapping as ipvsadm's comparators do.
fn cdiff(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

/// The address as the four host-order words of the kernel's `union nf_inet_addr`; an IPv4
/// address sits in the first word and the rest are zero.
fn words(addr: IpAddr) -> [u32; 4] {
    match addr {
        IpAddr::V4(a) => [u32::from(a), 0, 0, 0],
        IpAddr::V6(a) => {
            let s = a.segments();
            [0, 1, 2, 3].map(|i| (u32::from(s[2 * i]) << 16) | u32::from(s[2 * i + 1]))
        }
    }
}

fn cmp_addr(left_af: u16, a: IpAddr, b: IpAddr) -> i32 {
    let (wa, wb) = (words(a), words(b));
    let n = if left_af == AF_INET6 { 4 } else { 1 };
    for i in 0..n {
        let r = cdiff(wa[i], wb[i]);
        if r != 0 {
            return r;
        }
    }
    0
}

/// ipvsadm's `ipvs_cmp_services`: fwmark, af, protocol, address, port, as wrapping C ints.
fn cmp_services(a: &Service, b: &Service) -> i32 {
    let r = cdiff(a.fwmark, b.fwmark);
    if r != 0 {
        return r;
    }
    let r = i32::from(a.af) - i32::from(b.af);
    if r != 0 {
        return r;
    }
    let r = i32::from(a.protocol) - i32::from(b.protocol);
    if r != 0 {
        return r;
    }
    let r = cmp_addr(a.af, a.addr, b.addr);
    if r != 0 {
        return r;
    }
    i32::from(a.port) - i32::from(b.port)
}

/// ipvsadm's `ipvs_cmp_dests`: the address (4 words if the left one is IPv6), then the port.
fn cmp_dests(a: &Dest, b: &Dest) -> i32 {
    let r = cmp_addr(a.af, a.addr, b.addr);
    if r != 0 {
        return r;
    }
    i32::from(a.port) - i32::from(b.port)
}

/// glibc 2.36's `qsort`, which is a top-down merge sort: the comparators above are not
/// transitive, so only the same algorithm gives the same order.
fn glibc_msort<T: Copy>(v: &mut [T], cmp: impl Fn(&T, &T) -> i32 + Copy) {
    if v.len() <= 1 {
        return;
    }
    let mut scratch = Vec::with_capacity(v.len());
    msort_with(v, &mut scratch, cmp);
}

fn msort_with<T: Copy>(v: &mut [T], scratch: &mut Vec<T>, cmp: impl Fn(&T, &T) -> i32 + Copy) {
    let n = v.len();
    if n <= 1 {
        return;
    }
    let n1 = n / 2;
    msort_with(&mut v[..n1], scratch, cmp);
    msort_with(&mut v[n1..], scratch, cmp);
    scratch.clear();
    let (mut i, mut j) = (0, n1);
    while i < n1 && j < n {
        if cmp(&v[i], &v[j]) <= 0 {
            scratch.push(v[i]);
            i += 1;
        } else {
            scratch.push(v[j]);
            j += 1;
        }
    }
    // What is left of the right half is already in place.
    scratch.extend_from_slice(&v[i..n1]);
    let merged = scratch.len();
    v[..merged].copy_from_slice(scratch);
}

#[cfg(test)]
mod tests;
pub mod view;
