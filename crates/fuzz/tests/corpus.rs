//! Runs every committed input through its target in the ordinary test suite: the seeds
//! (`seeds/<target>/`), the captured kernel replies the netlink fixtures hold, the example
//! cluster's manifests, and every regression (`regressions/<target>/`: an input a fuzzer
//! crashed on, kept after the fix). A crash that comes back fails here, without libFuzzer.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

#[test]
fn every_seed_and_regression_runs_clean_through_its_target() {
    let mut ran = 0;
    for t in kube_ipvs_fuzz::TARGETS {
        let seeds = kube_ipvs_fuzz::seeds(t.name, &root()).expect("seeds");
        assert!(!seeds.is_empty(), "{}: no seeds", t.name);
        let regressions = files(&root().join("crates/fuzz/regressions").join(t.name));
        for input in seeds.into_iter().chain(
            regressions
                .iter()
                .map(|p| std::fs::read(p).expect("regression readable")),
        ) {
            (t.run)(&input);
            ran += 1;
        }
    }
    assert!(ran >= kube_ipvs_fuzz::TARGETS.len());
}
