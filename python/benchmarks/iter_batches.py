"""Rows per second that a Python consumer gets from flumen's `iter_batches` against
`pyarrow.dataset` scanning the same Parquet file, in the same run (figures in
`docs/benchmarks.md`).

    python python/benchmarks/iter_batches.py [--rows 5000000] [--repeat 3]

Needs the module built in release (`pip install ./python`, or `maturin develop --release`
in python/). The baseline reads the columns with pyarrow.dataset (`to_batches`); flumen
runs a SQL transform over the same file (a filter and two computed columns) while it feeds
the consumer. The consumer touches every batch (sums a column with pyarrow.compute), as a
data loader would. Goal: flumen's rate at least 0.8x pyarrow's.
"""

import argparse
import os
import tempfile
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

import flumen


def write_table(path, rows):
    chunk = 1_000_000
    writer = None
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        ids = pa.array(range(start, start + n), pa.int64())
        table = pa.table(
            {
                "id": ids,
                "x": pc.multiply(pc.cast(ids, pa.float64()), 0.5),
                "label": pc.cast(pc.bit_wise_and(ids, 7), pa.int32()),
                "text": pa.array([f"document {i}" for i in range(start, start + n)]),
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=256_000)
    writer.close()


def consume(batches):
    rows = 0
    total = 0.0
    for batch in batches:
        rows += batch.num_rows
        total += pc.sum(batch.column(0)).as_py() or 0
    return rows, total


def timed(run, repeat):
    best = None
    for _ in range(repeat):
        start = time.perf_counter()
        rows, _ = run()
        took = time.perf_counter() - start
        best = took if best is None or took < best else best
    return rows, best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as dir:
        path = os.path.join(dir, "t.parquet")
        write_table(path, args.rows)
        dataset = ds.dataset(path, format="parquet")
        base_rows, base = timed(
            lambda: consume(dataset.to_batches(columns=["id", "x", "label", "text"])),
            args.repeat,
        )
        ctx = flumen.Session()
        ctx.register_parquet("t", path)
        df = ctx.sql(
            "SELECT id, x * 2 AS y, label, upper(text) AS text FROM t WHERE label <> 3"
        )
        rows, took = timed(lambda: consume(df.iter_batches()), args.repeat)
        plain = ctx.sql("SELECT id, x, label, text FROM t")
        plain_rows, plain_took = timed(lambda: consume(plain.iter_batches()), args.repeat)
    base_rate = base_rows / base
    rate = args.rows / took  # rows the transform read, per second
    plain_rate = plain_rows / plain_took
    print(f"iter_batches: {args.rows} rows of Parquet, best of {args.repeat}")
    print(f"  pyarrow.dataset to_batches: {base:.2f} s, {base_rate / 1e6:.2f} M rows/s")
    print(
        f"  flumen SELECT (plain): {plain_took:.2f} s, {plain_rate / 1e6:.2f} M rows/s, "
        f"{plain_rate / base_rate:.2f}x pyarrow"
    )
    print(
        f"  flumen SQL transform (filter, 2 computed columns; {rows} rows out): {took:.2f} s, "
        f"{rate / 1e6:.2f} M rows read/s, {rate / base_rate:.2f}x pyarrow (goal >= 0.8x: "
        f"{'met' if rate >= 0.8 * base_rate else 'not met'})"
    )


if __name__ == "__main__":
    main()
