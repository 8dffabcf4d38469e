//! The `kube-ipvs` binary's library half: everything `main.rs` dispatches to, kept here so it is
//! testable without a process.

pub mod dump;
pub mod ipvsadm;
pub mod kernel;
