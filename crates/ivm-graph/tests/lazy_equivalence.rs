//! 1 000 lazy-job launches of two small graphs, interleaved with random eager work on
//! three streams, against a sequential interpreter of the same program. Launches mutate
//! their parameters; eager work reads and writes launch inputs, outputs and parameters;
//! a tensor is often an input of one run and an output of the next with nothing in
//! between (critical-section hazards the engine must order).

use ivm_graph::{Graph, GraphBuilder};
use ivm_std::{Config, DebugCounters, Device, Stream, StreamId, Tensor, VirtualMachine};

/// Non-commutative mixing: any reordering of dependent steps changes the result.
fn mix(x: u64, y: u64) -> u64 {
    let mut z = x ^ y.wrapping_add(0x9e37_79b9_7f4a_7c15).rotate_left(17);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Graph A: h = mix(mix(a0, a1), w); o0 = h; o1 = mix(h, 2); w = mix(w, h).
fn graph_a() -> Graph {
    let mut g = GraphBuilder::new("A");
    let a0 = g.input("a0", 8);
    let a1 = g.input("a1", 8);
    let w = g.param("w", 8);
    let h = g.blob("h", 8);
    let o0 = g.blob("o0", 8);
    let o1 = g.blob("o1", 8);
    g.param_kernel("fwd", &[a0, a1], &[h], move |k| {
        let v = mix(mix(k.input_u64(0)[0], k.input_u64(1)[0]), k.param_u64(w)[0]);
        k.output_u64(0)[0] = v;
    });
    g.kernel("out", &[h], &[o0, o1], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v;
        k.output_u64(1)[0] = mix(v, 2);
    });
    g.param_kernel("upd", &[h], &[], move |k| {
        let v = k.input_u64(0)[0];
        let p = &mut k.param_u64_mut(w)[0];
        *p = mix(*p, v);
    });
    g.output("o0", o0);
    g.output("o1", o1);
    g.build().unwrap()
}

/// Graph B: q = mix(b0, w); w = mix(w, mix(b0, 7)); an invalid output `unused`.
fn graph_b() -> Graph {
    let mut g = GraphBuilder::new("B");
    let b0 = g.input("b0", 8);
    let w = g.param("w", 8);
    let q = g.blob("q", 8);
    g.param_kernel("fwd_upd", &[b0], &[q], move |k| {
        let b = k.input_u64(0)[0];
        let p = k.param_u64(w)[0];
        k.output_u64(0)[0] = mix(b, p);
        k.param_u64_mut(w)[0] = mix(p, mix(b, 7));
    });
    g.output("q", q);
    g.output_with("unused", q, false);
    g.build().unwrap()
}

const NT: usize = 6;

fn distinct(rng: &mut Rng, n: usize, avoid: &[usize]) -> Vec<usize> {
    let mut v = Vec::new();
    while v.len() < n {
        let t = rng.below(NT);
        if !v.contains(&t) && !avoid.contains(&t) {
            v.push(t);
        }
    }
    v
}

fn run_program(cfg: Config, seed: u64, launches: usize) {
    let vm = VirtualMachine::new(cfg).unwrap();
    let streams: Vec<Stream> = vec![
        vm.default_stream(),
        vm.stream(StreamId::compute(Device::CPU, 1)).unwrap(),
        vm.stream(StreamId::compute(Device::CPU, 2)).unwrap(),
    ];
    let (ga, gb) = (graph_a(), graph_b());
    let mut model: Vec<u64> = (0..NT as u64 + 2).map(|i| mix(i, seed)).collect();
    // Tensors 0..NT are data; NT is A's parameter, NT+1 is B's.
    let ts: Vec<Tensor> = model
        .iter()
        .map(|v| vm.new_tensor_from(&streams[0], &v.to_ne_bytes()).unwrap())
        .collect();
    let (pa, pb) = (NT, NT + 1);
    let mut rng = Rng(seed | 1);
    let mut done = 0;
    let mut step = 0u64;
    while done < launches {
        let batch = 1 + rng.below(4);
        vm.run(|bl| {
            for _ in 0..batch {
                step += 1;
                let id = step;
                match rng.below(10) {
                    0..=2 => {
                        // Graph A: two inputs (may repeat), two outputs elsewhere.
                        let o = distinct(&mut rng, 2, &[]);
                        let i = [distinct(&mut rng, 1, &o)[0], distinct(&mut rng, 1, &o)[0]];
                        bl.launch_lazy_job(
                            &[&ts[i[0]], &ts[i[1]]],
                            &[&ts[o[0]], &ts[o[1]]],
                            &[&ts[pa]],
                            ga.lazy(),
                        )?;
                        let h = mix(mix(model[i[0]], model[i[1]]), model[pa]);
                        model[o[0]] = h;
                        model[o[1]] = mix(h, 2);
                        model[pa] = mix(model[pa], h);
                        done += 1;
                    }
                    3..=4 => {
                        let o = distinct(&mut rng, 2, &[]);
                        let i = distinct(&mut rng, 1, &o)[0];
                        bl.launch_lazy_job(
                            &[&ts[i]],
                            &[&ts[o[0]], &ts[o[1]]],
                            &[&ts[pb]],
                            gb.lazy(),
                        )?;
                        model[o[0]] = mix(model[i], model[pb]);
                        model[pb] = mix(model[pb], mix(model[i], 7));
                        done += 1;
                    }
                    _ => {
                        // Eager: out = mix(out, id, inputs...) on a random stream; the
                        // operands include the parameters.
                        let s = &streams[rng.below(3)];
                        let out = rng.below(NT + 2);
                        let nin = rng.below(3);
                        let mut ins = Vec::new();
                        while ins.len() < nin {
                            let t = rng.below(NT + 2);
                            if t != out {
                                ins.push(t);
                            }
                        }
                        let mut v = mix(model[out], id);
                        for &i in &ins {
                            v = mix(v, model[i]);
                        }
                        model[out] = v;
                        let in_refs: Vec<&Tensor> = ins.iter().map(|&i| &ts[i]).collect();
                        bl.call(s, &in_refs, &[&ts[out]], move |k| {
                            let mut v = mix(k.output_u64(0)[0], id);
                            for i in 0..k.num_inputs() {
                                v = mix(v, k.input_u64(i)[0]);
                            }
                            k.output_u64(0)[0] = v;
                        })?;
                    }
                }
            }
            Ok(())
        })
        .unwrap();
        if rng.below(25) == 0 {
            let t = rng.below(NT + 2);
            let mut b = [0u8; 8];
            vm.read_small(&ts[t], 0, &mut b).unwrap();
            assert_eq!(
                u64::from_ne_bytes(b),
                model[t],
                "seed {seed}: tensor {t} mid-way"
            );
        }
    }
    for (k, t) in ts.iter().enumerate() {
        let mut b = [0u8; 8];
        vm.read_small(t, 0, &mut b).unwrap();
        assert_eq!(u64::from_ne_bytes(b), model[k], "seed {seed}: tensor {k}");
    }
    drop(ts);
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}

#[test]
fn thousand_launches_equal_the_sequential_interpreter() {
    run_program(Config::default(), 0x5eed, 1000);
}

#[test]
fn launches_equal_the_sequential_interpreter_over_seeds() {
    for seed in 1..=4u64 {
        run_program(Config::default(), seed * 7919, 150);
    }
}

#[test]
fn single_thread_launches_equal_the_sequential_interpreter() {
    run_program(Config::single_thread(), 42, 200);
}
