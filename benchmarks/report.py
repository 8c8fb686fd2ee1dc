"""What a benchmark's committed table starts and ends with: the command that made it and the
machine it ran on (so the table can be reproduced and judged), then the file it goes to."""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import jax


def header(machine: str) -> list[str]:
    """The command line of this run and a date/versions line ending with `machine`."""
    script = f"benchmarks/{os.path.basename(sys.argv[0])}"
    return [f"Command: `python {script} {' '.join(sys.argv[1:])}`".rstrip(), "",
            f"Date: {datetime.date.today()}; jax {jax.__version__}; "
            f"Python {platform.python_version()}; {os.cpu_count()} CPU cores{machine}"]


def publish(lines: list[str], out: str | None) -> None:
    """Print the table, and write it to `out` when given."""
    text = "\n".join(lines) + "\n"
    if out:
        Path(out).write_text(text)
    print(text)
