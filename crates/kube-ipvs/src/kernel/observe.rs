//! The kernel as the diff engine's observed [`Table`]: a dump of the IPVS table and the
//! addresses on `kube-ipvs0` (read by [`super::RealKernel`]) turned into the engine's types.
//!
//! Everything is read; nothing is filtered here. Deciding what the engine owns (exclude CIDRs,
//! fwmark services) is the engine's job (`full_diff` and `Engine::resync` take the exclude
//! list), so plan and check see the same table the daemon would. Entries the engine cannot
//! represent (an unknown scheduler, an odd protocol) are listed as foreign instead of failing
//! the read.

use kube_ipvs_diff::Table;

use super::convert::{ForeignEntry, entry_from_kernel};

/// What the kernel holds, in the engine's terms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Virtual servers, real servers and `kube-ipvs0` addresses.
    pub table: Table,
    /// Kernel entries the engine cannot represent; never touched.
    pub foreign: Vec<ForeignEntry>,
    /// Whether the dummy interface exists at all.
    pub interface_exists: bool,
}

/// Builds the observed table from a dump (`Ipvs::table()`) and the interface's addresses
/// (`None` when the interface does not exist). Pure, so it is tested without a kernel.
pub fn from_dump(
    dump: &[(
        kube_ipvs_netlink::ipvs::Service,
        Vec<kube_ipvs_netlink::ipvs::Destination>,
    )],
    addresses: Option<Vec<std::net::IpAddr>>,
) -> Observed {
    let mut out = Observed::default();
    for (svc, dests) in dump {
        out.add(svc, dests);
    }
    out.set_addresses(addresses);
    out
}

impl Observed {
    /// Adds one virtual server with its real servers, as the engine's entry or as foreign, and
    /// returns its key if it is the engine's. The kernel's reader adds each as soon as its real
    /// servers are read, so a whole dump (about 260 bytes a real server, tens of MiB at 10,000
    /// Services) is never held at once.
    pub fn add(
        &mut self,
        svc: &kube_ipvs_netlink::ipvs::Service,
        dests: &[kube_ipvs_netlink::ipvs::Destination],
    ) -> Option<kube_ipvs_diff::VirtualKey> {
        match entry_from_kernel(svc, dests) {
            Ok(entry) => {
                let key = entry.server.key;
                self.table.services.insert(key, entry);
                Some(key)
            }
            Err(f) => {
                self.foreign.push(f);
                None
            }
        }
    }

    /// Sets the interface's addresses (`None` when the interface does not exist).
    pub fn set_addresses(&mut self, addresses: Option<Vec<std::net::IpAddr>>) {
        self.interface_exists = addresses.is_some();
        // The kernel gives an interface that is up an IPv6 link-local address of its own; the
        // engine never binds one, so it is not service state and must not be "repaired" away.
        self.table.addresses = addresses
            .into_iter()
            .flatten()
            .filter(|a| !(a.is_ipv6() && kube_ipvs_diff::is_link_local(*a)))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_ipvs_netlink::ipvs::{Destination, ForwardMethod, Service, ServiceKey};

    #[test]
    fn dump_becomes_a_table_and_foreign_entries_are_listed() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("literal");
        let ours = Service::new(ServiceKey::tcp(ip("10.96.0.10"), 80), "rr");
        let theirs = Service::new(ServiceKey::udp(ip("10.96.0.11"), 53), "none");
        let d = Destination::new(ip("10.244.1.5"), 8080, ForwardMethod::Masq);
        let obs = from_dump(
            &[(ours, vec![d]), (theirs, vec![])],
            Some(vec![ip("10.96.0.10"), ip("fe80::1c2a:ff:fe00:1")]),
        );
        assert_eq!(
            obs.table.addresses.iter().copied().collect::<Vec<_>>(),
            vec![ip("10.96.0.10")],
            "the kernel's own link-local address is not service state"
        );
        assert_eq!(obs.table.services.len(), 1);
        assert_eq!(obs.table.dest_count(), 1);
        assert_eq!(obs.foreign.len(), 1);
        assert!(obs.foreign[0].to_string().contains("UDP 10.96.0.11:53"));
        assert!(obs.interface_exists);
        assert!(!from_dump(&[], None).interface_exists);
    }
}
