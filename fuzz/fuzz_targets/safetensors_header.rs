#![no_main]
//! See `qmk_model::fuzzing::safetensors_header`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| qmk_model::fuzzing::safetensors_header(data));
