//! The IP family, one type for every part of the crate (and its users) that keeps IPv4 and IPv6 apart: the
//! hairpin set of each, the iptables tools of each, the address family of a request.

use std::net::IpAddr;

/// An IP family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// Both families, IPv4 first.
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    /// The family of an address.
    #[must_use]
    pub fn of(addr: IpAddr) -> Self {
        if addr.is_ipv4() { Self::V4 } else { Self::V6 }
    }

    /// Whether `addr` is of this family.
    #[must_use]
    pub fn holds(self, addr: &IpAddr) -> bool {
        Self::of(*addr) == self
    }

    /// The prefix length of one address: 32 or 128.
    #[must_use]
    pub fn host_prefix(self) -> u8 {
        match self {
            Self::V4 => 32,
            Self::V6 => 128,
        }
    }
}
