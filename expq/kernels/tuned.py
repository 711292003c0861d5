"""Tuned block configs of the fused-MoE w8a16 kernel, per GPU, shape and token bucket.

A table is a JSON file ``expq/kernels/configs/<GPU>.json``, ``<GPU>`` being ``normalize_gpu_name`` of
``torch.cuda.get_device_name`` (``"NVIDIA H200"`` -> ``NVIDIA_H200``), written by ``bench/tune_kernel.py``:

    {
      "format": "expq-moe-configs/1",
      "measured": true,
      "gpu": "NVIDIA H200",
      "meta": {"tuner": "bench/tune_kernel.py", "triton": "3.6.0", "torch": "2.11.0", "date": "...", ...},
      "shapes": {
        "E=128,H=2048,I=768,top_k=8,dtype=bfloat16": {
          "1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1,
                "num_warps": 8, "num_stages": 3, "SPLIT_K": 1, "SWAP_AB": false, "FUSE_ACT": false},
          "8": {...}, ...
        }
      }
    }

``lookup`` answers for a CUDA device only, and only when its GPU has a file and the exact (E, H, I, top_k, dtype)
is in it; the token bucket is the nearest key to the token count (``abs(bucket - T)``, ties to the smaller
bucket: vLLM's rule for its own tuned files). Otherwise it returns None and ``get_config`` keeps its built-in
default. An entry may leave out ``SPLIT_K``, ``SWAP_AB`` and ``FUSE_ACT`` (tables written before the kernel had
them): they are then 1, false and false (``CONFIG_DEFAULTS``); ``lookup`` always returns all nine keys. A file
whose ``measured`` is not ``true``, of another format, or with a malformed entry is ignored as a whole (one
warning line, ``LOGGER``), never half-used. Files are read once per process.

``EXPQ_KERNEL_CONFIGS``: a directory searched before the package's own (to try a freshly tuned table before it is
committed); the value ``off`` disables tables altogether.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from ..errors import visible

FORMAT = "expq-moe-configs/1"
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
ENV = "EXPQ_KERNEL_CONFIGS"
LOGGER = "vllm.expq.kernels"
"""The kernels' logger (a table that cannot be used): a child of the vLLM plugin's (``engines.vllm_kernel.LOGGER``),
so that in a vLLM process its lines reach vLLM's log as the plugin's do. Elsewhere (``expq verify``,
``load_model``) nothing configures the ``vllm`` loggers: a line goes to the application's handlers, or, where there
are none (expq's command line), to stderr through Python's last-resort handler (WARNING and above)."""
_LOG = logging.getLogger(LOGGER)

CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages", "SPLIT_K",
               "SWAP_AB", "FUSE_ACT")
"""The knobs a table entry sets: exactly those of ``get_config`` (the kernel has no other). SPLIT_K: split-K factor
of GEMM2 (the down projection) only, 1 = no split; SWAP_AB: every tile computed transposed (both GEMMs); FUSE_ACT:
GEMM1 stores act(gate) * up itself (no activation launch; needs SWAP_AB false)."""

CONFIG_DEFAULTS = {"SPLIT_K": 1, "SWAP_AB": False, "FUSE_ACT": False}
"""The knobs an entry may leave out, and the value they then take (what the kernel did before it had them)."""

SWAP_AB_MAX_BLOCK_M = 256
"""SWAP_AB tiles of this many token rows (the MMA's N, 256) or more are refused: on an H200 with Triton 3.6 the
256 x 128 x 64 tile at 8 warps (the tuner's fastest Mixtral prefill config, 1.63 ms against 1.78 ms at T=1024)
gives relative errors of 0.07 to 0.1 against the fp32 reference at H=4096 (tests/test_kernels_gpu.py
``test_prefill_tiles_against_the_reference``, bench/tune_kernel.py's check; 2026-12-01), while it passes at H=2048.
Triton 3.6 compiles it as it does the smaller SWAP_AB tiles, which pass every GPU test (the converted weight tile a
register operand of asynchronous wgmmas, three left pending: bench/kernel_ir.py); the cause is not known."""

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

__all__ = ["CONFIG_DEFAULTS", "CONFIG_DIR", "CONFIG_KEYS", "FORMAT", "SWAP_AB_MAX_BLOCK_M", "check_config",
           "clear_cache", "load_table", "lookup", "normalize_gpu_name", "parse_table", "pick_bucket", "shape_key"]


def normalize_gpu_name(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200"``: runs of characters other than letters, digits, ``.`` and ``-``
    become one ``_``, without leading or trailing ``_``."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", name).strip("_")


def shape_key(num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, dtype) -> str:
    """The table key of a shape: ``"E=128,H=2048,I=768,top_k=8,dtype=bfloat16"`` (dtype: a torch dtype or its
    name)."""
    name = _DTYPES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    return f"E={int(num_experts)},H={int(hidden_size)},I={int(intermediate_size)},top_k={int(top_k)},dtype={name}"


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def check_config(cfg) -> dict:
    """A table entry as ``get_config`` returns it (a new dict of all ``CONFIG_KEYS``, in that order), or ValueError
    saying what is wrong. Every key of ``CONFIG_KEYS`` present except those of ``CONFIG_DEFAULTS`` (SPLIT_K,
    SWAP_AB and FUSE_ACT, which take their defaults 1, False and False when absent), no other key; block sizes powers
    of two in [16, 256] (BLOCK_SIZE_K [16, 512]; 16 is ``tl.dot``'s least), GROUP_SIZE_M an integer in [1, 1024],
    num_warps a power of two in [1, 32], num_stages an
    integer in [1, 8], SPLIT_K a power of two in [1, 16], SWAP_AB and FUSE_ACT bools (JSON true / false, not 0 / 1),
    not both true, and SWAP_AB only with BLOCK_SIZE_M below ``SWAP_AB_MAX_BLOCK_M``. Integers are ``int``, never
    ``bool``."""
    if not isinstance(cfg, dict):
        raise ValueError(f"expected an object, got {type(cfg).__name__}")
    missing = [k for k in CONFIG_KEYS if k not in cfg and k not in CONFIG_DEFAULTS]
    extra = [k for k in cfg if k not in CONFIG_KEYS]
    if missing or extra:
        raise ValueError(f"keys: missing {missing}, unknown {extra}")
    cfg = {**CONFIG_DEFAULTS, **cfg}
    for k, top in (("BLOCK_SIZE_M", 256), ("BLOCK_SIZE_N", 256), ("BLOCK_SIZE_K", 512)):
        if not _pow2(cfg[k]) or not 16 <= cfg[k] <= top:
            raise ValueError(f"{k}: expected a power of two in [16, {top}], got {cfg[k]!r}")
    g = cfg["GROUP_SIZE_M"]
    if not isinstance(g, int) or isinstance(g, bool) or not 1 <= g <= 1024:
        raise ValueError(f"GROUP_SIZE_M: expected an integer in [1, 1024], got {g!r}")
    if not _pow2(cfg["num_warps"]) or cfg["num_warps"] > 32:
        raise ValueError(f"num_warps: expected a power of two <= 32, got {cfg['num_warps']!r}")
    st = cfg["num_stages"]
    if not isinstance(st, int) or isinstance(st, bool) or not 1 <= st <= 8:
        raise ValueError(f"num_stages: expected an integer in [1, 8], got {st!r}")
    if not _pow2(cfg["SPLIT_K"]) or cfg["SPLIT_K"] > 16:
        raise ValueError(f"SPLIT_K: expected a power of two in [1, 16], got {cfg['SPLIT_K']!r}")
    for k in ("SWAP_AB", "FUSE_ACT"):
        if not isinstance(cfg[k], bool):
            raise ValueError(f"{k}: expected true or false, got {cfg[k]!r}")
    if cfg["SWAP_AB"] and cfg["FUSE_ACT"]:
        raise ValueError("FUSE_ACT: needs SWAP_AB false (the fused activation is written for untransposed tiles)")
    if cfg["SWAP_AB"] and cfg["BLOCK_SIZE_M"] >= SWAP_AB_MAX_BLOCK_M:
        raise ValueError(f"SWAP_AB: needs BLOCK_SIZE_M < {SWAP_AB_MAX_BLOCK_M}, got {cfg['BLOCK_SIZE_M']} (such tiles "
                         "computed wrong results on an H200 with Triton 3.6; see tuned.SWAP_AB_MAX_BLOCK_M)")
    return {k: cfg[k] for k in CONFIG_KEYS}


def parse_table(data) -> dict:
    """A table file's JSON (``FORMAT``, ``"measured": true``) as {shape key: [(token bucket, full config)] sorted by
    bucket}.

    Raises:
        ValueError: not this format, not marked measured, or a bad bucket or config (the message names it).
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not an {FORMAT} table")
    if data.get("measured") is not True:
        raise ValueError("not marked measured (\"measured\": true)")
    shapes = data.get("shapes")
    if not isinstance(shapes, dict):
        raise ValueError("'shapes' must be an object")
    table = {}
    for key, buckets in shapes.items():
        if not isinstance(buckets, dict) or not buckets:
            raise ValueError(f"{key}: expected a non-empty object of token buckets")
        rows = []
        for b, cfg in buckets.items():
            try:
                bucket = int(b)
            except ValueError:
                raise ValueError(f"{key}: token bucket {b!r} is not an integer") from None
            if bucket < 1:
                raise ValueError(f"{key}: token bucket {b!r} < 1")
            try:
                rows.append((bucket, check_config(cfg)))
            except ValueError as e:
                raise ValueError(f"{key}, bucket {b}: {e}") from None
        table[key] = sorted(rows, key=lambda r: r[0])
    return table


_CACHE: dict = {}


def clear_cache() -> None:
    """Forget the files read (tests; a table written while the process runs)."""
    _CACHE.clear()


def _dirs() -> list[Path]:
    env = os.environ.get(ENV, "").strip()
    if env.lower() == "off":
        return []
    return ([Path(env)] if env else []) + [CONFIG_DIR]


def load_table(gpu_name: str) -> dict | None:
    """The parsed table of ``gpu_name`` (raw name or normalised): the first readable file
    ``<dir>/<normalised name>.json`` of ``EXPQ_KERNEL_CONFIGS`` then the package's ``configs/``; None if there is
    none. A file that cannot be used is ignored (one warning per process) and the search goes on."""
    norm = normalize_gpu_name(gpu_name)
    cache_key = (norm, os.environ.get(ENV, ""))
    if cache_key in _CACHE:
        return _CACHE[cache_key]
    table = None
    for d in _dirs():
        path = d / f"{norm}.json"
        if not path.is_file():
            continue
        try:
            table = parse_table(json.loads(path.read_text()))
            break
        except (OSError, ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
            _LOG.warning(visible(f"expq: ignoring the kernel config table {path}: {e}", one_line=True))
    _CACHE[cache_key] = table
    return table


def pick_bucket(rows: list, num_tokens: int):
    """The config of the nearest bucket in ``rows`` (sorted [(bucket, config)]): min |bucket - T|, ties to the
    smaller bucket."""
    best = min(rows, key=lambda r: (abs(r[0] - num_tokens), r[0]))
    return best[1]


_GPU_NAMES: dict = {}


def _gpu_name(device) -> str | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index
    if index not in _GPU_NAMES:
        try:
            if not torch.cuda.is_available():
                return None
            _GPU_NAMES[index] = torch.cuda.get_device_name(index if index is not None else torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - no usable CUDA: no table
            return None
    return _GPU_NAMES[index]


def lookup(num_tokens: int, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, dtype,
           device) -> dict | None:
    """The tuned config (a new dict) for this call, or None: not a CUDA device, no table for its GPU, or the shape
    is not in it."""
    if device is None or os.environ.get(ENV, "").strip().lower() == "off":
        return None
    name = _gpu_name(device)
    if name is None:
        return None
    table = load_table(name)
    if not table:
        return None
    rows = table.get(shape_key(num_experts, hidden_size, intermediate_size, top_k, dtype))
    if not rows:
        return None
    return dict(pick_bucket(rows, num_tokens))
