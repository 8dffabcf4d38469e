//! Errors of the watch crate. Every message names the object (`Service default/web`,
//! `EndpointSlice default/web-abc12`) so an operator can find it in the cluster.

use std::path::PathBuf;

/// What went wrong, and with which object.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An object carried a value the model cannot take: an invalid IP, a port out of range,
    /// an unknown protocol. The object is skipped; everything else keeps flowing.
    #[error("{kind} {namespace}/{name}: {reason}")]
    BadObject {
        /// `Service`, `EndpointSlice` or `Node`.
        kind: &'static str,
        /// The object's namespace (empty for a Node).
        namespace: String,
        /// The object's name.
        name: String,
        /// Why, in words, naming the field.
        reason: String,
    },
    /// The engine's model rejected a translated Service or endpoint.
    #[error("{kind} {namespace}/{name}: {source}")]
    Rejected {
        /// `Service` or `EndpointSlice`.
        kind: &'static str,
        /// The object's namespace.
        namespace: String,
        /// The object's name.
        name: String,
        /// The model's reason (boxed: it is large, and errors are the rare path).
        #[source]
        source: Box<kube_ipvs_diff::Error>,
    },
    /// A manifest file could not be read.
    #[error("manifest {path}: {source}")]
    ReadManifest {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A manifest document did not parse as YAML, or as the object it says it is.
    #[error("manifest {path}: document {index}: {reason}")]
    ParseManifest {
        /// The file.
        path: PathBuf,
        /// The document's place in the file, counted from 1 as a person counts.
        index: usize,
        /// Why, in words.
        reason: String,
    },
    /// The consumer of the change stream went away.
    #[error("the change set receiver was dropped")]
    ReceiverGone,
}

/// Result with the watch crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
