//! Graph blob sizes, pipeline depths and thread counts no host can provide are
//! `Error::OutOfMemory`, never a panic or an abort (they come from the user). The sizes
//! are past `isize::MAX` bytes or past the machine's address space (`1 << 50` bytes).

use ivm_graph::GraphBuilder;
use ivm_std::Error;

/// Sizes that must be refused. `1 << 50` only where `usize` has room for it.
fn impossible_sizes() -> Vec<usize> {
    let mut v = vec![usize::MAX, usize::MAX / 2, isize::MAX as usize + 1];
    if usize::BITS >= 64 {
        v.push(1usize << (usize::BITS - 14));
    }
    v
}

fn assert_oom<T: std::fmt::Debug>(what: &str, n: usize, r: ivm_std::Result<T>) {
    match r {
        Err(Error::OutOfMemory { nbytes, .. }) => assert_eq!(nbytes, n, "{what}({n})"),
        other => panic!("{what}({n}): expected OutOfMemory, got {other:?}"),
    }
}

#[test]
fn impossible_graph_blobs_and_depths_are_out_of_memory() {
    for n in impossible_sizes() {
        // An intermediate blob produced by a kernel (depth slots) and an input blob.
        let mut g = GraphBuilder::new("huge");
        let x = g.input("x", 8);
        let y = g.blob("y", n);
        g.kernel("k", &[x], &[y], |_| {});
        assert_oom("GraphBuilder::build (blob)", n, g.build().map(drop));

        let mut g = GraphBuilder::new("huge-input");
        let x = g.input("x", n);
        let y = g.blob("y", 8);
        g.kernel("k", &[x], &[y], |_| {});
        g.output("y", y);
        assert_oom("GraphBuilder::build (input)", n, g.build().map(drop));
    }
    for depth in [usize::MAX, usize::MAX / 2, isize::MAX as usize + 1] {
        let mut g = GraphBuilder::new("deep");
        let x = g.input("x", 8);
        let y = g.blob("y", 8);
        g.kernel("k", &[x], &[y], |_| {});
        g.pipeline_depth(depth);
        match g.build() {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!(
                "depth {depth}: expected OutOfMemory, got {:?}",
                other.map(drop)
            ),
        }
    }
    // One notifier per graph thread: a thread count no host can hold.
    for threads in [usize::MAX, usize::MAX / 2] {
        let mut g = GraphBuilder::new("wide");
        let x = g.input("x", 8);
        let y = g.blob("y", 8);
        g.kernel("k", &[x], &[y], |_| {});
        g.threads(threads);
        match g.build() {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!(
                "{threads} threads: expected OutOfMemory, got {:?}",
                other.map(drop)
            ),
        }
    }
    // A sane graph still builds.
    let mut g = GraphBuilder::new("fine");
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    g.kernel("k", &[x], &[y], |k| {
        k.output_u64(0)[0] = k.input_u64(0)[0] + 1
    });
    g.output("y", y);
    g.build().unwrap().shutdown();
}

/// Zero-byte inputs, parameters and blobs (pure dependences) have empty word views in a
/// graph kernel. Before, the view of an empty slice was cast from a dangling, unaligned
/// pointer, and the debug check aborted the process.
#[test]
fn word_views_of_zero_byte_blobs_are_empty() {
    for config in [ivm_std::Config::default(), ivm_std::Config::single_thread()] {
        // A graph serves one VM: one per config.
        let mut g = GraphBuilder::new("empty-words");
        let x = g.input("x", 0);
        let w = g.param("w", 0);
        let e = g.blob("e", 0);
        let y = g.blob("y", 8);
        g.param_kernel("fill", &[x], &[e], move |k| {
            assert!(k.input_u64(0).is_empty() && k.output_u64(0).is_empty());
            assert!(k.param_u64(w).is_empty() && k.param_u64_mut(w).is_empty());
        });
        g.kernel("count", &[e], &[y], |k| {
            k.output_u64(0)[0] = 7 + k.input_u64(0).len() as u64;
        });
        g.output("y", y);
        let graph = g.build().unwrap();
        let vm = ivm_std::VirtualMachine::new(config).unwrap();
        let (xt, wt, yt) = (
            vm.new_tensor(0).unwrap(),
            vm.new_tensor(0).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        vm.run(|b| b.launch_lazy_job(&[&xt], &[&yt], &[&wt], graph.lazy()))
            .unwrap();
        let mut out = [0u8; 8];
        vm.read_small(&yt, 0, &mut out).unwrap();
        assert_eq!(u64::from_ne_bytes(out), 7);
        drop((xt, wt, yt));
        vm.shutdown().unwrap();
    }
}
