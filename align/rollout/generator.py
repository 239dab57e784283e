"""The generator of an asynchronous rollout source: a copy of the policy in its own process, placed by Ray.

:class:`Generator` is a plain class: :class:`~align.rollout.async_source.AsyncSource` runs it as a Ray actor
(:func:`start_generator`), one per training rank, and tests call it directly. It rebuilds the policy from the
settings a checkpoint records (``PolicyModel.spec``: model id or path, dtype, LoRA, quantization), takes the
trainable weights the trainer sends after each optimizer step (the whole model, or the LoRA adapter), and answers
prompt batches with the training engine (``sampling.engine``: the native decoder or vLLM). Calls run one at a time,
in the order they were sent, so a batch sent after weights is always generated with those weights.

Why Ray (docs/architecture.md, "Asynchronous rollouts"): actors are started, placed and supervised by an engine that
already runs across machines. On one machine the run starts a local Ray; with ``generator.address`` (or
``RAY_ADDRESS``) naming a cluster, the same configuration places the generators on its nodes, with
``generator.num_gpus`` and ``generator.num_cpus`` saying what each needs. The model must then be loadable on those
nodes (a hub id, or a path every node sees).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from align.errors import AlignConfigError, AlignError

__all__ = [
    "Generator",
    "GeneratorPlacement",
    "connect",
    "generator_error",
    "rng_state",
    "set_rng_state",
    "start_generator",
    "trainable_weights",
]


@dataclass
class GeneratorPlacement:
    """Where and how an asynchronous source's generators run (``model.source.init_args.generator``)."""

    address: str | None = None
    """Ray cluster to place the generators on (``ray://...``, ``host:port`` or ``auto``); null: ``RAY_ADDRESS`` when
    set, else a local Ray started by the run (shared by its ranks) and stopped with it."""
    num_cpus: float = 1.0
    """CPUs Ray reserves for each generator."""
    num_gpus: float | None = None
    """GPUs Ray reserves for each generator; null: 1 when CUDA is available to the trainer, else 0. A fraction
    (0.5) shares a GPU with other Ray work; the trainer's own processes are not Ray's and are not counted."""
    device: str = "auto"
    """The generator's device: ``auto`` (a GPU Ray gave it, else the CPU), ``cpu`` or ``cuda``."""
    threads: int | None = None
    """Torch threads of a generator on a CPU; null: the trainer's (the same kernels, so that ``max_staleness: 0``
    repeats the synchronous run)."""
    timeout_s: float = 600.0
    """Longest wait for a generator to start or to answer a batch before it is taken as hung and restarted."""
    max_restarts: int = 3
    """Generators that may die (or hang) in a run; each is replaced and its unfinished batches generated again, with
    the same weights and random streams. One more stops the run with an error."""

    def __post_init__(self):
        key = "model.source.generator"
        for name, ok, expected in (
            ("num_cpus", self.num_cpus >= 0, ">= 0"),
            ("num_gpus", self.num_gpus is None or self.num_gpus >= 0, ">= 0 or null"),
            ("device", self.device in ("auto", "cpu", "cuda"), "auto, cpu or cuda"),
            ("threads", self.threads is None or self.threads >= 1, ">= 1 or null"),
            ("timeout_s", self.timeout_s > 0, "> 0 seconds"),
            ("max_restarts", self.max_restarts >= 0, ">= 0"),
        ):
            if not ok:
                raise AlignConfigError(f"{key}.{name}: expected {expected}, got {getattr(self, name)!r}")


def rng_state(device_type: str) -> torch.Tensor:
    """The default random generator's state on ``device_type`` (``cpu``, ``cuda``: the current device)."""
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def set_rng_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def trainable_weights(policy) -> dict[str, torch.Tensor]:
    """What a generator needs after an update: the trainable tensors of ``policy.model`` (every weight, or the LoRA
    adapter), by name, on the CPU; the frozen ones are rebuilt from the policy's settings."""
    return {name: p.detach().to("cpu") for name, p in policy.model.named_parameters() if p.requires_grad}


def build_policy(spec: dict[str, Any]):
    """The policy that ``spec`` (``PolicyModel.spec``) describes, without its critic or reference."""
    from align.models import PolicyModel
    from align.models.loading import LoraSettings

    keep = (
        "model",
        "tokenizer",
        "dtype",
        "quantization",
        "attn_implementation",
        "trust_remote_code",
        "revision",
        "pad_equals_eos",
        "seed",
    )
    lora = LoraSettings(**spec["lora"]) if spec.get("lora") else None
    return PolicyModel(**{k: spec[k] for k in keep if k in spec}, lora=lora)


class Generator:
    """A copy of the policy that generates rollouts with the weights it was last sent (:meth:`load`)."""

    def __init__(
        self,
        spec: dict[str, Any],
        sampling,
        device: str = "cpu",
        threads: int | None = None,
        partial: str | None = None,
    ):
        """``partial``: cut generations when newer weights are offered (:meth:`offer`) and ``discard`` or
        ``continue`` the cut rows (:mod:`align.rollout.partial`); null: finish each batch with its weights."""
        from align.rollout.engine import make_engine

        if threads:
            torch.set_num_threads(threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.policy = build_policy(spec).to(self.device)
        self.policy.disable_dropout()
        self.engine = make_engine(sampling)
        self.partial = partial
        self.version = -1
        self.pid = os.getpid()
        self._last_end: float | None = None
        self._turn = threading.Condition()
        self._next = 0  # the number of the next call to run (calls may arrive out of order on a threaded actor)
        self._offered: tuple[int, Any] | None = None

    def ready(self) -> int:
        """The process id, once the policy is built."""
        return self.pid

    def _idle(self, start: float) -> float:
        return 0.0 if self._last_end is None else max(start - self._last_end, 0.0)

    @contextmanager
    def _in_order(self, seq: int | None):
        """Run the call numbered ``seq`` after every call numbered before it (None: now)."""
        if seq is None:
            yield
            return
        with self._turn:
            self._turn.wait_for(lambda: self._next == seq)
        try:
            yield
        finally:
            with self._turn:
                self._next = seq + 1
                self._turn.notify_all()

    @torch.no_grad()
    def load(self, version: int, weights: dict[str, torch.Tensor], seq: int | None = None) -> dict[str, Any]:
        """Take the trainable weights of policy ``version`` (:func:`trainable_weights`); nothing to do when a cut
        took them already."""
        with self._in_order(seq):
            start, start_ns = time.perf_counter(), time.time_ns()
            idle = self._idle(start)
            if version != self.version:
                self._copy(version, weights)
            self._last_end = time.perf_counter()
            return {"start_ns": start_ns, "end_ns": time.time_ns(), "idle_s": idle}

    def _copy(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.policy.model.named_parameters())
        missing = sorted(set(weights) - set(params))
        if missing:
            raise AlignConfigError(
                f"generator: the policy rebuilt from its settings has no weights {missing[:3]}; "
                "the trainer's model differs from what its settings describe"
            )
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].device, non_blocking=True))
        self.version = version

    def offer(self, version: int, weights: list) -> None:
        """Newer weights (``[weights]`` or ``[a Ray reference to them]``), taken at the next token of the batch
        being generated when generations are cut (``partial``), else by the :meth:`load` sent with them."""
        with self._turn:
            if self._offered is None or version > self._offered[0]:
                self._offered = (version, weights[0])

    def _newer(self) -> bool:
        with self._turn:
            return self._offered is not None and self._offered[0] > self.version

    @torch.no_grad()
    def _take_newer(self) -> int:
        with self._turn:
            # Called once _newer() saw an offer, and an offer is only ever replaced by a newer one.
            assert self._offered is not None
            version, weights = self._offered
        if not isinstance(weights, dict):
            import ray

            weights = ray.get(weights)
        self._copy(version, weights)
        return version

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        seed: int | None = None,
        rng: torch.Tensor | None = None,
        seq: int | None = None,
    ) -> dict[str, Any]:
        """A rollout of ``group_size`` completions per prompt, with its random stream: a generator seeded with
        ``seed``, or the default generator set to ``rng`` (whose state after sampling is returned, so that the
        trainer's stream continues from it)."""
        from align.rollout.partial import decode_with_cuts
        from align.rollout.types import rollout_to

        with self._in_order(seq):
            start, start_ns = time.perf_counter(), time.time_ns()
            idle, version = self._idle(start), self.version
            generator = None
            if rng is not None:
                set_rng_state(self.device.type, rng)
            elif seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(seed)
            if self.partial is None:
                rollout = self.engine.generate(self.policy, prompt_ids, group_size, generator=generator)
            else:
                engine = self.engine
                ids, mask, index = engine.contexts(self.policy, prompt_ids, group_size)
                out, versions, stats = decode_with_cuts(
                    engine,
                    self.policy,
                    ids,
                    mask,
                    group_size,
                    generator,
                    self._newer,
                    self._take_newer,
                    version,
                    self.partial,
                )
                rollout = engine.rollout_of(self.policy, ids, mask, index, group_size, out, time.perf_counter() - start)
                rollout.token_versions = versions
                rollout.metrics.update(stats)
            after = rng_state(self.device.type) if rng is not None else None
            self._last_end = time.perf_counter()
            return {
                "rollout": rollout_to(rollout, "cpu"),
                "rng": after,
                "version": version,
                "pid": self.pid,
                "start_ns": start_ns,
                "end_ns": time.time_ns(),
                "seconds": self._last_end - start,
                "idle_s": idle,
            }

    def close(self) -> None:
        self.engine.close()


# ---------------------------------------------------------------------------------------------- placement
def connect(address: str | None, num_cpus: float) -> None:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``), or start a local one with at least ``num_cpus``
    logical CPUs. Under data parallelism without an address, rank 0 starts it and the other ranks join it."""
    import ray
    import torch.distributed as dist

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    options: dict[str, Any] = dict(
        namespace="align", include_dashboard=False, log_to_driver=False, logging_level="WARNING"
    )
    address = address or os.environ.get("RAY_ADDRESS")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if address is None:
        shared: list[str | None] = [None, None]  # the address of the Ray rank 0 started, and its token
        if not distributed or dist.get_rank() == 0:
            ray.init(num_cpus=max(int(num_cpus + 0.999), os.cpu_count() or 1), **options)
            shared = [ray.get_runtime_context().gcs_address, _auth_token()]
        if distributed:
            dist.broadcast_object_list(shared, src=0)
            if dist.get_rank() != 0:
                if shared[1]:  # a local Ray authenticates its clients with a token (Ray >= 2.59)
                    _use_token(shared[1])
                ray.init(address=shared[0], **options)
        return
    try:
        ray.init(address=address, **options)
    except (ConnectionError, ValueError) as err:
        raise AlignConfigError(
            f"model.source.generator.address: cannot join the Ray cluster at {address!r}: {err}"
        ) from None


def _auth_token() -> str | None:
    """The token of the Ray this process started, where Ray keeps it (never logged)."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    if token:
        return token
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _use_token(token: str) -> None:
    """Authenticate this process's Ray client with ``token`` (Ray reads its mode once; it is read again here)."""
    os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"] = "token", token
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]  # compiled module; its .pyi lacks Config

        Config.initialize("")
    except (ImportError, AttributeError):  # a Ray without token authentication
        pass


def start_generator(
    placement: GeneratorPlacement, spec: dict[str, Any], sampling, threads: int, name: str, partial: str | None = None
) -> tuple[Any, str]:
    """A :class:`Generator` actor placed with ``placement``, and the type of its device; raises a one-line error
    when Ray cannot place or start it within ``placement.timeout_s``."""
    import ray

    num_gpus = placement.num_gpus
    if num_gpus is None:
        num_gpus = 1.0 if torch.cuda.is_available() else 0.0
    device = placement.device
    if device == "auto":
        device = "cuda" if num_gpus > 0 else "cpu"
    options: dict[str, Any] = dict(num_cpus=placement.num_cpus, num_gpus=num_gpus, max_restarts=0)
    if partial is not None:  # offers of newer weights run beside the batch being generated
        options.update(concurrency_groups={"offers": 1}, max_concurrency=8)
    # Ray types an actor handle's methods only when they are decorated with @ray.method: the handle goes untyped.
    actor: Any = (
        ray.remote(**options)(Generator)
        .options(name=name)
        .remote(spec, sampling, device, placement.threads or threads, partial)
    )
    ready = actor.ready.remote()
    done, _ = ray.wait([ready], timeout=placement.timeout_s)
    if not done:
        ray.kill(actor)
        raise AlignConfigError(
            f"model.source.generator: Ray did not start a generator with {placement.num_cpus:g} CPUs and "
            f"{num_gpus:g} GPUs within timeout_s={placement.timeout_s:g} s; free those resources, lower "
            "generator.num_cpus/num_gpus, or raise generator.timeout_s if the model takes longer to load"
        )
    try:
        ray.get(ready)
    except ray.exceptions.RayError as err:
        raise generator_error(err) from None
    return actor, device


def generator_error(err: Exception) -> Exception:
    """What to raise for an error of a generator's call: align's own error as it was raised there (its one line),
    anything else with the generator's traceback."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, AlignError):
        return cause
    if getattr(err, "actor_init_failed", False):  # its __init__ raised: the message ends with that error's line
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return AlignError(f"generator: could not be started on its Ray node: {lines[-1] if lines else err}")
    if isinstance(cause, BaseException) and hasattr(err, "as_instanceof_cause"):
        return err.as_instanceof_cause()
    return err
