//! The node debugging commands, apart from the agent: [`dump`] (the IPVS table as `ipvsadm -Ln`
//! prints it), [`plan`], [`check`], [`explain`] and [`cleanup`], and [`source`], the desired state
//! they compare against (manifests or one API listing). None of them writes to the kernel except
//! `plan --apply` and `cleanup`, which go through the same executor as the agent.

pub mod check;
pub mod cleanup;
pub mod dump;
pub mod explain;
pub mod plan;
pub mod source;
