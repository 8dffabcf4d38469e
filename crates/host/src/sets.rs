//! The ipsets the `filter` rules ([`crate::filter`]) and the `nat` and `mangle` marking rules
//! ([`crate::masquerade`]) match: every Service-dependent fact those rules need is a member of
//! one of these sets, so the rules themselves never change with the Services. The caller keeps
//! the members over netlink ([`kube_ipvs_netlink::nfnl::ipset`]); the hairpin sets are
//! [`kube_ipvs_netlink::nfnl::ipset::SET_V4`] and `SET_V6`.

use kube_ipvs_netlink::Family;
use kube_ipvs_netlink::nfnl::ipset::SetKind;

/// The sets the `filter` and `nat` rules match; their members are kept by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServiceSet {
    /// `hash:ip,port`: every virtual server (address, protocol, port), NodePorts included.
    Services,
    /// `hash:ip`: every address bound to `kube-ipvs0`.
    Addresses,
    /// `hash:ip,port`: the load-balancer virtual servers of Services with
    /// `loadBalancerSourceRanges`.
    LbFirewall,
    /// `hash:ip,port,net`: (load-balancer address, protocol, port, allowed source range).
    LbSources,
    /// `bitmap:port`, both families: the `healthCheckNodePort`s this node serves.
    HealthCheckPorts,
    /// `hash:ip,port`: the ClusterIP virtual servers, masqueraded unless the client is local
    /// (`detectLocalMode`) or always with `--masquerade-all`.
    ClusterIps,
    /// `hash:ip,port`: the external-IP, load-balancer and NodePort virtual servers of Services
    /// with `externalTrafficPolicy: Cluster`, always masqueraded (replies must come back
    /// through this node). Those of Local-policy Services are in no masquerade set: they keep
    /// the client's address.
    External,
    /// `hash:ip,port` with a mark per member: the external-IP, load-balancer and NodePort
    /// virtual servers of `externalTrafficPolicy: Local` Services, each mapped to the firewall
    /// mark of the fwmark virtual server that holds the Service's cluster-wide endpoints. The
    /// `mangle` rules ([`crate::masquerade`]) give that mark to new connections from this
    /// node's Pods and from the node itself, so they reach any endpoint while external clients
    /// keep the Local policy.
    LocalMarks,
}

impl ServiceSet {
    /// Every filter set.
    pub const ALL: [ServiceSet; 8] = [
        Self::Services,
        Self::Addresses,
        Self::LbFirewall,
        Self::LbSources,
        Self::HealthCheckPorts,
        Self::ClusterIps,
        Self::External,
        Self::LocalMarks,
    ];

    /// The set's name for `family` (the port set has one name for both).
    #[must_use]
    pub fn name(self, family: Family) -> &'static str {
        match (self, family) {
            (Self::Services, Family::V4) => "KUBE-IPVS-SERVICES",
            (Self::Services, Family::V6) => "KUBE-IPVS-SERVICES6",
            (Self::Addresses, Family::V4) => "KUBE-IPVS-ADDRS",
            (Self::Addresses, Family::V6) => "KUBE-IPVS-ADDRS6",
            (Self::LbFirewall, Family::V4) => "KUBE-IPVS-LB-FW",
            (Self::LbFirewall, Family::V6) => "KUBE-IPVS-LB-FW6",
            (Self::LbSources, Family::V4) => "KUBE-IPVS-LB-SRC",
            (Self::LbSources, Family::V6) => "KUBE-IPVS-LB-SRC6",
            (Self::HealthCheckPorts, _) => "KUBE-IPVS-HC-PORTS",
            (Self::ClusterIps, Family::V4) => "KUBE-IPVS-CLUSTER-IPS",
            (Self::ClusterIps, Family::V6) => "KUBE-IPVS-CLUSTER-IPS6",
            (Self::External, Family::V4) => "KUBE-IPVS-EXTERNAL",
            (Self::External, Family::V6) => "KUBE-IPVS-EXTERNAL6",
            (Self::LocalMarks, Family::V4) => "KUBE-IPVS-LOCAL-MARKS",
            (Self::LocalMarks, Family::V6) => "KUBE-IPVS-LOCAL-MARKS6",
        }
    }

    /// The set's type.
    #[must_use]
    pub fn kind(self) -> SetKind {
        match self {
            Self::Services | Self::LbFirewall | Self::ClusterIps | Self::External => {
                SetKind::IpPort
            }
            Self::Addresses => SetKind::Ip,
            Self::LbSources => SetKind::IpPortNet,
            Self::HealthCheckPorts => SetKind::Port,
            Self::LocalMarks => SetKind::IpPortMark,
        }
    }

    /// The families the set exists for: one set for both when it holds ports only.
    #[must_use]
    pub fn families(self) -> &'static [Family] {
        match self {
            Self::HealthCheckPorts => &[Family::V4],
            _ => &[Family::V4, Family::V6],
        }
    }
}

/// Every set as (name, family, kind), in creation order.
pub fn sets() -> impl Iterator<Item = (&'static str, Family, SetKind)> {
    ServiceSet::ALL
        .into_iter()
        .flat_map(|s| s.families().iter().map(move |&f| (s.name(f), f, s.kind())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_set_has_a_name_of_its_own_that_ipset_takes() {
        let names: Vec<&str> = sets().map(|(n, _, _)| n).collect();
        assert_eq!(names.len(), 15);
        let unique: std::collections::BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        for n in names {
            assert!(n.len() < 32, "{n} is too long for an ipset name");
        }
    }
}
