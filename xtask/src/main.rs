//! `cargo xtask`: everything `cargo test` cannot do on its own. See `xtask/README.md`.
//!
//! This file only dispatches; each command lives in its own module.

mod bench;
mod bench_e2e;
mod charts;
mod ci;
mod cluster;
mod conformance;
mod demo;
mod fuzz;
mod host;
mod image;
mod initramfs;
mod kernel;
mod lab;
mod netns;
mod reaper;
mod soak;
mod testimages;
mod tools;
mod util;
mod vm;
mod vmtest;

use anyhow::{Result, bail};

const USAGE: &str = "usage: cargo xtask <command>
  demo                              the example cluster on a real kernel: agent, traffic, table
  ci [--no-vm]                      fmt, clippy (kernel tests too), tests, fuzz, vm-test, image,
                                    conformance smoke (each step timed)
  vm-test [FILTER] [--timeout S] [--test-timeout S] [--no-daemon] [--forward PORT]...
                                    run the kernel tests in a QEMU guest
  vm-run [--mem MIB] [--timeout S] [--forward PORT]... [--exe HOST[:GUEST]]... 'SCRIPT'
                                    run a shell snippet in the guest (with host executables)
  vm-shell [--mem MIB] [--forward PORT]...
                                    interactive root shell in the guest
  bench netlink [-- ARGS]           ipvs-bench in the guest (default --services 10000 --dests 10)
  bench dump [-- ARGS]              kube-ipvs dump vs ipvsadm -Ln in the guest
  bench datapath [--size N] [--count N] [--no-perf]
                                    a connection through kube-ipvs vs nftables/iptables rules, one guest
  bench diff|watch [ARGS]           cargo bench of kube-ipvs-diff / kube-ipvs-watch
  bench e2e [--sizes N,..] [--updates U] [--agents kube-ipvs,kube-proxy-ipvs,...]
                                    kube-ipvs vs kube-proxy's ipvs, nftables and iptables modes on a real API server, in the guest
  bench soak [--minutes 120] [--services 10000] [--rate 5]
                                    hours of endpoint churn: RSS, fds, threads, update latency; repair after ipvsadm -C
  fuzz [TARGET] [--seconds N]       coverage-guided fuzzing of every parser of outside input (crates/fuzz)
  cluster up [--proxy kube-ipvs|kube-proxy] [--nodes N] [--mem MIB] | down
                                    a real Kubernetes cluster in QEMU guests, kube-ipvs on every node
  conformance [--proxy kube-ipvs|kube-proxy] [--focus RE] [--skip RE] [--smoke] [--timeout S] [--shard I/N] [--nodes N] [--mem MIB]
                                    upstream e2e.test ([sig-network]) on that cluster
  tools                             build kube-apiserver, etcd, kube-proxy, kubectl (integration/tools)
  deploy-check                      kubectl apply --dry-run=server of deploy/ against a real API server
  image [--check]                   OCI/docker archive target/image/kube-ipvs-<version>.tar; --check runs it in a chroot";

fn main() -> Result<()> {
    reaper::install();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((command, rest)) = args.split_first() else {
        bail!("{USAGE}");
    };
    match command.as_str() {
        "demo" => demo::command(rest),
        "ci" => ci::command(rest),
        "vm-test" => vmtest::command(rest),
        "vm-run" => vm::vm_run_command(rest),
        "vm-shell" => vm::vm_shell_command(rest),
        "bench" => bench::command(rest),
        "image" => image::command(rest),
        "tools" => tools::command(rest),
        "deploy-check" => cluster::command(rest),
        "cluster" => lab::command(rest),
        "conformance" => lab::conformance_command(rest),
        "fuzz" => fuzz::command(rest),
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown xtask command {other:?}\n{USAGE}"),
    }
}
