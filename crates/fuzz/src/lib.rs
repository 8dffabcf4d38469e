//! Fuzz targets for every parser of outside input kube-ipvs has: the kernel's netlink replies
//! (IPVS, rtnetlink addresses, ipset, conntrack), `dump`'s ipvsadm-style command line, the
//! `KubeProxyConfiguration` file, manifests, and arbitrary Service / EndpointSlice / Node objects
//! through translation and the diff engine.
//!
//! Each target takes arbitrary bytes and checks what must hold for any input: no panic, and the
//! target's invariants (see each function). `cargo xtask fuzz [TARGET] [--seconds N]` runs them
//! under libFuzzer (the `libfuzzer` feature builds that binary); `tests/corpus.rs` runs every
//! committed seed and every regression (`regressions/<target>/`, one file per crash the fuzzer
//! found) through its target in the ordinary test suite, so a fixed crash stays fixed.

mod objects;
mod pipeline;

use std::path::Path;

use clap::Parser;
use kube_ipvs::agent::config::{RunArgs, Settings};
use kube_ipvs::cmd::dump::DumpArgs;
use kube_ipvs_netlink::fuzzing as nl;

/// One fuzz target.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// Its name: the corpus directory, and `KUBE_IPVS_FUZZ_TARGET` of the libFuzzer binary.
    pub name: &'static str,
    /// What it feeds the input to.
    pub run: fn(&[u8]),
}

/// Every target, in the order `cargo xtask fuzz` runs them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "ipvs_reply",
        run: nl::ipvs_reply,
    },
    Target {
        name: "address_events",
        run: nl::address_events,
    },
    Target {
        name: "ipset_list",
        run: nl::ipset_list,
    },
    Target {
        name: "conntrack_dump",
        run: nl::conntrack_dump,
    },
    Target {
        name: "dump_args",
        run: dump_args,
    },
    Target {
        name: "proxy_config",
        run: proxy_config,
    },
    Target {
        name: "manifest",
        run: manifest,
    },
    Target {
        name: "objects",
        run: objects::run,
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().copied().find(|t| t.name == name)
}

/// Every target's name.
pub fn names() -> Vec<&'static str> {
    TARGETS.iter().map(|t| t.name).collect()
}

#[derive(Debug, Parser)]
#[command(name = "dump", no_binary_name = true)]
struct DumpCli {
    #[command(flatten)]
    args: DumpArgs,
}

/// `kube-ipvs dump`'s command line (the input split at whitespace): the ipvsadm-style service
/// selectors and column flags, rendered against a small table. A selector that parses names a
/// service that `render` either prints or reports missing, never a panic.
pub fn dump_args(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cli) = DumpCli::try_parse_from(text.split_whitespace()) else {
        return;
    };
    let table = pipeline::dump_table();
    match kube_ipvs::cmd::dump::render(&table, &cli.args) {
        Ok(out) => assert!(
            cli.args.selector().is_ok(),
            "rendered with a bad selector: {out}"
        ),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// A `KubeProxyConfiguration` file: parsed and merged with an empty command line. Either the
/// settings resolve or the error names the file or the setting.
pub fn proxy_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("config.conf");
    let args = RunArgs {
        hostname_override: Some("node-a".to_owned()),
        ..RunArgs::default()
    };
    if let Err(e) = Settings::resolve_text(&args, path, text) {
        let text = e.to_string();
        assert!(!text.is_empty(), "an empty config error");
    }
}

/// A manifest file (YAML, one or more documents): every object it holds goes through
/// translation and the engine ([`pipeline::converge`] states what must hold).
pub fn manifest(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(m) = kube_ipvs_watch::manifest::parse_manifest(Path::new("fuzz.yaml"), text) else {
        return;
    };
    pipeline::converge(&m.services, &m.slices, m.nodes.first());
}

/// Where a target's seeds come from, beside its committed `crates/fuzz/seeds/<target>/`: the
/// netlink replies captured from the kernel (one datagram per line of a fixture's hex), the
/// `KubeProxyConfiguration` fixtures, and the example cluster's manifests.
fn seed_sources(target: &str) -> &'static [(&'static str, &'static str, bool)] {
    // (directory under the repository, file name prefix or suffix, whether the files are hex)
    match target {
        "ipvs_reply" => &[
            ("crates/netlink/tests/fixtures", "service_", true),
            ("crates/netlink/tests/fixtures", "dest_", true),
        ],
        "ipset_list" => &[("crates/netlink/tests/fixtures", "ipset_", true)],
        "conntrack_dump" => &[("crates/netlink/tests/fixtures", "conntrack_", true)],
        "proxy_config" => &[("crates/kube-ipvs/tests/fixtures", ".conf", false)],
        "manifest" | "objects" => &[("examples/cluster", ".yaml", false)],
        _ => &[],
    }
}

/// Every seed of `target`, read from the repository at `root`.
pub fn seeds(target: &str, root: &Path) -> std::io::Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    let mut read_dir =
        |dir: &Path, pick: &dyn Fn(&str) -> bool, hex: bool| -> std::io::Result<()> {
            let mut paths: Vec<_> = std::fs::read_dir(dir)?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(pick))
                .collect();
            paths.sort();
            for p in paths {
                let bytes = std::fs::read(&p)?;
                if hex {
                    let text = String::from_utf8_lossy(&bytes);
                    out.extend(text.lines().filter_map(unhex));
                } else {
                    out.push(bytes);
                }
            }
            Ok(())
        };
    let committed = root.join("crates/fuzz/seeds").join(target);
    if committed.is_dir() {
        read_dir(&committed, &|_| true, false)?;
    }
    for &(dir, affix, hex) in seed_sources(target) {
        read_dir(
            &root.join(dir),
            &|n| n.starts_with(affix) || n.ends_with(affix),
            hex,
        )?;
    }
    Ok(out)
}

/// One line of a fixture's hex (one datagram).
fn unhex(line: &str) -> Option<Vec<u8>> {
    let line = line.trim();
    if line.is_empty() || !line.len().is_multiple_of(2) {
        return None;
    }
    (0..line.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(line.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pipeline the targets drive does program something: the example cluster's Services
    /// reach the table, so the targets' invariants are checked on real tables, not empty ones.
    #[test]
    fn the_example_cluster_reaches_the_table() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let text =
            std::fs::read_to_string(root.join("examples/cluster/web.yaml")).expect("example");
        let m = kube_ipvs_watch::manifest::parse_manifest(Path::new("web.yaml"), &text)
            .expect("the example parses");
        let agent = pipeline::converge(&m.services, &m.slices, m.nodes.first());
        assert!(agent.table.dest_count() > 0, "{:#?}", agent.table);
    }

    /// `dump_args` renders a real table: the captured services, each with its destinations.
    #[test]
    fn the_dump_table_holds_the_captured_services() {
        let table = pipeline::dump_table();
        assert_eq!(table.services.len(), 4);
        assert!(table.services.iter().all(|s| !s.dests.is_empty()));
        let cli = DumpCli::try_parse_from(["-n"]).expect("flags");
        let text = kube_ipvs::cmd::dump::render(&table, &cli.args).expect("renders");
        assert!(
            text.contains("FWM") && text.contains("UDP") && text.contains("TCP"),
            "{text}"
        );
    }
}
