//! Which panics are handled where they happen, and the test-only hook that makes a task panic.
//!
//! # Contract
//! - [`catch`] runs a closure under `catch_unwind` and marks the thread as catching its own
//!   panics while it runs: the data plane's supervisor restarts a worker thread that panics,
//!   so such a panic is not the process's to act on. [`caught_here`] tells the process-wide
//!   panic hook (`crate::stop`) so; every other panic stops the daemon.
//! - [`injected_task_fault`] panics in the named task when the `fault-injection` feature is on
//!   and `WEFT_FAULT_PANIC_TASK` names it; without the feature it is nothing.
//!
//! This module imports nothing of weft's: every layer may use it.

use std::any::Any;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    static CATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `body`; a panic in it is returned as its payload instead of unwinding further, and is
/// not the process's to act on ([`caught_here`] is true meanwhile).
pub fn catch<R>(body: impl FnOnce() -> R) -> Result<R, Box<dyn Any + Send>> {
    let outer = CATCHING.with(|c| c.replace(true));
    let result = catch_unwind(AssertUnwindSafe(body));
    CATCHING.with(|c| c.set(outer));
    result
}

/// Whether a panic on this thread now is caught by a [`catch`] around it.
pub fn caught_here() -> bool {
    CATCHING.with(Cell::get)
}

/// A panic payload as text.
pub fn message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic payload".to_owned())
}

/// Fault injection for the end-to-end tests, compiled only with the `fault-injection` feature
/// (never into a release build): the task named `task` panics here when
/// `WEFT_FAULT_PANIC_TASK` names it and, if `WEFT_FAULT_PANIC_ONCE_FILE` names a file, once
/// that file exists (so that a test chooses the moment).
#[cfg(feature = "fault-injection")]
pub fn injected_task_fault(task: &str) {
    if std::env::var("WEFT_FAULT_PANIC_TASK").is_ok_and(|t| t == task)
        && std::env::var_os("WEFT_FAULT_PANIC_ONCE_FILE")
            .is_none_or(|f| std::path::Path::new(&f).exists())
    {
        panic!("injected fault in task {task} (WEFT_FAULT_PANIC_TASK)");
    }
}

/// Without the `fault-injection` feature: nothing.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn injected_task_fault(_task: &str) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catch_marks_the_thread_only_while_it_runs() {
        assert!(!caught_here());
        let inside = catch(caught_here).unwrap();
        assert!(inside);
        assert!(!caught_here());
        let payload = catch(|| panic!("boom {}", 1)).unwrap_err();
        assert_eq!(message(&*payload), "boom 1");
        assert!(!caught_here(), "a panic left the mark set");
    }
}
