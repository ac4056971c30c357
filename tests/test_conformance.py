"""What transformers' common model tests require of every model, checked on plugformer's heads for every
attention_score x position_scheme (read from the registries): causal LM, the encoder heads (masked LM, sequence and
token classification) and the seq2seq model; and what transformers' testers and other outside clients rely on:
`inputs_embeds` as the ids' embeddings, a cache by its deprecated name, attention weights in the graph, the config's
signature and bookkeeping kwargs, and capability flags that follow the config.

Written for plugformer, modelled on what transformers' per-model tests check (ModelTesterMixin, the causal-LM tester,
the configuration tests); none of their code. Tiny configs and one model per class and variant (class-scoped
fixtures) keep the module fast: about a minute on one thread. What transformers' suites check that plugformer
legitimately does not support is listed, with the reason, in tests/README.md ("Conformance").
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import SCORES, build, tiny_config, variants
from tolerances import model_tolerance, tolerance
from transformers import AutoModel, AutoModelForCausalLM
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.utils import logging

import plugformer
from plugformer import (
    PlugformerConfig,
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
    PlugformerForMaskedLM,
    PlugformerForSequenceClassification,
    PlugformerForTokenClassification,
    PlugformerModel,
    PlugformerSeq2SeqModel,
)


logging.disable_progress_bar()

VARIANTS = variants()  # the full grid with -m slow
PROJECTED = variants(projections=True)  # and the other attention projections (seq2seq has only the standard one)
BATCH, LENGTH, TARGET = 2, 7, 5


def kernel_of(score: str) -> str:
    return "sdpa" if plugformer.ATTENTION_SCORES.get(score).dot_product else "eager"


def make(model_class, score: str, scheme: str, projection: str | None = None, kernel: str | None = None, **overrides):
    """A model in eval mode built from its own copy of a tiny config, seeded."""
    config = tiny_config(score, scheme, projection, **overrides)
    config._attn_implementation = kernel or kernel_of(score)
    torch.manual_seed(0)
    return model_class(config).eval()


def ids(batch: int = BATCH, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def eager_copy(model):
    """The same weights on the eager kernel (the one that returns attention weights)."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    return model


def assert_attention_maps(maps, layers: int, heads: int, queries: int, keys: int, causal: bool, score=None) -> None:
    """Each of `layers` maps has the shape asked, no weight on a later key where `causal`, and rows summing to 1, or
    to at most 1 where `score` (a name) says its weights do not (`weights_sum_to_one`: stick-breaking)."""
    assert len(maps) == layers
    normalised = score is None or plugformer.ATTENTION_SCORES.get(score).weights_sum_to_one
    for weights in maps:
        assert weights.shape == (BATCH, heads, queries, keys)
        # fp32's exp and division, then a sum of `keys` weights of total 1 (`tolerance`)
        atol = tolerance(torch.float32, length=keys, steps=2)
        if normalised:
            torch.testing.assert_close(weights.sum(-1), torch.ones(BATCH, heads, queries), atol=atol, rtol=0)
        else:
            assert weights.min() >= 0 and weights.sum(-1).max() <= 1 + atol
        if causal:  # no weight on a later key
            assert not weights.triu(1).any()


def assert_saved_and_loaded(model, directory, inputs: dict, loader=None) -> None:
    """save_pretrained -> from_pretrained (the class, or `loader`) gives the same outputs and the same state dict."""
    model.save_pretrained(directory)
    loaded = (loader or type(model)).from_pretrained(directory, attn_implementation=model.config._attn_implementation)
    assert type(loaded) is type(model)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, atol=0, rtol=0)


def assert_resizes(model, inputs: dict) -> None:
    """resize_token_embeddings up and down: config, embedding and tied head follow; the grown ids run."""
    model = copy.deepcopy(model)
    vocab = model.config.vocab_size
    for size in (vocab + 8, vocab - 8):
        model.resize_token_embeddings(size)
        assert model.config.vocab_size == size == model.get_input_embeddings().num_embeddings
        if model.get_output_embeddings() is not None:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
        grown = {name: value.clamp(max=size - 1) if "input_ids" in name else value for name, value in inputs.items()}
        with torch.no_grad():
            logits = model(**grown).logits
        if model.get_output_embeddings() is not None:
            assert logits.shape[-1] == size


# ---------------------------------------------------------------------------------------------------------------
# Causal LM
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="class", params=PROJECTED)
def causal(request):
    return make(PlugformerForCausalLM, *request.param)


class TestCausalLM:
    def test_save_load_round_trip(self, causal, tmp_path):
        assert_saved_and_loaded(causal, tmp_path, {"input_ids": ids()}, loader=AutoModelForCausalLM)

    def test_inputs_embeds_equal_input_ids(self, causal):
        tokens = ids()
        with torch.no_grad():
            embeds = causal.get_input_embeddings()(tokens)
            expected = causal(tokens).logits  # the same forward entered at the embeddings: `model_tolerance`
            torch.testing.assert_close(
                causal(inputs_embeds=embeds).logits, expected, atol=model_tolerance(causal.config, expected), rtol=0
            )

    def test_attentions_hidden_states_and_their_gradients(self, causal):
        config = causal.config
        model = eager_copy(causal)
        output = model(ids(), output_attentions=True, output_hidden_states=True)
        assert_attention_maps(
            output.attentions,
            config.num_hidden_layers,
            config.num_attention_heads,
            LENGTH,
            LENGTH,
            causal=True,
            score=config.attention_score,
        )
        assert len(output.hidden_states) == config.num_hidden_layers + 1
        assert all(h.shape == (BATCH, LENGTH, config.hidden_size) for h in output.hidden_states)
        attentions, hidden = output.attentions[0], output.hidden_states[0]
        attentions.retain_grad()
        hidden.retain_grad()
        output.logits.sum().backward()
        assert attentions.grad is not None and hidden.grad is not None

    def test_cached_decoding_equals_the_full_forward(self, causal):
        tokens = ids()
        with torch.no_grad():
            full = causal(tokens, use_cache=False).logits
            step = causal(tokens[:, :3], use_cache=True)
            assert isinstance(step.cache, DynamicCache)
            pieces = [step.logits]
            for position in range(3, LENGTH):
                step = causal(tokens[:, position : position + 1], cache=step.cache, use_cache=True)
                pieces.append(step.logits)
        # cached against full: fp32's rounding through the model times max|logits| (`model_tolerance`)
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=model_tolerance(causal.config, full), rtol=0)
        assert step.cache.get_seq_length() == LENGTH

    def test_base_model_prefix_loading(self, causal, tmp_path):
        """The head saved, the base loaded from it (prefix `model.` dropped), and the other way round."""
        assert causal.base_model is causal.model
        causal.save_pretrained(tmp_path / "head")
        base = AutoModel.from_pretrained(tmp_path / "head", attn_implementation=causal.config._attn_implementation)
        assert type(base) is PlugformerModel
        for name, tensor in causal.model.state_dict().items():
            assert torch.equal(base.state_dict()[name], tensor), name
        causal.model.save_pretrained(tmp_path / "base")
        head, info = PlugformerForCausalLM.from_pretrained(tmp_path / "base", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        with torch.no_grad():
            expected = causal(ids()).logits  # reloaded with the loader's kernel choice: `model_tolerance`
            torch.testing.assert_close(
                head(ids()).logits, expected, atol=model_tolerance(causal.config, expected), rtol=0
            )

    def test_tuple_output_and_batching(self, causal):
        tokens = ids()
        with torch.no_grad():
            output = causal(tokens, use_cache=False)
            as_tuple = causal(tokens, use_cache=False, return_dict=False)
            torch.testing.assert_close(as_tuple[0], output.logits, atol=0, rtol=0)
            # one row alone against the batch: fp32's rounding through the model (`model_tolerance`)
            atol = model_tolerance(causal.config, output.logits)
            torch.testing.assert_close(causal(tokens[:1], use_cache=False).logits, output.logits[:1], atol=atol, rtol=0)

    def test_resize_token_embeddings(self, causal):
        assert_resizes(causal, {"input_ids": ids()})


# ---------------------------------------------------------------------------------------------------------------
# Encoder heads
# ---------------------------------------------------------------------------------------------------------------

ENCODER = dict(is_causal=False, pad_token_id=0)


@pytest.fixture(scope="class", params=variants(projections=True, **ENCODER))  # the scores an encoder takes
def encoder(request):
    variant = request.param  # (score, scheme) or (score, scheme, projection)
    return {
        "masked": make(PlugformerForMaskedLM, *variant, **ENCODER),
        "sequence": make(PlugformerForSequenceClassification, *variant, num_labels=3, **ENCODER),
        "token": make(PlugformerForTokenClassification, *variant, num_labels=5, **ENCODER),
    }


class TestEncoderHeads:
    def test_save_load_round_trip(self, encoder, tmp_path):
        assert_saved_and_loaded(encoder["masked"], tmp_path, {"input_ids": ids()})

    def test_head_shapes_tuples_and_inputs_embeds(self, encoder):
        tokens = ids()
        shapes = {"masked": (BATCH, LENGTH, 128), "sequence": (BATCH, 3), "token": (BATCH, LENGTH, 5)}
        with torch.no_grad():
            for name, model in encoder.items():
                logits = model(tokens).logits
                assert logits.shape == shapes[name], name
                torch.testing.assert_close(model(tokens, return_dict=False)[0], logits, atol=0, rtol=0)
                embeds = model.get_input_embeddings()(tokens)
                mask = torch.ones_like(tokens)  # the sequence head pools the last real token, found from the mask
                from_embeds = model(inputs_embeds=embeds, attention_mask=mask).logits
                torch.testing.assert_close(from_embeds, logits, atol=model_tolerance(model.config, logits), rtol=0)

    def test_attentions_hidden_states_and_their_gradients(self, encoder):
        model = eager_copy(encoder["masked"])
        config = model.config
        output = model(ids(), output_attentions=True, output_hidden_states=True)
        assert_attention_maps(
            output.attentions, config.num_hidden_layers, config.num_attention_heads, LENGTH, LENGTH, causal=False
        )
        assert output.attentions[0].triu(1).any()  # bidirectional: later keys weigh
        assert len(output.hidden_states) == config.num_hidden_layers + 1
        attentions = output.attentions[-1]
        attentions.retain_grad()
        output.logits.sum().backward()
        assert attentions.grad is not None

    def test_base_model_prefix_loading(self, encoder, tmp_path):
        masked = encoder["masked"]
        masked.save_pretrained(tmp_path)
        for model_class in (PlugformerForSequenceClassification, PlugformerForTokenClassification):
            head, info = model_class.from_pretrained(tmp_path, num_labels=3, output_loading_info=True)
            assert {key.split(".")[0] for key in info["missing_keys"]} <= {"score"}  # only the new head
            for name, tensor in masked.model.state_dict().items():
                assert torch.equal(head.model.state_dict()[name], tensor), name

    def test_resize_token_embeddings(self, encoder):
        assert_resizes(encoder["masked"], {"input_ids": ids()})


# ---------------------------------------------------------------------------------------------------------------
# Seq2seq
# ---------------------------------------------------------------------------------------------------------------

SEQ2SEQ = dict(is_encoder_decoder=True, pad_token_id=0, num_decoder_layers=3)


@pytest.fixture(scope="class", params=variants(**SEQ2SEQ))  # the scores a seq2seq model takes
def seq2seq(request):
    return make(PlugformerForConditionalGeneration, *request.param, **SEQ2SEQ)


def seq2seq_inputs() -> dict:
    return {"input_ids": ids(), "decoder_input_ids": ids(length=TARGET, seed=1)}


class TestSeq2Seq:
    def test_save_load_round_trip(self, seq2seq, tmp_path):
        assert_saved_and_loaded(seq2seq, tmp_path, seq2seq_inputs())

    def test_inputs_embeds_equal_input_ids(self, seq2seq):
        inputs = seq2seq_inputs()
        embed = seq2seq.get_input_embeddings()
        with torch.no_grad():
            embedded = seq2seq(
                inputs_embeds=embed(inputs["input_ids"]), decoder_inputs_embeds=embed(inputs["decoder_input_ids"])
            ).logits
            expected = seq2seq(**inputs).logits  # the same forward entered at the embeddings: `model_tolerance`
            torch.testing.assert_close(embedded, expected, atol=model_tolerance(seq2seq.config, expected), rtol=0)

    def test_attentions_hidden_states_and_their_gradients(self, seq2seq):
        model = eager_copy(seq2seq)
        config = model.config
        heads = config.num_attention_heads
        output = model(**seq2seq_inputs(), output_attentions=True, output_hidden_states=True)
        layers, decoder_layers = config.num_hidden_layers, config.num_decoder_layers
        assert_attention_maps(output.encoder_attentions, layers, heads, LENGTH, LENGTH, causal=False)
        assert_attention_maps(output.decoder_attentions, decoder_layers, heads, TARGET, TARGET, causal=True)
        assert_attention_maps(output.cross_attentions, decoder_layers, heads, TARGET, LENGTH, causal=False)
        assert len(output.encoder_hidden_states) == layers + 1
        assert len(output.decoder_hidden_states) == decoder_layers + 1
        kept = (output.encoder_attentions[0], output.decoder_attentions[0], output.cross_attentions[0])
        for weights in kept:
            weights.retain_grad()
        output.logits.sum().backward()
        assert all(weights.grad is not None for weights in kept)

    def test_cached_decoding_equals_the_full_forward(self, seq2seq):
        inputs = seq2seq_inputs()
        target = inputs["decoder_input_ids"]
        with torch.no_grad():
            full = seq2seq(**inputs, use_cache=False).logits
            encoder_outputs = seq2seq.get_encoder()(input_ids=inputs["input_ids"])
            step = seq2seq(encoder_outputs=encoder_outputs, decoder_input_ids=target[:, :2], use_cache=True)
            assert isinstance(step.cache, EncoderDecoderCache)
            pieces = [step.logits]
            for position in range(2, TARGET):
                step = seq2seq(
                    encoder_outputs=encoder_outputs,
                    decoder_input_ids=target[:, position : position + 1],
                    cache=step.cache,
                    use_cache=True,
                )
                pieces.append(step.logits)
        # cached against full: fp32's rounding through both stacks times max|logits| (`model_tolerance`)
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=model_tolerance(seq2seq.config, full), rtol=0)

    def test_base_model_prefix_loading(self, seq2seq, tmp_path):
        """T5's layout: the head and its base (`PlugformerSeq2SeqModel`) share parameter names, so each loads the
        other's checkpoint."""
        seq2seq.save_pretrained(tmp_path / "head")
        base, info = PlugformerSeq2SeqModel.from_pretrained(tmp_path / "head", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        inputs = seq2seq_inputs()
        with torch.no_grad():
            hidden = base(**inputs).last_hidden_state
            expected = seq2seq(**inputs).logits  # the base reloaded with the loader's kernel: `model_tolerance`
            atol = model_tolerance(seq2seq.config, expected)
            torch.testing.assert_close(seq2seq.lm_head(hidden), expected, atol=atol, rtol=0)
        base.save_pretrained(tmp_path / "base")
        head, info = PlugformerForConditionalGeneration.from_pretrained(tmp_path / "base", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert head.lm_head.weight is head.encoder.embed_tokens.weight is head.decoder.embed_tokens.weight
        with torch.no_grad():
            torch.testing.assert_close(head(**inputs).logits, expected, atol=atol, rtol=0)

    def test_resize_token_embeddings(self, seq2seq):
        assert_resizes(seq2seq, seq2seq_inputs())


# ---------------------------------------------------------------------------------------------------------------
# Configuration (as transformers' ConfigTester: signature, round trips, common kwargs)
# ---------------------------------------------------------------------------------------------------------------


def test_config_signature_names_the_fields_with_their_defaults():
    parameters = inspect.signature(PlugformerConfig.__init__).parameters
    for name, field in PlugformerConfig.__dataclass_fields__.items():
        if field.init and not name.startswith("_") and name in parameters:
            assert parameters[name].default == field.default or field.default_factory is not None, name
    assert {"attention_score", "position_scheme", "hidden_size", "num_attention_heads"} <= set(parameters)


@pytest.mark.parametrize(("score", "scheme"), [pytest.param(*v.values[0], id=v.id, marks=v.marks) for v in VARIANTS])
def test_config_round_trips(score, scheme, tmp_path):
    """to_dict/from_dict, to_json_file/from_json_file and save/from_pretrained give the same config; a config built
    from the signature's keywords is the config asked for."""
    config = tiny_config(score, scheme, num_labels=3)
    assert PlugformerConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    config.to_json_file(tmp_path / "config.json")
    assert PlugformerConfig.from_json_file(tmp_path / "config.json").to_dict() == config.to_dict()
    parameters = inspect.signature(PlugformerConfig.__init__).parameters
    rebuilt = PlugformerConfig(**{name: getattr(config, name) for name in parameters if name != "self"})
    assert (rebuilt.attention_score, rebuilt.position_scheme, rebuilt.hidden_size) == (score, scheme, 32)


def test_config_common_kwargs():
    """The keywords every transformers config takes are kept (ConfigTester's common kwargs)."""
    common = dict(
        output_hidden_states=True,
        return_dict=False,
        chunk_size_feed_forward=4,
        problem_type="regression",
        architectures=["PlugformerForCausalLM"],
        id2label={0: "a", 1: "b"},
        dtype="float32",
    )
    config = tiny_config(**common)
    for name, value in common.items():
        assert getattr(config, name) == (torch.float32 if name == "dtype" else value), name
    assert config.num_labels == 2


def test_main_input_name_and_embeddings_accessors():
    model = make(PlugformerForCausalLM, "scaled_dot", "rope")
    assert model.main_input_name == "input_ids"
    assert model.get_output_embeddings() is model.lm_head
    replacement = torch.nn.Embedding(128, 32)
    model.set_input_embeddings(replacement)
    assert model.get_input_embeddings() is replacement is model.model.embed_tokens


@pytest.mark.parametrize("score", SCORES)
def test_sinusoidal_inputs_embeds_equal_input_ids_and_generate_alike(score):
    """The sqrt(d) token scale applies to `inputs_embeds` too: embeddings of the ids give the ids' logits, and
    generation continued from `inputs_embeds` picks the tokens generation from the ids picks."""
    model = build(tiny_config(score, "sinusoidal"))
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_ids = model(input_ids=ids).logits
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
        torch.testing.assert_close(from_embeds, from_ids, atol=model_tolerance(model.config, from_ids), rtol=0)
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
        continued = model.generate(
            inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=4, do_sample=False
        )  # returns the new tokens only
    assert torch.equal(continued, generated[:, ids.shape[1] :])


def test_sequence_classification_takes_a_cache_by_its_deprecated_name():
    """`past_key_values=` is the deprecated alias of `cache` on every head that keeps one (it was ignored here)."""
    from transformers.cache_utils import DynamicCache

    from plugformer import PlugformerForSequenceClassification

    torch.manual_seed(0)
    model = PlugformerForSequenceClassification(tiny_config(pad_token_id=0, num_labels=3)).eval()
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        output = model(ids, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 5 and output.cache is cache


@pytest.mark.parametrize("scheme", ["none", "alibi"])
@pytest.mark.parametrize("training", [False, True])
def test_additive_attention_weights_stay_in_the_graph(scheme, training):
    """The weights eager returns for additive scores are those the output is computed from: a gradient reaches them
    (they were a padded copy cut off from the graph), and the output equals the one without weights."""
    model = build(tiny_config("additive", scheme, additive_chunk_size=3))
    model.train(training)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = model(ids).logits
    output = model(ids, output_attentions=True)
    torch.testing.assert_close(output.logits, reference, atol=model_tolerance(model.config, reference), rtol=0)
    attentions = output.attentions[0]
    attentions.retain_grad()
    output.logits.sum().backward()
    assert attentions.grad is not None and attentions.grad.abs().sum() > 0


def test_config_signature_shows_the_fields():
    """Tools that build a config from `inspect.signature` (transformers' tester) see the fields, not `**kwargs`."""
    import inspect

    from plugformer import PlugformerConfig

    parameters = inspect.signature(PlugformerConfig.__init__).parameters
    assert {"attention_score", "position_scheme", "hidden_size", "use_cache"} <= set(parameters)
    assert parameters["attention_score"].default == "scaled_dot"


def test_config_keeps_transformers_bookkeeping_kwargs(tmp_path):
    """What transformers passes or writes (labels, dtype, legacy names, generation settings, custom attributes)
    still loads."""
    from plugformer import PlugformerConfig

    config = tiny_config(
        num_labels=3,
        problem_type="single_label_classification",
        torch_dtype="float32",
        output_attentions=True,
        name_or_path="x",
        my_own_note="kept",
    )
    config.save_pretrained(tmp_path)
    loaded = PlugformerConfig.from_pretrained(tmp_path, attn_implementation="eager")
    assert loaded.num_labels == 3 and loaded.my_own_note == "kept"
    unnamed = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert unnamed(loaded) == unnamed(config)


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("scheme", ["rope", "alibi"])
def test_capability_flags_follow_the_config(score, scheme):
    """`_supports_sdpa` / `_supports_flex_attn` / `_supports_flash_attn` answer for the model's config (the kernel
    table), so transformers and its tests skip what the config cannot run; an explicit request of such a kernel
    raises, the default resolves to eager; a supported sdpa can be set at run time."""
    from plugformer import ATTENTION_SCORES, KERNELS, PlugformerForCausalLM

    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny_config(score, scheme))
    config = model.config
    for flag, kernel in (
        ("_supports_sdpa", "sdpa"),
        ("_supports_flex_attn", "flex_attention"),
        ("_supports_flash_attn", "flash_attention_2"),
    ):
        assert getattr(model, flag) is (KERNELS.get(kernel).unsupported_reason(config) is None), flag
    dot_product = ATTENTION_SCORES.get(score).dot_product
    assert model.config._attn_implementation == ("sdpa" if dot_product else "eager")
    if dot_product:
        model.set_attn_implementation("eager")
        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
    else:
        with pytest.raises(ValueError, match=f"attention_score={score!r}"):
            model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "eager"
