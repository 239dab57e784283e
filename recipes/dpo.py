"""Direct preference optimisation. With no arguments: the embedded tiny model on the bundled sorting preferences.

python recipes/dpo.py
python recipes/dpo.py --config configs/dpo/qwen2.5-0.5b-lora.yaml --trainer.max_steps 100
python recipes/dpo.py --model.init_args.loss_type ipo --print_config
"""

from align.cli import run_recipe
from align.data.preference import PreferenceDataModule
from align.modules.dpo import DPOModule

if __name__ == "__main__":
    run_recipe("dpo", DPOModule, PreferenceDataModule)
