//! The peer the cluster benches measure flumen against: datafusion-distributed 4 (a
//! published crate on DataFusion 55, as flumen is), its workers serving Arrow Flight over
//! gRPC and its coordinator planning with a static list of worker URLs.
//!
//! Its workers take no credentials (the crate has none); the benches run them only inside
//! the network namespaces of a `TestNet`, which no other host reaches.

use std::net::SocketAddr;

use async_trait::async_trait;
use datafusion::error::DataFusionError;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_distributed::{DistributedExt, SessionStateBuilderExt, Worker, WorkerResolver};

/// Serve a datafusion-distributed worker on `address` until the process is killed.
pub fn serve_worker(address: SocketAddr) -> ! {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime for the peer's worker");
    runtime.block_on(async move {
        println!("peer worker listening on {address}");
        tonic::transport::Server::builder()
            .add_service(Worker::default().into_worker_server())
            .serve(address)
            .await
            .expect("the peer's worker serves");
    });
    std::process::exit(0)
}

/// A static list of the peer's workers (`http://host:port`).
#[derive(Clone)]
struct StaticWorkers(Vec<url::Url>);

#[async_trait]
impl WorkerResolver for StaticWorkers {
    fn get_urls(&self) -> Result<Vec<url::Url>, DataFusionError> {
        Ok(self.0.clone())
    }
}

/// A coordinator session planning over the workers at `addresses`, `partitions` target
/// partitions, the crate's other settings at their defaults.
pub fn coordinator(addresses: &[String], partitions: usize) -> SessionContext {
    let urls = (addresses.iter())
        .map(|a| url::Url::parse(&format!("http://{a}")).expect("a worker address"))
        .collect();
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_config(SessionConfig::new().with_target_partitions(partitions))
        .with_distributed_worker_resolver(StaticWorkers(urls))
        .with_distributed_planner()
        .build();
    SessionContext::from(state)
}
