//! flumen's SQL functions.
//!
//! - [`accelerator`]: the accelerator UDF interface (model functions run on the accelerator
//!   pool by workers that keep the model loaded).
//! - [`accelerator_devices`]: which GPU each accelerator worker computes on.
//! - [`embedding`]: `embed`, a sentence-embedding model (CPU and CUDA).
//! - [`emulated_accelerator`]: a model that occupies an emulated device (benches, tests).
//! - [`text`]: `clean_text`; [`vector`]: `cosine_similarity`, `dot_product`, `l2_distance`.
//! - [`row_hash`]: `row_hash(seed, value, ...)`, a seeded hash of a row (random shuffles).
//! - [`percentile_cont`]: DataFusion's `percentile_cont`, merging every partial state it is
//!   handed (DataFusion 55's merges the first of a batch only).
//! - [`timestamp_time_zone`]: `to_timestamp` (and its unit forms) whose column results carry
//!   the session's time zone (DataFusion 55's lose it).

pub mod accelerator;
pub mod accelerator_devices;
pub mod embedding;
pub mod emulated_accelerator;
pub mod model_cache;
pub mod percentile_cont;
pub mod row_hash;
pub(crate) mod text;
pub mod timestamp_time_zone;
pub(crate) mod vector;

pub use text::clean_text_udf;
pub use vector::vector_functions;
