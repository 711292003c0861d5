"""Every command the model card prints for the demo model, run as a user would: the card is fetched from the test
Hub after ``expq push``, its "How to use it" code blocks are run as they are in fresh interpreters pointed at that
Hub. transformers and expq blocks run here; vLLM blocks run where vLLM and CUDA are (``-m gpu``, on the H200)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

import expq
from expq.demo import DEMO_CONFIG
from expq.examples import build_example

FORMATS = ("compressed-tensors", "experts-int8")


@pytest.fixture(scope="module")
def demo_src(tmp_path_factory):
    return build_example("mixtral", tmp_path_factory.mktemp("demo") / "src", max_shard_size="10MB", **DEMO_CONFIG)


def usage_blocks(card: str) -> list[tuple[str, str, str]]:
    """(engine, language, code) of every code block in the card's "How to use it" section."""
    usage = card.split("## How to use it", 1)[1]
    out = []
    for section in re.split(r"^### ", usage, flags=re.M)[1:]:
        engine = section.splitlines()[0].strip()
        out += [(engine, lang, code) for lang, code in re.findall(r"```(\w+)\n(.*?)```", section, re.S)]
    return out


@pytest.fixture(scope="module", params=FORMATS)
def published(request, demo_src, tmp_path_factory):
    """(repo id, card text as the Hub serves it) for the demo converted in one format and pushed to a test Hub."""
    import hub_server as hs

    mp = pytest.MonkeyPatch()
    server = hs.HubServer(tmp_path_factory.mktemp("hub") / "data").start()
    try:
        hs.configure_hf_client(mp, server.url, tmp_path_factory.mktemp("hf-home"), server.token)
        out = tmp_path_factory.mktemp(f"out-{request.param}") / "demo-int8"
        expq.convert(demo_src, out, format=request.param, device="cpu")
        repo = f"me/demo-{request.param}"
        expq.push(out, repo, device="cpu")
        yield repo, server.read_file(repo, "README.md").decode(), request.param
    finally:
        mp.undo()
        server.stop()


def test_card_lists_one_command_per_engine(published):
    repo, card, fmt = published
    engines = {e for e, _, _ in usage_blocks(card)}
    sglang = {"SGLang"} if fmt == "compressed-tensors" else set()  # SGLang has no experts-int8 loader
    assert engines == {"vLLM", "transformers", "expq"} | sglang, engines  # hidden 256: Marlin serves it
    assert f"Format: **{fmt}**" in card


def test_card_python_commands_run(published):
    """The python blocks, verbatim and in the card's order, in one fresh interpreter pointed at the test Hub (each
    in its own namespace; a block that does not import expq runs before any block that does): each must build a
    model that runs."""
    repo, card, fmt = published
    blocks = [code for _, lang, code in usage_blocks(card) if lang == "python"]
    assert len(blocks) == 2 and all(repo in code for code in blocks)
    first_expq = next(i for i, code in enumerate(blocks) if "import expq" in code)
    assert all("import expq" not in code for code in blocks[:first_expq])
    runner = ("import sys, torch\nfor i, code in enumerate(BLOCKS):\n    ns = {}\n    exec(compile(code, f'block{i}', 'exec'), ns)\n"
              "    with torch.no_grad():\n        print('LOGITS', i, tuple(ns['model'](torch.tensor([[1, 2, 3]])).logits.shape))\n")
    r = subprocess.run([sys.executable, "-c", f"BLOCKS = {blocks!r}\n" + runner], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert r.returncode == 0, f"{fmt} card block failed:\n{r.stderr[-3000:]}"
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("LOGITS")] == \
        [f"LOGITS {i} (1, 3, 320)" for i in range(len(blocks))], r.stdout


def serve_log_errors(path):
    """The lines of a failed server's log that say why: every line naming an error, then the last 1500 characters."""
    text = path.read_text()
    errors = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln][:40]
    return "\n".join(errors) + "\n...\n" + text[-1500:]


@pytest.mark.gpu
def test_card_vllm_command_serves(published, tmp_path):
    """The vLLM block, verbatim (the pip line is skipped: expq and its entry point are installed), then one
    completion through the server's OpenAI API."""
    if shutil.which("vllm") is None or not torch.cuda.is_available():
        pytest.skip("needs vLLM and CUDA")
    repo, card, fmt = published
    (code,) = [c for e, lang, c in usage_blocks(card) if e == "vLLM" and lang == "bash"]
    cmd = [ln.split("  #")[0] for ln in code.splitlines() if ln.startswith("vllm ")][0]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd.split() + ["--port", "8765", "--max-model-len", "128", "--enforce-eager",
                                           "--gpu-memory-utilization", "0.3", "--skip-tokenizer-init"],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen("http://127.0.0.1:8765/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, serve_log_errors(tmp_path / "serve.log")
                time.sleep(1)
        req = urllib.request.Request("http://127.0.0.1:8765/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=f'{{"model": "{repo}", "prompt": [1, 2, 3], "max_tokens": 4}}'.encode())
        assert b"choices" in urllib.request.urlopen(req, timeout=60).read()
    finally:
        proc.terminate()
        proc.wait(60)
