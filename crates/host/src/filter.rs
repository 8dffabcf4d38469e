//! The `filter` table rules: what kube-proxy's IPVS mode does with `KUBE-IPVS-FILTER`,
//! `KUBE-FORWARD`, `KUBE-NODE-PORT` and `KUBE-PROXY-FIREWALL`, under our own chain and set names,
//! with a rule count that does not depend on the number of Services.
//!
//! # What the rules do
//!
//! IPVS takes a packet to a virtual server in the `LOCAL_IN` hook at priority 98 (`ip_vs_in`),
//! after the `filter` table's `INPUT` chain (priority 0). A packet to an address bound to
//! `kube-ipvs0` on a port that is no virtual server is not taken by IPVS and is delivered to
//! whatever local socket listens on that port: without a filter, every host daemon listening on
//! `0.0.0.0` (sshd, the kubelet) answers on every ClusterIP (kubernetes issue 72236). So
//! [`INPUT_CHAIN`], jumped to first from `INPUT`:
//!
//! 1. sends packets to a load-balancer address and port with `loadBalancerSourceRanges`
//!    ([`crate::sets::ServiceSet::LbFirewall`]) through [`SOURCE_RANGES_CHAIN`], which lets through sources in
//!    a range ([`crate::sets::ServiceSet::LbSources`], `dst,dst,src`) and the node itself (`--src-type LOCAL`,
//!    kube-proxy's rule that a node may always reach its own load-balancer addresses) and drops
//!    the rest;
//! 2. accepts packets to a virtual server, NodePorts included ([`crate::sets::ServiceSet::Services`],
//!    `dst,dst`), so a host whose `INPUT` policy is `DROP` still serves its Services;
//! 3. accepts TCP to a `healthCheckNodePort` on a local address ([`crate::sets::ServiceSet::HealthCheckPorts`]);
//! 4. rejects new connections to any other port of a `kube-ipvs0` address
//!    ([`crate::sets::ServiceSet::Addresses`]).
//!
//! [`FORWARD_CHAIN`], jumped to first from `FORWARD`, accepts packets carrying the masquerade
//! mark and packets of established connections: the replies of a real server on another host
//! (or in a local Pod) to a client elsewhere pass `FORWARD` before IPVS rewrites them, and die on
//! a host whose `FORWARD` policy is `DROP` (Docker sets it) without this.
//!
//! # Why the rule count is constant
//!
//! Every Service-dependent fact is a member of an ipset, kept over netlink by the caller
//! ([`kube_ipvs_netlink::nfnl::ipset`]): a Service change is a set delta, never a rule rewrite.
//! The sets ([`crate::sets`]) must exist before the rules reference them and outlive them.

use kube_ipvs_netlink::Family;

use crate::sets::ServiceSet;

/// Our chain jumped to first from `INPUT`.
pub const INPUT_CHAIN: &str = "KUBE-IPVS-INPUT";
/// Our chain jumped to first from `FORWARD`.
pub const FORWARD_CHAIN: &str = "KUBE-IPVS-FORWARD";
/// Our chain enforcing `loadBalancerSourceRanges`, jumped to from [`INPUT_CHAIN`].
pub const SOURCE_RANGES_CHAIN: &str = "KUBE-IPVS-SOURCE-RANGES";
/// Our chains in the `filter` table.
pub const CHAINS: [&str; 3] = [INPUT_CHAIN, FORWARD_CHAIN, SOURCE_RANGES_CHAIN];
/// The comment on the jump from `INPUT`, by which it is found again.
pub const INPUT_COMMENT: &str = "kube-ipvs service filter";
/// The comment on the jump from `FORWARD`.
pub const FORWARD_COMMENT: &str = "kube-ipvs service forwarding";
/// The jumps from built-in chains: (built-in chain, our chain, comment).
pub const JUMPS: [(&str, &str, &str); 2] = [
    ("INPUT", INPUT_CHAIN, INPUT_COMMENT),
    ("FORWARD", FORWARD_CHAIN, FORWARD_COMMENT),
];

/// The `*filter` section of the `iptables-restore --noflush` input for one family: our chains
/// declared (which empties them and only them), their rules, and each jump of [`JUMPS`] whose
/// `add_jump` entry is true, inserted first in its built-in chain. `mark` is the masquerade
/// mark bit's value.
pub fn restore_section(family: Family, mark: u32, add_jump: [bool; 2]) -> String {
    let set = |s: ServiceSet| s.name(family);
    let rules = [
        format!(
            "-A {INPUT_CHAIN} -m set --match-set {} dst,dst -j {SOURCE_RANGES_CHAIN}",
            set(ServiceSet::LbFirewall)
        ),
        format!(
            "-A {INPUT_CHAIN} -m set --match-set {} dst,dst -m comment --comment \"service port\" -j ACCEPT",
            set(ServiceSet::Services)
        ),
        format!(
            "-A {INPUT_CHAIN} -p tcp -m addrtype --dst-type LOCAL -m set --match-set {} dst -m comment --comment \"health check node port\" -j ACCEPT",
            set(ServiceSet::HealthCheckPorts)
        ),
        format!(
            "-A {INPUT_CHAIN} -m set --match-set {} dst -m conntrack --ctstate NEW -m comment --comment \"no service on this port\" -j REJECT",
            set(ServiceSet::Addresses)
        ),
        format!(
            "-A {SOURCE_RANGES_CHAIN} -m set --match-set {} dst,dst,src -j RETURN",
            set(ServiceSet::LbSources)
        ),
        format!("-A {SOURCE_RANGES_CHAIN} -m addrtype --src-type LOCAL -j RETURN"),
        format!(
            "-A {SOURCE_RANGES_CHAIN} -m comment --comment \"outside loadBalancerSourceRanges\" -j DROP"
        ),
        format!(
            "-A {FORWARD_CHAIN} -m mark --mark {mark:#x}/{mark:#x} -m comment --comment \"masquerade-marked\" -j ACCEPT"
        ),
        format!(
            "-A {FORWARD_CHAIN} -m conntrack --ctstate RELATED,ESTABLISHED -m comment --comment \"established\" -j ACCEPT"
        ),
    ];
    let mut r = crate::masquerade::section_head("filter", &CHAINS, &JUMPS, &add_jump);
    for rule in rules {
        r.push_str(&rule);
        r.push('\n');
    }
    r.push_str("COMMIT\n");
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_are_the_same_whatever_the_services() {
        // The section takes no Service input at all: its size is fixed. This pins its order,
        // which is its meaning (source ranges before the accept, the reject last).
        let r = restore_section(Family::V4, 0x4000, [true, false]);
        let lines: Vec<&str> = r.lines().collect();
        assert_eq!(
            lines,
            [
                "*filter",
                ":KUBE-IPVS-INPUT - [0:0]",
                ":KUBE-IPVS-FORWARD - [0:0]",
                ":KUBE-IPVS-SOURCE-RANGES - [0:0]",
                "-I INPUT -m comment --comment \"kube-ipvs service filter\" -j KUBE-IPVS-INPUT",
                "-A KUBE-IPVS-INPUT -m set --match-set KUBE-IPVS-LB-FW dst,dst -j KUBE-IPVS-SOURCE-RANGES",
                "-A KUBE-IPVS-INPUT -m set --match-set KUBE-IPVS-SERVICES dst,dst -m comment --comment \"service port\" -j ACCEPT",
                "-A KUBE-IPVS-INPUT -p tcp -m addrtype --dst-type LOCAL -m set --match-set KUBE-IPVS-HC-PORTS dst -m comment --comment \"health check node port\" -j ACCEPT",
                "-A KUBE-IPVS-INPUT -m set --match-set KUBE-IPVS-ADDRS dst -m conntrack --ctstate NEW -m comment --comment \"no service on this port\" -j REJECT",
                "-A KUBE-IPVS-SOURCE-RANGES -m set --match-set KUBE-IPVS-LB-SRC dst,dst,src -j RETURN",
                "-A KUBE-IPVS-SOURCE-RANGES -m addrtype --src-type LOCAL -j RETURN",
                "-A KUBE-IPVS-SOURCE-RANGES -m comment --comment \"outside loadBalancerSourceRanges\" -j DROP",
                "-A KUBE-IPVS-FORWARD -m mark --mark 0x4000/0x4000 -m comment --comment \"masquerade-marked\" -j ACCEPT",
                "-A KUBE-IPVS-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -m comment --comment \"established\" -j ACCEPT",
                "COMMIT",
            ]
        );
        // IPv6 names its own sets; the port set is shared.
        let r6 = restore_section(Family::V6, 1, [false, true]);
        assert!(r6.contains("KUBE-IPVS-SERVICES6 dst,dst"));
        assert!(r6.contains("KUBE-IPVS-LB-SRC6 dst,dst,src"));
        assert!(r6.contains("KUBE-IPVS-HC-PORTS dst"));
        assert!(r6.contains("-I FORWARD -m comment"));
        assert!(!r6.contains("-I INPUT"));
        assert!(r6.contains("--mark 0x1/0x1"));
    }
}
