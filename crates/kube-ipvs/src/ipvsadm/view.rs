//! Reading the kernel's IPVS table into the renderer's view ([`crate::ipvsadm::Table`]).
//!
//! The netlink crate's types carry everything the kernel sent; this module only picks what
//! ipvsadm shows, in ipvsadm's integer forms.

use kube_ipvs_netlink::ipvs::{Destination, Ipvs, Netmask, Service, ServiceKey, Stats};

use crate::ipvsadm;

/// The whole table as `ipvsadm -Ln` would read it: GET_INFO, the service dump, and one
/// destination dump per service.
pub fn read_table(ipvs: &mut Ipvs) -> kube_ipvs_netlink::Result<ipvsadm::Table> {
    let info = ipvs.info()?;
    let services = ipvs
        .table()?
        .into_iter()
        .map(|(svc, dests)| service_view(&svc, &dests))
        .collect();
    Ok(ipvsadm::Table {
        version: info.version,
        conn_tab_size: info.conn_tab_size,
        services,
    })
}

/// The STATS64 counters where the kernel sent them, else the 32-bit STATS ones (as libipvs).
fn counters(stats64: Option<&Stats>, stats: Option<&Stats>) -> ipvsadm::Counters {
    let Some(s) = stats64.or(stats) else {
        return ipvsadm::Counters::default();
    };
    ipvsadm::Counters {
        conns: s.conns,
        inpkts: s.inpkts,
        outpkts: s.outpkts,
        inbytes: s.inbytes,
        outbytes: s.outbytes,
        cps: s.cps,
        inpps: s.inpps,
        outpps: s.outpps,
        inbps: s.inbps,
        outbps: s.outbps,
    }
}

/// One service and its destinations in the renderer's terms.
pub fn service_view(svc: &Service, dests: &[Destination]) -> ipvsadm::Service {
    let af = svc.key.family().raw();
    let (protocol, addr, port, fwmark) = match svc.key {
        ServiceKey::Fwmark { mark, family } => {
            // The kernel stores fwmark services as TCP; the address is unspecified.
            let unspecified = match family.raw() {
                ipvsadm::AF_INET6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
                _ => std::net::Ipv4Addr::UNSPECIFIED.into(),
            };
            (6, unspecified, 0, mark)
        }
        ServiceKey::Addr {
            protocol,
            addr,
            port,
        } => (protocol.raw(), addr, port, 0),
    };
    ipvsadm::Service {
        af,
        protocol,
        addr,
        port,
        fwmark,
        scheduler: svc.scheduler.clone(),
        flags: svc.flags.flags,
        timeout: svc.timeout,
        netmask: match svc.netmask {
            Netmask::V4(m) => u32::from(m),
            Netmask::V6(p) => u32::from(p),
        },
        pe_name: svc.pe_name.clone().unwrap_or_default(),
        stats: counters(svc.stats64.as_ref(), svc.stats.as_ref()),
        dests: dests.iter().map(dest_view).collect(),
    }
}

fn dest_view(d: &Destination) -> ipvsadm::Dest {
    let tunnel = d.tunnel.unwrap_or_default();
    ipvsadm::Dest {
        af: if d.addr.is_ipv6() {
            ipvsadm::AF_INET6
        } else {
            ipvsadm::AF_INET
        },
        addr: d.addr,
        port: d.port,
        fwd: d.forward.raw(),
        // ipvsadm keeps the weight in a C int.
        weight: d.weight as i32,
        u_threshold: d.upper_threshold,
        l_threshold: d.lower_threshold,
        active_conns: d.active_conns,
        inact_conns: d.inactive_conns,
        persist_conns: d.persist_conns,
        tun_type: tunnel.kind.raw(),
        tun_port: tunnel.port,
        tun_flags: tunnel.flags,
        stats: counters(d.stats64.as_ref(), d.stats.as_ref()),
    }
}
