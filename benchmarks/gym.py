"""Classic RL on CartPole-v1: ``align`` against Stable-Baselines3, side by side, for PPO, A2C and DQN.

Usage::

    python benchmarks/gym.py --quick                  # smoke check, tiny budgets, one seed (well under a minute)
    python benchmarks/gym.py                          # PPO, A2C and DQN, 3 seeds each
    python benchmarks/gym.py --algos ppo --seeds 5 --json gym-bench.json
    python benchmarks/gym.py --algos dqn --eval-every 1000 --threads 1

What happens:

1. For each algorithm and seed, two trials run in fresh subprocesses, ``align`` then ``sb3`` (the next seed again
   ``align, sb3``), so that load drifts on a shared machine hit both alike.
2. Each trial trains on CartPole-v1 with RL Zoo's tuned hyperparameters for SB3, which the shipped
   ``configs/gym/{ppo,a2c,dqn}-cartpole.yaml`` use (table below; the same on both sides). align builds its module
   with the constructor and trains it under a Lightning ``Trainer`` (no logger, checkpoints, progress bar or
   validation loop); SB3 calls ``learn``.
3. Evaluation, the same on both sides and at the same cadence: at the first iteration boundary (after the update)
   at or past every ``--eval-every`` environment steps, and at the end of training, 20 deterministic (greedy)
   episodes on a separate set of environments, one episode each. Both sides play the same 20 held-out starting
   states, every time: those of align's evaluation seeds for the trial's seed (``episode_seed(seed, 1, i, 0)``,
   i = 0..19), so each trial seed has its own 20 and the two sides of a seed share them. align: the module's own
   ``ClassicRLModule.evaluate()`` from a Lightning callback's ``on_train_batch_end``; SB3:
   ``evaluate_policy(model, eval_env, n_eval_episodes=20, deterministic=True)`` on a ``DummyVecEnv`` of 20
   ``Monitor``-wrapped environments, each reset with its fixed seed, from a ``BaseCallback`` at the start of each
   rollout (that is, after the previous update) and at the end of training. Each evaluation is timed and its time
   is subtracted from the training clock.

   Why the shared states matter: whether a 20-episode mean reaches 475 hangs on one or two hard starting states,
   so a seed's "steps to 475" moves by tens of thousands of steps with the set it is evaluated on. Evaluated on
   different sets, the two sides' medians differ by more than their learning does; and a set shared by many
   trials (SB3's ``seed + i`` convention gives neighbouring trial seeds 19 of 20 states in common) biases every
   trial alike.
4. A trial stops once it has both reached the target (mean return >= ``--target``, 475) and taken the steps its
   throughput is measured over (see below), or at the budget. For PPO and DQN that is always the full budget; A2C
   may stop before its 500k.

Reported per algorithm and side (medians over seeds):

* **steps to 475**: environment steps (over all environments) at the first evaluation whose mean return over the
  20 episodes is >= 475. A seed that never gets there counts as infinity ("not reached") in the median.
* **train s to 475**: training wall time to that evaluation: from the start of training (align: ``on_train_start``;
  SB3: ``on_training_start``, after model construction on both sides) minus the time spent evaluating.
* **env steps/s**: environment steps / training wall time (evaluation excluded) over the first ``rate steps``
  environment steps, read at the first iteration boundary at or past them: the whole budget for PPO (100,096 =
  391 iterations of 256) and DQN (50,176 = 196 iterations of 256), the first 100,000 for A2C (2,500 iterations of
  40). Over the same window, its split per 1,000 steps: **collect** (stepping the environments with the
  policy; align: the module's own ``time/rollout_s``; SB3: ``collect_rollouts``, which also computes PPO/A2C's
  returns and advantages, that align counts in the update) and **update** (the rest: learning, and each library's
  loop and logging around it); and the CPU seconds per 1,000 steps (above the wall seconds when torch used more
  than one core).
* **final return**: the last evaluation's mean return.
* **other processes, cores**: how many cores other processes kept busy, on average, while the trial trained (the
  machine's busy CPU time from ``/proc/stat`` less the trial's own, per wall second). Above ~0.1 the trial
  shared the cores, and with torch's default of one thread per core the timings of such a trial can be several
  times slower; rerun it, or compare with ``--threads 1``. The 1-minute load average at each trial's start and end
  is printed too.

Then ``PASS``/``FAIL`` lines for the goal: align reaches 475 in no more environment steps than SB3 (median), and
align's environment steps/s are at least 1.5x SB3's. Both sides run with the same torch threads: ``--threads N``
sets ``torch.set_num_threads(N)`` (and one inter-op thread) in every trial; without it each side keeps torch's
default, which neither library changes (the number of physical cores). The trials report the count they ran with.

Settings (RL Zoo's CartPole-v1 hyperparameters), the same on both sides: ``SETTINGS`` below holds them in align's
names (the shipped configs'), and ``sb3_kwargs`` maps them to SB3's arguments (docs/classic_rl.md has the table):

* PPO: 8 environments x 32 steps per iteration, 20 epochs of one 256-transition minibatch, gamma 0.98, GAE lambda
  0.8, no entropy bonus, learning rate 1e-3 and clip range 0.2 both decaying linearly to 0 at 100k steps, Adam eps
  1e-5, gradient norm clipped at 0.5, advantages whitened per minibatch, separate 64x64 tanh policy and value
  networks with orthogonal initialisation; value-loss weight: align ``value.coef 1.0`` on ``0.5 (V - R)^2`` =
  SB3's default ``vf_coef 0.5`` on ``(V - R)^2``. Budget 100k steps.
* A2C: 8 environments x 5 steps per update, gamma 0.99, GAE lambda 1 (5-step returns), no entropy bonus, RMSprop
  lr 7e-4, alpha 0.99, eps 1e-5, gradient norm clipped at 0.5, no advantage normalisation, the same networks and
  value-loss weight as PPO. Budget 500k steps.
* DQN: one environment, 256x256 ReLU Q-network, Adam lr 2.3e-3, batch 64, replay buffer 100k, learning from 1,000
  steps on, gamma 0.99, 256 environment steps then 128 gradient steps per iteration, target network copied every
  10 environment steps, epsilon 1.0 -> 0.04 over the first 16% of 50k steps, Huber loss, gradient norm clipped at
  10. Budget 50k steps.

Each library keeps its own environment loop (align: a Gymnasium ``SyncVectorEnv`` stepped by its ``EnvRunner``;
SB3: its ``DummyVecEnv`` of ``Monitor``-wrapped environments, as RL Zoo builds it) and its own details where they
differ: align steps Adam with torch's fused kernel (its configs' ``fused: true``), SB3 with torch's default; SB3's
DQN acts uniformly at random for its first 1,000 steps (align epsilon-greedily, epsilon ~0.9 there); SB3 decays
PPO's learning rate by the progress after each rollout, align by the progress before it (one 256-step iteration
apart). Both initialise the Q-network with torch's ``nn.Linear`` default (align's DQN ``init: torch``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import _harness as h

ENV_ID = "CartPole-v1"
EVAL_EPISODES = 20

# budget: environment steps to train for (RL Zoo's n_timesteps for PPO and DQN; A2C's 500k is RL Zoo's, its config
# here stops at 200k); rate_steps: the steps its throughput is measured over; eval_every: the evaluation cadence.
ALGOS = {
    "ppo": {"budget": 100_000, "rate_steps": 100_000, "eval_every": 5_000},
    "a2c": {"budget": 500_000, "rate_steps": 100_000, "eval_every": 5_000},
    "dqn": {"budget": 50_000, "rate_steps": 50_000, "eval_every": 2_500},
}
# --quick: only to check that the script works (nothing learns in these budgets)
QUICK = {
    "ppo": {"budget": 2_048, "rate_steps": 2_048, "eval_every": 1_024},
    "a2c": {"budget": 2_000, "rate_steps": 2_000, "eval_every": 1_000},
    "dqn": {"budget": 1_536, "rate_steps": 1_536, "eval_every": 768},
}
SIDES = ("align", "sb3")


# ---------------------------------------------------------------------------------------------------------------
# the training clock and evaluation schedule, shared by both sides


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (Linux ``/proc/stat``: user, nice, system, irq and
    softirq time of all cores); NaN elsewhere."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return float("nan")
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")


class Tracker:
    """The training clock (wall and CPU seconds, evaluation excluded) and the evaluation schedule. Each side calls
    :meth:`boundary` at every iteration boundary, after the update; its answer says whether to keep training."""

    def __init__(self, spec: dict):
        self.target, self.eval_every, self.rate_steps = spec["target"], spec["eval_every"], spec["rate_steps"]
        self.next_eval = self.eval_every
        self.evals: list[tuple[int, float, float]] = []  # (env steps, mean return, training seconds)
        self.reached: tuple[int, float] | None = None  # (env steps, training seconds) at the first eval >= target
        self.rate: tuple[int, float, float, float] | None = None  # (env steps, wall s, CPU s, rollout s) at the
        # first boundary >= rate_steps
        self.rollout_seconds = 0.0  # of the training seconds, those spent collecting steps (policy + environments)
        self.last: tuple[int, float] = (0, 0.0)
        self.eval_seconds = self.eval_cpu_seconds = 0.0
        self._start = self._start_cpu = self._start_busy = 0.0

    def start(self) -> None:
        self._start, self._start_cpu = time.perf_counter(), time.process_time()
        self._start_busy = machine_busy_seconds()

    def other_cores(self) -> float:
        """Cores that other processes kept busy on average since the start of training (the machine's busy CPU
        time less this process's, per wall second): work that shared the cores with this trial."""
        wall = time.perf_counter() - self._start
        other = machine_busy_seconds() - self._start_busy - (time.process_time() - self._start_cpu)
        return max(other, 0.0) / wall if wall > 0 else float("nan")

    def train_seconds(self) -> tuple[float, float]:
        return (
            time.perf_counter() - self._start - self.eval_seconds,
            time.process_time() - self._start_cpu - self.eval_cpu_seconds,
        )

    def boundary(self, steps: int, evaluate) -> bool:
        """An iteration ended at ``steps`` environment steps: read the clock, evaluate when due (``evaluate()``
        returns the mean return), and say whether training goes on."""
        seconds, cpu_seconds = self.train_seconds()
        self.last = (steps, seconds)
        if self.rate is None and steps >= self.rate_steps:
            self.rate = (steps, seconds, cpu_seconds, self.rollout_seconds)
        if steps >= self.next_eval:
            wall, cpu = time.perf_counter(), time.process_time()
            mean_return = float(evaluate())
            self.eval_seconds += time.perf_counter() - wall
            self.eval_cpu_seconds += time.process_time() - cpu
            self.evals.append((steps, mean_return, seconds))
            if self.reached is None and mean_return >= self.target:
                self.reached = (steps, seconds)
            self.next_eval = (steps // self.eval_every + 1) * self.eval_every
        return not (self.reached is not None and self.rate is not None)

    def result(self, threads: int, load_start: float) -> dict:
        steps, seconds = self.last
        rate_steps, rate_seconds, rate_cpu, rate_rollout = self.rate or (steps, seconds, *[float("nan")] * 2)
        per_1k = 1000.0 / rate_steps if rate_steps else float("nan")
        return {
            "steps_to_target": self.reached[0] if self.reached else None,
            "seconds_to_target": self.reached[1] if self.reached else None,
            "rate_steps": rate_steps,
            "rate_seconds": rate_seconds,
            "steps_per_s": rate_steps / rate_seconds if rate_seconds > 0 else float("nan"),
            "cpu_s_per_1k_steps": rate_cpu * per_1k,
            "rollout_s_per_1k_steps": rate_rollout * per_1k,
            "update_s_per_1k_steps": (rate_seconds - rate_rollout) * per_1k,
            "total_steps": steps,
            "train_seconds": seconds,
            "eval_seconds": self.eval_seconds,
            "evaluations": len(self.evals),
            "final_return": self.evals[-1][1] if self.evals else float("nan"),
            "evals": self.evals,
            "threads": threads,
            "load_start": load_start,
            "other_cores": self.other_cores(),
        }


def setup_threads(spec: dict) -> int:
    """``--threads`` when given (both sides alike), else torch's default; returns the intra-op thread count."""
    import torch

    if spec["threads"]:
        h.set_threads(spec["threads"])
    return torch.get_num_threads()


# ---------------------------------------------------------------------------------------------------------------
# children


# Each algorithm's settings in align's names: the module's arguments (option groups as dicts), the optimizer's
# name and arguments, and the network (``network`` for PPO and A2C; DQN's ``hidden``, ``activation`` and ``init``).
SETTINGS = {
    "ppo": {
        "num_envs": 8,
        "steps_per_iteration": 32,
        "gae": {"gamma": 0.98, "lam": 0.8, "whiten_advantages": True},
        "entropy_coef": 0.0,
        "value": {"coef": 1.0, "clip": None},
        "clip": {"low": 0.2, "schedule": "linear"},
        "updates": {"epochs": 20, "minibatch_size": 256, "max_grad_norm": 0.5},
        "lr_schedule": "linear",
        "network": {"hidden": (64, 64), "activation": "tanh", "shared": False},
        "optimizer": ("Adam", {"lr": 1e-3, "eps": 1e-5, "fused": True}),
    },
    "a2c": {
        "num_envs": 8,
        "steps_per_iteration": 5,
        "gae": {"gamma": 0.99, "lam": 1.0, "whiten_advantages": False},
        "entropy_coef": 0.0,
        "value": {"coef": 1.0},
        "updates": {"max_grad_norm": 0.5},
        "lr_schedule": "constant",
        "network": {"hidden": (64, 64), "activation": "tanh", "shared": False},
        "optimizer": ("RMSprop", {"lr": 7e-4, "alpha": 0.99, "eps": 1e-5, "foreach": True}),
    },
    "dqn": {
        "num_envs": 1,
        "steps_per_iteration": 256,
        "buffer_size": 100_000,
        "learning_starts": 1000,
        "updates": {"gradient_steps": 128, "minibatch_size": 64, "max_grad_norm": 10.0},
        "gamma": 0.99,
        "target_update_interval": 10,
        "tau": 1.0,
        "loss": "huber",
        "hidden": (256, 256),
        "activation": "relu",
        "init": "torch",
        "exploration": {"initial": 1.0, "final": 0.04, "fraction": 0.16},
        "lr_schedule": "constant",
        "optimizer": ("Adam", {"lr": 2.3e-3, "fused": True}),
    },
}


def build_module(spec: dict):
    """The align module of a trial, with ``SETTINGS`` (those of ``configs/gym/<algo>-cartpole.yaml``, the budget
    aside)."""
    import torch

    from align import gym
    from align.gym.make import EnvSpec

    algo, seed, budget = spec["algo"], spec["seed"], spec["budget"]
    settings = dict(SETTINGS[algo])
    optimizer, optimizer_args = settings.pop("optimizer")
    groups = {
        "gae": gym.GymGAE,
        "value": gym.GymValueTraining,
        "clip": gym.GymClipRange,
        "network": gym.Network,
        "exploration": gym.Exploration,
        "updates": gym.ReplayUpdates if algo == "dqn" else gym.GymUpdates,
    }
    kwargs = {k: groups[k](**v) if k in groups else v for k, v in settings.items() if k != "num_envs"}
    module = {"ppo": gym.PPOGymModule, "a2c": gym.A2CGymModule, "dqn": gym.DQNGymModule}[algo]
    return module(
        env=EnvSpec(id=ENV_ID, num_envs=settings["num_envs"], seed=seed),
        total_steps=budget,
        evaluation=gym.EpisodeEvaluation(episodes=EVAL_EPISODES, deterministic=True),
        optimizer=lambda params: getattr(torch.optim, optimizer)(params, **optimizer_args),
        **kwargs,
    )


def sb3_kwargs(algo: str) -> dict:
    """SB3's arguments for ``SETTINGS[algo]``: align's names mapped to SB3's (docs/classic_rl.md's table). SB3's
    value loss is ``(V - R)^2`` and align's ``0.5 * (V - R)^2``, so ``vf_coef`` is half of ``value.coef``; a
    ``linear`` schedule is SB3's callable of the remaining progress (1 -> 0)."""
    settings = SETTINGS[algo]
    optimizer, optimizer_args = settings["optimizer"]
    lr = optimizer_args["lr"]
    out = {
        "learning_rate": (lambda progress: progress * lr) if settings["lr_schedule"] == "linear" else lr,
        "max_grad_norm": settings["updates"]["max_grad_norm"],
    }
    if algo == "dqn":
        exploration, updates = settings["exploration"], settings["updates"]
        assert optimizer == "Adam" and settings["loss"] == "huber" and settings["init"] == "torch"  # SB3's own
        return {
            **out,
            "batch_size": updates["minibatch_size"],
            "buffer_size": settings["buffer_size"],
            "learning_starts": settings["learning_starts"],
            "gamma": settings["gamma"],
            "target_update_interval": settings["target_update_interval"],
            "tau": settings["tau"],
            "train_freq": settings["steps_per_iteration"],
            "gradient_steps": updates["gradient_steps"],
            "exploration_fraction": exploration["fraction"],
            "exploration_initial_eps": exploration["initial"],
            "exploration_final_eps": exploration["final"],
            "policy_kwargs": {"net_arch": list(settings["hidden"])},
        }
    gae, network = settings["gae"], settings["network"]
    assert network["activation"] == "tanh" and not network["shared"]  # SB3's MlpPolicy: tanh, separate networks
    out.update(
        {
            "n_steps": settings["steps_per_iteration"],
            "gamma": gae["gamma"],
            "gae_lambda": gae["lam"],
            "normalize_advantage": gae["whiten_advantages"],
            "ent_coef": settings["entropy_coef"],
            "vf_coef": settings["value"]["coef"] / 2,
            "policy_kwargs": {
                "net_arch": {"pi": list(network["hidden"]), "vf": list(network["hidden"])},
                "ortho_init": True,
            },
        }
    )
    if algo == "ppo":
        updates, clip = settings["updates"], settings["clip"]
        low = clip["low"]
        assert settings["value"].get("clip") is None and clip.get("high") is None  # SB3's clip_range_vf: None
        out.update(
            {
                "n_epochs": updates["epochs"],
                "batch_size": updates["minibatch_size"],
                "clip_range": (lambda progress: progress * low) if clip["schedule"] == "linear" else low,
            }
        )
    else:  # A2C: RMSprop (SB3's alpha is 0.99) or Adam
        assert optimizer == "RMSprop" and optimizer_args.get("alpha", 0.99) == 0.99
        out.update({"use_rms_prop": True, "rms_prop_eps": optimizer_args["eps"]})
    return out


def run_align(spec: dict) -> dict:
    load_start = h.load_average()
    threads = setup_threads(spec)
    import lightning as L

    L.seed_everything(spec["seed"], verbose=False)
    module = build_module(spec)
    tracker = Tracker(spec)

    def evaluate(pl_module) -> float:
        return statistics.fmean(episode.reward for episode in pl_module.evaluate())

    class Evaluations(L.Callback):
        def on_train_start(self, trainer, pl_module):
            tracker.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            tracker.rollout_seconds += pl_module.timings.get("time/rollout_s", 0.0)  # this iteration's collection
            if not tracker.boundary(pl_module.env_steps, lambda: evaluate(pl_module)):
                trainer.should_stop = True

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Evaluations()],
    )
    trainer.fit(module)  # one endless epoch: the module stops itself at total_steps, the callback at the target
    return tracker.result(threads, load_start)


def held_out_env(seed: int):
    """SB3's evaluation environments for trial ``seed``: ``EVAL_EPISODES`` ``Monitor``-wrapped CartPoles, one
    episode each, whose every reset uses the seed align's evaluation gives that environment's first episode
    (``align.gym.runner.episode_seed`` of stream 1). Both sides then evaluate on the same 20 held-out starting
    states, every time, and each trial seed has its own 20."""
    import gymnasium as gym
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    from align.gym.runner import episode_seed

    class FixedReset(gym.Wrapper):
        def __init__(self, env, reset_seed: int):
            super().__init__(env)
            self.reset_seed = reset_seed

        def reset(self, *, seed=None, options=None):
            return self.env.reset(seed=self.reset_seed, options=options)

    seeds = [episode_seed(seed, 1, i, 0) for i in range(EVAL_EPISODES)]
    return DummyVecEnv([lambda s=s: FixedReset(Monitor(gym.make(ENV_ID)), s) for s in seeds])


def run_sb3(spec: dict) -> dict:
    load_start = h.load_average()
    threads = setup_threads(spec)
    from stable_baselines3 import A2C, DQN, PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.logger import Logger

    algo, seed = spec["algo"], spec["seed"]
    common = {"seed": seed, "device": "cpu", "verbose": 0}
    env = make_vec_env(ENV_ID, n_envs=SETTINGS[algo]["num_envs"], seed=seed)
    model = {"ppo": PPO, "a2c": A2C, "dqn": DQN}[algo]("MlpPolicy", env, **sb3_kwargs(algo), **common)
    eval_env = held_out_env(seed)
    tracker = Tracker(spec)

    def evaluate() -> float:
        mean_return, _ = evaluate_policy(model, eval_env, n_eval_episodes=EVAL_EPISODES, deterministic=True)
        return mean_return

    class Evaluations(BaseCallback):
        """Iteration boundaries: the start of every rollout after the first (the previous update is done) and
        the end of training."""

        stop = False

        def _on_training_start(self) -> None:
            tracker.start()

        def _on_rollout_start(self) -> None:
            if self.model.num_timesteps > 0 and not tracker.boundary(self.model.num_timesteps, evaluate):
                self.stop = True  # the rollout's first step ends learn(), untimed

        def _on_step(self) -> bool:
            return not self.stop

        def _on_training_end(self) -> None:
            if not self.stop:
                tracker.boundary(self.model.num_timesteps, evaluate)

    collect_rollouts = model.collect_rollouts

    def timed_collect_rollouts(*args, **kwargs):
        """SB3's collection (policy + environments; the replay buffer and target updates for DQN, the returns and
        advantages for PPO/A2C), less the evaluation that its ``on_rollout_start`` may run."""
        start, evaluating = time.perf_counter(), tracker.eval_seconds
        out = collect_rollouts(*args, **kwargs)
        tracker.rollout_seconds += time.perf_counter() - start - (tracker.eval_seconds - evaluating)
        return out

    model.collect_rollouts = timed_collect_rollouts
    # SB3's own logger would write nothing at verbose 0 but still make an empty folder in the temporary directory
    # per trial; this one records the same values and makes none.
    model.set_logger(Logger(folder=None, output_formats=[]))
    model.learn(total_timesteps=spec["budget"], callback=Evaluations())
    return tracker.result(threads, load_start)


CHILDREN = {"align": run_align, "sb3": run_sb3}

# ---------------------------------------------------------------------------------------------------------------
# parent


def steps_text(value: float) -> str:
    return "not reached" if value is None or math.isinf(value) else f"{value:,.0f}"


def seconds_text(value: float) -> str:
    return "not reached" if value is None or math.isinf(value) else f"{value:.1f}"


def print_trial(algo: str, seed: int, side: str, res: dict, target: float) -> None:
    reached = (
        f"{target:g} at {res['steps_to_target']:,} env steps, {res['seconds_to_target']:.1f} s"
        if res["steps_to_target"] is not None
        else f"{target:g} not reached"
    )
    print(
        f"{algo} seed {seed} {side:5s}: {reached}; {res['steps_per_s']:,.0f} env steps/s over "
        f"{res['rate_steps']:,} steps (per 1k: collect {res['rollout_s_per_1k_steps']:.3f} s, update "
        f"{res['update_s_per_1k_steps']:.3f} s, {res['cpu_s_per_1k_steps']:.3f} CPU s); final return "
        f"{res['final_return']:.1f} after {res['total_steps']:,} steps; {res['evaluations']} evaluations, "
        f"{res['eval_seconds']:.1f} s excluded; {res['threads']} threads; trial {res['process_seconds']:.0f} s; "
        f"load {res['load_start']:.2f} -> {res['load']:.2f}, other processes {res['other_cores']:.2f} cores",
        flush=True,
    )


def summarise(trials: list[dict]) -> dict:
    """Medians over seeds; not reaching the target counts as infinity."""
    inf = float("inf")
    return {
        "steps_to_target": statistics.median(
            inf if r["steps_to_target"] is None else r["steps_to_target"] for r in trials
        ),
        "seconds_to_target": statistics.median(
            inf if r["seconds_to_target"] is None else r["seconds_to_target"] for r in trials
        ),
        "reached": sum(r["steps_to_target"] is not None for r in trials),
        "steps_per_s": statistics.median(r["steps_per_s"] for r in trials),
        "cpu_s_per_1k_steps": statistics.median(r["cpu_s_per_1k_steps"] for r in trials),
        "rollout_s_per_1k_steps": statistics.median(r["rollout_s_per_1k_steps"] for r in trials),
        "update_s_per_1k_steps": statistics.median(r["update_s_per_1k_steps"] for r in trials),
        "final_return": statistics.median(r["final_return"] for r in trials),
        "rate_steps": statistics.median(r["rate_steps"] for r in trials),
        "other_cores": statistics.median(r["other_cores"] for r in trials),
    }


def ratio(a: float, b: float) -> str:
    if math.isinf(a) or math.isinf(b) or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def report(algo: str, settings: dict, seeds: list[int], results: dict[str, list[dict]], target: float) -> dict:
    """Print the table of one algorithm and its PASS/FAIL lines; return the medians and verdicts."""
    med = {side: summarise(results[side]) for side in SIDES}
    a, s = med["align"], med["sb3"]
    print(
        f"\n{algo.upper()} on {ENV_ID}, seeds {', '.join(map(str, seeds))}: budget {settings['budget']:,} env steps, "
        f"evaluation every {settings['eval_every']:,} ({EVAL_EPISODES} greedy episodes), steps/s over the first "
        f"{a['rate_steps']:,.0f}; medians over seeds"
    )
    print(f"{'':24s}{'align':>14s}{'SB3':>14s}{'align/SB3':>11s}")
    rows = [
        (
            f"steps to {target:g}",
            steps_text(a["steps_to_target"]),
            steps_text(s["steps_to_target"]),
            ratio(a["steps_to_target"], s["steps_to_target"]),
        ),
        (
            f"train s to {target:g}",
            seconds_text(a["seconds_to_target"]),
            seconds_text(s["seconds_to_target"]),
            ratio(a["seconds_to_target"], s["seconds_to_target"]),
        ),
        (
            "env steps/s",
            f"{a['steps_per_s']:,.0f}",
            f"{s['steps_per_s']:,.0f}",
            ratio(a["steps_per_s"], s["steps_per_s"]),
        ),
        (
            "  collect s per 1k steps",
            f"{a['rollout_s_per_1k_steps']:.3f}",
            f"{s['rollout_s_per_1k_steps']:.3f}",
            ratio(a["rollout_s_per_1k_steps"], s["rollout_s_per_1k_steps"]),
        ),
        (
            "  update s per 1k steps",
            f"{a['update_s_per_1k_steps']:.3f}",
            f"{s['update_s_per_1k_steps']:.3f}",
            ratio(a["update_s_per_1k_steps"], s["update_s_per_1k_steps"]),
        ),
        (
            "CPU s per 1k steps",
            f"{a['cpu_s_per_1k_steps']:.3f}",
            f"{s['cpu_s_per_1k_steps']:.3f}",
            ratio(a["cpu_s_per_1k_steps"], s["cpu_s_per_1k_steps"]),
        ),
        ("final return", f"{a['final_return']:.1f}", f"{s['final_return']:.1f}", ""),
        ("seeds reaching target", f"{a['reached']}/{len(seeds)}", f"{s['reached']}/{len(seeds)}", ""),
        ("other processes, cores", f"{a['other_cores']:.2f}", f"{s['other_cores']:.2f}", ""),
    ]
    for label, x, y, r in rows:
        print(f"{label:24s}{x:>14s}{y:>14s}{r:>11s}")
    for i, seed in enumerate(seeds):
        x, y = results["align"][i], results["sb3"][i]
        print(
            f"  seed {seed}: steps to {target:g} {steps_text(x['steps_to_target']):>11s} / "
            f"{steps_text(y['steps_to_target']):>11s}; steps/s {x['steps_per_s']:7,.0f} / {y['steps_per_s']:7,.0f}"
        )
    sample = a["steps_to_target"] <= s["steps_to_target"] and not math.isinf(a["steps_to_target"])
    speed = a["steps_per_s"] / s["steps_per_s"]
    print(
        f"{'PASS' if sample else 'FAIL'} {algo}: align reaches {target:g} in {steps_text(a['steps_to_target'])} "
        f"env steps (median), SB3 in {steps_text(s['steps_to_target'])} (goal: align <= SB3)"
    )
    print(
        f"{'PASS' if speed >= 1.5 else 'FAIL'} {algo}: align {a['steps_per_s']:,.0f} env steps/s = {speed:.2f}x "
        f"SB3's {s['steps_per_s']:,.0f} (goal: >= 1.5x)",
        flush=True,
    )
    return {
        "medians": med,
        "sample_efficiency_pass": sample,
        "throughput_ratio": speed,
        "throughput_pass": speed >= 1.5,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default="ppo,a2c,dqn", help="comma-separated: ppo, a2c, dqn")
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="N seeds from --first-seed on, one align and one SB3 trial each (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the first seed (default 0): a later range adds seeds to an earlier run's",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="environment steps between evaluations (default: 5,000 for PPO and A2C, 2,500 for DQN)",
    )
    parser.add_argument("--target", type=float, default=475.0, help="mean return over the 20 evaluation episodes")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads in every trial of both sides (default: torch's own default)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke check: tiny budgets and one seed (unless --seeds is given); nothing learns",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the trials, medians and verdicts here")
    h.add_child_args(parser, CHILDREN)
    ns = parser.parse_args(argv)
    if h.run_if_child(ns, CHILDREN):
        return
    algos = [a.strip() for a in ns.algos.split(",") if a.strip()]
    unknown = sorted(set(algos) - set(ALGOS))
    if unknown or not algos:
        parser.error(f"--algos: expected some of {', '.join(ALGOS)}, got {ns.algos!r}")
    seeds = list(range(ns.first_seed, ns.first_seed + (ns.seeds if ns.seeds is not None else 1 if ns.quick else 3)))

    print(
        f"{ENV_ID}: {', '.join(algos)}; seeds {seeds}; torch threads "
        f"{ns.threads if ns.threads else 'default'}; load {h.load_average():.2f}",
        flush=True,
    )
    summary: dict = {}
    all_trials: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in algos:
            settings = dict((QUICK if ns.quick else ALGOS)[algo])
            if ns.eval_every:
                settings["eval_every"] = ns.eval_every
            results: dict[str, list[dict]] = {side: [] for side in SIDES}
            for seed in seeds:
                spec = {"algo": algo, "seed": seed, "target": ns.target, "threads": ns.threads, **settings}
                workdir = Path(tmp) / f"{algo}-{seed}"
                workdir.mkdir()
                trials = h.Trials(__file__, spec, workdir, threads=ns.threads)
                for side in SIDES:
                    res = trials.run(side)
                    results[side].append(res)
                    print_trial(algo, seed, side, res, ns.target)
            summary[algo] = report(algo, settings, seeds, results, ns.target)
            all_trials[algo] = results

    every = [r for trials in all_trials.values() for side in trials.values() for r in side]
    loads = [x for r in every for x in (r["load_start"], r["load"])]
    others = [r["other_cores"] for r in every]
    print(
        f"\nload average (1 min) over the trials: {min(loads):.2f} - {max(loads):.2f} on {os.cpu_count()} CPUs; "
        f"other processes kept {min(others):.2f} - {max(others):.2f} cores busy during training; torch threads "
        f"per trial: {sorted({r['threads'] for r in every})}"
    )
    h.write_json(
        ns.json,
        {
            "env": ENV_ID,
            "seeds": seeds,
            "settings": {k: str(v) for k, v in vars(ns).items()},
            "trials": all_trials,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
