//! The event loop shared by both sources: it feeds watcher events into the [`Tracker`] and hands
//! out change sets no more often than a minimum interval.
//!
//! It owns coalescing and the first-sync rule; it must not know where events come from, so the
//! API-server source, the manifest source and paused-time tests all drive the same code.

use std::time::Duration;

use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher::{self, Event};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::tracker::{ChangeSet, Tracker};

/// One item of a watcher stream.
pub type WatchItem<K> = Result<Event<K>, watcher::Error>;

/// Buffers the Node watcher's `InitApply` objects until `InitDone`, as a reflector does, so a
/// relist replaces the state in one step and a half-finished relist changes nothing. (Services
/// and slices are buffered translated, inside the tracker.)
struct Relist<K> {
    buffer: Option<Vec<K>>,
}

impl<K> Relist<K> {
    fn new() -> Self {
        Self { buffer: None }
    }

    /// Feeds one event; returns a complete list at `InitDone`, or the event to apply.
    fn feed(&mut self, ev: Event<K>) -> Step<K> {
        match ev {
            Event::Init => {
                self.buffer = Some(Vec::new());
                Step::Nothing
            }
            Event::InitApply(o) => {
                self.buffer.get_or_insert_with(Vec::new).push(o);
                Step::Nothing
            }
            Event::InitDone => Step::Relisted(self.buffer.take().unwrap_or_default()),
            Event::Apply(o) => Step::Apply(o),
            Event::Delete(o) => Step::Delete(o),
        }
    }
}

enum Step<K> {
    Nothing,
    Relisted(Vec<K>),
    Apply(K),
    Delete(K),
}

/// Counts of what the driver saw, for health reporting and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Watch errors (list failures, dropped watches, 410s) the watchers recovered from.
    pub watch_errors: u64,
    /// Completed relists of Services or EndpointSlices.
    pub relists: u64,
    /// Change sets handed out.
    pub change_sets: u64,
}

/// How many already-queued events a flush takes in before it computes the change set. Large
/// enough for a whole relist of a big cluster, bounded so a flood cannot postpone it forever.
const DRAIN_LIMIT: usize = 100_000;

/// The tracker with the relist buffers and counters: everything an event changes.
struct Core {
    tracker: Tracker,
    node: Relist<Node>,
    counts: DriverStats,
    stats: Option<tokio::sync::watch::Sender<DriverStats>>,
}

impl Core {
    fn publish(&self) {
        if let Some(s) = &self.stats {
            s.send_replace(self.counts);
        }
    }

    fn error(&mut self, what: &str, e: &watcher::Error) {
        self.counts.watch_errors += 1;
        self.publish();
        tracing::warn!("watch of {what} failed, keeping the last good state and retrying: {e}");
    }

    fn relisted(&mut self) {
        self.counts.relists += 1;
        self.publish();
    }

    // Services and slices go to the tracker one object at a time, also during a relist (it
    // translates each on arrival and applies the whole list at `InitDone`), so no list of raw
    // objects is ever held: at 10,000 Services that buffer was larger than the model.
    fn on_service(&mut self, item: WatchItem<Service>) {
        match item {
            Ok(Event::Init) => self.tracker.begin_services(),
            Ok(Event::InitApply(o)) => self.tracker.list_service(&o),
            Ok(Event::InitDone) => {
                self.tracker.end_services();
                self.relisted();
            }
            Ok(Event::Apply(o)) => {
                log_taken_in("Service", &o.metadata);
                self.tracker.apply_service(&o);
            }
            Ok(Event::Delete(o)) => self.tracker.delete_service(&o),
            Err(e) => self.error("Services", &e),
        }
    }

    fn on_slice(&mut self, item: WatchItem<EndpointSlice>) {
        match item {
            Ok(Event::Init) => self.tracker.begin_slices(),
            Ok(Event::InitApply(o)) => self.tracker.list_slice(&o),
            Ok(Event::InitDone) => {
                self.tracker.end_slices();
                self.relisted();
            }
            Ok(Event::Apply(o)) => {
                log_taken_in("EndpointSlice", &o.metadata);
                self.tracker.apply_slice(&o);
            }
            Ok(Event::Delete(o)) => self.tracker.delete_slice(&o),
            Err(e) => self.error("EndpointSlices", &e),
        }
    }

    fn on_node(&mut self, item: WatchItem<Node>) {
        match item {
            Ok(ev) => match self.node.feed(ev) {
                // A missing Node keeps the last known zone and addresses.
                Step::Relisted(list) => {
                    if let Some(n) = list.last() {
                        self.tracker.apply_node(n);
                    }
                }
                Step::Apply(n) => self.tracker.apply_node(&n),
                Step::Nothing | Step::Delete(_) => {}
            },
            Err(e) => self.error("the Node", &e),
        }
    }
}

/// A debug line for each changed object as the watch hands it over (not for a relist's): with
/// the agent's own lines after it, it splits an update's latency into the way to the agent
/// and the agent's part.
fn log_taken_in(kind: &str, meta: &ObjectMeta) {
    tracing::debug!(
        "{kind} {}/{} taken in (resourceVersion {})",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default(),
        meta.resource_version.as_deref().unwrap_or_default()
    );
}

/// Runs until the receiver is dropped or every input stream ends. Change sets are sent at most
/// once per `min_interval`; the first only after both Services and EndpointSlices were listed.
/// Before a change set is computed, every event already queued is taken in, so one reload or
/// one burst lands in one change set. Watch errors are logged and change nothing: the
/// watchers retry with backoff, and until they succeed the last good state stands.
pub async fn drive<S1, S2, S3>(
    tracker: Tracker,
    services: S1,
    slices: S2,
    node: S3,
    min_interval: Duration,
    tx: mpsc::Sender<ChangeSet>,
    stats: Option<tokio::sync::watch::Sender<DriverStats>>,
) where
    S1: Stream<Item = WatchItem<Service>> + Send,
    S2: Stream<Item = WatchItem<EndpointSlice>> + Send,
    S3: Stream<Item = WatchItem<Node>> + Send,
{
    let mut services = std::pin::pin!(services.fuse());
    let mut slices = std::pin::pin!(slices.fuse());
    let mut node = std::pin::pin!(node.fuse());
    let mut core = Core {
        tracker,
        node: Relist::new(),
        counts: DriverStats::default(),
        stats,
    };
    let mut last_sent: Option<Instant> = None;
    // When the oldest change not yet sent was taken in (for the debug log of each change set).
    let mut pending_since: Option<Instant> = None;
    // The Node's deadline: the first change set waits for it until then.
    let node_wait = core.tracker.node_awaited();
    let node_deadline = node_wait.map(|w| Instant::now() + w);
    loop {
        let pending = core.tracker.has_pending();
        if pending && pending_since.is_none() {
            pending_since = Some(Instant::now());
        }
        let due = pending.then(|| last_sent.map_or_else(Instant::now, |t| t + min_interval));
        tokio::select! {
            // The timer comes first so a steady stream of events cannot starve the flush.
            biased;
            () = sleep_until_opt(due), if due.is_some() => {
                // Without the runtime's cooperative budget: each receive from a channel spends
                // it, and once it is spent a queued item looks absent, which would cut the
                // drain short and split a burst over two change sets.
                tokio::task::unconstrained(async {
                    for _ in 0..DRAIN_LIMIT {
                        let mut progressed = false;
                        if let Some(Some(item)) = services.next().now_or_never() {
                            core.on_service(item);
                            progressed = true;
                        }
                        if let Some(Some(item)) = slices.next().now_or_never() {
                            core.on_slice(item);
                            progressed = true;
                        }
                        if let Some(Some(item)) = node.next().now_or_never() {
                            core.on_node(item);
                            progressed = true;
                        }
                        if !progressed {
                            break;
                        }
                    }
                })
                .await;
                if let Some(cs) = core.tracker.take_change_set() {
                    if let Some(since) = pending_since.take() {
                        tracing::debug!(
                            "change set of {} Services sent {:.1} ms after its first change was \
                             taken in",
                            cs.services.len(),
                            since.elapsed().as_secs_f64() * 1000.0
                        );
                    }
                    if tx.send(cs).await.is_err() {
                        return;
                    }
                    core.counts.change_sets += 1;
                    core.publish();
                }
                last_sent = Some(Instant::now());
            }
            () = sleep_until_opt(node_deadline),
                if node_deadline.is_some() && core.tracker.node_awaited().is_some() =>
            {
                core.tracker.stop_awaiting_node();
                tracing::warn!(
                    "this node's Node object did not arrive within {:?}: syncing without it \
                     (no zone for topology hints, NodePort `primary` addresses unknown) until it does",
                    node_wait.unwrap_or_default()
                );
            }
            Some(item) = services.next() => core.on_service(item),
            Some(item) = slices.next() => core.on_slice(item),
            Some(item) = node.next() => core.on_node(item),
            else => return,
        }
    }
}

async fn sleep_until_opt(due: Option<Instant>) {
    // A deadline already passed returns at once: the timer wheel would round it up to its
    // next 1 ms tick, which is most of the latency of a single event.
    if let Some(d) = due.filter(|d| *d > Instant::now()) {
        tokio::time::sleep_until(d).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::TranslateOptions;
    use k8s_openapi::api::core::v1::ServiceSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube_ipvs_diff::ServiceName;

    fn svc(name: &str, ip: &str) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some(ip.into()),
                ports: Some(vec![k8s_openapi::api::core::v1::ServicePort {
                    port: 80,
                    ..Default::default()
                }]),
                ..ServiceSpec::default()
            }),
            status: None,
        }
    }

    type Tx<K> = mpsc::UnboundedSender<WatchItem<K>>;

    struct Harness {
        svc: Tx<Service>,
        slices: Tx<EndpointSlice>,
        _node: Tx<Node>,
        out: mpsc::Receiver<ChangeSet>,
    }

    fn start(min_interval: Duration) -> Harness {
        let (svc, svc_rx) = mpsc::unbounded_channel();
        let (slices, slice_rx) = mpsc::unbounded_channel();
        let (node, node_rx) = mpsc::unbounded_channel();
        let (tx, out) = mpsc::channel(16);
        let as_stream = |rx| tokio_stream_from(rx);
        tokio::spawn(drive(
            Tracker::new(TranslateOptions::default()),
            as_stream(svc_rx),
            tokio_stream_from(slice_rx),
            tokio_stream_from(node_rx),
            min_interval,
            tx,
            None,
        ));
        Harness {
            svc,
            slices,
            _node: node,
            out,
        }
    }

    fn tokio_stream_from<T: Send + 'static>(
        rx: mpsc::UnboundedReceiver<T>,
    ) -> impl Stream<Item = T> + Send {
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
    }

    fn list<K>(tx: &Tx<K>, objs: Vec<K>) {
        let _ = tx.send(Ok(Event::Init));
        for o in objs {
            let _ = tx.send(Ok(Event::InitApply(o)));
        }
        let _ = tx.send(Ok(Event::InitDone));
    }

    /// Sends `n` Services (`s0`, `s1`, ...) as watch events, all at once.
    fn apply_services(tx: &Tx<Service>, n: usize) {
        for i in 0..n {
            let _ = tx.send(Ok(Event::Apply(svc(&format!("s{i}"), "10.96.0.2"))));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn first_change_set_waits_for_both_lists() {
        let mut h = start(Duration::from_millis(100));
        list(&h.svc, vec![svc("web", "10.96.0.1")]);
        // Let the driver run; with paused time, timers fire as soon as everything is idle.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            h.out.try_recv().is_err(),
            "no change set before EndpointSlices are listed"
        );
        list(&h.slices, vec![]);
        let cs = h.out.recv().await.expect("a change set");
        assert!(cs.initial);
        assert_eq!(
            cs.services.keys().cloned().collect::<Vec<_>>(),
            vec![ServiceName::new("default", "web")]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn events_within_the_minimum_interval_are_coalesced() {
        let mut h = start(Duration::from_secs(1));
        list(&h.svc, vec![]);
        list(&h.slices, vec![]);
        let first = h.out.recv().await.expect("initial change set");
        let t0 = Instant::now();
        assert!(first.services.is_empty());
        apply_services(&h.svc, 5);
        let cs = h.out.recv().await.expect("change set");
        assert_eq!(cs.services.len(), 5, "all five in one change set");
        assert!(
            Instant::now() - t0 >= Duration::from_secs(1),
            "not before the minimum interval"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_takes_in_a_whole_burst_past_the_runtime_s_budget() {
        let mut h = start(Duration::ZERO);
        list(&h.svc, vec![]);
        list(&h.slices, vec![]);
        let _ = h.out.recv().await.expect("initial change set");
        // Queued at once: the first wakes the flush, which takes in the rest. Each receive
        // spends the task's budget (128 per poll); a drain within it stopped after 127.
        apply_services(&h.svc, 300);
        let cs = h.out.recv().await.expect("change set");
        assert_eq!(cs.services.len(), 300, "the whole burst in one change set");
    }

    #[tokio::test(start_paused = true)]
    async fn watch_errors_remove_nothing() {
        let mut h = start(Duration::ZERO);
        list(&h.svc, vec![svc("web", "10.96.0.1")]);
        list(&h.slices, vec![]);
        let _ = h.out.recv().await.expect("initial");
        for _ in 0..3 {
            let _ = h.svc.send(Err(watcher::Error::NoResourceVersion));
        }
        // A relist that starts but never finishes (the server went away mid-list) changes nothing.
        let _ = h.svc.send(Ok(Event::Init));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(h.out.try_recv().is_err(), "errors produced a change set");
        // When the relist completes without the Service, the API has said it is gone.
        let _ = h.svc.send(Ok(Event::InitDone));
        let cs = h.out.recv().await.expect("change set");
        assert_eq!(
            cs.services.get(&ServiceName::new("default", "web")),
            Some(&crate::tracker::ServiceChange::default())
        );
    }
}
