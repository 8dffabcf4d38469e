//! The incremental engine: remembers what each Service last asked for, recomputes only the
//! Services that changed, and turns the difference into [`Op`]s. It also runs graceful
//! termination of TCP real servers, with time passed in by the caller.
//!
//! **Invariant**: the incremental path ([`Engine::sync`]) does work proportional to the changed
//! Services and the pending terminations, never to the cluster. Whole-table walks happen only
//! in [`Engine::resync`] (startup, drift repair), [`Engine::desired_table`] (plan/check) and
//! [`Engine::desired_size`] (after a full sync), or when the node context changes.
//!
//! The engine assumes the executor applies every op it returns. If an op fails, the caller
//! should run [`Engine::resync`] against a fresh dump.
//!
//! How a daemon drives it:
//! 1. At startup: fill [`Inputs`] from the first complete watch, dump the kernel into a
//!    [`Table`], call [`Engine::resync`] and apply the ops (an unchanged table costs none).
//! 2. On each change (debounced): [`Engine::sync`] with `now` from its monotonic clock and
//!    connection counts for the virtual servers in [`Engine::draining`]; apply the ops.
//! 3. Wake up at [`Engine::next_deadline`] (if any) and call [`Engine::sync`] even without
//!    changes, so drained or timed-out real servers are deleted.
//! 4. Now and then (and after any failed op): dump and [`Engine::resync`] to repair drift.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use foldhash::fast::RandomState;

use crate::desired::{ServiceTable, drains, service_table};
use crate::fingerprint::Fingerprint;
use crate::model::{Inputs, ServiceName};
use crate::table::{
    DestKey, Op, Ownership, RealServer, ServiceEntry, Table, VirtualKey, VirtualServer, diff_view,
    merge_by, order_ops,
};

/// Connection counts (active + inactive) of real servers, as the kernel reports them. The
/// daemon answers from a dump of the virtual server in question, so a lookup costs O(that
/// virtual server). `None` means unknown, which the engine treats as "may have connections".
pub trait ConnectionCounts {
    /// Active plus inactive connections of `dest` in `service`.
    fn connections(&self, service: &VirtualKey, dest: &DestKey) -> Option<u64>;
}

impl<S: std::hash::BuildHasher> ConnectionCounts for HashMap<(VirtualKey, DestKey), u64, S> {
    fn connections(&self, service: &VirtualKey, dest: &DestKey) -> Option<u64> {
        self.get(&(*service, *dest)).copied()
    }
}

/// No counts known: every removed TCP real server drains until the timeout.
#[derive(Debug, Clone, Copy, Default)]
pub struct UnknownCounts;

impl ConnectionCounts for UnknownCounts {
    fn connections(&self, _: &VirtualKey, _: &DestKey) -> Option<u64> {
        None
    }
}

/// A real server kept at weight 0 until it drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draining {
    /// When it was set to weight 0 (caller's clock).
    pub since: Duration,
    /// It as the kernel now holds it (weight 0).
    pub dest: RealServer,
}

/// A virtual server two Services both asked for. The first keeps it; the other waits and gets
/// it if the first lets go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The contested virtual server.
    pub key: VirtualKey,
    /// The Service that has it.
    pub owner: ServiceName,
    /// The Services waiting for it.
    pub waiting: Vec<ServiceName>,
}

/// Where a sync's ops go. [`Engine::resync`] discards them, since it diffs against the
/// kernel's table instead.
struct Sink {
    ops: Vec<Op>,
    keep: bool,
}

impl Sink {
    fn push(&mut self, op: Op) {
        if self.keep {
            self.ops.push(op);
        }
    }
}

/// The incremental diff engine.
#[derive(Debug, Default)]
pub struct Engine {
    /// What each Service last got (only virtual servers it owns).
    applied: HashMap<Arc<ServiceName>, ServiceTable, RandomState>,
    /// Who owns each virtual server.
    owners: HashMap<VirtualKey, Arc<ServiceName>, RandomState>,
    /// Services waiting for a virtual server another Service owns.
    waiting: HashMap<VirtualKey, BTreeSet<ServiceName>, RandomState>,
    /// How many Services need each `kube-ipvs0` address.
    addr_refs: HashMap<IpAddr, u32, RandomState>,
    /// Real servers at weight 0, waiting to drain. Ordered so a virtual server's entries are a
    /// range.
    draining: BTreeMap<(VirtualKey, DestKey), Draining>,
    /// Whether a sync has run; the first one computes every Service, whatever the inputs
    /// recorded as changed.
    started: bool,
    /// The graceful-termination timeout of the current sync (from the node options).
    drain_timeout: Duration,
    /// Draining real servers deleted because the timeout passed while they still had
    /// connections, not yet taken by [`Engine::take_timed_out`].
    timed_out: Vec<(VirtualKey, DestKey)>,
    /// The fingerprint of `applied`'s virtual servers and `addr_refs`'s addresses, kept as they
    /// change.
    fingerprint: Fingerprint,
}

impl Engine {
    /// An engine that believes the kernel is empty; call [`Engine::resync`] first against a
    /// real dump to adopt what is there.
    pub fn new() -> Self {
        Self::default()
    }

    /// Recomputes the Services that changed since the last call and returns the ops that take
    /// the kernel from what the engine last asked for to what they need now, plus the deletes of
    /// drained or timed-out real servers. `now` is the caller's monotonic clock.
    pub fn sync(
        &mut self,
        inputs: &mut Inputs,
        now: Duration,
        counts: &dyn ConnectionCounts,
    ) -> Vec<Op> {
        self.sync_into(inputs, now, counts, true)
    }

    /// [`Engine::sync`], keeping the ops only if `keep`; [`Engine::resync`] has no use for them
    /// and skips building the whole-table list at startup.
    fn sync_into(
        &mut self,
        inputs: &mut Inputs,
        now: Duration,
        counts: &dyn ConnectionCounts,
        keep: bool,
    ) -> Vec<Op> {
        self.drain_timeout = inputs.node().options.graceful_termination_timeout;
        let changes = inputs.take_changes();
        let mut work: BTreeSet<ServiceName> = if changes.node || !self.started {
            self.started = true;
            let mut all = changes.services;
            all.extend(inputs.service_names().cloned());
            all.extend(self.applied.keys().map(|n| ServiceName::clone(n)));
            self.applied
                .reserve(inputs.len().saturating_sub(self.applied.len()));
            // Collecting a whole list at once lets the set sort it and bulk-build.
            all.into_iter().collect()
        } else {
            changes.services.into_iter().collect()
        };
        let mut ops = Sink {
            ops: Vec::new(),
            keep,
        };
        let mut addr_touched: HashMap<IpAddr, bool, RandomState> = HashMap::default();
        while let Some(name) = work.pop_first() {
            let new = service_table(
                inputs.service(&name),
                inputs.endpoints(&name),
                inputs.node(),
            );
            self.replace(
                &name,
                new,
                now,
                counts,
                &mut ops,
                &mut work,
                &mut addr_touched,
            );
        }
        // Expiry runs after the recompute, so an endpoint that came back in this batch is
        // restored from its draining entry instead of being deleted and added again (which
        // would reach the kernel as add-before-delete of the same destination).
        self.expire(inputs, now, counts, &mut ops);
        self.address_ops(addr_touched, &mut ops);
        let mut ops = ops.ops;
        order_ops(&mut ops);
        ops
    }

    /// Deletes draining real servers that have no connections left or whose time is up.
    fn expire(
        &mut self,
        inputs: &Inputs,
        now: Duration,
        counts: &dyn ConnectionCounts,
        ops: &mut Sink,
    ) {
        let timeout = inputs.node().options.graceful_termination_timeout;
        let timed_out = &mut self.timed_out;
        self.draining.retain(|(service, dest), d| {
            let drained = counts.connections(service, dest) == Some(0);
            let late = now.saturating_sub(d.since) >= timeout;
            if late && !drained {
                timed_out.push((*service, *dest));
            }
            let done = drained || late;
            if done {
                ops.push(Op::DeleteDest {
                    service: *service,
                    dest: *dest,
                });
            }
            !done
        });
    }

    /// The earliest time a draining real server times out, so the caller can wake up then.
    pub fn next_deadline(&self, inputs: &Inputs) -> Option<Duration> {
        let timeout = inputs.node().options.graceful_termination_timeout;
        self.draining.values().map(|d| d.since + timeout).min()
    }

    /// The draining real servers deleted since the last call because the graceful-termination
    /// timeout passed while they still had connections (or their count was unknown), for the
    /// caller to log and count.
    pub fn take_timed_out(&mut self) -> Vec<(VirtualKey, DestKey)> {
        std::mem::take(&mut self.timed_out)
    }

    /// The real servers currently draining.
    pub fn draining(&self) -> impl Iterator<Item = (&VirtualKey, &DestKey, &Draining)> {
        self.draining.iter().map(|((s, d), v)| (s, d, v))
    }

    /// Virtual servers asked for by more than one Service.
    pub fn conflicts(&self) -> Vec<Conflict> {
        let mut out: Vec<Conflict> = self
            .waiting
            .iter()
            .filter_map(|(key, w)| {
                Some(Conflict {
                    key: *key,
                    owner: ServiceName::clone(self.owners.get(key)?),
                    waiting: w.iter().cloned().collect(),
                })
            })
            .collect();
        out.sort_by_key(|c| c.key);
        out
    }

    /// Replaces what one Service has with `new`, emitting the ops in between.
    #[allow(
        clippy::too_many_arguments,
        reason = "the sync state is passed piecewise so the borrows stay disjoint"
    )]
    fn replace(
        &mut self,
        name: &ServiceName,
        mut new: ServiceTable,
        now: Duration,
        counts: &dyn ConnectionCounts,
        ops: &mut Sink,
        work: &mut BTreeSet<ServiceName>,
        addr_touched: &mut HashMap<IpAddr, bool, RandomState>,
    ) {
        // Names are shared (one allocation per Service, not one per virtual server it owns).
        let (owner, old) = match self.applied.remove_entry(name) {
            Some((owner, old)) => (owner, old),
            None => (Arc::new(name.clone()), ServiceTable::default()),
        };
        // Forget earlier waits of this Service; they are re-registered below if still wanted.
        // (Its stored table holds only keys it owns, so it waits on none of those.) This walks
        // the contested keys only, which are few; the check keeps the common case O(1).
        if !self.waiting.is_empty() {
            self.waiting.retain(|_, w| {
                w.remove(name);
                !w.is_empty()
            });
        }
        new.servers.retain(|(s, _)| match self.owners.get(&s.key) {
            Some(o) if **o != *name => {
                self.waiting.entry(s.key).or_default().insert(name.clone());
                false
            }
            _ => true,
        });

        let mut old_it = old.servers.iter().peekable();
        let mut new_it = new.servers.iter().peekable();
        loop {
            let ord = match (old_it.peek(), new_it.peek()) {
                (None, None) => break,
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (Some((o, _)), Some((n, _))) => o.key.cmp(&n.key),
            };
            match ord {
                std::cmp::Ordering::Less => {
                    if let Some((o, od)) = old_it.next() {
                        self.fingerprint.subtract(Fingerprint::of_entry(o, od));
                        self.release(name, o.key, ops, work);
                    }
                }
                std::cmp::Ordering::Greater => {
                    if let Some((n, dests)) = new_it.next() {
                        self.fingerprint.add(Fingerprint::of_entry(n, dests));
                        self.owners.insert(n.key, Arc::clone(&owner));
                        ops.push(Op::AddService(*n));
                        for d in dests {
                            ops.push(Op::AddDest {
                                service: n.key,
                                dest: *d,
                            });
                        }
                    }
                }
                std::cmp::Ordering::Equal => {
                    if let (Some((o, od)), Some((n, nd))) = (old_it.next(), new_it.next()) {
                        if o != n {
                            self.fingerprint.remove_server(o);
                            self.fingerprint.insert_server(n);
                            ops.push(Op::UpdateService(*n));
                        }
                        self.diff_dests(n.key, od, nd, now, counts, ops);
                    }
                }
            }
        }

        // Addresses are reference-counted over Services; the net change is decided at the end
        // of the sync so one Service dropping an address another adds costs nothing.
        // Both address lists are sorted and unique.
        merge_by(
            &old.addresses,
            &new.addresses,
            |a| **a,
            |a| **a,
            |o, n| match (o, n) {
                (Some(a), None) => {
                    let present = self.addr_refs.contains_key(a);
                    addr_touched.entry(*a).or_insert(present);
                    if let Some(n) = self.addr_refs.get_mut(a) {
                        *n -= 1;
                        if *n == 0 {
                            self.addr_refs.remove(a);
                            self.fingerprint.remove_address(*a);
                        }
                    }
                }
                (None, Some(a)) => {
                    let present = self.addr_refs.contains_key(a);
                    addr_touched.entry(*a).or_insert(present);
                    if !present {
                        self.fingerprint.insert_address(*a);
                    }
                    *self.addr_refs.entry(*a).or_insert(0) += 1;
                }
                _ => {}
            },
        );

        if !new.servers.is_empty() || !new.addresses.is_empty() {
            self.applied.insert(owner, new);
        }
    }

    /// Gives up a virtual server: deletes it, forgets its draining real servers, and queues any
    /// Service that was waiting for it.
    fn release(
        &mut self,
        name: &ServiceName,
        key: VirtualKey,
        ops: &mut Sink,
        work: &mut BTreeSet<ServiceName>,
    ) {
        if self.owners.get(&key).is_some_and(|o| **o == *name) {
            self.owners.remove(&key);
        }
        ops.push(Op::DeleteService(key));
        let range: Vec<(VirtualKey, DestKey)> = self
            .draining
            .range((key, DestKey::MIN)..=(key, DestKey::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in range {
            self.draining.remove(&k);
        }
        if let Some(waiters) = self.waiting.remove(&key) {
            work.extend(waiters);
        }
    }

    /// Real-server ops within a virtual server that stays, with graceful termination.
    fn diff_dests(
        &mut self,
        service: VirtualKey,
        old: &[RealServer],
        new: &[RealServer],
        now: Duration,
        counts: &dyn ConnectionCounts,
        ops: &mut Sink,
    ) {
        let mut o = old.iter().peekable();
        let mut n = new.iter().peekable();
        loop {
            let ord = match (o.peek(), n.peek()) {
                (None, None) => break,
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (Some(a), Some(b)) => a.key.cmp(&b.key),
            };
            match ord {
                std::cmp::Ordering::Less => {
                    if let Some(d) = o.next() {
                        self.fingerprint.remove_dest(&service, d);
                        self.remove_dest(service, d, now, counts, ops);
                    }
                }
                std::cmp::Ordering::Greater => {
                    if let Some(d) = n.next() {
                        self.fingerprint.insert_dest(&service, d);
                        // An endpoint that comes back while draining is restored in place.
                        if self.draining.remove(&(service, d.key)).is_some() {
                            ops.push(Op::UpdateDest { service, dest: *d });
                        } else {
                            ops.push(Op::AddDest { service, dest: *d });
                        }
                    }
                }
                std::cmp::Ordering::Equal => {
                    if let (Some(a), Some(b)) = (o.next(), n.next())
                        && a != b
                    {
                        self.fingerprint.remove_dest(&service, a);
                        self.fingerprint.insert_dest(&service, b);
                        ops.push(Op::UpdateDest { service, dest: *b });
                    }
                }
            }
        }
    }

    /// Removes a real server: UDP at once; TCP and SCTP at once only if it is known to have no
    /// connections, else it goes to weight 0 and drains.
    fn remove_dest(
        &mut self,
        service: VirtualKey,
        dest: &RealServer,
        now: Duration,
        counts: &dyn ConnectionCounts,
        ops: &mut Sink,
    ) {
        if !drains(service.protocol())
            || counts.connections(&service, &dest.key) == Some(0)
            || self.drain_timeout.is_zero()
        {
            ops.push(Op::DeleteDest {
                service,
                dest: dest.key,
            });
            return;
        }
        let zero = RealServer { weight: 0, ..*dest };
        ops.push(Op::UpdateDest {
            service,
            dest: zero,
        });
        self.draining.insert(
            (service, dest.key),
            Draining {
                since: now,
                dest: zero,
            },
        );
    }

    /// Emits the net address ops for addresses whose presence changed during a sync.
    fn address_ops(&self, touched: HashMap<IpAddr, bool, RandomState>, ops: &mut Sink) {
        let mut changed: Vec<(IpAddr, bool)> = touched
            .into_iter()
            .filter_map(|(a, before)| {
                let now = self.addr_refs.contains_key(&a);
                (now != before).then_some((a, now))
            })
            .collect();
        changed.sort();
        for (a, present) in changed {
            ops.push(if present {
                Op::AddAddress(a)
            } else {
                Op::RemoveAddress(a)
            });
        }
    }

    /// The whole desired table: every virtual server the engine has asked for, plus draining
    /// real servers at weight 0. Walks everything; for plan/check, not for the sync path.
    pub fn desired_table(&self) -> Table {
        let mut t = Table::default();
        // Sorting first lets the map be bulk-built instead of inserted into key by key.
        let mut entries: Vec<(VirtualKey, ServiceEntry)> = self
            .applied
            .values()
            .flat_map(|st| &st.servers)
            .map(|(s, dests)| {
                let entry = ServiceEntry {
                    server: *s,
                    dests: dests.iter().map(|d| (d.key, *d)).collect(),
                };
                (s.key, entry)
            })
            .collect();
        entries.sort_unstable_by_key(|(k, _)| *k);
        t.services = entries.into_iter().collect();
        for ((s, d), dr) in &self.draining {
            if let Some(e) = t.services.get_mut(s) {
                e.dests.insert(*d, dr.dest);
            }
        }
        t.addresses = self.addr_refs.keys().copied().collect();
        t
    }

    /// One virtual server of [`Engine::desired_table`]: what the engine last asked the kernel
    /// to hold under `key`, draining real servers at weight 0; `None` when it asks for none.
    /// Walks only that virtual server's Service.
    pub fn asked_entry(&self, key: &VirtualKey) -> Option<ServiceEntry> {
        let (server, dests) = self
            .applied
            .get(self.owners.get(key)?)?
            .servers
            .iter()
            .find(|(s, _)| s.key == *key)?;
        let mut entry = ServiceEntry {
            server: *server,
            dests: dests.iter().map(|d| (d.key, *d)).collect(),
        };
        for ((_, d), dr) in self
            .draining
            .range((*key, DestKey::MIN)..=(*key, DestKey::MAX))
        {
            entry.dests.insert(*d, dr.dest);
        }
        Some(entry)
    }

    /// [`Fingerprint::of_entry`] of [`Engine::asked_entry`] for `key` (the empty fingerprint
    /// when it asks for none there), worked out without building the entry.
    pub fn asked_fingerprint(&self, key: &VirtualKey) -> Fingerprint {
        let Some((server, dests)) = self
            .owners
            .get(key)
            .and_then(|owner| self.applied.get(owner))
            .and_then(|st| st.servers.iter().find(|(s, _)| s.key == *key))
        else {
            return Fingerprint::default();
        };
        let mut f = Fingerprint::default();
        f.insert_server(server);
        let draining = || {
            self.draining
                .range((*key, DestKey::MIN)..=(*key, DestKey::MAX))
        };
        let any_draining = draining().next().is_some();
        for d in dests {
            // A draining entry of the same key stands in its place, as in `asked_entry`.
            if !(any_draining && self.draining.contains_key(&(*key, d.key))) {
                f.insert_dest(key, d);
            }
        }
        for (_, dr) in draining() {
            f.insert_dest(key, &dr.dest);
        }
        f
    }

    /// Whether `observed_fingerprint` is that of the desired table with the draining real
    /// servers at weight 0, and nothing in `inputs` waits to be synced: then
    /// [`Engine::resync_fingerprinted`] with it finds the fingerprints equal and walks no diff,
    /// so a caller that put the engine's own entries into the fingerprint
    /// ([`Engine::asked_fingerprint`]) need not build them into its table.
    pub fn holds_desired(&self, inputs: &Inputs, observed_fingerprint: Fingerprint) -> bool {
        if inputs.has_changes() || !self.started {
            return false;
        }
        let mut with_draining = self.fingerprint;
        for ((service, _), d) in &self.draining {
            with_draining.insert_dest(service, &d.dest);
        }
        observed_fingerprint == with_draining
    }

    /// The size of [`Engine::desired_table`], virtual servers and real servers (draining
    /// ones included), without building it: one walk, no allocation.
    pub fn desired_size(&self) -> (usize, usize) {
        let mut services = 0;
        let mut dests = 0;
        for (_, d) in self.applied.values().flat_map(|st| &st.servers) {
            services += 1;
            dests += d.len();
        }
        // A draining real server counts where `desired_table` keeps it: under a virtual server
        // the engine still asks for, and not twice if it is wanted again.
        dests += self
            .draining
            .keys()
            .filter(|(s, d)| {
                self.entry_dests(s)
                    .is_some_and(|wanted| !wanted.iter().any(|r| r.key == *d))
            })
            .count();
        (services, dests)
    }

    /// The real servers the engine asks for under one virtual server, if it asks for it.
    fn entry_dests(&self, key: &VirtualKey) -> Option<&[RealServer]> {
        let owner = self.owners.get(key)?;
        self.applied
            .get(owner)?
            .servers
            .iter()
            .find(|(s, _)| s.key == *key)
            .map(|(_, d)| d.as_slice())
    }

    /// Full resync against what the kernel holds: brings the per-Service state up to date (every
    /// Service on a new engine, the changed ones otherwise), then diffs the whole desired table against `observed`, managing only what the engine owns
    /// ([`Ownership::of`] the node options). Real servers the kernel has and
    /// the desired table lacks drain gracefully as in [`Engine::sync`]; ones already at weight 0
    /// keep draining. Use at startup (adopting an existing table) and for drift repair.
    pub fn resync(
        &mut self,
        inputs: &mut Inputs,
        observed: &Table,
        now: Duration,
        counts: &dyn ConnectionCounts,
    ) -> Vec<Op> {
        self.resync_checked(inputs, observed, None, now, counts)
    }

    /// The fingerprint of the desired table without draining real servers: every virtual
    /// server the engine asks for with its real servers, and every address (see
    /// [`crate::fingerprint`]). Kept as Services change, so this costs nothing.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// [`Engine::resync`], given also `observed_fingerprint`: [`Fingerprint::of_table`] of
    /// `observed` under the node options' [`Ownership`], worked out where the table was read.
    /// When it equals that of the desired table with each draining real server added at weight
    /// 0, the kernel holds exactly that, so the per-Service state is
    /// brought up to date and no diff is walked: the only ops are the deletes of draining real
    /// servers with no connections left or whose time is up, as the diff would give. Otherwise
    /// (drift) the same as [`Engine::resync`]. Also says whether the fingerprints matched.
    pub fn resync_fingerprinted(
        &mut self,
        inputs: &mut Inputs,
        observed: &Table,
        observed_fingerprint: Fingerprint,
        now: Duration,
        counts: &dyn ConnectionCounts,
    ) -> (Vec<Op>, bool) {
        let mut matched = false;
        let ops = self.resync_checked(
            inputs,
            observed,
            Some((observed_fingerprint, &mut matched)),
            now,
            counts,
        );
        (ops, matched)
    }

    fn resync_checked(
        &mut self,
        inputs: &mut Inputs,
        observed: &Table,
        observed_fingerprint: Option<(Fingerprint, &mut bool)>,
        now: Duration,
        counts: &dyn ConnectionCounts,
    ) -> Vec<Op> {
        // Bring the per-Service state up to date with the inputs (all of it for a new engine).
        // Its ops are dropped: the full diff below starts from what the kernel really holds.
        // Draining entries are set aside first so the sync does not expire them on its own;
        // the kernel's view below decides.
        let mut previous_draining = std::mem::take(&mut self.draining);
        self.sync_into(inputs, now, counts, false);
        for (k, d) in std::mem::take(&mut self.draining) {
            previous_draining.entry(k).or_insert(d);
        }
        // The kernel holds the desired table and the draining real servers at weight 0: the
        // diff below would give only the deletes of the drained ones.
        if let Some((f, matched)) = observed_fingerprint {
            let mut with_draining = self.fingerprint;
            for ((service, _), d) in &previous_draining {
                with_draining.insert_dest(service, &d.dest);
            }
            if f == with_draining {
                *matched = true;
                return self.expire_unchanged(previous_draining, inputs, now, counts);
            }
        }
        // The per-Service tables are diffed in key order without building a whole `Table`.
        let mut servers: Vec<&(VirtualServer, Vec<RealServer>)> =
            self.applied.values().flat_map(|st| &st.servers).collect();
        servers.sort_unstable_by_key(|(s, _)| s.key);
        let mut addresses: Vec<IpAddr> = self.addr_refs.keys().copied().collect();
        addresses.sort_unstable();
        let options = &inputs.node().options;
        let diff = diff_view(
            servers.iter().map(|(s, d)| (s, d.iter())),
            addresses,
            observed,
            Ownership::of(options),
        );
        let mut ops = Vec::new();
        for op in diff {
            let Op::DeleteDest { service, dest } = op else {
                ops.push(op);
                continue;
            };
            let weight = observed
                .services
                .get(&service)
                .and_then(|e| e.dests.get(&dest));
            let Some(current) = weight.copied() else {
                continue;
            };
            let since = previous_draining
                .get(&(service, dest))
                .map(|d| d.since)
                .unwrap_or(now);
            let expired = now.saturating_sub(since) >= options.graceful_termination_timeout;
            if !drains(service.protocol())
                || counts.connections(&service, &dest) == Some(0)
                || expired
            {
                ops.push(Op::DeleteDest { service, dest });
                continue;
            }
            let zero = RealServer {
                weight: 0,
                ..current
            };
            if current != zero {
                ops.push(Op::UpdateDest {
                    service,
                    dest: zero,
                });
            }
            self.draining
                .insert((service, dest), Draining { since, dest: zero });
        }
        order_ops(&mut ops);
        ops
    }

    /// The resync's ops when the kernel holds the desired table with `draining` at weight 0:
    /// the deletes of those with no connections left or whose time is up (the others keep
    /// draining, with their start times), exactly as the diff's deletes would decide.
    fn expire_unchanged(
        &mut self,
        draining: BTreeMap<(VirtualKey, DestKey), Draining>,
        inputs: &Inputs,
        now: Duration,
        counts: &dyn ConnectionCounts,
    ) -> Vec<Op> {
        let timeout = inputs.node().options.graceful_termination_timeout;
        let mut ops = Vec::new();
        for ((service, dest), d) in draining {
            let expired = now.saturating_sub(d.since) >= timeout;
            if !drains(service.protocol())
                || counts.connections(&service, &dest) == Some(0)
                || expired
            {
                ops.push(Op::DeleteDest { service, dest });
            } else {
                self.draining.insert((service, dest), d);
            }
        }
        order_ops(&mut ops);
        ops
    }
}

impl DestKey {
    const MIN: DestKey = DestKey {
        addr: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        port: 0,
    };
    const MAX: DestKey = DestKey {
        addr: IpAddr::V6(std::net::Ipv6Addr::new(
            0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff,
        )),
        port: u16::MAX,
    };
}
