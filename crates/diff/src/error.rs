//! Errors of the diff engine. Every message names the object that was rejected, so an
//! operator can find it in the cluster without reading code.

use crate::model::ServiceName;

/// What went wrong, and with which object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A Service failed validation before it could reach the kernel.
    #[error("service {service}: {reason}")]
    InvalidService {
        /// The Service that was rejected.
        service: ServiceName,
        /// Why, in words.
        reason: String,
    },
    /// An endpoint of a Service failed validation.
    #[error("service {service}: endpoint {endpoint}: {reason}")]
    InvalidEndpoint {
        /// The Service the endpoint belongs to.
        service: ServiceName,
        /// The endpoint address as given.
        endpoint: String,
        /// Why, in words.
        reason: String,
    },
    /// A scheduler name (from `--scheduler` or the Service annotation) is not one the kernel has.
    #[error("invalid IPVS scheduler {input:?}: {reason}")]
    InvalidScheduler {
        /// The text as given.
        input: String,
        /// Why, in words.
        reason: String,
    },
    /// A CIDR (exclude CIDRs, loadBalancerSourceRanges) did not parse.
    #[error("invalid CIDR {input:?}: {reason}")]
    InvalidCidr {
        /// The text as given.
        input: String,
        /// Why, in words.
        reason: String,
    },
    /// The node context is unusable (for example an empty node name).
    #[error("node {node:?}: {reason}")]
    InvalidNode {
        /// The node name as given.
        node: String,
        /// Why, in words.
        reason: String,
    },
}

/// Result with the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
