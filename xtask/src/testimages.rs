//! The container images the lab cluster's Pods run (`cargo xtask cluster`), built here because
//! nothing can be pulled: each carries the exact reference the pinned release's e2e suite names
//! (`test/utils/image/manifest.go`), so the kubelet finds it already present and never pulls.
//!
//! * `pause`: the sandbox process, `integration/images/pause.c` built statically;
//! * `busybox`: Debian's static busybox with its applet links;
//! * `agnhost`: the pinned release's agnhost (built by `cargo xtask tools`) over the busybox tree,
//!   with the tools upstream's image carries (curl, an OpenBSD nc, ss, ip, dig, bash, socat,
//!   CoreDNS) and GNU wget;
//! * `coredns`: the pinned CoreDNS (`integration/tools/coredns`), for the lab's DNS;
//! * `glibc-dns-testing`: the busybox tree with glibc's `getent` and Debian's `dig`, `host`
//!   and `nslookup` (upstream's is Debian with dnsutils), for the DNS tests' glibc prober;
//! * `nginx`: Debian's nginx serving port 80 (upstream's is nginx on Alpine);
//! * `regression-issue-74839`: the pinned release's server of that name, alone;
//! * `distroless-iptables`: Debian's iptables, ipset, nftables and conntrack with a shell, as
//!   upstream's (the tests exec `conntrack -L` and `grep` in it).
//!
//! Archives are cached under `<target>/lab/images/<hash>/` by a hash of their inputs.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::image::write_archive;
use crate::tools::ClusterTools;
use crate::util::{self, Fnv};

/// Bump when what goes into an image changes in a way the input hash cannot see.
const LAYOUT_VERSION: &str = "2";

/// A reference of the pinned manifest, split as the manifest keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImageRef {
    pub(crate) repository: String,
    pub(crate) tag: String,
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.repository, self.tag)
    }
}

/// The references of the images built here, read from the pinned release's manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refs {
    pub(crate) pause: ImageRef,
    pub(crate) busybox: ImageRef,
    pub(crate) agnhost: ImageRef,
    pub(crate) coredns: ImageRef,
    pub(crate) glibc_dns_testing: ImageRef,
    pub(crate) nginx: ImageRef,
    pub(crate) regression_74839: ImageRef,
    pub(crate) distroless_iptables: ImageRef,
}

/// One built image archive, with the reference containerd files it under.
#[derive(Debug, Clone)]
pub(crate) struct Archive {
    pub(crate) reference: ImageRef,
    pub(crate) path: PathBuf,
}

/// Reads `configs[Name] = Config{list.Registry, "name", "version"}` lines and the registry
/// defaults (`Registry: "host/path",`) of `test/utils/image/manifest.go`.
pub(crate) fn parse_manifest(text: &str) -> Result<Refs> {
    let registry = |field: &str| -> Result<String> {
        text.lines()
            .map(str::trim)
            .find_map(|line| {
                let rest = line.strip_prefix(field)?.trim_start().strip_prefix(':')?;
                let value = rest.trim().trim_end_matches(',').trim_matches('"');
                Some(value.to_owned())
            })
            .with_context(|| format!("manifest.go sets no default for {field}"))
    };
    let config = |id: &str| -> Result<ImageRef> {
        let prefix = format!("configs[{id}] = Config{{list.");
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with(&prefix))
            .with_context(|| format!("manifest.go has no configs[{id}]"))?;
        let inner = line[prefix.len()..].trim_end_matches('}');
        let parts: Vec<&str> = inner.split(',').map(str::trim).collect();
        let [reg, name, tag] = parts.as_slice() else {
            bail!("cannot read configs[{id}]: {line}");
        };
        Ok(ImageRef {
            repository: format!("{}/{}", registry(reg)?, name.trim_matches('"')),
            tag: tag.trim_matches('"').to_owned(),
        })
    };
    Ok(Refs {
        pause: config("Pause")?,
        busybox: config("BusyBox")?,
        agnhost: config("Agnhost")?,
        coredns: coredns_ref()?,
        glibc_dns_testing: config("GlibcDnsTesting")?,
        nginx: config("Nginx")?,
        regression_74839: config("RegressionIssue74839")?,
        distroless_iptables: config("DistrolessIptables")?,
    })
}

/// CoreDNS's reference, `registry.k8s.io/coredns/coredns:<pinned version>`, from the pin in
/// `integration/tools/coredns/go.mod`.
pub(crate) fn coredns_ref() -> Result<ImageRef> {
    let path = util::workspace_root().join("integration/tools/coredns/go.mod");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let tag = text
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("github.com/coredns/coredns "))
        .and_then(|rest| rest.split_whitespace().next())
        .with_context(|| format!("{} pins no github.com/coredns/coredns", path.display()))?;
    Ok(ImageRef {
        repository: "registry.k8s.io/coredns/coredns".to_owned(),
        tag: tag.to_owned(),
    })
}

/// The pinned `k8s.io/kubernetes` module's directory in the Go module cache (the tools build
/// put it there).
fn kubernetes_module_dir() -> Result<PathBuf> {
    let go = crate::tools::go().context("no Go toolchain to locate the pinned module")?;
    let out = util::output(
        Command::new(go)
            .current_dir(util::workspace_root().join("integration/tools"))
            .args(["list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"])
            .env("GOFLAGS", "-mod=readonly")
            .env("GOTOOLCHAIN", "local"),
    )?;
    Ok(PathBuf::from(out.trim()))
}

/// The references the pinned e2e suite uses.
pub(crate) fn refs() -> Result<Refs> {
    let path = kubernetes_module_dir()?.join("test/utils/image/manifest.go");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    parse_manifest(&text).with_context(|| format!("reading {}", path.display()))
}

/// A busybox tree: the binary at `/bin/busybox`, a link per applet, and the files a shell
/// expects.
fn busybox_tree(root: &Path, busybox: &Path) -> Result<()> {
    let bin = root.join("bin");
    fs::create_dir_all(&bin)?;
    fs::copy(busybox, bin.join("busybox"))
        .with_context(|| format!("copying {}", busybox.display()))?;
    let list = util::output(Command::new(busybox).arg("--list"))?;
    for applet in list.lines().map(str::trim).filter(|a| !a.is_empty()) {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", bin.join(applet))?;
        }
    }
    for dir in ["etc", "tmp", "proc", "sys", "dev", "root", "var/run"] {
        fs::create_dir_all(root.join(dir))?;
    }
    fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
    )?;
    fs::write(root.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n")?;
    Ok(())
}

/// Host programs the agnhost image carries beside agnhost, at the paths upstream's image has
/// them (its Dockerfile installs curl, netcat-openbsd, iproute2, bind-tools, bash and socat):
/// the e2e tests exec `nc -v -t -w 2`, `curl`, `ss`, `dig` and `wget -T 1` in agnhost Pods, and
/// the DNS tests' prober `getent hosts` (Alpine's, musl's, upstream; glibc's here, under
/// [`NSSWITCH`]; busybox has none, which failed every DNS test that checks `/etc/hosts`).
/// `wget` is GNU's: Debian 12's static busybox 1.35 (whose applets the image has otherwise)
/// dies of a segmentation fault on `wget -T`, which failed every test that checks a Service
/// with `wget -q -O - -T 1` as reachable by nobody.
const AGNHOST_TOOLS: &[(&str, &str)] = &[
    ("/usr/bin/curl", "/usr/bin/curl"),
    ("/usr/bin/wget", "/usr/bin/wget"),
    ("/usr/bin/nc.openbsd", "/usr/bin/nc"),
    ("/usr/bin/ss", "/usr/bin/ss"),
    ("/usr/sbin/ip", "/sbin/ip"),
    ("/usr/bin/dig", "/usr/bin/dig"),
    ("/usr/bin/bash", "/bin/bash"),
    ("/usr/bin/socat", "/usr/bin/socat"),
    ("/usr/bin/getent", "/usr/bin/getent"),
];

/// `/etc/nsswitch.conf` of the images with glibc's `getent`: the hosts file first, as musl
/// reads it (without the file glibc asks DNS first and stops at its "no such name").
const NSSWITCH: &str = "hosts: files dns\n";

/// Files of upstream's agnhost `porter` directory its image carries at `/`: the certificate
/// and key `porter` serves its TLS ports with (the "Proxy through a service and a pod" test
/// reads through them).
const PORTER_TLS: &[&str] = &["localhost.crt", "localhost.key"];

/// Host programs of the `glibc-dns-testing` image: the DNS tests' glibc prober runs `dig` and
/// `getent hosts` (glibc's resolver, where busybox would use its own).
const GLIBC_DNS_TOOLS: &[(&str, &str)] = &[
    ("/usr/bin/dig", "/usr/bin/dig"),
    ("/usr/bin/host", "/usr/bin/host"),
    ("/usr/bin/nslookup", "/usr/bin/nslookup"),
    ("/usr/bin/getent", "/usr/bin/getent"),
    ("/usr/bin/bash", "/bin/bash"),
];

/// Debian packages of the `nginx` image.
const NGINX_PACKAGES: &[&str] = &["nginx"];

/// nginx's configuration in the `nginx` image: port 80, as upstream's image serves, in the
/// foreground, logging to the container's output.
const NGINX_CONF: &str = "user root;
worker_processes 1;
daemon off;
pid /run/nginx.pid;
error_log stderr;
events { worker_connections 64; }
http {
    access_log off;
    server {
        listen 80;
        location / { return 200 \"nginx\\n\"; }
    }
}
";

/// Debian packages of the `distroless-iptables` image: upstream's carries iptables, ipset,
/// nftables and conntrack, and the tests exec `sh -c` with `test`, `which`, `grep` and `cat`.
const DISTROLESS_IPTABLES_PACKAGES: &[&str] = &[
    "iptables",
    "ipset",
    "nftables",
    "conntrack",
    "bash",
    "coreutils",
    "grep",
    "debianutils",
];

/// Copies a host program into `root` at `guest`, with every shared library it links at the
/// library's own path (the loader included), replacing a busybox link of the same name.
fn add_host_program(root: &Path, host: &Path, guest: &str) -> Result<()> {
    let mut copies = vec![(host.to_path_buf(), PathBuf::from(guest))];
    for lib in crate::initramfs::shared_libraries(host)? {
        copies.push((lib.clone(), lib));
    }
    for (from, to) in copies {
        let dest = root.join(to.strip_prefix("/").unwrap_or(&to));
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent)?;
        }
        if dest.symlink_metadata().is_ok() {
            fs::remove_file(&dest)?;
        }
        // `copy` follows symlinks: the image gets the file the host's loader would open.
        fs::copy(&from, &dest).with_context(|| format!("copying {}", from.display()))?;
    }
    Ok(())
}

/// Makes `/bin/sh` bash. Debian's static busybox prefers its own applets: as `/bin/sh` it
/// would run its `nc` (which lacks `-v` and `-t`) whatever PATH says; the tests' `sh -c` must
/// find the image's tools, as on upstream's images.
fn shell_is_bash(root: &Path) -> Result<()> {
    let sh = root.join("bin/sh");
    if sh.symlink_metadata().is_ok() {
        fs::remove_file(&sh)?;
    }
    std::os::unix::fs::symlink("bash", &sh)?;
    Ok(())
}

/// Appends `text` to a file of the image tree.
fn append(path: &Path, text: &str) -> Result<()> {
    use std::io::Write as _;
    fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("appending to {}", path.display()))
}

/// Builds (or finds cached) the archives.
pub(crate) fn ensure(cluster: &ClusterTools, coredns: &Path, refs: &Refs) -> Result<Vec<Archive>> {
    let source = util::workspace_root().join("integration/images/pause.c");
    let busybox = fs::canonicalize(util::which("busybox").context("busybox not found")?)?;
    let mut key = Fnv::default();
    key.str(LAYOUT_VERSION).str(format!("{refs:?}"));
    key.bytes(&fs::read(&source).with_context(|| format!("reading {}", source.display()))?);
    key.file(&busybox)?;
    key.file(&cluster.agnhost)?;
    for file in PORTER_TLS {
        key.file(&cluster.agnhost_porter.join(file))?;
    }
    key.file(coredns)?;
    key.file(&cluster.regression_74839)?;
    for (host, guest) in AGNHOST_TOOLS.iter().chain(GLIBC_DNS_TOOLS) {
        key.file(Path::new(host))?;
        key.str(guest);
        for lib in crate::initramfs::shared_libraries(Path::new(host))? {
            key.file(&lib)?;
        }
    }
    let debs_dir = util::target_dir()?.join("lab/test-image-debs");
    let nginx_debs = crate::image::download_debs(&debs_dir, NGINX_PACKAGES)?;
    let iptables_debs = crate::image::download_debs(&debs_dir, DISTROLESS_IPTABLES_PACKAGES)?;
    key.str(NGINX_CONF);
    for deb in nginx_debs.iter().chain(&iptables_debs) {
        key.str(deb.file_name().unwrap_or_default());
    }
    let dir = util::target_dir()?.join("lab/images").join(key.hex());
    let archive = |reference: &ImageRef, file: &str| Archive {
        reference: reference.clone(),
        path: dir.join(file),
    };
    let pause = archive(&refs.pause, "pause.tar");
    let busybox_image = archive(&refs.busybox, "busybox.tar");
    let agnhost = archive(&refs.agnhost, "agnhost.tar");
    let coredns_image = archive(&refs.coredns, "coredns.tar");
    let glibc_dns = archive(&refs.glibc_dns_testing, "glibc-dns-testing.tar");
    let nginx = archive(&refs.nginx, "nginx.tar");
    let regression = archive(&refs.regression_74839, "regression-issue-74839.tar");
    let iptables = archive(&refs.distroless_iptables, "distroless-iptables.tar");
    let all = [
        &pause,
        &busybox_image,
        &agnhost,
        &coredns_image,
        &glibc_dns,
        &nginx,
        &regression,
        &iptables,
    ];
    if all.iter().all(|a| a.path.is_file()) {
        return Ok(all.into_iter().cloned().collect());
    }
    let names: Vec<_> = all.iter().filter_map(|a| a.path.file_name()).collect();
    let scratch = dir.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&scratch)?;
    // Each image's tree is `scratch/<archive name>.root`, packed into `scratch/<archive name>`.
    let tree = |image: &Archive| -> Result<PathBuf> {
        let name = image
            .path
            .file_name()
            .context("an archive path has no name")?;
        Ok(scratch.join(Path::new(name).with_extension("root")))
    };
    let pack = |root: &Path, config: serde_json::Value, image: &Archive| -> Result<()> {
        let name = image
            .path
            .file_name()
            .context("an archive path has no name")?;
        write_archive(
            &scratch,
            root,
            config,
            &image.reference.repository,
            &image.reference.tag,
            &scratch.join(name),
        )
    };
    let env = json!(["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]);

    // pause
    let root = tree(&pause)?;
    fs::create_dir_all(&root)?;
    util::run(
        Command::new("gcc")
            .args(["-static", "-Os", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(root.join("pause"))
            .arg(&source),
    )
    .context("building the pause binary (needs gcc and libc6-dev)")?;
    pack(
        &root,
        json!({ "Entrypoint": ["/pause"], "Env": env }),
        &pause,
    )?;

    // busybox
    let root = tree(&busybox_image)?;
    busybox_tree(&root, &busybox)?;
    pack(&root, json!({ "Cmd": ["sh"], "Env": env }), &busybox_image)?;

    // agnhost, over the same busybox tree, with upstream's tools.
    fs::copy(&cluster.agnhost, root.join("agnhost"))
        .with_context(|| format!("copying {}", cluster.agnhost.display()))?;
    std::os::unix::fs::symlink("agnhost", root.join("agnhost-2"))?;
    fs::create_dir_all(root.join("uploads"))?;
    // `porter` serves TLS with these, found relative to its working directory (`/`).
    for file in PORTER_TLS {
        let from = cluster.agnhost_porter.join(file);
        fs::copy(&from, root.join(file)).with_context(|| format!("copying {}", from.display()))?;
    }
    // Upstream's image carries CoreDNS at /coredns (the DNS tests run it as a Pod's DNS
    // server) and a user and group its tests name.
    fs::copy(coredns, root.join("coredns"))
        .with_context(|| format!("copying {}", coredns.display()))?;
    append(
        &root.join("etc/passwd"),
        "user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n",
    )?;
    append(
        &root.join("etc/group"),
        "user-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\n",
    )?;
    for (host, guest) in AGNHOST_TOOLS {
        add_host_program(&root, Path::new(host), guest)?;
    }
    shell_is_bash(&root)?;
    fs::write(root.join("etc/nsswitch.conf"), NSSWITCH)?;
    let config = json!({ "Entrypoint": ["/agnhost"], "Cmd": ["pause"], "Env": env });
    pack(&root, config, &agnhost)?;

    // coredns: the binary alone (it runs as root with NET_BIND_SERVICE, reading its Corefile).
    let root = tree(&coredns_image)?;
    for dir in ["etc", "tmp"] {
        fs::create_dir_all(root.join(dir))?;
    }
    fs::copy(coredns, root.join("coredns"))
        .with_context(|| format!("copying {}", coredns.display()))?;
    pack(
        &root,
        json!({ "Entrypoint": ["/coredns"], "Env": env }),
        &coredns_image,
    )?;

    // glibc-dns-testing: a shell, `seq` and `sleep` from busybox, the resolver tools from
    // the host (glibc's).
    let root = tree(&glibc_dns)?;
    busybox_tree(&root, &busybox)?;
    for (host, guest) in GLIBC_DNS_TOOLS {
        add_host_program(&root, Path::new(host), guest)?;
    }
    shell_is_bash(&root)?;
    fs::write(root.join("etc/nsswitch.conf"), NSSWITCH)?;
    pack(&root, json!({ "Cmd": ["sh"], "Env": env }), &glibc_dns)?;

    // nginx
    let root = tree(&nginx)?;
    crate::image::unpack_debs(&root, &nginx_debs)?;
    for dir in ["run", "tmp", "var/lib/nginx", "var/log/nginx", "etc/nginx"] {
        fs::create_dir_all(root.join(dir))?;
    }
    fs::write(root.join("etc/nginx/nginx.conf"), NGINX_CONF)?;
    fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")?;
    fs::write(root.join("etc/group"), "root:x:0:\n")?;
    let config = json!({
        "Entrypoint": ["/usr/sbin/nginx"],
        "ExposedPorts": { "80/tcp": {} },
        "Env": env,
    });
    pack(&root, config, &nginx)?;

    // regression-issue-74839: the server alone (it is static).
    let root = tree(&regression)?;
    fs::create_dir_all(root.join("tmp"))?;
    fs::copy(
        &cluster.regression_74839,
        root.join("regression-issue-74839"),
    )
    .with_context(|| format!("copying {}", cluster.regression_74839.display()))?;
    let config = json!({ "Entrypoint": ["/regression-issue-74839"], "Env": env });
    pack(&root, config, &regression)?;

    // distroless-iptables
    let root = tree(&iptables)?;
    crate::image::unpack_debs(&root, &iptables_debs)?;
    for dir in ["run", "tmp", "proc", "sys", "dev"] {
        fs::create_dir_all(root.join(dir))?;
    }
    shell_is_bash(&root)?;
    // debianutils' `which` is an alternative its maintainer script would link.
    let which = root.join("usr/bin/which");
    if which.symlink_metadata().is_err() {
        std::os::unix::fs::symlink("which.debianutils", &which)?;
    }
    pack(&root, json!({ "Env": env }), &iptables)?;

    // Only the archives stay: the trees and `write_archive`'s work files go.
    for entry in fs::read_dir(&scratch)? {
        let path = entry?.path();
        if path.file_name().is_some_and(|n| names.contains(&n)) {
            continue;
        }
        if path.is_dir() {
            fs::remove_dir_all(&path)?;
        } else {
            fs::remove_file(&path)?;
        }
    }
    if let Some(parent) = dir.parent() {
        // Earlier inputs' images are dead weight (agnhost alone is ~90 MB).
        for old in fs::read_dir(parent)?.filter_map(|e| e.ok().map(|e| e.path())) {
            if old != scratch {
                let _ = fs::remove_dir_all(old);
            }
        }
    }
    fs::rename(&scratch, &dir)?;
    Ok(all.into_iter().cloned().collect())
}

/// Debian packages of the kube-proxy image: what its IPVS, iptables and nftables modes call
/// (upstream's image is distroless-iptables, with the same programs).
const KUBE_PROXY_PACKAGES: &[&str] = &[
    "iptables",
    "ipset",
    "nftables",
    "conntrack",
    "kmod",
    "libc6",
];

/// The pinned kube-proxy as an image, `registry.k8s.io/kube-proxy:<release>`, for the lab's
/// comparison runs (`--proxy kube-proxy`).
pub(crate) fn kube_proxy(tools: &crate::tools::Tools) -> Result<Archive> {
    let reference = ImageRef {
        repository: "registry.k8s.io/kube-proxy".to_owned(),
        tag: tools.kubernetes_version.clone(),
    };
    let base = util::target_dir()?.join("lab/kube-proxy-image");
    let debs_dir = base.join("debs");
    let debs = crate::image::download_debs(&debs_dir, KUBE_PROXY_PACKAGES)?;
    let mut key = Fnv::default();
    key.str(LAYOUT_VERSION).str(reference.to_string());
    crate::image::inputs_key(&mut key, &tools.kube_proxy, &debs)?;
    let dir = base.join(key.hex());
    let archive = Archive {
        reference,
        path: dir.join("kube-proxy.tar"),
    };
    if archive.path.is_file() {
        return Ok(archive);
    }
    // Earlier inputs' archives are dead weight; the downloaded packages are kept.
    for old in fs::read_dir(&base)?.filter_map(|e| e.ok().map(|e| e.path())) {
        if old != debs_dir {
            let _ = fs::remove_dir_all(old);
        }
    }
    let scratch = base.join(format!("tmp{}", std::process::id()));
    fs::create_dir_all(&scratch)?;
    let root = scratch.join("root");
    crate::image::unpack_debs(&root, &debs)?;
    for d in [
        "tmp",
        "run",
        "proc",
        "sys",
        "dev",
        "var/lib/kube-proxy",
        "usr/local/bin",
    ] {
        fs::create_dir_all(root.join(d))?;
    }
    fs::copy(&tools.kube_proxy, root.join("usr/local/bin/kube-proxy"))
        .with_context(|| format!("copying {}", tools.kube_proxy.display()))?;
    let config = json!({
        "Entrypoint": ["/usr/local/bin/kube-proxy"],
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    });
    write_archive(
        &scratch,
        &root,
        config,
        &archive.reference.repository,
        &archive.reference.tag,
        &scratch.join("kube-proxy.tar"),
    )?;
    fs::remove_dir_all(&root)?;
    fs::rename(&scratch, &dir)?;
    Ok(archive)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_lines_give_full_references() -> Result<()> {
        let text = r#"
func initReg() RegistryList {
	registry := RegistryList{
		PromoterE2eRegistry:      "registry.k8s.io/e2e-test-images",
		BuildImageRegistry:       "registry.k8s.io/build-image",
		GcRegistry:               "registry.k8s.io",
	}
}
	configs[DistrolessIptables] = Config{list.BuildImageRegistry, "distroless-iptables", "v0.9.9"}
	configs[GlibcDnsTesting] = Config{list.PromoterE2eRegistry, "glibc-dns-testing", "2.1.1"}
	configs[Nginx] = Config{list.PromoterE2eRegistry, "nginx", "1.27.0-2"}
	configs[RegressionIssue74839] = Config{list.PromoterE2eRegistry, "regression-issue-74839", "1.5"}
	configs[Agnhost] = Config{list.PromoterE2eRegistry, "agnhost", "2.66.1"}
	configs[BusyBox] = Config{list.PromoterE2eRegistry, "busybox", "1.37.0-2"}
	configs[Pause] = Config{list.GcRegistry, "pause", "3.10.2"}
"#;
        let refs = parse_manifest(text)?;
        assert_eq!(
            refs.agnhost.to_string(),
            "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
        );
        assert_eq!(
            refs.busybox.to_string(),
            "registry.k8s.io/e2e-test-images/busybox:1.37.0-2"
        );
        assert_eq!(refs.pause.to_string(), "registry.k8s.io/pause:3.10.2");
        assert_eq!(
            refs.distroless_iptables.to_string(),
            "registry.k8s.io/build-image/distroless-iptables:v0.9.9"
        );
        assert_eq!(
            refs.glibc_dns_testing.to_string(),
            "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"
        );
        assert!(
            refs.coredns
                .to_string()
                .starts_with("registry.k8s.io/coredns/coredns:v1.")
        );
        let missing = parse_manifest(&text.replace("configs[Pause]", "configs[Other]"));
        assert!(missing.is_err_and(|e| e.to_string().contains("configs[Pause]")));
        Ok(())
    }
}
