//! The `kube-ipvs0` dummy interface and the node's local addresses, over rtnetlink.
//!
//! This is a small synchronous implementation over `netlink-packet-route` messages and the crate's one blocking
//! socket, rather than the async `rtnetlink` crate: the IPVS handle is synchronous too, the agent runs both on one
//! worker thread, and a handful of requests per sync does not justify a tokio connection task. The module owns the
//! dummy interface and its addresses, and the local routes of ours ([`ROUTE_PROTOCOL`]) that make
//! service addresses local without an address; it never touches other interfaces' addresses or
//! any other route.
//!
//! [`AddressWatch`] listens to the kernel's address notifications (the `RTNLGRP_IPV4_IFADDR` and
//! `RTNLGRP_IPV6_IFADDR` multicast groups), so a caller follows the node's addresses without polling. It only
//! reads; it never changes anything.

use std::collections::VecDeque;
use std::io;
use std::net::IpAddr;
use std::time::Duration;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::error::{Error, Result};
use crate::socket::NlSocket;

/// The interface kube-ipvs binds service addresses to by default.
pub const DEFAULT_DUMMY: &str = "kube-ipvs0";

/// The routing protocol number of kube-ipvs's local routes (`ip route show table local proto
/// 124`): it tells them from the kernel's and other programs' routes, and a delete that names it
/// removes only ours. Unassigned in iproute2's `rt_protos`.
pub const ROUTE_PROTOCOL: u8 = 124;
/// The protocol of the routes the kernel makes itself, such as an address's (`RTPROT_KERNEL`).
const RTPROT_KERNEL: u8 = 2;
/// The kernel's local table (`RT_TABLE_LOCAL`), where it keeps the routes of local addresses.
const RT_TABLE_LOCAL: u8 = 255;
/// How long a move to addresses waits for the kernel's own routes of IPv6 addresses.
const V6_ROUTE_PATIENCE: Duration = Duration::from_secs(5);
/// The loopback interface our local routes go through.
const LOOPBACK: &str = "lo";

/// `IFNAMSIZ - 1`.
const MAX_IFNAME: usize = 15;
/// Address requests per `sendmsg`, at most.
const ADDRESS_BATCH: usize = 1000;
/// Receive buffer bytes one queued acknowledgement costs (an skb's truesize).
const ACK_COST: usize = 1024;
/// The receive buffer asked for before a batch of address requests.
const ADDRESS_RCVBUF: usize = 1 << 20;

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

/// The address a route makes local, if it is one of ours: protocol [`ROUTE_PROTOCOL`], type
/// local, in the local table, through `lo` (interface index `lo`), for one whole address.
fn our_local_route(r: &RouteMessage, lo: u32) -> Option<IpAddr> {
    local_route_of(r, ROUTE_PROTOCOL, Some(lo))
}

/// The address a route makes local, if it is of `protocol`, type local, in the local table,
/// through interface `oif` when given, for one whole address.
fn local_route_of(r: &RouteMessage, protocol: u8, oif: Option<u32>) -> Option<IpAddr> {
    let h = &r.header;
    let through_lo = oif.is_none_or(|lo| {
        r.attributes
            .iter()
            .any(|a| matches!(a, RouteAttribute::Oif(i) if *i == lo))
    });
    let table = r
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(h.table));
    if u8::from(h.protocol) != protocol
        || !through_lo
        || h.kind != RouteType::Local
        || table != u32::from(RT_TABLE_LOCAL)
    {
        return None;
    }
    let addr = r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        RouteAttribute::Destination(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    })?;
    let full = if addr.is_ipv4() { 32 } else { 128 };
    (h.destination_prefix_length == full).then_some(addr)
}

/// The addresses whose request succeeded, and the first failure.
fn split(addrs: &[IpAddr], results: Vec<Result<()>>) -> (Vec<IpAddr>, Option<Error>) {
    let mut moved = Vec::with_capacity(addrs.len());
    let mut failed = None;
    for (a, r) in addrs.iter().zip(results) {
        match r {
            Ok(()) => moved.push(*a),
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    (moved, failed)
}

/// The interface's own address in an address message.
fn own_address(a: &AddressMessage) -> Option<IpAddr> {
    // For IPv4, IFA_LOCAL is the interface's own address and IFA_ADDRESS the peer on point-to-point links;
    // IPv6 sends only IFA_ADDRESS.
    let mut local = None;
    let mut address = None;
    for attr in &a.attributes {
        match attr {
            AddressAttribute::Local(ip) => local = Some(*ip),
            AddressAttribute::Address(ip) => address = Some(*ip),
            _ => {}
        }
    }
    local.or(address)
}

/// The multicast groups of IPv4 and IPv6 address changes (`RTNLGRP_IPV4_IFADDR`, `RTNLGRP_IPV6_IFADDR`).
const IFADDR_GROUPS: [u32; 2] = [libc::RTNLGRP_IPV4_IFADDR, libc::RTNLGRP_IPV6_IFADDR];

/// The kernel's message types for an added and a removed address.
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;

/// One change to the node's addresses, as the kernel announced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AddressEvent {
    /// An address was added (or an existing one changed, e.g. its lifetime or flags).
    Added {
        /// Interface index.
        index: u32,
        /// The address.
        addr: IpAddr,
        /// Its prefix length.
        prefix: u8,
    },
    /// An address was removed.
    Removed {
        /// Interface index.
        index: u32,
        /// The address.
        addr: IpAddr,
        /// Its prefix length.
        prefix: u8,
    },
    /// Notifications were lost (the socket's receive buffer overflowed, `ENOBUFS`, or a message could not be
    /// parsed): the caller must re-read every address instead of trusting the events it saw.
    Resync,
}

/// A subscription to the kernel's address notifications in the caller's network namespace.
///
/// Events are only those that happen after [`AddressWatch::subscribe`] returns, so a caller subscribes first and
/// then reads the current addresses, and misses nothing in between.
pub struct AddressWatch {
    sock: NlSocket,
    buf: Vec<u8>,
    /// Events of a datagram that carried more than one message.
    pending: VecDeque<AddressEvent>,
    /// The receive timeout the socket has now.
    timeout: Option<Duration>,
}

impl AddressWatch {
    /// Opens a route netlink socket joined to the IPv4 and IPv6 address groups.
    pub fn subscribe() -> Result<Self> {
        let sock = NlSocket::open_groups(netlink_sys::protocols::NETLINK_ROUTE, &IFADDR_GROUPS)
            .map_err(|source| Error::Io {
                op: "subscribe to address notifications".to_owned(),
                source,
            })?;
        Ok(AddressWatch {
            sock,
            buf: Vec::with_capacity(64 * 1024),
            pending: VecDeque::new(),
            timeout: None,
        })
    }

    /// Waits for the next address event.
    pub fn recv(&mut self) -> Result<AddressEvent> {
        self.set_timeout(None)?;
        loop {
            if let Some(event) = self.next()? {
                return Ok(event);
            }
        }
    }

    /// Waits at most about `timeout` for the next address event; `None` when none came. (The wait starts again
    /// when a datagram holds only messages that are not address events.)
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<AddressEvent>> {
        self.set_timeout(Some(timeout))?;
        self.next()
    }

    fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<()> {
        if self.timeout != timeout {
            self.sock
                .set_recv_timeout(timeout)
                .map_err(|source| Error::Io {
                    op: "set the receive timeout of the address subscription".to_owned(),
                    source,
                })?;
            self.timeout = timeout;
        }
        Ok(())
    }

    /// The next queued event, or the events of the next datagram; `None` on a timeout.
    fn next(&mut self) -> Result<Option<AddressEvent>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Ok(Some(event));
            }
            match self.sock.recv(&mut self.buf, true) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    return Ok(Some(AddressEvent::Resync));
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(Error::Io {
                        op: "receive address notifications".to_owned(),
                        source,
                    });
                }
            }
            self.pending = parse_events(&self.buf);
        }
    }
}

/// The address events in one notification datagram. A message that cannot be parsed means an event the caller
/// does not know about, so it becomes a [`AddressEvent::Resync`] rather than an error that would end the watch.
pub(crate) fn parse_events(datagram: &[u8]) -> VecDeque<AddressEvent> {
    let mut out = VecDeque::new();
    for m in crate::wire::messages(datagram) {
        let Ok((h, _, whole)) = m else {
            out.push_back(AddressEvent::Resync);
            break;
        };
        if h.kind != RTM_NEWADDR && h.kind != RTM_DELADDR {
            continue;
        }
        let parsed = match NetlinkMessage::<RouteNetlinkMessage>::deserialize(whole) {
            Ok(p) => p,
            Err(_) => {
                out.push_back(AddressEvent::Resync);
                continue;
            }
        };
        let event = match parsed.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewAddress(a)) => own_address(&a)
                .map(|addr| AddressEvent::Added {
                    index: a.header.index,
                    addr,
                    prefix: a.header.prefix_len,
                }),
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelAddress(a)) => own_address(&a)
                .map(|addr| AddressEvent::Removed {
                    index: a.header.index,
                    addr,
                    prefix: a.header.prefix_len,
                }),
            _ => None,
        };
        out.extend(event);
    }
    out
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
        f: impl FnMut(RouteNetlinkMessage) -> Result<()>,
    ) -> Result<i32> {
        self.request_with(payload, flags, op, false, f)
    }

    /// [`Rtnl::request`], with reply messages the route crate cannot decode skipped instead of
    /// failing the request when `skip_undecodable` (a dump of every route of the node, some of
    /// them kinds the crate does not know, of which only ours matter).
    fn request_with(
        &mut self,
        payload: RouteNetlinkMessage,
        flags: u16,
        op: &dyn Fn() -> String,
        skip_undecodable: bool,
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
            for m in crate::wire::messages(&self.buf) {
                let (h, payload, whole) = m?;
                if h.seq != seq {
                    continue;
                }
                match h.kind {
                    crate::wire::NLMSG_DONE => return Ok(0),
                    crate::wire::NLMSG_ERROR => {
                        return crate::wire::error_code(payload);
                    }
                    _ => {
                        let parsed = match NetlinkMessage::<RouteNetlinkMessage>::deserialize(whole)
                        {
                            Ok(m) => m,
                            Err(_) if skip_undecodable => continue,
                            Err(e) => return Err(Error::decode(op(), e)),
                        };
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

    /// Deletes interface `name` (one RTM_DELLINK by index); `false` if there was no such interface. The caller
    /// decides which interface may go: this deletes whatever carries the name.
    pub fn delete_link(&mut self, name: &str) -> Result<bool> {
        let Some(index) = self.link_index(name)? else {
            return Ok(false);
        };
        let op = || format!("delete interface {name}");
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        let errno = self.request(
            RouteNetlinkMessage::DelLink(msg),
            NLM_F_REQUEST | NLM_F_ACK,
            &op,
            |_| Ok(()),
        )?;
        match errno {
            0 => Ok(true),
            // Gone between the lookup and here: the outcome the caller wanted.
            libc::ENODEV => Ok(false),
            e => Err(kernel_err(op(), e)),
        }
    }

    fn dump_addresses(&mut self, op: &dyn Fn() -> String) -> Result<Vec<LocalAddress>> {
        let mut out = Vec::new();
        let errno = self.request(
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            NLM_F_REQUEST | NLM_F_DUMP,
            op,
            |reply| {
                if let RouteNetlinkMessage::NewAddress(a) = reply
                    && let Some(addr) = own_address(&a)
                {
                    out.push(LocalAddress {
                        ifindex: a.header.index,
                        addr,
                        prefix_len: a.header.prefix_len,
                    });
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

    /// Adds many addresses to `ifname` like [`Rtnl::add_address`], one result per address in
    /// order, with one interface lookup and many requests per `sendmsg` (a startup binds one
    /// address per ClusterIP: 10,000 round trips, and as many link lookups, cost seconds). The
    /// outer error is the interface lookup's.
    pub fn add_addresses(&mut self, ifname: &str, addrs: &[IpAddr]) -> Result<Vec<Result<()>>> {
        let index = self.index_of(ifname)?;
        Ok(self.send_batched(
            addrs,
            |addr| format!("add address {addr} to {ifname}"),
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            |addr| RouteNetlinkMessage::NewAddress(Self::address_message(index, addr)),
        ))
    }

    /// Sends one request per address, many per `sendmsg`, and returns one result per address in
    /// order: an `EEXIST` answer counts as done. An address that is not unicast is refused
    /// without a request.
    fn send_batched(
        &mut self,
        addrs: &[IpAddr],
        op: impl Fn(&IpAddr) -> String,
        flags: u16,
        message: impl Fn(IpAddr) -> RouteNetlinkMessage,
    ) -> Vec<Result<()>> {
        let mut results: Vec<Option<Result<()>>> = addrs
            .iter()
            .map(|a| Self::check_addr(&|| op(a), a).err().map(Err))
            .collect();
        let todo: Vec<usize> = (0..addrs.len()).filter(|&i| results[i].is_none()).collect();
        // The kernel charges each queued acknowledgement its skb's truesize (about 1 KiB), not
        // its 36 bytes: a batch is as large as the receive buffer holds acknowledgements.
        let rcvbuf = if todo.len() > 1 {
            self.sock.grow_rcvbuf(ADDRESS_RCVBUF).unwrap_or(0)
        } else {
            0
        };
        let batch = (rcvbuf / ACK_COST).clamp(1, ADDRESS_BATCH);
        for chunk in todo.chunks(batch) {
            let first = self.seq;
            self.seq = self
                .seq
                .wrapping_add(u32::try_from(chunk.len()).unwrap_or(u32::MAX));
            let mut out = Vec::with_capacity(chunk.len() * 64);
            for (k, &i) in chunk.iter().enumerate() {
                let mut header = NetlinkHeader::default();
                header.flags = flags;
                header.sequence_number = first.wrapping_add(u32::try_from(k).unwrap_or(u32::MAX));
                let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(message(addrs[i])));
                msg.finalize();
                let at = out.len();
                out.resize(at + msg.buffer_len(), 0);
                msg.serialize(&mut out[at..]);
            }
            if let Err(e) = self.sock.send(&out) {
                for &i in chunk {
                    results[i] = Some(Err(Error::Io {
                        op: op(&addrs[i]),
                        source: io::Error::new(e.kind(), e.to_string()),
                    }));
                }
                continue;
            }
            let (codes, _) = self
                .sock
                .read_acks(&mut self.buf, first, chunk.len(), false);
            for (&i, code) in chunk.iter().zip(codes) {
                results[i] = code.map(|errno| match errno {
                    0 | libc::EEXIST => Ok(()),
                    e => Err(kernel_err(op(&addrs[i]), e)),
                });
            }
        }
        results
            .into_iter()
            .zip(addrs)
            .map(|(r, a)| r.unwrap_or_else(|| Err(Error::AckLost { op: op(a) })))
            .collect()
    }

    /// Removes `addr` from `ifname`; an address that is not there, or an interface that is not
    /// there, is fine.
    pub fn del_address(&mut self, ifname: &str, addr: IpAddr) -> Result<()> {
        let op = || format!("remove address {addr} from {ifname}");
        Self::check_addr(&op, &addr)?;
        let Some(index) = self.link_index(ifname)? else {
            return Ok(());
        };
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

    /// The local route that makes `addr` local without an address (`ip route add local ADDR
    /// dev lo table local proto 124 scope host`): what [`Rtnl::add_local_routes`] adds and
    /// [`Rtnl::del_local_route`] removes.
    fn local_route_message(lo: u32, addr: IpAddr) -> RouteMessage {
        let mut msg = RouteMessage::default();
        let (family, len) = match addr {
            IpAddr::V4(_) => (AddressFamily::Inet, 32),
            IpAddr::V6(_) => (AddressFamily::Inet6, 128),
        };
        msg.header.address_family = family;
        msg.header.destination_prefix_length = len;
        msg.header.table = RT_TABLE_LOCAL;
        msg.header.protocol = RouteProtocol::from(ROUTE_PROTOCOL);
        msg.header.scope = RouteScope::Host;
        msg.header.kind = RouteType::Local;
        msg.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(addr)));
        msg.attributes.push(RouteAttribute::Oif(lo));
        msg
    }

    /// Makes each address local with a route of ours (see [`ROUTE_PROTOCOL`]) in the local
    /// table through `lo`, one result per address in order, many requests per `sendmsg`. Unlike
    /// an address, a route costs the kernel no walk of an interface's address list: 50,000 take
    /// seconds, not minutes. A route of ours already there is fine; a route of ours goes in
    /// beside the kernel's own local route of an address bound somewhere (it does not replace
    /// it, and outlives it), so moving from addresses to routes leaves no moment unrouted. The
    /// outer error is the loopback lookup's.
    pub fn add_local_routes(&mut self, addrs: &[IpAddr]) -> Result<Vec<Result<()>>> {
        let lo = self.index_of(LOOPBACK)?;
        Ok(self.send_batched(
            addrs,
            |addr| format!("add local route {addr}"),
            // No NLM_F_EXCL: the kernel's local route of the same address (another protocol,
            // another device) is no conflict; only a route identical to ours answers EEXIST.
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE,
            |addr| RouteNetlinkMessage::NewRoute(Self::local_route_message(lo, addr)),
        ))
    }

    /// Removes our local route of `addr` (only ours: the request names our protocol); a route
    /// that is not there is fine.
    pub fn del_local_route(&mut self, addr: IpAddr) -> Result<()> {
        let op = || format!("remove local route {addr}");
        Self::check_addr(&op, &addr)?;
        let lo = self.index_of(LOOPBACK)?;
        let errno = self.request(
            RouteNetlinkMessage::DelRoute(Self::local_route_message(lo, addr)),
            NLM_F_REQUEST | NLM_F_ACK,
            &op,
            |_| Ok(()),
        )?;
        match errno {
            0 | libc::ESRCH | libc::ENOENT => Ok(()),
            e => Err(kernel_err(op(), e)),
        }
    }

    /// Moves `addrs` from addresses on `ifname` to local routes of ours: each is routed first,
    /// then unbound if its route went in, so none stops being local in between. With `whole`
    /// (they are every address on `ifname`) the interface is deleted and made again instead of
    /// unbinding one address at a time, which walks the address list. Says how many moved, or
    /// the first failure once the others are moved.
    pub fn move_to_routes(&mut self, ifname: &str, addrs: &[IpAddr], whole: bool) -> Result<usize> {
        if addrs.is_empty() {
            return Ok(0);
        }
        let (moved, failed) = split(addrs, self.add_local_routes(addrs)?);
        if whole && failed.is_none() {
            self.delete_link(ifname)?;
            self.ensure_dummy(ifname)?;
        } else {
            for &a in &moved {
                self.del_address(ifname, a)?;
            }
        }
        failed.map_or(Ok(moved.len()), Err)
    }

    /// Moves `addrs` from local routes of ours to addresses on `ifname` (made if missing): each
    /// is bound first, then its route removed once the address is routed by the kernel (an
    /// IPv6 address's own route comes from the kernel's address work a moment after the add is
    /// answered, so it is waited for, up to 5 s; one whose route does not come keeps ours too).
    /// Says how many moved, or the first failure once the others are moved.
    pub fn move_to_addresses(&mut self, ifname: &str, addrs: &[IpAddr]) -> Result<usize> {
        if addrs.is_empty() {
            return Ok(0);
        }
        self.ensure_dummy(ifname)?;
        let (moved, failed) = split(addrs, self.add_addresses(ifname, addrs)?);
        // Sets: an IPv6-only cluster moves every Service address through here.
        let mut waiting: std::collections::HashSet<IpAddr> =
            moved.iter().copied().filter(IpAddr::is_ipv6).collect();
        let deadline = std::time::Instant::now() + V6_ROUTE_PATIENCE;
        while !waiting.is_empty() {
            for routed in self.kernel_local_routes_v6()? {
                waiting.remove(&routed);
            }
            if waiting.is_empty() || std::time::Instant::now() >= deadline {
                break;
            }
            // The kernel's address work runs on its own; nothing here to wake on but time.
            std::thread::sleep(Duration::from_millis(10));
        }
        for a in moved.iter().filter(|a| !waiting.contains(a)) {
            self.del_local_route(*a)?;
        }
        failed.map_or(Ok(moved.len()), Err)
    }

    /// The addresses our local routes make local (routes of [`ROUTE_PROTOCOL`] of type local
    /// in the local table through `lo`), IPv4 and IPv6. A route of the node's that the route
    /// crate cannot decode is no route of ours, and is skipped.
    pub fn local_routes(&mut self) -> Result<Vec<IpAddr>> {
        let lo = self.index_of(LOOPBACK)?;
        self.dump_local_routes(&[AddressFamily::Inet, AddressFamily::Inet6], |r| {
            our_local_route(r, lo)
        })
    }

    /// The IPv6 addresses whose own local route the kernel has put in the local table
    /// (protocol kernel). It puts it there from its address work a moment after it answers an
    /// IPv6 address add (IPv4's goes in before the answer), so whoever must not leave an IPv6
    /// address unrouted waits for it here.
    pub fn kernel_local_routes_v6(&mut self) -> Result<Vec<IpAddr>> {
        self.dump_local_routes(&[AddressFamily::Inet6], |r| {
            local_route_of(r, RTPROT_KERNEL, None)
        })
    }

    /// The addresses of the local routes of `families` that `keep` picks.
    fn dump_local_routes(
        &mut self,
        families: &[AddressFamily],
        keep: impl Fn(&RouteMessage) -> Option<IpAddr>,
    ) -> Result<Vec<IpAddr>> {
        let op = || "list local routes".to_owned();
        let mut out = Vec::new();
        for &family in families {
            let mut msg = RouteMessage::default();
            msg.header.address_family = family;
            let errno = self.request_with(
                RouteNetlinkMessage::GetRoute(msg),
                NLM_F_REQUEST | NLM_F_DUMP,
                &op,
                true,
                |reply| {
                    if let RouteNetlinkMessage::NewRoute(r) = reply
                        && let Some(addr) = keep(&r)
                    {
                        out.push(addr);
                    }
                    Ok(())
                },
            )?;
            if errno != 0 {
                return Err(kernel_err(op(), errno));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: RouteNetlinkMessage) -> Vec<u8> {
        let mut msg = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(payload));
        msg.finalize();
        let mut out = vec![0u8; msg.buffer_len()];
        msg.serialize(&mut out);
        out
    }

    fn address(index: u32, local: &str, peer: Option<&str>, prefix: u8) -> AddressMessage {
        let mut a = AddressMessage::default();
        a.header.family = AddressFamily::Inet;
        a.header.index = index;
        a.header.prefix_len = prefix;
        let local: IpAddr = local.parse().expect("literal");
        a.attributes.push(AddressAttribute::Local(local));
        let peer: IpAddr = peer.map_or(local, |p| p.parse().expect("literal"));
        a.attributes.push(AddressAttribute::Address(peer));
        a
    }

    /// The payload bytes (after the 16-byte netlink header) of a route message.
    fn route_payload(msg: RouteMessage) -> Vec<u8> {
        message(RouteNetlinkMessage::NewRoute(msg))[16..].to_vec()
    }

    #[test]
    fn a_local_route_is_ours_in_the_local_table_through_loopback() {
        let ip = |s: &str| -> IpAddr { s.parse().expect("literal") };
        // struct rtmsg, then RTA_DST and RTA_OIF, as `ip route add local 10.96.0.10/32 dev lo
        // table local proto 124 scope host` sends them.
        #[rustfmt::skip]
        let v4 = [
            2, 32, 0, 0, 255, 124, 254, 2, 0, 0, 0, 0,
            8, 0, 1, 0, 10, 96, 0, 10,
            8, 0, 4, 0, 1, 0, 0, 0,
        ];
        assert_eq!(
            route_payload(Rtnl::local_route_message(1, ip("10.96.0.10"))),
            v4
        );
        let v6 = route_payload(Rtnl::local_route_message(1, ip("fd00::a")));
        assert_eq!(v6[..12], [10, 128, 0, 0, 255, 124, 254, 2, 0, 0, 0, 0]);
        assert_eq!(v6[12..16], [20, 0, 1, 0], "RTA_DST of 16 bytes");
        assert_eq!(
            v6[16..32],
            [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0a]
        );
    }

    #[test]
    fn only_whole_local_routes_of_ours_in_the_local_table_are_read_back() {
        let ip = |s: &str| -> IpAddr { s.parse().expect("literal") };
        let ours = Rtnl::local_route_message(1, ip("10.96.0.10"));
        assert_eq!(our_local_route(&ours, 1), Some(ip("10.96.0.10")));
        let v6 = Rtnl::local_route_message(1, ip("fd00::a"));
        assert_eq!(our_local_route(&v6, 1), Some(ip("fd00::a")));
        // The kernel's route of a bound address: same table and type, another protocol.
        let mut kernel = ours.clone();
        kernel.header.protocol = RouteProtocol::Kernel;
        assert_eq!(our_local_route(&kernel, 1), None);
        // Ours by protocol, but a unicast route, a route of the main table, or a prefix.
        let mut unicast = ours.clone();
        unicast.header.kind = RouteType::Unicast;
        assert_eq!(our_local_route(&unicast, 1), None);
        let mut main = ours.clone();
        main.header.table = 254;
        assert_eq!(our_local_route(&main, 1), None);
        // A table past 255 is told by RTA_TABLE alone (the header then says 252, RT_TABLE_COMPAT).
        let mut far = ours.clone();
        far.header.table = 252;
        far.attributes.push(RouteAttribute::Table(1000));
        assert_eq!(our_local_route(&far, 1), None);
        // Ours by everything but the device: not ours to read (its delete, through lo, would
        // never match it).
        assert_eq!(our_local_route(&ours, 2), None);
        let mut prefix = ours;
        prefix.header.destination_prefix_length = 24;
        assert_eq!(our_local_route(&prefix, 1), None);
    }

    #[test]
    fn a_datagram_of_adds_and_removes_becomes_events_in_order() {
        let mut datagram = message(RouteNetlinkMessage::NewAddress(address(
            3,
            "192.168.77.10",
            None,
            24,
        )));
        // A point-to-point address: the event carries the interface's own (IFA_LOCAL) address.
        datagram.extend(message(RouteNetlinkMessage::DelAddress(address(
            4,
            "10.0.0.1",
            Some("10.0.0.2"),
            32,
        ))));
        // A link message in the same datagram is not an address event.
        datagram.extend(message(
            RouteNetlinkMessage::NewLink(LinkMessage::default()),
        ));
        let ip = |s: &str| -> IpAddr { s.parse().expect("literal") };
        assert_eq!(
            Vec::from(parse_events(&datagram)),
            vec![
                AddressEvent::Added {
                    index: 3,
                    addr: ip("192.168.77.10"),
                    prefix: 24
                },
                AddressEvent::Removed {
                    index: 4,
                    addr: ip("10.0.0.1"),
                    prefix: 32
                },
            ]
        );
    }

    #[test]
    fn an_unparsable_address_message_asks_for_a_resync() {
        let mut bytes = message(RouteNetlinkMessage::NewAddress(address(
            3,
            "192.168.77.10",
            None,
            24,
        )));
        // Declare an attribute longer than the message, which no parser can accept.
        let first_attr = 16 + 8;
        bytes[first_attr] = 0xff;
        assert_eq!(Vec::from(parse_events(&bytes)), vec![AddressEvent::Resync]);
    }
}
