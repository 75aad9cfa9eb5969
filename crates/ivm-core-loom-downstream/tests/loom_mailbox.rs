//! A downstream loom model: this crate's `Mailbox` checked together with ivm-core's
//! `Notifier`, both on loom's atomics.
#![cfg(loom)]

use ivm_core_loom_downstream::Mailbox;
use loom::sync::Arc;

#[test]
fn value_put_is_value_taken() {
    loom::model(|| {
        let mailbox = Arc::new(Mailbox::new());
        let producer = {
            let mailbox = Arc::clone(&mailbox);
            loom::thread::spawn(move || mailbox.put(7u32).unwrap())
        };
        assert_eq!(mailbox.take(), Ok(7));
        producer.join().unwrap();
    });
}

#[test]
fn close_ends_a_waiting_take() {
    loom::model(|| {
        let mailbox = Arc::new(Mailbox::<u32>::new());
        let closer = {
            let mailbox = Arc::clone(&mailbox);
            loom::thread::spawn(move || mailbox.close())
        };
        assert!(mailbox.take().is_err());
        closer.join().unwrap();
    });
}
