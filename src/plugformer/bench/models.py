"""The models compared: transformers references with their plugformer twins (same weights, checked), and the
plugformer variants."""

from __future__ import annotations

import copy
import tempfile

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from ..capabilities import supported_kernels
from ..configuration import PlugformerConfig
from ..integrations.convert import convert
from ..modeling import PlugformerForCausalLM
from ..runtime.memory import check_model_fits
from .measure import random_tokens


PARITY_TOLERANCE = 1e-4  # max |logit difference| allowed between a reference and its twin before any timing


def gqa_key_value_heads(config: PlugformerConfig) -> int:
    """The size's key/value heads if it already groups queries, else groups of the smallest divisor (> 1) of the
    query heads: 6 heads -> 3 key/value heads, 8 -> 4 (a size with one head stays multi-head)."""
    heads = config.num_attention_heads
    if config.num_key_value_heads < heads or heads == 1:
        return config.num_key_value_heads
    group = next(divisor for divisor in range(2, heads + 1) if heads % divisor == 0)
    return heads // group


def reference_model(pair: str, config: PlugformerConfig, seed: int) -> PreTrainedModel:
    """A randomly initialised transformers model with `config`'s dimensions, on sdpa, in eval mode.

    `llama`: `LlamaForCausalLM` with grouped-query attention. `gpt2`: `GPT2LMHeadModel` with GPT-2's 4·d MLP and
    dropout off (the two models place dropout slightly differently; a benchmark should not time it); its head width
    is hidden_size / heads (`BenchArguments` refuses sizes that set another).
    """
    torch.manual_seed(seed)
    if pair == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads,
                num_key_value_heads=gqa_key_value_heads(config),
                head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings,
                tie_word_embeddings=config.tie_word_embeddings,
                rms_norm_eps=config.rms_norm_eps,
            )
        )
    elif pair == "gpt2":
        last = config.vocab_size - 1  # GPT-2's default special id 50256 lies outside small vocabularies
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=config.vocab_size,
                n_embd=config.hidden_size,
                n_layer=config.num_hidden_layers,
                n_head=config.num_attention_heads,
                n_inner=4 * config.hidden_size,
                n_positions=config.max_position_embeddings,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=last,
                eos_token_id=last,
                tie_word_embeddings=config.tie_word_embeddings,
            )
        )
    else:
        raise ValueError(f"pairs: {pair!r} is not one of ['llama', 'gpt2']")
    model.set_attn_implementation("sdpa")
    return model.eval()


@torch.no_grad()
def logit_difference(model: nn.Module, reference: nn.Module, tokens: torch.Tensor) -> float:
    """max |logits(model) - logits(reference)| on `tokens`, fp32, eval mode."""
    model.eval()
    reference.eval()
    return (model(input_ids=tokens).logits - reference(input_ids=tokens).logits).abs().max().item()


def check_parity(model: nn.Module, reference: nn.Module, tokens: torch.Tensor, name: str) -> float:
    """Refuses to benchmark two models that are not the same function (a conversion or configuration mistake)."""
    difference = logit_difference(model, reference, tokens)
    if not difference <= PARITY_TOLERANCE:  # also catches NaN
        raise RuntimeError(
            f"{name}: plugformer and reference logits differ by {difference:.3g} > {PARITY_TOLERANCE} "
            "before timing; the benchmark would compare different models"
        )
    return difference


def build_pair(
    pair: str, config: PlugformerConfig, seed: int, device: str, parity_length: int
) -> tuple[PlugformerForCausalLM | PreTrainedModel, PreTrainedModel, float]:
    """The reference, saved and converted by `plugformer.integrations.convert` (identical weights), both on sdpa and `device`,
    and their logit difference on one random sequence of `parity_length` tokens (at most `PARITY_TOLERANCE`). Pair `aa`
    returns Llama's reference and a copy of it in the twin's place (an A/A comparison)."""
    reference = reference_model("llama" if pair == "aa" else pair, config, seed)
    if pair == "aa":  # the A/A row: the same model on both sides, so its ratio's spread is the machine's noise
        twin = copy.deepcopy(reference)
    else:
        with tempfile.TemporaryDirectory() as directory:
            reference.save_pretrained(directory)
            twin = convert(directory)
    twin.set_attn_implementation("sdpa")
    twin, reference = twin.to(device), reference.to(device)
    tokens = random_tokens(1, parity_length, config.vocab_size, seed, device)
    return twin, reference, check_parity(twin, reference, tokens, pair)


def build_variant(config: PlugformerConfig, seed: int, device: str, kernel: str | None = None) -> PlugformerForCausalLM:
    """A plugformer model on `kernel`, or by default on the kernel transformers resolves (sdpa where plugformer's
    capabilities allow it, else eager)."""
    torch.manual_seed(seed)
    config = copy.deepcopy(config)  # models built from one config object share it
    if kernel is not None:
        if kernel not in supported_kernels(config):
            raise ValueError(f"kernel={kernel!r} cannot run {config.attention_score}+{config.position_scheme}")
        config._attn_implementation = kernel
    check_model_fits(config, training=True, device=device, what="plugformer bench")
    return PlugformerForCausalLM(config).to(device)
