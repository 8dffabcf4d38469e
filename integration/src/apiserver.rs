//! A test API server that speaks the Kubernetes list/watch protocol for Services,
//! EndpointSlices and Nodes, so the real kube-rs client can be exercised end to end.
//!
//! It owns an in-memory object store with a global, monotonically increasing resourceVersion
//! and a bounded event history. Watches from a resourceVersion older than the history window
//! get an `ERROR` event carrying a `Status` with code 410 and reason `Expired`, as the real
//! server sends after compaction. Lists are paginated with continue tokens that pin a
//! snapshot, and an expired token is answered with HTTP 410.
//!
//! It must not know about the watch crate or the engine: it serves JSON objects, nothing more.
//! Test controls (`TestApiServer` methods) change objects, drop watch connections, expire the
//! history, make the server unavailable, add latency and send bookmarks.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// The error type a watch body can fail with; a failed body makes hyper cut the connection
/// without the terminating chunk, which is what a dropped connection looks like to a client.
type BodyError = Box<dyn std::error::Error + Send + Sync>;
type Body = BoxBody<Bytes, BodyError>;

/// How many events the server keeps for watches that resume from an older resourceVersion.
const DEFAULT_HISTORY: usize = 10_000;

/// Errors from the test controls.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object could not be turned into JSON.
    #[error("object {kind} {name}: cannot serialise: {source}")]
    Serialise {
        kind: String,
        name: String,
        #[source]
        source: serde_json::Error,
    },
    /// The object lacks a field the server needs.
    #[error("object {0}: missing kind or metadata.name")]
    Incomplete(String),
    /// The object's kind is not one this server serves.
    #[error("object kind {0} is not served by the test API server")]
    UnknownKind(String),
    /// Create of an object that already exists.
    #[error("{kind} {key} already exists")]
    AlreadyExists { kind: String, key: String },
    /// Update or delete of an object that does not exist.
    #[error("{kind} {key} not found")]
    NotFound { kind: String, key: String },
    /// Binding the listening socket failed.
    #[error("cannot bind the test API server: {0}")]
    Bind(#[source] std::io::Error),
}

/// Result alias for the test controls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The resources this server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    fn from_kind(kind: &str) -> Option<Self> {
        match kind {
            "Service" => Some(Self::Service),
            "EndpointSlice" => Some(Self::EndpointSlice),
            "Node" => Some(Self::Node),
            _ => None,
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::Service => "Service",
            Self::EndpointSlice => "EndpointSlice",
            Self::Node => "Node",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Self::Service | Self::Node => "v1",
            Self::EndpointSlice => "discovery.k8s.io/v1",
        }
    }

    fn namespaced(self) -> bool {
        !matches!(self, Self::Node)
    }
}

/// Namespace ("" for cluster-scoped) and name.
type Key = (String, String);

#[derive(Debug, Clone)]
struct StoredEvent {
    rv: u64,
    kind: Kind,
    kind_type: &'static str,
    /// The object before the change, for selector transitions; `None` for ADDED.
    old: Option<Arc<Value>>,
    /// The object after the change, or the deleted object carrying the delete's resourceVersion.
    new: Arc<Value>,
}

/// An open watch connection.
struct Watcher {
    kind: Kind,
    filter: Filter,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<WatchMsg>,
}

enum WatchMsg {
    Line(Bytes),
    /// Cut the connection without ending the chunked body properly.
    Abort,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Availability {
    Up,
    /// Every request is answered with 503 and a `Status`, as an overloaded server does.
    Unavailable,
    /// Connections are accepted and closed at once, as a server that is going away does.
    Refusing,
}

struct State {
    rv: u64,
    objects: HashMap<Kind, BTreeMap<Key, Arc<Value>>>,
    history: VecDeque<StoredEvent>,
    history_limit: usize,
    /// Watches from a resourceVersion below this get 410 Gone.
    oldest_watchable: u64,
    watchers: Vec<Watcher>,
    /// How many watches are registered, for tests that must wait until a client is watching.
    watch_count: tokio::sync::watch::Sender<usize>,
    /// Every watch request: its kind and the resourceVersion it started from (0 for none).
    watch_starts: Vec<(Kind, u64)>,
    /// Continue tokens: snapshot id to (resourceVersion, remaining items).
    snapshots: HashMap<u64, Snapshot>,
    next_snapshot: u64,
    availability: Availability,
    latency: Duration,
    next_uid: u64,
    requests: u64,
}

/// The resourceVersion of a paginated list and the items its later pages will serve.
type Snapshot = (u64, Arc<Vec<Arc<Value>>>);

/// A running test API server. Dropping it stops the accept loop; open connections close with it.
pub struct TestApiServer {
    state: Arc<Mutex<State>>,
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        self.accept.abort();
        // Closing every watch channel ends the connection tasks, which otherwise would keep
        // streaming to clients of a server the test considers gone.
        lock(&self.state).watchers.clear();
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock only happens in a failing test; the state is still usable.
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl TestApiServer {
    /// Starts the server on 127.0.0.1 with an ephemeral port; returns the handle and its URL.
    pub async fn start() -> Result<(Self, String)> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(Error::Bind)?;
        let addr = listener.local_addr().map_err(Error::Bind)?;
        let state = Arc::new(Mutex::new(State {
            rv: 1,
            objects: HashMap::new(),
            history: VecDeque::new(),
            history_limit: DEFAULT_HISTORY,
            oldest_watchable: 0,
            watchers: Vec::new(),
            watch_count: tokio::sync::watch::Sender::new(0),
            watch_starts: Vec::new(),
            snapshots: HashMap::new(),
            next_snapshot: 0,
            availability: Availability::Up,
            latency: Duration::ZERO,
            next_uid: 0,
            requests: 0,
        }));
        let accept_state = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                if lock(&accept_state).availability == Availability::Refusing {
                    drop(stream);
                    continue;
                }
                // Go's net package, and so the real API server, disables Nagle on every
                // connection; without it small watch events wait for delayed ACKs (~40 ms).
                let _ = stream.set_nodelay(true);
                let conn_state = accept_state.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let st = conn_state.clone();
                        async move { Ok::<_, Infallible>(handle(st, req).await) }
                    });
                    // Connection errors are expected when a test drops watches or stops the server.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        let url = format!("http://{addr}");
        Ok((
            Self {
                state,
                addr,
                accept,
            },
            url,
        ))
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Creates an object (a k8s-openapi type such as `Service`, `EndpointSlice` or `Node`).
    pub fn create<K>(&self, obj: &K) -> Result<u64>
    where
        K: k8s_openapi::Resource + serde::Serialize,
    {
        self.create_json(to_json(obj)?)
    }

    /// Replaces an existing object.
    pub fn update<K>(&self, obj: &K) -> Result<u64>
    where
        K: k8s_openapi::Resource + serde::Serialize,
    {
        self.update_json(to_json(obj)?)
    }

    /// Creates the object, or replaces it if it exists.
    pub fn apply<K>(&self, obj: &K) -> Result<u64>
    where
        K: k8s_openapi::Resource + serde::Serialize,
    {
        self.apply_json(to_json(obj)?)
    }

    /// Deletes an object by kind (`K`), namespace and name.
    pub fn delete<K: k8s_openapi::Resource>(&self, namespace: &str, name: &str) -> Result<u64> {
        let kind = Kind::from_kind(K::KIND).ok_or_else(|| Error::UnknownKind(K::KIND.into()))?;
        self.delete_kind(kind, namespace, name)
    }

    /// Creates an object given as JSON; it must carry `kind` and `metadata.name`.
    pub fn create_json(&self, obj: Value) -> Result<u64> {
        self.write(obj, Write::Create)
    }

    /// Replaces an object given as JSON.
    pub fn update_json(&self, obj: Value) -> Result<u64> {
        self.write(obj, Write::Update)
    }

    /// Creates or replaces an object given as JSON.
    pub fn apply_json(&self, obj: Value) -> Result<u64> {
        self.write(obj, Write::Apply)
    }

    /// Deletes an object; returns the resourceVersion of the deletion.
    pub fn delete_kind(&self, kind: Kind, namespace: &str, name: &str) -> Result<u64> {
        let mut st = lock(&self.state);
        let ns = if kind.namespaced() { namespace } else { "" };
        let key = (ns.to_owned(), name.to_owned());
        let Some(old) = st.objects.entry(kind).or_default().remove(&key) else {
            return Err(Error::NotFound {
                kind: kind.kind().into(),
                key: format!("{ns}/{name}"),
            });
        };
        st.rv += 1;
        let rv = st.rv;
        let mut deleted = (*old).clone();
        set_rv(&mut deleted, rv);
        st.record(StoredEvent {
            rv,
            kind,
            kind_type: "DELETED",
            old: Some(old),
            new: Arc::new(deleted),
        });
        Ok(rv)
    }

    fn write(&self, mut obj: Value, mode: Write) -> Result<u64> {
        let kind_name = obj
            .get("kind")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Incomplete(obj.to_string()))?
            .to_owned();
        let kind = Kind::from_kind(&kind_name).ok_or(Error::UnknownKind(kind_name))?;
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Incomplete(obj.to_string()))?
            .to_owned();
        let ns = if kind.namespaced() {
            obj.pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or("default")
                .to_owned()
        } else {
            String::new()
        };
        let mut st = lock(&self.state);
        let key = (ns.clone(), name);
        let old = st.objects.entry(kind).or_default().get(&key).cloned();
        match (mode, &old) {
            (Write::Create, Some(_)) => {
                return Err(Error::AlreadyExists {
                    kind: kind.kind().into(),
                    key: format!("{}/{}", key.0, key.1),
                });
            }
            (Write::Update, None) => {
                return Err(Error::NotFound {
                    kind: kind.kind().into(),
                    key: format!("{}/{}", key.0, key.1),
                });
            }
            _ => {}
        }
        st.rv += 1;
        let rv = st.rv;
        // The server owns uid, creationTimestamp and resourceVersion; keep uid across updates.
        let uid = match old
            .as_ref()
            .and_then(|o| o.pointer("/metadata/uid").cloned())
        {
            Some(uid) => uid,
            None => {
                st.next_uid += 1;
                json!(format!("00000000-0000-4000-8000-{:012x}", st.next_uid))
            }
        };
        if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("uid".into(), uid);
            if kind.namespaced() {
                meta.insert("namespace".into(), json!(ns));
            }
            meta.entry("creationTimestamp")
                .or_insert_with(|| json!("2026-01-01T00:00:00Z"));
        }
        obj["apiVersion"] = json!(kind.api_version());
        set_rv(&mut obj, rv);
        let new = Arc::new(obj);
        st.objects.entry(kind).or_default().insert(key, new.clone());
        let kind_type = if old.is_some() { "MODIFIED" } else { "ADDED" };
        st.record(StoredEvent {
            rv,
            kind,
            kind_type,
            old,
            new,
        });
        Ok(rv)
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.state).rv
    }

    /// How many watch connections are open.
    pub fn open_watches(&self) -> usize {
        let mut st = lock(&self.state);
        st.watchers.retain(|w| !w.tx.is_closed());
        st.watchers.len()
    }

    /// How many HTTP requests the server has answered (including failed ones).
    pub fn requests(&self) -> u64 {
        lock(&self.state).requests
    }

    /// Cuts every open watch connection mid-stream, as a load balancer or a restarting
    /// server does. Clients see a broken body and must re-watch.
    pub fn drop_watches(&self) {
        let mut st = lock(&self.state);
        st.abort_watches();
    }

    /// Ends every open watch cleanly, after what was already queued for it, as the server does
    /// when a watch reaches its `timeoutSeconds`. Clients resume from their last version.
    pub fn close_watches(&self) {
        let mut st = lock(&self.state);
        st.watchers.clear();
        st.watch_count.send_replace(0);
    }

    /// Waits until at least `n` watches are open: a client has finished its lists and is
    /// watching, so a change made now reaches it as a watch event, not in a list.
    pub async fn wait_watches(&self, n: usize) {
        let mut rx = lock(&self.state).watch_count.subscribe();
        // The sender lives as long as the server, which `self` keeps alive.
        let _ = rx.wait_for(|c| *c >= n).await;
    }

    /// Every watch request so far: its kind and the resourceVersion it started from.
    pub fn watch_starts(&self) -> Vec<(Kind, u64)> {
        lock(&self.state).watch_starts.clone()
    }

    /// Forgets the event history and every continue token, as etcd compaction does: the next
    /// watch from any resourceVersion before now gets 410 Gone. Open watches are cut, so the
    /// clients must come back and meet the 410.
    pub fn expire_history(&self) {
        let mut st = lock(&self.state);
        st.history.clear();
        // One past the current version, so even a client that is fully caught up must re-list.
        st.oldest_watchable = st.rv + 1;
        st.snapshots.clear();
        st.abort_watches();
    }

    /// Sets how many events the history keeps.
    pub fn set_history_limit(&self, limit: usize) {
        lock(&self.state).history_limit = limit.max(1);
    }

    /// Answers every request with 503 (`available == false`) and cuts open watches; or
    /// serves normally again.
    pub fn set_available(&self, available: bool) {
        let mut st = lock(&self.state);
        st.availability = if available {
            Availability::Up
        } else {
            Availability::Unavailable
        };
        if !available {
            st.abort_watches();
        }
    }

    /// Closes every new connection at once and cuts open watches, as a server that is down.
    pub fn set_refusing(&self) {
        let mut st = lock(&self.state);
        st.availability = Availability::Refusing;
        st.abort_watches();
    }

    /// Delays every response (list, get, and the start of a watch) by `latency`.
    pub fn set_latency(&self, latency: Duration) {
        lock(&self.state).latency = latency;
    }

    /// Sends a BOOKMARK with the current resourceVersion to every watch that asked for them.
    pub fn send_bookmarks(&self) {
        let mut st = lock(&self.state);
        let rv = st.rv;
        st.watchers.retain(|w| {
            if !w.bookmarks {
                return true;
            }
            let line = event_line("BOOKMARK", &bookmark_object(w.kind, rv, false));
            w.tx.send(WatchMsg::Line(line)).is_ok()
        });
    }
}

#[derive(Debug, Clone, Copy)]
enum Write {
    Create,
    Update,
    Apply,
}

fn to_json<K: k8s_openapi::Resource + serde::Serialize>(obj: &K) -> Result<Value> {
    let mut v = serde_json::to_value(obj).map_err(|source| Error::Serialise {
        kind: K::KIND.into(),
        name: String::new(),
        source,
    })?;
    // k8s-openapi types serialise without their type meta; the real server always sets it.
    v["kind"] = json!(K::KIND);
    v["apiVersion"] = json!(K::API_VERSION);
    Ok(v)
}

fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
    }
}

fn bookmark_object(kind: Kind, rv: u64, initial_end: bool) -> Value {
    let mut meta = json!({ "resourceVersion": rv.to_string() });
    if initial_end {
        meta["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    json!({ "kind": kind.kind(), "apiVersion": kind.api_version(), "metadata": meta })
}

fn event_line(kind_type: &str, obj: &Value) -> Bytes {
    let mut s = json!({ "type": kind_type, "object": obj }).to_string();
    s.push('\n');
    Bytes::from(s)
}

impl State {
    fn count_watches(&mut self) {
        self.watchers.retain(|w| !w.tx.is_closed());
        self.watch_count.send_replace(self.watchers.len());
    }

    /// Cuts every open watch mid-stream.
    fn abort_watches(&mut self) {
        for w in self.watchers.drain(..) {
            let _ = w.tx.send(WatchMsg::Abort);
        }
        self.watch_count.send_replace(0);
    }

    /// Appends an event to the history and fans it out to the open watches whose selectors
    /// see it, turning selector transitions into ADDED/DELETED as the real server does.
    fn record(&mut self, ev: StoredEvent) {
        self.watchers.retain(|w| {
            if w.kind != ev.kind {
                return true;
            }
            match translate_for(&w.filter, &ev) {
                Some((t, obj)) => w.tx.send(WatchMsg::Line(event_line(t, obj))).is_ok(),
                None => !w.tx.is_closed(),
            }
        });
        self.history.push_back(ev);
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.oldest_watchable = dropped.rv;
            }
        }
    }
}

/// What a watcher with `filter` sees of `ev`, if anything.
fn translate_for<'a>(filter: &Filter, ev: &'a StoredEvent) -> Option<(&'static str, &'a Value)> {
    let old_match = ev.old.as_deref().is_some_and(|o| filter.matches(o));
    let new_match = filter.matches(&ev.new);
    match ev.kind_type {
        "DELETED" => old_match.then_some(("DELETED", &*ev.new)),
        _ => match (old_match, new_match) {
            (false, true) => Some(("ADDED", &*ev.new)),
            (true, true) => Some((ev.kind_type, &*ev.new)),
            // The object left the selection: the watcher sees it deleted.
            (true, false) => Some(("DELETED", &*ev.new)),
            (false, false) => None,
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Selectors.

#[derive(Debug, Clone, Default)]
struct Filter {
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<(String, bool, String)>,
}

#[derive(Debug, Clone)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        let meta = obj.get("metadata");
        let get = |p: &str| meta.and_then(|m| m.get(p)).and_then(Value::as_str);
        if let Some(ns) = &self.namespace
            && get("namespace") != Some(ns.as_str())
        {
            return false;
        }
        let labels = meta
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_object);
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|r| match r {
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
            LabelReq::Eq(k, v) => label(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => label(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
        });
        let fields_ok = self.fields.iter().all(|(path, eq, want)| {
            let have = match path.as_str() {
                "metadata.name" => get("name"),
                "metadata.namespace" => get("namespace"),
                _ => None,
            }
            .unwrap_or("");
            (have == want) == *eq
        });
        labels_ok && fields_ok
    }
}

fn parse_label_selector(s: &str) -> std::result::Result<Vec<LabelReq>, String> {
    let mut out = Vec::new();
    // Split on commas outside parentheses.
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
        let set = |rest: &str| -> std::result::Result<Vec<String>, String> {
            let rest = rest.trim();
            let inner = rest
                .strip_prefix('(')
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(|| format!("bad set in label selector {part:?}"))?;
            Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
        };
        let req = if let Some(k) = part.strip_prefix('!') {
            LabelReq::NotExists(k.trim().to_owned())
        } else if let Some((k, v)) = part.split_once("!=") {
            LabelReq::NotEq(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once("==") {
            LabelReq::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once('=') {
            LabelReq::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, rest)) = part.split_once(" notin ") {
            LabelReq::NotIn(k.trim().into(), set(rest)?)
        } else if let Some((k, rest)) = part.split_once(" in ") {
            LabelReq::In(k.trim().into(), set(rest)?)
        } else if part.contains(' ') {
            return Err(format!("unable to parse label requirement {part:?}"));
        } else {
            LabelReq::Exists(part.to_owned())
        };
        out.push(req);
    }
    Ok(out)
}

fn parse_field_selector(s: &str) -> std::result::Result<Vec<(String, bool, String)>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, eq, v) = if let Some((k, v)) = part.split_once("!=") {
            (k, false, v)
        } else if let Some((k, v)) = part.split_once("==") {
            (k, true, v)
        } else if let Some((k, v)) = part.split_once('=') {
            (k, true, v)
        } else {
            return Err(format!("invalid field selector {part:?}"));
        };
        let k = k.trim();
        if k != "metadata.name" && k != "metadata.namespace" {
            return Err(format!("field label not supported: {k}"));
        }
        out.push((k.to_owned(), eq, v.trim().to_owned()));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// HTTP.

fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn respond_json(code: StatusCode, v: &Value) -> Response<Body> {
    let body = Full::new(Bytes::from(v.to_string()))
        .map_err(|never: Infallible| match never {})
        .boxed();
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(body)
        .unwrap_or_else(|_| Response::new(empty()))
}

fn empty() -> Body {
    Full::new(Bytes::new())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

fn status_response(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    respond_json(code, &status_body(code.as_u16(), reason, message))
}

/// The route a path names.
struct Route {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
}

fn route(path: &str) -> Option<Route> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group_len, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => (2, rest),
        ["apis", "discovery.k8s.io", "v1", rest @ ..] => (3, rest),
        _ => return None,
    };
    let core = group_len == 2;
    let kind_of = |plural: &str| match (core, plural) {
        (true, "services") => Some(Kind::Service),
        (true, "nodes") => Some(Kind::Node),
        (false, "endpointslices") => Some(Kind::EndpointSlice),
        _ => None,
    };
    match rest {
        [plural] => Some(Route {
            kind: kind_of(plural)?,
            namespace: None,
            name: None,
        }),
        [plural, name] => {
            let kind = kind_of(plural)?;
            (!kind.namespaced()).then(|| Route {
                kind,
                namespace: None,
                name: Some((*name).to_owned()),
            })
        }
        ["namespaces", ns, plural] => {
            let kind = kind_of(plural)?;
            kind.namespaced().then(|| Route {
                kind,
                namespace: Some((*ns).to_owned()),
                name: None,
            })
        }
        ["namespaces", ns, plural, name] => {
            let kind = kind_of(plural)?;
            kind.namespaced().then(|| Route {
                kind,
                namespace: Some((*ns).to_owned()),
                name: Some((*name).to_owned()),
            })
        }
        _ => None,
    }
}

fn query_map(q: Option<&str>) -> HashMap<String, String> {
    let mut m = HashMap::new();
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        m.insert(percent_decode(k), percent_decode(v));
    }
    m
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn handle(state: Arc<Mutex<State>>, req: Request<Incoming>) -> Response<Body> {
    let (availability, latency) = {
        let mut st = lock(&state);
        st.requests += 1;
        (st.availability, st.latency)
    };
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    if availability != Availability::Up {
        let mut resp = status_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the test API server is unavailable",
        );
        // The real server's hint for clients that retry on their own.
        resp.headers_mut()
            .insert("retry-after", hyper::header::HeaderValue::from_static("1"));
        return resp;
    }
    if req.method() != Method::GET {
        return status_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the test API server is read-only over HTTP; use the test controls",
        );
    }
    let path = req.uri().path().to_owned();
    match path.as_str() {
        "/version" => {
            return respond_json(
                StatusCode::OK,
                &json!({
                    "major": "1", "minor": "34", "gitVersion": "v1.34.0-kube-ipvs-test",
                    "gitCommit": "", "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                    "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"
                }),
            );
        }
        "/api" => {
            return respond_json(
                StatusCode::OK,
                &json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}),
            );
        }
        "/apis" => {
            return respond_json(
                StatusCode::OK,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [{
                    "name": "discovery.k8s.io",
                    "versions": [{"groupVersion": "discovery.k8s.io/v1", "version": "v1"}],
                    "preferredVersion": {"groupVersion": "discovery.k8s.io/v1", "version": "v1"}
                }]}),
            );
        }
        _ => {}
    }
    let Some(route) = route(&path) else {
        return status_response(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("the server could not find the requested resource ({path})"),
        );
    };
    let q = query_map(req.uri().query());
    let mut filter = Filter {
        namespace: route.namespace.clone(),
        ..Filter::default()
    };
    if let Some(s) = q.get("labelSelector") {
        match parse_label_selector(s) {
            Ok(l) => filter.labels = l,
            Err(e) => return status_response(StatusCode::BAD_REQUEST, "BadRequest", &e),
        }
    }
    if let Some(s) = q.get("fieldSelector") {
        match parse_field_selector(s) {
            Ok(f) => filter.fields = f,
            Err(e) => return status_response(StatusCode::BAD_REQUEST, "BadRequest", &e),
        }
    }
    if let Some(name) = route.name {
        return get_one(&state, route.kind, route.namespace.as_deref(), &name);
    }
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        watch(&state, route.kind, filter, &q)
    } else {
        list(&state, route.kind, &filter, &q)
    }
}

fn get_one(state: &Mutex<State>, kind: Kind, ns: Option<&str>, name: &str) -> Response<Body> {
    let st = lock(state);
    let key = (ns.unwrap_or("").to_owned(), name.to_owned());
    match st.objects.get(&kind).and_then(|m| m.get(&key)) {
        Some(obj) => respond_json(StatusCode::OK, obj),
        None => status_response(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{}s \"{name}\" not found", kind.kind().to_lowercase()),
        ),
    }
}

fn list(
    state: &Mutex<State>,
    kind: Kind,
    filter: &Filter,
    q: &HashMap<String, String>,
) -> Response<Body> {
    let mut st = lock(state);
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let (rv, items) = if let Some(token) = q.get("continue").filter(|t| !t.is_empty()) {
        let snap = token
            .parse::<u64>()
            .ok()
            .and_then(|id| st.snapshots.remove(&id));
        match snap {
            Some(s) => s,
            None => {
                return status_response(
                    StatusCode::GONE,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list \
                     result. You can start a new list without the continue parameter.",
                );
            }
        }
    } else {
        let requested = q
            .get("resourceVersion")
            .and_then(|r| r.parse::<u64>().ok())
            .unwrap_or(0);
        let exact = q.get("resourceVersionMatch").is_some_and(|m| m == "Exact");
        // An exact read at a version the history no longer covers is gone, as after compaction.
        if exact && requested != 0 && requested < st.oldest_watchable {
            return status_response(
                StatusCode::GONE,
                "Expired",
                &format!(
                    "too old resource version: {requested} ({})",
                    st.oldest_watchable
                ),
            );
        }
        let items: Vec<Arc<Value>> = st
            .objects
            .get(&kind)
            .map(|m| m.values().filter(|o| filter.matches(o)).cloned().collect())
            .unwrap_or_default();
        (st.rv, Arc::new(items))
    };
    let (page, cont) = match limit {
        Some(l) if items.len() > l => {
            let rest = Arc::new(items[l..].to_vec());
            st.next_snapshot += 1;
            let id = st.next_snapshot;
            st.snapshots.insert(id, (rv, rest));
            (&items[..l], Some(id.to_string()))
        }
        _ => (&items[..], None),
    };
    let mut meta = json!({ "resourceVersion": rv.to_string() });
    if let Some(c) = cont {
        meta["continue"] = json!(c);
    }
    let body = json!({
        "kind": format!("{}List", kind.kind()),
        "apiVersion": kind.api_version(),
        "metadata": meta,
        "items": page.iter().map(|o| &**o).collect::<Vec<_>>(),
    });
    respond_json(StatusCode::OK, &body)
}

fn watch(
    state: &Arc<Mutex<State>>,
    kind: Kind,
    filter: Filter,
    q: &HashMap<String, String>,
) -> Response<Body> {
    let (tx, rx) = mpsc::unbounded_channel::<WatchMsg>();
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let initial_events = q.get("sendInitialEvents").is_some_and(|b| b == "true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs);
    let from = q
        .get("resourceVersion")
        .filter(|r| !r.is_empty())
        .map(|r| r.parse::<u64>());
    {
        let mut st = lock(state);
        let send = |t: &str, o: &Value| {
            let _ = tx.send(WatchMsg::Line(event_line(t, o)));
        };
        let from = match from {
            Some(Ok(rv)) => rv,
            None => 0,
            Some(Err(_)) => {
                return status_response(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "resourceVersion must be an integer",
                );
            }
        };
        if from == 0 || initial_events {
            // No version, "0", or sendInitialEvents: start with the current state as ADDED.
            for o in st.objects.get(&kind).into_iter().flat_map(|m| m.values()) {
                if filter.matches(o) {
                    send("ADDED", o);
                }
            }
            if initial_events && bookmarks {
                send("BOOKMARK", &bookmark_object(kind, st.rv, true));
            }
        } else if from < st.oldest_watchable {
            // The real server answers 200 and then a single ERROR event with a 410 Status.
            let status = status_body(
                410,
                "Expired",
                &format!("too old resource version: {from} ({})", st.oldest_watchable),
            );
            send("ERROR", &status);
            drop(tx);
            return stream_response(rx, None);
        } else {
            for ev in st.history.iter().filter(|e| e.rv > from && e.kind == kind) {
                if let Some((t, o)) = translate_for(&filter, ev) {
                    send(t, o);
                }
            }
        }
        st.watchers.push(Watcher {
            kind,
            filter,
            bookmarks,
            tx,
        });
        st.watch_starts.push((kind, from));
        st.count_watches();
    }
    stream_response(rx, timeout)
}

fn stream_response(
    mut rx: mpsc::UnboundedReceiver<WatchMsg>,
    timeout: Option<Duration>,
) -> Response<Body> {
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let stream = async_stream(move |yield_| async move {
        loop {
            let msg = match deadline {
                // At timeoutSeconds the server ends the watch cleanly, as the real one does.
                Some(d) => tokio::time::timeout_at(d, rx.recv())
                    .await
                    .unwrap_or_default(),
                None => rx.recv().await,
            };
            match msg {
                Some(WatchMsg::Line(b)) => {
                    if yield_.send(Ok(Frame::data(b))).await.is_err() {
                        return;
                    }
                }
                Some(WatchMsg::Abort) => {
                    let _ = yield_
                        .send(Err("watch connection dropped by the test".into()))
                        .await;
                    return;
                }
                None => return,
            }
        }
    });
    let body = StreamBody::new(stream).boxed();
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(body)
        .unwrap_or_else(|_| Response::new(empty()))
}

type FrameResult = std::result::Result<Frame<Bytes>, BodyError>;

/// A tiny generator: runs `f` as a task that pushes frames into a bounded channel, returned as
/// a stream. Bounded so a slow client applies back-pressure instead of growing memory.
fn async_stream<F, Fut>(f: F) -> impl futures::Stream<Item = FrameResult> + Send + 'static
where
    F: FnOnce(mpsc::Sender<FrameResult>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(f(tx));
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_selectors_parse_and_match() {
        let reqs = parse_label_selector(
            "kubernetes.io/service-name,!service.kubernetes.io/headless,a in (x, y),b!=z",
        )
        .expect("valid selector");
        let f = Filter {
            labels: reqs,
            ..Filter::default()
        };
        let obj = |labels: Value| json!({"metadata": {"name": "n", "labels": labels}});
        assert!(f.matches(&obj(json!({"kubernetes.io/service-name": "web", "a": "x"}))));
        assert!(!f.matches(&obj(json!({"kubernetes.io/service-name": "web", "a": "q"}))));
        assert!(!f.matches(&obj(json!({
            "kubernetes.io/service-name": "web", "a": "y", "service.kubernetes.io/headless": ""
        }))));
        assert!(!f.matches(&obj(
            json!({"kubernetes.io/service-name": "web", "a": "y", "b": "z"})
        )));
        assert!(!f.matches(&obj(json!({"a": "x"}))));
    }

    #[test]
    fn field_selectors_reject_unsupported_fields() {
        assert!(parse_field_selector("spec.nodeName=x").is_err());
        let f = Filter {
            fields: parse_field_selector("metadata.name=node-a").expect("valid"),
            ..Filter::default()
        };
        assert!(f.matches(&json!({"metadata": {"name": "node-a"}})));
        assert!(!f.matches(&json!({"metadata": {"name": "node-b"}})));
    }

    #[test]
    fn routes() {
        let r =
            route("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices").expect("route");
        assert_eq!(r.kind, Kind::EndpointSlice);
        assert_eq!(r.namespace.as_deref(), Some("default"));
        let r = route("/api/v1/nodes/node-a").expect("route");
        assert_eq!((r.kind, r.name.as_deref()), (Kind::Node, Some("node-a")));
        assert!(route("/api/v1/endpointslices").is_none());
        assert!(route("/api/v1/services/x").is_none());
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(
            percent_decode("kubernetes.io%2Fservice-name%3Dweb"),
            "kubernetes.io/service-name=web"
        );
        assert_eq!(percent_decode("a%2"), "a%2");
    }
}
