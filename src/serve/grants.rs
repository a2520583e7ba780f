//! What the operator grants each serve user beyond the server's defaults: the options after a
//! user's hash in the users file, one line per user:
//!
//! ```text
//! ana:$argon2id$v=19$... allow-path=/data/ana allow-url=s3://team-a/ max-queries=2 memory-budget=1GB
//! ben:$argon2id$v=19$... cloud-identity=server
//! ```
//!
//! - `allow-path=DIR`, `allow-url=PREFIX` (repeatable): places this user may read and write,
//!   besides those every user may (`--allow-path`, `--allow-url`).
//! - `max-queries=N`: queries the user runs at once (instead of `--max-queries-per-user`).
//! - `memory-budget=SIZE`: the memory budget of each of the user's queries (instead of the
//!   server's `flumen.memory_budget`); the user's memory is at most `max-queries` budgets.
//! - `cloud-identity=server`: object stores the user opens without credentials in their
//!   `OPTIONS` use the server's environment (`AWS_*`, instance metadata). Without it, a
//!   user's store has only the credentials the user gave; the static token's holders (the
//!   operator's token) always have it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};

use super::policy::AccessPolicy;
use crate::config::ByteSize;

/// The user name the static token's holders run as (the operator's token: always the
/// server's cloud identity).
pub const TOKEN_USER: &str = "token";

/// The options of one user's line in the users file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UserGrant {
    /// Directories the user may read and write, besides the server's.
    pub allow_paths: Vec<PathBuf>,
    /// URL prefixes the user may read and write, besides the server's.
    pub allow_urls: Vec<String>,
    /// Queries the user runs at once, when not the server's default.
    pub max_queries: Option<usize>,
    /// Each of the user's queries' memory budget, when not the server's.
    pub memory_budget: Option<ByteSize>,
    /// Whether stores the user opens without credentials use the server's environment.
    pub cloud_identity: bool,
}

impl UserGrant {
    /// Parse `key=value` words (the rest of a users-file line after the hash).
    pub fn parse<'a>(words: impl Iterator<Item = &'a str>) -> std::result::Result<Self, String> {
        let mut grant = Self::default();
        for word in words {
            let (key, value) = word
                .split_once('=')
                .filter(|(_, v)| !v.is_empty())
                .ok_or_else(|| format!("'{word}' is not KEY=VALUE"))?;
            match key {
                "allow-path" => grant.allow_paths.push(PathBuf::from(value)),
                "allow-url" => grant.allow_urls.push(value.to_string()),
                "max-queries" => {
                    let n: usize = value
                        .parse()
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| format!("max-queries={value}: not a count ≥ 1"))?;
                    grant.max_queries = Some(n);
                }
                "memory-budget" => {
                    let size: ByteSize = value
                        .parse()
                        .map_err(|_| format!("memory-budget={value}: not a size such as 1GB"))?;
                    grant.memory_budget = Some(size);
                }
                "cloud-identity" if value == "server" => grant.cloud_identity = true,
                "cloud-identity" => {
                    return Err(format!(
                        "cloud-identity={value}: the only value is 'server' (leave it out for \
                         the user's own credentials only)"
                    ));
                }
                other => {
                    return Err(format!(
                        "unknown option '{other}' (allow-path, allow-url, max-queries, \
                         memory-budget, cloud-identity)"
                    ));
                }
            }
        }
        Ok(grant)
    }
}

/// One user's access, resolved against the server's defaults.
#[derive(Debug, Clone)]
pub struct UserAccess {
    /// The files and URLs the user may touch.
    pub policy: Arc<AccessPolicy>,
    /// Queries the user runs at once.
    pub max_queries: usize,
    /// Each of the user's queries' memory budget (`None`: the server's).
    pub memory_budget: Option<ByteSize>,
    /// Whether the user's stores may use the server's cloud identity.
    pub cloud_identity: bool,
}

/// Every user's access: the server's defaults, and each user's grant on top.
#[derive(Debug, Clone)]
pub struct Grants {
    default: UserAccess,
    users: HashMap<String, UserAccess>,
}

impl Default for Grants {
    fn default() -> Self {
        Self::new(AccessPolicy::default(), super::MAX_QUERIES_PER_USER)
    }
}

impl Grants {
    /// Every user may touch what `policy` allows and run `max_queries` queries at once.
    pub fn new(policy: AccessPolicy, max_queries: usize) -> Self {
        Self {
            default: UserAccess {
                policy: Arc::new(policy),
                max_queries: max_queries.max(1),
                memory_budget: None,
                cloud_identity: false,
            },
            users: HashMap::new(),
        }
    }

    /// Add each user's grant (from the users file) on top of the defaults. A directory that
    /// does not exist or a URL that is not one fails, naming the user.
    pub fn with_users(mut self, grants: &HashMap<String, UserGrant>) -> Result<Self> {
        for (user, grant) in grants {
            let own = AccessPolicy::new(&grant.allow_paths, &grant.allow_urls).map_err(|e| {
                DataFusionError::Configuration(format!("users file, user {user}: {e}"))
            })?;
            self.users.insert(
                user.clone(),
                UserAccess {
                    policy: Arc::new(self.default.policy.widened(&own)),
                    max_queries: grant.max_queries.unwrap_or(self.default.max_queries),
                    memory_budget: grant.memory_budget,
                    cloud_identity: grant.cloud_identity,
                },
            );
        }
        Ok(self)
    }

    /// What `user` may do.
    pub fn of(&self, user: &str) -> UserAccess {
        if let Some(access) = self.users.get(user) {
            return access.clone();
        }
        UserAccess {
            // The static token is the operator's: its holders act with the server's identity.
            cloud_identity: user == TOKEN_USER,
            ..self.default.clone()
        }
    }

    /// The server's defaults, in words (for the startup log).
    pub fn describe(&self) -> String {
        let mut granted: Vec<&String> = self.users.keys().collect();
        granted.sort();
        format!(
            "{}; {} queries at once per user; own grants in the users file: {granted:?}",
            self.default.policy.describe(),
            self.default.max_queries
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_grant_widens_the_servers_and_bad_options_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let words = format!(
            "allow-path={} allow-url=s3://team-a/ max-queries=2 memory-budget=1GB",
            dir.path().display()
        );
        let grant = UserGrant::parse(words.split_whitespace()).unwrap();
        assert_eq!(grant.max_queries, Some(2));
        assert_eq!(grant.memory_budget, Some(ByteSize(1 << 30)));
        assert!(!grant.cloud_identity);
        let server = AccessPolicy::new(&[], &["s3://shared/".to_string()]).unwrap();
        let grants = Grants::new(server, 8)
            .with_users(&HashMap::from([("ana".to_string(), grant)]))
            .unwrap();
        let ana = grants.of("ana");
        assert_eq!(ana.max_queries, 2);
        let file = dir.path().join("t.csv").display().to_string();
        for allowed in [
            file.as_str(),
            "s3://team-a/t.parquet",
            "s3://shared/t.parquet",
        ] {
            ana.policy.check_location(allowed, "read").unwrap();
        }
        // Another user has the server's defaults only.
        let ben = grants.of("ben");
        assert_eq!(ben.max_queries, 8);
        assert!(ben.policy.check_location(&file, "read").is_err());
        assert!(
            (ben.policy)
                .check_location("s3://team-a/t.parquet", "read")
                .is_err()
        );
        assert!(!ben.cloud_identity && grants.of(TOKEN_USER).cloud_identity);
        for (bad, names) in [
            ("max-queries=0", "max-queries"),
            ("memory-budget=lots", "memory-budget"),
            ("cloud-identity=mine", "cloud-identity"),
            ("admin=yes", "unknown option 'admin'"),
            ("allow-path", "KEY=VALUE"),
        ] {
            let err = UserGrant::parse([bad].into_iter()).unwrap_err();
            assert!(err.contains(names), "{bad}: {err}");
        }
        let missing = UserGrant::parse(["allow-path=/no/such/dir"].into_iter()).unwrap();
        let err = Grants::default()
            .with_users(&HashMap::from([("cy".to_string(), missing)]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("user cy") && err.contains("/no/such/dir"),
            "{err}"
        );
    }
}
