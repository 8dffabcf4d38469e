//! The crate's error type.
//!
//! Every variant that comes from one operation carries `op`, a sentence naming the object that was being changed
//! (for example `add service TCP 10.96.0.1:80`), so an error read in a log says what failed without the caller
//! having to wrap it.

use std::io;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why an IPVS or rtnetlink operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `EEXIST`: the service or destination being added is already there.
    #[error("{op}: {object} already exists")]
    Exists {
        /// The operation that failed.
        op: String,
        /// `"service"` or `"destination"`.
        object: &'static str,
    },
    /// `ESRCH`: the service the operation refers to does not exist.
    #[error("{op}: no such service")]
    NoSuchService {
        /// The operation that failed.
        op: String,
    },
    /// `ENOENT` from SET_DEST or DEL_DEST: the destination does not exist.
    #[error("{op}: no such destination")]
    NoSuchDestination {
        /// The operation that failed.
        op: String,
    },
    /// `ENOENT` from a service command: the scheduler or persistence engine is unknown to this kernel.
    #[error("{op}: unknown scheduler or persistence engine")]
    UnknownScheduler {
        /// The operation that failed.
        op: String,
    },
    /// `EPERM`: the caller lacks `CAP_NET_ADMIN` in this network namespace.
    #[error("{op}: permission denied (CAP_NET_ADMIN is needed)")]
    Permission {
        /// The operation that failed.
        op: String,
    },
    /// The generic netlink family "IPVS" cannot be resolved: the `ip_vs` module is not loaded and could not be
    /// loaded on demand.
    #[error("ip_vs not loaded: the generic netlink family IPVS is unknown to this kernel")]
    ModuleMissing,
    /// Any other error the kernel answered with.
    #[error("{op}: kernel error {errno}: {}", io::Error::from_raw_os_error(*errno))]
    Kernel {
        /// The operation that failed.
        op: String,
        /// The positive errno value.
        errno: i32,
    },
    /// A netfilter subsystem (ipset, conntrack) refused a request. ipset's own codes (4096 and up) have no
    /// `strerror`, so the message says what they mean.
    #[error("{op}: kernel error {errno} ({})", netfilter_errno_text(*errno))]
    Netfilter {
        /// The operation that failed, starting with the subsystem and object (`ipset KUBE-IPVS-HAIRPIN: add ...`).
        op: String,
        /// The positive errno value.
        errno: i32,
    },
    /// The acknowledgement for this operation was dropped because the receive buffer overflowed (`ENOBUFS`), so
    /// whether the kernel applied it is unknown. Read the table back before trusting it.
    #[error("{op}: acknowledgement lost (netlink receive buffer overrun); outcome unknown")]
    AckLost {
        /// The operation whose outcome is unknown.
        op: String,
    },
    /// The request was rejected before it reached the kernel.
    #[error("{op}: invalid request: {reason}")]
    Invalid {
        /// The operation that was refused.
        op: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A socket call failed.
    #[error("{op}: {source}")]
    Io {
        /// The operation that was under way.
        op: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A kernel reply could not be decoded.
    #[error("decoding {what}: {reason}")]
    Decode {
        /// What was being decoded.
        what: String,
        /// Why it failed.
        reason: String,
    },
}

impl Error {
    /// The positive errno behind this error, when the kernel or a socket call gave one.
    #[must_use]
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Exists { .. } => Some(libc::EEXIST),
            Error::NoSuchService { .. } => Some(libc::ESRCH),
            Error::NoSuchDestination { .. } | Error::UnknownScheduler { .. } => Some(libc::ENOENT),
            Error::Permission { .. } => Some(libc::EPERM),
            Error::Kernel { errno, .. } | Error::Netfilter { errno, .. } => Some(*errno),
            Error::AckLost { .. } => Some(libc::ENOBUFS),
            Error::Io { source, .. } => source.raw_os_error(),
            Error::ModuleMissing | Error::Invalid { .. } | Error::Decode { .. } => None,
        }
    }

    pub(crate) fn decode(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Error::Decode {
            what: what.into(),
            reason: reason.to_string(),
        }
    }
}

/// What a netfilter errno means: ipset's private codes from `ip_set.h`, or the system's text.
fn netfilter_errno_text(errno: i32) -> String {
    use crate::nfnl::ipset::codes;
    match errno {
        codes::IPSET_ERR_PROTOCOL => "ipset protocol error".into(),
        codes::IPSET_ERR_FIND_TYPE => {
            "set type not supported (is ip_set_hash_netnet loaded?)".into()
        }
        codes::IPSET_ERR_MAX_SETS => "no room for more sets".into(),
        codes::IPSET_ERR_BUSY => "set is in use".into(),
        codes::IPSET_ERR_EXIST_SETNAME2 => {
            "a set of that name exists with a different type or settings".into()
        }
        codes::IPSET_ERR_TYPE_MISMATCH => "set type mismatch".into(),
        codes::IPSET_ERR_INVALID_CIDR => "invalid prefix length".into(),
        codes::IPSET_ERR_INVALID_FAMILY => "address family does not match the set".into(),
        codes::IPSET_ERR_REFERENCED => "set is referenced by a rule".into(),
        e if e >= codes::IPSET_ERR_TYPE_SPECIFIC => format!("set type error {e} (e.g. set full)"),
        e => io::Error::from_raw_os_error(e).to_string(),
    }
}
