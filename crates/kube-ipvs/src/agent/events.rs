//! Kubernetes Events where kube-proxy emits them, in its form (`events.k8s.io/v1`, reporting
//! controller `kube-proxy`, instance `kube-proxy-<node>`), so the event-based alerts and
//! dashboards of a kube-proxy cluster keep matching:
//! - `Starting` (Normal, action `StartKubeProxy`) on the Node when the agent starts;
//! - `FailedToStartServiceHealthcheck` (Warning, action `Listen`) on a Service whose
//!   healthCheckNodePort cannot be bound, with kube-proxy's note.
//!
//! Sending is best effort and never holds up the sync: each Event is created by a task of its
//! own, and a refusal is logged. The RBAC in `deploy/clusterrole.yaml` grants exactly `create` on
//! `events.k8s.io` events for this.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};

/// Who reports the Events, as kube-proxy's recorder names itself.
pub const REPORTING_CONTROLLER: &str = "kube-proxy";

/// Normal or Warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `Normal`.
    Normal,
    /// `Warning`.
    Warning,
}

/// Creates Events through the API server; cheap to clone.
#[derive(Clone)]
pub struct Recorder {
    client: kube::Client,
    node: String,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("node", &self.node)
            .finish()
    }
}

/// The reference to this node's Node object.
pub fn node_ref(node: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.to_owned()),
        ..ObjectReference::default()
    }
}

/// The reference to a Service.
pub fn service_ref(namespace: &str, name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        namespace: Some(namespace.to_owned()),
        name: Some(name.to_owned()),
        ..ObjectReference::default()
    }
}

/// The Event object, as client-go's events recorder builds it: named
/// `<regarding name>.<event time in hex nanoseconds>`, in the regarding object's namespace
/// (`default` for a cluster-scoped one).
pub fn event(
    node: &str,
    regarding: ObjectReference,
    kind: Kind,
    reason: &str,
    action: &str,
    note: &str,
    now: std::time::SystemTime,
) -> Event {
    let nanos = now
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let namespace = regarding
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "default".to_owned());
    let name = format!("{}.{nanos:x}", regarding.name.clone().unwrap_or_default());
    Event {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace),
            ..ObjectMeta::default()
        },
        event_time: k8s_openapi::jiff::Timestamp::try_from(now)
            .ok()
            .map(MicroTime),
        type_: Some(
            match kind {
                Kind::Normal => "Normal",
                Kind::Warning => "Warning",
            }
            .to_owned(),
        ),
        reason: Some(reason.to_owned()),
        action: Some(action.to_owned()),
        note: (!note.is_empty()).then(|| note.to_owned()),
        regarding: Some(regarding),
        reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
        reporting_instance: Some(format!("{REPORTING_CONTROLLER}-{node}")),
        ..Event::default()
    }
}

impl Recorder {
    /// A recorder for the agent on `node`.
    pub fn new(client: kube::Client, node: impl Into<String>) -> Self {
        Self {
            client,
            node: node.into(),
        }
    }

    /// The node the agent runs on.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Sends an Event in the background.
    pub fn emit(
        &self,
        regarding: ObjectReference,
        kind: Kind,
        reason: &str,
        action: &str,
        note: &str,
    ) {
        let ev = event(
            &self.node,
            regarding,
            kind,
            reason,
            action,
            note,
            std::time::SystemTime::now(),
        );
        let namespace = ev.metadata.namespace.clone().unwrap_or_default();
        let api = Api::<Event>::namespaced(self.client.clone(), &namespace);
        let reason = reason.to_owned();
        tokio::spawn(async move {
            if let Err(e) = api.create(&PostParams::default(), &ev).await {
                tracing::warn!("sending the {reason} Event: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_shaped_as_kube_proxys() {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(0x1234_5678_9abc);
        let e = event(
            "node-1",
            node_ref("node-1"),
            Kind::Normal,
            "Starting",
            "StartKubeProxy",
            "",
            at,
        );
        assert_eq!(e.metadata.name.as_deref(), Some("node-1.123456789abc"));
        assert_eq!(e.metadata.namespace.as_deref(), Some("default"));
        assert_eq!(e.reporting_instance.as_deref(), Some("kube-proxy-node-1"));
        assert_eq!(e.note, None);
        let w = event(
            "node-1",
            service_ref("shop", "web"),
            Kind::Warning,
            "FailedToStartServiceHealthcheck",
            "Listen",
            "node node-1 failed to start healthcheck \"shop/web\" on port 30000: in use",
            at,
        );
        assert_eq!(w.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(w.type_.as_deref(), Some("Warning"));
        assert_eq!(w.regarding.and_then(|r| r.kind).as_deref(), Some("Service"));
    }
}
