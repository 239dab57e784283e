"""Classic RL on Gymnasium: PPO, A2C, REINFORCE, DQN and Q-learning on align's math, loop, logging and checkpoints."""

from align.gym.base import ClassicRLModule, Evaluation
from align.gym.dqn import DQNGymModule, Exploration, QLearningGymModule
from align.gym.onpolicy import A2CGymModule, Network, OnPolicyModule, PPOGymModule, REINFORCEGymModule

__all__ = ["A2CGymModule", "ClassicRLModule", "DQNGymModule", "Evaluation", "Exploration", "Network", "OnPolicyModule",
           "PPOGymModule", "QLearningGymModule", "REINFORCEGymModule"]
