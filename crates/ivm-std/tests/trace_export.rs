//! Trace export (`ivm_std::trace`): with tracing on, every instruction's receive,
//! dispatch, compute (start/end) and release are recorded and written as Chrome trace
//! JSON; the JSON parses, names the VM's threads, and each instruction's events are in
//! order: receive ≤ dispatch ≤ compute start ≤ compute end ≤ release.
//!
//! One test in its own binary: the trace rings are process-wide.

use std::collections::HashMap;

use ivm_std::{Config, Device, StreamId, VirtualMachine};
use serde_json::Value;

#[test]
fn every_instruction_has_ordered_events_in_the_chrome_trace() {
    ivm_std::trace::clear();
    let vm = VirtualMachine::new(Config::default().with_trace(true)).unwrap();
    let s0 = vm.default_stream();
    let s1 = vm.stream(StreamId::compute(Device::CPU, 1)).unwrap();
    let t: Vec<_> = (0..4).map(|_| vm.new_tensor(8).unwrap()).collect();
    for i in 0..200u64 {
        vm.run(|b| {
            b.call(&s0, &[&t[0]], &[&t[1]], move |k| {
                k.output_u64(0)[0] = k.input_u64(0)[0] + i
            })?;
            b.call(&s1, &[&t[1]], &[&t[2]], |k| {
                k.output_u64(0)[0] = k.input_u64(0)[0] * 2
            })?;
            b.touch_tensors(&s0, &[&t[2]])
        })
        .unwrap();
        let mut out = [0u8; 8];
        vm.read_small(&t[2], 0, &mut out).unwrap();
        if i % 10 == 0 {
            vm.write_small(&t[3], 0, &out).unwrap();
        }
    }
    vm.sync().unwrap();
    drop(t);
    vm.shutdown().unwrap();
    ivm_std::trace::set_enabled(false);

    let mut json = Vec::new();
    ivm_std::trace::write_chrome_json(&mut json).unwrap();
    let v: Value = serde_json::from_slice(&json).expect("the trace is valid JSON");
    let events = v["traceEvents"].as_array().expect("traceEvents");

    let thread_names: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        thread_names.iter().any(|n| n.contains("-cpu:0-t0")),
        "{thread_names:?}"
    );

    // instr id -> (phase -> ns), each phase at most once.
    let mut by_instr: HashMap<u64, HashMap<String, u64>> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] != "M") {
        let args = &e["args"];
        let id = args["instr"].as_u64().expect("args.instr");
        let phases = by_instr.entry(id).or_default();
        let mut put = |phase: &str, ns: u64| {
            assert!(
                phases.insert(phase.to_string(), ns).is_none(),
                "instruction {id}: {phase} recorded twice"
            );
        };
        match args["phase"].as_str().expect("args.phase") {
            "compute" => {
                assert_eq!(e["ph"], "X");
                put("compute_start", args["start_ns"].as_u64().unwrap());
                put("compute_end", args["end_ns"].as_u64().unwrap());
            }
            p => put(p, args["ns"].as_u64().unwrap()),
        }
    }
    const ORDER: [&str; 5] = [
        "receive",
        "dispatch",
        "compute_start",
        "compute_end",
        "release",
    ];
    let mut complete = 0;
    for (id, phases) in &by_instr {
        let ts: Vec<u64> = ORDER
            .iter()
            .filter_map(|p| phases.get(*p).copied())
            .collect();
        assert!(
            ts.windows(2).all(|w| w[0] <= w[1]),
            "instruction {id}: events out of order: {phases:?}"
        );
        if ts.len() == ORDER.len() {
            complete += 1;
        } else {
            panic!("instruction {id}: missing events: {phases:?}");
        }
    }
    // 200 × (2 kernels + touch), plus the sync accesses that were instructions (a sync
    // access with nothing in flight is done by the caller itself, without one), `sync()`
    // and the releases of the 4 tensors.
    assert!(complete >= 200 * 3, "only {complete} complete instructions");
}
