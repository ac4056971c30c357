"""Hostile inputs: each malformed input fails with a `ValueError` / `TypeError` naming the argument, before any work,
and leaves the model (weights, outputs, the cache it was given) as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build, tiny_config
from tolerances import model_tolerance
from transformers import DynamicCache, StaticCache

from plugformer import (
    POSITION_SCHEMES,
    PlugformerForConditionalGeneration,
    PlugformerForMaskedLM,
    PlugformerForSequenceClassification,
    stack,
    train_tokenizer,
)
from plugformer import inputs as checks


VOCAB, HIDDEN = 128, 32  # the tiny preset's


def causal():
    return build(tiny_config("scaled_dot", "rope"), "sdpa")


def encoder(head=PlugformerForMaskedLM):
    config = copy.deepcopy(tiny_config("multiplicative", "t5_bias", is_causal=False, pad_token_id=0))
    torch.manual_seed(0)
    return head(config).eval()


def seq2seq():
    config = copy.deepcopy(tiny_config("scaled_dot", "alibi", is_encoder_decoder=True, pad_token_id=0))
    torch.manual_seed(0)
    return PlugformerForConditionalGeneration(config).eval()


MODELS = {"causal": causal, "masked": encoder, "classifier": lambda: encoder(PlugformerForSequenceClassification)}


def ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def output(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def assert_refused(model, error: type[Exception], pattern: str, valid: dict, **bad) -> None:
    """`model(**bad)` raises `error` matching `pattern`; weights and the output on `valid` are unchanged."""
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    expected = output(model, valid)
    with pytest.raises(error, match=pattern):
        output(model, bad)
    torch.testing.assert_close(output(model, valid), expected, atol=0, rtol=0)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in model.state_dict().items())


# --- token ids ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 1000, -1])
def test_ids_outside_the_vocabulary(kind, bad_id):
    model, tokens = MODELS[kind](), ids(2, 6)
    bad = tokens.clone()
    bad[1, 3] = bad_id
    pattern = rf"input_ids contains id {bad_id}, outside the vocabulary of vocab_size={VOCAB}"
    assert_refused(model, ValueError, pattern, dict(input_ids=tokens), input_ids=bad)


@pytest.mark.parametrize("bad_id", [VOCAB, -1])
def test_ids_are_checked_up_front_off_the_cpu(bad_id):
    """On an accelerator (no device here: the check itself) the ids are reduced before any work, as an
    out-of-range embedding index there is a device-side assert; on the CPU the embedding's IndexError is
    translated (`test_ids_outside_the_vocabulary`)."""
    bad = ids(2, 6)
    bad[1, 3] = bad_id
    with pytest.raises(ValueError, match=rf"input_ids contains id {bad_id}, outside the vocabulary of vocab_size"):
        checks._raise_first(checks._value_checks("", VOCAB, bad, None, [], None))
    checks._raise_first(checks._value_checks("", VOCAB, ids(2, 6), None, [], None))  # in range: no error


def test_an_index_error_with_ids_in_range_is_not_renamed():
    class Broken(torch.nn.Embedding):
        def forward(self, input):
            raise IndexError("something else")

    with pytest.raises(IndexError, match="something else"):
        checks.embed_ids(Broken(VOCAB, 4), ids(1, 3), "input_ids")


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("shape", [(1, 0), (0, 5)])
def test_empty_input_ids(kind, shape):
    model = MODELS[kind]()
    empty = torch.zeros(shape, dtype=torch.long)
    assert_refused(
        model,
        ValueError,
        rf"input_ids is empty \(shape \({shape[0]}, {shape[1]}\)\)",
        dict(input_ids=ids(1, 5)),
        input_ids=empty,
    )


def test_empty_inputs_embeds():
    pattern = r"inputs_embeds is empty \(shape \(2, 0, 32\)\)"
    empty = torch.zeros(2, 0, HIDDEN)
    assert_refused(causal(), ValueError, pattern, dict(input_ids=ids(2, 5)), inputs_embeds=empty)


def test_neither_or_both_of_input_ids_and_inputs_embeds():
    model, tokens = causal(), ids(1, 5)
    assert_refused(model, ValueError, "exactly one of input_ids or inputs_embeds", dict(input_ids=tokens))
    embeds = model.get_input_embeddings()(tokens)
    pattern = "exactly one of input_ids or inputs_embeds"
    assert_refused(model, ValueError, pattern, dict(input_ids=tokens), input_ids=tokens, inputs_embeds=embeds)


# --- attention masks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("mask_shape", [(2, 9), (2, 3), (3, 6), (1, 6)])
def test_attention_mask_of_another_shape(kind, mask_shape):
    model, tokens = MODELS[kind](), ids(2, 6)
    mask = torch.ones(mask_shape, dtype=torch.long)
    pattern = rf"attention_mask has shape \({mask_shape[0]}, {mask_shape[1]}\), but input_ids has shape \(2, 6\)"
    valid = dict(input_ids=tokens, attention_mask=torch.ones(2, 6, dtype=torch.long))
    assert_refused(model, ValueError, pattern, valid, input_ids=tokens, attention_mask=mask)


@pytest.mark.parametrize("mask", [torch.ones(6, dtype=torch.long), torch.ones(1, 2, 6), torch.ones(2, 6) * 1j])
def test_attention_mask_that_is_not_a_2d_padding_mask(mask):
    model, tokens = causal(), ids(2, 6)
    pattern = "attention_mask must be a 2-D .* mask"
    assert_refused(model, ValueError, pattern, dict(input_ids=tokens), input_ids=tokens, attention_mask=mask)


def test_attention_mask_must_cover_the_cached_tokens_and_a_refused_step_leaves_the_cache_intact():
    model, tokens = causal(), ids(1, 6)
    with torch.no_grad():
        expected = model(tokens, use_cache=False).logits[:, -1]
        cache = DynamicCache(config=model.config)
        model(tokens[:, :5], attention_mask=torch.ones(1, 5, dtype=torch.long), cache=cache, use_cache=True)
        pattern = r"attention_mask has shape \(1, 1\), but input_ids has shape \(1, 1\) after 5 cached tokens: " + (
            r"expected \(1, 6\)"
        )
        with pytest.raises(ValueError, match=pattern):
            model(tokens[:, 5:], attention_mask=torch.ones(1, 1, dtype=torch.long), cache=cache, use_cache=True)
        assert cache.get_seq_length() == 5
        step = model(tokens[:, 5:], attention_mask=torch.ones(1, 6, dtype=torch.long), cache=cache, use_cache=True)
    atol = model_tolerance(model.config, expected[:, None])  # a cached step against the full forward's last token
    torch.testing.assert_close(step.logits[:, -1], expected, atol=atol, rtol=0)


@pytest.mark.parametrize("kind", MODELS)
def test_attention_mask_dtypes_bool_int_and_0_1_float_are_one_mask(kind):
    model, tokens = MODELS[kind](), ids(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0  # right padding
    expected = output(model, dict(input_ids=tokens, attention_mask=mask))
    for same in (mask.bool(), mask.int(), mask.float(), mask.double()):
        torch.testing.assert_close(output(model, dict(input_ids=tokens, attention_mask=same)), expected)


@pytest.mark.parametrize("values", [(0.0, 0.5), (0.0, float("-inf")), (0, 2), (-1, 1), (0.0, float("nan"))])
def test_attention_mask_values_other_than_0_and_1(values):
    """A float mask of probabilities, an additive 0 / -inf mask, or integer counts are not padding masks."""
    model, tokens = causal(), ids(2, 6)
    mask = torch.tensor([values[1]] * 6 + [values[0]] + [values[1]] * 5).reshape(2, 6)
    pattern = r"attention_mask must hold 1 \(attend\) and 0 \(padding\), got other values"
    assert_refused(model, ValueError, pattern, dict(input_ids=tokens), input_ids=tokens, attention_mask=mask)


# --- positions ---------------------------------------------------------------------------------------------------


def test_learned_positions_refuse_sequences_past_max_position_embeddings():
    model = build(tiny_config("scaled_dot", "learned", max_position_embeddings=16), "sdpa")
    pattern = r"max_position_embeddings=16 positions, but position 16 was requested"
    assert_refused(model, ValueError, pattern, dict(input_ids=ids(1, 16)), input_ids=ids(1, 17))


def test_the_check_learned_positions_run_before_the_lookup_off_the_cpu():
    """Off the CPU (no device here: the check itself) the largest position is checked before the lookup, as an
    out-of-range index there is a device-side assert; on the CPU the lookup's IndexError is translated
    (`test_learned_positions_refuse_sequences_past_max_position_embeddings`)."""
    positions = build(tiny_config("scaled_dot", "learned", max_position_embeddings=16), "sdpa").model.positions
    pattern = r"max_position_embeddings=16 positions, but position 16 was requested"
    with pytest.raises(ValueError, match=pattern) as error:
        positions._refuse_past_the_table(16)
    assert f"without a table of positions ({', '.join(UNBOUNDED)})" in str(error.value)  # each of them runs past it
    positions._refuse_past_the_table(15)


# the schemes without a table of positions
UNBOUNDED = [name for name in POSITION_SCHEMES if POSITION_SCHEMES.get(name).max_length(tiny_config()) is None]


@pytest.mark.parametrize("scheme", UNBOUNDED)
def test_relative_and_computed_schemes_run_past_max_position_embeddings(scheme):
    model = build(tiny_config("scaled_dot", scheme, max_position_embeddings=16), "sdpa")
    logits = output(model, dict(input_ids=ids(2, 32)))
    assert logits.shape == (2, 32, VOCAB) and torch.isfinite(logits).all()


def test_position_ids_of_float_dtype():
    model, tokens = causal(), ids(1, 6)
    positions = torch.arange(6)[None]
    pattern = r"position_ids must hold integer positions \(torch.long or torch.int\), got dtype torch.float32"
    valid = dict(input_ids=tokens, position_ids=positions)
    assert_refused(model, TypeError, pattern, valid, input_ids=tokens, position_ids=positions.float())


@pytest.mark.parametrize("positions", [torch.arange(5)[None], torch.arange(6), torch.arange(6).expand(3, 6)])
def test_position_ids_of_another_shape(positions):
    model, tokens = causal(), ids(2, 6)
    pattern = rf"position_ids has shape \({', '.join(map(str, positions.shape))},?\), but input_ids has shape \(2, 6\)"
    assert_refused(model, ValueError, pattern, dict(input_ids=tokens), input_ids=tokens, position_ids=positions)


def test_negative_position_ids():
    model, tokens = causal(), ids(1, 6)
    positions = torch.arange(6)[None] - 3
    pattern = "position_ids contains negative positions, e.g. -3"
    assert_refused(model, ValueError, pattern, dict(input_ids=tokens), input_ids=tokens, position_ids=positions)


# --- dtypes and values -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int16])
def test_input_ids_of_a_non_index_dtype(kind, dtype):
    model, tokens = MODELS[kind](), ids(2, 6)
    pattern = rf"input_ids must hold integer token ids \(torch.long or torch.int\), got dtype {dtype}"
    assert_refused(model, TypeError, pattern, dict(input_ids=tokens), input_ids=tokens.to(dtype))


def test_input_ids_of_int32_are_accepted():
    model, tokens = causal(), ids(2, 6)
    torch.testing.assert_close(output(model, dict(input_ids=tokens.int())), output(model, dict(input_ids=tokens)))


def test_input_ids_that_are_not_a_tensor_or_not_2d():
    model, tokens = causal(), ids(2, 6)
    valid = dict(input_ids=tokens)
    assert_refused(model, TypeError, "input_ids must be a torch.Tensor, got list", valid, input_ids=tokens.tolist())
    pattern = r"input_ids must have shape \(batch_size, sequence_length\), got \(6,\)"
    assert_refused(model, ValueError, pattern, valid, input_ids=tokens[0])


def test_inputs_embeds_of_integer_dtype_or_wrong_width():
    model, tokens = causal(), ids(2, 6)
    embeds = model.get_input_embeddings()(tokens).detach()
    valid = dict(inputs_embeds=embeds)
    pattern = "inputs_embeds must be a floating-point tensor, got dtype torch.int64"
    assert_refused(model, TypeError, pattern, valid, inputs_embeds=embeds.long())
    pattern = rf"inputs_embeds must have shape \(batch_size, sequence_length, hidden_size={HIDDEN}\), got \(2, 6, 31\)"
    assert_refused(model, ValueError, pattern, valid, inputs_embeds=embeds[..., :31])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_inputs_embeds_with_nan_or_infinity(value):
    model, tokens = causal(), ids(2, 6)
    embeds = model.get_input_embeddings()(tokens).detach()
    bad = embeds.clone()
    bad[1, 2, 5] = value
    pattern = "inputs_embeds contains NaN or infinity"
    assert_refused(model, ValueError, pattern, dict(inputs_embeds=embeds), inputs_embeds=bad)


def test_generate_refuses_ids_outside_the_vocabulary():
    model, prompt = causal(), ids(1, 4)
    expected = model.generate(prompt, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match=rf"input_ids contains id {VOCAB + 7}, outside the vocabulary"):
        model.generate(torch.cat([prompt, torch.tensor([[VOCAB + 7]])], dim=1), max_new_tokens=3, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False), expected)


def test_checks_compile_whole_with_a_static_cache():
    """`check_inputs` adds no graph break: value checks are skipped while compiling, shape checks are static."""
    model, prompt = causal(), ids(1, 8)
    expected = model.generate(prompt, max_new_tokens=3, do_sample=False)[:, 8:]
    cache = StaticCache(config=model.config, max_cache_len=16)
    step = torch.compile(model.forward, fullgraph=True)
    mask = torch.ones(1, 8, dtype=torch.long)
    with torch.no_grad():
        token = model(prompt, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        generated = [token]
        for position in range(8, 10):
            mask = torch.ones(1, position + 1, dtype=torch.long)
            logits = step(
                input_ids=token,
                attention_mask=mask,
                cache=cache,
                use_cache=True,
                position_ids=torch.tensor([[position]]),
            ).logits
            token = logits[:, -1:].argmax(-1)
            generated.append(token)
    assert torch.equal(torch.cat(generated, dim=1), expected)


# --- seq2seq -----------------------------------------------------------------------------------------------------


def seq2seq_inputs() -> dict:
    return dict(input_ids=ids(2, 7), decoder_input_ids=ids(2, 5, seed=1))


@pytest.mark.parametrize(
    "bad,error,pattern",
    [
        (
            dict(decoder_input_ids=ids(2, 5) + VOCAB),
            ValueError,
            r"decoder_input_ids contains id \d+, outside the vocab",
        ),
        (dict(decoder_input_ids=-ids(2, 5)), ValueError, r"decoder_input_ids contains id -\d+, outside the vocabulary"),
        (dict(decoder_input_ids=ids(2, 5).float()), TypeError, "decoder_input_ids must hold integer token ids"),
        (dict(decoder_input_ids=torch.zeros(2, 0, dtype=torch.long)), ValueError, "decoder_input_ids is empty"),
        (dict(decoder_input_ids=ids(5)), ValueError, r"decoder_input_ids must have shape \(batch_size, seq"),
        (
            dict(decoder_attention_mask=torch.ones(2, 4, dtype=torch.long)),
            ValueError,
            r"decoder_attention_mask has shape \(2, 4\), but decoder_input_ids has shape \(2, 5\)",
        ),
        (dict(input_ids=ids(2, 7) + VOCAB), ValueError, r"input_ids contains id \d+, outside the vocabulary"),
        (
            dict(attention_mask=torch.ones(2, 6, dtype=torch.long)),
            ValueError,
            r"attention_mask has shape \(2, 6\), but input_ids has shape \(2, 7\)",
        ),
    ],
)
def test_seq2seq_refuses_bad_source_and_decoder_inputs(bad, error, pattern):
    assert_refused(seq2seq(), error, pattern, seq2seq_inputs(), **{**seq2seq_inputs(), **bad})


def test_seq2seq_source_mask_must_match_precomputed_encoder_outputs():
    model, inputs = seq2seq(), seq2seq_inputs()
    with torch.no_grad():
        encoder_outputs = model.encoder(inputs["input_ids"])
    valid = dict(encoder_outputs=encoder_outputs, decoder_input_ids=inputs["decoder_input_ids"])
    pattern = r"attention_mask has shape \(2, 9\), but the encoder output covers \(2, 7\) tokens"
    assert_refused(model, ValueError, pattern, valid, **valid, attention_mask=torch.ones(2, 9, dtype=torch.long))


# --- tokenizer ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)


@pytest.mark.parametrize("bad", [10**6, -1, "len"])
@pytest.mark.parametrize("method", ["decode", "batch_decode", "convert_ids_to_tokens"])
def test_tokenizer_refuses_ids_it_does_not_have(tokenizer, bad, method):
    """The `tokenizers` backend would drop unknown ids silently ('' for 10**6) and overflow on negative ones."""
    bad = len(tokenizer) if bad == "len" else bad
    good = tokenizer("the lazy dog")["input_ids"]
    expected = tokenizer.decode(good)
    sequence = [*good, bad]
    with pytest.raises(ValueError, match=rf"token_ids contains {bad}, which this tokenizer does not have \(ids 0 to"):
        getattr(tokenizer, method)([sequence] if method == "batch_decode" else sequence)
    assert tokenizer.decode(good) == expected == "the lazy dog"


def test_tokenizer_refuses_ids_that_are_not_integers_and_accepts_tensors(tokenizer):
    good = tokenizer("the lazy dog")["input_ids"]
    with pytest.raises(TypeError, match=r"token_ids must be integers, got 1.5"):
        tokenizer.decode([*good, 1.5])
    assert tokenizer.decode(torch.tensor(good)) == tokenizer.decode(good) == "the lazy dog"
    assert tokenizer.convert_ids_to_tokens(torch.tensor(good)) == tokenizer.convert_ids_to_tokens(good)


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_generate_checks_the_inputs_it_was_given_not_those_it_built(kind, monkeypatch):
    """The first step (and a seq2seq encoder) runs the checks; later steps feed back generate's own ids, masks and
    positions, built from checked inputs, with `validate_inputs=False`."""
    model = causal() if kind == "causal" else seq2seq()
    prompt = ids(2, 5)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    checked = []
    original = stack.check_inputs  # looked up by PlugformerModel.forward in its module, `stack`
    monkeypatch.setattr(stack, "check_inputs", lambda *args: checked.append(args[1]) or original(*args))
    generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, expected)
    assert torch.equal(checked[0], prompt)  # the prompt's ids (for seq2seq, in the encoder)
    if kind == "causal":
        assert len(checked) == 1
    else:  # and the decoder's first step: the start token
        assert len(checked) == 2 and checked[1].tolist() == [[model.generation_config.decoder_start_token_id]] * 2


def test_generate_still_names_a_misspelt_argument():
    model = causal()
    with pytest.raises(ValueError, match=r"model_kwargs` are not used by the model: \['args'\]"):
        model.generate(ids(1, 4), max_new_tokens=2, args=1)


def test_validate_inputs_false_skips_the_checks():
    model, tokens = causal(), ids(2, 6)
    half = torch.full((2, 6), 0.5)
    with pytest.raises(ValueError, match="attention_mask must hold 1"):
        model(tokens, attention_mask=half)
    model(tokens, attention_mask=half, validate_inputs=False)  # the caller vouches for its inputs


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32])
def test_an_all_zero_mask_row_is_refused(dtype):
    """A sequence with nothing to attend to has no defined softmax: refused, naming the argument and the row."""
    from plugformer import PlugformerForConditionalGeneration

    model = build(tiny_config())
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, dtype=dtype)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"attention_mask row 1 is all zeros"):
        model(ids, attention_mask=mask)
    seq2seq = PlugformerForConditionalGeneration(tiny_config(is_encoder_decoder=True, pad_token_id=0)).eval()
    with pytest.raises(ValueError, match=r"^attention_mask row 1 is all zeros"):
        seq2seq(ids, attention_mask=mask, decoder_input_ids=ids[:, :2])
    with pytest.raises(ValueError, match=r"decoder_attention_mask row 1 is all zeros"):
        seq2seq(ids, decoder_input_ids=ids, decoder_attention_mask=mask)


@pytest.mark.parametrize("head", ["causal", "masked", "seq2seq", "classification"])
def test_labels_out_of_range_name_labels(head):
    """Labels past the vocabulary (or the classes) raised torch's IndexError naming neither."""
    import torch

    from plugformer import (
        PlugformerForCausalLM,
        PlugformerForConditionalGeneration,
        PlugformerForMaskedLM,
        PlugformerForSequenceClassification,
    )
    from tests.conftest import tiny_config

    classes = {
        "causal": PlugformerForCausalLM,
        "masked": PlugformerForMaskedLM,
        "seq2seq": PlugformerForConditionalGeneration,
        "classification": PlugformerForSequenceClassification,
    }
    extra = {
        "masked": {"is_causal": False},
        "seq2seq": {"is_encoder_decoder": True, "pad_token_id": 0},
        "classification": {"num_labels": 3, "pad_token_id": 0},
    }.get(head, {})
    model = classes[head](tiny_config(**extra)).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 5))
    limit = 3 if head == "classification" else model.config.vocab_size
    good = torch.tensor([0, 2]) if head == "classification" else ids.index_fill(1, torch.tensor([0]), -100)
    bad = torch.tensor([0, limit]) if head == "classification" else ids.clone().fill_(limit)
    assert torch.isfinite(model(input_ids=ids, labels=good).loss)
    with pytest.raises(ValueError, match=rf"labels holds {limit}, outside \[0, {limit - 1}\]"):
        model(input_ids=ids, labels=bad)
