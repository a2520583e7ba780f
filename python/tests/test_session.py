"""flumen's Python module: SQL results against pyarrow's, Arrow out through the PyCapsule
interface without copies, bad input as clear errors, streaming under a memory budget, and
Ctrl-C during a long query.

Run by `tests/integration/python.rs` (the README's test command) with the interpreter that
`python/install.sh` built the module into.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import flumen

ROWS = 10_000


def required(module):
    """`module`, imported; under CI (CI=true) a missing one fails the test, elsewhere it
    skips it and says so."""
    try:
        return __import__(module)
    except ImportError:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            raise
        pytest.skip(f"{module} is not installed")


@pytest.fixture
def table(tmp_path):
    ids = list(range(ROWS))
    data = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "g": pa.array([i % 7 for i in ids], pa.int64()),
            "x": pa.array([i * 0.5 for i in ids], pa.float64()),
            "s": pa.array([f"row {i}" for i in ids], pa.string()),
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(data, path, row_group_size=1_000)
    return data, str(path)


def session(**settings):
    return flumen.Session(settings={"flumen.device": "cpu", **settings})


def test_sql_results_equal_pyarrows(table):
    data, path = table
    ctx = session()
    ctx.register_parquet("t", path)
    got = ctx.sql(
        "SELECT g, sum(x) AS total, count(*) AS n FROM t WHERE id % 3 = 0 GROUP BY g ORDER BY g"
    ).to_arrow()
    kept = data.filter(pa.array([i % 3 == 0 for i in range(ROWS)]))
    expected = kept.group_by("g").aggregate([("x", "sum"), ("x", "count")]).sort_by("g")
    assert got.column("g").to_pylist() == expected.column("g").to_pylist()
    assert got.column("total").to_pylist() == expected.column("x_sum").to_pylist()
    assert got.column("n").to_pylist() == expected.column("x_count").to_pylist()
    # The same rows as dicts.
    rows = ctx.sql("SELECT id, s FROM t WHERE id < 3 ORDER BY id").to_pylist()
    assert rows == [{"id": i, "s": f"row {i}"} for i in range(3)]


@pytest.mark.parametrize("workers", [0, 2])
def test_files_read_by_path_equal_pyarrows(table, tmp_path, workers):
    data, path = table
    settings = {"flumen.workers": "process", "flumen.worker_processes": "2"} if workers else {}
    ctx = session(**settings)
    rows = sorted(ctx.read_parquet(path).to_pylist(), key=lambda row: row["id"])
    assert rows == data.to_pylist()
    # A list of files, and a glob: the rows of each.
    (tmp_path / "more").mkdir()
    pq.write_table(data.slice(0, 10), tmp_path / "more" / "ten.parquet")
    both = ctx.read_parquet([path, str(tmp_path / "more" / "ten.parquet")])
    assert both.to_arrow().num_rows == ROWS + 10
    assert ctx.read_parquet(str(tmp_path / "*.parquet")).to_arrow().num_rows == ROWS
    # CSV and newline-delimited JSON, whatever the files are called.
    import pyarrow.csv as pcsv

    pcsv.write_csv(data.slice(0, 5), tmp_path / "five.txt")
    assert ctx.read_csv(str(tmp_path / "five.txt")).to_arrow().column("id").to_pylist() == [
        0, 1, 2, 3, 4,
    ]
    (tmp_path / "rows.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    assert ctx.read_json(str(tmp_path / "rows.jsonl")).to_pylist() == [{"a": 1}, {"a": 2}]
    with pytest.raises(flumen.FlumenError, match="no file found there"):
        ctx.read_parquet(str(tmp_path / "missing.parquet")).collect()
    # A quoted path reads as a table in SQL, as in the shell; one that cannot says why.
    got = ctx.sql(f"SELECT count(*) AS n, sum(id) AS total FROM '{path}'").to_pylist()
    assert got == [{"n": ROWS, "total": sum(range(ROWS))}]
    with pytest.raises(flumen.FlumenError, match="missing.parquet' as a table: no file found there"):
        ctx.sql(f"SELECT * FROM '{tmp_path / 'missing.parquet'}'")


def test_samples_and_rollups_in_sql(table):
    """TABLESAMPLE keeps the same rows for a seed (DataFusion 55 ignored it), SYSTEM whole
    row groups; GROUP BY ... WITH ROLLUP has its total row (DataFusion 55 dropped it); ORDER
    BY ALL orders (`all` was read as a column)."""
    data, path = table
    ctx = session()
    ctx.register_parquet("t", path)
    sample = "SELECT id FROM t TABLESAMPLE BERNOULLI (10) REPEATABLE (7) ORDER BY id"
    ids = [row["id"] for row in ctx.sql(sample).to_pylist()]
    assert 800 < len(ids) < 1_200, len(ids)
    assert ids == [row["id"] for row in ctx.sql(sample).to_pylist()]
    groups = ctx.sql("SELECT DISTINCT id / 1000 AS rg FROM t TABLESAMPLE SYSTEM (30) REPEATABLE (7)")
    kept = ctx.sql("SELECT count(*) AS n FROM t TABLESAMPLE SYSTEM (30) REPEATABLE (7)").to_pylist()
    assert kept == [{"n": 1_000 * groups.to_arrow().num_rows}]
    totals = ctx.sql("SELECT g, count(*) AS n FROM t GROUP BY g WITH ROLLUP ORDER BY g NULLS LAST")
    assert totals.to_pylist()[-1] == {"g": None, "n": ROWS}
    # ORDER BY ALL (DuckDB's): by every output column, left to right.
    ordered = ctx.sql("SELECT g, id FROM t WHERE id < 10 ORDER BY ALL DESC").to_pylist()
    assert [(r["g"], r["id"]) for r in ordered] == [
        (6, 6), (5, 5), (4, 4), (3, 3), (2, 9), (2, 2), (1, 8), (1, 1), (0, 7), (0, 0)
    ]


def test_worker_processes_answer_like_threads_and_pyarrow(table):
    data, path = table
    # The session starts its workers as `python -m flumen worker` (this interpreter).
    query = "SELECT g, sum(x) AS total, count(*) AS n, max(s) AS last FROM t GROUP BY g ORDER BY g"
    answers = {}
    for mode in ("threads", "process"):
        ctx = session(**{"flumen.workers": mode, "flumen.worker_processes": "2"})
        ctx.register_parquet("t", path)
        answers[mode] = ctx.sql(query).to_arrow()
        if mode == "process":
            plan = ctx.sql(query).explain(analyze=True)
            remote = [int(n) for n in re.findall(r"remote_tasks=(\d+)", plan)]
            assert sum(remote) > 0, f"no task ran in a worker process:\n{plan}"
    assert answers["process"].equals(answers["threads"])
    expected = data.group_by("g").aggregate([("x", "sum")]).sort_by("g")
    assert answers["process"].column("total").to_pylist() == expected.column("x_sum").to_pylist()


def test_results_are_read_through_the_arrow_pycapsule_stream(table):
    data, path = table
    ctx = session()
    ctx.register_parquet("t", path)
    df = ctx.sql("SELECT id, s FROM t ORDER BY id")
    # DataFusion reads Parquet strings as string views.
    assert df.schema == pa.schema([("id", pa.int64()), ("s", pa.string_view())])
    read = pa.RecordBatchReader.from_stream(df).read_all()
    assert read.column("id").to_pylist() == list(range(ROWS))
    assert pa.table(df).column("s").to_pylist() == data.column("s").to_pylist()
    polars = required("polars")
    frame = polars.DataFrame(df)
    assert frame.height == ROWS
    assert frame["id"].to_list() == list(range(ROWS))


def test_results_leave_without_copies(table):
    _, path = table
    ctx = session()
    ctx.register_parquet("t", path)
    df = ctx.sql("SELECT id, x, s FROM t")
    batches = 0
    for exported in df._inner.batches():
        batch = pa.record_batch(exported)
        for held, column in zip(exported.buffer_addresses(), batch.columns):
            read = {b.address for b in column.buffers() if b is not None}
            assert set(held) <= read, f"a buffer was copied: {held} against {read}"
        batches += 1
    assert batches > 0


def test_arrow_data_goes_in_and_comes_back_out():
    values = pa.array(range(1_000_000), pa.int64())
    ctx = session()
    df = ctx.from_arrow("src", pa.table({"v": values}))
    assert sum(b.num_rows for b in df.collect()) == 1_000_000
    total = ctx.sql("SELECT sum(v) AS total FROM src").to_pylist()
    assert total == [{"total": sum(range(1_000_000))}]
    # polars reads a result through the stream interface, and flumen reads polars' frame.
    polars = required("polars")
    frame = polars.DataFrame(ctx.sql("SELECT v FROM src WHERE v % 2 = 0"))
    assert frame["v"].sum() == sum(range(0, 1_000_000, 2))
    ctx.from_arrow("evens", frame)
    assert ctx.sql("SELECT count(*) AS n FROM evens").to_pylist() == [{"n": 500_000}]


def test_bad_input_is_a_clear_error_and_the_session_goes_on(tmp_path):
    ctx = session()
    with pytest.raises(flumen.FlumenError, match="no_such_table"):
        ctx.sql("SELECT * FROM no_such_table")
    with pytest.raises(flumen.FlumenError, match="SELEC"):
        ctx.sql("SELEC 1")
    missing = tmp_path / "missing.parquet"
    with pytest.raises(flumen.FlumenError, match="missing.parquet"):
        ctx.register_parquet("m", str(missing))
    with pytest.raises(TypeError, match="__arrow_c_stream__"):
        ctx.from_arrow("bad", [1, 2, 3])
    # Files that disagree on a column's type: the odd one is named.
    (tmp_path / "mixed").mkdir()
    pq.write_table(pa.table({"a": pa.array([1], pa.int64())}), tmp_path / "mixed" / "one.parquet")
    pq.write_table(pa.table({"a": pa.array(["x"])}), tmp_path / "mixed" / "two.parquet")
    odd = r"Utf8\w* in 1 file \(" + re.escape(str(tmp_path / "mixed" / "two.parquet")) + r"\)"
    with pytest.raises(flumen.FlumenError, match=f"disagree on the type of column 'a': .*{odd}"):
        ctx.sql(f"SELECT * FROM '{tmp_path / 'mixed'}/'")
    assert ctx.sql("SELECT 1 AS one").to_pylist() == [{"one": 1}]


def test_iter_batches_holds_memory_within_the_budget_for_a_slow_consumer():
    # In a process of its own: the peak RSS it reads is this stream's, not an earlier test's.
    script = (
        "import resource, time, flumen\n"
        "ctx = flumen.Session(settings={'flumen.memory_budget': '32MB'})\n"
        "df = ctx.sql(\"SELECT value AS id, repeat('a', 100) AS pad FROM generate_series(1, 3000000)\")\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10\n"
        "rows = 0\n"
        "for batch in df.iter_batches(batch_rows=8192):\n"
        "    rows += batch.num_rows\n"
        "    time.sleep(0.002)\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10\n"
        "print(rows, peak - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows, grew = map(int, out.stdout.split())
    budget = 32 << 20
    assert rows == 3_000_000
    print(f"peak RSS grew {grew >> 20} MiB streaming {rows * 110 >> 20} MiB, budget {budget >> 20} MiB")
    assert grew < budget + (160 << 20), f"peak RSS grew {grew >> 20} MiB"


def test_iter_batches_shuffles_each_epoch_with_its_seed(table):
    _, path = table
    ctx = session()
    ctx.register_parquet("t", path)
    df = ctx.sql("SELECT id FROM t")

    def epochs(seed):
        orders, current = [], []
        for batch in df.iter_batches(batch_rows=1000, epochs=2, shuffle_seed=seed):
            current.extend(batch.column(0).to_pylist())
            if len(current) == ROWS:
                orders.append(current)
                current = []
        assert current == []
        return orders

    first, second = epochs(7)
    assert sorted(first) == sorted(second) == list(range(ROWS)), "a row lost or repeated"
    assert first != second, "two epochs in the same order"
    assert first != sorted(first), "not shuffled"
    assert epochs(7) == [first, second], "the same seed gave another order"


def test_ranks_get_disjoint_shares_that_hold_every_row(table):
    _, path = table
    ctx = session()
    ctx.register_parquet("t", path)
    df = ctx.sql("SELECT id, s FROM t")
    shares = [
        [i for b in df.iter_batches(rank=r, world_size=3) for i in b.column(0).to_pylist()]
        for r in range(3)
    ]
    every = sorted(i for share in shares for i in share)
    assert every == list(range(ROWS)), "a row in no share or in two"
    for share in shares:
        assert ROWS / 3 * 0.8 < len(share) < ROWS / 3 * 1.2, [len(s) for s in shares]
    # A rank's share, shuffled per epoch, is the same rows in another order.
    shuffled = [i for b in df.iter_batches(rank=1, world_size=3, shuffle_seed=3) for i in b.column(0).to_pylist()]
    assert sorted(shuffled) == sorted(shares[1]) and shuffled != shares[1]
    with pytest.raises(ValueError, match="rank"):
        next(df.iter_batches(rank=3, world_size=3))


@pytest.mark.parametrize("workers", [None, 2], ids=["threads", "workers"])
def test_numpy_batches_have_the_size_asked_for_and_vectors_as_matrices(table, workers):
    _, path = table
    ctx = flumen.Session(workers=workers, settings={"flumen.device": "cpu"})
    ctx.register_parquet("t", path)
    # 10,000 rows in row groups of 1,000, cut into batches of 768: 13 of 768 and one of 16.
    df = ctx.sql("SELECT id, x, arrow_cast(v, 'FixedSizeList(2, Float32)') AS v FROM (" +
                 "SELECT id, x, make_array(CAST(id AS FLOAT), CAST(2.0 AS FLOAT)) AS v FROM t) ORDER BY id")
    batches = list(df.iter_numpy_batches(batch_size=768))
    assert [len(b["id"]) for b in batches] == [768] * 13 + [16]
    assert batches[0]["v"].shape == (768, 2) and batches[0]["v"].dtype == np.float32
    assert np.concatenate([b["id"] for b in batches]).tolist() == list(range(ROWS))
    assert np.concatenate([b["v"][:, 0] for b in batches]).tolist() == [float(i) for i in range(ROWS)]
    assert np.concatenate([b["x"] for b in batches]).tolist() == [i * 0.5 for i in range(ROWS)]
    assert [len(b["id"]) for b in df.iter_numpy_batches(batch_size=768, drop_last=True)] == [768] * 13
    # Two epochs, two ranks: each rank's epochs hold its share twice; the shares every row.
    ids = [
        np.concatenate([b["id"] for b in df.iter_numpy_batches(batch_size=500, epochs=2, rank=r, world_size=2)])
        for r in range(2)
    ]
    halves = [sorted(i.tolist()) for i in ids]
    for rank_ids in ids:
        first, second = np.split(rank_ids, 2)
        assert sorted(first.tolist()) == sorted(second.tolist())
    assert sorted(set(halves[0]) | set(halves[1])) == list(range(ROWS))
    assert not set(halves[0]) & set(halves[1])
    with pytest.raises(ValueError, match="batch_size"):
        next(df.iter_numpy_batches(batch_size=0))


@pytest.mark.parametrize("workers", [None, 2], ids=["threads", "workers"])
def test_delta_and_iceberg_tables_register_by_path(tmp_path, workers):
    deltalake = required("deltalake")
    required("pyiceberg")
    from pyiceberg.catalog.sql import SqlCatalog

    first = pa.table({"id": pa.array(range(100), pa.int64()), "s": [f"a{i}" for i in range(100)]})
    second = pa.table({"id": pa.array(range(100, 150), pa.int64()), "s": ["b"] * 50})
    delta = str(tmp_path / "delta's table")
    deltalake.write_deltalake(delta, first)
    deltalake.write_deltalake(delta, second, mode="append")
    ctx = flumen.Session(workers=workers, settings={"flumen.device": "cpu"})
    ctx.register_delta("latest", delta)
    ctx.register_delta("v0", delta, version=0)
    total = "SELECT count(*) AS n, sum(id) AS ids FROM {}"
    assert ctx.sql(total.format("latest")).to_pylist() == [{"n": 150, "ids": sum(range(150))}]
    assert ctx.sql(total.format("v0")).to_pylist() == [{"n": 100, "ids": sum(range(100))}]
    with pytest.raises(flumen.FlumenError, match="version"):
        ctx.register_delta("v9", delta, version=9)

    catalog = SqlCatalog(
        "t", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse"
    )
    catalog.create_namespace("db")
    table = catalog.create_table("db.events", schema=first.schema)
    table.append(first)
    snapshot = table.current_snapshot().snapshot_id
    table.append(second)
    location = table.location().removeprefix("file://")
    ctx.register_iceberg("events", location)
    ctx.register_iceberg("events_then", location, snapshot_id=snapshot)
    assert ctx.sql(total.format("events")).to_pylist() == [{"n": 150, "ids": sum(range(150))}]
    assert ctx.sql(total.format("events_then")).to_pylist() == [{"n": 100, "ids": sum(range(100))}]


def test_ctrl_c_interrupts_a_long_query_within_two_seconds():
    script = (
        "import flumen, sys\n"
        "ctx = flumen.Session()\n"
        "df = ctx.sql('SELECT count(*) FROM generate_series(1, 100000000000) a, generate_series(1, 10) b')\n"
        "print('running', flush=True)\n"
        "try:\n"
        "    df.collect()\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.exit(3)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "running"
    time.sleep(1.0)
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=30)
    took = time.monotonic() - sent
    assert child.returncode == 3, (child.returncode, out, err)
    assert "interrupted" in out
    print(f"Ctrl-C to KeyboardInterrupt: {took:.2f} s")
    assert took < 2.0, f"Ctrl-C took {took:.2f} s"


@pytest.mark.parametrize("workers", [None, 2], ids=["threads", "workers"])
def test_reset_puts_a_flumen_setting_back(table, workers):
    """`RESET flumen.<name>` (which DataFusion 55's own RESET refuses) puts the setting back
    to its default: 100-row blocks, then the default's, in the batches a query returns (cut
    by the workers too, which take the session's settings with each task)."""
    _, path = table
    ctx = flumen.Session(workers=workers, settings={"flumen.device": "cpu"})
    ctx.register_parquet("t", path)

    def largest_batch():
        reader = pa.RecordBatchReader.from_stream(ctx.sql("SELECT id FROM t"))
        return max(batch.num_rows for batch in reader)

    ctx.sql("SET flumen.target_block_rows = 100")
    assert largest_batch() <= 100
    ctx.sql("RESET flumen.target_block_rows")
    assert largest_batch() > 100
    with pytest.raises(flumen.FlumenError, match="no_such_setting"):
        ctx.sql("RESET flumen.no_such_setting")
