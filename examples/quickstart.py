"""Build plugformer models with different attention score functions and position schemes, run them through the
Auto classes and `generate`, and see which kernel each runs on.

    python examples/quickstart.py
"""

import tempfile

import torch
from transformers import AutoModelForCausalLM

import plugformer  # registers model_type "plugformer" with the Auto classes
from plugformer import PlugformerConfig, PlugformerForCausalLM


torch.manual_seed(0)
prompt = torch.randint(3, 128, (1, 6))
for score, scheme in [("scaled_dot", "rope"), ("multiplicative", "t5_bias"), ("additive", "alibi")]:
    config = PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme)
    model = PlugformerForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)  # safetensors + the model's code (loads with trust_remote_code too)
        reloaded = AutoModelForCausalLM.from_pretrained(directory)
    tokens = reloaded.generate(prompt, max_new_tokens=6, do_sample=False)
    print(f"{score:15s}{scheme:13s} kernel={reloaded.config._attn_implementation:6s} "
          f"valid kernels={plugformer.supported_kernels(config)} -> {tokens[0, 6:].tolist()}")  # fmt: skip
