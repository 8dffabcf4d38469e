//! Firewall marks for the Local-policy short circuit.
//!
//! A Service with `externalTrafficPolicy: Local` sends external clients of its NodePorts,
//! external IPs and load-balancer IPs to this node's endpoints only. Clients inside the cluster
//! (this node's Pods, and the node itself) must reach every endpoint instead, as the Service API
//! says and kube-proxy's iptables and nftables modes do. An IPVS virtual server is chosen by
//! destination only, so the two kinds of client cannot share one: each such Service port gets a
//! **firewall mark**, and a fwmark virtual server of that mark holds the cluster-wide endpoints
//! (one per family). The host rules give new connections from local clients to the Service's
//! external addresses that mark (`SET --map-mark` from a set that maps each address and port to
//! its mark), and IPVS looks a marked packet up by its mark before its address.
//!
//! Marks come from a [`MarkSpace`] (a run of bits of the packet mark the operator leaves to us)
//! and are handed out by [`MarkTable`], kept by [`crate::Inputs`] so every reader of a
//! [`crate::ServiceInfo`] sees the same assignment. A port keeps its mark while it needs one;
//! a new one takes the mark the kernel already maps one of its ways in to (hints read from the
//! short circuit's sets at start, so a restarted agent and `check` agree with the running
//! agent), else starts its search at a hash of its name.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use crate::model::{Protocol, ServiceInfo, ServiceKind, ServiceName, ServicePort, TrafficPolicy};

/// The bits of the packet mark kube-ipvs gives its fwmark virtual servers: one contiguous run.
/// A mark is an index from 1 shifted to the run's lowest bit; every mark has no bit outside
/// the run and at least one inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MarkSpace {
    mask: u32,
}

impl MarkSpace {
    /// The default run, bits 20 to 29 (`0x3ff00000`): 1,023 marks, clear of kube-proxy's
    /// masquerade and drop bits (14, 15) and of the low bits other agents commonly use.
    pub const DEFAULT: MarkSpace = MarkSpace { mask: 0x3ff0_0000 };

    /// A space of the bits in `mask`, which must be one run of at least 4 bits.
    pub fn new(mask: u32) -> Result<Self, String> {
        if mask == 0 {
            return Err("the mark mask is empty".to_owned());
        }
        let run = mask >> mask.trailing_zeros();
        if run & (run + 1) != 0 {
            return Err(format!("the mark mask {mask:#x} is not one run of bits"));
        }
        if run.count_ones() < 4 {
            return Err(format!(
                "the mark mask {mask:#x} has fewer than 4 bits (at most 15 Service ports)"
            ));
        }
        Ok(Self { mask })
    }

    /// The mask.
    pub fn mask(&self) -> u32 {
        self.mask
    }

    /// How many marks there are.
    pub fn capacity(&self) -> u32 {
        self.mask >> self.mask.trailing_zeros()
    }

    /// The mark of `index` (1 to [`MarkSpace::capacity`]).
    fn mark(&self, index: u32) -> u32 {
        index << self.mask.trailing_zeros()
    }

    /// Whether `mark` is one of this space's (so an observed fwmark virtual server of that mark
    /// is ours).
    pub fn contains(&self, mark: u32) -> bool {
        mark != 0 && mark & !self.mask == 0
    }
}

impl Default for MarkSpace {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for MarkSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.mask)
    }
}

impl FromStr for MarkSpace {
    type Err = String;

    /// A mask in hexadecimal (`0x3ff00000`) or decimal.
    fn from_str(s: &str) -> Result<Self, String> {
        let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => s.parse(),
        };
        let mask = parsed.map_err(|_| format!("{s:?} is not a 32-bit mark mask"))?;
        Self::new(mask)
    }
}

/// The mark of one Service port: new connections from local clients to the port's external
/// addresses and NodePorts carry it, and its fwmark virtual servers hold the cluster-wide
/// endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortMark {
    /// The Service port's protocol.
    pub protocol: Protocol,
    /// The Service port (`spec.ports[].port`).
    pub port: u16,
    /// Its mark.
    pub mark: u32,
}

/// Whether a Service's ports need marks: Local external policy and some way in from outside
/// (a NodePort, an external IP or a load-balancer IP), with a ClusterIP.
pub fn needs_marks(info: &ServiceInfo) -> bool {
    info.kind != ServiceKind::ExternalName
        && !info.cluster_ips.is_empty()
        && info.external_traffic_policy == TrafficPolicy::Local
        && (!info.external_ips.is_empty()
            || !info.load_balancer_ips.is_empty()
            || info.ports.iter().any(|p| p.node_port.is_some()))
}

/// Where a mark was seen in the kernel (the short circuit's set): a way in (an external or
/// load-balancer address, or `None` for a NodePort on any address), a protocol and a port.
pub type MarkHint = (Option<IpAddr>, Protocol, u16);

/// The marks in use, and the space they come from (`None`: no marks, no short circuit).
#[derive(Debug, Clone, Default)]
pub struct MarkTable {
    space: Option<MarkSpace>,
    used: HashSet<u32>,
    /// Service ports that needed a mark and got none (the space was full).
    short: usize,
    /// The marks the kernel already maps each way in to: a port takes its way in's mark when
    /// it is free, so a restarted agent (and `check`) assigns what the running one did.
    hints: HashMap<MarkHint, u32>,
}

impl MarkTable {
    /// An empty table over `space`.
    pub fn new(space: Option<MarkSpace>) -> Self {
        Self {
            space,
            used: HashSet::new(),
            short: 0,
            hints: HashMap::new(),
        }
    }

    /// The marks the kernel holds, to be preferred by the ports whose ways in they map.
    pub fn set_hints(&mut self, hints: HashMap<MarkHint, u32>) {
        self.hints = hints;
    }

    /// The hinted mark of one of `info`'s ways in for `port`, if free and of the space.
    fn hinted(&self, space: MarkSpace, info: &ServiceInfo, port: &ServicePort) -> Option<u32> {
        let addrs = info
            .external_ips
            .iter()
            .chain(&info.load_balancer_ips)
            .map(|a| (Some(*a), port.protocol, port.port));
        let node_port = port.node_port.map(|np| (None, port.protocol, np));
        addrs
            .chain(node_port)
            .filter_map(|h| self.hints.get(&h).copied())
            .find(|m| space.contains(*m) && !self.used.contains(m))
    }

    /// The space marks come from.
    pub fn space(&self) -> Option<MarkSpace> {
        self.space
    }

    /// How many Service ports needed a mark and got none, over all assignments so far.
    pub fn short(&self) -> usize {
        self.short
    }

    /// Gives `info` the marks its ports need, keeping those `old` had for the same port and
    /// releasing the rest of `old`'s.
    pub fn assign(&mut self, name: &ServiceName, info: &mut ServiceInfo, old: &[PortMark]) {
        let mut marks = Vec::new();
        if let Some(space) = self.space.filter(|_| needs_marks(info)) {
            for p in &info.ports {
                if marks
                    .iter()
                    .any(|m: &PortMark| (m.protocol, m.port) == (p.protocol, p.port))
                {
                    continue;
                }
                let kept = old
                    .iter()
                    .find(|m| (m.protocol, m.port) == (p.protocol, p.port))
                    .map(|m| m.mark);
                let hinted = || {
                    self.hinted(space, info, p).inspect(|m| {
                        self.used.insert(*m);
                    })
                };
                let mark = kept
                    .or_else(hinted)
                    .or_else(|| self.take(space, name, p.protocol, p.port));
                match mark {
                    Some(mark) => marks.push(PortMark {
                        protocol: p.protocol,
                        port: p.port,
                        mark,
                    }),
                    None => self.short += 1,
                }
            }
        }
        for m in old {
            if !marks.contains(m) {
                self.used.remove(&m.mark);
            }
        }
        info.local_marks = marks;
    }

    /// Releases the marks of a removed Service.
    pub fn release(&mut self, marks: &[PortMark]) {
        for m in marks {
            self.used.remove(&m.mark);
        }
    }

    /// A free mark, searched from a hash of the port's identity.
    fn take(
        &mut self,
        space: MarkSpace,
        name: &ServiceName,
        protocol: Protocol,
        port: u16,
    ) -> Option<u32> {
        let capacity = space.capacity();
        if self.used.len() >= capacity as usize {
            return None;
        }
        let start = fnv1a(name, protocol, port) % capacity;
        (0..capacity)
            .map(|i| space.mark((start + i) % capacity + 1))
            .find(|m| self.used.insert(*m))
    }
}

/// FNV-1a over the Service name and port: a hash that is the same in every process (the
/// standard library's and foldhash's are seeded per process).
fn fnv1a(name: &ServiceName, protocol: Protocol, port: u16) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    let bytes = name
        .namespace
        .bytes()
        .chain([b'/'])
        .chain(name.name.bytes())
        .chain([b'/', protocol.number()])
        .chain(port.to_be_bytes());
    for b in bytes {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ServicePort;

    fn local_node_port(ports: &[u16]) -> ServiceInfo {
        ServiceInfo {
            kind: ServiceKind::NodePort,
            cluster_ips: vec!["10.96.0.1".parse().expect("literal")],
            ports: ports
                .iter()
                .map(|&p| ServicePort {
                    name: format!("p{p}"),
                    protocol: Protocol::Tcp,
                    port: p,
                    node_port: Some(30000 + p),
                })
                .collect(),
            external_traffic_policy: TrafficPolicy::Local,
            ..ServiceInfo::default()
        }
    }

    #[test]
    fn a_mask_is_one_run_of_at_least_four_bits() {
        assert_eq!(MarkSpace::DEFAULT.capacity(), 1023);
        assert!(MarkSpace::new(0).is_err());
        assert!(MarkSpace::new(0x7).is_err());
        assert!(MarkSpace::new(0xf0f0).is_err());
        let s: MarkSpace = "0xf000".parse().expect("valid");
        assert_eq!((s.capacity(), s.mark(1), s.mark(15)), (15, 0x1000, 0xf000));
        assert!(s.contains(0x3000) && !s.contains(0) && !s.contains(0x13000));
        assert!("0xg".parse::<MarkSpace>().is_err());
    }

    #[test]
    fn marks_are_unique_kept_across_updates_and_released() {
        let space = MarkSpace::new(0xf0).expect("valid");
        let mut t = MarkTable::new(Some(space));
        let a = ServiceName::new("default", "a");
        let mut info = local_node_port(&[80, 443]);
        t.assign(&a, &mut info, &[]);
        let first = info.local_marks.clone();
        assert_eq!(first.len(), 2);
        assert_ne!(first[0].mark, first[1].mark);
        assert!(first.iter().all(|m| space.contains(m.mark)));

        // An update that keeps port 80 keeps its mark and frees port 443's.
        let mut next = local_node_port(&[80, 8080]);
        t.assign(&a, &mut next, &first);
        assert_eq!(next.local_marks[0], first[0]);
        assert_eq!(t.used.len(), 2);

        // Cluster policy needs none: both are released.
        let mut cluster = next.clone();
        cluster.external_traffic_policy = TrafficPolicy::Cluster;
        let held = next.local_marks.clone();
        t.assign(&a, &mut cluster, &held);
        assert!(cluster.local_marks.is_empty() && t.used.is_empty());
    }

    #[test]
    fn a_full_space_leaves_ports_without_marks_and_counts_them() {
        let mut t = MarkTable::new(Some(MarkSpace::new(0xf).expect("valid")));
        let mut all = Vec::new();
        for i in 0..16 {
            let mut info = local_node_port(&[80]);
            t.assign(&ServiceName::new("ns", format!("s{i}")), &mut info, &[]);
            all.extend(info.local_marks);
        }
        assert_eq!(all.len(), 15);
        assert_eq!(t.short(), 1);
        let unique: HashSet<u32> = all.iter().map(|m| m.mark).collect();
        assert_eq!(unique.len(), 15);
    }

    /// Two ports whose hashes collide get their marks in arrival order; a table seeded with the
    /// kernel's marks gives them the same marks whatever the order they arrive in.
    #[test]
    fn hints_from_the_kernel_keep_the_marks_the_running_agent_gave() {
        let space = MarkSpace::new(0xf).expect("valid");
        // 14 ports in 15 marks: their hashes collide, so the order decides.
        let names: Vec<ServiceName> = (0..14)
            .map(|i| ServiceName::new("ns", format!("s{i}")))
            .collect();
        let info = |i: u16| local_node_port(&[80 + i]);
        let mut running = MarkTable::new(Some(space));
        let mut given = HashMap::new();
        for (i, n) in names.iter().enumerate() {
            let mut svc = info(i as u16);
            running.assign(n, &mut svc, &[]);
            let m = svc.local_marks[0];
            let np = svc.ports[0].node_port.expect("node port");
            given.insert((None, m.protocol, np), m.mark);
        }
        // Without hints, the opposite order gives some port another mark.
        let mut unhinted = MarkTable::new(Some(space));
        let mut moved = 0;
        for (i, n) in names.iter().enumerate().rev() {
            let mut svc = info(i as u16);
            unhinted.assign(n, &mut svc, &[]);
            let np = svc.ports[0].node_port.expect("node port");
            let same = given.get(&(None, Protocol::Tcp, np)) == Some(&svc.local_marks[0].mark);
            moved += usize::from(!same);
        }
        assert!(moved > 0, "the test needs colliding ports");
        // A restart sees the Services in the opposite order, with the kernel's marks as hints.
        let mut restarted = MarkTable::new(Some(space));
        restarted.set_hints(given.clone());
        for (i, n) in names.iter().enumerate().rev() {
            let mut svc = info(i as u16);
            restarted.assign(n, &mut svc, &[]);
            let np = svc.ports[0].node_port.expect("node port");
            assert_eq!(
                Some(&svc.local_marks[0].mark),
                given.get(&(None, Protocol::Tcp, np)),
                "{n}"
            );
        }
    }

    #[test]
    fn the_first_mark_of_a_port_is_the_same_in_every_process() {
        let mut one = MarkTable::new(Some(MarkSpace::DEFAULT));
        let mut two = MarkTable::new(Some(MarkSpace::DEFAULT));
        let name = ServiceName::new("shop", "web");
        let (mut x, mut y) = (local_node_port(&[80]), local_node_port(&[80]));
        one.assign(&name, &mut x, &[]);
        two.assign(&name, &mut y, &[]);
        assert_eq!(x.local_marks, y.local_marks);
        assert_eq!(
            fnv1a(&name, Protocol::Tcp, 80),
            fnv1a(&name, Protocol::Tcp, 80)
        );
        assert_ne!(
            fnv1a(&name, Protocol::Tcp, 80),
            fnv1a(&name, Protocol::Udp, 80)
        );
    }
}
