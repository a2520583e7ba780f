//! The demo `docs` table of the REPL (`flumen::demo`): registered at start-up, written to the
//! cache dir on its first scan, so starting the REPL costs nothing.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{Session, TableProvider};
use datafusion::datasource::TableType;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::error::Result;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use tokio::sync::OnceCell;

/// The demo table: a Parquet listing table over a file made on first use.
#[derive(Debug)]
pub struct DemoTable {
    path: PathBuf,
    rows: usize,
    table: OnceCell<Arc<ListingTable>>,
}

impl DemoTable {
    /// The demo table of `rows` rows, kept at `flumen::demo::default_path(rows)`.
    pub fn new(rows: usize) -> Self {
        Self {
            path: flumen::demo::default_path(rows),
            rows,
            table: OnceCell::new(),
        }
    }

    async fn table(&self) -> Result<&Arc<ListingTable>> {
        self.table
            .get_or_try_init(|| async {
                if !self.path.exists() {
                    eprintln!(
                        "generating the demo table docs ({} rows) in {}",
                        self.rows,
                        self.path.display()
                    );
                    let (path, rows) = (self.path.clone(), self.rows);
                    tokio::task::spawn_blocking(move || flumen::demo::ensure_docs(&path, rows))
                        .await
                        .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))??;
                }
                let url = ListingTableUrl::parse(self.path.to_string_lossy())?;
                let options = ListingOptions::new(Arc::new(ParquetFormat::default()))
                    .with_file_extension(".parquet");
                let config = ListingTableConfig::new(url)
                    .with_listing_options(options)
                    .with_schema(flumen::demo::docs_schema());
                Ok(Arc::new(ListingTable::try_new(config)?))
            })
            .await
    }
}

#[async_trait]
impl TableProvider for DemoTable {
    fn schema(&self) -> SchemaRef {
        flumen::demo::docs_schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.table()
            .await?
            .scan(state, projection, filters, limit)
            .await
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }
}
