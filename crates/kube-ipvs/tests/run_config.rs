//! Host tests of `kube-ipvs run`'s settings: kubeadm's kube-proxy ConfigMap (`config.conf`)
//! loads unchanged with `mode: ipvs`, flags win over the file (under the name `kube-proxy` the
//! file wins, as kube-proxy reads its command line), unknown keys are warned about and
//! ignored (kube-proxy's lenient decoding), other modes and bad values are refused naming the
//! key, and the binary stops before touching the kernel with one line and a
//! distinct exit code for a bad file (3) and a bad setting (4).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kube_ipvs::agent::{RunArgs, Settings};

/// `config.conf` of the `kube-proxy` ConfigMap as kubeadm (v1.31) writes it, with `mode: ipvs`
/// and the ipvs section filled in as an operator would.
const KUBEADM: &str = include_str!("fixtures/kubeadm-kube-proxy.conf");

fn config_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kube-ipvs-run-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

fn args(config: PathBuf) -> RunArgs {
    RunArgs {
        config: Some(config),
        hostname_override: Some("node-1".into()),
        ..RunArgs::default()
    }
}

#[test]
fn kubeadms_config_map_loads_unchanged() {
    let s = Settings::resolve(&args(config_file("kubeadm.yaml", KUBEADM))).expect("loads");
    assert_eq!(s.node.default_scheduler.to_string(), "lc");
    assert_eq!(s.sync_period, Duration::from_secs(60));
    assert_eq!(s.min_sync_period, Duration::from_secs(2));
    assert!(s.strict_arp);
    assert_eq!(s.timeouts.tcp, Some(900));
    assert_eq!(s.timeouts.tcp_fin, None, "0s leaves the kernel's value");
    assert_eq!(s.node.options.exclude_cidrs.len(), 1);
    assert_eq!(s.cluster_cidrs.len(), 1);
    assert_eq!(s.metrics.to_string(), "0.0.0.0:10249");
    assert_eq!(
        s.healthz.to_string(),
        "0.0.0.0:10256",
        "empty means default"
    );
    assert_eq!(
        s.source.kubeconfig,
        Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(s.node.node_name, "node-1");
    assert!(!s.masquerade_all);
}

#[test]
fn flags_win_over_the_file() {
    let mut a = args(config_file("override.yaml", KUBEADM));
    a.scheduler = Some("sh".into());
    a.sync_period = Some("10s".into());
    a.min_sync_period = Some("1s".into());
    a.masquerade_all = true;
    a.healthz_bind_address = Some("127.0.0.1:1234".into());
    let s = Settings::resolve(&a).expect("loads");
    assert_eq!(s.node.default_scheduler.to_string(), "sh");
    assert_eq!(s.sync_period, Duration::from_secs(10));
    assert!(s.masquerade_all);
    assert_eq!(s.healthz.to_string(), "127.0.0.1:1234");
    // The file still gives what the flags did not.
    assert_eq!(s.timeouts.tcp, Some(900));
}

/// kube-proxy decodes a file with unknown keys leniently and warns; so does kube-ipvs, naming
/// each key with its section, and the misspelt setting keeps its default.
#[test]
fn unknown_keys_are_warned_about_and_ignored() {
    let text = KUBEADM
        .replace("strictARP:", "strictArp:")
        .replace("portRange:", "portRnage:")
        .replace(
            "kind: KubeProxyConfiguration",
            "kind: KubeProxyConfiguration\nserviceProxyName: ipvs-only",
        );
    let s = Settings::resolve(&args(config_file("unknown-keys.yaml", &text))).expect("loads");
    assert!(!s.strict_arp, "the misspelt key set nothing");
    let unknown: Vec<&String> = s
        .warnings
        .iter()
        .filter(|w| w.contains("is not a KubeProxyConfiguration key"))
        .collect();
    assert_eq!(unknown.len(), 2, "{:?}", s.warnings);
    assert!(
        unknown[0].contains("config key ipvs.strictArp "),
        "{unknown:?}"
    );
    assert!(unknown[1].contains("config key portRnage "), "{unknown:?}");
    // serviceProxyName is ours in the file, like --service-proxy-name.
    assert_eq!(s.source.service_proxy_name.as_deref(), Some("ipvs-only"));
}

/// `nodePortAddresses` as kube-proxy reads it: unset is every local address, `[primary]` the
/// Node's own address of each family, a network list the addresses inside (per family); a
/// bad entry is refused with the setting and the entry named.
#[test]
fn node_port_addresses_follow_kube_proxys_choice() {
    let local: Vec<std::net::IpAddr> = ["192.168.56.10", "10.0.2.15", "2001:db8::10"]
        .iter()
        .map(|a| a.parse().expect("literal"))
        .collect();
    let node: Vec<std::net::IpAddr> = vec!["10.0.2.15".parse().expect("literal")];
    let unset = Settings::resolve(&args(config_file("np-unset.yaml", KUBEADM))).expect("loads");
    assert_eq!(unset.nodeports.select(&local, &node).len(), 3);
    let primary = KUBEADM.replace("nodePortAddresses: null", "nodePortAddresses: [primary]");
    let s = Settings::resolve(&args(config_file("primary.yaml", &primary))).expect("loads");
    assert_eq!(
        s.nodeports.select(&local, &node),
        vec![node[0], local[2]],
        "the Node's IPv4 address, and every IPv6 address (the Node has none of that family)"
    );
    let cidrs = KUBEADM.replace(
        "nodePortAddresses: null",
        "nodePortAddresses: [192.168.0.0/16]",
    );
    let s = Settings::resolve(&args(config_file("np-cidrs.yaml", &cidrs))).expect("loads");
    assert_eq!(s.nodeports.select(&local, &node), vec![local[0], local[2]]);
    let bad = KUBEADM.replace("nodePortAddresses: null", "nodePortAddresses: [eth0]");
    let e = Settings::resolve(&args(config_file("np-bad.yaml", &bad))).expect_err("refused");
    assert!(
        e.to_string().contains("nodePortAddresses") && e.to_string().contains("eth0"),
        "{e}"
    );
}

#[test]
fn other_modes_and_bad_values_name_the_setting() {
    let cases = [
        (
            KUBEADM.replace("kubeproxy.config.k8s.io/v1alpha1", "v1"),
            "apiVersion",
            true,
        ),
        (
            KUBEADM.replace("mode: ipvs", "mode: iptables"),
            "mode \"iptables\"",
            false,
        ),
        (
            KUBEADM.replace("scheduler: lc", "scheduler: fastest"),
            "ipvs.scheduler \"fastest\"",
            false,
        ),
        (
            KUBEADM.replace("syncPeriod: 1m0s", "syncPeriod: soon"),
            "ipvs.syncPeriod \"soon\"",
            false,
        ),
        (
            KUBEADM.replace("- 10.200.0.0/16", "- 10.200.0.0/33"),
            "ipvs.excludeCIDRs \"10.200.0.0/33\"",
            false,
        ),
    ];
    for (i, (text, want, file_error)) in cases.into_iter().enumerate() {
        let err =
            Settings::resolve(&args(config_file(&format!("bad{i}.yaml"), &text))).expect_err(want);
        assert!(err.to_string().contains(want), "{err} should name {want}");
        assert_eq!(err.is_file_error(), file_error, "{err}");
    }
}

fn run_exit(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kube-ipvs"))
        .args(args)
        .output()
        .expect("run kube-ipvs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_binary_refuses_bad_settings_with_one_line_and_its_exit_code() {
    let missing = std::env::temp_dir().join("kube-ipvs-no-such-config.yaml");
    let malformed = config_file("malformed.yaml", "apiVersion: [unclosed\n");
    let wrong_type = config_file(
        "wrong-type.yaml",
        &KUBEADM.replace("strictARP: true", "strictARP: [yes]"),
    );
    for (args, code, want) in [
        (
            vec!["--config", missing.to_str().expect("utf-8")],
            3,
            "kube-ipvs-no-such-config.yaml",
        ),
        (
            vec!["--config", malformed.to_str().expect("utf-8")],
            3,
            "malformed.yaml",
        ),
        (
            vec!["--config", wrong_type.to_str().expect("utf-8")],
            3,
            "wrong-type.yaml",
        ),
        (vec!["--scheduler", "fastest"], 4, "--scheduler \"fastest\""),
        (vec!["--exclude-cidrs", "10.0.0.0/40"], 4, "--exclude-cidrs"),
        (vec!["--sync-period", "0s"], 4, "--sync-period"),
    ] {
        let mut all = vec!["run", "--hostname-override", "node-1"];
        all.extend(args);
        let (got, err) = run_exit(&all);
        assert_eq!(got, Some(code), "{all:?}: {err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(err.starts_with("kube-ipvs run: "), "{err}");
        assert!(err.contains(want), "{err} should contain {want}");
    }
}

/// `/configz` reports the merged settings as kube-proxy's configz does: one object under
/// `kubeproxy.config.k8s.io`, a v1alpha1 `KubeProxyConfiguration` with kube-proxy's field names
/// and Go duration strings; each value here came from kubeadm's file or a default.
#[test]
fn configz_reports_the_settings_in_kube_proxys_shape() {
    let s = Settings::resolve(&args(config_file("configz.yaml", KUBEADM))).expect("loads");
    let doc = kube_ipvs::agent::configz::document(&s);
    let keys: Vec<&String> = doc.as_object().expect("an object").keys().collect();
    assert_eq!(keys, ["kubeproxy.config.k8s.io"]);
    let c = &doc["kubeproxy.config.k8s.io"];
    assert_eq!(c["kind"], "KubeProxyConfiguration");
    assert_eq!(c["apiVersion"], "kubeproxy.config.k8s.io/v1alpha1");
    assert_eq!(c["mode"], "ipvs");
    assert_eq!(c["ipvs"]["scheduler"], "lc");
    assert_eq!(c["ipvs"]["syncPeriod"], "1m0s");
    assert_eq!(c["ipvs"]["minSyncPeriod"], "2s");
    assert_eq!(c["ipvs"]["tcpTimeout"], "15m0s");
    assert_eq!(c["ipvs"]["tcpFinTimeout"], "0s");
    assert_eq!(c["ipvs"]["strictARP"], true);
    assert_eq!(c["ipvs"]["excludeCIDRs"][0], "10.200.0.0/16");
    assert_eq!(c["iptables"]["masqueradeBit"], 14, "kube-proxy's default");
    assert_eq!(c["clusterCIDR"], "10.244.0.0/16");
    assert_eq!(c["metricsBindAddress"], "0.0.0.0:10249");
    assert_eq!(c["healthzBindAddress"], "0.0.0.0:10256");
    assert_eq!(c["hostnameOverride"], "node-1");
    assert_eq!(c["detectLocalMode"], "ClusterCIDR");
    assert_eq!(c["conntrack"]["maxPerCore"], 32768);
    assert_eq!(c["conntrack"]["tcpEstablishedTimeout"], "24h0m0s");
    assert_eq!(
        c["clientConnection"]["kubeconfig"],
        "/var/lib/kube-proxy/kubeconfig.conf"
    );
}

/// Under the name `kube-proxy` (the image's link), the binary reads its command line as
/// kube-proxy does: beside `--config` a contradicting `--proxy-mode` is ignored, so the first
/// error is the file's own bad value, named by its key; as `kube-ipvs run` the same flags win
/// and the mode is refused first.
#[test]
fn under_kube_proxys_name_the_file_overrides_its_flags() {
    let bad = config_file(
        "bad-scheduler.yaml",
        &KUBEADM.replace("scheduler: lc", "scheduler: fastest"),
    );
    assert!(
        KUBEADM.contains("scheduler: lc"),
        "the fixture's scheduler line moved"
    );
    let dir = std::env::temp_dir().join(format!("kube-ipvs-as-kube-proxy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let link = dir.join("kube-proxy");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kube-ipvs"), &link).expect("link");
    let flags = [
        "--config",
        bad.to_str().expect("utf-8"),
        "--hostname-override=node-1",
        "--proxy-mode=iptables",
    ];
    let out = Command::new(&link)
        .args(flags)
        .output()
        .expect("run as kube-proxy");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("ipvs.scheduler \"fastest\""), "{err}");
    let mut run = vec!["run"];
    run.extend(flags);
    let (code, err) = run_exit(&run);
    assert_eq!(code, Some(4), "{err}");
    assert!(err.contains("--proxy-mode \"iptables\""), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
