"""What Triton makes of expq's fused-MoE GEMM for a config, compiled ahead of time for a GPU target (issue 13):
which MMA, whether the K loop is software-pipelined, whether each int8 weight tile makes a round trip through
shared memory after its conversion, how the MMA waits, shared memory, registers and spills.

Usage (repo root; no GPU needed, the installed Triton compiles for the target):
    python3 bench/kernel_ir.py                                  # the shipped H200 table's configs, Mixtral shape
    python3 bench/kernel_ir.py --config 128,128,64,0,0,4,4      # BLOCK_SIZE_M,N,K,SWAP_AB,FUSE_ACT,warps,stages
    python3 bench/kernel_ir.py --arch 90 --k 14336 --json out.json

The kernel is specialised as the JIT would specialise it for contiguous bf16 activations and int8 weights (unit
strides constant, pointers and the other strides divisible by 16), K (H for GEMM1, I for GEMM2) from ``--k``.
Columns: ``mma`` (the MMA version and instruction shape of the accumulator layout), ``pipelined`` (the K loop's
global loads are asynchronous copies into multi-buffered shared memory), ``B via smem`` (the converted weight tile
is stored back to shared memory inside the loop: the MMA reads both operands from shared memory and must finish
before the next conversion, ``wait 0``), ``waits`` (the ``pendings`` of each wgmma wait: 1 lets the next
iteration's conversion overlap the MMA), shared memory (bytes, Triton's count), registers and local-memory (spill)
bytes per thread from ``cuobjdump -res-usage`` (the cubin of Triton's bundled ptxas).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is every release's default

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from expq.kernels import fused_moe_triton as fk  # noqa: E402
from expq.kernels import moe  # noqa: E402
from expq.kernels import tuned  # noqa: E402

POINTERS = {"a_ptr": "*bf16", "b_ptr": "*i8", "c_ptr": "*bf16", "b_scale_ptr": "*fp32", "b_bias_ptr": "*fp32",
            "topk_weights_ptr": "*fp32", "sorted_token_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
            "num_tokens_post_padded_ptr": "*i32"}
UNIT_STRIDES = ("stride_ak", "stride_bk", "stride_cn", "stride_bsn", "stride_bbn")
INT_ARGS = ("N", "EM", "num_valid_tokens", "stride_am", "stride_be", "stride_bn", "stride_cs", "stride_cm",
            "stride_bse", "stride_bbe")


def compile_config(cfg: dict, k: int, arch: int, top_k: int = 2, gemm: int = 1):
    """The compiled GEMM kernel (``triton.compile``'s result) for ``cfg`` (a full config: all of
    ``tuned.CONFIG_KEYS``) and K = ``k``: GEMM1 (``gemm`` 1: FUSE_ACT as the config says, ``top_k`` pairs per row,
    no router weight, no split) or GEMM2 (``gemm`` 2: unfused, one pair per row, the router weight multiplied in,
    the config's SPLIT_K), as the pipeline launches them."""
    sig, consts = dict(POINTERS), {}
    for name in ("N", "K", "EM", "num_valid_tokens", "stride_am", "stride_ak", "stride_be", "stride_bn", "stride_bk",
                 "stride_cs", "stride_cm", "stride_cn", "stride_bse", "stride_bsn", "stride_bbe", "stride_bbn"):
        sig[name] = "i32"
    g2 = gemm == 2
    split = moe.gemm2_split_k(cfg, k, num_pairs=1, hidden_size=1) if g2 else 1  # the pipeline's clamp (K = I)
    consts.update(K=k, BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"],
                  BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], GROUP_SIZE_M=cfg["GROUP_SIZE_M"], SPLIT_K=split,
                  SWAP_AB=cfg["SWAP_AB"], FUSE_ACT=cfg["FUSE_ACT"] and not g2, ACTIVATION=0, ALPHA=1.702, LIMIT=7.0,
                  EVEN_K=k % cfg["BLOCK_SIZE_K"] == 0, TOP_K=1 if g2 else top_k, MUL_ROUTED_WEIGHT=g2,
                  HAS_BIAS=False, compute_type=tl.bfloat16, DOT_PRECISION="tf32", UNSORTED=False)
    consts.update({s: 1 for s in UNIT_STRIDES})
    for name in consts:
        sig[name] = "constexpr"
    sig["num_experts"] = "i32"
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in list(POINTERS) + list(INT_ARGS)}
    if split > 1:
        sig["c_ptr"] = "*fp32"  # split-K partials
    src = ASTSource(fn=fk.fused_moe_w8a16_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def _res_usage(cubin: bytes) -> dict:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    out = {}
    for key in ("REG", "STACK", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", text)
        out[key.lower()] = int(m.group(1)) if m else None
    return out


def describe(cc) -> dict:
    """The facts of the module docstring's columns, from the final TTGIR and the cubin."""
    ir = cc.asm["ttgir"]
    mma = re.search(r"nvidia_mma<\{versionMajor = (\d+).*?instrShape = \[([\d, ]+)\]", ir)
    loop = ir[ir.find("scf.for"):]
    loop = loop[:loop.find("scf.yield")]
    sass_ops = {}
    try:
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cc.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
        for op in re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", sass, re.M):
            if op.startswith(("LDS", "LDSM", "STS", "HGMMA", "HMMA", "I2F", "PRMT", "LDGSTS")):
                sass_ops[op] = sass_ops.get(op, 0) + 1
    except OSError:
        pass
    return dict(mma=f"v{mma.group(1)} {mma.group(2).replace(' ', '')}" if mma else "none",
                pipelined="async_copy_global_to_local" in ir,
                b_via_smem=bool(re.search(r"sitofp[^\n]*\n[^\n]*local_alloc", loop)),
                waits=sorted(int(x) for x in re.findall(r"pendings = (\d+)", loop)),
                shared=cc.metadata.shared, **_res_usage(cc.asm["cubin"]), sass=sass_ops)


def parse_config(spec: str) -> dict:
    """``--config``'s BLOCK_SIZE_M,N,K,SWAP_AB,FUSE_ACT,num_warps,num_stages as a full config (GROUP_SIZE_M 8,
    SPLIT_K 1), or exit with one line. Not ``tuned.check_config``'s refusals: this tool also studies refused tiles
    (``tuned.SWAP_AB_MAX_BLOCK_M``)."""
    try:
        m, n, k, swap, fuse, w, s = (int(v) for v in spec.split(","))
    except ValueError:
        sys.exit(f"--config {spec!r}: expected BLOCK_SIZE_M,N,K,SWAP_AB,FUSE_ACT,num_warps,num_stages (7 integers)")
    if swap not in (0, 1) or fuse not in (0, 1):
        sys.exit(f"--config {spec!r}: SWAP_AB and FUSE_ACT are 0 or 1")
    cfg = dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=k, GROUP_SIZE_M=8, num_warps=w, num_stages=s,
               SWAP_AB=bool(swap), FUSE_ACT=bool(fuse))
    try:
        tuned.check_config(dict(cfg, SWAP_AB=False, FUSE_ACT=False))  # sizes, warps, stages
    except ValueError as exc:
        sys.exit(f"--config {spec!r}: {exc}")
    return {**tuned.CONFIG_DEFAULTS, **cfg}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[],
                    help="BLOCK_SIZE_M,N,K,SWAP_AB,FUSE_ACT,num_warps,num_stages (repeatable); default: the table's")
    ap.add_argument("--table", default=str(tuned.CONFIG_DIR / "NVIDIA_H200.json"))
    ap.add_argument("--shape", default="E=8,H=4096,I=14336,top_k=2,dtype=bfloat16", help="the table's shape key")
    ap.add_argument("--k", type=int, default=4096, help="K of the GEMM (GEMM1: H, GEMM2: I)")
    ap.add_argument("--gemm", type=int, default=1, choices=(1, 2), help="which GEMM's specialisation")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [(spec, parse_config(spec)) for spec in a.config]
    if not rows:
        try:
            table = tuned.parse_table(json.loads(Path(a.table).read_text()))
        except (OSError, ValueError, RecursionError) as exc:
            sys.exit(f"{a.table}: {exc}")
        if a.shape not in table:
            sys.exit(f"{a.table}: no shape {a.shape!r}; it has {sorted(table)}")
        rows = [(f"T={b}", cfg) for b, cfg in table[a.shape]]
    print(f"triton {triton.__version__}, sm_{a.arch}, GEMM{a.gemm}, K={a.k}")
    print("| config | tile MxNxK swap fuse warps stages | mma | pipelined | B via smem | waits | shared B | regs | "
          "local B | SASS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for label, cfg in rows:
        try:
            d = describe(compile_config(cfg, a.k, a.arch, gemm=a.gemm))
        except Exception as exc:  # noqa: BLE001 - a config Triton refuses: reported as such
            d = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        out.append(dict(label=label, config=cfg, **d))
        tile = (f"{cfg['BLOCK_SIZE_M']}x{cfg['BLOCK_SIZE_N']}x{cfg['BLOCK_SIZE_K']} {int(cfg['SWAP_AB'])} "
                f"{int(cfg['FUSE_ACT'])} {cfg['num_warps']} {cfg['num_stages']}")
        if "error" in d:
            print(f"| {label} | {tile} | {d['error']} |")
            continue
        sass = ", ".join(f"{k} {v}" for k, v in sorted(d["sass"].items()))
        print(f"| {label} | {tile} | {d['mma']} | {d['pipelined']} | {d['b_via_smem']} | {d['waits']} | "
              f"{d['shared']} | {d['reg']} | {d['local']} | {sass} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(triton=triton.__version__, arch=a.arch, k=a.k, rows=out), indent=1))


if __name__ == "__main__":
    main()
