//! Bearer tokens: an ES256 JWT issuer for `loams dev` and a verifier over a JWKS (local keys or fetched from a URL).
//!
//! The verifier pins the algorithm to ES256 (the header's `alg` is never trusted), checks signature, `iss`, `aud` and
//! `exp`, and requires the `org` claim: every request is scoped to exactly the organisation its token names.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::jwk::{Jwk, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use crate::ApiError;

/// Longest bearer token accepted; anything larger is not one of ours.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// Largest JWKS document fetched.
pub const MAX_JWKS_BYTES: usize = 64 * 1024;
/// Clock skew tolerated on `exp` (and, for agent tokens, on `iat`).
pub(crate) const LEEWAY_S: u64 = 30;
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

/// The scopes a procedure requires; a token carries them space-separated in its `scope` claim.
pub mod scope {
    /// Read runs, their timelines, and watch them.
    pub const RUNS_READ: &str = "runs:read";
    /// Stop a run.
    pub const RUNS_KILL: &str = "runs:kill";
    /// Give a run the decisions only a person can: triage, and the verdict after an inconclusive observation.
    pub const RUNS_DECIDE: &str = "runs:decide";
    /// Read approvals.
    pub const APPROVALS_READ: &str = "approvals:read";
    /// Take a challenge and decide an approval.
    pub const APPROVALS_DECIDE: &str = "approvals:decide";
    /// Register and revoke one's own devices.
    pub const DEVICES_WRITE: &str = "devices:write";
    /// Every scope above, and the read scope of each app's panels (CollabService), named as the app agent's card
    /// names it (`plane:read`, ...), as a `scope` claim: what the `loams dev` issuer grants.
    pub const ALL: &str = "runs:read runs:kill runs:decide approvals:read approvals:decide devices:write \
                           zulip:read plane:read forgejo:read glitchtip:read analytics:read";
}

/// Who is calling: taken from a verified token only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub user: String,
    pub org: String,
    pub scopes: Vec<String>,
}

impl Caller {
    /// `PermissionDenied` unless the token grants `scope`. Checked before a procedure reads or writes anything.
    pub fn require(&self, scope: &str) -> Result<(), ApiError> {
        if self.scopes.iter().any(|s| s == scope) {
            Ok(())
        } else {
            Err(ApiError::PermissionDenied(format!(
                "the token lacks the scope {scope}"
            )))
        }
    }
}

/// The development issuer run by `loams dev`: one P-256 key generated at start, served as a JWKS.
#[derive(Clone)]
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
    pub fn from_pkcs8(
        pkcs8: &[u8],
        iss: impl Into<String>,
        aud: impl Into<String>,
    ) -> Result<Self, ApiError> {
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8)
            .map_err(|_| ApiError::Internal("the issuer key is not a P-256 PKCS#8 key".into()))?;
        let thumb =
            aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, pair.public_key().as_ref());
        let kid = hex::encode(&thumb.as_ref()[..8]);
        let key = EncodingKey::from_ec_der(pkcs8);
        let mut jwk = Jwk::from_encoding_key(&key, Algorithm::ES256)
            .map_err(|e| ApiError::Internal(format!("issuer JWK: {e}")))?;
        jwk.common.key_id = Some(kid.clone());
        jwk.common.public_key_use = Some(PublicKeyUse::Signature);
        Ok(Self {
            key,
            kid,
            jwk,
            iss: iss.into(),
            aud: aud.into(),
        })
    }

    /// A token for `user` in `org`, valid for `ttl_s` seconds from `now_s`.
    pub fn issue(
        &self,
        user: &str,
        org: &str,
        scope: &str,
        now_s: u64,
        ttl_s: u64,
    ) -> Result<String, ApiError> {
        self.issue_for(&self.aud, user, org, scope, now_s, ttl_s)
    }

    /// Like [`Issuer::issue`] but for another audience (an agent's URL instead of the API).
    pub fn issue_for(
        &self,
        aud: &str,
        user: &str,
        org: &str,
        scope: &str,
        now_s: u64,
        ttl_s: u64,
    ) -> Result<String, ApiError> {
        let claims = Claims {
            sub: user.into(),
            org: org.into(),
            iss: self.iss.clone(),
            aud: aud.into(),
            exp: now_s.saturating_add(ttl_s),
            iat: now_s,
            scope: scope.into(),
        };
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, &claims, &self.key)
            .map_err(|e| ApiError::Internal(format!("signing token: {e}")))
    }

    pub fn jwks(&self) -> JwkSet {
        JwkSet {
            keys: vec![self.jwk.clone()],
        }
    }

    /// A verifier trusting exactly this issuer's key.
    pub fn verifier(&self) -> Verifier {
        Verifier::from_keys(self.jwks(), &self.iss, &self.aud)
    }
}

struct Keys {
    set: JwkSet,
    /// When the last fetch started (successful or not).
    fetched: Option<std::time::Instant>,
}

/// Verifies bearer tokens against a JWKS. Cloning shares the key cache.
#[derive(Clone)]
pub struct Verifier {
    keys: Arc<RwLock<Keys>>,
    jwks_url: Option<String>,
    http: Option<reqwest::Client>,
    validation: Arc<Validation>,
    /// Least time between two fetches; tokens with made-up `kid`s must not turn into requests to the issuer.
    min_refresh: Duration,
    /// Held while fetching, so concurrent unknown-kid tokens wait for one fetch and then see its keys.
    fetching: Arc<tokio::sync::Mutex<()>>,
}

impl Verifier {
    pub fn from_keys(set: JwkSet, iss: &str, aud: &str) -> Self {
        Self {
            keys: Arc::new(RwLock::new(Keys { set, fetched: None })),
            jwks_url: None,
            http: None,
            validation: Arc::new(validation(iss, aud)),
            min_refresh: MIN_REFRESH,
            fetching: Arc::default(),
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
            keys: Arc::new(RwLock::new(Keys {
                set,
                fetched: Some(std::time::Instant::now()),
            })),
            jwks_url: Some(url.into()),
            http: Some(http),
            validation: Arc::new(validation(iss, aud)),
            min_refresh: MIN_REFRESH,
            fetching: Arc::default(),
        })
    }

    /// The caller named by an `Authorization` header value, or `Unauthenticated`.
    pub async fn verify_header(&self, authorization: Option<&str>) -> Result<Caller, ApiError> {
        let value = authorization
            .ok_or_else(|| ApiError::Unauthenticated("missing bearer token".into()))?;
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .ok_or_else(|| {
                ApiError::Unauthenticated("authorization is not a bearer token".into())
            })?;
        self.verify(token.trim()).await
    }

    /// The same keys and issuer, accepting tokens for `aud` only (an agent checks its own URL).
    pub fn for_audience(&self, aud: &str) -> Verifier {
        let mut validation = (*self.validation).clone();
        validation.set_audience(&[aud]);
        Self {
            validation: Arc::new(validation),
            ..self.clone()
        }
    }

    pub async fn verify(&self, token: &str) -> Result<Caller, ApiError> {
        let claims = self.verify_claims(token).await?;
        Ok(Caller {
            user: claims.sub,
            org: claims.org,
            scopes: claims.scope.split_whitespace().map(str::to_owned).collect(),
        })
    }

    /// The verified claims of `token`, for checks beyond [`Verifier::verify`] (a token's lifetime).
    pub async fn verify_claims(&self, token: &str) -> Result<Claims, ApiError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(ApiError::Unauthenticated("token too large".into()));
        }
        // jsonwebtoken reads the header's other members into `Value`s: serde_json's private keys are refused first
        // (see `loams_platform::has_serde_private_key`).
        let header_json = token
            .split('.')
            .next()
            .and_then(|h| URL_SAFE_NO_PAD.decode(h).ok())
            .ok_or_else(unauth)?;
        if loams_platform::has_serde_private_key(&header_json) {
            return Err(unauth());
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
        let data =
            jsonwebtoken::decode::<Claims>(token, &key, &self.validation).map_err(|_| unauth())?;
        let claims = data.claims;
        if loams_platform::limits::org(&claims.org).is_err() || claims.sub.is_empty() {
            return Err(unauth());
        }
        Ok(claims)
    }

    fn key(&self, kid: &str) -> Result<Option<DecodingKey>, ApiError> {
        let keys = self
            .keys
            .read()
            .map_err(|_| ApiError::Internal("key cache poisoned".into()))?;
        match keys.set.find(kid) {
            Some(jwk) => DecodingKey::from_jwk(jwk).map(Some).map_err(|_| unauth()),
            None => Ok(None),
        }
    }

    async fn refresh(&self) -> Result<(), ApiError> {
        let (Some(url), Some(http)) = (&self.jwks_url, &self.http) else {
            return Ok(());
        };
        let _fetching = self.fetching.lock().await;
        {
            // The time is taken before fetching: a failing issuer is not retried on every request either.
            let mut keys = self
                .keys
                .write()
                .map_err(|_| ApiError::Internal("key cache poisoned".into()))?;
            if keys.fetched.is_some_and(|t| t.elapsed() < self.min_refresh) {
                return Ok(());
            }
            keys.fetched = Some(std::time::Instant::now());
        }
        let set = fetch_jwks(http, url).await?;
        let mut keys = self
            .keys
            .write()
            .map_err(|_| ApiError::Internal("key cache poisoned".into()))?;
        keys.set = set;
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
    let mut resp = http
        .get(url)
        .send()
        .await
        .map_err(|e| unavailable(e.to_string()))?;
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
        let token = issuer
            .issue("alice", "acme", "runs:read  approvals:read", now(), 600)
            .unwrap();
        let caller = issuer
            .verifier()
            .verify_header(Some(&format!("Bearer {token}")))
            .await
            .unwrap();
        assert_eq!(caller.user, "alice");
        assert_eq!(caller.org, "acme");
        assert_eq!(caller.scopes, vec!["runs:read", "approvals:read"]);
    }

    #[tokio::test]
    async fn rejects_expired_wrong_issuer_audience_key_and_org() {
        let issuer = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let v = issuer.verifier();
        let expired = issuer.issue("alice", "acme", "", now() - 3600, 60).unwrap();
        assert!(matches!(
            v.verify(&expired).await,
            Err(ApiError::Unauthenticated(_))
        ));

        let other_iss = Issuer::generate("https://evil.test", "loams-api").unwrap();
        let t = other_iss.issue("alice", "acme", "", now(), 600).unwrap();
        assert!(other_iss.verifier().verify(&t).await.is_ok());
        // Right iss/aud but a key this verifier does not know.
        let stranger = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let t = stranger.issue("alice", "acme", "", now(), 600).unwrap();
        assert!(v.verify(&t).await.is_err());

        let wrong_aud = Issuer {
            aud: "other".into(),
            ..Issuer::generate("https://loams.test", "x").unwrap()
        };
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

    #[tokio::test]
    async fn refuses_a_header_with_serde_jsons_private_keys_even_when_signed() {
        // A header member under `$serde_json::private::RawValue` would be parsed again, unbounded when nested: the
        // token is refused although its signature holds.
        let issuer = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let good = issuer.issue("alice", "acme", "", now(), 600).unwrap();
        let payload = good.split('.').nth(1).unwrap();
        let header = format!(
            r#"{{"alg":"ES256","kid":"{}","x":{{"$serde_json::private::RawValue":"1"}}}}"#,
            issuer.kid
        );
        let message = format!("{}.{payload}", base64_url(header.as_bytes()));
        let signature =
            jsonwebtoken::crypto::sign(message.as_bytes(), &issuer.key, Algorithm::ES256).unwrap();
        let token = format!("{message}.{signature}");
        assert!(issuer.verifier().verify(&token).await.is_err());
        // The same header without the private key verifies: the signature is not what refuses it.
        let plain = format!(r#"{{"alg":"ES256","kid":"{}","x":1}}"#, issuer.kid);
        let message = format!("{}.{payload}", base64_url(plain.as_bytes()));
        let signature =
            jsonwebtoken::crypto::sign(message.as_bytes(), &issuer.key, Algorithm::ES256).unwrap();
        assert!(
            issuer
                .verifier()
                .verify(&format!("{message}.{signature}"))
                .await
                .is_ok()
        );
    }

    #[test]
    fn require_checks_the_token_scopes() {
        let caller = Caller {
            user: "a".into(),
            org: "acme".into(),
            scopes: vec![scope::RUNS_READ.into()],
        };
        assert!(caller.require(scope::RUNS_READ).is_ok());
        assert!(matches!(
            caller.require(scope::RUNS_KILL),
            Err(ApiError::PermissionDenied(_))
        ));
        // A prefix or a broader-sounding name is not the scope.
        let caller = Caller {
            scopes: vec!["runs".into(), "runs:read:x".into()],
            ..caller
        };
        assert!(caller.require(scope::RUNS_READ).is_err());
        let all: Vec<&str> = scope::ALL.split_whitespace().collect();
        for s in [
            scope::RUNS_READ,
            scope::RUNS_KILL,
            scope::RUNS_DECIDE,
            scope::APPROVALS_READ,
            scope::APPROVALS_DECIDE,
            scope::DEVICES_WRITE,
        ] {
            assert!(all.contains(&s), "{s} missing from ALL");
        }
    }

    /// Serves `keys` as a JWKS, counting requests.
    async fn jwks_server(
        keys: Arc<RwLock<JwkSet>>,
        hits: Arc<std::sync::atomic::AtomicUsize>,
    ) -> String {
        let app = axum::Router::new().route(
            "/jwks",
            axum::routing::get(move || async move {
                hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let set = keys.read().unwrap().clone();
                axum::Json(set)
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/jwks", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    #[tokio::test]
    async fn unknown_kids_refetch_the_jwks_at_most_once_per_interval() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let old = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let rotated = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let served = Arc::new(RwLock::new(old.jwks()));
        let hits = Arc::new(AtomicUsize::new(0));
        let url = jwks_server(served.clone(), hits.clone()).await;
        let mut v = Verifier::fetch(&url, "https://loams.test", "loams-api")
            .await
            .unwrap();
        assert_eq!(hits.load(Ordering::SeqCst), 1);

        // The issuer rotates; tokens of the new key arrive within the interval of the first fetch: none fetches.
        *served.write().unwrap() = rotated.jwks();
        let token = rotated.issue("alice", "acme", "", now(), 600).unwrap();
        let results = futures::future::join_all((0..8).map(|_| v.verify(&token))).await;
        assert!(results.iter().all(Result::is_err));
        assert_eq!(
            hits.load(Ordering::SeqCst),
            1,
            "unknown kids must not refetch within the interval"
        );

        // Once the interval is over, concurrent unknown-kid tokens cause one fetch, and all see its keys.
        // A second's interval, so the fetch and the checks below fit in it on a loaded machine.
        v.min_refresh = Duration::from_secs(1);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let results = futures::future::join_all((0..8).map(|_| v.verify(&token))).await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert_eq!(hits.load(Ordering::SeqCst), 2);
        // A made-up kid right after: no fetch.
        let stranger = Issuer::generate("https://loams.test", "loams-api").unwrap();
        let forged = stranger.issue("alice", "acme", "", now(), 600).unwrap();
        assert!(v.verify(&forged).await.is_err());
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    fn base64_url(b: &[u8]) -> String {
        URL_SAFE_NO_PAD.encode(b)
    }
}
