//! Every netlink protocol kube-ipvs speaks: IPVS over generic netlink, the `kube-ipvs0` dummy interface and the
//! node's addresses over rtnetlink, and the hairpin ipsets and conntrack over nfnetlink.
//!
//! This crate is the one seam between kube-ipvs and the kernel's netlink families. [`ipvs`] holds the pure
//! IPVS types, the [`ipvs::Request`] data type and the [`ipvs::Ipvs`] handle; [`link`] holds the rtnetlink handle
//! for the dummy interface and local addresses; [`nfnl`] holds [`nfnl::ipset`] and [`nfnl::conntrack`]. All of
//! them frame messages with one private `wire` module (header, attributes, acknowledgements, dump ends) and make
//! every system call through one private `socket` module, the only place `unsafe` is allowed. One
//! [`Error`] keeps the errno and names the operation and object.
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

// The socket and framing code turns lengths and counts into the kernel's fixed-width fields: a
// silent truncation there is a malformed message, so every narrowing cast must be a checked one.
#![warn(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap
)]

pub mod error;
mod family;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod ipvs;
pub mod link;
pub mod nfnl;
mod socket;
mod wire;

pub use error::{Error, Result};
pub use family::Family;
