"""The plan: before any byte is written, what happens to every source tensor and where every output tensor goes.

``make_plan`` runs every check that can fail early (architecture, expert count against the tensor names, MoE and
dense layers against the config, shapes and orientation, dtypes), then lays out the output: one ``Job`` per source
tensor (copy its bytes, or quantize the routed-expert matrices it holds), the output tensors each job produces, and
their shard and byte offset. The pipeline executes the jobs; the writer lays down the files.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import LayoutError, SourceError
from .formats import compressed_tensors as ct
from .layouts import PROJECTIONS, Layout, config_lookup, detect_layout, load_layout, moe_layer_indices
from .scheme import resolve_compute_dtype
from .source import DTYPE_BITS, FLOAT_DTYPES, ST_DTYPES, Source, TensorInfo

_ITEMSIZE = {torch.int32: 4, torch.int64: 8, torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


@dataclass(frozen=True)
class Matrix:
    """One routed-expert projection matrix ``[rows=out, cols=in]`` to quantize, and the module it becomes."""

    layer: int
    expert: int
    proj: str  # "gate" | "up" | "down"
    module: str
    rows: int
    cols: int


@dataclass(frozen=True)
class Extract:
    """How a stacked source tensor yields its matrices: ``view`` the tensor as [E, a, b]; ``in_out`` means each
    expert's block is [in, out] and is transposed; ``order`` splits a fused gate_up block's rows into gate and up."""

    part: str  # "gate_up" | "gate" | "up" | "down"
    orientation: str  # "out_in" | "in_out"
    order: str  # "concat" | "interleaved" | "single"
    experts: int


@dataclass
class OutTensor:
    """An output tensor: name, dtype, shape; where it goes (``shard`` index, ``offset`` in that file's data area)."""

    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    nbytes: int
    shard: int = -1
    offset: int = -1


@dataclass
class Job:
    """One source tensor and what becomes of it: ``copy`` (raw bytes) or ``quantize`` (its ``matrices``, in order;
    each matrix yields three outputs: weight_packed, weight_scale, weight_shape)."""

    kind: str
    source: TensorInfo
    outputs: list[OutTensor]
    matrices: list[Matrix] = field(default_factory=list)
    extract: Extract | None = None


@dataclass
class Plan:
    """What ``convert`` will do. Produced by ``make_plan`` (also what ``expq inspect`` shows).

    Sizes are bytes; ``moe_layers``/``dense_layers``/``extra_layers`` are decoder-layer indices (extra: layers past
    ``num_hidden_layers`` that hold experts, e.g. DeepSeek's MTP layer, which are copied as they are).
    """

    source: Source
    layout: Layout
    detected_by: str
    model_type: str | None
    architecture: str | None
    compute_dtype: torch.dtype
    dtype_reason: str
    config_keys: dict[str, str]
    num_layers: int
    num_experts: int
    top_k: int | None
    hidden_size: int | None
    intermediate_size: int | None
    moe_layers: list[int]
    dense_layers: list[int]
    extra_layers: list[int]
    prefix: str
    jobs: list[Job]
    shard_names: list[str]
    shard_sizes: list[int]
    quantized_modules: list[str]
    ignore: list[str]
    targets: list[str]
    bytes_in: int
    bytes_out: int
    max_shard_size: int

    @property
    def matrices(self) -> list[Matrix]:
        return [m for j in self.jobs for m in j.matrices]

    @property
    def copied(self) -> list[TensorInfo]:
        return [j.source for j in self.jobs if j.kind == "copy"]

    @property
    def outputs(self) -> list[OutTensor]:
        return [o for j in self.jobs for o in j.outputs]

    def summary(self) -> dict:
        """A JSON-ready description (what ``expq inspect --json`` prints)."""
        mats = self.matrices
        q_src = [j.source for j in self.jobs if j.kind == "quantize"]
        return {
            "source": self.source.id,
            "revision": self.source.revision,
            "commit": self.source.commit,
            "architecture": self.architecture,
            "model_type": self.model_type,
            "layout": self.layout.name,
            "layout_file": self.layout.path,
            "layout_rule": self.layout.rule,
            "detected_by": self.detected_by,
            "config_keys": self.config_keys,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "compute_dtype_reason": self.dtype_reason,
            "num_layers": self.num_layers,
            "moe_layers": self.moe_layers,
            "dense_layers": self.dense_layers,
            "extra_expert_layers_copied": self.extra_layers,
            "routed_experts_per_layer": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.intermediate_size,
            "matrices_quantized": len(mats),
            "source_tensors_quantized": len(q_src),
            "source_tensors_copied": len(self.copied),
            "bytes_quantized_in": sum(t.nbytes for t in q_src),
            "bytes_copied": sum(t.nbytes for t in self.copied),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "output_shards": len(self.shard_names),
            "targets": self.targets,
            "side_files": self.source.side_files,
            "skipped_files": self.source.skipped_files,
        }


def parse_size(s: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units as Hugging Face uses; GiB/MiB binary). Raises ValueError."""
    if isinstance(s, int):
        if s <= 0:
            raise ValueError(f"size must be positive: {s!r}")
        return s
    t = s.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if t.endswith(u):
            num = t[: -len(u)]
            break
    else:
        num, mult = t, 1
    try:
        val = float(num)
    except ValueError:
        raise ValueError(f"not a size: {s!r} (use e.g. 5GB, 500MB, 2GiB)") from None
    if val <= 0:
        raise ValueError(f"size must be positive: {s!r}")
    return int(val * mult)


def _config_int(config: dict, keys: tuple[str, ...], what: str, used: dict[str, str], required: bool) -> int | None:
    val, where = config_lookup(config, keys)
    if val is None:
        if required:
            raise LayoutError(f"config.json has no {what} (looked for {', '.join(keys)})", file="config.json")
        return None
    used[what] = where
    if isinstance(val, list):  # e.g. per-layer sizes: not a single number
        return None
    if isinstance(val, bool) or not isinstance(val, int) or val < 0:
        raise LayoutError(f"{where} = {val!r} is not an integer", file="config.json")
    return val


def _config_dtype(config: dict) -> str | None:
    for scope in (config, config.get("text_config") or {}):
        if not isinstance(scope, dict):
            continue
        for k in ("torch_dtype", "dtype"):
            v = scope.get(k)
            if isinstance(v, str):
                return v
            if v is not None:
                raise LayoutError(f"{k} = {v!r} is not a dtype name", file="config.json")
    return None


def _check_not_quantized(source: Source) -> None:
    qc = source.config.get("quantization_config")
    if not qc:
        qc_tc = (source.config.get("text_config") or {}).get("quantization_config")
        qc = qc_tc
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise SourceError(f"the source is already quantized (quantization_config quant_method={method!r}); expq "
                          "converts bf16/fp16/fp32 checkpoints", file="config.json",
                          hint="start from the unquantized release")


def make_plan(source: Source, *, layout: Layout | str | Path | None = None, dtype: str = "auto",
              max_shard_size: str | int = "5GB") -> Plan:
    """Check the source against its layout and plan the conversion.

    Args:
        source: an opened source (``resolve_source``).
        layout: a Layout, a layout file path (``--layout FILE``), or None to detect from config.json.
        dtype: ``auto`` or an explicit compute dtype (see ``scheme.resolve_compute_dtype``).
        max_shard_size: the largest output shard, e.g. ``"5GB"`` (a single larger tensor gets a shard of its own).

    Returns:
        the Plan.

    Raises:
        LayoutError: unknown architecture; expert count, MoE layers, shapes or orientation that do not match.
        SourceError: an already-quantized source, or expert tensors that are not float.
        ValueError: a bad ``dtype`` or ``max_shard_size``.
    """
    config = source.config
    _check_not_quantized(source)
    if layout is None:
        lay, detected_by = detect_layout(config)
    elif isinstance(layout, Layout):
        lay, detected_by = layout, f"layout {layout.path}"
    else:
        lay, detected_by = load_layout(layout), f"--layout {layout}"
    used: dict[str, str] = {}
    num_layers = _config_int(config, lay.keys["num_layers"], "num_layers", used, True)
    num_experts = _config_int(config, lay.keys["num_experts"], "num_experts", used, True)
    hidden = _config_int(config, lay.keys["hidden_size"], "hidden_size", used, False)
    inter = _config_int(config, lay.keys["intermediate_size"], "intermediate_size", used, False)
    top_k = _config_int(config, lay.keys["top_k"], "top_k", used, False)
    compute_dtype, dtype_reason = resolve_compute_dtype(_config_dtype(config), dtype)
    shard_limit = parse_size(max_shard_size)

    regex = lay.expert_regex()
    found: dict[tuple[str, int], list[tuple[TensorInfo, dict]]] = defaultdict(list)
    for name, ti in source.tensors.items():
        m = regex.match(name)
        if m:
            found[(m["prefix"], int(m["layer"]))].append((ti, m.groupdict()))
    prefixes = sorted({p for p, L in found if L < num_layers})
    if len(prefixes) > 1:
        raise LayoutError(f"routed experts under more than one prefix ({', '.join(prefixes)}): the layout cannot tell "
                          "which is the decoder", file="config.json")
    prefix = prefixes[0] if prefixes else ""
    expect_moe = moe_layer_indices(lay, config, num_layers)
    got_moe = sorted(L for p, L in found if p == prefix and L < num_layers)
    extra_layers = sorted(L for p, L in found if L >= num_layers)
    if extra_layers:  # only MTP layers may sit past the decoder, and only as many as the config declares
        n_mtp, _ = config_lookup(config, ("num_nextn_predict_layers", "num_mtp_layers"))
        n_mtp = n_mtp if isinstance(n_mtp, int) and not isinstance(n_mtp, bool) else 0
        beyond = [L for L in extra_layers if L >= num_layers + n_mtp]
        if beyond:
            raise LayoutError(f"layers {beyond} hold routed experts beyond num_hidden_layers={num_layers} and the "
                              f"config declares {n_mtp} MTP layers (num_nextn_predict_layers)", file="config.json")
    if not got_moe:
        raise LayoutError(f"no routed-expert tensors matching the {lay.name} layout ({regex.pattern})",
                          file=source.shards[0].file if source.shards else None,
                          hint="wrong model_type, or pass --layout FILE")
    if got_moe != expect_moe:
        missing = sorted(set(expect_moe) - set(got_moe))
        unexpected = sorted(set(got_moe) - set(expect_moe))
        parts = []
        if missing:
            parts.append(f"config says layers {missing} are MoE but they have no routed experts")
        if unexpected:
            rules = ", ".join(lay.moe_layer_rules) or "every layer MoE"
            parts.append(f"layers {unexpected} have routed experts but the config ({rules}) says dense")
        raise LayoutError("; ".join(parts), file="config.json")
    dense_layers = [L for L in range(num_layers) if L not in got_moe]

    quant_jobs: dict[str, Job] = {}
    for L in got_moe:
        entries = found[(prefix, L)]
        if lay.rule == "per_expert":
            _plan_per_expert(lay, prefix, L, entries, num_experts, hidden, inter, quant_jobs)
        else:
            _plan_stacked(lay, prefix, L, entries, num_experts, hidden, inter, quant_jobs)
    for job in quant_jobs.values():
        if job.source.dtype not in FLOAT_DTYPES:
            raise SourceError(f"routed-expert weight is {job.source.dtype}, not bf16/fp16/fp32",
                              file=job.source.file, tensor=job.source.name)

    jobs: list[Job] = []
    st_dtype = ST_DTYPES[compute_dtype]
    for sh in source.shards:
        for ti in sh.tensors:
            job = quant_jobs.get(ti.name)
            if job is None:
                jobs.append(Job("copy", ti, [OutTensor(ti.name, ti.dtype, ti.shape, ti.nbytes)]))
                continue
            for mat in job.matrices:
                for name, dt, shape in ct.tensor_specs(mat.module, mat.rows, mat.cols, compute_dtype):
                    nbytes = math.prod(shape) * _ITEMSIZE[dt]
                    job.outputs.append(OutTensor(name, ST_DTYPES[dt] if dt != compute_dtype else st_dtype, shape,
                                                 nbytes))
            jobs.append(job)

    names = [o.name for j in jobs for o in j.outputs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise LayoutError("two output tensors would have the same name", tensor=dup)
    shard_names, shard_sizes = _assign_shards(jobs, shard_limit)

    quantized_modules = [m.module for j in jobs for m in j.matrices]
    expected = len(got_moe) * num_experts * 3
    if len(quantized_modules) != expected:
        raise LayoutError(f"{len(quantized_modules)} routed-expert matrices found, expected {expected} "
                          f"({len(got_moe)} MoE layers x {num_experts} experts x 3)", file="config.json")
    qset = set(quantized_modules)
    ignore = sorted({o.name[: -len(".weight")] for j in jobs if j.kind == "copy" for o in j.outputs
                     if o.name.endswith(".weight") and len(o.shape) == 2} - qset)
    if "lm_head" not in ignore and not any(n.startswith("lm_head.") for n in source.tensors):
        ignore.append("lm_head")  # tied embeddings: no tensor, but the module exists
    targets = [ct.targets_regex(sorted(set(lay.out_names.values())), lay.targets_container)]
    return Plan(
        source=source, layout=lay, detected_by=detected_by, model_type=config.get("model_type"),
        architecture=(config.get("architectures") or [None])[0], compute_dtype=compute_dtype,
        dtype_reason=dtype_reason, config_keys=used, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
        hidden_size=hidden, intermediate_size=inter, moe_layers=got_moe, dense_layers=dense_layers,
        extra_layers=extra_layers, prefix=prefix, jobs=jobs, shard_names=shard_names, shard_sizes=shard_sizes,
        quantized_modules=quantized_modules, ignore=sorted(ignore), targets=targets,
        bytes_in=source.total_bytes, bytes_out=sum(shard_sizes), max_shard_size=shard_limit)


def _check_shape(ti: TensorInfo, got: tuple[int, ...], want: tuple[int | None, ...], what: str) -> None:
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        shown = [("?" if w is None else w) for w in want]
        raise LayoutError(f"shape {list(got)} does not match {what} {shown} from config.json", file=ti.file,
                          tensor=ti.name)


def _plan_per_expert(lay: Layout, prefix: str, L: int, entries: list, E: int, H: int | None, I: int | None,
                     jobs: dict[str, Job]) -> None:
    by_name = {v: k for k, v in lay.proj_names.items()}
    seen: dict[int, dict[str, TensorInfo]] = defaultdict(dict)
    for ti, g in entries:
        seen[int(g["expert"])][by_name[g["proj"]]] = ti
    experts = sorted(seen)
    if experts != list(range(E)):
        extra = [e for e in experts if e >= E]
        missing = sorted(set(range(E)) - set(experts))
        detail = f"experts {missing} missing" if missing else f"experts {extra} beyond the configured {E}"
        t = seen[extra[0]] if extra else None
        raise LayoutError(f"layer {L}: {detail} (config num_experts = {E})", file=(next(iter(t.values())).file
                          if t else "config.json"))
    for e in experts:
        for p in PROJECTIONS:
            ti = seen[e].get(p)
            if ti is None:
                raise LayoutError(f"layer {L}: {lay.proj_names[p]} missing", expert=e,
                                  tensor=f"{prefix}{lay.layers}.{L}.{lay.module}.{e}.{lay.proj_names[p]}.weight")
            want = (I, H) if p != "down" else (H, I)
            _check_shape(ti, ti.shape, want, "[intermediate, hidden]" if p != "down" else "[hidden, intermediate]")
            rows, cols = ti.shape
            mat = Matrix(L, e, p, lay.out_module_name(prefix, L, e, p), rows, cols)
            jobs[ti.name] = Job("quantize", ti, [], [mat])
        # shapes of gate and up must agree, and down must be their transpose
        g, u, d = (seen[e][p].shape for p in PROJECTIONS)
        if g != u or d != (g[1], g[0]):
            raise LayoutError(f"layer {L}: gate {list(g)}, up {list(u)} and down {list(d)} do not fit together",
                              expert=e, tensor=seen[e]["down"].name)


def _orientation(st, ti: TensorInfo, block: tuple[int, int], out_dim: int | None, in_dim: int | None) -> str:
    """Pick the orientation of a stacked tensor's per-expert block [a, b]: the layout's, or where it admits two,
    the one the config sizes fit (error when both or neither fit)."""
    if len(st.orientations) == 1:
        return st.orientations[0]
    fits = []
    for o in st.orientations:
        rows, cols = block if o == "out_in" else (block[1], block[0])
        if (out_dim is None or rows == out_dim) and (in_dim is None or cols == in_dim):
            fits.append(o)
    if len(fits) != 1:
        why = "fits both orientations" if fits else "fits neither orientation"
        raise LayoutError(f"per-expert block {list(block)} {why} the layout admits ({', '.join(st.orientations)}) "
                          f"given config sizes out={out_dim}, in={in_dim}: orientation is not decidable",
                          file=ti.file, tensor=ti.name)
    return fits[0]


def _plan_stacked(lay: Layout, prefix: str, L: int, entries: list, E: int, H: int | None, I: int | None,
                  jobs: dict[str, Job]) -> None:
    by_tensor = {g["tensor"]: ti for ti, g in entries}
    layer_mats: list[Matrix] = []
    for part, st in lay.stacked.items():
        ti = by_tensor.get(st.name)
        if ti is None:
            raise LayoutError(f"layer {L}: stacked expert tensor {st.name} missing",
                              tensor=f"{prefix}{lay.layers}.{L}.{lay.module}.{st.name}")
        if st.flat:
            if len(ti.shape) != 2 or ti.shape[0] % E:
                raise LayoutError(f"expected [{E}*rows, cols] (flat stacked experts), got {list(ti.shape)}",
                                  file=ti.file, tensor=ti.name)
            block = (ti.shape[0] // E, ti.shape[1])
        else:
            if len(ti.shape) != 3 or ti.shape[0] != E:
                raise LayoutError(f"expected [{E}, rows, cols] (stacked experts, config num_experts = {E}), "
                                  f"got {list(ti.shape)}", file=ti.file, tensor=ti.name)
            block = (ti.shape[1], ti.shape[2])
        fused = part == "gate_up"
        out_dim = (2 * I if I is not None else None) if fused else (H if part == "down" else I)
        in_dim = I if part == "down" else H
        orient = _orientation(st, ti, block, out_dim, in_dim)
        rows, cols = block if orient == "out_in" else (block[1], block[0])
        _check_shape(ti, (rows, cols), (out_dim, in_dim), f"{part} [out, in]")
        if fused and rows % 2:
            raise LayoutError(f"fused gate_up block has an odd number of rows ({rows})", file=ti.file, tensor=ti.name)
        mats = []
        for e in range(E):
            if fused:
                for p in ("gate", "up"):
                    mats.append(Matrix(L, e, p, lay.out_module_name(prefix, L, e, p), rows // 2, cols))
            else:
                mats.append(Matrix(L, e, part, lay.out_module_name(prefix, L, e, part), rows, cols))
        jobs[ti.name] = Job("quantize", ti, [], mats, Extract(part, orient, st.order if fused else "single", E))
        layer_mats += mats
    # gate/up and down must fit together
    g = next(m for m in layer_mats if m.proj == "gate")
    d = next(m for m in layer_mats if m.proj == "down")
    if (d.rows, d.cols) != (g.cols, g.rows):
        raise LayoutError(f"layer {L}: gate [{g.rows}, {g.cols}] and down [{d.rows}, {d.cols}] do not fit together",
                          tensor=f"{prefix}{lay.layers}.{L}.{lay.module}")


def _assign_shards(jobs: list[Job], limit: int) -> tuple[list[str], list[int]]:
    """Cut the outputs into shards of at most ``limit`` bytes, in production order, keeping each module's tensors
    together; within a shard, lay tensors out by descending itemsize (so every tensor is aligned), then production
    order. Sets ``shard`` and ``offset`` on every OutTensor. Returns (file names, data sizes)."""
    groups: list[list[OutTensor]] = []
    for j in jobs:
        if j.kind == "copy":
            groups.append(list(j.outputs))
        else:
            for i in range(0, len(j.outputs), 3):
                groups.append(j.outputs[i:i + 3])
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for grp in groups:
        n = sum(o.nbytes for o in grp)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].extend(grp)
        size += n
    sizes = []
    for k, members in enumerate(shards):
        order = sorted(range(len(members)), key=lambda i: (-_align(members[i].dtype), i))
        off = 0
        for i in order:
            o = members[i]
            o.shard, o.offset = k, off
            off += o.nbytes
        sizes.append(off)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    return names, sizes


def _align(st_dtype: str) -> int:
    return max(1, DTYPE_BITS[st_dtype] // 8)
