//! Host prerequisites for building and booting the VM: QEMU, the tools copied into the guest and
//! the ones used to unpack the kernel. Installs them with apt when running as root, so CI on a
//! fresh Debian machine needs nothing but Rust.

use std::process::Command;

use anyhow::{Result, bail};

use crate::util;

/// The apt packages providing every tool below; printed verbatim when we cannot install them.
const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "ipvsadm",
    "iptables",
    "iproute2",
    "cpio",
    "kmod",
    "socat",
    "ipset",
    "nftables",
];

/// Each tool with the reason we need it, for the error message.
const TOOLS: &[(&str, &str)] = &[
    ("qemu-system-x86_64", "boots the guest"),
    ("busybox", "the guest's shell and core utilities"),
    ("ipvsadm", "shipped into the guest"),
    ("iptables-legacy", "shipped into the guest"),
    ("iptables-nft", "shipped into the guest"),
    ("ip", "shipped into the guest (iproute2)"),
    ("socat", "shipped into the guest, and forwards guest ports"),
    ("ipset", "shipped into the guest for kube-proxy (bench e2e)"),
    (
        "nft",
        "shipped into the guest for kube-proxy's nftables mode (bench e2e)",
    ),
    ("depmod", "indexes the guest kernel's modules"),
    ("cpio", "only for inspecting images by hand"),
    ("apt-get", "downloads the guest kernel"),
    ("dpkg", "unpacks the guest kernel"),
    ("ldd", "finds the shared libraries to ship"),
];

/// What the lab cluster (`cargo xtask cluster`) needs besides [`PACKAGES`]: the node's container
/// runtime and CNI plugins, the tools the agnhost image carries (as upstream's: curl, an
/// OpenBSD nc, ss and ip, dig, bash, socat, and GNU wget in place of busybox's), and gcc for
/// the pause binary.
const LAB_PACKAGES: &[&str] = &[
    "containerd",
    "runc",
    "containernetworking-plugins",
    "curl",
    "wget",
    "netcat-openbsd",
    "bind9-dnsutils",
    "bash",
    "gcc",
    "libc6-dev",
];

/// A file of each [`LAB_PACKAGES`] entry that shows it is installed.
const LAB_FILES: &[&str] = &[
    "/usr/bin/containerd",
    "/usr/sbin/runc",
    "/usr/lib/cni/bridge",
    "/usr/bin/curl",
    "/usr/bin/wget",
    "/usr/bin/nc.openbsd",
    "/usr/bin/dig",
    "/usr/bin/bash",
    "/usr/bin/gcc",
    "/usr/lib/x86_64-linux-gnu/libc.a",
];

/// Makes sure the lab's packages are installed (as root, with apt-get; otherwise says what to
/// install).
pub(crate) fn ensure_lab_packages() -> Result<()> {
    ensure_packages()?;
    let missing = || -> Vec<&str> {
        LAB_FILES
            .iter()
            .copied()
            .filter(|f| !std::path::Path::new(f).exists())
            .collect()
    };
    if missing().is_empty() {
        return Ok(());
    }
    // --no-remove: Debian's containerd and runc conflict with Docker's containerd.io; on a
    // developer's Docker host apt would otherwise remove Docker to make room.
    let cmd = format!(
        "apt-get install -y --no-install-recommends --no-remove {}",
        LAB_PACKAGES.join(" ")
    );
    if !util::is_root() {
        bail!("the lab needs {}; run as root: {cmd}", missing().join(", "));
    }
    eprintln!("xtask: installing the lab's packages: {cmd}");
    util::run(Command::new("apt-get").arg("update"))?;
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "--no-remove"])
            .args(LAB_PACKAGES)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    let still = missing();
    if !still.is_empty() {
        bail!("still missing after apt-get install: {}", still.join(", "));
    }
    Ok(())
}

fn install_command() -> String {
    format!(
        "apt-get update && apt-get install -y --no-install-recommends {}",
        PACKAGES.join(" ")
    )
}

/// What is wrong with the host: missing tools, or a dynamically linked busybox (the guest has no
/// libraries at the point its shell starts mounting things, so it must be the static build).
fn problems() -> Vec<String> {
    let mut out: Vec<String> = TOOLS
        .iter()
        .filter(|(tool, _)| util::which(tool).is_none())
        .map(|(tool, why)| format!("{tool} ({why})"))
        .collect();
    if let Some(busybox) = util::which("busybox") {
        let is_static = Command::new("ldd").arg(&busybox).output().is_ok_and(|o| {
            !o.status.success() || String::from_utf8_lossy(&o.stdout).contains("statically")
        });
        if !is_static {
            out.push(format!(
                "{} is dynamically linked (need busybox-static)",
                busybox.display()
            ));
        }
    }
    out
}

/// Makes sure the host tools exist, installing them when we are root.
pub(crate) fn ensure_packages() -> Result<()> {
    let missing = problems();
    if missing.is_empty() {
        return Ok(());
    }
    let cmd = install_command();
    if !util::is_root() {
        bail!(
            "missing host tools: {}\nrun as root: {cmd}",
            missing.join(", ")
        );
    }
    eprintln!(
        "xtask: missing host tools: {}; running: {cmd}",
        missing.join(", ")
    );
    util::run(Command::new("apt-get").arg("update"))?;
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(PACKAGES)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    let still = problems();
    if !still.is_empty() {
        bail!(
            "still missing after apt-get install: {}\ntry by hand: {cmd}",
            still.join(", ")
        );
    }
    Ok(())
}
