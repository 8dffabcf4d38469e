//! The IPVS table as data: virtual servers, real servers and the addresses on `kube-ipvs0`,
//! the operations that change it, and the full diff between two tables.
//!
//! The same [`Table`] type holds what the engine wants (desired) and what the kernel reports
//! (observed, converted by the caller from netlink dumps). [`Op`] is the only way the engine
//! asks for a change; one executor applies it, and `kube-ipvs plan` prints it with `Display`.
//! [`Table::apply`] is a model of the kernel's rules for these operations, used by tests and
//! by anything that needs an in-memory kernel. Nothing here talks to the kernel.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use crate::marks::MarkSpace;
use crate::model::{Cidr, Options, Protocol, Scheduler, SchedulerKind};

/// `IP_VS_SVC_F_PERSISTENT`.
pub const FLAG_PERSISTENT: u32 = 0x1;
/// `IP_VS_SVC_F_SCHED1`: sh-fallback / mh-fallback.
pub const FLAG_SCHED1: u32 = 0x8;
/// `IP_VS_SVC_F_SCHED2`: sh-port / mh-port.
pub const FLAG_SCHED2: u32 = 0x10;

/// What identifies a virtual server in the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum VirtualKey {
    /// Protocol, address and port; the address family is the address's.
    Inet {
        /// The transport protocol.
        protocol: Protocol,
        /// The virtual address.
        addr: IpAddr,
        /// The virtual port.
        port: u16,
    },
    /// A firewall-mark service. The engine makes these only for the Local-policy short circuit,
    /// with marks of [`Options::local_marks`]; others are someone else's and never touched.
    Fwmark {
        /// Whether the service is IPv6 (`AF_INET6`).
        ipv6: bool,
        /// The mark.
        mark: u32,
    },
}

impl VirtualKey {
    /// A protocol/address/port key.
    pub fn inet(protocol: Protocol, addr: IpAddr, port: u16) -> Self {
        VirtualKey::Inet {
            protocol,
            addr,
            port,
        }
    }

    /// The protocol of an inet key; fwmark services are TCP in the kernel's books.
    pub fn protocol(&self) -> Protocol {
        match self {
            VirtualKey::Inet { protocol, .. } => *protocol,
            VirtualKey::Fwmark { .. } => Protocol::Tcp,
        }
    }

    /// The address of an inet key.
    pub fn addr(&self) -> Option<IpAddr> {
        match self {
            VirtualKey::Inet { addr, .. } => Some(*addr),
            VirtualKey::Fwmark { .. } => None,
        }
    }
}

/// `1.2.3.4:80` or `[fd00::1]:80`, as ipvsadm writes them.
struct HostPort(IpAddr, u16);

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            IpAddr::V4(a) => write!(f, "{a}:{}", self.1),
            IpAddr::V6(a) => write!(f, "[{a}]:{}", self.1),
        }
    }
}

impl fmt::Display for VirtualKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VirtualKey::Inet {
                protocol,
                addr,
                port,
            } => write!(f, "{protocol} {}", HostPort(*addr, *port)),
            VirtualKey::Fwmark { ipv6, mark } => {
                write!(f, "FWM {mark}{}", if *ipv6 { " IPv6" } else { "" })
            }
        }
    }
}

/// A virtual server with the attributes the engine sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VirtualServer {
    /// Its identity.
    pub key: VirtualKey,
    /// The scheduler and its sh/mh flags.
    pub scheduler: Scheduler,
    /// The persistence timeout in seconds (ClientIP session affinity), or `None` for no persistence.
    pub persistence: Option<u32>,
    /// The persistence netmask as a prefix length: 32 for IPv4, 128 for IPv6 (one client
    /// address each). The netlink layer encodes IPv4 as a mask.
    pub netmask: u8,
}

impl VirtualServer {
    /// The `IP_VS_SVC_F_*` flags this server needs (without the kernel-internal HASHED bit).
    pub fn flags(&self) -> u32 {
        let mut flags = 0;
        if self.persistence.is_some() {
            flags |= FLAG_PERSISTENT;
        }
        if self.scheduler.fallback() {
            flags |= FLAG_SCHED1;
        }
        if self.scheduler.port() {
            flags |= FLAG_SCHED2;
        }
        flags
    }

    /// A virtual server as the kernel reports it (`SCHED_NAME`, `FLAGS`, `TIMEOUT`, `NETMASK`
    /// as a prefix length), for building an observed [`Table`] from a dump. The sh/mh flag bits
    /// are read only for sh and mh; the HASHED bit and others the engine never sets are
    /// ignored. A scheduler the engine does not know is an error naming the virtual server, so
    /// the caller can decide (e.g. treat the entry as foreign).
    pub fn from_kernel(
        key: VirtualKey,
        sched_name: &str,
        flags: u32,
        timeout: u32,
        netmask: u8,
    ) -> crate::Result<Self> {
        let kind =
            SchedulerKind::from_name(sched_name).ok_or_else(|| crate::Error::InvalidScheduler {
                input: sched_name.to_owned(),
                reason: format!(
                    "virtual server {key} uses a scheduler this engine does not manage"
                ),
            })?;
        let hashing = matches!(kind, SchedulerKind::Sh | SchedulerKind::Mh);
        let scheduler = Scheduler::with_flags(
            kind,
            hashing && flags & FLAG_SCHED1 != 0,
            hashing && flags & FLAG_SCHED2 != 0,
        )?;
        Ok(Self {
            key,
            scheduler,
            persistence: (flags & FLAG_PERSISTENT != 0).then_some(timeout),
            netmask,
        })
    }

    /// The persistence timeout as the kernel stores it (0 when not persistent).
    pub fn timeout(&self) -> u32 {
        self.persistence.unwrap_or(0)
    }
}

impl fmt::Display for VirtualServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.key, self.scheduler)?;
        if let Some(t) = self.persistence {
            write!(f, " persistent {t}")?;
            let full = match self.key.addr() {
                Some(IpAddr::V4(_)) | None => 32,
                Some(IpAddr::V6(_)) => 128,
            };
            if self.netmask != full {
                write!(f, " mask /{}", self.netmask)?;
            }
        }
        Ok(())
    }
}

/// The forwarding method of a real server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Forward {
    /// NAT (`IP_VS_CONN_F_MASQ`): the only method the engine uses.
    Masq,
    /// Local node.
    Local,
    /// IP-in-IP tunnel.
    Tunnel,
    /// Direct routing.
    Route,
    /// Bypass.
    Bypass,
}

impl fmt::Display for Forward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Forward::Masq => "masq",
            Forward::Local => "local",
            Forward::Tunnel => "tunnel",
            Forward::Route => "route",
            Forward::Bypass => "bypass",
        })
    }
}

/// What identifies a real server within its virtual server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DestKey {
    /// The backend address.
    pub addr: IpAddr,
    /// The backend port.
    pub port: u16,
}

impl fmt::Display for DestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        HostPort(self.addr, self.port).fmt(f)
    }
}

/// A real server (IPVS destination).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RealServer {
    /// The backend address and port.
    pub key: DestKey,
    /// The weight; 0 means no new connections (graceful termination).
    pub weight: u32,
    /// The forwarding method.
    pub forward: Forward,
}

impl RealServer {
    /// A masqueraded backend with the given weight.
    pub fn masq(addr: IpAddr, port: u16, weight: u32) -> Self {
        Self {
            key: DestKey { addr, port },
            weight,
            forward: Forward::Masq,
        }
    }
}

impl fmt::Display for RealServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} weight {}", self.key, self.forward, self.weight)
    }
}

/// One virtual server and its real servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceEntry {
    /// The virtual server.
    pub server: VirtualServer,
    /// Its real servers by key.
    pub dests: BTreeMap<DestKey, RealServer>,
}

/// A whole IPVS table plus the addresses on `kube-ipvs0`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Table {
    /// Virtual servers by key.
    pub services: BTreeMap<VirtualKey, ServiceEntry>,
    /// Addresses bound to the dummy interface (ClusterIPs, externalIPs, LB IPs; no node IPs).
    pub addresses: BTreeSet<IpAddr>,
}

/// One change to the kernel, as data.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Op {
    /// Bind an address to `kube-ipvs0`.
    AddAddress(IpAddr),
    /// Create a virtual server (`IPVS_CMD_NEW_SERVICE`).
    AddService(VirtualServer),
    /// Change a virtual server's scheduler, flags, timeout or netmask (`IPVS_CMD_SET_SERVICE`).
    UpdateService(VirtualServer),
    /// Add a real server (`IPVS_CMD_NEW_DEST`).
    AddDest {
        /// The virtual server it belongs to.
        service: VirtualKey,
        /// The real server.
        dest: RealServer,
    },
    /// Change a real server's weight or forwarding (`IPVS_CMD_SET_DEST`).
    UpdateDest {
        /// The virtual server it belongs to.
        service: VirtualKey,
        /// The real server as it should be.
        dest: RealServer,
    },
    /// Remove a real server (`IPVS_CMD_DEL_DEST`).
    DeleteDest {
        /// The virtual server it belongs to.
        service: VirtualKey,
        /// Which real server.
        dest: DestKey,
    },
    /// Remove a virtual server and, implicitly, all its real servers (`IPVS_CMD_DEL_SERVICE`).
    DeleteService(VirtualKey),
    /// Unbind an address from `kube-ipvs0`.
    RemoveAddress(IpAddr),
}

impl Op {
    /// The phase the op runs in; ops are executed in phase order, which is an order the kernel
    /// accepts: a virtual server exists before its real servers are added, deletes of real
    /// servers come before deletes of servers, and addresses are bound before traffic can be
    /// sent to them and unbound last.
    pub fn phase(&self) -> u8 {
        match self {
            Op::AddAddress(_) => 0,
            Op::AddService(_) => 2,
            Op::UpdateService(_) => 3,
            Op::AddDest { .. } => 4,
            Op::UpdateDest { .. } => 5,
            Op::DeleteDest { .. } => 6,
            Op::DeleteService(_) => 7,
            Op::RemoveAddress(_) => 8,
        }
    }

    /// The virtual server this op touches, if any.
    pub fn service(&self) -> Option<&VirtualKey> {
        match self {
            Op::AddService(vs) | Op::UpdateService(vs) => Some(&vs.key),
            Op::AddDest { service, .. }
            | Op::UpdateDest { service, .. }
            | Op::DeleteDest { service, .. }
            | Op::DeleteService(service) => Some(service),
            Op::AddAddress(_) | Op::RemoveAddress(_) => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::AddAddress(a) => write!(f, "add address {a} to kube-ipvs0"),
            Op::AddService(vs) => write!(f, "add service {vs}"),
            Op::UpdateService(vs) => write!(f, "update service {vs}"),
            Op::AddDest { service, dest } => write!(f, "add dest {service} -> {dest}"),
            Op::UpdateDest { service, dest } => write!(f, "update dest {service} -> {dest}"),
            Op::DeleteDest { service, dest } => write!(f, "delete dest {service} -> {dest}"),
            Op::DeleteService(k) => write!(f, "delete service {k} and its dests"),
            Op::RemoveAddress(a) => write!(f, "remove address {a} from kube-ipvs0"),
        }
    }
}

/// Puts ops in an order the kernel accepts (see [`Op::phase`]). The sort is stable, so ops of
/// one phase keep the order the engine produced them in, with one exception: real servers are
/// added round by round, every virtual server's first new real server, then every one's second,
/// and so on. On an empty or flushed table every Service then has a backend after a fifth of a
/// 10-endpoint table's adds rather than only once the Services before it are complete (after
/// `ipvsadm -C` each add also scans the kernel's trash of deleted real servers, which makes a
/// whole table's repair take minutes at 10,000 x 10). A virtual server that is deleted and
/// created again in the same batch (its owner changed) is deleted first.
pub fn order_ops(ops: &mut [Op]) {
    let recreated: BTreeSet<VirtualKey> = ops
        .iter()
        .filter_map(|op| match op {
            Op::AddService(vs) => Some(vs.key),
            _ => None,
        })
        .collect();
    let phase = |op: &Op| match op {
        Op::DeleteService(k) if recreated.contains(k) => 1,
        other => other.phase(),
    };
    // Each AddDest's round: how many AddDests of its virtual server come before it.
    let mut seen: std::collections::HashMap<VirtualKey, usize> = std::collections::HashMap::new();
    let mut keyed: Vec<(u8, usize, Op)> = Vec::with_capacity(ops.len());
    for op in ops.iter() {
        let round = match op {
            Op::AddDest { service, .. } => {
                let n = seen.entry(*service).or_insert(0);
                *n += 1;
                *n - 1
            }
            _ => 0,
        };
        keyed.push((phase(op), round, op.clone()));
    }
    if seen.values().all(|n| *n <= 1) {
        // No virtual server gains more than one real server: the phase order is the order.
        ops.sort_by_key(phase);
        return;
    }
    keyed.sort_by_key(|(phase, round, _)| (*phase, *round));
    for (slot, (_, _, op)) in ops.iter_mut().zip(keyed) {
        *slot = op;
    }
}

/// Why the kernel model refused an op; the kernel would answer with the errno in brackets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {reason}")]
pub struct ApplyError {
    /// The op, as printed.
    pub op: String,
    /// Why (with the kernel's errno).
    pub reason: &'static str,
}

impl Table {
    /// Applies one op by the kernel's rules: adding what exists is `EEXIST`, changing or
    /// deleting what does not exist is `ESRCH`/`ENOENT`, and a destination needs its service.
    pub fn apply(&mut self, op: &Op) -> Result<(), ApplyError> {
        let fail = |reason| ApplyError {
            op: op.to_string(),
            reason,
        };
        match op {
            Op::AddAddress(a) => {
                if !self.addresses.insert(*a) {
                    return Err(fail("address already bound (EEXIST)"));
                }
            }
            Op::RemoveAddress(a) => {
                if !self.addresses.remove(a) {
                    return Err(fail("address not bound (EADDRNOTAVAIL)"));
                }
            }
            Op::AddService(vs) => {
                if self.services.contains_key(&vs.key) {
                    return Err(fail("service exists (EEXIST)"));
                }
                self.services.insert(
                    vs.key,
                    ServiceEntry {
                        server: *vs,
                        dests: BTreeMap::new(),
                    },
                );
            }
            Op::UpdateService(vs) => match self.services.get_mut(&vs.key) {
                Some(e) => e.server = *vs,
                None => return Err(fail("no such service (ESRCH)")),
            },
            Op::DeleteService(k) => {
                if self.services.remove(k).is_none() {
                    return Err(fail("no such service (ESRCH)"));
                }
            }
            Op::AddDest { service, dest } => {
                let e = self
                    .services
                    .get_mut(service)
                    .ok_or_else(|| fail("no such service (ESRCH)"))?;
                if e.dests.insert(dest.key, *dest).is_some() {
                    return Err(fail("destination exists (EEXIST)"));
                }
            }
            Op::UpdateDest { service, dest } => {
                let e = self
                    .services
                    .get_mut(service)
                    .ok_or_else(|| fail("no such service (ESRCH)"))?;
                match e.dests.get_mut(&dest.key) {
                    Some(d) => *d = *dest,
                    None => return Err(fail("no such destination (ENOENT)")),
                }
            }
            Op::DeleteDest { service, dest } => {
                let e = self
                    .services
                    .get_mut(service)
                    .ok_or_else(|| fail("no such service (ESRCH)"))?;
                if e.dests.remove(dest).is_none() {
                    return Err(fail("no such destination (ENOENT)"));
                }
            }
        }
        Ok(())
    }

    /// Applies ops in order, stopping at the first the kernel would refuse.
    pub fn apply_all<'a>(
        &mut self,
        ops: impl IntoIterator<Item = &'a Op>,
    ) -> Result<(), ApplyError> {
        ops.into_iter().try_for_each(|op| self.apply(op))
    }

    /// The number of real servers in the table.
    pub fn dest_count(&self) -> usize {
        self.services.values().map(|e| e.dests.len()).sum()
    }
}

/// What of an observed table is the engine's to manage.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ownership<'a> {
    /// Inet virtual servers and addresses in these networks belong to someone else
    /// (`--ipvs-exclude-cidrs`).
    pub exclude: &'a [Cidr],
    /// Fwmark virtual servers with a mark of this space are the engine's (the Local-policy
    /// short circuit); any other fwmark virtual server is someone else's.
    pub marks: Option<MarkSpace>,
}

impl<'a> Ownership<'a> {
    /// What the engine owns under these options.
    pub fn of(options: &'a Options) -> Self {
        Self {
            exclude: &options.exclude_cidrs,
            marks: options.local_marks,
        }
    }

    /// Inet virtual servers and addresses outside `exclude`; no fwmark virtual server.
    pub fn excluding(exclude: &'a [Cidr]) -> Self {
        Self {
            exclude,
            marks: None,
        }
    }

    /// Whether an observed virtual server is the engine's to manage.
    pub fn key(&self, key: &VirtualKey) -> bool {
        match *key {
            VirtualKey::Inet { addr, .. } => self.addr(addr),
            VirtualKey::Fwmark { mark, .. } => self.marks.is_some_and(|m| m.contains(mark)),
        }
    }

    /// Whether an observed address on `kube-ipvs0` is the engine's to manage.
    pub fn addr(&self, addr: IpAddr) -> bool {
        !self.exclude.iter().any(|c| c.contains(addr))
    }
}

/// Merge-joins two iterators sorted by key, calling `f` with each key's left and right items.
pub(crate) fn merge_by<A, B, K: Ord>(
    left: impl IntoIterator<Item = A>,
    right: impl IntoIterator<Item = B>,
    key_a: impl Fn(&A) -> K,
    key_b: impl Fn(&B) -> K,
    mut f: impl FnMut(Option<A>, Option<B>),
) {
    let mut l = left.into_iter().peekable();
    let mut r = right.into_iter().peekable();
    loop {
        let ord = match (l.peek(), r.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(a), Some(b)) => key_a(a).cmp(&key_b(b)),
        };
        match ord {
            Ordering::Less => f(l.next(), None),
            Ordering::Greater => f(None, r.next()),
            Ordering::Equal => f(l.next(), r.next()),
        }
    }
}

/// The ops that take the real servers `old` to `new` within one existing virtual server; both
/// sorted by key.
fn diff_dests<'a, 'b>(
    service: VirtualKey,
    old: impl IntoIterator<Item = &'a RealServer>,
    new: impl IntoIterator<Item = &'b RealServer>,
    ops: &mut Vec<Op>,
) {
    merge_by(
        old,
        new,
        |d| d.key,
        |d| d.key,
        |o, n| match (o, n) {
            (Some(o), None) => ops.push(Op::DeleteDest {
                service,
                dest: o.key,
            }),
            (None, Some(n)) => ops.push(Op::AddDest { service, dest: *n }),
            (Some(o), Some(n)) if o != n => ops.push(Op::UpdateDest { service, dest: *n }),
            _ => {}
        },
    );
}

/// The full diff: the minimal ops that take `observed` to `desired`, touching only what the
/// engine owns (see [`Ownership`]). One op per differing entry: an address, a virtual server
/// or a real server; deleting a virtual server covers its real servers. The result is ordered
/// with [`order_ops`]. Graceful termination is not applied here (the engine does that).
pub fn full_diff(desired: &Table, observed: &Table, owned: Ownership<'_>) -> Vec<Op> {
    diff_view(
        desired
            .services
            .values()
            .map(|e| (&e.server, e.dests.values())),
        desired.addresses.iter().copied(),
        observed,
        owned,
    )
}

/// [`full_diff`] over any sorted view of the desired state, so the engine can diff its
/// per-Service tables without first building a [`Table`]: `services` sorted by key with their
/// real servers sorted by key, `addresses` sorted.
pub(crate) fn diff_view<'a, I>(
    services: impl IntoIterator<Item = (&'a VirtualServer, I)>,
    addresses: impl IntoIterator<Item = IpAddr>,
    observed: &Table,
    owned: Ownership<'_>,
) -> Vec<Op>
where
    I: IntoIterator<Item = &'a RealServer>,
{
    let mut ops = Vec::new();
    merge_by(
        observed.addresses.iter().copied(),
        addresses,
        |a| *a,
        |a| *a,
        |o, d| match (o, d) {
            (None, Some(a)) => ops.push(Op::AddAddress(a)),
            (Some(a), None) if owned.addr(a) => ops.push(Op::RemoveAddress(a)),
            _ => {}
        },
    );
    merge_by(
        &observed.services,
        services,
        |(k, _)| **k,
        |(s, _)| s.key,
        |o, d| match (o, d) {
            (None, Some((server, dests))) => {
                ops.push(Op::AddService(*server));
                ops.extend(dests.into_iter().map(|dest| Op::AddDest {
                    service: server.key,
                    dest: *dest,
                }));
            }
            (Some((k, _)), None) => {
                if owned.key(k) {
                    ops.push(Op::DeleteService(*k));
                }
            }
            (Some((k, o)), Some((server, dests))) => {
                if o.server != *server {
                    ops.push(Op::UpdateService(*server));
                }
                diff_dests(*k, o.dests.values(), dests, &mut ops);
            }
            (None, None) => {}
        },
    );
    order_ops(&mut ops);
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    fn vs(addr: &str, port: u16) -> VirtualServer {
        VirtualServer {
            key: VirtualKey::inet(Protocol::Tcp, ip(addr), port),
            scheduler: Scheduler::RR,
            persistence: None,
            netmask: 32,
        }
    }

    #[test]
    fn display_reads_like_a_plan() {
        let v = vs("10.96.0.10", 80);
        assert_eq!(
            Op::AddService(v).to_string(),
            "add service TCP 10.96.0.10:80 rr"
        );
        let d = RealServer::masq(ip("fd00::5"), 8080, 1);
        let k6 = VirtualKey::inet(Protocol::Udp, ip("fd00::a"), 53);
        assert_eq!(
            Op::AddDest {
                service: k6,
                dest: d
            }
            .to_string(),
            "add dest UDP [fd00::a]:53 -> [fd00::5]:8080 masq weight 1"
        );
        let mut p = v;
        p.persistence = Some(10_800);
        p.scheduler = "mh:fallback,port".parse().expect("valid");
        assert_eq!(
            Op::UpdateService(p).to_string(),
            "update service TCP 10.96.0.10:80 mh:fallback,port persistent 10800"
        );
        assert_eq!(p.flags(), FLAG_PERSISTENT | FLAG_SCHED1 | FLAG_SCHED2);
    }

    #[test]
    fn from_kernel_reads_flags_back() {
        let v = VirtualServer {
            persistence: Some(300),
            scheduler: "sh:fallback,port".parse().expect("valid"),
            ..vs("10.96.0.10", 80)
        };
        // The kernel adds HASHED (0x2) to every dumped service.
        let back = VirtualServer::from_kernel(v.key, "sh", v.flags() | 0x2, 300, 32)
            .expect("known scheduler");
        assert_eq!(back, v);
        // SCHED1 on rr means nothing to rr and is not read back as a flag.
        let rr = VirtualServer::from_kernel(v.key, "rr", FLAG_SCHED1, 0, 32).expect("known");
        assert_eq!(rr, vs("10.96.0.10", 80));
        let err = VirtualServer::from_kernel(v.key, "none", 0, 0, 32).expect_err("unknown");
        assert!(err.to_string().contains("TCP 10.96.0.10:80"), "{err}");
    }

    #[test]
    fn kernel_model_refuses_what_the_kernel_refuses() {
        let mut t = Table::default();
        let v = vs("10.96.0.10", 80);
        let d = RealServer::masq(ip("10.0.0.1"), 8080, 1);
        let add_dest = Op::AddDest {
            service: v.key,
            dest: d,
        };
        assert!(t.apply(&add_dest).is_err(), "a dest needs its service");
        t.apply(&Op::AddService(v)).expect("new service");
        assert!(t.apply(&Op::AddService(v)).is_err(), "EEXIST");
        t.apply(&add_dest).expect("new dest");
        assert!(t.apply(&add_dest).is_err(), "EEXIST");
        t.apply(&Op::DeleteService(v.key)).expect("delete");
        assert_eq!(t, Table::default(), "deleting a service drops its dests");
    }

    #[test]
    fn full_diff_leaves_excluded_and_foreign_fwmark_services_alone() {
        let mut observed = Table::default();
        for key in [
            VirtualKey::inet(Protocol::Tcp, ip("192.168.1.1"), 80),
            VirtualKey::Fwmark {
                ipv6: false,
                mark: 7,
            },
            VirtualKey::inet(Protocol::Tcp, ip("10.96.0.99"), 80),
            VirtualKey::Fwmark {
                ipv6: true,
                mark: 0x30,
            },
        ] {
            let mut server = vs("10.96.0.99", 80);
            server.key = key;
            observed.services.insert(
                key,
                ServiceEntry {
                    server,
                    dests: BTreeMap::new(),
                },
            );
        }
        observed.addresses.insert(ip("192.168.1.1"));
        observed.addresses.insert(ip("10.96.0.99"));
        let exclude = ["192.168.0.0/16".parse().expect("valid")];
        // Mark 7 is outside the engine's mark space (bits 4 to 7 here).
        let owned = Ownership {
            exclude: &exclude,
            marks: Some(MarkSpace::new(0xf0).expect("valid")),
        };
        let ops = full_diff(&Table::default(), &observed, owned);
        assert_eq!(
            ops,
            vec![
                Op::DeleteService(VirtualKey::inet(Protocol::Tcp, ip("10.96.0.99"), 80)),
                // A mark of the engine's space that nothing wants is the engine's to delete.
                Op::DeleteService(VirtualKey::Fwmark {
                    ipv6: true,
                    mark: 0x30
                }),
                Op::RemoveAddress(ip("10.96.0.99")),
            ]
        );
    }

    #[test]
    fn order_puts_a_recreated_service_delete_before_its_add() {
        let v = vs("10.96.0.10", 80);
        let mut ops = vec![Op::AddService(v), Op::DeleteService(v.key)];
        order_ops(&mut ops);
        assert_eq!(ops, vec![Op::DeleteService(v.key), Op::AddService(v)]);
        let mut t = Table::default();
        t.apply(&Op::AddService(v)).expect("setup");
        t.apply_all(&ops).expect("kernel accepts the order");
    }

    #[test]
    fn order_adds_real_servers_round_by_round_across_services() {
        let (a, b, c) = (
            vs("10.96.0.1", 80),
            vs("10.96.0.2", 80),
            vs("10.96.0.3", 80),
        );
        let dest = |k: &VirtualServer, last: u8| Op::AddDest {
            service: k.key,
            dest: RealServer::masq(ip(&format!("10.244.0.{last}")), 8080, 1),
        };
        // As the engine emits them: per Service, its server then its real servers.
        let mut ops = vec![
            Op::AddService(a),
            dest(&a, 1),
            dest(&a, 2),
            dest(&a, 3),
            Op::AddService(b),
            dest(&b, 4),
            Op::AddService(c),
            dest(&c, 5),
            dest(&c, 6),
            Op::AddAddress(ip("10.96.0.1")),
        ];
        order_ops(&mut ops);
        assert_eq!(
            ops,
            vec![
                Op::AddAddress(ip("10.96.0.1")),
                Op::AddService(a),
                Op::AddService(b),
                Op::AddService(c),
                dest(&a, 1),
                dest(&b, 4),
                dest(&c, 5),
                dest(&a, 2),
                dest(&c, 6),
                dest(&a, 3),
            ]
        );
        Table::default()
            .apply_all(&ops)
            .expect("kernel accepts the order");
    }
}
