//! The `kube-ipvs0` dummy interface and the node's local addresses, over rtnetlink.
//!
//! This is a small synchronous implementation over `netlink-packet-route` messages and the crate's one blocking
//! socket, rather than the async `rtnetlink` crate: the IPVS handle is synchronous too, the agent runs both on one
//! worker thread, and a handful of requests per sync does not justify a tokio connection task. The module owns the
//! dummy interface and its addresses; it never touches other interfaces' addresses or any routes.

use std::net::IpAddr;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::error::{Error, Result};
use crate::socket::NlSocket;

/// The interface kube-ipvs binds service addresses to by default.
pub const DEFAULT_DUMMY: &str = "kube-ipvs0";

/// `IFNAMSIZ - 1`.
const MAX_IFNAME: usize = 15;

/// An address configured on some interface of the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalAddress {
    /// Interface index.
    pub ifindex: u32,
    /// The address.
    pub addr: IpAddr,
    /// Its prefix length.
    pub prefix_len: u8,
}

/// Checks an interface name the way the kernel's `dev_valid_name` does.
pub fn validate_ifname(name: &str) -> Result<()> {
    let bad = |reason: &str| Error::Invalid {
        op: format!("interface {name:?}"),
        reason: reason.to_owned(),
    };
    if name.is_empty() || name.len() > MAX_IFNAME {
        return Err(bad("interface names are 1 to 15 bytes"));
    }
    if name == "." || name == ".." {
        return Err(bad("'.' and '..' are not interface names"));
    }
    if name.bytes().any(|b| {
        b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace() || !b.is_ascii_graphic()
    }) {
        return Err(bad(
            "interface names may not contain '/', ':', whitespace or control characters",
        ));
    }
    Ok(())
}

/// A handle on the rtnetlink socket of the caller's network namespace.
pub struct Rtnl {
    sock: NlSocket,
    seq: u32,
    buf: Vec<u8>,
}

fn kernel_err(op: String, errno: i32) -> Error {
    match errno {
        libc::EPERM => Error::Permission { op },
        _ => Error::Kernel { op, errno },
    }
}

impl Rtnl {
    /// Opens an rtnetlink socket.
    pub fn new() -> Result<Self> {
        let sock =
            NlSocket::open(netlink_sys::protocols::NETLINK_ROUTE).map_err(|source| Error::Io {
                op: "open rtnetlink socket".to_owned(),
                source,
            })?;
        Ok(Rtnl {
            sock,
            seq: 1,
            buf: Vec::with_capacity(64 * 1024),
        })
    }

    /// Sends one request and hands each reply message to `f`; returns the kernel's errno (0 on success).
    fn request(
        &mut self,
        payload: RouteNetlinkMessage,
        flags: u16,
        op: &dyn Fn() -> String,
        mut f: impl FnMut(RouteNetlinkMessage) -> Result<()>,
    ) -> Result<i32> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(payload));
        msg.finalize();
        let mut out = vec![0u8; msg.buffer_len()];
        msg.serialize(&mut out);
        self.sock
            .send(&out)
            .map_err(|source| Error::Io { op: op(), source })?;
        loop {
            self.sock
                .recv(&mut self.buf, true)
                .map_err(|source| Error::Io { op: op(), source })?;
            for m in crate::ipvs::wire::messages(&self.buf) {
                let (h, payload, whole) = m?;
                if h.seq != seq {
                    continue;
                }
                match h.kind {
                    crate::ipvs::wire::NLMSG_DONE => return Ok(0),
                    crate::ipvs::wire::NLMSG_ERROR => {
                        return crate::ipvs::wire::error_code(payload);
                    }
                    _ => {
                        let parsed = NetlinkMessage::<RouteNetlinkMessage>::deserialize(whole)
                            .map_err(|e| Error::decode(op(), e))?;
                        if let NetlinkPayload::InnerMessage(inner) = parsed.payload {
                            f(inner)?;
                        }
                    }
                }
            }
        }
    }

    /// The index of interface `name`, or `None` if there is no such interface.
    pub fn link_index(&mut self, name: &str) -> Result<Option<u32>> {
        validate_ifname(name)?;
        let op = || format!("look up interface {name}");
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_owned()));
        let mut index = None;
        let errno = self.request(
            RouteNetlinkMessage::GetLink(msg),
            NLM_F_REQUEST | NLM_F_ACK,
            &op,
            |reply| {
                if let RouteNetlinkMessage::NewLink(l) = reply {
                    index = Some(l.header.index);
                }
                Ok(())
            },
        )?;
        match errno {
            0 => Ok(index),
            libc::ENODEV => Ok(None),
            e => Err(kernel_err(op(), e)),
        }
    }

    /// Makes sure a dummy interface `name` exists and returns its index. An existing interface of that name is
    /// left exactly as it is.
    pub fn ensure_dummy(&mut self, name: &str) -> Result<u32> {
        if let Some(index) = self.link_index(name)? {
            return Ok(index);
        }
        let op = || format!("create dummy interface {name}");
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_owned()));
        msg.attributes
            .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(
                InfoKind::Dummy,
            )]));
        let errno = self.request(
            RouteNetlinkMessage::NewLink(msg),
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            &op,
            |_| Ok(()),
        )?;
        // EEXIST means another agent created it between the lookup and here, which is just as good.
        if errno != 0 && errno != libc::EEXIST {
            return Err(kernel_err(op(), errno));
        }
        self.link_index(name)?.ok_or_else(|| Error::Kernel {
            op: op(),
            errno: libc::ENODEV,
        })
    }

    fn dump_addresses(&mut self, op: &dyn Fn() -> String) -> Result<Vec<LocalAddress>> {
        let mut out = Vec::new();
        let errno = self.request(
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            NLM_F_REQUEST | NLM_F_DUMP,
            op,
            |reply| {
                if let RouteNetlinkMessage::NewAddress(a) = reply {
                    // For IPv4, IFA_LOCAL is the interface's own address and IFA_ADDRESS the peer on
                    // point-to-point links; IPv6 sends only IFA_ADDRESS.
                    let mut local = None;
                    let mut address = None;
                    for attr in &a.attributes {
                        match attr {
                            AddressAttribute::Local(ip) => local = Some(*ip),
                            AddressAttribute::Address(ip) => address = Some(*ip),
                            _ => {}
                        }
                    }
                    if let Some(addr) = local.or(address) {
                        out.push(LocalAddress {
                            ifindex: a.header.index,
                            addr,
                            prefix_len: a.header.prefix_len,
                        });
                    }
                }
                Ok(())
            },
        )?;
        if errno != 0 {
            return Err(kernel_err(op(), errno));
        }
        Ok(out)
    }

    /// Every address on every interface of the node.
    pub fn local_addresses(&mut self) -> Result<Vec<LocalAddress>> {
        self.dump_addresses(&|| "list local addresses".to_owned())
    }

    fn index_of(&mut self, ifname: &str) -> Result<u32> {
        self.link_index(ifname)?.ok_or_else(|| Error::Kernel {
            op: format!("look up interface {ifname}"),
            errno: libc::ENODEV,
        })
    }

    /// The addresses on interface `ifname`.
    pub fn addresses(&mut self, ifname: &str) -> Result<Vec<IpAddr>> {
        let index = self.index_of(ifname)?;
        let all = self.dump_addresses(&|| format!("list addresses of {ifname}"))?;
        Ok(all
            .into_iter()
            .filter(|a| a.ifindex == index)
            .map(|a| a.addr)
            .collect())
    }

    fn address_message(index: u32, addr: IpAddr) -> AddressMessage {
        let mut msg = AddressMessage::default();
        msg.header.index = index;
        msg.header.scope = AddressScope::Universe;
        match addr {
            IpAddr::V4(_) => {
                msg.header.family = AddressFamily::Inet;
                msg.header.prefix_len = 32;
                msg.attributes.push(AddressAttribute::Local(addr));
                msg.attributes.push(AddressAttribute::Address(addr));
            }
            IpAddr::V6(_) => {
                msg.header.family = AddressFamily::Inet6;
                msg.header.prefix_len = 128;
                msg.attributes.push(AddressAttribute::Address(addr));
                // Service addresses are not on a link, so duplicate address detection would only delay them.
                msg.attributes
                    .push(AddressAttribute::Flags(AddressFlags::Nodad));
            }
        }
        msg
    }

    fn check_addr(op: &dyn Fn() -> String, addr: &IpAddr) -> Result<()> {
        if addr.is_unspecified()
            || addr.is_multicast()
            || matches!(addr, IpAddr::V4(a) if a.is_broadcast())
        {
            return Err(Error::Invalid {
                op: op(),
                reason: format!("{addr} is not a unicast address"),
            });
        }
        Ok(())
    }

    /// Adds `addr` as a /32 or /128 to `ifname`; an address already there is fine.
    pub fn add_address(&mut self, ifname: &str, addr: IpAddr) -> Result<()> {
        let op = || format!("add address {addr} to {ifname}");
        Self::check_addr(&op, &addr)?;
        let index = self.index_of(ifname)?;
        let msg = Self::address_message(index, addr);
        let errno = self.request(
            RouteNetlinkMessage::NewAddress(msg),
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            &op,
            |_| Ok(()),
        )?;
        match errno {
            0 | libc::EEXIST => Ok(()),
            e => Err(kernel_err(op(), e)),
        }
    }

    /// Removes `addr` from `ifname`; an address that is not there is fine.
    pub fn del_address(&mut self, ifname: &str, addr: IpAddr) -> Result<()> {
        let op = || format!("remove address {addr} from {ifname}");
        Self::check_addr(&op, &addr)?;
        let index = self.index_of(ifname)?;
        let msg = Self::address_message(index, addr);
        let errno = self.request(
            RouteNetlinkMessage::DelAddress(msg),
            NLM_F_REQUEST | NLM_F_ACK,
            &op,
            |_| Ok(()),
        )?;
        match errno {
            0 | libc::EADDRNOTAVAIL | libc::ENOENT | libc::ESRCH => Ok(()),
            e => Err(kernel_err(op(), e)),
        }
    }
}
