//! The runner client: every [`OperationIr`] burn's router sends becomes one ivm instruction.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};

use burn_common::future::DynFut;
use burn_ir::{OperationIr, TensorId, TensorIr, TensorStatus};
use burn_ndarray::NdArrayTensor;
use burn_router::{RouterTensor, RunnerClient};
use burn_tensor::backend::Backend;
use burn_tensor::{DType, FloatDType, Shape, TensorData};
use ivm_std::{Config, Device, Stream, StreamId, Tensor, VirtualMachine};
use smallvec::SmallVec;

use crate::device::{IvmDevice, VmMode};
use crate::dispatch::{self, Inner, Operands, Slot};
use crate::fuse::FillWhereLe;
use crate::job::{JobBox, Ticket, Work, Yard};

/// One burn tensor as the client knows it: the ivm tensor that carries its dependences
/// and the slot that holds its value.
struct Entry {
    /// Zero bytes: the engine orders the instructions that use it, the value is in `slot`.
    ivm: Tensor,
    slot: Arc<Slot>,
    /// The stream of the instruction that wrote it (where its readers go by default).
    stream: usize,
}

/// burn's tensor ids are a counter: one multiplication spreads them over the hash's bits
/// (the table reads its top bits), far cheaper than SipHash for the client's hot path.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

struct Table {
    tensors: HashMap<TensorId, Entry, BuildHasherDefault<IdHasher>>,
    next_id: u64,
    /// The stream of the next operation without inputs (round robin).
    next_stream: usize,
    /// Operations submitted per stream.
    ops: Vec<u64>,
    /// Operations turned into instructions and not yet handed to the VM, in order
    /// (`flush`), and their kernels (`kernels[k]` is `batch[k]`'s).
    batch: Vec<Pending>,
    kernels: Vec<Ticket>,
    /// Boxes for the next operations, back from their kernels (`job.rs`).
    spare: Vec<JobBox>,
    /// Tensors whose last handle burn dropped since the last `flush`.
    dropped: Vec<TensorId>,
    /// How many operations the next `flush` waits for: 1 after a read or `sync` (the
    /// worker has run everything; the next op should reach it at once), doubling with each
    /// flush up to `batch_limit`.
    batch_goal: usize,
    /// A comparison held back for one op: if the next is the mask fill that consumes its
    /// output, the two run as one kernel (`fuse.rs`). Registered (`release_held`) before
    /// any other op, a read, `sync`, `seed` or a flush; a `Drop` or a new tensor only adds
    /// to the table, so the order of what the VM receives is unchanged.
    held: Option<OperationIr>,
    /// How many pairs ran as one kernel.
    fused: u64,
    /// Whether comparisons are held back to fuse (`IvmClient::set_fusion`).
    fuse: bool,
}

/// One operation waiting in the batch: its instruction's stream and operands. It holds
/// its own handles on its ivm tensors, so a tensor dropped meanwhile is released only
/// after the batch was received (after every instruction that uses it).
struct Pending {
    stream: usize,
    /// The instruction's inputs, then its outputs.
    tensors: SmallVec<[Tensor; 4]>,
    inputs: usize,
}

struct Shared {
    vm: VirtualMachine,
    streams: Vec<Stream>,
    /// Held while an operation is turned into an instruction and submitted, so the VM
    /// receives the operations in the order their tensors were created in the table: an op
    /// another thread registers on a tensor this thread just made is submitted after it.
    table: Mutex<Table>,
    /// Where kernels hand their operations' boxes back.
    yard: Arc<Yard>,
    /// How many operations one `run` hands to the VM at most (`IVM_BURN_BATCH`).
    batch_limit: usize,
}

/// The [`RunnerClient`] of [`IvmChannel`](crate::IvmChannel): one VM per (mode, process).
pub struct IvmClient<M: VmMode> {
    shared: Arc<Shared>,
    mode: PhantomData<M>,
}

impl<M: VmMode> Clone for IvmClient<M> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            mode: PhantomData,
        }
    }
}

/// How many compute streams the client of mode `M` spreads operations over: the mode's
/// own count ([`VmMode::STREAMS`]), else `IVM_BURN_STREAMS`, else [`default_stream_count`]
/// of the CPUs this process may use.
fn stream_count<M: VmMode>() -> usize {
    if let Some(n) = M::STREAMS {
        return n.clamp(1, 64);
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    env_count("IVM_BURN_STREAMS", 1..=64, default_stream_count(cpus))
}

/// One compute stream per CPU but one, at least one: the caller keeps a CPU for what burn
/// does between ops (autodiff's bookkeeping, the router's shape inference), which is what
/// the workers' kernels overlap with. One worker per CPU makes three runnable threads on
/// two CPUs, and a caller that loses its CPU to a worker holds up every op after it
/// (ARCHITECTURE.md, "ivm-burn").
fn default_stream_count(cpus: usize) -> usize {
    cpus.saturating_sub(1).clamp(1, 64)
}

/// How many operations the client collects at most before it hands them to the VM in one
/// `run`: `IVM_BURN_BATCH`, 16 by default. A read, `sync` and `seed` hand over what was
/// collected at once. One `run` drives the engine once for the whole batch, where one
/// `run` per operation drives it per operation, which costs the caller more than a tiny
/// kernel. After a read or `sync` the batches start at one op and double up to this
/// (`Table::batch_goal`): the worker ran everything the read waited for, and a first
/// batch of 16 kept it idle while the caller built 16 ops (ARCHITECTURE.md, "ivm-burn").
fn batch_limit() -> usize {
    env_count("IVM_BURN_BATCH", 1..=4096, 16)
}

/// Whether the client fuses a comparison with the mask fill that consumes it
/// (`fuse.rs`): on unless `IVM_BURN_FUSE` is `0`.
fn fuse_enabled() -> bool {
    std::env::var("IVM_BURN_FUSE").map_or(true, |v| v.trim() != "0")
}

/// The count in the environment variable `name` if it parses and lies in `range`, else
/// `default`.
fn env_count(name: &str, range: std::ops::RangeInclusive<usize>, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| range.contains(n))
        .unwrap_or(default)
}

impl<M: VmMode> IvmClient<M> {
    pub(crate) fn new() -> Self {
        let config = Config::from_env()
            .unwrap_or_else(|e| panic!("ivm-burn: {e}"))
            .with_mode(M::MODE);
        let vm = VirtualMachine::new(config)
            .unwrap_or_else(|e| panic!("ivm-burn: cannot start the VM: {e}"));
        let n = stream_count::<M>();
        let streams = (0..n)
            .map(|i| {
                vm.stream(StreamId::compute(Device::CPU, i as u32))
                    .unwrap_or_else(|e| panic!("ivm-burn: cannot create stream {i}: {e}"))
            })
            .collect();
        Self {
            shared: Arc::new(Shared {
                vm,
                streams,
                table: Mutex::new(Table {
                    tensors: HashMap::default(),
                    next_id: 0,
                    next_stream: 0,
                    ops: vec![0; n],
                    batch: Vec::new(),
                    kernels: Vec::new(),
                    spare: Vec::new(),
                    dropped: Vec::new(),
                    batch_goal: 1,
                    held: None,
                    fused: 0,
                    fuse: fuse_enabled(),
                }),
                yard: Arc::default(),
                batch_limit: batch_limit(),
            }),
            mode: PhantomData,
        }
    }

    /// The VM this client submits to.
    pub fn vm(&self) -> &VirtualMachine {
        &self.shared.vm
    }

    /// How many operations went to each of the client's compute streams so far.
    pub fn ops_per_stream(&self) -> Vec<u64> {
        self.table().ops.clone()
    }

    /// How many pairs of ops ran as one kernel so far: a float `lower_equal_elem` with a
    /// scalar and the mask fill that consumed its mask, which is how burn's router sends
    /// ReLU and its backward pass (each pair counts once in
    /// [`ops_per_stream`](Self::ops_per_stream), which does not count a comparison still
    /// held back). `IVM_BURN_FUSE=0` turns the fusion off.
    pub fn fused_pairs(&self) -> u64 {
        self.table().fused
    }

    /// Turns the fusion of a comparison with the mask fill that consumes it on or off for
    /// the ops registered from now on (it starts on unless `IVM_BURN_FUSE` is `0`).
    /// Results are the same either way, bit for bit and layout for layout; only the
    /// kernels' work differs.
    ///
    /// ```
    /// use burn_tensor::{Tensor, activation::relu};
    /// use ivm_burn::{Ivm, IvmChannel, MultiThread};
    ///
    /// let client = burn_router::get_client::<IvmChannel<MultiThread>>(&Default::default());
    /// let x = Tensor::<Ivm, 1>::from_floats([-1.0, 2.0], &Default::default());
    /// client.set_fusion(false);
    /// let unfused = relu(x.clone()).into_data();
    /// client.set_fusion(true);
    /// assert_eq!(relu(x).into_data(), unfused);
    /// ```
    pub fn set_fusion(&self, on: bool) {
        let mut t = self.table();
        t.fuse = on;
        if !on {
            self.release_held(&mut t);
        }
    }

    /// Whether the fusion is on ([`set_fusion`](Self::set_fusion)).
    pub fn fusion(&self) -> bool {
        self.table().fuse
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // Nothing panics while the table is held except a failed submission, which panics
        // after it left the table consistent.
        self.shared.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn new_entry(&self, stream: usize) -> Entry {
        Entry {
            ivm: self
                .shared
                .vm
                .new_tensor(0)
                .unwrap_or_else(|e| panic!("ivm-burn: {e}")),
            slot: Arc::new(Slot::default()),
            stream,
        }
    }

    /// Registers `value` (made by the caller) as a new tensor.
    fn register_value(
        &self,
        value: NdArrayTensor,
        shape: Shape,
        dtype: DType,
    ) -> RouterTensor<Self> {
        let mut t = self.table();
        let id = next_id(&mut t);
        let stream = round_robin(&mut t, self.shared.streams.len());
        let mut e = self.new_entry(stream);
        e.slot = Arc::new(Slot::with(value));
        t.tensors.insert(id, e);
        RouterTensor::new(id, shape, dtype, self.clone())
    }

    /// The value of `ir` once every earlier writer ran, through the VM's sync door.
    fn value(&self, ir: &TensorIr) -> NdArrayTensor {
        let (ivm, slot) = {
            let mut t = self.table();
            // The tensor may be a held comparison's output.
            self.release_held(&mut t);
            let e = match ir.status {
                TensorStatus::ReadWrite => t.tensors.remove(&ir.id).map(|e| (e.ivm, e.slot)),
                _ => t
                    .tensors
                    .get(&ir.id)
                    .map(|e| (e.ivm.clone(), e.slot.clone())),
            };
            let e = e.unwrap_or_else(|| panic!("ivm-burn: read of unknown tensor {:?}", ir.id));
            // Every op collected so far, the tensor's writers among them, goes to the VM
            // before the read.
            self.flush_before_wait(&mut t);
            e
        };
        // `ivm` lives until the access returned: a consumed tensor's release follows it.
        let v = self
            .shared
            .vm
            .access(&ivm, move |_| slot.cloned())
            .unwrap_or_else(|e| panic!("{e}"));
        v.unwrap_or_else(|| panic!("ivm-burn: tensor {:?} was never written", ir.id))
    }

    /// [`flush`](Self::flush) before the caller waits for the VM (a read, `sync`): the
    /// worker will have run everything, so the next ops go to it from one at a time again
    /// (`Table::batch_goal`).
    fn flush_before_wait(&self, t: &mut Table) {
        self.flush(t);
        t.batch_goal = 1;
    }

    /// Hands the batch to the VM in one `run`, in the order it was collected, then forgets
    /// the tensors dropped meanwhile.
    fn flush(&self, t: &mut Table) {
        self.release_held(t);
        let r = self.submit_batch(t);
        let Table {
            tensors, dropped, ..
        } = t;
        for id in dropped.drain(..) {
            tensors.remove(&id);
        }
        if let Err(e) = r {
            panic!("ivm-burn: cannot submit an operation: {e}");
        }
    }

    fn submit_batch(&self, t: &mut Table) -> ivm_std::Result<()> {
        if t.batch.is_empty() {
            return Ok(());
        }
        let streams = &self.shared.streams;
        let (batch, kernels) = (&t.batch, &mut t.kernels);
        let mut refs: Vec<&Tensor> = Vec::new();
        let r = self.shared.vm.run(|b| {
            for (p, job) in batch.iter().zip(kernels.drain(..)) {
                refs.clear();
                refs.extend(&p.tensors);
                let (ins, outs) = refs.split_at(p.inputs);
                b.call_named("burn", &streams[p.stream], ins, outs, move |_| job.run())?;
            }
            Ok(())
        });
        // After the batch was received: a handle dropped here may be a tensor's last,
        // whose release then follows the instructions that use it.
        t.batch.clear();
        t.kernels.clear();
        // Boxes for the next batches: up to four batches' worth.
        let cap = 4 * self.shared.batch_limit;
        self.shared.yard.collect(&mut t.spare, cap);
        r
    }

    /// Registers a held comparison that found no mask fill to fuse with.
    fn release_held(&self, t: &mut Table) {
        if let Some(cmp) = t.held.take() {
            self.add(t, Work::Op(cmp));
        }
    }

    /// Turns `work` into an instruction in the batch, and flushes the batch at its goal.
    fn add(&self, t: &mut Table, work: Work) {
        // Each operand once: a read is a `ReadOnly` use, a write a `NotInit` output or a
        // `ReadWrite` last use; a tensor used twice, once as its last use, is only written
        // (listing it also as a read would alias).
        let mut operands: SmallVec<[(TensorId, TensorStatus); 4]> = SmallVec::new();
        for n in work.operands() {
            match operands.iter_mut().find(|(id, _)| *id == n.id) {
                Some(o) if o.1 == TensorStatus::ReadOnly => o.1 = n.status,
                Some(_) => {}
                None => operands.push((n.id, n.status)),
            }
        }
        let is_read = |s: TensorStatus| s == TensorStatus::ReadOnly;
        // Reads first, then writes, each in the op's order.
        operands.sort_by_key(|(_, s)| !is_read(*s));
        let reads = operands.iter().take_while(|(_, s)| is_read(*s)).count();
        let stream = if work.draws_random() {
            0
        } else if let Some(e) = operands
            .iter()
            .filter(|(_, s)| *s != TensorStatus::NotInit)
            .find_map(|(id, _)| t.tensors.get(id))
        {
            e.stream
        } else {
            round_robin(t, self.shared.streams.len())
        };
        t.ops[stream] += 1;
        // The first output takes over the first consumed input's ivm tensor and slot: the
        // op writes that tensor anyway, and a chain of ops that each consume their input
        // then allocates no ivm tensor and submits no release per op.
        let mut donor = operands
            .iter()
            .find(|(_, s)| *s == TensorStatus::ReadWrite)
            .map(|(id, _)| *id);
        let mut inherited = None;
        for &(id, _) in operands[reads..]
            .iter()
            .filter(|(_, s)| *s == TensorStatus::NotInit)
        {
            let e = match donor.take().and_then(|d| t.tensors.get(&d)) {
                Some(d) => {
                    inherited = Some(id);
                    Entry {
                        ivm: d.ivm.clone(),
                        slot: d.slot.clone(),
                        stream,
                    }
                }
                None => self.new_entry(stream),
            };
            t.tensors.insert(id, e);
        }
        let tensors: SmallVec<[Tensor; 4]> = operands
            .iter()
            .filter(|(id, _)| inherited != Some(*id))
            .map(|(id, _)| entry(t, *id).ivm.clone())
            .collect();
        let slots = operands
            .iter()
            .map(|(id, _)| (*id, entry(t, *id).slot.clone()))
            .collect();
        // A consumed input is gone once its last use was collected: the batch holds its
        // ivm tensor until the instruction was received.
        for (id, _) in operands
            .iter()
            .filter(|(_, s)| *s == TensorStatus::ReadWrite)
        {
            t.tensors.remove(id);
        }
        t.batch.push(Pending {
            stream,
            tensors,
            inputs: reads,
        });
        let job = Ticket::new(&mut t.spare, &self.shared.yard, work, Operands { slots });
        t.kernels.push(job);
        if t.batch.len() >= t.batch_goal {
            self.flush(t);
            t.batch_goal = (t.batch_goal * 2).min(self.shared.batch_limit);
        }
    }
}

fn entry(t: &Table, id: TensorId) -> &Entry {
    t.tensors
        .get(&id)
        .unwrap_or_else(|| panic!("ivm-burn: op on unknown tensor {id:?}"))
}

fn next_id(t: &mut Table) -> TensorId {
    t.next_id += 1;
    TensorId::new(t.next_id)
}

fn round_robin(t: &mut Table, n: usize) -> usize {
    let s = t.next_stream;
    t.next_stream = (s + 1) % n;
    s
}

impl<M: VmMode> RunnerClient for IvmClient<M> {
    type Device = IvmDevice<M>;

    fn register(&self, op: OperationIr) {
        match &op {
            // The tensor's last handle: its entry goes at the next `flush`, after the batch
            // was received, so its ivm tensor's release follows every instruction that uses
            // it, and the value goes with the last kernel's slot handle. Not at once: burn's
            // router counts a tensor's handles with relaxed atomics, and a thread whose op
            // still reads the tensor (it took the op's view, then dropped its handle) may
            // register that op after another thread's drop of the last handle.
            OperationIr::Drop(ir) => {
                let mut t = self.table();
                t.dropped.push(ir.id);
                if t.dropped.len() >= 4 * self.shared.batch_limit {
                    self.flush(&mut t);
                }
                return;
            }
            // `from_data`'s tensor is registered already, with its value.
            OperationIr::Init(_) => return,
            _ => {}
        }
        let mut t = self.table();
        if let Some(cmp) = t.held.take() {
            if let Some(f) = FillWhereLe::pair(&cmp, &op) {
                t.fused += 1;
                self.add(&mut t, Work::FillWhereLe(f));
                return;
            }
            self.add(&mut t, Work::Op(cmp));
        }
        if t.fuse && FillWhereLe::may_start(&op) {
            t.held = Some(op);
            return;
        }
        self.add(&mut t, Work::Op(op));
    }

    fn read_tensor(&self, tensor: TensorIr) -> DynFut<TensorData> {
        let dtype = tensor.dtype;
        let v = self.value(&tensor);
        let data = dispatch::into_data(v, dtype);
        Box::pin(async move { data })
    }

    fn sync(&self) {
        self.flush_before_wait(&mut self.table());
        if let Err(e) = self.shared.vm.sync() {
            panic!("{e}");
        }
    }

    fn register_tensor_data(&self, data: TensorData) -> RouterTensor<Self> {
        let shape = Shape::from(data.shape.clone());
        let dtype = data.dtype;
        self.register_value(dispatch::from_data(data), shape, dtype)
    }

    fn register_empty_tensor(&self, shape: Shape, dtype: DType) -> RouterTensor<Self> {
        let id = next_id(&mut self.table());
        RouterTensor::new(id, shape, dtype, self.clone())
    }

    fn register_float_tensor(&self, shape: Shape, dtype: FloatDType) -> RouterTensor<Self> {
        self.register_empty_tensor(shape, dtype.into())
    }

    fn device(&self) -> Self::Device {
        IvmDevice::default()
    }

    fn seed(&self, seed: u64) {
        // In stream order with the ops that draw random numbers (all on stream 0).
        let s = &self.shared.streams[0];
        let mut t = self.table();
        self.flush(&mut t);
        let r = self.shared.vm.run(|b| {
            b.call_named("burn seed", s, &[], &[], move |_| {
                Inner::seed(&burn_ndarray::NdArrayDevice::Cpu, seed)
            })
        });
        drop(t);
        if let Err(e) = r {
            panic!("ivm-burn: cannot submit the seed: {e}");
        }
    }
}

impl<M: VmMode> IvmClient<M> {
    /// burn's handle for `ir` (the bridge's view of a tensor).
    pub(crate) fn handle(&self, ir: &TensorIr) -> NdArrayTensor {
        self.value(ir)
    }

    /// A new tensor holding `handle`.
    pub(crate) fn adopt(
        &self,
        handle: NdArrayTensor,
        shape: Shape,
        dtype: DType,
    ) -> RouterTensor<Self> {
        self.register_value(handle, shape, dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::default_stream_count;

    #[test]
    fn one_stream_per_cpu_but_one_and_at_least_one() {
        assert_eq!(default_stream_count(0), 1);
        assert_eq!(default_stream_count(1), 1);
        assert_eq!(default_stream_count(2), 1);
        assert_eq!(default_stream_count(3), 2);
        assert_eq!(default_stream_count(16), 15);
        assert_eq!(default_stream_count(1000), 64);
    }
}
