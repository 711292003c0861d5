"""``--ray local`` from a working directory that holds a folder named ``expq`` (a package of that name, or an OUT
called so): Ray puts the driver's working directory first on its workers' import path, and expq starts Ray from the
folder of its own package so that the workers import the driver's expq. A real local cluster in a subprocess, run
through the installed ``expq`` command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import example, tree_digest

import expq

pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_local_works_beside_a_folder_named_expq(tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, "mixtral")
    ref = tmp_path / "ref"
    expq.convert(src, ref, device="cpu")
    work = tmp_path / "work"
    (work / "expq").mkdir(parents=True)
    (work / "expq" / "__init__.py").write_text('raise ImportError("the folder named expq in the working directory")\n')
    command = shutil.which("expq", path=str(Path(sys.executable).parent)) or pytest.skip("no expq command")
    env = {**os.environ, "PYTHONPATH": str(Path(expq.__file__).resolve().parents[1])}
    p = subprocess.run([command, "convert", str(src), "out", "--ray", "local", "--device", "cpu"], cwd=work, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout
    assert tree_digest(work / "out") == tree_digest(ref)
