"""Output formats: one file each, implementing ``base.Format``, and one line each in ``FORMATS`` below.

``FORMATS`` maps a format's name (``--format``, expq.json's ``format``) to its class. A built-in format is written
as ``"module:Class"`` and imported the first time its class is asked for, so that the names alone (the command
line's option checks and help, the layout schema) import no torch. A format defined outside expq is registered by
assigning its class: ``FORMATS[MyFormat.name] = MyFormat``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING

from ..errors import UsageError
from .base import Format, TensorSpec

if TYPE_CHECKING:
    import torch

    from ..experts import ExpertMap

AUTO = "auto"  # --format auto: the family's default (its layout's [clients] format)
DEFAULT = "compressed-tensors"  # a layout's [clients] format when it names none: the format stock clients load


class FormatRegistry(MutableMapping[str, type]):
    """Format name -> format class; a value given as ``"module:Class"`` is imported when first read.

    ``watch(fn)`` calls ``fn(cls)`` for every format, those registered later included: the engines register each
    format's ``quant_method`` this way (``engines.transformers``).
    """

    def __init__(self, entries: dict[str, str]):
        self._entries: dict[str, type | str] = dict(entries)
        self._watchers: list[Callable[[type], None]] = []

    def __getitem__(self, name: str) -> type:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            self._check(name, entry)
            self._entries[name] = entry
        return entry

    def __setitem__(self, name: str, cls: type) -> None:
        """Register ``cls`` (its ``name`` must be ``name``) and tell the watchers.

        Raises:
            ValueError: ``cls.name`` is not ``name``.
        """
        self._check(name, cls)
        self._entries[name] = cls
        for fn in self._watchers:
            fn(cls)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:  # by name: imports nothing (Mapping's would read the value)
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def watch(self, fn: Callable[[type], None]) -> None:
        """Call ``fn(cls)`` for each format now (importing the built-in ones) and for each one registered later."""
        self._watchers.append(fn)
        for name in self:
            fn(self[name])

    @staticmethod
    def _check(name: str, cls: type) -> None:
        if getattr(cls, "name", None) != name:
            raise ValueError(f"format class {cls.__qualname__} is named {getattr(cls, 'name', None)!r}, registered "
                             f"as {name!r}")


FORMATS = FormatRegistry({
    "compressed-tensors": "expq.formats.compressed_tensors:CompressedTensorsFormat",
    "experts-int8": "expq.formats.experts_int8:ExpertsInt8Format",
})

__all__ = ["Format", "TensorSpec", "FORMATS", "AUTO", "DEFAULT", "check_name", "get_format",
           "format_for_quant_method"]


def check_name(name: str) -> None:
    """``name`` is ``auto`` or a registered format's (imports no format).

    Raises:
        UsageError: an unknown format name (the message lists the known ones).
    """
    if name != AUTO and name not in FORMATS:
        raise _unknown(name)


def format_for_quant_method(method: object) -> str | None:
    """The format whose ``quantization_config`` names ``quant_method`` ``method``, else None."""
    return next((name for name, cls in FORMATS.items() if cls.quant_method == method), None)


def get_format(name: str, experts: ExpertMap, compute_dtype: torch.dtype) -> Format:
    """The format called ``name`` for one model and compute dtype.

    Raises:
        UsageError: an unknown format name (the message lists the known ones).
    """
    if name not in FORMATS:
        raise _unknown(name)
    return FORMATS[name](experts, compute_dtype)


def _unknown(name: str) -> UsageError:
    return UsageError(f"unknown --format {name!r}; supported: {AUTO}, {', '.join(FORMATS)}")
