"""Quantized sources on a GPU: FP8-block, MXFP4 and compressed-tensors INT4 fixtures converted with --device cuda
give the same bytes as --device cpu, and verify --source passes with the Triton kernel.

    python bench/gpu_quantized_sources.py OUTDIR     (needs CUDA; tests/ on the path for the fixture builders)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import expq  # noqa: E402
from expq.examples import build_example  # noqa: E402


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def main(outdir: str) -> None:
    from ct_fixture import make_ct_int4_source
    from fp8_fixture import make_fp8_deepseek
    from mxfp4_fixture import make_mxfp4_gpt_oss

    work = Path(tempfile.mkdtemp())
    results = {}
    cases = {
        "fp8-block deepseek_v3": lambda: make_fp8_deepseek(build_example("deepseek_v3", work / "ds"), work / "ds-fp8")[0],
        "mxfp4 gpt_oss": lambda: make_mxfp4_gpt_oss(build_example("gpt_oss", work / "go", intermediate_size=96),
                                                    work / "go-mx")[0],
        "compressed-tensors int4 qwen3_moe": lambda: make_ct_int4_source(build_example("qwen3_moe", work / "qw"),
                                                                         work / "qw-ct")[0],
    }
    for name, make in cases.items():
        src = Path(make())
        a, b = work / f"{len(results)}-cpu", work / f"{len(results)}-cuda"
        expq.convert(src, a, device="cpu")
        expq.convert(src, b, device="cuda")
        same = tree(a) == tree(b)
        rep = expq.verify(b, source=src, device="cuda", tokens=32)
        results[name] = {"cpu_equals_cuda": same, "verify": rep.verdict, "backend": rep.backend}
        print(name, results[name], flush=True)
    Path(outdir, "gpu_quantized_sources.json").write_text(json.dumps(results, indent=1))
    assert all(r["cpu_equals_cuda"] and r["verify"].startswith("PASS") for r in results.values()), results


if __name__ == "__main__":
    assert torch.cuda.is_available()
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
