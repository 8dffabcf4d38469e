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

/// Captures a service and destination with non-zero counters: a local connection to a VIP on `lo` passes IPVS's
/// LOCAL_OUT hook, so STATS and STATS64 carry real values of both widths.
#[test]
fn capture_stats_fixtures() {
    let status = std::process::Command::new("/usr/sbin/ip")
        .args(["addr", "add", "10.0.0.100/32", "dev", "lo"])
        .status()
        .expect("spawn ip");
    assert!(status.success());
    let mut ipvs = Ipvs::new().expect("open IPVS handle");
    let key = kube_ipvs_netlink::ipvs::ServiceKey::tcp(common::ip("10.0.0.100"), 80);
    ipvs.new_service(&Service::new(key, "rr"))
        .expect("add service");
    let d = Destination::new(
        common::ip("10.0.0.100"),
        80,
        kube_ipvs_netlink::ipvs::ForwardMethod::Local,
    );
    ipvs.new_dest(&key, &d).expect("add destination");
    let target: std::net::SocketAddr = "10.0.0.100:80".parse().expect("literal");
    for _ in 0..3 {
        // Nothing listens, so each attempt is refused; IPVS has scheduled and counted it by then.
        let r = std::net::TcpStream::connect_timeout(&target, std::time::Duration::from_secs(5));
        assert!(r.is_err(), "nothing listens on {target}");
    }
    let raw = ipvs.raw_services().expect("dump services");
    assert_eq!(raw.len(), 1);
    let msg = IpvsMessage::<Service>::parse(&raw[0]).expect("parse");
    let stats = msg.body.stats64.expect("stats64");
    assert!(
        stats.conns >= 1 && stats.inpkts >= 1 && stats.inbytes > 0,
        "{stats:?}"
    );
    let mut again = Vec::new();
    msg.emit(&mut again);
    assert_eq!(hex(&again), hex(&raw[0]));
    println!("FIXTURE service_tcp4_traffic {}", hex(&raw[0]));
    let raw = ipvs.raw_destinations(&key).expect("dump destinations");
    assert_eq!(raw.len(), 1);
    let msg = IpvsMessage::<Destination>::parse(&raw[0], key.family()).expect("parse");
    assert!(msg.body.stats64.expect("stats64").conns >= 1);
    let mut again = Vec::new();
    msg.emit(&mut again);
    assert_eq!(hex(&again), hex(&raw[0]));
    println!("FIXTURE dest_tcp4_traffic_0 {}", hex(&raw[0]));
}
