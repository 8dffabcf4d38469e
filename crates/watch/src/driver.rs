//! The event loop shared by both sources: it feeds watcher events into the [`Tracker`] and hands
//! out change sets no more often than a minimum interval.
//!
//! It owns coalescing and the first-sync rule; it must not know where events come from, so the
//! API-server source, the manifest source and paused-time tests all drive the same code.

use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::tracker::{ChangeSet, Tracker};

/// One item of a watcher stream.
pub type WatchItem<K> = Result<Event<K>, watcher::Error>;

/// Buffers a watcher's `InitApply` objects until `InitDone`, as a reflector does, so a relist
/// replaces the state in one step and a half-finished relist changes nothing.
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

/// Runs until the receiver is dropped or every input stream ends. Change sets are sent at most
/// once per `min_interval`; the first only after both Services and EndpointSlices were listed.
/// Watch errors are logged and change nothing: the watchers retry with backoff, and until they
/// succeed the last good state stands.
pub async fn drive<S1, S2, S3>(
    mut tracker: Tracker,
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
    let (mut svc_relist, mut slice_relist, mut node_relist) =
        (Relist::new(), Relist::new(), Relist::new());
    let mut last_sent: Option<Instant> = None;
    let mut counts = DriverStats::default();
    let publish = |c: &DriverStats| {
        if let Some(s) = &stats {
            s.send_replace(*c);
        }
    };
    let on_error = |what: &str, e: &watcher::Error, counts: &mut DriverStats| {
        counts.watch_errors += 1;
        tracing::warn!("watch of {what} failed, keeping the last good state and retrying: {e}");
    };
    loop {
        let due = tracker
            .has_pending()
            .then(|| last_sent.map_or_else(Instant::now, |t| t + min_interval));
        tokio::select! {
            // The timer comes first so a steady stream of events cannot starve the flush.
            biased;
            () = sleep_until_opt(due), if due.is_some() => {
                if let Some(cs) = tracker.take_change_set() {
                    if tx.send(cs).await.is_err() {
                        return;
                    }
                    counts.change_sets += 1;
                    publish(&counts);
                }
                last_sent = Some(Instant::now());
            }
            Some(item) = services.next() => match item {
                Ok(ev) => match svc_relist.feed(ev) {
                    Step::Nothing => {}
                    Step::Relisted(list) => {
                        tracker.relist_services(&list);
                        counts.relists += 1;
                        publish(&counts);
                    }
                    Step::Apply(o) => tracker.apply_service(&o),
                    Step::Delete(o) => tracker.delete_service(&o),
                },
                Err(e) => { on_error("Services", &e, &mut counts); publish(&counts); }
            },
            Some(item) = slices.next() => match item {
                Ok(ev) => match slice_relist.feed(ev) {
                    Step::Nothing => {}
                    Step::Relisted(list) => {
                        tracker.relist_slices(&list);
                        counts.relists += 1;
                        publish(&counts);
                    }
                    Step::Apply(o) => tracker.apply_slice(&o),
                    Step::Delete(o) => tracker.delete_slice(&o),
                },
                Err(e) => { on_error("EndpointSlices", &e, &mut counts); publish(&counts); }
            },
            Some(item) = node.next() => match item {
                Ok(ev) => match node_relist.feed(ev) {
                    Step::Relisted(list) => {
                        // A missing Node keeps the last known zone and addresses.
                        if let Some(n) = list.last() {
                            tracker.apply_node(n);
                        }
                    }
                    Step::Apply(n) => tracker.apply_node(&n),
                    Step::Nothing | Step::Delete(_) => {}
                },
                Err(e) => { on_error("the Node", &e, &mut counts); publish(&counts); }
            },
            else => return,
        }
    }
}

async fn sleep_until_opt(due: Option<Instant>) {
    if let Some(d) = due {
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
        for i in 0..5 {
            let _ = h
                .svc
                .send(Ok(Event::Apply(svc(&format!("s{i}"), "10.96.0.2"))));
        }
        let cs = h.out.recv().await.expect("change set");
        assert_eq!(cs.services.len(), 5, "all five in one change set");
        assert!(
            Instant::now() - t0 >= Duration::from_secs(1),
            "not before the minimum interval"
        );
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
