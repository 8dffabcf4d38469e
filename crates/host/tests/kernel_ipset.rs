//! Kernel tests (run in the VM by `cargo xtask vm-test kube-ipvs-host/kernel_ipset`) of the ipset
//! handle against the real kernel, cross-checked with the real `ipset` binary: a set our code
//! creates is listed by `ipset save` with its type, family and members; members `ipset add`
//! writes are read back by our dump; create, add and delete are idempotent; destroy removes the
//! set and an absent one is not an error.
//!
//! Each test runs in its own network namespace, so it starts with no sets.
#![cfg(feature = "kernel-tests")]

mod common;

use std::net::IpAddr;

use kube_ipvs_host::masquerade::Family;
use kube_ipvs_netlink::nfnl::ipset::{Entry, Ipset, Member, SET_TYPE, SET_V4, SET_V6, SetKind};

const IPSET: &str = "/usr/sbin/ipset";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("literal")
}

/// Runs the `ipset` binary with fixed arguments; its stdout, asserting success.
fn ipset(args: &[&str]) -> String {
    common::run_ok(IPSET, args)
}

/// `ipset save SET` lines: the create line and one add line per member, sorted.
fn saved(set: &str) -> Vec<String> {
    let mut lines: Vec<String> = ipset(&["save", set]).lines().map(str::to_owned).collect();
    lines.sort();
    lines
}

/// The hairpin members of a `hash:net,net` set, sorted (any other kind of member fails).
fn members(h: &mut Ipset, set: &str) -> Vec<Entry> {
    let mut m: Vec<Entry> = h
        .list(set)
        .expect("list")
        .expect("the set exists")
        .into_iter()
        .map(|m| match m {
            Member::NetNet(e) => e,
            other => panic!("{other} is not a net,net member"),
        })
        .collect();
    m.sort();
    m
}

#[test]
fn create_add_del_list_destroy_agree_with_the_ipset_binary() {
    let mut h = Ipset::new().expect("netlink");
    assert_eq!(h.list(SET_V4).expect("list"), None, "no set yet");
    h.create(SET_V4, Family::V4, SetKind::NetNet)
        .expect("create");
    h.create(SET_V4, Family::V4, SetKind::NetNet)
        .expect("create again is fine");
    h.create(SET_V6, Family::V6, SetKind::NetNet)
        .expect("create v6");
    assert_eq!(members(&mut h, SET_V4), []);

    let a = Entry::hairpin(ip("10.244.1.5"));
    let b = Entry::hairpin(ip("10.244.1.6"));
    h.add(SET_V4, &[a, b]).expect("add");
    h.add(SET_V4, &[a])
        .expect("adding a present member is fine");
    assert_eq!(members(&mut h, SET_V4), [a, b]);
    let save = saved(SET_V4);
    assert!(
        save.iter().any(
            |l| l.starts_with(&format!("create {SET_V4} {SET_TYPE} family inet "))
                && l.contains("maxelem 1048576")
        ),
        "{save:?}"
    );
    assert!(
        save.contains(&format!("add {SET_V4} 10.244.1.5,10.244.1.5")),
        "{save:?}"
    );
    assert!(
        save.contains(&format!("add {SET_V4} 10.244.1.6,10.244.1.6")),
        "{save:?}"
    );

    // What the binary adds, our dump reads, including a member that is not a hairpin one.
    ipset(&["add", SET_V4, "10.244.2.7,10.244.2.7"]);
    ipset(&["add", SET_V4, "10.0.0.0/8,10.244.2.7"]);
    let m = members(&mut h, SET_V4);
    assert!(m.contains(&Entry::hairpin(ip("10.244.2.7"))), "{m:?}");
    assert!(
        m.contains(&Entry {
            src: ip("10.0.0.0"),
            src_prefix: 8,
            dst: ip("10.244.2.7"),
            dst_prefix: 32,
        }),
        "{m:?}"
    );
    assert_eq!(m.len(), 4);

    h.del(SET_V4, &[a]).expect("del");
    h.del(SET_V4, &[a])
        .expect("deleting an absent member is fine");
    let m = members(&mut h, SET_V4);
    assert!(!m.contains(&a) && m.contains(&b), "{m:?}");

    // IPv6.
    let c = Entry::hairpin(ip("fd00:10:244::5"));
    h.add(SET_V6, &[c]).expect("add v6");
    assert_eq!(members(&mut h, SET_V6), [c]);
    let save6 = saved(SET_V6);
    assert!(
        save6
            .iter()
            .any(|l| l.starts_with(&format!("create {SET_V6} {SET_TYPE} family inet6 "))),
        "{save6:?}"
    );
    assert!(
        save6.contains(&format!("add {SET_V6} fd00:10:244::5,fd00:10:244::5")),
        "{save6:?}"
    );
    // An IPv4 member in the IPv6 set is refused, with the set and member named.
    let e = h
        .add(SET_V6, &[Entry::hairpin(ip("10.1.1.1"))])
        .expect_err("family mismatch");
    assert!(e.to_string().contains(SET_V6), "{e}");
    assert!(e.to_string().contains("10.1.1.1,10.1.1.1"), "{e}");

    assert!(h.destroy(SET_V4).expect("destroy"));
    assert!(!h.destroy(SET_V4).expect("destroying an absent set is fine"));
    assert_eq!(h.list(SET_V4).expect("list"), None);
    assert!(h.destroy(SET_V6).expect("destroy v6"));
    assert_eq!(ipset(&["list", "-n"]).trim(), "");
}

#[test]
fn many_members_in_batches_and_a_set_of_another_type_is_an_error() {
    let mut h = Ipset::new().expect("netlink");
    h.create(SET_V4, Family::V4, SetKind::NetNet)
        .expect("create");
    // More members than one batch and than the kernel's default maxelem of one batch's acks.
    let all: Vec<Entry> = (0..3000u32)
        .map(|i| Entry::hairpin(IpAddr::V4(std::net::Ipv4Addr::from(0x0af4_0000 + i))))
        .collect();
    h.add(SET_V4, &all).expect("add 3000");
    let mut want = all.clone();
    want.sort();
    assert_eq!(members(&mut h, SET_V4), want);
    let listed = ipset(&["list", SET_V4]);
    assert!(listed.contains("Number of entries: 3000"), "{listed}");
    h.del(SET_V4, &all[..2990]).expect("del");
    assert_eq!(members(&mut h, SET_V4), want[2990..]);
    assert!(h.destroy(SET_V4).expect("destroy"));

    // A set of our name but another type: create says so, naming the set.
    ipset(&["create", SET_V4, "hash:ip"]);
    let e = h
        .create(SET_V4, Family::V4, SetKind::NetNet)
        .expect_err("another type");
    assert_eq!(e.errno(), Some(17), "{e}");
    assert!(e.to_string().contains(SET_V4), "{e}");
    assert!(e.to_string().contains("another type"), "{e}");
}

/// Prints the kernel's list replies for two known sets as hex, one datagram a line, for the
/// checked-in fixtures `tests/fixtures/ipset_list_v{4,6}.hex` (the unit tests in `ipset.rs`
/// parse them); and checks what our parse of them says against `ipset save`.
#[test]
fn list_replies_for_the_fixtures() {
    let mut h = Ipset::new().expect("netlink");
    for (set, family, ours, theirs, v) in [
        (
            SET_V4,
            Family::V4,
            vec![ip("10.244.1.5"), ip("10.244.1.6")],
            "10.0.0.0/8,10.244.2.7",
            "4",
        ),
        (
            SET_V6,
            Family::V6,
            vec![ip("fd00:10:244::5")],
            "fd00::/8,fd00:10:244::7",
            "6",
        ),
    ] {
        h.create(set, family, SetKind::NetNet).expect("create");
        let entries: Vec<Entry> = ours.iter().map(|a| Entry::hairpin(*a)).collect();
        h.add(set, &entries).expect("add");
        ipset(&["add", set, theirs]);
        let mut raw = Vec::new();
        let got = h
            .list_capturing(set, Some(&mut raw))
            .expect("list")
            .expect("the set exists");
        for d in &raw {
            let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
            println!("##ipset-fixture v{v} {hex}");
        }
        let mut got: Vec<String> = got.iter().map(|e| format!("add {set} {e}")).collect();
        got.sort();
        let want: Vec<String> = saved(set)
            .into_iter()
            .filter(|l| l.starts_with("add "))
            .collect();
        assert_eq!(got, want);
    }
}

/// The cost the agent pays at 100,000 local endpoints (bench e2e's largest size), printed for
/// the record: filling the set, reading it back, and one Service's delta, against one
/// `iptables-restore` of the per-endpoint rules that the set replaces.
#[test]
fn hundred_thousand_members_cost() {
    use kube_ipvs_host::masquerade::{Backend, Config, Hairpin, Masquerade};
    use std::time::Instant;

    let n = 100_000u32;
    let addrs: Vec<IpAddr> = (0..n)
        .map(|i| IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i)))
        .collect();
    let all: Vec<Entry> = addrs.iter().map(|a| Entry::hairpin(*a)).collect();
    let mut h = Ipset::new().expect("netlink");
    h.create(SET_V4, Family::V4, SetKind::NetNet)
        .expect("create");
    let t = Instant::now();
    h.add(SET_V4, &all).expect("add");
    let fill = t.elapsed();
    let t = Instant::now();
    let listed = h.list(SET_V4).expect("list").expect("exists");
    let list = t.elapsed();
    assert_eq!(listed.len(), n as usize);
    // One Service's endpoints move: ten out, ten in.
    let t = Instant::now();
    h.del(SET_V4, &all[..10]).expect("del");
    let fresh: Vec<Entry> = (0..10u32)
        .map(|i| Entry::hairpin(IpAddr::V4(std::net::Ipv4Addr::from(0x0b00_0000 + i))))
        .collect();
    h.add(SET_V4, &fresh).expect("add");
    let delta = t.elapsed();

    let rules = |hairpin| {
        let m = Masquerade::new(Config {
            hairpin,
            backend: Backend::Nft,
            ..Config::default()
        })
        .expect("config");
        let t = Instant::now();
        m.ensure().expect("ensure");
        t.elapsed()
    };
    let set_rules = rules(Hairpin::Set);
    let endpoint_rules = rules(Hairpin::Endpoints(addrs));
    println!(
        "##ipset-cost members {n}: fill {fill:?}, list {list:?}, delta of 20 {delta:?}; \
         iptables-restore with the set rule {set_rules:?}, with {n} endpoint rules \
         {endpoint_rules:?}"
    );
    assert!(h.list(SET_V4).expect("list").expect("exists").len() == n as usize);
}

/// The filter sets' kinds (`hash:ip`, `hash:ip,port`, `hash:ip,port,net`, `bitmap:port`), each
/// created by our code with the names and types of `kube_ipvs_host::filter`, filled with
/// members of both families and every protocol, and cross-checked both ways with the `ipset`
/// binary: `ipset save` prints what we added, and what `ipset add` writes we read back.
#[test]
fn every_filter_set_kind_agrees_with_the_ipset_binary() {
    use kube_ipvs_host::sets::{self, ServiceSet};
    use kube_ipvs_netlink::nfnl::ipset::Member;

    let mut h = Ipset::new().expect("netlink");
    for (name, family, kind) in sets::sets() {
        h.create(name, family, kind).expect("create");
        h.create(name, family, kind).expect("create again is fine");
    }
    let port = |addr: &str, protocol: u8, port: u16| Member::IpPort {
        addr: ip(addr),
        protocol,
        port,
    };
    let cases: Vec<(&str, Vec<Member>, Vec<&str>)> = vec![
        (
            ServiceSet::Addresses.name(Family::V4),
            vec![Member::Ip(ip("10.96.0.1"))],
            vec!["add KUBE-IPVS-ADDRS 10.96.0.1"],
        ),
        (
            ServiceSet::Services.name(Family::V4),
            vec![
                port("10.96.0.1", 6, 443),
                port("10.96.0.10", 17, 53),
                port("10.96.0.10", 132, 9),
            ],
            vec![
                "add KUBE-IPVS-SERVICES 10.96.0.1,tcp:443",
                "add KUBE-IPVS-SERVICES 10.96.0.10,sctp:9",
                "add KUBE-IPVS-SERVICES 10.96.0.10,udp:53",
            ],
        ),
        (
            ServiceSet::Services.name(Family::V6),
            vec![port("fd00::10", 6, 80)],
            vec!["add KUBE-IPVS-SERVICES6 fd00::10,tcp:80"],
        ),
        (
            ServiceSet::LbSources.name(Family::V4),
            vec![Member::IpPortNet {
                addr: ip("203.0.113.7"),
                protocol: 6,
                port: 80,
                net: ip("198.51.100.0"),
                prefix: 24,
            }],
            vec!["add KUBE-IPVS-LB-SRC 203.0.113.7,tcp:80,198.51.100.0/24"],
        ),
        (
            ServiceSet::HealthCheckPorts.name(Family::V4),
            vec![Member::Port(32080), Member::Port(30000)],
            vec![
                "add KUBE-IPVS-HC-PORTS 30000",
                "add KUBE-IPVS-HC-PORTS 32080",
            ],
        ),
        (
            ServiceSet::LocalMarks.name(Family::V4),
            vec![Member::IpPortMark {
                addr: ip("192.168.56.10"),
                protocol: 6,
                port: 30080,
                mark: 0x10_0000,
            }],
            vec!["add KUBE-IPVS-LOCAL-MARKS 192.168.56.10,tcp:30080 skbmark 0x100000"],
        ),
        (
            ServiceSet::LocalMarks.name(Family::V6),
            vec![Member::IpPortMark {
                addr: ip("fd00::10"),
                protocol: 132,
                port: 80,
                mark: 0x3ff0_0000,
            }],
            vec!["add KUBE-IPVS-LOCAL-MARKS6 fd00::10,sctp:80 skbmark 0x3ff00000"],
        ),
    ];
    for (name, members, want) in cases {
        h.add(name, &members).expect("add");
        let mut have: Vec<String> = saved(name)
            .into_iter()
            .filter(|l| l.starts_with("add "))
            .collect();
        have.sort();
        assert_eq!(have, want, "{name} as ipset saves it");
        let mut back = h.list(name).expect("list").expect("exists");
        back.sort();
        let mut members = members;
        members.sort();
        assert_eq!(back, members, "{name} read back");
    }
    // The types as ipset names them; the port bitmap covers every port.
    let create = |name: &str| {
        saved(name)
            .into_iter()
            .find(|l| l.starts_with("create "))
            .expect("create line")
    };
    assert!(
        create("KUBE-IPVS-ADDRS6").starts_with("create KUBE-IPVS-ADDRS6 hash:ip family inet6 ")
    );
    assert!(
        create("KUBE-IPVS-LB-FW").starts_with("create KUBE-IPVS-LB-FW hash:ip,port family inet ")
    );
    assert!(
        create("KUBE-IPVS-LB-SRC6")
            .starts_with("create KUBE-IPVS-LB-SRC6 hash:ip,port,net family inet6 ")
    );
    assert!(
        create("KUBE-IPVS-HC-PORTS")
            .starts_with("create KUBE-IPVS-HC-PORTS bitmap:port range 0-65535")
    );

    assert!(
        create("KUBE-IPVS-LOCAL-MARKS")
            .starts_with("create KUBE-IPVS-LOCAL-MARKS hash:ip,port family inet ")
            && create("KUBE-IPVS-LOCAL-MARKS").contains(" skbinfo")
    );

    // What the ipset binary writes, we read; a mark under a mask is no mapping of ours.
    ipset(&["add", "KUBE-IPVS-LB-SRC", "203.0.113.8,udp:53,192.0.2.0/25"]);
    ipset(&[
        "add",
        "KUBE-IPVS-LOCAL-MARKS",
        "10.0.0.9,udp:53",
        "skbmark",
        "0x200000",
    ]);
    ipset(&[
        "add",
        "KUBE-IPVS-LOCAL-MARKS",
        "10.0.0.8,udp:53",
        "skbmark",
        "0x5/0xff",
    ]);
    let marks = h
        .list("KUBE-IPVS-LOCAL-MARKS")
        .expect("list")
        .expect("exists");
    assert!(marks.contains(&Member::IpPortMark {
        addr: ip("10.0.0.9"),
        protocol: 17,
        port: 53,
        mark: 0x20_0000,
    }));
    assert!(marks.contains(&Member::IpPortMark {
        addr: ip("10.0.0.8"),
        protocol: 17,
        port: 53,
        mark: 0,
    }));
    // Adding a present member with another mark replaces its mark.
    let moved = Member::IpPortMark {
        addr: ip("10.0.0.9"),
        protocol: 17,
        port: 53,
        mark: 0x30_0000,
    };
    h.add("KUBE-IPVS-LOCAL-MARKS", &[moved]).expect("re-add");
    assert!(
        saved("KUBE-IPVS-LOCAL-MARKS")
            .contains(&"add KUBE-IPVS-LOCAL-MARKS 10.0.0.9,udp:53 skbmark 0x300000".to_owned())
    );
    ipset(&["add", "KUBE-IPVS-ADDRS", "10.96.0.2"]);
    let lb = h.list("KUBE-IPVS-LB-SRC").expect("list").expect("exists");
    assert!(lb.contains(&Member::IpPortNet {
        addr: ip("203.0.113.8"),
        protocol: 17,
        port: 53,
        net: ip("192.0.2.0"),
        prefix: 25,
    }));
    let addrs = h.list("KUBE-IPVS-ADDRS").expect("list").expect("exists");
    assert!(addrs.contains(&Member::Ip(ip("10.96.0.2"))));

    // Deletes, including an absent member, and a member of the wrong family is refused by the
    // kernel with the set named.
    h.del(
        "KUBE-IPVS-HC-PORTS",
        &[Member::Port(30000), Member::Port(1)],
    )
    .expect("del");
    assert_eq!(
        h.list("KUBE-IPVS-HC-PORTS").expect("list").expect("exists"),
        [Member::Port(32080)]
    );
    let err = h
        .add("KUBE-IPVS-SERVICES", &[port("fd00::1", 6, 80)])
        .expect_err("an IPv6 member in an IPv4 set");
    assert!(err.to_string().contains("KUBE-IPVS-SERVICES"), "{err}");
    for (name, _, _) in sets::sets() {
        assert!(h.destroy(name).expect("destroy"), "{name}");
    }
}
