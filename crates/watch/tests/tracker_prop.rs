//! Property: whatever events the tracker is told or misses (a dropped watch, a 410), a relist
//! followed by a change set leaves a consumer that applied every change set in order with
//! exactly the state a fresh tracker builds from the API's objects. Nothing lost, nothing
//! stale, and a change set carries a Service whose state did not change only if what the
//! tracker held for it changed in between (changed and changed back before the change set:
//! the tracker keeps no copy of what it handed out); in particular a relist that finds what
//! the tracker already holds repeats nothing.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube_ipvs_diff::{Inputs, NodeContext, ServiceName};
use kube_ipvs_watch::{ServiceChange, Tracker, TranslateOptions};
use proptest::prelude::*;

const SERVICES: usize = 3;
const SLICES: usize = 4;

fn svc(i: usize, v: u8) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(format!("s{i}")),
            namespace: Some("default".into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(format!("10.96.{i}.{}", v + 1)),
            ports: Some(vec![ServicePort {
                port: 80 + i32::from(v),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

fn slice(j: usize, owner: usize, v: u8) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("x{j}")),
            namespace: Some("default".into()),
            labels: Some([("kubernetes.io/service-name".to_owned(), format!("s{owner}"))].into()),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        // Slices overlap in addresses on purpose, so merging across slices is exercised.
        endpoints: (0..=(v % 3))
            .map(|k| Endpoint {
                addresses: vec![format!("10.0.0.{}", k + v % 2)],
                ..Endpoint::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort {
            port: Some(8000 + i32::from(v)),
            ..EndpointPort::default()
        }]),
    }
}

#[derive(Debug, Clone)]
enum Op {
    SetService {
        i: usize,
        v: u8,
        told: bool,
    },
    DelService {
        i: usize,
        told: bool,
    },
    SetSlice {
        j: usize,
        owner: usize,
        v: u8,
        told: bool,
    },
    DelSlice {
        j: usize,
        told: bool,
    },
    RelistServices,
    RelistSlices,
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..SERVICES, 0..3u8, any::<bool>()).prop_map(|(i, v, told)| Op::SetService { i, v, told }),
        1 => (0..SERVICES, any::<bool>()).prop_map(|(i, told)| Op::DelService { i, told }),
        3 => (0..SLICES, 0..SERVICES, 0..4u8, any::<bool>())
            .prop_map(|(j, owner, v, told)| Op::SetSlice { j, owner, v, told }),
        1 => (0..SLICES, any::<bool>()).prop_map(|(j, told)| Op::DelSlice { j, told }),
        1 => Just(Op::RelistServices),
        1 => Just(Op::RelistSlices),
        2 => Just(Op::Flush),
    ]
}

fn name(i: usize) -> ServiceName {
    ServiceName::new("default", format!("s{i}"))
}

/// The Service a slice is filed under, by its label.
fn owner(slice: &EndpointSlice) -> ServiceName {
    let label = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("kubernetes.io/service-name"))
        .cloned()
        .unwrap_or_default();
    ServiceName::new("default", label)
}

/// What the tracker was told (by events and relists), to know which Services it saw change.
#[derive(Default)]
struct Seen {
    services: BTreeMap<usize, Service>,
    slices: BTreeMap<usize, EndpointSlice>,
    /// Services whose objects, as the tracker saw them, changed since the last change set.
    touched: BTreeSet<ServiceName>,
}

impl Seen {
    fn service(&mut self, i: usize, s: Option<Service>) {
        let old = match s {
            Some(s) => self.services.insert(i, s),
            None => self.services.remove(&i),
        };
        if old.as_ref() != self.services.get(&i) {
            self.touched.insert(name(i));
        }
    }

    fn slice(&mut self, j: usize, s: Option<EndpointSlice>) {
        let old = match s {
            Some(s) => self.slices.insert(j, s),
            None => self.slices.remove(&j),
        };
        let new = self.slices.get(&j);
        if old.as_ref() != new {
            self.touched.extend(old.iter().chain(new).map(owner));
        }
    }
}

fn state(inputs: &Inputs) -> BTreeMap<ServiceName, ServiceChange> {
    (0..SERVICES)
        .map(|i| ServiceName::new("default", format!("s{i}")))
        .map(|n| {
            let c = ServiceChange {
                service: inputs.service(&n).cloned(),
                endpoints: inputs.endpoints(&n).into(),
            };
            (n, c)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_relist_converges_on_the_api_state(ops in prop::collection::vec(op(), 0..40)) {
        let mut truth_svc: BTreeMap<usize, Service> = BTreeMap::new();
        let mut truth_slice: BTreeMap<usize, EndpointSlice> = BTreeMap::new();
        let mut t = Tracker::new(TranslateOptions::default());
        t.relist_services(&[]);
        t.relist_slices(&[]);
        let mut consumer = Inputs::new(NodeContext::new("n")).expect("node");
        let mut last = state(&consumer);
        let mut seen = Seen::default();
        let flush = |t: &mut Tracker, consumer: &mut Inputs, last: &mut BTreeMap<_, _>, seen: &mut Seen| {
            if let Some(cs) = t.take_change_set() {
                prop_assert!(cs.apply_to(consumer).is_empty());
                let now = state(consumer);
                for name in cs.services.keys() {
                    if !seen.touched.contains(name) {
                        prop_assert_ne!(last.get(name), now.get(name), "{} in a change set unchanged", name);
                    }
                }
                *last = now;
            }
            seen.touched.clear();
            Ok(())
        };
        for op in ops {
            match op {
                Op::SetService { i, v, told } => {
                    let s = svc(i, v);
                    if told {
                        t.apply_service(&s);
                        seen.service(i, Some(s.clone()));
                    }
                    truth_svc.insert(i, s);
                }
                Op::DelService { i, told } => {
                    if let Some(s) = truth_svc.remove(&i) && told {
                        t.delete_service(&s);
                        seen.service(i, None);
                    }
                }
                Op::SetSlice { j, owner, v, told } => {
                    let s = slice(j, owner, v);
                    if told {
                        t.apply_slice(&s);
                        seen.slice(j, Some(s.clone()));
                    }
                    truth_slice.insert(j, s);
                }
                Op::DelSlice { j, told } => {
                    if let Some(s) = truth_slice.remove(&j) && told {
                        t.delete_slice(&s);
                        seen.slice(j, None);
                    }
                }
                Op::RelistServices => {
                    t.relist_services(&truth_svc.values().cloned().collect::<Vec<_>>());
                    for i in 0..SERVICES {
                        seen.service(i, truth_svc.get(&i).cloned());
                    }
                }
                Op::RelistSlices => {
                    t.relist_slices(&truth_slice.values().cloned().collect::<Vec<_>>());
                    for j in 0..SLICES {
                        seen.slice(j, truth_slice.get(&j).cloned());
                    }
                }
                Op::Flush => flush(&mut t, &mut consumer, &mut last, &mut seen)?,
            }
        }
        // The watch recovers: both lists again, then a change set.
        let services: Vec<Service> = truth_svc.values().cloned().collect();
        let slices: Vec<EndpointSlice> = truth_slice.values().cloned().collect();
        t.relist_services(&services);
        t.relist_slices(&slices);
        for i in 0..SERVICES {
            seen.service(i, truth_svc.get(&i).cloned());
        }
        for j in 0..SLICES {
            seen.slice(j, truth_slice.get(&j).cloned());
        }
        flush(&mut t, &mut consumer, &mut last, &mut seen)?;

        let mut fresh = Tracker::new(TranslateOptions::default());
        fresh.relist_services(&services);
        fresh.relist_slices(&slices);
        let mut expected = Inputs::new(NodeContext::new("n")).expect("node");
        if let Some(cs) = fresh.take_change_set() {
            cs.apply_to(&mut expected);
        }
        prop_assert_eq!(state(&consumer), state(&expected));
    }
}
