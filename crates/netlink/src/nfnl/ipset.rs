//! ipsets over nfnetlink, of the kinds kube-ipvs uses ([`SetKind`]): the hairpin sets
//! ([`SET_V4`], [`SET_V6`], `hash:net,net` with a member `(a, a)` per local endpoint address
//! `a`, so one iptables rule matches a Pod reaching itself through a Service) and the service
//! sets the `filter` and `nat` rules match (`hash:ip`, `hash:ip,port`, `hash:ip,port,net`,
//! `bitmap:port`), and `hash:ip,port` with `skbinfo` (a mark per member, for the `mangle`
//! rules' `SET --map-mark`). One [`Member`] type covers every kind.
//!
//! This module owns one `NETLINK_NETFILTER` socket per [`Ipset`] handle and only ever touches
//! the sets it is asked about by name: create if absent, list members,
//! add and delete many members in one `sendmsg` (one acknowledgement per member), destroy. It
//! never flushes or destroys all sets. Messages are built and parsed by pure functions that the
//! unit tests drive without a kernel.
//!
//! The wire format is the kernel's `include/uapi/linux/netfilter/ipset/ip_set.h` (commands,
//! attribute numbers, error codes), as `net/netfilter/ipset/ip_set_core.c` reads it (a create
//! or add without `NLM_F_EXCL` carries `IPSET_FLAG_EXIST`, so re-creating an identical set,
//! adding a present member and deleting an absent one all succeed; a `DATA` or `IP` attribute
//! must carry `NLA_F_NESTED`, an address or `u32` must carry `NLA_F_NET_BYTEORDER`) and
//! each type's `uadt` lays members out (`IP`, `IP2`, `CIDR`, `CIDR2`, `PORT`, `PROTO`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{DumpEnd, NfSocket, begin, dump_step};
use crate::Family;
use crate::error::{Error, Result};
use crate::wire::{
    self, NLA_F_NESTED, NLA_F_NET_BYTEORDER, NLM_F_ACK, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST,
    Writer,
};

/// The IPv4 hairpin set.
pub const SET_V4: &str = "KUBE-IPVS-HAIRPIN";
/// The IPv6 hairpin set.
pub const SET_V6: &str = "KUBE-IPVS-HAIRPIN6";
/// The set type: a member is a (source network, destination network) pair.
pub const SET_TYPE: &str = "hash:net,net";
/// The most members a set may hold. The kernel's default (65,536) is below the number of local
/// endpoints a large node can have; memory grows with the members, not with this limit.
pub const MAX_ELEMENTS: u32 = 1 << 20;

/// The hairpin set of a family.
#[must_use]
pub fn set_name(family: Family) -> &'static str {
    match family {
        Family::V4 => SET_V4,
        Family::V6 => SET_V6,
    }
}

const NFNL_SUBSYS_IPSET: u16 = 6;
const IPSET_CMD_CREATE: u16 = 2;
const IPSET_CMD_DESTROY: u16 = 3;
const IPSET_CMD_LIST: u16 = 7;
const IPSET_CMD_ADD: u16 = 9;
const IPSET_CMD_DEL: u16 = 10;
/// `IPSET_PROTOCOL_MIN` of current kernels and `IPSET_PROTOCOL` of older ones: both accept it.
const IPSET_PROTOCOL: u8 = 6;
const IPSET_MAXNAMELEN: usize = 32;

// Attributes at command level.
const IPSET_ATTR_PROTOCOL: u16 = 1;
const IPSET_ATTR_SETNAME: u16 = 2;
const IPSET_ATTR_TYPENAME: u16 = 3;
const IPSET_ATTR_REVISION: u16 = 4;
const IPSET_ATTR_FAMILY: u16 = 5;
const IPSET_ATTR_DATA: u16 = 7;
const IPSET_ATTR_ADT: u16 = 8;
// Attributes inside DATA (CADT, create and ADT numbering).
const IPSET_ATTR_IP: u16 = 1;
const IPSET_ATTR_CIDR: u16 = 3;
const IPSET_ATTR_PORT: u16 = 4;
const IPSET_ATTR_PORT_TO: u16 = 5;
const IPSET_ATTR_PROTO: u16 = 7;
const IPSET_ATTR_CADT_FLAGS: u16 = 8;
const IPSET_ATTR_MAXELEM: u16 = 19;
const IPSET_ATTR_IP2: u16 = 20;
const IPSET_ATTR_CIDR2: u16 = 21;
const IPSET_ATTR_SKBMARK: u16 = 27;
/// `IPSET_FLAG_WITH_SKBINFO`, in `CADT_FLAGS` at create: members carry a mark for `SET
/// --map-set ... --map-mark`.
const IPSET_FLAG_WITH_SKBINFO: u32 = 1 << 6;
// Attributes inside IP and IP2.
const IPSET_ATTR_IPADDR_IPV4: u16 = 1;
const IPSET_ATTR_IPADDR_IPV6: u16 = 2;

/// ipset's private error codes (`enum ipset_errno` in `ip_set.h`), answered as errnos.
pub mod codes {
    /// The protocol version is not one the kernel speaks.
    pub const IPSET_ERR_PROTOCOL: i32 = 4097;
    /// The set type is unknown (its module is not loaded).
    pub const IPSET_ERR_FIND_TYPE: i32 = 4098;
    /// No room for more sets.
    pub const IPSET_ERR_MAX_SETS: i32 = 4099;
    /// The set is referenced (by an iptables rule).
    pub const IPSET_ERR_BUSY: i32 = 4100;
    /// A set of that name exists with another type or settings.
    pub const IPSET_ERR_EXIST_SETNAME2: i32 = 4101;
    /// The set type does not match.
    pub const IPSET_ERR_TYPE_MISMATCH: i32 = 4102;
    /// A prefix length is out of range.
    pub const IPSET_ERR_INVALID_CIDR: i32 = 4104;
    /// The address family does not match the set.
    pub const IPSET_ERR_INVALID_FAMILY: i32 = 4106;
    /// The set is referenced by a rule.
    pub const IPSET_ERR_REFERENCED: i32 = 4108;
    /// The first of the set types' own codes.
    pub const IPSET_ERR_TYPE_SPECIFIC: i32 = 4352;
}
pub use codes::IPSET_ERR_BUSY;
#[cfg(test)]
use codes::{IPSET_ERR_EXIST_SETNAME2, IPSET_ERR_PROTOCOL};

const NFPROTO_UNSPEC: u8 = 0;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
/// Members per `sendmsg`: their acknowledgements (one small skb each) must fit the socket's
/// receive buffer, or the kernel drops the excess and we could not tell which were applied.
const BATCH: usize = 128;

/// The error of a request the kernel refused, naming the set and what was being done to it.
fn refused(set: &str, what: impl std::fmt::Display, errno: i32) -> Error {
    Error::Netfilter {
        op: format!("ipset {set}: {what}"),
        errno,
    }
}

/// The set types this module creates and reads, each with the revision asked for at create.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SetKind {
    /// `hash:net,net`: (source network, destination network); [`Member::NetNet`].
    NetNet,
    /// `hash:ip`: one address; [`Member::Ip`].
    Ip,
    /// `hash:ip,port`: address, protocol and port; [`Member::IpPort`].
    IpPort,
    /// `hash:ip,port,net`: address, protocol, port and a network; [`Member::IpPortNet`].
    IpPortNet,
    /// `bitmap:port` over 0..=65535, family-independent: one port; [`Member::Port`].
    Port,
    /// `hash:ip,port` with `skbinfo`: address, protocol and port, each with a packet mark the
    /// iptables `SET` target can set (`--map-mark`); [`Member::IpPortMark`].
    IpPortMark,
}

impl SetKind {
    /// The kernel's type name.
    #[must_use]
    pub fn type_name(self) -> &'static str {
        match self {
            Self::NetNet => SET_TYPE,
            Self::Ip => "hash:ip",
            Self::IpPort | Self::IpPortMark => "hash:ip,port",
            Self::IpPortNet => "hash:ip,port,net",
            Self::Port => "bitmap:port",
        }
    }

    /// The revision asked for: the lowest that every kernel with the type knows and that has
    /// what we use (SCTP ports came with revision 1 of the `ip,port` types, `skbinfo` with
    /// revision 5 of `hash:ip,port`).
    fn revision(self) -> u8 {
        match self {
            Self::NetNet | Self::Ip | Self::Port => 0,
            Self::IpPort | Self::IpPortNet => 1,
            Self::IpPortMark => 5,
        }
    }
}

/// One member of a set of any [`SetKind`]. `protocol` is an IP protocol number (6 TCP, 17 UDP,
/// 132 SCTP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Member {
    /// A `hash:net,net` member.
    NetNet(Entry),
    /// A `hash:ip` member.
    Ip(IpAddr),
    /// A `hash:ip,port` member.
    IpPort {
        addr: IpAddr,
        protocol: u8,
        port: u16,
    },
    /// A `hash:ip,port,net` member.
    IpPortNet {
        addr: IpAddr,
        protocol: u8,
        port: u16,
        net: IpAddr,
        prefix: u8,
    },
    /// A `bitmap:port` member.
    Port(u16),
    /// A [`SetKind::IpPortMark`] member: the `SET` target gives a matching packet `mark` (the
    /// whole mark: the member's mark mask is `0xffffffff`).
    IpPortMark {
        addr: IpAddr,
        protocol: u8,
        port: u16,
        mark: u32,
    },
}

impl From<Entry> for Member {
    fn from(e: Entry) -> Self {
        Self::NetNet(e)
    }
}

/// `ipset`'s name of a protocol: `tcp`, `udp`, `sctp`, or the number.
fn protocol_text(p: u8) -> std::borrow::Cow<'static, str> {
    match p {
        6 => "tcp".into(),
        17 => "udp".into(),
        132 => "sctp".into(),
        n => n.to_string().into(),
    }
}

impl std::fmt::Display for Member {
    /// As `ipset save` prints it: `10.0.0.1`, `10.0.0.1,tcp:80`, `10.0.0.1,tcp:80,10.1.0.0/16`,
    /// `80`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::NetNet(e) => e.fmt(f),
            Self::Ip(a) => write!(f, "{a}"),
            Self::IpPort {
                addr,
                protocol,
                port,
            } => write!(f, "{addr},{}:{port}", protocol_text(protocol)),
            Self::IpPortNet {
                addr,
                protocol,
                port,
                net,
                prefix,
            } => write!(
                f,
                "{addr},{}:{port},{net}/{prefix}",
                protocol_text(protocol)
            ),
            Self::Port(p) => write!(f, "{p}"),
            Self::IpPortMark {
                addr,
                protocol,
                port,
                mark,
            } => write!(
                f,
                "{addr},{}:{port} skbmark {mark:#x}",
                protocol_text(protocol)
            ),
        }
    }
}

impl Member {
    /// The address family of the member; `None` for a port.
    #[must_use]
    pub fn family(&self) -> Option<Family> {
        match *self {
            Self::NetNet(e) => Some(Family::of(e.src)),
            Self::Ip(a)
            | Self::IpPort { addr: a, .. }
            | Self::IpPortNet { addr: a, .. }
            | Self::IpPortMark { addr: a, .. } => Some(Family::of(a)),
            Self::Port(_) => None,
        }
    }

    fn is_valid(&self) -> bool {
        match *self {
            Self::NetNet(e) => e.is_valid(),
            Self::Ip(_) | Self::Port(_) => true,
            Self::IpPort { protocol, .. } => protocol != 0,
            // Mark 0 is never one of ours, but a member read back with it (a mapping under
            // another mask) must still be deletable.
            Self::IpPortMark { protocol, .. } => protocol != 0,
            Self::IpPortNet {
                addr,
                protocol,
                net,
                prefix,
                ..
            } => {
                protocol != 0
                    && addr.is_ipv4() == net.is_ipv4()
                    && (1..=host_prefix(net)).contains(&prefix)
            }
        }
    }
}

/// One member of a `hash:net,net` set: a source and a destination network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Entry {
    pub src: IpAddr,
    pub src_prefix: u8,
    pub dst: IpAddr,
    pub dst_prefix: u8,
}

impl Entry {
    /// The hairpin member of one address: `(a/32, a/32)` or `(a/128, a/128)`.
    pub fn hairpin(addr: IpAddr) -> Self {
        let p = host_prefix(addr);
        Self {
            src: addr,
            src_prefix: p,
            dst: addr,
            dst_prefix: p,
        }
    }

    /// The address, if this is the hairpin member of one.
    pub fn hairpin_addr(&self) -> Option<IpAddr> {
        (*self == Self::hairpin(self.src)).then_some(self.src)
    }

    fn is_valid(&self) -> bool {
        self.src.is_ipv4() == self.dst.is_ipv4()
            && (1..=host_prefix(self.src)).contains(&self.src_prefix)
            && (1..=host_prefix(self.dst)).contains(&self.dst_prefix)
    }
}

impl std::fmt::Display for Entry {
    /// As `ipset save` prints it: `10.0.0.1,10.0.0.1` for host members, with `/prefix` otherwise.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let net = |f: &mut std::fmt::Formatter<'_>, a: IpAddr, p: u8| {
            if p == host_prefix(a) {
                write!(f, "{a}")
            } else {
                write!(f, "{a}/{p}")
            }
        };
        net(f, self.src, self.src_prefix)?;
        f.write_str(",")?;
        net(f, self.dst, self.dst_prefix)
    }
}

fn host_prefix(a: IpAddr) -> u8 {
    if a.is_ipv4() { 32 } else { 128 }
}

fn nfproto(family: Family) -> u8 {
    match family {
        Family::V4 => NFPROTO_IPV4,
        Family::V6 => NFPROTO_IPV6,
    }
}

fn check_name(set: &str) -> Result<()> {
    if set.is_empty() || set.len() >= IPSET_MAXNAMELEN || set.contains('\0') {
        return Err(Error::Invalid {
            op: format!("ipset {set:?}"),
            reason: "the name must be 1 to 31 bytes without NUL".to_owned(),
        });
    }
    Ok(())
}

/// A handle on the kernel's ipsets of this network namespace: one `NETLINK_NETFILTER` socket.
pub struct Ipset {
    socket: NfSocket,
}

impl std::fmt::Debug for Ipset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ipset")
            .field("seq", &self.socket.seq)
            .finish()
    }
}

impl Ipset {
    /// Opens the netfilter netlink socket.
    pub fn new() -> Result<Self> {
        Ok(Self {
            socket: NfSocket::open("ipset *: open")?,
        })
    }

    /// Creates the set `set` of `kind` for `family` if it is absent (a [`SetKind::Port`] set is
    /// for both families; `family` is then only named in errors). An existing set of that name
    /// with the same type and settings is fine; any other is an error naming the set.
    pub fn create(&mut self, set: &str, family: Family, kind: SetKind) -> Result<()> {
        check_name(set)?;
        let seq = self.socket.next_seqs(1);
        let msg = create_request(seq, set, family, kind);
        let what = format!(
            "create {} family {}",
            kind.type_name(),
            nfproto_name(family)
        );
        match self.request(set, &what, &msg, seq, 1)?.pop().flatten() {
            Some(0) | None => Ok(()),
            // `ip_set_create` answers EEXIST when the set of that name differs in type,
            // family or settings (an identical one is accepted above).
            Some(libc::EEXIST) => Err(refused(
                set,
                format!("{what}: a set of that name exists with another type or settings"),
                libc::EEXIST,
            )),
            Some(errno) => Err(refused(set, what, errno)),
        }
    }

    /// Destroys the set; `false` if it was absent. A set an iptables rule references cannot be
    /// destroyed (`IPSET_ERR_BUSY`): remove the rule first.
    pub fn destroy(&mut self, set: &str) -> Result<bool> {
        check_name(set)?;
        // Asked to tell an absent set (with NLM_F_EXCL the kernel answers ENOENT).
        let seq = self.socket.next_seqs(1);
        let msg = destroy_request(seq, set);
        match self.request(set, "destroy", &msg, seq, 1)?.pop().flatten() {
            Some(0) | None => Ok(true),
            Some(libc::ENOENT) => Ok(false),
            Some(errno) => Err(refused(set, "destroy", errno)),
        }
    }

    /// The members of a set, or `None` if there is no such set.
    pub fn list(&mut self, set: &str) -> Result<Option<Vec<Member>>> {
        self.list_capturing(set, None)
    }

    /// [`Ipset::list`], also keeping each reply datagram as received in `raw` (to capture
    /// fixtures from a real kernel).
    pub fn list_capturing(
        &mut self,
        set: &str,
        mut raw: Option<&mut Vec<Vec<u8>>>,
    ) -> Result<Option<Vec<Member>>> {
        check_name(set)?;
        let seq = self.socket.next_seqs(1);
        let mut entries = Vec::new();
        let op = format!("ipset {set}: list");
        self.socket
            .dump(&list_request(seq, set), &op, |buf| {
                if let Some(r) = raw.as_deref_mut() {
                    r.push(buf.to_vec());
                }
                Ok(match list_step(buf, Some(seq), set, &mut entries)? {
                    ListStep::More => None,
                    ListStep::Done => Some(true),
                    ListStep::Absent => Some(false),
                })
            })
            .map(|present| present.then_some(entries))
    }

    /// Adds the members (present ones are fine), in batches of one `sendmsg` each. Hairpin
    /// [`Entry`]s are members too.
    pub fn add<M: Into<Member> + Copy>(&mut self, set: &str, members: &[M]) -> Result<()> {
        self.change(set, IPSET_CMD_ADD, "add", members)
    }

    /// Deletes the members (absent ones are fine), in batches of one `sendmsg` each.
    pub fn del<M: Into<Member> + Copy>(&mut self, set: &str, members: &[M]) -> Result<()> {
        self.change(set, IPSET_CMD_DEL, "del", members)
    }

    fn change<M: Into<Member> + Copy>(
        &mut self,
        set: &str,
        cmd: u16,
        verb: &str,
        entries: &[M],
    ) -> Result<()> {
        check_name(set)?;
        if let Some(bad) = entries.iter().map(|&m| m.into()).find(|e| !e.is_valid()) {
            return Err(Error::Invalid {
                op: format!("ipset {set}: member {bad}"),
                reason: "prefix length, protocol or family out of range".to_owned(),
            });
        }
        // Each queued acknowledgement costs its skb's truesize (about 1 KiB) of the receive
        // buffer, so a batch is no larger than the buffer holds.
        let batch = self
            .socket
            .rcvbuf()
            .map_or(BATCH, |b| (b / 1024).clamp(1, BATCH));
        let mut msgs = Vec::new();
        for chunk in entries.chunks(batch) {
            msgs.clear();
            let first = self.socket.next_seqs(chunk.len());
            for (seq, &e) in (first..).zip(chunk) {
                member_request(&mut msgs, cmd, seq, set, &e.into());
            }
            let acks = self.request(set, verb, &msgs, first, chunk.len())?;
            // The first refusal names its member; the others were still applied or refused
            // by the kernel on their own.
            if let Some((e, errno)) = chunk
                .iter()
                .zip(&acks)
                .find_map(|(&e, a)| a.filter(|&c| c != 0).map(|c| (e.into(), c)))
            {
                let e: Member = e;
                return Err(refused(set, format!("{verb} {e}"), errno));
            }
        }
        Ok(())
    }

    /// Sends `n` requests (sequence numbers `first..first + n`) in one datagram and reads their
    /// acknowledgements: each request's errno or 0. Requests the kernel did not answer are an
    /// error, unless it refused one (a refused datagram, e.g. EPERM without CAP_NET_ADMIN, is
    /// answered once, for its first message): then the answers are the kernel's word.
    fn request(
        &mut self,
        set: &str,
        what: &str,
        msgs: &[u8],
        first: u32,
        n: usize,
    ) -> Result<Vec<Option<i32>>> {
        let acks = self
            .socket
            .acked(msgs, first, n, &format!("ipset {set}: {what}"))?;
        let unanswered = acks.iter().filter(|a| a.is_none()).count();
        if unanswered > 0 && !acks.iter().any(|a| a.is_some_and(|c| c != 0)) {
            return Err(Error::Io {
                op: format!(
                    "ipset {set}: {what}: {unanswered} of {n} requests unanswered: netlink socket"
                ),
                source: std::io::Error::from_raw_os_error(libc::ENOBUFS),
            });
        }
        Ok(acks)
    }
}

fn nfproto_name(family: Family) -> &'static str {
    match family {
        Family::V4 => "inet",
        Family::V6 => "inet6",
    }
}

fn put_name(w: &mut Writer<'_>, kind: u16, name: &str) {
    w.put_str(kind, name);
}

fn put_addr(w: &mut Writer<'_>, kind: u16, addr: IpAddr) {
    let nest = w.begin_nest(kind | NLA_F_NESTED);
    match addr {
        IpAddr::V4(a) => w.put(IPSET_ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, &a.octets()),
        IpAddr::V6(a) => w.put(IPSET_ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, &a.octets()),
    }
    w.end_nest(nest);
}

/// Starts a request in `buf`: the netlink and nfgenmsg headers plus the protocol and set name every
/// request starts with. Returns the message's offset for [`Writer::end_msg`].
fn start(w: &mut Writer<'_>, cmd: u16, flags: u16, seq: u32, set: &str) -> usize {
    // The nfgenmsg family: the kernel ignores it for ipset.
    let msg = begin(w, NFNL_SUBSYS_IPSET, cmd, flags, seq, NFPROTO_IPV4);
    w.put(IPSET_ATTR_PROTOCOL, &[IPSET_PROTOCOL]);
    put_name(w, IPSET_ATTR_SETNAME, set);
    msg
}

/// `IPSET_CMD_CREATE` of a set of `kind`, without `NLM_F_EXCL`: hash sets hold up to
/// [`MAX_ELEMENTS`], the port bitmap covers every port.
fn create_request(seq: u32, set: &str, family: Family, kind: SetKind) -> Vec<u8> {
    let mut buf = Vec::with_capacity(96);
    let mut w = Writer::new(&mut buf);
    let msg = start(
        &mut w,
        IPSET_CMD_CREATE,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        set,
    );
    put_name(&mut w, IPSET_ATTR_TYPENAME, kind.type_name());
    w.put(IPSET_ATTR_REVISION, &[kind.revision()]);
    // `bitmap:port` is of no family (the kernel sets NFPROTO_UNSPEC on it whatever is asked).
    let nf = if kind == SetKind::Port {
        NFPROTO_UNSPEC
    } else {
        nfproto(family)
    };
    w.put(IPSET_ATTR_FAMILY, &[nf]);
    let data = w.begin_nest(IPSET_ATTR_DATA | NLA_F_NESTED);
    if kind == SetKind::Port {
        w.put(IPSET_ATTR_PORT | NLA_F_NET_BYTEORDER, &0u16.to_be_bytes());
        w.put(
            IPSET_ATTR_PORT_TO | NLA_F_NET_BYTEORDER,
            &u16::MAX.to_be_bytes(),
        );
    } else {
        w.put(
            IPSET_ATTR_MAXELEM | NLA_F_NET_BYTEORDER,
            &MAX_ELEMENTS.to_be_bytes(),
        );
    }
    if kind == SetKind::IpPortMark {
        w.put(
            IPSET_ATTR_CADT_FLAGS | NLA_F_NET_BYTEORDER,
            &IPSET_FLAG_WITH_SKBINFO.to_be_bytes(),
        );
    }
    w.end_nest(data);
    w.end_msg(msg);
    buf
}

/// `IPSET_CMD_DESTROY` of one set, with `NLM_F_EXCL` so an absent set is told (ENOENT).
fn destroy_request(seq: u32, set: &str) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64);
    let mut w = Writer::new(&mut buf);
    let msg = start(
        &mut w,
        IPSET_CMD_DESTROY,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL,
        seq,
        set,
    );
    w.end_msg(msg);
    buf
}

/// `IPSET_CMD_LIST` dump of one set.
fn list_request(seq: u32, set: &str) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64);
    let mut w = Writer::new(&mut buf);
    let msg = start(&mut w, IPSET_CMD_LIST, NLM_F_REQUEST | NLM_F_DUMP, seq, set);
    w.end_msg(msg);
    buf
}

/// Appends `IPSET_CMD_ADD` or `IPSET_CMD_DEL` of one member, without `NLM_F_EXCL`, to `buf`.
/// The attributes are those the type's `uadt` reads (`ip_set_hash_*.c`, `ip_set_bitmap_port.c`).
fn member_request(buf: &mut Vec<u8>, cmd: u16, seq: u32, set: &str, m: &Member) {
    let mut w = Writer::new(buf);
    let msg = start(&mut w, cmd, NLM_F_REQUEST | NLM_F_ACK, seq, set);
    let data = w.begin_nest(IPSET_ATTR_DATA | NLA_F_NESTED);
    let port = |w: &mut Writer<'_>, protocol: u8, port: u16| {
        w.put(IPSET_ATTR_PORT | NLA_F_NET_BYTEORDER, &port.to_be_bytes());
        w.put(IPSET_ATTR_PROTO, &[protocol]);
    };
    match *m {
        Member::NetNet(e) => {
            put_addr(&mut w, IPSET_ATTR_IP, e.src);
            put_addr(&mut w, IPSET_ATTR_IP2, e.dst);
            w.put(IPSET_ATTR_CIDR, &[e.src_prefix]);
            w.put(IPSET_ATTR_CIDR2, &[e.dst_prefix]);
        }
        Member::Ip(a) => put_addr(&mut w, IPSET_ATTR_IP, a),
        Member::IpPort {
            addr,
            protocol,
            port: p,
        } => {
            put_addr(&mut w, IPSET_ATTR_IP, addr);
            port(&mut w, protocol, p);
        }
        Member::IpPortNet {
            addr,
            protocol,
            port: p,
            net,
            prefix,
        } => {
            put_addr(&mut w, IPSET_ATTR_IP, addr);
            port(&mut w, protocol, p);
            put_addr(&mut w, IPSET_ATTR_IP2, net);
            w.put(IPSET_ATTR_CIDR2, &[prefix]);
        }
        Member::Port(p) => {
            w.put(IPSET_ATTR_PORT | NLA_F_NET_BYTEORDER, &p.to_be_bytes());
        }
        Member::IpPortMark {
            addr,
            protocol,
            port: p,
            mark,
        } => {
            put_addr(&mut w, IPSET_ATTR_IP, addr);
            port(&mut w, protocol, p);
            // The mark in the high half, its mask (all of it) in the low half, as `ipset`'s
            // `skbmark` sends them.
            let full = u64::from(mark) << 32 | u64::from(u32::MAX);
            w.put(
                IPSET_ATTR_SKBMARK | NLA_F_NET_BYTEORDER,
                &full.to_be_bytes(),
            );
        }
    }
    w.end_nest(data);
    w.end_msg(msg);
}

/// Where a list reply stands after one datagram.
#[derive(Debug, PartialEq, Eq)]
enum ListStep {
    More,
    Done,
    Absent,
}

/// Reads one datagram of an `IPSET_CMD_LIST` reply into `entries`: members of its messages
/// (those of sequence number `seq`, or all when `None`), then whether the dump is done or
/// the set does not exist. A dump that failed part way ends with an errno in its DONE message:
/// the members so far are not the whole set, and that is an error.
fn list_step(
    buf: &[u8],
    seq: Option<u32>,
    set: &str,
    entries: &mut Vec<Member>,
) -> Result<ListStep> {
    let op = || format!("ipset {set}: list");
    match dump_step(buf, seq, &op, |payload| {
        entries.extend(parse_list_message(payload));
        Ok(())
    }) {
        Ok(DumpEnd::More) => Ok(ListStep::More),
        Ok(DumpEnd::Done) => Ok(ListStep::Done),
        Ok(DumpEnd::Refused(libc::ENOENT)) => Ok(ListStep::Absent),
        Ok(DumpEnd::Refused(errno)) => Err(refused(set, "list", errno)),
        Err(e) => Err(e),
    }
}

fn parse_addr(nested: &[u8]) -> Option<IpAddr> {
    wire::attrs(nested).find_map(|(kind, p, _)| match (kind, p) {
        (IPSET_ATTR_IPADDR_IPV4, &[a, b, c, d]) => Some(IpAddr::V4(Ipv4Addr::new(a, b, c, d))),
        (IPSET_ATTR_IPADDR_IPV6, p) => <[u8; 16]>::try_from(p)
            .ok()
            .map(|o| IpAddr::V6(Ipv6Addr::from(o))),
        _ => None,
    })
}

/// One member from the attributes of a `DATA` container, its kind told by the attributes
/// present: two addresses and a port are `ip,port,net`, two addresses `net,net`, an address
/// and a port `ip,port` (with a mark, of a [`SetKind::IpPortMark`] set), an address alone
/// `ip`, a port alone `port`. Missing prefix lengths are
/// host prefixes (the kernel's default); `None` when nothing identifies a member.
fn parse_member(data: &[u8]) -> Option<Member> {
    let (mut ip, mut ip2, mut cidr, mut cidr2, mut port, mut proto, mut skbmark) =
        (None, None, None, None, None, None, None);
    for (kind, p, _) in wire::attrs(data) {
        match (kind, p) {
            (IPSET_ATTR_IP, _) => ip = parse_addr(p),
            (IPSET_ATTR_IP2, _) => ip2 = parse_addr(p),
            (IPSET_ATTR_CIDR, [c, ..]) => cidr = Some(*c),
            (IPSET_ATTR_CIDR2, [c, ..]) => cidr2 = Some(*c),
            (IPSET_ATTR_PORT, &[a, b]) => port = Some(u16::from_be_bytes([a, b])),
            (IPSET_ATTR_PROTO, [c, ..]) => proto = Some(*c),
            (IPSET_ATTR_SKBMARK, p) => {
                skbmark = <[u8; 8]>::try_from(p).ok().map(u64::from_be_bytes);
            }
            _ => {}
        }
    }
    Some(match (ip, ip2, port) {
        (Some(addr), Some(net), Some(port)) => Member::IpPortNet {
            addr,
            protocol: proto?,
            port,
            net,
            prefix: cidr2.unwrap_or_else(|| host_prefix(net)),
        },
        (Some(src), Some(dst), None) => Member::NetNet(Entry {
            src,
            src_prefix: cidr.unwrap_or_else(|| host_prefix(src)),
            dst,
            dst_prefix: cidr2.unwrap_or_else(|| host_prefix(dst)),
        }),
        // Only a whole-mark mapping is one of ours; a member with another mask reads as
        // mark 0, which is never wanted, so it is replaced.
        (Some(addr), None, Some(port)) if skbmark.is_some() => Member::IpPortMark {
            addr,
            protocol: proto?,
            port,
            mark: skbmark
                .map(|m| (m >> 32, m & u64::from(u32::MAX)))
                .filter(|&(_, mask)| mask == u64::from(u32::MAX))
                .and_then(|(mark, _)| u32::try_from(mark).ok())
                .unwrap_or(0),
        },
        (Some(addr), None, Some(port)) => Member::IpPort {
            addr,
            protocol: proto?,
            port,
        },
        (Some(addr), None, None) => Member::Ip(addr),
        (None, None, Some(port)) => Member::Port(port),
        (None, _, _) => return None,
    })
}

/// The members in one `IPSET_CMD_LIST` dump message's payload (nfgenmsg and attributes): those
/// of its `ADT` container. The first message of a set also carries its header (type, family,
/// `DATA` with sizes), which is skipped, as are unknown attributes. A malformed attribute ends
/// the container it is in (the framing's attribute reader stops there).
fn parse_list_message(payload: &[u8]) -> Vec<Member> {
    let Some(body) = payload.get(4..) else {
        return Vec::new();
    };
    wire::attrs(body)
        .filter(|a| a.0 == IPSET_ATTR_ADT)
        .flat_map(|adt| wire::attrs(adt.1))
        .filter(|a| a.0 == IPSET_ATTR_DATA)
        .filter_map(|data| parse_member(data.1))
        .collect()
}

/// [`crate::fuzzing::ipset_list`]: reads one datagram as a list reply, then sends every member
/// through an add request and parses the request's `DATA` back.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_list(datagram: &[u8]) {
    let mut members = Vec::new();
    let _ = list_step(datagram, None, "fuzz", &mut members);
    for m in &members {
        let mut req = Vec::new();
        member_request(&mut req, IPSET_CMD_ADD, 1, "fuzz", m);
        let (_, payload, _) = wire::messages(&req)
            .next()
            .and_then(std::result::Result::ok)
            .expect("an emitted request frames");
        let again: Vec<Member> = wire::attrs(&payload[4..])
            .filter(|a| a.0 == IPSET_ATTR_DATA)
            .filter_map(|data| parse_member(data.1))
            .collect();
        assert_eq!(again, [*m], "ipset member emit/parse round trip");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nfnl::test_support::{datagrams, messages};
    use crate::wire::{NLMSG_DONE, NLMSG_ERROR};

    const ENOENT: i32 = libc::ENOENT;

    // The byte tests below were written against free functions on a `Vec`; these adapt the
    // crate's `Writer` and readers to that shape, so the expected bytes stay as they were.
    fn put_attr(b: &mut Vec<u8>, kind: u16, v: &[u8]) {
        Writer::new(b).put(kind, v);
    }
    fn put_name(b: &mut Vec<u8>, kind: u16, name: &str) {
        Writer::new(b).put_str(kind, name);
    }
    fn put_nested(b: &mut Vec<u8>, kind: u16, inner: impl FnOnce(&mut Vec<u8>)) {
        let mut body = Vec::new();
        inner(&mut body);
        put_attr(b, kind | NLA_F_NESTED, &body);
    }
    fn put_addr(b: &mut Vec<u8>, kind: u16, addr: IpAddr) {
        super::put_addr(&mut Writer::new(b), kind, addr);
    }
    fn member_request(cmd: u16, seq: u32, set: &str, e: impl Into<Member>) -> Vec<u8> {
        let mut b = Vec::new();
        super::member_request(&mut b, cmd, seq, set, &e.into());
        b
    }
    struct Attr {
        kind: u16,
    }
    fn attrs(buf: &[u8]) -> Vec<Attr> {
        wire::attrs(buf).map(|(kind, _, _)| Attr { kind }).collect()
    }
    fn error_code(payload: &[u8]) -> Option<i32> {
        wire::error_code(payload).ok()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    /// Bytes as the kernel reads them on this (little-endian) machine, written by hand from
    /// `struct nlmsghdr`, `struct nfgenmsg` and `struct nlattr`.
    fn le16(v: u16) -> [u8; 2] {
        v.to_le_bytes()
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn create_request_bytes() {
        let got = create_request(7, "KUBE-IPVS-HAIRPIN", Family::V4, SetKind::NetNet);
        let mut want: Vec<u8> = Vec::new();
        // nlmsghdr: length 100, type IPSET (6) << 8 | CREATE (2), REQUEST|ACK, seq 7, pid 0.
        want.extend([100, 0, 0, 0, 0x02, 0x06, 0x05, 0x00, 7, 0, 0, 0, 0, 0, 0, 0]);
        // nfgenmsg: AF_INET, version 0, res_id 0.
        want.extend([2, 0, 0, 0]);
        // PROTOCOL (1) u8 6, padded.
        want.extend([5, 0, 1, 0, 6, 0, 0, 0]);
        // SETNAME (2) "KUBE-IPVS-HAIRPIN\0": 4 + 18 = 22, padded to 24.
        want.extend([22, 0, 2, 0]);
        want.extend(b"KUBE-IPVS-HAIRPIN\0\0\0");
        // TYPENAME (3) "hash:net,net\0": 4 + 13 = 17, padded to 20.
        want.extend([17, 0, 3, 0]);
        want.extend(b"hash:net,net\0\0\0\0");
        // REVISION (4) u8 0, FAMILY (5) u8 NFPROTO_IPV4.
        want.extend([5, 0, 4, 0, 0, 0, 0, 0]);
        want.extend([5, 0, 5, 0, 2, 0, 0, 0]);
        // DATA (7 | NESTED) holding MAXELEM (19 | NET_BYTEORDER) = 1 << 20, big-endian.
        want.extend([12, 0, 7, 0x80, 8, 0, 19, 0x40, 0x00, 0x10, 0x00, 0x00]);
        assert_eq!(want.len(), 100);
        assert_eq!(got, want);
        // The IPv6 set differs in the name and the family only.
        let v6 = create_request(7, "KUBE-IPVS-HAIRPIN6", Family::V6, SetKind::NetNet);
        assert_eq!(v6[16 + 4 + 8 + 24 + 20 + 8 + 4], NFPROTO_IPV6);
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn add_request_bytes() {
        let got = member_request(IPSET_CMD_ADD, 3, "S", Entry::hairpin(ip("10.244.1.5")));
        let mut want: Vec<u8> = Vec::new();
        want.extend([80, 0, 0, 0, 0x09, 0x06, 0x05, 0x00, 3, 0, 0, 0, 0, 0, 0, 0]);
        want.extend([2, 0, 0, 0]);
        want.extend([5, 0, 1, 0, 6, 0, 0, 0]);
        // SETNAME "S\0": 6, padded to 8.
        want.extend([6, 0, 2, 0, b'S', 0, 0, 0]);
        // DATA (7 | NESTED): 4 + IP 12 + IP2 12 + CIDR 8 + CIDR2 8 = 44.
        want.extend([44, 0, 7, 0x80]);
        // IP (1 | NESTED) { IPADDR_IPV4 (1 | NET_BYTEORDER) 10.244.1.5 }.
        want.extend([12, 0, 1, 0x80, 8, 0, 1, 0x40, 10, 244, 1, 5]);
        // IP2 (20 | NESTED) { the same address }.
        want.extend([12, 0, 20, 0x80, 8, 0, 1, 0x40, 10, 244, 1, 5]);
        // CIDR (3) 32, CIDR2 (21) 32.
        want.extend([5, 0, 3, 0, 32, 0, 0, 0]);
        want.extend([5, 0, 21, 0, 32, 0, 0, 0]);
        assert_eq!(got, want);

        let del = member_request(IPSET_CMD_DEL, 4, "S", Entry::hairpin(ip("fd00::5")));
        assert_eq!(&del[4..6], &le16(0x060a));
        // IPv6: IP { IPADDR_IPV6 (2 | NET_BYTEORDER), 16 bytes } and prefix 128.
        let ip_attr = &del[40..64];
        assert_eq!(&ip_attr[..8], &[24, 0, 1, 0x80, 20, 0, 2, 0x40]);
        assert_eq!(&ip_attr[8..12], &[0xfd, 0, 0, 0]);
        assert_eq!(ip_attr[23], 5);
        assert_eq!(&del[del.len() - 8..], &[5, 0, 21, 0, 128, 0, 0, 0]);
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn list_and_destroy_request_bytes() {
        let list = list_request(9, "S");
        assert_eq!(
            list,
            [
                vec![36, 0, 0, 0, 0x07, 0x06, 0x01, 0x03, 9, 0, 0, 0, 0, 0, 0, 0],
                vec![
                    2, 0, 0, 0, 5, 0, 1, 0, 6, 0, 0, 0, 6, 0, 2, 0, b'S', 0, 0, 0
                ],
            ]
            .concat()
        );
        let destroy = destroy_request(1, "S");
        // DESTROY (3), REQUEST|ACK|EXCL.
        assert_eq!(&destroy[4..8], &[0x03, 0x06, 0x05, 0x02]);
        assert_eq!(&destroy[16..], &list[16..]);
    }

    /// A dump message as `ip_set_dump_do` lays it out: the set header, then an `ADT` container
    /// of `DATA` members (`hash_netnet4_data_list`), with attributes we do not read.
    fn dump_payload(members: &[Entry]) -> Vec<u8> {
        let mut b = vec![NFPROTO_IPV4, 0, 0, 0];
        put_attr(&mut b, IPSET_ATTR_PROTOCOL, &[7]);
        put_name(&mut b, IPSET_ATTR_SETNAME, SET_V4);
        put_name(&mut b, IPSET_ATTR_TYPENAME, SET_TYPE);
        put_attr(&mut b, IPSET_ATTR_FAMILY, &[NFPROTO_IPV4]);
        put_attr(&mut b, IPSET_ATTR_REVISION, &[0]);
        put_attr(&mut b, 11, &1u16.to_be_bytes());
        put_nested(&mut b, IPSET_ATTR_DATA, |d| {
            put_attr(d, 18 | NLA_F_NET_BYTEORDER, &1024u32.to_be_bytes());
            put_attr(d, 19 | NLA_F_NET_BYTEORDER, &MAX_ELEMENTS.to_be_bytes());
        });
        put_nested(&mut b, IPSET_ATTR_ADT, |adt| {
            for e in members {
                put_nested(adt, IPSET_ATTR_DATA, |d| {
                    put_addr(d, IPSET_ATTR_IP, e.src);
                    put_addr(d, IPSET_ATTR_IP2, e.dst);
                    put_attr(d, IPSET_ATTR_CIDR, &[e.src_prefix]);
                    put_attr(d, IPSET_ATTR_CIDR2, &[e.dst_prefix]);
                    put_attr(d, 8 | NLA_F_NET_BYTEORDER, &0u32.to_be_bytes());
                });
            }
        });
        b
    }

    #[test]
    fn parses_members_of_a_dump_message() {
        let members = [
            Entry::hairpin(ip("10.244.1.5")),
            Entry {
                src: ip("10.0.0.0"),
                src_prefix: 8,
                dst: ip("10.0.0.1"),
                dst_prefix: 32,
            },
            Entry::hairpin(ip("fd00::5")),
        ];
        let got: Vec<Entry> = parse_list_message(&dump_payload(&members))
            .into_iter()
            .map(|m| match m {
                Member::NetNet(e) => e,
                other => panic!("not a net,net member: {other}"),
            })
            .collect();
        assert_eq!(got, members);
        assert_eq!(got[0].hairpin_addr(), Some(ip("10.244.1.5")));
        assert_eq!(got[1].hairpin_addr(), None, "not a hairpin member");
        assert_eq!(got[1].to_string(), "10.0.0.0/8,10.0.0.1");
        assert_eq!(got[2].to_string(), "fd00::5,fd00::5");
    }

    fn list_fixture(hex: &str) -> (Vec<Member>, ListStep) {
        let mut entries = Vec::new();
        let mut step = ListStep::More;
        for d in datagrams(hex) {
            step = list_step(&d, None, "fixture", &mut entries).expect("no error");
        }
        entries.sort();
        (entries, step)
    }

    /// List replies captured from the kernel in the VM (`kernel_ipset::
    /// list_replies_for_the_fixtures`): two members our code added and one `ipset add` wrote.
    #[test]
    fn parses_list_replies_captured_from_the_kernel() {
        let (v4, step) = list_fixture(include_str!("../../tests/fixtures/ipset_list_v4.hex"));
        assert_eq!(step, ListStep::Done);
        assert_eq!(
            v4.iter().map(Member::to_string).collect::<Vec<_>>(),
            [
                "10.0.0.0/8,10.244.2.7",
                "10.244.1.5,10.244.1.5",
                "10.244.1.6,10.244.1.6"
            ]
        );
        let (v6, step) = list_fixture(include_str!("../../tests/fixtures/ipset_list_v6.hex"));
        assert_eq!(step, ListStep::Done);
        assert_eq!(
            v6.iter().map(Member::to_string).collect::<Vec<_>>(),
            ["fd00::/8,fd00:10:244::7", "fd00:10:244::5,fd00:10:244::5"]
        );
        assert_eq!(v6[1], Member::NetNet(Entry::hairpin(ip("fd00:10:244::5"))));
        // The set header in the first message (type, family, sizes) is not a member, and the
        // kernel's message for each set is the layout our own dump test builds.
        let first = &datagrams(include_str!("../../tests/fixtures/ipset_list_v4.hex"))[0];
        let msgs = messages(first);
        assert_eq!(msgs[0].kind, (NFNL_SUBSYS_IPSET << 8) | IPSET_CMD_LIST);
        let names: Vec<u16> = attrs(&msgs[0].payload[4..])
            .iter()
            .map(|a| a.kind)
            .collect();
        assert_eq!(
            names,
            [
                IPSET_ATTR_PROTOCOL,
                IPSET_ATTR_SETNAME,
                IPSET_ATTR_TYPENAME,
                IPSET_ATTR_FAMILY,
                IPSET_ATTR_REVISION,
                IPSET_ATTR_DATA,
                IPSET_ATTR_ADT
            ]
        );
    }

    #[test]
    fn a_list_error_names_the_set_and_an_absent_set_is_none() {
        let reply = |errno: i32| {
            let mut m = Vec::new();
            m.extend(36u32.to_ne_bytes());
            m.extend(NLMSG_ERROR.to_ne_bytes());
            m.extend(0u16.to_ne_bytes());
            m.extend(1u32.to_ne_bytes());
            m.extend(0u32.to_ne_bytes());
            m.extend((-errno).to_ne_bytes());
            m.extend([0u8; 16]);
            m
        };
        let mut e = Vec::new();
        assert_eq!(
            list_step(&reply(ENOENT), Some(1), SET_V4, &mut e).expect("absent"),
            ListStep::Absent
        );
        let err = list_step(&reply(IPSET_ERR_PROTOCOL), Some(1), SET_V4, &mut e)
            .expect_err("protocol error");
        assert_eq!(
            err.to_string(),
            "ipset KUBE-IPVS-HAIRPIN: list: kernel error 4097 (ipset protocol error)"
        );
        // A reply to another request is not ours.
        assert_eq!(
            list_step(&reply(ENOENT), Some(2), SET_V4, &mut e).expect("skipped"),
            ListStep::More
        );
    }

    #[test]
    fn a_member_without_prefixes_is_a_host_member() {
        let mut d = Vec::new();
        put_addr(&mut d, IPSET_ATTR_IP, ip("10.0.0.9"));
        put_addr(&mut d, IPSET_ATTR_IP2, ip("10.0.0.9"));
        assert_eq!(
            parse_member(&d),
            Some(Member::NetNet(Entry::hairpin(ip("10.0.0.9"))))
        );
        let mut only_one = Vec::new();
        put_addr(&mut only_one, IPSET_ATTR_IP, ip("10.0.0.9"));
        assert_eq!(parse_member(&only_one), Some(Member::Ip(ip("10.0.0.9"))));
        // A protocol without a port or address identifies nothing.
        let mut nothing = Vec::new();
        put_attr(&mut nothing, IPSET_ATTR_PROTO, &[6]);
        assert_eq!(parse_member(&nothing), None);
        // A port with an address but no protocol is not a member either (the kernel always
        // sends the protocol of an `ip,port` member).
        let mut no_proto = Vec::new();
        put_addr(&mut no_proto, IPSET_ATTR_IP, ip("10.0.0.9"));
        put_attr(
            &mut no_proto,
            IPSET_ATTR_PORT | NLA_F_NET_BYTEORDER,
            &80u16.to_be_bytes(),
        );
        assert_eq!(parse_member(&no_proto), None);
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn ip_port_and_port_set_request_bytes() {
        let member = Member::IpPort {
            addr: ip("10.96.0.10"),
            protocol: 132,
            port: 53,
        };
        let got = member_request(IPSET_CMD_ADD, 3, "S", member);
        let mut want: Vec<u8> = Vec::new();
        want.extend([68, 0, 0, 0, 0x09, 0x06, 0x05, 0x00, 3, 0, 0, 0, 0, 0, 0, 0]);
        want.extend([2, 0, 0, 0]);
        want.extend([5, 0, 1, 0, 6, 0, 0, 0]);
        want.extend([6, 0, 2, 0, b'S', 0, 0, 0]);
        // DATA (7 | NESTED): 4 + IP 12 + PORT 8 + PROTO 8 = 32.
        want.extend([32, 0, 7, 0x80]);
        want.extend([12, 0, 1, 0x80, 8, 0, 1, 0x40, 10, 96, 0, 10]);
        // PORT (4 | NET_BYTEORDER) 53 big-endian, padded; PROTO (7) 132 (SCTP), padded.
        want.extend([6, 0, 4, 0x40, 0, 53, 0, 0]);
        want.extend([5, 0, 7, 0, 132, 0, 0, 0]);
        assert_eq!(got, want);

        // ip,port,net: the network goes in IP2 with its prefix in CIDR2.
        let net = member_request(
            IPSET_CMD_DEL,
            4,
            "S",
            Member::IpPortNet {
                addr: ip("203.0.113.7"),
                protocol: 6,
                port: 443,
                net: ip("198.51.100.0"),
                prefix: 24,
            },
        );
        assert_eq!(&net[36..40], &[52, 0, 7, 0x80]);
        assert_eq!(
            &net[net.len() - 20..],
            &[
                12, 0, 20, 0x80, 8, 0, 1, 0x40, 198, 51, 100, 0, 5, 0, 21, 0, 24, 0, 0, 0
            ]
        );

        // bitmap:port: created over every port, family unspecified, no size limit.
        let create = create_request(1, "P", Family::V6, SetKind::Port);
        let tail: Vec<u8> = [
            vec![16, 0, 3, 0],
            b"bitmap:port\0".to_vec(),
            vec![5, 0, 4, 0, 0, 0, 0, 0],
            vec![5, 0, 5, 0, NFPROTO_UNSPEC, 0, 0, 0],
            vec![20, 0, 7, 0x80],
            vec![6, 0, 4, 0x40, 0, 0, 0, 0],
            vec![6, 0, 5, 0x40, 0xff, 0xff, 0, 0],
        ]
        .concat();
        assert_eq!(&create[create.len() - tail.len()..], &tail[..]);
        let port = member_request(IPSET_CMD_ADD, 2, "P", Member::Port(30080));
        assert_eq!(
            &port[port.len() - 12..],
            &[12, 0, 7, 0x80, 6, 0, 4, 0x40, 0x75, 0x80, 0, 0]
        );
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn mark_set_request_bytes() {
        // Created as hash:ip,port revision 5 with CADT_FLAGS (8 | NET_BYTEORDER) holding
        // IPSET_FLAG_WITH_SKBINFO (1 << 6) big-endian, after MAXELEM.
        let create = create_request(1, "M", Family::V4, SetKind::IpPortMark);
        let tail: Vec<u8> = [
            vec![17, 0, 3, 0],
            b"hash:ip,port\0".to_vec(),
            vec![0, 0, 0],
            vec![5, 0, 4, 0, 5, 0, 0, 0],
            vec![5, 0, 5, 0, NFPROTO_IPV4, 0, 0, 0],
            vec![20, 0, 7, 0x80],
            vec![8, 0, 19, 0x40, 0, 0x10, 0, 0],
            vec![8, 0, 8, 0x40, 0, 0, 0, 0x40],
        ]
        .concat();
        assert_eq!(&create[create.len() - tail.len()..], &tail[..]);
        // A member carries SKBMARK (27 | NET_BYTEORDER): mark << 32 | mask, big-endian.
        let add = member_request(
            IPSET_CMD_ADD,
            2,
            "M",
            Member::IpPortMark {
                addr: ip("10.0.0.1"),
                protocol: 17,
                port: 53,
                mark: 0x0123_4567,
            },
        );
        let tail: Vec<u8> = [
            vec![44, 0, 7, 0x80],
            vec![12, 0, 1, 0x80, 8, 0, 1, 0x40, 10, 0, 0, 1],
            vec![6, 0, 4, 0x40, 0, 53, 0, 0],
            vec![5, 0, 7, 0, 17, 0, 0, 0],
            vec![
                12, 0, 27, 0x40, 0x01, 0x23, 0x45, 0x67, 0xff, 0xff, 0xff, 0xff,
            ],
        ]
        .concat();
        assert_eq!(&add[add.len() - tail.len()..], &tail[..]);
    }

    #[test]
    fn members_of_every_kind_read_back_and_print_as_ipset_does() {
        let members = [
            Member::Ip(ip("10.96.0.1")),
            Member::IpPort {
                addr: ip("fd00::a"),
                protocol: 17,
                port: 53,
            },
            Member::IpPortNet {
                addr: ip("203.0.113.7"),
                protocol: 132,
                port: 80,
                net: ip("198.51.100.0"),
                prefix: 24,
            },
            Member::Port(30080),
            Member::IpPortMark {
                addr: ip("192.168.56.10"),
                protocol: 6,
                port: 30080,
                mark: 0x10_0000,
            },
        ];
        for m in members {
            let req = member_request(IPSET_CMD_ADD, 1, "S", m);
            // The DATA container of the request is what a dump message carries per member.
            let body = &req[16 + 4..];
            let data = wire::attrs(body)
                .find(|a| a.0 == IPSET_ATTR_DATA)
                .expect("data")
                .1;
            assert_eq!(parse_member(data), Some(m), "{m}");
        }
        let text: Vec<String> = members.iter().map(Member::to_string).collect();
        assert_eq!(
            text,
            [
                "10.96.0.1",
                "fd00::a,udp:53",
                "203.0.113.7,sctp:80,198.51.100.0/24",
                "30080",
                "192.168.56.10,tcp:30080 skbmark 0x100000"
            ]
        );
    }

    #[test]
    fn truncated_dump_is_fewer_members_not_a_panic() {
        let payload = dump_payload(&[Entry::hairpin(ip("10.244.1.5"))]);
        for cut in 0..payload.len() {
            let _ = parse_list_message(&payload[..cut]);
            let _ = messages(&payload[..cut]);
        }
        assert!(parse_list_message(&payload[..payload.len() - 1]).is_empty());
    }

    #[test]
    fn acks_are_read_with_their_sequence_numbers() {
        // Two NLMSG_ERROR messages: an acknowledgement for seq 5 and IPSET_ERR_EXIST_SETNAME2
        // for seq 6, each echoing the request header.
        let ack = |seq: u32, err: i32| {
            let mut m = Vec::new();
            m.extend(36u32.to_ne_bytes());
            m.extend(NLMSG_ERROR.to_ne_bytes());
            m.extend(0u16.to_ne_bytes());
            m.extend(seq.to_ne_bytes());
            m.extend(0u32.to_ne_bytes());
            m.extend((-err).to_ne_bytes());
            m.extend([0u8; 16]);
            m
        };
        let buf = [ack(5, 0), ack(6, IPSET_ERR_EXIST_SETNAME2)].concat();
        let got: Vec<(u32, Option<i32>)> = messages(&buf)
            .iter()
            .map(|m| (m.seq, error_code(m.payload)))
            .collect();
        assert_eq!(got, [(5, Some(0)), (6, Some(IPSET_ERR_EXIST_SETNAME2))]);
    }

    #[test]
    fn errors_name_the_set_and_the_member() {
        let e = refused(
            SET_V4,
            format!("add {}", Entry::hairpin(ip("10.244.1.5"))),
            IPSET_ERR_EXIST_SETNAME2,
        );
        assert_eq!(
            e.to_string(),
            "ipset KUBE-IPVS-HAIRPIN: add 10.244.1.5,10.244.1.5: kernel error 4101 \
             (a set of that name exists with a different type or settings)"
        );
        assert!(check_name("").is_err());
        assert!(check_name(&"X".repeat(32)).is_err());
        assert!(check_name(SET_V6).is_ok());
        let bad = Entry {
            src_prefix: 33,
            ..Entry::hairpin(ip("10.0.0.1"))
        };
        assert!(!bad.is_valid());
        let mixed = Entry {
            dst: ip("fd00::1"),
            ..Entry::hairpin(ip("10.0.0.1"))
        };
        assert!(!mixed.is_valid());
    }

    #[test]
    fn a_list_that_ends_with_an_error_in_its_done_message_is_not_complete() {
        // struct nlmsghdr (len 20, NLMSG_DONE, NLM_F_MULTI, seq 7, pid 0) + int error.
        let done = |errno: i32| {
            let mut b = Vec::new();
            b.extend_from_slice(&20u32.to_le_bytes());
            b.extend_from_slice(&le16(NLMSG_DONE));
            b.extend_from_slice(&le16(0x2));
            b.extend_from_slice(&7u32.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            b.extend_from_slice(&(-errno).to_le_bytes());
            b
        };
        let mut entries = Vec::new();
        assert_eq!(
            list_step(&done(0), Some(7), SET_V4, &mut entries).expect("complete"),
            ListStep::Done
        );
        let err = list_step(&done(4), Some(7), SET_V4, &mut entries).expect_err("EINTR");
        assert_eq!(err.errno(), Some(4));
        assert!(err.to_string().contains(SET_V4), "{err}");
    }
}
