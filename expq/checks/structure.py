"""The structure checks: what ``verify`` checks without the source, each over the opened checkpoint alone."""

from __future__ import annotations

from ..checkpoint import ConvertedCheckpoint
from ..experts import Matrix
from ..io.index import INDEX_NAME
from ..manifest import MANIFEST, files_against_manifest
from .record import CheckResult, result


def manifest_unchanged(ck: ConvertedCheckpoint) -> CheckResult:
    """expq.json is there and unchanged: its canonical sha256 is the one config.json records (so an edited
    ``command`` or ``rows.underflow``, which sets the codes check's underflow allowance, fails)."""
    why = ck.manifest_problem
    return result(f"{MANIFEST} intact (its sha256 in config.json)", [f"file {MANIFEST}: {why}"] if why else [])


def files_match_manifest(ck: ConvertedCheckpoint) -> CheckResult:
    """OUT holds exactly the files expq.json lists, each with its recorded size and sha256
    (``manifest.files_against_manifest``, the rule a re-run of convert applies too), so any changed, missing or
    extra byte shows without the source."""
    name = "files match expq.json (size, sha256)"
    if ck.manifest is None:
        return result(name, [f"file {MANIFEST}: missing, so no file's size and sha256 can be checked"])
    if not ck.manifest.files:
        return result(name, [f"file {MANIFEST}: lists no files (written by an older expq), so none can be checked"])
    judged = files_against_manifest(ck.root, ck.manifest)
    added = f"; documentation added since: {', '.join(judged.added)}" if judged.added else ""
    return result(name, list(judged.problems()), f"{len({f.name for f in ck.manifest.files})} files{added}")


def index_matches_shards(ck: ConvertedCheckpoint) -> CheckResult:
    """Every shard the index names is there; each tensor is in one shard, the one the index names; no safetensors
    file outside the checkpoint (loaders without an index take every ``*.safetensors``); ``total_size`` right."""
    bad = [f"file {f}: listed in {INDEX_NAME} but missing" for f in ck.missing_files]
    where: dict[str, list[str]] = {}
    for sh in ck.shards.values():
        for t in sh.tensors:
            where.setdefault(t.name, []).append(sh.file)
    bad += [f"tensor {name}: stored in {len(files)} shards ({', '.join(files)})"
            for name, files in where.items() if len(files) > 1]
    bad += [f"file {p.name}: a safetensors file that is not part of the checkpoint"
            for p in sorted(ck.root.glob("*.safetensors")) if p.name not in ck.shards and p.name not in ck.missing_files]
    if ck.weight_map is not None:
        for name, f in ck.weight_map.items():
            if f in ck.missing_files or f in where.get(name, []):
                continue
            found = f" (it is in {where[name][0]})" if name in where else ""
            bad.append(f"tensor {name}: {INDEX_NAME} says {f} but the tensor is not there{found}")
        bad += [f"tensor {name}: in {files[0]} but not in {INDEX_NAME}"
                for name, files in where.items() if name not in ck.weight_map]
        total = sum(t.nbytes for sh in ck.shards.values() for t in sh.tensors)
        if ck.index.total_size != total:
            bad.append(f"{INDEX_NAME}: total_size {ck.index.total_size} but the shards hold {total} bytes of tensors")
    n = len(ck.shards)
    return result("index and shards agree", bad, f"{n} shard{'s' if n != 1 else ''}")


def files_load(ck: ConvertedCheckpoint) -> CheckResult:
    """Every shard loads with the ``safetensors`` library (what every client reads it with); stops at the first
    that does not."""
    from safetensors import safe_open

    for f in sorted(ck.shards):
        try:
            with safe_open(ck.root / f, "pt") as s:
                for k in s.keys():
                    s.get_slice(k)
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            return result("files load with safetensors", [f"file {f}: safetensors cannot load it: {e}"])
    return result("files load with safetensors", [])


def quantization_config_valid(ck: ConvertedCheckpoint) -> CheckResult:
    """The format's own check of config.json's ``quantization_config`` against the tensors, and of the model (never
    from the marker check's cache: whoever can write the cache folder must not be able to make verify pass)."""
    return result("quantization_config", ck.format.check_config(ck.quantization_config, ck.tensors)
                  + ck.format.check_model(ck.config, use_cache=False))


def experts_present(ck: ConvertedCheckpoint) -> CheckResult:
    """Every expected matrix has the format's tensors with their dtypes and shapes (shapes from config sizes), and
    no quantized module is other than a routed expert the config describes."""
    bad = []
    em = ck.experts
    for (L, e, p), module in em.expected_modules().items():
        rows, cols = em.matrix_shape(p)
        for spec in ck.format.tensor_specs(Matrix(L, e, p, module, rows or 0, cols or 0)):
            t = ck.tensors.get(spec.name)
            if t is None:
                bad.append(f"layer {L} expert {e} {p}: tensor {spec.name} missing")
                continue
            if t.dtype != spec.dtype:
                bad.append(f"layer {L} expert {e} {p}: tensor {spec.name} is {t.dtype}, expected {spec.dtype}")
            if rows is not None and cols is not None and tuple(t.shape) != spec.shape:
                bad.append(f"layer {L} expert {e} {p}: tensor {spec.name} has shape {list(t.shape)}, "
                           f"expected {list(spec.shape)}")
    for key in sorted(set(ck.modules) - set(em.expected_modules())):
        bad.append(f"layer {key[0]} expert {key[1]} {key[2]}: quantized module {ck.modules[key]} is not a routed "
                   "expert the config describes")
    n = len(em.moe_layers) * em.num_experts * 3
    return result("every routed expert present (dtypes, shapes)", bad,
                  f"{n} matrices = {len(em.moe_layers)} layers x {em.num_experts} experts x 3")


STRUCTURE = (manifest_unchanged, files_match_manifest, index_matches_shards, files_load, quantization_config_valid,
             experts_present)
"""The structure checks, in the order the report lists them."""
