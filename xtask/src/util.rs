//! Small helpers shared by the xtask commands: running processes, locating the workspace, hashing
//! cache keys and quoting for the guest shell.
//!
//! Nothing here knows about the VM; it must stay free of policy so every command can use it.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail};

/// The workspace root, known at compile time because xtask always lives one level below it.
pub(crate) fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// The cargo target directory (honours `CARGO_TARGET_DIR` and config), from `cargo metadata`.
pub(crate) fn target_dir() -> Result<PathBuf> {
    let text = output(cargo_cmd().args(["metadata", "--format-version", "1", "--no-deps"]))?;
    let meta: serde_json::Value = serde_json::from_str(&text).context("parsing cargo metadata")?;
    let target = meta["target_directory"]
        .as_str()
        .context("cargo metadata has no target_directory")?;
    Ok(PathBuf::from(target))
}

/// The cargo that invoked us, so toolchain overrides (`cargo +nightly xtask`) carry through.
pub(crate) fn cargo_cmd() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = program(cargo);
    cmd.current_dir(workspace_root());
    cmd
}

thread_local! {
    /// Set while [`in_background`] runs: builds started on this thread run at nice 19.
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the builds it starts (through [`program`]: cargo and Go) at the lowest CPU
/// priority (`nice -n 19`), so they use only what the rest of the machine leaves idle: `cargo
/// xtask ci` builds the lab's programs and the image's binary this way while the kernel tests
/// wait on their guests' timers.
pub(crate) fn in_background<T>(f: impl FnOnce() -> T) -> T {
    BACKGROUND.set(true);
    let out = f();
    BACKGROUND.set(false);
    out
}

/// A command running `program`, under `nice -n 19` inside [`in_background`].
pub(crate) fn program(program: impl AsRef<std::ffi::OsStr>) -> Command {
    if BACKGROUND.get() {
        let mut nice = Command::new("nice");
        nice.args(["-n", "19"]).arg(program);
        nice
    } else {
        Command::new(program)
    }
}

/// Renders a command for messages, so a failure says exactly what to re-run by hand.
pub(crate) fn display_cmd(cmd: &Command) -> String {
    let mut out = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        out.push(' ');
        out.push_str(&arg.to_string_lossy());
    }
    out
}

/// Runs a command with inherited stdio and fails if it exits non-zero.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let shown = display_cmd(cmd);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("could not start `{shown}`"))?;
    let _registered = crate::reaper::register(child.id());
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed: {status}");
    }
    Ok(())
}

/// Runs a command, captures stdout as text and fails (showing stderr) if it exits non-zero.
pub(crate) fn output(cmd: &mut Command) -> Result<String> {
    let shown = display_cmd(cmd);
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{shown}`"))?;
    let _registered = crate::reaper::register(child.id());
    let out: Output = child
        .wait_with_output()
        .with_context(|| format!("waiting for `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim_end()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("`{shown}` printed non-UTF-8 output"))
}

/// Finds an executable on `PATH` (plus the sbin directories, which a non-login root shell may
/// lack), without running it.
pub(crate) fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let extra = ["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from);
    std::env::split_paths(&path)
        .chain(extra)
        .map(|dir| dir.join(name))
        .find(|candidate| {
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
        })
}

/// Whether this process runs as root, read from `/proc/self` to avoid `unsafe` libc calls.
pub(crate) fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// FNV-1a, 64 bit: a stable hash for cache keys (std's `DefaultHasher` may change between Rust
/// releases, which would silently invalidate or, worse, alias cache entries).
#[derive(Debug, Clone)]
pub(crate) struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub(crate) fn bytes(&mut self, data: &[u8]) -> &mut Self {
        for &b in data {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
        // A separator, so ("ab", "c") and ("a", "bc") hash differently.
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        self
    }

    pub(crate) fn str(&mut self, s: impl AsRef<OsStr>) -> &mut Self {
        self.bytes(s.as_ref().as_encoded_bytes())
    }

    /// Adds a host file by its path, size and modification time: cheap, and changed by every
    /// rebuild or package upgrade that replaces the file.
    pub(crate) fn file(&mut self, path: &Path) -> Result<&mut Self> {
        let meta =
            std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
        Ok(self.str(path).str(format!(
            "{} {}.{}",
            meta.len(),
            meta.mtime(),
            meta.mtime_nsec()
        )))
    }

    pub(crate) fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Quotes a word for the guest's POSIX shell: single quotes, with embedded quotes spliced in.
pub(crate) fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
    {
        return word.to_owned();
    }
    let mut out = String::with_capacity(word.len() + 2);
    out.push('\'');
    for ch in word.chars() {
        if ch == '\'' {
            out.push_str("'\\''");
        } else {
            out.push(ch);
        }
    }
    out.push('\'');
    out
}

/// Formats a duration in seconds with one decimal, as every summary here prints it.
pub(crate) fn secs(d: std::time::Duration) -> String {
    let mut s = String::new();
    let _ = write!(s, "{:.1}s", d.as_secs_f64());
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_in_background_run_at_nice_19_and_others_do_not() {
        let args = |c: &Command| -> Vec<String> {
            c.get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        let plain = program("go");
        assert_eq!(plain.get_program(), "go");
        let niced = in_background(|| program("go"));
        assert_eq!(niced.get_program(), "nice");
        assert_eq!(args(&niced), ["-n", "19", "go"]);
        // The flag ends with the closure: later commands on the thread are plain again.
        assert_eq!(program("cargo").get_program(), "cargo");
    }

    #[test]
    fn shell_quote_leaves_plain_words_and_quotes_the_rest() {
        assert_eq!(shell_quote("--services"), "--services");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote("$(reboot)"), "'$(reboot)'");
    }

    #[test]
    fn fnv_separates_fields() {
        let a = Fnv::default().str("ab").str("c").hex();
        let b = Fnv::default().str("a").str("bc").hex();
        assert_ne!(a, b);
        assert_eq!(a, Fnv::default().str("ab").str("c").hex());
    }
}
