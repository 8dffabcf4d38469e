//! The API-server source of `plan`/`check`/`explain`, against the project's test API server
//! (the list/watch protocol over HTTP, through kube-rs): one listing of the example cluster must
//! give exactly the plan the same objects give from manifests, and an unreachable server must
//! be a clear error with exit 2.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kube_ipvs_integration::TestApiServer;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster")
}

fn kube_ipvs(args: Vec<String>) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kube-ipvs"))
        .args(args)
        .output()
        .expect("run kube-ipvs")
}

/// A kubeconfig naming only the server, written to a file of this test's own.
fn kubeconfig(url: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kube-ipvs-api-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"{url}\"}}\n\
         users:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test}}\n\
         current-context: test\n"
    );
    std::fs::write(&path, text).expect("write kubeconfig");
    path
}

fn args(cmd: &[&str], source: &[&str]) -> Vec<String> {
    cmd.iter()
        .chain(source)
        .chain(&["--hostname-override", "node-1"])
        .map(|s| (*s).to_owned())
        .collect()
}

fn path_str(p: &Path) -> String {
    p.to_str().expect("utf-8 path").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_from_the_api_server_matches_plan_from_manifests() {
    let (server, url) = TestApiServer::start().await.expect("test API server");
    let m = kube_ipvs_watch::manifest::load(&examples()).expect("example manifests");
    for s in &m.services {
        server.create(s).expect("create Service");
    }
    for s in &m.slices {
        server.create(s).expect("create EndpointSlice");
    }
    for n in &m.nodes {
        server.create(n).expect("create Node");
    }
    let kc = path_str(&kubeconfig(&url, "plan"));
    let manifests = path_str(&examples());
    let (from_api, from_files) = tokio::task::spawn_blocking(move || {
        (
            kube_ipvs(args(&["plan", "--from-empty"], &["--kubeconfig", &kc])),
            kube_ipvs(args(
                &["plan", "--from-empty"],
                &["--manifests", &manifests],
            )),
        )
    })
    .await
    .expect("join");
    let api_text = String::from_utf8_lossy(&from_api.stdout);
    assert_eq!(
        from_api.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&from_api.stderr)
    );
    assert!(
        api_text.ends_with("28 operations: 5 add address, 8 add service, 15 add dest\n"),
        "{api_text}"
    );
    // The Node object from the API gave the NodePort address.
    assert!(
        api_text.contains("192.168.56.10:30080 -> 10.244.1.30:8080"),
        "{api_text}"
    );
    assert_eq!(api_text, String::from_utf8_lossy(&from_files.stdout));
    assert!(
        server.requests() >= 3,
        "Services, EndpointSlices and the Node were asked for"
    );
}

#[test]
fn an_unreachable_api_server_is_exit_2_with_the_step_named() {
    // Port 1 on loopback: nothing listens, so the connection is refused at once.
    let kc = path_str(&kubeconfig("http://127.0.0.1:1", "down"));
    let out = kube_ipvs(args(&["check"], &["--kubeconfig", &kc]));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("kube-ipvs check: list Services: "), "{err}");
    let out = kube_ipvs(args(
        &["plan", "--from-empty"],
        &["--kubeconfig", "/nonexistent/kubeconfig"],
    ));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("kube-ipvs plan: kubeconfig /nonexistent/kubeconfig: "),
        "{err}"
    );
}
