//! The guest's root file system: a tree of entries written as a cpio "newc" archive, the format
//! the kernel unpacks into its initial rootfs.
//!
//! This module owns the archive format and the copying of host files (with their symlink chains
//! and shared libraries) into the tree. It does not decide *what* goes into the guest; `vm.rs`
//! does. The archive is uncompressed on purpose: under TCG, inflating gzip in the guest costs
//! more boot time than reading the larger image.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::Fnv;

const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFCHR: u32 = 0o020_000;

/// Where a regular file's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    Host(PathBuf),
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Entry {
    Dir,
    File { source: Source, mode: u32 },
    Symlink(PathBuf),
    CharDev { major: u32, minor: u32 },
}

/// An in-memory description of a guest file tree, keyed by absolute guest path.
///
/// `BTreeMap` order puts every directory before its children, which the kernel's unpacker needs.
#[derive(Debug, Default)]
pub(crate) struct Tree {
    entries: BTreeMap<PathBuf, Entry>,
}

impl Tree {
    #[cfg(test)]
    pub(crate) fn contains(&self, path: &Path) -> bool {
        self.entries.contains_key(path)
    }

    /// Whether a guest path exists, following the tree's symlinks.
    pub(crate) fn exists(&self, path: &Path) -> Result<bool> {
        Ok(self.entries.contains_key(&self.resolve(path)?))
    }

    fn insert(&mut self, path: PathBuf, entry: Entry) -> Result<()> {
        if !path.is_absolute() {
            bail!("guest path {} is not absolute", path.display());
        }
        match self.entries.get(&path) {
            None => {
                self.entries.insert(path, entry);
                Ok(())
            }
            Some(existing) if *existing == entry => Ok(()),
            Some(existing) => bail!(
                "guest path {} added twice with different contents ({existing:?} vs {entry:?})",
                path.display()
            ),
        }
    }

    /// Follows symlinks that are already in the tree, so a later file under `/lib/...` lands in
    /// `/usr/lib/...` when `/lib` is a symlink, exactly as it would on the host.
    fn resolve(&self, path: &Path) -> Result<PathBuf> {
        let mut current = path.to_path_buf();
        'restart: for _ in 0..40 {
            let mut prefix = PathBuf::from("/");
            let comps: Vec<Component<'_>> = current.components().collect();
            for (i, comp) in comps.iter().enumerate() {
                if matches!(comp, Component::RootDir) {
                    continue;
                }
                prefix.push(comp);
                if let Some(Entry::Symlink(target)) = self.entries.get(&prefix) {
                    let mut next = join_link(&prefix, target);
                    for rest in &comps[i + 1..] {
                        next.push(rest);
                    }
                    current = next;
                    continue 'restart;
                }
            }
            return Ok(current);
        }
        bail!("too many symlinks resolving guest path {}", path.display())
    }

    /// Creates a directory and its parents (through any symlinks already in the tree).
    pub(crate) fn add_dir(&mut self, path: &Path) -> Result<PathBuf> {
        let resolved = self.resolve(path)?;
        let mut prefix = PathBuf::from("/");
        for comp in resolved.components().skip(1) {
            prefix.push(comp);
            match self.entries.get(&prefix) {
                Some(Entry::Dir) => {}
                None => {
                    self.entries.insert(prefix.clone(), Entry::Dir);
                }
                Some(other) => bail!(
                    "cannot create directory {}: {} is already {other:?}",
                    path.display(),
                    prefix.display()
                ),
            }
        }
        Ok(resolved)
    }

    fn parent_dir(&mut self, path: &Path) -> Result<PathBuf> {
        let parent = path
            .parent()
            .with_context(|| format!("guest path {} has no parent", path.display()))?;
        let name = path
            .file_name()
            .with_context(|| format!("guest path {} has no file name", path.display()))?;
        Ok(self.add_dir(parent)?.join(name))
    }

    pub(crate) fn add_file(&mut self, path: &Path, source: Source, mode: u32) -> Result<()> {
        let path = self.parent_dir(path)?;
        self.insert(path, Entry::File { source, mode })
    }

    pub(crate) fn add_bytes(
        &mut self,
        path: &str,
        bytes: impl Into<Vec<u8>>,
        mode: u32,
    ) -> Result<()> {
        self.add_file(Path::new(path), Source::Bytes(bytes.into()), mode)
    }

    pub(crate) fn add_symlink(&mut self, path: &Path, target: &Path) -> Result<()> {
        let path = self.parent_dir(path)?;
        self.insert(path, Entry::Symlink(target.to_path_buf()))
    }

    pub(crate) fn add_char_dev(&mut self, path: &str, major: u32, minor: u32) -> Result<()> {
        let path = self.parent_dir(Path::new(path))?;
        self.insert(path, Entry::CharDev { major, minor })
    }

    /// Copies a host file to the same path in the guest, reproducing every symlink on the way
    /// (`/usr/sbin/iptables -> /etc/alternatives/iptables -> ...`, `/lib -> usr/lib`), so that
    /// programs find each other and their loader exactly where they were built to look.
    /// Returns the host path of the regular file finally reached.
    pub(crate) fn add_host_path(&mut self, path: &Path) -> Result<PathBuf> {
        self.add_host_path_inner(path, 0)
            .with_context(|| format!("copying host path {} into the guest", path.display()))
    }

    fn add_host_path_inner(&mut self, path: &Path, depth: u32) -> Result<PathBuf> {
        if depth > 40 {
            bail!("too many levels of symlinks");
        }
        if !path.is_absolute() {
            bail!("{} is not absolute", path.display());
        }
        let comps: Vec<Component<'_>> = path.components().collect();
        let mut prefix = PathBuf::from("/");
        for (i, comp) in comps.iter().enumerate() {
            match comp {
                Component::RootDir => continue,
                Component::Normal(_) => prefix.push(comp),
                _ => bail!("{} is not a normalised path", path.display()),
            }
            let last = i + 1 == comps.len();
            let meta = fs::symlink_metadata(&prefix)
                .with_context(|| format!("reading {}", prefix.display()))?;
            let kind = meta.file_type();
            if kind.is_symlink() {
                let target = fs::read_link(&prefix)
                    .with_context(|| format!("reading symlink {}", prefix.display()))?;
                self.insert(prefix.clone(), Entry::Symlink(target.clone()))?;
                let mut next = join_link(&prefix, &target);
                for rest in &comps[i + 1..] {
                    next.push(rest);
                }
                return self.add_host_path_inner(&next, depth + 1);
            } else if kind.is_dir() {
                self.insert(prefix.clone(), Entry::Dir)?;
            } else if kind.is_file() && last {
                let mode = meta.permissions().mode() & 0o7777;
                self.insert(
                    prefix.clone(),
                    Entry::File {
                        source: Source::Host(prefix.clone()),
                        mode,
                    },
                )?;
                return Ok(prefix);
            } else {
                bail!(
                    "{} is neither a directory, a regular file nor a symlink",
                    prefix.display()
                );
            }
        }
        Ok(prefix)
    }

    /// Copies a host executable or library and every shared library it needs, as `ldd` resolves
    /// them (the dynamic loader included).
    pub(crate) fn add_host_elf(&mut self, path: &Path) -> Result<()> {
        let real = self.add_host_path(path)?;
        for lib in shared_libraries(&real)? {
            self.add_host_path(&lib)?;
        }
        Ok(())
    }

    /// Copies a host executable to a *different* guest path, plus its shared libraries at their
    /// host paths.
    pub(crate) fn add_host_elf_as(&mut self, host: &Path, guest: &Path) -> Result<()> {
        let mode = fs::metadata(host)
            .with_context(|| format!("reading {}", host.display()))?
            .permissions()
            .mode()
            & 0o7777;
        self.add_file(guest, Source::Host(host.to_path_buf()), mode)?;
        for lib in shared_libraries(host)? {
            self.add_host_path(&lib)?;
        }
        Ok(())
    }

    /// A cache key for the archive this tree would produce: every path and kind, and for host
    /// files their size and modification time (cheap, and changes whenever a package upgrade
    /// replaces the file).
    pub(crate) fn fingerprint(&self, hash: &mut Fnv) -> Result<()> {
        for (path, entry) in &self.entries {
            hash.str(path);
            match entry {
                Entry::Dir => {
                    hash.str("dir");
                }
                Entry::Symlink(target) => {
                    hash.str("link").str(target);
                }
                Entry::CharDev { major, minor } => {
                    hash.str("chr").str(format!("{major}:{minor}"));
                }
                Entry::File { source, mode } => {
                    hash.str(format!("file {mode:o}"));
                    match source {
                        Source::Bytes(bytes) => {
                            hash.bytes(bytes);
                        }
                        Source::Host(host) => {
                            hash.file(host)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes the tree as a newc archive, omitting entries that `base` holds identically (this
    /// archive is appended to base's). An entry that differs is written, so it replaces the
    /// base's when the kernel unpacks the second archive.
    pub(crate) fn write_newc(&self, out: &Path, base: Option<&Tree>) -> Result<()> {
        let tmp = out.with_extension(format!("tmp{}", std::process::id()));
        let file = fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = NewcWriter::new(BufWriter::new(file));
        for (path, entry) in &self.entries {
            if base.is_some_and(|b| b.entries.get(path) == Some(entry)) {
                continue;
            }
            let name = path.strip_prefix("/").unwrap_or(path);
            let name = name.to_string_lossy();
            match entry {
                Entry::Dir => w.entry(&name, S_IFDIR | 0o755, 0, &[])?,
                Entry::Symlink(target) => w.entry(
                    &name,
                    S_IFLNK | 0o777,
                    0,
                    target.as_os_str().as_encoded_bytes(),
                )?,
                Entry::CharDev { major, minor } => {
                    w.entry(&name, S_IFCHR | 0o600, (*major << 8) | *minor, &[])?;
                }
                Entry::File { source, mode } => {
                    let data = match source {
                        Source::Bytes(bytes) => bytes.clone(),
                        Source::Host(host) => {
                            fs::read(host).with_context(|| format!("reading {}", host.display()))?
                        }
                    };
                    w.entry(&name, S_IFREG | mode, 0, &data)?;
                }
            }
        }
        w.finish()?
            .into_inner()
            .map_err(|e| e.into_error())
            .map(drop)
            .with_context(|| format!("writing {}", tmp.display()))?;
        fs::rename(&tmp, out).with_context(|| format!("renaming {}", tmp.display()))?;
        Ok(())
    }
}

/// Resolves a symlink target lexically against the directory holding the link. Lexical `..`
/// handling is correct here because every caller resolves left to right, so the link's parent
/// is already a real directory.
fn join_link(link: &Path, target: &Path) -> PathBuf {
    let base = if target.is_absolute() {
        PathBuf::from("/")
    } else {
        link.parent().unwrap_or(Path::new("/")).to_path_buf()
    };
    let mut out = base;
    for comp in target.components() {
        match comp {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(part) => out.push(part),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// The shared libraries `ldd` says an ELF file needs; empty for static executables.
pub(crate) fn shared_libraries(path: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(path)
        .output()
        .with_context(|| format!("running ldd on {}", path.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // ldd exits non-zero for static executables and non-ELF files (scripts); both need no
        // libraries.
        return Ok(Vec::new());
    }
    parse_ldd(&text)
        .with_context(|| format!("resolving the shared libraries of {}", path.display()))
}

fn parse_ldd(text: &str) -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.contains("statically linked") {
            continue;
        }
        if let Some((name, rest)) = line.split_once("=>") {
            let rest = rest.trim();
            if rest.starts_with("not found") {
                bail!("library {} not found", name.trim());
            }
            if let Some(path) = rest
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/'))
            {
                libs.push(PathBuf::from(path));
            }
        } else if let Some(path) = line
            .split_whitespace()
            .next()
            .filter(|p| p.starts_with('/'))
        {
            // The loader line: `/lib64/ld-linux-x86-64.so.2 (0x...)`.
            libs.push(PathBuf::from(path));
        }
    }
    Ok(libs)
}

/// A writer for the cpio "new ASCII" format (`070701`), the one the kernel's initramfs unpacker
/// reads: a 110-byte hex header, the NUL-terminated name, the data, each padded to 4 bytes.
pub(crate) struct NewcWriter<W: Write> {
    inner: W,
    written: u64,
    next_ino: u32,
}

impl<W: Write> NewcWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        Self {
            inner,
            written: 0,
            next_ino: 1,
        }
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.inner.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let rem = (self.written % 4) as usize;
        if rem != 0 {
            self.write(&[0; 3][..4 - rem])?;
        }
        Ok(())
    }

    /// Writes one entry. `rdev` is `major << 8 | minor` for device nodes.
    pub(crate) fn entry(&mut self, name: &str, mode: u32, rdev: u32, data: &[u8]) -> Result<()> {
        let size = u32::try_from(data.len())
            .with_context(|| format!("{name} is larger than 4 GiB, too large for cpio"))?;
        let nlink = if mode & S_IFDIR == S_IFDIR { 2 } else { 1 };
        let ino = self.next_ino;
        self.next_ino += 1;
        let name_size = name.len() + 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
             {devmajor:08x}{devminor:08x}{rdevmajor:08x}{rdevminor:08x}{name_size:08x}{check:08x}",
            uid = 0,
            gid = 0,
            mtime = 0,
            devmajor = 0,
            devminor = 0,
            rdevmajor = rdev >> 8,
            rdevminor = rdev & 0xff,
            check = 0,
        );
        self.write(header.as_bytes())?;
        self.write(name.as_bytes())?;
        self.write(&[0])?;
        self.pad()?;
        self.write(data)?;
        self.pad()?;
        Ok(())
    }

    pub(crate) fn finish(mut self) -> Result<W> {
        self.entry("TRAILER!!!", 0, 0, &[])?;
        self.inner.flush()?;
        Ok(self.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_entries_are_aligned_and_terminated() -> Result<()> {
        let mut w = NewcWriter::new(Vec::new());
        w.entry("init", S_IFREG | 0o755, 0, b"#!/bin/sh\n")?;
        w.entry("dev/console", S_IFCHR | 0o600, (5 << 8) | 1, &[])?;
        let bytes = w.finish()?;
        assert_eq!(bytes.len() % 4, 0);
        assert!(bytes.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&bytes);
        // Header (110) + "init\0" (5) padded to 116, then 10 data bytes padded to 12.
        assert_eq!(&bytes[110..115], b"init\0");
        assert_eq!(&bytes[116..126], b"#!/bin/sh\n");
        assert_eq!(&bytes[128..134], b"070701");
        // The console node carries major 5, minor 1 in the rdev fields (fields 10 and 11).
        let console = &text[128..];
        assert_eq!(&console[6 + 9 * 8..6 + 10 * 8], "00000005");
        assert_eq!(&console[6 + 10 * 8..6 + 11 * 8], "00000001");
        assert!(text.contains("TRAILER!!!"));
        Ok(())
    }

    #[test]
    fn overlay_omits_only_identical_base_entries() -> Result<()> {
        let mut base = Tree::default();
        base.add_bytes("/etc/same", b"x".to_vec(), 0o644)?;
        base.add_bytes("/etc/changed", b"old".to_vec(), 0o644)?;
        let mut overlay = Tree::default();
        overlay.add_bytes("/etc/same", b"x".to_vec(), 0o644)?;
        overlay.add_bytes("/etc/changed", b"new".to_vec(), 0o644)?;
        overlay.add_bytes("/job/run.sh", b"true".to_vec(), 0o755)?;
        let out = std::env::temp_dir().join(format!("xtask-overlay-{}.cpio", std::process::id()));
        overlay.write_newc(&out, Some(&base))?;
        let text = String::from_utf8_lossy(&fs::read(&out)?).into_owned();
        fs::remove_file(&out)?;
        assert!(!text.contains("etc/same"));
        assert!(
            !text.contains("etc\0"),
            "the shared /etc directory is not repeated"
        );
        assert!(text.contains("etc/changed\0") && text.contains("new"));
        assert!(text.contains("job/run.sh\0"));
        Ok(())
    }

    #[test]
    fn ldd_output_parses_libraries_and_loader_and_rejects_missing() -> Result<()> {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibpopt.so.0 => /lib/x86_64-linux-gnu/libpopt.so.0 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text)?,
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libpopt.so.0"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
        let err = parse_ldd("\tlibnl-3.so.200 => not found\n");
        assert!(err.is_err_and(|e| e.to_string().contains("libnl-3.so.200")));
        Ok(())
    }

    #[test]
    fn tree_follows_symlinks_it_already_holds() -> Result<()> {
        let mut tree = Tree::default();
        tree.add_dir(Path::new("/usr/lib"))?;
        tree.add_symlink(Path::new("/lib"), Path::new("usr/lib"))?;
        tree.add_bytes("/lib/modules/x/a.ko", b"ko".to_vec(), 0o644)?;
        assert!(tree.contains(Path::new("/usr/lib/modules/x/a.ko")));
        assert!(!tree.contains(Path::new("/lib/modules")));
        Ok(())
    }

    #[test]
    fn tree_copies_host_symlink_chains() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("xtask-tree-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("real"))?;
        fs::write(dir.join("real/tool"), b"x")?;
        std::os::unix::fs::symlink("real", dir.join("alias"))?;
        std::os::unix::fs::symlink("tool", dir.join("real/tool-link"))?;
        let mut tree = Tree::default();
        let reached = tree.add_host_path(&dir.join("alias/tool-link"))?;
        fs::remove_dir_all(&dir)?;
        assert_eq!(reached, dir.join("real/tool"));
        assert!(
            matches!(tree.entries.get(&dir.join("alias")), Some(Entry::Symlink(t)) if t == Path::new("real"))
        );
        assert!(tree.contains(&dir.join("real/tool-link")));
        assert!(tree.contains(&dir.join("real/tool")));
        Ok(())
    }
}
