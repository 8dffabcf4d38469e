//! Host tests of `deploy/`: every manifest parses into a typed Kubernetes object, and the
//! invariants an operator relies on hold. The ClusterRole grants exactly the API calls the code
//! makes (checked against the sources, so a new call without a rule fails here), the DaemonSet
//! runs in the host network with the mounts, probes and rollout the docs promise, the ConfigMap's
//! `config.conf` loads with the agent's own `--config` reader, and the image tag is the workspace
//! version that `cargo xtask image` builds.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_ipvs::run::{RunArgs, Settings};
use serde::Deserialize;
use serde_json::Value;

/// The image name; the tag is the workspace version (`CARGO_PKG_VERSION` is inherited from it
/// here and in xtask, which names its archive and `RepoTags` the same way).
const IMAGE: &str = "kube-ipvs";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn deploy_dir() -> PathBuf {
    repo_root().join("deploy")
}

/// Every Kubernetes object in the base: file name, kind and the raw document.
fn base_objects() -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("read deploy/")
        .map(|e| e.expect("deploy/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for path in files {
        let name = path
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .into_owned();
        if name == "kustomization.yaml" {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read manifest");
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{name} is not YAML: {e}"));
        for doc in docs {
            let kind = doc["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{name}: a document without kind"))
                .to_owned();
            out.push((name.clone(), kind, doc));
        }
    }
    out
}

/// The single object of a kind, parsed into its typed form (which fails on a wrong shape).
fn one<T: serde::de::DeserializeOwned>(kind: &str) -> T {
    let objs: Vec<_> = base_objects()
        .into_iter()
        .filter(|(_, k, _)| k == kind)
        .collect();
    assert_eq!(objs.len(), 1, "want exactly one {kind} in deploy/");
    let (file, _, doc) = objs.into_iter().next().expect("one object");
    serde_json::from_value(doc).unwrap_or_else(|e| panic!("{file}: not a valid {kind}: {e}"))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Kustomization {
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    images: Vec<KustomizeImage>,
    #[serde(default)]
    patches: Vec<KustomizePatch>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct KustomizeImage {
    name: String,
    new_tag: Option<String>,
}

#[derive(Debug, Deserialize)]
struct KustomizePatch {
    patch: String,
    #[serde(default)]
    target: Option<BTreeMap<String, String>>,
}

fn kustomization(dir: &Path) -> Kustomization {
    let path = dir.join("kustomization.yaml");
    let text = std::fs::read_to_string(&path).expect("read kustomization.yaml");
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_manifest_is_a_typed_object_listed_in_the_kustomization() {
    let k = kustomization(&deploy_dir());
    assert_eq!(k.namespace.as_deref(), Some("kube-system"));
    let listed: BTreeSet<&str> = k.resources.iter().map(String::as_str).collect();
    let objects = base_objects();
    let files: BTreeSet<&str> = objects.iter().map(|(f, _, _)| f.as_str()).collect();
    assert_eq!(
        listed, files,
        "kustomization resources vs the files in deploy/"
    );
    for (file, kind, doc) in &objects {
        let doc = doc.clone();
        let parsed = match kind.as_str() {
            "ServiceAccount" => serde_json::from_value::<ServiceAccount>(doc).map(drop),
            "ClusterRole" => serde_json::from_value::<ClusterRole>(doc).map(drop),
            "ClusterRoleBinding" => serde_json::from_value::<ClusterRoleBinding>(doc).map(drop),
            "ConfigMap" => serde_json::from_value::<ConfigMap>(doc).map(drop),
            "DaemonSet" => serde_json::from_value::<DaemonSet>(doc).map(drop),
            other => panic!("{file}: unexpected kind {other}"),
        };
        if let Err(e) = parsed {
            panic!("{file}: not a valid {kind}: {e}");
        }
    }
}

/// Every `.rs` file under a directory, with its text.
fn sources(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).expect("read source dir") {
        let path = entry.expect("source entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("read source");
            out.push((path, text));
        }
    }
}

/// The Kubernetes kinds the code builds an `Api` for (`Api::<Kind>`), across the crates that
/// run in the agent's pod.
fn api_kinds_in_code(srcs: &[(PathBuf, String)]) -> BTreeSet<String> {
    let mut kinds = BTreeSet::new();
    for (_, text) in srcs {
        for piece in text.split("Api::<").skip(1) {
            let kind: String = piece
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            kinds.insert(kind);
        }
    }
    kinds
}

#[test]
fn cluster_role_grants_exactly_what_the_code_calls() {
    let root = repo_root();
    let mut srcs = Vec::new();
    for dir in ["crates/watch/src", "crates/kube-ipvs/src"] {
        sources(&root.join(dir), &mut srcs);
    }
    // Watchers (list + watch) for all three in crates/watch/src/cluster.rs; one-shot list of
    // Services and EndpointSlices and get_opt of the Node in crates/kube-ipvs/src/source.rs.
    assert_eq!(
        api_kinds_in_code(&srcs),
        BTreeSet::from(["EndpointSlice".into(), "Node".into(), "Service".into()]),
        "the code reaches a new kind: give it a rule in deploy/clusterrole.yaml and here"
    );
    for (path, text) in &srcs {
        for call in [
            ".create(",
            ".patch(",
            ".replace(",
            ".delete(",
            "Recorder::new",
            "events::",
        ] {
            let hits_api = text.lines().any(|l| {
                l.contains(call) && (l.contains("Api") || l.contains("api.") || call.contains("::"))
            });
            assert!(
                !hits_api,
                "{} writes to the API server ({call}): the ClusterRole grants reads only",
                path.display()
            );
        }
    }
    let watch = ["list", "watch"];
    let want: BTreeSet<(String, String, String)> = [
        ("", "services", &watch[..]),
        ("discovery.k8s.io", "endpointslices", &watch[..]),
        ("", "nodes", &["get", "list", "watch"][..]),
    ]
    .into_iter()
    .flat_map(|(g, r, verbs)| {
        verbs
            .iter()
            .map(move |v| (g.to_owned(), r.to_owned(), (*v).to_owned()))
    })
    .collect();

    let role: ClusterRole = one("ClusterRole");
    let mut got = BTreeSet::new();
    for rule in role.rules.unwrap_or_default() {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "{rule:?}"
        );
        for g in rule.api_groups.clone().unwrap_or_default() {
            for r in rule.resources.clone().unwrap_or_default() {
                for v in &rule.verbs {
                    assert_ne!(v, "*", "no wildcard verbs");
                    let triple = (g.clone(), r.clone(), v.clone());
                    assert!(got.insert(triple.clone()), "granted twice: {triple:?}");
                }
            }
        }
    }
    assert_eq!(got, want);
}

#[test]
fn binding_names_the_role_and_the_daemonsets_service_account() {
    let sa: ServiceAccount = one("ServiceAccount");
    let role: ClusterRole = one("ClusterRole");
    let binding: ClusterRoleBinding = one("ClusterRoleBinding");
    let ds: DaemonSet = one("DaemonSet");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subjects = binding.subjects.unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), sa.metadata.name.as_ref());
    assert_eq!(subjects[0].namespace, sa.metadata.namespace);
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(pod.service_account_name, sa.metadata.name);
    assert_eq!(ds.metadata.namespace, sa.metadata.namespace);
}

#[test]
fn daemonset_runs_on_every_node_in_the_host_network() {
    let ds: DaemonSet = one("DaemonSet");
    let spec = ds.spec.expect("spec");
    let strategy = spec.update_strategy.expect("updateStrategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.expect("rollingUpdate");
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(1)));

    let labels = spec.template.metadata.expect("template metadata").labels;
    let selector = spec.selector.match_labels.expect("matchLabels");
    for (k, v) in &selector {
        assert_eq!(labels.as_ref().and_then(|l| l.get(k)), Some(v), "{k}");
    }

    let pod = spec.template.spec.expect("pod spec");
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = pod.tolerations.unwrap_or_default();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "tolerate every taint: {tolerations:?}"
    );

    assert_eq!(pod.containers.len(), 1);
    let c = &pod.containers[0];
    let sc = c.security_context.clone().expect("securityContext");
    let caps = sc.capabilities.and_then(|c| c.add).unwrap_or_default();
    for cap in ["NET_ADMIN", "NET_RAW", "SYS_MODULE"] {
        assert!(caps.iter().any(|c| c == cap), "{cap} in {caps:?}");
    }
    assert_eq!(
        caps.len(),
        3,
        "only the capabilities the agent uses: {caps:?}"
    );

    let volumes: BTreeMap<String, _> = pod
        .volumes
        .unwrap_or_default()
        .into_iter()
        .map(|v| (v.name.clone(), v))
        .collect();
    let mounts = c.volume_mounts.clone().unwrap_or_default();
    let host_mount = |host: &str| {
        mounts
            .iter()
            .find(|m| {
                volumes
                    .get(&m.name)
                    .and_then(|v| v.host_path.as_ref())
                    .is_some_and(|h| h.path == host)
            })
            .unwrap_or_else(|| panic!("no mount of the host's {host}"))
    };
    let modules = host_mount("/lib/modules");
    assert_eq!(modules.mount_path, "/lib/modules");
    assert_eq!(modules.read_only, Some(true));
    let lock = host_mount("/run/xtables.lock");
    assert_eq!(lock.mount_path, "/run/xtables.lock");
    assert_ne!(lock.read_only, Some(true), "iptables takes the lock");

    for (probe, path) in [
        (c.liveness_probe.clone(), "/livez"),
        (c.readiness_probe.clone(), "/healthz"),
    ] {
        let get = probe.and_then(|p| p.http_get).expect("an httpGet probe");
        assert_eq!(get.path.as_deref(), Some(path));
        // The health server's default address (kube-proxy's healthzBindAddress port).
        assert_eq!(get.port, IntOrString::Int(10256), "{path}");
    }
    let requests = c
        .resources
        .clone()
        .and_then(|r| r.requests)
        .unwrap_or_default();
    assert!(requests.contains_key("cpu") && requests.contains_key("memory"));

    let args = c.args.clone().unwrap_or_default();
    assert_eq!(args.first().map(String::as_str), Some("run"));
    assert!(args.iter().any(|a| a == "--hostname-override=$(NODE_NAME)"));
}

/// The `--config` path the DaemonSet passes, resolved through the ConfigMap volume it mounts:
/// (ConfigMap name, key).
fn config_source(ds: &DaemonSet) -> (String, String, String) {
    let pod = ds
        .spec
        .clone()
        .expect("spec")
        .template
        .spec
        .expect("pod spec");
    let c = &pod.containers[0];
    let config = c
        .args
        .clone()
        .unwrap_or_default()
        .iter()
        .find_map(|a| a.strip_prefix("--config=").map(str::to_owned))
        .expect("--config=PATH in args");
    let path = Path::new(&config);
    let dir = path.parent().expect("config dir").to_string_lossy();
    let mount = c
        .volume_mounts
        .clone()
        .unwrap_or_default()
        .into_iter()
        .find(|m| m.mount_path == dir)
        .expect("a mount at the config directory");
    let volume = pod
        .volumes
        .unwrap_or_default()
        .into_iter()
        .find(|v| v.name == mount.name)
        .expect("the config volume");
    let cm = volume.config_map.expect("a ConfigMap volume");
    let key = path
        .file_name()
        .expect("file")
        .to_string_lossy()
        .into_owned();
    (cm.name, key, config)
}

#[test]
fn configmap_loads_with_the_agents_own_reader() {
    let ds: DaemonSet = one("DaemonSet");
    let cm: ConfigMap = one("ConfigMap");
    let (name, key, _) = config_source(&ds);
    assert_eq!(Some(&name), cm.metadata.name.as_ref());
    let text = cm
        .data
        .unwrap_or_default()
        .remove(&key)
        .unwrap_or_else(|| panic!("ConfigMap {name} has no {key}"));
    let dir = std::env::temp_dir().join(format!("kube-ipvs-deploy-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join(&key);
    std::fs::write(&file, &text).expect("write config");
    let args = RunArgs {
        config: Some(file),
        hostname_override: Some("node-1".into()),
        ..RunArgs::default()
    };
    let settings = Settings::resolve(&args);
    let _ = std::fs::remove_dir_all(&dir);
    let settings = settings.unwrap_or_else(|e| panic!("deploy/configmap.yaml {key}: {e}"));
    assert_eq!(settings.healthz.port(), 10256, "the probes' port");
    assert!(!settings.cluster_cidrs.is_empty(), "clusterCIDR is set");
}

#[test]
fn image_is_the_workspace_version() {
    let version = env!("CARGO_PKG_VERSION");
    let want = format!("{IMAGE}:{version}");
    let ds: DaemonSet = one("DaemonSet");
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(pod.containers[0].image.as_deref(), Some(want.as_str()));
    let k = kustomization(&deploy_dir());
    assert_eq!(k.images.len(), 1);
    assert_eq!(k.images[0].name, IMAGE);
    assert_eq!(k.images[0].new_tag.as_deref(), Some(version));
    // xtask names its archive and tag with the same version and name.
    let xtask = std::fs::read_to_string(repo_root().join("xtask/src/image.rs"))
        .expect("read xtask/src/image.rs");
    assert!(
        xtask.contains(&format!("const IMAGE_NAME: &str = \"{IMAGE}\";")),
        "xtask/src/image.rs builds another image name"
    );
    assert!(xtask.contains("env!(\"CARGO_PKG_VERSION\")"));
}

#[test]
fn overlay_swaps_in_kube_proxys_configmap() {
    let k = kustomization(&deploy_dir().join("replace-kube-proxy"));
    assert_eq!(k.resources, ["..".to_owned()]);
    let ds: DaemonSet = one("DaemonSet");
    let mut doc = serde_json::to_value(&ds).expect("DaemonSet to JSON");
    let mut deleted = Vec::new();
    for p in &k.patches {
        if p.target.is_some() {
            let ops: Vec<Value> = serde_saphyr::from_str(&p.patch).expect("JSON 6902 patch");
            for op in ops {
                assert_eq!(op["op"], "replace");
                let path = op["path"].as_str().expect("path");
                let slot = doc
                    .pointer_mut(path)
                    .unwrap_or_else(|| panic!("overlay patch path {path} is not in the DaemonSet"));
                *slot = op["value"].clone();
            }
        } else {
            let del: Value = serde_saphyr::from_str(&p.patch).expect("delete patch");
            assert_eq!(del["$patch"], "delete");
            deleted.push(del["metadata"]["name"].clone());
        }
    }
    let patched: DaemonSet = serde_json::from_value(doc).expect("patched DaemonSet");
    let (name, key, path) = config_source(&patched);
    // kubeadm's ConfigMap and key; its config.conf names /var/lib/kube-proxy/kubeconfig.conf.
    assert_eq!((name.as_str(), key.as_str()), ("kube-proxy", "config.conf"));
    assert_eq!(path, "/var/lib/kube-proxy/config.conf");
    let cm: ConfigMap = one("ConfigMap");
    assert_eq!(deleted, [Value::from(cm.metadata.name.expect("name"))]);
}
