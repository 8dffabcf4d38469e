//! Tidy checks: plain `#[test]`s that read the source tree and fail when an architecture
//! invariant of `docs/ARCHITECTURE.md` breaks (kernel I/O outside the kernel-facing crates, a
//! kernel dependency where it does not belong, an impure diff engine, `unsafe` outside the socket
//! code or without a `// SAFETY:` comment, a module without a `//!` doc, a bare `#[ignore]`).
//!
//! Each test collects every violation of its rule and fails once with the whole list, each entry
//! naming the file, the line and the rule. The checks are textual: a small lexer blanks comments
//! (and, where a rule is about code, string contents) so that prose never trips a rule. They read
//! only the tree and need nothing but the file system.

use std::fs;
use std::path::{Path, PathBuf};

/// The kernel-facing crates, by directory under `crates/`: the only ones that may do kernel I/O
/// (netlink sockets, `/proc`, spawning kernel tools) or depend on the crates that do it. A crate
/// in this list need not exist.
const KERNEL_FACING: &[&str] = &["netlink", "host"];

/// Dependencies only the kernel-facing crates may have in `[dependencies]`; a trailing `*`
/// matches any suffix.
const KERNEL_DEPS: &[&str] = &[
    "libc",
    "rustix",
    "netlink-sys",
    "netlink-packet-*",
    "rtnetlink",
];

/// Everything `kube-ipvs-diff` may depend on. A new entry is a deliberate decision: the engine is
/// pure (no tokio, no kube client, no netlink socket, no clock), so only plain data-structure and
/// error crates belong here.
const DIFF_ALLOWED_DEPS: &[&str] = &["thiserror", "foldhash"];

/// Dependencies `kube-ipvs-diff` may never have, whatever `DIFF_ALLOWED_DEPS` says; a trailing
/// `*` matches any suffix and a leading one any prefix.
const DIFF_FORBIDDEN_DEPS: &[&str] = &["tokio*", "kube*", "k8s-openapi", "libc", "*netlink*"];

/// The files that may contain `unsafe`, each with the reason. Every `unsafe` block and impl in
/// them needs a `// SAFETY:` comment within the three lines above it.
const UNSAFE_ALLOWED: &[(&str, &str)] = &[
    (
        "crates/netlink/src/socket.rs",
        "the two socket options netlink-sys does not offer",
    ),
    (
        "crates/host/src/memory.rs",
        "malloc_trim, which the libc crate declares unsafe like every C function",
    ),
    (
        "crates/host/src/thread.rs",
        "setpriority and gettid, which the libc crate declares unsafe like every C function",
    ),
    (
        "crates/diff/benches/diff.rs",
        "the benchmark's counting allocator: GlobalAlloc is an unsafe trait",
    ),
];

/// How many lines above an `unsafe` block its `// SAFETY:` comment may start.
const SAFETY_WINDOW: usize = 3;

#[test]
fn kernel_io_only_in_kernel_facing_crates() {
    let root = repo_root();
    let mut violations = Vec::new();
    for krate in crate_dirs(&root) {
        let name = file_name(&krate);
        if KERNEL_FACING.contains(&name.as_str()) {
            continue;
        }
        for file in rust_files(&krate.join("src")) {
            let source = SourceFile::read(&root, &file);
            for (line, what) in kernel_io_uses(&source.masked) {
                violations.push(format!(
                    "{}:{line}: rule 1 (kernel I/O only in crates/{{{}}}): uses {what}: `{}`",
                    source.rel,
                    KERNEL_FACING.join(","),
                    source.line_text(line),
                ));
            }
        }
    }
    report("kernel I/O outside the kernel-facing crates", &violations);
}

#[test]
fn kernel_dependencies_only_in_kernel_facing_crates() {
    let root = repo_root();
    let mut violations = Vec::new();
    for manifest in member_manifests(&root) {
        let dir = manifest.parent().map(file_name).unwrap_or_default();
        let in_crates = manifest.parent().and_then(Path::parent) == Some(&root.join("crates"));
        if in_crates && KERNEL_FACING.contains(&dir.as_str()) {
            continue;
        }
        let rel = relative(&root, &manifest);
        for dep in dependencies(&manifest) {
            if KERNEL_DEPS.iter().any(|p| glob_match(p, &dep.name)) {
                violations.push(format!(
                    "{rel}:{}: rule 2 (only crates/{{{}}} may depend on {}): depends on `{}`",
                    dep.line,
                    KERNEL_FACING.join(","),
                    KERNEL_DEPS.join(", "),
                    dep.name,
                ));
            }
        }
    }
    report(
        "kernel dependencies outside the kernel-facing crates",
        &violations,
    );
}

#[test]
fn diff_engine_depends_only_on_allowed_crates() {
    // The allowlist itself must not undo the invariant.
    for allowed in DIFF_ALLOWED_DEPS {
        assert!(
            !DIFF_FORBIDDEN_DEPS.iter().any(|p| glob_match(p, allowed)),
            "rule 3: DIFF_ALLOWED_DEPS lists `{allowed}`, which kube-ipvs-diff may never depend on"
        );
    }
    let root = repo_root();
    let manifest = root.join("crates/diff/Cargo.toml");
    let rel = relative(&root, &manifest);
    let mut violations = Vec::new();
    for dep in dependencies(&manifest) {
        if DIFF_FORBIDDEN_DEPS.iter().any(|p| glob_match(p, &dep.name)) {
            violations.push(format!(
                "{rel}:{}: rule 3 (kube-ipvs-diff is pure): `{}` is never allowed \
                 (no tokio, kube client, netlink or libc; see docs/ARCHITECTURE.md)",
                dep.line, dep.name,
            ));
        } else if !DIFF_ALLOWED_DEPS.contains(&dep.name.as_str()) {
            violations.push(format!(
                "{rel}:{}: rule 3 (kube-ipvs-diff is pure): `{}` is not in the allowed set {:?}; \
                 if it is pure, add it to DIFF_ALLOWED_DEPS in xtask/tests/tidy.rs",
                dep.line, dep.name, DIFF_ALLOWED_DEPS,
            ));
        }
    }
    report("kube-ipvs-diff dependencies", &violations);
}

#[test]
fn unsafe_only_in_socket_code_with_safety_comments() {
    let root = repo_root();
    let mut violations = Vec::new();
    for file in rust_files(&root) {
        let source = SourceFile::read(&root, &file);
        let allowed = UNSAFE_ALLOWED.iter().any(|(path, _)| *path == source.rel);
        for (offset, line) in words(&source.masked.code, "unsafe") {
            if !allowed {
                violations.push(format!(
                    "{}:{line}: rule 4 (`unsafe` only in {}): `{}`",
                    source.rel,
                    UNSAFE_ALLOWED
                        .iter()
                        .map(|(p, _)| *p)
                        .collect::<Vec<_>>()
                        .join(", "),
                    source.line_text(line),
                ));
                continue;
            }
            let rest = source.masked.code[offset + "unsafe".len()..].trim_start();
            let needs_comment = rest.starts_with('{') || starts_with_word(rest, "impl");
            if needs_comment && !source.has_safety_comment_above(line) {
                violations.push(format!(
                    "{}:{line}: rule 4 (every `unsafe` block has a `// SAFETY:` comment within \
                     the {SAFETY_WINDOW} lines above it): `{}`",
                    source.rel,
                    source.line_text(line),
                ));
            }
        }
    }
    report(
        "`unsafe` outside the socket code or without a SAFETY comment",
        &violations,
    );
}

#[test]
fn every_module_starts_with_a_module_doc() {
    let root = repo_root();
    let mut dirs: Vec<PathBuf> = crate_dirs(&root).iter().map(|c| c.join("src")).collect();
    dirs.push(root.join("xtask/src"));
    dirs.push(root.join("integration/src"));
    let mut violations = Vec::new();
    for dir in dirs {
        for file in rust_files(&dir) {
            let source = SourceFile::read(&root, &file);
            if let Some((line, text)) = missing_module_doc(&source.text) {
                violations.push(format!(
                    "{}:{line}: rule 5 (every module starts with a `//!` doc saying what it owns): \
                     starts with `{text}`",
                    source.rel,
                ));
            }
        }
    }
    report("modules without a `//!` module doc", &violations);
}

#[test]
fn no_bare_ignore() {
    let root = repo_root();
    let mut violations = Vec::new();
    for file in rust_files(&root) {
        let source = SourceFile::read(&root, &file);
        for line in bare_ignores(&source.masked.code) {
            violations.push(format!(
                "{}:{line}: rule 6 (no bare `#[ignore]`: give the reason, `#[ignore = \"...\"]`, \
                 or gate the test behind a feature): `{}`",
                source.rel,
                source.line_text(line),
            ));
        }
    }
    report("bare `#[ignore]`", &violations);
}

/// The `kernel-tests` feature only gates the kernel test files: each member declares it empty
/// (`kernel-tests = []`) and only a package's `tests/kernel*.rs` have
/// `cfg(feature = "kernel-tests")`. `cargo xtask ci` relies on this to lint the workspace once
/// with every such feature on (a build with it on then holds everything a build without it
/// does).
#[test]
fn the_kernel_tests_feature_only_gates_kernel_test_files() {
    let root = repo_root();
    let mut violations = Vec::new();
    for manifest in member_manifests(&root) {
        let text = fs::read_to_string(&manifest)
            .unwrap_or_else(|e| panic!("read {}: {e}", manifest.display()));
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.starts_with("kernel-tests") && line.replace(' ', "") != "kernel-tests=[]" {
                violations.push(format!(
                    "{}:{}: the kernel-tests feature must be empty: `{line}`",
                    relative(&root, &manifest),
                    n + 1
                ));
            }
        }
    }
    for file in rust_files(&root) {
        let source = SourceFile::read(&root, &file);
        // `<package>/tests/kernel*.rs`: the integration test targets vm-test runs.
        let in_kernel_test = file.parent().is_some_and(|dir| {
            file_name(dir) == "tests"
                && dir.parent().is_some_and(|p| p.join("Cargo.toml").is_file())
        }) && file_name(&file).starts_with("kernel");
        if in_kernel_test {
            continue;
        }
        for offset in find_all(&source.masked.text, "feature = \"kernel-tests\"") {
            let line = line_of(&source.masked.text, offset);
            violations.push(format!(
                "{}:{line}: only tests/kernel*.rs may depend on the kernel-tests feature: `{}`",
                source.rel,
                source.line_text(line),
            ));
        }
    }
    report(
        "kernel-tests feature beyond the kernel test files",
        &violations,
    );
}

/// Both image builders make the same image: `cargo xtask image` (`xtask/src/image.rs`) and the
/// `Dockerfile` each link `/usr/local/bin/kube-proxy` to the binary, so a kube-proxy DaemonSet
/// whose image alone is swapped keeps its `command` with either image.
#[test]
fn both_images_answer_to_the_name_kube_proxy() {
    let root = repo_root();
    let read = |rel: &str| {
        std::fs::read_to_string(root.join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
    };
    let mut violations = Vec::new();
    if !read("Dockerfile").contains("ln -s kube-ipvs /out/usr/local/bin/kube-proxy") {
        violations
            .push("Dockerfile: no `ln -s kube-ipvs /out/usr/local/bin/kube-proxy`".to_owned());
    }
    let image = read("xtask/src/image.rs");
    if !(image.contains(r#"bin_dir.join("kube-proxy")"#)
        && image.contains(r#"symlink("kube-ipvs""#))
    {
        violations.push("xtask/src/image.rs: no kube-proxy -> kube-ipvs link".to_owned());
    }
    report("image without the kube-proxy name", &violations);
}

#[test]
fn lexer_blanks_comments_and_string_contents() {
    let src = "let a = \"libc::x // no\"; // libc::y\n\
               let b = r#\"unsafe \" {\"#; /* unsafe /* nested */ still */ let c = '\"';\n\
               fn f<'a>(x: &'a str) -> char { '\\'' } // end\n\
               unsafe { libc::z() }";
    let masked = mask(src);
    let code: Vec<&str> = masked.code.lines().collect();
    let text: Vec<&str> = masked.text.lines().collect();
    assert_eq!(code.len(), 4, "{code:?}");
    assert!(
        !code[0].contains("libc") && text[0].contains("\"libc::x // no\""),
        "{code:?} {text:?}"
    );
    assert!(!text[0].contains("libc::y"), "{text:?}");
    assert!(
        !code[1].contains("unsafe") && !text[1].contains("nested"),
        "{code:?} {text:?}"
    );
    assert!(code[1].contains("let c ="), "{code:?}");
    assert!(code[2].contains("fn f<'a>(x: &'a str)"), "{code:?}");
    assert_eq!(words(&masked.code, "unsafe").len(), 1);
    assert_eq!(words(&masked.code, "unsafe")[0].1, 4);
    assert_eq!(kernel_io_uses(&masked), vec![(4, "`libc`".to_owned())]);
    let paths = mask("let p = \"/proc\";\nlet q = \"/sys/module\";\nlet r = \"/system\";");
    assert_eq!(
        kernel_io_uses(&paths)
            .iter()
            .map(|u| u.0)
            .collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(
        bare_ignores(&mask("#[ignore]\n#[ignore = \"vm\"]\n#[cfg_attr(x, ignore)]").code).len(),
        2
    );
}

// ---- the rules' matchers ----

/// The lines of a file that use kernel I/O: `(line, what)`.
fn kernel_io_uses(masked: &Masked) -> Vec<(usize, String)> {
    let mut uses = Vec::new();
    for (word, what) in [("libc", "`libc`"), ("netlink_sys", "`netlink_sys`")] {
        uses.extend(
            words(&masked.code, word)
                .into_iter()
                .map(|(_, line)| (line, what)),
        );
    }
    for (needle, what) in [
        ("Command::new", "`Command::new`"),
        ("process::Command", "`process::Command`"),
    ] {
        uses.extend(find_all(&masked.code, needle).map(|o| (line_of(&masked.code, o), what)));
    }
    // `use std::process::{Command, Stdio}` (rustfmt may spread the list over several lines).
    for open in find_all(&masked.code, "process::{") {
        let list = &masked.code[open..];
        let list = &list[..list.find('}').unwrap_or(list.len())];
        if !words(list, "Command").is_empty() {
            uses.push((line_of(&masked.code, open), "`process::{Command, ..}`"));
        }
    }
    // Sysctls anywhere in strings or code (comments do not count), and any string literal that
    // is a path under /proc or /sys, read or written (`"/proc"`, `"/proc/..."`, `"/sys/..."`).
    uses.extend(
        find_all(&masked.text, "/proc/sys").map(|o| (line_of(&masked.text, o), "`/proc/sys`")),
    );
    for (root, what) in [
        ("\"/proc", "a `\"/proc...\"` path"),
        ("\"/sys", "a `\"/sys...\"` path"),
    ] {
        for o in find_all(&masked.text, root) {
            if matches!(
                masked.text[o + root.len()..].chars().next(),
                Some('"' | '/')
            ) {
                uses.push((line_of(&masked.text, o), what));
            }
        }
    }
    uses.sort();
    uses.dedup();
    // One entry per line.
    let mut lines: Vec<(usize, String)> = Vec::new();
    for (line, what) in uses {
        match lines.last_mut() {
            Some((last, whats)) if *last == line => {
                whats.push_str(", ");
                whats.push_str(what);
            }
            _ => lines.push((line, what.to_owned())),
        }
    }
    lines
}

/// The lines holding an `ignore` attribute without a reason: `#[ignore]` or
/// `#[cfg_attr(.., ignore)]`, but not `#[ignore = "reason"]`.
fn bare_ignores(code: &str) -> Vec<usize> {
    let mut lines = Vec::new();
    for (offset, line) in words(code, "ignore") {
        let line_start = code[..offset].rfind('\n').map_or(0, |i| i + 1);
        let in_attribute = code[line_start..offset].contains("#[");
        let next = code[offset + "ignore".len()..].trim_start().chars().next();
        if in_attribute && matches!(next, Some(']' | ')' | ',')) {
            lines.push(line);
        }
    }
    lines
}

/// The first line that is not blank and not part of an inner attribute, when it is not a `//!`
/// doc: `(line, text)`.
fn missing_module_doc(text: &str) -> Option<(usize, String)> {
    let mut depth = 0i32; // brackets still open in an inner attribute
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if depth > 0 || trimmed.starts_with("#![") {
            depth += bracket_balance(trimmed);
            continue;
        }
        if trimmed.is_empty() {
            continue;
        }
        if trimmed.starts_with("//!") {
            return None;
        }
        return Some((i + 1, trimmed.to_owned()));
    }
    Some((1, "an empty file".to_owned()))
}

fn bracket_balance(line: &str) -> i32 {
    line.chars()
        .map(|c| match c {
            '[' => 1,
            ']' => -1,
            _ => 0,
        })
        .sum()
}

// ---- the tree ----

fn repo_root() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).to_path_buf()
}

/// The crate directories under `crates/`, sorted.
fn crate_dirs(root: &Path) -> Vec<PathBuf> {
    let entries = fs::read_dir(root.join("crates"))
        .unwrap_or_else(|e| panic!("read {}: {e}", root.join("crates").display()));
    let mut dirs: Vec<PathBuf> = entries
        .map(|e| e.unwrap_or_else(|e| panic!("read crates/: {e}")).path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// The workspace members' manifests (`members = ["crates/*", "xtask", "integration"]`).
fn member_manifests(root: &Path) -> Vec<PathBuf> {
    let mut manifests: Vec<PathBuf> = crate_dirs(root)
        .iter()
        .map(|c| c.join("Cargo.toml"))
        .collect();
    manifests.push(root.join("xtask/Cargo.toml"));
    manifests.push(root.join("integration/Cargo.toml"));
    manifests
}

/// Every `.rs` file under `dir`, sorted, skipping `target/` and hidden directories (`.git/`).
/// A missing `dir` has none.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let entry = entry.unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
            let path = entry.path();
            let name = file_name(&path);
            let file_type = entry
                .file_type()
                .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
            if file_type.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    stack.push(path);
                }
            } else if file_type.is_file() && name.ends_with(".rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

fn report(what: &str, violations: &[String]) {
    assert!(
        violations.is_empty(),
        "{} violation(s): {what}\n{}\n",
        violations.len(),
        violations.join("\n")
    );
}

struct SourceFile {
    rel: String,
    text: String,
    masked: Masked,
}

impl SourceFile {
    fn read(root: &Path, path: &Path) -> SourceFile {
        let text =
            fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let masked = mask(&text);
        SourceFile {
            rel: relative(root, path),
            text,
            masked,
        }
    }

    /// Line `line` (1-based), trimmed, for a message.
    fn line_text(&self, line: usize) -> &str {
        self.text.lines().nth(line - 1).unwrap_or_default().trim()
    }

    fn has_safety_comment_above(&self, line: usize) -> bool {
        let lines: Vec<&str> = self.text.lines().collect();
        let from = line.saturating_sub(1 + SAFETY_WINDOW);
        lines[from..line - 1]
            .iter()
            .any(|l| l.contains("// SAFETY:"))
    }
}

// ---- Cargo.toml ----

struct Dependency {
    name: String,
    line: usize,
}

/// The normal dependencies of a manifest: `[dependencies]`, `[dependencies.NAME]` and
/// `[target.'cfg(..)'.dependencies]`, by package name (a `package = "..."` rename is followed).
/// Not `[dev-dependencies]` or `[build-dependencies]`.
fn dependencies(manifest: &Path) -> Vec<Dependency> {
    let text =
        fs::read_to_string(manifest).unwrap_or_else(|e| panic!("read {}: {e}", manifest.display()));
    let mut deps = Vec::new();
    let mut in_table = false;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split(" #").next().unwrap_or_default().trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_end_matches(']').trim();
            in_table = header == "dependencies"
                || (header.starts_with("target.") && header.ends_with(".dependencies"));
            if let Some(name) = header.strip_prefix("dependencies.") {
                deps.push(Dependency {
                    name: normalise(name),
                    line: i + 1,
                });
            }
            continue;
        }
        if !in_table || !line.contains('=') {
            continue;
        }
        let key = line.split(['=', '.', ' ']).next().unwrap_or_default();
        let name = package_rename(line).unwrap_or(key);
        deps.push(Dependency {
            name: normalise(name),
            line: i + 1,
        });
    }
    deps
}

/// The `package = "..."` of an inline table (`foo = { package = "bar", version = "1" }`).
fn package_rename(line: &str) -> Option<&str> {
    let table = line.split_once('{')?.1;
    table.split([',', '}']).find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key.trim() == "package").then(|| value.trim().trim_matches('"'))
    })
}

fn normalise(name: &str) -> String {
    name.trim().trim_matches('"').replace('_', "-")
}

/// Whether `name` matches `pattern`, where a leading or trailing `*` matches anything.
fn glob_match(pattern: &str, name: &str) -> bool {
    match (pattern.strip_prefix('*'), pattern.strip_suffix('*')) {
        (Some(inner), _) if inner.ends_with('*') => name.contains(inner.trim_end_matches('*')),
        (Some(suffix), _) => name.ends_with(suffix),
        (None, Some(prefix)) => name.starts_with(prefix),
        (None, None) => name == pattern,
    }
}

// ---- a small Rust lexer ----

/// A source file with the same line structure, in two forms: `code` has comments and the
/// contents of string and char literals blanked (the quotes stay); `text` has only the comments
/// blanked.
#[derive(Debug)]
struct Masked {
    code: String,
    text: String,
}

fn mask(src: &str) -> Masked {
    let chars: Vec<char> = src.chars().collect();
    let mut code = String::with_capacity(src.len());
    let mut text = String::with_capacity(src.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                code.push(' ');
                text.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                let pair = (chars[i], chars.get(i + 1).copied());
                let width = match pair {
                    ('/', Some('*')) => {
                        depth += 1;
                        2
                    }
                    ('*', Some('/')) => {
                        depth -= 1;
                        2
                    }
                    _ => 1,
                };
                for &c in &chars[i..i + width] {
                    code.push(blank(c));
                    text.push(blank(c));
                }
                i += width;
                if depth == 0 {
                    break;
                }
            }
        } else if let Some(hashes) = raw_string_start(&chars, i) {
            // `r"..."`, `r#"..."#`: the `r`, the hashes and the opening quote stay.
            for &c in &chars[i..i + hashes + 2] {
                code.push(c);
                text.push(c);
            }
            i += hashes + 2;
            while i < chars.len() {
                let closes = chars[i] == '"'
                    && chars.len() >= i + 1 + hashes
                    && chars[i + 1..i + 1 + hashes].iter().all(|&h| h == '#');
                if closes {
                    for &c in &chars[i..i + 1 + hashes] {
                        code.push(c);
                        text.push(c);
                    }
                    i += 1 + hashes;
                    break;
                }
                code.push(blank(chars[i]));
                text.push(chars[i]);
                i += 1;
            }
        } else if c == '"' {
            code.push('"');
            text.push('"');
            i += 1;
            while i < chars.len() {
                let c = chars[i];
                if c == '\\' {
                    code.push(' ');
                    text.push(c);
                    if let Some(&escaped) = chars.get(i + 1) {
                        code.push(blank(escaped));
                        text.push(escaped);
                    }
                    i += 2;
                    continue;
                }
                i += 1;
                if c == '"' {
                    code.push('"');
                    text.push('"');
                    break;
                }
                code.push(blank(c));
                text.push(c);
            }
        } else if c == '\'' {
            // A char literal (`'x'`, `'\n'`, `'\''`) or a lifetime/label (`'a`).
            let end = if next == Some('\\') {
                // Past the backslash and the escaped character, up to the closing quote.
                chars
                    .get(i + 3..)
                    .and_then(|rest| rest.iter().position(|&c| c == '\''))
                    .map(|p| i + 3 + p)
            } else if chars.get(i + 2) == Some(&'\'') && next != Some('\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    code.push('\'');
                    text.push('\'');
                    for &c in &chars[i + 1..end] {
                        code.push(blank(c));
                        text.push(c);
                    }
                    code.push('\'');
                    text.push('\'');
                    i = end + 1;
                }
                None => {
                    code.push(c);
                    text.push(c);
                    i += 1;
                }
            }
        } else {
            code.push(c);
            text.push(c);
            i += 1;
        }
    }
    Masked { code, text }
}

/// When a raw string (`r"`, `r#"`, `br"`, `cr#"`) starts at `i`: its number of `#`s.
fn raw_string_start(chars: &[char], i: usize) -> Option<usize> {
    if chars[i] != 'r' {
        return None;
    }
    let is_ident = |j: Option<usize>| j.and_then(|j| chars.get(j)).is_some_and(|&c| ident_char(c));
    let before = i.checked_sub(1);
    let prefix_ok = !is_ident(before)
        || (matches!(before.map(|j| chars[j]), Some('b' | 'c')) && !is_ident(i.checked_sub(2)));
    if !prefix_ok {
        return None;
    }
    let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
    (chars.get(i + 1 + hashes) == Some(&'"')).then_some(hashes)
}

fn ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn starts_with_word(s: &str, word: &str) -> bool {
    s.strip_prefix(word)
        .is_some_and(|rest| !rest.starts_with(ident_char))
}

fn find_all<'a>(haystack: &'a str, needle: &'a str) -> impl Iterator<Item = usize> + 'a {
    haystack.match_indices(needle).map(|(o, _)| o)
}

/// The occurrences of `word` as a whole identifier: `(byte offset, line)`.
fn words(haystack: &str, word: &str) -> Vec<(usize, usize)> {
    find_all(haystack, word)
        .filter(|&o| {
            let before = haystack[..o].chars().next_back();
            let after = haystack[o + word.len()..].chars().next();
            !before.is_some_and(ident_char) && !after.is_some_and(ident_char)
        })
        .map(|o| (o, line_of(haystack, o)))
        .collect()
}

fn line_of(haystack: &str, offset: usize) -> usize {
    haystack[..offset].bytes().filter(|&b| b == b'\n').count() + 1
}
