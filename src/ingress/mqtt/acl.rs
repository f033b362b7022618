//! The broker-side isolation of `[mqtt] mode = "external"`, written from
//! edgeway's device registry (`edgeway mqtt-acl`): on an external broker
//! edgeway cannot keep devices apart itself (as the embedded broker's
//! mounts do), the broker's ACLs must.
//!
//! - **Mosquitto ACL file** (`acl_file`): one `user` block per device, which
//!   may publish only its own `{prefix}/{id}/req`, `/cancel` and `/resume`
//!   and read only its own namespace `{prefix}/{id}/#` (responses, compact
//!   streams, MQTT 5 response topics) and the read-only `{prefix}/shared/#`;
//!   edgeway's user reads every device's requests, cancels and resumes
//!   (the requests through the shared subscription) and writes under
//!   `{prefix}/#`. Mosquitto denies whatever no line allows.
//! - **Mosquitto password file** (`password_file`): `user:$7$…`, PBKDF2-
//!   SHA512 as `mosquitto_passwd` writes it (Mosquitto 2), for every device
//!   and edgeway's user. edgeway keeps only hashes of device passwords,
//!   which cannot be turned back, so each device's plain password comes
//!   from the environment variable its `[devices.ID] mqtt_password_env`
//!   names, and must match the device's `password_hash` /
//!   `password_sha256` when it has one (the two brokers agree); edgeway's
//!   own from `[mqtt.external] password_env`. A device without it is an
//!   error naming it, unless only the ACLs are asked for.
//! - **EMQX** `acl.conf` (Erlang terms): the same rules, then
//!   `{deny, all}.` (EMQX users come from its own authentication).
//!
//! Owns: the rules and the file formats. Does not own: the files' place
//! (the command) or the broker's other settings.

use std::fmt::Write as _;

use argon2::password_hash::rand_core::{OsRng, RngCore};
use argon2::password_hash::{PasswordHash, PasswordVerifier};
use base64::Engine as _;
use sha2::{Digest, Sha256, Sha512};

use crate::config::{Config, DeviceConfig};

/// PBKDF2 rounds of the password file: what `mosquitto_passwd` writes.
pub const MOSQUITTO_ITERATIONS: u32 = 101;

/// Why the files cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum AclError {
    #[error("[mqtt] mode = \"external\" with [mqtt.external] is needed: it names edgeway's user and shared group")]
    NotExternal,
    #[error("mqtt.external.username is needed: the ACLs give edgeway's user its rights")]
    NoEdgewayUser,
    #[error("mqtt.external.password_env is needed for the password file (or write the ACLs only)")]
    NoEdgewayPassword,
    #[error("device {0:?} has the user name of edgeway itself; rename one of them")]
    DeviceIsEdgeway(String),
    #[error(
        "no plain password for devices {0:?}: set [devices.ID] mqtt_password_env to a variable holding it \
         (edgeway keeps only hashes), or write the ACLs only"
    )]
    MissingPasswords(Vec<String>),
    #[error("the password in {var} does not match devices.{device}'s password hash")]
    PasswordMismatch { device: String, var: String },
}

/// The files for the broker.
#[derive(Debug, Clone)]
pub struct BrokerFiles {
    pub mosquitto_acl: String,
    /// `None` when only the ACLs were asked for.
    pub mosquitto_passwd: Option<String>,
    pub emqx_acl: String,
}

/// The files for `cfg`'s device registry. `env` reads an environment
/// variable (the device passwords); `passwords`: whether to write the
/// password file.
pub fn broker_files(
    cfg: &Config,
    env: impl Fn(&str) -> Option<String>,
    passwords: bool,
) -> Result<BrokerFiles, AclError> {
    let mqtt = cfg.mqtt.as_ref().ok_or(AclError::NotExternal)?;
    let ext = mqtt.external.as_ref().ok_or(AclError::NotExternal)?;
    let edgeway = ext.username.as_deref().ok_or(AclError::NoEdgewayUser)?;
    let prefix = mqtt.topic_prefix.as_str();
    let devices: Vec<&DeviceConfig> = cfg.devices.values().collect();
    if let Some(d) = devices.iter().find(|d| d.id == edgeway) {
        return Err(AclError::DeviceIsEdgeway(d.id.clone()));
    }
    let mosquitto_passwd =
        passwords.then(|| password_file(edgeway, ext.password.as_ref(), &devices, &env)).transpose()?;
    Ok(BrokerFiles {
        mosquitto_acl: mosquitto_acl(prefix, edgeway, &devices),
        mosquitto_passwd,
        emqx_acl: emqx_acl(prefix, edgeway, &ext.shared_group, &devices),
    })
}

/// Writes the files into `dir` (`mosquitto.acl`, `mosquitto.passwd`
/// readable by its owner only, `emqx-acl.conf`); returns their paths.
pub fn write_files(dir: &std::path::Path, files: &BrokerFiles) -> std::io::Result<Vec<std::path::PathBuf>> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    let mut write = |name: &str, text: &str, mode: u32| -> std::io::Result<()> {
        let path = dir.join(name);
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&path)?;
        // `mode` only applies to a new file: an old one gets it too.
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        std::io::Write::write_all(&mut f, text.as_bytes())?;
        written.push(path);
        Ok(())
    };
    write("mosquitto.acl", &files.mosquitto_acl, 0o644)?;
    if let Some(p) = &files.mosquitto_passwd {
        write("mosquitto.passwd", p, 0o600)?;
    }
    write("emqx-acl.conf", &files.emqx_acl, 0o644)?;
    Ok(written)
}

fn password_file(
    edgeway: &str,
    edgeway_password: Option<&crate::config::Secret>,
    devices: &[&DeviceConfig],
    env: &impl Fn(&str) -> Option<String>,
) -> Result<String, AclError> {
    let edgeway_password = edgeway_password.ok_or(AclError::NoEdgewayPassword)?;
    let mut out = mosquitto_password_line(edgeway, edgeway_password.expose(), &salt(), MOSQUITTO_ITERATIONS);
    let mut missing = Vec::new();
    for d in devices {
        let Some((var, password)) =
            d.mqtt_password_env.as_ref().and_then(|v| env(v).filter(|p| !p.is_empty()).map(|p| (v, p)))
        else {
            missing.push(d.id.clone());
            continue;
        };
        if !matches_registry(d, &password) {
            return Err(AclError::PasswordMismatch { device: d.id.clone(), var: var.clone() });
        }
        out.push_str(&mosquitto_password_line(&d.id, &password, &salt(), MOSQUITTO_ITERATIONS));
    }
    if !missing.is_empty() {
        return Err(AclError::MissingPasswords(missing));
    }
    Ok(out)
}

/// Whether `password` is the one `[devices.ID]` holds a hash of (true
/// when it holds none: a JWT-only device on the embedded broker).
fn matches_registry(d: &DeviceConfig, password: &str) -> bool {
    if let Some(phc) = &d.password_hash {
        return PasswordHash::new(phc)
            .is_ok_and(|h| argon2::Argon2::default().verify_password(password.as_bytes(), &h).is_ok());
    }
    if let Some(want) = &d.password_sha256 {
        let got: [u8; 32] = Sha256::digest(password.as_bytes()).into();
        return &got == want;
    }
    true
}

fn salt() -> [u8; 12] {
    let mut s = [0u8; 12];
    OsRng.fill_bytes(&mut s);
    s
}

/// One line of a Mosquitto 2 password file: `user:$7$iterations$salt$hash`
/// (PBKDF2-HMAC-SHA512, 64 bytes; salt and hash in standard base64).
pub fn mosquitto_password_line(user: &str, password: &str, salt: &[u8], iterations: u32) -> String {
    let mut hash = [0u8; 64];
    pbkdf2_sha512(password.as_bytes(), salt, iterations, &mut hash);
    let b64 = base64::engine::general_purpose::STANDARD;
    format!("{user}:$7${iterations}${}${}\n", b64.encode(salt), b64.encode(hash))
}

/// HMAC-SHA512 (RFC 2104) of `msg` under `key`.
fn hmac_sha512(key: &[u8], msg: &[&[u8]]) -> [u8; 64] {
    crate::ingress::hmac::<Sha512>(key, msg).into()
}

/// PBKDF2 (RFC 8018) with HMAC-SHA512, filling `out`.
fn pbkdf2_sha512(password: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
    for (i, chunk) in out.chunks_mut(64).enumerate() {
        let block = (i as u32 + 1).to_be_bytes();
        let mut u = hmac_sha512(password, &[salt, &block]);
        let mut t = u;
        for _ in 1..iterations {
            u = hmac_sha512(password, &[&u]);
            t.iter_mut().zip(u.iter()).for_each(|(t, u)| *t ^= u);
        }
        chunk.copy_from_slice(&t[..chunk.len()]);
    }
}

/// The topics a device publishes to edgeway.
fn device_writes(prefix: &str, id: &str) -> [String; 3] {
    ["req", "cancel", "resume"].map(|k| format!("{prefix}/{id}/{k}"))
}

fn mosquitto_acl(prefix: &str, edgeway: &str, devices: &[&DeviceConfig]) -> String {
    let mut s = String::from(
        "# Written by `edgeway mqtt-acl` from edgeway's device registry; do not edit.\n\
         # Mosquitto denies whatever no line below allows.\n\n",
    );
    let _ = writeln!(s, "# edgeway: every device's requests (shared subscription), cancels and resumes; the answers.");
    let _ = writeln!(s, "user {edgeway}");
    for k in ["req", "cancel", "resume"] {
        let _ = writeln!(s, "topic read {prefix}/+/{k}");
    }
    let _ = writeln!(s, "topic write {prefix}/#");
    for d in devices {
        let _ = writeln!(s, "\n# device {} (tenant {}): its own topics only.", d.id, d.tenant);
        let _ = writeln!(s, "user {}", d.id);
        for t in device_writes(prefix, &d.id) {
            let _ = writeln!(s, "topic write {t}");
        }
        let _ = writeln!(s, "topic read {prefix}/{}/#", d.id);
        let _ = writeln!(s, "topic read {prefix}/shared/#");
    }
    s
}

/// An Erlang string literal.
fn erl(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn erl_list(items: &[String]) -> String {
    format!("[{}]", items.iter().map(|t| erl(t)).collect::<Vec<_>>().join(", "))
}

fn emqx_acl(prefix: &str, edgeway: &str, group: &str, devices: &[&DeviceConfig]) -> String {
    let mut s = String::from("%% Written by `edgeway mqtt-acl` from edgeway's device registry; do not edit.\n\n");
    let reads = [
        format!("$share/{group}/{prefix}/+/req"),
        format!("{prefix}/+/req"),
        format!("{prefix}/+/cancel"),
        format!("{prefix}/+/resume"),
    ];
    let _ = writeln!(s, "%% edgeway: every device's requests (shared subscription), cancels and resumes; the answers.");
    let _ = writeln!(s, "{{allow, {{username, {}}}, subscribe, {}}}.", erl(edgeway), erl_list(&reads));
    let _ = writeln!(s, "{{allow, {{username, {}}}, publish, {}}}.", erl(edgeway), erl_list(&[format!("{prefix}/#")]));
    for d in devices {
        let _ = writeln!(s, "\n%% device {} (tenant {}): its own topics only.", d.id, d.tenant);
        let user = erl(&d.id);
        let _ = writeln!(s, "{{allow, {{username, {user}}}, publish, {}}}.", erl_list(&device_writes(prefix, &d.id)));
        let reads = [format!("{prefix}/{}/#", d.id), format!("{prefix}/shared/#")];
        let _ = writeln!(s, "{{allow, {{username, {user}}}, subscribe, {}}}.", erl_list(&reads));
    }
    s.push_str("\n{deny, all}.\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_sha512_matches_rfc_4231() {
        // Test case 2.
        let mac = hmac_sha512(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(
            hex::encode(mac),
            "164b7a7bfcf819e2e395fbe73b56e0a387bd64222e831fd610270cd7ea2505549758bf75c05a994a6d034f65f8f0e6fd\
             caeab1a34d4a6b4b636e070a38bce737"
        );
    }

    #[test]
    fn pbkdf2_sha512_matches_a_known_vector() {
        let mut out = [0u8; 64];
        pbkdf2_sha512(b"password", b"salt", 2, &mut out);
        assert_eq!(
            hex::encode(out),
            "e1d9c16aa681708a45f5c7c4e215ceb66e011a2e9f0040713f18aefdb866d53cf76cab2868a39b9f7840edce4fef5a82\
             be67335c77a6068e04112754f27ccf4e"
        );
    }

    /// A line `mosquitto_passwd -b` 2.0.11 wrote: the same salt gives the
    /// same hash.
    #[test]
    fn password_lines_are_what_mosquitto_passwd_writes() {
        let want = "dev1:$7$101$qxXGPUiVjnjqjK5i$6sDVIGhDUve3SPjNtXM7qod+/Bj7Aiq7mYVjlYJMtfUAbQSbDpyRlsbvphlqtU87NYRukKB6GJKrS02WXEuiQw==\n";
        let salt = base64::engine::general_purpose::STANDARD.decode("qxXGPUiVjnjqjK5i").unwrap();
        assert_eq!(mosquitto_password_line("dev1", "secret-1", &salt, 101), want);
    }
}
