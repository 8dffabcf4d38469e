//! Order-independent fingerprints of sets, so a reconcile can tell that nothing drifted without
//! walking the whole desired state on the sync loop.
//!
//! A [`Fingerprint`] is the number of elements and the wrapping sum of one 64-bit hash per
//! element. Sums commute, so the fingerprint of what the engine asks for is kept up to date as
//! Services change (take away what went, add what came), and the fingerprint of a kernel dump is
//! worked out on the thread that read it. Unequal fingerprints always mean the sets differ;
//! equal ones mean they are equal unless two different sets' sums collide, a chance of about one
//! in 2^64 for each comparison of sets that differ.
//!
//! A table's elements ([`Fingerprint::of_table`], [`Engine::fingerprint`](crate::Engine)) are
//! its virtual servers, each real server with its virtual server's key, and its addresses:
//! exactly what [`full_diff`](crate::full_diff) compares, so equal fingerprints mean an empty
//! diff.

use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;

use foldhash::quality::FixedState;

use crate::table::{Ownership, RealServer, Table, VirtualKey, VirtualServer};

/// The seed of the element hash: any fixed value; both sides of a comparison are this process.
const SEED: u64 = 0x6b75_6265_2d69_7076;

/// The element count and the wrapping sum of the elements' hashes of a set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fingerprint {
    count: u64,
    sum: u64,
}

/// What kind of table element a hash is of, so a value of one kind never stands for another.
#[derive(Hash)]
enum Element<'a> {
    Server(&'a VirtualServer),
    Dest(&'a VirtualKey, &'a RealServer),
    Address(IpAddr),
}

impl Fingerprint {
    fn hash(value: &impl Hash) -> u64 {
        FixedState::with_seed(SEED).hash_one(value)
    }

    /// Adds one element.
    pub fn insert(&mut self, value: &impl Hash) {
        self.count = self.count.wrapping_add(1);
        self.sum = self.sum.wrapping_add(Self::hash(value));
    }

    /// Takes away one element added before.
    pub fn remove(&mut self, value: &impl Hash) {
        self.count = self.count.wrapping_sub(1);
        self.sum = self.sum.wrapping_sub(Self::hash(value));
    }

    /// Adds the elements of `other`.
    pub fn add(&mut self, other: Self) {
        self.count = self.count.wrapping_add(other.count);
        self.sum = self.sum.wrapping_add(other.sum);
    }

    /// Takes away the elements of `other`, added before.
    pub fn subtract(&mut self, other: Self) {
        self.count = self.count.wrapping_sub(other.count);
        self.sum = self.sum.wrapping_sub(other.sum);
    }

    /// The fingerprint of one virtual server with its real servers.
    pub fn of_entry<'a>(
        server: &VirtualServer,
        dests: impl IntoIterator<Item = &'a RealServer>,
    ) -> Self {
        let mut f = Self::default();
        f.insert_server(server);
        for d in dests {
            f.insert_dest(&server.key, d);
        }
        f
    }

    /// Adds a virtual server (without its real servers).
    pub fn insert_server(&mut self, server: &VirtualServer) {
        self.insert(&Element::Server(server));
    }

    /// Takes away a virtual server added before (without its real servers).
    pub fn remove_server(&mut self, server: &VirtualServer) {
        self.remove(&Element::Server(server));
    }

    /// Adds one real server of the virtual server `service`.
    pub fn insert_dest(&mut self, service: &VirtualKey, dest: &RealServer) {
        self.insert(&Element::Dest(service, dest));
    }

    /// Takes away one real server of `service` added before.
    pub fn remove_dest(&mut self, service: &VirtualKey, dest: &RealServer) {
        self.remove(&Element::Dest(service, dest));
    }

    /// Adds an address on `kube-ipvs0`.
    pub fn insert_address(&mut self, addr: IpAddr) {
        self.insert(&Element::Address(addr));
    }

    /// Takes away an address added before.
    pub fn remove_address(&mut self, addr: IpAddr) {
        self.remove(&Element::Address(addr));
    }

    /// The fingerprint of the part of `table` that `owned` gives the engine: what the engine
    /// would compare a kernel dump on.
    pub fn of_table(table: &Table, owned: Ownership<'_>) -> Self {
        let mut f = Self::default();
        for (key, entry) in &table.services {
            if owned.key(key) {
                f.add(Self::of_entry(&entry.server, entry.dests.values()));
            }
        }
        for a in &table.addresses {
            if owned.addr(*a) {
                f.insert_address(*a);
            }
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::ServiceEntry;
    use crate::{Cidr, Protocol, Scheduler};

    fn table() -> Table {
        let ip = |s: &str| s.parse::<IpAddr>().expect("literal");
        let server = VirtualServer {
            key: VirtualKey::inet(Protocol::Tcp, ip("10.96.0.10"), 80),
            scheduler: Scheduler::RR,
            persistence: None,
            netmask: 32,
        };
        let dests = [
            RealServer::masq(ip("10.1.0.1"), 8080, 1),
            RealServer::masq(ip("10.1.0.2"), 8080, 1),
        ];
        let mut t = Table::default();
        t.services.insert(
            server.key,
            ServiceEntry {
                server,
                dests: dests.iter().map(|d| (d.key, *d)).collect(),
            },
        );
        t.addresses.insert(ip("10.96.0.10"));
        t
    }

    #[test]
    fn insertion_order_does_not_matter_and_removal_undoes_insertion() {
        let t = table();
        let whole = Fingerprint::of_table(&t, Ownership::default());
        let entry = &t.services.values().next().expect("one entry");
        let dests: Vec<&RealServer> = entry.dests.values().collect();
        let mut reversed = Fingerprint::default();
        reversed.insert_address(*t.addresses.first().expect("one address"));
        reversed.add(Fingerprint::of_entry(
            &entry.server,
            dests.iter().rev().copied(),
        ));
        assert_eq!(reversed, whole);
        reversed.subtract(Fingerprint::of_entry(&entry.server, dests.iter().copied()));
        assert_ne!(reversed, whole);
        reversed.remove_address(*t.addresses.first().expect("one address"));
        assert_eq!(reversed, Fingerprint::default());
    }

    #[test]
    fn a_changed_weight_or_a_moved_real_server_changes_it() {
        let t = table();
        let whole = Fingerprint::of_table(&t, Ownership::default());
        let mut heavier = t.clone();
        for e in heavier.services.values_mut() {
            for d in e.dests.values_mut() {
                d.weight = 2;
            }
        }
        assert_ne!(Fingerprint::of_table(&heavier, Ownership::default()), whole);
        // The same real server under another virtual server is another element.
        let mut moved = t.clone();
        let (_, mut entry) = moved.services.pop_first().expect("one entry");
        if let VirtualKey::Inet { port, .. } = &mut entry.server.key {
            *port = 81;
        }
        moved.services.insert(entry.server.key, entry);
        assert_ne!(Fingerprint::of_table(&moved, Ownership::default()), whole);
    }

    #[test]
    fn what_the_engine_does_not_own_is_left_out() {
        let t = table();
        let exclude = ["10.96.0.0/16".parse::<Cidr>().expect("literal")];
        assert_eq!(
            Fingerprint::of_table(&t, Ownership::excluding(&exclude)),
            Fingerprint::default()
        );
    }
}
