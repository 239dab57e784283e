"""Classic RL on Gymnasium environments, on the same math, loop, logging and checkpoints as the language-model
algorithms: PPO, A2C and REINFORCE (:mod:`.onpolicy`), DQN (:mod:`.dqn`) and tabular Q-learning
(:mod:`.qlearning`)."""

from align.modules.classic.base import ClassicRLModule, Evaluation
from align.modules.classic.dqn import DQNGymModule, Exploration, QLearningGymModule
from align.modules.classic.onpolicy import A2CGymModule, Network, OnPolicyModule, PPOGymModule, REINFORCEGymModule

__all__ = ["A2CGymModule", "ClassicRLModule", "DQNGymModule", "Evaluation", "Exploration", "Network", "OnPolicyModule",
           "PPOGymModule", "QLearningGymModule", "REINFORCEGymModule"]
