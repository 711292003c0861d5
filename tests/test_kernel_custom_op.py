"""``torch.ops.expq.fused_moe_int8`` (expq/kernels/custom_op.py): the op computes what ``fused_moe_int8`` computes,
its fake implementation lets torch.compile take it whole (fullgraph, dynamic batch, no recompile), torch's own
``opcheck`` accepts it; on a GPU (marked gpu) CUDA-graph capture and replay and an inductor compile give the eager
result bit for bit."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_kernels import EP_MAPS, ep_problem, make_problem

from expq.kernels import custom_op, fused_moe_int8

OP = custom_op.fused_moe_int8_op


def op_args(args, kwargs, expert_map=None, activation="silu", on_input=False, backend="torch"):
    return (*args, kwargs.get("w13_bias"), kwargs.get("w2_bias"), expert_map, activation, on_input, backend)


def direct(args, kwargs, expert_map=None, activation="silu", on_input=False, backend="torch"):
    return fused_moe_int8(*args, **kwargs, expert_map=expert_map, activation=activation,
                          apply_router_weight_on_input=on_input, backend=backend)


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on unused rows
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_op_equals_the_function(backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # backend "triton" on CPU tensors
    args, kw = make_problem(t=9, top_k=2, dtype=torch.float16, seed=50, bias=True)
    out = OP(*op_args(args, kw, activation="gelu_tanh", backend=backend))
    assert torch.equal(out, direct(args, kw, activation="gelu_tanh", backend=backend))
    assert all(out.data_ptr() != a.data_ptr() for a in args)  # a new tensor, never an input
    local, lkw, emap, _, _ = ep_problem(EP_MAPS["permuted"], t=7, top_k=2, dtype=torch.float16, seed=51)
    assert torch.equal(OP(*op_args(local, lkw, emap, backend=backend)), direct(local, lkw, emap, backend=backend))
    one, _ = make_problem(t=5, top_k=1, dtype=torch.float16, seed=52)
    assert torch.equal(OP(*op_args(one, {}, on_input=True, backend=backend)),
                       direct(one, {}, on_input=True, backend=backend))


def test_fake_gives_shape_and_dtype_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kw = make_problem(t=6, top_k=2, dtype=torch.float16, seed=53, bias=True)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in op_args(args, kw)]
        out = OP(*fake)
    assert tuple(out.shape) == tuple(args[0].shape) and out.dtype == torch.float16


def test_opcheck():
    args, kw = make_problem(t=6, top_k=2, dtype=torch.float32, seed=54, bias=True)
    torch.library.opcheck(torch.ops.expq.fused_moe_int8.default, op_args(args, kw))
    local, lkw, emap, _, _ = ep_problem(EP_MAPS["linear-rank1"], t=5, top_k=2, dtype=torch.float32, seed=55)
    torch.library.opcheck(torch.ops.expq.fused_moe_int8.default, op_args(local, lkw, emap))


def test_fullgraph_compile_takes_the_op_whole():
    """Dynamo records the op as one node (no graph break: fullgraph=True would raise), and a new batch size reuses
    the dynamic-shape graph; the compiled result equals eager."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    args, kw = make_problem(t=9, top_k=2, dtype=torch.float32, seed=56, bias=True)

    def layer(x, *rest):
        return OP(x * 2, *rest, kw["w13_bias"], kw["w2_bias"], None, "silu", False, "torch") + x

    compiled = torch.compile(layer, fullgraph=True, backend=counter, dynamic=True)
    assert torch.equal(compiled(*args), layer(*args))
    args5, _ = make_problem(t=5, top_k=2, dtype=torch.float32, seed=57)
    assert torch.equal(compiled(*args5), layer(*args5))
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_reimport_finds_the_registered_op():
    again = importlib.reload(custom_op)
    assert again.fused_moe_int8_op is torch.ops.expq.fused_moe_int8


# --- GPU ----------------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_problem(t, e=16, h=512, i=256, top_k=4, dtype=torch.bfloat16, seed=60, bias=False, emap=None):
    args, kw = make_problem(e=e, h=h, i=i, t=t, top_k=top_k, dtype=dtype, seed=seed, bias=bias)
    args = tuple(a.cuda() for a in args)
    kw = {k: v.cuda() for k, v in kw.items()}
    return args, kw, None if emap is None else torch.tensor(emap, dtype=torch.int32, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("t", [1, 16, 300])
def test_cuda_graph_capture_and_replay_equal_eager(t, ep):
    """Captured once, replayed on new inputs copied into the static buffers: bit-identical to eager each time
    (decode without the sort, sorted batches; with an expert map)."""
    e = 16  # local experts; with the map, the even ones of 32 global experts
    emap = [(g // 2 if g % 2 == 0 else -1) for g in range(2 * e)] if ep else None
    args, kw, m = cuda_problem(t, e=e, seed=61, bias=True, emap=emap)
    if ep:  # ids are global (32 experts)
        args = (*args[:6], torch.randint(0, 2 * e, args[6].shape, device="cuda", dtype=torch.int32))
    static = [a.clone() for a in args]
    rest = (kw["w13_bias"], kw["w2_bias"], m, "silu", False, "auto")
    OP(*static, *rest)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*static, *rest)
    for seed in (62, 63):
        g = torch.Generator(device="cuda").manual_seed(seed)
        static[0].copy_(torch.randn(static[0].shape, generator=g, device="cuda").to(static[0].dtype))
        n_ids = 2 * e if ep else e
        static[6].copy_(torch.randint(0, n_ids, static[6].shape, generator=g, device="cuda", dtype=torch.int32))
        static[5].copy_(torch.rand(static[5].shape, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, OP(*static, *rest)), (t, ep, seed)


@pytest.mark.gpu
@gpu
def test_inductor_fullgraph_equals_eager_and_captures():
    """torch.compile(fullgraph=True) with inductor and CUDA graphs (mode reduce-overhead) around the op: the same
    bits as eager, for two batch sizes."""
    torch._dynamo.reset()
    args, kw, _ = cuda_problem(16, seed=64, bias=True)

    def layer(x, *rest):
        return OP((x * 2).contiguous(), *rest, kw["w13_bias"], kw["w2_bias"], None, "silu", False, "auto") + x

    for mode in (None, "reduce-overhead"):
        compiled = torch.compile(layer, fullgraph=True, mode=mode)
        for t in (16, 64):
            a, _, _ = cuda_problem(t, seed=65 + t)
            want = layer(*a)
            for _ in range(3):  # reduce-overhead records, then replays
                assert torch.equal(compiled(*a), want), (mode, t)
        torch._dynamo.reset()
