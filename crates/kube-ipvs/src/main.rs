//! `kube-ipvs`: the node agent and its debugging tools. Thin: parsing and dispatch only.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kube_ipvs::cmd::dump::DumpArgs;

#[derive(Debug, Parser)]
#[command(
    name = "kube-ipvs",
    version,
    about = "Kubernetes service proxy on the kernel's IPVS"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the kernel's IPVS table exactly as `ipvsadm -Ln` does (or as JSON).
    Dump(DumpArgs),
    /// Print the operations `run` would apply now (`--apply` applies them once).
    Plan(kube_ipvs::cmd::plan::PlanArgs),
    /// Compare the desired state with the kernel; exit 0 in sync, 1 not, 2 on error.
    Check(kube_ipvs::cmd::check::CheckArgs),
    /// Explain which Service IP:PORT[/PROTO] is and why each endpoint is or is not used here.
    Explain(kube_ipvs::cmd::explain::ExplainArgs),
    /// Run the node agent: keep the kernel's IPVS table in sync with the cluster.
    Run(Box<kube_ipvs::agent::RunArgs>),
    /// Remove what kube-ipvs created: its IPVS virtual servers, kube-ipvs0, its iptables chains.
    Cleanup(kube_ipvs::cmd::cleanup::CleanupArgs),
}

/// `kube-ipvs` started under the name `kube-proxy` (the image links
/// `/usr/local/bin/kube-proxy` to it): kube-proxy's command line, unchanged, is `run`'s, so a
/// DaemonSet whose image is swapped keeps its `command`.
#[derive(Debug, Parser)]
#[command(
    name = "kube-proxy",
    version,
    about = "kube-ipvs run, under kube-proxy's name and flags"
)]
struct KubeProxyCli {
    /// kube-proxy's `--cleanup`: remove what the proxy created and exit (`kube-ipvs cleanup`).
    #[arg(long)]
    cleanup: bool,
    #[command(flatten)]
    run: kube_ipvs::agent::RunArgs,
}

/// Whether the program was started as `kube-proxy`.
fn started_as_kube_proxy() -> bool {
    std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|p| p.file_name().map(|n| n == "kube-proxy"))
        .unwrap_or(false)
}

fn main() -> ExitCode {
    if started_as_kube_proxy() {
        let mut cli = KubeProxyCli::parse();
        // kube-proxy's reading of the flags beside --config (see `kube_proxy_view`).
        cli.run.as_kube_proxy = true;
        if cli.cleanup {
            return kube_ipvs::cmd::cleanup::as_kube_proxy(&cli.run);
        }
        return kube_ipvs::agent::main(&cli.run);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Dump(args) => kube_ipvs::cmd::dump::main(&args),
        Command::Plan(args) => kube_ipvs::cmd::plan::main(&args),
        Command::Check(args) => kube_ipvs::cmd::check::main(&args),
        Command::Explain(args) => kube_ipvs::cmd::explain::main(&args),
        Command::Run(args) => kube_ipvs::agent::main(&args),
        Command::Cleanup(args) => kube_ipvs::cmd::cleanup::main(&args),
    }
}
