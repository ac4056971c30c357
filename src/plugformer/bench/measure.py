"""Timing, memory and kernel probes. Nothing here knows about plugformer: subjects are callables.

- `run_interleaved` runs every subject once per repeat, warm-up included, so drift of a shared machine (other jobs,
  thermal or frequency changes) hits every subject alike; the order flips each repeat (A, B, B, A, ...), so neither
  subject always runs in the allocator and cache state the other leaves behind.
- `TrainStep` times one forward + backward + AdamW step; `GenerateRun` one greedy `generate`, split into prefill and
  decode by timestamps a logits processor takes as each token's scores arrive.
- `profile_call` runs one extra, untimed call under `torch.profiler`: its op names say which SDPA backend actually
  ran, and on CPU its allocation events give the peak memory (see `profile_call`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LogitsProcessor, LogitsProcessorList

from .arguments import DTYPES


# The aten op each SDPA backend dispatches to (CPU and CUDA); "math" is the unfused composite. A flash backward is
# listed too: the banded kernel calls it where its forward ran in C.
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "flash",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "mem-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
    "plugformer::sdpa_relative_bias": "blockwise-bias",  # kernels.PROFILER_NAME: SDPA per block of query rows
    "plugformer::banded_bias": "banded-bias",  # kernels_banded: fused, the bias gradient of the near band explicit
    "plugformer::band_native": "band-native",  # kernels_banded: the forward and the near band's backward in C
    "plugformer::relative_native": "relative-native",  # kernels_relative_native: any relative bias wholly in C
    "plugformer::relative_bias": "relative-bias",  # kernels_relative: fused forward, bias as a view; hand backward
    "plugformer::fire_native": "fire-native",  # kernels_fire_native: FIRE's bias by pieces, wholly in C
    "plugformer::linear_bias": "linear-bias",  # kernels_alibi: ALiBi as a key-side row per query block
    "plugformer::query_bias": "query-bias",  # kernels_query_bias: FIRE's / forgetting's bias per block, recomputed
    "plugformer::additive_native": "additive-native",  # kernels_additive_native: tanh pair by pair in C
}


def interleave(subjects: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """The schedule `[(0, A), (0, B), (1, B), (1, A), (2, A), ...]`: every subject once per repeat, the order
    reversed on odd repeats (counterbalanced)."""
    return [
        (repeat, subject) for repeat in range(repeats) for subject in (subjects if repeat % 2 == 0 else subjects[::-1])
    ]


def run_interleaved(
    subjects: dict[str, Callable[[], dict[str, float]]], repeats: int, warmup: int
) -> dict[str, list[dict[str, float]]]:
    """Calls the subjects `warmup` rounds untimed, then `repeats` rounds, interleaved; each subject's samples."""
    for _, name in interleave(list(subjects), warmup):
        subjects[name]()
    samples = {name: [] for name in subjects}
    for _, name in interleave(list(subjects), repeats):
        samples[name].append(subjects[name]())
    return samples


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def autocast(device: str, dtype: str) -> contextlib.AbstractContextManager:
    """fp32 runs as is; bf16 / fp16 run under `torch.autocast` (weights and optimiser stay fp32: mixed precision)."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=DTYPES[dtype])


def random_tokens(batch_size: int, length: int, vocab_size: int, seed: int, device: str) -> torch.Tensor:
    """`(batch_size, length)` ids drawn uniformly, avoiding ids 0-2 (often pad/bos/eos)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch_size, length), generator=generator).to(device)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (tied weights counted once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class TrainStep:
    """One training step of `model` on `batch` (labels = inputs): forward + backward + AdamW, gradients freed.

    Calling it times one step (device synchronised on both ends) and returns `{"seconds": ...}`.
    """

    def __init__(self, model: torch.nn.Module, batch: torch.Tensor, dtype: str, device: str):
        self.model, self.batch, self.dtype, self.device = model.train(), batch, dtype, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.scaler = torch.amp.GradScaler(device) if dtype == "fp16" else None  # fp16 gradients underflow unscaled

    def step(self) -> None:
        with autocast(self.device, self.dtype):
            loss = self.model(input_ids=self.batch, labels=self.batch).loss
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def live_bytes(self) -> int:
        """What is allocated between steps: parameters, buffers, AdamW's moments and the batch."""
        states = [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return tensor_bytes([*self.model.parameters(), *self.model.buffers(), *states, self.batch])

    def __call__(self) -> dict[str, float]:
        synchronize(self.device)
        start = time.perf_counter()
        self.step()
        synchronize(self.device)
        return {"seconds": time.perf_counter() - start}


class _Stamps(LogitsProcessor):
    """Records the time each new token's scores are ready (the first = end of prefill); leaves scores unchanged."""

    def __init__(self, device: str):
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


class GenerateRun:
    """Greedy `generate` of exactly `new_tokens` tokens after `prompts` with the model's KV cache (DynamicCache).

    Calling it returns `{"prefill_seconds": start -> first token's scores, "decode_seconds": first -> last token's
    scores}`: the decode interval covers `new_tokens - 1` cached forward passes plus generate's per-step work.
    """

    def __init__(self, model, prompts: torch.Tensor, new_tokens: int, dtype: str, device: str):
        self.model, self.prompts, self.new_tokens = model.eval(), prompts, new_tokens
        self.dtype, self.device = dtype, device
        self.sequences = None

    def generate(self, processors: Sequence[LogitsProcessor] = ()) -> torch.Tensor:
        eos = self.model.generation_config.eos_token_id
        with torch.no_grad(), autocast(self.device, self.dtype):
            return self.model.generate(
                input_ids=self.prompts,
                attention_mask=torch.ones_like(self.prompts),
                do_sample=False,
                num_beams=1,
                max_new_tokens=self.new_tokens,
                min_new_tokens=self.new_tokens,  # EOS is suppressed until the last token: every run is as long
                pad_token_id=eos[0] if isinstance(eos, list) else eos,
                logits_processor=LogitsProcessorList(processors),
            )

    def __call__(self) -> dict[str, float]:
        stamps = _Stamps(self.device)
        synchronize(self.device)
        start = time.perf_counter()
        self.sequences = self.generate([stamps])
        return {"prefill_seconds": stamps.times[0] - start, "decode_seconds": stamps.times[-1] - stamps.times[0]}


@dataclass
class Profile:
    """What one profiled call showed: peak memory in bytes and the SDPA backends that ran (empty: no SDPA call)."""

    peak_bytes: int | None
    sdpa_backends: list[str]


def peak_allocation(events: Iterable[tuple[int, int]]) -> int:
    """The highest running total of `(time_ns, bytes)` allocation events (frees are negative), from 0 at the start."""
    total = peak = 0
    for _, size in sorted(events):
        total += size
        peak = max(peak, total)
    return peak


def sdpa_backends(op_names: Iterable[str]) -> list[str]:
    return sorted({SDPA_OPS[name] for name in op_names if name in SDPA_OPS})


def profile_call(fn: Callable[[], object], device: str, live_bytes: int = 0) -> Profile:
    """Runs `fn` once under `torch.profiler`; returns its peak memory and the SDPA backends its op trace shows.

    Peak memory = `live_bytes` (what the caller says `fn`'s subject already holds: weights, optimiser state, inputs)
    + the highest increase of allocated bytes during the call, so the other model of a pair, resident on the same
    device, is not counted. CUDA: the increase is `torch.cuda.max_memory_allocated()` over its value at the start.
    CPU: the highest running total of the profiler's allocation events (frees negative), i.e. bytes of live tensors
    from torch's CPU allocator — the CPU analogue of `max_memory_allocated`. It does not see allocator caching or
    fragmentation, nor memory a library takes outside torch's allocator (some BLAS/oneDNN scratch), so the process
    RSS can be higher. (RSS itself, `ru_maxrss`, would need a fresh process per model: torch keeps freed pages.)
    """
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=device == "cpu") as profiler:
        fn()
    synchronize(device)
    events = profiler.profiler.kineto_results.events()  # raw events, frees included
    if device == "cuda":
        increase = torch.cuda.max_memory_allocated() - start
    else:
        increase = peak_allocation((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    return Profile(live_bytes + increase, sdpa_backends(e.name() for e in events))


def matmul_flops(size: int) -> int:
    """An n x n by n x n product: n² outputs of n multiply-adds = 2n³ FLOPs."""
    return 2 * size**3


def matmul_peak(dtype: str, device: str, size: int, repeats: int, warmup: int) -> dict:
    """Measured peak: FLOP/s of `torch.mm` on `size` x `size` operands in `dtype` (median of `repeats`)."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device=device, dtype=DTYPES[dtype]) for _ in range(2))
    seconds = []
    for repeat in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        if repeat >= warmup:
            seconds.append(time.perf_counter() - start)
    return {"size": size, "seconds": seconds, "flops_per_s": matmul_flops(size) / median(seconds)}
