//! Host tests of the sync loop against an in-memory kernel, with tokio's paused clock: startup
//! adopts a stale table with only the needed operations, the periodic reconcile repairs a
//! cleared table and counts it, a change set becomes an incremental sync, a failed operation is
//! retried with doubling delays while the other Services apply, shutdown leaves the table, and
//! with masquerade an endpoint change on this node is a hairpin ipset delta with no rules apply.
//!
//! The in-memory kernel (`kube_ipvs::kernel::mem`) answers the executor's netlink requests the
//! way IPVS does (adding what exists or deleting what does not is an error), so the agent cannot
//! pass by issuing blind requests. Waiting is on the agent's own sync counter, never on a sleep.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kube_ipvs::agent::health::Shared;
use kube_ipvs::agent::sync::{Agent, AgentConfig};
use kube_ipvs::kernel::mem::MemKernel;
use kube_ipvs_diff::{Inputs, NodeContext, ServiceEntry, Table, VirtualKey};
use kube_ipvs_watch::{ChangeSet, Tracker, TranslateOptions};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

fn examples() -> kube_ipvs_watch::manifest::Manifests {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster");
    kube_ipvs_watch::manifest::load(&dir).expect("the examples load")
}

fn tracker_with_examples() -> (Tracker, ChangeSet) {
    let m = examples();
    let mut t = Tracker::new(TranslateOptions::default());
    t.relist_services(&m.services);
    t.relist_slices(&m.slices);
    t.apply_node(&m.nodes[0]);
    let cs = t.take_change_set().expect("an initial change set");
    (t, cs)
}

fn inputs() -> Inputs {
    Inputs::new(NodeContext::new("node-1")).expect("valid node")
}

/// The table the examples ask for, from a throwaway engine.
fn desired() -> Table {
    let (_, cs) = tracker_with_examples();
    let mut inp = inputs();
    cs.apply_to(&mut inp);
    let mut engine = kube_ipvs_diff::Engine::new();
    engine.sync(&mut inp, Duration::ZERO, &kube_ipvs_diff::UnknownCounts);
    engine.desired_table()
}

const SYNC_PERIOD: Duration = Duration::from_secs(30);

struct Running {
    shared: Arc<Shared>,
    changes: mpsc::Sender<ChangeSet>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), kube_ipvs::agent::sync::AgentError>>,
}

/// The masquerade settings of these tests: no cluster CIDR, the legacy backend, the defaults.
fn fixed() -> kube_ipvs::agent::masq::Fixed {
    kube_ipvs::agent::masq::Fixed {
        cluster_cidrs: Vec::new(),
        masquerade_all: false,
        node_pod_cidrs: Vec::new(),
        backend: kube_ipvs_host::masquerade::Backend::Legacy,
        detect_local: kube_ipvs::agent::masq::DetectLocal::ClusterCidr,
        mark_bit: 14,
        random_fully: true,
        local_marks: Some(0x3ff0_0000),
    }
}

fn start(kernel: MemKernel) -> Running {
    start_with(kernel, |a| a)
}

/// [`start`] with more set up on the agent (masquerade).
fn start_with(
    kernel: MemKernel,
    setup: impl FnOnce(Agent<MemKernel>) -> Agent<MemKernel>,
) -> Running {
    // The node holds its InternalIP (examples/cluster/node.yaml), where NodePorts listen.
    kernel.state().node_addresses = vec!["192.168.56.10".parse().expect("literal")];
    let shared = Arc::new(Shared::new(SYNC_PERIOD));
    let cfg = AgentConfig::every(SYNC_PERIOD);
    let mut agent = setup(Agent::new(kernel, inputs(), cfg, shared.clone()));
    let (tx, rx) = mpsc::channel(4);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        agent
            .run(rx, async {
                let _ = stopped.await;
            })
            .await
    });
    Running {
        shared,
        changes: tx,
        stop,
        task,
    }
}

impl Running {
    /// Waits until `n` syncs have finished in all.
    async fn syncs(&self, n: u64) {
        self.shared
            .syncs()
            .wait_for(|c| *c >= n)
            .await
            .expect("the agent is running");
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let result = self.task.await.expect("agent task");
        assert!(result.is_ok(), "{result:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn startup_adopts_a_stale_table_with_only_the_needed_operations() {
    let want = desired();
    let kernel = MemKernel::default();
    {
        let mut st = kernel.state();
        st.table = want.clone();
        st.interface = true;
        // One real server missing, one virtual server nobody asks for.
        let web = st
            .table
            .services
            .values_mut()
            .find(|e| e.dests.len() == 3)
            .expect("web has three endpoints");
        let first = *web.dests.keys().next().expect("a dest");
        web.dests.remove(&first);
        let stale = kube_ipvs_diff::VirtualServer {
            key: VirtualKey::inet(
                kube_ipvs_diff::Protocol::Tcp,
                "10.96.99.1".parse().expect("literal"),
                80,
            ),
            scheduler: kube_ipvs_diff::Scheduler::RR,
            persistence: None,
            netmask: 32,
        };
        st.table.services.insert(
            stale.key,
            ServiceEntry {
                server: stale,
                dests: Default::default(),
            },
        );
    }
    let run = start(kernel.clone());
    let (_, cs) = tracker_with_examples();
    run.changes.send(cs).await.expect("send");
    run.syncs(1).await;
    assert_eq!(
        kernel.state().requests.len(),
        2,
        "add the dest, delete the stale service"
    );
    assert_eq!(kernel.state().table, want);
    run.shared.with_metrics(|m| {
        assert_eq!(
            m.operations(kube_ipvs::agent::metrics::SyncKind::Startup),
            2
        );
        assert_eq!(m.services, want.services.len() as u64);
        assert_eq!(m.real_servers, want.dest_count() as u64);
    });
    assert!(run.shared.health().healthy());
    run.stop().await;
    assert_eq!(kernel.state().table, want, "stopping leaves the table");
}

#[tokio::test(start_paused = true)]
async fn the_reconcile_repairs_a_cleared_table_and_counts_it() {
    let want = desired();
    let kernel = MemKernel::default();
    let run = start(kernel.clone());
    let t0 = Instant::now();
    let (_, cs) = tracker_with_examples();
    run.changes.send(cs).await.expect("send");
    run.syncs(1).await;
    assert_eq!(kernel.state().table, want);
    // `ipvsadm -C` behind the agent's back.
    kernel.state().table.services.clear();
    run.syncs(2).await;
    assert_eq!(
        t0.elapsed(),
        SYNC_PERIOD,
        "repaired by the periodic reconcile"
    );
    assert_eq!(kernel.state().table, want);
    let repaired = (want.services.len() + want.dest_count()) as u64;
    run.shared
        .with_metrics(|m| assert_eq!(m.drift_repaired, repaired));
    // The next reconcile finds nothing to repair.
    run.syncs(3).await;
    run.shared
        .with_metrics(|m| assert_eq!(m.drift_repaired, repaired));
    run.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_change_set_is_an_incremental_sync_of_that_service() {
    let kernel = MemKernel::default();
    let run = start(kernel.clone());
    let (mut tracker, cs) = tracker_with_examples();
    run.changes.send(cs).await.expect("send");
    run.syncs(1).await;
    let before = kernel.state().requests.len();
    let t0 = Instant::now();
    // The web endpoint 10.244.2.10 moves to 10.244.2.99.
    let mut m = examples();
    let text = serde_json::to_string(&m.slices).expect("json");
    m.slices = serde_json::from_str(&text.replace("10.244.2.10", "10.244.2.99")).expect("json");
    tracker.relist_slices(&m.slices);
    let cs = tracker.take_change_set().expect("a change");
    assert_eq!(cs.services.len(), 1, "only web changed");
    run.changes.send(cs).await.expect("send");
    run.syncs(2).await;
    assert_eq!(
        t0.elapsed(),
        Duration::ZERO,
        "applied at once, not at the reconcile"
    );
    {
        let st = kernel.state();
        // Add the new real server; the old one has unknown connections, so it drains at weight 0.
        assert_eq!(st.requests.len() - before, 2);
        let web = st
            .table
            .services
            .values()
            .find(|e| e.dests.keys().any(|d| d.addr.to_string() == "10.244.2.99"))
            .expect("the new endpoint is programmed");
        let old = web
            .dests
            .values()
            .find(|d| d.key.addr.to_string() == "10.244.2.10")
            .expect("the old one drains");
        assert_eq!(old.weight, 0);
    }
    run.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_operation_is_retried_with_backoff_and_does_not_block_others() {
    let want = desired();
    let kernel = MemKernel::default();
    // Every request for a destination on port 8080 fails (web, shop...); others must apply.
    kernel.state().fail_dest_port = Some(8080);
    let run = start(kernel.clone());
    let (_, cs) = tracker_with_examples();
    run.changes.send(cs).await.expect("send");
    let t0 = Instant::now();
    run.syncs(1).await;
    {
        let st = kernel.state();
        assert!(st.table.dest_count() > 0, "other Services applied");
        assert!(st.table.dest_count() < want.dest_count());
    }
    run.shared.with_metrics(|m| {
        assert!(m.kernel_errors > 0);
        assert!(m.pending_retries > 0);
    });
    // Retries at 1 s, then 2 s later, then 4 s later.
    let mut at = Vec::new();
    for n in 2..=4 {
        run.syncs(n).await;
        at.push(t0.elapsed());
    }
    assert_eq!(
        at,
        [1, 3, 7].map(Duration::from_secs),
        "doubling retry delays"
    );
    kernel.state().fail_dest_port = None;
    run.syncs(5).await;
    assert_eq!(t0.elapsed(), Duration::from_secs(15));
    assert_eq!(kernel.state().table, want, "the retry completed the table");
    run.shared
        .with_metrics(|m| assert_eq!(m.pending_retries, 0));
    run.stop().await;
}

/// A LoadBalancer Service with the Local policy, its health-check node port, and one endpoint on
/// node-1 whose readiness is `READY`.
const LB: &str = r#"apiVersion: v1
kind: Service
metadata: {name: lb, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.77
  clusterIPs: [10.96.0.77]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32100
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 31080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: lb-1
  namespace: default
  labels: {kubernetes.io/service-name: lb}
addressType: IPv4
endpoints:
- addresses: [10.244.1.77]
  conditions: {ready: READY}
  nodeName: node-1
ports:
- {name: http, port: 8080, protocol: TCP}
"#;

#[tokio::test(start_paused = true)]
async fn health_check_node_ports_follow_local_endpoints() {
    let parse = |ready: &str| {
        kube_ipvs_watch::manifest::parse_manifest(Path::new("lb.yaml"), &LB.replace("READY", ready))
            .expect("parses")
    };
    let (hc, checks) = kube_ipvs::agent::hcport::HealthChecks::new();
    let shared = Arc::new(Shared::new(SYNC_PERIOD));
    let cfg = AgentConfig::every(SYNC_PERIOD);
    let mut agent =
        Agent::new(MemKernel::default(), inputs(), cfg, shared.clone()).with_health_checks(hc);
    let (tx, rx) = mpsc::channel(4);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        agent
            .run(rx, async {
                let _ = stopped.await;
            })
            .await
    });
    let mut t = Tracker::new(TranslateOptions::default());
    let m = parse("true");
    t.relist_services(&m.services);
    t.relist_slices(&m.slices);
    tx.send(t.take_change_set().expect("initial"))
        .await
        .expect("send");
    let mut syncs = shared.syncs();
    syncs.wait_for(|n| *n >= 1).await.expect("sync");
    let local = |c: &kube_ipvs::agent::hcport::Checks| c.get(&32100).map(|c| c.local_endpoints);
    assert_eq!(local(&checks.borrow()), Some(1));
    t.relist_slices(&parse("false").slices);
    tx.send(t.take_change_set().expect("a change"))
        .await
        .expect("send");
    syncs.wait_for(|n| *n >= 2).await.expect("sync");
    assert_eq!(
        local(&checks.borrow()),
        Some(0),
        "not ready: the node fails the check"
    );
    t.relist_services(&[]);
    tx.send(t.take_change_set().expect("a removal"))
        .await
        .expect("send");
    syncs.wait_for(|n| *n >= 3).await.expect("sync");
    assert_eq!(
        local(&checks.borrow()),
        None,
        "the port closes with the Service"
    );
    let _ = stop.send(());
    assert!(task.await.expect("agent task").is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_drained_real_server_deleted_by_the_reconcile_is_not_drift() {
    let kernel = MemKernel::default();
    let run = start(kernel.clone());
    let (mut tracker, cs) = tracker_with_examples();
    run.changes.send(cs).await.expect("send");
    run.syncs(1).await;
    let dests = |k: &MemKernel| k.state().table.dest_count();
    let before = dests(&kernel);

    // One endpoint of `web` goes away. The in-memory kernel cannot count connections between
    // reconciles, so the real server drains at weight 0 until the reconcile sees it has none.
    let m = examples();
    let mut slice = m
        .slices
        .iter()
        .find(|s| {
            s.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/service-name"))
                .is_some_and(|n| n == "web")
        })
        .cloned()
        .expect("web's EndpointSlice");
    slice.endpoints.remove(0);
    tracker.apply_slice(&slice);
    let cs = tracker.take_change_set().expect("a change set");
    run.changes.send(cs).await.expect("send");
    let t0 = Instant::now();
    while dests(&kernel) == before {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            t0.elapsed() <= SYNC_PERIOD + Duration::from_secs(1),
            "still {before} real servers one reconcile after the endpoint went"
        );
    }
    assert_eq!(dests(&kernel), before - 1);
    run.shared.with_metrics(|m| {
        assert_eq!(
            m.drift_repaired, 0,
            "a finished graceful termination counted as drift"
        );
    });
    run.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_change_on_this_node_is_a_hairpin_set_delta_without_rules() {
    use kube_ipvs::agent::masq::Masq;
    use kube_ipvs_host::masquerade::Hairpin;

    let kernel = MemKernel::default();
    let masq = Masq::new(fixed()).with_hairpin_sets(&mut kernel.clone());
    let run = start_with(kernel.clone(), |a| a.with_masquerade(masq));
    let (mut tracker, cs) = tracker_with_examples();
    run.changes.send(cs).await.expect("send");
    run.syncs(1).await;
    let members = || -> BTreeSet<IpAddr> {
        let st = kernel.state();
        [kube_ipvs_netlink::Family::V4, kube_ipvs_netlink::Family::V6]
            .into_iter()
            .flat_map(|f| st.set_members(f))
            .collect()
    };
    let node1: BTreeSet<IpAddr> = [
        "10.244.1.10",
        "10.244.1.20",
        "10.244.1.30",
        "10.244.1.40",
        "10.244.1.53",
    ]
    .iter()
    .map(|a| a.parse().expect("literal"))
    .collect();
    assert_eq!(members(), node1, "node-1's endpoints, after startup");
    assert_eq!(kernel.state().rules.len(), 1);
    assert_eq!(kernel.state().rules[0].hairpin, Hairpin::Set);
    kernel.state().set_log.clear();

    // web's endpoint on node-1 moves from 10.244.1.10 to 10.244.1.99.
    let mut m = examples();
    let text = serde_json::to_string(&m.slices).expect("json");
    m.slices = serde_json::from_str(&text.replace("10.244.1.10", "10.244.1.99")).expect("json");
    tracker.relist_slices(&m.slices);
    let cs = tracker.take_change_set().expect("a change");
    run.changes.send(cs).await.expect("send");
    run.syncs(2).await;
    let mut log = kernel.state().set_log.clone();
    log.sort();
    assert_eq!(
        log,
        [
            "add KUBE-IPVS-HAIRPIN 10.244.1.99,10.244.1.99",
            "del KUBE-IPVS-HAIRPIN 10.244.1.10,10.244.1.10"
        ]
    );
    assert_eq!(
        kernel.state().rules.len(),
        1,
        "no iptables-restore for an endpoint change"
    );
    // An endpoint on another node changing touches neither.
    let text = serde_json::to_string(&m.slices).expect("json");
    m.slices = serde_json::from_str(&text.replace("10.244.2.10", "10.244.2.98")).expect("json");
    tracker.relist_slices(&m.slices);
    let cs = tracker.take_change_set().expect("a change");
    run.changes.send(cs).await.expect("send");
    run.syncs(3).await;
    assert_eq!(kernel.state().set_log.len(), 2);
    assert_eq!(kernel.state().rules.len(), 1);
    run.stop().await;
}

/// kube-proxy's leftovers are removed once, and only after our own rules are in place: not
/// while iptables refuses them, then at the first forced sync that applies them, and never
/// again.
#[tokio::test(start_paused = true)]
async fn kube_proxys_leftovers_go_once_our_rules_are_in_place() {
    use kube_ipvs::agent::masq::Masq;

    let kernel = MemKernel::default();
    {
        let mut st = kernel.state();
        st.fail_rules = true;
        st.kube_proxy_leftovers =
            vec!["iptables chain KUBE-SERVICES (iptables-nft-restore)".into()];
    }
    let masq = Masq::new(fixed());
    let run = start_with(kernel.clone(), |a| a.with_masquerade(masq));
    let (_tracker, cs) = tracker_with_examples();
    run.changes.send(cs).await.expect("send");
    run.syncs(1).await;
    assert!(
        kernel.state().kube_proxy_removals.is_empty(),
        "not while our rules are refused"
    );
    kernel.state().fail_rules = false;
    // The next reconcile applies our rules, then removes kube-proxy's.
    let before = kernel.state().rules.len();
    tokio::time::advance(SYNC_PERIOD).await;
    run.syncs(2).await;
    let removals = kernel.state().kube_proxy_removals.clone();
    assert_eq!(removals.len(), 1, "{removals:?}");
    assert!(removals[0] > before, "after our rules were ensured");
    assert!(kernel.state().kube_proxy_leftovers.is_empty());
    tokio::time::advance(SYNC_PERIOD).await;
    run.syncs(3).await;
    assert_eq!(kernel.state().kube_proxy_removals.len(), 1, "once");
    run.stop().await;
}
