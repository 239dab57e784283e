"""Online DPO. With no arguments: the shipped SFT-warmed tiny model on the bundled sorting task, graded reward.

python recipes/online_dpo.py
python recipes/online_dpo.py --config configs/online_dpo/tiny.yaml --model.beta 0.2
python recipes/online_dpo.py --model.loss_type ipo --trainer.max_steps 100
python recipes/online_dpo.py --print_config
"""

from align.cli import run_recipe
from align.data.prompts import PromptDataModule
from align.modules.online_dpo import OnlineDPOModule

if __name__ == "__main__":
    run_recipe("online_dpo", OnlineDPOModule, PromptDataModule)
