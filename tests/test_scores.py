"""Reference tests of the score functions against the formulas, computed with plain Python floats."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import additive_path, build, spy_additive_chunks, tiny_config
from test_additive_native import SCORE_STEPS as NATIVE_SCORE_STEPS
from test_additive_native import chunk_tolerances, score_gradient_tolerances
from tolerances import assert_close, model_tolerance, softmax_spread, tolerance
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from plugformer import ATTENTION_SCORES, kernels_additive


Q = [[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]]
K = [[0.0, 1.0], [2.0, -0.5], [-1.0, 1.5]]
V = [[1.0, 0.0, 2.0], [0.0, 1.0, -1.0], [0.5, 0.5, 0.5]]
W = [[1.0, 2.0], [0.0, -1.0]]  # bilinear W
W1 = [[0.5, -0.2], [0.1, 0.3]]  # additive W1 (d -> a)
W2 = [[-0.4, 0.2], [0.6, 0.1]]  # additive W2
ENERGY = [1.5, -2.0]
GAIN = 3.5  # cosine's learned scale g


def dot(a, b):
    return sum(x * y for x, y in zip(a, b, strict=True))


def matvec_t(matrix, vector):
    """vector @ matrix, i.e. (Mᵀ x)."""
    return [sum(vector[d] * matrix[d][a] for d in range(len(vector))) for a in range(len(matrix[0]))]


def attention_reference(score):
    """softmax_j(e(q_i, k_j)) · V, row by row, in Python floats."""
    out = []
    for q in Q:
        e = [score(q, k) for k in K]
        top = max(e)
        weights = [math.exp(x - top) for x in e]
        total = sum(weights)
        out.append([sum(w / total * v[c] for w, v in zip(weights, V, strict=True)) for c in range(len(V[0]))])
    return torch.tensor([out])  # (1, Q, D_v) for one head


def terms(a, b):
    return sum(abs(x * y) for x, y in zip(a, b, strict=True))


def magnitudes(matrix):
    return [[abs(x) for x in row] for row in matrix]


def norm(a):
    return math.sqrt(dot(a, a))


REFERENCE_SCORES = {
    "dot": lambda q, k: dot(q, k),
    "scaled_dot": lambda q, k: dot(q, k) / math.sqrt(2),
    "multiplicative": lambda q, k: dot(q, [sum(W[d][e] * k[e] for e in range(2)) for d in range(2)]),
    "cosine": lambda q, k: GAIN * dot(q, k) / math.sqrt(dot(q, q) * dot(k, k)),
    "additive": lambda q, k: dot(
        ENERGY, [math.tanh(x + y) for x, y in zip(matvec_t(W1, q), matvec_t(W2, k), strict=True)]
    ),
}


# the size of the terms each score is formed from (Σ_d |q_d k_d| for a dot product; for additive Σ_a |v_a| (|tanh| ≤
# 1 plus its argument's terms): the scale of its rounding in fp32
SCORE_TERMS = {
    "dot": lambda q, k: terms(q, k),
    "scaled_dot": lambda q, k: terms(q, k) / math.sqrt(2),
    "multiplicative": lambda q, k: terms([abs(x) for x in q], [terms(W[d], k) for d in range(2)]),
    "cosine": lambda q, k: GAIN * terms(q, k) / (norm(q) * norm(k)),
    "additive": lambda q, k: terms(ENERGY, [1 + x + y for x, y in zip(matvec_t(magnitudes(W1), magnitudes([q])[0]),
                                                                       matvec_t(magnitudes(W2), magnitudes([k])[0]),
                                                                       strict=True)]),
}  # fmt: skip
# rounded operations of a score (its products and sums, a norm's square root and division, a tanh)
SCORE_STEPS = 4


def formula_tolerance(name: str) -> float:
    """`atol` of a kernel's fp32 output against `attention_reference` of score `name` in Python floats: the softmax
    over the 3 keys of max|V|-sized values (its `softmax_spread`, exp and the division), and the scores' own rounding
    (SCORE_STEPS · max SCORE_TERMS in units of u), which moves a weight p_j by p_j (δs_j − Σ_k p_k δs_k)."""
    scores = torch.tensor([[REFERENCE_SCORES[name](q, k) for k in K] for q in Q], dtype=torch.float64)
    size = max(SCORE_TERMS[name](q, k) for q in Q for k in K)
    values = max(abs(x) for v in V for x in v)
    return tolerance(
        torch.float32, magnitude=values, length=len(K), spread=softmax_spread(scores) + SCORE_STEPS * size, steps=2
    )


# differential: one pair of query heads (maps 1 and 2) over two key/value heads, d_k = 2, the second layer
Q2 = [[-0.5, 1.0], [2.0, 0.5], [0.0, -1.5]]  # the second map's queries (query head 1); Q is the first's (head 0)
K2 = [[1.0, 1.0], [-0.5, 2.0], [0.5, -1.0]]  # key/value head 1's keys; K is head 0's
V2 = [[0.5, -1.0], [2.0, 0.0], [-1.0, 1.0]]  # key/value head 1's values; head 0's are V1
V1 = [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]
LAMBDAS = {"lambda_q1": [0.3, -0.2], "lambda_k1": [0.5, 0.4], "lambda_q2": [-0.1, 0.6], "lambda_k2": [0.2, 0.3]}
EPS = 1e-6  # the tiny preset's rms_norm_eps


def differential_reference(layer_idx: int = 1):
    """(1 − λ_init) · RMSNorm((softmax(q1·k1/√2) − λ softmax(q2·k2/√2)) [v1, v2]) row by row in Python floats, with
    λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init and λ_init = 0.8 − 0.6·exp(−0.3·layer_idx) (Ye et al. 2024, §2)."""

    def softmax(logits):
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        return [w / sum(weights) for w in weights]

    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
    lam = math.exp(dot(LAMBDAS["lambda_q1"], LAMBDAS["lambda_k1"])) - math.exp(
        dot(LAMBDAS["lambda_q2"], LAMBDAS["lambda_k2"])
    )
    lam += lambda_init
    values = [v1 + v2 for v1, v2 in zip(V1, V2, strict=True)]  # (K, 4): [v1, v2]
    out = []
    for q1, q2 in zip(Q, Q2, strict=True):
        first = softmax([dot(q1, k) / math.sqrt(2) for k in K])
        second = softmax([dot(q2, k) / math.sqrt(2) for k in K2])
        row = [sum((a - lam * b) * v[c] for a, b, v in zip(first, second, values, strict=True)) for c in range(4)]
        rms = math.sqrt(sum(x * x for x in row) / 4 + EPS)
        out.append([(1 - lambda_init) * x / rms for x in row])
    return torch.tensor([out])  # (1, Q, 2·D) for the one differential head


def differential_tolerance(layer_idx: int = 1) -> float:
    """`atol` of the fp32 differential head against `differential_reference`: each map's softmax over 3 keys (spread,
    scores of terms Σ|q_d k_d| / √2), of values of terms Σ_j p_j |v_j| + |λ| Σ_j p'_j |v_j|; the difference cancels,
    and RMSNorm divides its error by the row's rms (times 1 − λ_init); λ's exp and sums, the norm: 6 more steps."""
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
    lam = math.exp(dot(LAMBDAS["lambda_q1"], LAMBDAS["lambda_k1"])) - math.exp(
        dot(LAMBDAS["lambda_q2"], LAMBDAS["lambda_k2"])
    )
    lam += lambda_init
    values = torch.tensor([v1 + v2 for v1, v2 in zip(V1, V2, strict=True)], dtype=torch.float64)  # (K, 4)
    maps = [
        torch.tensor([[dot(q, k) / math.sqrt(2) for k in keys] for q in queries], dtype=torch.float64)
        for queries, keys in ((Q, K), (Q2, K2))
    ]
    first, second = (scores.softmax(-1) for scores in maps)  # (Q, K)
    difference = (first - lam * second) @ values  # (Q, 4)
    size = (first @ values.abs() + abs(lam) * second @ values.abs()).amax(-1)  # (Q,)
    amplification = (size / difference.pow(2).mean(-1).add(EPS).sqrt()).max().item()
    dots = max(terms(q, k) / math.sqrt(2) for queries, keys in ((Q, K), (Q2, K2)) for q in queries for k in keys)
    spread = max(softmax_spread(scores) for scores in maps) + SCORE_STEPS * dots
    return tolerance(torch.float32, magnitude=(1 - lambda_init) * amplification, length=len(K), spread=spread, steps=8)


def run_differential(kernel: str, layer_idx: int = 1):
    """The score's hooks around a kernel call, as the attention layer makes them."""
    config = tiny_config("differential", "none", num_attention_heads=2, num_key_value_heads=2, hidden_size=4)
    score = ATTENTION_SCORES.get("differential")(config, layer_idx)
    with torch.no_grad():
        for name, vector in LAMBDAS.items():
            getattr(score, name).copy_(torch.tensor(vector))
    module = SimpleNamespace(num_key_value_groups=1, training=False, is_causal=False, config=config)
    query = score.prepare_query(torch.tensor([Q, Q2])[None])  # (1, 2, 3, 2)
    key = score.prepare_key(torch.tensor([K, K2])[None])
    value = score.prepare_value(torch.tensor([V1, V2])[None])  # (1, 2, 3, 4)
    function = score.eager_kernel if kernel == "eager" else sdpa_attention_forward
    out, _ = function(module, query, key, value, None, scaling=score.scaling, **score.kernel_kwargs())
    return score.prepare_output(out)[:, :, 0]  # (1, Q, 2·D) of the single differential head


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_differential_matches_formula(kernel):
    atol = differential_tolerance()
    torch.testing.assert_close(run_differential(kernel), differential_reference(), atol=atol, rtol=0)


def stick_breaking_reference():
    """o_i = Σ_{j<i} A_ij v_j, A_ij = β_ij ∏_{j<k<i} (1 − β_ik), β_ij = σ(q_i·k_j / √2), row by row in Python floats
    (Tan et al. 2024, §2), causal: the query's own key and the later ones take no share, and nothing normalises."""
    out = []
    for i, q in enumerate(Q):
        beta = [1 / (1 + math.exp(-dot(q, k) / math.sqrt(2))) for k in K]
        row = [0.0] * len(V[0])
        for j in range(i):
            weight = beta[j]
            for k in range(j + 1, i):
                weight *= 1 - beta[k]
            row = [r + weight * v for r, v in zip(row, V[j], strict=True)]
        out.append(row)
    return torch.tensor([out], dtype=torch.float64)  # (1, Q, D_v) for one head


def test_stick_breaking_matches_formula_in_float64():
    """The kernel in float64 (its log-space sums) against the loops: exact up to fp64 rounding."""
    config = tiny_config("stick_breaking", "none", num_attention_heads=1, num_key_value_heads=1, hidden_size=2)
    score = ATTENTION_SCORES.get("stick_breaking")(config)
    module = SimpleNamespace(num_key_value_groups=1, training=False, is_causal=True, config=config)
    query, key, value = (torch.tensor(x, dtype=torch.float64)[None, None] for x in (Q, K, V))  # (1, 1, 3, ·)
    out, weights = score.eager_kernel(module, query, key, value, None, scaling=score.scaling)
    torch.testing.assert_close(out[:, :, 0], stick_breaking_reference(), atol=1e-14, rtol=0)
    assert weights[0, 0].triu().abs().max() == 0 and weights.sum(-1).max() < 1  # strictly causal, not normalised


# scores whose reference is not one e(q, k) per pair of a query and a key
OUTPUT_REFERENCES = {"differential": differential_reference, "stick_breaking": stick_breaking_reference}


def score_with_weights(name):
    config = tiny_config(name, "none", num_attention_heads=1, num_key_value_heads=1, hidden_size=2)
    score = ATTENTION_SCORES.get(name)(config)
    with torch.no_grad():
        if name == "multiplicative":
            score.weight.copy_(torch.tensor([W]))
        if name == "cosine":
            score.scale.copy_(torch.tensor([GAIN]))
        if name == "additive":
            score.query_weight.copy_(torch.tensor([W1]))
            score.key_weight.copy_(torch.tensor([W2]))
            score.energy.copy_(torch.tensor([ENERGY]))
    return config, score


def run_kernel(name, kernel):
    config, score = score_with_weights(name)
    module = SimpleNamespace(num_key_value_groups=1, training=False, is_causal=False, config=config)
    query = score.prepare_query(torch.tensor(Q)[None, None])  # (1, 1, 3, 2)
    key = score.prepare_key(torch.tensor(K)[None, None])
    value = torch.tensor(V)[None, None]
    function = score.eager_kernel if kernel == "eager" else sdpa_attention_forward
    out, _ = function(module, query, key, value, None, scaling=score.scaling, **score.kernel_kwargs())
    return out[:, :, 0]  # (1, Q, D_v) of the single head


@pytest.mark.parametrize("name", list(REFERENCE_SCORES))
def test_score_matches_formula_on_eager(name):
    expected = attention_reference(REFERENCE_SCORES[name])
    torch.testing.assert_close(run_kernel(name, "eager"), expected, atol=formula_tolerance(name), rtol=0)


@pytest.mark.parametrize("name", [n for n in REFERENCE_SCORES if ATTENTION_SCORES.get(n).dot_product])
def test_dot_product_scores_run_exactly_on_sdpa(name):
    expected = attention_reference(REFERENCE_SCORES[name])
    torch.testing.assert_close(run_kernel(name, "sdpa"), expected, atol=formula_tolerance(name), rtol=0)


def test_every_registered_score_has_a_reference():
    assert set(ATTENTION_SCORES.names()) == set(REFERENCE_SCORES) | set(OUTPUT_REFERENCES)


def test_multiplicative_starts_as_scaled_dot():
    from plugformer import PlugformerForCausalLM

    model = PlugformerForCausalLM(tiny_config("multiplicative", "none"))
    weight = model.model.layers[0].self_attn.score.weight
    expected = torch.eye(8).expand(4, 8, 8) / math.sqrt(8)
    torch.testing.assert_close(weight.detach(), expected)


def test_cosine_starts_at_the_papers_scale_and_bounds_the_logits():
    """g starts at log2(L² − L) (Henry et al. 2020), L = max_position_embeddings = 64 in the tiny preset; every logit
    g·q̂·k̂ lies within ±g, however large q and k are."""
    from plugformer import PlugformerForCausalLM

    score = PlugformerForCausalLM(tiny_config("cosine", "none")).model.layers[0].self_attn.score
    torch.testing.assert_close(score.scale.detach(), torch.full((4,), math.log2(64 * 63)))
    query = score.prepare_query(1e3 * torch.randn(1, 4, 5, 8))
    key = score.prepare_key(1e3 * torch.randn(1, 4, 5, 8))
    logits = query @ key.transpose(2, 3)
    assert logits.abs().max() <= math.log2(64 * 63) + 1e-4


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_the_value_and_output_hooks_run_after_the_cache_and_before_o_proj(kernel, tokens, monkeypatch):
    """`prepare_value` widens the values the kernel gets (here to [v, 2v], `value_width` 2) and `prepare_output` folds
    the kernel's output back before `o_proj` (here (o₁ + o₂) / 3 = o): the logits stay those of the model without
    the hooks, in causal self-attention (full forward and cached decoding, the cache holding the d_k-wide projected
    values) and in a seq2seq decoder's cross-attention."""
    from plugformer import PlugformerForConditionalGeneration

    calls = []

    def widen(self, value):
        calls.append("value")
        return torch.cat([value, 2 * value], dim=-1)  # (B, H_kv, K, 2·D)

    def fold(self, output):
        calls.append("output")
        return (output[..., : self.head_dim] + output[..., self.head_dim :]) / 3  # (B, Q, H, D)

    config = tiny_config("scaled_dot", "rope")
    seq2seq_config = tiny_config("scaled_dot", "rope", is_encoder_decoder=True, pad_token_id=0)
    seq2seq_config._attn_implementation = kernel
    with torch.no_grad():
        expected = build(config, kernel)(tokens).logits
        torch.manual_seed(0)
        expected_seq2seq = PlugformerForConditionalGeneration(seq2seq_config).eval()(tokens, decoder_input_ids=tokens)
        score = ATTENTION_SCORES.get("scaled_dot")
        for name, value in (("value_width", 2), ("prepare_value", widen), ("prepare_output", fold)):
            monkeypatch.setattr(score, name, value)
        model = build(config, kernel)
        atol = model_tolerance(config, expected)  # wider values folded back: fp32's rounding through the model
        torch.testing.assert_close(model(tokens).logits, expected, atol=atol, rtol=0)
        cache = DynamicCache(config=model.config)
        steps = [model(tokens[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(tokens.shape[1])]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=atol, rtol=0)
        assert cache.layers[0].values.shape[-1] == config.head_dim
        torch.manual_seed(0)
        hooked = PlugformerForConditionalGeneration(seq2seq_config).eval()(tokens, decoder_input_ids=tokens)
        atol = model_tolerance(seq2seq_config, expected_seq2seq.logits)
        torch.testing.assert_close(hooked.logits, expected_seq2seq.logits, atol=atol, rtol=0)
    # 2 layers: full forward + 12 steps; seq2seq: 2 encoder, 2 decoder self- and 2 cross-attention layers
    assert calls.count("value") == calls.count("output") == 2 * (1 + tokens.shape[1]) + 6


def additive_inputs(batch=2, heads=4, length=40, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(batch, heads, length, dim, generator=generator) for _ in range(3))
    energy = torch.randn(heads, dim, generator=generator)
    causal = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
    return query, key, value, energy, causal


def naive_additive(query, key, value, energy, mask):
    scores = torch.einsum("bhqka,ha->bhqk", torch.tanh(query[:, :, :, None] + key[:, :, None]), energy) + mask
    return torch.matmul(scores.softmax(-1), value).transpose(1, 2)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("path", ["torch", "native"])
def test_additive_kernel_bounds_memory_per_chunk(path, training, monkeypatch):
    """With a 16 KiB budget no chunk may exceed it, and the result is unchanged: on the torch path the chunk's
    (B, H, c, K, A) tanh tensor, on the native path (which forms no such tensor) its (B, H, c, K) scores."""
    additive_path(monkeypatch, path)
    query, key, value, energy, mask = additive_inputs()
    monkeypatch.setattr(kernels_additive, "ADDITIVE_CHUNK_BYTES", 16 * 1024)
    monkeypatch.setattr(kernels_additive, "NATIVE_CHUNK_BYTES", 16 * 1024)
    chunks = spy_additive_chunks(monkeypatch)
    module = SimpleNamespace(num_key_value_groups=1, training=training, config=SimpleNamespace(output_attentions=False))
    out, weights = kernels_additive.additive_attention_forward(module, query, key, value, mask, energy=energy)
    # the chunks against one pass of the formula, both fp32: the bound of a chunk against fp64 (`chunk_tolerances`)
    atol = chunk_tolerances(query, key, value, energy, 0.0, mask, torch.zeros_like(query))["output"]
    torch.testing.assert_close(out, naive_additive(query, key, value, energy, mask), atol=atol, rtol=0)
    assert weights is None
    assert len(chunks) > 1
    for (b, h, c, a), (_, _, k, _) in chunks:
        assert b * h * c * k * (a if path == "torch" else 1) * 4 <= 16 * 1024


def test_additive_checkpointed_chunks_give_the_same_gradients():
    query, key, value, energy, mask = additive_inputs(length=24)
    grads = []
    for chunk_size in (24, 5):
        leaves = [t.clone().requires_grad_() for t in (query, key, value, energy)]
        module = SimpleNamespace(num_key_value_groups=1, training=True, config=SimpleNamespace(output_attentions=False))
        out, _ = kernels_additive.additive_attention_forward(
            module, *leaves[:3], mask, energy=leaves[3], chunk_size=chunk_size
        )
        out.square().sum().backward()
        grads.append([leaf.grad for leaf in leaves])
        upstream = 2 * out.detach().transpose(1, 2)  # d(Σ out²)/d out, (B, H, Q, D) as the kernel's inputs
    # both fp32, each within a chunk's bound against fp64 (`chunk_tolerances`; upstream 2·out)
    bounds = chunk_tolerances(query, key, value, energy, 0.0, mask, upstream)
    for name, full, chunked in zip(("query", "key", "value", "energy"), *grads, strict=True):
        torch.testing.assert_close(chunked, full, atol=bounds[name], rtol=0, msg=name)


def fp64_leaves(*shapes, scale=2.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).requires_grad_() for shape in shapes
    ]


@pytest.mark.parametrize("path", ["numpy", "torch-tanh-numpy-contraction", "torch"])
def test_additive_scores_function_equals_autograd_in_fp64(path, monkeypatch):
    """`AdditiveScores` (gradients formed by hand from the kept tanh) gives the scores s_ij = Σ_a v_a tanh(q_ia + k_ja)
    and the gradients of plain autograd over that formula, in fp64, on each of its paths (numpy's tanh and contraction,
    torch's tanh and numpy's contraction, torch only); a graph kept with `retain_graph` backpropagates twice to the
    same gradients."""
    monkeypatch.setattr(kernels_additive, "numpy_tanh_is_faster", lambda threads: path == "numpy")
    if path == "torch":
        monkeypatch.setattr(kernels_additive, "_numpy_view", lambda tensor: None)
    query, key, energy = fp64_leaves((2, 3, 5, 4), (2, 3, 7, 4), (3, 4))
    upstream = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scores = kernels_additive.AdditiveScores.apply(query, key, energy)
    reference = torch.einsum("bhqka,ha->bhqk", torch.tanh(query[:, :, :, None] + key[:, :, None]), energy)
    # fp64 both sides, as test_additive_native's fp32 bounds: a score sums 4 terms of size |v_a| (SCORE_STEPS each);
    # a gradient sums |upstream| · |v_a| over keys (query) or queries (key), |upstream| over every pair (energy)
    energy_size, size = energy.detach().abs(), upstream.abs()
    atol = tolerance(torch.float64, magnitude=energy_size.sum(-1).max().item(), length=4, steps=NATIVE_SCORE_STEPS)
    torch.testing.assert_close(scores, reference, atol=atol, rtol=0)
    bounds = score_gradient_tolerances(energy_size, size, torch.float64)
    expected = torch.autograd.grad(reference, (query, key, energy), upstream)
    for _ in range(2):
        grads = torch.autograd.grad(scores, (query, key, energy), upstream, retain_graph=True)
        for name, grad, want in zip(("query", "key", "energy"), grads, expected, strict=True):
            torch.testing.assert_close(grad, want, atol=bounds[name], rtol=0, msg=name)


def test_additive_kernel_gradients_with_padding_and_causal_mask_equal_autograd():
    """The checkpointed chunks of the kernel in training (4-query chunks, causal key truncation, `AdditiveScores`)
    give the gradients of plain autograd over the whole formula (softmax(v·tanh(q + k) masked) V), fp64 inputs, with
    a causal mask and a left-padded row; the padding queries, which see no key, are left out of the loss.

    Both sides take the softmax and its backward in fp32 (as eager does), the kernel over rows truncated to the causal
    prefix, the reference over all keys: torch's vectorised softmax rounds rows of 4 and of 11 keys differently (not
    its scalar one, `ATEN_CPU_CAPABILITY=default`), so the two agree within fp32's rounding of the softmax
    (`tolerances`): the output from the values' size, each gradient from the terms its sum adds."""
    length, heads, dim = 11, 3, 4
    query, key, value, energy = fp64_leaves(*[(2, heads, length, dim)] * 3, (heads, dim))
    real = torch.ones(2, length, dtype=torch.bool)
    real[1, :3] = False  # the second row is left-padded by 3
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]  # (B, 1, Q, K)
    upstream = torch.randn(2, length, heads, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    upstream = upstream * real[:, :, None, None]
    module = SimpleNamespace(
        num_key_value_groups=1, training=True, is_causal=True, config=SimpleNamespace(output_attentions=False)
    )
    out, _ = kernels_additive.additive_attention_forward(module, query, key, value, mask, energy=energy, chunk_size=4)
    exact = torch.einsum("bhqka,ha->bhqk", torch.tanh(query[:, :, :, None] + key[:, :, None]), energy)  # (B, H, Q, K)
    scores = exact.float().masked_fill(~mask, torch.finfo(torch.float32).min)  # the kernel scores in fp32, as eager
    reference = torch.matmul(scores.softmax(-1).to(value.dtype), value).transpose(1, 2)  # (B, Q, H, D)
    # fp32's rounding of the softmax: exp's argument rounded by u·spread, its sum over the keys, exp and the division
    bound = {"length": length, "spread": softmax_spread(exact, mask), "steps": 2}
    real_rows = real[:, :, None, None]
    assert_close(out * real_rows, reference * real_rows, torch.float32, magnitude=value.abs().max().item(), **bound)
    leaves = (query, key, value, energy)
    grads = torch.autograd.grad(out, leaves, upstream)
    expected = torch.autograd.grad(reference, leaves, upstream)
    with torch.no_grad():  # what each gradient sums: ds_ij = p_ij (g_ij − Σ_k p_ik g_ik) errs by u·p_ij (|g_ij| + ...)
        weights = exact.masked_fill(~mask, -math.inf).softmax(-1).nan_to_num(0.0)  # (B, H, Q, K)
        upstream_rows = upstream.transpose(1, 2)  # (B, H, Q, D)
        g = upstream_rows.matmul(value.transpose(2, 3)).abs()  # |dL/dp| (B, H, Q, K)
        terms = weights * (g + (weights * g).sum(-1, keepdim=True))  # (B, H, Q, K)
        size = energy.abs().max().item()  # dq, dk: v_a Σ ds (1 − t²); dv: Σ_i p_ij dL/do_i; denergy: Σ ds t (|t| ≤ 1)
        magnitudes = {
            "query": size * terms.sum(-1).max().item(),
            "key": size * terms.sum(-2).max().item(),
            "value": weights.transpose(2, 3).matmul(upstream_rows.abs()).max().item(),
            "energy": terms.sum((0, 2, 3)).max().item(),
        }
    for (name, magnitude), grad, want in zip(magnitudes.items(), grads, expected, strict=True):
        assert_close(grad, want, torch.float32, magnitude=magnitude, **bound, msg=name)


def test_additive_model_scores_on_the_numpy_path_on_the_cpu(monkeypatch):
    """Without the native kernel, a CPU fp32 model's training step and its decoding score every chunk with numpy's
    contraction (and its tanh where it is the faster): the energy reaches the kernel as a Parameter and the projected
    queries in an einsum's layout, neither of which may send it to torch's contraction (2x slower on one thread)."""
    additive_path(monkeypatch, "torch")
    seen = []
    original = kernels_additive._numpy_view

    def spy(tensor):
        seen.append(original(tensor) is not None)
        return seen[-1] and original(tensor)

    monkeypatch.setattr(kernels_additive, "_numpy_view", spy)
    model = build(tiny_config("additive", "rope")).train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens).loss.backward()
    model.eval().generate(tokens[:, :4], max_new_tokens=3, do_sample=False)
    assert seen and all(seen)


def test_numpy_tanh_choice_is_timed_once_per_thread_count():
    """The tanh path is chosen once per process and torch thread count (a bool, cached), so every chunk of a run
    takes the same one; the timing (torch's tanh on one thread) leaves torch's thread count as it found it."""
    threads = torch.get_num_threads()
    kernels_additive.numpy_tanh_is_faster.cache_clear()
    choice = kernels_additive.numpy_tanh_is_faster(threads)
    assert torch.get_num_threads() == threads
    assert isinstance(choice, bool)
    assert kernels_additive.numpy_tanh_is_faster(threads) is choice
    assert kernels_additive.numpy_tanh_is_faster.cache_info().hits >= 1
