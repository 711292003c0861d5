"""The vLLM plugin's kernel choice (expq/engines/vllm_kernel.py, EXPQ_VLLM_KERNEL) over stand-in vLLM classes: the
variable's values, the plugin's own MoE method (``expq.engines.vllm._method_class``) loading and applying a layer
with expq's kernel (Triton's interpreter, fp16/fp32) against the fp32 reference for every activation, with
tensor-parallel slices and expert-parallel maps summed over ranks, and its fallback to vLLM's kernel with one log
line per reason; the plugin's and the kernels' lines in vLLM's log (stand-in handler), user text escaped. Real vLLM
runs these paths on the GPU (bench/serve.py, bench/vllm_compare.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_kernels import REL_BOUND, TOKEN_BOUND, assert_close_to_reference, errors, make_problem

from expq.engines import vllm as plugin
from expq.engines import vllm_kernel
from expq.errors import ExpqError
from expq.kernels import moe_reference

VLLM_RESULT = object()  # what the stand-in vLLM kernel returns: the test sees which kernel ran


class MoEPrepareAndFinalizeNoDPEPModular:
    """Named as vLLM's prepare/finalize without data/expert-parallel dispatch (the only one expq replaces)."""


class MoEPrepareAndFinalizeNaiveDPEPModular:
    """Named as one of vLLM's dispatching prepare/finalize classes."""


class StandInInt8OnlineMoEMethod:
    """The surface of vLLM's Int8OnlineMoEMethod the plugin uses (0.24: ``__init__(*, layer)``, 0.30+: ``moe=``):
    ``_setup_kernel`` builds the modular kernel (its prepare/finalize and shared-expert overlap, the quant config
    with no clamps), ``apply`` runs it; here it records the call and returns VLLM_RESULT."""

    is_monolithic = False

    def __init__(self, *, layer=None, moe=None):
        self.moe = SimpleNamespace(has_bias=False)
        self.moe_kernel = None
        self.moe_quant_config = None
        self.vllm_calls = 0

    def _setup_kernel(self, layer):
        self.moe_quant_config = SimpleNamespace(gemm1_clamp_limit=None, gemm1_alpha=None, gemm1_beta=None)
        self.moe_kernel = SimpleNamespace(prepare_finalize=MoEPrepareAndFinalizeNoDPEPModular(),
                                          can_overlap_shared_experts=False)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        self.vllm_calls += 1
        return VLLM_RESULT


METHOD = plugin._method_class(SimpleNamespace(Int8OnlineMoEMethod=StandInInt8OnlineMoEMethod, ctor="layer",
                                              set_weight_attrs=lambda p, attrs: None))


def vllm_layer(w13, w2, s13, s2, *, activation="silu", b13=None, b2=None, expert_map=None, on_input=False,
               global_experts=None, name="model.layers.0.mlp.experts", top_k=2, dtype=torch.float16):
    """A stand-in RoutedExperts holding one rank's tensors as vLLM holds them (activation as a MoEActivation;
    ``top_k`` and ``orig_dtype``, the activations' dtype, as vLLM's layer says them)."""
    layer = torch.nn.Module()
    layer.top_k, layer.orig_dtype = top_k, dtype
    for k, v in (("w13_weight", w13), ("w2_weight", w2), ("w13_scale", s13), ("w2_scale", s2), ("w13_bias", b13),
                 ("w2_bias", b2)):
        if v is not None:
            layer.register_parameter(k, torch.nn.Parameter(v.clone(), requires_grad=False))
    layer.activation = SimpleNamespace(value=activation)
    layer.expert_map = expert_map
    layer.apply_router_weight_on_input = on_input
    layer.global_num_experts = global_experts or w13.shape[0]
    layer.layer_name = name
    return layer


def loaded_method(layer, monkeypatch, kernel="expq", *, setup=None):
    """The plugin's method for ``layer`` after vLLM loaded it (EXPQ_VLLM_KERNEL=kernel; None: unset)."""
    if kernel is None:
        monkeypatch.delenv(vllm_kernel.ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_kernel.ENV, kernel)
    method = METHOD(layer=layer)
    method.loader = SimpleNamespace(check_complete=lambda: None)
    if setup is not None:
        real = method._setup_kernel

        def patched(layer):
            real(layer)
            setup(method)
        method._setup_kernel = patched
    method.process_weights_after_loading(layer)
    return method


def apply(method, layer, x, tw, ti):
    return method.apply(layer=layer, x=x, topk_weights=tw, topk_ids=ti, shared_experts=None,
                        shared_experts_input=None)


@pytest.fixture
def interpret(monkeypatch):
    """CPU tensors through Triton's interpreter; every test starts with no reason logged yet."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(vllm_kernel, "_LOGGED", set())
    monkeypatch.setattr(vllm_kernel, "_WARMED", set())


def interleave(t, i):
    """[gate | up] rows (dim 1) -> gate/up interleaved (vLLM's layout for swigluoai)."""
    return torch.stack([t[:, :i], t[:, i:]], dim=2).reshape(t.shape[0], 2 * i, *t.shape[2:])


# --- the variable -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,want", [(None, "vllm"), ("", "vllm"), ("  ", "vllm"), ("expq", "expq"),
                                      (" EXPQ ", "expq"), ("vllm", "vllm"), ("VLLM", "vllm")])
def test_kernel_choice_values(raw, want):
    env = {} if raw is None else {vllm_kernel.ENV: raw}
    assert vllm_kernel.kernel_choice(env) == want
    assert vllm_kernel.DEFAULT == "vllm"


@pytest.mark.parametrize("raw", ["triton", "expq,vllm", "1"])
def test_unknown_value_is_one_line(raw, interpret, monkeypatch):
    with pytest.raises(ExpqError) as ei:
        vllm_kernel.kernel_choice({vllm_kernel.ENV: raw})
    msg = str(ei.value)
    assert f"EXPQ_VLLM_KERNEL={raw!r}: expected one of expq, vllm (default vllm)" in msg and "\n" not in msg
    args, _ = make_problem(dtype=torch.float16)
    layer = vllm_layer(*args[1:5])
    with pytest.raises(ExpqError, match="EXPQ_VLLM_KERNEL="):  # the model load stops there
        loaded_method(layer, monkeypatch, raw)


def test_default_runs_vllms_kernel(interpret, monkeypatch, caplog):
    args, _ = make_problem(t=5, dtype=torch.float16)
    layer = vllm_layer(*args[1:5])
    with caplog.at_level("INFO", logger=plugin.LOGGER):
        method = loaded_method(layer, monkeypatch, None)
    assert method.expq_experts is None and not caplog.records
    assert apply(method, layer, args[0], args[5], args[6]) is VLLM_RESULT and method.vllm_calls == 1


def test_plugin_lines_reach_vllms_log(interpret, monkeypatch, vllm_logging):
    args, _ = make_problem(t=5, dtype=torch.float16, seed=77)
    loaded_method(vllm_layer(*args[1:5], name="m.layers.0.moe"), monkeypatch)
    assert vllm_logging.expq_lines() == [
        "vllm-format INFO EXPQ_VLLM_KERNEL=expq: the routed experts run expq's fused-MoE kernel (m.layers.0.moe and "
        "the others)",
        f"vllm-format INFO expq's kernel warmed up for steps of 1 to {vllm_kernel.max_batched_tokens()} tokens (2 step "
        "sizes run, one per kernel "
        "variant) on m.layers.0.moe and the layers like it"]


def test_plugin_lines_show_user_text_escaped(interpret, monkeypatch, vllm_logging):
    """A layer name with a newline and an escape sequence: one line in vLLM's log each, shown escaped (no forged
    line, no colour)."""
    args, _ = make_problem(t=5, dtype=torch.float16, seed=77)
    loaded_method(vllm_layer(*args[1:5], name="m.layers.0.moe\nINFO forged\x1b[31m"), monkeypatch)
    name = "m.layers.0.moe\\nINFO forged\\x1b[31m"
    assert vllm_logging.expq_lines() == [
        f"vllm-format INFO EXPQ_VLLM_KERNEL=expq: the routed experts run expq's fused-MoE kernel ({name} and the "
        "others)",
        f"vllm-format INFO expq's kernel warmed up for steps of 1 to {vllm_kernel.max_batched_tokens()} tokens (2 step "
        f"sizes run, one per kernel variant) on {name} and the layers like it"]


def test_kernel_table_warning_reaches_vllms_log(tmp_path, monkeypatch, vllm_logging):
    """An unusable tuned table, read by expq's kernel in a vLLM process: one warning in vLLM's log (the kernels'
    logger is a child of the plugin's), its path's control characters escaped."""
    from expq.kernels import moe, tuned

    assert tuned.LOGGER.startswith(vllm_kernel.LOGGER + ".")
    folder = tmp_path / "tables\n\x1b[31m"
    folder.mkdir()
    (folder / "NVIDIA_H200.json").write_text("[]")
    monkeypatch.setenv(tuned.ENV, str(folder))
    monkeypatch.setattr(tuned, "_GPU_NAMES", {None: "NVIDIA H200"})
    tuned.clear_cache()
    for t in (1, 8):
        moe.get_config(t, 8, 2, "cuda", hidden_size=64, intermediate_size=32, dtype=torch.bfloat16)
    tuned.clear_cache()
    assert vllm_logging.expq_lines() == [
        f"vllm-format WARNING expq: ignoring the kernel config table {tmp_path}/tables\\n\\x1b[31m/NVIDIA_H200.json: "
        "not an expq-moe-configs/1 table"]


# --- expq's kernel through the plugin's apply --------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
@pytest.mark.parametrize("activation,bias,dtype", [("silu", False, torch.float16), ("gelu", True, torch.float16),
                                                   ("gelu_tanh", False, torch.float32),
                                                   ("swigluoai", True, torch.float16)])
def test_expq_kernel_serves_the_layer(activation, bias, dtype, interpret, monkeypatch, caplog):
    args, kw = make_problem(t=13, top_k=2, dtype=dtype, seed=70, bias=bias)
    x, w13, w2, s13, s2, tw, ti = args
    I = w2.shape[2]
    stored = (w13, s13, kw.get("w13_bias"))
    if activation in vllm_kernel.INTERLEAVED:  # as the plugin's loader fills the layer for vLLM's swigluoai
        stored = tuple(None if t is None else interleave(t, I) for t in stored)
    layer = vllm_layer(stored[0], w2, stored[1], s2, activation=activation, b13=stored[2], b2=kw.get("w2_bias"),
                       dtype=dtype)
    with caplog.at_level("INFO", logger=plugin.LOGGER):
        method = loaded_method(layer, monkeypatch)
    assert method.expq_experts is not None
    assert [r.getMessage() for r in caplog.records] == [
        "EXPQ_VLLM_KERNEL=expq: the routed experts run expq's fused-MoE kernel (model.layers.0.mlp.experts and the "
        "others)",
        f"expq's kernel warmed up for steps of 1 to {vllm_kernel.max_batched_tokens()} tokens (2 step sizes run, one "
        "per kernel variant) on "
        "model.layers.0.mlp.experts and the layers like it"]
    assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w13_scale, s13)  # gate rows then up rows
    out = apply(method, layer, x, tw, ti)
    assert method.vllm_calls == 0 and out.dtype == dtype
    ref = moe_reference(*args, **kw, activation=activation)
    assert_close_to_reference(out, ref, dtype, activation)
    assert torch.equal(out, torch.ops.expq.fused_moe_int8(*args, kw.get("w13_bias"), kw.get("w2_bias"), None,
                                                           activation, False, "triton"))
    if activation in vllm_kernel.INTERLEAVED:  # negative control: the interleaved rows read as gate-then-up
        bad = moe_reference(x, stored[0], w2, stored[1], s2, tw, ti, w13_bias=stored[2], w2_bias=kw["w2_bias"],
                            activation=activation)
        assert errors(out, bad)[0] > 20 * REL_BOUND[dtype]


def tp_slices(args, kw, tp):
    """Per rank, the layer's tensors as the plugin loads them: gate and up rows r*I_r.., w2 columns r*I_r.., w2
    scales full rows; w2's bias on rank 0 only (the sum over ranks adds it once)."""
    _, w13, w2, s13, s2, _, _ = args
    I = w2.shape[2]
    I_r = I // tp
    for r in range(tp):
        rows = torch.cat([torch.arange(r * I_r, (r + 1) * I_r), I + torch.arange(r * I_r, (r + 1) * I_r)])
        cols = slice(r * I_r, (r + 1) * I_r)
        b13 = kw.get("w13_bias")
        b2 = kw.get("w2_bias")
        yield (w13[:, rows], w2[:, :, cols], s13[:, rows], s2, None if b13 is None else b13[:, rows],
               None if b2 is None else (b2 if r == 0 else torch.zeros_like(b2)))


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
def test_tensor_parallel_ranks_sum_to_the_layer(interpret, monkeypatch):
    args, kw = make_problem(t=11, top_k=2, dtype=torch.float32, seed=71, bias=True)
    ref = moe_reference(*args, **kw)
    total = 0
    for w13, w2, s13, s2, b13, b2 in tp_slices(args, kw, 2):
        layer = vllm_layer(w13, w2, s13, s2, b13=b13, b2=b2, dtype=torch.float32)
        total = total + apply(loaded_method(layer, monkeypatch), layer, args[0], args[5], args[6])
    rel, token = errors(total, ref)
    assert rel <= REL_BOUND[torch.float32] and token <= TOKEN_BOUND[torch.float32]


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
@pytest.mark.parametrize("placement", ["linear", "round-robin"])
def test_expert_parallel_ranks_sum_to_the_layer(placement, interpret, monkeypatch):
    """vLLM's router gives global ids; each rank's layer has its expert_map; the ranks' outputs add up."""
    E = 6
    args, kw = make_problem(e=E, t=15, top_k=2, dtype=torch.float16, seed=72, bias=True)
    x, w13, w2, s13, s2, tw, ti = args
    owner = [g * 2 // E if placement == "linear" else g % 2 for g in range(E)]
    total = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(2):
        held = [g for g in range(E) if owner[g] == r]
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[held] = torch.arange(len(held), dtype=torch.int32)
        layer = vllm_layer(w13[held], w2[held], s13[held], s2[held], b13=kw["w13_bias"][held],
                           b2=kw["w2_bias"][held], expert_map=emap, global_experts=E)
        out = apply(loaded_method(layer, monkeypatch), layer, x, tw, ti)
        mine = torch.isin(ti, torch.tensor(held))
        assert_close_to_reference(out, moe_reference(x, w13, w2, s13, s2, tw * mine, ti, **kw), torch.float16,
                                  f"rank {r}")
        total += out.float()
    rel, _ = errors(total, moe_reference(*args, **kw))
    assert rel <= 2 * REL_BOUND[torch.float16]


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
def test_router_weight_on_input(interpret, monkeypatch):
    args, _ = make_problem(t=9, top_k=1, dtype=torch.float16, seed=73)
    layer = vllm_layer(*args[1:5], on_input=True, top_k=1)
    out = apply(loaded_method(layer, monkeypatch), layer, args[0], args[5], args[6])
    assert_close_to_reference(out, moe_reference(*args, apply_router_weight_on_input=True), torch.float16,
                              "on input")


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
def test_warm_up_once_per_kind_of_layer(interpret, monkeypatch, caplog):
    """Every kernel variant a step of up to vLLM's max_num_batched_tokens can run is compiled at load, once per kind
    of layer: the sizes run are warm_up_token_counts' (here E = 64, top_k = 2: 1 token, unsorted; 5, the first
    sorted batch: 5 * 2 > 64 / 8; 1025, the first two-pass sort: 2050 pairs x 128 bins > 2^18; with top_k = 1: 1
    and 9), and a second layer of the same kind runs none."""
    from expq.kernels.moe import warm_up_token_counts

    monkeypatch.setattr(vllm_kernel, "max_batched_tokens", lambda: 1100)
    args, _ = make_problem(e=64, h=16, i=16, t=3, dtype=torch.float16, seed=75)
    w13, w2, s13, s2 = args[1:5]
    with caplog.at_level("INFO", logger=plugin.LOGGER):
        first = loaded_method(vllm_layer(w13, w2, s13, s2, name="m.layers.0.moe"), monkeypatch)
        same = loaded_method(vllm_layer(w13, w2, s13, s2, name="m.layers.1.moe"), monkeypatch)
        other = loaded_method(vllm_layer(w13, w2, s13, s2, name="m.layers.2.moe", top_k=1), monkeypatch)
    warmed = [r.getMessage() for r in caplog.records if "warmed up" in r.getMessage()]
    assert warmed == [
        "expq's kernel warmed up for steps of 1 to 1100 tokens (3 step sizes run, one per kernel variant) on "
        "m.layers.0.moe and the layers like it",
        "expq's kernel warmed up for steps of 1 to 1100 tokens (2 step sizes run, one per kernel variant) on "
        "m.layers.2.moe and the layers like it"]
    assert warm_up_token_counts(1100, 64, 2, 16, 16, torch.float16, "cpu") == [1, 5, 1025]
    assert warm_up_token_counts(1100, 64, 1, 16, 16, torch.float16, "cpu") == [1, 9]  # two passes from 2049
    assert all(m.expq_experts is not None for m in (first, same, other))


# --- where expq's kernel cannot serve a layer: vLLM's, with one warning per reason ------------------------------
def _other_prepare(method):
    method.moe_kernel.prepare_finalize = MoEPrepareAndFinalizeNaiveDPEPModular()


def _overlap(method):
    method.moe_kernel.can_overlap_shared_experts = True


def _clamp(method):
    method.moe_quant_config.gemm1_clamp_limit = 7.0


FALLBACKS = {
    "activation": (dict(activation="relu2_no_mul"), None, "activation 'relu2_no_mul' is not one of expq's"),
    "dispatch": ({}, _other_prepare, "moves its tokens with MoEPrepareAndFinalizeNaiveDPEPModular"),
    "shared-overlap": ({}, _overlap, "shared experts inside the MoE kernel"),
    "clamp": ({}, _clamp, "quant config sets gemm1_clamp_limit"),
    "layout": (dict(bf16_weights=True), None, "w13_weight is torch.bfloat16"),
    "device": (dict(no_interpreter=True), None, "its weights are on cpu, where expq's Triton kernel does not run"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_fallback_to_vllms_kernel_with_one_line(case, interpret, monkeypatch, caplog):
    opts, setup, reason = FALLBACKS[case]
    if opts.get("no_interpreter"):
        monkeypatch.delenv("TRITON_INTERPRET")
    args, _ = make_problem(t=5, dtype=torch.float16, seed=74)
    w13, w2, s13, s2 = args[1:5]
    if opts.get("bf16_weights"):
        w13 = w13.to(torch.bfloat16)
    with caplog.at_level("INFO", logger=plugin.LOGGER):
        layers = [vllm_layer(w13, w2, s13, s2, activation=opts.get("activation", "silu"), name=f"m.layers.{L}.moe")
                  for L in (0, 1)]
        methods = [loaded_method(layer, monkeypatch, setup=setup) for layer in layers]
    assert all(m.expq_experts is None for m in methods)
    assert [apply(m, la, args[0], args[5], args[6]) for m, la in zip(methods, layers)] == [VLLM_RESULT] * 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and caplog.records[0].levelname == "WARNING", lines  # one line for both layers
    assert lines[0].startswith("expq's kernel cannot serve m.layers.0.moe (nor any layer like it): ")
    assert reason in lines[0] and lines[0].endswith("; vLLM's int8 kernel runs it") and "\n" not in lines[0]
