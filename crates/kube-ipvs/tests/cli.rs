//! Host tests of `plan --from-empty`, `explain` and the error exits of `check`, by running the
//! real binary on the example manifests. None of them needs root or IPVS.

use std::path::PathBuf;
use std::process::{Command, Output};

fn examples(file: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/cluster")
        .join(file);
    p.to_str().expect("utf-8 path").to_owned()
}

fn kube_ipvs(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kube-ipvs"))
        .args(args)
        .output()
        .expect("run kube-ipvs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn plan_from_empty_prints_the_ops_for_one_service() {
    let out = kube_ipvs(&[
        "plan",
        "--from-empty",
        "--manifests",
        &examples("web.yaml"),
        "--hostname-override",
        "node-1",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "add address 10.96.0.10 to kube-ipvs0\n\
         add service TCP 10.96.0.10:80 rr\n\
         add dest TCP 10.96.0.10:80 -> 10.244.1.10:8080 masq weight 1\n\
         add dest TCP 10.96.0.10:80 -> 10.244.2.10:8080 masq weight 1\n\
         add dest TCP 10.96.0.10:80 -> 10.244.3.10:8080 masq weight 1\n\
         5 operations: 1 add address, 1 add service, 3 add dest\n"
    );
}

#[test]
fn plan_from_empty_covers_the_whole_example_cluster() {
    let out = kube_ipvs(&[
        "plan",
        "--from-empty",
        "--manifests",
        &examples(""),
        "--hostname-override",
        "node-1",
        "--scheduler",
        "wlc",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let plan = text(&out.stdout);
    assert!(
        plan.ends_with("28 operations: 5 add address, 8 add service, 15 add dest\n"),
        "{plan}"
    );
    // The node flag's scheduler is the default; ClientIP affinity makes a persistent server.
    assert!(
        plan.contains("add service TCP 10.96.0.10:80 wlc\n"),
        "{plan}"
    );
    assert!(
        plan.contains("add service TCP 10.96.0.20:443 wlc persistent 600\n"),
        "{plan}"
    );
    assert!(
        plan.contains("add service UDP 10.96.0.53:53 wlc\n"),
        "{plan}"
    );
    // The NodePort listens on the Node object's InternalIP; under Local only node-1's endpoint.
    assert!(
        plan.contains("add dest TCP 192.168.56.10:30080 -> 10.244.1.30:8080"),
        "{plan}"
    );
    assert!(
        !plan.contains("192.168.56.10:30080 -> 10.244.2.30"),
        "{plan}"
    );
    assert!(!plan.contains("add address 192.168.56.10"), "{plan}");
    // Only the ready endpoint of api.
    assert!(plan.contains("10.96.0.40:80 -> 10.244.1.40:8080"), "{plan}");
    assert!(
        !plan.contains("10.244.2.40") && !plan.contains("10.244.3.40"),
        "{plan}"
    );

    // Another node sees the NodePort with the other endpoint, on the address given by flag.
    let out = kube_ipvs(&[
        "plan",
        "--from-empty",
        "--manifests",
        &examples(""),
        "--hostname-override",
        "node-2",
        "--node-ip",
        "192.168.56.11",
    ]);
    let plan = text(&out.stdout);
    assert!(
        plan.contains("add dest TCP 192.168.56.11:30080 -> 10.244.2.30:8080"),
        "{plan}"
    );
    assert!(!plan.contains("192.168.56.10"), "{plan}");
}

#[test]
fn explain_gives_each_endpoint_a_verdict() {
    let out = kube_ipvs(&[
        "explain",
        "10.96.0.40:80",
        "--manifests",
        &examples(""),
        "--hostname-override",
        "node-1",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(
        s.contains("TCP 10.96.0.40:80 is Service default/api port http (TCP 80) via ClusterIP\n"),
        "{s}"
    );
    assert!(
        s.contains("virtual server TCP 10.96.0.40:80 rr with 1 real server\n"),
        "{s}"
    );
    assert!(s.contains("  10.244.1.40:8080 ready=true serving=true terminating=false node=node-1 zone=(none)\n    -> real server: ready\n"), "{s}");
    assert!(s.contains("  10.244.2.40:8080 ready=false serving=false terminating=false node=node-2 zone=(none)\n    -> not a real server: not ready\n"), "{s}");
    assert!(s.contains("  10.244.3.40:8080 ready=false serving=true terminating=true node=node-3 zone=(none)\n    -> not a real server: serving but terminating; terminating endpoints are used only when none is ready\n"), "{s}");

    let out = kube_ipvs(&[
        "explain",
        "192.168.56.10:30080/tcp",
        "--manifests",
        &examples(""),
        "--hostname-override",
        "node-1",
    ]);
    let s = text(&out.stdout);
    assert!(s.contains("-> not a real server: on node node-2, not this node, and externalTrafficPolicy is Local"), "{s}");
}

#[test]
fn explain_exits_1_for_no_service_and_2_for_a_bad_target() {
    let m = examples("");
    let out = kube_ipvs(&[
        "explain",
        "10.96.0.10:81",
        "--manifests",
        &m,
        "--hostname-override",
        "node-1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).contains("no Service port has this address"));
    let out = kube_ipvs(&[
        "explain",
        "10.96.0.10",
        "--manifests",
        &m,
        "--hostname-override",
        "node-1",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).starts_with("kube-ipvs explain: \"10.96.0.10\": expected IP:PORT"));
}

#[test]
fn check_and_plan_exit_2_on_bad_input_before_touching_the_kernel() {
    let dir = std::env::temp_dir().join(format!("kube-ipvs-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "kind: Service\nspec: [not, a, map\n").expect("write");
    let bad = bad.to_str().expect("utf-8").to_owned();
    let out = kube_ipvs(&[
        "check",
        "--manifests",
        &bad,
        "--hostname-override",
        "node-1",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("kube-ipvs check: manifest ") && err.contains("bad.yaml"),
        "{err}"
    );
    let out = kube_ipvs(&[
        "plan",
        "--from-empty",
        "--manifests",
        &examples(""),
        "--hostname-override",
        "node-1",
        "--scheduler",
        "fastest",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).starts_with("kube-ipvs plan: --scheduler \"fastest\""),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The manifests of issue 20: one good Service whose EndpointSlice's second endpoint address is
/// `not-an-ip`, and one bad Service (`clusterIP: 10.96.0.300`, `port: 99999`).
const BAD_INPUT: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: shop, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.77
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.300
  ports: [{name: http, port: 99999, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: shop-abc
  namespace: default
  labels: {kubernetes.io/service-name: shop}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.9.9]
  conditions: {ready: true}
  nodeName: node-2
- addresses: [not-an-ip]
  conditions: {ready: true}
  nodeName: node-2
"#;

/// `kube-ipvs plan --from-empty` on a manifest directory, as node-1.
fn plan_from_empty(dir: &std::path::Path) -> Output {
    kube_ipvs(&[
        "plan",
        "--from-empty",
        "--manifests",
        dir.to_str().expect("utf-8"),
        "--hostname-override",
        "node-1",
    ])
}

/// A directory of its own holding `files`.
fn manifest_dir(tag: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kube-ipvs-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (name, body) in files {
        std::fs::write(dir.join(name), body).expect("write manifest");
    }
    dir
}

#[test]
fn plan_says_what_it_skipped_and_a_bad_endpoint_costs_only_itself() {
    let dir = manifest_dir("skipped", &[("all.yaml", BAD_INPUT)]);
    let out = plan_from_empty(&dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "add address 10.96.0.77 to kube-ipvs0\n\
         add service TCP 10.96.0.77:80 rr\n\
         add dest TCP 10.96.0.77:80 -> 10.244.9.9:8080 masq weight 1\n\
         3 operations: 1 add address, 1 add service, 1 add dest\n",
        "the slice's valid endpoint stays"
    );
    let err = text(&out.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines,
        [
            "kube-ipvs plan: EndpointSlice default/shop-abc: endpoints[1] address \"not-an-ip\" \
             is not an IP address; this endpoint is skipped, the slice's others stay",
            "kube-ipvs plan: skipping bad object, keeping its last good state: Service \
             default/bad: clusterIP \"10.96.0.300\" is not an IP address",
        ],
        "{err}"
    );
}

#[test]
fn explain_names_the_endpoint_its_slice_lost() {
    let dir = manifest_dir("explain-skipped", &[("all.yaml", BAD_INPUT)]);
    let out = kube_ipvs(&[
        "explain",
        "10.96.0.77:80",
        "--manifests",
        dir.to_str().expect("utf-8"),
        "--hostname-override",
        "node-1",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let got = text(&out.stdout);
    assert!(got.contains("10.244.9.9"), "{got}");
    assert!(
        got.ends_with(
            "left out by translation, which may be why:\n  EndpointSlice default/shop-abc: \
             endpoints[1] address \"not-an-ip\" is not an IP address; this endpoint is skipped, \
             the slice's others stay\n"
        ),
        "{got}"
    );
    assert!(!got.contains("no EndpointSlice lists any"), "{got}");
}

#[test]
fn a_yaml_error_names_the_file_the_document_from_1_and_the_line() {
    let broken = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n---\n\
                  apiVersion: v1\nkind: Service\nmetadata: : :\n";
    let dir = manifest_dir("yaml", &[("broken.yaml", broken)]);
    let out = plan_from_empty(&dir);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        format!(
            "kube-ipvs plan: manifest {}: document 2: not valid YAML at line 7, column 11: \
             mapping values are not allowed in this context\n",
            dir.join("broken.yaml").display()
        )
    );
}

/// Started as `kube-proxy` (the image's link), the binary is `run` with kube-proxy's flags:
/// its usage is kube-proxy's, and a setting it refuses exits 4 naming it, before any kernel or
/// API access.
#[test]
fn started_as_kube_proxy_it_is_run_with_kube_proxys_flags() {
    let dir = std::env::temp_dir().join(format!("kube-proxy-alias-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let alias = dir.join("kube-proxy");
    let _ = std::fs::remove_file(&alias);
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kube-ipvs"), &alias).expect("link");
    let help = Command::new(&alias).arg("--help").output().expect("run");
    assert_eq!(help.status.code(), Some(0));
    let usage = text(&help.stdout);
    assert!(usage.contains("Usage: kube-proxy [OPTIONS]"), "{usage}");
    assert!(
        usage.contains("--cleanup") && usage.contains("--scheduler"),
        "{usage}"
    );
    let out = Command::new(&alias)
        .args([
            "--hostname-override=node-1",
            "--proxy-mode=iptables",
            "--v=2",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--proxy-mode \"iptables\""));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `KubeProxyConfiguration` as the agent's ConfigMap holds it: this node's name and the lc
/// scheduler.
const AGENT_CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: ipvs
hostnameOverride: node-1
ipvs:
  scheduler: lc
";

#[test]
fn plan_takes_what_run_takes_from_the_config_file_and_flags_still_win() {
    let dir = manifest_dir(
        "config",
        &[
            ("config.conf", AGENT_CONFIG),
            (
                "bad.conf",
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nipvs: {scheduler: fastest}\n",
            ),
        ],
    );
    let nodeports_file = dir.join("nodeports.conf");
    let config = dir.join("config.conf");
    let config = config.to_str().expect("utf-8");
    let all = examples("");
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--from-empty",
            "--manifests",
            &all,
            "--config",
            config,
        ];
        args.extend_from_slice(extra);
        kube_ipvs(&args)
    };
    // No --hostname-override and no --scheduler: both come from the file, node-1 being the
    // one whose Local-policy NodePort has its local endpoint only.
    let out = plan(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let text_out = text(&out.stdout);
    assert!(
        text_out.contains("add service TCP 10.96.0.10:80 lc\n"),
        "{text_out}"
    );
    assert!(
        text_out.contains("add dest TCP 192.168.56.10:30080 -> 10.244.1.30:8080"),
        "{text_out}"
    );
    assert!(!text_out.contains("192.168.56.11"), "{text_out}");

    // A flag wins over its key, as in `run`.
    let out = plan(&[
        "--scheduler",
        "sed",
        "--hostname-override",
        "node-2",
        "--node-ip",
        "192.168.56.11",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let text_out = text(&out.stdout);
    assert!(
        text_out.contains("add service TCP 10.96.0.10:80 sed\n"),
        "{text_out}"
    );
    assert!(
        text_out.contains("add dest TCP 192.168.56.11:30080 -> 10.244.2.30:8080"),
        "{text_out}"
    );
    assert!(!text_out.contains("192.168.56.10"), "{text_out}");

    // Without the kernel, the NodePort addresses are chosen among the Node's InternalIPs
    // (node-1's is 192.168.56.10), by flag or by the file's key.
    let nodeports = |how: &str| {
        let out = plan(&["--nodeport-addresses", how]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout).contains("add service TCP 192.168.56.10:30080 lc\n")
    };
    assert!(nodeports("192.168.56.0/24"));
    assert!(!nodeports("10.0.0.0/8"));
    assert!(nodeports("primary"));
    std::fs::write(
        &nodeports_file,
        AGENT_CONFIG.replace("mode: ipvs", "mode: ipvs\nnodePortAddresses: [10.0.0.0/8]"),
    )
    .expect("write");
    let out = kube_ipvs(&[
        "plan",
        "--from-empty",
        "--manifests",
        &all,
        "--config",
        nodeports_file.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        !text(&out.stdout).contains("192.168.56.10"),
        "{}",
        text(&out.stdout)
    );

    // A bad value in the file is named by its key, before anything is read.
    let bad = dir.join("bad.conf");
    let out = kube_ipvs(&[
        "plan",
        "--from-empty",
        "--manifests",
        &examples(""),
        "--hostname-override",
        "node-1",
        "--config",
        bad.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).starts_with("kube-ipvs plan: ipvs.scheduler \"fastest\""),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
