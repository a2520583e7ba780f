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
    write_table_with(path, batches, None)
}

/// Write `batches` to `path` (through a temporary file), in row groups of at most
/// `row_group_rows` rows when given.
fn write_table_with(path: &Path, batches: Batches, row_group_rows: Option<usize>) -> Result<()> {
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
    let properties = row_group_rows.map(|rows| {
        datafusion::parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(rows))
            .build()
    });
    let mut writer = ArrowWriter::try_new(std::fs::File::create(&tmp)?, schema, properties)?;
    for batch in batches {
        writer.write(&batch?)?;
    }
    writer.close()?;
    std::fs::rename(tmp, path)?;
    Ok(())
}

/// The rows of part `part` of `parts` (from 1) of TPC-H table `table` at scale factor `sf`.
fn table_part(table: &str, sf: f64, part: i32, parts: i32) -> Batches {
    match table {
        "nation" => Box::new(NationArrow::new(NationGenerator::new(sf, part, parts))),
        "region" => Box::new(RegionArrow::new(RegionGenerator::new(sf, part, parts))),
        "part" => Box::new(PartArrow::new(PartGenerator::new(sf, part, parts))),
        "supplier" => Box::new(SupplierArrow::new(SupplierGenerator::new(sf, part, parts))),
        "partsupp" => Box::new(PartSuppArrow::new(PartSuppGenerator::new(sf, part, parts))),
        "customer" => Box::new(CustomerArrow::new(CustomerGenerator::new(sf, part, parts))),
        "orders" => Box::new(OrderArrow::new(OrderGenerator::new(sf, part, parts))),
        _ => Box::new(LineItemArrow::new(LineItemGenerator::new(sf, part, parts))),
    }
}

/// Write each TPC-H table at scale factor `sf` as a directory `dir/<table>/` of `parts`
/// Parquet files (one file for the two tables too small to part: nation and region), in
/// row groups of `row_group_rows` rows, unless there. Register them with [`register`].
// The tests' TPC-H (`tests/common/tpch.rs`) uses it; the tpch bench reads one file a table.
#[allow(dead_code)]
pub fn generate_parts(dir: &Path, sf: f64, parts: i32, row_group_rows: usize) -> Result<()> {
    for table in TABLES {
        let table_dir = dir.join(table);
        if table_dir.exists() {
            continue;
        }
        let staging = dir.join(format!("{table}.tmp"));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging)?;
        let parts = if matches!(*table, "nation" | "region") {
            1
        } else {
            parts
        };
        for part in 1..=parts {
            let path = staging.join(format!("part-{part}.parquet"));
            let batches = table_part(table, sf, part, parts);
            write_table_with(&path, batches, Some(row_group_rows))?;
        }
        std::fs::rename(&staging, &table_dir)?;
    }
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
        let batches = table_part(table, sf, 1, 1);
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

/// Register the tables under `dir` in `ctx` by their names (files from [`generate`], or
/// directories from [`generate_parts`]).
pub async fn register(ctx: &SessionContext, dir: &Path) -> Result<()> {
    for table in TABLES {
        let path = match dir.join(table) {
            parts if parts.is_dir() => format!("{}/", parts.display()),
            _ => dir.join(format!("{table}.parquet")).display().to_string(),
        };
        ctx.register_parquet(*table, &path, ParquetReadOptions::default())
            .await?;
    }
    Ok(())
}
