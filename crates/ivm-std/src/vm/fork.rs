//! Fork entry points of [`VirtualMachine`] (the policy is in `fork.rs`).

use super::VirtualMachine;

impl VirtualMachine {
    /// Whether this process is a `fork()` child of the process that created the VM (then
    /// every entry point returns [`Error::Forked`](crate::Error::Forked); see [`crate::contract`]).
    pub fn is_forked(&self) -> bool {
        self.shared_state().core.birth().is_forked()
    }

    /// The id of the process that created the VM.
    pub fn creator_pid(&self) -> u32 {
        self.shared_state().core.birth().pid()
    }
}
