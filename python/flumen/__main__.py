"""``python -m flumen worker [OPTIONS]``: serve as a worker process for a flumen driver.

The options are those of ``flumen worker`` (``--help`` lists them). A Python session in
worker mode starts its workers this way; on other hosts, start them by hand and point
``flumen.Session(cluster=...)`` at them. Besides flumen's own functions, these workers run
the Python models and functions their driver ships with its tasks.
"""

import sys

from ._flumen import worker_main

USAGE = "usage: python -m flumen worker [OPTIONS]   (python -m flumen worker --help)"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] != "worker":
        print(USAGE, file=sys.stderr)
        return 2
    return worker_main(["flumen worker", *args[1:]])


if __name__ == "__main__":
    sys.exit(main())
