"""transformers support for the ``experts-int8`` format: a quantization config and an ``HfQuantizer`` for
``quant_method: expq_experts_int8``, registered with transformers' ``register_quantization_config`` /
``register_quantizer`` when expq is imported (``expq/__init__.py`` registers them as soon as transformers is
imported, so ``import expq`` alone never imports transformers).

After ``import expq``, ``AutoModelForCausalLM.from_pretrained(OUT)`` builds the same modules as ``expq.load_model``:
before the weights load, each MoE layer's experts module becomes ``Int8<Family>Experts`` without its dense weights
(``runtime.make_experts_int8``); transformers loads every other tensor as it always does; then the int8 codes and
fp32 scales are read from the checkpoint and attached (``runtime.attach_int8_experts``). Without expq, stock
transformers stops on the format's layer markers (see ``formats/experts_int8.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..formats.experts_int8 import QUANT_METHOD

_registered = False


def register() -> None:
    """Register expq's config and quantizer with transformers (idempotent).

    Raises:
        ImportError: transformers is not installed.
    """
    global _registered
    if _registered:
        return
    from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                              register_quantization_config, register_quantizer)

    config_cls, quantizer_cls = _classes()
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(config_cls)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(quantizer_cls)
    _registered = True


def _classes():
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class ExpqExpertsInt8Config(QuantizationConfigMixin):
        """The ``quantization_config`` of an expq ``experts-int8`` checkpoint (kept as written)."""

        def __init__(self, **kwargs):
            self.quant_method = QUANT_METHOD
            self._fields = {k: v for k, v in kwargs.items() if k != "quant_method"}
            for k, v in self._fields.items():
                setattr(self, k, v)

        def to_dict(self) -> dict:
            return {"quant_method": QUANT_METHOD, **self._fields}

    class ExpqExpertsInt8Quantizer(HfQuantizer):
        """Loads expq ``experts-int8`` checkpoints with the routed experts int8 in memory (expq's kernel)."""

        requires_calibration = True  # pre-quantized checkpoints only: expq convert makes them

        def __init__(self, quantization_config, **kwargs):
            super().__init__(quantization_config, **kwargs)
            self._ck = None
            self._int8_cls = None

        def validate_environment(self, *args, **kwargs):
            return None

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            from ..checkpoint import ConvertedCheckpoint
            from ..errors import UsageError
            from ..runtime import make_experts_int8

            if not checkpoint_files:
                raise UsageError("expq experts-int8: transformers gave no checkpoint files to read the experts from")
            self._ck = ConvertedCheckpoint(Path(checkpoint_files[0]).parent)
            self._int8_cls = make_experts_int8(model, self._ck)
            # The int8 tensors are read by expq after loading; the dense placeholders are not loaded by design.
            fmt = self._ck.format
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or []) | {
                r"\.(" + "|".join(fmt.SUFFIXES) + r")$"}
            model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or []) | {
                re.escape(f".{self._ck.layout.runtime_module}.")}
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            from ..runtime import attach_int8_experts

            attach_int8_experts(model, self._ck, self._int8_cls)
            return model

        def is_serializable(self, *args, **kwargs) -> bool:
            return False

        @property
        def is_trainable(self) -> bool:
            return False

    return ExpqExpertsInt8Config, ExpqExpertsInt8Quantizer
