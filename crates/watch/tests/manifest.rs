//! The manifest source: a directory of YAML files reloaded on change, producing the same
//! change stream as the cluster. Time is paused, so the poll interval is virtual.

use std::path::PathBuf;
use std::time::Duration;

use kube_ipvs_diff::ServiceName;
use kube_ipvs_watch::manifest::{self, ManifestConfig};
use kube_ipvs_watch::{ChangeSet, ServiceChange, TranslateOptions};

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("kube-ipvs-watch-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }

    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.0.join(name), text).expect("write");
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn svc(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n\
         spec:\n  clusterIP: {ip}\n  ports: [{{name: http, port: 80}}]\n"
    )
}

fn slice(svc: &str, addr: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {svc}-1, namespace: default, labels: {{kubernetes.io/service-name: {svc}}}}}\n\
         addressType: IPv4\nendpoints: [{{addresses: [{addr}]}}]\nports: [{{name: http, port: 8080}}]\n"
    )
}

const POLL: Duration = Duration::from_secs(1);

async fn next(w: &mut kube_ipvs_watch::ClusterWatch) -> ChangeSet {
    w.changes.recv().await.expect("the change stream is open")
}

/// Lets the poller run several times in virtual time, so "nothing arrived" means nothing
/// was produced, not that it was not produced yet.
async fn several_polls() {
    tokio::time::sleep(POLL * 5).await;
}

fn name(n: &str) -> ServiceName {
    ServiceName::new("default", n)
}

#[tokio::test(start_paused = true)]
async fn reloads_on_change_and_keeps_the_last_good_file() {
    let dir = TempDir::new("reload");
    dir.write(
        "web.yaml",
        &format!(
            "{}---\n{}",
            svc("web", "10.96.0.1"),
            slice("web", "10.0.0.1")
        ),
    );
    dir.write("README.txt", "not a manifest: ignored");
    let mut w = manifest::spawn(ManifestConfig {
        path: dir.0.clone(),
        node_name: None,
        translate: TranslateOptions::default(),
        min_interval: Duration::ZERO,
        poll_interval: POLL,
    });
    let first = next(&mut w).await;
    assert!(first.initial);
    assert_eq!(first.services[&name("web")].endpoints.len(), 1);

    // A new file and a change to the old one arrive together in one reload.
    dir.write("api.yaml", &svc("api", "10.96.0.2"));
    dir.write(
        "web.yaml",
        &format!(
            "{}---\n{}",
            svc("web", "10.96.0.1"),
            slice("web", "10.0.0.9")
        ),
    );
    let cs = next(&mut w).await;
    assert_eq!(
        cs.services.keys().collect::<Vec<_>>(),
        [&name("api"), &name("web")]
    );
    assert_eq!(
        cs.services[&name("web")].endpoints[0].addr,
        "10.0.0.9".parse::<std::net::IpAddr>().expect("literal")
    );

    // A half-written file (invalid YAML) keeps its previous objects: nothing changes.
    dir.write(
        "web.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: web\n",
    );
    several_polls().await;
    assert!(
        w.changes.try_recv().is_err(),
        "a broken file changed the state"
    );

    // An unchanged rewrite is not a change either.
    dir.write(
        "web.yaml",
        &format!(
            "{}---\n{}",
            svc("web", "10.96.0.1"),
            slice("web", "10.0.0.9")
        ),
    );
    several_polls().await;
    assert!(
        w.changes.try_recv().is_err(),
        "an identical reload produced a change set"
    );

    // Removing a file removes its objects.
    std::fs::remove_file(dir.0.join("api.yaml")).expect("remove");
    let cs = next(&mut w).await;
    assert_eq!(cs.services.keys().collect::<Vec<_>>(), [&name("api")]);
    assert_eq!(cs.services[&name("api")], ServiceChange::default());
}

#[tokio::test(start_paused = true)]
async fn a_single_file_works_and_picks_this_nodes_object() {
    let dir = TempDir::new("single");
    let node = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n  labels: {topology.kubernetes.io/zone: z1}\n\
                status:\n  addresses: [{type: InternalIP, address: 192.168.1.5}, {type: Hostname, address: node-a}]\n";
    let other = node
        .replace("node-a", "node-b")
        .replace("192.168.1.5", "192.168.1.6");
    dir.write(
        "all.yaml",
        &format!("{}---\n{node}---\n{other}", svc("web", "10.96.0.1")),
    );
    let mut w = manifest::spawn(ManifestConfig {
        path: dir.0.join("all.yaml"),
        node_name: Some("node-a".into()),
        translate: TranslateOptions::default(),
        min_interval: Duration::ZERO,
        poll_interval: POLL,
    });
    let first = next(&mut w).await;
    assert!(first.services.contains_key(&name("web")));
    let node = first.node.expect("this node's info");
    assert_eq!(node.zone.as_deref(), Some("z1"));
    assert_eq!(
        node.ips_v4,
        ["192.168.1.5"
            .parse::<std::net::Ipv4Addr>()
            .expect("literal")]
    );
}

#[test]
fn a_syntax_error_names_the_file_the_document_from_1_the_line_and_column() {
    let path = std::path::Path::new("/srv/m/services.yaml");
    let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n---\n\
                apiVersion: v1\nkind: Service\nmetadata: : :\n";
    let err = manifest::parse_manifest(path, text).expect_err("not YAML");
    assert_eq!(
        err.to_string(),
        "manifest /srv/m/services.yaml: document 2: not valid YAML at line 7, column 11: \
         mapping values are not allowed in this context"
    );
    // A leading separator starts the first document, not a second one.
    let text = "---\na: \"unclosed\n";
    let err = manifest::parse_manifest(path, text).expect_err("not YAML");
    assert!(
        err.to_string()
            .starts_with("manifest /srv/m/services.yaml: document 1: not valid YAML at line 2,"),
        "{err}"
    );
    assert!(!err.to_string().contains("Option<"), "{err}");
}

/// A cluster export of thousands of Services in one file parses: the YAML parser's default
/// limits (1,024 documents, 250,000 nodes) suit config files and refused it (found by the
/// faults-under-traffic VM test's 3,000-Service manifest).
#[test]
fn a_file_of_thousands_of_services_parses() {
    let n = 5_000;
    let text: String = (0..n)
        .map(|i| {
            let ip = format!("10.97.{}.{}", i / 250, i % 250 + 1);
            format!(
                "{}---\n{}---\n",
                svc(&format!("s{i}"), &ip),
                slice(&format!("s{i}"), "10.245.0.1")
            )
        })
        .collect();
    let m = manifest::parse_manifest(std::path::Path::new("big.yaml"), &text).expect("parses");
    assert_eq!((m.services.len(), m.slices.len()), (n, n));
}
