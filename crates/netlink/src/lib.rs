//! IPVS over generic netlink and the `kube-ipvs0` dummy interface over rtnetlink.
//!
//! This crate is the one seam between kube-ipvs and the kernel's IPVS and address tables. [`ipvs`] holds the pure
//! IPVS types, the request data type and the [`ipvs::Ipvs`] handle; [`link`] holds the rtnetlink handle for the
//! dummy interface and local addresses. Everything that makes a system call goes through one private socket module.

pub mod error;
pub mod ipvs;
pub mod link;
mod socket;

pub use error::{Error, Result};
