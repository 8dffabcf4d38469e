//! Pure IPVS types: services, destinations, their statistics and the global settings, with parsing from the
//! attribute bytes the kernel sends and emitting back to the same bytes.
//!
//! Nothing here touches a socket. Each type keeps everything `ipvsadm` can show, both statistics blocks exactly as
//! received, and any attribute this crate does not know (`other`), so a dump from a newer kernel still decodes and
//! re-emits losslessly.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// `AF_INET` from `sys/socket.h`, as the `u16` IPVS attributes carry it.
const AF_INET: u16 = 2;
/// `AF_INET6` on Linux.
const AF_INET6: u16 = 10;

use netlink_packet_core::{DefaultNla, Emitable};

use super::wire::{self, Raw, Writer};
use crate::error::{Error, Result};

/// Address family of a service or destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// `AF_INET` (2).
    Inet,
    /// `AF_INET6` (10).
    Inet6,
}

impl Family {
    /// The `AF_*` number.
    #[must_use]
    pub fn raw(self) -> u16 {
        match self {
            Family::Inet => AF_INET,
            Family::Inet6 => AF_INET6,
        }
    }

    /// Decodes an `AF_*` number.
    pub fn from_raw(af: u16) -> Result<Self> {
        Self::decode(af).map_err(|e| Error::decode("address family", format!("{e}: {af}")))
    }

    fn decode(af: u16) -> Raw<Self> {
        match i32::from(af) {
            libc::AF_INET => Ok(Family::Inet),
            libc::AF_INET6 => Ok(Family::Inet6),
            _ => Err("unsupported address family"),
        }
    }

    /// The family of an address.
    #[must_use]
    pub fn of(addr: &IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Family::Inet,
            IpAddr::V6(_) => Family::Inet6,
        }
    }
}

/// Transport protocol of a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// 6.
    Tcp,
    /// 17.
    Udp,
    /// 132.
    Sctp,
    /// Any other number the kernel reports; never accepted in a request.
    Other(u16),
}

impl Protocol {
    /// The IP protocol number.
    #[must_use]
    pub fn raw(self) -> u16 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
            Protocol::Other(p) => p,
        }
    }

    /// Decodes an IP protocol number.
    #[must_use]
    pub fn from_raw(p: u16) -> Self {
        match p {
            6 => Protocol::Tcp,
            17 => Protocol::Udp,
            132 => Protocol::Sctp,
            p => Protocol::Other(p),
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Protocol::Tcp => f.write_str("TCP"),
            Protocol::Udp => f.write_str("UDP"),
            Protocol::Sctp => f.write_str("SCTP"),
            Protocol::Other(p) => write!(f, "proto {p}"),
        }
    }
}

/// What identifies a virtual service: a firewall mark, or protocol + address + port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServiceKey {
    /// A fwmark service (`ipvsadm -f`).
    Fwmark {
        /// Which family's packets the mark selects.
        family: Family,
        /// The mark; never 0.
        mark: u32,
    },
    /// A TCP, UDP or SCTP service on one address and port.
    Addr {
        /// Transport protocol.
        protocol: Protocol,
        /// Virtual address; its type gives the family.
        addr: IpAddr,
        /// Virtual port.
        port: u16,
    },
}

impl ServiceKey {
    /// Shorthand for a TCP service.
    #[must_use]
    pub fn tcp(addr: IpAddr, port: u16) -> Self {
        ServiceKey::Addr {
            protocol: Protocol::Tcp,
            addr,
            port,
        }
    }

    /// Shorthand for a UDP service.
    #[must_use]
    pub fn udp(addr: IpAddr, port: u16) -> Self {
        ServiceKey::Addr {
            protocol: Protocol::Udp,
            addr,
            port,
        }
    }

    /// The address family.
    #[must_use]
    pub fn family(&self) -> Family {
        match self {
            ServiceKey::Fwmark { family, .. } => *family,
            ServiceKey::Addr { addr, .. } => Family::of(addr),
        }
    }

    /// Writes AF plus FWMARK, or AF plus PROTOCOL, ADDR and PORT, in the kernel's order.
    pub(crate) fn emit_attrs(&self, w: &mut Writer<'_>) {
        w.put_u16(wire::SVC_AF, self.family().raw());
        match self {
            ServiceKey::Fwmark { mark, .. } => w.put_u32(wire::SVC_FWMARK, *mark),
            ServiceKey::Addr {
                protocol,
                addr,
                port,
            } => {
                w.put_u16(wire::SVC_PROTOCOL, protocol.raw());
                w.put(wire::SVC_ADDR, &addr_bytes(addr));
                w.put_u16_be(wire::SVC_PORT, *port);
            }
        }
    }

    /// Writes a SERVICE nest holding only the identifying attributes.
    pub(crate) fn emit_nest(&self, w: &mut Writer<'_>) {
        let nest = w.begin_nest(wire::CMD_ATTR_SERVICE);
        self.emit_attrs(w);
        w.end_nest(nest);
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServiceKey::Fwmark {
                family: Family::Inet,
                mark,
            } => write!(f, "FWM {mark}"),
            ServiceKey::Fwmark {
                family: Family::Inet6,
                mark,
            } => write!(f, "FWM {mark} IPv6"),
            ServiceKey::Addr {
                protocol,
                addr: IpAddr::V4(a),
                port,
            } => write!(f, "{protocol} {a}:{port}"),
            ServiceKey::Addr {
                protocol,
                addr: IpAddr::V6(a),
                port,
            } => write!(f, "{protocol} [{a}]:{port}"),
        }
    }
}

/// `struct ip_vs_flags`: the service flags and which of them a request changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags {
    /// The flag bits (`IP_VS_SVC_F_*`).
    pub flags: u32,
    /// Which bits to change; the kernel computes `(old & !mask) | (flags & mask)`. Replies carry `0xffffffff`.
    pub mask: u32,
}

impl Flags {
    /// Persistent service (`-p`).
    pub const PERSISTENT: u32 = 0x1;
    /// Kernel-internal "hashed" bit; every dumped service has it.
    pub const HASHED: u32 = 0x2;
    /// One-packet scheduling (`-o`).
    pub const ONEPACKET: u32 = 0x4;
    /// Scheduler flag 1 (`sh-fallback`, `mh-fallback`).
    pub const SCHED1: u32 = 0x8;
    /// Scheduler flag 2 (`sh-port`, `mh-port`).
    pub const SCHED2: u32 = 0x10;
    /// Scheduler flag 3.
    pub const SCHED3: u32 = 0x20;

    /// Sets exactly `flags`, as ipvsadm does (mask all ones).
    #[must_use]
    pub fn exactly(flags: u32) -> Self {
        Flags {
            flags,
            mask: u32::MAX,
        }
    }

    /// Whether `bit` is set in `flags`.
    #[must_use]
    pub fn has(&self, bit: u32) -> bool {
        self.flags & bit != 0
    }
}

/// Persistence granularity: an IPv4 mask, or an IPv6 prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Netmask {
    /// IPv4 mask; 255.255.255.255 is the default.
    V4(Ipv4Addr),
    /// IPv6 prefix length, 1..=128; 128 is the default.
    V6(u8),
}

impl Netmask {
    /// The default for a family: all ones for IPv4, /128 for IPv6.
    #[must_use]
    pub fn default_for(family: Family) -> Self {
        match family {
            Family::Inet => Netmask::V4(Ipv4Addr::BROADCAST),
            Family::Inet6 => Netmask::V6(128),
        }
    }

    fn raw(self) -> [u8; 4] {
        match self {
            // The kernel stores an IPv4 mask as a __be32, so the wire bytes are the address octets.
            Netmask::V4(m) => m.octets(),
            Netmask::V6(p) => u32::from(p).to_ne_bytes(),
        }
    }

    fn from_raw(family: Family, raw: [u8; 4]) -> Raw<Self> {
        match family {
            Family::Inet => Ok(Netmask::V4(Ipv4Addr::from(raw))),
            Family::Inet6 => u8::try_from(u32::from_ne_bytes(raw))
                .map(Netmask::V6)
                .map_err(|_| "IPv6 netmask prefix above 255"),
        }
    }
}

/// The ten IPVS counters. Used for both STATS (where the kernel truncates all but the byte counters to 32 bits)
/// and STATS64; they are kept separately, as received.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Stats {
    /// Connections scheduled.
    pub conns: u64,
    /// Incoming packets.
    pub inpkts: u64,
    /// Outgoing packets.
    pub outpkts: u64,
    /// Incoming bytes.
    pub inbytes: u64,
    /// Outgoing bytes.
    pub outbytes: u64,
    /// Connections per second.
    pub cps: u64,
    /// Incoming packets per second.
    pub inpps: u64,
    /// Outgoing packets per second.
    pub outpps: u64,
    /// Incoming bytes per second.
    pub inbps: u64,
    /// Outgoing bytes per second.
    pub outbps: u64,
}

const STATS_PAD: u16 = 11;

impl Stats {
    fn field(&mut self, kind: u16) -> Option<&mut u64> {
        Some(match kind {
            1 => &mut self.conns,
            2 => &mut self.inpkts,
            3 => &mut self.outpkts,
            4 => &mut self.inbytes,
            5 => &mut self.outbytes,
            6 => &mut self.cps,
            7 => &mut self.inpps,
            8 => &mut self.outpps,
            9 => &mut self.inbps,
            10 => &mut self.outbps,
            _ => return None,
        })
    }

    /// Parses a STATS or STATS64 nest; each counter is read at the width it was sent with.
    fn parse(nest: &[u8]) -> Raw<Self> {
        let mut s = Stats::default();
        let mut it = wire::attrs(nest);
        for (kind, value, _) in &mut it {
            if kind == STATS_PAD {
                continue;
            }
            if let Some(slot) = s.field(kind) {
                *slot = match value.len() {
                    8 => wire::read_u64(value)?,
                    _ => u64::from(wire::read_u32(value)?),
                };
            }
        }
        it.finish()?;
        Ok(s)
    }

    /// Emits the nest as the kernel fills it: in STATS only the byte counters are 64-bit. A
    /// counter too wide for its 32-bit slot (never the kernel's, but the parse takes it) goes out
    /// at 64 bits rather than cut, so emit then parse gives back what was parsed.
    fn emit(&self, w: &mut Writer<'_>, kind: u16, wide: bool) {
        let nest = w.begin_nest(kind);
        let mut copy = *self;
        for k in 1..=10u16 {
            let v = copy.field(k).map_or(0, |v| *v);
            match u32::try_from(v) {
                Ok(narrow) if !(wide || k == 4 || k == 5) => w.put_u32(k, narrow),
                _ => w.put_u64(k, v),
            }
        }
        w.end_nest(nest);
    }
}

/// A virtual service as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    /// What identifies the service.
    pub key: ServiceKey,
    /// Scheduler name (`rr`, `wlc`, `sh`, `mh`, ...).
    pub scheduler: String,
    /// Persistence engine (`sip`), if any.
    pub pe_name: Option<String>,
    /// Flags and the mask of flags a request changes.
    pub flags: Flags,
    /// Persistence timeout in seconds.
    pub timeout: u32,
    /// Persistence netmask.
    pub netmask: Netmask,
    /// The STATS nest, in replies.
    pub stats: Option<Stats>,
    /// The STATS64 nest, in replies.
    pub stats64: Option<Stats>,
    /// Attributes this crate does not know, kept so they round-trip.
    pub other: Vec<DefaultNla>,
}

impl Service {
    /// A service with the given scheduler, no persistence and no flags.
    #[must_use]
    pub fn new(key: ServiceKey, scheduler: &str) -> Self {
        Service {
            key,
            scheduler: scheduler.to_owned(),
            pe_name: None,
            flags: Flags::exactly(0),
            timeout: 0,
            netmask: Netmask::default_for(key.family()),
            stats: None,
            stats64: None,
            other: Vec::new(),
        }
    }

    /// Parses the attributes inside a SERVICE nest.
    pub fn parse(nest: &[u8]) -> Result<Self> {
        Self::parse_raw(nest).map_err(|e| Error::decode("service", e))
    }

    fn parse_raw(nest: &[u8]) -> Raw<Self> {
        let mut af = None;
        let mut protocol = None;
        let mut addr: Option<&[u8]> = None;
        let mut port = None;
        let mut fwmark = None;
        let mut scheduler = None;
        let mut pe_name = None;
        let mut flags = None;
        let mut timeout = 0;
        let mut netmask = None;
        let mut stats = None;
        let mut stats64 = None;
        let mut other = Vec::new();
        let mut it = wire::attrs(nest);
        for (kind, v, whole) in &mut it {
            match kind {
                wire::SVC_AF => af = Some(Family::decode(wire::read_u16(v)?)?),
                wire::SVC_PROTOCOL => protocol = Some(Protocol::from_raw(wire::read_u16(v)?)),
                wire::SVC_ADDR => addr = Some(v),
                wire::SVC_PORT => port = Some(wire::read_u16_be(v)?),
                wire::SVC_FWMARK => fwmark = Some(wire::read_u32(v)?),
                wire::SVC_SCHED_NAME => scheduler = Some(wire::read_str(v)?),
                wire::SVC_PE_NAME => pe_name = Some(wire::read_str(v)?),
                wire::SVC_FLAGS => {
                    let f = wire::read_u32(v)?;
                    let m = wire::read_u32(v.get(4..).unwrap_or(&[]))?;
                    flags = Some(Flags { flags: f, mask: m });
                }
                wire::SVC_TIMEOUT => timeout = wire::read_u32(v)?,
                wire::SVC_NETMASK => {
                    netmask = Some(wire::read_u32(v)?.to_ne_bytes());
                }
                wire::SVC_STATS => stats = Some(Stats::parse(v)?),
                wire::SVC_STATS64 => stats64 = Some(Stats::parse(v)?),
                _ => other.push(raw_nla(whole)),
            }
        }
        it.finish()?;
        let af = af.ok_or("no address family")?;
        let key = match (fwmark, protocol, addr, port) {
            (Some(mark), ..) if mark != 0 => ServiceKey::Fwmark { family: af, mark },
            (_, Some(protocol), Some(addr), Some(port)) => ServiceKey::Addr {
                protocol,
                addr: parse_addr(addr, af)?,
                port,
            },
            _ => return Err("neither a fwmark nor protocol, address and port"),
        };
        let netmask = match netmask {
            Some(raw) => Netmask::from_raw(af, raw)?,
            None => Netmask::default_for(af),
        };
        Ok(Service {
            key,
            scheduler: scheduler.unwrap_or_default(),
            pe_name,
            flags: flags.unwrap_or_default(),
            timeout,
            netmask,
            stats,
            stats64,
            other,
        })
    }

    /// Emits the attributes of a SERVICE nest in the kernel's reply order: the key, SCHED_NAME, PE_NAME, FLAGS,
    /// TIMEOUT, NETMASK, then STATS and STATS64 when present, then unknown attributes.
    pub fn emit(&self, out: &mut Vec<u8>) {
        self.emit_attrs(&mut Writer::new(out), true);
    }

    pub(crate) fn emit_attrs(&self, w: &mut Writer<'_>, with_output: bool) {
        self.key.emit_attrs(w);
        w.put_str(wire::SVC_SCHED_NAME, &self.scheduler);
        if let Some(pe) = &self.pe_name {
            w.put_str(wire::SVC_PE_NAME, pe);
        }
        let mut fm = [0u8; 8];
        fm[..4].copy_from_slice(&self.flags.flags.to_ne_bytes());
        fm[4..].copy_from_slice(&self.flags.mask.to_ne_bytes());
        w.put(wire::SVC_FLAGS, &fm);
        w.put_u32(wire::SVC_TIMEOUT, self.timeout);
        w.put(wire::SVC_NETMASK, &self.netmask.raw());
        if with_output {
            if let Some(s) = &self.stats {
                s.emit(w, wire::SVC_STATS, false);
            }
            if let Some(s) = &self.stats64 {
                s.emit(w, wire::SVC_STATS64, true);
            }
            emit_other(w, &self.other);
        }
    }

    /// Whether the service is persistent.
    #[must_use]
    pub fn is_persistent(&self) -> bool {
        self.flags.has(Flags::PERSISTENT)
    }
}

/// How a destination forwards packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ForwardMethod {
    /// NAT (`-m`), 0.
    Masq,
    /// Local node, 1.
    Local,
    /// IP-in-IP / GUE / GRE tunnel (`-i`), 2.
    Tunnel,
    /// Direct routing (`-g`), 3.
    Route,
    /// Bypass, 4.
    Bypass,
    /// Any other value the kernel reports; never accepted in a request.
    Other(u32),
}

impl ForwardMethod {
    /// The `IP_VS_CONN_F_*` forwarding value.
    #[must_use]
    pub fn raw(self) -> u32 {
        match self {
            ForwardMethod::Masq => 0,
            ForwardMethod::Local => 1,
            ForwardMethod::Tunnel => 2,
            ForwardMethod::Route => 3,
            ForwardMethod::Bypass => 4,
            ForwardMethod::Other(v) => v,
        }
    }

    /// Decodes a forwarding value.
    #[must_use]
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => ForwardMethod::Masq,
            1 => ForwardMethod::Local,
            2 => ForwardMethod::Tunnel,
            3 => ForwardMethod::Route,
            4 => ForwardMethod::Bypass,
            v => ForwardMethod::Other(v),
        }
    }
}

/// Tunnel encapsulation of a tunnel destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TunnelType {
    /// IP-in-IP, 0.
    Ipip,
    /// Generic UDP encapsulation, 1; needs a port.
    Gue,
    /// GRE, 2.
    Gre,
    /// Any other value the kernel reports.
    Other(u8),
}

impl TunnelType {
    /// The `IP_VS_CONN_F_TUNNEL_TYPE_*` value.
    #[must_use]
    pub fn raw(self) -> u8 {
        match self {
            TunnelType::Ipip => 0,
            TunnelType::Gue => 1,
            TunnelType::Gre => 2,
            TunnelType::Other(v) => v,
        }
    }

    /// Decodes a tunnel type.
    #[must_use]
    pub fn from_raw(v: u8) -> Self {
        match v {
            0 => TunnelType::Ipip,
            1 => TunnelType::Gue,
            2 => TunnelType::Gre,
            v => TunnelType::Other(v),
        }
    }
}

/// Tunnel settings of a destination. Kernels since 5.2 report them on every destination (IPIP, port 0, flags 0
/// for non-tunnel ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tunnel {
    /// Encapsulation.
    pub kind: TunnelType,
    /// UDP port for GUE.
    pub port: u16,
    /// Checksum flags: [`Tunnel::NOCSUM`], [`Tunnel::CSUM`], [`Tunnel::REMCSUM`].
    pub flags: u16,
}

impl Tunnel {
    /// No checksum (`--tun-nocsum`); the value 0.
    pub const NOCSUM: u16 = 0;
    /// Checksum (`--tun-csum`).
    pub const CSUM: u16 = 1;
    /// Remote checksum offload (`--tun-remcsum`).
    pub const REMCSUM: u16 = 2;
}

impl Default for Tunnel {
    fn default() -> Self {
        Tunnel {
            kind: TunnelType::Ipip,
            port: 0,
            flags: 0,
        }
    }
}

/// A real server behind a virtual service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// Real server address; its type gives the destination's family, which may differ from the service's only
    /// for tunnel destinations.
    pub addr: IpAddr,
    /// Real server port.
    pub port: u16,
    /// Forwarding method.
    pub forward: ForwardMethod,
    /// Weight, 0..=i32::MAX.
    pub weight: u32,
    /// Upper connection threshold (0 = none).
    pub upper_threshold: u32,
    /// Lower connection threshold.
    pub lower_threshold: u32,
    /// Tunnel settings; `None` sends none (the kernel then uses IPIP without checksum flags).
    pub tunnel: Option<Tunnel>,
    /// Active connections (replies only).
    pub active_conns: u32,
    /// Inactive connections (replies only).
    pub inactive_conns: u32,
    /// Persistent connection templates (replies only).
    pub persist_conns: u32,
    /// The STATS nest, in replies.
    pub stats: Option<Stats>,
    /// The STATS64 nest, in replies.
    pub stats64: Option<Stats>,
    /// Attributes this crate does not know, kept so they round-trip.
    pub other: Vec<DefaultNla>,
}

impl Destination {
    /// A destination with weight 1 and no thresholds.
    #[must_use]
    pub fn new(addr: IpAddr, port: u16, forward: ForwardMethod) -> Self {
        Destination {
            addr,
            port,
            forward,
            weight: 1,
            upper_threshold: 0,
            lower_threshold: 0,
            tunnel: None,
            active_conns: 0,
            inactive_conns: 0,
            persist_conns: 0,
            stats: None,
            stats64: None,
            other: Vec::new(),
        }
    }

    /// Parses the attributes inside a DEST nest. `service_family` is used when the kernel omits ADDR_FAMILY
    /// (kernels before 4.15).
    pub fn parse(nest: &[u8], service_family: Family) -> Result<Self> {
        Self::parse_raw(nest, service_family).map_err(|e| Error::decode("destination", e))
    }

    fn parse_raw(nest: &[u8], service_family: Family) -> Raw<Self> {
        let mut addr: Option<&[u8]> = None;
        let mut family = service_family;
        let mut d = Destination::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0, ForwardMethod::Masq);
        let mut tunnel: Option<Tunnel> = None;
        let mut it = wire::attrs(nest);
        for (kind, v, whole) in &mut it {
            match kind {
                wire::DEST_ADDR => addr = Some(v),
                wire::DEST_PORT => d.port = wire::read_u16_be(v)?,
                wire::DEST_FWD_METHOD => d.forward = ForwardMethod::from_raw(wire::read_u32(v)?),
                wire::DEST_WEIGHT => d.weight = wire::read_u32(v)?,
                wire::DEST_U_THRESH => d.upper_threshold = wire::read_u32(v)?,
                wire::DEST_L_THRESH => d.lower_threshold = wire::read_u32(v)?,
                wire::DEST_ACTIVE_CONNS => d.active_conns = wire::read_u32(v)?,
                wire::DEST_INACT_CONNS => d.inactive_conns = wire::read_u32(v)?,
                wire::DEST_PERSIST_CONNS => d.persist_conns = wire::read_u32(v)?,
                wire::DEST_STATS => d.stats = Some(Stats::parse(v)?),
                wire::DEST_STATS64 => d.stats64 = Some(Stats::parse(v)?),
                wire::DEST_ADDR_FAMILY => family = Family::decode(wire::read_u16(v)?)?,
                wire::DEST_TUN_TYPE => {
                    tunnel.get_or_insert_with(Tunnel::default).kind =
                        TunnelType::from_raw(wire::read_u8(v)?);
                }
                wire::DEST_TUN_PORT => {
                    tunnel.get_or_insert_with(Tunnel::default).port = wire::read_u16_be(v)?
                }
                wire::DEST_TUN_FLAGS => {
                    tunnel.get_or_insert_with(Tunnel::default).flags = wire::read_u16(v)?
                }
                _ => d.other.push(raw_nla(whole)),
            }
        }
        it.finish()?;
        let addr = addr.ok_or("no address")?;
        d.addr = parse_addr(addr, family)?;
        d.tunnel = tunnel;
        Ok(d)
    }

    /// Emits the attributes of a DEST nest in the kernel's reply order.
    pub fn emit(&self, out: &mut Vec<u8>) {
        self.emit_attrs(&mut Writer::new(out), true);
    }

    /// Writes the DEST attributes; requests (`with_output == false`) leave out counters and statistics.
    pub(crate) fn emit_attrs(&self, w: &mut Writer<'_>, with_output: bool) {
        self.emit_key(w);
        w.put_u32(wire::DEST_FWD_METHOD, self.forward.raw());
        w.put_u32(wire::DEST_WEIGHT, self.weight);
        if let Some(t) = &self.tunnel {
            w.put_u8(wire::DEST_TUN_TYPE, t.kind.raw());
            w.put_u16_be(wire::DEST_TUN_PORT, t.port);
            w.put_u16(wire::DEST_TUN_FLAGS, t.flags);
        }
        w.put_u32(wire::DEST_U_THRESH, self.upper_threshold);
        w.put_u32(wire::DEST_L_THRESH, self.lower_threshold);
        if with_output {
            w.put_u32(wire::DEST_ACTIVE_CONNS, self.active_conns);
            w.put_u32(wire::DEST_INACT_CONNS, self.inactive_conns);
            w.put_u32(wire::DEST_PERSIST_CONNS, self.persist_conns);
        }
        w.put_u16(wire::DEST_ADDR_FAMILY, Family::of(&self.addr).raw());
        if with_output {
            if let Some(s) = &self.stats {
                s.emit(w, wire::DEST_STATS, false);
            }
            if let Some(s) = &self.stats64 {
                s.emit(w, wire::DEST_STATS64, true);
            }
            emit_other(w, &self.other);
        }
    }

    pub(crate) fn emit_key(&self, w: &mut Writer<'_>) {
        w.put(wire::DEST_ADDR, &addr_bytes(&self.addr));
        w.put_u16_be(wire::DEST_PORT, self.port);
    }
}

/// What GET_INFO reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    /// `IP_VS_VERSION_CODE`, e.g. 0x010201 for 1.2.1.
    pub version: u32,
    /// Size of the connection hash table.
    pub conn_tab_size: u32,
}

impl Info {
    /// The version as (major, minor, patch), as ipvsadm prints it.
    #[must_use]
    pub fn version_triplet(&self) -> (u8, u8, u8) {
        let [_, a, b, c] = self.version.to_be_bytes();
        (a, b, c)
    }

    pub(crate) fn parse(attrs: &[u8]) -> Result<Self> {
        Self::parse_raw(attrs).map_err(|e| Error::decode("IPVS info", e))
    }

    fn parse_raw(attrs: &[u8]) -> Raw<Self> {
        let mut info = Info {
            version: 0,
            conn_tab_size: 0,
        };
        let mut it = wire::attrs(attrs);
        for (kind, v, _) in &mut it {
            match kind {
                wire::INFO_VERSION => info.version = wire::read_u32(v)?,
                wire::INFO_CONN_TAB_SIZE => info.conn_tab_size = wire::read_u32(v)?,
                _ => {}
            }
        }
        it.finish()?;
        Ok(info)
    }
}

/// Connection timeouts in seconds. In a SET, 0 leaves a value unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timeouts {
    /// Established TCP.
    pub tcp: u32,
    /// TCP after FIN.
    pub tcp_fin: u32,
    /// UDP.
    pub udp: u32,
}

impl Timeouts {
    pub(crate) fn parse(attrs: &[u8]) -> Result<Self> {
        Self::parse_raw(attrs).map_err(|e| Error::decode("IPVS timeouts", e))
    }

    fn parse_raw(attrs: &[u8]) -> Raw<Self> {
        let mut t = Timeouts::default();
        let mut it = wire::attrs(attrs);
        for (kind, v, _) in &mut it {
            match kind {
                wire::CMD_ATTR_TIMEOUT_TCP => t.tcp = wire::read_u32(v)?,
                wire::CMD_ATTR_TIMEOUT_TCP_FIN => t.tcp_fin = wire::read_u32(v)?,
                wire::CMD_ATTR_TIMEOUT_UDP => t.udp = wire::read_u32(v)?,
                _ => {}
            }
        }
        it.finish()?;
        Ok(t)
    }

    pub(crate) fn emit_attrs(&self, w: &mut Writer<'_>) {
        w.put_u32(wire::CMD_ATTR_TIMEOUT_TCP, self.tcp);
        w.put_u32(wire::CMD_ATTR_TIMEOUT_TCP_FIN, self.tcp_fin);
        w.put_u32(wire::CMD_ATTR_TIMEOUT_UDP, self.udp);
    }
}

/// `union nf_inet_addr` as the kernel sends it: 16 bytes, IPv4 in the first four.
pub(crate) fn addr_bytes(addr: &IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            b
        }
        IpAddr::V6(a) => a.octets(),
    }
}

fn parse_addr(v: &[u8], family: Family) -> Raw<IpAddr> {
    match family {
        Family::Inet => match v.get(..4) {
            Some(b) => Ok(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))),
            None => Err("IPv4 address shorter than 4 bytes"),
        },
        Family::Inet6 => match v.get(..16) {
            Some(b) => {
                let mut a = [0u8; 16];
                a.copy_from_slice(b);
                Ok(IpAddr::V6(Ipv6Addr::from(a)))
            }
            None => Err("IPv6 address shorter than 16 bytes"),
        },
    }
}

/// Keeps an unknown attribute with its flag bits, so it is emitted exactly as received.
fn raw_nla(whole: &[u8]) -> DefaultNla {
    let kind = u16::from_ne_bytes([whole[2], whole[3]]);
    DefaultNla::new(kind, whole[4..].to_vec())
}

fn emit_other(w: &mut Writer<'_>, other: &[DefaultNla]) {
    use netlink_packet_core::Nla as _;
    for nla in other {
        let start = w.buf.len();
        w.buf.resize(start + nla.buffer_len(), 0);
        nla.emit(&mut w.buf[start..]);
        // netlink-packet-core sets the nested flag from the type with its flags masked off, which
        // drops the byte-order flag when both are set; the type goes out as it came in.
        w.buf[start + 2..start + 4].copy_from_slice(&nla.kind().to_ne_bytes());
    }
}
