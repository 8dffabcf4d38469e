//! The API-server source: kube-rs watchers for Services, EndpointSlices and this node's Node,
//! with backoff, feeding the shared [`driver`](crate::driver).
//!
//! It owns the watch configuration (selectors, backoff); it must not interpret objects, which
//! is the translation's job, nor talk to the kernel.

use std::time::Duration;

use futures::Stream;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::mpsc;

use crate::driver::{DriverStats, WatchItem, drive};
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
    watcher(api, wc.page_size(cfg.page_size))
        .backoff(ExpBackoff::new(cfg.backoff_min, cfg.backoff_max))
}

/// The three watch streams for `cfg`.
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
        Api::<Service>::all(client.clone()),
        watcher::Config::default().labels(&selector),
        cfg,
    );
    let slices = watch(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL},{selector}")),
        cfg,
    );
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
    let task = tokio::spawn(drive(
        tracker,
        services,
        slices,
        node,
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
