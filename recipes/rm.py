"""Reward-model training. With no arguments: the embedded tiny model on the bundled sorting preferences.

    python recipes/rm.py
    python recipes/rm.py --config configs/rm/qwen2.5-0.5b-lora.yaml --trainer.max_steps 100
    python recipes/rm.py --print_config

The trained model is exported to ``<run dir>/export``; name it as a reward with
``align.rewards.RewardModelScorer`` (``path: <run dir>/export``).
"""

from align.cli import run_recipe
from align.data.preference import PreferenceDataModule
from align.modules.reward import RewardModule

if __name__ == "__main__":
    run_recipe("rm", RewardModule, PreferenceDataModule)
