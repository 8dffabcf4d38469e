//! The diff engine: desired IPVS state from Services and endpoints, and the minimal list of
//! operations that takes an observed table there.
//!
//! Pure: no tokio, no kube client, no sockets, no clock.
