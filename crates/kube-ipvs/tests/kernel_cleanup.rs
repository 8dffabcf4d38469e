//! Kernel test of `kube-ipvs cleanup` (run in the VM by `cargo xtask vm-test
//! kube-ipvs/kernel_cleanup`): after `run` converged the example cluster and stopped on SIGTERM
//! (leaving everything in place), `cleanup --dry-run` lists and keeps, and `cleanup` leaves only
//! the foreign virtual server inside `--exclude-cidrs` and a firewall-mark service outside our
//! mark space (ours, the Local-policy short circuit's, goes), no `kube-ipvs0` and no
//! `KUBE-IPVS` chains in any iptables backend; a second run finds nothing.
#![cfg(feature = "kernel-tests")]

mod common;
use common::*;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The virtual server lines of `ipvsadm -Ln` (TCP, UDP, SCTP, FWM).
fn virtual_servers() -> Vec<String> {
    ipvsadm(&["-Ln"])
        .lines()
        .filter(|l| {
            ["TCP ", "UDP ", "SCTP ", "FWM "]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
        .collect()
}

/// Every installed backend's and family's `nat` table.
fn all_nat_rules() -> String {
    all_rules("nat")
}

/// Every installed backend's and family's `table`.
fn all_rules(table: &str) -> String {
    let mut all = String::new();
    for tool in [
        "iptables-legacy-save",
        "iptables-nft-save",
        "ip6tables-legacy-save",
        "ip6tables-nft-save",
    ] {
        // Not every tool is in the guest (ip6tables-legacy is not); a missing one holds nothing.
        if let Ok(out) = Command::new(tool).args(["-t", table]).output() {
            all += &String::from_utf8_lossy(&out.stdout);
        }
    }
    all
}

fn healthy() -> bool {
    use std::io::{Read as _, Write as _};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", 10256)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").is_err() {
        return false;
    }
    let mut t = String::new();
    let _ = s.read_to_string(&mut t);
    t.starts_with("HTTP/1.1 200") || t.starts_with("HTTP/1.0 200")
}

#[test]
fn cleanup_removes_what_run_created_and_nothing_else() {
    let dir = PathBuf::from("/tmp/kube-ipvs-cleanup");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create manifest dir");
    for (name, body) in EXAMPLES {
        std::fs::write(dir.join(name), body).expect("write manifest");
    }
    node_address();
    // Someone else's: a virtual server inside the excluded network and a fwmark service.
    ipvsadm(&["-A", "-t", "10.200.0.1:80", "-s", "rr"]);
    ipvsadm(&["-a", "-t", "10.200.0.1:80", "-r", "10.1.0.1:80", "-m"]);
    ipvsadm(&["-A", "-f", "7", "-s", "rr"]);
    let foreign = virtual_servers();
    assert_eq!(foreign.len(), 2);

    let log = dir.with_extension("log");
    let mut child = Command::new(kube_ipvs_bin())
        .args([
            "run",
            "--manifests",
            dir.to_str().expect("utf-8"),
            "--hostname-override",
            "node-1",
            "--exclude-cidrs",
            "10.200.0.0/16",
            "--cluster-cidr",
            "10.244.0.0/16",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("start kube-ipvs run");
    let converged = || {
        virtual_servers().len() == foreign.len() + 8
            && all_nat_rules().contains("not a local pod")
            && all_rules("mangle").contains("KUBE-IPVS-LOCAL-MARKS")
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(healthy() && converged()) {
        if Instant::now() > deadline || matches!(child.try_wait(), Ok(Some(_))) {
            let _ = child.kill();
            panic!(
                "run did not converge:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        run("kill", &["-TERM", &child.id().to_string()])
            .status
            .success()
    );
    let status = child.wait().expect("wait");
    assert_eq!(
        status.code(),
        Some(0),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(converged(), "SIGTERM leaves everything in place");
    assert!(
        run("/usr/sbin/ip", &["link", "show", "kube-ipvs0"])
            .status
            .success()
    );

    let cleanup = |extra: &[&str]| {
        let mut args = vec!["cleanup", "--exclude-cidrs", "10.200.0.0/16"];
        args.extend_from_slice(extra);
        run(&kube_ipvs_bin(), &args)
    };
    let dry = cleanup(&["--dry-run"]);
    assert_eq!(dry.status.code(), Some(0));
    let dry_text = stdout(&dry);
    assert!(
        dry_text.contains("would remove: 8 IPVS virtual servers"),
        "{dry_text}"
    );
    assert!(
        dry_text.contains("would remove link kube-ipvs0"),
        "{dry_text}"
    );
    for what in [
        "iptables chain KUBE-IPVS-MASQ",
        "iptables chain KUBE-IPVS-SERVICES",
        "iptables chain KUBE-IPVS-INPUT",
        "iptables chain KUBE-IPVS-FORWARD",
        "iptables chain KUBE-IPVS-LOCAL-PODS",
        "iptables chain KUBE-IPVS-LOCAL-HOST",
        "ipset KUBE-IPVS-SERVICES",
        "ipset KUBE-IPVS-LOCAL-MARKS",
        "ipset KUBE-IPVS-HC-PORTS",
    ] {
        assert!(
            dry_text.contains(&format!("would remove {what}")),
            "{what}:\n{dry_text}"
        );
    }
    assert!(converged(), "--dry-run changes nothing");

    let out = cleanup(&[]);
    assert_eq!(out.status.code(), Some(0));
    let done = stdout(&out);
    assert!(done.contains("removed: 8 IPVS virtual servers"), "{done}");
    assert!(
        done.contains("removed IPVS virtual server TCP 10.96.0.30:80"),
        "{done}"
    );
    assert!(
        done.contains("removed IPVS virtual server FWM "),
        "the short circuit's fwmark service is ours: {done}"
    );
    assert_eq!(
        virtual_servers(),
        foreign,
        "only the foreign entries are left"
    );
    assert!(
        ipvsadm(&["-Ln"]).contains("10.1.0.1:80"),
        "the foreign real server is kept too"
    );
    assert!(
        !run("/usr/sbin/ip", &["link", "show", "kube-ipvs0"])
            .status
            .success()
    );
    assert!(!all_nat_rules().contains("KUBE-IPVS"));
    assert!(!all_rules("filter").contains("KUBE-IPVS"));
    assert!(!all_rules("mangle").contains("KUBE-IPVS"));
    let sets = stdout(&run("/usr/sbin/ipset", &["list", "-n"]));
    assert!(
        !sets.contains("KUBE-IPVS"),
        "every ipset of ours is gone:\n{sets}"
    );

    let again = cleanup(&[]);
    assert_eq!(again.status.code(), Some(0));
    assert!(stdout(&again).contains(
        "removed: 0 IPVS virtual servers, 0 addresses on kube-ipvs0, no link, 0 iptables chains"
    ));
}
