//! The sync loop: change sets in, kernel operations out.
//!
//! At startup the agent waits for the first complete change set, dumps the kernel and applies
//! only the difference ([`Engine::resync`]): it adopts what is there and never flushes, so a
//! restart leaves established connections alone. Afterwards each change set is an incremental
//! sync of the changed Services; every sync period a full reconcile dumps the kernel again and
//! repairs drift (someone ran `ipvsadm -C`, an address vanished), counting what it repaired.
//! An operation the kernel refuses is reported with its Service and retried by a full sync with
//! exponential backoff per Service; the other operations of the same batch still apply, so one
//! broken Service never blocks the others. Stopping leaves the kernel as it is.
//!
//! The reconcile's read of the kernel (every virtual and real server: seconds at 10,000
//! Services under emulation) runs on a thread of its own with a kernel handle of its own
//! ([`Agent::with_background_reads`]), so change sets keep being programmed while it runs.
//! The loop records what it changes meanwhile. A virtual server it changed may have been read
//! half changed, so when the read comes back the reader reads those virtual servers again
//! ([`Kernel::observe_services`], a cost in proportion to the changes), again for those changed
//! during that re-read while they are more than [`LOOP_REREADS`] (up to [`REREAD_ROUNDS`]
//! rounds, each shorter than the last under churn), the loop reads itself the few changed
//! during the last round, and it diffs against the read with them all replaced: an operation that failed meanwhile shows as a difference again, and their
//! connection counts are current. Under churn (more than [`DEFER_ABOVE`] changed during the
//! whole read) only those the last reconcile took on the engine's word are read again: for the
//! others the reconcile takes the engine's word ([`Engine::asked_entry`]: what it asked the
//! kernel to hold there, every change since applied; one with an operation that failed
//! meanwhile is read on the loop, and none is taken on its word while a failed operation waits
//! for its retry), and the next reconcile reads them. The engine's entries are built into the
//! read only when the fingerprint with them differs from the desired table's
//! ([`Engine::asked_fingerprint`], [`Engine::holds_desired`]): when it does not, the reconcile
//! walks no diff and needs only their fingerprints. So every virtual server
//! is read by one reconcile in two at least, and drift in one the loop keeps changing is
//! repaired at most one sync period later. A read during which a virtual server or an address came or
//! went is discarded and read again (the kernel dumps by position, so such a read may have
//! skipped an entry nobody touched; the second read names its virtual servers, so there only
//! an address discards it); after [`BACKGROUND_READS`] such reads the reconcile reads on the
//! loop, as the startup sync and the retries always do.
//!
//! The reader also works out the read's fingerprint ([`kube_ipvs_diff::fingerprint`]), and
//! swaps in the entries (and their fingerprints and connection counts) of the virtual servers it
//! reads again, so the loop does that only for the few it reads itself and those it takes on the
//! engine's word. When it is that of the engine's
//! desired table with the draining real servers at weight 0, the kernel holds exactly that and
//! the reconcile walks no diff ([`Engine::resync_fingerprinted`]: only the drained ones are
//! deleted); the service sets likewise. Only drift then costs the loop a walk of the whole
//! table (the metrics still count the desired table's size and the Local-policy Services
//! without local endpoints, two cheap walks), and the read is freed (and its pages returned to
//! the kernel) on the reader's thread.
//!
//! The kernel is reached through the one [`Kernel`] trait (`crate::kernel`), so the
//! loop runs against an in-memory kernel in tests, and time is tokio's, so tests pause it. This
//! module decides nothing about the table itself: the engine does.
//!
//! With `--nodeport-addresses`, the node's addresses are re-read at each full sync and whenever
//! the address watch ([`watch_addresses`]) signals that one inside those CIDRs may have come or
//! gone, so NodePorts follow the node's addresses without waiting for the sync period.
//!
//! After each sync the agent observes `kubeproxy_network_programming_duration_seconds`: for
//! every trigger time a change set carried for a Service (see the watch crate's tracker), the
//! wall-clock time from the trigger to the end of the sync that programmed it. Like kube-proxy
//! it observes only after a sync that succeeded, and keeps every coalesced trigger time. Unlike
//! kube-proxy's IPVS proxier, which observes once its iptables-restore succeeds even if IPVS
//! operations failed (and so never measures the retry), a Service whose operations failed is
//! observed only when a full sync applies it without failure: the metric then says when the
//! change really reached the kernel. Wall-clock time is injected ([`WallClock`]), apart from
//! the engine's monotonic clock.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kube_ipvs_diff::{
    Cidr, ConnectionCounts, DestKey, Engine, Fingerprint, Inputs, MarkSpace, Op, Options,
    Ownership, Protocol, ServiceEntry, ServiceName, VirtualKey,
};
use kube_ipvs_watch::ChangeSet;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::health::Shared;
use super::metrics::SyncKind;
use super::sets::{SetsRead, read_sets_fingerprinted};
use crate::apply::{self, Owners, names_label};
use crate::kernel::observe::Observed;
use crate::kernel::{Counts, Kernel, KernelError, UdpFlush};
use crate::words::count;

/// How often the connections of draining real servers are re-read (see the sync loop).
const DRAIN_POLL: Duration = Duration::from_secs(1);

/// Background reads a reconcile tries before it reads on the loop, when virtual servers or
/// addresses keep coming and going during them.
const BACKGROUND_READS: u32 = 3;

/// At most this many virtual servers changed during a background re-read are read again on the
/// loop (about 1.7 ms each under emulation); more go back to the reader for another round.
const LOOP_REREADS: usize = 8;

/// Rounds of re-reads the reader does for one reconcile before the loop reads what is left,
/// however many: under churn each round is shorter than the last, so its changes are fewer.
const REREAD_ROUNDS: u32 = 4;

/// Above this many virtual servers changed during a whole read, the reconcile takes the
/// engine's word for each one the last reconcile did not already take it for, instead of
/// reading them again (see the module docs).
const DEFER_ABOVE: usize = 8;

/// What a background read of the kernel found.
struct Read {
    observed: Observed,
    counts: Counts,
    /// The fingerprint of what of `observed` the engine owns, and the ownership it was worked
    /// out under (the reconcile uses it only if the node options still give the same).
    fingerprint: (Owned, Fingerprint),
    /// The service sets, when asked for and readable (otherwise the reconcile reads them on
    /// the loop).
    sets: Option<SetsRead>,
    /// Virtual servers taken on the engine's word without building their entries: the
    /// fingerprint counts them as the engine asks for them, while `observed` and `counts` still
    /// hold what the read found there, which the reconcile must not use (their counts are
    /// unknown to it, as for entries put in).
    word: BTreeSet<VirtualKey>,
}

/// Connection counts with those of some virtual servers unknown (the engine's word taken for
/// them unbuilt, see [`Read::word`]).
struct Masked<'a> {
    counts: &'a Counts,
    unknown: &'a BTreeSet<VirtualKey>,
}

impl ConnectionCounts for Masked<'_> {
    fn connections(&self, service: &VirtualKey, dest: &DestKey) -> Option<u64> {
        if self.unknown.contains(service) {
            None
        } else {
            self.counts.connections(service, dest)
        }
    }
}

/// [`Ownership`] by value, for the reader thread.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Owned {
    exclude: Vec<Cidr>,
    marks: Option<MarkSpace>,
}

impl Owned {
    fn of(options: &Options) -> Self {
        let o = Ownership::of(options);
        Self {
            exclude: o.exclude.to_vec(),
            marks: o.marks,
        }
    }

    fn view(&self) -> Ownership<'_> {
        Ownership {
            exclude: &self.exclude,
            marks: self.marks,
        }
    }
}

/// What a background read of the kernel answers.
type ReadResult = Result<Read, KernelError>;

/// Virtual servers read again: each one's entry (`None` if the kernel holds none the engine can
/// represent), and their real servers' connections.
type Reread = (BTreeMap<VirtualKey, Option<ServiceEntry>>, Counts);

/// What the reader answers to a second read: the whole read with the virtual servers read again
/// in place.
type RereadResult = Result<Box<WholeRead>, KernelError>;

/// What the loop asks the reader thread.
enum Ask {
    /// The whole IPVS table, fingerprinted under this ownership, and the service sets when
    /// `true`.
    Whole(Owned, bool),
    /// The virtual servers `again` of a whole read again: the ones the loop changed during the
    /// whole read, or during the last round of re-reads. The reader puts them in place in the
    /// read (their old entries out of its fingerprint and freed, the new ones in), so the loop
    /// does none of that work: at 1,000 Services of 250 real servers it took the loop 213-256 ms
    /// for 500-1,500 of them under emulation.
    Services(Box<WholeRead>),
    /// A read the reconcile is done with: freed on the reader's thread (tens of MiB of small
    /// allocations at 10,000 Services), whose free pages then go back to the kernel. Not
    /// answered.
    Dispose(Box<Read>),
}

/// What the reader thread answers, in the order it was asked.
enum Answer {
    Whole(ReadResult),
    Services(RereadResult),
}

/// The thread that reads the kernel for reconciles, with a kernel handle of its own, at nice
/// [`kube_ipvs_host::thread::BACKGROUND_NICE`].
struct Reader {
    requests: std::sync::mpsc::Sender<Ask>,
    results: mpsc::Receiver<Answer>,
}

impl Reader {
    fn start(mut kernel: Box<dyn Kernel>) -> std::io::Result<Reader> {
        let (requests, asked) = std::sync::mpsc::channel::<Ask>();
        let (answer, results) = mpsc::channel(1);
        std::thread::Builder::new()
            .name("kernel-reader".to_owned())
            .spawn(move || {
                // The loop's changes are waited for and this read is not: under churn at 10,000
                // Services on two emulated CPUs, while the read ran at nice 0 an update's median
                // time from the API server's answer to the kernel went from 5-7 ms to 7-12 ms
                // (`docs/benchmarks.md`, twentieth session).
                use kube_ipvs_host::thread::{BACKGROUND_NICE, set_this_threads_nice};
                match set_this_threads_nice(BACKGROUND_NICE) {
                    Ok(()) => tracing::debug!("kernel reader: at nice {BACKGROUND_NICE}"),
                    Err(e) => tracing::warn!(
                        "kernel reader: could not lower its CPU priority (nice {BACKGROUND_NICE}): {e}"
                    ),
                }
                while let Ok(ask) = asked.recv() {
                    let read = match ask {
                        Ask::Whole(owned, sets) => {
                            Answer::Whole(read_whole(&mut *kernel, owned, sets))
                        }
                        Ask::Services(whole) => Answer::Services(read_again(&mut *kernel, whole)),
                        Ask::Dispose(read) => {
                            drop(read);
                            release_memory("reconcile");
                            continue;
                        }
                    };
                    if answer.blocking_send(read).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Reader { requests, results })
    }
}

/// The whole IPVS table, with each real server's connections and the fingerprint of what
/// `owned` gives the engine, and the service sets when `sets` (a failure to read those leaves
/// them out: the reconcile reads them on the loop).
fn read_whole(kernel: &mut dyn Kernel, owned: Owned, sets: bool) -> ReadResult {
    kernel.observe().map(|(observed, counts)| Read {
        fingerprint: {
            let f = Fingerprint::of_table(&observed.table, owned.view());
            (owned, f)
        },
        observed,
        counts,
        sets: sets.then(|| read_sets_fingerprinted(kernel)).and_then(|r| {
            r.map_err(|e| {
                tracing::debug!("reconcile: reading the service sets in the background: {e}");
            })
            .ok()
        }),
        word: BTreeSet::new(),
    })
}

/// The virtual servers `whole.again` read again and put in place in `whole.read`. On a failure
/// the whole read is freed here, off the loop.
fn read_again(kernel: &mut dyn Kernel, mut whole: Box<WholeRead>) -> RereadResult {
    match kernel.observe_services(&whole.again) {
        Ok(fresh) => {
            replace_entries(&mut whole.read, &whole.again, fresh);
            Ok(whole)
        }
        Err(e) => {
            drop(whole);
            release_memory("reconcile");
            Err(e)
        }
    }
}

/// A background read under way, and what the loop changed since it started.
#[derive(Debug)]
struct ReadInFlight {
    started: Instant,
    /// Virtual servers an op named since the read started (applied or failed).
    touched: BTreeSet<VirtualKey>,
    /// Whether an op added or deleted a virtual server or an address since the read started.
    moved: bool,
    /// How many reads this reconcile discarded before this one.
    discarded: u32,
    /// Whether the whole read is back and with the reader, which reads again the virtual
    /// servers the loop changed during it (`touched` then collects what the loop changes
    /// during that second read).
    second: bool,
}

impl ReadInFlight {
    /// A read starting now, with nothing changed yet.
    fn new(discarded: u32, second: bool) -> Self {
        Self {
            started: Instant::now(),
            touched: BTreeSet::new(),
            moved: false,
            discarded,
            second,
        }
    }
}

/// A whole read that came back, and the virtual servers being read again for it.
struct WholeRead {
    read: Read,
    /// How long the whole read took.
    took: Duration,
    /// The virtual servers being read again: those the loop changed during the whole read, or
    /// during the last round of re-reads.
    again: BTreeSet<VirtualKey>,
    /// Rounds of re-reads so far, this one included.
    rounds: u32,
    /// Virtual servers read again in the rounds before this one, and how long those took.
    earlier: (usize, Duration),
    /// The virtual servers changed during the whole read whose entries the reconcile takes
    /// from the engine instead of reading them again.
    defer: BTreeSet<VirtualKey>,
}

impl std::fmt::Debug for WholeRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WholeRead")
            .field("took", &self.took)
            .field("again", &self.again)
            .finish_non_exhaustive()
    }
}

/// The conntrack cleanups the applied (not failed) ops call for: one per deleted UDP real
/// server and one per deleted UDP virtual server, in order, without repeats.
pub fn udp_flushes(ops: &[Op], failures: &[apply::Failure]) -> Vec<UdpFlush> {
    let mut out = Vec::new();
    for op in ops {
        if failures.iter().any(|f| &f.op == op) {
            continue;
        }
        let flush = match op {
            Op::DeleteDest {
                service:
                    VirtualKey::Inet {
                        protocol: Protocol::Udp,
                        ..
                    },
                dest,
            } => UdpFlush::Endpoint(dest.addr, dest.port),
            Op::DeleteService(VirtualKey::Inet {
                protocol: Protocol::Udp,
                addr,
                port,
            }) => UdpFlush::Service(*addr, *port),
            _ => continue,
        };
        if !out.contains(&flush) {
            out.push(flush);
        }
    }
    out
}

/// How many of a change set's Services changed their object, and how many their endpoints,
/// against what the inputs hold (kube-proxy's service and endpoint change counters). Marks the
/// input store assigned are not part of the object.
fn changes_in(cs: &ChangeSet, inputs: &Inputs) -> (u64, u64) {
    let (mut services, mut endpoints) = (0, 0);
    for (name, change) in &cs.services {
        let same = match (inputs.service(name), &change.service) {
            (None, None) => true,
            (Some(old), Some(new)) if old.local_marks.is_empty() => old == new,
            (Some(old), Some(new)) => {
                let mut new = new.clone();
                new.local_marks.clone_from(&old.local_marks);
                *old == new
            }
            _ => false,
        };
        services += u64::from(!same);
        endpoints += u64::from(*inputs.endpoints(name) != *change.endpoints);
    }
    (services, endpoints)
}

/// Services with a Local traffic policy and no ready or serving local endpoint: (internal,
/// external), for `kubeproxy_sync_proxy_rules_no_local_endpoints_total`.
fn no_local_endpoints(inputs: &Inputs) -> [u64; 2] {
    let node = inputs.node().node_name.as_str();
    let mut out = [0u64; 2];
    for name in inputs.service_names() {
        let Some(info) = inputs.service(name) else {
            continue;
        };
        let local = kube_ipvs_diff::TrafficPolicy::Local;
        let external =
            info.kind != kube_ipvs_diff::ServiceKind::ClusterIp || !info.external_ips.is_empty();
        let policies = [
            info.internal_traffic_policy == local,
            external && info.external_traffic_policy == local,
        ];
        // The endpoints are looked at only for a Service with a Local policy, and once.
        if policies.iter().any(|p| *p)
            && !inputs
                .endpoints(name)
                .iter()
                .any(|e| (e.ready || e.serving) && e.node_name.as_deref() == Some(node))
        {
            for (n, p) in out.iter_mut().zip(policies) {
                *n += u64::from(p);
            }
        }
    }
    out
}

/// How the loop behaves.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Full reconcile interval.
    pub sync_period: Duration,
    /// First retry delay after a failed operation; doubles per failure.
    pub retry_min: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
    /// NodePort addresses from `--node-ip` (fixed); win over `nodeports`.
    pub node_ips: Vec<IpAddr>,
    /// Which of the node's addresses NodePorts listen on, re-read at each full sync and when
    /// the address watch signals.
    pub nodeports: super::nodeports::NodePortAddresses,
    /// Remove kube-proxy's IPVS-mode chains and ipsets once our rules are in place
    /// (`--keep-kube-proxy-rules` turns it off).
    pub remove_kube_proxy_leftovers: bool,
}

impl AgentConfig {
    /// A reconcile every `period`; retries from 1 s, doubling up to the period (at least 1 s);
    /// NodePorts on every node address; kube-proxy's leftovers removed. The daemon's defaults,
    /// which callers change field by field.
    pub fn every(period: Duration) -> Self {
        Self {
            sync_period: period,
            retry_min: Duration::from_secs(1),
            retry_max: period.max(Duration::from_secs(1)),
            node_ips: Vec::new(),
            nodeports: super::nodeports::NodePortAddresses::default(),
            remove_kube_proxy_leftovers: true,
        }
    }
}

/// Why the loop stopped on its own.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The desired-state source stopped sending change sets.
    #[error("the desired-state source stopped")]
    SourceEnded,
}

/// The wall clock: what the network programming latency and the last-sync timestamp are
/// measured with. Injected so tests can use fixed times; [`system_clock`] in production.
pub type WallClock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// The system's wall clock.
pub fn system_clock() -> WallClock {
    Arc::new(SystemTime::now)
}

/// Logs the agent's resident memory and its peak at a step of the startup.
fn log_memory(step: &str) {
    if let Some((rss, hwm)) = kube_ipvs_host::memory::resident_kib() {
        tracing::info!(
            "{step}: resident {:.1} MiB, peak {:.1} MiB",
            rss as f64 / 1024.0,
            hwm as f64 / 1024.0
        );
    }
}

/// Seconds from `from` to `to`, negative if `to` is earlier (clocks of two machines disagree:
/// kube-proxy observes Go's negative `time.Since` too).
fn seconds_between(from: SystemTime, to: SystemTime) -> f64 {
    match to.duration_since(from) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// Why the masquerade rules and sets are synced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MasqSync<'a> {
    /// A change set or an address change: only what changed.
    Change,
    /// After the startup sync: everything, waiting for the rules.
    Startup,
    /// A reconcile: everything, waiting for the rules only if their last apply failed, against
    /// the service sets as its background read found them, if it read them.
    Reconcile(Option<&'a SetsRead>),
}

/// A Service (or group of Services) waiting for a failed operation to be retried.
#[derive(Debug, Clone, Copy)]
struct Pending {
    attempts: u32,
    due: Instant,
}

/// The sync loop's state.
pub struct Agent<K> {
    kernel: K,
    engine: Engine,
    inputs: Inputs,
    cfg: AgentConfig,
    shared: Arc<Shared>,
    epoch: Instant,
    /// Failed Services (by label) and when they are retried.
    retry: BTreeMap<String, Pending>,
    /// The node's addresses (not `kube-ipvs0`'s) as last read, if read yet.
    local: Option<Vec<IpAddr>>,
    /// The Node object's addresses (its InternalIPs), for `primary`.
    node_primary: Vec<IpAddr>,
    /// Health-check node ports, if served.
    health_checks: Option<super::hcport::HealthChecks>,
    /// The masquerade rules, if managed.
    masq: Option<super::masq::Masq>,
    /// Signals that the node's addresses may have changed, if watched.
    address_changes: Option<mpsc::Receiver<()>>,
    /// Whether a full sync has read the kernel; until then the engine's idea of the kernel is
    /// empty and an incremental sync would re-add what is already there.
    adopted: bool,
    /// The wall clock.
    wall: WallClock,
    /// Trigger times of changes taken but not yet programmed, by Service.
    triggers: BTreeMap<ServiceName, Vec<SystemTime>>,
    /// Services with an operation that failed since the last full sync that applied them
    /// cleanly; their trigger times wait for that sync.
    unprogrammed: BTreeSet<ServiceName>,
    /// Whether a failed operation belonged to no known Service (a deleted Service's, say): then
    /// no trigger time is observed until a full sync applies without such a failure, since we
    /// cannot tell whose change it held up.
    unprogrammed_unknown: bool,
    /// How many Service ports had found the short-circuit mark space full when last logged.
    marks_short: usize,
    /// Whether kube-proxy's leftovers are still to be removed.
    kube_proxy_leftovers_pending: bool,
    /// The reconcile's background reader, if one was started.
    reader: Option<Reader>,
    /// At most this many virtual servers changed during a re-read are read on the loop
    /// ([`LOOP_REREADS`]; tests lower it).
    loop_rereads: usize,
    /// Above this many virtual servers changed during a whole read the reconcile takes the
    /// engine's word for them ([`DEFER_ABOVE`]; tests change it).
    defer_above: usize,
    /// The virtual servers the last reconcile took the engine's word for: the next one reads
    /// them.
    deferred: BTreeSet<VirtualKey>,
    /// Virtual servers with an operation that failed since the background read began: the
    /// reconcile never takes the engine's word for them.
    failed_during_read: BTreeSet<VirtualKey>,
    /// The background read under way, if any.
    reading: Option<ReadInFlight>,
}

impl<K: Kernel> Agent<K> {
    /// An agent with an empty engine: its first sync adopts whatever the kernel holds.
    pub fn new(kernel: K, inputs: Inputs, cfg: AgentConfig, shared: Arc<Shared>) -> Self {
        let cfg_removes_leftovers = cfg.remove_kube_proxy_leftovers;
        Self {
            kernel,
            engine: Engine::new(),
            inputs,
            cfg,
            shared,
            epoch: Instant::now(),
            retry: BTreeMap::new(),
            local: None,
            node_primary: Vec::new(),
            health_checks: None,
            masq: None,
            address_changes: None,
            adopted: false,
            wall: system_clock(),
            triggers: BTreeMap::new(),
            unprogrammed: BTreeSet::new(),
            unprogrammed_unknown: false,
            marks_short: 0,
            kube_proxy_leftovers_pending: cfg_removes_leftovers,
            reader: None,
            reading: None,
            loop_rereads: LOOP_REREADS,
            defer_above: DEFER_ABOVE,
            deferred: BTreeSet::new(),
            failed_during_read: BTreeSet::new(),
        }
    }

    /// Reads the kernel for reconciles on a thread of its own through `kernel`, a handle of
    /// its own, so the loop keeps programming changes meanwhile (see the module docs). An
    /// error if the thread cannot be started.
    pub fn with_background_reads(mut self, kernel: Box<dyn Kernel>) -> std::io::Result<Self> {
        self.reader = Some(Reader::start(kernel)?);
        Ok(self)
    }

    /// Measures wall-clock time with `clock` instead of the system's (for tests).
    pub fn with_wall_clock(mut self, clock: WallClock) -> Self {
        self.wall = clock;
        self
    }

    /// Keeps these health checks up to date with every change set.
    pub fn with_health_checks(mut self, hc: super::hcport::HealthChecks) -> Self {
        self.health_checks = Some(hc);
        self
    }

    /// Keeps these masquerade rules applied (after the startup sync, at every reconcile and
    /// when what they are built from changes).
    pub fn with_masquerade(mut self, masq: super::masq::Masq) -> Self {
        self.masq = Some(masq);
        self
    }

    /// Re-reads the node's addresses (for `--nodeport-addresses`) and syncs what changed
    /// whenever `signals` delivers, instead of only at full syncs.
    pub fn with_address_changes(mut self, signals: mpsc::Receiver<()>) -> Self {
        self.address_changes = Some(signals);
        self
    }

    /// The kernel (for tests).
    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    /// The engine's clock.
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Runs until `shutdown` completes (then the kernel is left as it is) or the source ends.
    pub async fn run(
        &mut self,
        mut changes: mpsc::Receiver<ChangeSet>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), AgentError> {
        tokio::pin!(shutdown);
        let first = tokio::select! {
            cs = changes.recv() => cs,
            () = &mut shutdown => return Ok(()),
        };
        let Some(cs) = first else {
            return Err(AgentError::SourceEnded);
        };
        tracing::info!(
            "listed: {}",
            count(cs.services.len(), "Service", "Services")
        );
        log_memory("listed");
        self.take(cs);
        self.full_sync(SyncKind::Startup);
        log_memory("startup sync done");
        self.sync_masquerade(MasqSync::Startup);
        log_memory("masquerade in place");
        let period = self.cfg.sync_period;
        let mut reconcile = tokio::time::interval_at(Instant::now() + period, period);
        reconcile.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut address_changes = self.address_changes.take();
        let mut reader = self.reader.take();
        loop {
            let retry_due = self.retry.values().map(|p| p.due).min();
            let drain_due = self
                .engine
                .next_deadline(&self.inputs)
                .map(|d| self.epoch + d);
            // While real servers drain, their connection counts are re-read every
            // DRAIN_POLL, so one whose last connection closed is deleted within a second
            // rather than at the next reconcile (kube-proxy checks once a minute).
            let drain_poll = self
                .engine
                .draining()
                .next()
                .map(|_| Instant::now() + DRAIN_POLL);
            let wake = [retry_due, drain_due, drain_poll]
                .into_iter()
                .flatten()
                .min();
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                cs = changes.recv() => {
                    let Some(cs) = cs else { return Err(AgentError::SourceEnded) };
                    tracing::debug!("change set of {} Services received", cs.services.len());
                    self.take(cs);
                    // Whatever else is already queued goes into the same sync.
                    while let Ok(more) = changes.try_recv() {
                        self.take(more);
                    }
                    self.incremental_sync();
                    self.sync_masquerade(MasqSync::Change);
                }
                signal = next_signal(&mut address_changes) => {
                    if signal.is_none() {
                        tracing::warn!(
                            "the address watch stopped; NodePort addresses are re-read at each reconcile only"
                        );
                        address_changes = None;
                        continue;
                    }
                    // A burst of notifications (a link brought up with several addresses) is
                    // one re-read.
                    if let Some(rx) = &mut address_changes {
                        while rx.try_recv().is_ok() {}
                    }
                    if self.refresh_node_addresses() {
                        self.incremental_sync();
                        self.sync_masquerade(MasqSync::Change);
                    }
                }
                _ = reconcile.tick() => {
                    match &reader {
                        // A tick while the last read is still under way waits for it.
                        Some(_) if self.reading.is_some() => {}
                        Some(r) => self.start_read(r, 0),
                        None => self.reconcile_on_loop(),
                    }
                }
                read = next_read(&mut reader) => {
                    match read {
                        Some(result) => self.finish_read(result, reader.as_ref()),
                        None => {
                            tracing::warn!(
                                "the kernel reader stopped; reconciles read the kernel on the loop"
                            );
                            reader = None;
                            if self.reading.take().is_some() {
                                self.reconcile_on_loop();
                            }
                        }
                    }
                }
                () = sleep_until(wake) => {
                    if retry_due.is_some_and(|d| d <= Instant::now()) {
                        self.full_sync(SyncKind::Retry);
                    } else {
                        self.incremental_sync();
                    }
                }
            }
        }
    }

    /// Starts a reconcile's background read, after bringing the node's addresses up to date
    /// (a NodePort they move is programmed now, before the read starts).
    fn start_read(&mut self, reader: &Reader, discarded: u32) {
        if self.refresh_node_addresses() {
            self.incremental_sync();
        }
        self.reading = Some(ReadInFlight::new(discarded, false));
        self.failed_during_read.clear();
        let sets = self
            .masq
            .as_mut()
            .is_some_and(super::masq::Masq::begin_read);
        let owned = Owned::of(&self.inputs.node().options);
        if reader.requests.send(Ask::Whole(owned, sets)).is_err() {
            // The thread is gone; `next_read` reports it and the reconcile reads on the loop.
            tracing::debug!("the kernel reader did not take the request");
        }
    }

    /// The reader answered: a whole read, or the virtual servers changed during one read
    /// again (see the module docs).
    fn finish_read(&mut self, answer: Answer, reader: Option<&Reader>) {
        let second = self.reading.as_ref().map(|f| f.second);
        match (answer, second) {
            (Answer::Whole(result), Some(false)) => self.whole_read_back(result, reader),
            (Answer::Services(result), Some(true)) => self.reread_back(result, reader),
            // One question is out at a time, so this is a bug: the reconcile still happens.
            _ => {
                debug_assert!(false, "the kernel reader answered what was not asked");
                tracing::warn!(
                    "the kernel reader answered what was not asked; reading on the loop"
                );
                self.reading = None;
                self.reconcile_on_loop();
            }
        }
    }

    /// A read during which something moved is discarded: read again in the background, up to
    /// [`BACKGROUND_READS`] times, then on the loop.
    fn discard_read(&mut self, discarded: u32, reader: Option<&Reader>) {
        match reader {
            Some(r) if discarded < BACKGROUND_READS => {
                tracing::debug!(
                    "reconcile: virtual servers or addresses came or went during the read; reading again"
                );
                self.start_read(r, discarded);
            }
            _ => {
                tracing::info!(
                    "reconcile: virtual servers or addresses came or went during {}; reading on the loop",
                    count(discarded, "background read", "background reads")
                );
                self.reconcile_on_loop();
            }
        }
    }

    /// A whole read came back: discarded if virtual servers or addresses came or went during
    /// it; otherwise the virtual servers the loop changed meanwhile are read again, by the
    /// reader when there is one, before the reconcile diffs.
    fn whole_read_back(&mut self, result: ReadResult, reader: Option<&Reader>) {
        let Some(flight) = self.reading.take() else {
            return;
        };
        let took = flight.started.elapsed();
        let read = match result {
            Ok(v) => v,
            Err(e) => return self.read_failed(SyncKind::Reconcile, &e),
        };
        if flight.moved {
            return self.discard_read(flight.discarded + 1, reader);
        }
        let (again, defer) = self.split_touched(flight.touched);
        let whole = WholeRead {
            read,
            took,
            again,
            rounds: 1,
            earlier: (0, Duration::ZERO),
            defer,
        };
        if let Some(r) = reader.filter(|_| !whole.again.is_empty()) {
            return self.read_again_with(r, Box::new(whole), flight.discarded);
        }
        // Nothing to read again, or no reader to read it: the loop reads it.
        let loop_start = Instant::now();
        let WholeRead {
            mut read,
            again,
            defer,
            ..
        } = whole;
        if let Err(e) = self
            .reread_on_loop(&mut read, &again)
            .and_then(|()| self.take_engine_word(&mut read, defer))
        {
            return self.read_failed(SyncKind::Reconcile, &e);
        }
        if !again.is_empty() {
            tracing::info!(
                "reconcile: read {} the loop changed during the read again on the loop in {:.1} ms",
                count(again.len(), "virtual server", "virtual servers"),
                loop_start.elapsed().as_secs_f64() * 1000.0
            );
        }
        self.reconcile_with(read, took, loop_start, reader);
    }

    /// Of the virtual servers the loop changed during a whole read: those to read again, and
    /// those whose entries the reconcile takes from the engine. Up to `defer_above` changed,
    /// all are read again; above, only those the last reconcile took the engine's word for
    /// already, so each virtual server is read by one reconcile in two at least. While an
    /// operation waits for its retry, the engine's word is not taken at all.
    fn split_touched(
        &self,
        touched: BTreeSet<VirtualKey>,
    ) -> (BTreeSet<VirtualKey>, BTreeSet<VirtualKey>) {
        if touched.len() <= self.defer_above || self.unsure_of_the_engine() {
            return (touched, BTreeSet::new());
        }
        touched.into_iter().partition(|k| self.deferred.contains(k))
    }

    /// Whether an operation failed and waits for a full sync to apply it (a retry is pending,
    /// or a failed change is not yet programmed): the engine's word may then be wrong about
    /// virtual servers the loop did not record as failed since the read began.
    fn unsure_of_the_engine(&self) -> bool {
        !self.retry.is_empty() || !self.unprogrammed.is_empty() || self.unprogrammed_unknown
    }

    /// Puts in `read`, for each virtual server of `defer`, what the engine asked the kernel
    /// to hold there (the loop changed it during the read and every change since applied);
    /// one with an operation that failed since the read began, or every one while a failed
    /// operation waits for its retry, is read on the loop instead.
    /// The next reconcile reads them: they are remembered as deferred.
    fn take_engine_word(
        &mut self,
        read: &mut Read,
        mut defer: BTreeSet<VirtualKey>,
    ) -> Result<(), KernelError> {
        let unsure: BTreeSet<VirtualKey> = if self.unsure_of_the_engine() {
            std::mem::take(&mut defer)
        } else {
            defer
                .intersection(&self.failed_during_read)
                .copied()
                .collect()
        };
        self.reread_on_loop(read, &unsure)?;
        defer.retain(|k| !unsure.contains(k));
        if !defer.is_empty() {
            let start = Instant::now();
            let built = if let Some(f) = self.word_fingerprint(read, &defer) {
                read.fingerprint.1 = f;
                read.word.clone_from(&defer);
                "fingerprinted"
            } else {
                let entries = defer
                    .iter()
                    .map(|k| (*k, self.engine.asked_entry(k)))
                    .collect();
                replace_entries(read, &defer, (entries, Counts::default()));
                "built"
            };
            tracing::info!(
                "reconcile: took the engine's word for {} the loop changed during the read, {built} in {:.1} ms (the next reconcile reads them)",
                count(defer.len(), "virtual server", "virtual servers"),
                start.elapsed().as_secs_f64() * 1000.0
            );
        }
        self.deferred = defer;
        Ok(())
    }

    /// The fingerprint `read` would have with the engine's entries for `defer` in place of what
    /// it found there, when that is the desired table's and nothing waits to be synced: the
    /// reconcile then walks no diff, so those entries need not be built (at 1,000 virtual
    /// servers of 250 real servers, 1.7 s of the loop under emulation). Otherwise `None`, and
    /// they are built: the diff needs them, and they must be the engine's as they are now,
    /// before the reconcile syncs anything.
    fn word_fingerprint(&self, read: &Read, defer: &BTreeSet<VirtualKey>) -> Option<Fingerprint> {
        let (owned, f) = &read.fingerprint;
        if *owned != Owned::of(&self.inputs.node().options) {
            return None;
        }
        let view = owned.view();
        let mut f = *f;
        for key in defer.iter().filter(|k| view.key(k)) {
            if let Some(old) = read.observed.table.services.get(key) {
                f.subtract(Fingerprint::of_entry(&old.server, old.dests.values()));
            }
            f.add(self.engine.asked_fingerprint(key));
        }
        self.engine.holds_desired(&self.inputs, f).then_some(f)
    }

    /// Reads the virtual servers `keys` again on the loop, in place of what `read` found of
    /// them.
    fn reread_on_loop(
        &mut self,
        read: &mut Read,
        keys: &BTreeSet<VirtualKey>,
    ) -> Result<(), KernelError> {
        if !keys.is_empty() {
            replace_entries(read, keys, self.kernel.observe_services(keys)?);
        }
        Ok(())
    }

    /// Hands the whole read to the reader to read `whole.again` again in it; a reader that is
    /// gone (it took the read with it) leaves the reconcile to the loop.
    fn read_again_with(&mut self, reader: &Reader, whole: Box<WholeRead>, discarded: u32) {
        if reader.requests.send(Ask::Services(whole)).is_ok() {
            self.reading = Some(ReadInFlight::new(discarded, true));
        } else {
            tracing::warn!("the kernel reader did not take a second read; reading on the loop");
            self.reconcile_on_loop();
        }
    }

    /// The reader read again the virtual servers changed during a whole read (or during the
    /// last round of re-reads) and replaced them in it; those the loop changed during this
    /// round go back to the reader for another while they are more than the loop's share (up to
    /// [`REREAD_ROUNDS`] rounds), else the loop reads them once more, and the reconcile diffs.
    /// An address that came or went during a round discards the read like a move during the
    /// whole read (the table's addresses are the whole read's).
    fn reread_back(&mut self, result: RereadResult, reader: Option<&Reader>) {
        let Some(ReadInFlight {
            second: true,
            started,
            touched,
            moved,
            discarded,
        }) = self.reading.take()
        else {
            return;
        };
        if moved {
            return self.discard_read(discarded + 1, reader);
        }
        let whole = match result {
            Ok(v) => v,
            Err(e) => return self.read_failed(SyncKind::Reconcile, &e),
        };
        let loop_start = Instant::now();
        let WholeRead {
            mut read,
            took,
            again,
            rounds,
            earlier,
            defer,
        } = *whole;
        let reread = (earlier.0 + again.len(), earlier.1 + started.elapsed());
        // Those the reconcile takes the engine's word for need no other read.
        let last: BTreeSet<VirtualKey> = touched.difference(&defer).copied().collect();
        // Many changed during this round (a churn): the reader reads them in another round,
        // shorter than this one, rather than the loop.
        if last.len() > self.loop_rereads
            && rounds < REREAD_ROUNDS
            && let Some(r) = reader
        {
            let next = WholeRead {
                read,
                took,
                again: last,
                rounds: rounds + 1,
                earlier: reread,
                defer,
            };
            return self.read_again_with(r, Box::new(next), discarded);
        }
        if let Err(e) = self
            .reread_on_loop(&mut read, &last)
            .and_then(|()| self.take_engine_word(&mut read, defer))
        {
            return self.read_failed(SyncKind::Reconcile, &e);
        }
        tracing::info!(
            "reconcile: read {} the loop changed during the read again in the background in \
             {:.1} ms ({}), and {} changed meanwhile on the loop in {:.1} ms",
            count(reread.0, "virtual server", "virtual servers"),
            reread.1.as_secs_f64() * 1000.0,
            count(rounds, "round", "rounds"),
            last.len(),
            loop_start.elapsed().as_secs_f64() * 1000.0
        );
        self.reconcile_with(read, took + reread.1, loop_start, reader);
    }

    /// The reconcile's diff against a read (`took`: how long it took off the loop; the loop's
    /// own time counts from `loop_start`), then its masquerade sync; the read is then freed
    /// by the reader, when there is one.
    fn reconcile_with(
        &mut self,
        read: Read,
        took: Duration,
        loop_start: Instant,
        reader: Option<&Reader>,
    ) {
        let (owned, fingerprint) = &read.fingerprint;
        let fingerprint =
            (*owned == Owned::of(&self.inputs.node().options)).then_some(*fingerprint);
        self.resync_observed(
            SyncKind::Reconcile,
            took,
            Some(loop_start),
            &read.observed,
            &Masked {
                counts: &read.counts,
                unknown: &read.word,
            },
            fingerprint,
        );
        self.reconcile_masquerade(read.sets.as_ref());
        let ask = Ask::Dispose(Box::new(read));
        let unsent = match reader {
            Some(r) => r.requests.send(ask).err().map(|e| e.0),
            None => Some(ask),
        };
        if let Some(ask) = unsent {
            drop(ask);
            release_memory("reconcile");
        }
    }

    /// A reconcile that reads the kernel on the loop (no reader, or reads kept being
    /// overtaken).
    fn reconcile_on_loop(&mut self) {
        self.full_sync(SyncKind::Reconcile);
        self.reconcile_masquerade(None);
    }

    /// A read of the kernel failed: logged, counted, and retried with backoff.
    fn read_failed(&mut self, kind: SyncKind, e: &KernelError) {
        tracing::warn!("{} sync: reading the kernel: {e}", kind.label());
        self.shared.with_metrics(|m| m.kernel_errors += 1);
        self.schedule_retry("(reading the kernel)".to_owned());
    }

    /// The reconcile's forced masquerade sync, timed; `read`: the service sets as its
    /// background read found them, if it read them.
    fn reconcile_masquerade(&mut self, read: Option<&SetsRead>) {
        if self.masq.is_none() {
            return;
        }
        let start = Instant::now();
        self.sync_masquerade(MasqSync::Reconcile(read));
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        if let Some(m) = &self.masq {
            tracing::info!(
                "reconcile: masquerade rules and sets ensured in {:.1} ms (hairpin sets {:.1} ms, \
                 service sets {:.1} ms, rules {:.1} ms)",
                ms(start.elapsed()),
                ms(m.timing.hairpin_sets),
                ms(m.timing.service_sets),
                ms(m.timing.rules)
            );
        }
    }

    /// Applies a change set to the inputs, keeping our NodePort addresses over the Node's.
    fn take(&mut self, mut cs: ChangeSet) {
        // kube-proxy's QueuedUpdate: the health check times out if no sync applies this.
        if !cs.services.is_empty() || cs.node.is_some() {
            self.shared.queued();
            let wall = (self.wall)()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            let (services, endpoints) = changes_in(&cs, &self.inputs);
            self.shared.with_metrics(|m| {
                m.last_queued_timestamp = wall;
                m.service_changes += services;
                m.service_changes_pending += services;
                m.endpoint_changes += endpoints;
                m.endpoint_changes_pending += endpoints;
            });
        }
        if let Some(node) = &cs.node {
            self.shared.set_node_draining(node.draining);
        }
        // Moved, not copied: the first change set is the whole cluster.
        for e in cs.move_into(&mut self.inputs) {
            tracing::warn!("skipping an object the model refused: {e}");
        }
        let short = self.inputs.marks_short();
        if short > self.marks_short {
            tracing::warn!(
                "--local-fwmark-mask is full: {} Local-policy Service port(s) got no mark, so \
                 local clients of their external addresses get local endpoints only",
                short - self.marks_short
            );
            self.marks_short = short;
        }
        for (name, times) in &cs.trigger_times {
            self.triggers
                .entry(name.clone())
                .or_default()
                .extend(times.iter().copied());
        }
        if cs.node.is_some() {
            // The change set replaced the context's addresses with the Node's.
            self.node_primary = self.inputs.node().node_ips().collect();
            self.impose_node_ips();
            self.note_families();
        }
        if let Some(hc) = &mut self.health_checks {
            hc.update(cs.services.keys(), &self.inputs);
        }
        if let Some(m) = &mut self.masq {
            if cs.node.is_some() {
                m.update_all(&self.inputs);
            } else {
                m.update(cs.services.keys(), &self.inputs);
            }
        }
    }

    /// Applies the masquerade rules and sets: all of them at startup and at a reconcile, else
    /// when their inputs changed; a failure is logged and counted and left for the next
    /// reconcile.
    fn sync_masquerade(&mut self, how: MasqSync<'_>) {
        let Some(m) = &mut self.masq else {
            return;
        };
        let force = how != MasqSync::Change;
        let result = match how {
            MasqSync::Change => m.sync(&mut self.kernel, &self.inputs, false),
            MasqSync::Startup => m.sync(&mut self.kernel, &self.inputs, true),
            MasqSync::Reconcile(read) => m.repair(&mut self.kernel, &self.inputs, read),
        };
        let retried = std::mem::take(&mut m.retried_failures);
        if retried > 0 {
            self.shared
                .with_metrics(|metrics| metrics.masquerade_errors += retried);
        }
        match result {
            Ok(true) => tracing::debug!("masquerade rules applied"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!("masquerade rules (retried at the next reconcile): {e}");
                self.shared.with_metrics(|m| m.masquerade_errors += 1);
                return;
            }
        }
        // Our rules are in place: kube-proxy's leftovers can go (once; retried at the next
        // forced sync if it fails).
        if force && self.kube_proxy_leftovers_pending {
            match self.kernel.remove_kube_proxy_leftovers() {
                Ok(removed) => {
                    self.kube_proxy_leftovers_pending = false;
                    for what in &removed {
                        tracing::info!("removed kube-proxy's {what}");
                    }
                }
                Err(e) => tracing::warn!(
                    "removing kube-proxy's chains and ipsets (retried at the next reconcile): {e}"
                ),
            }
        }
    }

    /// The families health and metrics report: the Node's addresses (kube-proxy's node IPs),
    /// else the NodePort addresses.
    fn note_families(&self) {
        let node = self.inputs.node();
        let from: Vec<IpAddr> = if self.node_primary.is_empty() {
            node.node_ips().collect()
        } else {
            self.node_primary.clone()
        };
        let (v4, v6) = (
            from.iter().any(IpAddr::is_ipv4),
            from.iter().any(IpAddr::is_ipv6),
        );
        self.shared.set_families(v6);
        let family = if v6 && !v4 { "IPv6" } else { "IPv4" };
        self.shared.with_metrics(|m| m.ip_family = family);
    }

    /// Sets the NodePort and held addresses from what was last read ([`super::nodeports`]);
    /// before the first read, only `--node-ip` (the Node's addresses stand meanwhile). Says
    /// whether the node context changed.
    fn impose_node_ips(&mut self) -> bool {
        let mut ctx = self.inputs.node().clone();
        let changed = match &self.local {
            Some(local) => super::nodeports::apply(
                &mut ctx,
                &self.cfg.nodeports,
                &self.cfg.node_ips,
                local,
                &self.node_primary,
            ),
            None if !self.cfg.node_ips.is_empty() => {
                ctx.set_node_ips(self.cfg.node_ips.iter().copied());
                true
            }
            None => false,
        };
        if !changed {
            return false;
        }
        let ips: Vec<IpAddr> = ctx.node_ips().collect();
        match self.inputs.set_node(ctx) {
            Ok(()) => {
                tracing::info!("NodePort addresses: {ips:?}");
                true
            }
            Err(e) => {
                tracing::warn!("node addresses refused: {e}");
                false
            }
        }
    }

    /// Re-reads the node's addresses; says whether the NodePort addresses or the addresses
    /// other interfaces hold changed.
    fn refresh_node_addresses(&mut self) -> bool {
        match self.kernel.node_addresses() {
            Ok(mut all) => {
                all.sort_unstable();
                all.dedup();
                if self.local.as_ref() == Some(&all) {
                    return false;
                }
                self.local = Some(all);
                let changed = self.impose_node_ips();
                if changed {
                    self.note_families();
                }
                changed
            }
            Err(e) => {
                self.shared.with_metrics(|m| m.kernel_errors += 1);
                tracing::warn!("reading the node's addresses: {e}");
                false
            }
        }
    }

    /// Changed Services only, plus expiry of draining real servers.
    fn incremental_sync(&mut self) {
        if !self.adopted {
            self.full_sync(SyncKind::Retry);
            return;
        }
        let start = Instant::now();
        let draining: BTreeSet<VirtualKey> = self.engine.draining().map(|(s, _, _)| *s).collect();
        let counts = if draining.is_empty() {
            Counts::default()
        } else {
            self.kernel.connection_counts(&draining)
        };
        let now = self.now();
        let ops = self.engine.sync(&mut self.inputs, now, &counts);
        self.note_drain_timeouts();
        if ops.is_empty() {
            self.programmed(&[], false);
            self.finish(SyncKind::Incremental, start, 0, &[]);
            return;
        }
        tracing::debug!(
            "incremental sync: {} ready to apply after {:.1} ms (connection counts of {} \
             draining virtual servers, diff)",
            count(ops.len(), "operation", "operations"),
            start.elapsed().as_secs_f64() * 1000.0,
            draining.len()
        );
        let failures = self.apply(&ops);
        let mut delta: (i64, i64) = (0, 0);
        for op in &ops {
            if failures.iter().any(|f| &f.op == op) {
                continue;
            }
            match op {
                Op::AddService(_) => delta.0 += 1,
                Op::DeleteService(_) => delta.0 -= 1,
                Op::AddDest { .. } => delta.1 += 1,
                Op::DeleteDest { .. } => delta.1 -= 1,
                _ => {}
            }
        }
        self.shared.with_metrics(|m| {
            m.services = m.services.saturating_add_signed(delta.0);
            m.real_servers = m.real_servers.saturating_add_signed(delta.1);
        });
        let labels: BTreeSet<String> = failures.iter().map(|f| names_label(&f.services)).collect();
        for label in labels {
            self.schedule_retry(label);
        }
        self.programmed(&failures, false);
        self.finish(SyncKind::Incremental, start, ops.len(), &failures);
    }

    /// Dumps the kernel on the loop and applies the whole difference.
    fn full_sync(&mut self, kind: SyncKind) {
        let start = Instant::now();
        self.refresh_node_addresses();
        let (observed, counts) = match self.kernel.observe() {
            Ok(v) => v,
            Err(e) => return self.read_failed(kind, &e),
        };
        // Everything was read: nothing is left on the engine's word.
        self.deferred.clear();
        self.resync_observed(
            kind,
            start.elapsed(),
            None,
            &observed,
            &Masked {
                counts: &counts,
                unknown: &BTreeSet::new(),
            },
            None,
        );
        drop((observed, counts));
        release_memory(kind.label());
    }

    /// Applies the whole difference between the desired table and `observed`, read in `read`:
    /// on the loop, or in the background when `background` gives the time the loop took the
    /// read back (so the sync's own duration is the loop's time on it either way).
    fn resync_observed(
        &mut self,
        kind: SyncKind,
        read: Duration,
        background: Option<Instant>,
        observed: &Observed,
        masked: &Masked<'_>,
        fingerprint: Option<Fingerprint>,
    ) {
        let start = Instant::now();
        let counts: &dyn ConnectionCounts = masked;
        let on_loop = background.unwrap_or_else(|| start.checked_sub(read).unwrap_or(start));
        self.adopted = true;
        let now = self.now();
        // Real servers that were draining and are deleted now finished their graceful
        // termination: expected work, not drift.
        let draining: BTreeSet<(VirtualKey, DestKey)> =
            self.engine.draining().map(|(s, d, _)| (*s, *d)).collect();
        let (ops, same) = match fingerprint {
            Some(f) => {
                self.engine
                    .resync_fingerprinted(&mut self.inputs, &observed.table, f, now, counts)
            }
            None => (
                self.engine
                    .resync(&mut self.inputs, &observed.table, now, counts),
                false,
            ),
        };
        if !same && !masked.unknown.is_empty() {
            // `word_fingerprint` made sure the fingerprints would be equal, so this is a bug:
            // the diff went against entries the read no longer stands for, so its ops are
            // dropped and the kernel is read again whole on the loop. (The engine's draining
            // state is the dropped diff's by then: a real server it meant to delete that still
            // has connections starts its graceful termination again, the safe side.)
            debug_assert!(
                false,
                "the engine's word was taken unbuilt and the diff ran"
            );
            tracing::warn!(
                "reconcile: fingerprints differed with the engine's word taken unbuilt; reading the kernel on the loop"
            );
            return self.full_sync(SyncKind::Reconcile);
        }
        self.note_drain_timeouts();
        let diffed = start.elapsed();
        let failures = self.apply(&ops);
        if matches!(kind, SyncKind::Startup | SyncKind::Reconcile) {
            tracing::info!(
                "{} sync: read the kernel in {:.1} ms ({}), {} in {:.1} ms, applied {} in {:.1} ms",
                kind.label(),
                read.as_secs_f64() * 1000.0,
                if background.is_some() {
                    "in the background"
                } else {
                    "on the loop"
                },
                if same {
                    "fingerprints equal, not diffed"
                } else {
                    "diffed"
                },
                diffed.as_secs_f64() * 1000.0,
                count(ops.len(), "operation", "operations"),
                (start.elapsed() - diffed).as_secs_f64() * 1000.0
            );
        }
        let drained = ops
            .iter()
            .filter(|op| {
                matches!(op, Op::DeleteDest { service, dest } if draining.contains(&(*service, *dest)))
                    && !failures.iter().any(|f| &f.op == *op)
            })
            .count() as u64;
        let (services, real_servers) = self.engine.desired_size();
        let failed: BTreeSet<String> = failures.iter().map(|f| names_label(&f.services)).collect();
        // A full sync retried everything: what did not fail again is done.
        self.retry.retain(|label, _| failed.contains(label));
        for label in failed {
            self.schedule_retry(label);
        }
        let applied = (ops.len() - failures.len()) as u64;
        let drift = applied - drained;
        let no_local = no_local_endpoints(&self.inputs);
        self.shared.with_metrics(|m| {
            m.services = services as u64;
            m.real_servers = real_servers as u64;
            m.foreign_entries = observed.foreign.len() as u64;
            m.no_local_endpoints = no_local;
            if kind == SyncKind::Reconcile {
                m.drift_repaired += drift;
                m.reconcile_fingerprint_matches += u64::from(same);
            }
            m.full_sync_duration.observe(match background {
                Some(_) => read + on_loop.elapsed(),
                None => on_loop.elapsed(),
            });
        });
        if kind == SyncKind::Reconcile && drift > 0 {
            tracing::warn!(
                "reconcile repaired {} of drift",
                count(drift, "operation", "operations")
            );
        }
        if drained > 0 {
            tracing::info!(
                "{} deleted",
                count(drained, "drained real server", "drained real servers")
            );
        }
        self.programmed(&failures, true);
        // The sync's own duration is the time the loop spent on it: the read too when it read.
        self.finish(kind, on_loop, ops.len(), &failures);
    }

    /// Logs and counts the draining real servers the engine deleted at the graceful-termination
    /// timeout while they still had connections.
    fn note_drain_timeouts(&mut self) {
        let cut = self.engine.take_timed_out();
        if cut.is_empty() {
            return;
        }
        let timeout = self.inputs.node().options.graceful_termination_timeout;
        for (service, dest) in &cut {
            tracing::warn!(
                "graceful termination: {service} real server {} still had connections after \
                 {:?} (--graceful-termination-timeout); deleting it",
                std::net::SocketAddr::new(dest.addr, dest.port),
                timeout
            );
        }
        self.shared
            .with_metrics(|m| m.drain_timeouts += cut.len() as u64);
    }

    /// Applies ops; failures are logged with their Services and counted.
    fn apply(&mut self, ops: &[Op]) -> Vec<apply::Failure> {
        if let Some(flight) = &mut self.reading {
            // A whole read dumps by position, so a virtual server or an address that comes or
            // goes may make it skip another; a second read (of named virtual servers) cannot,
            // but the table's addresses are still the whole read's.
            let whole_read = !flight.second;
            for op in ops {
                flight.moved |= match op {
                    Op::AddService(_) | Op::DeleteService(_) => whole_read,
                    Op::AddAddress(_) | Op::RemoveAddress(_) => true,
                    _ => false,
                };
                if let Some(key) = op.service() {
                    flight.touched.insert(*key);
                }
            }
        }
        // Owners cost a walk over every Service, so they are only worked out for failures.
        let mut failures = apply::apply(&mut self.kernel, ops, &Owners::default());
        if self.reading.is_some() {
            self.failed_during_read
                .extend(failures.iter().filter_map(|f| f.op.service()).copied());
        }
        if !failures.is_empty() {
            let owners = Owners::from_inputs(&self.inputs);
            for f in &mut failures {
                f.services = owners.of(&f.op).to_vec();
                tracing::warn!("failed: {f}");
            }
            let n = failures.len() as u64;
            self.shared.with_metrics(|m| m.kernel_errors += n);
        }
        // After the IPVS change, so no new datagram is scheduled to the endpoint once its
        // entries are gone.
        let flushes = udp_flushes(ops, &failures);
        let flush_start = Instant::now();
        let any_flush = !flushes.is_empty();
        for target in flushes {
            match self.kernel.flush_udp(target) {
                Ok(n) => {
                    if n > 0 {
                        tracing::info!(
                            "deleted {} of {target}",
                            count(n, "conntrack entry", "conntrack entries")
                        );
                    }
                    self.shared
                        .with_metrics(|m| m.conntrack_flushed += n as u64);
                }
                Err(e) => {
                    tracing::warn!("conntrack cleanup of {target}: {e}");
                    self.shared.with_metrics(|m| m.conntrack_errors += 1);
                }
            }
        }
        if any_flush {
            let took = flush_start.elapsed();
            self.shared
                .with_metrics(|m| m.conntrack_reconcile.observe(took));
        }
        failures
    }

    /// After a sync that ran (the kernel was read, for a full one): notes the Services whose
    /// operations failed and observes the network programming latency of every pending trigger
    /// time whose Service is now programmed. A full sync diffs against the kernel, so it clears
    /// what earlier failures left behind; an incremental one only adds to them.
    fn programmed(&mut self, failures: &[apply::Failure], full: bool) {
        if full {
            self.unprogrammed.clear();
            self.unprogrammed_unknown = false;
        }
        for f in failures {
            if f.services.is_empty() {
                self.unprogrammed_unknown = true;
            }
            self.unprogrammed.extend(f.services.iter().cloned());
        }
        if self.triggers.is_empty() || self.unprogrammed_unknown {
            return;
        }
        let now = (self.wall)();
        let unprogrammed = &self.unprogrammed;
        let mut done = Vec::new();
        self.triggers.retain(|name, times| {
            if unprogrammed.contains(name) {
                return true;
            }
            for t in times.iter() {
                done.push((name.clone(), seconds_between(*t, now)));
            }
            false
        });
        for (name, secs) in &done {
            tracing::debug!("service {name}: network programming took {secs:.3} s");
        }
        self.shared.with_metrics(|m| {
            for (_, secs) in &done {
                m.network_programming.observe_secs(*secs);
            }
        });
    }

    fn schedule_retry(&mut self, label: String) {
        let attempts = self.retry.get(&label).map_or(0, |p| p.attempts) + 1;
        let delay = self
            .cfg
            .retry_min
            .saturating_mul(1u32 << (attempts - 1).min(16))
            .min(self.cfg.retry_max);
        tracing::info!(
            "retrying {label} in {:.1}s (attempt {attempts})",
            delay.as_secs_f64()
        );
        self.retry.insert(
            label,
            Pending {
                attempts,
                due: Instant::now() + delay,
            },
        );
    }

    fn finish(&mut self, kind: SyncKind, start: Instant, ops: usize, failures: &[apply::Failure]) {
        let applied = (ops - failures.len()) as u64;
        let elapsed = start.elapsed();
        let pending = self.retry.len() as u64;
        let now = (self.wall)();
        let wall = now
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        // A sync whose every operation failed, for more than one Service, programmed nothing:
        // the kernel refuses everything, which is not a successful sync. One Service the
        // kernel keeps refusing (a scheduler whose module is missing) is retried and counted,
        // but does not make the node unhealthy: that would drain every load balancer from it.
        let mut failed_services: Vec<&ServiceName> =
            failures.iter().flat_map(|f| &f.services).collect();
        failed_services.sort_unstable();
        failed_services.dedup();
        let succeeded = ops == 0 || applied > 0 || failed_services.len() <= 1;
        self.shared.with_metrics(|m| {
            m.sync_duration.observe(elapsed);
            m.add_operations(kind, applied);
            if succeeded {
                m.last_sync_timestamp = wall;
            }
            m.pending_retries = pending;
        });
        if succeeded {
            self.shared.synced(now);
            self.shared.with_metrics(|m| {
                m.service_changes_pending = 0;
                m.endpoint_changes_pending = 0;
            });
        } else {
            self.shared.sync_failed();
        }
        if ops > 0 || kind == SyncKind::Startup {
            tracing::info!(
                "{} sync: applied {applied} of {} in {:.1} ms",
                kind.label(),
                count(ops, "operation", "operations"),
                elapsed.as_secs_f64() * 1000.0
            );
        }
    }
}

/// Puts the virtual servers `keys`, read again (`fresh`), in place of what `read` found of
/// them, their real servers' connections with them.
fn replace_entries(read: &mut Read, keys: &BTreeSet<VirtualKey>, fresh: Reread) {
    let (entries, counts) = fresh;
    let services = &read.observed.table.services;
    let stale: usize = keys
        .iter()
        .filter_map(|k| services.get(k))
        .map(|e| e.dests.len())
        .sum();
    // Many (a churn at 250 real servers a Service): one pass over the counts beats as many
    // scattered removals (natively 22 against 39 ms for 250,000 of 250,000).
    if stale > read.counts.len() / 4 {
        read.counts.retain(|(k, _), _| !keys.contains(k));
    } else {
        for key in keys {
            for dest in services.get(key).into_iter().flat_map(|e| e.dests.keys()) {
                read.counts.remove(&(*key, *dest));
            }
        }
    }
    read.counts.extend(counts);
    let (owned, fingerprint) = &mut read.fingerprint;
    let owned = owned.view();
    let services = &mut read.observed.table.services;
    for (key, entry) in entries {
        let old = match entry {
            Some(entry) => {
                if owned.key(&key) {
                    fingerprint.add(Fingerprint::of_entry(&entry.server, entry.dests.values()));
                }
                services.insert(key, entry)
            }
            None => services.remove(&key),
        };
        if let Some(old) = old.filter(|_| owned.key(&key)) {
            fingerprint.subtract(Fingerprint::of_entry(&old.server, old.dests.values()));
        }
    }
}

/// Returns free memory to the kernel after a sync's read is freed. The observed table was the
/// sync's big allocation (tens of MiB at 10,000 Services): without this the RSS keeps the
/// high-water mark of whichever sync's memory ended up below a live allocation (a 45-minute
/// soak stepped from 111 to 144 MiB at minute 6 and stayed there).
fn release_memory(sync: &str) {
    let trim = std::time::Instant::now();
    let released = kube_ipvs_host::memory::release_free_memory();
    tracing::debug!(
        "{sync} sync: returned free memory to the kernel ({released}) in {:.1} ms",
        trim.elapsed().as_secs_f64() * 1000.0
    );
}

/// The next answer of the kernel reader; never completes without one. `None` when the reader's
/// thread is gone.
async fn next_read(reader: &mut Option<Reader>) -> Option<Answer> {
    match reader {
        Some(r) => r.results.recv().await,
        None => std::future::pending().await,
    }
}

/// The next signal of an address watch; never completes without one.
async fn next_signal(signals: &mut Option<mpsc::Receiver<()>>) -> Option<()> {
    match signals {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Subscribes to the kernel's address notifications and forwards a signal for each change of an
/// address of an interface other than `dummy` (and for each loss of notifications) from a dedicated thread, since
/// the subscription's socket blocks. `None`, with a warning, when the subscription fails: the
/// caller then relies on the re-read at each full sync.
pub fn watch_addresses(dummy: &str) -> Option<mpsc::Receiver<()>> {
    use kube_ipvs_netlink::link::{AddressEvent, AddressWatch, Rtnl};
    let dummy = dummy.to_owned();
    // The dummy interface's index, looked up again whenever an event names another interface
    // (it may have been recreated): our own binds there, thousands at startup, are no change
    // of the node's addresses and must not each cost a re-read.
    let mut rtnl = Rtnl::new().ok();
    let mut ours: Option<u32> = None;
    let mut is_ours = move |index: u32| {
        if ours == Some(index) {
            return true;
        }
        ours = rtnl
            .as_mut()
            .and_then(|r| r.link_index(&dummy).ok().flatten());
        ours == Some(index)
    };
    let mut watch = match AddressWatch::subscribe() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!("{e}; NodePort addresses are re-read at each reconcile only");
            return None;
        }
    };
    // One pending signal is enough: the loop re-reads every address when it gets it.
    let (tx, rx) = mpsc::channel(1);
    let spawned = std::thread::Builder::new()
        .name("address-watch".to_owned())
        .spawn(move || {
            loop {
                // Any address counts: NodePort addresses are chosen among all of them, and
                // the held ones decide which external addresses are bound.
                let relevant = match watch.recv() {
                    Ok(AddressEvent::Added { index, .. } | AddressEvent::Removed { index, .. }) => {
                        !is_ours(index)
                    }
                    Ok(AddressEvent::Resync) => {
                        tracing::info!(
                            "address notifications were lost (the receive buffer overflowed): every address is read again"
                        );
                        true
                    }
                    Ok(_) => false,
                    Err(e) => {
                        // Dropping the sender tells the loop, which logs the fallback.
                        tracing::warn!("address watch: {e}");
                        return;
                    }
                };
                if relevant && let Err(mpsc::error::TrySendError::Closed(())) = tx.try_send(()) {
                    return;
                }
            }
        });
    match spawned {
        Ok(_) => Some(rx),
        Err(e) => {
            tracing::warn!(
                "starting the address watch thread: {e}; NodePort addresses are re-read at each reconcile only"
            );
            None
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::mem::MemKernel;
    use std::sync::Mutex;

    /// A read of `n` virtual servers of 4 real servers each, every real server with
    /// `conns` connections.
    fn read_of(n: u8, conns: u64) -> Read {
        let mut table = kube_ipvs_diff::Table::default();
        let mut counts = Counts::default();
        for i in 0..n {
            let entry = entry_of(i, 4);
            for d in entry.dests.keys() {
                counts.insert((entry.server.key, *d), conns);
            }
            table.services.insert(entry.server.key, entry);
        }
        let owned = Owned {
            exclude: Vec::new(),
            marks: None,
        };
        let f = Fingerprint::of_table(&table, owned.view());
        Read {
            observed: Observed {
                table,
                foreign: Vec::new(),
                interface_exists: true,
            },
            counts,
            fingerprint: (owned, f),
            sets: None,
            word: BTreeSet::new(),
        }
    }

    /// Virtual server `i` (10.96.0.i:80) with `dests` real servers.
    fn entry_of(i: u8, dests: u8) -> kube_ipvs_diff::ServiceEntry {
        let server = kube_ipvs_diff::VirtualServer {
            key: key(Protocol::Tcp, &format!("10.96.0.{i}"), 80),
            scheduler: kube_ipvs_diff::Scheduler::new(kube_ipvs_diff::SchedulerKind::Rr),
            persistence: None,
            netmask: 32,
        };
        let dests = (0..dests)
            .map(|j| {
                let d = kube_ipvs_diff::RealServer::masq(ip(&format!("10.244.{i}.{j}")), 8080, 1);
                (d.key, d)
            })
            .collect();
        kube_ipvs_diff::ServiceEntry { server, dests }
    }

    /// Entries read again replace the read's, with their counts and in its fingerprint, however
    /// many they are (a few are removed one by one, many in one pass over the counts).
    #[test]
    fn replaced_entries_bring_their_counts_and_fingerprint() {
        for replaced in [1u8, 2, 6, 10] {
            let mut read = read_of(10, 5);
            let keys: BTreeSet<VirtualKey> = (0..replaced)
                .map(|i| key(Protocol::Tcp, &format!("10.96.0.{i}"), 80))
                .collect();
            // The first comes back with 2 real servers, 7 connections each; the second is gone.
            let mut fresh_counts = Counts::default();
            let fresh: BTreeMap<VirtualKey, Option<kube_ipvs_diff::ServiceEntry>> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    if i == 1 {
                        return (*k, None);
                    }
                    let e = entry_of(u8::try_from(i).expect("small"), 2);
                    for d in e.dests.keys() {
                        fresh_counts.insert((*k, *d), 7);
                    }
                    (*k, Some(e))
                })
                .collect();
            replace_entries(&mut read, &keys, (fresh, fresh_counts));
            let table = &read.observed.table;
            let expected: Counts = table
                .services
                .iter()
                .flat_map(|(k, e)| {
                    let n = if keys.contains(k) { 7 } else { 5 };
                    e.dests.keys().map(move |d| ((*k, *d), n))
                })
                .collect();
            assert_eq!(read.counts, expected, "{replaced} replaced");
            assert_eq!(
                table.services.len(),
                if replaced > 1 { 9 } else { 10 },
                "{replaced} replaced"
            );
            let (owned, f) = &read.fingerprint;
            assert_eq!(
                *f,
                Fingerprint::of_table(table, owned.view()),
                "{replaced} replaced"
            );
        }
    }

    /// Sets the node's addresses the in-memory kernel reports.
    fn set_addresses(k: &MemKernel, addrs: &[&str]) {
        k.state().node_addresses = addrs.iter().map(|a| ip(a)).collect();
    }

    /// The example cluster's manifests.
    fn examples() -> kube_ipvs_watch::manifest::Manifests {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster");
        kube_ipvs_watch::manifest::load(&dir).expect("the examples load")
    }

    /// The first change set of the example cluster, with its Node.
    fn examples_change_set() -> ChangeSet {
        let m = examples();
        let mut t = kube_ipvs_watch::Tracker::new(kube_ipvs_watch::TranslateOptions::default());
        t.relist_services(&m.services);
        t.relist_slices(&m.slices);
        t.apply_node(&m.nodes[0]);
        t.take_change_set().expect("an initial change set")
    }

    /// Waits (at most 10 s, so a missing sync fails the test instead of hanging it) until `n`
    /// syncs have finished.
    async fn wait_syncs(syncs: &mut tokio::sync::watch::Receiver<u64>, n: u64) {
        tokio::time::timeout(Duration::from_secs(10), syncs.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("sync {n} did not happen within 10 s"))
            .expect("the agent is running");
    }

    /// With a one-hour sync period only the address signal can make the agent re-read the node's
    /// addresses: the NodePort follows an added and a removed address.
    #[tokio::test]
    async fn an_address_signal_moves_the_nodeports() {
        let cs = examples_change_set();

        let kernel = MemKernel::default();
        set_addresses(&kernel, &["192.168.77.10", "10.0.2.15"]);
        let period = Duration::from_secs(3600);
        let shared = Arc::new(Shared::new(period));
        let cfg = AgentConfig {
            nodeports: crate::agent::nodeports::NodePortAddresses::parse(["192.168.77.0/24"])
                .expect("literal"),
            remove_kube_proxy_leftovers: false,
            ..AgentConfig::every(period)
        };
        let inputs = Inputs::new(kube_ipvs_diff::NodeContext::new("node-1")).expect("valid node");
        let (signal, signals) = mpsc::channel(1);
        let mut agent =
            Agent::new(kernel.clone(), inputs, cfg, shared.clone()).with_address_changes(signals);
        let (changes, rx) = mpsc::channel(4);
        changes.send(cs).await.expect("send");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            agent
                .run(rx, async {
                    let _ = stopped.await;
                })
                .await
        });
        let mut syncs = shared.syncs();
        wait_syncs(&mut syncs, 1).await;
        let nodeports = |k: &MemKernel| -> Vec<(bool, IpAddr)> {
            k.state()
                .service_changes
                .clone()
                .into_iter()
                .filter(|c| c.2 == 30080)
                .map(|c| (c.0, c.1))
                .collect()
        };
        assert_eq!(nodeports(&kernel), vec![(true, ip("192.168.77.10"))]);

        set_addresses(&kernel, &["192.168.77.10", "192.168.77.11", "10.0.2.15"]);
        signal.send(()).await.expect("send");
        wait_syncs(&mut syncs, 2).await;
        assert_eq!(
            nodeports(&kernel),
            vec![(true, ip("192.168.77.10")), (true, ip("192.168.77.11"))]
        );

        // Removing .10 deletes its NodePort; the addresses outside the CIDRs never count.
        set_addresses(&kernel, &["192.168.77.11", "10.0.2.15", "10.0.2.16"]);
        signal.send(()).await.expect("send");
        wait_syncs(&mut syncs, 3).await;
        assert_eq!(
            nodeports(&kernel),
            vec![
                (true, ip("192.168.77.10")),
                (true, ip("192.168.77.11")),
                (false, ip("192.168.77.10"))
            ]
        );
        let _ = stop.send(());
        assert!(task.await.expect("agent task").is_ok());
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    /// 2026-01-01T00:00:00Z plus `secs`.
    fn at(secs: f64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600) + Duration::from_secs_f64(secs)
    }

    /// A running agent over the example cluster, with a wall clock the test sets.
    struct Latency {
        kernel: MemKernel,
        tracker: kube_ipvs_watch::Tracker,
        slices: Vec<k8s_openapi::api::discovery::v1::EndpointSlice>,
        clock: Arc<Mutex<SystemTime>>,
        shared: Arc<Shared>,
        changes: mpsc::Sender<ChangeSet>,
        syncs: tokio::sync::watch::Receiver<u64>,
    }

    impl Latency {
        /// Starts the agent (tracker started at `at(0)`) and waits for its startup sync.
        async fn start() -> Self {
            Self::start_with(Duration::from_secs(3600), false).await
        }

        /// The same with this sync period, reading the kernel for reconciles on a thread of
        /// its own if `background`.
        async fn start_with(period: Duration, background: bool) -> Self {
            Self::start_configured(period, background, LOOP_REREADS, DEFER_ABOVE).await
        }

        /// Reads in the background, with at most `loop_rereads` virtual servers re-read on the
        /// loop.
        async fn start_with_loop_rereads(period: Duration, loop_rereads: usize) -> Self {
            Self::start_configured(period, true, loop_rereads, DEFER_ABOVE).await
        }

        /// Reads in the background, taking the engine's word for any virtual server changed
        /// during a whole read that the last reconcile read.
        async fn start_deferring(period: Duration) -> Self {
            Self::start_configured(period, true, LOOP_REREADS, 0).await
        }

        async fn start_configured(
            period: Duration,
            background: bool,
            loop_rereads: usize,
            defer_above: usize,
        ) -> Self {
            let m = examples();
            let mut tracker = kube_ipvs_watch::Tracker::started_at(
                kube_ipvs_watch::TranslateOptions::default(),
                at(0.0),
            );
            tracker.relist_services(&m.services);
            tracker.relist_slices(&m.slices);
            let cs = tracker.take_change_set().expect("an initial change set");
            let kernel = MemKernel::default();
            let clock = Arc::new(Mutex::new(at(1.0)));
            let shared = Arc::new(Shared::new(period));
            let cfg = AgentConfig {
                remove_kube_proxy_leftovers: false,
                ..AgentConfig::every(period)
            };
            let inputs =
                Inputs::new(kube_ipvs_diff::NodeContext::new("node-1")).expect("valid node");
            let wall = clock.clone();
            let mut agent = Agent::new(kernel.clone(), inputs, cfg, shared.clone())
                .with_wall_clock(Arc::new(move || *wall.lock().expect("lock")));
            agent.loop_rereads = loop_rereads;
            agent.defer_above = defer_above;
            if background {
                agent = agent
                    .with_background_reads(Box::new(kernel.clone()))
                    .expect("the reader thread starts");
            }
            let (changes, rx) = mpsc::channel(4);
            changes.send(cs).await.expect("send");
            // The agent stops when the test drops its sender.
            tokio::spawn(async move { agent.run(rx, std::future::pending()).await });
            let mut syncs = shared.syncs();
            wait_syncs(&mut syncs, 1).await;
            Self {
                kernel,
                tracker,
                slices: m.slices,
                clock,
                shared,
                changes,
                syncs,
            }
        }

        fn set_clock(&self, t: SystemTime) {
            *self.clock.lock().expect("lock") = t;
        }

        /// Changes an example slice with `edit`, annotates it with this trigger time, and
        /// hands the change set to the agent.
        async fn change_slice(
            &mut self,
            name: &str,
            edit: impl FnOnce(&mut k8s_openapi::api::discovery::v1::EndpointSlice),
            trigger: &str,
        ) {
            let slice = self
                .slices
                .iter_mut()
                .find(|s| s.metadata.name.as_deref() == Some(name))
                .expect("the example has the slice");
            edit(slice);
            slice.metadata.annotations = Some(std::collections::BTreeMap::from([(
                kube_ipvs_watch::translate::LAST_CHANGE_TRIGGER_TIME_ANNOTATION.to_owned(),
                trigger.to_owned(),
            )]));
            let slice = slice.clone();
            self.tracker.apply_slice(&slice);
            let cs = self.tracker.take_change_set().expect("the slice changed");
            assert_eq!(cs.trigger_times.len(), 1, "{:?}", cs.trigger_times);
            self.changes.send(cs).await.expect("send");
        }

        /// Adds a ready endpoint to the `shop` slice (a new real server), triggered at `trigger`.
        async fn add_shop_endpoint(&mut self, addr: &str, trigger: &str) {
            let edit = |s: &mut k8s_openapi::api::discovery::v1::EndpointSlice| {
                let mut ep = s.endpoints[0].clone();
                ep.addresses = vec![addr.to_owned()];
                s.endpoints.push(ep);
            };
            self.change_slice("shop-m4n8q", edit, trigger).await;
        }

        /// [`Latency::add_shop_endpoint`], then waits until the kernel has the endpoint.
        async fn add_shop_endpoint_programmed(&mut self, addr: &str, trigger: &str) {
            self.add_shop_endpoint(addr, trigger).await;
            let kernel = self.kernel.clone();
            until(&format!("{addr} programmed"), || {
                shop_dests(&kernel).contains(&ip(addr))
            })
            .await;
        }

        fn histogram(&self) -> (u64, String) {
            self.shared.with_metrics(|m| {
                (
                    m.network_programming.count(),
                    m.render()
                        .lines()
                        .filter(|l| l.starts_with("kubeproxy_network_programming_duration_seconds"))
                        .collect::<Vec<_>>()
                        .join("\n"),
                )
            })
        }
    }

    /// A change triggered at 10 s and programmed at 12.3 s is one observation of 2.3 s: in the
    /// 3 s bucket, not the 2 s one.
    #[tokio::test(start_paused = true)]
    async fn an_observation_lands_in_its_bucket() {
        let mut l = Latency::start().await;
        assert_eq!(l.histogram().0, 0, "the examples carry no trigger times");
        l.set_clock(at(12.3));
        l.add_shop_endpoint("10.244.3.30", "2026-01-01T00:00:10Z")
            .await;
        wait_syncs(&mut l.syncs, 2).await;
        let (count, text) = l.histogram();
        assert_eq!(count, 1, "{text}");
        let name = "kubeproxy_network_programming_duration_seconds";
        for line in [
            format!("{name}_bucket{{ip_family=\"IPv4\",le=\"2\"}} 0"),
            format!("{name}_bucket{{ip_family=\"IPv4\",le=\"3\"}} 1"),
            format!("{name}_bucket{{ip_family=\"IPv4\",le=\"+Inf\"}} 1"),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        let sum: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}_sum{{ip_family=\"IPv4\"}} ")))
            .and_then(|v| v.parse().ok())
            .expect("a sum line");
        assert!((sum - 2.3).abs() < 1e-6, "{sum}");
    }

    /// A change whose real server the kernel refuses is not observed by the failed sync, nor by
    /// a later incremental sync of another change; it is observed by the retry that applies
    /// it, with the latency up to that retry.
    #[tokio::test(start_paused = true)]
    async fn a_failed_change_is_observed_when_its_retry_succeeds() {
        let mut l = Latency::start().await;
        l.kernel.state().fail_new_dests = true;
        l.set_clock(at(11.0));
        l.add_shop_endpoint("10.244.3.30", "2026-01-01T00:00:10Z")
            .await;
        wait_syncs(&mut l.syncs, 2).await;
        assert_eq!(l.histogram().0, 0, "the sync failed: {}", l.histogram().1);
        assert_eq!(l.shared.with_metrics(|m| m.pending_retries), 1);
        // Another Service's change (no new real server, so the kernel takes it) is observed
        // by its incremental sync (1 s at 12 s); shop's stays pending.
        l.set_clock(at(12.0));
        l.change_slice(
            "dns-q9w2e",
            |s| {
                s.endpoints.remove(1);
            },
            "2026-01-01T00:00:11Z",
        )
        .await;
        wait_syncs(&mut l.syncs, 3).await;
        assert_eq!(l.histogram().0, 1, "dns's change: {}", l.histogram().1);
        // Still failing: the retry fails too and observes nothing.
        wait_syncs(&mut l.syncs, 4).await;
        assert_eq!(l.histogram().0, 1, "the retry failed: {}", l.histogram().1);
        // Now the kernel takes it; the next retry applies shop's change at 40 s.
        l.kernel.state().fail_new_dests = false;
        l.set_clock(at(40.0));
        wait_syncs(&mut l.syncs, 5).await;
        let (count, text) = l.histogram();
        assert_eq!(count, 2, "{text}");
        let name = "kubeproxy_network_programming_duration_seconds";
        assert!(
            text.lines()
                .any(|x| x == format!("{name}_bucket{{ip_family=\"IPv4\",le=\"1\"}} 1"))
                && text
                    .lines()
                    .any(|x| x == format!("{name}_bucket{{ip_family=\"IPv4\",le=\"29\"}} 1"))
                && text
                    .lines()
                    .any(|x| x == format!("{name}_bucket{{ip_family=\"IPv4\",le=\"30\"}} 2")),
            "{text}"
        );
        assert_eq!(l.shared.with_metrics(|m| m.pending_retries), 0);
    }

    /// Polls `cond` until it holds, failing the test after 10 s.
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "{what}: not within 10 s");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Holds the next reconcile read of an agent started with background reads and a short
    /// period, once it has taken its snapshot: the loop goes on while the read waits.
    #[expect(
        clippy::await_holding_lock,
        reason = "the guard holds the reader thread, not this task, while the loop runs"
    )]
    async fn hold_a_read<'g>(gate: &'g MemKernel) -> std::sync::MutexGuard<'g, ()> {
        let held = gate.hold_reads();
        until("a reconcile's read to wait", || {
            gate.state().reads_waiting == 1
        })
        .await;
        held
    }

    /// How many full syncs have finished.
    fn full_syncs(shared: &Shared) -> u64 {
        shared.with_metrics(|m| m.full_sync_duration.count())
    }

    /// Kernel errors, drift repaired and pending retries, as the metrics count them.
    fn trouble(shared: &Shared) -> (u64, u64, u64) {
        shared.with_metrics(|m| (m.kernel_errors, m.drift_repaired, m.pending_retries))
    }

    /// Full syncs, and reconciles that matched the kernel by fingerprint (counted together).
    fn matched(shared: &Shared) -> (u64, u64) {
        shared.with_metrics(|m| {
            (
                m.full_sync_duration.count(),
                m.reconcile_fingerprint_matches,
            )
        })
    }

    /// The real servers of the shop Service's ClusterIP virtual server in the in-memory kernel.
    fn shop_dests(k: &MemKernel) -> Vec<IpAddr> {
        k.state()
            .table
            .services
            .get(&key(Protocol::Tcp, "10.96.0.30", 80))
            .map(|e| e.dests.keys().map(|d| d.addr).collect())
            .unwrap_or_default()
    }

    /// A change programmed while a reconcile's background read is under way is neither undone
    /// nor counted as drift when the read, taken before it, comes back: the reconcile repairs
    /// nothing and fails nothing. (Diffing against the read as it is re-adds the new real
    /// server, which the kernel refuses: a kernel error and a retry.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[expect(
        clippy::await_holding_lock,
        reason = "the guard holds the reader thread, not this task, while the loop runs"
    )]
    async fn a_change_made_during_a_background_read_is_not_undone_by_the_reconcile() {
        let mut l = Latency::start_with(Duration::from_millis(200), true).await;
        let before = shop_dests(&l.kernel);
        assert!(
            !before.is_empty(),
            "the example's shop Service has endpoints"
        );
        let gate = l.kernel.clone();
        let held = hold_a_read(&gate).await;
        let full = full_syncs(&l.shared);
        let (syncs, matches) = matched(&l.shared);
        l.add_shop_endpoint_programmed("10.244.3.30", "2026-01-01T00:00:10Z")
            .await;
        drop(held);
        until("the reconcile of the read taken before the change", || {
            full_syncs(&l.shared) > full
        })
        .await;
        assert_eq!(trouble(&l.shared), (0, 0, 0));
        // The read, with the changed virtual server read again, has the desired table's
        // fingerprint: nothing was diffed (nor in any reconcile since).
        let (now, matched_now) = matched(&l.shared);
        assert!(now > syncs);
        assert_eq!(matched_now - matches, now - syncs);
        assert!(shop_dests(&l.kernel).contains(&ip("10.244.3.30")));
        assert_eq!(shop_dests(&l.kernel).len(), before.len() + 1);
        // The changed virtual server was read again by the reader, not on the loop.
        let shop = key(Protocol::Tcp, "10.96.0.30", 80);
        let reads = l.kernel.state().service_reads.clone();
        assert!(
            reads
                .iter()
                .any(|(thread, keys)| thread == "kernel-reader" && keys.contains(&shop)),
            "{reads:?}"
        );
        assert!(
            !reads
                .iter()
                .any(|(thread, keys)| thread != "kernel-reader" && keys.contains(&shop)),
            "{reads:?}"
        );
    }

    /// A change programmed during a held whole read and another during the held re-read of
    /// the first, with at most `loop_rereads` virtual servers re-read on the loop: checks that
    /// the reconcile neither undoes them nor counts them as drift and that it matched by
    /// fingerprint, and returns how many times the reader and the loop read the shop's
    /// virtual server.
    #[expect(
        clippy::await_holding_lock,
        reason = "the guards hold the reader thread, not this task, while the loop runs"
    )]
    async fn change_during_both_reads(loop_rereads: usize) -> (usize, usize) {
        let mut l =
            Latency::start_with_loop_rereads(Duration::from_millis(200), loop_rereads).await;
        let gate = l.kernel.clone();
        let held = hold_a_read(&gate).await;
        let full = full_syncs(&l.shared);
        l.add_shop_endpoint_programmed("10.244.3.30", "2026-01-01T00:00:10Z")
            .await;
        let second = gate.hold_service_reads();
        drop(held);
        until("the reader to read the shop virtual server again", || {
            gate.state().service_reads_waiting == 1
        })
        .await;
        l.add_shop_endpoint_programmed("10.244.3.31", "2026-01-01T00:00:11Z")
            .await;
        let (syncs, matches) = matched(&l.shared);
        drop(second);
        until("the reconcile", || full_syncs(&l.shared) > full).await;
        assert_eq!(trouble(&l.shared), (0, 0, 0));
        let (now, matched_now) = matched(&l.shared);
        assert!(now > syncs);
        assert_eq!(matched_now - matches, now - syncs, "matched by fingerprint");
        let dests = shop_dests(&l.kernel);
        assert!(dests.contains(&ip("10.244.3.30")) && dests.contains(&ip("10.244.3.31")));
        let shop = key(Protocol::Tcp, "10.96.0.30", 80);
        let reads = l.kernel.state().service_reads.clone();
        let on = |reader: bool| {
            reads
                .iter()
                .filter(|(thread, keys)| {
                    (thread == "kernel-reader") == reader && keys.contains(&shop)
                })
                .count()
        };
        (on(true), on(false))
    }

    /// A change programmed while the reader reads again the virtual servers changed during
    /// its whole read is read once more on the loop: the reconcile neither undoes it nor
    /// counts it as drift.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_made_while_changed_virtual_servers_are_read_again_is_read_on_the_loop() {
        assert_eq!(change_during_both_reads(LOOP_REREADS).await, (1, 1));
    }

    /// With no virtual server to be read again on the loop, one changed while the reader reads
    /// again those changed during its whole read goes back to the reader for another round:
    /// the loop reads nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_during_a_re_read_go_back_to_the_reader_above_the_loop_s_share() {
        assert_eq!(change_during_both_reads(0).await, (2, 0));
    }

    /// Under churn, the reconcile takes the engine's word for a virtual server the loop changed
    /// during its read, reading it neither on the reader nor on the loop; the next reconcile
    /// during whose read the loop changes it again reads it (no second time on the engine's
    /// word), and so repairs drift there that the first one could not see.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[expect(
        clippy::await_holding_lock,
        reason = "the guard holds the reader thread, not this task, while the loop runs"
    )]
    async fn a_virtual_server_changed_during_two_reads_is_read_by_the_second_reconcile() {
        // A period long enough for the second hold to be in place before the next read (a
        // reconcile between the two would read the shop and end its deferral).
        let mut l = Latency::start_deferring(Duration::from_secs(3)).await;
        let shop = key(Protocol::Tcp, "10.96.0.30", 80);
        let read_shop = |k: &MemKernel| {
            k.state()
                .service_reads
                .iter()
                .filter(|(_, keys)| keys.contains(&shop))
                .count()
        };
        let gate = l.kernel.clone();

        let held = hold_a_read(&gate).await;
        let full = full_syncs(&l.shared);
        let (syncs, matches) = matched(&l.shared);
        l.add_shop_endpoint_programmed("10.244.3.30", "2026-01-01T00:00:10Z")
            .await;
        drop(held);
        until("the first reconcile", || full_syncs(&l.shared) > full).await;
        assert_eq!(trouble(&l.shared), (0, 0, 0));
        let (now, matched_now) = matched(&l.shared);
        assert_eq!(
            (now - syncs, matched_now - matches),
            (1, 1),
            "one reconcile, matched by fingerprint"
        );
        assert_eq!(read_shop(&l.kernel), 0, "the shop was read again");

        let held = hold_a_read(&gate).await;
        let full = full_syncs(&l.shared);
        l.add_shop_endpoint_programmed("10.244.3.31", "2026-01-01T00:00:11Z")
            .await;
        // Drift in the shop virtual server after the loop's change: only a read sees it.
        if let Some(e) = l.kernel.state().table.services.get_mut(&shop) {
            e.dests.retain(|d, _| d.addr != ip("10.244.3.30"));
        }
        assert!(!shop_dests(&l.kernel).contains(&ip("10.244.3.30")));
        drop(held);
        until("the second reconcile", || full_syncs(&l.shared) > full).await;
        assert_eq!(full_syncs(&l.shared), full + 1, "one reconcile");
        assert_eq!(trouble(&l.shared), (0, 1, 0), "the drift repaired");
        assert!(shop_dests(&l.kernel).contains(&ip("10.244.3.30")));
        assert_eq!(read_shop(&l.kernel), 1, "the shop read again once");
    }

    /// The engine's word is taken without building its entries when the fingerprint with it is
    /// the desired table's (drift inside a virtual server taken on its word is the engine's word's
    /// to override, as when built); drift anywhere else, or a change waiting to be synced, has
    /// the entries built, so the reconcile's diff sees them.
    #[test]
    fn the_engine_s_word_is_built_only_when_the_fingerprints_differ() {
        let cs = examples_change_set();
        let period = Duration::from_secs(3600);
        let inputs = Inputs::new(kube_ipvs_diff::NodeContext::new("node-1")).expect("valid node");
        let kernel = MemKernel::default();
        let mut agent = Agent::new(
            kernel.clone(),
            inputs,
            AgentConfig::every(period),
            Arc::new(Shared::new(period)),
        );
        agent.take(cs);
        agent.full_sync(SyncKind::Startup);
        let keys: Vec<VirtualKey> = kernel.state().table.services.keys().copied().collect();
        assert!(keys.len() >= 3, "{keys:?}");
        let defer = BTreeSet::from([keys[0], keys[1]]);
        let owned = Owned::of(&agent.inputs.node().options);
        let drop_a_dest = |k: &VirtualKey| {
            let mut state = kernel.state();
            let e = state.table.services.get_mut(k).expect("held");
            let first = *e.dests.keys().next().expect("a real server");
            e.dests.remove(&first);
        };

        // In sync, and drift only inside a virtual server taken on the word: not built.
        drop_a_dest(&keys[0]);
        let mut read = read_whole(&mut agent.kernel, owned.clone(), false).expect("read");
        let found = read.observed.table.services.get(&keys[0]).cloned();
        agent
            .take_engine_word(&mut read, defer.clone())
            .expect("no read");
        assert_eq!(read.word, defer);
        assert_eq!(
            read.observed.table.services.get(&keys[0]).cloned(),
            found,
            "not built"
        );
        assert!(
            agent
                .engine
                .holds_desired(&agent.inputs, read.fingerprint.1)
        );

        // Drift in another virtual server: built, so the diff sees both.
        drop_a_dest(&keys[2]);
        let mut read = read_whole(&mut agent.kernel, owned.clone(), false).expect("read");
        agent
            .take_engine_word(&mut read, defer.clone())
            .expect("no read");
        assert!(read.word.is_empty());
        assert_eq!(
            read.observed.table.services.get(&keys[0]).cloned(),
            agent.engine.asked_entry(&keys[0]),
            "built"
        );
        assert_eq!(
            read.fingerprint.1,
            Fingerprint::of_table(&read.observed.table, owned.view())
        );
    }

    /// Above the threshold, only the virtual servers the last reconcile took on the engine's
    /// word are read again; while a failed operation waits for its retry (or a failed change
    /// for a clean full sync), every one is read again, since the engine's word may hold what
    /// the kernel refused before the read began.
    #[test]
    fn the_engine_s_word_is_not_taken_while_a_failed_operation_waits() {
        let period = Duration::from_secs(30);
        let inputs = Inputs::new(kube_ipvs_diff::NodeContext::new("node-1")).expect("valid node");
        let mut agent = Agent::new(
            MemKernel::default(),
            inputs,
            AgentConfig::every(period),
            Arc::new(Shared::new(period)),
        );
        agent.defer_above = 1;
        let (a, b, c) = (
            key(Protocol::Tcp, "10.96.0.1", 80),
            key(Protocol::Tcp, "10.96.0.2", 80),
            key(Protocol::Udp, "10.96.0.3", 53),
        );
        let touched = BTreeSet::from([a, b, c]);
        let none = BTreeSet::new();
        agent.deferred = BTreeSet::from([a]);
        assert_eq!(
            agent.split_touched(touched.clone()),
            (BTreeSet::from([a]), BTreeSet::from([b, c]))
        );
        assert_eq!(
            agent.split_touched(BTreeSet::from([a])),
            (BTreeSet::from([a]), none.clone()),
            "at the threshold"
        );
        agent.retry.insert(
            "default/shop".to_owned(),
            Pending {
                attempts: 1,
                due: Instant::now(),
            },
        );
        assert_eq!(
            agent.split_touched(touched.clone()),
            (touched.clone(), none.clone())
        );
        agent.retry.clear();
        agent
            .unprogrammed
            .insert(ServiceName::new("default", "shop"));
        assert_eq!(
            agent.split_touched(touched.clone()),
            (touched.clone(), none.clone())
        );
        agent.unprogrammed.clear();
        agent.unprogrammed_unknown = true;
        assert_eq!(agent.split_touched(touched.clone()), (touched, none));
    }

    /// A background read during which a virtual server came may have skipped another in the
    /// kernel's positional dump: it is discarded and the kernel read again, so the one it
    /// skipped is not "repaired". (Diffing against it re-adds the skipped virtual server,
    /// which the kernel refuses.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[expect(
        clippy::await_holding_lock,
        reason = "the guard holds the reader thread, not this task, while the loop runs"
    )]
    async fn a_read_during_which_a_virtual_server_came_is_read_again() {
        let mut l = Latency::start_with(Duration::from_millis(200), true).await;
        let shop = key(Protocol::Tcp, "10.96.0.30", 80);
        let skipped = *l
            .kernel
            .state()
            .table
            .services
            .keys()
            .find(|k| **k != shop)
            .expect("the examples have other virtual servers");
        let gate = l.kernel.clone();
        let held = hold_a_read(&gate).await;
        let (reads, full) = (l.kernel.state().reads, full_syncs(&l.shared));
        // The held read will answer without `skipped`, as a dump overtaken by an add can.
        l.kernel.state().omit_from_read = Some(skipped);
        // A new port on the shop Service: a new virtual server.
        let mut svc = examples()
            .services
            .into_iter()
            .find(|s| s.metadata.name.as_deref() == Some("shop"))
            .expect("the example has shop");
        let spec = svc.spec.as_mut().expect("spec");
        let mut port = spec.ports.as_ref().expect("ports")[0].clone();
        port.name = Some("extra".to_owned());
        port.port = 8443;
        port.node_port = None;
        spec.ports.as_mut().expect("ports").push(port);
        l.tracker.apply_service(&svc);
        let cs = l.tracker.take_change_set().expect("the Service changed");
        l.changes.send(cs).await.expect("send");
        let extra = key(Protocol::Tcp, "10.96.0.30", 8443);
        until(
            "the new virtual server programmed while the read waits",
            || l.kernel.state().table.services.contains_key(&extra),
        )
        .await;
        drop(held);
        until("the reconcile", || full_syncs(&l.shared) > full).await;
        assert_eq!(trouble(&l.shared), (0, 0, 0));
        assert!(
            l.kernel.state().reads > reads,
            "the kernel was read again after the held read"
        );
        assert!(l.kernel.state().table.services.contains_key(&skipped));
    }

    fn key(protocol: Protocol, addr: &str, port: u16) -> VirtualKey {
        VirtualKey::Inet {
            protocol,
            addr: ip(addr),
            port,
        }
    }

    /// kube-proxy's no-local-endpoints gauge: a Local-policy Service counts under each Local
    /// policy that applies to it while none of its serving endpoints is on this node.
    #[test]
    fn local_policy_services_without_a_local_endpoint_are_counted_per_policy() {
        use kube_ipvs_diff::{Endpoint, Protocol, ServiceInfo, ServiceKind, ServicePort};
        let mut inputs = Inputs::new(kube_ipvs_diff::NodeContext::new("node-1")).expect("node");
        let svc = |kind, internal, external| ServiceInfo {
            kind,
            cluster_ips: vec![ip("10.96.0.1")],
            ports: vec![ServicePort {
                name: String::new(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: (kind == ServiceKind::NodePort).then_some(30080),
            }],
            internal_traffic_policy: internal,
            external_traffic_policy: external,
            ..ServiceInfo::default()
        };
        let on = |node: &str| Endpoint {
            node_name: Some(node.into()),
            ..Endpoint::ready(ip("10.244.1.5"), Vec::new())
        };
        use kube_ipvs_diff::TrafficPolicy::{Cluster, Local};
        for (name, info, node) in [
            ("both", svc(ServiceKind::NodePort, Local, Local), "node-2"),
            (
                "internal",
                svc(ServiceKind::ClusterIp, Local, Local),
                "node-2",
            ),
            ("served", svc(ServiceKind::NodePort, Local, Local), "node-1"),
            (
                "cluster",
                svc(ServiceKind::NodePort, Cluster, Cluster),
                "node-2",
            ),
        ] {
            let n = ServiceName::new("default", name);
            inputs.upsert_service(n.clone(), info).expect("valid");
            inputs.set_endpoints(n, vec![on(node)]).expect("valid");
        }
        // "both" counts twice; "internal" is not reachable from outside; "served" has one here.
        assert_eq!(no_local_endpoints(&inputs), [2, 1]);
    }

    #[test]
    fn only_applied_udp_deletes_call_for_conntrack_cleanup() {
        let dest = |a: &str| DestKey {
            addr: ip(a),
            port: 53,
        };
        let udp = key(Protocol::Udp, "10.96.0.10", 53);
        let tcp = key(Protocol::Tcp, "10.96.0.10", 53);
        let failed = Op::DeleteDest {
            service: udp,
            dest: dest("10.244.1.7"),
        };
        let ops = vec![
            Op::DeleteDest {
                service: udp,
                dest: dest("10.244.1.5"),
            },
            Op::DeleteDest {
                service: tcp,
                dest: dest("10.244.1.6"),
            },
            failed.clone(),
            Op::DeleteService(key(Protocol::Udp, "10.96.0.11", 5353)),
            Op::DeleteService(tcp),
            Op::RemoveAddress(ip("10.96.0.11")),
        ];
        let failures = vec![apply::Failure {
            op: failed,
            services: Vec::new(),
            error: "EBUSY".into(),
            errno: None,
        }];
        assert_eq!(
            udp_flushes(&ops, &failures),
            vec![
                UdpFlush::Endpoint(ip("10.244.1.5"), 53),
                UdpFlush::Service(ip("10.96.0.11"), 5353),
            ]
        );
    }
}
