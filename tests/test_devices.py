"""``devices.warm_up``: the CUDA warm-up thread is waited for when the body ends (normally or by an error), so that
no process exits while CUDA is still starting (which aborts it in the CUDA runtime)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from expq.devices import parse_devices, warm_up


def _slow_cuda_start(monkeypatch) -> tuple[threading.Event, list[str]]:
    """torch.empty on a CUDA device blocks until the returned event is set (a CUDA context that is slow to start);
    the list records when it finished."""
    release, log = threading.Event(), []
    real_empty = torch.empty

    def empty(*args, device=None, **kw):
        if device is not None and torch.device(device).type == "cuda":
            release.wait(10)
            log.append("cuda started")
            return real_empty(*args, **kw)
        return real_empty(*args, device=device, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    return release, log


@pytest.mark.parametrize("fails", [False, True])
def test_leaving_warm_up_waits_for_cuda_start(monkeypatch, fails):
    release, log = _slow_cuda_start(monkeypatch)
    threading.Timer(0.3, release.set).start()
    with pytest.raises(RuntimeError, match="early") if fails else contextlib.nullcontext():
        with warm_up([torch.device("cuda:0")]):
            assert log == []  # the body runs while CUDA starts
            if fails:
                raise RuntimeError("early")
    assert log == ["cuda started"]
    assert not any(t.name == "expq-cuda-init" for t in threading.enumerate())


def test_warm_up_starts_nothing_on_cpu(monkeypatch):
    _, log = _slow_cuda_start(monkeypatch)
    before = threading.active_count()
    with warm_up(parse_devices("cpu")):
        assert threading.active_count() == before
    assert log == []
