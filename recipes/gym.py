"""Classic RL on Gymnasium. With no arguments: PPO on CartPole-v1 (configs/gym/ppo-cartpole.yaml, about 30 s).

python recipes/gym.py
python recipes/gym.py --config configs/gym/dqn-cartpole.yaml
python recipes/gym.py --config configs/gym/qlearning-frozenlake.yaml
python recipes/gym.py --model.env.id Acrobot-v1 --model.total_steps 200000
python recipes/gym.py --print_config
"""

from align.cli import run_recipe
from align.gym import ClassicRLModule

if __name__ == "__main__":
    # A --config replaces the default (each config names its own module), rather than adding to it.
    run_recipe("gym", ClassicRLModule, None, default_config="ppo-cartpole.yaml", layered=False)
