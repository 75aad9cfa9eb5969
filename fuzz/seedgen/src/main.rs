//! Writes seed corpora of long programs for the fuzz targets that decode programs:
//!
//! * `vm_program`, `vm_program_sim`, `vm_faults`: inputs decoded by `ivm_std::fuzzing::Program`'s
//!   `Arbitrary` impl (what `fuzz_target!(|program: Program| ..)` does). Candidates are
//!   pseudo-random byte strings cut to the prefix the decoder consumed; kept are programs
//!   with at least `MIN_VM_OPS` ops, the ones with the most cross-stream uses (and, for the
//!   sim targets, cross-device uses, copies and launches) on the target's topology.
//! * `engine_program`: 8 bytes of executor seed, then `ivm_engine::check::Program`'s byte
//!   format (2 to 5 bytes an op); programs of roughly 20 to 630 ops, the candidate with the
//!   most cross-stream uses at each length.
//!
//! Deterministic (a fixed SplitMix64 stream): rerunning rewrites the same files. Run from
//! `fuzz/`: `cargo run --release -p ivm-fuzz-seeds`.

use std::fs;
use std::path::{Path, PathBuf};

use ivm_device::sim::sim_device;
use ivm_std::fuzzing::arbitrary::{Arbitrary, Unstructured};
use ivm_std::fuzzing::{MAX_OPS, Op, Program, Topology};

/// Seed files per target.
const SEEDS: usize = 24;
/// Shortest VM program kept (the decoder makes at most `MAX_OPS`).
const MIN_VM_OPS: usize = MAX_OPS * 3 / 4;
/// VM candidates drawn per target.
const VM_CANDIDATES: usize = 4000;
/// Engine program lengths in bytes (after the 8-byte seed), cycled over the seeds.
const ENGINE_LENGTHS: [usize; 6] = [96, 192, 384, 768, 1536, 3072];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The prefix of `bytes` the VM target decodes, and the program it decodes to; `None`
/// when the decoder ran out of bytes (the program would depend on the cut).
fn vm_decode(bytes: &[u8]) -> Option<(Vec<u8>, Program)> {
    let mut u = Unstructured::new(bytes);
    let program = Program::arbitrary(&mut u).ok()?;
    let rest = u.len();
    (rest > 0).then(|| (bytes[..bytes.len() - rest].to_vec(), program))
}

fn vm_score(topology: &Topology, program: &Program) -> usize {
    let fitted = topology.fit(program);
    let cross = topology.cross_stream_uses(&fitted);
    let count = |f: fn(&Op) -> bool| fitted.ops.iter().filter(|op| f(op)).count();
    let copies = count(|op| matches!(op, Op::Copy { .. }));
    let launches = count(|op| matches!(op, Op::Launch(_)));
    cross.streams + 2 * cross.devices + 2 * copies.min(3) + 2 * launches.min(3)
}

fn vm_seeds(topology: &Topology, rng: &mut Rng) -> Vec<Vec<u8>> {
    let mut scored: Vec<(usize, Vec<u8>)> = (0..VM_CANDIDATES)
        .filter_map(|_| vm_decode(&rng.bytes(4096)))
        .filter(|(_, p)| p.ops.len() >= MIN_VM_OPS)
        .map(|(bytes, p)| (vm_score(topology, &p), bytes))
        .collect();
    // Stable: equal scores keep the order drawn.
    scored.sort_by_key(|s| std::cmp::Reverse(s.0));
    scored.into_iter().take(SEEDS).map(|(_, b)| b).collect()
}

fn engine_seeds(rng: &mut Rng) -> Vec<Vec<u8>> {
    (0..SEEDS)
        .map(|i| {
            let len = ENGINE_LENGTHS[i % ENGINE_LENGTHS.len()];
            (0..16)
                .map(|_| rng.bytes(8 + len))
                .max_by_key(|b| ivm_engine::check::Program::from_bytes(&b[8..]).cross_stream_uses())
                .expect("candidates")
        })
        .collect()
}

fn write(dir: &Path, seeds: &[Vec<u8>]) {
    if dir.exists() {
        fs::remove_dir_all(dir).expect("remove the old seeds");
    }
    fs::create_dir_all(dir).expect("create the seed directory");
    for (i, s) in seeds.iter().enumerate() {
        fs::write(dir.join(format!("long-{i:02}")), s).expect("write a seed");
    }
    let bytes: usize = seeds.iter().map(Vec::len).sum();
    println!("{}: {} seeds, {bytes} bytes", dir.display(), seeds.len());
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../seeds");
    let mut rng = Rng(0x5eed_1d5e_ed00_0001);
    let cpu = Topology::cpu();
    let sim = Topology::with_devices(&[sim_device(0), sim_device(1)]);
    write(&root.join("vm_program"), &vm_seeds(&cpu, &mut rng));
    write(&root.join("vm_program_sim"), &vm_seeds(&sim, &mut rng));
    write(&root.join("engine_program"), &engine_seeds(&mut rng));
    // Drawn last, so that the seeds above stay what they were.
    write(&root.join("vm_faults"), &vm_seeds(&sim, &mut rng));
    // What the seeds hold, as the targets decode them.
    for (name, topology) in [
        ("vm_program", &cpu),
        ("vm_program_sim", &sim),
        ("vm_faults", &sim),
    ] {
        let mut lens = Vec::new();
        let mut cross = (0, 0);
        for e in fs::read_dir(root.join(name)).expect("seeds") {
            let b = fs::read(e.expect("entry").path()).expect("seed");
            let p = topology.fit(&Program::from_bytes(&b));
            let c = topology.cross_stream_uses(&p);
            lens.push(p.ops.len());
            cross = (cross.0 + c.streams, cross.1 + c.devices);
        }
        lens.sort_unstable();
        println!(
            "{name}: ops {}..={}, {} cross-stream uses ({} cross-device) in all",
            lens[0],
            lens[lens.len() - 1],
            cross.0,
            cross.1
        );
    }
}
