use std::time::Instant;
use ivm::ivm_std::{Config, VirtualMachine};
fn main() {
    let vm = VirtualMachine::new(Config { inline_sync_access: false, ..Config::from_env().unwrap() }).unwrap();
    let t = vm.new_tensor(8).unwrap();
    let mut out = [0u8; 8];
    for _ in 0..2000 { vm.sync_read_small_mem(&t, &mut out).unwrap(); }
    let mut s = Vec::new();
    for _ in 0..20000 { let a = Instant::now(); vm.sync_read_small_mem(&t, &mut out).unwrap(); s.push(a.elapsed()); }
    s.sort();
    println!("warm p50 {:?} p90 {:?} p99 {:?}", s[10000], s[18000], s[19800]);
}
