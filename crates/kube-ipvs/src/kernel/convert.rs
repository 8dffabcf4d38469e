//! The conversions between the engine's table types (`kube-ipvs-diff`) and the netlink crate's IPVS types, in
//! one place: a virtual server or real server to its netlink service or destination, an [`Op`] to its netlink
//! [`Request`], and a dumped kernel entry back to the engine's [`ServiceEntry`] (or why it is foreign to us).
//! Pure functions: no socket here.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use kube_ipvs_diff::{
    DestKey, Forward, Op, Protocol, RealServer, ServiceEntry, VirtualKey, VirtualServer,
};
use kube_ipvs_netlink::ipvs::{
    Destination, Family, Flags, ForwardMethod, Netmask, Request, Service, ServiceKey,
};

/// The netlink key of a virtual server.
pub fn service_key(key: &VirtualKey) -> ServiceKey {
    match *key {
        VirtualKey::Inet {
            protocol,
            addr,
            port,
        } => ServiceKey::Addr {
            protocol: netlink_protocol(protocol),
            addr,
            port,
        },
        VirtualKey::Fwmark { ipv6, mark } => ServiceKey::Fwmark {
            family: if ipv6 { Family::Inet6 } else { Family::Inet },
            mark,
        },
    }
}

fn netlink_protocol(p: Protocol) -> kube_ipvs_netlink::ipvs::Protocol {
    use kube_ipvs_netlink::ipvs::Protocol as P;
    match p {
        Protocol::Tcp => P::Tcp,
        Protocol::Udp => P::Udp,
        Protocol::Sctp => P::Sctp,
    }
}

/// The netlink service for a virtual server: its scheduler, exactly its flags (so an update
/// also clears flags it no longer wants), the persistence timeout and the netmask (a mask for
/// IPv4, a prefix length for IPv6).
pub fn netlink_service(vs: &VirtualServer) -> Service {
    let key = service_key(&vs.key);
    let mut s = Service::new(key, vs.scheduler.name());
    s.flags = Flags::exactly(vs.flags());
    s.timeout = vs.timeout();
    s.netmask = match key.family() {
        Family::Inet => Netmask::V4(Ipv4Addr::from(
            u32::MAX
                .checked_shl(32 - u32::from(vs.netmask.min(32)))
                .unwrap_or(0),
        )),
        Family::Inet6 => Netmask::V6(vs.netmask.min(128)),
    };
    s
}

fn netlink_forward(f: Forward) -> ForwardMethod {
    match f {
        Forward::Masq => ForwardMethod::Masq,
        Forward::Local => ForwardMethod::Local,
        Forward::Tunnel => ForwardMethod::Tunnel,
        Forward::Route => ForwardMethod::Route,
        Forward::Bypass => ForwardMethod::Bypass,
    }
}

/// The netlink destination for a real server.
pub fn netlink_dest(rs: &RealServer) -> Destination {
    let mut d = Destination::new(rs.key.addr, rs.key.port, netlink_forward(rs.forward));
    d.weight = rs.weight;
    d
}

/// Why a kernel entry cannot be read into the engine's table; the entry is then foreign to us.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("virtual server {key}: {reason}")]
pub struct ForeignEntry {
    /// The kernel's key, as ipvsadm prints it.
    pub key: String,
    /// What the engine cannot represent.
    pub reason: String,
}

/// A dumped service and its destinations as the engine's [`ServiceEntry`] (fwmark services
/// included; whether one is the engine's is its `Ownership`'s business). Protocols other than
/// TCP/UDP/SCTP, schedulers the engine does not know and forwarding methods it cannot name are
/// errors, so the caller can list them as foreign.
pub fn entry_from_kernel(
    svc: &Service,
    dests: &[Destination],
) -> Result<ServiceEntry, ForeignEntry> {
    let foreign = |reason: String| ForeignEntry {
        key: svc.key.to_string(),
        reason,
    };
    let key = match svc.key {
        ServiceKey::Fwmark { family, mark } => VirtualKey::Fwmark {
            ipv6: family == Family::Inet6,
            mark,
        },
        ServiceKey::Addr {
            protocol,
            addr,
            port,
        } => {
            use kube_ipvs_netlink::ipvs::Protocol as P;
            let protocol = match protocol {
                P::Tcp => Protocol::Tcp,
                P::Udp => Protocol::Udp,
                P::Sctp => Protocol::Sctp,
                P::Other(n) => return Err(foreign(format!("IP protocol {n}"))),
            };
            VirtualKey::inet(protocol, addr, port)
        }
    };
    let netmask = match svc.netmask {
        // A non-contiguous mask has no prefix length; its leading ones are the closest.
        Netmask::V4(m) => u8::try_from(u32::from(m).leading_ones()).unwrap_or(32),
        Netmask::V6(p) => p,
    };
    let server =
        VirtualServer::from_kernel(key, &svc.scheduler, svc.flags.flags, svc.timeout, netmask)
            .map_err(|e| foreign(e.to_string()))?;
    let mut out = BTreeMap::new();
    for d in dests {
        let forward = match d.forward {
            ForwardMethod::Masq => Forward::Masq,
            ForwardMethod::Local => Forward::Local,
            ForwardMethod::Tunnel => Forward::Tunnel,
            ForwardMethod::Route => Forward::Route,
            ForwardMethod::Bypass => Forward::Bypass,
            ForwardMethod::Other(v) => {
                return Err(foreign(format!(
                    "real server {} uses forwarding method {v}",
                    DestKey {
                        addr: d.addr,
                        port: d.port
                    }
                )));
            }
        };
        let rs = RealServer {
            key: DestKey {
                addr: d.addr,
                port: d.port,
            },
            weight: d.weight,
            forward,
        };
        out.insert(rs.key, rs);
    }
    Ok(ServiceEntry { server, dests: out })
}

/// The netlink request for an IPVS op; `None` for address ops.
pub fn request_for(op: &Op) -> Option<Request> {
    Some(match op {
        Op::AddService(vs) => Request::NewService(netlink_service(vs)),
        Op::UpdateService(vs) => Request::SetService(netlink_service(vs)),
        Op::DeleteService(k) => Request::DelService(service_key(k)),
        Op::AddDest { service, dest } => Request::NewDest {
            service: service_key(service),
            dest: netlink_dest(dest),
        },
        Op::UpdateDest { service, dest } => Request::SetDest {
            service: service_key(service),
            dest: netlink_dest(dest),
        },
        Op::DeleteDest { service, dest } => Request::DelDest {
            service: service_key(service),
            addr: dest.addr,
            port: dest.port,
        },
        Op::AddAddress(_) | Op::RemoveAddress(_) => return None,
    })
}

/// The engine's [`Op`] a netlink [`Request`] carries out: the inverse of [`request_for`], for
/// the in-memory kernel ([`super::mem`]), which applies requests to the engine's own table
/// model. `None` for requests the engine never makes (timeouts, flush, fwmark services) and for
/// entries it cannot represent.
pub fn op_for(request: &Request) -> Option<Op> {
    let key = |k: &ServiceKey| {
        entry_from_kernel(&Service::new(*k, "rr"), &[])
            .ok()
            .map(|e| e.server.key)
    };
    let dest = |service: &ServiceKey, d: &Destination| {
        entry_from_kernel(&Service::new(*service, "rr"), std::slice::from_ref(d))
            .ok()
            .and_then(|e| e.dests.into_values().next())
    };
    Some(match request {
        Request::NewService(s) => Op::AddService(entry_from_kernel(s, &[]).ok()?.server),
        Request::SetService(s) => Op::UpdateService(entry_from_kernel(s, &[]).ok()?.server),
        Request::DelService(k) => Op::DeleteService(key(k)?),
        Request::NewDest { service, dest: d } => Op::AddDest {
            service: key(service)?,
            dest: dest(service, d)?,
        },
        Request::SetDest { service, dest: d } => Op::UpdateDest {
            service: key(service)?,
            dest: dest(service, d)?,
        },
        Request::DelDest {
            service,
            addr,
            port,
        } => Op::DeleteDest {
            service: key(service)?,
            dest: DestKey {
                addr: *addr,
                port: *port,
            },
        },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::test_support::{ip, vs};

    #[test]
    fn netlink_service_carries_flags_timeout_and_mask() {
        let mut v = vs("10.96.0.10", 80);
        v.persistence = Some(10_800);
        v.scheduler = "mh:fallback,port".parse().expect("valid");
        let s = netlink_service(&v);
        assert_eq!(s.scheduler, "mh");
        assert_eq!(s.flags, Flags::exactly(0x1 | 0x8 | 0x10));
        assert_eq!(s.timeout, 10_800);
        assert_eq!(s.netmask, Netmask::V4(Ipv4Addr::BROADCAST));
        let mut v6 = vs("fd00::10", 80);
        v6.persistence = Some(60);
        assert_eq!(netlink_service(&v6).netmask, Netmask::V6(128));
        // The kernel reports HASHED on every service; reading back gives what was asked for.
        let mut dumped = s.clone();
        dumped.flags.flags |= Flags::HASHED;
        let back = entry_from_kernel(&dumped, &[]).expect("ours");
        assert_eq!(back.server, v);
    }

    #[test]
    fn dests_are_masquerade_with_the_engine_weight() {
        let d = netlink_dest(&RealServer::masq(ip("10.244.1.5"), 8080, 1));
        assert_eq!(
            (d.forward, d.weight, d.port),
            (ForwardMethod::Masq, 1, 8080)
        );
        let mut zero = RealServer::masq(ip("10.244.1.5"), 8080, 0);
        zero.forward = Forward::Masq;
        assert_eq!(netlink_dest(&zero).weight, 0);
    }

    #[test]
    fn foreign_entries_are_named() {
        let mut s = Service::new(ServiceKey::tcp(ip("10.0.0.1"), 80), "none");
        let err = entry_from_kernel(&s, &[]).expect_err("unknown scheduler");
        assert!(err.to_string().contains("TCP 10.0.0.1:80"), "{err}");
        s.scheduler = "rr".into();
        let d = Destination::new(ip("10.0.0.2"), 80, ForwardMethod::Other(9));
        let err = entry_from_kernel(&s, &[d]).expect_err("unknown forwarding");
        assert!(err.to_string().contains("10.0.0.2:80"), "{err}");
    }
}
