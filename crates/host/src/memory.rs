//! Handing the allocator's free memory back to the kernel.
//!
//! A full sync holds the whole observed kernel table for a moment (at 10,000 Services x 10,
//! tens of MiB in small allocations). glibc's malloc gives a heap's free top back to the
//! kernel when it is freed, but not free chunks below a live allocation, so once a sync's
//! memory ends up under something long-lived the process keeps that high-water mark as RSS
//! for good. `malloc_trim(0)` releases every whole free page of every arena
//! (`madvise(MADV_DONTNEED)`), so the RSS an operator sees follows what the agent holds.

#![allow(unsafe_code, reason = "malloc_trim is a C function")]

/// Returns the allocator's free pages to the kernel; `true` if any were released. Does
/// nothing (and returns `false`) on a C library without `malloc_trim`.
pub fn release_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes no pointers; glibc locks each arena while it trims.
        unsafe { libc::malloc_trim(0) != 0 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// This process's resident memory and its peak so far, in KiB (`VmRSS` and `VmHWM` of
/// `/proc/self/status`), for the agent's log; `None` where that file is not there.
pub fn resident_kib() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some((field("VmRSS")?, field("VmHWM")?))
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    const MIB: u64 = 1024;

    fn rss_kib() -> u64 {
        resident_kib()
            .expect("VmRSS and VmHWM in /proc/self/status")
            .0
    }

    /// The agent's pattern: many small allocations freed while a few stay live among them.
    /// Freeing them leaves the RSS where it was (the premise, checked), and releasing gives
    /// most of it back.
    #[test]
    fn free_chunks_below_live_ones_go_back_to_the_kernel() {
        let before = rss_kib();
        let mut blocks: Vec<Box<[u8; 200]>> = (0..300_000).map(|_| Box::new([1u8; 200])).collect();
        // Every 64th block stays, pinning the pages around it.
        let kept: Vec<Box<[u8; 200]>> = blocks.iter().step_by(64).map(|b| Box::new(**b)).collect();
        let mut i = 0;
        blocks.retain(|_| {
            i += 1;
            i % 64 == 0
        });
        drop(blocks);
        let freed = rss_kib();
        assert!(
            freed > before + 30 * MIB,
            "premise: freed small blocks stay resident ({before} KiB before, {freed} KiB after freeing)"
        );
        assert!(release_free_memory(), "malloc_trim released nothing");
        let released = rss_kib();
        assert!(
            released + 25 * MIB < freed,
            "{freed} KiB before releasing, {released} KiB after"
        );
        assert_eq!(kept.len(), 300_000usize.div_ceil(64));
    }
}
