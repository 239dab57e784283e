"""Supervised fine-tuning. With no arguments: the embedded tiny model on the bundled sorting task.

python recipes/sft.py
python recipes/sft.py --config configs/sft/qwen2.5-0.5b-lora.yaml --trainer.max_steps 100
python recipes/sft.py --print_config
"""

from align.cli import run_recipe
from align.data import SFTDataModule
from align.modules import SFTModule

if __name__ == "__main__":
    run_recipe("sft", SFTModule, SFTDataModule)
