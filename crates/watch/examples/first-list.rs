//! How long the cluster watch takes from its start to its first change set (every Service and
//! EndpointSlice listed, decoded and translated) against a real API server, natively: the
//! startup's listing without the guest. Used for before/after figures of the watch's listing
//! (`docs/benchmarks.md`).
//!
//!     cargo run --release -p kube-ipvs-watch --example first-list -- KUBECONFIG [RUNS]

#![allow(
    clippy::print_stdout,
    reason = "a measuring tool: it reports on stdout"
)]

use std::time::{Duration, Instant};

use kube_ipvs_watch::{WatchConfig, cluster};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let kubeconfig = args.next().ok_or("usage: first-list KUBECONFIG [RUNS]")?;
    let runs: usize = args.next().map_or(Ok(3), |r| r.parse())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let config = kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(&kubeconfig)?,
            &kube::config::KubeConfigOptions::default(),
        )
        .await?;
        for run in 1..=runs {
            let client = kube::Client::try_from(config.clone())?;
            let start = Instant::now();
            let mut watch = cluster::spawn(
                client,
                WatchConfig {
                    min_interval: Duration::ZERO,
                    ..WatchConfig::default()
                },
            );
            let first = watch.changes.recv().await.ok_or("the watch ended")?;
            println!(
                "run {run}: {} Services in the first change set after {:.2} s",
                first.services.len(),
                start.elapsed().as_secs_f64()
            );
            watch.task.abort();
        }
        Ok(())
    })
}
