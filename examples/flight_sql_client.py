"""Query `flumen serve` from Python with the ADBC Flight SQL driver.

    pip install adbc-driver-flightsql pyarrow
    flumen serve &                      # prints where its token is
    python examples/flight_sql_client.py grpc://127.0.0.1:50051 ~/.local/share/flumen/serve-token

With a user file instead (`flumen serve --users FILE`), connect with
db_kwargs={"username": ..., "password": ...}.
"""

import sys

import adbc_driver_flightsql
import adbc_driver_flightsql.dbapi as flight_sql

uri, token_file = sys.argv[1], sys.argv[2]
with open(token_file) as f:
    token = f.read().strip()

conn = flight_sql.connect(
    uri,
    db_kwargs={
        adbc_driver_flightsql.DatabaseOptions.AUTHORIZATION_HEADER.value: f"Bearer {token}"
    },
    autocommit=True,
)
with conn, conn.cursor() as cur:
    # Embeddings computed by the server's model, streamed back as Arrow.
    cur.execute(
        "SELECT id, topic, embed(clean_text(body)) AS v FROM docs WHERE id < ? ORDER BY id",
        parameters=(4,),
    )
    table = cur.fetch_arrow_table()
    print(f"{table.num_rows} rows, columns {table.column_names}")
    for row in table.slice(0, 4).to_pylist():
        print(row["id"], row["topic"], f"{len(row['v'])} dims", [round(x, 3) for x in row["v"][:3]])

    # Rows as NumPy, as a trainer would take them.
    vectors = table.column("v").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    print("vectors", vectors.shape, vectors.dtype)
