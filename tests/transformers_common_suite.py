"""plugformer's heads under transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`).

Not collected by the default suite: `tests/run_transformers_common_tests.py` copies this file beside transformers'
test files (taken at run time from a transformers source, never committed here) and runs it there. One test class
per head (causal, encoder, seq2seq) and per score × scheme configuration (`CONFIGS`).

Skips are stated the way transformers' own models state theirs: a class attribute of the mixin where one exists
(`test_resize_position_embeddings`, `test_torch_exportable`, ...), else an override that skips with the reason.
"""

import copy
import inspect
import os
import unittest

import torch
import transformers
from transformers.cache_utils import StaticCache
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

import plugformer
from plugformer import (
    ATTENTION_SCORES,
    POSITION_SCHEMES,
    PlugformerConfig,
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
    PlugformerForMaskedLM,
    PlugformerForSequenceClassification,
    PlugformerForTokenClassification,
    PlugformerModel,
)

from .generation.test_utils import GenerationTesterMixin
from .test_configuration_common import ConfigTester
from .test_modeling_common import ModelTesterMixin, ids_tensor


# transformers' tests classify classes by name through these tables; plugformer registers its classes with the Auto
# classes, which keep their own (extra) mapping: sync the names so that the tests see a causal LM as one.
for table, cls in [
    (MODEL_MAPPING_NAMES, PlugformerModel),
    (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, PlugformerForCausalLM),
    (MODEL_FOR_MASKED_LM_MAPPING_NAMES, PlugformerForMaskedLM),
    (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, PlugformerForConditionalGeneration),
    (MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, PlugformerForSequenceClassification),
    (MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, PlugformerForTokenClassification),
]:
    table["plugformer"] = cls.__name__


# score × scheme configurations: by default one per family of each axis (RoPE, a score bias, learned absolute, none;
# dot products and the additive score); PLUGFORMER_COMMON_CONFIGS="score:scheme,..." or "all" (the whole grid)
DEFAULT_CONFIGS = "scaled_dot:rope,additive:alibi,dot:t5_bias,multiplicative:learned"


def configurations() -> list[tuple[str, str]]:
    chosen = os.environ.get("PLUGFORMER_COMMON_CONFIGS", DEFAULT_CONFIGS)
    if chosen == "all":
        return [(score, scheme) for score in ATTENTION_SCORES.names() for scheme in POSITION_SCHEMES.names()]
    return [tuple(pair.split(":")) for pair in chosen.split(",")]


class PlugformerModelTester:
    """Tiny configs and inputs in transformers' tester shape (the attributes `ModelTesterMixin` reads)."""

    def __init__(self, parent, score: str, scheme: str, kind: str):
        self.parent, self.score, self.scheme, self.kind = parent, score, scheme, kind
        self.batch_size, self.seq_length, self.vocab_size = 3, 7, 99
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 32, 2, 4
        self.is_training, self.num_labels, self.num_choices = True, 3, 4
        self.encoder_seq_length = self.decoder_seq_length = self.seq_length

    def get_config(self) -> PlugformerConfig:
        return PlugformerConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=37,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attention_score=self.score,
            position_scheme=self.scheme,
            is_causal=self.kind == "causal",
            is_encoder_decoder=self.kind == "seq2seq",
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            max_relative_distance=8,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=0,
            num_labels=self.num_labels,
        )

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3
        mask = torch.ones_like(input_ids)
        mask[0, :2] = 0  # left padding in one row
        inputs = {"input_ids": input_ids, "attention_mask": mask}
        if self.kind == "seq2seq":
            inputs["decoder_input_ids"] = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3
            inputs["decoder_attention_mask"] = torch.ones_like(inputs["decoder_input_ids"])
        return config, inputs


# test-name fragment -> (text in the generation mixin's source, whether the installed transformers has it): the mixin
# file may come from another transformers version than the installed one (no source holds 5.24's tests/generation/),
# and these tests then call an API the installed version lacks (checked: with the call ported to 5.24's name they pass)
MIXIN_API = {
    "assisted_decoding": ('"dynamic_full"', lambda: "dynamic_full" in ALL_CACHE_IMPLEMENTATIONS),
    "generate_compilation_all_outputs": ("get_max_cache_shape()", lambda: hasattr(StaticCache, "get_max_cache_shape")),
}


class PlugformerCommonTests(ModelTesterMixin):
    """The mixin with plugformer's stated skips; subclasses set `score`, `scheme`, `kind`, `all_model_classes`."""

    score = scheme = kind = None
    test_resize_position_embeddings = False  # as Llama: positions are not an embedding to resize
    test_torch_exportable = False  # torch.export: tests/test_export.py covers plugformer's own export route
    test_all_params_have_gradient = False  # e.g. a learned bias's far buckets get no gradient from 7 tokens

    def setUp(self):
        self.model_tester = PlugformerModelTester(self, self.score, self.scheme, self.kind)
        self.config_tester = ConfigTester(self, config_class=PlugformerConfig, hidden_size=32, num_attention_heads=4)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_reverse_loading_mapping(self):
        # plugformer's conversions (`legacy_weights`) reshape FIRE's two scalars and rename nothing, so its keys stay
        # as they were (transformers' models whose conversions only transpose pass the same flag)
        if not hasattr(ModelTesterMixin, "test_reverse_loading_mapping"):
            self.skipTest(f"transformers {transformers.__version__}'s mixin has no test_reverse_loading_mapping")
        if self.scheme != "fire":
            self.skipTest(
                f"position_scheme={self.scheme!r} has none of the parameters plugformer's conversions "
                "reshape (FIRE's `positions.distance_scale`, `positions.threshold_scale`)"
            )
        super().test_reverse_loading_mapping(check_keys_were_modified=False)

    def _rope_only(self):
        if "rope_parameters" not in POSITION_SCHEMES.get(self.scheme).config_fields:
            self.skipTest(f"position_scheme={self.scheme!r} has no RoPE: rope_parameters are refused there")

    def _not_seq2seq(self):
        if self.kind == "seq2seq":
            self.skipTest(
                "T5's layout: PlugformerForConditionalGeneration holds `encoder` and `decoder` beside "
                "`lm_head` and is its own base model (see PlugformerSeq2SeqModel), so no child is the base"
            )

    def _dot_product_only(self):
        if not ATTENTION_SCORES.get(self.score).dot_product:
            self.skipTest(
                f"attention_score={self.score!r} is not a dot product: no sdpa/flex kernel computes it "
                "(the model refuses them and runs eager)"
            )

    def _mixin_api_installed(self):
        source = inspect.getsource(GenerationTesterMixin)
        for fragment, (text, present) in MIXIN_API.items():
            if fragment in self._testMethodName and text in source and not present():
                self.skipTest(
                    f"the generation mixin's file is from another transformers version: it uses {text}, "
                    f"which transformers {transformers.__version__} lacks"
                )


# test-name fragment -> the guard that skips it, with its reason, where the configuration lacks what it tests: the
# class flags transformers' models set (`_supports_sdpa = False`, no `rope_parameters` field) cannot say it, as the
# support depends on the config's score and scheme, not on the class.
GUARDS = {"rope_scaling": "_rope_only", "sdpa": "_dot_product_only", "flex": "_dot_product_only",
          "base_model_prefix": "_not_seq2seq", **dict.fromkeys(MIXIN_API, "_mixin_api_installed")}  # fmt: skip


def _stated_skips(cls):
    for name in dir(cls):
        original = getattr(cls, name)
        guards = [guard for fragment, guard in GUARDS.items() if fragment in name]
        if not name.startswith("test_") or not callable(original) or not guards:
            continue

        def wrapped(self, *args, _original=original, _guards=tuple(guards), **kwargs):
            for guard in _guards:
                getattr(self, guard)()
            return _original(self, *args, **kwargs)

        wrapped.__name__, wrapped.__qualname__ = name, original.__qualname__  # --mixin selects by the defining class
        setattr(cls, name, wrapped)
    return cls


HEADS = {
    "causal": (
        PlugformerModel,
        PlugformerForCausalLM,
        PlugformerForSequenceClassification,
        PlugformerForTokenClassification,
    ),
    "encoder": (PlugformerForMaskedLM,),
    "seq2seq": (PlugformerForConditionalGeneration,),
}

for _kind, _classes in HEADS.items():
    for _score, _scheme in configurations():
        _name = f"Test_{_kind}_{_score}_{_scheme}"
        attributes = dict(
            score=_score, scheme=_scheme, kind=_kind, all_model_classes=_classes, is_encoder_decoder=_kind == "seq2seq"
        )
        # the generation tests for the heads that generate (the mixin checks that only those inherit it)
        mixins = (GenerationTesterMixin,) if any(cls.can_generate() for cls in _classes) else ()
        globals()[_name] = _stated_skips(
            type(_name, (PlugformerCommonTests, *mixins, unittest.TestCase), copy.deepcopy(attributes))
        )

assert plugformer  # registers the Auto classes
