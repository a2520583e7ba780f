//! Planning: DataFusion's optimized physical plan cut into flumen operators.
//!
//! - [`graph`]: the operator graph (operators, pools, task shapes, who feeds whom).
//! - [`cut`]: the cutting algorithm that turns a DataFusion plan into that graph.
//! - [`exchange_sizing`]: how many partitions hash exchanges get, from bytes and budget.
//! - [`split_source`]: source scans cut into splits (one task each).
//! - [`stage_input`]: the leaf through which a fragment reads its producer's blocks.
//! - [`accelerator_projection`]: model UDF projections kept apart as accelerator operators.
//! - [`random_shuffle`]: `ORDER BY random()` planned as a seeded random shuffle.

pub(crate) mod accelerator_projection;
pub(crate) mod cut;
pub mod exchange_sizing;
pub(crate) mod graph;
pub mod random_shuffle;
pub(crate) mod split_source;
pub(crate) mod stage_input;

pub use graph::{Operator, OperatorGraph, OperatorId, Pool, TaskShape};
