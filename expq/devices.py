"""Device lists: ``--device auto|cpu|cuda|cuda:N|cuda:0,cuda:1,...``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .errors import UsageError


def parse_devices(spec: str | None) -> list[torch.device]:
    """``auto`` (every visible CUDA device, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``cuda:0,cuda:1,...``.

    Raises:
        UsageError: an unknown device, a device listed twice, or CUDA asked for where none is available.
    """
    spec = (spec or "auto").strip()
    if spec == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]
    devs = []
    for part in spec.split(","):
        part = part.strip()
        try:
            d = torch.device(part)
        except RuntimeError:
            raise UsageError(f"unknown device {part!r} (use auto, cpu, cuda, cuda:N or a comma-separated list)") \
                from None
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise UsageError(f"device {part} asked for, but CUDA is not available here")
            if d.index is None:
                d = torch.device("cuda:0")
            if d.index >= torch.cuda.device_count():
                raise UsageError(f"device {part} asked for, but only {torch.cuda.device_count()} CUDA devices exist")
        elif d.type != "cpu":
            raise UsageError(f"unsupported device {part!r}")
        devs.append(d)
    if len(set(devs)) != len(devs):
        raise UsageError(f"device listed twice in {spec!r}")
    return devs


@contextlib.contextmanager
def warm_up(devices: list[torch.device]) -> Iterator[None]:
    """Create the CUDA context of every GPU in ``devices`` in a background thread while the body runs, so that it
    overlaps opening the source and planning (about a second per process); a pipeline's first CUDA call waits for
    it. Leaving the body waits for the thread: a process that ends while CUDA is still starting (a conversion that
    is up to date, or fails early) aborts in the CUDA runtime ("terminate called without an active exception")
    instead of exiting with its own status. No-op on CPU."""
    gpus = [d for d in devices if d.type == "cuda"]

    def init() -> None:
        try:
            for d in gpus:
                torch.empty(1, device=d)
        except Exception:  # noqa: BLE001 - the pipeline's own first CUDA call reports it
            pass

    thread = threading.Thread(target=init, name="expq-cuda-init", daemon=True) if gpus else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        if thread is not None:
            thread.join()
