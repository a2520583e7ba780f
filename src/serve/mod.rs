//! `flumen serve`: an Arrow Flight SQL server over a flumen session, for ADBC (Python, Go,
//! Java, C), the Flight SQL JDBC driver and any Flight client.
//!
//! - [`credentials`]: users with Argon2 password hashes, the static token, session tokens.
//! - [`gate`]: the tower layer that refuses every call but the handshake without a token.
//! - [`handshake_limits`]: password checks rationed; addresses and users back off after failures.
//! - [`policy`]: what a client may touch: operator-only settings, allowed paths and URLs.
//! - [`grants`]: what the operator grants each user on top (the users file's options).
//! - [`sessions`]: each client's own session (own settings, shared tables).
//! - [`settings_file`]: the operator's settings file (`--settings FILE`), applied at startup.
//! - [`statements`]: tickets and prepared statements held between calls.
//! - [`running`]: the running queries: progress view, cancellation, one log line each.
//! - [`catalog_file`]: the tables clients created, kept across restarts.
//! - [`datasets`]: the training feed: dataset jobs read by trainers block by block.
//! - [`flight_sql`]: the Flight SQL service itself.
//!
//! Nothing runs unauthenticated: a server needs users or a token, and one listening on
//! anything but loopback needs TLS too (passwords and tokens must not cross a network in
//! the clear).

pub mod catalog_file;
pub mod credentials;
pub mod datasets;
pub mod flight_sql;
pub mod gate;
pub mod grants;
pub mod handshake_limits;
pub mod policy;
pub mod running;
pub mod sessions;
pub mod settings_file;
pub mod statements;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::SessionContext;

use crate::cluster::auth::Secret;
use crate::cluster::tls::TlsIdentity;
use catalog_file::CatalogFile;
use credentials::{Authenticator, UserFile};
use flight_sql::FlumenFlightSql;

/// The default address: loopback, the port Flight SQL servers customarily use.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";

/// Largest message a client may send (a ticket, parameters, an action): 16 MiB.
pub const MAX_REQUEST_BYTES: usize = 16 << 20;

/// Most queries one user runs at once by default (each holds up to the memory budget).
pub const MAX_QUERIES_PER_USER: usize = 8;

/// How a server listens and whom it admits.
#[derive(Debug)]
pub struct ServeSettings {
    /// `host:port` to listen on (port 0 picks a free one).
    pub listen: String,
    /// Users who authenticate with a password on the handshake.
    pub users: Option<UserFile>,
    /// A token accepted as a bearer token on every call.
    pub token: Option<Secret>,
    /// The TLS certificate and key (required off loopback).
    pub tls: Option<TlsIdentity>,
    /// Where tables created by clients are kept (none: they last until the server exits).
    pub catalog_file: Option<PathBuf>,
    /// A dataset job none of whose consumers asked for a block this long is dropped.
    pub dataset_job_idle: std::time::Duration,
    /// The files and URLs clients may read and write (default: none).
    pub policy: policy::AccessPolicy,
    /// Most queries one user runs at once.
    pub max_queries_per_user: usize,
    /// A session token expires this long after its handshake.
    pub token_lifetime: std::time::Duration,
}

impl ServeSettings {
    /// Listen on [`DEFAULT_LISTEN`] without users, token, TLS or catalog file (give at
    /// least users or a token before serving).
    pub fn new() -> Self {
        Self {
            listen: DEFAULT_LISTEN.into(),
            users: None,
            token: None,
            tls: None,
            catalog_file: None,
            dataset_job_idle: datasets::JOB_IDLE_LIMIT,
            policy: policy::AccessPolicy::default(),
            max_queries_per_user: MAX_QUERIES_PER_USER,
            token_lifetime: credentials::TOKEN_LIFETIME,
        }
    }
}

impl Default for ServeSettings {
    fn default() -> Self {
        Self::new()
    }
}

/// Refuse to serve on `address` what would cross a network in the clear.
pub fn check_exposure(address: &SocketAddr, tls: bool) -> Result<()> {
    if !tls && !address.ip().is_loopback() {
        return Err(DataFusionError::Execution(format!(
            "flumen serve on {address} (not a loopback address) must use TLS, or passwords \
             and tokens would cross the network in the clear: give --tls-cert FILE and \
             --tls-key FILE"
        )));
    }
    Ok(())
}

/// Serve `ctx`'s tables over Flight SQL until Ctrl-C or SIGTERM. Prints `flumen serve
/// listening on ADDRESS` on standard output once it accepts calls.
pub async fn serve(ctx: SessionContext, settings: ServeSettings) -> Result<()> {
    let no_grants = HashMap::new();
    let user_grants = settings.users.as_ref().map_or(&no_grants, |u| u.grants());
    let grants = grants::Grants::new(settings.policy.clone(), settings.max_queries_per_user)
        .with_users(user_grants)?;
    let auth = Authenticator::new(settings.users, settings.token)?
        .with_token_lifetime(settings.token_lifetime);
    let listener = tokio::net::TcpListener::bind(&settings.listen)
        .await
        .map_err(|e| {
            DataFusionError::Execution(format!(
                "flumen serve cannot listen on {}: {e}",
                settings.listen
            ))
        })?;
    let address = listener.local_addr()?;
    check_exposure(&address, settings.tls.is_some())?;
    let catalog = match &settings.catalog_file {
        Some(path) => {
            let catalog = CatalogFile::open(path)?;
            let created = catalog.replay(&ctx).await;
            log::info!(
                "flumen serve: {created} of {} tables recreated from {}",
                catalog.tables().len(),
                path.display()
            );
            Some(Arc::new(catalog))
        }
        None => None,
    };
    let builder = crate::cluster::tls::server_builder(settings.tls.as_ref(), "flumen serve")?;
    // Queries run on a runtime of their own: calls (new connections, cancellations, the
    // progress view) are answered while every query thread computes.
    let queries = tokio::runtime::Builder::new_multi_thread()
        .thread_name("flumen-query")
        .enable_all()
        .build()?;
    let service = FlumenFlightSql::new(queries.handle().clone(), ctx, auth.clone(), catalog)?
        .with_dataset_job_idle(settings.dataset_job_idle)
        .with_grants(grants.clone());
    log::info!("flumen serve: clients may touch {}", grants.describe());
    let server = FlightServiceServer::new(service).max_decoding_message_size(MAX_REQUEST_BYTES);
    println!("flumen serve listening on {address}");
    use std::io::Write;
    std::io::stdout().flush()?;
    let served = builder
        .layer(gate::AuthLayer::new(auth))
        .add_service(server)
        .serve_with_incoming_shutdown(
            // No Nagle: a small message (a handshake, the first batch) would wait for the
            // client's delayed ACK, 40 ms.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown_signal(),
        )
        .await;
    queries.shutdown_background();
    served.map_err(|e| DataFusionError::Execution(format!("flumen serve on {address} failed: {e}")))
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    log::info!("flumen serve: shutting down");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_is_refused_off_loopback() {
        let any: SocketAddr = "0.0.0.0:50051".parse().unwrap();
        let err = check_exposure(&any, false).unwrap_err().to_string();
        assert!(err.contains("must use TLS"), "{err}");
        assert!(check_exposure(&any, true).is_ok());
        assert!(check_exposure(&"127.0.0.1:1".parse().unwrap(), false).is_ok());
    }
}
