"""Bad input gets one clear line naming file / tensor / expert / row, and OUT never holds a final-named partial file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import example, tree_digest
from helpers import run_cli as cli_process
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.errors import ExpqError, LayoutError, NonFiniteError, SourceError, UsageError


def copy_src(tmp_path, tmp_path_factory, family="mixtral", **kw) -> Path:
    src = tmp_path / "src"
    shutil.copytree(example(tmp_path_factory, family, **kw), src)
    return src


def find(src: Path, name: str) -> Path:
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    return src / idx[name]


def edit_tensor(src: Path, name: str, fn) -> None:
    f = find(src, name)
    t = load_file(f)
    t[name] = fn(t[name].clone())
    save_file(t, f, metadata={"format": "pt"})


def edit_config(src: Path, **kv) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(kv)
    (src / "config.json").write_text(json.dumps(cfg))


def assert_no_output(out: Path) -> None:
    """No final-named file in OUT (it may not exist at all), and no staging folder left behind."""
    if out.exists():
        assert [p.name for p in out.iterdir()] == [], list(out.iterdir())


def run_cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def test_nonfinite_row_names_tensor_expert_row(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"

    def poison(w):
        w[5, 7] = float("nan")
        return w

    edit_tensor(src, name, poison)
    out = tmp_path / "out"
    with pytest.raises(NonFiniteError) as ei:
        expq.convert(src, out, device="cpu", max_shard_size="40KB")
    e = ei.value
    assert (e.tensor, e.expert, e.row) == (name, 2, 5)
    assert "NaN or infinity" in str(e) and name in str(e) and "expert 2" in str(e) and "row 5" in str(e)
    assert "(1 such row in this tensor, first: layer 1 up)" in str(e)  # one row: "row", not "rows"
    assert str(e).endswith("(pass allow_nonfinite=True to reproduce vLLM anyway)")  # as Python spells it
    assert_no_output(out)
    code, text = run_cli("convert", src, out, "--device", "cpu")
    assert code == 1 and "row 5" in text and "Traceback" not in text
    assert text.rstrip().endswith("(pass --allow-nonfinite to reproduce vLLM anyway)")  # as the command line does
    assert_no_output(out)
    # allowed on request: reproduces vLLM and reports the row
    r = expq.convert(src, out, device="cpu", allow_nonfinite=True)
    assert r.nonfinite_rows == 1 and "expert 2 up row 5" in r.nonfinite_examples[0]


def test_nonfinite_stacked_row_located(tmp_path, tmp_path_factory):
    """In an interleaved stacked tensor (GPT-OSS), the poisoned column maps back to expert, projection and row."""
    src = copy_src(tmp_path, tmp_path_factory, "gpt_oss")
    name = "model.layers.0.mlp.experts.gate_up_proj"  # [E, H, 2I], column 2*r+1 is up row r

    def poison(w):
        w[3, 10, 2 * 6 + 1] = float("inf")
        return w

    edit_tensor(src, name, poison)
    with pytest.raises(NonFiniteError) as ei:
        expq.convert(src, tmp_path / "out", device="cpu")
    assert (ei.value.tensor, ei.value.expert, ei.value.row) == (name, 3, 6) and "up" in str(ei.value)
    assert_no_output(tmp_path / "out")


def test_a_config_dtype_vllm_does_not_serve_names_config_json(tmp_path, tmp_path_factory):
    """``torch_dtype: int8`` in config.json: one usage line naming config.json and what to pass (it named no file);
    an explicit --dtype converts it."""
    src = copy_src(tmp_path, tmp_path_factory, "mixtral")
    edit_config(src, torch_dtype="int8")
    with pytest.raises(UsageError) as e:
        expq.convert(src, tmp_path / "out", device="cpu")
    assert str(e.value) == "file config.json: config dtype 'int8' is not a float type vLLM serves; pass --dtype " \
                           "explicitly"
    assert_no_output(tmp_path / "out")
    expq.convert(src, tmp_path / "out", device="cpu", dtype="bfloat16")


def test_expert_count_mismatch(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory, "qwen3_moe")
    edit_config(src, num_local_experts=8)
    with pytest.raises(LayoutError, match=r"experts \[4, 5, 6, 7\] missing \(config.json num_local_experts = 8\)"):
        expq.convert(src, tmp_path / "out", device="cpu")
    assert_no_output(tmp_path / "out")


def test_stacked_expert_count_mismatch(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory, "granitemoe")
    edit_config(src, num_local_experts=6)
    with pytest.raises(LayoutError, match=r"expected \[6, rows, cols\].*got \[4, 96, 64\]") as ei:
        expq.convert(src, tmp_path / "out", device="cpu")
    assert ei.value.tensor.endswith("block_sparse_moe.input_linear.weight")
    assert_no_output(tmp_path / "out")


def test_unknown_model_type(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    edit_config(src, model_type="frobnicate_moe", architectures=["FrobForCausalLM"])
    with pytest.raises(LayoutError) as ei:
        expq.convert(src, tmp_path / "out", device="cpu")
    msg = str(ei.value)
    assert "model_type='frobnicate_moe'" in msg and "architectures='FrobForCausalLM'" in msg and "mixtral" in msg
    assert "--layout" in msg
    assert_no_output(tmp_path / "out")
    # a user's own layout file makes it work
    code, text = run_cli("convert", src, tmp_path / "out", "--layout", "configs/mixtral.toml", "--json",
                         "--device", "cpu")
    assert code == 0, text


def test_square_orientation_not_decidable(tmp_path, tmp_path_factory):
    """H == 2I makes the fused block square: a layout that admits both orientations cannot decide, and says so."""
    src = copy_src(tmp_path, tmp_path_factory, "granitemoe", intermediate_size=32)  # 2I = 64 = H
    layout = tmp_path / "both.toml"
    text = Path("configs/granitemoe.toml").read_text().replace('orientation = "out_in", order', 'orientation = '
                                                                '["out_in", "in_out"], order')
    layout.write_text(text)
    with pytest.raises(LayoutError, match="fits both orientations") as ei:
        expq.convert(src, tmp_path / "out", layout=layout, device="cpu")
    assert ei.value.tensor.endswith("input_linear.weight")
    assert_no_output(tmp_path / "out")
    # the shipped layout fixes the orientation, so the same checkpoint converts
    expq.convert(src, tmp_path / "out", device="cpu")


def test_moe_layers_disagree_with_config(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory, "deepseek_v3")
    edit_config(src, first_k_dense_replace=2)
    with pytest.raises(LayoutError, match=r"layers \[1\] have routed experts but the config"):
        expq.convert(src, tmp_path / "out", device="cpu")
    assert_no_output(tmp_path / "out")


def test_missing_projection(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory, "olmoe")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    f = find(src, name)
    t = load_file(f)
    del t[name]
    save_file(t, f, metadata={"format": "pt"})
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    del idx["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(LayoutError, match="down_proj missing") as ei:
        expq.convert(src, tmp_path / "out", device="cpu")
    assert ei.value.expert == 3 and ei.value.tensor == name
    assert_no_output(tmp_path / "out")


def test_truncated_shard(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    f = sorted(src.glob("model-*.safetensors"))[1]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(SourceError, match="truncated") as ei:
        expq.convert(src, tmp_path / "out", device="cpu")
    assert ei.value.file == str(f) and ei.value.tensor
    code, text = run_cli("convert", src, tmp_path / "out")
    assert code == 1 and f.name in text and "truncated" in text
    assert_no_output(tmp_path / "out")


def test_index_names_missing_file(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    f = sorted(src.glob("model-*.safetensors"))[0]
    f.unlink()
    with pytest.raises(SourceError, match="listed in model.safetensors.index.json but missing") as ei:
        expq.inspect(src)
    assert ei.value.file == str(f)


def test_not_a_safetensors_file(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    f = sorted(src.glob("model-*.safetensors"))[0]
    f.write_bytes(b"<html>rate limited</html>" * 10)
    with pytest.raises(SourceError, match="not a safetensors file") as ei:
        expq.inspect(src)
    assert ei.value.file == str(f)


def test_expert_weight_not_float(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    edit_tensor(src, name, lambda w: w.to(torch.int8))
    with pytest.raises(SourceError, match="not bf16/fp16/fp32") as ei:
        expq.convert(src, tmp_path / "out", device="cpu")
    assert ei.value.tensor == name
    assert_no_output(tmp_path / "out")


def test_already_quantized_source(tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, "mixtral")
    expq.convert(src, tmp_path / "once", device="cpu")
    with pytest.raises(SourceError, match="already quantized"):
        expq.convert(tmp_path / "once", tmp_path / "twice", device="cpu")
    assert not (tmp_path / "twice").exists()


def test_out_not_empty_and_overwrite(tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, "mixtral")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty and was not written by expq"):
        expq.convert(src, out, device="cpu")
    code, text = run_cli("convert", src, out)
    assert code == 2 and "refusing to delete its contents" in text
    with pytest.raises(UsageError, match="was not written by expq convert"):
        expq.convert(src, out, device="cpu", overwrite=True)  # never deletes what expq did not write
    assert (out / "notes.txt").read_text() == "mine"
    original = tmp_path / "original"  # an unconverted checkpoint is not fair game either
    shutil.copytree(src, original)
    with pytest.raises(UsageError, match="no expq.json"):
        expq.convert(example(tmp_path_factory, "olmoe"), original, device="cpu", overwrite=True)
    assert tree_digest(original) == tree_digest(src)
    # an earlier output is replaced, stale files removed
    out2 = tmp_path / "out2"
    expq.convert(src, out2, device="cpu", max_shard_size="40KB")
    n_before = len(list(out2.glob("*.safetensors")))
    expq.convert(src, out2, device="cpu", overwrite=True)
    assert sorted(p.name for p in out2.glob("*.safetensors")) == ["model.safetensors"] and n_before > 1
    assert not (out2 / "model.safetensors.index.json").exists()


def expq_subprocess(*args, fault: str | None = None, wait: bool = True, timeout: float = 120):
    """``expq ARGS`` in a real subprocess (optionally with the writer's EXPQ_FAULT seam): (exit code, output), or the
    running Popen when ``wait`` is False."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("EXPQ_FAULT", None)
    if fault:
        env["EXPQ_FAULT"] = fault
    cmd = [sys.executable, "-m", "expq.cli", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def test_overwrite_failure_keeps_the_old_checkpoint(tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    expq.convert(example(tmp_path_factory, "mixtral"), out, device="cpu", max_shard_size="40KB")
    before = tree_digest(out)
    code, text = expq_subprocess("convert", example(tmp_path_factory, "qwen3_moe"), out, "--device", "cpu",
                                 "--overwrite", "--max-shard-size", "40KB", fault="rename:1:eio")  # the swap fails
    assert code == 1 and "Input/output error" in text and "Traceback" not in text, text
    assert f"file {out}: cannot move the finished conversion into place" in text, text
    assert tree_digest(out) == before  # the old checkpoint, complete, and nothing of the new one


def test_a_changed_source_file_is_named_when_the_settings_differ(tmp_path, tmp_path_factory):
    """OUT holds a conversion of an earlier version of SRC: the refusal names the source file that differs."""
    src = tmp_path / "src"
    shutil.copytree(example(tmp_path_factory, "mixtral"), src)
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu", max_shard_size="40KB")
    shard = sorted(src.glob("*.safetensors"))[2]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 1  # same size, one byte of the last tensor
    shard.write_bytes(bytes(data))
    with pytest.raises(UsageError) as e:
        expq.convert(src, out, device="cpu", max_shard_size="40KB")
    assert f"source.files: {shard.name} differs (size or content)" in str(e.value), str(e.value)


@pytest.mark.parametrize("src", ["a file", "/dev/null", ""])
def test_a_src_that_is_neither_a_folder_nor_a_repo_id_is_a_usage_error(src, tmp_path):
    """README's exit statuses: a SRC that is neither a directory nor a repo id is 2 (a file was 'not a directory'
    and 1; an empty SRC was read as the current folder; found by a hostile-user pass)."""
    if src == "a file":
        src = tmp_path / "afile"
        src.write_text("{}")
    with pytest.raises(UsageError) as e:
        expq.convert(src, tmp_path / "out", device="cpu")
    assert e.value.exit_code == 2
    assert str(e.value) == ("SRC is empty: give a checkpoint directory or a Hub repo id" if src == "" else
                            f"file {src}: not a directory (a checkpoint is a folder holding config.json and the "
                            "weights)")
    assert not (tmp_path / "out").exists()


def test_a_src_name_the_filesystem_cannot_take_is_a_usage_error(tmp_path):
    """A SRC whose name is longer than the filesystem allows: one usage line with the OS's reason (it was
    'error: OSError: [Errno 36] ...' and 1; found by a hostile-user pass)."""
    src = tmp_path / ("s" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1))
    with pytest.raises(UsageError) as e:
        expq.convert(src, tmp_path / "out", device="cpu")
    assert str(e.value) == f"file {src}: cannot open: File name too long" and e.value.exit_code == 2


def test_an_empty_out_and_a_looping_one_are_usage_errors(tmp_path, tmp_path_factory):
    """On the command line an empty OUT is refused, not read as the current folder (convert wrote the checkpoint
    into it; verify checked it), and verify of an OUT the OS cannot look up (a loop of links) is one usage line,
    exit 2 (it was 'error: RuntimeError: Symlink loop' and 1); found by hostile-user passes."""
    src = example(tmp_path_factory, "mixtral")
    for args in (["convert", src, ""], ["verify", ""]):
        code, text = cli_process(*args, "--device", "cpu")
        assert code == 2 and text.strip() == "error: OUT is empty: give a directory", text
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    code, text = cli_process("verify", tmp_path / "a", "--device", "cpu")
    assert code == 2 and text.strip() == f"error: file {tmp_path / 'a'}: cannot open: Too many levels of symbolic " \
                                         "links", text


def test_out_whose_parent_cannot_hold_expq_files_is_one_line(tmp_path, tmp_path_factory):
    (tmp_path / "afile").write_text("not a directory")
    out = tmp_path / "afile" / "out"
    with pytest.raises(UsageError) as e:
        expq.convert(example(tmp_path_factory, "mixtral"), out, device="cpu")
    assert f"file {out}: cannot write beside OUT in {out.parent} ({out.parent} is not a folder)" in str(e.value), \
        str(e.value)  # mkdir says only "File exists"
    deeper = out / "sub"  # a file above the folder that would be made
    with pytest.raises(UsageError) as e:
        expq.convert(example(tmp_path_factory, "mixtral"), deeper, device="cpu")
    assert f"cannot write beside OUT in {deeper.parent} ({out.parent} is not a folder)" in str(e.value), str(e.value)


def test_second_conversion_into_the_same_out_is_refused(tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, "mixtral")
    out = tmp_path / "out"
    first = expq_subprocess("convert", src, out, "--device", "cpu", fault="write:1:stall", wait=False)
    try:
        lock = tmp_path / ".out.expq-lock"
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline \
                and first.poll() is None:
            time.sleep(0.1)
        assert lock.exists(), first.communicate()[0] if first.poll() is not None else "no lock taken"
        with pytest.raises(UsageError, match=rf"another expq convert \(pid {first.pid}\) is writing OUT"):
            expq.convert(src, out, device="cpu")
        assert (tmp_path / ".out.expq-partial").is_dir()  # the other run's work is left alone
    finally:
        first.kill()  # a real SIGKILL: the OS drops its lock
        first.wait()
    expq.convert(src, out, device="cpu")  # resumes the killed run's staging under the lock
    assert (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging, journal or lock left


def test_out_overlaps_source(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    before = tree_digest(src)
    for out in (src, src / "sub", tmp_path):
        with pytest.raises(UsageError, match="overlaps the source"):
            expq.convert(src, out, device="cpu", overwrite=True)
    assert tree_digest(src) == before


def test_crash_midway_leaves_no_final_file(tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, "qwen3_moe")
    calls = {"n": 0}

    def fail_at_tenth(nbytes, shards_done):  # convert's public progress callback raises mid-run
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError(28, "No space left on device")

    out = tmp_path / "out"
    with pytest.raises(OSError):
        expq.convert(src, out, device="cpu", max_shard_size="40KB", on_progress=fail_at_tenth)
    assert calls["n"] == 10
    assert_no_output(out)


def test_disk_full_names_the_file(tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    code, text = expq_subprocess("convert", example(tmp_path_factory, "mixtral"), out, "--device", "cpu",
                                 "--max-shard-size", "40KB", fault="write:21:enospc")
    assert code == 1 and "Traceback" not in text, text
    line = next(ln for ln in text.splitlines() if ln.startswith("error:"))
    assert "cannot write: No space left on device" in line and "file model-" in line and "tensor " in line, line
    assert_no_output(out)


def test_staging_not_left_by_expq_is_never_deleted(tmp_path, tmp_path_factory):
    """A folder named like expq's staging folder but without expq's journal is the user's: refused, kept."""
    src = example(tmp_path_factory, "mixtral")
    out = tmp_path / "out"
    (tmp_path / ".out.expq-partial").mkdir()
    (tmp_path / ".out.expq-partial" / "mine.txt").write_text("mine")
    with pytest.raises(UsageError, match="was not left by expq; refusing to delete it"):
        expq.convert(src, out, device="cpu")
    assert (tmp_path / ".out.expq-partial" / "mine.txt").read_text() == "mine" and not out.exists()


def test_usage_errors(tmp_path, tmp_path_factory, monkeypatch):
    src = example(tmp_path_factory, "mixtral")
    with monkeypatch.context() as m:  # read before any work, like the options
        m.setenv("EXPQ_CPU_KERNEL", "bogus")
        code, text = run_cli("convert", src, tmp_path / "o")
        assert code == 2 and "EXPQ_CPU_KERNEL='bogus': use auto, numba, torch" in text and "Traceback" not in text
    code, text = run_cli("convert", src, tmp_path / "o", "--max-shard-size", "lots")
    assert code == 2 and "not a size" in text
    code, text = run_cli("convert", src, tmp_path / "o", "--dtype", "int4")
    assert code == 2 and "unknown --dtype" in text
    code, text = run_cli("convert", src, tmp_path / "o", "--format", "gguf")
    assert code == 2 and "unknown --format" in text
    if not torch.cuda.is_available():
        code, text = run_cli("convert", src, tmp_path / "o", "--device", "cuda:1")
        assert code == 2 and "CUDA is not available" in text
    code, text = run_cli("convert", "/no/such/dir", tmp_path / "o")
    assert code == 2 and "not a Hub repo id" in text  # a usage error (README, exit statuses)
    assert not (tmp_path / "o").exists()


def test_exit_statuses_agree_for_missing_and_unconverted_inputs(tmp_path, tmp_path_factory):
    """README, exit statuses: a checkpoint verify, run (load_model) or push cannot read is 2 for all three; a local
    SRC that does not exist (and is no repo id) is a usage error, 2; a --source of another model says so, without
    pointing at an option verify lacks."""
    src = example(tmp_path_factory, "mixtral")  # a checkpoint, but not a converted one
    for args in (("verify", src), ("run", src, "--prompt", "1 2"), ("push", src, "me/x", "--dry-run")):
        code, text = run_cli(*args)
        assert code == 2 and "no quantization_config: not a converted checkpoint" in text, (args, text)
    code, text = run_cli("convert", "./nope", tmp_path / "o")
    assert code == 2 and "file ./nope: no such directory, and not a Hub repo id" in text, text
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu")
    code, text = run_cli("verify", out, "--source", example(tmp_path_factory, "olmoe"), "--device", "cpu")
    assert code == 2 and "--layout" not in text, text
    assert ("the source must be the checkpoint OUT was converted from: OUT has the mixtral layout (model_type "
            "'mixtral'), the source is model_type 'olmoe'") in text, text


def test_custom_layout_travels_with_the_checkpoint(tmp_path, tmp_path_factory):
    """A user's --layout file is carried in expq.json, so verify, load_model and push work on the result."""
    src = copy_src(tmp_path, tmp_path_factory)
    edit_config(src, model_type="foomoe", architectures=["FooForCausalLM"])
    layout = tmp_path / "foo.toml"
    layout.write_text(Path("configs/mixtral.toml").read_text().replace('name = "mixtral"', 'name = "foomoe"')
                      .replace('model_types = ["mixtral"]', 'model_types = ["foomoe"]'))
    out = tmp_path / "out"
    expq.convert(src, out, layout=layout, device="cpu")
    rep = expq.verify(out, device="cpu", tokens=8)
    assert rep.ok, rep.problems
    from expq.hub import model_card

    assert "foomoe layout" in model_card(out, "me/foo")
    with pytest.raises(ExpqError, match="cannot instantiate model_type 'foomoe'"):  # transformers has no foomoe
        expq.load_model(out, device="cpu")


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.replace('activation = "silu"', 'activaton = "gelu"'), "unknown key config.activaton"),
    (lambda t: t.replace('activation = "silu"', 'activation = "relu2"'), "config.activation must be one of"),
    (lambda t: t.replace('gate = "w1"', "gate = 5"), "experts.gate must be a projection name"),
    (lambda t: t.replace('module = "block_sparse_moe.experts"', "module = 3", 1), "experts.module must be"),
    (lambda t: t + "\n[experts.extra]\nx = 1\n", "unknown key experts.extra"),
    (lambda t: t.replace("[experts]", "[experts\n"), "not a valid TOML layout"),
])
def test_bad_layout_files(tmp_path, tmp_path_factory, edit, match):
    layout = tmp_path / "bad.toml"
    layout.write_text(edit(Path("configs/mixtral.toml").read_text()))
    src = example(tmp_path_factory, "mixtral")
    with pytest.raises(LayoutError, match=match):
        expq.convert(src, tmp_path / "out", layout=layout, device="cpu")
    code, text = run_cli("convert", src, tmp_path / "out", "--layout", tmp_path)  # a directory
    assert code == 1 and "cannot read the layout file" in text


def test_index_may_not_point_outside_the_checkpoint(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    first = sorted(set(idx["weight_map"].values()))[0]
    shutil.move(src / first, tmp_path / "evil.safetensors")
    idx["weight_map"] = {k: ("../evil.safetensors" if v == first else v) for k, v in idx["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(SourceError, match="outside the checkpoint directory"):
        expq.inspect(src)


@pytest.mark.parametrize("change,match", [
    (dict(num_local_experts="4"), "is not an integer"),
    (dict(num_local_experts=True), "is not an integer"),
    (dict(num_hidden_layers=1), r"layers \[1\] hold routed experts beyond num_hidden_layers=1"),
    (dict(dtype=5), "dtype"),
])
def test_config_values_checked(tmp_path, tmp_path_factory, change, match):
    src = copy_src(tmp_path, tmp_path_factory)
    edit_config(src, **change)
    with pytest.raises(ExpqError, match=match):
        expq.inspect(src)


def test_moe_layer_keys_checked(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory, "qwen3_moe")
    for change, match in ((dict(decoder_sparse_step=0), "decoder_sparse_step must be"),
                          (dict(mlp_only_layers="1"), "mlp_only_layers must be")):
        edit_config(src, **change)
        with pytest.raises(LayoutError, match=match):
            expq.inspect(src)
        edit_config(src, decoder_sparse_step=1, mlp_only_layers=[])


def test_config_json_not_an_object(tmp_path, tmp_path_factory):
    src = copy_src(tmp_path, tmp_path_factory)
    (src / "config.json").write_text("[1, 2]")
    code, text = run_cli("inspect", src)
    assert code == 1 and "must hold a JSON object" in text


@pytest.mark.skipif(not Path("/proc/self/mountinfo").exists() or not Path("/sys/kernel").is_dir(),
                    reason="needs Linux's /proc and /sys")
def test_out_in_a_kernel_filesystem_names_it(tmp_path, tmp_path_factory):
    """OUT under /proc or /sys: the line names the filesystem, not the errno the kernel gives there ("No such file or
    directory" for a /proc folder that is plainly there, "Permission denied" even to root); found by a hostile-user
    pass."""
    from expq.io.files import kernel_filesystem

    assert kernel_filesystem(tmp_path / "out") is None  # a folder of files: its own errno is the reason
    src = example(tmp_path_factory, "mixtral")
    code, text = cli_process("convert", src, "/proc/self/out", "--device", "cpu")
    assert code == 2 and text.splitlines()[-1] == (
        "error: file /proc/self/out: cannot write beside OUT in /proc/self (it is in the kernel's proc filesystem, "
        "where no file can be made): expq keeps its lock, journal and partial output there"), text
    with pytest.raises(UsageError) as e:
        expq.convert(src, "/sys/kernel/expq-test/out", device="cpu")
    assert str(e.value) == ("file /sys/kernel/expq-test/out: cannot write beside OUT in /sys/kernel/expq-test (it is "
                            "in the kernel's sysfs filesystem, where no file can be made): expq keeps its lock, "
                            "journal and partial output there")
