//! Replays the kept corpus (`corpus/<target>/`) and every crash found so
//! far (`crashes/<target>/`, added with the regression test that names it)
//! through the fuzz targets, uninstrumented: `cargo test` in fuzz/.

use std::path::Path;

fn replay(target: &str, run: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for dir in ["corpus", "crashes"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else { continue };
        for e in entries {
            let path = e.expect("corpus entry").path();
            let data = std::fs::read(&path).expect("corpus file");
            eprintln!("{}", path.display());
            run(&data);
            n += 1;
        }
    }
    assert!(n > 0, "no corpus for {target}");
}

#[test]
fn mqtt_packets() {
    replay("mqtt_packets", edgeway_fuzz::mqtt_packets);
}

#[test]
fn device_payload() {
    replay("device_payload", edgeway_fuzz::device_payload);
}

#[test]
fn request_body() {
    replay("request_body", edgeway_fuzz::request_body);
}

#[test]
fn nats_message() {
    replay("nats_message", edgeway_fuzz::nats_message);
}
