"""The vLLM plugin's weight loading (expq.engines), without vLLM: converted fixtures' expert tensors loaded into
stand-in fused-MoE layers per tensor-/expert-parallel rank, compared bit for bit with the checkpoint's experts_int8
layout and with what vLLM 0.24's online experts_int8 would hold (the seed function on the source weights, in the
w13 row order vLLM's model loaders give); negative controls; the plugin's routing over stand-in vLLM modules; the
entry point and the import without vLLM."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import converted_factory, load_hf, model_expert_matrices, seed_reference

from expq.checkpoint import ConvertedCheckpoint
from expq.engines import vllm as plugin
from expq.engines.moe_loading import LayerLoader, Partition, per_rank, route_weights
from expq.errors import ExpqError

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss", "dbrx"]
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None  # found, not imported (collection must not import it)
INTERLEAVED = {"gpt_oss"}  # vLLM's gpt_oss loader keeps gate/up interleaved in w13 (swigluoai reads x[::2], x[1::2])
SUFFIX = {"codes": "weight_int8", "scale": "weight_scale"}  # the experts-int8 format's tensor names


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    get = converted_factory(tmp_path_factory, "vllm", format="experts-int8")
    cache: dict[str, tuple[Path, ConvertedCheckpoint, dict]] = {}

    def ck(family):
        if family not in cache:
            src, out = get(family)
            c = ConvertedCheckpoint(out)
            cache[family] = (src, c, {L: c.layer_experts(L) for L in c.moe_layers})
        return cache[family]

    return ck


# --- the checkpoint as the experts-int8 format stores it (per projection: codes [out, in], scales [out]) ---------
def expert_stream(ck: ConvertedCheckpoint, layers: dict, drop=None, extra=()):
    """(name, tensor) as vLLM's loader would stream an experts-int8 checkpoint: a few ordinary tensors, then per
    layer a marker and every projection's codes and scales (``drop``: one (L, e, proj, kind) left out)."""
    others = [n for n in sorted(ck.tensors) if ck.format.classify(n) is None][:5]
    for n in others:
        yield n, ck.read(n)
    yield from extra
    for L, lx in layers.items():
        yield ck.experts.stock_weight_name(L), ck.read(ck.experts.stock_weight_name(L))
        for e in range(ck.num_experts):
            for p in ("gate", "up", "down"):
                codes, scales = lx.matrix(e, p)
                for kind, t in (("codes", codes), ("scale", scales)):
                    if (L, e, p, kind) != drop:
                        yield f"{ck.experts.module_name(L, e, p)}.{SUFFIX[kind]}", t.clone()


def classify_for(ck: ConvertedCheckpoint):
    """The experts-int8 format's own classify."""
    assert ck.format.name == "experts-int8"
    return ck.format.classify


def stand_in(E_local: int, H: int, I_r: int) -> torch.nn.Module:
    """A fused-MoE layer's four parameters, shaped per rank, filled with garbage (every byte must be written)."""
    m = torch.nn.Module()
    m.w13_weight = torch.nn.Parameter(torch.full((E_local, 2 * I_r, H), 99, dtype=torch.int8), requires_grad=False)
    m.w2_weight = torch.nn.Parameter(torch.full((E_local, H, I_r), 99, dtype=torch.int8), requires_grad=False)
    m.w13_scale = torch.nn.Parameter(torch.full((E_local, 2 * I_r), float("nan")), requires_grad=False)
    m.w2_scale = torch.nn.Parameter(torch.full((E_local, H), float("nan")), requires_grad=False)
    return m


def params(m):
    return {k: getattr(m, k).data for k in ("w13_weight", "w2_weight", "w13_scale", "w2_scale")}


def load_ranks(ck, layers, tp_size, partition_of=None, interleaved=False):
    """Per rank: {L: stand-in}, filled through route_weights; returns (modules per rank, passed-through names)."""
    lx0 = next(iter(layers.values()))
    E, I2, H = lx0.w13.shape
    I_r = (I2 // 2) // tp_size
    ranks, passed = [], None
    for r in range(tp_size):
        part = partition_of(r) if partition_of else Partition(tp_rank=r, tp_size=tp_size, interleaved=interleaved)
        E_local = E if part.expert_map is None else sum(x >= 0 for x in part.expert_map)
        mods = {L: stand_in(E_local, H, I_r) for L in layers}
        loaders = {L: LayerLoader(L, params(m), E, part) for L, m in mods.items()}
        names = [n for n, _ in route_weights(expert_stream(ck, layers), classify_for(ck), loaders)]
        assert passed is None or names == passed
        passed = names
        ranks.append(mods)
    return ranks, passed


# --- bit-exact against the checkpoint's experts_int8 layout ------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_tp_slices_equal_checkpoint(family, tp, converted):
    _, ck, layers = converted(family)
    ranks, passed = load_ranks(ck, layers, tp)
    assert passed == [n for n in sorted(ck.tensors) if ck.format.classify(n) is None][:5]  # others unchanged, in order
    for L, lx in layers.items():
        I = lx.w2.shape[2]
        I_r = I // tp
        for r, mods in enumerate(ranks):
            m = mods[L]
            mine = slice(r * I_r, (r + 1) * I_r)
            want_w13 = torch.cat([lx.w13[:, :I][:, mine], lx.w13[:, I:][:, mine]], dim=1)
            want_s13 = torch.cat([lx.w13_scale[:, :I][:, mine], lx.w13_scale[:, I:][:, mine]], dim=1)
            assert torch.equal(m.w13_weight, want_w13)
            assert torch.equal(m.w13_scale, want_s13)
            assert torch.equal(m.w2_weight, lx.w2[:, :, mine])
            assert torch.equal(m.w2_scale, lx.w2_scale)  # the full row, every rank
        # the ranks put together are the whole layer
        cat = lambda k, d, L=L: torch.cat([mods[L].__getattr__(k) for mods in ranks], dim=d)  # noqa: E731
        gate = torch.cat([mods[L].w13_weight[:, :I_r] for mods in ranks], dim=1)
        up = torch.cat([mods[L].w13_weight[:, I_r:] for mods in ranks], dim=1)
        assert torch.equal(torch.cat([gate, up], dim=1), lx.w13)
        assert torch.equal(cat("w2_weight", 2), lx.w2)
        g_s = torch.cat([mods[L].w13_scale[:, :I_r] for mods in ranks], dim=1)
        u_s = torch.cat([mods[L].w13_scale[:, I_r:] for mods in ranks], dim=1)
        assert torch.equal(torch.cat([g_s, u_s], dim=1), lx.w13_scale)


@pytest.mark.parametrize("expert_map", [(-1, -1, 0, 1), (-1, 0, -1, 1), (1, -1, 0, -1)],
                         ids=["linear-rank1", "round-robin-rank1", "permuted"])
def test_expert_parallel_loads_local_experts(expert_map, converted):
    _, ck, layers = converted("qwen3_moe")
    assert ck.num_experts == len(expert_map)
    (mods,), _ = load_ranks(ck, layers, 1, partition_of=lambda r: Partition(expert_map=expert_map))
    for L, lx in layers.items():
        for e, local in enumerate(expert_map):
            if local < 0:
                continue
            assert torch.equal(mods[L].w13_weight[local], lx.w13[e])
            assert torch.equal(mods[L].w2_weight[local], lx.w2[e])
            assert torch.equal(mods[L].w13_scale[local], lx.w13_scale[e])
            assert torch.equal(mods[L].w2_scale[local], lx.w2_scale[e])


def test_expert_parallel_skips_other_ranks_experts(converted):
    _, ck, layers = converted("mixtral")
    L, lx = next(iter(layers.items()))
    m = stand_in(2, lx.w13.shape[2], lx.w2.shape[2])
    loader = LayerLoader(L, params(m), 4, Partition(expert_map=(0, 1, -1, -1)))
    before = m.w13_weight.clone()
    assert loader.load(2, "gate", "codes", lx.matrix(2, "gate")[0], "x") is False
    assert torch.equal(m.w13_weight, before)
    assert loader.load(1, "gate", "codes", lx.matrix(1, "gate")[0], "x") is True
    assert {e for e, _, _ in loader.missing()} == {0, 1}


# --- what vLLM 0.24's online experts_int8 holds: the seed function on vLLM's own w13 / w2 -----------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_equals_online_experts_int8_layout(family, tp, converted):
    """vLLM's loaders build w13 [E, 2I_r, H] per rank from the source (gate rows then up rows; gpt_oss: the source's
    interleaved gate_up columns [2*r*I_r, 2*(r+1)*I_r), i.e. gate/up interleaved) and w2 [E, H, I_r]; the online
    method then quantizes each row. The plugin must hold exactly that: w13 at any TP; w2 at TP=1 (at TP>1 vLLM
    0.24 takes the row absmax over its slice; expq stores full-row scales, as vLLM >= 0.28 uses)."""
    src, ck, layers = converted(family)
    mats = model_expert_matrices(family, load_hf(src, dtype=torch.bfloat16))
    interleaved = family in INTERLEAVED
    ranks, _ = load_ranks(ck, layers, tp, interleaved=interleaved)
    for L in layers:
        for e in range(ck.num_experts):
            gate, up, down = (mats[(L, e, p)] for p in ("gate", "up", "down"))
            I_r = gate.shape[0] // tp
            for r, mods in enumerate(ranks):
                mine = slice(r * I_r, (r + 1) * I_r)
                if interleaved:
                    w13 = torch.stack([gate[mine], up[mine]], dim=1).reshape(2 * I_r, -1)
                else:
                    w13 = torch.cat([gate[mine], up[mine]])
                codes, scales = seed_reference(w13)
                assert torch.equal(mods[L].w13_weight[e], codes), (L, e, r)
                assert torch.equal(mods[L].w13_scale[e], scales.float()), (L, e, r)
                if tp == 1:
                    codes, scales = seed_reference(down)
                    assert torch.equal(mods[L].w2_weight[e], codes)
                    assert torch.equal(mods[L].w2_scale[e], scales.float())


def test_interleaved_rows_are_a_permutation_of_gate_then_up(converted):
    _, ck, layers = converted("gpt_oss")
    (plain,), _ = load_ranks(ck, layers, 1)
    (inter,), _ = load_ranks(ck, layers, 1, interleaved=True)
    for L in layers:
        I = plain[L].w2_weight.shape[2]
        assert torch.equal(inter[L].w13_weight[:, 0::2], plain[L].w13_weight[:, :I])
        assert torch.equal(inter[L].w13_weight[:, 1::2], plain[L].w13_weight[:, I:])
        assert torch.equal(inter[L].w13_scale[:, 1::2], plain[L].w13_scale[:, I:])
        assert not torch.equal(inter[L].w13_weight, plain[L].w13_weight)


# --- negative controls --------------------------------------------------------------------------------------------
def _loaders(ck, layers, tp=1, r=0):
    lx0 = next(iter(layers.values()))
    E, I2, H = lx0.w13.shape
    return {L: LayerLoader(L, params(stand_in(E, H, (I2 // 2) // tp)), E, Partition(tp_rank=r, tp_size=tp),
                           describe=lambda e, p, L=L: ck.experts.module_name(L, e, p)) for L in layers}


@pytest.mark.parametrize("kind", ["codes", "scale"])
def test_missing_expert_piece_is_named(kind, converted):
    _, ck, layers = converted("mixtral")
    L = ck.moe_layers[-1]
    stream = expert_stream(ck, layers, drop=(L, 2, "up", kind))
    with pytest.raises(ExpqError) as ei:
        list(route_weights(stream, classify_for(ck), _loaders(ck, layers)))
    err = ei.value
    assert err.expert == 2 and err.tensor == ck.experts.module_name(L, 2, "up")
    assert f"layer {L}" in str(err) and "up projection" in str(err) and kind in str(err)
    assert "\n" not in str(err)


def test_wrong_shape_names_tensor_and_both_shapes(converted):
    _, ck, layers = converted("qwen3_moe")
    L = ck.moe_layers[0]
    codes, _ = layers[L].matrix(1, "gate")
    name = f"{ck.experts.module_name(L, 1, 'gate')}.weight_int8"
    bad = [(name, codes[:, :-1].clone())]
    with pytest.raises(ExpqError) as ei:
        list(route_weights(bad, classify_for(ck), _loaders(ck, layers, tp=2)))
    msg = str(ei.value)
    I, H = codes.shape
    assert name in msg and f"[{I}, {H - 1}]" in msg and f"[{I}, {H}]" in msg and "w13_weight" in msg
    assert f"[{ck.num_experts}, {I}, {H}]" in msg  # the parameter's own shape (2 * I_r = I at tp 2)


def test_wrong_dtype_and_duplicates_refused(converted):
    _, ck, layers = converted("mixtral")
    L = ck.moe_layers[0]
    codes, scales = layers[L].matrix(0, "down")
    loader = _loaders(ck, layers)[L]
    with pytest.raises(ExpqError, match="int8"):
        loader.load(0, "down", "codes", codes.to(torch.int16), "w2.weight_int8")
    with pytest.raises(ExpqError, match="float32"):
        loader.load(0, "down", "scale", scales.double(), "w2.weight_scale")
    loader.load(0, "down", "scale", scales.to(torch.bfloat16), "w2.weight_scale")  # exact widening accepted
    with pytest.raises(ExpqError, match="twice"):
        loader.load(0, "down", "scale", scales, "w2.weight_scale")


def test_user_text_in_the_plugins_errors_is_one_escaped_line(converted, tmp_path, monkeypatch):
    """What vLLM prints of the plugin's errors (``str``: vLLM has no expq command line to escape it): a checkpoint's
    tensor name and a model path holding a carriage return, a newline and an escape sequence are shown escaped, on
    one line (they were printed raw: a forged log line, a coloured or erased terminal); found by a hostile-user
    pass."""
    import shutil

    _, ck, layers = converted("mixtral")
    L = ck.moe_layers[0]
    codes, _ = layers[L].matrix(0, "down")
    hostile = "w2.weight_int8\r\x1b[2K\nERROR forged"
    with pytest.raises(ExpqError) as ei:
        _loaders(ck, layers)[L].load(0, "down", "codes", codes.to(torch.int16), hostile)
    assert str(ei.value) == "tensor w2.weight_int8\\r\\x1b[2K\\nERROR forged, expert 0: codes must be int8, got " \
                            "torch.int16"
    assert ei.value.tensor == hostile  # the attribute keeps the name itself, for callers that act on it
    path = tmp_path / "ckpt\nERROR forged\x1b[31m"
    shutil.copytree(ck.root, path)
    monkeypatch.setattr(plugin, "QUANT_METHOD", "another_method")  # served as a method the checkpoint is not
    with pytest.raises(ExpqError) as ei:
        list(plugin.routed_weights(iter([("model.embed_tokens.weight", torch.zeros(2))]),
                                   SimpleNamespace(model=str(path), dtype=torch.bfloat16), None))
    assert str(ei.value).startswith(f"{tmp_path}/ckpt\\nERROR forged\\x1b[31m is served as another_method but its "
                                    "format is experts-int8"), str(ei.value)


def test_intermediate_not_divisible_by_tp(converted):
    _, ck, layers = converted("dbrx")
    L = ck.moe_layers[0]
    I = layers[L].w2.shape[2]
    tp = 5
    assert I % tp
    loader = _loaders(ck, layers, tp=tp)[L]
    for proj, kind in (("gate", "codes"), ("up", "scale"), ("down", "codes")):
        t = layers[L].matrix(0, proj)[kind == "scale"]
        with pytest.raises(ExpqError, match=f"intermediate size {I} is not divisible by the tensor-parallel size 5"):
            loader.load(0, proj, kind, t, f"t.{kind}")
    with pytest.raises(ExpqError, match="not divisible"):
        per_rank(I, tp)
    assert per_rank(I, 2) == I // 2


# --- the plugin's routing over stand-in vLLM modules (the vLLM classes replaced by these) -------------------------
class FakeRoutedExperts(torch.nn.Module):
    def __init__(self, E, H, I, tp_rank, tp_size, expert_map=None, activation="silu"):
        super().__init__()
        E_local = E if expert_map is None else sum(x >= 0 for x in expert_map)
        for k, v in params(stand_in(E_local, H, I // tp_size)).items():
            setattr(self, k, torch.nn.Parameter(v, requires_grad=False))
        self.global_num_experts = E
        self.activation = activation
        self.moe_config = SimpleNamespace(tp_rank=tp_rank, moe_parallel_config=SimpleNamespace(tp_size=tp_size))
        self._map = expert_map
        self.quant_method = FakeMethod()

    def _map_global_expert_id_to_local_expert_id(self, e):
        return e if self._map is None else self._map[e]


class FakeMethod:
    loader = None


FAKE_API = SimpleNamespace(RoutedExperts=FakeRoutedExperts, MoEActivation=SimpleNamespace(SWIGLUOAI="swigluoai"))


def fake_vllm_model(ck, layers, tp_rank=0, tp_size=1, expert_map=None, activation="silu", extra_layer=None):
    lx0 = next(iter(layers.values()))
    E, I2, H = lx0.w13.shape
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    setattr(root.model, ck.layout.layers, torch.nn.ModuleList())
    stack = getattr(root.model, ck.layout.layers)
    for L in range(max(ck.moe_layers) + 1):
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        if L in layers or L == extra_layer:
            block.mlp.experts = torch.nn.Module()
            block.mlp.experts.routed_experts = FakeRoutedExperts(E, H, I2 // 2, tp_rank, tp_size, expert_map,
                                                                 activation)
        stack.append(block)
    return root


@pytest.mark.parametrize("family,tp,activation", [("mixtral", 2, "silu"), ("gpt_oss", 2, "swigluoai"),
                                                  ("dbrx", 1, "silu")])
def test_plugin_routing_fills_every_layer(family, tp, activation, converted):
    _, ck, layers = converted(family)
    for r in range(tp):
        model = fake_vllm_model(ck, layers, r, tp, activation=activation)
        loaders = plugin.attach_loaders(model, ck, api=FAKE_API, method_cls=FakeMethod)
        assert sorted(loaders) == ck.moe_layers
        mods = {L: getattr(model.model, ck.layout.layers)[L].mlp.experts.routed_experts for L in layers}
        assert all(mods[L].quant_method.loader is loaders[L] for L in layers)
        assert loaders[ck.moe_layers[0]].partition.interleaved == (activation == "swigluoai")
        list(route_weights(expert_stream(ck, layers), classify_for(ck), loaders))
        for L, lx in layers.items():
            I = lx.w2.shape[2]
            I_r = I // tp
            mine = slice(r * I_r, (r + 1) * I_r)
            w13 = mods[L].w13_weight
            gate, up = (w13[:, 0::2], w13[:, 1::2]) if activation == "swigluoai" else (w13[:, :I_r], w13[:, I_r:])
            assert torch.equal(gate, lx.w13[:, :I][:, mine]) and torch.equal(up, lx.w13[:, I:][:, mine])
            assert torch.equal(mods[L].w2_weight, lx.w2[:, :, mine])
            assert torch.equal(mods[L].w2_scale, lx.w2_scale)


def test_plugin_routing_expert_parallel(converted):
    _, ck, layers = converted("qwen3_moe")
    emap = (-1, -1, 0, 1)
    model = fake_vllm_model(ck, layers, expert_map=emap)
    loaders = plugin.attach_loaders(model, ck, api=FAKE_API, method_cls=FakeMethod)
    assert loaders[ck.moe_layers[0]].partition.expert_map == emap
    list(route_weights(expert_stream(ck, layers), classify_for(ck), loaders))
    for L, lx in layers.items():
        m = getattr(model.model, ck.layout.layers)[L].mlp.experts.routed_experts
        assert torch.equal(m.w13_weight, lx.w13[2:]) and torch.equal(m.w2_scale, lx.w2_scale[2:])


def test_plugin_refuses_a_layer_the_checkpoint_does_not_quantize(converted):
    _, ck, layers = converted("qwen3_moe")
    model = fake_vllm_model(ck, layers)
    model.model.layers.append(torch.nn.Module())
    model.model.layers[-1].experts = FakeRoutedExperts(4, 64, 48, 0, 1)
    extra = len(model.model.layers) - 1
    with pytest.raises(ExpqError, match=f"layer {extra} is not one of the checkpoint's"):
        plugin.attach_loaders(model, ck, api=FAKE_API, method_cls=FakeMethod)


# --- packaging, import without vLLM, clear errors for a vLLM without the internals --------------------------------
def test_entry_point_and_extra_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["entry-points"]["vllm.general_plugins"] == {"expq": "expq.engines.vllm:register"}
    assert meta["optional-dependencies"]["vllm"] == ["vllm>=0.24,<0.34"]
    from expq.engines.vllm_compat import TESTED_RANGE

    assert TESTED_RANGE == ("0.24", "0.33")  # the range the extra allows
    mod, _, fn = meta["entry-points"]["vllm.general_plugins"]["expq"].partition(":")
    assert callable(getattr(__import__(mod, fromlist=[fn]), fn))


class _NoVllm:
    """A meta-path finder that fails any import of vllm."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise AssertionError(f"{name} imported")
        return None


def test_import_never_imports_vllm():
    """Fresh imports of expq, its engines and the modules they use, with vllm imports made to fail (also where vLLM
    is installed and another test imported it: its modules are taken out of sys.modules meanwhile)."""
    ours = lambda k: k in ("expq", "vllm") or k.startswith(("expq.", "vllm."))  # noqa: E731
    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.meta_path.insert(0, blocker := _NoVllm())
    try:
        import expq.api  # noqa: F401
        import expq.checkpoint  # noqa: F401
        import expq.engines.moe_loading  # noqa: F401
        import expq.engines.vllm as fresh

        assert fresh is not plugin and fresh.QUANT_METHOD == "expq_experts_int8"
        assert not any(k == "vllm" or k.startswith("vllm.") for k in sys.modules)
    finally:
        sys.meta_path.remove(blocker)
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here")
def test_register_without_vllm_says_so():
    with pytest.raises(ExpqError, match=r"needs vLLM, which is not installed \(pip install 'expq\[vllm\]'\)"):
        plugin.register()
    # the classes register() would publish do not exist, as attributes that are missing: probing them is safe
    assert not hasattr(plugin, "ExpqExpertsInt8Config") and getattr(plugin, "ExpqInt8MoEMethod", None) is None
    with pytest.raises(ImportError, match="ExpqExpertsInt8Config"):
        from expq.engines.vllm import ExpqExpertsInt8Config  # noqa: F401


@pytest.fixture
def fake_vllm(monkeypatch):
    """A 'vllm' 0.99.0 with a quantization registry but none of the fused-MoE internals."""
    if VLLM_INSTALLED:
        pytest.skip("vLLM is installed here")
    registered = {}

    class QuantizationConfig:
        def __init__(self):
            pass

    def register_quantization_config(name):
        def wrap(cls):
            registered[name] = cls
            return cls
        return wrap

    mods = {"vllm": types.ModuleType("vllm"), "vllm.model_executor": types.ModuleType("vllm.model_executor"),
            "vllm.model_executor.layers": types.ModuleType("vllm.model_executor.layers"),
            "vllm.model_executor.layers.quantization": types.ModuleType("q"),
            "vllm.model_executor.layers.quantization.base_config": types.ModuleType("b")}
    mods["vllm"].__version__ = "0.99.0"
    mods["vllm.model_executor.layers.quantization"].register_quantization_config = register_quantization_config
    mods["vllm.model_executor.layers.quantization.base_config"].QuantizationConfig = QuantizationConfig
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    monkeypatch.setattr(plugin, "_STATE", {})
    published = {n: vars(plugin)[n] for n in plugin._PUBLISHED if n in vars(plugin)}
    yield registered
    for n in plugin._PUBLISHED:  # the classes register() published for the stand-in vLLM go with it
        vars(plugin).pop(n, None)
    vars(plugin).update(published)


def test_missing_internals_named_with_version(fake_vllm):
    with pytest.raises(ExpqError) as ei:
        plugin.vllm_api()
    msg = str(ei.value)
    assert "vLLM 0.99.0" in msg and "vllm.model_executor.layers.fused_moe.RoutedExperts" in msg
    assert "Int8OnlineMoEMethod._setup_kernel" in msg and "DefaultModelLoader.get_all_weights" in msg
    assert "register_quantization_config" not in msg and "\n" not in msg


def test_register_on_unsupported_vllm_refuses_only_expq_checkpoints(fake_vllm):
    plugin.register()  # must not raise: vLLM calls plugins for every model it serves
    plugin.register()  # idempotent
    cls = fake_vllm[plugin.QUANT_METHOD]
    with pytest.raises(ExpqError, match="vLLM 0.99.0 lacks"):
        cls.from_config({"quant_method": plugin.QUANT_METHOD})
    # a process that unpickles the working plugin's config on this vLLM is told why the class is missing
    with pytest.raises(AttributeError, match="'ExpqExpertsInt8Config': vLLM 0.99.0 lacks"):
        _ = plugin.ExpqExpertsInt8Config


def test_dtype_other_than_the_conversion_is_warned(converted, caplog):
    _, ck, _ = converted("mixtral")
    assert ck.manifest.options.dtype == "bfloat16"
    with caplog.at_level("WARNING", logger=plugin.LOGGER):
        plugin._warn_dtype(ck, SimpleNamespace(model="m", dtype=torch.bfloat16))
        assert not caplog.records
        plugin._warn_dtype(ck, SimpleNamespace(model="m", dtype=torch.float16))
    assert "converted in bfloat16 but is served in float16" in caplog.text


def test_a_model_path_is_shown_escaped_in_vllms_log(converted, tmp_path, monkeypatch, vllm_logging):
    """A checkpoint directory whose name holds a newline and an escape sequence, served in another dtype: the
    plugin's warning is one line of vLLM's log, the path escaped (no forged line, no colour)."""
    import shutil

    _, ck, _ = converted("mixtral")
    path = tmp_path / "ckpt\nWARNING forged\x1b[31m"
    shutil.copytree(ck.root, path)
    monkeypatch.setattr(plugin, "attach_loaders", lambda model, ck: {})  # no vLLM model: the warning is the point
    weights = [("model.embed_tokens.weight", torch.zeros(2))]
    model_config = SimpleNamespace(model=str(path), dtype=torch.float16)
    assert [n for n, _ in plugin.routed_weights(iter(weights), model_config, None)] == ["model.embed_tokens.weight"]
    assert vllm_logging.expq_lines() == [
        f"vllm-format WARNING {tmp_path}/ckpt\\nWARNING forged\\x1b[31m was converted in bfloat16 but is served in "
        "float16: outputs will differ from online experts_int8 in float16 (serve with --dtype bfloat16)"]


@pytest.mark.parametrize("shards", [1, 3], ids=["one-file", "indexed"])
def test_checkpoint_dir_of_a_hub_repo(shards, tmp_path, monkeypatch):
    """`vllm serve <repo id>`: the plugin opens the checkpoint from the Hub cache. A one-file checkpoint has no
    index, so its shard's header is what names the layers (a snapshot of the JSON files alone cannot be opened)."""
    import hub_server as hs

    import expq
    from expq.demo import DEMO_CONFIG
    from expq.examples import build_example

    src = build_example("mixtral", tmp_path / "src", **DEMO_CONFIG)
    out = tmp_path / "out"
    expq.convert(src, out, format="experts-int8", device="cpu", max_shard_size="40MB" if shards == 1 else "4MB")
    assert (out / "model.safetensors.index.json").exists() == (shards > 1)
    with hs.HubServer(tmp_path / "hub") as server:
        hs.configure_hf_client(monkeypatch, server.url, tmp_path / "hf-home", server.token)
        expq.push(out, "me/demo-int8", device="cpu")
        local = plugin.checkpoint_dir(SimpleNamespace(model="me/demo-int8", revision=None))
        ck = ConvertedCheckpoint(local)
        assert ck.moe_layers == ConvertedCheckpoint(out).moe_layers == [0, 1, 2, 3]
        assert ck.num_experts == 8 and ck.tensors == ConvertedCheckpoint(out).tensors


# --- a stand-in vLLM package per release (its constructor and online int8 method as that release has them) -----------
def int8_module(ctor: str = "layer", scale: str = "scale", divisor: str = "vmax") -> str:
    """``vllm/model_executor/layers/quantization/online/int8.py`` of a stand-in vLLM: ``Int8OnlineMoEMethod`` whose
    constructor takes ``ctor`` (0.24-0.29: ``layer``; 0.30-0.33: ``moe``) and whose ``_quantize_weights`` is vLLM's
    (scales named ``w13_<scale>``; ``divisor`` of the row max)."""
    moe = "layer.moe_config" if ctor == "layer" else ctor
    return f"""import types
import torch


class Int8OnlineMoEMethod:
    def __init__(self, *, {ctor}):
        self.moe = types.SimpleNamespace(has_bias=False, tp_size=1, source={moe})

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        pass

    def process_weights_after_loading(self, layer):
        pass

    def _quantize_weights(self, layer):
        vmax = torch.iinfo(torch.int8).max
        for w in ("w13", "w2"):
            t = getattr(layer, w + "_weight")
            scales = t.abs().amax(dim=2) / {divisor}
            q = t.div(scales.unsqueeze(2)).round().clamp(-vmax, vmax).to(torch.int8)
            setattr(layer, w + "_weight", torch.nn.Parameter(q, requires_grad=False))
            layer.register_parameter(w + "_{scale}", torch.nn.Parameter(scales.float(), requires_grad=False))

    def _setup_kernel(self, layer):
        pass
"""


def stand_in_vllm(version: str, **int8) -> dict[str, str]:
    """The stand-in package's files (path -> text)."""
    return {
        "vllm/__init__.py": f"__version__ = '{version}'\n",
        "vllm/model_executor/__init__.py": "",
        "vllm/model_executor/utils.py": "def set_weight_attrs(weight, weight_attrs):\n"
                                        "    for k, v in weight_attrs.items():\n        setattr(weight, k, v)\n",
        "vllm/model_executor/layers/__init__.py": "",
        "vllm/model_executor/layers/linear.py": "class LinearBase:\n    pass\n\n\nclass UnquantizedLinearMethod:\n"
                                                "    pass\n",
        "vllm/model_executor/layers/fused_moe/__init__.py":
            "import types\n\n\nclass RoutedExperts:\n    def __init__(self):\n"
            "        self.moe_config = types.SimpleNamespace(name='moe_config')\n\n"
            "    def _map_global_expert_id_to_local_expert_id(self, expert_id):\n        return expert_id\n",
        "vllm/model_executor/layers/fused_moe/activation.py": "class MoEActivation:\n    SWIGLUOAI = 'swigluoai'\n",
        "vllm/model_executor/layers/quantization/__init__.py":
            "REGISTRY = {}\n\n\ndef register_quantization_config(quantization):\n    def wrap(cls):\n"
            "        REGISTRY[quantization] = cls\n        return cls\n    return wrap\n",
        "vllm/model_executor/layers/quantization/base_config.py":
            "class QuantizationConfig:\n    def __init__(self):\n        pass\n",
        "vllm/model_executor/layers/quantization/online/__init__.py": "",
        "vllm/model_executor/layers/quantization/online/int8.py": int8_module(**int8),
        "vllm/model_executor/model_loader/__init__.py": "",
        "vllm/model_executor/model_loader/default_loader.py":
            "class DefaultModelLoader:\n    def get_all_weights(self, model_config, model):\n        return iter(())\n",
    }


def write_stand_in(root: Path, version: str, **int8) -> dict[str, str]:
    """Write the stand-in under ``root``; the environment that puts it (and expq) first on the path."""
    import os

    for rel, text in stand_in_vllm(version, **int8).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT)]))


REGISTER_AND_BUILD = """
import sys
import expq.engines.vllm as plugin
from vllm.model_executor.layers.quantization import REGISTRY
from vllm.model_executor.layers.fused_moe import RoutedExperts
plugin.register()
try:
    cfg = REGISTRY[plugin.QUANT_METHOD].from_config({"quant_method": plugin.QUANT_METHOD})
    method = cfg.get_quant_method(RoutedExperts(), "model.layers.0.mlp.experts")
    print("METHOD", type(method).__name__, method.moe.source)
except Exception as e:
    print("REFUSED", type(e).__name__, e)
"""


@pytest.mark.parametrize("version,int8,outcome", [
    ("0.24.0", {"ctor": "layer"}, "METHOD ExpqInt8MoEMethod namespace(name='moe_config')"),
    ("0.30.0", {"ctor": "moe"}, "METHOD ExpqInt8MoEMethod namespace(name='moe_config')"),
    ("0.34.0", {"ctor": "config"}, "REFUSED ExpqError vLLM 0.34.0 changed what the expq plugin uses (tested with "
                                   "vLLM 0.24-0.33): Int8OnlineMoEMethod.__init__ takes (*, config); the plugin "
                                   "knows (*, layer) (vLLM 0.24-0.29) or (*, moe) (vLLM 0.30-0.33)"),
    ("0.35.0", {"ctor": "moe", "scale": "weight_scale"},
     "REFUSED ExpqError vLLM 0.35.0 changed what the expq plugin uses (tested with vLLM 0.24-0.33): the online int8 "
     "method now holds w13_weight int8 [2, 16, 12], w13_weight_scale float32 [2, 16], w2_weight int8 [2, 12, 8], "
     "w2_weight_scale float32 [2, 12]; the plugin fills w13_scale float32 [2, 16], w13_weight int8 [2, 16, 12], "
     "w2_scale float32 [2, 12], w2_weight int8 [2, 12, 8]"),
], ids=["0.24-layer", "0.30-moe", "constructor-changed", "parameters-renamed"])
def test_constructor_and_behaviour_per_release(version, int8, outcome, tmp_path):
    """The plugin builds its method with the constructor each release has (a stand-in modelled on 0.24 alone let
    the 0.30 break pass), and a vLLM whose constructor or online int8 parameters changed gets one line naming its
    version and what changed, from the config vLLM would load (vLLM itself keeps serving other models)."""
    import subprocess

    env = write_stand_in(tmp_path, version, **int8)
    r = subprocess.run([sys.executable, "-c", REGISTER_AND_BUILD], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == outcome + (
        " (install a vLLM the plugin supports: pip install 'vllm>=0.24,<0.34')" if "REFUSED" in outcome else "")


def test_online_arithmetic_change_is_warned_not_refused(tmp_path):
    """A vLLM whose online experts_int8 rounds differently (here absmax / 127.5) still serves the checkpoint's
    codes; the plugin says that outputs will differ from that vLLM's --quantization experts_int8."""
    import subprocess

    env = write_stand_in(tmp_path, "0.36.0", ctor="moe", divisor="127.5")
    r = subprocess.run([sys.executable, "-c", REGISTER_AND_BUILD], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith("METHOD ExpqInt8MoEMethod")
    assert ("this vLLM's online experts_int8 quantizes w13 and w2 differently from expq's scheme: outputs will "
            "differ from --quantization experts_int8") in r.stderr


# --- a spawned engine process (vllm serve): the quantization config crosses processes by pickling ------------------
PICKLE_IN_PARENT = """
import pickle, sys
import expq.engines.vllm as plugin
from vllm.model_executor.layers.quantization import REGISTRY
plugin.register()
cfg = REGISTRY[plugin.QUANT_METHOD].from_config({"quant_method": plugin.QUANT_METHOD})
open(sys.argv[1], "wb").write(pickle.dumps(cfg))
"""

UNPICKLE_IN_ENGINE = """
import pickle, sys
from types import SimpleNamespace
cfg = pickle.loads(open(sys.argv[1], "rb").read())  # before anything registered the plugin in this process
import expq.engines.vllm as plugin
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
print("CLASS", type(cfg) is plugin.ExpqExpertsInt8Config)
layer = RoutedExperts()
layer.layer_name = "model.layers.0.mlp.experts"
method = cfg.get_quant_method(layer, "model.layers.0.mlp.experts")
print("METHOD", type(method) is plugin.ExpqInt8MoEMethod)
DefaultModelLoader().get_all_weights(SimpleNamespace(quantization="fp8"), None)  # the engine's own loader call
try:
    method.process_weights_after_loading(layer)
except Exception as e:
    print("ERROR", e)
"""


# the second constructor's variant in the slow tier (make test-slow): both constructors are built in make test by
# test_constructor_and_behaviour_per_release
@pytest.mark.parametrize("version,ctor", [pytest.param("0.24.0", "layer", marks=pytest.mark.slow), ("0.30.0", "moe")])
def test_config_pickled_into_a_spawned_engine_shares_the_plugin_state(version, ctor, tmp_path):
    """`vllm serve` spawns its engine core and sends it the VllmConfig by pickling (cloudpickle): the config and
    method classes must travel by name, so that the engine's copy is the class its own registration made and reads
    the routing state that its own loader writes (a class sent by value saw a stale copy of that state: 'the default
    loader never ran'). Two fresh interpreters over a stand-in vLLM package."""
    import subprocess

    env = write_stand_in(tmp_path, version, ctor=ctor)
    blob = tmp_path / "config.pickle"
    for code in (PICKLE_IN_PARENT, UNPICKLE_IN_ENGINE):
        r = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[:2] == ["CLASS True", "METHOD True"], r.stdout
    assert lines[2] == ("ERROR model.layers.0.mlp.experts: no expq expert tensor was loaded: the default loader ran "
                        "for quantization 'fp8', not 'expq_experts_int8' (serve without --quantization: the "
                        "checkpoint's quantization_config names the method)"), r.stdout
