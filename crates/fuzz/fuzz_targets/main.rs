//! The libFuzzer binary: one for every target, the target named by `KUBE_IPVS_FUZZ_TARGET` (one
//! binary links once). With `KUBE_IPVS_FUZZ_SEED_DIR` (and `KUBE_IPVS_FUZZ_ROOT`, the repository)
//! it first writes the target's seeds into that directory, which `cargo xtask fuzz` passes as the
//! corpus.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

static TARGET: OnceLock<kube_ipvs_fuzz::Target> = OnceLock::new();

fn init() {
    let name = std::env::var("KUBE_IPVS_FUZZ_TARGET").unwrap_or_default();
    let target = kube_ipvs_fuzz::target(&name).unwrap_or_else(|| {
        panic!(
            "KUBE_IPVS_FUZZ_TARGET={name:?}: not one of {:?}",
            kube_ipvs_fuzz::names()
        )
    });
    if let (Some(dir), Some(root)) = (
        std::env::var_os("KUBE_IPVS_FUZZ_SEED_DIR"),
        std::env::var_os("KUBE_IPVS_FUZZ_ROOT"),
    ) {
        let dir = PathBuf::from(dir);
        let seeds = kube_ipvs_fuzz::seeds(target.name, &PathBuf::from(root))
            .unwrap_or_else(|e| panic!("reading the seeds of {name}: {e}"));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for (i, seed) in seeds.iter().enumerate() {
            let path = dir.join(format!("seed-{i:03}"));
            std::fs::write(&path, seed).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
    let _ = TARGET.set(target);
}

libfuzzer_sys::fuzz_target!(init: init(), |data: &[u8]| {
    if let Some(target) = TARGET.get() {
        (target.run)(data);
    }
});
