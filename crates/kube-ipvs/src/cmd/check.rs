//! `kube-ipvs check`: the desired state against the kernel, as findings grouped by Service.
//!
//! The comparison is the engine's own full diff (the desired table from [`Engine`], diffed
//! with [`full_diff`] and the exclude CIDRs), so "in sync" means exactly "the daemon would do
//! nothing". Each op of that diff is turned into a finding and filed under the Services that
//! ask for its virtual server or address; stale entries no Service asks for go under
//! `(no Service)`. Real servers at weight 0 that no Service wants are draining (graceful
//! termination) and reported as notes, not as drift. Exit 0 in sync, 1 not, 2 on error.
//!
//! The service ipsets (the members the `filter` and `nat` rules match) are compared the same
//! way ([`check_sets`]): a member a Service needs is filed under it, a stray one under
//! `(no Service)`; a node where none of them exists is not managed by kube-ipvs's iptables
//! side and gets a note.
//!
//! Findings say which side is wrong: an empty virtual server with a note "no usable
//! endpoints" is the control plane's doing (the API has no ready endpoint), a missing or stale
//! entry while the API is fine is the node's (its rules are stale).

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write as _;
use std::net::IpAddr;
use std::process::ExitCode;
use std::time::Duration;

use kube_ipvs_diff::{
    DestKey, Engine, Inputs, Op, Ownership, RealServer, Table, UnknownCounts, VirtualKey,
    VirtualServer, full_diff,
};
use kube_ipvs_netlink::Family;
use kube_ipvs_netlink::link::DEFAULT_DUMMY;

use kube_ipvs_netlink::nfnl::ipset::Member;

use crate::agent::sets::{ObservedSets, desired_members, diff_sets, read_sets};
use crate::apply::Owners;
use crate::cmd::source::SourceArgs;
use crate::kernel::observe::Observed;
use crate::kernel::{Binding, RealKernel};
use crate::words::count;

/// The options of `kube-ipvs check`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Compare the desired state with the kernel, grouped by Service; exit 0 in sync, 1 not, 2 on error"
)]
pub struct CheckArgs {
    /// Where the desired state comes from, and this node.
    #[command(flatten)]
    pub source: SourceArgs,
    /// Machine-readable output: `{"in_sync", "desired", "notes", "groups": [{"services",
    /// "findings": [{"kind", "text"}], "notes"}], "skipped": [lines]}`.
    #[arg(long)]
    pub json: bool,
}

/// One difference between the desired state and the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// A virtual server the kernel lacks, with the number of real servers it should have.
    MissingVirtualServer {
        /// The virtual server as it should be.
        server: VirtualServer,
        /// How many real servers it should have.
        dests: usize,
    },
    /// A virtual server the kernel has, we own, and no Service asks for.
    StaleVirtualServer {
        /// Its key.
        key: VirtualKey,
        /// How many real servers it has.
        dests: usize,
    },
    /// A virtual server whose scheduler, flags or persistence differ.
    WrongScheduler {
        /// As the kernel has it.
        have: VirtualServer,
        /// As it should be.
        want: VirtualServer,
    },
    /// A real server the kernel lacks.
    MissingRealServer {
        /// Its virtual server.
        service: VirtualKey,
        /// The real server as it should be.
        dest: RealServer,
    },
    /// A real server the kernel has and no endpoint asks for.
    StaleRealServer {
        /// Its virtual server.
        service: VirtualKey,
        /// As the kernel has it.
        dest: RealServer,
    },
    /// A real server with the wrong weight.
    WrongWeight {
        /// Its virtual server.
        service: VirtualKey,
        /// Which real server.
        dest: DestKey,
        /// The kernel's weight.
        have: u32,
        /// The weight it should have.
        want: u32,
    },
    /// A real server with the wrong forwarding method.
    WrongForwarding {
        /// Its virtual server.
        service: VirtualKey,
        /// As the kernel has it.
        have: RealServer,
        /// As it should be.
        want: RealServer,
    },
    /// An address missing from `kube-ipvs0`.
    MissingAddress(IpAddr),
    /// An address on `kube-ipvs0` that no Service asks for.
    ExtraAddress(IpAddr),
    /// A member a Service needs in one of the service ipsets (filter and masquerade rules).
    MissingSetMember {
        /// The set.
        set: &'static str,
        /// The member, as `ipset` prints it.
        member: Member,
    },
    /// A member of a service ipset that no Service asks for.
    ExtraSetMember {
        /// The set.
        set: &'static str,
        /// The member.
        member: Member,
    },
    /// A service ipset that does not exist while the others do.
    MissingSet(&'static str),
    /// A jump or chain of our iptables layout that the kernel lacks while the sets exist
    /// (`nat: no jump from PREROUTING to KUBE-IPVS-SERVICES`).
    MissingRule(String),
}

impl Finding {
    /// A stable name for the class of finding, for `--json`.
    pub fn kind(&self) -> &'static str {
        match self {
            Finding::MissingVirtualServer { .. } => "missing-virtual-server",
            Finding::StaleVirtualServer { .. } => "stale-virtual-server",
            Finding::WrongScheduler { .. } => "wrong-scheduler",
            Finding::MissingRealServer { .. } => "missing-real-server",
            Finding::StaleRealServer { .. } => "stale-real-server",
            Finding::WrongWeight { .. } => "wrong-weight",
            Finding::WrongForwarding { .. } => "wrong-forwarding",
            Finding::MissingAddress(_) => "missing-address",
            Finding::ExtraAddress(_) => "extra-address",
            Finding::MissingSetMember { .. } => "missing-set-member",
            Finding::ExtraSetMember { .. } => "extra-set-member",
            Finding::MissingSet(_) => "missing-set",
            Finding::MissingRule(_) => "missing-rule",
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        match self {
            Finding::MissingVirtualServer { server, dests } => write!(
                f,
                "missing virtual server {server} (wants {dests} real server{})",
                plural(*dests)
            ),
            Finding::StaleVirtualServer { key, dests } => write!(
                f,
                "stale virtual server {key} (has {dests} real server{})",
                plural(*dests)
            ),
            Finding::WrongScheduler { have, want } => write!(
                f,
                "wrong scheduler or flags on {}: kernel has {have}, want {want}",
                want.key
            ),
            Finding::MissingRealServer { service, dest } => {
                write!(f, "missing real server {service} -> {dest}")
            }
            Finding::StaleRealServer { service, dest } => {
                write!(f, "stale real server {service} -> {dest}")
            }
            Finding::WrongWeight {
                service,
                dest,
                have,
                want,
            } => write!(
                f,
                "wrong weight of real server {service} -> {dest}: kernel has {have}, want {want}"
            ),
            Finding::WrongForwarding {
                service,
                have,
                want,
            } => write!(
                f,
                "wrong forwarding of real server {service} -> {}: kernel has {}, want {}",
                want.key, have.forward, want.forward
            ),
            Finding::MissingAddress(a) => write!(f, "missing address {a} on kube-ipvs0"),
            Finding::ExtraAddress(a) => write!(f, "extra address {a} on kube-ipvs0"),
            Finding::MissingSetMember { set, member } => {
                write!(f, "missing member {member} of ipset {set}")
            }
            Finding::ExtraSetMember { set, member } => {
                write!(f, "extra member {member} of ipset {set}")
            }
            Finding::MissingSet(set) => write!(f, "missing ipset {set}"),
            Finding::MissingRule(what) => write!(f, "missing iptables {what}"),
        }
    }
}

/// The findings and notes of one group (a Service, several sharing an entry, or `(no Service)`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Group {
    /// Differences: each one means the node is not in sync.
    pub findings: Vec<Finding>,
    /// Information that does not make the node out of sync (draining real servers, virtual
    /// servers without usable endpoints).
    pub notes: Vec<String>,
}

/// The result of a check.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Groups by label: `namespace/name`, several joined by `, `, or `(no Service)`.
    pub groups: BTreeMap<String, Group>,
    /// Notes about the kernel as a whole (foreign entries, a missing interface).
    pub notes: Vec<String>,
    /// The size of the desired table: virtual servers, real servers, addresses.
    pub desired: (usize, usize, usize),
    /// What translation left out, one line per reason (the agent's words).
    pub skipped: Vec<String>,
}

impl Report {
    /// Whether the kernel matches the desired state.
    pub fn in_sync(&self) -> bool {
        self.groups.values().all(|g| g.findings.is_empty())
    }

    /// The number of findings.
    pub fn finding_count(&self) -> usize {
        self.groups.values().map(|g| g.findings.len()).sum()
    }

    /// The report as JSON (its own output types, so the internal model can change freely).
    pub fn to_json(&self) -> String {
        #[derive(serde::Serialize)]
        struct JsonFinding {
            kind: &'static str,
            text: String,
        }
        #[derive(serde::Serialize)]
        struct JsonGroup<'a> {
            services: &'a str,
            findings: Vec<JsonFinding>,
            notes: &'a [String],
        }
        #[derive(serde::Serialize)]
        struct JsonDesired {
            virtual_servers: usize,
            real_servers: usize,
            addresses: usize,
        }
        #[derive(serde::Serialize)]
        struct JsonReport<'a> {
            in_sync: bool,
            desired: JsonDesired,
            notes: &'a [String],
            groups: Vec<JsonGroup<'a>>,
            skipped: &'a [String],
        }
        let (vs, rs, addrs) = self.desired;
        let report = JsonReport {
            in_sync: self.in_sync(),
            desired: JsonDesired {
                virtual_servers: vs,
                real_servers: rs,
                addresses: addrs,
            },
            notes: &self.notes,
            skipped: &self.skipped,
            groups: self
                .groups
                .iter()
                .map(|(label, g)| JsonGroup {
                    services: label,
                    findings: g
                        .findings
                        .iter()
                        .map(|f| JsonFinding {
                            kind: f.kind(),
                            text: f.to_string(),
                        })
                        .collect(),
                    notes: &g.notes,
                })
                .collect(),
        };
        // Serialising plain strings, numbers and bools cannot fail.
        let mut text = serde_json::to_string_pretty(&report).unwrap_or_default();
        text.push('\n');
        text
    }

    /// The report as text: each group with its findings and notes, then one summary line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for note in &self.notes {
            out.push_str(&format!("note: {note}\n"));
        }
        for (label, g) in &self.groups {
            out.push_str(&format!("{label}:\n"));
            for f in &g.findings {
                out.push_str(&format!("  {f}\n"));
            }
            for n in &g.notes {
                out.push_str(&format!("  note: {n}\n"));
            }
        }
        for s in &self.skipped {
            out.push_str(&format!("skipped: {s}\n"));
        }
        if self.in_sync() {
            out.push_str(&format!("in sync: {}\n", desired_text(self.desired)));
        } else {
            let bad = self
                .groups
                .values()
                .filter(|g| !g.findings.is_empty())
                .count();
            out.push_str(&format!(
                "NOT in sync: {} in {} (desired: {})\n",
                count(self.finding_count(), "finding", "findings"),
                count(bad, "group", "groups"),
                desired_text(self.desired)
            ));
        }
        out
    }
}

/// The desired table's size in words.
fn desired_text((vs, rs, addrs): (usize, usize, usize)) -> String {
    format!(
        "{}, {}, {}",
        count(vs, "virtual server", "virtual servers"),
        count(rs, "real server", "real servers"),
        count(addrs, "address", "addresses")
    )
}

/// Compares what `inputs` ask for with what the kernel holds. Pure: tests pass hand-built
/// observed tables.
pub fn check(inputs: &mut Inputs, observed: &Observed) -> Report {
    let owners = Owners::from_inputs(inputs);
    let mut engine = Engine::new();
    let _ = engine.sync(inputs, Duration::ZERO, &UnknownCounts);
    let desired = engine.desired_table();
    let ops = full_diff(
        &desired,
        &observed.table,
        Ownership::of(&inputs.node().options),
    );
    let mut report = Report {
        desired: (
            desired.services.len(),
            desired.dest_count(),
            desired.addresses.len(),
        ),
        ..Report::default()
    };
    for f in &observed.foreign {
        report.notes.push(format!("left alone (foreign): {f}"));
    }
    if !observed.interface_exists && !desired.addresses.is_empty() {
        report
            .notes
            .push(format!("interface {DEFAULT_DUMMY} does not exist"));
    }
    let missing: Vec<VirtualKey> = ops
        .iter()
        .filter_map(|op| match op {
            Op::AddService(vs) => Some(vs.key),
            _ => None,
        })
        .collect();
    for op in &ops {
        let label = owners.label(op);
        let finding = match finding_for(op, &desired, &observed.table, &missing) {
            Some(Ok(f)) => f,
            Some(Err(note)) => {
                report.groups.entry(label).or_default().notes.push(note);
                continue;
            }
            None => continue,
        };
        report
            .groups
            .entry(label)
            .or_default()
            .findings
            .push(finding);
    }
    // Virtual servers with no real servers are the control plane's side: nothing ready.
    for (key, entry) in &desired.services {
        if entry.dests.is_empty() {
            let label = crate::apply::names_label(
                owners.servers.get(key).map(Vec::as_slice).unwrap_or(&[]),
            );
            report.groups.entry(label).or_default().notes.push(format!(
                "{key} has no usable endpoints: the API offers none for this node (see `kube-ipvs explain`)"
            ));
        }
    }
    report
}

/// Adds the differences of the service ipsets ([`crate::agent::sets`]) to `report`: members a
/// Service needs under that Service, members and sets nobody has under `(no Service)`. When
/// no set exists at all, kube-ipvs does not manage iptables on this node (`--no-masquerade`)
/// and that is a note, not drift. Returns the families whose rules should then exist: `None`
/// when iptables is not managed, else IPv4 and, with an IPv6 member, IPv6.
pub fn check_sets(
    report: &mut Report,
    inputs: &Inputs,
    observed: &ObservedSets,
) -> Option<Vec<Family>> {
    let desired = desired_members(inputs);
    let diff = diff_sets(&desired, observed);
    if diff.unmanaged {
        report.notes.push(
            "no service ipsets: iptables is not managed by kube-ipvs here (--no-masquerade), \
             or the agent has not run yet"
                .to_owned(),
        );
        return None;
    }
    let mut families = vec![Family::V4];
    if desired.keys().any(|(_, m)| m.family() == Some(Family::V6)) {
        families.push(Family::V6);
    }
    for ((set, member), owners) in diff.missing {
        if diff.absent.contains(&set) {
            continue;
        }
        report
            .groups
            .entry(crate::apply::names_label(&owners))
            .or_default()
            .findings
            .push(Finding::MissingSetMember { set, member });
    }
    let none = report.groups.entry("(no Service)".to_owned()).or_default();
    for (set, member) in diff.extra {
        none.findings.push(Finding::ExtraSetMember { set, member });
    }
    for set in diff.absent {
        none.findings.push(Finding::MissingSet(set));
    }
    if report
        .groups
        .get("(no Service)")
        .is_some_and(|g| g.findings.is_empty() && g.notes.is_empty())
    {
        report.groups.remove("(no Service)");
    }
    Some(families)
}

/// Adds what of our iptables layout is missing (`missing`: per family, the jumps and chains
/// `iptables-save` lacks, or why it could not be read) under `(no Service)`.
pub fn check_rules(report: &mut Report, missing: Vec<(Family, Result<Vec<String>, String>)>) {
    for (family, result) in missing {
        match result {
            Ok(lines) if lines.is_empty() => {}
            Ok(lines) => {
                let group = report.groups.entry("(no Service)".to_owned()).or_default();
                group.findings.extend(
                    lines
                        .into_iter()
                        .map(|l| Finding::MissingRule(format!("{} {l}", family_label(family)))),
                );
            }
            Err(e) => report
                .notes
                .push(format!("{} rules not checked: {e}", family_label(family))),
        }
    }
}

fn family_label(family: Family) -> &'static str {
    match family {
        Family::V4 => "IPv4",
        Family::V6 => "IPv6",
    }
}

/// The finding for one op of the diff; `Some(Err(note))` for what is not drift, `None` for an
/// op already covered by another finding (the real servers of a missing virtual server).
fn finding_for(
    op: &Op,
    desired: &Table,
    observed: &Table,
    missing: &[VirtualKey],
) -> Option<Result<Finding, String>> {
    let have_dest = |service: &VirtualKey, dest: &DestKey| {
        observed
            .services
            .get(service)
            .and_then(|e| e.dests.get(dest))
            .copied()
    };
    Some(Ok(match op {
        Op::AddAddress(a) => Finding::MissingAddress(*a),
        Op::RemoveAddress(a) => Finding::ExtraAddress(*a),
        Op::AddService(vs) => Finding::MissingVirtualServer {
            server: *vs,
            dests: desired.services.get(&vs.key).map_or(0, |e| e.dests.len()),
        },
        Op::DeleteService(k) => Finding::StaleVirtualServer {
            key: *k,
            dests: observed.services.get(k).map_or(0, |e| e.dests.len()),
        },
        Op::UpdateService(want) => match observed.services.get(&want.key) {
            Some(e) => Finding::WrongScheduler {
                have: e.server,
                want: *want,
            },
            None => return None,
        },
        Op::AddDest { service, .. } if missing.contains(service) => return None,
        Op::AddDest { service, dest } => Finding::MissingRealServer {
            service: *service,
            dest: *dest,
        },
        Op::DeleteDest { service, dest } => {
            let have = have_dest(service, dest)?;
            if have.weight == 0 {
                return Some(Err(format!(
                    "real server {service} -> {dest} is draining (weight 0, no endpoint wants it)"
                )));
            }
            Finding::StaleRealServer {
                service: *service,
                dest: have,
            }
        }
        Op::UpdateDest { service, dest } => {
            let have = have_dest(service, &dest.key)?;
            if have.weight != dest.weight {
                Finding::WrongWeight {
                    service: *service,
                    dest: dest.key,
                    have: have.weight,
                    want: dest.weight,
                }
            } else {
                Finding::WrongForwarding {
                    service: *service,
                    have,
                    want: *dest,
                }
            }
        }
    }))
}

/// Runs `kube-ipvs check`: 0 in sync, 1 not in sync, 2 on error.
pub fn main(args: &CheckArgs) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("kube-ipvs check: {msg}");
        ExitCode::from(2)
    };
    // The kernel's short-circuit marks are hints for the desired state's (best effort: the
    // desired state's errors are reported before the kernel's).
    // An address counts as bound whichever way `run` made it local
    // (`--service-address-binding`).
    let mut kernel = RealKernel::open(DEFAULT_DUMMY).map(|k| k.binding(Binding::Either));
    let desired = match args.source.load_beside(&mut kernel) {
        Ok(v) => v,
        Err(e) => return fail(e.to_string()),
    };
    desired.report("kube-ipvs check");
    let mut inputs = desired.inputs;
    let observed = kernel.and_then(|mut k| Ok((k.read()?, read_sets(&mut k)?)));
    let (observed, sets) = match observed {
        Ok(o) => o,
        Err(e) => return fail(e.to_string()),
    };
    let mut report = check(&mut inputs, &observed);
    if let Some(families) = check_sets(&mut report, &inputs, &sets) {
        let missing = families
            .into_iter()
            .map(|f| {
                let r =
                    kube_ipvs_host::masquerade::missing_rules(None, f).map_err(|e| e.to_string());
                (f, r)
            })
            .collect();
        check_rules(&mut report, missing);
    }
    report.skipped = desired
        .skipped
        .iter()
        .flat_map(|s| s.messages.iter().cloned())
        .collect();
    let text = if args.json {
        report.to_json()
    } else {
        report.render()
    };
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    if report.in_sync() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_ipvs_diff::{
        Endpoint, EndpointPort, NodeContext, Protocol, ServiceInfo, ServiceName, ServicePort,
    };

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    fn svc(cluster_ip: &str, port: u16, protocol: Protocol) -> ServiceInfo {
        ServiceInfo {
            cluster_ips: vec![ip(cluster_ip)],
            ports: vec![ServicePort {
                name: "p".into(),
                protocol,
                port,
                node_port: None,
            }],
            ..ServiceInfo::default()
        }
    }

    fn eps(addrs: &[&str], protocol: Protocol) -> Vec<Endpoint> {
        addrs
            .iter()
            .map(|a| {
                Endpoint::ready(
                    ip(a),
                    vec![EndpointPort {
                        name: "p".into(),
                        port: 8080,
                        protocol,
                    }],
                )
            })
            .collect()
    }

    /// Two Services, web (TCP, two endpoints) and dns (UDP, one endpoint).
    fn inputs() -> Inputs {
        let mut i = Inputs::new(NodeContext::new("node-1")).expect("valid node");
        let web = ServiceName::new("default", "web");
        i.upsert_service(web.clone(), svc("10.96.0.10", 80, Protocol::Tcp))
            .expect("valid");
        i.set_endpoints(web, eps(&["10.244.1.1", "10.244.2.1"], Protocol::Tcp))
            .expect("valid");
        let dns = ServiceName::new("kube-system", "dns");
        i.upsert_service(dns.clone(), svc("10.96.0.53", 53, Protocol::Udp))
            .expect("valid");
        i.set_endpoints(dns, eps(&["10.244.1.53"], Protocol::Udp))
            .expect("valid");
        i
    }

    /// A kernel that matches the inputs exactly, built with the engine's own ops.
    fn synced_kernel() -> Observed {
        let mut table = Table::default();
        let ops = crate::cmd::plan::compute(&mut inputs(), &Table::default());
        table
            .apply_all(&ops)
            .expect("the kernel model accepts the plan");
        Observed {
            table,
            interface_exists: true,
            ..Observed::default()
        }
    }

    fn web_key() -> VirtualKey {
        VirtualKey::inet(Protocol::Tcp, ip("10.96.0.10"), 80)
    }

    #[test]
    fn service_set_drift_is_filed_under_its_service_and_absent_sets_are_only_a_note() {
        let inputs = inputs();
        let mut report = check(&mut inputs.clone(), &synced_kernel());
        check_sets(&mut report, &inputs, &ObservedSets::new());
        let all_absent: ObservedSets = kube_ipvs_host::sets::sets()
            .map(|(n, _, _)| (n, None))
            .collect();
        check_sets(&mut report, &inputs, &all_absent);
        assert!(report.in_sync(), "{}", report.render());
        assert!(report.notes.iter().any(|n| n.contains("no service ipsets")));

        // Every set exists and holds what is wanted, except web's member and a stray one.
        let mut sets: ObservedSets = all_absent
            .keys()
            .map(|n| (*n, Some(Default::default())))
            .collect();
        for ((set, member), _) in desired_members(&inputs) {
            if let Some(Some(m)) = sets.get_mut(set) {
                m.insert(member);
            }
        }
        let web = Member::IpPort {
            addr: ip("10.96.0.10"),
            protocol: 6,
            port: 80,
        };
        for set in ["KUBE-IPVS-SERVICES", "KUBE-IPVS-CLUSTER-IPS"] {
            if let Some(Some(m)) = sets.get_mut(set) {
                m.remove(&web);
            }
        }
        if let Some(Some(m)) = sets.get_mut("KUBE-IPVS-ADDRS") {
            m.insert(Member::Ip(ip("10.96.7.7")));
        }
        let mut report = check(&mut inputs.clone(), &synced_kernel());
        check_sets(&mut report, &inputs, &sets);
        assert!(!report.in_sync());
        let text = report.render();
        assert!(
            text.contains("default/web:\n  missing member 10.96.0.10,tcp:80 of ipset KUBE-IPVS-CLUSTER-IPS\n  missing member 10.96.0.10,tcp:80 of ipset KUBE-IPVS-SERVICES\n"),
            "{text}"
        );
        assert!(
            text.contains("(no Service):\n  extra member 10.96.7.7 of ipset KUBE-IPVS-ADDRS\n"),
            "{text}"
        );
        assert!(!text.contains("kube-system/dns"), "{text}");
    }

    #[test]
    fn missing_rules_are_drift_and_unreadable_rules_a_note() {
        let inputs = inputs();
        let mut report = check(&mut inputs.clone(), &synced_kernel());
        check_rules(
            &mut report,
            vec![
                (Family::V4, Ok(Vec::new())),
                (Family::V6, Err("ip6tables-save: not found".to_owned())),
            ],
        );
        assert!(report.in_sync(), "{}", report.render());
        assert!(
            report
                .notes
                .iter()
                .any(|n| n.starts_with("IPv6 rules not checked"))
        );
        check_rules(
            &mut report,
            vec![(
                Family::V4,
                Ok(vec!["mangle: no chain KUBE-IPVS-LOCAL-PODS".to_owned()]),
            )],
        );
        assert!(!report.in_sync());
        let text = report.render();
        assert!(
            text.contains(
                "(no Service):\n  missing iptables IPv4 mangle: no chain KUBE-IPVS-LOCAL-PODS\n"
            ),
            "{text}"
        );
    }

    fn dest(addr: &str) -> DestKey {
        DestKey {
            addr: ip(addr),
            port: 8080,
        }
    }

    #[test]
    fn in_sync_node() {
        let r = check(&mut inputs(), &synced_kernel());
        assert!(r.in_sync(), "{}", r.render());
        assert_eq!(
            r.render(),
            "in sync: 2 virtual servers, 3 real servers, 2 addresses\n"
        );
    }

    #[test]
    fn stale_endpoint_is_grouped_under_its_service() {
        let mut k = synced_kernel();
        let entry = k.table.services.get_mut(&web_key()).expect("web");
        entry.dests.remove(&dest("10.244.2.1"));
        let stale = RealServer::masq(ip("10.244.9.9"), 8080, 1);
        entry.dests.insert(stale.key, stale);
        let r = check(&mut inputs(), &k);
        assert!(!r.in_sync());
        assert_eq!(
            r.render(),
            "default/web:\n\
             \x20 missing real server TCP 10.96.0.10:80 -> 10.244.2.1:8080 masq weight 1\n\
             \x20 stale real server TCP 10.96.0.10:80 -> 10.244.9.9:8080 masq weight 1\n\
             NOT in sync: 2 findings in 1 group (desired: 2 virtual servers, 3 real servers, 2 addresses)\n"
        );
    }

    #[test]
    fn json_lists_groups_with_finding_kinds() {
        let mut k = synced_kernel();
        k.table.addresses.remove(&ip("10.96.0.53"));
        let r = check(&mut inputs(), &k);
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).expect("valid JSON");
        assert_eq!(v["in_sync"], false);
        assert_eq!(v["desired"]["real_servers"], 3);
        assert_eq!(v["groups"][0]["services"], "kube-system/dns");
        assert_eq!(v["groups"][0]["findings"][0]["kind"], "missing-address");
        assert_eq!(
            v["groups"][0]["findings"][0]["text"],
            "missing address 10.96.0.53 on kube-ipvs0"
        );
    }

    #[test]
    fn missing_service_is_one_finding_not_one_per_real_server() {
        let mut k = synced_kernel();
        k.table.services.remove(&web_key());
        let r = check(&mut inputs(), &k);
        assert_eq!(r.finding_count(), 1);
        assert_eq!(
            r.groups["default/web"].findings,
            vec![Finding::MissingVirtualServer {
                server: VirtualServer {
                    key: web_key(),
                    scheduler: kube_ipvs_diff::Scheduler::RR,
                    persistence: None,
                    netmask: 32
                },
                dests: 2
            }]
        );
    }

    #[test]
    fn missing_and_extra_addresses() {
        let mut k = synced_kernel();
        k.table.addresses.remove(&ip("10.96.0.53"));
        k.table.addresses.insert(ip("10.96.7.7"));
        k.table.addresses.insert(ip("10.200.0.1"));
        let mut i = inputs();
        let mut node = i.node().clone();
        node.options.exclude_cidrs = vec!["10.200.0.0/16".parse().expect("valid")];
        i.set_node(node).expect("valid");
        let r = check(&mut i, &k);
        assert_eq!(
            r.groups["kube-system/dns"].findings,
            vec![Finding::MissingAddress(ip("10.96.0.53"))]
        );
        assert_eq!(
            r.groups["(no Service)"].findings,
            vec![Finding::ExtraAddress(ip("10.96.7.7"))],
            "the excluded address belongs to someone else"
        );
    }

    #[test]
    fn stale_service_wrong_weight_and_scheduler() {
        let mut k = synced_kernel();
        let entry = k.table.services.get_mut(&web_key()).expect("web");
        entry.server.scheduler = "wrr".parse().expect("valid");
        entry
            .dests
            .get_mut(&dest("10.244.1.1"))
            .expect("dest")
            .weight = 5;
        let mut stale = entry.clone();
        stale.server.key = VirtualKey::inet(Protocol::Tcp, ip("10.96.0.99"), 80);
        k.table.services.insert(stale.server.key, stale);
        let r = check(&mut inputs(), &k);
        let text = r.render();
        assert!(
            text.contains("default/web:\n  wrong scheduler or flags on TCP 10.96.0.10:80: kernel has TCP 10.96.0.10:80 wrr, want TCP 10.96.0.10:80 rr\n  wrong weight of real server TCP 10.96.0.10:80 -> 10.244.1.1:8080: kernel has 5, want 1\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "(no Service):\n  stale virtual server TCP 10.96.0.99:80 (has 2 real servers)\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn draining_real_servers_and_empty_services_are_notes() {
        let mut k = synced_kernel();
        let draining = RealServer::masq(ip("10.244.3.1"), 8080, 0);
        let entry = k.table.services.get_mut(&web_key()).expect("web");
        entry.dests.insert(draining.key, draining);
        let mut i = inputs();
        i.set_endpoints(ServiceName::new("kube-system", "dns"), vec![])
            .expect("valid");
        let dns = VirtualKey::inet(Protocol::Udp, ip("10.96.0.53"), 53);
        k.table.services.get_mut(&dns).expect("dns").dests.clear();
        let r = check(&mut i, &k);
        assert!(r.in_sync(), "{}", r.render());
        assert_eq!(
            r.groups["default/web"].notes,
            vec![
                "real server TCP 10.96.0.10:80 -> 10.244.3.1:8080 is draining (weight 0, no endpoint wants it)"
            ]
        );
        assert!(r.groups["kube-system/dns"].notes[0].contains("no usable endpoints"));
    }

    #[test]
    fn a_shared_address_names_every_service() {
        let mut i = inputs();
        let mut other = svc("10.96.0.11", 80, Protocol::Tcp);
        other.external_ips = vec![ip("203.0.113.5")];
        let mut web = svc("10.96.0.10", 80, Protocol::Tcp);
        web.external_ips = vec![ip("203.0.113.5")];
        web.ports[0].port = 81;
        i.upsert_service(ServiceName::new("default", "web"), web)
            .expect("valid");
        i.upsert_service(ServiceName::new("shop", "front"), other)
            .expect("valid");
        let r = check(&mut i, &synced_kernel());
        let shared = &r.groups["default/web, shop/front"];
        assert_eq!(
            shared.findings,
            vec![Finding::MissingAddress(ip("203.0.113.5"))]
        );
    }
}
