#![cfg(feature = "kernel-tests")]
//! Address notifications: the events `AddressWatch` reports when iproute2 adds and removes addresses.

use std::net::IpAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use kube_ipvs_netlink::link::{AddressEvent, AddressWatch, Rtnl};

const IP: &str = "/usr/sbin/ip";

fn ip_cmd(args: &[&str]) {
    let out = Command::new(IP).args(args).output().expect("spawn ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits for the first event `want` accepts, skipping others (the kernel also announces e.g. IPv6 link-local
/// addresses of links coming up), and fails after a deadline so the test cannot hang.
fn expect_event(
    watch: &mut AddressWatch,
    what: &str,
    want: impl Fn(&AddressEvent) -> bool,
) -> AddressEvent {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no {what} within 10 s; saw {seen:?}");
        match watch.recv_timeout(left).expect("receive") {
            Some(e) if want(&e) => return e,
            Some(e) => seen.push(e),
            None => {}
        }
    }
}

#[test]
fn added_and_removed_addresses_are_reported() {
    let mut watch = AddressWatch::subscribe().expect("subscribe");
    ip_cmd(&["link", "add", "watch0", "type", "dummy"]);
    ip_cmd(&["link", "set", "watch0", "up"]);
    let index = Rtnl::new()
        .expect("rtnetlink")
        .link_index("watch0")
        .expect("lookup")
        .expect("watch0 exists");

    let v4: IpAddr = "192.168.77.10".parse().expect("literal");
    ip_cmd(&["addr", "add", "192.168.77.10/24", "dev", "watch0"]);
    let added = expect_event(
        &mut watch,
        "IPv4 add",
        |e| matches!(e, AddressEvent::Added { addr, .. } if *addr == v4),
    );
    assert_eq!(
        added,
        AddressEvent::Added {
            index,
            addr: v4,
            prefix: 24
        }
    );
    ip_cmd(&["addr", "del", "192.168.77.10/24", "dev", "watch0"]);
    let removed = expect_event(
        &mut watch,
        "IPv4 removal",
        |e| matches!(e, AddressEvent::Removed { addr, .. } if *addr == v4),
    );
    assert_eq!(
        removed,
        AddressEvent::Removed {
            index,
            addr: v4,
            prefix: 24
        }
    );

    let v6: IpAddr = "fd00:77::10".parse().expect("literal");
    ip_cmd(&["addr", "add", "fd00:77::10/64", "dev", "watch0", "nodad"]);
    let added = expect_event(
        &mut watch,
        "IPv6 add",
        |e| matches!(e, AddressEvent::Added { addr, .. } if *addr == v6),
    );
    assert_eq!(
        added,
        AddressEvent::Added {
            index,
            addr: v6,
            prefix: 64
        }
    );
    ip_cmd(&["addr", "del", "fd00:77::10/64", "dev", "watch0"]);
    expect_event(
        &mut watch,
        "IPv6 removal",
        |e| matches!(e, AddressEvent::Removed { addr, index: i, prefix: 64 } if *addr == v6 && *i == index),
    );
}

#[test]
fn a_quiet_subscription_times_out() {
    let mut watch = AddressWatch::subscribe().expect("subscribe");
    let start = Instant::now();
    assert_eq!(
        watch
            .recv_timeout(Duration::from_millis(200))
            .expect("receive"),
        None
    );
    assert!(start.elapsed() >= Duration::from_millis(150));
}
