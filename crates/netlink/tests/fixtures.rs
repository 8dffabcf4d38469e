//! Byte-exact round trips of dump replies captured from a real kernel (Debian's, in the VM): each fixture parses
//! to exactly the struct the capture test programmed (plus what the kernel adds), and emits back to the same
//! bytes. Regenerate with `cargo xtask vm-test kernel_capture` and `tests/fixtures/extract.sh`.

mod common;

use std::path::PathBuf;

use kube_ipvs_netlink::ipvs::{Destination, Flags, IpvsMessage, Service, Stats};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.hex"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let text = text.trim();
    assert!(text.len() % 2 == 0, "{name}: odd hex length");
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap_or_else(|e| panic!("{name}: {e}")))
        .collect()
}

/// What the kernel reports for a service added as `s`: HASHED set, mask all ones, zeroed statistics.
fn as_dumped_service(s: &Service) -> Service {
    let mut s = s.clone();
    s.flags = Flags {
        flags: s.flags.flags | Flags::HASHED,
        mask: u32::MAX,
    };
    s.stats = Some(Stats::default());
    s.stats64 = Some(Stats::default());
    s
}

/// What the kernel reports for a destination added as `d`: tunnel fields always present, zeroed statistics.
fn as_dumped_dest(d: &Destination) -> Destination {
    let mut d = d.clone();
    d.tunnel = Some(d.tunnel.unwrap_or_default());
    d.stats = Some(Stats::default());
    d.stats64 = Some(Stats::default());
    d
}

#[test]
fn services_parse_and_reemit_byte_exact() {
    for case in common::cases() {
        let bytes = fixture(&format!("service_{}", case.name));
        let msg =
            IpvsMessage::<Service>::parse(&bytes).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(msg.body, as_dumped_service(&case.service), "{}", case.name);
        assert_eq!(
            msg.cmd, 1,
            "{}: service dumps answer with NEW_SERVICE",
            case.name
        );
        let mut out = Vec::new();
        msg.emit(&mut out);
        assert_eq!(common::hex(&out), common::hex(&bytes), "{}", case.name);
    }
}

#[test]
fn destinations_parse_and_reemit_byte_exact() {
    for case in common::cases() {
        for (i, want) in case.dests.iter().enumerate() {
            let name = format!("dest_{}_{i}", case.name);
            let bytes = fixture(&name);
            let msg = IpvsMessage::<Destination>::parse(&bytes, case.service.key.family())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(msg.body, as_dumped_dest(want), "{name}");
            assert_eq!(msg.cmd, 5, "{name}: destination dumps answer with NEW_DEST");
            let mut out = Vec::new();
            msg.emit(&mut out);
            assert_eq!(common::hex(&out), common::hex(&bytes), "{name}");
        }
    }
}

/// An attribute a newer kernel might add (type 40, inside the service nest) must not fail the parse, and must
/// come back out unchanged, with whichever flag bits it carried (the fuzzer found both flags set coming
/// back without the byte-order one: netlink-packet-core's emitter drops it).
#[test]
fn unknown_attributes_round_trip() {
    const NESTED: u16 = 0x8000;
    const NET_BYTEORDER: u16 = 0x4000;
    for kind in [
        40,
        40 | NESTED,
        40 | NET_BYTEORDER,
        40 | NESTED | NET_BYTEORDER,
    ] {
        let bytes = fixture("service_tcp4_wlc");
        let mut msg = IpvsMessage::<Service>::parse(&bytes).expect("parse fixture");
        let mut extra = Vec::new();
        let mut grown = Vec::new();
        msg.emit(&mut grown);
        // Append an unknown u32 attribute to the SERVICE nest and fix up both lengths.
        extra.extend_from_slice(&8u16.to_ne_bytes());
        extra.extend_from_slice(&kind.to_ne_bytes());
        extra.extend_from_slice(&7u32.to_ne_bytes());
        grown.extend_from_slice(&extra);
        let total = grown.len() as u32;
        grown[..4].copy_from_slice(&total.to_ne_bytes());
        let nest_len = u16::from_ne_bytes([grown[20], grown[21]]) + 8;
        grown[20..22].copy_from_slice(&nest_len.to_ne_bytes());

        let parsed = IpvsMessage::<Service>::parse(&grown)
            .expect("an unknown attribute must not fail the parse");
        assert_eq!(parsed.body.other.len(), 1);
        msg.body.other = parsed.body.other.clone();
        assert_eq!(parsed, msg);
        let mut out = Vec::new();
        parsed.emit(&mut out);
        assert_eq!(common::hex(&out), common::hex(&grown), "type {kind:#06x}");
    }
}

/// Truncated input is an error, never a panic.
#[test]
fn truncated_replies_are_errors() {
    let bytes = fixture("dest_fwm4_gue_0");
    for cut in [0, 3, 16, 19, 24, 40, bytes.len() - 1] {
        let mut short = bytes[..cut].to_vec();
        if short.len() >= 4 {
            let l = short.len() as u32;
            short[..4].copy_from_slice(&l.to_ne_bytes());
        }
        let r = IpvsMessage::<Destination>::parse(&short, kube_ipvs_netlink::ipvs::Family::Inet);
        assert!(r.is_err(), "cut at {cut} parsed: {r:?}");
    }
}

/// The captured fixtures carry zeroed counters (nothing sent traffic through them), so this puts distinct values
/// into a captured destination, including 64-bit ones in STATS64 and the byte counters of STATS, and checks that
/// each counter survives emit and parse at the width the kernel uses for it.
#[test]
fn nonzero_counters_round_trip_at_kernel_widths() {
    let bytes = fixture("dest_tcp4_wlc_0");
    let mut msg = IpvsMessage::<Destination>::parse(&bytes, kube_ipvs_netlink::ipvs::Family::Inet)
        .expect("parse");
    let small = Stats {
        conns: 1,
        inpkts: 2,
        outpkts: 3,
        inbytes: 5_000_000_001,
        outbytes: 5_000_000_002,
        cps: 6,
        inpps: 7,
        outpps: 8,
        inbps: 9,
        outbps: 10,
    };
    let big = Stats {
        conns: 5_000_000_011,
        inpkts: 5_000_000_012,
        outpkts: 13,
        inbytes: 5_000_000_014,
        outbytes: 15,
        cps: 16,
        inpps: 17,
        outpps: 18,
        inbps: 5_000_000_019,
        outbps: 20,
    };
    msg.body.stats = Some(small);
    msg.body.stats64 = Some(big);
    msg.body.active_conns = 4;
    msg.body.inactive_conns = 5;
    msg.body.persist_conns = 6;
    let mut out = Vec::new();
    msg.emit(&mut out);
    assert_eq!(
        out.len(),
        bytes.len(),
        "the same attributes at the same widths"
    );
    let back = IpvsMessage::<Destination>::parse(&out, kube_ipvs_netlink::ipvs::Family::Inet)
        .expect("reparse");
    assert_eq!(back, msg);
}

/// A STATS counter the kernel keeps at 32 bits but a reply carried at 64 (the parse reads each
/// counter at the width it came with) is emitted at 64 rather than cut to `u32::MAX`: emit then
/// parse gives back what was parsed (found by the `ipvs_reply` fuzz target).
#[test]
fn a_wide_value_in_a_narrow_counter_survives_emit() {
    let bytes = fixture("dest_tcp4_wlc_0");
    let mut msg = IpvsMessage::<Destination>::parse(&bytes, kube_ipvs_netlink::ipvs::Family::Inet)
        .expect("parse");
    msg.body.stats = Some(Stats {
        inbps: 0x16_0000_0000,
        ..Stats::default()
    });
    let mut out = Vec::new();
    msg.emit(&mut out);
    let back = IpvsMessage::<Destination>::parse(&out, kube_ipvs_netlink::ipvs::Family::Inet)
        .expect("reparse");
    assert_eq!(back, msg);
}
