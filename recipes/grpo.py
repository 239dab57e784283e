"""GRPO. With no arguments: the shipped SFT-warmed tiny model on the bundled sorting task, exact-match reward.

python recipes/grpo.py
python recipes/grpo.py --config configs/grpo/qwen2.5-0.5b-gsm8k.yaml
python recipes/grpo.py --model.kl.coef 0.04 --trainer.max_steps 100
python recipes/grpo.py --print_config
"""

from align.cli import run_recipe
from align.data.prompts import PromptDataModule
from align.modules.grpo import GRPOModule

if __name__ == "__main__":
    run_recipe("grpo", GRPOModule, PromptDataModule)
