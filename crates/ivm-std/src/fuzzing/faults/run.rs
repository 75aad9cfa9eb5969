//! Running a program on the VM while the device injects faults
//! ([`Runner::run_with_faults`]), batch by batch, recording what it observes; then healing
//! the device and recovering the VM.

use std::fmt;
use std::sync::{Arc, Mutex};

use super::check::check;
use super::record::{FaultRun, Obs, born_root, observe};
use super::{FaultControl, FaultOutcome};
use crate::fuzzing::TENSORS;
use crate::fuzzing::interpreter::{Kernels, Trace, batch_end, interpret};
use crate::fuzzing::program::{Op, Program, slot, sync_update};
use crate::fuzzing::runner::{Mismatch, Point, Runner, op_name};
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};

impl<K: Kernels> Runner<K> {
    /// Runs `program` (fitted to the topology) while `device` injects faults, and checks
    /// it against the sequential model told which instructions failed (see the
    /// module docs). After the program the device is healed, the VM drained and
    /// its cached memory returned, the device's memory checked, and the faults resumed:
    /// the next program starts clean.
    ///
    /// # Errors
    /// The first [`Mismatch`]: an observation the model does not allow, a timeout without
    /// a stuck event or whose diagnostic names nothing stuck, a VM that does not recover
    /// once the device is healed, or device memory left behind.
    pub fn run_with_faults(
        &self,
        program: &Program,
        device: &dyn FaultControl,
    ) -> std::result::Result<FaultOutcome, Box<Mismatch>> {
        let program = &self.prepare(program);
        let run = self.execute_faulty(program, device);
        let recovered = self.recover(device);
        let mismatch = |at: Point, e: &dyn fmt::Display, g: &dyn fmt::Display| {
            Box::new(Mismatch {
                program: program.clone(),
                topology: self.topology.clone(),
                at,
                expected: e.to_string(),
                got: g.to_string(),
                vm_trace: None::<Trace>,
                expected_trace: interpret(program, &*self.kernels),
            })
        };
        if let Err(e) = recovered {
            return Err(mismatch(
                Point::Vm { op: None },
                &"recovery once healed",
                &e,
            ));
        }
        let mut out = FaultOutcome {
            aborted: run.aborted,
            timeout: run.timeout.is_some(),
            sync_errors: run.sync_errors,
            cut: run.cut.is_some(),
            ..FaultOutcome::default()
        };
        if let Some((op, e)) = &run.vm_error {
            return Err(mismatch(Point::Vm { op: Some(*op) }, &"Ok", e));
        }
        if run.aborted {
            return Ok(out);
        }
        if let Some((op, d, stuck)) = &run.timeout {
            let at = Point::Vm {
                op: (*op < program.ops.len()).then_some(*op),
            };
            if *stuck == 0 {
                return Err(mismatch(
                    at,
                    &"no timeout: no event was left uncompleted",
                    d,
                ));
            }
            if !d.lively.iter().any(|l| l.launched && !l.done) {
                return Err(mismatch(at, &"a diagnostic naming the stuck work", d));
            }
        }
        check(self, program, &run, &mut out).map_err(|(at, e, g)| mismatch(at, &e, &g))?;
        Ok(out)
    }

    /// Heals the device, drains the VM, gives its cached memory back, checks the
    /// device's memory and resumes the faults.
    fn recover(&self, device: &dyn FaultControl) -> std::result::Result<(), String> {
        device.heal();
        // Device errors left by the program are reported (once) by these syncs.
        let mut r = self.vm.sync();
        for _ in 0..3 {
            if r.is_ok() {
                break;
            }
            r = self.vm.sync();
        }
        r.map_err(|e| format!("vm.sync() after healing: {e}"))?;
        self.vm
            .shrink_all_mem()
            .map_err(|e| format!("shrink_all_mem after healing: {e}"))?;
        device.check_memory()?;
        device.resume();
        Ok(())
    }

    fn execute_faulty(&self, program: &Program, device: &dyn FaultControl) -> FaultRun {
        let vm = &self.vm;
        let mut run = FaultRun::default();
        let home = |h: u8| &self.streams[usize::from(h)];
        let mut tensors = Vec::with_capacity(TENSORS);
        for t in 0..TENSORS {
            match self.allocate(home(self.topology.homes[t])) {
                (Ok(x), ids) => {
                    run.created
                        .push((born_root(program, None, t), x.blob().clone(), ids));
                    tensors.push(x);
                }
                (Err(Error::Timeout(d)), _) => {
                    run.timeout = Some((0, d, device.stuck_events()));
                    break;
                }
                (Err(_), _) => {
                    run.aborted = true;
                    break;
                }
            }
        }
        let barriers = Arc::new(Mutex::new(Vec::new()));
        if run.timeout.is_none() && !run.aborted {
            self.run_ops(program, device, &mut tensors, &barriers, &mut run);
        }
        if run.timeout.is_none() && run.cut.is_none() && !run.aborted {
            for (t, x) in tensors.iter().enumerate() {
                let i = program.ops.len() + t;
                let mut b = [0u8; 8];
                let r = vm
                    .read_small(x, 0, &mut b)
                    .map(|()| Obs::Value(u64::from_ne_bytes(b)));
                if !observe(&mut run, i, r, device) {
                    break;
                }
            }
        }
        // The tensors go once the device works again (`recover` drains their releases).
        device.heal();
        drop(tensors);
        let _ = vm.sync();
        // Every fill ran by now; a failed one poisoned its tensor first (and first stays).
        // Only a tensor's own fill makes it born poisoned: a fill's poison also spreads
        // (a copy from a tensor born poisoned), so the fill's id must be one its creation
        // made.
        for (root, blob, ids) in std::mem::take(&mut run.created) {
            if let Some(f) = blob.poison()
                && let Some(id) = f.instruction.strip_prefix("fill_reused_block#")
                && id.parse().is_ok_and(|id: usize| ids.contains(&id))
            {
                run.born.insert(f.instruction.to_string(), root);
            }
        }
        run.barriers = std::mem::take(&mut *barriers.lock().unwrap_or_else(|e| e.into_inner()));
        run
    }

    /// A new 8-byte tensor homed on `s`, with a few tries: an allocation fault should not
    /// cost the whole program; and the ids of the instructions the tries made.
    fn allocate(&self, s: &crate::Stream) -> (Result<Tensor>, std::ops::Range<usize>) {
        let first = crate::model::instruction::peek_next_id();
        let mut r = self.vm.new_tensor_on(s, 8);
        for _ in 0..4 {
            if r.is_ok() || matches!(r, Err(Error::Timeout(_))) {
                break;
            }
            r = self.vm.new_tensor_on(s, 8);
        }
        (r, first..crate::model::instruction::peek_next_id())
    }

    fn run_ops(
        &self,
        program: &Program,
        device: &dyn FaultControl,
        tensors: &mut [Tensor],
        barriers: &Arc<Mutex<Vec<usize>>>,
        run: &mut FaultRun,
    ) {
        let vm = &self.vm;
        let mut i = 0;
        while i < program.ops.len() {
            let going = match program.ops[i] {
                Op::SyncRead { tensor } => {
                    let mut b = [0u8; 8];
                    let r = vm
                        .read_small(&tensors[slot(tensor)], 0, &mut b)
                        .map(|()| Obs::Value(u64::from_ne_bytes(b)));
                    observe(run, i, r, device)
                }
                Op::SyncWrite { tensor, value } => {
                    let r = vm
                        .write_small(&tensors[slot(tensor)], 0, &value.to_ne_bytes())
                        .map(|()| Obs::Written);
                    observe(run, i, r, device)
                }
                Op::SyncUpdate { tensor, add } => {
                    let r = vm
                        .access_mut(&tensors[slot(tensor)], move |b| sync_update(b, add))
                        .map(Obs::Value);
                    observe(run, i, r, device)
                }
                Op::Sync => match vm.sync() {
                    Ok(()) => true,
                    Err(Error::Timeout(d)) => {
                        run.timeout = Some((i, d, device.stuck_events()));
                        false
                    }
                    // A device error or a sticky failure, reported once.
                    Err(Error::Device(_) | Error::Poisoned { .. }) => {
                        run.sync_errors += 1;
                        true
                    }
                    Err(e) => {
                        run.vm_error = Some((i, e.to_string()));
                        false
                    }
                },
                Op::Submit => true,
                Op::Kernel(_)
                | Op::Recreate { .. }
                | Op::Copy { .. }
                | Op::Launch(_)
                | Op::Barrier => {
                    let end = batch_end(&program.ops, i);
                    let going = self.run_batch(program, i, end, device, tensors, barriers, run);
                    i = end - 1;
                    going
                }
            };
            if !going {
                return;
            }
            i += 1;
        }
    }

    /// One `run` batch, ops `start..end`. The recreates' tensors are allocated first (a
    /// few tries each): if one cannot be, the program ends here.
    #[allow(clippy::too_many_arguments)]
    fn run_batch(
        &self,
        program: &Program,
        start: usize,
        end: usize,
        device: &dyn FaultControl,
        tensors: &mut [Tensor],
        barriers: &Arc<Mutex<Vec<usize>>>,
        run: &mut FaultRun,
    ) -> bool {
        let vm = &self.vm;
        let mut fresh = Vec::new();
        for (j, op) in program.ops.iter().enumerate().take(end).skip(start) {
            if let Op::Recreate { home, .. } = op {
                match self.allocate(&self.streams[usize::from(*home)]) {
                    (Ok(t), ids) => {
                        run.created.push((j, t.blob().clone(), ids));
                        fresh.push(t);
                    }
                    (Err(Error::Timeout(d)), _) => {
                        run.timeout = Some((j, d, device.stuck_events()));
                        return false;
                    }
                    (Err(_), _) => {
                        run.cut = Some(start);
                        return false;
                    }
                }
            }
        }
        let mut fresh = fresh.into_iter();
        let r = vm.run(|b| {
            for (j, op) in program.ops.iter().enumerate().take(end).skip(start) {
                match *op {
                    Op::Recreate { tensor, .. } => {
                        if let Some(t) = fresh.next() {
                            let old = std::mem::replace(&mut tensors[slot(tensor)], t);
                            b.release_tensor(old)?;
                        }
                    }
                    Op::Copy { stream, src, dst } => b.copy_named(
                        op_name(j),
                        &self.streams[usize::from(stream)],
                        &tensors[slot(src)],
                        &tensors[slot(dst)],
                    )?,
                    _ => self.build(b, j, op, tensors, barriers)?,
                }
            }
            Ok(())
        });
        match r {
            Ok(()) => true,
            Err(Error::Timeout(d)) => {
                run.timeout = Some((start, d, device.stuck_events()));
                false
            }
            Err(e) => {
                run.vm_error = Some((start, e.to_string()));
                false
            }
        }
    }
}
