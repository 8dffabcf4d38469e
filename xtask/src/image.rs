//! `cargo xtask image [--check]`: the container image without a Docker engine.
//!
//! The release `kube-ipvs` binary plus iptables and kmod (and the libraries they link) from
//! Debian's own packages, fetched with `apt-get download` and unpacked with `dpkg-deb -x`, go
//! into one layer tar written by GNU tar with sorted entries, fixed mtimes and numeric root
//! ownership, so the same inputs give the same digest. The archive holds both an OCI image layout
//! (`oci-layout`, `index.json`, `blobs/sha256/...`, for `ctr import`) and `docker save`'s
//! `manifest.json` (for `docker load`), pointing at the same blobs.
//!
//! `--check` unpacks the layer into a fresh directory and runs the binary in a chroot
//! (`--version`, `dump --help`) and the iptables and modprobe it will call, so the archive is
//! known to start before it reaches a node. This module writes only below
//! `<target dir>/image/`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::util;

/// The image name; `deploy/daemonset.yaml`, `deploy/replace-kube-proxy/daemonset.yaml` and
/// `deploy/Kustomization` use it with the workspace version as the tag (checked by
/// `crates/kube-ipvs/tests/deploy.rs`).
const IMAGE_NAME: &str = "kube-ipvs";

/// The workspace version, inherited by this package: the one source of the tag.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Debian packages whose files go into the image, with their dependency closure added by
/// `apt-cache depends`. iptables (legacy and nft backends) for the masquerade rules, kmod for
/// `modprobe ip_vs*`; libc6 and libgcc-s1 are what the Rust binary itself links.
const PACKAGES: &[&str] = &["iptables", "kmod", "libc6", "libgcc-s1"];

/// The `iptables*` names Debian provides through update-alternatives in a maintainer script,
/// which `dpkg-deb -x` does not run. The nft backend is Debian's default and what current
/// distributions' hosts use; the agent asks `iptables --version` which one it is talking to.
const ALTERNATIVES: &[(&str, &str)] = &[
    ("iptables", "xtables-nft-multi"),
    ("iptables-restore", "xtables-nft-multi"),
    ("iptables-save", "xtables-nft-multi"),
    ("ip6tables", "xtables-nft-multi"),
    ("ip6tables-restore", "xtables-nft-multi"),
    ("ip6tables-save", "xtables-nft-multi"),
];

pub(crate) fn command(args: &[String]) -> Result<()> {
    let mut check = false;
    for a in args {
        match a.as_str() {
            "--check" => check = true,
            other => bail!("cargo xtask image: unknown argument {other:?} (want [--check])"),
        }
    }
    let started = Instant::now();
    let out_dir = image_dir()?;
    let archive = build(&out_dir)?;
    println!(
        "image {IMAGE_NAME}:{VERSION} -> {} ({})",
        archive.display(),
        util::secs(started.elapsed())
    );
    if check {
        let t = Instant::now();
        self_check(&out_dir)?;
        println!("image check passed ({})", util::secs(t.elapsed()));
    }
    Ok(())
}

/// Builds the archive (as `cargo xtask image`) and returns its path and the reference it
/// carries (`kube-ipvs:VERSION`).
pub(crate) fn build_archive() -> Result<(PathBuf, String)> {
    let archive = build(&image_dir()?)?;
    Ok((archive, format!("{IMAGE_NAME}:{VERSION}")))
}

/// `<cargo target dir>/image`.
fn image_dir() -> Result<PathBuf> {
    Ok(util::target_dir()?.join("image"))
}

/// The release build of the binary the image holds. `ci` runs it in the background
/// ([`util::in_background`]) beside the kernel tests, which leave a CPU idle much of the time;
/// the image step's own build then finds it done. Debug and release builds hold separate
/// locks, so it never blocks the kernel tests' build.
pub(crate) fn build_release() -> Result<()> {
    util::run(util::cargo_cmd().args(["build", "--release", "--locked", "-p", "kube-ipvs"]))
}

fn build(out_dir: &Path) -> Result<PathBuf> {
    build_release()?;
    let target = out_dir.parent().context("image dir has no parent")?;
    let binary = target.join("release/kube-ipvs");

    // The archive is a function of the binary and the packages: when neither changed (the lab
    // asks for it on every run, and `ci` right after `image --check`), it is kept.
    let archive = out_dir.join(format!("{IMAGE_NAME}-{VERSION}.tar"));
    let debs = download_debs(&out_dir.join("debs"), PACKAGES)?;
    let mut key = util::Fnv::default();
    key.str(VERSION);
    inputs_key(&mut key, &binary, &debs)?;
    let stamp = out_dir.join("archive.key");
    if archive.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|k| k == key.hex()) {
        return Ok(archive);
    }
    let _ = std::fs::remove_file(&stamp);
    let rootfs = out_dir.join("rootfs");
    unpack_debs(&rootfs, &debs)?;
    for dir in [
        "tmp",
        "run",
        "proc",
        "sys",
        "dev",
        "etc",
        "var/lib/kube-ipvs",
    ] {
        std::fs::create_dir_all(rootfs.join(dir))?;
    }
    let bin_dir = rootfs.join("usr/local/bin");
    std::fs::create_dir_all(&bin_dir)?;
    let installed = bin_dir.join("kube-ipvs");
    std::fs::copy(&binary, &installed).with_context(|| format!("copying {}", binary.display()))?;
    // kube-proxy's DaemonSets run `/usr/local/bin/kube-proxy` with kube-proxy's flags: under that
    // name the binary is `kube-ipvs run`, so swapping only the image keeps their `command`.
    let alias = bin_dir.join("kube-proxy");
    if !alias.exists() {
        std::os::unix::fs::symlink("kube-ipvs", &alias)
            .with_context(|| format!("linking {}", alias.display()))?;
    }
    // The release profile keeps line tables for backtraces on developer machines; on nodes they
    // are most of the image's size. Without binutils the image is just larger.
    if util::which("strip").is_some() {
        util::run(Command::new("strip").arg("--strip-debug").arg(&installed))?;
    }

    let config = json!({
        "Entrypoint": ["/usr/local/bin/kube-ipvs"],
        "Cmd": ["run"],
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "Labels": {
            "org.opencontainers.image.title": IMAGE_NAME,
            "org.opencontainers.image.version": VERSION,
        },
    });
    write_archive(out_dir, &rootfs, config, IMAGE_NAME, VERSION, &archive)?;
    std::fs::write(&stamp, key.hex())?;
    Ok(archive)
}

/// Adds an image's inputs to a cache key: the binary (size and modification time, which every
/// rebuild changes) and the `.deb` files by name (name and version).
pub(crate) fn inputs_key(key: &mut util::Fnv, binary: &Path, debs: &[PathBuf]) -> Result<()> {
    key.file(binary)?;
    for deb in debs {
        key.str(deb.file_name().unwrap_or_default());
    }
    Ok(())
}

/// The name containerd files an image under: Docker's normalisation of `repository` (a bare
/// name is `docker.io/library/NAME`, a path without a registry host is under `docker.io/`).
fn containerd_name(repository: &str, tag: &str) -> String {
    let full = match repository.split_once('/') {
        None => format!("docker.io/library/{repository}"),
        Some((host, _)) if host.contains('.') || host.contains(':') || host == "localhost" => {
            repository.to_owned()
        }
        Some(_) => format!("docker.io/{repository}"),
    };
    format!("{full}:{tag}")
}

/// Writes `rootfs` as a one-layer image archive at `archive`: an OCI image layout (for `ctr
/// images import`, named by the `io.containerd.image.name` annotation) and `docker save`'s
/// `manifest.json` (for `docker load`), pointing at the same blobs. `config` is the image
/// config's `config` object (entrypoint, command, environment). `work` is scratch space.
pub(crate) fn write_archive(
    work: &Path,
    rootfs: &Path,
    config: serde_json::Value,
    repository: &str,
    tag: &str,
    archive: &Path,
) -> Result<()> {
    // The layer: GNU tar with everything that varies between builds pinned.
    let oci = work.join("oci");
    let blobs = oci.join("blobs/sha256");
    if oci.exists() {
        std::fs::remove_dir_all(&oci)?;
    }
    std::fs::create_dir_all(&blobs)?;
    let layer_tmp = work.join("layer.tar");
    util::run(deterministic_tar(&layer_tmp, rootfs).arg("."))?;
    let layer = blob_from_file(&blobs, &layer_tmp)?;
    let layer_size = std::fs::metadata(blobs.join(&layer))?.len();

    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{layer}")] },
        "history": [{ "created": "1970-01-01T00:00:00Z", "created_by": "cargo xtask" }],
    });
    let config_bytes = serde_json::to_vec(&config)?;
    let config_digest = blob(&blobs, &config_bytes)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{config_digest}"),
            "size": config_bytes.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{layer}"),
            "size": layer_size,
        }],
    });
    let manifest_bytes = serde_json::to_vec(&manifest)?;
    let manifest_digest = blob(&blobs, &manifest_bytes)?;
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"),
            "size": manifest_bytes.len(),
            "annotations": {
                "io.containerd.image.name": containerd_name(repository, tag),
                "org.opencontainers.image.ref.name": tag,
            },
        }],
    });
    std::fs::write(oci.join("index.json"), serde_json::to_vec(&index)?)?;
    std::fs::write(
        oci.join("oci-layout"),
        serde_json::to_vec(&json!({ "imageLayoutVersion": "1.0.0" }))?,
    )?;
    let docker = json!([{
        "Config": format!("blobs/sha256/{config_digest}"),
        "RepoTags": [format!("{repository}:{tag}")],
        "Layers": [format!("blobs/sha256/{layer}")],
    }]);
    std::fs::write(oci.join("manifest.json"), serde_json::to_vec(&docker)?)?;
    util::run(deterministic_tar(archive, &oci).args([
        "oci-layout",
        "index.json",
        "manifest.json",
        "blobs",
    ]))?;
    Ok(())
}

/// A fresh `rootfs` holding the files of Debian's `debs` (from [`download_debs`]), without
/// documentation, with the iptables alternatives Debian's maintainer scripts would have made.
pub(crate) fn unpack_debs(rootfs: &Path, debs: &[PathBuf]) -> Result<()> {
    if rootfs.exists() {
        std::fs::remove_dir_all(rootfs)
            .with_context(|| format!("removing {}", rootfs.display()))?;
    }
    std::fs::create_dir_all(rootfs)?;
    for deb in debs {
        util::run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(rootfs))?;
    }
    // Documentation and locales are most of the packages' size and nothing reads them here.
    for dir in [
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
        "usr/share/locale",
    ] {
        let p = rootfs.join(dir);
        if p.exists() {
            std::fs::remove_dir_all(&p)?;
        }
    }
    let sbin = rootfs.join("usr/sbin");
    if sbin.join("xtables-nft-multi").exists() {
        for (name, target) in ALTERNATIVES {
            let link = sbin.join(name);
            if !link.exists() {
                std::os::unix::fs::symlink(target, &link)
                    .with_context(|| format!("linking {}", link.display()))?;
            }
        }
    }
    Ok(())
}

/// `tar` creating `out` from paths under `dir` (the caller adds them) with nothing that varies
/// between builds: sorted names, epoch times, root owner, no atime/ctime, so the same inputs
/// give the same bytes and digests.
fn deterministic_tar(out: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new("tar");
    cmd.args([
        "--create",
        "--format=posix",
        "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
        "--sort=name",
        "--mtime=@0",
        "--owner=0",
        "--group=0",
        "--numeric-owner",
        "--file",
    ])
    .arg(out)
    .arg("-C")
    .arg(dir);
    cmd
}

/// The packages and their dependency closure, downloaded once into `cache` (re-runs reuse the
/// `.deb` files apt-get already fetched).
pub(crate) fn download_debs(cache: &Path, packages: &[&str]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(cache)?;
    let text = util::output(
        Command::new("apt-cache")
            .args([
                "depends",
                "--recurse",
                "--no-recommends",
                "--no-suggests",
                "--no-conflicts",
                "--no-breaks",
                "--no-replaces",
                "--no-enhances",
            ])
            .args(packages),
    )?;
    let mut names: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('<'))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    names.sort_unstable();
    names.dedup();
    let missing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| find_deb(cache, n).is_none())
        .collect();
    if !missing.is_empty() {
        util::run(
            Command::new("apt-get")
                .arg("download")
                .args(&missing)
                .current_dir(cache),
        )?;
    }
    names
        .iter()
        .map(|n| find_deb(cache, n).with_context(|| format!("apt-get download gave no {n}_*.deb")))
        .collect()
}

fn find_deb(cache: &Path, package: &str) -> Option<PathBuf> {
    let prefix = format!("{package}_");
    let mut found: Vec<PathBuf> = std::fs::read_dir(cache)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(&prefix) && f.ends_with(".deb"))
        })
        .collect();
    found.sort();
    found.pop()
}

/// Stores `bytes` as a content-addressed blob; returns the hex digest.
fn blob(blobs: &Path, bytes: &[u8]) -> Result<String> {
    let tmp = blobs.join("incoming");
    std::fs::write(&tmp, bytes)?;
    blob_from_file(blobs, &tmp)
}

/// Moves a file into `blobs` under its sha256; returns the hex digest.
fn blob_from_file(blobs: &Path, file: &Path) -> Result<String> {
    let out = util::output(Command::new("sha256sum").arg(file))?;
    let digest = out
        .split_whitespace()
        .next()
        .filter(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()))
        .with_context(|| format!("sha256sum printed {out:?}"))?
        .to_owned();
    std::fs::rename(file, blobs.join(&digest))?;
    Ok(digest)
}

/// Unpacks the archive as a runtime would (archive -> manifest.json -> layer) and runs what the
/// agent will run, in a chroot.
fn self_check(out_dir: &Path) -> Result<()> {
    if !util::is_root() {
        bail!("cargo xtask image --check runs chroot and needs root");
    }
    let archive = out_dir.join(format!("{IMAGE_NAME}-{VERSION}.tar"));
    let unpacked = out_dir.join("check");
    if unpacked.exists() {
        std::fs::remove_dir_all(&unpacked)?;
    }
    let outer = unpacked.join("archive");
    let root = unpacked.join("rootfs");
    std::fs::create_dir_all(&outer)?;
    std::fs::create_dir_all(&root)?;
    util::run(
        Command::new("tar")
            .arg("-xf")
            .arg(&archive)
            .arg("-C")
            .arg(&outer),
    )?;
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(outer.join("manifest.json"))?)
            .context("manifest.json")?;
    let entry = &manifest[0];
    let tag = entry["RepoTags"][0].as_str().unwrap_or_default();
    if tag != format!("{IMAGE_NAME}:{VERSION}") {
        bail!("manifest.json tags {tag:?}, want {IMAGE_NAME}:{VERSION}");
    }
    let layers = entry["Layers"].as_array().context("manifest.json Layers")?;
    for layer in layers {
        let rel = layer.as_str().context("a layer path")?;
        // The blob's name must be its content's digest, or a runtime refuses it.
        let want = rel.rsplit('/').next().unwrap_or_default();
        let got = util::output(Command::new("sha256sum").arg(outer.join(rel)))?;
        if got.split_whitespace().next() != Some(want) {
            bail!("layer {rel}: digest mismatch ({got})");
        }
        util::run(
            Command::new("tar")
                .arg("-xf")
                .arg(outer.join(rel))
                .arg("-C")
                .arg(&root),
        )?;
    }
    let version = util::output(
        Command::new("chroot")
            .arg(&root)
            .args(["/usr/local/bin/kube-ipvs", "--version"]),
    )?;
    if !version.contains(VERSION) {
        bail!("kube-ipvs --version in the image printed {version:?}, want {VERSION}");
    }
    print!("  {version}");
    let help = util::output(Command::new("chroot").arg(&root).args([
        "/usr/local/bin/kube-ipvs",
        "dump",
        "--help",
    ]))?;
    if !help.contains("Usage") {
        bail!("kube-ipvs dump --help in the image printed {help:?}");
    }
    println!("  dump --help: {} lines", help.lines().count());
    // kube-proxy's DaemonSet command, unchanged, reaches `run`.
    let alias = util::output(
        Command::new("chroot")
            .arg(&root)
            .args(["/usr/local/bin/kube-proxy", "--help"]),
    )?;
    if !alias.contains("Usage: kube-proxy") {
        bail!("kube-proxy --help in the image printed {alias:?}");
    }
    println!("  kube-proxy --help: {} lines", alias.lines().count());
    for tool in [
        &["/usr/sbin/iptables", "--version"][..],
        &["/usr/sbin/iptables-legacy", "--version"][..],
        &["/sbin/modprobe", "--version"][..],
    ] {
        let out = util::output(Command::new("chroot").arg(&root).args(tool))?;
        print!("  {}: {out}", tool[0]);
    }
    std::fs::remove_dir_all(&unpacked)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_archive_key_follows_the_binary_and_every_package_version() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("xtask-image-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let binary = dir.join("kube-ipvs");
        std::fs::write(&binary, b"one")?;
        let debs = vec![
            PathBuf::from("/c/iptables_1.8.9-2_amd64.deb"),
            PathBuf::from("/c/kmod_30+20221128-1_amd64.deb"),
        ];
        let key = |binary: &Path, debs: &[PathBuf]| -> Result<String> {
            let mut k = util::Fnv::default();
            inputs_key(&mut k, binary, debs)?;
            Ok(k.hex())
        };
        let first = key(&binary, &debs)?;
        assert_eq!(key(&binary, &debs)?, first, "same inputs, same key");
        let mut upgraded = debs.clone();
        upgraded[0] = PathBuf::from("/c/iptables_1.8.9-3_amd64.deb");
        assert_ne!(key(&binary, &upgraded)?, first);
        std::fs::write(&binary, b"a rebuilt binary")?;
        let rebuilt = key(&binary, &debs)?;
        std::fs::remove_dir_all(&dir)?;
        assert_ne!(rebuilt, first);
        Ok(())
    }

    #[test]
    fn containerd_files_images_under_dockers_normalised_names() {
        assert_eq!(
            containerd_name("kube-ipvs", "0.1.0"),
            "docker.io/library/kube-ipvs:0.1.0"
        );
        assert_eq!(
            containerd_name("registry.k8s.io/pause", "3.10.2"),
            "registry.k8s.io/pause:3.10.2"
        );
        assert_eq!(containerd_name("user/app", "1"), "docker.io/user/app:1");
    }
}
