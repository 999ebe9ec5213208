//! The device key. Phones implement [`DeviceSigner`] with a non-exportable key in the Secure Enclave or StrongBox
//! (both hold only P-256); [`SoftwareSigner`] is the fallback for devices without one, desktop and tests, with its
//! private key kept in a keyring-core credential store the platform chooses.

use std::sync::Arc;

use async_trait::async_trait;
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{
    ECDSA_P256_SHA256_ASN1, ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair,
    UnparsedPublicKey,
};
use keyring_core::{CredentialStore, Entry};

use crate::error::{Error, Result};

/// An uncompressed P-256 point: 0x04 || X || Y.
pub const P256_PUBLIC_KEY_LEN: usize = 65;
/// A DER ECDSA P-256 signature is at most 72 bytes; more is not one.
const MAX_SIGNATURE_LEN: usize = 72;
/// PKCS#8 documents of P-256 keys are ~140 bytes; a larger secret is not ours.
const MAX_PKCS8_LEN: usize = 1024;

/// Signs with this installation's device key. The core builds the bytes (the canonical decision bytes of
/// `loams-proto`); the platform only signs them, and may ask for Face ID or a BiometricPrompt first, which is why
/// the methods are async.
#[async_trait]
pub trait DeviceSigner: Send + Sync {
    /// The public key as an uncompressed P-256 point (65 bytes).
    async fn public_key(&self) -> Result<Vec<u8>>;
    /// ECDSA P-256 with SHA-256 over `message`, ASN.1 DER encoded.
    async fn sign(&self, message: Vec<u8>) -> Result<Vec<u8>>;
}

/// A P-256 key generated in software, its PKCS#8 kept in a credential store (the Apple protected keychain, the
/// Android keystore-backed store, or keyring-core's mock store in tests).
pub struct SoftwareSigner {
    key: EcdsaKeyPair,
}

impl std::fmt::Debug for SoftwareSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the private key.
        f.debug_struct("SoftwareSigner")
            .field("public_key", &hex::encode(self.key.public_key()))
            .finish()
    }
}

fn keyring(e: keyring_core::Error) -> Error {
    Error::Signer(format!("credential store: {e}"))
}

impl SoftwareSigner {
    /// Loads the key stored under (`service`, `account`) in `store`, or generates one and stores it first.
    pub fn load_or_create(
        store: &Arc<CredentialStore>,
        service: &str,
        account: &str,
    ) -> Result<SoftwareSigner> {
        let entry = Entry::new_in_store(store, service, account).map_err(keyring)?;
        match entry.get_secret() {
            Ok(pkcs8) => {
                if pkcs8.len() > MAX_PKCS8_LEN {
                    return Err(Error::Signer(
                        "the stored device key is not a P-256 key".into(),
                    ));
                }
                let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &pkcs8)
                    .map_err(|_| {
                        Error::Signer("the stored device key is not a P-256 key".into())
                    })?;
                Ok(SoftwareSigner { key })
            }
            Err(keyring_core::Error::NoEntry) => {
                let pkcs8 = EcdsaKeyPair::generate_pkcs8(
                    &ECDSA_P256_SHA256_ASN1_SIGNING,
                    &SystemRandom::new(),
                )
                .map_err(|_| Error::Signer("cannot generate a P-256 key".into()))?;
                let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref())
                    .map_err(|_| Error::Signer("the generated key does not load".into()))?;
                // Stored before first use: a key the store did not take would be lost at the next start.
                entry.set_secret(pkcs8.as_ref()).map_err(keyring)?;
                Ok(SoftwareSigner { key })
            }
            Err(e) => Err(keyring(e)),
        }
    }

    /// Removes the key from the store (after the device was revoked, or on sign-out).
    pub fn delete(store: &Arc<CredentialStore>, service: &str, account: &str) -> Result<()> {
        let entry = Entry::new_in_store(store, service, account).map_err(keyring)?;
        match entry.delete_credential() {
            Ok(()) | Err(keyring_core::Error::NoEntry) => Ok(()),
            Err(e) => Err(keyring(e)),
        }
    }
}

#[async_trait]
impl DeviceSigner for SoftwareSigner {
    async fn public_key(&self) -> Result<Vec<u8>> {
        Ok(self.key.public_key().as_ref().to_vec())
    }

    async fn sign(&self, message: Vec<u8>) -> Result<Vec<u8>> {
        let sig = self
            .key
            .sign(&SystemRandom::new(), &message)
            .map_err(|_| Error::Signer("signing failed".into()))?;
        Ok(sig.as_ref().to_vec())
    }
}

/// Checks a platform signer's answer before it is sent: a broken Keystore integration (an X.509 SubjectPublicKeyInfo
/// instead of the raw point, a raw r||s signature instead of DER) then fails here, with a message that says what is
/// wrong, instead of as an opaque refusal from the server.
pub(crate) fn verify(public_key: &[u8], message: &[u8], signature: &[u8]) -> Result<()> {
    check_public_key(public_key)?;
    if signature.is_empty() || signature.len() > MAX_SIGNATURE_LEN {
        return Err(Error::Signer(format!(
            "the signer returned {} bytes, not a DER ECDSA P-256 signature",
            signature.len()
        )));
    }
    UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, public_key)
        .verify(message, signature)
        .map_err(|_| {
            Error::Signer("the signature does not verify with the device's public key".into())
        })
}

pub(crate) fn check_public_key(public_key: &[u8]) -> Result<()> {
    if public_key.len() != P256_PUBLIC_KEY_LEN || public_key[0] != 0x04 {
        return Err(Error::Signer(format!(
            "the public key must be an uncompressed P-256 point ({P256_PUBLIC_KEY_LEN} bytes, 0x04 || X || Y), got {} bytes",
            public_key.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> Arc<CredentialStore> {
        keyring_core::mock::Store::new().unwrap()
    }

    #[tokio::test]
    async fn the_key_is_created_once_and_reloaded_from_the_store() {
        let store = store();
        let a = SoftwareSigner::load_or_create(&store, "loams", "acme").unwrap();
        let b = SoftwareSigner::load_or_create(&store, "loams", "acme").unwrap();
        let pk = a.public_key().await.unwrap();
        assert_eq!(pk, b.public_key().await.unwrap());
        assert_eq!(pk.len(), P256_PUBLIC_KEY_LEN);
        let other = SoftwareSigner::load_or_create(&store, "loams", "other-org").unwrap();
        assert_ne!(pk, other.public_key().await.unwrap());

        let sig = b.sign(b"hello".to_vec()).await.unwrap();
        verify(&pk, b"hello", &sig).unwrap();
        assert!(verify(&pk, b"hellO", &sig).is_err());

        SoftwareSigner::delete(&store, "loams", "acme").unwrap();
        let c = SoftwareSigner::load_or_create(&store, "loams", "acme").unwrap();
        assert_ne!(pk, c.public_key().await.unwrap(), "a deleted key is gone");
    }

    #[test]
    fn a_corrupt_stored_key_is_an_error_not_a_new_key() {
        let store = store();
        Entry::new_in_store(&store, "loams", "acme")
            .unwrap()
            .set_secret(b"not a key")
            .unwrap();
        assert!(matches!(
            SoftwareSigner::load_or_create(&store, "loams", "acme"),
            Err(Error::Signer(_))
        ));
    }

    #[test]
    fn a_failing_store_is_reported() {
        let store = store();
        let entry = Entry::new_in_store(&store, "loams", "acme").unwrap();
        let mock: &keyring_core::mock::Cred = entry.as_any().downcast_ref().unwrap();
        mock.set_error(keyring_core::Error::NoStorageAccess(Box::new(
            std::io::Error::other("locked"),
        )));
        let err = SoftwareSigner::load_or_create(&store, "loams", "acme").unwrap_err();
        assert!(err.to_string().contains("credential store"), "{err}");
    }

    #[test]
    fn malformed_keys_and_signatures_are_refused() {
        assert!(check_public_key(&[4u8; 64]).is_err());
        assert!(check_public_key(&[3u8; 65]).is_err());
        assert!(verify(&[4u8; 65], b"m", &[0u8; 64]).is_err());
        assert!(verify(&[4u8; 65], b"m", &[]).is_err());
    }
}
