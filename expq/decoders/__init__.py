"""Source decoders: detect how the source stores its weights and turn quantized ones back into the compute dtype.

``detect(config, tensors)`` tries each decoder of ``DECODERS`` in order and falls back to ``PlainDecoder``; a source
whose ``quantization_config`` no decoder understands is refused, naming its ``quant_method``.
"""

from __future__ import annotations

from ..errors import SourceError
from ..io.safetensors import TensorInfo
from .base import Decoder, LogicalTensor, ReadFn, source_quantization_config
from .compressed_tensors import CompressedTensorsDecoder
from .fp8_block import Fp8BlockDecoder
from .mxfp4 import Mxfp4Decoder
from .plain import PlainDecoder

DECODERS: list[type] = [
    Fp8BlockDecoder,
    Mxfp4Decoder,
    CompressedTensorsDecoder,
]
"""Quantized source formats, tried in order (each in its own file next to this one)."""

__all__ = ["Decoder", "LogicalTensor", "ReadFn", "PlainDecoder", "DECODERS", "detect", "source_quantization_config"]


def detect(config: dict, tensors: dict[str, TensorInfo]) -> Decoder:
    """The decoder for a source's ``config.json`` and stored tensors.

    Raises:
        SourceError: the source is quantized in a format no decoder handles (names ``quant_method``), or a decoder
            found its config inconsistent.
    """
    for cls in DECODERS:
        dec = cls.detect(config, tensors)
        if dec is not None:
            return dec
    raw = config.get("quantization_config")
    if raw is not None and not isinstance(raw, dict):
        raise SourceError(f"quantization_config must be a JSON object, got {type(raw).__name__}", file="config.json")
    qc = source_quantization_config(config)
    if not qc:
        quantized = next((t for t in tensors.values() if t.dtype.startswith("F8_")
                          or (t.dtype == "U8" and t.name.endswith("_blocks"))), None)
        if quantized is not None:
            raise SourceError(f"stored as {quantized.dtype} but config.json has no quantization_config saying how "
                              "to decode it", file=quantized.file, tensor=quantized.name)
    if qc:
        method = qc.get("quant_method", "?")
        raise SourceError(f"the source is already quantized (quantization_config quant_method={method!r}); expq "
                          "converts bf16/fp16/fp32 checkpoints", file="config.json",
                          hint="start from the unquantized release")
    return PlainDecoder()
