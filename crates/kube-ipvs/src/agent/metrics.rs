//! What the agent measures, and its Prometheus text rendering.
//!
//! Every series kube-proxy's IPVS mode registers (`pkg/proxy/metrics/metrics.go`) is here
//! under its name, help, labels and buckets, so existing dashboards keep working; the per-family
//! ones carry the node's primary family in `ip_family` (one sync serves both families). The
//! rest are ours, prefixed `kube_ipvs_`. The agent
//! updates a [`Metrics`] behind a mutex; the HTTP server renders it. Nothing here is secret:
//! counts and durations only, no addresses or names.
//!
//! The text is rendered here rather than by `prometheus-client` because that crate writes
//! OpenMetrics, which is not byte for byte what kube-proxy serves (Prometheus' text format
//! 0.0.4 from client_golang): bucket bounds as `le="1.0"` where kube-proxy writes `le="1"`
//! (dashboards and recording rules that select a bucket match the label's text), counter
//! families typed without their `_total`, and a closing `# EOF`. The tests below pin
//! kube-proxy's spelling (`le="0"`, `le="0.25"`, `le="300"`).

use std::fmt::Write as _;
use std::time::Duration;

/// kube-proxy's buckets for sync durations: 1 ms doubling 15 times (about 16 s).
fn sync_buckets() -> Vec<f64> {
    (0..15).map(|i| 0.001 * f64::from(1u32 << i)).collect()
}

/// kube-proxy's buckets for `kubeproxy_network_programming_duration_seconds`
/// (`pkg/proxy/metrics/metrics.go`): 0.25 s and 0.5 s, every second to 59 s, every 5 s to
/// 115 s, every 30 s to 5 min. The leading 0 is there because component-base's
/// `MergeBuckets` starts from a one-element zero slice; we keep it so the series are the same,
/// and it is where a negative latency (the node's clock behind the controller's) lands.
fn network_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.0, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

/// A Prometheus histogram with fixed buckets.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: Vec<f64>) -> Self {
        let counts = vec![0; bounds.len()];
        Self {
            bounds,
            counts,
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, d: Duration) {
        self.observe_secs(d.as_secs_f64());
    }

    /// Records one observation in seconds, which may be negative (a latency measured across
    /// two clocks).
    pub fn observe_secs(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    /// How many observations there were.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The histogram's lines, each series with `labels` (`ip_family="IPv4"`, or empty).
    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// Why a sync ran, as the `reason` label of the operation counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncKind {
    /// The first full sync, adopting what the kernel holds.
    Startup,
    /// Changed Services only.
    Incremental,
    /// The periodic full reconcile.
    Reconcile,
    /// A full sync retrying failed operations.
    Retry,
}

impl SyncKind {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            SyncKind::Startup => "startup",
            SyncKind::Incremental => "incremental",
            SyncKind::Reconcile => "reconcile",
            SyncKind::Retry => "retry",
        }
    }

    const ALL: [SyncKind; 4] = [
        SyncKind::Startup,
        SyncKind::Incremental,
        SyncKind::Reconcile,
        SyncKind::Retry,
    ];
}

/// Everything `/metrics` shows.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Every sync's duration (kube-proxy's name).
    pub sync_duration: Histogram,
    /// Full syncs' durations.
    pub full_sync_duration: Histogram,
    /// From an EndpointSlice change's trigger time to the end of the sync that programmed it
    /// (kube-proxy's name and buckets).
    pub network_programming: Histogram,
    /// Wall-clock time of the last successful sync, in Unix seconds.
    pub last_sync_timestamp: f64,
    /// Operations applied, by why the sync ran.
    pub operations: [u64; 4],
    /// Operations the periodic reconcile had to apply: drift someone else caused.
    pub drift_repaired: u64,
    /// Reconciles that found the kernel's table to be the desired one by its fingerprint, so
    /// walked no diff (see `kube_ipvs_diff::fingerprint`).
    pub reconcile_fingerprint_matches: u64,
    /// Operations or reads the kernel refused.
    pub kernel_errors: u64,
    /// Virtual servers the engine wants.
    pub services: u64,
    /// Real servers the engine wants (draining ones included).
    pub real_servers: u64,
    /// Kernel entries the engine cannot represent and leaves alone.
    pub foreign_entries: u64,
    /// Services waiting for a failed operation to be retried.
    pub pending_retries: u64,
    /// Times the masquerade rules could not be applied (each is retried at the next reconcile).
    pub masquerade_errors: u64,
    /// UDP conntrack cleanups (after a UDP real or virtual server was deleted) that failed.
    pub conntrack_errors: u64,
    /// UDP conntrack entries deleted after their real or virtual server was deleted.
    pub conntrack_flushed: u64,
    /// Draining real servers deleted at the graceful-termination timeout with connections left.
    pub drain_timeouts: u64,
    /// `/healthz` answers: 200s and 503s.
    pub healthz: [u64; 2],
    /// `/livez` answers: 200s and 503s.
    pub livez: [u64; 2],
    /// The `ip_family` label of the per-family series: one sync serves both families, so the
    /// series carry the node's primary family (`IPv6` on an IPv6-only node).
    pub ip_family: &'static str,
    /// Wall-clock time a change was last queued for a sync, in Unix seconds.
    pub last_queued_timestamp: f64,
    /// Service objects changed, in all; and not yet synced.
    pub service_changes: u64,
    pub service_changes_pending: u64,
    /// Services whose endpoints changed, in all; and not yet synced.
    pub endpoint_changes: u64,
    pub endpoint_changes_pending: u64,
    /// Services with a Local traffic policy and no local endpoint: internal, external (at the
    /// last full sync).
    pub no_local_endpoints: [u64; 2],
    /// How long the UDP conntrack cleanups of a sync took.
    pub conntrack_reconcile: Histogram,
    /// Watch errors the API watches recovered from (failed lists, dropped watches, 410 Gone).
    pub watch_errors: u64,
    /// Completed relists of Services or EndpointSlices (the first lists and every one after a
    /// watch could not resume).
    pub watch_relists: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            sync_duration: Histogram::new(sync_buckets()),
            full_sync_duration: Histogram::new(sync_buckets()),
            network_programming: Histogram::new(network_programming_buckets()),
            last_sync_timestamp: 0.0,
            operations: [0; 4],
            drift_repaired: 0,
            reconcile_fingerprint_matches: 0,
            kernel_errors: 0,
            services: 0,
            real_servers: 0,
            foreign_entries: 0,
            pending_retries: 0,
            masquerade_errors: 0,
            conntrack_errors: 0,
            conntrack_flushed: 0,
            drain_timeouts: 0,
            healthz: [0; 2],
            livez: [0; 2],
            ip_family: "IPv4",
            last_queued_timestamp: 0.0,
            service_changes: 0,
            service_changes_pending: 0,
            endpoint_changes: 0,
            endpoint_changes_pending: 0,
            no_local_endpoints: [0; 2],
            conntrack_reconcile: Histogram::new(sync_buckets()),
            watch_errors: 0,
            watch_relists: 0,
        }
    }
}

impl Metrics {
    /// Operations applied by syncs of this kind.
    pub fn operations(&self, kind: SyncKind) -> u64 {
        self.operations[kind as usize]
    }

    /// Counts applied operations.
    pub fn add_operations(&mut self, kind: SyncKind, n: u64) {
        self.operations[kind as usize] += n;
    }

    /// Counts one `/healthz` (or `/livez`) answer, 200 when `ok`, else 503.
    pub fn count_health(&mut self, healthz: bool, ok: bool) {
        let counts = if healthz {
            &mut self.healthz
        } else {
            &mut self.livez
        };
        counts[usize::from(!ok)] += 1;
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let family = format!("ip_family=\"{}\"", self.ip_family);
        self.sync_duration.render(
            &mut out,
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            &family,
        );
        self.full_sync_duration.render(
            &mut out,
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            &family,
        );
        self.network_programming.render(
            &mut out,
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            &family,
        );
        self.conntrack_reconcile.render(
            &mut out,
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            &family,
        );
        // kube-proxy's per-family series, with this node's family.
        let labelled = |out: &mut String, kind: &str, name: &str, help: &str, v: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{family}}} {v}"
            );
        };
        labelled(
            &mut out,
            "gauge",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            format!("{}", self.last_queued_timestamp),
        );
        labelled(
            &mut out,
            "counter",
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            "Cumulative proxy iptables restore failures",
            self.masquerade_errors.to_string(),
        );
        labelled(
            &mut out,
            "counter",
            "kubeproxy_conntrack_reconciler_deleted_entries_total",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            self.conntrack_flushed.to_string(),
        );
        let name = "kubeproxy_sync_proxy_rules_no_local_endpoints_total";
        let _ = writeln!(
            out,
            "# HELP {name} Number of services with a Local traffic policy and no endpoints\n# TYPE {name} gauge"
        );
        for (policy, n) in [
            ("internal", self.no_local_endpoints[0]),
            ("external", self.no_local_endpoints[1]),
        ] {
            let _ = writeln!(out, "{name}{{traffic_policy=\"{policy}\",{family}}} {n}");
        }
        let gauge = |out: &mut String, name: &str, help: &str, v: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        labelled(
            &mut out,
            "gauge",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            format!("{}", self.last_sync_timestamp),
        );
        for (name, help, v) in [
            (
                "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
                "Pending proxy rules Endpoint changes",
                self.endpoint_changes_pending,
            ),
            (
                "kubeproxy_sync_proxy_rules_service_changes_pending",
                "Pending proxy rules Service changes",
                self.service_changes_pending,
            ),
        ] {
            gauge(&mut out, name, help, v.to_string());
        }
        counter(
            &mut out,
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "Cumulative proxy rules Endpoint changes",
            self.endpoint_changes,
        );
        counter(
            &mut out,
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "Cumulative proxy rules Service changes",
            self.service_changes,
        );
        let name = "kube_ipvs_operations_total";
        let _ = writeln!(
            out,
            "# HELP {name} Kernel operations applied, by why the sync ran\n# TYPE {name} counter"
        );
        for kind in SyncKind::ALL {
            let _ = writeln!(
                out,
                "{name}{{reason=\"{}\"}} {}",
                kind.label(),
                self.operations(kind)
            );
        }
        counter(
            &mut out,
            "kube_ipvs_drift_repaired_total",
            "Operations the periodic reconcile applied to repair changes made behind our back",
            self.drift_repaired,
        );
        counter(
            &mut out,
            "kube_ipvs_reconcile_fingerprint_matches_total",
            "Reconciles that found the kernel's table to be the desired one by its fingerprint, without diffing",
            self.reconcile_fingerprint_matches,
        );
        counter(
            &mut out,
            "kube_ipvs_masquerade_errors_total",
            "Attempts to apply the masquerade (iptables nat) rules that failed",
            self.masquerade_errors,
        );
        counter(
            &mut out,
            "kube_ipvs_conntrack_errors_total",
            "UDP conntrack cleanups after a deleted real or virtual server that failed",
            self.conntrack_errors,
        );
        counter(
            &mut out,
            "kube_ipvs_conntrack_entries_deleted_total",
            "UDP conntrack entries deleted because their real or virtual server was deleted",
            self.conntrack_flushed,
        );
        counter(
            &mut out,
            "kube_ipvs_drain_timeouts_total",
            "Draining real servers deleted at --graceful-termination-timeout with connections left",
            self.drain_timeouts,
        );
        counter(
            &mut out,
            "kube_ipvs_kernel_errors_total",
            "Kernel operations or reads that failed",
            self.kernel_errors,
        );
        counter(
            &mut out,
            "kube_ipvs_watch_errors_total",
            "Errors the Service, EndpointSlice and Node watches recovered from (failed lists, dropped watches, 410 Gone)",
            self.watch_errors,
        );
        counter(
            &mut out,
            "kube_ipvs_watch_relists_total",
            "Completed lists of Services or EndpointSlices: the first two, and one per watch that could not resume",
            self.watch_relists,
        );
        // kube-proxy's counter vectors by HTTP code: a code is shown once it has been answered.
        for (name, help, counts) in [
            (
                "kubeproxy_proxy_healthz_total",
                "Cumulative proxy healthz HTTP status",
                self.healthz,
            ),
            (
                "kubeproxy_proxy_livez_total",
                "Cumulative proxy livez HTTP status",
                self.livez,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (code, n) in [("200", counts[0]), ("503", counts[1])] {
                if n > 0 {
                    let _ = writeln!(out, "{name}{{code=\"{code}\"}} {n}");
                }
            }
        }
        gauge(
            &mut out,
            "kube_ipvs_services",
            "IPVS virtual servers programmed",
            self.services.to_string(),
        );
        gauge(
            &mut out,
            "kube_ipvs_real_servers",
            "IPVS real servers programmed, draining ones included",
            self.real_servers.to_string(),
        );
        gauge(
            &mut out,
            "kube_ipvs_foreign_entries",
            "Kernel IPVS entries kube-ipvs cannot represent and leaves alone",
            self.foreign_entries.to_string(),
        );
        gauge(
            &mut out,
            "kube_ipvs_pending_retries",
            "Services with a failed kernel operation waiting for a retry",
            self.pending_retries.to_string(),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(vec![0.001, 0.01]);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let mut out = String::new();
        h.render(&mut out, "x", "help", "");
        assert!(out.contains("x_bucket{le=\"0.001\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.01\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"), "{out}");
    }

    #[test]
    fn network_programming_has_kube_proxys_buckets() {
        let b = network_programming_buckets();
        // 1 (the zero) + 2 + 59 + 12 + 7, as kube-proxy's MergeBuckets builds them.
        assert_eq!(b.len(), 81);
        assert_eq!(&b[..5], &[0.0, 0.25, 0.5, 1.0, 2.0]);
        assert_eq!(b[61], 59.0);
        assert_eq!(&b[62..64], &[60.0, 65.0]);
        assert_eq!(b[73], 115.0);
        assert_eq!(&b[74..], &[120.0, 150.0, 180.0, 210.0, 240.0, 270.0, 300.0]);
        let text = Metrics::default().render();
        let name = "kubeproxy_network_programming_duration_seconds";
        assert!(
            text.contains(&format!(
                "# HELP {name} In Cluster Network Programming Latency in seconds\n# TYPE {name} histogram\n{name}_bucket{{ip_family=\"IPv4\",le=\"0\"}} 0\n{name}_bucket{{ip_family=\"IPv4\",le=\"0.25\"}} 0\n"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "{name}_bucket{{ip_family=\"IPv4\",le=\"300\"}} 0\n"
            )),
            "{text}"
        );
    }

    #[test]
    fn a_negative_latency_lands_in_the_zero_bucket() {
        let mut m = Metrics::default();
        m.network_programming.observe_secs(-1.5);
        m.network_programming.observe_secs(0.375);
        let text = m.render();
        let name = "kubeproxy_network_programming_duration_seconds";
        assert!(
            text.contains(&format!("{name}_bucket{{ip_family=\"IPv4\",le=\"0\"}} 1\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "{name}_bucket{{ip_family=\"IPv4\",le=\"0.25\"}} 1\n"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "{name}_bucket{{ip_family=\"IPv4\",le=\"0.5\"}} 2\n"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("{name}_sum{{ip_family=\"IPv4\"}} -1.125\n")),
            "{text}"
        );
    }

    #[test]
    fn render_names_every_metric_once_with_its_value() {
        let mut m = Metrics::default();
        m.add_operations(SyncKind::Startup, 7);
        m.drift_repaired = 3;
        m.watch_relists = 5;
        m.services = 4;
        let text = m.render();
        assert!(text.contains("kube_ipvs_operations_total{reason=\"startup\"} 7\n"));
        assert!(text.contains("kube_ipvs_drift_repaired_total 3\n"));
        assert!(text.contains("kube_ipvs_watch_relists_total 5\n"));
        assert!(text.contains("kube_ipvs_services 4\n"));
        m.no_local_endpoints = [2, 1];
        m.ip_family = "IPv6";
        let text = m.render();
        // kube-proxy's IPVS-mode series (`pkg/proxy/metrics/metrics.go`), with its labels.
        for line in [
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\",ip_family=\"IPv6\"} 2\n",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\",ip_family=\"IPv6\"} 1\n",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv6\"} 0\n",
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 0\n",
            "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv6\"} 0\n",
            "kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family=\"IPv6\"} 0\n",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0\n",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 0\n",
            "kubeproxy_sync_proxy_rules_service_changes_pending 0\n",
            "kubeproxy_sync_proxy_rules_service_changes_total 0\n",
            "# TYPE kubeproxy_proxy_healthz_total counter\n",
            "# TYPE kubeproxy_proxy_livez_total counter\n",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        for name in [
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_network_programming_duration_seconds",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "kube_ipvs_kernel_errors_total",
            "kube_ipvs_real_servers",
        ] {
            assert_eq!(
                text.matches(&format!("# TYPE {name} ")).count(),
                1,
                "{name}"
            );
        }
    }
}
