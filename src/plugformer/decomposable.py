"""The decomposable attention model for natural language inference (Parikh et al. 2016): attend, compare, aggregate.

A premise a and a hypothesis b arrive as one tokenizer pair `a <|sep|> b` (or with `token_type_ids` 0/1):

- optional intra-sentence attention: a'_i = Σ_j softmax_j(F_intra(a_i)·F_intra(a_j) + d_{i-j}) a_j, then a_i <- [a_i, a'_i]
- attend: e_ij = F(a_i)·F(b_j); β_i = Σ_j softmax_j(e_ij) b_j; α_j = Σ_i softmax_i(e_ij) a_i
- compare: v1_i = G([a_i, β_i]), v2_j = G([b_j, α_j])
- aggregate: ŷ = H([Σ_i v1_i, Σ_j v2_j])

Both sentences are kept at full sequence length with masks, so no gather or re-padding is needed.
"""

from __future__ import annotations

import math

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.utils import can_return_tuple


@strict
class DecomposableAttentionConfig(PreTrainedConfig):
    r"""Configuration of [`DecomposableAttentionForSequenceClassification`].

    Args:
        vocab_size (`int`, *optional*, defaults to 8192): Token ids.
        embedding_size (`int`, *optional*, defaults to 128): Width of the token embeddings.
        hidden_size (`int`, *optional*, defaults to 128): Width of the projected inputs and of F, G, H.
        hidden_act (`str`, *optional*, defaults to `"relu"`): Activation of the feed-forward networks.
        intra_attention (`bool`, *optional*, defaults to `False`): Add intra-sentence attention (§3.3).
        max_intra_distance (`int`, *optional*, defaults to 10): Distances |i − j| ≥ this share one bias d.
        hidden_dropout (`float`, *optional*, defaults to 0.2): Dropout inside F, G and H.
        initializer_range (`float`, *optional*, defaults to 1.0): Standard deviation of the token embeddings at
            initialisation (unit-variance word vectors; the linear layers take PyTorch's default initialisation).
        sep_token_id (`int`, *optional*): Token between premise and hypothesis when no `token_type_ids` are given.
        num_labels (`int`, *optional*, defaults to 3): entailment / neutral / contradiction.
    """

    model_type = "decomposable_attention"

    vocab_size: int = 8192
    embedding_size: int = 128
    hidden_size: int = 128
    hidden_act: str = "relu"
    intra_attention: bool = False
    max_intra_distance: int = 10
    hidden_dropout: float | int = 0.2
    initializer_range: float = 1.0
    pad_token_id: int | None = None
    sep_token_id: int | None = None

    def __post_init__(self, **kwargs):
        kwargs.setdefault("num_labels", 3)
        for field in ("vocab_size", "embedding_size", "hidden_size", "max_intra_distance"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} must be a positive integer")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {sorted(ACT2FN)}")
        if not 0 <= self.hidden_dropout < 1:
            raise ValueError(f"hidden_dropout={self.hidden_dropout!r} must lie in [0, 1)")
        super().__post_init__(**kwargs)
        if getattr(self, "auto_map", None) is None:
            self.auto_map = {
                "AutoConfig": "decomposable.DecomposableAttentionConfig",
                "AutoModelForSequenceClassification": "decomposable.DecomposableAttentionForSequenceClassification",
            }


class FeedForward(nn.Sequential):
    """Two dropout-ReLU-linear layers, the F, G and H networks of the paper."""

    def __init__(self, config: DecomposableAttentionConfig, input_size: int):
        super().__init__(
            nn.Dropout(config.hidden_dropout),
            nn.Linear(input_size, config.hidden_size),
            ACT2FN[config.hidden_act],
            nn.Dropout(config.hidden_dropout),
            nn.Linear(config.hidden_size, config.hidden_size),
            ACT2FN[config.hidden_act],
        )


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax over `dim` where `mask` is True; all-masked slices give zeros instead of NaN."""
    scores = scores.float().masked_fill(~mask, torch.finfo(torch.float32).min)
    return scores.softmax(dim) * mask


class DecomposableAttentionForSequenceClassification(PreTrainedModel):
    """Parikh et al. (2016): sentence-pair classification with soft alignment and no recurrence."""

    config: DecomposableAttentionConfig
    config_class = DecomposableAttentionConfig
    base_model_prefix = "decomposable"
    # its loss is a mean over the batch's examples: `Trainer` divides it by the gradient-accumulation steps itself
    accepts_loss_kwargs = False

    def __init__(self, config: DecomposableAttentionConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embedding_size, config.pad_token_id)
        self.input_proj = nn.Linear(config.embedding_size, config.hidden_size, bias=False)
        width = config.hidden_size * (2 if config.intra_attention else 1)
        if config.intra_attention:
            self.intra_ff = FeedForward(config, config.hidden_size)
            self.distance_bias = nn.Embedding(2 * config.max_intra_distance + 1, 1)
        self.attend_ff = FeedForward(config, width)
        self.compare_ff = FeedForward(config, 2 * width)
        self.aggregate_ff = FeedForward(config, 2 * config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Embeddings N(0, `initializer_range`²) (1.0), linear layers as PyTorch initialises them.

        Not transformers' N(0, 0.02²): the alignment e_ij = F(a_i)·F(b_j) is a product of two networks' outputs, and
        from vectors that small F starts near 0 and its final ReLU dead for most words, where the gradient of e
        vanishes: trained from scratch on the embedded grammar (`data.nli`), such a model aligned most premise words
        uniformly and never learned whether a person of the hypothesis occurs in the premise
        (model_cards/nli-grammar/RESULTS.md)."""
        if isinstance(module, nn.Embedding):
            init.normal_(module.weight, std=self.config.initializer_range)
            if module.padding_idx is not None:
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.Linear):
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # uniform(±1/sqrt(fan_in)), as nn.Linear
            if module.bias is not None:
                bound = 1 / math.sqrt(module.in_features)
                init.uniform_(module.bias, -bound, bound)

    def sentence_masks(self, input_ids, attention_mask, token_type_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) boolean masks of the premise and hypothesis tokens."""
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if token_type_ids is None:
            if self.config.sep_token_id is None:
                raise ValueError("Pass token_type_ids or set config.sep_token_id to split premise and hypothesis")
            is_sep = input_ids == self.config.sep_token_id
            if not bool(is_sep.any(-1).all()):
                raise ValueError(f"every row needs the separator token {self.config.sep_token_id} (a sentence pair)")
            token_type_ids = is_sep.long().cumsum(-1)
        if self.config.sep_token_id is not None:  # a word of neither sentence (a tokenizer's pair types it 0)
            real = real & (input_ids != self.config.sep_token_id)
        return real & (token_type_ids == 0), real & (token_type_ids > 0)

    def intra_attend(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[x_i, Σ_j softmax_j(F(x_i)·F(x_j) + d_{i-j}) x_j] within one sentence (§3.3)."""
        projected = self.intra_ff(x)
        positions = torch.arange(x.shape[1], device=x.device)
        limit = self.config.max_intra_distance
        distance = (positions[:, None] - positions[None, :]).clamp(-limit, limit) + limit  # (T, T)
        scores = projected @ projected.transpose(1, 2) + self.distance_bias(distance).squeeze(-1)  # (B, T, T)
        weights = masked_softmax(scores, mask[:, None, :] & mask[:, :, None], dim=-1)
        return torch.cat([x, weights.to(x.dtype) @ x], dim=-1)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> SequenceClassifierOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`): `premise <|sep|> hypothesis`.
            attention_mask (`torch.Tensor`, *optional*): 1 for real tokens, 0 for padding.
            token_type_ids (`torch.LongTensor`, *optional*): 0 for premise, 1 for hypothesis tokens (instead of a
                separator).
            labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*): Class ids.
            output_attentions (`bool`, *optional*): Return the alignment e_ij softmaxed over the hypothesis,
                `(B, T, T)` (premise rows, hypothesis columns).
        """
        premise, hypothesis = self.sentence_masks(input_ids, attention_mask, token_type_ids)
        x = self.input_proj(self.embed_tokens(input_ids))  # (B, T, hidden)
        a = self.intra_attend(x, premise) if self.config.intra_attention else x
        b = self.intra_attend(x, hypothesis) if self.config.intra_attention else x
        pair = premise[:, :, None] & hypothesis[:, None, :]  # (B, T_a, T_b): which e_ij exist
        e = self.attend_ff(a) @ self.attend_ff(b).transpose(1, 2)  # (B, T, T)
        beta = masked_softmax(e, pair, dim=2).to(x.dtype) @ b  # (B, T, ·): b aligned to each a_i
        alpha = masked_softmax(e, pair, dim=1).transpose(1, 2).to(x.dtype) @ a  # (B, T, ·): a aligned to each b_j
        v1 = (self.compare_ff(torch.cat([a, beta], dim=-1)) * premise[..., None]).sum(1)  # (B, hidden)
        v2 = (self.compare_ff(torch.cat([b, alpha], dim=-1)) * hypothesis[..., None]).sum(1)
        logits = self.classifier(self.aggregate_ff(torch.cat([v1, v2], dim=-1)))
        loss = None if labels is None else nn.functional.cross_entropy(logits.float(), labels.to(logits.device))
        attentions = (masked_softmax(e, pair, dim=2),) if output_attentions else None
        return SequenceClassifierOutput(loss=loss, logits=logits, attentions=attentions)
