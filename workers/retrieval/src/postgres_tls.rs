//! TLS to PostgreSQL as libpq reads it from the connection string:
//! `sslmode` (`disable`, `prefer` — the default —, `require`, `verify-ca`,
//! `verify-full`) and `sslrootcert`, through rustls (no OpenSSL).
//!
//! tokio-postgres knows only `disable`, `prefer` and `require` and refuses
//! `sslrootcert`, so both are taken out of the string here and the rest is
//! left to its parser. As libpq: `prefer` and `require` encrypt without
//! checking the certificate (`require` with an `sslrootcert` checks the
//! chain, as `verify-ca`); `verify-ca` checks the chain against
//! `sslrootcert`; `verify-full` also checks that the certificate names the
//! host. Without `sslrootcert` the verify modes trust the system's roots
//! (libpq reads `~/.postgresql/root.crt`; `sslrootcert=system` is the same
//! here).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::store::StoreError;

/// The URL's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// What the connection string asks of TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
}

/// Splits `sslmode` and `sslrootcert` out of `url` (URL or `key=value`
/// form): the rest for tokio-postgres, and the TLS settings.
///
/// # Errors
///
/// [`StoreError::Invalid`] for an `sslmode` libpq does not know.
pub fn split(url: &str) -> Result<(String, TlsSettings), StoreError> {
    let mut mode = None;
    let mut root_cert = None;
    let mut take = |key: &str, value: &str| -> bool {
        match key {
            "sslmode" => mode = Some(value.to_owned()),
            "sslrootcert" => root_cert = Some(value.to_owned()),
            _ => return false,
        }
        true
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            Some((base, query)) => {
                let mut kept = url::form_urlencoded::Serializer::new(String::new());
                for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
                    if !take(&key, &value) {
                        kept.append_pair(&key, &value);
                    }
                }
                let kept = kept.finish();
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{kept}")
                }
            }
            None => url.to_owned(),
        }
    } else {
        // `key=value` pairs; values with spaces are quoted and are kept
        // whole (only the two keys here never need quotes).
        url.split_whitespace()
            .filter(|pair| {
                pair.split_once('=')
                    .is_none_or(|(key, value)| !take(key.trim(), value.trim_matches('\'')))
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mode = match mode.as_deref() {
        None | Some("prefer") => SslMode::Prefer,
        Some("disable") => SslMode::Disable,
        // `allow` tries without TLS first; tokio-postgres cannot, and
        // prefer is what it can do closest.
        Some("allow") => SslMode::Prefer,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some(other) => {
            return Err(StoreError::Invalid(format!(
                "sslmode {other:?}: one of disable, allow, prefer, require, verify-ca, verify-full"
            )));
        }
    };
    Ok((
        rest,
        TlsSettings {
            mode,
            root_cert: root_cert.filter(|r| r != "system").map(PathBuf::from),
        },
    ))
}

impl TlsSettings {
    /// tokio-postgres's mode for these settings.
    #[must_use]
    pub fn tokio_mode(&self) -> tokio_postgres::config::SslMode {
        match self.mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        }
    }

    /// The connector: rustls with the verification the mode asks for.
    ///
    /// # Errors
    ///
    /// [`StoreError::Invalid`] when `sslrootcert` cannot be read or holds
    /// no certificate.
    pub fn connector(&self) -> Result<MakeRustlsConnect, StoreError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Engine(format!("TLS: {e}")))?;
        let check_chain = match self.mode {
            SslMode::VerifyCa | SslMode::VerifyFull => true,
            SslMode::Require => self.root_cert.is_some(),
            SslMode::Disable | SslMode::Prefer => false,
        };
        let verifier: Arc<dyn ServerCertVerifier> = if check_chain {
            let roots = self.roots()?;
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| StoreError::Invalid(format!("sslrootcert: {e}")))?;
            if self.mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        } else {
            Arc::new(Unchecked(provider))
        };
        let config = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(MakeRustlsConnect::new(config))
    }

    /// `sslrootcert`'s certificates, or the system's without one.
    fn roots(&self) -> Result<RootCertStore, StoreError> {
        let mut roots = RootCertStore::empty();
        let Some(path) = &self.root_cert else {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            return Ok(roots);
        };
        let pem = std::fs::read(path)
            .map_err(|e| StoreError::Invalid(format!("sslrootcert {}: {e}", path.display())))?;
        let certificates: Vec<CertificateDer<'static>> =
            rustls::pki_types::pem::PemObject::pem_slice_iter(&pem)
                .collect::<Result<_, _>>()
                .map_err(|e| StoreError::Invalid(format!("sslrootcert {}: {e}", path.display())))?;
        let (added, _) = roots.add_parsable_certificates(certificates);
        if added == 0 {
            return Err(StoreError::Invalid(format!(
                "sslrootcert {}: no certificate in it",
                path.display()
            )));
        }
        Ok(roots)
    }
}

/// `verify-ca`: the chain is checked, the name is not.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require`: encrypted, the certificate taken as it comes
/// (libpq's meaning of those modes); the handshake's signatures are still
/// checked.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_sslrootcert_are_taken_out_of_both_forms() {
        let (rest, tls) = split(
            "postgres://u:p@db:5432/x?sslmode=verify-full&application_name=a&sslrootcert=/ca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p@db:5432/x?application_name=a");
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.root_cert, Some(PathBuf::from("/ca.pem")));
        let (rest, tls) = split("postgres://db/x?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://db/x");
        assert_eq!(tls.mode, SslMode::Require);
        let (rest, tls) = split("host=db user=u sslmode=verify-ca sslrootcert=/ca.pem").unwrap();
        assert_eq!(rest, "host=db user=u");
        assert_eq!(tls.mode, SslMode::VerifyCa);
        assert_eq!(split("postgres://db/x").unwrap().1.mode, SslMode::Prefer);
        assert_eq!(
            split("postgres://db/x?sslrootcert=system&sslmode=verify-full")
                .unwrap()
                .1
                .root_cert,
            None
        );
        let error = split("postgres://db/x?sslmode=sometimes").unwrap_err();
        assert!(error.to_string().contains("verify-full"), "{error}");
    }
}
