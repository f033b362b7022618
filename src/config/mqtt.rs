//! The `[mqtt]` section (the embedded broker and the device ingress) and
//! the `[devices.ID]` sections (who may connect, with which credentials, on
//! behalf of which application). Without `[mqtt]` (or an
//! `EDGEWAY__MQTT__…` variable) there is no broker.
//!
//! `[mqtt] mode = "external"` replaces the embedded broker by an existing
//! one (`[mqtt.external]`), to which edgeway connects as a client.
//!
//! Owns: these sections' format, defaults and rules. Does not own: the
//! broker or the device ingress (`ingress::mqtt`), which read [`MqttConfig`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::raw::{optional, Field, PriorityName};
use super::validate::{env_var, resolve, sha256_hex, Entries};
use super::Secret;
use super::{ApplicationConfig, Problems};
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
    /// Sockets per listener that have not sent CONNECT yet; one more is
    /// closed at once.
    pub max_pending_connects: usize,
    /// QoS 1/2 messages in flight per connection.
    pub max_inflight: usize,
    /// Time a new connection has to send CONNECT.
    pub connect_timeout: Duration,
    /// Longest keep-alive, seconds: a client's 0 ("none") or longer one
    /// becomes this (MQTT 5 clients are told, Server Keep Alive).
    pub max_keep_alive_s: u16,
    /// Client ids (`{device}:{instance}`) connected at once per device.
    pub max_instances_per_device: usize,
    /// Largest will payload; a CONNECT with a bigger one is refused.
    pub max_will_bytes: usize,
    /// Longest a will waits (MQTT 5 will delay / session expiry), seconds.
    pub max_will_delay_s: u32,
    /// Longest MQTT 5 Session Expiry Interval, seconds: a client's longer
    /// one (or "never", 0xFFFFFFFF) becomes this, and the CONNACK says so.
    pub max_session_expiry_s: u32,
    /// Sessions the broker keeps per device after their connections ended
    /// (MQTT 5 Session Expiry, 3.1.1 `cleansession = 0`), over all its
    /// client ids; one more discards the oldest (0: none kept).
    pub max_kept_sessions_per_device: usize,
    /// JWT-only device ids whose tenant binding is remembered (least
    /// recently used forgotten first).
    pub max_jwt_device_bindings: usize,
    /// Failed authentications per second allowed per device id (bursts of
    /// 5 ×); beyond, CONNECTs of that id are refused without a password
    /// check.
    pub auth_failures_per_s: f64,
    /// Failed authentications per second allowed per source IP address
    /// (bursts of 5 ×), whatever device ids it names; beyond, CONNECTs from
    /// that address are refused without a password check.
    pub auth_failures_per_ip_per_s: f64,
    /// Retained messages a device may keep in the broker; one more is
    /// refused (MQTT 5 0x97 Quota exceeded).
    pub max_retained_per_device: usize,
    /// Bytes (topic and payload) of a device's retained messages.
    pub max_retained_bytes_per_device: usize,
    /// Distinct topic names and filters a device may use while edgeway
    /// runs (the broker keeps each in caches that never shrink).
    pub max_topics_per_device: usize,
    /// Subscriptions (filters) one connection holds at once (with those a
    /// session resumed with Clean Start 0 restores).
    pub max_subscriptions_per_connection: usize,
    /// Bytes (topic and payload) of QoS 2 publishes awaiting PUBREL that a
    /// device may leave in the broker, over all its connections.
    pub max_inflight_bytes_per_device: usize,
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
    /// What a device's resumes may replay, per second (a budget of bytes,
    /// full at `stream_replay_max_bytes`); more is refused `RATE_LIMITED`.
    pub resume_replay_bytes_per_s: usize,
    /// Bytes kept per subscription filter in the broker's in-memory log
    /// (what a slow subscriber can lag behind before it misses messages).
    pub filter_log_bytes: usize,
    /// `mode = "external"`: no embedded broker; edgeway is a client of this
    /// one. `None`: `mode = "embedded"` (the listeners above are served).
    pub external: Option<ExternalBrokerConfig>,
}

/// `[mqtt.external]`: the existing broker edgeway connects to as a client
/// in `mode = "external"`.
#[derive(Debug, Clone)]
pub struct ExternalBrokerConfig {
    pub host: String,
    pub port: u16,
    /// Default `edgeway-{node_id}` (unique per node: a broker disconnects
    /// the older of two connections with one client id).
    pub client_id: String,
    pub username: Option<String>,
    /// Read from the environment variable `password_env` names.
    pub password: Option<Secret>,
    /// The name of that variable (`edgeway mqtt-acl` reads it too).
    pub password_env: Option<String>,
    /// The shared-subscription group of the nodes that split the device
    /// requests: `$share/{shared_group}/{prefix}/+/req`.
    pub shared_group: String,
    pub keep_alive: Duration,
    /// Longest wait between two connection attempts (the wait doubles from
    /// 100 ms up to this).
    pub reconnect_max: Duration,
    /// TLS to the broker (`tls = true`): `None` for plain TCP.
    pub tls: Option<ExternalTls>,
}

/// TLS to an external broker: the CA that signed its certificate (the
/// certificate must name `host`), and edgeway's own certificate when the
/// broker asks for one.
#[derive(Debug, Clone)]
pub struct ExternalTls {
    pub ca_file: PathBuf,
    /// Client certificate and key (PEM), both or neither.
    pub client_cert: Option<(PathBuf, PathBuf)>,
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
    /// SHA-256 of the device password (deprecated: unsalted; see
    /// `password_hash`).
    pub password_sha256: Option<[u8; 32]>,
    /// Argon2 PHC string of the device password (`edgeway hash-password`).
    /// Neither this nor `password_sha256`: only a JWT is accepted.
    pub password_hash: Option<String>,
    pub max_priority: Priority,
    pub default_priority: Priority,
    /// The least strict data class of the device's calls.
    pub data_class: Option<crate::task::DataClass>,
    /// The device's streams are compact unless a request says
    /// `"compact": false` (topics/README.md "Compact streams").
    pub compact: bool,
    /// The device's delta coalescing, for requests that set none
    /// (`None`: `[mqtt]`'s).
    pub coalesce: Option<Duration>,
    pub max_chunk_bytes: Option<usize>,
    /// The environment variable holding the device's plain password, for
    /// the password file of an external broker (`edgeway mqtt-acl`); the
    /// hashes above cannot be turned back into it.
    pub mqtt_password_env: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawMqtt {
    pub listen: Field<SocketAddr>,
    pub tls_listen: Option<Field<SocketAddr>>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    pub ws_listen: Option<Field<SocketAddr>>,
    pub topic_prefix: String,
    pub max_packet_bytes: usize,
    pub max_request_bytes: usize,
    pub max_connections: usize,
    pub max_pending_connects: usize,
    pub max_inflight: usize,
    pub connect_timeout_ms: u64,
    pub max_keep_alive_s: u64,
    pub max_instances_per_device: usize,
    pub max_will_bytes: usize,
    pub max_will_delay_s: u32,
    pub max_session_expiry_s: u32,
    pub max_kept_sessions_per_device: usize,
    pub max_jwt_device_bindings: usize,
    pub auth_failures_per_s: f64,
    pub auth_failures_per_ip_per_s: f64,
    pub max_retained_per_device: usize,
    pub max_retained_bytes_per_device: usize,
    pub max_topics_per_device: usize,
    pub max_subscriptions_per_connection: usize,
    pub max_inflight_bytes_per_device: usize,
    pub coalesce_ms: u64,
    pub max_chunk_bytes: usize,
    pub disconnect_grace_ms: u64,
    pub replay_retention_ms: u64,
    pub replay_max_bytes: usize,
    pub stream_replay_max_bytes: usize,
    pub resume_replay_bytes_per_s: usize,
    pub filter_log_bytes: usize,
    /// `"embedded"` (default) or `"external"`.
    pub mode: String,
    pub external: Option<RawExternalBroker>,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawExternalBroker {
    pub host: String,
    pub port: u16,
    pub client_id: Option<String>,
    pub username: Option<String>,
    pub password_env: Option<String>,
    pub shared_group: String,
    pub keep_alive_s: u64,
    pub reconnect_max_ms: u64,
    pub tls: bool,
    pub ca_file: Option<PathBuf>,
    pub client_cert_file: Option<PathBuf>,
    pub client_key_file: Option<PathBuf>,
}

impl Default for RawExternalBroker {
    fn default() -> Self {
        RawExternalBroker {
            host: String::new(),
            port: 1883,
            client_id: None,
            username: None,
            password_env: None,
            shared_group: "edgeway".into(),
            keep_alive_s: 30,
            reconnect_max_ms: 30_000,
            tls: false,
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
        }
    }
}

impl Default for RawMqtt {
    fn default() -> Self {
        RawMqtt {
            listen: Field::Valid(SocketAddr::from(([127, 0, 0, 1], 1883))),
            tls_listen: None,
            tls_cert_file: None,
            tls_key_file: None,
            ws_listen: None,
            topic_prefix: "ai/v1".into(),
            max_packet_bytes: 1024 * 1024,
            max_request_bytes: 512 * 1024,
            max_connections: 20_000,
            max_pending_connects: 1024,
            max_inflight: 100,
            connect_timeout_ms: 10_000,
            max_keep_alive_s: DEFAULT_MQTT_MAX_KEEP_ALIVE_S.into(),
            max_instances_per_device: 8,
            max_will_bytes: 16 * 1024,
            max_will_delay_s: 3600,
            max_session_expiry_s: 86_400,
            max_kept_sessions_per_device: 8,
            max_jwt_device_bindings: 100_000,
            auth_failures_per_s: 2.0,
            auth_failures_per_ip_per_s: 10.0,
            max_retained_per_device: 100,
            max_retained_bytes_per_device: 1024 * 1024,
            max_topics_per_device: 1000,
            max_subscriptions_per_connection: 100,
            max_inflight_bytes_per_device: 16 * 1024 * 1024,
            coalesce_ms: 100,
            max_chunk_bytes: 512,
            disconnect_grace_ms: 60_000,
            replay_retention_ms: 300_000,
            replay_max_bytes: 64 * 1024 * 1024,
            stream_replay_max_bytes: 1024 * 1024,
            resume_replay_bytes_per_s: 64 * 1024,
            filter_log_bytes: 256 * 1024,
            mode: "embedded".into(),
            external: None,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawDevice {
    pub tenant: Field<String>,
    pub application: Field<String>,
    pub password_sha256: Option<String>,
    pub password_hash: Option<String>,
    /// Default: its application's.
    pub max_priority: Option<Field<PriorityName>>,
    /// Default: its application's, or `max_priority` if that is less urgent.
    pub default_priority: Option<Field<PriorityName>>,
    /// The least strict data class of the device's calls.
    pub data_class: Option<Field<crate::task::DataClass>>,
    /// Compact streams by default.
    pub compact: bool,
    /// Default: `mqtt.coalesce_ms`.
    pub coalesce_ms: Option<u64>,
    /// Default: `mqtt.max_chunk_bytes`.
    pub max_chunk_bytes: Option<usize>,
    /// The environment variable that holds the device's plain password for
    /// an external broker's password file (`edgeway mqtt-acl`).
    pub mqtt_password_env: Option<String>,
}

/// The default of `mqtt.max_keep_alive_s`: a dead device's connection is
/// noticed within 1.5 × this.
pub const DEFAULT_MQTT_MAX_KEEP_ALIVE_S: u16 = 600;

/// The largest `coalesce_ms` a request or a device may set.
pub const MAX_COALESCE_MS: u64 = 60_000;
/// The largest `max_chunk_bytes` a request or a device may set.
pub const MAX_CHUNK_BYTES: usize = 1024 * 1024;

/// Device ids become MQTT client ids and topic levels.
pub fn valid_device_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !RESERVED_DEVICE_IDS.contains(&id)
}

/// Topic levels under the prefix that are not devices.
pub const RESERVED_DEVICE_IDS: &[&str] = &["shared"];

/// Validates `[mqtt]`; `None` after reporting a problem. `env` holds the
/// broker password of `mode = "external"`; `node_id` names its client.
pub(super) fn validate(
    mut raw: RawMqtt,
    env: &[(String, String)],
    base_dir: &Path,
    node_id: &str,
    p: &mut Problems,
) -> Option<MqttConfig> {
    let external = match (raw.mode.as_str(), raw.external.take()) {
        ("embedded", None) => Some(None),
        ("embedded", Some(_)) => {
            p.add("mqtt.external", "is used only with mode = \"external\"");
            None
        }
        ("external", Some(e)) => external(e, env, base_dir, node_id, p).map(Some),
        ("external", None) => {
            p.add("mqtt.external", "mode = \"external\" needs [mqtt.external] with the broker's host");
            None
        }
        (other, _) => {
            p.add("mqtt.mode", format!("{other:?} is not \"embedded\" or \"external\""));
            None
        }
    };
    let listen = raw.listen.get("mqtt.listen", p);
    let ws_listen = optional(raw.ws_listen, "mqtt.ws_listen", p);
    let tls = match (raw.tls_listen, &raw.tls_cert_file, &raw.tls_key_file) {
        (None, None, None) => Some(None),
        (Some(l), Some(c), Some(k)) => {
            let (cert_file, key_file) = (resolve(base_dir, c), resolve(base_dir, k));
            let mut files_exist = true;
            for (key, f) in [("mqtt.tls_cert_file", &cert_file), ("mqtt.tls_key_file", &key_file)] {
                if !f.exists() {
                    p.add(key, format!("{} does not exist", f.display()));
                    files_exist = false;
                }
            }
            let listen = l.get("mqtt.tls_listen", p);
            match listen {
                Some(listen) if files_exist => Some(Some(MqttTlsConfig { listen, cert_file, key_file })),
                _ => None,
            }
        }
        _ => {
            p.add("mqtt.tls_listen", "tls_listen, tls_cert_file and tls_key_file go together");
            None
        }
    };
    let prefix = raw.topic_prefix.trim_matches('/').to_string();
    if prefix.is_empty() || prefix.split('/').any(|l| l.is_empty() || l.contains(['+', '#'])) || prefix.starts_with('$')
    {
        p.add("mqtt.topic_prefix", format!("{:?} is not a topic prefix like \"ai/v1\"", raw.topic_prefix));
    }
    if raw.max_packet_bytes < 4096 {
        p.add("mqtt.max_packet_bytes", "must be at least 4096");
    }
    if raw.max_request_bytes < 1024 || raw.max_request_bytes > raw.max_packet_bytes {
        p.add("mqtt.max_request_bytes", "must be between 1024 and max_packet_bytes");
    }
    if raw.max_connections == 0 {
        p.add("mqtt.max_connections", "must be at least 1");
    }
    if raw.max_pending_connects == 0 {
        p.add("mqtt.max_pending_connects", "must be at least 1");
    }
    if raw.max_inflight == 0 || raw.max_inflight > u16::MAX as usize {
        p.add("mqtt.max_inflight", "must be between 1 and 65535");
    }
    if raw.connect_timeout_ms == 0 || raw.connect_timeout_ms > u16::MAX as u64 {
        p.add("mqtt.connect_timeout_ms", "must be between 1 and 65535");
    }
    if raw.max_keep_alive_s == 0 || raw.max_keep_alive_s > u64::from(u16::MAX) {
        p.add("mqtt.max_keep_alive_s", "must be between 1 and 65535");
    }
    if raw.max_instances_per_device == 0 {
        p.add("mqtt.max_instances_per_device", "must be at least 1");
    }
    if raw.max_jwt_device_bindings == 0 {
        p.add("mqtt.max_jwt_device_bindings", "must be at least 1");
    }
    if !(raw.auth_failures_per_s.is_finite() && raw.auth_failures_per_s > 0.0) {
        p.add("mqtt.auth_failures_per_s", "must be a number above 0");
    }
    if !(raw.auth_failures_per_ip_per_s.is_finite() && raw.auth_failures_per_ip_per_s > 0.0) {
        p.add("mqtt.auth_failures_per_ip_per_s", "must be a number above 0");
    }
    for (key, v) in [
        ("mqtt.max_topics_per_device", raw.max_topics_per_device),
        ("mqtt.max_subscriptions_per_connection", raw.max_subscriptions_per_connection),
        ("mqtt.max_inflight_bytes_per_device", raw.max_inflight_bytes_per_device),
    ] {
        if v == 0 {
            p.add(key, "must be at least 1");
        }
    }
    if raw.max_chunk_bytes == 0 {
        p.add("mqtt.max_chunk_bytes", "must be at least 1");
    }
    if raw.stream_replay_max_bytes > raw.replay_max_bytes {
        p.add("mqtt.stream_replay_max_bytes", "must not exceed replay_max_bytes");
    }
    // It is also the resume budget, which must hold the least a resume
    // costs (the ingress's RESUME_MIN_COST).
    if raw.stream_replay_max_bytes < 512 {
        p.add("mqtt.stream_replay_max_bytes", "must be at least 512");
    }
    if raw.resume_replay_bytes_per_s < 1024 {
        p.add("mqtt.resume_replay_bytes_per_s", "must be at least 1024");
    }
    if raw.filter_log_bytes < 4096 {
        p.add("mqtt.filter_log_bytes", "must be at least 4096");
    }
    Some(MqttConfig {
        listen: listen?,
        tls: tls?,
        ws_listen: ws_listen?,
        topic_prefix: prefix,
        max_packet_bytes: raw.max_packet_bytes,
        max_request_bytes: raw.max_request_bytes,
        max_connections: raw.max_connections,
        max_pending_connects: raw.max_pending_connects,
        max_inflight: raw.max_inflight,
        connect_timeout: Duration::from_millis(raw.connect_timeout_ms),
        max_keep_alive_s: u16::try_from(raw.max_keep_alive_s).unwrap_or(u16::MAX),
        max_instances_per_device: raw.max_instances_per_device,
        max_will_bytes: raw.max_will_bytes,
        max_will_delay_s: raw.max_will_delay_s,
        max_session_expiry_s: raw.max_session_expiry_s,
        max_kept_sessions_per_device: raw.max_kept_sessions_per_device,
        max_jwt_device_bindings: raw.max_jwt_device_bindings,
        auth_failures_per_s: raw.auth_failures_per_s,
        auth_failures_per_ip_per_s: raw.auth_failures_per_ip_per_s,
        max_retained_per_device: raw.max_retained_per_device,
        max_retained_bytes_per_device: raw.max_retained_bytes_per_device,
        max_topics_per_device: raw.max_topics_per_device,
        max_subscriptions_per_connection: raw.max_subscriptions_per_connection,
        max_inflight_bytes_per_device: raw.max_inflight_bytes_per_device,
        coalesce: Duration::from_millis(raw.coalesce_ms),
        max_chunk_bytes: raw.max_chunk_bytes,
        disconnect_grace: Duration::from_millis(raw.disconnect_grace_ms),
        replay_retention: Duration::from_millis(raw.replay_retention_ms),
        replay_max_bytes: raw.replay_max_bytes,
        stream_replay_max_bytes: raw.stream_replay_max_bytes,
        resume_replay_bytes_per_s: raw.resume_replay_bytes_per_s,
        filter_log_bytes: raw.filter_log_bytes,
        external: external?,
    })
}

/// Validates `[mqtt.external]`.
fn external(
    e: RawExternalBroker,
    env: &[(String, String)],
    base_dir: &Path,
    node_id: &str,
    p: &mut Problems,
) -> Option<ExternalBrokerConfig> {
    let mut ok = true;
    if e.host.trim().is_empty() || e.host.contains(['/', ' ']) {
        p.add("mqtt.external.host", "must be the broker's host name or address");
        ok = false;
    }
    if e.port == 0 {
        p.add("mqtt.external.port", "must be 1..65535");
        ok = false;
    }
    let client_id = e.client_id.unwrap_or_else(|| format!("edgeway-{node_id}"));
    if client_id.is_empty() || client_id.len() > 128 || client_id.contains(['+', '#', '/']) {
        p.add("mqtt.external.client_id", "must be 1..128 characters without / + #");
        ok = false;
    }
    if e.shared_group.is_empty() || e.shared_group.contains(['+', '#', '/']) {
        p.add("mqtt.external.shared_group", "must be a share name: no / + #, not empty");
        ok = false;
    }
    if e.keep_alive_s == 0 || e.keep_alive_s > u64::from(u16::MAX) {
        p.add("mqtt.external.keep_alive_s", "must be between 1 and 65535");
        ok = false;
    }
    if e.reconnect_max_ms < 100 {
        p.add("mqtt.external.reconnect_max_ms", "must be at least 100");
        ok = false;
    }
    let password = match (&e.username, &e.password_env) {
        (_, None) => None,
        (None, Some(_)) => {
            p.add("mqtt.external.username", "is required with password_env");
            ok = false;
            None
        }
        (Some(_), Some(var)) => match env_var(env, var) {
            Some(v) if !v.is_empty() => Some(Secret::new(v)),
            _ => {
                p.add("mqtt.external.password_env", format!("environment variable {var} is not set"));
                ok = false;
                None
            }
        },
    };
    let file = |key: &str, f: &Path, p: &mut Problems| {
        let path = resolve(base_dir, f);
        if !path.is_file() {
            p.add(format!("mqtt.external.{key}"), format!("{} does not exist", path.display()));
        }
        path
    };
    let tls = match (e.tls, &e.ca_file, &e.client_cert_file, &e.client_key_file) {
        (false, None, None, None) => None,
        (false, ..) => {
            p.add("mqtt.external.tls", "ca_file and client_cert_file/client_key_file are used only with tls = true");
            ok = false;
            None
        }
        (true, None, ..) => {
            p.add("mqtt.external.ca_file", "is required with tls = true (the CA that signed the broker's certificate)");
            ok = false;
            None
        }
        (true, Some(ca), cert, key) => {
            let ca_file = file("ca_file", ca, p);
            let client_cert = match (cert, key) {
                (None, None) => None,
                (Some(c), Some(k)) => Some((file("client_cert_file", c, p), file("client_key_file", k, p))),
                _ => {
                    p.add("mqtt.external.client_cert_file", "client_cert_file and client_key_file go together");
                    ok = false;
                    None
                }
            };
            Some(ExternalTls { ca_file, client_cert })
        }
    };
    ok.then(|| ExternalBrokerConfig {
        host: e.host,
        port: e.port,
        client_id,
        username: e.username,
        password,
        password_env: e.password_env,
        shared_group: e.shared_group,
        keep_alive: Duration::from_secs(e.keep_alive_s),
        reconnect_max: Duration::from_millis(e.reconnect_max_ms),
        tls,
    })
}

/// Validates `[devices.ID]` against the applications they act for. A device
/// of an application that itself had a problem is left out (`None`) without
/// a report of its own: the application's is the one to fix.
pub(super) fn validate_devices(
    raw: BTreeMap<String, RawDevice>,
    applications: &Entries<ApplicationConfig>,
    p: &mut Problems,
) -> Entries<DeviceConfig> {
    raw.into_iter()
        .map(|(id, d)| {
            let device = device(&id, d, applications, p);
            (id, device)
        })
        .collect()
}

fn device(id: &str, d: RawDevice, applications: &Entries<ApplicationConfig>, p: &mut Problems) -> Option<DeviceConfig> {
    let path = format!("devices.{id}");
    if !valid_device_id(id) {
        p.add(
            path.clone(),
            format!("a device id is 1..64 characters of A-Z a-z 0-9 - _ . and not one of {RESERVED_DEVICE_IDS:?}"),
        );
    }
    let tenant = d.tenant.get(&format!("{path}.tenant"), p);
    let application = d.application.get(&format!("{path}.application"), p);
    let password_sha256 = match d.password_sha256.as_deref() {
        None => Some(None),
        Some(h) => {
            let digest = sha256_hex(h);
            if digest.is_none() {
                p.add(
                    format!("{path}.password_sha256"),
                    "must be a SHA-256 digest in hex; `edgeway hash-key PASSWORD` prints one",
                );
            }
            digest.map(Some)
        }
    };
    let password_hash = match d.password_hash {
        None => Some(None),
        Some(_) if d.password_sha256.is_some() => {
            p.add(format!("{path}.password_hash"), "set password_hash or password_sha256, not both");
            None
        }
        Some(h) => {
            let argon2 = argon2::password_hash::PasswordHash::new(&h)
                .is_ok_and(|ph| ["argon2id", "argon2i", "argon2d"].contains(&ph.algorithm.as_str()));
            if !argon2 {
                p.add(
                    format!("{path}.password_hash"),
                    "must be an Argon2 PHC string ($argon2id$…); `edgeway hash-password PASSWORD` prints one",
                );
            }
            argon2.then_some(Some(h))
        }
    };
    let max_priority = optional(d.max_priority, &format!("{path}.max_priority"), p);
    let default_priority = optional(d.default_priority, &format!("{path}.default_priority"), p);
    let data_class = optional(d.data_class, &format!("{path}.data_class"), p);
    // The same bounds as a request's fields.
    if d.coalesce_ms.is_some_and(|ms| ms > MAX_COALESCE_MS) {
        p.add(format!("{path}.coalesce_ms"), format!("must be 0..{MAX_COALESCE_MS}"));
    }
    if d.max_chunk_bytes.is_some_and(|b| !(1..=MAX_CHUNK_BYTES).contains(&b)) {
        p.add(format!("{path}.max_chunk_bytes"), format!("must be 1..{MAX_CHUNK_BYTES}"));
    }
    let app = match application.as_ref().map(|a| (a, applications.get(a))) {
        None => None,
        Some((name, None)) => {
            p.add(format!("{path}.application"), format!("no application named {name:?}"));
            None
        }
        Some((_, Some(app))) => app.as_ref(),
    };
    let app = app?;
    if tenant.as_ref().is_some_and(|t| *t != app.tenant) {
        p.add(format!("{path}.tenant"), format!("application {:?} belongs to tenant {:?}", app.name, app.tenant));
    }
    let max_priority = max_priority?.map_or(app.max_priority, |n| n.0);
    let default_priority = default_priority?.map_or(app.default_priority.max(max_priority), |n| n.0);
    if max_priority < app.max_priority {
        p.add(format!("{path}.max_priority"), format!("is above its application's {}", app.max_priority.as_str()));
    }
    if default_priority < max_priority {
        p.add(format!("{path}.default_priority"), "is more urgent than max_priority");
    }
    Some(DeviceConfig {
        id: id.to_string(),
        tenant: tenant?,
        application: app.name.clone(),
        password_sha256: password_sha256?,
        password_hash: password_hash?,
        max_priority,
        default_priority,
        data_class: data_class?,
        compact: d.compact,
        coalesce: d.coalesce_ms.map(Duration::from_millis),
        max_chunk_bytes: d.max_chunk_bytes,
        mqtt_password_env: d.mqtt_password_env,
    })
}
