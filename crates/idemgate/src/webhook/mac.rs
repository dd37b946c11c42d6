//! The MACs the schemes sign with, and the constant-time comparison they are checked by.

use hmac::{KeyInit, Mac};
use sha1::Sha1;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::{Secrets, SignatureError};

/// HMAC-SHA256 of the concatenated `parts` under `key`.
pub(crate) fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    mac::<hmac::Hmac<Sha256>>(key, parts)
}

/// HMAC-SHA1 of the concatenated `parts` under `key` (Twilio's scheme).
pub(crate) fn hmac_sha1(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    mac::<hmac::Hmac<Sha1>>(key, parts)
}

fn mac<M: Mac + KeyInit>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    // HMAC takes keys of any length.
    let mut mac = <M as KeyInit>::new_from_slice(key).expect("HMAC accepts any key length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().to_vec()
}

/// `Ok` when the MAC `sign` makes under any of `secrets` equals any of `candidates`, each
/// comparison in constant time.
pub(crate) fn any_matches(
    secrets: &Secrets,
    candidates: &[Vec<u8>],
    sign: impl Fn(&[u8]) -> Vec<u8>,
) -> Result<(), SignatureError> {
    let matched = secrets.iter().any(|secret| {
        let expected = sign(secret.expose());
        candidates
            .iter()
            .any(|candidate| bool::from(expected.as_slice().ct_eq(candidate)))
    });
    if matched {
        Ok(())
    } else {
        Err(SignatureError::Mismatch)
    }
}
