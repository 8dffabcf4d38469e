#![cfg(feature = "kernel-tests")]
//! Programs one service of every kind through the crate, reads the kernel's raw dump replies, checks that they
//! parse to what was programmed and re-emit to the same bytes, and prints each as a `FIXTURE <name> <hex>` line.
//!
//! Regenerate the checked-in fixtures with `crates/netlink/tests/fixtures/extract.sh` (see its header).

mod common;

use common::{Case, cases, hex, same_dest, same_service};
use kube_ipvs_netlink::ipvs::{Destination, Ipvs, IpvsMessage, Service};

#[test]
fn capture_fixtures() {
    let mut ipvs = Ipvs::new().expect("open IPVS handle");
    let cases: Vec<Case> = cases();
    for (i, r) in ipvs.apply(&common::program(&cases)).into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("request {i}: {e}"));
    }

    let raw = ipvs.raw_services().expect("dump services");
    assert_eq!(raw.len(), cases.len());
    for bytes in &raw {
        let msg = IpvsMessage::<Service>::parse(bytes).expect("parse service message");
        let case = cases
            .iter()
            .find(|c| c.service.key == msg.body.key)
            .unwrap_or_else(|| panic!("dumped service {} was never added", msg.body.key));
        same_service(&msg.body, &case.service);
        let mut again = Vec::new();
        msg.emit(&mut again);
        assert_eq!(
            hex(&again),
            hex(bytes),
            "service {} re-emits differently",
            case.name
        );
        println!("FIXTURE service_{} {}", case.name, hex(bytes));

        let raw_dests = ipvs
            .raw_destinations(&case.service.key)
            .expect("dump destinations");
        assert_eq!(
            raw_dests.len(),
            case.dests.len(),
            "destinations of {}",
            case.name
        );
        for bytes in &raw_dests {
            let msg = IpvsMessage::<Destination>::parse(bytes, case.service.key.family())
                .expect("parse dest");
            let (j, want) = case
                .dests
                .iter()
                .enumerate()
                .find(|(_, d)| d.addr == msg.body.addr && d.port == msg.body.port)
                .unwrap_or_else(|| panic!("dumped destination {} was never added", msg.body.addr));
            same_dest(&msg.body, want);
            let mut again = Vec::new();
            msg.emit(&mut again);
            assert_eq!(
                hex(&again),
                hex(bytes),
                "destination {} of {} re-emits differently",
                j,
                case.name
            );
            println!("FIXTURE dest_{}_{} {}", case.name, j, hex(bytes));
        }
    }
}
