//! What a task is: its id within the run, and what it reads ([`TaskKind`]), which is
//! enough to run it again and get the same blocks (lineage).

use crate::store::block::BlockId;

/// Index of a task within one query run.
pub type TaskId = usize;

/// What a task reads: enough to run it again and get the same blocks.
#[derive(Debug, Clone)]
pub enum TaskKind {
    /// Source split `split` of the task's partition.
    Source {
        /// Split index within the partition.
        split: usize,
    },
    /// These input blocks, in order (a block-wise task).
    Blocks {
        /// Input block ids.
        inputs: Vec<BlockId>,
    },
    /// The whole partition of every input (a per-partition task).
    Partition,
    /// One slice of a per-partition task cut because its partition was too large
    /// ([`crate::plan::partition_slices`]): these blocks of input `input` (its join's build
    /// side), and the whole partition of every other input.
    Slice {
        /// The stage input the slice cuts.
        input: usize,
        /// Its blocks of that input, in order.
        blocks: Vec<BlockId>,
    },
}

impl TaskKind {
    /// The source split a source task reads; `None` for any other task.
    pub fn source_split(&self) -> Option<usize> {
        match self {
            TaskKind::Source { split } => Some(*split),
            _ => None,
        }
    }
}
