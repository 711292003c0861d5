"""``expq.json``: the typed record of what produced a converted checkpoint, written by ``convert`` and read by
``verify``, ``load_model``, ``push`` and the model card. No module reads its keys by hand, and every reader reads
it through ``ManifestFile.read``. ``files_against_manifest`` is the one rule for which files OUT may hold.

Deterministic: no time, no machine, no absolute paths (the same input and options give the same bytes).
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import SourceError
from .io import files as io_files
from .io.hashing import sha256_file
from .io.regular import read_regular
from .version import __version__

MANIFEST = "expq.json"


# config.json's key holding the sha256 of expq.json's canonical form (``canonical_sha256``): a top-level key, which
# transformers keeps as a plain attribute and vLLM ignores; inside ``quantization_config`` compressed-tensors'
# schema would have to accept it.
MANIFEST_SHA256_KEY = "expq_manifest_sha256"
CONFIG = "config.json"

# Files `expq push` writes into OUT (the model card): not part of the conversion's bytes. OUT may hold them whether
# expq.json lists them or not, and their bytes are not compared (``files_against_manifest``); a re-run of convert
# keeps them, a rebuild carries them into the new checkpoint.
PUSH_WRITES = ("README.md",)
# Documentation a user adds to OUT (a push publishes it): OUT may hold it unlisted; verify reports it, a re-run of
# convert with nothing to do keeps it, and a rebuild refuses to delete it. Anything else (weights, configs, code:
# what a loader could read) must be listed.
DOCUMENTATION = re.compile(r"\.(md|txt|rst)$", re.IGNORECASE)
MAX_MANIFEST_BYTES = 64 << 20  # expq.json (a few KiB: its size grows with the file list and the source's card)

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
        """Read and validate ``root/expq.json`` (``ManifestFile.read``).

        Raises:
            SourceError: missing, not JSON, or not an expq manifest (names the first wrong key).
        """
        found = ManifestFile.read(root)
        if found is None:
            raise SourceError(f"no {MANIFEST}: not written by expq convert", file=str(root))
        return found.record

    @classmethod
    def load_optional(cls, root: str | Path) -> "Manifest | None":
        """``load``, or None when there is no ``expq.json`` (a checkpoint another tool wrote)."""
        found = ManifestFile.read(root)
        return found.record if found is not None else None


@dataclass(frozen=True)
class ManifestFile:
    """``expq.json`` as read from a folder, once: its validated record and the ``canonical_sha256`` of its data as
    stored (what config.json's ``MANIFEST_SHA256_KEY`` must equal: the file's own data, not the record written
    again, so that any value changed shows)."""

    record: Manifest
    sha256: str

    @classmethod
    def read(cls, root: str | Path) -> "ManifestFile | None":
        """Read ``root/expq.json`` (a regular file of at most ``MAX_MANIFEST_BYTES``) and validate it; None when
        there is none. Every reader of expq.json comes through here.

        Raises:
            SourceError: not a regular file, unreadable, not JSON, not a JSON object, or not an expq manifest (names
                the first wrong key).
        """
        path = Path(root) / MANIFEST
        if io_files.lstat(path) is None:
            return None
        raw = read_regular(path, MANIFEST, MAX_MANIFEST_BYTES)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: Python's int digit limit
            raise SourceError(f"{MANIFEST} cannot be read: {type(e).__name__}: {str(e).splitlines()[0]}",
                              file=str(path)) from None
        if not isinstance(data, dict):
            raise SourceError(f"{MANIFEST} must hold a JSON object", file=str(path))
        try:
            record = Manifest.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(x) for x in err["loc"])
            raise SourceError(f"not an expq manifest: {key}: {err['msg']}", file=str(path)) from None
        return cls(record, canonical_sha256(data))


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


def manifest_intact(found: ManifestFile | None, config: dict) -> str | None:
    """None when expq.json (``found``: as ``ManifestFile.read`` read it, None when missing) hashes to what
    ``config`` (config.json's data) records under ``MANIFEST_SHA256_KEY``, else why not, as a line to follow
    ``file expq.json: `` (missing, not recorded, changed)."""
    if found is None:
        return "missing (the record of what expq convert wrote, and of every file's sha256)"
    want = config.get(MANIFEST_SHA256_KEY)
    if not isinstance(want, str):
        return f"cannot be checked: {CONFIG} has no {MANIFEST_SHA256_KEY} (removed, or written by an older expq)"
    if found.sha256 != want:
        return f"changed since expq convert wrote it (its sha256 differs from {CONFIG}'s {MANIFEST_SHA256_KEY})"
    return None


# --- OUT's files against the manifest ------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutFiles:
    """OUT's entries judged against its expq.json (``files_against_manifest``).

    ``listed``: the files expq.json records whose size and sha256 are compared (every one but ``PUSH_WRITES``);
    ``unlisted``: what OUT holds that expq.json does not list and OUT may not hold: files, then links and special
    files (shown with what they are: ``name (a symbolic link)``), then folders holding no file (shown ending in
    ``/``), each group sorted; ``added``: the documentation OUT holds unlisted (``DOCUMENTATION``; an unlisted
    model card among it), sorted.
    """

    root: Path
    listed: tuple[FileRecord, ...]
    unlisted: tuple[str, ...]
    added: tuple[str, ...]

    def problems(self) -> Iterator[str]:
        """Each difference as one line naming the file: the unlisted entries first, then the listed files (by name)
        that are missing (or not a regular file), of another size, or of another sha256 (hashed only when the size
        matches). Lazy: ``next(problems(), None)`` hashes only up to the first difference."""
        for entry in self.unlisted:
            yield f"file {entry}: in OUT but not in {MANIFEST} (not written by expq convert)"
        for f in sorted(self.listed, key=lambda f: f.name):
            path = self.root / f.name
            st = io_files.lstat(path)
            if st is None or not stat.S_ISREG(st.st_mode):
                yield f"file {f.name}: listed in {MANIFEST} but missing"
            elif st.st_size != f.size:
                yield f"file {f.name}: {st.st_size} bytes, {MANIFEST} says {f.size}"
            elif sha256_file(path, follow_links=False) != f.sha256:
                yield f"file {f.name}: content changed since expq convert wrote it (sha256 differs from {MANIFEST})"

    def match(self) -> bool:
        """OUT holds what expq.json records (at least one file besides ``PUSH_WRITES``), byte for byte, and nothing
        it may not hold."""
        return bool(self.listed) and next(self.problems(), None) is None

    def not_carried(self) -> list[str]:
        """The added documentation a rebuild would delete: all of it but ``PUSH_WRITES`` (which it carries)."""
        return [a for a in self.added if a not in PUSH_WRITES]


def files_against_manifest(out: str | Path, manifest: Manifest) -> OutFiles:
    """The one rule for which files OUT holds, shared by ``verify`` and a re-run of ``convert``: ``expq.json``, the
    files it lists, ``PUSH_WRITES`` (the model card a push writes, listed or not, there or not, its bytes not
    compared) and documentation a user added (``DOCUMENTATION``), each a regular file; anything else (a file, a
    link, a special file, a folder holding no file) was not written by expq convert. Nothing under OUT is followed
    through a link.

    Args:
        out: the checkpoint folder. manifest: its expq.json.

    Returns:
        OutFiles (hashes are computed only as ``problems`` is iterated).
    """
    root = Path(out)
    names = {f.name for f in manifest.files}
    entries = list(io_files.walk(root))
    regular = {rel for rel, st in entries if stat.S_ISREG(st.st_mode)}
    odd = [f"{rel} (a symbolic link)" if stat.S_ISLNK(st.st_mode) else f"{rel} (not a regular file)"
           for rel, st in entries if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))]
    empty = [f"{rel}/" for rel, st in entries
             if stat.S_ISDIR(st.st_mode) and not any(f.startswith(rel + "/") for f in regular)]
    extra = regular - {MANIFEST} - names
    added = {rel for rel in extra if DOCUMENTATION.search(rel)}
    unlisted = sorted(extra - added - set(PUSH_WRITES)) + sorted(odd) + sorted(empty)
    listed = tuple(f for f in manifest.files if f.name not in PUSH_WRITES)
    return OutFiles(root, listed, tuple(unlisted), tuple(sorted(added)))


def _decoded(plan) -> DecodedRecord | None:
    from .decoders import source_quantization_config

    if plan.source.decoder.name == "none":
        return None
    return DecodedRecord(source_format=plan.source.decoder.name,
                         source_quantization_config=source_quantization_config(plan.source.config) or {},
                         tensors_decoded=plan.decoded_as())
