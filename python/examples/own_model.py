"""Embed a Parquet table two ways in one query: flumen's built-in `embed`
(all-MiniLM-L6-v2, installed by `flumen install-model`) and a model class of your own,
each run by worker processes of the accelerator pool, the CPU work below them.

    python python/examples/own_model.py [DOCS.parquet] [--threads] [--rows N]

Without a file it writes N demo documents (2,000 unless `--rows` says). Your model here is a linear map over word
counts so that it runs anywhere; a Hugging Face model goes the same way: load it in
`__init__` (once per worker), call it in `__call__`, return one vector per row.
"""

import os
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import flumen

WORDS = ["data", "model", "query", "arrow", "table", "stream", "vector", "worker"]


@flumen.model(returns=pa.list_(pa.float32(), 8), batch_rows=256, concurrency=2)
class WordCountModel:
    """Your own model: loaded once per accelerator worker, called on blocks of rows."""

    def __init__(self):
        # e.g. AutoModel.from_pretrained("my-org/my-model").eval()
        rng = np.random.default_rng(0)
        self.weights = rng.standard_normal((len(WORDS), 8)).astype(np.float32)

    def __call__(self, batch: pa.RecordBatch) -> pa.Array:
        texts = batch.column(0).to_pylist()  # arg0: the SQL call's first argument
        counts = np.array(
            [[(t or "").split().count(w) for w in WORDS] for t in texts], dtype=np.float32
        ).reshape(len(texts), len(WORDS))
        vectors = counts @ self.weights
        return pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), 8)


def demo_docs(path: str, rows: int = 2000) -> None:
    bodies = [
        " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 4 + i % 9)) + f" (doc {i})"
        for i in range(rows)
    ]
    pq.write_table(pa.table({"id": pa.array(range(rows), pa.int64()), "body": bodies}), path)


def main() -> None:
    argv = sys.argv[1:]
    rows = 2000
    if "--rows" in argv:
        at = argv.index("--rows")
        rows = int(argv[at + 1])
        del argv[at : at + 2]
    args = [a for a in argv if not a.startswith("--")]
    workers = None if "--threads" in argv else 2
    with tempfile.TemporaryDirectory() as tmp:
        path = args[0] if args else os.path.join(tmp, "docs.parquet")
        if not args:
            demo_docs(path, rows)
        ctx = flumen.Session(workers=workers, settings={"flumen.device": "cpu"})
        ctx.register_parquet("docs", path)
        ctx.register_model("word_counts", WordCountModel)
        out = ctx.sql(
            "SELECT id, embed(body) AS minilm, word_counts(lower(body)) AS mine "
            "FROM docs ORDER BY id"
        ).to_arrow()
        first = out.slice(0, 1).to_pylist()[0]
        print(f"{out.num_rows} documents embedded")
        print(f"row 0: minilm[:4] = {np.round(first['minilm'][:4], 4).tolist()}, "
              f"|minilm| = {np.linalg.norm(first['minilm']):.3f}, "
              f"mine = {np.round(first['mine'], 2).tolist()}")


if __name__ == "__main__":
    main()
