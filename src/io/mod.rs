//! Where tables come from and where output goes.
//!
//! - [`object_stores`]: S3, GCS, Azure and HTTP stores for the locations a statement names.
//! - [`flight_data`]: batches as Arrow Flight data, each column with the type it has.
//! - [`output_commit`]: file sinks write to staging and commit atomically.
//! - [`delta`], [`iceberg`]: the lakehouse table formats (`STORED AS DELTATABLE|ICEBERG`;
//!   Delta with the cargo feature `delta`, on by default).
//! - [`delta_insert`]: `INSERT INTO` a Delta table: idempotent with an app transaction, no
//!   orphan files when it fails.
//! - [`delta_changes`]: `table_changes(...)`, a Delta table's change data feed.
//! - [`lakehouse_options`]: the options both formats share.
//! - [`table_locations`]: the locations a statement reads as tables (quoted paths, file
//!   functions' arguments, `LOCATION`s).
//! - [`url_tables`]: why a quoted path or URL could not be read as a table (no file there,
//!   files that disagree on a column's type).
//! - [`file_functions`]: `read_parquet(path)`, `read_csv(path)`, ...: files read as a table
//!   by a function of their format, and the locations a statement hands such functions.
//! - [`glob_function`]: `glob(pattern)`, the files a pattern names.
//! - [`parquet_metadata`]: `parquet_metadata(path)`, a Parquet footer's row groups and
//!   statistics as rows.
//! - [`planning_reads`]: the async reads a table function makes while it is planned.

#[cfg(feature = "delta")]
pub(crate) mod delta;
#[cfg(feature = "delta")]
pub(crate) mod delta_changes;
#[cfg(feature = "delta")]
pub(crate) mod delta_insert;
pub mod file_functions;
pub mod flight_data;
pub(crate) mod glob_function;
pub(crate) mod iceberg;
pub(crate) mod lakehouse_options;
pub(crate) mod object_stores;
pub mod output_commit;
pub(crate) mod parquet_metadata;
pub(crate) mod planning_reads;
pub mod table_locations;
pub mod url_tables;

#[cfg(feature = "delta")]
pub use delta::{
    DeltaTableFactory, DeltaTableProvider, DeltaVersion, delta_table, register_delta_table,
};
#[cfg(feature = "delta")]
pub use delta_changes::TableChanges;
pub use file_functions::register_file_functions;
pub use glob_function::Glob;
pub use iceberg::{IcebergTableFactory, iceberg_table};
pub use object_stores::{register_for_location, register_for_statement};
pub use parquet_metadata::ParquetMetadata;
