//! nfnetlink framing shared by our two netfilter clients, [`crate::conntrack`] and
//! [`crate::ipset`]: the `nlmsghdr` + `nfgenmsg` header, attributes, and reading the messages,
//! acknowledgements and attributes of a reply. Pure functions on bytes; each client owns its
//! socket, its subsystem's message types and attributes.

pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;
pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
pub(crate) const NLM_F_DUMP: u16 = 0x300;
pub(crate) const NLA_TYPE_MASK: u16 = 0x3fff;
/// `struct nlmsghdr`.
pub(crate) const HEADER_LEN: usize = 16;

pub(crate) fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Starts a message: `struct nlmsghdr` (its length left for [`finish`]) and `struct nfgenmsg`
/// (`family`, `NFNETLINK_V0`, `res_id` 0) for `subsys`'s message `kind`.
pub(crate) fn start(subsys: u16, kind: u16, flags: u16, seq: u32, family: u8) -> Vec<u8> {
    let mut buf = Vec::with_capacity(96);
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(&((subsys << 8) | kind).to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(&[family, 0, 0, 0]);
    buf
}

/// Writes the message's length into its header.
pub(crate) fn finish(mut buf: Vec<u8>) -> Vec<u8> {
    let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
    buf[..4].copy_from_slice(&len.to_ne_bytes());
    buf
}

/// Appends one attribute, padded to 4 bytes.
pub(crate) fn put_attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = u16::try_from(4 + payload.len()).unwrap_or(u16::MAX);
    buf.extend_from_slice(&len.to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(align4(buf.len()), 0);
}

/// A netlink message in a datagram.
pub(crate) struct Message<'a> {
    pub(crate) kind: u16,
    pub(crate) seq: u32,
    /// What follows the 16-byte header.
    pub(crate) payload: &'a [u8],
}

/// The netlink messages in a datagram; a truncated tail is dropped.
pub(crate) fn messages(buf: &[u8]) -> Vec<Message<'_>> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= HEADER_LEN {
        let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        let seq = u32::from_ne_bytes([rest[8], rest[9], rest[10], rest[11]]);
        if len < HEADER_LEN || len > rest.len() {
            break;
        }
        out.push(Message {
            kind,
            seq,
            payload: &rest[HEADER_LEN..len],
        });
        rest = &rest[align4(len).min(rest.len())..];
    }
    out
}

/// The errno of an `NLMSG_ERROR` payload (0 for an acknowledgement), made positive.
pub(crate) fn error_code(payload: &[u8]) -> Option<i32> {
    let b = payload.get(..4)?;
    Some(i32::from_ne_bytes([b[0], b[1], b[2], b[3]]).saturating_abs())
}

/// The errno of an `NLMSG_DONE` payload (a negative `i32`, or none: 0).
pub(crate) fn done_code(payload: &[u8]) -> i32 {
    payload
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(0, |b| i32::from_ne_bytes(b).saturating_neg())
}

/// One attribute: its type without the nested/byte-order flags, its payload, and its whole
/// bytes (header and payload, for copying it into a request as it came).
pub(crate) struct Attr<'a> {
    pub(crate) kind: u16,
    pub(crate) payload: &'a [u8],
    pub(crate) whole: &'a [u8],
}

/// The attributes in `buf`; a truncated tail is dropped.
pub(crate) fn attrs(buf: &[u8]) -> Vec<Attr<'_>> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= 4 {
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > rest.len() {
            break;
        }
        out.push(Attr {
            kind,
            payload: &rest[4..len],
            whole: &rest[..len],
        });
        rest = &rest[align4(len).min(rest.len())..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_and_its_attributes_round_trip_and_truncated_tails_are_dropped() {
        let mut buf = start(6, 9, NLM_F_REQUEST | NLM_F_ACK, 42, 2);
        put_attr(&mut buf, 1, &[6]);
        put_attr(&mut buf, 2 | 0x8000, b"abcde");
        let msg = finish(buf);
        assert_eq!(msg.len(), 16 + 4 + 8 + 12);
        let mut two = msg.clone();
        two.extend_from_slice(&msg[..10]);
        let got = messages(&two);
        assert_eq!(got.len(), 1, "the cut second message is dropped");
        assert_eq!((got[0].kind, got[0].seq), ((6 << 8) | 9, 42));
        let a = attrs(&got[0].payload[4..]);
        assert_eq!(a.len(), 2);
        assert_eq!((a[0].kind, a[0].payload), (1, &[6u8][..]));
        assert_eq!((a[1].kind, a[1].payload), (2, &b"abcde"[..]));
        assert_eq!(a[1].whole.len(), 9);
        assert_eq!(error_code(&(-17i32).to_ne_bytes()), Some(17));
        assert_eq!(error_code(&[0, 0]), None);
    }
}
