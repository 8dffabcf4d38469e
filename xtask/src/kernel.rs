//! The guest kernel: Debian's current cloud kernel, downloaded with apt, unpacked and cached under
//! `target/vm/kernel/<version>/`, plus the subset of its modules the guest loads at boot.
//!
//! The version is resolved through the `linux-image-cloud-amd64` metapackage on every run, so a
//! Debian kernel update is picked up without editing code. Nothing here boots anything.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{self, Fnv};

const METAPACKAGE: &str = "linux-image-cloud-amd64";

/// Modules loaded at boot, with their dependencies, in this order. Names absent from the kernel
/// are skipped and reported (e.g. `ip_vs_twos` only exists from Linux 6.7 on).
pub(crate) const BOOT_MODULES: &[&str] = &[
    // IPVS and every scheduler.
    "ip_vs",
    "ip_vs_rr",
    "ip_vs_wrr",
    "ip_vs_lc",
    "ip_vs_wlc",
    "ip_vs_sh",
    "ip_vs_mh",
    "ip_vs_sed",
    "ip_vs_nq",
    "ip_vs_dh",
    "ip_vs_lblc",
    "ip_vs_lblcr",
    "ip_vs_fo",
    "ip_vs_ovf",
    "ip_vs_twos",
    // Links for tests and the optional user-mode network.
    "dummy",
    "veth",
    "bridge",
    "virtio_pci",
    "virtio_net",
    // Conntrack, iptables (legacy and nft) and the matches a service proxy uses.
    "nf_conntrack",
    "nf_conntrack_netlink",
    "nf_nat",
    "xt_ipvs",
    "xt_MASQUERADE",
    "xt_mark",
    "xt_comment",
    "xt_conntrack",
    "xt_addrtype",
    "xt_nat",
    "xt_set",
    "ipt_REJECT",
    "ip6t_REJECT",
    "ip_tables",
    "iptable_nat",
    "iptable_filter",
    "ip6_tables",
    "ip6table_nat",
    "ip6table_filter",
    // The Local-policy short circuit's SET --map-mark rules live in mangle.
    "iptable_mangle",
    "ip6table_mangle",
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    "nft_ct",
    "nft_masq",
    "nft_nat",
    // kube-proxy's nftables mode, beside kube-ipvs in `bench e2e`.
    "nft_numgen",
    "nft_fib",
    "nft_fib_ipv4",
    "nft_fib_ipv6",
    "nft_fib_inet",
    "nft_reject",
    "nft_reject_ipv4",
    "nft_reject_ipv6",
    "nft_reject_inet",
    "nft_limit",
    "nft_hash",
    // ... and its iptables mode's matches.
    "xt_statistic",
    "xt_tcpudp",
    "xt_recent",
    "xt_multiport",
    "xt_nfacct",
    "ip_set",
    "ip_set_hash_ip",
    "ip_set_hash_ipport",
    "ip_set_hash_ipportip",
    "ip_set_hash_ipportnet",
    "ip_set_hash_net",
    "ip_set_hash_netnet",
    "ip_set_bitmap_port",
    // SCTP services and tunnelled destinations.
    "sctp",
    "ipip",
    "ip_gre",
    "fou",
];

/// Modules staged in the guest but not loaded at boot: the lab cluster's nodes load them
/// (`modprobe`), while the kernel tests keep a kernel without them (`br_netfilter` would send
/// their bridged test traffic through iptables). `sctp` is for the SCTP Services and Pods of
/// the `[sig-network]` suite, loaded at boot so that they do not depend on the kernel's
/// on-demand module load; `xt_sctp` is the iptables match the CNI `portmap` plugin's rules for
/// an SCTP `hostPort` use (without it the sandbox fails with "RULE_APPEND failed").
pub(crate) const NODE_MODULES: &[&str] = &["overlay", "br_netfilter", "sctp", "xt_sctp"];

/// An unpacked kernel with the boot modules staged for the guest.
#[derive(Debug)]
pub(crate) struct Kernel {
    pub(crate) version: String,
    pub(crate) vmlinuz: PathBuf,
    /// A `lib/modules/<version>` tree holding only the staged modules and their `depmod` files.
    pub(crate) modules_dir: PathBuf,
    /// Module paths relative to `modules_dir`, dependencies first: loaded at boot.
    pub(crate) load_order: Vec<String>,
    /// Every staged module path (the boot ones and [`NODE_MODULES`] with dependencies).
    pub(crate) staged: Vec<String>,
    /// Requested modules this kernel does not have.
    pub(crate) missing: Vec<String>,
}

/// Resolves, downloads (once) and prepares the guest kernel under `vm_dir/kernel/`.
pub(crate) fn prepare(vm_dir: &Path) -> Result<Kernel> {
    let version = match resolve_version() {
        Ok(version) => version,
        Err(err) => match cached_versions(vm_dir).as_slice() {
            // Offline, or apt is broken: a single unpacked kernel is an unambiguous fallback.
            [only] => {
                eprintln!("xtask: {err:#}\nxtask: using the cached kernel {only}");
                only.clone()
            }
            _ => return Err(err),
        },
    };
    let dir = vm_dir.join("kernel").join(&version);
    let root = dir.join("root");
    if !dir.join(".unpacked").exists() {
        unpack(&version, &dir, &root)?;
    }
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{version}"));
    if !vmlinuz.is_file() {
        bail!("kernel package for {version} has no {}", vmlinuz.display());
    }
    let full_modules = root.join("lib/modules").join(&version);
    let deps = parse_modules_dep(
        &fs::read_to_string(full_modules.join("modules.dep"))
            .with_context(|| format!("reading modules.dep of kernel {version}"))?,
    );
    let (load_order, missing) = load_order(&deps, BOOT_MODULES);
    let all: Vec<&str> = BOOT_MODULES.iter().chain(NODE_MODULES).copied().collect();
    let (stage_order, _) = self::load_order(&deps, &all);

    // The staged tree is keyed by the module list, so editing either list re-stages it.
    let mut key = Fnv::default();
    for m in &stage_order {
        key.str(m);
    }
    let staged = dir.join(format!("staged-{}", key.hex()));
    let modules_dir = staged.join("lib/modules").join(&version);
    if !staged.with_extension("complete").exists() {
        stage(&full_modules, &staged, &version, &stage_order)?;
    }
    let load_order = load_order.iter().map(|m| plain_module_path(m)).collect();
    let staged = stage_order.iter().map(|m| plain_module_path(m)).collect();
    Ok(Kernel {
        version,
        vmlinuz,
        modules_dir,
        load_order,
        staged,
        missing,
    })
}

/// Kernel versions already unpacked under `vm_dir/kernel/`.
fn cached_versions(vm_dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(vm_dir.join("kernel")) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join(".unpacked").exists())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

/// Asks apt which kernel the metapackage currently depends on, refreshing the package lists once
/// if apt does not know the metapackage yet (a fresh container has empty lists).
fn resolve_version() -> Result<String> {
    let query = || {
        util::output(Command::new("apt-cache").args(["depends", METAPACKAGE]))
            .ok()
            .and_then(|text| parse_depends(&text))
    };
    if let Some(version) = query() {
        return Ok(version);
    }
    if !util::is_root() {
        bail!(
            "apt does not know {METAPACKAGE}; run `apt-get update` as root (or run xtask as root)"
        );
    }
    eprintln!("xtask: apt does not know {METAPACKAGE}; running apt-get update");
    util::run(Command::new("apt-get").arg("update"))?;
    query().with_context(|| format!("apt-cache depends {METAPACKAGE} names no linux-image package"))
}

/// Extracts `6.1.0-57-cloud-amd64` from `apt-cache depends` output.
fn parse_depends(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("Depends:"))
        .filter_map(|dep| dep.trim().strip_prefix("linux-image-"))
        .find(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(str::to_owned)
}

/// Downloads and unpacks the kernel package. Works in per-process scratch directories and
/// renames the result into place, so two first runs at once cannot see a half-unpacked tree.
fn unpack(version: &str, dir: &Path, root: &Path) -> Result<()> {
    let pid = std::process::id();
    let download = dir.join(format!("download.tmp{pid}"));
    let scratch = dir.join(format!("root.tmp{pid}"));
    let _ = fs::remove_dir_all(&download);
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&download).with_context(|| format!("creating {}", download.display()))?;
    let package = format!("linux-image-{version}");
    eprintln!("xtask: downloading {package}");
    util::run(
        Command::new("apt-get")
            .args(["download", "-q", &package])
            .current_dir(&download),
    )?;
    let deb = fs::read_dir(&download)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download {package} produced no .deb"))?;
    util::run(Command::new("dpkg").arg("-x").arg(&deb).arg(&scratch))?;
    // Debian generates modules.dep in the package's postinst, so the .deb does not carry it.
    util::run(Command::new("depmod").arg("-b").arg(&scratch).arg(version))?;
    fs::remove_dir_all(&download)?;
    publish(&scratch, root, &dir.join(".unpacked"))
}

/// Moves a finished scratch directory to `dest` and writes the `stamp` that marks it complete,
/// unless another process finished first (then its copy is kept and ours dropped).
fn publish(scratch: &Path, dest: &Path, stamp: &Path) -> Result<()> {
    if stamp.exists() {
        fs::remove_dir_all(scratch)?;
        return Ok(());
    }
    // A destination without a stamp is the leftover of an interrupted run.
    let _ = fs::remove_dir_all(dest);
    fs::rename(scratch, dest)
        .with_context(|| format!("moving {} to {}", scratch.display(), dest.display()))?;
    fs::write(stamp, "")?;
    Ok(())
}

/// Copies the selected modules into a fresh tree, decompressing them (busybox's `insmod` and
/// `modprobe` cannot read `.ko.xz`/`.ko.zst`), and runs depmod over the result so the guest's
/// `modprobe` also works for them.
fn stage(full: &Path, staged: &Path, version: &str, order: &[String]) -> Result<()> {
    let scratch = staged.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    let modules_dir = scratch.join("lib/modules").join(version);
    for rel in order {
        let src = full.join(rel);
        let dst = modules_dir.join(plain_module_path(rel));
        if let Some(parent) = dst.parent() {
            fs::create_dir_all(parent)?;
        }
        let bytes = match Path::new(rel).extension().and_then(|e| e.to_str()) {
            Some("ko") => fs::read(&src).with_context(|| format!("reading {}", src.display()))?,
            Some("xz") => decompress("xz", &src)?,
            Some("zst") => decompress("zstd", &src)?,
            Some("gz") => decompress("gzip", &src)?,
            _ => bail!("module {} has an unknown compression", src.display()),
        };
        fs::write(&dst, bytes).with_context(|| format!("writing {}", dst.display()))?;
    }
    for file in [
        "modules.order",
        "modules.builtin",
        "modules.builtin.modinfo",
    ] {
        let src = full.join(file);
        if src.exists() {
            fs::copy(&src, modules_dir.join(file))?;
        }
    }
    util::run(Command::new("depmod").arg("-b").arg(&scratch).arg(version))?;
    let stamp = staged.with_extension("complete");
    publish(&scratch, staged, &stamp)
}

fn decompress(tool: &str, src: &Path) -> Result<Vec<u8>> {
    let out = Command::new(tool)
        .arg("-dc")
        .arg(src)
        .output()
        .with_context(|| format!("running {tool} to decompress {}", src.display()))?;
    if !out.status.success() {
        bail!("{tool} -dc {} failed: {}", src.display(), out.status);
    }
    Ok(out.stdout)
}

fn plain_module_path(rel: &str) -> String {
    for ext in [".xz", ".zst", ".gz"] {
        if let Some(stripped) = rel.strip_suffix(ext) {
            return stripped.to_owned();
        }
    }
    rel.to_owned()
}

/// A module's name as the kernel knows it: file stem without `.ko*`, dashes as underscores.
fn module_name(rel: &str) -> String {
    let file = rel.rsplit('/').next().unwrap_or(rel);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// Parses `modules.dep`: module path -> its dependencies, keyed by module name.
fn parse_modules_dep(text: &str) -> BTreeMap<String, (String, Vec<String>)> {
    text.lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(module, deps)| {
            let deps = deps.split_whitespace().map(str::to_owned).collect();
            (module_name(module), (module.to_owned(), deps))
        })
        .collect()
}

/// Orders the requested modules and everything they depend on so each comes after its
/// dependencies; returns (module paths in load order, requested names the kernel lacks).
fn load_order(
    deps: &BTreeMap<String, (String, Vec<String>)>,
    wanted: &[&str],
) -> (Vec<String>, Vec<String>) {
    fn visit(
        name: &str,
        deps: &BTreeMap<String, (String, Vec<String>)>,
        seen: &mut HashSet<String>,
        order: &mut Vec<String>,
    ) {
        let Some((path, needs)) = deps.get(name) else {
            return;
        };
        if !seen.insert(name.to_owned()) {
            return;
        }
        for dep in needs {
            visit(&module_name(dep), deps, seen, order);
        }
        order.push(path.clone());
    }
    let mut seen = HashSet::new();
    let mut order = Vec::new();
    let mut missing = Vec::new();
    for name in wanted {
        let name = name.replace('-', "_");
        if deps.contains_key(&name) {
            visit(&name, deps, &mut seen, &mut order);
        } else {
            missing.push(name);
        }
    }
    (order, missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_output_names_the_versioned_image() {
        let text = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n";
        assert_eq!(parse_depends(text).as_deref(), Some("6.1.0-57-cloud-amd64"));
        assert_eq!(parse_depends("linux-image-cloud-amd64\n"), None);
    }

    #[test]
    fn load_order_puts_dependencies_first_and_reports_missing() {
        let deps = parse_modules_dep(
            "kernel/net/ipvs/ip_vs_rr.ko.xz: kernel/net/ipvs/ip_vs.ko.xz kernel/nf_conntrack.ko.xz\n\
             kernel/net/ipvs/ip_vs.ko.xz: kernel/nf_conntrack.ko.xz\n\
             kernel/nf_conntrack.ko.xz:\n\
             kernel/drivers/net/dummy.ko.xz:\n",
        );
        let (order, missing) = load_order(&deps, &["ip_vs_rr", "ip_vs", "ip_vs_twos", "dummy"]);
        assert_eq!(
            order,
            [
                "kernel/nf_conntrack.ko.xz",
                "kernel/net/ipvs/ip_vs.ko.xz",
                "kernel/net/ipvs/ip_vs_rr.ko.xz",
                "kernel/drivers/net/dummy.ko.xz"
            ]
        );
        assert_eq!(missing, ["ip_vs_twos"]);
        assert_eq!(plain_module_path(&order[0]), "kernel/nf_conntrack.ko");
    }

    #[test]
    fn module_names_normalise_dashes() {
        assert_eq!(module_name("kernel/a/nf-foo_bar.ko.zst"), "nf_foo_bar");
    }
}
