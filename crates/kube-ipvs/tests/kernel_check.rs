//! Kernel tests (run in the VM by `cargo xtask vm-test`): the real binary programs the kernel
//! from the example manifests with `plan --apply`, then `check` must say in sync (exit 0); after
//! a stale endpoint, a deleted virtual server or a removed address it must say which Service is
//! out of sync and why (exit 1). `ipvsadm -Ln` and `ip addr` confirm what the kernel holds.
//!
//! Each test runs in its own network namespace (fresh IPVS table, no `kube-ipvs0`), and writes
//! its manifests to its own directory under the shared `/tmp`.
#![cfg(feature = "kernel-tests")]

mod common;
use common::*;

use std::path::PathBuf;

/// Programs the kernel from the manifests and checks that `check` agrees: the common start.
fn apply_and_expect_in_sync(dir: &std::path::Path) {
    node_address();
    let out = kube_ipvs("plan", dir, &["--apply"]);
    assert_eq!(out.status.code(), Some(0), "plan --apply failed");
    assert!(
        stdout(&out).contains("applied 28 of 28 operations"),
        "{}",
        stdout(&out)
    );
    let out = kube_ipvs("check", dir, &[]);
    assert_eq!(out.status.code(), Some(0), "check after apply");
    assert!(stdout(&out).contains("in sync: 8 virtual servers, 15 real servers, 5 addresses"));
}

fn ipvsadm_list(args: &[&str]) -> String {
    let mut a = vec!["-Ln"];
    a.extend_from_slice(args);
    let out = run(&ipvsadm_bin(), &a);
    assert!(out.status.success(), "ipvsadm -Ln {args:?}");
    stdout(&out)
}

fn kube_ipvs0_addresses() -> String {
    let out = run("/usr/sbin/ip", &["-o", "addr", "show", "dev", "kube-ipvs0"]);
    assert!(out.status.success(), "ip addr show kube-ipvs0");
    stdout(&out)
}

#[test]
fn check_is_in_sync_after_plan_apply() {
    let dir = manifests("check-in-sync");
    apply_and_expect_in_sync(&dir);
    // The kernel holds what the plan said, as ipvsadm reads it.
    let web = ipvsadm_list(&["-t", "10.96.0.10:80"]);
    for dest in ["10.244.1.10:8080", "10.244.2.10:8080", "10.244.3.10:8080"] {
        assert!(web.contains(&format!("-> {dest}")), "{web}");
    }
    assert!(web.contains("Masq"), "{web}");
    let sticky = ipvsadm_list(&["-t", "10.96.0.20:443"]);
    assert!(sticky.contains("persistent 600"), "{sticky}");
    let dns = ipvsadm_list(&["-u", "10.96.0.53:53"]);
    assert!(dns.contains("-> 10.244.2.53:53"), "{dns}");
    let nodeport = ipvsadm_list(&["-t", "192.168.56.10:30080"]);
    assert!(nodeport.contains("-> 10.244.1.30:8080"), "{nodeport}");
    assert!(
        !nodeport.contains("10.244.2.30"),
        "Local policy: only node-1's endpoint\n{nodeport}"
    );
    let addrs = kube_ipvs0_addresses();
    for a in ["10.96.0.10/32", "10.96.0.20/32", "10.96.0.53/32"] {
        assert!(addrs.contains(a), "{addrs}");
    }
    assert!(!addrs.contains("192.168.56.10"), "node IPs are never bound");
    // A second plan against the programmed kernel has nothing to do.
    let out = kube_ipvs("plan", &dir, &[]);
    assert_eq!(stdout(&out), "0 operations: the kernel already matches\n");
}

#[test]
fn check_reports_a_stale_endpoint() {
    let dir = manifests("check-stale-endpoint");
    apply_and_expect_in_sync(&dir);
    // The endpoint 10.244.3.10 is replaced by 10.244.3.11 in the API's view.
    let web = std::fs::read_to_string(dir.join("web.yaml")).expect("read");
    std::fs::write(
        dir.join("web.yaml"),
        web.replace("10.244.3.10", "10.244.3.11"),
    )
    .expect("write");
    let out = kube_ipvs("check", &dir, &[]);
    assert_eq!(out.status.code(), Some(1), "check must fail");
    let text = stdout(&out);
    assert!(
        text.contains(
            "default/web:\n  missing real server TCP 10.96.0.10:80 -> 10.244.3.11:8080 masq weight 1\n  \
             stale real server TCP 10.96.0.10:80 -> 10.244.3.10:8080 masq weight 1\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("NOT in sync: 2 findings in 1 group "),
        "{text}"
    );
    assert!(ipvsadm_list(&["-t", "10.96.0.10:80"]).contains("-> 10.244.3.10:8080"));
    // Applying again adds the new endpoint and drains the old one (weight 0: no connection
    // counts are known), which check accepts as in sync and notes.
    let out = kube_ipvs("plan", &dir, &["--apply"]);
    assert_eq!(out.status.code(), Some(0));
    let out = kube_ipvs("check", &dir, &[]);
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("10.244.3.10:8080 is draining"));
    let web = ipvsadm_list(&["-t", "10.96.0.10:80"]);
    assert!(web.contains("-> 10.244.3.11:8080"), "{web}");
    let drained = web
        .lines()
        .find(|l| l.contains("10.244.3.10:8080"))
        .unwrap_or_else(|| panic!("draining real server kept\n{web}"));
    assert_eq!(
        drained.split_whitespace().nth(3),
        Some("0"),
        "weight 0: {drained}"
    );
}

#[test]
fn check_reports_a_missing_service() {
    let dir = manifests("check-missing-service");
    apply_and_expect_in_sync(&dir);
    let out = run(&ipvsadm_bin(), &["-D", "-t", "10.96.0.20:443"]);
    assert!(out.status.success(), "ipvsadm -D");
    assert!(!ipvsadm_list(&[]).contains("10.96.0.20:443"));
    let out = kube_ipvs("check", &dir, &[]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains(
            "default/sticky:\n  missing virtual server TCP 10.96.0.20:443 rr persistent 600 (wants 2 real servers)\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("NOT in sync: 1 finding in 1 group "),
        "{text}"
    );
    // And the plan repairs exactly that.
    let out = kube_ipvs("plan", &dir, &[]);
    assert!(
        stdout(&out).ends_with("3 operations: 1 add service, 2 add dest\n"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn check_reports_a_missing_address() {
    let dir = manifests("check-missing-address");
    apply_and_expect_in_sync(&dir);
    let out = run(
        "/usr/sbin/ip",
        &["addr", "del", "10.96.0.53/32", "dev", "kube-ipvs0"],
    );
    assert!(out.status.success(), "ip addr del");
    assert!(!kube_ipvs0_addresses().contains("10.96.0.53/32"));
    let out = kube_ipvs("check", &dir, &[]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains("kube-system/dns:\n  missing address 10.96.0.53 on kube-ipvs0\n"),
        "{text}"
    );
    // An address no Service asks for is reported too, under no Service.
    let out = run(
        "/usr/sbin/ip",
        &["addr", "add", "10.96.9.9/32", "dev", "kube-ipvs0"],
    );
    assert!(out.status.success(), "ip addr add");
    let text = stdout(&kube_ipvs("check", &dir, &[]));
    assert!(
        text.contains("(no Service):\n  extra address 10.96.9.9 on kube-ipvs0\n"),
        "{text}"
    );
    // With that network excluded, it belongs to someone else and is not reported.
    let text = stdout(&kube_ipvs(
        "check",
        &dir,
        &["--exclude-cidrs", "10.96.9.0/24"],
    ));
    assert!(!text.contains("10.96.9.9"), "{text}");
}

#[test]
fn a_failed_op_is_reported_with_its_service_and_the_rest_applies() {
    // The guest kernel (6.1) has no `twos` scheduler, so creating this virtual server fails
    // with ENOENT while every other Service's ops must still apply.
    assert!(
        !std::path::Path::new("/sys/module/ip_vs_twos").exists(),
        "this test needs a kernel without ip_vs_twos; pick another missing scheduler"
    );
    node_address();
    let dir = manifests("check-failed-op");
    let odd = "apiVersion: v1\nkind: Service\nmetadata:\n  name: odd\n  namespace: default\n  \
               annotations: {kube-ipvs.io/scheduler: twos}\nspec:\n  clusterIP: 10.96.0.77\n  \
               ports:\n  - {name: http, port: 80, protocol: TCP}\n---\n\
               apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: odd-1\n  \
               namespace: default\n  labels: {kubernetes.io/service-name: odd}\naddressType: IPv4\n\
               endpoints:\n- addresses: [10.244.1.77]\nports:\n- {name: http, port: 8080, protocol: TCP}\n";
    std::fs::write(dir.join("odd.yaml"), odd).expect("write");
    let out = kube_ipvs("plan", &dir, &["--apply"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a failed op makes plan --apply exit 1"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "failed: service default/odd: add service TCP 10.96.0.77:80 twos: \
             add service TCP 10.96.0.77:80: unknown scheduler"
        ),
        "{err}"
    );
    assert!(
        err.contains("failed: service default/odd: add dest TCP 10.96.0.77:80 -> 10.244.1.77:8080"),
        "{err}"
    );
    assert!(
        stdout(&out).contains("applied 29 of 31 operations"),
        "{}",
        stdout(&out)
    );
    // Everything else is in the kernel; check names only the failed Service.
    let out = kube_ipvs("check", &dir, &[]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains(
            "default/odd:\n  missing virtual server TCP 10.96.0.77:80 twos (wants 1 real server)\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("NOT in sync: 1 finding in 1 group "),
        "{text}"
    );
    assert!(ipvsadm_list(&[]).contains("TCP  10.96.0.10:80 rr"));
}

#[test]
fn dual_stack_persistence_and_scheduler_flags_round_trip_through_the_kernel() {
    // What the executor writes (IPv6 keys, a /128 persistence netmask, mh flags, UDP) must read
    // back as exactly what the engine asked for, or check and plan would see drift forever.
    let dir = PathBuf::from("/tmp/kube-ipvs-check-dual-stack");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create manifest dir");
    let yaml = "apiVersion: v1\nkind: Service\nmetadata:\n  name: ds\n  namespace: default\n  \
                annotations: {kube-ipvs.io/scheduler: \"mh:fallback,port\"}\nspec:\n  \
                clusterIP: 10.96.0.66\n  clusterIPs: [10.96.0.66, \"fd00:96::66\"]\n  \
                ipFamilies: [IPv4, IPv6]\n  sessionAffinity: ClientIP\n  \
                sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}\n  ports:\n  \
                - {name: dns, port: 53, protocol: UDP}\n---\n\
                apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: ds-v4\n  \
                namespace: default\n  labels: {kubernetes.io/service-name: ds}\naddressType: IPv4\n\
                endpoints:\n- addresses: [10.244.1.66]\nports:\n- {name: dns, port: 5353, protocol: UDP}\n---\n\
                apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: ds-v6\n  \
                namespace: default\n  labels: {kubernetes.io/service-name: ds}\naddressType: IPv6\n\
                endpoints:\n- addresses: [\"fd00:244::66\"]\nports:\n- {name: dns, port: 5353, protocol: UDP}\n";
    std::fs::write(dir.join("ds.yaml"), yaml).expect("write");
    let out = kube_ipvs("plan", &dir, &["--apply"]);
    assert_eq!(out.status.code(), Some(0), "plan --apply");
    assert!(
        stdout(&out).contains("add service UDP [fd00:96::66]:53 mh:fallback,port persistent 300\n"),
        "{}",
        stdout(&out)
    );
    let out = kube_ipvs("check", &dir, &[]);
    assert_eq!(out.status.code(), Some(0), "check after apply");
    let out = kube_ipvs("plan", &dir, &[]);
    assert_eq!(stdout(&out), "0 operations: the kernel already matches\n");
    let v6 = ipvsadm_list(&["-u", "[fd00:96::66]:53"]);
    assert!(v6.contains("mh-fallback,mh-port"), "{v6}");
    assert!(v6.contains("persistent 300"), "{v6}");
    assert!(v6.contains("-> [fd00:244::66]:5353"), "{v6}");
    let v4 = ipvsadm_list(&["-u", "10.96.0.66:53"]);
    assert!(v4.contains("-> 10.244.1.66:5353"), "{v4}");
    assert!(
        !v4.contains("fd00"),
        "an endpoint backs only its own family\n{v4}"
    );
    let addrs = kube_ipvs0_addresses();
    assert!(addrs.contains("fd00:96::66/128"), "{addrs}");
}

/// A bad Service beside the example cluster: `check` still compares everything else, says in
/// its text and its JSON what it left out, and counts in words a person reads.
#[test]
fn check_says_what_it_skipped_in_text_and_json() {
    let dir = manifests("check-skipped");
    std::fs::write(
        dir.join("bad.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: bad, namespace: default}\n\
         spec:\n  type: ClusterIP\n  clusterIP: 10.96.0.300\n  ports: [{port: 80}]\n",
    )
    .expect("write bad.yaml");
    let out = kube_ipvs("plan", &dir, &["--apply"]);
    assert_eq!(out.status.code(), Some(0), "plan --apply");
    let line = "skipping bad object, keeping its last good state: Service default/bad: \
                clusterIP \"10.96.0.300\" is not an IP address";
    let out = kube_ipvs("check", &dir, &[]);
    assert_eq!(out.status.code(), Some(0), "the rest is in sync");
    let text = stdout(&out);
    assert!(text.contains(&format!("skipped: {line}\n")), "{text}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("kube-ipvs check: {line}")),
        "stderr names it too"
    );
    let out = kube_ipvs("check", &dir, &["--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["skipped"], serde_json::json!([line]), "{json}");
    assert_eq!(json["in_sync"], serde_json::json!(true));
}
