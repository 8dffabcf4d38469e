//! `cargo xtask ci`: every check CI runs, in order, timed. `.ci/run` calls this.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::util::{self, secs};
use crate::vmtest;

/// How long CI fuzzes each target.
const FUZZ_SECONDS: u64 = 15;

pub(crate) fn command(args: &[String]) -> Result<()> {
    let mut vm = true;
    for arg in args {
        match arg.as_str() {
            "--no-vm" => vm = false,
            other => bail!("ci: unknown argument {other:?}; usage: cargo xtask ci [--no-vm]"),
        }
    }
    let mut timings: Vec<(String, Duration)> = Vec::new();
    let result = steps(vm, &mut timings);
    println!();
    println!("---- ci timings ----");
    for (step, took) in &timings {
        println!("{:>8}  {step}", secs(*took));
    }
    let total: Duration = timings.iter().map(|(_, t)| *t).sum();
    println!("{:>8}  total", secs(total));
    result
}

fn timed(
    timings: &mut Vec<(String, Duration)>,
    name: &str,
    f: impl FnOnce() -> Result<()>,
) -> Result<()> {
    eprintln!("xtask ci: {name}");
    let started = Instant::now();
    let result = f();
    let status = if result.is_ok() { "" } else { " (FAILED)" };
    timings.push((format!("{name}{status}"), started.elapsed()));
    result
}

fn timed_value<T>(
    timings: &mut Vec<(String, Duration)>,
    name: &str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let mut value = None;
    timed(timings, name, || {
        value = Some(f()?);
        Ok(())
    })?;
    value.ok_or_else(|| anyhow::anyhow!("{name} produced nothing"))
}

fn cargo(args: &[&str]) -> Result<()> {
    util::run(util::cargo_cmd().args(args))
}

fn steps(vm: bool, timings: &mut Vec<(String, Duration)>) -> Result<()> {
    timed(timings, "cargo fmt --all -- --check", || {
        cargo(&["fmt", "--all", "--", "--check"])
    })?;
    // One clippy run with every package's `kernel-tests` feature on: the kernel tests only
    // compile with it, and the feature adds nothing else (it only gates `tests/kernel*.rs`), so
    // this run lints everything the runs without it would, VM-only code included, in one build.
    let features: Vec<String> = vmtest::discover()?
        .iter()
        .map(|pkg| format!("{}/kernel-tests", pkg.name))
        .collect();
    let features = features.join(",");
    timed(
        timings,
        &format!("cargo clippy --workspace --all-targets --features {features} -- -D warnings"),
        || {
            cargo(&[
                "clippy",
                "--workspace",
                "--all-targets",
                "--features",
                &features,
                "--",
                "-D",
                "warnings",
            ])
        },
    )?;
    timed(timings, "cargo test --workspace", || {
        cargo(&["test", "--workspace"])
    })?;
    // The real Kubernetes programs (issue 9): built once per machine from the Go module proxy,
    // then the shipped manifests go through a real API server's validation and admission. Without
    // Go both are skipped with the reason printed, and vm-test skips its kernel_apiserver tests
    // the same way.
    match timed_value(timings, "cargo xtask tools", crate::tools::ensure)? {
        Ok(_) => timed(timings, "cargo xtask deploy-check", || {
            crate::cluster::command(&[])
        })?,
        Err(crate::tools::Unavailable(why)) => {
            println!("SKIPPED cargo xtask deploy-check and the kernel_apiserver tests: {why}");
        }
    }
    // Every parser of outside input under libFuzzer for a short fixed time (issue 18); the
    // corpora are not kept between CI runs, so each starts from the committed seeds.
    timed(
        timings,
        &format!("cargo xtask fuzz --seconds {FUZZ_SECONDS}"),
        || crate::fuzz::command(&["--seconds".to_owned(), FUZZ_SECONDS.to_string()]),
    )?;
    // The lab's Go programs (several minutes on a cold machine) build at nice 19 beside the
    // kernel tests, which spend much of their time waiting on their guests' timers.
    let lab = match (vm, crate::tools::go(), crate::lab::unavailable()) {
        (false, _, _) => Lab::Off,
        (true, None, _) => Lab::Skipped("no Go toolchain".into()),
        (true, _, Some(why)) => Lab::Skipped(why),
        (true, Some(_), None) => Lab::Building(std::thread::spawn(|| {
            util::in_background(crate::lab::prebuild)
        })),
    };
    // The image's release build goes beside the kernel tests too, at nice 19 like the lab's:
    // the guests leave a CPU idle much of the time, and the image step below then finds the
    // binary built.
    let release =
        vm.then(|| std::thread::spawn(|| util::in_background(crate::image::build_release)));
    if vm {
        timed(timings, "cargo xtask vm-test", || vmtest::command(&[]))?;
    }
    if let Some(build) = release {
        timed(
            timings,
            "the image's release build (beside vm-test; the rest of the wait)",
            || {
                build
                    .join()
                    .map_err(|_| anyhow::anyhow!("the release build's thread panicked"))?
            },
        )?;
    }
    // The container image: built from Debian's packages without a Docker engine, unpacked, and
    // its binary run in a chroot (issue 8's proof that the archive is usable).
    timed(timings, "cargo xtask image --check", || {
        crate::image::command(&["--check".to_owned()])
    })?;
    // The upstream e2e suite's smoke subset on a real two-node cluster with the image above as
    // its service proxy (issue 15); the whole `[sig-network]` focus is `cargo xtask
    // conformance`. Its result prints as `N passed, N failed, N skipped`.
    match lab {
        Lab::Off => {}
        Lab::Skipped(why) => println!("SKIPPED cargo xtask conformance --smoke: {why}"),
        Lab::Building(build) => {
            timed(
                timings,
                "the lab's programs (built beside vm-test; the rest of the wait)",
                || {
                    build
                        .join()
                        .map_err(|_| anyhow::anyhow!("the lab's build thread panicked"))?
                },
            )?;
            timed(timings, "cargo xtask conformance --smoke", || {
                crate::lab::conformance_command(&["--smoke".to_owned()])
            })?;
        }
    }
    Ok(())
}

/// The conformance smoke run's state through `ci`.
enum Lab {
    /// `--no-vm`.
    Off,
    /// Cannot run here, and why.
    Skipped(String),
    /// Its programs are being built.
    Building(std::thread::JoinHandle<Result<()>>),
}
