//! The training feed, in the model of the tf.data service: a client asks for a **dataset
//! job** over a query (`flumen.create_dataset`, JSON: `name`, `sql`, `epochs`, `consumers`,
//! `batch_rows`, `shuffle_seed`, `shuffle_buffer`), gets one ticket per (epoch, consumer),
//! and its trainers read with plain Flight `DoGet`.
//!
//! - **One block per `DoGet`**, first come first served from the epoch's queue, so a fast
//!   trainer takes more blocks than a slow one. A `DoGet` with an empty result means the
//!   epoch is over for that consumer.
//! - **Acknowledgement by asking again**: a consumer's next `DoGet` acknowledges the block it
//!   got last. A block not acknowledged within [`LEASE`] (the consumer died or hung) goes
//!   back to the queue for the others. A consumer that needs longer with a block renews its
//!   lease (`flumen.renew_dataset_lease`, the ticket's hex as body) while it works on it.
//!   Within an epoch every row reaches exactly one consumer that acknowledged it; a consumer
//!   that dies holding a block may have seen it too (it never acknowledged it).
//! - **Owned by their creator**: a job, its tickets, its listing and its renewals answer its
//!   creating user only (another user's ticket is "unknown"); datasets are named per user,
//!   so two users' datasets of the same name never share a run. A job has at most
//!   [`MAX_TICKETS`] (epochs × consumers) tickets and a shuffle buffer of at most
//!   [`MAX_SHUFFLE_BUFFER`] blocks.
//! - **Sharing**: jobs created with the same dataset name (and the same query) share one run
//!   of its pipeline per epoch: each block of the run goes to every job attached when the
//!   run started (the slowest job holds the run back). A job that asks for an epoch whose
//!   shared run started without it gets a run of its own. `flumen.datasets` reports the
//!   runs per epoch.
//! - **Expiry** (tf.data service's job garbage collection): a job none of whose consumers
//!   has asked for a block for [`JOB_IDLE_LIMIT`] (or the server's `--dataset-job-idle`) is
//!   dropped: its queued blocks are freed, a shared run stops waiting for it, a run no job
//!   reads any more stops, and its tickets answer "unknown dataset job". A dataset with no
//!   job left is dropped too.
//! - **Shuffle**: a seeded block-level shuffle buffer (`shuffle_buffer` blocks, emitted in a
//!   random order drawn from `shuffle_seed` and the epoch); **`batch_rows`**: blocks of that
//!   many rows (the last of an epoch may be shorter).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::arrow::compute::BatchCoalescer;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::physical_plan::execute_stream;
use datafusion::prelude::SessionContext;
use futures::StreamExt;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tonic::Status;

/// A block handed to a consumer and not acknowledged within this long goes to the others.
pub const LEASE: Duration = Duration::from_secs(3);
/// Most tickets (epochs × consumers) one job may have.
pub const MAX_TICKETS: u64 = 10_000;
/// Most blocks a job's shuffle buffer may hold.
pub const MAX_SHUFFLE_BUFFER: usize = 1024;
/// A job none of whose consumers asked for a block for this long is dropped.
pub const JOB_IDLE_LIMIT: Duration = Duration::from_secs(300);
/// Blocks a job's queue holds ahead of its consumers before the run waits.
const QUEUE_BLOCKS: usize = 8;
/// The `Any` type URL of a dataset ticket.
pub const TICKET_TYPE: &str = "type.googleapis.com/flumen.DatasetTicket";

/// What a client asks for (`flumen.create_dataset`'s JSON body).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct DatasetRequest {
    /// The dataset's name: jobs of the same name (and query) share its runs.
    pub name: String,
    /// The query whose rows the dataset is.
    pub sql: String,
    /// Passes over the data.
    #[serde(default = "one")]
    pub epochs: u32,
    /// Trainers reading the job.
    #[serde(default = "one")]
    pub consumers: u32,
    /// Rows per block handed out (default: as the query produces them).
    #[serde(default)]
    pub batch_rows: Option<usize>,
    /// Seed of the block-level shuffle (none: no shuffle).
    #[serde(default)]
    pub shuffle_seed: Option<u64>,
    /// Blocks the shuffle buffer holds.
    #[serde(default = "sixteen")]
    pub shuffle_buffer: usize,
}

fn one() -> u32 {
    1
}

fn sixteen() -> usize {
    16
}

/// What a consumer's ticket names.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DatasetTicket {
    /// The job.
    pub job: String,
    /// Which of its consumers (0-based).
    pub consumer: u32,
    /// Which epoch (0-based).
    pub epoch: u32,
}

/// The answer to `flumen.create_dataset`.
#[derive(Debug, Serialize)]
pub struct JobCreated {
    /// The job's id.
    pub job: String,
    /// Whether it shares an existing dataset's runs.
    pub shared: bool,
    /// One ticket (hex of the Flight ticket's bytes) per epoch and consumer.
    pub tickets: Vec<TicketEntry>,
}

/// One ticket of a job.
#[derive(Debug, Serialize)]
pub struct TicketEntry {
    /// The epoch.
    pub epoch: u32,
    /// The consumer.
    pub consumer: u32,
    /// The Flight ticket's bytes, hex.
    pub ticket: String,
}

/// One epoch's blocks for one job.
struct EpochQueue {
    state: Mutex<QueueState>,
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct QueueState {
    schema: Option<SchemaRef>,
    ready: VecDeque<RecordBatch>,
    /// Per consumer: the block it holds unacknowledged, since when.
    in_flight: HashMap<u32, (RecordBatch, Instant)>,
    /// Per consumer: blocks and rows it acknowledged.
    acknowledged: HashMap<u32, (u64, u64)>,
    requeued: u64,
    producer_done: bool,
    error: Option<String>,
}

impl EpochQueue {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::default(),
            changed: tokio::sync::Notify::new(),
        })
    }

    fn notify(&self) {
        self.changed.notify_waiters();
    }
}

/// A dataset: its query and options, the jobs reading it, the runs of its pipeline.
struct Dataset {
    request: DatasetRequest,
    ctx: SessionContext,
    jobs: Mutex<Vec<Arc<Job>>>,
    /// Runs of the pipeline started, per epoch.
    runs: Mutex<HashMap<u32, u32>>,
}

/// A job: its owner, its consumers and, per epoch, its queue.
struct Job {
    id: String,
    /// The user who created it: the only one its tickets answer.
    owner: String,
    consumers: u32,
    epochs: u32,
    queues: Mutex<HashMap<u32, Arc<EpochQueue>>>,
    /// When a consumer last asked for a block (or the job was created).
    last_asked: Mutex<Instant>,
    /// Dropped for idleness: runs no longer feed it.
    expired: AtomicBool,
}

impl Job {
    /// A consumer is asking now.
    fn touch(&self) {
        *self.last_asked.lock().unwrap() = Instant::now();
    }

    /// How long since a consumer last asked.
    fn idle(&self) -> Duration {
        self.last_asked.lock().unwrap().elapsed()
    }

    /// Drop the job: free its queued blocks and let the runs feeding it go on without it.
    fn expire(&self) {
        self.expired.store(true, Ordering::Relaxed);
        for queue in self.queues.lock().unwrap().values() {
            let mut st = queue.state.lock().unwrap();
            st.ready.clear();
            st.in_flight.clear();
            drop(st);
            queue.notify();
        }
    }

    fn is_expired(&self) -> bool {
        self.expired.load(Ordering::Relaxed)
    }
}

/// One job's queue for the epoch a run produces.
struct Feed {
    job: Arc<Job>,
    queue: Arc<EpochQueue>,
}

/// The datasets and jobs of a server.
pub struct Datasets {
    /// By (owner, name).
    by_name: Mutex<HashMap<(String, String), Arc<Dataset>>>,
    jobs: Mutex<HashMap<String, JobOfDataset>>,
    /// Jobs idle longer than this are dropped.
    idle_limit: Duration,
    /// A block held unacknowledged and unrenewed this long goes to the other consumers.
    lease: Duration,
}

impl Default for Datasets {
    fn default() -> Self {
        Self::new(JOB_IDLE_LIMIT)
    }
}

/// A job and the dataset it reads.
type JobOfDataset = (Arc<Dataset>, Arc<Job>);

/// What `flumen.datasets` reports of one dataset (as JSON; the REPL's `\jobs` reads it back).
#[derive(Debug, Serialize, Deserialize)]
pub struct DatasetReport {
    /// The dataset's name.
    pub name: String,
    /// Runs of its pipeline per epoch.
    pub runs_per_epoch: BTreeMap<u32, u32>,
    /// Per job: per epoch, per consumer, blocks and rows acknowledged, and blocks requeued.
    pub jobs: Vec<JobReport>,
}

/// One job in a [`DatasetReport`].
#[derive(Debug, Serialize, Deserialize)]
pub struct JobReport {
    /// The job's id.
    pub job: String,
    /// Per epoch: consumer → (blocks, rows) acknowledged.
    pub acknowledged: BTreeMap<u32, BTreeMap<u32, (u64, u64)>>,
    /// Per epoch: blocks that went back to the queue after their lease ran out.
    pub requeued: BTreeMap<u32, u64>,
    /// Seconds since a consumer last asked for a block.
    pub idle_seconds: f64,
}

impl Datasets {
    /// No datasets; jobs idle longer than `idle_limit` are dropped.
    pub fn new(idle_limit: Duration) -> Self {
        Self {
            by_name: Mutex::default(),
            jobs: Mutex::default(),
            idle_limit,
            lease: LEASE,
        }
    }

    /// Hand a block held unacknowledged and unrenewed for `lease` to the other consumers.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Drop the jobs idle beyond the limit (and datasets left without a job).
    fn sweep(&self) {
        let mut by_name = self.by_name.lock().unwrap();
        let idle: Vec<JobOfDataset> = {
            let mut jobs = self.jobs.lock().unwrap();
            let ids: Vec<String> = jobs
                .iter()
                .filter(|(_, (_, job))| job.is_expired() || job.idle() > self.idle_limit)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| jobs.remove(id)).collect()
        };
        for (dataset, job) in idle {
            log::info!(
                "dataset job {} dropped: no consumer asked for {:.0} s",
                job.id,
                job.idle().as_secs_f64()
            );
            job.expire();
            let mut attached = dataset.jobs.lock().unwrap();
            attached.retain(|j| !Arc::ptr_eq(j, &job));
            if attached.is_empty() {
                by_name.remove(&(job.owner.clone(), dataset.request.name.clone()));
            }
        }
    }

    /// Create a job of user `owner` over `request` on `ctx` (the caller's session), sharing
    /// the owner's dataset of the same name when its query and options match.
    pub fn create_job(
        &self,
        owner: &str,
        ctx: &SessionContext,
        request: DatasetRequest,
    ) -> Result<JobCreated, Status> {
        self.sweep();
        if request.epochs == 0 || request.consumers == 0 {
            return Err(Status::invalid_argument(
                "a dataset job needs at least one epoch and one consumer",
            ));
        }
        if request.batch_rows == Some(0) || request.shuffle_buffer == 0 {
            return Err(Status::invalid_argument(
                "batch_rows and shuffle_buffer must be positive",
            ));
        }
        let tickets = u64::from(request.epochs) * u64::from(request.consumers);
        if tickets > MAX_TICKETS {
            return Err(Status::invalid_argument(format!(
                "a dataset job has at most {MAX_TICKETS} tickets (epochs × consumers), not \
                 {tickets}"
            )));
        }
        if request.shuffle_buffer > MAX_SHUFFLE_BUFFER {
            return Err(Status::invalid_argument(format!(
                "a dataset job's shuffle_buffer holds at most {MAX_SHUFFLE_BUFFER} blocks, not {}",
                request.shuffle_buffer
            )));
        }
        let key = (owner.to_string(), request.name.clone());
        let mut by_name = self.by_name.lock().unwrap();
        let (dataset, shared) = match by_name.get(&key) {
            Some(d) if same_pipeline(&d.request, &request) => (Arc::clone(d), true),
            Some(_) => {
                return Err(Status::already_exists(format!(
                    "dataset {} exists with another query or options",
                    request.name
                )));
            }
            None => {
                let d = Arc::new(Dataset {
                    request: request.clone(),
                    ctx: ctx.clone(),
                    jobs: Mutex::default(),
                    runs: Mutex::default(),
                });
                by_name.insert(key, Arc::clone(&d));
                (d, false)
            }
        };
        let job = Arc::new(Job {
            id: uuid::Uuid::new_v4().simple().to_string(),
            owner: owner.to_string(),
            consumers: request.consumers,
            epochs: request.epochs,
            queues: Mutex::default(),
            last_asked: Mutex::new(Instant::now()),
            expired: AtomicBool::new(false),
        });
        dataset.jobs.lock().unwrap().push(Arc::clone(&job));
        self.jobs
            .lock()
            .unwrap()
            .insert(job.id.clone(), (dataset, Arc::clone(&job)));
        let mut tickets = vec![];
        for epoch in 0..request.epochs {
            for consumer in 0..request.consumers {
                let ticket = DatasetTicket {
                    job: job.id.clone(),
                    consumer,
                    epoch,
                };
                tickets.push(TicketEntry {
                    epoch,
                    consumer,
                    ticket: hex::encode(encode_ticket(&ticket)),
                });
            }
        }
        Ok(JobCreated {
            job: job.id.clone(),
            shared,
            tickets,
        })
    }

    /// User `user`'s job that `ticket` names; another user's job is unknown to it.
    fn job_of(&self, user: &str, ticket: &DatasetTicket) -> Result<JobOfDataset, Status> {
        (self.jobs.lock().unwrap().get(&ticket.job))
            .filter(|(_, job)| job.owner == user)
            .cloned()
            .ok_or_else(|| {
                Status::not_found(format!(
                    "unknown dataset job {} (a job is dropped after {} s without a consumer \
                     asking for a block)",
                    ticket.job,
                    self.idle_limit.as_secs()
                ))
            })
    }

    /// Renew the lease of the block `ticket`'s consumer holds (user `user`'s job): it stays
    /// that consumer's for another lease. `Ok(false)`: the consumer holds no block (it was
    /// acknowledged, or its lease had already run out and it went to the others).
    pub fn renew(&self, user: &str, ticket: &DatasetTicket) -> Result<bool, Status> {
        let (_, job) = self.job_of(user, ticket)?;
        job.touch();
        let queue = job.queues.lock().unwrap().get(&ticket.epoch).cloned();
        let Some(queue) = queue else {
            return Ok(false);
        };
        let mut st = queue.state.lock().unwrap();
        match st.in_flight.get_mut(&ticket.consumer) {
            Some((_, since)) => {
                *since = Instant::now();
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The next block for `ticket`'s consumer (acknowledging the one it got last), or
    /// `Ok((schema, None))` at the end of its epoch; `ticket` must be of a job of user
    /// `user`. Runs the epoch's pipeline on `queries` if it has not started.
    pub async fn next_block(
        &self,
        queries: &tokio::runtime::Handle,
        user: &str,
        ticket: &DatasetTicket,
    ) -> Result<(SchemaRef, Option<RecordBatch>), Status> {
        self.sweep();
        let (dataset, job) = self.job_of(user, ticket)?;
        job.touch();
        if ticket.consumer >= job.consumers || ticket.epoch >= job.epochs {
            return Err(Status::invalid_argument(format!(
                "job {} has consumers 0..{} and epochs 0..{}",
                job.id, job.consumers, job.epochs
            )));
        }
        let queue = start_epoch(&dataset, &job, ticket.epoch, queries, self.idle_limit);
        loop {
            let notified = queue.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // A consumer waiting for a block is not idle.
            job.touch();
            if job.is_expired() {
                return Err(Status::not_found(format!(
                    "dataset job {} was dropped while this consumer waited",
                    job.id
                )));
            }
            {
                let mut st = queue.state.lock().unwrap();
                // Asking again acknowledges the block this consumer holds; consumers
                // waiting for the epoch's end (no block held anywhere) may now see it.
                if let Some((batch, _)) = st.in_flight.remove(&ticket.consumer) {
                    let entry = st.acknowledged.entry(ticket.consumer).or_default();
                    entry.0 += 1;
                    entry.1 += batch.num_rows() as u64;
                    queue.notify();
                }
                // Blocks of consumers gone quiet go back to the queue.
                let expired: Vec<u32> = st
                    .in_flight
                    .iter()
                    .filter(|(_, (_, since))| since.elapsed() >= self.lease)
                    .map(|(c, _)| *c)
                    .collect();
                for consumer in expired {
                    let (batch, _) = st.in_flight.remove(&consumer).expect("listed");
                    st.ready.push_front(batch);
                    st.requeued += 1;
                    log::warn!(
                        "dataset job {}: consumer {consumer} did not acknowledge its block \
                         within {:?}; it goes to the others",
                        job.id,
                        self.lease
                    );
                }
                if let Some(e) = &st.error {
                    return Err(Status::internal(format!("the dataset's query failed: {e}")));
                }
                if let Some(batch) = st.ready.pop_front() {
                    st.in_flight
                        .insert(ticket.consumer, (batch.clone(), Instant::now()));
                    let schema = batch.schema();
                    drop(st);
                    queue.notify();
                    return Ok((schema, Some(batch)));
                }
                if st.producer_done && st.in_flight.is_empty() {
                    let schema = st
                        .schema
                        .clone()
                        .unwrap_or_else(|| Arc::new(datafusion::arrow::datatypes::Schema::empty()));
                    return Ok((schema, None));
                }
            }
            // Wait for a block, the run's end, or a lease to run out.
            let _ = tokio::time::timeout(self.lease / 2, notified).await;
        }
    }

    /// User `user`'s datasets with their runs and its jobs' deliveries.
    pub fn report(&self, user: &str) -> Vec<DatasetReport> {
        self.sweep();
        let datasets: Vec<_> = (self.by_name.lock().unwrap().iter())
            .filter(|((owner, _), _)| owner == user)
            .map(|(_, d)| Arc::clone(d))
            .collect();
        datasets
            .iter()
            .map(|d| DatasetReport {
                name: d.request.name.clone(),
                runs_per_epoch: d.runs.lock().unwrap().clone().into_iter().collect(),
                jobs: d
                    .jobs
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|job| {
                        let queues = job.queues.lock().unwrap();
                        JobReport {
                            job: job.id.clone(),
                            acknowledged: queues
                                .iter()
                                .map(|(e, q)| {
                                    let st = q.state.lock().unwrap();
                                    (*e, st.acknowledged.clone().into_iter().collect())
                                })
                                .collect(),
                            requeued: queues
                                .iter()
                                .map(|(e, q)| (*e, q.state.lock().unwrap().requeued))
                                .collect(),
                            idle_seconds: job.idle().as_secs_f64(),
                        }
                    })
                    .collect(),
            })
            .collect()
    }
}

fn same_pipeline(a: &DatasetRequest, b: &DatasetRequest) -> bool {
    a.sql == b.sql
        && a.batch_rows == b.batch_rows
        && a.shuffle_seed == b.shuffle_seed
        && a.shuffle_buffer == b.shuffle_buffer
}

/// The Flight ticket bytes of `ticket` (a protobuf `Any` with JSON inside).
pub fn encode_ticket(ticket: &DatasetTicket) -> Vec<u8> {
    use prost::Message;
    arrow_flight::sql::Any {
        type_url: TICKET_TYPE.into(),
        value: serde_json::to_vec(ticket)
            .expect("a ticket serializes")
            .into(),
    }
    .encode_to_vec()
}

/// The dataset ticket inside `any`, if it is one.
pub fn decode_ticket(any: &arrow_flight::sql::Any) -> Option<Result<DatasetTicket, Status>> {
    (any.type_url == TICKET_TYPE).then(|| {
        serde_json::from_slice(&any.value)
            .map_err(|e| Status::invalid_argument(format!("not a dataset ticket: {e}")))
    })
}

/// `job`'s queue for `epoch`, starting the epoch's run (shared by every attached job that
/// has no queue for it yet) when there is none.
fn start_epoch(
    dataset: &Arc<Dataset>,
    job: &Arc<Job>,
    epoch: u32,
    queries: &tokio::runtime::Handle,
    idle_limit: Duration,
) -> Arc<EpochQueue> {
    // Lock order: the dataset's jobs, then each job's queues.
    let jobs = dataset.jobs.lock().unwrap();
    if let Some(queue) = job.queues.lock().unwrap().get(&epoch) {
        return Arc::clone(queue);
    }
    let mut feeds = vec![];
    let mut own = None;
    for other in jobs.iter() {
        // A job with fewer epochs would never read this one's blocks.
        if epoch >= other.epochs || other.is_expired() {
            continue;
        }
        let mut queues = other.queues.lock().unwrap();
        if queues.contains_key(&epoch) {
            continue;
        }
        let queue = EpochQueue::new();
        queues.insert(epoch, Arc::clone(&queue));
        if Arc::ptr_eq(other, job) {
            own = Some(Arc::clone(&queue));
        }
        feeds.push(Feed {
            job: Arc::clone(other),
            queue,
        });
    }
    drop(jobs);
    *dataset.runs.lock().unwrap().entry(epoch).or_default() += 1;
    let request = dataset.request.clone();
    let ctx = dataset.ctx.clone();
    queries.spawn(run_epoch(ctx, request, epoch, feeds, idle_limit));
    own.expect("the asking job had no queue")
}

/// Run the dataset's query once for `epoch`, handing each block to every queue of `feeds`.
async fn run_epoch(
    ctx: SessionContext,
    request: DatasetRequest,
    epoch: u32,
    feeds: Vec<Feed>,
    idle_limit: Duration,
) {
    let result = produce(&ctx, &request, epoch, &feeds, idle_limit).await;
    for Feed { queue, .. } in &feeds {
        let mut st = queue.state.lock().unwrap();
        st.producer_done = true;
        if let Err(e) = &result {
            st.error = Some(e.to_string());
        }
        drop(st);
        queue.notify();
    }
}

async fn produce(
    ctx: &SessionContext,
    request: &DatasetRequest,
    epoch: u32,
    feeds: &[Feed],
    idle_limit: Duration,
) -> datafusion::error::Result<()> {
    let frame = crate::session::sql(ctx, &request.sql).await?;
    let task_ctx = Arc::new(frame.task_ctx());
    let plan = frame.create_physical_plan().await?;
    let schema = plan.schema();
    for feed in feeds {
        feed.queue.state.lock().unwrap().schema = Some(Arc::clone(&schema));
    }
    let mut stream = execute_stream(plan, task_ctx)?;
    let mut coalescer = request
        .batch_rows
        .map(|rows| BatchCoalescer::new(Arc::clone(&schema), rows));
    let mut shuffle = request.shuffle_seed.map(|seed| {
        (
            rand::rngs::StdRng::seed_from_u64(seed ^ (u64::from(epoch) << 32)),
            Vec::<RecordBatch>::new(),
        )
    });
    let mut out = vec![];
    loop {
        let next = stream.next().await.transpose()?;
        let finished = next.is_none();
        match (&mut coalescer, next) {
            (Some(c), Some(batch)) => {
                c.push_batch(batch)?;
                while let Some(b) = c.next_completed_batch() {
                    out.push(b);
                }
            }
            (Some(c), None) => {
                c.finish_buffered_batch()?;
                while let Some(b) = c.next_completed_batch() {
                    out.push(b);
                }
            }
            (None, Some(batch)) => out.push(batch),
            (None, None) => {}
        }
        for batch in out.drain(..) {
            if batch.num_rows() == 0 {
                continue;
            }
            match &mut shuffle {
                Some((rng, buffer)) => {
                    buffer.push(batch);
                    if buffer.len() >= request.shuffle_buffer {
                        let pick = rng.random_range(0..buffer.len());
                        let chosen = buffer.swap_remove(pick);
                        if !hand_out(feeds, chosen, idle_limit).await {
                            return Ok(());
                        }
                    }
                }
                None => {
                    if !hand_out(feeds, batch, idle_limit).await {
                        return Ok(());
                    }
                }
            }
        }
        if finished {
            break;
        }
    }
    if let Some((mut rng, mut buffer)) = shuffle {
        buffer.shuffle(&mut rng);
        for batch in buffer {
            if !hand_out(feeds, batch, idle_limit).await {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Put `batch` in every queue, first waiting while any is full (the slowest job sets the
/// pace of a shared run), but not for a job idle beyond `idle_limit`: that one is dropped.
/// Returns false when no job reads the run any more (it should stop).
async fn hand_out(feeds: &[Feed], batch: RecordBatch, idle_limit: Duration) -> bool {
    for Feed { job, queue } in feeds {
        loop {
            if job.is_expired() {
                break;
            }
            let notified = queue.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = queue.state.lock().unwrap();
                if st.ready.len() < QUEUE_BLOCKS {
                    st.ready.push_back(batch.clone());
                    drop(st);
                    queue.notify();
                    break;
                }
            }
            if job.idle() > idle_limit {
                log::info!(
                    "dataset job {}: no consumer asked for {:.0} s; the run goes on without it",
                    job.id,
                    job.idle().as_secs_f64()
                );
                job.expire();
                break;
            }
            let _ = tokio::time::timeout(IDLE_CHECK.min(idle_limit), notified).await;
        }
    }
    feeds.iter().any(|feed| !feed.job.is_expired())
}

/// How often a run waiting on a full queue checks whether its job went idle.
const IDLE_CHECK: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_round_trip_and_requests_take_defaults() {
        let ticket = DatasetTicket {
            job: "j".into(),
            consumer: 1,
            epoch: 2,
        };
        use prost::Message;
        let any = arrow_flight::sql::Any::decode(&*encode_ticket(&ticket)).unwrap();
        assert_eq!(decode_ticket(&any).unwrap().unwrap(), ticket);
        let request: DatasetRequest =
            serde_json::from_str(r#"{"name": "d", "sql": "SELECT 1"}"#).unwrap();
        assert_eq!(
            (request.epochs, request.consumers, request.shuffle_buffer),
            (1, 1, 16)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_consumers_get_every_row_once_per_epoch_and_shared_jobs_run_once() {
        let ctx = crate::session(crate::FlumenConfig::default());
        let datasets = Datasets::default();
        let request: DatasetRequest = serde_json::from_str(
            r#"{"name": "d", "sql": "SELECT value AS id FROM generate_series(1, 10000)",
                "epochs": 2, "consumers": 2, "batch_rows": 300, "shuffle_seed": 7}"#,
        )
        .unwrap();
        let a = datasets.create_job("u", &ctx, request.clone()).unwrap();
        let b = datasets.create_job("u", &ctx, request).unwrap();
        assert!(!a.shared && b.shared);
        let handle = tokio::runtime::Handle::current();
        let datasets = Arc::new(datasets);
        // Every consumer of both jobs reads at once, epoch after epoch, as trainers do.
        let mut readers = vec![];
        for job in [a.job.clone(), b.job.clone()] {
            for consumer in 0..2u32 {
                let (datasets, handle, job) = (Arc::clone(&datasets), handle.clone(), job.clone());
                readers.push(tokio::spawn(async move {
                    let mut per_epoch = vec![];
                    for epoch in 0..2 {
                        let ticket = DatasetTicket {
                            job: job.clone(),
                            consumer,
                            epoch,
                        };
                        let (mut ids, mut firsts) = (vec![], vec![]);
                        while let (_, Some(batch)) =
                            datasets.next_block(&handle, "u", &ticket).await.unwrap()
                        {
                            assert!(batch.num_rows() <= 300);
                            let col = batch
                                .column(0)
                                .as_any()
                                .downcast_ref::<datafusion::arrow::array::Int64Array>()
                                .unwrap();
                            firsts.push(col.value(0));
                            ids.extend(col.values().iter().copied());
                        }
                        per_epoch.push((ids, firsts));
                    }
                    (job, per_epoch)
                }));
            }
        }
        // Per job, per epoch: the ids read and each block's first id.
        type Epochs = Vec<(Vec<i64>, Vec<i64>)>;
        let mut by_job: HashMap<String, Epochs> = HashMap::new();
        for reader in readers {
            let (job, per_epoch) = reader.await.unwrap();
            let entry = by_job
                .entry(job)
                .or_insert_with(|| vec![(vec![], vec![]); 2]);
            for (epoch, (ids, firsts)) in per_epoch.into_iter().enumerate() {
                entry[epoch].0.extend(ids);
                entry[epoch].1.extend(firsts);
            }
        }
        for (job, epochs) in by_job {
            for (epoch, (mut ids, firsts)) in epochs.into_iter().enumerate() {
                assert!(firsts.windows(2).any(|w| w[0] > w[1]) || firsts.len() < 3);
                ids.sort_unstable();
                assert_eq!(
                    ids,
                    (1..=10000).collect::<Vec<i64>>(),
                    "job {job} epoch {epoch}"
                );
            }
        }
        let report = datasets.report("u");
        assert_eq!(report[0].runs_per_epoch.get(&0), Some(&1));
        assert_eq!(report[0].runs_per_epoch.get(&1), Some(&1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sharer_with_fewer_epochs_is_not_fed_the_epochs_it_will_not_read() {
        let ctx = crate::session(crate::FlumenConfig::default());
        let datasets = Datasets::default();
        let request = |epochs: u32| -> DatasetRequest {
            serde_json::from_value(serde_json::json!({
                "name": "d", "sql": "SELECT value AS id FROM generate_series(1, 50000)",
                "epochs": epochs, "batch_rows": 1000
            }))
            .unwrap()
        };
        let long = datasets.create_job("u", &ctx, request(2)).unwrap();
        let short = datasets.create_job("u", &ctx, request(1)).unwrap();
        assert!(short.shared);
        let handle = tokio::runtime::Handle::current();
        let read = |job: &str, epoch: u32| {
            let ticket = DatasetTicket {
                job: job.to_string(),
                consumer: 0,
                epoch,
            };
            let (datasets, handle) = (&datasets, handle.clone());
            async move {
                let mut rows = 0;
                while let (_, Some(batch)) =
                    datasets.next_block(&handle, "u", &ticket).await.unwrap()
                {
                    rows += batch.num_rows();
                }
                rows
            }
        };
        // Both read epoch 0 together; then the long job's epoch 1 (50 blocks) must not wait
        // for the short job, which has no epoch 1.
        let (a, b) = tokio::join!(read(&long.job, 0), read(&short.job, 0));
        assert_eq!((a, b), (50_000, 50_000));
        let second = tokio::time::timeout(Duration::from_secs(30), read(&long.job, 1)).await;
        assert_eq!(second.expect("epoch 1 waited for a job without it"), 50_000);
    }

    fn job_request(json: serde_json::Value) -> DatasetRequest {
        serde_json::from_value(json).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_users_job_is_unknown_and_listings_are_the_owners() {
        let ctx = crate::session(crate::FlumenConfig::default());
        let datasets = Datasets::default();
        let request = job_request(serde_json::json!({
            "name": "d", "sql": "SELECT value AS id FROM generate_series(1, 100)"
        }));
        let anas = datasets.create_job("ana", &ctx, request.clone()).unwrap();
        let ticket = DatasetTicket {
            job: anas.job.clone(),
            consumer: 0,
            epoch: 0,
        };
        let handle = tokio::runtime::Handle::current();
        let err = datasets
            .next_block(&handle, "bo", &ticket)
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
        assert!(datasets.renew("bo", &ticket).is_err());
        assert!(datasets.report("bo").is_empty());
        assert_eq!(datasets.report("ana").len(), 1);
        // Bo's dataset of the same name is its own: no run shared with Ana's.
        let bos = datasets.create_job("bo", &ctx, request).unwrap();
        assert!(!bos.shared);
        assert!(datasets.next_block(&handle, "ana", &ticket).await.is_ok());
    }

    #[test]
    fn oversized_jobs_are_refused() {
        let ctx = crate::session(crate::FlumenConfig::default());
        let datasets = Datasets::default();
        for (json, says) in [
            (
                serde_json::json!({"name": "e", "sql": "SELECT 1", "epochs": 10000, "consumers": 2}),
                "tickets",
            ),
            (
                serde_json::json!({"name": "c", "sql": "SELECT 1", "consumers": 1000000}),
                "tickets",
            ),
            (
                serde_json::json!({"name": "s", "sql": "SELECT 1", "shuffle_buffer": 1000000}),
                "shuffle_buffer",
            ),
        ] {
            let err = datasets
                .create_job("u", &ctx, job_request(json))
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
            assert!(err.message().contains(says), "{err}");
        }
        assert!(datasets.report("u").is_empty());
    }

    /// Two consumers; the first holds its first block for five leases. Renewing its lease
    /// meanwhile, the block stays its own and every id is read exactly once; not renewing,
    /// the block also goes to the other consumer (the case renewal exists for).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_trainer_slower_than_the_lease_keeps_its_block_by_renewing() {
        for renews in [true, false] {
            let lease = Duration::from_millis(200);
            let ctx = crate::session(crate::FlumenConfig::default());
            let datasets = Arc::new(Datasets::default().with_lease(lease));
            let request = job_request(serde_json::json!({
                "name": "d", "sql": "SELECT value AS id FROM generate_series(1, 2000)",
                "consumers": 2, "batch_rows": 100
            }));
            let job = datasets.create_job("u", &ctx, request).unwrap().job;
            let ticket = |consumer| DatasetTicket {
                job: job.clone(),
                consumer,
                epoch: 0,
            };
            let handle = tokio::runtime::Handle::current();
            let ids = |batch: &RecordBatch| {
                let col = batch.column(0).as_any();
                let col = col
                    .downcast_ref::<datafusion::arrow::array::Int64Array>()
                    .unwrap();
                col.values().to_vec()
            };
            let (slow, fast) = (ticket(0), ticket(1));
            let mut read = vec![];
            let (_, first) = datasets.next_block(&handle, "u", &slow).await.unwrap();
            read.extend(ids(&first.unwrap()));
            let other = {
                let (datasets, handle, fast) =
                    (Arc::clone(&datasets), handle.clone(), fast.clone());
                tokio::spawn(async move {
                    let mut read = vec![];
                    while let (_, Some(batch)) =
                        datasets.next_block(&handle, "u", &fast).await.unwrap()
                    {
                        read.extend(ids(&batch));
                    }
                    read
                })
            };
            let held_until = Instant::now() + lease * 5;
            while Instant::now() < held_until {
                if renews {
                    assert!(datasets.renew("u", &slow).unwrap());
                }
                tokio::time::sleep(lease / 4).await;
            }
            while let (_, Some(batch)) = datasets.next_block(&handle, "u", &slow).await.unwrap() {
                read.extend(ids(&batch));
            }
            read.extend(other.await.unwrap());
            read.sort_unstable();
            let once: Vec<i64> = (1..=2000).collect();
            match renews {
                true => assert_eq!(read, once, "renewing, a row was read twice or never"),
                false => assert!(
                    read.len() > 2000,
                    "not renewing, the block went to nobody else"
                ),
            }
        }
    }
}
