"""vLLM's prefill/decode instance as an encoder-cache consumer, in one process, on CPU.

Runs under the vLLM venv's python (imported by ``vllm_consumer.py``). Every step a PD takes
on an encoder-cache request is vLLM's own code: the chat body is parsed by its
``ChatCompletionRequest`` and rendered by its renderer and ``InputProcessor`` (which turn the
``image_embeds`` items into multimodal features and their identifiers); the request then goes
through its ``Scheduler``, which asks the EC connector (``has_cache_item``,
``ensure_cache_available``, ``update_state_after_alloc``, ``build_connector_meta``), and the
scheduler's output goes through the model runner's EC hook
(``ECConnectorModelRunnerMixin``: ``start_load_caches`` into the worker's encoder cache).

What is not vLLM's: there is no model forward (no weights are loaded; the step's output
carries only the connectors' worker metadata), the KV cache is a small hand-made config,
and a TP-sharded consumer is several worker-side connectors in this one process, each told
its rank (vLLM learns it from its TP group, which needs ``torch.distributed``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.renderers import renderer_from_config
from vllm.renderers.params import ChatParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

CONNECTORS = {"example": "ECExampleConnector", "mooncake": "ECMooncakeConnector"}
#: KV blocks of the hand-made KV cache (the model runner would size it from memory).
NUM_BLOCKS = 256
BLOCK_SIZE = 16
#: The consumer's receive arena for Mooncake pushes (vLLM's default is 1e9 bytes).
EC_BUFFER_BYTES = 64 * 1024 * 1024


@dataclass
class ConsumerSettings:
    """One PD: the model folder (config and tokenizer), the connector and its settings."""

    model: Path
    connector: str
    dtype: str = "bfloat16"
    storage_path: Path | None = None
    ec_port: int = 0
    shards: int = 1
    push_wait_timeout_s: float = 60.0
    control_timeout_s: float = 5.0


@dataclass
class Outcome:
    """What became of one PD request."""

    scheduled: bool
    #: identifier -> the encoder-cache tensor of each shard's worker.
    caches: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: identifiers the scheduler still handed to the local encoder (none expected).
    local_encodes: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    waited_s: float = 0.0


def vllm_config(settings: ConsumerSettings) -> VllmConfig:
    extra: dict[str, Any] = {}
    transfer: dict[str, Any] = {}
    if settings.connector == "example":
        extra["shared_storage_path"] = str(settings.storage_path)
    else:
        transfer = {
            "ec_ip": "127.0.0.1",
            "ec_port": settings.ec_port,
            "ec_buffer_size": EC_BUFFER_BYTES,
            # No CUDA here: the receive arena lives in host memory.
            "ec_buffer_device": "cpu",
        }
        extra = {
            "mooncake_protocol": "tcp",
            "control_timeout_s": settings.control_timeout_s,
            "push_wait_timeout_s": settings.push_wait_timeout_s,
        }
    ec = ECTransferConfig(
        ec_connector=CONNECTORS[settings.connector],
        ec_role="ec_consumer",
        ec_connector_extra_config=extra,
        **transfer,
    )
    args = EngineArgs(
        model=str(settings.model),
        dtype=settings.dtype,
        ec_transfer_config=ec,
        max_model_len=4096,
        num_gpu_blocks_override=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        skip_mm_profiling=True,
    )
    return args.create_engine_config()


class ConsumerPD:
    """A vLLM PD reduced to the parts an encoder-cache request passes through.

    Blocking calls throughout (vLLM's engine core is synchronous); ``close`` shuts the
    connectors down (for Mooncake: its control servers and registered arenas).
    """

    def __init__(self, settings: ConsumerSettings) -> None:
        self.settings = settings
        self.config = config = vllm_config(settings)
        self.renderer = renderer_from_config(config)
        self.inputs = InputProcessor(config, self.renderer)
        group = KVCacheGroupSpec(
            ["layer"],
            FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
            ),
        )
        kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[group])
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
        )
        self.workers = [self._worker(rank) for rank in range(settings.shards)]
        #: Each worker's encoder cache, as the model runner keeps it (identifier -> tensor).
        self.encoder_caches: list[dict[str, torch.Tensor]] = [{} for _ in self.workers]
        self._count = 0

    def _worker(self, rank: int) -> ECConnectorBase:
        connector = ECConnectorFactory.create_connector(self.config, ECConnectorRole.WORKER)
        inner = getattr(connector, "_worker", None)
        if inner is not None and self.settings.shards > 1:
            # vLLM reads rank and size from its TP group (torch.distributed); one process
            # holding every shard sets them as that lookup would.
            inner._consumer_rank_resolved = True
            inner._tp_rank = rank
            inner._tp_size = self.settings.shards
        # What the model runner does once the model is resident.
        connector.start_worker_services()
        return connector

    @property
    def consumer_zmq(self) -> str:
        """TP rank 0's control address, the one the proxy names to encoders."""
        return f"tcp://127.0.0.1:{self.settings.ec_port}"

    def submit(self, body: dict[str, Any]) -> Request:
        """Admit a chat body as the PD's API server and engine core do (no checkpoint)."""
        chat = ChatCompletionRequest.model_validate(body)
        params = chat.to_sampling_params(max_tokens=1, default_sampling_params={})
        _conversations, (engine_input,) = self.renderer.render_chat([chat.messages], ChatParams())
        self._count += 1
        core = self.inputs.process_inputs(
            f"pd-{self._count}", engine_input, params, supported_tasks=("generate",)
        )
        request = Request.from_engine_core_request(core, block_hasher=None)
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """One engine step without a forward: schedule, run each worker's EC hook, feed
        the connectors' worker metadata back. Returns the scheduler's output."""
        output = self.scheduler.schedule()
        meta = None
        ec_output = None
        for worker, cache in zip(self.workers, self.encoder_caches, strict=True):
            ec_transfer_state._EC_CONNECTOR_AGENT = worker
            try:
                with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(
                    output, cache
                ) as ec_output:
                    pass
            finally:
                ec_transfer_state._EC_CONNECTOR_AGENT = None
            assert ec_output is not None
            part = ec_output.ec_connector_worker_meta
            if part is not None:
                meta = part if meta is None else meta.aggregate(part)
            # The model runner frees what the scheduler freed this step.
            for mm_hash in output.free_encoder_mm_hashes:
                cache.pop(mm_hash, None)
        ec_output.ec_connector_worker_meta = meta
        # Scheduled requests get no token: as a prefill chunk that samples nothing.
        ids = list(output.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={req_id: index for index, req_id in enumerate(ids)},
            sampled_token_ids=[[] for _ in ids],
            ec_connector_output=ec_output,
        )
        self.scheduler.update_from_output(output, runner_output)
        return output

    def run(self, request: Request, deadline_s: float) -> Outcome:
        """Step until ``request`` is scheduled or finished, or ``deadline_s`` passes."""
        started = time.monotonic()
        local: list[str] = []
        while time.monotonic() - started < deadline_s:
            output = self.step()
            ids = [f.identifier for f in request.mm_features]
            local += [ids[i] for i in output.scheduled_encoder_inputs.get(request.request_id, [])]
            scheduled = any(r.req_id == request.request_id for r in output.scheduled_new_reqs)
            if scheduled:
                caches = {
                    ident: [cache[ident] for cache in self.encoder_caches if ident in cache]
                    for ident in ids
                }
                return Outcome(True, caches, local, None, time.monotonic() - started)
            if request.is_finished():
                reason = request.get_finished_reason()
                return Outcome(False, {}, local, str(reason), time.monotonic() - started)
            time.sleep(0.005)  # the engine core's busy loop, slowed for two cores
        return Outcome(False, {}, local, "deadline", time.monotonic() - started)

    def finish(self, request: Request) -> None:
        """Abort as the API server does when done; a few steps let the frees go out."""
        self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        for _ in range(3):
            self.step()

    def reservations(self) -> int:
        """Active Mooncake reservations over all shards (0 for Example)."""
        count = 0
        for worker in self.workers:
            inner = getattr(worker, "_worker", None)
            if inner is not None:
                count += len(inner._reservations._active_ids)
        return count

    def reservation_states(self) -> list[str]:
        """The states of the active Mooncake reservations over all shards."""
        states = []
        for worker in self.workers:
            inner = getattr(worker, "_worker", None)
            if inner is not None:
                manager = inner._reservations
                with manager._memory.lock:
                    states += [manager._records[t].state.name for t in manager._active_ids]
        return states

    def arena_in_use(self) -> int:
        """Bytes of the Mooncake receive arenas not free, over all shards (0 for Example):
        reservations, and tensors still held (or kept resident) for the encoder cache."""
        used = 0
        for worker in self.workers:
            inner = getattr(worker, "_worker", None)
            if inner is None:
                continue
            allocator = inner._consumer_memory._allocator
            used += allocator._capacity - sum(size for _, size in allocator._free)
        return used

    def close(self) -> None:
        self.scheduler.shutdown()
        for worker in self.workers:
            worker.shutdown()
