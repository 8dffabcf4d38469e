//! The settings of `kube-ipvs run`: its flags, kube-proxy's `KubeProxyConfiguration` file
//! (`--config`), and the one validated [`Settings`] value both resolve to.
//!
//! Flags win over the file, the file over the defaults. Every value is checked here, before
//! anything touches the kernel, and an error names the setting as the user wrote it
//! (`--scheduler` or `ipvs.scheduler`). A kubeadm cluster's kube-proxy ConfigMap must load
//! unchanged, so every key kube-proxy knows is accepted, even those that mean nothing to IPVS
//! mode; a key kube-proxy does not know is an error naming it. This module reads no kernel state.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kube_ipvs_diff::{Cidr, NodeContext};
use serde::Deserialize;
use serde::de::IgnoredAny;

use super::nodeports::NodePortAddresses;
use crate::cmd::source::SourceArgs;

/// The only `apiVersion` of `KubeProxyConfiguration` there is.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// kube-proxy's default `healthzBindAddress`.
pub const DEFAULT_HEALTHZ: &str = "0.0.0.0:10256";
/// kube-proxy's default `metricsBindAddress`.
pub const DEFAULT_METRICS: &str = "127.0.0.1:10249";
/// kube-proxy's default `ipvs.syncPeriod`.
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// The default `--min-sync-period`: none. kube-proxy defaults to 1 s because each of its syncs
/// rewrites everything; ours costs the changed Services only, and a burst of events already
/// lands in one change set (the watch driver drains what is queued first), so a wait would only
/// delay programming. A configured value (flag or `ipvs.minSyncPeriod`) is honoured.
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::ZERO;

/// Why the settings are unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not a valid `KubeProxyConfiguration`.
    #[error("config file {path}: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (it names an unknown key).
        reason: String,
    },
    /// One setting has an unusable value.
    #[error("{setting} {value:?}: {reason}")]
    Setting {
        /// The flag (`--scheduler`) or file key (`ipvs.scheduler`).
        setting: String,
        /// The value given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl ConfigError {
    fn setting(setting: &str, value: &str, reason: impl Into<String>) -> Self {
        ConfigError::Setting {
            setting: setting.to_owned(),
            value: value.to_owned(),
            reason: reason.into(),
        }
    }

    /// Whether the problem is the config file as a whole (rather than one setting's value).
    pub fn is_file_error(&self) -> bool {
        matches!(self, ConfigError::Read { .. } | ConfigError::Parse { .. })
    }
}

/// The command line of `kube-ipvs run`. Values are kept as given; [`Settings::resolve`] checks
/// them, so a bad value is reported with its flag name in our words.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(
    after_help = "Exit codes: 0 stopped by SIGTERM/SIGINT (the kernel state stays), \
1 the desired-state source ended, 2 command line, 3 config file unreadable or invalid, \
4 invalid setting, 5 kernel setup (missing module, sysctl, IPVS), 6 serving or watching \
could not start."
)]
pub struct RunArgs {
    /// kube-proxy's `KubeProxyConfiguration` file (e.g. the kube-proxy ConfigMap's
    /// `config.conf`); flags given on the command line win over it (under the name
    /// `kube-proxy`, kube-proxy's flags are ignored beside it, as kube-proxy ignores them).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Read Services and EndpointSlices (and optionally this node's Node) from YAML manifests,
    /// a file or a directory, re-read when they change; without it the API server is watched.
    #[arg(long, value_name = "PATH")]
    pub manifests: Option<PathBuf>,
    /// The kubeconfig for the API server; default: in-cluster config, then `$KUBECONFIG`.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's address, overriding the kubeconfig's (kube-proxy's `--master`); without
    /// `--kubeconfig` it is the whole connection, with no credentials.
    #[arg(long, value_name = "URL")]
    pub master: Option<String>,
    /// This node's name (default: the kernel's hostname, lowercased).
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// This node's zone; default: the Node object's `topology.kubernetes.io/zone` label.
    #[arg(long, value_name = "ZONE")]
    pub node_zone: Option<String>,
    /// An address NodePorts listen on (repeatable), instead of the choice of
    /// `--nodeport-addresses`.
    #[arg(long = "node-ip", value_name = "IP")]
    pub node_ips: Vec<IpAddr>,
    /// The IPVS scheduler for Services without a `kube-ipvs.io/scheduler` annotation (any
    /// kernel scheduler: rr, wrr, lc, wlc, lblc, lblcr, dh, sh, mh, sed, nq, fo, ovf, twos;
    /// `sh`/`mh` take `:fallback,port`). Default rr.
    #[arg(long, value_name = "NAME", alias = "ipvs-scheduler")]
    pub scheduler: Option<String>,
    /// The Pod network(s), comma-separated (for the masquerade rules).
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub cluster_cidr: Option<String>,
    /// Masquerade all traffic to ClusterIPs, even from local Pods (Local-policy external
    /// traffic still keeps the client's address).
    #[arg(long)]
    pub masquerade_all: bool,
    /// How ClusterIP traffic from this node's Pods is recognised (it keeps its address):
    /// ClusterCIDR (sources in --cluster-cidr, the default), NodeCIDR (the Node's podCIDRs),
    /// BridgeInterface (--pod-bridge-interface), InterfaceNamePrefix
    /// (--pod-interface-name-prefix).
    #[arg(long, value_name = "MODE")]
    pub detect_local_mode: Option<String>,
    /// The bridge Pods are attached to, for --detect-local-mode=BridgeInterface.
    #[arg(long, value_name = "NAME")]
    pub pod_bridge_interface: Option<String>,
    /// The prefix of Pod interfaces, for --detect-local-mode=InterfaceNamePrefix.
    #[arg(long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,
    /// The packet mark bit (0 to 31) meaning "masquerade this" (default 14, i.e. 0x4000).
    #[arg(long, value_name = "BIT")]
    pub iptables_masquerade_bit: Option<u8>,
    /// This node's Pod network(s), comma-separated: hairpin traffic is recognised by one
    /// masquerade rule per CIDR. Without it, by one rule matching the `KUBE-IPVS-HAIRPIN`
    /// ipsets (one member per endpoint on this node; one rule each without ipset support).
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub node_pod_cidr: Option<String>,
    /// Leave iptables alone: no masquerade rules in `nat`, no Service filter or
    /// loadBalancerSourceRanges in `filter` (e.g. when another component does both).
    #[arg(long)]
    pub no_masquerade: bool,
    /// Keep kube-proxy's IPVS-mode chains (`KUBE-SERVICES`, `KUBE-IPVS-FILTER`, ...) and ipsets
    /// (`KUBE-CLUSTER-IP`, ...) instead of removing them once our rules are in place. Left
    /// behind they act on every packet and go wrong as Services change; keep them only while
    /// kube-proxy itself still runs on the node.
    #[arg(long)]
    pub keep_kube_proxy_rules: bool,
    /// kube-proxy's `--init-only`: load the modules and set the sysctls and IPVS timeouts the
    /// settings need (what needs full privileges, e.g. in a privileged init container), then
    /// exit 0. A `run` afterwards needs only `NET_ADMIN` and `NET_RAW`, and writes no
    /// sysctl.
    #[arg(long)]
    pub init_only: bool,
    /// NodePorts listen on the node's addresses inside these networks, comma-separated, or on
    /// `primary` (the Node's InternalIP of each family); a family with no network takes every
    /// local address (the default: all but loopback, IPv6 link-local and `kube-ipvs0`'s).
    /// Followed as addresses come and go.
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub nodeport_addresses: Option<String>,
    /// How often the whole kernel table is dumped and drift repaired (e.g. `30s`, `1m0s`).
    #[arg(long, value_name = "DURATION", alias = "ipvs-sync-period")]
    pub sync_period: Option<String>,
    /// The minimum interval between incremental syncs (changes are batched meanwhile).
    #[arg(long, value_name = "DURATION", alias = "ipvs-min-sync-period")]
    pub min_sync_period: Option<String>,
    /// How long a removed TCP or SCTP real server with open connections keeps weight 0 before
    /// it is deleted anyway (e.g. `1h`; default `15m`); `0s` deletes at once. Each deletion at
    /// this cap is logged and counted (`kube_ipvs_drain_timeouts_total`).
    #[arg(long, value_name = "DURATION")]
    pub graceful_termination_timeout: Option<String>,
    /// The packet-mark bits (one run, e.g. `0x3ff00000`, the default) the Local-policy short
    /// circuit gives its fwmark virtual servers, so this node's Pods and the node itself reach
    /// every endpoint of an `externalTrafficPolicy: Local` Service's NodePorts, external and
    /// load-balancer IPs; `0` turns it off (local clients then get local endpoints only, as in
    /// kube-proxy's IPVS mode). Must not hold the masquerade bit or bits another agent marks.
    #[arg(long, value_name = "MASK")]
    pub local_fwmark_mask: Option<String>,
    /// Set `arp_ignore=1` and `arp_announce=2` so Service addresses on `kube-ipvs0` are not
    /// answered for by ARP (needed by some load balancers).
    #[arg(long, alias = "ipvs-strict-arp")]
    pub strict_arp: bool,
    /// Set `net.ipv4.vs.run_estimation=0` (kernel 5.12 or later): the kernel stops its
    /// per-2-seconds estimate of every virtual and real server's rates. Before kernel 6.2 that
    /// estimate is one timer walking every server's counters under the lock each IPVS add and
    /// delete takes, which at 100,000 real servers holds such changes up by tens of ms every
    /// 2 s. The cost: the same walk sums the counters, so `ipvsadm -L --rate` and `--stats`
    /// and `/proc/net/ip_vs_stats` stop changing. Unset leaves the kernel's value; a failure
    /// to set it (no such sysctl before 5.12, a read-only `/proc/sys`) is logged, not fatal.
    #[arg(long)]
    pub no_ipvs_rate_estimation: bool,
    /// How Service addresses (ClusterIPs, external and load-balancer IPs) are made local so
    /// IPVS sees their packets: `address` binds each to `kube-ipvs0`, as kube-proxy's IPVS
    /// mode does; `route` adds a local route of ours for each instead (`ip route show table
    /// local proto 124`), which costs the kernel no walk of an interface's address list per
    /// add (50,000 take seconds instead of minutes) but leaves `ip addr show kube-ipvs0` empty.
    /// A change either way moves the node's addresses at start, making each local the new way
    /// before undoing the old.
    #[arg(long, value_name = "address|route", default_value = "address")]
    pub service_address_binding: crate::kernel::Binding,
    /// Networks whose virtual servers and addresses belong to someone else and are never
    /// touched, comma-separated.
    #[arg(long, value_name = "CIDR[,CIDR]", alias = "ipvs-exclude-cidrs")]
    pub exclude_cidrs: Option<String>,
    /// IPVS timeout for established TCP connections (e.g. `900s`); unset leaves the kernel's.
    #[arg(long, value_name = "DURATION", alias = "ipvs-tcp-timeout")]
    pub tcp_timeout: Option<String>,
    /// IPVS timeout for TCP connections after a FIN; unset leaves the kernel's.
    #[arg(long, value_name = "DURATION", alias = "ipvs-tcpfin-timeout")]
    pub tcpfin_timeout: Option<String>,
    /// IPVS timeout for UDP; unset leaves the kernel's.
    #[arg(long, value_name = "DURATION", alias = "ipvs-udp-timeout")]
    pub udp_timeout: Option<String>,
    /// Where `/healthz` and `/livez` are served (IP or IP:PORT; default 0.0.0.0:10256).
    #[arg(long, value_name = "IP:PORT")]
    pub healthz_bind_address: Option<String>,
    /// Where Prometheus `/metrics` is served (IP or IP:PORT; default 127.0.0.1:10249).
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_bind_address: Option<String>,
    /// Take only Services labelled `service.kubernetes.io/service-proxy-name` with this value.
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,
    /// Conntrack table entries per CPU (`nf_conntrack_max` = this x CPUs, at least
    /// `--conntrack-min`); 0 leaves the table size alone. Default 32768.
    #[arg(long, value_name = "N")]
    pub conntrack_max_per_core: Option<u32>,
    /// The least conntrack table size. Default 131072.
    #[arg(long, value_name = "N")]
    pub conntrack_min: Option<u32>,
    /// Idle timeout of established TCP conntrack entries; 0 leaves the kernel's. Default 24h.
    #[arg(long, value_name = "DURATION")]
    pub conntrack_tcp_timeout_established: Option<String>,
    /// Timeout of TCP conntrack entries in CLOSE_WAIT; 0 leaves the kernel's. Default 1h.
    #[arg(long, value_name = "DURATION")]
    pub conntrack_tcp_timeout_close_wait: Option<String>,
    /// Let conntrack accept TCP packets outside the window instead of marking them INVALID.
    #[arg(long)]
    pub conntrack_tcp_be_liberal: bool,
    /// Timeout of unreplied UDP conntrack entries; 0 (default) leaves the kernel's.
    #[arg(long, value_name = "DURATION")]
    pub conntrack_udp_timeout: Option<String>,
    /// Timeout of UDP conntrack entries that saw replies; 0 (default) leaves the kernel's.
    #[arg(long, value_name = "DURATION")]
    pub conntrack_udp_timeout_stream: Option<String>,
    /// kube-proxy's mode: only `ipvs` (or empty) is accepted.
    #[arg(
        long,
        value_name = "MODE",
        help_heading = "kube-proxy flags accepted for compatibility"
    )]
    pub proxy_mode: Option<String>,
    /// kube-proxy's log verbosity: accepted and ignored (use RUST_LOG).
    #[arg(
        short = 'v',
        long = "v",
        value_name = "LEVEL",
        help_heading = "kube-proxy flags accepted for compatibility"
    )]
    pub verbosity: Option<String>,
    /// Accepted and ignored, with a warning: kube-ipvs binds no proxy socket.
    #[arg(
        long,
        value_name = "IP",
        help_heading = "kube-proxy flags accepted for compatibility"
    )]
    pub bind_address: Option<String>,
    /// Accepted and ignored, with a warning: set the container's OOM score in the manifest.
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags accepted for compatibility"
    )]
    pub oom_score_adj: Option<String>,
    /// Accepted and ignored, with a warning: kube-ipvs has no feature gates.
    #[arg(
        long,
        value_name = "GATES",
        help_heading = "kube-proxy flags accepted for compatibility"
    )]
    pub feature_gates: Option<String>,
    /// Accepted and ignored, with a warning: the client's own rate limits apply.
    #[arg(
        long,
        value_name = "QPS",
        help_heading = "kube-proxy flags accepted for compatibility"
    )]
    pub kube_api_qps: Option<String>,
    /// Accepted and ignored, with a warning.
    #[arg(
        long,
        value_name = "N",
        help_heading = "kube-proxy flags accepted for compatibility"
    )]
    pub kube_api_burst: Option<String>,
    /// Accepted and ignored, with a warning: the client speaks JSON.
    #[arg(
        long,
        value_name = "TYPE",
        help_heading = "kube-proxy flags accepted for compatibility"
    )]
    pub kube_api_content_type: Option<String>,
    /// Set when the program runs under the name `kube-proxy` (not a flag): its command line is
    /// then read as kube-proxy reads it, so with `--config` every flag the file covers is
    /// ignored, each named in a warning, instead of winning over the file ([`kube_proxy_view`]).
    #[arg(skip)]
    pub as_kube_proxy: bool,
}

/// `args` as kube-proxy reads its command line when `--config` is given: the file replaces
/// every setting its flags could give, so only `--config`, `--master`, `--hostname-override`,
/// `--init-only`, `--cleanup` and the logging flags survive (`cmd/kube-proxy/app/options.go`:
/// the loaded file overwrites the parsed flags). Flags of kube-ipvs's own, which the file has
/// no key for, are kept. Returns the flags it dropped, by kube-proxy's names.
pub fn kube_proxy_view(args: &RunArgs) -> (RunArgs, Vec<&'static str>) {
    let mut a = args.clone();
    let mut dropped = Vec::new();
    let mut opt = |given: bool, name: &'static str| {
        if given {
            dropped.push(name);
        }
    };
    opt(a.kubeconfig.take().is_some(), "--kubeconfig");
    opt(a.scheduler.take().is_some(), "--ipvs-scheduler");
    opt(a.cluster_cidr.take().is_some(), "--cluster-cidr");
    opt(std::mem::take(&mut a.masquerade_all), "--masquerade-all");
    opt(a.detect_local_mode.take().is_some(), "--detect-local-mode");
    opt(
        a.pod_bridge_interface.take().is_some(),
        "--pod-bridge-interface",
    );
    opt(
        a.pod_interface_name_prefix.take().is_some(),
        "--pod-interface-name-prefix",
    );
    opt(
        a.iptables_masquerade_bit.take().is_some(),
        "--iptables-masquerade-bit",
    );
    opt(
        a.nodeport_addresses.take().is_some(),
        "--nodeport-addresses",
    );
    opt(a.sync_period.take().is_some(), "--ipvs-sync-period");
    opt(a.min_sync_period.take().is_some(), "--ipvs-min-sync-period");
    opt(std::mem::take(&mut a.strict_arp), "--ipvs-strict-arp");
    opt(a.exclude_cidrs.take().is_some(), "--ipvs-exclude-cidrs");
    opt(a.tcp_timeout.take().is_some(), "--ipvs-tcp-timeout");
    opt(a.tcpfin_timeout.take().is_some(), "--ipvs-tcpfin-timeout");
    opt(a.udp_timeout.take().is_some(), "--ipvs-udp-timeout");
    opt(
        a.healthz_bind_address.take().is_some(),
        "--healthz-bind-address",
    );
    opt(
        a.metrics_bind_address.take().is_some(),
        "--metrics-bind-address",
    );
    opt(
        a.conntrack_max_per_core.take().is_some(),
        "--conntrack-max-per-core",
    );
    opt(a.conntrack_min.take().is_some(), "--conntrack-min");
    opt(
        a.conntrack_tcp_timeout_established.take().is_some(),
        "--conntrack-tcp-timeout-established",
    );
    opt(
        a.conntrack_tcp_timeout_close_wait.take().is_some(),
        "--conntrack-tcp-timeout-close-wait",
    );
    opt(
        std::mem::take(&mut a.conntrack_tcp_be_liberal),
        "--conntrack-tcp-be-liberal",
    );
    opt(
        a.conntrack_udp_timeout.take().is_some(),
        "--conntrack-udp-timeout",
    );
    opt(
        a.conntrack_udp_timeout_stream.take().is_some(),
        "--conntrack-udp-timeout-stream",
    );
    opt(a.proxy_mode.take().is_some(), "--proxy-mode");
    opt(a.bind_address.take().is_some(), "--bind-address");
    opt(a.oom_score_adj.take().is_some(), "--oom-score-adj");
    opt(a.feature_gates.take().is_some(), "--feature-gates");
    opt(a.kube_api_qps.take().is_some(), "--kube-api-qps");
    opt(a.kube_api_burst.take().is_some(), "--kube-api-burst");
    opt(
        a.kube_api_content_type.take().is_some(),
        "--kube-api-content-type",
    );
    (a, dropped)
}

/// Keys of a section that no field took, by name.
type Unknown = std::collections::BTreeMap<String, IgnoredAny>;

/// The `conntrack` section of `KubeProxyConfiguration`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConntrackSection {
    /// Keys kube-proxy does not know either: warned about, as its lenient decoding does.
    #[serde(flatten)]
    unknown: Unknown,
    max_per_core: Option<u32>,
    min: Option<u32>,
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    tcp_be_liberal: Option<bool>,
    udp_timeout: Option<String>,
    udp_stream_timeout: Option<String>,
}

/// The `detectLocal` section of `KubeProxyConfiguration`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DetectLocalSection {
    /// Keys kube-proxy does not know either: warned about, as its lenient decoding does.
    #[serde(flatten)]
    unknown: Unknown,
    bridge_interface: Option<String>,
    interface_name_prefix: Option<String>,
}

/// The `ipvs` section of `KubeProxyConfiguration`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct IpvsSection {
    /// Keys kube-proxy does not know either: warned about, as its lenient decoding does.
    #[serde(flatten)]
    unknown: Unknown,
    scheduler: Option<String>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    strict_arp: Option<bool>,
    tcp_timeout: Option<String>,
    tcp_fin_timeout: Option<String>,
    udp_timeout: Option<String>,
}

/// The `iptables` section: only `masqueradeAll` means something in IPVS mode (kube-proxy's
/// IPVS proxier reads it from here too).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
#[expect(
    dead_code,
    reason = "kube-proxy keys that mean nothing to IPVS mode are accepted and ignored"
)]
struct IptablesSection {
    /// Keys kube-proxy does not know either: warned about, as its lenient decoding does.
    #[serde(flatten)]
    unknown: Unknown,
    masquerade_all: Option<bool>,
    masquerade_bit: Option<u8>,
    localhost_node_ports: Option<IgnoredAny>,
    sync_period: Option<IgnoredAny>,
    min_sync_period: Option<IgnoredAny>,
}

/// `clientConnection`: only the kubeconfig path is ours; rates and content types are the
/// client library's business.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
#[expect(
    dead_code,
    reason = "kube-proxy keys that mean nothing to IPVS mode are accepted and ignored"
)]
struct ClientConnection {
    /// Keys kube-proxy does not know either: warned about, as its lenient decoding does.
    #[serde(flatten)]
    unknown: Unknown,
    kubeconfig: Option<String>,
    accept_content_types: Option<IgnoredAny>,
    content_type: Option<IgnoredAny>,
    qps: Option<IgnoredAny>,
    burst: Option<IgnoredAny>,
}

/// kube-proxy's `KubeProxyConfiguration`, every key it knows. Keys that do not apply to IPVS
/// mode are accepted and ignored so a kubeadm ConfigMap loads unchanged.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
#[expect(
    dead_code,
    reason = "kube-proxy keys that mean nothing to IPVS mode are accepted and ignored"
)]
struct ProxyConfig {
    /// Keys kube-proxy does not know either: warned about, as its lenient decoding does.
    #[serde(flatten)]
    unknown: Unknown,
    api_version: Option<String>,
    kind: Option<String>,
    mode: Option<String>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    hostname_override: Option<String>,
    node_port_addresses: Option<Vec<String>>,
    client_connection: Option<ClientConnection>,
    ipvs: Option<IpvsSection>,
    iptables: Option<IptablesSection>,
    bind_address: Option<IgnoredAny>,
    bind_address_hard_fail: Option<IgnoredAny>,
    config_sync_period: Option<IgnoredAny>,
    conntrack: Option<ConntrackSection>,
    detect_local: Option<DetectLocalSection>,
    detect_local_mode: Option<String>,
    enable_profiling: Option<IgnoredAny>,
    feature_gates: Option<IgnoredAny>,
    logging: Option<IgnoredAny>,
    nftables: Option<IgnoredAny>,
    oom_score_adj: Option<IgnoredAny>,
    port_range: Option<IgnoredAny>,
    show_hidden_metrics_for_version: Option<IgnoredAny>,
    winkernel: Option<IgnoredAny>,
    windows_run_as_service: Option<IgnoredAny>,
    /// Ours, not kube-proxy's: `--service-proxy-name` in the file.
    service_proxy_name: Option<String>,
}

impl ProxyConfig {
    /// Every key no field took, with its section (`ipvs.foo`), sorted.
    fn unknown_keys(&self) -> Vec<String> {
        let section = |name: &str, keys: Option<&Unknown>| {
            keys.into_iter()
                .flat_map(|k| k.keys())
                .map(|k| format!("{name}.{k}"))
                .collect::<Vec<_>>()
        };
        let mut out: Vec<String> = self.unknown.keys().cloned().collect();
        out.extend(section("ipvs", self.ipvs.as_ref().map(|s| &s.unknown)));
        out.extend(section(
            "iptables",
            self.iptables.as_ref().map(|s| &s.unknown),
        ));
        out.extend(section(
            "clientConnection",
            self.client_connection.as_ref().map(|s| &s.unknown),
        ));
        out.extend(section(
            "conntrack",
            self.conntrack.as_ref().map(|s| &s.unknown),
        ));
        out.extend(section(
            "detectLocal",
            self.detect_local.as_ref().map(|s| &s.unknown),
        ));
        out.sort();
        out
    }
}

/// Reads and checks a `KubeProxyConfiguration` file.
fn read_file(path: &Path) -> Result<ProxyConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_file(path, &text)
}

fn parse_file(path: &Path, text: &str) -> Result<ProxyConfig, ConfigError> {
    let parse_err = |reason: String| ConfigError::Parse {
        path: path.to_owned(),
        reason,
    };
    let cfg: ProxyConfig = serde_saphyr::from_str(text).map_err(|e| {
        // The parser draws a source snippet below its first line; the first line says it all
        // (position and cause, or the unknown key) and keeps the error one line in logs.
        let text = e.to_string();
        let first = text.lines().next().unwrap_or_default();
        parse_err(first.trim_start_matches("error: ").to_owned())
    })?;
    match cfg.api_version.as_deref() {
        Some(API_VERSION) => {}
        Some(other) => {
            return Err(parse_err(format!(
                "apiVersion {other:?} is not {API_VERSION:?}"
            )));
        }
        None => {
            return Err(parse_err(format!(
                "apiVersion missing; want {API_VERSION:?}"
            )));
        }
    }
    match cfg.kind.as_deref() {
        Some("KubeProxyConfiguration") => {}
        other => {
            return Err(parse_err(format!(
                "kind {other:?} is not \"KubeProxyConfiguration\""
            )));
        }
    }
    Ok(cfg)
}

/// A value and the name of the setting it came from, so errors name what the user wrote.
type Named<T> = (T, String);

/// The flag's value if given, else the file's if set to something other than kube-proxy's
/// "unset" (empty string, `0s`, null).
fn pick(
    flag: Option<&str>,
    flag_name: &str,
    file: Option<&str>,
    key: &str,
) -> Option<Named<String>> {
    if let Some(v) = flag {
        return Some((v.to_owned(), format!("--{flag_name}")));
    }
    file.filter(|v| !v.trim().is_empty())
        .map(|v| (v.to_owned(), key.to_owned()))
}

/// Parses a Go duration (`30s`, `1m0s`, `1h30m`, `500ms`, `0`), as kube-proxy's flags and file
/// take them.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err("empty duration".to_owned());
    }
    if s.starts_with('-') {
        return Err("negative duration".to_owned());
    }
    let mut rest = s.strip_prefix('+').unwrap_or(s);
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("missing unit after {rest:?} (use s, m, h, ms...)"))?;
        let (num, tail) = rest.split_at(num_len);
        let value: f64 = num
            .parse()
            .map_err(|_| format!("{num:?} is not a number"))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            other => return Err(format!("unknown unit {other:?} (use ns, us, ms, s, m, h)")),
        };
        total += value * scale;
        rest = tail;
    }
    Duration::try_from_secs_f64(total).map_err(|e| e.to_string())
}

fn duration(v: &Named<String>) -> Result<Duration, ConfigError> {
    parse_duration(&v.0).map_err(|r| ConfigError::setting(&v.1, &v.0, r))
}

/// An IPVS timeout in whole seconds; zero means "leave the kernel's".
fn timeout_secs(v: Option<Named<String>>) -> Result<Option<u32>, ConfigError> {
    let Some(v) = v else { return Ok(None) };
    let d = duration(&v)?;
    if d.subsec_nanos() != 0 {
        return Err(ConfigError::setting(
            &v.1,
            &v.0,
            "IPVS timeouts are whole seconds",
        ));
    }
    let secs = u32::try_from(d.as_secs())
        .map_err(|_| ConfigError::setting(&v.1, &v.0, "longer than the kernel can hold"))?;
    Ok((secs > 0).then_some(secs))
}

/// `detectLocalMode` with its interface, each flag winning over its key.
fn detect_local(
    args: &RunArgs,
    file_mode: Option<&str>,
    file: DetectLocalSection,
) -> Result<super::masq::DetectLocal, ConfigError> {
    use super::masq::DetectLocal;
    let (mode, setting) = match (&args.detect_local_mode, file_mode) {
        (Some(m), _) => (m.as_str(), "--detect-local-mode"),
        (None, Some(m)) => (m, "detectLocalMode"),
        (None, None) => ("", "detectLocalMode"),
    };
    let named = |flag: &Option<String>, flag_name: &str, key: Option<String>, key_name: &str| match (
        flag, key,
    ) {
        (Some(v), _) => Some((v.clone(), flag_name.to_owned())),
        (None, Some(v)) if !v.is_empty() => Some((v, key_name.to_owned())),
        (None, _) => None,
    };
    let interface = |v: Option<(String, String)>, needs: &str| match v {
        None => Err(ConfigError::setting(
            setting,
            mode,
            format!("needs {needs}"),
        )),
        Some((name, from)) if !kube_ipvs_host::masquerade::valid_interface_name(&name) => Err(
            ConfigError::setting(&from, &name, "not 1 to 15 letters, digits, '-', '_' or '.'"),
        ),
        Some((name, _)) => Ok(name),
    };
    match mode {
        "" | "ClusterCIDR" => Ok(DetectLocal::ClusterCidr),
        "NodeCIDR" => Ok(DetectLocal::NodeCidr),
        "BridgeInterface" => Ok(DetectLocal::BridgeInterface(interface(
            named(
                &args.pod_bridge_interface,
                "--pod-bridge-interface",
                file.bridge_interface,
                "detectLocal.bridgeInterface",
            ),
            "--pod-bridge-interface or detectLocal.bridgeInterface",
        )?)),
        "InterfaceNamePrefix" => Ok(DetectLocal::InterfaceNamePrefix(interface(
            named(
                &args.pod_interface_name_prefix,
                "--pod-interface-name-prefix",
                file.interface_name_prefix,
                "detectLocal.interfaceNamePrefix",
            ),
            "--pod-interface-name-prefix or detectLocal.interfaceNamePrefix",
        )?)),
        other => Err(ConfigError::setting(
            setting,
            other,
            "one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix",
        )),
    }
}

/// A conntrack timeout in whole seconds (rounded down, as kube-proxy does); `default` when
/// neither the flag nor the key is set, 0 meaning "leave the kernel's".
fn conntrack_secs(v: Option<Named<String>>, default: u64) -> Result<u64, ConfigError> {
    match v {
        None => Ok(default),
        Some(v) => Ok(duration(&v)?.as_secs()),
    }
}

/// The `conntrack` settings: each flag wins over its key, kube-proxy's defaults otherwise.
fn conntrack_settings(
    args: &RunArgs,
    file: ConntrackSection,
) -> Result<kube_ipvs_host::setup::Conntrack, ConfigError> {
    let d = kube_ipvs_host::setup::Conntrack::default();
    // A duration from the flag, else the key, else kube-proxy's default.
    let secs = |flag: &Option<String>, flag_name, key: &Option<String>, key_name, default| {
        conntrack_secs(
            pick(flag.as_deref(), flag_name, key.as_deref(), key_name),
            default,
        )
    };
    Ok(kube_ipvs_host::setup::Conntrack {
        max_per_core: args
            .conntrack_max_per_core
            .or(file.max_per_core)
            .unwrap_or(d.max_per_core),
        min: args.conntrack_min.or(file.min).unwrap_or(d.min),
        tcp_established: secs(
            &args.conntrack_tcp_timeout_established,
            "conntrack-tcp-timeout-established",
            &file.tcp_established_timeout,
            "conntrack.tcpEstablishedTimeout",
            d.tcp_established,
        )?,
        tcp_close_wait: secs(
            &args.conntrack_tcp_timeout_close_wait,
            "conntrack-tcp-timeout-close-wait",
            &file.tcp_close_wait_timeout,
            "conntrack.tcpCloseWaitTimeout",
            d.tcp_close_wait,
        )?,
        tcp_be_liberal: args.conntrack_tcp_be_liberal || file.tcp_be_liberal.unwrap_or(false),
        udp: secs(
            &args.conntrack_udp_timeout,
            "conntrack-udp-timeout",
            &file.udp_timeout,
            "conntrack.udpTimeout",
            d.udp,
        )?,
        udp_stream: secs(
            &args.conntrack_udp_timeout_stream,
            "conntrack-udp-timeout-stream",
            &file.udp_stream_timeout,
            "conntrack.udpStreamTimeout",
            d.udp_stream,
        )?,
    })
}

/// `IP:PORT`, or an IP alone with the default's port (kube-proxy accepts both).
fn bind_address(v: Option<Named<String>>, default: &str) -> Result<SocketAddr, ConfigError> {
    let Some((value, setting)) = v else {
        return default
            .parse()
            .map_err(|_| ConfigError::setting("default bind address", default, "unparsable"));
    };
    if let Ok(a) = value.parse::<SocketAddr>() {
        return Ok(a);
    }
    let port = default
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .unwrap_or(0);
    value
        .parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, port))
        .map_err(|_| ConfigError::setting(&setting, &value, "not an IP or IP:PORT"))
}

fn cidrs(v: Option<Named<String>>) -> Result<Vec<Cidr>, ConfigError> {
    let Some((value, setting)) = v else {
        return Ok(Vec::new());
    };
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<Cidr>()
                .map_err(|e| ConfigError::setting(&setting, s, e.to_string()))
        })
        .collect()
}

/// IPVS connection timeouts in seconds; `None` leaves the kernel's value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timeouts {
    /// Established TCP.
    pub tcp: Option<u32>,
    /// TCP after FIN.
    pub tcp_fin: Option<u32>,
    /// UDP.
    pub udp: Option<u32>,
}

/// Everything `run` needs, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The desired-state source and node flags, in the form `plan`/`check` use, so all three
    /// read the same state.
    pub source: SourceArgs,
    /// The node context those give before the Node object is seen (validated).
    pub node: NodeContext,
    /// The Pod networks.
    pub cluster_cidrs: Vec<Cidr>,
    /// Masquerade everything to Services (consumed by the masquerade rules, not the table).
    pub masquerade_all: bool,
    /// This node's Pod networks (`--node-pod-cidr`), for constant-size hairpin rules.
    pub node_pod_cidrs: Vec<Cidr>,
    /// `detectLocalMode`.
    pub detect_local: super::masq::DetectLocal,
    /// The masquerade mark bit.
    pub masquerade_bit: u8,
    /// Whether the masquerade rules are managed (not `--no-masquerade`).
    pub masquerade: bool,
    /// Which local addresses NodePorts listen on (`nodePortAddresses`).
    pub nodeports: NodePortAddresses,
    /// Full reconcile interval.
    pub sync_period: Duration,
    /// Minimum interval between incremental syncs.
    pub min_sync_period: Duration,
    /// Strict ARP sysctls.
    pub strict_arp: bool,
    /// `--no-ipvs-rate-estimation`: `net.ipv4.vs.run_estimation=0`.
    pub no_rate_estimation: bool,
    /// `--service-address-binding`: how Service addresses are made local.
    pub binding: crate::kernel::Binding,
    /// IPVS timeouts to set.
    pub timeouts: Timeouts,
    /// kube-proxy's conntrack tuning.
    pub conntrack: kube_ipvs_host::setup::Conntrack,
    /// Flags accepted and ignored, to log once logging is up.
    pub warnings: Vec<String>,
    /// `--keep-kube-proxy-rules`.
    pub keep_kube_proxy_rules: bool,
    /// `/healthz` and `/livez`.
    pub healthz: SocketAddr,
    /// `/metrics`.
    pub metrics: SocketAddr,
}

impl Settings {
    /// Merges the flags with the config file (if any) and checks every value.
    pub fn resolve(args: &RunArgs) -> Result<Settings, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => ProxyConfig::default(),
        };
        Self::merge(args, file)
    }

    /// [`Settings::resolve`] with the config file's `text` already read from `path` (which
    /// errors name): the entry of the fuzz target for `KubeProxyConfiguration`.
    pub fn resolve_text(args: &RunArgs, path: &Path, text: &str) -> Result<Settings, ConfigError> {
        Self::merge(args, parse_file(path, text)?)
    }

    fn merge(args: &RunArgs, file: ProxyConfig) -> Result<Settings, ConfigError> {
        // Under kube-proxy's name, its command line means what it means to kube-proxy.
        let viewed;
        let mut dropped = Vec::new();
        let args = if args.as_kube_proxy && args.config.is_some() {
            (viewed, dropped) = kube_proxy_view(args);
            &viewed
        } else {
            args
        };
        let mode = match &args.proxy_mode {
            Some(m) => Some((m.as_str(), "--proxy-mode")),
            None => file.mode.as_deref().map(|m| (m, "mode")),
        };
        if let Some((mode, setting)) = mode.filter(|(m, _)| !m.is_empty())
            && mode != "ipvs"
        {
            return Err(ConfigError::setting(
                setting,
                mode,
                "kube-ipvs only implements the ipvs mode; use \"ipvs\" or leave it empty",
            ));
        }
        let mut warnings = ignored_flags(args);
        warnings.extend(dropped.into_iter().map(|flag| {
            format!(
                "{flag} is ignored beside --config, as kube-proxy ignores it (running as \
                 kube-proxy); set it in the config file"
            )
        }));
        // kube-proxy decodes leniently when strict decoding fails, with a warning; so do we.
        warnings.extend(
            file.unknown_keys()
                .into_iter()
                .map(|k| format!("config key {k} is not a KubeProxyConfiguration key; ignored")),
        );
        let ipvs = file.ipvs.unwrap_or_default();
        let iptables = file.iptables.unwrap_or_default();
        let client = file.client_connection.unwrap_or_default();
        let joined = |v: &Option<Vec<String>>| v.as_ref().map(|l| l.join(","));

        let scheduler = pick(
            args.scheduler.as_deref(),
            "scheduler",
            ipvs.scheduler.as_deref(),
            "ipvs.scheduler",
        )
        .unwrap_or_else(|| {
            (
                crate::cmd::source::DEFAULT_SCHEDULER.to_owned(),
                "--scheduler".to_owned(),
            )
        });
        let exclude = pick(
            args.exclude_cidrs.as_deref(),
            "exclude-cidrs",
            joined(&ipvs.exclude_cidrs).as_deref(),
            "ipvs.excludeCIDRs",
        );
        let cluster = pick(
            args.cluster_cidr.as_deref(),
            "cluster-cidr",
            file.cluster_cidr.as_deref(),
            "clusterCIDR",
        );
        let hostname = pick(
            args.hostname_override.as_deref(),
            "hostname-override",
            file.hostname_override.as_deref(),
            "hostnameOverride",
        );
        let kubeconfig = pick(
            args.kubeconfig.as_deref().and_then(Path::to_str),
            "kubeconfig",
            client.kubeconfig.as_deref(),
            "clientConnection.kubeconfig",
        );
        if args.manifests.is_some()
            && let Some((_, setting)) = &kubeconfig
            && setting.starts_with("--")
        {
            return Err(ConfigError::setting(
                "--kubeconfig",
                "",
                "--manifests and --kubeconfig are two sources; give one",
            ));
        }

        let sync_period = match pick(
            args.sync_period.as_deref(),
            "sync-period",
            ipvs.sync_period.as_deref(),
            "ipvs.syncPeriod",
        ) {
            Some(v) => {
                let d = duration(&v)?;
                // kube-proxy's file uses 0s for "default"; a flag of 0 is a mistake.
                if d.is_zero() && v.1.starts_with("--") {
                    return Err(ConfigError::setting(
                        &v.1,
                        &v.0,
                        "must be greater than zero",
                    ));
                }
                if d.is_zero() { DEFAULT_SYNC_PERIOD } else { d }
            }
            None => DEFAULT_SYNC_PERIOD,
        };
        let min_sync_period = match pick(
            args.min_sync_period.as_deref(),
            "min-sync-period",
            ipvs.min_sync_period.as_deref(),
            "ipvs.minSyncPeriod",
        ) {
            Some(v) => {
                let d = duration(&v)?;
                if d > sync_period {
                    return Err(ConfigError::setting(
                        &v.1,
                        &v.0,
                        format!("longer than the sync period ({sync_period:?})"),
                    ));
                }
                d
            }
            None => DEFAULT_MIN_SYNC_PERIOD.min(sync_period),
        };
        let timeouts = Timeouts {
            tcp: timeout_secs(pick(
                args.tcp_timeout.as_deref(),
                "tcp-timeout",
                ipvs.tcp_timeout.as_deref(),
                "ipvs.tcpTimeout",
            ))?,
            tcp_fin: timeout_secs(pick(
                args.tcpfin_timeout.as_deref(),
                "tcpfin-timeout",
                ipvs.tcp_fin_timeout.as_deref(),
                "ipvs.tcpFinTimeout",
            ))?,
            udp: timeout_secs(pick(
                args.udp_timeout.as_deref(),
                "udp-timeout",
                ipvs.udp_timeout.as_deref(),
                "ipvs.udpTimeout",
            ))?,
        };
        let conntrack = conntrack_settings(args, file.conntrack.unwrap_or_default())?;
        let detect_local = detect_local(
            args,
            file.detect_local_mode.as_deref(),
            file.detect_local.unwrap_or_default(),
        )?;
        let masquerade_bit = match (args.iptables_masquerade_bit, iptables.masquerade_bit) {
            (Some(b), _) => (b, "--iptables-masquerade-bit"),
            (None, Some(b)) => (b, "iptables.masqueradeBit"),
            (None, None) => (14, "default"),
        };
        if masquerade_bit.0 > 31 {
            return Err(ConfigError::setting(
                masquerade_bit.1,
                &masquerade_bit.0.to_string(),
                "a mark bit is 0 to 31",
            ));
        }
        let masquerade_bit = masquerade_bit.0;
        let healthz = bind_address(
            pick(
                args.healthz_bind_address.as_deref(),
                "healthz-bind-address",
                file.healthz_bind_address.as_deref(),
                "healthzBindAddress",
            ),
            DEFAULT_HEALTHZ,
        )?;
        let metrics = bind_address(
            pick(
                args.metrics_bind_address.as_deref(),
                "metrics-bind-address",
                file.metrics_bind_address.as_deref(),
                "metricsBindAddress",
            ),
            DEFAULT_METRICS,
        )?;
        let nodeport_addresses = pick(
            args.nodeport_addresses.as_deref(),
            "nodeport-addresses",
            joined(&file.node_port_addresses).as_deref(),
            "nodePortAddresses",
        );
        let nodeports = match &nodeport_addresses {
            None => NodePortAddresses::default(),
            Some((v, setting)) => NodePortAddresses::parse(v.split(','))
                .map_err(|e| ConfigError::setting(setting, &e.entry, e.reason))?,
        };
        if nodeports.loopback_only() {
            warnings.push(
                "nodePortAddresses names only loopback networks for a family: IPVS cannot \
                 serve NodePorts on loopback, so that family has no NodePort address"
                    .to_owned(),
            );
        }
        let cluster_cidrs = cidrs(cluster.clone())?;
        let node_pod_cidrs = cidrs(
            args.node_pod_cidr
                .clone()
                .map(|v| (v, "--node-pod-cidr".to_owned())),
        )?;
        // Checked here so the error names the setting; the source re-parses the same text.
        cidrs(exclude.clone())?;

        let source = SourceArgs {
            config: None,
            manifests: args.manifests.clone(),
            kubeconfig: if args.manifests.is_some() {
                None
            } else {
                kubeconfig.map(|(v, _)| PathBuf::from(v))
            },
            hostname_override: hostname.as_ref().map(|(v, _)| v.clone()),
            master: args.master.clone(),
            node_zone: args.node_zone.clone(),
            node_ips: args.node_ips.clone(),
            nodeport_addresses: nodeport_addresses.map(|(v, _)| v),
            scheduler: Some(scheduler.0.clone()),
            cluster_cidr: cluster.map(|(v, _)| v),
            exclude_cidrs: exclude.map(|(v, _)| v),
            service_proxy_name: args
                .service_proxy_name
                .clone()
                .or_else(|| file.service_proxy_name.clone().filter(|n| !n.is_empty())),
            graceful_termination_timeout: args.graceful_termination_timeout.clone(),
            local_fwmark_mask: args.local_fwmark_mask.clone(),
        };
        scheduler
            .0
            .parse::<kube_ipvs_diff::Scheduler>()
            .map_err(|e| ConfigError::setting(&scheduler.1, &scheduler.0, e.to_string()))?;
        let node = source.node_context().map_err(|e| match e {
            crate::cmd::source::SourceError::Flag {
                flag,
                value,
                reason,
            } => {
                let setting = match (flag, &hostname) {
                    ("hostname-override", Some((_, s))) => s.clone(),
                    (f, _) => format!("--{f}"),
                };
                ConfigError::setting(&setting, &value, reason)
            }
            other => ConfigError::setting("node", "", other.to_string()),
        })?;
        if let Some(space) = node.options.local_marks
            && space.mask() & (1u32 << masquerade_bit) != 0
        {
            return Err(ConfigError::setting(
                "--local-fwmark-mask",
                &space.to_string(),
                format!("holds the masquerade mark bit {masquerade_bit}"),
            ));
        }
        Ok(Settings {
            source,
            node,
            cluster_cidrs,
            masquerade_all: args.masquerade_all || iptables.masquerade_all.unwrap_or(false),
            node_pod_cidrs,
            detect_local,
            masquerade_bit,
            masquerade: !args.no_masquerade,
            nodeports,
            sync_period,
            min_sync_period,
            strict_arp: args.strict_arp || ipvs.strict_arp.unwrap_or(false),
            no_rate_estimation: args.no_ipvs_rate_estimation,
            binding: args.service_address_binding,
            timeouts,
            conntrack,
            healthz,
            metrics,
            warnings,
            keep_kube_proxy_rules: args.keep_kube_proxy_rules,
        })
    }
}

/// A warning for each kube-proxy flag given that means nothing to kube-ipvs (accepted so a
/// kube-proxy command line starts unchanged).
fn ignored_flags(args: &RunArgs) -> Vec<String> {
    [
        (
            "--v",
            &args.verbosity,
            "set RUST_LOG for kube-ipvs's log level",
        ),
        (
            "--bind-address",
            &args.bind_address,
            "kube-ipvs binds no proxy socket",
        ),
        (
            "--oom-score-adj",
            &args.oom_score_adj,
            "set the container's OOM score in its manifest",
        ),
        (
            "--feature-gates",
            &args.feature_gates,
            "kube-ipvs has no feature gates",
        ),
        (
            "--kube-api-qps",
            &args.kube_api_qps,
            "the client's own rate limits apply",
        ),
        (
            "--kube-api-burst",
            &args.kube_api_burst,
            "the client's own rate limits apply",
        ),
        (
            "--kube-api-content-type",
            &args.kube_api_content_type,
            "the client speaks JSON",
        ),
    ]
    .into_iter()
    .filter_map(|(flag, value, why)| {
        value.as_ref().map(|v| {
            format!("{flag}={v} is accepted for kube-proxy compatibility and ignored: {why}")
        })
    })
    .collect()
}

/// For unit tests: a directory of this test's own holding `config.conf`, a
/// `KubeProxyConfiguration` whose body (after `apiVersion` and `kind`) is `body`. Returns the
/// directory (for the test to remove) and the file.
#[cfg(test)]
pub(crate) fn temp_config(tag: &str, body: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("kube-ipvs-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("config.conf");
    std::fs::write(
        &file,
        format!("apiVersion: {API_VERSION}\nkind: KubeProxyConfiguration\n{body}"),
    )
    .expect("write config");
    (dir, file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> RunArgs {
        RunArgs {
            hostname_override: Some("node-1".into()),
            ..RunArgs::default()
        }
    }

    #[test]
    fn go_durations_parse() {
        let cases = [
            ("30s", 30_000),
            ("1m0s", 60_000),
            ("1h30m", 5_400_000),
            ("500ms", 500),
            ("1.5s", 1_500),
            ("0", 0),
            ("0s", 0),
        ];
        for (text, ms) in cases {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_millis(ms)),
                "{text}"
            );
        }
        for bad in ["", "30", "5x", "-1s", "s", "1..2s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn defaults_are_kube_proxys() {
        let s = Settings::resolve(&args()).expect("defaults are valid");
        assert_eq!(s.sync_period, Duration::from_secs(30));
        // The one deliberate difference (see DEFAULT_MIN_SYNC_PERIOD).
        assert_eq!(s.min_sync_period, Duration::ZERO);
        assert_eq!(s.healthz.to_string(), "0.0.0.0:10256");
        assert_eq!(s.metrics.to_string(), "127.0.0.1:10249");
        assert_eq!(s.node.default_scheduler.to_string(), "rr");
        assert_eq!(s.timeouts, Timeouts::default());
        assert!(!s.strict_arp && !s.masquerade_all && !s.no_rate_estimation);
        let mut a = args();
        a.no_ipvs_rate_estimation = true;
        let s = Settings::resolve(&a).expect("valid");
        assert!(s.no_rate_estimation);
        assert_eq!(s.binding, crate::kernel::Binding::Address);
    }

    #[test]
    fn bad_flag_values_name_the_flag() {
        type Edit = fn(&mut RunArgs);
        let cases: [(Edit, &str); 11] = [
            (
                |a| a.scheduler = Some("fastest".into()),
                "--scheduler \"fastest\"",
            ),
            (
                |a| a.sync_period = Some("soon".into()),
                "--sync-period \"soon\"",
            ),
            (
                |a| a.sync_period = Some("0s".into()),
                "--sync-period \"0s\"",
            ),
            (
                |a| a.exclude_cidrs = Some("10.0.0.0/8,10.1.2.3/99".into()),
                "--exclude-cidrs \"10.1.2.3/99\"",
            ),
            (
                |a| a.metrics_bind_address = Some("localhost:x".into()),
                "--metrics-bind-address \"localhost:x\"",
            ),
            (
                |a| a.tcp_timeout = Some("1.5s".into()),
                "--tcp-timeout \"1.5s\"",
            ),
            (
                |a| a.graceful_termination_timeout = Some("-1m".into()),
                "--graceful-termination-timeout \"-1m\"",
            ),
            (
                |a| a.detect_local_mode = Some("PodCIDR".into()),
                "--detect-local-mode \"PodCIDR\"",
            ),
            (
                |a| a.detect_local_mode = Some("BridgeInterface".into()),
                "--detect-local-mode \"BridgeInterface\"",
            ),
            (
                |a| {
                    a.detect_local_mode = Some("InterfaceNamePrefix".into());
                    a.pod_interface_name_prefix = Some("veth+".into());
                },
                "--pod-interface-name-prefix \"veth+\"",
            ),
            (
                |a| a.iptables_masquerade_bit = Some(32),
                "--iptables-masquerade-bit \"32\"",
            ),
        ];
        for (set, want) in cases {
            let mut a = args();
            set(&mut a);
            let err = Settings::resolve(&a).expect_err(want);
            assert!(!err.is_file_error());
            assert!(err.to_string().starts_with(want), "{err} vs {want}");
        }
    }

    #[test]
    fn kube_proxys_ipvs_flags_and_ignored_flags_are_accepted() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            run: RunArgs,
        }
        // A kops-style kube-proxy command line, unchanged.
        let cli = Cli::try_parse_from([
            "kube-proxy",
            "--hostname-override=node-1",
            "--proxy-mode=ipvs",
            "--ipvs-scheduler=lc",
            "--ipvs-sync-period=30s",
            "--ipvs-min-sync-period=1s",
            "--ipvs-exclude-cidrs=10.200.0.0/16",
            "--ipvs-strict-arp",
            "--ipvs-tcp-timeout=900s",
            "--ipvs-tcpfin-timeout=60s",
            "--ipvs-udp-timeout=300s",
            "--v=2",
            "--bind-address=0.0.0.0",
            "--oom-score-adj=-998",
            "--feature-gates=SomeGate=true",
            "--kube-api-qps=50",
            "--kube-api-burst=100",
            "--kube-api-content-type=application/vnd.kubernetes.protobuf",
            "--conntrack-max-per-core=0",
        ])
        .expect("kube-proxy's flags parse");
        let s = Settings::resolve(&cli.run).expect("and resolve");
        assert_eq!(s.sync_period, Duration::from_secs(30));
        assert!(s.strict_arp);
        // Not kube-proxy's: the kernel's rate estimator is left alone.
        assert!(!s.no_rate_estimation);
        assert_eq!(s.timeouts.tcp, Some(900));
        assert_eq!(s.source.scheduler.as_deref(), Some("lc"));
        assert_eq!(s.warnings.len(), 7, "{:?}", s.warnings);
        assert!(
            s.warnings[2].starts_with("--oom-score-adj=-998 is accepted"),
            "{:?}",
            s.warnings
        );
        // Ours, not kube-proxy's: how Service addresses are made local, named when wrong.
        let routes =
            Cli::try_parse_from(["kube-ipvs", "--service-address-binding=route"]).expect("route");
        let s = Settings::resolve(&routes.run).expect("resolves");
        assert_eq!(s.binding, crate::kernel::Binding::Route);
        let err = Cli::try_parse_from(["kube-ipvs", "--service-address-binding=either"])
            .err()
            .expect("the tools' own value is no flag value");
        assert!(
            err.to_string()
                .contains("--service-address-binding <address|route>"),
            "{err}"
        );
        // -v 4 as kubeadm's manifests write it.
        let short =
            Cli::try_parse_from(["kube-proxy", "-v", "4", "--hostname-override", "n"]).expect("-v");
        assert_eq!(short.run.verbosity.as_deref(), Some("4"));
        // Another mode is refused with the flag named.
        let mut a = args();
        a.proxy_mode = Some("nftables".into());
        let err = Settings::resolve(&a).expect_err("nftables");
        assert!(
            err.to_string().starts_with("--proxy-mode \"nftables\""),
            "{err}"
        );
    }

    /// Under kube-proxy's name, a command line with `--config` means what it means to
    /// kube-proxy: the file's values, whatever the other flags say (a kubeadm-style file beside
    /// flags that contradict it, even a mode kube-ipvs refuses), each dropped flag named; the
    /// node name and kube-ipvs's own flags still apply. As `kube-ipvs run`, flags win.
    #[test]
    fn as_kube_proxy_the_config_file_overrides_its_flags() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            run: RunArgs,
        }
        let (dir, file) = temp_config(
            "kp-view",
            "mode: ipvs\nclusterCIDR: 10.244.0.0/16\nipvs: {scheduler: lc, syncPeriod: 45s}\n",
        );
        let line = [
            "kube-proxy",
            "--config",
            file.to_str().expect("utf-8"),
            "--hostname-override=node-9",
            "--proxy-mode=iptables",
            "--ipvs-scheduler=sed",
            "--ipvs-sync-period=5s",
            "--cluster-cidr=10.0.0.0/8",
            "--masquerade-all",
            "--metrics-bind-address=0.0.0.0:10249",
            "--graceful-termination-timeout=1m",
        ];
        let mut cli = Cli::try_parse_from(line).expect("parses");
        cli.run.as_kube_proxy = true;
        let s = Settings::resolve(&cli.run).expect("the file's mode is ipvs");
        assert_eq!(s.source.scheduler.as_deref(), Some("lc"));
        assert_eq!(s.sync_period, Duration::from_secs(45));
        assert_eq!(s.source.cluster_cidr.as_deref(), Some("10.244.0.0/16"));
        assert!(!s.masquerade_all);
        assert_eq!(s.metrics.to_string(), "127.0.0.1:10249");
        // Kept: the node name, and our own flag the file has no key for.
        assert_eq!(s.node.node_name, "node-9");
        assert_eq!(
            s.node.options.graceful_termination_timeout,
            Duration::from_secs(60)
        );
        let dropped: Vec<&String> = s
            .warnings
            .iter()
            .filter(|w| w.contains("is ignored beside --config"))
            .collect();
        assert_eq!(dropped.len(), 6, "{:?}", s.warnings);
        assert!(dropped[0].starts_with("--ipvs-scheduler "), "{dropped:?}");

        // The same command line as `kube-ipvs run`: the flags win, so the mode is refused.
        cli.run.as_kube_proxy = false;
        let err = Settings::resolve(&cli.run).expect_err("--proxy-mode=iptables");
        assert!(
            err.to_string().starts_with("--proxy-mode \"iptables\""),
            "{err}"
        );
        // Without --config, kube-proxy's flags are its settings under either name.
        let mut cli = Cli::try_parse_from([
            "kube-proxy",
            "--hostname-override=n",
            "--ipvs-scheduler=sed",
        ])
        .expect("parses");
        cli.run.as_kube_proxy = true;
        let s = Settings::resolve(&cli.run).expect("valid");
        assert_eq!(s.source.scheduler.as_deref(), Some("sed"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Every flag of `run` is either dropped beside `--config` under kube-proxy's name (one the
    /// file covers) or deliberately kept; a new flag must be placed in one of the two.
    #[test]
    fn every_flag_is_placed_for_kube_proxys_reading() {
        use clap::{Args as _, FromArgMatches as _};
        const KEPT: &[&str] = &[
            "config",
            "manifests",
            "master",
            "hostname_override",
            "node_zone",
            "node_ips",
            "node_pod_cidr",
            "no_masquerade",
            "keep_kube_proxy_rules",
            "init_only",
            "no_ipvs_rate_estimation",
            "service_address_binding",
            "graceful_termination_timeout",
            "local_fwmark_mask",
            "service_proxy_name",
            "verbosity",
        ];
        let cmd = RunArgs::augment_args(clap::Command::default());
        let mut line = vec!["run".to_owned()];
        let mut ids = Vec::new();
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str().to_owned();
            let long = arg.get_long().expect("every flag has a long name");
            line.push(format!("--{long}"));
            if arg.get_action().takes_values() {
                let value = match id.as_str() {
                    "node_ips" => "10.0.0.1",
                    "service_address_binding" => "route",
                    _ => "1",
                };
                line.push(value.to_owned());
            }
            ids.push(id);
        }
        let every = RunArgs::from_arg_matches(&cmd.try_get_matches_from(&line).expect("parses"))
            .expect("every flag given");
        let (_, dropped) = kube_proxy_view(&every);
        assert_eq!(
            ids.len(),
            KEPT.len() + dropped.len(),
            "a flag is neither kept nor dropped by kube_proxy_view: {ids:?}"
        );
        for kept in KEPT {
            assert!(ids.iter().any(|id| id == kept), "{kept} is not a flag");
        }
    }

    #[test]
    fn detect_local_modes_and_the_mark_bit_resolve() {
        use super::super::masq::DetectLocal;
        let s = Settings::resolve(&args()).expect("defaults");
        assert_eq!(s.detect_local, DetectLocal::ClusterCidr);
        assert_eq!(s.masquerade_bit, 14);
        let mut a = args();
        a.detect_local_mode = Some("BridgeInterface".into());
        a.pod_bridge_interface = Some("cbr0".into());
        a.iptables_masquerade_bit = Some(0);
        let s = Settings::resolve(&a).expect("bridge");
        assert_eq!(s.detect_local, DetectLocal::BridgeInterface("cbr0".into()));
        assert_eq!(s.masquerade_bit, 0);
        a.detect_local_mode = Some("NodeCIDR".into());
        assert_eq!(
            Settings::resolve(&a).expect("node").detect_local,
            DetectLocal::NodeCidr
        );
    }

    #[test]
    fn min_sync_period_cannot_exceed_sync_period() {
        let mut a = args();
        a.sync_period = Some("2s".into());
        a.min_sync_period = Some("5s".into());
        let err = Settings::resolve(&a).expect_err("min > sync");
        assert!(err.to_string().contains("--min-sync-period"), "{err}");
    }

    #[test]
    fn bind_address_takes_an_ip_alone() {
        let mut a = args();
        a.healthz_bind_address = Some("127.0.0.2".into());
        a.metrics_bind_address = Some("[::1]:9000".into());
        let s = Settings::resolve(&a).expect("valid");
        assert_eq!(s.healthz.to_string(), "127.0.0.2:10256");
        assert_eq!(s.metrics.to_string(), "[::1]:9000");
    }
}
