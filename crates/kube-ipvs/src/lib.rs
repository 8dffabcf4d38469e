//! The `kube-ipvs` binary's library half: everything `main.rs` dispatches to, kept here so it is
//! testable without a process.

pub mod apply;
pub mod check;
pub mod cleanup;
pub mod dump;
pub mod explain;
pub mod ipvsadm;
pub mod kernel;
pub mod observe;
pub mod plan;
pub mod run;
pub mod source;
