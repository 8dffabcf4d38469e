//! The manifest source: Services, EndpointSlices and optionally the Node from YAML files
//! (multi-document, a file or a directory), producing the same change stream as the cluster.
//!
//! Each reload is presented to the shared driver as a complete relist, so the diffing,
//! coalescing and "bad objects keep their last good state" rules are exactly the cluster's.
//! It owns file reading and YAML parsing; it must not interpret objects beyond their `kind`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::cluster::ClusterWatch;
use crate::driver::{DriverStats, WatchItem, drive};
use crate::error::{Error, Result};
use crate::tracker::{ChangeSet, Skipped, Tracker};
use crate::translate::TranslateOptions;

/// The objects found in a set of manifests.
#[derive(Debug, Clone, Default)]
pub struct Manifests {
    /// Every Service.
    pub services: Vec<Service>,
    /// Every EndpointSlice.
    pub slices: Vec<EndpointSlice>,
    /// Every Node.
    pub nodes: Vec<Node>,
}

/// The files a path names: the file itself, or the `.yaml`/`.yml` files of a directory
/// (not recursive), sorted so loading is deterministic.
pub fn manifest_files(path: &Path) -> Result<Vec<PathBuf>> {
    let read = |source| Error::ReadManifest {
        path: path.to_owned(),
        source,
    };
    if !path.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(read)? {
        let p = entry.map_err(read)?.path();
        let yaml = p
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e == "yaml" || e == "yml");
        if yaml && p.is_file() {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// Parses one file's text. A document that is not a Service, EndpointSlice, Node or a `List`
/// of them is ignored; a document that does not parse is an error naming it (counted from 1),
/// with the line and column.
pub fn parse_manifest(path: &Path, text: &str) -> Result<Manifests> {
    let docs: Vec<Value> = serde_saphyr::from_multiple_with_options(text, options(text.len()))
        .map_err(|e| syntax_error(path, text, &e))?;
    let mut out = Manifests::default();
    for (index, doc) in docs.into_iter().enumerate() {
        add_object(path, index + 1, doc, &mut out)?;
    }
    Ok(out)
}

/// The parser's limits for a text of `len` bytes. Its defaults suit a config file (1,024
/// documents, 250,000 nodes, a million events), and a cluster export of a few thousand Services
/// exceeds them; what they guard against, expansion by aliases, stays bounded by the alias and
/// anchor limits. A document takes at least 4 bytes (`---` and a newline) and a node or an event
/// at least one, so these scale with the input instead of refusing a large, honest file.
fn options(len: usize) -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_documents: (len / 4).max(1_024),
            max_nodes: len.max(250_000),
            max_events: len.max(1_000_000),
        },
    }
}

/// A YAML syntax error in our words: the document it is in (counted from 1), the line and
/// column in the file, and what the parser found, without its advice on Rust types.
fn syntax_error(path: &Path, text: &str, e: &serde_saphyr::Error) -> Error {
    let Some(at) = e.location() else {
        return Error::ParseManifest {
            path: path.to_owned(),
            index: 1,
            reason: format!("not valid YAML: {}", parser_words(&e.to_string())),
        };
    };
    let line = usize::try_from(at.line()).unwrap_or(usize::MAX);
    Error::ParseManifest {
        path: path.to_owned(),
        index: document_at(text, line),
        reason: format!(
            "not valid YAML at line {line}, column {}: {}",
            at.column(),
            parser_words(&e.to_string())
        ),
    }
}

/// Which document (counted from 1) holds line `line` (counted from 1): one more than the `---`
/// separators before it that follow some content (a leading `---` starts the first document).
fn document_at(text: &str, line: usize) -> usize {
    let mut index = 1;
    let mut content = false;
    for l in text.lines().take(line.saturating_sub(1)) {
        if l.starts_with("---") {
            if content {
                index += 1;
                content = false;
            }
        } else if !l.trim().is_empty() && !l.trim_start().starts_with('#') {
            content = true;
        }
    }
    index
}

/// The parser's description of a syntax error: its first line, without its own position prefix
/// (we give the position) and without advice meant for Rust programmers.
fn parser_words(message: &str) -> String {
    let first = message.lines().next().unwrap_or_default();
    let mut words = first.strip_prefix("error: ").unwrap_or(first);
    // `line N column M: ` when the parser repeats the position.
    if let Some(rest) = words.strip_prefix("line ")
        && let Some((_, after)) = rest.split_once(": ")
    {
        words = after;
    }
    // The parser's advice on Rust types ("...; use Option<String>") is not for our users.
    if let Some(cut) = words.find("; use ") {
        words = &words[..cut];
    }
    if words.contains("null into") || words.contains("deserialize null") {
        return "an empty key or value where text is expected".to_owned();
    }
    words.trim().to_owned()
}

fn add_object(path: &Path, index: usize, doc: Value, out: &mut Manifests) -> Result<()> {
    let bad = |reason: String| Error::ParseManifest {
        path: path.to_owned(),
        index,
        reason,
    };
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
    match kind {
        "Service" => out
            .services
            .push(serde_json::from_value(doc).map_err(|e| bad(format!("Service: {e}")))?),
        "EndpointSlice" => out
            .slices
            .push(serde_json::from_value(doc).map_err(|e| bad(format!("EndpointSlice: {e}")))?),
        "Node" => out
            .nodes
            .push(serde_json::from_value(doc).map_err(|e| bad(format!("Node: {e}")))?),
        "List" | "ServiceList" | "EndpointSliceList" => {
            let items = doc.get("items").and_then(Value::as_array).cloned();
            for item in items.into_iter().flatten() {
                add_object(path, index, item, out)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Loads a file or directory. A file that fails to read or parse is an error.
pub fn load(path: &Path) -> Result<Manifests> {
    let mut out = Manifests::default();
    for file in manifest_files(path)? {
        let text = std::fs::read_to_string(&file).map_err(|source| Error::ReadManifest {
            path: file.clone(),
            source,
        })?;
        let m = parse_manifest(&file, &text)?;
        out.services.extend(m.services);
        out.slices.extend(m.slices);
        out.nodes.extend(m.nodes);
    }
    Ok(out)
}

/// The state of a manifest set as one change set, for `plan` and tests: what the daemon would
/// hand the engine at its first sync. Bad objects are logged and left out.
pub fn snapshot(
    path: &Path,
    opts: &TranslateOptions,
    node_name: Option<&str>,
) -> Result<ChangeSet> {
    snapshot_with_skipped(path, opts, node_name).map(|(cs, _)| cs)
}

/// [`snapshot`], with what was left out (whole objects or some of their endpoints), for the
/// debugging commands to show.
pub fn snapshot_with_skipped(
    path: &Path,
    opts: &TranslateOptions,
    node_name: Option<&str>,
) -> Result<(ChangeSet, Vec<Skipped>)> {
    let m = load(path)?;
    let mut t = Tracker::new(opts.clone());
    t.relist_services(&m.services);
    t.relist_slices(&m.slices);
    if let Some(n) = pick_node(&m.nodes, node_name) {
        t.apply_node(n);
    }
    Ok((t.take_change_set().unwrap_or_default(), t.skipped()))
}

fn pick_node<'a>(nodes: &'a [Node], name: Option<&str>) -> Option<&'a Node> {
    let name = name?;
    nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(name))
}

/// How to watch manifests.
#[derive(Debug, Clone)]
pub struct ManifestConfig {
    /// The file or directory.
    pub path: PathBuf,
    /// This node's name, to pick its Node object from the manifests if there is one.
    pub node_name: Option<String>,
    /// Which Services are ours.
    pub translate: TranslateOptions,
    /// The minimum interval between change sets.
    pub min_interval: Duration,
    /// How often the files are checked for changes.
    pub poll_interval: Duration,
}

/// Reads every file; per file, the text if it could be read.
fn read_all(path: &Path) -> Result<BTreeMap<PathBuf, String>> {
    let mut out = BTreeMap::new();
    for file in manifest_files(path)? {
        let text = std::fs::read_to_string(&file).map_err(|source| Error::ReadManifest {
            path: file.clone(),
            source,
        })?;
        out.insert(file, text);
    }
    Ok(out)
}

type Senders = (
    mpsc::UnboundedSender<WatchItem<Service>>,
    mpsc::UnboundedSender<WatchItem<EndpointSlice>>,
    mpsc::UnboundedSender<WatchItem<Node>>,
);

fn send_list<K>(tx: &mpsc::UnboundedSender<WatchItem<K>>, objs: Vec<K>) -> bool {
    let mut ok = tx.send(Ok(Event::Init)).is_ok();
    for o in objs {
        ok &= tx.send(Ok(Event::InitApply(o))).is_ok();
    }
    ok && tx.send(Ok(Event::InitDone)).is_ok()
}

/// Polls the files and sends a relist whenever their contents change. A file that no longer
/// parses keeps its previous objects (an editor's half-written save must not remove Services);
/// a file that is removed takes its objects with it.
async fn poll(cfg: ManifestConfig, tx: Senders) {
    let mut texts: BTreeMap<PathBuf, String> = BTreeMap::new();
    let mut parsed: BTreeMap<PathBuf, Manifests> = BTreeMap::new();
    let mut first = true;
    let mut tick = tokio::time::interval(cfg.poll_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = match read_all(&cfg.path) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("keeping the last good manifests: {e}");
                continue;
            }
        };
        if !first && now == texts {
            continue;
        }
        first = false;
        let mut next = BTreeMap::new();
        for (file, text) in &now {
            match parse_manifest(file, text) {
                Ok(m) => {
                    next.insert(file.clone(), m);
                }
                Err(e) => {
                    tracing::warn!("keeping the last good version of the file: {e}");
                    if let Some(old) = parsed.get(file) {
                        next.insert(file.clone(), old.clone());
                    }
                }
            }
        }
        texts = now;
        parsed = next;
        let all = parsed.values();
        let services = all.clone().flat_map(|m| m.services.clone()).collect();
        let slices = all.clone().flat_map(|m| m.slices.clone()).collect();
        let nodes: Vec<Node> = all.flat_map(|m| m.nodes.clone()).collect();
        let node: Vec<Node> = pick_node(&nodes, cfg.node_name.as_deref())
            .cloned()
            .into_iter()
            .collect();
        let ok = send_list(&tx.0, services) & send_list(&tx.1, slices) & send_list(&tx.2, node);
        if !ok {
            return;
        }
    }
}

/// Starts watching manifests; the same change stream as [`crate::cluster::spawn`].
pub fn spawn(cfg: ManifestConfig) -> ClusterWatch {
    let (svc_tx, svc_rx) = mpsc::unbounded_channel();
    let (slice_tx, slice_rx) = mpsc::unbounded_channel();
    let (node_tx, node_rx) = mpsc::unbounded_channel();
    let (tx, changes) = mpsc::channel(16);
    let (stats_tx, stats) = tokio::sync::watch::channel(DriverStats::default());
    let tracker = Tracker::new(cfg.translate.clone());
    let min_interval = cfg.min_interval;
    let poller = tokio::spawn(poll(cfg, (svc_tx, slice_tx, node_tx)));
    let (services, slices, node) = (
        receiver_stream(svc_rx),
        receiver_stream(slice_rx),
        receiver_stream(node_rx),
    );
    let task = tokio::spawn(async move {
        drive(
            tracker,
            services,
            slices,
            node,
            min_interval,
            tx,
            Some(stats_tx),
        )
        .await;
        poller.abort();
    });
    ClusterWatch {
        changes,
        stats,
        task,
    }
}

fn receiver_stream<T: Send + 'static>(
    rx: mpsc::UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parsers_words_lose_its_position_prefix_and_its_rust_advice() {
        assert_eq!(
            parser_words("error: line 5 column 4: mapping values are not allowed in this context"),
            "mapping values are not allowed in this context"
        );
        assert_eq!(
            parser_words("cannot deserialize null into string; use Option<String>"),
            "an empty key or value where text is expected"
        );
        assert_eq!(
            parser_words("unclosed quote\n  |\n3 | b: \"x"),
            "unclosed quote"
        );
    }
}
