//! Bad input, one object of each malformed kind the agent can meet, beside the example cluster,
//! through the real binary (`kube-ipvs plan --from-empty`, the desired state `run` programs) from
//! both sources: the manifests, and the test API server over the real kube-rs client
//! (`--master`). Each case must leave every example Service programmed exactly as without it,
//! name the bad object (and why) on stderr when it is skipped, exit 0, and never panic.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kube_ipvs_integration::TestApiServer;

/// A case: its name, the YAML documents it adds, what stderr must say (all of it), and the
/// operations it must add to the example cluster's.
struct Case {
    name: &'static str,
    yaml: String,
    says: Vec<&'static str>,
    adds: Vec<String>,
}

fn service(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: bad}}\nspec:\n{spec}"
    )
}

/// An IPv4 EndpointSlice `NAME-1` of Service `NAME`, with these endpoint addresses and port.
fn slice(name: &str, addresses: &[&str], port: u32) -> String {
    let endpoints: String = addresses
        .iter()
        .map(|a| format!("- addresses: [{a}]\n"))
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
         namespace: bad\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\n\
         endpoints:\n{endpoints}ports:\n- {{port: {port}, protocol: TCP}}\n"
    )
}

fn cases() -> Vec<Case> {
    let many_ports: String = (0..1000)
        .map(|i| format!("  - {{name: p{i}, port: {}, protocol: TCP}}\n", 20000 + i))
        .collect();
    vec![
        Case {
            name: "bad-ip",
            yaml: service(
                "bad-ip",
                "  clusterIP: 10.96.500.1\n  ports:\n  - {port: 80, protocol: TCP}\n",
            ),
            says: vec!["Service bad/bad-ip", "\"10.96.500.1\" is not an IP address"],
            adds: vec![],
        },
        Case {
            name: "port-out-of-range",
            yaml: service(
                "wide",
                "  clusterIP: 10.96.7.1\n  ports:\n  - {port: 70000, protocol: TCP}\n",
            ),
            says: vec!["Service bad/wide", "port 70000 is out of range"],
            adds: vec![],
        },
        Case {
            name: "node-port-out-of-range",
            yaml: service(
                "np",
                "  type: NodePort\n  clusterIP: 10.96.7.2\n  ports:\n  \
                 - {port: 80, nodePort: 99999, protocol: TCP}\n",
            ),
            says: vec!["Service bad/np", "99999"],
            adds: vec![],
        },
        Case {
            name: "unknown-protocol",
            yaml: service(
                "icmp",
                "  clusterIP: 10.96.7.3\n  ports:\n  - {port: 80, protocol: ICMP}\n",
            ),
            says: vec!["Service bad/icmp", "unknown protocol \"ICMP\""],
            adds: vec![],
        },
        Case {
            name: "duplicate-ports",
            yaml: service(
                "dup",
                "  clusterIP: 10.96.7.4\n  ports:\n  - {name: a, port: 80, protocol: TCP}\n  \
                 - {name: b, port: 80, protocol: TCP}\n",
            ),
            says: vec!["Service bad/dup", "duplicate TCP port 80"],
            adds: vec![],
        },
        Case {
            name: "a-thousand-ports",
            yaml: service(
                "many",
                &format!("  clusterIP: 10.96.7.5\n  ports:\n{many_ports}"),
            ),
            says: vec![],
            adds: (0..1000)
                .map(|i| format!("add service TCP 10.96.7.5:{} rr", 20000 + i))
                .chain(["add address 10.96.7.5 to kube-ipvs0".to_owned()])
                .collect(),
        },
        Case {
            name: "absurd-scheduler-annotation",
            yaml: "apiVersion: v1\nkind: Service\nmetadata:\n  name: odd\n  namespace: bad\n  \
                   annotations: {kube-ipvs.io/scheduler: \"rr; rm -rf /\"}\nspec:\n  \
                   clusterIP: 10.96.7.6\n  ports:\n  - {port: 80, protocol: TCP}\n"
                .to_owned(),
            says: vec!["bad/odd", "rr; rm -rf /"],
            // Served with the node's default scheduler.
            adds: vec![
                "add address 10.96.7.6 to kube-ipvs0".to_owned(),
                "add service TCP 10.96.7.6:80 rr".to_owned(),
            ],
        },
        Case {
            name: "absurd-affinity-timeout",
            yaml: service(
                "sticky",
                "  clusterIP: 10.96.7.7\n  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    \
                 clientIP: {timeoutSeconds: -5}\n  ports:\n  - {port: 80, protocol: TCP}\n",
            ),
            says: vec!["Service bad/sticky", "timeoutSeconds -5 is negative"],
            adds: vec![],
        },
        Case {
            name: "endpoint-with-a-bad-address",
            yaml: format!(
                "{}---\n{}",
                service(
                    "ok",
                    "  clusterIP: 10.96.7.8\n  ports:\n  - {port: 80, targetPort: 8080, protocol: TCP}\n"
                ),
                slice("ok", &["10.244.1.999", "fd00::1", "10.244.1.77"], 8080)
            ),
            says: vec!["EndpointSlice bad/ok-1", "10.244.1.999", "fd00::1"],
            // The good endpoint of the same slice is still used.
            adds: vec![
                "add address 10.96.7.8 to kube-ipvs0".to_owned(),
                "add service TCP 10.96.7.8:80 rr".to_owned(),
                "add dest TCP 10.96.7.8:80 -> 10.244.1.77:8080 masq weight 1".to_owned(),
            ],
        },
        Case {
            // Not malformed (its Service may come later): nothing is programmed for it, as in
            // kube-proxy, and nothing is said.
            name: "slice-of-a-missing-service",
            yaml: slice("ghost", &["10.244.1.78"], 8080),
            says: vec![],
            adds: vec![],
        },
        Case {
            // A slice whose addressType is neither IPv4, IPv6 nor FQDN: the slice is skipped by
            // name and its Service stays, without endpoints.
            name: "unknown-address-type",
            yaml: format!(
                "{}---\n{}",
                service(
                    "typed",
                    "  clusterIP: 10.96.7.10\n  ports:\n  - {port: 80, protocol: TCP}\n"
                ),
                slice("typed", &["10.244.1.80"], 8080)
                    .replace("addressType: IPv4", "addressType: IPv5")
            ),
            says: vec!["EndpointSlice bad/typed-1", "IPv5"],
            adds: vec![
                "add address 10.96.7.10 to kube-ipvs0".to_owned(),
                "add service TCP 10.96.7.10:80 rr".to_owned(),
            ],
        },
        Case {
            name: "endpoint-port-out-of-range",
            yaml: format!(
                "{}---\n{}",
                service(
                    "far",
                    "  clusterIP: 10.96.7.9\n  ports:\n  - {port: 80, protocol: TCP}\n"
                ),
                slice("far", &["10.244.1.79"], 123_456)
            ),
            says: vec!["EndpointSlice bad/far-1", "123456"],
            adds: vec![
                "add address 10.96.7.9 to kube-ipvs0".to_owned(),
                "add service TCP 10.96.7.9:80 rr".to_owned(),
            ],
        },
    ]
}

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster")
}

fn plan(source: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kube-ipvs"))
        .args(["plan", "--from-empty", "--hostname-override", "node-1"])
        .args(source)
        .output()
        .expect("run kube-ipvs")
}

/// The operation lines of a plan (its last line is the summary).
fn ops(out: &Output) -> BTreeSet<String> {
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    lines.pop();
    lines.into_iter().collect()
}

/// The checks every case shares, for one source.
fn check(case: &Case, source: &str, out: &Output, baseline: &BTreeSet<String>) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let at = format!("case {} from {source}", case.name);
    assert_eq!(out.status.code(), Some(0), "{at}: exit\n{stderr}");
    assert!(!stderr.contains("panicked"), "{at}: panic\n{stderr}");
    for s in &case.says {
        assert!(stderr.contains(s), "{at}: stderr lacks {s:?}\n{stderr}");
    }
    if case.says.is_empty() {
        assert!(!stderr.contains("bad/"), "{at}: said something\n{stderr}");
    }
    let got = ops(out);
    let mut want = baseline.clone();
    want.extend(case.adds.iter().cloned());
    assert_eq!(
        got.difference(&want).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "{at}: operations beyond the example cluster's and the case's"
    );
    assert_eq!(
        want.difference(&got).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "{at}: operations missing"
    );
}

fn write_dir(dir: &Path, extra: Option<&str>) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("mkdir");
    for entry in std::fs::read_dir(examples()).expect("examples") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
    }
    if let Some(yaml) = extra {
        std::fs::write(dir.join("zz-bad.yaml"), yaml).expect("write");
    }
}

#[test]
fn each_bad_object_from_manifests_is_skipped_by_name_and_the_rest_is_programmed() {
    let base = std::env::temp_dir().join(format!("kube-ipvs-bad-input-{}", std::process::id()));
    let baseline_dir = base.join("baseline");
    write_dir(&baseline_dir, None);
    let out = plan(&["--manifests", baseline_dir.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0));
    let baseline = ops(&out);
    assert!(
        baseline.len() > 20,
        "the example cluster plans {baseline:?}"
    );
    for case in cases() {
        let dir = base.join(case.name);
        write_dir(&dir, Some(&case.yaml));
        let out = plan(&["--manifests", dir.to_str().expect("utf-8")]);
        check(&case, "manifests", &out, &baseline);
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// The same objects through the API: the test API server stores what it is given (it does not
/// validate as kube-apiserver would, so these reach the client as a buggy or hostile server
/// could send them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bad_object_from_the_api_is_skipped_by_name_and_the_rest_is_programmed() {
    let docs = |text: &str| -> Vec<serde_json::Value> {
        serde_saphyr::from_multiple::<serde_json::Value>(text)
            .expect("YAML")
            .into_iter()
            .filter(|d| !d.is_null())
            .collect()
    };
    let examples: Vec<serde_json::Value> = std::fs::read_dir(examples())
        .expect("examples")
        .flat_map(|e| docs(&std::fs::read_to_string(e.expect("entry").path()).expect("read")))
        .collect();
    let fresh = || async {
        let (server, url) = TestApiServer::start().await.expect("test API server");
        for d in &examples {
            server
                .create_json(d.clone())
                .expect("create an example object");
        }
        (server, url)
    };
    let run = |url: String| tokio::task::spawn_blocking(move || plan(&["--master", &url]));
    let (_server, url) = fresh().await;
    let out = run(url).await.expect("plan");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let baseline = ops(&out);
    assert!(
        baseline.len() > 20,
        "the example cluster plans {baseline:?}"
    );
    for case in cases() {
        let (server, url) = fresh().await;
        for d in docs(&case.yaml) {
            server.create_json(d).expect("create the case's object");
        }
        let out = run(url).await.expect("plan");
        check(&case, "the API", &out, &baseline);
    }
}
