//! Bearer tokens: an ES256 JWT issuer for `loams dev` and a verifier over a JWKS (local keys or fetched from a URL).
//!
//! The verifier pins the algorithm to ES256 (the header's `alg` is never trusted), checks signature, `iss`, `aud` and
//! `exp`, and requires the `org` claim: every request is scoped to exactly the organisation its token names.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
use jsonwebtoken::jwk::{Jwk, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use crate::ApiError;

/// Longest bearer token accepted; anything larger is not one of ours.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// Largest JWKS document fetched.
pub const MAX_JWKS_BYTES: usize = 64 * 1024;
/// Clock skew tolerated on `exp`.
const LEEWAY_S: u64 = 30;
/// Unknown `kid`s trigger a refetch of the JWKS (key rotation), but not more often than this.
const MIN_REFRESH: Duration = Duration::from_secs(60);

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Claims {
    pub sub: String,
    pub org: String,
    pub iss: String,
    pub aud: String,
    pub exp: u64,
    pub iat: u64,
    /// Space-separated scopes.
    #[serde(default)]
    pub scope: String,
}

/// Who is calling: taken from a verified token only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub user: String,
    pub org: String,
    pub scopes: Vec<String>,
}

/// The development issuer run by `loams dev`: one P-256 key generated at start, served as a JWKS.
pub struct Issuer {
    key: EncodingKey,
    kid: String,
    jwk: Jwk,
    iss: String,
    aud: String,
}

impl Issuer {
    pub fn generate(iss: impl Into<String>, aud: impl Into<String>) -> Result<Self, ApiError> {
        Self::from_pkcs8(&Self::generate_pkcs8()?, iss, aud)
    }

    /// A new P-256 private key (PKCS#8 DER), for an issuer whose key must outlive the process.
    pub fn generate_pkcs8() -> Result<Vec<u8>, ApiError> {
        EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &SystemRandom::new())
            .map(|doc| doc.as_ref().to_vec())
            .map_err(|_| ApiError::Internal("generating the issuer key failed".into()))
    }

    /// The issuer over a stored P-256 key. The key id is derived from the public key, so it is the same after a
    /// restart and tokens issued before it stay valid.
    pub fn from_pkcs8(pkcs8: &[u8], iss: impl Into<String>, aud: impl Into<String>) -> Result<Self, ApiError> {
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8)
            .map_err(|_| ApiError::Internal("the issuer key is not a P-256 PKCS#8 key".into()))?;
        let thumb = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, pair.public_key().as_ref());
        let kid = hex::encode(&thumb.as_ref()[..8]);
        let key = EncodingKey::from_ec_der(pkcs8);
        let mut jwk = Jwk::from_encoding_key(&key, Algorithm::ES256)
            .map_err(|e| ApiError::Internal(format!("issuer JWK: {e}")))?;
        jwk.common.key_id = Some(kid.clone());
        jwk.common.public_key_use = Some(PublicKeyUse::Signature);
        Ok(Self { key, kid, jwk, iss: iss.into(), aud: aud.into() })
    }

    /// A token for `user` in `org`, valid for `ttl_s` seconds from `now_s`.
    pub fn issue(&self, user: &str, org: &str, scope: &str, now_s: u64, ttl_s: u64) -> Result<String, ApiError> {
        let claims = Claims {
            sub: user.into(),
            org: org.into(),
            iss: self.iss.clone(),
            aud: self.aud.clone(),
            exp: now_s.saturating_add(ttl_s),
            iat: now_s,
            scope: scope.into(),
        };
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, &claims, &self.key).map_err(|e| ApiError::Internal(format!("signing token: {e}")))
    }

    pub fn jwks(&self) -> JwkSet {
        JwkSet { keys: vec![self.jwk.clone()] }
    }

    /// A verifier trusting exactly this issuer's key.
    pub fn verifier(&self) -> Verifier {
        Verifier::from_keys(self.jwks(), &self.iss, &self.aud)
    }
}

struct Keys {
    set: JwkSet,
    fetched: Option<std::time::Instant>,
}

/// Verifies bearer tokens against a JWKS. Cloning shares the key cache.
#[derive(Clone)]
pub struct Verifier {
    keys: Arc<RwLock<Keys>>,
    jwks_url: Option<String>,
    http: Option<reqwest::Client>,
    validation: Arc<Validation>,
}

impl Verifier {
    pub fn from_keys(set: JwkSet, iss: &str, aud: &str) -> Self {
        Self {
            keys: Arc::new(RwLock::new(Keys { set, fetched: None })),
            jwks_url: None,
            http: None,
            validation: Arc::new(validation(iss, aud)),
        }
    }

    /// Fetches the JWKS at `url` now (so a misconfigured URL fails at start) and again when a token names an
    /// unknown key.
    pub async fn fetch(url: &str, iss: &str, aud: &str) -> Result<Self, ApiError> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| ApiError::Internal(format!("http client: {e}")))?;
        let set = fetch_jwks(&http, url).await?;
        Ok(Self {
            keys: Arc::new(RwLock::new(Keys { set, fetched: Some(std::time::Instant::now()) })),
            jwks_url: Some(url.into()),
            http: Some(http),
            validation: Arc::new(validation(iss, aud)),
        })
    }

    /// The caller named by an `Authorization` header value, or `Unauthenticated`.
    pub async fn verify_header(&self, authorization: Option<&str>) -> Result<Caller, ApiError> {
        let value = authorization.ok_or_else(|| ApiError::Unauthenticated("missing bearer token".into()))?;
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .ok_or_else(|| ApiError::Unauthenticated("authorization is not a bearer token".into()))?;
        self.verify(token.trim()).await
    }

    pub async fn verify(&self, token: &str) -> Result<Caller, ApiError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(ApiError::Unauthenticated("token too large".into()));
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| unauth())?;
        if header.alg != Algorithm::ES256 {
            return Err(unauth());
        }
        let kid = header.kid.ok_or_else(unauth)?;
        let key = match self.key(&kid)? {
            Some(k) => k,
            None => {
                self.refresh().await?;
                self.key(&kid)?.ok_or_else(unauth)?
            }
        };
        let data = jsonwebtoken::decode::<Claims>(token, &key, &self.validation).map_err(|_| unauth())?;
        let claims = data.claims;
        if loams_platform::limits::org(&claims.org).is_err() || claims.sub.is_empty() {
            return Err(unauth());
        }
        Ok(Caller {
            user: claims.sub,
            org: claims.org,
            scopes: claims.scope.split_whitespace().map(str::to_owned).collect(),
        })
    }

    fn key(&self, kid: &str) -> Result<Option<DecodingKey>, ApiError> {
        let keys = self.keys.read().map_err(|_| ApiError::Internal("key cache poisoned".into()))?;
        match keys.set.find(kid) {
            Some(jwk) => DecodingKey::from_jwk(jwk).map(Some).map_err(|_| unauth()),
            None => Ok(None),
        }
    }

    async fn refresh(&self) -> Result<(), ApiError> {
        let (Some(url), Some(http)) = (&self.jwks_url, &self.http) else { return Ok(()) };
        {
            let keys = self.keys.read().map_err(|_| ApiError::Internal("key cache poisoned".into()))?;
            if keys.fetched.is_some_and(|t| t.elapsed() < MIN_REFRESH) {
                return Ok(());
            }
        }
        let set = fetch_jwks(http, url).await?;
        let mut keys = self.keys.write().map_err(|_| ApiError::Internal("key cache poisoned".into()))?;
        *keys = Keys { set, fetched: Some(std::time::Instant::now()) };
        Ok(())
    }
}

fn unauth() -> ApiError {
    // One message for every failure: telling a caller which check failed helps only an attacker.
    ApiError::Unauthenticated("invalid token".into())
}

fn validation(iss: &str, aud: &str) -> Validation {
    let mut v = Validation::new(Algorithm::ES256);
    v.algorithms = vec![Algorithm::ES256];
    v.set_issuer(&[iss]);
    v.set_audience(&[aud]);
    v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
    v.leeway = LEEWAY_S;
    v
}

async fn fetch_jwks(http: &reqwest::Client, url: &str) -> Result<JwkSet, ApiError> {
    let unavailable = |e: String| ApiError::Unavailable(format!("fetching JWKS from {url}: {e}"));
    let mut resp = http.get(url).send().await.map_err(|e| unavailable(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(unavailable(format!("status {}", resp.status())));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| unavailable(e.to_string()))? {
        if body.len() + chunk.len() > MAX_JWKS_BYTES {
            return Err(unavailable(format!("larger than {MAX_JWKS_BYTES} bytes")));
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| unavailable(format!("malformed JWKS: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> u64 {
        jsonwebtoken::get_current_timestamp()
    }

    #[tokio::test]
    async fn issued_token_verifies_and_names_the_caller() {
        let issuer = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let token = issuer.issue("alice", "acme", "runs:read approvals", now(), 600).unwrap();
        let caller = issuer.verifier().verify_header(Some(&format!("Bearer {token}"))).await.unwrap();
        assert_eq!(caller.user, "alice");
        assert_eq!(caller.org, "acme");
        assert_eq!(caller.scopes, vec!["runs:read", "approvals"]);
    }

    #[tokio::test]
    async fn rejects_expired_wrong_issuer_audience_key_and_org() {
        let issuer = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let v = issuer.verifier();
        let expired = issuer.issue("alice", "acme", "", now() - 3600, 60).unwrap();
        assert!(matches!(v.verify(&expired).await, Err(ApiError::Unauthenticated(_))));

        let other_iss = Issuer::generate("https://evil.test", "loams-api").unwrap();
        let t = other_iss.issue("alice", "acme", "", now(), 600).unwrap();
        assert!(other_iss.verifier().verify(&t).await.is_ok());
        // Right iss/aud but a key this verifier does not know.
        let stranger = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let t = stranger.issue("alice", "acme", "", now(), 600).unwrap();
        assert!(v.verify(&t).await.is_err());

        let wrong_aud = Issuer { aud: "other".into(), ..Issuer::generate("https://loams.test", "x").unwrap() };
        let t = wrong_aud.issue("alice", "acme", "", now(), 600).unwrap();
        let v2 = Verifier::from_keys(wrong_aud.jwks(), "https://loams.test", "loams-api");
        assert!(v2.verify(&t).await.is_err());
        let v3 = Verifier::from_keys(wrong_aud.jwks(), "https://other.test", "other");
        assert!(v3.verify(&t).await.is_err(), "issuer must match");

        let bad_org = issuer.issue("alice", "Not An Org", "", now(), 600).unwrap();
        assert!(v.verify(&bad_org).await.is_err());
        assert!(v.verify_header(None).await.is_err());
        assert!(v.verify_header(Some("Basic abc")).await.is_err());
        assert!(v.verify(&"a".repeat(MAX_TOKEN_BYTES + 1)).await.is_err());
    }

    #[tokio::test]
    async fn rejects_an_unsigned_or_hmac_token() {
        let issuer = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let good = issuer.issue("alice", "acme", "", now(), 600).unwrap();
        let mut parts: Vec<&str> = good.split('.').collect();
        // alg "none" with the same kid: must not be accepted whatever the payload.
        let none_header = base64_url(br#"{"alg":"none","typ":"JWT"}"#);
        parts[0] = &none_header;
        let forged = format!("{}.{}.", parts[0], parts[1]);
        assert!(issuer.verifier().verify(&forged).await.is_err());
        let hmac = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({"sub": "alice", "org": "acme"}),
            &EncodingKey::from_secret(b"secret").unwrap(),
        )
        .unwrap();
        assert!(issuer.verifier().verify(&hmac).await.is_err());
    }

    fn base64_url(b: &[u8]) -> String {
        use base64::Engine as _;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    }
}
