"""A Python client of `flumen serve`, as users write one: the ADBC Flight SQL driver
(`adbc-driver-flightsql`) for SQL, `pyarrow.flight` for flumen's own actions.

Run by tests/integration/serve.rs: `adbc_client.py SCENARIO URI [ARGS...]`. Credentials come on stdin
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


def flight_client():
    client = flight.FlightClient(URI)
    options = flight.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {SECRETS['token']}".encode())]
    )
    return client, options


def create_job(client, options, **request):
    body = json.dumps(request).encode()
    result = list(client.do_action(flight.Action("flumen.create_dataset", body), options))
    return json.loads(result[0].body.to_pybytes())


def ticket_of(job, epoch, consumer):
    for t in job["tickets"]:
        if t["epoch"] == epoch and t["consumer"] == consumer:
            return flight.Ticket(bytes.fromhex(t["ticket"]))
    raise KeyError((epoch, consumer))


def read_epoch(client, options, ticket, sleep=0.0, blocks=None):
    """A trainer's loop: one block per DoGet until an empty one; ids as NumPy."""
    ids = []
    count = 0
    while True:
        table = client.do_get(ticket, options).read_all()
        if table.num_rows == 0:
            break
        ids.extend(table.column("id").to_numpy().tolist())
        count += 1
        if sleep:
            time.sleep(sleep)
    if blocks is not None:
        blocks.append(count)
    return ids


def trainers():
    """Two trainers x 2 epochs over 100k rows (one slow), and a second job on the same
    dataset read at the same time."""
    client, options = flight_client()
    request = dict(
        name="train",
        sql="SELECT value AS id FROM generate_series(1, 100000)",
        epochs=2,
        consumers=2,
        batch_rows=1000,
        shuffle_seed=3,
    )
    job = create_job(client, options, **request)
    other = create_job(client, options, **{**request, "consumers": 1})
    out = {"shared": other["shared"], "epochs": []}
    for epoch in range(2):
        results = {}
        blocks = {"fast": [], "slow": [], "other": []}
        started = time.monotonic()

        def run(name, ticket, sleep):
            c, o = flight_client()
            results[name] = read_epoch(c, o, ticket, sleep, blocks[name])

        threads = [
            threading.Thread(target=run, args=("fast", ticket_of(job, epoch, 0), 0.0)),
            threading.Thread(target=run, args=("slow", ticket_of(job, epoch, 1), 0.02)),
            threading.Thread(target=run, args=("other", ticket_of(other, epoch, 0), 0.0)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        both = sorted(results["fast"] + results["slow"])
        out["epochs"].append(
            {
                "exactly_once": both == list(range(1, 100001)),
                "other_exactly_once": sorted(results["other"]) == list(range(1, 100001)),
                "fast_blocks": blocks["fast"][0],
                "slow_blocks": blocks["slow"][0],
                "shuffled": results["fast"][:1000] != sorted(results["fast"][:1000])
                or results["fast"] != sorted(results["fast"]),
                "seconds": round(time.monotonic() - started, 2),
            }
        )
    report = list(client.do_action(flight.Action("flumen.datasets", b""), options))
    out["report"] = json.loads(report[0].body.to_pybytes())
    return out


def killed_consumer():
    """Consumer 1 is a separate process, SIGKILLed while it holds an unacknowledged block:
    that block reaches consumer 0."""
    import signal
    import subprocess

    client, options = flight_client()
    job = create_job(
        client,
        options,
        name="killed",
        sql="SELECT value AS id FROM generate_series(1, 20000)",
        consumers=2,
        batch_rows=500,
    )
    child = subprocess.Popen(
        [sys.executable, __file__, "consume_one_by_one", URI, ticket_of(job, 0, 1).ticket.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child.stdin.write(json.dumps(SECRETS) + "\n")
    child.stdin.flush()
    acknowledged = []
    held = None
    for i in range(3):
        block = json.loads(child.stdout.readline())
        if i < 2:
            acknowledged.extend(block)
            child.stdin.write("next\n")
            child.stdin.flush()
        else:
            held = block
    child.send_signal(signal.SIGKILL)
    child.wait()
    started = time.monotonic()
    rest = read_epoch(client, options, ticket_of(job, 0, 0))
    return {
        "exactly_once": sorted(rest + acknowledged) == list(range(1, 20001)),
        "held_block_reached_the_other": set(held) <= set(rest),
        "seconds_for_the_rest": round(time.monotonic() - started, 2),
    }


def consume_one_by_one():
    """The killed consumer: prints each block's ids, asks for the next one only when told."""
    client, options = flight_client()
    ticket = flight.Ticket(bytes.fromhex(ARGS[0]))
    while True:
        table = client.do_get(ticket, options).read_all()
        print(json.dumps(table.column("id").to_pylist()), flush=True)
        if sys.stdin.readline().strip() != "next":
            return {}


SCENARIOS = {
    "trainers": trainers,
    "killed_consumer": killed_consumer,
    "consume_one_by_one": consume_one_by_one,
    "tls": tls,
    "basics": basics,
    "create_table": create_table,
    "read_kept": read_kept,
    "two_clients": two_clients,
    "cancel": cancel,
}

print(json.dumps(SCENARIOS[SCENARIO]()))
