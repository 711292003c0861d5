"""Device lists: ``--device auto|cpu|cuda|cuda:N|cuda:0,cuda:1,...``."""

from __future__ import annotations

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
