#![no_main]
//! See `qmk_model::fuzzing::config`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| qmk_model::fuzzing::config(data));
