"""Write the lakehouse test tables with the ecosystem's own writers.

Delta tables are written by the `deltalake` Python package, Iceberg tables by `pyiceberg`
(a SQL catalog in SQLite). Each table is then read back by the same package's own reader,
and what it reads (row count, sums, per-version or per-snapshot) is written to
`expected.json`, which flumen's tests compare against.

    python make_tables.py ROOT EXPECTED_JSON [--s3-endpoint URL]

ROOT is a local directory or an `s3://bucket/prefix` URI (with --s3-endpoint pointing at an
S3-compatible server, e.g. moto on 127.0.0.1).
"""

import argparse
import datetime
import json
import os
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc

TOPICS = ["news", "sport", "science", "art"]


def docs(start, stop):
    """Rows id in [start, stop): the same columns in every table."""
    ids = list(range(start, stop))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "topic": pa.array([TOPICS[i % 4] for i in ids], pa.string()),
            "body": pa.array([f"document {i} about {TOPICS[i % 4]}" for i in ids], pa.string()),
            "score": pa.array([i * 0.5 for i in ids], pa.float64()),
            "day": pa.array(
                [datetime.date(2026, 1, 1) + datetime.timedelta(days=i % 5) for i in ids],
                pa.date32(),
            ),
        }
    )


def with_lang(table):
    """`table` with a `lang` column added (schema evolution: older rows lack it)."""
    langs = [["en", "de", "fr"][i % 3] for i in table["id"].to_pylist()]
    return table.append_column("lang", pa.array(langs, pa.string()))


def lang_summary(table):
    """`summary`, with how many rows have a `lang` (the evolved column)."""
    entry = summary(table)
    entry["lang_count"] = table.num_rows - table["lang"].null_count
    return entry


def summary(table):
    """What a reader saw: the figures flumen's answer must match."""
    return {
        "count": table.num_rows,
        "sum_id": pc.sum(table["id"]).as_py() or 0,
        "sum_score": pc.sum(table["score"]).as_py() or 0.0,
        "max_body": pc.max(table["body"]).as_py(),
    }


def write_delta(root, storage_options):
    from deltalake import DeltaTable, write_deltalake

    location = f"{root}/delta/docs"
    # v0: create, partitioned by topic; v1: append; v2: delete the first 100 ids.
    # Time travel by timestamp resolves against the log files' modification times, which
    # S3 keeps to the second: commits a second apart keep the versions apart there too.
    write_deltalake(location, docs(0, 1000), partition_by=["topic"], mode="overwrite",
                    storage_options=storage_options)
    time.sleep(1.1)
    write_deltalake(location, docs(1000, 1500), partition_by=["topic"], mode="append",
                    storage_options=storage_options)
    time.sleep(1.1)
    DeltaTable(location, storage_options=storage_options).delete("id < 100")
    table = DeltaTable(location, storage_options=storage_options)
    history = {h["version"]: h["timestamp"] for h in table.history()}
    versions = []
    for version in range(table.version() + 1):
        at = DeltaTable(location, version=version, storage_options=storage_options)
        read = at.to_pyarrow_table()
        entry = summary(read)
        entry["version"] = version
        entry["timestamp_ms"] = history[version]
        entry["files"] = len(at.file_uris())
        entry["sport_count"] = read.filter(pc.equal(read["topic"], "sport")).num_rows
        versions.append(entry)

    # Schema evolution and a checkpoint: v0 without `lang`; v1 appends rows with it (the
    # schema merged); a checkpoint of v1; v2 appends more after the checkpoint.
    evolved = f"{root}/delta/evolved"
    write_deltalake(evolved, docs(0, 400), mode="overwrite", storage_options=storage_options)
    write_deltalake(evolved, with_lang(docs(400, 800)), mode="append", schema_mode="merge",
                    storage_options=storage_options)
    DeltaTable(evolved, storage_options=storage_options).create_checkpoint()
    write_deltalake(evolved, with_lang(docs(800, 1000)), mode="append",
                    storage_options=storage_options)
    evolved_read = DeltaTable(evolved, storage_options=storage_options).to_pyarrow_table()

    plain = f"{root}/delta/plain"
    write_deltalake(plain, docs(0, 300), mode="overwrite", storage_options=storage_options)
    plain_read = DeltaTable(plain, storage_options=storage_options).to_pyarrow_table()
    return {
        "docs": {"location": location, "versions": versions},
        "plain": {"location": plain, "versions": [dict(summary(plain_read), version=0)]},
        "evolved": {"location": evolved, "current": lang_summary(evolved_read)},
    }


def write_iceberg(root, catalog_db, s3_endpoint):
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.transforms import IdentityTransform

    properties = {"uri": f"sqlite:///{catalog_db}", "warehouse": f"{root}/iceberg"}
    if s3_endpoint:
        properties.update(
            {
                "s3.endpoint": s3_endpoint,
                "s3.access-key-id": "test",
                "s3.secret-access-key": "test",
                "s3.region": "us-east-1",
            }
        )
    catalog = SqlCatalog("fixtures", **properties)
    catalog.create_namespace_if_not_exists("db")
    schema = docs(0, 1).schema
    out = {}

    # Format v2, partitioned by topic: two appends, then a (copy-on-write) delete.
    v2 = catalog.create_table("db.docs_v2", schema=schema,
                              properties={"format-version": "2"})
    with v2.update_spec() as spec:
        spec.add_field("topic", IdentityTransform(), "topic")
    v2 = catalog.load_table("db.docs_v2")
    v2.append(docs(0, 1000))
    v2.append(docs(1000, 1500))
    v2.delete("id < 100")
    out["docs_v2"] = iceberg_summary(catalog.load_table("db.docs_v2"))

    # Schema evolution: `lang` added after the first append, then rows with it.
    evolved = catalog.create_table("db.evolved", schema=schema,
                                   properties={"format-version": "2"})
    evolved.append(docs(0, 400))
    from pyiceberg.types import StringType
    with evolved.update_schema() as update:
        update.add_column("lang", StringType())
    evolved = catalog.load_table("db.evolved")
    evolved.append(with_lang(docs(400, 800)))
    evolved = catalog.load_table("db.evolved")
    out["evolved"] = {
        "location": evolved.location(),
        "current": lang_summary(evolved.scan().to_arrow()),
    }

    # Format v1, unpartitioned, one append.
    v1 = catalog.create_table("db.docs_v1", schema=schema, properties={"format-version": "1"})
    v1.append(docs(0, 700))
    out["docs_v1"] = iceberg_summary(catalog.load_table("db.docs_v1"))
    return out


def iceberg_summary(table):
    snapshots = []
    for snapshot in table.snapshots():
        read = table.scan(snapshot_id=snapshot.snapshot_id).to_arrow()
        entry = summary(read)
        entry["snapshot_id"] = snapshot.snapshot_id
        entry["sport_count"] = read.filter(pc.equal(read["topic"], "sport")).num_rows
        snapshots.append(entry)
    return {
        "location": table.location(),
        "metadata": table.metadata_location,
        "format_version": table.format_version,
        "snapshots": snapshots,
        "current": summary(table.scan().to_arrow()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("expected")
    parser.add_argument("--s3-endpoint")
    args = parser.parse_args()
    root = args.root.rstrip("/")
    storage_options = None
    if args.s3_endpoint:
        os.environ.update(
            {
                "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        )
        storage_options = {
            "AWS_ENDPOINT_URL": args.s3_endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_S3_ALLOW_UNSAFE_RENAME": "true",
        }
    else:
        os.makedirs(root, exist_ok=True)
    expected_dir = os.path.dirname(os.path.abspath(args.expected))
    catalog_db = os.path.join(expected_dir, "iceberg-catalog.db")
    if os.path.exists(catalog_db):
        os.remove(catalog_db)
    expected = {
        "delta": write_delta(root, storage_options),
        "iceberg": write_iceberg(root, catalog_db, args.s3_endpoint),
    }
    with open(args.expected, "w") as f:
        json.dump(expected, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
