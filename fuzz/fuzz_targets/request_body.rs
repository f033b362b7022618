//! libFuzzer driver of [`edgeway_fuzz::request_body`] (run by scripts/fuzz.sh).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edgeway_fuzz::request_body(data));
