# waveplan_verl_plugin.py -- on the PYTHONPATH of every veRL worker
import os

import torch

from waveplan.planner import Planner
from waveplan.planner.integrations.verl import install

TP = int(os.environ.get("WAVEPLAN_TP", "1"))
planner = Planner.from_hf_config(os.environ["WAVEPLAN_HF_CONFIG"], tp=TP, sequence_parallel=TP > 1,
                                 recompute="full",
                                 lora_rank=int(os.environ.get("WAVEPLAN_LORA_RANK", "16")),
                                 profiles_path=os.environ.get("WAVEPLAN_PROFILES"))
RESERVE = float(os.environ.get("WAVEPLAN_RESERVE_GIB", "6")) * 2**30


def free_bytes():
    """What a wave may use: the GPU's free memory now, less a reserve; without a GPU (a CPU
    dry run of the batching), the budget WAVEPLAN_FREE_GIB states."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0] - RESERVE
    return float(os.environ["WAVEPLAN_FREE_GIB"]) * 2**30


def model_parallel_group():
    """TP x PP x CP peers share one budget and one plan (resolved when veRL splits)."""
    if TP == 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_model_parallel_group()


handle = install(planner, free_bytes, model_parallel_group=model_parallel_group)
