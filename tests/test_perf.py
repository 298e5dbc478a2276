"""Model FLOPs per token and the TPU peak table: the two halves of the MFU figure."""

from __future__ import annotations

import pytest

from workloads.config import ModelConfig, padded_vocab_size
from workloads.perf import model_flops_per_token, tpu_peak


def test_model_flops_count_the_tokenizers_vocabulary_not_the_padded_table():
    # The byte tokenizer's 257 ids are padded to 384 rows; the 127 extra rows are work the
    # hardware does, not model FLOPs, so MFU must not count them.
    cfg = ModelConfig(size="tiny", max_seq_len=128)
    assert padded_vocab_size(257) > padded_vocab_size(256)
    one_more_token = model_flops_per_token(cfg, 257, 128) - model_flops_per_token(cfg, 256, 128)
    assert one_more_token == 3 * 2 * cfg.d_model  # forward and backward of one logit row


@pytest.mark.parametrize(
    "kind, devices, chips_peak",
    [
        ("TPU v5 lite", 8, 8 * 197e12),  # v5e: a device per chip
        ("TPU v4", 4, 4 * 275e12),  # megacore: a chip's two cores are one device
        ("TPU v5p", 4, 4 * 459e12),
        ("TPU v6 lite", 8, 8 * 918e12),
        ("TPU v3", 8, 4 * 123e12),  # two devices per chip: 8 devices are 4 chips
        ("TPU v2", 8, 4 * 45e12),
    ],
)
def test_the_tpu_peak_is_per_chip_whatever_the_devices_per_chip(kind, devices, chips_peak):
    peak = tpu_peak(kind, devices)
    assert peak is not None and peak.flops_per_s == pytest.approx(chips_peak)


def test_an_unknown_tpu_kind_has_no_table_peak():
    assert tpu_peak("TPU v9 turbo", 8) is None
