"""The engine's configuration: one typed dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from areno.errors import ConfigError
from areno.settings import build, setting

DTYPES = ("auto", "float32", "bfloat16", "float16")
LINEAR_STATE_DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
GRAPH_MODES = ("auto", "off", "static", "capture")
COMPILE_MODES = ("auto", "off", "inductor", "aot_eager", "eager")
ON_OFF_MODES = ("auto", "on", "off")
DEFAULT_MAX_CONTEXT_LEN = 8192


@dataclass(frozen=True)
class KVPoolOptions:
    """What sizes the KV block pool (areno/engine/parallel/kv_pool.py): EngineConfig's `block_size`,
    `kv_cache_gib`, `kv_cache_memory_fraction` and the saved-state settings; `profile_tokens`, the prompt tokens of the
    forward whose activation peak the fraction leaves room for (`max_num_batched_tokens`)."""

    block_size: int = 16
    kv_cache_gib: float | None = None
    memory_fraction: float = 0.9
    profile_tokens: int = 8192
    # Saved layer states of the prefix cache sized in bytes beside the blocks (`prefix_state_rows`
    # None): their share of the cache's memory and the blocks between two checkpoints.
    size_state_rows: bool = False
    state_memory_fraction: float = 0.1
    checkpoint_blocks: int = 16


@dataclass(frozen=True)
class EngineConfig:
    """How one Generator replica runs: `areno serve`'s engine flags, a Ray Serve config's
    `engine:` and a GRPO config's `rollout.engine` are this one declaration."""

    tp_size: int = setting(1, help="ranks (GPUs) of one Generator's tensor-parallel group")
    max_running_prompts: int = setting(
        8,
        help="sequences running at once per replica; each of a request's n samples is one, "
        "and samples beyond the free ones wait",
    )
    max_context_len: int | None = setting(
        None,
        help="tokens one sequence may reach, prompt plus output; none: the model's "
        f"max_position_embeddings, at most {DEFAULT_MAX_CONTEXT_LEN}",
    )
    block_size: int = setting(16, help="tokens per KV cache block")
    kv_cache_gib: float | None = setting(
        None,
        help="GiB of KV cache blocks per rank; none: on CUDA kv_cache_memory_fraction sizes "
        "the pool, on CPU it holds max_context_len tokens for each of max_running_prompts "
        "sequences",
    )
    kv_cache_memory_fraction: float = setting(
        0.9,
        help="on CUDA without kv_cache_gib, the share of the GPU's memory the engine may use: "
        "the KV pool gets what the weights, the activation peak of a max_num_batched_tokens "
        "prefill (measured at start-up) and the running sequences' states leave",
    )
    max_num_batched_tokens: int = setting(
        8192,
        help="prompt tokens prefilled in one engine step; a longer prompt is prefilled in "
        "chunks over several steps beside the running decodes",
    )
    enable_prefix_caching: bool = setting(
        True,
        help="keep computed KV blocks by the chained hash of their tokens and media, so a "
        "prompt starts from its longest cached prefix; where layers keep state besides keys "
        "(linear attention, sliding windows) a prompt resumes where a state was saved "
        "(areno/engine/kv/state_cache.py)",
    )
    prefix_state_rows: int | None = setting(
        None,
        help="saved layer states the prefix cache keeps on models with linear-attention or "
        "sliding-window layers, beside the running sequences' own; none: sized in bytes by "
        "prefix_state_memory_fraction",
    )
    prefix_state_memory_fraction: float = setting(
        0.1,
        help="without prefix_state_rows, the most of the cache's memory (KV blocks and saved "
        "states together) that saved layer states take: a state for every "
        "prefix_checkpoint_blocks blocks the KV pool holds, within this share, and never fewer "
        "than two per running sequence; on a GPU the KV pool gets the rest",
    )
    prefix_checkpoint_blocks: int = setting(
        16,
        help="on models with linear-attention or sliding-window layers, a prompt's prefill also "
        "saves their states every this many KV blocks (and where it parts from a cached "
        "prompt), so a prompt sharing only its beginning with another resumes near where they "
        "part; each save takes a saved-state row (prefix_state_rows); 0: only at the prompt's "
        "last full block",
    )
    encoder_cache_gib: float = setting(
        0.5,
        help="with prefix caching, GiB of media tower outputs kept by the content they "
        "encoded, so media seen again skip the towers; 0: none",
    )
    dtype: str = setting("auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on CUDA")
    device: str = setting("auto", choices=DEVICES, help="auto: CUDA when a GPU is visible")
    num_cpus_per_rank: float = setting(
        1.0, help="CPUs Ray reserves for each tensor-parallel follower actor"
    )
    decode_graphs: str = setting(
        "auto",
        choices=GRAPH_MODES,
        help="CUDA graphs of the decode step: auto captures them on CUDA; static runs the "
        "graphs' padded step eagerly (tests on CPU); see areno/engine/runner/cuda_graphs.py",
    )
    decode_compile: str = setting(
        "auto",
        choices=COMPILE_MODES,
        help="torch.compile backend of the decode step: auto is inductor where decode graphs "
        "are captured and off elsewhere; aot_eager traces without generating kernels; a "
        "compile error logs a warning and the step runs uncompiled (docs/performance.md)",
    )
    prefill_compile: str = setting(
        "auto",
        choices=COMPILE_MODES,
        help="torch.compile backend of the text stack when prompts without media share a "
        "prefill forward: auto is the decode step's, off under tensor parallelism",
    )
    cpu_packed_linear: bool = setting(
        True,
        help="on CPU in float32 without tensor parallelism, run the linear layers through "
        "oneDNN with prepacked weights (areno/engine/layers/cpu_linear.py)",
    )
    overlap_steps: str = setting(
        "auto",
        choices=ON_OFF_MODES,
        help="launch each engine step before reading the previous one's tokens, so the host's "
        "bookkeeping runs while the device computes: auto is on on CUDA with tp_size 1 (on "
        "needs tp_size 1)",
    )
    fuse_projections: str = setting(
        "auto",
        choices=ON_OFF_MODES,
        help="run each layer's sibling projections (q/k/v, gate/up) as one matmul over a fused "
        "weight: auto is on on CUDA with tp_size 1 (areno/engine/layers/fused_linear.py)",
    )
    one_row_gemv: str = setting(
        "auto",
        choices=ON_OFF_MODES,
        help="run a linear layer's product of one row (a decode step of one sequence, a lone "
        "prompt's logits) through a matrix-vector Triton kernel instead of cuBLAS: auto is on "
        "on CUDA (areno/engine/kernels/gemv.py)",
    )
    pad_lone_prefills: str = setting(
        "auto",
        choices=ON_OFF_MODES,
        help="where prefills are compiled, a lone prompt without media (or a lone part of one) "
        "of up to half of max_num_batched_tokens prefills beside a copy of itself, and a "
        "longer one uncompiled, so that no graph of a batch of one is compiled (a shorter "
        "first start); auto is on on CUDA, where a lone prompt leaves most of the device idle "
        "(on CPU the copy doubles the prompt's compute)",
    )
    whole_prompts_as_parts: str = setting(
        "auto",
        choices=ON_OFF_MODES,
        help="where prefills are compiled and parts of prompts share forwards, whole prompts "
        "without media prefill through the forward of parts (from their first token) rather "
        "than a batched prefill graph of their own: one graph fewer to compile (a shorter "
        "first start), their attention over their blocks with a mask rather than causal; "
        "auto is on on CUDA",
    )
    max_loras: int = setting(
        0,
        help="LoRA adapters the engine holds beside its base weights (serving raises it to the "
        "number of --lora adapters); 0: no low-rank path runs; needs tp_size 1",
    )
    max_lora_rank: int = setting(16, help="the largest LoRA rank the engine takes")
    stream_interval_ms: float = setting(
        10.0,
        help="a streamed request's new tokens are handed to its caller at most this often "
        "(its first token and its end at once): each hand-off is a message through the "
        "server's hops, which cost host time beside the engine's (docs/performance.md); 0: "
        "every step's",
    )
    linear_state_dtype: str = setting(
        "float32",
        choices=LINEAR_STATE_DTYPES,
        help="stored dtype of linear-attention (Qwen3.5) recurrent states; bfloat16 halves "
        "their bytes per decode step (computed in fp32 either way; docs/performance.md)",
    )

    # A config's old names for settings, each refused with the new one (`from_dict`).
    RENAMED: ClassVar[dict[str, str]] = {"max_prefill_tokens_per_step": "max_num_batched_tokens"}

    @classmethod
    def from_dict(
        cls, raw: Any, where: str = "engine", base: EngineConfig | None = None
    ) -> EngineConfig:
        """An EngineConfig from a mapping (YAML, JSON), over `base`'s settings where given;
        an unknown or renamed key is an error that names it."""
        return build(cls, raw, where, cls.RENAMED, base)

    def __post_init__(self) -> None:
        names = ("tp_size", "max_running_prompts", "max_num_batched_tokens", "block_size")
        checkpoints = self.prefix_checkpoint_blocks
        if isinstance(checkpoints, bool) or not isinstance(checkpoints, int) or checkpoints < 0:
            raise ConfigError(
                f"prefix_checkpoint_blocks must be an integer >= 0; got {checkpoints!r}",
                param="prefix_checkpoint_blocks",
            )
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
        share = self.prefix_state_memory_fraction
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share < 1:
            raise ConfigError(
                f"prefix_state_memory_fraction must be a number in [0, 1); got {share!r}",
                param="prefix_state_memory_fraction",
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
        interval = self.stream_interval_ms
        if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0:
            raise ConfigError(
                f"stream_interval_ms must be a number >= 0; got {interval!r}",
                param="stream_interval_ms",
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
        for name in ("decode_graphs", "decode_compile", "prefill_compile"):
            if getattr(self, name) is False:  # YAML reads a bare off as false
                object.__setattr__(self, name, "off")
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
        for name in (
            "overlap_steps",
            "fuse_projections",
            "one_row_gemv",
            "pad_lone_prefills",
            "whole_prompts_as_parts",
        ):
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


def pool_options(config: EngineConfig) -> KVPoolOptions:
    """How the engine's KV block pool is sized (areno/engine/parallel/kv_pool.py)."""
    return KVPoolOptions(
        block_size=config.block_size,
        kv_cache_gib=config.kv_cache_gib,
        memory_fraction=config.kv_cache_memory_fraction,
        profile_tokens=config.max_num_batched_tokens,
        size_state_rows=config.enable_prefix_caching and config.prefix_state_rows is None,
        state_memory_fraction=config.prefix_state_memory_fraction,
        checkpoint_blocks=config.prefix_checkpoint_blocks,
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
