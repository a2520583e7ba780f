//! What a `flumen serve` client may touch: the settings only the operator sets, and the
//! files and URLs a statement may read or write.
//!
//! - **Operator settings** ([`OPERATOR_SETTINGS`], and every `datafusion.runtime.*`): where
//!   the workers run, the cluster's secret and CA, the worker binary, process and slot
//!   counts, the memory budget, the spill directory, the timeline file, the model directory
//!   and the model-output cache.
//!   `flumen serve`'s flags and its settings file (`--settings FILE`) set them at startup; a
//!   client's `SET` or `RESET` of one is refused, naming where the operator sets it.
//! - **Files and URLs** ([`AccessPolicy`]): a statement's every location (`CREATE EXTERNAL
//!   TABLE ... LOCATION`, a path table `SELECT * FROM '/path'`, `COPY ... TO`, the table an
//!   `INSERT` writes, every table a query scans) must be under a directory the operator
//!   allowed (`--allow-path DIR`), after `..` and symlinks are resolved, or start with a URL
//!   prefix the operator allowed (`--allow-url PREFIX`). None is allowed by default. An
//!   `http(s)://` location whose host is (or resolves to) a loopback, private, link-local or
//!   unspecified address is refused unless an allowed prefix names that host: a client must
//!   not reach the services beside the server (instance metadata at 169.254.169.254).
//!
//! Checked on the logical plan, before it runs; a path table is checked before it is
//! planned, since planning one reads the file to infer its schema.

use std::net::{IpAddr, ToSocketAddrs};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use datafusion::catalog::TableProvider;
use datafusion::common::TableReference;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::DefaultTableSource;
use datafusion::datasource::listing::ListingTable;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{DdlStatement, LogicalPlan, Statement, TableSource};
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParser, Statement as DFStatement};
use datafusion::sql::sqlparser::ast::Value;
use url::Url;

use crate::io::file_functions::{FunctionArgument, locations_read_by_functions};

/// Settings only the operator sets, each with the `flumen serve` flag (or server setting)
/// that sets it.
pub const OPERATOR_SETTINGS: &[(&str, &str)] = &[
    ("flumen.workers", "--workers"),
    ("flumen.worker_processes", "--workers"),
    ("flumen.worker_binary", "flumen serve --settings FILE"),
    ("flumen.worker_tls", "flumen serve --settings FILE"),
    ("flumen.cluster", "flumen serve --settings FILE"),
    ("flumen.cluster_secret_file", "flumen serve --settings FILE"),
    ("flumen.worker_ca", "flumen serve --settings FILE"),
    (
        "flumen.heartbeat_timeout_secs",
        "flumen serve --settings FILE",
    ),
    ("flumen.task_timeout_secs", "flumen serve --settings FILE"),
    ("flumen.max_task_retries", "flumen serve --settings FILE"),
    ("flumen.memory_budget", "--memory-budget"),
    ("flumen.budget_counts_heap", "flumen serve --settings FILE"),
    ("flumen.spill_dir", "flumen serve --settings FILE"),
    ("flumen.cpu_slots", "flumen serve --settings FILE"),
    ("flumen.accelerator_slots", "flumen serve --settings FILE"),
    (
        "flumen.accelerator_min_slots",
        "flumen serve --settings FILE",
    ),
    (
        "flumen.accelerator_idle_secs",
        "flumen serve --settings FILE",
    ),
    ("flumen.timeline_file", "flumen serve --settings FILE"),
    ("flumen.model_dir", "flumen serve --settings FILE"),
    ("flumen.model_cache", "flumen serve --settings FILE"),
    (
        "flumen.model_cache_max_bytes",
        "flumen serve --settings FILE",
    ),
    ("flumen.device", "flumen serve --settings FILE"),
];

/// Refuse `SET`/`RESET` of `variable` when only the operator sets it.
pub fn check_setting(variable: &str) -> Result<()> {
    let name = variable.trim().to_ascii_lowercase();
    let flag = if name.starts_with("datafusion.runtime.") {
        Some("flumen serve --settings FILE")
    } else {
        (OPERATOR_SETTINGS.iter())
            .find(|(setting, _)| *setting == name)
            .map(|(_, flag)| *flag)
    };
    match flag {
        None => Ok(()),
        Some(flag) => Err(refused(format!(
            "{name} is set by the server's operator ({flag}), not by a client's SET"
        ))),
    }
}

/// A statement the server's policy refuses (a client is told `PERMISSION_DENIED`).
#[derive(Debug)]
pub struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "flumen serve refuses this statement: {}", self.0)
    }
}

impl std::error::Error for Refused {}

/// A refusal, as the client sees it.
fn refused(what: String) -> DataFusionError {
    DataFusionError::External(Box::new(Refused(what)))
}

/// The files and URLs a server's clients may read and write.
#[derive(Debug, Clone, Default)]
pub struct AccessPolicy {
    /// Directories (canonical) under which clients read and write.
    paths: Vec<PathBuf>,
    /// URL prefixes (as `Url` writes them) clients read and write.
    urls: Vec<String>,
}

impl AccessPolicy {
    /// Allow `paths` (each an existing directory) and URLs starting with `urls`.
    pub fn new(paths: &[PathBuf], urls: &[String]) -> Result<Self> {
        let paths = (paths.iter())
            .map(|dir| {
                let canonical = dir.canonicalize().map_err(|e| {
                    DataFusionError::Configuration(format!("--allow-path {}: {e}", dir.display()))
                })?;
                if !canonical.is_dir() {
                    return Err(DataFusionError::Configuration(format!(
                        "--allow-path {}: not a directory",
                        dir.display()
                    )));
                }
                Ok(canonical)
            })
            .collect::<Result<Vec<_>>>()?;
        let urls = (urls.iter())
            .map(|prefix| match Url::parse(prefix) {
                // A whole scheme (`https://`): any host, public ones only for http(s).
                _ if prefix.strip_suffix("://").is_some_and(|scheme| {
                    !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric())
                }) =>
                {
                    Ok(prefix.to_ascii_lowercase())
                }
                Ok(url) if url.scheme() != "file" => Ok(url.to_string()),
                Ok(_) => Err(DataFusionError::Configuration(format!(
                    "--allow-url {prefix}: give local directories with --allow-path"
                ))),
                Err(e) => Err(DataFusionError::Configuration(format!(
                    "--allow-url {prefix}: not a URL ({e})"
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { paths, urls })
    }

    /// What is allowed, in words (for refusals and the startup log).
    pub fn describe(&self) -> String {
        let list = |items: Vec<String>| match items.is_empty() {
            true => "none".to_string(),
            false => items.join(", "),
        };
        format!(
            "directories: {}; URL prefixes: {}",
            list(self.paths.iter().map(|p| p.display().to_string()).collect()),
            list(self.urls.clone())
        )
    }

    /// What this policy allows and what `other` does.
    pub fn widened(&self, other: &AccessPolicy) -> AccessPolicy {
        let mut wider = self.clone();
        for path in &other.paths {
            if !wider.paths.contains(path) {
                wider.paths.push(path.clone());
            }
        }
        for url in &other.urls {
            if !wider.urls.contains(url) {
                wider.urls.push(url.clone());
            }
        }
        wider
    }

    /// Refuse `location` unless it is allowed; `access` says what the statement does with
    /// it ("read", "write").
    pub fn check_location(&self, location: &str, access: &str) -> Result<()> {
        let outcome = match local_path(location) {
            Some(path) => self.check_path(&path),
            None => self.check_url(location),
        };
        outcome.map_err(|why| {
            refused(format!(
                "it would {access} '{location}', {why} (the operator allows {})",
                self.describe()
            ))
        })
    }

    fn check_path(&self, path: &Path) -> std::result::Result<(), String> {
        let resolved = resolve(path)?;
        match self.paths.iter().any(|dir| resolved.starts_with(dir)) {
            true => Ok(()),
            false => Err(format!(
                "which is {} and outside the allowed directories",
                resolved.display()
            )),
        }
    }

    fn check_url(&self, location: &str) -> std::result::Result<(), String> {
        let url = Url::parse(location).map_err(|e| format!("which is not a URL ({e})"))?;
        if url
            .path_segments()
            .is_some_and(|mut s| s.any(|s| s == ".." || s == "%2e%2e"))
        {
            return Err("whose path goes up with '..'".into());
        }
        let text = url.as_str();
        let Some(prefix) = self.urls.iter().find(|p| under_prefix(text, p)) else {
            return Err("which no allowed URL prefix covers".into());
        };
        if matches!(url.scheme(), "http" | "https") {
            let named = Url::parse(prefix).is_ok_and(|p| p.host_str() == url.host_str());
            if !named && let Some(ip) = inner_address(&url)? {
                return Err(format!(
                    "whose host is the internal address {ip} (allow it by naming the host in \
                     an --allow-url prefix)"
                ));
            }
        }
        Ok(())
    }

    /// Refuse `plan` if it sets an operator setting or touches a location not allowed.
    pub fn check_plan(&self, plan: &LogicalPlan) -> Result<()> {
        plan.apply_with_subqueries(|node| {
            match node {
                LogicalPlan::Statement(Statement::SetVariable(set)) => {
                    check_setting(&set.variable)?
                }
                LogicalPlan::Statement(Statement::ResetVariable(reset)) => {
                    check_setting(&reset.variable)?
                }
                LogicalPlan::Ddl(DdlStatement::CreateExternalTable(create)) => {
                    for location in &create.locations {
                        self.check_location(location, "read and write")?;
                    }
                }
                LogicalPlan::Copy(copy) => self.check_location(&copy.output_url, "write")?,
                LogicalPlan::Dml(dml) => self.check_source(dml.target.as_ref(), "write")?,
                LogicalPlan::TableScan(scan) => self.check_source(scan.source.as_ref(), "read")?,
                _ => {}
            }
            Ok(TreeNodeRecursion::Continue)
        })
        .map(|_| ())
    }

    /// Refuse a statement's `OPTIONS` that would point the server at an internal address:
    /// an endpoint, URL or host option (`aws.endpoint`, `azure.authority_host`, a proxy) whose
    /// host is loopback, private or link-local, unless an allowed URL prefix names that host.
    fn check_endpoints(&self, options: &[(String, Value)]) -> Result<()> {
        for (key, value) in options {
            let value = match value {
                Value::SingleQuotedString(s) | Value::DoubleQuotedString(s) => s.clone(),
                other => other.to_string(),
            };
            let name = key.to_ascii_lowercase();
            if !["endpoint", "url", "host"].iter().any(|w| name.contains(w)) {
                continue;
            }
            let Ok(url) = Url::parse(&value) else {
                continue;
            };
            let named = (self.urls.iter()).any(|p| {
                Url::parse(p).is_ok_and(|p| {
                    p.host_str() == url.host_str()
                        && p.port_or_known_default() == url.port_or_known_default()
                })
            });
            if named || url.host().is_none() {
                continue;
            }
            if let Some(ip) = inner_address(&url)
                .map_err(|why| refused(format!("option '{key}' '{value}', {why}")))?
            {
                return Err(refused(format!(
                    "option '{key}' '{value}' points at the internal address {ip} (the \
                     operator allows it by naming the host in an --allow-url prefix)"
                )));
            }
        }
        Ok(())
    }

    /// Refuse a table whose files are not allowed (a listing table: files and directories).
    fn check_source(&self, source: &dyn TableSource, access: &str) -> Result<()> {
        let Some(provider) = provider_of(source) else {
            return Ok(());
        };
        if let Some(listing) = provider.downcast_ref::<ListingTable>() {
            for url in listing.table_paths() {
                self.check_location(url.as_str(), access)?;
            }
        }
        Ok(())
    }

    /// Refuse `sql` before it is planned (or its object stores opened) if a table it names
    /// is a path or URL not allowed (a name the session has no table for is read as a file's
    /// location when the statement is planned), or its `OPTIONS` aim at an internal address.
    pub fn check_before_planning(&self, ctx: &SessionContext, sql: &str) -> Result<()> {
        let Ok(statements) = DFParser::parse_sql(sql) else {
            return Ok(());
        };
        let state = ctx.state();
        for statement in &statements {
            match statement {
                DFStatement::CreateExternalTable(create) => {
                    self.check_endpoints(&create.options)?
                }
                DFStatement::CopyTo(copy) => self.check_endpoints(&copy.options)?,
                _ => {}
            }
            // What `read_parquet(...)`, `parquet_metadata(...)` and `table_changes(...)` read
            // as they are planned: a location the policy allows, or (`table_changes`) a table
            // of the session's; one known only once planned is refused.
            for argument in locations_read_by_functions(statement) {
                match argument {
                    FunctionArgument::Quoted(location) => {
                        let table = TableReference::from(location.as_str());
                        let known = (state.schema_for_ref(table.clone()))
                            .is_ok_and(|schema| schema.table_exist(table.table()));
                        if !known {
                            self.check_location(&location, "read")?;
                        }
                    }
                    FunctionArgument::Computed(sql) => {
                        return Err(refused(format!(
                            "the location {sql}: a table function's location must be a \
                             quoted string"
                        )));
                    }
                }
            }
            let Ok(tables) = state.resolve_table_references(statement) else {
                continue;
            };
            for table in tables {
                let name = table.table();
                let known = (state.schema_for_ref(table.clone()))
                    .is_ok_and(|schema| schema.table_exist(name));
                if !known && (name.contains('/') || name.contains('.') || name.contains(':')) {
                    self.check_location(name, "read")?;
                }
            }
        }
        Ok(())
    }
}

/// The provider behind a plan's table source, when it is one.
fn provider_of(source: &dyn TableSource) -> Option<Arc<dyn TableProvider>> {
    source
        .downcast_ref::<DefaultTableSource>()
        .map(|default| Arc::clone(&default.table_provider))
}

/// The local path of `location`: a `file://` URL's, or a location with no scheme.
fn local_path(location: &str) -> Option<PathBuf> {
    if let Some(rest) = location.strip_prefix("file://") {
        return Some(PathBuf::from(rest));
    }
    match location.contains("://") {
        true => None,
        false => Some(PathBuf::from(location)),
    }
}

/// `path` made absolute, cut before its first glob component, its existing part with every
/// symlink resolved and the rest with `..` taken lexically (nothing there to link).
fn resolve(path: &Path) -> std::result::Result<PathBuf, String> {
    let absolute =
        std::path::absolute(path).map_err(|e| format!("which has no absolute form ({e})"))?;
    let glob = |c: &Component| {
        c.as_os_str()
            .to_string_lossy()
            .contains(['*', '?', '[', '{'])
    };
    let base: PathBuf = absolute.components().take_while(|c| !glob(c)).collect();
    let mut existing = base.clone();
    let mut tail = vec![];
    while std::fs::symlink_metadata(&existing).is_err() {
        let Some(name) = existing.components().next_back() else {
            break;
        };
        tail.push(name.as_os_str().to_owned());
        if !existing.pop() {
            break;
        }
    }
    let mut resolved = existing
        .canonicalize()
        .map_err(|e| format!("which cannot be resolved ({e})"))?;
    for name in tail.into_iter().rev() {
        match Path::new(&name).components().next() {
            Some(Component::ParentDir) => {
                resolved.pop();
            }
            Some(Component::Normal(part)) => resolved.push(part),
            _ => {}
        }
    }
    Ok(resolved)
}

/// Whether URL `text` is `prefix` or under it (a prefix ends at a `/`, so `s3://bucket`
/// does not cover `s3://bucket-other`).
fn under_prefix(text: &str, prefix: &str) -> bool {
    text.strip_prefix(prefix).is_some_and(|rest| {
        prefix.ends_with('/') || rest.is_empty() || rest.starts_with(['/', '?', '#'])
    })
}

/// The loopback, private, link-local or unspecified address `url`'s host is or resolves
/// to, if any; a host that does not resolve is refused.
fn inner_address(url: &Url) -> std::result::Result<Option<IpAddr>, String> {
    let addresses: Vec<IpAddr> = match url.host() {
        Some(url::Host::Ipv4(ip)) => vec![IpAddr::V4(ip)],
        Some(url::Host::Ipv6(ip)) => vec![IpAddr::V6(ip)],
        Some(url::Host::Domain(name)) => {
            let port = url.port_or_known_default().unwrap_or(443);
            (name, port)
                .to_socket_addrs()
                .map_err(|e| format!("whose host {name} does not resolve ({e})"))?
                .map(|a| a.ip())
                .collect()
        }
        None => return Err("which names no host".into()),
    };
    Ok(addresses.into_iter().find(is_inner))
}

/// Whether `ip` is an address of the server's own machine or network.
fn is_inner(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                // Carrier-grade NAT, 100.64.0.0/10.
                || (a == 100 && (64..128).contains(&b))
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                // Unique local (fc00::/7) and link-local (fe80::/10).
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || v6.to_ipv4_mapped().is_some_and(|v4| is_inner(&IpAddr::V4(v4)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(dir: &Path, urls: &[&str]) -> AccessPolicy {
        let urls: Vec<String> = urls.iter().map(|u| u.to_string()).collect();
        AccessPolicy::new(&[dir.to_path_buf()], &urls).unwrap()
    }

    #[test]
    fn paths_are_judged_after_dots_and_symlinks_resolve() {
        let root = tempfile::tempdir().unwrap();
        let data = root.path().join("data");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(root.path().join("secret"), "x").unwrap();
        std::os::unix::fs::symlink(root.path().join("secret"), data.join("link.csv")).unwrap();
        let p = policy(&data, &[]);
        let inside = data.join("t.parquet");
        assert!(p.check_location(inside.to_str().unwrap(), "read").is_ok());
        assert!(
            p.check_location(&format!("file://{}/", data.display()), "read")
                .is_ok()
        );
        assert!(
            p.check_location(&format!("{}/new/out.parquet", data.display()), "write")
                .is_ok()
        );
        assert!(
            p.check_location(&format!("{}/*.parquet", data.display()), "read")
                .is_ok()
        );
        for outside in [
            "/etc/passwd".to_string(),
            format!("{}/../secret", data.display()),
            format!("{}/new/../../secret", data.display()),
            format!("{}/link.csv", data.display()),
            format!("file://{}/secret", root.path().display()),
            "relative.csv".to_string(),
        ] {
            let err = p.check_location(&outside, "read").unwrap_err().to_string();
            assert!(err.contains("flumen serve refuses"), "{outside}: {err}");
            assert!(err.contains(&outside), "{outside}: {err}");
        }
    }

    #[test]
    fn urls_need_an_allowed_prefix_and_a_public_host() {
        let root = tempfile::tempdir().unwrap();
        let p = policy(
            root.path(),
            &[
                "s3://bucket/",
                "s3://other/t/",
                "https://",
                "http://127.0.0.1:9000/",
            ],
        );
        assert!(p.check_location("s3://bucket/t/x.parquet", "read").is_ok());
        assert!(
            p.check_location("s3://bucket-other/x.parquet", "read")
                .is_err()
        );
        // Judged as parsed: `..` is taken out first.
        assert!(p.check_location("s3://other/t/x", "read").is_ok());
        assert!(p.check_location("s3://other/t/../x", "read").is_err());
        assert!(p.check_location("gs://bucket/x", "read").is_err());
        assert!(
            p.check_location("https://93.184.215.14/x.csv", "read")
                .is_ok()
        );
        for inner in [
            "http://169.254.169.254/latest/meta-data/",
            "https://169.254.169.254/",
            "https://10.1.2.3/x.csv",
            "https://[::1]/x.csv",
            "https://localhost/x.csv",
        ] {
            let err = p.check_location(inner, "read").unwrap_err().to_string();
            assert!(
                err.contains("internal address") || err.contains("no allowed"),
                "{inner}: {err}"
            );
        }
        // A prefix that names an internal host allows it.
        assert!(
            p.check_location("http://127.0.0.1:9000/b/x.parquet", "read")
                .is_ok()
        );
    }

    #[test]
    fn operator_settings_are_refused() {
        for name in [
            "flumen.workers",
            "FLUMEN.CLUSTER",
            "datafusion.runtime.memory_limit",
        ] {
            let err = check_setting(name).unwrap_err().to_string();
            assert!(err.contains("set by the server's operator"), "{err}");
        }
        assert!(check_setting("flumen.target_block_rows").is_ok());
        assert!(check_setting("datafusion.execution.batch_size").is_ok());
    }
}
