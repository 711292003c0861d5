"""Run converted checkpoints with the routed experts kept int8 in memory.

``load_model`` loads a checkpoint written by ``expq convert`` into its transformers model class. transformers loads
everything but the routed experts, exactly as it always does (its renames, dtypes, devices, tied weights); each MoE
layer's experts module is an ``Int8Experts`` subclass of transformers' own experts class, built without its
dense weights, holding the experts_int8 tensors (``w13`` int8 [E, 2I, H], ``w2`` int8 [E, H, I], fp32 ``w13_scale``
[E, 2I] and ``w2_scale`` [E, H], plus expert biases where the family has them) and running expq's fused-MoE kernel
(Triton on CUDA, the torch implementation on CPU). Memory: int8 weights plus scales, never the dense experts.

How it hooks in: while ``from_pretrained`` builds the model, the name of transformers' experts class in its modeling
module points at the int8 subclass (restored right after), so the model is created with it; the dense weights it
would have had are empty placeholders (transformers reports them missing and the packed tensors unexpected, which
is expected and silenced); then the int8 tensors are read from the checkpoint, one layer at a time, and attached.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import ConvertedCheckpoint, LayerExperts, open_checkpoint
from .errors import ExpqError, LayoutError, UsageError
from .experts import ExpertMap

_PATCH_LOCK = threading.Lock()


def load_experts(path: str | Path, layer: int | None = None) -> dict:
    """The routed experts of a converted checkpoint in vLLM's experts_int8 layout.

    Args:
        path: a directory written by ``expq convert``.
        layer: one MoE layer index, or None for all.

    Returns:
        ``{layer: {"w13_weight": int8 [E, 2I, H], "w2_weight": int8 [E, H, I], "w13_scale": fp32 [E, 2I],
        "w2_scale": fp32 [E, H], ["w13_bias": [E, 2I], "w2_bias": [E, H]]}}`` (CPU tensors; w13 rows are gate
        then up), or that inner dict alone when ``layer`` is given.

    Raises:
        UnreadableInputError: not a converted checkpoint. LayoutError: ``layer`` is not a MoE layer (the message
            lists them).
    """
    ck = open_checkpoint(path)
    if layer is not None:
        if layer not in ck.moe_layers:
            raise LayoutError(f"layer {layer} is not a MoE layer; MoE layers: {ck.moe_layers}", file=str(path))
        return ck.layer_experts(layer).as_dict()
    return {L: ck.layer_experts(L).as_dict() for L in ck.moe_layers}


def _int8_experts_class(base: type, experts: ExpertMap) -> type:
    """A subclass of transformers' experts class ``base`` that holds experts_int8 tensors and runs the kernel;
    the parameters ``experts`` calls routed-expert weights (``ExpertMap.is_runtime_expert_weight``) are not
    allocated."""

    class Int8Experts(base):  # type: ignore[misc, valid-type]
        expq_int8 = True

        def __init__(self, *args, **kwargs):
            with torch.device("meta"):
                super().__init__(*args, **kwargs)
            self._become_int8()

        def _become_int8(self) -> None:
            self._drop_dense_weights()
            self.activation = "silu"
            self.forward_kind = "topk"
            self.apply_router_weight_on_input = False
            self.backend = "auto"

        def _drop_dense_weights(self) -> None:
            # The expert weight matrices (E x I x H elements: 3-D stacked, or DBRX's 2-D [E*I, H]) become empty
            # placeholders; biases (GPT-OSS) and anything else small keep their shape and load as usual.
            for mod in self.modules():
                for name, p in list(mod.named_parameters(recurse=False)):
                    if experts.is_runtime_expert_weight(p.numel()):
                        setattr(mod, name, torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=False))

        def _apply(self, fn, *args, **kwargs):
            # model.to(dtype) / .half() / .float() cast floating buffers: the fp32 scales must stay fp32 (their
            # values are the compute dtype's; another float dtype would round them). They move with the device only.
            scales = {n: self._buffers.pop(n) for n in ("w13_scale", "w2_scale") if self._buffers.get(n) is not None}
            out = super()._apply(fn, *args, **kwargs)
            for n, t in scales.items():
                device = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
                self.register_buffer(n, t.to(device), persistent=False)
            return out

        def attach(self, ex: LayerExperts, *, activation: str, forward_kind: str, on_input: bool,
                   device: torch.device) -> None:
            for name, t in (("w13_weight", ex.w13), ("w2_weight", ex.w2), ("w13_scale", ex.w13_scale),
                            ("w2_scale", ex.w2_scale), ("w13_bias", ex.w13_bias), ("w2_bias", ex.w2_bias)):
                self.register_buffer(name, None if t is None else t.to(device), persistent=False)
            self.activation, self.forward_kind, self.apply_router_weight_on_input = activation, forward_kind, on_input

        def forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
            from .kernels import fused_moe_int8

            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1])
            E = self.w13_weight.shape[0]
            bias = {"w13_bias": self.w13_bias, "w2_bias": self.w2_bias}
            if self.forward_kind == "dense_premultiplied":
                # x is [E*T, H]: expert e's block holds the tokens already scaled by their router score, zero rows
                # for tokens that did not pick e (Llama-4). Run only the picked (non-zero) rows, weight 1.
                xe = x.view(E, -1, x.shape[-1])
                picked = xe.abs().amax(dim=-1) > 0  # [E, T]
                e_idx, t_idx = picked.nonzero(as_tuple=True)
                out = torch.zeros_like(xe)
                if e_idx.numel():
                    y = fused_moe_int8(xe[e_idx, t_idx], self.w13_weight, self.w2_weight, self.w13_scale,
                                       self.w2_scale, torch.ones(e_idx.numel(), 1, device=x.device),
                                       e_idx.view(-1, 1).to(torch.int32), activation=self.activation,
                                       backend=self.backend, **bias)
                    out[e_idx, t_idx] = y
                return out.view(shape)
            ids = top_k_index.reshape(x.shape[0], -1)
            w = top_k_weights.reshape(x.shape[0], -1)
            y = fused_moe_int8(x, self.w13_weight, self.w2_weight, self.w13_scale, self.w2_scale, w, ids,
                               activation=self.activation,
                               apply_router_weight_on_input=self.apply_router_weight_on_input,
                               backend=self.backend, **bias)
            return y.view(shape)

        def extra_repr(self) -> str:
            if getattr(self, "w13_weight", None) is None:
                return "int8 experts (not attached)"
            E, twoI, H = self.w13_weight.shape
            return f"experts_int8: {E} experts, w13 int8 [{E}, {twoI}, {H}], activation={self.activation}"

    Int8Experts.__name__ = Int8Experts.__qualname__ = f"Int8{base.__name__}"
    return Int8Experts


@contextlib.contextmanager
def _patched(cls: type, replacement: type):
    module = sys.modules[cls.__module__]
    with _PATCH_LOCK:
        setattr(module, cls.__name__, replacement)
        try:
            yield
        finally:
            setattr(module, cls.__name__, cls)


def _experts_modules(model, ck: ConvertedCheckpoint) -> dict[int, torch.nn.Module]:
    """MoE layer index -> the model's experts module (``<layers>.<L>.<runtime module>``)."""
    lay = ck.layout
    found = {}
    for L in ck.moe_layers:
        suffix = f"{lay.layers}.{L}.{lay.runtime_module}"
        hits = [m for n, m in model.named_modules() if n == suffix or n.endswith("." + suffix)]
        if len(hits) != 1:
            raise LayoutError(f"layer {L}: found {len(hits)} modules named *{suffix} in the transformers model "
                              f"{type(model).__name__} (expected 1); the layout's runtime.module may not fit this "
                              "transformers version", file=lay.path)
        found[L] = hits[0]
    return found


def load_model(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
               backend: str = "auto", **from_pretrained_kwargs):
    """Load a converted checkpoint into its transformers model class, routed experts int8 in memory.

    Args:
        path: a directory written by ``expq convert``.
        device: where the model goes (``"cpu"``, ``"cuda"``, ``"cuda:1"``...); default CUDA if available, else CPU.
        dtype: the model dtype for everything but the experts (default: the checkpoint's, as transformers'
            ``dtype="auto"``).
        backend: the experts kernel: ``auto`` (Triton on CUDA, torch on CPU), ``triton`` or ``torch``.
        from_pretrained_kwargs: passed on to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``).

    Returns:
        a ``transformers.PreTrainedModel`` in eval mode whose MoE layers hold ``Int8<Family>Experts`` modules
        (``w13_weight``/``w2_weight`` int8, ``w13_scale``/``w2_scale`` fp32). ``generate()`` works.

    Raises:
        UsageError: an unknown backend, or a device that is not available.
        UnreadableInputError: not a converted checkpoint (exit status 2).
        ExpqError: transformers cannot instantiate this architecture; the layout's runtime module is not found in
            the model.
    """
    from .kernels.moe import BACKENDS
    from .devices import parse_devices

    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    ck = open_checkpoint(path)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as tlog

    dev = parse_devices(str(device))[0] if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError, OSError) as e:
        import transformers

        raise ExpqError(f"transformers {transformers.__version__} cannot instantiate model_type "
                        f"{ck.config.get('model_type')!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                        file=str(path)) from None
    int8_cls = int8_experts_class(skeleton, ck)
    base = int8_cls.__mro__[1]
    del skeleton
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # expq loads the experts; transformers must not dequantize them
    kw = dict(from_pretrained_kwargs)
    kw.setdefault("dtype", dtype if dtype is not None else "auto")
    if dev.type != "cpu":
        kw.setdefault("device_map", str(dev))  # load straight onto the device (accelerate)
    prev = tlog.get_verbosity()
    tlog.set_verbosity_error()  # the packed tensors are "unexpected" and the dense experts "missing": by design
    try:
        with _patched(base, int8_cls):
            model, info = AutoModelForCausalLM.from_pretrained(path, config=config, output_loading_info=True, **kw)
    finally:
        tlog.set_verbosity(prev)
    _refuse_missing(model, info, int8_cls, path)
    attach_int8_experts(model, ck, int8_cls, backend=backend, device=dev)
    model.eval()
    return model


def int8_experts_class(model, ck: ConvertedCheckpoint) -> type:
    """The ``Int8<Family>Experts`` subclass of the experts class ``model`` (a transformers model, e.g. on the meta
    device) uses for ``ck``'s family.

    Raises:
        LayoutError: the layout's runtime module is not found in the model.
    """
    base = type(next(iter(_experts_modules(model, ck).values())))
    return _int8_experts_class(base, ck.experts)


def make_experts_int8(model, ck: ConvertedCheckpoint) -> type:
    """Turn every MoE layer's experts module of a freshly built ``model`` (before its weights load) into the int8
    experts class, in place, without their dense weights; returns that class. What expq's transformers quantizer
    does before loading (``load_model`` builds the model with the class directly)."""
    int8_cls = int8_experts_class(model, ck)
    for mod in _experts_modules(model, ck).values():
        mod.__class__ = int8_cls
        mod._become_int8()
    return int8_cls


def attach_int8_experts(model, ck: ConvertedCheckpoint, int8_cls: type, *, backend: str = "auto",
                        device: torch.device | None = None) -> None:
    """Read each MoE layer's experts_int8 tensors from ``ck`` and attach them to the model's int8 experts modules
    (on ``device``, else on the device of the decoder layer's other weights).

    Raises:
        ExpqError: a layer's experts module is not the int8 class; a module of the checkpoint is missing.
    """
    lay = ck.layout
    for L, mod in _experts_modules(model, ck).items():
        if not isinstance(mod, int8_cls):
            raise ExpqError(f"layer {L}: transformers built {type(mod).__name__}, not the int8 experts",
                            file=str(ck.root))
        dev = device if device is not None else _neighbour_device(model, mod)
        mod.attach(ck.layer_experts(L), activation=lay.activation, forward_kind=lay.runtime_forward,
                   on_input=lay.router_weight_on_input and lay.runtime_forward == "topk", device=dev)
        mod.backend = backend
    model.expq_layout = lay.name


def _neighbour_device(model, experts) -> torch.device:
    """Where the weights next to an experts module live (its decoder layer's), for device maps."""
    name = next(n for n, m in model.named_modules() if m is experts)
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    for owner in (parent, model):
        for p in owner.parameters():
            if p.numel() and p.device.type != "meta":
                return p.device
    return torch.device("cpu")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class Generation:
    """What ``generate`` produced: the prompt and new token ids, the decoded continuation (the new tokens' text
    alone, without the prompt; None without a tokenizer), the model class, where it ran, and the bytes of its routed
    experts (int8 + scales) and of the rest."""

    prompt_ids: list[int]
    new_ids: list[int]
    text: str | None
    model_class: str
    device: str
    experts_bytes: int
    other_bytes: int


def generate(path: str | Path, prompt: str, *, max_new_tokens: int = 20, device: str | None = None) -> Generation:
    """Load a converted checkpoint with ``load_model`` (experts int8) and continue ``prompt`` greedily.

    Args:
        path: a directory written by ``expq convert``.
        prompt: the prompt text; for a checkpoint without a tokenizer, space- or comma-separated token ids.
        max_new_tokens: tokens to generate (>= 1).
        device: ``cpu``, ``cuda`` or ``cuda:N`` (default: CUDA if available).

    Returns:
        Generation (``text`` is the continuation, when the checkpoint has a tokenizer: the decoded prompt and new
        tokens with the decoded prompt taken off the front, so that a space the tokenizer puts between them is
        kept).

    Raises:
        UsageError: an empty prompt, ``max_new_tokens`` < 1, a device that is not there, token ids that are not
            integers or outside the vocabulary, a prompt that encodes to no tokens.
        ExpqError: see ``load_model``.
    """
    from .devices import parse_devices
    from .options import check_run

    check_run(device=device, max_new_tokens=max_new_tokens, prompt=prompt)
    if device is not None:
        parse_devices(device)  # a clear error for a device that is not there
    model = load_model(path, device=device)
    tok = _tokenizer(Path(path))
    dev = next(model.parameters()).device
    ids = _prompt_ids(prompt, tok, model.get_input_embeddings().weight.shape[0]).to(dev)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0)
    new = out[0, ids.shape[1]:].tolist()
    nb = experts_nbytes(model)
    text = continuation(tok, ids[0].tolist(), new) if tok is not None else None
    return Generation(ids[0].tolist(), new, text, type(model).__name__, str(dev), nb["experts"], nb["other"])


def continuation(tok, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text of ``new_ids`` as it reads after the prompt: decode(prompt + new) minus decode(prompt) (decoding the
    new tokens alone would drop a leading space some tokenizers encode in the token), else decode(new)."""
    head = tok.decode(prompt_ids, skip_special_tokens=True)
    full = tok.decode(prompt_ids + new_ids, skip_special_tokens=True)
    return full[len(head):] if full.startswith(head) else tok.decode(new_ids, skip_special_tokens=True)


def _tokenizer(path: Path):
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _prompt_ids(prompt: str, tok, vocab: int) -> torch.Tensor:
    if tok is not None:
        ids = tok(prompt, return_tensors="pt").input_ids
    else:
        try:
            ids = torch.tensor([[int(x) for x in prompt.replace(",", " ").split()]])
        except ValueError:
            raise UsageError("this checkpoint has no tokenizer: give --prompt as token ids, e.g. '1 2 3'") from None
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise UsageError(f"token ids must lie in [0, {vocab})")
    if ids.shape[1] == 0:
        raise UsageError("the prompt encodes to no tokens")
    return ids


def _refuse_missing(model, info: dict, int8_cls: type, path) -> None:
    """A tensor the model needs and the checkpoint lacks is an error, never a random initialisation (the routed
    experts' dense placeholders are the only parameters expected to be missing)."""
    experts = [n for n, m in model.named_modules() if isinstance(m, int8_cls)]
    missing = [k for k in info.get("missing_keys", [])
               if not any(k == e or k.startswith(e + ".") for e in experts)]
    if missing:
        raise ExpqError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {sorted(missing)[0]}; "
                        "refusing to fill them with random values", file=str(path), tensor=sorted(missing)[0])


def experts_nbytes(model) -> dict[str, int]:
    """Bytes the routed experts occupy in ``model`` (int8 weights, scales, biases) and the rest of the model."""
    experts = other = 0
    seen = set()
    for mod in model.modules():
        if getattr(mod, "expq_int8", False):
            for t in mod.buffers(recurse=False):
                if t is not None:
                    experts += t.numel() * t.element_size()
                    seen.add(id(t))
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            other += t.numel() * t.element_size()
    return {"experts": experts, "other": other}


logging.getLogger(__name__).addHandler(logging.NullHandler())
