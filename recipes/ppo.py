"""PPO-RLHF. With no arguments: the shipped SFT-warmed tiny model on the bundled sorting task, rewarded by the
shipped reward model (``tiny-sort-rm``, trained by ``recipes/rm.py``), with the true exact-match reward reported
next to it.

    python recipes/ppo.py
    python recipes/ppo.py --config configs/ppo/qwen2.5-0.5b-lora.yaml
    python recipes/ppo.py --model.kl.target 6 --trainer.max_steps 200
    python recipes/ppo.py --print_config
"""

from align.cli import run_recipe
from align.data.prompts import PromptDataModule
from align.modules.ppo import PPOModule

if __name__ == "__main__":
    run_recipe("ppo", PPOModule, PromptDataModule)
