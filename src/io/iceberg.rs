//! Iceberg tables, read by planning the scan from the table's own metadata.
//!
//! The metadata chain is followed by hand: the table metadata JSON (format v1 or v2) names the
//! snapshot, whose manifest list (Avro) names the manifests (Avro), whose live entries are the
//! snapshot's Parquet data files. Those files become an ordinary DataFusion Parquet scan
//! (a `ListingTable` over exactly those files), so flumen's planner cuts it into deterministic
//! byte-range source splits like any Parquet scan, and a lost block re-reads the same row groups.
//!
//! Not supported yet, each with a clear error: row-level deletes (position or equality delete
//! files), data files that are not Parquet, and format versions other than 1 and 2.

use std::sync::Arc;

use apache_avro::types::Value as Avro;
use async_trait::async_trait;
use datafusion::arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef, TimeUnit};
use datafusion::catalog::{Session, TableProvider, TableProviderFactory};
use datafusion::datasource::empty::EmptyTable;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::CreateExternalTable;
use object_store::{ObjectStore, ObjectStoreExt};
use serde_json::Value as Json;

use crate::io::lakehouse_options::{self, time_travel, timestamp_option};
use crate::io::object_stores;

/// Which snapshot of an Iceberg table to read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IcebergSnapshot {
    /// The table's current snapshot.
    #[default]
    Current,
    /// The snapshot with this id.
    Id(i64),
    /// The newest snapshot committed at or before this time (milliseconds since the epoch).
    AsOfMillis(i64),
}

/// `CREATE EXTERNAL TABLE t STORED AS ICEBERG LOCATION '...'`: LOCATION is the table directory
/// (holding `metadata/`) or one `*.metadata.json` file. OPTIONS: `'snapshot_id' 'N'` or
/// `'timestamp' '2026-01-01T00:00:00Z'` (time travel), plus `aws.*`/`gcp.*`/`azure.*` store
/// settings.
#[derive(Debug, Default)]
pub struct IcebergTableFactory;

#[async_trait]
impl TableProviderFactory for IcebergTableFactory {
    async fn create(
        &self,
        state: &dyn Session,
        cmd: &CreateExternalTable,
    ) -> Result<Arc<dyn TableProvider>> {
        let (location, options) = lakehouse_options::prepare(state, cmd)?;
        let table = format!("Iceberg table {location}");
        let snapshot = match time_travel(cmd, &table, ["snapshot_id", "timestamp"])? {
            Some(("snapshot_id", id)) => IcebergSnapshot::Id(id.parse().map_err(|_| {
                DataFusionError::Plan(format!("{table}: snapshot_id '{id}' is not a number"))
            })?),
            Some((_, at)) => IcebergSnapshot::AsOfMillis(timestamp_option(&table, at)?),
            None => IcebergSnapshot::Current,
        };
        iceberg_table(state, location, snapshot)
            .await
            .map_err(|e| object_stores::with_credentials_hint(e, location, &options))
    }
}

/// The Iceberg table at `location` (a table directory or a metadata JSON file), at `snapshot`,
/// as a table provider whose scan is an ordinary Parquet scan of the snapshot's data files.
/// The location's object store must be registered in the session (local paths always are).
pub async fn iceberg_table(
    state: &dyn Session,
    location: &str,
    snapshot: IcebergSnapshot,
) -> Result<Arc<dyn TableProvider>> {
    let table = IcebergMetadata::load(state, location).await?;
    let schema = table.arrow_schema()?;
    let Some(snapshot) = table.snapshot(snapshot)? else {
        return Ok(Arc::new(EmptyTable::new(schema)));
    };
    let files = table.data_files(state, snapshot).await?;
    if files.is_empty() {
        return Ok(Arc::new(EmptyTable::new(schema)));
    }
    let paths = files
        .iter()
        .map(ListingTableUrl::parse)
        .collect::<Result<Vec<_>>>()?;
    let format = ParquetFormat::default().with_options(state.table_options().parquet.clone());
    let options = ListingOptions::new(Arc::new(format)).with_file_extension("");
    let config = ListingTableConfig::new_with_multi_paths(paths)
        .with_listing_options(options)
        .with_schema(schema);
    Ok(Arc::new(ListingTable::try_new(config)?))
}

/// A parsed table metadata file and where it came from.
struct IcebergMetadata {
    location: String,
    json: Json,
}

impl IcebergMetadata {
    /// Find and parse the table's newest metadata file.
    async fn load(state: &dyn Session, location: &str) -> Result<Self> {
        let not_a_table = |why: String| {
            DataFusionError::Plan(format!("{location} is not an Iceberg table: {why}"))
        };
        let (store, metadata_path) = if location.ends_with(".metadata.json") {
            let url = ListingTableUrl::parse(location)?;
            (store_of(state, &url)?, url.prefix().clone())
        } else {
            let dir = format!("{}/metadata/", location.trim_end_matches('/'));
            let url = ListingTableUrl::parse(&dir)?;
            let store = store_of(state, &url)?;
            let newest = newest_metadata_file(store.as_ref(), url.prefix())
                .await
                .map_err(|e| not_a_table(format!("cannot list {dir}: {e}")))?
                .ok_or_else(|| not_a_table(format!("no *.metadata.json under {dir}")))?;
            (store, newest)
        };
        let bytes = read(store.as_ref(), &metadata_path)
            .await
            .map_err(|e| not_a_table(format!("cannot read metadata file {metadata_path}: {e}")))?;
        let json: Json = serde_json::from_slice(&bytes)
            .map_err(|e| not_a_table(format!("metadata file {metadata_path} is not JSON: {e}")))?;
        match json.get("format-version").and_then(Json::as_i64) {
            Some(1 | 2) => {}
            Some(other) => {
                return Err(DataFusionError::NotImplemented(format!(
                    "Iceberg table {location}: format version {other} is not supported \
                     (flumen reads versions 1 and 2)"
                )));
            }
            None => {
                return Err(not_a_table(format!(
                    "{metadata_path} has no format-version"
                )));
            }
        }
        Ok(Self {
            location: location.to_string(),
            json,
        })
    }

    fn error(&self, why: impl std::fmt::Display) -> DataFusionError {
        DataFusionError::Plan(format!("Iceberg table {}: {why}", self.location))
    }

    /// The current schema as Arrow.
    fn arrow_schema(&self) -> Result<SchemaRef> {
        let current = self.json.get("current-schema-id").and_then(Json::as_i64);
        let schema = self
            .json
            .get("schemas")
            .and_then(Json::as_array)
            .and_then(|schemas| {
                schemas
                    .iter()
                    .find(|s| s.get("schema-id").and_then(Json::as_i64) == current)
            })
            .or_else(|| self.json.get("schema"))
            .ok_or_else(|| self.error("metadata has no current schema"))?;
        let fields = struct_fields(schema).map_err(|e| self.error(e))?;
        Ok(Arc::new(Schema::new(fields)))
    }

    /// The chosen snapshot's JSON; `None` for a table without snapshots.
    fn snapshot(&self, which: IcebergSnapshot) -> Result<Option<&Json>> {
        let snapshots = self
            .json
            .get("snapshots")
            .and_then(Json::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let by_id = |id: i64| {
            snapshots
                .iter()
                .find(|s| s.get("snapshot-id").and_then(Json::as_i64) == Some(id))
        };
        match which {
            IcebergSnapshot::Current => {
                let current = self.json.get("current-snapshot-id").and_then(Json::as_i64);
                match current {
                    None | Some(-1) => Ok(None),
                    Some(id) => by_id(id)
                        .map(Some)
                        .ok_or_else(|| self.error(format!("current snapshot {id} is missing"))),
                }
            }
            IcebergSnapshot::Id(id) => by_id(id)
                .map(Some)
                .ok_or_else(|| self.error(format!("no snapshot with id {id}"))),
            IcebergSnapshot::AsOfMillis(at) => {
                // The snapshot log holds the main branch's history in commit order.
                let log = self
                    .json
                    .get("snapshot-log")
                    .and_then(Json::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let id = log
                    .iter()
                    .filter(|e| e.get("timestamp-ms").and_then(Json::as_i64) <= Some(at))
                    .filter_map(|e| e.get("snapshot-id").and_then(Json::as_i64))
                    .next_back()
                    .ok_or_else(|| {
                        self.error(format!("no snapshot at or before timestamp {at} ms"))
                    })?;
                by_id(id).map(Some).ok_or_else(|| {
                    self.error(format!("snapshot {id} from the snapshot log is missing"))
                })
            }
        }
    }

    /// The live Parquet data files of `snapshot`, as locations.
    async fn data_files(&self, state: &dyn Session, snapshot: &Json) -> Result<Vec<String>> {
        let manifests: Vec<(String, i32)> =
            if let Some(list) = snapshot.get("manifest-list").and_then(Json::as_str) {
                let records = self.read_avro(state, list).await?;
                records
                    .iter()
                    .map(|r| {
                        let path = string_field(r, "manifest_path").ok_or_else(|| {
                            self.error(format!("{list}: entry without manifest_path"))
                        })?;
                        // v1 manifest lists have no `content`: every manifest holds data files.
                        let content = int_field(r, "content").unwrap_or(0) as i32;
                        Ok((path.to_string(), content))
                    })
                    .collect::<Result<_>>()?
            } else {
                // Format v1 may list the manifests inline.
                snapshot
                    .get("manifests")
                    .and_then(Json::as_array)
                    .ok_or_else(|| self.error("snapshot has neither manifest-list nor manifests"))?
                    .iter()
                    .filter_map(Json::as_str)
                    .map(|p| (p.to_string(), 0))
                    .collect()
            };
        let mut files = vec![];
        for (manifest, content) in manifests {
            for entry in self.read_avro(state, &manifest).await? {
                // status 2 = DELETED: the file is no longer part of the snapshot.
                if int_field(&entry, "status") == Some(2) {
                    continue;
                }
                let data_file = field(&entry, "data_file")
                    .ok_or_else(|| self.error(format!("{manifest}: entry without data_file")))?;
                let file_content = int_field(data_file, "content").unwrap_or(0);
                if content != 0 || file_content != 0 {
                    return Err(DataFusionError::NotImplemented(format!(
                        "Iceberg table {}: the snapshot has row-level delete files ({}), \
                         which flumen cannot apply yet",
                        self.location,
                        string_field(data_file, "file_path").unwrap_or(&manifest)
                    )));
                }
                let path = string_field(data_file, "file_path")
                    .ok_or_else(|| self.error(format!("{manifest}: data file without path")))?;
                let format = string_field(data_file, "file_format").unwrap_or("PARQUET");
                if !format.eq_ignore_ascii_case("parquet") {
                    return Err(DataFusionError::NotImplemented(format!(
                        "Iceberg table {}: data file {path} is {format}; flumen reads Parquet \
                         data files only",
                        self.location
                    )));
                }
                files.push(path.to_string());
            }
        }
        Ok(files)
    }

    /// Every record of the Avro file at `location` (a manifest list or a manifest).
    async fn read_avro(&self, state: &dyn Session, location: &str) -> Result<Vec<Avro>> {
        let url = ListingTableUrl::parse(location)?;
        let store = store_of(state, &url)?;
        let bytes = read(store.as_ref(), url.prefix())
            .await
            .map_err(|e| self.error(format!("cannot read {location}: {e}")))?;
        let reader = apache_avro::Reader::new(&bytes[..])
            .map_err(|e| self.error(format!("{location} is not an Avro file: {e}")))?;
        reader
            .map(|r| r.map_err(|e| self.error(format!("{location}: bad Avro record: {e}"))))
            .collect()
    }
}

/// The session's object store for `url`.
fn store_of(state: &dyn Session, url: &ListingTableUrl) -> Result<Arc<dyn ObjectStore>> {
    state.runtime_env().object_store(url.object_store())
}

async fn read(store: &dyn ObjectStore, path: &object_store::path::Path) -> Result<Vec<u8>> {
    Ok(store.get(path).await?.bytes().await?.to_vec())
}

/// The newest `*.metadata.json` in a `metadata/` directory: the one `version-hint.text` names
/// (Hadoop tables), else the highest leading version number (`00003-<uuid>` or `v3`).
async fn newest_metadata_file(
    store: &dyn ObjectStore,
    dir: &object_store::path::Path,
) -> Result<Option<object_store::path::Path>> {
    use futures::TryStreamExt;
    let hint = dir.clone().join("version-hint.text");
    if let Ok(found) = store.get(&hint).await {
        let text = found.bytes().await?;
        let version = String::from_utf8_lossy(&text).trim().to_string();
        return Ok(Some(
            dir.clone()
                .join(format!("v{version}.metadata.json").as_str()),
        ));
    }
    let listed: Vec<_> = store.list(Some(dir)).try_collect().await?;
    Ok(listed
        .into_iter()
        .filter_map(|meta| {
            let name = meta.location.filename()?.to_string();
            let stem = name.strip_suffix(".metadata.json")?;
            let digits = stem.trim_start_matches('v');
            let digits: String = digits.chars().take_while(char::is_ascii_digit).collect();
            Some((digits.parse::<u64>().ok()?, meta.location))
        })
        .max_by_key(|(version, _)| *version)
        .map(|(_, location)| location))
}

/// A record's field, with `["null", T]` unions unwrapped.
fn field<'a>(record: &'a Avro, name: &str) -> Option<&'a Avro> {
    let Avro::Record(fields) = record else {
        return None;
    };
    let mut value = &fields.iter().find(|(n, _)| n == name)?.1;
    while let Avro::Union(_, inner) = value {
        value = inner;
    }
    (!matches!(value, Avro::Null)).then_some(value)
}

fn int_field(record: &Avro, name: &str) -> Option<i64> {
    match field(record, name)? {
        Avro::Int(v) => Some(i64::from(*v)),
        Avro::Long(v) => Some(*v),
        _ => None,
    }
}

fn string_field<'a>(record: &'a Avro, name: &str) -> Option<&'a str> {
    match field(record, name)? {
        Avro::String(s) => Some(s),
        Avro::Enum(_, s) => Some(s),
        _ => None,
    }
}

/// The Arrow fields of an Iceberg struct type (a schema is one).
fn struct_fields(schema: &Json) -> std::result::Result<Fields, String> {
    let fields = schema
        .get("fields")
        .and_then(Json::as_array)
        .ok_or("struct type without fields")?;
    fields
        .iter()
        .map(|f| {
            let name = f
                .get("name")
                .and_then(Json::as_str)
                .ok_or("field without name")?;
            let required = f.get("required").and_then(Json::as_bool).unwrap_or(false);
            let data_type = arrow_type(f.get("type").ok_or("field without type")?)
                .map_err(|e| format!("column {name}: {e}"))?;
            Ok(Field::new(name, data_type, !required))
        })
        .collect()
}

/// The Arrow type of an Iceberg type (a primitive name or a nested type object).
fn arrow_type(ty: &Json) -> std::result::Result<DataType, String> {
    if let Some(name) = ty.as_str() {
        return primitive_type(name);
    }
    match ty.get("type").and_then(Json::as_str) {
        Some("struct") => Ok(DataType::Struct(struct_fields(ty)?)),
        Some("list") => {
            let element = arrow_type(ty.get("element").ok_or("list without element")?)?;
            let required = ty
                .get("element-required")
                .and_then(Json::as_bool)
                .unwrap_or(false);
            Ok(DataType::List(Arc::new(Field::new(
                "element", element, !required,
            ))))
        }
        Some("map") => {
            let key = arrow_type(ty.get("key").ok_or("map without key")?)?;
            let value = arrow_type(ty.get("value").ok_or("map without value")?)?;
            let required = ty
                .get("value-required")
                .and_then(Json::as_bool)
                .unwrap_or(false);
            let entries = Field::new(
                "key_value",
                DataType::Struct(Fields::from(vec![
                    Field::new("key", key, false),
                    Field::new("value", value, !required),
                ])),
                false,
            );
            Ok(DataType::Map(Arc::new(entries), false))
        }
        _ => Err(format!("unknown Iceberg type {ty}")),
    }
}

fn primitive_type(name: &str) -> std::result::Result<DataType, String> {
    Ok(match name {
        "boolean" => DataType::Boolean,
        "int" => DataType::Int32,
        "long" => DataType::Int64,
        "float" => DataType::Float32,
        "double" => DataType::Float64,
        "date" => DataType::Date32,
        "time" => DataType::Time64(TimeUnit::Microsecond),
        "timestamp" => DataType::Timestamp(TimeUnit::Microsecond, None),
        "timestamptz" => DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into())),
        "timestamp_ns" => DataType::Timestamp(TimeUnit::Nanosecond, None),
        "timestamptz_ns" => DataType::Timestamp(TimeUnit::Nanosecond, Some("+00:00".into())),
        "string" => DataType::Utf8,
        "uuid" => DataType::FixedSizeBinary(16),
        "binary" => DataType::Binary,
        other => {
            if let Some(len) = other
                .strip_prefix("fixed[")
                .and_then(|s| s.strip_suffix(']'))
            {
                let len = len
                    .trim()
                    .parse()
                    .map_err(|_| format!("bad type {other}"))?;
                DataType::FixedSizeBinary(len)
            } else if let Some(args) = other
                .strip_prefix("decimal(")
                .and_then(|s| s.strip_suffix(')'))
            {
                let (p, s) = args.split_once(',').ok_or(format!("bad type {other}"))?;
                let precision = p.trim().parse().map_err(|_| format!("bad type {other}"))?;
                let scale = s.trim().parse().map_err(|_| format!("bad type {other}"))?;
                DataType::Decimal128(precision, scale)
            } else {
                return Err(format!("unknown Iceberg type {other}"));
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iceberg_types_map_to_arrow() {
        let schema: Json = serde_json::json!({
            "type": "struct",
            "fields": [
                {"id": 1, "name": "id", "type": "long", "required": true},
                {"id": 2, "name": "price", "type": "decimal(10, 2)", "required": false},
                {"id": 3, "name": "tags", "required": false,
                 "type": {"type": "list", "element-id": 4, "element": "string",
                          "element-required": true}},
                {"id": 5, "name": "at", "type": "timestamptz", "required": false},
                {"id": 6, "name": "hash", "type": "fixed[16]", "required": false},
            ]
        });
        let fields = struct_fields(&schema).unwrap();
        assert_eq!(fields[0].data_type(), &DataType::Int64);
        assert!(!fields[0].is_nullable());
        assert_eq!(fields[1].data_type(), &DataType::Decimal128(10, 2));
        assert!(matches!(fields[2].data_type(), DataType::List(f) if !f.is_nullable()));
        assert!(matches!(
            fields[3].data_type(),
            DataType::Timestamp(TimeUnit::Microsecond, Some(_))
        ));
        assert_eq!(fields[4].data_type(), &DataType::FixedSizeBinary(16));
        let bad = serde_json::json!({"type": "struct", "fields": [
            {"id": 1, "name": "v", "type": "variant", "required": false}]});
        assert_eq!(
            struct_fields(&bad).unwrap_err(),
            "column v: unknown Iceberg type variant"
        );
    }
}
