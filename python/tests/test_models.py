"""Python model classes in flumen's accelerator pool (`@flumen.model`): planned as an
accelerator operator with their CPU arguments below them, loaded once per worker, results
equal to calling the class directly, and a failing class a clear error after which the
session goes on. Python functions (`@flumen.udf`) in CPU tasks.

The model is a tiny one the test builds itself (a linear map over word counts, numpy): no
model can be downloaded here.
"""

import os
import threading

import numpy as np
import pyarrow as pa
import pytest

import flumen

VOCAB = ["the", "a", "of", "data", "model", "flumen", "arrow", "query", "batch", "row"]
DIMS = 4
ROWS = 20_000


@flumen.model(returns=pa.list_(pa.float32(), DIMS), batch_rows=256, concurrency=2)
class WordCounts:
    """A linear map over word counts, weights drawn once per instance from a fixed seed."""

    inits = []
    calls = []

    def __init__(self):
        rng = np.random.default_rng(7)
        self.weights = rng.standard_normal((len(VOCAB), DIMS)).astype(np.float32)
        WordCounts.inits.append(threading.get_ident())

    def __call__(self, batch):
        WordCounts.calls.append((threading.get_ident(), batch.num_rows))
        texts = batch.column(0).to_pylist()
        counts = np.array(
            [[(t or "").split().count(w) for w in VOCAB] for t in texts], dtype=np.float32
        ).reshape(len(texts), len(VOCAB))
        out = counts @ self.weights
        return pa.FixedSizeListArray.from_arrays(pa.array(out.ravel(), pa.float32()), DIMS)


def text(i):
    return " ".join(VOCAB[(i * k) % len(VOCAB)] for k in range(1, 2 + i % 9))


@pytest.fixture
def ctx():
    ctx = flumen.Session(settings={"flumen.device": "cpu"})
    ids = list(range(ROWS))
    ctx.from_arrow("docs", pa.table({"id": pa.array(ids, pa.int64()), "body": [text(i) for i in ids]}))
    return ctx


def test_a_python_model_runs_in_the_accelerator_pool_and_equals_the_class_called_directly(ctx):
    WordCounts.inits.clear()
    WordCounts.calls.clear()
    ctx.register_model("word_vectors", WordCounts)
    df = ctx.sql("SELECT id, word_vectors(lower(body)) AS v FROM docs ORDER BY id")
    plan = df.explain()
    assert "pool=accelerator" in plan and "word_vectors" in plan, plan
    # lower() runs in CPU tasks below the model's operator, not in it.
    model_line = next(line for line in plan.splitlines() if "AcceleratorProjectionExec:" in line)
    assert "word_vectors(" in model_line and "lower(" not in model_line, plan
    assert any("lower(body" in line and "ProjectionExec" in line for line in plan.splitlines())
    got = df.to_arrow()
    assert got.num_rows == ROWS
    direct = WordCounts()
    bodies = pa.array([text(i).lower() for i in range(ROWS)])
    expected = direct(pa.record_batch({"arg0": bodies}))
    assert got.column("v").combine_chunks().equals(expected)
    # One instance per worker thread that ran blocks (the direct call above made one more).
    workers = {thread for thread, _ in WordCounts.calls[:-1]}
    assert len(WordCounts.inits) - 1 == len(workers) <= 2, (WordCounts.inits, workers)
    assert max(rows for _, rows in WordCounts.calls[:-1]) <= 256
    # Again: the loaded instances are kept (at most one per worker thread, ever).
    assert ctx.sql("SELECT count(word_vectors(body)) AS n FROM docs").to_pylist() == [{"n": ROWS}]
    assert len(WordCounts.inits) - 1 <= 2, WordCounts.inits


@flumen.model(returns=pa.int64())
class Broken:
    def __call__(self, batch):
        raise ValueError("this model cannot read row 0")


@flumen.model(returns=pa.int64())
class WrongLength:
    def __call__(self, batch):
        return pa.array([1], pa.int64())


def test_a_failing_model_is_a_clear_error_and_the_session_goes_on(ctx):
    ctx.register_model("broken", Broken)
    with pytest.raises(flumen.FlumenError, match="Broken.*cannot read row 0"):
        ctx.sql("SELECT broken(body) FROM docs").collect()
    ctx.register_model("wrong_length", WrongLength)
    with pytest.raises(flumen.FlumenError, match="WrongLength returned 1 values"):
        ctx.sql("SELECT wrong_length(body) FROM docs WHERE id < 10").collect()
    with pytest.raises(TypeError, match="returns"):
        ctx.register_model("untyped", type("Untyped", (), {"__call__": lambda self, b: b}))
    assert ctx.sql("SELECT count(*) AS n FROM docs").to_pylist() == [{"n": ROWS}]


@flumen.model(returns=pa.float32(), device="cuda")
class OnGpu:
    def __init__(self):
        import torch

        self.device = torch.device("cuda")

    def __call__(self, batch):
        import torch

        x = torch.tensor(batch.column(0).to_pylist(), dtype=torch.float32, device=self.device)
        return pa.array((x * 2).cpu().numpy(), pa.float32())


def torch_on_a_gpu(what):
    """torch, when a CUDA device is here; skips without one. torch's wheels come with CUDA
    (gigabytes), so only GPU machines install it: there a missing torch fails under CI."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip(f"no CUDA device (libcuda.so.1 not found) for {what}")
    try:
        import torch
    except ImportError:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            raise
        pytest.skip(f"torch is not installed for {what}")
    return torch


def test_a_cuda_model_runs_on_a_gpu(ctx):
    torch_on_a_gpu("the GPU model")
    ctx.register_model("double_on_gpu", OnGpu)
    got = ctx.sql("SELECT double_on_gpu(CAST(id AS FLOAT)) AS d FROM docs WHERE id < 100 ORDER BY id")
    assert got.to_arrow().to_pydict()["d"] == [2.0 * i for i in range(100)]


@flumen.udf(returns=pa.int64())
def word_count(batch):
    return pa.array([len((t or "").split()) for t in batch.column(0).to_pylist()], pa.int64())


@flumen.udf(returns=pa.int64())
def no_words(batch):
    raise RuntimeError("no words here")


def test_a_python_function_runs_in_cpu_tasks(ctx):
    ctx.register_udf("word_count", word_count)
    df = ctx.sql("SELECT id, word_count(body) AS n FROM docs ORDER BY id")
    plan = df.explain()
    assert "pool=accelerator" not in plan, plan
    assert df.to_arrow().column("n").to_pylist() == [len(text(i).split()) for i in range(ROWS)]
    ctx.register_udf("no_words", no_words)
    with pytest.raises(flumen.FlumenError, match="no_words.*no words here"):
        ctx.sql("SELECT no_words(body) FROM docs").collect()
    assert ctx.sql("SELECT word_count('a b c') AS n").to_pylist() == [{"n": 3}]


def test_torch_batches_feed_a_training_loop_on_the_gpu(ctx):
    torch = torch_on_a_gpu("the torch training feed")
    df = ctx.sql("SELECT CAST(id AS FLOAT) AS x, CAST(id % 2 AS FLOAT) AS y FROM docs")
    seen = 0
    for batch in df.iter_torch_batches(batch_size=1000, device="cuda", drop_last=True):
        assert batch["x"].device.type == "cuda" and batch["x"].shape == (1000,)
        seen += 1000
    assert seen == ROWS
    loader = torch.utils.data.DataLoader(df.to_torch(batch_size=500, device="cuda"), batch_size=None)
    model = torch.nn.Linear(1, 1).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch["x"][:, None]).squeeze(1), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with pytest.raises(TypeError, match="body"):
        next(ctx.sql("SELECT body FROM docs").iter_torch_batches())


def test_the_readme_example_embeds_with_embed_and_its_own_model_in_workers_and_threads():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[1] / "examples" / "own_model.py"
    runs = [
        subprocess.run(
            [sys.executable, str(example), "--rows", "400", *flags], capture_output=True, text=True, timeout=300
        )
        for flags in ([], ["--threads"])
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert "400 documents embedded" in runs[0].stdout, runs[0].stdout
    assert "|minilm| = 1.000" in runs[0].stdout, runs[0].stdout
    # Worker processes and this process's threads give the same vectors.
    assert runs[0].stdout == runs[1].stdout
