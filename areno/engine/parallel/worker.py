"""The worker: one rank's tensor work. It owns the model, the runner and the sampler.

The engine sends one `StepInput` per step and gets one `StepOutput` back (host lists, copied
once). Under tensor parallelism every rank runs the same forward; only the rank that reports to
the engine samples (`Worker(sample=True)`), the others just follow.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from areno.engine.config import EngineConfig, KVPoolOptions, pool_options
from areno.engine.layers.lora import LoraError, LoraWeights
from areno.engine.outputs import TokenScores
from areno.engine.parallel.kv_pool import (
    KVPool,
    agree_across_ranks,
    block_bytes,
    fraction_budget,
    reserved_bytes,
    saved_state_rows,
)
from areno.engine.runner.model_runner import ModelRunner
from areno.engine.runner.prefills import run_prefills
from areno.engine.sample.penalties import TokenHistory
from areno.engine.sample.sampler import (
    SamplingTensors,
    StepLogits,
    row_keys,
    sample,
)
from areno.engine.sampling import SamplingParams
from areno.engine.step import PendingStep, StepInput, StepOutput
from areno.engine.transfer import to_device
from areno.errors import ArenoError
from areno.processing.types import PromptInputs


class WeightUpdateError(ArenoError):
    """New weights do not fit the loaded model (unknown name, wrong shape)."""

    code = "weight_update_mismatch"


@dataclass(frozen=True)
class CompiledPaths:
    """The compiled forwards a worker runs: batched prefills, prefills of parts of prompts
    (resumptions from the prefix cache, chunks, the rounds a state save splits a prefill into),
    and the decode graphs' row buckets (None: decodes are not compiled); the pool's block count
    for their tables."""

    batched_prefill: bool
    decode_buckets: list[int] | None
    num_blocks: int
    prefill_parts: bool = False
    # A lone prompt (part) runs beside a copy of itself (ModelRunner's `pad_lone_tokens`): no
    # graph of a batch of one.
    lone_padded: bool = False


class Worker:
    """Runs steps for one model replica shard; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_slots: int,
        max_len: int,
        sample: bool,
        pool: KVPoolOptions | None = None,
        num_blocks: int | None = None,
        tensor_parallel: bool = False,
        graphs: str = "auto",
        compile: str = "auto",
        prefill_compile: str = "auto",
        packed_linear: bool = False,
        fuse_projections: str = "off",
        one_row_gemv: str = "off",
        pad_lone_prefills: str = "off",
        whole_prompts_as_parts: str = "off",
        state_rows: int = 0,
        encoder_cache_bytes: int = 0,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        linear_state_dtype: torch.dtype | None = None,
    ):
        """`pool`: how the KV block pool is sized (areno/engine/parallel/kv_pool.py); `num_blocks` sets
        its size directly (None: every slot `max_len` tokens). `packed_linear`: on CPU in
        float32, linear layers run on prepacked oneDNN weights
        (areno/engine/layers/cpu_linear.py); not under tensor parallelism, whose shards are DTensors.
        `prefill_compile` "auto" compiles batched prefills as the decode step is compiled, but
        not under tensor parallelism (not yet run there on a GPU). `fuse_projections` "auto"
        fuses on CUDA without tensor parallelism, whose shards cannot be concatenated.
        `one_row_gemv` "auto": on CUDA, products of one row on the matrix-vector kernel.
        `pad_lone_prefills` "auto": on CUDA, a lone prompt of up to half the pool's profiled
        prompt tokens prefills beside a copy of itself (ModelRunner's `pad_lone_tokens`).
        `whole_prompts_as_parts` "auto": on CUDA, whole prompts without media prefill through
        the compiled forward of parts (`whole_as_parts`). `state_rows`, `encoder_cache_bytes`:
        saved slot states and media tower outputs for the prefix cache (ModelRunner's). `max_loras`, `max_lora_rank`: LoRA adapter slots
        (areno/engine/layers/lora.py). `linear_state_dtype`: the stored dtype of linear-attention
        recurrent states (None: fp32)."""
        if prefill_compile == "auto" and tensor_parallel:
            prefill_compile = "off"
        on_cuda = next(model.parameters()).device.type == "cuda"
        if fuse_projections == "auto":
            fuse_projections = "on" if on_cuda and not tensor_parallel else "off"
        if one_row_gemv == "auto":
            one_row_gemv = "on" if on_cuda else "off"
        if pad_lone_prefills == "auto":
            pad_lone_prefills = "on" if on_cuda else "off"
        if whole_prompts_as_parts == "auto":
            whole_prompts_as_parts = "on" if on_cuda else "off"
        self.runner = ModelRunner(
            model,
            num_slots=num_slots,
            max_len=max_len,
            num_blocks=num_blocks,
            block_size=(pool or KVPoolOptions()).block_size,
            graphs=graphs,
            compile=compile,
            prefill_compile=prefill_compile,
            packed_linear=packed_linear and not tensor_parallel,
            fuse_projections=fuse_projections == "on",
            one_row_gemv=one_row_gemv == "on",
            state_rows=state_rows,
            encoder_cache_bytes=encoder_cache_bytes,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            linear_state_dtype=linear_state_dtype,
            # Up to half the prompt tokens whose activations the pool leaves room for.
            pad_lone_tokens=(pool or KVPoolOptions()).profile_tokens // 2
            if pad_lone_prefills == "on"
            else 0,
        )
        # The adapter of requests that name none: an RL weight sync's policy adapter, or None
        # (the base model).
        self.default_adapter: str | None = None
        self.samples = sample
        self.tensor_parallel = tensor_parallel
        # Parts of prompts (resumptions from the prefix cache, chunks) share forwards; not under
        # tensor parallelism (its sharded linear-attention path continues one row's state, and
        # shared parts have not run there yet). A benchmark's baseline clears it.
        self.shares_part_prefills = self.runner.can_prefill_parts and not tensor_parallel
        self._whole_as_parts = whole_prompts_as_parts == "on"
        if pool is not None and num_blocks is None:
            self._size_pool(pool)
        runner = self.runner
        self.pool = KVPool(
            runner.num_blocks,
            runner.block_size,
            block_bytes(runner.model, runner.layer_types, runner.block_size),
        )
        self._history = TokenHistory(num_slots, self.device)
        # The token last sampled into each slot, on the device (see `launch`).
        self._last_tokens = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        # The last step's rows' parameters (held, so their identities stay theirs) and tensors.
        self._last_sampling: tuple[list[SamplingParams], SamplingTensors] | None = None
        banned = media_placeholder_ids(model.config)
        self._banned_ids = (
            torch.tensor(banned, dtype=torch.long, device=self.device) if banned else None
        )

    @classmethod
    def from_config(
        cls,
        model: torch.nn.Module,
        config: EngineConfig,
        *,
        max_len: int,
        sample: bool = True,
        tensor_parallel: bool = False,
    ) -> Worker:
        """The worker an engine of `config` runs on every rank: the one place that turns the
        config into worker options, so no rank drops one."""
        return cls(
            model,
            num_slots=config.max_running_prompts,
            max_len=max_len,
            sample=sample,
            pool=pool_options(config),
            tensor_parallel=tensor_parallel,
            graphs=config.decode_graphs,
            compile=config.decode_compile,
            prefill_compile=config.prefill_compile,
            packed_linear=config.cpu_packed_linear,
            fuse_projections=config.fuse_projections,
            one_row_gemv=config.one_row_gemv,
            pad_lone_prefills=config.pad_lone_prefills,
            whole_prompts_as_parts=config.whole_prompts_as_parts,
            state_rows=_state_rows(config),
            encoder_cache_bytes=int(config.encoder_cache_gib * (1 << 30))
            if config.enable_prefix_caching
            else 0,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            linear_state_dtype=getattr(torch, config.linear_state_dtype),
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def vocab_size(self) -> int:
        """The width of the logits the sampler draws from."""
        return self.runner.text_config.vocab_size

    def _size_pool(self, options: KVPoolOptions) -> None:
        """Resize the runner's pool as `options` ask: `kv_cache_gib`, else on CUDA the memory
        fraction, else (CPU) keep every slot's `max_len` tokens; and where its layers keep state
        besides keys, its saved-state rows by bytes (`saved_state_rows`), which a measured pool
        leaves out of the blocks' share."""
        runner = self.runner
        per_block = block_bytes(runner.model, runner.layer_types, runner.block_size)
        measured = False
        row_bytes = 0
        if options.kv_cache_gib is not None:
            cache_bytes = int(options.kv_cache_gib * (1 << 30))
        elif self.device.type == "cuda":
            measured = True
            # What an earlier engine of this process freed goes back to the device first: the
            # budget counts it, and the pool's tensors are larger than its blocks. Its runner,
            # graphs and pool sit in reference cycles (unfrozen once the last engine shut
            # down, gc_freeze.py) that only a collection frees.
            gc.collect()
            torch.cuda.empty_cache()
            tokens = min(options.profile_tokens, runner.max_len)
            activation, row_bytes = runner.measure_prefill_memory(tokens)
            reserved = self.reserved_bytes(activation, row_bytes * runner.num_slots)
            cache_bytes = fraction_budget(
                self.device, options.memory_fraction, sum(reserved.values())
            )
        else:
            cache_bytes = runner.num_blocks * per_block
        state_rows = runner.num_state_rows
        if options.size_state_rows and state_rows:
            state_rows = saved_state_rows(
                cache_bytes,
                block_bytes=per_block,
                row_bytes=row_bytes or runner.measure_state_bytes(),
                fraction=options.state_memory_fraction,
                checkpoint_blocks=options.checkpoint_blocks or runner.max_blocks,
                num_slots=runner.num_slots,
            )
        if measured:
            cache_bytes -= state_rows * row_bytes
        num_blocks = max(cache_bytes // per_block, 1)
        if self.tensor_parallel:
            num_blocks = agree_across_ranks(num_blocks, self.device)
            state_rows = agree_across_ranks(state_rows, self.device)
        if (num_blocks, state_rows) != (runner.num_blocks, runner.num_state_rows) or measured:
            runner.num_state_rows = state_rows
            runner.reset_pool(num_blocks, measured=measured)

    def reserved_bytes(self, activation: int, states: int) -> dict[str, int]:
        """What the engine uses besides its weights and its KV pool (`kv_pool.reserved_bytes`),
        given a prefill's measured activation peak and the running sequences' state bytes."""
        return reserved_bytes(
            activation=activation,
            states=states,
            encoder_cache=self.runner.encoders.max_bytes,
            num_slots=self.runner.num_slots,
            vocab_size=self.vocab_size,
        )

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def release_cache(self) -> None:
        """Let the KV pool, the decode graphs and the LoRA layers go (the engine is shutting
        down): a pool sized to most of a GPU must not outlive its engine until a garbage
        collection finds it."""
        self.release_graphs()
        self.runner.release_cache()
        if self.runner.lora is not None:  # the model may serve another engine next
            self.runner.lora.release()

    def release_graphs(self) -> None:
        """Drop captured decode graphs (before leaving a TP group; see DecodeGraphs.release)."""
        if self.runner.graphs is not None:
            self.runner.graphs.release()

    def execute(self, step: StepInput) -> StepOutput | None:
        """Run the step's forwards and (on the sampling rank) sample one token per row."""
        pending = self.launch(step)
        return pending.result() if pending is not None else None

    def launch(self, step: StepInput) -> PendingStep | None:
        """`execute` without waiting: the forwards and sampling are queued on the device and the
        sampled tokens start their copy to the host (None on a following rank). Each row's
        token also stays on the device in its slot, for a next step launched before this one's
        result is read (`StepInput.decode_token_ids` None)."""
        if step.state_saves:  # before the decode, which may scribble on idle slots
            self.runner.save_states(step.state_saves)
        # NOTE: decode before prefill: a graphed decode may scribble on slots that are not
        # decoding (see areno/engine/runner/cuda_graphs.py), which the prefill then overwrites.
        decoded = []
        if step.decode_slots:
            token_ids = step.decode_token_ids
            if token_ids is None:
                assert self.samples, "only the sampling worker keeps the last tokens"
                token_ids = self._last_tokens
            decoded.append(
                self.runner.decode(
                    step.decode_slots, step.decode_positions, token_ids, step.decode_block_tables
                )
            )
        for item in step.prefill:
            self.runner.assign_adapter(item.slots, self.adapter_index(item.adapter))
        prefilled = run_prefills(
            self.runner,
            step.prefill,
            share_parts=self.shares_part_prefills,
            whole_as_parts=self.whole_as_parts,
        )
        logits = prefilled + decoded
        if not self.samples or not logits:
            return None
        logits_BV = logits[0] if len(logits) == 1 else torch.cat(logits)
        row_slots = [s for item in step.prefill if item.is_final for s in item.slots]
        row_slots += step.decode_slots
        return self._sample(logits_BV, step, row_slots)

    def _sample(
        self, logits_BV: torch.Tensor, step: StepInput, row_slots: list[int]
    ) -> PendingStep:
        rows = step.rows
        params = [row.params for row in rows]
        tensors = self._sampling_tensors(params)
        keys_B = None
        if not tensors.all_greedy:
            keys_B = row_keys([row.seed for row in rows], [row.draw for row in rows], self.device)
        step_logits, penalised = self._step_logits(step, row_slots, logits_BV.shape[-1])
        out = sample(logits_BV, tensors, keys_B, self._banned_ids, step_logits)
        if penalised is not None:
            self._history.record(penalised[1], out.token_ids_B[penalised[0]])
        if row_slots == list(range(len(row_slots))):
            self._last_tokens[: len(row_slots)] = out.token_ids_B
        else:
            self._last_tokens[to_device(torch.tensor(row_slots), self.device)] = out.token_ids_B
        packed = out.packed()
        on_cuda = self.device.type == "cuda"
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=on_cuda)
        host.copy_(packed, non_blocking=on_cuda)
        copied = None
        if on_cuda:
            copied = torch.cuda.Event()
            copied.record()
        return PendingStep(host, copied, params)

    def _step_logits(
        self, step: StepInput, row_slots: list[int], vocab: int
    ) -> tuple[StepLogits | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The step's penalty counts, stop-token bans and grammar masks (None: no row has
        any), and the penalised rows with their slots."""
        rows = step.rows
        for row, slot in zip(rows, row_slots, strict=True):
            if row.history is not None:
                self._history.start(slot, *row.history, vocab)
        penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
        banned = [(i, t) for i, row in enumerate(rows) for t in row.banned]
        if not (penalised or banned or step.grammar_rows):
            return None, None
        device = self.device
        out = StepLogits()
        pairs = None
        if penalised:
            slots = [row_slots[i] for i in penalised]
            pairs = tuple(to_device(torch.tensor(v), device) for v in (penalised, slots))
            out.seen = self._history.gather(pairs[1])
        if banned:
            ban_rows, ban_ids = zip(*banned, strict=True)
            out.ban_rows_N = to_device(torch.tensor(ban_rows), device)
            out.ban_ids_N = to_device(torch.tensor(ban_ids), device)
        if step.grammar_rows:
            out.grammar_rows_G = to_device(torch.tensor(step.grammar_rows), device)
            out.bitmask_GW = to_device(step.token_bitmask[step.grammar_rows], device)
        return out, pairs

    def _sampling_tensors(self, params: list[SamplingParams]) -> SamplingTensors:
        """The rows' parameters as device tensors, rebuilt only when the rows changed: in a
        steady decode they are the same requests step after step, and building them costs six
        small host-to-device copies."""
        cached = self._last_sampling
        if (
            cached is not None
            and len(cached[0]) == len(params)
            and all(a is b for a, b in zip(cached[0], params, strict=True))
        ):
            return cached[1]
        tensors = SamplingTensors.from_params(params, self.device)
        self._last_sampling = (params, tensors)
        return tensors

    @property
    def whole_as_parts(self) -> bool:
        """Whether whole prompts without media prefill through the forward of parts (from
        their first token): where asked (`whole_prompts_as_parts`), parts share forwards and
        that forward is compiled, so that the batched prefill's graph is never compiled."""
        return self._whole_as_parts and self.shares_part_prefills and self.runner.parts_compiled

    def compiled_paths(self) -> CompiledPaths:
        """What the start-up steps must run once for their compiles (startup.py)."""
        runner, graphs = self.runner, self.runner.graphs
        compiled = graphs is not None and graphs.compiled
        return CompiledPaths(
            batched_prefill=runner.prefill_compiled and not self.whole_as_parts,
            decode_buckets=list(graphs.buckets) if compiled else None,
            num_blocks=runner.num_blocks,
            prefill_parts=runner.parts_compiled and self.shares_part_prefills,
            lone_padded=runner.pad_lone_tokens > 0,
        )

    def media_cache_stats(self) -> tuple[int, int, float]:
        """Media tower calls made and answered from the encoder cache, and the seconds the
        calls made took."""
        encoders = self.runner.encoders
        return encoders.num_misses, encoders.num_hits, encoders.encode_s

    @property
    def caches_prefixes(self) -> bool:
        """Whether a prompt may start from the prefix cache's blocks: every layer keeps only
        keys, or there are rows to save the other layers' states in."""
        return not self.runner.keeps_slot_state or self.runner.num_state_rows > 0

    @property
    def num_state_rows(self) -> int:
        return self.runner.num_state_rows

    def whole_runs(self, inputs: PromptInputs) -> list[tuple[int, int]]:
        """The token runs of a prompt that one prefill chunk must hold whole (ModelRunner's)."""
        return self.runner.whole_runs(inputs)

    def score(
        self, inputs: PromptInputs, adapter: str | None = None, num_top_logprobs: int = 0
    ) -> TokenScores | None:
        """Log-probabilities of tokens 1..N-1 of `inputs`, with the `num_top_logprobs` most
        likely tokens at each position when asked (None on a following rank)."""
        logprobs_N, top_logprobs_NK, top_ids_NK = self.runner.score(
            inputs, self.adapter_index(adapter), num_top_logprobs
        )
        if not self.samples:
            return None
        top = None
        if num_top_logprobs:
            pairs = zip(top_ids_NK.tolist(), top_logprobs_NK.tolist(), strict=True)
            top = [list(zip(ids, lps, strict=True)) for ids, lps in pairs]
        return TokenScores(logprobs_N.tolist(), top)

    def adapter_index(self, name: str | None) -> int:
        """The LoRA slot index of adapter `name` (None: the default adapter; 0: the base).
        Raises LoraError for an adapter that is not loaded."""
        name = name if name is not None else self.default_adapter
        if name is None:
            return 0
        if self.runner.lora is None:
            raise LoraError(
                f"adapter {name!r} was asked for, but this engine holds no LoRA adapters "
                "(start it with max_loras > 0)",
                param="model",
            )
        return self.runner.lora.index_of(name)

    def load_adapter(self, name: str, weights: LoraWeights, *, default: bool = False) -> int:
        """Load (or update in place) LoRA adapter `name`; `default`: requests that name no
        adapter run with it from then on. Returns the number of adapted layers."""
        if self.runner.lora is None:
            raise LoraError(
                f"adapter {name!r} cannot be loaded: this engine holds no LoRA adapters "
                "(start it with max_loras > 0)"
            )
        self.runner.lora.load(name, weights)
        if default:
            self.default_adapter = name
        return len(weights.factors)

    def check_weights(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        """Raise WeightUpdateError unless every (name, tensor) fits a parameter of the model."""
        params = dict(self.model.named_parameters())
        for name, tensor in updates:
            if name not in params:
                raise WeightUpdateError(f"the model has no parameter named {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise WeightUpdateError(
                    f"parameter {name!r} has shape {tuple(params[name].shape)} but the update "
                    f"has {tuple(tensor.shape)}"
                )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy `weights` (name, full tensor) into the model in place; returns how many.

        Names are the model's own `named_parameters()` names; a subset is fine (frozen towers
        need not be sent). Every name and shape is checked before anything is written, so a bad
        update leaves the model as it was. A tensor-parallel shard (a DTensor) takes its part of
        rank 0's tensor: every rank of the group calls this with the same names in the same order
        (the followers with empty tensors of the right shape).
        """
        params = dict(self.model.named_parameters())
        updates = list(weights)
        self.check_weights(updates)
        for name, tensor in updates:
            param = params[name]
            full = tensor.to(param.device, param.dtype)
            if isinstance(param, DTensor):
                shard = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=0
                )
                param.to_local().copy_(shard.to_local())
                continue
            if self.tensor_parallel:  # a parameter every rank holds whole (norms, media towers)
                dist.broadcast(full, src=0)
            param.copy_(full)
        if self.runner.linears is not None:
            self.runner.linears.repack(params[name] for name, _ in updates)
        self.runner.weights_changed([name for name, _ in updates])
        if self.device.type == "cuda" and any(t.is_cuda for _, t in updates):
            # NOTE: the copies above are only queued. A sender's device memory (CUDA IPC from a
            # trainer on this GPU) may change once this returns: its next optimizer step
            # updates its parameters in place.
            torch.cuda.current_stream(self.device).synchronize()
        return len(updates)


def media_placeholder_ids(config) -> list[int]:
    """The model's media placeholder token ids (image / video / audio), never to be sampled."""
    ids = set()
    for name in ("image_token_id", "video_token_id", "audio_token_id", "image_token_index"):
        for source in (config, getattr(config, "text_config", None)):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return sorted(ids)


def _state_rows(config: EngineConfig) -> int:
    """The saved slot states an engine of `config` keeps for its prefix cache."""
    if not config.enable_prefix_caching:
        return 0
    rows = config.prefix_state_rows
    # NOTE: without a count, two per running sequence until the pool is sized in bytes
    # (`Worker._size_pool`, `saved_state_rows`), where a worker is built without a pool.
    return 2 * config.max_running_prompts if rows is None else rows
