//! The executor: the one place where the diff engine's [`Op`]s become kernel changes, through
//! the one [`Kernel`] seam (conversions in [`crate::kernel::convert`]).
//!
//! IPVS ops become netlink [`Request`]s applied in batches; address ops bind and unbind
//! addresses on `kube-ipvs0`. Every op gets its own result,
//! and a failed op is reported with the Service it belongs to while the others still apply.
//! This module decides nothing about what the table should hold (the engine does) and renders
//! nothing for people beyond the failure messages.

use std::collections::BTreeMap;
use std::net::IpAddr;

use kube_ipvs_diff::{Inputs, Op, ServiceName, VirtualKey, service_table};
use kube_ipvs_netlink::ipvs::Request;

use crate::kernel::convert::request_for;
use crate::kernel::{Kernel, KernelError};

/// Which Services each virtual server and address belongs to, for naming them in failures and
/// findings.
#[derive(Debug, Clone, Default)]
pub struct Owners {
    /// Services by virtual server.
    pub servers: BTreeMap<VirtualKey, Vec<ServiceName>>,
    /// Services by `kube-ipvs0` address.
    pub addresses: BTreeMap<IpAddr, Vec<ServiceName>>,
}

impl Owners {
    /// Who asks for what, from every Service's own table (so a virtual server two Services
    /// contest names both).
    pub fn from_inputs(inputs: &Inputs) -> Self {
        let mut owners = Owners::default();
        for name in inputs.service_names() {
            let st = service_table(inputs.service(name), inputs.endpoints(name), inputs.node());
            for (vs, _) in &st.servers {
                owners.servers.entry(vs.key).or_default().push(name.clone());
            }
            for a in &st.addresses {
                owners.addresses.entry(*a).or_default().push(name.clone());
            }
        }
        for names in owners
            .servers
            .values_mut()
            .chain(owners.addresses.values_mut())
        {
            names.sort();
        }
        owners
    }

    /// The Services an op belongs to.
    pub fn of(&self, op: &Op) -> &[ServiceName] {
        let found = match op {
            Op::AddAddress(a) | Op::RemoveAddress(a) => self.addresses.get(a),
            other => other.service().and_then(|k| self.servers.get(k)),
        };
        found.map(Vec::as_slice).unwrap_or(&[])
    }

    /// The Services an op belongs to as text: `default/web`, `a/x, b/y`, or a note that it
    /// belongs to none (a stale entry).
    pub fn label(&self, op: &Op) -> String {
        names_label(self.of(op))
    }
}

/// `default/web`, several joined by commas, or `(no Service)`.
pub fn names_label(names: &[ServiceName]) -> String {
    if names.is_empty() {
        return "(no Service)".to_owned();
    }
    names
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One op that the kernel refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The op.
    pub op: Op,
    /// The Services it belongs to.
    pub services: Vec<ServiceName>,
    /// The kernel's answer.
    pub error: String,
    /// The kernel's errno, when it gave one.
    pub errno: Option<i32>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "service {}: {}: {}",
            names_label(&self.services),
            self.op,
            self.error
        )
    }
}

/// IPVS requests built and applied at a time (each chunk goes out in as few `sendmsg` calls as
/// the socket buffers allow).
const REQUEST_CHUNK: usize = 8192;

/// Applies ops, which must be in [`kube_ipvs_diff::order_ops`] order: address binds first, then
/// every IPVS op in order (in chunks of [`REQUEST_CHUNK`]), then address removals (so an address is bound before traffic
/// can be sent to it and unbound only after its virtual servers are gone). Returns the ops
/// that failed, each with its Services; all others were applied.
pub fn apply(kernel: &mut dyn Kernel, ops: &[Op], owners: &Owners) -> Vec<Failure> {
    let mut failures = Vec::new();
    let mut fail = |op: &Op, error: Option<&KernelError>| {
        failures.push(Failure {
            op: op.clone(),
            services: owners.of(op).to_vec(),
            error: error.map_or_else(
                || "no result from the kernel".to_owned(),
                ToString::to_string,
            ),
            errno: error.and_then(KernelError::errno),
        });
    };
    let started = std::time::Instant::now();
    let adds: Vec<&Op> = ops
        .iter()
        .filter(|op| matches!(op, Op::AddAddress(_)))
        .collect();
    let address_adds = adds.len();
    if !adds.is_empty() {
        // Without the interface no bind can work; each bind is then reported with this cause.
        match kernel.ensure_interface() {
            Ok(()) => {
                let addrs: Vec<IpAddr> = adds
                    .iter()
                    .filter_map(|op| match op {
                        Op::AddAddress(a) => Some(*a),
                        _ => None,
                    })
                    .collect();
                let results = kernel.add_addresses(&addrs);
                for (i, op) in adds.iter().enumerate() {
                    match results.get(i) {
                        Some(Ok(())) => {}
                        Some(Err(e)) => fail(op, Some(e)),
                        None => fail(op, None),
                    }
                }
            }
            Err(e) => {
                for op in adds {
                    fail(op, Some(&e));
                }
            }
        }
    }
    let bound = std::time::Instant::now();
    // The requests are built and sent a chunk at a time: a startup at 10,000 Services is
    // 110,000 of them, and holding them all at once was a fifth of the agent's peak memory.
    let mut requests = 0;
    let mut chunk_ops: Vec<&Op> = Vec::new();
    let mut chunk: Vec<Request> = Vec::new();
    let mut ipvs_ops = ops
        .iter()
        .filter_map(|op| request_for(op).map(|r| (op, r)))
        .peekable();
    while ipvs_ops.peek().is_some() {
        chunk_ops.clear();
        chunk.clear();
        for (op, r) in ipvs_ops.by_ref().take(REQUEST_CHUNK) {
            chunk_ops.push(op);
            chunk.push(r);
        }
        requests += chunk.len();
        let results = kernel.apply_requests(&chunk);
        for (i, op) in chunk_ops.iter().enumerate() {
            match results.get(i) {
                Some(Ok(())) => {}
                Some(Err(e)) => fail(op, Some(e)),
                None => fail(op, None),
            }
        }
    }
    let programmed = std::time::Instant::now();
    for op in ops {
        if let Op::RemoveAddress(a) = op
            && let Err(e) = kernel.remove_address(*a)
        {
            fail(op, Some(&e));
        }
    }
    // Where a big apply (a startup, a large reconcile) spent its time; small ones only at debug.
    let (binds_ms, ipvs_ms, removals_ms) = (
        (bound - started).as_secs_f64() * 1000.0,
        (programmed - bound).as_secs_f64() * 1000.0,
        programmed.elapsed().as_secs_f64() * 1000.0,
    );
    // The macros evaluate their arguments only when the level is enabled: nothing is formatted
    // for an ordinary incremental sync.
    let binds = || crate::words::count(address_adds, "address bind", "address binds");
    let sent = || crate::words::count(requests, "IPVS request", "IPVS requests");
    if address_adds + requests >= 1000 {
        tracing::info!(
            "applied {} in {binds_ms:.1} ms, {} in {ipvs_ms:.1} ms, removals in {removals_ms:.1} ms",
            binds(),
            sent()
        );
    } else {
        tracing::debug!(
            "applied {} in {binds_ms:.1} ms, {} in {ipvs_ms:.1} ms, removals in {removals_ms:.1} ms",
            binds(),
            sent()
        );
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::convert::op_for;
    use crate::kernel::mem::MemKernel;
    use crate::kernel::test_support::{ip, vs};
    use kube_ipvs_diff::{RealServer, ServiceEntry, Table};

    #[test]
    fn executor_takes_an_empty_kernel_to_the_desired_table() {
        let mut desired = Table::default();
        let v = vs("10.96.0.10", 80);
        desired.services.insert(
            v.key,
            ServiceEntry {
                server: v,
                dests: [
                    RealServer::masq(ip("10.244.1.5"), 8080, 1),
                    RealServer::masq(ip("10.244.2.5"), 8080, 1),
                ]
                .into_iter()
                .map(|d| (d.key, d))
                .collect(),
            },
        );
        desired.addresses.insert(ip("10.96.0.10"));
        let ops = kube_ipvs_diff::full_diff(&desired, &Table::default(), Default::default());
        let mut k = MemKernel::default();
        let failures = apply(&mut k, &ops, &Owners::default());
        assert_eq!(failures, vec![]);
        assert_eq!(k.state().table, desired);
        // One batch: a service and two destinations.
        assert_eq!(k.state().requests.len(), 3);
    }

    #[test]
    fn a_failed_op_names_its_service_and_the_others_still_apply() {
        let web = vs("10.96.0.10", 80);
        let db = vs("10.96.0.20", 5432);
        let mut desired = Table::default();
        for (v, port) in [(web, 8080), (db, 5432)] {
            let d = RealServer::masq(ip("10.244.1.5"), port, 1);
            desired.services.insert(
                v.key,
                ServiceEntry {
                    server: v,
                    dests: [(d.key, d)].into_iter().collect(),
                },
            );
        }
        let mut owners = Owners::default();
        owners
            .servers
            .insert(web.key, vec![ServiceName::new("default", "web")]);
        owners
            .servers
            .insert(db.key, vec![ServiceName::new("prod", "db")]);
        let ops = kube_ipvs_diff::full_diff(&desired, &Table::default(), Default::default());
        let mut k = MemKernel::default();
        k.state().fail_dest_port = Some(8080);
        let failures = apply(&mut k, &ops, &owners);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(
            failures[0].to_string(),
            "service default/web: add dest TCP 10.96.0.10:80 -> 10.244.1.5:8080 masq weight 1: \
             injected failure"
        );
        assert_eq!(
            k.state().table.dest_count(),
            1,
            "the db destination still applied"
        );
        assert!(k.state().table.services[&db.key].dests.len() == 1);
    }

    #[test]
    fn many_requests_go_in_chunks_in_order_and_a_failure_in_a_later_chunk_is_its_own() {
        // 1,900 virtual servers with 9 real servers each: 19,000 requests, three chunks.
        let mut desired = Table::default();
        for i in 0..1900u32 {
            let v = vs(&std::net::Ipv4Addr::from(0x0a60_0000 + i).to_string(), 80);
            let port = if i == 1800 { 9999 } else { 8080 };
            desired.services.insert(
                v.key,
                ServiceEntry {
                    server: v,
                    dests: (0..9u32)
                        .map(|j| RealServer::masq(IpAddr::V4((0x0af4_0000 + j).into()), port, 1))
                        .map(|d| (d.key, d))
                        .collect(),
                },
            );
        }
        let ops = kube_ipvs_diff::full_diff(&desired, &Table::default(), Default::default());
        let mut k = MemKernel::default();
        k.state().fail_dest_port = Some(9999);
        let failures = apply(&mut k, &ops, &Owners::default());
        assert_eq!(
            k.state().batches,
            vec![REQUEST_CHUNK, REQUEST_CHUNK, 19_000 - 2 * REQUEST_CHUNK]
        );
        assert_eq!(failures.len(), 9, "the nine real servers of 10.96.7.8 only");
        assert!(
            failures
                .iter()
                .all(|f| f.to_string().contains("10.96.7.8:80 -> ")
                    && f.to_string().contains(":9999")),
            "{failures:?}"
        );
        // Everything else arrived, in the executor's order.
        assert_eq!(k.state().table.dest_count(), 1900 * 9 - 9);
        let sent: Vec<Op> = k.state().requests.iter().filter_map(op_for).collect();
        let wanted: Vec<Op> = ops
            .iter()
            .filter(|op| request_for(op).is_some())
            .cloned()
            .collect();
        assert_eq!(sent, wanted);
    }
}
