#![no_main]
//! See `qmk_model::fuzzing::sharded_index`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| qmk_model::fuzzing::sharded_index(data));
