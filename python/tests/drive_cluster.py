"""The driver of `tests/integration/python.rs`'s cluster test: a Python session attached to the workers
of a cluster file (`python -m flumen worker` on namespace hosts), running a Python model
(shipped by value: this script is `__main__`) and a Python function over a Parquet file.
Prints one JSON line: the pids the model and function ran in, and whether the answers
equal the class and function called here."""

import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

import flumen

cluster_file, workdir = sys.argv[1], sys.argv[2]
ROWS = 12_000


@flumen.model(returns=pa.list_(pa.int64(), 2), batch_rows=500)
class LengthAndPid:
    def __call__(self, batch):
        lengths = [len(t) for t in batch.column(0).to_pylist()]
        return pa.array([[n, os.getpid()] for n in lengths], pa.list_(pa.int64(), 2))


@flumen.udf(returns=pa.int64())
def pid_of(batch):
    return pa.array([os.getpid()] * batch.num_rows, pa.int64())


path = os.path.join(workdir, "docs.parquet")
bodies = [f"document {i} " * (1 + i % 7) for i in range(ROWS)]
pq.write_table(pa.table({"id": pa.array(range(ROWS), pa.int64()), "body": bodies}), path,
               row_group_size=1000)
ctx = flumen.Session(cluster=cluster_file, settings={"flumen.device": "cpu",
                                                     "flumen.model_split_rows": 1000})
ctx.register_parquet("docs", path)
ctx.register_model("length_and_pid", LengthAndPid)
ctx.register_udf("pid_of", pid_of)
got = ctx.sql(
    "SELECT id, length_and_pid(upper(body)) AS lp, pid_of(id) AS cpu_pid FROM docs ORDER BY id"
).to_arrow()
pairs = got.column("lp").to_pylist()
print(json.dumps({
    "rows": got.num_rows,
    "ids_in_order": got.column("id").to_pylist() == list(range(ROWS)),
    "lengths_equal": [p[0] for p in pairs] == [len(b.upper()) for b in bodies],
    "model_pids": sorted({p[1] for p in pairs}),
    "function_pids": sorted(set(got.column("cpu_pid").to_pylist())),
    "driver_pid": os.getpid(),
}))
