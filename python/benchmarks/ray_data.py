"""A Python model with CPU preprocessing over 100,000 documents: flumen against Ray Data.

The same model class (a numpy MLP over hashed word counts: 2**12 buckets -> 256 -> 64,
weights from a fixed seed), the same batch size (256 rows), the same two model workers
(flumen: `concurrency=2` accelerator worker processes, `Session(workers=2)`; Ray Data:
`map_batches(..., concurrency=2, num_cpus=0.5)`, an actor pool of 2), the same preprocessing (lower-case,
non-letters to spaces: flumen's SQL below the model, Ray's `map_batches` over pyarrow
compute), the same Parquet file, the same machine (`ray.init(num_cpus=<cores>)`). Each
engine's consumer iterates the result batches and counts rows. Each runs the job
`--runs` times; the first run includes starting its workers or actors (Ray's `ray.init`
itself is not counted, flumen's `Session()` is). Prints per run: seconds, rows/s, the
time to the first result batch, and flumen's ratio to Ray Data.

    target/bench-venv/bin/python python/benchmarks/ray_data.py --docs 100000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

BUCKETS = 1 << 12
BATCH_ROWS = 256
WORDS = (
    "data model query arrow batch row column table stream block worker task operator "
    "memory budget shuffle join sort filter parquet lakehouse feature vector embedding "
    "token text document inference training pipeline scheduler lineage recompute"
).split()


def write_docs(path: str, docs: int) -> None:
    rng = np.random.default_rng(3)
    bodies = []
    for i in range(docs):
        n = 20 + (i % 41)
        words = rng.choice(WORDS, n)
        bodies.append(f"Doc #{i}: " + " ".join(w.capitalize() if k % 5 == 0 else w for k, w in enumerate(words)) + "!")
    table = pa.table({"id": pa.array(range(docs), pa.int64()), "body": bodies})
    pq.write_table(table, path, row_group_size=max(1, docs // 20))


class Mlp:
    """Hashed word counts through a two-layer MLP; `__call__` takes the texts."""

    def __init__(self):
        rng = np.random.default_rng(11)
        self.w1 = (rng.standard_normal((BUCKETS, 256)) / 64).astype(np.float32)
        self.w2 = (rng.standard_normal((256, 64)) / 16).astype(np.float32)

    def vectors(self, texts: list[str]) -> np.ndarray:
        counts = np.zeros((len(texts), BUCKETS), np.float32)
        for row, text in enumerate(texts):
            for word in text.split():
                counts[row, hash(word) % BUCKETS] += 1.0
        hidden = np.maximum(counts @ self.w1, 0.0)
        return hidden @ self.w2


def as_list_array(vectors: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), 64)


def run_flumen(path: str) -> tuple[float, float, int]:
    import flumen

    @flumen.model(returns=pa.list_(pa.float32(), 64), batch_rows=BATCH_ROWS, concurrency=2)
    class FlumenMlp(Mlp):
        def __call__(self, batch):
            return as_list_array(self.vectors(batch.column(0).to_pylist()))

    start = time.perf_counter()
    ctx = flumen.Session(workers=2, settings={"flumen.device": "cpu"})
    ctx.register_parquet("docs", path)
    ctx.register_model("mlp", FlumenMlp)
    df = ctx.sql(
        "SELECT id, mlp(lower(regexp_replace(body, '[^A-Za-z ]', ' ', 'g'))) AS v FROM docs"
    )
    first = None
    rows = 0
    for batch in df.iter_batches():
        if first is None:
            first = time.perf_counter() - start
        rows += batch.num_rows
    return time.perf_counter() - start, first, rows


def preprocess(batch: pa.Table) -> pa.Table:
    cleaned = pc.utf8_lower(pc.replace_substring_regex(batch["body"], "[^A-Za-z ]", " "))
    return pa.table({"id": batch["id"], "text": cleaned})


class RayMlp(Mlp):
    def __call__(self, batch: pa.Table) -> pa.Table:
        vectors = self.vectors(batch["text"].to_pylist())
        return pa.table({"id": batch["id"], "v": as_list_array(vectors)})


def run_ray(path: str) -> tuple[float, float, int]:
    import ray.data

    start = time.perf_counter()
    ds = (
        ray.data.read_parquet(path, override_num_blocks=20)  # one block per row group
        .map_batches(preprocess, batch_format="pyarrow")
        # Half a logical CPU per actor: with a whole one each, the two would hold both CPUs
        # and the read tasks would never be scheduled (Ray Data waits forever).
        .map_batches(
            RayMlp, batch_size=BATCH_ROWS, concurrency=2, num_cpus=0.5, batch_format="pyarrow"
        )
    )
    first = None
    rows = 0
    for batch in ds.iter_batches(batch_format="pyarrow"):
        if first is None:
            first = time.perf_counter() - start
        rows += batch.num_rows
    return time.perf_counter() - start, first, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "docs.parquet")
        write_docs(path, args.docs)
        import ray

        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        print(f"{args.docs} documents, batches of {BATCH_ROWS}, 2 model workers, {cores} cores, "
              f"ray {ray.__version__}")
        for run in range(1, args.runs + 1):
            figures = {}
            for name, job in (("flumen", run_flumen), ("ray data", run_ray)):
                seconds, first, rows = job(path)
                assert rows == args.docs, (name, rows)
                figures[name] = seconds, first
                print(f"run {run} {name:8}: {seconds:7.2f} s  {rows / seconds:9.0f} rows/s  "
                      f"first batch {first:6.2f} s", flush=True)
            ratio = figures["ray data"][0] / figures["flumen"][0]
            print(f"run {run} flumen / ray data throughput: {ratio:.2f}x "
                  f"(first batch {figures['ray data'][1] / figures['flumen'][1]:.2f}x sooner)")
        ray.shutdown()


if __name__ == "__main__":
    main()
