//! The diff engine: desired IPVS state from Services and endpoints, and the minimal list of
//! operations that takes an observed table there.
//!
//! Pure: no tokio, no kube client, no sockets, no clock. Time is an input.
//!
//! - [`model`]: the input model (Services, endpoints, node) and the change-tracking [`Inputs`] store.
//! - [`desired`]: the Service API's semantics, from one Service to its virtual servers.
//! - [`table`]: the IPVS table as data, [`Op`]s, the kernel model and [`full_diff`].
//! - [`engine`]: the incremental [`Engine`] with graceful termination.
//! - [`fingerprint`]: order-independent fingerprints, so a reconcile skips an empty diff.
//!
//! The semantic rules and where kube-proxy's IPVS mode differs are listed in `README.md` and
//! in the [`desired`] module docs.
//!
//! ```
//! use std::time::Duration;
//! use kube_ipvs_diff::{
//!     Endpoint, EndpointPort, Engine, Inputs, NodeContext, Protocol, ServiceInfo, ServiceName,
//!     ServicePort, UnknownCounts,
//! };
//!
//! let mut inputs = Inputs::new(NodeContext::new("node-a"))?;
//! let web = ServiceName::new("default", "web");
//! inputs.upsert_service(web.clone(), ServiceInfo {
//!     cluster_ips: vec!["10.96.0.10".parse()?],
//!     ports: vec![ServicePort { name: "http".into(), protocol: Protocol::Tcp, port: 80, node_port: None }],
//!     ..ServiceInfo::default()
//! })?;
//! let port = EndpointPort { name: "http".into(), port: 8080, protocol: Protocol::Tcp };
//! inputs.set_endpoints(web, vec![Endpoint::ready("10.1.0.1".parse()?, vec![port])])?;
//!
//! let mut engine = Engine::new();
//! let plan: Vec<String> = engine
//!     .sync(&mut inputs, Duration::ZERO, &UnknownCounts)
//!     .iter()
//!     .map(ToString::to_string)
//!     .collect();
//! assert_eq!(plan, [
//!     "add address 10.96.0.10 to kube-ipvs0",
//!     "add service TCP 10.96.0.10:80 rr",
//!     "add dest TCP 10.96.0.10:80 -> 10.1.0.1:8080 masq weight 1",
//! ]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod desired;
pub mod engine;
pub mod error;
pub mod fingerprint;
pub mod marks;
pub mod model;
pub mod table;

pub use desired::{
    EndpointDecision, EndpointReason, ServiceTable, endpoint_decisions, service_table,
};
pub use engine::{ConnectionCounts, Draining, Engine, UnknownCounts};
pub use error::{Error, Result};
pub use fingerprint::Fingerprint;
pub use marks::{MarkHint, MarkSpace, PortMark};
pub use model::{
    Changes, Cidr, Endpoint, EndpointPort, Inputs, NodeContext, Options, Protocol, Scheduler,
    SchedulerKind, ServiceInfo, ServiceKind, ServiceName, ServicePort, ServicePortName,
    SessionAffinity, TrafficDistribution, TrafficPolicy, endpoint_address_problem,
    endpoints_merged, is_link_local,
};
pub use table::{
    DestKey, Forward, Op, Ownership, RealServer, ServiceEntry, Table, VirtualKey, VirtualServer,
    full_diff, order_ops,
};
