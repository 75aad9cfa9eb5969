//! Two of burn's ops run as one kernel: `lower_equal_elem` with a scalar, and the mask fill
//! that consumes its mask.
//!
//! burn's router has no ReLU of its own: `ActivationOps`' defaults send ReLU as
//! `mask = lower_equal_elem(x, 0)` then `mask_fill(x, mask, 0)`, and its backward pass as
//! `mask = lower_equal_elem(x, 0)` then `mask_fill(grad, mask, 0)` (burn-autodiff keeps
//! ReLU's input for it). burn-ndarray called directly runs its own ReLU forward, one
//! in-place pass, and the same pair backward. Each pair makes a bool array, copies the
//! filled tensor and walks both again with a branch per element. The client holds such a
//! comparison back for one op (`client.rs`); when the next op is the mask fill that
//! consumes its mask, the two become one instruction running [`FillWhereLe`], which gives
//! every element the pair's bits (NaN and signed zeros included) and the output the pair's
//! memory layout, without the mask: the tests compare bits and strides. ARCHITECTURE.md
//! ("ivm-burn") says why the client fuses this pair and no other.

use burn_ir::{NumericOperationIr, OperationIr, TensorIr, TensorStatus};
use burn_ndarray::{NdArrayTensor, SharedArray};
use burn_tensor::DType;
use ndarray::Zip;

use crate::dispatch::{FloatElem, Operands};

/// `out[i] = if lhs[i] <= threshold { fill } else { tensor[i] }`: burn's
/// `mask_fill(tensor, lower_equal_elem(lhs, threshold), fill)` with `lhs` and `tensor` of
/// one shape (possibly one tensor), without the mask.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FillWhereLe {
    /// The compared tensor, with the comparison's status.
    pub(crate) lhs: TensorIr,
    /// The filled tensor, with the mask fill's status.
    pub(crate) tensor: TensorIr,
    pub(crate) out: TensorIr,
    pub(crate) threshold: FloatElem,
    pub(crate) fill: FloatElem,
}

impl FillWhereLe {
    /// Whether `op` may be the first of a fused pair: a float comparison with a scalar
    /// whose f32 tensor is compared element by element.
    pub(crate) fn may_start(op: &OperationIr) -> bool {
        matches!(
            op,
            OperationIr::NumericFloat(DType::F32, NumericOperationIr::LowerEqualElem(d))
                if d.lhs.dtype == DType::F32
        )
    }

    /// The fused form of `cmp` then `fill`, if `fill` is a mask fill of an f32 tensor of
    /// `cmp`'s shape whose mask is `cmp`'s output, consumed here (no other op can read it).
    pub(crate) fn pair(cmp: &OperationIr, fill: &OperationIr) -> Option<Self> {
        let OperationIr::NumericFloat(DType::F32, NumericOperationIr::LowerEqualElem(c)) = cmp
        else {
            return None;
        };
        let OperationIr::NumericFloat(DType::F32, NumericOperationIr::MaskFill(f)) = fill else {
            return None;
        };
        let fits = f.mask.id == c.out.id
            && f.mask.status == TensorStatus::ReadWrite
            && c.lhs.dtype == DType::F32
            && f.tensor.dtype == DType::F32
            && f.tensor.shape == c.lhs.shape
            // The comparison consumed its input: the fill cannot read it again.
            && !(f.tensor.id == c.lhs.id && c.lhs.status == TensorStatus::ReadWrite);
        fits.then(|| Self {
            lhs: c.lhs.clone(),
            tensor: f.tensor.clone(),
            out: f.out.clone(),
            threshold: c.rhs.elem::<FloatElem>(),
            fill: f.value.elem::<FloatElem>(),
        })
    }

    /// The tensors the kernel reads and writes: the two inputs, then the output.
    pub(crate) fn operands(&self) -> Vec<&TensorIr> {
        vec![&self.lhs, &self.tensor, &self.out]
    }

    /// The kernel. The filled tensor is copied the way burn-ndarray's `mask_fill` copies
    /// it (`copy_like_mask_fill`), so the output has the pair's memory layout too, and a
    /// later op that walks it by its layout (a sum) rounds the same way.
    pub(crate) fn run(&self, c: &Operands) {
        let (t, f) = (self.threshold, self.fill);
        let out = if self.lhs.id == self.tensor.id {
            // ReLU's forward pass: one tensor, with the fill's (the stronger) status.
            let mut x = copy_like_mask_fill(f32_array(c.get(&self.tensor)));
            match x.as_slice_memory_order_mut() {
                Some(xs) => xs.iter_mut().for_each(|v| *v = select(*v <= t, f, *v)),
                None => x.mapv_inplace(|v| select(v <= t, f, v)),
            }
            x
        } else {
            let lhs = f32_array(c.get(&self.lhs));
            let mut x = copy_like_mask_fill(f32_array(c.get(&self.tensor)));
            let fill_where = |o: &mut f32, l: f32| *o = select(l <= t, f, *o);
            let same_order = x.strides() == lhs.strides();
            match (
                same_order,
                lhs.as_slice_memory_order(),
                x.as_slice_memory_order_mut(),
            ) {
                // One memory order, no gaps: element k of one slice is element k of the
                // other. A plain loop over slices, where ndarray's `Zip` over dynamic
                // dimensions (burn-ndarray's `mask_fill` uses it) costs several times more.
                (true, Some(l), Some(o)) => {
                    for (o, &l) in o.iter_mut().zip(l) {
                        fill_where(o, l);
                    }
                }
                _ => Zip::from(&mut x)
                    .and(&lhs)
                    .for_each(|o, &l| fill_where(o, l)),
            }
            x
        };
        c.put(&self.out, NdArrayTensor::F32(out));
    }
}

/// `if c { a } else { b }` as bit masks: the compiler vectorises it, where a branch
/// mispredicts on about every other element of ReLU's data (a kernel several times
/// slower). The result's bits are `a`'s or `b`'s, so NaN payloads and signed zeros pass
/// through as the pair passes them.
#[inline(always)]
fn select(c: bool, a: f32, b: f32) -> f32 {
    let m = 0u32.wrapping_sub(u32::from(c));
    f32::from_bits((a.to_bits() & m) | (b.to_bits() & !m))
}

/// `x`, copied as burn-ndarray's `mask_fill` copies its tensor: it clones the handle and
/// writes through the clone, so ndarray's copy on write always copies, and picks the copy's
/// layout from the view and its buffer (a gapped view over at most half of its buffer
/// becomes standard; otherwise the strides stay). Writing in place instead would keep a
/// gapped view's strides, and a later sum over it would round differently. The copy costs
/// about what the pair's own copy cost; it is not where the fused kernel saves.
fn copy_like_mask_fill(x: SharedArray<f32>) -> SharedArray<f32> {
    let mut output = x.clone();
    output.view_mut();
    drop(x);
    output
}

fn f32_array(t: NdArrayTensor) -> SharedArray<f32> {
    match t {
        NdArrayTensor::F32(a) => a,
        // The ops' IR said f32 (`pair`); burn-ndarray's kernels would fail alike.
        other => panic!(
            "ivm-burn: fused compare-and-fill expected an f32 tensor, got {:?}",
            burn_tensor::TensorMetadata::dtype(&other)
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn_ir::{MaskFillOpIr, ScalarIr, ScalarOpIr, TensorId};
    use burn_tensor::Shape;
    use burn_tensor::ops::FloatTensorOps;

    use super::*;
    use crate::dispatch::{Inner, Slot};

    fn ir(id: u64, dims: &[usize], status: TensorStatus, dtype: DType) -> TensorIr {
        TensorIr {
            id: TensorId::new(id),
            shape: Shape::from(dims.to_vec()),
            status,
            dtype,
        }
    }

    fn cmp(lhs: TensorIr, mask: u64, threshold: f32) -> OperationIr {
        let out = ir(mask, &lhs.shape.dims, TensorStatus::NotInit, DType::Bool);
        OperationIr::NumericFloat(
            DType::F32,
            NumericOperationIr::LowerEqualElem(ScalarOpIr {
                lhs,
                rhs: ScalarIr::F32(threshold),
                out,
            }),
        )
    }

    fn fill(tensor: TensorIr, mask: TensorIr, value: f32, out: u64) -> OperationIr {
        let out = ir(out, &tensor.shape.dims, TensorStatus::NotInit, DType::F32);
        OperationIr::NumericFloat(
            DType::F32,
            NumericOperationIr::MaskFill(MaskFillOpIr {
                tensor,
                mask,
                value: ScalarIr::F32(value),
                out,
            }),
        )
    }

    /// Values at and around every edge of `<=`: NaN, both zeros, both infinities.
    fn edgy(n: usize, salt: f32) -> Vec<f32> {
        let edges = [
            f32::NAN,
            -0.0,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.5,
            -0.5,
        ];
        (0..n)
            .map(|i| match i % 9 {
                k if k < edges.len() => edges[k],
                _ => ((i as f32) * 0.731 + salt).sin(),
            })
            .collect()
    }

    fn array(v: Vec<f32>, rows: usize, transposed: bool) -> NdArrayTensor {
        let a = ndarray::Array::from_shape_vec((rows, v.len() / rows), v).unwrap();
        let a = if transposed {
            // The same values in column-major memory order.
            a.t().as_standard_layout().t().to_owned()
        } else {
            a
        };
        assert_eq!(a.is_standard_layout(), !transposed || rows == 1);
        NdArrayTensor::F32(a.into_dyn().into_shared())
    }

    trait FloatArray {
        fn float_array(self) -> ndarray::ArcArray<f32, ndarray::Ix2>;
    }

    impl FloatArray for NdArrayTensor {
        fn float_array(self) -> ndarray::ArcArray<f32, ndarray::Ix2> {
            let NdArrayTensor::F32(a) = self else {
                panic!("not f32")
            };
            a.into_dimensionality().unwrap()
        }
    }

    fn bits_and_strides(t: NdArrayTensor) -> (Vec<u32>, Vec<isize>) {
        let NdArrayTensor::F32(a) = t else {
            panic!("not f32")
        };
        (
            a.iter().map(|x| x.to_bits()).collect(),
            a.strides().to_vec(),
        )
    }

    /// Runs `f` with the values of `ids` in their slots and returns `out`'s value.
    fn run(f: &FillWhereLe, values: Vec<(u64, NdArrayTensor)>) -> NdArrayTensor {
        let mut c = Operands::default();
        for (id, v) in values {
            c.slots.push((TensorId::new(id), Arc::new(Slot::with(v))));
        }
        c.slots.push((f.out.id, Arc::new(Slot::default())));
        f.run(&c);
        c.slots
            .iter()
            .find(|(id, _)| *id == f.out.id)
            .and_then(|(_, s)| s.cloned())
            .expect("the kernel wrote its output")
    }

    #[test]
    fn relu_forward_matches_the_pair_bit_for_bit() {
        for (threshold, value) in [(0.0, 0.0), (0.5, -1.0), (-0.0, f32::NAN)] {
            for transposed in [false, true] {
                let x = array(edgy(6 * 10, 0.3), 6, transposed);
                let want = Inner::float_mask_fill(
                    x.clone(),
                    Inner::float_lower_equal_elem(x.clone(), threshold),
                    value,
                );
                let xi = ir(1, &[6, 10], TensorStatus::ReadOnly, DType::F32);
                let mut xw = xi.clone();
                xw.status = TensorStatus::ReadWrite;
                let mask = ir(2, &[6, 10], TensorStatus::ReadWrite, DType::Bool);
                let f = FillWhereLe::pair(&cmp(xi, 2, threshold), &fill(xw, mask, value, 3))
                    .expect("ReLU's pair fuses");
                let got = run(&f, vec![(1, x)]);
                assert_eq!(
                    bits_and_strides(got),
                    bits_and_strides(want),
                    "threshold {threshold}, fill {value}, transposed {transposed}"
                );
            }
        }
    }

    #[test]
    fn relu_backward_matches_the_pair_bit_for_bit() {
        for (lhs_t, grad_t) in [(false, false), (true, false), (false, true)] {
            let out = array(edgy(4 * 8, 0.1), 4, lhs_t);
            let grad = array(edgy(4 * 8, 1.7).into_iter().rev().collect(), 4, grad_t);
            let want = Inner::float_mask_fill(
                grad.clone(),
                Inner::float_lower_equal_elem(out.clone(), 0.0),
                0.0,
            );
            let lhs = ir(1, &[4, 8], TensorStatus::ReadWrite, DType::F32);
            let tensor = ir(2, &[4, 8], TensorStatus::ReadWrite, DType::F32);
            let mask = ir(3, &[4, 8], TensorStatus::ReadWrite, DType::Bool);
            let f = FillWhereLe::pair(&cmp(lhs, 3, 0.0), &fill(tensor, mask, 0.0, 4))
                .expect("ReLU backward's pair fuses");
            let got = run(&f, vec![(1, out), (2, grad)]);
            assert_eq!(
                bits_and_strides(got),
                bits_and_strides(want),
                "lhs transposed {lhs_t}, grad transposed {grad_t}"
            );
        }
    }

    /// [4, 8] views of larger buffers: with gaps; without, in a buffer under twice their
    /// size and in one over (a copy of the first keeps its strides and buffer, of the
    /// second is compact); column-major; standard. Made afresh for each use, so that the
    /// kernel may hold the only handle.
    fn view(k: usize, salt: f32) -> SharedArray<f32> {
        use ndarray::s;
        let big = |rows, cols| {
            ndarray::Array::from_shape_vec((rows, cols), edgy(rows * cols, salt))
                .unwrap()
                .into_shared()
        };
        let v = match k {
            0 => big(6, 12).slice_move(s![0..4, 2..10]),
            1 => big(6, 8).slice_move(s![1..5, ..]),
            2 => big(10, 8).slice_move(s![3..7, ..]),
            3 => array(edgy(32, salt), 4, true).float_array(),
            _ => array(edgy(32, salt), 4, false).float_array(),
        };
        v.into_dyn()
    }

    /// The fused pair comparing `lhs` with 0 and filling `tensor` with 0.
    fn fused(lhs: TensorIr, tensor: TensorIr) -> FillWhereLe {
        let mask = ir(90, &lhs.shape.dims, TensorStatus::ReadWrite, DType::Bool);
        FillWhereLe::pair(&cmp(lhs, 90, 0.0), &fill(tensor, mask, 0.0, 91)).unwrap()
    }

    /// Runs `f` on `inputs` and compares its output with `want`, bits and strides; a
    /// handle the test `kept` must still read as `fresh`, a new copy of its values.
    fn check(
        f: &FillWhereLe,
        inputs: Vec<(u64, SharedArray<f32>)>,
        want: NdArrayTensor,
        kept: Option<(SharedArray<f32>, SharedArray<f32>)>,
        what: &str,
    ) {
        let inputs = inputs
            .into_iter()
            .map(|(id, a)| (id, NdArrayTensor::F32(a)));
        let got = run(f, inputs.collect());
        assert_eq!(bits_and_strides(got), bits_and_strides(want), "{what}");
        if let Some((k, fresh)) = kept {
            let same = k
                .iter()
                .zip(&fresh)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: a shared input was written in place");
        }
    }

    /// The pair and the fused kernel on views, each the only handle (`keep` false) or
    /// shared with the test (which must not see it written): bits and strides.
    #[test]
    fn matches_the_pair_on_views_and_shared_tensors() {
        let status = |keep| {
            if keep {
                TensorStatus::ReadOnly
            } else {
                TensorStatus::ReadWrite
            }
        };
        let f32s = NdArrayTensor::F32;
        let at = |id, status| ir(id, &[4, 8], status, DType::F32);
        for i in 0..5 {
            for keep in [false, true] {
                // The forward form: one tensor.
                let want = {
                    let x = view(i, 0.2);
                    Inner::float_mask_fill(
                        f32s(x.clone()),
                        Inner::float_lower_equal_elem(f32s(x), 0.0),
                        0.0,
                    )
                };
                let x = view(i, 0.2);
                let kept = keep.then(|| (x.clone(), view(i, 0.2)));
                let f = fused(at(1, TensorStatus::ReadOnly), at(1, status(keep)));
                let what = format!("forward, view {i}, kept {keep}");
                check(&f, vec![(1, x)], want, kept, &what);

                // The backward form: ReLU's input compared, the gradient filled.
                for j in 0..5 {
                    let want = Inner::float_mask_fill(
                        f32s(view(i, 1.7)),
                        Inner::float_lower_equal_elem(f32s(view(j, 0.4)), 0.0),
                        0.0,
                    );
                    let g = view(i, 1.7);
                    let kept = keep.then(|| (g.clone(), view(i, 1.7)));
                    let f = fused(at(1, TensorStatus::ReadWrite), at(2, status(keep)));
                    let what = format!("backward, grad view {i}, input view {j}, kept {keep}");
                    check(&f, vec![(1, view(j, 0.4)), (2, g)], want, kept, &what);
                }
            }
        }
    }

    #[test]
    fn only_a_mask_consumed_by_the_fill_of_a_same_shaped_f32_tensor_fuses() {
        let x = ir(1, &[2, 3], TensorStatus::ReadOnly, DType::F32);
        let y = ir(5, &[2, 3], TensorStatus::ReadOnly, DType::F32);
        let mask = |status| ir(2, &[2, 3], status, DType::Bool);
        let c = cmp(x.clone(), 2, 0.0);
        assert!(FillWhereLe::may_start(&c));
        assert!(
            FillWhereLe::pair(&c, &fill(y.clone(), mask(TensorStatus::ReadWrite), 0.0, 3))
                .is_some()
        );
        // The mask is read again later: it must exist.
        assert!(
            FillWhereLe::pair(&c, &fill(y.clone(), mask(TensorStatus::ReadOnly), 0.0, 3)).is_none()
        );
        // Another mask.
        let other = ir(9, &[2, 3], TensorStatus::ReadWrite, DType::Bool);
        assert!(FillWhereLe::pair(&c, &fill(y.clone(), other, 0.0, 3)).is_none());
        // A fill that broadcasts the mask.
        let wide = ir(5, &[4, 2, 3], TensorStatus::ReadOnly, DType::F32);
        assert!(
            FillWhereLe::pair(&c, &fill(wide, mask(TensorStatus::ReadWrite), 0.0, 3)).is_none()
        );
        // Not f32.
        let x64 = ir(1, &[2, 3], TensorStatus::ReadOnly, DType::F64);
        assert!(!FillWhereLe::may_start(&cmp(x64, 2, 0.0)));
        let y64 = ir(5, &[2, 3], TensorStatus::ReadOnly, DType::F64);
        assert!(FillWhereLe::pair(&c, &fill(y64, mask(TensorStatus::ReadWrite), 0.0, 3)).is_none());
        // Not a mask fill.
        assert!(FillWhereLe::pair(&c, &c).is_none());
    }
}
