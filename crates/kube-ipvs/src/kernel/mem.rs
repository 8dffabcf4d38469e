//! The in-memory kernel of the host tests: one [`Kernel`] that the executor's, the sync loop's
//! and the masquerade tests all run against, so each proves its logic without a VM (the kernel
//! tests in the VM prove the real one).
//!
//! It answers IPVS requests the way IPVS does, through the engine's own table model
//! ([`Table::apply`]: adding what exists or deleting what does not is an error), so code under
//! test cannot pass by issuing blind requests. The hairpin sets and the masquerade rules are
//! recorded. Every handle shares one [`MemState`] (it is `Clone`), so a test keeps a handle,
//! gives others to the code under test (the masquerade worker thread has its own), and reads
//! or changes the state, including the failures it injects, at any time.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kube_ipvs_diff::{ServiceEntry, Table, VirtualKey};
use kube_ipvs_host::masquerade::{self, Family, Hairpin};
use kube_ipvs_netlink::ipvs::{Request, ServiceKey};
use kube_ipvs_netlink::nfnl::ipset::{self, Member, SetKind};

use super::convert::op_for;
use super::observe::Observed;
use super::{Counts, Kernel, KernelError};

/// What the in-memory kernel holds and records, and the failures it is told to inject.
#[derive(Debug, Default)]
pub struct MemState {
    /// The IPVS table and `kube-ipvs0`'s addresses.
    pub table: Table,
    /// Whether `kube-ipvs0` exists.
    pub interface: bool,
    /// Every IPVS request received, in order.
    pub requests: Vec<Request>,
    /// The size of each `apply_requests` call, in order.
    pub batches: Vec<usize>,
    /// Virtual servers added (`true`) and deleted (`false`), by address and port, in order.
    pub service_changes: Vec<(bool, IpAddr, u16)>,
    /// The node's own addresses, as [`Kernel::node_addresses`] answers.
    pub node_addresses: Vec<IpAddr>,
    /// Requests for real servers on this port fail ("injected failure").
    pub fail_dest_port: Option<u16>,
    /// Every new real server fails ("Cannot allocate memory").
    pub fail_new_dests: bool,
    /// `observe` answers an empty table (a kernel whose table someone cleared between syncs).
    pub observe_empty: bool,
    /// The ipsets (hairpin and service sets) with their kind, present once created.
    pub sets: BTreeMap<&'static str, (SetKind, BTreeSet<Member>)>,
    /// Set operations, in order: `list NAME`, `add NAME M1 M2` and `del NAME M1` (members as
    /// `ipset save` prints them, sorted).
    pub set_log: Vec<String>,
    /// Creating a set fails (a kernel without ipset support).
    pub fail_set_create: bool,
    /// Adding or deleting set members fails.
    pub fail_set_changes: bool,
    /// Every rule set ensured, in order.
    pub rules: Vec<masquerade::Config>,
    /// Ensuring rules fails.
    pub fail_rules: bool,
    /// Rules that match the hairpin sets are refused (iptables without `xt_set`).
    pub refuse_set_rules: bool,
    /// Rules matching the service sets are refused (iptables without a match they use).
    pub refuse_service_set_rules: bool,
    /// How many times `observe` took its snapshot.
    pub reads: usize,
    /// How many `observe` calls took their snapshot and wait for [`MemKernel::hold_reads`].
    pub reads_waiting: usize,
    /// The next `observe` to get past [`MemKernel::hold_reads`] leaves this virtual server out
    /// of its answer, as the kernel's positional dump can when entries come and go during it.
    pub omit_from_read: Option<VirtualKey>,
    /// Every [`Kernel::observe_services`]: the name of the thread that called it, and the
    /// virtual servers it asked for.
    pub service_reads: Vec<(String, BTreeSet<VirtualKey>)>,
    /// How many [`Kernel::observe_services`] calls wait for [`MemKernel::hold_service_reads`].
    pub service_reads_waiting: usize,
    /// Virtual servers created while their address was not bound to `kube-ipvs0` (the
    /// executor binds an address before it creates a virtual server on it).
    pub services_before_address: Vec<VirtualKey>,
    /// How many address binds [`Kernel::address_binder`]'s binder is waiting to make, held by
    /// [`MemKernel::hold_binds`].
    pub binds_waiting: usize,
    /// The binder of [`Kernel::address_binder`] panics at its first call.
    pub binder_panics: bool,
    /// Whether [`Kernel::address_binder`] gives a binder (a kernel with one socket only, when
    /// `false`).
    pub no_binder: bool,
    /// kube-proxy's leftovers [`Kernel::remove_kube_proxy_leftovers`] finds (and removes).
    pub kube_proxy_leftovers: Vec<String>,
    /// How many times they were asked to be removed, and how many rule sets had been
    /// ensured by then.
    pub kube_proxy_removals: Vec<usize>,
}

impl MemState {
    /// The addresses `a` of the members `(a, a)` of a family's hairpin set.
    #[must_use]
    pub fn set_members(&self, family: Family) -> Vec<IpAddr> {
        self.sets
            .get(ipset::set_name(family))
            .map(|(_, m)| {
                m.iter()
                    .filter_map(|m| match m {
                        Member::NetNet(e) => e.hairpin_addr(),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A handle on one in-memory kernel.
#[derive(Clone, Default)]
pub struct MemKernel {
    state: Arc<Mutex<MemState>>,
    /// Held by a test to keep `ensure_rules` waiting (the masquerade worker's tests).
    gate: Arc<Mutex<()>>,
    /// Held by a test to keep `observe` from answering the snapshot it took (a background
    /// read that the agent's loop overtakes).
    read_gate: Arc<Mutex<()>>,
    /// Held by a test to keep the binder of [`Kernel::address_binder`] from binding.
    bind_gate: Arc<Mutex<()>>,
    /// Held by a test to keep [`Kernel::observe_services`] from reading.
    service_read_gate: Arc<Mutex<()>>,
}

impl MemKernel {
    /// The shared state.
    pub fn state(&self) -> MutexGuard<'_, MemState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `ensure_rules` until the guard is dropped.
    pub fn hold_rules(&self) -> MutexGuard<'_, ()> {
        self.gate.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `observe`'s answer, taken from the table as it was when it was called, until the
    /// guard is dropped.
    pub fn hold_reads(&self) -> MutexGuard<'_, ()> {
        self.read_gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds [`Kernel::observe_services`] (before it reads) until the guard is dropped.
    pub fn hold_service_reads(&self) -> MutexGuard<'_, ()> {
        self.service_read_gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds the binds of [`Kernel::address_binder`]'s binder until the guard is dropped.
    pub fn hold_binds(&self) -> MutexGuard<'_, ()> {
        self.bind_gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn refused(what: impl Into<String>) -> KernelError {
        KernelError::Refused(what.into())
    }

    fn apply_one(st: &mut MemState, r: &Request) -> Result<(), KernelError> {
        if let Request::NewDest { dest, .. } | Request::SetDest { dest, .. } = r {
            if st.fail_dest_port == Some(dest.port) {
                return Err(Self::refused("injected failure"));
            }
            if st.fail_new_dests && matches!(r, Request::NewDest { .. }) {
                return Err(Self::refused("Cannot allocate memory"));
            }
        }
        let op = op_for(r).ok_or_else(|| Self::refused(format!("unexpected request {r:?}")))?;
        st.table
            .apply(&op)
            .map_err(|e| Self::refused(e.to_string()))?;
        match r {
            Request::NewService(s) => {
                if let ServiceKey::Addr { addr, port, .. } = s.key {
                    st.service_changes.push((true, addr, port));
                    if !st.table.addresses.contains(&addr) {
                        let key = op.service().copied();
                        st.services_before_address.extend(key);
                    }
                }
            }
            Request::DelService(ServiceKey::Addr { addr, port, .. }) => {
                st.service_changes.push((false, *addr, *port));
            }
            _ => {}
        }
        Ok(())
    }
}

impl Kernel for MemKernel {
    fn apply_requests(&mut self, requests: &[Request]) -> Vec<Result<(), KernelError>> {
        let mut st = self.state();
        st.requests.extend_from_slice(requests);
        st.batches.push(requests.len());
        requests
            .iter()
            .map(|r| Self::apply_one(&mut st, r))
            .collect()
    }

    fn ensure_interface(&mut self) -> Result<(), KernelError> {
        self.state().interface = true;
        Ok(())
    }

    fn add_address(&mut self, addr: IpAddr) -> Result<(), KernelError> {
        self.state()
            .table
            .apply(&kube_ipvs_diff::Op::AddAddress(addr))
            .map_err(|e| Self::refused(e.to_string()))
    }

    fn address_binder(&mut self) -> Option<super::AddressBinder> {
        if self.state().no_binder {
            return None;
        }
        let mut k = self.clone();
        Some(Box::new(move |addrs| {
            assert!(!k.state().binder_panics, "injected binder panic");
            k.state().binds_waiting += addrs.len();
            let gate = k.bind_gate.clone();
            let _held = gate.lock().unwrap_or_else(PoisonError::into_inner);
            k.state().binds_waiting -= addrs.len();
            k.add_addresses(addrs)
        }))
    }

    fn remove_address(&mut self, addr: IpAddr) -> Result<(), KernelError> {
        self.state()
            .table
            .apply(&kube_ipvs_diff::Op::RemoveAddress(addr))
            .map_err(|e| Self::refused(e.to_string()))
    }

    fn observe(&mut self) -> Result<(Observed, Counts), KernelError> {
        let mut st = self.state();
        let mut table = if st.observe_empty {
            Table::default()
        } else {
            st.table.clone()
        };
        st.reads += 1;
        st.reads_waiting += 1;
        let interface = st.interface;
        drop(st);
        drop(self.hold_reads());
        {
            let mut st = self.state();
            st.reads_waiting -= 1;
            if let Some(k) = st.omit_from_read.take() {
                table.services.remove(&k);
            }
        }
        // No connections anywhere: stale real servers can go at once.
        let counts = table
            .services
            .iter()
            .flat_map(|(k, e)| e.dests.keys().map(move |d| ((*k, *d), 0)))
            .collect();
        Ok((
            Observed {
                table,
                foreign: Vec::new(),
                interface_exists: interface,
            },
            counts,
        ))
    }

    fn connection_counts(&mut self, _: &BTreeSet<VirtualKey>) -> Counts {
        Counts::default()
    }

    fn observe_services(
        &mut self,
        keys: &BTreeSet<VirtualKey>,
    ) -> Result<(BTreeMap<VirtualKey, Option<ServiceEntry>>, Counts), KernelError> {
        // The snapshot is taken before the wait (as `observe` does), so a change made while a
        // test holds the read is not in its answer.
        let (entries, counts) = {
            let mut st = self.state();
            let thread = std::thread::current().name().unwrap_or_default().to_owned();
            st.service_reads.push((thread, keys.clone()));
            st.service_reads_waiting += 1;
            let entries: BTreeMap<VirtualKey, Option<ServiceEntry>> = keys
                .iter()
                .map(|k| (*k, st.table.services.get(k).cloned()))
                .collect();
            // No connections anywhere, as `observe` answers.
            let counts: Counts = entries
                .iter()
                .filter_map(|(k, e)| e.as_ref().map(|e| (k, e)))
                .flat_map(|(k, e)| e.dests.keys().map(move |d| ((*k, *d), 0)))
                .collect();
            (entries, counts)
        };
        let gate = self.service_read_gate.clone();
        drop(gate.lock().unwrap_or_else(PoisonError::into_inner));
        self.state().service_reads_waiting -= 1;
        Ok((entries, counts))
    }

    fn node_addresses(&mut self) -> Result<Vec<IpAddr>, KernelError> {
        Ok(self.state().node_addresses.clone())
    }

    fn create_set(
        &mut self,
        name: &'static str,
        _family: Family,
        kind: SetKind,
    ) -> Result<(), KernelError> {
        let mut st = self.state();
        if st.fail_set_create {
            return Err(Self::refused(format!(
                "ipset {name}: protocol not supported"
            )));
        }
        let (have, _) = st
            .sets
            .entry(name)
            .or_insert_with(|| (kind, BTreeSet::new()));
        if *have != kind {
            return Err(Self::refused(format!(
                "ipset {name}: a set of that name exists with another type"
            )));
        }
        Ok(())
    }

    fn list_set(&mut self, name: &'static str) -> Result<Option<Vec<Member>>, KernelError> {
        let mut st = self.state();
        st.set_log.push(format!("list {name}"));
        Ok(st
            .sets
            .get(name)
            .map(|(_, set)| set.iter().copied().collect()))
    }

    fn change_set(
        &mut self,
        name: &'static str,
        add: bool,
        members: &[Member],
    ) -> Result<(), KernelError> {
        let mut st = self.state();
        let verb = if add { "add" } else { "del" };
        let mut text: Vec<String> = members.iter().map(Member::to_string).collect();
        text.sort();
        st.set_log.push(format!("{verb} {name} {}", text.join(" ")));
        if st.fail_set_changes {
            return Err(Self::refused(format!("ipset {name}: {verb} refused")));
        }
        let (_, set) = st
            .sets
            .get_mut(name)
            .ok_or_else(|| Self::refused(format!("ipset {name}: the set is gone")))?;
        for m in members {
            if add {
                set.insert(*m);
            } else {
                set.remove(m);
            }
        }
        Ok(())
    }

    fn ensure_rules(&mut self, config: &masquerade::Config) -> Result<(), KernelError> {
        let _open = self.hold_rules();
        let mut st = self.state();
        st.rules.push(config.clone());
        if st.fail_rules
            || (st.refuse_set_rules && config.hairpin == Hairpin::Set)
            || (st.refuse_service_set_rules && config.service_sets)
        {
            Err(Self::refused("iptables-restore: no"))
        } else {
            Ok(())
        }
    }

    fn remove_kube_proxy_leftovers(&mut self) -> Result<Vec<String>, KernelError> {
        let mut st = self.state();
        let ensured = st.rules.len();
        st.kube_proxy_removals.push(ensured);
        Ok(std::mem::take(&mut st.kube_proxy_leftovers))
    }
}
