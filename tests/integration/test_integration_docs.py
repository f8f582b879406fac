"""docs/integration.md: the code blocks marked `docs-test` run as written.

* `step`: the Step constructors;
* `verl-config`: every key of the veRL configuration exists in veRL's own packaged trainer
  configuration, and the environment it sets names the plugin;
* `verl-plugin`: the plugin module, imported by veRL itself (`VERL_USE_EXTERNAL_MODULES`) in a
  fresh process, puts waveplan under veRL's engine (`prepare_micro_batches`);
* `megatron-loop`: the training loop trains the tiny CPU Megatron-core GPT (the loss falls).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"
HF_CONFIG = Path(__file__).resolve().parents[1] / "data" / "hf" / "qwen3-8b.json"
TIMEOUT_S = 600

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def block(name: str) -> tuple[str, str]:
    """(language, code) of the fenced block after `<!-- docs-test: name -->`."""
    found = re.findall(r"<!-- docs-test: ([\w-]+) -->\s*```(\w+)\n(.*?)```", DOC.read_text(), re.S)
    blocks = {n: (lang, code) for n, lang, code in found}
    assert name in blocks, f"docs/integration.md has no docs-test block {name!r} (has {sorted(blocks)})"
    return blocks[name]


def test_step_block_runs():
    pytest.importorskip("torch")
    lang, code = block("step")
    assert lang == "python"
    exec(compile(code, "docs/integration.md:step", "exec"), {})


def _leaves(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, prefix + (key,))
    else:
        yield prefix, node


def test_verl_config_keys_are_verls_own():
    verl = pytest.importorskip("verl")
    yaml = pytest.importorskip("yaml")
    lang, text = block("verl-config")
    assert lang == "yaml"
    ours = yaml.safe_load(text)
    base_path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_megatron_trainer.yaml"
    base = yaml.safe_load(base_path.read_text())
    env_prefix = ("ray_kwargs", "ray_init", "runtime_env", "env_vars")
    for path, value in _leaves(ours):
        if path[:len(env_prefix)] == env_prefix:
            continue  # free-form: environment variables of every Ray worker
        node = base
        for key in path:
            assert isinstance(node, dict) and key in node, f"veRL has no config key {'.'.join(path)}"
            node = node[key]
        interpolated = isinstance(node, str) and node.startswith("${")
        assert type(node) is type(value) or node is None or interpolated, (path, node, value)
    runtime_env = base["ray_kwargs"]["ray_init"]["runtime_env"]
    assert isinstance(runtime_env, dict)   # veRL merges our env_vars into its own
    env = ours["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert env["VERL_USE_EXTERNAL_MODULES"] == "waveplan_verl_plugin"
    plugin = block("verl-plugin")[1]
    for name in env:
        if name.startswith("WAVEPLAN_"):
            assert name in plugin, f"the plugin does not read {name}"


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_verl_plugin_block_is_the_example_plugin():
    assert block("verl-plugin")[1] == (EXAMPLES / "waveplan_verl_plugin.py").read_text()


@pytest.mark.slow
def test_verl_plugin_is_installed_by_verl_itself():
    """examples/verl_driver.py: veRL imports the plugin (VERL_USE_EXTERNAL_MODULES) in a fresh
    process and splits a batch into the waves of one plan."""
    pytest.importorskip("verl")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(EXAMPLES / "verl_driver.py"), "--config", str(HF_CONFIG),
                           "--free-gib", "12", "--json"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["plans"] == 1 and result["micro_batches"] == result["waves"] > 1, result
    assert sorted(i for part in result["indices"] for i in part) == list(range(result["sequences"]))


@pytest.mark.slow
@pytest.mark.megatron
def test_megatron_loop_trains_the_tiny_model():
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    import megatron_tiny

    from waveplan.pricing.measure.megatron_shim import init_single_process

    lang, code = block("megatron-loop")
    assert lang == "python"
    scope: dict = {}
    exec(compile(code, "docs/integration.md:megatron-loop", "exec"), scope)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with init_single_process(1):
            model, _ = megatron_tiny.build(seed=3)
            planner = scope["make_planner"](model, backend="torch-cpu", head="full-native")
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
            sequences, prompts = megatron_tiny.grpo(np.random.default_rng(4))
            losses = scope["train"](model, optimizer, planner, [(sequences, prompts)] * 4, 3 * 2**20)
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert losses[-1] < losses[0], losses
    assert sum(p.count for p in planner.profiles) >= 4   # every wave's peak was observed
