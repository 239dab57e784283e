"""Classic RL on Gymnasium: PPO, A2C, REINFORCE, DQN and Q-learning on align's math, loop, logging and checkpoints."""

from align.gym.base import ClassicRLModule
from align.gym.dqn import DQNGymModule, QLearningGymModule
from align.gym.onpolicy import A2CGymModule, OnPolicyModule, PPOGymModule, REINFORCEGymModule
from align.gym.options import (
    EpisodeEvaluation,
    Exploration,
    GymClipRange,
    GymGAE,
    GymUpdates,
    GymValueTraining,
    Network,
    ReplayUpdates,
)

__all__ = [
    "A2CGymModule",
    "ClassicRLModule",
    "DQNGymModule",
    "EpisodeEvaluation",
    "Exploration",
    "GymClipRange",
    "GymGAE",
    "GymUpdates",
    "GymValueTraining",
    "Network",
    "OnPolicyModule",
    "PPOGymModule",
    "QLearningGymModule",
    "REINFORCEGymModule",
    "ReplayUpdates",
]
