//! Translation of Kubernetes objects (k8s-openapi types) into the engine's model.
//!
//! Pure functions, no I/O: both sources (the API server and manifests) and the tests call them.
//! This module owns the rules that decide what a Service or an EndpointSlice means to the proxy:
//! which objects are skipped (headless, ExternalName, another proxy's), defaults the API leaves
//! implicit (an absent `ready` condition is ready), and how endpoints that appear in several
//! slices are merged. It must not decide what to program into the kernel; that is the engine's.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_ipvs_diff::model::{
    SCHEDULER_ANNOTATION, unusable_vip, validate_endpoints, validate_service,
};
use kube_ipvs_diff::{
    Cidr, Endpoint, EndpointPort, Protocol, Scheduler, ServiceInfo, ServiceKind, ServiceName,
    ServicePort, SessionAffinity, TrafficDistribution, TrafficPolicy,
};

use crate::error::{Error, Result};

/// Label that hands a Service to a specific proxy implementation.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Label the control plane puts on headless Services' EndpointSlices.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
/// Label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The Node label carrying its zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The annotation the EndpointSlice controller sets to when the change behind a slice's update
/// happened (a pod became ready, say), in RFC 3339. The network programming latency is measured
/// from it.
pub const LAST_CHANGE_TRIGGER_TIME_ANNOTATION: &str =
    "endpoints.kubernetes.io/last-change-trigger-time";

/// What translation needs to know about this proxy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TranslateOptions {
    /// `--service-proxy-name`: Services labelled with [`SERVICE_PROXY_NAME_LABEL`] are ours only
    /// if the label names this. `None` means we take only unlabelled Services, as kube-proxy.
    pub service_proxy_name: Option<String>,
}

impl TranslateOptions {
    /// The label selector the API server can apply for us. The proxy-name rule "absent, or equal
    /// to ours" cannot be written as one selector, so with a proxy name only headless Services
    /// are filtered on the server and [`skip_reason`] does the rest.
    pub fn label_selector(&self) -> String {
        match self.service_proxy_name {
            None => format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}"),
            Some(_) => format!("!{HEADLESS_LABEL}"),
        }
    }
}

/// Why an object is not for this proxy; `None` if it is. Applies to Services and slices alike,
/// from their labels.
pub fn skip_reason(
    labels: Option<&BTreeMap<String, String>>,
    opts: &TranslateOptions,
) -> Option<String> {
    let labels = labels?;
    if labels.contains_key(HEADLESS_LABEL) {
        return Some(format!("labelled {HEADLESS_LABEL}"));
    }
    match (
        labels.get(SERVICE_PROXY_NAME_LABEL),
        &opts.service_proxy_name,
    ) {
        (None, _) => None,
        (Some(theirs), Some(ours)) if theirs == ours => None,
        (Some(theirs), _) => Some(format!(
            "{SERVICE_PROXY_NAME_LABEL}={theirs} is not this proxy"
        )),
    }
}

/// A Service translated into the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TranslatedService {
    /// Its namespace and name.
    pub name: ServiceName,
    /// What the engine needs.
    pub info: ServiceInfo,
    /// Problems that did not stop translation (an invalid scheduler annotation: the node
    /// default is used). The sources log these with the object's name.
    pub warnings: Vec<String>,
}

fn bad(kind: &'static str, ns: &str, name: &str, reason: String) -> Error {
    Error::BadObject {
        kind,
        namespace: ns.to_owned(),
        name: name.to_owned(),
        reason,
    }
}

/// The namespace/name of a Service, or of the Service an EndpointSlice belongs to.
pub fn service_name(svc: &Service) -> ServiceName {
    ServiceName::new(
        svc.metadata.namespace.as_deref().unwrap_or("default"),
        svc.metadata.name.as_deref().unwrap_or_default(),
    )
}

fn parse_protocol(p: Option<&str>) -> std::result::Result<Protocol, String> {
    // The API defaults an absent protocol to TCP.
    match p.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        other => Err(format!("unknown protocol {other:?}")),
    }
}

fn parse_port(what: &str, p: i32) -> std::result::Result<u16, String> {
    u16::try_from(p)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{what} {p} is out of range 1..=65535"))
}

fn parse_ip(what: &str, s: &str) -> std::result::Result<IpAddr, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("{what} {s:?} is not an IP address"))
}

/// Translates a Service. `Ok(None)` means the Service is not programmed by this proxy
/// (headless, ExternalName, another proxy's); `Err` means it is malformed and must be skipped.
pub fn translate_service(
    svc: &Service,
    opts: &TranslateOptions,
) -> Result<Option<TranslatedService>> {
    let name = service_name(svc);
    let err = |reason: String| bad("Service", &name.namespace, &name.name, reason);
    if name.name.is_empty() {
        return Err(err("metadata.name is empty".into()));
    }
    if skip_reason(svc.metadata.labels.as_ref(), opts).is_some() {
        return Ok(None);
    }
    let Some(spec) = &svc.spec else {
        return Err(err("spec is missing".into()));
    };
    let kind = match spec.type_.as_deref().unwrap_or("ClusterIP") {
        "ClusterIP" => ServiceKind::ClusterIp,
        "NodePort" => ServiceKind::NodePort,
        "LoadBalancer" => ServiceKind::LoadBalancer,
        "ExternalName" => return Ok(None),
        other => return Err(err(format!("unknown spec.type {other:?}"))),
    };
    // `clusterIPs` is authoritative when set; older objects only have `clusterIP`.
    let ips: Vec<&str> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        (_, Some(ip)) if !ip.is_empty() => vec![ip.as_str()],
        _ => Vec::new(),
    };
    if ips.is_empty() || ips.contains(&"None") {
        // Headless: DNS only, nothing to balance.
        return Ok(None);
    }
    let cluster_ips = ips
        .iter()
        .map(|ip| parse_ip("clusterIP", ip))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(err)?;
    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let label = match &p.name {
            Some(n) if !n.is_empty() => format!("port {n:?}"),
            _ => format!("ports[{i}]"),
        };
        let protocol =
            parse_protocol(p.protocol.as_deref()).map_err(|r| err(format!("{label}: {r}")))?;
        let port = parse_port("port", p.port).map_err(|r| err(format!("{label}: {r}")))?;
        let node_port = p
            .node_port
            .filter(|np| *np != 0)
            .map(|np| parse_port("nodePort", np))
            .transpose()
            .map_err(|r| err(format!("{label}: {r}")))?;
        ports.push(ServicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol,
            port,
            node_port,
        });
    }
    let external_ips = spec
        .external_ips
        .iter()
        .flatten()
        .map(|ip| parse_ip("externalIP", ip))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(err)?;
    let mut load_balancer_ips = Vec::new();
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for ing in ingress.into_iter().flatten() {
        // ipMode Proxy means the load balancer delivers to the node itself, not to the VIP.
        if ing.ip_mode.as_deref() == Some("Proxy") {
            continue;
        }
        if let Some(ip) = &ing.ip {
            load_balancer_ips.push(parse_ip("status.loadBalancer.ingress ip", ip).map_err(err)?);
        }
    }
    let session_affinity = match spec.session_affinity.as_deref().unwrap_or("None") {
        "None" => SessionAffinity::None,
        "ClientIP" => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            let timeout_seconds = match t {
                None => kube_ipvs_diff::model::DEFAULT_AFFINITY_TIMEOUT_SECONDS,
                Some(t) => u32::try_from(t).map_err(|_| {
                    err(format!(
                        "sessionAffinityConfig.clientIP.timeoutSeconds {t} is negative"
                    ))
                })?,
            };
            SessionAffinity::ClientIp { timeout_seconds }
        }
        other => return Err(err(format!("unknown spec.sessionAffinity {other:?}"))),
    };
    let policy = |field: &str, v: Option<&str>| match v.unwrap_or("Cluster") {
        "Cluster" => Ok(TrafficPolicy::Cluster),
        "Local" => Ok(TrafficPolicy::Local),
        other => Err(err(format!("unknown spec.{field} {other:?}"))),
    };
    let external_traffic_policy = policy(
        "externalTrafficPolicy",
        spec.external_traffic_policy.as_deref(),
    )?;
    let internal_traffic_policy = policy(
        "internalTrafficPolicy",
        spec.internal_traffic_policy.as_deref(),
    )?;
    let health_check_node_port = spec
        .health_check_node_port
        .filter(|p| *p != 0)
        .map(|p| parse_port("healthCheckNodePort", p))
        .transpose()
        .map_err(err)?;
    let load_balancer_source_ranges = spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .map(|r| {
            r.parse::<Cidr>()
                .map_err(|e| err(format!("loadBalancerSourceRanges: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let traffic_distribution = spec.traffic_distribution.as_deref().map(|t| match t {
        "PreferClose" => TrafficDistribution::PreferClose,
        "PreferSameZone" => TrafficDistribution::PreferSameZone,
        "PreferSameNode" => TrafficDistribution::PreferSameNode,
        other => TrafficDistribution::Other(other.to_owned()),
    });
    let mut warnings = Vec::new();
    let scheduler = match svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SCHEDULER_ANNOTATION))
    {
        None => None,
        Some(v) => match v.parse::<Scheduler>() {
            Ok(s) => Some(s),
            Err(e) => {
                warnings.push(format!(
                    "annotation {SCHEDULER_ANNOTATION}: {e}; using the node default"
                ));
                None
            }
        },
    };
    let info = ServiceInfo {
        kind,
        cluster_ips,
        ports,
        external_ips,
        load_balancer_ips,
        session_affinity,
        external_traffic_policy,
        internal_traffic_policy,
        health_check_node_port,
        load_balancer_source_ranges,
        traffic_distribution,
        scheduler,
        // Assigned by the input store.
        local_marks: Vec::new(),
    };
    validate_service(&name, &info).map_err(|source| Error::Rejected {
        kind: "Service",
        namespace: name.namespace.clone(),
        name: name.name.clone(),
        source: Box::new(source),
    })?;
    Ok(Some(TranslatedService {
        name,
        info,
        warnings,
    }))
}

/// One EndpointSlice translated: the Service it belongs to and its endpoints, merged (sorted by
/// address, one per address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TranslatedSlice {
    /// The owning Service (the `kubernetes.io/service-name` label).
    pub service: ServiceName,
    /// The slice's endpoints, merged as [`merge_slices`] merges one slice alone (sorted by
    /// address, one per address), so a Service with one slice shares this list.
    pub endpoints: Arc<[Endpoint]>,
    /// Its [`LAST_CHANGE_TRIGGER_TIME_ANNOTATION`], if present and valid.
    pub trigger_time: Option<SystemTime>,
    /// Problems that did not stop translation (a malformed trigger time: the change is applied
    /// but not measured). The sources log these with the slice's name.
    pub warnings: Vec<String>,
}

/// Reads [`LAST_CHANGE_TRIGGER_TIME_ANNOTATION`]: `Ok(None)` if absent, `Err` with the reason if
/// it is not an RFC 3339 time. kube-proxy parses it with Go's `time.RFC3339Nano`, which accepts
/// the same texts (fractional seconds optional, `Z` or a numeric offset).
pub fn trigger_time(
    annotations: Option<&BTreeMap<String, String>>,
) -> std::result::Result<Option<SystemTime>, String> {
    let Some(v) = annotations.and_then(|a| a.get(LAST_CHANGE_TRIGGER_TIME_ANNOTATION)) else {
        return Ok(None);
    };
    let ts: k8s_openapi::jiff::Timestamp = v.parse().map_err(|e| {
        format!(
            "annotation {LAST_CHANGE_TRIGGER_TIME_ANNOTATION} {v:?} is not an RFC 3339 time: {e}"
        )
    })?;
    Ok(Some(SystemTime::from(ts)))
}

/// The namespace and name of a slice: its key in the tracker, and its name in messages.
pub(crate) fn slice_key(slice: &EndpointSlice) -> (String, String) {
    (
        slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        slice.metadata.name.clone().unwrap_or_default(),
    )
}

/// Translates one EndpointSlice. `Ok(None)` means it is not for this proxy (no service-name
/// label, headless, another proxy's, or an FQDN slice, which IPVS cannot use).
pub fn translate_slice(
    slice: &EndpointSlice,
    opts: &TranslateOptions,
) -> Result<Option<TranslatedSlice>> {
    let (ns, name) = slice_key(slice);
    let err = |reason: String| bad("EndpointSlice", &ns, &name, reason);
    let labels = slice.metadata.labels.as_ref();
    let Some(svc) = labels.and_then(|l| l.get(SERVICE_NAME_LABEL)) else {
        return Ok(None);
    };
    if skip_reason(labels, opts).is_some() {
        return Ok(None);
    }
    let v6 = match slice.address_type.as_str() {
        "IPv4" => false,
        "IPv6" => true,
        "FQDN" => return Ok(None),
        other => return Err(err(format!("unknown addressType {other:?}"))),
    };
    let mut ports = Vec::new();
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        // A nil port means "all ports", which only headless Services use; nothing to balance.
        let Some(port) = p.port else { continue };
        let label = format!("ports[{i}]");
        ports.push(EndpointPort {
            name: p.name.clone().unwrap_or_default(),
            port: parse_port("port", port).map_err(|r| err(format!("{label}: {r}")))?,
            protocol: parse_protocol(p.protocol.as_deref())
                .map_err(|r| err(format!("{label}: {r}")))?,
        });
    }
    ports.sort();
    // One copy of the ports and of each node's name per slice, shared by its endpoints.
    let ports: Arc<[EndpointPort]> = ports.into();
    let mut names: Vec<Arc<str>> = Vec::new();
    let mut endpoints = Vec::new();
    let mut warnings = Vec::new();
    for (i, ep) in slice.endpoints.iter().enumerate() {
        // One unusable endpoint costs only itself, as in kube-proxy: the slice's others stay.
        let mut skip = |reason: String| {
            warnings.push(format!(
                "{reason}; this endpoint is skipped, the slice's others stay"
            ));
        };
        // The API says consumers use the first address; the others are for future use.
        let Some(text) = ep.addresses.first() else {
            skip(format!("endpoints[{i}]: no address"));
            continue;
        };
        let addr = match parse_ip(&format!("endpoints[{i}] address"), text) {
            Ok(a) => a,
            Err(reason) => {
                skip(reason);
                continue;
            }
        };
        if addr.is_ipv6() != v6 {
            skip(format!(
                "endpoints[{i}] address {addr} does not match addressType {}",
                slice.address_type
            ));
            continue;
        }
        if let Some(why) = kube_ipvs_diff::endpoint_address_problem(addr) {
            skip(format!("endpoints[{i}] address {addr}: {why}"));
            continue;
        }
        let c = ep.conditions.as_ref();
        // Per the API: a nil ready means ready, a nil serving means the same as ready, and a
        // nil terminating means not terminating.
        let ready = c.and_then(|c| c.ready).unwrap_or(true);
        let serving = c.and_then(|c| c.serving).unwrap_or(ready);
        let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
        let hints = ep.hints.as_ref();
        let node_name = ep.node_name.as_deref().map(|n| share(&mut names, n));
        let zone = ep.zone.as_deref().map(|z| share(&mut names, z));
        endpoints.push(Endpoint {
            addr,
            ports: ports.clone(),
            ready,
            serving,
            terminating,
            node_name,
            zone,
            hints_for_zones: hints
                .and_then(|h| h.for_zones.as_ref())
                .map(|z| z.iter().map(|z| z.name.clone()).collect())
                .unwrap_or_default(),
            hints_for_nodes: hints
                .and_then(|h| h.for_nodes.as_ref())
                .map(|n| n.iter().map(|n| n.name.clone()).collect())
                .unwrap_or_default(),
        });
    }
    let service = ServiceName::new(ns.clone(), svc.clone());
    validate_endpoints(&service, &endpoints).map_err(|source| Error::Rejected {
        kind: "EndpointSlice",
        namespace: ns.clone(),
        name: name.clone(),
        source: Box::new(source),
    })?;
    // A bad trigger time only costs the measurement, never the endpoints.
    let trigger_time = trigger_time(slice.metadata.annotations.as_ref()).unwrap_or_else(|w| {
        warnings.push(w);
        None
    });
    Ok(Some(TranslatedSlice {
        service,
        // Held merged, as merging this slice alone would leave it (most slices already are, and
        // are kept as they are).
        endpoints: merge_slices([&endpoints.into()]),
        trigger_time,
        warnings,
    }))
}

/// One shared copy of `name` among the names a slice has used so far (its endpoints' nodes
/// and zones: a handful, so a linear search).
fn share(names: &mut Vec<Arc<str>>, name: &str) -> Arc<str> {
    if let Some(shared) = names.iter().find(|a| ***a == *name) {
        return shared.clone();
    }
    let shared: Arc<str> = name.into();
    names.push(shared.clone());
    shared
}

/// Merges the endpoints of all slices of one Service, given in slice-name order.
///
/// An address may appear in more than one slice (while the controller moves it between
/// slices, or in a hand-written manifest). The rule, deterministic and documented: the copy
/// with the best conditions wins, ranked ready > serving > not terminating; on a tie the copy
/// from the slice whose name sorts first wins. The winner's ports stand; a port (by name and
/// protocol) that only another copy carries is added, since slices of one Service may carry
/// different named ports for one pod. The result is sorted by address, ports by name.
///
/// One slice merged already (see [`kube_ipvs_diff::endpoints_merged`]; every slice the tracker
/// holds is) is the result itself, shared rather than copied.
pub fn merge_slices<'a>(slices: impl IntoIterator<Item = &'a Arc<[Endpoint]>>) -> Arc<[Endpoint]> {
    let slices: Vec<&Arc<[Endpoint]>> = slices.into_iter().filter(|s| !s.is_empty()).collect();
    match slices[..] {
        [] => Arc::default(),
        [one] if kube_ipvs_diff::endpoints_merged(one) => Arc::clone(one),
        _ => merge(slices.into_iter().map(|s| &s[..])).into(),
    }
}

/// [`merge_slices`]' rule, on any slices.
fn merge<'a>(slices: impl IntoIterator<Item = &'a [Endpoint]>) -> Vec<Endpoint> {
    let mut by_addr: BTreeMap<IpAddr, Endpoint> = BTreeMap::new();
    let rank = |e: &Endpoint| (e.ready, e.serving, !e.terminating);
    let add_missing = |into: &mut Arc<[EndpointPort]>, from: &[EndpointPort]| {
        let missing: Vec<&EndpointPort> = from
            .iter()
            .filter(|p| {
                !into
                    .iter()
                    .any(|q| q.name == p.name && q.protocol == p.protocol)
            })
            .collect();
        if !missing.is_empty() {
            let mut united = into.to_vec();
            united.extend(missing.into_iter().cloned());
            *into = united.into();
        }
    };
    for ep in slices.into_iter().flatten() {
        match by_addr.get_mut(&ep.addr) {
            None => {
                by_addr.insert(ep.addr, ep.clone());
            }
            Some(cur) if rank(ep) > rank(cur) => {
                let loser = std::mem::replace(cur, ep.clone());
                add_missing(&mut cur.ports, &loser.ports);
            }
            Some(cur) => add_missing(&mut cur.ports, &ep.ports),
        }
    }
    for ep in by_addr.values_mut() {
        if !ep.ports.is_sorted() {
            let mut sorted = ep.ports.to_vec();
            sorted.sort();
            ep.ports = sorted.into();
        }
    }
    by_addr.into_values().collect()
}

/// Translates any number of EndpointSlices into merged endpoints per Service. Bad slices are
/// returned as errors and left out; the others are merged as [`merge_slices`] describes.
pub fn translate_slices(
    slices: &[EndpointSlice],
    opts: &TranslateOptions,
) -> (BTreeMap<ServiceName, Arc<[Endpoint]>>, Vec<Error>) {
    let mut per_service: BTreeMap<ServiceName, BTreeMap<String, Arc<[Endpoint]>>> = BTreeMap::new();
    let mut errors = Vec::new();
    for slice in slices {
        match translate_slice(slice, opts) {
            Ok(Some(t)) => {
                per_service
                    .entry(t.service)
                    .or_default()
                    .insert(slice_key(slice).1, t.endpoints);
            }
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    let merged = per_service
        .into_iter()
        .map(|(svc, slices)| {
            let eps = merge_slices(slices.values());
            (svc, eps)
        })
        .collect();
    (merged, errors)
}

/// What the proxy takes from its own Node object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// The [`ZONE_LABEL`] label.
    pub zone: Option<String>,
    /// `status.addresses` of type `InternalIP`, IPv4, in the object's order.
    pub ips_v4: Vec<std::net::Ipv4Addr>,
    /// `status.addresses` of type `InternalIP`, IPv6, in the object's order.
    pub ips_v6: Vec<std::net::Ipv6Addr>,
    /// `spec.podCIDRs` (or the older `spec.podCIDR` alone), in the object's order.
    pub pod_cidrs: Vec<Cidr>,
    /// The node is going away: it has a deletion timestamp or the cluster autoscaler's
    /// [`TO_BE_DELETED_TAINT`]. kube-proxy's `/healthz` then answers 503 (`nodeEligible:
    /// false`) so load balancers drain the node first.
    pub draining: bool,
}

/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Translates this node's Node object. An address that does not parse is an error, so a
/// broken object never silently shrinks the node's NodePort addresses.
pub fn translate_node(node: &Node) -> Result<NodeInfo> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let zone = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ZONE_LABEL))
        .cloned();
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    let mut info = NodeInfo {
        zone,
        draining: node.metadata.deletion_timestamp.is_some() || tainted,
        ..NodeInfo::default()
    };
    let addrs = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for a in addrs
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP")
    {
        let ip = parse_ip("InternalIP", &a.address).map_err(|r| bad("Node", "", &name, r))?;
        if let Some(why) = unusable_vip(ip) {
            return Err(bad("Node", "", &name, format!("InternalIP {ip} {why}")));
        }
        match ip {
            IpAddr::V4(v4) => info.ips_v4.push(v4),
            IpAddr::V6(v6) => info.ips_v6.push(v6),
        }
    }
    let spec = node.spec.as_ref();
    let cidrs = spec
        .and_then(|s| s.pod_cidrs.clone())
        .filter(|c| !c.is_empty())
        .or_else(|| spec.and_then(|s| s.pod_cidr.clone()).map(|c| vec![c]))
        .unwrap_or_default();
    for c in cidrs {
        let cidr = c
            .parse::<Cidr>()
            .map_err(|e| bad("Node", "", &name, format!("podCIDRs: {c:?}: {e}")))?;
        info.pod_cidrs.push(cidr);
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::Endpoint as K8sEndpoint;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use std::time::Duration;

    fn slice(annotation: Option<&str>) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some("web-abc".into()),
                namespace: Some("shop".into()),
                labels: Some(BTreeMap::from([(
                    SERVICE_NAME_LABEL.to_owned(),
                    "web".to_owned(),
                )])),
                annotations: annotation.map(|v| {
                    BTreeMap::from([(LAST_CHANGE_TRIGGER_TIME_ANNOTATION.to_owned(), v.to_owned())])
                }),
                ..ObjectMeta::default()
            },
            address_type: "IPv4".into(),
            endpoints: vec![K8sEndpoint {
                addresses: vec!["10.0.0.1".into()],
                ..K8sEndpoint::default()
            }],
            ports: None,
        }
    }

    #[test]
    fn a_node_being_deleted_or_tainted_for_deletion_is_draining() {
        let node =
            |json: serde_json::Value| -> Node { serde_json::from_value(json).expect("node") };
        let plain = node(serde_json::json!({"metadata": {"name": "n1"}}));
        assert!(!translate_node(&plain).expect("valid").draining);
        let other_taint = node(serde_json::json!({"metadata": {"name": "n1"},
            "spec": {"taints": [{"key": "dedicated", "effect": "NoSchedule"}]}}));
        assert!(!translate_node(&other_taint).expect("valid").draining);
        let tainted = node(serde_json::json!({"metadata": {"name": "n1"},
            "spec": {"taints": [{"key": TO_BE_DELETED_TAINT, "value": "1700000000", "effect": "NoSchedule"}]}}));
        assert!(translate_node(&tainted).expect("valid").draining);
        let deleted = node(serde_json::json!({"metadata": {"name": "n1",
            "deletionTimestamp": "2026-12-02T04:00:00Z"}}));
        assert!(translate_node(&deleted).expect("valid").draining);
    }

    /// An InternalIP the engine cannot use as a node address (loopback, unspecified, multicast,
    /// broadcast) leaves the Node out with a message naming it, as an unparsable one does, instead
    /// of reaching the model, which would refuse the whole node context (found by the `objects`
    /// fuzz target).
    #[test]
    fn a_node_with_an_unusable_internal_ip_is_refused_by_name() {
        for addr in [
            "::1",
            "127.0.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
        ] {
            let node: Node = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "n1"},
                "status": {"addresses": [
                    {"type": "InternalIP", "address": "192.168.56.10"},
                    {"type": "InternalIP", "address": addr}]}}))
            .expect("node");
            let e = translate_node(&node).expect_err(addr).to_string();
            assert!(e.contains("n1") && e.contains(addr), "{e}");
        }
    }

    fn translated(annotation: Option<&str>) -> TranslatedSlice {
        translate_slice(&slice(annotation), &TranslateOptions::default())
            .expect("valid slice")
            .expect("ours")
    }

    #[test]
    fn the_trigger_time_annotation_is_parsed_as_rfc3339() {
        // As the EndpointSlice controller writes it (RFC 3339 with nanoseconds, UTC).
        let t = translated(Some("2026-11-30T13:16:06.123456789Z"));
        let want = SystemTime::UNIX_EPOCH + Duration::new(1_796_044_566, 123_456_789);
        assert_eq!(t.trigger_time, Some(want));
        assert!(t.warnings.is_empty());
        // Whole seconds and a numeric offset are RFC 3339 too.
        let t = translated(Some("2026-11-30T14:16:06+01:00"));
        assert_eq!(
            t.trigger_time,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_044_566))
        );
    }

    #[test]
    fn an_absent_trigger_time_is_none_without_a_warning() {
        let t = translated(None);
        assert_eq!(t.trigger_time, None);
        assert!(t.warnings.is_empty());
    }

    #[test]
    fn a_malformed_trigger_time_is_a_warning_and_the_endpoints_stay() {
        for bad in [
            "",
            "yesterday",
            "2026-11-30 13:16:06",
            "2026-11-30T13:16:06",
        ] {
            let t = translated(Some(bad));
            assert_eq!(t.trigger_time, None, "{bad:?}");
            assert_eq!(t.endpoints.len(), 1, "{bad:?}");
            assert_eq!(t.warnings.len(), 1, "{bad:?}");
            assert!(
                t.warnings[0].contains(LAST_CHANGE_TRIGGER_TIME_ANNOTATION)
                    && t.warnings[0].contains(&format!("{bad:?}")),
                "{}",
                t.warnings[0]
            );
        }
    }
}
