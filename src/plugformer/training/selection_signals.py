"""What dev selection scores when the data holds no verifiable answer: each stage's own dev signal.

`DevSelection` compares one number per scored step, higher being better. Where the data has an `answer` or a
`solution` column (or is the embedded task) and the model generates, it is greedy exact match
(`selection.ExactMatchSignal`); otherwise the stage names its own, chosen by the data's columns
(`common.dev_selection`):

| stage | data | signal (`run_info.json`: `selection.signal`) |
|---|---|---|
| sft | `messages`, `prompt`/`completion` or `text` | `dev_completion_log_likelihood`: the mean log-likelihood per completion token (the perplexity beside it) |
| reward | preference pairs, explicit or implicit prompt (the embedded pairs too) | `dev_pairwise_accuracy`: the pairs whose reward ranks chosen above rejected |
| dpo | preference pairs, explicit or implicit prompt | `dev_implicit_reward_accuracy`: the pairs whose implicit reward ranks chosen above rejected |
| grpo | prompts, rewards that need no ground truth | `dev_mean_reward`: the weighted reward of greedy dev answers |
| rlhf | prompts | `dev_mean_reward`: the reward model's score of greedy dev answers |

The completion log-likelihood reads the tokens TRL's SFT loss is about (the answers): it ranks steps by how well they
predict held-out answers, not by whether their greedy answers are right (there is nothing to check them against).
The pairwise accuracies count a tie as wrong, as TRL's logged accuracies do. The mean reward is the trainer's own objective on held-out
prompts, not a gold score: it finds a policy that generalises its reward, not one the reward overrates (RLHF's
over-optimisation needs a gold score to be seen).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..evaluation.answers import generate_answers
from ..evaluation.implicit_reward import completion_log_probs, explicit_prompts, padded_batch
from ..evaluation.metrics import load_metric
from ..evaluation.rewards import completion_text
from .sharding import is_sharded


@contextlib.contextmanager
def evaluating(model):
    """`model` in eval mode (no dropout) meanwhile, put back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def with_eos(completion, eos: str | None):
    """A string `completion` ending in `eos`, as TRL's `SFTTrainer` and `RewardTrainer` append it to text that is not
    a conversation (a conversation's end is its chat template's)."""
    if isinstance(completion, str) and eos and not completion.endswith(eos):
        return completion + eos
    return completion


def pair_token_ids(tokenizer, prompt, completion, max_length: int | None = None) -> tuple[list[int], int]:
    """(prompt ids + completion ids, where the completion starts), the two tokenized apart as TRL's DPO does, so a
    merge across the boundary cannot move it; a conversation's completion is its text after the templated prompt."""
    if isinstance(prompt, str):
        head, tail = prompt, completion_text(completion)
    else:
        head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        tail = whole[len(head) :] if whole.startswith(head) else completion_text(completion)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    ids = head_ids + tokenizer(tail, add_special_tokens=False)["input_ids"]
    if max_length is not None and len(ids) > max_length:  # as the trainer truncates what it trains on
        ids = ids[:max_length]
    return ids, min(len(head_ids), len(ids))


class ImplicitRewardAccuracy:
    """DPO's own dev signal: the fraction of dev pairs whose implicit reward β·(log π − log π_ref) is higher for the
    chosen answer than for the rejected one (TRL logs the same on its batches as `rewards/accuracies`; a tie, as at
    step 0 where π is π_ref, counts as wrong there too), with the mean reward margin beside it.

    Args:
        rows (`datasets.Dataset`): Dev pairs (`chosen`, `rejected`, and `prompt` or an implicit one).
        tokenizer: The policy's tokenizer.
        reference (`str`): The DPO reference's folder (the stage's `--model_name_or_path`).
        beta (`float`): The stage's β (scales the margin only).
        max_length (`int`, *optional*): Tokens kept of each prompt + answer (the trainer's `--max_length`).
        batch_size (`int`, *optional*, defaults to 32): Sequences per forward.

    The reference's log-probabilities are computed once: at step 0 with the policy itself, which is the reference
    there (DPO starts from it; new LoRA adapters change nothing), else (a resumed run) with the reference loaded from
    its folder, then freed.
    """

    name = "dev_implicit_reward_accuracy"
    description = "pairwise accuracy of the implicit reward (chosen above rejected) on the dev pairs"

    def __init__(
        self, rows, tokenizer, reference: str, beta: float, max_length: int | None = None, batch_size: int = 32
    ):
        rows = explicit_prompts(rows)
        self.reference, self.beta, self.batch_size = reference, beta, batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batches = []  # (ids, mask, starts) of chosen then rejected answers, per batch of pairs
        for start in range(0, len(rows), batch_size):
            part = rows[start : start + batch_size]
            for column in ("chosen", "rejected"):
                pairs = zip(part["prompt"], part[column], strict=True)
                self.batches.append(padded_batch([pair_token_ids(tokenizer, p, c, max_length) for p, c in pairs], pad))
        self.reference_log_probs: torch.Tensor | None = None

    def log_probs(self, model) -> torch.Tensor:
        """Σ log p of each answer's tokens under `model`: (pairs, 2), chosen then rejected."""
        with evaluating(model):
            values = [completion_log_probs(model, *batch) for batch in self.batches]
        chosen, rejected = torch.cat(values[0::2]), torch.cat(values[1::2])
        return torch.stack([chosen, rejected], dim=1)

    def __call__(self, model, step: int) -> dict:
        policy = self.log_probs(model)
        if self.reference_log_probs is None:
            self.reference_log_probs = policy if step == 0 else self.log_probs(self.load_reference(model))
        rewards = self.beta * (policy - self.reference_log_probs)  # (pairs, 2)
        margins = rewards[:, 0] - rewards[:, 1]
        return {self.name: float((margins > 0).float().mean()), "dev_implicit_reward_margin": float(margins.mean())}

    def load_reference(self, model):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.reference, dtype=model.dtype).to(model.device)


def completion_pairs(rows, eos: str | None) -> list[tuple]:
    """(prompt, completion) of each stretch of SFT `rows` that TRL's completion-only loss trains on: a `completion`
    after its `prompt`; each assistant turn of `messages` after the conversation before it; all of a `text` (after
    an empty prompt). A string completion or text ends in `eos` (`with_eos`)."""
    columns = rows.column_names
    if "completion" in columns:  # TRL reads a prompt and a completion before anything else
        return [(p, with_eos(c, eos)) for p, c in zip(rows["prompt"], rows["completion"], strict=True)]
    if "messages" in columns:
        return [
            (messages[:k], messages[k : k + 1])
            for messages in rows["messages"]
            for k, turn in enumerate(messages)
            if turn["role"] == "assistant"
        ]
    if "text" in columns:
        return [("", with_eos(text, eos)) for text in rows["text"]]
    raise ValueError(
        f"dev completion log-likelihood: rows with columns {columns}; expected prompt and completion, messages, or text"
    )


class CompletionLikelihood:
    """SFT's own dev signal where the data holds no verifiable answer: the mean log-likelihood per completion token
    over the dev rows (nats, −log of the perplexity, which is recorded beside it), token-weighted as the trainer's loss
    is. The tokens read are the completions (`completion_pairs`): a `completion`, the assistant turns of `messages`,
    all of a `text` but its first (nothing predicts it).

    Args:
        rows (`datasets.Dataset`): Dev rows in one of TRL's SFT formats.
        tokenizer: The policy's tokenizer.
        max_length (`int`, *optional*): Tokens kept of each prompt + completion (the trainer's `--max_length`).
        batch_size (`int`, *optional*, defaults to 32): Sequences per forward.

    Differs from TRL for `messages`: its loss reads the whole conversation unless `--assistant_only_loss true`; the
    signal reads the assistant turns, the answers a step is chosen for.
    """

    name = "dev_completion_log_likelihood"
    description = "mean log-likelihood per completion token (assistant turns, completions or text) of the dev rows"

    def __init__(self, rows, tokenizer, max_length: int | None = None, batch_size: int = 32):
        pairs = completion_pairs(rows, tokenizer.eos_token)
        sequences = [pair_token_ids(tokenizer, prompt, completion, max_length) for prompt, completion in pairs]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batches = [padded_batch(sequences[i : i + batch_size], pad) for i in range(0, len(sequences), batch_size)]
        # the tokens `completion_log_probs` sums over: from the completion's start, never the first token
        self.tokens = sum(max(len(ids) - max(start, 1), 0) for ids, start in sequences)
        if self.tokens == 0:
            raise ValueError(
                f"dev completion log-likelihood: the {len(rows)} dev rows hold no completion token "
                f"within --max_length {max_length}"
            )

    def __call__(self, model, step: int) -> dict:
        with evaluating(model):
            total = sum(float(completion_log_probs(model, *batch).sum()) for batch in self.batches)
        mean = total / self.tokens
        return {self.name: mean, "dev_completion_perplexity": math.exp(min(-mean, 50.0))}


class RewardAccuracy:
    """The reward stage's dev signal: the fraction of dev pairs that the reward model being trained scores higher
    for the chosen answer than for the rejected one (the `pairwise_accuracy` metric; a tie counts as wrong, as in TRL's
    logged `accuracy`), with the mean reward margin beside it.

    Args:
        rows (`datasets.Dataset`): Dev pairs (`chosen`, `rejected`, and `prompt` or an implicit one).
        tokenizer: The reward model's tokenizer.
        batch_size (`int`, *optional*, defaults to 32): Sequences per forward.

    Each answer is scored after its prompt as `RewardTrainer` reads it: a conversation through the chat template
    (`ClassifierReward`), a string ending in the end-of-text token, which TRL appends (`with_eos`).
    """

    name = "dev_pairwise_accuracy"
    description = "pairwise accuracy of the reward model (chosen above rejected) on the dev pairs"

    def __init__(self, rows, tokenizer, batch_size: int = 32):
        rows = explicit_prompts(rows)
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.prompts = list(rows["prompt"])
        self.chosen = [with_eos(answer, tokenizer.eos_token) for answer in rows["chosen"]]
        self.rejected = [with_eos(answer, tokenizer.eos_token) for answer in rows["rejected"]]
        self.metric = load_metric("pairwise_accuracy")

    def __call__(self, model, step: int) -> dict:
        reward = ClassifierReward(model, self.tokenizer, self.batch_size)
        with evaluating(model):
            chosen, rejected = reward(self.prompts, self.chosen), reward(self.prompts, self.rejected)
        accuracy = self.metric.compute(predictions=chosen, references=rejected)["pairwise_accuracy"]
        margin = sum(c - r for c, r in zip(chosen, rejected, strict=True)) / max(len(chosen), 1)
        return {self.name: accuracy, "dev_reward_margin": margin}


class MeanReward:
    """GRPO's and RLHF's own dev signal: the mean over dev prompts of the weighted reward (TRL's sum over the reward
    functions, a `None` counted as no reward) of each prompt's greedy answer.

    Args:
        rows (`datasets.Dataset`): Dev prompts (`prompt`); their other columns reach the reward functions as keyword
            lists, as TRL passes them.
        tokenizer: The policy's tokenizer.
        reward_funcs (`list`): TRL reward functions, `f(prompts, completions, completion_ids, **kwargs)`.
        weights (`list[float]`, *optional*): One per function; defaults to 1 each.
        max_new_tokens (`int`, *optional*, defaults to 32): Generation budget per answer.
    """

    name = "dev_mean_reward"

    def __init__(
        self, rows, tokenizer, reward_funcs: list, weights: list[float] | None = None, max_new_tokens: int = 32
    ):
        weights = list(weights) if weights is not None else [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ValueError(
                f"--reward_weights {weights}: {len(weights)} weights for {len(reward_funcs)} reward "
                "functions; give one weight each"
            )
        self.rows, self.tokenizer, self.max_new_tokens = rows, tokenizer, max_new_tokens
        self.reward_funcs, self.weights = reward_funcs, weights
        names = ", ".join(getattr(f, "__name__", type(f).__name__) for f in reward_funcs)
        self.description = f"mean reward ({names}) of greedy answers to the dev prompts"

    def __call__(self, model, step: int) -> dict:
        prompts = list(self.rows["prompt"])
        texts = generate_answers(model, self.tokenizer, prompts, self.max_new_tokens, synced_gpus=is_sharded(model))
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts, strict=True)
        ]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        columns = {c: list(self.rows[c]) for c in self.rows.column_names if c not in ("prompt", "completion")}
        total = [0.0] * len(prompts)
        for function, weight in zip(self.reward_funcs, self.weights, strict=True):
            values = function(prompts=prompts, completions=completions, completion_ids=ids, **columns)
            for i, value in enumerate(values):
                if value is not None and not math.isnan(value):
                    total[i] += weight * float(value)
        return {self.name: sum(total) / max(len(total), 1)}


class ClassifierReward:
    """A reward classifier (`num_labels=1`) as a TRL reward function: the score of prompt + completion, templated
    for a conversation, as TRL's online trainers score with a reward model."""

    __name__ = "reward_model"

    def __init__(self, model, tokenizer, batch_size: int = 32):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        texts = [
            self.tokenizer.apply_chat_template(p + c, tokenize=False) if isinstance(p, list) else p + c
            for p, c in zip(prompts, completions, strict=True)
        ]
        device = next(self.model.parameters()).device
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "right"
        scores = []
        try:
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(device)
                scores += self.model(**batch).logits[:, 0].float().cpu().tolist()  # (B, 1) -> (B,)
        finally:
            self.tokenizer.padding_side = side
        return scores
