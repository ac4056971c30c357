"""The kernel table: each kernel's record says what it computes, and a kernel is refused for what it does not declare
— registered kernels, kernels registered with transformers behind plugformer's back, and names set on a config by
an engine (vLLM sets its own) alike. Before the table, a kernel registered with `AttentionInterface.register` ran
additive scoring and bias schemes with the score and the bias silently dropped (max |Δlogit| 2.4 to 5.8)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from conftest import SCHEMES, SCORES, build, tiny_config
from tolerances import model_tolerance
from transformers import AutoModelForCausalLM, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

import plugformer
from plugformer import KERNELS, combination_matrix, register_attention_kernel, supported_kernels
from plugformer.biases import BIAS_KINDS
from plugformer.capabilities import KernelSpec
from plugformer.positions import POSITION_SCHEMES
from plugformer.scores import ATTENTION_SCORES


def dot_product(score: str) -> bool:
    return ATTENTION_SCORES.get(score).dot_product


def biased(scheme: str) -> bool:
    return POSITION_SCHEMES.get(scheme).has_bias


def plain_dot_product(score: str) -> bool:
    """A dot product whose values are as wide as its queries and keys: what every kernel in transformers' interface
    computes."""
    return dot_product(score) and ATTENTION_SCORES.get(score).value_width == 1


@pytest.fixture
def kernel_name(request):
    """A fresh kernel name, removed from both plugformer's and transformers' tables afterwards."""
    name = f"test_kernel_{request.node.name.split('[')[0][-20:]}_{id(request)}"
    yield name
    KERNELS._table.pop(name, None)
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


def saved(tmp_path, score: str, scheme: str):
    model = build(tiny_config(score, scheme))
    model.save_pretrained(tmp_path)
    return model


def test_the_table_lists_what_each_kernel_computes():
    assert {"eager", "sdpa", "flex_attention", "flash_attention_2"} <= set(KERNELS)
    assert KERNELS.get("eager").scores == "any" and KERNELS.get("eager").attention_weights
    for name in ("sdpa", "flex_attention"):
        assert (KERNELS.get(name).scores, KERNELS.get(name).bias) == ("dot_product", "relative")
    assert KERNELS.get("flash_attention_3").bias == "none"
    assert KERNELS.taking_wide_values() == ["eager", "sdpa", "flex_attention"]
    # a name without a record: what every function in transformers' interface computes, no more
    assert (KERNELS.get("vllm").scores, KERNELS.get("vllm").bias) == ("dot_product", "none")
    assert not KERNELS.get("vllm").wide_values


def test_the_combination_matrix_is_read_from_the_records():
    rows = {(score, scheme): kernels for score, scheme, kernels in combination_matrix()}
    assert len(rows) == len(SCORES) * len(SCHEMES)
    for (score, scheme), kernels in rows.items():
        kind = POSITION_SCHEMES.get(scheme).bias_type.kind  # a scheme's bias object: per distance, per query position
        expected = [
            name
            for name in KERNELS
            if (KERNELS.get(name).scores == "any" or dot_product(score))
            and (KERNELS.get(name).wide_values or ATTENTION_SCORES.get(score).value_width == 1)
            and (
                KERNELS.get(name).bias == "dense"
                or (
                    KERNELS.get(name).bias == "relative"
                    and (not biased(scheme) or kind in KERNELS.get(name).bias_kinds)
                )
                or (KERNELS.get(name).bias == "none" and not biased(scheme))
                or (KERNELS.get(name).bias == "alibi" and scheme == "alibi")
            )
        ]
        assert kernels == expected, (score, scheme)
    # on this machine (no CUDA) no flash kernel runs: the suite's kernels are the available ones
    if not torch.cuda.is_available():
        assert not any(k.startswith("flash") for k in supported_kernels(tiny_config("dot", "none")))


def test_records_refuse_unknown_capabilities_and_duplicates():
    with pytest.raises(ValueError, match="scores='bilinear' is not one of"):
        KernelSpec("x", scores="bilinear", bias="none")
    with pytest.raises(ValueError, match="bias='per_query' is not one of"):
        KernelSpec("x", scores="any", bias="per_query")
    with pytest.raises(ValueError, match=re.escape(f"bias_kinds=('per_head',) must be a tuple of {list(BIAS_KINDS)}")):
        KernelSpec("x", scores="any", bias="relative", bias_kinds=("per_head",))
    with pytest.raises(ValueError, match="'sdpa' is already registered"):
        KERNELS.register(KernelSpec("sdpa", scores="dot_product", bias="none"))


FOREIGN_REFUSED = [
    (score, scheme) for score in SCORES for scheme in SCHEMES if not plain_dot_product(score) or biased(scheme)
]


@pytest.mark.parametrize("score,scheme", [("additive", "none"), ("dot", "alibi"), ("additive", "t5_bias"),
                                          ("multiplicative", "clamped_bias")])  # fmt: skip
def test_a_kernel_registered_only_with_transformers_is_refused_where_it_would_drop_something(
    score, scheme, kernel_name, tmp_path
):
    assert (score, scheme) in FOREIGN_REFUSED
    AttentionInterface.register(kernel_name, sdpa_attention_forward)  # computes softmax(s·q·k + mask) v, no more
    saved(tmp_path, score, scheme)
    with pytest.raises(ValueError, match=f"attn_implementation='{kernel_name}'"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=kernel_name)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    with pytest.raises(ValueError, match=f"attn_implementation='{kernel_name}'"):
        model.set_attn_implementation(kernel_name)
    # an engine setting the name on the config by hand (as vLLM's transformers backend does) meets the same refusal
    model.config._attn_implementation = kernel_name
    with pytest.raises(ValueError, match=f"attn_implementation='{kernel_name}'"):
        model(torch.tensor([[5, 6, 7]]))


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if not biased(s)])
def test_a_kernel_registered_only_with_transformers_runs_what_it_can_compute(scheme, kernel_name, tmp_path):
    calls = []

    def counting_sdpa(*args, **kwargs):
        calls.append(kwargs.get("position_bias"))
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register(kernel_name, counting_sdpa)
    reference = saved(tmp_path, "scaled_dot", scheme)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=kernel_name).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        expected = reference(ids).logits  # the registered kernel against eager: `model_tolerance`
        torch.testing.assert_close(model(ids).logits, expected, atol=model_tolerance(model.config, expected), rtol=0)
    assert calls and all(bias is None for bias in calls)


def test_a_registered_kernel_declaring_a_dense_bias_gets_one_and_matches_eager(kernel_name, tmp_path):
    shapes = []

    def dense_bias_sdpa(module, query, key, value, attention_mask, position_bias=None, **kwargs):
        shapes.append(tuple(position_bias.shape))
        return sdpa_attention_forward(module, query, key, value, attention_mask, position_bias=position_bias, **kwargs)

    register_attention_kernel(kernel_name, dense_bias_sdpa, bias="dense")
    reference = saved(tmp_path, "multiplicative", "t5_bias")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=kernel_name).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        got, expected = model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
    real = mask.bool()  # a padding query attends to nothing: its output is the kernel's own choice
    torch.testing.assert_close(got[real], expected[real], atol=model_tolerance(model.config, expected), rtol=0)
    heads = reference.config.num_attention_heads
    assert shapes and all(shape == (2, heads, 6, 6) for shape in shapes)
    # what it did not declare is still refused: a score that is not a dot product
    saved(tmp_path / "additive", "additive", "t5_bias")
    with pytest.raises(ValueError, match="is not a dot product"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "additive", attn_implementation=kernel_name)


def test_register_attention_kernel_reaches_transformers_and_checks_its_record(kernel_name):
    spec = register_attention_kernel(kernel_name, sdpa_attention_forward, scores="dot_product", bias="none")
    assert KERNELS.get(kernel_name) is spec and kernel_name in AttentionInterface._global_mapping
    assert kernel_name in AttentionMaskInterface._global_mapping  # else transformers would build it no mask
    assert kernel_name in supported_kernels(tiny_config("dot", "rope"))
    assert kernel_name not in supported_kernels(tiny_config("dot", "alibi"))
    with pytest.raises(ValueError, match="already registered"):
        register_attention_kernel(kernel_name, sdpa_attention_forward)


def test_a_kernel_adding_alibi_itself_computes_alibi_only_and_gets_no_bias(kernel_name, tmp_path):
    """`bias="alibi"` (vLLM's attention built with ALiBi slopes, `plugformer.integrations.vllm_plugin`): the kernel adds ALiBi
    from its own slopes, so it gets no `position_bias`, and every other scheme is refused — T5/clamped biases it
    cannot add, and schemes without a bias, which it would change."""
    spec = KernelSpec(kernel_name, scores="dot_product", bias="alibi")
    for score in SCORES:
        for scheme in SCHEMES:
            reason = spec.unsupported_reason(tiny_config(score, scheme))
            assert (reason is None) == (plain_dot_product(score) and scheme == "alibi"), (score, scheme, reason)
            if scheme != "alibi" and plain_dot_product(score):
                assert f"position_scheme={scheme!r}" in reason
    received = []

    def alibi_sdpa(module, query, key, value, attention_mask, position_bias=None, **kwargs):
        """ALiBi from plugformer's slopes added here, as an engine holding the slopes does."""
        received.append(position_bias)
        slopes = plugformer.positions.alibi_slopes(query.shape[1])
        distance = torch.arange(key.shape[2])[None, :] - torch.arange(query.shape[2])[:, None]  # j - i (causal)
        bias = slopes[:, None, None] * distance  # (H, Q, K): -slope * |i - j| where j <= i
        causal = distance <= 0
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            (bias + torch.where(causal, 0.0, -torch.inf))[None],
            is_causal=False,
            **{k: v for k, v in kwargs.items() if k != "is_causal"},
        )

    register_attention_kernel(kernel_name, alibi_sdpa, bias="alibi", mask=None)
    assert kernel_name not in KERNELS.taking_a_bias()  # never suggested for T5 or clamped biases
    reference = saved(tmp_path, "scaled_dot", "alibi")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=kernel_name).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, expected, atol=model_tolerance(model.config, expected), rtol=0)
    assert received and all(bias is None for bias in received)
    saved(tmp_path / "rope", "scaled_dot", "rope")
    with pytest.raises(ValueError, match=rf"attn_implementation='{kernel_name}' adds ALiBi.*position_scheme='rope'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "rope", attn_implementation=kernel_name)


def test_the_vllm_plugin_entry_point_names_its_register_hook():
    """pyproject declares plugformer's vLLM plugin; its module imports without vLLM (vLLM is optional)."""
    import importlib
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["plugformer"]
    module, _, name = target.partition(":")
    assert (module, name) == ("plugformer.integrations.vllm_plugin", "register")
    assert callable(getattr(importlib.import_module(module), name))
    assert not any(dependency.startswith("vllm") for dependency in project["dependencies"])


def test_a_kernel_that_masks_by_itself_is_refused_a_sliding_window():
    """vLLM's attention (no record) and a kernel registered with `mask=None` never see plugformer's mask, where the
    window lives: they must refuse `sliding_window`, not attend to every key."""
    from plugformer.capabilities import unsupported_reason

    windowed = plugformer.PlugformerConfig.from_preset("tiny", sliding_window=3)
    assert "sliding_window=3" in unsupported_reason(windowed, "vllm")
    assert unsupported_reason(plugformer.PlugformerConfig.from_preset("tiny"), "vllm") is None
    for kernel in ("eager", "sdpa", "flex_attention"):
        assert unsupported_reason(windowed, kernel) is None
    register_attention_kernel("self_masking_test", lambda *args, **kwargs: None, mask=None)
    try:
        assert "sliding_window=3" in unsupported_reason(windowed, "self_masking_test")
        assert "self_masking_test" not in KERNELS.windowing()
    finally:
        KERNELS._table.pop("self_masking_test")


def test_vllm_plugin_lets_a_causal_window_through_by_layer_types():
    """vLLM's Transformers backend windows the layers `config.layer_types` marks sliding (a window of
    `sliding_window` keys, the query's included): with the plugin's record of its kernel, a causal window is computed;
    an encoder's (bidirectional) window is still refused."""
    from plugformer.capabilities import unsupported_reason
    from plugformer.integrations import vllm_plugin

    assert "vllm" not in KERNELS
    vllm_plugin.register_vllm_kernel()
    try:
        mixed = plugformer.PlugformerConfig.from_preset(
            "tiny", sliding_window=3, layer_types=["sliding_attention", "full_attention"]
        )
        assert unsupported_reason(mixed, "vllm") is None
        assert unsupported_reason(plugformer.PlugformerConfig.from_preset("tiny", sliding_window=3), "vllm") is None
        encoder = plugformer.PlugformerConfig.from_preset("tiny", sliding_window=3, is_causal=False)
        assert "sliding_window=3" in unsupported_reason(encoder, "vllm")
        assert "vllm" not in supported_kernels(mixed)  # runs only inside vLLM's engine
    finally:
        KERNELS._table.pop("vllm")


def test_vllm_plugin_record_refuses_latent_attention_and_takes_gates_and_value_residuals():
    """vLLM sizes its KV cache for `num_key_value_heads` heads of `head_dim`: the plugin's record of its kernel refuses
    multi-head latent attention (even with values as wide as its keys), naming the field, and lets gated attention and
    value residuals through (they run in plugformer's modules around vLLM's attention; tests/test_vllm.py)."""
    from plugformer.capabilities import unsupported_reason
    from plugformer.integrations import vllm_plugin

    assert "vllm" not in KERNELS
    vllm_plugin.register_vllm_kernel()
    try:
        latent = plugformer.PlugformerConfig.from_preset("tiny", attention_projection="latent", v_head_dim=12)
        assert latent.v_head_dim == latent.qk_nope_head_dim + latent.qk_rope_head_dim  # the widths agree
        assert "attention_projection='latent'" in unsupported_reason(latent, "vllm")
        for fields in ({"use_gated_attention": True}, {"value_residual": "fixed"}, {"value_residual": "learned"}):
            assert unsupported_reason(plugformer.PlugformerConfig.from_preset("tiny", **fields), "vllm") is None
    finally:
        KERNELS._table.pop("vllm")


def test_a_score_with_wide_values_runs_only_on_kernels_declaring_them(kernel_name, monkeypatch):
    """A score whose `prepare_value` widens the values (`value_width` 2, as differential attention's) is refused, naming
    the field, by every kernel whose record does not declare `wide_values`: flash-attn's, one registered without it,
    an engine's without a record."""
    from plugformer.capabilities import unsupported_reason

    monkeypatch.setattr(ATTENTION_SCORES.get("scaled_dot"), "value_width", 2)
    config = tiny_config("scaled_dot", "rope")
    register_attention_kernel(kernel_name, sdpa_attention_forward)
    for kernel in ("flash_attention_2", kernel_name, "vllm"):
        reason = unsupported_reason(config, kernel)
        assert "attention_score='scaled_dot'" in reason and "2·head_dim wide" in reason, (kernel, reason)
        assert "['eager', 'sdpa', 'flex_attention']" in reason
    assert supported_kernels(config) == ["eager", "sdpa", "flex_attention"]


# --- the kernel table owns its rules ------------------------------------------------------------------------------

PACKAGE = Path(plugformer.__file__).parent
# The kernel table: the records (capabilities.py) and the kernel functions they name.
KERNEL_TABLE_MODULES = {"capabilities.py", "kernels.py", "kernels_sdpa.py", "kernels_sinks.py", "kernels_banded.py",
                        "kernels_fixed.py"}  # fmt: skip
# (module, string) pairs that match a name by coincidence: `plugformer plot sinusoidal` is a command named after the
# encoding it draws, not a config's position scheme; `plugformer bench --attention_modifiers none` asks for no modifier
# rows, not for a position scheme.
COINCIDENCES = {("evaluation/plots.py", "sinusoidal"), ("bench/arguments.py", "none")}


def constant_strings(node: ast.AST) -> list[str]:
    """The string literals of a comparison operand, including those of a literal tuple, list or set (`x in (...)`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [value for element in node.elts for value in constant_strings(element)]
    return []


def name_comparisons(source: str, names: set[str]) -> list[tuple[int, str, str]]:
    """(line, name, code) of each comparison (`==`, `!=`, `in`, a `match` case) of a string literal in `names`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            continue
        found += [
            (node.lineno, value, ast.unparse(node))
            for operand in operands
            for value in constant_strings(operand)
            if value in names
        ]
    return found


def test_no_module_outside_the_kernel_table_compares_kernel_or_scheme_names():
    """A kernel's rules live in its record and a scheme's in its class: every other module asks them (`KERNELS.of`,
    `KernelSpec.position_bias`, `PositionScheme.linear_bias_slopes`), never tests a name."""
    from plugformer.integrations.vllm_plugin import ALIBI_KERNEL

    names = set(KERNELS) | set(POSITION_SCHEMES) | {ALIBI_KERNEL}
    assert name_comparisons('if config.position_scheme == "alibi":\n    pass', names)  # the scan sees one
    assert name_comparisons('match kernel:\n    case "sdpa":\n        pass', names)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module in KERNEL_TABLE_MODULES:
            continue
        found += [
            f"{module}:{line}: {code}"
            for line, name, code in name_comparisons(path.read_text("utf-8"), names)
            if (module, name) not in COINCIDENCES
        ]
    assert not found, "compare a record's or a scheme class's property instead:\n" + "\n".join(found)


def test_the_kernel_table_is_the_one_reader_of_attn_implementation():
    """`KERNELS.of(config)` reads `config._attn_implementation`; other modules may set it (transformers' way for an
    engine), not read it."""
    readers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "_attn_implementation":
                readers |= {module} if isinstance(node.ctx, ast.Load) else set()
    assert readers == {"capabilities.py"}


def test_a_kernel_declaring_cache_and_padding_limits_is_refused_them(kernel_name):
    """`static_cache=False` / `padding=False` in a record refuse a static cache / a padded batch at the forward,
    naming the field, for that kernel only (flex's record declares the first)."""
    register_attention_kernel(kernel_name, sdpa_attention_forward, static_cache=False, padding=False)
    model = build(tiny_config("scaled_dot", "rope"), kernel_name)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with pytest.raises(
        ValueError,
        match=rf"attn_implementation='{kernel_name}' cannot decode with a StaticCache "
        r"\(its record says static_cache=False",
    ):
        model(ids, cache=StaticCache(config=model.config, max_cache_len=8), use_cache=True)
    with pytest.raises(ValueError, match=rf"'{kernel_name}' with padding .* padding=False\); use one of \['eager'"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with torch.no_grad():  # no padding, a dynamic cache: computed
        expected = build(tiny_config("scaled_dot", "rope"))(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, atol=model_tolerance(model.config, expected), rtol=0)
    static = KERNELS.decoding_with_static_caches()
    assert kernel_name not in static and "flex_attention" not in static and "sdpa" in static


def test_the_alibi_kernel_computes_the_schemes_that_give_linear_slopes():
    """`bias="alibi"` reads ALiBi-ness off the scheme class (`linear_bias_slopes`), not its name."""
    config = tiny_config("scaled_dot", "alibi")
    for scheme in SCHEMES:
        slopes = POSITION_SCHEMES.get(scheme).linear_bias_slopes(config)
        assert (slopes is not None) == (scheme == "alibi"), scheme
    torch.testing.assert_close(
        POSITION_SCHEMES.get("alibi").linear_bias_slopes(config), plugformer.positions.alibi_slopes(4)
    )


def test_the_readme_example_kernel_runs_as_printed(monkeypatch):
    """'Adding a kernel' as printed: the kernel registers (in this test only), matches eager on a T5 bias it gets
    dense, and its record refuses a score that is not a dot product. Fails until README.md has the section."""
    from test_project import readme_code

    monkeypatch.setattr(KERNELS, "_table", dict(KERNELS._table))  # restored after the test
    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(AttentionMaskInterface, "_global_mapping", dict(AttentionMaskInterface._global_mapping))
    (code,) = readme_code("Adding a kernel")
    before = set(KERNELS)
    exec(compile(code, "README.md (Adding a kernel)", "exec"), {})
    (name,) = set(KERNELS) - before
    assert name in supported_kernels(tiny_config("scaled_dot", "t5_bias"))
    assert "is not a dot product" in KERNELS.get(name).unsupported_reason(tiny_config("additive", "rope"))
