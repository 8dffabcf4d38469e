//! The diff engine: desired IPVS state from Services and endpoints, and the minimal list of
//! operations that takes an observed table there.
//!
//! Pure: no tokio, no kube client, no sockets, no clock. Time is an input.
//!
//! - [`model`]: the input model (Services, endpoints, node) and the change-tracking [`Inputs`] store.
//! - [`desired`]: the Service API's semantics, from one Service to its virtual servers.
//! - [`table`]: the IPVS table as data, [`Op`]s, the kernel model and [`full_diff`].
//! - [`engine`]: the incremental [`Engine`] with graceful termination.

pub mod desired;
pub mod engine;
pub mod error;
pub mod model;
pub mod table;

pub use desired::{ServiceTable, service_table};
pub use engine::{ConnectionCounts, Draining, Engine, UnknownCounts};
pub use error::{Error, Result};
pub use model::{
    Changes, Cidr, Endpoint, EndpointPort, Inputs, NodeContext, Options, Protocol, Scheduler,
    SchedulerKind, ServiceInfo, ServiceKind, ServiceName, ServicePort, ServicePortName,
    SessionAffinity, TrafficDistribution, TrafficPolicy,
};
pub use table::{
    DestKey, Forward, Op, RealServer, ServiceEntry, Table, VirtualKey, VirtualServer, full_diff,
    order_ops,
};
