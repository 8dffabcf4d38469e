//! What the host crate's kernel tests share: running a tool with fixed arguments and showing what
//! it printed.
#![allow(
    dead_code,
    reason = "shared by several test targets, each using a part"
)]

use std::process::{Command, Output};

/// Runs `bin args`, printing the command, its output and its exit status for the log.
pub(crate) fn run(bin: &str, args: &[&str]) -> Output {
    let out = Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {bin} {args:?}: {e}"));
    println!(
        "$ {bin} {}\n{}{}(exit {:?})",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        out.status.code()
    );
    out
}

/// `bin args`, which must succeed; its stdout.
pub(crate) fn run_ok(bin: &str, args: &[&str]) -> String {
    let out = run(bin, args);
    assert!(out.status.success(), "{bin} {args:?} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}
