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
