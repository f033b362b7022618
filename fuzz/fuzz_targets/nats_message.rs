//! libFuzzer driver of [`edgeway_fuzz::nats_message`] (run by scripts/fuzz.sh).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edgeway_fuzz::nats_message(data));
