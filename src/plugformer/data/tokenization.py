"""An offline byte-level BPE tokenizer, trained locally with 🤗 tokenizers and reloadable with `AutoTokenizer`."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast


BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
MASK_TOKEN = "<|mask|>"
SEP_TOKEN = "<|sep|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, MASK_TOKEN, IM_START, IM_END, SEP_TOKEN]

# ChatML. Each assistant turn ends with <|im_end|> (an end-of-generation token, see `generation_eos_token_ids`);
# `{% generation %}` marks what TRL's `assistant_only_loss` trains on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A conversation written as a document of a question-answer corpus: `<|bos|>Question: {user}\nAnswer: {assistant}`
# and `<|endoftext|>`, each exchange a new document (a system message opens the first). A model pretrained on such
# documents answers through it as it learnt to, where ChatML is a format it first meets in SFT.
QUESTION_ANSWER_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ 'Answer:' }}{% generation %}{{ ' ' + message['content'] + '<|endoftext|>' }}{% endgeneration %}"
    "{% elif message['role'] == 'user' %}"
    "{% if loop.first or loop.previtem['role'] != 'system' %}{{ '<|bos|>' }}{% endif %}"
    "{{ 'Question: ' + message['content'] + '\n' }}"
    "{% else %}"
    "{{ '<|bos|>' + message['content'] + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}"
)

# `--chat_template` of the pretrain stage: the template its new tokenizer carries to every later stage
CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "question_answer": QUESTION_ANSWER_TEMPLATE}


def set_chat_template(tokenizer: PreTrainedTokenizerFast, name: str) -> PreTrainedTokenizerFast:
    """Gives `tokenizer` the chat template `name` (a key of `CHAT_TEMPLATES`) and returns it."""
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template={name!r}: expected one of {' | '.join(CHAT_TEMPLATES)}")
    tokenizer.chat_template = CHAT_TEMPLATES[name]
    return tokenizer


class PlugformerTokenizer(PreTrainedTokenizerFast):
    """transformers' fast tokenizer, except that decoding refuses ids it does not have.

    The `tokenizers` backend drops unknown ids silently (`decode([10**6]) == ""`, `convert_ids_to_tokens` gives
    `None`) and overflows on negative ones (`OverflowError`); generated ids past the vocabulary (a model whose
    `vocab_size` exceeds `len(tokenizer)`) would vanish from the text. Saved, it is an ordinary fast tokenizer: its
    files name this class, and `AutoTokenizer` falls back to `TokenizersBackend` wherever the class is not known.
    """

    def _check_ids(self, token_ids) -> None:
        with contextlib.suppress(TypeError):  # one id (an int, a numpy or 0-d tensor integer) rather than a sequence
            token_ids = [operator.index(token_ids)]
        size = len(self)
        for token_id in token_ids:
            try:
                token_id = operator.index(token_id)
            except TypeError:
                raise TypeError(f"token_ids must be integers, got {token_id!r}") from None
            if not 0 <= token_id < size:
                raise ValueError(
                    f"token_ids contains {token_id}, which this tokenizer does not have (ids 0 to {size - 1})"
                )

    def _decode(self, token_ids, *args, **kwargs) -> str:
        self._check_ids(token_ids["input_ids"] if isinstance(token_ids, dict) else token_ids)
        return super()._decode(token_ids, *args, **kwargs)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        self._check_ids(ids)
        return super().convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    min_frequency: int = 2,
    model_max_length: int = 2048,
    split_digits: bool = False,
    show_progress: bool = False,
) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer on `texts`, with no network access.

    Every byte is in the base alphabet, so any text encodes (no unknown tokens) and decodes back exactly.

    Args:
        texts (`Iterable[str]`): Training corpus.
        vocab_size (`int`, *optional*, defaults to 8192): Target size including the 256 bytes and the specials.
        min_frequency (`int`, *optional*, defaults to 2): Minimum count for a merge.
        model_max_length (`int`, *optional*, defaults to 2048): Recorded for truncation by pipelines / trainers.
        split_digits (`bool`, *optional*, defaults to `False`): Keep every digit a token of its own (as Llama
            does), so numbers are read digit by digit instead of as arbitrary merged chunks — arithmetic needs it.
        show_progress (`bool`, *optional*, defaults to `False`): Show the trainer's progress bars (word counting,
            merges) on the terminal: worth it for a real corpus, noise for the embedded one.

    Returns:
        [`PlugformerTokenizer`] (a `PreTrainedTokenizerFast`): pad `<|pad|>`, bos `<|bos|>`, eos `<|endoftext|>`,
        mask `<|mask|>`, sep `<|sep|>` between the texts of a pair, a ChatML chat template; `save_pretrained(dir)`
        then `AutoTokenizer.from_pretrained(dir)` reproduces it.
    """
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size!r} must be an int >= {minimum} (256 bytes + {len(SPECIAL_TOKENS)} specials)"
        )
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # A sentence pair (premise, hypothesis) is encoded as `a <|sep|> b`; single texts are left as they are.
    separator = (SEP_TOKEN, tokenizer.token_to_id(SEP_TOKEN))
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="$A", pair=f"$A {SEP_TOKEN} $B:1", special_tokens=[separator]),
        ]
    )
    wrapped = PlugformerTokenizer(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        mask_token=MASK_TOKEN,
        sep_token=SEP_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def generation_eos_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Token ids that end a generation: end of text and end of a chat turn (put them in
    `generation_config.eos_token_id`, or chat completions never stop)."""
    return [tokenizer.convert_tokens_to_ids(token) for token in (EOS_TOKEN, IM_END)]


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved in `path`, which must have a pad token (every stage batches padded rows)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        raise ValueError(f"the tokenizer in {path} has no pad token; set one before training")
    return tokenizer
