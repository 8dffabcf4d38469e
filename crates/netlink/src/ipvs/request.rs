//! Changes to the IPVS table as data: one [`Request`] per kernel command, with the validation that runs before
//! anything is sent and the encoding into one generic netlink message.

use std::fmt;
use std::net::IpAddr;

use super::types::{
    Destination, Family, ForwardMethod, Netmask, Protocol, Service, ServiceKey, Timeouts,
    TunnelType,
};
use super::wire::{self, Writer};
use crate::error::Error;

/// Longest scheduler or persistence engine name the kernel accepts (its buffers hold 16 bytes with the NUL).
const MAX_NAME_LEN: usize = 15;
/// ipvsadm's upper bound for a persistence timeout (31 days); larger values overflow the kernel's jiffies.
const MAX_PERSISTENCE_TIMEOUT: u32 = 86400 * 31;
/// The kernel rejects connection timeouts above INT_MAX / HZ; with HZ up to 1000 this is the safe bound.
const MAX_CONN_TIMEOUT: u32 = (i32::MAX as u32) / 1000;

/// One change to the IPVS table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// NEW_SERVICE: add a service (`EEXIST` if it is there).
    NewService(Service),
    /// SET_SERVICE: change scheduler, flags, persistence of an existing service.
    SetService(Service),
    /// DEL_SERVICE: delete a service and its destinations.
    DelService(ServiceKey),
    /// NEW_DEST: add a destination to a service.
    NewDest {
        /// The service.
        service: ServiceKey,
        /// The destination, fully specified.
        dest: Destination,
    },
    /// SET_DEST: change weight, forwarding, thresholds or tunnel settings of a destination.
    SetDest {
        /// The service.
        service: ServiceKey,
        /// The destination, fully specified.
        dest: Destination,
    },
    /// DEL_DEST: remove a destination.
    DelDest {
        /// The service.
        service: ServiceKey,
        /// Destination address.
        addr: IpAddr,
        /// Destination port.
        port: u16,
    },
    /// FLUSH: delete every service in the network namespace.
    Flush,
    /// ZERO: reset the counters of one service, or of everything with `None`.
    Zero(Option<ServiceKey>),
    /// SET_CONFIG: set connection timeouts; a 0 leaves that timeout unchanged.
    SetTimeouts(Timeouts),
}

struct Endpoint<'a>(&'a IpAddr, u16);

impl fmt::Display for Endpoint<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            IpAddr::V4(a) => write!(f, "{a}:{}", self.1),
            IpAddr::V6(a) => write!(f, "[{a}]:{}", self.1),
        }
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Request::NewService(s) => write!(f, "add service {}", s.key),
            Request::SetService(s) => write!(f, "update service {}", s.key),
            Request::DelService(k) => write!(f, "delete service {k}"),
            Request::NewDest { service, dest } => {
                write!(
                    f,
                    "add destination {} to service {service}",
                    Endpoint(&dest.addr, dest.port)
                )
            }
            Request::SetDest { service, dest } => {
                write!(
                    f,
                    "update destination {} of service {service}",
                    Endpoint(&dest.addr, dest.port)
                )
            }
            Request::DelDest {
                service,
                addr,
                port,
            } => {
                write!(
                    f,
                    "delete destination {} from service {service}",
                    Endpoint(addr, *port)
                )
            }
            Request::Flush => f.write_str("flush all services"),
            Request::Zero(None) => f.write_str("zero all counters"),
            Request::Zero(Some(k)) => write!(f, "zero counters of service {k}"),
            Request::SetTimeouts(t) => {
                write!(
                    f,
                    "set timeouts tcp {} tcpfin {} udp {}",
                    t.tcp, t.tcp_fin, t.udp
                )
            }
        }
    }
}

impl Request {
    pub(crate) fn cmd(&self) -> u8 {
        match self {
            Request::NewService(_) => wire::CMD_NEW_SERVICE,
            Request::SetService(_) => wire::CMD_SET_SERVICE,
            Request::DelService(_) => wire::CMD_DEL_SERVICE,
            Request::NewDest { .. } => wire::CMD_NEW_DEST,
            Request::SetDest { .. } => wire::CMD_SET_DEST,
            Request::DelDest { .. } => wire::CMD_DEL_DEST,
            Request::Flush => wire::CMD_FLUSH,
            Request::Zero(_) => wire::CMD_ZERO,
            Request::SetTimeouts(_) => wire::CMD_SET_CONFIG,
        }
    }

    /// Maps a kernel errno to a typed error, reading it as the uapi documents it for this command: ENOENT is an
    /// unknown scheduler for service commands but a missing destination for SET_DEST and DEL_DEST.
    pub(crate) fn error_for(&self, errno: i32) -> Error {
        let op = self.to_string();
        let is_dest = matches!(
            self,
            Request::NewDest { .. } | Request::SetDest { .. } | Request::DelDest { .. }
        );
        match errno {
            libc::EEXIST => Error::Exists {
                op,
                object: if is_dest { "destination" } else { "service" },
            },
            libc::ESRCH => Error::NoSuchService { op },
            libc::EPERM => Error::Permission { op },
            libc::ENOENT => match self {
                Request::NewService(_) | Request::SetService(_) => Error::UnknownScheduler { op },
                Request::SetDest { .. } | Request::DelDest { .. } => {
                    Error::NoSuchDestination { op }
                }
                _ => Error::Kernel { op, errno },
            },
            _ => Error::Kernel { op, errno },
        }
    }

    /// Checks everything the kernel would otherwise reject with a bare EINVAL or ERANGE, or silently accept
    /// wrongly, so a bad object from the API server is refused with a message naming it.
    pub fn validate(&self) -> Result<(), Error> {
        let check = || -> Result<(), String> {
            match self {
                Request::NewService(s) | Request::SetService(s) => validate_service(s),
                Request::DelService(k) | Request::Zero(Some(k)) => validate_key(k),
                Request::NewDest { service, dest } | Request::SetDest { service, dest } => {
                    validate_key(service)?;
                    validate_dest(service, dest)
                }
                Request::DelDest { service, addr, .. } => {
                    validate_key(service)?;
                    validate_dest_addr(addr)
                }
                Request::Flush | Request::Zero(None) => Ok(()),
                Request::SetTimeouts(t) => {
                    for (name, v) in [("tcp", t.tcp), ("tcpfin", t.tcp_fin), ("udp", t.udp)] {
                        if v > MAX_CONN_TIMEOUT {
                            return Err(format!("{name} timeout {v}s exceeds {MAX_CONN_TIMEOUT}s"));
                        }
                    }
                    Ok(())
                }
            }
        };
        check().map_err(|reason| Error::Invalid {
            op: self.to_string(),
            reason,
        })
    }

    /// Appends this request to `buf` as one netlink message of the IPVS family `family_id`, with
    /// `flags` (`NLM_F_REQUEST`, and `NLM_F_ACK` for an answer) and `seq`: for senders other than
    /// [`super::Ipvs::apply`], such as the benchmark's raw-cost baseline.
    pub fn encode_into(&self, buf: &mut Vec<u8>, family_id: u16, flags: u16, seq: u32) {
        self.encode(&mut Writer::new(buf), family_id, flags, seq);
    }

    /// Appends this request as one netlink message.
    pub(crate) fn encode(&self, w: &mut Writer<'_>, family_id: u16, flags: u16, seq: u32) {
        let start = w.begin_msg(family_id, flags, seq, 0);
        w.genl_header(self.cmd(), wire::IPVS_GENL_VERSION);
        match self {
            Request::NewService(s) | Request::SetService(s) => {
                let nest = w.begin_nest(wire::CMD_ATTR_SERVICE);
                s.emit_attrs(w, false);
                w.end_nest(nest);
            }
            Request::DelService(k) | Request::Zero(Some(k)) => k.emit_nest(w),
            Request::NewDest { service, dest } | Request::SetDest { service, dest } => {
                service.emit_nest(w);
                let nest = w.begin_nest(wire::CMD_ATTR_DEST);
                dest.emit_attrs(w, false);
                w.end_nest(nest);
            }
            Request::DelDest {
                service,
                addr,
                port,
            } => {
                service.emit_nest(w);
                let nest = w.begin_nest(wire::CMD_ATTR_DEST);
                w.put(wire::DEST_ADDR, &super::types::addr_bytes(addr));
                w.put_u16_be(wire::DEST_PORT, *port);
                w.put_u16(wire::DEST_ADDR_FAMILY, Family::of(addr).raw());
                w.end_nest(nest);
            }
            Request::Flush | Request::Zero(None) => {}
            Request::SetTimeouts(t) => t.emit_attrs(w),
        }
        w.end_msg(start);
    }
}

fn validate_key(k: &ServiceKey) -> Result<(), String> {
    match k {
        ServiceKey::Fwmark { mark, .. } => {
            if *mark == 0 {
                return Err("fwmark 0 does not identify a service".into());
            }
        }
        ServiceKey::Addr { protocol, addr, .. } => {
            if let Protocol::Other(p) = protocol {
                return Err(format!("protocol {p} is not TCP, UDP or SCTP"));
            }
            if addr.is_unspecified() || addr.is_multicast() {
                return Err(format!(
                    "virtual address {addr} is unspecified or multicast"
                ));
            }
            if let IpAddr::V4(a) = addr
                && a.is_broadcast()
            {
                return Err(format!("virtual address {addr} is the broadcast address"));
            }
        }
    }
    Ok(())
}

fn validate_name(kind: &str, name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(format!(
            "{kind} name {name:?} must be 1 to {MAX_NAME_LEN} bytes"
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!(
            "{kind} name {name:?} has characters other than letters, digits, '_' and '-'"
        ));
    }
    Ok(())
}

fn validate_service(s: &Service) -> Result<(), String> {
    validate_key(&s.key)?;
    validate_name("scheduler", &s.scheduler)?;
    if let Some(pe) = &s.pe_name {
        validate_name("persistence engine", pe)?;
    }
    if let ServiceKey::Addr { port: 0, .. } = s.key
        && s.flags.flags & super::types::Flags::PERSISTENT == 0
    {
        return Err("port 0 is only allowed for a persistent service".into());
    }
    if s.timeout > MAX_PERSISTENCE_TIMEOUT {
        return Err(format!(
            "persistence timeout {}s exceeds {MAX_PERSISTENCE_TIMEOUT}s",
            s.timeout
        ));
    }
    match (s.key.family(), s.netmask) {
        (Family::Inet, Netmask::V4(m)) => {
            let bits = u32::from(m);
            if bits.leading_ones() + bits.trailing_zeros() != 32 {
                return Err(format!("netmask {m} is not contiguous"));
            }
        }
        (Family::Inet6, Netmask::V6(p)) => {
            if !(1..=128).contains(&p) {
                return Err(format!("IPv6 netmask prefix /{p} is outside 1..128"));
            }
        }
        (Family::Inet, Netmask::V6(_)) => return Err("IPv4 service with an IPv6 netmask".into()),
        (Family::Inet6, Netmask::V4(_)) => return Err("IPv6 service with an IPv4 netmask".into()),
    }
    Ok(())
}

fn validate_dest_addr(addr: &IpAddr) -> Result<(), String> {
    let bad = addr.is_unspecified()
        || addr.is_multicast()
        || matches!(addr, IpAddr::V4(a) if a.is_broadcast());
    if bad {
        return Err(format!(
            "destination address {addr} is not a unicast address"
        ));
    }
    Ok(())
}

fn validate_dest(service: &ServiceKey, d: &Destination) -> Result<(), String> {
    validate_dest_addr(&d.addr)?;
    match d.forward {
        ForwardMethod::Masq
        | ForwardMethod::Local
        | ForwardMethod::Tunnel
        | ForwardMethod::Route => {}
        other => return Err(format!("forwarding method {other:?} cannot be requested")),
    }
    if Family::of(&d.addr) != service.family() && d.forward != ForwardMethod::Tunnel {
        return Err(format!(
            "destination {} has a different address family than the service; only tunnel forwarding allows that",
            d.addr
        ));
    }
    if d.weight > i32::MAX as u32 {
        return Err(format!("weight {} exceeds {}", d.weight, i32::MAX));
    }
    if d.lower_threshold > d.upper_threshold {
        return Err(format!(
            "lower threshold {} is above upper threshold {}",
            d.lower_threshold, d.upper_threshold
        ));
    }
    if let Some(t) = &d.tunnel {
        if let TunnelType::Other(v) = t.kind {
            return Err(format!("tunnel type {v} is unknown"));
        }
        if t.kind == TunnelType::Gue && t.port == 0 {
            return Err("GUE tunnel needs a non-zero port".into());
        }
        if t.flags > 3 {
            return Err(format!("tunnel flags {:#x} are unknown", t.flags));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::ipvs::types::{Flags, Tunnel};

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    fn encode(r: &Request) -> Vec<u8> {
        let mut buf = Vec::new();
        r.encode(
            &mut Writer::new(&mut buf),
            0x1a,
            wire::NLM_F_REQUEST | wire::NLM_F_ACK,
            7,
        );
        buf
    }

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// The request ipvsadm 1.31 sends for `-A -t 10.0.0.1:80 -s rr -p 300 -M 255.255.255.0` (captured in the
    /// specification, section 1.4), except that libnl marks the nest with NLA_F_NESTED (0x8001) and this crate
    /// sends it as the kernel itself does (0x0001); the kernel accepts both.
    #[test]
    fn new_service_matches_ipvsadm_bytes() {
        let mut s = Service::new(ServiceKey::tcp(ip("10.0.0.1"), 80), "rr");
        s.flags = Flags::exactly(Flags::PERSISTENT);
        s.timeout = 300;
        s.netmask = Netmask::V4(Ipv4Addr::new(255, 255, 255, 0));
        let want = unhex(
            "68000000 1a00 0500 07000000 00000000
             01010000
             54000100
             0600 0100 0200 0000
             0600 0200 0600 0000
             1400 0300 0a000001 000000000000000000000000
             0600 0400 0050 0000
             0700 0600 72720000
             0c00 0700 01000000 ffffffff
             0800 0800 2c010000
             0800 0900 ffffff00",
        );
        assert_eq!(encode(&Request::NewService(s)), want);
    }

    #[test]
    fn flush_and_timeouts_match_ipvsadm_commands() {
        assert_eq!(
            encode(&Request::Flush),
            unhex("14000000 1a00 0500 07000000 00000000 11010000")
        );
        let t = Timeouts {
            tcp: 900,
            tcp_fin: 120,
            udp: 300,
        };
        assert_eq!(
            encode(&Request::SetTimeouts(t)),
            unhex(
                "2c000000 1a00 0500 07000000 00000000 0c010000
                 0800 0400 84030000 0800 0500 78000000 0800 0600 2c010000"
            )
        );
    }

    /// A destination request carries the same attributes ipvsadm sends, and parses back to the same values.
    #[test]
    fn new_dest_carries_every_field() {
        let key = ServiceKey::Fwmark {
            family: Family::Inet,
            mark: 100,
        };
        let mut d = Destination::new(ip("192.168.1.30"), 0, ForwardMethod::Tunnel);
        d.weight = 3;
        d.upper_threshold = 100;
        d.lower_threshold = 10;
        d.tunnel = Some(Tunnel {
            kind: TunnelType::Gue,
            port: 6080,
            flags: Tunnel::CSUM,
        });
        let bytes = encode(&Request::NewDest {
            service: key,
            dest: d.clone(),
        });
        assert_eq!(
            bytes[20..],
            {
                let mut w = Vec::new();
                let mut wr = Writer::new(&mut w);
                key.emit_nest(&mut wr);
                let n = wr.begin_nest(wire::CMD_ATTR_DEST);
                d.emit_attrs(&mut wr, false);
                wr.end_nest(n);
                w
            }[..]
        );
        // Skip the headers and the SERVICE nest (4 + 8 + 8 bytes) to reach the DEST nest's attributes.
        let dest_nest = &bytes[20 + 20 + 4..];
        let parsed = Destination::parse(dest_nest, Family::Inet).expect("parse own request");
        assert_eq!(parsed, d);
    }

    #[test]
    fn enoent_means_scheduler_for_services_and_destination_for_dest_commands() {
        let key = ServiceKey::tcp(ip("10.0.0.1"), 80);
        let svc = Request::NewService(Service::new(key, "rr"));
        assert!(matches!(
            svc.error_for(libc::ENOENT),
            Error::UnknownScheduler { .. }
        ));
        let del = Request::DelDest {
            service: key,
            addr: ip("10.0.0.2"),
            port: 80,
        };
        assert!(matches!(
            del.error_for(libc::ENOENT),
            Error::NoSuchDestination { .. }
        ));
        assert!(matches!(
            del.error_for(libc::ESRCH),
            Error::NoSuchService { .. }
        ));
        assert!(matches!(
            Request::Flush.error_for(libc::EINVAL),
            Error::Kernel {
                errno: libc::EINVAL,
                ..
            }
        ));
        assert_eq!(
            svc.error_for(libc::EEXIST).to_string(),
            "add service TCP 10.0.0.1:80: service already exists"
        );
        assert_eq!(
            Request::DelService(ServiceKey::Fwmark {
                family: Family::Inet6,
                mark: 7
            })
            .error_for(libc::EPERM)
            .to_string(),
            "delete service FWM 7 IPv6: permission denied (CAP_NET_ADMIN is needed)"
        );
        assert_eq!(
            Request::Flush.error_for(libc::EINVAL).to_string(),
            "flush all services: kernel error 22: Invalid argument (os error 22)"
        );
    }

    #[test]
    fn invalid_requests_are_refused_with_a_reason() {
        let key = ServiceKey::tcp(ip("10.0.0.1"), 80);
        let v6 = ServiceKey::tcp(ip("2001:db8::1"), 80);
        let svc = |k: ServiceKey, sched: &str| Service::new(k, sched);
        let mut long_timeout = svc(key, "rr");
        long_timeout.timeout = MAX_PERSISTENCE_TIMEOUT + 1;
        let mut holey_mask = svc(key, "rr");
        holey_mask.netmask = Netmask::V4(Ipv4Addr::new(255, 0, 255, 0));
        let mut bad_prefix = svc(v6, "rr");
        bad_prefix.netmask = Netmask::V6(0);
        let mut wrong_mask = svc(v6, "rr");
        wrong_mask.netmask = Netmask::V4(Ipv4Addr::BROADCAST);
        let mut bad_pe = svc(key, "rr");
        bad_pe.pe_name = Some("s i p".into());
        let d = |a: &str, f: ForwardMethod| Destination::new(ip(a), 80, f);
        let mut heavy = d("10.0.0.2", ForwardMethod::Masq);
        heavy.weight = u32::MAX;
        let mut gue0 = d("10.0.0.2", ForwardMethod::Tunnel);
        gue0.tunnel = Some(Tunnel {
            kind: TunnelType::Gue,
            port: 0,
            flags: 0,
        });
        let bad = vec![
            Request::NewService(svc(ServiceKey::tcp(ip("0.0.0.0"), 80), "rr")),
            Request::NewService(svc(ServiceKey::tcp(ip("224.0.0.1"), 80), "rr")),
            Request::NewService(svc(
                ServiceKey::Addr {
                    protocol: Protocol::Other(1),
                    addr: ip("10.0.0.1"),
                    port: 80,
                },
                "rr",
            )),
            Request::NewService(svc(
                ServiceKey::Fwmark {
                    family: Family::Inet,
                    mark: 0,
                },
                "rr",
            )),
            Request::NewService(svc(key, "")),
            Request::NewService(svc(key, "rr\0")),
            Request::NewService(svc(ServiceKey::tcp(ip("10.0.0.1"), 0), "rr")),
            Request::NewService(long_timeout),
            Request::NewService(holey_mask),
            Request::NewService(bad_prefix),
            Request::NewService(wrong_mask),
            Request::NewService(bad_pe),
            Request::NewDest {
                service: key,
                dest: d("255.255.255.255", ForwardMethod::Masq),
            },
            Request::NewDest {
                service: key,
                dest: d("2001:db8::2", ForwardMethod::Masq),
            },
            Request::NewDest {
                service: key,
                dest: d("10.0.0.2", ForwardMethod::Bypass),
            },
            Request::NewDest {
                service: key,
                dest: heavy,
            },
            Request::NewDest {
                service: key,
                dest: gue0,
            },
            Request::DelDest {
                service: key,
                addr: ip("::"),
                port: 80,
            },
            Request::SetTimeouts(Timeouts {
                tcp: u32::MAX,
                tcp_fin: 0,
                udp: 0,
            }),
        ];
        for r in &bad {
            match r.validate() {
                Err(Error::Invalid { op, reason }) => {
                    assert_eq!(op, r.to_string());
                    assert!(!reason.is_empty());
                }
                other => panic!("{r} was not refused: {other:?}"),
            }
        }
        // A mixed-family destination is fine with tunnel forwarding, and a port-0 service with persistence.
        let mut tun = d("2001:db8::2", ForwardMethod::Tunnel);
        tun.tunnel = Some(Tunnel::default());
        Request::NewDest {
            service: key,
            dest: tun,
        }
        .validate()
        .expect("mixed-family tunnel");
        let mut any_port = svc(ServiceKey::tcp(ip("10.0.0.1"), 0), "rr");
        any_port.flags = Flags::exactly(Flags::PERSISTENT);
        Request::NewService(any_port)
            .validate()
            .expect("persistent port 0");
    }
}
