//! `kube-ipvs cleanup`: removes what kube-ipvs created on this node and nothing else, for
//! uninstalling or switching to another proxy.
//!
//! What is ours is decided the way the engine decides it, so cleanup removes exactly what `run`
//! would manage: IPVS virtual servers outside `--exclude-cidrs` and the fwmark services of the
//! Local-policy short circuit (marks in `--local-fwmark-mask`; other firewall-mark services and
//! entries the engine cannot represent are never ours), the addresses on `kube-ipvs0` and our
//! local routes (`run --service-address-binding=route`) outside those networks, then the
//! `kube-ipvs0` link itself once nothing of anyone else's is left on it,
//! our `nat`, `filter` and `mangle` chains and their jumps in every iptables backend and family, and then
//! (once no rule references them) our ipsets ([`masquerade::all_sets`]: the hairpin sets and
//! the filter sets).
//!
//! Each removal is printed; the exit code is 0 when everything went, 1 naming what did not.
//! `--dry-run` prints the same list as "would remove" and changes nothing.

use std::net::IpAddr;
use std::process::ExitCode;

use kube_ipvs_diff::{Cidr, MarkSpace, Op, Ownership, Table, full_diff};
use kube_ipvs_netlink::link::DEFAULT_DUMMY;

use crate::apply::{self, Owners};
use crate::kernel::observe::Observed;
use crate::kernel::{Binding, RealKernel};
use crate::words::count;
use kube_ipvs_host::masquerade;

/// `kube-ipvs cleanup`'s flags.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(
    after_help = "Exit codes: 0 everything of ours removed (or nothing to remove), \
1 something could not be removed (named on stderr), 2 command line."
)]
pub struct CleanupArgs {
    /// kube-proxy's `KubeProxyConfiguration` file, read as `run --config` reads it: its
    /// `ipvs.excludeCIDRs` are kept as `--exclude-cidrs` keeps them (the flag wins when both
    /// are given).
    #[arg(long, value_name = "PATH")]
    pub config: Option<std::path::PathBuf>,
    /// Networks whose virtual servers and addresses belong to someone else and are kept,
    /// comma-separated (the same value as `run --exclude-cidrs`).
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub exclude_cidrs: Option<String>,
    /// The mark bits of the Local-policy short circuit's fwmark virtual servers, which are
    /// removed (the same value as `run --local-fwmark-mask`; other fwmark services are kept).
    #[arg(long, value_name = "MASK", default_value_t = MarkSpace::DEFAULT)]
    pub local_fwmark_mask: MarkSpace,
    /// Print what would be removed and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// The kernel operations that remove everything ours from `observed`: the full diff towards an
/// empty table, which leaves excluded, foreign and other firewall-mark entries (marks outside
/// `--local-fwmark-mask`) alone just as `run` does. Deleting a virtual server covers its real servers.
pub fn removal_ops(observed: &Table, owned: Ownership<'_>) -> Vec<Op> {
    full_diff(&Table::default(), observed, owned)
}

/// Whether the link can go once `removed` addresses are gone: only if none of someone else's
/// (inside the exclude CIDRs) remain. The kernel's own IPv6 link-local address is not counted
/// ([`observe::from_dump`] already leaves it out).
pub fn link_removable(observed: &Observed, removed: &[IpAddr]) -> bool {
    observed.interface_exists && observed.table.addresses.iter().all(|a| removed.contains(a))
}

fn parse_cidrs(v: Option<&str>) -> Result<Vec<Cidr>, String> {
    v.unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<Cidr>()
                .map_err(|e| format!("--exclude-cidrs {s:?}: {e}"))
        })
        .collect()
}

/// kube-proxy's `--cleanup` under kube-proxy's name: `cleanup` with the exclude CIDRs and mark
/// mask that `run` would use with the same flags and `--config` (exit 4 naming a bad setting).
pub fn as_kube_proxy(run: &crate::agent::RunArgs) -> ExitCode {
    let settings = match crate::agent::Settings::resolve(run) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kube-proxy --cleanup: {e}");
            return ExitCode::from(4);
        }
    };
    main(&CleanupArgs {
        config: None,
        exclude_cidrs: settings.source.exclude_cidrs.clone(),
        local_fwmark_mask: settings.node.options.local_marks.unwrap_or_default(),
        dry_run: false,
    })
}

/// The exclude CIDRs `cleanup` keeps: `--exclude-cidrs`, else `--config`'s
/// `ipvs.excludeCIDRs`, resolved as the debugging commands resolve the file
/// ([`crate::cmd::source::SourceArgs::with_config_file`]).
fn exclude_cidrs(args: &CleanupArgs) -> Result<Option<String>, String> {
    crate::cmd::source::SourceArgs {
        config: args.config.clone(),
        exclude_cidrs: args.exclude_cidrs.clone(),
        ..Default::default()
    }
    .with_config_file()
    .map(|s| s.exclude_cidrs)
    .map_err(|e| e.to_string())
}

/// Runs `kube-ipvs cleanup`.
pub fn main(args: &CleanupArgs) -> ExitCode {
    let exclude = match exclude_cidrs(args).and_then(|v| parse_cidrs(v.as_deref())) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kube-ipvs cleanup: {e}");
            return ExitCode::from(2);
        }
    };
    let verb = if args.dry_run {
        "would remove"
    } else {
        "removed"
    };
    let mut failed: Vec<String> = Vec::new();
    let (mut servers, mut addresses, mut chains, mut link) = (0usize, 0usize, 0usize, false);
    let mut sets = 0usize;

    let owned = Ownership {
        exclude: &exclude,
        marks: Some(args.local_fwmark_mask),
    };
    match ipvs_part(owned, args.dry_run, verb, &mut failed) {
        Ok((s, a, l)) => (servers, addresses, link) = (s, a, l),
        Err(e) => failed.push(e),
    }

    if args.dry_run {
        for (tool, found) in masquerade::saved_chains() {
            for c in &found {
                println!("{verb} iptables chain {c} ({tool})");
            }
            chains += found.len();
        }
        for set in masquerade::sets_present() {
            println!("{verb} ipset {set}");
            sets += 1;
        }
    } else {
        match masquerade::cleanup_everywhere(None) {
            Ok(removed) => {
                for r in removed {
                    for c in &r.chains {
                        println!("{verb} iptables chain {c} ({})", r.tool);
                    }
                    if r.jumps > 0 {
                        println!(
                            "{verb} {} jump rule(s) from built-in chains ({})",
                            r.jumps, r.tool
                        );
                    }
                    chains += r.chains.len();
                }
            }
            Err(e) => failed.push(format!("iptables: {e}")),
        }
        // After the rules: the kernel refuses to destroy a set a rule still references.
        match masquerade::cleanup_sets() {
            Ok(removed) => {
                for set in &removed {
                    println!("{verb} ipset {set}");
                }
                sets += removed.len();
            }
            Err(e) => failed.push(e.to_string()),
        }
    }

    println!(
        "{verb}: {}, {} on {DEFAULT_DUMMY}, {} link, {}, {}",
        count(servers, "IPVS virtual server", "IPVS virtual servers"),
        count(addresses, "address", "addresses"),
        if link { "its" } else { "no" },
        count(chains, "iptables chain", "iptables chains"),
        count(sets, "ipset", "ipsets")
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        for f in &failed {
            eprintln!("kube-ipvs cleanup: failed: {f}");
        }
        ExitCode::from(1)
    }
}

/// Removes (or lists) our virtual servers and addresses and the link; returns the counts.
fn ipvs_part(
    owned: Ownership<'_>,
    dry_run: bool,
    verb: &str,
    failed: &mut Vec<String>,
) -> Result<(usize, usize, bool), String> {
    let kernel = RealKernel::open(DEFAULT_DUMMY).map_err(|e| format!("opening netlink: {e}"))?;
    // Whichever way `run` made the service addresses local, both ways are ours to remove.
    let mut kernel = kernel.binding(Binding::Either);
    let observed = kernel
        .read()
        .map_err(|e| format!("reading the IPVS table and {DEFAULT_DUMMY}: {e}"))?;
    let ops = removal_ops(&observed.table, owned);
    let failures = if dry_run {
        Vec::new()
    } else {
        apply::apply(&mut kernel, &ops, &Owners::default())
    };
    let (mut servers, mut removed_addrs) = (0, Vec::new());
    for op in &ops {
        if let Some(f) = failures.iter().find(|f| &f.op == op) {
            failed.push(format!("{op}: {}", f.error));
            continue;
        }
        match op {
            Op::DeleteService(key) => {
                let dests = observed
                    .table
                    .services
                    .get(key)
                    .map_or(0, |e| e.dests.len());
                println!(
                    "{verb} IPVS virtual server {key} ({})",
                    count(dests, "real server", "real servers")
                );
                servers += 1;
            }
            Op::RemoveAddress(a) => {
                println!("{verb} address {a} (from {DEFAULT_DUMMY}, or its local route)");
                removed_addrs.push(*a);
            }
            other => println!("{verb}: {other}"),
        }
    }
    let mut link = false;
    if link_removable(&observed, &removed_addrs) {
        if dry_run {
            link = true;
        } else {
            match kernel.rtnl.delete_link(DEFAULT_DUMMY) {
                Ok(_) => link = true,
                Err(e) => failed.push(format!("deleting link {DEFAULT_DUMMY}: {e}")),
            }
        }
        if link {
            println!("{verb} link {DEFAULT_DUMMY}");
        }
    } else if observed.interface_exists {
        println!("kept link {DEFAULT_DUMMY}: it holds addresses inside --exclude-cidrs");
    }
    Ok((servers, removed_addrs.len(), link))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_ipvs_netlink::ipvs::{Destination, ForwardMethod, Service, ServiceKey};

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    #[test]
    fn the_config_file_gives_the_excluded_networks_unless_the_flag_does() {
        let (dir, file) = crate::agent::config::temp_config(
            "cleanup",
            "hostnameOverride: node-1\nipvs: {excludeCIDRs: [10.200.0.0/16, 10.201.0.0/16]}\n",
        );
        let mut args = CleanupArgs {
            config: Some(file.clone()),
            ..CleanupArgs::default()
        };
        assert_eq!(
            exclude_cidrs(&args).expect("valid file").as_deref(),
            Some("10.200.0.0/16,10.201.0.0/16")
        );
        args.exclude_cidrs = Some("10.9.0.0/16".into());
        assert_eq!(
            exclude_cidrs(&args).expect("valid file").as_deref(),
            Some("10.9.0.0/16")
        );
        args.config = Some(dir.join("missing.conf"));
        let err = exclude_cidrs(&args).expect_err("no such file");
        assert!(err.contains("missing.conf"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn removes_ours_and_keeps_excluded_fwmark_and_foreign_entries() {
        let ours = Service::new(ServiceKey::tcp(ip("10.96.0.10"), 80), "rr");
        let excluded = Service::new(ServiceKey::tcp(ip("10.200.0.1"), 80), "rr");
        let fwmark = Service::new(
            ServiceKey::Fwmark {
                family: kube_ipvs_netlink::ipvs::Family::Inet,
                mark: 7,
            },
            "rr",
        );
        let odd = Service::new(ServiceKey::udp(ip("10.96.0.11"), 53), "none");
        let d = Destination::new(ip("10.244.1.5"), 8080, ForwardMethod::Masq);
        let observed = crate::kernel::observe::from_dump(
            &[
                (ours, vec![d.clone()]),
                (excluded, vec![d]),
                (fwmark, vec![]),
                (odd, vec![]),
            ],
            Some(vec![ip("10.96.0.10"), ip("10.200.0.1")]),
        );
        let exclude = parse_cidrs(Some("10.200.0.0/16")).expect("cidr");
        // Mark 7 is not in the default mark space.
        let owned = Ownership {
            exclude: &exclude,
            marks: Some(MarkSpace::DEFAULT),
        };
        let ops = removal_ops(&observed.table, owned);
        let text: Vec<String> = ops.iter().map(ToString::to_string).collect();
        assert_eq!(ops.len(), 2, "{text:?}");
        assert!(matches!(&ops[0], Op::DeleteService(k) if k.to_string().contains("10.96.0.10:80")));
        assert_eq!(ops[1], Op::RemoveAddress(ip("10.96.0.10")));
        assert!(
            !link_removable(&observed, &[ip("10.96.0.10")]),
            "10.200.0.1 is someone else's"
        );
        let all = removal_ops(&observed.table, Ownership::default());
        assert_eq!(
            all.len(),
            4,
            "without excludes: both servers and both addresses"
        );
        assert!(link_removable(
            &observed,
            &[ip("10.96.0.10"), ip("10.200.0.1")]
        ));
        assert!(parse_cidrs(Some("10.0.0.0/33")).is_err());
    }
}
