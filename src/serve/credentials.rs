//! Who may use `flumen serve`: users with hashed passwords, a static token, and the session
//! tokens the handshake hands out.
//!
//! - A **user file** (`--users FILE`, owner-only) holds one `name:hash` line per user, the
//!   hash an Argon2id PHC string as `flumen serve --hash-password` prints it. A client
//!   authenticates with HTTP basic credentials on the Flight `Handshake` call and gets a
//!   session token back in the `authorization` response header (what ADBC's Flight SQL
//!   driver does with `username`/`password`).
//! - A **static token** (`--token-file FILE`, owner-only, 64 hex digits) is accepted as a
//!   bearer token on every call (ADBC's `authorization_header` option), and in exchange for a
//!   session token on the handshake. With neither option the server makes one on first
//!   start and keeps it in its state directory, as Jupyter does.
//!
//! Every token is compared in constant time; none is ever logged or printed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use argon2::Argon2;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use base64::Engine;
use datafusion::error::{DataFusionError, Result};
use subtle::ConstantTimeEq;

use super::grants::{TOKEN_USER, UserGrant};
use crate::cluster::auth::{Secret, read_owner_only};

/// The users of a server: name → Argon2 hash (PHC string), and what the operator granted
/// each (the options after the hash, [`UserGrant`]).
#[derive(Clone, Default)]
pub struct UserFile {
    hashes: HashMap<String, String>,
    grants: HashMap<String, UserGrant>,
}

impl std::fmt::Debug for UserFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<_> = self.hashes.keys().collect();
        names.sort();
        f.debug_struct("UserFile").field("users", &names).finish()
    }
}

impl UserFile {
    /// Read `name:hash [option ...]` lines (blank lines and `#` comments skipped) from a
    /// file only its owner can read.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::parse(&read_owner_only(path, "user file")?)
            .map_err(|e| DataFusionError::Execution(format!("user file {}: {e}", path.display())))
    }

    /// Parse the text of a user file.
    pub fn parse(text: &str) -> Result<Self> {
        let mut hashes = HashMap::new();
        let mut grants = HashMap::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |why: &str| DataFusionError::Execution(format!("line {}: {why}", number + 1));
            let (name, rest) = line
                .split_once(':')
                .ok_or_else(|| bad("expected NAME:HASH (flumen serve --hash-password)"))?;
            let mut words = rest.split_whitespace();
            let hash = words.next().unwrap_or_default();
            let grant = UserGrant::parse(words).map_err(|e| bad(&format!("user {name}: {e}")))?;
            if name.is_empty() {
                return Err(bad("empty user name"));
            }
            PasswordHash::new(hash).map_err(|_| {
                bad("the hash is not a PHC string (make one with flumen serve --hash-password)")
            })?;
            if hashes.insert(name.to_string(), hash.to_string()).is_some() {
                return Err(bad(&format!("user {name} appears twice")));
            }
            if grant != UserGrant::default() {
                grants.insert(name.to_string(), grant);
            }
        }
        Ok(Self { hashes, grants })
    }

    /// What the operator granted each user who has options in the file.
    pub fn grants(&self) -> &HashMap<String, UserGrant> {
        &self.grants
    }

    /// Whether `name` exists and `password` is theirs. Unknown users cost a hash too, so
    /// timing does not tell which names exist.
    pub fn verify(&self, name: &str, password: &str) -> bool {
        static DECOY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let decoy = DECOY.get_or_init(|| hash_password("flumen decoy").unwrap_or_default());
        let (hash, known) = match self.hashes.get(name) {
            Some(hash) => (hash.as_str(), true),
            None => (decoy.as_str(), false),
        };
        let Ok(parsed) = PasswordHash::new(hash) else {
            return false;
        };
        let matches = Argon2::default()
            .verify_password(password.as_bytes(), &parsed)
            .is_ok();
        matches && known
    }

    /// How many users the file names.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// Whether the file names no user.
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }
}

/// An Argon2id hash of `password` with a fresh random salt, as a PHC string.
pub fn hash_password(password: &str) -> Result<String> {
    let mut salt = [0u8; 16];
    getrandom::fill(&mut salt)
        .map_err(|e| DataFusionError::Execution(format!("no random salt: {e}")))?;
    let salt = SaltString::encode_b64(&salt)
        .map_err(|e| DataFusionError::Execution(format!("bad salt: {e}")))?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|hash| hash.to_string())
        .map_err(|e| DataFusionError::Execution(format!("cannot hash the password: {e}")))
}

/// What a caller proved on the handshake, or presents on a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// HTTP basic: a user name and password.
    Basic {
        /// The user name.
        user: String,
        /// The password as sent.
        password: String,
    },
    /// A bearer token (64 hex digits).
    Bearer(String),
}

impl Credential {
    /// Parse an `authorization` header value (`Basic base64(user:password)` or
    /// `Bearer TOKEN`).
    pub fn parse(header: &str) -> Option<Self> {
        if let Some(token) = header.strip_prefix("Bearer ") {
            return Some(Self::Bearer(token.trim().to_string()));
        }
        let encoded = header.strip_prefix("Basic ")?;
        // Padding optional: Go's Flight client sends none.
        let lenient = base64::engine::GeneralPurpose::new(
            &base64::alphabet::STANDARD,
            base64::engine::GeneralPurposeConfig::new()
                .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
        );
        let decoded = lenient.decode(encoded.trim()).ok()?;
        let text = String::from_utf8(decoded).ok()?;
        let (user, password) = text.split_once(':')?;
        Some(Self::Basic {
            user: user.to_string(),
            password: password.to_string(),
        })
    }
}

/// Who a session token or the static token belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller {
    /// The user name (`token` for the static token's holders).
    pub user: String,
    /// The session this caller's settings live in (the token's first 16 hex digits; never
    /// the whole token).
    pub session: String,
}

/// The server's side of authentication: users, the static token, issued session tokens.
#[derive(Debug, Clone)]
pub struct Authenticator {
    users: Option<Arc<UserFile>>,
    static_token: Option<Arc<Secret>>,
    issued: Arc<Mutex<Vec<IssuedToken>>>,
    idle_limit: std::time::Duration,
    max_sessions: usize,
    max_sessions_per_user: usize,
    token_lifetime: std::time::Duration,
}

/// A session token handed out by a handshake.
#[derive(Debug)]
struct IssuedToken {
    bytes: [u8; 32],
    caller: Caller,
    /// When its handshake issued it.
    issued: std::time::Instant,
    last_used: std::time::Instant,
}

/// A session token expires this long after its handshake, however much it is used: the
/// client logs in again (ADBC's Flight SQL driver does so on `Unauthenticated`).
pub const TOKEN_LIFETIME: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
/// A session token unused this long expires (its session's settings are forgotten).
pub const SESSION_IDLE_LIMIT: std::time::Duration = std::time::Duration::from_secs(12 * 3600);
/// Most live session tokens; a handshake beyond it expires the least recently used of the
/// user holding the most.
pub const MAX_SESSIONS: usize = 10_000;
/// Most live session tokens of one user; a handshake beyond it expires that user's least
/// recently used, never another user's.
pub const MAX_SESSIONS_PER_USER: usize = 256;

impl Authenticator {
    /// Accept the users of `users` and/or the static token; at least one must be given.
    pub fn new(users: Option<UserFile>, static_token: Option<Secret>) -> Result<Self> {
        if users.as_ref().is_none_or(UserFile::is_empty) && static_token.is_none() {
            return Err(DataFusionError::Execution(
                "flumen serve needs users (--users FILE) or a token (--token-file FILE): an \
                 unauthenticated call never runs anything"
                    .into(),
            ));
        }
        Ok(Self {
            users: users.map(Arc::new),
            static_token: static_token.map(Arc::new),
            issued: Arc::default(),
            idle_limit: SESSION_IDLE_LIMIT,
            max_sessions: MAX_SESSIONS,
            max_sessions_per_user: MAX_SESSIONS_PER_USER,
            token_lifetime: TOKEN_LIFETIME,
        })
    }

    /// Expire session tokens idle `idle_limit`, and keep at most `max_sessions` (≥ 1).
    pub fn with_session_limits(
        mut self,
        idle_limit: std::time::Duration,
        max_sessions: usize,
    ) -> Self {
        self.idle_limit = idle_limit;
        self.max_sessions = max_sessions.max(1);
        self
    }

    /// Expire session tokens `lifetime` after their handshake, used or not.
    pub fn with_token_lifetime(mut self, lifetime: std::time::Duration) -> Self {
        self.token_lifetime = lifetime;
        self
    }

    /// Whether issued token `t` is still good.
    fn live(&self, t: &IssuedToken) -> bool {
        t.last_used.elapsed() < self.idle_limit && t.issued.elapsed() < self.token_lifetime
    }

    /// Keep at most `max` (≥ 1) sessions of any one user.
    pub fn with_sessions_per_user(mut self, max: usize) -> Self {
        self.max_sessions_per_user = max.max(1);
        self
    }

    /// The handshake: check basic credentials or the static token and issue a new session
    /// token for them (its own session: its own settings). Tokens idle over
    /// [`SESSION_IDLE_LIMIT`], or the least recently used beyond [`MAX_SESSIONS`], expire;
    /// the sessions that ended are returned with the token.
    pub fn handshake(&self, credential: &Credential) -> Option<(Secret, Caller, Vec<Caller>)> {
        let user = match credential {
            Credential::Basic { user, password } => {
                let users = self.users.as_ref()?;
                users.verify(user, password).then(|| user.clone())?
            }
            Credential::Bearer(token) => self
                .is_static_token(token)
                .then(|| TOKEN_USER.to_string())?,
        };
        let token = Secret::random();
        let caller = Caller {
            user,
            session: token.to_hex()[..16].to_string(),
        };
        let bytes = hex_bytes(&token.to_hex())?;
        let mut issued = self.issued.lock().unwrap();
        let mut expired = vec![];
        issued.retain(|t| {
            let live = self.live(t);
            if !live {
                expired.push(t.caller.clone());
            }
            live
        });
        // Room for the new session: one of this user's own when it holds its most, else,
        // the server being full, one of the user holding the most (one user's handshakes
        // never expire another's sessions while it holds as many).
        let holds = |issued: &Vec<IssuedToken>, user: &str| {
            issued.iter().filter(|t| t.caller.user == user).count()
        };
        let evict = if holds(&issued, &caller.user) >= self.max_sessions_per_user {
            Some(caller.user.clone())
        } else if issued.len() >= self.max_sessions {
            let mut counts: HashMap<&str, usize> = HashMap::new();
            for t in issued.iter() {
                *counts.entry(t.caller.user.as_str()).or_default() += 1;
            }
            (counts.into_iter())
                .max_by_key(|(user, n)| (*n, *user == caller.user))
                .map(|(user, _)| user.to_string())
        } else {
            None
        };
        if let Some(user) = evict
            && let Some(oldest) = (issued.iter().enumerate())
                .filter(|(_, t)| t.caller.user == user)
                .min_by_key(|(_, t)| t.last_used)
                .map(|(i, _)| i)
        {
            expired.push(issued.swap_remove(oldest).caller);
        }
        let now = std::time::Instant::now();
        issued.push(IssuedToken {
            bytes,
            caller: caller.clone(),
            issued: now,
            last_used: now,
        });
        Some((token, caller, expired))
    }

    /// Who presents bearer `token` on a call: a session token from a handshake, or the
    /// static token (whose holders share one session).
    pub fn caller(&self, token: &str) -> Option<Caller> {
        if self.is_static_token(token) {
            return Some(Caller {
                user: TOKEN_USER.into(),
                session: TOKEN_USER.into(),
            });
        }
        let presented = hex_bytes(token)?;
        let mut issued = self.issued.lock().unwrap();
        // Compare with every token, without stopping at the first match.
        let mut found = None;
        let lifetime = self.token_lifetime;
        for t in issued.iter_mut() {
            let live = t.last_used.elapsed() < self.idle_limit && t.issued.elapsed() < lifetime;
            if bool::from(t.bytes.ct_eq(&presented)) && live {
                t.last_used = std::time::Instant::now();
                found = Some(t.caller.clone());
            }
        }
        found
    }

    fn is_static_token(&self, token: &str) -> bool {
        let (Some(expected), Some(presented)) = (&self.static_token, hex_bytes(token)) else {
            return false;
        };
        let expected = hex_bytes(&expected.to_hex()).unwrap_or_default();
        bool::from(expected.ct_eq(&presented))
    }
}

fn hex_bytes(text: &str) -> Option<[u8; 32]> {
    hex::decode(text.trim()).ok()?.try_into().ok()
}

/// The static token of a server started with neither users nor a token file: read from
/// `path` (owner-only), or made and written there (mode 0600) on first start.
pub fn default_token(path: &Path) -> Result<Secret> {
    if path.exists() {
        return Secret::from_file(path);
    }
    let token = Secret::random();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| DataFusionError::Execution(format!("cannot write {}: {e}", path.display())))?;
    writeln!(file, "{}", token.to_hex())?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_file_verifies_only_the_right_password() {
        let hash = hash_password("s3cret").unwrap();
        assert!(hash.starts_with("$argon2id$"), "{hash}");
        let users =
            UserFile::parse(&format!("# team\nana:{hash}\nbo:{hash}  max-queries=2\n\n")).unwrap();
        assert_eq!(users.len(), 2);
        assert!(users.verify("ana", "s3cret") && users.verify("bo", "s3cret"));
        assert_eq!(users.grants()["bo"].max_queries, Some(2));
        assert!(!users.grants().contains_key("ana"));
        assert!(!users.verify("ana", "wrong"));
        assert!(!users.verify("bob", "s3cret"));
        assert!(!format!("{users:?}").contains("argon2"));
    }

    #[test]
    fn a_bad_user_file_names_its_line() {
        let err = UserFile::parse("ana:plaintext").unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("PHC"), "{err}");
        let err = UserFile::parse("\nnocolon").unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
        let hash = hash_password("s3cret").unwrap();
        let err = UserFile::parse(&format!("ana:{hash} admin=yes"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 1") && err.contains("user ana"), "{err}");
    }

    #[test]
    fn basic_and_bearer_headers_parse() {
        let basic = base64::engine::general_purpose::STANDARD.encode("ana:pa:ss");
        let unpadded = base64::engine::general_purpose::STANDARD_NO_PAD.encode("ana:nope");
        assert!(matches!(
            Credential::parse(&format!("Basic {unpadded}")),
            Some(Credential::Basic { password, .. }) if password == "nope"
        ));
        assert_eq!(
            Credential::parse(&format!("Basic {basic}")),
            Some(Credential::Basic {
                user: "ana".into(),
                password: "pa:ss".into()
            })
        );
        assert_eq!(
            Credential::parse("Bearer abc"),
            Some(Credential::Bearer("abc".into()))
        );
        assert_eq!(Credential::parse("Digest x"), None);
    }

    #[test]
    fn handshakes_issue_tokens_with_their_own_sessions() {
        let hash = hash_password("pw").unwrap();
        let users = UserFile::parse(&format!("ana:{hash}")).unwrap();
        let token = Secret::random();
        let auth = Authenticator::new(Some(users), Some(token.clone())).unwrap();
        let basic = Credential::Basic {
            user: "ana".into(),
            password: "pw".into(),
        };
        let (first, caller, _) = auth.handshake(&basic).unwrap();
        let (second, _, _) = auth.handshake(&basic).unwrap();
        assert_eq!(caller.user, "ana");
        let a = auth.caller(&first.to_hex()).unwrap();
        let b = auth.caller(&second.to_hex()).unwrap();
        assert_ne!(a.session, b.session);
        assert!(auth.caller(&Secret::random().to_hex()).is_none());
        assert!(auth.caller("not hex").is_none());
        assert_eq!(auth.caller(&token.to_hex()).unwrap().user, TOKEN_USER);
        let wrong = Credential::Basic {
            user: "ana".into(),
            password: "nope".into(),
        };
        assert!(auth.handshake(&wrong).is_none());
        assert!(
            auth.handshake(&Credential::Bearer(token.to_hex()))
                .is_some()
        );
        assert!(Authenticator::new(None, None).is_err());
    }

    #[test]
    fn idle_and_surplus_session_tokens_expire() {
        let token = Secret::random();
        let bearer = Credential::Bearer(token.to_hex());
        let auth = Authenticator::new(None, Some(token))
            .unwrap()
            .with_session_limits(std::time::Duration::from_millis(200), 3);
        let (first, _, _) = auth.handshake(&bearer).unwrap();
        let (second, _, _) = auth.handshake(&bearer).unwrap();
        let (third, _, _) = auth.handshake(&bearer).unwrap();
        // Using the first keeps it; the fourth handshake expires the least recently used.
        assert!(auth.caller(&first.to_hex()).is_some());
        let (_, _, expired) = auth.handshake(&bearer).unwrap();
        assert_eq!(expired.len(), 1);
        assert!(auth.caller(&second.to_hex()).is_none());
        assert!(auth.caller(&first.to_hex()).is_some());
        assert!(auth.caller(&third.to_hex()).is_some());
        std::thread::sleep(std::time::Duration::from_millis(250));
        assert!(auth.caller(&first.to_hex()).is_none());
        let (_, _, expired) = auth.handshake(&bearer).unwrap();
        assert_eq!(expired.len(), 3);
    }

    #[test]
    fn one_users_handshakes_never_expire_anothers_sessions() {
        let hash = hash_password("pw").unwrap();
        let users = UserFile::parse(&format!("ana:{hash}\nbo:{hash}")).unwrap();
        let auth = Authenticator::new(Some(users), None)
            .unwrap()
            .with_session_limits(std::time::Duration::from_secs(60), 6)
            .with_sessions_per_user(4);
        let basic = |user: &str| Credential::Basic {
            user: user.into(),
            password: "pw".into(),
        };
        let (ana, _, _) = auth.handshake(&basic("ana")).unwrap();
        let (ana2, _, _) = auth.handshake(&basic("ana")).unwrap();
        // Bo floods: past its four, each handshake expires one of its own.
        for _ in 0..10 {
            let (_, _, expired) = auth.handshake(&basic("bo")).unwrap();
            assert!(expired.iter().all(|c| c.user == "bo"), "{expired:?}");
        }
        assert!(auth.caller(&ana.to_hex()).is_some());
        assert!(auth.caller(&ana2.to_hex()).is_some());
        // The server full (6), a third of Ana's expires one of Bo's, who holds the most.
        let (_, _, expired) = auth.handshake(&basic("ana")).unwrap();
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].user, "bo");
        assert!(auth.caller(&ana.to_hex()).is_some());
    }

    #[test]
    fn a_session_token_expires_at_the_end_of_its_lifetime_however_used() {
        let token = Secret::random();
        let auth = Authenticator::new(None, Some(token.clone()))
            .unwrap()
            .with_token_lifetime(std::time::Duration::from_millis(150));
        let (session, _, _) = auth.handshake(&Credential::Bearer(token.to_hex())).unwrap();
        for _ in 0..2 {
            assert!(auth.caller(&session.to_hex()).is_some());
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(auth.caller(&session.to_hex()).is_none());
        // Renewal is a new handshake.
        let (renewed, _, _) = auth.handshake(&Credential::Bearer(token.to_hex())).unwrap();
        assert!(auth.caller(&renewed.to_hex()).is_some());
    }

    #[test]
    fn the_default_token_is_made_once_and_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/serve-token");
        let made = default_token(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(default_token(&path).unwrap(), made);
    }
}
