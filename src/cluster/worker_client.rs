//! A Flight client of one worker: connecting with the driver's secret, the driver's hello
//! (a program that is not a flumen worker, or a worker of another protocol, is refused),
//! the calls the driver makes, and why a call failed ([`Failure`]).

use std::time::Duration;

use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, Ticket};
use datafusion::arrow::compute::concat_batches;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use futures::TryStreamExt;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::cluster::auth::{Secret, SendSecret};
use crate::cluster::protocol::{
    BlockTicket, DriverHello, MAX_TASK_BYTES, PROTOCOL_VERSION, WorkerStatus,
};
use crate::cluster::tls::WorkerTrust;

/// A Flight client of one worker that presents the driver's secret on every call.
pub type Client = FlightServiceClient<InterceptedService<Channel, SendSecret>>;

/// A Flight client of the worker at `address` (`host:port`) that presents `secret` on
/// every call; in TLS, checking the worker's certificate against `trust`, when given.
pub async fn connect(
    address: &str,
    trust: Option<&WorkerTrust>,
    secret: &Secret,
) -> Result<Client> {
    let scheme = if trust.is_some() { "https" } else { "http" };
    let mut endpoint = Channel::from_shared(format!("{scheme}://{address}"))
        .map_err(|e| DataFusionError::Execution(format!("bad worker address {address}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        // A peer that stops answering (a frozen process, a cut link) fails the calls on
        // it within seconds instead of holding them until the task timeout.
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    if let Some(trust) = trust {
        endpoint = endpoint.tls_config(trust.client_config()).map_err(|e| {
            DataFusionError::Execution(format!("cannot use TLS with {address}: {e}"))
        })?;
    }
    let channel = endpoint.connect().await.map_err(|e| {
        DataFusionError::Execution(format!(
            "cannot connect to {address}: {}",
            crate::error_chain(&e)
        ))
    })?;
    Ok(
        FlightServiceClient::with_interceptor(channel, SendSecret::new(secret))
            .max_decoding_message_size(MAX_TASK_BYTES)
            .max_encoding_message_size(MAX_TASK_BYTES),
    )
}

/// Connect to the worker at `address` and read its status with this driver's hello: a
/// program that does not answer as a flumen worker, or a worker of another protocol, is
/// refused here.
pub(crate) async fn introduce(
    address: &str,
    trust: Option<&WorkerTrust>,
    secret: &Secret,
) -> Result<(Client, WorkerStatus)> {
    let client = connect(address, trust, secret).await?;
    let status = read_status(&client).await.map_err(|e| {
        DataFusionError::Execution(match e {
            Failure::Refused(why) => format!(
                "worker {address} refused this driver ({why}): the secret in \
                 flumen.cluster_secret_file is not the one the worker was started with"
            ),
            Failure::Task(why) if why.contains("worker protocol") => why,
            other => format!("{address} does not answer as a flumen worker: {other}"),
        })
    })?;
    if status.protocol != PROTOCOL_VERSION {
        return Err(DataFusionError::Execution(format!(
            "worker {address} (flumen {}) speaks worker protocol {}, this driver (flumen {}) \
             protocol {PROTOCOL_VERSION}: run the same flumen version on the driver and its \
             workers",
            if status.version.is_empty() {
                "of an older version"
            } else {
                &status.version
            },
            status.protocol,
            env!("CARGO_PKG_VERSION"),
        )));
    }
    Ok((client, status))
}

/// Send action `name` to the worker behind `client` and read its one reply as JSON.
pub(crate) async fn action_on<T: serde::de::DeserializeOwned>(
    client: &Client,
    name: &str,
    body: Vec<u8>,
) -> Result<T, Failure> {
    let mut client = client.clone();
    let action = Action {
        r#type: name.into(),
        body: body.into(),
    };
    let reply = client.do_action(action).await.map_err(Failure::from)?;
    let results: Vec<arrow_flight::Result> = reply
        .into_inner()
        .try_collect()
        .await
        .map_err(Failure::from)?;
    let first = results
        .first()
        .ok_or_else(|| Failure::Garbage(format!("empty reply to {name}")))?;
    serde_json::from_slice(&first.body)
        .map_err(|e| Failure::Garbage(format!("bad reply to {name}: {e}")))
}

/// The status of the worker behind `client`, asked with this driver's hello (a worker of
/// another protocol refuses it, naming both versions).
pub(crate) async fn read_status(client: &Client) -> Result<WorkerStatus, Failure> {
    let hello = serde_json::to_vec(&DriverHello::ours()).expect("hello serializes");
    action_on(client, "status", hello).await
}

/// Read the block `ticket` names from the worker behind `client` (`do_get`).
pub(crate) async fn get_block(
    client: &Client,
    ticket: BlockTicket,
) -> Result<RecordBatch, Failure> {
    let mut client = client.clone();
    let key = ticket.key.clone();
    let ticket = Ticket {
        ticket: serde_json::to_vec(&ticket).unwrap().into(),
    };
    let reply = client.do_get(ticket).await.map_err(Failure::from)?;
    let stream = FlightRecordBatchStream::new_from_flight_data(
        reply
            .into_inner()
            .map_err(arrow_flight::error::FlightError::from),
    );
    let batches: Vec<RecordBatch> = stream.try_collect().await.map_err(|e| {
        // A stream cut by the worker's death reads as a transport error.
        match e {
            arrow_flight::error::FlightError::Tonic(status) => Failure::from(*status),
            other => Failure::Garbage(other.to_string()),
        }
    })?;
    // Flight cuts a block larger than its message size into several batches.
    match batches.len() {
        0 => Err(Failure::Garbage(format!("block {key} came without rows"))),
        1 => Ok(batches.into_iter().next().unwrap()),
        _ => concat_batches(&batches[0].schema(), &batches)
            .map_err(|e| Failure::Garbage(format!("block {key}: {e}"))),
    }
}

/// Why a call to a worker failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The worker is gone (connection refused or broken): its blocks are lost.
    Dead(String),
    /// The worker answered with an error (the task itself failed).
    Task(String),
    /// The worker answered with bytes that make no sense.
    Garbage(String),
    /// The task ran past its deadline: the worker is suspect (killed, the task retried).
    Stuck(String),
    /// The driver could not take what the worker sent (e.g. its query was cancelled).
    Driver(DataFusionError),
    /// The worker refused the driver's credential (another cluster's secret).
    Refused(String),
}

impl From<tonic::Status> for Failure {
    fn from(status: tonic::Status) -> Self {
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
                Failure::Dead(status.to_string())
            }
            tonic::Code::Unauthenticated => Failure::Refused(status.message().to_string()),
            _ => Failure::Task(status.message().to_string()),
        }
    }
}

impl Failure {
    /// Whether the call's HTTP/2 stream broke under it (gRPC reports a stream the peer
    /// reset as an internal error, `h2 protocol error: ...`), rather than the worker
    /// answering with an error of the task's own: the task may be tried again.
    pub(crate) fn broke_the_call(&self) -> bool {
        matches!(self, Failure::Task(message) if message.starts_with("h2 protocol error"))
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Dead(e) => write!(f, "worker died: {e}"),
            Failure::Task(e) => write!(f, "{e}"),
            Failure::Garbage(e) => write!(f, "worker sent garbage: {e}"),
            Failure::Stuck(e) => write!(f, "{e}"),
            Failure::Driver(e) => write!(f, "{e}"),
            Failure::Refused(e) => write!(f, "refused: {e}"),
        }
    }
}

/// A peer at the returned address that takes one connection, resets its first call's
/// HTTP/2 stream with PROTOCOL_ERROR (which gRPC reports as an internal error, not as a
/// dead peer) and then goes away: as a killed worker's call can look, and as a call seen
/// under lost blocks with the worker alive did.
#[cfg(test)]
pub(crate) async fn peer_resetting_one_call() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let peer = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        drop(listener);
        let mut connection = h2::server::handshake(socket).await.unwrap();
        let (_request, mut respond) = connection.accept().await.unwrap().unwrap();
        respond.send_reset(h2::Reason::PROTOCOL_ERROR);
        // Drive the connection until the reset is out and the client is done with it.
        let _ =
            tokio::time::timeout(std::time::Duration::from_millis(500), connection.accept()).await;
    });
    (address, peer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::auth::Secret;

    #[tokio::test]
    async fn a_call_whose_stream_the_peer_reset_broke_and_may_be_tried_again() {
        let (address, peer) = peer_resetting_one_call().await;
        let client = connect(&address, None, &Secret::random()).await.unwrap();
        let failure = read_status(&client).await.unwrap_err();
        peer.await.unwrap();
        assert!(failure.broke_the_call(), "{failure}");
        assert!(!Failure::Task("Arrow error: Cast error".into()).broke_the_call());
    }
}
