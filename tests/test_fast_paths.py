"""The fast paths equal the eager reference: outputs *and gradients*, for every position scheme, with and without a
cache, in blocks small enough that every multi-block branch runs; and they keep no (B, H, N, N) tensor.

The blockwise SDPA kernel for score biases (`kernels.sdpa_relative_bias_forward`) is forced to 16-row blocks by
`BIAS_BLOCK_BYTES = 1`, ALiBi's causal kernel (`kernels_alibi`) by `ROWS = 16`; the additive kernel to 8-query
chunks.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from conftest import SCHEMES, additive_path, build, spy_additive_chunks, tiny_config
from tolerances import assert_same_step, attention_tolerances, model_tolerance, tolerance
from transformers import DynamicCache

import plugformer.kernels as kernels
import plugformer.kernels_additive as kernels_additive
import plugformer.kernels_alibi as kernels_alibi
from plugformer import PlugformerForCausalLM, PlugformerForMaskedLM, PlugformerForSequenceClassification
from plugformer.biases import RelativeBias
from plugformer.positions import POSITION_SCHEMES


BIAS_SCHEMES = [name for name in SCHEMES if POSITION_SCHEMES.get(name).has_bias]
# those whose bias reaches the kernels per distance (FIRE's depends on the query position: a `QueryPositionBias`)
RELATIVE_BIAS_SCHEMES = [name for name in BIAS_SCHEMES if POSITION_SCHEMES.get(name).bias_type is RelativeBias]


def has_parameters(scheme: str) -> bool:
    return len(list(POSITION_SCHEMES.get(scheme)(tiny_config(scheme=scheme)).parameters())) > 0


# a per-distance bias with parameters requires grad in training: sdpa runs the blockwise kernel's hand-written
# backward (FIRE's per-row bias goes to SDPA as a float mask instead)
LEARNED_BIAS_SCHEMES = [name for name in RELATIVE_BIAS_SCHEMES if has_parameters(name)]
LENGTH = 40  # three 16-row blocks, the last one short


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(kernels, "BIAS_BLOCK_BYTES", 1)
    monkeypatch.setattr(kernels_alibi, "ROWS", 16)


def model_pair(head, config, seed: int = 0):
    """The same weights on eager and on sdpa, in training mode (dropout 0 in the tiny preset)."""
    models = {}
    for kernel in ("eager", "sdpa"):
        torch.manual_seed(seed)
        variant = copy.deepcopy(config)
        variant._attn_implementation = kernel
        models[kernel] = head(variant).train()
    return models


def loss_and_grads(model, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_training_step(models, **inputs):
    logits_eager, grads_eager = loss_and_grads(models["eager"], **inputs)
    logits_sdpa, grads_sdpa = loss_and_grads(models["sdpa"], **inputs)
    # padding queries see no key: eager averages the masked keys, sdpa returns zeros
    real = inputs["attention_mask"].bool()
    if logits_eager.dim() == 3:
        logits_eager, logits_sdpa = logits_eager[real], logits_sdpa[real]
    assert_same_step(
        models["eager"].config,
        logits_sdpa,
        grads_sdpa,
        logits_eager,
        grads_eager,
        msg="sdpa",
        tokens=inputs["input_ids"].shape[1],
    )


def batch(length: int = LENGTH, pad: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    # a causal LM predicts the first real token from the last padding position, whose query sees no key: eager
    # averages the masked keys there, sdpa returns zeros (neither is meaningful), so it is not scored
    labels[1, : pad + 1 if pad else 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("score", ["scaled_dot", "multiplicative"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("pad", [0, 7], ids=["no-padding", "left-padding"])
def test_causal_training_step_equals_eager(score, scheme, pad, small_blocks):
    """Logits and every parameter's gradient (the bias table included) of sdpa equal eager's."""
    models = model_pair(PlugformerForCausalLM, tiny_config(score, scheme))
    assert_same_training_step(models, **batch(pad=pad))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_encoder_training_step_equals_eager(scheme, small_blocks):
    """Bidirectional: every block sees keys on both sides, with padding."""
    config = tiny_config("scaled_dot", scheme, is_causal=False)
    models = model_pair(PlugformerForMaskedLM, config)
    inputs = batch(pad=5)
    inputs["labels"] = inputs["labels"].masked_fill(torch.rand(inputs["labels"].shape) < 0.5, -100)
    assert_same_training_step(models, **inputs)


@pytest.mark.parametrize("scheme", BIAS_SCHEMES)
def test_classification_with_padding_equals_eager(scheme, small_blocks):
    config = tiny_config("dot", scheme, num_labels=3, pad_token_id=0)
    models = model_pair(PlugformerForSequenceClassification, config)
    inputs = batch(pad=9)
    inputs["input_ids"][1, :9] = 0
    inputs["labels"] = torch.tensor([0, 2])
    assert_same_training_step(models, **inputs)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "chunks", [[LENGTH], [20, 1, 19], [3, 34, 1, 1, 1]], ids=["full", "prefill-step-chunk", "steps"]
)
def test_cached_chunks_equal_full_forward(scheme, chunks, small_blocks):
    """A cache makes the kernel see a mask and key slots offset from the query slots: multi-block chunks after a
    prefill must still equal the full forward (and eager)."""
    models = model_pair(PlugformerForCausalLM, tiny_config("scaled_dot", scheme))
    ids = batch()["input_ids"]
    with torch.no_grad():
        reference = models["eager"].eval()(ids).logits
        cache, logits, start = DynamicCache(config=models["sdpa"].config), [], 0
        for size in chunks:
            logits.append(models["sdpa"].eval()(ids[:, start : start + size], cache=cache, use_cache=True).logits)
            start += size
    torch.testing.assert_close(
        torch.cat(logits, dim=1), reference, atol=model_tolerance(models["eager"].config, reference), rtol=0
    )


def relative_errors(result, reference) -> tuple[float, float]:
    """Relative L2 error of the logits, and the largest one over the parameters' gradients (leaving out gradients
    that are 0 up to rounding in fp32, where a relative error means nothing: FIRE's output bias adds a constant per
    head to every score, which the softmax ignores)."""
    (logits, grads), (ref_logits, ref_grads) = result, reference
    logits_error = (logits.float() - ref_logits).norm() / ref_logits.norm()
    grads_error = max((grads[n].float() - ref).norm() / ref.norm() for n, ref in ref_grads.items() if ref.norm() > 1e-8)
    return float(logits_error), float(grads_error)


@pytest.mark.parametrize("scheme", BIAS_SCHEMES)
def test_bf16_autocast_training_step_as_accurate_as_eager(scheme, small_blocks):
    """Under bf16 autocast the blockwise kernel (bf16 fused forward, fp32 softmax backward) is as close to the fp32
    reference as eager in bf16 is (measured: both about 0.3% on the logits, 0.8% on the gradients)."""
    models = model_pair(PlugformerForCausalLM, tiny_config("scaled_dot", scheme))
    reference = loss_and_grads(models["eager"], **batch())
    errors = {}
    for kernel, model in models.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            errors[kernel] = relative_errors(loss_and_grads(model, **batch()), reference)
    (eager_logits, eager_grads), (sdpa_logits, sdpa_grads) = errors["eager"], errors["sdpa"]
    assert sdpa_logits < 2 * eager_logits + 1e-3, errors
    assert sdpa_grads < 2 * eager_grads + 1e-3, errors


def saved_shapes(model, **inputs) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves for backward during one training step."""
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**inputs).loss.backward()
    return shapes


@pytest.mark.parametrize("scheme", LEARNED_BIAS_SCHEMES)
def test_learned_bias_keeps_no_score_sized_tensor(scheme, small_blocks):
    """The memory bound: sdpa keeps no (B, H, N, N) bias requiring grad (nor any other (·, N, N) tensor) for
    backward; eager, the reference, keeps several."""
    models = model_pair(PlugformerForCausalLM, tiny_config("scaled_dot", scheme))
    length = 48  # no other dimension of the tiny preset is 48

    def score_like(shapes, rows):  # (B or 1, H, > rows, N)
        return [shape for shape in shapes if len(shape) == 4 and shape[2] > rows and shape[3] == length]

    assert score_like(saved_shapes(models["eager"], **batch(length)), rows=length - 1)
    assert not score_like(saved_shapes(models["sdpa"], **batch(length)), rows=16)


@pytest.mark.parametrize("pad", [0, 5], ids=["no-mask", "padding-mask"])
def test_alibi_keeps_no_mask_only_the_allowed_keys_of_its_blocks(pad, small_blocks):
    """ALiBi's float mask is not kept for the fused backward. With a padding mask (`kernels_fixed` builds each block's
    again): of the 4-D tensors beside query, key, value and output blocks, only each block's boolean allowed keys
    (B or 1, 1, 16, keys), no (·, H, ·, ·) mask and none (·, N, N); a causal block sees only the keys up to its last
    query. Without one (`kernels_alibi`, no mask built at all): only query, key, value and output."""
    config = tiny_config("scaled_dot", "alibi")
    models = model_pair(PlugformerForCausalLM, config)
    shapes = [shape for shape in saved_shapes(models["sdpa"], **batch(length=48, pad=pad)) if len(shape) == 4]
    masks = [shape for shape in shapes if shape[-1] != config.head_dim]  # the rest: query, key, value, output blocks
    rows = 2 if pad else 1  # a padding mask differs per sequence
    expected = [(rows, 1, 16, keys) for keys in (16, 32, 48)] if pad else []
    assert masks == expected * config.num_hidden_layers


def prefix_lm_mask(length: int, prefix: int) -> torch.Tensor:
    """A custom additive 4-D mask (2, 1, N, N): the first `prefix` tokens see each other, the rest is causal."""
    allowed = torch.ones(length, length).tril().bool()
    allowed[:prefix, :prefix] = True
    return torch.zeros(2, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("scheme", BIAS_SCHEMES)
def test_a_custom_mask_that_shows_later_keys_is_honoured(scheme, small_blocks):
    """Causal blocks skip later keys only when the mask provably blocks them (`mask_blocks_the_future`): with a
    prefix-LM 4-D mask sdpa equals eager, outputs and gradients."""
    models = model_pair(PlugformerForCausalLM, tiny_config("scaled_dot", scheme))
    inputs = {"input_ids": batch()["input_ids"], "attention_mask": prefix_lm_mask(LENGTH, prefix=20)}
    (logits_eager, grads_eager), (logits_sdpa, grads_sdpa) = (
        loss_and_grads(models[k], **inputs, labels=inputs["input_ids"]) for k in ("eager", "sdpa")
    )
    assert_same_step(models["eager"].config, logits_sdpa, grads_sdpa, logits_eager, grads_eager, msg="sdpa")


def test_mask_blocks_the_future():
    causal = torch.ones(6, 6).tril().bool()[None, None]  # (1, 1, Q, K)
    assert kernels.mask_blocks_the_future(causal, 6, 6)
    padded = causal.repeat(2, 1, 1, 1)
    padded[1, :, :, :2] = False
    assert kernels.mask_blocks_the_future(padded, 6, 6)
    assert kernels.mask_blocks_the_future(causal[:, :, 3:], 3, 6)  # 3 new queries after 3 cached keys
    static = torch.cat([causal[:, :, 3:], torch.zeros(1, 1, 3, 4, dtype=torch.bool)], dim=-1)  # 4 empty slots
    assert kernels.mask_blocks_the_future(static, 3, 10)
    assert not kernels.mask_blocks_the_future(prefix_lm_mask(6, prefix=3), 6, 6)
    assert kernels.mask_blocks_the_future(prefix_lm_mask(6, prefix=1), 6, 6)  # additive float, causal


def kernel_inputs(dtype=torch.float64, length: int = 20, padded: bool = False, seed: int = 0):
    """GQA query/key/value (2 query heads on 1 key/value head), bias values and a mask for one causal layer."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(*shape, generator=generator, dtype=dtype, requires_grad=True)
        for shape in [(2, 2, length, 4), (2, 1, length, 4), (2, 1, length, 4), (2, 2 * length - 1)]
    ]
    mask = None
    if padded:  # left padding in the second row, causal
        allowed = torch.ones(length, length).tril().bool()[None, None].repeat(2, 1, 1, 1)
        allowed[1, :, :, :3] = False
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return tensors, mask


def relative_bias_attention(query, key, value, values, mask, dropout, seed=3):
    """`sdpa_relative_bias_forward` in training (a learned bias), the global RNG seeded first: a deterministic
    function of its inputs even with dropout."""
    torch.manual_seed(seed)
    module = types.SimpleNamespace(is_causal=True)
    bias = RelativeBias(values, query.shape[2], key.shape[2])
    output, _ = kernels.sdpa_relative_bias_forward(
        module, query, key, value, mask, scaling=0.5, dropout=dropout, position_bias=bias
    )
    return output


# gradcheck costs 9-36 s a case on the CPU: the default run takes the case with both a mask and dropout
@pytest.mark.parametrize(("padded", "dropout"), [
    pytest.param(False, 0.0, id="no-mask-0.0", marks=pytest.mark.slow),
    pytest.param(False, 0.3, id="no-mask-0.3", marks=pytest.mark.slow),
    pytest.param(True, 0.0, id="left-padding-0.0", marks=pytest.mark.slow),
    pytest.param(True, 0.3, id="left-padding-0.3"),
])  # fmt: skip
def test_learned_bias_backward_is_the_gradient_of_its_forward(padded, dropout, small_blocks):
    """fp64 gradcheck of the hand-written backward (two 16-row blocks, GQA): query, key, value and bias values."""
    (query, key, value, values), mask = kernel_inputs(padded=padded)
    assert torch.autograd.gradcheck(
        lambda *tensors: relative_bias_attention(*tensors, mask, dropout), (query, key, value, values)
    )


def test_learned_bias_dropout_forward_equals_the_formula_with_its_masks(small_blocks):
    """O = (softmax(s·QKᵀ + bias) ⊙ Z / (1 − p)) V per block, Z the keep mask of the seed each block draws."""
    (query, key, value, values), _ = kernel_inputs(dtype=torch.float32)
    output = relative_bias_attention(query, key, value, values, None, dropout=0.3)  # (B, Q, H, D)
    torch.manual_seed(3)  # the blocks draw their seeds in order from here
    expected = []
    for start, stop in [(0, 16), (16, 20)]:
        seed = int(torch.randint(2**62, (), device="cpu"))
        bias = RelativeBias(values, 20, 20).dense()[:, :, start:stop, :stop]  # (1, H, r, keys)
        scores = query[:, :, start:stop] @ key[:, :, :stop].repeat_interleave(2, dim=1).transpose(2, 3) * 0.5 + bias
        causal = torch.arange(start, stop)[:, None] >= torch.arange(stop)
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        keep = kernels._kept_scale(weights, 0.3, seed)
        torch.testing.assert_close(keep.unique(), torch.tensor([0.0, 1 / 0.7]))
        expected.append((weights * keep) @ value[:, :, :stop].repeat_interleave(2, dim=1))
    # the blocks against one pass, both fp32: softmax-weighted values of the whole causal layer, scaled by
    # 1 / (1 − p) where kept (`attention_tolerances`' output bound, its magnitude max|V| / 0.7)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    bias = RelativeBias(values, 20, 20).dense()
    atol = attention_tolerances(query, key, value, torch.zeros_like(query), 0.5, bias, causal)["output"] / 0.7
    torch.testing.assert_close(output, torch.cat(expected, dim=2).transpose(1, 2), atol=atol, rtol=0)


def test_attention_dropout_with_a_learned_bias_trains_on_the_hand_written_path(monkeypatch, small_blocks):
    """Nothing is checkpointed; a seed repeats the step exactly; the masks are drawn (not the dropout-free step);
    the bias table gets its gradient."""
    monkeypatch.setattr(kernels_additive, "checkpoint", None)  # the one checkpointing kernel: a call would fail
    results = {}
    for dropout, seed in [(0.3, 7), (0.3, 7), (0.0, 7)]:
        config = tiny_config("scaled_dot", "t5_bias", attention_dropout=dropout)
        model = model_pair(PlugformerForCausalLM, config)["sdpa"]
        torch.manual_seed(seed)
        results.setdefault(dropout, []).append(loss_and_grads(model, **batch(pad=4)))
    (logits, grads), (logits_again, grads_again) = results[0.3]
    torch.testing.assert_close(logits_again, logits, atol=0, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_again[name], grad, atol=0, rtol=0, msg=name)
    assert not torch.allclose(logits, results[0.0][0][0])
    assert grads["model.positions.relative_attention_bias.weight"].abs().sum() > 0


@pytest.mark.parametrize("scheme", BIAS_SCHEMES)
def test_additive_chunks_with_bias_equal_one_chunk(scheme, monkeypatch):
    """The additive kernel takes the `RelativeBias` per chunk, inside the checkpoint: 8-query chunks give the
    gradients of one chunk."""
    config = tiny_config("additive", scheme)
    results = {}
    for chunk in (None, 8):
        torch.manual_seed(0)
        model = PlugformerForCausalLM(copy.deepcopy(config)).train()
        for layer in model.model.layers:
            layer.self_attn.score.chunk_size = chunk
        results[chunk] = loss_and_grads(model, **batch(pad=5))
    # padding queries see no key; eager averages whichever keys a chunk scores there (meaningless either way)
    real = batch(pad=5)["attention_mask"].bool()
    (logits, grads), (whole_logits, whole_grads) = results[8], results[None]
    assert_same_step(config, logits[real], grads, whole_logits[real], whole_grads, msg="chunks", tokens=LENGTH)


@pytest.mark.parametrize("path", ["torch", "native"])
def test_additive_causal_chunks_score_only_the_keys_up_to_their_last_query(path, monkeypatch):
    """With a padding mask (the eager path always has one), chunk c of 8 queries scores keys 0..8c+7 only; under a
    prefix-LM mask every chunk scores all keys and 8-query chunks still equal one chunk."""
    additive_path(monkeypatch, path)
    chunks = spy_additive_chunks(monkeypatch)
    torch.manual_seed(0)
    model = PlugformerForCausalLM(copy.deepcopy(tiny_config("additive", "t5_bias"))).train()
    for layer in model.model.layers:
        layer.self_attn.score.chunk_size = 8
    model(**batch(pad=5)).loss.backward()
    assert sorted({(query[2], key[2]) for query, key in chunks}) == [(8, 8), (8, 16), (8, 24), (8, 32), (8, 40)]
    chunks.clear()
    inputs = {"input_ids": batch()["input_ids"], "attention_mask": prefix_lm_mask(LENGTH, prefix=12)}
    chunked = loss_and_grads(model, **inputs, labels=inputs["input_ids"])
    assert sorted({(query[2], key[2]) for query, key in chunks}) == [(8, 40)]
    for layer in model.model.layers:
        layer.self_attn.score.chunk_size = None
    whole = loss_and_grads(model, **inputs, labels=inputs["input_ids"])
    assert_same_step(model.config, *chunked, *whole, msg="chunks")


@pytest.mark.parametrize("scheme", RELATIVE_BIAS_SCHEMES)
@pytest.mark.parametrize(
    "query_offset,query_length,key_offset,key_length", [(0, 7, 0, 7), (5, 3, 0, 8), (0, 1, 0, 9), (2, 4, 1, 10)]
)
def test_relative_bias_rows_equal_the_dense_bias(scheme, query_offset, query_length, key_offset, key_length):
    positions = POSITION_SCHEMES.get(scheme)(tiny_config("scaled_dot", scheme))
    values = positions.bias_values(query_offset, query_length, key_offset, key_length, torch.zeros(1, query_length))
    bias = RelativeBias(values, query_length, key_length)
    query_slots = torch.arange(query_length) + query_offset
    key_slots = torch.arange(key_length) + key_offset
    dense = positions.bias(query_slots, key_slots)
    torch.testing.assert_close(bias.dense(), dense, atol=0, rtol=0)
    stop = query_length
    start = min(1, stop - 1)
    torch.testing.assert_close(bias.rows(start, stop, key_length - 1), dense[:, :, start:stop, : key_length - 1])
    # flex attention's score_mod reads bias[b, h, i, j] with index tensors (here: all of them at once)
    heads, queries, keys = torch.meshgrid(
        torch.arange(values.shape[0]), torch.arange(query_length), torch.arange(key_length), indexing="ij"
    )
    torch.testing.assert_close(bias[0, heads, queries, keys], dense[0], atol=0, rtol=0)


@pytest.mark.parametrize(
    "query_length,key_length,start,stop,keys", [(5, 5, 0, 5, 5), (7, 9, 2, 5, 9), (6, 6, 1, 4, 4), (1, 8, 0, 1, 8)]
)
def test_fold_rows_is_the_adjoint_of_rows(query_length, key_length, start, stop, keys):
    """`fold_rows` (the hand-written bias gradient) equals autograd's gradient of `rows`."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3, query_length + key_length - 1, dtype=torch.float64, generator=generator)
    values.requires_grad_(True)
    bias = RelativeBias(values, query_length, key_length)
    rows = bias.rows(start, stop, keys)[0]
    grad = torch.randn(rows.shape, dtype=torch.float64, generator=generator)
    rows.backward(grad)
    # fp64 sums of a distance's entries (at most one a row) in another order: terms at most a head's Σ|grad|
    atol = tolerance(torch.float64, magnitude=grad.abs().sum((-2, -1)).max().item(), length=grad.shape[-2])
    torch.testing.assert_close(bias.fold_rows(grad, start), values.grad, atol=atol, rtol=0)


@pytest.mark.parametrize("scheme", RELATIVE_BIAS_SCHEMES)
def test_flex_attention_reads_the_bias_per_distance(scheme, monkeypatch, tokens):
    """transformers' flex gets the `RelativeBias` itself: no (B, H, Q, K) bias is built, and logits equal eager's."""
    model = build(tiny_config("scaled_dot", scheme), "eager")
    with torch.no_grad():
        expected = model(tokens).logits
        monkeypatch.setattr(RelativeBias, "dense", lambda self: pytest.fail("a dense bias was built"))
        model.set_attn_implementation("flex_attention")
        torch.testing.assert_close(model(tokens).logits, expected, atol=model_tolerance(model.config, expected), rtol=0)


def test_relative_bias_refuses_values_of_another_length():
    with pytest.raises(ValueError, match="expected 9 distances"):
        RelativeBias(torch.zeros(2, 8), 4, 6)
