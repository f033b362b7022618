//! Caller identity: API keys (per application, compared by SHA-256 digest,
//! never logged) and JWT bearer tokens (HS256 / RS256, with issuer, audience
//! and expiry checked).

use std::collections::HashMap;
use std::sync::Arc;

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use crate::config::{ApplicationConfig, Config, JwtConfig};
use crate::error::{ErrorCode, GatewayError};
use crate::task::{Identity, Priority};

pub struct Authenticator {
    by_key: HashMap<[u8; 32], Arc<ApplicationConfig>>,
    by_name: HashMap<String, Arc<ApplicationConfig>>,
    jwt: Option<JwtVerifier>,
    /// Keys revoked at run time (`POST /admin/keys/revoke`; kept in the
    /// store and loaded again at start).
    revoked: std::sync::RwLock<std::collections::HashSet<[u8; 32]>>,
}

struct JwtVerifier {
    cfg: JwtConfig,
    hs: Option<DecodingKey>,
    rs: Option<DecodingKey>,
}

fn auth_failed(msg: &str) -> GatewayError {
    GatewayError::new(ErrorCode::AuthFailed, msg)
}

impl Authenticator {
    pub fn new(cfg: &Config) -> Authenticator {
        let mut by_key = HashMap::new();
        let mut by_name = HashMap::new();
        for app in cfg.applications.values() {
            let app = Arc::new(app.clone());
            for k in &app.api_key_sha256 {
                by_key.insert(*k, app.clone());
            }
            by_name.insert(app.name.clone(), app);
        }
        let jwt = cfg.auth.jwt.as_ref().map(|j| JwtVerifier {
            hs: j.hs256_secret.as_deref().and_then(|s| DecodingKey::from_secret(s).ok()),
            rs: j.rs256_public_key_pem.as_deref().and_then(|p| DecodingKey::from_rsa_pem(p).ok()),
            cfg: j.clone(),
        });
        Authenticator { by_key, by_name, jwt, revoked: Default::default() }
    }

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
        if let Some(app) = self.by_key.get(&digest) {
            return Ok(identity(app, None, Some(digest)));
        }
        if cred.matches('.').count() == 2 {
            if let Some(j) = &self.jwt {
                return self.verify_jwt(j, cred);
            }
        }
        Err(auth_failed("invalid API key or token"))
    }

    fn verify_jwt(&self, j: &JwtVerifier, token: &str) -> Result<Identity, GatewayError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| auth_failed("malformed token"))?;
        let key = match header.alg {
            Algorithm::HS256 => j.hs.as_ref(),
            Algorithm::RS256 => j.rs.as_ref(),
            _ => None,
        }
        .ok_or_else(|| auth_failed("token algorithm not accepted"))?;
        let mut v = Validation::new(header.alg);
        v.leeway = j.cfg.leeway_s;
        v.set_required_spec_claims(&["exp"]);
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
                ErrorKind::InvalidIssuer => auth_failed("token issuer not accepted"),
                ErrorKind::InvalidAudience => auth_failed("token audience not accepted"),
                _ => auth_failed("invalid token"),
            }
        })?;
        let claims = data.claims;
        let claim = |name: &str| claims.get(name).and_then(Value::as_str).map(str::to_string);
        let app_name = claim(&j.cfg.application_claim).ok_or_else(|| auth_failed("token names no application"))?;
        let app = self.by_name.get(&app_name).ok_or_else(|| auth_failed("token names an unknown application"))?;
        if let Some(t) = claim(&j.cfg.tenant_claim) {
            if t != app.tenant {
                return Err(GatewayError::new(
                    ErrorCode::PermissionDenied,
                    "token tenant does not own this application",
                ));
            }
        }
        Ok(identity(app, claim("sub"), None))
    }
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
    /// Refuses the key from now on. Returns whether it was a known key.
    pub fn revoke(&self, digest: [u8; 32]) -> bool {
        self.revoked.write().expect("revoked keys").insert(digest);
        self.by_key.contains_key(&digest)
    }

    /// Accepts a revoked key again. Returns whether it was revoked.
    pub fn reinstate(&self, digest: &[u8; 32]) -> bool {
        self.revoked.write().expect("revoked keys").remove(digest)
    }

    /// The application a key digest belongs to.
    pub fn key_owner(&self, digest: &[u8; 32]) -> Option<(String, String)> {
        self.by_key.get(digest).map(|a| (a.tenant.clone(), a.name.clone()))
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
}
