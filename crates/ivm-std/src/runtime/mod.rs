//! What a VM is configured with and what it knows about its process, below the engine:
//! [`Config`](crate::Config) and the fork policy (the fork generation every entry point
//! checks). Plain data and process-wide state; nothing here runs an instruction.

pub(crate) mod config;
pub(crate) mod fork;
