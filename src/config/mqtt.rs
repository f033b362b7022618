//! The `[mqtt]` section (the embedded broker and the device ingress) and
//! the `[devices.ID]` sections (who may connect, with which credentials, on
//! behalf of which application). Without `[mqtt]` (or an
//! `EDGEWAY__MQTT__…` variable) there is no broker.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::ApplicationConfig;
use crate::task::Priority;

#[derive(Debug, Clone)]
pub struct MqttConfig {
    /// MQTT 3.1.1 and 5 on one port (the version is read from CONNECT).
    pub listen: SocketAddr,
    pub tls: Option<MqttTlsConfig>,
    /// MQTT over WebSocket (3.1.1 and 5), plain.
    pub ws_listen: Option<SocketAddr>,
    /// The topic prefix of the device topics (`ai/v1`): `{prefix}/{device}/req`.
    pub topic_prefix: String,
    /// Largest MQTT packet accepted; a bigger one closes the connection.
    pub max_packet_bytes: usize,
    /// Largest request payload; a bigger one is answered `INVALID_REQUEST`.
    pub max_request_bytes: usize,
    pub max_connections: usize,
    /// QoS 1/2 messages in flight per connection.
    pub max_inflight: usize,
    /// Time a new connection has to send CONNECT.
    pub connect_timeout: Duration,
    /// Default delta coalescing: at most one delta message per this period…
    pub coalesce: Duration,
    /// …or per this many bytes of text, whichever comes first.
    pub max_chunk_bytes: usize,
    /// How long a task with `on_disconnect = "continue"` keeps running
    /// after its device went away, waiting for a resume.
    pub disconnect_grace: Duration,
    /// How long the messages of an ended stream stay available for resumes.
    pub replay_retention: Duration,
    /// Byte budget of the messages kept for resumes, over all streams.
    pub replay_max_bytes: usize,
    /// Byte budget of one stream's kept messages; older ones are dropped.
    pub stream_replay_max_bytes: usize,
    /// Bytes kept per subscription filter in the broker's in-memory log
    /// (what a slow subscriber can lag behind before it misses messages).
    pub filter_log_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct MqttTlsConfig {
    pub listen: SocketAddr,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// A device allowed to connect. Its MQTT client id is its name.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    pub id: String,
    pub tenant: String,
    /// The application whose rights and quotas the device's requests use.
    pub application: String,
    /// SHA-256 of the device password; `None`: only a JWT is accepted.
    pub password_sha256: Option<[u8; 32]>,
    pub max_priority: Priority,
    pub default_priority: Priority,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMqtt {
    #[serde(default = "d_listen")]
    pub listen: String,
    pub tls_listen: Option<String>,
    pub tls_cert_file: Option<String>,
    pub tls_key_file: Option<String>,
    pub ws_listen: Option<String>,
    #[serde(default = "d_prefix")]
    pub topic_prefix: String,
    #[serde(default = "d_max_packet")]
    pub max_packet_bytes: usize,
    #[serde(default = "d_max_request")]
    pub max_request_bytes: usize,
    #[serde(default = "d_max_connections")]
    pub max_connections: usize,
    #[serde(default = "d_max_inflight")]
    pub max_inflight: usize,
    #[serde(default = "d_connect_timeout")]
    pub connect_timeout_ms: u64,
    #[serde(default = "d_coalesce")]
    pub coalesce_ms: u64,
    #[serde(default = "d_chunk")]
    pub max_chunk_bytes: usize,
    #[serde(default = "d_grace")]
    pub disconnect_grace_ms: u64,
    #[serde(default = "d_retention")]
    pub replay_retention_ms: u64,
    #[serde(default = "d_replay_bytes")]
    pub replay_max_bytes: usize,
    #[serde(default = "d_stream_bytes")]
    pub stream_replay_max_bytes: usize,
    #[serde(default = "d_filter_log")]
    pub filter_log_bytes: usize,
}

fn d_listen() -> String {
    "127.0.0.1:1883".into()
}
fn d_prefix() -> String {
    "ai/v1".into()
}
fn d_max_packet() -> usize {
    1024 * 1024
}
fn d_max_request() -> usize {
    512 * 1024
}
fn d_max_connections() -> usize {
    20_000
}
fn d_max_inflight() -> usize {
    100
}
fn d_connect_timeout() -> u64 {
    10_000
}
fn d_coalesce() -> u64 {
    100
}
fn d_chunk() -> usize {
    512
}
fn d_grace() -> u64 {
    60_000
}
fn d_retention() -> u64 {
    300_000
}
fn d_replay_bytes() -> usize {
    64 * 1024 * 1024
}
fn d_stream_bytes() -> usize {
    1024 * 1024
}
fn d_filter_log() -> usize {
    256 * 1024
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDevice {
    pub tenant: String,
    pub application: String,
    pub password_sha256: Option<String>,
    pub max_priority: Option<String>,
    pub default_priority: Option<String>,
}

/// Device ids become MQTT client ids and topic levels.
pub fn valid_device_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !RESERVED_DEVICE_IDS.contains(&id)
}

/// Topic levels under the prefix that are not devices.
pub const RESERVED_DEVICE_IDS: &[&str] = &["shared"];

fn addr(path: &str, s: &str, err: &mut dyn FnMut(String, String)) -> SocketAddr {
    s.parse().unwrap_or_else(|_| {
        err(path.into(), format!("{s:?} is not an address like 127.0.0.1:1883"));
        SocketAddr::from(([127, 0, 0, 1], 1883))
    })
}

fn resolve(base: &Path, f: &str) -> PathBuf {
    let p = PathBuf::from(f);
    if p.is_absolute() {
        p
    } else {
        base.join(p)
    }
}

pub fn validate(raw: RawMqtt, base_dir: &Path, err: &mut dyn FnMut(String, String)) -> MqttConfig {
    let listen = addr("mqtt.listen", &raw.listen, err);
    let ws_listen = raw.ws_listen.as_deref().map(|a| addr("mqtt.ws_listen", a, err));
    let tls = match (&raw.tls_listen, &raw.tls_cert_file, &raw.tls_key_file) {
        (None, None, None) => None,
        (Some(l), Some(c), Some(k)) => {
            let (cert_file, key_file) = (resolve(base_dir, c), resolve(base_dir, k));
            for (key, f) in [("mqtt.tls_cert_file", &cert_file), ("mqtt.tls_key_file", &key_file)] {
                if !f.exists() {
                    err(key.into(), format!("{} does not exist", f.display()));
                }
            }
            Some(MqttTlsConfig { listen: addr("mqtt.tls_listen", l, err), cert_file, key_file })
        }
        _ => {
            err("mqtt.tls_listen".into(), "tls_listen, tls_cert_file and tls_key_file go together".into());
            None
        }
    };
    let prefix = raw.topic_prefix.trim_matches('/').to_string();
    if prefix.is_empty() || prefix.split('/').any(|l| l.is_empty() || l.contains(['+', '#'])) || prefix.starts_with('$')
    {
        err("mqtt.topic_prefix".into(), format!("{:?} is not a topic prefix like \"ai/v1\"", raw.topic_prefix));
    }
    if raw.max_packet_bytes < 4096 {
        err("mqtt.max_packet_bytes".into(), "must be at least 4096".into());
    }
    if raw.max_request_bytes < 1024 || raw.max_request_bytes > raw.max_packet_bytes {
        err("mqtt.max_request_bytes".into(), "must be between 1024 and max_packet_bytes".into());
    }
    if raw.max_connections == 0 {
        err("mqtt.max_connections".into(), "must be at least 1".into());
    }
    if raw.max_inflight == 0 || raw.max_inflight > u16::MAX as usize {
        err("mqtt.max_inflight".into(), "must be between 1 and 65535".into());
    }
    if raw.connect_timeout_ms == 0 || raw.connect_timeout_ms > u16::MAX as u64 {
        err("mqtt.connect_timeout_ms".into(), "must be between 1 and 65535".into());
    }
    if raw.max_chunk_bytes == 0 {
        err("mqtt.max_chunk_bytes".into(), "must be at least 1".into());
    }
    if raw.stream_replay_max_bytes > raw.replay_max_bytes {
        err("mqtt.stream_replay_max_bytes".into(), "must not exceed replay_max_bytes".into());
    }
    if raw.filter_log_bytes < 4096 {
        err("mqtt.filter_log_bytes".into(), "must be at least 4096".into());
    }
    MqttConfig {
        listen,
        tls,
        ws_listen,
        topic_prefix: prefix,
        max_packet_bytes: raw.max_packet_bytes,
        max_request_bytes: raw.max_request_bytes,
        max_connections: raw.max_connections,
        max_inflight: raw.max_inflight,
        connect_timeout: Duration::from_millis(raw.connect_timeout_ms),
        coalesce: Duration::from_millis(raw.coalesce_ms),
        max_chunk_bytes: raw.max_chunk_bytes,
        disconnect_grace: Duration::from_millis(raw.disconnect_grace_ms),
        replay_retention: Duration::from_millis(raw.replay_retention_ms),
        replay_max_bytes: raw.replay_max_bytes,
        stream_replay_max_bytes: raw.stream_replay_max_bytes,
        filter_log_bytes: raw.filter_log_bytes,
    }
}

pub fn validate_devices(
    raw: BTreeMap<String, RawDevice>,
    applications: &BTreeMap<String, ApplicationConfig>,
    err: &mut dyn FnMut(String, String),
) -> BTreeMap<String, DeviceConfig> {
    let mut out = BTreeMap::new();
    for (id, d) in raw {
        let p = format!("devices.{id}");
        if !valid_device_id(&id) {
            err(
                p.clone(),
                format!("a device id is 1..64 characters of A-Z a-z 0-9 - _ . and not one of {RESERVED_DEVICE_IDS:?}"),
            );
        }
        let app = applications.get(&d.application);
        match app {
            None => err(format!("{p}.application"), format!("no application named {:?}", d.application)),
            Some(a) if a.tenant != d.tenant => {
                err(format!("{p}.tenant"), format!("application {:?} belongs to tenant {:?}", d.application, a.tenant))
            }
            Some(_) => {}
        }
        let password_sha256 =
            d.password_sha256.as_deref().and_then(|h| match hex::decode(h.trim().trim_start_matches("sha256:")) {
                Ok(b) if b.len() == 32 => Some(b.try_into().expect("32 bytes")),
                _ => {
                    err(
                        format!("{p}.password_sha256"),
                        "must be a SHA-256 digest in hex; `edgeway hash-key PASSWORD` prints one".into(),
                    );
                    None
                }
            });
        let prio = |key: &str, v: &Option<String>, dflt: Priority, err: &mut dyn FnMut(String, String)| match v {
            None => dflt,
            Some(s) => Priority::parse(s).unwrap_or_else(|| {
                err(format!("{p}.{key}"), format!("must be P0..P4, not {s:?}"));
                dflt
            }),
        };
        let (app_max, app_default) =
            app.map(|a| (a.max_priority, a.default_priority)).unwrap_or((Priority::P4, Priority::P4));
        let max_priority = prio("max_priority", &d.max_priority, app_max, err);
        let default_priority = prio("default_priority", &d.default_priority, app_default.max(max_priority), err);
        if max_priority < app_max {
            err(format!("{p}.max_priority"), format!("is above its application's {}", app_max.as_str()));
        }
        if default_priority < max_priority {
            err(format!("{p}.default_priority"), "is more urgent than max_priority".into());
        }
        out.insert(
            id.clone(),
            DeviceConfig {
                id,
                tenant: d.tenant,
                application: d.application,
                password_sha256,
                max_priority,
                default_priority,
            },
        );
    }
    out
}
