"""The plan: before any byte is written, what happens to every source tensor and where every output tensor goes.

``make_plan`` reads as its steps: resolve the layout, build the expert map (every check of the experts against the
config and the tensors; the source decoder refuses routed experts it must not decode), resolve the compute dtype,
pick the output format, check the experts' dtypes, build one job per logical source tensor (``JobKind``: copy its
bytes, decode it, or quantize the routed-expert matrices it holds, with the output tensors the format says they
become; a stacked expert tensor's job cut into slices of experts, ``Slice``), and cut the outputs into shards at
fixed offsets. The pipeline executes the jobs; the writer lays down the files.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from .decoders import LogicalTensor
from .errors import LayoutError, SourceError, UsageError
from .formats.stock_model import ChildProcesses, NotComputed, answered_at_once, in_child_process
from .experts import ExpertMap, ExpertTensor, Matrix
from .engines.clients import stock_transformers_misloads
from .formats import AUTO, Format, get_format
from .io.safetensors import DTYPE_BITS, TORCH_DTYPES
from .layouts import Layout, detect_layout, load_layout, nested_configs
from .manifest import DECODED_EXPERTS, DECODED_OTHERS
from .options import DEFAULT_MAX_SHARD, parse_size
from .scheme import COMPUTE_DTYPES, resolve_compute_dtype
from .source import Source

DEFAULT_FORMAT = AUTO  # the family's default format (its layout's [clients] format)
SLICE_BYTES = 256 << 20
"""The most bytes of routed-expert rows in the compute dtype that one slice of a stacked expert tensor holds
(``Slice``; at least one expert a slice). What a slice costs the host while the pipeline computes it is about 2.5x
this (its decoded rows, their contiguous copy in the compute dtype, the codes; plus its stored bytes), so a job in
computation holds about 0.7 GB whatever the number of experts, instead of the whole tensor (GPT-OSS-120B's
``gate_up_proj``: 4.25 GB decoded, 2.1 GB of codes; 16 slices of 8 experts now). 256 MiB is more than a job of the
per-expert families holds (one matrix: DeepSeek-V3 29 MB, Qwen3-235B-A22B 13 MB, Mixtral-8x22B 201 MB), and those
run at full speed: the per-slice costs (one dispatch over the thread pool, one GPU synchronisation) stay negligible.
The output bytes do not depend on it (the scheme is per row). ``EXPQ_SLICE_BYTES`` (a size, e.g. ``64MiB``)
overrides it; read when a plan is made (``slice_bytes``)."""
SLICE_ENV = "EXPQ_SLICE_BYTES"
BACKGROUND_CHECK_MIN_BYTES = 1 << 30
"""The smallest source whose conversion runs its model check beside it (``ModelCheck``): a smaller one converts in
less time than the check's child takes (4-17 s: a second import of torch, then transformers), so the check runs in
the plan, as for ``inspect``."""


@dataclass
class OutTensor:
    """An output tensor: name, dtype, shape; where it goes (``shard`` index, ``offset`` in that file's data area);
    ``value``: its bytes when the format knows them at plan time (written when the shard is opened)."""

    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    nbytes: int
    shard: int = -1
    offset: int = -1
    value: bytes | None = None


@dataclass(frozen=True)
class Slice:
    """Experts ``[first, stop)`` of a quantize job's tensor, which the pipeline reads, decodes, quantizes and writes
    as one piece (the whole tensor for a per-expert tensor, and for a stacked one that fits ``SLICE_BYTES``).

    Attributes:
        tensor: those experts' logical tensor (``Decoder.narrow``: only their stored bytes are read), or the job's
            own when the slice is the whole tensor.
        expert: their matrices (``ExpertTensor.experts_slice``), in row order.
        groups: the indices of their output groups in the job's ``groups`` (one group per matrix).
    """

    first: int
    stop: int
    tensor: LogicalTensor
    expert: ExpertTensor
    groups: range


class JobKind(StrEnum):
    """What becomes of a logical source tensor (the value is what ``inspect --tensors`` prints as its action)."""

    COPY = "copy"  # its stored bytes, as they are (byte-identical)
    DECODE = "decode"  # a quantized non-expert source tensor, written decoded in its logical dtype (not quantized)
    QUANTIZE = "quantize"  # its routed-expert matrices, each becoming the format's tensors


@dataclass
class Job:
    """One logical source tensor (``tensor``) and what becomes of it (``kind``). ``groups``: the output tensors,
    one group per matrix (a copy or decode job has one group of one), kept together in a shard. ``slices``: a
    quantize job's pieces of work, in expert order, covering its matrices once (``Slice``; none for the others).
    The job, not the slice, is the unit the journal and a resume count.
    """

    kind: JobKind
    tensor: LogicalTensor
    groups: list[list[OutTensor]]
    expert: ExpertTensor | None = None
    slices: tuple[Slice, ...] = ()

    @property
    def outputs(self) -> list[OutTensor]:
        return [o for g in self.groups for o in g]

    @property
    def matrices(self) -> tuple[Matrix, ...]:
        return self.expert.matrices if self.expert is not None else ()

    def groups_of(self, piece: Slice) -> list[list[OutTensor]]:
        """The output groups of one of the job's slices (one per matrix of ``piece.expert``, in row order)."""
        return [self.groups[i] for i in piece.groups]


@dataclass
class Plan:
    """What ``convert`` will do. Produced by ``make_plan`` (also what ``expq inspect`` shows). Sizes are bytes."""

    source: Source
    layout: Layout
    detected_by: str
    experts: ExpertMap
    format: Format
    compute_dtype: torch.dtype
    dtype_reason: str
    jobs: list[Job]
    shard_names: list[str]
    shard_sizes: list[int]
    max_shard_size: int
    model_check: ModelCheck | None = None  # the check against transformers' model class, when still running

    def finish_checks(self, stop: threading.Event | None = None) -> None:
        """Wait for the checks ``make_plan`` left running (``background_checks``), and raise what they found.

        Raises:
            LayoutError: as ``make_plan``'s check of the format against the model class. Whatever else the
            check raised. Returns early (nothing raised) when ``stop`` is set: the caller's stop decides.
        """
        if self.model_check is not None:
            self.model_check.wait(stop)

    def cancel_checks(self) -> None:
        """End the checks ``make_plan`` left running, if they still run (their verdict is no longer wanted): none
        outlives the conversion."""
        if self.model_check is not None:
            self.model_check.cancel()

    def checks_failed(self) -> bool:
        """Whether a check ``make_plan`` left running has found a problem (``finish_checks`` raises it): the
        pipelines stop for it (``pipeline.Run.halted``) rather than convert what cannot be committed."""
        return self.model_check is not None and self.model_check.failed()

    def checks_verdict(self) -> BaseException | bool | None:
        """What the checks ``make_plan`` left running have found so far (an interrupted conversion says it, so that
        its line never promises a resume that a re-run would refuse): True when they passed (or none was left
        running), the error ``finish_checks`` would raise when one found a problem, None while not yet known."""
        if self.model_check is None:
            return True
        return self.model_check.verdict()

    @property
    def model_type(self) -> str | None:
        return self.source.config.get("model_type")

    @property
    def architecture(self) -> str | None:
        archs = self.source.config.get("architectures")
        return archs[0] if isinstance(archs, list) and archs else None

    def tensors_of(self, kind: JobKind) -> list[LogicalTensor]:
        """The logical source tensors of the jobs of ``kind``, in job order."""
        return [j.tensor for j in self.jobs if j.kind is kind]

    @property
    def copied(self) -> list[LogicalTensor]:
        """The tensors copied byte for byte."""
        return self.tensors_of(JobKind.COPY)

    @property
    def decoded(self) -> list[LogicalTensor]:
        """The tensors of a quantized source written decoded, not quantized (not byte-identical to the source)."""
        return self.tensors_of(JobKind.DECODE)

    @property
    def unquantized(self) -> list[LogicalTensor]:
        """Every tensor not quantized: copied byte for byte or decoded, in job order."""
        return [j.tensor for j in self.jobs if j.kind is not JobKind.QUANTIZE]

    @property
    def quantized_bytes_out(self) -> int:
        """Output bytes of the format's tensors for the routed experts."""
        return sum(o.nbytes for j in self.jobs if j.kind is JobKind.QUANTIZE for o in j.outputs)

    @property
    def outputs(self) -> list[OutTensor]:
        return [o for j in self.jobs for o in j.outputs]

    @property
    def bytes_in(self) -> int:
        return self.source.total_bytes

    @property
    def bytes_out(self) -> int:
        return sum(self.shard_sizes)

    def quantization_config(self) -> dict:
        """The output's ``quantization_config`` (the format's)."""
        return self.format.quantization_config(self.source.logical)

    def summary(self) -> dict:
        """A JSON-ready description (what ``expq inspect --json`` prints)."""
        em = self.experts
        q_src = self.tensors_of(JobKind.QUANTIZE)
        return {
            "source": self.source.id,
            "revision": self.source.revision,
            "commit": self.source.commit,
            "source_format": self.source.decoder.name,
            "format": self.format.name,
            "architecture": self.architecture,
            "model_type": self.model_type,
            "layout": self.layout.name,
            "layout_file": self.layout.path,
            "layout_rule": self.layout.rule,
            "detected_by": self.detected_by,
            "config_keys": em.config_keys,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "compute_dtype_reason": self.dtype_reason,
            "num_layers": em.num_layers,
            "moe_layers": em.moe_layers,
            "dense_layers": em.dense_layers,
            "extra_expert_layers_copied": em.extra_layers,
            "routed_experts_per_layer": em.num_experts,
            "top_k": em.top_k,
            "hidden_size": em.hidden_size,
            "moe_intermediate_size": em.intermediate_size,
            "matrices_quantized": len(em.matrices),
            "source_tensors_quantized": len(q_src),
            "source_tensors_copied": len(self.unquantized),
            "source_tensors_byte_identical": len(self.copied),
            "source_tensors_decoded_not_quantized": len(self.decoded),
            "source_tensors_decoded": sum(1 for j in self.jobs if j.tensor.decoded),
            "decoded_as": self.decoded_as(),
            "bytes_quantized_in": sum(t.nbytes_stored for t in q_src),
            "bytes_copied": sum(t.nbytes_stored for t in self.unquantized),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "output_shards": len(self.shard_names),
            "targets": self.format.targets(),
            "format_reason": self.format_reason(),
            "warnings": [w for w in (stock_transformers_misloads(self.format, self.layout),) if w],
            "clients": [{"engine": c.engine, "loads": c.loads, "command": c.one_line("OUT"), "note": c.note,
                         "commands": [{"when": w, "command": cmd} for w, cmd in c.variant_lines("OUT")]}
                        for c in self.format.clients(self.layout, em.hidden_size, local=True)],
            "side_files": self.source.side_files,
            "skipped_files": self.source.skipped_files,
        }

    def format_reason(self) -> str:
        """Why this output format: the family's default (and the layout's reason), or the user's choice."""
        lay = self.layout
        if self.format.name != lay.default_format:
            return f"chosen with --format (this family's default is {lay.default_format})"
        if lay.format_reason:
            return f"this family's default: {lay.format_reason}"
        loads = [c.engine for c in self.format.clients(lay, self.experts.hidden_size, local=True)
                 if c.loads and c.engine != "expq"]
        names = ", ".join(loads[:-1]) + (" and " if len(loads) > 1 else "") + (loads[-1] if loads else "")
        return "this family's default: " + (f"stock {names} load{'s' if len(loads) == 1 else ''} it"
                                            if loads else "expq.load_model runs it")

    def decoded_as(self) -> dict[str, int]:
        """How the quantized source tensors are decoded: ``"<routed experts|other> <how>"`` -> count."""
        out: dict[str, int] = {}
        for j in self.jobs:
            if j.tensor.decoded:
                kind = DECODED_EXPERTS if j.kind is JobKind.QUANTIZE else DECODED_OTHERS
                key = f"{kind}: {j.tensor.how}"
                out[key] = out.get(key, 0) + 1
        return out

    def tensor_table(self) -> list[dict]:
        """Every logical source tensor and what happens to it (what ``expq inspect --tensors`` lists)."""
        return [{"name": j.tensor.name, "file": j.tensor.file, "dtype": j.tensor.stored.dtype,
                 "shape": list(j.tensor.shape), "action": j.kind.value, "decoded": j.tensor.how if j.tensor.decoded
                 else None, "outputs": [o.name for o in j.outputs]} for j in self.jobs]


def make_plan(source: Source, *, layout: Layout | str | Path | None = None, dtype: str = "auto",
              max_shard_size: str | int = DEFAULT_MAX_SHARD, format: str = DEFAULT_FORMAT,
              background_checks: bool = False) -> Plan:
    """Check the source against its layout and plan the conversion.

    Args:
        source: an opened source (``resolve_source``).
        layout: a Layout, a layout file path (``--layout FILE``), or None to detect from config.json.
        dtype: ``auto`` or an explicit compute dtype (see ``scheme.resolve_compute_dtype``).
        max_shard_size: the largest output shard, e.g. ``"5GB"`` (a single larger tensor gets a shard of its own).
        format: the output format (``formats.FORMATS``), or ``auto``: the family's default (layout ``[clients]
            format``: compressed-tensors where stock clients load it, experts-int8 where they cannot).
        background_checks: leave the check of the format against transformers' model class running
            (``ModelCheck``: a conversion runs beside it) for a source of ``BACKGROUND_CHECK_MIN_BYTES`` or more;
            ``Plan.finish_checks`` raises what it finds. Else it runs here.

    Returns:
        the Plan.

    Raises:
        LayoutError: unknown architecture; expert count, MoE layers, shapes or orientation that do not match;
            the format's tensors do not fit transformers' model class (``Format.check_model``).
        SourceError: expert tensors that are not float; routed experts the source decoder refuses
            (``Decoder.check_experts``: already int8 per channel).
        UsageError: an unknown format, a bad ``EXPQ_SLICE_BYTES``, an unknown ``dtype`` or config dtype (naming
            config.json). ValueError: a bad ``max_shard_size``.
    """
    lay, detected_by = resolve_layout(source.config, layout)
    experts = ExpertMap.from_source(lay, source.config, source.logical)
    source.decoder.check_experts(experts)
    try:
        compute_dtype, dtype_reason = resolve_compute_dtype(config_dtype(source.config), dtype)
    except ValueError as e:  # an unknown dtype: the config's (named), or an explicit one
        raise UsageError(str(e), **({"file": "config.json"} if dtype == "auto" else {})) from None
    shard_limit, budget = parse_size(max_shard_size), slice_bytes()
    fmt = get_format(lay.default_format if format == DEFAULT_FORMAT else format, experts, compute_dtype)
    _check_expert_dtypes(source, experts)
    _check_lm_head(source)
    # in the background only what a child process computes (``answered_at_once``: else it costs nothing here), and
    # only beside a conversion long enough to hide it (the child pays a second import of torch)
    check = ModelCheck(fmt, source.config) if background_checks and not answered_at_once() and \
        source.total_bytes >= BACKGROUND_CHECK_MIN_BYTES else _check_model(fmt, source.config)
    jobs = _build_jobs(source, experts, fmt, compute_dtype, budget)
    _check_unique_names(jobs)
    shard_names, shard_sizes = _assign_shards(jobs, shard_limit)
    return Plan(source=source, layout=lay, detected_by=detected_by, experts=experts, format=fmt,
                compute_dtype=compute_dtype, dtype_reason=dtype_reason, jobs=jobs, shard_names=shard_names,
                shard_sizes=shard_sizes, max_shard_size=shard_limit, model_check=check)


# --- steps of make_plan ----------------------------------------------------------------------------------------------
def resolve_layout(config: dict, layout: Layout | str | Path | None) -> tuple[Layout, str]:
    """The layout to use and what decided it: the given Layout or file, else detected from config.json."""
    if layout is None:
        return detect_layout(config)
    if isinstance(layout, Layout):
        return layout, f"layout {layout.path}"
    return load_layout(layout), f"--layout {layout}"


def config_dtype(config: dict) -> str | None:
    """The config's ``torch_dtype`` / ``dtype`` (top level, else a nested config's), or None.

    Raises:
        LayoutError: a dtype that is not a string.
    """
    for scope in (config, *(c for _, c in nested_configs(config))):
        for k in ("torch_dtype", "dtype"):
            v = scope.get(k)
            if isinstance(v, str):
                return v
            if v is not None:
                raise LayoutError(f"{k} = {v!r} is not a dtype name", file="config.json")
    return None


def _check_expert_dtypes(source: Source, experts: ExpertMap) -> None:
    for name in experts.tensors:
        t = source.logical[name]
        if TORCH_DTYPES.get(t.dtype) not in COMPUTE_DTYPES.values():
            raise SourceError(f"routed-expert weight is {t.dtype}, not bf16/fp16/fp32", file=t.file, tensor=name)


class ModelCheck:
    """``_check_model`` on a thread of its own (``expq-model-check``), so that a conversion need not wait for it:
    on a cold cache the marker check imports transformers and the model's module, seconds of one core, which it
    computes in a child process (``formats.stock_model.in_child_process``) while the pipelines run; its verdict is
    taken before the commit (``Plan.finish_checks``). Where the child gives no answer, ``wait`` computes it in the
    waiting thread."""

    def __init__(self, fmt: Format, config: dict):
        self._fmt, self._config = fmt, config
        self._error: BaseException | None = None
        self._here = False  # the child gave no answer: ``wait`` computes it
        self._children = ChildProcesses()
        self._thread = threading.Thread(target=self._main, name="expq-model-check", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            with in_child_process(self._children):
                _check_model(self._fmt, self._config)
        except NotComputed:
            self._here = True
        except BaseException as e:  # noqa: BLE001 - raised by wait, in the caller's thread
            self._error = e

    def cancel(self) -> None:
        """End its child process, if one still runs (the verdict is no longer wanted: the conversion ended)."""
        self._children.end()

    def failed(self) -> bool:
        """Done, and found a problem (or raised)."""
        return self._error is not None

    def verdict(self) -> BaseException | bool | None:
        """The error it found (or raised), True when done without one, None while not done."""
        if self._error is not None:
            return self._error
        return None if self._here or self._thread.is_alive() else True

    def wait(self, stop: threading.Event | None = None) -> None:
        """Block until the check is done (or ``stop`` is set: then return at once), then raise what it found. Where
        the child gave no answer, the check is computed now (the caller's pipelines are done), on a thread of its own
        so that ``stop`` is still seen within 0.1 s."""
        if not self._join(stop):
            return
        if self._here:
            self._thread = threading.Thread(target=self._compute_here, name="expq-model-check", daemon=True)
            self._thread.start()
            self._here = False  # after the start: ``verdict`` never sees a finished thread and no answer as done
            if not self._join(stop):
                return
        if self._error is not None:
            raise self._error

    def _join(self, stop: threading.Event | None) -> bool:
        while self._thread.is_alive():
            if stop is not None and stop.is_set():
                return False
            self._thread.join(0.1)
        return True

    def _compute_here(self) -> None:
        try:
            _check_model(self._fmt, self._config)
        except BaseException as e:  # noqa: BLE001 - raised by wait, in the caller's thread
            self._error = e


def _check_model(fmt: Format, config: dict) -> None:
    """The format's tensors fit the model class stock clients build (experts-int8: its layer markers are real
    weights, so stock transformers refuses the output rather than load random experts).

    Raises:
        LayoutError: the first problem, naming the layout file.
    """
    bad = fmt.check_model(config)
    if bad:
        raise LayoutError(bad[0], file=fmt.experts.layout.path)


def _check_lm_head(source: Source) -> None:
    """A config that says the embeddings are not tied needs an ``lm_head`` (else a loader fills it randomly)."""
    from .layouts import config_lookup

    tied, where = config_lookup(source.config, ("tie_word_embeddings",))
    if tied is False and not any(n.startswith("lm_head.") or ".lm_head." in n for n in source.logical):
        raise SourceError(f"{where} is false but the checkpoint has no lm_head weight: a loader would initialise "
                          "it randomly", file="config.json")


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)


def slice_bytes() -> int:
    """The budget of one slice of a stacked expert tensor: ``$EXPQ_SLICE_BYTES`` where set, else ``SLICE_BYTES``.

    Raises:
        UsageError: ``EXPQ_SLICE_BYTES`` is not a size of at least 1 byte.
    """
    env = os.environ.get(SLICE_ENV)
    if not env:
        return SLICE_BYTES
    try:
        return parse_size(env)
    except ValueError as e:
        raise UsageError(f"{SLICE_ENV}={env!r}: {e} (unset it for the default, {SLICE_BYTES >> 20} MiB)") from None


def _build_jobs(source: Source, experts: ExpertMap, fmt: Format, compute_dtype: torch.dtype,
                budget: int) -> list[Job]:
    """One job per logical tensor, in the stored order of the source shards; a quantize job's slices of at most
    ``budget`` bytes of rows in ``compute_dtype`` (``_slices``)."""
    jobs: list[Job] = []
    for t in sorted(source.logical.values(), key=lambda t: (t.stored.file, t.stored.start)):
        et = experts.tensors.get(t.name)
        if et is None:
            out = OutTensor(t.name, t.dtype, t.shape, _nbytes(t.dtype, t.shape))
            jobs.append(Job(JobKind.DECODE if t.decoded else JobKind.COPY, t, [[out]]))
            continue
        groups = [[OutTensor(s.name, s.dtype, s.shape, _nbytes(s.dtype, s.shape), value=s.value)
                   for s in fmt.tensor_specs(m)]
                  for m in et.matrices]
        jobs.append(Job(JobKind.QUANTIZE, t, groups, et, _slices(source, t, et, compute_dtype, budget)))
    return jobs


def _slices(source: Source, t: LogicalTensor, et: ExpertTensor, compute_dtype: torch.dtype,
            budget: int) -> tuple[Slice, ...]:
    """A quantize job's slices: for a stacked tensor whose rows in ``compute_dtype`` exceed ``budget`` bytes, runs
    of as many whole experts as fit the budget (at least one), each narrowed by the source decoder
    (``Decoder.narrow``); else, or where the decoder cannot cut the tensor at an expert boundary, the whole."""
    E = et.stacked_experts
    whole = (Slice(0, max(E, 1), t, et, range(len(et.matrices))),)
    if E <= 1:
        return whole
    per_matrices = len(et.matrices) // E
    per_expert = sum(m.rows * m.cols for m in et.matrices[:per_matrices]) * compute_dtype.itemsize
    n = max(1, budget // max(1, per_expert))
    if n >= E:
        return whole
    narrow = getattr(source.decoder, "narrow", None)  # (a decoder registered before it: taken whole)
    if narrow is None:
        return whole
    out = []
    for first in range(0, E, n):
        stop = min(E, first + n)
        piece = narrow(t, *et.leading_range(first, stop, t.shape))
        if piece is None:
            return whole
        out.append(Slice(first, stop, piece, et.experts_slice(first, stop),
                         range(first * per_matrices, stop * per_matrices)))
    return tuple(out)


def _check_unique_names(jobs: list[Job]) -> None:
    seen: set[str] = set()
    for o in (o for j in jobs for o in j.outputs):
        if o.name in seen:
            raise LayoutError("two output tensors would have the same name", tensor=o.name)
        seen.add(o.name)


def _assign_shards(jobs: list[Job], limit: int) -> tuple[list[str], list[int]]:
    """Cut the outputs into shards of at most ``limit`` bytes, in production order, keeping each group (a module's
    tensors) together; within a shard, lay tensors out by descending itemsize (so every tensor is aligned), then
    production order. Sets ``shard`` and ``offset`` on every OutTensor. Returns (file names, data sizes)."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for grp in (g for j in jobs for g in j.groups):
        n = sum(o.nbytes for o in grp)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].extend(grp)
        size += n
    sizes = []
    for k, members in enumerate(shards):
        order = sorted(range(len(members)), key=lambda i: (-max(1, DTYPE_BITS[members[i].dtype] // 8), i))
        off = 0
        for i in order:
            o = members[i]
            o.shard, o.offset = k, off
            off += o.nbytes
        sizes.append(off)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    return names, sizes
