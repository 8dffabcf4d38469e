#![cfg(feature = "kernel-tests")]
//! The dummy interface and address handling, checked against iproute2's view of the same namespace.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::process::Command;

use kube_ipvs_netlink::Error;
use kube_ipvs_netlink::link::{DEFAULT_DUMMY, Rtnl, validate_ifname};

const IP: &str = "/usr/sbin/ip";

fn ip_cmd(args: &[&str]) -> String {
    let out = Command::new(IP).args(args).output().expect("spawn ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Addresses iproute2 lists, optionally for one device, from `ip -o addr show`.
fn ip_addrs(dev: Option<&str>) -> BTreeSet<IpAddr> {
    let mut args = vec!["-o", "addr", "show"];
    if let Some(d) = dev {
        args.extend(["dev", d]);
    }
    ip_cmd(&args)
        .lines()
        .filter_map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            let i = t.iter().position(|w| *w == "inet" || *w == "inet6")?;
            t[i + 1].split('/').next()?.parse().ok()
        })
        .collect()
}

fn addr(s: &str) -> IpAddr {
    s.parse().expect("literal")
}

#[test]
fn dummy_is_created_once_and_existing_links_are_left_alone() {
    let mut rt = Rtnl::new().expect("rtnetlink");
    assert_eq!(rt.link_index(DEFAULT_DUMMY).expect("lookup"), None);
    let index = rt.ensure_dummy(DEFAULT_DUMMY).expect("create");
    let details = ip_cmd(&["-d", "-o", "link", "show", DEFAULT_DUMMY]);
    assert!(
        details.starts_with(&format!("{index}: {DEFAULT_DUMMY}:")),
        "{details}"
    );
    assert!(details.contains("dummy"), "not a dummy: {details}");
    assert_eq!(rt.ensure_dummy(DEFAULT_DUMMY).expect("again"), index);

    ip_cmd(&["link", "add", "kube-ipvs1", "type", "dummy"]);
    ip_cmd(&["link", "set", "kube-ipvs1", "mtu", "1400"]);
    let before = ip_cmd(&["-o", "link", "show", "kube-ipvs1"]);
    let existing = rt.ensure_dummy("kube-ipvs1").expect("existing dummy");
    assert_eq!(
        ip_cmd(&["-o", "link", "show", "kube-ipvs1"]),
        before,
        "an existing link must be left alone"
    );
    assert!(before.starts_with(&format!("{existing}: ")));
    // An existing interface of another kind is also left alone rather than replaced.
    assert_eq!(rt.ensure_dummy("lo").expect("lo"), 1);
}

#[test]
fn addresses_are_added_and_removed_idempotently() {
    let mut rt = Rtnl::new().expect("rtnetlink");
    rt.ensure_dummy(DEFAULT_DUMMY).expect("create");
    let v4 = addr("10.96.0.10");
    let v6 = addr("fd00:10:96::10");
    for a in [v4, v6, v4, v6] {
        rt.add_address(DEFAULT_DUMMY, a).expect("add address");
    }
    let listed: BTreeSet<IpAddr> = rt
        .addresses(DEFAULT_DUMMY)
        .expect("list")
        .into_iter()
        .collect();
    assert_eq!(listed, BTreeSet::from([v4, v6]));
    assert_eq!(ip_addrs(Some(DEFAULT_DUMMY)), listed);
    let shown = ip_cmd(&["-o", "addr", "show", "dev", DEFAULT_DUMMY]);
    assert!(
        shown.contains("10.96.0.10/32") && shown.contains("fd00:10:96::10/128"),
        "{shown}"
    );

    let all = rt.local_addresses().expect("local addresses");
    let all_set: BTreeSet<IpAddr> = all.iter().map(|a| a.addr).collect();
    assert_eq!(all_set, ip_addrs(None));
    assert!(all_set.contains(&addr("127.0.0.1")));
    let lo = all
        .iter()
        .find(|a| a.addr == addr("127.0.0.1"))
        .expect("loopback address");
    assert_eq!((lo.ifindex, lo.prefix_len), (1, 8));

    for a in [v4, v6, v4, v6] {
        rt.del_address(DEFAULT_DUMMY, a).expect("remove address");
    }
    assert!(rt.addresses(DEFAULT_DUMMY).expect("list").is_empty());
    assert!(ip_addrs(Some(DEFAULT_DUMMY)).is_empty());
}

#[test]
fn many_addresses_are_added_in_batches_with_one_result_each() {
    let mut rt = Rtnl::new().expect("rtnetlink");
    rt.ensure_dummy(DEFAULT_DUMMY).expect("create");
    rt.add_address(DEFAULT_DUMMY, addr("10.96.0.7"))
        .expect("one already bound");
    // More than one batch, IPv4 and IPv6, one already bound, one twice, one refused.
    let mut addrs: Vec<IpAddr> = (0..2500u32)
        .map(|i| IpAddr::V4(std::net::Ipv4Addr::from(0x0a60_0000 + i)))
        .collect();
    addrs.push(addr("fd00:10:96::2a"));
    addrs.push(addr("10.96.0.3"));
    addrs.push(addr("224.0.0.1"));
    let results = rt
        .add_addresses(DEFAULT_DUMMY, &addrs)
        .expect("interface found");
    assert_eq!(results.len(), addrs.len());
    let refused: Vec<(IpAddr, String)> = addrs
        .iter()
        .zip(&results)
        .filter_map(|(a, r)| r.as_ref().err().map(|e| (*a, e.to_string())))
        .collect();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].0, addr("224.0.0.1"));
    assert!(
        refused[0].1.contains("224.0.0.1") && refused[0].1.contains(DEFAULT_DUMMY),
        "{}",
        refused[0].1
    );
    let want: BTreeSet<IpAddr> = addrs[..addrs.len() - 1].iter().copied().collect();
    assert_eq!(want.len(), 2501);
    assert_eq!(ip_addrs(Some(DEFAULT_DUMMY)), want);
    match rt.add_addresses("kube-ipvs9", &addrs[..1]) {
        Err(Error::Kernel { errno, .. }) => assert_eq!(errno, libc::ENODEV),
        other => panic!("expected ENODEV, got {other:?}"),
    }
}

#[test]
fn bad_names_and_missing_interfaces_are_clear_errors() {
    for bad in ["", "a/b", "has space", "x:y", "sixteen-chars-xx", ".", ".."] {
        let e = validate_ifname(bad).expect_err(bad);
        assert!(matches!(e, Error::Invalid { .. }), "{bad:?}: {e:?}");
    }
    validate_ifname("kube-ipvs0").expect("valid name");
    let mut rt = Rtnl::new().expect("rtnetlink");
    let e = rt.ensure_dummy("bad/name").expect_err("invalid name");
    assert!(e.to_string().contains("bad/name"), "{e}");
    let e = rt
        .add_address("nosuchdev0", addr("10.0.0.1"))
        .expect_err("missing interface");
    assert!(e.to_string().contains("nosuchdev0"), "{e}");
    rt.del_address("nosuchdev0", addr("10.0.0.1"))
        .expect("no interface, so nothing to remove");
    let e = rt
        .add_address("lo", addr("0.0.0.0"))
        .expect_err("unspecified address");
    assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
}

#[test]
fn delete_link_removes_only_the_named_interface() {
    let mut rt = Rtnl::new().expect("rtnetlink");
    assert!(
        !rt.delete_link(DEFAULT_DUMMY).expect("absent"),
        "nothing to delete yet"
    );
    rt.ensure_dummy(DEFAULT_DUMMY).expect("create");
    ip_cmd(&["link", "add", "kube-ipvs1", "type", "dummy"]);
    assert!(rt.delete_link(DEFAULT_DUMMY).expect("delete"));
    let links = ip_cmd(&["-o", "link", "show"]);
    assert!(!links.contains(&format!(" {DEFAULT_DUMMY}:")), "{links}");
    assert!(
        links.contains(" kube-ipvs1:"),
        "the other dummy stays: {links}"
    );
    assert_eq!(rt.link_index(DEFAULT_DUMMY).expect("lookup"), None);
}

/// Whether the kernel routes `a` as local (`ip route get`; a failure to route is not local).
fn is_local(a: &str) -> bool {
    let out = Command::new(IP)
        .args(["route", "get", a])
        .output()
        .expect("spawn ip");
    String::from_utf8_lossy(&out.stdout).starts_with("local ")
}

/// The addresses of our local routes (protocol 124) as iproute2 lists them, both families.
fn ip_local_routes() -> BTreeSet<IpAddr> {
    ["-4", "-6"]
        .iter()
        .flat_map(|family| {
            ip_cmd(&[family, "route", "show", "table", "local", "proto", "124"])
                .lines()
                .filter_map(|l| {
                    let mut words = l.split_whitespace();
                    (words.next() == Some("local")).then(|| words.next())?
                })
                .map(|a| a.parse().expect("an address"))
                .collect::<Vec<IpAddr>>()
        })
        .collect()
}

#[test]
fn local_routes_make_addresses_local_beside_bound_ones_and_only_ours_are_removed() {
    ip_cmd(&["link", "set", "lo", "up"]);
    let mut rt = Rtnl::new().expect("rtnetlink");
    let v4: Vec<IpAddr> = (1..=300)
        .map(|i| addr(&format!("10.97.{}.{}", i / 250, i % 250 + 1)))
        .collect();
    let mut all = v4.clone();
    all.push(addr("fd00:96::a"));
    all.push(addr("0.0.0.0"));
    let results = rt.add_local_routes(&all).expect("loopback found");
    assert_eq!(results.len(), all.len(), "one result each");
    assert!(results[..301].iter().all(Result::is_ok), "{results:?}");
    assert!(
        matches!(&results[301], Err(Error::Invalid { .. })),
        "not unicast: {:?}",
        results[301]
    );
    let expected: BTreeSet<IpAddr> = all[..301].iter().copied().collect();
    assert_eq!(ip_local_routes(), expected, "iproute2 sees our routes");
    let read: BTreeSet<IpAddr> = rt.local_routes().expect("dump").into_iter().collect();
    assert_eq!(read, expected, "and so does the dump");
    for a in ["10.97.0.2", "fd00:96::a"] {
        assert!(is_local(a), "{a} is local");
    }
    // Again: a route of ours already there is no error.
    assert!(
        rt.add_local_routes(&v4[..3])
            .expect("again")
            .iter()
            .all(Result::is_ok)
    );

    // Beside an address bound to an interface: both stay, and the address can go without the
    // ClusterIP stopping being local (the move from addresses to routes).
    rt.ensure_dummy(DEFAULT_DUMMY).expect("dummy");
    rt.add_address(DEFAULT_DUMMY, addr("10.97.0.2"))
        .expect("bind");
    rt.add_address(DEFAULT_DUMMY, addr("10.98.0.1"))
        .expect("bind another");
    assert!(ip_local_routes().contains(&addr("10.97.0.2")));
    rt.del_address(DEFAULT_DUMMY, addr("10.97.0.2"))
        .expect("unbind");
    assert!(is_local("10.97.0.2"), "still local");
    // An IPv6 address bound to the (down) interface gets the kernel's own local route a moment
    // after the add's answer, from the kernel's address work: it shows among the kernel's.
    rt.add_address(DEFAULT_DUMMY, addr("fd00:98::1"))
        .expect("bind IPv6");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !rt
        .kernel_local_routes_v6()
        .expect("dump")
        .contains(&addr("fd00:98::1"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no kernel route for the IPv6 address: {}",
            ip_cmd(&["-6", "route", "show", "table", "local"])
        );
        std::thread::yield_now();
    }
    assert!(
        !rt.kernel_local_routes_v6()
            .expect("dump")
            .contains(&addr("fd00:96::a")),
        "a route of ours is not the kernel's"
    );
    // Removing ours where only the kernel's route of a bound address exists leaves that.
    rt.del_local_route(addr("10.98.0.1"))
        .expect("nothing of ours");
    assert!(is_local("10.98.0.1"), "the address's route stays");
    assert!(ip_addrs(Some(DEFAULT_DUMMY)).contains(&addr("10.98.0.1")));

    for a in &all[..301] {
        rt.del_local_route(*a).expect("remove");
    }
    rt.del_local_route(all[0])
        .expect("again: nothing to remove is fine");
    assert_eq!(ip_local_routes(), BTreeSet::new());
    assert!(rt.local_routes().expect("dump").is_empty());
    assert!(!is_local("10.97.0.2"), "no longer local");
}
