//! IPVS over generic netlink.
//!
//! [`Ipvs`] is the handle: one blocking `netlink-sys` socket, the family id resolved once, and two reusable
//! buffers. Reads (`services`, `destinations`, `info`, `timeouts`) are single requests or dumps. Writes are
//! [`Request`] values given to [`Ipvs::apply`], which packs as many as fit into each `sendmsg` and maps every
//! acknowledgement back to its request by sequence number.
//!
//! The module owns the IPVS wire format and nothing else: it does not decide what the table should contain, and it
//! does not render anything for people.

mod message;
mod request;
mod types;
pub(crate) mod wire;

use std::io;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_generic::GenlMessage;
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};

pub use crate::wire::NlHeader;
pub use message::IpvsMessage;
pub use request::Request;
pub use types::{
    Destination, Family, Flags, ForwardMethod, Info, Netmask, Protocol, Service, ServiceKey, Stats,
    Timeouts, Tunnel, TunnelType,
};

use crate::error::{Error, Result};
use crate::socket::NlSocket;
use wire::Writer;

/// Size of the buffer dumps and acknowledgements are read into. The kernel never builds a dump datagram larger
/// than 32 KiB, and `recv` reports a larger one as an error instead of truncating it.
const RECV_BUF: usize = 64 * 1024;

/// `GENL_ID_CTRL`, the controller family that resolves family names.
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_ATTR_FAMILY_ID: u16 = 1;

/// How `apply` asks the kernel to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckMode {
    /// Every request carries NLM_F_ACK, so every outcome is read back explicitly.
    Every,
    /// Only the last request of each `sendmsg` carries NLM_F_ACK. The kernel still answers every failing request
    /// with an error, and it processes a batch in order, so once the last acknowledgement has been read every
    /// request without an error succeeded. This saves one `recv` per request; if the receive buffer overflows,
    /// requests without an answer are reported as [`Error::AckLost`] exactly as in `Every` mode.
    ErrorsOnly,
}

/// Socket sizing and batching policy.
#[derive(Debug, Clone, Copy)]
pub struct IpvsConfig {
    /// Receive buffer to request (forced past `rmem_max` when the caller has CAP_NET_ADMIN).
    pub rcvbuf: usize,
    /// Send buffer to request; it bounds the bytes of one `sendmsg`.
    pub sndbuf: usize,
    /// Receive buffer bytes one queued acknowledgement costs, used to cap how many requests go into one `sendmsg`
    /// so their acknowledgements fit. The kernel charges an skb's truesize, not its 36 bytes of payload.
    pub ack_cost: usize,
    /// How requests are acknowledged.
    pub ack_mode: AckMode,
    /// Bytes of the buffer replies are read into. The kernel sizes each dump datagram to the largest buffer the
    /// socket has read with (up to 32 KiB), so this also sets how much it allocates per dump batch.
    pub recv_buf: usize,
    /// The generic netlink family to resolve; always "IPVS" except in tests of the missing-module path.
    pub family_name: &'static str,
}

impl Default for IpvsConfig {
    fn default() -> Self {
        IpvsConfig {
            rcvbuf: 16 << 20,
            sndbuf: 4 << 20,
            ack_cost: 1024,
            // Measured at 10,000 x 10 on fresh tables (docs/benchmarks.md): 1.08x the raw
            // cost of the same messages with no acknowledgement at all, against 1.68x for
            // `Every`; a failure is still reported, by its sequence number.
            ack_mode: AckMode::ErrorsOnly,
            family_name: "IPVS",
            recv_buf: RECV_BUF,
        }
    }
}

/// Counters of what `apply` did, for benchmarks and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// `sendmsg` calls made by `apply`.
    pub sends: u64,
    /// Times the receive buffer overflowed (ENOBUFS).
    pub overruns: u64,
    /// Requests reported as [`Error::AckLost`].
    pub lost: u64,
}

/// The handle to the IPVS table of the caller's network namespace.
pub struct Ipvs {
    sock: NlSocket,
    family: u16,
    seq: u32,
    recv_buf: Vec<u8>,
    send_buf: Vec<u8>,
    max_batch_bytes: usize,
    max_batch_msgs: usize,
    ack_mode: AckMode,
    stats: BatchStats,
    buffers: (usize, usize),
}

fn io_err(op: &str) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| Error::Io {
        op: op.to_owned(),
        source,
    }
}

fn copy_io(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

impl Ipvs {
    /// Opens a handle with the default [`IpvsConfig`].
    pub fn new() -> Result<Self> {
        Self::with_config(IpvsConfig::default())
    }

    /// Opens a handle: socket, buffer sizes, and the IPVS family id.
    pub fn with_config(config: IpvsConfig) -> Result<Self> {
        const OP: &str = "open generic netlink socket";
        let sock = NlSocket::open(netlink_sys::protocols::NETLINK_GENERIC).map_err(io_err(OP))?;
        sock.set_cap_ack().map_err(io_err(OP))?;
        let rcvbuf = sock.grow_rcvbuf(config.rcvbuf).map_err(io_err(OP))?;
        let sndbuf = sock.grow_sndbuf(config.sndbuf).map_err(io_err(OP))?;
        let mut ipvs = Ipvs {
            sock,
            family: 0,
            seq: 1,
            recv_buf: Vec::with_capacity(config.recv_buf.max(4096)),
            send_buf: Vec::new(),
            // The kernel refuses a sendmsg longer than sk_sndbuf - 32; keep a page of slack for the last message.
            max_batch_bytes: sndbuf.saturating_sub(4096).max(4096),
            max_batch_msgs: (rcvbuf / config.ack_cost.max(1)).max(1),
            ack_mode: config.ack_mode,
            stats: BatchStats::default(),
            buffers: (rcvbuf, sndbuf),
        };
        ipvs.family = ipvs.resolve_family(config.family_name)?;
        Ok(ipvs)
    }

    /// The generic netlink family id of IPVS in this kernel.
    #[must_use]
    pub fn family_id(&self) -> u16 {
        self.family
    }

    /// The most bytes and requests `apply` puts into one `sendmsg`.
    #[must_use]
    pub fn batch_limits(&self) -> (usize, usize) {
        (self.max_batch_bytes, self.max_batch_msgs)
    }

    /// The receive and send buffer sizes the kernel granted (as it reports them, doubled).
    #[must_use]
    pub fn socket_buffers(&self) -> (usize, usize) {
        self.buffers
    }

    /// What `apply` has done so far.
    #[must_use]
    pub fn batch_stats(&self) -> BatchStats {
        self.stats
    }

    fn next_seq(&mut self) -> u32 {
        let s = self.seq;
        self.seq = self.seq.wrapping_add(1);
        s
    }

    fn resolve_family(&mut self, name: &str) -> Result<u16> {
        const OP: &str = "resolve generic netlink family IPVS";
        let genl = GenlMessage::from_payload(GenlCtrl {
            cmd: GenlCtrlCmd::GetFamily,
            nlas: vec![GenlCtrlAttrs::FamilyName(name.to_owned())],
        });
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK;
        header.sequence_number = self.next_seq();
        let seq = header.sequence_number;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(genl));
        msg.finalize();
        let mut out = vec![0u8; msg.buffer_len()];
        msg.serialize(&mut out);
        self.sock.send(&out).map_err(io_err(OP))?;

        // The reply is decoded by hand: the controller's reply carries policy attributes that change between
        // kernels, and only the family id matters here.
        let mut family = None;
        loop {
            self.sock
                .recv(&mut self.recv_buf, true)
                .map_err(io_err(OP))?;
            for m in wire::messages(&self.recv_buf) {
                let (h, payload, _) = m?;
                if h.seq != seq {
                    continue;
                }
                match h.kind {
                    wire::NLMSG_ERROR => {
                        let code = wire::error_code(payload)?;
                        return match (code, family) {
                            (0, Some(id)) => Ok(id),
                            (0, None) => Err(Error::decode("IPVS family reply", "no family id")),
                            (libc::ENOENT, _) => Err(Error::ModuleMissing),
                            (libc::EPERM, _) => Err(Error::Permission { op: OP.to_owned() }),
                            (errno, _) => Err(Error::Kernel {
                                op: OP.to_owned(),
                                errno,
                            }),
                        };
                    }
                    GENL_ID_CTRL => {
                        let attrs = payload.get(wire::GENL_HDR_LEN..).unwrap_or(&[]);
                        for (kind, v, _) in wire::attrs(attrs) {
                            if kind == CTRL_ATTR_FAMILY_ID {
                                family = Some(
                                    wire::read_u16(v)
                                        .map_err(|e| Error::decode("IPVS family id", e))?,
                                );
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Applies `requests` in order, as few `sendmsg` calls as the buffers allow, and returns one result per
    /// request. Nothing is atomic: a failing request does not stop the ones after it. Requests that fail
    /// validation are not sent.
    pub fn apply(&mut self, requests: &[Request]) -> Vec<Result<()>> {
        let mut results: Vec<Option<Result<()>>> = requests.iter().map(|_| None).collect();
        let mut buf = std::mem::take(&mut self.send_buf);
        buf.clear();
        let mut chunk: Vec<usize> = Vec::with_capacity(self.max_batch_msgs.min(requests.len()));
        let mut last_off = 0;
        let flags = match self.ack_mode {
            AckMode::Every => NLM_F_REQUEST | NLM_F_ACK,
            AckMode::ErrorsOnly => NLM_F_REQUEST,
        };
        for (i, req) in requests.iter().enumerate() {
            if let Err(e) = req.validate() {
                results[i] = Some(Err(e));
                continue;
            }
            let mut off = buf.len();
            let seq = self
                .seq
                .wrapping_add(u32::try_from(chunk.len()).unwrap_or(u32::MAX));
            req.encode(&mut Writer::new(&mut buf), self.family, flags, seq);
            if buf.len() > self.max_batch_bytes && !chunk.is_empty() {
                // This request does not fit: send the batch without it, then start the next batch with it.
                buf.truncate(off);
                self.send_batch(&mut buf, last_off, requests, &chunk, &mut results);
                chunk.clear();
                off = 0;
                req.encode(&mut Writer::new(&mut buf), self.family, flags, self.seq);
            }
            last_off = off;
            chunk.push(i);
            if chunk.len() >= self.max_batch_msgs {
                self.send_batch(&mut buf, last_off, requests, &chunk, &mut results);
                chunk.clear();
            }
        }
        if !chunk.is_empty() {
            self.send_batch(&mut buf, last_off, requests, &chunk, &mut results);
        }
        self.send_buf = buf;
        results
            .into_iter()
            .zip(requests)
            .map(|(r, req)| {
                r.unwrap_or_else(|| {
                    Err(Error::AckLost {
                        op: req.to_string(),
                    })
                })
            })
            .collect()
    }

    /// Sends one batch and reads every answer to it. `last_off` is the offset of the batch's last message.
    fn send_batch(
        &mut self,
        buf: &mut Vec<u8>,
        last_off: usize,
        requests: &[Request],
        chunk: &[usize],
        results: &mut [Option<Result<()>>],
    ) {
        let first = self.seq;
        self.seq = self
            .seq
            .wrapping_add(u32::try_from(chunk.len()).unwrap_or(u32::MAX));
        let errors_only = self.ack_mode == AckMode::ErrorsOnly;
        if errors_only {
            let at = last_off + 6;
            let f = u16::from_ne_bytes([buf[at], buf[at + 1]]) | NLM_F_ACK;
            buf[at..at + 2].copy_from_slice(&f.to_ne_bytes());
        }
        self.stats.sends += 1;
        let sent = self.sock.send(buf);
        buf.clear();
        if let Err(e) = sent {
            for &i in chunk {
                results[i] = Some(Err(Error::Io {
                    op: requests[i].to_string(),
                    source: copy_io(&e),
                }));
            }
            return;
        }

        let mut rbuf = std::mem::take(&mut self.recv_buf);
        let (codes, overruns) = self
            .sock
            .read_acks(&mut rbuf, first, chunk.len(), errors_only);
        self.stats.overruns += overruns;
        for (&i, code) in chunk.iter().zip(&codes) {
            results[i] = code.map(|c| {
                if c == 0 {
                    Ok(())
                } else {
                    Err(requests[i].error_for(c))
                }
            });
        }
        let last_seen = codes.last().is_some_and(Option::is_some);
        let overrun = overruns > 0;
        self.recv_buf = rbuf;
        let implied_ok = errors_only && last_seen && !overrun;
        for &i in chunk {
            if results[i].is_none() {
                results[i] = Some(if implied_ok {
                    Ok(())
                } else {
                    self.stats.lost += 1;
                    Err(Error::AckLost {
                        op: requests[i].to_string(),
                    })
                });
            }
        }
    }

    /// Applies one request.
    pub fn execute(&mut self, request: &Request) -> Result<()> {
        self.apply(std::slice::from_ref(request))
            .pop()
            .unwrap_or_else(|| {
                Err(Error::AckLost {
                    op: request.to_string(),
                })
            })
    }

    /// Sends one command (with `flags`, and the service's key nest if given) in the reusable send
    /// buffer; returns its sequence number.
    fn send_command(
        &mut self,
        cmd: u8,
        flags: u16,
        service: Option<&ServiceKey>,
        op: &dyn Fn() -> String,
    ) -> Result<u32> {
        let seq = self.next_seq();
        let mut buf = std::mem::take(&mut self.send_buf);
        buf.clear();
        {
            let mut w = Writer::new(&mut buf);
            let start = w.begin_msg(self.family, flags, seq, 0);
            w.genl_header(cmd, wire::IPVS_GENL_VERSION);
            if let Some(k) = service {
                k.emit_nest(&mut w);
            }
            w.end_msg(start);
        }
        let sent = self.sock.send(&buf);
        self.send_buf = buf;
        sent.map_err(|source| Error::Io { op: op(), source })?;
        Ok(seq)
    }

    /// Sends one doit request and returns the attributes of its reply message, if it has one.
    fn doit(
        &mut self,
        cmd: u8,
        service: Option<&ServiceKey>,
        op: &dyn Fn() -> String,
    ) -> Result<Option<Vec<u8>>> {
        let seq = self.send_command(cmd, NLM_F_REQUEST | NLM_F_ACK, service, op)?;
        let mut reply = None;
        loop {
            self.sock
                .recv(&mut self.recv_buf, true)
                .map_err(|source| Error::Io { op: op(), source })?;
            for m in wire::messages(&self.recv_buf) {
                let (h, payload, _) = m?;
                if h.seq != seq {
                    continue;
                }
                if h.kind == wire::NLMSG_ERROR {
                    return match wire::error_code(payload)? {
                        0 => Ok(reply),
                        errno => Err(map_read_errno(errno, op())),
                    };
                }
                if h.kind == self.family {
                    reply = Some(payload.get(wire::GENL_HDR_LEN..).unwrap_or(&[]).to_vec());
                }
            }
        }
    }

    /// Runs a dump and calls `f` with each reply message (whole, header included).
    fn dump(
        &mut self,
        cmd: u8,
        service: Option<&ServiceKey>,
        op: &dyn Fn() -> String,
        mut f: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let seq = self.send_command(cmd, NLM_F_REQUEST | wire::NLM_F_DUMP, service, op)?;
        let mut rbuf = std::mem::take(&mut self.recv_buf);
        let result = (|| loop {
            self.sock
                .recv(&mut rbuf, true)
                .map_err(|source| Error::Io { op: op(), source })?;
            for m in wire::messages(&rbuf) {
                let (h, payload, whole) = m?;
                if h.seq != seq {
                    continue;
                }
                match h.kind {
                    wire::NLMSG_DONE => return Ok(()),
                    wire::NLMSG_ERROR => match wire::error_code(payload)? {
                        0 => {}
                        errno => return Err(map_read_errno(errno, op())),
                    },
                    k if k == self.family => f(whole)?,
                    _ => {}
                }
            }
        })();
        self.recv_buf = rbuf;
        result
    }

    /// GET_INFO: IPVS version and connection table size.
    pub fn info(&mut self) -> Result<Info> {
        let op = || "get IPVS info".to_owned();
        let attrs = self
            .doit(wire::CMD_GET_INFO, None, &op)?
            .ok_or_else(|| Error::decode("IPVS info", "no reply"))?;
        Info::parse(&attrs)
    }

    /// GET_CONFIG: the TCP, TCP FIN and UDP connection timeouts.
    pub fn timeouts(&mut self) -> Result<Timeouts> {
        let op = || "get timeouts".to_owned();
        let attrs = self
            .doit(wire::CMD_GET_CONFIG, None, &op)?
            .ok_or_else(|| Error::decode("IPVS timeouts", "no reply"))?;
        Timeouts::parse(&attrs)
    }

    /// GET_SERVICE for one service; `None` if it does not exist.
    pub fn service(&mut self, key: &ServiceKey) -> Result<Option<Service>> {
        let op = || format!("get service {key}");
        match self.doit(wire::CMD_GET_SERVICE, Some(key), &op) {
            Ok(Some(attrs)) => {
                for (kind, v, _) in wire::attrs(&attrs) {
                    if kind == wire::CMD_ATTR_SERVICE {
                        return Service::parse(v).map(Some);
                    }
                }
                Err(Error::decode(
                    format!("service {key}"),
                    "reply without a service",
                ))
            }
            Ok(None) => Err(Error::decode(format!("service {key}"), "no reply")),
            Err(Error::NoSuchService { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Dumps every service.
    pub fn services(&mut self) -> Result<Vec<Service>> {
        let mut out = Vec::new();
        let op = || "list services".to_owned();
        self.dump(wire::CMD_GET_SERVICE, None, &op, |m| {
            out.push(IpvsMessage::<Service>::parse(m)?.body);
            Ok(())
        })?;
        Ok(out)
    }

    /// Dumps the destinations of one service (empty if the service does not exist), in kernel order.
    pub fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<Destination>> {
        let mut out = Vec::new();
        let family = key.family();
        let op = || format!("list destinations of service {key}");
        self.dump(wire::CMD_GET_DEST, Some(key), &op, |m| {
            out.push(IpvsMessage::<Destination>::parse(m, family)?.body);
            Ok(())
        })?;
        Ok(out)
    }

    /// Every service with its destinations: one service dump, then one destination dump per service.
    ///
    /// Two faster-looking variants were measured in the VM and dropped: pipelining several destination dumps
    /// into one `sendmsg` (the kernel finishes a short dump inside `sendmsg`, and later ones fail with EBUSY while
    /// a long one runs) was slower, since each queued dump holds its own reply buffer; and reading with one socket
    /// per CPU on scoped threads was no faster, since the kernel's filling of dump messages dominates.
    pub fn table(&mut self) -> Result<Vec<(Service, Vec<Destination>)>> {
        let services = self.services()?;
        let mut out = Vec::with_capacity(services.len());
        for s in services {
            let d = self.destinations(&s.key)?;
            out.push((s, d));
        }
        Ok(out)
    }

    /// Dumps services and returns each reply message as received, for fixtures and debugging.
    pub fn raw_services(&mut self) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        let op = || "list services".to_owned();
        self.dump(wire::CMD_GET_SERVICE, None, &op, |m| {
            out.push(m.to_vec());
            Ok(())
        })?;
        Ok(out)
    }

    /// Dumps destinations of a service and returns each reply message as received.
    pub fn raw_destinations(&mut self, key: &ServiceKey) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        let op = || format!("list destinations of service {key}");
        self.dump(wire::CMD_GET_DEST, Some(key), &op, |m| {
            out.push(m.to_vec());
            Ok(())
        })?;
        Ok(out)
    }

    /// Sends a bare IPVS command with the given netlink flags and an optional service, and returns the errno it
    /// is answered with (0 for success or an ended dump). For probing kernel behaviour in tests.
    pub fn probe_command(
        &mut self,
        cmd: u8,
        flags: u16,
        service: Option<&ServiceKey>,
    ) -> Result<i32> {
        let op = || format!("probe command {cmd}");
        let seq = self.next_seq();
        let mut buf = Vec::new();
        {
            let mut w = Writer::new(&mut buf);
            let start = w.begin_msg(self.family, flags, seq, 0);
            w.genl_header(cmd, wire::IPVS_GENL_VERSION);
            if let Some(k) = service {
                k.emit_nest(&mut w);
            }
            w.end_msg(start);
        }
        self.sock
            .send(&buf)
            .map_err(|source| Error::Io { op: op(), source })?;
        loop {
            self.sock
                .recv(&mut self.recv_buf, true)
                .map_err(|source| Error::Io { op: op(), source })?;
            for m in wire::messages(&self.recv_buf) {
                let (h, payload, _) = m?;
                if h.seq != seq {
                    continue;
                }
                match h.kind {
                    wire::NLMSG_ERROR => return wire::error_code(payload),
                    wire::NLMSG_DONE => return Ok(0),
                    _ => {}
                }
            }
        }
    }

    /// Adds a service.
    pub fn new_service(&mut self, service: &Service) -> Result<()> {
        self.execute(&Request::NewService(service.clone()))
    }

    /// Changes a service.
    pub fn set_service(&mut self, service: &Service) -> Result<()> {
        self.execute(&Request::SetService(service.clone()))
    }

    /// Deletes a service.
    pub fn del_service(&mut self, key: &ServiceKey) -> Result<()> {
        self.execute(&Request::DelService(*key))
    }

    /// Adds a destination.
    pub fn new_dest(&mut self, service: &ServiceKey, dest: &Destination) -> Result<()> {
        self.execute(&Request::NewDest {
            service: *service,
            dest: dest.clone(),
        })
    }

    /// Changes a destination.
    pub fn set_dest(&mut self, service: &ServiceKey, dest: &Destination) -> Result<()> {
        self.execute(&Request::SetDest {
            service: *service,
            dest: dest.clone(),
        })
    }

    /// Removes a destination.
    pub fn del_dest(
        &mut self,
        service: &ServiceKey,
        addr: std::net::IpAddr,
        port: u16,
    ) -> Result<()> {
        self.execute(&Request::DelDest {
            service: *service,
            addr,
            port,
        })
    }

    /// Deletes every service.
    pub fn flush(&mut self) -> Result<()> {
        self.execute(&Request::Flush)
    }

    /// Zeroes counters of one service, or all with `None`.
    pub fn zero(&mut self, service: Option<&ServiceKey>) -> Result<()> {
        self.execute(&Request::Zero(service.copied()))
    }

    /// Sets connection timeouts (0 leaves one unchanged).
    pub fn set_timeouts(&mut self, timeouts: Timeouts) -> Result<()> {
        self.execute(&Request::SetTimeouts(timeouts))
    }
}

/// Maps an errno from a read (GET_*) to a typed error.
fn map_read_errno(errno: i32, op: String) -> Error {
    match errno {
        libc::ESRCH => Error::NoSuchService { op },
        libc::EPERM => Error::Permission { op },
        _ => Error::Kernel { op, errno },
    }
}

/// Command numbers for [`Ipvs::probe_command`].
pub mod cmd {
    /// GET_SERVICE (doit and dump).
    pub const GET_SERVICE: u8 = super::wire::CMD_GET_SERVICE;
    /// GET_DEST (dump only).
    pub const GET_DEST: u8 = super::wire::CMD_GET_DEST;
    /// GET_INFO (doit).
    pub const GET_INFO: u8 = super::wire::CMD_GET_INFO;
}

/// Netlink flags for [`Ipvs::probe_command`].
pub mod flags {
    /// NLM_F_REQUEST.
    pub const REQUEST: u16 = super::wire::NLM_F_REQUEST;
    /// NLM_F_ACK.
    pub const ACK: u16 = super::wire::NLM_F_ACK;
    /// NLM_F_DUMP.
    pub const DUMP: u16 = super::wire::NLM_F_DUMP;
}
