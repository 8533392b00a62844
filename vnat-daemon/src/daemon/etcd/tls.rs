//! etcd's TLS files, checked when vnatd starts, and why a member's TLS
//! refused us, asked of the member directly.
//!
//! Under TLS 1.3 a member checks the client certificate after the
//! client's last handshake message, so its refusal (an alert) reaches the
//! client while the first request is already on its way, and the gRPC
//! stack reports either the alert or only "connection closed", by a race.
//! A handshake of our own that sends nothing and reads once always sees
//! the alert (RFC 8446, section 4.4.2.4: the server aborts with
//! `bad_certificate` or `certificate_required`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio_rustls::rustls::{
    self,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName},
    AlertDescription, ClientConfig, RootCertStore,
};

use super::EtcdError;

/// The TLS settings vnatd gives etcd-client, as a rustls configuration of
/// the same files, for [`diagnose`].
pub(super) struct Files {
    config: Arc<ClientConfig>,
}

fn certs(
    what: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, EtcdError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .unwrap_or_default();
    if certs.is_empty() {
        return Err(EtcdError::NotPem {
            what,
            path: path.to_path_buf(),
            want: "PEM certificate",
        });
    }
    Ok(certs)
}

/// A file's path and what it holds.
pub(super) struct Pem<'a> {
    pub path: &'a Path,
    pub text: &'a [u8],
}

impl<'a> Pem<'a> {
    /// A path and the bytes read from it.
    pub fn of((path, text): &'a (&'a Path, Vec<u8>)) -> Pem<'a> {
        Pem { path, text }
    }
}

impl Files {
    /// Check the files' contents: certificates where certificates are
    /// named, a private key that belongs to the client certificate
    /// (`identity`: the certificate, then the key).
    pub(super) fn check(ca: Option<Pem>, identity: Option<(Pem, Pem)>) -> Result<Files, EtcdError> {
        let mut roots = RootCertStore::empty();
        if let Some(ca) = ca {
            for c in certs("the etcd CA", ca.path, ca.text)? {
                roots.add(c).map_err(|e| EtcdError::BadTlsFile {
                    what: "the etcd CA",
                    path: ca.path.to_path_buf(),
                    why: e.to_string(),
                })?;
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| EtcdError::TlsSetup(e.to_string()))?
            .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let (cpath, kpath) = (cert.path, key.path);
                let chain = certs("the etcd client certificate", cpath, cert.text)?;
                let key =
                    PrivateKeyDer::from_pem_slice(key.text).map_err(|_| EtcdError::NotPem {
                        what: "the etcd client key",
                        path: kpath.to_path_buf(),
                        want: "PEM private key",
                    })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| EtcdError::BadTlsFile {
                        what: "the etcd client key",
                        path: kpath.to_path_buf(),
                        why: format!("does not go with {}: {e}", cpath.display()),
                    })?
            }
        };
        Ok(Files {
            config: Arc::new(config),
        })
    }
}

/// The member at `endpoint` (`https://HOST:PORT`) refuses our client
/// certificate, or its own is not one our CA vouches for: handshake with
/// it, send nothing, and read once within `limit`. `None` when TLS is not
/// what failed.
pub(super) async fn diagnose(endpoint: &str, files: &Files, limit: Duration) -> Option<EtcdError> {
    let hostport = endpoint.strip_prefix("https://")?.trim_end_matches('/');
    let (host, port) = hostport.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port.parse().ok()?;
    let name = ServerName::try_from(host.to_string()).ok()?;
    let connector = tokio_rustls::TlsConnector::from(files.config.clone());
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        let mut tls = match connector.connect(name, tcp).await {
            Ok(t) => t,
            Err(e) => return verdict(&e),
        };
        let mut byte = [0u8; 1];
        match tls.read(&mut byte).await {
            Err(e) => verdict(&e),
            Ok(_) => None,
        }
    };
    tokio::time::timeout(limit, attempt).await.ok().flatten()
}

/// What rustls said, where it is about a certificate.
fn verdict(e: &std::io::Error) -> Option<EtcdError> {
    let r = e.get_ref()?.downcast_ref::<rustls::Error>()?;
    match r {
        rustls::Error::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::CertificateRequired
            | AlertDescription::UnknownCA
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked,
        ) => Some(EtcdError::ClientCert {
            detail: r.to_string(),
        }),
        rustls::Error::InvalidCertificate(_) => Some(EtcdError::ServerCert {
            detail: r.to_string(),
        }),
        _ => None,
    }
}
