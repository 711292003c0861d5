"""``verify``: prove a converted checkpoint right, or fail naming the layer, expert and tensor.

Checks:

1. structure (no source needed): expq.json is there and unchanged (its canonical sha256 is the one config.json
   records); OUT holds the files expq.json lists, each with the size and sha256 it records, and nothing else
   (``manifest.files_against_manifest``); index and shards agree; every routed expert of every MoE layer is there
   with the format's dtypes and shapes; codes in [-127, 127]; scales finite, positive (0 only for an all-zero row,
   or a row the manifest lists as underflowed); each row's largest code is 126 or 127 (the scheme maps the row
   absmax there, so a zeroed or corrupted row shows); the quantization_config validates with compressed-tensors and
   its targets match exactly the quantized modules; every file loads with ``safetensors``;
2. against the source (``source=``): each quantized matrix equals re-quantizing the source matrix bit for bit (counts
   of differing codes and scales per tensor); every other tensor is byte-identical; each row's dequantization error
   is within half a step (plus the scheme's own rounding of w/scale to the compute dtype);
3. kernel: per MoE layer, expq's fused-MoE kernel on the int8 weights (Triton on CUDA, the torch implementation
   elsewhere; the report says which) with routing forced so every expert gets tokens, against an fp32 reference from
   the dequantized weights, and against the source experts when given.

Each check is a function in ``expq/checks/`` over one ``ConvertedCheckpoint`` (opened once: config, expq.json,
index and headers), returning its record; ``verify`` runs them in that order and writes the report.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .checkpoint import ConvertedCheckpoint, open_checkpoint
from .checks.experts import layer_bits, layer_codes, other_tensors_match_source
from .checks.kernel import layer_kernel
from .checks.record import (BITS, CODES, KERNEL, LAYER_CHECK_NAMES, MAX_PROBLEMS, ROW_ERROR, SOURCE, Check,
                            CheckResult, Findings, LayerResult, result)
from .checks.structure import STRUCTURE
from .checks.thresholds import KERNEL_REL_TOL, KERNEL_TOKEN_TOL, SOURCE_REL_TOL, row_error_limit
from .devices import parse_devices
from .engines.clients import stock_transformers_misloads
from .errors import ExpqError, HubError, LayoutError, UnreadableInputError, UsageError
from .kernels import select_backend
from .options import check_verify
from .plan import JobKind, Plan
from .output.outdir import reading

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


def verify(out: str | Path, source: str | Path | None = None, *, device: str = "auto", tokens: int = 64,
           revision: str | None = None, token: str | None = None, seed: int = 0) -> VerifyReport:
    """Verify a checkpoint written by ``expq convert``.

    Steps: open the checkpoint (and, with a source, plan it the same way); the structure checks
    (``checks.structure.STRUCTURE``); with a source, the other tensors byte for byte; per MoE layer, decode the
    experts and check codes, bits against the source and the kernel; summarise.

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
    check_verify(device=device, tokens=tokens, out=out)
    dev = parse_devices(device)[0]
    with reading(out):  # a conversion into OUT does not swap it while it is read
        ck = open_checkpoint(out)
        plan = _source_plan(ck, source, revision, token) if source is not None else None
        results = [check(ck) for check in STRUCTURE]
        if plan is not None:
            results.append(other_tensors_match_source(ck, plan))
        layers, found = _layer_checks(ck, plan, dev, tokens, seed)
    problems = ([p for r in results for p in r.problems] + found.problems)[:MAX_PROBLEMS]
    backend = select_backend(dev)
    results += _layer_summary(ck, layers, found, plan is not None, backend)
    return _report(ck, out, source, [r.check for r in results], layers, problems, dev, backend, tokens,
                   time.perf_counter() - t0)


def _source_plan(ck: ConvertedCheckpoint, source: str | Path, revision: str | None, token: str | None) -> Plan:
    """The plan of ``source`` made with the checkpoint's own layout, dtype and format.

    Raises:
        UnreadableInputError: the source cannot be read, or is of another model. HubError, UsageError: as raised.
    """
    from .plan import make_plan
    from .source import resolve_source

    try:
        src = resolve_source(source, revision=revision, token=token)
        dtype = ck.manifest.options.dtype if ck.manifest is not None else "auto"
        try:
            return make_plan(src, layout=ck.layout, dtype=dtype, format=ck.format.name)
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


def _layer_checks(ck: ConvertedCheckpoint, plan: Plan | None, dev: torch.device, tokens: int,
                  seed: int) -> tuple[list[LayerResult], Findings]:
    """Per MoE layer: read its experts once, then the codes check, the bits and row error against the source (with
    a plan), and the kernel check."""
    src_jobs: dict[int, list] = {}
    for j in (plan.jobs if plan is not None else []):
        if j.kind is JobKind.QUANTIZE:
            src_jobs.setdefault(j.matrices[0].layer, []).append(j)
    act_dtype = ck.scale_dtype  # activations in the compute dtype, as vLLM serves the model
    underflow_budget = ck.manifest.rows.underflow if ck.manifest is not None else 0
    gen = torch.Generator().manual_seed(seed)
    found = Findings()
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
        underflow_budget = layer_codes(ck, experts, res, found, underflow_budget)
        src_w = layer_bits(ck, experts, plan, src_jobs.get(L, []), res, found) if plan is not None else None
        layer_kernel(ck, experts, res, found, dev, act_dtype, tokens, gen, src_w)
    return layers, found


def _layer_summary(ck: ConvertedCheckpoint, layers: list[LayerResult], found: Findings, with_source: bool,
                   backend: str) -> list[CheckResult]:
    """One record per layer-level check, from its own findings: failed where it found a problem (the first one is
    the detail), else passed with what it measured."""
    if not layers:
        return [result(LAYER_CHECK_NAMES[KERNEL].format(backend=backend), ["no MoE layer to check"])]
    keys = [CODES] + ([BITS, ROW_ERROR] if with_source else []) + [KERNEL] + ([SOURCE] if with_source else [])
    return [result(LAYER_CHECK_NAMES[k].format(backend=backend), found.of(k),
                   "" if found.of(k) else _passed_detail(k, ck, layers)) for k in keys]


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
