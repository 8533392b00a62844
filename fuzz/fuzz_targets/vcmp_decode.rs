//! The VCMP decoder on arbitrary bytes: it must never panic, and whatever it
//! accepts must encode back to exactly the same bytes (one encoding per
//! message, which the MACs rely on).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vnat_vcmp::wire::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = Message::decode(data) {
        let again = msg.encode().expect("a decoded message must encode");
        assert_eq!(again, data, "decode/encode is not the identity for {msg:?}");
    }
});
