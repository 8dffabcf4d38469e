//! Entry points for the coverage-guided fuzz targets (`crates/fuzz`, `cargo xtask fuzz`), built only with
//! the `fuzzing` feature. Each feeds arbitrary bytes, as one datagram from the kernel, to the parser the
//! crate runs on that family's replies, and checks what must hold for any input: no panic, and every
//! value that parsed is emitted and parsed again to the same value (the requests the crate builds from
//! what it read are what it read).

use crate::ipvs::{Destination, Family, IpvsMessage, Service};
use crate::nfnl::{conntrack, ipset};
use crate::wire;

/// An IPVS dump reply, acknowledgements and the `NLMSG_DONE` errno: every message is parsed as a service
/// and as a destination of either family; what parses must survive emit and parse unchanged.
pub fn ipvs_reply(datagram: &[u8]) {
    let mut codes = [None; 8];
    let filled = wire::record_acks(datagram, 1, &mut codes);
    assert_eq!(filled, codes.iter().flatten().count(), "acks recorded");
    for m in wire::messages(datagram) {
        let Ok((_, payload, whole)) = m else { break };
        let _ = wire::done_code(payload);
        let _ = wire::error_code(payload);
        if let Ok(svc) = IpvsMessage::<Service>::parse(whole) {
            let mut out = Vec::new();
            svc.emit(&mut out);
            match IpvsMessage::<Service>::parse(&out) {
                Ok(again) => assert_eq!(again, svc, "service emit/parse round trip"),
                Err(e) => panic!("re-parse of an emitted service failed: {e}"),
            }
        }
        for family in [Family::Inet, Family::Inet6] {
            if let Ok(dest) = IpvsMessage::<Destination>::parse(whole, family) {
                let mut out = Vec::new();
                dest.emit(&mut out);
                match IpvsMessage::<Destination>::parse(&out, family) {
                    Ok(again) => assert_eq!(again, dest, "destination emit/parse round trip"),
                    Err(e) => panic!("re-parse of an emitted destination failed: {e}"),
                }
            }
        }
    }
}

/// An rtnetlink address notification datagram, as the node-address watch reads it.
pub fn address_events(datagram: &[u8]) {
    let _ = crate::link::parse_events(datagram);
}

/// An ipset `LIST` reply datagram: its members must survive the add request and a parse unchanged.
pub fn ipset_list(datagram: &[u8]) {
    ipset::fuzz_list(datagram);
}

/// A conntrack dump datagram: each entry's delete request must carry the original tuple it was read with.
pub fn conntrack_dump(datagram: &[u8]) {
    conntrack::fuzz_dump(datagram);
}
