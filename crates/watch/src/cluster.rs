//! The API-server source: kube-rs watchers for Services, EndpointSlices and this node's Node,
//! with backoff, feeding the shared [`driver`](crate::driver).
//!
//! It owns the watch configuration (selectors, backoff); it must not interpret objects, which
//! is the translation's job, nor talk to the kernel.

use std::time::Duration;

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher;
use kube::runtime::watcher::Event;
use kube::{Api, Client};
use tokio::sync::mpsc;

use crate::driver::{DriverStats, WatchItem, drive};
use crate::lean::{LeanService, LeanSlice};
use crate::tracker::{ChangeSet, Tracker};
use crate::translate::{SERVICE_NAME_LABEL, TranslateOptions};

/// How to watch the cluster.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// This node's name; its Node object gives the zone and NodePort addresses. `None` skips
    /// the Node watch.
    pub node_name: Option<String>,
    /// Which Services are ours (`--service-proxy-name`).
    pub translate: TranslateOptions,
    /// The minimum interval between change sets (kube-proxy's `--min-sync-period`).
    pub min_interval: Duration,
    /// The first retry delay after a watch error; doubled per failure up to `backoff_max`.
    pub backoff_min: Duration,
    /// The longest retry delay.
    pub backoff_max: Duration,
    /// List page size.
    pub page_size: u32,
    /// How long the first change set waits for this node's Node object (with `node_name`),
    /// so the first sync already knows the node's zone, addresses and eligibility (kube-proxy
    /// waits 30 s for the Node's addresses before it starts).
    pub node_wait: Duration,
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self {
            node_name: None,
            translate: TranslateOptions::default(),
            min_interval: Duration::from_secs(1),
            // client-go's reflector values.
            backoff_min: Duration::from_millis(800),
            backoff_max: Duration::from_secs(30),
            page_size: 500,
            node_wait: Duration::from_secs(30),
        }
    }
}

/// Exponential backoff without jitter: each agent watches its own objects, so there is no herd
/// to spread, and a deterministic delay keeps tests exact.
#[derive(Debug, Clone)]
pub struct ExpBackoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl ExpBackoff {
    /// Starts at `min`, doubles up to `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            next: min,
        }
    }
}

impl Iterator for ExpBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        Some(d)
    }
}

impl Backoff for ExpBackoff {
    fn reset(&mut self) {
        self.next = self.min;
    }
}

/// [`ExpBackoff`], except after a 410 Gone: the API server answered, and the watcher lists
/// again on its next poll, so that poll comes at once and the doubling starts over. (After an
/// outage the delay has grown to `backoff_max`; without this the relist that follows the first
/// answer would wait that long again.)
///
/// Only the first 410 since the stream last yielded an item is retried at once: should a 410
/// come back without anything in between, the doubling goes on, so a server that answers 410
/// to every attempt is not polled in a tight loop.
#[derive(Debug, Clone)]
pub struct GoneAwareBackoff {
    inner: ExpBackoff,
    /// Set by the watch stream when it yields a 410 error, read by the next backoff.
    gone: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Whether the last delay was a 410's zero (cleared by [`Backoff::reset`], which the stream
    /// calls on every item that is not an error).
    retried_gone: bool,
}

impl GoneAwareBackoff {
    /// The backoff and the flag its stream sets on a 410 (see [`is_gone`]).
    pub fn new(inner: ExpBackoff) -> (Self, std::sync::Arc<std::sync::atomic::AtomicBool>) {
        let gone = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        (
            Self {
                inner,
                gone: gone.clone(),
                retried_gone: false,
            },
            gone,
        )
    }
}

impl Iterator for GoneAwareBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        if self.gone.swap(false, std::sync::atomic::Ordering::SeqCst) && !self.retried_gone {
            self.retried_gone = true;
            self.inner.reset();
            return Some(Duration::ZERO);
        }
        self.inner.next()
    }
}

impl Backoff for GoneAwareBackoff {
    fn reset(&mut self) {
        self.retried_gone = false;
        self.inner.reset();
    }
}

/// Whether a watcher error is the API server's 410 Gone: the resourceVersion to resume from is
/// older than the history it keeps (compacted, or a restarted API server's watch cache), so the
/// watcher must list again.
///
/// Only a 410 event in the watch counts: the watcher lists again after it. A 410 answer to the
/// watch request itself leaves the watcher resuming from the same version, so retrying it at
/// once would only repeat it.
pub fn is_gone(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchError(status) if status.code == 410)
}

fn watch<K>(
    api: Api<K>,
    wc: watcher::Config,
    cfg: &WatchConfig,
) -> impl Stream<Item = WatchItem<K>> + Send + use<K>
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default,
{
    let (backoff, gone) = GoneAwareBackoff::new(ExpBackoff::new(cfg.backoff_min, cfg.backoff_max));
    watcher(api, wc.page_size(cfg.page_size))
        .inspect(move |item| {
            if let Err(e) = item
                && is_gone(e)
            {
                gone.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        })
        .backoff(backoff)
}

/// An event of a lean watch as the event of the object it wraps.
fn unwrap_lean<L: Into<K>, K>(item: WatchItem<L>) -> WatchItem<K> {
    item.map(|ev| match ev {
        Event::Apply(o) => Event::Apply(o.into()),
        Event::Delete(o) => Event::Delete(o.into()),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(o.into()),
        Event::InitDone => Event::InitDone,
    })
}

/// The three watch streams for `cfg`. Services and EndpointSlices are decoded lean (see
/// [`crate::lean`]).
pub fn streams(
    client: &Client,
    cfg: &WatchConfig,
) -> (
    impl Stream<Item = WatchItem<Service>> + Send + use<>,
    impl Stream<Item = WatchItem<EndpointSlice>> + Send + use<>,
    impl Stream<Item = WatchItem<Node>> + Send + use<>,
) {
    let selector = cfg.translate.label_selector();
    let services = watch(
        Api::<LeanService>::all(client.clone()),
        watcher::Config::default().labels(&selector),
        cfg,
    )
    .map(unwrap_lean);
    let slices = watch(
        Api::<LeanSlice>::all(client.clone()),
        watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL},{selector}")),
        cfg,
    )
    .map(unwrap_lean);
    let node = match &cfg.node_name {
        Some(n) => futures::future::Either::Left(watch(
            Api::<Node>::all(client.clone()),
            watcher::Config::default().fields(&format!("metadata.name={n}")),
            cfg,
        )),
        None => futures::future::Either::Right(futures::stream::pending()),
    };
    (services, slices, node)
}

/// How many items a watch task may run ahead of the driver: two pages of a list at the default
/// page size.
const FORWARD_BUFFER: usize = 1000;

/// Runs `stream` on a task in `tasks`, its items passed on through a bounded channel in order.
/// The task ends when the stream does, or at its next item once the returned stream is dropped
/// (a dropped `JoinSet` aborts it first).
fn forward<T, S>(
    tasks: &mut tokio::task::JoinSet<()>,
    stream: S,
) -> impl Stream<Item = T> + Send + use<T, S>
where
    T: Send + 'static,
    S: Stream<Item = T> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(FORWARD_BUFFER);
    tasks.spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if tx.send(item).await.is_err() {
                return;
            }
        }
    });
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

/// The driver over the three watch streams, each run on a task of its own, so the Services'
/// and the slices' pages are fetched and decoded on both of the runtime's threads at once,
/// beside the tracker's translation in the driver (at 50,000 Services the decode is most of the
/// startup's listing). Ends when the driver does, dropping the tasks' set, which aborts them; and
/// when a watch task ends, which a watcher stream only does by panicking: the driver stops with
/// it (the change sets' channel closes, and the agent exits) rather than go on with one kind of
/// object frozen.
async fn drive_watches<S1, S2, S3>(
    tracker: Tracker,
    (services, slices, node): (S1, S2, S3),
    min_interval: Duration,
    tx: mpsc::Sender<ChangeSet>,
    stats: Option<tokio::sync::watch::Sender<DriverStats>>,
) where
    S1: Stream<Item = WatchItem<Service>> + Send + 'static,
    S2: Stream<Item = WatchItem<EndpointSlice>> + Send + 'static,
    S3: Stream<Item = WatchItem<Node>> + Send + 'static,
{
    let mut watches = tokio::task::JoinSet::new();
    let services = forward(&mut watches, services);
    let slices = forward(&mut watches, slices);
    let node = forward(&mut watches, node);
    tokio::select! {
        () = drive(tracker, services, slices, node, min_interval, tx, stats) => {}
        Some(ended) = watches.join_next() => match ended {
            Err(e) if e.is_panic() => {
                tracing::error!("a watch task panicked; the watch stops: {e}");
            }
            _ => tracing::error!("a watch stream ended; the watch stops"),
        },
    }
}

/// A running cluster watch.
pub struct ClusterWatch {
    /// Change sets, in order. Applying each to an `Inputs` keeps it equal to the cluster.
    pub changes: mpsc::Receiver<ChangeSet>,
    /// What the driver has seen so far.
    pub stats: tokio::sync::watch::Receiver<DriverStats>,
    /// The driver task; abort it to stop watching.
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts watching the cluster. Change sets arrive on [`ClusterWatch::changes`]; the first
/// after Services and EndpointSlices have both been listed.
pub fn spawn(client: Client, cfg: WatchConfig) -> ClusterWatch {
    let (tx, changes) = mpsc::channel(16);
    let (stats_tx, stats) = tokio::sync::watch::channel(DriverStats::default());
    // No reflector stores: the raw objects are translated as they arrive and only the model is
    // kept (the tracker's), so memory grows with what the proxy uses, not with the objects.
    let (services, slices, node) = streams(&client, &cfg);
    let mut tracker = Tracker::new(cfg.translate.clone());
    if cfg.node_name.is_some() {
        tracker.await_node(cfg.node_wait);
    }
    let task = tokio::spawn(drive_watches(
        tracker,
        (services, slices, node),
        cfg.min_interval,
        tx,
        Some(stats_tx),
    ));
    ClusterWatch {
        changes,
        stats,
        task,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16) -> Box<kube::core::Status> {
        Box::new(
            serde_json::from_value(serde_json::json!({
                "status": "Failure", "code": code, "reason": "Expired",
                "message": "too old resource version: 248 (268)",
            }))
            .expect("a Status"),
        )
    }

    #[test]
    fn the_backoff_doubles_to_its_cap_and_a_410_is_retried_at_once_from_the_start() {
        let (mut b, gone) = GoneAwareBackoff::new(ExpBackoff::new(
            Duration::from_millis(800),
            Duration::from_secs(30),
        ));
        let first: Vec<Duration> = (&mut b).take(7).collect();
        assert_eq!(
            first.iter().map(Duration::as_millis).collect::<Vec<_>>(),
            [800, 1600, 3200, 6400, 12800, 25600, 30000]
        );
        assert_eq!(b.next(), Some(Duration::from_secs(30)));
        gone.store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(b.next(), Some(Duration::ZERO));
        // The flag is spent, and the doubling starts over.
        assert_eq!(b.next(), Some(Duration::from_millis(800)));
        // A 410 again with nothing in between: no second zero, the doubling goes on.
        gone.store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(b.next(), Some(Duration::from_millis(1600)));
        // Once the stream yielded an item (reset), a 410 is retried at once again.
        b.reset();
        gone.store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(b.next(), Some(Duration::ZERO));
    }

    #[tokio::test]
    async fn a_watch_task_that_panics_stops_the_driver_and_closes_the_change_sets() {
        let services =
            futures::stream::poll_fn(|_| -> std::task::Poll<Option<WatchItem<Service>>> {
                panic!("a watcher stream panics")
            });
        let slices = futures::stream::pending::<WatchItem<EndpointSlice>>();
        let node = futures::stream::pending::<WatchItem<Node>>();
        let (tx, mut changes) = mpsc::channel(16);
        let driver = tokio::spawn(drive_watches(
            Tracker::new(crate::translate::TranslateOptions::default()),
            (services, slices, node),
            Duration::ZERO,
            tx,
            None,
        ));
        assert!(
            changes.recv().await.is_none(),
            "the change sets' channel closes"
        );
        driver
            .await
            .expect("the driver ends without panicking itself");
    }

    #[test]
    fn only_a_410_counts_as_gone() {
        assert!(is_gone(&watcher::Error::WatchError(status(410))));
        assert!(!is_gone(&watcher::Error::WatchError(status(500))));
        // A 410 answer to the watch request: the watcher would resume from the same version.
        assert!(!is_gone(&watcher::Error::WatchStartFailed(
            kube::Error::Api(status(410))
        )));
        assert!(!is_gone(&watcher::Error::NoResourceVersion));
    }
}
