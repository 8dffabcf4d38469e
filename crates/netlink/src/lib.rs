//! IPVS over generic netlink and the `kube-ipvs0` dummy interface over rtnetlink.
//!
//! This crate is the one seam between kube-ipvs and the kernel's IPVS and address tables.
