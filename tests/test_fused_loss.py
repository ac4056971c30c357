"""The fused linear cross-entropy (`plugformer.losses`): loss and every gradient equal the unfused computation
(transformers' `ForCausalLMLoss` / `fixed_cross_entropy` on the full logits), and the heads switch to it only when
asked, in training, with labels."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import gradient_tolerance, tolerance
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss, fixed_cross_entropy

from plugformer import PlugformerConfig, PlugformerForCausalLM, PlugformerForMaskedLM
from plugformer.losses import causal_targets, linear_cross_entropy


def random_case(rows=37, hidden=16, vocab=50, ignored=0.3, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=generator, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=generator, dtype=dtype) * 0.5
    y = torch.randint(0, vocab, (rows,), generator=generator)
    y[torch.rand(rows, generator=generator) < ignored] = -100
    return h.requires_grad_(), w.requires_grad_(), y


def cross_entropy_tolerances(h, w, count) -> tuple[float, float, float]:
    """`atol` of the mean cross-entropy of logits h Wᵀ over `count` items and of its gradients in h and W, two fp64
    computations (chunks against the full logits): a logit sums terms of size L = max(max |h| |W|ᵀ, 1) over the
    hidden size, a row's loss lse − logit_y twice that; a weight p_v moves by p_v (δ_v − Σ p δ), so dh = Σ_v (p_v −
    [v = y]) w_v / count sums terms 2·max|w|·L over the vocabulary, dW the rows' 2·Σ_r |h_r|·L."""
    count = max(int(count), 1)
    with torch.no_grad():
        size = max((h.abs() @ w.abs().T).max().item(), 1.0)
        growth = {"length": max(h.shape[-1], w.shape[0]), "steps": 4}
        loss = tolerance(torch.float64, magnitude=2 * size, **growth)
        dh = tolerance(torch.float64, magnitude=2 * w.abs().max().item() * size / count, **growth)
        dw = tolerance(
            torch.float64,
            magnitude=2 * h.abs().sum(0).max().item() * size / count,
            length=max(h.shape[0], w.shape[0]),
            steps=4,
        )
    return loss, dh, dw


@pytest.mark.parametrize("softcap", [None, 2.0])  # 2: below most of the logits (Gemma 2's 30 at its sizes)
@pytest.mark.parametrize("num_items", [None, 50, "tensor"])
@pytest.mark.parametrize("chunk_elements", [1, 7 * 50, 1 << 23])  # one row a chunk, a ragged last chunk, one chunk
def test_linear_cross_entropy_equals_the_full_logits_loss_and_gradients(num_items, chunk_elements, softcap):
    h, w, y = random_case()
    num_items = torch.tensor(50) if num_items == "tensor" else num_items
    logits = h @ w.T if softcap is None else softcap * torch.tanh(h @ w.T / softcap)  # autograd's own derivative
    reference = fixed_cross_entropy(logits, y, num_items)
    expected = torch.autograd.grad(reference, (h, w))
    loss = linear_cross_entropy(h, w, y, num_items, chunk_elements=chunk_elements, softcap=softcap)
    got = torch.autograd.grad(loss, (h, w))
    atol, *gradients = cross_entropy_tolerances(h, w, int(num_items) if num_items is not None else (y != -100).sum())
    torch.testing.assert_close(loss, reference, rtol=0, atol=atol)
    for a, b, bound in zip(got, expected, gradients, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=bound)


def test_linear_cross_entropy_scales_by_the_outer_gradient_and_skips_unneeded_gradients():
    h, w, y = random_case(seed=1)
    (g,) = torch.autograd.grad(3.0 * linear_cross_entropy(h, w.detach(), y), (h,))
    (expected,) = torch.autograd.grad(3.0 * fixed_cross_entropy(h @ w.detach().T, y), (h,))
    atol = 3 * cross_entropy_tolerances(h, w, (y != -100).sum())[1]  # the outer gradient 3 scales every term
    torch.testing.assert_close(g, expected, rtol=0, atol=atol)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y), fixed_cross_entropy(h @ w.T, y))


def test_a_batch_without_labels_gives_a_zero_loss_with_zero_gradients():
    h, w, y = random_case(ignored=1.0)
    loss = linear_cross_entropy(h, w, y)
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any()


def test_causal_targets_shift_as_transformers_does():
    labels = torch.tensor([[5, 6, -100, 7]])
    assert causal_targets(labels).tolist() == [[6, -100, 7, -100]]
    shifted = torch.tensor([[1, 2, 3, 4]])
    assert causal_targets(labels, shift_labels=shifted) is shifted


def tiny(is_causal=True, tie=True, cap=None):
    config = PlugformerConfig.from_preset(
        "tiny", is_causal=is_causal, tie_word_embeddings=tie, final_logit_softcapping=cap
    )
    config._attn_implementation = "sdpa"
    return config


def head_tolerance(logits) -> float:
    """`atol` of a loss from `logits` `(B, N, V)` upcast to fp32 (transformers' loss) against the fused fp64 one: a
    row's lse − logit_y of terms twice max(|logits|, 1), through the softmax over the vocabulary."""
    size = max(logits.detach().abs().max().item(), 1.0)
    return tolerance(torch.float32, magnitude=2 * size, length=logits.shape[-1], steps=4)


def loss_and_grads(model, fused: bool, **inputs):
    model.fused_loss = fused
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("num_items", [None, 11])
@pytest.mark.parametrize("cap", [None, 0.3])  # final_logit_softcapping: the tiny model's logits reach ~0.6
def test_causal_lm_fused_loss_equals_the_unfused_head(tie, num_items, cap):
    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny(tie=tie, cap=cap)).double().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[1, -2:] = -100  # padding
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    plain, plain_grads = loss_and_grads(model, False, input_ids=ids, labels=labels, **kwargs)
    fused, fused_grads = loss_and_grads(model, True, input_ids=ids, labels=labels, **kwargs)
    reference = ForCausalLMLoss(plain.logits, labels, model.config.vocab_size, **kwargs)
    # transformers upcasts the logits to float32 (even from float64): equal to float32's precision, the loss's terms
    # of the logits' size, its gradients as a training step's (`gradient_tolerance` in fp32)
    atol = head_tolerance(plain.logits)
    torch.testing.assert_close(fused.loss, reference, rtol=0, atol=atol, check_dtype=False)
    torch.testing.assert_close(plain.loss, reference)
    assert fused.logits is None and plain.logits.shape == (2, 9, model.config.vocab_size)
    assert fused_grads.keys() == plain_grads.keys()
    assert ("model.embed_tokens.weight" in fused_grads) and (("lm_head.weight" in fused_grads) != tie)
    atol = gradient_tolerance(model.config, plain_grads, ids.shape[1])
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=0, atol=atol, msg=name)


def test_causal_lm_fused_loss_takes_pre_shifted_labels():
    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny()).double().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    shifted = causal_targets(ids)
    shifted[1, 0] = -100
    model.fused_loss = True
    fused = model(input_ids=ids, labels=ids, shift_labels=shifted).loss
    model.fused_loss = False
    plain = model(input_ids=ids, labels=ids, shift_labels=shifted)
    atol = head_tolerance(plain.logits)  # the unfused loss's fp32 upcast
    torch.testing.assert_close(fused, plain.loss, rtol=0, atol=atol, check_dtype=False)


def test_the_fused_loss_runs_only_in_training_with_labels():
    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny())
    model.fused_loss = True
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    assert model.train()(input_ids=ids, labels=ids).logits is None
    evaluated = model.eval()(input_ids=ids, labels=ids)  # evaluation (and generation) keep the logits
    assert evaluated.logits is not None and evaluated.loss is not None
    assert model.train()(input_ids=ids).logits is not None  # no labels: the logits
    model.lm_head.weight.ds_id = 0  # a DeepSpeed ZeRO-3 partition: only the head's own call gathers it
    assert model(input_ids=ids, labels=ids).logits is not None
    del model.lm_head.weight.ds_id
    fresh = PlugformerForCausalLM(copy.deepcopy(model.config)).train()
    assert fresh(input_ids=ids, labels=ids).logits is not None  # off by default


def test_a_head_swapped_by_fsdp2_keeps_the_fused_loss():
    """accelerate's FSDP2 shards the head with the final norm (and the tied embeddings): `fully_shard` swaps its class
    for `FSDPLinear` (bases `(FSDPModule, nn.Linear)`), whose weight the model's forward sees gathered. The fused loss
    stayed off there before (tests/test_fused_loss_distributed.py's FSDP2 runs count the calls)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny()).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    model.fused_loss = False
    expected = model(input_ids=ids, labels=ids).loss
    model.fused_loss = True
    model.lm_head.__class__ = type("FSDPLinear", (fsdp.FSDPModule, nn.Linear), {})  # as `fully_shard` names it
    fused = model(input_ids=ids, labels=ids)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, expected)


def test_a_lora_adapter_on_the_head_keeps_the_unfused_loss():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny(tie=False))
    model = peft.get_peft_model(model, peft.LoraConfig(target_modules=["lm_head"], r=2, init_lora_weights=False))
    model.base_model.model.fused_loss = True
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    assert model.train()(input_ids=ids, labels=ids).logits is not None  # the weight alone would miss the adapter


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("cap", [None, 0.3])
def test_masked_lm_fused_loss_equals_the_unfused_head(tie, cap):
    torch.manual_seed(0)
    model = PlugformerForMaskedLM(tiny(is_causal=False, tie=tie, cap=cap)).double().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 5], labels[1, 6] = ids[0, 2], ids[1, 5], ids[1, 6]
    plain, plain_grads = loss_and_grads(model, False, input_ids=ids, labels=labels)
    fused, fused_grads = loss_and_grads(model, True, input_ids=ids, labels=labels)
    reference = nn.functional.cross_entropy(plain.logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(fused.loss, reference, rtol=0, atol=head_tolerance(plain.logits), check_dtype=False)
    assert fused.logits is None
    assert fused_grads.keys() == plain_grads.keys()
    atol = gradient_tolerance(model.config, plain_grads, ids.shape[1])  # the unfused head's fp32 upcast
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=0, atol=atol, msg=name)


def test_the_fused_loss_under_bf16_autocast_matches_the_unfused_one():
    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny()).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, plain_grads = loss_and_grads(model, False, input_ids=ids, labels=ids)
        fused, fused_grads = loss_and_grads(model, True, input_ids=ids, labels=ids)
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-2, atol=1e-2)
    for name, grad in plain_grads.items():
        cosine = nn.functional.cosine_similarity(fused_grads[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.99, name


# the training stages: fused by default, the same training as the unfused loss, Liger refused
STAGE_FLAGS = ["--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--max_steps", "3",
               "--per_device_train_batch_size", "4", "--train_examples", "48", "--dev_examples", "8",
               "--test_examples", "8", "--exact_match_examples", "0", "--dataloader_pin_memory", "false",
               "--learning_rate", "1e-3", "--seed", "3"]  # fmt: skip
PRETRAIN = ["--preset", "tiny", "--vocab_size", "300", "--block_size", "32", "--max_position_embeddings", "128"]
SFT = ["--bf16", "false", "--activation_checkpointing", "false", "--max_length", "64"]


def trained_weights(directory):
    from safetensors.torch import load_file

    return load_file(f"{directory}/model.safetensors")


def count_fused_calls(monkeypatch) -> list:
    import plugformer.losses

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return linear_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(plugformer.losses, "linear_cross_entropy", counted)
    return calls


def test_pretrain_and_sft_train_the_same_weights_fused_and_unfused(tmp_path, monkeypatch):
    from plugformer.training import run_stage

    calls = count_fused_calls(monkeypatch)
    for fused in ("true", "false"):
        before = len(calls)
        run_stage(
            "pretrain",
            ["--output_dir", str(tmp_path / f"pretrain-{fused}"), *STAGE_FLAGS, *PRETRAIN, "--fused_loss", fused],
        )
        assert (len(calls) > before) == (fused == "true")  # the default stage's model computes the fused loss
    unfused = trained_weights(tmp_path / "pretrain-false")
    for name, tensor in trained_weights(tmp_path / "pretrain-true").items():
        torch.testing.assert_close(tensor, unfused[name], rtol=1e-4, atol=1e-5, msg=name)
    # SFT: TRL's own chunked head (the default) against the model's unfused loss
    parent = str(tmp_path / "pretrain-true")
    for fused in ("true", "false"):
        run_stage(
            "sft",
            [
                "--output_dir",
                str(tmp_path / f"sft-{fused}"),
                *STAGE_FLAGS,
                *SFT,
                "--model_name_or_path",
                parent,
                "--fused_loss",
                fused,
            ],
        )
    unfused = trained_weights(tmp_path / "sft-false")
    for name, tensor in trained_weights(tmp_path / "sft-true").items():
        torch.testing.assert_close(tensor, unfused[name], rtol=1e-4, atol=1e-5, msg=name)
    assert not torch.equal(unfused["model.embed_tokens.weight"], trained_weights(parent)["model.embed_tokens.weight"])


@pytest.mark.parametrize("stage", ["pretrain", "sft"])
def test_use_liger_kernel_is_refused_not_ignored(stage, tmp_path):
    from plugformer.training import run_stage

    flags = PRETRAIN if stage == "pretrain" else [*SFT, "--model_name_or_path", str(tmp_path / "missing")]
    with pytest.raises(ValueError, match="--use_liger_kernel true: Liger's kernels do not patch plugformer models"):
        run_stage(stage, ["--output_dir", str(tmp_path / "out"), *STAGE_FLAGS, *flags, "--use_liger_kernel", "true"])
