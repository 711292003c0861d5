"""The ``expq`` console script's entry point: signals are handled from its first line.

Importing the command line (``expq.cli``: typer, rich, click) takes a moment during which Python's default
handling would apply (a traceback for SIGINT, a silent death for SIGTERM and SIGHUP). ``main`` first makes those
signals end the process with one line and 128 + the signal (``interrupts.end_on_signals``), then imports the
command line and runs ``cli.console``, which takes the signals over (``interrupts.raise_on_signals``).
``python -m expq.cli`` does the same from the first line of ``expq/cli.py``.
"""

from __future__ import annotations


def main() -> None:
    """The ``expq`` console script: ``interrupts.guard_start``, then ``cli.console``."""
    from .interrupts import guard_start

    guard_start()
    from .cli import console

    console()
