//! ivm-std: placeholder.
