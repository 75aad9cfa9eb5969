use std::time::{Duration, Instant};
use ivm::ivm_std::{Config, VirtualMachine};
fn main() {
    let inline = std::env::args().nth(1).map_or(true, |a| a == "1");
    let vm = VirtualMachine::new(Config { inline_sync_access: inline, ..Config::default() }).unwrap();
    let t = vm.new_tensor(8).unwrap();
    let mut out = [0u8; 8];
    for _ in 0..100 { vm.sync_read_small_mem(&t, &mut out).unwrap(); }
    ivm::ivm_std::trace::set_enabled(true);
    let origin = Instant::now();
    let mut rows = Vec::new();
    for _ in 0..30 {
        std::thread::sleep(Duration::from_millis(10));
        ivm::ivm_std::trace::clear();
        let a = Instant::now();
        vm.sync_read_small_mem(&t, &mut out).unwrap();
        let b = Instant::now();
        let mut j = Vec::new();
        ivm::ivm_std::trace::write_chrome_json(&mut j).unwrap();
        rows.push(((b - a).as_secs_f64() * 1e6, String::from_utf8(j).unwrap(), a.duration_since(origin)));
    }
    rows.sort_by(|x, y| x.0.partial_cmp(&y.0).unwrap());
    let (d, j, _) = &rows[rows.len() / 2];
    println!("median {d:.1} us");
    for l in j.lines() { if l.contains("\"ns\"") || l.contains("start_ns") { println!("{l}"); } }
}
