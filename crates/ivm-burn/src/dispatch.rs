//! From one [`OperationIr`] to burn-ndarray's ops: what an instruction's kernel runs.
//!
//! The kernel gets the operation and the slots of its operands ([`Operands`]); it takes
//! each input out of its slot (a consuming last use moves it, which lets ndarray reuse the
//! buffer in place; a shared use clones the handle, a reference count), calls the ndarray
//! op, and puts each output into its slot. Every tensor kind of ndarray is one Rust type
//! ([`NdArrayTensor`]), so one slot type serves floats, ints and bools.

use std::sync::{Arc, Mutex, MutexGuard};

use burn_ir::{
    BaseOperationIr, BoolOperationIr, FloatOperationIr, IntOperationIr, ModuleOperationIr,
    NumericOperationIr, OperationIr, TensorId, TensorIr, TensorStatus,
};
use burn_ndarray::{NdArrayDevice, NdArrayTensor};
use burn_tensor::DType;
use burn_tensor::ops::{BoolTensorOps, FloatTensorOps, IntTensorOps, ModuleOps};
use smallvec::SmallVec;

/// The backend that runs the kernels.
pub type Inner = burn_ndarray::NdArray<f32, i64>;
/// Inner's float element.
pub(crate) type FloatElem = f32;
/// Inner's int element.
pub(crate) type IntElem = i64;

/// Where one tensor's value lives between the instruction that writes it and those that
/// read it. The engine orders every access (a consuming use is a write), so the lock is
/// never contended; it exists to make the hand-over between worker threads sound.
#[derive(Default)]
pub(crate) struct Slot(Mutex<Option<NdArrayTensor>>);

impl Slot {
    pub(crate) fn with(t: NdArrayTensor) -> Self {
        Self(Mutex::new(Some(t)))
    }

    fn lock(&self) -> MutexGuard<'_, Option<NdArrayTensor>> {
        // A panic never happens while the guard is held (the kernels take the value out
        // first), so a poisoned lock still holds a consistent value.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A shared handle to the value (an `Arc` clone inside ndarray).
    pub(crate) fn cloned(&self) -> Option<NdArrayTensor> {
        self.lock().clone()
    }

    fn take(&self) -> Option<NdArrayTensor> {
        self.lock().take()
    }

    fn put(&self, t: NdArrayTensor) {
        *self.lock() = Some(t);
    }
}

/// The slots of one operation's operands, by burn's tensor id. Inline up to four (most
/// ops): the kernel is built on the caller's thread and dropped on a worker's, and a heap
/// block freed on another thread than its own costs glibc's arena lock on both sides.
#[derive(Default)]
pub(crate) struct Operands {
    pub(crate) slots: SmallVec<[(TensorId, Arc<Slot>); 4]>,
}

impl Operands {
    fn slot(&self, id: TensorId) -> &Slot {
        self.slots
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, s)| &**s)
            .unwrap_or_else(|| panic!("ivm-burn: tensor {id:?} is not an operand of this op"))
    }

    /// The input `ir`: moved out on its last use (`ReadWrite`), shared otherwise.
    pub(crate) fn get(&self, ir: &TensorIr) -> NdArrayTensor {
        let s = self.slot(ir.id);
        let v = match ir.status {
            TensorStatus::ReadWrite => s.take(),
            _ => s.cloned(),
        };
        v.unwrap_or_else(|| panic!("ivm-burn: tensor {:?} holds no value", ir.id))
    }

    fn get_opt(&self, ir: &Option<TensorIr>) -> Option<NdArrayTensor> {
        ir.as_ref().map(|t| self.get(t))
    }

    pub(crate) fn put(&self, ir: &TensorIr, t: NdArrayTensor) {
        self.slot(ir.id).put(t);
    }
}

const DEV: NdArrayDevice = NdArrayDevice::Cpu;

macro_rules! unary {
    ($c:ident, $d:expr, $f:path) => {{
        let d = $d;
        let x = $c.get(&d.input);
        $c.put(&d.out, $f(x));
    }};
}

macro_rules! binary {
    ($c:ident, $d:expr, $f:path) => {{
        let d = $d;
        let l = $c.get(&d.lhs);
        let r = $c.get(&d.rhs);
        $c.put(&d.out, $f(l, r));
    }};
}

macro_rules! scalar {
    ($c:ident, $d:expr, $f:path, $e:ty) => {{
        let d = $d;
        let l = $c.get(&d.lhs);
        $c.put(&d.out, $f(l, d.rhs.elem::<$e>()));
    }};
}

macro_rules! reduce_dim {
    ($c:ident, $d:expr, $f:path) => {{
        let d = $d;
        let x = $c.get(&d.input);
        $c.put(&d.out, $f(x, d.axis));
    }};
}

/// Runs `op` on the inner backend. Panics (burn's own way to report a bad op) are caught
/// by the VM and poison the op's outputs.
pub(crate) fn run(op: &OperationIr, c: &Operands) {
    match op {
        OperationIr::BaseFloat(op) => base(op, c, Kind::Float),
        OperationIr::BaseInt(op) => base(op, c, Kind::Int),
        OperationIr::BaseBool(op) => base(op, c, Kind::Bool),
        OperationIr::NumericFloat(_, op) => numeric_float(op, c),
        OperationIr::NumericInt(_, op) => numeric_int(op, c),
        OperationIr::Bool(op) => boolean(op, c),
        OperationIr::Int(op) => int(op, c),
        OperationIr::Float(_, op) => float(op, c),
        OperationIr::Module(op) => module(op, c),
        OperationIr::Init(_) | OperationIr::Drop(_) => {}
        OperationIr::Custom(op) => {
            panic!("ivm-burn: custom operation `{}` has no kernel here", op.id)
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Float,
    Int,
    Bool,
}

/// Picks the float, int or bool form of an op.
macro_rules! by_kind {
    ($k:expr, $fl:path, $int:path, $b:path $(, $arg:expr)*) => {
        match $k {
            Kind::Float => $fl($($arg),*),
            Kind::Int => $int($($arg),*),
            Kind::Bool => $b($($arg),*),
        }
    };
}

fn no_bool<T>(what: &str) -> T {
    panic!("ivm-burn: `{what}` has no bool form")
}

fn base(op: &BaseOperationIr, c: &Operands, k: Kind) {
    type F = Inner;
    match op {
        BaseOperationIr::ToDevice(_) => {
            panic!("ivm-burn: one device per client; to_device changes clients, not ops")
        }
        BaseOperationIr::Reshape(d) => {
            let x = c.get(&d.input);
            let s = d.out.shape.clone();
            let y = by_kind!(k, F::float_reshape, F::int_reshape, F::bool_reshape, x, s);
            c.put(&d.out, y);
        }
        BaseOperationIr::SwapDims(d) => {
            let x = c.get(&d.input);
            let y = by_kind!(
                k,
                F::float_swap_dims,
                F::int_swap_dims,
                F::bool_swap_dims,
                x,
                d.dim1,
                d.dim2
            );
            c.put(&d.out, y);
        }
        BaseOperationIr::Permute(d) => {
            let x = c.get(&d.input);
            let a = &d.axes;
            let y = by_kind!(k, F::float_permute, F::int_permute, F::bool_permute, x, a);
            c.put(&d.out, y);
        }
        BaseOperationIr::Flip(d) => {
            let x = c.get(&d.input);
            let a = &d.axes;
            let y = by_kind!(k, F::float_flip, F::int_flip, F::bool_flip, x, a);
            c.put(&d.out, y);
        }
        BaseOperationIr::Expand(d) => {
            let x = c.get(&d.input);
            let s = d.shape.clone();
            let y = by_kind!(k, F::float_expand, F::int_expand, F::bool_expand, x, s);
            c.put(&d.out, y);
        }
        BaseOperationIr::Unfold(d) => {
            let x = c.get(&d.input);
            let y = by_kind!(
                k,
                F::float_unfold,
                F::int_unfold,
                F::bool_unfold,
                x,
                d.dim,
                d.size,
                d.step
            );
            c.put(&d.out, y);
        }
        BaseOperationIr::Slice(d) => {
            let x = c.get(&d.tensor);
            let r = &d.ranges;
            let y = by_kind!(k, F::float_slice, F::int_slice, F::bool_slice, x, r);
            c.put(&d.out, y);
        }
        BaseOperationIr::SliceAssign(d) => {
            let x = c.get(&d.tensor);
            let v = c.get(&d.value);
            let r = &d.ranges;
            let y = by_kind!(
                k,
                F::float_slice_assign,
                F::int_slice_assign,
                F::bool_slice_assign,
                x,
                r,
                v
            );
            c.put(&d.out, y);
        }
        BaseOperationIr::Equal(d) => {
            let l = c.get(&d.lhs);
            let r = c.get(&d.rhs);
            let y = by_kind!(k, F::float_equal, F::int_equal, F::bool_equal, l, r);
            c.put(&d.out, y);
        }
        BaseOperationIr::RepeatDim(d) => {
            let x = c.get(&d.tensor);
            let y = by_kind!(
                k,
                F::float_repeat_dim,
                F::int_repeat_dim,
                F::bool_repeat_dim,
                x,
                d.dim,
                d.times
            );
            c.put(&d.out, y);
        }
        BaseOperationIr::Cat(d) => {
            let xs: Vec<_> = d.tensors.iter().map(|t| c.get(t)).collect();
            let y = by_kind!(k, F::float_cat, F::int_cat, F::bool_cat, xs, d.dim);
            c.put(&d.out, y);
        }
        BaseOperationIr::Cast(d) => {
            let x = c.get(&d.input);
            let y = match k {
                Kind::Float => F::float_cast(x, d.out.dtype.into()),
                Kind::Int => F::int_cast(x, d.out.dtype.into()),
                Kind::Bool => no_bool("cast"),
            };
            c.put(&d.out, y);
        }
        BaseOperationIr::CumSum(d) => cumulative(c, d, k, F::float_cumsum, F::int_cumsum, "cumsum"),
        BaseOperationIr::CumProd(d) => {
            cumulative(c, d, k, F::float_cumprod, F::int_cumprod, "cumprod")
        }
        BaseOperationIr::CumMin(d) => cumulative(c, d, k, F::float_cummin, F::int_cummin, "cummin"),
        BaseOperationIr::CumMax(d) => cumulative(c, d, k, F::float_cummax, F::int_cummax, "cummax"),
        BaseOperationIr::Empty(out) => {
            let s = out.shape.clone();
            let y = match k {
                Kind::Float => F::float_empty(s, &DEV, out.dtype.into()),
                Kind::Int => F::int_empty(s, &DEV, out.dtype.into()),
                Kind::Bool => F::bool_empty(s, &DEV),
            };
            c.put(out, y);
        }
    }
}

fn cumulative(
    c: &Operands,
    d: &burn_ir::DimOpIr,
    k: Kind,
    fl: fn(NdArrayTensor, usize) -> NdArrayTensor,
    int: fn(NdArrayTensor, usize) -> NdArrayTensor,
    what: &str,
) {
    let x = c.get(&d.input);
    let y = match k {
        Kind::Float => fl(x, d.axis),
        Kind::Int => int(x, d.axis),
        Kind::Bool => no_bool(what),
    };
    c.put(&d.out, y);
}

/// The numeric ops of one element kind: `$p` names the backend's function of each op.
macro_rules! numeric {
    ($op:ident, $c:ident, $e:ty,
     add $add:path, add_scalar $adds:path, sub $sub:path, sub_scalar $subs:path,
     div $div:path, div_scalar $divs:path, rem $rem:path, rem_scalar $rems:path,
     mul $mul:path, mul_scalar $muls:path, abs $abs:path,
     ones $ones:expr, zeros $zeros:expr, full $full:expr,
     gather $gather:path, scatter $scatter:path, select $select:path,
     select_assign $select_assign:path, mask_where $mask_where:path, mask_fill $mask_fill:path,
     mean_dim $mean_dim:path, mean $mean:path, sum $sum:path, sum_dim $sum_dim:path,
     prod $prod:path, prod_dim $prod_dim:path, equal_elem $equal_elem:path,
     greater $greater:path, greater_elem $greater_elem:path,
     greater_equal $greater_equal:path, greater_equal_elem $greater_equal_elem:path,
     lower $lower:path, lower_elem $lower_elem:path,
     lower_equal $lower_equal:path, lower_equal_elem $lower_equal_elem:path,
     argmax $argmax:path, argmin $argmin:path, max $max:path,
     max_dim_with_indices $max_dwi:path, min_dim_with_indices $min_dwi:path, min $min:path,
     max_dim $max_dim:path, min_dim $min_dim:path, max_abs $max_abs:path,
     max_abs_dim $max_abs_dim:path, clamp $clamp:path, random $random:path, powf $powf:path) => {
        match $op {
            NumericOperationIr::Add(d) => binary!($c, d, $add),
            NumericOperationIr::AddScalar(d) => scalar!($c, d, $adds, $e),
            NumericOperationIr::Sub(d) => binary!($c, d, $sub),
            NumericOperationIr::SubScalar(d) => scalar!($c, d, $subs, $e),
            NumericOperationIr::Div(d) => binary!($c, d, $div),
            NumericOperationIr::DivScalar(d) => scalar!($c, d, $divs, $e),
            NumericOperationIr::Rem(d) => binary!($c, d, $rem),
            NumericOperationIr::RemScalar(d) => scalar!($c, d, $rems, $e),
            NumericOperationIr::Mul(d) => binary!($c, d, $mul),
            NumericOperationIr::MulScalar(d) => scalar!($c, d, $muls, $e),
            NumericOperationIr::Abs(d) => unary!($c, d, $abs),
            NumericOperationIr::Ones(out) => $c.put(out, $ones(out)),
            NumericOperationIr::Zeros(out) => $c.put(out, $zeros(out)),
            NumericOperationIr::Full((out, v)) => $c.put(out, $full(out, v.elem::<$e>())),
            NumericOperationIr::Gather(d) => {
                let t = $c.get(&d.tensor);
                let i = $c.get(&d.indices);
                $c.put(&d.out, $gather(d.dim, t, i));
            }
            NumericOperationIr::Scatter(d) => {
                let t = $c.get(&d.tensor);
                let i = $c.get(&d.indices);
                let v = $c.get(&d.value);
                $c.put(&d.out, $scatter(d.dim, t, i, v));
            }
            NumericOperationIr::Select(d) => {
                let t = $c.get(&d.tensor);
                let i = $c.get(&d.indices);
                $c.put(&d.out, $select(t, d.dim, i));
            }
            NumericOperationIr::SelectAssign(d) => {
                let t = $c.get(&d.tensor);
                let i = $c.get(&d.indices);
                let v = $c.get(&d.value);
                $c.put(&d.out, $select_assign(t, d.dim, i, v));
            }
            NumericOperationIr::MaskWhere(d) => {
                let t = $c.get(&d.tensor);
                let m = $c.get(&d.mask);
                let v = $c.get(&d.value);
                $c.put(&d.out, $mask_where(t, m, v));
            }
            NumericOperationIr::MaskFill(d) => {
                let t = $c.get(&d.tensor);
                let m = $c.get(&d.mask);
                $c.put(&d.out, $mask_fill(t, m, d.value.elem::<$e>()));
            }
            NumericOperationIr::MeanDim(d) => reduce_dim!($c, d, $mean_dim),
            NumericOperationIr::Mean(d) => unary!($c, d, $mean),
            NumericOperationIr::Sum(d) => unary!($c, d, $sum),
            NumericOperationIr::SumDim(d) => reduce_dim!($c, d, $sum_dim),
            NumericOperationIr::Prod(d) => unary!($c, d, $prod),
            NumericOperationIr::ProdDim(d) => reduce_dim!($c, d, $prod_dim),
            NumericOperationIr::EqualElem(d) => scalar!($c, d, $equal_elem, $e),
            NumericOperationIr::Greater(d) => binary!($c, d, $greater),
            NumericOperationIr::GreaterElem(d) => scalar!($c, d, $greater_elem, $e),
            NumericOperationIr::GreaterEqual(d) => binary!($c, d, $greater_equal),
            NumericOperationIr::GreaterEqualElem(d) => scalar!($c, d, $greater_equal_elem, $e),
            NumericOperationIr::Lower(d) => binary!($c, d, $lower),
            NumericOperationIr::LowerElem(d) => scalar!($c, d, $lower_elem, $e),
            NumericOperationIr::LowerEqual(d) => binary!($c, d, $lower_equal),
            NumericOperationIr::LowerEqualElem(d) => scalar!($c, d, $lower_equal_elem, $e),
            NumericOperationIr::ArgMax(d) => reduce_dim!($c, d, $argmax),
            NumericOperationIr::ArgMin(d) => reduce_dim!($c, d, $argmin),
            NumericOperationIr::Max(d) => unary!($c, d, $max),
            NumericOperationIr::MaxDimWithIndices(d) => {
                let t = $c.get(&d.tensor);
                let (v, i) = $max_dwi(t, d.dim);
                $c.put(&d.out, v);
                $c.put(&d.out_indices, i);
            }
            NumericOperationIr::MinDimWithIndices(d) => {
                let t = $c.get(&d.tensor);
                let (v, i) = $min_dwi(t, d.dim);
                $c.put(&d.out, v);
                $c.put(&d.out_indices, i);
            }
            NumericOperationIr::Min(d) => unary!($c, d, $min),
            NumericOperationIr::MaxDim(d) => reduce_dim!($c, d, $max_dim),
            NumericOperationIr::MinDim(d) => reduce_dim!($c, d, $min_dim),
            NumericOperationIr::MaxAbs(d) => unary!($c, d, $max_abs),
            NumericOperationIr::MaxAbsDim(d) => reduce_dim!($c, d, $max_abs_dim),
            NumericOperationIr::Clamp(d) => {
                let t = $c.get(&d.tensor);
                $c.put(&d.out, $clamp(t, d.min.elem::<$e>(), d.max.elem::<$e>()));
            }
            NumericOperationIr::IntRandom(d) => {
                $c.put(&d.out, $random(d.out.shape.clone(), d.distribution, &DEV))
            }
            NumericOperationIr::Powf(d) => binary!($c, d, $powf),
        }
    };
}

fn numeric_float(op: &NumericOperationIr, c: &Operands) {
    type F = Inner;
    numeric!(op, c, FloatElem,
        add F::float_add, add_scalar F::float_add_scalar, sub F::float_sub,
        sub_scalar F::float_sub_scalar, div F::float_div, div_scalar F::float_div_scalar,
        rem F::float_remainder, rem_scalar F::float_remainder_scalar, mul F::float_mul,
        mul_scalar F::float_mul_scalar, abs F::float_abs,
        ones |o: &TensorIr| F::float_ones(o.shape.clone(), &DEV, o.dtype.into()),
        zeros |o: &TensorIr| F::float_zeros(o.shape.clone(), &DEV, o.dtype.into()),
        full |o: &TensorIr, v| F::float_full(o.shape.clone(), v, &DEV, o.dtype.into()),
        gather F::float_gather, scatter F::float_scatter, select F::float_select,
        select_assign F::float_select_assign, mask_where F::float_mask_where,
        mask_fill F::float_mask_fill, mean_dim F::float_mean_dim, mean F::float_mean,
        sum F::float_sum, sum_dim F::float_sum_dim, prod F::float_prod,
        prod_dim F::float_prod_dim, equal_elem F::float_equal_elem,
        greater F::float_greater, greater_elem F::float_greater_elem,
        greater_equal F::float_greater_equal, greater_equal_elem F::float_greater_equal_elem,
        lower F::float_lower, lower_elem F::float_lower_elem,
        lower_equal F::float_lower_equal, lower_equal_elem F::float_lower_equal_elem,
        argmax F::float_argmax, argmin F::float_argmin, max F::float_max,
        max_dim_with_indices F::float_max_dim_with_indices,
        min_dim_with_indices F::float_min_dim_with_indices, min F::float_min,
        max_dim F::float_max_dim, min_dim F::float_min_dim, max_abs F::float_max_abs,
        max_abs_dim F::float_max_abs_dim, clamp F::float_clamp, random F::float_random,
        powf F::float_powf)
}

fn numeric_int(op: &NumericOperationIr, c: &Operands) {
    type F = Inner;
    numeric!(op, c, IntElem,
        add F::int_add, add_scalar F::int_add_scalar, sub F::int_sub,
        sub_scalar F::int_sub_scalar, div F::int_div, div_scalar F::int_div_scalar,
        rem F::int_remainder, rem_scalar F::int_remainder_scalar, mul F::int_mul,
        mul_scalar F::int_mul_scalar, abs F::int_abs,
        ones |o: &TensorIr| F::int_ones(o.shape.clone(), &DEV, o.dtype.into()),
        zeros |o: &TensorIr| F::int_zeros(o.shape.clone(), &DEV, o.dtype.into()),
        full |o: &TensorIr, v| F::int_full(o.shape.clone(), v, &DEV, o.dtype.into()),
        gather F::int_gather, scatter F::int_scatter, select F::int_select,
        select_assign F::int_select_assign, mask_where F::int_mask_where,
        mask_fill F::int_mask_fill, mean_dim F::int_mean_dim, mean F::int_mean,
        sum F::int_sum, sum_dim F::int_sum_dim, prod F::int_prod,
        prod_dim F::int_prod_dim, equal_elem F::int_equal_elem,
        greater F::int_greater, greater_elem F::int_greater_elem,
        greater_equal F::int_greater_equal, greater_equal_elem F::int_greater_equal_elem,
        lower F::int_lower, lower_elem F::int_lower_elem,
        lower_equal F::int_lower_equal, lower_equal_elem F::int_lower_equal_elem,
        argmax F::int_argmax, argmin F::int_argmin, max F::int_max,
        max_dim_with_indices F::int_max_dim_with_indices,
        min_dim_with_indices F::int_min_dim_with_indices, min F::int_min,
        max_dim F::int_max_dim, min_dim F::int_min_dim, max_abs F::int_max_abs,
        max_abs_dim F::int_max_abs_dim, clamp F::int_clamp, random F::int_random,
        powf F::int_powf)
}

fn float(op: &FloatOperationIr, c: &Operands) {
    type F = Inner;
    match op {
        FloatOperationIr::Exp(d) => unary!(c, d, F::float_exp),
        FloatOperationIr::Log(d) => unary!(c, d, F::float_log),
        FloatOperationIr::Log1p(d) => unary!(c, d, F::float_log1p),
        FloatOperationIr::Erf(d) => unary!(c, d, F::float_erf),
        FloatOperationIr::PowfScalar(d) => scalar!(c, d, F::float_powf_scalar, f32),
        FloatOperationIr::Sqrt(d) => unary!(c, d, F::float_sqrt),
        FloatOperationIr::Cos(d) => unary!(c, d, F::float_cos),
        FloatOperationIr::Sin(d) => unary!(c, d, F::float_sin),
        FloatOperationIr::Tanh(d) => unary!(c, d, F::float_tanh),
        FloatOperationIr::Round(d) => unary!(c, d, F::float_round),
        FloatOperationIr::Floor(d) => unary!(c, d, F::float_floor),
        FloatOperationIr::Ceil(d) => unary!(c, d, F::float_ceil),
        FloatOperationIr::Trunc(d) => unary!(c, d, F::float_trunc),
        FloatOperationIr::IntoInt(d) => unary!(c, d, F::float_into_int),
        FloatOperationIr::Matmul(d) => binary!(c, d, F::float_matmul),
        FloatOperationIr::Cross(d) => {
            let l = c.get(&d.lhs);
            let r = c.get(&d.rhs);
            c.put(&d.out, F::float_cross(l, r, d.dim));
        }
        FloatOperationIr::Random(d) => c.put(
            &d.out,
            F::float_random(d.out.shape.clone(), d.distribution, &DEV),
        ),
        FloatOperationIr::Recip(d) => unary!(c, d, F::float_recip),
        FloatOperationIr::IsNan(d) => unary!(c, d, F::float_is_nan),
        FloatOperationIr::IsInf(d) => unary!(c, d, F::float_is_inf),
        FloatOperationIr::Quantize(_) | FloatOperationIr::Dequantize(_) => {
            panic!("ivm-burn: quantization is not supported through burn's router")
        }
    }
}

fn int(op: &IntOperationIr, c: &Operands) {
    type F = Inner;
    match op {
        IntOperationIr::IntoFloat(d) => unary!(c, d, F::int_into_float),
        IntOperationIr::BitwiseAnd(d) => binary!(c, d, F::bitwise_and),
        IntOperationIr::BitwiseAndScalar(d) => scalar!(c, d, F::bitwise_and_scalar, IntElem),
        IntOperationIr::BitwiseOr(d) => binary!(c, d, F::bitwise_or),
        IntOperationIr::BitwiseOrScalar(d) => scalar!(c, d, F::bitwise_or_scalar, IntElem),
        IntOperationIr::BitwiseXor(d) => binary!(c, d, F::bitwise_xor),
        IntOperationIr::BitwiseXorScalar(d) => scalar!(c, d, F::bitwise_xor_scalar, IntElem),
        IntOperationIr::BitwiseNot(d) => unary!(c, d, F::bitwise_not),
        IntOperationIr::BitwiseLeftShift(d) => binary!(c, d, F::bitwise_left_shift),
        IntOperationIr::BitwiseLeftShiftScalar(d) => {
            scalar!(c, d, F::bitwise_left_shift_scalar, IntElem)
        }
        IntOperationIr::BitwiseRightShift(d) => binary!(c, d, F::bitwise_right_shift),
        IntOperationIr::BitwiseRightShiftScalar(d) => {
            scalar!(c, d, F::bitwise_right_shift_scalar, IntElem)
        }
        IntOperationIr::Matmul(d) => binary!(c, d, F::int_matmul),
    }
}

fn boolean(op: &BoolOperationIr, c: &Operands) {
    type F = Inner;
    match op {
        BoolOperationIr::Zeros(out) => c.put(out, F::bool_zeros(out.shape.clone(), &DEV)),
        BoolOperationIr::Ones(out) => c.put(out, F::bool_ones(out.shape.clone(), &DEV)),
        BoolOperationIr::IntoFloat(d) => unary!(c, d, F::bool_into_float),
        BoolOperationIr::IntoInt(d) => unary!(c, d, F::bool_into_int),
        BoolOperationIr::Not(d) => unary!(c, d, F::bool_not),
        BoolOperationIr::And(d) => binary!(c, d, F::bool_and),
        BoolOperationIr::Or(d) => binary!(c, d, F::bool_or),
    }
}

fn module(op: &ModuleOperationIr, c: &Operands) {
    type F = Inner;
    match op {
        ModuleOperationIr::Embedding(d) => {
            let w = c.get(&d.weights);
            let i = c.get(&d.indices);
            c.put(&d.out, F::embedding(w, i));
        }
        ModuleOperationIr::EmbeddingBackward(d) => {
            let w = c.get(&d.weights);
            let g = c.get(&d.out_grad);
            let i = c.get(&d.indices);
            c.put(&d.out, F::embedding_backward(w, g, i));
        }
        ModuleOperationIr::Conv1d(d) => {
            let (x, w, b) = (c.get(&d.x), c.get(&d.weight), c.get_opt(&d.bias));
            c.put(&d.out, F::conv1d(x, w, b, d.options.clone().into()));
        }
        ModuleOperationIr::Conv2d(d) => {
            let (x, w, b) = (c.get(&d.x), c.get(&d.weight), c.get_opt(&d.bias));
            c.put(&d.out, F::conv2d(x, w, b, d.options.clone().into()));
        }
        ModuleOperationIr::Conv3d(d) => {
            let (x, w, b) = (c.get(&d.x), c.get(&d.weight), c.get_opt(&d.bias));
            c.put(&d.out, F::conv3d(x, w, b, d.options.clone().into()));
        }
        ModuleOperationIr::DeformableConv2d(d) => {
            let x = c.get(&d.x);
            let o = c.get(&d.offset);
            let w = c.get(&d.weight);
            let m = c.get_opt(&d.mask);
            let b = c.get_opt(&d.bias);
            c.put(
                &d.out,
                F::deform_conv2d(x, o, w, m, b, d.options.clone().into()),
            );
        }
        ModuleOperationIr::DeformableConv2dBackward(d) => {
            let x = c.get(&d.x);
            let o = c.get(&d.offset);
            let w = c.get(&d.weight);
            let m = c.get_opt(&d.mask);
            let b = c.get_opt(&d.bias);
            let g = c.get(&d.out_grad);
            let r = F::deform_conv2d_backward(x, o, w, m, b, g, d.options.clone().into());
            c.put(&d.input_grad, r.x_grad);
            c.put(&d.offset_grad, r.offset_grad);
            c.put(&d.weight_grad, r.weight_grad);
            if let (Some(ir), Some(t)) = (&d.mask_grad, r.mask_grad) {
                c.put(ir, t);
            }
            if let (Some(ir), Some(t)) = (&d.bias_grad, r.bias_grad) {
                c.put(ir, t);
            }
        }
        ModuleOperationIr::ConvTranspose1d(d) => {
            let (x, w, b) = (c.get(&d.x), c.get(&d.weight), c.get_opt(&d.bias));
            c.put(
                &d.out,
                F::conv_transpose1d(x, w, b, d.options.clone().into()),
            );
        }
        ModuleOperationIr::ConvTranspose2d(d) => {
            let (x, w, b) = (c.get(&d.x), c.get(&d.weight), c.get_opt(&d.bias));
            c.put(
                &d.out,
                F::conv_transpose2d(x, w, b, d.options.clone().into()),
            );
        }
        ModuleOperationIr::ConvTranspose3d(d) => {
            let (x, w, b) = (c.get(&d.x), c.get(&d.weight), c.get_opt(&d.bias));
            c.put(
                &d.out,
                F::conv_transpose3d(x, w, b, d.options.clone().into()),
            );
        }
        ModuleOperationIr::AvgPool1d(d) => {
            let x = c.get(&d.x);
            let y = F::avg_pool1d(x, d.kernel_size, d.stride, d.padding, d.count_include_pad);
            c.put(&d.out, y);
        }
        ModuleOperationIr::AvgPool2d(d) => {
            let x = c.get(&d.x);
            let y = F::avg_pool2d(x, d.kernel_size, d.stride, d.padding, d.count_include_pad);
            c.put(&d.out, y);
        }
        ModuleOperationIr::AvgPool1dBackward(d) => {
            let (x, g) = (c.get(&d.x), c.get(&d.grad));
            let y = F::avg_pool1d_backward(
                x,
                g,
                d.kernel_size,
                d.stride,
                d.padding,
                d.count_include_pad,
            );
            c.put(&d.out, y);
        }
        ModuleOperationIr::AvgPool2dBackward(d) => {
            let (x, g) = (c.get(&d.x), c.get(&d.grad));
            let y = F::avg_pool2d_backward(
                x,
                g,
                d.kernel_size,
                d.stride,
                d.padding,
                d.count_include_pad,
            );
            c.put(&d.out, y);
        }
        ModuleOperationIr::AdaptiveAvgPool1d(d) => {
            let x = c.get(&d.x);
            c.put(&d.out, F::adaptive_avg_pool1d(x, d.output_size));
        }
        ModuleOperationIr::AdaptiveAvgPool2d(d) => {
            let x = c.get(&d.x);
            c.put(&d.out, F::adaptive_avg_pool2d(x, d.output_size));
        }
        ModuleOperationIr::AdaptiveAvgPool1dBackward(d) => {
            let (x, g) = (c.get(&d.x), c.get(&d.grad));
            c.put(&d.out, F::adaptive_avg_pool1d_backward(x, g));
        }
        ModuleOperationIr::AdaptiveAvgPool2dBackward(d) => {
            let (x, g) = (c.get(&d.x), c.get(&d.grad));
            c.put(&d.out, F::adaptive_avg_pool2d_backward(x, g));
        }
        ModuleOperationIr::MaxPool1d(d) => {
            let x = c.get(&d.x);
            let y = F::max_pool1d(x, d.kernel_size, d.stride, d.padding, d.dilation);
            c.put(&d.out, y);
        }
        ModuleOperationIr::MaxPool1dWithIndices(d) => {
            let x = c.get(&d.x);
            let r = F::max_pool1d_with_indices(x, d.kernel_size, d.stride, d.padding, d.dilation);
            c.put(&d.out, r.output);
            c.put(&d.out_indices, r.indices);
        }
        ModuleOperationIr::MaxPool1dWithIndicesBackward(d) => {
            let (x, g, i) = (c.get(&d.x), c.get(&d.grad), c.get(&d.indices));
            let r = F::max_pool1d_with_indices_backward(
                x,
                d.kernel_size,
                d.stride,
                d.padding,
                d.dilation,
                g,
                i,
            );
            c.put(&d.out, r.x_grad);
        }
        ModuleOperationIr::MaxPool2d(d) => {
            let x = c.get(&d.x);
            let y = F::max_pool2d(x, d.kernel_size, d.stride, d.padding, d.dilation);
            c.put(&d.out, y);
        }
        ModuleOperationIr::MaxPool2dWithIndices(d) => {
            let x = c.get(&d.x);
            let r = F::max_pool2d_with_indices(x, d.kernel_size, d.stride, d.padding, d.dilation);
            c.put(&d.out, r.output);
            c.put(&d.out_indices, r.indices);
        }
        ModuleOperationIr::MaxPool2dWithIndicesBackward(d) => {
            let (x, g, i) = (c.get(&d.x), c.get(&d.grad), c.get(&d.indices));
            let r = F::max_pool2d_with_indices_backward(
                x,
                d.kernel_size,
                d.stride,
                d.padding,
                d.dilation,
                g,
                i,
            );
            c.put(&d.out, r.x_grad);
        }
        ModuleOperationIr::Interpolate(d) => {
            let x = c.get(&d.x);
            c.put(
                &d.out,
                F::interpolate(x, d.output_size, d.options.clone().into()),
            );
        }
        ModuleOperationIr::InterpolateBackward(d) => {
            let (x, g) = (c.get(&d.x), c.get(&d.grad));
            c.put(
                &d.out,
                F::interpolate_backward(x, g, d.output_size, d.options.clone().into()),
            );
        }
    }
}

/// Whether `dtype` is a float, int or bool tensor (for data registered by the caller).
pub(crate) fn from_data(data: burn_tensor::TensorData) -> NdArrayTensor {
    type F = Inner;
    match data.dtype {
        DType::Bool => F::bool_from_data(data, &DEV),
        d if d.is_float() => F::float_from_data(data, &DEV),
        d if d.is_int() || d.is_uint() => F::int_from_data(data, &DEV),
        d => panic!("ivm-burn: tensors of {d:?} are not supported through burn's router"),
    }
}

/// The data of a tensor of `dtype` (the caller's side of a read).
pub(crate) fn into_data(t: NdArrayTensor, dtype: DType) -> burn_tensor::TensorData {
    type F = Inner;
    use burn_common::future::block_on;
    match dtype {
        DType::Bool => block_on(F::bool_into_data(t)),
        d if d.is_float() => block_on(F::float_into_data(t)),
        _ => block_on(F::int_into_data(t)),
    }
}

/// The ops that draw from ndarray's process-wide random generator: they keep their
/// submission order (one stream), so a seeded run draws the same numbers.
pub(crate) fn draws_random(op: &OperationIr) -> bool {
    matches!(
        op,
        OperationIr::Float(_, FloatOperationIr::Random(_))
            | OperationIr::NumericFloat(_, NumericOperationIr::IntRandom(_))
            | OperationIr::NumericInt(_, NumericOperationIr::IntRandom(_))
    )
}

/// Every tensor `op` reads or writes. burn-ir's `OperationIr::nodes` gives that set, except
/// that burn-ir 0.19.1 leaves out the outputs of the deformable convolution and of its
/// backward pass; they are added here (without them the op would write tensors the engine
/// does not know it writes).
pub(crate) fn operands(op: &OperationIr) -> Vec<&TensorIr> {
    let mut nodes = op.nodes();
    match op {
        OperationIr::Module(ModuleOperationIr::DeformableConv2d(d)) => nodes.push(&d.out),
        OperationIr::Module(ModuleOperationIr::DeformableConv2dBackward(d)) => {
            nodes.extend([&d.input_grad, &d.offset_grad, &d.weight_grad]);
            nodes.extend(d.mask_grad.iter().chain(&d.bias_grad));
        }
        _ => {}
    }
    nodes
}
