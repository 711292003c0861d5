"""``expq.json``: the typed record of what produced a converted checkpoint, written by ``convert`` and read by
``verify``, ``load_model``, ``push`` and the model card. No module reads its keys by hand.

Deterministic: no time, no machine, no absolute paths (the same input and options give the same bytes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import SourceError
from .version import __version__

MANIFEST = "expq.json"


# config.json's key holding the sha256 of expq.json's canonical form (``canonical_sha256``): a top-level key, which
# transformers keeps as a plain attribute and vLLM ignores; inside ``quantization_config`` compressed-tensors'
# schema would have to accept it.
MANIFEST_SHA256_KEY = "expq_manifest_sha256"
CONFIG = "config.json"

# Files `expq push` writes into OUT (the model card): not part of the conversion's bytes; verify does not compare
# them and a re-run of convert keeps them.
PUSH_WRITES = ("README.md",)

class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # "24", true, 24.0 are not 24


class SourceRecord(_Record):
    repo_id: str | None
    revision: str | None
    commit: str | None
    name: str


class OptionsRecord(_Record):
    dtype: str
    max_shard_size: int
    layout: str
    allow_nonfinite: bool


class PlanRecord(_Record):
    """What the plan found (sizes in bytes, layer indices as in the model)."""

    architecture: str | None
    model_type: str | None
    layout: str
    layout_rule: str
    detected_by: str
    config_keys: dict[str, str]
    compute_dtype: str
    compute_dtype_reason: str
    num_layers: int
    moe_layers: list[int]
    dense_layers: list[int]
    extra_expert_layers_copied: list[int]
    routed_experts_per_layer: int
    top_k: int | None
    hidden_size: int | None
    moe_intermediate_size: int | None
    matrices_quantized: int
    source_tensors_quantized: int
    source_tensors_copied: int  # tensors not quantized: copied byte for byte, or decoded (see ``decoded``)
    bytes_quantized_in: int
    bytes_copied: int  # source bytes of the tensors not quantized
    bytes_in: int
    bytes_out: int
    output_shards: int


class RowsRecord(_Record):
    zero: int
    underflow: int
    nonfinite: int
    underflow_examples: list[str]
    nonfinite_examples: list[str]


DECODED_EXPERTS = "routed experts"
DECODED_OTHERS = "other tensors"
"""The kinds of ``DecodedRecord.tensors_decoded``'s keys (``"<kind>: <how>"``): routed experts, decoded then
quantized; other tensors, written decoded (not quantized)."""


class DecodedRecord(_Record):
    """A quantized source: its format, its ``quantization_config`` (not carried into the output's config) and how
    many tensors of each kind were decoded to the compute dtype (``"<kind>: <how>"`` -> count)."""

    source_format: str
    source_quantization_config: dict[str, Any]
    tensors_decoded: dict[str, int]

    def count(self, kind: str) -> int:
        """Tensors decoded of ``kind`` (``DECODED_EXPERTS`` or ``DECODED_OTHERS``)."""
        return sum(n for key, n in self.tensors_decoded.items() if key.startswith(kind + ": "))


class FileRecord(_Record):
    """One output file: its path relative to OUT, size in bytes and sha256 (hex), as the Hub records LFS files."""

    name: str
    size: int
    sha256: str


class Manifest(_Record):
    """The contents of ``expq.json`` (field order is the file's key order)."""

    expq_version: str
    command: str
    format: str
    scheme: str
    source: SourceRecord
    options: OptionsRecord
    plan: PlanRecord
    layout_toml: str
    activation: str
    expert_biases: list[str]
    quantized_modules: int
    rows: RowsRecord
    side_files: list[str]
    skipped_files: list[str]
    source_card: dict[str, Any]
    quantized_bytes_out: int
    decoded: DecodedRecord | None = None  # written only for a quantized source
    settings: dict[str, Any] | None = None  # the run's settings fingerprint (source identity, options, version)
    files: list[FileRecord] = []  # every other output file: verify checks each byte without the source

    @classmethod
    def from_plan(cls, plan, stats, *, allow_nonfinite: bool, command: str, source_card: dict, settings: dict,
                  files: list[FileRecord]) -> "Manifest":
        """The manifest of a conversion: ``plan`` (``plan.Plan``), ``stats`` (``pipeline.RunStats``), the run's
        ``settings`` fingerprint and the ``files`` written (every output file but expq.json)."""
        s = plan.summary()
        src = plan.source
        return cls(
            expq_version=__version__, command=command, format=plan.format.name, scheme="experts_int8",
            source=SourceRecord(repo_id=src.repo_id, revision=src.revision, commit=src.commit,
                                name=src.repo_id or src.root.name),
            options=OptionsRecord(dtype=s["compute_dtype"], max_shard_size=plan.max_shard_size,
                                  layout=plan.layout.name, allow_nonfinite=allow_nonfinite),
            plan=PlanRecord(**{k: s[k] for k in PlanRecord.model_fields}),
            layout_toml=plan.layout.source_text, activation=plan.layout.activation,
            expert_biases=list(plan.layout.expert_biases), quantized_modules=len(plan.experts.matrices),
            rows=RowsRecord(zero=stats.zero_rows, underflow=stats.underflow_rows, nonfinite=stats.nonfinite_rows,
                            underflow_examples=[str(n) for n in stats.underflow_examples],
                            nonfinite_examples=[str(n) for n in stats.nonfinite_examples]),
            side_files=list(src.side_files), skipped_files=list(src.skipped_files), source_card=source_card,
            quantized_bytes_out=plan.quantized_bytes_out,
            decoded=_decoded(plan), settings=settings, files=files)

    def to_json(self) -> str:
        """The file's text (2-space indent; values JSON cannot hold, such as dates in a card, as strings)."""
        data = self.model_dump(mode="python")
        if data["decoded"] is None:
            del data["decoded"]
        return json.dumps(data, indent=2, default=str) + "\n"

    def sha256(self) -> str:
        """``canonical_sha256`` of this manifest as ``to_json`` writes it (what config.json records)."""
        return canonical_sha256(json.loads(self.to_json()))

    @classmethod
    def load(cls, root: str | Path) -> "Manifest":
        """Read and validate ``root/expq.json``.

        Raises:
            SourceError: missing, not JSON, or not an expq manifest (names the first wrong key).
        """
        path = Path(root) / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise SourceError(f"no {MANIFEST}: not written by expq convert", file=str(root)) from None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: Python's int digit limit
            raise SourceError(f"{MANIFEST} cannot be read: {type(e).__name__}: {str(e).splitlines()[0]}",
                              file=str(path)) from None
        if not isinstance(data, dict):
            raise SourceError(f"{MANIFEST} must hold a JSON object", file=str(path))
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(x) for x in err["loc"])
            raise SourceError(f"not an expq manifest: {key}: {err['msg']}", file=str(path)) from None

    @classmethod
    def load_optional(cls, root: str | Path) -> "Manifest | None":
        """``load``, or None when there is no ``expq.json`` (a checkpoint another tool wrote)."""
        return cls.load(root) if (Path(root) / MANIFEST).is_file() else None


def canonical_sha256(data: dict) -> str:
    """The sha256 (hex) of expq.json's canonical form: its JSON data with sorted keys, compact separators and ASCII
    escapes, without the ``files`` record of config.json (which holds this very hash, so cannot be covered by it;
    config.json's own bytes are covered by that record). Whitespace and key order do not change it; any value does.
    """
    data = dict(data)
    if isinstance(data.get("files"), list):
        data["files"] = [f for f in data["files"] if not (isinstance(f, dict) and f.get("name") == CONFIG)]
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_sha256(root: str | Path) -> str | None:
    """``canonical_sha256`` of ``root/expq.json`` as it is on disk (None when it is missing or not a JSON object).

    Raises:
        SourceError: it cannot be read.
    """
    path = Path(root) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise SourceError(f"{MANIFEST} cannot be read: {type(e).__name__}", file=str(path)) from None
    return canonical_sha256(data) if isinstance(data, dict) else None


def manifest_intact(root: str | Path, config: dict) -> str | None:
    """None when ``root/expq.json`` hashes to what ``config`` (config.json's data) records under
    ``MANIFEST_SHA256_KEY``, else why not, as a line to follow ``file expq.json: `` (missing, not recorded,
    changed)."""
    try:
        got = manifest_sha256(root)
    except SourceError as e:
        return e.message
    if got is None:
        return "missing (the record of what expq convert wrote, and of every file's sha256)"
    want = config.get(MANIFEST_SHA256_KEY)
    if not isinstance(want, str):
        return f"cannot be checked: {CONFIG} has no {MANIFEST_SHA256_KEY} (removed, or written by an older expq)"
    if got != want:
        return f"changed since expq convert wrote it (its sha256 differs from {CONFIG}'s {MANIFEST_SHA256_KEY})"
    return None


def _decoded(plan) -> DecodedRecord | None:
    from .decoders import source_quantization_config

    if plan.source.decoder.name == "none":
        return None
    return DecodedRecord(source_format=plan.source.decoder.name,
                         source_quantization_config=source_quantization_config(plan.source.config) or {},
                         tensors_decoded=plan.decoded_as())
