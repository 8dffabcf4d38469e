//! Services, EndpointSlices and this node's Node object, from the API server (kube-rs) or from
//! manifest files, turned into the diff engine's model.
//!
//! The pieces, from the outside in:
//! - [`cluster`] runs kube-rs watchers (with backoff) against the API server; no raw object is
//!   kept once translated (no reflector stores), so memory follows the model, not the objects;
//! - [`manifest`] reads YAML files and presents each reload as a relist;
//! - [`driver`] is the event loop both share: it feeds a [`Tracker`] and hands out
//!   [`ChangeSet`]s no more often than a minimum interval, the first only after Services and
//!   EndpointSlices were both listed;
//! - [`lean`] decodes Services and EndpointSlices without the metadata nothing here reads;
//! - [`tracker`] holds the translated state and computes change sets;
//! - [`translate`] is the pure translation of k8s-openapi objects into the model;
//! - [`tls`] picks the TLS cipher order the API client uses, as Go's crypto/tls does.
//!
//! This crate never talks to the kernel. An API outage leaves the last good state in place:
//! nothing here removes a Service unless the API said it is gone.

pub mod cluster;
pub mod driver;
pub mod error;
pub mod lean;
pub mod manifest;
pub mod tls;
pub mod tracker;
pub mod translate;

pub use cluster::{ClusterWatch, WatchConfig};
pub use error::{Error, Result};
pub use tracker::{ChangeSet, ServiceChange, Skipped, Tracker};
pub use translate::{
    NodeInfo, TranslateOptions, TranslatedService, TranslatedSlice, translate_node,
    translate_service, translate_slice, translate_slices,
};
