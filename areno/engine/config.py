"""The engine's configuration: one typed dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areno.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
LINEAR_STATE_DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
GRAPH_MODES = ("auto", "off", "static", "capture")
COMPILE_MODES = ("auto", "off", "inductor", "aot_eager", "eager")
ON_OFF_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class KVPoolOptions:
    """What sizes the KV block pool (areno/engine/parallel/kv_pool.py): EngineConfig's `block_size`,
    `kv_cache_gib` and `kv_cache_memory_fraction`; `profile_tokens`, the prompt tokens of the
    forward whose activation peak the fraction leaves room for (the per-step prefill budget)."""

    block_size: int = 16
    kv_cache_gib: float | None = None
    memory_fraction: float = 0.9
    profile_tokens: int = 8192


@dataclass(frozen=True)
class EngineConfig:
    """How one Generator replica runs.

    tp_size: ranks of the tensor-parallel group (`--tp-size`).
    max_running_prompts: sequences running at once (`--max-running-prompts`); each of a
        request's n samples is one, and samples beyond the free slots wait for one.
    max_context_len: tokens one sequence may reach, prompt plus output (`--max-context-len`);
        None: the model's max_position_embeddings, capped at DEFAULT_MAX_CONTEXT_LEN.
    block_size: tokens per KV cache block (`--block-size`).
    kv_cache_gib: GiB of KV blocks in the pool (`--kv-cache-gib`); None: on CUDA
        `kv_cache_memory_fraction` sizes it, on CPU it holds max_context_len tokens for each of
        max_running_prompts sequences (what a slot cache would take).
    kv_cache_memory_fraction: on CUDA without kv_cache_gib, the fraction of the device's
        memory the whole engine may use (`--kv-cache-memory-fraction`): the pool gets what is
        left after the weights, the activation peak of a max_prefill_tokens_per_step prefill
        (measured at start-up) and the running sequences' linear-attention states.
    max_prefill_tokens_per_step: prompt tokens prefilled per step (`--max-num-batched-tokens`);
        a longer prompt is prefilled in chunks beside the decodes (see SchedulerConfig).
    enable_prefix_caching: keep computed full KV blocks by the chained hash of their tokens and
        media, so that a prompt starts from its longest cached prefix (SchedulerConfig;
        `--enable-prefix-caching`, on by default as in vLLM). Where
        layers keep state besides keys (linear attention, sliding windows), a prompt resumes
        only where that state was saved: at the end of a prompt with media's last full block,
        and at the end of every finished sequence (areno/engine/kv/state_cache.py).
    prefix_state_rows: how many such saved states the engine keeps, beside the running
        sequences' own (`--prefix-state-rows`); None: two per running sequence. Each costs one
        sequence's linear-attention states and sliding rings; unused elsewhere.
    encoder_cache_gib: with prefix caching, GiB of media tower outputs kept by the content
        they encoded (`--encoder-cache-gib`), so that media seen again skip the towers
        (areno/engine/runner/encoder_cache.py); 0: none.
    dtype: "auto" is float32 on CPU and bfloat16 on CUDA.
    device: "auto" is CUDA when available.
    num_cpus_per_rank: CPUs Ray reserves for each tensor-parallel follower actor.
    decode_graphs: "auto" (CUDA graphs on GPU), "off", "capture", or "static" (the graphs' padded
        step run eagerly; for tests on CPU). See areno/engine/runner/cuda_graphs.py.
    decode_compile: the torch.compile backend of the decode step's model forward: "auto" is
        "inductor" where decode graphs are captured (CUDA) and "off" elsewhere; "aot_eager"
        traces without generating kernels (fast; for tests). Compiling costs minutes at the
        first decode of each new row bucket's shape family; a compile error logs a warning and
        the step runs uncompiled. On CPU "inductor" runs the padded step compiled, keeping the
        packed linear layers: on 2 cores the small checkpoint's decode step took 20.8-22.2 ms
        against 25.3-26.2 eager, after a 40 s cold compile (docs/performance.md, "The generator engine").
    prefill_compile: the torch.compile backend of the text stack when prompts without media
        share a prefill forward: "auto" is the decode step's, except under tensor parallelism
        (off there). Media prompts prefill uncompiled.
    fuse_projections: run each layer's sibling projections of one input (query / key / value,
        gate / up, a gated-delta-net's four) as one matmul over a fused weight, of which the
        parameters become views (areno/engine/layers/fused_linear.py). "auto" is "on" on CUDA without
        tensor parallelism, "off" on CPU, where "on" packs each fused weight whole for the packed
        layers and gained nothing measurable (docs/performance.md, "The generator engine"). On an H200 it took
        the Qwen3-1.7B shape from 14.8k to 16.5k tok/s, the engine's cold warm-up (both
        compiles) 204 s (docs/performance.md, "The generator engine").
    cpu_packed_linear: on CPU in float32 without tensor parallelism, run the model's linear
        layers through oneDNN with prepacked weights (areno/engine/layers/cpu_linear.py), compiled or
        not; False keeps aten's matmul.
    overlap_steps: "on" launches each step before the host reads the previous step's tokens,
        so the host's bookkeeping runs while the device computes (see EngineCore.step; true and
        false mean "on" and "off", as a YAML config's bare on / off arrive); "auto"
        is "on" on CUDA with tp_size 1 and "off" elsewhere ("on" needs tp_size 1: the followers
        of a tensor-parallel group take each step's tokens from the host). A sequence that stops
        on a token then decodes one wasted step; its output is the same. On an H200 it took the
        Qwen3-1.7B shape from 10.7k to 13.4k tok/s and the Qwen3.5-2B hybrid from 9.5k to 11.8k
        (docs/performance.md, "The generator engine"); on CPU, where nothing overlaps, it gains nothing.
    max_loras: LoRA adapters the engine can hold beside its base weights (`--max-loras`);
        0: none, and no low-rank path runs (areno/engine/layers/lora.py). Needs tp_size 1.
    max_lora_rank: the largest adapter rank it takes (`--max-lora-rank`).
    linear_state_dtype: the stored dtype of linear-attention (Qwen3.5 gated-delta-net)
        recurrent states (`--linear-state-dtype`): "float32", or "bfloat16", which halves the
        bytes a decode step reads and writes for them; they are computed in fp32 either way
        (areno/engine/kernels/gated_delta.py). Its effect on greedy parity and step time is in
        docs/performance.md ("Linear-attention state in bf16").
    """

    tp_size: int = 1
    max_running_prompts: int = 8
    max_context_len: int | None = None
    block_size: int = 16
    kv_cache_gib: float | None = None
    kv_cache_memory_fraction: float = 0.9
    max_prefill_tokens_per_step: int = 8192
    enable_prefix_caching: bool = True
    prefix_state_rows: int | None = None
    encoder_cache_gib: float = 0.5
    dtype: str = "auto"
    device: str = "auto"
    num_cpus_per_rank: float = 1.0
    decode_graphs: str = "auto"
    decode_compile: str = "auto"
    prefill_compile: str = "auto"
    cpu_packed_linear: bool = True
    overlap_steps: str = "auto"
    fuse_projections: str = "auto"
    max_loras: int = 0
    max_lora_rank: int = 16
    linear_state_dtype: str = "float32"

    def __post_init__(self) -> None:
        names = ("tp_size", "max_running_prompts", "max_prefill_tokens_per_step", "block_size")
        for name in (*names, "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1; got {value!r}", param=name)
        loras = self.max_loras
        if isinstance(loras, bool) or not isinstance(loras, int) or loras < 0:
            raise ConfigError(
                f"max_loras must be an integer >= 0; got {loras!r}", param="max_loras"
            )
        if loras and self.tp_size > 1:
            raise ConfigError(
                "LoRA adapters (max_loras > 0) need tp_size 1: the low-rank path does not shard "
                "its factors over a tensor-parallel group yet",
                param="max_loras",
            )
        rows = self.prefix_state_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise ConfigError(
                f"prefix_state_rows must be an integer >= 0; got {rows!r}",
                param="prefix_state_rows",
            )
        cache = self.encoder_cache_gib
        if isinstance(cache, bool) or not isinstance(cache, int | float) or cache < 0:
            raise ConfigError(
                f"encoder_cache_gib must be a number >= 0; got {cache!r}",
                param="encoder_cache_gib",
            )
        if self.max_context_len is not None and (
            not isinstance(self.max_context_len, int) or self.max_context_len < 2
        ):
            raise ConfigError(
                f"max_context_len must be an integer >= 2; got {self.max_context_len!r}",
                param="max_context_len",
            )
        gib = self.kv_cache_gib
        if gib is not None and (
            isinstance(gib, bool) or not isinstance(gib, int | float) or gib <= 0
        ):
            raise ConfigError(
                f"kv_cache_gib must be a number > 0; got {gib!r}", param="kv_cache_gib"
            )
        fraction = self.kv_cache_memory_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 < fraction <= 1
        ):
            raise ConfigError(
                f"kv_cache_memory_fraction must be a number in (0, 1]; got {fraction!r}",
                param="kv_cache_memory_fraction",
            )
        if not isinstance(self.num_cpus_per_rank, int | float) or self.num_cpus_per_rank < 0:
            raise ConfigError(
                f"num_cpus_per_rank must be a number >= 0; got {self.num_cpus_per_rank!r}",
                param="num_cpus_per_rank",
            )
        if self.decode_graphs not in GRAPH_MODES:
            raise ConfigError(
                f"decode_graphs must be one of {GRAPH_MODES}; got {self.decode_graphs!r}",
                param="decode_graphs",
            )
        for name in ("decode_compile", "prefill_compile"):
            if getattr(self, name) not in COMPILE_MODES:
                raise ConfigError(
                    f"{name} must be one of {COMPILE_MODES}; got {getattr(self, name)!r}",
                    param=name,
                )
        if not isinstance(self.cpu_packed_linear, bool):
            raise ConfigError(
                f"cpu_packed_linear must be true or false; got {self.cpu_packed_linear!r}",
                param="cpu_packed_linear",
            )
        for name in ("overlap_steps", "fuse_projections"):
            value = getattr(self, name)
            if isinstance(value, bool):  # YAML reads a bare on / off as a boolean
                object.__setattr__(self, name, "on" if value else "off")
            if getattr(self, name) not in ON_OFF_MODES:
                raise ConfigError(
                    f"{name} must be one of {ON_OFF_MODES}; got {value!r}", param=name
                )
        if self.fuse_projections == "on" and self.tp_size > 1:
            raise ConfigError(
                "fuse_projections needs tp_size 1: a tensor-parallel rank's projections are "
                "shards, which cannot be concatenated into one weight",
                param="fuse_projections",
            )
        if self.overlap_steps == "on" and self.tp_size > 1:
            raise ConfigError(
                "overlap_steps needs tp_size 1: the followers of a tensor-parallel group take "
                "each step's input tokens from the host",
                param="overlap_steps",
            )
        if self.linear_state_dtype not in LINEAR_STATE_DTYPES:
            raise ConfigError(
                f"linear_state_dtype must be one of {LINEAR_STATE_DTYPES}; got "
                f"{self.linear_state_dtype!r}",
                param="linear_state_dtype",
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}; got {self.dtype!r}", param="dtype")
        if self.device not in DEVICES:
            raise ConfigError(
                f"device must be one of {DEVICES}; got {self.device!r}", param="device"
            )


DEFAULT_MAX_CONTEXT_LEN = 8192


def pool_options(config: EngineConfig) -> KVPoolOptions:
    """How the engine's KV block pool is sized (areno/engine/parallel/kv_pool.py)."""
    return KVPoolOptions(
        block_size=config.block_size,
        kv_cache_gib=config.kv_cache_gib,
        memory_fraction=config.kv_cache_memory_fraction,
        profile_tokens=config.max_prefill_tokens_per_step,
    )


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when a GPU is visible, else "cpu"."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but no GPU is visible", param="device")
    return device


def resolve_overlap(config: EngineConfig, device: str) -> bool:
    """Whether the engine overlaps its steps: "auto" is on for a one-process CUDA engine."""
    if config.overlap_steps == "auto":
        return config.tp_size == 1 and device.startswith("cuda")
    return config.overlap_steps == "on"


def resolve_dtype(dtype: str, device: str):
    """ "auto" -> bfloat16 on CUDA, float32 on CPU; else the named torch dtype."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def resolve_step_modes(
    graphs: str, compile: str, prefill_compile: str, device_type: str
) -> tuple[str, str, str]:
    """A runner's (graphs, compile, prefill_compile) with "auto" resolved: graphs are captured
    on CUDA and off on CPU, where an explicit compile runs the padded step uncaptured
    ("static"); the decode step compiles with inductor where graphs are captured; the batched
    prefill compiles as the decode step does. Raises ValueError for an unknown mode, or a
    compiled decode without the padded step."""
    if graphs not in GRAPH_MODES:
        raise ValueError(f"graphs must be one of {GRAPH_MODES}; got {graphs!r}")
    for name, mode in (("compile", compile), ("prefill_compile", prefill_compile)):
        if mode not in COMPILE_MODES:
            raise ValueError(f"{name} must be one of {COMPILE_MODES}; got {mode!r}")
    if graphs == "auto":
        graphs = "capture" if device_type == "cuda" else "off"
        if graphs == "off" and compile not in ("auto", "off"):
            graphs = "static"
    if compile == "auto":
        compile = "inductor" if graphs == "capture" else "off"
    if compile != "off" and graphs == "off":
        raise ValueError("a compiled decode needs the padded step: graphs 'static' or 'capture'")
    if prefill_compile == "auto":
        prefill_compile = compile
    return graphs, compile, prefill_compile


def resolve_max_context_len(config: EngineConfig, model_config: Any) -> int:
    """The configured max_context_len, or the model's limit capped at DEFAULT_MAX_CONTEXT_LEN."""
    text_config = model_config.get_text_config()
    model_limit = getattr(text_config, "max_position_embeddings", None) or DEFAULT_MAX_CONTEXT_LEN
    if config.max_context_len is None:
        return min(model_limit, DEFAULT_MAX_CONTEXT_LEN)
    if config.max_context_len > model_limit:
        raise ConfigError(
            f"--max-context-len {config.max_context_len} exceeds the model's "
            f"max_position_embeddings ({model_limit})",
            param="max_context_len",
        )
    return config.max_context_len
