//! The binary's one seam to the kernel: the [`Kernel`] trait, its one real implementation
//! [`RealKernel`] (the netlink crate's IPVS, rtnetlink and conntrack handles), and the typed
//! [`KernelError`] that keeps the kernel's errno.
//!
//! The executor ([`crate::apply`]) and the agent's sync loop ([`crate::agent::sync`]) reach the
//! kernel only through [`Kernel`], so both run against an in-memory kernel in the host tests.
//! [`convert`] holds every conversion between the engine's table types and the netlink crate's;
//! [`observe`] reads the kernel back as the engine's table. Nothing here decides what the table
//! should hold, and nothing outside the kernel-facing crates opens a socket: this module only
//! calls `kube-ipvs-netlink`.

pub mod convert;
pub mod mem;
pub mod observe;

/// What the unit tests of the executor and the conversions share.
#[cfg(test)]
pub(crate) mod test_support {
    use std::net::IpAddr;

    use kube_ipvs_diff::{Protocol, Scheduler, VirtualKey, VirtualServer};

    /// An address literal.
    pub(crate) fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal")
    }

    /// A round-robin TCP virtual server without persistence.
    pub(crate) fn vs(addr: &str, port: u16) -> VirtualServer {
        VirtualServer {
            key: VirtualKey::inet(Protocol::Tcp, ip(addr), port),
            scheduler: Scheduler::RR,
            persistence: None,
            netmask: if ip(addr).is_ipv4() { 32 } else { 128 },
        }
    }
}

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use kube_ipvs_diff::{DestKey, ServiceEntry, VirtualKey};
use kube_ipvs_host::masquerade::{self, Family, MasqueradeError};
use kube_ipvs_netlink::ipvs::{Destination, Ipvs, Request};
use kube_ipvs_netlink::link::Rtnl;
use kube_ipvs_netlink::nfnl::conntrack;
use kube_ipvs_netlink::nfnl::ipset::{Ipset, Member, SetKind};

use observe::Observed;

/// Connection counts (active + inactive) by virtual server and real server.
///
/// Hashed with foldhash (seeded per process), not SipHash: a reconcile under churn removes and
/// inserts every real server of the virtual servers it reads again or takes on the engine's
/// word, and at 1,000 Services of 250 real servers SipHash made those 250,000 removals the
/// largest part of the loop's 2.1 s there under emulation (54 of about 100 ms natively).
pub type Counts = HashMap<(VirtualKey, DestKey), u64, foldhash::fast::RandomState>;

/// Why a kernel operation failed.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The netlink crate's error: it names the operation and object and keeps the errno.
    #[error(transparent)]
    Netlink(#[from] kube_ipvs_netlink::Error),
    /// The iptables tools failed (it names the tool, its arguments and what it printed).
    #[error(transparent)]
    Iptables(#[from] MasqueradeError),
    /// One error that failed a whole batch, repeated for each of its operations.
    #[error("{message}")]
    Batch {
        /// The batch's error, as the netlink crate words it.
        message: String,
        /// Its errno, when the kernel gave one.
        errno: Option<i32>,
    },
    /// A refusal without an errno: an in-memory kernel's in the host tests, or an answer that
    /// never came.
    #[error("{0}")]
    Refused(String),
}

impl KernelError {
    /// The positive errno behind the error, when the kernel gave one.
    #[must_use]
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Netlink(e) => e.errno(),
            Self::Batch { errno, .. } => *errno,
            Self::Iptables(_) | Self::Refused(_) => None,
        }
    }
}

/// Which UDP conntrack entries to delete after an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum UdpFlush {
    /// Flows answered by this endpoint (a deleted UDP real server).
    Endpoint(IpAddr, u16),
    /// Flows sent to this virtual server (a deleted UDP virtual server).
    Service(IpAddr, u16),
}

impl std::fmt::Display for UdpFlush {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Endpoint(a, p) => write!(f, "UDP endpoint {}", std::net::SocketAddr::new(*a, *p)),
            Self::Service(a, p) => write!(
                f,
                "UDP virtual server {}",
                std::net::SocketAddr::new(*a, *p)
            ),
        }
    }
}

/// Everything the binary does to the kernel: the IPVS table, the dummy interface, the node's
/// addresses, conntrack, the hairpin ipsets and the masquerade rules. [`RealKernel`] is the real
/// one; the host tests use [`mem::MemKernel`]. `Send`, so the masquerade worker thread can own
/// a handle of its own.
pub trait Kernel: Send {
    /// Applies IPVS requests in order, one result per request; a failure does not stop the rest.
    fn apply_requests(&mut self, requests: &[Request]) -> Vec<Result<(), KernelError>>;
    /// Makes sure the dummy interface exists.
    fn ensure_interface(&mut self) -> Result<(), KernelError>;
    /// Binds an address to the dummy interface.
    fn add_address(&mut self, addr: IpAddr) -> Result<(), KernelError>;
    /// Binds many addresses, one result per address in order. The real kernel sends them in
    /// batches; the default binds one at a time.
    fn add_addresses(&mut self, addrs: &[IpAddr]) -> Vec<Result<(), KernelError>> {
        addrs.iter().map(|a| self.add_address(*a)).collect()
    }
    /// Something that binds addresses to the dummy interface on a thread of its own (a socket
    /// of its own), so a big apply binds its addresses while it sends its IPVS requests
    /// ([`crate::apply`]); `None` where the kernel has no such handle (the default), and the
    /// apply binds on its own thread first.
    fn address_binder(&mut self) -> Option<AddressBinder> {
        None
    }
    /// Unbinds an address from the dummy interface.
    fn remove_address(&mut self, addr: IpAddr) -> Result<(), KernelError>;
    /// Dumps the IPVS table and `kube-ipvs0`'s addresses, with each real server's connections.
    fn observe(&mut self) -> Result<(Observed, Counts), KernelError>;
    /// The connections of the real servers of these virtual servers (for draining).
    fn connection_counts(&mut self, services: &BTreeSet<VirtualKey>) -> Counts;
    /// Reads these virtual servers, each with its real servers and their connections: `None`
    /// for one the kernel does not hold, or holds in a form the engine cannot represent (as
    /// [`Kernel::observe`] leaves it out of its table).
    fn observe_services(
        &mut self,
        keys: &BTreeSet<VirtualKey>,
    ) -> Result<(BTreeMap<VirtualKey, Option<ServiceEntry>>, Counts), KernelError>;
    /// The node's own addresses (not `kube-ipvs0`'s, not loopback, not link-local).
    fn node_addresses(&mut self) -> Result<Vec<IpAddr>, KernelError>;
    /// Deletes the UDP conntrack entries a deleted real or virtual server leaves behind, so
    /// datagrams of those flows are scheduled afresh instead of going to a gone endpoint; says
    /// how many it deleted. The default does nothing: a kernel without conntrack (the
    /// in-memory one of the loop tests) has none to delete.
    fn flush_udp(&mut self, target: UdpFlush) -> Result<usize, KernelError> {
        let _ = target;
        Ok(0)
    }
    /// Creates the set `name` of `kind` for `family` if it is absent (the hairpin sets,
    /// [`kube_ipvs_netlink::nfnl::ipset::set_name`], and the service sets, [`kube_ipvs_host::sets`]).
    fn create_set(
        &mut self,
        name: &'static str,
        family: Family,
        kind: SetKind,
    ) -> Result<(), KernelError>;
    /// The members of the set `name`, or `None` if there is no such set.
    fn list_set(&mut self, name: &'static str) -> Result<Option<Vec<Member>>, KernelError>;
    /// Adds (`add`) or deletes members of the set `name` (present or absent ones are fine).
    fn change_set(
        &mut self,
        name: &'static str,
        add: bool,
        members: &[Member],
    ) -> Result<(), KernelError>;
    /// Makes the kernel hold exactly these masquerade rules (our chains, `iptables-restore`).
    fn ensure_rules(&mut self, config: &masquerade::Config) -> Result<(), KernelError>;
    /// Removes kube-proxy's IPVS-mode chains and ipsets ([`kube_ipvs_host::kube_proxy`]) and
    /// says what it removed, one line each. The default has none to remove.
    fn remove_kube_proxy_leftovers(&mut self) -> Result<Vec<String>, KernelError> {
        Ok(Vec::new())
    }
}

/// How the service addresses are made local so IPVS sees their packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Binding {
    /// Each address bound to `kube-ipvs0`, as kube-proxy's IPVS mode does (the default).
    #[default]
    Address,
    /// Each address a local route of ours through `lo` (`kube-ipvs run
    /// --service-address-binding=route`): no walk of an address list per add, so 50,000
    /// addresses take seconds instead of minutes, and `ip addr show kube-ipvs0` lists none.
    Route,
    /// Either way, for the tools that read or clean a node whatever the agent's setting: a
    /// read holds both the addresses and the routes, a removal removes both.
    Either,
}

impl std::str::FromStr for Binding {
    type Err = String;

    /// The flag's values: `address` or `route` ([`Binding::Either`] is the tools' own).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "address" => Ok(Self::Address),
            "route" => Ok(Self::Route),
            _ => Err(format!("{s:?} is neither address nor route")),
        }
    }
}

impl std::fmt::Display for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Address => "address",
            Self::Route => "route",
            Self::Either => "either",
        })
    }
}

/// Binds addresses, one result per address in order (see [`Kernel::address_binder`]).
pub type AddressBinder = Box<dyn FnMut(&[IpAddr]) -> Vec<Result<(), KernelError>> + Send>;

/// The real kernel: the IPVS handle and rtnetlink, the ipset handle (opened at first use and
/// again after an error), conntrack (a socket per flush) and the iptables tools.
pub struct RealKernel {
    /// The IPVS generic netlink handle.
    pub ipvs: Ipvs,
    /// rtnetlink.
    pub rtnl: Rtnl,
    /// The dummy interface (`kube-ipvs0`).
    pub ifname: String,
    /// How service addresses are made local.
    binding: Binding,
    ipset: Option<Ipset>,
    /// Whether whole reads rest between virtual servers ([`RealKernel::paced`]).
    paced: bool,
}

/// How long a paced whole read reads before it rests.
const STRETCH: std::time::Duration = std::time::Duration::from_millis(5);

/// A paced read's rest after `worked` of reading since the last one: none until a stretch is
/// done, then as long as the stretch, so the read takes at most half of one CPU.
fn rest_after(worked: std::time::Duration) -> Option<std::time::Duration> {
    (worked >= STRETCH).then_some(worked)
}

impl RealKernel {
    /// Opens the IPVS and rtnetlink handles for the dummy interface `ifname`.
    pub fn open(ifname: &str) -> Result<Self, KernelError> {
        Ok(Self::with(Ipvs::new()?, Rtnl::new()?, ifname))
    }

    /// The kernel through handles the caller opened (and configured).
    #[must_use]
    pub fn with(ipvs: Ipvs, rtnl: Rtnl, ifname: &str) -> Self {
        Self {
            ipvs,
            rtnl,
            ifname: ifname.to_owned(),
            binding: Binding::Address,
            ipset: None,
            paced: false,
        }
    }

    /// The kernel binding service addresses this way (the default: [`Binding::Address`]).
    #[must_use]
    pub fn binding(mut self, binding: Binding) -> Self {
        self.binding = binding;
        self
    }

    /// Whole reads ([`Kernel::observe`]) that rest as long as they read: for the
    /// reconcile's reader thread. Under emulation a whole read of 10,000 Services takes seconds
    /// of a CPU, which the agent's loop and the rest of the node then lack.
    #[must_use]
    pub fn paced(mut self) -> Self {
        self.paced = true;
        self
    }

    /// Runs `f` on the ipset handle, opening it first if needed. A handle that failed may hold
    /// unread replies, so a fresh one is opened next time.
    fn with_ipset<T>(
        &mut self,
        f: impl FnOnce(&mut Ipset) -> kube_ipvs_netlink::Result<T>,
    ) -> Result<T, KernelError> {
        let mut h = match self.ipset.take() {
            Some(h) => h,
            None => Ipset::new()?,
        };
        let result = f(&mut h)?;
        self.ipset = Some(h);
        Ok(result)
    }

    /// The IPVS table and the dummy interface's addresses as the engine's table.
    pub fn read(&mut self) -> Result<Observed, KernelError> {
        self.observe().map(|(observed, _)| observed)
    }

    /// Whether the dummy interface exists (the agent makes it whatever the binding), and the
    /// service addresses made local the binding's way.
    fn bound(&mut self) -> Result<(bool, Vec<IpAddr>), KernelError> {
        let interface = self.rtnl.link_index(&self.ifname)?.is_some();
        let mut bound = match self.binding {
            Binding::Address | Binding::Either if interface => self.rtnl.addresses(&self.ifname)?,
            _ => Vec::new(),
        };
        if self.binding != Binding::Address {
            bound.extend(self.rtnl.local_routes()?);
        }
        Ok((interface, bound))
    }

    /// Moves service addresses the engine owns (`owned`) made local the other way to this
    /// binding's way ([`Rtnl::move_to_routes`], [`Rtnl::move_to_addresses`]: each made local
    /// the new way before the old is undone): after a change of `--service-address-binding`,
    /// before the first sync. Says how many it moved, or the first failure once the others are
    /// moved. [`Binding::Either`] moves nothing.
    pub fn move_bindings(&mut self, owned: impl Fn(IpAddr) -> bool) -> Result<usize, KernelError> {
        // The kernel's own IPv6 link-local address of an interface someone set up is no
        // service address (as `Observed::set_addresses` leaves it out): it stays, and so does
        // the interface.
        let service = |a: &IpAddr| owned(*a) && !(a.is_ipv6() && kube_ipvs_diff::is_link_local(*a));
        Ok(match self.binding {
            Binding::Address => {
                let routes: Vec<IpAddr> = self
                    .rtnl
                    .local_routes()?
                    .into_iter()
                    .filter(service)
                    .collect();
                self.rtnl.move_to_addresses(&self.ifname, &routes)?
            }
            Binding::Route if self.rtnl.link_index(&self.ifname)?.is_some() => {
                let bound = self.rtnl.addresses(&self.ifname)?;
                let all = bound.len();
                let ours: Vec<IpAddr> = bound.into_iter().filter(service).collect();
                let whole = ours.len() == all;
                self.rtnl.move_to_routes(&self.ifname, &ours, whole)?
            }
            Binding::Route | Binding::Either => 0,
        })
    }
}

impl Kernel for RealKernel {
    fn apply_requests(&mut self, requests: &[Request]) -> Vec<Result<(), KernelError>> {
        self.ipvs
            .apply(requests)
            .into_iter()
            .map(|r| r.map_err(KernelError::from))
            .collect()
    }

    fn ensure_interface(&mut self) -> Result<(), KernelError> {
        self.rtnl.ensure_dummy(&self.ifname)?;
        Ok(())
    }

    fn add_address(&mut self, addr: IpAddr) -> Result<(), KernelError> {
        match self.binding {
            Binding::Address | Binding::Either => self.rtnl.add_address(&self.ifname, addr)?,
            Binding::Route => {
                bind(&mut self.rtnl, &self.ifname, Binding::Route, &[addr])
                    .pop()
                    .unwrap_or(Ok(()))?;
            }
        }
        Ok(())
    }

    fn add_addresses(&mut self, addrs: &[IpAddr]) -> Vec<Result<(), KernelError>> {
        bind(&mut self.rtnl, &self.ifname, self.binding, addrs)
    }

    fn address_binder(&mut self) -> Option<AddressBinder> {
        // A socket of its own: rtnetlink and IPVS take different kernel locks, so the binds
        // and the IPVS requests run at the same time on two CPUs.
        let mut rtnl = Rtnl::new().ok()?;
        let ifname = self.ifname.clone();
        let binding = self.binding;
        Some(Box::new(move |addrs| {
            bind(&mut rtnl, &ifname, binding, addrs)
        }))
    }

    fn remove_address(&mut self, addr: IpAddr) -> Result<(), KernelError> {
        // Both ways whatever the binding, so what a failed move left the other way goes with
        // its Service: the way not in use answers "not there", which is fine, and a missing
        // interface holds no address.
        self.rtnl.del_local_route(addr)?;
        Ok(self.rtnl.del_address(&self.ifname, addr)?)
    }

    fn observe(&mut self) -> Result<(Observed, Counts), KernelError> {
        // One service dump, then one destination dump per virtual server, each turned into
        // the engine's entry and counts at once: the raw dump is never held whole. A foreign
        // virtual server's connections are not counted: the engine never touches it.
        let mut observed = Observed::default();
        let mut counts = Counts::default();
        let mut stretch = std::time::Instant::now();
        for svc in self.ipvs.services()? {
            let dests = self.ipvs.destinations(&svc.key)?;
            if let Some(key) = observed.add(&svc, &dests) {
                dest_counts(&mut counts, key, &dests);
            }
            if let Some(rest) = rest_after(stretch.elapsed()).filter(|_| self.paced) {
                std::thread::sleep(rest);
                stretch = std::time::Instant::now();
            }
        }
        let (interface, bound) = self.bound()?;
        observed.set_addresses(Some(bound));
        observed.interface_exists = interface;
        Ok((observed, counts))
    }

    fn connection_counts(&mut self, services: &BTreeSet<VirtualKey>) -> Counts {
        let mut counts = Counts::default();
        for key in services {
            // An unreadable virtual server leaves its counts unknown, which the engine treats
            // as "may have connections": the safe side.
            if let Ok(dests) = self.ipvs.destinations(&convert::service_key(key)) {
                dest_counts(&mut counts, *key, &dests);
            }
        }
        counts
    }

    fn observe_services(
        &mut self,
        keys: &BTreeSet<VirtualKey>,
    ) -> Result<(BTreeMap<VirtualKey, Option<ServiceEntry>>, Counts), KernelError> {
        let mut entries = BTreeMap::new();
        let mut counts = Counts::default();
        for key in keys {
            let sk = convert::service_key(key);
            let entry = match self.ipvs.service(&sk)? {
                None => None,
                Some(svc) => {
                    let dests = self.ipvs.destinations(&sk)?;
                    dest_counts(&mut counts, *key, &dests);
                    convert::entry_from_kernel(&svc, &dests).ok()
                }
            };
            entries.insert(*key, entry);
        }
        Ok((entries, counts))
    }

    fn node_addresses(&mut self) -> Result<Vec<IpAddr>, KernelError> {
        let ours = self.rtnl.link_index(&self.ifname)?;
        let all = self.rtnl.local_addresses()?;
        Ok(all
            .into_iter()
            .filter(|a| Some(a.ifindex) != ours)
            .map(|a| a.addr)
            .filter(|a| !a.is_loopback() && !kube_ipvs_diff::is_link_local(*a))
            .collect())
    }

    fn flush_udp(&mut self, target: UdpFlush) -> Result<usize, KernelError> {
        Ok(match target {
            UdpFlush::Endpoint(a, p) => conntrack::flush_udp_endpoint(a, p)?,
            UdpFlush::Service(a, p) => conntrack::flush_udp_service(a, p)?,
        })
    }

    fn create_set(
        &mut self,
        name: &'static str,
        family: Family,
        kind: SetKind,
    ) -> Result<(), KernelError> {
        self.with_ipset(|h| h.create(name, family, kind))
    }

    fn list_set(&mut self, name: &'static str) -> Result<Option<Vec<Member>>, KernelError> {
        self.with_ipset(|h| h.list(name))
    }

    fn change_set(
        &mut self,
        name: &'static str,
        add: bool,
        members: &[Member],
    ) -> Result<(), KernelError> {
        if add {
            self.with_ipset(|h| h.add(name, members))
        } else {
            self.with_ipset(|h| h.del(name, members))
        }
    }

    fn ensure_rules(&mut self, config: &masquerade::Config) -> Result<(), KernelError> {
        masquerade::Masquerade::new(config.clone())?.ensure()?;
        Ok(())
    }

    fn remove_kube_proxy_leftovers(&mut self) -> Result<Vec<String>, KernelError> {
        let found = kube_ipvs_host::kube_proxy::remove(None)?;
        let mut lines = Vec::new();
        for r in &found.rules {
            for c in &r.chains {
                lines.push(format!("iptables chain {c} ({})", r.tool));
            }
            if r.jumps > 0 {
                lines.push(format!("{} jump rule(s) to them ({})", r.jumps, r.tool));
            }
        }
        lines.extend(found.sets.iter().map(|s| format!("ipset {s}")));
        Ok(lines)
    }
}

/// Makes addresses local the binding's way in batches (bound to `ifname`, or local routes), one
/// result per address.
fn bind(
    rtnl: &mut Rtnl,
    ifname: &str,
    binding: Binding,
    addrs: &[IpAddr],
) -> Vec<Result<(), KernelError>> {
    let sent = match binding {
        Binding::Address | Binding::Either => rtnl.add_addresses(ifname, addrs),
        Binding::Route => rtnl.add_local_routes(addrs),
    };
    match sent {
        Ok(results) => results
            .into_iter()
            .map(|r| r.map_err(KernelError::from))
            .collect(),
        Err(e) => {
            // One error failed the whole batch (the link lookup): each address gets it, with
            // its errno.
            let (message, errno) = (e.to_string(), e.errno());
            addrs
                .iter()
                .map(|_| {
                    Err(KernelError::Batch {
                        message: message.clone(),
                        errno,
                    })
                })
                .collect()
        }
    }
}

fn dest_counts(counts: &mut Counts, key: VirtualKey, dests: &[Destination]) {
    for d in dests {
        let dk = DestKey {
            addr: d.addr,
            port: d.port,
        };
        counts.insert(
            (key, dk),
            u64::from(d.active_conns) + u64::from(d.inactive_conns),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{STRETCH, rest_after};
    use std::time::Duration;

    #[test]
    fn a_paced_read_rests_as_long_as_each_finished_stretch() {
        let ms = Duration::from_millis;
        assert_eq!(rest_after(ms(1)), None, "a stretch under way");
        assert_eq!(rest_after(STRETCH), Some(STRETCH));
        assert_eq!(rest_after(ms(40)), Some(ms(40)), "a long virtual server");
    }
}
