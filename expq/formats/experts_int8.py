"""The ``experts-int8`` format: the routed experts exactly as vLLM's experts_int8 holds them after loading.

vLLM's seed (``ExpertsInt8MoEMethod`` with ``quantize_in_place_and_get_scales``) ends up with, per MoE layer,
``w13_weight`` int8 [E, 2I, H] (gate rows, then up rows), ``w2_weight`` int8 [E, H, I], ``w13_scale`` fp32 [E, 2I]
and ``w2_scale`` fp32 [E, H]. This format stores those values per routed-expert projection module ``M`` (the same
module names as the compressed-tensors output, e.g. ``model.layers.3.mlp.experts.7.gate_proj``):

* ``M.weight_int8`` I8 ``[out, in]``: the codes (gate and up are w13's rows ``[0, I)`` and ``[I, 2I)`` of expert e,
  down is w2 of expert e);
* ``M.weight_scale`` F32 ``[out]``: the per-row scales (values of the compute dtype, held in fp32 as the seed does;
  w2's are full-row maxima, what vLLM >= 0.28 computes at any tensor-parallel size).

so ``w13_weight[e] = cat(gate.weight_int8, up.weight_int8)`` and so on: a concatenation, no arithmetic. Nothing is
packed. The expert tensors' names are not the dense ones on purpose: stock clients cannot mistake int8 codes for
weights. One zero-element I8 tensor per MoE layer, the **marker**, sits at the name stock transformers loads that
layer's fused experts weight from (the layout's ``[runtime]`` module and weight, e.g.
``model.layers.3.mlp.experts.gate_up_proj``), so that stock transformers, which skips an unknown
``quant_method`` with a warning, stops with a size-mismatch error instead of building random experts. With
``import expq`` transformers uses expq's quantizer (``expq.engines.transformers``); vLLM serves it through expq's
plugin (``expq.engines.vllm``); without them both refuse the checkpoint.

The ``quantization_config`` names expq's own method, ``expq_experts_int8``, never vLLM's ``experts_int8``: vLLM
ignores the configuration of that method, quantizes whatever the weight tensors hold again (here: int8 codes, with
scale 1.0) and drops the stored scales, silently for some models.
"""

from __future__ import annotations

import re
from typing import ClassVar, Mapping, Sequence

import torch

from ..engines.clients import Client, expq_clients
from ..experts import ExpertMap, Matrix, TensorLike
from ..layouts import Layout
from ..version import __version__
from .base import ReadByName, TensorRole, TensorSpec
from .stock_model import stock_parameter_sizes

QUANT_METHOD = "expq_experts_int8"
CODES, SCALE = "weight_int8", "weight_scale"
WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "scale_dtype": "float32",
           "scheme": "experts_int8: scale = amax(|w|, dim=1) / 127 in the compute dtype; "
                     "q = clamp(round(w / scale), -127, 127), round half to even"}


class ExpertsInt8Format:
    """int8 codes and fp32 per-row scales, per routed-expert projection, unpacked.

    Args:
        experts: the model's expert map. compute_dtype: the dtype the scales were computed in (they are stored as
            fp32 whatever it is).
    """

    name: ClassVar[str] = "experts-int8"
    quant_method: ClassVar[str] = QUANT_METHOD
    expq_loads: ClassVar[bool] = True  # stock transformers: unknown quant_method, then the markers' size mismatch
    suffixes: ClassVar[Mapping[str, str]] = {"codes": CODES, "scale": SCALE}

    def __init__(self, experts: ExpertMap, compute_dtype: torch.dtype):
        self.experts = experts
        self.compute_dtype = compute_dtype

    # --- writing --------------------------------------------------------------------------------------------------
    def tensor_specs(self, matrix: Matrix) -> list[TensorSpec]:
        """``weight_int8`` I8 [out, in], ``weight_scale`` F32 [out]; the first matrix of a layer (expert 0's gate)
        also carries the layer's marker (I8 [0], a plan-time constant)."""
        m = matrix.module
        specs = [TensorSpec(f"{m}.{CODES}", "I8", (matrix.rows, matrix.cols)),
                 TensorSpec(f"{m}.{SCALE}", "F32", (matrix.rows,))]
        if matrix.expert == 0 and matrix.proj == "gate":
            specs.append(TensorSpec(self.experts.stock_weight_name(matrix.layer), "I8", (0,), value=b""))
        return specs

    def encode(self, codes: torch.Tensor, scales: torch.Tensor,
               matrices: Sequence[Matrix]) -> list[list[tuple[TensorSpec, torch.Tensor]]]:
        """The codes as they are and the scales widened to fp32 (exact), cut per matrix. See ``Format.encode``."""
        scales32 = scales.to(torch.float32)
        out, r0 = [], 0
        for m in matrices:
            sl = slice(r0, r0 + m.rows)
            r0 += m.rows
            c_spec, s_spec = self.tensor_specs(m)[:2]
            out.append([(c_spec, codes[sl]), (s_spec, scales32[sl])])
        return out

    def describe(self) -> str:
        """One sentence for the model card: how the codes and scales are stored."""
        return ("Stored as expq `experts-int8` (`quant_method: expq_experts_int8`), the tensors vLLM's experts_int8 "
                "holds after loading, unpacked: per expert projection `weight_int8` int8 [out, in] and "
                "`weight_scale` float32 [out] (w13 = gate rows then up rows; w2 scales over full rows), plus one "
                "empty marker tensor per MoE layer that makes stock transformers refuse the checkpoint.")

    # --- reading --------------------------------------------------------------------------------------------------
    def decode(self, module: str, read: ReadByName) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [out, in], scales fp32 [out]) of one module, as stored. See ``Format.decode``."""
        codes, scale = read(f"{module}.{CODES}"), read(f"{module}.{SCALE}")
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise ValueError(f"{CODES} must be int8 2-D, got {codes.dtype} {list(codes.shape)}")
        if scale.dtype != torch.float32 or scale.dim() != 1:
            raise ValueError(f"{SCALE} must be float32 1-D, got {scale.dtype} {list(scale.shape)}")
        if scale.shape[0] != codes.shape[0]:
            raise ValueError(f"{CODES} {list(codes.shape)} and {SCALE} {list(scale.shape)} do not fit: one scale per "
                             "row of the codes")
        return codes, scale

    def classify(self, name: str) -> TensorRole | None:
        """``(layer, expert, proj, "codes" | "scale")`` for an expert tensor, ``(layer, -1, "", "marker")`` for a
        layer's marker, else None. See ``Format.classify``."""
        module, _, suffix = name.rpartition(".")
        if suffix in (CODES, SCALE):
            key = self.experts.parse_module(module)
            if key is not None:
                return TensorRole(*key, "codes" if suffix == CODES else "scale")
        layer = self._markers().get(name)
        return None if layer is None else TensorRole(layer, -1, "", "marker")

    def quantized_modules(self, names: Sequence[str]) -> dict[tuple[int, int, str], str]:
        return self.experts.modules_with(names, CODES)

    def _markers(self) -> dict[str, int]:
        return {self.experts.stock_weight_name(L): L for L in self.experts.moe_layers}

    def check_model(self, config: dict, *, use_cache: bool = True) -> list[str]:
        """Problems with the layer markers against the transformers model class of ``config`` (config.json as a
        dict): each marker must be a parameter that stock transformers loads, with elements, or stock transformers
        would not refuse the checkpoint (a custom layout's ``[runtime]`` module/weight that does not fit). Empty
        when transformers cannot build the model at all (then it cannot load the checkpoint either). The parameter
        sizes come from ``stock_model.stock_parameter_sizes`` (cached per config and transformers; ``use_cache``
        False: computed, the cache only written)."""
        markers = self._markers()
        params = stock_parameter_sizes(config, list(markers), use_cache=use_cache)
        if params is None:
            return []
        bad = [m for m in sorted(markers) if not params.get(m)]
        if not bad:
            return []
        return [f"layer marker {bad[0]} is not a weight of transformers' {config.get('model_type')} model "
                f"({len(bad)} of {len(markers)} markers): stock transformers would load this checkpoint with random "
                "experts instead of refusing it; the layout's [runtime] module/weight must name the experts module's "
                "fused weight"]

    def clients(self, layout: Layout, hidden_size: int | None, *, local: bool = False) -> list[Client]:
        """expq's own: its vLLM plugin (``engines.vllm`` serves this format), transformers after ``import expq``,
        ``expq.load_model``. See ``Format.clients``."""
        return expq_clients(self, layout, hidden_size, local=local, vllm_plugin=True)

    # --- quantization_config --------------------------------------------------------------------------------------
    def targets(self) -> list[str]:
        """The quantized modules: ``re:.*<container>\\.\\d+\\.(<output projection names>)$``."""
        container = self.experts.layout.targets_container
        alts = "|".join(re.escape(a) for a in self.experts.output_projection_names)
        return ["re:.*" + re.escape(container) + r"\.\d+\.(" + alts + r")$"]

    def quantization_config(self, tensors: Mapping[str, TensorLike]) -> dict:
        """``{quant_method: expq_experts_int8, format: experts-int8, expq_version, weights: {...}, targets,
        tensors: {codes, scale}, markers}``: what engines need to read the checkpoint, as data."""
        return {"quant_method": QUANT_METHOD, "format": self.name, "expq_version": __version__,
                "weights": dict(WEIGHTS), "targets": self.targets(), "tensors": {"codes": CODES, "scale": SCALE},
                "markers": sorted(self._markers())}

    def check_config(self, config: dict, tensors: Mapping[str, TensorLike]) -> list[str]:
        """The config names this method and scheme, and its targets cover exactly the quantized modules."""
        bad = []
        if config.get("quant_method") != QUANT_METHOD or config.get("format") != self.name:
            bad.append(f"quantization_config: quant_method/format {config.get('quant_method')}/"
                       f"{config.get('format')}, expected {QUANT_METHOD}/{self.name}")
        w = config.get("weights") if isinstance(config.get("weights"), dict) else {}
        want = {k: v for k, v in WEIGHTS.items() if k != "scheme"}
        got = {k: w.get(k) for k in want}
        if got != want:
            bad.append(f"quantization_config weights {got}, expected {want}")
        if config.get("tensors") != {"codes": CODES, "scale": SCALE}:
            bad.append(f"quantization_config tensors {config.get('tensors')}, expected "
                       f"{{'codes': {CODES!r}, 'scale': {SCALE!r}}}")
        pats = [re.compile(t[3:]) for t in config.get("targets") or [] if isinstance(t, str) and t.startswith("re:")]
        quantized = set(self.quantized_modules(list(tensors)).values())
        unmatched = sorted(m for m in quantized if not any(p.fullmatch(m) for p in pats))
        if unmatched:
            bad.append(f"quantization_config targets miss {len(unmatched)} quantized modules, e.g. {unmatched[0]}")
        missing = sorted(set(self._markers()) - set(tensors))
        if missing:
            bad.append(f"{len(missing)} layer marker tensor(s) missing, e.g. {missing[0]}: stock transformers "
                       "would not refuse this checkpoint")
        wrong = sorted(m for m in set(self._markers()) & set(tensors)
                       if getattr(tensors[m], "dtype", "I8") != "I8" or tuple(tensors[m].shape) != (0,))
        if wrong:
            t = tensors[wrong[0]]
            bad.append(f"layer marker {wrong[0]} is {getattr(t, 'dtype', '?')} {list(t.shape)}, expected I8 [0] "
                       "(an empty tensor)")
        return bad

