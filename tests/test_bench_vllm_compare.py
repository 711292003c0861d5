"""bench/vllm_compare.py's parts that run without vLLM: the prompts, the distances against online experts_int8 over
several prompts, issue 26's bound (expq's kernel against Marlin on the same positions), and the scheduler that never
lets a serve start or end while another is in vLLM's memory profiling (real subprocesses standing in for serves)."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def vc():
    spec = importlib.util.spec_from_file_location("vllm_compare_under_test", BENCH / "vllm_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prompt_zero_is_serve_checks_and_every_prompt_differs(vc):
    """Prompt 0 keeps the formula of the earlier results (serve_check.py's), so old and new figures compare; the
    others are distinct sequences of in-vocabulary ids."""
    assert vc.prompt_ids(1000) == [(7919 * i + 13) % 1000 for i in range(1, vc.PROMPT_LEN + 1)]
    prompts = [tuple(vc.prompt_ids(1000, i)) for i in range(8)]
    assert len(set(prompts)) == 8
    assert all(len(p) == vc.PROMPT_LEN and all(0 <= t < 1000 for t in p) for p in prompts)


def record(prompt_lp, tokens, token_lp):
    return {"prompt_logprobs": prompt_lp, "tokens": tokens, "token_logprobs": token_lp}


def run(*records):
    return {"status": "ok", "data": {"prompts": list(records)}}


def test_compare_takes_the_maximum_and_the_median_over_prompts(vc):
    base = run(record([-1.0, -2.0], [5, 6, 7], [-0.1, -0.2, -0.3]),
               record([-1.0, -2.0], [1, 2, 3], [-0.1, -0.2, -0.3]),
               record([-1.0, -2.0], [4, 4, 4], [-0.1, -0.2, -0.3]))
    other = run(record([-1.5, -2.0], [5, 6, 7], [-0.1, -0.25, -0.3]),  # equal tokens; Δ prompt 0.5, gen 0.05
                record([-1.0, -2.1], [1, 9, 3], [-0.3, -5.0, -0.3]),  # differs at 1: gen Δ over token 0 only (0.2)
                record([-1.0, -2.0], [8, 4, 4], [-9.0, -0.2, -0.3]))  # differs at 0: no shared generated token
    c = vc.compare(base, other)
    assert c["prompts"] == 3 and c["prompts_equal"] == 1 and c["greedy_equal"] is False
    assert c["max_d_prompt_lp"] == pytest.approx(0.5) and c["median_d_prompt_lp"] == pytest.approx(0.1)
    assert c["max_d_gen_lp"] == pytest.approx(0.2) and c["median_d_gen_lp"] == pytest.approx(0.125)
    assert c["first_divergence"] == 0
    assert [p["common_prefix"] for p in c["per_prompt"]] == [3, 1, 0]
    json.dumps(c)  # the report writes it


def test_a_result_of_one_prompt_from_before_still_compares(vc):
    """Serves written before --prompts carry one prompt's fields at the top level."""
    base = {"status": "ok", "data": record([-1.0, -2.0], [1, 2], [-0.5, -0.5])}
    other = {"status": "ok", "data": record([-1.0, -2.25], [1, 3], [-0.75, -0.5])}
    c = vc.compare(base, other)
    assert (c["prompts"], c["max_d_prompt_lp"], c["max_d_gen_lp"], c["first_divergence"]) == (1, 0.25, 0.25, 1)


def test_the_bound_measures_both_kernels_on_the_tokens_both_share_with_online(vc):
    """Issue 26's bound: Marlin's distance on its own common prefix may cover fewer tokens than expq's; the bound
    compares both on the shorter prefix, so a large Δ that expq meets only after Marlin has diverged is not counted
    against it."""
    base = run(record([-1.0], [1, 2, 3, 4], [-0.1, -0.1, -0.1, -0.1]),
               record([-1.0], [1, 2, 3, 4], [-0.1, -0.1, -0.1, -0.1]))
    expq = run(record([-1.02], [1, 2, 3, 4], [-0.11, -0.1, -0.9, -0.1]),  # Δ 0.8 at token 2, after Marlin diverged
               record([-1.3], [1, 2, 3, 4], [-0.1, -0.1, -0.1, -0.1]))
    marlin = run(record([-1.01], [1, 2, 9, 9], [-0.13, -0.1, -0.1, -0.1]),
                 record([-1.1], [1, 2, 3, 4], [-0.1, -0.2, -0.1, -0.1]))
    b = vc.side_by_side(base, expq, marlin)
    assert b["gen_lp_shared"]["tokens"] == [2, 4]
    assert b["gen_lp_shared"]["a_max"] == pytest.approx(0.01) and b["gen_lp_shared"]["b_max"] == pytest.approx(0.1)
    assert b["gen_lp_shared"]["a_within_b"] == 2
    assert b["prompt_lp"]["a_max"] == pytest.approx(0.3) and b["prompt_lp"]["b_max"] == pytest.approx(0.1)
    assert b["prompt_lp"]["a_within_b"] == 0  # 0.02 > 0.01 on prompt 0, 0.3 > 0.1 on prompt 1
    # the whole common prefix, as compare() reports it, does count the late Δ
    assert vc.compare(base, expq)["max_d_gen_lp"] == pytest.approx(0.8)


FAKE_SERVE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    events, name = Path(os.environ["FAKE_EVENTS"]), Path(sys.argv[3]).stem
    def say(what):
        with open(events, "a") as f:
            f.write(f"{time.monotonic()} {what} {name}\\n")
    time.sleep(0.3)  # vLLM's import
    go = os.environ["EXPQ_VC_GO"]
    while not Path(go).exists():
        time.sleep(0.05)
    say("start")
    time.sleep(0.6)  # engine start and vLLM's memory profiling
    say("profiled")
    print("INFO Available KV cache memory: 1.00 GiB", flush=True)
    time.sleep(1.5)  # generate (vLLM: 10-20 s)
    Path(sys.argv[3]).write_text(json.dumps({"prompts": [], "load_s": 0.1}))
    hold = os.environ["EXPQ_VC_HOLD"]
    while not Path(hold).exists():
        time.sleep(0.05)
    say("end")
""")


def test_no_serve_starts_or_ends_while_another_is_in_memory_profiling(vc, tmp_path, monkeypatch):
    """Five stand-in serves, three at a time (real processes with the serves' logs and their go and release files):
    every one runs, several at once, and within each one's profiling window (its engine's start to its profiled
    line) no other one starts its engine or ends."""
    fake = tmp_path / "fake_serve.py"
    fake.write_text(FAKE_SERVE)
    events = tmp_path / "events"
    monkeypatch.setenv("FAKE_EVENTS", str(events))
    monkeypatch.setattr(vc, "__file__", str(fake))
    jobs = [{"family": f"f{i}", "run": "online", "model": "m", "quantization": None} for i in range(5)]
    deadline = vc.time.monotonic() + 120
    vc.serve_all(jobs, tmp_path / "results", parallel=3, timeout=60, deadline=deadline, tokens=4, prompts=2)
    assert [j["status"] for j in jobs] == ["ok"] * 5
    times: dict[str, dict[str, float]] = {}
    for line in events.read_text().splitlines():
        t, what, name = line.split()
        times.setdefault(name, {})[what] = float(t)
    assert sorted(times) == [f"f{i}-online" for i in range(5)] and all(len(v) == 3 for v in times.values())
    for name, mine in times.items():
        for other, theirs in times.items():
            if other != name:
                for what in ("start", "end"):
                    assert not mine["start"] < theirs[what] < mine["profiled"], (other, what, "inside", name)
    overlapping = sum(1 for a in times.values() for b in times.values()
                      if a is not b and a["start"] < b["start"] < a["end"])
    assert overlapping >= 2, "the serves ran one at a time"
