//! `kube-ipvs`: the node agent and its debugging tools. Thin: parsing and dispatch only.

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kube_ipvs::dump::{self, DumpArgs, DumpError};
use kube_ipvs::{ipvsadm, kernel};
use kube_ipvs_netlink::ipvs::Ipvs;

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
    Plan(kube_ipvs::plan::PlanArgs),
    /// Compare the desired state with the kernel; exit 0 in sync, 1 not, 2 on error.
    Check(kube_ipvs::check::CheckArgs),
    /// Explain which Service IP:PORT[/PROTO] is and why each endpoint is or is not used here.
    Explain(kube_ipvs::explain::ExplainArgs),
    /// Run the node agent: keep the kernel's IPVS table in sync with the cluster.
    Run(kube_ipvs::run::RunArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Dump(args) => run_dump(&args),
        Command::Plan(args) => kube_ipvs::plan::main(&args),
        Command::Check(args) => kube_ipvs::check::main(&args),
        Command::Explain(args) => kube_ipvs::explain::main(&args),
        Command::Run(args) => kube_ipvs::run::main(&args),
    }
}

fn run_dump(args: &DumpArgs) -> ExitCode {
    // Check the command line before touching the kernel, so a typo is reported as a typo.
    if let Err(e) = args.selector() {
        eprintln!("kube-ipvs dump: {e}");
        return ExitCode::from(2);
    }
    let mut ipvs = match Ipvs::new() {
        Ok(ipvs) => ipvs,
        Err(e) => {
            eprintln!("kube-ipvs dump: {e}");
            return ExitCode::from(1);
        }
    };
    let text = if args.timeout {
        ipvs.timeouts()
            .map(|t| ipvsadm::render_timeouts(t.tcp, t.tcp_fin, t.udp))
            .map_err(|e| e.to_string())
    } else {
        match kernel::read_table(&mut ipvs) {
            Ok(table) => dump::render(&table, args).map_err(|e| match e {
                DumpError::NoSuchService => e.to_string(),
                other => format!("kube-ipvs dump: {other}"),
            }),
            Err(e) => Err(format!("kube-ipvs dump: {e}")),
        }
    };
    match text {
        Ok(text) => {
            let mut out = std::io::stdout().lock();
            // A closed pipe (`kube-ipvs dump | head`) is not an error worth a message.
            let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
            ExitCode::SUCCESS
        }
        Err(msg) => {
            eprintln!("{msg}");
            ExitCode::from(1)
        }
    }
}
