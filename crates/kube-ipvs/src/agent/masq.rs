//! The masquerade rules as the agent keeps them: what [`kube_ipvs_host::masquerade`] needs beyond the
//! settings (NodePorts and external/load-balancer addresses of `externalTrafficPolicy: Local`
//! Services, this node's endpoints for hairpin), tracked per Service from change sets so a
//! change costs the changed Services only, and when to apply them.
//!
//! # Hairpin
//!
//! With `--node-pod-cidr` (this node's Pod CIDRs) hairpin is [`Hairpin::LocalPodCidrs`]: one
//! rule per CIDR whatever the number of Services or endpoints, the default this build
//! recommends. It also masquerades Service traffic between two different Pods of this node (a
//! superset of hairpin), which then loses the client Pod's address. Without the flag the node's
//! Pod CIDR is unknown (the Node object's `spec.podCIDRs` is not part of the desired state), so
//! hairpin is exact: [`Hairpin::Set`], one rule per family matching an ipset whose members are
//! this node's endpoint addresses ([`kube_ipvs_netlink::nfnl::ipset`]). The rules then do not depend on the
//! endpoints at all; the members are kept over netlink from a reference count per address (an
//! address can be an endpoint of several Services), maintained from the per-Service
//! contributions, so a change to one Service's endpoints costs a few netlink messages on the
//! caller's thread and no `iptables-restore`. Forced applies make each set exactly the wanted
//! members (dump, compare, add/delete), which repairs someone flushing it, before the rules are
//! ensured. If the sets cannot be created at startup (no `ip_set` / `ip_set_hash_netnet`),
//! hairpin falls back to [`Hairpin::Endpoints`]: one rule per endpoint on this node, re-applied
//! when they change.
//!
//! The rules are applied after the startup sync, at every full reconcile (which repairs
//! someone deleting them), and whenever what they are built from changes. A failure is logged
//! and counted and the next reconcile tries again: iptables trouble never stops the agent.
//!
//! # Off the sync loop
//!
//! In the agent the rules are applied by a worker thread ([`Masq::in_background`]): an
//! `iptables-restore` is a process or two per family even for our few rules (and takes seconds
//! for the per-endpoint fallback on a node with many local endpoints), and IPVS programming must not
//! wait behind it. The hairpin set's members are not rules: their deltas are applied on the
//! caller's thread, before any rules are handed over. A change hands the worker the new rules and
//! returns at once; the worker applies the newest rules it was given (intermediate ones are
//! skipped: each is a whole state). The startup's forced apply waits for the worker, so it
//! keeps its order with the changes before it and reports its own error (and the fallbacks
//! without the sets can be tried); a reconcile's waits only when the last apply failed, since
//! otherwise it re-ensures rules already in place and its loop has changes to program. An error of
//! a background apply is reported by the next call, which treats the rules as not applied.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use kube_ipvs_diff::{Cidr, Inputs, Protocol, ServiceKind, ServiceName, TrafficPolicy};

use kube_ipvs_host::masquerade::{
    self, Backend, Family, Hairpin, LocalDetect, LocalNodePort, LocalVirtualServer,
};
use kube_ipvs_netlink::nfnl::ipset::{self, Entry, Member, SetKind};

use super::sets::{Change, RefCounts, ServiceSets, SetsRead, sorted_changes, swap_contribution};
use crate::kernel::{Kernel, KernelError};

/// What one Service contributes to the rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Contribution {
    /// Local-policy NodePorts.
    node_ports: Vec<(Protocol, u16)>,
    /// Local-policy external and load-balancer addresses with their ports.
    virtual_servers: Vec<(IpAddr, Protocol, u16)>,
    /// Addresses of this node's endpoints (for exact hairpin).
    local_endpoints: Vec<IpAddr>,
}

impl Contribution {
    fn is_empty(&self) -> bool {
        self.node_ports.is_empty()
            && self.virtual_servers.is_empty()
            && self.local_endpoints.is_empty()
    }
}

fn contribution(name: &ServiceName, inputs: &Inputs) -> Contribution {
    let mut c = Contribution::default();
    let Some(info) = inputs.service(name) else {
        return c;
    };
    if info.kind == ServiceKind::ExternalName || info.cluster_ips.is_empty() {
        return c;
    }
    if info.external_traffic_policy == TrafficPolicy::Local
        && matches!(info.kind, ServiceKind::NodePort | ServiceKind::LoadBalancer)
    {
        for p in &info.ports {
            if let Some(np) = p.node_port.filter(|np| *np != 0) {
                c.node_ports.push((p.protocol, np));
            }
        }
    }
    if info.external_traffic_policy == TrafficPolicy::Local {
        for addr in info.external_ips.iter().chain(&info.load_balancer_ips) {
            for p in &info.ports {
                if p.port != 0 {
                    c.virtual_servers.push((*addr, p.protocol, p.port));
                }
            }
        }
    }
    let node = inputs.node().node_name.as_str();
    c.local_endpoints = inputs
        .endpoints(name)
        .iter()
        .filter(|e| e.node_name.as_deref() == Some(node))
        .map(|e| e.addr)
        .collect();
    // Each address counts once per Service, however many slices or ports list it.
    c.local_endpoints.sort_unstable();
    c.local_endpoints.dedup();
    c
}

/// Everything the rules are built from besides the fixed settings; two equal values give the
/// same rules, so an unchanged value needs no `iptables-restore`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wanted {
    node_ips: Vec<IpAddr>,
    node_ports: Vec<(Protocol, u16)>,
    virtual_servers: Vec<(IpAddr, Protocol, u16)>,
    /// The local endpoints, when they are rules ([`Hairpin::Endpoints`]).
    local_endpoints: Vec<IpAddr>,
    /// Hairpin through the sets ([`Hairpin::Set`]): the endpoints are not in the rules.
    hairpin_set: bool,
    /// Whether an IPv6 address is in the hairpin set (the IPv6 rules are then needed).
    hairpin_v6: bool,
    /// Whether the service sets exist ([`super::sets`]): Service traffic is marked by set
    /// membership and the `filter` table is programmed.
    service_sets: bool,
    /// How local Pods are told apart, with this node's Pod CIDRs for `NodeCIDR`.
    local_detect: LocalDetect,
    /// Whether a service set holds an IPv6 member (the IPv6 rules are then needed).
    services_v6: bool,
}

/// The node's NodePort addresses, as [`Wanted`] holds them.
fn node_ips(inputs: &Inputs) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = inputs.node().node_ips().collect();
    ips.sort_unstable();
    ips.dedup();
    ips
}

/// The fixed part of the rules, from the settings.
#[derive(Debug, Clone)]
pub struct Fixed {
    /// `--cluster-cidr`.
    pub cluster_cidrs: Vec<Cidr>,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--node-pod-cidr`: constant-size hairpin when given.
    pub node_pod_cidrs: Vec<Cidr>,
    /// The iptables backend, resolved once at startup when possible.
    pub backend: Backend,
    /// `detectLocalMode`.
    pub detect_local: DetectLocal,
    /// The masquerade mark bit (`--iptables-masquerade-bit`).
    pub mark_bit: u8,
    /// Whether iptables has `MASQUERADE --random-fully`.
    pub random_fully: bool,
    /// The mark mask of the Local-policy short circuit (`--local-fwmark-mask`), if on.
    pub local_marks: Option<u32>,
}

/// kube-proxy's `detectLocalMode`, as configured (the Pod CIDRs of `NodeCIDR` come from the
/// Node object).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DetectLocal {
    /// `ClusterCIDR`: sources in `--cluster-cidr`.
    #[default]
    ClusterCidr,
    /// `NodeCIDR`: sources in the Node's `spec.podCIDRs`.
    NodeCidr,
    /// `BridgeInterface`: packets from this bridge.
    BridgeInterface(String),
    /// `InterfaceNamePrefix`: packets from interfaces named with this prefix.
    InterfaceNamePrefix(String),
}

impl DetectLocal {
    /// The helper's form for this node.
    fn for_node(&self, inputs: &Inputs) -> LocalDetect {
        match self {
            Self::ClusterCidr => LocalDetect::ClusterCidr,
            Self::NodeCidr => LocalDetect::NodeCidr(inputs.node().pod_cidrs.clone()),
            Self::BridgeInterface(b) => LocalDetect::Bridge(b.clone()),
            Self::InterfaceNamePrefix(p) => LocalDetect::InterfacePrefix(p.clone()),
        }
    }
}

/// Per-Service contributions, kept up to date from change sets.
#[derive(Debug, Default)]
pub struct LocalSets {
    by_service: HashMap<ServiceName, Contribution>,
    /// Whether a contribution changed since [`LocalSets::wanted`] last ran: without that, an
    /// incremental sync does not rebuild the whole rule input (a walk over every Service).
    changed: bool,
    /// Hairpin through the sets: local endpoints are counted here, not put in the rules.
    in_set: bool,
    /// In set mode, how many Services have each local endpoint address, and the addresses
    /// whose count went from or to zero since the sets were last changed (the delta).
    refs: RefCounts<IpAddr>,
}

impl LocalSets {
    /// Recomputes these Services' contributions.
    pub fn update<'a>(
        &mut self,
        names: impl IntoIterator<Item = &'a ServiceName>,
        inputs: &Inputs,
    ) {
        for name in names {
            let c = contribution(name, inputs);
            let empty = c.is_empty();
            let Some(old) = swap_contribution(&mut self.by_service, name, c, empty) else {
                continue;
            };
            if !self.in_set {
                self.changed = true;
                continue;
            }
            let none = Contribution::default();
            let c = self.by_service.get(name).unwrap_or(&none);
            // In set mode an endpoint change is a set delta, not a rules change.
            if old.node_ports != c.node_ports || old.virtual_servers != c.virtual_servers {
                self.changed = true;
            }
            // Both lists are sorted and deduplicated: only the addresses that differ change a
            // count (an unchanged one must not become a delta).
            let changes = sorted_changes(&old.local_endpoints, &c.local_endpoints);
            let had_v6 = self.refs.has_v6();
            for change in changes {
                match change {
                    Change::Gone(a) => self.release(a),
                    Change::New(a) => self.hold(a),
                }
            }
            if had_v6 != self.refs.has_v6() {
                self.changed = true;
            }
        }
    }

    fn hold(&mut self, a: IpAddr) {
        self.refs.hold(a, a.is_ipv6());
    }

    fn release(&mut self, a: IpAddr) {
        self.refs.release(a, a.is_ipv6());
    }

    /// The addresses the hairpin sets must hold now (set mode).
    pub fn hairpin_members(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.refs.members().copied()
    }

    /// Recomputes every Service (after a Node change: the node name decides what is local).
    pub fn update_all(&mut self, inputs: &Inputs) {
        self.by_service.clear();
        self.changed = true;
        self.refs.release_all();
        let names: Vec<ServiceName> = inputs.service_names().cloned().collect();
        self.update(&names, inputs);
    }

    /// What the rules need now, with the node's NodePort addresses from `inputs`.
    pub fn wanted(&mut self, inputs: &Inputs, fixed: &Fixed) -> Wanted {
        self.changed = false;
        let in_set = self.in_set && fixed.node_pod_cidrs.is_empty();
        let mut w = Wanted {
            node_ips: node_ips(inputs),
            hairpin_set: in_set,
            hairpin_v6: in_set && self.refs.has_v6(),
            ..Wanted::default()
        };
        for c in self.by_service.values() {
            w.node_ports.extend(&c.node_ports);
            w.virtual_servers.extend(&c.virtual_servers);
            if fixed.node_pod_cidrs.is_empty() && !in_set {
                w.local_endpoints.extend(&c.local_endpoints);
            }
        }
        w.local_endpoints.sort_unstable();
        w.local_endpoints.dedup();
        w.node_ports.sort_unstable();
        w.node_ports.dedup();
        w.virtual_servers.sort_unstable();
        w.virtual_servers.dedup();
        w
    }
}

/// The helper's config for these inputs. IPv6 rules are added when anything in them is IPv6.
pub fn config(fixed: &Fixed, wanted: &Wanted) -> masquerade::Config {
    let v6 = fixed.cluster_cidrs.iter().any(|c| c.addr().is_ipv6())
        || fixed.node_pod_cidrs.iter().any(|c| c.addr().is_ipv6())
        || wanted.node_ips.iter().any(IpAddr::is_ipv6)
        || wanted.virtual_servers.iter().any(|v| v.0.is_ipv6())
        || wanted.local_endpoints.iter().any(IpAddr::is_ipv6)
        || wanted.hairpin_v6
        || wanted.services_v6;
    let mut families = vec![Family::V4];
    if v6 {
        families.push(Family::V6);
    }
    masquerade::Config {
        families,
        cluster_cidrs: fixed.cluster_cidrs.clone(),
        masquerade_all: fixed.masquerade_all,
        node_ips: wanted.node_ips.clone(),
        local_node_ports: wanted
            .node_ports
            .iter()
            .map(|&(protocol, port)| LocalNodePort { protocol, port })
            .collect(),
        local_virtual_servers: wanted
            .virtual_servers
            .iter()
            .map(|&(addr, protocol, port)| LocalVirtualServer {
                addr,
                protocol,
                port,
            })
            .collect(),
        hairpin: if !fixed.node_pod_cidrs.is_empty() {
            Hairpin::LocalPodCidrs(fixed.node_pod_cidrs.clone())
        } else if wanted.hairpin_set {
            Hairpin::Set
        } else {
            Hairpin::Endpoints(wanted.local_endpoints.clone())
        },
        mark_bit: fixed.mark_bit,
        service_sets: wanted.service_sets,
        local_detect: wanted.local_detect.clone(),
        random_fully: fixed.random_fully,
        local_marks: fixed.local_marks,
        backend: fixed.backend,
        bin_dir: None,
    }
}

/// Where the rules go: applied in the caller's thread (through the kernel the caller passes), or
/// handed to a worker with a kernel handle of its own.
enum Applier {
    Inline,
    Worker(Worker),
}

/// The state a [`Worker`] shares with its owner.
#[derive(Default)]
struct WorkerState {
    /// The newest rules not yet taken by the worker, with their sequence number.
    pending: Option<(u64, masquerade::Config)>,
    /// The last sequence number submitted, and the last one the worker finished.
    submitted: u64,
    finished: u64,
    /// The outcome of each finished apply not yet read: (sequence number, error).
    errors: Vec<(u64, String)>,
    /// Set when the owner is dropped: the worker exits.
    closed: bool,
}

/// A thread applying the newest rules it is given.
struct Worker {
    shared: std::sync::Arc<(std::sync::Mutex<WorkerState>, std::sync::Condvar)>,
}

impl Worker {
    fn start(mut kernel: Box<dyn Kernel>) -> Result<Worker, String> {
        let shared = std::sync::Arc::new((
            std::sync::Mutex::new(WorkerState::default()),
            std::sync::Condvar::new(),
        ));
        let theirs = std::sync::Arc::clone(&shared);
        std::thread::Builder::new()
            .name("masquerade".into())
            .spawn(move || {
                let (lock, cond) = &*theirs;
                loop {
                    let (seq, cfg) = {
                        let Ok(mut st) = lock.lock() else { return };
                        loop {
                            if st.closed {
                                return;
                            }
                            if let Some(job) = st.pending.take() {
                                break job;
                            }
                            st = match cond.wait(st) {
                                Ok(st) => st,
                                Err(_) => return,
                            };
                        }
                    };
                    let result = kernel.ensure_rules(&cfg).map_err(|e| e.to_string());
                    let Ok(mut st) = lock.lock() else { return };
                    if let Err(e) = result {
                        st.errors.push((seq, e));
                    }
                    st.finished = seq;
                    cond.notify_all();
                }
            })
            .map_err(|e| format!("starting the masquerade thread: {e}"))?;
        Ok(Worker { shared })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WorkerState> {
        // A panic inside `ensure` poisons nothing we rely on: the state is plain data.
        self.shared
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Hands over `cfg` (replacing rules not yet taken); its sequence number.
    fn submit(&self, cfg: masquerade::Config) -> u64 {
        let mut st = self.lock();
        st.submitted += 1;
        let seq = st.submitted;
        st.pending = Some((seq, cfg));
        self.shared.1.notify_all();
        seq
    }

    /// Waits until the apply `seq` (or a later one) finished; the errors of finished applies
    /// not yet read.
    fn wait(&self, seq: u64) -> Vec<(u64, String)> {
        std::mem::take(&mut self.finished(seq).errors)
    }

    /// The state once the apply `seq` (or a later one) finished.
    fn finished(&self, seq: u64) -> std::sync::MutexGuard<'_, WorkerState> {
        let mut st = self.lock();
        while st.finished < seq {
            st = self
                .shared
                .1
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        st
    }

    /// The errors of finished applies not yet read, without waiting.
    fn take_errors(&self) -> Vec<(u64, String)> {
        std::mem::take(&mut self.lock().errors)
    }

    /// Waits until everything handed over is applied, leaving its errors to be read (tests).
    #[cfg(test)]
    fn wait_finished(&self) {
        let seq = self.lock().submitted;
        drop(self.finished(seq));
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.lock().closed = true;
        self.shared.1.notify_all();
    }
}

/// The agent's masquerade state.
pub struct Masq {
    /// The settings' part.
    pub fixed: Fixed,
    /// Per-Service contributions.
    pub locals: LocalSets,
    /// What was last applied (or, in the background, handed over); `None` before that or after
    /// a failure.
    pub applied: Option<Wanted>,
    /// Where the rules go.
    rules: Applier,
    /// Whether hairpin goes through the sets (set mode).
    sets: bool,
    /// Whether the sets were made exact by the last forced sync and every delta since applied;
    /// after a failure, deltas wait for the next forced sync, which repairs the whole set.
    sets_synced: bool,
    /// The service sets' members, when they exist (Service traffic is then marked by set
    /// membership and the `filter` table is programmed).
    pub sets_for_services: Option<ServiceSets>,
    /// How long the last sync took, by part.
    pub timing: Timing,
    /// Background applies that failed and were applied again by a forced sync (which then
    /// reported only its own outcome), not yet counted by the caller.
    pub retried_failures: u64,
}

/// How long a sync's parts took (the agent logs a reconcile's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timing {
    /// The hairpin sets.
    pub hairpin_sets: std::time::Duration,
    /// The service sets.
    pub service_sets: std::time::Duration,
    /// The rules (handing them over, or applying them and waiting).
    pub rules: std::time::Duration,
}

impl Masq {
    /// Masquerade state for these settings, applying rules in the caller's thread through the
    /// kernel each call is given.
    pub fn new(fixed: Fixed) -> Self {
        Self {
            fixed,
            locals: LocalSets::default(),
            applied: None,
            rules: Applier::Inline,
            sets: false,
            sets_synced: false,
            sets_for_services: None,
            timing: Timing::default(),
            retried_failures: 0,
        }
    }

    /// Marks Service traffic by set membership and programs the `filter` table
    /// ([`kube_ipvs_host::sets`], [`kube_ipvs_host::filter`]): creates the sets now; if that
    /// fails (no `ip_set` or one of its types), warns and keeps the older `POSTROUTING` rules
    /// without a `filter` table.
    pub fn with_service_sets(mut self, kernel: &mut dyn Kernel) -> Self {
        match ServiceSets::create(kernel) {
            Ok(()) => self.sets_for_services = Some(ServiceSets::default()),
            Err(e) => tracing::warn!(
                "service sets: cannot create the ipsets ({e}); are the ip_set_hash_ip, \
                 ip_set_hash_ipport, ip_set_hash_ipportnet and ip_set_bitmap_port modules \
                 available? Service addresses stay open on every port, \
                 loadBalancerSourceRanges are not enforced, and only --cluster-cidr tells \
                 local Pods"
            ),
        }
        self
    }

    /// Works out these Services' contributions again (hairpin, Local exemptions, filter sets).
    pub fn update<'a>(
        &mut self,
        names: impl IntoIterator<Item = &'a ServiceName> + Clone,
        inputs: &Inputs,
    ) {
        self.locals.update(names.clone(), inputs);
        if let Some(f) = &mut self.sets_for_services {
            let had_v6 = f.has_v6();
            f.update(names, inputs);
            // The first or last IPv6 Service adds or drops the IPv6 rules.
            if had_v6 != f.has_v6() {
                self.locals.changed = true;
            }
        }
    }

    /// Works out every Service again (after a Node change).
    pub fn update_all(&mut self, inputs: &Inputs) {
        self.locals.update_all(inputs);
        if let Some(f) = &mut self.sets_for_services {
            f.update_all(inputs);
        }
    }

    /// Hairpin through `sets` ([`Hairpin::Set`]) unless `--node-pod-cidr` is given. Creates the
    /// sets now; if that fails (no ipset support in the kernel), warns and keeps one rule per
    /// local endpoint. Call before the first [`LocalSets::update`].
    pub fn with_hairpin_sets(mut self, kernel: &mut dyn Kernel) -> Self {
        if !self.fixed.node_pod_cidrs.is_empty() {
            return self;
        }
        match [Family::V4, Family::V6]
            .into_iter()
            .try_for_each(|f| kernel.create_set(ipset::set_name(f), f, SetKind::NetNet))
        {
            Ok(()) => {
                self.sets = true;
                self.locals.in_set = true;
            }
            Err(e) => tracing::warn!(
                "hairpin: cannot create the ipsets ({e}); is the ip_set_hash_netnet module \
                 available? Falling back to one iptables rule per local endpoint"
            ),
        }
        self
    }

    /// Whether hairpin goes through the sets.
    pub fn hairpin_in_set(&self) -> bool {
        self.sets
    }

    /// Brings the sets up to date: when forced, creates them if absent and makes each exactly
    /// the wanted members; otherwise applies the delta since the last change. Returns whether a
    /// member was added or deleted.
    fn sync_sets(&mut self, kernel: &mut dyn Kernel, force: bool) -> Result<bool, String> {
        if !self.sets {
            return Ok(false);
        }
        let locals = &mut self.locals;
        if !force && (!self.sets_synced || locals.refs.delta().is_empty()) {
            // A failed delta waits for the forced sync, which does the whole set.
            if !self.sets_synced {
                locals.refs.clear_delta();
            }
            return Ok(false);
        }
        let mut changed = false;
        let result = (|| {
            for family in [Family::V4, Family::V6] {
                let name = ipset::set_name(family);
                let is_family = |a: &IpAddr| a.is_ipv6() == (family == Family::V6);
                let hairpin = |a: IpAddr| Member::NetNet(Entry::hairpin(a));
                let (add, del): (Vec<Member>, Vec<Member>) = if force {
                    kernel.create_set(name, family, SetKind::NetNet)?;
                    let have: HashSet<Member> = kernel
                        .list_set(name)?
                        .ok_or_else(|| {
                            KernelError::Refused(format!("ipset {name}: the set is gone"))
                        })?
                        .into_iter()
                        .collect();
                    let want: HashSet<Member> = locals
                        .hairpin_members()
                        .filter(is_family)
                        .map(hairpin)
                        .collect();
                    (
                        want.difference(&have).copied().collect(),
                        have.difference(&want).copied().collect(),
                    )
                } else {
                    let mut add = Vec::new();
                    let mut del = Vec::new();
                    for a in locals.refs.delta().iter().filter(|a| is_family(a)) {
                        if locals.refs.held(a) {
                            add.push(hairpin(*a));
                        } else {
                            del.push(hairpin(*a));
                        }
                    }
                    (add, del)
                };
                changed |= super::sets::apply(kernel, name, &add, &del)?;
            }
            Ok::<(), KernelError>(())
        })()
        .map_err(|e| e.to_string());
        locals.refs.clear_delta();
        self.sets_synced = result.is_ok();
        result.map(|()| changed)
    }

    /// The same, applying rules on a worker thread (see the module docs) through `worker`, a
    /// kernel handle of its own. An error if the thread cannot be started.
    pub fn in_background(self, worker: Box<dyn Kernel>) -> Result<Self, String> {
        let rules = match self.rules {
            Applier::Inline => Applier::Worker(Worker::start(worker)?),
            running @ Applier::Worker(_) => running,
        };
        Ok(Self { rules, ..self })
    }

    /// Applies the rules if `force` or what they are built from changed since the last success.
    /// Returns the error, if any, for the caller to count: in the background, a change's own
    /// error comes with a later call.
    pub fn sync(
        &mut self,
        kernel: &mut dyn Kernel,
        inputs: &Inputs,
        force: bool,
    ) -> Result<bool, String> {
        self.sync_with(kernel, inputs, force, force, None)
    }

    /// A reconcile's forced sync: the sets made exact and the rules ensured, but the rules
    /// handed to the worker without waiting when the last apply succeeded (a reconcile re-ensures
    /// the same rules; an error comes with a later call, like a change's). After a failure it
    /// waits, so the fallbacks without the sets can be tried.
    ///
    /// `read`: the service sets as the reconcile's background read found them, after
    /// [`Masq::begin_read`]; without it they are read here.
    pub fn repair(
        &mut self,
        kernel: &mut dyn Kernel,
        inputs: &Inputs,
        read: Option<&SetsRead>,
    ) -> Result<bool, String> {
        let wait = self.applied.is_none();
        self.sync_with(kernel, inputs, true, wait, read)
    }

    /// A background read of the service sets starts now (see [`ServiceSets::sync_read`]).
    /// Says whether there are service sets to read.
    pub fn begin_read(&mut self) -> bool {
        match &mut self.sets_for_services {
            Some(f) => {
                f.begin_read();
                true
            }
            None => false,
        }
    }

    fn sync_with(
        &mut self,
        kernel: &mut dyn Kernel,
        inputs: &Inputs,
        force: bool,
        wait: bool,
        read: Option<&SetsRead>,
    ) -> Result<bool, String> {
        // The sets first: the rules reference them, and a set failure must not keep the other
        // rules from being repaired.
        let start = std::time::Instant::now();
        let mut sets = self.sync_sets(kernel, force);
        self.timing.hairpin_sets = start.elapsed();
        let start = std::time::Instant::now();
        if let Some(f) = &mut self.sets_for_services {
            if f.node_changed(inputs) {
                f.update_all(inputs);
            }
            let filter = match read {
                Some(observed) if force => f.sync_read(kernel, observed),
                _ => f.sync(kernel, force),
            }
            .map_err(|e| format!("filter sets: {e}"));
            sets = match (sets, filter) {
                (Ok(a), Ok(b)) => Ok(a || b),
                (Err(e), Ok(_)) | (Ok(_), Err(e)) => Err(e),
                (Err(a), Err(b)) => Err(format!("{a}; {b}")),
            };
        }
        self.timing.service_sets = start.elapsed();
        let start = std::time::Instant::now();
        let rules = self.sync_rules(kernel, inputs, force, wait);
        self.timing.rules = start.elapsed();
        match (sets, rules) {
            (Ok(a), Ok(b)) => Ok(a || b),
            (Err(e), Ok(_)) | (Ok(_), Err(e)) => Err(e),
            (Err(s), Err(r)) => Err(format!("{s}; {r}")),
        }
    }

    fn sync_rules(
        &mut self,
        kernel: &mut dyn Kernel,
        inputs: &Inputs,
        force: bool,
        wait: bool,
    ) -> Result<bool, String> {
        // A background apply that failed since the last call: the rules are not in place. A
        // change reports it and leaves the rules to the next forced sync; a forced sync applies
        // them again now, waiting, so the fallbacks can be tried.
        let mut wait = wait;
        if let Applier::Worker(w) = &self.rules
            && let Some((_, e)) = w.take_errors().pop()
        {
            self.applied = None;
            if !force {
                return Err(e);
            }
            tracing::warn!(
                "masquerade rules: a background apply failed ({e}); applying them again"
            );
            self.retried_failures += 1;
            wait = true;
        }
        // Nothing the rules are built from changed: the common case of an endpoint change on
        // another node, answered without walking every Service.
        if !force
            && !self.locals.changed
            && self
                .applied
                .as_ref()
                .is_some_and(|a| a.node_ips == node_ips(inputs))
        {
            return Ok(false);
        }
        let mut wanted = self.locals.wanted(inputs, &self.fixed);
        wanted.service_sets = self.sets_for_services.is_some();
        wanted.services_v6 = self
            .sets_for_services
            .as_ref()
            .is_some_and(ServiceSets::has_v6);
        wanted.local_detect = self.fixed.detect_local.for_node(inputs);
        if !force && self.applied.as_ref() == Some(&wanted) {
            return Ok(false);
        }
        // A failed attempt waits for the next reconcile rather than hammering iptables on
        // every change set.
        if !force && self.applied.is_none() {
            return Ok(false);
        }
        let cfg = config(&self.fixed, &wanted);
        let result = match &mut self.rules {
            Applier::Inline => kernel.ensure_rules(&cfg).map_err(|e| e.to_string()),
            Applier::Worker(w) => {
                let seq = w.submit(cfg);
                if wait {
                    // Errors of earlier background applies are superseded by this one's.
                    match w.wait(seq).into_iter().find(|(s, _)| *s == seq) {
                        Some((_, e)) => Err(e),
                        None => Ok(()),
                    }
                } else {
                    Ok(())
                }
            }
        };
        match result {
            Ok(()) => {
                self.applied = Some(wanted);
                Ok(true)
            }
            Err(e) if force && wanted.service_sets => self.without_service_sets(kernel, inputs, e),
            Err(e) if force && wanted.hairpin_set => self.without_sets(kernel, inputs, e),
            Err(e) => {
                self.applied = None;
                Err(e)
            }
        }
    }

    /// A forced apply of rules that use the sets failed: perhaps iptables cannot match sets
    /// (no `xt_set`) although the sets exist. Tries the same rules with one hairpin rule per
    /// local endpoint; if those apply, hairpin stays that way (warned once) so the rest of the
    /// rules (cluster CIDR, NodePorts) are not lost with it. Otherwise set mode is kept and
    /// the first error returned.
    fn without_sets(
        &mut self,
        kernel: &mut dyn Kernel,
        inputs: &Inputs,
        first: String,
    ) -> Result<bool, String> {
        self.locals.in_set = false;
        let mut wanted = self.locals.wanted(inputs, &self.fixed);
        wanted.service_sets = self.sets_for_services.is_some();
        wanted.local_detect = self.fixed.detect_local.for_node(inputs);
        let cfg = config(&self.fixed, &wanted);
        let retry = match &mut self.rules {
            Applier::Inline => kernel.ensure_rules(&cfg).map_err(|e| e.to_string()),
            Applier::Worker(w) => {
                let seq = w.submit(cfg);
                match w.wait(seq).into_iter().find(|(s, _)| *s == seq) {
                    Some((_, e)) => Err(e),
                    None => Ok(()),
                }
            }
        };
        match retry {
            Ok(()) => {
                tracing::warn!(
                    "hairpin: the rule matching the ipsets was refused ({first}); is the xt_set \
                     module available? Falling back to one iptables rule per local endpoint"
                );
                self.sets = false;
                self.locals.refs.clear_delta();
                self.applied = Some(wanted);
                Ok(true)
            }
            Err(_) => {
                self.locals.in_set = true;
                self.locals.changed = true;
                self.applied = None;
                Err(first)
            }
        }
    }

    /// A forced apply of rules using the service sets failed: perhaps iptables lacks a match
    /// or target they use (`set`, `addrtype`, `conntrack`, `REJECT`). Tries the older rules
    /// without them; if those apply, they stay (warned once) so masquerading is not lost.
    /// Otherwise the sets are kept and the first error returned.
    fn without_service_sets(
        &mut self,
        kernel: &mut dyn Kernel,
        inputs: &Inputs,
        first: String,
    ) -> Result<bool, String> {
        let Some(kept) = self.sets_for_services.take() else {
            return Err(first);
        };
        match self.sync_rules(kernel, inputs, true, true) {
            Ok(changed) => {
                tracing::warn!(
                    "service sets: the rules matching them were refused ({first}); are the \
                     xt_set, xt_addrtype, xt_conntrack and REJECT modules available? Service \
                     addresses stay open on every port, loadBalancerSourceRanges are not \
                     enforced, and only --cluster-cidr tells local Pods"
                );
                Ok(changed)
            }
            Err(_) => {
                self.sets_for_services = Some(kept);
                self.locals.changed = true;
                self.applied = None;
                Err(first)
            }
        }
    }

    /// Waits until everything handed to the worker is applied (tests; a no-op inline).
    pub fn settle(&mut self) -> Result<(), String> {
        if let Applier::Worker(w) = &self.rules {
            let seq = w.lock().submitted;
            if let Some((_, e)) = w.wait(seq).pop() {
                self.applied = None;
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::mem::MemKernel;
    use kube_ipvs_diff::{Endpoint, NodeContext, ServiceInfo, ServicePort};

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    fn inputs() -> Inputs {
        let mut node = NodeContext::new("node-1");
        node.node_ips_v4 = vec!["192.168.1.10".parse().expect("literal")];
        Inputs::new(node).expect("node")
    }

    fn lb(policy: TrafficPolicy) -> ServiceInfo {
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
            external_traffic_policy: policy,
            ..ServiceInfo::default()
        }
    }

    fn endpoint(addr: &str, node: &str) -> Endpoint {
        Endpoint {
            node_name: Some(node.into()),
            ..Endpoint::ready(ip(addr), Vec::new())
        }
    }

    fn fixed(pod: &[&str]) -> Fixed {
        Fixed {
            cluster_cidrs: vec!["10.244.0.0/16".parse().expect("literal")],
            masquerade_all: false,
            node_pod_cidrs: pod.iter().map(|c| c.parse().expect("literal")).collect(),
            backend: Backend::Legacy,
            detect_local: DetectLocal::ClusterCidr,
            mark_bit: 14,
            random_fully: true,
            local_marks: Some(0x3ff0_0000),
        }
    }

    #[test]
    fn only_local_policy_services_exempt_their_node_ports_and_external_addresses() {
        let mut inputs = inputs();
        let local = ServiceName::new("default", "local");
        let cluster = ServiceName::new("default", "cluster");
        inputs
            .upsert_service(local.clone(), lb(TrafficPolicy::Local))
            .expect("service");
        inputs
            .upsert_service(cluster.clone(), lb(TrafficPolicy::Cluster))
            .expect("service");
        inputs
            .set_endpoints(
                cluster.clone(),
                vec![
                    endpoint("10.244.1.5", "node-1"),
                    endpoint("10.244.2.5", "node-2"),
                ],
            )
            .expect("endpoints");
        let mut sets = LocalSets::default();
        sets.update([&local, &cluster], &inputs);
        assert!(sets.changed);
        let w = sets.wanted(&inputs, &fixed(&[]));
        // Recomputing a Service whose contribution is the same marks nothing for the rules.
        assert!(!sets.changed);
        sets.update([&cluster], &inputs);
        assert!(!sets.changed, "an unchanged contribution");
        assert_eq!(w.node_ports, vec![(Protocol::Tcp, 30080)]);
        assert_eq!(
            w.virtual_servers,
            vec![(ip("203.0.113.7"), Protocol::Tcp, 80)]
        );
        assert_eq!(
            w.local_endpoints,
            vec![ip("10.244.1.5")],
            "only this node's"
        );
        assert_eq!(w.node_ips, vec![ip("192.168.1.10")]);
        let cfg = config(&fixed(&[]), &w);
        assert_eq!(cfg.hairpin, Hairpin::Endpoints(vec![ip("10.244.1.5")]));
        assert_eq!(cfg.families, vec![Family::V4]);

        // With this node's Pod CIDR, hairpin is one rule whatever the endpoints.
        let pod = fixed(&["10.244.1.0/24"]);
        let w = sets.wanted(&inputs, &pod);
        assert!(w.local_endpoints.is_empty());
        assert!(matches!(config(&pod, &w).hairpin, Hairpin::LocalPodCidrs(c) if c.len() == 1));

        // The Service turning Cluster drops its exemptions.
        inputs
            .upsert_service(local.clone(), lb(TrafficPolicy::Cluster))
            .expect("service");
        sets.update([&local], &inputs);
        assert!(sets.changed, "the exemptions went");
        let w = sets.wanted(&inputs, &fixed(&[]));
        assert!(w.node_ports.is_empty() && w.virtual_servers.is_empty());
    }

    #[test]
    fn rules_are_applied_when_forced_or_changed_and_a_failure_waits_for_a_forced_sync() {
        let rec = MemKernel::default();
        let mut m = Masq::new(fixed(&[]));
        let mut inputs = inputs();
        let calls = || rec.state().rules.len();
        assert_eq!(m.sync(&mut rec.clone(), &inputs, true), Ok(true));
        assert_eq!(
            m.sync(&mut rec.clone(), &inputs, false),
            Ok(false),
            "nothing changed"
        );
        assert_eq!(calls(), 1);
        let local = ServiceName::new("default", "local");
        inputs
            .upsert_service(local.clone(), lb(TrafficPolicy::Local))
            .expect("service");
        m.locals.update([&local], &inputs);
        assert_eq!(
            m.sync(&mut rec.clone(), &inputs, false),
            Ok(true),
            "the Local set changed"
        );
        assert_eq!(calls(), 2);
        assert_eq!(
            rec.state().rules[1].local_node_ports,
            vec![LocalNodePort {
                protocol: Protocol::Tcp,
                port: 30080
            }]
        );
        rec.state().fail_rules = true;
        assert!(m.sync(&mut rec.clone(), &inputs, true).is_err());
        inputs.remove_service(&local);
        m.locals.update([&local], &inputs);
        assert_eq!(
            m.sync(&mut rec.clone(), &inputs, false),
            Ok(false),
            "a failure waits"
        );
        rec.state().fail_rules = false;
        assert_eq!(
            m.sync(&mut rec.clone(), &inputs, true),
            Ok(true),
            "the reconcile retries"
        );
        assert_eq!(calls(), 4);
    }

    #[test]
    fn in_the_background_changes_do_not_wait_forced_syncs_do_and_errors_surface() {
        let rec = MemKernel::default();
        let mut m = Masq::new(fixed(&[]))
            .in_background(Box::new(rec.clone()))
            .expect("worker");
        let mut inputs = inputs();
        let calls = || rec.state().rules.len();
        assert_eq!(m.sync(&mut rec.clone(), &inputs, true), Ok(true));
        assert_eq!(calls(), 1, "a forced sync waits for its apply");

        // While the worker is held inside `ensure`, changes return at once, and of three
        // changes handed over meanwhile only the newest is applied after the held one.
        let held = rec.hold_rules();
        let names: Vec<ServiceName> = (0..4)
            .map(|i| ServiceName::new("default", format!("local{i}")))
            .collect();
        for (i, name) in names.iter().enumerate() {
            let mut svc = lb(TrafficPolicy::Local);
            if let Some(p) = svc.ports.first_mut() {
                p.node_port = Some(30080 + i as u16);
            }
            inputs.upsert_service(name.clone(), svc).expect("service");
            m.locals.update([name], &inputs);
            assert_eq!(
                m.sync(&mut rec.clone(), &inputs, false),
                Ok(true),
                "handed over without waiting"
            );
        }
        drop(held);
        assert_eq!(m.settle(), Ok(()));
        let applied = rec.state().rules.clone();
        assert!(
            applied.len() <= 3,
            "at most the first change (taken before the gate closed) and the newest: {}",
            applied.len()
        );
        assert_eq!(
            applied.last().map(|c| c.local_node_ports.len()),
            Some(4),
            "the newest rules are the last applied"
        );

        // A background failure is reported (here by `settle`; in the agent by the next
        // `sync`) and then waits for a forced sync.
        rec.state().fail_rules = true;
        inputs.remove_service(&names[0]);
        m.locals.update([&names[0]], &inputs);
        assert_eq!(
            m.sync(&mut rec.clone(), &inputs, false),
            Ok(true),
            "handed over"
        );
        assert!(m.settle().is_err(), "the background apply failed");
        let n = calls();
        inputs.remove_service(&names[1]);
        m.locals.update([&names[1]], &inputs);
        assert_eq!(
            m.sync(&mut rec.clone(), &inputs, false),
            Ok(false),
            "a failure waits"
        );
        assert_eq!(m.settle(), Ok(()));
        assert_eq!(calls(), n, "nothing applied after the failure");
        rec.state().fail_rules = false;
        assert_eq!(
            m.sync(&mut rec.clone(), &inputs, true),
            Ok(true),
            "the reconcile retries"
        );
        assert_eq!(calls(), n + 1);
    }

    /// A reconcile's repair hands the same rules to a busy worker and returns (the agent's loop
    /// has changes to program); after a failed apply it waits for its own, so it can report
    /// it and try the fallbacks.
    #[test]
    fn a_repair_waits_for_the_worker_only_after_a_failure() {
        let rec = MemKernel::default();
        let mut m = Masq::new(fixed(&[]))
            .in_background(Box::new(rec.clone()))
            .expect("worker");
        let inputs = inputs();
        let calls = || rec.state().rules.len();
        assert_eq!(m.sync(&mut rec.clone(), &inputs, true), Ok(true));
        assert_eq!(calls(), 1);

        // Held inside `ensure`: a repair that waited would not return until released.
        std::thread::scope(|s| {
            let held = rec.hold_rules();
            let (tx, rx) = std::sync::mpsc::channel();
            let (m, inputs, mut k) = (&mut m, &inputs, rec.clone());
            s.spawn(move || tx.send(m.repair(&mut k, inputs, None)));
            let repaired = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("the repair returned while the worker was busy");
            drop(held);
            assert_eq!(repaired, Ok(true));
        });
        assert_eq!(m.settle(), Ok(()));
        assert_eq!(calls(), 2, "the repair's rules were applied after all");

        // A repair whose background apply failed: the next repair applies the rules again at
        // once, waiting, and counts the failure it retried.
        rec.state().fail_rules = true;
        assert_eq!(
            m.repair(&mut rec.clone(), &inputs, None),
            Ok(true),
            "handed over"
        );
        if let Applier::Worker(w) = &m.rules {
            w.wait_finished();
        }
        rec.state().fail_rules = false;
        let n = calls();
        assert_eq!(m.repair(&mut rec.clone(), &inputs, None), Ok(true));
        assert!(calls() > n, "applied again before the repair returned");
        assert_eq!(m.retried_failures, 1);

        // After a failure the repair waits and reports its own outcome.
        rec.state().fail_rules = true;
        assert_eq!(
            m.repair(&mut rec.clone(), &inputs, None),
            Ok(true),
            "handed over"
        );
        assert!(m.settle().is_err(), "the background apply failed");
        assert!(
            m.repair(&mut rec.clone(), &inputs, None).is_err(),
            "waited for its own apply, which failed"
        );
        rec.state().fail_rules = false;
        let n = calls();
        assert_eq!(m.repair(&mut rec.clone(), &inputs, None), Ok(true));
        assert_eq!(calls(), n + 1, "applied before the repair returned");
    }

    fn cluster_ip(addr: &str) -> ServiceInfo {
        ServiceInfo {
            kind: ServiceKind::ClusterIp,
            cluster_ips: vec![ip(addr)],
            ports: vec![ServicePort {
                name: String::new(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: None,
            }],
            ..ServiceInfo::default()
        }
    }

    /// A Masq in set mode over in-memory sets, with a service `default/a` whose endpoints are
    /// 10.244.1.5 on this node and 10.244.2.5 on another, after the startup sync.
    /// Sets a Service's endpoints, as (address, node) pairs, and updates its contribution.
    fn set_local(m: &mut Masq, inputs: &mut Inputs, name: &ServiceName, eps: &[(&str, &str)]) {
        inputs
            .set_endpoints(
                name.clone(),
                eps.iter().map(|(a, n)| endpoint(a, n)).collect::<Vec<_>>(),
            )
            .expect("endpoints");
        m.locals.update([name], inputs);
    }

    fn set_mode() -> (Masq, MemKernel, MemKernel, Inputs, ServiceName) {
        let rec = MemKernel::default();
        let sets = rec.clone();
        let mut m = Masq::new(fixed(&[])).with_hairpin_sets(&mut sets.clone());
        assert!(m.hairpin_in_set());
        let mut inputs = inputs();
        let a = ServiceName::new("default", "a");
        inputs
            .upsert_service(a.clone(), cluster_ip("10.96.0.1"))
            .expect("service");
        set_local(
            &mut m,
            &mut inputs,
            &a,
            &[("10.244.1.5", "node-1"), ("10.244.2.5", "node-2")],
        );
        assert_eq!(m.sync(&mut sets.clone(), &inputs, true), Ok(true));
        (m, rec, sets, inputs, a)
    }

    #[test]
    fn with_the_service_sets_a_new_service_is_a_set_delta_and_refused_set_rules_fall_back() {
        let k = MemKernel::default();
        let mut m = Masq::new(fixed(&[]))
            .with_hairpin_sets(&mut k.clone())
            .with_service_sets(&mut k.clone());
        let mut inputs = inputs();
        for i in 0..1000u32 {
            let name = ServiceName::new("default", format!("s{i}"));
            let vip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
            inputs
                .upsert_service(name, cluster_ip(&vip))
                .expect("service");
        }
        m.update_all(&inputs);
        assert_eq!(m.sync(&mut k.clone(), &inputs, true), Ok(true));
        let applied = k.state().rules.len();
        let last = k.state().rules.last().cloned().expect("rules");
        assert!(last.service_sets);
        assert_eq!(last.families, vec![Family::V4]);

        // The 1,001st Service: three members, one message each, and no rules.
        k.state().set_log.clear();
        let new = ServiceName::new("default", "new");
        inputs
            .upsert_service(new.clone(), cluster_ip("10.96.9.9"))
            .expect("service");
        m.update([&new], &inputs);
        assert_eq!(m.sync(&mut k.clone(), &inputs, false), Ok(true));
        assert_eq!(k.state().rules.len(), applied, "no iptables-restore");
        let mut log = k.state().set_log.clone();
        log.sort();
        assert_eq!(
            log,
            [
                "add KUBE-IPVS-ADDRS 10.96.9.9",
                "add KUBE-IPVS-CLUSTER-IPS 10.96.9.9,tcp:80",
                "add KUBE-IPVS-SERVICES 10.96.9.9,tcp:80"
            ]
        );

        // iptables refusing the set matches: the older rules, without the sets, once.
        k.state().refuse_service_set_rules = true;
        assert_eq!(m.sync(&mut k.clone(), &inputs, true), Ok(true));
        assert!(!k.state().rules.last().expect("rules").service_sets);
        assert!(m.sets_for_services.is_none());
    }

    #[test]
    fn rules_refused_with_the_set_fall_back_to_endpoint_rules_and_other_failures_do_not() {
        let (mut m, rec, sets, inputs, _a) = set_mode();
        let last = || rec.state().rules.last().cloned().expect("a call");
        rec.state().refuse_set_rules = true;
        assert_eq!(
            m.sync(&mut sets.clone(), &inputs, true),
            Ok(true),
            "the fallback applied"
        );
        assert!(!m.hairpin_in_set());
        assert_eq!(
            last().hairpin,
            Hairpin::Endpoints(vec![ip("10.244.1.5")]),
            "node-1's endpoint as its own rule, with the other rules"
        );
        assert_eq!(m.sync(&mut sets.clone(), &inputs, true), Ok(true));
        assert_eq!(last().hairpin, Hairpin::Endpoints(vec![ip("10.244.1.5")]));

        // iptables itself failing is not a reason to leave the sets.
        let (mut m, rec, sets, inputs, _a) = set_mode();
        rec.state().fail_rules = true;
        assert!(m.sync(&mut sets.clone(), &inputs, true).is_err());
        assert!(m.hairpin_in_set());
        rec.state().fail_rules = false;
        assert_eq!(m.sync(&mut sets.clone(), &inputs, true), Ok(true));
        assert_eq!(
            rec.state().rules.last().expect("a call").hairpin,
            Hairpin::Set
        );
    }

    #[test]
    fn in_set_mode_an_endpoint_change_is_a_set_delta_and_no_rules_apply() {
        let (mut m, rec, sets, mut inputs, a) = set_mode();
        let calls = || rec.state().rules.clone();
        // Startup: both sets made exact, then one rule per family matching the set.
        assert_eq!(
            std::mem::take(&mut sets.state().set_log),
            [
                "list KUBE-IPVS-HAIRPIN",
                "add KUBE-IPVS-HAIRPIN 10.244.1.5,10.244.1.5",
                "list KUBE-IPVS-HAIRPIN6"
            ]
        );
        assert_eq!(sets.state().set_members(Family::V4), [ip("10.244.1.5")]);
        assert_eq!(calls().len(), 1);
        assert_eq!(calls()[0].hairpin, Hairpin::Set);

        // Another endpoint on this node: one add, no rules.
        set_local(
            &mut m,
            &mut inputs,
            &a,
            &[
                ("10.244.1.5", "node-1"),
                ("10.244.1.6", "node-1"),
                ("10.244.2.5", "node-2"),
            ],
        );
        assert_eq!(m.sync(&mut sets.clone(), &inputs, false), Ok(true));
        assert_eq!(
            std::mem::take(&mut sets.state().set_log),
            ["add KUBE-IPVS-HAIRPIN 10.244.1.6,10.244.1.6"]
        );
        assert_eq!(
            calls().len(),
            1,
            "no iptables-restore for an endpoint change"
        );

        // One goes: one delete, no rules. An endpoint elsewhere changing: nothing at all.
        set_local(
            &mut m,
            &mut inputs,
            &a,
            &[("10.244.1.6", "node-1"), ("10.244.2.6", "node-2")],
        );
        assert_eq!(m.sync(&mut sets.clone(), &inputs, false), Ok(true));
        assert_eq!(
            std::mem::take(&mut sets.state().set_log),
            ["del KUBE-IPVS-HAIRPIN 10.244.1.5,10.244.1.5"]
        );
        assert_eq!(sets.state().set_members(Family::V4), [ip("10.244.1.6")]);
        assert_eq!(m.sync(&mut sets.clone(), &inputs, false), Ok(false));
        assert_eq!(
            std::mem::take(&mut sets.state().set_log),
            Vec::<String>::new()
        );
        assert_eq!(calls().len(), 1);

        // The first IPv6 endpoint needs the IPv6 rules: the one rules change, then deltas.
        set_local(
            &mut m,
            &mut inputs,
            &a,
            &[("10.244.1.6", "node-1"), ("fd00:10:244:1::6", "node-1")],
        );
        assert_eq!(m.sync(&mut sets.clone(), &inputs, false), Ok(true));
        assert_eq!(
            std::mem::take(&mut sets.state().set_log),
            ["add KUBE-IPVS-HAIRPIN6 fd00:10:244:1::6,fd00:10:244:1::6"]
        );
        assert_eq!(calls().len(), 2);
        assert_eq!(calls()[1].families, [Family::V4, Family::V6]);
        assert_eq!(calls()[1].hairpin, Hairpin::Set);
    }

    #[test]
    fn an_address_shared_by_two_services_stays_until_both_drop_it() {
        let (mut m, _rec, sets, mut inputs, a) = set_mode();
        let b = ServiceName::new("default", "b");
        inputs
            .upsert_service(b.clone(), cluster_ip("10.96.0.2"))
            .expect("service");
        set_local(&mut m, &mut inputs, &b, &[("10.244.1.5", "node-1")]);
        assert_eq!(
            m.sync(&mut sets.clone(), &inputs, false),
            Ok(false),
            "already a member"
        );
        std::mem::take(&mut sets.state().set_log);

        set_local(&mut m, &mut inputs, &a, &[]);
        assert_eq!(
            m.sync(&mut sets.clone(), &inputs, false),
            Ok(false),
            "b still has it"
        );
        assert_eq!(sets.state().set_members(Family::V4), [ip("10.244.1.5")]);

        inputs.remove_service(&b);
        m.locals.update([&b], &inputs);
        assert_eq!(m.sync(&mut sets.clone(), &inputs, false), Ok(true));
        assert_eq!(
            std::mem::take(&mut sets.state().set_log),
            ["del KUBE-IPVS-HAIRPIN 10.244.1.5,10.244.1.5"]
        );
        assert!(sets.state().set_members(Family::V4).is_empty());

        // A Node change recomputes everything and keeps the counts right.
        inputs
            .set_endpoints(
                a.clone(),
                vec![
                    endpoint("10.244.1.7", "node-1"),
                    endpoint("10.244.1.7", "node-1"),
                ],
            )
            .expect("endpoints");
        m.locals.update_all(&inputs);
        assert_eq!(m.sync(&mut sets.clone(), &inputs, false), Ok(true));
        assert_eq!(sets.state().set_members(Family::V4), [ip("10.244.1.7")]);
        set_local(&mut m, &mut inputs, &a, &[]);
        assert_eq!(m.sync(&mut sets.clone(), &inputs, false), Ok(true));
        assert!(
            sets.state().set_members(Family::V4).is_empty(),
            "counted once per Service"
        );
    }

    #[test]
    fn a_forced_sync_repairs_the_set_and_a_failed_delta_waits_for_it() {
        let (mut m, rec, sets, mut inputs, a) = set_mode();
        // Someone flushes the set and adds a stranger.
        {
            let mut st = sets.state();
            let (_, set) = st.sets.get_mut(ipset::SET_V4).expect("the hairpin set");
            set.clear();
            set.insert(Member::NetNet(Entry::hairpin(ip("192.0.2.99"))));
        }
        std::mem::take(&mut sets.state().set_log);
        assert_eq!(m.sync(&mut sets.clone(), &inputs, true), Ok(true));
        assert_eq!(sets.state().set_members(Family::V4), [ip("10.244.1.5")]);
        let log = std::mem::take(&mut sets.state().set_log);
        assert!(
            log.contains(&"del KUBE-IPVS-HAIRPIN 192.0.2.99,192.0.2.99".to_owned()),
            "{log:?}"
        );
        assert!(
            log.contains(&"add KUBE-IPVS-HAIRPIN 10.244.1.5,10.244.1.5".to_owned()),
            "{log:?}"
        );

        // A delta that fails is reported, the next deltas wait, the forced sync repairs.
        sets.state().fail_set_changes = true;
        set_local(&mut m, &mut inputs, &a, &[("10.244.1.8", "node-1")]);
        assert!(m.sync(&mut sets.clone(), &inputs, false).is_err());
        sets.state().fail_set_changes = false;
        set_local(&mut m, &mut inputs, &a, &[("10.244.1.9", "node-1")]);
        std::mem::take(&mut sets.state().set_log);
        assert_eq!(
            m.sync(&mut sets.clone(), &inputs, false),
            Ok(false),
            "waits for the reconcile"
        );
        assert!(std::mem::take(&mut sets.state().set_log).is_empty());
        assert_eq!(m.sync(&mut sets.clone(), &inputs, true), Ok(true));
        assert_eq!(sets.state().set_members(Family::V4), [ip("10.244.1.9")]);
        // The rules were re-ensured by each forced sync, never by an endpoint change.
        assert_eq!(rec.state().rules.len(), 3);
    }

    #[test]
    fn without_ipset_support_hairpin_falls_back_to_endpoint_rules() {
        let rec = MemKernel::default();
        let sets = rec.clone();
        sets.state().fail_set_create = true;
        let mut m = Masq::new(fixed(&[])).with_hairpin_sets(&mut sets.clone());
        assert!(!m.hairpin_in_set());
        let mut inputs = inputs();
        let a = ServiceName::new("default", "a");
        inputs
            .upsert_service(a.clone(), cluster_ip("10.96.0.1"))
            .expect("service");
        set_local(&mut m, &mut inputs, &a, &[("10.244.1.5", "node-1")]);
        assert_eq!(m.sync(&mut sets.clone(), &inputs, true), Ok(true));
        assert_eq!(
            rec.state().rules[0].hairpin,
            Hairpin::Endpoints(vec![ip("10.244.1.5")])
        );
        assert!(std::mem::take(&mut sets.state().set_log).is_empty());

        // With --node-pod-cidr no set is made at all.
        let sets = MemKernel::default();
        let m = Masq::new(fixed(&["10.244.1.0/24"])).with_hairpin_sets(&mut sets.clone());
        assert!(!m.hairpin_in_set());
        assert!(sets.state().sets.is_empty());
    }
}
