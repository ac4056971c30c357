"""Load: many prompts of mixed lengths in one left-padded batch generate exactly what each generates alone, and one
model serves several threads at once with the outputs of one-at-a-time calls."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from conftest import build, tiny_config
from tolerances import model_tolerance

from plugformer import PlugformerForConditionalGeneration, train_tokenizer
from plugformer.data.corpus import arithmetic_sentences


STEPS = 10  # new tokens per prompt
THREADS = 8
# 16 prompts cut to 1..6 words of arithmetic sentences: 2 to 11 tokens, so rows carry 0 to 9 padding tokens
PROMPTS = [" ".join(text.split()[: 1 + i % 6]) for i, text in enumerate(arithmetic_sentences(16, seed=1))]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_tokenizer(arithmetic_sentences(400), vocab_size=300)
    tokenizer.padding_side = "left"
    return tokenizer


def language_model(tokenizer, score: str, scheme: str, kernel: str, **overrides):
    config = tiny_config(
        score,
        scheme,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )
    return build(config, kernel)


def generate_alone(model, tokenizer, prompt: str, **kwargs) -> torch.Tensor:
    """The new tokens greedy decoding gives `prompt` on its own (no padding)."""
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, **kwargs)
    return output[0, inputs["input_ids"].shape[1] :]


BATCH_VARIANTS = [
    ("scaled_dot", "alibi", "sdpa", None),
    ("dot", "t5_bias", "eager", None),
    ("multiplicative", "learned", "sdpa", None),
    ("scaled_dot", "rope", "eager", None),
    ("multiplicative", "rope", "sdpa", None),
    ("additive", "clamped_bias", "eager", None),
    ("additive", "alibi", "eager", None),
    ("dot", "sinusoidal", "sdpa", None),
    ("scaled_dot", "t5_bias", "sdpa", "static"),
]


@pytest.mark.parametrize(
    "score,scheme,kernel,cache_implementation",
    [pytest.param(*variant, id="-".join(filter(None, variant))) for variant in BATCH_VARIANTS],
)
def test_a_batch_of_many_left_padded_prompts_generates_what_each_prompt_generates_alone(
    tokenizer, score, scheme, kernel, cache_implementation
):
    model = language_model(tokenizer, score, scheme, kernel)
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum(-1).unique().numel() >= 6  # mixed lengths, up to 9 padding tokens a row
    width = batch["input_ids"].shape[1]
    kwargs = {"cache_implementation": cache_implementation} if cache_implementation else {}
    generated = model.generate(**batch, max_new_tokens=STEPS, do_sample=False, **kwargs)[:, width:]
    for row, prompt in enumerate(PROMPTS):
        alone = generate_alone(model, tokenizer, prompt, **kwargs)
        assert torch.equal(generated[row, : len(alone)], alone), prompt
        # a prompt that ended at end-of-text alone is padded in the batch while the others go on
        assert (generated[row, len(alone) :] == tokenizer.pad_token_id).all(), prompt


def encode_requests(tokenizer, count: int) -> list[dict]:
    """The inputs of `count` requests, encoded up front: a fast tokenizer is not thread-safe (each call with or
    without `padding` reconfigures the one Rust tokenizer it wraps, so a concurrent unpadded call can strip a padded
    batch's padding)."""
    requests = []
    for job in range(count):
        prompt, other = PROMPTS[job % len(PROMPTS)], PROMPTS[(job + 5) % len(PROMPTS)]
        requests.append(
            {
                "single": tokenizer(prompt, return_tensors="pt"),
                "pair": tokenizer([prompt, other], padding=True, return_tensors="pt"),
            }
        )
    return requests


def serve(model, request: dict) -> dict[str, torch.Tensor]:
    """One request: a forward with attentions and hidden states recorded (eager), a padded pair, a greedy generate."""
    eager = model.config._attn_implementation == "eager"
    with torch.no_grad():
        single = model(**request["single"], output_attentions=eager, output_hidden_states=True)
        padded = model(**request["pair"]).logits
    results = {"logits": single.logits, "padded": padded, "hidden": torch.stack(single.hidden_states)}
    if eager:
        results["attentions"] = torch.stack(single.attentions)
    results["generated"] = model.generate(**request["single"], max_new_tokens=STEPS, do_sample=False)
    return results


def seq2seq_serve(model, request: dict) -> dict[str, torch.Tensor]:
    inputs = request["single"]
    with torch.no_grad():
        logits = model(**inputs, decoder_input_ids=inputs["input_ids"][:, :3]).logits
    return {"logits": logits, "generated": model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)}


@contextmanager
def intra_op_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def assert_same_results(expected: dict, got: dict, config) -> None:
    assert expected.keys() == got.keys()
    for name in expected:
        if expected[name].is_floating_point():
            # kernels may pick other blockings under contention: equal up to float rounding, not always bitwise
            # (fp32's rounding through `config`'s model, `model_tolerance`)
            atol = model_tolerance(config, expected[name])
            torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=0, msg=name)
        else:
            assert torch.equal(got[name], expected[name]), name


THREAD_VARIANTS = [
    ("scaled_dot", "alibi", "sdpa"),
    ("multiplicative", "rope", "eager"),
    ("additive", "t5_bias", "eager"),
    ("seq2seq", "t5_bias", "sdpa"),
]


# the last two run by default (the chunked additive kernel, seq2seq's caches); the first two under -m slow (~15 s)
@pytest.mark.parametrize(
    "score,scheme,kernel",
    [
        pytest.param(*variant, id="-".join(variant), marks=[pytest.mark.slow] if variant in THREAD_VARIANTS[:2] else [])
        for variant in THREAD_VARIANTS
    ],
)
def test_one_model_serves_many_threads_with_the_outputs_of_one_at_a_time_calls(tokenizer, score, scheme, kernel):
    """8 threads share one model (forward with recorded outputs, padded batches, generate): transformers' output
    recording keeps its collector in a ContextVar, caches belong to each call, and nothing in plugformer's forward
    writes to the model."""
    if score == "seq2seq":
        config = tiny_config(
            "scaled_dot",
            scheme,
            vocab_size=len(tokenizer),
            is_encoder_decoder=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        config._attn_implementation = kernel
        torch.manual_seed(0)
        model, request = PlugformerForConditionalGeneration(config).eval(), seq2seq_serve
    else:
        model, request = language_model(tokenizer, score, scheme, kernel), serve
    requests = encode_requests(tokenizer, 2 * len(PROMPTS))
    jobs = list(range(len(requests)))
    # one intra-op thread per request, as a server running many request threads would (8 threads each fanning out
    # over every core mostly wait for each other); the one-at-a-time reference runs the same way
    with intra_op_threads(1), ThreadPoolExecutor(max_workers=THREADS) as pool:
        expected = {job: request(model, requests[job]) for job in jobs}
        for repeat in range(2):  # reshuffled each time so that different requests overlap
            order = jobs[repeat::2] + jobs[1 - repeat :: 2]
            for job, got in zip(order, pool.map(lambda job: request(model, requests[job]), order), strict=True):
                assert_same_results(expected[job], got, model.config)


@pytest.mark.xfail(
    strict=True,
    reason="dynamic RoPE keeps its frequencies as module state (transformers' "
    "dynamic_rope_update, as in Llama): a call's output depends on the calls before it, and threads "
    "race on it",
)
def test_dynamic_rope_outputs_do_not_depend_on_earlier_calls(tokenizer):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = language_model(tokenizer, "scaled_dot", "rope", "sdpa", max_position_embeddings=8, rope_parameters=rope)
    medium = tokenizer(PROMPTS[5], return_tensors="pt")  # 11 tokens: past the 8 trained positions
    long = tokenizer(" ".join(itertools.islice(PROMPTS, 8)), return_tensors="pt")
    with torch.no_grad():
        fresh = model(**medium).logits
        model(**long)  # grows the module's cached frequencies to the long length
        torch.testing.assert_close(model(**medium).logits, fresh)
