//! Benchmarks of the diff engine (`cargo bench -p kube-ipvs-diff`, or `cargo xtask bench diff`).
//!
//! - `full_resync_10k_drift_check`: 10,000 Services x 10 endpoints, engine up to date, full
//!   diff of the desired table against a matching observed table (periodic drift repair).
//! - `full_resync_10k_startup`: a new engine computes all 10,000 Services and diffs against a
//!   matching observed table (restart adopting the kernel's table). Target: under 50 ms.
//! - `full_diff_tables_10k`: the table-against-table diff alone, one entry differing.
//! - `one_endpoint_change`: one endpoint of one Service replaced (`Inputs::set_endpoints` with
//!   a list the watch layer built, then `Engine::sync`), at 1,000, 10,000 and 50,000 Services.
//!   Target: under 20 us and flat (50k within 2x of 1k).
//! - `memory_per_100k_endpoints`: live heap of the inputs store and the engine for 10,000
//!   Services x 10 endpoints, measured with a counting allocator and printed once.
//!
//! The counting allocator is the one piece of `unsafe` outside socket code: `GlobalAlloc` is an
//! unsafe trait. It only forwards to the system allocator and adds to an atomic counter.
#![allow(unsafe_code, reason = "the counting allocator implements GlobalAlloc")]
#![allow(
    missing_docs,
    clippy::unwrap_used,
    reason = "a benchmark: its inputs are our own"
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use kube_ipvs_diff::{
    Endpoint, EndpointPort, Engine, Inputs, NodeContext, Ownership, Protocol, ServiceInfo,
    ServiceName, ServicePort, Table, UnknownCounts, full_diff,
};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static ALLOCS: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// caller's obligations under `GlobalAlloc` are passed on as they are; the counter is a side
// effect that never touches the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; see the impl.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; see the impl.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is; see the impl.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const ENDPOINTS_PER_SERVICE: u32 = 10;

fn name(i: u32) -> ServiceName {
    ServiceName::new(format!("ns-{}", i % 100), format!("svc-{i}"))
}

fn service(i: u32) -> ServiceInfo {
    ServiceInfo {
        cluster_ips: vec![IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + i))],
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 80,
            node_port: None,
        }],
        ..ServiceInfo::default()
    }
}

fn endpoint(i: u32, j: u32) -> Endpoint {
    let mut e = Endpoint::ready(
        IpAddr::V4(Ipv4Addr::from(0x0a80_0000 + i * 16 + j)),
        vec![EndpointPort {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Tcp,
        }],
    );
    e.node_name = Some(format!("node-{}", j % 50).into());
    e
}

/// A Service's endpoints as translation builds them: one shared copy of the slice's ports.
fn endpoints(i: u32) -> Vec<Endpoint> {
    let mut eps: Vec<Endpoint> = (0..ENDPOINTS_PER_SERVICE).map(|j| endpoint(i, j)).collect();
    let shared = eps[0].ports.clone();
    for e in &mut eps {
        e.ports = shared.clone();
    }
    eps
}

fn inputs(services: u32) -> Inputs {
    let mut node = NodeContext::new("node-0");
    node.node_ips_v4 = vec![Ipv4Addr::new(192, 168, 0, 10)];
    let mut inputs = Inputs::new(node).unwrap();
    for i in 0..services {
        inputs.upsert_service(name(i), service(i)).unwrap();
        inputs.set_endpoints(name(i), endpoints(i)).unwrap();
    }
    inputs
}

/// Inputs, an engine that has synced them, and the kernel table it produced.
fn synced(services: u32) -> (Inputs, Engine, Table) {
    let mut inputs = inputs(services);
    let mut engine = Engine::new();
    let mut kernel = Table::default();
    let ops = engine.sync(&mut inputs, Duration::ZERO, &UnknownCounts);
    kernel.apply_all(&ops).unwrap();
    (inputs, engine, kernel)
}

#[divan::bench(sample_count = 20, sample_size = 1)]
fn full_resync_10k_drift_check(bencher: divan::Bencher<'_, '_>) {
    let (mut inputs, mut engine, kernel) = synced(10_000);
    bencher.bench_local(|| {
        let ops = engine.resync(&mut inputs, &kernel, Duration::ZERO, &UnknownCounts);
        assert!(ops.is_empty());
        ops
    });
}

#[divan::bench(sample_count = 20, sample_size = 1)]
fn full_resync_10k_startup(bencher: divan::Bencher<'_, '_>) {
    let (inputs, _, kernel) = synced(10_000);
    bencher
        .with_inputs(|| (inputs.clone(), Engine::new()))
        .bench_local_values(|(mut inputs, mut engine)| {
            let ops = engine.resync(&mut inputs, &kernel, Duration::ZERO, &UnknownCounts);
            assert!(ops.is_empty());
            // Returned so dropping the state is not timed.
            (ops, inputs, engine)
        });
}

#[divan::bench(sample_count = 20, sample_size = 1)]
fn full_diff_tables_10k(bencher: divan::Bencher<'_, '_>) {
    let (_, engine, mut kernel) = synced(10_000);
    let desired = engine.desired_table();
    // One real server drifted.
    if let Some(entry) = kernel.services.values_mut().nth(5_000)
        && let Some(d) = entry.dests.values_mut().next()
    {
        d.weight = 7;
    }
    bencher.bench_local(|| {
        let ops = full_diff(&desired, &kernel, Ownership::default());
        assert_eq!(ops.len(), 1);
        ops
    });
}

#[divan::bench(args = [1_000, 10_000, 50_000], sample_count = 200, sample_size = 20)]
fn one_endpoint_change(bencher: divan::Bencher<'_, '_>, services: u32) {
    let (mut inputs, mut engine, _) = synced(services);
    let target = name(services / 2);
    let a = endpoints(services / 2);
    let mut b = a.clone();
    b[3] = endpoint(services / 2, 15);
    let mut flip = false;
    // The new endpoint list is built outside the timing: it is the watch layer's work.
    bencher
        .with_inputs(|| {
            flip = !flip;
            let eps = if flip { b.clone() } else { a.clone() };
            (target.clone(), eps)
        })
        .bench_local_values(|(target, eps)| {
            inputs.set_endpoints(target, eps).unwrap();
            let ops = engine.sync(&mut inputs, Duration::ZERO, &UnknownCounts);
            // One endpoint out, one in: weight 0 for the old, add (or restore) the new.
            assert_eq!(ops.len(), 2);
            ops
        });
}

#[divan::bench(sample_count = 1, sample_size = 1)]
fn memory_per_100k_endpoints() {
    let before = LIVE.load(Ordering::Relaxed);
    let mut inputs = inputs(10_000);
    let after_inputs = LIVE.load(Ordering::Relaxed);
    let mut engine = Engine::new();
    let ops = engine.sync(&mut inputs, Duration::ZERO, &UnknownCounts);
    let ops_bytes = ops.capacity() * size_of::<kube_ipvs_diff::Op>();
    drop(ops);
    let after_engine = LIVE.load(Ordering::Relaxed);
    let mib = |b: isize| b as f64 / (1024.0 * 1024.0);
    eprintln!(
        "memory for 10,000 Services x 10 endpoints (100,000 endpoints): inputs {:.1} MiB, \
         engine state {:.1} MiB, total {:.1} MiB ({} bytes per endpoint); the first sync's op \
         list was {:.1} MiB, freed after use",
        mib(after_inputs - before),
        mib(after_engine - after_inputs),
        mib(after_engine - before),
        (after_engine - before) / 100_000,
        mib(ops_bytes as isize),
    );
    // Allocations of one endpoint change (update plus sync), the incremental path's cost
    // driver besides cache misses.
    let target = name(5_000);
    let mut changed = endpoints(5_000);
    changed[3] = endpoint(5_000, 15);
    let before = ALLOCS.load(Ordering::Relaxed);
    inputs.set_endpoints(target, changed).unwrap();
    let mid = ALLOCS.load(Ordering::Relaxed);
    let ops = engine.sync(&mut inputs, Duration::ZERO, &UnknownCounts);
    let after = ALLOCS.load(Ordering::Relaxed);
    eprintln!(
        "one endpoint change: {} allocations in set_endpoints, {} in sync ({} ops)",
        mid - before,
        after - mid,
        ops.len()
    );
    divan::black_box((inputs, engine));
}

fn main() {
    divan::main();
}
