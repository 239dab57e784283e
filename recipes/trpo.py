"""TRPO. With no arguments: the shipped SFT-warmed tiny model on the bundled sorting task, exact-match reward.

python recipes/trpo.py
python recipes/trpo.py --model.trust_region.max_kl 0.05 --trainer.max_steps 60
python recipes/trpo.py --print_config
"""

from align.cli import run_recipe
from align.data.prompts import PromptDataModule
from align.modules.trpo import TRPOModule

if __name__ == "__main__":
    run_recipe("trpo", TRPOModule, PromptDataModule)
