//! `kube-ipvs plan`: the operations `run` would apply now, printed one per line, and with
//! `--apply` applied once through the executor (the first piece of `run`: one resync, no
//! watch, no timers).
//!
//! After the IPVS operations come the changes to the service ipsets (the members the `filter`
//! and `nat` rules match) that `run` would make; `--apply` applies the IPVS operations only.
//!
//! The ops come from the engine's own `resync` against the observed table, so what is printed
//! is exactly what the daemon would do at startup. This module owns the command line and the
//! text; the engine decides, [`crate::apply`] executes, [`crate::kernel::observe`] reads.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use kube_ipvs_diff::{Engine, Inputs, Op, Table, UnknownCounts};
use kube_ipvs_netlink::link::DEFAULT_DUMMY;

use crate::agent::sets::{SetDiff, desired_members, diff_sets, read_sets};
use crate::apply::{self, Owners};
use crate::cmd::source::SourceArgs;
use crate::kernel::{Binding, RealKernel};

/// The options of `kube-ipvs plan`.
#[derive(Debug, Clone, clap::Args)]
#[command(about = "Print the operations `run` would apply now (and with --apply, apply them once)")]
pub struct PlanArgs {
    /// Where the desired state comes from, and this node.
    #[command(flatten)]
    pub source: SourceArgs,
    /// Diff against an empty table instead of the kernel: needs no root and no IPVS.
    #[arg(long, conflicts_with = "apply")]
    pub from_empty: bool,
    /// Apply the plan once through the executor and report failed operations (a one-shot
    /// sync: what `run` does at startup, without watching afterwards).
    #[arg(long)]
    pub apply: bool,
    /// Read and bind service addresses one way, as `run --service-address-binding` does
    /// (address or route). Unset, an address counts as bound either way, and `--apply` binds
    /// it as an address (`run`'s default).
    #[arg(long, value_name = "address|route")]
    pub service_address_binding: Option<Binding>,
}

/// The ops that take `observed` to what `inputs` ask for, as the daemon's startup resync would
/// compute them (no connection counts are known, so stale TCP real servers drain at weight 0).
pub fn compute(inputs: &mut Inputs, observed: &Table) -> Vec<Op> {
    Engine::new().resync(inputs, observed, Duration::ZERO, &UnknownCounts)
}

/// The plan as text: one op per line, then a summary with a count per kind of op.
pub fn render(ops: &[Op]) -> String {
    let mut out = String::new();
    for op in ops {
        out.push_str(&op.to_string());
        out.push('\n');
    }
    if ops.is_empty() {
        out.push_str("0 operations: the kernel already matches\n");
        return out;
    }
    // Kinds in kernel order, so the summary reads like the plan above it.
    let mut kinds: std::collections::BTreeMap<u8, (&str, usize)> = Default::default();
    for op in ops {
        kinds.entry(op.phase()).or_insert((kind_name(op), 0)).1 += 1;
    }
    let counts: Vec<String> = kinds
        .values()
        .map(|(name, n)| format!("{n} {name}"))
        .collect();
    out.push_str(&format!(
        "{}: {}\n",
        crate::words::count(ops.len(), "operation", "operations"),
        counts.join(", ")
    ));
    out
}

/// The changes to the service ipsets `run` would make, one per line, then a count; nothing when
/// kube-ipvs does not manage iptables on this node (no set exists). `plan --apply` applies
/// only the IPVS operations: the sets and rules are `run`'s.
pub fn render_sets(diff: &SetDiff) -> String {
    if diff.unmanaged {
        return String::new();
    }
    let mut out = String::new();
    for set in &diff.absent {
        out.push_str(&format!("create ipset {set}\n"));
    }
    for ((set, member), _) in &diff.missing {
        out.push_str(&format!("add ipset member {set} {member}\n"));
    }
    for (set, member) in &diff.extra {
        out.push_str(&format!("delete ipset member {set} {member}\n"));
    }
    let n = diff.absent.len() + diff.missing.len() + diff.extra.len();
    out.push_str(&format!(
        "{}\n",
        crate::words::count(n, "ipset change", "ipset changes")
    ));
    out
}

fn kind_name(op: &Op) -> &'static str {
    match op {
        Op::AddAddress(_) => "add address",
        Op::AddService(_) => "add service",
        Op::UpdateService(_) => "update service",
        Op::AddDest { .. } => "add dest",
        Op::UpdateDest { .. } => "update dest",
        Op::DeleteDest { .. } => "delete dest",
        Op::DeleteService(_) => "delete service",
        Op::RemoveAddress(_) => "remove address",
    }
}

/// Runs `kube-ipvs plan`: 0 on success, 1 if `--apply` had failures, 2 on error.
pub fn main(args: &PlanArgs) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("kube-ipvs plan: {msg}");
        ExitCode::from(2)
    };
    if args.from_empty {
        let desired = match args.source.load() {
            Ok(v) => v,
            Err(e) => return fail(e.to_string()),
        };
        desired.report("kube-ipvs plan");
        let mut inputs = desired.inputs;
        let ops = compute(&mut inputs, &Table::default());
        print(&render(&ops));
        return ExitCode::SUCCESS;
    }
    // The short circuit's marks the kernel holds are hints for the desired state's (best
    // effort: the desired state's errors are reported before the kernel's).
    let binding = args.service_address_binding.unwrap_or(Binding::Either);
    let mut kernel = RealKernel::open(DEFAULT_DUMMY).map(|k| k.binding(binding));
    let desired = match args.source.load_beside(&mut kernel) {
        Ok(v) => v,
        Err(e) => return fail(e.to_string()),
    };
    desired.report("kube-ipvs plan");
    let mut inputs = desired.inputs;
    let mut kernel = match kernel {
        Ok(k) => k,
        Err(e) => return fail(e.to_string()),
    };
    let observed = match kernel.read() {
        Ok(o) => o,
        Err(e) => return fail(e.to_string()),
    };
    for f in &observed.foreign {
        eprintln!("kube-ipvs plan: leaving foreign entry alone: {f}");
    }
    let owners = Owners::from_inputs(&inputs);
    let ops = compute(&mut inputs, &observed.table);
    print(&render(&ops));
    match read_sets(&mut kernel) {
        Ok(sets) => print(&render_sets(&diff_sets(&desired_members(&inputs), &sets))),
        Err(e) => eprintln!("kube-ipvs plan: reading the service ipsets: {e}"),
    }
    if !args.apply {
        return ExitCode::SUCCESS;
    }
    let failures = apply::apply(&mut kernel, &ops, &owners);
    for f in &failures {
        eprintln!("kube-ipvs plan: failed: {f}");
    }
    print(&format!(
        "applied {} of {}\n",
        ops.len() - failures.len(),
        crate::words::count(ops.len(), "operation", "operations")
    ));
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    // A closed pipe (`kube-ipvs plan | head`) is not an error worth a message.
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_ipvs_diff::{Protocol, RealServer, Scheduler, VirtualKey, VirtualServer};

    #[test]
    fn render_lists_ops_and_counts_them() {
        let v = VirtualServer {
            key: VirtualKey::inet(Protocol::Tcp, "10.96.0.10".parse().expect("literal"), 80),
            scheduler: Scheduler::RR,
            persistence: None,
            netmask: 32,
        };
        let ops = vec![
            Op::AddAddress("10.96.0.10".parse().expect("literal")),
            Op::AddService(v),
            Op::AddDest {
                service: v.key,
                dest: RealServer::masq("10.244.1.5".parse().expect("literal"), 8080, 1),
            },
        ];
        assert_eq!(
            render(&ops),
            "add address 10.96.0.10 to kube-ipvs0\n\
             add service TCP 10.96.0.10:80 rr\n\
             add dest TCP 10.96.0.10:80 -> 10.244.1.5:8080 masq weight 1\n\
             3 operations: 1 add address, 1 add service, 1 add dest\n"
        );
        assert_eq!(render(&[]), "0 operations: the kernel already matches\n");
    }
}
