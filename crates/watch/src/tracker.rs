//! The tracker: the translated state of every Service, EndpointSlice and the Node, and the
//! change sets that bring a consumer up to date with it.
//!
//! It plays the role of kube-rs's reflector store, keyed the way the engine needs (slices by
//! their Service), and is changed by plain synchronous methods that mirror the watcher's
//! events (`Init`/`InitApply`/`InitDone` as a relist, `Apply`, `Delete`), so tests drive it
//! without a server. Both sources feed it.
//!
//! **Invariant: only the API's own word removes anything.** A Service leaves the change
//! stream when a watch event deletes it or a completed relist no longer has it; watch errors,
//! outages and bad objects never remove state. A bad update keeps the last good translation.
//!
//! It also carries, per Service, the trigger times of the slice changes behind each change set
//! (the `endpoints.kubernetes.io/last-change-trigger-time` annotation), so the agent can export
//! kube-proxy's `kubeproxy_network_programming_duration_seconds`. The rules are kube-proxy's
//! (`pkg/proxy/endpointschangetracker.go`): a slice update records its trigger time only if it
//! changed what the proxy holds for that slice; every trigger time of a Service is kept until
//! it is handed out, so coalesced changes are each measured; trigger times from before the
//! tracker started are dropped (they belong to changes an earlier proxy, or nobody, programmed,
//! and would make every restart look like a slow sync); and deleting a slice forgets the
//! Service's pending trigger times, since a deleted object's annotation dates from its last
//! update, not from the deletion.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_ipvs_diff::{Endpoint, Inputs, ServiceInfo, ServiceName};

use crate::translate::{
    NodeInfo, TranslateOptions, merge_slices, service_name, translate_node, translate_service,
    translate_slice,
};

/// The full current state of one changed Service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceChange {
    /// The Service, or `None` if it is gone or no longer for this proxy.
    pub service: Option<ServiceInfo>,
    /// Its endpoints merged over all its slices (see [`merge_slices`]); empty if none. Shared
    /// with the tracker's copy of its slice when it has one.
    pub endpoints: Arc<[Endpoint]>,
}

/// What changed since the previous change set, each entry with its full new state, so a
/// consumer that applies change sets in order holds exactly the tracker's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeSet {
    /// Whether this is the first change set: it carries every Service known at the first sync.
    pub initial: bool,
    /// The changed Services.
    pub services: BTreeMap<ServiceName, ServiceChange>,
    /// This node's new zone and addresses, if they changed.
    pub node: Option<NodeInfo>,
    /// For Services in [`ChangeSet::services`]: the trigger times of the slice changes this
    /// change set carries, oldest first as they arrived, one per change (coalesced changes
    /// each keep theirs). Services without a (valid, recent) trigger time are absent.
    pub trigger_times: BTreeMap<ServiceName, Vec<SystemTime>>,
}

impl ChangeSet {
    /// Applies the change set to the engine's store. Returns the model's rejections, which
    /// translation already screens for, so they are unexpected; the rest is applied anyway.
    pub fn apply_to(&self, inputs: &mut Inputs) -> Vec<kube_ipvs_diff::Error> {
        self.clone().move_into(inputs)
    }

    /// Like [`ChangeSet::apply_to`], but moves each Service's state into `inputs` instead of
    /// copying it; afterwards every entry of [`ChangeSet::services`] is empty (its key, the
    /// changed Service's name, stays). The agent uses this so the first change set, which
    /// carries the whole cluster, is never held twice.
    pub fn move_into(&mut self, inputs: &mut Inputs) -> Vec<kube_ipvs_diff::Error> {
        let mut errors = Vec::new();
        if let Some(n) = &self.node {
            let mut ctx = inputs.node().clone();
            ctx.zone.clone_from(&n.zone);
            ctx.node_ips_v4.clone_from(&n.ips_v4);
            ctx.node_ips_v6.clone_from(&n.ips_v6);
            ctx.pod_cidrs.clone_from(&n.pod_cidrs);
            if let Err(e) = inputs.set_node(ctx) {
                errors.push(e);
            }
        }
        for (name, change) in &mut self.services {
            match change.service.take() {
                Some(info) => {
                    if let Err(e) = inputs.upsert_service(name.clone(), info) {
                        errors.push(e);
                    }
                }
                None => inputs.remove_service(name),
            }
            if let Err(e) =
                inputs.set_endpoints(name.clone(), std::mem::take(&mut change.endpoints))
            {
                errors.push(e);
            }
        }
        errors
    }
}

/// Translated state and dirty tracking. A Service is dirty only when what the tracker holds for
/// it changed, so no copy of what was handed out is kept (at 10,000 Services that copy was a
/// fifth of the agent's memory); a change undone before the next change set (A, B, A) is
/// handed out once as a no-op, which the engine's diff turns into no operation.
#[derive(Debug)]
pub struct Tracker {
    opts: TranslateOptions,
    services: HashMap<ServiceName, ServiceInfo>,
    /// Slices by Service, each by slice name, so merging is in slice-name order.
    slices: HashMap<ServiceName, BTreeMap<String, Arc<[Endpoint]>>>,
    /// Which Service a slice (namespace, name) was filed under, in case its label changes.
    slice_owner: HashMap<(String, String), ServiceName>,
    node: Option<NodeInfo>,
    node_dirty: bool,
    dirty: BTreeSet<ServiceName>,
    services_listed: bool,
    slices_listed: bool,
    sent_initial: bool,
    /// How long the first change set may still wait for the Node, while it has not arrived.
    node_wait: Option<Duration>,
    /// Wall-clock time the tracker started; older trigger times are not measured.
    started: SystemTime,
    /// Trigger times of slice changes not yet handed out, by Service.
    triggers: HashMap<ServiceName, Vec<SystemTime>>,
    /// A Service relist in progress: its objects translated as they arrive.
    services_relist: Option<HashMap<ServiceName, ServiceInfo>>,
    /// An EndpointSlice relist in progress.
    slices_relist: Option<SliceRelist>,
    /// What is left out right now, whole or in part, by (kind, namespace, name).
    skipped: BTreeMap<(&'static str, String, String), Skipped>,
}

/// An object the tracker left out, whole (it did not translate) or in part (some of its
/// endpoints), with each reason in the words the agent logs. The debugging commands print these;
/// the agent logs each as it happens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// `Service`, `EndpointSlice` or `Node`.
    pub kind: &'static str,
    /// The object's namespace (empty for a Node).
    pub namespace: String,
    /// The object's name.
    pub name: String,
    /// The Service it is or belongs to, when known (an EndpointSlice's service-name label).
    pub service: Option<ServiceName>,
    /// A Service's addresses as written (`clusterIPs`, `externalIPs`, load-balancer IPs), even
    /// unparsable ones: which `IP:PORT` it would have been.
    pub addresses: Vec<String>,
    /// Whether the whole object was left out (else only what `messages` name).
    pub whole: bool,
    /// Why, one line each, as the agent logs them.
    pub messages: Vec<String>,
}

/// The words the agent logs for an object left out whole.
fn skip_line(e: &crate::Error) -> String {
    format!("skipping bad object, keeping its last good state: {e}")
}

/// A Service's addresses as written.
fn raw_addresses(svc: &Service) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(spec) = &svc.spec {
        out.extend(spec.cluster_ips.iter().flatten().cloned());
        out.extend(spec.cluster_ip.iter().cloned());
        out.extend(spec.external_ips.iter().flatten().cloned());
        out.extend(spec.load_balancer_ip.iter().cloned());
    }
    if let Some(lb) = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()) {
        out.extend(lb.ingress.iter().flatten().filter_map(|i| i.ip.clone()));
    }
    out.sort();
    out.dedup();
    out
}

/// The Service an EndpointSlice says it belongs to (its service-name label).
fn slice_service(slice: &EndpointSlice) -> Option<ServiceName> {
    let (ns, _) = crate::translate::slice_key(slice);
    slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(crate::translate::SERVICE_NAME_LABEL))
        .map(|svc| ServiceName::new(ns, svc.clone()))
}

/// An EndpointSlice relist in progress. Objects are translated as they arrive, so a relist of a
/// large cluster never holds the raw objects, only the model; nothing of it is visible until
/// it completes.
#[derive(Debug, Default)]
struct SliceRelist {
    slices: HashMap<ServiceName, BTreeMap<String, Arc<[Endpoint]>>>,
    owners: HashMap<(String, String), ServiceName>,
    /// Trigger times of the slices it changes, recorded when it completes.
    triggers: Vec<(ServiceName, SystemTime)>,
}

impl Tracker {
    /// An empty tracker, started now (by the system clock; see [`Tracker::started_at`]).
    pub fn new(opts: TranslateOptions) -> Self {
        Self::started_at(opts, SystemTime::now())
    }

    /// An empty tracker that measures only trigger times after `started`. The clock is
    /// injected so tests can use fixed times.
    pub fn started_at(opts: TranslateOptions, started: SystemTime) -> Self {
        Self {
            opts,
            services: HashMap::new(),
            slices: HashMap::new(),
            slice_owner: HashMap::new(),
            node: None,
            node_dirty: false,
            dirty: BTreeSet::new(),
            services_listed: false,
            slices_listed: false,
            sent_initial: false,
            node_wait: None,
            started,
            triggers: HashMap::new(),
            services_relist: None,
            slices_relist: None,
            skipped: BTreeMap::new(),
        }
    }

    /// What is left out right now, whole or in part, in kind, namespace, name order.
    pub fn skipped(&self) -> Vec<Skipped> {
        self.skipped.values().cloned().collect()
    }

    /// Records (and logs) what a Service's translation left out, or forgets it. A Service that
    /// translated cleanly costs nothing here unless something is recorded (the common case of
    /// every event).
    fn note_service(
        &mut self,
        svc: &Service,
        name: &ServiceName,
        outcome: std::result::Result<&[String], &crate::Error>,
    ) {
        if matches!(outcome, Ok([])) {
            self.forget("Service", &name.namespace, &name.name);
            return;
        }
        let (ns, n) = (name.namespace.clone(), name.name.clone());
        self.note(
            "Service",
            ns,
            n,
            Some(name.clone()),
            raw_addresses(svc),
            outcome,
        );
    }

    /// Records (and logs) what a slice's translation left out, or forgets it; `key` is the
    /// slice's namespace and name, which the caller has already.
    fn note_slice(
        &mut self,
        slice: &EndpointSlice,
        key: &(String, String),
        outcome: std::result::Result<&[String], &crate::Error>,
    ) {
        if matches!(outcome, Ok([])) {
            self.forget("EndpointSlice", &key.0, &key.1);
            return;
        }
        let (ns, name) = key.clone();
        self.note(
            "EndpointSlice",
            ns,
            name,
            slice_service(slice),
            Vec::new(),
            outcome,
        );
    }

    /// Records (and logs) what was left out of one object: all of it (`Err`) or the parts its
    /// warnings name (no warnings: any earlier record is forgotten).
    fn note(
        &mut self,
        kind: &'static str,
        namespace: String,
        name: String,
        service: Option<ServiceName>,
        addresses: Vec<String>,
        outcome: std::result::Result<&[String], &crate::Error>,
    ) {
        let key = (kind, namespace.clone(), name.clone());
        let (whole, messages) = match outcome {
            Ok([]) => {
                self.skipped.remove(&key);
                return;
            }
            Ok(warnings) => (
                false,
                warnings
                    .iter()
                    .map(|w| format!("{kind} {namespace}/{name}: {w}"))
                    .collect::<Vec<_>>(),
            ),
            Err(e) => (true, vec![skip_line(e)]),
        };
        for m in &messages {
            tracing::warn!("{m}");
        }
        self.skipped.insert(
            key,
            Skipped {
                kind,
                namespace,
                name,
                service,
                addresses,
                whole,
                messages,
            },
        );
    }

    /// Forgets what was left out of an object that is fine now, deleted or no longer ours.
    fn forget(&mut self, kind: &'static str, namespace: &str, name: &str) {
        // Nothing is recorded in a healthy cluster: no key is built for every event then.
        if !self.skipped.is_empty() {
            self.skipped
                .remove(&(kind, namespace.to_owned(), name.to_owned()));
        }
    }

    /// Records a changed slice's trigger time for its Service, if it is after the start.
    /// kube-proxy compares with `After`, so a time equal to the start is dropped too.
    fn note_trigger(&mut self, service: &ServiceName, at: Option<SystemTime>) {
        if let Some(at) = at.filter(|t| *t > self.started) {
            self.triggers.entry(service.clone()).or_default().push(at);
        }
    }

    /// The list the tracker holds for this slice, if it already holds exactly these endpoints
    /// (both merged, so a slice that only reordered its endpoints is no change) under this
    /// Service: then the update changes nothing the proxy uses (kube-proxy's `esInfoChanged` is
    /// false), its trigger time is not recorded, and the held list is kept (the engine's inputs
    /// may share it).
    fn held(
        &self,
        key: &(String, String),
        service: &ServiceName,
        endpoints: &[Endpoint],
    ) -> Option<&Arc<[Endpoint]>> {
        if self.slice_owner.get(key) != Some(service) {
            return None;
        }
        self.slices
            .get(service)
            .and_then(|m| m.get(&key.1))
            .filter(|e| ***e == *endpoints)
    }

    /// Whether both Services and EndpointSlices have been listed once, and the Node has
    /// arrived unless it is not awaited ([`Tracker::await_node`]).
    pub fn synced(&self) -> bool {
        self.services_listed && self.slices_listed && self.node_wait.is_none()
    }

    /// Holds the first change set until this node's Node arrives, for at most `wait`; the
    /// driver ([`crate::driver::drive`]) gives up after that with a warning.
    pub fn await_node(&mut self, wait: Duration) {
        if self.node.is_none() {
            self.node_wait = Some(wait);
        }
    }

    /// How long the first change set waits for the Node, if it does.
    pub fn node_awaited(&self) -> Option<Duration> {
        self.node_wait
    }

    /// Stops waiting for the Node: the first change set goes without it.
    pub fn stop_awaiting_node(&mut self) {
        self.node_wait = None;
    }

    /// Whether a change set is due: synced, and something may have changed.
    pub fn has_pending(&self) -> bool {
        self.synced() && (!self.dirty.is_empty() || self.node_dirty || !self.sent_initial)
    }

    /// A Service was added or modified.
    pub fn apply_service(&mut self, svc: &Service) {
        let name = service_name(svc);
        match translate_service(svc, &self.opts) {
            Ok(Some(t)) => {
                self.note_service(svc, &name, Ok(&t.warnings));
                if self.services.get(&t.name) != Some(&t.info) {
                    self.services.insert(t.name.clone(), t.info);
                    self.dirty.insert(t.name);
                }
            }
            Ok(None) => {
                // Became headless, ExternalName or another proxy's: no longer ours.
                self.forget("Service", &name.namespace, &name.name);
                if self.services.remove(&name).is_some() {
                    self.dirty.insert(name);
                }
            }
            Err(e) => self.note_service(svc, &name, Err(&e)),
        }
    }

    /// A Service was deleted.
    pub fn delete_service(&mut self, svc: &Service) {
        let name = service_name(svc);
        self.forget("Service", &name.namespace, &name.name);
        if self.services.remove(&name).is_some() {
            self.dirty.insert(name);
        }
    }

    /// A complete list of Services: replaces the set, so Services missing from it are removed.
    /// A bad object keeps its previous translation. The same as [`Tracker::begin_services`],
    /// [`Tracker::list_service`] for each, then [`Tracker::end_services`].
    pub fn relist_services(&mut self, list: &[Service]) {
        self.begin_services();
        for svc in list {
            self.list_service(svc);
        }
        self.end_services();
    }

    /// A relist of Services starts (a watcher's `Init`); one already in progress is dropped.
    pub fn begin_services(&mut self) {
        self.services_relist = Some(HashMap::new());
        // Each bad object of the list is noted again as it arrives; those gone are forgotten.
        self.skipped.retain(|k, _| k.0 != "Service");
    }

    /// One object of the relist in progress (`InitApply`), translated now and kept only as
    /// the model until the relist completes.
    pub fn list_service(&mut self, svc: &Service) {
        let name = service_name(svc);
        match translate_service(svc, &self.opts) {
            Ok(Some(t)) => {
                self.note_service(svc, &name, Ok(&t.warnings));
                let next = self.services_relist.get_or_insert_with(HashMap::new);
                next.insert(t.name, t.info);
            }
            Ok(None) => {}
            Err(e) => {
                self.note_service(svc, &name, Err(&e));
                let old = self.services.get(&name).cloned();
                let next = self.services_relist.get_or_insert_with(HashMap::new);
                if let Some(old) = old {
                    next.insert(name, old);
                }
            }
        }
    }

    /// The relist is complete (`InitDone`): its Services replace the set in one step.
    pub fn end_services(&mut self) {
        let next = self.services_relist.take().unwrap_or_default();
        let old = std::mem::replace(&mut self.services, next);
        for (name, info) in &self.services {
            if old.get(name) != Some(info) {
                self.dirty.insert(name.clone());
            }
        }
        for name in old.keys() {
            if !self.services.contains_key(name) {
                self.dirty.insert(name.clone());
            }
        }
        self.services_listed = true;
    }

    fn remove_slice_key(&mut self, key: &(String, String)) {
        if let Some(owner) = self.slice_owner.remove(key) {
            if let Some(m) = self.slices.get_mut(&owner) {
                m.remove(&key.1);
                if m.is_empty() {
                    self.slices.remove(&owner);
                }
            }
            self.dirty.insert(owner);
        }
    }

    /// An EndpointSlice was added or modified.
    pub fn apply_slice(&mut self, slice: &EndpointSlice) {
        let key = crate::translate::slice_key(slice);
        match translate_slice(slice, &self.opts) {
            Ok(Some(t)) => {
                self.note_slice(slice, &key, Ok(&t.warnings));
                if self.held(&key, &t.service, &t.endpoints).is_some() {
                    return;
                }
                self.note_trigger(&t.service, t.trigger_time);
                self.remove_slice_key(&key);
                self.slices
                    .entry(t.service.clone())
                    .or_default()
                    .insert(key.1.clone(), t.endpoints);
                self.slice_owner.insert(key, t.service.clone());
                self.dirty.insert(t.service);
            }
            Ok(None) => {
                self.forget("EndpointSlice", &key.0, &key.1);
                self.remove_slice_key(&key);
            }
            Err(e) => self.note_slice(slice, &key, Err(&e)),
        }
    }

    /// An EndpointSlice was deleted. Its Service's pending trigger times are forgotten, as
    /// kube-proxy does: the deleted object's annotation is from its last update.
    pub fn delete_slice(&mut self, slice: &EndpointSlice) {
        let key = crate::translate::slice_key(slice);
        self.forget("EndpointSlice", &key.0, &key.1);
        if let Some(owner) = self.slice_owner.get(&key) {
            self.triggers.remove(owner);
        }
        self.remove_slice_key(&key);
    }

    /// A complete list of EndpointSlices: replaces the set. The same as
    /// [`Tracker::begin_slices`], [`Tracker::list_slice`] for each, then [`Tracker::end_slices`].
    pub fn relist_slices(&mut self, list: &[EndpointSlice]) {
        self.begin_slices();
        for slice in list {
            self.list_slice(slice);
        }
        self.end_slices();
    }

    /// A relist of EndpointSlices starts; one already in progress is dropped.
    pub fn begin_slices(&mut self) {
        self.slices_relist = Some(SliceRelist::default());
        self.skipped.retain(|k, _| k.0 != "EndpointSlice");
    }

    /// One object of the slice relist in progress, translated now.
    pub fn list_slice(&mut self, slice: &EndpointSlice) {
        let key = crate::translate::slice_key(slice);
        let (service, endpoints) = match translate_slice(slice, &self.opts) {
            Ok(Some(t)) => {
                self.note_slice(slice, &key, Ok(&t.warnings));
                let held = self.held(&key, &t.service, &t.endpoints).map(Arc::clone);
                if let Some(at) = t.trigger_time
                    && held.is_none()
                {
                    self.slices_relist
                        .get_or_insert_with(SliceRelist::default)
                        .triggers
                        .push((t.service.clone(), at));
                }
                (t.service, held.unwrap_or(t.endpoints))
            }
            Ok(None) => return,
            Err(e) => {
                self.note_slice(slice, &key, Err(&e));
                let Some(owner) = self.slice_owner.get(&key) else {
                    return;
                };
                let Some(old) = self.slices.get(owner).and_then(|m| m.get(&key.1)) else {
                    return;
                };
                (owner.clone(), old.clone())
            }
        };
        let next = self.slices_relist.get_or_insert_with(SliceRelist::default);
        next.slices
            .entry(service.clone())
            .or_default()
            .insert(key.1.clone(), endpoints);
        next.owners.insert(key, service);
    }

    /// The slice relist is complete: its slices replace the set in one step.
    pub fn end_slices(&mut self) {
        let next = self.slices_relist.take().unwrap_or_default();
        for (service, at) in next.triggers {
            self.note_trigger(&service, Some(at));
        }
        // A slice missing from the list was deleted: as for a watch delete, its Service's
        // pending trigger times go (a relist reports deletions after the updates).
        for (key, owner) in &self.slice_owner {
            if !next.owners.contains_key(key) {
                self.triggers.remove(owner);
            }
        }
        let old = std::mem::replace(&mut self.slices, next.slices);
        self.slice_owner = next.owners;
        for (name, slices) in &self.slices {
            if old.get(name) != Some(slices) {
                self.dirty.insert(name.clone());
            }
        }
        for name in old.keys() {
            if !self.slices.contains_key(name) {
                self.dirty.insert(name.clone());
            }
        }
        self.slices_listed = true;
    }

    /// This node's Node object was added or modified.
    pub fn apply_node(&mut self, node: &Node) {
        match translate_node(node) {
            Ok(info) => {
                let name = node.metadata.name.as_deref().unwrap_or_default();
                self.forget("Node", "", name);
                self.node_wait = None;
                if self.node.as_ref() != Some(&info) {
                    self.node = Some(info);
                    self.node_dirty = true;
                }
            }
            Err(e) => {
                let line = skip_line(&e);
                tracing::warn!("{line}");
                let name = node.metadata.name.clone().unwrap_or_default();
                self.skipped.insert(
                    ("Node", String::new(), name.clone()),
                    Skipped {
                        kind: "Node",
                        namespace: String::new(),
                        name,
                        service: None,
                        addresses: Vec::new(),
                        whole: true,
                        messages: vec![line],
                    },
                );
            }
        }
    }

    /// The change set since the last one, if the first sync is done and anything changed.
    /// Services whose state equals what was last handed out are left out, so a relist after
    /// a dropped watch or a 410 repeats nothing.
    pub fn take_change_set(&mut self) -> Option<ChangeSet> {
        if !self.synced() {
            return None;
        }
        let mut cs = ChangeSet {
            initial: !self.sent_initial,
            ..ChangeSet::default()
        };
        // Only a dirty Service has trigger times (a slice change that changed nothing records
        // none), and each is handed out with its Service.
        let mut triggers = std::mem::take(&mut self.triggers);
        for name in std::mem::take(&mut self.dirty) {
            let now = ServiceChange {
                service: self.services.get(&name).cloned(),
                endpoints: self
                    .slices
                    .get(&name)
                    .map(|m| merge_slices(m.values()))
                    .unwrap_or_default(),
            };
            if let Some(times) = triggers.remove(&name) {
                cs.trigger_times.insert(name.clone(), times);
            }
            cs.services.insert(name, now);
        }
        if std::mem::take(&mut self.node_dirty) {
            cs.node.clone_from(&self.node);
        }
        if cs.initial || !cs.services.is_empty() || cs.node.is_some() {
            self.sent_initial = true;
            Some(cs)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use k8s_openapi::api::discovery::v1::{Endpoint as K8sEndpoint, EndpointPort};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn meta(name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        }
    }

    fn svc(name: &str, ip: &str) -> Service {
        Service {
            metadata: meta(name, &[]),
            spec: Some(ServiceSpec {
                cluster_ip: Some(ip.into()),
                ports: Some(vec![ServicePort {
                    port: 80,
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            status: None,
        }
    }

    fn slice(name: &str, service: &str, addr: &str) -> EndpointSlice {
        EndpointSlice {
            metadata: meta(name, &[("kubernetes.io/service-name", service)]),
            address_type: "IPv4".into(),
            endpoints: vec![K8sEndpoint {
                addresses: vec![addr.into()],
                ..K8sEndpoint::default()
            }],
            ports: Some(vec![EndpointPort {
                port: Some(8080),
                ..EndpointPort::default()
            }]),
        }
    }

    fn synced(services: &[Service], slices: &[EndpointSlice]) -> Tracker {
        let mut t = Tracker::new(TranslateOptions::default());
        t.relist_services(services);
        t.relist_slices(slices);
        assert!(t.take_change_set().is_some_and(|cs| cs.initial));
        t
    }

    fn web() -> ServiceName {
        ServiceName::new("default", "web")
    }

    /// A Service with one slice shares that slice's endpoints with its change set and, through
    /// it, with the engine's inputs (a copy was 10 MiB at 10,000 Services x 10); the slice is
    /// held merged (sorted by address), so the sharing never changes what the engine sees.
    /// With a second slice the Service gets a merged list of its own.
    #[test]
    fn a_service_with_one_slice_shares_its_endpoints_through_to_the_inputs() {
        let mut two = slice("web-1", "web", "10.0.0.9");
        two.endpoints.push(K8sEndpoint {
            addresses: vec!["10.0.0.2".into()],
            ..K8sEndpoint::default()
        });
        let mut t = synced(&[svc("web", "10.96.0.1")], &[]);
        t.apply_slice(&two);
        let mut cs = t.take_change_set().expect("the slice");
        let held = Arc::clone(&t.slices[&web()]["web-1"]);
        let addrs: Vec<String> = held.iter().map(|e| e.addr.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.2", "10.0.0.9"]);
        assert!(Arc::ptr_eq(&cs.services[&web()].endpoints, &held));
        let mut inputs = Inputs::new(kube_ipvs_diff::NodeContext::new("n1")).expect("node");
        assert!(cs.move_into(&mut inputs).is_empty());
        assert_eq!(inputs.endpoints(&web()).as_ptr(), held.as_ptr());
        // A relist of the same slice keeps the list held, so the sharing survives it.
        t.relist_slices(std::slice::from_ref(&two));
        assert_eq!(t.take_change_set(), None);
        assert!(Arc::ptr_eq(&t.slices[&web()]["web-1"], &held));
        // An equal list handed to the inputs is no change, and the inputs hold it from then on.
        let _ = inputs.take_changes();
        let equal: Arc<[Endpoint]> = held.to_vec().into();
        inputs
            .set_endpoints(web(), Arc::clone(&equal))
            .expect("valid");
        assert!(inputs.take_changes().services.is_empty());
        assert_eq!(inputs.endpoints(&web()).as_ptr(), equal.as_ptr());

        t.apply_slice(&slice("web-2", "web", "10.0.0.5"));
        let cs = t.take_change_set().expect("the second slice");
        let merged = &cs.services[&web()].endpoints;
        assert_eq!(merged.len(), 3);
        assert!(!Arc::ptr_eq(merged, &t.slices[&web()]["web-1"]));
    }

    #[test]
    fn nothing_before_both_lists() {
        let mut t = Tracker::new(TranslateOptions::default());
        t.relist_services(&[svc("web", "10.96.0.1")]);
        assert_eq!(t.take_change_set(), None);
        t.relist_slices(&[]);
        let cs = t.take_change_set().expect("first change set");
        assert!(cs.initial && cs.services.contains_key(&web()));
    }

    #[test]
    fn a_bad_update_keeps_the_last_good_state() {
        let mut t = synced(&[svc("web", "10.96.0.1")], &[]);
        t.apply_service(&svc("web", "10.96.0.999"));
        assert_eq!(t.take_change_set(), None, "the bad update changed nothing");
        // Also through a relist: the bad object keeps its old translation.
        t.relist_services(&[svc("web", "10.96.0.999")]);
        assert_eq!(t.take_change_set(), None);
        t.apply_slice(&slice("web-1", "web", "10.0.0.1"));
        // A slice malformed as a whole (one bad endpoint only costs that endpoint; see below).
        let mut bad = slice("web-1", "web", "10.0.0.2");
        bad.address_type = "Bogus".into();
        t.apply_slice(&bad);
        let cs = t.take_change_set().expect("the good slice");
        assert_eq!(cs.services[&web()].endpoints.len(), 1);
        assert_eq!(
            cs.services[&web()].endpoints[0].addr.to_string(),
            "10.0.0.1"
        );
        assert!(cs.services[&web()].service.is_some());
        let skipped = t.skipped();
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(skipped.iter().all(|s| s.whole));
        assert!(
            skipped[0].messages[0].contains("EndpointSlice default/web-1")
                && skipped[0].messages[0].contains("Bogus"),
            "{skipped:?}"
        );
        assert!(
            skipped[1].messages[0].contains("10.96.0.999"),
            "{skipped:?}"
        );
        // Fixed, the records go.
        t.apply_slice(&slice("web-1", "web", "10.0.0.1"));
        t.apply_service(&svc("web", "10.96.0.1"));
        assert!(t.skipped().is_empty());
    }

    #[test]
    fn a_bad_endpoint_costs_only_itself_and_is_recorded() {
        let mut t = synced(&[svc("web", "10.96.0.1")], &[]);
        let mut s = slice("web-1", "web", "10.0.0.1");
        let mut bad = s.endpoints[0].clone();
        bad.addresses = vec!["not-an-ip".into()];
        s.endpoints.insert(0, bad);
        t.apply_slice(&s);
        let cs = t.take_change_set().expect("the slice");
        let eps: Vec<String> = cs.services[&web()]
            .endpoints
            .iter()
            .map(|e| e.addr.to_string())
            .collect();
        assert_eq!(eps, ["10.0.0.1"], "the good endpoint stays");
        let skipped = t.skipped();
        assert_eq!(skipped.len(), 1);
        assert!(!skipped[0].whole);
        assert_eq!(skipped[0].service, Some(web()));
        assert_eq!(
            skipped[0].messages,
            [
                "EndpointSlice default/web-1: endpoints[0] address \"not-an-ip\" is not an IP \
              address; this endpoint is skipped, the slice's others stay"
            ]
        );
    }

    #[test]
    fn an_identical_relist_is_not_a_change_and_a_missing_object_is_removed() {
        let s = [svc("web", "10.96.0.1"), svc("api", "10.96.0.2")];
        let sl = [slice("web-1", "web", "10.0.0.1")];
        let mut t = synced(&s, &sl);
        t.relist_services(&s);
        t.relist_slices(&sl);
        assert_eq!(t.take_change_set(), None);
        t.relist_services(&s[..1]);
        let cs = t.take_change_set().expect("api removed");
        assert_eq!(
            cs.services.into_iter().collect::<Vec<_>>(),
            vec![(ServiceName::new("default", "api"), ServiceChange::default())]
        );
    }

    #[test]
    fn a_relist_in_progress_changes_nothing_and_a_restarted_one_drops_its_objects() {
        let mut t = synced(
            &[svc("web", "10.96.0.1")],
            &[slice("web-1", "web", "10.0.0.1")],
        );
        // Objects of an unfinished relist are invisible, even when the driver flushes.
        t.begin_services();
        t.list_service(&svc("api", "10.96.0.2"));
        t.begin_slices();
        t.list_slice(&slice("web-1", "web", "10.0.0.9"));
        assert_eq!(t.take_change_set(), None);
        // The watch failed mid-list and lists again: only the new list counts, whole.
        t.begin_services();
        t.list_service(&svc("web", "10.96.0.1"));
        t.end_services();
        t.begin_slices();
        t.list_slice(&slice("web-1", "web", "10.0.0.1"));
        t.list_slice(&slice("api-1", "api", "10.0.0.2"));
        t.end_slices();
        let cs = t.take_change_set().expect("the slice of api");
        assert_eq!(
            cs.services.keys().cloned().collect::<Vec<_>>(),
            vec![ServiceName::new("default", "api")],
            "web unchanged: the unfinished relist's endpoint never counted"
        );
        assert!(
            cs.services[&ServiceName::new("default", "api")]
                .service
                .is_none()
        );
        t.begin_services();
        t.list_service(&svc("web", "10.96.0.1"));
        t.list_service(&svc("api", "10.96.0.2"));
        t.end_services();
        let cs = t
            .take_change_set()
            .expect("api arrives with the slice listed before it");
        let api = &cs.services[&ServiceName::new("default", "api")];
        assert!(api.service.is_some());
        assert_eq!(api.endpoints.len(), 1);
    }

    #[test]
    fn moving_a_change_set_into_inputs_equals_copying_it_and_keeps_the_names() {
        let mut t = Tracker::new(TranslateOptions::default());
        t.relist_services(&[svc("web", "10.96.0.1"), svc("api", "10.96.0.2")]);
        t.relist_slices(&[slice("web-1", "web", "10.0.0.1")]);
        let mut cs = t.take_change_set().expect("initial");
        let node = kube_ipvs_diff::NodeContext::new("node-1");
        let mut copied = Inputs::new(node.clone()).expect("node");
        assert!(cs.apply_to(&mut copied).is_empty());
        let mut moved = Inputs::new(node).expect("node");
        assert!(cs.move_into(&mut moved).is_empty());
        for name in [web(), ServiceName::new("default", "api")] {
            assert_eq!(moved.service(&name), copied.service(&name));
            assert_eq!(moved.endpoints(&name), copied.endpoints(&name));
        }
        assert_eq!(moved.endpoints(&web()).len(), 1);
        assert_eq!(
            cs.services.keys().cloned().collect::<Vec<_>>(),
            vec![ServiceName::new("default", "api"), web()]
        );
        assert!(cs.services.values().all(|c| *c == ServiceChange::default()));
    }

    #[test]
    fn a_slice_that_changes_its_service_label_moves() {
        let mut t = synced(
            &[svc("web", "10.96.0.1"), svc("api", "10.96.0.2")],
            &[slice("s-1", "web", "10.0.0.1")],
        );
        t.apply_slice(&slice("s-1", "api", "10.0.0.1"));
        let cs = t.take_change_set().expect("both change");
        assert!(cs.services[&web()].endpoints.is_empty());
        assert_eq!(
            cs.services[&ServiceName::new("default", "api")]
                .endpoints
                .len(),
            1
        );
    }

    /// The tracker's start in the trigger-time tests: 2026-01-01T00:00:00Z.
    fn start() -> SystemTime {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_767_225_600)
    }

    fn at(secs_after_start: u64) -> SystemTime {
        start() + std::time::Duration::from_secs(secs_after_start)
    }

    fn annotated(mut s: EndpointSlice, trigger: &str) -> EndpointSlice {
        s.metadata.annotations = Some(BTreeMap::from([(
            crate::translate::LAST_CHANGE_TRIGGER_TIME_ANNOTATION.to_owned(),
            trigger.to_owned(),
        )]));
        s
    }

    fn synced_at_start(services: &[Service], slices: &[EndpointSlice]) -> Tracker {
        let mut t = Tracker::started_at(TranslateOptions::default(), start());
        t.relist_services(services);
        t.relist_slices(slices);
        assert!(t.take_change_set().is_some_and(|cs| cs.initial));
        t
    }

    #[test]
    fn a_changed_slice_carries_its_trigger_time_to_its_service() {
        let mut t = synced_at_start(&[svc("web", "10.96.0.1")], &[]);
        t.apply_slice(&annotated(
            slice("web-1", "web", "10.0.0.1"),
            "2026-01-01T00:00:05Z",
        ));
        let cs = t.take_change_set().expect("web changed");
        assert_eq!(cs.trigger_times, BTreeMap::from([(web(), vec![at(5)])]));
        // Handed out once: the next change set does not repeat it.
        t.apply_slice(&slice("web-1", "web", "10.0.0.2"));
        let cs = t.take_change_set().expect("web changed again");
        assert!(cs.trigger_times.is_empty(), "{:?}", cs.trigger_times);
    }

    #[test]
    fn coalesced_changes_keep_every_trigger_time_in_order() {
        let mut t = synced_at_start(&[svc("web", "10.96.0.1"), svc("api", "10.96.0.2")], &[]);
        t.apply_slice(&annotated(
            slice("web-1", "web", "10.0.0.1"),
            "2026-01-01T00:00:05Z",
        ));
        t.apply_slice(&annotated(
            slice("web-1", "web", "10.0.0.2"),
            "2026-01-01T00:00:07.5+00:00",
        ));
        t.apply_slice(&annotated(
            slice("api-1", "api", "10.0.1.1"),
            "2026-01-01T01:00:09+01:00",
        ));
        let cs = t.take_change_set().expect("both changed");
        assert_eq!(
            cs.trigger_times,
            BTreeMap::from([
                (ServiceName::new("default", "api"), vec![at(9)]),
                (
                    web(),
                    vec![at(5), at(7) + std::time::Duration::from_millis(500)]
                ),
            ])
        );
    }

    #[test]
    fn absent_malformed_old_and_unchanged_trigger_times_are_not_measured() {
        let s1 = slice("web-1", "web", "10.0.0.1");
        let mut t = synced_at_start(&[svc("web", "10.96.0.1")], std::slice::from_ref(&s1));
        // Absent.
        t.apply_slice(&slice("web-1", "web", "10.0.0.2"));
        // Malformed: the endpoints still apply.
        t.apply_slice(&annotated(slice("web-1", "web", "10.0.0.3"), "yesterday"));
        let cs = t.take_change_set().expect("the endpoints changed");
        assert_eq!(
            cs.services[&web()].endpoints[0].addr.to_string(),
            "10.0.0.3"
        );
        assert!(cs.trigger_times.is_empty(), "{:?}", cs.trigger_times);
        // Before the tracker started, and exactly at its start.
        t.apply_slice(&annotated(
            slice("web-1", "web", "10.0.0.4"),
            "2025-12-31T23:59:59Z",
        ));
        t.apply_slice(&annotated(
            slice("web-1", "web", "10.0.0.5"),
            "2026-01-01T00:00:00Z",
        ));
        let cs = t.take_change_set().expect("the endpoints changed");
        assert!(cs.trigger_times.is_empty(), "{:?}", cs.trigger_times);
        // An update that changes only the annotation is no change to program.
        t.apply_slice(&annotated(
            slice("web-1", "web", "10.0.0.5"),
            "2026-01-01T00:00:30Z",
        ));
        assert_eq!(t.take_change_set(), None);
        // Nor does it leave a trigger time behind for the next real change.
        t.apply_slice(&slice("web-1", "web", "10.0.0.6"));
        let cs = t.take_change_set().expect("the endpoints changed");
        assert!(cs.trigger_times.is_empty(), "{:?}", cs.trigger_times);
    }

    #[test]
    fn a_deleted_slice_forgets_its_services_pending_trigger_times() {
        let mut t = synced_at_start(
            &[svc("web", "10.96.0.1")],
            &[slice("web-2", "web", "10.0.0.9")],
        );
        t.apply_slice(&annotated(
            slice("web-1", "web", "10.0.0.1"),
            "2026-01-01T00:00:05Z",
        ));
        t.delete_slice(&slice("web-2", "web", "10.0.0.9"));
        let cs = t.take_change_set().expect("web changed");
        assert!(cs.trigger_times.is_empty(), "{:?}", cs.trigger_times);
        // The same through a relist that no longer has web-1.
        t.apply_slice(&annotated(
            slice("web-3", "web", "10.0.0.3"),
            "2026-01-01T00:00:06Z",
        ));
        t.relist_slices(&[annotated(
            slice("web-3", "web", "10.0.0.3"),
            "2026-01-01T00:00:06Z",
        )]);
        let cs = t.take_change_set().expect("web changed");
        assert!(cs.trigger_times.is_empty(), "{:?}", cs.trigger_times);
    }

    #[test]
    fn a_relist_measures_only_the_slices_it_changes() {
        let mut t = synced_at_start(
            &[svc("web", "10.96.0.1"), svc("api", "10.96.0.2")],
            &[
                slice("web-1", "web", "10.0.0.1"),
                slice("api-1", "api", "10.0.1.1"),
            ],
        );
        t.relist_slices(&[
            annotated(slice("web-1", "web", "10.0.0.1"), "2026-01-01T00:00:05Z"),
            annotated(slice("api-1", "api", "10.0.1.2"), "2026-01-01T00:00:06Z"),
        ]);
        let cs = t.take_change_set().expect("api changed");
        assert_eq!(
            cs.trigger_times,
            BTreeMap::from([(ServiceName::new("default", "api"), vec![at(6)])])
        );
    }

    #[test]
    fn a_service_that_becomes_headless_leaves() {
        let mut t = synced(&[svc("web", "10.96.0.1")], &[]);
        t.apply_service(&svc("web", "None"));
        let cs = t.take_change_set().expect("web leaves");
        assert_eq!(cs.services[&web()], ServiceChange::default());
    }
}
