//! The diff engine: desired IPVS state from Services and endpoints, and the minimal list of
//! operations that takes an observed table there.
//!
//! Pure: no tokio, no kube client, no sockets, no clock.

pub mod error;
pub mod model;

pub use error::{Error, Result};
pub use model::{
    Changes, Cidr, Endpoint, EndpointPort, Inputs, NodeContext, Options, Protocol, Scheduler,
    SchedulerKind, ServiceInfo, ServiceKind, ServiceName, ServicePort, ServicePortName,
    SessionAffinity, TrafficDistribution, TrafficPolicy,
};
