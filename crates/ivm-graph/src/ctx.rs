//! What a graph kernel sees while it fires ([`GraphCtx`]): its iteration, its operands'
//! bytes, the run's parameters.

use std::fmt;

use ivm_std::lazy::JobInstance;

/// What a graph kernel sees: its iteration, its input and output blobs' bytes and, for
/// parameter kernels, the run's parameter tensors.
///
/// The accessors lend one operand at a time; [`io`](Self::io) lends all of them at once
/// (no copies: a kernel reads its inputs and parameters and writes its outputs in place).
pub struct GraphCtx<'a> {
    pub(crate) kernel: &'a str,
    pub(crate) iteration: u64,
    pub(crate) reads: &'a [&'a [u8]],
    pub(crate) writes: &'a mut [&'a mut [u8]],
    pub(crate) job: Option<&'a JobInstance>,
}

/// Every operand of a graph kernel at once (see [`GraphCtx::io`]).
#[derive(Debug)]
pub struct KernelIo<'c, 'a> {
    /// The bytes of each read blob, in declaration order.
    pub inputs: &'c [&'a [u8]],
    /// The bytes of each written blob, in declaration order.
    pub outputs: &'c mut [&'a mut [u8]],
    /// The run's parameters, read-only, except the one in `param_mut`.
    pub params: Params<'c>,
    /// The parameter lent mutably, if one was asked for.
    pub param_mut: Option<&'c mut [u8]>,
}

/// Read-only access to the parameters of a run, inside a parameter kernel (see
/// [`GraphCtx::io`]).
#[derive(Debug, Clone, Copy)]
pub struct Params<'c> {
    kernel: &'c str,
    job: Option<&'c JobInstance>,
    /// The parameter lent mutably (not readable here).
    except: Option<usize>,
}

impl<'c> Params<'c> {
    /// Number of parameters (0 outside parameter kernels).
    pub fn len(&self) -> usize {
        self.job.map_or(0, JobInstance::num_params)
    }

    /// Whether there are none (always outside parameter kernels).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of parameter `i`.
    ///
    /// # Panics
    /// Outside a parameter kernel, for an index out of range, and for the parameter lent
    /// mutably in the same [`KernelIo`] (a panic fails the iteration).
    pub fn get(&self, i: usize) -> &'c [u8] {
        let job = self.job.unwrap_or_else(|| {
            panic!(
                "graph kernel `{}` uses parameters: declare it with param_kernel",
                self.kernel
            )
        });
        assert!(
            self.except != Some(i),
            "graph kernel `{}`: parameter {i} is lent mutably (use `param_mut`)",
            self.kernel
        );
        // SAFETY: as in `GraphCtx::param` (parameter kernels run one at a time while the
        // launch instruction holds every parameter); the only mutable slice of a
        // parameter lent out with this view is `except`'s, which this refuses, and the
        // view does not outlive the kernel call (`'c` is a borrow of its `GraphCtx`).
        unsafe { job.param(i) }
    }
}

impl fmt::Debug for GraphCtx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphCtx")
            .field("kernel", &self.kernel)
            .field("iteration", &self.iteration)
            .finish_non_exhaustive()
    }
}

impl<'a> GraphCtx<'a> {
    /// The kernel's name.
    pub fn kernel_name(&self) -> &str {
        self.kernel
    }

    /// The iteration (the graph's run number, from 0).
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// Number of blobs read.
    pub fn num_inputs(&self) -> usize {
        self.reads.len()
    }

    /// Number of blobs written.
    pub fn num_outputs(&self) -> usize {
        self.writes.len()
    }

    /// The bytes of read blob `i` (panics if out of range: the iteration fails).
    pub fn input(&self, i: usize) -> &[u8] {
        self.reads[i]
    }

    /// The bytes of written blob `i` (panics if out of range: the iteration fails).
    pub fn output(&mut self, i: usize) -> &mut [u8] {
        self.writes[i]
    }

    /// Read blob `i` as `u64`s (blobs are 8-byte aligned; a trailing partial word is left
    /// out).
    pub fn input_u64(&self, i: usize) -> &[u64] {
        words(self.reads[i])
    }

    /// Written blob `i` as `u64`s.
    pub fn output_u64(&mut self, i: usize) -> &mut [u64] {
        words_mut(self.writes[i])
    }

    /// Every operand at once: the inputs and outputs, read-only access to the
    /// parameters, and parameter `param_mut` (if any) mutably. Parameters need a
    /// parameter kernel.
    ///
    /// # Panics
    /// A `param_mut` outside a parameter kernel or out of range (a panic fails the
    /// iteration).
    ///
    /// # Examples
    ///
    /// ```
    /// use ivm_graph::GraphBuilder;
    ///
    /// let mut g = GraphBuilder::new("axpy");
    /// let x = g.input("x", 16);
    /// let y = g.blob("y", 16);
    /// let w = g.param("w", 16);
    /// // y = w * x, then w += y: every operand borrowed at once, nothing copied.
    /// g.param_kernel("axpy", &[x], &[y], move |ctx| {
    ///     let mut io = ctx.io(Some(w));
    ///     let w = io.param_mut.take().expect("asked for it");
    ///     for i in 0..16 {
    ///         io.outputs[0][i] = w[i].wrapping_mul(io.inputs[0][i]);
    ///         w[i] = w[i].wrapping_add(io.outputs[0][i]);
    ///     }
    /// });
    /// # let _ = g;
    /// ```
    pub fn io(&mut self, param_mut: Option<usize>) -> KernelIo<'_, 'a> {
        let mutable = param_mut.map(|i| {
            let job = self.job();
            assert!(
                i < job.num_params(),
                "graph kernel `{}`: no parameter {i}",
                self.kernel
            );
            // SAFETY: as in `param_mut`; `Params` refuses to lend this parameter, so this
            // is its only slice while the `KernelIo` lives (it borrows `self` mutably).
            unsafe { job.param_mut(i) }
        });
        KernelIo {
            inputs: self.reads,
            outputs: &mut *self.writes,
            params: Params {
                kernel: self.kernel,
                job: self.job,
                except: param_mut,
            },
            param_mut: mutable,
        }
    }

    fn job(&self) -> &'a JobInstance {
        self.job.unwrap_or_else(|| {
            panic!(
                "graph kernel `{}` uses parameters: declare it with param_kernel",
                self.kernel
            )
        })
    }

    /// Number of parameter tensors of this run (0 outside parameter kernels).
    pub fn num_params(&self) -> usize {
        self.job.map_or(0, JobInstance::num_params)
    }

    /// The bytes of parameter `i` (parameter kernels only; panics otherwise).
    pub fn param(&self, i: usize) -> &[u8] {
        let job = self.job();
        // SAFETY: parameter kernels run one at a time, in one global order (the graph's
        // parameter turn), while the run's launch instruction — which writes every
        // parameter — is neither done nor released, so no eager body and no other
        // parameter kernel accesses the tensor meanwhile; runs of other graphs wait for
        // this graph's queue to drain. The slice does not outlive the kernel call.
        unsafe { job.param(i) }
    }

    /// The bytes of parameter `i`, mutably (parameter kernels only; panics otherwise).
    pub fn param_mut(&mut self, i: usize) -> &mut [u8] {
        let job = self.job();
        // SAFETY: as in `param`; `&mut self` allows one parameter slice at a time.
        unsafe { job.param_mut(i) }
    }

    /// Parameter `i` as `u64`s.
    pub fn param_u64(&self, i: usize) -> &[u64] {
        words(self.param(i))
    }

    /// Parameter `i` as `u64`s, mutably.
    pub fn param_u64_mut(&mut self, i: usize) -> &mut [u64] {
        words_mut(self.param_mut(i))
    }
}

fn words(b: &[u8]) -> &[u64] {
    if b.len() < 8 {
        // No whole word; and an empty tensor's slice is dangling (address 1), not aligned.
        return &[];
    }
    // SAFETY: graph blobs and eager tensors are host memory at least 8-byte aligned (both
    // `ivm_std::HostMemory`, or an eager tensor under the `DeviceMemory` contract), so `b`
    // is; `len / 8` whole words lie inside it and every bit pattern is a valid u64.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u64>(), b.len() / 8) }
}

fn words_mut(b: &mut [u8]) -> &mut [u64] {
    if b.len() < 8 {
        // As in `words`.
        return &mut [];
    }
    // SAFETY: as in `words`, and `b` is borrowed mutably for the returned lifetime.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<u64>(), b.len() / 8) }
}
