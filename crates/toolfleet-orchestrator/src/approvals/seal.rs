//! A parked record keeps no webhook URL (its path or query may hold a
//! token). A configured sink is kept by name only — it is the profile's,
//! resolved again from the configuration when the invocation resumes. A
//! chat job's own webhook is kept **sealed**: encrypted (AES-256-GCM) under
//! a key derived (HKDF-SHA256) from the secret that signs jobs' webhooks
//! (`TOOLFLEET_SINK_SECRET`, `--sink-secret-env`), which every orchestrator
//! that could deliver it holds; the record's tenant and invocation id are
//! the associated data, so a sealed URL opens in its own record only. On
//! resume it is opened and the route checked again, as at the start.
//!
//! Without that secret a job's webhook could not be delivered anyway (its
//! deliveries are dead-lettered `sink_secret_missing`): the record then
//! keeps no webhook at all, and the events after the park go to NATS only.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};

/// The HKDF salt: names the key's one use.
const SALT: &[u8] = b"toolfleet parked job webhook v1";

/// The AEAD key derived from `secret`.
fn key(secret: &[u8]) -> Option<LessSafeKey> {
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SALT).extract(secret);
    let okm = prk.expand(&[], &AES_256_GCM).ok()?;
    Some(LessSafeKey::new(UnboundKey::from(okm)))
}

/// What the sealed value is bound to.
fn aad(tenant: &str, invocation_id: &str) -> Vec<u8> {
    format!("{tenant}\n{invocation_id}").into_bytes()
}

/// `url` sealed under `secret` for `tenant`'s `invocation_id`: hex of the
/// nonce, the ciphertext and its tag. `None` when the system's random
/// source fails (the webhook is then not kept).
pub(crate) fn seal(secret: &[u8], tenant: &str, invocation_id: &str, url: &str) -> Option<String> {
    let key = key(secret)?;
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new().fill(&mut nonce).ok()?;
    let mut sealed = url.as_bytes().to_vec();
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(aad(tenant, invocation_id)),
        &mut sealed,
    )
    .ok()?;
    let mut out = nonce.to_vec();
    out.extend(sealed);
    Some(hex(&out))
}

/// The URL `sealed` holds, when it was sealed under `secret` for this very
/// record; `None` otherwise (another secret, another record, altered).
pub(crate) fn open(
    secret: &[u8],
    tenant: &str,
    invocation_id: &str,
    sealed: &str,
) -> Option<String> {
    let key = key(secret)?;
    let bytes = unhex(sealed)?;
    if bytes.len() < NONCE_LEN {
        return None;
    }
    let (nonce, rest) = bytes.split_at(NONCE_LEN);
    let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
    let mut rest = rest.to_vec();
    let plain = key
        .open_in_place(nonce, Aad::from(aad(tenant, invocation_id)), &mut rest)
        .ok()?;
    String::from_utf8(plain.to_vec()).ok()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "https://hooks.example.com/t/secret-token-123";

    #[test]
    fn a_sealed_url_opens_with_its_secret_in_its_own_record_only() {
        let sealed = seal(b"whsec-one", "acme", "inv_1", URL).unwrap();
        assert!(!sealed.contains("hooks.example.com"));
        assert!(!sealed.contains("secret-token"));
        assert_eq!(
            open(b"whsec-one", "acme", "inv_1", &sealed).as_deref(),
            Some(URL)
        );
        assert_eq!(open(b"whsec-two", "acme", "inv_1", &sealed), None);
        assert_eq!(open(b"whsec-one", "globex", "inv_1", &sealed), None);
        assert_eq!(open(b"whsec-one", "acme", "inv_2", &sealed), None);
        let mut altered = sealed.clone();
        altered.replace_range(30..32, if &sealed[30..32] == "00" { "01" } else { "00" });
        assert_eq!(open(b"whsec-one", "acme", "inv_1", &altered), None);
        assert_eq!(open(b"whsec-one", "acme", "inv_1", "zz"), None);
        // A fresh nonce each time.
        assert_ne!(sealed, seal(b"whsec-one", "acme", "inv_1", URL).unwrap());
    }
}
