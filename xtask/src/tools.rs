//! `cargo xtask tools`: the real Kubernetes programs (kube-apiserver, etcd, kube-proxy, kubectl)
//! built from the Go module proxy at the versions pinned in `integration/tools/go.mod`.
//!
//! The binaries land in `<target>/tools/<hash>/`, where the hash covers `go.mod`, `go.sum` and
//! the Go version, so they are built once per machine and rebuilt only when a pin changes. A
//! build goes to a scratch directory first and is renamed into place, so an interrupted build
//! never leaves a half-filled cache that a later run would trust.
//!
//! Without a Go toolchain nothing is built: callers get [`Unavailable`] with the reason and skip
//! (loudly) what needs these programs.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::util::{self, Fnv, secs};

/// The packages built, and the file name each binary gets.
const PACKAGES: &[(&str, &str)] = &[
    ("go.etcd.io/etcd/server/v3", "etcd"),
    ("k8s.io/kubernetes/cmd/kube-apiserver", "kube-apiserver"),
    ("k8s.io/kubernetes/cmd/kube-proxy", "kube-proxy"),
    ("k8s.io/kubernetes/cmd/kubectl", "kubectl"),
];

/// The node and control-plane programs of the lab cluster (`cargo xtask cluster`, issue 15),
/// built only when a lab is wanted: they are large and most commands never need them. They go
/// into guests, so they are built without symbol tables (`-s -w`).
const CLUSTER_PACKAGES: &[(&str, &str)] = &[
    ("k8s.io/kubernetes/cmd/kubelet", "kubelet"),
    (
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        "kube-controller-manager",
    ),
    ("k8s.io/kubernetes/cmd/kube-scheduler", "kube-scheduler"),
    ("k8s.io/kubernetes/test/images/agnhost", "agnhost"),
];

/// Programs of the pinned release's test images that are not agnhost, built apart from
/// [`CLUSTER_PACKAGES`] (small, standard library only) so that adding one does not rebuild
/// the large programs.
const IMAGE_PACKAGES: &[(&str, &str)] = &[(
    "k8s.io/kubernetes/test/images/regression-issue-74839",
    "regression-issue-74839",
)];

/// Test binaries (`go test -c`) of the lab: the upstream end-to-end suite.
const CLUSTER_TESTS: &[(&str, &str)] = &[("k8s.io/kubernetes/test/e2e", "e2e.test")];

/// Paths of the built programs.
#[derive(Debug, Clone)]
pub(crate) struct Tools {
    pub(crate) etcd: PathBuf,
    pub(crate) kube_apiserver: PathBuf,
    pub(crate) kube_proxy: PathBuf,
    pub(crate) kubectl: PathBuf,
    /// The pinned Kubernetes release, e.g. `v1.37.2`.
    pub(crate) kubernetes_version: String,
}

/// Paths of the lab cluster's programs (see [`CLUSTER_PACKAGES`]).
#[derive(Debug, Clone)]
pub(crate) struct ClusterTools {
    pub(crate) kubelet: PathBuf,
    pub(crate) kube_controller_manager: PathBuf,
    pub(crate) kube_scheduler: PathBuf,
    pub(crate) agnhost: PathBuf,
    /// The directory of agnhost's `porter` in the pinned module's source: upstream's image
    /// carries its `localhost.crt` and `localhost.key` (the TLS port of `porter`).
    pub(crate) agnhost_porter: PathBuf,
    /// The server of the `regression-issue-74839` test image (see [`IMAGE_PACKAGES`]).
    pub(crate) regression_74839: PathBuf,
    /// Upstream `e2e.test` of the pinned release.
    pub(crate) e2e_test: PathBuf,
}

/// Why the programs cannot be had here (no Go toolchain); callers print it and skip.
#[derive(Debug)]
pub(crate) struct Unavailable(pub(crate) String);

pub(crate) fn command(args: &[String]) -> Result<()> {
    if let Some(arg) = args.first() {
        anyhow::bail!("tools: unexpected argument {arg:?}; usage: cargo xtask tools");
    }
    match ensure()? {
        Ok(tools) => {
            println!("kubernetes {}", tools.kubernetes_version);
            for path in [
                &tools.etcd,
                &tools.kube_apiserver,
                &tools.kube_proxy,
                &tools.kubectl,
            ] {
                println!("{}", path.display());
            }
            Ok(())
        }
        Err(Unavailable(why)) => anyhow::bail!("tools: {why}"),
    }
}

/// The `go` command: `$GO` if set (which also lets one check the no-Go path with
/// `GO=/nonexistent`), else `go` on `PATH`, else the usual install location.
pub(crate) fn go() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("GO") {
        let path = PathBuf::from(path);
        return path.is_file().then_some(path);
    }
    util::which("go").or_else(|| {
        let p = PathBuf::from("/usr/local/go/bin/go");
        p.is_file().then_some(p)
    })
}

fn module_dir() -> PathBuf {
    util::workspace_root().join("integration/tools")
}

/// The pinned `k8s.io/kubernetes` version, read from `go.mod`.
fn kubernetes_version(go_mod: &str) -> Option<String> {
    // `go mod tidy` keeps it inside the require block, marked indirect (only tools use it).
    go_mod.lines().find_map(|line| {
        let line = line.trim();
        let rest = line
            .strip_prefix("require k8s.io/kubernetes ")
            .or_else(|| line.strip_prefix("k8s.io/kubernetes "))?;
        rest.split_whitespace().next().map(str::to_owned)
    })
}

/// The built programs, building them first if the cache lacks them. The outer error is a real
/// failure (a build error); the inner one means "no Go here", which callers skip on.
pub(crate) fn ensure() -> Result<std::result::Result<Tools, Unavailable>> {
    let Some(go) = go() else {
        return Ok(Err(Unavailable(
            "no Go toolchain (`$GO` unset or not a file, no `go` on PATH or in /usr/local/go/bin); \
             kube-apiserver, etcd and kube-proxy cannot be built"
                .into(),
        )));
    };
    let dir = module_dir();
    let go_mod = fs::read_to_string(dir.join("go.mod"))
        .with_context(|| format!("reading {}/go.mod", dir.display()))?;
    let go_sum = fs::read_to_string(dir.join("go.sum"))
        .with_context(|| format!("reading {}/go.sum", dir.display()))?;
    let kubernetes_version = kubernetes_version(&go_mod)
        .context("integration/tools/go.mod pins no k8s.io/kubernetes")?;
    let go_version = util::output(Command::new(&go).arg("version"))?;
    let mut key = Fnv::default();
    key.str(&go_mod)
        .str(&go_sum)
        .str(go_version.trim())
        .str(version_ldflags(&kubernetes_version, false));
    let target = util::target_dir()?.join("tools");
    let out = target.join(key.hex());
    let tools = Tools {
        etcd: out.join("etcd"),
        kube_apiserver: out.join("kube-apiserver"),
        kube_proxy: out.join("kube-proxy"),
        kubectl: out.join("kubectl"),
        kubernetes_version,
    };
    if PACKAGES.iter().all(|(_, name)| out.join(name).is_file()) {
        return Ok(Ok(tools));
    }
    let ldflags = version_ldflags(&tools.kubernetes_version, false);
    build(&go, &dir, &target, &out, PACKAGES, &[], &[&ldflags])?;
    Ok(Ok(tools))
}

/// The lab cluster's programs, building them first if the cache lacks them (as [`ensure`]); the
/// cache key is the same pins, so they always match [`Tools`] of the same checkout.
pub(crate) fn ensure_cluster() -> Result<std::result::Result<ClusterTools, Unavailable>> {
    let tools = match ensure()? {
        Ok(tools) => tools,
        Err(why) => return Ok(Err(why)),
    };
    let Some(go) = go() else {
        return Ok(Err(Unavailable("no Go toolchain".into())));
    };
    let base = tools
        .kubectl
        .parent()
        .context("the tools directory has no parent")?
        .to_path_buf();
    let target = base.parent().context("no target dir")?.to_path_buf();
    let flags = version_ldflags(&tools.kubernetes_version, true);
    let build_set =
        |set: &str, packages, tests| build_set(&go, &base, &target, set, packages, tests, &flags);
    let out = build_set("cluster", CLUSTER_PACKAGES, CLUSTER_TESTS)?;
    let images = build_set("images", IMAGE_PACKAGES, &[])?;
    // The module is in the Go module cache once the builds above have run.
    let source = util::output(go_command(&go, &module_dir()).args([
        "list",
        "-m",
        "-f",
        "{{.Dir}}",
        "k8s.io/kubernetes",
    ]))
    .context("finding the pinned k8s.io/kubernetes source")?;
    Ok(Ok(ClusterTools {
        kubelet: out.join("kubelet"),
        kube_controller_manager: out.join("kube-controller-manager"),
        kube_scheduler: out.join("kube-scheduler"),
        agnhost: out.join("agnhost"),
        agnhost_porter: PathBuf::from(source.trim()).join("test/images/agnhost/porter"),
        regression_74839: images.join("regression-issue-74839"),
        e2e_test: out.join("e2e.test"),
    }))
}

/// One set of programs built together into `<base>-<set>-<key>/` (the key hashes the flags and
/// the packages), unless every one of them is already there; returns that directory.
fn build_set(
    go: &Path,
    base: &Path,
    target: &Path,
    set: &str,
    packages: &[(&str, &str)],
    tests: &[(&str, &str)],
    flags: &str,
) -> Result<PathBuf> {
    let mut key = Fnv::default();
    key.str(flags);
    for (pkg, name) in packages.iter().chain(tests) {
        key.str(pkg).str(name);
    }
    let out = PathBuf::from(format!("{}-{set}-{}", base.display(), key.hex()));
    let complete = packages
        .iter()
        .chain(tests)
        .all(|(_, name)| out.join(name).is_file());
    if !complete {
        build(go, &module_dir(), target, &out, packages, tests, &[flags])?;
    }
    Ok(out)
}

/// `-ldflags` stamping the release into the programs, as upstream's build does: without it
/// they report `v0.0.0-master`, and kubectl, kubelet and the e2e suite compare versions.
/// No program gets DWARF (`-w`): none is run under a debugger here, writing it is much of the
/// linker's time on a cold machine, and Go's stack traces and pprof read the pclntab, which
/// stays. `strip` also drops the symbol tables of programs that go into guests (`-s`).
fn version_ldflags(version: &str, strip: bool) -> String {
    let mut parts = version.trim_start_matches('v').split('.');
    let major = parts.next().unwrap_or("1");
    let minor = parts.next().unwrap_or("0");
    let mut flags = String::from("-ldflags=");
    if strip {
        flags.push_str("-s ");
    }
    flags.push_str("-w ");
    for pkg in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        flags.push_str(&format!(
            "-X {pkg}.gitVersion={version} -X {pkg}.gitMajor={major} -X {pkg}.gitMinor={minor} \
             -X {pkg}.gitTreeState=clean -X {pkg}.buildDate=1970-01-01T00:00:00Z "
        ));
    }
    flags.trim_end().to_owned()
}

fn go_command(go: &Path, module: &Path) -> Command {
    let mut cmd = util::program(go);
    cmd.current_dir(module)
        // go.sum is committed: a build must never rewrite the pins, and must not switch to
        // another Go release on its own.
        .env("GOFLAGS", "-mod=readonly -buildvcs=false")
        .env("GOTOOLCHAIN", "local")
        .env("CGO_ENABLED", "0");
    cmd
}

fn build(
    go: &Path,
    module: &Path,
    target: &Path,
    out: &Path,
    packages: &[(&str, &str)],
    tests: &[(&str, &str)],
    flags: &[&str],
) -> Result<()> {
    let started = Instant::now();
    // Named after the output too: two builds of one process (the lab's programs and CoreDNS)
    // must not share a scratch directory.
    let scratch = target.join(format!(
        "building-{}-{}",
        out.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&scratch)?;
    eprintln!(
        "xtask: building {} from the Go module proxy (first time on this machine: several minutes)",
        packages
            .iter()
            .chain(tests)
            .map(|(_, n)| *n)
            .collect::<Vec<_>>()
            .join(", "),
    );
    let mut cmd = go_command(go, module);
    cmd.args(["build", "-trimpath"])
        .args(flags)
        .arg("-o")
        .arg(&scratch)
        .args(packages.iter().map(|(pkg, _)| *pkg));
    util::run(&mut cmd)?;
    for (pkg, name) in tests {
        let mut cmd = go_command(go, module);
        cmd.args(["test", "-c", "-trimpath"])
            .args(flags)
            .arg("-o")
            .arg(scratch.join(name))
            .arg(pkg);
        util::run(&mut cmd)?;
    }
    // `go build -o DIR` names each binary after the last element of its package path, which
    // for etcd is `v3`'s parent directory name `server`.
    for (pkg, name) in packages {
        let built = pkg
            .trim_end_matches("/v3")
            .rsplit('/')
            .next()
            .unwrap_or(name);
        if built != *name {
            fs::rename(scratch.join(built), scratch.join(name))
                .with_context(|| format!("renaming the {pkg} binary to {name}"))?;
        }
    }
    let _ = fs::remove_dir_all(out);
    fs::rename(&scratch, out)?;
    eprintln!(
        "xtask: built the tools into {} in {}",
        out.display(),
        secs(started.elapsed())
    );
    Ok(())
}

/// The Helm package built, from its own module (`integration/tools/helm`).
const HELM: &str = "helm.sh/helm/v3/cmd/helm";

/// The CoreDNS package built, from its own module (`integration/tools/coredns`).
const COREDNS: &str = "github.com/coredns/coredns";

/// The `helm` binary, building it first if the cache lacks it (as [`ensure`]); without DWARF,
/// as [`version_ldflags`] says why.
pub(crate) fn helm() -> Result<std::result::Result<PathBuf, Unavailable>> {
    own_module("helm", HELM, &["-ldflags=-w"])
}

/// The `coredns` binary for the lab cluster (built without symbol tables: it goes into an
/// image).
pub(crate) fn coredns() -> Result<std::result::Result<PathBuf, Unavailable>> {
    own_module("coredns", COREDNS, &["-ldflags=-s -w"])
}

/// A program pinned by a module of its own, `integration/tools/NAME`, built into
/// `<target>/tools/NAME-<hash>/NAME`.
fn own_module(
    name: &str,
    package: &str,
    flags: &[&str],
) -> Result<std::result::Result<PathBuf, Unavailable>> {
    let Some(go) = go() else {
        return Ok(Err(Unavailable(format!(
            "no Go toolchain (`$GO` unset or not a file, no `go` on PATH or in /usr/local/go/bin); \
             {name} cannot be built"
        ))));
    };
    let dir = module_dir().join(name);
    let go_mod = fs::read_to_string(dir.join("go.mod"))
        .with_context(|| format!("reading {}/go.mod", dir.display()))?;
    let go_sum = fs::read_to_string(dir.join("go.sum"))
        .with_context(|| format!("reading {}/go.sum", dir.display()))?;
    let go_version = util::output(Command::new(&go).arg("version"))?;
    let mut key = Fnv::default();
    key.str(&go_mod).str(&go_sum).str(go_version.trim());
    for flag in flags {
        key.str(flag);
    }
    let target = util::target_dir()?.join("tools");
    let out = target.join(format!("{name}-{}", key.hex()));
    let bin = out.join(name);
    if bin.is_file() {
        return Ok(Ok(bin));
    }
    build(&go, &dir, &target, &out, &[(package, name)], &[], flags)?;
    Ok(Ok(bin))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pinned_release_is_read_from_go_mod() -> Result<()> {
        let go_mod = fs::read_to_string(module_dir().join("go.mod"))?;
        let version = kubernetes_version(&go_mod).context("no pin")?;
        assert!(version.starts_with("v1."), "{version}");
        // Every staging module is replaced at the matching v0 version, or the build mixes
        // releases.
        let staging = format!("v0.{}", &version["v1.".len()..]);
        let replaces: Vec<&str> = go_mod
            .lines()
            .filter(|l| l.contains(" => k8s.io/"))
            .collect();
        assert!(replaces.len() > 20, "{replaces:?}");
        for line in replaces {
            assert!(
                line.trim_end().ends_with(&staging),
                "{line} is not {staging}"
            );
        }
        Ok(())
    }
}
