//! The one netlink framing every protocol of the crate uses (IPVS generic netlink, rtnetlink, nfnetlink):
//! `nlmsghdr` constants from the kernel uapi, an attribute writer that appends straight into one reusable buffer,
//! and the readers of messages, acknowledgements (`NLMSG_ERROR`), dump ends (`NLMSG_DONE`) and attributes.
//! Pure functions on bytes: no socket here.
//!
//! The writer exists because the batch path builds over a hundred thousand messages; writing each attribute in
//! place costs no allocation, where building attribute vectors first would cost several per message. Parsing uses
//! `netlink-packet-core`'s buffers.

use netlink_packet_core::{NLA_HEADER_SIZE, NetlinkBuffer};

use crate::error::{Error, Result};

pub(crate) const NLMSG_HDR_LEN: usize = 16;
pub(crate) const GENL_HDR_LEN: usize = 4;

pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;

pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
/// With a create, "fail if it exists"; with an ipset destroy, "tell an absent set" (`ENOENT`).
pub(crate) const NLM_F_EXCL: u16 = 0x200;
pub(crate) const NLM_F_DUMP: u16 = 0x300;

/// Attribute type flag: the payload is a nest of attributes.
pub(crate) const NLA_F_NESTED: u16 = 0x8000;
/// Attribute type flag: the payload is in network byte order.
pub(crate) const NLA_F_NET_BYTEORDER: u16 = 0x4000;

/// Appends netlink messages and attributes to a byte buffer.
pub(crate) struct Writer<'a> {
    pub(crate) buf: &'a mut Vec<u8>,
}

impl<'a> Writer<'a> {
    pub(crate) fn new(buf: &'a mut Vec<u8>) -> Self {
        Writer { buf }
    }

    /// Starts a message with an nlmsghdr whose length is patched by [`Writer::end_msg`]; returns its offset.
    pub(crate) fn begin_msg(&mut self, kind: u16, flags: u16, seq: u32, pid: u32) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&pid.to_ne_bytes());
        start
    }

    /// Writes the generic netlink header that follows the nlmsghdr.
    pub(crate) fn genl_header(&mut self, cmd: u8, version: u8) {
        self.buf.extend_from_slice(&[cmd, version, 0, 0]);
    }

    pub(crate) fn end_msg(&mut self, start: usize) {
        let len = u32::try_from(self.buf.len() - start).unwrap_or(u32::MAX);
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    /// Appends one attribute with `value`, padded to 4 bytes.
    pub(crate) fn put(&mut self, kind: u16, value: &[u8]) {
        // Attributes hold validated, bounded fields; saturating keeps a bug visible as a kernel
        // EINVAL rather than a silently wrapped length.
        let len = u16::try_from(NLA_HEADER_SIZE + value.len()).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.pad();
    }

    fn pad(&mut self) {
        let rem = self.buf.len() % 4;
        if rem != 0 {
            self.buf.extend_from_slice(&[0u8; 3][..4 - rem]);
        }
    }

    pub(crate) fn put_u8(&mut self, kind: u16, v: u8) {
        self.put(kind, &[v]);
    }
    pub(crate) fn put_u16(&mut self, kind: u16, v: u16) {
        self.put(kind, &v.to_ne_bytes());
    }
    pub(crate) fn put_u16_be(&mut self, kind: u16, v: u16) {
        self.put(kind, &v.to_be_bytes());
    }
    pub(crate) fn put_u32(&mut self, kind: u16, v: u32) {
        self.put(kind, &v.to_ne_bytes());
    }
    pub(crate) fn put_u64(&mut self, kind: u16, v: u64) {
        self.put(kind, &v.to_ne_bytes());
    }

    /// Appends a NUL-terminated string attribute, as the kernel's `nla_put_string` does.
    pub(crate) fn put_str(&mut self, kind: u16, s: &str) {
        let len = u16::try_from(NLA_HEADER_SIZE + s.len() + 1).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
        self.pad();
    }

    /// Starts a nested attribute; returns its offset for [`Writer::end_nest`].
    pub(crate) fn begin_nest(&mut self, kind: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        start
    }

    pub(crate) fn end_nest(&mut self, start: usize) {
        // Nests hold validated, bounded fields, so they stay far below 64 KiB; saturating keeps a bug visible as
        // a kernel EINVAL rather than a panic.
        let len = u16::try_from(self.buf.len() - start).unwrap_or(u16::MAX);
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }
}

/// The fixed fields of a netlink message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NlHeader {
    /// `nlmsg_type`: the generic netlink family id for IPVS messages.
    pub kind: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// `nlmsg_pid`.
    pub pid: u32,
}

/// Splits a datagram into its netlink messages, each returned as (header, payload, whole message).
pub(crate) fn messages(
    datagram: &[u8],
) -> impl Iterator<Item = Result<(NlHeader, &[u8], &[u8])>> + '_ {
    let mut rest = datagram;
    std::iter::from_fn(move || {
        if rest.len() < NLMSG_HDR_LEN {
            return None;
        }
        let buf = match NetlinkBuffer::new_checked(rest) {
            Ok(b) => b,
            Err(e) => {
                rest = &[];
                return Some(Err(Error::decode("netlink message", e)));
            }
        };
        let len = buf.length() as usize;
        let header = NlHeader {
            kind: buf.message_type(),
            flags: buf.flags(),
            seq: buf.sequence_number(),
            pid: buf.port_number(),
        };
        let whole = &rest[..len];
        let payload = &rest[NLMSG_HDR_LEN..len];
        let aligned = (len + 3) & !3;
        rest = rest.get(aligned..).unwrap_or(&[]);
        Some(Ok((header, payload, whole)))
    })
}

/// Records the acknowledgements in one datagram: an `NLMSG_ERROR` of sequence number
/// `first + i` fills `codes[i]` (0 for success, else the errno) unless it is filled already.
/// Other messages, sequence numbers outside the batch and unreadable codes are skipped; a
/// malformed message ends the datagram. Returns how many slots it filled.
pub(crate) fn record_acks(datagram: &[u8], first: u32, codes: &mut [Option<i32>]) -> usize {
    let mut filled = 0;
    for m in messages(datagram) {
        let Ok((h, payload, _)) = m else { break };
        if h.kind != NLMSG_ERROR {
            continue;
        }
        let Some(slot) = codes.get_mut(h.seq.wrapping_sub(first) as usize) else {
            continue;
        };
        if slot.is_some() {
            continue;
        }
        let Ok(code) = error_code(payload) else {
            continue;
        };
        *slot = Some(code);
        filled += 1;
    }
    filled
}

/// The errno of an `NLMSG_DONE` payload: a dump that failed part way carries a negative errno there; none
/// (or a short payload) is 0.
pub(crate) fn done_code(payload: &[u8]) -> i32 {
    payload
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(0, |b| i32::from_ne_bytes(b).saturating_neg())
}

/// Reads the error code of an NLMSG_ERROR payload: 0 for an ACK, otherwise a positive errno.
pub(crate) fn error_code(payload: &[u8]) -> Result<i32> {
    let raw = payload
        .get(..4)
        .ok_or_else(|| Error::decode("netlink error message", "shorter than 4 bytes"))?;
    let code = i32::from_ne_bytes([raw[0], raw[1], raw[2], raw[3]]);
    Ok(code.saturating_neg())
}

/// Decoding result of one attribute value. The error is a static description, so the hot parse loop moves small
/// values around; the caller turns it into an [`Error::Decode`] naming the object once.
pub(crate) type Raw<T> = std::result::Result<T, &'static str>;

pub(crate) fn read_u8(v: &[u8]) -> Raw<u8> {
    v.first().copied().ok_or("empty u8 attribute")
}

pub(crate) fn read_u16(v: &[u8]) -> Raw<u16> {
    match v {
        [a, b, ..] => Ok(u16::from_ne_bytes([*a, *b])),
        _ => Err("u16 attribute shorter than 2 bytes"),
    }
}

pub(crate) fn read_u16_be(v: &[u8]) -> Raw<u16> {
    read_u16(v).map(u16::from_be)
}

pub(crate) fn read_u32(v: &[u8]) -> Raw<u32> {
    match v {
        [a, b, c, d, ..] => Ok(u32::from_ne_bytes([*a, *b, *c, *d])),
        _ => Err("u32 attribute shorter than 4 bytes"),
    }
}

pub(crate) fn read_u64(v: &[u8]) -> Raw<u64> {
    match v.get(..8) {
        Some(b) => {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            Ok(u64::from_ne_bytes(a))
        }
        None => Err("u64 attribute shorter than 8 bytes"),
    }
}

/// Reads a NUL-terminated (or unterminated) string attribute.
pub(crate) fn read_str(v: &[u8]) -> Raw<String> {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    std::str::from_utf8(&v[..end])
        .map(str::to_owned)
        .map_err(|_| "string attribute is not UTF-8")
}

/// Iterates attributes as (type without flag bits, value, the whole raw attribute). A malformed length ends the
/// iteration and sets `bad`, which the caller checks once after its loop.
pub(crate) struct Attrs<'a> {
    rest: &'a [u8],
    pub(crate) bad: bool,
}

pub(crate) fn attrs(buf: &[u8]) -> Attrs<'_> {
    Attrs {
        rest: buf,
        bad: false,
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = (u16, &'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.rest;
        if rest.len() < NLA_HEADER_SIZE {
            return None;
        }
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let kind = u16::from_ne_bytes([rest[2], rest[3]]);
        if len < NLA_HEADER_SIZE || len > rest.len() {
            self.bad = true;
            self.rest = &[];
            return None;
        }
        let aligned = (len + 3) & !3;
        self.rest = rest.get(aligned..).unwrap_or(&[]);
        Some((
            kind & netlink_packet_core::NLA_TYPE_MASK,
            &rest[NLA_HEADER_SIZE..len],
            &rest[..len],
        ))
    }
}

impl Attrs<'_> {
    /// Fails if the iteration stopped at a malformed attribute.
    pub(crate) fn finish(&self) -> Raw<()> {
        if self.bad {
            Err("malformed attribute length")
        } else {
            Ok(())
        }
    }
}
