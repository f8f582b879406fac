"""veRL's FSDP engine with the fsdp framework: verl 0.9.1's own `prepare_dynamic_batch` and
`restore_dynamic_batch` (what its FSDP actor, `dp_actor`, calls with `use_dynamic_bsz`) driven
through `install(model, ...)` with a small PEFT-wrapped transformers Llama on the CPU: the
micro-batches are the plan's waves, each fits the budget, and the per-token log-probs the model
computes micro-batch by micro-batch come back in the batch's order, equal to one full-batch run."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")
pytest.importorskip("peft")

from verl import DataProto  # noqa: E402
from verl.utils import seqlen_balancing as vsb  # noqa: E402

from waveplan.planner import Planner  # noqa: E402
from waveplan.planner.integrations import verl as adapter  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def small_peft_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def log_probs(model, ids, mask):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp * mask[:, 1:]


def test_verl_prepare_dynamic_batch_under_the_fsdp_planner():
    model = small_peft_llama()
    model.eval()
    planner = Planner.from_hf_model(model, fsdp=2)
    assert planner.model.fsdp_layout.attn == "sdpa" and planner.model.fsdp_layout.checkpointing
    assert planner.model.fsdp_layout.fsdp == 2 and planner.model.lora.slots[0].rank == 4
    rng = np.random.default_rng(3)
    lengths = [int(x) for x in rng.integers(8, 96, 12)]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.from_numpy(rng.integers(1, 512, n))
        mask[r, :n] = 1
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    # a budget that holds about a third of the batch: the whole batch as one wave, over 3
    whole = adapter.plan_micro_batches(data.batch, planner=planner, free_bytes=2**40)
    free = whole.waves[0].admitted_bytes // 3
    handle = adapter.install(model, free_bytes=free, fsdp=2)
    try:
        micro, idx = vsb.prepare_dynamic_batch(data, max_token_len=1 << 20)
        assert handle.calls == 1 and len(micro) == handle.last_plan.num_waves > 1
        assert all(w.admitted_bytes <= free for w in handle.last_plan.waves)
        assert sorted(i for part in idx for i in part) == list(range(len(lengths)))
        outs = [log_probs(model, mb.batch["input_ids"], mb.batch["attention_mask"]) for mb in micro]
        restored = vsb.restore_dynamic_batch(torch.cat(outs), idx)
    finally:
        handle.restore()
    assert vsb.rearrange_micro_batches is not handle.rearrange
    assert torch.allclose(restored, log_probs(model, ids, mask), atol=1e-5)


def test_a_padded_batch_is_refused_by_a_packed_planner_and_priced_by_a_padded_one():
    """veRL's `use_remove_padding=False` runs [B, L] rows: a planner that prices packed rows
    would price a wave of uneven sequences under, so the adapter refuses the batch in one line;
    `install(..., remove_padding=False)` prices every sequence at the step's longest
    (docs/memory-model.md#fsdp-verl-options)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from waveplan.pricing.errors import ConfigError
    from waveplan.pricing.fsdp.model import PADDED_GAP

    model = small_peft_llama()
    lengths = [90, 12, 30, 7]
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    td = TensorDict({"input_ids": torch.ones_like(mask), "attention_mask": mask}, batch_size=[len(lengths)])
    tu.assign_non_tensor(td, use_remove_padding=False)
    packed = Planner.from_hf_model(model, fsdp=2)
    with pytest.raises(ConfigError, match="use_remove_padding"):
        adapter.plan_micro_batches(td, planner=packed, free_bytes=2**40)
    padded = Planner.from_hf_model(model, fsdp=2, remove_padding=False)
    assert padded.model.basis == "conservative" and PADDED_GAP in padded.model.gaps
    plan = adapter.plan_micro_batches(td, planner=padded, free_bytes=2**40)
    # one wave of four sequences padded to 90 rows each
    assert plan.num_waves == 1 and plan.waves[0].size.logical_rows == 4 * max(lengths)
    handle = adapter.install(model, free_bytes=2**40, fsdp=2, remove_padding=False)
    try:
        assert not handle.planner.model.fsdp_layout.remove_padding
    finally:
        handle.restore()
