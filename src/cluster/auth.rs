//! Who may talk to a worker: the driver's secret.
//!
//! A driver makes one random 256-bit [`Secret`] when it first starts workers and gives it to
//! each worker on its standard input (never in argv or the environment, which other local
//! users can read through `/proc`). A worker started by hand reads it from a file only its
//! owner can read (`--secret-file`).
//!
//! Every Flight call carries `authorization: Bearer <hex>`, either the secret or a session
//! token that the `handshake` call hands out in exchange for the secret; the server-side
//! interceptor ([`RequireSecret`]) compares it in constant time and answers anything else
//! with `Unauthenticated` before the call reaches the worker (and logs the refusal).

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use datafusion::error::{DataFusionError, Result};
use subtle::ConstantTimeEq;
use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

/// The metadata key that carries the credential.
pub const AUTH_HEADER: &str = "authorization";

/// A 256-bit shared secret (or a session token of the same size).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the bytes.
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A fresh random secret from the operating system's generator.
    pub fn random() -> Self {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).expect("the OS random generator works");
        Self(bytes)
    }

    /// The secret as 64 hex digits (what travels on stdin and in the header).
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parse 64 hex digits (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<Self> {
        let bytes = hex::decode(text.trim()).map_err(|_| bad_secret())?;
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| bad_secret())?;
        Ok(Self(bytes))
    }

    /// Read a secret from a file that only its owner can read (mode 0600 or 0400), as ssh
    /// does for private keys: a secret others can read is no secret.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_hex(&read_owner_only(path, "secret file")?)
    }

    /// Read a secret from the first line of standard input.
    pub fn from_stdin() -> Result<Self> {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map_err(|e| {
            DataFusionError::Execution(format!("cannot read the secret from stdin: {e}"))
        })?;
        Self::from_hex(&line)
    }

    /// Constant-time comparison with `other` (hex text from a caller).
    fn matches_hex(&self, other: &str) -> bool {
        match Self::from_hex(other) {
            Ok(other) => bool::from(self.0.ct_eq(&other.0)),
            Err(_) => false,
        }
    }

    /// The header value that presents this secret.
    fn bearer(&self) -> MetadataValue<tonic::metadata::Ascii> {
        format!("Bearer {}", self.to_hex())
            .parse()
            .expect("hex is valid metadata")
    }
}

/// The text of `path`, which must be readable by its owner only (no group or other bits),
/// else an error naming `what` and the chmod that fixes it.
pub fn read_owner_only(path: &Path, what: &str) -> Result<String> {
    use std::os::unix::fs::MetadataExt;
    let cannot = |e: std::io::Error| {
        DataFusionError::Execution(format!("cannot read {what} {}: {e}", path.display()))
    };
    let meta = std::fs::metadata(path).map_err(cannot)?;
    if meta.mode() & 0o077 != 0 {
        return Err(DataFusionError::Execution(format!(
            "{what} {} is readable by other users (mode {:o}): chmod 600 it",
            path.display(),
            meta.mode() & 0o777
        )));
    }
    std::fs::read_to_string(path).map_err(cannot)
}

fn bad_secret() -> DataFusionError {
    DataFusionError::Execution("a flumen secret is 64 hex digits (256 bits)".into())
}

/// This driver's secret, made on first use and the same for every worker it starts.
pub fn driver_secret() -> &'static Secret {
    static SECRET: OnceLock<Secret> = OnceLock::new();
    SECRET.get_or_init(Secret::random)
}

/// The worker's side: the secret and the session tokens its handshakes handed out.
#[derive(Debug, Clone)]
pub struct RequireSecret {
    secret: Arc<Secret>,
    tokens: Arc<Mutex<HashSet<[u8; 32]>>>,
}

impl RequireSecret {
    /// Require `secret` (or a token issued for it) on every call.
    pub fn new(secret: Secret) -> Self {
        Self {
            secret: Arc::new(secret),
            tokens: Arc::default(),
        }
    }

    /// Whether `presented` (hex) is the secret; constant time.
    pub fn is_secret(&self, presented: &[u8]) -> bool {
        std::str::from_utf8(presented).is_ok_and(|text| self.secret.matches_hex(text))
    }

    /// A new session token, valid on this worker until it exits.
    pub fn issue_token(&self) -> Secret {
        let token = Secret::random();
        self.tokens.lock().unwrap().insert(token.0);
        token
    }

    /// Whether `credential` (hex) is the secret or an issued token.
    fn accepts(&self, credential: &str) -> bool {
        if self.secret.matches_hex(credential) {
            return true;
        }
        let Ok(presented) = Secret::from_hex(credential) else {
            return false;
        };
        // Compare against every token without stopping at the first match.
        let tokens = self.tokens.lock().unwrap();
        tokens
            .iter()
            .fold(false, |found, t| found | bool::from(t.ct_eq(&presented.0)))
    }
}

impl tonic::service::Interceptor for RequireSecret {
    fn call(&mut self, request: Request<()>) -> std::result::Result<Request<()>, Status> {
        let credential = request
            .metadata()
            .get(AUTH_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match credential {
            Some(credential) if self.accepts(credential) => Ok(request),
            other => {
                let peer = request
                    .remote_addr()
                    .map_or_else(|| "an unknown peer".to_string(), |a| a.to_string());
                let why = if other.is_some() {
                    "a wrong credential"
                } else {
                    "no credential"
                };
                log::warn!("flumen worker refused a call from {peer}: {why}");
                Err(Status::unauthenticated(format!(
                    "flumen worker: {why}; calls must carry the driver's secret"
                )))
            }
        }
    }
}

/// The driver's side: adds the secret to every call.
#[derive(Debug, Clone)]
pub struct SendSecret {
    header: MetadataValue<tonic::metadata::Ascii>,
}

impl SendSecret {
    /// Present `secret` on every call.
    pub fn new(secret: &Secret) -> Self {
        Self {
            header: secret.bearer(),
        }
    }
}

impl tonic::service::Interceptor for SendSecret {
    fn call(&mut self, mut request: Request<()>) -> std::result::Result<Request<()>, Status> {
        request
            .metadata_mut()
            .insert(AUTH_HEADER, self.header.clone());
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    fn with_header(value: Option<&str>) -> Request<()> {
        let mut request = Request::new(());
        if let Some(value) = value {
            request
                .metadata_mut()
                .insert(AUTH_HEADER, value.parse().unwrap());
        }
        request
    }

    #[test]
    fn only_the_secret_or_an_issued_token_passes() {
        let secret = Secret::random();
        let mut guard = RequireSecret::new(secret.clone());
        assert!(guard.call(with_header(None)).is_err());
        assert!(guard.call(with_header(Some("Bearer 00"))).is_err());
        let other = Secret::random();
        let err = guard
            .call(with_header(Some(&format!("Bearer {}", other.to_hex()))))
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(
            guard
                .call(with_header(Some(&format!("Bearer {}", secret.to_hex()))))
                .is_ok()
        );
        let token = guard.issue_token();
        assert!(
            guard
                .call(with_header(Some(&format!("Bearer {}", token.to_hex()))))
                .is_ok()
        );
        // What the driver sends passes.
        let sent = SendSecret::new(&secret).call(Request::new(())).unwrap();
        assert!(guard.call(sent).is_ok());
    }

    #[test]
    fn secrets_round_trip_and_never_print() {
        let secret = Secret::random();
        assert_eq!(Secret::from_hex(&secret.to_hex()).unwrap(), secret);
        assert!(Secret::from_hex("abc").is_err());
        assert_eq!(format!("{secret:?}"), "Secret(..)");
        assert_ne!(Secret::random(), secret);
    }

    #[test]
    fn a_secret_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        let secret = Secret::random();
        std::fs::write(&path, secret.to_hex()).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Secret::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("readable by other users"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Secret::from_file(&path).unwrap(), secret);
    }
}
