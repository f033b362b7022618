//! `devices-sim`: simulates many MQTT devices on bad links against edgeway
//! and prints what they saw. Devices are `{prefix}{i}` with passwords
//! `{password_prefix}{i}` for i in 1..=N (register them in edgeway's
//! config, e.g. with `--print-config`).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use devices_sim::{run, LinkProfile, SimConfig};

#[derive(Parser)]
#[command(name = "devices-sim", about = "Many MQTT devices on bad links against edgeway")]
struct Args {
    /// edgeway's MQTT listener.
    #[arg(long, default_value = "127.0.0.1:1883")]
    broker: SocketAddr,
    #[arg(long, short = 'n', default_value_t = 10)]
    devices: usize,
    #[arg(long, default_value = "sim-")]
    id_prefix: String,
    #[arg(long, default_value = "sim-pass-")]
    password_prefix: String,
    #[arg(long, default_value_t = 3)]
    requests: usize,
    #[arg(long, default_value = "general-chat")]
    model: String,
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    #[arg(long, default_value_t = 0.0)]
    cancel_ratio: f64,
    #[arg(long)]
    coalesce_ms: Option<u64>,
    #[arg(long)]
    max_chunk_bytes: Option<usize>,
    /// Ask for compact streams (topics/README.md "Compact streams").
    #[arg(long)]
    compact: bool,
    /// One-way latency, ms.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    #[arg(long, default_value_t = 0)]
    jitter_ms: u64,
    /// Bytes per second per direction (0: unlimited).
    #[arg(long, default_value_t = 0)]
    bandwidth: u64,
    #[arg(long, default_value_t = 0.0)]
    stall_probability: f64,
    #[arg(long, default_value_t = 0)]
    stall_ms: u64,
    /// Mean connection lifetime before the proxy cuts it, ms (0: never).
    #[arg(long, default_value_t = 0)]
    drop_mean_ms: u64,
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    #[arg(long, default_value_t = 0)]
    think_ms: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Print the `[devices.…]` config sections for the simulated devices
    /// (application `demo`, tenant `demo`) and exit.
    #[arg(long)]
    print_config: bool,
}

fn main() -> ExitCode {
    let a = Args::parse();
    let devices: Vec<(String, String)> =
        (1..=a.devices).map(|i| (format!("{}{i}", a.id_prefix), format!("{}{i}", a.password_prefix))).collect();
    if a.print_config {
        for (id, pw) in &devices {
            println!("{}", devices_sim::device_config(id, pw, "demo", "demo"));
        }
        return ExitCode::SUCCESS;
    }
    let cfg = SimConfig {
        broker: a.broker,
        devices,
        requests_per_device: a.requests,
        model: a.model,
        max_tokens: a.max_tokens,
        cancel_ratio: a.cancel_ratio,
        coalesce_ms: a.coalesce_ms,
        max_chunk_bytes: a.max_chunk_bytes,
        compact: a.compact,
        link: LinkProfile {
            latency: Duration::from_millis(a.latency_ms),
            jitter: Duration::from_millis(a.jitter_ms),
            bandwidth: (a.bandwidth > 0).then_some(a.bandwidth),
            stall_probability: a.stall_probability,
            stall: Duration::from_millis(a.stall_ms),
            drop_mean: (a.drop_mean_ms > 0).then(|| Duration::from_millis(a.drop_mean_ms)),
        },
        request_timeout: Duration::from_secs(a.timeout_s),
        think: Duration::from_millis(a.think_ms),
        seed: a.seed,
        ..SimConfig::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    match rt.block_on(run(cfg)) {
        Ok(s) => {
            if a.json {
                println!("{}", serde_json::to_string(&s).expect("summary JSON"));
            } else {
                println!("{}", s.render());
            }
            if s.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("devices-sim: {e:#}");
            ExitCode::from(2)
        }
    }
}
