//! What kube-proxy's IPVS mode leaves on a node, and its removal when kube-ipvs takes over.
//!
//! kube-proxy (`pkg/proxy/ipvs`) writes its own `nat` and `filter` chains and ipsets beside the
//! IPVS table and `kube-ipvs0` (which kube-ipvs adopts). Left behind after the swap they keep
//! acting on every packet, and go wrong as soon as Services change: `KUBE-IPVS-FILTER` rejects
//! new connections to `kube-ipvs0` addresses missing from its stale `KUBE-IPVS-IPS` set (every
//! new Service's ClusterIP), `KUBE-SERVICES` marks by stale sets. [`remove`] deletes exactly the
//! chains and jumps kube-proxy's own `CleanupLeftovers` deletes for IPVS mode (in every backend
//! and family) and its ipsets (IPv4 names and their `KUBE-6-` IPv6 twins), nothing else: no
//! chain another component shares (`KUBE-FIREWALL`, `KUBE-KUBELET-CANARY`, ...), and neither the
//! IPVS table nor `kube-ipvs0`, which kube-ipvs manages itself.

use std::path::Path;

use crate::masquerade::{self, Removed, Result, Table};

/// kube-proxy's IPVS-mode chains in `nat`.
pub const NAT_CHAINS: [&str; 5] = [
    "KUBE-SERVICES",
    "KUBE-POSTROUTING",
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-MARK-MASQ",
];

/// kube-proxy's IPVS-mode chains in `filter`.
pub const FILTER_CHAINS: [&str; 6] = [
    "KUBE-FORWARD",
    "KUBE-NODE-PORT",
    "KUBE-PROXY-FIREWALL",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

const NAT: Table = Table {
    name: "nat",
    chains: &NAT_CHAINS,
    jump_targets: &["KUBE-SERVICES", "KUBE-POSTROUTING"],
};

const FILTER: Table = Table {
    name: "filter",
    chains: &FILTER_CHAINS,
    jump_targets: &[
        "KUBE-FORWARD",
        "KUBE-NODE-PORT",
        "KUBE-PROXY-FIREWALL",
        "KUBE-IPVS-FILTER",
        "KUBE-IPVS-OUT-FILTER",
    ],
};

/// kube-proxy's IPVS-mode ipsets (`pkg/proxy/ipvs/ipset.go`; the SCTP bitmaps of older
/// versions too), IPv4 names then the IPv6 ones (`KUBE-` becomes `KUBE-6-`, cut to 31 bytes).
pub const SETS: [&str; 38] = [
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
    "KUBE-NODE-PORT-SCTP",
    "KUBE-NODE-PORT-LOCAL-SCTP",
    "KUBE-6-LOOP-BACK",
    "KUBE-6-CLUSTER-IP",
    "KUBE-6-EXTERNAL-IP",
    "KUBE-6-EXTERNAL-IP-LOCAL",
    "KUBE-6-LOAD-BALANCER",
    "KUBE-6-LOAD-BALANCER-LOCAL",
    "KUBE-6-LOAD-BALANCER-FW",
    "KUBE-6-LOAD-BALANCER-SOURCE-IP",
    // Truncated to ipset's 31 bytes, as kube-proxy truncates it.
    "KUBE-6-LOAD-BALANCER-SOURCE-CID",
    "KUBE-6-NODE-PORT-TCP",
    "KUBE-6-NODE-PORT-LOCAL-TCP",
    "KUBE-6-NODE-PORT-UDP",
    "KUBE-6-NODE-PORT-LOCAL-UDP",
    "KUBE-6-NODE-PORT-SCTP-HASH",
    "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS",
    "KUBE-6-HEALTH-CHECK-NODE-PORT",
    "KUBE-6-IPVS-IPS",
    "KUBE-6-NODE-PORT-SCTP",
    "KUBE-6-NODE-PORT-LOCAL-SCTP",
];

/// What [`remove`] found and removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// Per backend and family that had any: the tool, the jumps and the chains removed.
    pub rules: Vec<Removed>,
    /// The ipsets destroyed.
    pub sets: Vec<&'static str>,
}

impl Leftovers {
    /// Whether nothing of kube-proxy's was there.
    pub fn is_empty(&self) -> bool {
        self.sets.is_empty()
            && self
                .rules
                .iter()
                .all(|r| r.jumps == 0 && r.chains.is_empty())
    }
}

/// Removes kube-proxy's IPVS-mode chains (after the jumps to them) from every installed backend
/// and family, then its ipsets (which the kernel lets go once no rule references them).
pub fn remove(bin_dir: Option<&Path>) -> Result<Leftovers> {
    let rules = masquerade::tables_everywhere(bin_dir, &[&NAT, &FILTER])?
        .into_iter()
        .filter(|r| r.jumps > 0 || !r.chains.is_empty())
        .collect();
    let sets = masquerade::destroy_sets(SETS)?;
    Ok(Leftovers { rules, sets })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `iptables-save -t nat` and `-t filter` of a node running kube-proxy's IPVS mode (trimmed),
    /// with kubelet's and our own chains beside them.
    const NAT_SAVE: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-LOAD-BALANCER - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-NODE-PORT - [0:0]\n\
:KUBE-POSTROUTING - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-IPVS-POSTROUTING - [0:0]\n\
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
-A POSTROUTING -m comment --comment \"kube-ipvs service traffic requiring SNAT\" -j KUBE-IPVS-POSTROUTING\n\
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ\n-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\nCOMMIT\n";

    #[test]
    fn only_kube_proxys_jumps_and_chains_are_removed() {
        let (input, removed) = masquerade::cleanup_input(NAT_SAVE, &NAT);
        assert_eq!(removed.jumps, 3);
        assert_eq!(
            removed.chains,
            [
                "KUBE-SERVICES",
                "KUBE-POSTROUTING",
                "KUBE-NODE-PORT",
                "KUBE-LOAD-BALANCER",
                "KUBE-MARK-MASQ"
            ]
        );
        assert!(input.contains(
            "-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n"
        ));
        assert!(input.contains("-D POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n"));
        assert!(
            !input.contains("KUBE-IPVS-POSTROUTING"),
            "ours stays: {input}"
        );
        assert!(
            !input.contains("KUBE-KUBELET-CANARY"),
            "kubelet's stays: {input}"
        );
        assert!(input.contains("-F KUBE-MARK-MASQ\n") && input.contains("-X KUBE-MARK-MASQ\n"));
        // Nothing of kube-proxy's: nothing to do.
        let (_, none) = masquerade::cleanup_input("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n", &NAT);
        assert_eq!((none.jumps, none.chains.len()), (0, 0));
    }

    #[test]
    fn the_lists_are_kube_proxys_and_never_ours() {
        let ours: Vec<&str> = masquerade::all_sets().collect();
        for set in SETS {
            assert!(!ours.contains(&set), "{set} is ours");
            assert!(set.len() < 32, "{set} is too long for an ipset name");
        }
        // Every IPv4 name has its IPv6 twin.
        let (v4, v6) = SETS.split_at(SETS.len() / 2);
        for (a, b) in v4.iter().zip(v6) {
            let mut twin = a.replacen("KUBE-", "KUBE-6-", 1);
            twin.truncate(31);
            assert_eq!(twin, *b);
        }
        for chain in NAT_CHAINS.iter().chain(&FILTER_CHAINS) {
            assert!(!chain.starts_with("KUBE-IPVS-") || chain.ends_with("FILTER"));
        }
    }
}
