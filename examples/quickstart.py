"""Train three plugformer variants (attention score x position scheme) for a few seconds each on a copying task,
reload each through the Auto classes, and see what differs: the kernel each runs on, how far its loss fell, and how
many tokens of a new pattern it continues correctly.

The task: a random 4-token pattern repeated to 16 tokens; after the first 4 every token is predictable by looking 4
back (an "induction" lookup), which a 2-layer model learns in a few hundred steps, some variants faster than others.

    python examples/quickstart.py            # ~10-20 s on a laptop CPU
"""

from __future__ import annotations

import tempfile

import torch
from transformers import AutoModelForCausalLM

import plugformer  # registers model_type "plugformer" with the Auto classes
from plugformer import PlugformerConfig, PlugformerForCausalLM


PERIOD, LENGTH, VOCAB = 4, 16, 32


def batch(size: int, generator: torch.Generator) -> torch.Tensor:
    """(size, LENGTH) token ids: a random pattern of PERIOD tokens (ids 3..VOCAB-1) repeated."""
    pattern = torch.randint(3, VOCAB, (size, PERIOD), generator=generator)
    return pattern.repeat(1, LENGTH // PERIOD)


def train(model: PlugformerForCausalLM, steps: int, seed: int = 0) -> list[float]:
    """A few AdamW steps on the copying task; the loss is scored on the predictable tokens only (after the first
    PERIOD). Returns the loss of each step."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _ in range(steps):
        ids = batch(32, generator)
        labels = ids.clone()
        labels[:, :PERIOD] = -100  # the first pattern is random: nothing to learn there
        loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def continued_correctly(model, generator: torch.Generator, examples: int = 64) -> float:
    """Fraction of generated tokens equal to the pattern's continuation, prompting with the pattern twice."""
    ids = batch(examples, generator)
    prompt, expected = ids[:, : 2 * PERIOD], ids[:, 2 * PERIOD :]
    generated = model.generate(prompt, max_new_tokens=expected.shape[1], do_sample=False, pad_token_id=0)
    return (generated[:, prompt.shape[1] :] == expected).float().mean().item()


def main(steps: int = 150) -> dict:
    results = {}
    for score, scheme in [("scaled_dot", "rope"), ("multiplicative", "t5_bias"), ("additive", "alibi")]:
        torch.manual_seed(0)
        config = PlugformerConfig.from_preset(
            "tiny", attention_score=score, position_scheme=scheme, vocab_size=VOCAB, max_position_embeddings=LENGTH
        )
        model = PlugformerForCausalLM(config)
        losses = train(model, steps)
        with tempfile.TemporaryDirectory() as directory:
            model.save_pretrained(directory)  # safetensors + the model's code (loads with trust_remote_code too)
            reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()
        accuracy = continued_correctly(reloaded, torch.Generator().manual_seed(1))
        results[f"{score}/{scheme}"] = {"first_loss": losses[0], "last_loss": losses[-1], "accuracy": accuracy}
        print(
            f"{score:15s}{scheme:9s} kernel={reloaded.config._attn_implementation:6s} "
            f"(valid: {', '.join(plugformer.supported_kernels(config))})  loss {losses[0]:.2f} -> {losses[-1]:.2f}  "
            f"pattern continued correctly: {accuracy:.0%}"
        )
    print(
        f"(chance: {1 / (VOCAB - 3):.0%}; the untrained models' loss ≈ ln({VOCAB}) = {torch.tensor(VOCAB).log():.2f})"
    )
    return results


if __name__ == "__main__":
    main()
