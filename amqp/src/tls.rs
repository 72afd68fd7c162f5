//! TLS for `amqps://`: the broker's certificate checked against a CA file (or the platform's
//! roots), and optionally a client certificate (for the EXTERNAL login).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::ClientConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::error::{Error, Result};

/// Certificates and keys, as PEM files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// CA certificates to trust; the platform's roots when `None`.
    pub ca_file: Option<PathBuf>,
    /// The client's certificate chain.
    pub cert_file: Option<PathBuf>,
    /// The client's private key.
    pub key_file: Option<PathBuf>,
    /// The name to check the broker's certificate against, when not the URI's host.
    pub server_name: Option<String>,
}

/// Builds a rustls configuration from `options`; a file that cannot be read or parsed is an
/// error naming it.
pub fn client_config(options: Option<&TlsOptions>) -> Result<ClientConfig> {
    let default = TlsOptions::default();
    let options = options.unwrap_or(&default);
    let mut roots = rustls::RootCertStore::empty();
    match &options.ca_file {
        Some(path) => {
            let certs = read_certs(path)?;
            if certs.is_empty() {
                return Err(Error::Tls(format!("{}: no certificate in the file", path.display())));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| Error::Tls(format!("{}: {e}", path.display())))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err(Error::Tls("no CA file given and no platform certificates found".into()));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?
        .with_root_certificates(roots);
    match (&options.cert_file, &options.key_file) {
        (Some(cert_file), Some(key_file)) => {
            let chain = read_certs(cert_file)?;
            if chain.is_empty() {
                return Err(Error::Tls(format!(
                    "{}: no certificate in the file",
                    cert_file.display()
                )));
            }
            let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| match e {
                rustls::pki_types::pem::Error::NoItemsFound => {
                    Error::Tls(format!("{}: no private key (PEM) in the file", key_file.display()))
                }
                e => Error::Tls(format!("{}: {e}", key_file.display())),
            })?;
            builder.with_client_auth_cert(chain, key).map_err(|e| match e {
                rustls::Error::InconsistentKeys(_) => Error::Tls(format!(
                    "{}: the key does not belong to the certificate in {}",
                    key_file.display(),
                    cert_file.display()
                )),
                e => Error::Tls(format!(
                    "{}: the client certificate cannot be used: {e}",
                    cert_file.display()
                )),
            })
        }
        (None, None) => Ok(builder.with_no_client_auth()),
        _ => Err(Error::Tls(
            "a client certificate needs both cert_file and key_file".into(),
        )),
    }
}

fn read_certs(path: &PathBuf) -> Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_file_iter(path)
        .map_err(|e| Error::Tls(format!("{}: {e}", path.display())))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Tls(format!("{}: {e}", path.display())))
}

/// Wraps `tcp` in TLS, checking the broker's certificate against `host` (or the configured
/// server name).
pub(crate) async fn connect(tcp: TcpStream, host: &str, options: Option<&TlsOptions>) -> Result<TlsStream<TcpStream>> {
    let config = client_config(options)?;
    let name = options
        .and_then(|o| o.server_name.clone())
        .unwrap_or_else(|| host.to_string());
    let server_name =
        ServerName::try_from(name.clone()).map_err(|e| Error::Tls(format!("server name {name:?}: {e}")))?;
    TlsConnector::from(Arc::new(config))
        .connect(server_name, tcp)
        .await
        .map_err(|e| match rustls_error(&e) {
            Some(refused) => Error::Tls(format!("handshake with {name}: {}", explain(refused, &name))),
            None => Error::Tls(format!("handshake with {name}: {e}")),
        })
}

/// A TLS alert that arrives after the handshake, while the AMQP handshake reads (TLS 1.3: the
/// broker checks the client's certificate after the client has finished), as a TLS error that
/// says what it means; any other error as it is.
pub(crate) fn explain_late_alert(error: Error) -> Error {
    match &error {
        Error::Io(io) => match rustls_error(io) {
            Some(refused @ rustls::Error::AlertReceived(_)) => Error::Tls(explain(refused, "the broker")),
            _ => error,
        },
        _ => error,
    }
}

/// The rustls error inside an I/O error from tokio-rustls, if any.
fn rustls_error(e: &std::io::Error) -> Option<&rustls::Error> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

/// What a refused handshake means for whoever configures the certificates.
fn explain(e: &rustls::Error, name: &str) -> String {
    use rustls::{AlertDescription as Alert, CertificateError as Cert};
    let why = match e {
        rustls::Error::InvalidCertificate(cert) => match cert {
            Cert::UnknownIssuer | Cert::BadSignature => {
                "the broker's certificate is not signed by a trusted CA (the CA file, or the platform's roots when none is given)".to_string()
            }
            Cert::NotValidForName | Cert::NotValidForNameContext { .. } => {
                format!("the broker's certificate is not valid for the name {name:?} (connect by a name it holds, or set the server name)")
            }
            Cert::Expired | Cert::ExpiredContext { .. } => "the broker's certificate has expired".to_string(),
            Cert::NotValidYet | Cert::NotValidYetContext { .. } => {
                "the broker's certificate is not valid yet (check the clocks)".to_string()
            }
            _ => "the broker's certificate was refused".to_string(),
        },
        rustls::Error::AlertReceived(
            Alert::BadCertificate
            | Alert::UnknownCA
            | Alert::CertificateRequired
            | Alert::CertificateUnknown
            | Alert::CertificateExpired
            | Alert::CertificateRevoked
            | Alert::UnsupportedCertificate
            | Alert::AccessDenied,
        ) => "the broker refused our client certificate (none was sent, or the broker does not trust its CA)".to_string(),
        _ => return e.to_string(),
    };
    format!("{why}: {e}")
}
