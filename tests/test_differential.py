"""Differential attention (`attention_score="differential"`, Ye et al. 2024): parity with transformers' DiffLlama, a
layer-level float64 reference with the modifiers, bias schemes and the encoder direction it composes with, and what
it refuses. The formula on one head pair is in test_scores.py; the shared suites pick the score up from the registry.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import tiny_config
from tolerances import STAGES_PER_LAYER, model_tolerance, softmax_spread, tolerance
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM
from transformers.distributed import DistributedConfig

from plugformer import (
    PlugformerConfig,
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
    PlugformerModel,
    supported_kernels,
)
from plugformer.capabilities import unsupported_reason
from plugformer.positions import alibi_slopes


# GQA: 4 query heads over 2 key/value heads (two differential heads, one key/value pair); 3 layers: 3 λ_init values
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def lambda_init(layer_idx: int) -> float:
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)  # Ye et al. 2024, §2, with l − 1 = layer_idx


def diffllama_twin(kernel: str):
    """A random DiffLlama (init 0.1, λ vectors N(0, 0.5²) so that λ matters) and the plugformer model with its weights:
    DiffLlama's `self_attn.lambda_*` are plugformer's `self_attn.score.lambda_*`, every other name is the same."""
    torch.manual_seed(0)
    reference = DiffLlamaForCausalLM(DiffLlamaConfig(**SIZES, rope_parameters=ROPE, initializer_range=0.1))
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.rsplit(".", 1)[-1] in LAMBDAS:
                parameter.normal_(0.0, 0.5)
    reference.set_attn_implementation(kernel)
    config = PlugformerConfig(**SIZES, rope_parameters=ROPE, attention_score="differential", position_scheme="rope")
    config._attn_implementation = kernel
    model = PlugformerForCausalLM(config)
    renamed = {
        name.replace("self_attn.lambda_", "self_attn.score.lambda_"): value
        for name, value in reference.state_dict().items()
    }
    model.load_state_dict(renamed, strict=True)
    return reference.eval(), model.eval()


def padded_batch():
    tokens = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # left padding
    return tokens, mask


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_logits_and_cached_generation_equal_transformers_diffllama(kernel):
    reference, model = diffllama_twin(kernel)
    tokens, mask = padded_batch()
    with torch.no_grad():
        expected, actual = reference(tokens, attention_mask=mask).logits, model(tokens, attention_mask=mask).logits
        # two fp32 forwards (ours, DiffLlama's): fp32's rounding through the model's layers and longest reduction
        # times max|logits| (`model_tolerance`)
        atol = model_tolerance(
            model.config,
            expected[:1],
            magnitude=max(expected[0].abs().max().item(), expected[1, 3:].abs().max().item(), 1.0),
        )
        torch.testing.assert_close(actual[0], expected[0], atol=atol, rtol=0)
        torch.testing.assert_close(actual[1, 3:], expected[1, 3:], atol=atol, rtol=0)
        settings = dict(
            attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
        want, got = reference.generate(tokens, **settings), model.generate(tokens, **settings)
    assert torch.equal(got.sequences, want.sequences)
    # cached steps' logits `(steps, B, V)`: the same bound from their max|logits|
    atol = model_tolerance(model.config, expected, magnitude=max(torch.stack(want.logits).abs().max().item(), 1.0))
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=atol, rtol=0)
    # the check can fail: the same weights with other λ vectors give other logits
    with torch.no_grad():
        model.model.layers[1].self_attn.score.lambda_q1.mul_(-1.0)
        assert (model(tokens, attention_mask=mask).logits[0] - expected[0]).abs().max() > 1e-3


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def differential_layer_reference(
    attention, hidden: torch.Tensor, config, bias: torch.Tensor | None
) -> tuple[torch.Tensor, float]:
    """One differential self-attention layer in float64, written from the paper's formula and DiffLlama's head layout
    (query heads j and j + H/2 are the maps of head j, over key/value heads m and m + H_kv/2, m = j // groups, and
    its value is [v_m, v_{m + H_kv/2}]); each map is its query head's ordinary attention, soft-capped, biased
    (`bias` (H, T, T)), masked and with a sink as its query head would be. Returns the output `(B, T, hidden)` and
    the `atol` of the layer computed in fp32 against it (see the comments at the end)."""
    batch, length, _ = hidden.shape
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    groups, eps = heads // kv_heads, config.rms_norm_eps
    x = hidden.double()

    def project(linear, n):
        return (x @ linear.weight.double().T).view(batch, length, n, dim).transpose(1, 2)  # (B, n, T, D)

    query, key, value = (
        project(attention.q_proj, heads),
        project(attention.k_proj, kv_heads),
        project(attention.v_proj, kv_heads),
    )
    if config.use_qk_norm:
        query, key = (
            rms(query, eps) * attention.q_norm.weight.double(),
            rms(key, eps) * attention.k_norm.weight.double(),
        )
    logits = query @ key.repeat_interleave(groups, dim=1).transpose(2, 3) / math.sqrt(dim)  # (B, H, T, T)
    if config.attn_logit_softcapping is not None:
        cap = config.attn_logit_softcapping
        logits = cap * torch.tanh(logits / cap)
    if bias is not None:
        logits = logits + bias.double()
    if config.is_causal:
        logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), -math.inf)
    if config.use_attention_sinks:
        sinks = attention.sinks.double().view(1, heads, 1, 1).expand(batch, heads, length, 1)
        logits = torch.cat([logits, sinks], dim=-1)
    spread = softmax_spread(logits)  # the sink's column counts as a key
    weights = logits.softmax(-1)[..., :length]  # (B, H, T, T)
    score = attention.score
    lam = math.exp(score.lambda_q1.double() @ score.lambda_k1.double()) - math.exp(
        score.lambda_q2.double() @ score.lambda_k2.double()
    )
    lam += lambda_init(attention.layer_idx)
    out, amplification = [], 0.0
    for j in range(heads // 2):
        m = j // groups
        pair_value = torch.cat([value[:, m], value[:, m + kv_heads // 2]], dim=-1)  # (B, T, 2·D)
        difference = weights[:, j] @ pair_value - lam * weights[:, j + heads // 2] @ pair_value
        out.append((1 - lambda_init(attention.layer_idx)) * rms(difference, eps))
        # the difference of the maps cancels: its rounding, of its terms' size Σ_t p_t |v_t| + |λ| Σ_t p'_t |v_t| per
        # unit of growth, is divided by the rms of the difference, row by row
        terms = weights[:, j] @ pair_value.abs() + abs(lam) * weights[:, j + heads // 2] @ pair_value.abs()
        size = terms.amax(-1) / difference.pow(2).mean(-1).add(eps).sqrt()  # (B, T)
        amplification = max(amplification, size.max().item())
    output = torch.cat(out, dim=-1) @ attention.o_proj.weight.double().T  # (B, T, hidden)
    # fp32's rounding of the layer: its projections, scores, softmax (`spread`), weighted values, norm and o_proj
    # (`STAGES_PER_LAYER` steps, the longest reduction the hidden size, the keys or o_proj's H·D inputs, and the
    # scores' own rounding √D·scale·max Σ_d |q_d k_d| (scale = 1/√D) as in `attention_tolerances`), in units of the normalised
    # difference's error: (1 − λ_init) · amplification per unit of growth, summed by o_proj's rows (max_o Σ_k |W_ok|)
    dot = (query.abs() @ key.abs().repeat_interleave(groups, 1).transpose(2, 3)).max().item() / math.sqrt(dim)
    rows = attention.o_proj.weight.double().abs().sum(-1).max().item()
    atol = tolerance(
        torch.float32,
        magnitude=(1 - lambda_init(attention.layer_idx)) * amplification * rows,
        length=max(config.hidden_size, length, heads * dim),
        spread=spread + dot,
        steps=STAGES_PER_LAYER,
    )
    return output, atol


COMPOSED = [  # (scheme, config fields, kernel): what the differential layer composes with
    ("alibi", {}, "eager"),
    ("alibi", {}, "sdpa"),
    ("alibi", {"is_causal": False}, "sdpa"),  # an encoder: both directions
    ("none", {"attn_logit_softcapping": 2.0}, "eager"),
    ("none", {"use_attention_sinks": True}, "sdpa"),
    ("none", {"use_qk_norm": True}, "sdpa"),
]


@pytest.mark.parametrize(
    "scheme,fields,kernel", COMPOSED, ids=[f"{s}-{'-'.join(f) or 'plain'}-{k}" for s, f, k in COMPOSED]
)
def test_a_layer_equals_the_formula_with_what_it_composes_with(scheme, fields, kernel):
    """Each of the two maps is the ordinary attention of its query head: its own ALiBi slope, its own soft cap, its
    own sink logit, q/k normed before; then the difference, norm and scale. Layer 1 of the stack, in float64."""
    config = tiny_config("differential", scheme, **fields)
    config._attn_implementation = kernel
    torch.manual_seed(0)
    model = PlugformerModel(config).eval()
    attention = model.layers[1].self_attn
    with torch.no_grad():
        for parameter in (*(getattr(attention.score, name) for name in LAMBDAS), attention.sinks):
            if parameter is not None:
                parameter.normal_(0.0, 0.5)
    captured = {}
    attention.register_forward_hook(lambda module, args, output: captured.update(input=args[0], output=output[0]))
    tokens = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(tokens)
    bias = None
    if scheme == "alibi":
        distance = (torch.arange(9)[None, :] - torch.arange(9)[:, None]).abs()  # |i − j|
        bias = -alibi_slopes(config.num_attention_heads)[:, None, None] * distance  # (H, T, T)
    with torch.no_grad():
        expected, atol = differential_layer_reference(attention, captured["input"], config, bias)
    torch.testing.assert_close(captured["output"].double(), expected, atol=atol, rtol=0)


def test_lambda_parameters_init_and_depth():
    """Four (d_k,) λ vectors per attention layer under DiffLlama's names, N(0, 0.1²) at init; λ_init from the layer's
    depth, the decoder's in a seq2seq model's cross-attention too; the per-head norm has no weights."""
    config = PlugformerConfig(**SIZES, attention_score="differential")
    model = PlugformerForCausalLM(config)
    names = {name for name, _ in model.named_parameters() if ".score." in name}
    assert names == {f"model.layers.{i}.self_attn.score.{name}" for i in range(3) for name in LAMBDAS}
    values = torch.cat([p.detach() for name, p in model.named_parameters() if ".score." in name])
    assert values.shape == (3 * 4 * config.head_dim,) and 0.07 < values.std() < 0.13
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.score.lambda_init == pytest.approx(lambda_init(i))
        assert not list(layer.self_attn.score.groupnorm.parameters())
    seq2seq = PlugformerForConditionalGeneration(tiny_config("differential", is_encoder_decoder=True, pad_token_id=0))
    for i, layer in enumerate(seq2seq.decoder.layers):
        assert layer.cross_attn.score.lambda_init == pytest.approx(lambda_init(i))


def test_a_saved_model_loads_with_trust_remote_code_without_the_package(tmp_path):
    """The checkpoint carries the code (scores.py with the class, the attention hooks): same logits and tokens in a
    process where plugformer cannot be imported."""
    from test_hf_integration import assert_same_without_the_package

    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny_config("differential", "rope")).eval()
    model.save_pretrained(tmp_path / "model")
    tokens = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_same_without_the_package(model, tmp_path / "model", tokens, tmp_path)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(num_key_value_heads=1), r"num_key_value_heads=1 must be even"),  # MQA: no pair of key/value heads
        (dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=24), r"num_key_value_heads=3 must be even"),
        (dict(attention_dropout=0.1), r"attention_dropout=0.1 is not supported with attention_score='differential'"),
    ],
)
def test_configs_it_cannot_compute_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("differential", "rope", **fields)


def test_kernels_and_tensor_parallelism_it_cannot_run_on_are_refused():
    """Its values are 2·d_k wide: eager, sdpa and flex take them; flash-attn kernels (one head dim) and kernels without
    a record (vLLM's) are refused naming the field. Tensor parallelism is refused: the λ vectors are shared by the
    heads, and heads j and j + H/2 would sit on different ranks."""
    config = tiny_config("differential", "rope")
    assert supported_kernels(config, available_only=False) == ["eager", "sdpa", "flex_attention"]
    for kernel in ("flash_attention_2", "flash_attention_3", "vllm"):
        assert "attention_score='differential' gives the kernel values 2·head_dim wide" in unsupported_reason(
            config, kernel
        )
    parallel = copy.deepcopy(config)
    parallel.distributed_config = DistributedConfig(tp_size=2)
    with pytest.raises(ValueError, match=r"attention_score='differential' cannot run with tensor parallelism"):
        PlugformerForCausalLM(parallel)
