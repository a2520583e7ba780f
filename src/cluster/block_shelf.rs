//! The blocks a worker keeps for its driver, each under the query that owns it, until the
//! driver fetches or releases them. Keys are 128 random bits: only a caller told a key by
//! the driver can name a block, and only with the owning query's token.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};

use crate::cluster::auth::Secret;
use crate::cluster::protocol::{BlockTicket, ReleaseRequest};

/// How many ended queries a worker remembers.
const ENDED_QUERIES_KEPT: usize = 4096;

/// A block a worker keeps, and the query it belongs to.
struct KeptBlock {
    query: String,
    batch: RecordBatch,
}

/// A worker's kept blocks, by key.
#[derive(Default)]
pub(crate) struct BlockShelf {
    blocks: Mutex<HashMap<String, KeptBlock>>,
    /// Queries whose blocks were all released (the query ended): blocks their tasks still
    /// cut afterwards are refused. The most recent [`ENDED_QUERIES_KEPT`].
    ended: Mutex<VecDeque<String>>,
}

impl BlockShelf {
    /// Keep `batch` for `query`; its new key. Refused when the query has ended.
    pub(crate) fn keep(&self, query: &str, batch: RecordBatch) -> Result<String> {
        let mut blocks = self.blocks.lock().unwrap();
        if self.ended.lock().unwrap().iter().any(|q| q == query) {
            return Err(DataFusionError::Execution(
                "the task's query has ended; its blocks were dropped".into(),
            ));
        }
        let key = random_key();
        let kept = KeptBlock {
            query: query.to_string(),
            batch,
        };
        blocks.insert(key.clone(), kept);
        Ok(key)
    }

    /// The block `ticket` names, if its query owns it: removed unless the ticket says keep.
    pub(crate) fn take(&self, ticket: &BlockTicket) -> Option<RecordBatch> {
        let mut blocks = self.blocks.lock().unwrap();
        match blocks.get(&ticket.key) {
            Some(b) if b.query == ticket.query && ticket.keep => Some(b.batch.clone()),
            Some(b) if b.query == ticket.query => blocks.remove(&ticket.key).map(|b| b.batch),
            _ => None,
        }
    }

    /// Drop the listed blocks of a query, or all of them (the query ended) when none is
    /// listed; how many were dropped.
    pub(crate) fn release(&self, request: ReleaseRequest) -> usize {
        let mut blocks = self.blocks.lock().unwrap();
        let before = blocks.len();
        if request.keys.is_empty() {
            blocks.retain(|_, b| b.query != request.query);
            let mut ended = self.ended.lock().unwrap();
            ended.push_back(request.query);
            if ended.len() > ENDED_QUERIES_KEPT {
                ended.pop_front();
            }
        } else {
            for key in request.keys {
                if blocks.get(&key).is_some_and(|b| b.query == request.query) {
                    blocks.remove(&key);
                }
            }
        }
        before - blocks.len()
    }

    /// Blocks kept now.
    pub(crate) fn len(&self) -> usize {
        self.blocks.lock().unwrap().len()
    }
}

/// 128 random bits as hex: a block key nobody can guess.
pub(crate) fn random_key() -> String {
    Secret::random().to_hex()[..32].to_string()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::Int32Array;

    use super::*;

    fn batch() -> RecordBatch {
        RecordBatch::try_from_iter([("x", Arc::new(Int32Array::from(vec![1, 2])) as _)]).unwrap()
    }

    fn ticket(query: &str, key: &str, keep: bool) -> BlockTicket {
        BlockTicket {
            query: query.into(),
            key: key.into(),
            keep,
        }
    }

    #[test]
    fn only_the_owning_query_takes_or_releases_a_block() {
        let shelf = BlockShelf::default();
        let key = shelf.keep("a", batch()).unwrap();
        assert_eq!(key.len(), 32);
        assert!(shelf.take(&ticket("b", &key, false)).is_none());
        let release = |query: &str| ReleaseRequest {
            query: query.into(),
            keys: vec![key.clone()],
        };
        assert_eq!(shelf.release(release("b")), 0);
        assert!(shelf.take(&ticket("a", &key, true)).is_some(), "kept");
        assert_eq!(shelf.len(), 1);
        assert!(shelf.take(&ticket("a", &key, false)).is_some(), "taken");
        assert_eq!(shelf.len(), 0);
    }

    #[test]
    fn an_ended_query_keeps_nothing_more() {
        let shelf = BlockShelf::default();
        shelf.keep("a", batch()).unwrap();
        shelf.keep("b", batch()).unwrap();
        let ended = ReleaseRequest {
            query: "a".into(),
            keys: vec![],
        };
        assert_eq!(shelf.release(ended), 1);
        let refused = shelf.keep("a", batch()).unwrap_err().to_string();
        assert!(refused.contains("has ended"), "{refused}");
        assert_eq!(shelf.len(), 1, "query b's block stays");
    }
}
