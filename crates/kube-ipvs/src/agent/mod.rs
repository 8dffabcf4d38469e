//! `kube-ipvs run`: the node agent. It checks its settings, prepares the kernel (modules,
//! sysctls, IPVS timeouts), serves `/healthz`, `/livez`, `/metrics` and each Local-policy
//! Service's `healthCheckNodePort`, watches the desired
//! state (API server or manifests) and runs the sync loop until SIGTERM or SIGINT, which leave
//! the kernel's IPVS table and `kube-ipvs0` in place.
//!
//! Each kind of start-up failure has its own exit code ([`exit`]), so scripts and tests can tell
//! a bad config file from a missing kernel module. The masquerade rules (iptables `nat`) are
//! kept applied by the loop ([`masq`]) unless `--no-masquerade`; trouble with them is logged
//! and counted, never fatal.

pub mod config;
pub mod configz;
pub mod events;
pub mod hcport;
pub mod health;
pub mod masq;
pub mod metrics;
pub mod nodeports;
pub mod sets;
pub mod sync;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kube_ipvs_diff::Inputs;
use kube_ipvs_netlink::ipvs::Timeouts;
use kube_ipvs_netlink::link::DEFAULT_DUMMY;
use kube_ipvs_watch::TranslateOptions;

pub use config::{RunArgs, Settings};

use crate::kernel::RealKernel;
use health::{Routes, Shared};
use sync::{Agent, AgentConfig};

/// Exit codes of `kube-ipvs run`.
pub mod exit {
    /// Stopped by SIGTERM or SIGINT; the kernel state was left in place.
    pub const STOPPED: u8 = 0;
    /// The agent stopped on its own after starting (the desired-state source ended).
    pub const FAILED: u8 = 1;
    /// The config file could not be read or is not a valid `KubeProxyConfiguration` (unknown
    /// key, wrong apiVersion, malformed YAML). (2 is the command line parser's own.)
    pub const CONFIG_FILE: u8 = 3;
    /// A setting has an unusable value (an unknown scheduler, a bad CIDR or duration).
    pub const SETTING: u8 = 4;
    /// The kernel cannot be prepared: a missing module, a sysctl that cannot be set, no IPVS.
    pub const KERNEL: u8 = 5;
    /// Serving or watching could not start (bind address in use, bad kubeconfig, unreadable
    /// manifests).
    pub const START: u8 = 6;
}

/// How often `--manifests` files are checked for changes.
const MANIFEST_POLL: Duration = Duration::from_secs(1);

fn fail(code: u8, msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("kube-ipvs run: {msg}");
    ExitCode::from(code)
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // A second init (tests calling main twice) is harmless; keep the first subscriber.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not in a log file or journal.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Runs `kube-ipvs run`; see [`exit`] for the codes.
pub fn main(args: &RunArgs) -> ExitCode {
    let settings = match Settings::resolve(args) {
        Ok(s) => s,
        Err(e) if e.is_file_error() => return fail(exit::CONFIG_FILE, e),
        Err(e) => return fail(exit::SETTING, e),
    };
    init_logging();
    for w in &settings.warnings {
        tracing::warn!("{w}");
    }
    let kernel = match prepare_kernel(&settings) {
        Ok(k) => k,
        Err(e) => return fail(exit::KERNEL, e),
    };
    if args.init_only {
        tracing::info!("modules, sysctls and IPVS timeouts in place; exiting (--init-only)");
        return ExitCode::SUCCESS;
    }
    if let Some(path) = &settings.source.manifests
        && let Err(e) = kube_ipvs_watch::manifest::load(path)
    {
        return fail(exit::START, e);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(exit::START, format!("starting the runtime: {e}")),
    };
    rt.block_on(serve(settings, kernel))
}

/// Modules, sysctls, the netlink handles and the IPVS timeouts, through the host crate.
fn prepare_kernel(settings: &Settings) -> Result<RealKernel, String> {
    let t = settings.timeouts;
    // Zero leaves the kernel's value for that timeout.
    let ipvs_timeouts =
        (t.tcp.is_some() || t.tcp_fin.is_some() || t.udp.is_some()).then(|| Timeouts {
            tcp: t.tcp.unwrap_or(0),
            tcp_fin: t.tcp_fin.unwrap_or(0),
            udp: t.udp.unwrap_or(0),
        });
    let prepared = kube_ipvs_host::setup::Host::system()
        .prepare(&kube_ipvs_host::setup::Preparation {
            scheduler: &settings.node.default_scheduler,
            strict_arp: settings.strict_arp,
            conntrack: &settings.conntrack,
            no_rate_estimation: settings.no_rate_estimation,
            masquerade: settings.masquerade,
            ipvs_timeouts,
        })
        .map_err(|e| e.to_string())?;
    // Tuning, not correctness: a sysctl that cannot be set (nf_conntrack_max is read-only
    // outside the initial network namespace; run_estimation before 5.12, or in the agent's
    // read-only /proc/sys after an init container without the flag) is named and the agent
    // goes on.
    for e in &prepared.tuning_left {
        tracing::warn!("tuning left as it is: {e}");
    }
    for e in &prepared.optional_modules_missing {
        tracing::warn!("ipset and iptables matches: {e}");
    }
    Ok(RealKernel::with(prepared.ipvs, prepared.rtnl, DEFAULT_DUMMY).binding(settings.binding))
}

/// The iptables backend and whether it has `--random-fully`, asked once; if
/// `iptables --version` fails now the backend is asked again at each attempt to apply the
/// rules (so a tool installed later is picked up) and `--random-fully` is not used.
fn probe_iptables() -> (kube_ipvs_host::masquerade::Backend, bool) {
    match kube_ipvs_host::masquerade::probe(None) {
        Ok((backend, random_fully)) => {
            if !random_fully {
                tracing::info!("masquerade: iptables before 1.6.2 has no --random-fully");
            }
            (backend, random_fully)
        }
        Err(e) => {
            tracing::warn!("masquerade: {e}; asking again when the rules are applied");
            (kube_ipvs_host::masquerade::Backend::Auto, false)
        }
    }
}

/// Completes on SIGTERM or SIGINT. The handlers are installed when this is called, not when the
/// future is first polled: a SIGTERM that came before the agent's loop first polled it used to
/// find no handler and kill the process with the signal (exit status 143 instead of 0).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    // A signal whose handler could not be installed never completes its half.
    let wait = |sig: std::io::Result<tokio::signal::unix::Signal>, name: &'static str| async move {
        match sig {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for {name} ({e})");
                std::future::pending::<()>().await;
            }
        }
    };
    async move {
        tokio::select! {
            () = wait(term, "SIGTERM") => tracing::info!("SIGTERM"),
            () = wait(int, "SIGINT") => tracing::info!("SIGINT"),
        }
    }
}

async fn serve(settings: Settings, kernel: RealKernel) -> ExitCode {
    // First, so a SIGTERM at any later point of the startup is a clean stop.
    let shutdown = shutdown_signal();
    let shared = Arc::new(Shared::new(settings.sync_period));
    shared.set_configz(configz::document(&settings).to_string());
    let healthz = match health::bind(settings.healthz, "--healthz-bind-address").await {
        Ok(l) => l,
        Err(e) => return fail(exit::START, e),
    };
    let metrics = match health::bind(settings.metrics, "--metrics-bind-address").await {
        Ok(l) => l,
        Err(e) => return fail(exit::START, e),
    };
    tokio::spawn(health::serve(healthz, shared.clone(), Routes::Health));
    tokio::spawn(health::serve(metrics, shared.clone(), Routes::Metrics));

    let mut inputs = match Inputs::new(settings.node.clone()) {
        Ok(i) => i,
        Err(e) => return fail(exit::SETTING, format!("node context: {e}")),
    };
    // Before any Service arrives: the short circuit's marks stay what they were.
    let mut kernel = kernel;
    inputs.set_mark_hints(sets::mark_hints(&mut kernel));
    let translate = TranslateOptions {
        service_proxy_name: settings.source.service_proxy_name.clone(),
    };
    let node_name = Some(settings.node.node_name.clone());
    let mut events = None;
    let watch = match &settings.source.manifests {
        Some(path) => kube_ipvs_watch::manifest::spawn(kube_ipvs_watch::manifest::ManifestConfig {
            path: path.clone(),
            node_name,
            translate,
            min_interval: settings.min_sync_period,
            poll_interval: MANIFEST_POLL,
        }),
        None => {
            let client = match settings.source.client().await {
                Ok(c) => c,
                Err(e) => return fail(exit::START, e),
            };
            let recorder = events::Recorder::new(client.clone(), settings.node.node_name.clone());
            // kube-proxy's birth cry.
            recorder.emit(
                events::node_ref(&settings.node.node_name),
                events::Kind::Normal,
                "Starting",
                "StartKubeProxy",
                "",
            );
            events = Some(recorder);
            kube_ipvs_watch::cluster::spawn(
                client,
                kube_ipvs_watch::WatchConfig {
                    node_name,
                    translate,
                    min_interval: settings.min_sync_period,
                    ..Default::default()
                },
            )
        }
    };
    // The watches' error and relist counts, copied into /metrics as they change.
    let mut watch_stats = watch.stats.clone();
    let stats_shared = shared.clone();
    tokio::spawn(async move {
        while watch_stats.changed().await.is_ok() {
            let s = *watch_stats.borrow_and_update();
            stats_shared.with_metrics(|m| {
                m.watch_errors = s.watch_errors;
                m.watch_relists = s.relists;
            });
        }
    });
    tracing::info!(
        "started: node {}, scheduler {}, sync period {:?}, healthz {}, metrics {}",
        settings.node.node_name,
        settings.node.default_scheduler,
        settings.sync_period,
        settings.healthz,
        settings.metrics
    );
    let cfg = AgentConfig {
        node_ips: settings.source.node_ips.clone(),
        nodeports: settings.nodeports.clone(),
        remove_kube_proxy_leftovers: !settings.keep_kube_proxy_rules,
        ..AgentConfig::every(settings.sync_period)
    };
    // Per-Service health checks listen on every address, as kube-proxy's do by default.
    let (health_checks, checks) = hcport::HealthChecks::new();
    tokio::spawn(hcport::serve_all(
        checks,
        std::net::Ipv4Addr::UNSPECIFIED.into(),
        shared.clone(),
        events,
    ));
    // Subscribed before the startup sync reads the addresses, so no change falls in between.
    let address_changes = sync::watch_addresses(DEFAULT_DUMMY);
    let masq = if settings.masquerade {
        // Changes are applied on a worker with a kernel handle of its own, so IPVS programming
        // never waits for iptables.
        let worker = match RealKernel::open(DEFAULT_DUMMY) {
            Ok(k) => k,
            Err(e) => return fail(exit::START, format!("masquerade rules: {e}")),
        };
        let (backend, random_fully) = probe_iptables();
        let masq = masq::Masq::new(masq::Fixed {
            cluster_cidrs: settings.cluster_cidrs.clone(),
            masquerade_all: settings.masquerade_all,
            node_pod_cidrs: settings.node_pod_cidrs.clone(),
            backend,
            detect_local: settings.detect_local.clone(),
            mark_bit: settings.masquerade_bit,
            random_fully,
            local_marks: settings.node.options.local_marks.map(|m| m.mask()),
        })
        .with_hairpin_sets(&mut kernel)
        .with_service_sets(&mut kernel);
        match masq.in_background(Box::new(worker)) {
            Ok(masq) => Some(masq),
            Err(e) => return fail(exit::START, format!("masquerade rules: {e}")),
        }
    } else {
        tracing::info!("--no-masquerade: iptables is left alone (no nat or filter rules)");
        None
    };
    // After a change of --service-address-binding, the addresses made local the other way
    // are made local this way before the first sync reads the kernel. A failure leaves those
    // addresses local the other way (the engine then binds its own anew): logged, not fatal.
    let owned = kube_ipvs_diff::Ownership::of(&settings.node.options);
    let moving = std::time::Instant::now();
    match kernel.move_bindings(|a| owned.addr(a)) {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            "moved {n} service addresses to --service-address-binding={} in {:.1} ms",
            settings.binding,
            moving.elapsed().as_secs_f64() * 1000.0
        ),
        Err(e) => tracing::warn!(
            "moving service addresses to --service-address-binding={}: {e}",
            settings.binding
        ),
    }
    let mut agent = Agent::new(kernel, inputs, cfg, shared).with_health_checks(health_checks);
    // Reconciles read the kernel on a thread with a handle of its own, so a whole-table read
    // never holds up the programming of a change; without it they read on the loop. The
    // reader rests as long as it reads, leaving CPU to the loop and the node.
    agent = match RealKernel::open(DEFAULT_DUMMY) {
        Ok(reader) => {
            match agent.with_background_reads(Box::new(reader.binding(settings.binding).paced())) {
                Ok(a) => a,
                Err(e) => {
                    return fail(
                        exit::START,
                        format!("starting the kernel reader thread: {e}"),
                    );
                }
            }
        }
        Err(e) => return fail(exit::START, format!("the kernel reader: {e}")),
    };
    if let Some(signals) = address_changes {
        agent = agent.with_address_changes(signals);
    }
    if let Some(masq) = masq {
        agent = agent.with_masquerade(masq);
    }
    let result = agent.run(watch.changes, shutdown).await;
    watch.task.abort();
    match result {
        Ok(()) => {
            tracing::info!("stopping; the IPVS table and {DEFAULT_DUMMY} stay as they are");
            ExitCode::from(exit::STOPPED)
        }
        Err(e) => fail(exit::FAILED, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SIGTERM that arrives after `shutdown_signal()` is called but before its future is
    /// first polled is caught, not fatal: with the handler installed at the first poll, as
    /// before, this test process would be killed by the signal.
    #[tokio::test]
    async fn a_sigterm_before_the_first_poll_completes_the_shutdown() {
        let shutdown = shutdown_signal();
        kube_ipvs_integration::sigterm_this_process();
        tokio::time::timeout(std::time::Duration::from_secs(10), shutdown)
            .await
            .expect("the SIGTERM completed the shutdown");
    }
}
