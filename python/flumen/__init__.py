"""flumen from Python: SQL over Parquet, CSV, Delta, Iceberg and Arrow data, results as
Arrow; your own models (``@flumen.model``) and functions (``@flumen.udf``) run in its
accelerator and CPU pools, in this process's threads or in worker processes.

    import flumen
    ctx = flumen.Session(memory_budget="4GB", workers=4)
    ctx.register_parquet("docs", "docs.parquet")
    df = ctx.sql("SELECT id, embed(body) AS v FROM docs")
    table = df.to_arrow()                      # or to_pandas(), to_pylist()
    for batch in df.iter_batches():            # streamed: a slow consumer holds the query back
        ...

Results implement the Arrow PyCapsule interface (``__arrow_c_stream__``), so
``pyarrow.table(df)``, ``polars.DataFrame(df)`` and DuckDB read them without copies.
Waits release the GIL; Ctrl-C interrupts a running query.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa

from . import _shipping
from ._flumen import FlumenError
from ._flumen import DataFrame as _DataFrame
from ._flumen import Session as _Session

__all__ = ["Session", "DataFrame", "FlumenError", "model", "udf"]


def _literal(text: str) -> str:
    """``text`` as a SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _setting_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Session:
    """A flumen session: DataFusion's SQL with flumen's scheduler, memory budget and models.

    ``memory_budget``: bytes the session's queries may hold (``"4GB"``, ``"512MB"``);
    ``workers``: run tasks in that many CPU worker processes (and
    ``flumen.accelerator_slots`` accelerator worker processes) instead of this process's
    threads; ``cluster``: attach to workers already running on other hosts (a cluster file
    ``workers.toml``, ``"host:port,..."`` or ``"k8s://NAMESPACE/SELECTOR"``; see the
    README). Worker processes are Python interpreters (``python -m flumen worker``) that
    also run the session's Python models and functions, shipped with the tasks.
    ``settings``: any other session setting by name (``{"flumen.device": "cpu"}``),
    applied as ``SET name = 'value'``.
    """

    def __init__(
        self,
        memory_budget: Optional[str] = None,
        workers: Optional[int] = None,
        cluster: Optional[str] = None,
        settings: Optional[dict[str, Any]] = None,
    ) -> None:
        pairs = []
        if memory_budget is not None:
            pairs.append(("flumen.memory_budget", str(memory_budget)))
        if workers is not None:
            if int(workers) < 1:
                raise ValueError(f"workers must be at least 1, got {workers}")
            pairs.append(("flumen.workers", "process"))
            pairs.append(("flumen.worker_processes", str(int(workers))))
        if cluster is not None:
            pairs.append(("flumen.workers", "process"))
            pairs.append(("flumen.cluster", str(cluster)))
        for name, value in (settings or {}).items():
            pairs.append((name, _setting_value(value)))
        self._inner = _Session(pairs, sys.executable)

    def sql(self, query: str) -> "DataFrame":
        """Plan ``query``; the rows are computed when asked for. ``SET``, ``CREATE`` and
        ``COPY ... TO`` statements take effect when their result is read (``.collect()``).
        A quoted path or URL reads as a table: ``SELECT * FROM 'data/t.parquet'``."""
        return DataFrame(self._inner.sql(query))

    def read_parquet(self, path: Any) -> "DataFrame":
        """The Parquet files at ``path`` (a file, a directory, a glob such as
        ``"data/*.parquet"``, an object-store URL, or a list of them) as a DataFrame:
        ``SELECT * FROM read_parquet(path)``."""
        return self._read("read_parquet", path)

    def read_csv(self, path: Any) -> "DataFrame":
        """The CSV files at ``path`` (as for :meth:`read_parquet`; a header row unless
        ``datafusion.catalog.has_header`` is off) as a DataFrame."""
        return self._read("read_csv", path)

    def read_json(self, path: Any) -> "DataFrame":
        """The newline-delimited JSON files at ``path`` (as for :meth:`read_parquet`) as a
        DataFrame."""
        return self._read("read_json", path)

    def _read(self, function: str, path: Any) -> "DataFrame":
        if isinstance(path, (list, tuple)):
            if not path:
                raise ValueError(f"{function}: no path given")
            argument = "[" + ", ".join(_literal(str(p)) for p in path) + "]"
        else:
            argument = _literal(str(path))
        return self.sql(f"SELECT * FROM {function}({argument})")

    def register_parquet(self, name: str, path: str) -> None:
        """Table ``name`` over Parquet files (a file, a directory, an object-store URL)."""
        self._inner.register_parquet(name, str(path))

    def register_csv(self, name: str, path: str) -> None:
        """Table ``name`` over CSV files with a header row."""
        self._inner.register_csv(name, str(path))

    def register_delta(
        self,
        name: str,
        path: str,
        version: Optional[int] = None,
        timestamp: Optional[str] = None,
        options: Optional[dict[str, str]] = None,
    ) -> None:
        """Table ``name`` over the Delta table at ``path`` (a directory or an object-store
        URL): its latest version, or ``version``, or the version current at ``timestamp``
        (RFC 3339). ``options``: the table's storage options (``aws.region``, ...)."""
        options = dict(options or {})
        if version is not None:
            options["version"] = str(int(version))
        if timestamp is not None:
            options["timestamp"] = str(timestamp)
        self._create_external(name, "DELTATABLE", path, options)

    def register_iceberg(
        self,
        name: str,
        path: str,
        snapshot_id: Optional[int] = None,
        timestamp: Optional[str] = None,
        options: Optional[dict[str, str]] = None,
    ) -> None:
        """Table ``name`` over the Iceberg table whose directory (holding ``metadata/``) is
        ``path``: its current snapshot, or ``snapshot_id``, or the one current at
        ``timestamp``. ``options``: the table's storage options."""
        options = dict(options or {})
        if snapshot_id is not None:
            options["snapshot_id"] = str(int(snapshot_id))
        if timestamp is not None:
            options["timestamp"] = str(timestamp)
        self._create_external(name, "ICEBERG", path, options)

    def _create_external(self, name: str, format: str, path: str, options: dict[str, str]) -> None:
        quoted = '"' + name.replace('"', '""') + '"'
        sql = f"CREATE EXTERNAL TABLE {quoted} STORED AS {format} LOCATION {_literal(str(path))}"
        if options:
            pairs = ", ".join(f"{_literal(k)} {_literal(str(v))}" for k, v in options.items())
            sql += f" OPTIONS ({pairs})"
        self.sql(sql).collect()

    def from_arrow(self, name: str, data: Any) -> "DataFrame":
        """Table ``name`` over any Arrow data with ``__arrow_c_stream__`` (a pyarrow table,
        a polars frame, another flumen result), shared without copying; returns it as a
        DataFrame."""
        self._inner.register_arrow(name, data)
        return self.sql(f'SELECT * FROM "{name}"')

    def deregister_table(self, name: str) -> bool:
        """Drop table ``name``; true when there was one."""
        return self._inner.deregister_table(name)

    def register_udf(self, name: str, function: Any, returns: Any = None) -> None:
        """Register Python function ``function`` (see ``flumen.udf``) as SQL function
        ``name``, run in the CPU tasks that evaluate it (in worker processes too: it ships
        with them, pickled by cloudpickle)."""
        returns = returns or getattr(function, "__flumen_udf__", {}).get("returns")
        if returns is None:
            raise TypeError(
                f"function {getattr(function, '__qualname__', function)!r} needs its result "
                "type: @flumen.udf(returns=pa....) or register_udf(..., returns=...)"
            )
        packed = _packed(name, {"kind": "udf", "object": function, "returns": returns})
        self._inner.register_udf(name, function, returns, packed)

    def register_model(self, name: str, cls: Any, **overrides: Any) -> None:
        """Register model class ``cls`` (see ``flumen.model``) as SQL function ``name``,
        run in the accelerator pool with its CPU arguments below it; keyword arguments
        (``returns``, ``batch_rows``, ``device``, ``concurrency``) override the decorator's.
        In worker mode the class ships to the accelerator worker processes (pickled by
        cloudpickle), each of which makes one instance."""
        spec = {**getattr(cls, "__flumen_model__", {}), **overrides}
        returns = spec.get("returns")
        if returns is None:
            raise TypeError(
                f"model {getattr(cls, '__qualname__', cls)!r} needs its result type: "
                "@flumen.model(returns=pa....) or register_model(..., returns=...)"
            )
        concurrency = spec.get("concurrency")
        if concurrency:
            self.sql(f"SET flumen.accelerator_slots = {int(concurrency)}").collect()
        batch_rows = spec.get("batch_rows")
        device = spec.get("device") or "cpu"
        packed = _packed(
            name,
            {
                "kind": "model",
                "object": cls,
                "returns": returns,
                "batch_rows": batch_rows,
                "device": device,
            },
        )
        self._inner.register_model(name, cls, returns, batch_rows, device, packed)


def _numpy_columns(table: pa.Table) -> dict[str, np.ndarray]:
    """Each column of ``table`` as one numpy array (a vector column as a 2-D array)."""
    columns = {}
    for name, column in zip(table.column_names, table.columns):
        column = column.combine_chunks()
        if pa.types.is_fixed_size_list(column.type) and column.null_count == 0:
            width = column.type.list_size
            values = column.flatten().to_numpy(zero_copy_only=False)
            columns[name] = values.reshape(len(column), width)
        else:
            columns[name] = column.to_numpy(zero_copy_only=False)
    return columns


def _packed(name: str, spec: dict[str, Any]) -> Optional[bytes]:
    """``spec`` packed for worker processes, or None with a warning saying why not."""
    packed, why = _shipping.try_pack(spec)
    if packed is None:
        warnings.warn(
            f"flumen: {name} cannot ship to worker processes ({why}); in worker mode its "
            "tasks run in this process",
            stacklevel=3,
        )
    return packed


class DataFrame:
    """A planned query. Reading it runs it; each read runs it again."""

    def __init__(self, inner: _DataFrame) -> None:
        self._inner = inner

    @property
    def schema(self) -> pa.Schema:
        """The result's Arrow schema."""
        return pa.schema(self._inner)

    def __arrow_c_schema__(self) -> Any:
        return self._inner.__arrow_c_schema__()

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        return self._inner.__arrow_c_stream__(requested_schema)

    def _batches(self) -> Iterator[pa.RecordBatch]:
        for exported in self._inner.batches():
            yield pa.record_batch(exported)

    def iter_batches(
        self,
        batch_rows: Optional[int] = None,
        epochs: int = 1,
        shuffle_seed: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> Iterator[pa.RecordBatch]:
        """The result's batches as the query produces them; the query runs as far ahead of
        the consumer as its memory budget allows. ``batch_rows``: re-cut them to at most
        that many rows (slices, no copies). ``epochs``: run the query that many times, one
        after the other. ``shuffle_seed``: each epoch's rows in a random order, seeded by
        ``shuffle_seed + epoch`` (flumen's shuffle, an exchange: the same seed gives the
        same order). ``rank``, ``world_size``: only this data-parallel rank's share of the
        rows (by a hash of each row's values: the ranks' shares are disjoint and hold every
        row between them)."""
        inner = self._inner
        if world_size != 1:
            inner = inner.sharded(rank, world_size)
        for epoch in range(epochs):
            source = inner
            if shuffle_seed is not None:
                source = inner.shuffled(shuffle_seed + epoch)
            for exported in source.batches():
                batch = pa.record_batch(exported)
                if batch_rows is None or batch.num_rows <= batch_rows:
                    yield batch
                    continue
                for start in range(0, batch.num_rows, batch_rows):
                    yield batch.slice(start, batch_rows)

    def iter_numpy_batches(
        self,
        batch_size: int = 256,
        epochs: int = 1,
        shuffle_seed: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> Iterator[dict[str, np.ndarray]]:
        """The result as batches of exactly ``batch_size`` rows (the last of each epoch may
        be shorter, or dropped with ``drop_last``), each a dict of numpy arrays by column: a
        fixed-size list column (a vector) becomes a 2-D array, a string column an object
        array. ``epochs``, ``shuffle_seed``, ``rank`` and ``world_size`` as in
        ``iter_batches``; streamed the same way."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        for epoch in range(epochs):
            pending: list[pa.RecordBatch] = []
            rows = 0
            one_epoch = self.iter_batches(
                shuffle_seed=None if shuffle_seed is None else shuffle_seed + epoch,
                rank=rank,
                world_size=world_size,
            )
            for batch in one_epoch:
                pending.append(batch)
                rows += batch.num_rows
                while rows >= batch_size:
                    table = pa.Table.from_batches(pending, schema=batch.schema)
                    yield _numpy_columns(table.slice(0, batch_size))
                    rest = table.slice(batch_size)
                    pending = rest.to_batches()
                    rows = rest.num_rows
            if rows and not drop_last:
                yield _numpy_columns(pa.Table.from_batches(pending, schema=self.schema))

    def iter_torch_batches(
        self,
        batch_size: int = 256,
        device: str = "cpu",
        dtypes: Optional[dict[str, Any]] = None,
        **options: Any,
    ) -> Iterator[dict[str, Any]]:
        """``iter_numpy_batches`` as dicts of ``torch.Tensor`` on ``device`` (needs torch);
        ``dtypes``: a torch dtype per column name. Every column must be numeric (select
        only what the model trains on). Keyword ``options`` as in ``iter_numpy_batches``
        (``epochs``, ``shuffle_seed``, ``rank``, ``world_size``, ``drop_last``)."""
        import torch

        dtypes = dtypes or {}
        for batch in self.iter_numpy_batches(batch_size=batch_size, **options):
            tensors = {}
            for name, values in batch.items():
                if values.dtype == object:
                    raise TypeError(
                        f"column {name!r} is not numeric and cannot be a tensor: select only "
                        "numeric columns (or vectors) for iter_torch_batches"
                    )
                tensors[name] = torch.as_tensor(values, dtype=dtypes.get(name), device=device)
            yield tensors

    def to_torch(self, batch_size: int = 256, device: str = "cpu", **options: Any) -> Any:
        """A ``torch.utils.data.IterableDataset`` over ``iter_torch_batches`` (needs torch):
        each item a batch (use ``DataLoader(dataset, batch_size=None)``). Give each
        data-parallel rank its ``rank`` and ``world_size``; keep ``num_workers=0``: the
        query already runs in flumen's own threads and worker processes."""
        import torch.utils.data

        frame = self

        class FlumenDataset(torch.utils.data.IterableDataset):
            def __iter__(self):
                if torch.utils.data.get_worker_info() is not None:
                    raise RuntimeError(
                        "a flumen dataset runs in the DataLoader's own process: use "
                        "num_workers=0 (flumen's workers do the loading)"
                    )
                return frame.iter_torch_batches(batch_size=batch_size, device=device, **options)

        return FlumenDataset()

    def collect(self) -> list[pa.RecordBatch]:
        """Run the query; all its batches."""
        return list(self._batches())

    def to_arrow(self) -> pa.Table:
        """Run the query; its rows as a pyarrow Table."""
        return pa.Table.from_batches(self.collect(), schema=self.schema)

    def to_pandas(self) -> Any:
        """Run the query; its rows as a pandas DataFrame (needs pandas)."""
        return self.to_arrow().to_pandas()

    def to_pylist(self) -> list[dict[str, Any]]:
        """Run the query; its rows as a list of dicts."""
        return self.to_arrow().to_pylist()

    def show(self, rows: int = 20) -> None:
        """Print the first ``rows`` rows."""
        shown = []
        count = 0
        for batch in self._batches():
            shown.append(batch.slice(0, rows - count))
            count += shown[-1].num_rows
            if count >= rows:
                break
        print(pa.Table.from_batches(shown, schema=self.schema))

    def explain(self, analyze: bool = False) -> str:
        """The plan with flumen's operators (``analyze``: run it and show its figures)."""
        return self._inner.explain(analyze)

    def __repr__(self) -> str:
        return f"flumen.DataFrame({self.schema})"


def model(
    returns: Any,
    batch_rows: Optional[int] = None,
    device: str = "cpu",
    concurrency: Optional[int] = None,
):
    """Mark a class as a model for ``Session.register_model``.

    ``cls()`` loads the model (once per accelerator worker, kept for every later block);
    ``instance(batch)`` gets a ``pyarrow.RecordBatch`` whose columns are the SQL call's
    arguments (``arg0``, ``arg1``, ...) and returns a ``pyarrow.Array`` of type ``returns``
    with one value per row. ``batch_rows``: most rows per call (default: whole blocks);
    ``device``: ``"cpu"`` or ``"cuda"``; ``concurrency``: accelerator workers (the session's
    ``flumen.accelerator_slots``).

        @flumen.model(returns=pa.list_(pa.float32(), 384), batch_rows=256)
        class Embedder:
            def __init__(self): self.model = load()
            def __call__(self, batch): return pa.array(self.model(batch.column(0)))
    """

    def mark(cls):
        cls.__flumen_model__ = {
            "returns": returns,
            "batch_rows": batch_rows,
            "device": device,
            "concurrency": concurrency,
        }
        return cls

    return mark



def udf(returns: Any):
    """Mark a function as a CPU function for ``Session.register_udf``: ``function(batch)``
    gets a ``pyarrow.RecordBatch`` of the SQL call's arguments (``arg0``, ...) and returns
    a ``pyarrow.Array`` of type ``returns``, one value per row. It runs in CPU tasks,
    taking the GIL while Python runs.

        @flumen.udf(returns=pa.int64())
        def word_count(batch):
            return pa.array([len(t.split()) for t in batch.column(0).to_pylist()])
    """

    def mark(function):
        function.__flumen_udf__ = {"returns": returns}
        return function

    return mark
