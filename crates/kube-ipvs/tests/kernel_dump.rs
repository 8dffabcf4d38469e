//! Kernel tests (run in the VM by `cargo xtask vm-test`): `kube-ipvs dump` against the real
//! `ipvsadm` on the same kernel table, byte for byte, for every list variant.
//!
//! Each test runs in its own network namespace, so each builds its own table with `ipvsadm`
//! (fixed argument lists, no shell) and then compares the two programs' stdout and exit codes.
#![cfg(feature = "kernel-tests")]

use std::process::{Command, Output};

fn ipvsadm_bin() -> String {
    std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".into())
}

fn kube_ipvs_bin() -> String {
    std::env::var("KUBE_IPVS_BIN").unwrap_or_else(|_| "/usr/local/bin/kube-ipvs".into())
}

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {bin} {args:?}: {e}"))
}

/// Runs one `ipvsadm` rule command and fails the test, with its stderr, if ipvsadm refuses it.
fn ipvsadm(rule: &str) {
    let args: Vec<&str> = rule.split_whitespace().collect();
    let out = run(&ipvsadm_bin(), &args);
    assert!(
        out.status.success(),
        "ipvsadm {rule}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ipvsadm -L<args>` and `kube-ipvs dump <args>` must print the same bytes and exit alike.
fn same_output(args: &[&str]) {
    let mut ipvsadm_args = vec!["-L"];
    ipvsadm_args.extend_from_slice(args);
    let want = run(&ipvsadm_bin(), &ipvsadm_args);
    let mut ours_args = vec!["dump"];
    ours_args.extend_from_slice(args);
    let got = run(&kube_ipvs_bin(), &ours_args);
    let want_text = String::from_utf8_lossy(&want.stdout);
    let got_text = String::from_utf8_lossy(&got.stdout);
    if want.stdout != got.stdout {
        // Print both so a failure in the VM log shows the whole difference.
        println!("--- ipvsadm -L {}\n{want_text}", args.join(" "));
        println!("--- kube-ipvs dump {}\n{got_text}", args.join(" "));
        println!(
            "--- kube-ipvs stderr\n{}",
            String::from_utf8_lossy(&got.stderr)
        );
    }
    assert_eq!(got_text, want_text, "stdout of {args:?}");
    assert_eq!(
        got.status.code(),
        want.status.code(),
        "exit status of {args:?}: ours said {}",
        String::from_utf8_lossy(&got.stderr)
    );
}

/// A table with every kind of service and destination the renderer has a rule for.
fn build_mixed_table() {
    for rule in [
        // TCP with route and masq destinations, thresholds; sorting of wrapping addresses.
        "-A -t 10.0.0.1:80 -s wlc",
        "-a -t 10.0.0.1:80 -r 192.168.1.10:8080 -g -w 100",
        "-a -t 10.0.0.1:80 -r 192.168.1.11:80 -m -w 1 -x 100 -y 10",
        "-a -t 10.0.0.1:80 -r 200.0.0.5:80 -m -w 3",
        "-a -t 10.0.0.1:80 -r 100.0.0.5:80 -m -w 4",
        "-a -t 10.0.0.1:80 -r 10.0.0.5:79 -m -w 5",
        "-a -t 10.0.0.1:80 -r 10.0.0.5:80 -m -w 6",
        // sh with both flags, persistent.
        "-A -t 200.0.0.1:443 -s sh -b sh-fallback,sh-port -p 300",
        "-a -t 200.0.0.1:443 -r 10.1.1.1:443 -m -w 0",
        // UDP persistent with a netmask and one-packet scheduling, a tunnel destination.
        "-A -u 10.0.0.1:53 -s rr -p 10800 -M 255.255.255.0 -o",
        "-a -u 10.0.0.1:53 -r 192.168.1.20:53 -i -w 5",
        // SCTP with mh.
        "-A --sctp-service 10.0.0.2:3868 -s mh -b mh-fallback -p 1",
        "-a --sctp-service 10.0.0.2:3868 -r 192.168.1.21:3868 -m -w 1",
        // IPv6, persistent with a prefix.
        "-A -t [2001:db8::1]:80 -s wrr -p 600 -M 64",
        "-a -t [2001:db8::1]:80 -r [2001:db8::10]:80 -m -w 2",
        "-a -t [2001:db8::1]:80 -r [2001:db8::9]:80 -m -w 2",
        // IPv4-compatible IPv6 text (glibc prints ::a.b.c.d).
        "-A -u [::1.2.3.4]:53 -s lc",
        "-a -u [::1.2.3.4]:53 -r [::2:3]:53 -m -w 1",
        // Firewall marks, one above 2^31 (printed signed by ipvsadm 1.31), GUE and GRE tunnels.
        "-A -f 100 -s wlc -p 300",
        "-a -f 100 -r 192.168.1.30:0 -i -w 1 --tun-type gue --tun-port 6080 --tun-csum",
        "-a -f 100 -r 192.168.1.31:0 -i -w 1 --tun-type gre --tun-csum",
        "-A -f 3000000000 -6 -s wlc",
        "-A -f 3000000001 -s dh",
    ] {
        ipvsadm(rule);
    }
}

#[test]
fn empty_table_matches() {
    same_output(&["-n"]);
}

#[test]
fn list_variants_match_ipvsadm() {
    build_mixed_table();
    for variant in [
        &["-n"][..],
        &["-n", "--stats"],
        &["-n", "--rate"],
        &["-n", "--stats", "--exact"],
        &["-n", "--rate", "--exact"],
        &["-n", "--exact"],
        &["-n", "--thresholds"],
        &["-n", "--persistent-conn"],
        &["-n", "--tun-info"],
        &["-n", "--nosort"],
        &["-n", "--timeout"],
    ] {
        same_output(variant);
    }
}

#[test]
fn one_service_variants_match_ipvsadm() {
    build_mixed_table();
    for variant in [
        &["-n", "-t", "10.0.0.1:80"][..],
        &["-n", "-t", "200.0.0.1:443", "--stats"],
        &["-n", "-u", "10.0.0.1:53"],
        &["-n", "--sctp-service", "10.0.0.2:3868"],
        &["-n", "-t", "[2001:db8::1]:80"],
        &["-n", "-u", "[::1.2.3.4]:53"],
        &["-n", "-f", "100", "--tun-info"],
        &["-n", "-f", "100"],
        // A service that does not exist: "No such service" and exit 1 from both.
        &["-n", "-t", "10.9.9.9:80"],
    ] {
        same_output(variant);
    }
}

#[test]
fn save_matches_ipvsadm_s_n() {
    build_mixed_table();
    let want = run(&ipvsadm_bin(), &["-S", "-n"]);
    let got = run(&kube_ipvs_bin(), &["dump", "--save"]);
    assert!(want.status.success());
    assert_eq!(
        String::from_utf8_lossy(&got.stdout),
        String::from_utf8_lossy(&want.stdout)
    );
}

/// The `InPkts` column of `ipvsadm -Ln --stats --exact` for the service line starting `prefix`.
fn in_packets(prefix: &str) -> Option<u64> {
    let out = run(&ipvsadm_bin(), &["-L", "-n", "--stats", "--exact"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
}

#[test]
fn counters_from_real_traffic_match() {
    // Real packets make the counters non-zero: a UDP virtual server on a dummy link whose real
    // server is another local address, hit by one socket.
    let ip = "/usr/sbin/ip";
    for args in [
        &["link", "add", "kipvs-test", "type", "dummy"][..],
        &["addr", "add", "10.77.0.1/32", "dev", "kipvs-test"],
        &["addr", "add", "10.77.0.2/32", "dev", "lo"],
    ] {
        let out = run(ip, args);
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    ipvsadm("-A -u 10.77.0.1:9 -s rr");
    ipvsadm("-a -u 10.77.0.1:9 -r 10.77.0.2:9 -m -w 1");
    let sock = std::net::UdpSocket::bind("10.77.0.2:0").unwrap();
    const PACKETS: u64 = 300;
    for _ in 0..PACKETS {
        sock.send_to(b"kube-ipvs counters", "10.77.0.1:9").unwrap();
    }
    // The kernel folds its per-CPU counters into what it reports every two seconds (the rate
    // estimator's tick), so wait for that to happen rather than for a fixed time.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while in_packets("UDP  10.77.0.1:9") != Some(PACKETS) {
        assert!(
            std::time::Instant::now() < deadline,
            "the kernel never reported {PACKETS} packets: {:?}",
            in_packets("UDP  10.77.0.1:9")
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    for variant in [&["-n", "--stats"][..], &["-n", "--stats", "--exact"]] {
        // Not --rate: rates keep moving at every estimator tick, so two reads may differ;
        // the rate columns are compared on the idle table above.
        same_output(variant);
    }
}
