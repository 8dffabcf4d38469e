//! The watch crate through the real kube-rs client against the test API server: object
//! changes arrive as the right model changes; dropped watches, 410s and outages are recovered
//! without losing or duplicating a change, and an outage leaves the last state in place.

mod common;

use std::net::IpAddr;
use std::time::Duration;

use common::{client, next, node, service, slice};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_ipvs_diff::{Inputs, NodeContext, ServiceName};
use kube_ipvs_integration::{Kind, TestApiServer};
use kube_ipvs_watch::cluster::{self, ClusterWatch};
use kube_ipvs_watch::{ServiceChange, WatchConfig};

fn config() -> WatchConfig {
    WatchConfig {
        node_name: Some("node-a".into()),
        min_interval: Duration::from_millis(5),
        backoff_min: Duration::from_millis(10),
        backoff_max: Duration::from_millis(100),
        // Most tests here create no Node: the first change set goes without it soon.
        node_wait: Duration::from_millis(100),
        ..WatchConfig::default()
    }
}

fn name(n: &str) -> ServiceName {
    ServiceName::new("default", n)
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("literal")
}

/// Starts a watch and returns it with the initial change set.
async fn start(url: &str) -> (ClusterWatch, kube_ipvs_watch::ChangeSet) {
    let mut w = cluster::spawn(client(url), config());
    let first = next(&mut w.changes).await;
    assert!(first.initial);
    (w, first)
}

/// Waits until the driver has seen at least `n` watch errors.
async fn wait_errors(w: &mut ClusterWatch, n: u64) {
    tokio::time::timeout(
        Duration::from_secs(30),
        w.stats.wait_for(|s| s.watch_errors >= n),
    )
    .await
    .expect("watch errors within 30s")
    .expect("driver alive");
}

#[tokio::test]
async fn create_update_delete_arrive_as_model_changes() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "web", "10.96.0.10", 80))
        .expect("create");
    server
        .create(&node("node-a", "zone-a", "192.168.0.10"))
        .expect("create");
    server
        .create(&node("node-b", "zone-b", "192.168.0.11"))
        .expect("create");
    let (mut w, first) = start(&url).await;
    let mut inputs = Inputs::new(NodeContext::new("node-a")).expect("node");
    assert!(first.apply_to(&mut inputs).is_empty());
    let web = inputs
        .service(&name("web"))
        .expect("web in the first change set");
    assert_eq!(web.cluster_ips, vec![ip("10.96.0.10")]);
    // The node may arrive in the first change set or just after it.
    let node_info = match first.node {
        Some(n) => n,
        None => next(&mut w.changes).await.node.expect("the node's info"),
    };
    assert_eq!(node_info.zone.as_deref(), Some("zone-a"));
    assert_eq!(
        node_info.ips_v4,
        vec!["192.168.0.10".parse::<std::net::Ipv4Addr>().expect("ip")]
    );

    server
        .create(&slice(
            "default",
            "web-abc",
            "web",
            &[("10.0.0.1", true), ("10.0.0.2", false)],
        ))
        .expect("create");
    let cs = next(&mut w.changes).await;
    assert_eq!(cs.services.keys().collect::<Vec<_>>(), [&name("web")]);
    let eps = &cs.services[&name("web")].endpoints;
    assert_eq!(
        eps.iter().map(|e| (e.addr, e.ready)).collect::<Vec<_>>(),
        [(ip("10.0.0.1"), true), (ip("10.0.0.2"), false)]
    );
    cs.apply_to(&mut inputs);

    server
        .update(&service("default", "web", "10.96.0.10", 8080))
        .expect("update");
    let cs = next(&mut w.changes).await;
    let info = cs.services[&name("web")]
        .service
        .as_ref()
        .expect("still there");
    assert_eq!(info.ports[0].port, 8080);
    assert_eq!(
        cs.services[&name("web")].endpoints.len(),
        2,
        "full state per change"
    );

    server
        .delete::<EndpointSlice>("default", "web-abc")
        .expect("delete");
    let cs = next(&mut w.changes).await;
    assert!(cs.services[&name("web")].endpoints.is_empty());
    server.delete::<Service>("default", "web").expect("delete");
    let cs = next(&mut w.changes).await;
    assert_eq!(cs.services[&name("web")], ServiceChange::default());
    cs.apply_to(&mut inputs);
    assert!(inputs.is_empty());
}

/// The first change set waits for this node's Node (as kube-proxy waits for its addresses),
/// so the first sync knows the zone and the NodePort addresses: a Node created a while after
/// the watch started is in it.
#[tokio::test]
async fn the_first_change_set_waits_for_the_node() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "web", "10.96.0.10", 80))
        .expect("create");
    let mut w = cluster::spawn(
        client(&url),
        WatchConfig {
            node_wait: Duration::from_secs(30),
            ..config()
        },
    );
    // Services and slices are listed at once; without the Node nothing is handed out.
    let early = tokio::time::timeout(Duration::from_millis(500), w.changes.recv()).await;
    assert!(early.is_err(), "a change set before the Node: {early:?}");
    server
        .create(&node("node-a", "zone-a", "192.168.0.10"))
        .expect("create");
    let first = next(&mut w.changes).await;
    assert!(first.initial && first.services.contains_key(&name("web")));
    let node = first.node.expect("the Node in the first change set");
    assert_eq!(node.zone.as_deref(), Some("zone-a"));
}

/// A Node that never comes holds the first change set for `node_wait` only.
#[tokio::test]
async fn without_the_node_the_first_change_set_goes_after_the_wait() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "web", "10.96.0.10", 80))
        .expect("create");
    let started = std::time::Instant::now();
    let mut w = cluster::spawn(
        client(&url),
        WatchConfig {
            node_wait: Duration::from_millis(700),
            ..config()
        },
    );
    let first = next(&mut w.changes).await;
    assert!(started.elapsed() >= Duration::from_millis(700));
    assert!(first.initial && first.node.is_none());
    assert!(first.services.contains_key(&name("web")));
}

#[tokio::test]
async fn dropped_watch_loses_and_repeats_nothing() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    let (mut w, _) = start(&url).await;
    server.wait_watches(3).await;
    let relists = w.stats.borrow().relists;
    let requests = server.requests();
    server.drop_watches();
    // Made while the watches are down or reconnecting: must arrive once, after the resume.
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    let cs = next(&mut w.changes).await;
    assert_eq!(cs.services.keys().collect::<Vec<_>>(), [&name("b")]);
    server
        .create(&service("default", "c", "10.96.0.3", 80))
        .expect("create");
    let cs = next(&mut w.changes).await;
    assert_eq!(
        cs.services.keys().collect::<Vec<_>>(),
        [&name("c")],
        "b is not repeated"
    );
    assert_eq!(
        w.stats.borrow().relists,
        relists,
        "a dropped watch resumes, it does not re-list"
    );
    // kube-rs treats a cut body as the end of the watch and resumes from its last version.
    assert!(server.requests() > requests, "the watches were re-opened");
}

#[tokio::test]
async fn gone_410_relists_without_losing_or_repeating_a_change() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    server
        .create(&service("default", "keep", "10.96.0.9", 80))
        .expect("create");
    let (mut w, _) = start(&url).await;
    let relists = w.stats.borrow().relists;
    // Compaction: history is gone and open watches are cut; their resume gets 410.
    server.expire_history();
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    server.delete::<Service>("default", "a").expect("delete");
    let mut seen = std::collections::BTreeMap::new();
    while seen.len() < 2 {
        let cs = next(&mut w.changes).await;
        for (k, v) in cs.services {
            assert!(seen.insert(k.clone(), v).is_none(), "{k} changed twice");
        }
    }
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        [&name("a"), &name("b")],
        "keep is unchanged"
    );
    assert_eq!(seen[&name("a")], ServiceChange::default(), "a is gone");
    assert!(seen[&name("b")].service.is_some());
    assert!(
        w.stats.borrow().relists > relists,
        "the 410 caused a relist"
    );
}

/// A 410 is an answer, not an outage: the relist it calls for goes out at once, however long
/// the backoff is (after a real outage it has grown to 30 s).
#[tokio::test]
async fn a_410_relists_at_once_not_after_the_backoff() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    let slow = WatchConfig {
        backoff_min: Duration::from_secs(60),
        backoff_max: Duration::from_secs(60),
        ..config()
    };
    let mut w = cluster::spawn(client(&url), slow);
    assert!(next(&mut w.changes).await.initial);
    let relists = w.stats.borrow().relists;
    server.expire_history();
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    let cs = tokio::time::timeout(Duration::from_secs(20), next(&mut w.changes))
        .await
        .expect("the relist came long before the 60 s backoff");
    assert!(
        cs.services.contains_key(&name("b")),
        "{:?}",
        cs.services.keys()
    );
    assert!(w.stats.borrow().relists > relists, "a relist");
}

#[tokio::test]
async fn bookmarks_let_a_watch_resume_past_other_kinds_churn() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server.set_history_limit(4);
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    let (mut w, _) = start(&url).await;
    server.wait_watches(3).await;
    let relists = w.stats.borrow().relists;
    // Churn on another kind pushes the Service watch's last version out of the history.
    for i in 0..10 {
        server
            .apply(&node("node-z", &format!("z{i}"), "192.168.0.99"))
            .expect("apply");
    }
    server.send_bookmarks();
    let bookmark = server.resource_version();
    // A clean end delivers what was queued first, so the bookmark is read before the resume.
    server.close_watches();
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    let cs = next(&mut w.changes).await;
    assert_eq!(cs.services.keys().collect::<Vec<_>>(), [&name("b")]);
    assert_eq!(
        w.stats.borrow().relists,
        relists,
        "resumed from the bookmark, no 410"
    );
    assert!(
        server.watch_starts().contains(&(Kind::Service, bookmark)),
        "the Service watch resumed from the bookmark's version: {:?}",
        server.watch_starts()
    );
}

#[tokio::test]
async fn without_bookmarks_the_same_churn_forces_a_relist() {
    // The control for the test above: the same sequence without the bookmark must 410.
    let (server, url) = TestApiServer::start().await.expect("server");
    server.set_history_limit(4);
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    let (mut w, _) = start(&url).await;
    server.wait_watches(3).await;
    let relists = w.stats.borrow().relists;
    for i in 0..10 {
        server
            .apply(&node("node-z", &format!("z{i}"), "192.168.0.99"))
            .expect("apply");
    }
    server.close_watches();
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    let cs = next(&mut w.changes).await;
    assert_eq!(
        cs.services.keys().collect::<Vec<_>>(),
        [&name("b")],
        "only b, once"
    );
    assert!(w.stats.borrow().relists > relists, "a 410 and a relist");
}

#[tokio::test]
async fn outage_keeps_the_last_state_and_resumes_afterwards() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    server
        .create(&slice("default", "a-1", "a", &[("10.0.0.1", true)]))
        .expect("create");
    let (mut w, first) = start(&url).await;
    let mut inputs = Inputs::new(NodeContext::new("node-a")).expect("node");
    first.apply_to(&mut inputs);
    let errors = w.stats.borrow().watch_errors;

    server.set_available(false);
    // Several failed retries (503 on list/watch) must produce no change set at all.
    wait_errors(&mut w, errors + 4).await;
    server.set_refusing();
    wait_errors(&mut w, errors + 8).await;
    assert!(
        w.changes.try_recv().is_err(),
        "an outage produced a change set"
    );
    assert!(inputs.service(&name("a")).is_some());
    assert_eq!(inputs.endpoints(&name("a")).len(), 1);

    server.set_available(true);
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    let cs = next(&mut w.changes).await;
    assert_eq!(
        cs.services.keys().collect::<Vec<_>>(),
        [&name("b")],
        "a untouched"
    );
    cs.apply_to(&mut inputs);
    assert_eq!(inputs.len(), 2);
}

#[tokio::test]
async fn slow_responses_only_delay() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server.set_latency(Duration::from_millis(300));
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    let (mut w, first) = start(&url).await;
    assert!(first.services.contains_key(&name("a")));
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    let cs = next(&mut w.changes).await;
    assert_eq!(cs.services.keys().collect::<Vec<_>>(), [&name("b")]);
}

#[tokio::test]
async fn other_proxies_headless_and_bad_objects_are_skipped_and_the_rest_flows() {
    use kube_ipvs_watch::TranslateOptions;
    let (server, url) = TestApiServer::start().await.expect("server");
    let labelled = |n: &str, ip: &str, proxy: &str| {
        let mut s = service("default", n, ip, 80);
        s.metadata.labels = Some(
            [(
                "service.kubernetes.io/service-proxy-name".to_owned(),
                proxy.to_owned(),
            )]
            .into(),
        );
        s
    };
    server
        .create(&service("default", "plain", "10.96.0.1", 80))
        .expect("create");
    server
        .create(&labelled("theirs", "10.96.0.2", "cilium"))
        .expect("create");
    server
        .create(&labelled("ours", "10.96.0.3", "kube-ipvs"))
        .expect("create");
    let mut headless = service("default", "headless", "None", 80);
    if let Some(spec) = headless.spec.as_mut() {
        spec.cluster_ips = Some(vec!["None".into()]);
    }
    server.create(&headless).expect("create");
    server
        .create(&service("default", "bad", "10.96.0.999", 80))
        .expect("create");

    let names = |cs: &kube_ipvs_watch::ChangeSet| {
        cs.services
            .iter()
            .filter(|(_, c)| c.service.is_some())
            .map(|(n, _)| n.name.clone())
            .collect::<Vec<_>>()
    };
    let (_w, first) = start(&url).await;
    assert_eq!(
        names(&first),
        ["plain"],
        "kube-proxy's rule without a proxy name"
    );

    let mut cfg = config();
    cfg.translate = TranslateOptions {
        service_proxy_name: Some("kube-ipvs".into()),
    };
    let mut w = cluster::spawn(client(&url), cfg);
    let first = next(&mut w.changes).await;
    assert_eq!(names(&first), ["ours", "plain"]);
    // The bad object is skipped, and later changes still flow.
    server
        .create(&service("default", "later", "10.96.0.4", 80))
        .expect("create");
    let cs = next(&mut w.changes).await;
    assert_eq!(names(&cs), ["later"]);
}
