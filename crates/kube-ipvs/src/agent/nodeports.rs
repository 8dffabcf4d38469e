//! Which of the node's addresses NodePorts listen on (kube-proxy's `nodePortAddresses`), and
//! which addresses are never bound to `kube-ipvs0` because another interface holds them.
//!
//! kube-proxy's IPVS mode decides per family: a family with no network in the setting takes
//! every local address of that family (not `kube-ipvs0`'s, not loopback, not IPv6
//! link-local); a family with networks takes the local addresses inside them. `primary` is the
//! network of one address, the Node's first InternalIP of each family, so a family whose
//! primary address is not known yet takes every address: the first sync waits for the Node
//! (`kube_ipvs_watch::WatchConfig::node_wait`). The agent, `check` and `plan` all use
//! [`apply`], so they agree on the table.

use std::net::IpAddr;

use kube_ipvs_diff::{Cidr, NodeContext};

/// The parsed setting.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePortAddresses {
    cidrs: Vec<Cidr>,
    primary: bool,
}

/// An entry of the setting that is neither a network nor a keyword.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry:?}: {reason}")]
pub struct BadEntry {
    /// The entry as written.
    pub entry: String,
    /// Why it was refused.
    pub reason: String,
}

impl NodePortAddresses {
    /// Parses kube-proxy's list: networks and the keywords `primary`, `all` (every address of
    /// both families) and `localhost` (loopback, which IPVS cannot serve NodePorts on, so the
    /// family it names gets none). Empty entries are skipped.
    pub fn parse<'a>(entries: impl IntoIterator<Item = &'a str>) -> Result<Self, BadEntry> {
        let mut out = Self::default();
        for entry in entries.into_iter().map(str::trim).filter(|e| !e.is_empty()) {
            let literal = |s: &str| s.parse::<Cidr>().expect("a literal network");
            match entry {
                "primary" => out.primary = true,
                "all" => out.cidrs.extend([literal("0.0.0.0/0"), literal("::/0")]),
                "localhost" => out
                    .cidrs
                    .extend([literal("127.0.0.0/8"), literal("::1/128")]),
                other => out
                    .cidrs
                    .push(other.parse().map_err(|e: kube_ipvs_diff::Error| BadEntry {
                        entry: other.to_owned(),
                        reason: e.to_string(),
                    })?),
            }
        }
        Ok(out)
    }

    /// Whether the choice depends on the Node object (`primary`).
    pub fn uses_node(&self) -> bool {
        self.primary
    }

    /// The networks the setting names in one family.
    fn family(&self, v6: bool) -> impl Iterator<Item = &Cidr> {
        self.cidrs.iter().filter(move |c| c.addr().is_ipv6() == v6)
    }

    /// Whether the choice names loopback networks only in some family (`localhost`): that
    /// family gets no NodePort address at all, which deserves a warning.
    pub fn loopback_only(&self) -> bool {
        [false, true].into_iter().any(|v6| {
            let mut own = self.family(v6).peekable();
            own.peek().is_some() && own.all(|c| c.addr().is_loopback())
        })
    }

    /// The NodePort addresses among the node's `local` ones, `primary` being the Node's
    /// addresses (its InternalIPs; the first of each family counts). Sorted, unique.
    pub fn select(&self, local: &[IpAddr], primary: &[IpAddr]) -> Vec<IpAddr> {
        // Per family: the Node's primary address (with `primary`), and whether the family is
        // unfiltered (no network and no primary address).
        let per_family = [false, true].map(|v6| {
            let mine = primary
                .iter()
                .copied()
                .find(|p| p.is_ipv6() == v6)
                .filter(|_| self.primary);
            let all = mine.is_none() && self.family(v6).next().is_none();
            (mine, all)
        });
        let mut out: Vec<IpAddr> = local
            .iter()
            .copied()
            .filter(|a| !a.is_loopback() && !kube_ipvs_diff::is_link_local(*a))
            .filter(|a| {
                let (mine, all) = per_family[usize::from(a.is_ipv6())];
                all || mine == Some(*a) || self.family(a.is_ipv6()).any(|c| c.contains(*a))
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Sets the NodePort addresses and the held addresses of `ctx`: `fixed` (`--node-ip`) when
/// given, else the choice among `local` (the node's addresses, not `kube-ipvs0`'s) with the
/// Node's `primary` addresses. Says whether `ctx` changed.
pub fn apply(
    ctx: &mut NodeContext,
    how: &NodePortAddresses,
    fixed: &[IpAddr],
    local: &[IpAddr],
    primary: &[IpAddr],
) -> bool {
    let chosen = if fixed.is_empty() {
        how.select(local, primary)
    } else {
        let mut f = fixed.to_vec();
        f.sort_unstable();
        f.dedup();
        f
    };
    let mut held = local.to_vec();
    held.sort_unstable();
    held.dedup();
    let mut before: Vec<IpAddr> = ctx.node_ips().collect();
    before.sort_unstable();
    if before == chosen && ctx.held_addresses == held {
        return false;
    }
    ctx.set_node_ips(chosen);
    ctx.held_addresses = held;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|a| a.parse().expect("literal")).collect()
    }

    fn parse(list: &[&str]) -> NodePortAddresses {
        NodePortAddresses::parse(list.iter().copied()).expect("valid")
    }

    const LOCAL: &[&str] = &[
        "192.168.56.10",
        "10.0.2.15",
        "172.17.0.1",
        "2001:db8::10",
        "fe80::1",
        "127.0.0.1",
        "::1",
    ];

    #[test]
    fn unset_takes_every_local_address_but_loopback_and_link_local() {
        let got = parse(&[]).select(&ips(LOCAL), &[]);
        assert_eq!(
            got,
            ips(&["10.0.2.15", "172.17.0.1", "192.168.56.10", "2001:db8::10"])
        );
    }

    #[test]
    fn networks_of_one_family_leave_the_other_family_unfiltered() {
        // kube-proxy's per-family proxiers: a family the setting names no network of
        // takes all its addresses (kube-proxy warns about this; so does `run`).
        let got = parse(&["192.168.56.0/24"]).select(&ips(LOCAL), &[]);
        assert_eq!(got, ips(&["192.168.56.10", "2001:db8::10"]));
    }

    #[test]
    fn primary_is_the_nodes_first_address_of_each_family_if_local() {
        let how = parse(&["primary"]);
        assert!(how.uses_node());
        let primary = ips(&["192.168.56.10", "192.168.56.11", "2001:db8::99"]);
        // The v6 primary is not a local address: nothing of that family.
        assert_eq!(how.select(&ips(LOCAL), &primary), ips(&["192.168.56.10"]));
        // Before the Node is known, every address (why the first sync waits for it).
        assert_eq!(how.select(&ips(LOCAL), &[]).len(), 4);
    }

    #[test]
    fn keywords_all_and_localhost() {
        assert_eq!(parse(&["all"]).select(&ips(LOCAL), &[]).len(), 4);
        let lo = parse(&["localhost"]);
        assert!(lo.loopback_only());
        assert!(lo.select(&ips(LOCAL), &[]).is_empty());
        assert!(!parse(&["10.0.0.0/8"]).loopback_only());
    }

    #[test]
    fn a_bad_entry_is_named() {
        let e = NodePortAddresses::parse(["10.0.0.0/8", "eth0"]).expect_err("not a network");
        assert_eq!(e.entry, "eth0");
    }

    #[test]
    fn apply_prefers_fixed_addresses_and_records_what_other_interfaces_hold() {
        let mut ctx = NodeContext::new("node-1");
        let changed = apply(
            &mut ctx,
            &parse(&[]),
            &ips(&["192.168.56.10"]),
            &ips(&["192.168.56.10", "10.0.2.15"]),
            &[],
        );
        assert!(changed);
        assert_eq!(ctx.node_ips().collect::<Vec<_>>(), ips(&["192.168.56.10"]));
        assert_eq!(ctx.held_addresses, ips(&["10.0.2.15", "192.168.56.10"]));
        let again = apply(
            &mut ctx,
            &parse(&[]),
            &ips(&["192.168.56.10"]),
            &ips(&["10.0.2.15", "192.168.56.10"]),
            &[],
        );
        assert!(!again, "the same addresses in another order change nothing");
    }
}
