//! `cargo xtask conformance`: the upstream end-to-end suite (`e2e.test` of the pinned release)
//! against the lab cluster (`lab.rs`), with kube-ipvs as its service proxy.
//!
//! The suite runs in the lab's network namespace with `--provider=local`, the focus given (by
//! default `[sig-network]`) and the committed skip list (`integration/lab/skip.txt`, every
//! entry with its reason). Its JUnit report is read back into a table of the tests that ran,
//! with their result and time, written beside the report and summed up as
//! `N passed, N failed, N skipped`.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use quick_xml::events::Event;
use quick_xml::{Reader, XmlVersion};

use crate::util::{self, secs};

/// The smoke subset `cargo xtask ci` runs: one test of each thing a service proxy does first.
pub(crate) const SMOKE: &[&str] = &[
    "Services should serve a basic endpoint from pods",
    "Services should serve multiport endpoints from pods",
    "Services should be able to create a functioning NodePort service",
    "Services should have session affinity work for service with type clusterIP",
    "Services should serve endpoints on same port and different protocols",
    "Services should allow pods to hairpin back to themselves through services",
];

/// The default focus: the whole network SIG.
pub(crate) const DEFAULT_FOCUS: &str = r"\[sig-network\]";

/// The committed skip list.
const SKIP_LIST: &str = "integration/lab/skip.txt";

/// A test's result.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    Passed,
    Failed(String),
    /// Skipped by the test itself while it ran (e.g. "requires at least 3 nodes").
    Skipped(String),
}

/// One test that the focus selected.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Case {
    pub(crate) name: String,
    pub(crate) outcome: Outcome,
    pub(crate) seconds: f64,
}

/// The regular expression matching the `[sig-network]` tests named `names` (a test's full
/// name contains one of them; other SIGs' tests of the same words, such as `[sig-windows]`'s
/// NodePort test, are left out).
pub(crate) fn focus_of<S: AsRef<str>>(names: &[S]) -> String {
    let escaped: Vec<String> = names.iter().map(|n| regex_escape(n.as_ref())).collect();
    format!(r"\[sig-network\] (?:{})", escaped.join("|"))
}

fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Reads `integration/lab/skip.txt`: one regular expression per line, then ` # ` and the
/// reason; a line without a reason is an error (every skip must say why).
pub(crate) fn parse_skip_list(text: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((pattern, reason)) = line.split_once(" # ") else {
            bail!("{SKIP_LIST}:{}: no ` # reason` after the pattern", i + 1);
        };
        let (pattern, reason) = (pattern.trim(), reason.trim());
        if pattern.is_empty() || reason.is_empty() {
            bail!("{SKIP_LIST}:{}: empty pattern or reason", i + 1);
        }
        out.push((pattern.to_owned(), reason.to_owned()));
    }
    Ok(out)
}

/// The committed skip list as one `--ginkgo.skip` expression.
fn skip_expression() -> Result<String> {
    let path = util::workspace_root().join(SKIP_LIST);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let entries = parse_skip_list(&text)?;
    Ok(entries
        .iter()
        .map(|(p, _)| format!("(?:{p})"))
        .collect::<Vec<_>>()
        .join("|"))
}

fn attribute(e: &quick_xml::events::BytesStart<'_>, name: &str) -> Result<Option<String>> {
    for attr in e.attributes() {
        let attr = attr?;
        if attr.key.as_ref() == name {
            return Ok(Some(
                attr.normalized_value(XmlVersion::Explicit1_0)?.into_owned(),
            ));
        }
    }
    Ok(None)
}

/// The `[It]` test cases of a Ginkgo JUnit report that the focus selected: a case the filters
/// left out is reported `skipped` with the bare message "skipped" and no time, and is dropped.
pub(crate) fn parse_junit(xml: &str) -> Result<Vec<Case>> {
    let mut reader = Reader::from_str(xml);
    let mut cases = Vec::new();
    // The case being read: name, status, seconds, and the failure or skip message.
    let mut current: Option<(String, String, f64, String)> = None;
    let mut in_message = false;
    loop {
        match reader.read_event()? {
            Event::Start(e) | Event::Empty(e) if e.name().as_ref() == "testcase" => {
                let name = attribute(&e, "name")?.unwrap_or_default();
                let status = attribute(&e, "status")?.unwrap_or_default();
                let seconds = attribute(&e, "time")?
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(0.0);
                current = Some((name, status, seconds, String::new()));
            }
            Event::Start(e) | Event::Empty(e)
                if matches!(e.name().as_ref(), "failure" | "skipped") =>
            {
                if let Some(case) = current.as_mut() {
                    case.3 = attribute(&e, "message")?.unwrap_or_default();
                    in_message = e.name().as_ref() == "failure";
                }
            }
            // The message's first line: the text up to its first entity reference (`&#xA;`,
            // which quick-xml reports as an event of its own).
            Event::Text(t) if in_message => {
                if let Some(case) = current.as_mut() {
                    let text = t.xml10_content();
                    if case.3.is_empty() {
                        case.3 = text.lines().next().unwrap_or_default().to_owned();
                    }
                }
            }
            Event::End(e) if e.name().as_ref() == "failure" => in_message = false,
            Event::End(e) if e.name().as_ref() == "testcase" => {
                if let Some((name, status, seconds, message)) = current.take() {
                    // Suite-level nodes (`[SynchronizedBeforeSuite]`, `[ReportAfterSuite] ...`)
                    // count only when they fail: then every test's result is in doubt.
                    let name = match name.strip_prefix("[It] ") {
                        Some(test) => test.to_owned(),
                        None if status == "failed" => name,
                        None => continue,
                    };
                    let outcome = match status.as_str() {
                        "passed" => Outcome::Passed,
                        "skipped" if message == "skipped" && seconds == 0.0 => continue,
                        "skipped" => Outcome::Skipped(message),
                        _ => Outcome::Failed(message),
                    };
                    cases.push(Case {
                        name,
                        outcome,
                        seconds,
                    });
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    cases.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(cases)
}

/// `N passed, N failed, N skipped`.
pub(crate) fn summary(cases: &[Case]) -> String {
    let count = |f: fn(&Outcome) -> bool| cases.iter().filter(|c| f(&c.outcome)).count();
    format!(
        "{} passed, {} failed, {} skipped",
        count(|o| *o == Outcome::Passed),
        count(|o| matches!(o, Outcome::Failed(_))),
        count(|o| matches!(o, Outcome::Skipped(_))),
    )
}

/// A Markdown table of the cases.
pub(crate) fn table(cases: &[Case]) -> String {
    let mut out = String::from("| test | result | seconds |\n|---|---|---:|\n");
    for case in cases {
        let result = match &case.outcome {
            Outcome::Passed => "pass".to_owned(),
            Outcome::Failed(m) => format!("**fail**: {}", m.replace('|', "\\|")),
            Outcome::Skipped(m) => format!("skipped: {}", m.replace('|', "\\|")),
        };
        let _ = writeln!(
            out,
            "| {} | {result} | {:.1} |",
            case.name.replace('|', "\\|"),
            case.seconds
        );
    }
    out
}

/// What to run.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub(crate) focus: String,
    pub(crate) skip: Option<String>,
    /// The suite's time box in seconds (ginkgo's `--timeout`: when it runs out, the test
    /// running is interrupted, the rest are not started, and the report is still written).
    pub(crate) timeout_secs: u64,
}

/// The time box when none is given: a day, as long as any whole run could take.
pub(crate) const DEFAULT_TIMEOUT_SECS: u64 = 24 * 3600;

/// `e2e.test` with what every run of it here shares: the local provider, the run's focus,
/// and the committed skip list with the run's own `--skip`.
fn e2e_command(e2e: &Path, run: &Run) -> Result<Command> {
    let mut skip = skip_expression()?;
    if let Some(extra) = &run.skip {
        skip = if skip.is_empty() {
            extra.clone()
        } else {
            format!("{skip}|{extra}")
        };
    }
    let mut cmd = Command::new(e2e);
    cmd.arg("--provider=local")
        .arg(format!("--ginkgo.focus={}", run.focus))
        .arg("--ginkgo.no-color");
    if !skip.is_empty() {
        cmd.arg(format!("--ginkgo.skip={skip}"));
    }
    Ok(cmd)
}

/// One part of a focus too long for one sitting: the `index`-th (from 1) of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shard {
    pub(crate) index: usize,
    pub(crate) count: usize,
}

impl std::str::FromStr for Shard {
    type Err = anyhow::Error;

    /// `I/N`, `1 <= I <= N`.
    fn from_str(text: &str) -> Result<Shard> {
        let (i, n) = text
            .split_once('/')
            .with_context(|| format!("--shard {text:?}: want I/N, e.g. 2/4"))?;
        let index: usize = i
            .parse()
            .with_context(|| format!("--shard {text:?}: {i:?} is not a number"))?;
        let count: usize = n
            .parse()
            .with_context(|| format!("--shard {text:?}: {n:?} is not a number"))?;
        if count == 0 || index == 0 || index > count {
            bail!("--shard {text:?}: want 1 <= I <= N");
        }
        Ok(Shard { index, count })
    }
}

/// A selected test's name (as `parse_junit` gives it) as a focus can match it: without the
/// `[sig-network] ` it starts with (`focus_of` puts that back) and the label list Ginkgo
/// appends (`[sig-network, Conformance]`), which is not part of the text a focus matches.
pub(crate) fn spec_name(name: &str) -> &str {
    let name = name.strip_prefix("[sig-network] ").unwrap_or(name);
    match name.rfind(" [sig-") {
        Some(at) if name.ends_with(']') => &name[..at],
        _ => name,
    }
}

/// The shard's tests out of every selected one: sorted by name, then dealt out in turn, so
/// the slow groups (session affinity timeouts, DNS) spread over the shards. The same
/// `e2e.test` and skip list always deal the same shards.
pub(crate) fn shard_of(names: &[String], shard: Shard) -> Vec<String> {
    let mut sorted = names.to_vec();
    sorted.sort();
    sorted
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % shard.count == shard.index - 1)
        .map(|(_, n)| n)
        .collect()
}

/// The tests `run` selects, by name (`spec_name`): `e2e.test --ginkgo.dry-run` with the run's
/// focus and skip, read from the JUnit report it writes. Needs no cluster.
pub(crate) fn selected(e2e: &Path, run: &Run) -> Result<Vec<String>> {
    let dir = util::target_dir()?.join("lab/dry-run");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let junit = dir.join("junit.xml");
    let status = e2e_command(e2e, run)?
        .arg("--kubeconfig=/dev/null")
        .arg("--ginkgo.dry-run")
        .arg(format!("--ginkgo.junit-report={}", junit.display()))
        .stdout(fs::File::create(dir.join("e2e.log"))?)
        .stderr(std::process::Stdio::null())
        .status()
        .context("starting e2e.test --ginkgo.dry-run")?;
    if !status.success() {
        bail!(
            "e2e.test --ginkgo.dry-run failed ({status}); see {}",
            dir.join("e2e.log").display()
        );
    }
    let xml = fs::read_to_string(&junit)
        .with_context(|| format!("e2e.test --ginkgo.dry-run wrote no {}", junit.display()))?;
    // A dry run reports what it would run as passed and what the filters left out as skipped.
    Ok(parse_junit(&xml)?
        .into_iter()
        .filter(|c| c.outcome == Outcome::Passed && c.name.starts_with("[sig-network] "))
        .map(|c| spec_name(&c.name).to_owned())
        .collect())
}

/// Runs `e2e.test` (already inside the lab's namespace, the cluster up) and reads its report.
pub(crate) fn run_suite(
    e2e: &Path,
    kubectl: &Path,
    kubeconfig: &Path,
    run: &Run,
    report_dir: &Path,
) -> Result<Vec<Case>> {
    let _ = fs::remove_dir_all(report_dir);
    fs::create_dir_all(report_dir)?;
    let log = report_dir.join("e2e.log");
    let started = Instant::now();
    let mut cmd = e2e_command(e2e, run)?;
    cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--kubectl-path={}", kubectl.display()))
        .arg(format!("--report-dir={}", report_dir.display()))
        .arg(format!("--ginkgo.timeout={}s", run.timeout_secs))
        .stdout(fs::File::create(&log)?)
        .stderr(fs::File::create(report_dir.join("e2e.stderr"))?);
    eprintln!(
        "xtask: running e2e.test --ginkgo.focus={:?} (log: {})",
        run.focus,
        log.display()
    );
    let mut child = cmd.spawn().context("starting e2e.test")?;
    let _registered = crate::reaper::register(child.id());
    let status = child.wait()?;
    let junit = report_dir.join("junit_01.xml");
    let xml = fs::read_to_string(&junit).with_context(|| {
        format!(
            "e2e.test ({status}) wrote no {}; see {}",
            junit.display(),
            log.display()
        )
    })?;
    let cases = parse_junit(&xml)?;
    fs::write(report_dir.join("results.md"), table(&cases))?;
    let failed = cases
        .iter()
        .any(|c| matches!(c.outcome, Outcome::Failed(_)));
    if !status.success() && !failed {
        bail!(
            "e2e.test failed ({status}) but its report names no failed test; see {}",
            log.display()
        );
    }
    eprintln!(
        "xtask: e2e.test finished in {} ({status})",
        secs(started.elapsed())
    );
    Ok(cases)
}

/// Where a run's report goes: `<target>/lab/conformance/`.
pub(crate) fn report_dir() -> Result<PathBuf> {
    Ok(util::target_dir()?.join("lab/conformance"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="4">
  <testsuite name="Kubernetes e2e suite" tests="4">
    <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="1.5"></testcase>
    <testcase name="[ReportAfterSuite] Log Check" classname="Kubernetes e2e suite" status="failed" time="0.5">
      <failure message="" type="failed">[FAILED] a component logged an error</failure>
    </testcase>
    <testcase name="[It] [sig-network] Services should serve a basic endpoint from pods [Conformance]" classname="Kubernetes e2e suite" status="failed" time="133.8">
      <failure message="" type="failed">[FAILED] service is not reachable within 2m0s timeout on endpoint endpoint-test2:80 over TCP protocol&#xA;In [It] at: service.go:769</failure>
      <system-err>lots of &gt; log</system-err>
    </testcase>
    <testcase name="[It] [sig-network] Services should be rejected when no endpoints exist" classname="Kubernetes e2e suite" status="passed" time="12.25"></testcase>
    <testcase name="[It] [sig-network] Services should work with the LoadBalancer" classname="Kubernetes e2e suite" status="skipped" time="0">
      <skipped message="skipped"></skipped>
    </testcase>
    <testcase name="[It] [sig-network] Services should handle three zones" classname="Kubernetes e2e suite" status="skipped" time="0.4">
      <skipped message="skipped - requires at least 3 nodes"></skipped>
    </testcase>
  </testsuite>
</testsuites>"#;

    #[test]
    fn junit_keeps_the_tests_that_ran_with_their_results() -> Result<()> {
        let cases = parse_junit(REPORT)?;
        let names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "[ReportAfterSuite] Log Check",
                "[sig-network] Services should be rejected when no endpoints exist",
                "[sig-network] Services should handle three zones",
                "[sig-network] Services should serve a basic endpoint from pods [Conformance]",
            ]
        );
        assert!(matches!(&cases[0].outcome, Outcome::Failed(m) if m.contains("logged an error")));
        assert_eq!(cases[1].outcome, Outcome::Passed);
        assert!((cases[1].seconds - 12.25).abs() < 1e-9);
        assert_eq!(
            cases[2].outcome,
            Outcome::Skipped("skipped - requires at least 3 nodes".into())
        );
        assert!(matches!(&cases[3].outcome,
            Outcome::Failed(m) if m.starts_with("[FAILED] service is not reachable") && !m.contains("In [It]")));
        assert_eq!(summary(&cases), "1 passed, 2 failed, 1 skipped");
        assert!(table(&cases).contains("| **fail**: [FAILED] service is not reachable"));
        Ok(())
    }

    #[test]
    fn the_smoke_focus_matches_each_name_literally() {
        let focus = focus_of(SMOKE);
        assert!(focus.starts_with(r"\[sig-network\] (?:Services should serve a basic"));
        assert_eq!(focus.split('|').count(), SMOKE.len());
        assert!(focus.contains("type clusterIP"));
        assert_eq!(regex_escape("a [b] (c)."), r"a \[b\] \(c\)\.");
    }

    #[test]
    fn spec_names_lose_the_sig_and_the_labels() {
        assert_eq!(
            spec_name(
                "[sig-network] API Server should provide secure master service [Conformance] [sig-network, Conformance]"
            ),
            "API Server should provide secure master service [Conformance]"
        );
        assert_eq!(
            spec_name(
                "[sig-network] Connectivity Pod Lifecycle should be able to connect [sig-network]"
            ),
            "Connectivity Pod Lifecycle should be able to connect"
        );
        // No label list: nothing is cut.
        assert_eq!(
            spec_name("[sig-network] DNS should provide DNS for the cluster [Provider:gce]"),
            "DNS should provide DNS for the cluster [Provider:gce]"
        );
    }

    #[test]
    fn shards_deal_every_test_to_exactly_one() -> Result<()> {
        let names: Vec<String> = (0..10).rev().map(|i| format!("test {i}")).collect();
        let count = 3;
        let mut all = Vec::new();
        for index in 1..=count {
            let shard = shard_of(&names, Shard { index, count });
            // Dealt in turn: sizes differ by at most one.
            assert!((3..=4).contains(&shard.len()), "{shard:?}");
            all.extend(shard);
        }
        all.sort();
        let mut want = names.clone();
        want.sort();
        assert_eq!(all, want);
        assert_eq!(
            shard_of(&names, "2/3".parse()?),
            ["test 1", "test 4", "test 7"]
        );
        for bad in ["0/3", "4/3", "1/0", "3", "a/3", "1/b"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
        Ok(())
    }

    #[test]
    fn skip_entries_need_a_reason() -> Result<()> {
        let ok = parse_skip_list("# comment\n\nLoadBalancer # no cloud provider in the lab\n")?;
        assert_eq!(
            ok,
            [(
                "LoadBalancer".to_owned(),
                "no cloud provider in the lab".to_owned()
            )]
        );
        assert!(parse_skip_list("LoadBalancer\n").is_err());
        let committed = fs::read_to_string(util::workspace_root().join(SKIP_LIST))?;
        assert!(!parse_skip_list(&committed)?.is_empty());
        Ok(())
    }
}
