//! libFuzzer driver of [`edgeway_fuzz::mqtt_packets`] (run by scripts/fuzz.sh).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edgeway_fuzz::mqtt_packets(data));
