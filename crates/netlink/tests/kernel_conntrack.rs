#![cfg(feature = "kernel-tests")]
//! Conntrack over nfnetlink against the real kernel: UDP flows sent over loopback are tracked
//! (an iptables rule with the `conntrack` match makes the kernel track this namespace), our dump
//! finds each with both tuples, and a flush by endpoint deletes exactly its flows, more than one
//! batch of them, leaving the others. The dump replies are printed as `##conntrack-fixture`
//! lines for `src/nfnl/conntrack.rs`'s fixture test (`tests/fixtures/extract.sh` has the recipe).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::process::Command;

use kube_ipvs_netlink::nfnl::conntrack::{self, Entry, Filter, IPPROTO_UDP};

/// Registers conntrack in this namespace: a rule that uses the `conntrack` match.
fn track(tool: &str) {
    let out = Command::new(tool)
        .args([
            "-A",
            "OUTPUT",
            "-m",
            "conntrack",
            "--ctstate",
            "NEW",
            "-j",
            "ACCEPT",
        ])
        .output()
        .expect("spawn iptables");
    assert!(
        out.status.success(),
        "{tool}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Sends one datagram from each of `n` client sockets to `server` and has the server answer
/// each, so every flow is a conntrack entry with a reply; returns the clients, which the caller
/// keeps open so no later client reuses a port (the same tuple is the same entry).
fn flows(server: &UdpSocket, n: usize) -> Vec<UdpSocket> {
    let to = server.local_addr().expect("server address");
    let mut clients = Vec::new();
    for _ in 0..n {
        let c = UdpSocket::bind(SocketAddr::new(to.ip(), 0)).expect("client socket");
        c.send_to(b"ping", to).expect("send");
        let mut buf = [0u8; 16];
        let (_, from) = server.recv_from(&mut buf).expect("server receives");
        server.send_to(b"pong", from).expect("answer");
        c.recv_from(&mut buf).expect("client receives the answer");
        clients.push(c);
    }
    clients
}

fn ours(entries: &[Entry], server: SocketAddr) -> Vec<&Entry> {
    entries
        .iter()
        .filter(|e| e.orig.protocol == IPPROTO_UDP && e.orig.dst == server.ip())
        .filter(|e| e.orig.dst_port == server.port())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn udp_flows_are_dumped_and_a_flush_by_endpoint_deletes_exactly_them() {
    track("iptables");
    track("ip6tables");
    for (addr, v6) in [("127.0.0.1", false), ("::1", true)] {
        let ip: IpAddr = addr.parse().expect("literal");
        let server = UdpSocket::bind(SocketAddr::new(ip, 0)).expect("server socket");
        let other = UdpSocket::bind(SocketAddr::new(ip, 0)).expect("other server");
        let at = server.local_addr().expect("address");

        // Two flows first, their dump kept as the fixture.
        let first = flows(&server, 2);
        let first_addrs: Vec<SocketAddr> = first
            .iter()
            .map(|c| c.local_addr().expect("client address"))
            .collect();
        let mut raw = Vec::new();
        let got = conntrack::entries_capturing(v6, Some(&mut raw)).expect("dump");
        let mine = ours(&got, at);
        assert_eq!(mine.len(), 2, "{got:?}");
        for e in &mine {
            assert!(first_addrs.contains(&SocketAddr::new(e.orig.src, e.orig.src_port)));
            assert_eq!((e.reply.src, e.reply.src_port), (at.ip(), at.port()));
            assert_eq!(e.reply.dst_port, e.orig.src_port);
        }
        for d in &raw {
            println!("##conntrack-fixture v{} {}", if v6 { 6 } else { 4 }, hex(d));
        }

        // Then 300 more (more than one batch of deletes) and 3 to another endpoint.
        let _many = flows(&server, 300);
        let _others = flows(&other, 3);
        let deleted = conntrack::flush(&Filter {
            protocol: IPPROTO_UDP,
            reply_src: Some((at.ip(), at.port())),
            orig_dst: None,
        })
        .expect("flush");
        assert_eq!(deleted, 302);
        let after = conntrack::entries(v6).expect("dump");
        assert!(ours(&after, at).is_empty(), "{after:?}");
        let kept = other.local_addr().expect("address");
        assert_eq!(
            ours(&after, kept).len(),
            3,
            "the other endpoint's flows stay"
        );
    }
}
