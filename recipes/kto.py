"""KTO on unpaired examples. With no arguments: the shipped SFT-warmed tiny model on the bundled sorting
preferences, each pair read as one desirable and one undesirable example.

    python recipes/kto.py
    python recipes/kto.py --config configs/kto/tiny.yaml --model.init_args.desirable_weight 1.2
    python recipes/kto.py --print_config
"""

from align.cli import run_recipe
from align.data.preference import UnpairedDataModule
from align.modules.kto import KTOModule

if __name__ == "__main__":
    run_recipe("kto", KTOModule, UnpairedDataModule)
