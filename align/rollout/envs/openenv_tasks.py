"""A small OpenEnv environment that ships with align: letter sorting over rounds (the task of
:class:`align.rollout.envs.tasks.SortRounds`), written against OpenEnv's own classes, so that
``configs/grpo/tiny-openenv.yaml`` trains the tiny model on an OpenEnv environment offline, in this process or
served over HTTP (docs/environments.md, "OpenEnv").

``reset(prompt=..., rounds=[...])`` plays the rounds a data row gives (``align:sort/rounds``); ``reset(seed=n)``
draws them (``rounds`` of them) from the seed. Each round's observation is ``sort: d a c``; a ``SortAction``'s
``answer`` earns ``1 / rounds`` when it is the sorted letters. Serve it with::

    python -m align.rollout.envs.openenv_tasks --port 8000   # then OpenEnvEnvironment(url="http://localhost:8000")
"""

from __future__ import annotations

import argparse
import random
import uuid
from collections.abc import Callable
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

from align.data import sort_task

__all__ = ["SortAction", "SortObservation", "LetterSortEnv", "make_app", "serve"]


class SortAction(Action):
    """The policy's answer to the current round."""

    answer: str


class SortObservation(Observation):
    """The letters of the current round (``sort: d a c``); empty once the episode is over."""

    prompt: str = ""


class LetterSortEnv(Environment[SortAction, SortObservation, State]):
    """Sort letters over rounds (module docstring). Every round is played whatever the earlier answers were."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, rounds: int = 1, min_len: int = 2, max_len: int = 4):
        super().__init__()
        self.rounds, self.min_len, self.max_len = rounds, min_len, max_len
        self._state = State(episode_id=None, step_count=0)
        self.prompts: list[str] = []

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        prompt: str | None = None,
        rounds: list | None = None,
        **kwargs: Any,
    ) -> SortObservation:
        if prompt is None:
            rng = random.Random(seed)
            self.prompts = [
                sort_task.sample_problem(rng, self.min_len, self.max_len)["prompt"] for _ in range(self.rounds)
            ]
        else:
            self.prompts = [prompt, *(rounds or [])]
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return SortObservation(prompt=self.prompts[0])

    def step(self, action: SortAction, timeout_s: float | None = None, **kwargs: Any) -> SortObservation:
        turn = self._state.step_count
        if turn >= len(self.prompts):
            raise RuntimeError("step after the episode ended; call reset first")
        solved = sort_task.is_correct(action.answer, sort_task.solve(self.prompts[turn]))
        self._state.step_count = turn + 1
        done = self._state.step_count == len(self.prompts)
        return SortObservation(
            prompt="" if done else self.prompts[turn + 1],
            done=done,
            reward=float(solved) / len(self.prompts),
            metadata={"solved": solved},
        )

    @property
    def state(self) -> State:
        return self._state


def make_app(max_concurrent_envs: int = 256, **env_kwargs: Any):
    """The FastAPI app of an OpenEnv server for :class:`LetterSortEnv` (one environment per session)."""
    return create_fastapi_app(
        lambda: LetterSortEnv(**env_kwargs), SortAction, SortObservation, max_concurrent_envs=max_concurrent_envs
    )


def serve(app, host: str = "127.0.0.1", port: int = 0) -> tuple[str, Callable[[], None]]:
    """Serve ``app`` with uvicorn on a thread of this process: ``(base URL, stop)``; port 0 takes a free one."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="openenv-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the OpenEnv server on {host}:{sock.getsockname()[1]} did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)
        sock.close()

    return f"http://{host}:{sock.getsockname()[1]}", stop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve LetterSortEnv as an OpenEnv server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-concurrent-envs", type=int, default=256)
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(make_app(args.max_concurrent_envs, rounds=args.rounds), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
