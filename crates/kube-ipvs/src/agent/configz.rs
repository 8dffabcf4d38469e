//! `/configz` on the metrics server: the configuration in effect, as kube-proxy's
//! (component-base's `configz`) serves it: one JSON object keyed by the config group, holding a
//! `KubeProxyConfiguration` of `kubeproxy.config.k8s.io/v1alpha1` with kube-proxy's field names
//! and Go duration strings. It reports what the agent does, flags and file merged: the keys
//! kube-ipvs accepts but does not act on (`docs/operations.md`) are left out. Nothing secret is
//! in it: the kubeconfig appears as its path.

use std::time::Duration;

use serde_json::{Value, json};

use super::config::Settings;
use super::masq::DetectLocal;

/// The config group kube-proxy registers its configz under.
pub const GROUP: &str = "kubeproxy.config.k8s.io";

/// A duration as Go's `time.Duration.String()` writes it (`0s`, `500ms`, `30s`, `1m0s`,
/// `24h0m0s`), the form of a `metav1.Duration` in JSON.
pub fn go_duration(d: Duration) -> String {
    if d.is_zero() {
        return "0s".to_owned();
    }
    if d < Duration::from_secs(1) {
        let ns = d.as_nanos();
        return if ns.is_multiple_of(1_000_000) {
            format!("{}ms", ns / 1_000_000)
        } else if ns.is_multiple_of(1_000) {
            format!("{}µs", ns / 1_000)
        } else {
            format!("{ns}ns")
        };
    }
    let total = d.as_secs();
    let (h, m, s) = (total / 3600, (total % 3600) / 60, total % 60);
    let nanos = d.subsec_nanos();
    let secs = if nanos == 0 {
        s.to_string()
    } else {
        let frac = format!("{nanos:09}");
        format!("{s}.{}", frac.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => format!("{secs}s"),
        (0, m) => format!("{m}m{secs}s"),
        (h, m) => format!("{h}h{m}m{secs}s"),
    }
}

fn seconds(s: Option<u32>) -> String {
    go_duration(Duration::from_secs(u64::from(s.unwrap_or(0))))
}

fn list(value: Option<&str>) -> Vec<String> {
    value
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The `/configz` document for `settings`.
pub fn document(settings: &Settings) -> Value {
    let src = &settings.source;
    let (mode, bridge, prefix) = match &settings.detect_local {
        DetectLocal::ClusterCidr => ("ClusterCIDR", "", ""),
        DetectLocal::NodeCidr => ("NodeCIDR", "", ""),
        DetectLocal::BridgeInterface(b) => ("BridgeInterface", b.as_str(), ""),
        DetectLocal::InterfaceNamePrefix(p) => ("InterfaceNamePrefix", "", p.as_str()),
    };
    let sync = go_duration(settings.sync_period);
    let min_sync = go_duration(settings.min_sync_period);
    let ct = &settings.conntrack;
    let config = json!({
        "kind": "KubeProxyConfiguration",
        "apiVersion": format!("{GROUP}/v1alpha1"),
        "clientConnection": {
            "kubeconfig": src
                .kubeconfig
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        },
        "hostnameOverride": settings.node.node_name,
        "bindAddress": "0.0.0.0",
        "healthzBindAddress": settings.healthz.to_string(),
        "metricsBindAddress": settings.metrics.to_string(),
        "mode": "ipvs",
        "iptables": {
            "masqueradeBit": settings.masquerade_bit,
            "masqueradeAll": settings.masquerade_all,
            "localhostNodePorts": false,
            "syncPeriod": sync,
            "minSyncPeriod": min_sync,
        },
        "ipvs": {
            "syncPeriod": sync,
            "minSyncPeriod": min_sync,
            "scheduler": src.scheduler.as_deref().unwrap_or(crate::cmd::source::DEFAULT_SCHEDULER),
            "excludeCIDRs": list(src.exclude_cidrs.as_deref()),
            "strictARP": settings.strict_arp,
            "tcpTimeout": seconds(settings.timeouts.tcp),
            "tcpFinTimeout": seconds(settings.timeouts.tcp_fin),
            "udpTimeout": seconds(settings.timeouts.udp),
        },
        "detectLocalMode": mode,
        "detectLocal": {"bridgeInterface": bridge, "interfaceNamePrefix": prefix},
        "clusterCIDR": src.cluster_cidr.clone().unwrap_or_default(),
        "nodePortAddresses": list(src.nodeport_addresses.as_deref()),
        "conntrack": {
            "maxPerCore": ct.max_per_core,
            "min": ct.min,
            "tcpEstablishedTimeout": go_duration(Duration::from_secs(ct.tcp_established)),
            "tcpCloseWaitTimeout": go_duration(Duration::from_secs(ct.tcp_close_wait)),
            "tcpBeLiberal": ct.tcp_be_liberal,
            "udpTimeout": go_duration(Duration::from_secs(ct.udp)),
            "udpStreamTimeout": go_duration(Duration::from_secs(ct.udp_stream)),
        },
    });
    json!({ GROUP: config })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_go_writes_them() {
        for (d, want) in [
            (Duration::ZERO, "0s"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(15 * 60), "15m0s"),
            (Duration::from_secs(3600), "1h0m0s"),
            (Duration::from_secs(24 * 3600), "24h0m0s"),
            (Duration::from_secs(3661), "1h1m1s"),
        ] {
            assert_eq!(go_duration(d), want, "{d:?}");
        }
    }
}
