//! The TLS pieces both sides share: rustls with the ring provider only (no OpenSSL, no aws-lc),
//! PEM certificates and keys read with errors that name the file, and the client configuration
//! (trust one CA; optionally present a certificate for mutual TLS; ALPN h2 then http/1.1).
//!
//! The server builds its own `ServerConfig` from [`read_certs`], [`read_key`] and [`roots`]; the
//! client SDK and the admin CLI hand [`client_config`] to reqwest as a preconfigured TLS config.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::ring as ring_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};
use thiserror::Error;

/// ALPN protocols offered and accepted: HTTP/2 first.
pub fn alpn() -> Vec<Vec<u8>> {
    vec![b"h2".to_vec(), b"http/1.1".to_vec()]
}

/// The one crypto provider Hora uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(ring_provider::default_provider())
}

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{}: {message}", file.display())]
    File { file: PathBuf, message: String },
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

fn file_error(file: &Path, message: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        file: file.to_path_buf(),
        message: message.to_string(),
    }
}

/// A certificate chain and its private key (PEM files), presented for mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Every certificate in a PEM file (at least one).
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, format!("reading certificates: {e}")))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(path, format!("parsing certificates: {e}")))?;
    if certs.is_empty() {
        return Err(file_error(path, "holds no PEM certificate"));
    }
    Ok(certs)
}

/// The private key in a PEM file.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| file_error(path, format!("reading the private key: {e}")))
}

/// A root store holding the CA certificates in `ca`.
pub fn roots(ca: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(ca)? {
        roots
            .add(cert)
            .map_err(|e| file_error(ca, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// A client configuration trusting `ca` (and presenting `identity` for mutual TLS).
pub fn client_config(ca: &Path, identity: Option<&Identity>) -> Result<ClientConfig, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(ca)?);
    let mut config = match identity {
        Some(id) => builder.with_client_auth_cert(read_certs(&id.cert)?, read_key(&id.key)?)?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn();
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.pem");
        let err = client_config(&missing, None).unwrap_err().to_string();
        assert!(err.contains("nope.pem"), "{err}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = client_config(&empty, None).unwrap_err().to_string();
        assert!(
            err.contains("empty.pem") && err.contains("no PEM certificate"),
            "{err}"
        );
    }
}
