"""``make demo`` (``python -m expq.demo DIR``), the README's first command, as a new user runs it: in a folder whose
name has spaces and brackets, its output in a log (CI).

About 45 s on an idle 2-core machine (every step a real ``expq`` process), so it is marked slow: ``make test-slow``
runs it (CI too, after ``make test``); ``make demo`` itself runs the same code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_and_says_what_it_shows(tmp_path):
    work = tmp_path / "my demo [1]"
    env = {**os.environ, "CI": "true"}
    env.pop("EXPQ_PROGRESS_INTERVAL", None)
    r = subprocess.run([sys.executable, "-m", "expq.demo", str(work)], capture_output=True, text=True, timeout=900,
                       env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Its weights are random (seeded), not trained: the text it generates is gibberish, by design." in r.stdout
    assert "greedy tokens equal: True" in r.stdout and "PASS: 4 MoE layers x 8 experts" in r.stdout
    assert "Could not match `re:" not in out  # compressed-tensors' harmless warning, silenced where expq loads
    assert "\r" not in out and "Loading weights" not in out  # no progress bars in a log
    assert "--- README.md (model card) ---" in r.stdout and "> **Warning" not in r.stdout
    # expq run prints the continuation alone: the prompt is not glued to it
    run_out = r.stdout.split("$ expq run ", 1)[1].splitlines()[1:]
    assert run_out and not any(ln.startswith("The router picks the top-k experts") for ln in run_out), run_out
    assert (work / "mixtral-demo-int8" / "expq.json").is_file()
