//! nfnetlink (`NETLINK_NETFILTER`): the two netfilter subsystems the agent speaks, [`ipset`] (the hairpin
//! sets) and [`conntrack`] (UDP entries of removed endpoints).
//!
//! What the two share lives here: the `nfgenmsg` header every nfnetlink message carries after its
//! `nlmsghdr`, opening the socket (with a reply timeout, so a dump the kernel stops answering is an error rather
//! than a hung agent), sending a batch and reading its acknowledgements by sequence number, and reading a dump to
//! its `NLMSG_DONE`. The framing is the crate's one [`crate::wire`]; the socket is the crate's one
//! [`NlSocket`]. Each subsystem owns its message types and attributes, built and parsed by pure functions that
//! the unit tests drive without a kernel.

pub mod conntrack;
pub mod ipset;

use std::time::Duration;

use crate::error::{Error, Result};
use crate::socket::NlSocket;
use crate::wire::{self, NLMSG_DONE, NLMSG_ERROR, Writer};

/// `NETLINK_NETFILTER` from `linux/netlink.h`.
const NETLINK_NETFILTER: isize = 12;

/// How long a reply may keep us waiting for its next datagram. Listing a set of 100,000 members takes about a
/// second in the TCG test guest; a kernel that says nothing for this long is not going to.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// The largest datagram a reply is read into: dumps fill the socket's default page-sized skbs, far below this.
const RECV_BUF: usize = 1 << 16;

/// A `NETLINK_NETFILTER` socket with its reusable receive buffer and sequence numbers.
pub(crate) struct NfSocket {
    sock: NlSocket,
    buf: Vec<u8>,
    seq: u32,
}

impl NfSocket {
    /// Opens the socket; `op` names what it is for in an error.
    pub(crate) fn open(op: &str) -> Result<Self> {
        let io = |source| Error::Io {
            op: format!("{op}: netlink socket"),
            source,
        };
        let sock = NlSocket::open(NETLINK_NETFILTER).map_err(io)?;
        sock.set_recv_timeout(Some(REPLY_TIMEOUT)).map_err(io)?;
        Ok(Self {
            sock,
            buf: Vec::with_capacity(RECV_BUF),
            seq: 0,
        })
    }

    /// The next `n` sequence numbers; returns the first.
    pub(crate) fn next_seqs(&mut self, n: usize) -> u32 {
        let first = self.seq.wrapping_add(1);
        self.seq = self.seq.wrapping_add(u32::try_from(n).unwrap_or(u32::MAX));
        first
    }

    /// The receive buffer size the kernel granted (it bounds how many acknowledgements can queue).
    pub(crate) fn rcvbuf(&self) -> Option<usize> {
        self.sock.rcvbuf().ok().filter(|&b| b > 0)
    }

    /// Sends `bytes` (`n` requests with the sequence numbers `first..first + n`) in one datagram and reads
    /// their acknowledgements: per request, its errno (0 for success) or `None` when the kernel sent no answer.
    /// nfnetlink handles the requests inside `sendmsg`, so every answer is queued when it returns; reading
    /// without waiting means an answer that was dropped or never sent cannot stop the caller.
    pub(crate) fn acked(
        &mut self,
        bytes: &[u8],
        first: u32,
        n: usize,
        op: &str,
    ) -> Result<Vec<Option<i32>>> {
        self.sock.send(bytes).map_err(|source| Error::Io {
            op: format!("{op}: netlink socket"),
            source,
        })?;
        let (codes, _overruns) = self.sock.read_acks(&mut self.buf, first, n, false);
        Ok(codes)
    }

    /// Sends one dump request and hands each reply datagram of it to `step` until `step` says the dump is
    /// over. Waits at most [`REPLY_TIMEOUT`] for each datagram.
    pub(crate) fn dump<T>(
        &mut self,
        request: &[u8],
        op: &str,
        mut step: impl FnMut(&[u8]) -> Result<Option<T>>,
    ) -> Result<T> {
        let io = |source| Error::Io {
            op: format!("{op}: netlink socket"),
            source,
        };
        self.sock.send(request).map_err(io)?;
        loop {
            self.buf.reserve(RECV_BUF);
            match self.sock.recv(&mut self.buf, true) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Err(io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no reply within {} s", REPLY_TIMEOUT.as_secs()),
                    )));
                }
                Err(e) => return Err(io(e)),
            }
            if let Some(done) = step(&self.buf)? {
                return Ok(done);
            }
        }
    }
}

/// Starts an nfnetlink message in `w`: `struct nlmsghdr` (its length patched by [`Writer::end_msg`]) and
/// `struct nfgenmsg` (`family`, `NFNETLINK_V0`, `res_id` 0) for `subsys`'s message `kind`. Returns the
/// message's offset.
pub(crate) fn begin(
    w: &mut Writer<'_>,
    subsys: u16,
    kind: u16,
    flags: u16,
    seq: u32,
    family: u8,
) -> usize {
    let start = w.begin_msg((subsys << 8) | kind, flags, seq, 0);
    w.buf.extend_from_slice(&[family, 0, 0, 0]);
    start
}

/// How one datagram of a dump reply ends, for the messages of sequence number `seq` (all when `None`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DumpEnd {
    /// More datagrams follow.
    More,
    /// `NLMSG_DONE` without an error: the dump is complete.
    Done,
    /// The kernel refused the request itself (`NLMSG_ERROR` with this errno): there is no dump.
    /// Whether that is an error is the subsystem's call (an absent ipset is not).
    Refused(i32),
}

/// Reads one datagram of a dump reply: hands each data message's payload (after the `nlmsghdr`) to `message`,
/// and says whether the dump is done or was refused. A `NLMSG_DONE` carrying an errno (a dump that failed part
/// way) is [`Error::Netfilter`] naming `op`; a malformed message is [`Error::Decode`].
pub(crate) fn dump_step(
    datagram: &[u8],
    seq: Option<u32>,
    op: &dyn Fn() -> String,
    mut message: impl FnMut(&[u8]) -> Result<()>,
) -> Result<DumpEnd> {
    for m in wire::messages(datagram) {
        let (h, payload, _) = m?;
        if seq.is_some_and(|s| s != h.seq) {
            continue;
        }
        match h.kind {
            NLMSG_DONE => {
                return match wire::done_code(payload) {
                    0 => Ok(DumpEnd::Done),
                    errno => Err(Error::Netfilter {
                        op: format!("{} (ended early)", op()),
                        errno,
                    }),
                };
            }
            NLMSG_ERROR => match wire::error_code(payload)? {
                0 => {}
                errno => return Ok(DumpEnd::Refused(errno)),
            },
            _ => message(payload)?,
        }
    }
    Ok(DumpEnd::More)
}

/// What the subsystems' unit tests share.
#[cfg(test)]
pub(crate) mod test_support {
    use crate::wire;

    /// A message of a datagram, as the tests read it.
    pub(crate) struct Message<'a> {
        pub(crate) kind: u16,
        pub(crate) seq: u32,
        pub(crate) payload: &'a [u8],
    }

    /// The well-formed messages of a datagram, up to the first malformed one.
    pub(crate) fn messages(buf: &[u8]) -> Vec<Message<'_>> {
        wire::messages(buf)
            .map_while(std::result::Result::ok)
            .map(|(h, payload, _)| Message {
                kind: h.kind,
                seq: h.seq,
                payload,
            })
            .collect()
    }

    /// Datagrams from a fixture file: one hex datagram a line.
    pub(crate) fn datagrams(hex: &str) -> Vec<Vec<u8>> {
        hex.lines()
            .map(|l| {
                (0..l.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&l[i..i + 2], 16).expect("hex"))
                    .collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{NLM_F_ACK, NLM_F_REQUEST, attrs, messages};

    #[test]
    fn a_message_and_its_attributes_round_trip_and_truncated_tails_are_dropped() {
        let mut buf = Vec::new();
        let mut w = Writer::new(&mut buf);
        let start = begin(&mut w, 6, 9, NLM_F_REQUEST | NLM_F_ACK, 42, 2);
        w.put(1, &[6]);
        w.put(2 | 0x8000, b"abcde");
        w.end_msg(start);
        let msg = buf;
        assert_eq!(msg.len(), 16 + 4 + 8 + 12);
        let mut two = msg.clone();
        two.extend_from_slice(&msg[..10]);
        let got: Vec<_> = messages(&two).filter_map(std::result::Result::ok).collect();
        assert_eq!(got.len(), 1, "the cut second message is dropped");
        assert_eq!((got[0].0.kind, got[0].0.seq), ((6 << 8) | 9, 42));
        let a: Vec<_> = attrs(&got[0].1[4..]).collect();
        assert_eq!(a.len(), 2);
        assert_eq!((a[0].0, a[0].1), (1, &[6u8][..]));
        assert_eq!((a[1].0, a[1].1), (2, &b"abcde"[..]));
        assert_eq!(a[1].2.len(), 9);
        assert_eq!(wire::error_code(&(-17i32).to_ne_bytes()).ok(), Some(17));
        assert!(wire::error_code(&[0, 0]).is_err());
    }
}
