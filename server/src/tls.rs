//! TLS: the rustls configurations (ring provider; TLS 1.3 and 1.2; HTTP/2 and HTTP/1.1 by ALPN)
//! and the development certificates.
//!
//! Development certificates are a local CA and a server certificate for `localhost`,
//! `127.0.0.1` and `::1` signed by it (rcgen). `serve` makes them when no certificate is given,
//! `hora-server certs` makes them explicitly, along with client certificates for mutual TLS.
//! Clients trust `ca.pem`. They are for one machine; real deployments bring their own.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
pub use hora_common::tls::client_config;
use hora_common::tls::{alpn, provider, read_certs, read_key, roots};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;

pub const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca-key.pem";
pub const SERVER_CERT: &str = "server.pem";
pub const SERVER_KEY: &str = "server-key.pem";

/// Paths of a certificate and its key (PEM).
pub use hora_common::tls::Identity as CertPaths;

/// Writes `contents` to `path`, readable by the server's user only, whole or not at all: a
/// temporary file beside it, synced, renamed over it, and the directory synced (a crash never
/// leaves a truncated key or credential).
pub(crate) fn write_private(path: &Path, contents: &str) -> Result<()> {
    use std::io::Write;
    let temporary = path.with_extension("tmp");
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts
        .open(&temporary)
        .with_context(|| format!("writing {}", temporary.display()))?;
    f.write_all(contents.as_bytes())?;
    f.sync_all()?;
    fs::rename(&temporary, path).with_context(|| format!("writing {}", path.display()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

fn load_ca(dir: &Path) -> Result<Issuer<'static, KeyPair>> {
    let key_pem = fs::read_to_string(dir.join(CA_KEY))
        .with_context(|| format!("reading {}", dir.join(CA_KEY).display()))?;
    let cert_pem = fs::read_to_string(dir.join(CA_CERT))?;
    let key = KeyPair::from_pem(&key_pem).context("parsing the CA key")?;
    Issuer::from_ca_cert_pem(&cert_pem, key).context("parsing the CA certificate")
}

/// Makes the development CA (if `dir` has none) and a server certificate for localhost and the
/// extra `hosts`. Returns the server certificate's paths.
pub fn make_dev_certs(dir: &Path, hosts: &[String]) -> Result<CertPaths> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    if !dir.join(CA_CERT).exists() || !dir.join(CA_KEY).exists() {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, "Hora development CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        write_private(&dir.join(CA_KEY), &key.serialize_pem())?;
        fs::write(dir.join(CA_CERT), cert.pem())?;
    }
    let issuer = load_ca(dir)?;
    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    names.extend(hosts.iter().cloned());
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.subject_alt_names = names
        .iter()
        .map(|n| match n.parse() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => Ok(SanType::DnsName(n.clone().try_into()?)),
        })
        .collect::<Result<_, rcgen::Error>>()?;
    params
        .distinguished_name
        .push(DnType::CommonName, "Hora development server");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    let paths = CertPaths {
        cert: dir.join(SERVER_CERT),
        key: dir.join(SERVER_KEY),
    };
    fs::write(&paths.cert, cert.pem())?;
    write_private(&paths.key, &key.serialize_pem())?;
    Ok(paths)
}

/// Makes a client certificate `NAME.pem` / `NAME-key.pem` signed by the development CA (for
/// mutual TLS).
pub fn make_client_cert(dir: &Path, name: &str) -> Result<CertPaths> {
    if !hora_common::wire::valid_id(name) {
        bail!("client certificate name `{name}` must be 1-64 of [A-Za-z0-9_.-]");
    }
    let issuer = load_ca(dir).context("make the development CA first (hora-server certs)")?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    let paths = CertPaths {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}-key.pem")),
    };
    fs::write(&paths.cert, cert.pem())?;
    write_private(&paths.key, &key.serialize_pem())?;
    Ok(paths)
}

/// The server's TLS configuration; with `client_ca`, clients must present a certificate it signed.
pub fn server_config(paths: &CertPaths, client_ca: Option<&Path>) -> Result<ServerConfig> {
    let certs = read_certs(&paths.cert)?;
    let key = read_key(&paths.key)?;
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        Some(ca) => builder.with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                .build()
                .context("building the client certificate verifier")?,
        ),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .context("the certificate and key do not match")?;
    config.alpn_protocols = alpn();
    Ok(config)
}

/// An HTTPS client (reqwest over our rustls configuration; no other TLS stack is linked).
pub fn https_client(ca: &Path, identity: Option<&CertPaths>) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .use_preconfigured_tls(client_config(ca, identity)?)
        .build()
        .context("building the HTTPS client")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_certs_build_server_and_client_configs() {
        let dir = tempfile::tempdir().unwrap();
        let paths = make_dev_certs(dir.path(), &["hora.test".into()]).unwrap();
        server_config(&paths, None).unwrap();
        let client = make_client_cert(dir.path(), "worker-1").unwrap();
        server_config(&paths, Some(&dir.path().join(CA_CERT))).unwrap();
        client_config(&dir.path().join(CA_CERT), Some(&client)).unwrap();
        // A second call reuses the CA.
        let ca_before = fs::read(dir.path().join(CA_CERT)).unwrap();
        make_dev_certs(dir.path(), &[]).unwrap();
        assert_eq!(fs::read(dir.path().join(CA_CERT)).unwrap(), ca_before);
        assert!(make_client_cert(dir.path(), "../evil").is_err());
    }
}
