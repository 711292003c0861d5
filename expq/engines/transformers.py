"""transformers support for the formats only expq loads (``Format.expq_loads``: e.g. ``experts-int8``): a quantization
config and an ``HfQuantizer`` registered under each such format's ``quant_method`` with transformers'
``register_quantization_config`` / ``register_quantizer`` when expq is imported (``expq/__init__.py`` registers them
as soon as transformers is imported, so ``import expq`` alone never imports transformers), and for each format
registered later in ``formats.FORMATS``.

After ``import expq``, ``AutoModelForCausalLM.from_pretrained(OUT)`` builds the same modules as ``expq.load_model``:
before the weights load, each MoE layer's experts module becomes ``Int8<Family>Experts`` without its dense weights
(``runtime.make_experts_int8``); transformers loads every other tensor as it always does; then the int8 codes and
scales are read from the checkpoint through its format's ``decode`` and attached (``runtime.attach_int8_experts``).
Without expq, stock transformers refuses such a checkpoint (``experts-int8``: on the format's layer markers, see
``formats/experts_int8.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..checkpoint import ConvertedCheckpoint
from ..errors import UsageError
from ..formats import FORMATS
from ..runtime import attach_int8_experts, make_experts_int8

_registered = False


def register() -> None:
    """Register expq's config and quantizer with transformers under the ``quant_method`` of every format only expq
    loads, now and as formats are registered (idempotent).

    Raises:
        ImportError: transformers is not installed.
    """
    global _registered
    if _registered:
        return
    _registered = True
    FORMATS.watch(_register_format)


def _register_format(fmt: type) -> None:
    """Register expq's config and quantizer under ``fmt.quant_method`` where expq loads ``fmt`` and transformers
    knows no such method yet."""
    from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                              register_quantization_config, register_quantizer)

    if not fmt.expq_loads:
        return
    method = fmt.quant_method
    config_cls, quantizer_cls = _classes(method)
    if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(method)(config_cls)
    if method not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(method)(quantizer_cls)


def _classes(quant_method: str):
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class ExpqExpertsInt8Config(QuantizationConfigMixin):
        """The ``quantization_config`` of a checkpoint in a format only expq loads (kept as written)."""

        def __init__(self, **kwargs):
            self.quant_method = quant_method
            self._fields = {k: v for k, v in kwargs.items() if k != "quant_method"}
            for k, v in self._fields.items():
                setattr(self, k, v)

        def to_dict(self) -> dict:
            return {"quant_method": quant_method, **self._fields}

    class ExpqExpertsInt8Quantizer(HfQuantizer):
        """Loads checkpoints in a format only expq loads with the routed experts int8 in memory (expq's kernel)."""

        requires_calibration = True  # pre-quantized checkpoints only: expq convert makes them

        def __init__(self, quantization_config, **kwargs):
            super().__init__(quantization_config, **kwargs)
            self._ck = None
            self._int8_cls = None

        def validate_environment(self, *args, **kwargs):
            return None

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            if not checkpoint_files:
                raise UsageError(f"expq {quant_method}: transformers gave no checkpoint files to read the experts "
                                 "from")
            self._ck = ConvertedCheckpoint(Path(checkpoint_files[0]).parent)
            self._int8_cls = make_experts_int8(model, self._ck)
            # The int8 tensors are read by expq after loading; the dense placeholders are not loaded by design.
            fmt = self._ck.format
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or []) | {
                r"\.(" + "|".join(map(re.escape, fmt.suffixes.values())) + r")$"}
            model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or []) | {
                re.escape(f".{self._ck.layout.runtime_module}.")}
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            attach_int8_experts(model, self._ck, self._int8_cls)
            return model

        def is_serializable(self, *args, **kwargs) -> bool:
            return False

        @property
        def is_trainable(self) -> bool:
            return False

    return ExpqExpertsInt8Config, ExpqExpertsInt8Quantizer
