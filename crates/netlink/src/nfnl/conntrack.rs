//! UDP conntrack cleanup over ctnetlink: when a UDP endpoint goes away, the conntrack entries
//! that still point to it are deleted, so the next datagram of each flow is scheduled again by
//! IPVS (UDP has no connection end that would clear them).
//!
//! This module owns one `NETLINK_NETFILTER` socket per call; it dumps the conntrack table of one
//! family and deletes the entries a [`Filter`] selects, by their original tuple (and zone). It
//! never flushes the whole table and never touches entries of other protocols. The wire format
//! is the kernel's `linux/netfilter/nfnetlink_conntrack.h`. Its attributes are rust-netlink's
//! `netlink-packet-netfilter` types (decoded and emitted there); this module frames them on the
//! shared nfnetlink socket (`nfgenmsg`, batches, acknowledgements, dump ends) and decodes only the
//! attributes it uses, by pure functions that the unit tests drive without a kernel.

use std::net::IpAddr;

use netlink_packet_core::{DefaultNla, Emitable, NlaBuffer, NlasIterator, Parseable};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, IPTuple, ProtoTuple, Tuple as Nested,
};

use super::{DumpEnd, NfSocket, begin, dump_step};
use crate::error::{Error, Result};
use crate::wire::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, Writer};

/// IP protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
/// Not among the crate's typed attributes: kept as the kernel sent it.
const CTA_ZONE: u16 = 18;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// Deletes per `sendmsg`: their acknowledgements (one small skb each) must fit the socket's
/// receive buffer, as for ipset members.
const BATCH: usize = 128;

/// One direction of a conntrack entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    pub src_port: u16,
    pub dst_port: u16,
}

/// A conntrack entry as the dump shows it, with what is needed to delete it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The client's view: client -> virtual address.
    pub orig: Tuple,
    /// The server's view: after IPVS (with `net.ipv4.vs.conntrack = 1`) its source is the real
    /// server (endpoint).
    pub reply: Tuple,
    /// The `CTA_TUPLE_ORIG` attribute as the kernel sent it (every nested attribute, the ones
    /// not in [`Tuple`] too), echoed back to delete the entry.
    orig_attr: ConntrackAttribute,
    /// The `CTA_ZONE` attribute if the entry has one.
    zone_attr: Option<DefaultNla>,
}

/// Which entries to delete. Every field set must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filter {
    pub protocol: u8,
    /// Reply source address and port (the endpoint a flow was sent to).
    pub reply_src: Option<(IpAddr, u16)>,
    /// Original destination address and port (the virtual server a client addressed).
    pub orig_dst: Option<(IpAddr, u16)>,
}

impl Filter {
    /// Whether `e` is selected.
    pub fn matches(&self, e: &Entry) -> bool {
        e.orig.protocol == self.protocol
            && self
                .reply_src
                .is_none_or(|(a, p)| e.reply.src == a && e.reply.src_port == p)
            && self
                .orig_dst
                .is_none_or(|(a, p)| e.orig.dst == a && e.orig.dst_port == p)
    }

    fn family(&self) -> u8 {
        match self.reply_src.or(self.orig_dst) {
            Some((IpAddr::V6(_), _)) => AF_INET6,
            _ => AF_INET,
        }
    }

    fn describe(&self) -> String {
        let mut s = format!("protocol {}", self.protocol);
        if let Some((a, p)) = self.reply_src {
            s += &format!(" endpoint {}", socket_text(a, p));
        }
        if let Some((a, p)) = self.orig_dst {
            s += &format!(" service {}", socket_text(a, p));
        }
        s
    }
}

fn socket_text(a: IpAddr, p: u16) -> String {
    std::net::SocketAddr::new(a, p).to_string()
}

/// Deletes the UDP conntrack entries whose flows were sent to the endpoint `addr:port` (their
/// reply source), as kube-proxy's `conntrack -D -p udp --reply-src`. Returns how many it deleted.
pub fn flush_udp_endpoint(addr: IpAddr, port: u16) -> Result<usize> {
    flush(&Filter {
        protocol: IPPROTO_UDP,
        reply_src: Some((addr, port)),
        orig_dst: None,
    })
}

/// Deletes the UDP conntrack entries addressed to the virtual server `addr:port` (their original
/// destination), e.g. when a UDP Service gets its first endpoint and earlier datagrams were
/// tracked with none. Returns how many it deleted.
pub fn flush_udp_service(addr: IpAddr, port: u16) -> Result<usize> {
    flush(&Filter {
        protocol: IPPROTO_UDP,
        reply_src: None,
        orig_dst: Some((addr, port)),
    })
}

/// Every conntrack entry of one family (`ipv6` or IPv4) in this network namespace.
pub fn entries(ipv6: bool) -> Result<Vec<Entry>> {
    entries_capturing(ipv6, None)
}

/// [`entries`], also keeping each reply datagram as received in `raw` (to capture fixtures from
/// a real kernel).
pub fn entries_capturing(ipv6: bool, raw: Option<&mut Vec<Vec<u8>>>) -> Result<Vec<Entry>> {
    let what = "dump";
    let mut socket = NfSocket::open(&format!("conntrack {what}"))?;
    dump_on(
        &mut socket,
        if ipv6 { AF_INET6 } else { AF_INET },
        what,
        raw,
    )
}

fn dump_on(
    socket: &mut NfSocket,
    family: u8,
    what: &str,
    mut raw: Option<&mut Vec<Vec<u8>>>,
) -> Result<Vec<Entry>> {
    let seq = socket.next_seqs(1);
    let op = || format!("conntrack {what}");
    let mut entries = Vec::new();
    socket.dump(&dump_request(family, seq), &op(), |buf| {
        if let Some(r) = raw.as_deref_mut() {
            r.push(buf.to_vec());
        }
        // A dump that failed part way ends with its errno in the DONE message.
        match dump_step(buf, Some(seq), &op, |payload| {
            entries.extend(parse_entry(payload));
            Ok(())
        })? {
            DumpEnd::More => Ok(None),
            DumpEnd::Done => Ok(Some(())),
            DumpEnd::Refused(errno) => Err(Error::Netfilter { op: op(), errno }),
        }
    })?;
    Ok(entries)
}

/// Dumps the conntrack table of the filter's family and deletes each selected entry, many per
/// `sendmsg`. An entry that disappears between the dump and its delete is not an error (and not
/// counted).
pub fn flush(filter: &Filter) -> Result<usize> {
    let what = format!("delete {}", filter.describe());
    let mut socket = NfSocket::open(&format!("conntrack {what}"))?;
    let family = filter.family();
    let entries = dump_on(&mut socket, family, &what, None)?;
    let selected: Vec<&Entry> = entries.iter().filter(|e| filter.matches(e)).collect();
    let batch = socket
        .rcvbuf()
        .map_or(BATCH, |b| (b / 1024).clamp(1, BATCH));
    let mut deleted = 0;
    let mut buf = Vec::new();
    for chunk in selected.chunks(batch) {
        buf.clear();
        let first = socket.next_seqs(chunk.len());
        for (seq, e) in (first..).zip(chunk) {
            delete_request_into(&mut buf, family, seq, e);
        }
        let acks = socket.acked(&buf, first, chunk.len(), &format!("conntrack {what}"))?;
        for (e, ack) in chunk.iter().zip(acks) {
            match ack {
                Some(0) => deleted += 1,
                // Gone already (it expired, or another delete took it), or not answered (an
                // overrun receive buffer): neither is counted, and neither stops the others.
                Some(libc::ENOENT) | None => {}
                Some(errno) => {
                    return Err(Error::Netfilter {
                        op: format!("conntrack {what}: entry {:?}", e.orig),
                        errno,
                    });
                }
            }
        }
    }
    Ok(deleted)
}

/// `IPCTNL_MSG_CT_GET` with `NLM_F_DUMP` for one family.
fn dump_request(family: u8, seq: u32) -> Vec<u8> {
    let mut buf = Vec::with_capacity(20);
    let mut w = Writer::new(&mut buf);
    let msg = begin(
        &mut w,
        NFNL_SUBSYS_CTNETLINK,
        IPCTNL_MSG_CT_GET,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        family,
    );
    w.end_msg(msg);
    buf
}

/// `IPCTNL_MSG_CT_DELETE` of one entry by its original tuple (and zone).
#[cfg(test)]
fn delete_request(family: u8, seq: u32, e: &Entry) -> Vec<u8> {
    let mut buf = Vec::new();
    delete_request_into(&mut buf, family, seq, e);
    buf
}

/// Appends `IPCTNL_MSG_CT_DELETE` of one entry by its original tuple (and zone) to `buf`.
fn delete_request_into(buf: &mut Vec<u8>, family: u8, seq: u32, e: &Entry) {
    let mut w = Writer::new(buf);
    let msg = begin(
        &mut w,
        NFNL_SUBSYS_CTNETLINK,
        IPCTNL_MSG_CT_DELETE,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        family,
    );
    emit_into(w.buf, &e.orig_attr);
    if let Some(z) = &e.zone_attr {
        emit_into(w.buf, z);
    }
    w.end_msg(msg);
}

/// Appends one attribute, padded to 4 bytes, to `buf`.
fn emit_into(buf: &mut Vec<u8>, attr: &impl Emitable) {
    let start = buf.len();
    buf.resize(start + attr.buffer_len(), 0);
    attr.emit(&mut buf[start..]);
}

/// The addresses, protocol and ports of a decoded `CTA_TUPLE_ORIG`/`CTA_TUPLE_REPLY`; `None`
/// without both addresses and the protocol (a port absent is 0, as for protocols without ports).
fn plain_tuple(nested: &[Nested]) -> Option<Tuple> {
    let (mut src, mut dst, mut protocol, mut src_port, mut dst_port) = (None, None, None, 0, 0);
    for n in nested {
        match n {
            Nested::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Nested::Proto(protos) => {
                for p in protos {
                    match p {
                        ProtoTuple::Protocol(n) => protocol = Some(u8::from(*n)),
                        ProtoTuple::SourcePort(port) => src_port = *port,
                        ProtoTuple::DestinationPort(port) => dst_port = *port,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Tuple {
        src: src?,
        dst: dst?,
        protocol: protocol?,
        src_port,
        dst_port,
    })
}

/// One conntrack entry from an `IPCTNL_MSG_CT_NEW` dump message's payload (nfgenmsg and
/// attributes); `None` when it lacks a tuple or any attribute is malformed (so an entry is never
/// deleted by a tuple without the zone that came after a malformed attribute). Only the two tuples and the
/// zone are decoded; the other attributes (status, timeout, counters, protocol state) are
/// skipped unread.
fn parse_entry(payload: &[u8]) -> Option<Entry> {
    let body = payload.get(4..)?;
    let (mut orig, mut reply, mut orig_attr, mut zone_attr) = (None, None, None, None);
    for nla in NlasIterator::new(body) {
        let nla: NlaBuffer<&[u8]> = nla.ok()?;
        match nla.kind() {
            CTA_TUPLE_ORIG => {
                let attr = ConntrackAttribute::parse(&nla).ok()?;
                if let ConntrackAttribute::CtaTupleOrig(nested) = &attr {
                    orig = plain_tuple(nested);
                }
                orig_attr = Some(attr);
            }
            CTA_TUPLE_REPLY => {
                if let ConntrackAttribute::CtaTupleReply(nested) =
                    ConntrackAttribute::parse(&nla).ok()?
                {
                    reply = plain_tuple(&nested);
                }
            }
            CTA_ZONE => zone_attr = Some(DefaultNla::parse(&nla).ok()?),
            _ => {}
        }
    }
    Some(Entry {
        orig: orig?,
        reply: reply?,
        orig_attr: orig_attr?,
        zone_attr,
    })
}

/// [`crate::fuzzing::conntrack_dump`]: reads one datagram as a dump reply; each entry's delete
/// request must carry the original tuple it was read with.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_dump(datagram: &[u8]) {
    let mut entries = Vec::new();
    let _ = dump_step(datagram, None, &String::new, |payload| {
        entries.extend(parse_entry(payload));
        Ok(())
    });
    for e in &entries {
        let mut req = Vec::new();
        delete_request_into(&mut req, AF_INET, 1, e);
        let (_, payload, _) = crate::wire::messages(&req)
            .next()
            .and_then(std::result::Result::ok)
            .expect("an emitted request frames");
        // The request is the payload of an entry with the original tuple alone: it reads back as
        // an entry only with a reply, so read the tuple by itself.
        let again = NlasIterator::new(&payload[4..])
            .filter_map(std::result::Result::ok)
            .find(|nla| nla.kind() == CTA_TUPLE_ORIG)
            .and_then(|nla| match ConntrackAttribute::parse(&nla) {
                Ok(ConntrackAttribute::CtaTupleOrig(nested)) => plain_tuple(&nested),
                _ => None,
            });
        assert_eq!(again, Some(e.orig), "conntrack delete request tuple");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nfnl::test_support::{datagrams, messages};

    /// Rounds a length up to netlink's 4-byte alignment.
    fn align4(n: usize) -> usize {
        (n + 3) & !3
    }

    /// An attribute as it goes on the wire, padded.
    fn bytes(a: &impl Emitable) -> Vec<u8> {
        let mut v = Vec::new();
        emit_into(&mut v, a);
        v
    }

    // The kernel's numbers, written out here so the fixtures do not come from the crate that
    // decodes them.
    const NLA_F_NESTED: u16 = 0x8000;
    const CTA_TUPLE_IP: u16 = 1;
    const CTA_TUPLE_PROTO: u16 = 2;
    const CTA_IP_V4_SRC: u16 = 1;
    const CTA_IP_V4_DST: u16 = 2;
    const CTA_IP_V6_SRC: u16 = 3;
    const CTA_IP_V6_DST: u16 = 4;
    const CTA_PROTO_NUM: u16 = 1;
    const CTA_PROTO_SRC_PORT: u16 = 2;
    const CTA_PROTO_DST_PORT: u16 = 3;

    fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        let len = u16::try_from(4 + payload.len()).expect("small attribute");
        a.extend_from_slice(&len.to_ne_bytes());
        a.extend_from_slice(&kind.to_ne_bytes());
        a.extend_from_slice(payload);
        a.resize(align4(a.len()), 0);
        a
    }

    fn tuple(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
        let ip = [attr(CTA_IP_V4_SRC, &src), attr(CTA_IP_V4_DST, &dst)].concat();
        let proto = [
            attr(CTA_PROTO_NUM, &[IPPROTO_UDP]),
            attr(CTA_PROTO_SRC_PORT, &sport.to_be_bytes()),
            attr(CTA_PROTO_DST_PORT, &dport.to_be_bytes()),
        ]
        .concat();
        [
            attr(CTA_TUPLE_IP | NLA_F_NESTED, &ip),
            attr(CTA_TUPLE_PROTO | NLA_F_NESTED, &proto),
        ]
        .concat()
    }

    /// A dump message payload as the kernel lays it out for a UDP flow from 10.0.0.2:40000 to
    /// the virtual server 10.96.0.10:53, sent to the endpoint 10.244.1.5:5353, with an
    /// attribute we do not know.
    fn entry_payload() -> (Vec<u8>, Vec<u8>) {
        let orig = attr(
            CTA_TUPLE_ORIG | NLA_F_NESTED,
            &tuple([10, 0, 0, 2], [10, 96, 0, 10], 40000, 53),
        );
        let reply = attr(
            CTA_TUPLE_REPLY | NLA_F_NESTED,
            &tuple([10, 244, 1, 5], [10, 0, 0, 2], 5353, 40000),
        );
        let unknown = attr(99, &[1, 2, 3]);
        let payload = [vec![AF_INET, 0, 0, 0], orig.clone(), unknown, reply].concat();
        (payload, orig)
    }

    #[test]
    fn parses_both_tuples_and_keeps_the_original_attribute() {
        let (payload, orig) = entry_payload();
        let e = parse_entry(&payload).expect("entry");
        assert_eq!(
            e.orig,
            Tuple {
                src: "10.0.0.2".parse().expect("ip"),
                dst: "10.96.0.10".parse().expect("ip"),
                protocol: IPPROTO_UDP,
                src_port: 40000,
                dst_port: 53,
            }
        );
        assert_eq!(e.reply.src, "10.244.1.5".parse::<IpAddr>().expect("ip"));
        assert_eq!(e.reply.src_port, 5353);
        assert_eq!(
            bytes(&e.orig_attr),
            orig,
            "the original tuple re-emits byte for byte"
        );
        assert_eq!(e.zone_attr, None);
    }

    #[test]
    fn filter_selects_by_endpoint_or_service() {
        let (payload, _) = entry_payload();
        let e = parse_entry(&payload).expect("entry");
        let ep = |a: &str, p| Filter {
            protocol: IPPROTO_UDP,
            reply_src: Some((a.parse().expect("ip"), p)),
            orig_dst: None,
        };
        assert!(ep("10.244.1.5", 5353).matches(&e));
        assert!(!ep("10.244.1.5", 53).matches(&e));
        assert!(!ep("10.244.1.6", 5353).matches(&e));
        let svc = Filter {
            protocol: IPPROTO_UDP,
            reply_src: None,
            orig_dst: Some(("10.96.0.10".parse().expect("ip"), 53)),
        };
        assert!(svc.matches(&e));
        assert!(!Filter { protocol: 6, ..svc }.matches(&e));
    }

    #[test]
    fn delete_request_echoes_the_original_tuple() {
        let (payload, orig) = entry_payload();
        let e = parse_entry(&payload).expect("entry");
        let req = delete_request(AF_INET, 7, &e);
        let msgs = messages(&req);
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].kind, 0x0102);
        assert_eq!(msgs[0].payload, [vec![AF_INET, 0, 0, 0], orig].concat());
        assert_eq!(
            u16::from_ne_bytes([req[6], req[7]]),
            NLM_F_REQUEST | NLM_F_ACK
        );
        assert_eq!(u32::from_ne_bytes([req[8], req[9], req[10], req[11]]), 7);
    }

    #[test]
    fn dump_request_bytes() {
        let req = dump_request(AF_INET6, 1);
        assert_eq!(req.len(), 20);
        assert_eq!(u32::from_ne_bytes([req[0], req[1], req[2], req[3]]), 20);
        assert_eq!(u16::from_ne_bytes([req[4], req[5]]), 0x0101);
        assert_eq!(u16::from_ne_bytes([req[6], req[7]]), 0x301);
        assert_eq!(&req[16..], &[AF_INET6, 0, 0, 0]);
    }

    #[test]
    fn parses_ipv6_tuples_and_zone() {
        let v6 = |last: u8| {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&[0xfd, 0, 0, 0]);
            a[15] = last;
            a
        };
        let t = |src: [u8; 16], dst: [u8; 16], sport: u16, dport: u16| {
            let ip = [attr(CTA_IP_V6_SRC, &src), attr(CTA_IP_V6_DST, &dst)].concat();
            let proto = [
                attr(CTA_PROTO_NUM, &[IPPROTO_UDP]),
                attr(CTA_PROTO_SRC_PORT, &sport.to_be_bytes()),
                attr(CTA_PROTO_DST_PORT, &dport.to_be_bytes()),
            ]
            .concat();
            [
                attr(CTA_TUPLE_IP | NLA_F_NESTED, &ip),
                attr(CTA_TUPLE_PROTO | NLA_F_NESTED, &proto),
            ]
            .concat()
        };
        let zone = attr(CTA_ZONE, &7u16.to_be_bytes());
        let payload = [
            vec![AF_INET6, 0, 0, 0],
            attr(CTA_TUPLE_ORIG | NLA_F_NESTED, &t(v6(2), v6(10), 40000, 53)),
            attr(
                CTA_TUPLE_REPLY | NLA_F_NESTED,
                &t(v6(5), v6(2), 5353, 40000),
            ),
            zone.clone(),
        ]
        .concat();
        let e = parse_entry(&payload).expect("entry");
        assert_eq!(e.orig.dst, "fd00::a".parse::<IpAddr>().expect("ip"));
        assert_eq!(e.reply.src, "fd00::5".parse::<IpAddr>().expect("ip"));
        assert_eq!(e.zone_attr.as_ref().map(bytes), Some(zone.clone()));
        let filter = Filter {
            protocol: IPPROTO_UDP,
            reply_src: Some(("fd00::5".parse().expect("ip"), 5353)),
            orig_dst: None,
        };
        assert!(filter.matches(&e));
        assert_eq!(filter.family(), AF_INET6);
        // The zone goes into the delete request after the tuple, so the entry of that zone is
        // the one deleted.
        let req = delete_request(AF_INET6, 3, &e);
        assert!(req.ends_with(&zone));
    }

    /// Dump replies captured from the kernel in the VM (`kernel_conntrack`): two answered UDP
    /// flows over loopback to one server, in each family. They parse to both tuples, the dump
    /// ends, and a delete request echoes the kernel's own original-tuple attribute.
    #[test]
    fn parses_dump_replies_captured_from_the_kernel() {
        for (hex, family, addr) in [
            (
                include_str!("../../tests/fixtures/conntrack_dump_v4.hex"),
                AF_INET,
                "127.0.0.1",
            ),
            (
                include_str!("../../tests/fixtures/conntrack_dump_v6.hex"),
                AF_INET6,
                "::1",
            ),
        ] {
            let addr: IpAddr = addr.parse().expect("literal");
            let mut entries = Vec::new();
            let mut end = DumpEnd::More;
            for d in datagrams(hex) {
                end = dump_step(&d, None, &|| "fixture".to_owned(), |p| {
                    entries.extend(parse_entry(p));
                    Ok(())
                })
                .expect("no error");
            }
            assert_eq!(end, DumpEnd::Done);
            let flows: Vec<&Entry> = entries
                .iter()
                .filter(|e| e.orig.protocol == IPPROTO_UDP && e.orig.dst == addr)
                .collect();
            assert_eq!(flows.len(), 2, "{entries:?}");
            let server = flows[0].orig.dst_port;
            for e in &flows {
                assert_eq!((e.orig.src, e.orig.dst_port), (addr, server));
                assert_eq!((e.reply.src, e.reply.src_port), (addr, server));
                assert_eq!((e.reply.dst, e.reply.dst_port), (addr, e.orig.src_port));
                let filter = Filter {
                    protocol: IPPROTO_UDP,
                    reply_src: Some((addr, server)),
                    orig_dst: None,
                };
                assert!(filter.matches(e));
                let req = delete_request(family, 9, e);
                let first = &datagrams(hex)[0];
                let orig = bytes(&e.orig_attr);
                assert!(
                    first.windows(orig.len()).any(|w| w == orig.as_slice()),
                    "the delete echoes the dumped tuple byte for byte"
                );
                assert_eq!(&req[16..20], &[family, 0, 0, 0]);
                assert!(req.ends_with(&orig) || e.zone_attr.is_some());
            }
        }
    }

    #[test]
    fn truncated_input_is_no_entry_not_a_panic() {
        let (payload, _) = entry_payload();
        for cut in 0..payload.len() {
            let _ = parse_entry(&payload[..cut]);
            let _ = messages(&payload[..cut]);
        }
        assert!(parse_entry(&payload[..30]).is_none());
    }
}
