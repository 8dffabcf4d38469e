//! The executor: the one place where the diff engine's [`Op`]s become kernel changes, through
//! the one [`Kernel`] seam (conversions in [`crate::kernel::convert`]).
//!
//! IPVS ops become netlink [`Request`]s applied in batches; address ops bind and unbind
//! addresses on `kube-ipvs0`. Every op gets its own result,
//! and a failed op is reported with the Service it belongs to while the others still apply.
//! This module decides nothing about what the table should hold (the engine does) and renders
//! nothing for people beyond the failure messages.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Condvar, Mutex, PoisonError};

use kube_ipvs_diff::{Inputs, Op, ServiceName, VirtualKey, service_table};

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

/// Fewer binds than this are made on the apply's own thread before the IPVS requests, not on
/// a binder thread beside them.
const BINDER_MIN: usize = 64;

/// Addresses a binder thread binds per call, so the IPVS requests that need them can go out
/// while it binds the next ones.
const BIND_STEP: usize = 256;

/// IPVS requests sent per call at least while a binder thread is still binding (fewer only at
/// the end of a chunk), so waiting for it does not cut the requests into tiny batches.
const MIN_RUN: usize = 512;

/// Applies ops, which must be in [`kube_ipvs_diff::order_ops`] order: address binds, then
/// every IPVS op in order (in chunks of [`REQUEST_CHUNK`]), then address removals. A virtual
/// server is created only once its address is bound, and an address is unbound only after its
/// virtual servers are gone. Many binds (a startup) are made on a thread of their own through
/// [`Kernel::address_binder`] while the IPVS requests go out: the new virtual servers of each
/// step of [`BIND_STEP`] binds, with their real servers, go out once that step is done (what
/// a stopped binder left is bound on the caller's thread first), and the apply returns when
/// both are done. Returns the ops that failed, each with its Services; all others were
/// applied.
pub fn apply(kernel: &mut dyn Kernel, ops: &[Op], owners: &Owners) -> Vec<Failure> {
    let failure = |op: &Op, error: Option<&KernelError>| Failure {
        op: op.clone(),
        services: owners.of(op).to_vec(),
        error: error.map_or_else(
            || "no result from the kernel".to_owned(),
            ToString::to_string,
        ),
        errno: error.and_then(KernelError::errno),
    };
    let started = std::time::Instant::now();
    let adds: Vec<&Op> = ops
        .iter()
        .filter(|op| matches!(op, Op::AddAddress(_)))
        .collect();
    let addrs: Vec<IpAddr> = adds
        .iter()
        .filter_map(|op| match op {
            Op::AddAddress(a) => Some(*a),
            _ => None,
        })
        .collect();
    // The binds' failures come first, as the binds do.
    let mut failures = Vec::new();
    let mut binder = None;
    if !adds.is_empty() {
        match kernel.ensure_interface() {
            Ok(()) => {
                if adds.len() >= BINDER_MIN {
                    binder = kernel.address_binder();
                }
                if binder.is_none() {
                    let results = kernel.add_addresses(&addrs);
                    collect(adds.iter().copied(), &results, &failure, &mut failures);
                }
            }
            // Without the interface no bind can work; each bind is then reported with this
            // cause.
            Err(e) => failures.extend(adds.iter().map(|op| failure(op, Some(&e)))),
        }
    }
    let bound = std::time::Instant::now();
    let ipvs_ops = ops
        .iter()
        .filter(|op| !matches!(op, Op::AddAddress(_) | Op::RemoveAddress(_)));
    let overlapped = binder.is_some();
    let (requests, waited) = match binder {
        // Every address is bound already: the IPVS ops go out in `order_ops` order.
        None => (
            send(
                kernel,
                ipvs_ops.map(|op| (0, op)),
                &mut |_, _| usize::MAX,
                &failure,
                &mut failures,
            ),
            std::time::Duration::ZERO,
        ),
        Some(bind) => {
            let progress = Progress::default();
            let (requests, waited) = std::thread::scope(|scope| {
                let binding = scope.spawn(|| bind_in_steps(bind, &addrs, &progress));
                let gated = gated(ops, ipvs_ops, &addrs);
                let mut waited = std::time::Duration::ZERO;
                let requests = send(
                    kernel,
                    gated.into_iter(),
                    &mut |kernel, gate| {
                        let t = std::time::Instant::now();
                        let mut bound = progress.wait_for(gate);
                        if bound < gate {
                            // The binder stopped short: the rest is bound here, before any
                            // virtual server on it goes out.
                            progress.bind_rest(kernel, &addrs);
                            bound = usize::MAX;
                        }
                        waited += t.elapsed();
                        bound
                    },
                    &failure,
                    &mut failures,
                );
                if let Err(panic) = binding.join() {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::error!(
                        "the address binder stopped: {what}; the rest is bound on the loop"
                    );
                }
                (requests, waited)
            });
            // Whatever a stopped binder left (its virtual servers all went out already if it
            // did not stop short).
            progress.bind_rest(kernel, &addrs);
            let mut bind_failures = Vec::new();
            collect(
                adds.iter().copied(),
                &progress.take_results(),
                &failure,
                &mut bind_failures,
            );
            failures.splice(0..0, bind_failures);
            (requests, waited)
        }
    };
    let programmed = std::time::Instant::now();
    for op in ops {
        if let Op::RemoveAddress(a) = op
            && let Err(e) = kernel.remove_address(*a)
        {
            failures.push(failure(op, Some(&e)));
        }
    }
    // Where a big apply (a startup, a large reconcile) spent its time; small ones only at debug.
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    let (binds_ms, ipvs_ms, removals_ms) = (
        ms(bound - started),
        ms(programmed - bound),
        ms(programmed.elapsed()),
    );
    // The macros evaluate their arguments only when the level is enabled: nothing is formatted
    // for an ordinary incremental sync.
    let binds = || crate::words::count(adds.len(), "address bind", "address binds");
    let sent = || crate::words::count(requests, "IPVS request", "IPVS requests");
    let how = || {
        if overlapped {
            format!(
                "{} and {} together in {ipvs_ms:.1} ms (the requests waited {:.1} ms for binds)",
                binds(),
                sent(),
                ms(waited)
            )
        } else {
            format!(
                "{} in {binds_ms:.1} ms, {} in {ipvs_ms:.1} ms",
                binds(),
                sent()
            )
        }
    };
    if adds.len() + requests >= 1000 {
        tracing::info!("applied {}, removals in {removals_ms:.1} ms", how());
    } else {
        tracing::debug!("applied {}, removals in {removals_ms:.1} ms", how());
    }
    failures
}

/// A binder's work: `addrs` in steps of [`BIND_STEP`], each step's results (exactly one per
/// address) reported to `progress`, which is marked stopped however the thread ends.
fn bind_in_steps(mut bind: crate::kernel::AddressBinder, addrs: &[IpAddr], progress: &Progress) {
    let _stopped = Stopped(progress);
    for step in addrs.chunks(BIND_STEP) {
        progress.advance(exactly(bind(step), step.len()));
    }
}

/// The IPVS ops beside a binder of `addrs`, each with its gate: how many binds must be done
/// before it goes out. A virtual server created on one of `addrs`, and its real servers, wait
/// for the end of the binder's step that binds the address (per step, not per address: the
/// binder reports after each step); every other op waits for none. Sorted by gate, stably: each
/// step's ops keep `order_ops`'s order, rounds included (every Service of the step gets its
/// first real server before any its second), and go out as soon as the step is bound.
fn gated<'a>(
    ops: &'a [Op],
    ipvs_ops: impl Iterator<Item = &'a Op>,
    addrs: &[IpAddr],
) -> Vec<(usize, &'a Op)> {
    let gate_of: HashMap<IpAddr, usize> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| (*a, ((i / BIND_STEP + 1) * BIND_STEP).min(addrs.len())))
        .collect();
    let created: HashMap<VirtualKey, usize> = ops
        .iter()
        .filter_map(|op| match op {
            Op::AddService(vs) => match vs.key {
                VirtualKey::Inet { addr, .. } => gate_of.get(&addr).map(|g| (vs.key, *g)),
                VirtualKey::Fwmark { .. } => None,
            },
            _ => None,
        })
        .collect();
    let mut gated: Vec<(usize, &Op)> = ipvs_ops
        .map(|op| {
            (
                op.service()
                    .and_then(|k| created.get(k))
                    .copied()
                    .unwrap_or(0),
                op,
            )
        })
        .collect();
    gated.sort_by_key(|(gate, _)| *gate);
    gated
}

/// Sends IPVS ops (with their gates, in an order whose gates never fall) a chunk of
/// [`REQUEST_CHUNK`] at a time, at least [`MIN_RUN`] requests per call; before a call whose
/// requests need more binds than are known to be done, `wait_for(kernel, gate)` waits and
/// says how many are. Failures go to `out`; returns how many requests went out.
fn send<'a>(
    kernel: &mut dyn Kernel,
    ops: impl Iterator<Item = (usize, &'a Op)>,
    wait_for: &mut dyn FnMut(&mut dyn Kernel, usize) -> usize,
    failure: &impl Fn(&Op, Option<&KernelError>) -> Failure,
    out: &mut Vec<Failure>,
) -> usize {
    // The requests are built and sent a chunk at a time: a startup at 10,000 Services is
    // 110,000 of them, and holding them all at once was a fifth of the agent's peak memory.
    let mut ops = ops
        .filter_map(|(gate, op)| request_for(op).map(|r| (gate, op, r)))
        .peekable();
    let (mut chunk_ops, mut chunk, mut gates) = (Vec::new(), Vec::new(), Vec::new());
    let (mut requests, mut bound) = (0, 0);
    while ops.peek().is_some() {
        chunk_ops.clear();
        chunk.clear();
        gates.clear();
        for (gate, op, r) in ops.by_ref().take(REQUEST_CHUNK) {
            chunk_ops.push(op);
            chunk.push(r);
            gates.push(gate);
        }
        requests += chunk.len();
        let mut at = 0;
        while at < chunk.len() {
            let least = (at + MIN_RUN).min(chunk.len());
            if gates[least - 1] > bound {
                bound = wait_for(kernel, gates[least - 1]);
            }
            let end = least + gates[least..].partition_point(|&g| g <= bound);
            let results = kernel.apply_requests(&chunk[at..end]);
            collect(chunk_ops[at..end].iter().copied(), &results, failure, out);
            at = end;
        }
    }
    requests
}

/// Adds a failure for each op whose result is an error or missing.
fn collect<'a>(
    ops: impl Iterator<Item = &'a Op>,
    results: &[Result<(), KernelError>],
    failure: &impl Fn(&Op, Option<&KernelError>) -> Failure,
    out: &mut Vec<Failure>,
) {
    for (i, op) in ops.enumerate() {
        match results.get(i) {
            Some(Ok(())) => {}
            Some(Err(e)) => out.push(failure(op, Some(e))),
            None => out.push(failure(op, None)),
        }
    }
}

/// `results` made exactly `n` long: a missing one is "no result from the kernel", so the
/// results of later binds keep their places.
fn exactly(mut results: Vec<Result<(), KernelError>>, n: usize) -> Vec<Result<(), KernelError>> {
    results.truncate(n);
    results.resize_with(n, || {
        Err(KernelError::Refused("no result from the kernel".to_owned()))
    });
    results
}

/// How far a binder thread got: each bind's result so far, and whether it stopped.
#[derive(Default)]
struct Progress {
    state: Mutex<BinderState>,
    wake: Condvar,
}

#[derive(Default)]
struct BinderState {
    results: Vec<Result<(), KernelError>>,
    stopped: bool,
}

impl Progress {
    fn lock(&self) -> std::sync::MutexGuard<'_, BinderState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A step's results, one per address.
    fn advance(&self, results: Vec<Result<(), KernelError>>) {
        self.lock().results.extend(results);
        self.wake.notify_all();
    }

    fn stop(&self) {
        self.lock().stopped = true;
        self.wake.notify_all();
    }

    /// Waits until `n` binds are done or the binder stopped; how many are done, or
    /// `usize::MAX` once all are (nothing is left to wait for).
    fn wait_for(&self, n: usize) -> usize {
        let mut st = self.lock();
        while st.results.len() < n && !st.stopped {
            st = self.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st.results.len()
    }

    /// Binds on the caller's thread what a stopped binder left of `addrs`.
    fn bind_rest(&self, kernel: &mut dyn Kernel, addrs: &[IpAddr]) {
        let done = self.lock().results.len();
        if done < addrs.len() {
            let rest = exactly(kernel.add_addresses(&addrs[done..]), addrs.len() - done);
            self.lock().results.extend(rest);
        }
    }

    fn take_results(&self) -> Vec<Result<(), KernelError>> {
        std::mem::take(&mut self.lock().results)
    }
}

/// Marks a binder's [`Progress`] stopped when dropped, however its thread ends.
struct Stopped<'a>(&'a Progress);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::convert::op_for;
    use crate::kernel::mem::{MemKernel, MemState};
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

    /// `n` virtual servers on addresses of their own, each with `per` real servers, and
    /// those addresses.
    fn table_with_addresses(n: u32, per: u32) -> Table {
        let mut desired = Table::default();
        for i in 0..n {
            let addr = std::net::Ipv4Addr::from(0x0a60_0000 + i).to_string();
            let v = vs(&addr, 80);
            desired.services.insert(
                v.key,
                ServiceEntry {
                    server: v,
                    dests: (0..per)
                        .map(|j| RealServer::masq(IpAddr::V4((0x0af4_0000 + j).into()), 8080, 1))
                        .map(|d| (d.key, d))
                        .collect(),
                },
            );
            desired.addresses.insert(ip(&addr));
        }
        desired
    }

    /// Waits (up to a minute) until `done` holds.
    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !done() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting: {what}"
            );
            std::thread::yield_now();
        }
    }

    #[test]
    fn many_binds_go_on_a_binder_thread_and_no_virtual_server_goes_before_its_address() {
        let desired = table_with_addresses(600, 3);
        let ops = kube_ipvs_diff::full_diff(&desired, &Table::default(), Default::default());
        let k = MemKernel::default();
        let held = k.hold_binds();
        let worker = {
            let (mut k, ops) = (k.clone(), ops.clone());
            std::thread::spawn(move || apply(&mut k, &ops, &Owners::default()))
        };
        wait_until("the binder to wait", || k.state().binds_waiting > 0);
        assert!(
            k.state().requests.is_empty(),
            "IPVS requests went out before any address was bound"
        );
        drop(held);
        let failures = worker.join().expect("the apply");
        assert_eq!(failures, vec![]);
        let st = k.state();
        assert_eq!(st.table, desired);
        assert_eq!(st.services_before_address, vec![]);
        // Beside a binder, the virtual servers of the first step of binds go out with their
        // real servers before those of the next step.
        let sent: Vec<Op> = st.requests.iter().filter_map(op_for).collect();
        assert!(
            sent[..BIND_STEP]
                .iter()
                .all(|op| matches!(op, Op::AddService(_))),
            "{:?}",
            &sent[..BIND_STEP]
        );
        assert!(
            matches!(&sent[BIND_STEP], Op::AddDest { .. }),
            "{:?}",
            &sent[BIND_STEP]
        );
    }

    #[test]
    fn without_a_binder_the_binds_go_first_and_the_order_stays() {
        let desired = table_with_addresses(600, 3);
        let ops = kube_ipvs_diff::full_diff(&desired, &Table::default(), Default::default());
        let mut k = MemKernel::default();
        k.state().no_binder = true;
        // A binder would wait for ever: the apply binds on its own thread.
        let gate = k.clone();
        let _held = gate.hold_binds();
        let failures = apply(&mut k, &ops, &Owners::default());
        assert_eq!(failures, vec![]);
        let st = k.state();
        assert_eq!(st.table, desired);
        assert_eq!(st.services_before_address, vec![]);
        let sent: Vec<Op> = st.requests.iter().filter_map(op_for).collect();
        let wanted: Vec<Op> = ops
            .iter()
            .filter(|op| request_for(op).is_some())
            .cloned()
            .collect();
        assert_eq!(sent, wanted);
    }

    /// Applies what takes an empty in-memory kernel, first set up by `setup`, to `desired`.
    fn from_empty(desired: &Table, setup: impl FnOnce(&mut MemState)) -> (MemKernel, Vec<Failure>) {
        let ops = kube_ipvs_diff::full_diff(desired, &Table::default(), Default::default());
        let mut k = MemKernel::default();
        setup(&mut k.state());
        let failures = apply(&mut k, &ops, &Owners::default());
        (k, failures)
    }

    #[test]
    fn what_a_binder_that_panics_left_is_bound_before_its_virtual_servers_go_out() {
        let desired = table_with_addresses(600, 2);
        let (k, failures) = from_empty(&desired, |st| st.binder_panics = true);
        assert_eq!(failures, vec![]);
        let st = k.state();
        assert_eq!(st.table, desired);
        assert_eq!(st.services_before_address, vec![]);
    }

    #[test]
    fn a_bind_the_binder_fails_names_its_address_and_the_rest_apply() {
        let desired = table_with_addresses(300, 2);
        // Bound already: the kernel refuses to bind it again.
        let (k, failures) = from_empty(&desired, |st| {
            st.table.addresses.insert(ip("10.96.0.77"));
        });
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(failures[0].op, Op::AddAddress(ip("10.96.0.77")));
        assert_eq!(k.state().table, desired);
    }
}
