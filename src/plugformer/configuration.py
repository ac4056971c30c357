"""`PlugformerConfig`: transformers' field names, one string field per variant axis, presets as small diffs.

No `from __future__ import annotations` here: huggingface_hub's `@strict` checks each field against its annotation
only when the annotation is a type; a string (what that import turns every annotation into) is skipped silently.
"""

import copy
import difflib
import functools
from typing import Any

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import GenerationConfig, PreTrainedConfig

from .compat import ASSIGNS_TP_PLAN
from .config_checks import check_choices, check_layer_types, check_sizes
from .layers import FEED_FORWARDS
from .linear_attention import complete_linear_attention
from .positions import POSITION_SCHEMES
from .presets import PRESETS
from .projections import ATTENTION_PROJECTIONS
from .registry import choice, unused_fields
from .scores import ATTENTION_SCORES


# Tensor parallelism splits the attention heads over the ranks (Megatron-LM's layout, as transformers' Llama): each
# rank attends with whole heads, one all-reduce follows o_proj (and down_proj). Keys are relative to one stack: the
# attention projection, the feed-forward and the position scheme add their own modules' entries (`base_model_tp_plan`);
# a seq2seq head adds its decoder's cross-attention, and transformers adds `embed_tokens` (vocabulary-parallel). Every
# rank must hold whole key/value heads: `PlugformerAttention` refuses a `num_key_value_heads` the TP size does not
# divide. Every parameter of a score function is per head, head dimension first (see `AttentionScore`): a module
# entry gives each of them this style, which shards dim 0 whatever the rank of the tensor ("colwise" would split dim
# ndim − 2, i.e. d_k of a (H, D, D) weight; "rowwise" the last). Its forward hook never runs (attention calls the
# score's `prepare_*` methods, which read the local shards), and a score without parameters matches it all the same.
STACK_TP_PLAN: dict[str, str] = {"layers.*.self_attn.score": "embedding_rowwise"}


# The variant axes whose classes own config fields (`registry.ConfigHooks`); each registry's `axis` is its field.
VARIANT_REGISTRIES = (ATTENTION_SCORES, POSITION_SCHEMES, ATTENTION_PROJECTIONS)


# Written into every config so a saved checkpoint loads with `trust_remote_code=True` without plugformer installed;
# must match `plugformer.AUTO_CLASSES` (a test checks). Module names are those of the files saved next to the weights.
DEFAULT_AUTO_MAP = {
    "AutoConfig": "configuration.PlugformerConfig",
    "AutoModel": "modeling.PlugformerModel",
    "AutoModelForCausalLM": "modeling.PlugformerForCausalLM",
    "AutoModelForMaskedLM": "modeling.PlugformerForMaskedLM",
    "AutoModelForSequenceClassification": "modeling.PlugformerForSequenceClassification",
    "AutoModelForTokenClassification": "modeling.PlugformerForTokenClassification",
    "AutoModelForSeq2SeqLM": "modeling_seq2seq.PlugformerForConditionalGeneration",
}


def layer_type(config: "PlugformerConfig", layer_idx: int) -> str:
    """The attention kind of self-attention layer `layer_idx` (`config.layer_types`). In a seq2seq model, whose
    decoder layers `layer_types` does not count, every self-attention layer of both stacks is of the one kind
    `layer_types` may hold there."""
    kind = config.layer_types[0 if config.is_encoder_decoder else layer_idx]
    if config.sliding_window is None and kind != "linear_attention":
        return "full_attention"
    return kind


def _raising_builtin_errors(cls: type) -> type:
    """`cls` with a constructor that raises `ValueError`/`TypeError` naming the field where huggingface_hub's strict
    dataclasses raise their own exception types (for a field's type, from a `validate_*` method): users, and `except
    ValueError` around config loading, expect the builtin ones. `inspect.signature` still shows the fields, so tools
    that read it build the model asked for."""
    strict_init = cls.__init__

    @functools.wraps(strict_init)
    def __init__(self, *args, **kwargs):
        try:
            strict_init(self, *args, **kwargs)
        except StrictDataclassError as error:
            cause = error.__cause__
            kind = type(cause) if isinstance(cause, (ValueError, TypeError)) else TypeError
            raise kind(str(cause or error)) from error

    cls.__init__ = __init__
    return cls


@_raising_builtin_errors  # outermost: `@strict` raises its own types from the constructor it wraps
@strict
class PlugformerConfig(PreTrainedConfig):
    r"""Configuration of a plugformer model: a transformer whose attention score function and position scheme are
    chosen by name.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000): Number of token ids.
        hidden_size (`int`, *optional*, defaults to 512): Width d_model of the residual stream.
        intermediate_size (`int`, *optional*): Width of the feed-forward block; defaults to 4·d for `ffn_type="mlp"`
            and to 8/3·d rounded up to a multiple of 64 for `"glu"` (same parameter count).
        num_hidden_layers (`int`, *optional*, defaults to 8): Number of blocks (of the encoder, in a seq2seq model).
        num_decoder_layers (`int`, *optional*): Decoder blocks of a seq2seq model; defaults to `num_hidden_layers`.
        num_attention_heads (`int`, *optional*, defaults to 8): Query heads h.
        num_key_value_heads (`int`, *optional*): Key/value heads; `h` = multi-head, 1 = MQA, in between = GQA.
            Defaults to `num_attention_heads`.
        head_dim (`int`, *optional*): Per-head width d_k = d_v; defaults to `hidden_size // num_attention_heads`. With
            `attention_projection="latent"`, the rotated width `qk_rope_head_dim` (transformers' DeepseekV3).
        hidden_act (`str`, *optional*, defaults to `"silu"`): Feed-forward activation (a key of `ACT2FN`).
        max_position_embeddings (`int`, *optional*, defaults to 2048): Positions a `learned` scheme can encode; the
            trained context for RoPE scaling.
        attention_score (`str`, *optional*, defaults to `"scaled_dot"`): A name registered in
            `plugformer.ATTENTION_SCORES` (`"dot"`, `"scaled_dot"`, ...; see `plugformer.scores`).
        position_scheme (`str`, *optional*, defaults to `"rope"`): A name registered in `plugformer.POSITION_SCHEMES`
            (`"none"`, `"rope"`, `"alibi"`, ...; see `plugformer.positions`).
        attention_projection (`str`, *optional*, defaults to `"standard"`): A name registered in
            `plugformer.ATTENTION_PROJECTIONS`: `"standard"` (q, k, v projections per head) or `"latent"` (multi-head
            latent attention, DeepSeek-V2/V3; see `plugformer.projections`).
        q_lora_rank (`int`, *optional*): `attention_projection="latent"`: rank of the query latent (`q_a_proj`,
            `q_b_proj`); `None` projects queries directly (`q_proj`).
        kv_lora_rank (`int`, *optional*): `attention_projection="latent"`: rank of the compressed key/value latent;
            defaults to 4·`hidden_size // num_attention_heads` (DeepSeek-V2's proportion).
        qk_rope_head_dim (`int`, *optional*): `attention_projection="latent"`: width of the decoupled RoPE part of
            each query and of the key part shared by the heads; defaults to half of `hidden_size // num_attention_heads`.
        qk_nope_head_dim (`int`, *optional*): `attention_projection="latent"`: width of each head's query and key part
            without positions; defaults to `hidden_size // num_attention_heads`.
        v_head_dim (`int`, *optional*): `attention_projection="latent"`: width of each head's value; defaults to
            `hidden_size // num_attention_heads`.
        rope_interleave (`bool`, *optional*, defaults to `False`): `attention_projection="latent"`: rotate interleaved
            pairs of the RoPE part, as DeepSeek's checkpoints expect (transformers' DeepseekV3 field).
        use_latent_cache (`bool`, *optional*, defaults to `False`): `attention_projection="latent"`: the KV cache
            holds each token's compressed latent and rotated key part (`kv_lora_rank + qk_rope_head_dim` numbers per
            layer, as transformers' DeepseekV3) instead of every head's keys and values; same outputs.
        norm_type (`str`, *optional*, defaults to `"rmsnorm"`): `"rmsnorm"` or `"layernorm"`.
        norm_placement (`str`, *optional*, defaults to `"pre"`): `"pre"` (x + F(norm x)), `"post"` (norm(x + F x)) or
            `"sandwich"` (x + norm'(F(norm x)), Gemma 2's: a second norm on each sublayer's output).
        ffn_type (`str`, *optional*, defaults to `"glu"`): `"glu"` (SwiGLU with silu) or `"mlp"` (e.g. GELU MLP).
        is_causal (`bool`, *optional*, defaults to `True`): `True` for a GPT-style decoder (masked self-attention),
            `False` for a BERT-style bidirectional encoder (masked LM, classification heads).
        rope_parameters (`dict`, *optional*): transformers' RoPE parameters (`rope_type`, `rope_theta`, scaling
            factors); used by `position_scheme="rope"`.
        no_rope_layers (`list[int]`, *optional*): Per layer, 1 to rotate queries and keys, 0 for a NoPE layer
            (SmolLM3's / Llama 4's field, same meaning); `position_scheme="rope"` only. `None`: every layer rotates.
        relative_attention_num_buckets (`int`, *optional*, defaults to 32): T5 buckets (`t5_bias`).
        relative_attention_max_distance (`int`, *optional*, defaults to 128): Distance where T5's last bucket starts.
        max_relative_distance (`int`, *optional*, defaults to 128): Clamp of `clamped_bias` distances.
        use_qk_norm (`bool`, *optional*, defaults to `False`): RMSNorm over each head's d_k on the projected queries and
            keys, before RoPE, with one learned gain each (Qwen3's `q_norm`/`k_norm`); composes with any score.
        attn_logit_softcapping (`float`, *optional*): Caps the attention logits as c·tanh(logits / c) before the mask
            and any position bias (Gemma 2); dot-product scores only, on the kernels whose record declares
            `softcap` (`plugformer info --markdown`; the others are refused).
        final_logit_softcapping (`float`, *optional*): Caps the head's logits as c·tanh(logits / c) (Gemma 2's field;
            the fused loss applies it too).
        embedding_multiplier (`float`, *optional*, defaults to 1.0): Scales the token embeddings, in their dtype
            (Gemma's sqrt(hidden_size); Granite's field), before any position is added; the head is not scaled.
        use_attention_sinks (`bool`, *optional*, defaults to `False`): A learned logit per head joins each softmax as
            one more key column and absorbs weight (gpt-oss's `sinks`, which it always has; transformers has no
            field for them); dot-product scores only, on the kernels whose record declares `sinks`
            (`plugformer info --markdown`; the others are refused).
        use_gated_attention (`bool`, *optional*, defaults to `False`): Multiplies each head's attention output by a
            sigmoid gate computed from the hidden state, before `o_proj` (Qwen3-Next; Qiu et al. 2025, "Gated
            Attention for Large Language Models"): `q_proj` is twice as wide, each head's query followed by its gate
            (transformers' `qwen3_next` layout); composes with every score, scheme and kernel.
        exclusive_self_attention (`bool`, *optional*, defaults to `False`): Removes from each head's self-attention
            output its component along the token's own value, z_i = y_i − (y_i·v_i / ‖v_i‖²) v_i (Zhai 2026, "Exclusive
            Self Attention"; with GQA the value its query head reads), after the kernel (and differential attention's
            norm), before the output gate and `o_proj`; composes with every score, scheme, projection and kernel.
        value_residual (`str`, *optional*): Every layer after the first attends with its values mixed with the first
            layer's, V_n' = λ1·V_n + λ2·V_1 (Zhou et al. 2024, ResFormer): `"fixed"` (λ1 = λ2 = 0.5) or `"learned"`
            (λ1, λ2 learned per layer; no tensor parallelism); `None`: off. Each stack of a seq2seq model mixes with
            its own first layer.
        additive_chunk_size (`int`, *optional*): Query rows per chunk of the additive kernel; by default as many as
            keep a chunk's tanh tensor within 16 MiB, or its scores within 4 MiB on the native path (kernels_additive).
        sliding_window (`int`, *optional*): Local attention in the layers `layer_types` marks sliding (by default
            every layer), as Mistral's (transformers' name and masks): a causal query sees only the last
            `sliding_window` keys (itself included), an encoder's query the keys at most `sliding_window` away
            (transformers' bidirectional sliding mask). The KV cache (`DynamicCache(config=...)`) then keeps only the
            window; a seq2seq model's keeps every key (its cross-attention sees the whole source). `None`: no window.
        layer_types (`list[str]`, *optional*): Each layer's attention kind, `"sliding_attention"` or `"full_attention"`
            (transformers' field, as Gemma 2 and Qwen3; vLLM reads it); by default every layer sliding when
            `sliding_window` is set, else full. A seq2seq model takes one kind for all its layers. `"linear_attention"`:
            a Gated DeltaNet (`linear_attention`, Qwen3-Next's `linear_attn`) in a causal single-stack model.
        linear_conv_kernel_dim, linear_key_head_dim, linear_value_head_dim, linear_num_key_heads,
            linear_num_value_heads (`int`, *optional*): The `"linear_attention"` layers' sizes (Qwen3-Next's fields);
            default to 4, `head_dim`, `head_dim`, `num_key_value_heads`, `num_attention_heads`.
        rms_norm_eps (`float`, *optional*, defaults to 1e-6), layer_norm_eps (`float`, *optional*, defaults to 1e-5):
            Norm epsilons.
        attention_dropout (`float`, *optional*, defaults to 0.0): Dropout on attention weights.
        hidden_dropout (`float`, *optional*, defaults to 0.0): Dropout on embeddings and each sublayer's output.
        attention_bias (`bool`, *optional*, defaults to `False`), mlp_bias (`bool`, *optional*, defaults to
            `False`): Biases in the attention and feed-forward projections.
        initializer_range (`float`, *optional*, defaults to 0.02): Std of the normal weight initialisation.
        tie_word_embeddings (`bool`, *optional*, defaults to `True`): Share the input embedding and the LM head.
        use_cache (`bool`, *optional*, defaults to `True`): Return a KV cache.
        pad_token_id, bos_token_id, eos_token_id (`int`, *optional*): Special token ids.
        decoder_start_token_id (`int`, *optional*): First decoder input of a seq2seq model; defaults to the pad id.
        is_encoder_decoder (`bool`, *optional*, defaults to `False`): Set for [`PlugformerForConditionalGeneration`].

    Example:

    ```python
    >>> from plugformer import PlugformerConfig, PlugformerForCausalLM
    >>> config = PlugformerConfig.from_preset("tiny", attention_score="additive", position_scheme="alibi")
    >>> model = PlugformerForCausalLM(config)
    ```
    """

    model_type = "plugformer"
    keys_to_ignore_at_inference = ["cache"]

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """transformers' tensor-parallel plan (`from_pretrained(..., tp_plan="auto")`) of one stack
        ([`PlugformerModel`]): the entries of the modules this config builds, each declared by its variant (the
        attention projection's `tp_plan(config)`, the feed-forward's `tp_plan`, the position scheme's
        `stack_tp_plan()`), and `STACK_TP_PLAN`. A property: the variants are fields."""
        parts = (
            (ATTENTION_PROJECTIONS.get(self.attention_projection).tp_plan(self), "layers.*.self_attn."),
            (STACK_TP_PLAN, ""),
            (FEED_FORWARDS.get(self.ffn_type).tp_plan, "layers.*.mlp."),
            (POSITION_SCHEMES.get(self.position_scheme).stack_tp_plan(), ""),
        )
        return {f"{prefix}{name}": style for plan, prefix in parts for name, style in plan.items()}

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, value) -> None:
        # transformers before 5.21 assigns the plan in `PreTrainedConfig.__post_init__` (adding `embed_tokens` for tied
        # embeddings; 5.21 and later do not): dropped there, since the plan follows the fields. Refused from 5.21 on.
        if not ASSIGNS_TP_PLAN:
            raise AttributeError("base_model_tp_plan is derived from position_scheme; set the fields instead")

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int | None = None
    num_hidden_layers: int = 8
    num_decoder_layers: int | None = None
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    attention_score: str = "scaled_dot"
    position_scheme: str = "rope"
    attention_projection: str = "standard"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = False
    use_latent_cache: bool = False
    norm_type: str = "rmsnorm"
    norm_placement: str = "pre"
    ffn_type: str = "glu"
    is_causal: bool = True
    rope_parameters: dict | None = None
    no_rope_layers: list[int] | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    max_relative_distance: int = 128
    use_qk_norm: bool = False
    attn_logit_softcapping: float | int | None = None
    final_logit_softcapping: float | int | None = None
    embedding_multiplier: float | int = 1.0
    use_attention_sinks: bool = False
    use_gated_attention: bool = False
    exclusive_self_attention: bool = False
    value_residual: str | None = None
    additive_chunk_size: int | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    linear_conv_kernel_dim: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    rms_norm_eps: float | int = 1e-6
    layer_norm_eps: float | int = 1e-5
    attention_dropout: float | int = 0.0
    hidden_dropout: float | int = 0.0
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float | int = 0.02
    tie_word_embeddings: bool = True
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    decoder_start_token_id: int | None = None
    is_encoder_decoder: bool = False  # declared again (transformers' own annotation is a string): type-checked

    def __post_init__(self, **kwargs):
        _refuse_near_miss(kwargs)  # `kwargs` are the keys that are no field
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_choices(self)
        check_sizes(self)
        check_layer_types(self)
        ATTENTION_PROJECTIONS.get(self.attention_projection).complete_config(self)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_hidden_layers
        if self.intermediate_size is None:
            self.intermediate_size = self._default_intermediate_size()
        complete_linear_attention(self)
        super().__post_init__(**kwargs)
        if getattr(self, "auto_map", None) is None:
            self.auto_map = dict(DEFAULT_AUTO_MAP)  # an instance dict: TRL reads and transformers extends it
        self._validate_variant_fields()
        self.__dict__["_post_init_done"] = True  # transformers' own flag from 5.24 on: assignments checked from here

    def __setattr__(self, name: str, value: Any) -> None:
        """A variant's own field assigned after construction (`config.rope_parameters = ...`) is checked as the
        constructor checks it: kept where the chosen variants accept it, else refused (the old value restored), so a
        setting is never kept and silently ignored."""
        checking = self.__dict__.get("_checking_assignment", False)  # the checks assign (transformers' RoPE init)
        if name not in _VARIANT_FIELDS or checking or not self.__dict__.get("_post_init_done", False):
            return super().__setattr__(name, value)
        old = self.__dict__.get(name)
        super().__setattr__(name, value)
        self.__dict__["_checking_assignment"] = True
        try:
            self._validate_variant_fields()
            self.validate_rope()
        except (ValueError, TypeError):
            super().__setattr__(name, old)
            raise
        finally:
            del self.__dict__["_checking_assignment"]

    def to_dict(self) -> dict[str, Any]:
        """transformers' `to_dict`; attributes set by assignment whose names nearly spell a field (GPT-2's
        `layer_norm_epsilon`) are listed under `NEAR_MISS_KEY`, so the saved config loads back although the constructor
        takes such a keyword argument for a typo."""
        output = super().to_dict()
        for key in (NEAR_MISS_KEY, "_post_init_done"):  # transformers drops the flag from 5.24 on
            output.pop(key, None)
        assigned = sorted(key for key in output if _near_miss(key) is not None)
        if assigned:
            output[NEAR_MISS_KEY] = assigned
        return output

    def _default_intermediate_size(self) -> int:
        if self.ffn_type == "glu":  # 3 matrices of 8/3·d ≈ the parameters of 2 of 4·d
            return -(-(8 * self.hidden_size // 3) // 64) * 64
        return 4 * self.hidden_size

    def _variants(self) -> tuple[type, ...]:
        """The classes of the chosen variants: score function, position scheme, attention projection."""
        return tuple(registry.get(getattr(self, registry.axis)) for registry in VARIANT_REGISTRIES)

    def _validate_variant_fields(self) -> None:
        """The chosen score function and position scheme check their own fields (`validate_config`); the fields
        only other variants own are left to their owners (`refuse_unused_config`)."""
        chosen = self._variants()
        for variant in chosen:
            variant.validate_config(self)
        for owner in unused_fields(chosen, VARIANT_REGISTRIES):
            owner.refuse_unused_config(self)

    def validate_rope(self):
        """transformers' check of `rope_parameters`, run only where a chosen variant owns them (transformers fills them
        in for every config, and would refuse e.g. an odd head_dim under `position_scheme="none"`); its `KeyError` for
        a missing key becomes a `ValueError` naming the field. Elsewhere their owner refuses settings it would not see
        applied (`_validate_variant_fields`)."""
        if not any("rope_parameters" in variant.config_fields for variant in self._variants()):
            return
        try:
            super().validate_rope()
        except KeyError as error:
            raise ValueError(f"rope_parameters={self.rope_parameters!r}: {error.args[0]}") from error

    def validate_token_ids(self):
        """Special token ids must be valid rows of the embedding (transformers only warns)."""
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            for token_id in value if isinstance(value, list) else [value]:
                if token_id is not None and not 0 <= token_id < self.vocab_size:
                    raise ValueError(f"{name}={value!r} is outside the vocabulary [0, {self.vocab_size})")

    def get_text_config(self, decoder=None, encoder=None) -> PreTrainedConfig:
        """transformers' view of one end of the model; a seq2seq decoder's has `num_decoder_layers` layers, so
        caches built from it (`DynamicCache(config=...)`, also inside `generate`) get one slot per decoder block."""
        text_config = super().get_text_config(decoder=decoder, encoder=encoder)
        if decoder and not encoder and self.is_encoder_decoder and text_config is not self:  # a copy: safe to edit
            text_config.num_hidden_layers = self.num_decoder_layers
            # transformers' generate() builds both halves of the EncoderDecoderCache from this view: sliding cache
            # layers would cut the encoder's keys in the cross-attention half to the window after the first step.
            # Full layers keep every key; the decoder's window is applied by its mask.
            text_config.sliding_window = None
            text_config.layer_types = ["full_attention"] * self.num_decoder_layers
        return text_config

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "PlugformerConfig":
        """A named preset (`tiny`, `small`, `gpt2-small`, `llama`) with `overrides` applied on top."""
        choice("preset", name, list(PRESETS))
        values = {**copy.deepcopy(PRESETS[name]), **overrides}
        chosen = []
        for registry in VARIANT_REGISTRIES:
            name = values.get(registry.axis, cls.__dataclass_fields__[registry.axis].default)
            if not isinstance(name, str) or name not in registry:
                return cls(**values)  # refused there, naming the field
            chosen.append(registry.get(name))
        for fields in unused_fields(tuple(chosen), VARIANT_REGISTRIES).values():
            for field in fields - set(overrides):  # the preset's settings (RoPE's), for a variant swapped out
                values.pop(field, None)
        return cls(**values)


# Keyword arguments that are no field of PlugformerConfig but that transformers itself passes or reads back from a
# config.json (bookkeeping such as `_name_or_path`, `architectures`, `torch_dtype`; legacy RoPE keys it converts;
# generation settings it drops): never taken for a typo, however close to a field.
_TRANSFORMERS_KWARGS = frozenset(
    {*PreTrainedConfig.__dataclass_fields__, *dir(PreTrainedConfig), *GenerationConfig._get_default_generation_params()}
    | {
        "name_or_path",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "per_layer_config",
        "torch_dtype",
        "num_labels",
        "rope_scaling",
        "rope_theta",
        "partial_rotary_factor",
        "use_return_dict",
    }
)


# The fields a variant owns (`config_fields`): checked again when assigned after construction.
_VARIANT_FIELDS = frozenset(
    field for registry in VARIANT_REGISTRIES for name in registry for field in registry.get(name).config_fields
)

# Key of a saved config listing the attributes that were set by assignment and nearly spell a field (see `to_dict`).
NEAR_MISS_KEY = "plugformer_assigned_attributes"


def _near_miss(key: str) -> str | None:
    """The field `key` nearly spells if it is no field itself nor a name transformers uses, else None."""
    fields = PlugformerConfig.__dataclass_fields__
    if key in fields or key in _TRANSFORMERS_KWARGS or key.startswith("_") or key == NEAR_MISS_KEY:
        return None
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.85)
    return close[0] if close else None


def _refuse_near_miss(kwargs: dict[str, Any]) -> None:
    """Raises a `ValueError` for a keyword argument that is no field but nearly spells one (`attention_scor`):
    transformers keeps unknown keys as plain attributes, so the default of the field meant would be used silently.
    Names a saved config lists under `NEAR_MISS_KEY` (attributes assigned on purpose, then saved) load as they are."""
    assigned = set(kwargs.pop(NEAR_MISS_KEY, None) or ())
    for key in kwargs:
        meant = None if key in assigned else _near_miss(key)
        if meant is not None:
            raise ValueError(
                f"PlugformerConfig got {key}={kwargs[key]!r}, which is not a field; did you mean {meant!r}? (keys "
                "of a config.json are read the same way; to keep such an attribute, assign it after construction)"
            )
