//! The blocking netlink socket both protocols use: the only code in the crate that makes system calls, and the
//! only place `unsafe` is allowed (for the two socket options `netlink-sys` does not offer).

#![allow(unsafe_code, reason = "socket options netlink-sys does not offer")]

use std::io;
use std::os::fd::AsRawFd;

use netlink_sys::{Socket, SocketAddr};

/// The size of a `c_int` socket option (4 bytes: the conversion cannot truncate).
const INT_LEN: libc::socklen_t = socklen_of::<libc::c_int>();
/// The size of a `timeval` socket option (16 bytes).
const TIMEVAL_LEN: libc::socklen_t = socklen_of::<libc::timeval>();

const fn socklen_of<T>() -> libc::socklen_t {
    let n = std::mem::size_of::<T>();
    assert!(
        n <= u32::MAX as usize,
        "a socket option larger than socklen_t"
    );
    #[expect(
        clippy::cast_possible_truncation,
        reason = "checked just above, in a const context where try_from is not available"
    )]
    let len = n as libc::socklen_t;
    len
}

/// A netlink socket bound to an automatic port id and connected to the kernel.
pub(crate) struct NlSocket {
    sock: Socket,
}

impl NlSocket {
    pub(crate) fn open(protocol: isize) -> io::Result<Self> {
        let mut sock = Socket::new(protocol)?;
        sock.bind_auto()?;
        sock.connect(&SocketAddr::new(0, 0))?;
        Ok(NlSocket { sock })
    }

    /// A socket that only listens: bound to an automatic port id and joined to these multicast groups, not
    /// connected, so it receives the kernel's notifications and never sends.
    pub(crate) fn open_groups(protocol: isize, groups: &[u32]) -> io::Result<Self> {
        let mut sock = Socket::new(protocol)?;
        sock.bind_auto()?;
        for &group in groups {
            sock.add_membership(group)?;
        }
        Ok(NlSocket { sock })
    }

    /// Makes a waiting `recv` give up with `WouldBlock` after `timeout`; `None` waits for ever.
    pub(crate) fn set_recv_timeout(&self, timeout: Option<std::time::Duration>) -> io::Result<()> {
        let tv = match timeout {
            // A zero timeval means "wait for ever" to the kernel, so the shortest real timeout is 1 us.
            Some(d) => libc::timeval {
                tv_sec: libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_usec: libc::suseconds_t::from(
                    d.subsec_micros().max(u32::from(d.as_secs() == 0)),
                ),
            },
            None => libc::timeval {
                tv_sec: 0,
                tv_usec: 0,
            },
        };
        // SAFETY: the fd is owned by `self.sock` and open for its lifetime; the option value points to a live
        // timeval and the length passed is exactly its size.
        let rc = unsafe {
            libc::setsockopt(
                self.sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                TIMEVAL_LEN,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Error replies carry only the failed message's header, not its whole payload.
    pub(crate) fn set_cap_ack(&self) -> io::Result<()> {
        self.sock.set_cap_ack(true)
    }

    /// Raises the receive buffer to `bytes`, past `rmem_max` when the caller has CAP_NET_ADMIN; returns the size
    /// the kernel reports (which it doubles for bookkeeping).
    pub(crate) fn grow_rcvbuf(&self, bytes: usize) -> io::Result<usize> {
        if setsockopt_int(&self.sock, libc::SO_RCVBUFFORCE, bytes).is_err() {
            // Without CAP_NET_ADMIN the forced variant fails; the plain one is capped by rmem_max, and the batch
            // budget below is computed from whatever the kernel actually granted.
            setsockopt_int(&self.sock, libc::SO_RCVBUF, bytes)?;
        }
        self.sock.get_rx_buf_sz()
    }

    /// The receive buffer size the kernel reports.
    pub(crate) fn rcvbuf(&self) -> io::Result<usize> {
        self.sock.get_rx_buf_sz()
    }

    /// Raises the send buffer, which bounds the size of one `sendmsg`; returns the granted size.
    pub(crate) fn grow_sndbuf(&self, bytes: usize) -> io::Result<usize> {
        if setsockopt_int(&self.sock, libc::SO_SNDBUFFORCE, bytes).is_err() {
            setsockopt_int(&self.sock, libc::SO_SNDBUF, bytes)?;
        }
        getsockopt_int(&self.sock, libc::SO_SNDBUF)
    }

    pub(crate) fn send(&self, buf: &[u8]) -> io::Result<()> {
        let n = self.sock.send(buf, 0)?;
        if n != buf.len() {
            return Err(io::Error::other(format!(
                "short netlink send: {n} of {} bytes",
                buf.len()
            )));
        }
        Ok(())
    }

    /// Reads the acknowledgements of a batch just sent whose `n` requests carry the sequence
    /// numbers `first..first + n`: the errno (0 for success) of each request answered, by its
    /// position, and how many times the receive buffer overran (`ENOBUFS`: answers dropped).
    ///
    /// The kernel handles a batch synchronously inside sendmsg, so every answer is queued when
    /// send returns: this reads without waiting until the queue is empty, and so can never wait
    /// forever on an answer that was dropped or never sent. A reply that does not parse costs
    /// only its own request. With `until_last`, it stops once the last request is answered (a
    /// batch that asks for an acknowledgement of its last request only).
    pub(crate) fn read_acks(
        &self,
        buf: &mut Vec<u8>,
        first: u32,
        n: usize,
        until_last: bool,
    ) -> (Vec<Option<i32>>, u64) {
        let mut codes: Vec<Option<i32>> = vec![None; n];
        let (mut answered, mut overruns) = (0, 0);
        while answered < n && !(until_last && codes.last().is_some_and(Option::is_some)) {
            match self.recv(buf, false) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    overruns += 1;
                    continue;
                }
                Err(_) => break,
            }
            answered += crate::wire::record_acks(buf, first, &mut codes);
        }
        (codes, overruns)
    }

    /// Receives one datagram into `buf` (cleared first). With `wait == false` it returns `WouldBlock` when
    /// nothing is queued. A datagram larger than the buffer's capacity is an error rather than silently cut.
    pub(crate) fn recv(&self, buf: &mut Vec<u8>, wait: bool) -> io::Result<usize> {
        buf.clear();
        let flags = libc::MSG_TRUNC | if wait { 0 } else { libc::MSG_DONTWAIT };
        let n = self.sock.recv(buf, flags)?;
        if n > buf.len() {
            return Err(io::Error::other(format!(
                "netlink datagram of {n} bytes exceeds the {}-byte receive buffer",
                buf.len()
            )));
        }
        Ok(n)
    }
}

fn setsockopt_int(sock: &Socket, opt: libc::c_int, value: usize) -> io::Result<()> {
    let v = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
    // SAFETY: the fd is owned by `sock` and open for its lifetime; the option value points to a live c_int and
    // the length passed is exactly its size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&raw const v).cast(),
            INT_LEN,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn getsockopt_int(sock: &Socket, opt: libc::c_int) -> io::Result<usize> {
    let mut v: libc::c_int = 0;
    let mut len = INT_LEN;
    // SAFETY: the fd is owned by `sock`; `v` and `len` are live locals and `len` holds the size of `v`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&raw mut v).cast(),
            &raw mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(v).unwrap_or(0))
}
