//! What the suites that run on both of the sim's kernel modes share: the kernel wrapper
//! that runs a byte-level body where it may touch the bytes, and the macro that makes one
//! test per mode.
#![allow(dead_code)] // Each test binary uses part of it.

use ivm_std::KernelCtx;

/// A kernel whose body `f` touches its operands' bytes: run at once on a queued sim (the
/// body runs in the device queue), enqueued on the stream from the worker on a launcher
/// sim ([`KernelCtx::on_host`]). A device that refuses the work fails the kernel with its
/// answer (unwinding without the panic hook: under injected faults that is expected).
pub fn host(
    f: impl FnOnce(&mut KernelCtx<'_>) + Send + 'static,
) -> impl FnOnce(&mut KernelCtx<'_>) + Send + 'static {
    move |k| {
        k.on_host(f)
            .unwrap_or_else(|e| std::panic::resume_unwind(Box::new(e.to_string())))
    }
}

/// `kernel_modes!(a, b)`: the tests `queued::a`, `launcher::a`, `queued::b`, ... calling
/// `a(false)`, `a(true)`, ...: each function takes whether the sim's streams are launcher
/// streams (`SimConfig::launcher`).
#[macro_export]
macro_rules! kernel_modes {
    ($($name:ident),* $(,)?) => {
        mod queued {
            $(#[test]
            fn $name() {
                super::$name(false)
            })*
        }
        mod launcher {
            $(#[test]
            fn $name() {
                super::$name(true)
            })*
        }
    };
}

/// `kernel_and_vm_modes!([a, b], [c])`: like [`kernel_modes!`], with the VM's mode as
/// well: the tests `queued::a` (multi-thread), `launcher::a` (multi-thread) and
/// `launcher_single::a` (single-thread), calling `a(false, Mode::MultiThread)`, ...; those
/// of the second list only in multi-thread mode.
#[macro_export]
macro_rules! kernel_and_vm_modes {
    ([$($both:ident),* $(,)?], [$($multi:ident),* $(,)?]) => {
        mod queued {
            $(#[test]
            fn $both() {
                super::$both(false, ivm_std::Mode::MultiThread)
            })*
            $(#[test]
            fn $multi() {
                super::$multi(false, ivm_std::Mode::MultiThread)
            })*
        }
        mod launcher {
            $(#[test]
            fn $both() {
                super::$both(true, ivm_std::Mode::MultiThread)
            })*
            $(#[test]
            fn $multi() {
                super::$multi(true, ivm_std::Mode::MultiThread)
            })*
        }
        mod launcher_single {
            $(#[test]
            fn $both() {
                super::$both(true, ivm_std::Mode::SingleThread)
            })*
        }
    };
}
