"""The ingress deployment: validates and routes HTTP requests to the model deployments through
their handles. It imports no engine and no tensor library (tests/test_layering.py checks it): a
process that only routes HTTP stays small."""

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from service.api.app import ROUTERS, create_api
from service.api.backend import Backends, ModelLoad, model_of_path
from service.config import ModelServingConfig, ServiceConfig
from service.metrics import request_failure_counter, request_retry_counter
from service.process import lower_priority, process_stats
from service.protocol import (
    AttentionMap,
    AttentionRequest,
    Chunk,
    GenerateRequest,
    Refusal,
    ReplicaLostError,
    TokenizeRequest,
    TokenizerInfo,
    Tokens,
)

READY_TIMEOUT_S = 2.0
log = logging.getLogger("ray.serve")


def replica_lost(error: BaseException) -> bool:
    """Ray's word that the replica a request went to died or cannot be reached (its process or its
    node is gone): the request may not have finished, and another replica can take it."""
    return isinstance(error, (RayActorError, ReplicaUnavailableError)) or isinstance(error.__cause__, RayActorError)


@dataclass(frozen=True)
class RetryPolicy:
    """How a request whose replica is lost before any of its answer has gone out is sent again."""

    max_tries: int = 3  # sends in all, the first included
    deadline_s: float = 30.0  # from the first send: no new try after it


async def _each(items: AsyncIterable[Chunk | Refusal] | list[Chunk | Refusal]) -> AsyncGenerator[Chunk | Refusal, None]:
    """The items of a replica's stream, or of a list read from one, as one async iteration."""
    if isinstance(items, list):
        for item in items:
            yield item
    else:
        async for item in items:
            yield item


class RayBackend:
    """A model deployment reached through its DeploymentHandle, streaming."""

    def __init__(
        self,
        handle: DeploymentHandle[Any],
        load: ModelLoad,
        retry_after_s: float,
        on_failure: Callable[[str], None],
        on_retry: Callable[[str], None] = lambda outcome: None,
        retries: RetryPolicy = RetryPolicy(),
    ) -> None:
        """load: the model's load as this ingress sees it (Backends.load), kept here: requests in
        flight, and a refusal by Serve's queue marked for retry_after_s. on_failure(reason) counts
        what no replica counted: the refusals made here or by Serve ("overloaded"; "unavailable"
        when no replica is up, the tries ran out, or a stream's replica was lost after it began),
        and a stream that broke for another reason ("internal"). on_retry(outcome) counts what became of requests whose replica was lost
        (service/metrics.py RETRY_OUTCOMES)."""
        self.handle, self.load, self.retry_after_s, self.on_failure = handle, load, retry_after_s, on_failure
        self.on_retry, self.retries = on_retry, retries
        self.streaming = handle.options(stream=True)  # made once: options() builds a new handle

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        """The replica's stream. A full model (ModelLoad.full) is refused here without a trip to
        Serve; Serve's own refusals before any item (its queue for the model is full, or no
        replica is up) become protocol Refusals too.

        A replica lost before anything of the answer has been yielded (for a request that is not
        streamed: before it finished, since its answer is yielded whole) is retried on another
        replica, within `retries`; a sampled request without a seed gets one first, so that a
        retry samples the same text. Past the tries: a Refusal("unavailable"). A replica lost
        after the stream began: ReplicaLostError."""
        if self.load.full():  # a request past the admission middleware, e.g. a long text's next sentence
            self.on_failure("overloaded")
            yield Refusal("overloaded", "the model's queue is full; retry later")
            return
        if not request.sampling.greedy and request.sampling.seed is None:
            request = request.seeded(secrets.randbits(63))
        deadline = time.monotonic() + self.retries.deadline_s
        self.load.in_flight += 1
        try:
            for attempt in range(1, self.retries.max_tries + 1):
                response: Any = None
                began = False
                try:
                    response = self.streaming.generate.remote(request)  # may refuse at once
                    # Not streamed: nothing goes out before the end, so the whole answer is read first.
                    items = response if request.stream else [item async for item in response]
                    async for item in _each(items):
                        began = True
                        if isinstance(item, Chunk) and item.finish_reason is not None:  # the reader may stop here
                            self.load.refused_until = 0.0  # one finished: there is room again
                            if attempt > 1:
                                self.on_retry("answered")
                        yield item
                    return
                except BackPressureError:
                    response = None  # never assigned: nothing to cancel (cancel() would raise it again)
                    self.load.refused_until = time.monotonic() + self.retry_after_s
                    self.on_failure("overloaded")
                    yield Refusal("overloaded", "the model's queue is full; retry later")
                    return
                except DeploymentUnavailableError:
                    response = None
                    self.on_failure("unavailable")
                    yield Refusal("unavailable", "no replica of the model is available; retry later")
                    return
                except Exception as error:
                    if not replica_lost(error):
                        self.on_failure("internal")  # the client sees the response cut; the metric says why
                        raise
                    if began:
                        self.on_retry("cut")
                        self.on_failure("unavailable")
                        raise ReplicaLostError("the model's replica was lost during the answer; retry the request") from error
                    if attempt == self.retries.max_tries or time.monotonic() > deadline:
                        break
                    self.on_retry("retried")
                    log.warning("replica lost before answering (%s); sending the request again", type(error).__name__)
                finally:
                    if response is not None:
                        response.cancel()  # a no-op once finished; stops the replica's work if the client left
            self.on_retry("unavailable")
            self.on_failure("unavailable")
            yield Refusal("unavailable", "the model's replicas were lost before answering; retry later")
        finally:
            self.load.in_flight -= 1

    async def attention(self, request: AttentionRequest) -> AttentionMap | Refusal:
        result: AttentionMap | Refusal = await self.handle.attention.remote(request)
        return result

    async def tokenize(self, request: TokenizeRequest) -> Tokens | Refusal:
        result: Tokens | Refusal = await self.handle.tokenize.remote(request)
        return result

    async def detokenize(self, ids: tuple[int, ...]) -> str | Refusal:
        result: str | Refusal = await self.handle.detokenize.remote(ids)
        return result

    async def tokenizer_info(self) -> TokenizerInfo:
        result: TokenizerInfo = await self.handle.tokenizer_info.remote()
        return result

    async def ready(self) -> bool:
        return bool(await asyncio.wait_for(self.handle.ready.remote(), READY_TIMEOUT_S))


@serve.deployment  # its options: service/app.py build_app
@serve.ingress()
class Ingress:
    """Validates and routes HTTP requests; holds only handles to the model deployments."""

    def __init__(self, config: ServiceConfig, handles: dict[str, DeploymentHandle[Any]]) -> None:
        """handles: each model's deployment, by model name."""
        lower_priority(config.ingress_niceness)  # below the engines' processes
        self.failures = request_failure_counter()
        self.retries = request_retry_counter()
        self.config = config
        self.model_of_path = model_of_path(ROUTERS)

        def backend(handle: DeploymentHandle[Any], model: ModelServingConfig) -> RayBackend:
            def failed(reason: str) -> None:
                self.failures.inc(1, tags={"model": model.name, "reason": reason})

            def retried(outcome: str) -> None:
                self.retries.inc(1, tags={"model": model.name, "outcome": outcome})

            retries = RetryPolicy(config.lost_replica_tries, config.lost_replica_deadline_s)
            return RayBackend(handle, ModelLoad(model.max_requests_held), config.retry_after_seconds, failed, retried, retries)

        models = {m.name: backend(handles[m.name], m) for m in config.models}
        backends = Backends(dict(models), {name: b.load for name, b in models.items()})
        # Serve's logger: the access lines land in this replica's log file with Serve's request context.
        self.api = create_api(config, backends, self.count_failure, logging.getLogger("ray.serve"))
        # FastAPI builds the schema on the first /openapi.json, in the event loop every stream shares
        # (about a second on a 2-core machine): built here, before the replica takes traffic.
        self.api.openapi()

    def count_failure(self, path: str, reason: str) -> None:
        """Requests refused by the ingress itself (validation, keys, admission), before a model was
        chosen: under the route's kind of model (MODEL_EXTENSION) when one model of that kind is
        served, its name; else the kind; "none" for a route that reaches no model."""
        kind = self.model_of_path.get(path)
        models = self.config.models_of(kind) if kind in ("translator", "generator") else []  # type: ignore[arg-type]
        model = models[0].name if len(models) == 1 else (kind or "none")
        self.failures.inc(1, tags={"model": model, "reason": reason})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.api

    async def stats(self) -> dict[str, int]:
        """This replica's process: memory, descriptors, asyncio tasks (for soak tests)."""
        return process_stats()
