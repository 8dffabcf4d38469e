//! `cargo xtask fuzz [TARGET] [--seconds N]`: the coverage-guided fuzz targets of `crates/fuzz`
//! under libFuzzer, on the stable toolchain.
//!
//! One binary holds every target (`KUBE_IPVS_FUZZ_TARGET` picks one), built in release with
//! LLVM's sanitizer-coverage pass (what `cargo fuzz` asks for, minus the sanitizers that need a
//! nightly compiler), with debug assertions and overflow checks on. Each target runs for the given
//! time on its corpus under `target/fuzz/corpus/<target>` (seeded by the binary from the
//! repository's fixtures and `crates/fuzz/seeds`, and kept between runs). A crash stops the run:
//! its input is written under `target/fuzz/artifacts/<target>/`; copy it to
//! `crates/fuzz/regressions/<target>/` with the fix, and `cargo test -p kube-ipvs-fuzz` replays it
//! from then on.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::util;

const USAGE: &str = "usage: cargo xtask fuzz [TARGET] [--seconds N] (N per target, default 60)";

/// Every target, as `crates/fuzz/src/lib.rs` lists them (the binary refuses any other name; a
/// test below keeps the two lists equal).
const TARGETS: &[&str] = &[
    "ipvs_reply",
    "address_events",
    "ipset_list",
    "conntrack_dump",
    "dump_args",
    "proxy_config",
    "manifest",
    "objects",
];

/// The coverage instrumentation libFuzzer needs, as `cargo fuzz` passes it.
const RUSTFLAGS: &[&str] = &[
    "-Cpasses=sancov-module",
    "-Cllvm-args=-sanitizer-coverage-level=4",
    "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
    "-Cllvm-args=-sanitizer-coverage-pc-table",
    "-Cllvm-args=-sanitizer-coverage-trace-compares",
    "-Cdebug-assertions",
    "-Coverflow-checks",
];

/// What one target's run did.
struct Outcome {
    target: &'static str,
    seconds: f64,
    executions: u64,
    corpus: usize,
}

pub(crate) fn command(args: &[String]) -> Result<()> {
    let mut seconds = 60u64;
    let mut only: Option<&'static str> = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => {
                let v = it.next().context(USAGE)?;
                seconds = v
                    .parse()
                    .with_context(|| format!("--seconds {v:?}; {USAGE}"))?;
            }
            name => {
                only = Some(
                    TARGETS
                        .iter()
                        .copied()
                        .find(|t| *t == name)
                        .with_context(|| {
                            format!("unknown target {name:?}; one of {TARGETS:?}\n{USAGE}")
                        })?,
                );
            }
        }
    }
    let targets: Vec<&'static str> = match only {
        Some(t) => vec![t],
        None => TARGETS.to_vec(),
    };
    let outcomes = run(&targets, seconds)?;
    println!("{}", table(&outcomes));
    Ok(())
}

/// Builds the binary and runs each target for `seconds`, as many at a time as the machine has
/// cores (each libFuzzer process uses one); returns the outcomes in the order given. After a
/// crash no other target starts, and the first failing target's error is returned.
fn run(targets: &[&'static str], seconds: u64) -> Result<Vec<Outcome>> {
    let bin = build()?;
    let base = util::workspace_root().join("target/fuzz");
    let workers = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(targets.len())
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let Some(&target) = targets.get(i) else { break };
                    let outcome = fuzz_one(&bin, &base, target, seconds);
                    let failed = outcome.is_err();
                    results
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((i, outcome));
                    if failed {
                        // The targets not started yet are not started.
                        next.store(targets.len(), std::sync::atomic::Ordering::SeqCst);
                    }
                }
            });
        }
    });
    let mut results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, outcome)| outcome).collect()
}

fn host_triple() -> Result<String> {
    let text = util::output(Command::new("rustc").arg("-vV"))?;
    text.lines()
        .find_map(|l| l.strip_prefix("host: "))
        .map(str::to_owned)
        .context("rustc -vV printed no host")
}

/// Builds the instrumented binary. The explicit `--target` keeps the flags off build scripts and
/// proc macros, as `cargo fuzz` does.
fn build() -> Result<PathBuf> {
    let triple = host_triple()?;
    let target_dir = util::workspace_root().join("target/fuzz/build");
    util::run(
        util::cargo_cmd()
            .env("RUSTFLAGS", RUSTFLAGS.join(" "))
            .args([
                "build",
                "--release",
                "-p",
                "kube-ipvs-fuzz",
                "--features",
                "libfuzzer",
                "--bin",
                "kube-ipvs-fuzz",
                "--target",
                &triple,
                "--target-dir",
            ])
            .arg(&target_dir),
    )?;
    Ok(target_dir.join(triple).join("release/kube-ipvs-fuzz"))
}

fn fuzz_one(bin: &Path, base: &Path, target: &'static str, seconds: u64) -> Result<Outcome> {
    let corpus = base.join("corpus").join(target);
    let artifacts = base.join("artifacts").join(target);
    std::fs::create_dir_all(&corpus)?;
    std::fs::create_dir_all(&artifacts)?;
    let log = base.join(format!("{target}.log"));
    eprintln!(
        "xtask fuzz: {target} for {seconds} s (log {})",
        log.display()
    );
    let started = Instant::now();
    let mut cmd = Command::new(bin);
    cmd.env("KUBE_IPVS_FUZZ_TARGET", target)
        .env("KUBE_IPVS_FUZZ_SEED_DIR", &corpus)
        .env("KUBE_IPVS_FUZZ_ROOT", util::workspace_root())
        .arg(&corpus)
        .arg(format!("-max_total_time={seconds}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .args([
            "-print_final_stats=1",
            "-timeout=20",
            "-rss_limit_mb=4096",
            "-max_len=65536",
            "-error_exitcode=77",
            "-timeout_exitcode=78",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    let shown = util::display_cmd(&cmd);
    let mut child = cmd.spawn().with_context(|| format!("starting {shown}"))?;
    let _registered = crate::reaper::register(child.id());
    let status = child.wait()?;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    if !status.success() {
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "fuzz target {target} failed ({status}); the input is under {}\n\
             reproduce: KUBE_IPVS_FUZZ_TARGET={target} {} ARTIFACT\n{}",
            artifacts.display(),
            bin.display(),
            tail.join("\n")
        );
    }
    let executions = stat(&text, "stat::number_of_executed_units:").with_context(|| {
        format!(
            "{target}: libFuzzer printed no execution count; see {}",
            log.display()
        )
    })?;
    Ok(Outcome {
        target,
        seconds: started.elapsed().as_secs_f64(),
        executions,
        corpus: std::fs::read_dir(&corpus)?.count(),
    })
}

fn stat(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().parse().ok())
}

/// The per-target figures, as `docs/reliability.md` shows them.
fn table(outcomes: &[Outcome]) -> String {
    let mut out = String::from(
        "| target | seconds | executions | exec/s | corpus | crashes |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for o in outcomes {
        #[allow(
            clippy::cast_precision_loss,
            reason = "execution counts are far below 2^52"
        )]
        let rate = o.executions as f64 / o.seconds.max(0.001);
        out.push_str(&format!(
            "| {} | {:.0} | {} | {:.0} | {} | 0 |\n",
            o.target, o.seconds, o.executions, rate, o.corpus
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_list_is_the_fuzz_crates() {
        let lib = std::fs::read_to_string(util::workspace_root().join("crates/fuzz/src/lib.rs"))
            .expect("crates/fuzz/src/lib.rs");
        let names: Vec<&str> = lib
            .lines()
            .filter_map(|l| l.trim().strip_prefix("name: \""))
            .filter_map(|l| l.strip_suffix("\","))
            .collect();
        assert_eq!(names, TARGETS);
    }
}
