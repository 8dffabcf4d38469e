//! Services and EndpointSlices decoded from the API server's JSON without the metadata the
//! proxy never reads.
//!
//! Every object the API server sends carries `metadata.managedFields`, the server-side apply
//! bookkeeping: most of a Service's bytes and a large part of a slice's. k8s-openapi decodes it
//! into nested maps, one allocation per field path, only for the agent to drop it. At 50,000
//! Services the startup list is 225 MB of JSON decoded inside the guest, so the decode is a
//! large part of the startup's time. [`LeanService`] and [`LeanSlice`] decode the same JSON into
//! the same k8s-openapi types, but keep of the metadata only what translation and the watcher
//! use ([`LeanMeta`]); the rest (`managedFields`, `ownerReferences`, `finalizers`,
//! `creationTimestamp`, `deletionGracePeriodSeconds`, `generateName`, `selfLink`) is skipped
//! unread, as are each endpoint's `targetRef`, `hostname` and `deprecatedTopology`.
//!
//! It owns nothing but the decode: the wrapped objects go to [`translate`](crate::translate)
//! as plain k8s-openapi objects. Absent and `null` fields decode as k8s-openapi decodes them;
//! `apiVersion` and `kind` are not checked (the API path the list or watch came from fixes them),
//! where k8s-openapi refuses a mismatch.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Service, ServiceSpec, ServiceStatus};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::Deserialize;

/// The metadata kept: what translation reads (name, namespace, labels, annotations), the
/// watcher's `resourceVersion` (it resumes a watch from the last object's version), and uid,
/// generation and deletionTimestamp, small and what a reader of an object expects to find.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct LeanMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    generation: Option<i64>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    deletion_timestamp: Option<Time>,
}

impl From<LeanMeta> for ObjectMeta {
    fn from(m: LeanMeta) -> Self {
        ObjectMeta {
            name: m.name,
            namespace: m.namespace,
            uid: m.uid,
            resource_version: m.resource_version,
            generation: m.generation,
            labels: m.labels,
            annotations: m.annotations,
            deletion_timestamp: m.deletion_timestamp,
            ..ObjectMeta::default()
        }
    }
}

/// `null` metadata decodes as absent, as k8s-openapi does.
fn meta<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    Ok(Option::<LeanMeta>::deserialize(d)?
        .unwrap_or_default()
        .into())
}

#[derive(Deserialize)]
struct ServiceWire {
    #[serde(default, deserialize_with = "meta")]
    metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<ServiceSpec>,
    #[serde(default)]
    status: Option<ServiceStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SliceWire {
    #[serde(default, deserialize_with = "meta")]
    metadata: ObjectMeta,
    #[serde(default)]
    address_type: Option<String>,
    #[serde(default)]
    endpoints: Option<Vec<LeanEndpoint>>,
    #[serde(default)]
    ports: Option<Vec<EndpointPort>>,
}

/// An endpoint without what translation never reads: `targetRef` (the Pod: four strings, about
/// half of an endpoint's bytes as the EndpointSlice controller writes it), `hostname` and
/// `deprecatedTopology`. `addresses` absent or `null` is empty, as with k8s-openapi.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndpointWire {
    #[serde(default)]
    addresses: Option<Vec<String>>,
    #[serde(default)]
    conditions: Option<EndpointConditions>,
    #[serde(default)]
    hints: Option<EndpointHints>,
    #[serde(default)]
    node_name: Option<String>,
    #[serde(default)]
    zone: Option<String>,
}

#[derive(Deserialize)]
#[serde(from = "EndpointWire")]
struct LeanEndpoint(Endpoint);

impl From<EndpointWire> for LeanEndpoint {
    fn from(w: EndpointWire) -> Self {
        LeanEndpoint(Endpoint {
            addresses: w.addresses.unwrap_or_default(),
            conditions: w.conditions,
            hints: w.hints,
            node_name: w.node_name,
            zone: w.zone,
            ..Endpoint::default()
        })
    }
}

/// A [`Service`] decoded with [`LeanMeta`]'s metadata.
#[derive(Debug, Clone, Deserialize)]
#[serde(from = "ServiceWire")]
pub struct LeanService(pub Service);

impl From<ServiceWire> for LeanService {
    fn from(w: ServiceWire) -> Self {
        LeanService(Service {
            metadata: w.metadata,
            spec: w.spec,
            status: w.status,
        })
    }
}

/// An [`EndpointSlice`] decoded with [`LeanMeta`]'s metadata.
#[derive(Debug, Clone, Deserialize)]
#[serde(from = "SliceWire")]
pub struct LeanSlice(pub EndpointSlice);

impl From<SliceWire> for LeanSlice {
    fn from(w: SliceWire) -> Self {
        LeanSlice(EndpointSlice {
            metadata: w.metadata,
            address_type: w.address_type.unwrap_or_default(),
            endpoints: w
                .endpoints
                .unwrap_or_default()
                .into_iter()
                .map(|e| e.0)
                .collect(),
            ports: w.ports,
        })
    }
}

impl From<LeanService> for Service {
    fn from(s: LeanService) -> Self {
        s.0
    }
}

impl From<LeanSlice> for EndpointSlice {
    fn from(s: LeanSlice) -> Self {
        s.0
    }
}

/// The wrappers are the same API resource as what they wrap, so kube's `Api` and watcher take
/// them (through kube's impl for every k8s-openapi resource with `ObjectMeta`).
macro_rules! same_resource {
    ($lean:ty, $inner:ty) => {
        impl k8s_openapi::Resource for $lean {
            const API_VERSION: &'static str = <$inner as k8s_openapi::Resource>::API_VERSION;
            const GROUP: &'static str = <$inner as k8s_openapi::Resource>::GROUP;
            const KIND: &'static str = <$inner as k8s_openapi::Resource>::KIND;
            const VERSION: &'static str = <$inner as k8s_openapi::Resource>::VERSION;
            const URL_PATH_SEGMENT: &'static str =
                <$inner as k8s_openapi::Resource>::URL_PATH_SEGMENT;
            type Scope = <$inner as k8s_openapi::Resource>::Scope;
        }

        impl k8s_openapi::Metadata for $lean {
            type Ty = ObjectMeta;

            fn metadata(&self) -> &ObjectMeta {
                &self.0.metadata
            }

            fn metadata_mut(&mut self) -> &mut ObjectMeta {
                &mut self.0.metadata
            }
        }
    };
}

same_resource!(LeanService, Service);
same_resource!(LeanSlice, EndpointSlice);

#[cfg(test)]
mod tests {
    use super::*;

    /// A Service as the API server lists it, with the metadata the proxy does not read.
    const SERVICE: &str = r#"{
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": "web", "namespace": "shop", "uid": "29de873c", "resourceVersion": "454",
            "generation": 3, "creationTimestamp": "2026-12-05T13:07:41Z",
            "labels": {"app": "web"},
            "annotations": {"ipvs.kube-ipvs.io/scheduler": "lc"},
            "finalizers": ["service.kubernetes.io/load-balancer-cleanup"],
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u"}],
            "managedFields": [{"manager": "kubectl", "operation": "Update", "apiVersion": "v1",
                "time": "2026-12-05T13:07:41Z", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {"f:ports": {"k:{\"port\":80,\"protocol\":\"TCP\"}": {}}}}}]
        },
        "spec": {"ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}],
            "clusterIP": "10.96.0.10", "type": "ClusterIP", "sessionAffinity": "None"},
        "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.7"}]}}
    }"#;

    const SLICE: &str = r#"{
        "metadata": {
            "name": "web-abc", "namespace": "shop", "resourceVersion": "457",
            "labels": {"kubernetes.io/service-name": "web"},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-05T13:07:40Z"},
            "deletionTimestamp": "2026-12-05T13:09:00Z",
            "managedFields": [{"manager": "m", "fieldsType": "FieldsV1", "fieldsV1": {"f:endpoints": {}}}]
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.244.0.11"], "conditions": {"ready": true},
            "nodeName": "node-56", "zone": "a", "hints": {"forZones": [{"name": "a"}]},
            "hostname": "web-0", "deprecatedTopology": {"kubernetes.io/hostname": "node-56"},
            "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-0", "uid": "8c1e"}},
            {"addresses": null, "conditions": {"serving": true, "terminating": true}},
            {}],
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}]
    }"#;

    /// What the lean decode keeps: k8s-openapi's decode with the skipped metadata taken out.
    fn without_skipped(mut m: ObjectMeta) -> ObjectMeta {
        m.managed_fields = None;
        m.owner_references = None;
        m.finalizers = None;
        m.creation_timestamp = None;
        m
    }

    #[test]
    fn a_lean_service_is_the_full_decode_without_the_metadata_the_proxy_does_not_read() {
        let full: Service = serde_json::from_str(SERVICE).expect("k8s-openapi decodes it");
        let lean: LeanService = serde_json::from_str(SERVICE).expect("the lean decode too");
        assert!(
            full.metadata.managed_fields.is_some(),
            "the fixture has them"
        );
        assert_eq!(lean.0.spec, full.spec);
        assert_eq!(lean.0.status, full.status);
        assert_eq!(lean.0.metadata, without_skipped(full.metadata));
    }

    #[test]
    fn a_lean_slice_is_the_full_decode_without_the_metadata_the_proxy_does_not_read() {
        let full: EndpointSlice = serde_json::from_str(SLICE).expect("k8s-openapi decodes it");
        let lean: LeanSlice = serde_json::from_str(SLICE).expect("the lean decode too");
        assert!(
            full.endpoints[0].target_ref.is_some() && full.endpoints[0].hostname.is_some(),
            "the fixture has them"
        );
        let endpoints: Vec<Endpoint> = full
            .endpoints
            .into_iter()
            .map(|e| Endpoint {
                target_ref: None,
                hostname: None,
                deprecated_topology: None,
                ..e
            })
            .collect();
        assert_eq!(lean.0.metadata, without_skipped(full.metadata.clone()));
        assert_eq!(
            (lean.0.address_type, lean.0.endpoints, lean.0.ports),
            (full.address_type, endpoints, full.ports)
        );
    }

    #[test]
    fn absent_and_null_fields_decode_as_k8s_openapi_decodes_them() {
        for json in [
            r#"{}"#,
            r#"{"metadata": null, "endpoints": null, "addressType": null, "ports": null}"#,
        ] {
            let full: EndpointSlice = serde_json::from_str(json).expect("k8s-openapi");
            let lean: LeanSlice = serde_json::from_str(json).expect("lean");
            assert_eq!(lean.0, full, "{json}");
        }
        for json in [
            r#"{}"#,
            r#"{"metadata": null, "spec": null, "status": null}"#,
        ] {
            let full: Service = serde_json::from_str(json).expect("k8s-openapi");
            let lean: LeanService = serde_json::from_str(json).expect("lean");
            assert_eq!(lean.0, full, "{json}");
        }
    }

    #[test]
    fn a_malformed_object_is_an_error_as_with_k8s_openapi() {
        let bad = r#"{"metadata": {"name": 7}, "endpoints": []}"#;
        assert!(serde_json::from_str::<EndpointSlice>(bad).is_err());
        assert!(serde_json::from_str::<LeanSlice>(bad).is_err());
        let bad = r#"{"endpoints": [{"addresses": "10.244.0.11"}]}"#;
        assert!(serde_json::from_str::<EndpointSlice>(bad).is_err());
        assert!(serde_json::from_str::<LeanSlice>(bad).is_err());
        let bad = r#"{"spec": {"ports": "80"}}"#;
        assert!(serde_json::from_str::<Service>(bad).is_err());
        assert!(serde_json::from_str::<LeanService>(bad).is_err());
    }

    #[test]
    fn the_wrappers_are_the_api_resources_they_wrap() {
        use kube::Resource as _;
        assert_eq!(LeanService::plural(&()), Service::plural(&()));
        assert_eq!(LeanSlice::api_version(&()), EndpointSlice::api_version(&()));
        assert_eq!(
            LeanSlice::url_path(&(), Some("shop")),
            EndpointSlice::url_path(&(), Some("shop"))
        );
    }
}
