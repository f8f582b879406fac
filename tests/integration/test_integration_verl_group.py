"""The veRL adapter's data-parallel balance (`integrations.verl.balance_batch`, `install(...,
balance_dp=True)`) against verl 0.9.1's own functions on the CPU:

* the batch, reordered, is cut by veRL's `DataProto.chunk` into the group plan's shares (equal
  counts); each rank's share, split by the adapter's `plan_micro_batches` as the worker does,
  needs exactly the group's wave count, never more than veRL's own balance
  (`get_seqlen_balanced_partitions` on `calculate_workload`) followed by the same split, MAX;
* `install(balance_dp=True)` replaces the driver's `RayPPOTrainer._balance_batch` (a stand-in
  class here: the driver module needs packages the CPU environment lacks) and `restore` puts
  it back; `keep_minibatch` falls back to veRL's own balance.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from verl.protocol import DataProto  # noqa: E402
from verl.utils import seqlen_balancing as vsb  # noqa: E402

from waveplan.planner import Planner  # noqa: E402
from waveplan.planner.integrations import verl as adapter  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

GIB = 2**30


@pytest.fixture(scope="module")
def planner():
    return Planner.from_preset("qwen3-8b", tp=1, recompute="full", lora_rank=16)


def data(lengths, seed=0):
    rng = np.random.default_rng(seed)
    n, width = len(lengths), int(max(lengths))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.from_numpy(rng.integers(1, 50_000, (n, width))) * mask
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "tag": torch.arange(n)})


def long_tail(n, seed):
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(900 * np.exp(1.1 * rng.standard_normal(n))), 32, 9000).astype(int).tolist()


def split_waves(planner, td, free):
    return adapter.plan_micro_batches(td, planner=planner, free_bytes=free).num_waves


@pytest.mark.parametrize("dp, n, seed, free", [(2, 16, 0, 4 * GIB), (4, 32, 1, int(5.25 * GIB))])
def test_balance_batch_against_verls_balance(planner, dp, n, seed, free):
    lengths = long_tail(n, seed)
    batch = data(lengths, seed)
    metrics: dict = {}
    group = adapter.balance_batch(batch, dp, planner=planner, free_bytes=free, metrics=metrics)
    assert any(k.startswith("global_seqlen") for k in metrics)
    chunks = batch.chunk(dp)
    assert [c.batch["tag"].tolist() for c in chunks] == [list(s) for s in group.shares]
    assert {len(s) for s in group.shares} == {n // dp}
    waves = [split_waves(planner, c.batch, free) for c in chunks]
    assert waves == [group.num_waves] * dp and group.num_waves >= 2
    # veRL's own balance, then the same split on each rank, MAX count
    work = vsb.calculate_workload(torch.tensor(lengths)).tolist()
    parts = vsb.get_seqlen_balanced_partitions(work, dp, equal_size=True)
    theirs = max(split_waves(planner, data([lengths[i] for i in p]).batch, free) for p in parts)
    assert group.num_waves <= theirs


def test_install_balance_dp_replaces_the_drivers_balance(planner, monkeypatch):
    calls = []

    class RayPPOTrainer:   # stand-in: veRL's driver class, with its methods' signatures
        actor_rollout_wg = object()
        use_prefix_grouper = False

        def _get_dp_size(self, worker_group, role):
            return 2

        def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen",
                           keep_minibatch=False):
            calls.append(keep_minibatch)

    original = RayPPOTrainer._balance_batch
    module = types.ModuleType(adapter._DRIVER)
    module.RayPPOTrainer = RayPPOTrainer
    monkeypatch.setitem(sys.modules, adapter._DRIVER, module)
    handle = adapter.install(planner, 6 * GIB, balance_dp=True)
    try:
        lengths = long_tail(12, 4)
        batch = data(lengths)
        metrics: dict = {}
        RayPPOTrainer()._balance_batch(batch, metrics)
        assert handle.last_group is not None and handle.last_group.dp == 2
        assert batch.batch["tag"].tolist() == [i for s in handle.last_group.shares for i in s]
        assert calls == []
        RayPPOTrainer()._balance_batch(batch, metrics, keep_minibatch=True)
        assert calls == [True]
    finally:
        handle.restore()
    assert RayPPOTrainer._balance_batch is original
