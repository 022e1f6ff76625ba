"""INT4 layers under torch.compile: `sdsie::int4_mm` (the launcher as a torch.library op) passes opcheck, finds
the layer's own weight object (and its launch plans), and a compiled tiny Llama with every decoder linear and the
LM head in INT4 (or gated) gives eager's logits with the kernel launched once per layer.

On CPU the kernel runs under TRITON_INTERPRET=1; inductor (a C++ build per graph, about a minute on CPU) is left to
the GPU test."""

from __future__ import annotations

import copy

import pytest
import torch

from sdsie.kernels import int4_matmul, int4_silu_mul, kernel_calls
from sdsie.kernels.ops import register_weight, weight_for
from sdsie.models import tiny_llama
from sdsie.quant import Int4Linear, QuantConfig, fuse_projections, gate_model, quantize_model

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
N_LINEARS = 7 + 1  # one decoder layer of seven, and the head
IDS = torch.tensor([[1, 5, 9, 4, 7]])


def _int4_model() -> torch.nn.Module:
    model = tiny_llama(vocab_size=64, num_layers=1, seed=0)
    quantize_model(model, ALL_LINEARS, QuantConfig("minmax", 32))
    return model


INT4 = _int4_model()


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model(IDS.to(model.device), use_cache=False).logits


def _same_logits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise on CPU (the interpreter and CPU matmuls are deterministic); on a GPU within fp32 float noise: cuBLAS
    may pick another algorithm for a traced graph's matmuls (the H200 differed in the fifth digit)."""
    if a.device.type == "cpu":
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("shape", [(3, 64), (2, 1, 64)])
def test_the_op_passes_opcheck_and_is_the_launcher(kernel_device, symmetric: bool, shape: tuple[int, ...]):
    lin = torch.nn.Linear(64, 24, bias=False)
    q = Int4Linear.from_linear(lin, QuantConfig("minmax", 32, symmetric=symmetric)).to(kernel_device)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(kernel_device)
    args = (x, q.qweight, q.scales, q.zeros, q.group_size)
    torch.library.opcheck(torch.ops.sdsie.int4_mm.default, args)
    assert torch.equal(torch.ops.sdsie.int4_mm(*args), int4_matmul(x, q.int4_weight))
    torch.library.opcheck(torch.ops.sdsie.int4_silu_mul.default, args)  # the fused gate/up projection's op
    assert torch.equal(torch.ops.sdsie.int4_silu_mul(*args), int4_silu_mul(x, q.int4_weight))
    assert torch.ops.sdsie.int4_silu_mul(*args).shape == (*shape[:-1], 12)


def test_the_op_finds_the_layers_weight_object_and_wraps_unknown_tensors_anew():
    q = Int4Linear.from_linear(torch.nn.Linear(64, 16), QuantConfig("minmax", 32))
    w = q.int4_weight
    assert weight_for(q.qweight, q.scales, q.zeros, 64, 32) is w  # its launch plans are the eager calls'
    copies = (q.qweight.clone(), q.scales.clone(), q.zeros.clone())
    other = weight_for(*copies, 64, 32)
    assert other is not w and other.qweight is copies[0]
    register_weight(other)
    assert weight_for(*copies, 64, 32) is other
    q.to(torch.bfloat16)  # new scale tensors: the layer's new weight object is the one found
    assert weight_for(q.qweight, q.scales, q.zeros, 64, 32) is q.int4_weight is not w


@pytest.mark.parametrize("fused", [False, True])
def test_a_compiled_int4_llama_gives_eager_logits_in_one_graph(kernel_device, fused: bool):
    """aot_eager: AOT traces the op through its fake implementation; fused: q/k/v and gate/up as one INT4 layer each
    (their slices' shared state traced by dynamo too)."""
    model = copy.deepcopy(INT4).to(kernel_device)
    if fused:
        fuse_projections(model)
    eager = _logits(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break is an error
    _logits(compiled)
    before = kernel_calls()
    out = _logits(compiled)
    assert kernel_calls() - before == (4 + 1 if fused else N_LINEARS)  # every INT4 layer launched, through the op
    assert _same_logits(out, eager)
    torch._dynamo.reset()


def test_a_compiled_gated_llama_follows_the_gear(kernel_device):
    model = tiny_llama(vocab_size=64, num_layers=1, seed=0)
    state = gate_model(model, ALL_LINEARS, QuantConfig("minmax", 32))
    model.to(kernel_device)
    full = _logits(model)
    state.int4 = True
    int4 = _logits(model)
    assert not _same_logits(full, int4)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for gear, expected in ((True, int4), (False, full), (True, int4)):
        state.int4 = gear
        before = kernel_calls()
        assert _same_logits(_logits(compiled), expected), gear
        assert kernel_calls() - before == (N_LINEARS if gear else 0)
    # one graph per gear, compiled once: the layers' call counters are not traced (each call would recompile)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for gear in (False, True, False, True):
            state.int4 = gear
            _logits(compiled)
    torch._dynamo.reset()


def test_a_compiled_prompt_takes_the_norm_fused_epilogues_from_torch_ops_and_a_step_from_the_op():
    """Past the rows a kernel takes an epilogue at (`epilogue_max_m`: a prompt's), a compiled norm-fused layer calls
    the op for its bare product and composes the norm, residual, gained copy and silu * up from traced torch ops
    (which inductor fuses); at one row the op carries them to the kernel. Both give eager's logits."""
    from sdsie.quant import quantize_for_decode

    model = tiny_llama(vocab_size=64, num_layers=1, seed=0)
    quantize_for_decode(model, QuantConfig("minmax", 32))
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=capture, fullgraph=True, dynamic=False)
    # rows -> ops that carry an epilogue to the kernel: all five at one row; at 12 the residual-only ones (o, down:
    # a residual is taken up to 16 rows), while the normed ones (q/k/v, gate/up, the head) compose; none past 16
    for rows, carried_ops in ((20, 0), (12, 2), (1, 5)):
        ids = torch.arange(1, rows + 1).unsqueeze(0) % 64
        with torch.no_grad():
            eager = model(ids, use_cache=False).logits
            before = kernel_calls()
            out = compiled(ids, use_cache=False).logits
        # q/k/v, o, gate/up, down and the head: one launch each per 16 rows (ROW_SLICE)
        assert kernel_calls() - before == 5 * -(-rows // 16), rows
        assert _same_logits(out, eager), rows
        ops = [n for n in graphs[-1].graph.nodes if n.op == "call_function" and "sdsie" in str(n.target)]
        assert sorted(str(n.target).split(".")[1] for n in ops) == (
            ["int4_mm"] * 4 + ["int4_silu_mul"] if rows == 1 else ["int4_mm"] * 5), rows
        carried = [n for n in ops if any(a is not None for a in (*n.args[5:], *n.kwargs.values()))]
        assert len(carried) == carried_ops, rows
        names = {getattr(n.target, "__name__", str(n.target)) for n in graphs[-1].graph.nodes}
        assert ("rsqrt" in names) is (rows > 1), rows  # the composed norm, traced
    torch._dynamo.reset()


@pytest.mark.parametrize("kwargs", [{"options": {"combo_kernels": True, "triton.enable_pdl": True}},
                                    {"mode": "max-autotune-no-cudagraphs"}, {"backend": "eager"}, {}])
def test_the_compiled_prompt_launches_inductors_kernels_plainly(monkeypatch, kwargs: dict):
    """DecodeCompiled compiles the prompt with inductor's programmatic launch off whatever the step's arguments ask
    (a mode becomes its options, since torch.compile takes one or the other); the step keeps them as given, and a
    backend other than inductor gets them unchanged."""
    from sdsie.decoding import DecodeCompiled

    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    DecodeCompiled(INT4, True, **kwargs)
    step, prompt = calls
    assert step == {**kwargs, "dynamic": False} and prompt["dynamic"] is True
    if kwargs.get("backend") == "eager":
        assert prompt == {**kwargs, "dynamic": True}
        return
    assert "mode" not in prompt and prompt["options"]["triton.enable_pdl"] is False
    assert prompt["options"].items() >= {**kwargs.get("options", {}), "triton.enable_pdl": False}.items()
    if "mode" in kwargs:
        assert prompt["options"]["max_autotune"] is True


@pytest.mark.gpu
def test_inductor_compiles_an_int4_llama_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = copy.deepcopy(INT4).to("cuda", torch.bfloat16)
    ids = IDS.cuda()
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits.float()
        compiled = torch.compile(model, fullgraph=True)
        out = compiled(ids, use_cache=False).logits.float()
    torch.testing.assert_close(out, eager, atol=0.05, rtol=0.05)  # inductor's fused norms round differently in bf16
    torch._dynamo.reset()


@pytest.mark.gpu
def test_inductor_compiles_a_norm_fused_int4_llama_at_a_prompts_rows_and_a_steps():
    """On a GPU, inductor with a dynamic length (a compiled prefill's): the epilogues composed in the graph at 12 and
    20 rows, and carried to the kernel at one, give eager's logits: to rounding in fp32; in bf16 within a few bf16
    steps of the logits' scale, since eager rounds each composed op to bf16 where inductor rounds its fused kernel
    once (this model's logits reach about 14, where a step is 0.06; an absolute 0.05 failed on an H100 with a
    largest difference of 0.34, telemetry/raw/gpu_int4_compile_tests_h100.txt)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sdsie.quant import quantize_for_decode

    model = tiny_llama(vocab_size=64, num_layers=1, seed=0)
    quantize_for_decode(model, QuantConfig("minmax", 32))
    for dtype in (torch.float32, torch.bfloat16):
        model.to("cuda", dtype)
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        for rows in (20, 12, 1):
            ids = (torch.arange(1, rows + 1).unsqueeze(0) % 64).cuda()
            with torch.no_grad():
                eager = model(ids, use_cache=False).logits.float()
                out = compiled(ids, use_cache=False).logits.float()
            if dtype == torch.float32:
                torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
            else:
                torch.testing.assert_close(out, eager, atol=0.05 * eager.abs().max().item(), rtol=0.05)
        torch._dynamo.reset()


@pytest.mark.gpu
def test_a_compiled_fused_int4_model_replays_under_the_engines_graphs():
    """On a GPU: inductor's decode step (the op, the slices of the fused projections) captured in the engine's graphs
    gives the eager engine's tokens (fp32: inductor's fused norms round within float noise of eager's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sdsie.decoding import DecodeConfig, generate
    from sdsie.models import compiled_copy

    model = copy.deepcopy(INT4).to("cuda")
    fuse_projections(model)
    prompt = IDS[0].cuda()
    eager = generate(model, prompt, DecodeConfig(max_new_tokens=24, kv_cache="static")).tokens
    compiled = compiled_copy(model)
    graphed = generate(compiled, prompt, DecodeConfig(max_new_tokens=24, kv_cache="static", cuda_graphs=True)).tokens
    assert graphed == eager
    torch._dynamo.reset()


@pytest.mark.gpu
def test_a_compiled_int4_prompt_replays_under_prefill_graphs_as_it_runs_without_them(monkeypatch):
    """On a GPU: a norm-fused INT4 model compiled with its prompt (inductor, programmatic launch asked for) and its
    prompts replayed as graphs (prefill_graphs) gives, run after run, the tokens of the same compiled model with the
    same padded prompts run without a prompt graph, at a padded length (20 -> 32) and an exact one (32). fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import sdsie.decoding.engine as engine
    from sdsie.decoding import DecodeCompiled, DecodeConfig, generate
    from sdsie.decoding.compiled import inductor_options
    from sdsie.quant import quantize_for_decode

    model = tiny_llama(vocab_size=64, num_layers=2, seed=0)
    quantize_for_decode(model, QuantConfig("minmax", 32))
    model.to("cuda")
    compiled = DecodeCompiled(model, True, options=inductor_options(torch.device("cuda")))
    graphed_cfg = DecodeConfig(max_new_tokens=24, kv_cache="static", cuda_graphs=True, prefill_graphs=True)
    for prompt in (list(range(1, 21)), [(7 * i) % 63 + 1 for i in range(32)]):
        graphed = [generate(compiled, prompt, graphed_cfg).tokens for _ in range(4)]
        with monkeypatch.context() as m:  # the same padding, the prompt run without a graph
            m.setattr(engine, "_prefill_sizes", lambda config: engine.PREFILL_SIZES)
            plain = generate(compiled, prompt, DecodeConfig(max_new_tokens=24, kv_cache="static")).tokens
        assert all(tokens == plain for tokens in graphed), (len(prompt), graphed, plain)
    torch._dynamo.reset()
