//! ivm-std: placeholder.
pub mod futex;
