//! Device authentication at CONNECT: the client id names the device, the
//! user name must repeat it, and the password is the device's password
//! (checked against its salted, slow hash) or a JWT whose `sub` is the
//! device.
//!
//! - **Passwords**: `[devices.ID] password_hash` is an Argon2 PHC string
//!   (`edgeway hash-password` prints one). The older `password_sha256`
//!   (an unsalted digest) is still accepted, with a warning at start. A
//!   password that passed the slow check is remembered (as its SHA-256, in
//!   memory only), so a device that reconnects does not pay it again; a
//!   wrong one always does.
//! - **One tenant per device id**: a registered device belongs to its
//!   configured tenant (a JWT for it must name that tenant's application);
//!   a device id that only JWTs name is bound to the tenant of the first
//!   token accepted for it, and refused for any other tenant until edgeway
//!   restarts, or until the binding is forgotten: at most
//!   `[mqtt] max_jwt_device_bindings` ([`TENANT_BINDINGS`]) bindings are kept, and past that the least
//!   recently used one goes (that device id can then be bound afresh). The
//!   binding is kept in memory only: what a device leaves in
//!   edgeway's MQTT layer (sessions, streams, wills, the router's topics)
//!   is in memory too and gone after a restart, and its tasks and
//!   idempotency keys in the store are per tenant anyway. Register a device
//!   in the config to pin its tenant for good.
//! - **Token expiry and revocation**: a JWT's `exp` is the end of the
//!   connection's authority ([`Login::expires_at`]); see [`expired`]. JWTs
//!   are checked by the gateway's own authenticator, so a token id revoked
//!   over HTTP (`POST /admin/keys/revoke {"jti"}`) or loaded from the store
//!   is refused at CONNECT, and a connection that logged in with it ends
//!   as soon as the token is revoked (MQTT 5 DISCONNECT 0x87), even if the
//!   device only listens ([`DeviceDirectory::revocations`],
//!   [`DeviceDirectory::lapsed`]). The same holds for a connection whose
//!   device or application a reload removed ([`DeviceDirectory::withdrawn`]);
//!   `[auth.jwt]` is read at each CONNECT, so a reload turns tokens on or off.
//! - **Bounded slow checks**: at most [`argon2_permits`] Argon2
//!   verifications run at once; a CONNECT that finds none free is refused
//!   as "server busy" (MQTT 5 0x89, 3.1.1 code 3) without running one, so
//!   wrong passwords cannot take every core and 19 MiB each. A password
//!   that cannot be a JWT's never reaches the JWT check, and a JWT-shaped
//!   password of a device with a password hash is tried as a JWT first.
//!
//! Owns: credentials, the tenant binding. Does not own: what a refusal
//! looks like on the wire (`codec`), the connection's life (`protocol`).

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use crate::config::mqtt::valid_device_id;
use crate::config::{Config, DeviceConfig};
use crate::gateway::Gateway;
use crate::task::Identity;

/// Why a CONNECT was refused; each maps to a CONNACK return code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not a device id (or empty): 3.1.1 code 2, 5 code 0x85.
    ClientIdNotValid,
    /// Wrong or missing credentials: 3.1.1 code 4, 5 code 0x86.
    BadCredentials,
    /// MQTT 3.1 and older: 3.1.1 code 1.
    ProtocolVersion,
    /// Every slow password check is taken: 3.1.1 code 3 (server
    /// unavailable), 5 code 0x89 (server busy).
    ServerBusy,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::ClientIdNotValid => "the client id is not a device id",
            Refusal::BadCredentials => "bad user name or password",
            Refusal::ProtocolVersion => "only MQTT 3.1.1 and 5 are served",
            Refusal::ServerBusy => "the server is busy: try again later",
        }
    }
}

/// An accepted CONNECT.
#[derive(Debug, Clone)]
pub struct Login<'a> {
    /// The device id (from the client id).
    pub device: &'a str,
    /// Who its requests run as.
    pub identity: Identity,
    /// Unix ms when the credential stops being valid (a JWT's `exp`);
    /// `None` for a password.
    pub expires_at: Option<i64>,
}

/// What a connection's login rests on in the configuration
/// ([`DeviceDirectory::withdrawn`]).
#[derive(Debug, Clone)]
pub struct Grant {
    device: String,
    tenant: String,
    application: String,
    /// A password login of a `[devices.ID]` entry.
    registered: bool,
}

/// How many JWT-only device ids keep their tenant binding (least recently
/// used first to go), unless `[mqtt] max_jwt_device_bindings` says.
pub const TENANT_BINDINGS: usize = 100_000;

/// How many Argon2 verifications may run at once: half the cores, at least
/// one.
pub fn argon2_permits() -> usize {
    (std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).max(1)
}

/// Whether a connection's credential has expired by now (`expires_at` from
/// [`Login`]). A connection past it may not do anything more: the codec
/// ends it at its expiry even if the device sends nothing (MQTT 5
/// DISCONNECT 0xA0; see `protocol`'s `Protocol::ending`), or at its next
/// packet or write should that come first, and the ingress refuses its
/// requests and stops sending.
pub fn expired(expires_at: Option<i64>) -> bool {
    expires_at.is_some_and(|at| crate::task::now_ms() >= at)
}

/// The MQTT 5 DISCONNECT sent to a connection whose token was revoked:
/// 0x87 Not authorized.
pub fn revoked_disconnect() -> rumqttd::protocol::Packet {
    use rumqttd::protocol::{Disconnect, DisconnectProperties, DisconnectReasonCode, Packet};
    let props = DisconnectProperties {
        session_expiry_interval: None,
        reason_string: Some("the token was revoked".into()),
        user_properties: Vec::new(),
        server_reference: None,
    };
    Packet::Disconnect(Disconnect { reason_code: DisconnectReasonCode::NotAuthorized }, Some(props))
}

/// The MQTT 5 DISCONNECT sent to a connection whose credential expired.
pub fn expired_disconnect() -> rumqttd::protocol::Packet {
    use rumqttd::protocol::{Disconnect, DisconnectProperties, DisconnectReasonCode, Packet};
    // The reason string tells the device why (a DISCONNECT without
    // properties is written right too since PATCHES.md 7).
    let props = DisconnectProperties {
        session_expiry_interval: None,
        reason_string: Some("the token has expired".into()),
        user_properties: Vec::new(),
        server_reference: None,
    };
    Packet::Disconnect(Disconnect { reason_code: DisconnectReasonCode::MaximumConnectTime }, Some(props))
}

/// An Argon2id PHC string of a device password, for `[devices.ID]
/// password_hash` (`edgeway hash-password`).
pub fn hash_password(password: &str) -> String {
    let salt = SaltString::generate(&mut argon2::password_hash::rand_core::OsRng);
    Argon2::default().hash_password(password.as_bytes(), &salt).expect("argon2 with default parameters").to_string()
}

/// The identity a registered device's requests run under (a password
/// login; on an external broker, every message of the device).
pub fn registered_identity(d: &DeviceConfig) -> Identity {
    Identity {
        tenant: d.tenant.clone(),
        application: d.application.clone(),
        user_id: Some(d.id.clone()),
        max_priority: d.max_priority,
        default_priority: d.default_priority,
        is_admin: false,
        credential: None,
        data_class: d.data_class,
    }
}

/// The registered devices, the JWT verifier and the tenant bindings.
pub struct DeviceDirectory {
    /// The registered devices and `[auth.jwt]` are read from the
    /// configuration in force at each CONNECT, so that a reload adds and
    /// removes devices and turns tokens on or off (a connected device keeps
    /// its session while its device and application stay). JWTs are checked
    /// by the gateway's authenticator (its revocations are the gateway's).
    gw: Arc<Gateway>,
    /// Argon2 verifications that may start now ([`argon2_permits`]).
    slow_checks: Semaphore,
    /// The tenant each JWT-only device id was first accepted for.
    tenants: Mutex<Bindings>,
    /// SHA-256 of the password that last passed a device's slow check.
    verified: Mutex<HashMap<String, [u8; 32]>>,
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl DeviceDirectory {
    /// `gw` checks JWTs (with its revocations).
    pub fn new(gw: Arc<Gateway>) -> DeviceDirectory {
        let bindings = gw.config().mqtt.as_ref().map_or(TENANT_BINDINGS, |m| m.max_jwt_device_bindings);
        Self::with_limits(gw, argon2_permits(), bindings)
    }

    fn with_limits(gw: Arc<Gateway>, slow_checks: usize, bindings: usize) -> DeviceDirectory {
        let cfg: Arc<Config> = gw.config();
        for d in cfg.devices.values() {
            if d.password_hash.is_none() && d.password_sha256.is_some() {
                tracing::warn!(
                    device = %d.id,
                    "devices.{}.password_sha256 is an unsalted digest and is deprecated: \
                     replace it with password_hash (`edgeway hash-password PASSWORD`)",
                    d.id
                );
            }
        }
        DeviceDirectory {
            gw: gw.clone(),
            slow_checks: Semaphore::new(slow_checks),
            tenants: Mutex::new(Bindings::new(bindings)),
            verified: Mutex::new(HashMap::new()),
        }
    }

    /// Changes after every revocation, and after every accepted reload,
    /// which may remove the device or its application
    /// ([`DeviceDirectory::withdrawn`]).
    pub fn revocations(&self) -> tokio::sync::watch::Receiver<u64> {
        self.gw.revocations()
    }

    /// Whether a connection's credential no longer holds: its `exp` passed
    /// ([`expired`]) or its token id was revoked since (`credential`: the
    /// login identity's [`Identity::credential`]). Checked at every packet
    /// a device sends.
    pub fn lapsed(&self, expires_at: Option<i64>, credential: Option<[u8; 32]>) -> bool {
        expired(expires_at) || credential.is_some_and(|c| self.gw.credential_revoked(&c))
    }

    /// What `login`'s connection rests on in the configuration.
    pub fn grant(login: &Login<'_>) -> Grant {
        Grant {
            device: login.device.to_string(),
            tenant: login.identity.tenant.clone(),
            application: login.identity.application.clone(),
            // A JWT always has an `exp`; a password login needs the
            // device in the file.
            registered: login.expires_at.is_none(),
        }
    }

    /// Whether a reload removed what a connection's login rests on: its
    /// application (or moved it to another tenant), or, for a password
    /// login, its device (or gave it to another application). Checked at
    /// every packet and after every reload, like a revocation.
    pub fn withdrawn(&self, g: &Grant) -> bool {
        let cfg = self.gw.config();
        cfg.applications.get(&g.application).is_none_or(|a| a.tenant != g.tenant)
            || (g.registered
                && cfg.devices.get(&g.device).is_none_or(|d| d.tenant != g.tenant || d.application != g.application))
    }

    /// The device a client id names: `{device}` or `{device}:{instance}`
    /// (a device that keeps several connections, e.g. a subscriber and a
    /// publisher process, gives each its own instance name).
    pub fn device_of(client_id: &str) -> Option<&str> {
        let (device, instance) = match client_id.split_once(':') {
            Some((d, i)) => (d, Some(i)),
            None => (client_id, None),
        };
        let instance_ok = instance.is_none_or(|i| {
            (1..=32).contains(&i.len()) && i.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        });
        (valid_device_id(device) && instance_ok).then_some(device)
    }

    /// The device and the identity its requests run under, or why it may
    /// not connect.
    pub fn authenticate<'a>(
        &self,
        client_id: &'a str,
        user: Option<&str>,
        password: &str,
    ) -> Result<Login<'a>, Refusal> {
        let Some(device) = Self::device_of(client_id) else { return Err(Refusal::ClientIdNotValid) };
        let (identity, expires_at) = self.authenticate_device(device, user, password)?;
        Ok(Login { device, identity, expires_at })
    }

    fn password_ok(&self, d: &DeviceConfig, password: &str) -> Result<bool, Refusal> {
        let digest: [u8; 32] = Sha256::digest(password.as_bytes()).into();
        if let Some(phc) = &d.password_hash {
            if self.verified.lock().expect("verified").get(&d.id).is_some_and(|v| constant_time_eq(v, &digest)) {
                return Ok(true);
            }
            // Never queued: a CONNECT that finds every check taken is
            // refused at once (the device retries later).
            let Ok(_permit) = self.slow_checks.try_acquire() else {
                tracing::warn!(device = %d.id, "MQTT CONNECT refused: every Argon2 check is taken");
                return Err(Refusal::ServerBusy);
            };
            // Validated when the config was loaded. Slow on purpose: on a
            // multi-thread runtime the worker's other tasks move elsewhere
            // meanwhile (the codec calling this cannot await).
            let verify = || {
                PasswordHash::new(phc).is_ok_and(|h| Argon2::default().verify_password(password.as_bytes(), &h).is_ok())
            };
            let multi_thread = tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
            let ok = if multi_thread { tokio::task::block_in_place(verify) } else { verify() };
            if ok {
                self.verified.lock().expect("verified").insert(d.id.clone(), digest);
            }
            return Ok(ok);
        }
        Ok(d.password_sha256.as_ref().is_some_and(|want| constant_time_eq(&digest, want)))
    }

    fn authenticate_device(
        &self,
        client_id: &str,
        user: Option<&str>,
        password: &str,
    ) -> Result<(Identity, Option<i64>), Refusal> {
        // The credentials belong to one device: the user name must be it.
        if user != Some(client_id) {
            return Err(Refusal::BadCredentials);
        }
        let cfg = self.gw.config();
        let device = cfg.devices.get(client_id);
        // A JWT-shaped password is tried as one first: a device that logs
        // in with tokens does not pay Argon2 at every connect.
        let jwt_shaped = cfg.auth.jwt.is_some() && looks_like_jwt(password);
        if jwt_shaped {
            match self.jwt_login(device, client_id, password) {
                Ok(login) => return Ok(login),
                Err(_) if device.is_some() => {}
                Err(e) => return Err(e),
            }
        }
        if let Some(d) = device {
            if self.password_ok(d, password)? {
                return Ok((registered_identity(d), None));
            }
        }
        Err(Refusal::BadCredentials)
    }

    /// A JWT as the password: `sub` must be this device.
    fn jwt_login(
        &self,
        device: Option<&DeviceConfig>,
        client_id: &str,
        password: &str,
    ) -> Result<(Identity, Option<i64>), Refusal> {
        let gw = &self.gw;
        // The leeway in force at this CONNECT: a token is valid until `exp`
        // plus this.
        let leeway_ms = gw.config().auth.jwt.as_ref().ok_or(Refusal::BadCredentials)?.leeway_s as i64 * 1000;
        let mut id = gw.authenticate(Some(password)).map_err(|_| Refusal::BadCredentials)?;
        if id.user_id.as_deref() != Some(client_id) {
            return Err(Refusal::BadCredentials);
        }
        if let Some(d) = device {
            if d.application != id.application || d.tenant != id.tenant {
                return Err(Refusal::BadCredentials);
            }
            id.max_priority = id.max_priority.max(d.max_priority);
            id.default_priority = id.default_priority.max(d.default_priority);
            id.data_class = d.data_class;
        } else {
            self.bind(client_id, &id.tenant)?;
        }
        id.is_admin = false;
        Ok((id, token_expiry(password).map(|at| at + leeway_ms)))
    }

    /// Binds a JWT-only device id to `tenant`, or refuses it if it is bound
    /// to another.
    fn bind(&self, device: &str, tenant: &str) -> Result<(), Refusal> {
        if self.tenants.lock().expect("tenants").bind(device, tenant) {
            Ok(())
        } else {
            tracing::warn!(device, "MQTT CONNECT refused: the device id is bound to another tenant");
            Err(Refusal::BadCredentials)
        }
    }
}

/// The tenant bindings of JWT-only device ids, at most `limit`: past it the
/// least recently used binding is forgotten.
struct Bindings {
    limit: usize,
    /// Device id → (tenant, last use).
    by_device: HashMap<String, (String, u64)>,
    /// Last use → device id, oldest first.
    by_use: BTreeMap<u64, String>,
    clock: u64,
}

impl Bindings {
    fn new(limit: usize) -> Bindings {
        Bindings { limit: limit.max(1), by_device: HashMap::new(), by_use: BTreeMap::new(), clock: 0 }
    }

    /// Whether `device` is (now) bound to `tenant`.
    fn bind(&mut self, device: &str, tenant: &str) -> bool {
        self.clock += 1;
        if let Some((bound, used)) = self.by_device.get_mut(device) {
            if bound != tenant {
                return false;
            }
            self.by_use.remove(used);
            *used = self.clock;
            self.by_use.insert(self.clock, device.to_string());
            return true;
        }
        if self.by_device.len() >= self.limit {
            if let Some((_, oldest)) = self.by_use.pop_first() {
                self.by_device.remove(&oldest);
            }
        }
        self.by_device.insert(device.to_string(), (tenant.to_string(), self.clock));
        self.by_use.insert(self.clock, device.to_string());
        true
    }
}

/// Three non-empty base64url parts, as a compact JWS has: anything else is
/// no JWT, and is not sent to the JWT check.
fn looks_like_jwt(password: &str) -> bool {
    let mut parts = 0;
    for part in password.split('.') {
        parts += 1;
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return false;
        }
    }
    parts == 3
}

/// The `exp` of a token the authenticator has just verified (so its
/// claims can be read without checking the signature again), in unix ms.
fn token_expiry(token: &str) -> Option<i64> {
    let claims = jsonwebtoken::dangerous::insecure_decode_claims::<serde_json::Map<String, serde_json::Value>>(token);
    let exp = claims.ok()?.get("exp")?.as_f64()?;
    Some((exp * 1000.0) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_hashes_are_salted_and_verify() {
        let (a, b) = (hash_password("pw"), hash_password("pw"));
        assert_ne!(a, b, "salted");
        assert!(a.starts_with("$argon2id$"));
        let h = PasswordHash::new(&a).unwrap();
        assert!(Argon2::default().verify_password(b"pw", &h).is_ok());
        assert!(Argon2::default().verify_password(b"px", &h).is_err());
    }

    #[test]
    fn tenant_bindings_are_bounded_least_recently_used_first() {
        let mut b = Bindings::new(2);
        assert!(b.bind("a", "t1") && b.bind("b", "t1"));
        assert!(!b.bind("a", "t2"), "bound to t1");
        assert!(b.bind("a", "t1"), "used again: b is now the oldest");
        assert!(b.bind("c", "t2"), "b is forgotten");
        assert_eq!(b.by_device.len(), 2);
        assert!(!b.bind("a", "t2"), "a is still bound");
        assert!(b.bind("b", "t2"), "b can be bound afresh");
        assert_eq!((b.by_device.len(), b.by_use.len()), (2, 2));
    }

    #[test]
    fn only_jwt_shaped_passwords_go_to_the_jwt_check() {
        assert!(looks_like_jwt("eyJh.eyJz.c2ln-_x"));
        for p in ["", "a.b", "a.b.c.d", "a..c", "a.b.c=", "pass word.x.y", "sk-edgeway-demo"] {
            assert!(!looks_like_jwt(p), "{p}");
        }
    }

    #[test]
    fn expiry() {
        assert!(!expired(None));
        assert!(expired(Some(crate::task::now_ms() - 1)));
        assert!(!expired(Some(crate::task::now_ms() + 60_000)));
    }
}
