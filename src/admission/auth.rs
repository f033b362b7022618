//! Caller identity: API keys (per application, compared by SHA-256 digest,
//! never logged) and JWT bearer tokens (HS256 / RS256, with expiry and
//! not-before checked, and issuer and audience required and checked when
//! configured), and revocation of either (keys by digest, tokens by their
//! `jti` within a tenant, see [`jwt_id_digest`]). Keys of
//! `applications.*.api_keys` carry an expiry, checked on every use (a
//! warning is logged at load for keys that expire within
//! [`EXPIRY_WARNING_MS`]).
//!
//! Does not own: what an identity may do (its models, priorities and
//! ingresses: [`super::request`]), nor the user a trusted header names
//! (the gateway reads the header, admission checks it).

use std::collections::HashMap;
use std::sync::Arc;

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use crate::config::{ApplicationConfig, Config, JwtConfig};
use crate::error::{ErrorCode, GatewayError};
use crate::task::{Identity, Priority};

pub struct Authenticator {
    /// The credentials of the configuration in force; a reload swaps them
    /// whole ([`Authenticator::reload`]), a check reads one snapshot.
    creds: std::sync::RwLock<Arc<Credentials>>,
    /// Keys and token ids ([`jwt_id_digest`]) revoked at run time
    /// (`POST /admin/keys/revoke`; kept in the store and loaded again at
    /// start).
    revoked: std::sync::RwLock<std::collections::HashSet<[u8; 32]>>,
    /// Counts revocations, so that holders of long-lived sessions (MQTT)
    /// check theirs when one happens instead of polling.
    revocations: tokio::sync::watch::Sender<u64>,
}

/// The API keys, applications and token keys of one configuration.
struct Credentials {
    by_key: HashMap<[u8; 32], Arc<ApplicationConfig>>,
    by_name: HashMap<String, Arc<ApplicationConfig>>,
    jwt: Option<JwtVerifier>,
}

struct JwtVerifier {
    cfg: JwtConfig,
    hs: Option<DecodingKey>,
    rs: Option<DecodingKey>,
}

/// How long before a key's expiry a warning is logged (at load and reload).
pub const EXPIRY_WARNING_MS: i64 = 7 * 24 * 3600 * 1000;

/// `ms` (Unix ms, UTC) as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_text(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = crate::store::budget::civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

fn auth_failed(msg: &str) -> GatewayError {
    GatewayError::new(ErrorCode::AuthFailed, msg)
}

/// What a revoked token id of `tenant` is recorded as: a digest in the same
/// set (and store table) as revoked API keys. The tenant is part of it, so
/// an admin revokes token ids of its own tenant only, and the prefix keeps
/// it apart from the digest of any API key.
pub fn jwt_id_digest(tenant: &str, jti: &str) -> [u8; 32] {
    crate::config::hash_api_key(&format!("jwt-id\n{tenant}\n{jti}"))
}

impl Authenticator {
    pub fn new(cfg: &Config) -> Authenticator {
        Authenticator {
            creds: std::sync::RwLock::new(Arc::new(Credentials::new(cfg))),
            revoked: Default::default(),
            revocations: Default::default(),
        }
    }

    /// Takes the applications, keys and `[auth.jwt]` of a reloaded
    /// configuration; revocations stay. Checks already made keep their
    /// identity (a task keeps the rights it was admitted with).
    pub fn reload(&self, cfg: &Config) {
        let creds = Arc::new(Credentials::new(cfg));
        *self.creds.write().unwrap_or_else(std::sync::PoisonError::into_inner) = creds;
    }

    fn creds(&self) -> Arc<Credentials> {
        self.creds.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl Credentials {
    fn new(cfg: &Config) -> Credentials {
        let mut by_key = HashMap::new();
        let mut by_name = HashMap::new();
        let now = crate::task::now_ms();
        for app in cfg.applications.values() {
            for (digest, &at) in &app.key_expires_ms {
                // The digest's first 16 hex digits, as the audit's key id:
                // enough to find the key, not the key.
                let key_id = &hex::encode(digest)[..16];
                if at <= now {
                    tracing::warn!(application = %app.name, key_id, expired = %utc_text(at), "an API key has expired");
                } else if at - now <= EXPIRY_WARNING_MS {
                    tracing::warn!(application = %app.name, key_id, expires = %utc_text(at), "an API key expires soon");
                }
            }
            let app = Arc::new(app.clone());
            for k in &app.api_key_sha256 {
                by_key.insert(*k, app.clone());
            }
            by_name.insert(app.name.clone(), app);
        }
        if let Some(j) = &cfg.auth.jwt {
            // Without them a token signed with the key is accepted whoever
            // issued it and whoever it was meant for: fine for one issuer
            // that mints tokens for edgeway alone, not for a shared one.
            if j.issuer.is_none() || j.audience.is_none() {
                tracing::warn!(
                    issuer = j.issuer.is_some(),
                    audience = j.audience.is_some(),
                    "[auth.jwt] sets no issuer or no audience: tokens are not checked for it"
                );
            }
        }
        let jwt = cfg.auth.jwt.as_ref().map(|j| JwtVerifier {
            hs: j.hs256_secret.as_deref().and_then(|s| DecodingKey::from_secret(s).ok()),
            rs: j.rs256_public_key_pem.as_deref().and_then(|p| DecodingKey::from_rsa_pem(p).ok()),
            cfg: j.clone(),
        });
        Credentials { by_key, by_name, jwt }
    }
}

impl Authenticator {
    /// Identifies the caller from a bearer credential (API key or JWT).
    pub fn authenticate(&self, credential: Option<&str>) -> Result<Identity, GatewayError> {
        let cred = credential
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .ok_or_else(|| auth_failed("missing credentials: send an API key or JWT as 'Authorization: Bearer …'"))?;
        let digest = crate::config::hash_api_key(cred);
        if self.revoked.read().expect("revoked keys").contains(&digest) {
            return Err(auth_failed("this API key has been revoked"));
        }
        let creds = self.creds();
        if let Some(app) = creds.by_key.get(&digest) {
            if let Some(&at) = app.key_expires_ms.get(&digest).filter(|&&at| crate::task::now_ms() >= at) {
                return Err(auth_failed(&format!("this API key expired at {}", utc_text(at))));
            }
            return Ok(identity(app, None, Some(digest)));
        }
        if cred.matches('.').count() == 2 {
            if let Some(j) = &creds.jwt {
                return self.verify_jwt(&creds, j, cred);
            }
        }
        Err(auth_failed("invalid API key or token"))
    }

    fn verify_jwt(&self, creds: &Credentials, j: &JwtVerifier, token: &str) -> Result<Identity, GatewayError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| auth_failed("malformed token"))?;
        let key = match header.alg {
            Algorithm::HS256 => j.hs.as_ref(),
            Algorithm::RS256 => j.rs.as_ref(),
            _ => None,
        }
        .ok_or_else(|| auth_failed("token algorithm not accepted"))?;
        let mut v = Validation::new(header.alg);
        v.leeway = j.cfg.leeway_s;
        v.validate_nbf = true;
        // A configured issuer or audience is required, not only checked
        // when the token happens to carry it.
        let mut required = vec!["exp"];
        required.extend(j.cfg.issuer.as_ref().map(|_| "iss"));
        required.extend(j.cfg.audience.as_ref().map(|_| "aud"));
        v.set_required_spec_claims(&required);
        match &j.cfg.issuer {
            Some(iss) => v.set_issuer(&[iss]),
            None => v.iss = None,
        }
        match &j.cfg.audience {
            Some(aud) => v.set_audience(&[aud]),
            None => v.validate_aud = false,
        }
        let data = jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, key, &v).map_err(|e| {
            use jsonwebtoken::errors::ErrorKind;
            match e.kind() {
                ErrorKind::ExpiredSignature => auth_failed("token expired"),
                ErrorKind::ImmatureSignature => auth_failed("token not valid yet (nbf)"),
                ErrorKind::MissingRequiredClaim(c) if c == "iss" => auth_failed("token names no issuer"),
                ErrorKind::MissingRequiredClaim(c) if c == "aud" => auth_failed("token names no audience"),
                ErrorKind::InvalidIssuer => auth_failed("token issuer not accepted"),
                ErrorKind::InvalidAudience => auth_failed("token audience not accepted"),
                _ => auth_failed("invalid token"),
            }
        })?;
        let claims = data.claims;
        let claim = |name: &str| claims.get(name).and_then(Value::as_str).map(str::to_string);
        let app_name = claim(&j.cfg.application_claim).ok_or_else(|| auth_failed("token names no application"))?;
        let app = creds.by_name.get(&app_name).ok_or_else(|| auth_failed("token names an unknown application"))?;
        if let Some(t) = claim(&j.cfg.tenant_claim) {
            if t != app.tenant {
                return Err(GatewayError::new(
                    ErrorCode::PermissionDenied,
                    "token tenant does not own this application",
                ));
            }
        }
        // A revoked token id is refused like a revoked key. The digest is
        // the identity's credential, so revoking it also cancels the tasks
        // the token submitted.
        let jti = claim("jti").map(|jti| jwt_id_digest(&app.tenant, &jti));
        if jti.is_some_and(|d| self.revoked.read().expect("revoked keys").contains(&d)) {
            return Err(auth_failed("this token has been revoked"));
        }
        Ok(identity(app, claim("sub"), jti))
    }
}

/// The identity of application `app`'s calls with no credential of their
/// own: those another node of the pool forwarded, having checked the
/// caller's (`ingress::nats::forward`).
pub fn application_identity(app: &ApplicationConfig, user: Option<String>) -> Identity {
    identity(app, user, None)
}

fn identity(app: &ApplicationConfig, user: Option<String>, credential: Option<[u8; 32]>) -> Identity {
    Identity {
        tenant: app.tenant.clone(),
        application: app.name.clone(),
        user_id: user,
        max_priority: app.max_priority,
        default_priority: app.default_priority,
        is_admin: app.admin,
        credential,
        data_class: None,
    }
}

impl Authenticator {
    /// Refuses the key (or token id digest) from now on. Returns whether it
    /// was a known key.
    pub fn revoke(&self, digest: [u8; 32]) -> bool {
        self.revoked.write().expect("revoked keys").insert(digest);
        self.revocations.send_modify(|n| *n += 1);
        self.creds().by_key.contains_key(&digest)
    }

    /// Tells the holders of [`Authenticator::revocations`] to check their
    /// credentials again without a revocation (a reload removed devices,
    /// keys or applications).
    pub fn announce(&self) {
        self.revocations.send_modify(|n| *n += 1);
    }

    /// Changes after every revocation (see [`Authenticator::is_revoked`]).
    pub fn revocations(&self) -> tokio::sync::watch::Receiver<u64> {
        self.revocations.subscribe()
    }

    /// Whether the key (or token id digest) is revoked.
    pub fn is_revoked(&self, digest: &[u8; 32]) -> bool {
        self.revoked.read().expect("revoked keys").contains(digest)
    }

    /// Accepts a revoked key again. Returns whether it was revoked.
    pub fn reinstate(&self, digest: &[u8; 32]) -> bool {
        self.revoked.write().expect("revoked keys").remove(digest)
    }

    /// Whether `digest` is one of the API keys (not a token id) of
    /// application `app`: a `user_header` is honoured for those only.
    pub fn is_key_of(&self, digest: &[u8; 32], app: &str) -> bool {
        self.creds().by_key.get(digest).is_some_and(|a| a.name == app)
    }

    /// The application a key digest belongs to.
    pub fn key_owner(&self, digest: &[u8; 32]) -> Option<(String, String)> {
        self.creds().by_key.get(digest).map(|a| (a.tenant.clone(), a.name.clone()))
    }

    /// [`Authenticator::key_owner`] while the key is in force: `None` once
    /// it has expired (a connection opened with it ends then).
    pub fn key_owner_in_force(&self, digest: &[u8; 32]) -> Option<(String, String)> {
        let creds = self.creds();
        let app = creds.by_key.get(digest)?;
        let expired = app.key_expires_ms.get(digest).is_some_and(|&at| crate::task::now_ms() >= at);
        (!expired).then(|| (app.tenant.clone(), app.name.clone()))
    }
}

/// Whether `identity` may use `p`.
pub fn may_use(identity: &Identity, p: Priority) -> bool {
    p >= identity.max_priority
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;

    const SECRET: &str = "an-hs256-secret-of-enough-length";

    fn config() -> Config {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let text = format!(
            r#"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["{}"]
max_priority = "P1"
[auth.jwt]
hs256_secret_env = "JWT_SECRET"
rs256_public_key_file = "tests/fixtures/jwt-test-public.pem"
issuer = "https://auth.test"
audience = "edgeway"
[engines.e]
type = "openai"
base_url = "http://127.0.0.1:1"
model = "m"
[models.m]
instances = ["e"]
"#,
            hex::encode(crate::config::hash_api_key("sk-good"))
        );
        Config::from_toml_str(&text, [("JWT_SECRET".to_string(), SECRET.to_string())], dir).unwrap()
    }

    fn now() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
    }

    fn claims(exp_offset: i64) -> Value {
        json!({
            "sub": "alice", "app": "demo", "tenant": "demo",
            "iss": "https://auth.test", "aud": "edgeway",
            "exp": (now() as i64 + exp_offset) as u64,
        })
    }

    fn hs(c: &Value) -> String {
        encode(&Header::new(Algorithm::HS256), c, &EncodingKey::from_secret(SECRET.as_bytes()).unwrap()).unwrap()
    }

    fn rs(c: &Value) -> String {
        let pem = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jwt-test-private.pem")).unwrap();
        encode(&Header::new(Algorithm::RS256), c, &EncodingKey::from_rsa_pem(&pem).unwrap()).unwrap()
    }

    fn code(r: Result<Identity, GatewayError>) -> ErrorCode {
        r.unwrap_err().code
    }

    #[test]
    fn utc_text_writes_calendar_dates() {
        assert_eq!(utc_text(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_text(1_798_761_600_000), "2027-01-01T00:00:00Z");
        assert_eq!(utc_text(951_782_400_000 + 3_723_000), "2000-02-29T01:02:03Z");
    }

    #[test]
    fn api_keys_identify_the_application() {
        let a = Authenticator::new(&config());
        let id = a.authenticate(Some("sk-good")).unwrap();
        assert_eq!((id.tenant.as_str(), id.application.as_str()), ("demo", "demo"));
        assert_eq!(id.max_priority, Priority::P1);
        assert_eq!(code(a.authenticate(Some("sk-bad"))), ErrorCode::AuthFailed);
        assert_eq!(code(a.authenticate(None)), ErrorCode::AuthFailed);
        assert_eq!(code(a.authenticate(Some("  "))), ErrorCode::AuthFailed);
    }

    #[test]
    fn hs256_and_rs256_tokens_identify_tenant_application_and_user() {
        let a = Authenticator::new(&config());
        for token in [hs(&claims(60)), rs(&claims(60))] {
            let id = a.authenticate(Some(&token)).unwrap();
            assert_eq!(id.user_id.as_deref(), Some("alice"));
            assert_eq!(id.application, "demo");
            assert_eq!(id.tenant, "demo");
        }
    }

    #[test]
    fn tokens_are_checked_for_expiry_issuer_audience_signature_and_owner() {
        let a = Authenticator::new(&config());
        let expired = claims(-3600);
        let mut wrong_iss = claims(60);
        wrong_iss["iss"] = json!("https://evil");
        let mut wrong_aud = claims(60);
        wrong_aud["aud"] = json!("other");
        let mut unknown_app = claims(60);
        unknown_app["app"] = json!("nobody");
        let mut no_exp = claims(60);
        no_exp.as_object_mut().unwrap().remove("exp");
        for c in [&expired, &wrong_iss, &wrong_aud, &unknown_app, &no_exp] {
            assert_eq!(code(a.authenticate(Some(&hs(c)))), ErrorCode::AuthFailed, "{c}");
        }
        let forged = encode(
            &Header::new(Algorithm::HS256),
            &claims(60),
            &EncodingKey::from_secret(b"another-secret-entirely!").unwrap(),
        )
        .unwrap();
        assert_eq!(code(a.authenticate(Some(&forged))), ErrorCode::AuthFailed);
        let mut other_tenant = claims(60);
        other_tenant["tenant"] = json!("acme");
        assert_eq!(code(a.authenticate(Some(&hs(&other_tenant)))), ErrorCode::PermissionDenied);
    }

    #[test]
    fn not_before_is_checked_with_the_same_leeway_as_expiry() {
        let a = Authenticator::new(&config());
        let mut later = claims(7200);
        later["nbf"] = json!(now() + 3600);
        let e = a.authenticate(Some(&hs(&later))).unwrap_err();
        assert_eq!((e.code, e.message.as_str()), (ErrorCode::AuthFailed, "token not valid yet (nbf)"));
        // Within the leeway (30 s): clocks differ a little.
        let mut soon = claims(7200);
        soon["nbf"] = json!(now() + 10);
        assert!(a.authenticate(Some(&hs(&soon))).is_ok());
    }

    #[test]
    fn a_configured_issuer_and_audience_must_be_in_the_token() {
        let a = Authenticator::new(&config());
        for (claim, msg) in [("iss", "token names no issuer"), ("aud", "token names no audience")] {
            let mut c = claims(60);
            c.as_object_mut().unwrap().remove(claim);
            for token in [hs(&c), rs(&c)] {
                let e = a.authenticate(Some(&token)).unwrap_err();
                assert_eq!((e.code, e.message.as_str()), (ErrorCode::AuthFailed, msg));
            }
        }
    }

    #[test]
    fn a_revoked_token_id_is_refused_like_a_revoked_key_in_its_tenant_only() {
        let a = Authenticator::new(&config());
        let with_jti = |jti: &str| {
            let mut c = claims(60);
            c["jti"] = json!(jti);
            hs(&c)
        };
        let id = a.authenticate(Some(&with_jti("t-1"))).unwrap();
        assert_eq!(id.credential, Some(jwt_id_digest("demo", "t-1")), "its tasks can be found by it");
        // Another tenant's id of the same name is another id.
        a.revoke(jwt_id_digest("acme", "t-1"));
        assert!(a.authenticate(Some(&with_jti("t-1"))).is_ok());
        a.revoke(jwt_id_digest("demo", "t-1"));
        for token in [with_jti("t-1"), {
            let mut c = claims(60);
            c["jti"] = json!("t-1");
            rs(&c)
        }] {
            let e = a.authenticate(Some(&token)).unwrap_err();
            assert_eq!((e.code, e.message.as_str()), (ErrorCode::AuthFailed, "this token has been revoked"));
        }
        assert!(a.authenticate(Some(&with_jti("t-2"))).is_ok());
        assert!(a.authenticate(Some(&hs(&claims(60)))).is_ok(), "a token without jti");
        assert!(a.reinstate(&jwt_id_digest("demo", "t-1")));
        assert!(a.authenticate(Some(&with_jti("t-1"))).is_ok());
    }
}
