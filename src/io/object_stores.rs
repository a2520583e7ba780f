//! Object stores for remote table locations, as datafusion-cli registers them: before a
//! statement runs, the store of each `s3://`, `gs://`, `az://` (`abfs://`, `abfss://`) or
//! `http(s)://` location it names (`CREATE EXTERNAL TABLE ... LOCATION`, `COPY ... TO`) is
//! registered with the session for that bucket or host. Credentials and settings come from the
//! environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`, as `object_store` reads them) and from the
//! statement's `OPTIONS ('aws.region' '...', 'aws.endpoint' '...', 'gcp.*', 'azure.*')`, which
//! win over the environment. A `flumen serve` user the operator did not grant the server's
//! identity gets no credential from the environment ([`CloudIdentity::OptionsOnly`]): its
//! stores have the credentials its statements give, or none.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::catalog::Session;
use datafusion::common::config::{ConfigEntry, ConfigExtension, ExtensionOptions};
use datafusion::datasource::listing::ListingTableUrl;
use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParser, Statement};
use datafusion::sql::sqlparser::ast::Value;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::{ObjectStore, RetryConfig};
use url::Url;

use super::table_locations::url_table_locations;

/// Options of one family of object stores as a statement gives them
/// (`OPTIONS ('aws.region' '...')`), accepted by the session's table options and kept as
/// written; `object_store` checks their names when the store is built.
macro_rules! store_options {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Default)]
        pub struct $name {
            values: BTreeMap<String, String>,
        }

        impl ConfigExtension for $name {
            const PREFIX: &'static str = $prefix;
        }

        impl ExtensionOptions for $name {
            fn as_any(&self) -> &dyn Any {
                self
            }
            fn as_any_mut(&mut self) -> &mut dyn Any {
                self
            }
            fn cloned(&self) -> Box<dyn ExtensionOptions> {
                Box::new(self.clone())
            }
            fn set(&mut self, key: &str, value: &str) -> Result<()> {
                let key = key.strip_prefix(concat!($prefix, ".")).unwrap_or(key);
                self.values.insert(key.to_ascii_lowercase(), value.to_string());
                Ok(())
            }
            fn entries(&self) -> Vec<ConfigEntry> {
                self.values
                    .iter()
                    .map(|(k, v)| ConfigEntry {
                        key: format!("{}.{k}", $prefix),
                        value: Some(v.clone()),
                        description: concat!("an option of ", $prefix, " object stores"),
                    })
                    .collect()
            }
        }
    };
}

store_options!(
    /// `aws.*` options for `s3://` locations (`access_key_id`, `secret_access_key`,
    /// `session_token`, `region`, `endpoint`, `allow_http`, `skip_signature`, ...).
    AwsOptions,
    "aws"
);
store_options!(
    /// `gcp.*` options for `gs://` locations (`service_account_path`, `service_account_key`,
    /// `application_credentials`, ...).
    GcpOptions,
    "gcp"
);
store_options!(
    /// `azure.*` options for `az://` and `abfs(s)://` locations (`account_name`,
    /// `access_key`, `client_id`, `client_secret`, `tenant_id`, `endpoint`, ...).
    AzureOptions,
    "azure"
);

/// Let a session's tables and COPY statements take `aws.*`, `gcp.*` and `azure.*` options.
pub fn register_table_options(ctx: &SessionContext) {
    let state = ctx.state_ref();
    let mut state = state.write();
    let extensions = &mut state.table_options_mut().extensions;
    extensions.insert(AwsOptions::default());
    extensions.insert(GcpOptions::default());
    extensions.insert(AzureOptions::default());
}

/// Whose cloud identity a store opened for a session has, where its `OPTIONS` give no
/// credentials: a session config extension (absent: [`CloudIdentity::Environment`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CloudIdentity {
    /// The process's environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`, the instance metadata
    /// service): an embedded session's or the REPL's, whose program is the operator.
    #[default]
    Environment,
    /// Only what the statement's `OPTIONS` give: a `flumen serve` user (named) whom the
    /// operator did not grant the server's identity. Options that would reach for the
    /// server's identity or files (metadata endpoints, token and key files, managed
    /// identities) are refused, and a store with no credentials at all is an error.
    OptionsOnly {
        /// The user, for errors.
        user: String,
    },
}

impl CloudIdentity {
    /// The identity of a session with `config`.
    pub fn of(config: &datafusion::prelude::SessionConfig) -> Self {
        config
            .get_extension::<Self>()
            .map(|identity| identity.as_ref().clone())
            .unwrap_or_default()
    }
}

/// Option words (in a key after its `aws.`/`gcp.`/`azure.` prefix) that make a store use the
/// machine's own identity or read the machine's files, refused under
/// [`CloudIdentity::OptionsOnly`].
const SERVER_IDENTITY_WORDS: &[&str] = &[
    "metadata",
    "imds",
    "container_credentials",
    "container_authorization",
    "web_identity",
    "token_file",
    "role_arn",
    "role_session",
    "sts_endpoint",
    "msi",
    "federated",
    "azure_cli",
    "object_id",
    "fabric",
    "application_credentials",
];

/// Whether `options` give a store for `scheme` credentials of its own (or say it needs none).
fn gives_credentials(scheme: &str, options: &[(String, String)]) -> bool {
    let has = |prefix: &str, words: &[&str]| {
        prefixed(options, prefix).any(|(key, value)| {
            // `skip_signature` counts when it is on.
            let on = !key.contains("skip_signature") || value.eq_ignore_ascii_case("true");
            on && words.iter().any(|w| key.contains(w))
        })
    };
    match scheme {
        "s3" | "s3a" => has("aws.", &["access_key_id", "skip_signature"]),
        "gs" | "gcs" => has("gcp.", &["service_account_key", "skip_signature"]),
        "az" | "azure" | "abfs" | "abfss" | "adl" => has(
            "azure.",
            &[
                "access_key",
                "account_key",
                "sas",
                "token",
                "client_secret",
                "use_emulator",
                "skip_signature",
            ],
        ),
        _ => true,
    }
}

/// Refuse, for a user with [`CloudIdentity::OptionsOnly`], options for `location` that reach
/// for the server's identity or files, and a store given no credentials.
fn check_users_options(location: &str, options: &[(String, String)], user: &str) -> Result<()> {
    let scheme = Url::parse(location)
        .map(|u| u.scheme().to_string())
        .unwrap_or_default();
    if matches!(scheme.as_str(), "http" | "https") {
        return Ok(());
    }
    for (key, _) in options {
        let name = key.split_once('.').map_or(key.as_str(), |(_, name)| name);
        let path_key = name.starts_with("service_account") && !name.contains("key")
            || name.starts_with("google_service_account") && !name.contains("key");
        if path_key || SERVER_IDENTITY_WORDS.iter().any(|w| name.contains(w)) {
            return Err(DataFusionError::Plan(format!(
                "option '{key}' for {location} would use the server's own cloud identity or \
                 files, which the operator has not granted user {user} (the users file's \
                 cloud-identity=server does)"
            )));
        }
    }
    if !gives_credentials(&scheme, options) {
        let example = match scheme.as_str() {
            "gs" | "gcs" => "('gcp.service_account_key' '...')",
            "s3" | "s3a" => "('aws.access_key_id' '...', 'aws.secret_access_key' '...')",
            _ => "('azure.account_name' '...', 'azure.access_key' '...')",
        };
        return Err(DataFusionError::Plan(format!(
            "no credentials for {location}: user {user} opens stores with its own credentials \
             only (the server's cloud identity is the operator's; the users file's \
             cloud-identity=server grants it): give OPTIONS {example}, or \
             '{}skip_signature' 'true' for a public bucket",
            match scheme.as_str() {
                "gs" | "gcs" => "gcp.",
                "s3" | "s3a" => "aws.",
                _ => "azure.",
            }
        )));
    }
    Ok(())
}

/// Register the object store of every remote location `sql` names. SQL that does not parse
/// registers nothing (running it reports the error).
pub fn register_for_statement(ctx: &SessionContext, sql: &str) -> Result<()> {
    let Ok(statements) = DFParser::parse_sql(sql) else {
        return Ok(());
    };
    for statement in statements {
        match statement {
            Statement::CreateExternalTable(create) => {
                let options = option_strings(&create.options);
                for location in &create.locations {
                    register_for_location(ctx, location, &options)?;
                }
            }
            Statement::CopyTo(copy) => {
                register_for_location(ctx, &copy.target, &option_strings(&copy.options))?;
                register_url_tables(ctx, &Statement::CopyTo(copy))?;
            }
            other => register_url_tables(ctx, &other)?,
        }
    }
    Ok(())
}

/// Register the store of every URL that `statement` reads as a table
/// (`SELECT * FROM 's3://bucket/t.parquet'`, with `SessionContext::enable_url_table`) or hands
/// to a function that reads it while it is planned (`read_parquet('s3://...')`).
fn register_url_tables(ctx: &SessionContext, statement: &Statement) -> Result<()> {
    for location in url_table_locations(ctx, statement) {
        // A store the session has (configured by an earlier statement's options) is kept.
        let registered = ListingTableUrl::parse(&location)
            .is_ok_and(|url| ctx.runtime_env().object_store(url.object_store()).is_ok());
        if location.contains("://") && !registered {
            register_for_location(ctx, &location, &[])?;
        }
    }
    Ok(())
}

fn option_strings(options: &[(String, Value)]) -> Vec<(String, String)> {
    options
        .iter()
        .map(|(k, v)| {
            let value = match v {
                Value::SingleQuotedString(s) | Value::DoubleQuotedString(s) => s.clone(),
                other => other.to_string(),
            };
            (k.to_ascii_lowercase(), value)
        })
        .collect()
}

/// Register the store for `location` (a URL; local paths register nothing), configured from
/// the environment and the `aws.`/`gcp.`/`azure.` entries of `options`.
pub fn register_for_location(
    ctx: &SessionContext,
    location: &str,
    options: &[(String, String)],
) -> Result<()> {
    register_in_session(&ctx.state(), location, options)
}

/// Whether a session with `identity` keeps the store it already has for `location` (its
/// own, or the operator's) rather than opening one: a user without the server's identity
/// who gives no credentials reads through the store that is there.
fn keeps_open_store(
    runtime: &datafusion::execution::runtime_env::RuntimeEnv,
    identity: &CloudIdentity,
    location: &str,
    options: &[(String, String)],
) -> bool {
    let Ok(url) = Url::parse(location) else {
        return false;
    };
    matches!(identity, CloudIdentity::OptionsOnly { .. })
        && !gives_credentials(url.scheme(), options)
        && ListingTableUrl::parse(location)
            .is_ok_and(|table| runtime.object_store(table.object_store()).is_ok())
}

/// Keep what a worker would need to read `location` (see [`StoreGrant`]) in the session's
/// [`StoreGrants`], when it has one.
fn record_grant(
    config: &datafusion::prelude::SessionConfig,
    location: &str,
    options: &[(String, String)],
) -> Result<()> {
    if let Some(grants) = config.get_extension::<StoreGrants>()
        && let Some(grant) = grant_for_location(location, options, &CloudIdentity::of(config))?
    {
        grants.0.lock().unwrap().insert(grant.url.clone(), grant);
    }
    Ok(())
}

/// What a worker needs to read one object store for a task: the store's URL (scheme and
/// bucket) and the options that configure it completely, credentials included, resolved
/// on the driver from its environment and the statement's options. It travels in the task
/// (over the cluster's TLS) to the workers that read that store, and only for the tasks
/// that do; a worker's own environment holds no credentials. Never printed with its values.
#[derive(Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoreGrant {
    /// `s3://bucket`.
    pub url: String,
    /// `(aws.<key>, value)` pairs.
    pub options: Vec<(String, String)>,
}

impl std::fmt::Debug for StoreGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&str> = self.options.iter().map(|(k, _)| k.as_str()).collect();
        write!(f, "StoreGrant({}, keys {keys:?})", self.url)
    }
}

/// The stores a session registered that its workers may be given (by URL).
#[derive(Debug, Default)]
pub struct StoreGrants(std::sync::Mutex<std::collections::HashMap<String, StoreGrant>>);

impl StoreGrants {
    /// The grant for the store at `url` (`s3://bucket`), if the session registered one.
    pub fn get(&self, url: &str) -> Option<StoreGrant> {
        let url = url.trim_end_matches('/');
        self.0.lock().unwrap().get(url).cloned()
    }
}

/// The settings of an S3 store that a worker needs to reach it as the driver does.
const GRANTED_S3_KEYS: &[AmazonS3ConfigKey] = &[
    AmazonS3ConfigKey::AccessKeyId,
    AmazonS3ConfigKey::SecretAccessKey,
    AmazonS3ConfigKey::Token,
    AmazonS3ConfigKey::Region,
    AmazonS3ConfigKey::Endpoint,
    AmazonS3ConfigKey::VirtualHostedStyleRequest,
    AmazonS3ConfigKey::SkipSignature,
    AmazonS3ConfigKey::Client(object_store::ClientConfigKey::AllowHttp),
];

/// The [`StoreGrant`] for a remote `location` configured from the environment and `options`;
/// `None` where workers are not given the store (not S3, or no credentials to pass on: a
/// worker would then ask the instance metadata service, so such scans stay on the driver).
pub fn grant_for_location(
    location: &str,
    options: &[(String, String)],
    identity: &CloudIdentity,
) -> Result<Option<StoreGrant>> {
    let Ok(url) = Url::parse(location) else {
        return Ok(None);
    };
    if !matches!(url.scheme(), "s3" | "s3a") {
        return Ok(None);
    }
    let builder = s3_builder(location, options, identity)?;
    let signed = builder
        .get_config_value(&AmazonS3ConfigKey::AccessKeyId)
        .is_some();
    let unsigned = builder
        .get_config_value(&AmazonS3ConfigKey::SkipSignature)
        .is_some_and(|v| v == "true");
    if !signed && !unsigned {
        return Ok(None);
    }
    let options = GRANTED_S3_KEYS
        .iter()
        .filter_map(|key| {
            let value = builder.get_config_value(key)?;
            // The short names statements use (`aws.access_key_id`), which the checks
            // for missing credentials look for.
            let name = key.as_ref().trim_start_matches("aws_");
            Some((format!("aws.{name}"), value))
        })
        .collect();
    Ok(Some(StoreGrant {
        url: format!("{}://{}", url.scheme(), url.authority()),
        options,
    }))
}

/// An S3 store's builder for `location`: the environment's settings (for `identity`
/// [`CloudIdentity::Environment`]), then `options`' `aws.*` entries.
fn s3_builder(
    location: &str,
    options: &[(String, String)],
    identity: &CloudIdentity,
) -> Result<AmazonS3Builder> {
    let fail = |e: &dyn std::fmt::Display| {
        DataFusionError::Plan(format!("cannot open object store for {location}: {e}"))
    };
    let base = match identity {
        CloudIdentity::Environment => AmazonS3Builder::from_env(),
        CloudIdentity::OptionsOnly { .. } => AmazonS3Builder::new(),
    };
    let mut builder = base.with_url(location).with_retry(retry());
    for (key, value) in prefixed(options, "aws.") {
        let key: AmazonS3ConfigKey = key.parse().map_err(|e| fail(&e))?;
        if key == AmazonS3ConfigKey::Endpoint && value.starts_with("http://") {
            builder = builder.with_allow_http(true);
        }
        builder = builder.with_config(key, value);
    }
    Ok(builder)
}

/// [`register_for_location`] for code that holds a `&dyn Session` (table factories): the
/// store goes into the session's runtime environment.
pub fn register_in_session(
    state: &dyn Session,
    location: &str,
    options: &[(String, String)],
) -> Result<()> {
    let identity = CloudIdentity::of(state.config());
    if keeps_open_store(state.runtime_env(), &identity, location, options) {
        return Ok(());
    }
    if let Some((base, store)) = store_for_location(location, options, &identity)? {
        state.runtime_env().register_object_store(&base, store);
        record_grant(state.config(), location, options)?;
    }
    Ok(())
}

/// The object store for a remote `location` and the URL (scheme and bucket) it serves;
/// `None` for local paths and schemes DataFusion serves itself.
pub fn store_for_location(
    location: &str,
    options: &[(String, String)],
    identity: &CloudIdentity,
) -> Result<Option<(Url, Arc<dyn ObjectStore>)>> {
    let Ok(url) = Url::parse(location) else {
        return Ok(None);
    };
    if let CloudIdentity::OptionsOnly { user } = identity {
        check_users_options(location, options, user)?;
    }
    let from_env = *identity == CloudIdentity::Environment;
    let fail = |e: &dyn std::fmt::Display| {
        DataFusionError::Plan(format!("cannot open object store for {location}: {e}"))
    };
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        "s3" | "s3a" => {
            let mut builder = s3_builder(location, options, identity)?;
            // With no credentials, object_store would ask the EC2 instance metadata service;
            // honour the AWS SDKs' switch that turns that off.
            if let Some(hint) = missing_credentials_hint(location, options)
                && env_flag("AWS_EC2_METADATA_DISABLED")
            {
                builder = builder.with_credentials(Arc::new(NoAwsCredentials(hint)));
            }
            Arc::new(builder.build().map_err(|e| fail(&e))?)
        }
        "gs" | "gcs" => {
            let base = match from_env {
                true => GoogleCloudStorageBuilder::from_env(),
                false => GoogleCloudStorageBuilder::new(),
            };
            let mut builder = base.with_url(location).with_retry(retry());
            for (key, value) in prefixed(options, "gcp.") {
                let key: GoogleConfigKey = key.parse().map_err(|e| fail(&e))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(|e| fail(&e))?)
        }
        "az" | "azure" | "abfs" | "abfss" | "adl" => {
            let base = match from_env {
                true => MicrosoftAzureBuilder::from_env(),
                false => MicrosoftAzureBuilder::new(),
            };
            let mut builder = base.with_url(location).with_retry(retry());
            for (key, value) in prefixed(options, "azure.") {
                let key: AzureConfigKey = key.parse().map_err(|e| fail(&e))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(|e| fail(&e))?)
        }
        "http" | "https" => {
            let base = format!("{}://{}", url.scheme(), url.authority());
            Arc::new(
                HttpBuilder::new()
                    .with_url(base)
                    .with_retry(retry())
                    .build()
                    .map_err(|e| fail(&e))?,
            )
        }
        _ => return Ok(None),
    };
    let base =
        Url::parse(&format!("{}://{}", url.scheme(), url.authority())).map_err(|e| fail(&e))?;
    Ok(Some((base, store)))
}

/// True when the environment variable `name` is `true` or `1`.
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// The credential provider of an S3 store that was given no credentials while
/// `AWS_EC2_METADATA_DISABLED` is set: every request fails at once with the hint, and no
/// instance metadata service is contacted.
#[derive(Debug)]
struct NoAwsCredentials(String);

#[async_trait::async_trait]
impl object_store::CredentialProvider for NoAwsCredentials {
    type Credential = object_store::aws::AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<Self::Credential>> {
        Err(object_store::Error::Generic {
            store: "S3",
            source: self.0.clone().into(),
        })
    }
}

/// For an `s3://` location given no credentials (none in `options`, none in the environment),
/// the sentence to add to an error about it: object_store then asks the instance metadata
/// service, whose refusal alone says little.
pub fn missing_credentials_hint(location: &str, options: &[(String, String)]) -> Option<String> {
    let scheme = Url::parse(location).ok()?.scheme().to_string();
    if scheme != "s3" && scheme != "s3a" {
        return None;
    }
    let given = |key: &str| options.iter().any(|(k, _)| k == key);
    let skip_signature = options
        .iter()
        .any(|(k, v)| k == "aws.skip_signature" && v.eq_ignore_ascii_case("true"));
    let from_env = [
        "AWS_ACCESS_KEY_ID",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some());
    if given("aws.access_key_id") || skip_signature || from_env {
        return None;
    }
    Some(format!(
        "no AWS credentials were given for {location}: set AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY, or OPTIONS ('aws.access_key_id' '...', \
         'aws.secret_access_key' '...'), or 'aws.skip_signature' 'true' for a public bucket"
    ))
}

/// `error` with the [`missing_credentials_hint`] for `location` appended, when there is one.
pub fn with_credentials_hint(
    error: DataFusionError,
    location: &str,
    options: &[(String, String)],
) -> DataFusionError {
    match missing_credentials_hint(location, options) {
        Some(hint) => DataFusionError::Plan(format!("{error}; {hint}")),
        None => error,
    }
}

/// Retries of failed requests: a few, within 15 s, so a wrong endpoint or a missing bucket
/// is an error soon rather than after object_store's default three minutes.
fn retry() -> RetryConfig {
    RetryConfig {
        max_retries: 3,
        retry_timeout: std::time::Duration::from_secs(15),
        ..RetryConfig::default()
    }
}

/// The entries of `options` whose key starts with `prefix`, with the prefix removed.
fn prefixed<'a>(
    options: &'a [(String, String)],
    prefix: &'a str,
) -> impl Iterator<Item = (&'a str, &'a str)> {
    options
        .iter()
        .filter_map(move |(k, v)| k.strip_prefix(prefix).map(|k| (k, v.as_str())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::object_store::ObjectStoreUrl;

    #[test]
    fn remote_locations_get_a_store_and_bad_options_are_named() {
        let ctx = SessionContext::new();
        register_table_options(&ctx);
        register_for_statement(
            &ctx,
            "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION 's3://bucket-a/data/' \
             OPTIONS ('aws.region' 'eu-west-1', 'aws.endpoint' 'http://127.0.0.1:9000')",
        )
        .unwrap();
        let url = ObjectStoreUrl::parse("s3://bucket-a").unwrap();
        assert!(ctx.runtime_env().object_store(&url).is_ok());
        // A bucket never named has no store.
        let other = ObjectStoreUrl::parse("s3://bucket-b").unwrap();
        assert!(ctx.runtime_env().object_store(&other).is_err());
        let err = register_for_statement(
            &ctx,
            "COPY (SELECT 1) TO 's3://bucket-a/out.parquet' OPTIONS ('aws.no_such_key' 'x')",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("s3://bucket-a/out.parquet"), "{err}");
        // Local paths and unparsable SQL register nothing and fail nothing.
        register_for_statement(
            &ctx,
            "CREATE EXTERNAL TABLE l STORED AS CSV LOCATION 'data/x.csv'",
        )
        .unwrap();
        register_for_statement(&ctx, "SELEC nonsense").unwrap();
    }

    #[test]
    fn a_store_grant_carries_the_credentials_under_statement_names_and_prints_none() {
        let options = vec![
            ("aws.access_key_id".to_string(), "AKIDEXAMPLE".to_string()),
            (
                "aws.secret_access_key".to_string(),
                "wJalrXUtnFEMI".to_string(),
            ),
            (
                "aws.endpoint".to_string(),
                "http://10.0.0.9:5000".to_string(),
            ),
            ("aws.region".to_string(), "us-east-1".to_string()),
        ];
        let grant = grant_for_location("s3://lake/events/", &options, &CloudIdentity::Environment)
            .unwrap()
            .unwrap();
        assert_eq!(grant.url, "s3://lake");
        let value = |k: &str| {
            grant
                .options
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v)
        };
        assert_eq!(value("aws.access_key_id").unwrap(), "AKIDEXAMPLE");
        assert_eq!(value("aws.secret_access_key").unwrap(), "wJalrXUtnFEMI");
        assert_eq!(value("aws.allow_http").unwrap(), "true");
        assert!(missing_credentials_hint(&grant.url, &grant.options).is_none());
        let shown = format!("{grant:?}");
        assert!(
            !shown.contains("wJalrXUtnFEMI") && !shown.contains("AKIDEXAMPLE"),
            "{shown}"
        );
        // A worker builds the same store from the grant alone.
        assert!(
            store_for_location(&grant.url, &grant.options, &CloudIdentity::Environment)
                .unwrap()
                .is_some()
        );
        // Not S3: no grant (the driver reads it).
        assert!(
            grant_for_location("gs://b/x", &[], &CloudIdentity::Environment)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_user_without_the_servers_identity_opens_stores_with_its_own_credentials_only() {
        let identity = CloudIdentity::OptionsOnly { user: "cy".into() };
        let config = datafusion::prelude::SessionConfig::new().with_extension(Arc::new(identity));
        let ctx = SessionContext::new_with_config(config);
        let err = |sql: &str| register_for_statement(&ctx, sql).unwrap_err().to_string();
        let e = err("CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION 's3://b/t/'");
        assert!(
            e.contains("no credentials for s3://b/t/") && e.contains("user cy"),
            "{e}"
        );
        let e = err("CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION 'gs://b/t/'");
        assert!(e.contains("gcp.service_account_key"), "{e}");
        for key in [
            "aws.metadata_endpoint",
            "aws.container_credentials_full_uri",
            "aws.web_identity_token_file",
            "gcp.service_account",
            "azure.federated_token_file",
            "azure.use_azure_cli",
        ] {
            let scheme = match key.split('.').next().unwrap() {
                "aws" => "s3",
                "gcp" => "gs",
                _ => "az",
            };
            let e = err(&format!(
                "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION '{scheme}://b/t/' \
                 OPTIONS ('{key}' 'x', 'aws.skip_signature' 'true')"
            ));
            assert!(e.contains("server's own cloud identity"), "{key}: {e}");
        }
        // Its own keys work; a public bucket needs none.
        register_for_statement(
            &ctx,
            "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION 's3://b/t/' \
             OPTIONS ('aws.access_key_id' 'AKID', 'aws.secret_access_key' 'S', 'aws.region' 'eu-west-1')",
        )
        .unwrap();
        register_for_statement(
            &ctx,
            "CREATE EXTERNAL TABLE p STORED AS PARQUET LOCATION 's3://public/t/' \
             OPTIONS ('aws.skip_signature' 'true')",
        )
        .unwrap();
        // A store the session has is kept for a statement that gives no credentials.
        let url = ObjectStoreUrl::parse("s3://b").unwrap();
        let before = ctx.runtime_env().object_store(&url).unwrap();
        register_for_statement(&ctx, "SELECT * FROM 's3://b/t/x.parquet'").unwrap();
        assert!(Arc::ptr_eq(
            &before,
            &ctx.runtime_env().object_store(&url).unwrap()
        ));
        // The grant a worker would get holds what the user gave, nothing of the environment.
        let grant = grant_for_location(
            "s3://b/t/",
            &[
                ("aws.access_key_id".into(), "AKID".into()),
                ("aws.secret_access_key".into(), "S".into()),
            ],
            &CloudIdentity::OptionsOnly { user: "cy".into() },
        )
        .unwrap()
        .unwrap();
        let keys: Vec<&str> = grant.options.iter().map(|(k, _)| k.as_str()).collect();
        assert!(keys.contains(&"aws.secret_access_key"), "{grant:?}");
        for from_env in ["aws.token", "aws.region", "aws.endpoint"] {
            assert!(!keys.contains(&from_env), "{grant:?}");
        }
    }
}
