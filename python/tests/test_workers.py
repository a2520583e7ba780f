"""Python models and functions in worker processes (`flumen.Session(workers=N)`): the
session starts its workers as `python -m flumen worker`, and each Python model or function
ships with the tasks that call it (cloudpickle). A model class is instantiated once per
accelerator worker; a worker SIGKILLed mid-query costs its blocks, which lineage
recomputes, not the answer; a model that raises is a clear error naming its class; a model
that kills its own process kills a worker, not the session.

The counting model class is made by a function, so cloudpickle ships it by value with the
path of the log file it writes to (its `__init__` and calls leave the worker's pid there);
classes of importable modules ship by reference (the worker imports them).
"""

import os
import re
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import flumen

VOCAB = ["the", "a", "of", "data", "model", "flumen", "arrow", "query", "batch", "row"]
DIMS = 4
ROWS = 20_000


def text(i):
    return " ".join(VOCAB[(i * k) % len(VOCAB)] for k in range(1, 2 + i % 9))


def word_counts_model(log, nap=0.0):
    """A linear map over word counts (weights from a fixed seed) that logs `init PID` once
    per instance and `call PID` per batch to `log`, sleeping `nap` seconds per batch."""

    @flumen.model(returns=pa.list_(pa.float32(), DIMS), batch_rows=256, concurrency=2)
    class WordCounts:
        def __init__(self):
            rng = np.random.default_rng(7)
            self.weights = rng.standard_normal((len(VOCAB), DIMS)).astype(np.float32)
            with open(log, "a") as f:
                f.write(f"init {os.getpid()}\n")

        def __call__(self, batch):
            with open(log, "a") as f:
                f.write(f"call {os.getpid()}\n")
            time.sleep(nap)
            texts = batch.column(0).to_pylist()
            counts = np.array(
                [[(t or "").split().count(w) for w in VOCAB] for t in texts], dtype=np.float32
            ).reshape(len(texts), len(VOCAB))
            out = counts @ self.weights
            return pa.FixedSizeListArray.from_arrays(pa.array(out.ravel(), pa.float32()), DIMS)

    return WordCounts


def logged(log, what):
    """The pids `log` holds for `what` (`init` or `call`), in order."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line.split()[1]) for line in f if line.startswith(what + " ")]


@pytest.fixture
def docs(tmp_path):
    """20,000 documents in a Parquet file of 10 row groups."""
    ids = list(range(ROWS))
    path = tmp_path / "docs.parquet"
    table = pa.table({"id": pa.array(ids, pa.int64()), "body": [text(i) for i in ids]})
    pq.write_table(table, path, row_group_size=ROWS // 10)
    return str(path)


def session(docs, **settings):
    ctx = flumen.Session(
        workers=2, settings={"flumen.device": "cpu", "flumen.model_split_rows": 2000, **settings}
    )
    ctx.register_parquet("docs", docs)
    return ctx


def expected_vectors(cls):
    bodies = pa.array([text(i).lower() for i in range(ROWS)])
    return cls()(pa.record_batch({"arg0": bodies}))


def test_a_model_on_two_worker_processes_equals_the_class_called_directly(docs, tmp_path):
    log = str(tmp_path / "model.log")
    cls = word_counts_model(log)
    ctx = session(docs)
    ctx.register_model("word_vectors", cls)
    query = "SELECT id, word_vectors(lower(body)) AS v FROM docs ORDER BY id"
    got = ctx.sql(query).to_arrow()
    assert got.num_rows == ROWS
    inits = logged(log, "init")
    calls = logged(log, "call")
    # Every call ran in a worker process, none in this one; each worker made one instance.
    assert os.getpid() not in calls and calls, calls[:5]
    assert sorted(inits) == sorted(set(calls)), (inits, set(calls))
    assert len(inits) == len(set(inits)) <= 2, inits
    # Again: the workers keep their instances.
    assert ctx.sql("SELECT count(word_vectors(body)) AS n FROM docs").to_pylist() == [{"n": ROWS}]
    assert logged(log, "init") == inits
    assert got.column("v").combine_chunks().equals(expected_vectors(cls))


def test_a_worker_killed_mid_query_gives_the_same_answer(docs, tmp_path):
    log = str(tmp_path / "model.log")
    cls = word_counts_model(log, nap=0.02)
    ctx = session(docs)
    ctx.register_model("word_vectors", cls)
    killed = []

    def kill_a_worker():
        deadline = time.time() + 60
        while time.time() < deadline:
            calls = logged(log, "call")
            if len(calls) >= 10:
                os.kill(calls[-1], signal.SIGKILL)
                killed.append(calls[-1])
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    got = ctx.sql("SELECT id, word_vectors(lower(body)) AS v FROM docs ORDER BY id").to_arrow()
    killer.join()
    assert killed, "no worker was killed (the query ended first)"
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)
    # Its blocks were recomputed elsewhere: each row once, the same vectors.
    assert got.column("id").to_pylist() == list(range(ROWS))
    assert got.column("v").combine_chunks().equals(expected_vectors(cls))
    calls = logged(log, "call")
    assert set(calls) - {killed[0]}, "no other worker ran the model"


@flumen.model(returns=pa.int64())
class Crashing:
    def __call__(self, batch):
        os._exit(3)  # the process dies as from a segfault in native code


def test_a_failing_model_in_a_worker_is_a_clear_error_and_the_session_goes_on(docs):
    # test_models.Broken ships by reference: the worker imports test_models from the
    # driver's sys.path.
    from test_models import Broken

    ctx = session(docs, **{"flumen.max_task_retries": 1})
    ctx.register_model("broken", Broken)
    with pytest.raises(flumen.FlumenError, match="Broken.*cannot read row 0"):
        ctx.sql("SELECT broken(body) FROM docs").collect()
    # A model that kills its process kills a worker (and the retry's), not the session.
    ctx.register_model("crashing", Crashing)
    with pytest.raises(flumen.FlumenError, match="(?i)worker"):
        ctx.sql("SELECT crashing(body) FROM docs WHERE id < 10").collect()
    assert ctx.sql("SELECT count(*) AS n FROM docs").to_pylist() == [{"n": ROWS}]


@flumen.udf(returns=pa.int64())
def pid_of(batch):
    return pa.array([os.getpid()] * batch.num_rows, pa.int64())


@flumen.udf(returns=pa.int64())
def word_count(batch):
    return pa.array([len((t or "").split()) for t in batch.column(0).to_pylist()], pa.int64())


def test_python_functions_run_in_the_cpu_worker_processes(docs):
    ctx = session(docs)
    ctx.register_udf("pid_of", pid_of)
    ctx.register_udf("word_count", word_count)
    got = ctx.sql("SELECT id, word_count(body) AS n, pid_of(id) AS pid FROM docs ORDER BY id")
    got = got.to_arrow()
    assert got.column("n").to_pylist() == [len(text(i).split()) for i in range(ROWS)]
    pids = set(got.column("pid").to_pylist())
    assert os.getpid() not in pids and pids, pids


def test_a_function_that_cannot_ship_warns_and_runs_in_the_session(docs):
    lock = threading.Lock()

    @flumen.udf(returns=pa.int64())
    def holds_a_lock(batch):
        with lock:
            return pa.array([1] * batch.num_rows, pa.int64())

    ctx = session(docs)
    with pytest.warns(UserWarning, match="holds_a_lock cannot ship to worker processes"):
        ctx.register_udf("holds_a_lock", holds_a_lock)
    got = ctx.sql("SELECT sum(holds_a_lock(id)) AS n FROM docs").to_pylist()
    assert got == [{"n": ROWS}]


def start_worker(pool, secret_file, *flags):
    """`python -m flumen worker` started by hand on loopback; (process, address)."""
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "flumen", "worker", "--listen", "127.0.0.1:0", "--pool", pool,
         "--secret-file", str(secret_file), "--lease", "60", *flags],
        stdout=subprocess.PIPE, text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("flumen worker listening on "), line
    return process, line.split()[-1]


def test_a_worker_that_refuses_shipped_functions_leaves_them_to_the_driver(docs, tmp_path):
    secret = tmp_path / "cluster.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    os.chmod(secret, 0o600)
    workers = [
        start_worker("cpu", secret, "--no-shipped-functions"),
        start_worker("accelerator", secret, "--no-shipped-functions"),
    ]
    try:
        addresses = ",".join(address for _, address in workers)
        ctx = flumen.Session(
            cluster=addresses,
            settings={"flumen.device": "cpu", "flumen.cluster_secret_file": str(secret)},
        )
        ctx.register_parquet("docs", docs)
        ctx.register_udf("pid_of", pid_of)
        # Plain SQL runs on the workers; the Python function stays in this process.
        plan = ctx.sql("SELECT sum(id) AS s FROM docs").explain(analyze=True)
        assert sum(int(n) for n in re.findall(r"remote_tasks=(\d+)", plan)) > 0, plan
        pids = ctx.sql("SELECT DISTINCT pid_of(id) AS p FROM docs").to_pylist()
        assert pids == [{"p": os.getpid()}], pids
    finally:
        for process, _ in workers:
            process.kill()
            process.wait()
