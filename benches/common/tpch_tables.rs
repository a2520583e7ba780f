//! The TPC-H tables as Parquet (generated with tpchgen, no downloads) and the 22 queries'
//! text (from the answer files shipped with `datafusion-sqllogictest`), for the benches that
//! run TPC-H.

use std::path::{Path, PathBuf};
use std::time::Instant;

use datafusion::arrow::error::ArrowError;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator,
    PartSuppGenerator, RegionGenerator, SupplierGenerator,
};
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow,
    SupplierArrow,
};

type Batches = Box<dyn Iterator<Item = std::result::Result<RecordBatch, ArrowError>>>;

const TABLES: &[&str] = &[
    "nation", "region", "part", "supplier", "partsupp", "customer", "orders", "lineitem",
];

fn write_table(path: &Path, batches: Batches) -> Result<()> {
    let mut batches = batches.peekable();
    let schema = match batches.peek() {
        Some(Ok(batch)) => batch.schema(),
        _ => {
            return Err(datafusion::error::DataFusionError::Execution(format!(
                "tpchgen produced no data for {}",
                path.display()
            )));
        }
    };
    let tmp = path.with_extension("tmp");
    let mut writer = ArrowWriter::try_new(std::fs::File::create(&tmp)?, schema, None)?;
    for batch in batches {
        writer.write(&batch?)?;
    }
    writer.close()?;
    std::fs::rename(tmp, path)?;
    Ok(())
}

/// Write each TPC-H table at scale factor `sf` as `dir/<table>.parquet`, unless there.
pub fn generate(dir: &Path, sf: f64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    for table in TABLES {
        let path = dir.join(format!("{table}.parquet"));
        if path.exists() {
            continue;
        }
        let started = Instant::now();
        let batches: Batches = match *table {
            "nation" => Box::new(NationArrow::new(NationGenerator::new(sf, 1, 1))),
            "region" => Box::new(RegionArrow::new(RegionGenerator::new(sf, 1, 1))),
            "part" => Box::new(PartArrow::new(PartGenerator::new(sf, 1, 1))),
            "supplier" => Box::new(SupplierArrow::new(SupplierGenerator::new(sf, 1, 1))),
            "partsupp" => Box::new(PartSuppArrow::new(PartSuppGenerator::new(sf, 1, 1))),
            "customer" => Box::new(CustomerArrow::new(CustomerGenerator::new(sf, 1, 1))),
            "orders" => Box::new(OrderArrow::new(OrderGenerator::new(sf, 1, 1))),
            _ => Box::new(LineItemArrow::new(LineItemGenerator::new(sf, 1, 1))),
        };
        write_table(&path, batches)?;
        println!(
            "generated {table} in {:.1}s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The statements of TPC-H query `n` from datafusion-sqllogictest's answer files.
pub fn query_statements(slt_dir: &Path, n: usize) -> Vec<String> {
    let text =
        std::fs::read_to_string(slt_dir.join(format!("test_files/tpch/answers/q{n}.slt.part")))
            .expect("read TPC-H query file");
    let mut statements = vec![];
    let mut current: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim();
        if let Some(sql) = current.as_mut() {
            if trimmed == "----" || trimmed.is_empty() {
                statements.push(std::mem::take(sql));
                current = None;
            } else {
                sql.push_str(line);
                sql.push('\n');
            }
        } else if trimmed.starts_with("query ") || trimmed.starts_with("statement ok") {
            current = Some(String::new());
        }
    }
    if let Some(sql) = current
        && !sql.trim().is_empty()
    {
        statements.push(sql);
    }
    statements
}

/// Where cargo unpacked `datafusion-sqllogictest` (a dev-dependency).
pub fn slt_dir() -> PathBuf {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cargo"));
    std::fs::read_dir(cargo_home.join("registry/src"))
        .expect("cargo registry")
        .flatten()
        .map(|d| d.path().join("datafusion-sqllogictest-55.2.0"))
        .find(|p| p.is_dir())
        .expect("datafusion-sqllogictest 55.2.0 sources (a dev-dependency)")
}

/// Register the tables under `dir` in `ctx` by their names.
pub async fn register(ctx: &SessionContext, dir: &Path) -> Result<()> {
    for table in TABLES {
        let path = dir.join(format!("{table}.parquet"));
        ctx.register_parquet(
            *table,
            path.to_str().unwrap(),
            ParquetReadOptions::default(),
        )
        .await?;
    }
    Ok(())
}
