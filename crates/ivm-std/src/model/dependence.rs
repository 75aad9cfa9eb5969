//! Dependences: the scheduling identity of a piece of data (a tensor). The dependency
//! engine (ivm-engine) keeps, per dependence, the list of accesses since the last write and
//! turns each new access into edges; a VM dependence adds the VM it belongs to.

/// A tensor's dependence: ivm-engine's [`Dependence`](ivm_engine::Dependence) plus the VM
/// it belongs to. Builders check `vm_id` before an instruction naming it reaches an engine
/// (an engine's dependences must be its own: ivm-engine's `Instruction` contract).
pub(crate) struct Dependence {
    pub(crate) vm_id: usize,
    pub(crate) dep: ivm_engine::Dependence,
}

impl Dependence {
    pub(crate) fn new(vm_id: usize) -> Self {
        Self {
            vm_id,
            dep: ivm_engine::Dependence::new(),
        }
    }
}

impl std::fmt::Debug for Dependence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dependence")
            .field("vm_id", &self.vm_id)
            .finish_non_exhaustive()
    }
}
