"""The options of the public functions, checked before any heavy work: no torch, transformers or Hub import here, so
the command line answers a usage error at once (the API checks the same, with the same words).

Each ``check_*`` raises ``UsageError`` naming the option (in the command line's words, as these messages always
have).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from . import formats
from .errors import UsageError

AUTO = "auto"  # the default of --dtype and --device (and of --format: formats.AUTO)
DEFAULT_MAX_SHARD = "5GB"  # the default --max-shard-size (Hugging Face's own default shard size)
# Compute dtypes by name, and the other spellings accepted for them (scheme.COMPUTE_DTYPES maps names to torch).
DTYPE_NAMES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_SIZE_UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
               "TB": 10**12, "B": 1}


def parse_size(s: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units as Hugging Face uses; KiB/MiB/GiB/TiB binary).

    Raises:
        ValueError: not a finite size, or less than 1 byte (``0.5`` too).

    Example:
        >>> parse_size("5GB"), parse_size("2GiB"), parse_size(1000)
        (5000000000, 2147483648, 1000)
    """
    if isinstance(s, int):
        if s < 1:
            raise ValueError(f"size must be at least 1 byte: {s!r}")
        return s
    t = s.strip().upper().replace(" ", "")
    num, mult = next(((t[: -len(u)], m) for u, m in _SIZE_UNITS.items() if t.endswith(u)), (t, 1))
    try:
        val = float(num)
    except ValueError:
        raise ValueError(f"not a size: {s!r} (use e.g. 5GB, 500MB, 2GiB)") from None
    if val == float("inf") or val != val:
        raise ValueError(f"not a size: {s!r} (use e.g. 5GB, 500MB, 2GiB)")
    if int(val * mult) < 1:
        raise ValueError(f"size must be at least 1 byte: {s!r}")
    return int(val * mult)


def format_size(n: float) -> str:
    """A size in bytes as people read it: decimal units as the Hub shows them, two decimals (rich's formatter).

    Example:
        >>> format_size(5 * 10**9), format_size(1234)
        ('5.00 GB', '1.23 kB')
    """
    from rich.filesize import decimal

    return decimal(int(n), precision=2)


def is_repo_id(s: str) -> bool:
    """Whether ``s`` has the form of a Hub repo id (``name`` or ``org/name``; letters, digits, ``_.-``)."""
    return bool(re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", s)) and not s.startswith((".", "/"))


def local_stat(path, what: str) -> os.stat_result | None:
    """``os.stat`` of a SRC or OUT the user gave, None where nothing is there (ENOENT, ENOTDIR).

    Raises:
        UsageError: ``path`` is empty (a path library reads it as the current folder), or the OS cannot look it up
            (a name too long, a loop of links), naming it and the OS's reason.
    """
    if str(path) == "":
        wanted = "a checkpoint directory or a Hub repo id" if what == "SRC" else "a directory"
        raise UsageError(f"{what} is empty: give {wanted}")
    try:
        return Path(path).expanduser().stat()
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise UsageError(f"cannot open: {e.strerror}", file=str(path)) from None
        return None


def check_source(src) -> None:
    """A SRC is an existing directory or has the form of a Hub repo id (``source.resolve_source`` says the same);
    an empty one, or one the OS cannot look up, is refused (``local_stat``)."""
    st = local_stat(src, "SRC")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UsageError("not a directory (a checkpoint is a folder holding config.json and the weights)",
                         file=str(src))
    if st is None and not is_repo_id(str(src)):
        raise UsageError("no such directory, and not a Hub repo id", file=str(src))


def check_dtype(name: str) -> None:
    """``auto``, a compute dtype name, or one of its aliases."""
    if name != AUTO and DTYPE_ALIASES.get(name, name) not in DTYPE_NAMES:
        raise UsageError(f"unknown --dtype {name!r}; use auto, {', '.join(DTYPE_NAMES)}")


def check_size(value: str | int, flag: str = "--max-shard-size") -> None:
    try:
        parse_size(value)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def check_devices(spec: str | None, *, several: bool = True) -> None:
    """The form of ``auto``, ``cpu``, ``cuda``, ``cuda:N`` (or, with ``several``, a comma-separated list); whether
    the devices exist is ``devices.parse_devices``'s to say."""
    spec = (spec or AUTO).strip()
    parts = [p.strip() for p in spec.split(",")]
    if spec == AUTO or (all(_DEVICE.fullmatch(p) for p in parts) and (several or len(parts) == 1)):
        return
    bad = next((p for p in parts if not _DEVICE.fullmatch(p)), spec)
    raise UsageError(f"unknown device {bad!r} (use auto, cpu, cuda, cuda:N" + (" or a comma-separated list)"
                                                                               if several else ")"))


def check_at_least_one(value: int, flag: str) -> None:
    if value < 1:
        raise UsageError(f"{flag} must be at least 1")


CPU_KERNEL_ENV = "EXPQ_CPU_KERNEL"
CPU_KERNELS = ("auto", "numba", "torch")


def cpu_kernel_choice() -> str:
    """``EXPQ_CPU_KERNEL``'s value, lower-cased (unset or blank: ``auto``): which CPU path ``expq.cpu_kernels`` runs.

    Raises:
        UsageError: any value but ``auto``, ``numba`` and ``torch``.
    """
    want = os.environ.get(CPU_KERNEL_ENV, "auto").strip().lower() or "auto"
    if want not in CPU_KERNELS:
        raise UsageError(f"{CPU_KERNEL_ENV}={want!r}: use {', '.join(CPU_KERNELS)}")
    return want


def check_convert(src, out, *, format: str, dtype: str, device: str, max_shard_size: str | int, stream: bool,
                  ray: str | None, to_hub: str | None) -> None:
    """Every option of ``api.convert`` whose value alone can be wrong, and their combinations."""
    check_source(src)
    cpu_kernel_choice()
    formats.check_name(format)
    check_dtype(dtype)
    check_devices(device)
    check_size(max_shard_size)
    if to_hub is not None and ray is None:
        raise UsageError("--to-hub needs --ray: its tasks upload the shards they write (on one machine, convert "
                         "to OUT and run `expq push OUT REPO`)")
    if to_hub is not None and out is not None:
        raise UsageError("give OUT or --to-hub, not both")
    if to_hub is None and out is None:
        raise UsageError("missing OUT (or --to-hub REPO with --ray)")
    if out is not None and str(out) == "":
        local_stat(out, "OUT")  # refused: empty
    if to_hub is not None:
        check_repo_id(to_hub, "--to-hub")
    local = Path(src).expanduser()
    if stream and local.exists():
        kind = "directory" if local.is_dir() else "file"
        raise UsageError(f"--stream applies to Hub repo ids; SRC is a local {kind} (convert it without --stream)",
                         file=str(src))


def is_model_repo_id(s: str) -> bool:
    """Whether ``s`` names a Hub model repo to publish to: ``namespace/name`` (not ``datasets/...``, ``spaces/...``)."""
    return not s.startswith(("datasets/", "spaces/")) and s.count("/") == 1 and is_repo_id(s)


def check_repo_id(repo_id: str, flag: str | None = None) -> None:
    """A model repo id, ``namespace/name`` (``flag``: the option that gave it, named in the message)."""
    if not is_model_repo_id(repo_id):
        raise UsageError(f"{flag + ' ' if flag else ''}{repo_id!r} is not a model repo id (namespace/name)")


def check_inspect(src, *, format: str, dtype: str, max_shard_size: str | int) -> None:
    """The options of ``api.inspect`` whose value alone can be wrong."""
    check_source(src)
    formats.check_name(format)
    check_dtype(dtype)
    check_size(max_shard_size)


def check_verify(*, device: str, tokens: int, out=None) -> None:
    """The options of ``verifier.verify`` whose value alone can be wrong; ``out``: not empty, and a path the OS
    can look up (``local_stat``)."""
    if out is not None:
        local_stat(out, "OUT")
    check_devices(device, several=False)
    check_at_least_one(tokens, "--tokens")


def check_run(*, device: str | None, max_new_tokens: int, prompt: str) -> None:
    """The options of ``runtime.generate`` whose value alone can be wrong."""
    if device is not None:
        check_devices(device, several=False)
    check_at_least_one(max_new_tokens, "--max-new-tokens")
    if not prompt.strip():
        raise UsageError("--prompt is empty")
