//! ivm facade (README becomes the crate doc).
