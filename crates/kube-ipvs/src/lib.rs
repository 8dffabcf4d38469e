//! The `kube-ipvs` binary's library half: everything `main.rs` dispatches to, kept here so it is
//! testable without a process.
//!
//! The architecture reads in the module list: [`agent`] is the node agent (`kube-ipvs run`),
//! [`cmd`] the debugging commands (`dump`, `plan`, `check`, `explain`, `cleanup`), [`apply`] the
//! one executor of the engine's operations, [`kernel`] the one seam to the kernel (one trait, one
//! real implementation, the conversions between engine and netlink types), and [`ipvsadm`] the
//! `ipvsadm -Ln` renderer, which reads no kernel. The watch and diff crates come before all of
//! this; the netlink and host crates after it.

pub mod agent;
pub mod apply;
pub mod cmd;
pub mod ipvsadm;
pub mod kernel;
pub mod words;
