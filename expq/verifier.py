"""``verify``: prove a converted checkpoint right, or fail naming the layer, expert and tensor.

Checks:

1. structure (no source needed): expq.json is there and unchanged (its canonical sha256 is the one config.json
   records); every file has the size and sha256 expq.json records; index and shards agree; every routed expert of every MoE layer is there with the
   format's dtypes and shapes; codes in [-127, 127]; scales finite, positive (0 only for an all-zero row, or a row
   the manifest lists as underflowed); each row's largest code is 126 or 127 (the scheme maps the row absmax there,
   so a zeroed or corrupted row shows); the quantization_config validates with compressed-tensors and its targets
   match exactly the quantized modules; every file loads with ``safetensors``;
2. against the source (``source=``): each quantized matrix equals re-quantizing the source matrix bit for bit (counts
   of differing codes and scales per tensor); every other tensor is byte-identical; each row's dequantization error
   is within half a step (plus the scheme's own rounding of w/scale to the compute dtype);
3. kernel: per MoE layer, expq's fused-MoE kernel on the int8 weights (Triton on CUDA, the torch implementation
   elsewhere; the report says which) with routing forced so every expert gets tokens, against an fp32 reference from
   the dequantized weights, and against the source experts when given.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .checkpoint import ConvertedCheckpoint, LayerExperts
from .devices import parse_devices
from .engines.clients import stock_transformers_misloads
from .errors import ExpqError, HubError, LayoutError, UnreadableInputError, UsageError
from .io.index import INDEX_NAME
from .kernels import select_backend
from .manifest import MANIFEST, PUSH_WRITES, manifest_intact
from .options import check_verify
from .plan import JobKind
from .writer import reading

# --- thresholds ----------------------------------------------------------------------------------------------------
# Kernel vs the fp32 reference on the same (dequantized) weights: the only differences are roundings. In bf16 each of
# the activation cast, the GEMM1 cache, the activation output and GEMM2's cast rounds to 2^-9 relative; a few such
# roundings through two GEMMs give ~0.5% relative on a layer's output; 2% leaves room without hiding a wrong scale
# (a doubled scale on one of E experts moves the layer by >> 2%). fp16 has 3 more mantissa bits, fp32 none lost.
KERNEL_REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# The worst single token sees fewer experts, so less averaging: 4x the layer bound.
KERNEL_TOKEN_TOL = {k: 4 * v for k, v in KERNEL_REL_TOL.items()}
# Against the source's own experts, the int8 error adds up: per-row absmax/127 steps give ~0.3-1% relative error
# per GEMM on Gaussian-like weights, two GEMMs and the activation compound it; 6% flags a wrong scale or codes
# without flagging honest int8 noise on outlier-heavy rows.
SOURCE_REL_TOL = 6e-2
# Dequantization error allowed per row, in steps of its scale: half a step from round(), plus the scheme's first
# rounding of w/scale to the compute dtype, at most half its spacing below 128 (64 * u: 0.25 in bf16, 1/32 in fp16).
# A rounded-down scale can push the absmax element's quotient to 127(1 + u) and the clamp then costs < 127u, which
# stays under the same bound. (u = unit roundoff of the dtype; +1e-3 for the fp32 arithmetic of the check itself.)
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def row_error_limit(dtype: torch.dtype) -> float:
    """The largest |w - q*s| / s the experts_int8 scheme can give in ``dtype`` (see above)."""
    return 0.5 + 64 * UNIT_ROUNDOFF[dtype] + 1e-3
MAX_PROBLEMS = 50


@dataclass
class Check:
    """One check: name, pass/fail, and a detail line (the first problem found, naming where)."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class LayerResult:
    """Results for one MoE layer."""

    layer: int
    experts: int
    ok: bool = True
    structure_ok: bool = True
    codes_differ: int | None = None  # against the source (None: no source)
    scales_differ: int | None = None
    max_row_error_steps: float | None = None  # worst |w - q*s| / s over rows, against the source
    kernel_rel_err: float | None = None  # ||out - ref|| / ||ref||, ref = fp32 on the dequantized weights
    kernel_worst_token_err: float | None = None
    source_rel_err: float | None = None  # same kernel output against the source's experts (fp32)
    experts_exercised: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    """What ``verify`` found. ``ok`` is True only if every check passed and the int8 kernel path ran."""

    out: str
    source: str | None
    ok: bool
    verdict: str
    backend: str
    device: str
    activation_dtype: str
    tokens: int
    checks: list[Check]
    layers: list[LayerResult]
    problems: list[str]
    seconds: float
    row_error_limit: float = 0.0  # the largest row error (in steps) the scheme can give in this dtype
    # what a user must know although every check passed: stock transformers would load this checkpoint with random
    # experts (``engines.clients.stock_transformers_misloads``)
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The command line's exit status for this report: 0 when every check passed, 1 otherwise."""
        return 0 if self.ok else 1

    def to_dict(self) -> dict:
        """JSON-ready: NaN and infinite figures become None."""
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v

        return clean(asdict(self))


def _fail(problems: list[str], msg: str) -> None:
    if len(problems) < MAX_PROBLEMS:
        problems.append(msg)


# The checks made per MoE layer, each reported once for the whole checkpoint (``_layer_summary_checks``).
CODES, BITS, ROW_ERROR, KERNEL, SOURCE = "codes", "bits", "row error", "kernel", "source"
LAYER_CHECK_NAMES = {CODES: "experts: codes and scales", BITS: "experts: bits equal re-quantized source",
                     ROW_ERROR: "experts: row error within half a step (+ w/scale rounding)",
                     KERNEL: "kernel ({backend}) vs fp32 reference", SOURCE: "kernel vs source experts"}


@dataclass
class Findings:
    """The problems the per-layer checks found, each under the check that found it, so that a check's result and
    detail are its own; ``problems`` is the report's list of all of them (the first ``MAX_PROBLEMS``)."""

    problems: list[str] = field(default_factory=list)
    by_check: dict[str, list[str]] = field(default_factory=dict)

    def add(self, check: str, res: "LayerResult", msg: str) -> None:
        """Record ``msg`` as a failure of ``check`` (one of ``LAYER_CHECK_NAMES``) in layer ``res``."""
        self.by_check.setdefault(check, []).append(msg)
        res.problems.append(msg)
        res.ok = False
        _fail(self.problems, msg)

    def of(self, check: str) -> list[str]:
        return self.by_check.get(check, [])


def verify(out: str | Path, source: str | Path | None = None, *, device: str = "auto", tokens: int = 64,
           revision: str | None = None, token: str | None = None, seed: int = 0) -> VerifyReport:
    """Verify a checkpoint written by ``expq convert``.

    Steps: open the checkpoint; structure checks; with a source, plan it the same way and compare the other tensors
    byte for byte; per MoE layer, decode the experts and check codes, bits against the source and the kernel;
    summarise.

    Args:
        out: the converted checkpoint directory.
        source: the source checkpoint (directory or Hub repo id) for the bit-for-bit and byte-for-byte checks.
        device: ``auto`` (CUDA if present), ``cpu``, ``cuda`` or ``cuda:N``: where the kernel check runs.
        tokens: random tokens per MoE layer for the kernel check (raised so every expert gets at least one).
        revision, token: Hub revision of ``source``, and the token to fetch it with (default: ``HF_TOKEN`` or the
            huggingface_hub login).
        seed: seed of the random activations.

    Returns:
        VerifyReport (``ok`` False when any check fails; problems name layer/expert/tensor; ``exit_code``;
        ``warnings``: what passing checks do not say, e.g. that stock transformers would load it with random
        experts).

    Raises:
        UsageError: bad device or tokens; the lock file beside OUT is a link. UnreadableInputError: ``out`` (or the
            source) cannot be read at all, or holds a link that leads out of it (named).
    """
    t0 = time.perf_counter()
    check_verify(device=device, tokens=tokens)
    dev = parse_devices(device)[0]
    with reading(out):  # a conversion into OUT does not swap it while it is read
        ck, plan = _open(out, source, revision, token)
        found = Findings()
        checks = _structure_checks(ck, found.problems)
        if plan is not None:
            checks.append(_check_passthrough(ck, plan, found.problems))
        layers = _layer_checks(ck, plan, found, dev, tokens, seed)
    backend = select_backend(dev)
    checks += _layer_summary_checks(ck, layers, found, plan is not None, backend)
    return _report(ck, out, source, checks, layers, found.problems, dev, backend, tokens, time.perf_counter() - t0)


def _open(out, source, revision, token) -> tuple[ConvertedCheckpoint, object]:
    """The checkpoint, and the plan of its source made with the checkpoint's own layout and dtype (or None)."""
    from .plan import make_plan
    from .source import resolve_source

    try:
        ck = ConvertedCheckpoint(out)
        if source is None:
            return ck, None
        src = resolve_source(source, revision=revision, token=token)
        dtype = ck.manifest.options.dtype if ck.manifest is not None else "auto"
        try:
            return ck, make_plan(src, layout=ck.layout, dtype=dtype, format=ck.format.name)
        except LayoutError as e:  # a source of another model: say so (verify takes OUT's layout, it has no other)
            raise UnreadableInputError(
                e.message, file=e.file, tensor=e.tensor,
                hint=f"the source must be the checkpoint OUT was converted from: OUT has the {ck.layout.name} layout "
                     f"(model_type {ck.config.get('model_type')!r}), the source is model_type "
                     f"{src.config.get('model_type')!r}") from None
    except (UsageError, HubError):  # Hub errors keep their own exit codes
        raise
    except ExpqError as e:
        raise UnreadableInputError.from_error(e) from None


def _structure_checks(ck: ConvertedCheckpoint, problems: list[str]) -> list[Check]:
    return [_check_manifest(ck, problems), _check_files_recorded(ck, problems), _check_index(ck, problems),
            _check_files_load(ck, problems), _check_quantization_config(ck, problems),
            _check_modules_present(ck, problems)]


def _check_manifest(ck: ConvertedCheckpoint, problems: list[str]) -> Check:
    """expq.json is there and unchanged: its canonical sha256 is the one config.json records (so an edited
    ``command`` or ``rows.underflow``, which sets this check's own underflow allowance, fails)."""
    why = manifest_intact(ck.root, ck.config)
    if why is not None:
        _fail(problems, f"file {MANIFEST}: {why}")
    return Check(f"{MANIFEST} intact (its sha256 in config.json)", why is None,
                 f"file {MANIFEST}: {why}" if why else "")


UNCHECKED_FILES = PUSH_WRITES  # files a push rewrites in OUT (the model card): listed, their bytes not the checkpoint's


def _check_files_recorded(ck: ConvertedCheckpoint, problems: list[str]) -> Check:
    """Every file expq.json lists has its recorded size and sha256, none is missing, and OUT holds no other file
    (so any changed, missing or extra byte shows without the source)."""
    from .io.hashing import sha256_file

    name = "files match expq.json (size, sha256)"
    if ck.manifest is None or not ck.manifest.files:
        msg = (f"file {MANIFEST}: missing, so no file's size and sha256 can be checked" if ck.manifest is None
               else f"file {MANIFEST}: lists no files (written by an older expq), so none can be checked")
        _fail(problems, msg)
        return Check(name, False, msg)
    bad = []
    listed = {f.name: f for f in ck.manifest.files}
    present = {p.relative_to(ck.root).as_posix() for p in ck.root.rglob("*") if p.is_file()} - {"expq.json"}
    notes = []
    for n in sorted(present - set(listed)):
        if re.search(r"\.(md|txt|rst)$", n, re.IGNORECASE):  # documentation a user added (a push publishes it)
            notes.append(n)
        else:  # weights, configs, code: anything a loader could read
            bad.append(f"file {n}: in OUT but not in expq.json (not written by expq convert)")
    for n, f in sorted(listed.items()):
        p = ck.root / n
        if not p.is_file():
            bad.append(f"file {n}: listed in expq.json but missing")
        elif n in UNCHECKED_FILES:
            continue
        elif p.stat().st_size != f.size:
            bad.append(f"file {n}: {p.stat().st_size} bytes, expq.json says {f.size}")
        elif sha256_file(p) != f.sha256:
            bad.append(f"file {n}: content changed since expq convert wrote it (sha256 differs from expq.json)")
    for b in bad:
        _fail(problems, b)
    detail = f"{len(listed)} files" + (f"; documentation added since: {', '.join(notes)}" if notes else "")
    return Check(name, not bad, bad[0] if bad else detail)


def _layer_checks(ck: ConvertedCheckpoint, plan, found: Findings, dev: torch.device, tokens: int,
                  seed: int) -> list[LayerResult]:
    from .kernels import fused_moe_int8, moe_reference, moe_reference_dense

    src_jobs: dict[int, list] = {}
    for j in (plan.jobs if plan is not None else []):
        if j.kind is JobKind.QUANTIZE:
            src_jobs.setdefault(j.matrices[0].layer, []).append(j)
    act_dtype = ck.scale_dtype  # activations in the compute dtype, as vLLM serves the model
    underflow_budget = ck.manifest.rows.underflow if ck.manifest is not None else 0
    gen = torch.Generator().manual_seed(seed)
    layers: list[LayerResult] = []
    for L in ck.moe_layers:
        res = LayerResult(L, ck.num_experts)
        layers.append(res)
        try:
            experts = ck.layer_experts(L)
        except ExpqError as e:
            res.structure_ok = False
            found.add(CODES, res, f"layer {L}: {e}")
            for k in ([BITS, ROW_ERROR, SOURCE] if plan is not None else []) + [KERNEL]:
                found.add(k, res, f"layer {L}: not checked, its experts cannot be read")
            continue
        underflow_budget = _check_layer_codes(ck, L, experts, res, found, underflow_budget)
        src_w = None
        if plan is not None:
            src_w = _check_layer_bits(ck, experts, plan, src_jobs.get(L, []), L, res, found)
        _check_layer_kernel(ck, experts, res, found, dev, act_dtype, tokens, gen, src_w,
                            fused_moe_int8, moe_reference, moe_reference_dense)
    return layers


def _layer_summary_checks(ck: ConvertedCheckpoint, layers: list[LayerResult], found: Findings, with_source: bool,
                          backend: str) -> list[Check]:
    """One record per layer-level check, from its own findings: failed where it found a problem (the first one is
    the detail), else passed with what it measured."""
    if not layers:
        return [Check(LAYER_CHECK_NAMES[KERNEL].format(backend=backend), False, "no MoE layer to check")]
    keys = [CODES] + ([BITS, ROW_ERROR] if with_source else []) + [KERNEL] + ([SOURCE] if with_source else [])
    return [Check(LAYER_CHECK_NAMES[k].format(backend=backend), not found.of(k),
                  found.of(k)[0] if found.of(k) else _passed_detail(k, ck, layers)) for k in keys]


def _passed_detail(check: str, ck: ConvertedCheckpoint, layers: list[LayerResult]) -> str:
    """What a passed layer-level check measured, over all layers."""
    n = f"{len(layers)} layers x {ck.num_experts} experts"
    if check == CODES:
        return f"{n}: codes in [-127, 127], scales finite, each row's largest code 126 or 127"
    if check == BITS:
        return f"{n}: every code and scale equal"
    if check == ROW_ERROR:
        return (f"worst {max(r.max_row_error_steps for r in layers):.3f} steps "
                f"(limit {row_error_limit(ck.scale_dtype):.3f})")
    if check == KERNEL:
        return (f"worst layer {max(r.kernel_rel_err for r in layers):.1e} relative, worst token "
                f"{max(r.kernel_worst_token_err for r in layers):.1e} (limits "
                f"{KERNEL_REL_TOL[ck.scale_dtype]:.0e} / {KERNEL_TOKEN_TOL[ck.scale_dtype]:.0e}); every expert "
                "exercised")
    return f"worst layer {max(r.source_rel_err for r in layers):.1e} relative (limit {SOURCE_REL_TOL:.0e})"


def _report(ck: ConvertedCheckpoint, out, source, checks: list[Check], layers: list[LayerResult],
            problems: list[str], dev: torch.device, backend: str, tokens: int, seconds: float) -> VerifyReport:
    ok = all(c.ok for c in checks) and all(r.ok for r in layers) and not problems and bool(layers)
    per_token = 1 if ck.layout.router_weight_on_input else min(ck.top_k or 2, ck.num_experts)
    tokens_used = max(tokens, math.ceil(ck.num_experts / max(1, per_token)))
    verdict = (f"PASS: {len(layers)} MoE layers x {ck.num_experts} experts ({len(ck.modules)} matrices) verified"
               f"{' bit for bit against ' + str(source) if source else ''}; kernel {backend} on {dev}"
               if ok else f"FAIL: {problems[0] if problems else next(c.detail or c.name for c in checks if not c.ok)}")
    warnings = [w for w in (stock_transformers_misloads(ck.format, ck.layout),) if w]
    return VerifyReport(out=str(out), source=str(source) if source else None, ok=ok, verdict=verdict,
                        backend=backend, device=str(dev), activation_dtype=str(ck.scale_dtype).removeprefix("torch."),
                        tokens=tokens_used, checks=checks, layers=layers, problems=problems,
                        seconds=round(seconds, 3), row_error_limit=round(row_error_limit(ck.scale_dtype), 4),
                        warnings=warnings)


# --- structure -----------------------------------------------------------------------------------------------------
def _check_index(ck: ConvertedCheckpoint, problems: list[str]) -> Check:
    bad = []
    for f in ck.missing_files:
        bad.append(f"file {f}: listed in {INDEX_NAME} but missing")
    where: dict[str, list[str]] = {}
    for sh in ck.shards.values():
        for t in sh.tensors:
            where.setdefault(t.name, []).append(sh.file)
    for name, files in where.items():
        if len(files) > 1:
            bad.append(f"tensor {name}: stored in {len(files)} shards ({', '.join(files)})")
    for p in sorted(ck.root.glob("*.safetensors")):  # loaders without an index take every *.safetensors
        if p.name not in ck.shards and p.name not in ck.missing_files:
            bad.append(f"file {p.name}: a safetensors file that is not part of the checkpoint")
    if ck.weight_map is not None:
        for name, f in ck.weight_map.items():
            if f in ck.missing_files or f in where.get(name, []):
                continue
            found = f" (it is in {where[name][0]})" if name in where else ""
            bad.append(f"tensor {name}: {INDEX_NAME} says {f} but the tensor is not there{found}")
        for name, files in where.items():
            if name not in ck.weight_map:
                bad.append(f"tensor {name}: in {files[0]} but not in {INDEX_NAME}")
        total = sum(t.nbytes for sh in ck.shards.values() for t in sh.tensors)
        declared = ck.index.total_size
        if declared != total:
            bad.append(f"{INDEX_NAME}: total_size {declared} but the shards hold {total} bytes of tensors")
    for b in bad:
        _fail(problems, b)
    n = len(ck.shards)
    return Check("index and shards agree", not bad, bad[0] if bad else f"{n} shard{'s' if n != 1 else ''}")


def _check_files_load(ck: ConvertedCheckpoint, problems: list[str]) -> Check:
    from safetensors import safe_open

    for f in sorted(ck.shards):
        try:
            with safe_open(ck.root / f, "pt") as s:
                for k in s.keys():
                    s.get_slice(k)
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            msg = f"file {f}: safetensors cannot load it: {e}"
            _fail(problems, msg)
            return Check("files load with safetensors", False, msg)
    return Check("files load with safetensors", True)


def _check_quantization_config(ck: ConvertedCheckpoint, problems: list[str]) -> Check:
    bad = ck.format.check_config(ck.quantization_config, ck.tensors) + ck.format.check_model(ck.config)
    for b in bad:
        _fail(problems, b)
    return Check("quantization_config", not bad, bad[0] if bad else "")


def _check_modules_present(ck: ConvertedCheckpoint, problems: list[str]) -> Check:
    """Every expected matrix has the format's tensors with their dtypes and shapes (shapes from config sizes)."""
    from .experts import Matrix

    bad = []
    em = ck.experts
    for (L, e, p), module in em.expected_modules().items():
        rows, cols = em.matrix_shape(p)
        specs = ck.format.tensor_specs(Matrix(L, e, p, module, rows or 0, cols or 0))
        for spec in specs:
            t = ck.tensors.get(spec.name)
            if t is None:
                bad.append(f"layer {L} expert {e} {p}: tensor {spec.name} missing")
                continue
            if t.dtype != spec.dtype:
                bad.append(f"layer {L} expert {e} {p}: tensor {spec.name} is {t.dtype}, expected {spec.dtype}")
            if rows is not None and cols is not None and tuple(t.shape) != spec.shape:
                bad.append(f"layer {L} expert {e} {p}: tensor {spec.name} has shape {list(t.shape)}, "
                           f"expected {list(spec.shape)}")
    for key in sorted(set(ck.modules) - set(em.expected_modules())):
        bad.append(f"layer {key[0]} expert {key[1]} {key[2]}: quantized module {ck.modules[key]} is not a routed "
                   "expert the config describes")
    for b in bad:
        _fail(problems, b)
    n = len(em.moe_layers) * em.num_experts * 3
    return Check("every routed expert present (dtypes, shapes)", not bad,
                 bad[0] if bad else f"{n} matrices = {len(em.moe_layers)} layers x {em.num_experts} experts x 3")


def _check_layer_codes(ck: ConvertedCheckpoint, L: int, ex: LayerExperts, res: LayerResult, found: Findings,
                       underflow_budget: int) -> int:
    """Codes in range, scales finite/positive, each row's largest code 126 or 127 (or a zero / underflow row)."""
    I = ex.w2.shape[2]
    tiny = torch.finfo(ex.scale_dtype).tiny
    for name, codes, scales in (("w13", ex.w13, ex.w13_scale), ("w2", ex.w2, ex.w2_scale)):
        for e in range(codes.shape[0]):
            c, s = codes[e], scales[e]
            proj = (lambda r: ("gate", r) if r < I else ("up", r - I)) if name == "w13" else (lambda r: ("down", r))
            msg = None
            if (c == -128).any():
                r = int(torch.nonzero((c == -128).any(dim=1))[0])
                msg = "code -128 outside [-127, 127]"
            elif not torch.isfinite(s).all() or (s < 0).any():
                r = int(torch.nonzero(~torch.isfinite(s) | (s < 0))[0])
                msg = f"scale {s[r].item()} is not finite and positive"
            else:
                cmax = c.abs().amax(dim=1)
                zero = s == 0
                bad_zero = zero & (cmax != 0)
                weak = (s >= tiny) & (cmax < 126)
                n_bad_zero = int(bad_zero.sum())
                if n_bad_zero and n_bad_zero <= underflow_budget:
                    underflow_budget -= n_bad_zero  # rows the manifest lists as underflowed: scale 0, codes +-127
                    bad_zero = torch.zeros_like(bad_zero)
                if bad_zero.any():
                    r = int(torch.nonzero(bad_zero)[0])
                    msg = "scale 0 but codes are not all 0 (not a zero row)"
                elif weak.any():
                    r = int(torch.nonzero(weak)[0])
                    msg = (f"largest code is {int(cmax[r])} with scale {s[r].item():.3g}: the scheme maps each row's "
                           "absmax to 126/127, so these codes or this scale are wrong")
            if msg:
                p, row = proj(r)
                module = ck.modules.get((L, e, p), "?")
                res.structure_ok = False
                found.add(CODES, res, f"layer {L} expert {e} {p} row {row} ({module}): {msg}")
    return underflow_budget


# --- against the source --------------------------------------------------------------------------------------------
def _check_passthrough(ck: ConvertedCheckpoint, plan, problems: list[str]) -> Check:
    """Every tensor the source keeps is in the output with the same dtype, shape and bytes (a decoded one: the
    bytes of the source decoded again)."""
    bad = []
    n = 0
    for j in plan.jobs:
        if j.kind is JobKind.QUANTIZE:
            continue
        n += 1
        s = j.tensor
        o = ck.tensors.get(s.name)
        if o is None:
            bad.append(f"tensor {s.name}: in the source but not in the output")
            continue
        if (o.dtype, tuple(o.shape)) != (s.dtype, tuple(s.shape)):
            bad.append(f"tensor {s.name}: {o.dtype}{list(o.shape)} in the output, {s.dtype}{list(s.shape)} in the "
                       "source")
            continue
        if s.decoded:
            same = torch.equal(plan.source.read_logical(s).view(-1).view(torch.uint8),
                               ck.read(s.name).view(-1).view(torch.uint8))
        else:
            st = s.stored
            same = _same_bytes(plan.source.root / st.file, st.start, ck.root / o.file, o.start, st.nbytes)
        if not same:
            bad.append(f"tensor {s.name}: bytes differ from the source ({o.file})")
    for b in bad:
        _fail(problems, b)
    return Check("other tensors byte-identical to the source", not bad, bad[0] if bad else f"{n} tensors")


def _same_bytes(a: Path, a0: int, b: Path, b0: int, n: int, chunk: int = 64 << 20) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(a0)
        fb.seek(b0)
        while n:
            k = min(chunk, n)
            if fa.read(k) != fb.read(k):
                return False
            n -= k
    return True


def _check_layer_bits(ck: ConvertedCheckpoint, ex: LayerExperts, plan, jobs: list, L: int, res: LayerResult,
                      found: Findings) -> dict:
    """Re-quantize the source matrices of layer L and compare with the layer's decoded experts ``ex``; returns
    (expert, proj) -> source matrix (fp32)."""
    from .scheme import dequantize_rows, quantize_rows

    src_w: dict[tuple[int, str], torch.Tensor] = {}
    codes_diff = scales_diff = 0
    worst = 0.0
    for j in jobs:
        w = j.expert.to_rows(plan.source.read_logical(j.tensor).to(plan.compute_dtype)).contiguous()
        ref_codes, ref_scales = quantize_rows(w)
        rows = j.expert.rows_per_matrix
        for i, m in enumerate(j.matrices):
            sl = slice(i * rows, (i + 1) * rows)
            module = ck.modules.get((m.layer, m.expert, m.proj), "?")
            codes, scales = ex.matrix(m.expert, m.proj)
            if codes.shape != ref_codes[sl].shape:
                found.add(BITS, res, f"layer {L} expert {m.expert} {m.proj} ({module}): shape {list(codes.shape)}, "
                                     f"source matrix {list(ref_codes[sl].shape)}")
                continue
            dc = int((codes != ref_codes[sl]).sum())
            ref_s = ref_scales[sl].float()  # fp32 holds every compute-dtype value exactly; NaN equals NaN here
            ds = int(((scales != ref_s) & ~(torch.isnan(scales) & torch.isnan(ref_s))).sum())
            codes_diff += dc
            scales_diff += ds
            if dc or ds:
                found.add(BITS, res, f"layer {L} expert {m.expert} {m.proj} ({module}): {dc} codes and {ds} scales "
                                     f"differ from re-quantizing {j.tensor.name}")
            wm = w[sl].float()
            s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)
            err = ((dequantize_rows(codes, scales) - wm).abs().amax(dim=1) / s)
            live = scales.float() > 0
            if live.any():
                worst = max(worst, float(err[live].max()))
            src_w[(m.expert, m.proj)] = wm
    res.codes_differ, res.scales_differ = codes_diff, scales_diff
    res.max_row_error_steps = round(worst, 4)
    given = sum(len(j.matrices) for j in jobs)
    if given != 3 * res.experts:
        for k in (BITS, ROW_ERROR):
            found.add(k, res, f"layer {L}: the source gives {given} of its {3 * res.experts} expert matrices")
    if worst > row_error_limit(plan.compute_dtype):
        found.add(ROW_ERROR, res, f"layer {L}: a row's dequantization error is {worst:.3f} steps (the scheme allows "
                                  f"{row_error_limit(plan.compute_dtype):.3f})")
    return src_w


# --- kernel --------------------------------------------------------------------------------------------------------
def forced_routing(tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor,
                                                                                             torch.Tensor, int]:
    """Top-k ids that give every expert tokens (round-robin over a random permutation, distinct within a token) and
    positive weights summing to 1 per token. Returns (ids int32 [T, k], weights fp32 [T, k], T)."""
    T = max(tokens, math.ceil(num_experts / top_k))
    perm = torch.randperm(num_experts, generator=gen)
    slots = torch.arange(T * top_k) % num_experts
    ids = perm[slots].view(T, top_k)
    # make ids distinct within each token where possible (top_k <= E)
    for k in range(1, top_k):
        ids[:, k] = perm[(slots.view(T, top_k)[:, 0] + k) % num_experts]
    w = torch.rand(T, top_k, generator=gen) + 0.1
    return ids.to(torch.int32), (w / w.sum(dim=1, keepdim=True)).float(), T


def _check_layer_kernel(ck, ex: LayerExperts, res: LayerResult, found: Findings, dev: torch.device,
                        act_dtype: torch.dtype, tokens: int, gen: torch.Generator, src_w: dict | None,
                        fused_moe_int8, moe_reference, moe_reference_dense) -> None:
    E, H = ex.w2.shape[0], ex.w2.shape[1]
    on_input = ck.layout.router_weight_on_input
    top_k = 1 if on_input else max(1, min(ck.top_k or 2, E))
    ids, weights, T = forced_routing(tokens, E, top_k, gen)
    x = (torch.randn(T, H, generator=gen) * 1.0).to(act_dtype)
    kw = dict(activation=ck.layout.activation, w13_bias=ex.w13_bias, w2_bias=ex.w2_bias,
              apply_router_weight_on_input=on_input)
    if ex.w13.dtype != torch.int8 or ex.w2.dtype != torch.int8:  # never pass without the int8 path
        for k in (KERNEL, SOURCE) if src_w is not None else (KERNEL,):
            found.add(k, res, f"layer {res.layer}: kernel input is not int8")
        return
    mv = lambda t: None if t is None else t.to(dev)  # noqa: E731
    try:
        out = fused_moe_int8(x.to(dev), ex.w13.to(dev), ex.w2.to(dev), ex.w13_scale.to(dev), ex.w2_scale.to(dev),
                             weights.to(dev), ids.to(dev), **{**kw, "w13_bias": mv(ex.w13_bias),
                                                              "w2_bias": mv(ex.w2_bias)}).float().cpu()
    except Exception as e:  # noqa: BLE001 - a kernel failure is a failed check
        msg = f"layer {res.layer}: kernel failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for k in (KERNEL, SOURCE) if src_w is not None else (KERNEL,):
            found.add(k, res, msg)
        return
    res.experts_exercised = int(torch.unique(ids).numel())
    if res.experts_exercised != E:
        found.add(KERNEL, res, f"layer {res.layer}: only {res.experts_exercised} of {E} experts got tokens")
    ref = moe_reference(x, ex.w13, ex.w2, ex.w13_scale, ex.w2_scale, weights, ids, **kw)
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    tok = float(((out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).max())
    res.kernel_rel_err, res.kernel_worst_token_err = round(rel, 6), round(tok, 6)
    if not (rel <= KERNEL_REL_TOL[act_dtype] and tok <= KERNEL_TOKEN_TOL[act_dtype]):
        found.add(KERNEL, res, f"layer {res.layer}: kernel output differs from the fp32 reference: {rel:.2e} relative "
                               f"(worst token {tok:.2e}; limits {KERNEL_REL_TOL[act_dtype]:.0e} / "
                               f"{KERNEL_TOKEN_TOL[act_dtype]:.0e})")
    if src_w is not None and len(src_w) != 3 * E:
        found.add(SOURCE, res, f"layer {res.layer}: not compared, {3 * E - len(src_w)} of its {3 * E} expert "
                               "matrices have no source matrix of the same shape")
    elif src_w is not None:
        w13 = torch.stack([torch.cat([src_w[(e, "gate")], src_w[(e, "up")]]) for e in range(E)])
        w2 = torch.stack([src_w[(e, "down")] for e in range(E)])
        src_ref = moe_reference_dense(x, w13, w2, weights, ids, **kw)
        srel = float((out - src_ref).norm() / src_ref.norm().clamp_min(1e-30))
        res.source_rel_err = round(srel, 6)
        if srel > SOURCE_REL_TOL:
            worst_e = _worst_expert(out, src_ref, ids)
            found.add(SOURCE, res, f"layer {res.layer}: kernel output differs from the source experts by {srel:.2e} "
                                   f"relative (limit {SOURCE_REL_TOL:.0e}; worst tokens go to expert {worst_e})")


def _worst_expert(out: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> int:
    err = (out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
    t = int(err.argmax())
    return int(ids[t, 0])
