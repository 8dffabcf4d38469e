//! Host tests of `deploy/`: every manifest parses into a typed Kubernetes object, and the
//! invariants an operator relies on hold. The ClusterRole grants exactly the API calls the code
//! makes (checked against the sources, so a new call without a rule fails here), the DaemonSet
//! runs in the host network with the mounts, probes and rollout the docs promise, the ConfigMap's
//! `config.conf` loads with the agent's own `--config` reader, and the image tag is the workspace
//! version that `cargo xtask image` builds.
//!
//! The layout is what a real API server accepts (`cargo xtask deploy-check` dry-runs it): the
//! kustomization is `deploy/Kustomization`, a name `kubectl apply -f deploy/` does not read, and
//! `deploy/replace-kube-proxy/` holds plain copies of the base's manifests (kustomize refuses an
//! overlay inside its base), which must not drift from the base except in where the DaemonSet
//! reads its configuration. The install commands in the docs are the ones deploy-check runs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount, VolumeMount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_ipvs::agent::{RunArgs, Settings};
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

fn overlay_dir() -> PathBuf {
    deploy_dir().join("replace-kube-proxy")
}

/// The files `kubectl apply -f DIR` reads: the directory's own (not its subdirectories') files
/// ending in `.yaml`, `.yml` or `.json`, sorted by name.
fn manifest_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|e| e == "yaml" || e == "yml" || e == "json")
        })
        .collect();
    files.sort();
    files
}

/// Every document `kubectl apply -f DIR` would send: file name, kind and the raw document.
fn objects(dir: &Path) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    for path in manifest_files(dir) {
        let name = path
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .into_owned();
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

/// Every Kubernetes object in the base, `deploy/`.
fn base_objects() -> Vec<(String, String, Value)> {
    objects(&deploy_dir())
}

/// The single object of a kind in a directory, parsed into its typed form (which fails on a
/// wrong shape).
fn one_in<T: serde::de::DeserializeOwned>(dir: &Path, kind: &str) -> T {
    let objs: Vec<_> = objects(dir)
        .into_iter()
        .filter(|(_, k, _)| k == kind)
        .collect();
    assert_eq!(
        objs.len(),
        1,
        "want exactly one {kind} in {}",
        dir.display()
    );
    let (file, _, doc) = objs.into_iter().next().expect("one object");
    serde_json::from_value(doc).unwrap_or_else(|e| panic!("{file}: not a valid {kind}: {e}"))
}

/// The single object of a kind in `deploy/`.
fn one<T: serde::de::DeserializeOwned>(kind: &str) -> T {
    one_in(&deploy_dir(), kind)
}

/// Parses a document into the typed object of its kind, naming the file on failure.
fn check_typed(file: &str, kind: &str, doc: Value) {
    let parsed = match kind {
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

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Kustomization {
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    images: Vec<KustomizeImage>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct KustomizeImage {
    name: String,
    new_tag: Option<String>,
}

/// The names kustomize looks for in a kustomization root besides `Kustomization`, the one
/// `deploy/` uses because `kubectl apply -f DIR` skips it (these two it would read).
const KUSTOMIZATION_YAML: [&str; 2] = ["kustomization.yaml", "kustomization.yml"];

/// `deploy/Kustomization`.
fn kustomization() -> Kustomization {
    let path = deploy_dir().join("Kustomization");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn kubectl_apply_f_reads_only_kubernetes_objects() {
    for dir in [deploy_dir(), overlay_dir()] {
        for name in KUSTOMIZATION_YAML {
            assert!(
                !dir.join(name).exists(),
                "{}/{name}: `kubectl apply -f` sends it to the API server, which has no kind \
                 Kustomization; name it Kustomization",
                dir.display()
            );
        }
        for (file, _, doc) in objects(&dir) {
            let api = doc["apiVersion"].as_str().unwrap_or_default();
            assert!(
                !api.is_empty() && !api.starts_with("kustomize.config.k8s.io/"),
                "{}/{file}: apiVersion {api:?} is not served by an API server",
                dir.display()
            );
        }
    }
}

#[test]
fn replace_kube_proxy_is_not_a_kustomization() {
    // An overlay there would name its base as `..`, which kustomize refuses ("cycle detected:
    // candidate root deploy contains visited root deploy/replace-kube-proxy"), and it may not
    // name files outside its own directory either.
    for name in KUSTOMIZATION_YAML.into_iter().chain(["Kustomization"]) {
        assert!(
            !overlay_dir().join(name).exists(),
            "deploy/replace-kube-proxy/{name}: it is applied with `kubectl apply -f`"
        );
    }
}

#[test]
fn every_manifest_is_a_typed_object_listed_in_the_kustomization() {
    let k = kustomization();
    assert_eq!(k.namespace.as_deref(), Some("kube-system"));
    let listed: BTreeSet<&str> = k.resources.iter().map(String::as_str).collect();
    let base = base_objects();
    let files: BTreeSet<&str> = base.iter().map(|(f, _, _)| f.as_str()).collect();
    assert_eq!(
        listed, files,
        "Kustomization resources vs the files `kubectl apply -f deploy/` reads"
    );
    for (file, kind, doc) in base {
        check_typed(&file, &kind, doc);
    }
    for (file, kind, doc) in objects(&overlay_dir()) {
        check_typed(&format!("replace-kube-proxy/{file}"), &kind, doc);
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

/// The kind an `Api`'s type is: the lean decodes (`crates/watch/src/lean.rs`) are the
/// resources they wrap, by their own `KIND`.
fn kind_of(name: &str) -> String {
    use k8s_openapi::Resource as _;
    use kube_ipvs_watch::lean::{LeanService, LeanSlice};
    match name {
        "LeanService" => LeanService::KIND.to_owned(),
        "LeanSlice" => LeanSlice::KIND.to_owned(),
        other => other.to_owned(),
    }
}

/// The Kubernetes kinds the code builds an `Api` for (`Api::<Kind>`), across the crates that
/// run in the agent's pod.
fn api_kinds_in_code(srcs: &[(PathBuf, String)]) -> BTreeSet<String> {
    let mut kinds = BTreeSet::new();
    for (_, text) in srcs {
        for piece in text.split("Api::<").skip(1) {
            let name: String = piece
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            kinds.insert(kind_of(&name));
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
    // Services and EndpointSlices and get_opt of the Node in crates/kube-ipvs/src/cmd/source.rs;
    // Events created in crates/kube-ipvs/src/agent/events.rs.
    assert_eq!(
        api_kinds_in_code(&srcs),
        BTreeSet::from([
            "EndpointSlice".into(),
            "Event".into(),
            "Node".into(),
            "Service".into()
        ]),
        "the code reaches a new kind: give it a rule in deploy/clusterrole.yaml and here"
    );
    let events_rs = root.join("crates/kube-ipvs/src/agent/events.rs");
    let creates = srcs
        .iter()
        .filter(|(p, _)| *p == events_rs)
        .map(|(_, t)| t.matches("api.create(").count())
        .sum::<usize>();
    assert_eq!(creates, 1, "the one write: creating an Event");
    for (path, text) in srcs.iter().filter(|(p, _)| *p != events_rs) {
        for call in [".create(", ".patch(", ".replace(", ".delete("] {
            let hits_api = text
                .lines()
                .any(|l| l.contains(call) && (l.contains("Api") || l.contains("api.")));
            assert!(
                !hits_api,
                "{} writes to the API server ({call}): the ClusterRole grants reads and \
                 Event creation only",
                path.display()
            );
        }
    }
    let watch = ["list", "watch"];
    let want: BTreeSet<(String, String, String)> = [
        ("", "services", &watch[..]),
        ("discovery.k8s.io", "endpointslices", &watch[..]),
        ("", "nodes", &["get", "list", "watch"][..]),
        ("events.k8s.io", "events", &["create"][..]),
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
    // The agent runs unprivileged with only the capabilities it uses, on a read-only root
    // filesystem (the VM test kernel_run::init_only_then_run_with_net_admin_and_net_raw_only
    // runs it exactly so).
    let sc = c.security_context.clone().expect("securityContext");
    assert_ne!(
        sc.privileged,
        Some(true),
        "the agent's container is not privileged"
    );
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.clone().expect("capabilities");
    assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));
    assert_eq!(
        caps.add,
        Some(vec!["NET_ADMIN".to_owned(), "NET_RAW".to_owned()]),
        "only the capabilities the agent uses"
    );

    // The privileged step before it: `run --init-only` with the agent's own flags, the host's
    // modules and the config.
    let inits = pod.init_containers.clone().unwrap_or_default();
    assert_eq!(inits.len(), 1);
    let init = &inits[0];
    assert_eq!(init.image, c.image);
    assert_eq!(init.command, c.command);
    let init_args = init.args.clone().unwrap_or_default();
    let mut agent_args = c.args.clone().unwrap_or_default();
    agent_args.insert(1, "--init-only".to_owned());
    assert_eq!(init_args, agent_args, "--init-only and the agent's flags");
    assert_eq!(
        init.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );

    let volumes: BTreeMap<String, _> = pod
        .volumes
        .unwrap_or_default()
        .into_iter()
        .map(|v| (v.name.clone(), v))
        .collect();
    let mounts = c.volume_mounts.clone().unwrap_or_default();
    let host_mount = |mounts: &[VolumeMount], host: &str| {
        mounts
            .iter()
            .find(|m| {
                volumes
                    .get(&m.name)
                    .and_then(|v| v.host_path.as_ref())
                    .is_some_and(|h| h.path == host)
            })
            .cloned()
            .unwrap_or_else(|| panic!("no mount of the host's {host}"))
    };
    let init_mounts = init.volume_mounts.clone().unwrap_or_default();
    let modules = host_mount(&init_mounts, "/lib/modules");
    assert_eq!(modules.mount_path, "/lib/modules");
    assert_eq!(modules.read_only, Some(true));
    let config_mount = |ms: &[VolumeMount]| {
        ms.iter()
            .find(|m| volumes.get(&m.name).is_some_and(|v| v.config_map.is_some()))
            .map(|m| (m.name.clone(), m.mount_path.clone()))
    };
    assert_eq!(
        config_mount(&init_mounts),
        config_mount(&mounts),
        "the init container reads the same config"
    );
    let lock = host_mount(&mounts, "/run/xtables.lock");
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
    // `kubectl apply -f` uses the DaemonSets' image as written, `-k` the Kustomization's tag.
    for dir in [deploy_dir(), overlay_dir()] {
        let ds: DaemonSet = one_in(&dir, "DaemonSet");
        let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
        assert_eq!(
            pod.containers[0].image.as_deref(),
            Some(want.as_str()),
            "{}",
            dir.display()
        );
    }
    let k = kustomization();
    assert_eq!(k.images.len(), 1);
    assert_eq!(k.images[0].name, IMAGE);
    assert_eq!(k.images[0].new_tag.as_deref(), Some(version));
    // The Helm chart's version and appVersion (its default image tag), and its image name.
    let chart_dir = repo_root().join("deploy/helm/kube-ipvs");
    let chart: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(chart_dir.join("Chart.yaml")).expect("read Chart.yaml"),
    )
    .expect("Chart.yaml is YAML");
    assert_eq!(chart["version"], version);
    assert_eq!(chart["appVersion"], version);
    let values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(chart_dir.join("values.yaml")).expect("read values.yaml"),
    )
    .expect("values.yaml is YAML");
    assert_eq!(values["image"]["repository"], IMAGE);
    // xtask names its archive and tag with the same version and name.
    let xtask = std::fs::read_to_string(repo_root().join("xtask/src/image.rs"))
        .expect("read xtask/src/image.rs");
    assert!(
        xtask.contains(&format!("const IMAGE_NAME: &str = \"{IMAGE}\";")),
        "xtask/src/image.rs builds another image name"
    );
    assert!(xtask.contains("env!(\"CARGO_PKG_VERSION\")"));
}

/// The fields in which `replace-kube-proxy/daemonset.yaml` may differ from `daemonset.yaml`: the
/// config volume's ConfigMap, where it is mounted, and the `--config` argument, in the agent's
/// container and in the init container.
const OVERLAY_FIELDS: [&str; 5] = [
    "/spec/template/spec/volumes/0/configMap/name",
    "/spec/template/spec/containers/0/volumeMounts/0/mountPath",
    "/spec/template/spec/containers/0/args/1",
    "/spec/template/spec/initContainers/0/volumeMounts/0/mountPath",
    "/spec/template/spec/initContainers/0/args/2",
];

/// The first JSON pointer at which two documents differ, with both values.
fn first_difference(a: &Value, b: &Value, at: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x.keys().chain(y.keys()).find_map(|k| {
            let here = format!("{at}/{k}");
            match (x.get(k), y.get(k)) {
                (Some(u), Some(v)) => first_difference(u, v, &here),
                (u, v) => Some(format!("{here}: {u:?} vs {v:?}")),
            }
        }),
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (u, v))| first_difference(u, v, &format!("{at}/{i}"))),
        _ if a == b => None,
        _ => Some(format!("{at}: {a} vs {b}")),
    }
}

#[test]
fn replace_kube_proxy_copies_the_base_but_reads_kube_proxys_configmap() {
    let base = base_objects();
    let overlay = objects(&overlay_dir());
    // Every base file but our ConfigMap, which kube-proxy's replaces.
    let cm: ConfigMap = one("ConfigMap");
    let cm_file = base
        .iter()
        .find(|(_, kind, _)| kind == "ConfigMap")
        .map(|(f, _, _)| f.clone())
        .expect("a ConfigMap file");
    let want: BTreeSet<&str> = base
        .iter()
        .map(|(f, _, _)| f.as_str())
        .filter(|f| *f != cm_file)
        .collect();
    let got: BTreeSet<&str> = overlay.iter().map(|(f, _, _)| f.as_str()).collect();
    assert_eq!(
        got, want,
        "deploy/replace-kube-proxy/ vs deploy/ without {cm_file}"
    );
    assert!(overlay.iter().all(|(_, kind, _)| kind != "ConfigMap"));

    for (file, kind, doc) in overlay {
        let mut doc = doc;
        let original = base
            .iter()
            .find(|(f, k, _)| *f == file && *k == kind)
            .map(|(_, _, d)| d)
            .unwrap_or_else(|| panic!("replace-kube-proxy/{file}: no {kind} in ../{file}"));
        if kind == "DaemonSet" {
            let ds: DaemonSet = serde_json::from_value(doc.clone()).expect("typed DaemonSet");
            let (name, key, path) = config_source(&ds);
            // kubeadm's ConfigMap and key; its config.conf names /var/lib/kube-proxy/kubeconfig.conf.
            assert_eq!((name.as_str(), key.as_str()), ("kube-proxy", "config.conf"));
            assert_eq!(path, "/var/lib/kube-proxy/config.conf");
            assert_ne!(cm.metadata.name.as_deref(), Some("kube-proxy"));
            // Put back the base's values in the intended fields; what remains must be equal.
            for field in OVERLAY_FIELDS {
                let from = original
                    .pointer(field)
                    .unwrap_or_else(|| panic!("{file}: no {field}"));
                let slot = doc
                    .pointer_mut(field)
                    .unwrap_or_else(|| panic!("replace-kube-proxy/{file}: no {field}"));
                assert_ne!(slot, from, "{field} is one of the intended differences");
                *slot = from.clone();
            }
        }
        if let Some(diff) = first_difference(&doc, original, "") {
            panic!(
                "replace-kube-proxy/{file} drifted from ../{file} at {diff}; change both \
                 (only {OVERLAY_FIELDS:?} of the DaemonSet may differ)"
            );
        }
    }
}

/// `kubectl apply|delete -f|-k PATH` commands naming `deploy...` in the operator docs, as
/// (verb, flag, path without a trailing slash).
fn documented_commands() -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for doc in ["README.md", "docs/operations.md", "docs/comparison.md"] {
        let text = std::fs::read_to_string(repo_root().join(doc))
            .unwrap_or_else(|e| panic!("read {doc}: {e}"));
        for line in text.lines() {
            let words: Vec<&str> = line
                .split_whitespace()
                .map(|w| w.trim_matches(|c: char| "`.,;:()".contains(c)))
                .collect();
            for (i, pair) in words.windows(2).enumerate() {
                let verb = match pair {
                    ["kubectl", verb @ ("apply" | "delete")] => *verb,
                    _ => continue,
                };
                let rest = &words[i + 2..];
                for flag_path in rest.windows(2) {
                    if let [flag @ ("-f" | "-k"), path] = flag_path
                        && path.starts_with("deploy")
                    {
                        out.insert((
                            verb.to_owned(),
                            (*flag).to_owned(),
                            path.trim_end_matches('/').to_owned(),
                        ));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn documented_install_commands_are_the_ones_deploy_check_dry_runs() {
    let docs = documented_commands();
    let applied: BTreeSet<(String, String)> = docs
        .iter()
        .filter(|(verb, _, _)| verb == "apply")
        .map(|(_, flag, path)| (flag.clone(), path.clone()))
        .collect();
    assert!(
        !applied.is_empty(),
        "the docs name no `kubectl apply` of deploy/"
    );
    for (verb, flag, path) in &docs {
        let target = repo_root().join(path);
        assert!(
            target.exists(),
            "the docs `kubectl {verb} {flag} {path}`: no such path"
        );
        if flag == "-k" {
            assert!(
                target.join("Kustomization").is_file(),
                "the docs `kubectl {verb} -k {path}`: no Kustomization there"
            );
        }
    }
    // The (flag, path) pairs in `dry_run_deploy` in xtask/src/cluster.rs.
    let xtask = std::fs::read_to_string(repo_root().join("xtask/src/cluster.rs"))
        .expect("read xtask/src/cluster.rs");
    let body = xtask
        .split_once("fn dry_run_deploy(")
        .and_then(|(_, rest)| rest.split_once("\n}\n"))
        .map(|(body, _)| body)
        .expect("fn dry_run_deploy in xtask/src/cluster.rs");
    let dry_run: BTreeSet<(String, String)> = body
        .split("(\"-")
        .skip(1)
        .filter_map(|piece| {
            let (flag, rest) = piece.split_once("\", \"")?;
            let (path, _) = rest.split_once("\")")?;
            Some((format!("-{flag}"), path.trim_end_matches('/').to_owned()))
        })
        .collect();
    assert_eq!(
        applied, dry_run,
        "`kubectl apply` commands in the docs vs what `cargo xtask deploy-check` dry-runs"
    );
}
