//! The CPU priority of the agent's background threads.
//!
//! The reconcile's whole read of the kernel table runs on a thread of its own while the loop
//! goes on applying changes. Both are the agent's work, but only the loop's is waited for: an
//! EndpointSlice change sits unapplied while the loop waits for a CPU. Linux keeps a nice value
//! per thread, so the reader can yield to the loop (and to the node's other work) without
//! touching the rest of the process: a CFS thread at nice 19 weighs 15 against a nice-0
//! thread's 1,024, and still gets every CPU nobody else wants.

#![allow(unsafe_code, reason = "setpriority and gettid are C functions")]

/// The nice value of a thread that should only use CPUs nobody else wants.
pub const BACKGROUND_NICE: i32 = 19;

/// Sets the calling thread's nice value (only this thread's: on Linux, `setpriority` on a
/// thread id is per thread). Raising it needs no privilege; lowering it below the current
/// value needs `CAP_SYS_NICE`.
///
/// # Errors
///
/// The `setpriority` error, e.g. `EACCES` when lowering it without the capability.
pub fn set_this_threads_nice(nice: i32) -> std::io::Result<()> {
    // SAFETY: gettid takes nothing and always succeeds; setpriority takes plain integers and
    // touches no memory of ours.
    let rc = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
    };
    if rc == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nice value of this thread, as the kernel reports it (field 19 of
    /// `/proc/thread-self/stat`, counted after the command name's closing parenthesis).
    fn this_threads_nice() -> i32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("thread stat");
        let after = &stat[stat.rfind(')').expect("command name") + 2..];
        // Field 3 (state) is the first after the name; nice is field 19.
        after
            .split(' ')
            .nth(19 - 3)
            .expect("nice field")
            .parse()
            .expect("nice")
    }

    #[test]
    fn only_the_calling_thread_gets_the_background_nice() {
        let before = this_threads_nice();
        assert!(
            before < BACKGROUND_NICE,
            "the test runs at nice {before} already"
        );
        let inside = std::thread::spawn(|| {
            set_this_threads_nice(BACKGROUND_NICE).map(|()| this_threads_nice())
        })
        .join()
        .expect("thread")
        .expect("raising a thread's nice needs no privilege");
        assert_eq!(inside, BACKGROUND_NICE);
        assert_eq!(
            this_threads_nice(),
            before,
            "the calling thread's nice moved too"
        );
    }
}
