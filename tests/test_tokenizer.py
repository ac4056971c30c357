"""The offline byte-level BPE tokenizer."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from plugformer import train_tokenizer
from plugformer.data.corpus import arithmetic_sentences
from plugformer.data.tokenization import IM_END, generation_eos_token_ids


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(arithmetic_sentences(2000), vocab_size=400)


def test_vocabulary_size_and_special_tokens(tokenizer):
    assert len(tokenizer) == 400
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|endoftext|>")
    assert tokenizer.pad_token_id == 0 and tokenizer.mask_token == "<|mask|>"
    # BPE learned the corpus: a frequent word is one token, not its bytes
    assert len(tokenizer.tokenize(" plus")) == 1


@pytest.mark.parametrize("text", ["12 plus 7 is 19.", "naïve café – 東京 🚀\n\ttabs", ""])
def test_any_text_round_trips_exactly(tokenizer, text):
    """Byte-level: every byte is in the alphabet, so unseen characters encode without unknown tokens."""
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_reloads_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "The sum of 41 and 1 is 42. 東京"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.chat_template == tokenizer.chat_template
    assert reloaded.pad_token_id == tokenizer.pad_token_id


def test_chat_template_marks_assistant_tokens(tokenizer):
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    encoded = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    kept = [i for i, m in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(kept) == "4<|im_end|>"


def test_question_answer_template_writes_a_conversation_as_the_corpus_writes_a_problem(tokenizer):
    """The template `--chat_template question_answer` gives: each exchange a document of the question-answer corpus,
    its generation prompt the pretraining prompt (`data.sources.pretraining_prompt`) after `<|bos|>`, and the loss
    mask on the answer and its end of text (each string written out by hand)."""
    from plugformer.data.sources import pretraining_prompt
    from plugformer.data.tokenization import set_chat_template

    qa = set_chat_template(train_tokenizer(arithmetic_sentences(200), vocab_size=400), "question_answer")
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    assert qa.apply_chat_template(messages, tokenize=False) == "<|bos|>Question: 2 + 2?\nAnswer: 4<|endoftext|>"
    prompt = qa.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|>" + pretraining_prompt("2 + 2?") == "<|bos|>Question: 2 + 2?\nAnswer:"
    system = [{"role": "system", "content": "Be exact."}]
    two_turns = qa.apply_chat_template(system + messages + messages[:1], tokenize=False, add_generation_prompt=True)
    assert two_turns == "<|bos|>Be exact.\nQuestion: 2 + 2?\nAnswer: 4<|endoftext|><|bos|>Question: 2 + 2?\nAnswer:"
    encoded = qa.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    kept = [i for i, m in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if m]
    assert qa.decode(kept) == " 4<|endoftext|>"
    with pytest.raises(ValueError, match=re.escape("chat_template='vicuna': expected one of chatml | question_answer")):
        set_chat_template(qa, "vicuna")


def test_generation_stops_at_end_of_text_and_end_of_turn(tokenizer):
    assert generation_eos_token_ids(tokenizer) == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]


def test_too_small_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"vocab_size=100 must be an int >= 264"):
        train_tokenizer(["hello"], vocab_size=100)


def test_sentence_pairs_are_joined_by_the_separator(tokenizer, tmp_path):
    single = tokenizer("the food was good")["input_ids"]
    pair = tokenizer("the food was good", "it was bad")["input_ids"]
    assert pair[: len(single)] == single and pair[len(single)] == tokenizer.sep_token_id
    assert tokenizer.decode(pair) == "the food was good<|sep|>it was bad"
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)("a", "b")["input_ids"] == tokenizer("a", "b")["input_ids"]


def test_without_plugformer_the_tokenizer_beside_a_model_loads_as_a_stock_one_without_a_prompt(tokenizer, tmp_path):
    """In a process that never imports plugformer (stdin closed, as a script under a scheduler): the documented
    calls give transformers' own fast tokenizer and the same ids, and never ask whether to run the checkpoint's code
    (`AutoTokenizer` reads the model's config.json first, whose `auto_map` names that code)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import tiny_config

    from plugformer import PlugformerForCausalLM

    tokenizer.save_pretrained(tmp_path)
    PlugformerForCausalLM(tiny_config(vocab_size=len(tokenizer))).save_pretrained(tmp_path)
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
        f"folder = {str(tmp_path)!r}\n"
        "loaded = [PreTrainedTokenizerFast.from_pretrained(folder),\n"
        "          AutoTokenizer.from_pretrained(folder, trust_remote_code=False)]\n"
        "assert 'plugformer' not in sys.modules\n"
        "print(json.dumps([[type(t).__name__, t('1 + 2 = 3').input_ids] for t in loaded]))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "custom code" not in done.stdout + done.stderr
    expected = tokenizer("1 + 2 = 3").input_ids
    assert json.loads(done.stdout.splitlines()[-1]) == [["TokenizersBackend", expected]] * 2
