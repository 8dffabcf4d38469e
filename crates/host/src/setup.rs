//! Kernel setup before the first sync: the modules IPVS needs, the sysctls it depends on, and the
//! node's hostname (kube-proxy's default node name).
//!
//! Modules are checked in `/proc/modules`, `/sys/module` and the kernel's `modules.builtin`;
//! one that is missing is loaded with `modprobe` only if a `modprobe` binary exists, and the
//! error names the module. Sysctls are written through `/proc/sys` (only when they differ), and
//! an error names the sysctl. The roots are fields so tests can point them at a directory of
//! their own. [`Host::prepare`] is the agent's whole setup: these, then the IPVS and
//! rtnetlink handles and the IPVS timeouts. This module does not touch the IPVS table.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Why the kernel cannot be prepared.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A kernel module is neither loaded nor built in, and could not be loaded.
    #[error("kernel module {module} is not loaded and {detail}")]
    MissingModule {
        /// The module.
        module: String,
        /// What was tried.
        detail: String,
    },
    /// A netlink handle could not be opened, or the IPVS timeouts not set.
    #[error("{what}: {source}")]
    Netlink {
        /// What was being done.
        what: &'static str,
        /// The netlink error.
        #[source]
        source: kube_ipvs_netlink::Error,
    },
    /// A sysctl could not be read or written.
    #[error("sysctl {name}={value}: {source}")]
    Sysctl {
        /// The sysctl, dotted (`net.ipv4.ip_forward`).
        name: String,
        /// The value we wanted.
        value: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Where the kernel's state is read and written.
#[derive(Debug, Clone)]
pub struct Host {
    /// `/proc`.
    pub proc_root: PathBuf,
    /// `/sys`.
    pub sys_root: PathBuf,
    /// `/lib/modules`.
    pub modules_root: PathBuf,
    /// The `modprobe` to run for a missing module; `None` never loads modules.
    pub modprobe: Option<PathBuf>,
}

impl Host {
    /// The running system, with the first `modprobe` found in the usual places.
    pub fn system() -> Self {
        let modprobe = ["/usr/sbin/modprobe", "/sbin/modprobe", "/usr/bin/modprobe"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists());
        Host {
            proc_root: "/proc".into(),
            sys_root: "/sys".into(),
            modules_root: "/lib/modules".into(),
            modprobe,
        }
    }

    /// Whether `module` is loaded or built into the kernel.
    pub fn module_present(&self, module: &str) -> bool {
        let loaded = std::fs::read_to_string(self.proc_root.join("modules"))
            .map(|text| {
                text.lines()
                    .any(|l| l.split_whitespace().next() == Some(module))
            })
            .unwrap_or(false);
        loaded || self.sys_root.join("module").join(module).is_dir() || self.builtin(module)
    }

    /// Whether the kernel's `modules.builtin` lists `module` (built-in modules without
    /// parameters have no `/sys/module` entry).
    fn builtin(&self, module: &str) -> bool {
        let Ok(release) = std::fs::read_to_string(self.proc_root.join("sys/kernel/osrelease"))
        else {
            return false;
        };
        let list = self
            .modules_root
            .join(release.trim())
            .join("modules.builtin");
        let file = format!("{module}.ko");
        std::fs::read_to_string(list)
            .map(|text| {
                text.lines()
                    .any(|l| Path::new(l).file_name().and_then(|f| f.to_str()) == Some(&file))
            })
            .unwrap_or(false)
    }

    /// Makes sure each module is there, loading the missing ones if `modprobe` exists.
    pub fn ensure_modules(&self, modules: &[String]) -> Result<(), SetupError> {
        for module in modules {
            if self.module_present(module) {
                continue;
            }
            let missing = |detail: String| SetupError::MissingModule {
                module: module.clone(),
                detail,
            };
            let Some(modprobe) = &self.modprobe else {
                return Err(missing(
                    "there is no modprobe to load it; load it on the host".to_owned(),
                ));
            };
            // The module name comes from our own scheduler list, never from API data.
            let out = Command::new(modprobe)
                .arg("--")
                .arg(module)
                .output()
                .map_err(|e| missing(format!("running {} failed: {e}", modprobe.display())))?;
            if !out.status.success() || !self.module_present(module) {
                let stderr = String::from_utf8_lossy(&out.stderr);
                return Err(missing(format!(
                    "{} could not load it: {}",
                    modprobe.display(),
                    stderr.trim()
                )));
            }
            tracing::info!("loaded kernel module {module}");
        }
        Ok(())
    }

    /// Sets each sysctl (dotted name, value) that does not already have the value.
    pub fn set_sysctls(&self, sysctls: &[(&str, &str)]) -> Result<(), SetupError> {
        for (name, value) in sysctls {
            let path = self.proc_root.join("sys").join(name.replace('.', "/"));
            let err = |source| SetupError::Sysctl {
                name: (*name).to_owned(),
                value: (*value).to_owned(),
                source,
            };
            let current = std::fs::read_to_string(&path).map_err(err)?;
            if current.trim() == *value {
                continue;
            }
            std::fs::write(&path, format!("{value}\n")).map_err(err)?;
            tracing::info!("set sysctl {name}={value} (was {})", current.trim());
        }
        Ok(())
    }
}

/// The kernel's hostname, as kube-proxy defaults the node name (lowercased, trimmed); `/etc/hostname`
/// if `/proc` cannot tell.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .map(|h| h.trim().to_lowercase())
        .filter(|h| !h.is_empty())
}

/// The modules IPVS mode needs with this default scheduler.
pub fn required_modules(scheduler: &kube_ipvs_diff::Scheduler) -> Vec<String> {
    vec![
        "ip_vs".to_owned(),
        format!("ip_vs_{}", scheduler.name()),
        "nf_conntrack".to_owned(),
    ]
}

/// The modules the ipsets and the rules matching them use: the ipset core, the set types of
/// exact hairpin (`hash:net,net`) and of the `filter` rules ([`crate::filter`]), and the
/// iptables matches and target those rules use. They are loaded best-effort: without them
/// hairpin falls back to one rule per local endpoint and the `filter` table is left alone (the
/// agent's masquerade state warns), so a missing one is a warning, not a failure.
pub fn set_modules() -> Vec<String> {
    [
        "ip_set",
        "ip_set_hash_netnet",
        "ip_set_hash_ip",
        "ip_set_hash_ipport",
        "ip_set_hash_ipportnet",
        "ip_set_bitmap_port",
        "xt_set",
        "xt_addrtype",
        "xt_conntrack",
        "ipt_REJECT",
        "ip6t_REJECT",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}

impl Host {
    /// Loads each module that is missing, as [`Host::ensure_modules`] does, but goes on after a
    /// failure; returns the failures.
    pub fn load_optional_modules(&self, modules: &[String]) -> Vec<SetupError> {
        modules
            .iter()
            .filter_map(|m| self.ensure_modules(std::slice::from_ref(m)).err())
            .collect()
    }
}

/// The sysctls IPVS mode needs: connection tracking for IPVS (so masquerade and conntrack
/// cleanup see its connections), dropping connections whose real server is gone or quiescent,
/// forwarding, and optionally strict ARP so Service addresses on `kube-ipvs0` are not
/// answered for on the node's other interfaces.
pub fn required_sysctls(strict_arp: bool) -> Vec<(&'static str, &'static str)> {
    let mut out = vec![
        ("net.ipv4.vs.conntrack", "1"),
        ("net.ipv4.vs.expire_nodest_conn", "1"),
        ("net.ipv4.vs.expire_quiescent_template", "1"),
        ("net.ipv4.ip_forward", "1"),
    ];
    if strict_arp {
        out.push(("net.ipv4.conf.all.arp_ignore", "1"));
        out.push(("net.ipv4.conf.all.arp_announce", "2"));
    }
    out
}

/// The kernel's IPVS rate estimator off (kernels 5.12 and later): before 6.2 its timer walks
/// every virtual and real server's counters every 2 s under the lock each IPVS add and delete
/// takes; the same walk sums the counters `ipvsadm --stats` shows.
const NO_RATE_ESTIMATION: (&str, &str) = ("net.ipv4.vs.run_estimation", "0");

/// kube-proxy's `conntrack` settings (`KubeProxyConfiguration.conntrack` and the
/// `--conntrack-*` flags), with its defaults. `None` or zero leaves the kernel's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conntrack {
    /// Table size per CPU (`maxPerCore`, default 32768).
    pub max_per_core: u32,
    /// The least table size (`min`, default 131072).
    pub min: u32,
    /// `tcpEstablishedTimeout` in seconds (default 24 h).
    pub tcp_established: u64,
    /// `tcpCloseWaitTimeout` in seconds (default 1 h).
    pub tcp_close_wait: u64,
    /// `tcpBeLiberal` (default false: left alone).
    pub tcp_be_liberal: bool,
    /// `udpTimeout` in seconds (default 0: left alone).
    pub udp: u64,
    /// `udpStreamTimeout` in seconds (default 0: left alone).
    pub udp_stream: u64,
}

impl Default for Conntrack {
    fn default() -> Self {
        Self {
            max_per_core: 32_768,
            min: 131_072,
            tcp_established: 24 * 3600,
            tcp_close_wait: 3600,
            tcp_be_liberal: false,
            udp: 0,
            udp_stream: 0,
        }
    }
}

impl Conntrack {
    /// The table size kube-proxy sets: `maxPerCore` times the CPUs, at least `min`; `None`
    /// when `maxPerCore` is 0 (left alone).
    #[must_use]
    pub fn max(&self, cpus: usize) -> Option<u64> {
        (self.max_per_core > 0).then(|| {
            let cpus = u64::try_from(cpus.max(1)).unwrap_or(u64::MAX);
            (u64::from(self.max_per_core).saturating_mul(cpus)).max(u64::from(self.min))
        })
    }

    /// The sysctls these settings ask for, as (dotted name, value), in the order kube-proxy
    /// sets them; zero and false settings are left out.
    #[must_use]
    pub fn sysctls(&self, cpus: usize) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(max) = self.max(cpus) {
            out.push(("net.netfilter.nf_conntrack_max", max.to_string()));
        }
        let timeouts = [
            (
                "net.netfilter.nf_conntrack_tcp_timeout_established",
                self.tcp_established,
            ),
            (
                "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
                self.tcp_close_wait,
            ),
            ("net.netfilter.nf_conntrack_udp_timeout", self.udp),
            (
                "net.netfilter.nf_conntrack_udp_timeout_stream",
                self.udp_stream,
            ),
        ];
        for (name, secs) in timeouts {
            if secs > 0 {
                out.push((name, secs.to_string()));
            }
        }
        if self.tcp_be_liberal {
            out.push(("net.netfilter.nf_conntrack_tcp_be_liberal", "1".to_owned()));
        }
        out
    }
}

/// `net.ipv4.vs.conn_reuse_mode=0` on kernels 4.1 to 5.8, as kube-proxy sets it: there, mode 1
/// (the default) drops the first packet of a reused connection to a deleted or changed real
/// server, which stalls clients for a second; from 5.9 the kernel no longer needs it.
/// `osrelease` is `/proc/sys/kernel/osrelease`.
#[must_use]
pub fn conn_reuse_sysctl(osrelease: &str) -> Option<(&'static str, &'static str)> {
    let mut parts = osrelease
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().ok());
    let major = parts.next().flatten()?;
    let minor = parts.next().flatten()?;
    ((4, 1) <= (major, minor) && (major, minor) < (5, 9))
        .then_some(("net.ipv4.vs.conn_reuse_mode", "0"))
}

impl Host {
    /// The CPUs the kernel has online (`/sys/devices/system/cpu/online`, e.g. `0-3,6`); 1 if
    /// unreadable.
    #[must_use]
    pub fn cpus(&self) -> usize {
        let text = std::fs::read_to_string(self.sys_root.join("devices/system/cpu/online"))
            .unwrap_or_default();
        let n: usize = text
            .trim()
            .split(',')
            .filter(|r| !r.is_empty())
            .map(|r| match r.split_once('-') {
                Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                    (Ok(a), Ok(b)) if b >= a => b - a + 1,
                    _ => 0,
                },
                None => usize::from(r.parse::<usize>().is_ok()),
            })
            .sum();
        n.max(1)
    }

    /// Sets kube-proxy's conntrack and IPVS tuning sysctls, and with `no_rate_estimation` the
    /// rate estimator off ([`NO_RATE_ESTIMATION`]), going on after a failure; returns each
    /// failure (naming the sysctl). `nf_conntrack_max` is writable only in the initial
    /// network namespace; when it is raised, the hash table is grown to a quarter of it as
    /// kube-proxy does (`/sys/module/nf_conntrack/parameters/hashsize`).
    pub fn set_tuning_sysctls(
        &self,
        conntrack: &Conntrack,
        no_rate_estimation: bool,
    ) -> Vec<SetupError> {
        let mut wanted = conntrack.sysctls(self.cpus());
        if no_rate_estimation {
            wanted.push((NO_RATE_ESTIMATION.0, NO_RATE_ESTIMATION.1.to_owned()));
        }
        let release = std::fs::read_to_string(self.proc_root.join("sys/kernel/osrelease"))
            .unwrap_or_default();
        if let Some((name, value)) = conn_reuse_sysctl(&release) {
            wanted.push((name, value.to_owned()));
        }
        let mut failed = Vec::new();
        for (name, value) in &wanted {
            let result = self.set_sysctls(&[(name, value.as_str())]).and_then(|()| {
                if *name == "net.netfilter.nf_conntrack_max" {
                    self.grow_conntrack_hash(value)
                } else {
                    Ok(())
                }
            });
            if let Err(e) = result {
                failed.push(e);
            }
        }
        failed
    }

    /// Grows the conntrack hash table to a quarter of `max` if it is smaller.
    fn grow_conntrack_hash(&self, max: &str) -> Result<(), SetupError> {
        let path = self
            .sys_root
            .join("module/nf_conntrack/parameters/hashsize");
        let want = max.parse::<u64>().unwrap_or(0) / 4;
        let err = |source| SetupError::Sysctl {
            name: "nf_conntrack hashsize".to_owned(),
            value: want.to_string(),
            source,
        };
        let have: u64 = std::fs::read_to_string(&path)
            .map_err(err)?
            .trim()
            .parse()
            .unwrap_or(0);
        if have >= want {
            return Ok(());
        }
        std::fs::write(&path, format!("{want}\n")).map_err(err)?;
        tracing::info!("set nf_conntrack hashsize={want} (was {have})");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conntrack_settings_give_kube_proxys_sysctls() {
        let d = Conntrack::default();
        assert_eq!(d.max(2), Some(131_072), "the minimum wins on a small node");
        assert_eq!(d.max(8), Some(262_144));
        let zero = Conntrack {
            max_per_core: 0,
            ..d
        };
        assert_eq!(
            zero.max(64),
            None,
            "maxPerCore 0 leaves the table size alone"
        );
        let names: Vec<String> = d
            .sysctls(4)
            .into_iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect();
        assert_eq!(
            names,
            [
                "net.netfilter.nf_conntrack_max=131072",
                "net.netfilter.nf_conntrack_tcp_timeout_established=86400",
                "net.netfilter.nf_conntrack_tcp_timeout_close_wait=3600",
            ]
        );
        let all = Conntrack {
            tcp_be_liberal: true,
            udp: 30,
            udp_stream: 120,
            ..zero
        };
        let names: Vec<&str> = all.sysctls(4).into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"net.netfilter.nf_conntrack_tcp_be_liberal"));
        assert!(names.contains(&"net.netfilter.nf_conntrack_udp_timeout"));
        assert!(names.contains(&"net.netfilter.nf_conntrack_udp_timeout_stream"));
        assert!(!names.contains(&"net.netfilter.nf_conntrack_max"));
    }

    #[test]
    fn conn_reuse_mode_only_on_the_kernels_that_need_it() {
        assert_eq!(conn_reuse_sysctl("4.0.9"), None);
        assert!(conn_reuse_sysctl("4.1.0").is_some());
        assert!(conn_reuse_sysctl("5.8.18-100.fc31.x86_64").is_some());
        assert_eq!(conn_reuse_sysctl("5.9.0"), None);
        assert_eq!(conn_reuse_sysctl("6.1.0-28-amd64"), None);
        assert_eq!(conn_reuse_sysctl("garbage"), None);
    }

    #[test]
    fn tuning_sysctls_are_set_and_each_failure_is_named() {
        let h = host("tuning");
        let sys = h.proc_root.join("sys");
        std::fs::create_dir_all(sys.join("net/netfilter")).expect("mkdir");
        std::fs::create_dir_all(sys.join("net/ipv4/vs")).expect("mkdir");
        std::fs::create_dir_all(h.sys_root.join("module/nf_conntrack/parameters")).expect("mkdir");
        std::fs::create_dir_all(h.sys_root.join("devices/system/cpu")).expect("mkdir");
        std::fs::write(h.sys_root.join("devices/system/cpu/online"), "0-7\n").expect("write");
        std::fs::write(sys.join("kernel/osrelease"), "5.4.0-1\n").expect("write");
        std::fs::write(
            h.sys_root.join("module/nf_conntrack/parameters/hashsize"),
            "16384\n",
        )
        .expect("write");
        for f in [
            "net/netfilter/nf_conntrack_max",
            "net/netfilter/nf_conntrack_tcp_timeout_established",
            "net/ipv4/vs/conn_reuse_mode",
        ] {
            std::fs::write(sys.join(f), "1\n").expect("write");
        }
        let estimator = sys.join("net/ipv4/vs/run_estimation");
        std::fs::write(&estimator, "1\n").expect("write");
        let estimation = || std::fs::read_to_string(&estimator).expect("read");
        // The rate estimator is left alone unless asked for.
        h.set_tuning_sysctls(&Conntrack::default(), false);
        assert_eq!(estimation().trim(), "1");
        // close_wait is missing: its failure is named, and the others are still set.
        let failed = h.set_tuning_sysctls(&Conntrack::default(), true);
        assert_eq!(estimation().trim(), "0");
        let read = |f: &str| std::fs::read_to_string(sys.join(f)).expect("read");
        assert_eq!(read("net/netfilter/nf_conntrack_max").trim(), "262144");
        assert_eq!(
            read("net/netfilter/nf_conntrack_tcp_timeout_established").trim(),
            "86400"
        );
        assert_eq!(read("net/ipv4/vs/conn_reuse_mode").trim(), "0");
        let hash =
            std::fs::read_to_string(h.sys_root.join("module/nf_conntrack/parameters/hashsize"))
                .expect("read");
        assert_eq!(hash.trim(), "65536");
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(
            failed[0]
                .to_string()
                .starts_with("sysctl net.netfilter.nf_conntrack_tcp_timeout_close_wait=3600"),
            "{}",
            failed[0]
        );
        // A kernel without the sysctl (before 5.12): named among the failures, not fatal.
        std::fs::remove_file(&estimator).expect("rm");
        let failed = h.set_tuning_sysctls(&Conntrack::default(), true);
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(
            failed.iter().any(|e| e
                .to_string()
                .starts_with("sysctl net.ipv4.vs.run_estimation=0: ")),
            "{failed:?}"
        );
    }

    /// A fake `/proc`, `/sys` and `/lib/modules` in a directory of the test's own.
    fn host(name: &str) -> Host {
        let root =
            std::env::temp_dir().join(format!("kube-ipvs-setup-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let h = Host {
            proc_root: root.join("proc"),
            sys_root: root.join("sys"),
            modules_root: root.join("lib/modules"),
            modprobe: None,
        };
        std::fs::create_dir_all(h.proc_root.join("sys/kernel")).expect("mkdir");
        std::fs::create_dir_all(h.sys_root.join("module/nf_conntrack")).expect("mkdir");
        std::fs::create_dir_all(h.modules_root.join("6.1.0-test")).expect("mkdir");
        std::fs::write(h.proc_root.join("sys/kernel/osrelease"), "6.1.0-test\n").expect("write");
        std::fs::write(
            h.proc_root.join("modules"),
            "ip_vs_rr 16384 1 - Live 0x0\nip_vs 188416 3 ip_vs_rr, Live 0x0\n",
        )
        .expect("write");
        std::fs::write(
            h.modules_root.join("6.1.0-test/modules.builtin"),
            "kernel/net/netfilter/ipvs/ip_vs_sh.ko\n",
        )
        .expect("write");
        h
    }

    #[test]
    fn modules_are_found_loaded_in_sys_or_built_in() {
        let h = host("found");
        for m in ["ip_vs", "ip_vs_rr", "nf_conntrack", "ip_vs_sh"] {
            assert!(h.module_present(m), "{m}");
        }
        assert!(!h.module_present("ip_vs_r"), "a prefix is not a module");
        let sched: kube_ipvs_diff::Scheduler = "sh".parse().expect("sh");
        h.ensure_modules(&required_modules(&sched))
            .expect("all present");
    }

    #[test]
    fn a_missing_module_is_named() {
        let h = host("missing");
        let sched: kube_ipvs_diff::Scheduler = "twos".parse().expect("twos");
        let err = h
            .ensure_modules(&required_modules(&sched))
            .expect_err("ip_vs_twos is missing");
        assert_eq!(
            err.to_string(),
            "kernel module ip_vs_twos is not loaded and there is no modprobe to load it; \
             load it on the host"
        );
    }

    #[test]
    fn optional_modules_report_each_failure_and_go_on() {
        let h = host("optional");
        // The fake host has ip_vs loaded and nothing else, and no modprobe.
        let failed = h.load_optional_modules(&set_modules());
        let named: Vec<String> = failed
            .iter()
            .map(|e| match e {
                SetupError::MissingModule { module, .. } => module.clone(),
                SetupError::Sysctl { name, .. } => name.clone(),
                SetupError::Netlink { what, .. } => (*what).to_owned(),
            })
            .collect();
        assert_eq!(named, set_modules());
        std::fs::write(h.proc_root.join("modules"), "xt_set 16384 0 - Live 0x0\n").expect("write");
        assert_eq!(
            h.load_optional_modules(&set_modules()).len(),
            set_modules().len() - 1
        );
    }

    #[test]
    fn a_failing_modprobe_is_reported_with_the_module() {
        let mut h = host("modprobe");
        h.modprobe = Some("/bin/false".into());
        let err = h
            .ensure_modules(&["ip_vs_mh".to_owned()])
            .expect_err("false loads nothing");
        assert!(
            err.to_string().starts_with(
                "kernel module ip_vs_mh is not loaded and /bin/false could not load it"
            ),
            "{err}"
        );
    }

    #[test]
    fn sysctls_are_written_only_when_different_and_errors_name_them() {
        let h = host("sysctl");
        let dir = h.proc_root.join("sys/net/ipv4/vs");
        std::fs::create_dir_all(&dir).expect("mkdir");
        for (f, v) in [
            ("conntrack", "0"),
            ("expire_nodest_conn", "1"),
            ("expire_quiescent_template", "0"),
        ] {
            std::fs::write(dir.join(f), format!("{v}\n")).expect("write");
        }
        std::fs::write(h.proc_root.join("sys/net/ipv4/ip_forward"), "0\n").expect("write");
        h.set_sysctls(&required_sysctls(false)).expect("all exist");
        for f in [
            "vs/conntrack",
            "vs/expire_nodest_conn",
            "vs/expire_quiescent_template",
            "ip_forward",
        ] {
            let v =
                std::fs::read_to_string(h.proc_root.join("sys/net/ipv4").join(f)).expect("read");
            assert_eq!(v.trim(), "1", "{f}");
        }
        let err = h
            .set_sysctls(&required_sysctls(true))
            .expect_err("no conf/all in the fake /proc");
        assert!(
            err.to_string()
                .starts_with("sysctl net.ipv4.conf.all.arp_ignore=1: "),
            "{err}"
        );
    }
}

/// What the agent's setup before its first sync does (kube-proxy's `--init-only` part).
#[derive(Debug, Clone, Copy)]
pub struct Preparation<'a> {
    /// The default scheduler, whose module must be there.
    pub scheduler: &'a kube_ipvs_diff::Scheduler,
    /// Strict ARP sysctls.
    pub strict_arp: bool,
    /// The conntrack tuning.
    pub conntrack: &'a Conntrack,
    /// The rate estimator off ([`NO_RATE_ESTIMATION`]).
    pub no_rate_estimation: bool,
    /// The ipset and iptables match modules are loaded too.
    pub masquerade: bool,
    /// The IPVS timeouts to set (a zero leaves that one as it is); `None` sets none.
    pub ipvs_timeouts: Option<kube_ipvs_netlink::ipvs::Timeouts>,
}

/// The kernel handles the sync works through, and the setup that was left as it was.
pub struct Prepared {
    /// IPVS over generic netlink, the timeouts set.
    pub ipvs: kube_ipvs_netlink::ipvs::Ipvs,
    /// rtnetlink.
    pub rtnl: kube_ipvs_netlink::link::Rtnl,
    /// Tuning sysctls that could not be set (tuning, not correctness).
    pub tuning_left: Vec<SetupError>,
    /// Optional modules (ipset, iptables matches) that could not be loaded.
    pub optional_modules_missing: Vec<SetupError>,
}

impl Host {
    /// The agent's kernel setup, in order: the required modules and sysctls (an error stops
    /// it), the tuning sysctls and, with masquerade, the optional modules (failures are
    /// returned, not fatal), then the IPVS and rtnetlink handles and the IPVS timeouts.
    pub fn prepare(&self, p: &Preparation<'_>) -> Result<Prepared, SetupError> {
        self.ensure_modules(&required_modules(p.scheduler))?;
        self.set_sysctls(&required_sysctls(p.strict_arp))?;
        let tuning_left = self.set_tuning_sysctls(p.conntrack, p.no_rate_estimation);
        let optional_modules_missing = if p.masquerade {
            self.load_optional_modules(&set_modules())
        } else {
            Vec::new()
        };
        let netlink = |what| move |source| SetupError::Netlink { what, source };
        let mut ipvs =
            kube_ipvs_netlink::ipvs::Ipvs::new().map_err(netlink("opening IPVS netlink"))?;
        if let Some(timeouts) = p.ipvs_timeouts {
            ipvs.set_timeouts(timeouts)
                .map_err(netlink("setting IPVS timeouts"))?;
        }
        let rtnl = kube_ipvs_netlink::link::Rtnl::new().map_err(netlink("opening rtnetlink"))?;
        Ok(Prepared {
            ipvs,
            rtnl,
            tuning_left,
            optional_modules_missing,
        })
    }
}
