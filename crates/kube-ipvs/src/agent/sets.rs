//! The members of the service sets ([`kube_ipvs_host::sets`]) as the agent keeps them: worked
//! out per Service from the engine's inputs for the Services a change set touched, counted per
//! member (an address or a port can belong to several Services), and applied to the kernel as a
//! delta. A Service change is a few netlink messages; the `filter` rules never change.
//!
//! What a Service contributes, per family of its own:
//! - [`ServiceSet::Services`]: each virtual server the engine programs for it (ClusterIPs,
//!   external and load-balancer addresses, NodePorts on each NodePort address), as
//!   [`service_table`] decides them, so the filter and IPVS cannot disagree;
//! - [`ServiceSet::Addresses`]: the addresses that table binds to `kube-ipvs0`;
//! - [`ServiceSet::LbFirewall`] and [`ServiceSet::LbSources`]: with `loadBalancerSourceRanges`,
//!   each load-balancer address and port, and each (address, port, range) allowed. Ranges of
//!   the other family than the address are ignored, as kube-proxy does;
//! - [`ServiceSet::HealthCheckPorts`]: its `healthCheckNodePort` under the Local policy;
//! - [`ServiceSet::ClusterIps`]: its ClusterIP virtual servers, and [`ServiceSet::External`]:
//!   its other virtual servers (external and load-balancer addresses, NodePorts) when its
//!   `externalTrafficPolicy` is Cluster (for the `nat` marks of [`kube_ipvs_host::masquerade`]);
//! - [`ServiceSet::LocalMarks`]: under the Local policy, each external virtual server with the
//!   fwmark of its Service port ([`kube_ipvs_diff::marks`]), for the `mangle` rules.
//!
//! NodePort members depend on the node's NodePort addresses: when those change every Service is
//! worked out again. Forced syncs (startup, reconcile) make each set exactly its members (list,
//! compare, add and delete), which also repairs someone flushing a set.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use kube_ipvs_diff::{
    Fingerprint, Inputs, NodeContext, ServiceKind, ServiceName, TrafficPolicy, VirtualKey,
    service_table,
};
use kube_ipvs_host::sets::ServiceSet;
use kube_ipvs_netlink::Family;
use kube_ipvs_netlink::nfnl::ipset::Member;

use crate::kernel::{Kernel, KernelError};

/// One member of one set: the set's name and the member.
pub type Keyed = (&'static str, Member);

/// What one Service puts in the filter sets, sorted and without repeats.
pub fn contribution(name: &ServiceName, inputs: &Inputs) -> Vec<Keyed> {
    let mut out = Vec::new();
    let Some(info) = inputs.service(name) else {
        return out;
    };
    let table = service_table(Some(info), &[], inputs.node());
    for (server, _) in &table.servers {
        if let VirtualKey::Inet {
            protocol,
            addr,
            port,
        } = server.key
        {
            let member = Member::IpPort {
                addr,
                protocol: protocol.number(),
                port,
            };
            let family = Family::of(addr);
            out.push((ServiceSet::Services.name(family), member));
            if info.cluster_ips.contains(&addr) {
                out.push((ServiceSet::ClusterIps.name(family), member));
            } else if info.external_traffic_policy == TrafficPolicy::Cluster {
                out.push((ServiceSet::External.name(family), member));
            }
        }
    }
    for &a in &table.addresses {
        out.push((ServiceSet::Addresses.name(Family::of(a)), Member::Ip(a)));
    }
    for &(key, mark) in &table.marked {
        if let VirtualKey::Inet {
            protocol,
            addr,
            port,
        } = key
        {
            out.push((
                ServiceSet::LocalMarks.name(Family::of(addr)),
                Member::IpPortMark {
                    addr,
                    protocol: protocol.number(),
                    port,
                    mark,
                },
            ));
        }
    }
    if info.kind == ServiceKind::LoadBalancer && !info.load_balancer_source_ranges.is_empty() {
        // Only the load-balancer addresses the engine programs (those of the Service's
        // families) are filtered.
        let programmed = |a: &IpAddr| table.addresses.contains(a);
        for &lb in info.load_balancer_ips.iter().filter(|a| programmed(a)) {
            let family = Family::of(lb);
            for p in info.ports.iter().filter(|p| p.port != 0) {
                let (protocol, port) = (p.protocol.number(), p.port);
                out.push((
                    ServiceSet::LbFirewall.name(family),
                    Member::IpPort {
                        addr: lb,
                        protocol,
                        port,
                    },
                ));
                for range in &info.load_balancer_source_ranges {
                    if Family::of(range.addr()) != family {
                        continue;
                    }
                    out.push((
                        ServiceSet::LbSources.name(family),
                        Member::IpPortNet {
                            addr: lb,
                            protocol,
                            port,
                            net: range.addr(),
                            prefix: range.prefix(),
                        },
                    ));
                }
            }
        }
    }
    if info.external_traffic_policy == TrafficPolicy::Local
        && let Some(hc) = info.health_check_node_port.filter(|p| *p != 0)
    {
        out.push((
            ServiceSet::HealthCheckPorts.name(Family::V4),
            Member::Port(hc),
        ));
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Set members counted by how many Services hold each (a member can belong to several), with
/// the members whose count went from or to zero since the kernel was last changed (the delta to
/// apply) and how many held members are IPv6. The hairpin and the service sets both keep theirs
/// in one of these.
#[derive(Debug)]
pub struct RefCounts<K> {
    refs: HashMap<K, u32>,
    dirty: HashSet<K>,
    v6: usize,
    /// The fingerprint of the held members, kept as they come and go.
    fingerprint: Fingerprint,
}

impl<K> Default for RefCounts<K> {
    fn default() -> Self {
        Self {
            refs: HashMap::new(),
            dirty: HashSet::new(),
            v6: 0,
            fingerprint: Fingerprint::default(),
        }
    }
}

impl<K: std::hash::Hash + Eq + Copy> RefCounts<K> {
    /// One more holder of `k` (`v6`: whether it is an IPv6 member).
    pub fn hold(&mut self, k: K, v6: bool) {
        let n = self.refs.entry(k).or_insert(0);
        *n += 1;
        if *n == 1 {
            self.dirty.insert(k);
            self.v6 += usize::from(v6);
            self.fingerprint.insert(&k);
        }
    }

    /// One holder fewer of `k`.
    pub fn release(&mut self, k: K, v6: bool) {
        if let Some(n) = self.refs.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                self.refs.remove(&k);
                self.dirty.insert(k);
                self.v6 -= usize::from(v6);
                self.fingerprint.remove(&k);
            }
        }
    }

    /// Forgets every holder; every member becomes part of the delta.
    pub fn release_all(&mut self) {
        let old: Vec<K> = self.refs.drain().map(|(k, _)| k).collect();
        self.dirty.extend(old);
        self.v6 = 0;
        self.fingerprint = Fingerprint::default();
    }

    /// The fingerprint of the held members ([`kube_ipvs_diff::fingerprint`]).
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// Whether anyone holds `k`.
    pub fn held(&self, k: &K) -> bool {
        self.refs.contains_key(k)
    }

    /// Every held member.
    pub fn members(&self) -> impl Iterator<Item = &K> {
        self.refs.keys()
    }

    /// Whether a held member is IPv6.
    pub fn has_v6(&self) -> bool {
        self.v6 > 0
    }

    /// The members whose presence changed since [`RefCounts::clear_delta`].
    pub fn delta(&self) -> &HashSet<K> {
        &self.dirty
    }

    /// The delta was applied (or will be replaced by a whole-set repair). A large one's memory
    /// is given back: after a startup it holds every member.
    pub fn clear_delta(&mut self) {
        if self.dirty.capacity() > 1024 {
            self.dirty = HashSet::new();
        } else {
            self.dirty.clear();
        }
    }
}

/// The service sets' members, kept from change sets.
#[derive(Debug, Default)]
pub struct ServiceSets {
    by_service: HashMap<ServiceName, Vec<Keyed>>,
    /// How many Services hold each member, and the delta since the kernel was last changed.
    counts: RefCounts<Keyed>,
    /// The node the contributions were worked out with: its NodePort addresses decide the
    /// NodePort members, the addresses other interfaces hold decide which external addresses
    /// are bound (and so in the address set).
    node: Option<NodeContext>,
    /// Whether the kernel's sets were made exact by the last forced sync and every delta since
    /// applied; after a failure, deltas wait for the next forced sync.
    synced: bool,
    /// The marks claimed for each Local-policy external virtual server, with how many Services
    /// claim each: only an address all its claimants give the same mark is in the set.
    local_claims: HashMap<LocalKey, BTreeMap<u32, u32>>,
    /// While a background read of the sets is under way: the members whose deltas were
    /// applied since it started (the read may have seen them either way).
    since_read: Option<HashSet<Keyed>>,
}

/// A [`ServiceSet::LocalMarks`] member without its mark: the set, address, protocol and port
/// (what the kernel keys the member on).
type LocalKey = (&'static str, IpAddr, u8, u16);

/// The mark of a claimed key: the one all claims agree on, or none when two Services claim one
/// address and port (two Services sharing an external address: the short circuit must not send
/// one's local clients to the other's endpoints, so neither gets it).
fn agreed(claims: Option<&BTreeMap<u32, u32>>) -> Option<u32> {
    let claims = claims?;
    let mut marks = claims.iter().filter(|(_, n)| **n > 0).map(|(m, _)| *m);
    match (marks.next(), marks.next()) {
        (Some(m), None) => Some(m),
        _ => None,
    }
}

/// A [`ServiceSet::LocalMarks`] member as its key and mark; `None` for any other member.
fn local_key(k: Keyed) -> Option<(LocalKey, u32)> {
    match k {
        (
            set,
            Member::IpPortMark {
                addr,
                protocol,
                port,
                mark,
            },
        ) => Some(((set, addr, protocol, port), mark)),
        _ => None,
    }
}

fn local_member(key: LocalKey, mark: u32) -> Keyed {
    let (set, addr, protocol, port) = key;
    (
        set,
        Member::IpPortMark {
            addr,
            protocol,
            port,
            mark,
        },
    )
}

impl ServiceSets {
    /// Works out these Services' contributions again.
    pub fn update<'a>(
        &mut self,
        names: impl IntoIterator<Item = &'a ServiceName>,
        inputs: &Inputs,
    ) {
        if self.node_changed(inputs) {
            self.update_all(inputs);
            return;
        }
        for name in names {
            let new = contribution(name, inputs);
            let empty = new.is_empty();
            let Some(old) = swap_contribution(&mut self.by_service, name, new, empty) else {
                continue;
            };
            // Only the members that differ change a count.
            let new = self.by_service.get(name).map_or(&[][..], Vec::as_slice);
            for change in sorted_changes(&old, new) {
                match change {
                    Change::Gone(k) => self.release(k),
                    Change::New(k) => self.hold(k),
                }
            }
        }
    }

    /// Whether the NodePort addresses differ from those the contributions were worked out with.
    pub fn node_changed(&self, inputs: &Inputs) -> bool {
        self.node.as_ref() != Some(inputs.node())
    }

    /// Works out every Service again (the node, its NodePort addresses or the addresses its
    /// other interfaces hold changed).
    pub fn update_all(&mut self, inputs: &Inputs) {
        self.node = Some(inputs.node().clone());
        self.counts.release_all();
        self.by_service.clear();
        self.local_claims.clear();
        let names: Vec<ServiceName> = inputs.service_names().cloned().collect();
        for name in &names {
            let c = contribution(name, inputs);
            for k in &c {
                self.hold(*k);
            }
            if !c.is_empty() {
                self.by_service.insert(name.clone(), c);
            }
        }
    }

    fn hold(&mut self, k: Keyed) {
        if !self.claim(k, true) {
            self.counts.hold(k, k.1.family() == Some(Family::V6));
        }
    }

    fn release(&mut self, k: Keyed) {
        if !self.claim(k, false) {
            self.counts.release(k, k.1.family() == Some(Family::V6));
        }
    }

    /// For a Local-policy mark member: records the claim (or its release) and moves the counts
    /// from the key's old agreed member to its new one; `false` for any other member.
    fn claim(&mut self, k: Keyed, hold: bool) -> bool {
        let Some((key, mark)) = local_key(k) else {
            return false;
        };
        let before = agreed(self.local_claims.get(&key));
        let claims = self.local_claims.entry(key).or_default();
        let n = claims.entry(mark).or_insert(0);
        if hold {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                claims.remove(&mark);
            }
        }
        if claims.is_empty() {
            self.local_claims.remove(&key);
        }
        let after = agreed(self.local_claims.get(&key));
        if before != after {
            let v6 = key.1.is_ipv6();
            if let Some(m) = before {
                self.counts.release(local_member(key, m), v6);
            }
            if let Some(m) = after {
                self.counts.hold(local_member(key, m), v6);
            }
        }
        true
    }

    /// Whether any member is IPv6 (the IPv6 rules are then needed).
    pub fn has_v6(&self) -> bool {
        self.counts.has_v6()
    }

    /// Creates every set that is absent.
    pub fn create(kernel: &mut dyn Kernel) -> Result<(), KernelError> {
        for (name, family, kind) in kube_ipvs_host::sets::sets() {
            kernel.create_set(name, family, kind)?;
        }
        Ok(())
    }

    /// Brings the kernel's sets up to date: when forced, creates absent sets and makes each
    /// exactly its members; otherwise applies the delta since the last change (nothing after a
    /// failure until the next forced sync). Returns whether a member was added or deleted.
    pub fn sync(&mut self, kernel: &mut dyn Kernel, force: bool) -> Result<bool, KernelError> {
        if !force && (!self.synced || self.counts.delta().is_empty()) {
            if !self.synced {
                self.counts.clear_delta();
            }
            return Ok(false);
        }
        let result = if force {
            self.since_read = None;
            self.sync_exact(kernel)
        } else {
            if let Some(since) = &mut self.since_read {
                since.extend(self.counts.delta().iter().copied());
            }
            self.sync_delta(kernel)
        };
        self.counts.clear_delta();
        self.synced = result.is_ok();
        result
    }

    /// From now until [`ServiceSets::sync_read`], remembers the members whose deltas reach the
    /// kernel: the sets are being read in the background.
    pub fn begin_read(&mut self) {
        self.since_read = Some(HashSet::new());
    }

    /// The forced sync against `read`, the sets as read in the background since
    /// [`ServiceSets::begin_read`]: the pending delta is applied, then each set made exactly its
    /// members except those a delta changed since the read started, which the deltas keep
    /// right. When no delta was applied since the read started and the read's fingerprint is
    /// the members', the sets held exactly the members: nothing is compared. Reads the sets on
    /// the caller's thread instead ([`ServiceSets::sync`], forced) when no read was begun, a
    /// delta failed meanwhile or a set was missing from the read.
    pub fn sync_read(
        &mut self,
        kernel: &mut dyn Kernel,
        read: &SetsRead,
    ) -> Result<bool, KernelError> {
        let observed = &read.sets;
        let usable = self.synced && observed.values().all(Option::is_some);
        let Some(mut leave) = self.since_read.take().filter(|_| usable) else {
            return self.sync(kernel, true);
        };
        leave.extend(self.counts.delta().iter().copied());
        if leave.is_empty() && read.fingerprint == self.counts.fingerprint() {
            return Ok(false);
        }
        let result = self.sync_delta(kernel).and_then(|delta| {
            Self::create(kernel)?;
            Ok(self.exact_against(kernel, observed, &leave)? || delta)
        });
        self.counts.clear_delta();
        self.synced = result.is_ok();
        result
    }

    /// Each set made exactly its members: the kernel's sets read once, the wanted members
    /// grouped by set in one pass over the counts (not one pass per set).
    fn sync_exact(&self, kernel: &mut dyn Kernel) -> Result<bool, KernelError> {
        Self::create(kernel)?;
        let observed = read_sets(kernel)?;
        self.exact_against(kernel, &observed, &HashSet::new())
    }

    /// Makes each set of `observed` exactly its members, leaving the members in `leave` as
    /// they are.
    fn exact_against(
        &self,
        kernel: &mut dyn Kernel,
        observed: &ObservedSets,
        leave: &HashSet<Keyed>,
    ) -> Result<bool, KernelError> {
        let have = |k: &Keyed| {
            observed
                .get(k.0)
                .and_then(Option::as_ref)
                .is_some_and(|set| set.contains(&k.1))
        };
        let mut add: HashMap<&'static str, Vec<Member>> = HashMap::new();
        for k in self
            .counts
            .members()
            .filter(|k| !have(k) && !leave.contains(*k))
        {
            add.entry(k.0).or_default().push(k.1);
        }
        let mut changed = false;
        for (name, members) in observed {
            let members = members
                .as_ref()
                .ok_or_else(|| KernelError::Refused(format!("ipset {name}: the set is gone")))?;
            let del: Vec<Member> = members
                .iter()
                .filter(|m| {
                    let k = (*name, **m);
                    !self.counts.held(&k) && !leave.contains(&k)
                })
                .copied()
                .collect();
            let add = add.remove(name).unwrap_or_default();
            changed |= apply(kernel, name, &add, &del)?;
        }
        Ok(changed)
    }

    fn sync_delta(&self, kernel: &mut dyn Kernel) -> Result<bool, KernelError> {
        let mut by_set: HashMap<&'static str, (Vec<Member>, Vec<Member>)> = HashMap::new();
        for k in self.counts.delta() {
            let (add, del) = by_set.entry(k.0).or_default();
            if self.counts.held(k) {
                add.push(k.1);
            } else {
                del.push(k.1);
            }
        }
        let mut changed = false;
        for (name, (add, del)) in by_set {
            changed |= apply(kernel, name, &add, &del)?;
        }
        Ok(changed)
    }
}

/// Stores `new` as `name`'s contribution (none when `empty`) and returns the one it replaces,
/// or `None` when nothing changed (then nothing is stored, and nothing was cloned).
pub fn swap_contribution<V: PartialEq + Default>(
    map: &mut HashMap<ServiceName, V>,
    name: &ServiceName,
    new: V,
    empty: bool,
) -> Option<V> {
    if map.get(name).map_or(empty, |old| *old == new) {
        return None;
    }
    let old = if empty {
        map.remove(name)
    } else {
        map.insert(name.clone(), new)
    };
    Some(old.unwrap_or_default())
}

/// One element of the difference between two sorted lists without repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change<T> {
    /// Only in the old list.
    Gone(T),
    /// Only in the new list.
    New(T),
}

/// The elements that differ between `old` and `new`, both sorted and without repeats, in one
/// merge pass (an element in both is no change).
pub fn sorted_changes<T: Ord + Copy>(old: &[T], new: &[T]) -> Vec<Change<T>> {
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some(x), Some(y)) if x == y => (i, j) = (i + 1, j + 1),
            (Some(x), Some(y)) if x < y => {
                out.push(Change::Gone(*x));
                i += 1;
            }
            (Some(x), None) => {
                out.push(Change::Gone(*x));
                i += 1;
            }
            (_, Some(y)) => {
                out.push(Change::New(*y));
                j += 1;
            }
            (None, None) => break,
        }
    }
    out
}

/// Every member every Service wants, with the Services that want it (for `check` and `plan`).
pub fn desired_members(inputs: &Inputs) -> BTreeMap<Keyed, Vec<ServiceName>> {
    let mut out: BTreeMap<Keyed, Vec<ServiceName>> = BTreeMap::new();
    let mut marks: HashMap<LocalKey, BTreeSet<u32>> = HashMap::new();
    for name in inputs.service_names() {
        for k in contribution(name, inputs) {
            if let Some((key, mark)) = local_key(k) {
                marks.entry(key).or_default().insert(mark);
            }
            out.entry(k).or_default().push(name.clone());
        }
    }
    // As the agent keeps them: an address two Services give different marks is in no set.
    out.retain(|k, _| {
        local_key(*k).is_none_or(|(key, _)| marks.get(&key).is_none_or(|s| s.len() == 1))
    });
    out
}

/// The marks the kernel's [`ServiceSet::LocalMarks`] sets map ways in to, as hints for the
/// input store ([`Inputs::set_mark_hints`]); none when the sets cannot be read.
pub fn mark_hints(kernel: &mut dyn Kernel) -> HashMap<kube_ipvs_diff::MarkHint, u32> {
    use kube_ipvs_diff::Protocol;
    let mut hints = HashMap::new();
    for family in [Family::V4, Family::V6] {
        let Ok(Some(members)) = kernel.list_set(ServiceSet::LocalMarks.name(family)) else {
            continue;
        };
        for m in members {
            let Member::IpPortMark {
                addr,
                protocol,
                port,
                mark,
            } = m
            else {
                continue;
            };
            let protocol = match protocol {
                6 => Protocol::Tcp,
                17 => Protocol::Udp,
                132 => Protocol::Sctp,
                _ => continue,
            };
            if mark != 0 {
                hints.insert((Some(addr), protocol, port), mark);
                hints.insert((None, protocol, port), mark);
            }
        }
    }
    hints
}

/// The kernel's sets by name; `None` for a set that does not exist.
pub type ObservedSets = BTreeMap<&'static str, Option<BTreeSet<Member>>>;

/// The service sets as a background read found them, with the fingerprint of their members
/// (each a [`Keyed`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetsRead {
    /// The sets by name.
    pub sets: ObservedSets,
    /// The fingerprint of every member of every set read.
    pub fingerprint: Fingerprint,
}

/// Reads every service set from the kernel and fingerprints the members (for a background
/// read, so the loop does not walk them when nothing drifted).
pub fn read_sets_fingerprinted(kernel: &mut dyn Kernel) -> Result<SetsRead, KernelError> {
    let sets = read_sets(kernel)?;
    let mut fingerprint = Fingerprint::default();
    for (name, members) in &sets {
        for m in members.iter().flatten() {
            let k: Keyed = (name, *m);
            fingerprint.insert(&k);
        }
    }
    Ok(SetsRead { sets, fingerprint })
}

/// Reads every service set from the kernel.
pub fn read_sets(kernel: &mut dyn Kernel) -> Result<ObservedSets, KernelError> {
    kube_ipvs_host::sets::sets()
        .map(|(name, _, _)| {
            Ok((
                name,
                kernel.list_set(name)?.map(|m| m.into_iter().collect()),
            ))
        })
        .collect()
}

/// How the kernel's sets differ from what the Services want.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SetDiff {
    /// Members to add, with the Services that want them.
    pub missing: Vec<(Keyed, Vec<ServiceName>)>,
    /// Members no Service wants.
    pub extra: Vec<Keyed>,
    /// Sets that do not exist (while others do).
    pub absent: Vec<&'static str>,
    /// No set exists at all: kube-ipvs does not manage iptables here (`--no-masquerade`), or
    /// the agent has not started.
    pub unmanaged: bool,
}

impl SetDiff {
    /// Whether the sets hold exactly what is wanted (or are not managed at all).
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty() && self.extra.is_empty() && self.absent.is_empty()
    }
}

/// Compares the wanted members with the kernel's sets.
pub fn diff_sets(desired: &BTreeMap<Keyed, Vec<ServiceName>>, observed: &ObservedSets) -> SetDiff {
    if observed.values().all(Option::is_none) {
        return SetDiff {
            unmanaged: true,
            ..SetDiff::default()
        };
    }
    let mut diff = SetDiff::default();
    for (name, members) in observed {
        match members {
            None => diff.absent.push(name),
            Some(have) => {
                for m in have {
                    if !desired.contains_key(&(*name, *m)) {
                        diff.extra.push((*name, *m));
                    }
                }
            }
        }
    }
    for (k, owners) in desired {
        let present = observed
            .get(k.0)
            .and_then(Option::as_ref)
            .is_some_and(|set| set.contains(&k.1));
        if !present {
            diff.missing.push((*k, owners.clone()));
        }
    }
    diff
}

/// Deletes, then adds (a member moving between Services is in neither list).
pub fn apply(
    kernel: &mut dyn Kernel,
    name: &'static str,
    add: &[Member],
    del: &[Member],
) -> Result<bool, KernelError> {
    if !del.is_empty() {
        kernel.change_set(name, false, del)?;
    }
    if !add.is_empty() {
        kernel.change_set(name, true, add)?;
    }
    Ok(!add.is_empty() || !del.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::mem::MemKernel;
    use kube_ipvs_diff::{NodeContext, Protocol, ServiceInfo, ServicePort};

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    fn inputs(node_ip: &str) -> Inputs {
        let mut node = NodeContext::new("node-1");
        node.node_ips_v4 = vec![node_ip.parse().expect("literal")];
        Inputs::new(node).expect("node")
    }

    fn lb(ranges: &[&str]) -> ServiceInfo {
        ServiceInfo {
            kind: ServiceKind::LoadBalancer,
            cluster_ips: vec![ip("10.96.0.20")],
            ports: vec![ServicePort {
                name: String::new(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: Some(30080),
            }],
            load_balancer_ips: vec![ip("203.0.113.7")],
            load_balancer_source_ranges: ranges.iter().map(|r| r.parse().expect("cidr")).collect(),
            external_traffic_policy: TrafficPolicy::Local,
            health_check_node_port: Some(31000),
            ..ServiceInfo::default()
        }
    }

    fn tcp(addr: &str, port: u16) -> Member {
        Member::IpPort {
            addr: ip(addr),
            protocol: 6,
            port,
        }
    }

    /// The service sets of `inputs`, made exact in `k` by a forced sync that changed it.
    fn synced(inputs: &Inputs, k: &mut MemKernel) -> ServiceSets {
        let mut sets = ServiceSets::default();
        sets.update_all(inputs);
        assert!(sets.sync(k, true).expect("forced"));
        sets
    }

    /// Deletes every member of `set` in the kernel, as someone else would.
    fn empty_behind_our_back(k: &MemKernel, set: &str) {
        k.state()
            .sets
            .get_mut(set)
            .expect("the set exists")
            .1
            .clear();
    }

    fn members(k: &MemKernel, set: &str) -> Vec<String> {
        k.state()
            .sets
            .get(set)
            .map(|(_, m)| m.iter().map(Member::to_string).collect())
            .unwrap_or_default()
    }

    #[test]
    fn a_load_balancer_contributes_its_servers_addresses_ranges_and_health_port() {
        let mut inputs = inputs("192.168.1.10");
        let name = ServiceName::new("default", "web");
        inputs
            .upsert_service(name.clone(), lb(&["198.51.100.0/24", "fd00::/8"]))
            .expect("service");
        let c = contribution(&name, &inputs);
        let text: Vec<String> = c.iter().map(|(s, m)| format!("{s} {m}")).collect();
        let marks = &inputs.service(&name).expect("stored").local_marks;
        assert_eq!(marks.len(), 1, "one mark for the one port");
        let mark = marks[0].mark;
        assert_eq!(
            text,
            [
                "KUBE-IPVS-ADDRS 10.96.0.20".to_owned(),
                "KUBE-IPVS-ADDRS 203.0.113.7".to_owned(),
                "KUBE-IPVS-CLUSTER-IPS 10.96.0.20,tcp:80".to_owned(),
                "KUBE-IPVS-HC-PORTS 31000".to_owned(),
                "KUBE-IPVS-LB-FW 203.0.113.7,tcp:80".to_owned(),
                // The IPv6 range cannot apply to an IPv4 address and is left out.
                "KUBE-IPVS-LB-SRC 203.0.113.7,tcp:80,198.51.100.0/24".to_owned(),
                // Local clients of the NodePort and the load-balancer address get the mark.
                format!("KUBE-IPVS-LOCAL-MARKS 192.168.1.10,tcp:30080 skbmark {mark:#x}"),
                format!("KUBE-IPVS-LOCAL-MARKS 203.0.113.7,tcp:80 skbmark {mark:#x}"),
                "KUBE-IPVS-SERVICES 10.96.0.20,tcp:80".to_owned(),
                "KUBE-IPVS-SERVICES 192.168.1.10,tcp:30080".to_owned(),
                "KUBE-IPVS-SERVICES 203.0.113.7,tcp:80".to_owned(),
            ]
        );
        // Without ranges there is no firewall entry, a Cluster policy has no health port, and
        // its external virtual servers are always masqueraded.
        let open = ServiceInfo {
            external_traffic_policy: TrafficPolicy::Cluster,
            ..lb(&[])
        };
        inputs.upsert_service(name.clone(), open).expect("service");
        let c = contribution(&name, &inputs);
        let external: Vec<String> = c
            .iter()
            .filter(|(s, _)| *s == "KUBE-IPVS-EXTERNAL")
            .map(|(_, m)| m.to_string())
            .collect();
        assert_eq!(external, ["192.168.1.10,tcp:30080", "203.0.113.7,tcp:80"]);
        assert!(
            !c.iter().any(|(s, _)| s.starts_with("KUBE-IPVS-LB-")
                || s.starts_with("KUBE-IPVS-HC")
                || s.starts_with("KUBE-IPVS-LOCAL")),
            "{c:?}"
        );
    }

    #[test]
    fn an_ipv6_service_is_known_without_walking_the_members() {
        let mut inputs = inputs("192.168.1.10");
        let mut sets = ServiceSets::default();
        sets.update_all(&inputs);
        assert!(!sets.has_v6());
        let v6 = ServiceName::new("default", "v6");
        let info = ServiceInfo {
            kind: ServiceKind::ClusterIp,
            cluster_ips: vec![ip("fd00::10")],
            load_balancer_ips: Vec::new(),
            health_check_node_port: None,
            ..lb(&[])
        };
        inputs.upsert_service(v6.clone(), info).expect("v6");
        sets.update([&v6], &inputs);
        assert!(sets.has_v6());
        inputs.remove_service(&v6);
        sets.update([&v6], &inputs);
        assert!(!sets.has_v6());
    }

    #[test]
    fn a_contribution_is_swapped_only_when_it_changes() {
        let mut map: HashMap<ServiceName, Vec<u8>> = HashMap::new();
        let a = ServiceName::new("default", "a");
        assert_eq!(
            swap_contribution(&mut map, &a, vec![], true),
            None,
            "absent stays absent"
        );
        assert_eq!(
            swap_contribution(&mut map, &a, vec![1], false),
            Some(vec![])
        );
        assert_eq!(
            swap_contribution(&mut map, &a, vec![1], false),
            None,
            "the same"
        );
        assert_eq!(
            swap_contribution(&mut map, &a, vec![2], false),
            Some(vec![1])
        );
        assert_eq!(map.get(&a), Some(&vec![2]));
        assert_eq!(swap_contribution(&mut map, &a, vec![], true), Some(vec![2]));
        assert!(map.is_empty(), "an empty contribution is not stored");
    }

    #[test]
    fn sorted_changes_are_what_differs() {
        assert_eq!(
            sorted_changes(&[1, 3, 5, 7], &[2, 3, 7, 8]),
            [
                Change::Gone(1),
                Change::New(2),
                Change::Gone(5),
                Change::New(8)
            ]
        );
        assert!(sorted_changes(&[1, 2], &[1, 2]).is_empty());
        assert_eq!(sorted_changes(&[], &[4]), [Change::New(4)]);
        assert_eq!(sorted_changes(&[4], &[]), [Change::Gone(4)]);
    }

    /// Two Local-policy Services on one load-balancer address and port: their marks differ, so
    /// neither's local clients are short-circuited (one Service's clients must never reach the
    /// other's endpoints); once one is gone, the other's mark is set, by a delta.
    #[test]
    fn an_address_two_services_mark_differently_is_in_no_mark_set() {
        let mut inputs = inputs("192.168.1.10");
        let mut k = MemKernel::default();
        let a = ServiceName::new("default", "a");
        let b = ServiceName::new("default", "b");
        inputs.upsert_service(a.clone(), lb(&[])).expect("a");
        let same_lb = ServiceInfo {
            cluster_ips: vec![ip("10.96.0.21")],
            ports: vec![ServicePort {
                name: String::new(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: None,
            }],
            ..lb(&[])
        };
        inputs.upsert_service(b.clone(), same_lb).expect("b");
        let mark = |n: &ServiceName| inputs.service(n).expect("stored").local_marks[0].mark;
        assert_ne!(mark(&a), mark(&b), "each Service port has its own mark");
        let mut sets = synced(&inputs, &mut k);
        let a_mark = mark(&a);
        assert_eq!(
            members(&k, "KUBE-IPVS-LOCAL-MARKS"),
            [format!("192.168.1.10,tcp:30080 skbmark {a_mark:#x}")],
            "only a's NodePort, which b does not share"
        );
        assert!(
            !desired_members(&inputs)
                .keys()
                .any(|(set, m)| *set == "KUBE-IPVS-LOCAL-MARKS"
                    && m.to_string().starts_with("203.0.113.7,")),
            "check and plan agree"
        );
        inputs.remove_service(&b);
        sets.update([&b], &inputs);
        assert!(sets.sync(&mut k, false).expect("delta"));
        assert_eq!(
            members(&k, "KUBE-IPVS-LOCAL-MARKS"),
            [
                format!("192.168.1.10,tcp:30080 skbmark {a_mark:#x}"),
                format!("203.0.113.7,tcp:80 skbmark {a_mark:#x}"),
            ]
        );
    }

    /// A forced sync against sets read before a change neither undoes the change (a member
    /// the read lacks is not added twice, one it has is not deleted again) nor misses drift
    /// elsewhere (a member someone deleted is added back).
    #[test]
    fn a_sync_against_a_stale_read_keeps_the_changes_since_and_repairs_the_rest() {
        let mut inputs = inputs("192.168.1.10");
        let mut k = MemKernel::default();
        let a = ServiceName::new("default", "a");
        inputs
            .upsert_service(a.clone(), lb(&["198.51.100.0/24"]))
            .expect("a");
        let mut sets = synced(&inputs, &mut k);

        // Someone deletes a member; then the read is taken; then a's ranges change.
        let drift = "203.0.113.7,tcp:80";
        empty_behind_our_back(&k, "KUBE-IPVS-LB-FW");
        sets.begin_read();
        let read = read_sets_fingerprinted(&mut k).expect("read");
        inputs
            .upsert_service(a.clone(), lb(&["192.0.2.0/24"]))
            .expect("a");
        sets.update([&a], &inputs);
        assert!(sets.sync(&mut k, false).expect("delta"));
        k.state().set_log.clear();

        assert!(sets.sync_read(&mut k, &read).expect("against the read"));
        assert_eq!(
            k.state().set_log,
            [format!("add KUBE-IPVS-LB-FW {drift}")],
            "only the drift is repaired"
        );
        assert_eq!(
            members(&k, "KUBE-IPVS-LB-SRC"),
            ["203.0.113.7,tcp:80,192.0.2.0/24"]
        );
        assert_eq!(members(&k, "KUBE-IPVS-LB-FW"), [drift]);
    }

    /// The members' fingerprint, kept as members come and go, is the one a read of the sets
    /// works out after the deltas reached the kernel; a read that finds the same fingerprint
    /// with no delta since is trusted without comparing members, and one that differs (a
    /// member deleted behind our back) is compared and repaired.
    #[test]
    fn a_read_with_the_members_fingerprint_is_trusted_and_a_different_one_repaired() {
        let mut inputs = inputs("192.168.1.10");
        let mut k = MemKernel::default();
        let (a, b) = (
            ServiceName::new("default", "a"),
            ServiceName::new("default", "b"),
        );
        inputs
            .upsert_service(a.clone(), lb(&["198.51.100.0/24"]))
            .expect("a");
        let mut sets = synced(&inputs, &mut k);
        inputs
            .upsert_service(b.clone(), lb(&["192.0.2.0/24"]))
            .expect("b");
        inputs.remove_service(&a);
        sets.update([&a, &b], &inputs);
        assert!(sets.sync(&mut k, false).expect("delta"));
        let kept = sets.counts.fingerprint();
        assert_ne!(kept, Fingerprint::default());
        assert_eq!(
            read_sets_fingerprinted(&mut k).expect("read").fingerprint,
            kept
        );

        // Trusted: a read with the members' fingerprint is not compared, even against sets
        // that (in this made-up read) lack a member.
        sets.begin_read();
        let mut read = read_sets_fingerprinted(&mut k).expect("read");
        for members in read.sets.values_mut().flatten() {
            members.clear();
        }
        k.state().set_log.clear();
        assert!(!sets.sync_read(&mut k, &read).expect("trusted"));
        assert!(k.state().set_log.is_empty(), "{:?}", k.state().set_log);

        // Drift: a member deleted behind our back changes the read's fingerprint.
        let gone = members(&k, "KUBE-IPVS-LB-FW");
        empty_behind_our_back(&k, "KUBE-IPVS-LB-FW");
        sets.begin_read();
        let read = read_sets_fingerprinted(&mut k).expect("read");
        assert_ne!(read.fingerprint, kept);
        assert!(sets.sync_read(&mut k, &read).expect("repaired"));
        assert_eq!(members(&k, "KUBE-IPVS-LB-FW"), gone);
        assert_eq!(
            read_sets_fingerprinted(&mut k).expect("read").fingerprint,
            kept
        );
    }

    #[test]
    fn a_change_is_a_delta_of_the_changed_members_only() {
        let mut inputs = inputs("192.168.1.10");
        let mut k = MemKernel::default();
        let a = ServiceName::new("default", "a");
        let b = ServiceName::new("default", "b");
        inputs
            .upsert_service(a.clone(), lb(&["198.51.100.0/24"]))
            .expect("a");
        // b shares a's load-balancer address on another port.
        let other_port = ServiceInfo {
            cluster_ips: vec![ip("10.96.0.21")],
            ports: vec![ServicePort {
                name: String::new(),
                protocol: Protocol::Udp,
                port: 53,
                node_port: None,
            }],
            health_check_node_port: None,
            load_balancer_source_ranges: Vec::new(),
            ..lb(&[])
        };
        inputs.upsert_service(b.clone(), other_port).expect("b");
        let mut sets = synced(&inputs, &mut k);
        assert_eq!(
            members(&k, "KUBE-IPVS-ADDRS"),
            ["10.96.0.20", "10.96.0.21", "203.0.113.7"]
        );
        assert_eq!(members(&k, "KUBE-IPVS-LB-FW"), ["203.0.113.7,tcp:80"]);
        k.state().set_log.clear();

        // A's ranges change: two members of one set, nothing else.
        inputs
            .upsert_service(a.clone(), lb(&["192.0.2.0/24"]))
            .expect("a");
        sets.update([&a], &inputs);
        assert!(sets.sync(&mut k, false).expect("delta"));
        assert_eq!(
            k.state().set_log,
            [
                "del KUBE-IPVS-LB-SRC 203.0.113.7,tcp:80,198.51.100.0/24",
                "add KUBE-IPVS-LB-SRC 203.0.113.7,tcp:80,192.0.2.0/24"
            ]
        );
        assert_eq!(
            members(&k, "KUBE-IPVS-LB-SRC"),
            ["203.0.113.7,tcp:80,192.0.2.0/24"]
        );
        k.state().set_log.clear();

        // A goes: the shared address stays (b holds it), a's own members go.
        inputs.remove_service(&a);
        sets.update([&a], &inputs);
        assert!(sets.sync(&mut k, false).expect("delta"));
        assert_eq!(
            members(&k, "KUBE-IPVS-ADDRS"),
            ["10.96.0.21", "203.0.113.7"]
        );
        assert!(members(&k, "KUBE-IPVS-LB-FW").is_empty());
        assert!(members(&k, "KUBE-IPVS-HC-PORTS").is_empty());
        assert_eq!(
            members(&k, "KUBE-IPVS-SERVICES"),
            ["10.96.0.21,udp:53", "203.0.113.7,udp:53"]
        );
        // Nothing changed: nothing sent.
        k.state().set_log.clear();
        sets.update([&a, &b], &inputs);
        assert!(!sets.sync(&mut k, false).expect("nothing"));
        assert!(k.state().set_log.is_empty());
    }

    #[test]
    fn the_difference_names_missing_members_with_their_services_and_extra_ones() {
        let mut inputs = inputs("192.168.1.10");
        let web = ServiceName::new("default", "web");
        inputs.upsert_service(web.clone(), lb(&[])).expect("web");
        let desired = desired_members(&inputs);
        let mut k = MemKernel::default();
        // Nothing exists: not managed, not drift.
        let none = diff_sets(&desired, &read_sets(&mut k).expect("read"));
        assert!(none.unmanaged && none.is_empty());
        let mut sets = ServiceSets::default();
        sets.update_all(&inputs);
        sets.sync(&mut k, true).expect("forced");
        assert!(diff_sets(&desired, &read_sets(&mut k).expect("read")).is_empty());
        // One member lost, one stray added, one set destroyed.
        {
            let mut st = k.state();
            st.sets
                .get_mut("KUBE-IPVS-SERVICES")
                .expect("set")
                .1
                .remove(&tcp("10.96.0.20", 80));
            st.sets
                .get_mut("KUBE-IPVS-ADDRS")
                .expect("set")
                .1
                .insert(Member::Ip(ip("10.96.9.9")));
            st.sets.remove("KUBE-IPVS-HC-PORTS");
        }
        let d = diff_sets(&desired, &read_sets(&mut k).expect("read"));
        assert_eq!(
            d.missing,
            vec![
                (
                    ("KUBE-IPVS-HC-PORTS", Member::Port(31000)),
                    vec![web.clone()]
                ),
                (("KUBE-IPVS-SERVICES", tcp("10.96.0.20", 80)), vec![web])
            ]
        );
        assert_eq!(
            d.extra,
            vec![("KUBE-IPVS-ADDRS", Member::Ip(ip("10.96.9.9")))]
        );
        assert_eq!(d.absent, vec!["KUBE-IPVS-HC-PORTS"]);
        assert!(!d.unmanaged);
    }

    /// Found by the faults test: an external address another interface came to hold was
    /// unbound from kube-ipvs0 but stayed in the address set (only NodePort address changes
    /// made the sets work every Service out again).
    #[test]
    fn an_address_another_interface_comes_to_hold_leaves_the_address_set() {
        let mut inputs = inputs("192.168.1.10");
        let mut k = MemKernel::default();
        let a = ServiceName::new("default", "a");
        inputs.upsert_service(a.clone(), lb(&[])).expect("a");
        let mut sets = ServiceSets::default();
        sets.update_all(&inputs);
        sets.sync(&mut k, true).expect("forced");
        assert!(members(&k, "KUBE-IPVS-ADDRS").contains(&"203.0.113.7".to_owned()));
        let mut node = inputs.node().clone();
        node.held_addresses = vec![ip("203.0.113.7")];
        inputs.set_node(node).expect("node");
        assert!(sets.node_changed(&inputs));
        sets.update(std::iter::empty(), &inputs);
        sets.sync(&mut k, false).expect("delta");
        let addrs = members(&k, "KUBE-IPVS-ADDRS");
        assert!(!addrs.contains(&"203.0.113.7".to_owned()), "{addrs:?}");
        assert!(addrs.contains(&"10.96.0.20".to_owned()), "{addrs:?}");
    }

    #[test]
    fn new_node_addresses_move_the_node_ports_and_a_forced_sync_repairs_a_flush() {
        let mut inputs = inputs("192.168.1.10");
        let mut k = MemKernel::default();
        let a = ServiceName::new("default", "a");
        inputs.upsert_service(a.clone(), lb(&[])).expect("a");
        let mut sets = ServiceSets::default();
        sets.update_all(&inputs);
        sets.sync(&mut k, true).expect("forced");
        let mut node = inputs.node().clone();
        node.node_ips_v4 = vec!["192.168.1.11".parse().expect("literal")];
        inputs.set_node(node).expect("node");
        assert!(sets.node_changed(&inputs));
        // Any update notices the new addresses and works every Service out again.
        sets.update(std::iter::empty(), &inputs);
        sets.sync(&mut k, false).expect("delta");
        let services = members(&k, "KUBE-IPVS-SERVICES");
        assert!(services.contains(&tcp("192.168.1.11", 30080).to_string()));
        assert!(!services.contains(&tcp("192.168.1.10", 30080).to_string()));

        // Someone flushes a set and adds a stray member: a forced sync puts it right.
        k.state().sets.get_mut("KUBE-IPVS-SERVICES").expect("set").1 =
            [tcp("10.1.1.1", 1)].into_iter().collect();
        sets.sync(&mut k, true).expect("forced");
        assert_eq!(members(&k, "KUBE-IPVS-SERVICES"), services);

        // A failed delta is not retried blindly: the next forced sync repairs the whole set.
        k.state().sets.clear();
        inputs.remove_service(&a);
        sets.update([&a], &inputs);
        assert!(sets.sync(&mut k, false).is_err(), "the sets are gone");
        assert!(
            !sets.sync(&mut k, false).expect("waits"),
            "no delta after a failure"
        );
        sets.sync(&mut k, true).expect("forced recreates");
        assert!(members(&k, "KUBE-IPVS-SERVICES").is_empty());
        assert!(k.state().sets.contains_key("KUBE-IPVS-HC-PORTS"));
    }
}
