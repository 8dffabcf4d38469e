//! `cargo xtask bench {netlink,dump,diff,watch}`.
//!
//! `netlink` and `dump` need a kernel with IPVS, so they ship an example (release build) into the
//! VM: `ipvs-bench` of `kube-ipvs-netlink`, and `dump-bench` of `kube-ipvs` together with the
//! release `kube-ipvs` binary it compares with `ipvsadm`. The others are plain `cargo bench` runs.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{self, shell_quote};
use crate::vm::{self, GuestFile, Job};
use crate::vmtest::cargo_executables;

const NETLINK_PACKAGE: &str = "kube-ipvs-netlink";
const NETLINK_EXAMPLE: &str = "ipvs-bench";
const NETLINK_DEFAULT_ARGS: &[&str] = &["--services", "10000", "--dests", "10"];
const DUMP_PACKAGE: &str = "kube-ipvs";
const DUMP_EXAMPLE: &str = "dump-bench";

pub(crate) fn command(args: &[String]) -> Result<()> {
    let usage = "usage: cargo xtask bench netlink [-- ARGS] | bench dump [-- ARGS] | bench diff [ARGS] | bench watch [ARGS] | bench e2e [--sizes N,..] [--updates U] [--agents A,..] | bench soak [--minutes M] [--services N] [--rate R]";
    let (which, rest) = args.split_first().context(usage)?;
    // `--` separates our arguments from the benchmark's; accept it with or without.
    let rest: Vec<String> = match rest.split_first() {
        Some((sep, tail)) if sep == "--" => tail.to_vec(),
        _ => rest.to_vec(),
    };
    match which.as_str() {
        "netlink" => netlink(&rest),
        "dump" => dump(&rest),
        "diff" => cargo_bench("kube-ipvs-diff", &rest),
        "watch" => cargo_bench("kube-ipvs-watch", &rest),
        "e2e" => crate::bench_e2e::command(&rest),
        "soak" => crate::soak::command(&rest),
        other => bail!("unknown benchmark {other:?}; {usage}"),
    }
}

fn cargo_bench(package: &str, args: &[String]) -> Result<()> {
    let mut cmd = util::cargo_cmd();
    cmd.args(["bench", "-p", package]);
    if !args.is_empty() {
        cmd.arg("--").args(args);
    }
    util::run(&mut cmd)
}

/// Whether the netlink crate has the example yet (another engineer writes it); checked before
/// building so the message says what is missing instead of showing a cargo error.
fn example_exists() -> Result<bool> {
    let text =
        util::output(util::cargo_cmd().args(["metadata", "--format-version", "1", "--no-deps"]))?;
    let meta: serde_json::Value = serde_json::from_str(&text).context("parsing cargo metadata")?;
    Ok(meta["packages"].as_array().into_iter().flatten().any(|p| {
        p["name"] == NETLINK_PACKAGE
            && p["targets"].as_array().into_iter().flatten().any(|t| {
                t["name"] == NETLINK_EXAMPLE
                    && t["kind"]
                        .as_array()
                        .is_some_and(|k| k.iter().any(|k| k == "example"))
            })
    }))
}

fn netlink(args: &[String]) -> Result<()> {
    if !example_exists()? {
        bail!(
            "bench netlink: package {NETLINK_PACKAGE} has no example `{NETLINK_EXAMPLE}` yet \
             (crates/netlink/examples/{NETLINK_EXAMPLE}.rs); nothing to run"
        );
    }
    let built = cargo_executables(
        &[
            "build",
            "--release",
            "-p",
            NETLINK_PACKAGE,
            "--example",
            NETLINK_EXAMPLE,
        ],
        |m| m["target"]["name"] == NETLINK_EXAMPLE,
    )?;
    let (_, exe) = built
        .into_iter()
        .next()
        .context("cargo build produced no ipvs-bench executable")?;
    let args: Vec<String> = if args.is_empty() {
        NETLINK_DEFAULT_ARGS
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    } else {
        args.to_vec()
    };
    let mut script = String::from("exec /usr/local/bin/ipvs-bench");
    for arg in &args {
        script.push(' ');
        script.push_str(&shell_quote(arg));
    }
    script.push('\n');
    let mut job = Job::new("bench netlink", script);
    job.executables.push(GuestFile {
        host: exe,
        guest: PathBuf::from("/usr/local/bin/ipvs-bench"),
    });
    job.memory_mib = 4096;
    job.timeout = Duration::from_secs(3600);
    let outcome = vm::run(&job)?;
    eprintln!("xtask: console log in {}", outcome.log.display());
    if let Some(why) = outcome.failure() {
        bail!("bench netlink: {why}");
    }
    match outcome.guest_rc {
        Some(0) => Ok(()),
        rc => bail!("bench netlink: ipvs-bench exited with {rc:?}"),
    }
}

/// `kube-ipvs dump` against `ipvsadm -Ln` on a 10,000 x 10 table: ships the `dump-bench` example
/// and the release `kube-ipvs` binary.
fn dump(args: &[String]) -> Result<()> {
    let release = |what: &[&str], name: &str| -> Result<PathBuf> {
        let mut cargo_args = vec!["build", "--release", "-p", DUMP_PACKAGE];
        cargo_args.extend_from_slice(what);
        let built = cargo_executables(&cargo_args, |m| m["target"]["name"] == name)?;
        built
            .into_iter()
            .next()
            .map(|(_, exe)| exe)
            .with_context(|| format!("cargo build produced no {name} executable"))
    };
    let bench = release(&["--example", DUMP_EXAMPLE], DUMP_EXAMPLE)?;
    let daemon = release(&["--bin", "kube-ipvs"], "kube-ipvs")?;
    let mut script = format!("exec /usr/local/bin/{DUMP_EXAMPLE}");
    for arg in args {
        script.push(' ');
        script.push_str(&shell_quote(arg));
    }
    script.push('\n');
    let mut job = Job::new("bench dump", script);
    job.executables.push(GuestFile {
        host: bench,
        guest: PathBuf::from(format!("/usr/local/bin/{DUMP_EXAMPLE}")),
    });
    job.executables.push(GuestFile {
        host: daemon,
        guest: PathBuf::from("/usr/local/bin/kube-ipvs"),
    });
    job.memory_mib = 4096;
    job.timeout = Duration::from_secs(3600);
    let outcome = vm::run(&job)?;
    eprintln!("xtask: console log in {}", outcome.log.display());
    if let Some(why) = outcome.failure() {
        bail!("bench dump: {why}");
    }
    match outcome.guest_rc {
        Some(0) => Ok(()),
        rc => bail!("bench dump: {DUMP_EXAMPLE} exited with {rc:?}"),
    }
}
