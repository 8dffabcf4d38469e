#![cfg(feature = "kernel-tests")]
//! The harness's own smoke tests: they run only inside the VM (`cargo xtask vm-test xtask/`) and
//! check what every other kernel test relies on: the tools are there, IPVS works, and each test
//! gets a fresh network namespace.

use std::process::Command;

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("could not run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ipvsadm() -> String {
    std::env::var("IPVSADM").unwrap_or_else(|_| "/usr/sbin/ipvsadm".into())
}

/// Service lines in `ipvsadm -Ln` output (protocol first: TCP, UDP, SCTP or FWM).
fn services(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter(|l| {
            ["TCP ", "UDP ", "SCTP ", "FWM "]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn runs_inside_the_vm() {
    assert_eq!(
        std::env::var("KUBE_IPVS_VM").as_deref(),
        Ok("1"),
        "kernel tests must run through `cargo xtask vm-test`"
    );
}

#[test]
fn ipvsadm_lists_an_empty_table() {
    let listing = run(&ipvsadm(), &["-Ln"]);
    assert!(listing.contains("IP Virtual Server version"), "{listing}");
    assert_eq!(services(&listing), Vec::<String>::new());
}

/// Adds a service after checking the table is empty. Two tests do this with different
/// addresses: whichever runs second would see the first one's service if the harness did not
/// give each test its own network namespace.
fn add_service_to_empty_table(addr: &str) {
    let ipvsadm = ipvsadm();
    let before = run(&ipvsadm, &["-Ln"]);
    assert_eq!(
        services(&before),
        Vec::<String>::new(),
        "table not empty at start:\n{before}"
    );
    run(&ipvsadm, &["-A", "-t", addr, "-s", "rr"]);
    run(&ipvsadm, &["-a", "-t", addr, "-r", "10.99.0.2:8080", "-m"]);
    let after = services(&run(&ipvsadm, &["-Ln"]));
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(after[0].contains(addr), "{after:?}");
}

#[test]
fn netns_isolation_first() {
    add_service_to_empty_table("10.96.0.1:80");
}

#[test]
fn netns_isolation_second() {
    add_service_to_empty_table("10.96.0.2:443");
}

#[test]
fn dummy_link_can_be_created() {
    run("/usr/sbin/ip", &["link", "add", "kipvs0", "type", "dummy"]);
    run(
        "/usr/sbin/ip",
        &["addr", "add", "10.96.0.10/32", "dev", "kipvs0"],
    );
    let shown = run("/usr/sbin/ip", &["-o", "addr", "show", "dev", "kipvs0"]);
    assert!(shown.contains("10.96.0.10/32"), "{shown}");
}

#[test]
fn loopback_is_up_in_the_test_namespace() {
    let shown = run("/usr/sbin/ip", &["-o", "link", "show", "lo"]);
    assert!(shown.contains("UP"), "{shown}");
}

/// `vm-test` ships the daemon for end-to-end tests; check it is there and that the dynamic
/// loader finds all its libraries (fails under `vm-test --no-daemon`, which skips shipping it).
#[test]
fn daemon_binary_is_shipped_with_its_libraries() {
    let daemon = "/usr/local/bin/kube-ipvs";
    let meta = std::fs::metadata(daemon).unwrap_or_else(|e| panic!("{daemon}: {e}"));
    assert!(meta.is_file(), "{daemon} is not a file");
    let libs = run("/lib64/ld-linux-x86-64.so.2", &["--list", daemon]);
    assert!(!libs.contains("not found"), "{libs}");
}

/// The boot modules include every IPVS scheduler the kernel has (6.1 lacks `twos`); a service
/// can be created with each, which fails if its module was not loaded.
#[test]
fn every_scheduler_module_is_loaded() {
    let ipvsadm = ipvsadm();
    let schedulers = [
        "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh",
    ];
    for (i, sched) in schedulers.iter().enumerate() {
        let module = format!("/sys/module/ip_vs_{sched}");
        assert!(std::path::Path::new(&module).exists(), "{module} missing");
        let addr = format!("10.97.0.{}:80", i + 1);
        run(&ipvsadm, &["-A", "-t", &addr, "-s", sched]);
    }
    let listing = run(&ipvsadm, &["-Ln"]);
    assert_eq!(services(&listing).len(), schedulers.len(), "{listing}");
}
