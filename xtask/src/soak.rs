//! `cargo xtask bench soak`: hours of endpoint churn at 10,000 Services, with the agent's
//! resources sampled, and the repair after `ipvsadm -C` at that size.
//!
//! The control plane runs on the host as for `bench e2e` (same driver, `integration/examples/
//! e2e-bench.rs`); one VM runs the driver's `guest` mode with `--flush-repair --soak-seconds`:
//! the agent converges on N Services x 10, the IPVS table is flushed behind its back and the
//! repair timed, then EndpointSlice updates go out at a steady rate, each timed until the kernel
//! serves it, while the agent's RSS, file descriptors, threads and CPU are sampled. This module
//! parses the driver's `SOAK-SAMPLE` lines, prints them as a table and judges growth against
//! the bound below (nonzero exit when it is exceeded).

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::bench_e2e::{self, GuestRun, Shape, fields, number};
use crate::cluster::ControlPlane;
use crate::util;

const USAGE: &str = "usage: cargo xtask bench soak [--minutes 120] [--services 10000] [--rate 5] \
     [--sample-seconds 60] [--mem MIB]";

/// The bound a soak is judged by. After the warm-up (the first tenth of the run, at most 10
/// minutes: the first syncs, the allocator's arenas filling), the RSS floor (the lowest sample
/// of [`FLOOR_WINDOW`] consecutive ones) at the end may not be more than [`RSS_GROWTH`] above
/// the floor right after the warm-up, and file descriptors and threads may not exceed their
/// warm-up maximum by more than [`SLACK`] (a watch reconnecting holds one more socket for a
/// moment).
///
/// The floor, not each sample: a periodic reconcile holds the whole observed kernel table for
/// the seconds it runs (at 10,000 x 10 up to about 30 MiB), so one sample's RSS depends on
/// whether it fell inside one. The first bound, every sample against the end of the warm-up,
/// failed a two-hour run whose floor did not move (`docs/reliability.md`). The highest sample
/// is reported beside it.
const RSS_GROWTH: f64 = 0.10;
const SLACK: u64 = 2;
const WARMUP_MAX: Duration = Duration::from_secs(600);
const FLOOR_WINDOW: usize = 10;

#[derive(Debug, Clone, PartialEq)]
struct Options {
    minutes: u64,
    services: usize,
    rate: f64,
    sample_seconds: u64,
    memory_mib: u32,
}

fn parse_options(args: &[String]) -> Result<Options> {
    let mut o = Options {
        minutes: 120,
        services: 10_000,
        rate: 5.0,
        sample_seconds: 60,
        memory_mib: 4096,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .with_context(|| format!("bench soak: {flag} needs a value; {USAGE}"))?;
        let whole = |v: &str| -> Result<u64> {
            v.trim()
                .parse()
                .with_context(|| format!("bench soak: {flag} {v:?} is not a whole number"))
        };
        match flag.as_str() {
            "--minutes" => o.minutes = whole(value)?,
            "--services" => o.services = whole(value)? as usize,
            "--sample-seconds" => o.sample_seconds = whole(value)?,
            "--mem" => {
                o.memory_mib = u32::try_from(whole(value)?)
                    .with_context(|| format!("bench soak: --mem {value} is too large"))?;
            }
            "--rate" => {
                o.rate = value
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|r| r.is_finite() && *r > 0.0 && *r <= 1000.0)
                    .with_context(|| {
                        format!("bench soak: --rate {value:?}: updates per second, 0 < R <= 1000")
                    })?;
            }
            other => bail!("bench soak: unknown option {other:?}; {USAGE}"),
        }
    }
    if o.minutes == 0 || o.services == 0 || o.sample_seconds == 0 {
        bail!("bench soak: --minutes, --services and --sample-seconds must be positive");
    }
    if o.services > 60_000 {
        bail!("bench soak: more than 60,000 Services do not fit the 10.96.0.0/16 Service CIDR");
    }
    Ok(o)
}

/// One `SOAK-SAMPLE` line of the driver.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    t_s: u64,
    rss_kib: u64,
    fds: u64,
    threads: u64,
    cpu_s: f64,
    updates: u64,
    timeouts: u64,
    /// PATCHes the API server failed (not the agent's doing; reported, not judged).
    errors: u64,
    p50_us: u64,
    p99_us: u64,
    max_us: u64,
}

const SAMPLE_PREFIX: &str = "SOAK-SAMPLE ";

fn parse_sample(line: &str) -> Result<Sample> {
    let f = fields(line, SAMPLE_PREFIX)?;
    Ok(Sample {
        t_s: number(&f, "t_s")?,
        rss_kib: number(&f, "rss_kib")?,
        fds: number(&f, "fds")?,
        threads: number(&f, "threads")?,
        cpu_s: number(&f, "cpu_s")?,
        updates: number(&f, "updates")?,
        timeouts: number(&f, "timeouts")?,
        // (Absent from the first soaks' lines.)
        errors: if f.contains_key("errors") {
            number(&f, "errors")?
        } else {
            0
        },
        p50_us: number(&f, "p50_us")?,
        p99_us: number(&f, "p99_us")?,
        max_us: number(&f, "max_us")?,
    })
}

/// What the samples say against the bound: the summary text and the breaches (empty: passed).
fn judge(samples: &[Sample], run: Duration) -> (String, Vec<String>) {
    let warmup = (run / 10).min(WARMUP_MAX).as_secs();
    let (early, late): (Vec<&Sample>, Vec<&Sample>) = samples.iter().partition(|s| s.t_s <= warmup);
    let mut breaches = Vec::new();
    let window = FLOOR_WINDOW.min(late.len() / 2);
    let (Some(base), Some(last)) = (early.last(), late.last()) else {
        return (
            String::new(),
            vec![format!(
                "too few samples to judge ({} in the {warmup} s warm-up, {} after)",
                early.len(),
                late.len()
            )],
        );
    };
    if window == 0 {
        return (
            String::new(),
            vec![format!(
                "too few samples after the {warmup} s warm-up ({})",
                late.len()
            )],
        );
    }
    let floor = |w: &[&Sample]| w.iter().map(|s| s.rss_kib).min().unwrap_or(0);
    let floor_start = floor(&late[..window]);
    let floor_end = floor(&late[late.len() - window..]);
    let rss_limit = floor_start + (floor_start as f64 * RSS_GROWTH) as u64;
    if floor_end > rss_limit {
        breaches.push(format!(
            "the RSS floor of the last {window} samples, {floor_end} KiB, is above the bound \
             {rss_limit} KiB (floor after the warm-up {floor_start} KiB)"
        ));
    }
    let fds_limit = early.iter().map(|s| s.fds).max().unwrap_or(0) + SLACK;
    let threads_limit = early.iter().map(|s| s.threads).max().unwrap_or(0) + SLACK;
    for s in &late {
        if s.fds > fds_limit {
            breaches.push(format!(
                "{} file descriptors at {} s, bound {fds_limit}",
                s.fds, s.t_s
            ));
        }
        if s.threads > threads_limit {
            breaches.push(format!(
                "{} threads at {} s, bound {threads_limit}",
                s.threads, s.t_s
            ));
        }
    }
    let rss_max = late.iter().map(|s| s.rss_kib).max().unwrap_or(0);
    let updates: u64 = samples.iter().map(|s| s.updates).sum();
    let timeouts: u64 = samples.iter().map(|s| s.timeouts).sum();
    let errors: u64 = samples.iter().map(|s| s.errors).sum();
    let worst_p99 = late.iter().map(|s| s.p99_us).max().unwrap_or(0);
    let worst_max = samples.iter().map(|s| s.max_us).max().unwrap_or(0);
    let mib = |k: u64| k as f64 / 1024.0;
    let summary = format!(
        "after a {warmup} s warm-up: RSS floor (lowest of {window} samples) {:.1} -> {:.1} MiB \
         (bound {:.1}, growth {:+.1}%), highest sample {:.1} MiB; fds {} -> {} (bound {fds_limit}); \
         threads {} -> {} (bound {threads_limit}); {updates} updates, {timeouts} not in the kernel \
         within 180 s, {errors} refused by the API server; worst per-sample p99 {:.1} ms, max {:.1} ms; agent CPU {:.1} s",
        mib(floor_start),
        mib(floor_end),
        mib(rss_limit),
        (floor_end as f64 / floor_start.max(1) as f64 - 1.0) * 100.0,
        mib(rss_max),
        base.fds,
        last.fds,
        base.threads,
        last.threads,
        worst_p99 as f64 / 1000.0,
        worst_max as f64 / 1000.0,
        last.cpu_s,
    );
    if timeouts > 0 {
        breaches.push(format!(
            "{timeouts} updates never reached the kernel within 180 s"
        ));
    }
    (summary, breaches)
}

fn table(samples: &[Sample]) -> String {
    let mut out = String::from(
        "| minutes | RSS MiB | fds | threads | CPU s | updates | update p50 ms | p99 ms | max ms |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in samples {
        let _ = writeln!(
            out,
            "| {:.1} | {:.1} | {} | {} | {:.1} | {} | {:.1} | {:.1} | {:.1} |",
            s.t_s as f64 / 60.0,
            s.rss_kib as f64 / 1024.0,
            s.fds,
            s.threads,
            s.cpu_s,
            s.updates,
            s.p50_us as f64 / 1000.0,
            s.p99_us as f64 / 1000.0,
            s.max_us as f64 / 1000.0,
        );
    }
    out
}

/// The samples among console `lines`, their table, and the verdict (an error on a breach).
fn report(lines: &[String], run: Duration) -> Result<()> {
    // A line the console garbled is skipped and counted, not the end of hours of soak.
    let mut garbled = 0;
    let samples: Vec<Sample> = lines
        .iter()
        .filter_map(|l| l.find(SAMPLE_PREFIX).map(|at| &l[at..]))
        .filter_map(|l| match parse_sample(l) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("bench soak: skipping a sample line: {e:#}");
                garbled += 1;
                None
            }
        })
        .collect();
    let (summary, breaches) = judge(&samples, run);
    println!(
        "{}\n{summary}; {garbled} sample lines unreadable",
        table(&samples)
    );
    if !breaches.is_empty() {
        bail!(
            "bench soak: the bound was exceeded:\n{}",
            breaches.join("\n")
        );
    }
    Ok(())
}

pub(crate) fn command(args: &[String]) -> Result<()> {
    // `--judge LOG`: the verdict on a finished soak's console output, again.
    if let [flag, path] = args
        && flag == "--judge"
    {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("bench soak: reading {path}"))?;
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        let last = lines
            .iter()
            .filter_map(|l| l.find(SAMPLE_PREFIX).map(|at| &l[at..]))
            .filter_map(|l| parse_sample(l).ok())
            .map(|s| s.t_s)
            .max()
            .with_context(|| format!("bench soak: {path} has no {SAMPLE_PREFIX}lines"))?;
        return report(&lines, Duration::from_secs(last));
    }
    let opts = parse_options(args)?;
    let tools = match crate::tools::ensure()? {
        Ok(t) => t,
        Err(crate::tools::Unavailable(why)) => bail!("bench soak: {why}"),
    };
    let driver = bench_e2e::release_build(
        bench_e2e::DRIVER_PACKAGE,
        &["--example", bench_e2e::DRIVER],
        bench_e2e::DRIVER,
    )?;
    let daemon = bench_e2e::release_build("kube-ipvs", &["--bin", "kube-ipvs"], "kube-ipvs")?;
    let work = util::target_dir()?.join(format!("bench-soak/{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let plane = ControlPlane::start(&tools, &work.join("control-plane"))?;
    plane.apply_rbac()?;
    let list = bench_e2e::populate(&driver, &plane, opts.services, Shape::LOCAL, &work)?;
    let run = Duration::from_secs(opts.minutes * 60);
    let converge_timeout = 600 + opts.services as u64 / 4;
    let extra: Vec<String> = vec![
        "--converge-timeout".into(),
        converge_timeout.to_string(),
        "--flush-repair".into(),
        "--soak-seconds".into(),
        run.as_secs().to_string(),
        "--churn-rate".into(),
        opts.rate.to_string(),
        "--sample-seconds".into(),
        opts.sample_seconds.to_string(),
    ];
    let guest = GuestRun {
        plane: &plane,
        driver: &driver,
        agent_binary: &daemon,
        agent: "kube-ipvs",
        list: &list,
        memory_mib: opts.memory_mib,
        tap: None,
    };
    // Converging and the repair (each within the timeout), settling, the soak, boot.
    let timeout = Duration::from_secs(2 * converge_timeout + 600 + run.as_secs() + 600);
    let lines = guest.run(
        &format!("bench soak {} Services", opts.services),
        &extra,
        timeout,
    )?;
    let repair = fields(
        bench_e2e::result_line(&lines, "E2E-REPAIR ")?,
        "E2E-REPAIR ",
    )?;
    let converged = fields(
        bench_e2e::result_line(&lines, "E2E-RESULT ")?,
        "E2E-RESULT ",
    )?;
    println!(
        "\nbench soak: kube-ipvs, {} Services x 10, {:.1} updates/s for {} min (TCG guest, 2 vCPUs)\n\
         converged from empty in {:.2} s; after `ipvsadm -C`: first virtual server back in {:.2} s, \
         every Service serving (a real server each) in {:.2} s, every Service whole again in \
         {:.2} s (+{:.2} s)",
        opts.services,
        opts.rate,
        opts.minutes,
        number::<f64>(&converged, "converge_ms")? / 1000.0,
        number::<f64>(&repair, "noticed_ms")? / 1000.0,
        number::<f64>(&repair, "serving_ms")? / 1000.0,
        number::<f64>(&repair, "repaired_ms")? / 1000.0,
        number::<f64>(&repair, "repaired_err_ms")? / 1000.0,
    );
    report(&lines, run)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: u64, rss_kib: u64, fds: u64, threads: u64) -> Sample {
        Sample {
            t_s,
            rss_kib,
            fds,
            threads,
            cpu_s: 1.0,
            updates: 300,
            timeouts: 0,
            errors: 0,
            p50_us: 9000,
            p99_us: 20000,
            max_us: 30000,
        }
    }

    #[test]
    fn a_sample_line_parses_after_console_noise() -> Result<()> {
        let line = "[ 12.3] SOAK-SAMPLE t_s=60 rss_kib=51200 fds=14 threads=9 cpu_s=3.50 \
                    updates=299 timeouts=0 p50_us=8000 p99_us=21000 max_us=40000";
        let at = line.find(SAMPLE_PREFIX).context("prefix")?;
        let s = parse_sample(&line[at..])?;
        assert_eq!((s.t_s, s.rss_kib, s.fds, s.threads), (60, 51200, 14, 9));
        assert_eq!((s.updates, s.p99_us, s.max_us), (299, 21000, 40000));
        let err = parse_sample(&line[at..].replace(" fds=14", ""))
            .err()
            .context("a missing field parsed")?;
        assert!(format!("{err:#}").contains("fds"), "{err:#}");
        Ok(())
    }

    #[test]
    fn a_steady_floor_passes_with_reconcile_peaks_and_a_rising_one_is_named() {
        let run = Duration::from_secs(7200);
        // Warm-up is 600 s. Every third sample falls inside a reconcile, 30 MiB higher.
        let mut steady: Vec<Sample> = (0..=120)
            .map(|m| {
                let peak = if m % 3 == 0 { 30_000 } else { 0 };
                sample(m * 60, 130_000 + peak, 21, 5)
            })
            .collect();
        let (summary, breaches) = judge(&steady, run);
        assert!(breaches.is_empty(), "{breaches:?}");
        assert!(summary.contains("growth +0.0%"), "{summary}");
        assert!(summary.contains("highest sample 156.2 MiB"), "{summary}");

        // The floor of the last ten samples 11% up, and a file descriptor leaked past the slack.
        for s in steady.iter_mut().rev().take(10) {
            s.rss_kib = s.rss_kib.max(130_000 * 111 / 100);
        }
        if let Some(last) = steady.last_mut() {
            last.fds = 24;
        }
        let (_, breaches) = judge(&steady, run);
        assert_eq!(breaches.len(), 2, "{breaches:?}");
        assert!(breaches[0].contains("RSS floor"), "{breaches:?}");
        assert!(breaches[1].contains("file descriptors"), "{breaches:?}");

        // An update that never reached the kernel fails the soak too.
        let mut lost = (0..=120)
            .map(|m| sample(m * 60, 50_000, 14, 9))
            .collect::<Vec<_>>();
        lost[50].timeouts = 1;
        assert_eq!(judge(&lost, run).1.len(), 1);
        // No sample after the warm-up: nothing to judge, which is a failure.
        assert!(!judge(&steady[..5], run).1.is_empty());
    }

    #[test]
    fn options_default_to_two_hours_at_ten_thousand() -> Result<()> {
        let o = parse_options(&[])?;
        assert_eq!((o.minutes, o.services), (120, 10_000));
        let args = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        assert!(parse_options(&args("--rate 0")).is_err());
        assert!(parse_options(&args("--minutes")).is_err());
        assert!(parse_options(&args("--services 70000")).is_err());
        Ok(())
    }
}
