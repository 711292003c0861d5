"""What a directory source's identity costs: the full sha256 of every shard and side file (``api.local_identity``,
which ``expq convert`` computes before it plans OUT's journal), against the conversion it belongs to.

    python bench/identity_cost.py [--model mixtral-8x7b:1] [--shard-size 2GB] [--runs 3] [--work DIR]
                                  [--json OUT.json]

The checkpoint is built by ``bench/convert.py``'s builder (random bf16 weights at a real architecture's widths; see
its ``--model``). Each figure is the median of ``--runs`` runs, the source read once beforehand (in the page cache,
as ``bench/convert.py`` measures conversions):

* ``identity``: ``local_identity`` of the opened source, in this process (one thread per core, at most 8, one file
  per thread): seconds and GB/s of source;
* ``sha256 1 thread``: the same files hashed one after another in 16 MiB reads (what one core gives);
* ``convert``: ``python -m expq.cli convert SRC OUT --device cpu --json`` in a fresh process, OUT removed before each
  run: its wall time, which includes the identity;
* ``share``: identity / convert, the part of a conversion the full hash takes; and ``up-to-date re-run``: the same
  command once more on the finished OUT (the identity plus the sha256 of every output file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from convert import build_checkpoint, model_spec, parse_size, warm  # noqa: E402


def timed(fn, runs: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def sha256_one_thread(paths: list[Path]) -> None:
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)


def cli_convert(src: Path, out: Path, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "expq.cli", "convert", str(src), str(out), "--device", "cpu", "--json"],
                       env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mixtral-8x7b:1")
    ap.add_argument("--shard-size", type=parse_size, default=parse_size("2GB"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/expq-bench-identity"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from expq.api import local_identity
    from expq.source import open_source

    spec = model_spec(args.model, args.shard_size)
    src = args.work / f"src-{spec.name.replace(':', '-')}"
    build_checkpoint(spec, src)
    files = sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith("."))
    nbytes = sum(p.stat().st_size for p in files)
    warm(files)
    source = open_source(src)
    t_identity, _ = timed(lambda: local_identity(source), args.runs)
    t_one, _ = timed(lambda: sha256_one_thread(files), args.runs)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    out = args.work / "out"

    def fresh():
        shutil.rmtree(out, ignore_errors=True)
        warm(files)
        return cli_convert(src, out, env)

    t_convert, report = timed(fresh, args.runs)
    t_rerun, rerun = timed(lambda: cli_convert(src, out, env), args.runs)
    assert rerun["up_to_date"], rerun
    row = {"model": spec.name, "files": len(files), "source_bytes": nbytes, "cores": os.cpu_count(),
           "identity_s": round(t_identity, 3), "identity_gbps": round(nbytes / t_identity / 1e9, 3),
           "sha256_one_thread_s": round(t_one, 3), "sha256_one_thread_gbps": round(nbytes / t_one / 1e9, 3),
           "convert_s": round(t_convert, 3), "share": round(t_identity / t_convert, 3),
           "rerun_up_to_date_s": round(t_rerun, 3), "bytes_out": report["bytes_out"]}
    print(json.dumps(row, indent=1))
    if args.json:
        args.json.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
