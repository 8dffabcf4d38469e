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

use std::collections::{BTreeMap, BTreeSet, HashMap};

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
    /// Its endpoints merged over all its slices (see [`merge_slices`]); empty if none.
    pub endpoints: Vec<Endpoint>,
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
}

impl ChangeSet {
    /// Applies the change set to the engine's store. Returns the model's rejections, which
    /// translation already screens for, so they are unexpected; the rest is applied anyway.
    pub fn apply_to(&self, inputs: &mut Inputs) -> Vec<kube_ipvs_diff::Error> {
        let mut errors = Vec::new();
        if let Some(n) = &self.node {
            let mut ctx = inputs.node().clone();
            ctx.zone.clone_from(&n.zone);
            ctx.node_ips_v4.clone_from(&n.ips_v4);
            ctx.node_ips_v6.clone_from(&n.ips_v6);
            if let Err(e) = inputs.set_node(ctx) {
                errors.push(e);
            }
        }
        for (name, change) in &self.services {
            match &change.service {
                Some(info) => {
                    if let Err(e) = inputs.upsert_service(name.clone(), info.clone()) {
                        errors.push(e);
                    }
                }
                None => inputs.remove_service(name),
            }
            if let Err(e) = inputs.set_endpoints(name.clone(), change.endpoints.clone()) {
                errors.push(e);
            }
        }
        errors
    }
}

/// Translated state, dirty tracking, and what was last handed out.
#[derive(Debug)]
pub struct Tracker {
    opts: TranslateOptions,
    services: HashMap<ServiceName, ServiceInfo>,
    /// Slices by Service, each by slice name, so merging is in slice-name order.
    slices: HashMap<ServiceName, BTreeMap<String, Vec<Endpoint>>>,
    /// Which Service a slice (namespace, name) was filed under, in case its label changes.
    slice_owner: HashMap<(String, String), ServiceName>,
    node: Option<NodeInfo>,
    node_dirty: bool,
    emitted: HashMap<ServiceName, ServiceChange>,
    dirty: BTreeSet<ServiceName>,
    services_listed: bool,
    slices_listed: bool,
    sent_initial: bool,
}

impl Tracker {
    /// An empty tracker.
    pub fn new(opts: TranslateOptions) -> Self {
        Self {
            opts,
            services: HashMap::new(),
            slices: HashMap::new(),
            slice_owner: HashMap::new(),
            node: None,
            node_dirty: false,
            emitted: HashMap::new(),
            dirty: BTreeSet::new(),
            services_listed: false,
            slices_listed: false,
            sent_initial: false,
        }
    }

    /// Whether both Services and EndpointSlices have been listed once.
    pub fn synced(&self) -> bool {
        self.services_listed && self.slices_listed
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
                for w in &t.warnings {
                    tracing::warn!(service = %t.name, "{w}");
                }
                self.services.insert(t.name.clone(), t.info);
                self.dirty.insert(t.name);
            }
            Ok(None) => {
                // Became headless, ExternalName or another proxy's: no longer ours.
                if self.services.remove(&name).is_some() {
                    self.dirty.insert(name);
                }
            }
            Err(e) => {
                tracing::warn!("skipping bad object, keeping its last good state: {e}");
            }
        }
    }

    /// A Service was deleted.
    pub fn delete_service(&mut self, svc: &Service) {
        let name = service_name(svc);
        if self.services.remove(&name).is_some() {
            self.dirty.insert(name);
        }
    }

    /// A complete list of Services (a watcher's `InitDone`): replaces the set, so Services
    /// missing from it are removed. A bad object keeps its previous translation.
    pub fn relist_services(&mut self, list: &[Service]) {
        let mut next = HashMap::with_capacity(list.len());
        for svc in list {
            let name = service_name(svc);
            match translate_service(svc, &self.opts) {
                Ok(Some(t)) => {
                    for w in &t.warnings {
                        tracing::warn!(service = %t.name, "{w}");
                    }
                    next.insert(t.name, t.info);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!("skipping bad object, keeping its last good state: {e}");
                    if let Some(old) = self.services.get(&name) {
                        next.insert(name, old.clone());
                    }
                }
            }
        }
        let old = std::mem::replace(&mut self.services, next);
        for name in old.keys().chain(self.services.keys()) {
            self.dirty.insert(name.clone());
        }
        self.services_listed = true;
    }

    fn slice_key(slice: &EndpointSlice) -> (String, String) {
        (
            slice
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".into()),
            slice.metadata.name.clone().unwrap_or_default(),
        )
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
        let key = Self::slice_key(slice);
        match translate_slice(slice, &self.opts) {
            Ok(Some(t)) => {
                self.remove_slice_key(&key);
                self.slices
                    .entry(t.service.clone())
                    .or_default()
                    .insert(key.1.clone(), t.endpoints);
                self.slice_owner.insert(key, t.service.clone());
                self.dirty.insert(t.service);
            }
            Ok(None) => self.remove_slice_key(&key),
            Err(e) => tracing::warn!("skipping bad object, keeping its last good state: {e}"),
        }
    }

    /// An EndpointSlice was deleted.
    pub fn delete_slice(&mut self, slice: &EndpointSlice) {
        self.remove_slice_key(&Self::slice_key(slice));
    }

    /// A complete list of EndpointSlices: replaces the set.
    pub fn relist_slices(&mut self, list: &[EndpointSlice]) {
        let mut slices: HashMap<ServiceName, BTreeMap<String, Vec<Endpoint>>> = HashMap::new();
        let mut owners = HashMap::with_capacity(list.len());
        for slice in list {
            let key = Self::slice_key(slice);
            let (service, endpoints) = match translate_slice(slice, &self.opts) {
                Ok(Some(t)) => (t.service, t.endpoints),
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!("skipping bad object, keeping its last good state: {e}");
                    let Some(owner) = self.slice_owner.get(&key) else {
                        continue;
                    };
                    let Some(old) = self.slices.get(owner).and_then(|m| m.get(&key.1)) else {
                        continue;
                    };
                    (owner.clone(), old.clone())
                }
            };
            slices
                .entry(service.clone())
                .or_default()
                .insert(key.1.clone(), endpoints);
            owners.insert(key, service);
        }
        let old = std::mem::replace(&mut self.slices, slices);
        self.slice_owner = owners;
        for name in old.keys().chain(self.slices.keys()) {
            self.dirty.insert(name.clone());
        }
        self.slices_listed = true;
    }

    /// This node's Node object was added or modified.
    pub fn apply_node(&mut self, node: &Node) {
        match translate_node(node) {
            Ok(info) => {
                if self.node.as_ref() != Some(&info) {
                    self.node = Some(info);
                    self.node_dirty = true;
                }
            }
            Err(e) => tracing::warn!("skipping bad object, keeping its last good state: {e}"),
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
        for name in std::mem::take(&mut self.dirty) {
            let now = ServiceChange {
                service: self.services.get(&name).cloned(),
                endpoints: self
                    .slices
                    .get(&name)
                    .map(|m| merge_slices(m.values().map(Vec::as_slice)))
                    .unwrap_or_default(),
            };
            let before = self.emitted.get(&name).cloned().unwrap_or_default();
            if now == before {
                continue;
            }
            if now == ServiceChange::default() {
                self.emitted.remove(&name);
            } else {
                self.emitted.insert(name.clone(), now.clone());
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
        t.apply_slice(&slice("web-1", "web", "not-an-ip"));
        let cs = t.take_change_set().expect("the good slice");
        assert_eq!(cs.services[&web()].endpoints.len(), 1);
        assert!(cs.services[&web()].service.is_some());
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

    #[test]
    fn a_service_that_becomes_headless_leaves() {
        let mut t = synced(&[svc("web", "10.96.0.1")], &[]);
        t.apply_service(&svc("web", "None"));
        let cs = t.take_change_set().expect("web leaves");
        assert_eq!(cs.services[&web()], ServiceChange::default());
    }
}
