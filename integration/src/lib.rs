//! Test support for kube-ipvs: a test API server speaking the Kubernetes list/watch protocol,
//! used by the API-server rung of the test ladder (see `tests/`) and by the watch benchmark.

pub mod apiserver;

pub use apiserver::{Kind, TestApiServer};
