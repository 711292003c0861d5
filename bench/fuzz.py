"""Long fuzz run over the safetensors header parser and the config reader; prints the counts.

    python bench/fuzz.py N            # N inputs for each of the two targets (make fuzz: FUZZ_N, default 20000)
    python bench/fuzz.py N --seed S   # another random stream

Every input must end in a clean ``SourceError``/``LayoutError`` (one line) or be accepted; headers must be accepted
exactly when the safetensors library opens them. Prints, per target: inputs tried, clean errors, accepted, crashes
(and the first few crash messages). Exit status 1 if anything crashed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's expq, and the shared strategies

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from fuzz_cases import Counts, check_config, check_header, config_mutations, safetensors_blobs  # noqa: E402


def run(target, strategy, n: int, rng_seed: int, counts: Counts) -> None:
    """Feed ``n`` inputs from ``strategy`` to ``target``, recording crashes instead of stopping at the first."""
    @seed(rng_seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def body(value):
        signal.alarm(10)  # an input that hangs the reader is a crash too
        try:
            target(value, counts)
        except Exception as e:  # noqa: BLE001 - a crash or an oracle failure: count it and go on
            counts.crashes.append(f"{type(e).__name__}: {str(e)[:200]} | input {value!r:.200}"
                                  f" | {traceback.format_exc().splitlines()[-3].strip()}")
        finally:
            signal.alarm(0)

    body()


def _hang(signum, frame):
    raise TimeoutError("no answer within 10 s (a hang)")


def main() -> int:
    """Run both targets and print their counts."""
    signal.signal(signal.SIGALRM, _hang)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["header", "config"])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="expq-fuzz-"))
    code = 0
    try:
        if args.only in (None, "header"):
            counts, t = Counts(), time.time()
            f = work / "fuzz.safetensors"
            run(lambda blob, c: check_header(blob, f, c), safetensors_blobs(), args.n, args.seed, counts)
            code |= report(counts, "header parser", time.time() - t)
        if args.only in (None, "config"):
            from expq.examples import build_example

            src = build_example("qwen3_moe", work / "src", max_shard_size="60KB")
            base = json.loads((src / "config.json").read_text())
            counts, t = Counts(), time.time()
            run(lambda ch, c: check_config(src, base, ch, c), config_mutations(), args.n, args.seed, counts)
            code |= report(counts, "config reader", time.time() - t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return code


def report(counts: Counts, what: str, seconds: float) -> int:
    print(f"{counts.line(what)} ({seconds:.0f} s)", flush=True)
    seen = set()
    for c in counts.crashes:
        key = c.split(" | ")[0][:80]
        if key not in seen and len(seen) < 10:
            seen.add(key)
            print("  crash:", c)
    return 1 if counts.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
