//! The masquerade helper: the few `nat` table rules that SNAT Service traffic which would
//! otherwise not find its way back (clients outside the Pod network, NodePorts under
//! `externalTrafficPolicy: Cluster`, hairpin), applied atomically with
//! `iptables-restore --noflush` into chains kube-ipvs owns.
//!
//! The module owns two chains per family, [`POSTROUTING_CHAIN`] and [`MASQ_CHAIN`], and one jump
//! rule from the built-in `POSTROUTING` chain (recognised by its comment, [`JUMP_COMMENT`]). It
//! must never touch any other chain or rule: `--noflush` keeps the rest of the table, and
//! [`Masquerade::cleanup`] deletes only the jump and our chains.
//!
//! # Why the rule count does not grow with the number of Services
//!
//! The rules run in `POSTROUTING`, after IPVS has forwarded the packet, and use the kernel's
//! `ipvs` match (`-m ipvs --vdir ORIGINAL --vmethod MASQ`), which is true exactly for the
//! original-direction packets of connections IPVS forwards in masquerade mode. So one rule covers
//! every Service; which of them to masquerade is then decided by the client's address
//! (`--cluster-cidr`), the virtual address (`--vaddr` of each node IP, for NodePorts), and the
//! hairpin rule. The chain marks such packets with the masquerade bit and the last rules of
//! [`POSTROUTING_CHAIN`] clear the bit and `MASQUERADE` them, the way kube-proxy does; packets
//! others marked with the same bit (kube-proxy's `KUBE-MARK-MASQ` convention) are masqueraded
//! too. A packet that already carries the bit (the service sets mark in `PREROUTING`) skips
//! [`MASQ_CHAIN`], whose rules only set it or return.
//!
//! What does grow with configuration: one rule per cluster CIDR, one per node IP, one per
//! `(node IP, Local-policy NodePort)` pair and one per Local-policy external or load-balancer IP
//! (such Services must keep the client's address, and the `ipvs` match cannot see a Service's
//! policy) and, with [`Hairpin::Endpoints`], one per local
//! endpoint. "Source equals destination" is not an iptables match, so exact hairpin needs the
//! local endpoints somewhere: [`Hairpin::Set`] is one rule per family matching the ipsets
//! [`ipset::SET_V4`] / [`ipset::SET_V6`] (`src,dst` against `hash:net,net`
//! members `(a, a)`, kube-proxy's `KUBE-LOOP-BACK` idea), whose members the caller keeps over
//! netlink; [`Hairpin::Endpoints`] is the fallback without ipset support and costs one rule per
//! local endpoint. [`Hairpin::LocalPodCidrs`] is constant-size without any set and masquerades all
//! Service traffic between two Pods of this node (a superset of hairpin: such connections lose
//! the client Pod's address).
//!
//! The sets must exist before `iptables-restore` references them, and outlive the rules:
//! [`cleanup_hairpin_sets`] destroys them only after the rules are gone.
//!
//! The `ipvs` match needs IPVS to keep conntrack entries (`net.ipv4.vs.conntrack = 1`, per
//! network namespace); [`Masquerade::ensure`] sets it.
//!
//! Nothing from the API server reaches a command line or a shell: the tools are spawned with
//! fixed arguments and the rules are written to their standard input, built only from parsed
//! addresses, CIDRs, ports and our own constants.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kube_ipvs_diff::{Cidr, Protocol};
use kube_ipvs_netlink::nfnl::ipset;

/// Our chain jumped to from `POSTROUTING`: sends IPVS masquerade traffic to [`MASQ_CHAIN`], then
/// masquerades what is marked.
pub const POSTROUTING_CHAIN: &str = "KUBE-IPVS-POSTROUTING";
/// Our chain that decides which IPVS traffic to mark for masquerade.
pub const MASQ_CHAIN: &str = "KUBE-IPVS-MASQ";
/// The comment on the jump rule from `POSTROUTING`, by which it is found again.
pub const JUMP_COMMENT: &str = "kube-ipvs service traffic requiring SNAT";
/// Our chain jumped to from `PREROUTING` and `OUTPUT` (with the service sets): marks Service
/// traffic for masquerade while its destination is still the virtual address.
pub const SERVICES_CHAIN: &str = "KUBE-IPVS-SERVICES";
/// Our chain deciding whether ClusterIP traffic comes from a local Pod (`detectLocalMode`).
pub const CLUSTER_MASQ_CHAIN: &str = "KUBE-IPVS-CLUSTER-MASQ";
/// The comment on the jumps from `PREROUTING` and `OUTPUT`.
pub const SERVICES_COMMENT: &str = "kube-ipvs service masquerade marks";
/// The jumps from built-in `nat` chains: (built-in chain, our chain, comment). The last two
/// only with the service sets.
pub const NAT_JUMPS: [(&str, &str, &str); 3] = [
    ("POSTROUTING", POSTROUTING_CHAIN, JUMP_COMMENT),
    ("PREROUTING", SERVICES_CHAIN, SERVICES_COMMENT),
    ("OUTPUT", SERVICES_CHAIN, SERVICES_COMMENT),
];
/// Our `mangle` chain jumped to from `INPUT` (with the service sets and the short circuit):
/// gives new connections from local Pods to a Local-policy Service's external address its
/// fwmark ([`crate::sets::ServiceSet::LocalMarks`]).
pub const LOCAL_PODS_CHAIN: &str = "KUBE-IPVS-LOCAL-PODS";
/// Our `mangle` chain jumped to from `OUTPUT`: the same for connections the node itself opens.
pub const LOCAL_HOST_CHAIN: &str = "KUBE-IPVS-LOCAL-HOST";
/// The comment on the `mangle` jumps.
pub const LOCAL_COMMENT: &str = "kube-ipvs local clients of Local-policy services";
/// The jumps from built-in `mangle` chains.
pub const MANGLE_JUMPS: [(&str, &str, &str); 2] = [
    ("INPUT", LOCAL_PODS_CHAIN, LOCAL_COMMENT),
    ("OUTPUT", LOCAL_HOST_CHAIN, LOCAL_COMMENT),
];
/// The sysctl that makes IPVS keep conntrack entries, which the `ipvs` match and `MASQUERADE` need.
const IPVS_CONNTRACK_SYSCTL: &str = "/proc/sys/net/ipv4/vs/conntrack";

/// Errors of the masquerade helper; each names the tool, family or setting involved.
#[derive(Debug, thiserror::Error)]
pub enum MasqueradeError {
    /// The configuration cannot be turned into rules.
    #[error("masquerade config: {0}")]
    Config(String),
    /// A tool could not be started (missing binary, permissions).
    #[error("masquerade: cannot run {tool}: {source}")]
    Spawn {
        tool: String,
        #[source]
        source: std::io::Error,
    },
    /// A tool ran and failed.
    #[error("masquerade: {tool} {args} failed ({status}): {stderr}")]
    Failed {
        tool: String,
        args: String,
        status: String,
        stderr: String,
    },
    /// `iptables --version` printed something that names no backend we know.
    #[error("masquerade: cannot tell the iptables backend from {tool} --version output {output:?}")]
    UnknownBackend { tool: String, output: String },
    /// An ipset request failed (it names the set).
    #[error("{0}")]
    Ipset(#[from] kube_ipvs_netlink::Error),
    /// The IPVS conntrack sysctl could not be set.
    #[error("masquerade: cannot set {path} to 1 (is ip_vs loaded?): {source}")]
    Sysctl {
        path: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// The module's result type.
pub type Result<T, E = MasqueradeError> = std::result::Result<T, E>;

pub use kube_ipvs_netlink::Family;

/// The prefix of a family's tools: `iptables` or `ip6tables`.
fn tool_prefix(family: Family) -> &'static str {
    match family {
        Family::V4 => "iptables",
        Family::V6 => "ip6tables",
    }
}

/// Which iptables backend to program. Rules written through one backend are invisible to the
/// other, so this must be the one the node's other components use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Ask `iptables --version`, which prints `(nf_tables)` or `(legacy)`.
    Auto,
    /// `iptables-legacy*` (x_tables).
    Legacy,
    /// `iptables-nft*` (nf_tables).
    Nft,
}

impl Backend {
    fn suffix(self) -> &'static str {
        match self {
            Self::Legacy => "-legacy",
            Self::Nft => "-nft",
            // Resolved before any tool is named; the plain tool follows the system's choice.
            Self::Auto => "",
        }
    }

    /// The backend named in `iptables --version` output: `(nf_tables)` or `(legacy)`; versions
    /// before 1.8 print neither and only have the legacy backend.
    pub fn from_version_output(output: &str) -> Option<Self> {
        if output.contains("(nf_tables)") {
            Some(Self::Nft)
        } else if output.contains("(legacy)") {
            Some(Self::Legacy)
        } else if output.starts_with("iptables v1.") || output.starts_with("ip6tables v1.") {
            let minor = output
                .split_once("v1.")
                .and_then(|(_, rest)| rest.split('.').next())
                .and_then(|m| m.parse::<u32>().ok());
            minor.filter(|m| *m < 8).map(|_| Self::Legacy)
        } else {
            None
        }
    }
}

/// How hairpin traffic (a Pod reaching itself through a Service) is recognised; see the module
/// docs for the trade-off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hairpin {
    /// Masquerade Service traffic whose source and destination are both in one of these
    /// networks (this node's Pod CIDRs). Constant size; also masquerades other same-node
    /// Pod-to-Pod Service traffic.
    LocalPodCidrs(Vec<Cidr>),
    /// Masquerade Service traffic whose source and destination are the same one of these
    /// addresses (this node's endpoints). Exact; one rule per address, so the caller re-runs
    /// [`Masquerade::ensure`] when local endpoints change.
    Endpoints(Vec<IpAddr>),
    /// Masquerade Service traffic whose (source, destination) is a member of the family's
    /// hairpin set ([`ipset::set_name`]). Exact and one rule per family; the caller
    /// creates the sets first and keeps their members (this node's endpoints) itself.
    Set,
}

/// A NodePort whose Service has `externalTrafficPolicy: Local`: its traffic keeps the client's
/// address (no NodePort masquerade).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalNodePort {
    pub protocol: Protocol,
    pub port: u16,
}

/// A load-balancer ingress or external IP of a Service with `externalTrafficPolicy: Local`:
/// its traffic keeps the client's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalVirtualServer {
    pub addr: IpAddr,
    pub protocol: Protocol,
    pub port: u16,
}

/// How traffic from this node's Pods is told apart (kube-proxy's `detectLocalMode`): ClusterIP
/// traffic from a local Pod keeps its address, the rest is masqueraded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LocalDetect {
    /// Sources in [`Config::cluster_cidrs`] (`ClusterCIDR`, the default).
    #[default]
    ClusterCidr,
    /// Sources in this node's Pod CIDRs (`NodeCIDR`: the Node's `spec.podCIDRs`).
    NodeCidr(Vec<Cidr>),
    /// Packets entering through this bridge (`BridgeInterface`).
    Bridge(String),
    /// Packets entering through an interface whose name starts with this
    /// (`InterfaceNamePrefix`).
    InterfacePrefix(String),
}

/// Whether `name` is a Linux interface name iptables takes as it is: 1 to 15 bytes of letters,
/// digits, `-`, `_` and `.` (no `+`, which iptables reads as a wildcard, and no spaces or
/// quotes).
#[must_use]
pub fn valid_interface_name(name: &str) -> bool {
    (1..=15).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// What to masquerade, and with which tools.
#[derive(Debug, Clone)]
pub struct Config {
    /// The families to program (both on a dual-stack node).
    pub families: Vec<Family>,
    /// The Pod network(s) (`--cluster-cidr`): Service traffic from outside them is masqueraded.
    /// Ignored with `masquerade_all`. Empty and not `masquerade_all` means no
    /// masquerade for outside clients (kube-proxy's behaviour without `--cluster-cidr`).
    pub cluster_cidrs: Vec<Cidr>,
    /// Masquerade all Service traffic (`--masquerade-all`).
    pub masquerade_all: bool,
    /// The node's addresses NodePorts listen on: NodePort traffic to them is masqueraded.
    pub node_ips: Vec<IpAddr>,
    /// NodePorts under `externalTrafficPolicy: Local`, exempt from the NodePort masquerade.
    pub local_node_ports: Vec<LocalNodePort>,
    /// External IPs and load-balancer IPs under `externalTrafficPolicy: Local`, exempt from the
    /// outside-the-cluster-CIDR masquerade (one rule each).
    pub local_virtual_servers: Vec<LocalVirtualServer>,
    /// How hairpin traffic is recognised.
    pub hairpin: Hairpin,
    /// The packet mark bit used for masquerade (kube-proxy's `--iptables-masquerade-bit`,
    /// default 14, i.e. `0x4000`).
    pub mark_bit: u8,
    /// The service sets ([`crate::sets`]) exist: Service traffic is marked for masquerade
    /// before IPVS by matching them (and the `filter` table, [`crate::filter`], is
    /// programmed). Without them the older `POSTROUTING` rules decide, which know only the
    /// cluster CIDR and cost one rule per Local-policy NodePort and address.
    pub service_sets: bool,
    /// How local Pods are recognised (with the service sets; without them only the CIDR modes
    /// apply).
    pub local_detect: LocalDetect,
    /// Masquerade with `--random-fully` (iptables 1.6.2 and later; [`probe`] tells).
    pub random_fully: bool,
    /// The mark mask of the Local-policy short circuit (`kube_ipvs_diff::marks`), with the
    /// service sets: the `mangle` rules give local clients' new connections to a Local-policy
    /// Service's external addresses the mark the set maps them to, and those the node itself
    /// opens are masqueraded. `None`: no short circuit.
    pub local_marks: Option<u32>,
    /// The iptables backend.
    pub backend: Backend,
    /// Where the iptables tools are; `None` looks them up on `PATH`.
    pub bin_dir: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            families: vec![Family::V4],
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            node_ips: Vec::new(),
            local_node_ports: Vec::new(),
            local_virtual_servers: Vec::new(),
            hairpin: Hairpin::Endpoints(Vec::new()),
            mark_bit: 14,
            service_sets: false,
            local_detect: LocalDetect::ClusterCidr,
            random_fully: true,
            local_marks: None,
            backend: Backend::Auto,
            bin_dir: None,
        }
    }
}

/// What [`Masquerade::cleanup`] removed from one family's `nat` and `filter` tables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    pub family: Option<Family>,
    /// The tool that removed them (e.g. `iptables-nft-restore`).
    pub tool: String,
    /// Jump rules deleted from the built-in chains.
    pub jumps: usize,
    /// Our chains deleted (`nat` ones first).
    pub chains: Vec<String>,
}

/// The masquerade rules for one node, ready to apply.
#[derive(Debug, Clone)]
pub struct Masquerade {
    config: Config,
    backend: Backend,
}

/// Whether a refused `mangle` section was already warned about (once per process).
static MANGLE_WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Masquerade {
    /// Checks the configuration and resolves [`Backend::Auto`] by running `iptables --version`.
    pub fn new(config: Config) -> Result<Self> {
        validate(&config)?;
        let backend = match config.backend {
            Backend::Auto => detect_backend(config.bin_dir.as_deref())?,
            b => b,
        };
        Ok(Self { config, backend })
    }

    /// The backend in use (never [`Backend::Auto`]).
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Makes the kernel hold exactly our rules: sets `net.ipv4.vs.conntrack`, then per family
    /// replaces our chains' contents and adds the jumps from built-in chains that are missing, in
    /// one `iptables-restore --noflush` run (one transaction per table). Running it again with the
    /// same config changes nothing.
    pub fn ensure(&self) -> Result<()> {
        enable_ipvs_conntrack()?;
        for &family in &self.config.families {
            let save = |table| run_tool(&self.tool(family, "-save"), &["-t", table], None);
            let nat = save("nat")?;
            let missing = NAT_JUMPS.map(|(builtin, chain, _)| !has_jump(&nat, builtin, chain));
            let mut rules = restore_input(&self.config, family, missing)?;
            if self.config.service_sets {
                let filter = save("filter")?;
                let missing = crate::filter::JUMPS
                    .map(|(builtin, chain, _)| !has_jump(&filter, builtin, chain));
                rules.push_str(&crate::filter::restore_section(
                    family,
                    1u32 << self.config.mark_bit,
                    missing,
                ));
            }
            let restore = |text: &str| {
                run_tool(
                    &self.tool(family, "-restore"),
                    &["-w", "--noflush"],
                    Some(text),
                )
            };
            if !self.config.service_sets {
                restore(&rules)?;
                continue;
            }
            // The short circuit's mangle section rides in the same run; a kernel without the
            // mangle table or the SET target's --map-mark refuses it, and then the rest is
            // applied alone: it loses the short circuit only, not the filter and masquerade.
            let mangle = save("mangle").map(|saved| {
                let missing =
                    MANGLE_JUMPS.map(|(builtin, chain, _)| !has_jump(&saved, builtin, chain));
                mangle_section(&self.config, family, missing)
            });
            let refused = match mangle {
                Ok(section) => match restore(&format!("{rules}{section}")) {
                    Ok(_) => None,
                    Err(e) => {
                        restore(&rules)?;
                        Some(e)
                    }
                },
                Err(e) => {
                    restore(&rules)?;
                    Some(e)
                }
            };
            if let Some(e) = refused
                && !MANGLE_WARNED.swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::warn!(
                    "the Local-policy short circuit's mangle rules were refused ({e}); are \
                     the iptable_mangle and xt_set modules available? Local clients of \
                     Local-policy external addresses get local endpoints only"
                );
            }
        }
        Ok(())
    }

    /// Removes the jump rule(s) and our chains from the configured backend and families, and
    /// says what it removed. Nothing of ours present is not an error.
    pub fn cleanup(&self) -> Result<Vec<Removed>> {
        self.config
            .families
            .iter()
            .map(|&f| cleanup_family(self.config.bin_dir.as_deref(), self.backend, f))
            .collect()
    }

    fn tool(&self, family: Family, what: &str) -> PathBuf {
        tool_path(self.config.bin_dir.as_deref(), self.backend, family, what)
    }
}

/// A jump from a built-in chain: (built-in chain, our chain, comment).
type Jump = (&'static str, &'static str, &'static str);

/// What of our set-based layout (`nat`, `filter` and `mangle`) the backend in use does not
/// show for `family`: each missing jump from a built-in chain and each missing chain of ours,
/// as text (`nat: no jump from PREROUTING to KUBE-IPVS-SERVICES`), for `kube-ipvs check`.
/// The rules inside our chains depend on `run`'s flags and are not compared.
pub fn missing_rules(bin_dir: Option<&Path>, family: Family) -> Result<Vec<String>> {
    let backend = detect_backend(bin_dir)?;
    let mut missing = Vec::new();
    let layout: [(&Table, &[Jump]); 3] = [
        (&NAT, &NAT_JUMPS),
        (&FILTER, &crate::filter::JUMPS),
        (&MANGLE, &MANGLE_JUMPS),
    ];
    for (table, jumps) in layout {
        let save = save_table(bin_dir, backend, family, table)?.unwrap_or_default();
        missing.extend(missing_in(&save, table, jumps));
    }
    Ok(missing)
}

/// [`missing_rules`] of one table's `iptables-save` output.
fn missing_in(save: &str, table: &Table, jumps: &[Jump]) -> Vec<String> {
    let mut missing: Vec<String> = jumps
        .iter()
        .filter(|(builtin, chain, _)| !has_jump(save, builtin, chain))
        .map(|(builtin, chain, _)| format!("{}: no jump from {builtin} to {chain}", table.name))
        .collect();
    let present = chains_in(save, table);
    missing.extend(
        table
            .chains
            .iter()
            .filter(|c| !present.iter().any(|p| p == *c))
            .map(|c| format!("{}: no chain {c}", table.name)),
    );
    missing
}

/// `kube-ipvs cleanup`'s part: removes our rules from both backends and both families, skipping
/// tools that are not installed, and says what it removed.
pub fn cleanup_everywhere(bin_dir: Option<&Path>) -> Result<Vec<Removed>> {
    tables_everywhere(bin_dir, &[&NAT, &FILTER, &MANGLE])
}

/// [`cleanup_tables`] in both backends and both families, skipping tools that are not
/// installed.
pub(crate) fn tables_everywhere(bin_dir: Option<&Path>, tables: &[&Table]) -> Result<Vec<Removed>> {
    let mut removed = Vec::new();
    for backend in [Backend::Legacy, Backend::Nft] {
        for family in [Family::V4, Family::V6] {
            let save = tool_path(bin_dir, backend, family, "-save");
            if bin_dir.is_some() && !save.exists() {
                continue;
            }
            match cleanup_tables(bin_dir, backend, family, tables) {
                Ok(r) => removed.push(r),
                Err(MasqueradeError::Spawn { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}

/// Every ipset kube-ipvs creates: the hairpin sets and the filter sets.
pub fn all_sets() -> impl Iterator<Item = &'static str> {
    [ipset::SET_V4, ipset::SET_V6]
        .into_iter()
        .chain(crate::sets::sets().map(|(name, _, _)| name))
}

/// Destroys our ipsets ([`all_sets`]) that exist; run after the rules referencing them are gone
/// (the kernel refuses to destroy a referenced set). Returns the names destroyed. A kernel
/// without ipset support has no sets, which is not an error.
pub fn cleanup_sets() -> std::result::Result<Vec<&'static str>, kube_ipvs_netlink::Error> {
    destroy_sets(all_sets())
}

/// Destroys each of `names` that exists; says which it destroyed.
pub(crate) fn destroy_sets(
    names: impl IntoIterator<Item = &'static str>,
) -> std::result::Result<Vec<&'static str>, kube_ipvs_netlink::Error> {
    // EINVAL: nfnetlink has no ipset subsystem (ip_set not loaded and not loadable), as
    // `nfnetlink_rcv_msg` in net/netfilter/nfnetlink.c answers; our requests are well formed.
    let no_ipset = |e: &kube_ipvs_netlink::Error| e.errno() == Some(22);
    let mut sets = match ipset::Ipset::new() {
        Ok(s) => s,
        Err(e) if no_ipset(&e) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    // With iptables-nft the kernel lets go of a set a moment after the rule that used it is
    // deleted, so a destroy right after the rules can find it busy: retried for up to 2 s.
    // Every set is tried before an error is returned.
    let busy = |e: &kube_ipvs_netlink::Error| e.errno() == Some(ipset::IPSET_ERR_BUSY);
    let mut removed = Vec::new();
    let mut first_error = None;
    for name in names {
        let mut tries = 0;
        let outcome = loop {
            match sets.destroy(name) {
                Err(e) if busy(&e) && tries < 20 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                other => break other,
            }
        };
        match outcome {
            Ok(true) => removed.push(name),
            Ok(false) => {}
            Err(e) if no_ipset(&e) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(removed),
    }
}

/// Our ipsets that exist (for `cleanup --dry-run`); none without ipset support.
pub fn sets_present() -> Vec<&'static str> {
    let Ok(mut sets) = ipset::Ipset::new() else {
        return Vec::new();
    };
    all_sets()
        .filter(|name| matches!(sets.list(name), Ok(Some(_))))
        .collect()
}

/// Our chains as each installed `*-save` tool (found on `PATH`) shows them, for `kube-ipvs cleanup --dry-run`:
/// (tool, chains) for each tool that shows any.
pub fn saved_chains() -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for family in [Family::V4, Family::V6] {
        for backend in [Backend::Legacy, Backend::Nft] {
            let mut found = Vec::new();
            for table in [&NAT, &FILTER, &MANGLE] {
                // A tool that is missing or fails shows nothing.
                if let Ok(Some(text)) = save_table(None, backend, family, table) {
                    found.extend(chains_in(&text, table));
                }
            }
            if !found.is_empty() {
                let tool = tool_path(None, backend, family, "-save");
                out.push((tool.display().to_string(), found));
            }
        }
    }
    out
}

/// What of ours lives in one table: our chains, and the chains the built-in ones jump to.
#[derive(Debug)]
pub(crate) struct Table {
    pub(crate) name: &'static str,
    pub(crate) chains: &'static [&'static str],
    pub(crate) jump_targets: &'static [&'static str],
}

const NAT: Table = Table {
    name: "nat",
    chains: &[
        POSTROUTING_CHAIN,
        MASQ_CHAIN,
        SERVICES_CHAIN,
        CLUSTER_MASQ_CHAIN,
    ],
    jump_targets: &[POSTROUTING_CHAIN, SERVICES_CHAIN],
};

const FILTER: Table = Table {
    name: "filter",
    chains: &crate::filter::CHAINS,
    jump_targets: &[crate::filter::INPUT_CHAIN, crate::filter::FORWARD_CHAIN],
};

const MANGLE: Table = Table {
    name: "mangle",
    chains: &[LOCAL_PODS_CHAIN, LOCAL_HOST_CHAIN],
    jump_targets: &[LOCAL_PODS_CHAIN, LOCAL_HOST_CHAIN],
};

/// Our chains of `table` that `iptables-save` output declares.
fn chains_in(save: &str, table: &Table) -> Vec<String> {
    table
        .chains
        .iter()
        .filter(|c| save.lines().any(|l| l.starts_with(&format!(":{c} "))))
        .map(|c| (*c).to_owned())
        .collect()
}

/// Where the kernel lists the legacy (x_tables) tables of the reader's network namespace.
const LEGACY_TABLE_LISTS: [(Family, &str); 2] = [
    (Family::V4, "/proc/net/ip_tables_names"),
    (Family::V6, "/proc/net/ip6_tables_names"),
];

/// For the legacy backend, the x_tables tables that exist in this network namespace (`None`
/// for the nf_tables backend, or when the list cannot be read for another reason than its
/// absence). Asking `iptables-legacy-save -t nat` for a table that does not exist makes the
/// kernel create it, and an x_tables table hooks into the path of every packet of the
/// namespace for as long as the namespace lives: a scan for leftovers must not leave that
/// behind. Reading the kernel's list creates nothing; without the `ip_tables` module there is
/// no list and no table.
fn legacy_tables(backend: Backend, family: Family) -> Option<Vec<String>> {
    if backend != Backend::Legacy {
        return None;
    }
    let (_, path) = LEGACY_TABLE_LISTS.into_iter().find(|(f, _)| *f == family)?;
    table_list(std::fs::read_to_string(path))
}

/// The table names of a read of `/proc/net/ip_tables_names`: a missing file is no table, and
/// another error leaves it unknown (`None`).
fn table_list(read: std::io::Result<String>) -> Option<Vec<String>> {
    match read {
        Ok(text) => Some(text.split_whitespace().map(str::to_owned).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(Vec::new()),
        Err(_) => None,
    }
}

/// Whether `table` may hold rules, given [`legacy_tables`]: always when the list is unknown.
fn may_hold(legacy: Option<&[String]>, table: &str) -> bool {
    legacy.is_none_or(|names| names.iter().any(|n| n == table))
}

/// One backend's and family's `-save -t TABLE` output, for the scans (`check`, `cleanup`, the
/// removal of kube-proxy's leftovers); `None` for a legacy table the kernel does not list,
/// which holds nothing and which reading would create.
fn save_table(
    bin_dir: Option<&Path>,
    backend: Backend,
    family: Family,
    table: &Table,
) -> Result<Option<String>> {
    if !may_hold(legacy_tables(backend, family).as_deref(), table.name) {
        return Ok(None);
    }
    let tool = tool_path(bin_dir, backend, family, "-save");
    run_tool(&tool, &["-t", table.name], None).map(Some)
}

fn cleanup_family(bin_dir: Option<&Path>, backend: Backend, family: Family) -> Result<Removed> {
    cleanup_tables(bin_dir, backend, family, &[&NAT, &FILTER, &MANGLE])
}

/// Removes the jumps to and the chains of `tables` (their chains are whoever's: ours, or
/// kube-proxy's for [`crate::kube_proxy`]) from one backend and family, in one
/// `iptables-restore --noflush` run.
pub(crate) fn cleanup_tables(
    bin_dir: Option<&Path>,
    backend: Backend,
    family: Family,
    tables: &[&Table],
) -> Result<Removed> {
    let restore = tool_path(bin_dir, backend, family, "-restore");
    let mut input = String::new();
    let mut removed = Removed {
        family: Some(family),
        tool: restore.display().to_string(),
        ..Removed::default()
    };
    for table in tables {
        let Some(save) = save_table(bin_dir, backend, family, table)? else {
            continue;
        };
        let (text, r) = cleanup_input(&save, table);
        if r.jumps > 0 || !r.chains.is_empty() {
            input.push_str(&text);
            removed.jumps += r.jumps;
            removed.chains.extend(r.chains);
        }
    }
    if !input.is_empty() {
        run_tool(&restore, &["-w", "--noflush"], Some(&input))?;
    }
    Ok(removed)
}

/// The `iptables-restore` input that deletes what `iptables-save -t TABLE` output shows of ours
/// in `table`: each jump rule (by its saved spec, `-A` turned into `-D`), then our chains
/// (flushed, then deleted: a chain is deleted only once nothing jumps to it).
pub(crate) fn cleanup_input(save: &str, table: &Table) -> (String, Removed) {
    let jumps = jump_lines(save, table);
    let chains = chains_in(save, table);
    let mut input = format!("*{}\n", table.name);
    for j in &jumps {
        if let Some(spec) = j.strip_prefix("-A ") {
            let _ = writeln!(input, "-D {spec}");
        }
    }
    for c in &chains {
        let _ = writeln!(input, "-F {c}");
    }
    for c in &chains {
        let _ = writeln!(input, "-X {c}");
    }
    input.push_str("COMMIT\n");
    let removed = Removed {
        jumps: jumps.len(),
        chains,
        ..Removed::default()
    };
    (input, removed)
}

/// The rules in `iptables-save` output that jump to one of our chains from a chain not ours.
fn jump_lines<'a>(save: &'a str, table: &Table) -> Vec<&'a str> {
    save.lines()
        .filter(|l| {
            l.starts_with("-A ")
                && !table
                    .chains
                    .iter()
                    .any(|c| l.starts_with(&format!("-A {c} ")))
                && table
                    .jump_targets
                    .iter()
                    .any(|t| l.ends_with(&format!("-j {t}")))
        })
        .collect()
}

/// The start of one table's `iptables-restore --noflush` input: the table, our chains declared
/// (which empties them and only them) and each jump `(built-in chain, our chain, comment)` whose
/// `add` entry is true, inserted first in its built-in chain.
pub(crate) fn section_head(
    table: &str,
    chains: &[&str],
    jumps: &[(&str, &str, &str)],
    add: &[bool],
) -> String {
    let mut r = format!("*{table}\n");
    for c in chains {
        let _ = writeln!(r, ":{c} - [0:0]");
    }
    for ((builtin, chain, comment), add) in jumps.iter().zip(add) {
        if *add {
            let _ = writeln!(
                r,
                "-I {builtin} -m comment --comment \"{comment}\" -j {chain}"
            );
        }
    }
    r
}

/// Whether `iptables-save` output has a rule in `builtin` jumping to `chain`.
fn has_jump(save: &str, builtin: &str, chain: &str) -> bool {
    save.lines()
        .any(|l| l.starts_with(&format!("-A {builtin} ")) && l.ends_with(&format!("-j {chain}")))
}

fn validate(config: &Config) -> Result<()> {
    let bad = |s: String| Err(MasqueradeError::Config(s));
    if config.mark_bit > 31 {
        return bad(format!(
            "mark bit {} is out of range 0..=31",
            config.mark_bit
        ));
    }
    if config.families.is_empty() {
        return bad("no IP family to program".into());
    }
    if let Some(mask) = config.local_marks
        && mask & (1u32 << config.mark_bit) != 0
    {
        return bad(format!(
            "the local fwmark mask {mask:#x} holds the masquerade mark bit {}",
            config.mark_bit
        ));
    }
    if let LocalDetect::Bridge(name) | LocalDetect::InterfacePrefix(name) = &config.local_detect
        && !valid_interface_name(name)
    {
        return bad(format!(
            "interface name {name:?} is not 1 to 15 letters, digits, '-', '_' or '.'"
        ));
    }
    for ip in config.node_ips.iter().chain(match &config.hairpin {
        Hairpin::Endpoints(eps) => eps.as_slice(),
        Hairpin::LocalPodCidrs(_) | Hairpin::Set => &[],
    }) {
        if ip.is_unspecified() || ip.is_multicast() {
            return bad(format!("address {ip} is not a unicast address"));
        }
    }
    for p in &config.local_node_ports {
        if p.port == 0 {
            return bad(format!(
                "Local-policy NodePort {:?}/0 has no port",
                p.protocol
            ));
        }
    }
    for v in &config.local_virtual_servers {
        if v.port == 0 || v.addr.is_unspecified() || v.addr.is_multicast() {
            return bad(format!(
                "Local-policy virtual server {:?} {} is not a unicast address with a port",
                v.protocol,
                std::net::SocketAddr::new(v.addr, v.port)
            ));
        }
    }
    Ok(())
}

fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

fn cidr_text(c: &Cidr) -> String {
    format!("{}/{}", c.addr(), c.prefix())
}

fn host_text(ip: IpAddr) -> String {
    format!("{ip}/{}", Family::of(ip).host_prefix())
}

/// The `iptables-restore --noflush` input for one family's `nat` table: our chains declared
/// (which empties them and only them), their rules, and each jump of [`NAT_JUMPS`] whose
/// `add_jump` entry is true (the `PREROUTING` and `OUTPUT` ones only with the service sets).
pub fn restore_input(config: &Config, family: Family, add_jump: [bool; 3]) -> Result<String> {
    validate(config)?;
    let mark = 1u32 << config.mark_bit;
    let ipvs = "-m ipvs --vdir ORIGINAL --vmethod MASQ";
    // The jumps from PREROUTING and OUTPUT lead to the set-based marks: only with the sets.
    let add_jump = [
        add_jump[0],
        add_jump[1] && config.service_sets,
        add_jump[2] && config.service_sets,
    ];
    let mut r = section_head("nat", NAT.chains, &NAT_JUMPS, &add_jump);
    // Every rule of MASQ_CHAIN only sets the bit or returns, so a packet that already carries
    // it (marked in PREROUTING by the service sets, or by another component) skips the chain:
    // the mark test (a native nf_tables expression under iptables-nft 1.8.8 and later, a
    // trivial xtables match before) spares it the ipvs match and the chain's set lookups.
    let _ = writeln!(
        r,
        "-A {POSTROUTING_CHAIN} -m mark ! --mark {mark:#x}/{mark:#x} {ipvs} -j {MASQ_CHAIN}"
    );
    let _ = writeln!(
        r,
        "-A {POSTROUTING_CHAIN} -m mark ! --mark {mark:#x}/{mark:#x} -j RETURN"
    );
    // The bit is cleared so that a packet that is encapsulated and comes through POSTROUTING
    // again is not masqueraded twice.
    let _ = writeln!(r, "-A {POSTROUTING_CHAIN} -j MARK --xor-mark {mark:#x}");
    let random = if config.random_fully {
        " --random-fully"
    } else {
        ""
    };
    let _ = writeln!(
        r,
        "-A {POSTROUTING_CHAIN} -m comment --comment \"kube-ipvs masquerade\" -j MASQUERADE{random}"
    );
    if config.service_sets {
        hairpin_rules(&mut r, config, family, mark);
        if let Some(mask) = config.local_marks {
            // The node's own connections that the short circuit sent to a fwmark virtual server
            // (a mark of the space and no other bit) leave with the node's address as source,
            // which only this node can take replies for: masqueraded, as kube-proxy's
            // iptables mode does for "LOCAL traffic for external destinations".
            let _ = writeln!(
                r,
                "-A {MASQ_CHAIN} -m mark ! --mark 0x0/{mask:#x} -m mark --mark 0x0/{:#x} -m addrtype --src-type LOCAL -m comment --comment \"node to Local-policy service\" -j MARK --or-mark {mark:#x}",
                !mask
            );
        }
        service_marks(&mut r, config, family, mark);
        r.push_str("COMMIT\n");
        return Ok(r);
    }
    let in_family = |ip: &IpAddr| Family::of(*ip) == family;
    let mark_it = format!("-j MARK --or-mark {mark:#x}");
    if config.masquerade_all {
        let _ = writeln!(
            r,
            "-A {MASQ_CHAIN} -m comment --comment \"masquerade-all\" {mark_it}"
        );
        r.push_str("COMMIT\n");
        return Ok(r);
    }
    // Hairpin first: it is masqueraded whatever the source network or policy.
    hairpin_rules(&mut r, config, family, mark);
    for v in config
        .local_virtual_servers
        .iter()
        .filter(|v| in_family(&v.addr))
    {
        let _ = writeln!(
            r,
            "-A {MASQ_CHAIN} -m ipvs --vaddr {} --vport {} --vproto {} -m comment --comment \"local external\" -j RETURN",
            host_text(v.addr),
            v.port,
            protocol_name(v.protocol)
        );
    }
    // NodePorts: Local-policy ones keep the client's address, the rest are masqueraded so that
    // replies come back through this node.
    for node in config.node_ips.iter().filter(|ip| in_family(ip)) {
        let h = host_text(*node);
        for p in &config.local_node_ports {
            let _ = writeln!(
                r,
                "-A {MASQ_CHAIN} -m ipvs --vaddr {h} --vport {} --vproto {} -m comment --comment \"local nodeport\" -j RETURN",
                p.port,
                protocol_name(p.protocol)
            );
        }
        let _ = writeln!(
            r,
            "-A {MASQ_CHAIN} -m ipvs --vaddr {h} -m comment --comment \"nodeport\" {mark_it}"
        );
    }
    let cidrs: Vec<&Cidr> = config
        .cluster_cidrs
        .iter()
        .filter(|c| in_family(&c.addr()))
        .collect();
    if !cidrs.is_empty() {
        for c in cidrs {
            let _ = writeln!(r, "-A {MASQ_CHAIN} -s {} -j RETURN", cidr_text(c));
        }
        let _ = writeln!(
            r,
            "-A {MASQ_CHAIN} -m comment --comment \"outside cluster-cidr\" {mark_it}"
        );
    }
    r.push_str("COMMIT\n");
    Ok(r)
}

/// The hairpin rules of [`MASQ_CHAIN`] (after IPVS: source and destination are the same
/// endpoint), masqueraded whatever the source network or policy.
fn hairpin_rules(r: &mut String, config: &Config, family: Family, mark: u32) {
    let in_family = |ip: &IpAddr| Family::of(*ip) == family;
    let mark_it = format!("-j MARK --or-mark {mark:#x}");
    match &config.hairpin {
        Hairpin::LocalPodCidrs(cidrs) => {
            for c in cidrs.iter().filter(|c| in_family(&c.addr())) {
                let c = cidr_text(c);
                let _ = writeln!(
                    r,
                    "-A {MASQ_CHAIN} -s {c} -d {c} -m comment --comment \"hairpin\" {mark_it}"
                );
            }
        }
        Hairpin::Endpoints(eps) => {
            for ep in eps.iter().filter(|ip| in_family(ip)) {
                let h = host_text(*ep);
                let _ = writeln!(
                    r,
                    "-A {MASQ_CHAIN} -s {h} -d {h} -m comment --comment \"hairpin\" {mark_it}"
                );
            }
        }
        Hairpin::Set => {
            let set = ipset::set_name(family);
            let _ = writeln!(
                r,
                "-A {MASQ_CHAIN} -m set --match-set {set} src,dst -m comment --comment \"hairpin\" {mark_it}"
            );
        }
    }
}

/// The CIDRs that are local Pods' in `family` under the CIDR modes; `None` for the interface
/// modes.
fn local_cidrs(config: &Config, family: Family) -> Option<Vec<&Cidr>> {
    let cidrs = match &config.local_detect {
        LocalDetect::ClusterCidr => &config.cluster_cidrs,
        LocalDetect::NodeCidr(c) => c,
        LocalDetect::Bridge(_) | LocalDetect::InterfacePrefix(_) => return None,
    };
    Some(
        cidrs
            .iter()
            .filter(|c| Family::of(c.addr()) == family)
            .collect(),
    )
}

/// [`SERVICES_CHAIN`] and [`CLUSTER_MASQ_CHAIN`]: Service traffic marked for masquerade before
/// IPVS, while the destination is the virtual server, by set membership. External-IP,
/// load-balancer and NodePort traffic of Cluster-policy Services is always masqueraded (the
/// endpoint may be on another node, whose reply must come back here); that of Local-policy
/// Services never is (it keeps the client's address). ClusterIP traffic is masqueraded unless
/// it comes from a local Pod, or always with `--masquerade-all`; without any way to tell local
/// Pods (no cluster CIDR of this family) it is not, as kube-proxy does.
fn service_marks(r: &mut String, config: &Config, family: Family, mark: u32) {
    let mark_it = format!("-j MARK --or-mark {mark:#x}");
    let set = |s: crate::sets::ServiceSet| s.name(family);
    let _ = writeln!(
        r,
        "-A {SERVICES_CHAIN} -m set --match-set {} dst,dst -m comment --comment \"external, Cluster policy\" {mark_it}",
        set(crate::sets::ServiceSet::External)
    );
    let _ = writeln!(
        r,
        "-A {SERVICES_CHAIN} -m set --match-set {} dst,dst -j {CLUSTER_MASQ_CHAIN}",
        set(crate::sets::ServiceSet::ClusterIps)
    );
    if config.masquerade_all {
        let _ = writeln!(
            r,
            "-A {CLUSTER_MASQ_CHAIN} -m comment --comment \"masquerade-all\" {mark_it}"
        );
        return;
    }
    match (&config.local_detect, local_cidrs(config, family)) {
        (_, Some(cidrs)) if cidrs.is_empty() => {}
        (_, Some(cidrs)) => {
            for c in cidrs {
                let _ = writeln!(r, "-A {CLUSTER_MASQ_CHAIN} -s {} -j RETURN", cidr_text(c));
            }
            let _ = writeln!(
                r,
                "-A {CLUSTER_MASQ_CHAIN} -m comment --comment \"not a local pod\" {mark_it}"
            );
        }
        (LocalDetect::Bridge(name), None) | (LocalDetect::InterfacePrefix(name), None) => {
            let wildcard = if matches!(config.local_detect, LocalDetect::InterfacePrefix(_)) {
                "+"
            } else {
                ""
            };
            let _ = writeln!(r, "-A {CLUSTER_MASQ_CHAIN} -i {name}{wildcard} -j RETURN");
            let _ = writeln!(
                r,
                "-A {CLUSTER_MASQ_CHAIN} -m comment --comment \"not a local pod\" {mark_it}"
            );
        }
        (_, None) => {}
    }
}

/// The `*mangle` section of the short circuit for one family ([`LOCAL_PODS_CHAIN`],
/// [`LOCAL_HOST_CHAIN`] and the [`MANGLE_JUMPS`] whose `add_jump` entry is true). The chains
/// are declared, and so emptied, even without the short circuit.
///
/// `mangle INPUT` (priority -150) and `OUTPUT` run before IPVS (`LOCAL_IN` at 98, `LOCAL_OUT`
/// at -98), and IPVS looks a packet's mark up among the fwmark virtual servers before its
/// address (`ip_vs_service_find`). The mark replaces the packet's whole mark, since IPVS
/// compares all 32 bits; only the first packet of a connection is looked up, so only new
/// connections are marked. Local Pods are told by `detectLocalMode`, as for ClusterIP traffic;
/// without a way to tell them, only the node's own connections are short-circuited.
pub fn mangle_section(config: &Config, family: Family, add_jump: [bool; 2]) -> String {
    let mut r = section_head("mangle", MANGLE.chains, &MANGLE_JUMPS, &add_jump);
    if config.local_marks.is_some() {
        let map = format!(
            "-m conntrack --ctstate NEW -j SET --map-set {} dst,dst --map-mark",
            crate::sets::ServiceSet::LocalMarks.name(family)
        );
        match (&config.local_detect, local_cidrs(config, family)) {
            (_, Some(cidrs)) => {
                for c in cidrs {
                    let _ = writeln!(r, "-A {LOCAL_PODS_CHAIN} -s {} {map}", cidr_text(c));
                }
            }
            (LocalDetect::Bridge(name), None) => {
                let _ = writeln!(r, "-A {LOCAL_PODS_CHAIN} -i {name} {map}");
            }
            (LocalDetect::InterfacePrefix(name), None) => {
                let _ = writeln!(r, "-A {LOCAL_PODS_CHAIN} -i {name}+ {map}");
            }
            (_, None) => {}
        }
        let _ = writeln!(r, "-A {LOCAL_HOST_CHAIN} {map}");
    }
    r.push_str("COMMIT\n");
    r
}

fn tool_path(bin_dir: Option<&Path>, backend: Backend, family: Family, what: &str) -> PathBuf {
    let name = format!("{}{}{what}", tool_prefix(family), backend.suffix());
    match bin_dir {
        Some(d) => d.join(name),
        None => PathBuf::from(name),
    }
}

/// Whether `iptables --version` output names a version with `MASQUERADE --random-fully`
/// (1.6.2 and later, as kube-proxy checks).
#[must_use]
pub fn random_fully_in(version_output: &str) -> bool {
    let Some((_, rest)) = version_output.split_once(" v") else {
        return false;
    };
    let numbers: Vec<u32> = rest
        .split(|c: char| !c.is_ascii_digit() && c != '.')
        .next()
        .unwrap_or("")
        .split('.')
        .map_while(|n| n.parse().ok())
        .collect();
    match numbers.as_slice() {
        [major, minor, patch, ..] => (*major, *minor, *patch) >= (1, 6, 2),
        [major, minor] => (*major, *minor) >= (1, 7),
        _ => false,
    }
}

/// Runs `<bin_dir>/iptables --version` once: the backend and whether `--random-fully` is
/// supported.
pub fn probe(bin_dir: Option<&Path>) -> Result<(Backend, bool)> {
    let tool = tool_path(bin_dir, Backend::Auto, Family::V4, "");
    let out = run_tool(&tool, &["--version"], None)?;
    let backend = Backend::from_version_output(out.trim()).ok_or_else(|| {
        MasqueradeError::UnknownBackend {
            tool: tool.display().to_string(),
            output: out.trim().to_owned(),
        }
    })?;
    Ok((backend, random_fully_in(out.trim())))
}

/// Runs `<bin_dir>/iptables --version` and reads the backend from it.
pub fn detect_backend(bin_dir: Option<&Path>) -> Result<Backend> {
    let tool = tool_path(bin_dir, Backend::Auto, Family::V4, "");
    let out = run_tool(&tool, &["--version"], None)?;
    Backend::from_version_output(out.trim()).ok_or_else(|| MasqueradeError::UnknownBackend {
        tool: tool.display().to_string(),
        output: out.trim().to_owned(),
    })
}

/// Sets `net.ipv4.vs.conntrack = 1` in this network namespace (it also covers IPv6).
pub fn enable_ipvs_conntrack() -> Result<()> {
    match std::fs::read_to_string(IPVS_CONNTRACK_SYSCTL) {
        Ok(v) if v.trim() == "1" => Ok(()),
        _ => {
            std::fs::write(IPVS_CONNTRACK_SYSCTL, "1\n").map_err(|source| MasqueradeError::Sysctl {
                path: IPVS_CONNTRACK_SYSCTL,
                source,
            })
        }
    }
}

/// Runs a tool with fixed arguments, `stdin` written to its standard input; returns its stdout.
fn run_tool(tool: &Path, args: &[&str], stdin: Option<&str>) -> Result<String> {
    let name = tool.display().to_string();
    let spawn_err = |source| MasqueradeError::Spawn {
        tool: name.clone(),
        source,
    };
    let mut child = Command::new(tool)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // Dropping the pipe at the end of this block closes it, which ends the tool's input.
        pipe.write_all(text.as_bytes()).map_err(spawn_err)?;
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        return Err(MasqueradeError::Failed {
            tool: name,
            args: args.join(" "),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> Cidr {
        s.parse().expect("test CIDR")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    fn rules(config: &Config, family: Family) -> Vec<String> {
        restore_input(config, family, [false; 3])
            .expect("valid config")
            .lines()
            .filter(|l| l.starts_with("-A "))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn cluster_cidr_rules_return_for_pods_and_mark_the_rest() {
        let config = Config {
            cluster_cidrs: vec![cidr("10.244.0.0/16"), cidr("fd00:244::/56")],
            ..Config::default()
        };
        let r = rules(&config, Family::V4);
        assert_eq!(
            r,
            [
                "-A KUBE-IPVS-POSTROUTING -m mark ! --mark 0x4000/0x4000 -m ipvs --vdir ORIGINAL --vmethod MASQ -j KUBE-IPVS-MASQ",
                "-A KUBE-IPVS-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
                "-A KUBE-IPVS-POSTROUTING -j MARK --xor-mark 0x4000",
                "-A KUBE-IPVS-POSTROUTING -m comment --comment \"kube-ipvs masquerade\" -j MASQUERADE --random-fully",
                "-A KUBE-IPVS-MASQ -s 10.244.0.0/16 -j RETURN",
                "-A KUBE-IPVS-MASQ -m comment --comment \"outside cluster-cidr\" -j MARK --or-mark 0x4000",
            ]
        );
        // The IPv6 rules carry only the IPv6 network.
        let r6 = rules(&config, Family::V6);
        assert!(r6.contains(&"-A KUBE-IPVS-MASQ -s fd00:244::/56 -j RETURN".to_owned()));
        assert!(!r6.iter().any(|l| l.contains("10.244")));
    }

    #[test]
    fn masquerade_all_is_one_unconditional_mark() {
        let config = Config {
            masquerade_all: true,
            cluster_cidrs: vec![cidr("10.244.0.0/16")],
            node_ips: vec![ip("192.0.2.10")],
            mark_bit: 0,
            ..Config::default()
        };
        let r = rules(&config, Family::V4);
        let masq: Vec<_> = r
            .iter()
            .filter(|l| l.starts_with("-A KUBE-IPVS-MASQ "))
            .collect();
        assert_eq!(
            masq,
            ["-A KUBE-IPVS-MASQ -m comment --comment \"masquerade-all\" -j MARK --or-mark 0x1"]
        );
    }

    #[test]
    fn rule_count_depends_on_config_not_services() {
        let config = Config {
            cluster_cidrs: vec![cidr("10.244.0.0/16")],
            node_ips: vec![ip("192.0.2.10"), ip("2001:db8::10")],
            local_node_ports: vec![LocalNodePort {
                protocol: Protocol::Tcp,
                port: 30080,
            }],
            local_virtual_servers: vec![LocalVirtualServer {
                addr: ip("203.0.113.7"),
                protocol: Protocol::Udp,
                port: 53,
            }],
            hairpin: Hairpin::LocalPodCidrs(vec![cidr("10.244.1.0/24")]),
            ..Config::default()
        };
        let r = rules(&config, Family::V4);
        let masq: Vec<_> = r
            .iter()
            .filter(|l| l.starts_with("-A KUBE-IPVS-MASQ "))
            .collect();
        assert_eq!(
            masq,
            [
                "-A KUBE-IPVS-MASQ -s 10.244.1.0/24 -d 10.244.1.0/24 -m comment --comment \"hairpin\" -j MARK --or-mark 0x4000",
                "-A KUBE-IPVS-MASQ -m ipvs --vaddr 203.0.113.7/32 --vport 53 --vproto udp -m comment --comment \"local external\" -j RETURN",
                "-A KUBE-IPVS-MASQ -m ipvs --vaddr 192.0.2.10/32 --vport 30080 --vproto tcp -m comment --comment \"local nodeport\" -j RETURN",
                "-A KUBE-IPVS-MASQ -m ipvs --vaddr 192.0.2.10/32 -m comment --comment \"nodeport\" -j MARK --or-mark 0x4000",
                "-A KUBE-IPVS-MASQ -s 10.244.0.0/16 -j RETURN",
                "-A KUBE-IPVS-MASQ -m comment --comment \"outside cluster-cidr\" -j MARK --or-mark 0x4000",
            ]
        );
    }

    #[test]
    fn hairpin_endpoints_are_host_routes() {
        let config = Config {
            families: vec![Family::V6],
            hairpin: Hairpin::Endpoints(vec![ip("10.244.1.5"), ip("fd00::5")]),
            ..Config::default()
        };
        let r = rules(&config, Family::V6);
        assert!(r.contains(
            &"-A KUBE-IPVS-MASQ -s fd00::5/128 -d fd00::5/128 -m comment --comment \"hairpin\" -j MARK --or-mark 0x4000".to_owned()
        ));
        assert!(!r.iter().any(|l| l.contains("10.244.1.5")));
    }

    #[test]
    fn hairpin_set_is_one_rule_per_family_in_the_hairpin_position() {
        let config = Config {
            families: vec![Family::V4, Family::V6],
            cluster_cidrs: vec![cidr("10.244.0.0/16")],
            hairpin: Hairpin::Set,
            ..Config::default()
        };
        let masq = |family| -> Vec<String> {
            rules(&config, family)
                .into_iter()
                .filter(|l| l.starts_with("-A KUBE-IPVS-MASQ "))
                .collect()
        };
        assert_eq!(
            masq(Family::V4),
            [
                "-A KUBE-IPVS-MASQ -m set --match-set KUBE-IPVS-HAIRPIN src,dst -m comment --comment \"hairpin\" -j MARK --or-mark 0x4000",
                "-A KUBE-IPVS-MASQ -s 10.244.0.0/16 -j RETURN",
                "-A KUBE-IPVS-MASQ -m comment --comment \"outside cluster-cidr\" -j MARK --or-mark 0x4000",
            ]
        );
        assert_eq!(
            masq(Family::V6),
            [
                "-A KUBE-IPVS-MASQ -m set --match-set KUBE-IPVS-HAIRPIN6 src,dst -m comment --comment \"hairpin\" -j MARK --or-mark 0x4000"
            ]
        );
    }

    fn with_sets(local_detect: LocalDetect) -> Config {
        Config {
            service_sets: true,
            cluster_cidrs: vec![cidr("10.244.0.0/16"), cidr("fd00:244::/56")],
            local_detect,
            hairpin: Hairpin::Set,
            ..Config::default()
        }
    }

    fn chain(config: &Config, family: Family, chain: &str) -> Vec<String> {
        let prefix = format!("-A {chain} ");
        rules(config, family)
            .into_iter()
            .filter(|l| l.starts_with(&prefix))
            .collect()
    }

    #[test]
    fn missing_jumps_and_chains_are_named_with_their_table() {
        let config = with_sets(LocalDetect::ClusterCidr);
        let nat = restore_input(&config, Family::V4, [true; 3]).expect("valid");
        // What iptables-save prints after that restore: the jumps appended, not inserted.
        let saved = nat.replace("-I ", "-A ");
        assert!(missing_in(&saved, &NAT, &NAT_JUMPS).is_empty(), "{saved}");
        let without_output: String = saved
            .lines()
            .filter(|l| !l.starts_with("-A OUTPUT "))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            missing_in(&without_output, &NAT, &NAT_JUMPS),
            ["nat: no jump from OUTPUT to KUBE-IPVS-SERVICES"]
        );
        assert_eq!(
            missing_in("*mangle\nCOMMIT\n", &MANGLE, &MANGLE_JUMPS),
            [
                "mangle: no jump from INPUT to KUBE-IPVS-LOCAL-PODS",
                "mangle: no jump from OUTPUT to KUBE-IPVS-LOCAL-HOST",
                "mangle: no chain KUBE-IPVS-LOCAL-PODS",
                "mangle: no chain KUBE-IPVS-LOCAL-HOST",
            ]
        );
    }

    #[test]
    fn local_clients_of_local_policy_services_are_marked_in_mangle_and_the_node_masqueraded() {
        let mut config = with_sets(LocalDetect::ClusterCidr);
        config.local_marks = Some(0x3ff0_0000);
        let mangle = mangle_section(&config, Family::V4, [true, false]);
        assert_eq!(
            mangle.lines().collect::<Vec<_>>(),
            [
                "*mangle",
                ":KUBE-IPVS-LOCAL-PODS - [0:0]",
                ":KUBE-IPVS-LOCAL-HOST - [0:0]",
                "-I INPUT -m comment --comment \"kube-ipvs local clients of Local-policy services\" -j KUBE-IPVS-LOCAL-PODS",
                "-A KUBE-IPVS-LOCAL-PODS -s 10.244.0.0/16 -m conntrack --ctstate NEW -j SET --map-set KUBE-IPVS-LOCAL-MARKS dst,dst --map-mark",
                "-A KUBE-IPVS-LOCAL-HOST -m conntrack --ctstate NEW -j SET --map-set KUBE-IPVS-LOCAL-MARKS dst,dst --map-mark",
                "COMMIT",
            ]
        );
        assert_eq!(
            chain(&config, Family::V4, MASQ_CHAIN)[1],
            "-A KUBE-IPVS-MASQ -m mark ! --mark 0x0/0x3ff00000 -m mark --mark 0x0/0xc00fffff -m addrtype --src-type LOCAL -m comment --comment \"node to Local-policy service\" -j MARK --or-mark 0x4000"
        );
        // The interface modes tell Pods by their interface; the IPv6 rules use the IPv6 set.
        config.local_detect = LocalDetect::InterfacePrefix("veth".into());
        let v6 = mangle_section(&config, Family::V6, [false; 2]);
        assert!(v6.contains("-A KUBE-IPVS-LOCAL-PODS -i veth+ -m conntrack --ctstate NEW -j SET --map-set KUBE-IPVS-LOCAL-MARKS6 dst,dst --map-mark"), "{v6}");
        // Off: the chains are declared (emptied) and hold nothing.
        config.local_marks = None;
        let off = mangle_section(&config, Family::V4, [false; 2]);
        assert!(!off.contains("-A "), "{off}");
        assert_eq!(chain(&config, Family::V4, MASQ_CHAIN).len(), 1);
        // A mask holding the masquerade bit is refused.
        config.local_marks = Some(0xff00);
        assert!(restore_input(&config, Family::V4, [false; 3]).is_err());
    }

    #[test]
    fn with_the_sets_service_traffic_is_marked_by_membership_before_ipvs() {
        let config = with_sets(LocalDetect::ClusterCidr);
        assert_eq!(
            chain(&config, Family::V4, SERVICES_CHAIN),
            [
                "-A KUBE-IPVS-SERVICES -m set --match-set KUBE-IPVS-EXTERNAL dst,dst -m comment --comment \"external, Cluster policy\" -j MARK --or-mark 0x4000",
                "-A KUBE-IPVS-SERVICES -m set --match-set KUBE-IPVS-CLUSTER-IPS dst,dst -j KUBE-IPVS-CLUSTER-MASQ",
            ]
        );
        assert_eq!(
            chain(&config, Family::V4, CLUSTER_MASQ_CHAIN),
            [
                "-A KUBE-IPVS-CLUSTER-MASQ -s 10.244.0.0/16 -j RETURN",
                "-A KUBE-IPVS-CLUSTER-MASQ -m comment --comment \"not a local pod\" -j MARK --or-mark 0x4000",
            ]
        );
        // Only hairpin is left after IPVS; no rule names a Service, a NodePort or a node.
        assert_eq!(
            chain(&config, Family::V4, MASQ_CHAIN),
            [
                "-A KUBE-IPVS-MASQ -m set --match-set KUBE-IPVS-HAIRPIN src,dst -m comment --comment \"hairpin\" -j MARK --or-mark 0x4000"
            ]
        );
        assert!(chain(&config, Family::V6, SERVICES_CHAIN)[0].contains("KUBE-IPVS-EXTERNAL6"));
        // The jumps from PREROUTING and OUTPUT, only with the sets.
        let all = restore_input(&config, Family::V4, [true; 3]).expect("valid");
        assert!(all.contains("-I PREROUTING -m comment --comment \"kube-ipvs service masquerade marks\" -j KUBE-IPVS-SERVICES"));
        assert!(all.contains("-I OUTPUT -m comment --comment \"kube-ipvs service masquerade marks\" -j KUBE-IPVS-SERVICES"));
        let old = restore_input(&Config::default(), Family::V4, [true; 3]).expect("valid");
        assert!(!old.contains("-I PREROUTING"));
    }

    #[test]
    fn each_detect_local_mode_decides_which_cluster_ip_traffic_is_local() {
        let node = with_sets(LocalDetect::NodeCidr(vec![cidr("10.244.7.0/24")]));
        assert_eq!(
            chain(&node, Family::V4, CLUSTER_MASQ_CHAIN)[0],
            "-A KUBE-IPVS-CLUSTER-MASQ -s 10.244.7.0/24 -j RETURN"
        );
        // No Pod CIDR of this family: nothing tells local Pods, so nothing is masqueraded.
        assert!(chain(&node, Family::V6, CLUSTER_MASQ_CHAIN).is_empty());
        let bridge = with_sets(LocalDetect::Bridge("cbr0".into()));
        assert_eq!(
            chain(&bridge, Family::V6, CLUSTER_MASQ_CHAIN),
            [
                "-A KUBE-IPVS-CLUSTER-MASQ -i cbr0 -j RETURN",
                "-A KUBE-IPVS-CLUSTER-MASQ -m comment --comment \"not a local pod\" -j MARK --or-mark 0x4000",
            ]
        );
        let prefix = with_sets(LocalDetect::InterfacePrefix("veth".into()));
        assert_eq!(
            chain(&prefix, Family::V4, CLUSTER_MASQ_CHAIN)[0],
            "-A KUBE-IPVS-CLUSTER-MASQ -i veth+ -j RETURN"
        );
        // --masquerade-all marks every ClusterIP connection and still leaves Local-policy
        // external traffic (in no set) alone.
        let all = Config {
            masquerade_all: true,
            ..with_sets(LocalDetect::ClusterCidr)
        };
        assert_eq!(
            chain(&all, Family::V4, CLUSTER_MASQ_CHAIN),
            [
                "-A KUBE-IPVS-CLUSTER-MASQ -m comment --comment \"masquerade-all\" -j MARK --or-mark 0x4000"
            ]
        );
        assert_eq!(chain(&all, Family::V4, SERVICES_CHAIN).len(), 2);
        // Interface names reach iptables only if they are plain names.
        for bad in ["", "veth+", "a b", "x\"y", "sixteen-chars-xx"] {
            let c = with_sets(LocalDetect::Bridge(bad.into()));
            assert!(
                restore_input(&c, Family::V4, [false; 3]).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn random_fully_only_when_supported() {
        let without = Config {
            random_fully: false,
            ..Config::default()
        };
        assert!(
            rules(&without, Family::V4)
                .iter()
                .any(|l| l.ends_with("-j MASQUERADE"))
        );
        assert!(
            rules(&Config::default(), Family::V4)
                .iter()
                .any(|l| l.ends_with("-j MASQUERADE --random-fully"))
        );
    }

    #[test]
    fn jump_is_inserted_only_when_asked() {
        let config = Config::default();
        let with = restore_input(&config, Family::V4, [true; 3]).expect("valid");
        let without = restore_input(&config, Family::V4, [false; 3]).expect("valid");
        let jump = "-I POSTROUTING -m comment --comment \"kube-ipvs service traffic requiring SNAT\" -j KUBE-IPVS-POSTROUTING";
        assert!(with.lines().any(|l| l == jump));
        assert!(!without.contains("-I POSTROUTING"));
        assert!(
            with.starts_with("*nat\n:KUBE-IPVS-POSTROUTING - [0:0]\n:KUBE-IPVS-MASQ - [0:0]\n")
        );
        assert!(with.ends_with("COMMIT\n"));
    }

    #[test]
    fn bad_config_is_refused_with_the_setting() {
        let e = restore_input(
            &Config {
                mark_bit: 32,
                ..Config::default()
            },
            Family::V4,
            [false; 3],
        )
        .expect_err("bit 32");
        assert!(e.to_string().contains("mark bit 32"), "{e}");
        let e = restore_input(
            &Config {
                node_ips: vec![ip("0.0.0.0")],
                ..Config::default()
            },
            Family::V4,
            [false; 3],
        )
        .expect_err("unspecified");
        assert!(e.to_string().contains("0.0.0.0"), "{e}");
    }

    #[test]
    fn random_fully_from_the_version() {
        assert!(random_fully_in("iptables v1.8.9 (nf_tables)"));
        assert!(random_fully_in("iptables v1.6.2"));
        assert!(!random_fully_in("iptables v1.6.1"));
        assert!(!random_fully_in("iptables v1.4.21"));
        assert!(random_fully_in("ip6tables v1.8.7 (legacy)"));
        assert!(!random_fully_in("command not found"));
    }

    #[test]
    fn backend_from_version_output() {
        assert_eq!(
            Backend::from_version_output("iptables v1.8.9 (nf_tables)"),
            Some(Backend::Nft)
        );
        assert_eq!(
            Backend::from_version_output("iptables v1.8.7 (legacy)"),
            Some(Backend::Legacy)
        );
        assert_eq!(
            Backend::from_version_output("iptables v1.6.1"),
            Some(Backend::Legacy)
        );
        assert_eq!(Backend::from_version_output("iptables v1.8.0"), None);
        assert_eq!(Backend::from_version_output("command not found"), None);
    }

    #[test]
    fn cleanup_deletes_only_our_jumps_and_chains() {
        let save = "\
# Generated by iptables-save v1.8.9 (nf_tables)
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-IPVS-MASQ - [0:0]
:KUBE-IPVS-POSTROUTING - [0:0]
:KUBE-POSTROUTING - [0:0]
-A POSTROUTING -m comment --comment \"kube-ipvs service traffic requiring SNAT\" -j KUBE-IPVS-POSTROUTING
-A POSTROUTING -j KUBE-POSTROUTING
-A KUBE-IPVS-POSTROUTING -m ipvs --vdir ORIGINAL --vmethod MASQ -j KUBE-IPVS-MASQ
COMMIT
";
        let (input, removed) = cleanup_input(save, &NAT);
        assert_eq!(removed.jumps, 1);
        assert_eq!(removed.chains, ["KUBE-IPVS-POSTROUTING", "KUBE-IPVS-MASQ"]);
        assert_eq!(
            input,
            "*nat\n\
             -D POSTROUTING -m comment --comment \"kube-ipvs service traffic requiring SNAT\" -j KUBE-IPVS-POSTROUTING\n\
             -F KUBE-IPVS-POSTROUTING\n-F KUBE-IPVS-MASQ\n-X KUBE-IPVS-POSTROUTING\n-X KUBE-IPVS-MASQ\nCOMMIT\n"
        );
        let (_, none) = cleanup_input("*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n", &NAT);
        assert_eq!((none.jumps, none.chains.len()), (0, 0));
    }

    #[test]
    fn filter_cleanup_deletes_both_jumps_and_our_three_chains_only() {
        let save = "\
*filter
:INPUT DROP [0:0]
:FORWARD DROP [0:0]
:KUBE-IPVS-INPUT - [0:0]
:KUBE-IPVS-FORWARD - [0:0]
:KUBE-IPVS-SOURCE-RANGES - [0:0]
:KUBE-FORWARD - [0:0]
-A INPUT -m comment --comment \"kube-ipvs service filter\" -j KUBE-IPVS-INPUT
-A INPUT -p tcp --dport 22 -j ACCEPT
-A FORWARD -m comment --comment \"kube-ipvs service forwarding\" -j KUBE-IPVS-FORWARD
-A FORWARD -j KUBE-FORWARD
-A KUBE-IPVS-INPUT -m set --match-set KUBE-IPVS-LB-FW dst,dst -j KUBE-IPVS-SOURCE-RANGES
COMMIT
";
        let (input, removed) = cleanup_input(save, &FILTER);
        assert_eq!(removed.jumps, 2);
        assert_eq!(
            removed.chains,
            [
                "KUBE-IPVS-INPUT",
                "KUBE-IPVS-FORWARD",
                "KUBE-IPVS-SOURCE-RANGES"
            ]
        );
        assert!(input.starts_with("*filter\n-D INPUT -m comment"));
        assert!(!input.contains("dport 22"), "a rule not ours is kept");
        assert!(
            !input.contains("KUBE-FORWARD\n"),
            "kube-proxy's chain is not ours"
        );
        // The jump between our own chains goes with the flush, not as a jump of its own.
        assert!(!input.contains("-D KUBE-IPVS-INPUT"));
    }

    #[test]
    fn only_legacy_tables_the_kernel_lists_are_read() {
        use std::io::{Error, ErrorKind};
        let listed = table_list(Ok("filter\nnat\n".to_owned()));
        assert_eq!(listed, Some(vec!["filter".to_owned(), "nat".to_owned()]));
        assert!(may_hold(listed.as_deref(), "nat"));
        assert!(!may_hold(listed.as_deref(), "mangle"));
        // Without the ip_tables module there is no list and no legacy table at all.
        let absent = table_list(Err(Error::from(ErrorKind::NotFound)));
        assert_eq!(absent, Some(Vec::new()));
        assert!(!may_hold(absent.as_deref(), "filter"));
        // A list that cannot be read says nothing: every table is read, as before.
        let unknown = table_list(Err(Error::from(ErrorKind::PermissionDenied)));
        assert_eq!(unknown, None);
        assert!(may_hold(unknown.as_deref(), "filter"));
        // The nf_tables backend is never filtered.
        assert_eq!(legacy_tables(Backend::Nft, Family::V4), None);
    }
}
