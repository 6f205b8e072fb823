"""bench/wan_frontier.py: the configuration keys it parses, and which DDP each is compared with."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
frontier = importlib.import_module("wan_frontier")


def test_sgd_dgc_keys_name_a_topk_density_in_percent() -> None:
    config = frontier.BY_KEY["sgd-dgc-topk0.1"]
    assert (config.compression, config.density) == ("topk", 0.001)
    assert config.name == "SGD-DGC top-k 0.1 %"
    bad_keys = ("sgd-dgc-topk0", "sgd-dgc-topk100.5", "sgd-dgc-topk", "sgd-dgc-topk.1", "dgc-topk1")
    for bad in bad_keys:
        assert bad not in frontier.BY_KEY
        assert frontier.config_of(bad) is None


@given(st.integers(1, 100_000))
def test_any_density_up_to_100_percent_parses(thousandths: int) -> None:
    text = f"{thousandths / 1000:g}"
    config = frontier.sgd_dgc_config(f"sgd-dgc-topk{text}")
    assert config is not None
    assert config.density == float(text) / 100


def test_torchft_keys_name_h() -> None:
    config = frontier.BY_KEY["torchft-diloco128"]
    assert (config.compression, config.every) == ("torchft", 128)
    assert frontier.torchft_config("torchft-diloco0") is None
    assert frontier.torchft_config("torchft-diloco") is None


def test_sgd_configurations_train_with_sgd_and_compare_with_sgd_ddp() -> None:
    quick = frontier.QUICK
    assert quick.optimizer == "adamw"
    sgd = frontier.setup_for("sgd-dgc-topk0.1", quick)
    assert (sgd.optimizer, sgd.lr) == ("sgd", 0.1)
    assert frontier.setup_for("sgd-ddp", quick).optimizer == "sgd"
    assert frontier.setup_for("outer32-int4", quick) == quick
    assert frontier.setup_for("torchft-diloco32", quick) == quick
    assert frontier.baseline_of("sgd-dgc-topk1") == "sgd-ddp"
    assert frontier.baseline_of("torchft-diloco32") == "ddp"


def test_baselines_are_added_first_and_once() -> None:
    assert frontier.with_baselines(["sgd-dgc-topk0.1"]) == ["ddp", "sgd-ddp", "sgd-dgc-topk0.1"]
    assert frontier.with_baselines(["outer8-int4", "ddp"]) == ["outer8-int4", "ddp"]
    assert frontier.with_baselines(["sgd-ddp", "topk1"]) == ["ddp", "sgd-ddp", "topk1"]
