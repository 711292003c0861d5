"""The command line's output as CI and scripts see it: real ``python -m expq.cli`` subprocesses with stdout and stderr
piped and ``CI=true``. User text (paths, tensor names, prompts, generated text, error messages) comes out literally,
never as rich markup and never wrapped or truncated; machine output is only the result; progress is plain lines on
stderr."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.filesize import decimal
from safetensors.torch import save_file

import expq
from helpers import example

ROOT = Path(expq.__file__).resolve().parent.parent
# markup-looking and longer than a terminal: "[/data]" once made rich raise MarkupError, "[usb]" and "[bold]" vanished
ODD = "models [usb] [/data] [bold]"
LONG = "mixtral-" + "x" * 90
LONG_TENSOR = ("model.layers.0.block_sparse_moe.an_auxiliary_buffer_whose_name_is_longer_than_any_terminal_"
               "table_column.weight")
PROMPT = "[bold]x[/bold] [usb] [/data] experts route tokens to a few experts and the router picks the top-k experts"


def cli(*args, env: dict | None = None, drop: tuple[str, ...] = (), timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m expq.cli ARGS`` as CI runs it: stdout and stderr piped, ``CI=true``, a progress line per update
    (``env`` adds variables, ``drop`` removes some)."""
    gone = {"EXPQ_DEBUG", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", *drop}
    e = {k: v for k, v in os.environ.items() if k not in gone}
    e.update(CI="true", EXPQ_PROGRESS_INTERVAL="0", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "expq.cli", *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=ROOT, timeout=timeout)


def lines(text: str) -> list[str]:
    return text.splitlines()


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """A tiny Mixtral under a markup-looking path longer than 80 columns, plus one extra tensor with a long name,
    and its conversion by ``expq convert`` (the subprocess result is kept for the assertions)."""
    base = tmp_path_factory.mktemp("cli-output") / ODD
    src = base / LONG
    shutil.copytree(example(tmp_path_factory, "mixtral"), src)
    save_file({LONG_TENSOR: torch.arange(15, dtype=torch.bfloat16).reshape(3, 5)}, src / "extra.safetensors")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][LONG_TENSOR] = "extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = base / f"out [usb] [/data] [bold] {'y' * 80}"
    r = cli("convert", src, out, "--device", "cpu")
    return src, out, r


def test_convert_prints_paths_literally_unwrapped_with_progress_lines(odd):
    src, out, r = odd
    assert r.returncode == 0, r.stderr
    assert (out / "expq.json").is_file()  # the conversion that once crashed on "[/data]" after writing
    o = lines(r.stdout)
    assert o[0] == f"expq convert -> {out}"
    assert "architecture\tMixtralForCausalLM (mixtral layout)" in o
    assert "MoE layers / dense\t2 / 0 of 2" in o and "routed experts per layer\t4" in o
    assert "tensors copied byte for byte\t18" in o  # 17 + the long-named extra tensor
    assert not any("converting" in line or "converted" in line for line in o)  # stdout: only the result

    s = expq.inspect(src).summary()
    total, shards = decimal(s["bytes_in"], precision=2), s["output_shards"]
    e = lines(r.stderr)
    assert e[0] == f"{src}: MixtralForCausalLM (mixtral layout), 2 MoE layers x 4 experts, compute dtype bfloat16"
    running = [line for line in e if line.startswith("converting: ")]
    assert len(running) >= 2  # interval 0: a line per update
    for line in running:
        assert re.fullmatch(rf"converting: [\d.]+ (bytes|kB) / {re.escape(total)} \(\d+%\), \d+/{shards} shards, "
                            rf"([\d.]+ (bytes|kB|MB|GB)|-)/s, ETA (\d+:\d\d:\d\d|-)", line), line
    assert re.fullmatch(rf"converted: {re.escape(total)} / {re.escape(total)} \(100%\), {shards}/{shards} shards, "
                        rf"[\d.]+ (bytes|kB|MB|GB)/s, in \d+:\d\d:\d\d", e[-1]), e[-1]
    assert "\r" not in r.stderr and "\x1b" not in r.stderr and "━" not in r.stderr  # no bar redraws


def test_inspect_tensors_lists_full_names_and_json_is_only_json(odd):
    src, _, _ = odd
    r = cli("inspect", src, "--tensors")
    assert r.returncode == 0, r.stderr
    o = lines(r.stdout)
    assert o[0] == f"expq inspect {src}"
    assert "layout\tmixtral (per_expert), detected by model_type='mixtral'" in o
    assert f"{LONG_TENSOR}\tBF16\t[3, 5]\tcopy" in o
    assert "model.layers.1.post_attention_layernorm.weight\tBF16\t[64]\tcopy" in o
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight\tBF16\t[64, 48]\tquantize" in o
    assert "…" not in r.stdout
    rows = o[o.index("tensor\tdtype\tshape\taction") + 1:]
    assert len(rows) == 24 + 18

    j = cli("inspect", src, "--tensors", "--json")
    assert j.returncode == 0, j.stderr
    assert j.stdout.count("\n") == 1 and j.stdout.endswith("}\n")  # one line, nothing else
    plan = json.loads(j.stdout)
    assert plan["source"] == str(src)
    names = [t["name"] for t in plan["tensors"]]
    assert LONG_TENSOR in names and len(names) == 42
    assert {n for n in names} == {line.split("\t")[0] for line in rows}


def test_verify_and_push_dry_run_print_paths_literally(odd):
    src, out, _ = odd
    r = cli("verify", out, "--source", src, "--tokens", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    o = lines(r.stdout)
    assert o[0] == f"expq verify {out}"
    assert o[1] == "layer\texperts\tbits\trow err\tkernel\tworst tok\tvs src\tresult"
    assert re.fullmatch(r"0\t4/4\tequal\t0\.75\t[\d.e+-]+\t[\d.e+-]+\t[\d.e+-]+\tpass", o[2]), o[2]
    assert "other tensors byte-identical to the source\tpass\t18 tensors" in o
    assert o[-1].startswith("PASS: 2 MoE layers x 4 experts (24 matrices) verified bit for bit against ")
    assert f"against {src};" in o[-1]

    p = cli("push", out, "your-name/tiny-mixtral-int8", "--dry-run", "--skip-verify")
    assert p.returncode == 0, p.stderr
    o = lines(p.stdout)
    assert o[:2] == ["expq push --dry-run: would upload to your-name/tiny-mixtral-int8", "file\tsize"]
    listed = dict(line.split("\t") for line in o[2:o.index("--- README.md (model card) ---") - 2])
    on_disk = {f.name: decimal(f.stat().st_size, precision=2) for f in out.iterdir() if f.is_file()}
    assert set(listed) == set(on_disk) | {"README.md"}
    assert {k: v for k, v in listed.items() if k != "README.md"} == on_disk


def test_run_prints_the_continuation_exactly(odd):
    """stdout is the continuation alone, as the README says (the prompt is not glued to it), printed literally."""
    from transformers import AutoTokenizer

    from expq.runtime import generate

    _, out, _ = odd
    r = cli("run", out, "--prompt", PROMPT, "--max-new-tokens", "6", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    g = generate(out, PROMPT, max_new_tokens=6, device="cpu")
    tok = AutoTokenizer.from_pretrained(out)
    full = tok.decode(g.prompt_ids + g.new_ids)
    assert full.startswith(tok.decode(g.prompt_ids)) and g.text == full[len(tok.decode(g.prompt_ids)):]
    assert PROMPT not in g.text and g.text
    assert r.stdout == g.text + "\n"  # literal, no hard wrap
    e = lines(r.stderr)
    assert f"token ids: {g.new_ids}" in e
    assert re.fullmatch(r"MixtralForCausalLM: routed experts int8 in memory \([\d.]+ kB\), rest [\d.]+ kB, on cpu",
                        e[0]), e[0]
    assert "Loading weights" not in r.stderr and "\r" not in r.stderr  # transformers' bar is off in CI


def test_errors_name_odd_paths_literally(odd, tmp_path):
    missing = tmp_path / ODD / f"missing {LONG}"
    r = cli("inspect", missing)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and str(missing) in r.stderr

    odd_command = f"[/data] [bold]no such command[/bold] {LONG}"
    u = cli(odd_command)
    assert u.returncode == 2 and u.stdout == ""
    assert f"Error: No such command '{odd_command}'." in lines(u.stderr)  # click's plain line, not a wrapped panel


def test_control_characters_never_reach_the_terminal(odd, tmp_path):
    """An escape sequence in a path or in config.json is shown escaped; markup-looking text stays as it is."""
    missing = tmp_path / "e\x1b[31m [usb] \x07 z"
    r = cli("inspect", missing)
    assert r.returncode != 0 and "\x1b" not in r.stderr and "\x07" not in r.stderr
    assert "e\\x1b[31m [usb] " in r.stderr  # the escape spelled out, [usb] literal
    src = odd[0]
    edited = tmp_path / "edited"
    shutil.copytree(src, edited)
    cfg = json.loads((edited / "config.json").read_text())
    cfg["architectures"] = [cfg["architectures"][0]]
    cfg["model_type"] = cfg["model_type"] + "\x1b[2J"
    (edited / "config.json").write_text(json.dumps(cfg))
    r = cli("inspect", edited)
    assert "\x1b" not in r.stdout + r.stderr


def test_a_line_break_in_a_path_keeps_the_plain_table_one_line_per_row(odd, tmp_path):
    """Piped, convert's summary is a title line and one tab-separated row per line: a newline or a tab in OUT's name
    is shown escaped, so a reader of the table (``cut -f2``) sees the rows it expects (it split the title in two;
    found by a hostile-user pass)."""
    out = tmp_path / "o\nu\tt"
    r = cli("convert", odd[0], out, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    assert rows[0] == "expq convert -> " + str(out).replace("\n", "\\n").replace("\t", "\\t")
    assert all(len(row.split("\t")) == 2 for row in rows[1:]), rows


def test_hub_download_progress_follows_the_ci_rule(odd, hub_server, tmp_path):
    """Converting a Hub repo with stderr piped: huggingface_hub's tqdm bars are off (they are on by default), expq's
    own lines stay, at the default interval only the final one for a sub-second run."""
    src, _, _ = odd
    hub_server.add_repo("org/tiny-mixtral", src)
    env = {"EXPQ_PROGRESS_INTERVAL": "5"}  # the default
    drop = ("HF_HUB_DISABLE_PROGRESS_BARS",)  # huggingface_hub's default: bars on
    r = cli("convert", "org/tiny-mixtral", tmp_path / "out [usb]", "--device", "cpu", env=env, drop=drop)
    assert r.returncode == 0, r.stderr
    e = lines(r.stderr)
    assert e[0].startswith("org/tiny-mixtral: MixtralForCausalLM (mixtral layout), 2 MoE layers x 4 experts")
    assert not [line for line in e if line.startswith("converting: ")]  # a sub-second run: no line is due at 5 s
    assert e[-1].startswith("converted: "), e
    assert "%|" not in r.stderr and "\r" not in r.stderr and "Fetching" not in r.stderr
    assert lines(r.stdout)[0] == f"expq convert -> {tmp_path / 'out [usb]'}"


def test_progress_lines_interval():
    """``ProgressLines`` prints only when the interval has passed, from the values it was given."""
    from expq.progress import ProgressLines

    out: list[str] = []
    ticks = iter([0.0, 1.0, 2.0, 6.0, 7.0, 12.5, 13.0])
    p = ProgressLines(4_000_000, 2, write=out.append, every=5, clock=ticks.__next__)
    p.advance(1_000_000, 0)  # t=1: not due
    p.advance(1_000_000, 1)  # t=2: not due
    p.advance(1_000_000, 1)  # t=6: due
    p.advance(500_000, 1)  # t=7: not due
    p.advance(500_000, 2)  # t=12.5: due
    p.finish()  # t=13
    assert out == ["converting: 3.00 MB / 4.00 MB (75%), 1/2 shards, 500.00 kB/s, ETA 0:00:02",
                   "converting: 4.00 MB / 4.00 MB (100%), 2/2 shards, 320.00 kB/s, ETA 0:00:00",
                   "converted: 4.00 MB / 4.00 MB (100%), 2/2 shards, 307.69 kB/s, in 0:00:13"]


USAGE = {"convert": "SRC [OUT]", "inspect": "SRC", "verify": "OUT", "run": "OUT", "push": "OUT REPO_ID"}


@pytest.mark.parametrize("command", sorted(USAGE))
def test_help_names_arguments_without_placeholders(command):
    """Usage lines as a user reads them (``SRC [OUT]``), in the plain help a pipe gets and in rich's; no ``{src}``."""
    from typer.testing import CliRunner

    from expq.cli import app

    plain = cli(command, "--help").stdout
    rich = CliRunner().invoke(app, [command, "--help"], prog_name="expq", terminal_width=200).output
    for text in (plain, rich):
        usage = next(ln for ln in text.splitlines() if "Usage:" in ln)
        assert usage.strip().strip("│ ").endswith(f"Usage: expq {command} [OPTIONS] {USAGE[command]}"), usage
        assert "{" not in text and "}" not in text, text


# --- the console script's exit -------------------------------------------------------------------------------------
CONSOLE = """
import atexit, sys, threading, time
from expq.cli import console
atexit.register(print, "atexit ran", flush=True)
if sys.argv[1] == "worker":  # a thread that is not a daemon, still running when the command ends
    threading.Thread(target=lambda: (time.sleep(0.5), print("the worker finished", flush=True))).start()
sys.argv = ["expq", *sys.argv[2:]]
console()
"""


@pytest.mark.parametrize("case", ["help", "error", "worker", "stdout closed"])
def test_console_ends_at_once_after_flushing_unless_something_still_runs(case, tmp_path):
    args = {"error": ["convert", tmp_path / "no such dir", tmp_path / "out"]}.get(case, ["--help"])
    if case == "stdout closed":  # started with descriptor 1 closed: sys.stdout is None; the exit status stays 0
        r = subprocess.run(f'"{sys.executable}" -c \'{CONSOLE}\' help --help >&-', shell=True, capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        return
    r = subprocess.run([sys.executable, "-c", CONSOLE, case, *map(str, args)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    if case == "error":
        assert r.returncode == 2 and r.stderr.strip() == (f"error: file {tmp_path / 'no such dir'}: no such "
                                                          "directory, and not a Hub repo id"), r.stderr
    else:
        assert r.returncode == 0 and "Usage: expq [OPTIONS] COMMAND" in r.stdout, r.stderr  # flushed first
    # the interpreter's teardown (atexit hooks, module finalisation) runs only where a thread still works
    assert ("atexit ran" in r.stdout) == (case == "worker"), r.stdout
    assert ("the worker finished" in r.stdout) == (case == "worker"), r.stdout


@pytest.mark.parametrize("case", ["broken pipe", "stdout full", "stderr full"])
def test_output_that_cannot_be_written_never_undoes_a_conversion(case, tmp_path_factory, tmp_path):
    """The summary lost (the reader gone, a full disk) is one WARNING line naming <stdout> and the error, exit 0: the
    status says what happened to OUT, which is committed; a dead stderr (progress lines) stops nothing."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "EXPQ_DEBUG"}
    env.update(CI="true", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open("/dev/full", "w") as full:
        p = subprocess.Popen([sys.executable, "-m", "expq.cli", "convert", example(tmp_path_factory, "mixtral"), out,
                              "--device", "cpu"], env=env, cwd=ROOT, text=True,
                             stdout=full if case == "stdout full" else subprocess.PIPE,
                             stderr=full if case == "stderr full" else subprocess.PIPE)
        if case == "broken pipe":
            p.stdout.close()  # the reader went away (``| head -c0``)
        _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert (out / "expq.json").is_file() and not (tmp_path / ".out.expq-partial").exists()
    if case != "stderr full":
        reason = "[Errno 32] Broken pipe" if case == "broken pipe" else "[Errno 28] No space left on device"
        assert [ln for ln in lines(err) if "WARNING" in ln or "error" in ln] == [
            f"WARNING: cannot write to <stdout>: {reason}; the output was lost, the work itself was done"], err


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("case", ["stdout full", "stdout closed"])
def test_inspect_and_verify_keep_their_status_when_stdout_fails(command, case, tmp_path_factory, tmp_path):
    """inspect's and verify's report lost (a full disk; stdout closed from the start, where print() would drop it
    silently): one WARNING line naming <stdout>, and the command's own status (verify: 0, every check passed), not
    'error: OSError' and 1, which says a check failed (found by a hostile-user pass)."""
    import shlex

    import expq

    src = example(tmp_path_factory, "mixtral")
    if command == "inspect":
        args = ["inspect", src]
    else:
        expq.convert(src, tmp_path / "out", device="cpu")
        args = ["verify", tmp_path / "out", "--device", "cpu", "--tokens", "4"]
    redirect = ">/dev/full" if case == "stdout full" else ">&-"
    cmd = " ".join(shlex.quote(str(a)) for a in [sys.executable, "-m", "expq.cli", *args]) + " " + redirect
    env = {k: v for k, v in os.environ.items() if k != "EXPQ_DEBUG"}
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    reason = "[Errno 28] No space left on device" if case == "stdout full" else "[Errno 9] Bad file descriptor"
    assert [ln for ln in lines(r.stderr) if "WARNING" in ln or "error" in ln] == [
        f"WARNING: cannot write to <stdout>: {reason}; the output was lost, the work itself was done"], r.stderr
