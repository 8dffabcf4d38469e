//! Kernel tests (run in the VM by `cargo xtask vm-test kube-ipvs-host/kernel_masquerade`) of the
//! masquerade helper against real `iptables-restore` on both backends: `ensure()` is idempotent,
//! writes what the config asks for, leaves foreign rules alone, and `cleanup()` leaves the `nat`
//! table as it found it. Then traffic: a client in a second namespace reaches an IPVS virtual
//! server whose masquerade real server is local, and the `MASQUERADE` rule counts the packets;
//! hairpin is decided by endpoint rules, the hairpin ipset's members, or the Pod CIDR.
//!
//! Each test runs in its own network namespace, so iptables tables start empty.
#![cfg(feature = "kernel-tests")]

mod common;

use std::net::IpAddr;
use std::process::Command;

use common::{run, run_ok as ok};

use kube_ipvs_host::masquerade::{
    Backend, Config, Family, Hairpin, Masquerade, cleanup_everywhere,
};

fn tool(backend: Backend, family: Family, what: &str) -> String {
    let prefix = match family {
        Family::V4 => "iptables",
        Family::V6 => "ip6tables",
    };
    let suffix = match backend {
        Backend::Legacy => "-legacy",
        Backend::Nft => "-nft",
        Backend::Auto => "",
    };
    format!("{}/{prefix}{suffix}{what}", xtables_dir())
}

/// A directory with every iptables tool name for both backends, linked to the multi-call
/// binaries (which dispatch on their name). The guest ships `ip6tables-legacy`/`-nft` but not
/// their `-save`/`-restore` names, so the IPv6 tests reach them through here; it also exercises
/// `Config::bin_dir`.
fn xtables_dir() -> &'static str {
    const DIR: &str = "/tmp/kube-ipvs-masq-xtables";
    static MADE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    MADE.get_or_init(|| {
        let _ = std::fs::create_dir_all(DIR);
        for (backend, multi) in [
            ("legacy", "/usr/sbin/xtables-legacy-multi"),
            ("nft", "/usr/sbin/xtables-nft-multi"),
        ] {
            for family in ["iptables", "ip6tables"] {
                for what in ["", "-save", "-restore"] {
                    let link = format!("{DIR}/{family}-{backend}{what}");
                    let _ = std::fs::remove_file(&link);
                    std::os::unix::fs::symlink(multi, &link).expect("link xtables tool");
                }
            }
        }
    });
    DIR
}

/// `iptables-save -t nat` without its comment lines and with counters zeroed, so two saves of
/// the same rules compare equal.
fn nat(backend: Backend, family: Family) -> String {
    let save = ok(&tool(backend, family, "-save"), &["-t", "nat"]);
    save.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.rsplit_once(" [") {
            Some((head, tail)) if l.starts_with(':') && tail.ends_with(']') => {
                format!("{head} [0:0]")
            }
            _ => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn cidr(s: &str) -> kube_ipvs_diff::Cidr {
    s.parse().expect("test CIDR")
}

fn config(backend: Backend) -> Config {
    Config {
        families: vec![Family::V4],
        cluster_cidrs: vec![cidr("10.244.0.0/16")],
        node_ips: vec!["192.0.2.10".parse().expect("ip")],
        hairpin: Hairpin::Endpoints(vec!["10.244.1.5".parse().expect("ip")]),
        backend,
        ..Config::default()
    }
}

fn ensure_twice_is_idempotent_on(backend: Backend) {
    // A foreign rule that must survive both ensure() and cleanup().
    ok(
        &tool(backend, Family::V4, ""),
        &[
            "-w",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-o",
            "lo",
            "-j",
            "RETURN",
        ],
    );
    let before = nat(backend, Family::V4);
    let m = Masquerade::new(config(backend)).expect("config");
    assert_eq!(m.backend(), backend);
    m.ensure().expect("first ensure");
    let first = nat(backend, Family::V4);
    m.ensure().expect("second ensure");
    let second = nat(backend, Family::V4);
    assert_eq!(first, second, "a second ensure() changed the table");
    assert_eq!(
        first.matches("-j KUBE-IPVS-POSTROUTING").count(),
        1,
        "exactly one jump:\n{first}"
    );
    assert!(first.contains("-A POSTROUTING -o lo -j RETURN"), "{first}");
    for want in [
        "-A KUBE-IPVS-POSTROUTING -m mark ! --mark 0x4000/0x4000 -m ipvs --vdir ORIGINAL --vmethod MASQ -j KUBE-IPVS-MASQ",
        "-A KUBE-IPVS-MASQ -s 10.244.0.0/16 -j RETURN",
        "--vaddr 192.0.2.10",
        "-s 10.244.1.5/32 -d 10.244.1.5/32",
        "-j MASQUERADE --random-fully",
    ] {
        assert!(first.contains(want), "missing {want:?} in\n{first}");
    }

    let removed = m.cleanup().expect("cleanup");
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0].jumps, 1);
    // The chains of the set-based marks are declared (empty) without the sets too, so a node
    // that loses ipset support is left with no stale marks.
    assert_eq!(
        removed[0].chains,
        [
            "KUBE-IPVS-POSTROUTING",
            "KUBE-IPVS-MASQ",
            "KUBE-IPVS-SERVICES",
            "KUBE-IPVS-CLUSTER-MASQ"
        ]
    );
    assert_eq!(nat(backend, Family::V4), before, "cleanup() left a trace");
    // Nothing left to remove is not an error, and removes nothing.
    let again = m.cleanup().expect("second cleanup");
    assert_eq!((again[0].jumps, again[0].chains.len()), (0, 0));
}

#[test]
fn ensure_twice_is_idempotent_legacy() {
    ensure_twice_is_idempotent_on(Backend::Legacy);
}

#[test]
fn ensure_twice_is_idempotent_nft() {
    ensure_twice_is_idempotent_on(Backend::Nft);
}

#[test]
fn auto_backend_follows_iptables_version() {
    let version = ok("/usr/sbin/iptables", &["--version"]);
    let m = Masquerade::new(Config {
        backend: Backend::Auto,
        ..config(Backend::Auto)
    })
    .expect("config");
    let want = if version.contains("(nf_tables)") {
        Backend::Nft
    } else {
        Backend::Legacy
    };
    assert_eq!(m.backend(), want, "{version}");
}

#[test]
fn masquerade_all_replaces_the_cluster_cidr_rules() {
    let m = Masquerade::new(config(Backend::Nft)).expect("config");
    m.ensure().expect("ensure");
    assert!(nat(Backend::Nft, Family::V4).contains("outside cluster-cidr"));
    let all = Masquerade::new(Config {
        masquerade_all: true,
        ..config(Backend::Nft)
    })
    .expect("config");
    all.ensure().expect("ensure masquerade-all");
    let table = nat(Backend::Nft, Family::V4);
    assert!(table.contains("masquerade-all"), "{table}");
    assert!(!table.contains("outside cluster-cidr"), "{table}");
    assert!(!table.contains("10.244.0.0/16"), "{table}");
    assert_eq!(table.matches("-j KUBE-IPVS-POSTROUTING").count(), 1);
}

#[test]
fn dual_stack_programs_both_families_and_cleanup_everywhere_removes_them() {
    let m = Masquerade::new(Config {
        families: vec![Family::V4, Family::V6],
        cluster_cidrs: vec![cidr("10.244.0.0/16"), cidr("fd00:244::/56")],
        node_ips: vec![
            "192.0.2.10".parse().expect("ip"),
            "2001:db8::10".parse().expect("ip"),
        ],
        backend: Backend::Legacy,
        bin_dir: Some(xtables_dir().into()),
        ..Config::default()
    })
    .expect("config");
    m.ensure().expect("ensure");
    let v6 = nat(Backend::Legacy, Family::V6);
    assert!(
        v6.contains("-A KUBE-IPVS-MASQ -s fd00:244::/56 -j RETURN"),
        "{v6}"
    );
    assert!(v6.contains("--vaddr 2001:db8::10"), "{v6}");
    assert!(!v6.contains("10.244"), "{v6}");
    // A chain of ours left behind in the other backend is found too.
    ok(
        &tool(Backend::Nft, Family::V4, ""),
        &["-w", "-t", "nat", "-N", "KUBE-IPVS-MASQ"],
    );

    let removed =
        cleanup_everywhere(Some(std::path::Path::new(xtables_dir()))).expect("cleanup everywhere");
    let total: usize = removed.iter().map(|r| r.chains.len()).sum();
    assert_eq!(total, 9, "{removed:?}");
    for (backend, family) in [
        (Backend::Legacy, Family::V4),
        (Backend::Legacy, Family::V6),
        (Backend::Nft, Family::V4),
    ] {
        let table = nat(backend, family);
        assert!(
            !table.contains("KUBE-IPVS"),
            "{backend:?} {family:?}:\n{table}"
        );
    }
}

/// The `pkts` counter of our MASQUERADE rule.
fn masquerade_packets(backend: Backend) -> u64 {
    let out = ok(
        &tool(backend, Family::V4, ""),
        &[
            "-w",
            "-t",
            "nat",
            "-L",
            "KUBE-IPVS-POSTROUTING",
            "-n",
            "-v",
            "-x",
        ],
    );
    out.lines()
        .find(|l| l.contains("MASQUERADE"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no MASQUERADE rule in\n{out}"))
}

/// A client (192.168.77.2) and a real server (192.168.77.3) share a second namespace behind a
/// veth; this namespace holds the virtual server 10.96.0.10:80 with that masquerade real server.
/// The connection only works if it is masqueraded (else the server answers the client directly,
/// bypassing IPVS's reverse NAT), the server sees this namespace's address 192.168.77.1 as its
/// peer, and the MASQUERADE rule's packet counter grows.
#[test]
fn traffic_from_outside_the_cluster_cidr_is_masqueraded() {
    let ip = "/usr/sbin/ip";
    let ns = "masq-peer";
    let _ = run(ip, &["netns", "del", ns]);
    ok(ip, &["netns", "add", ns]);
    ok(
        ip,
        &["link", "add", "mq0", "type", "veth", "peer", "name", "mq1"],
    );
    ok(ip, &["link", "set", "mq1", "netns", ns]);
    ok(ip, &["addr", "add", "192.168.77.1/24", "dev", "mq0"]);
    ok(ip, &["link", "set", "mq0", "up"]);
    ok(ip, &["addr", "add", "10.96.0.10/32", "dev", "lo"]);
    ok(
        ip,
        &["-n", ns, "addr", "add", "192.168.77.2/24", "dev", "mq1"],
    );
    ok(
        ip,
        &["-n", ns, "addr", "add", "192.168.77.3/24", "dev", "mq1"],
    );
    ok(ip, &["-n", ns, "link", "set", "mq1", "up"]);
    ok(ip, &["-n", ns, "link", "set", "lo", "up"]);
    ok(
        ip,
        &[
            "-n",
            ns,
            "route",
            "add",
            "10.96.0.10/32",
            "via",
            "192.168.77.1",
            "src",
            "192.168.77.2",
        ],
    );
    // Replies de-masqueraded to the client are forwarded back out of mq0.
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1\n").expect("ip_forward");
    let ipvsadm = std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".into());
    ok(&ipvsadm, &["-A", "-t", "10.96.0.10:80", "-s", "rr"]);
    ok(
        &ipvsadm,
        &["-a", "-t", "10.96.0.10:80", "-r", "192.168.77.3:8080", "-m"],
    );

    let m = Masquerade::new(config(Backend::Nft)).expect("config");
    m.ensure().expect("ensure");
    let vs_conntrack = std::fs::read_to_string("/proc/sys/net/ipv4/vs/conntrack").expect("sysctl");
    assert_eq!(vs_conntrack.trim(), "1");
    let before = masquerade_packets(Backend::Nft);

    // The server tells each client the address it sees. The client retries until the server
    // listens (a refused connection is retried), so no sleep is needed.
    let mut server = Command::new(ip)
        .args([
            "netns",
            "exec",
            ns,
            "socat",
            "TCP-LISTEN:8080,bind=192.168.77.3,reuseaddr",
            "SYSTEM:echo $SOCAT_PEERADDR",
        ])
        .spawn()
        .expect("start server");
    let client = run(
        ip,
        &[
            "netns",
            "exec",
            ns,
            "socat",
            "-T",
            "10",
            "-u",
            "TCP:10.96.0.10:80,bind=192.168.77.2,retry=100,interval=0.1",
            "STDOUT",
        ],
    );
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        client.status.success(),
        "client could not connect through IPVS"
    );
    let peer = String::from_utf8_lossy(&client.stdout).trim().to_owned();
    let after = masquerade_packets(Backend::Nft);
    println!("masquerade packets {before} -> {after}, real server saw {peer}");
    assert_eq!(
        peer, "192.168.77.1",
        "the server saw the client unmasqueraded"
    );
    assert!(after > before, "MASQUERADE counted no packet");
    let _ = run(ip, &["netns", "del", ns]);
}

/// Two UDP flows from a second namespace through two virtual servers to two masquerade real
/// servers; deleting by one endpoint removes that flow's conntrack entry and keeps the other.
#[test]
fn udp_conntrack_entries_of_a_removed_endpoint_are_deleted() {
    use kube_ipvs_netlink::nfnl::conntrack;

    let ip = "/usr/sbin/ip";
    let ns = "ct-peer";
    let _ = run(ip, &["netns", "del", ns]);
    ok(ip, &["netns", "add", ns]);
    ok(
        ip,
        &["link", "add", "ct0", "type", "veth", "peer", "name", "ct1"],
    );
    ok(ip, &["link", "set", "ct1", "netns", ns]);
    ok(ip, &["addr", "add", "192.168.78.1/24", "dev", "ct0"]);
    ok(ip, &["link", "set", "ct0", "up"]);
    ok(ip, &["addr", "add", "10.96.0.53/32", "dev", "lo"]);
    ok(ip, &["addr", "add", "10.96.0.54/32", "dev", "lo"]);
    for a in ["192.168.78.2/24", "192.168.78.3/24", "192.168.78.4/24"] {
        ok(ip, &["-n", ns, "addr", "add", a, "dev", "ct1"]);
    }
    ok(ip, &["-n", ns, "link", "set", "ct1", "up"]);
    ok(
        ip,
        &[
            "-n",
            ns,
            "route",
            "add",
            "10.96.0.0/24",
            "via",
            "192.168.78.1",
        ],
    );
    let ipvsadm = std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".into());
    for (vip, rs) in [
        ("10.96.0.53:53", "192.168.78.3:5353"),
        ("10.96.0.54:53", "192.168.78.4:5353"),
    ] {
        ok(&ipvsadm, &["-A", "-u", vip, "-s", "rr"]);
        ok(&ipvsadm, &["-a", "-u", vip, "-r", rs, "-m"]);
    }
    // Conntrack only tracks a namespace's packets once something there needs it; on a node
    // that is the masquerade rules' nat table, so they are set up here too.
    Masquerade::new(config(Backend::Nft))
        .expect("config")
        .ensure()
        .expect("ensure");

    for (vip, sport) in [("10.96.0.53:53", "40053"), ("10.96.0.54:53", "40054")] {
        let target = format!("UDP-SENDTO:{vip},bind=192.168.78.2:{sport}");
        let out = Command::new(ip)
            .args([
                "netns",
                "exec",
                ns,
                "socat",
                "-u",
                "OPEN:/proc/sys/kernel/ostype",
                &target,
            ])
            .output()
            .expect("socat");
        assert!(out.status.success(), "{out:?}");
    }
    let to = |a: &str| a.parse::<std::net::IpAddr>().expect("ip");
    let flows = |entries: &[conntrack::Entry]| -> Vec<(std::net::IpAddr, u16)> {
        let mut f: Vec<_> = entries
            .iter()
            .filter(|e| e.orig.protocol == conntrack::IPPROTO_UDP)
            .map(|e| (e.reply.src, e.reply.src_port))
            .collect();
        f.sort();
        f
    };
    let before = conntrack::entries(false).expect("dump");
    println!("before: {before:#?}");
    if let Ok(proc) = std::fs::read_to_string("/proc/net/nf_conntrack") {
        println!("/proc/net/nf_conntrack:\n{proc}");
    }
    assert_eq!(
        flows(&before),
        [(to("192.168.78.3"), 5353), (to("192.168.78.4"), 5353)],
        "both flows are tracked, with the real server as reply source"
    );
    assert!(
        before
            .iter()
            .any(|e| e.orig.dst == to("10.96.0.53") && e.orig.dst_port == 53)
    );

    let deleted = conntrack::flush_udp_endpoint(to("192.168.78.3"), 5353).expect("flush");
    assert_eq!(deleted, 1);
    let after = conntrack::entries(false).expect("dump");
    assert_eq!(flows(&after), [(to("192.168.78.4"), 5353)], "{after:#?}");
    assert_eq!(
        conntrack::flush_udp_endpoint(to("192.168.78.3"), 5353).expect("flush again"),
        0
    );
    assert_eq!(
        conntrack::flush_udp_service(to("10.96.0.54"), 53).expect("flush service"),
        1
    );
    assert_eq!(flows(&conntrack::entries(false).expect("dump")), []);
    let _ = run(ip, &["netns", "del", ns]);
}

/// A client namespace (192.168.77.2, behind 192.168.77.1 = this node's address) and a server
/// namespace (192.168.88.2, behind 192.168.88.1), both routed through this namespace, which holds
/// a ClusterIP-like virtual server 10.96.0.10:80 and a NodePort-like one 192.168.77.1:30080, both
/// to the server's 192.168.88.2:8080 in masquerade mode. The server answers each connection with
/// the peer address it sees, so each case shows whether the connection was masqueraded.
struct Topology {
    server: std::process::Child,
}

const CLIENT_NS: &str = "mq-client";
const SERVER_NS: &str = "mq-server";

impl Topology {
    fn new() -> Self {
        let ip = "/usr/sbin/ip";
        for (ns, host_if, peer_if, host, peer) in [
            (
                CLIENT_NS,
                "mqc0",
                "mqc1",
                "192.168.77.1/24",
                "192.168.77.2/24",
            ),
            (
                SERVER_NS,
                "mqs0",
                "mqs1",
                "192.168.88.1/24",
                "192.168.88.2/24",
            ),
        ] {
            let _ = run(ip, &["netns", "del", ns]);
            ok(ip, &["netns", "add", ns]);
            ok(
                ip,
                &[
                    "link", "add", host_if, "type", "veth", "peer", "name", peer_if,
                ],
            );
            ok(ip, &["link", "set", peer_if, "netns", ns]);
            ok(ip, &["addr", "add", host, "dev", host_if]);
            ok(ip, &["link", "set", host_if, "up"]);
            ok(ip, &["-n", ns, "addr", "add", peer, "dev", peer_if]);
            ok(ip, &["-n", ns, "link", "set", peer_if, "up"]);
            ok(ip, &["-n", ns, "link", "set", "lo", "up"]);
            let gw = host.trim_end_matches("/24");
            ok(ip, &["-n", ns, "route", "add", "default", "via", gw]);
        }
        ok(ip, &["addr", "add", "10.96.0.10/32", "dev", "lo"]);
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1\n").expect("ip_forward");
        let ipvsadm = std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".into());
        for vip in ["10.96.0.10:80", "192.168.77.1:30080"] {
            ok(&ipvsadm, &["-A", "-t", vip, "-s", "rr"]);
            ok(
                &ipvsadm,
                &["-a", "-t", vip, "-r", "192.168.88.2:8080", "-m"],
            );
        }
        let server = Command::new(ip)
            .args([
                "netns",
                "exec",
                SERVER_NS,
                "socat",
                "TCP-LISTEN:8080,bind=192.168.88.2,reuseaddr,fork",
                "SYSTEM:echo $SOCAT_PEERADDR",
            ])
            .spawn()
            .expect("start server");
        Self { server }
    }

    /// The address the server saw for a connection from `ns`/`src` to `vip`, or `None` if the
    /// connection failed. `retry` is for connections expected to succeed: it retries refused
    /// connections (the server may not listen yet) and timed-out ones (a SYN the emulated guest
    /// was too slow to answer in 2 s, seen once in CI), at most 16 attempts of 2 s, well inside
    /// the test's limit, so a broken path fails its assertion rather than the limit. Without it one
    /// attempt decides, which is what a connection expected to fail needs.
    fn peer_seen(&self, ns: &str, src: &str, vip: &str, retry: bool) -> Option<String> {
        let opts = if retry {
            "connect-timeout=2,retry=15,interval=0.1"
        } else {
            "connect-timeout=2"
        };
        let out = run(
            "/usr/sbin/ip",
            &[
                "netns",
                "exec",
                ns,
                "socat",
                "-T",
                "3",
                "-u",
                &format!("TCP:{vip},bind={src},{opts}"),
                "STDOUT",
            ],
        );
        let seen = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (out.status.success() && !seen.is_empty()).then_some(seen)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        for ns in [CLIENT_NS, SERVER_NS] {
            let _ = run("/usr/sbin/ip", &["netns", "del", ns]);
        }
    }
}

/// Cluster CIDR, NodePort (Cluster and Local policy) and hairpin decisions on real traffic.
#[test]
fn masquerade_decisions_on_real_traffic() {
    use kube_ipvs_diff::Protocol;
    use kube_ipvs_host::masquerade::{LocalNodePort, LocalVirtualServer};

    let t = Topology::new();
    let node_ip: IpAddr = "192.168.77.1".parse().expect("ip");
    let apply = |config: Config| {
        Masquerade::new(Config {
            backend: Backend::Nft,
            node_ips: vec![node_ip],
            ..config
        })
        .expect("config")
        .ensure()
        .expect("ensure");
    };
    // Every client check expects a connection; what it checks is the address the server saw.
    let client = |vip: &str| t.peer_seen(CLIENT_NS, "192.168.77.2", vip, true);

    // The client is outside the cluster CIDR: masqueraded to this node's address on the server
    // side.
    apply(Config {
        cluster_cidrs: vec![cidr("10.244.0.0/16")],
        ..Config::default()
    });
    assert_eq!(client("10.96.0.10:80").as_deref(), Some("192.168.88.1"));
    // An external IP under the Local policy keeps the client's address even from outside.
    apply(Config {
        cluster_cidrs: vec![cidr("10.244.0.0/16")],
        local_virtual_servers: vec![LocalVirtualServer {
            addr: "10.96.0.10".parse().expect("ip"),
            protocol: Protocol::Tcp,
            port: 80,
        }],
        ..Config::default()
    });
    assert_eq!(client("10.96.0.10:80").as_deref(), Some("192.168.77.2"));

    // The client's network counts as the Pod network: the server sees the client itself.
    let pods = vec![cidr("192.168.77.0/24"), cidr("192.168.88.0/24")];
    apply(Config {
        cluster_cidrs: pods.clone(),
        ..Config::default()
    });
    assert_eq!(client("10.96.0.10:80").as_deref(), Some("192.168.77.2"));
    // ...but NodePort traffic is masqueraded (externalTrafficPolicy: Cluster)...
    assert_eq!(
        client("192.168.77.1:30080").as_deref(),
        Some("192.168.88.1")
    );
    // ...unless its NodePort has the Local policy.
    apply(Config {
        cluster_cidrs: pods.clone(),
        local_node_ports: vec![LocalNodePort {
            protocol: Protocol::Tcp,
            port: 30080,
        }],
        ..Config::default()
    });
    assert_eq!(
        client("192.168.77.1:30080").as_deref(),
        Some("192.168.77.2")
    );

    // Hairpin: the server reaches itself through the virtual server. Without the hairpin rule
    // its own packet comes back with its own address as source and the connection fails; with
    // it, it is masqueraded.
    // A check expected to succeed retries (see `peer_seen`); one expected to fail does not.
    let hairpin = |h: Hairpin, expect_success: bool| {
        apply(Config {
            cluster_cidrs: pods.clone(),
            hairpin: h,
            ..Config::default()
        });
        t.peer_seen(SERVER_NS, "192.168.88.2", "10.96.0.10:80", expect_success)
    };
    assert_eq!(hairpin(Hairpin::Endpoints(vec![]), false), None);
    assert_eq!(
        hairpin(
            Hairpin::Endpoints(vec!["192.168.88.2".parse().expect("ip")]),
            true
        )
        .as_deref(),
        Some("192.168.88.1")
    );
    // Through the set: the one rule matches only while the server's address is a member, so
    // a change of members is all it takes (the rules are not applied again in between).
    let mut sets = kube_ipvs_netlink::nfnl::ipset::Ipset::new().expect("netlink");
    let set = kube_ipvs_netlink::nfnl::ipset::SET_V4;
    sets.create(
        set,
        Family::V4,
        kube_ipvs_netlink::nfnl::ipset::SetKind::NetNet,
    )
    .expect("create the set");
    assert_eq!(hairpin(Hairpin::Set, false), None, "the set is empty");
    let member =
        kube_ipvs_netlink::nfnl::ipset::Entry::hairpin("192.168.88.2".parse().expect("ip"));
    sets.add(set, &[member]).expect("add");
    assert_eq!(
        t.peer_seen(SERVER_NS, "192.168.88.2", "10.96.0.10:80", true)
            .as_deref(),
        Some("192.168.88.1")
    );
    assert!(
        ok(&tool(Backend::Nft, Family::V4, "-save"), &["-t", "nat"])
            .contains("-m set --match-set KUBE-IPVS-HAIRPIN src,dst"),
        "the set rule is in place"
    );
    assert_eq!(
        hairpin(Hairpin::LocalPodCidrs(vec![cidr("192.168.88.0/24")]), true).as_deref(),
        Some("192.168.88.1")
    );
    // With no rule referencing it any more, the set can go.
    assert!(sets.destroy(set).expect("destroy"));
}

/// The IPv6 form of the UDP cleanup: one flow through an IPv6 virtual server to a masquerade
/// real server, found in the IPv6 dump and deleted by its endpoint.
#[test]
fn udp_conntrack_cleanup_ipv6() {
    use kube_ipvs_netlink::nfnl::conntrack;

    let ip = "/usr/sbin/ip";
    let ns = "ct6-peer";
    let _ = run(ip, &["netns", "del", ns]);
    ok(ip, &["netns", "add", ns]);
    ok(
        ip,
        &["link", "add", "c60", "type", "veth", "peer", "name", "c61"],
    );
    ok(ip, &["link", "set", "c61", "netns", ns]);
    ok(ip, &["addr", "add", "fd00:78::1/64", "dev", "c60", "nodad"]);
    ok(ip, &["link", "set", "c60", "up"]);
    ok(ip, &["addr", "add", "fd00:96::53/128", "dev", "lo"]);
    for a in ["fd00:78::2/64", "fd00:78::3/64"] {
        ok(ip, &["-n", ns, "addr", "add", a, "dev", "c61", "nodad"]);
    }
    ok(ip, &["-n", ns, "link", "set", "c61", "up"]);
    ok(
        ip,
        &[
            "-n",
            ns,
            "route",
            "add",
            "fd00:96::/64",
            "via",
            "fd00:78::1",
        ],
    );
    let ipvsadm = std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".into());
    ok(&ipvsadm, &["-A", "-u", "[fd00:96::53]:53", "-s", "rr"]);
    ok(
        &ipvsadm,
        &[
            "-a",
            "-u",
            "[fd00:96::53]:53",
            "-r",
            "[fd00:78::3]:5353",
            "-m",
        ],
    );
    Masquerade::new(Config {
        families: vec![Family::V6],
        backend: Backend::Nft,
        bin_dir: Some(xtables_dir().into()),
        ..Config::default()
    })
    .expect("config")
    .ensure()
    .expect("ensure");

    let out = Command::new(ip)
        .args([
            "netns",
            "exec",
            ns,
            "socat",
            "-u",
            "OPEN:/proc/sys/kernel/ostype",
            "UDP6-SENDTO:[fd00:96::53]:53,bind=[fd00:78::2]:40053",
        ])
        .output()
        .expect("socat");
    assert!(out.status.success(), "{out:?}");
    let ep: IpAddr = "fd00:78::3".parse().expect("ip");
    let to_ep = |entries: &[conntrack::Entry]| {
        entries
            .iter()
            .filter(|e| e.orig.protocol == conntrack::IPPROTO_UDP && e.reply.src == ep)
            .count()
    };
    let before = conntrack::entries(true).expect("dump");
    println!("before: {before:#?}");
    assert_eq!(to_ep(&before), 1, "the flow is tracked");
    assert_eq!(conntrack::flush_udp_endpoint(ep, 5353).expect("flush"), 1);
    assert_eq!(to_ep(&conntrack::entries(true).expect("dump")), 0);
    let _ = run(ip, &["netns", "del", ns]);
}
