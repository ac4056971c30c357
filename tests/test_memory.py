"""`runtime.memory.parameter_count` (the model built on the meta device) against counts worked out independently:
transformers' own models of the same shape, also built on the meta device, and hand formulas for the parameters of
position schemes no transformers model has; the count equals real models of every variant and head, and a model
too large for the memory available is refused before it is built."""

from __future__ import annotations

import pytest
import torch
from conftest import pretrain_checkpointed as pretrain
from conftest import refuse_training, tiny_config
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from plugformer.positions import FireBias
from plugformer.runtime.memory import parameter_count


def meta_count(model_class, config) -> int:
    """Parameters of transformers' `model_class(config)`, tied ones once, built without memory."""
    with torch.device("meta"):
        model = model_class(config)
    return sum(parameter.numel() for parameter in model.parameters())


def llama(config, model_class=LlamaForCausalLM, **fields) -> int:
    """Llama of the plugformer config's shape: pre-RMSNorm, SwiGLU, RoPE (no parameters), GQA."""
    reference = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
        **fields,
    )
    return meta_count(model_class, reference)


# (plugformer fields, the scheme's own parameters per stack by hand, H heads): added to Llama's count
SCHEME_PARAMETERS = {
    "none": lambda config: 0,
    "alibi": lambda config: 0,  # fixed slopes: a buffer
    "t5_bias": lambda config: config.relative_attention_num_buckets * config.num_attention_heads,
    "clamped_bias": lambda config: (config.max_relative_distance + 1) * config.num_attention_heads,  # causal: 0..max
    "kerple_log": lambda config: 2 * config.num_attention_heads,  # r1, r2 per head
    # c and L; the MLP 1 -> width -> H with biases (Li et al. 2024, FIRE)
    "fire": lambda config: 2 + 2 * FireBias.mlp_width + (FireBias.mlp_width + 1) * config.num_attention_heads,
    # each layer's forget gate: hidden -> H with biases (Lin et al. 2025)
    "forgetting": lambda config: config.num_hidden_layers * (config.hidden_size + 1) * config.num_attention_heads,
}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scheme", sorted(SCHEME_PARAMETERS))
def test_a_llama_shaped_model_counts_as_llama_plus_its_scheme(scheme, tied):
    config = tiny_config("scaled_dot", scheme, tie_word_embeddings=tied)
    assert parameter_count(config) == llama(config) + SCHEME_PARAMETERS[scheme](config)


@pytest.mark.parametrize(
    "fields",
    [
        {"attention_bias": True, "mlp_bias": True},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": 4, "head_dim": 12},
    ],
)
def test_biases_and_head_layouts_count_as_llama(fields):
    config = tiny_config("scaled_dot", "rope", **fields)
    assert parameter_count(config) == llama(config)


def test_qk_norm_counts_as_qwen3():
    config = tiny_config("scaled_dot", "rope", use_qk_norm=True, tie_word_embeddings=False)
    reference = Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        tie_word_embeddings=False,
    )
    assert parameter_count(config) == meta_count(Qwen3ForCausalLM, reference)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_a_gpt2_shaped_model_counts_as_gpt2(placement):
    """LayerNorm (gain and bias), a GELU MLP, learned positions, biases everywhere, a tied head; post-norm blocks
    have no final norm (GPT-2's `ln_f`, 2·d)."""
    config = tiny_config(
        "scaled_dot",
        "learned",
        norm_type="layernorm",
        norm_placement=placement,
        ffn_type="mlp",
        hidden_act="gelu_new",
        attention_bias=True,
        mlp_bias=True,
        num_key_value_heads=4,
    )
    reference = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        n_inner=config.intermediate_size,
    )
    final_norm = 2 * config.hidden_size if placement == "post" else 0
    assert parameter_count(config) == meta_count(GPT2LMHeadModel, reference) - final_norm


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("ffn_type", ["mlp", "glu"])
def test_a_t5_shaped_seq2seq_model_counts_as_t5(ffn_type, tied):
    """Encoder and decoder stacks (the decoder with cross-attention), one T5 bucket table per stack, RMSNorm, no
    biases, an embedding shared by both stacks. transformers 5.24's T5 always ties its head to that embedding (an
    untied `tie_word_embeddings=False` only stops scaling the decoder output): an untied head adds V·d."""
    config = tiny_config(
        "scaled_dot",
        "t5_bias",
        is_encoder_decoder=True,
        pad_token_id=0,
        num_decoder_layers=3,
        norm_type="rmsnorm",
        ffn_type=ffn_type,
        hidden_act="relu" if ffn_type == "mlp" else "gelu_new",
        num_key_value_heads=4,
        tie_word_embeddings=tied,
    )
    reference = T5Config(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        d_kv=config.head_dim,
        d_ff=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_decoder_layers=3,
        num_heads=config.num_attention_heads,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        feed_forward_proj="relu" if ffn_type == "mlp" else "gated-gelu",
        tie_word_embeddings=tied,
    )
    untied_head = 0 if tied else config.vocab_size * config.hidden_size
    assert parameter_count(config, "seq2seq") == meta_count(T5ForConditionalGeneration, reference) + untied_head


@pytest.mark.parametrize(
    "head,model_class",
    [
        ("sequence_classification", LlamaForSequenceClassification),
        ("token_classification", LlamaForTokenClassification),
    ],
)
def test_classification_heads_count_as_llamas(head, model_class):
    config = tiny_config("scaled_dot", "rope", num_labels=3, pad_token_id=0)
    assert parameter_count(config, head) == llama(config, model_class, num_labels=3, pad_token_id=0)


def test_an_unknown_head_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"head='regression': choose one of \['causal_lm', 'masked_lm', 'seq2seq'"):
        parameter_count(tiny_config(), "regression")


def test_the_count_leaves_the_config_as_it_was():
    config = tiny_config()
    config._attn_implementation = "sdpa"
    parameter_count(config)
    assert config.to_dict() == tiny_config().to_dict() and config._attn_implementation == "sdpa"


def size_variants():
    """(head, config fields): every score function and position scheme, both norms, placements and feed-forwards,
    biases, GQA, an explicit head_dim, untied heads, the encoder heads and the seq2seq model."""
    from plugformer.positions import POSITION_SCHEMES
    from plugformer.scores import ATTENTION_SCORES

    variants = [("causal_lm", {"attention_score": score}) for score in ATTENTION_SCORES.names()]
    variants += [("causal_lm", {"position_scheme": scheme}) for scheme in POSITION_SCHEMES.names()]
    variants += [
        (
            "causal_lm",
            {
                "norm_type": "layernorm",
                "norm_placement": "post",
                "ffn_type": "mlp",
                "attention_bias": True,
                "mlp_bias": True,
                "tie_word_embeddings": False,
                "num_key_value_heads": 1,
                "head_dim": 12,
            },
        ),
        ("causal_lm", {"attention_score": "additive", "ffn_type": "glu", "mlp_bias": True, "num_key_value_heads": 2}),
        ("masked_lm", {"is_causal": False, "position_scheme": "clamped_bias", "tie_word_embeddings": False}),
        ("sequence_classification", {"is_causal": False, "num_labels": 3, "pad_token_id": 0}),
        ("token_classification", {"is_causal": False, "num_labels": 5, "position_scheme": "learned"}),
        (
            "seq2seq",
            {
                "is_encoder_decoder": True,
                "pad_token_id": 0,
                "position_scheme": "t5_bias",
                "num_decoder_layers": 3,
                "attention_score": "multiplicative",
            },
        ),
        (
            "seq2seq",
            {
                "is_encoder_decoder": True,
                "pad_token_id": 0,
                "position_scheme": "clamped_bias",
                "tie_word_embeddings": False,
                "attention_score": "additive",
                "attention_bias": True,
            },
        ),
    ]
    return variants


def test_the_closed_form_parameter_count_equals_real_models():
    from plugformer import (
        PlugformerForCausalLM,
        PlugformerForConditionalGeneration,
        PlugformerForMaskedLM,
        PlugformerForSequenceClassification,
        PlugformerForTokenClassification,
    )
    from plugformer.runtime.memory import parameter_count
    from tests.conftest import tiny_config

    classes = {
        "causal_lm": PlugformerForCausalLM,
        "masked_lm": PlugformerForMaskedLM,
        "sequence_classification": PlugformerForSequenceClassification,
        "token_classification": PlugformerForTokenClassification,
        "seq2seq": PlugformerForConditionalGeneration,
    }
    for head, fields in size_variants():
        config = tiny_config(
            **{
                "score": fields.pop("attention_score", "scaled_dot"),
                "scheme": fields.pop("position_scheme", "rope"),
                **fields,
            }
        )
        model = classes[head](config)
        assert parameter_count(config, head) == sum(p.numel() for p in model.parameters()), (head, fields)


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(tmp_path, monkeypatch, llama_source):
    """A config that would allocate tens of GB went ahead until the allocator failed, or the machine swapped."""
    from transformers import Trainer

    from plugformer.experiments.demo import DemoArguments, build_model
    from plugformer.integrations.convert import convert
    from plugformer.runtime import memory

    monkeypatch.setattr(memory, "available_memory", lambda device=None: (2**30, "this machine has"))
    monkeypatch.setattr(Trainer, "train", refuse_training)
    big = ["--hidden_size", "8192", "--num_hidden_layers", "48", "--num_attention_heads", "64"]
    with pytest.raises(
        ValueError,
        match=r"pretrain: vocab_size=300, hidden_size=8192, intermediate_size=21888, "
        r"num_hidden_layers=48, .* make 32\.47B parameters, which need at least "
        r"483\.8 GiB \(16 bytes each: fp32 weights, gradients and AdamW's two "
        r"moments\) but this machine has 1\.0 GiB available; .*"
        r"PLUGFORMER_SKIP_MEMORY_CHECK=1",
    ):
        pretrain(tmp_path / "run", *big)

    class Tokenizer:  # what build_model reads of one
        pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

        def __len__(self):
            return 512

    with pytest.raises(ValueError, match=r"plugformer demo: .*hidden_size=16384.*need at least"):
        build_model(DemoArguments(hidden_size=16384, num_attention_heads=64, num_key_value_heads=8), Tokenizer())
    monkeypatch.setattr(memory, "available_memory", lambda device=None: (1000, "this machine has"))
    with pytest.raises(
        ValueError,
        match=r"convert \(the source model and its conversion\): .*4 bytes each: fp32 "
        r"weights, 2 models\) but this machine has 1000 B available",
    ):
        convert(llama_source, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()
    monkeypatch.setenv(memory.OVERRIDE, "1")  # the documented override builds it anyway
    assert convert(llama_source, tmp_path / "converted").num_parameters() > 0
