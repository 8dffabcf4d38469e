//! IPVS over generic netlink and the `kube-ipvs0` dummy interface over rtnetlink.
//!
//! This crate is the one seam between kube-ipvs and the kernel's IPVS and address tables. [`ipvs`] holds the pure
//! IPVS types, the [`ipvs::Request`] data type and the [`ipvs::Ipvs`] handle; [`link`] holds the rtnetlink handle
//! for the dummy interface and local addresses. Everything that makes a system call goes through one private
//! socket module, the only place `unsafe` is allowed.
//!
//! # Testing
//!
//! * `tests/fixtures.rs` parses dump replies captured from Debian's kernel in the VM (`tests/fixtures/*.hex`),
//!   compares them to the structs that were programmed, and re-emits them to the same bytes.
//! * `tests/kernel_*.rs` (feature `kernel-tests`, run by `cargo xtask vm-test`) program a real kernel and read it
//!   back through the crate, `ipvsadm -S -n`, `ipvsadm -Ln` and iproute2. `kernel_capture` regenerates the
//!   fixtures; see `tests/fixtures/extract.sh`.
//! * `examples/ipvs-bench.rs` (`cargo xtask bench netlink`) compares batched programming and table reads with
//!   `ipvsadm -R` and `ipvsadm -Ln`.

pub mod error;
pub mod ipvs;
pub mod link;
mod socket;

pub use error::{Error, Result};
