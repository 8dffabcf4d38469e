//! Whole IPVS generic netlink messages as the kernel sends them in dumps: the netlink header, the generic netlink
//! header and one SERVICE or DEST nest. These exist so captured kernel replies can be parsed and re-emitted byte
//! for byte; the handle uses the same parsers for every dump it reads.

use super::types::{Destination, Family, Service};
use super::wire::{self, GENL_HDR_LEN, NlHeader, Writer};
use crate::error::{Error, Result};

/// A generic netlink message carrying one IPVS object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpvsMessage<T> {
    /// The netlink header (family id, flags, sequence, port id).
    pub header: NlHeader,
    /// Generic netlink command (NEW_SERVICE for service dumps, NEW_DEST for destination dumps).
    pub cmd: u8,
    /// Generic netlink version (1).
    pub version: u8,
    /// The reserved field of the generic netlink header.
    pub reserved: u16,
    /// The object.
    pub body: T,
}

/// Splits a whole message into header, generic netlink header and the value of the nest of type `nest`.
fn split<'a>(bytes: &'a [u8], nest: u16, what: &str) -> Result<(NlHeader, [u8; 4], &'a [u8])> {
    let (header, payload, _) = wire::messages(bytes)
        .next()
        .ok_or_else(|| Error::decode(what, "shorter than a netlink header"))??;
    let genl = payload
        .get(..GENL_HDR_LEN)
        .ok_or_else(|| Error::decode(what, "no generic netlink header"))?;
    for (kind, value, _) in wire::attrs(&payload[GENL_HDR_LEN..]) {
        if kind == nest {
            return Ok((header, [genl[0], genl[1], genl[2], genl[3]], value));
        }
    }
    Err(Error::decode(what, format!("no nest of type {nest}")))
}

impl<T> IpvsMessage<T> {
    fn emit_with(&self, out: &mut Vec<u8>, nest: u16, body: impl FnOnce(&mut Writer<'_>)) {
        let mut w = Writer::new(out);
        let start = w.begin_msg(
            self.header.kind,
            self.header.flags,
            self.header.seq,
            self.header.pid,
        );
        w.genl_header(self.cmd, self.version);
        let len = w.buf.len();
        w.buf[len - 2..].copy_from_slice(&self.reserved.to_ne_bytes());
        let n = w.begin_nest(nest);
        body(&mut w);
        w.end_nest(n);
        w.end_msg(start);
    }
}

impl IpvsMessage<Service> {
    /// Parses one service message from a service dump.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let (header, g, nest) = split(bytes, wire::CMD_ATTR_SERVICE, "service message")?;
        Ok(IpvsMessage {
            header,
            cmd: g[0],
            version: g[1],
            reserved: u16::from_ne_bytes([g[2], g[3]]),
            body: Service::parse(nest)?,
        })
    }

    /// Emits the message as the kernel lays it out.
    pub fn emit(&self, out: &mut Vec<u8>) {
        self.emit_with(out, wire::CMD_ATTR_SERVICE, |w| {
            self.body.emit_attrs(w, true)
        });
    }
}

impl IpvsMessage<Destination> {
    /// Parses one destination message from a destination dump of a service of family `service_family`.
    pub fn parse(bytes: &[u8], service_family: Family) -> Result<Self> {
        let (header, g, nest) = split(bytes, wire::CMD_ATTR_DEST, "destination message")?;
        Ok(IpvsMessage {
            header,
            cmd: g[0],
            version: g[1],
            reserved: u16::from_ne_bytes([g[2], g[3]]),
            body: Destination::parse(nest, service_family)?,
        })
    }

    /// Emits the message as the kernel lays it out.
    pub fn emit(&self, out: &mut Vec<u8>) {
        self.emit_with(out, wire::CMD_ATTR_DEST, |w| self.body.emit_attrs(w, true));
    }
}
