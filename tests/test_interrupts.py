"""The one stop signal (``interrupts.STOP``) and the one rule for what resumes after an error (``errors.resumable``),
which the local run, the Ray driver and ``--stream`` all use."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from expq.errors import (ClusterError, HubAuthError, HubError, HubOfflineError, Interrupted, LayoutError,
                         NonFiniteError, OutputError, SourceError, UsageError, resumable)
from expq.interrupts import STOP, stop_on_signals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_real_signal_sets_the_one_stop_signal(sig):
    before = signal.getsignal(sig)
    with pytest.raises(Interrupted) as raised, stop_on_signals() as stop:
        assert stop is STOP and not stop.is_set()
        os.kill(os.getpid(), sig)
        assert stop.wait(5)  # the handler ran in this (the main) thread
        err = stop.interrupted()
        assert isinstance(err, Interrupted) and err.signum == sig and err.exit_code == 128 + sig
    # a signal the body did not act on still ends the run as interrupted (it came after the body's last look)
    assert raised.value.signum == sig
    assert signal.getsignal(sig) is before and not STOP.is_set()


def test_outside_the_main_thread_no_handler_is_installed():
    seen = []

    def run():
        with stop_on_signals() as stop:
            seen.append((stop is STOP, signal.getsignal(signal.SIGINT)))

    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [(True, before)]


@pytest.mark.parametrize("err,keep", [
    (Interrupted(signal.SIGTERM), True),
    (KeyboardInterrupt(), True),  # before the handlers are in place
    (OSError(28, "No space left on device"), True),
    (OutputError("cannot write", file="model.safetensors"), True),
    (HubError("the Hub answered 500", repo="me/x"), True),
    (HubOfflineError("offline", repo="me/x"), True),
    (HubAuthError("401", repo="me/x"), True),
    (ClusterError("the Ray task writing model.safetensors failed after 3 retries: the worker died"), True),
    (SourceError("truncated", file="a.safetensors"), False),
    (NonFiniteError("NaN", tensor="w"), False),
    (LayoutError("unknown architecture"), False),
    (UsageError("bad option"), False),
    (ValueError("a bug"), False),
])
def test_what_resumes(err, keep):
    assert resumable(err) is keep

