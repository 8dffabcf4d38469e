//! The expected texts below are byte-exact output of Debian's ipvsadm 1.31 (from
//! `shared/docs/ipvs-netlink-and-ipvsadm.md` §2, where `$` marks the end of a line). The VM tests
//! compare against the live binary as well.

use super::*;

fn v4(s: &str) -> IpAddr {
    IpAddr::V4(s.parse().unwrap())
}

fn v6(s: &str) -> IpAddr {
    IpAddr::V6(s.parse().unwrap())
}

fn svc(af: u16, protocol: u16, addr: IpAddr, port: u16, sched: &str) -> Service {
    Service {
        af,
        protocol,
        addr,
        port,
        fwmark: 0,
        scheduler: sched.into(),
        flags: 0x2, // HASHED, as every dumped service carries.
        timeout: 0,
        netmask: if af == AF_INET6 { 128 } else { 0xffff_ffff },
        pe_name: String::new(),
        stats: Counters::default(),
        dests: vec![],
    }
}

fn fwm(af: u16, mark: u32, sched: &str) -> Service {
    let unspec = if af == AF_INET6 {
        v6("::")
    } else {
        v4("0.0.0.0")
    };
    Service {
        fwmark: mark,
        ..svc(af, IPPROTO_TCP, unspec, 0, sched)
    }
}

fn dest(addr: IpAddr, port: u16, fwd: u32, weight: i32, active: u32, inact: u32) -> Dest {
    Dest {
        af: if addr.is_ipv6() { AF_INET6 } else { AF_INET },
        addr,
        port,
        fwd,
        weight,
        u_threshold: 0,
        l_threshold: 0,
        active_conns: active,
        inact_conns: inact,
        persist_conns: 0,
        tun_type: 0,
        tun_port: 0,
        tun_flags: 0,
        stats: Counters::default(),
    }
}

fn spec(text: &str) -> String {
    text.lines()
        .map(|l| format!("{}\n", l.trim_end_matches('$')))
        .collect()
}

/// The §2.2 table, with services and destinations given in an order unlike the sorted one.
fn spec_table() -> Table {
    let mut persistent_sh = svc(AF_INET, IPPROTO_TCP, v4("200.0.0.1"), 443, "sh");
    persistent_sh.flags |= F_PERSISTENT | F_SCHED1 | F_SCHED2;
    persistent_sh.timeout = 300;
    persistent_sh.dests = vec![dest(v4("10.1.1.1"), 443, FWD_LOCAL, 0, 0, 0)];

    let mut wlc = svc(AF_INET, IPPROTO_TCP, v4("10.0.0.1"), 80, "wlc");
    wlc.dests = vec![
        dest(v4("192.168.1.11"), 80, FWD_MASQ, 1, 3, 10),
        dest(v4("192.168.1.10"), 8080, FWD_ROUTE, 100, 0, 0),
    ];

    let mut udp = svc(AF_INET, IPPROTO_UDP, v4("10.0.0.1"), 53, "rr");
    udp.flags |= F_PERSISTENT | F_ONEPACKET;
    udp.timeout = 10800;
    udp.netmask = 0xffff_ff00;
    udp.dests = vec![dest(v4("192.168.1.20"), 53, FWD_TUNNEL, 5, 0, 0)];

    let mut sctp = svc(AF_INET, IPPROTO_SCTP, v4("10.0.0.2"), 3868, "mh");
    sctp.flags |= F_PERSISTENT | F_SCHED1;

    let mut six = svc(AF_INET6, IPPROTO_TCP, v6("2001:db8::1"), 80, "wrr");
    six.flags |= F_PERSISTENT;
    six.timeout = 600;
    six.netmask = 64;
    six.pe_name = "sip".into();
    six.dests = vec![
        dest(v6("2001:db8::10"), 80, FWD_MASQ, 2, 1, 2),
        dest(v6("2001:db8::9"), 80, FWD_MASQ, 2, 1, 2),
    ];

    let mut mark100 = fwm(AF_INET, 100, "wlc");
    mark100.flags |= F_PERSISTENT;
    mark100.timeout = 300;
    mark100.dests = vec![dest(v4("192.168.1.30"), 0, FWD_TUNNEL, 1, 0, 0)];

    Table {
        version: 0x010201,
        conn_tab_size: 4096,
        services: vec![
            mark100,
            six,
            udp,
            wlc,
            fwm(AF_INET6, 3_000_000_000, "wlc"),
            sctp,
            persistent_sh,
        ],
    }
}

#[test]
fn list_matches_ipvsadm_ln() {
    let expected = spec(
        "IP Virtual Server version 1.2.1 (size=4096)$
Prot LocalAddress:Port Scheduler Flags$
  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn$
FWM  -1294967296 IPv6 wlc$
TCP  200.0.0.1:443 sh (sh-fallback,sh-port) persistent 300$
  -> 10.1.1.1:443                 Local   0      0          0         $
TCP  10.0.0.1:80 wlc$
  -> 192.168.1.10:8080            Route   100    0          0         $
  -> 192.168.1.11:80              Masq    1      3          10        $
UDP  10.0.0.1:53 rr persistent 10800 mask 255.255.255.0 ops$
  -> 192.168.1.20:53              Tunnel  5      0          0         $
SCTP 10.0.0.2:3868 mh (mh-fallback) persistent 0$
TCP  [2001:db8::1]:80 wrr persistent 600 mask 64 pe sip$
  -> [2001:db8::9]:80             Masq    2      1          2         $
  -> [2001:db8::10]:80            Masq    2      1          2         $
FWM  100 wlc persistent 300$
  -> 192.168.1.30:0               Tunnel  1      0          0         $",
    );
    assert_eq!(render_table(&spec_table(), Format::default()), expected);
}

#[test]
fn empty_table_prints_only_the_header() {
    let table = Table {
        version: 0x010201,
        conn_tab_size: 4096,
        services: vec![],
    };
    assert_eq!(
        render_table(&table, Format::default()),
        spec(
            "IP Virtual Server version 1.2.1 (size=4096)$
Prot LocalAddress:Port Scheduler Flags$
  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn$"
        )
    );
}

fn stats_service() -> Service {
    let mut s = svc(AF_INET, IPPROTO_TCP, v4("10.0.0.1"), 80, "wlc");
    s.stats = Counters {
        conns: 99_999_999,
        inpkts: 100_000_000,
        outpkts: 999_999_999,
        inbytes: 1_000_000_000,
        outbytes: 99_999_999_999,
        cps: 100_000_000_000,
        inpps: 99_999_000_000_000,
        outpps: 100_000_000_000_000,
        inbps: 4_294_967_295,
        outbps: 0,
    };
    let mut d = dest(v4("10.0.0.5"), 80, FWD_MASQ, 1, 0, 0);
    d.stats = Counters {
        conns: 5_000_000_001,
        inpkts: 1,
        inbytes: 5_000_000_000,
        ..Counters::default()
    };
    s.dests = vec![d];
    s
}

#[test]
fn stats_scale_like_largenum_and_keep_only_low_32_bits_of_dest_counters() {
    let format = Format {
        columns: Columns::Stats,
        ..Format::default()
    };
    assert_eq!(
        render_one(&stats_service(), format),
        spec(
            "Prot LocalAddress:Port               Conns   InPkts  OutPkts  InBytes OutBytes$
  -> RemoteAddress:Port$
TCP  10.0.0.1:80                  99999999  100000K  999999K    1000M   99999M$
  -> 10.0.0.5:80                   705032K        1        0    5000M        0$"
        )
    );
}

#[test]
fn exact_stats_widen_past_eight_digits() {
    let format = Format {
        columns: Columns::Stats,
        exact: true,
        ..Format::default()
    };
    let out = render_one(&stats_service(), format);
    let line = out.lines().nth(2).unwrap();
    assert_eq!(
        line,
        "TCP  10.0.0.1:80                  99999999 100000000 999999999 1000000000 99999999999"
    );
}

#[test]
fn rate_service_line_scales_every_column() {
    let format = Format {
        columns: Columns::Rate,
        ..Format::default()
    };
    let out = render_one(&stats_service(), format);
    let mut lines = out.lines();
    assert_eq!(
        lines.next().unwrap(),
        "Prot LocalAddress:Port                 CPS    InPPS   OutPPS    InBPS   OutBPS"
    );
    assert_eq!(lines.next().unwrap(), "  -> RemoteAddress:Port");
    assert_eq!(
        lines.next().unwrap(),
        "TCP  10.0.0.1:80                      100G   99999G     100T    4294M        0"
    );
}

#[test]
fn exact_without_stats_is_the_plain_list() {
    let table = spec_table();
    let exact = Format {
        exact: true,
        ..Format::default()
    };
    assert_eq!(
        render_table(&table, exact),
        render_table(&table, Format::default())
    );
}

#[test]
fn save_matches_ipvsadm_s_n() {
    let mut wlc = svc(AF_INET, IPPROTO_TCP, v4("10.0.0.1"), 80, "wlc");
    wlc.dests = vec![
        dest(v4("192.168.1.11"), 80, FWD_MASQ, 1, 0, 0),
        dest(v4("192.168.1.10"), 8080, FWD_ROUTE, 100, 0, 0),
    ];
    let mut udp = svc(AF_INET, IPPROTO_UDP, v4("10.0.0.1"), 53, "rr");
    udp.flags |= F_PERSISTENT | F_ONEPACKET;
    udp.timeout = 10800;
    udp.netmask = 0xffff_ff00;
    udp.dests = vec![dest(v4("192.168.1.20"), 53, FWD_TUNNEL, 5, 0, 0)];
    let mut sctp = svc(AF_INET, IPPROTO_SCTP, v4("10.0.0.2"), 3868, "mh");
    sctp.flags |= F_PERSISTENT | F_SCHED1;
    let mut six = svc(AF_INET6, IPPROTO_TCP, v6("2001:db8::1"), 80, "wrr");
    six.flags |= F_PERSISTENT;
    six.timeout = 600;
    six.netmask = 64;
    six.pe_name = "sip".into();
    let mut mark = fwm(AF_INET, 100, "wlc");
    mark.flags |= F_PERSISTENT;
    mark.timeout = 300;
    let mut gue = dest(v4("192.168.1.30"), 0, FWD_TUNNEL, 1, 0, 0);
    gue.tun_type = TUN_GUE;
    gue.tun_port = 6080;
    gue.tun_flags = 1;
    mark.dests = vec![gue];

    let table = Table {
        version: 0x010201,
        conn_tab_size: 4096,
        services: vec![six, mark, sctp, udp, wlc],
    };
    let format = Format {
        columns: Columns::Save,
        ..Format::default()
    };
    assert_eq!(
        render_table(&table, format),
        spec(
            "-A -t 10.0.0.1:80 -s wlc$
-a -t 10.0.0.1:80 -r 192.168.1.10:8080 -g -w 100$
-a -t 10.0.0.1:80 -r 192.168.1.11:80 -m -w 1$
-A -u 10.0.0.1:53 -s rr -p 10800 -M 255.255.255.0 -o$
-a -u 10.0.0.1:53 -r 192.168.1.20:53 -i -w 5 --tun-type ipip$
-A --sctp-service 10.0.0.2:3868 -s mh -p 0 -b mh-fallback$
-A -t [2001:db8::1]:80 -s wrr -p 600 -M 64 --pe sip$
-A -f 100 -s wlc -p 300$
-a -f 100 -r 192.168.1.30:0 -i -w 1 --tun-type gue --tun-port 6080 --tun-csum$"
        )
    );
}

#[test]
fn tun_info_names_each_tunnel_kind() {
    let mut s = svc(AF_INET, IPPROTO_TCP, v4("10.0.0.1"), 80, "rr");
    let mut gre = dest(v4("10.0.0.3"), 80, FWD_TUNNEL, 1, 0, 0);
    gre.tun_type = TUN_GRE;
    gre.tun_flags = 2;
    let mut gue = dest(v4("10.0.0.2"), 80, FWD_TUNNEL, 1, 0, 0);
    gue.tun_type = TUN_GUE;
    gue.tun_port = 5555;
    s.dests = vec![gre, gue, dest(v4("10.0.0.1"), 80, FWD_MASQ, 1, 0, 0)];
    let format = Format {
        columns: Columns::TunInfo,
        ..Format::default()
    };
    assert_eq!(
        render_one(&s, format),
        spec(
            "Prot LocalAddress:Port Scheduler Flags$
  -> RemoteAddress:Port           Forward TunnelInfo    Weight ActiveConn InActConn$
TCP  10.0.0.1:80 rr$
  -> 10.0.0.1:80                  Masq    n/a           1      0          0         $
  -> 10.0.0.2:80                  Tunnel  gue:5555:-c   1      0          0         $
  -> 10.0.0.3:80                  Tunnel  gre:r+c       1      0          0         $"
        )
    );
}

#[test]
fn thresholds_and_persistent_conn_columns() {
    let mut s = svc(AF_INET, IPPROTO_UDP, v4("10.0.0.1"), 53, "lc");
    let mut d = dest(v4("10.0.0.9"), 53, FWD_MASQ, 7, 1, 2);
    d.u_threshold = 100;
    d.l_threshold = 10;
    d.persist_conns = 4;
    s.dests = vec![d];
    let thresholds = Format {
        columns: Columns::Thresholds,
        ..Format::default()
    };
    assert_eq!(
        render_one(&s, thresholds),
        spec(
            "Prot LocalAddress:Port            Uthreshold Lthreshold ActiveConn InActConn $
  -> RemoteAddress:Port$
UDP  10.0.0.1:53 lc$
  -> 10.0.0.9:53                  100        10         1          2         $"
        )
    );
    let persistent = Format {
        columns: Columns::PersistentConn,
        ..Format::default()
    };
    assert_eq!(
        render_one(&s, persistent),
        spec(
            "Prot LocalAddress:Port            Weight    PersistConn ActiveConn InActConn $
  -> RemoteAddress:Port$
UDP  10.0.0.1:53 lc$
  -> 10.0.0.9:53                  7         4           1          2         $"
        )
    );
}

#[test]
fn destination_sort_wraps_like_a_c_int() {
    // §2.6: [10.0.0.5:80, 200.0.0.5, 100.0.0.5, 10.0.0.5:79] -> 200, 10:79, 10:80, 100.
    let mut s = svc(AF_INET, IPPROTO_TCP, v4("10.0.0.1"), 80, "rr");
    s.dests = vec![
        dest(v4("10.0.0.5"), 80, FWD_MASQ, 1, 0, 0),
        dest(v4("200.0.0.5"), 80, FWD_MASQ, 1, 0, 0),
        dest(v4("100.0.0.5"), 80, FWD_MASQ, 1, 0, 0),
        dest(v4("10.0.0.5"), 79, FWD_MASQ, 1, 0, 0),
    ];
    let out = render_one(&s, Format::default());
    let order: Vec<&str> = out
        .lines()
        .skip(3)
        .map(|l| l.split_whitespace().nth(1).unwrap())
        .collect();
    assert_eq!(
        order,
        ["200.0.0.5:80", "10.0.0.5:79", "10.0.0.5:80", "100.0.0.5:80"]
    );
}

#[test]
fn nosort_keeps_kernel_order() {
    let mut s = svc(AF_INET, IPPROTO_TCP, v4("10.0.0.1"), 80, "rr");
    s.dests = vec![
        dest(v4("10.0.0.9"), 80, FWD_MASQ, 1, 0, 0),
        dest(v4("10.0.0.2"), 80, FWD_MASQ, 1, 0, 0),
    ];
    let format = Format {
        nosort: true,
        ..Format::default()
    };
    let out = render_one(&s, format);
    assert!(out.find("10.0.0.9").unwrap() < out.find("10.0.0.2").unwrap());
}

#[test]
fn glibc_ipv6_text() {
    let cases = [
        ("::", "::"),
        ("::1", "::1"),
        ("::2:3", "::0.2.0.3"),
        ("::1.2.3.4", "::1.2.3.4"),
        ("::ffff:1.2.3.4", "::ffff:1.2.3.4"),
        ("::ffff:0.0.0.0", "::ffff:0.0.0.0"),
        ("2001:db8::1", "2001:db8::1"),
        ("2001:db8:0:1:0:0:0:1", "2001:db8:0:1::1"),
        ("2001:0:0:1:0:0:1:1", "2001::1:0:0:1:1"),
        ("2001:db8:1:2:3:4:5:0", "2001:db8:1:2:3:4:5:0"),
        ("fe80::", "fe80::"),
        ("1:0:0:0:0:0:0:0", "1::"),
        ("0:0:1::", "0:0:1::"),
        ("::ffff:0:1.2.3.4", "::ffff:0:102:304"),
    ];
    for (input, want) in cases {
        let addr: Ipv6Addr = input.parse().unwrap();
        assert_eq!(glibc_ntop6(&addr), want, "inet_ntop of {input}");
    }
}

#[test]
fn timeouts_line() {
    assert_eq!(
        render_timeouts(900, 120, 300),
        "Timeout (tcp tcpfin udp): 900 120 300\n"
    );
}
