//! The Agent Card: building it from an [`AgentSpec`], signing it (A2A §8.4: detached JWS, ES256,
//! over the RFC 8785 canonical form of the card without `signatures`) and verifying it.

use a2a::{
    AgentCapabilities, AgentCard, AgentCardSignature, AgentExtension, AgentInterface,
    AgentProvider, AgentSkill, HttpAuthSecurityScheme, SecurityScheme,
    TRANSPORT_PROTOCOL_HTTP_JSON, TRANSPORT_PROTOCOL_JSONRPC,
};
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{
    ECDSA_P256_SHA256_FIXED, ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair,
    UnparsedPublicKey,
};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::skills::{AgentSpec, AppLinks, Risk, agent_principal};

/// Where the card is served, relative to the agent's base URL (A2A §8.2).
pub const CARD_PATH: &str = "/.well-known/agent-card.json";

/// Modes every Loams agent accepts and produces: the skill call is a data part, errors are text.
pub(crate) const MODES: [&str; 2] = ["application/json", "text/plain"];

/// The card extension naming the agent's own principal and the scopes its skills need.
pub const PRINCIPAL_EXTENSION: &str = "https://loams.dev/a2a/ext/principal/v1";
/// The card extension naming the app the agent works on and how to link into it ([`AppLinks`]).
pub const APP_EXTENSION: &str = "https://loams.dev/a2a/ext/app/v1";

/// A card signature can be checked against a bounded number of signatures only; a card carrying
/// more is refused rather than making the verifier do unbounded work.
const MAX_SIGNATURES: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum CardError {
    #[error("the agent card is not signed")]
    Unsigned,
    #[error("no card signature uses a trusted key")]
    UntrustedKey,
    #[error("the agent card signature does not verify")]
    BadSignature,
    #[error("malformed agent card or signature: {0}")]
    Malformed(String),
    #[error("signing key error: {0}")]
    Key(String),
}

/// A public key in JWK form (RFC 7517), P-256 only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Jwk {
    pub kty: String,
    pub crv: String,
    pub x: String,
    pub y: String,
    pub kid: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alg: Option<String>,
    #[serde(default, rename = "use", skip_serializing_if = "Option::is_none")]
    pub use_: Option<String>,
}

/// A JWK set (RFC 7517 §5): the keys a client trusts to sign agent cards.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Jwks {
    pub keys: Vec<Jwk>,
}

impl Jwk {
    /// The uncompressed SEC1 point (0x04 || x || y) that aws-lc-rs verifies against.
    fn sec1_point(&self) -> Result<Vec<u8>, CardError> {
        if self.kty != "EC" || self.crv != "P-256" {
            return Err(CardError::Malformed(format!(
                "unsupported key {} {}",
                self.kty, self.crv
            )));
        }
        let x = B64
            .decode(&self.x)
            .map_err(|e| CardError::Malformed(format!("jwk x: {e}")))?;
        let y = B64
            .decode(&self.y)
            .map_err(|e| CardError::Malformed(format!("jwk y: {e}")))?;
        if x.len() != 32 || y.len() != 32 {
            return Err(CardError::Malformed(
                "jwk coordinates must be 32 bytes".into(),
            ));
        }
        let mut point = Vec::with_capacity(65);
        point.push(0x04);
        point.extend_from_slice(&x);
        point.extend_from_slice(&y);
        Ok(point)
    }
}

/// The ES256 key an agent signs its card with. The `kid` is the RFC 7638 thumbprint of the public
/// key, so it is stable for a key without anyone having to pick names.
pub struct CardSigner {
    key: EcdsaKeyPair,
    kid: String,
}

impl std::fmt::Debug for CardSigner {
    // The private key must never reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CardSigner")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

impl CardSigner {
    /// A fresh random key (tests, `loams dev`); production loads a persisted key with
    /// [`CardSigner::from_pkcs8`].
    pub fn generate() -> Result<Self, CardError> {
        let doc =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &SystemRandom::new())
                .map_err(|_| CardError::Key("key generation failed".into()))?;
        Self::from_pkcs8(doc.as_ref())
    }

    /// Loads a P-256 key from PKCS#8 DER.
    pub fn from_pkcs8(der: &[u8]) -> Result<Self, CardError> {
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, der)
            .map_err(|e| CardError::Key(format!("not a P-256 PKCS#8 key: {e}")))?;
        let (x, y) = coordinates(key.public_key().as_ref())?;
        // RFC 7638: SHA-256 over the required members in lexicographic order, no whitespace.
        let thumb_input = format!(r#"{{"crv":"P-256","kty":"EC","x":"{x}","y":"{y}"}}"#);
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, thumb_input.as_bytes());
        Ok(CardSigner {
            key,
            kid: B64.encode(digest.as_ref()),
        })
    }

    /// The private key as PKCS#8 v1 DER, to persist a generated key.
    pub fn to_pkcs8(&self) -> Result<Vec<u8>, CardError> {
        let doc = self
            .key
            .to_pkcs8v1()
            .map_err(|_| CardError::Key("key export failed".into()))?;
        Ok(doc.as_ref().to_vec())
    }

    pub fn kid(&self) -> &str {
        &self.kid
    }

    pub fn jwk(&self) -> Result<Jwk, CardError> {
        let (x, y) = coordinates(self.key.public_key().as_ref())?;
        Ok(Jwk {
            kty: "EC".into(),
            crv: "P-256".into(),
            x,
            y,
            kid: self.kid.clone(),
            alg: Some("ES256".into()),
            use_: Some("sig".into()),
        })
    }

    pub fn jwks(&self) -> Result<Jwks, CardError> {
        Ok(Jwks {
            keys: vec![self.jwk()?],
        })
    }

    /// Returns `card` with its `signatures` replaced by one signature from this key.
    pub fn sign(&self, card: &AgentCard) -> Result<AgentCard, CardError> {
        let header = json!({"alg": "ES256", "kid": self.kid, "typ": "JOSE"});
        let protected = B64.encode(header.to_string());
        let payload = B64.encode(canonical_payload(card)?);
        let signing_input = format!("{protected}.{payload}");
        let sig = self
            .key
            .sign(&SystemRandom::new(), signing_input.as_bytes())
            .map_err(|_| CardError::Key("signing failed".into()))?;
        let mut signed = card.clone();
        signed.signatures = Some(vec![AgentCardSignature {
            protected,
            signature: B64.encode(sig.as_ref()),
            header: None,
        }]);
        Ok(signed)
    }
}

/// Splits an uncompressed SEC1 P-256 point into base64url JWK coordinates.
fn coordinates(point: &[u8]) -> Result<(String, String), CardError> {
    match point {
        [0x04, rest @ ..] if rest.len() == 64 => {
            Ok((B64.encode(&rest[..32]), B64.encode(&rest[32..])))
        }
        _ => Err(CardError::Key("unexpected public key encoding".into())),
    }
}

/// The bytes a card signature covers: the card without `signatures`, every empty string, list,
/// map and null removed recursively (what a2a-sdk 1.3.0 does, so our cards verify there and
/// theirs here), then RFC 8785 canonical JSON.
pub fn canonical_payload(card: &AgentCard) -> Result<Vec<u8>, CardError> {
    let mut value = serde_json::to_value(card).map_err(|e| CardError::Malformed(e.to_string()))?;
    if let Value::Object(map) = &mut value {
        map.remove("signatures");
    }
    let cleaned = strip_empty(value).unwrap_or(Value::Object(Default::default()));
    serde_json_canonicalizer::to_vec(&cleaned).map_err(|e| CardError::Malformed(e.to_string()))
}

/// Post-order removal of empty values; `None` means "this value is empty, drop it".
fn strip_empty(value: Value) -> Option<Value> {
    match value {
        Value::Null => None,
        Value::String(s) if s.is_empty() => None,
        Value::Array(items) => {
            let kept: Vec<Value> = items.into_iter().filter_map(strip_empty).collect();
            (!kept.is_empty()).then_some(Value::Array(kept))
        }
        Value::Object(map) => {
            let kept: serde_json::Map<String, Value> = map
                .into_iter()
                .filter_map(|(k, v)| strip_empty(v).map(|v| (k, v)))
                .collect();
            (!kept.is_empty()).then_some(Value::Object(kept))
        }
        other => Some(other),
    }
}

#[derive(Deserialize)]
struct ProtectedHeader {
    alg: String,
    kid: Option<String>,
    typ: Option<String>,
}

/// Passes if at least one signature on `card` is a valid ES256 signature by a key in `jwks`
/// (A2A §8.4.3). Signatures by unknown keys are skipped, not errors: a card may be co-signed.
pub fn verify_card(card: &AgentCard, jwks: &Jwks) -> Result<(), CardError> {
    let signatures = match &card.signatures {
        Some(s) if !s.is_empty() => s,
        _ => return Err(CardError::Unsigned),
    };
    if signatures.len() > MAX_SIGNATURES {
        return Err(CardError::Malformed(format!(
            "more than {MAX_SIGNATURES} signatures"
        )));
    }
    let payload = B64.encode(canonical_payload(card)?);
    let mut saw_trusted_key = false;
    for sig in signatures {
        let header_bytes = B64
            .decode(&sig.protected)
            .map_err(|e| CardError::Malformed(format!("protected header: {e}")))?;
        let header: ProtectedHeader = serde_json::from_slice(&header_bytes)
            .map_err(|e| CardError::Malformed(format!("protected header: {e}")))?;
        if header.alg != "ES256" || header.typ.as_deref().is_some_and(|t| t != "JOSE") {
            continue;
        }
        let Some(kid) = header.kid else { continue };
        let Some(jwk) = jwks.keys.iter().find(|k| k.kid == kid) else {
            continue;
        };
        saw_trusted_key = true;
        let signature = B64
            .decode(&sig.signature)
            .map_err(|e| CardError::Malformed(format!("signature: {e}")))?;
        let signing_input = format!("{}.{payload}", sig.protected);
        let key = UnparsedPublicKey::new(&ECDSA_P256_SHA256_FIXED, jwk.sec1_point()?);
        if key.verify(signing_input.as_bytes(), &signature).is_ok() {
            return Ok(());
        }
    }
    Err(if saw_trusted_key {
        CardError::BadSignature
    } else {
        CardError::UntrustedKey
    })
}

/// The name of the bearer-token scheme on the card.
pub const BEARER_SCHEME: &str = "bearer";

/// The unsigned card for an agent served at `base_url`: JSON-RPC (preferred) and HTTP+JSON both at
/// that URL, streaming, push notifications and the extended card offered, every call behind a
/// bearer JWT. Each skill carries its risk tag and its security requirement (the scopes of
/// [`Risk::scopes`]); the card as a whole needs `<agent>:read`. The extension
/// [`PRINCIPAL_EXTENSION`] names the agent's own principal ([`agent_principal`]).
pub fn build_card(spec: &AgentSpec, base_url: &str) -> AgentCard {
    let modes: Vec<String> = MODES.iter().map(|m| (*m).to_string()).collect();
    let bearer = SecurityScheme::HttpAuth(HttpAuthSecurityScheme {
        scheme: "Bearer".into(),
        description: Some("a JWT whose audience is this agent's URL".into()),
        bearer_format: Some("JWT".into()),
    });
    AgentCard {
        name: spec.name.clone(),
        description: spec.description.clone(),
        version: spec.version.clone(),
        supported_interfaces: vec![
            AgentInterface::new(base_url, TRANSPORT_PROTOCOL_JSONRPC),
            AgentInterface::new(base_url, TRANSPORT_PROTOCOL_HTTP_JSON),
        ],
        capabilities: AgentCapabilities {
            streaming: Some(true),
            push_notifications: Some(true),
            extensions: Some(
                std::iter::once(principal_extension(spec))
                    .chain(spec.app.as_ref().map(app_extension))
                    .collect(),
            ),
            extended_agent_card: Some(true),
        },
        default_input_modes: modes.clone(),
        default_output_modes: modes,
        skills: spec
            .skills
            .iter()
            .map(|s| {
                let mut tags = vec![s.risk.tag().to_string()];
                tags.extend(
                    s.tags
                        .iter()
                        .filter(|t| t.as_str() != s.risk.tag())
                        .cloned(),
                );
                AgentSkill {
                    id: s.id.clone(),
                    name: s.name.clone(),
                    description: s.description.clone(),
                    tags,
                    examples: (!s.examples.is_empty()).then(|| s.examples.clone()),
                    input_modes: None,
                    output_modes: None,
                    security_requirements: Some(vec![
                        [(BEARER_SCHEME.to_string(), s.risk.scopes(&spec.name))].into(),
                    ]),
                }
            })
            .collect(),
        provider: Some(AgentProvider {
            organization: "Loams".into(),
            url: base_url.to_string(),
        }),
        documentation_url: None,
        icon_url: None,
        security_schemes: Some([(BEARER_SCHEME.to_string(), bearer)].into()),
        security_requirements: Some(vec![
            [(BEARER_SCHEME.to_string(), Risk::Read.scopes(&spec.name))].into(),
        ]),
        signatures: None,
    }
}

fn app_extension(app: &AppLinks) -> AgentExtension {
    let params = match serde_json::to_value(app) {
        Ok(Value::Object(fields)) => fields.into_iter().collect(),
        _ => Default::default(),
    };
    AgentExtension {
        uri: APP_EXTENSION.into(),
        description: Some("the app this agent works on, and links to its pages".into()),
        required: None,
        params: Some(params),
    }
}

/// The app a verified card names in its [`APP_EXTENSION`], if it names one well-formed.
pub fn app_links(card: &AgentCard) -> Option<AppLinks> {
    let extension = card
        .capabilities
        .extensions
        .as_ref()?
        .iter()
        .find(|e| e.uri == APP_EXTENSION)?;
    let params = extension.params.clone()?;
    serde_json::from_value(Value::Object(params.into_iter().collect())).ok()
}

fn principal_extension(spec: &AgentSpec) -> AgentExtension {
    let params = [
        ("principal".to_string(), json!(agent_principal(&spec.name))),
        (
            "scopes".to_string(),
            json!({
                format!("{}:read", spec.name): "call the agent and its read skills",
                format!("{}:write", spec.name): "skills that change the app",
                format!("{}:destructive", spec.name): "skills that need a settled approval",
            }),
        ),
    ];
    AgentExtension {
        uri: PRINCIPAL_EXTENSION.into(),
        description: Some("the principal this agent acts as, and the scopes of its skills".into()),
        // A plain proto3 bool: false must be absent so the canonical form matches ProtoJSON peers.
        required: None,
        params: Some(params.into_iter().collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::skills::{Risk, SkillSpec};

    fn spec() -> AgentSpec {
        AgentSpec {
            name: "test".into(),
            description: "a test agent".into(),
            version: "1.0.0".into(),
            app: None,
            skills: vec![SkillSpec {
                id: "count".into(),
                name: "Count".into(),
                description: "counts".into(),
                risk: Risk::Write,
                tags: vec!["counter".into()],
                examples: vec![],
            }],
        }
    }

    #[test]
    fn the_app_extension_round_trips_through_a_signed_card() {
        let signer = CardSigner::generate().unwrap();
        let jwks = signer.jwks().unwrap();
        assert_eq!(app_links(&build_card(&spec(), "http://127.0.0.1:1")), None);
        let app = AppLinks {
            web_url: "https://git.example".into(),
            deep_link_templates: [(
                "pull_request".to_string(),
                "https://git.example/o/r/pulls/{number}".to_string(),
            )]
            .into(),
        };
        let card = signer
            .sign(&build_card(
                &AgentSpec {
                    app: Some(app.clone()),
                    ..spec()
                },
                "http://127.0.0.1:1",
            ))
            .unwrap();
        // Over the wire and back, as a client reads it.
        let card: AgentCard = serde_json::from_str(&serde_json::to_string(&card).unwrap()).unwrap();
        verify_card(&card, &jwks).unwrap();
        assert_eq!(app_links(&card), Some(app));
        // The extension is covered by the signature like the rest of the card.
        let mut moved = card.clone();
        for e in moved.capabilities.extensions.iter_mut().flatten() {
            if let Some(p) = e.params.as_mut() {
                p.insert("web_url".into(), json!("https://evil.example"));
            }
        }
        assert!(matches!(
            verify_card(&moved, &jwks),
            Err(CardError::BadSignature)
        ));
    }

    #[test]
    fn sign_then_verify_and_tamper() {
        let signer = CardSigner::generate().unwrap();
        let jwks = signer.jwks().unwrap();
        let card = signer
            .sign(&build_card(&spec(), "http://127.0.0.1:1"))
            .unwrap();
        verify_card(&card, &jwks).unwrap();

        let mut tampered = card.clone();
        tampered.skills[0].tags = vec!["risk:read".into()];
        assert!(matches!(
            verify_card(&tampered, &jwks),
            Err(CardError::BadSignature)
        ));

        let other = CardSigner::generate().unwrap().jwks().unwrap();
        assert!(matches!(
            verify_card(&card, &other),
            Err(CardError::UntrustedKey)
        ));

        let mut unsigned = card;
        unsigned.signatures = None;
        assert!(matches!(
            verify_card(&unsigned, &jwks),
            Err(CardError::Unsigned)
        ));
    }

    #[test]
    fn signature_is_raw_r_s_and_header_is_jose() {
        let signer = CardSigner::generate().unwrap();
        let card = signer.sign(&build_card(&spec(), "http://x")).unwrap();
        let sig = &card.signatures.as_ref().unwrap()[0];
        assert_eq!(B64.decode(&sig.signature).unwrap().len(), 64);
        let header: Value = serde_json::from_slice(&B64.decode(&sig.protected).unwrap()).unwrap();
        assert_eq!(
            header,
            json!({"alg": "ES256", "kid": signer.kid(), "typ": "JOSE"})
        );
    }

    #[test]
    fn skills_carry_the_scopes_of_their_risk_and_the_card_names_the_principal() {
        let mut s = spec();
        s.skills[0].risk = Risk::Destructive;
        let card = build_card(&s, "http://x");
        let needs = card.skills[0].security_requirements.as_ref().unwrap();
        assert_eq!(
            needs[0][BEARER_SCHEME],
            vec!["test:write".to_string(), "test:destructive".to_string()]
        );
        let ext = &card.capabilities.extensions.as_ref().unwrap()[0];
        assert_eq!(ext.uri, PRINCIPAL_EXTENSION);
        assert_eq!(ext.params.as_ref().unwrap()["principal"], "agent:test");
    }

    #[test]
    fn pkcs8_round_trip_keeps_kid() {
        let signer = CardSigner::generate().unwrap();
        let again = CardSigner::from_pkcs8(&signer.to_pkcs8().unwrap()).unwrap();
        assert_eq!(signer.kid(), again.kid());
        assert_eq!(signer.jwk().unwrap(), again.jwk().unwrap());
    }

    #[test]
    fn canonical_payload_drops_empties_and_signatures_keeps_false() {
        let mut card = build_card(&spec(), "http://x");
        card.capabilities.extensions = None;
        card.description = String::new();
        card.icon_url = Some(String::new());
        let bytes = canonical_payload(&card).unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert!(!text.contains("description\":\"\""), "{text}");
        assert!(!text.contains("iconUrl"), "{text}");
        assert!(
            text.starts_with(
                r#"{"capabilities":{"extendedAgentCard":true,"pushNotifications":true,"streaming":true}"#
            ),
            "{text}"
        );
        let signed = CardSigner::generate().unwrap().sign(&card).unwrap();
        assert_eq!(canonical_payload(&signed).unwrap(), text.into_bytes());
    }

    /// A card signed outside this crate (Python `cryptography`, with a2a-sdk's empty-stripping and
    /// a sorted compact JSON writer) carrying empty `tenant`, `extensions`, `examples` and
    /// `documentationUrl` that the canonical form must drop.
    #[test]
    fn verifies_a_card_signed_by_an_independent_implementation() {
        let card: AgentCard =
            serde_json::from_str(include_str!("../tests/fixtures/foreign-card.json")).unwrap();
        let jwks: Jwks =
            serde_json::from_str(include_str!("../tests/fixtures/foreign-jwks.json")).unwrap();
        verify_card(&card, &jwks).unwrap();
        let mut changed = card;
        changed.version = "2.1.1".into();
        assert!(matches!(
            verify_card(&changed, &jwks),
            Err(CardError::BadSignature)
        ));
    }

    #[test]
    fn risk_tag_first_and_not_duplicated() {
        let mut s = spec();
        s.skills[0].tags.push("risk:write".into());
        let card = build_card(&s, "http://x");
        assert_eq!(
            card.skills[0].tags,
            vec!["risk:write".to_string(), "counter".to_string()]
        );
    }
}
