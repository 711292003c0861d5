"""A source published in the compressed-tensors format (llm-compressor, Red Hat / Neural Magic releases, Kimi-K2's
INT4 releases): quantized modules are decompressed back to the compute dtype by the compressed-tensors library.

Handled formats, per module ``M`` (the tensors the library's compressors write):

* ``pack-quantized``: ``M.weight_packed`` I32 ``[out, ceil(in*bits/32)]`` + ``M.weight_scale`` + ``M.weight_shape``
  (I64/I32 ``[2]``), with ``M.weight_zero_point`` (asymmetric) and ``M.weight_g_idx`` where present; INT1-INT8 with
  tensor, channel or group scales (e.g. Kimi-K2-Thinking: INT4, group 32, routed experts only);
* ``float-quantized`` / ``naive-quantized`` / ``int-quantized``: ``M.weight`` stored as F8_E4M3 (or I8) +
  ``M.weight_scale`` (tensor, channel, group or block scales), e.g. the FP8-dynamic releases.

Every other tensor (modules the config ignores, norms, embeddings, routers) is its own logical tensor, stored as is.

Decisions:

* **Never quantize twice.** A source whose routed experts (the expert map's answer) are stored as 8-bit int per
  channel (what expq itself writes, or any W8A16/W8A8 int8 channel checkpoint) is refused: their codes are another
  quantizer's, and expq's would be a second rounding on top. Other int8 groups (per-group scales, or int8 channel
  on attention only) are decoded.
* **Activation quantization is dropped.** Only weights are decoded; the output is weight-only (W8A16, the model's
  activations in the compute dtype). Dynamic activation schemes store nothing; static ones store ``M.input_scale``
  (etc.), which become parts of ``M.weight``'s logical tensor and are read by nobody.
* **Not decoded (refused, naming config.json):** KV-cache quantization (``kv_cache_scheme``, ``k_scale``/``v_scale``),
  sparsity and transform (rotation) configs, expert sparsity (``moe_sparsity_config``), other formats (NVFP4,
  MXFP4...), activation-ordered groups (a ``weight_g_idx`` that is not the identity ordering).
* **Shapes.** ``weight_shape``'s values are not in the safetensors header, so the logical shape comes from the
  header: ``out`` is ``weight_packed``'s rows; ``in`` is ``group_size x`` the scale's groups for group scales, else
  the widest ``in`` that fits ``weight_packed``'s words; ``decode`` checks ``weight_shape`` equals it.
* **Dtype.** The logical dtype is the config's ``torch_dtype``/``dtype`` (else the scale's dtype). The library
  dequantizes in the scale's dtype; the result is cast to the logical dtype, as its own model-free dequantizer does.

Library functions used (compressed-tensors >= 0.20): ``QuantizationConfig.model_validate`` (the config's schema),
``compressors.format.infer_module_format`` (a group's format when the config leaves it implicit),
``BaseCompressor.get_value_from_registry(format)`` and that compressor's classmethod ``decompress(state_dict,
scheme)`` (per module: ``PackedQuantizationCompressor`` unpacks with ``unpack_from_int32`` and ``dequantize``s;
``NaiveQuantizationCompressor`` and its float/int aliases ``dequantize``), on the CPU.
"""

from __future__ import annotations

import inspect
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import parallel
from ..errors import SourceError
from ..io import buffers
from ..io.safetensors import TORCH_DTYPES, TensorInfo
from .base import LogicalTensor, ReadFn, narrow_stored, source_quantization_config

if TYPE_CHECKING:
    from ..experts import ExpertMap

NAME = "compressed-tensors"
PACKED = "pack-quantized"
UNPACKED = ("float-quantized", "naive-quantized", "int-quantized")  # one decompression (the naive compressor's)
SUPPORTED = (PACKED, *UNPACKED)
WEIGHT_QPARAMS = ("weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
ACT_QPARAMS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
               "output_global_scale")
OTHER_QPARAMS = ("weight_global_scale",)  # NVFP4 and friends: formats not decoded here
KV_SCALES = ("k_scale", "v_scale", "q_scale")
PART_ORDER = ("weight_packed", "weight", *WEIGHT_QPARAMS, *ACT_QPARAMS)
SCALE_DTYPES = ("BF16", "F16", "F32")
SHAPE_DTYPES = ("I64", "I32")
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
CLASS_NAME = re.compile(r"[A-Z]\w*")  # a target naming a module class (Linear), not a module


@dataclass(frozen=True)
class _Group:
    """One config group: its name, scheme (compressed-tensors' QuantizationScheme) and resolved format."""

    name: str
    scheme: Any
    format: str

    @property
    def weights(self) -> Any:
        return self.scheme.weights


def _hint_original() -> str:
    return "convert the original bf16/fp16 release instead"


class CompressedTensorsDecoder:
    """Decodes a compressed-tensors checkpoint's quantized modules with the compressed-tensors library."""

    name: ClassVar[str] = NAME

    def __init__(self, qc: Any, compute_dtype: str | None):
        self.qc = qc  # compressed-tensors' QuantizationConfig, validated
        self.compute_dtype = compute_dtype
        self.groups = [_Group(n, s, _group_format(qc, s)) for n, s in qc.config_groups.items()
                       if s.weights is not None]
        self.ignore = list(qc.ignore or [])
        self.int8_channel: list[LogicalTensor] = []  # quantized weights stored 8-bit int per channel (check_experts)
        self._group_cache: dict[str, _Group | None] = {}

    # --- detection -----------------------------------------------------------------------------------------------
    @classmethod
    def detect(cls, config: dict, tensors: dict[str, TensorInfo]) -> "CompressedTensorsDecoder | None":
        """This decoder if the config's ``quantization_config`` (or legacy ``compression_config``) says
        ``quant_method: compressed-tensors``; the stored tensors are checked against it at once.

        Raises:
            SourceError: a config the installed compressed-tensors does not validate, a feature not decoded here,
                or stored tensors that do not fit the config (routed experts already int8 per channel are refused
                by ``check_experts``, once the plan knows which they are).
        """
        raw = source_quantization_config(config)
        if raw is None and isinstance(config.get("compression_config"), dict):
            raw = config["compression_config"]
        if not isinstance(raw, dict) or raw.get("quant_method") != NAME:
            return None
        qc = _validate(raw)
        _check_features(qc, raw)
        dec = cls(qc, _config_compute_dtype(config))
        for g in dec.groups:
            if g.format not in SUPPORTED:
                raise SourceError(f"quantization_config group {g.name!r} uses format {g.format!r}; expq decodes "
                                  f"compressed-tensors {', '.join(SUPPORTED)}", file="config.json",
                                  hint=_hint_original())
        modules = dec._modules(tensors)
        if not modules:
            raise SourceError("quantization_config says compressed-tensors, but no stored tensor is a quantized "
                              "weight (weight_packed, or an F8_E4M3/I8 weight with its weight_scale)",
                              file="config.json")
        dec.int8_channel = [lt for lt in modules.values()
                            if _is_int8_channel(dec._group_of(lt.name.removesuffix(".weight")).weights)]
        return dec

    def check_experts(self, experts: ExpertMap) -> None:
        """Refuse a source whose routed experts (the expert map's answer, from the layout in use) are stored
        quantized by a group of 8-bit int channel weights.

        Raises:
            SourceError: names the first such tensor and its config group.
        """
        for lt in self.int8_channel:
            if lt.name in experts.tensors:
                module = lt.name.removesuffix(".weight")
                g = self._group_of(module)
                raise SourceError(
                    "the source is already quantized: its routed experts are already int8 per channel "
                    f"(compressed-tensors group {g.name!r}: {g.format}, 8-bit int, strategy channel, e.g. {module}): "
                    "expq never quantizes twice", file="config.json", tensor=lt.stored.name, hint=_hint_original())

    # --- module matching -------------------------------------------------------------------------------------------
    def _group_of(self, module: str) -> _Group | None:
        """The config group that quantizes ``module``, or None when no group targets it or ``ignore`` names it.

        Targets and ignore entries are matched by name as compressed-tensors does (``re:`` + ``re.match``, or the
        exact name); a class-name target (``Linear``) cannot be checked from the headers and matches any module: the
        stored tensors decide whether the module is quantized. The most specific target wins (exact, then ``re:``,
        then class), ties in config order.
        """
        if module in self._group_cache:
            return self._group_cache[module]
        from compressed_tensors.utils.match import match_name

        if any(match_name(module, ign) for ign in self.ignore):
            self._group_cache[module] = None
            return None
        best: tuple[int, _Group] | None = None
        for g in self.groups:
            for t in g.scheme.targets:
                if t.startswith("re:"):
                    rank = 1 if match_name(module, t) else None
                elif t == module:
                    rank = 0
                else:
                    rank = 2 if CLASS_NAME.fullmatch(t) else None  # a class name (Linear...), else another module
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, g)
        self._group_cache[module] = best[1] if best else None
        return self._group_cache[module]

    # --- the module table --------------------------------------------------------------------------------------------
    def _modules(self, tensors: dict[str, TensorInfo]) -> dict[str, LogicalTensor]:
        """Quantized modules' logical weights: main-part name -> LogicalTensor. Every structural check is here."""
        params: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
        for name, ti in tensors.items():
            module, _, param = name.rpartition(".")
            if param in KV_SCALES:
                raise SourceError("KV-cache quantization scales are not decoded by expq", file=ti.file, tensor=name,
                                  hint=_hint_original())
            if param in ("weight", "weight_packed", *WEIGHT_QPARAMS, *ACT_QPARAMS, *OTHER_QPARAMS):
                params[module][param] = ti
        out: dict[str, LogicalTensor] = {}
        for module, p in params.items():
            qparams = [k for k in p if k not in ("weight", "weight_packed")]
            if "weight_packed" not in p and not qparams:
                continue  # a plain module
            lt = self._module_tensor(module, p, qparams)
            out[lt.stored.name] = lt
        return out

    def _module_tensor(self, module: str, p: dict[str, TensorInfo], qparams: list[str]) -> LogicalTensor:
        main = p.get("weight_packed") or p.get("weight")
        if main is None:
            first = p[qparams[0]]
            raise SourceError(f"{qparams[0]} without its weight (no {module}.weight_packed or {module}.weight)",
                              file=first.file, tensor=first.name)
        g = self._group_of(module)
        if g is None:
            raise SourceError("stored quantized, but quantization_config's targets and ignore leave this module "
                              "unquantized", file=main.file, tensor=main.name)
        for k in OTHER_QPARAMS:
            if k in p:
                raise SourceError(f"{k} belongs to a format expq does not decode (group {g.name!r} says "
                                  f"{g.format})", file=p[k].file, tensor=p[k].name)
        if "weight_packed" in p:
            if g.format != PACKED:
                raise SourceError(f"stored as pack-quantized (weight_packed), but quantization_config group "
                                  f"{g.name!r} says {g.format}", file=main.file, tensor=main.name)
            shape = _packed_shape(module, p, g.weights)
        else:
            if g.format not in UNPACKED:
                raise SourceError(f"a quantized weight stored unpacked, but quantization_config group {g.name!r} "
                                  f"says {g.format}", file=main.file, tensor=main.name)
            shape = _unpacked_shape(module, p, g.weights)
        scale = p["weight_scale"]
        dtype = self.compute_dtype or scale.dtype
        parts = tuple(p[k] for k in PART_ORDER if k in p)
        return LogicalTensor(f"{module}.weight", dtype, shape, parts, decoded=True, how=_how(g, dtype))

    # --- the Decoder protocol -----------------------------------------------------------------------------------------
    def logical_tensors(self, tensors: dict[str, TensorInfo]) -> dict[str, LogicalTensor]:
        """Each quantized module ``M`` becomes ``M.weight`` (decoded, parts = its stored tensors, main first); every
        other stored tensor is its own logical tensor, stored as is. In the stored order of each main part.

        Raises:
            SourceError: a packed weight without its scale or shape, a scale without its weight, a module stored
                quantized that the config does not quantize, dtypes or shapes that do not fit the config.
        """
        modules = self._modules(tensors)
        taken = {p.name for lt in modules.values() for p in lt.parts}
        out: dict[str, LogicalTensor] = {}
        for name, ti in tensors.items():
            if name in modules:
                lt = modules[name]
                if lt.name != name and lt.name in tensors:
                    raise SourceError(f"both {lt.name} and {name} are stored", file=ti.file, tensor=name)
                out[lt.name] = lt
            elif name not in taken:
                out[name] = LogicalTensor(name, ti.dtype, ti.shape, (ti,))
        return out

    def row_absmax(self, tensor: LogicalTensor, read: ReadFn, dim: int = -1) -> torch.Tensor | None:
        """Not offered (None): the caller decodes. See ``Decoder.row_absmax``."""
        return None

    def narrow(self, tensor: LogicalTensor, start: int, stop: int) -> LogicalTensor | None:
        """A tensor stored as it is: ``narrow_stored``. A quantized module's weight: None (taken whole). Such a
        weight is a linear layer's 2-D ``M.weight`` ``[out, in]`` (its ``weight_shape`` holds exactly that), never
        a stacked ``[E, ...]`` expert tensor, so no conversion slices it. See ``Decoder.narrow``."""
        return None if tensor.decoded else narrow_stored(tensor, start, stop)

    def decode(self, tensor: LogicalTensor, read: ReadFn, device: torch.device | None = None) -> torch.Tensor:
        """Decompress one module's weight with its compressor's ``decompress`` (see the module docstring), by bands
        of rows over the conversion's thread pool (``_row_bands``: every row decompresses on its own, so the bands
        give the same values as one call). Always on the CPU (``device`` is not used: the library's ops are not
        checked on a GPU); the pipeline moves the result.

        Raises:
            SourceError: ``weight_shape`` disagrees with the header, a permuted ``weight_g_idx``, or the library
                fails on the stored values (names file and tensor).
        """
        from compressed_tensors.compressors import BaseCompressor

        module = tensor.name.removesuffix(".weight")
        g = self._group_of(module)
        if g is None or not tensor.decoded:
            raise SourceError("internal: not a quantized module of this source", file=tensor.file, tensor=tensor.name)
        compressor = BaseCompressor.get_value_from_registry(g.format)
        parts = {ti.name.rpartition(".")[2]: ti for ti in tensor.parts}
        # the parameters the compressor decompresses from, as the library's own model-free dequantizer gathers
        # them: activation qparams (dropped) and a symmetric scheme's zero point are not passed
        names = [*compressor.compression_param_names(g.scheme), "weight_g_idx"]
        state = {k: read(parts[k]) for k in names if k in parts}
        if "weight_shape" in state:
            got = tuple(int(x) for x in state["weight_shape"].reshape(-1).tolist())
            if got != tensor.shape:
                ti = parts["weight_shape"]
                raise SourceError(f"weight_shape says {list(got)} but the stored tensors give {list(tensor.shape)}"
                                  " (expq reads in_features from the header: a width that is not a multiple of "
                                  "32/num_bits is not supported)", file=ti.file, tensor=ti.name)
        g_idx = state.pop("weight_g_idx", None)
        if g_idx is not None:
            gs = g.weights.group_size if g.weights.group_size and g.weights.group_size > 0 else tensor.shape[1]
            if not torch.equal(g_idx.reshape(-1).long(), torch.arange(tensor.shape[1]) // gs):
                ti = parts["weight_g_idx"]
                raise SourceError("activation-ordered groups (a permuted weight_g_idx) are not decoded: compressed-"
                                  "tensors >= 0.20 no longer supports them", file=ti.file, tensor=ti.name)
        dtype = TORCH_DTYPES[tensor.dtype]
        bands = _row_bands(state, tensor.shape)
        if len(bands) == 1:
            return self._decompress(compressor, state, g, tensor).to(dtype).contiguous()
        out = buffers.empty(tensor.shape, dtype)  # a conversion's pool, if any

        def band(b: tuple[int, int, dict]) -> None:
            r0, r1, cut = b
            out[r0:r1] = self._decompress(compressor, cut, g, tensor, (r1 - r0, tensor.shape[1]))

        parallel.each(band, [(r0, r1, _band_state(state, tensor.shape, r0, r1)) for r0, r1 in bands])
        return out

    @staticmethod
    def _decompress(compressor: Any, state: dict, g: _Group, tensor: LogicalTensor,
                    shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The library's ``decompress`` of ``state``: the weight of ``shape`` (default the whole tensor's)."""
        shape = tensor.shape if shape is None else shape
        try:
            with torch.no_grad():
                w = compressor.decompress(state, g.scheme)["weight"]
        except (ValueError, RuntimeError, TypeError, KeyError, IndexError, AssertionError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SourceError(f"compressed-tensors could not decompress it: {msg}", file=tensor.file,
                              tensor=tensor.stored.name) from None
        if tuple(w.shape) != tuple(shape):
            raise SourceError(f"decompressed to {list(w.shape)}, expected {list(shape)}", file=tensor.file,
                              tensor=tensor.stored.name)
        return w


BAND_ELEMS = 1 << 20
"""Weight elements per band of rows decompressed at a time (about a core's cache of work per pool item)."""


def _row_bands(state: dict[str, torch.Tensor], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Bands ``(r0, r1)`` of about ``BAND_ELEMS`` elements that the state can be cut into: every state tensor is
    per row (first dimension = rows), whole-tensor (one row, or none), or per ``k`` rows (first dimension
    ``ceil(rows / k)``: packed zero points, block scales), and bands start at multiples of every such ``k``. One band
    (the whole tensor) when a tensor fits none of these."""
    rows, cols = shape
    unit = 1
    for k, t in state.items():
        if k == "weight_shape" or t.dim() == 0 or t.shape[0] in (rows, 1):
            continue
        per = math.ceil(rows / t.shape[0])
        if math.ceil(rows / per) != t.shape[0]:
            return [(0, rows)]
        unit = math.lcm(unit, per)
    # at least two rows of every per-k tensor in a band: the library's unpacking cannot view a one-row slice of
    # packed zero points (a transposed [1, n] tensor keeps a stride of n)
    band = max(2 * unit if unit > 1 else 1, BAND_ELEMS // max(1, cols) // unit * unit)
    bands = [(r0, min(rows, r0 + band)) for r0 in range(0, rows, band)]
    if len(bands) > 1 and unit > 1 and bands[-1][1] - bands[-1][0] <= unit:
        bands[-2:] = [(bands[-2][0], rows)]
    return bands


def _band_state(state: dict[str, torch.Tensor], shape: tuple[int, ...], r0: int, r1: int) -> dict[str, torch.Tensor]:
    """The state of rows ``r0:r1`` (see ``_row_bands``): per-row tensors sliced, per-``k``-rows tensors sliced by
    ``k``, whole-tensor ones kept, ``weight_shape`` rewritten."""
    rows, cols = shape
    cut = {}
    for k, t in state.items():
        if k == "weight_shape":
            cut[k] = torch.tensor([r1 - r0, cols], dtype=t.dtype).reshape(t.shape)
        elif t.dim() == 0 or t.shape[0] == 1 and rows != 1:
            cut[k] = t
        elif t.shape[0] == rows:
            cut[k] = t[r0:r1]
        else:
            per = math.ceil(rows / t.shape[0])
            cut[k] = t[r0 // per: math.ceil(r1 / per)]
    return cut


# --- config -----------------------------------------------------------------------------------------------------------
def _validate(raw: dict) -> Any:
    """The config as compressed-tensors' own ``QuantizationConfig``; one-line SourceError if it does not validate."""
    try:
        import compressed_tensors
        import pydantic
        from compressed_tensors.quantization import QuantizationConfig
        from compressed_tensors.compressors import BaseCompressor
    except ImportError:
        raise SourceError("a compressed-tensors source needs the compressed-tensors library (pip install "
                          "compressed-tensors)", file="config.json") from None
    version = getattr(compressed_tensors, "__version__", "?")
    if not isinstance(inspect.getattr_static(BaseCompressor, "decompress", None), classmethod):
        raise SourceError(f"compressed-tensors {version} is too old to decode this source: expq needs >= 0.20",
                          file="config.json")
    try:
        return QuantizationConfig.model_validate(raw)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise SourceError(f"quantization_config does not validate as compressed-tensors {version} "
                          f"({e.error_count()} error(s); first: {where}: {err.get('msg')})", file="config.json",
                          hint=_hint_original()) from None
    except (ValueError, TypeError, NotImplementedError, KeyError) as e:
        raise SourceError(f"quantization_config does not validate as compressed-tensors {version} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file="config.json",
                          hint=_hint_original()) from None


def _check_features(qc: Any, raw: dict) -> None:
    """Refuse what this decoder does not decode (see the module docstring), naming config.json."""
    sparsity = raw.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise SourceError(f"sparsity_config format {sparsity.get('format')!r} is not decoded by expq",
                          file="config.json", hint=_hint_original())
    transform = raw.get("transform_config")
    if transform and (not isinstance(transform, dict) or transform.get("config_groups")):
        raise SourceError("transform_config (rotated weights) is not decoded by expq", file="config.json",
                          hint=_hint_original())
    if raw.get("moe_sparsity_config"):
        raise SourceError("moe_sparsity_config (pruned or replaced experts) is not decoded by expq",
                          file="config.json", hint=_hint_original())
    if qc.kv_cache_scheme is not None:
        raise SourceError("kv_cache_scheme: KV-cache quantization is not decoded by expq", file="config.json",
                          hint=_hint_original())


def _group_format(qc: Any, scheme: Any) -> str:
    """A group's format: its own, else the config's (unless mixed/dense), else what compressed-tensors infers."""
    if scheme.format:
        return str(getattr(scheme.format, "value", scheme.format))
    if qc.format and qc.format not in ("mixed-precision", "dense", "fakequant"):
        return str(qc.format)
    from compressed_tensors.compressors.format import infer_module_format

    return infer_module_format(torch.nn.Linear, scheme).value


def _config_compute_dtype(config: dict) -> str | None:
    for scope in (config, config.get("text_config") or {}):
        if isinstance(scope, dict):
            for k in ("torch_dtype", "dtype"):
                v = scope.get(k)
                if isinstance(v, str) and v in CONFIG_DTYPES:
                    return CONFIG_DTYPES[v]
    return None


def _is_int8_channel(w: Any) -> bool:
    """Whether a group's weights are 8-bit int with one scale per output channel (what expq itself writes)."""
    return w.type == "int" and w.num_bits == 8 and w.strategy == "channel"


# --- shapes -----------------------------------------------------------------------------------------------------------
def _need(module: str, p: dict[str, TensorInfo], key: str, main: TensorInfo, dtypes: tuple[str, ...]) -> TensorInfo:
    ti = p.get(key)
    if ti is None:
        raise SourceError(f"no {module}.{key} for this quantized weight", file=main.file, tensor=main.name)
    if ti.dtype not in dtypes:
        raise SourceError(f"{key} is {ti.dtype}, expected {' or '.join(dtypes)}", file=ti.file, tensor=ti.name)
    return ti


def _check_scale(module: str, p: dict[str, TensorInfo], w: Any, out: int, cols: int | None) -> TensorInfo:
    """Check weight_scale's shape against the strategy (``cols``: in_features where known). Returns the scale."""
    main = p.get("weight_packed") or p["weight"]
    scale = _need(module, p, "weight_scale", main, SCALE_DTYPES)
    s = scale.shape
    if w.strategy == "tensor":
        ok = math.prod(s) == 1
        want = "one value"
    elif w.strategy == "channel":
        ok = s == (out, 1)
        want = f"[{out}, 1]"
    elif w.strategy == "group":
        gs = w.group_size
        if cols is not None and cols % gs:
            raise SourceError(f"in_features {cols} is not a multiple of group_size {gs}", file=main.file,
                              tensor=main.name)
        ok = len(s) == 2 and s[0] == out and (cols is None or s[1] == cols // gs)
        want = f"[{out}, {cols // gs if cols is not None else 'in/' + str(gs)}] for group_size {gs}"
    elif w.strategy == "block":
        b0, b1 = w.block_structure
        want_s = (math.ceil(out / b0), math.ceil(cols / b1)) if cols is not None else None
        ok = s == want_s
        want = f"{list(want_s) if want_s else '?'} for blocks {b0}x{b1}"
    else:
        raise SourceError(f"weight strategy {w.strategy!r} is not decoded by expq", file="config.json",
                          tensor=main.name)
    if not ok:
        raise SourceError(f"weight_scale {list(s)} does not fit the weight (expected {want})", file=scale.file,
                          tensor=scale.name)
    zp = p.get("weight_zero_point")
    if not w.symmetric and zp is None:
        raise SourceError(f"asymmetric weights need {module}.weight_zero_point", file=main.file, tensor=main.name)
    return scale


def _packed_shape(module: str, p: dict[str, TensorInfo], w: Any) -> tuple[int, int]:
    main = p["weight_packed"]
    if main.dtype != "I32" or len(main.shape) != 2:
        raise SourceError(f"weight_packed must be I32 2-D, got {main.dtype}{list(main.shape)}", file=main.file,
                          tensor=main.name)
    if w.type != "int" or not 1 <= w.num_bits <= 8:
        raise SourceError(f"pack-quantized needs 1-8 bit int weights, the config says {w.num_bits}-bit {w.type}",
                          file="config.json", tensor=main.name)
    out, words = main.shape
    bits = w.num_bits
    shape_ti = _need(module, p, "weight_shape", main, SHAPE_DTYPES)
    if shape_ti.shape != (2,):
        raise SourceError(f"weight_shape must hold 2 values, has shape {list(shape_ti.shape)}", file=shape_ti.file,
                          tensor=shape_ti.name)
    if w.strategy == "group":
        scale = _need(module, p, "weight_scale", main, SCALE_DTYPES)
        if len(scale.shape) != 2:
            raise SourceError(f"weight_scale {list(scale.shape)} must be 2-D for group scales", file=scale.file,
                              tensor=scale.name)
        cols = scale.shape[1] * w.group_size
        if math.ceil(cols * bits / 32) != words:
            raise SourceError(f"weight_scale has {scale.shape[1]} groups of {w.group_size} = {cols} columns, but "
                              f"weight_packed holds {words} words of {bits}-bit codes per row", file=scale.file,
                              tensor=scale.name)
    elif w.strategy in ("channel", "tensor"):
        cols = words * 32 // bits
    else:
        raise SourceError(f"pack-quantized weight strategy {w.strategy!r} is not decoded by expq",
                          file="config.json", tensor=main.name)
    _check_scale(module, p, w, out, cols)
    zp = p.get("weight_zero_point")
    if zp is not None and not w.symmetric:
        scale = p["weight_scale"]
        want = (math.ceil(out * bits / 32), scale.shape[1]) if len(scale.shape) == 2 else None
        if zp.dtype != "I32" or zp.shape != want:
            raise SourceError(f"weight_zero_point {zp.dtype}{list(zp.shape)} does not fit (expected I32"
                              f"{list(want) if want else '?'}, packed along rows)", file=zp.file, tensor=zp.name)
    g_idx = p.get("weight_g_idx")
    if g_idx is not None and (g_idx.dtype not in SHAPE_DTYPES or g_idx.shape != (cols,)):
        raise SourceError(f"weight_g_idx {g_idx.dtype}{list(g_idx.shape)} does not fit {cols} columns",
                          file=g_idx.file, tensor=g_idx.name)
    return out, cols


def _unpacked_shape(module: str, p: dict[str, TensorInfo], w: Any) -> tuple[int, int]:
    main = p["weight"]
    want = "F8_E4M3" if w.type == "float" and w.num_bits == 8 else "I8" if w.type == "int" and w.num_bits <= 8 \
        else None
    if want is None:
        raise SourceError(f"{w.num_bits}-bit {w.type} weights stored unpacked are not decoded by expq",
                          file="config.json", tensor=main.name)
    if main.dtype != want:
        raise SourceError(f"weight is {main.dtype}, but quantization_config stores {w.num_bits}-bit {w.type} "
                          f"weights as {want}", file=main.file, tensor=main.name)
    if len(main.shape) != 2:
        raise SourceError(f"quantized weight must be 2-D, has shape {list(main.shape)}", file=main.file,
                          tensor=main.name)
    out, cols = main.shape
    _check_scale(module, p, w, out, cols)
    zp = p.get("weight_zero_point")
    if zp is not None and not w.symmetric and zp.shape != p["weight_scale"].shape:
        raise SourceError(f"weight_zero_point {list(zp.shape)} does not match weight_scale "
                          f"{list(p['weight_scale'].shape)}", file=zp.file, tensor=zp.name)
    return out, cols


def _how(g: _Group, dtype: str) -> str:
    w = g.weights
    kind = "fp8 e4m3" if w.type == "float" else f"int{w.num_bits}"
    strat = {"group": f"group {w.group_size}", "block": "block {}x{}".format(*(w.block_structure or (0, 0)))}.get(
        w.strategy, w.strategy)
    asym = "" if w.symmetric else " asymmetric"
    acts = " (activation quantization dropped)" if g.scheme.input_activations is not None else ""
    return f"compressed-tensors {g.format} {kind} {strat}{asym} -> {dtype.lower()}{acts}"
