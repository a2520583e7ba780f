"""A Python client of `flumen serve`, as users write one: the ADBC Flight SQL driver
(`adbc-driver-flightsql`) for SQL, `pyarrow.flight` for flumen's own actions.

Run by tests/serve.rs: `adbc_client.py SCENARIO URI [ARGS...]`. Credentials come on stdin
(one JSON object: user, password, token), never in argv. Each scenario prints one JSON
object with what it saw; the Rust test checks it. A failed expectation raises (exit 1).
"""

import json
import math
import sys
import threading
import time

import adbc_driver_flightsql
import adbc_driver_flightsql.dbapi as flight_sql
import pyarrow.flight as flight

SCENARIO, URI = sys.argv[1], sys.argv[2]
ARGS = sys.argv[3:]
SECRETS = json.loads(sys.stdin.readline())


def connect_user(password=None):
    return flight_sql.connect(
        URI,
        db_kwargs={
            "username": SECRETS["user"],
            "password": SECRETS["password"] if password is None else password,
        },
        autocommit=True,
    )


def connect_token(token=None):
    token = SECRETS["token"] if token is None else token
    return flight_sql.connect(
        URI,
        db_kwargs={
            adbc_driver_flightsql.DatabaseOptions.AUTHORIZATION_HEADER.value: f"Bearer {token}"
        },
        autocommit=True,
    )


def running_queries():
    """flumen's progress view: the `flumen.queries` action, through pyarrow.flight."""
    client = flight.FlightClient(URI)
    options = flight.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {SECRETS['token']}".encode())]
    )
    results = list(client.do_action(flight.Action("flumen.queries", b""), options))
    return json.loads(results[0].body.to_pybytes())


def error_text(action):
    try:
        action()
    except Exception as e:  # the driver's error classes differ by failure
        return f"{type(e).__name__}: {e}"
    return None


def basics():
    seen = {}
    with connect_user() as conn, conn.cursor() as cur:
        cur.execute("SELECT id, embed(body) AS v FROM docs WHERE id < 3 ORDER BY id")
        table = cur.fetch_arrow_table()
        vectors = table.column("v").to_pylist()
        seen["ids"] = table.column("id").to_pylist()
        seen["dims"] = [len(v) for v in vectors]
        seen["norms"] = [round(math.sqrt(sum(x * x for x in v)), 4) for v in vectors]
        cur.execute("SELECT count(*) AS n FROM docs WHERE id < ?", parameters=(100,))
        seen["prepared_count"] = cur.fetchone()[0]
        cur.execute("SELECT ? || '!' AS s, ? * 2 AS d", parameters=("hi", 21))
        seen["prepared_row"] = list(cur.fetchone())
        info = conn.adbc_get_info()
        seen["vendor"] = info["vendor_name"]
        objects = conn.adbc_get_objects(depth="tables").read_all().to_pylist()
        seen["tables"] = sorted(
            t["table_name"]
            for c in objects
            for s in c["catalog_db_schemas"]
            for t in s["db_schema_tables"]
        )
        seen["sql_error"] = error_text(lambda: cur.execute("SELEC 1"))
        seen["missing_table"] = error_text(lambda: cur.execute("SELECT * FROM nowhere"))
    seen["wrong_password"] = error_text(
        lambda: connect_user("not the password").cursor().execute("SELECT 1")
    )
    with connect_token() as conn, conn.cursor() as cur:
        cur.execute("SELECT 40 + 2 AS answer")
        seen["token_answer"] = cur.fetchone()[0]
    seen["wrong_token"] = error_text(
        lambda: connect_token("00" * 32).cursor().execute("SELECT 1")
    )
    return seen


def create_table():
    csv_path = ARGS[0]
    with connect_user() as conn, conn.cursor() as cur:
        cur.execute(
            f"CREATE EXTERNAL TABLE kept STORED AS CSV LOCATION '{csv_path}' "
            "OPTIONS ('format.has_header' 'true')"
        )
        cur.execute("SELECT sum(a) FROM kept")
        return {"sum": cur.fetchone()[0]}


def read_kept():
    with connect_user() as conn, conn.cursor() as cur:
        cur.execute("SELECT sum(a) FROM kept")
        total = cur.fetchone()[0]
        cur.execute("DROP TABLE kept")
        return {"sum": total}


def two_clients():
    """Two connections at once, each with its own batch size, each querying while the
    other does."""
    out = {}
    barrier = threading.Barrier(2)

    def client(name, batch_size):
        with connect_user() as conn, conn.cursor() as cur:
            cur.execute(f"SET datafusion.execution.batch_size = {batch_size}")
            barrier.wait()
            cur.execute("SELECT count(*) FROM docs CROSS JOIN generate_series(1, 20)")
            rows = cur.fetchone()[0]
            cur.execute("SHOW datafusion.execution.batch_size")
            out[name] = {"batch_size": cur.fetchone()[1], "rows": rows}

    threads = [
        threading.Thread(target=client, args=("a", 1000)),
        threading.Thread(target=client, args=("b", 3000)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def cancel():
    """A query that would run for hours, cancelled by the client after a second."""
    out = {}
    with connect_user() as conn, conn.cursor() as cur:
        # Some 10^11 rows: hours of work.
        long_query = (
            "SELECT count(*) FROM generate_series(1, 100000000000) WHERE value % 7 = 3"
        )
        timer = threading.Timer(1.0, cur.adbc_cancel)
        started = time.monotonic()
        timer.start()
        out["error"] = error_text(lambda: (cur.execute(long_query), cur.fetchall()))
        out["seconds_until_cancelled"] = round(time.monotonic() - started, 2)
        timer.cancel()
        # The server lets go of it: no query left running within a few seconds.
        deadline = time.monotonic() + 10
        while running_queries() and time.monotonic() < deadline:
            time.sleep(0.1)
        out["running_after"] = len(running_queries())
        # The server's query threads are free again: the next query answers at once.
        started = time.monotonic()
        cur.execute("SELECT 1")
        out["next_query"] = cur.fetchone()[0]
        out["next_query_seconds"] = round(time.monotonic() - started, 2)
    return out


def tls():
    """Over TLS, trusting the server's CA (its PEM as the last argument)."""
    with open(ARGS[0]) as f:
        ca = f.read()
    conn = flight_sql.connect(
        URI,
        db_kwargs={
            "username": SECRETS["user"],
            "password": SECRETS["password"],
            adbc_driver_flightsql.DatabaseOptions.TLS_ROOT_CERTS.value: ca,
        },
        autocommit=True,
    )
    with conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM docs")
        return {"docs": cur.fetchone()[0]}


SCENARIOS = {
    "tls": tls,
    "basics": basics,
    "create_table": create_table,
    "read_kept": read_kept,
    "two_clients": two_clients,
    "cancel": cancel,
}

print(json.dumps(SCENARIOS[SCENARIO]()))
