"""On-policy distillation. With no arguments: the shipped GRPO-trained tiny model (``tiny-sort-grpo``) teaches the
SFT-warmed one it was trained from (``tiny-sort``) on the bundled sorting task; the student's and the teacher's
held-out accuracy are printed before and after.

    python recipes/distill.py
    python recipes/distill.py --model.objective gkd --model.beta 0.5
    python recipes/distill.py --config configs/distill/smollm2-arith.yaml
    python recipes/distill.py --print_config
"""

from align.cli import run_recipe
from align.data.prompts import PromptDataModule
from align.modules.distill import DistillModule

if __name__ == "__main__":
    run_recipe("distill", DistillModule, PromptDataModule)
