"""KV transfer benchmark: ``pdserve bench transfer`` / ``python -m bench.transfer [--json FILE] [--quick]``.

    driver.py   runs every link x transport x codec x payload, the memcpy and socket baselines; prints the table
    peer.py     one end of a run in its own process (``python -m bench.transfer.peer``) or Ray actor
    netns.py    shaped links: two network namespaces joined by a veth pair, tc-limited
    ttft.py     low-load TTFT: colocated vs disaggregated, with and without layer-wise streaming
                (``python -m bench.transfer.ttft``), the handoff after the first token split out
    handoff_probe.py  the handoff per transport (ray included), with and without layer-wise streaming, one process
"""


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see ``bench.transfer.driver``); returns the exit status."""
    # imported here, so that `python -m bench.transfer.peer` does not load the driver (and the peer) first
    from bench.transfer.driver import main as run

    return run(argv)
