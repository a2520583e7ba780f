//! Encryption of the worker protocol: TLS (rustls, through tonic).
//!
//! A worker that listens on anything but loopback must have a TLS identity (`flumen worker
//! --tls-cert FILE --tls-key FILE`, the key readable by its owner only) and refuses to start
//! without one; the driver checks the worker's certificate against the CA it was given
//! ([`WorkerTrust`]). A driver's own workers on its host listen on loopback, where TLS is
//! optional (`flumen.worker_tls`): when it is on, the driver makes a private CA once, signs
//! one certificate for `localhost`, `127.0.0.1` and `::1` with it, forgets the CA's key, and
//! hands the certificate, its key and the CA to each worker on stdin together with the
//! secret ([`local_tls`]). It then trusts that CA alone, as do its workers when they fetch
//! task inputs from one another.

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::OnceLock;

use datafusion::error::{DataFusionError, Result};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::cluster::auth::read_owner_only;

/// A worker's certificate chain and private key, both PEM.
#[derive(Clone)]
pub struct TlsIdentity {
    cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.write_str("TlsIdentity(..)")
    }
}

impl TlsIdentity {
    /// An identity from PEM text: `cert_pem` holds one or more `CERTIFICATE` blocks (the
    /// worker's first), `key_pem` one `PRIVATE KEY` block (PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem(cert_pem: String, key_pem: String) -> Result<Self> {
        if !has_pem_block(&cert_pem, "CERTIFICATE") {
            return Err(tls_error("the certificate has no PEM CERTIFICATE block"));
        }
        if !has_pem_block(&key_pem, "PRIVATE KEY") {
            return Err(tls_error("the key has no PEM PRIVATE KEY block"));
        }
        Ok(Self { cert_pem, key_pem })
    }

    /// Read a certificate file and a key file; the key file must be readable by its owner
    /// only (mode 0600 or 0400), as ssh requires of private keys.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self> {
        let cert_pem = std::fs::read_to_string(cert).map_err(|e| {
            tls_error(&format!(
                "cannot read TLS certificate {}: {e}",
                cert.display()
            ))
        })?;
        let key_pem = read_owner_only(key, "TLS key")?;
        Self::from_pem(cert_pem, key_pem)
            .map_err(|e| tls_error(&format!("{} / {}: {e}", cert.display(), key.display())))
    }

    /// Read an identity as [`TlsIdentity::to_text`] wrote it: PEM blocks up to a blank line
    /// (how a driver passes one on a worker's stdin, after the secret).
    pub fn read_from(input: &mut impl BufRead) -> Result<Self> {
        let (mut cert_pem, mut key_pem) = (String::new(), String::new());
        let mut in_key = false;
        for line in read_pem_section(input, "TLS identity")?.lines() {
            if line.starts_with("-----BEGIN") {
                in_key = line.contains("PRIVATE KEY");
            }
            let part = if in_key { &mut key_pem } else { &mut cert_pem };
            part.push_str(line);
            part.push('\n');
        }
        Self::from_pem(cert_pem, key_pem)
    }

    /// The certificate, the key and a blank line: what [`TlsIdentity::read_from`] reads.
    pub fn to_text(&self) -> String {
        format!(
            "{}\n{}\n\n",
            self.cert_pem.trim_end(),
            self.key_pem.trim_end()
        )
    }

    /// Write the certificate to `cert` and the key to `key`, readable by its owner only
    /// (what [`TlsIdentity::from_files`] reads).
    pub fn write_files(&self, cert: &Path, key: &Path) -> Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::write(cert, &self.cert_pem)?;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(key)?;
        file.write_all(self.key_pem.as_bytes())?;
        Ok(())
    }

    /// The server side of TLS with this identity.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
    }
}

/// The CA a driver checks its workers' certificates against.
#[derive(Clone, Debug)]
pub struct WorkerTrust {
    ca_pem: String,
}

impl WorkerTrust {
    /// Trust the CA certificate(s) in `ca_pem`.
    pub fn from_pem(ca_pem: String) -> Result<Self> {
        if !has_pem_block(&ca_pem, "CERTIFICATE") {
            return Err(tls_error("the CA has no PEM CERTIFICATE block"));
        }
        Ok(Self { ca_pem })
    }

    /// Trust the CA certificate(s) in the PEM file at `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let ca_pem = std::fs::read_to_string(path)
            .map_err(|e| tls_error(&format!("cannot read TLS CA {}: {e}", path.display())))?;
        Self::from_pem(ca_pem).map_err(|e| tls_error(&format!("{}: {e}", path.display())))
    }

    /// Read a CA as [`WorkerTrust::to_text`] wrote it (PEM up to a blank line).
    pub fn read_from(input: &mut impl BufRead) -> Result<Self> {
        Self::from_pem(read_pem_section(input, "trusted CA")?)
    }

    /// The CA certificate(s) and a blank line: what [`WorkerTrust::read_from`] reads.
    pub fn to_text(&self) -> String {
        format!("{}\n\n", self.ca_pem.trim_end())
    }

    /// The trusted CA certificate(s), PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The client side of TLS: a worker's certificate must chain to this CA and name the
    /// host (or IP address) the driver dialled.
    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem))
    }
}

/// The TLS a driver uses with the workers it starts on its own host.
#[derive(Debug)]
pub struct LocalTls {
    /// What each worker serves: one certificate for the loopback names.
    pub identity: TlsIdentity,
    /// What the driver trusts: the private CA that signed it, and nothing else.
    pub trust: WorkerTrust,
}

/// This driver's [`LocalTls`], made on first use (a private CA whose key is forgotten once
/// it signed the workers' certificate).
pub fn local_tls() -> Result<&'static LocalTls> {
    static LOCAL: OnceLock<std::result::Result<LocalTls, String>> = OnceLock::new();
    LOCAL
        .get_or_init(|| make_local_tls().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| tls_error(e))
}

fn make_local_tls() -> Result<LocalTls> {
    let ca = ClusterCa::new("flumen driver CA")?;
    let names = ["localhost", "127.0.0.1", "::1"].map(String::from);
    Ok(LocalTls {
        identity: ca.issue(&names)?,
        trust: ca.trust(),
    })
}

/// A private CA that signs workers' certificates: a driver's own ([`local_tls`]), or a
/// test cluster's. Its key lives only as long as it does.
pub struct ClusterCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca_pem: String,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterCa(..)")
    }
}

impl ClusterCa {
    /// A fresh CA named `name`.
    pub fn new(name: &str) -> Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let key = KeyPair::generate().map_err(cert_error)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_error)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).map_err(cert_error)?;
        Ok(Self {
            ca_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// What clients trust: this CA alone.
    pub fn trust(&self) -> WorkerTrust {
        WorkerTrust {
            ca_pem: self.ca_pem.clone(),
        }
    }

    /// A worker identity valid for `names` (DNS names or IP addresses).
    pub fn issue(&self, names: &[String]) -> Result<TlsIdentity> {
        use rcgen::{CertificateParams, DnType, KeyPair};
        let key = KeyPair::generate().map_err(cert_error)?;
        let mut params = CertificateParams::new(names.to_vec()).map_err(cert_error)?;
        params
            .distinguished_name
            .push(DnType::CommonName, "flumen worker");
        let cert = params.signed_by(&key, &self.issuer).map_err(cert_error)?;
        TlsIdentity::from_pem(cert.pem(), key.serialize_pem())
    }
}

fn cert_error(e: rcgen::Error) -> DataFusionError {
    tls_error(&format!("cannot make a worker certificate: {e}"))
}

/// A tonic server builder serving TLS with `identity` when given (`who` names the server
/// in errors).
pub fn server_builder(
    identity: Option<&TlsIdentity>,
    who: &str,
) -> Result<tonic::transport::Server> {
    let builder = tonic::transport::Server::builder();
    let Some(identity) = identity else {
        return Ok(builder);
    };
    // This build links both of rustls's crypto providers (ring for us, aws-lc-rs for the
    // object-store clients), so the server side needs one named.
    let _ = rustls::crypto::ring::default_provider().install_default();
    builder
        .tls_config(identity.server_config())
        .map_err(|e| tls_error(&format!("{who} cannot use its TLS identity: {e}")))
}

/// Refuse to serve plaintext on `address` unless it is a loopback address.
pub fn require_tls_off_loopback(address: &SocketAddr, tls: Option<&TlsIdentity>) -> Result<()> {
    if tls.is_none() && !address.ip().is_loopback() {
        return Err(DataFusionError::Execution(format!(
            "a worker listening on {address} (not a loopback address) must use TLS: give \
             --tls-cert FILE and --tls-key FILE"
        )));
    }
    Ok(())
}

/// Lines of `input` up to a blank line or its end (`what` names it in errors).
fn read_pem_section(input: &mut impl BufRead, what: &str) -> Result<String> {
    let mut text = String::new();
    loop {
        let mut line = String::new();
        let read = input
            .read_line(&mut line)
            .map_err(|e| tls_error(&format!("cannot read the {what}: {e}")))?;
        if read == 0 || line.trim().is_empty() {
            return Ok(text);
        }
        text.push_str(&line);
    }
}

fn has_pem_block(text: &str, label: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with("-----BEGIN") && l.contains(label))
}

fn tls_error(message: &str) -> DataFusionError {
    DataFusionError::Execution(message.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_survives_the_stdin_round_trip() {
        let local = local_tls().unwrap();
        let text = format!(
            "{}{}more input after the blank lines\n",
            local.identity.to_text(),
            local.trust.to_text()
        );
        let mut input = std::io::Cursor::new(text.into_bytes());
        let read = TlsIdentity::read_from(&mut input).unwrap();
        assert_eq!(read.cert_pem.trim(), local.identity.cert_pem.trim());
        assert_eq!(read.key_pem.trim(), local.identity.key_pem.trim());
        let trust = WorkerTrust::read_from(&mut input).unwrap();
        assert_eq!(trust.ca_pem.trim(), local.trust.ca_pem.trim());
        // The readers stopped at their blank lines.
        let mut rest = String::new();
        input.read_line(&mut rest).unwrap();
        assert_eq!(rest, "more input after the blank lines\n");
        assert!(!format!("{read:?}").contains("KEY"));
    }

    #[test]
    fn text_without_pem_blocks_is_refused() {
        let err = TlsIdentity::from_pem("hello".into(), "world".into()).unwrap_err();
        assert!(err.to_string().contains("CERTIFICATE"), "{err}");
        let err = WorkerTrust::from_pem(String::new()).unwrap_err();
        assert!(err.to_string().contains("CA"), "{err}");
    }

    #[test]
    fn plaintext_is_refused_off_loopback() {
        let loopback: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        assert!(require_tls_off_loopback(&loopback, None).is_ok());
        let err = require_tls_off_loopback(&any, None).unwrap_err();
        assert!(err.to_string().contains("must use TLS"), "{err}");
        let identity = &local_tls().unwrap().identity;
        assert!(require_tls_off_loopback(&any, Some(identity)).is_ok());
    }
}
