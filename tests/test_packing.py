"""Packed documents: position_ids restarting inside a row keep the documents apart on every kernel, and the pretrain
stage's packing keeps positions within the block.

The variants come from the registries (`conftest.projection_combinations`), flex_attention on the combination suite's
representatives (see `variants`).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import BIAS_SCHEMES, PLAIN_SCHEMES, SCORES, build, projection_combinations, tiny_config
from tolerances import model_tolerance
from transformers import DynamicCache

from plugformer import PlugformerForCausalLM, PlugformerForMaskedLM, train_tokenizer
from plugformer.data.packing import pack as pack_arrays


def pack(*args, **kwargs) -> dict:
    """`pack`'s blocks as lists (it returns numpy arrays, which `datasets` stores as they are)."""
    return {name: array.tolist() for name, array in pack_arrays(*args, **kwargs).items()}


def variants() -> list:
    """Every (score, scheme, kernel), flex_attention on the combination suite's representatives: by default the
    conftest's `DEFAULT_PAIRS` and its one flex row `DEFAULT_FLEX` (a score bias: the bias in `score_mod`, the
    documents in `mask_mod`; a cold compile costs 13-40 s per representative on the CPU), the rest with `-m slow`;
    for each attention projection."""
    return projection_combinations(all_flex=False, representative=True)


# Two rows packed differently (so the document index is read per row): 3 documents, then 2.
ROWS = ((5, 7, 4), (9, 7))


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, position_ids)` of shape (2, 16), positions restarting at each document."""
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 128, (len(ROWS), sum(ROWS[0])), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ROWS])
    return ids, positions


def assert_documents_equal_alone(model, alone_model, ids, positions, **kwargs) -> None:
    """The packed rows on `model` equal each document run alone on `alone_model` (default `use_cache`: the model
    makes a cache, as in training) within fp32's rounding through the model (`model_tolerance`)."""
    with torch.no_grad():
        packed = model(ids, position_ids=positions, **kwargs).logits
        for row, lengths in enumerate(ROWS):
            start = 0
            for length in lengths:
                alone = alone_model(ids[row : row + 1, start : start + length]).logits[0]
                atol = model_tolerance(model.config, alone[None])
                torch.testing.assert_close(packed[row, start : start + length], alone, atol=atol, rtol=0)
                start += length


@pytest.mark.parametrize("score,scheme,kernel,projection", variants())
def test_packed_documents_equal_each_document_alone(score, scheme, kernel, projection):
    """With or without an all-ones attention mask (transformers reads packing only without mask and cache), and
    for the relative biases (alibi, t5_bias, clamped_bias) too: no document sees another."""
    config = tiny_config(score, scheme, projection)
    model = build(config, kernel)
    # flex compiles a kernel per shape on the CPU (seconds each): its documents run alone on eager, the same weights
    # (flex == eager per document length is the combination suite's `test_fused_kernels_match_eager`)
    alone_model = build(config, "eager") if kernel == "flex_attention" else model
    ids, positions = packed_batch()
    assert_documents_equal_alone(model, alone_model, ids, positions)
    ones = torch.ones_like(ids)
    assert_documents_equal_alone(model, alone_model, ids, positions, attention_mask=ones)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_packed_documents_stay_apart_in_training_mode(kernel):
    """The pretrain batch (input_ids, position_ids; no mask) with gradients on, where sdpa runs a learned bias
    through its own backward-recomputing kernel (`LearnedBiasAttention`): each document's logits as alone."""
    model = build(tiny_config("scaled_dot", "t5_bias"), kernel).train()
    ids, positions = packed_batch()
    logits = model(ids[:1], position_ids=positions[:1]).logits[0]
    start = 0
    for length in ROWS[0]:
        alone = model(ids[:1, start : start + length]).logits[0]
        atol = model_tolerance(model.config, alone[None])  # packed against alone
        torch.testing.assert_close(logits[start : start + length], alone, atol=atol, rtol=0)
        start += length


def test_cached_decoding_with_position_ids_equals_the_full_forward():
    """A cache holds no packing: chunks after the first read all cached keys, whatever `position_ids` say."""
    model = build(tiny_config("scaled_dot", "alibi"), "sdpa")
    ids = packed_batch()[0][:1]
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        full = model(ids, position_ids=positions).logits
        cache, chunks, start = DynamicCache(config=model.config), [], 0
        for size in (6, 1, 9):
            step = slice(start, start + size)
            chunks.append(model(ids[:, step], position_ids=positions[:, step], cache=cache, use_cache=True).logits)
            start += size
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=model_tolerance(model.config, full), rtol=0)


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """The `position_ids` transformers' `generate()` passes: counted over the real tokens, 1 at each pad."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


@pytest.mark.parametrize("scheme", PLAIN_SCHEMES)
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_a_padding_mask_turns_off_documents_read_from_position_ids(scheme, kernel):
    """transformers reads packing from `position_ids` only without a padding mask. A mask with a hole (1, 0, 1, 1, ...)
    and generate()'s positions (1 at the pad) used to start a "document" after the pad, cutting token 0 off the later
    tokens: now the real tokens' logits are those of the same text without the pad (Llama's behaviour), and a
    left-padded row's too."""
    model = build(tiny_config("scaled_dot", scheme), kernel)
    ids = packed_batch()[0][:, :8]
    hole = torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]])  # a hole; left padding
    with torch.no_grad():
        padded = model(ids, attention_mask=hole, position_ids=generate_positions(hole)).logits
        for row in range(2):
            real = hole[row].bool()
            alone = model(ids[row : row + 1, real]).logits[0]
            atol = model_tolerance(model.config, alone[None])  # padded against alone
            torch.testing.assert_close(padded[row, real], alone, atol=atol, rtol=0)
        changed = ids.clone()
        changed[0, 0] = (ids[0, 0] + 1) % model.config.vocab_size
        other = model(changed, attention_mask=hole, position_ids=generate_positions(hole)).logits
    assert (other[0, -1] - padded[0, -1]).abs().max() > 1e-4  # token 0 reaches the last token


def test_a_padding_mask_keeps_bias_schemes_reading_token_0():
    """The same for every relative-bias scheme: token 0 still reaches the last token across the hole."""
    hole = torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]])
    for scheme in BIAS_SCHEMES:
        model = build(tiny_config("scaled_dot", scheme), "eager")
        ids = packed_batch()[0][:1, :8]
        changed = ids.clone()
        changed[0, 0] = (ids[0, 0] + 1) % model.config.vocab_size
        with torch.no_grad():
            logits = [
                model(x, attention_mask=hole, position_ids=generate_positions(hole)).logits for x in (ids, changed)
            ]
        assert (logits[0][0, -1] - logits[1][0, -1]).abs().max() > 1e-4, scheme


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["the cat sat on the mat", "1 + 2 = 3"] * 20, vocab_size=300)


def test_pack_keeps_every_position_within_the_block(tokenizer):
    """A document longer than several blocks restarts at each block's start (it used to run on to 31, 63, ...)."""
    long_text = " ".join(["the cat sat on the mat"] * 40)
    examples = {"text": ["1 + 2 = 3", long_text, "1 + 2 = 3", long_text[:40]]}
    block_size = 16
    blocks = pack(examples, tokenizer, block_size=block_size, causal=True)
    assert len(blocks["input_ids"]) > 4
    bos = tokenizer.bos_token_id
    for ids, positions, labels in zip(blocks["input_ids"], blocks["position_ids"], blocks["labels"], strict=True):
        assert len(ids) == len(positions) == block_size and labels == ids
        assert max(positions) < block_size and positions[0] == 0
        for index in range(1, block_size):  # a restart exactly where a document begins, else one step on
            assert positions[index] == (0 if ids[index] == bos else positions[index - 1] + 1)


def test_a_packed_block_equals_its_pieces_alone(tokenizer):
    """End to end with learned positions (which crashed on positions past the table): every document piece of a
    packed block, continued from the previous block or not, gives the logits of the piece alone."""
    long_text = " ".join(["the cat sat on the mat"] * 10)
    blocks = pack({"text": [long_text, "1 + 2 = 3", long_text]}, tokenizer, block_size=24, causal=True)
    config = tiny_config("scaled_dot", "learned", vocab_size=len(tokenizer), max_position_embeddings=24)
    model = PlugformerForCausalLM(config).eval()
    for ids, positions in zip(blocks["input_ids"], blocks["position_ids"], strict=True):
        ids, positions = torch.tensor([ids]), torch.tensor([positions])
        with torch.no_grad():
            packed = model(ids, position_ids=positions).logits[0]
            starts = [i for i in range(ids.shape[1]) if positions[0, i] == 0] + [ids.shape[1]]
            for start, stop in itertools.pairwise(starts):
                alone = model(ids[:, start:stop]).logits[0]
                atol = model_tolerance(config, alone[None])  # packed against alone
                torch.testing.assert_close(packed[start:stop], alone, atol=atol, rtol=0)


def masked_lm(score: str, scheme: str, kernel: str, projection: str | None = None) -> PlugformerForMaskedLM:
    torch.manual_seed(0)
    config = copy.deepcopy(tiny_config(score, scheme, projection, is_causal=False, pad_token_id=0))
    config._attn_implementation = kernel
    return PlugformerForMaskedLM(config).eval()


@pytest.mark.parametrize(
    "score,scheme,kernel,projection",
    projection_combinations(kernels=("eager", "sdpa"), representative=True, is_causal=False),
)
def test_packed_documents_stay_apart_in_a_bidirectional_encoder(score, scheme, kernel, projection):
    """Masked-LM packing: a document sees neither the documents before it nor (bidirectional) those after it, with
    or without an all-ones mask; it used to attend to the whole block."""
    model = masked_lm(score, scheme, kernel, projection)
    ids, positions = packed_batch()
    assert_documents_equal_alone(model, model, ids, positions)
    ones = torch.ones_like(ids)
    assert_documents_equal_alone(model, model, ids, positions, attention_mask=ones)


def test_pack_gives_masked_lm_blocks_document_positions(tokenizer):
    """Masked-LM blocks carry the same restarting `position_ids` as causal ones (and no labels: the collator masks)."""
    examples = {"text": ["1 + 2 = 3", "the cat sat on the mat", "1 + 2 = 3"] * 3}
    causal = pack(examples, tokenizer, block_size=16, causal=True)
    bidirectional = pack(examples, tokenizer, block_size=16, causal=False)
    assert bidirectional["position_ids"] == causal["position_ids"] and "labels" not in bidirectional
    assert "position_ids" not in pack(examples, tokenizer, block_size=16, causal=False, document_positions=False)


def test_padding_free_position_ids_equal_separate_sequences():
    """Packed sequences with restarting `position_ids` and no mask (transformers' padding-free format) attend only
    within their own sequence, on every kernel each config supports (additive: eager)."""
    import copy

    from plugformer import POSITION_SCHEMES, PlugformerForCausalLM, supported_kernels

    first, second = torch.randint(3, 128, (2, 1, 5), generator=torch.Generator().manual_seed(0)).unbind(0)
    second = second[:, :4]
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    for score in SCORES:
        for scheme in POSITION_SCHEMES.names():
            config = tiny_config(score, scheme)
            for kernel in supported_kernels(config):
                if kernel == "flex_attention":  # compiled per shape: seconds each; covered by test_combinations
                    continue
                config = copy.deepcopy(config)
                config._attn_implementation = kernel
                torch.manual_seed(0)
                model = PlugformerForCausalLM(config).eval()
                with torch.no_grad():
                    packed = model(torch.cat([first, second], 1), position_ids=position_ids, use_cache=False).logits
                    atol = model_tolerance(config, packed)  # packed against alone
                    torch.testing.assert_close(packed[:, :5], model(first).logits, atol=atol, rtol=0)
                    torch.testing.assert_close(packed[:, 5:], model(second).logits, atol=atol, rtol=0)
