"""Write and change the Delta source table of tests/integration/incremental.rs with the deltalake writer.

usage: change_source.py PATH create ROWS   -- version 0: ROWS docs, change data feed on
       change_source.py PATH change ROWS   -- on a table created with ROWS docs: update ids < 50,
                                              delete ROWS-100..ROWS-81, append ids ROWS..ROWS+29
       change_source.py PATH touch N       -- update ids 100..100+N
       change_source.py PATH plain ROWS    -- a table without the change data feed
       change_source.py PATH grow ROWS K   -- update ids < K, append ids ROWS..ROWS+K
"""

import sys

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

TOPICS = ["graphics", "databases", "gardening", "astronomy", "cooking"]


def docs(ids, note=""):
    ids = list(ids)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "topic": pa.array([TOPICS[i % len(TOPICS)] for i in ids]),
            "body": pa.array(
                [f"<p>Document {i} is about {TOPICS[i % len(TOPICS)]}{note}.</p>" for i in ids]
            ),
        }
    )


def main():
    path, action = sys.argv[1], sys.argv[2]
    if action == "create":
        write_deltalake(
            path,
            docs(range(int(sys.argv[3]))),
            configuration={"delta.enableChangeDataFeed": "true"},
        )
    elif action == "plain":
        write_deltalake(path, docs(range(int(sys.argv[3]))))
    elif action == "change":
        table = DeltaTable(path)
        table.update(
            updates={"body": "concat(body, ' Revised.')"}, predicate="id < 50"
        )
        rows = int(sys.argv[3])
        table.delete(f"id >= {rows - 100} AND id < {rows - 80}")
        write_deltalake(path, docs(range(rows, rows + 30)), mode="append")
    elif action == "touch":
        n = int(sys.argv[3])
        DeltaTable(path).update(
            updates={"body": "concat(body, ' Touched.')"},
            predicate=f"id >= 100 AND id < {100 + n}",
        )
    elif action == "grow":
        rows, k = int(sys.argv[3]), int(sys.argv[4])
        DeltaTable(path).update(
            updates={"body": "concat(body, ' Revised.')"}, predicate=f"id < {k}"
        )
        write_deltalake(path, docs(range(rows, rows + k)), mode="append")
    else:
        raise SystemExit(f"unknown action {action}")
    print(DeltaTable(path).version())


if __name__ == "__main__":
    main()
