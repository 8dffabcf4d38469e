//! The test API server against the real kube-rs client, at the protocol level: lists with
//! resourceVersion and pagination, watches from a version, bookmarks, 410 Gone, selectors.

mod common;

use common::{client, node, service, slice};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use kube_ipvs_integration::TestApiServer;

#[tokio::test]
async fn list_carries_resource_version_and_pages_with_continue() {
    let (server, url) = TestApiServer::start().await.expect("server");
    for i in 0..5 {
        server
            .create(&service(
                "default",
                &format!("s{i}"),
                &format!("10.96.0.{}", i + 1),
                80,
            ))
            .expect("create");
    }
    let api: Api<Service> = Api::all(client(&url));
    let page = api
        .list(&ListParams::default().limit(2))
        .await
        .expect("first page");
    assert_eq!(page.items.len(), 2);
    let rv = page.metadata.resource_version.clone().expect("list RV");
    assert_eq!(rv, server.resource_version().to_string());
    let token = page.metadata.continue_.clone().expect("a continue token");
    // A change between pages must not show up: the pages come from one snapshot.
    server.delete::<Service>("default", "s4").expect("delete");
    let rest = api
        .list(&ListParams::default().limit(10).continue_token(&token))
        .await
        .expect("second page");
    let names: Vec<_> = page
        .items
        .iter()
        .chain(&rest.items)
        .filter_map(|s| s.metadata.name.clone())
        .collect();
    assert_eq!(names, ["s0", "s1", "s2", "s3", "s4"]);
    assert_eq!(rest.metadata.resource_version.as_deref(), Some(rv.as_str()));

    // After compaction the token is gone, as on a real server.
    let page = api
        .list(&ListParams::default().limit(1))
        .await
        .expect("page");
    server.expire_history();
    let err = api
        .list(&ListParams::default().continue_token(&page.metadata.continue_.expect("token")))
        .await
        .expect_err("expired continue token");
    match err {
        kube::Error::Api(s) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
        other => panic!("expected a 410 Status, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_from_a_version_replays_history_then_streams() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    let api: Api<Service> = Api::all(client(&url));
    let rv = api
        .list(&ListParams::default())
        .await
        .expect("list")
        .metadata
        .resource_version;
    let rv = rv.expect("RV");
    // These happen after the list: a watch from its version must see exactly them, in order.
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    let mut b = service("default", "b", "10.96.0.2", 81);
    b.metadata.labels = Some([("tier".to_owned(), "web".to_owned())].into());
    server.update(&b).expect("update");
    let mut stream = api
        .watch(&WatchParams::default().timeout(30), &rv)
        .await
        .expect("watch")
        .boxed();
    let mut seen = Vec::new();
    for _ in 0..2 {
        match stream
            .try_next()
            .await
            .expect("event")
            .expect("open stream")
        {
            WatchEvent::Added(s) => {
                seen.push(format!("ADDED {}", s.metadata.name.unwrap_or_default()))
            }
            WatchEvent::Modified(s) => {
                seen.push(format!("MODIFIED {}", s.metadata.name.unwrap_or_default()));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, ["ADDED b", "MODIFIED b"]);
    // A live event after the replay.
    server.delete::<Service>("default", "a").expect("delete");
    match stream
        .try_next()
        .await
        .expect("event")
        .expect("open stream")
    {
        WatchEvent::Deleted(s) => {
            assert_eq!(s.metadata.name.as_deref(), Some("a"));
            assert_eq!(
                s.metadata.resource_version,
                Some(server.resource_version().to_string()),
                "a DELETED object carries the deletion's version"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    // Bookmarks are sent only to watches that asked for them (kube-rs asks by default).
    server.send_bookmarks();
    match stream
        .try_next()
        .await
        .expect("event")
        .expect("open stream")
    {
        WatchEvent::Bookmark(bm) => {
            assert_eq!(
                bm.metadata.resource_version,
                server.resource_version().to_string()
            );
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn watch_from_a_compacted_version_gets_410_expired() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server.set_history_limit(2);
    let api: Api<Service> = Api::all(client(&url));
    let rv = server.resource_version().to_string();
    for i in 0..4 {
        server
            .create(&service("default", &format!("s{i}"), "10.96.0.1", 80))
            .expect("create");
    }
    let mut stream = api
        .watch(&WatchParams::default(), &rv)
        .await
        .expect("the watch request itself succeeds, as on a real server")
        .boxed();
    match stream
        .try_next()
        .await
        .expect("event")
        .expect("open stream")
    {
        WatchEvent::Error(s) => {
            assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
            assert!(
                s.message.starts_with("too old resource version"),
                "{}",
                s.message
            );
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
    assert!(
        stream.next().await.is_none(),
        "the server ends the stream after a 410"
    );
}

#[tokio::test]
async fn selectors_filter_lists_and_turn_label_changes_into_added_and_deleted() {
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&slice("default", "web-1", "web", &[("10.0.0.1", true)]))
        .expect("create");
    let mut other = slice("default", "x-1", "x", &[("10.0.0.2", true)]);
    other.metadata.labels = None;
    server.create(&other).expect("create");
    let api: Api<EndpointSlice> = Api::all(client(&url));
    let lp = ListParams::default().labels("kubernetes.io/service-name");
    let list = api.list(&lp).await.expect("list");
    assert_eq!(list.items.len(), 1, "the unlabelled slice is filtered out");
    let rv = list.metadata.resource_version.expect("RV");
    let mut stream = api
        .watch(
            &WatchParams::default().labels("kubernetes.io/service-name"),
            &rv,
        )
        .await
        .expect("watch")
        .boxed();
    // Labelling the other slice makes it enter the selection: the watcher sees ADDED.
    let mut labelled = other.clone();
    labelled.metadata.labels =
        Some([("kubernetes.io/service-name".to_owned(), "x".to_owned())].into());
    server.update(&labelled).expect("update");
    assert!(matches!(
        stream.try_next().await,
        Ok(Some(WatchEvent::Added(_)))
    ));
    // And removing the label makes it leave: DELETED.
    server.update(&other).expect("update");
    assert!(matches!(
        stream.try_next().await,
        Ok(Some(WatchEvent::Deleted(_)))
    ));

    // The field selector kube-rs sends for a single Node.
    server
        .create(&node("node-a", "zone-a", "192.168.0.10"))
        .expect("create");
    server
        .create(&node("node-b", "zone-b", "192.168.0.11"))
        .expect("create");
    let nodes: Api<Node> = Api::all(client(&url));
    let list = nodes
        .list(&ListParams::default().fields("metadata.name=node-b"))
        .await
        .expect("list");
    assert_eq!(list.items.len(), 1);
    assert_eq!(list.items[0].metadata.name.as_deref(), Some("node-b"));
    let got = nodes.get("node-a").await.expect("get");
    assert_eq!(got.metadata.name.as_deref(), Some("node-a"));
    match nodes.get("node-z").await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 404),
        other => panic!("expected 404, got {other:?}"),
    }
}

#[tokio::test]
async fn unavailable_server_answers_503_and_recovers() {
    let (server, url) = TestApiServer::start().await.expect("server");
    let api: Api<Service> = Api::all(client(&url));
    server.set_available(false);
    match api.list(&ListParams::default()).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 503),
        other => panic!("expected 503, got {other:?}"),
    }
    server.set_refusing();
    assert!(api.list(&ListParams::default()).await.is_err(), "refused");
    server.set_available(true);
    api.list(&ListParams::default())
        .await
        .expect("served again");
}

#[tokio::test]
async fn streaming_lists_send_initial_events_and_the_end_bookmark() {
    use kube::runtime::watcher::{self, Event};
    let (server, url) = TestApiServer::start().await.expect("server");
    server
        .create(&service("default", "a", "10.96.0.1", 80))
        .expect("create");
    server
        .create(&service("default", "b", "10.96.0.2", 80))
        .expect("create");
    let api: Api<Service> = Api::all(client(&url));
    let mut w = watcher::watcher(api, watcher::Config::default().streaming_lists()).boxed();
    let mut seen = Vec::new();
    while seen.last().map(String::as_str) != Some("InitDone") {
        let ev = w.try_next().await.expect("event").expect("open stream");
        seen.push(ev.to_string());
    }
    assert_eq!(seen, ["Init", "InitApply(a)", "InitApply(b)", "InitDone"]);
    server
        .create(&service("default", "c", "10.96.0.3", 80))
        .expect("create");
    match w.try_next().await.expect("event").expect("open stream") {
        Event::Apply(s) => assert_eq!(s.metadata.name.as_deref(), Some("c")),
        other => panic!("expected Apply(c), got {other}"),
    }
}
