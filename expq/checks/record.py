"""What a check returns, and how the per-layer checks keep their findings."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PROBLEMS = 50  # problems the report lists (the first ones found)


@dataclass
class Check:
    """One check as the report shows it: name, pass/fail, and a detail line (the first problem found, naming where;
    or what a passed check measured)."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class CheckResult:
    """What one check found: its record, and every problem it found, in order (the report lists them all)."""

    check: Check
    problems: list[str]


def result(name: str, problems: list[str], passed: str = "") -> CheckResult:
    """The result of check ``name``: failed with its first problem as the detail, or passed with ``passed``."""
    return CheckResult(Check(name, not problems, problems[0] if problems else passed), problems)


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


# The checks made per MoE layer, each reported once for the whole checkpoint (``verifier``'s summary).
CODES, BITS, ROW_ERROR, KERNEL, SOURCE = "codes", "bits", "row error", "kernel", "source"
LAYER_CHECK_NAMES = {CODES: "experts: codes and scales", BITS: "experts: bits equal re-quantized source",
                     ROW_ERROR: "experts: row error within half a step (+ w/scale rounding)",
                     KERNEL: "kernel ({backend}) vs fp32 reference", SOURCE: "kernel vs source experts"}


@dataclass
class Findings:
    """The problems the per-layer checks found, each under the check that found it, so that a check's result and
    detail are its own; ``problems``: all of them, in the order found."""

    problems: list[str] = field(default_factory=list)
    by_check: dict[str, list[str]] = field(default_factory=dict)

    def add(self, check: str, res: LayerResult, msg: str) -> None:
        """Record ``msg`` as a failure of ``check`` (one of ``LAYER_CHECK_NAMES``) in layer ``res``."""
        self.by_check.setdefault(check, []).append(msg)
        res.problems.append(msg)
        res.ok = False
        self.problems.append(msg)

    def of(self, check: str) -> list[str]:
        """The problems ``check`` found (empty: it passed)."""
        return self.by_check.get(check, [])
