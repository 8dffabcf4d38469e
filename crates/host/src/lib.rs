//! The node's kernel interfaces that are not netlink: the masquerade rules through the iptables tools
//! ([`masquerade`]: rule text as data, backend choice, the `iptables-restore` runner), the removal of
//! kube-proxy's leftovers ([`kube_proxy`]), kernel modules, sysctls and the hostname ([`setup`]),
//! the allocator's free pages handed back to the kernel ([`memory`]), and the background threads'
//! CPU priority ([`thread`]).
//!
//! With `kube-ipvs-netlink` this is one of the two kernel-facing crates: nothing else in the workspace spawns a
//! kernel tool, opens a socket or touches `/proc` (the tidy test, `xtask/tests/tidy.rs`, checks it). It is a
//! crate of its own rather than a module of the netlink crate because its seam is different: processes and
//! files rather than one socket and its byte-exact messages, so the netlink crate stays pure netlink with its
//! fixtures, and this one can be read, reviewed and fenced as "everything we run on the node".
//!
//! Nothing from the API server reaches a command line here: tools are spawned with fixed arguments, rules are
//! written to their standard input from parsed addresses, CIDRs and ports, and module and sysctl names come from
//! our own lists.

pub mod filter;
pub mod kube_proxy;
pub mod masquerade;
pub mod memory;
pub mod sets;
pub mod setup;
pub mod thread;
