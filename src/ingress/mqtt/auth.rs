//! Device authentication at CONNECT: the client id names the device, the
//! user name must repeat it, and the password is the device's password
//! (compared by SHA-256 digest) or a JWT whose `sub` is the device.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use crate::config::mqtt::valid_device_id;
use crate::config::{Config, DeviceConfig};
use crate::gateway::Authenticator;
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
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::ClientIdNotValid => "the client id is not a device id",
            Refusal::BadCredentials => "bad user name or password",
            Refusal::ProtocolVersion => "only MQTT 3.1.1 and 5 are served",
        }
    }
}

/// The registered devices and the JWT verifier.
pub struct DeviceDirectory {
    devices: HashMap<String, DeviceConfig>,
    jwt: Option<Authenticator>,
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl DeviceDirectory {
    pub fn new(cfg: &Config) -> DeviceDirectory {
        DeviceDirectory {
            devices: cfg.devices.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            jwt: cfg.auth.jwt.as_ref().map(|_| Authenticator::new(cfg)),
        }
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
    ) -> Result<(&'a str, Identity), Refusal> {
        let Some(device) = Self::device_of(client_id) else { return Err(Refusal::ClientIdNotValid) };
        self.authenticate_device(device, user, password).map(|id| (device, id))
    }

    fn authenticate_device(&self, client_id: &str, user: Option<&str>, password: &str) -> Result<Identity, Refusal> {
        // The credentials belong to one device: the user name must be it.
        if user != Some(client_id) {
            return Err(Refusal::BadCredentials);
        }
        let device = self.devices.get(client_id);
        if let Some(d) = device {
            if let Some(want) = &d.password_sha256 {
                let got: [u8; 32] = Sha256::digest(password.as_bytes()).into();
                if constant_time_eq(&got, want) {
                    return Ok(Identity {
                        tenant: d.tenant.clone(),
                        application: d.application.clone(),
                        user_id: Some(client_id.to_string()),
                        max_priority: d.max_priority,
                        default_priority: d.default_priority,
                        is_admin: false,
                        credential: None,
                        data_class: d.data_class,
                    });
                }
            }
        }
        // A JWT as the password: `sub` must be this device.
        if password.matches('.').count() == 2 {
            if let Some(jwt) = &self.jwt {
                let mut id = jwt.authenticate(Some(password)).map_err(|_| Refusal::BadCredentials)?;
                if id.user_id.as_deref() != Some(client_id) {
                    return Err(Refusal::BadCredentials);
                }
                if let Some(d) = device {
                    if d.application != id.application {
                        return Err(Refusal::BadCredentials);
                    }
                    id.max_priority = id.max_priority.max(d.max_priority);
                    id.default_priority = id.default_priority.max(d.default_priority);
                    id.data_class = d.data_class;
                }
                id.is_admin = false;
                return Ok(id);
            }
        }
        Err(Refusal::BadCredentials)
    }
}
