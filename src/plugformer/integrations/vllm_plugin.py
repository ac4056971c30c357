"""plugformer's causal LM in vLLM, ALiBi included: a vLLM general plugin (entry point `vllm.general_plugins`).

vLLM loads `register` in each of its processes. It registers the architecture `PlugformerForCausalLM` with vLLM's
`ModelRegistry` as `PlugformerForCausalLMvLLM`: vLLM's Transformers-backend causal LM (plugformer's own modules,
vLLM's linear layers, KV cache and attention) with two differences.

- **ALiBi runs natively.** For a position scheme whose bias is ALiBi's linear one (its class answers
  `linear_bias_slopes`: `position_scheme="alibi"`) each layer's vLLM `Attention` is built with `alibi_slopes` from
  that answer, and plugformer's attention dispatches to the kernel `vllm_alibi` (kernel table: a dot product whose
  engine adds ALiBi itself, nothing else). vLLM's attention adds `slope_h · (j − i)` for key j ≤ query i, which is
  plugformer's `−slope_h · |i − j|` of a causal model.
  Built without slopes (another attention backend, say) it raises instead of attending without the bias.
- **The training process's classes stay untouched.** vLLM's backend decorates the decoder class it builds for
  `torch.compile` in place (new bases, `__init__` and `__call__`); in a trainer that runs vLLM in its own process
  (TRL's `vllm_mode="colocate"`) the policy already built from `PlugformerModel` then fails on its next forward
  (`'PlugformerModel' object has no attribute 'do_not_compile'`). Here vLLM builds, and decorates, a private
  subclass.

- **Sliding windows run natively.** vLLM's backend gives each layer that `config.layer_types` marks
  `"sliding_attention"` a window of `sliding_window` keys, the query's included (transformers' and plugformer's
  causal window); the record of its kernel `vllm` says so, and the kernel table lets a causal `sliding_window` through.

Everything else is as in vLLM's Transformers backend, and what it cannot compute stays refused by plugformer's
kernel table when the model is built (`ValueError` naming the variant): T5 and clamped biases (kernel `vllm`:
no bias), additive scoring (not a dot product) and `attention_projection="latent"` (vLLM sizes its KV cache for
`num_key_value_heads` heads of `head_dim`). Gated attention and value residuals run in plugformer's own modules
around vLLM's attention: greedy tokens equal transformers' (`tests/test_vllm.py`). Tensor parallelism with ALiBi is refused (each rank would need
its heads' slopes; not verified here). `"linear_attention"` layers (Gated DeltaNet) are refused: vLLM's Transformers
backend keeps no recurrent state for them (`refuse_unsupported_layers`).

Without the plugin installed (`pip install -e .` declares the entry point), `register()` can be called by hand in
the process that builds vLLM's engine.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from ..capabilities import KERNELS, KernelSpec, register_attention_kernel
from ..configuration import PlugformerConfig
from ..positions import POSITION_SCHEMES


ARCHITECTURE = "PlugformerForCausalLM"
ALIBI_KERNEL = "vllm_alibi"
VLLM_KERNEL = "vllm"  # vLLM's own implementation in its Transformers backend (its `VLLM_ATTN_IMPL`)


def register() -> None:
    """vLLM's plugin hook: the architecture (lazily, by name, as vLLM asks of plugins) and the ALiBi kernel."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:PlugformerForCausalLMvLLM")
    register_vllm_kernel()
    register_alibi_kernel()


def register_vllm_kernel() -> None:
    """The record of vLLM's own kernel (transformers' interface already has its function): a dot product without a
    bias that windows the layers `layer_types` marks sliding, on the heads vLLM sizes its KV cache for
    (`num_key_value_heads` of `head_dim`: multi-head latent attention is refused). Not `available` outside vLLM's
    engine, so no suite or `supported_kernels` picks it."""
    if VLLM_KERNEL not in KERNELS:
        KERNELS.register(
            KernelSpec(
                VLLM_KERNEL,
                scores="dot_product",
                bias="none",
                sliding_window=False,
                windows_layer_types=True,
                head_shapes=False,
                available=lambda: False,
            )
        )


def register_alibi_kernel() -> None:
    if ALIBI_KERNEL not in KERNELS:
        register_attention_kernel(
            ALIBI_KERNEL, vllm_alibi_attention_forward, scores="dot_product", bias="alibi", head_shapes=False, mask=None
        )


def vllm_alibi_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """vLLM's attention of the Transformers backend, on a vLLM `Attention` that adds ALiBi from its slopes."""
    from vllm.model_executor.models.transformers import vllm_attention_forward
    from vllm.model_executor.models.transformers.base import VLLM_ATTN_ATTR

    attention = getattr(module, VLLM_ATTN_ATTR, None)
    if attention is None or getattr(getattr(attention, "impl", None), "alibi_slopes", None) is None:
        raise ValueError(
            f"attn_implementation={ALIBI_KERNEL!r} runs only on a vLLM Attention built with alibi_slopes "
            "(PlugformerForCausalLMvLLM builds it); this one has none, so ALiBi would be dropped"
        )
    return vllm_attention_forward(module, query, key, value, attention_mask, **kwargs)


def refuse_unsupported_layers(config: PlugformerConfig) -> None:
    """Raises a `ValueError` for what vLLM's Transformers backend is not known to serve exactly: `"linear_attention"`
    layers (its cache holds keys and values per attention layer, no recurrent or convolution state) and
    `final_logit_softcapping` (vLLM computes the logits with its own head, outside plugformer's; neither verified
    here)."""
    linear = [i for i, kind in enumerate(config.layer_types or ()) if kind == "linear_attention"]
    if linear:
        raise ValueError(
            f"layer_types has 'linear_attention' layers {linear}, whose recurrent state vLLM's "
            "Transformers backend does not keep: serve this model with transformers' generate()"
        )
    if config.final_logit_softcapping is not None:
        raise ValueError(
            f"final_logit_softcapping={config.final_logit_softcapping}: vLLM computes the logits with its "
            "own head, whose cap is not verified for plugformer: serve with transformers' generate()"
        )


_PRIVATE_DECODER: type | None = None


def private_decoder_class() -> type:
    """A subclass of `PlugformerModel` that only vLLM builds (and decorates for torch.compile)."""
    global _PRIVATE_DECODER
    if _PRIVATE_DECODER is None:
        from ..modeling import PlugformerModel

        _PRIVATE_DECODER = type(
            "PlugformerModel", (PlugformerModel,), {"__module__": __name__, "__qualname__": "PlugformerModel"}
        )
    return _PRIVATE_DECODER


@contextmanager
def building_private_decoder():
    """`AutoModel` builds the private subclass for a `PlugformerConfig` while vLLM builds its model."""
    from transformers import AutoModel

    from ..modeling import PlugformerModel

    AutoModel.register(PlugformerConfig, private_decoder_class(), exist_ok=True)
    try:
        yield
    finally:
        AutoModel.register(PlugformerConfig, PlugformerModel, exist_ok=True)


def _vllm_model_class() -> type:
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.transformers import TransformersForCausalLM
    from vllm.model_executor.models.transformers.fusers.attention import VLLM_ATTN_IMPL

    class PlugformerForCausalLMvLLM(TransformersForCausalLM):
        """vLLM's Transformers-backend causal LM for plugformer: native ALiBi, the trainer's classes untouched."""

        def __init__(self, *, vllm_config, prefix: str = ""):
            config = vllm_config.model_config.hf_config
            refuse_unsupported_layers(config)
            # the per-head slopes of a scheme whose bias is ALiBi's linear one, which vLLM's attention adds itself
            # (kept as floats: vLLM may build the model under a device context)
            slopes = POSITION_SCHEMES.get(config.position_scheme).linear_bias_slopes(config)
            self._alibi = slopes is not None
            self._slopes = slopes.tolist() if self._alibi else None
            if self._alibi and vllm_config.parallel_config.tensor_parallel_size != 1:
                raise ValueError(
                    f"position_scheme={config.position_scheme!r} with tensor_parallel_size="
                    f"{vllm_config.parallel_config.tensor_parallel_size}: plugformer's vLLM model passes ALiBi "
                    "slopes for all heads, verified on one rank only; use tensor_parallel_size=1"
                )
            if self._alibi:
                register_alibi_kernel()
            with building_private_decoder():
                super().__init__(vllm_config=vllm_config, prefix=prefix)

        def _patch_config(self):
            super()._patch_config()
            if self._alibi:  # plugformer's attention dispatches to the kernel that knows vLLM adds the bias
                self.text_config._attn_implementation = ALIBI_KERNEL

        def recursive_replace(self):
            # vLLM's backend serves the attention of modules whose config names its own implementation ("vllm");
            # plugformer's attention names the ALiBi kernel everywhere else (construction, every forward)
            implementation = KERNELS.of(self.text_config).name
            if self._alibi:
                self.text_config._attn_implementation = VLLM_ATTN_IMPL
            try:
                super().recursive_replace()
            finally:
                self.text_config._attn_implementation = implementation

        def _get_attn_cls(self):
            attention_class = super()._get_attn_cls()
            if not self._alibi:
                return attention_class
            if attention_class is not Attention:
                raise ValueError(
                    f"position_scheme={self.text_config.position_scheme!r}: vLLM chose {attention_class.__name__}, "
                    "which takes no alibi_slopes"
                )
            return functools.partial(attention_class, alibi_slopes=self._slopes)

        def _create_attention_instances(self, prefix: str = ""):
            super()._create_attention_instances(prefix)
            if not self._alibi:
                return
            from vllm.model_executor.models.transformers.base import VLLM_ATTN_ATTR

            for name, module in self.named_modules():
                attention = getattr(module, VLLM_ATTN_ATTR, None)
                if attention is None:
                    continue
                slopes = getattr(attention.impl, "alibi_slopes", None)
                if slopes is None or torch.as_tensor(slopes, dtype=torch.float32).cpu().tolist() != self._slopes:
                    raise ValueError(
                        f"position_scheme={self.text_config.position_scheme!r}: vLLM's attention backend "
                        f"{type(attention.impl).__name__} at {name} did not keep plugformer's ALiBi slopes ({slopes!r}); refusing to run without them"
                    )

    return PlugformerForCausalLMvLLM


def __getattr__(name: str):
    # vLLM imports "plugformer.integrations.vllm_plugin:PlugformerForCausalLMvLLM" when it builds a model; defined on first use so
    # that importing this module (to register) does not import vLLM's model code
    if name == "PlugformerForCausalLMvLLM":
        cls = _vllm_model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
