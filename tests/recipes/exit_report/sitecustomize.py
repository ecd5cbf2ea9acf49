"""Loaded at start-up by every Python process that has this folder on PYTHONPATH (the layout tests put
it there for their torchrun ranks). A rank (RANK is set) prints, as its last exit handler, the names of
its threads: a process group still alive at that point has gloo threads (`pt_gloo_runloop`,
`gloo_tcp_loop`), and is then freed during interpreter finalisation, where it can abort a finished run
(`recipes.training.runtime.teardown`)."""

import atexit
import os
import sys
from pathlib import Path


def _report() -> None:
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # a thread that ended while we looked
            continue
    # One write(2) of the whole line: the ranks share the launcher's pipe, and print() writes the text and
    # the newline separately, so two ranks exiting together once gave "...rank=1 a b[exit-threads] rank=0 a b"
    # on one line and rank 0's report was not found. A write under PIPE_BUF (4 KiB) is not interleaved.
    sys.stderr.flush()
    os.write(2, f"[exit-threads] rank={os.environ['RANK']} {' '.join(sorted(names))}\n".encode())


if "RANK" in os.environ:
    atexit.register(_report)  # registered first, so it runs after every handler the program registers
