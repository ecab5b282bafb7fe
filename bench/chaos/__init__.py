"""Chaos run of the failure contract: ``pdserve bench chaos`` / ``python -m bench.chaos [--json FILE]``.

    workload.py  the requests (seeded sampling, stop strings, client cancels and deadlines) and their
                 reference outputs from the colocated engine
    client.py    one request as the client sees it
    drills.py    the faults: admission burst, kill -9 prefill / decode, stalled / corrupted / dropped KV
                 transfers, a hung decode loop; each fires on a condition
    run.py       steady clients + the drill schedule against a running cluster; settle and leak check
    report.py    each request judged against its reference; figures, table, contract, JSON
    cli.py       the command line
"""


def main(argv: list[str] | None = None) -> int:
    from bench.chaos.cli import main as run
    return run(argv)
