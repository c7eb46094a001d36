"""A rank file's zip archive (stagesafe/zero/rank_file.py): every record read with a limit from what it can be,
and records of one name refused."""

from __future__ import annotations

import os

import pytest
import torch
from _hostile import byteorder_bomb, duplicate_pickle, rewrite_rank_file, traced_peak, write_zero_checkpoint

from stagesafe.errors import CheckpointFormatError
from stagesafe.zero.checkpoint import open_zero_checkpoint

pytestmark = pytest.mark.timeout(60)

NAME = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _checkpoint(tmp_path) -> tuple[str, str]:
    src = write_zero_checkpoint(str(tmp_path / "ckpt"), {"w": torch.arange(6.0)})
    return src, os.path.join(src, "global_step1", NAME)


@pytest.mark.parametrize("inflated", [2**31, 2**24], ids=["2GiB", "16MiB"])
def test_a_byteorder_record_that_inflates_far_past_its_size_is_refused_having_inflated_a_few_kilobytes(
    tmp_path, inflated
):
    """Deflated 2 MB, inflating to 2 GiB, declaring 6 bytes: once read whole (13 s, 2 GB)."""
    src, path = _checkpoint(tmp_path)
    byteorder_bomb(path, inflated)
    bad_crc = rf"{NAME} cannot be read .*Bad CRC-32 for file '.*/byteorder'"  # it inflates to zeros, not "little"
    with traced_peak() as peak, pytest.raises(CheckpointFormatError, match=bad_crc):
        open_zero_checkpoint(src)
    assert peak[0] < 16 * 2**20


def test_a_byteorder_record_declaring_more_than_a_byte_order_is_refused_unread(tmp_path):
    import zlib

    src, path = _checkpoint(tmp_path)

    def change(records: list) -> None:
        for i, (name, *_rest) in enumerate(records):
            if name.endswith("/byteorder"):
                stored = b"little" + bytes(2**20)
                records[i] = (name, stored, 0, len(stored), zlib.crc32(stored))

    rewrite_rank_file(path, change)
    with pytest.raises(CheckpointFormatError, match=r"byteorder holds more than the 16 bytes a byte order takes"):
        open_zero_checkpoint(src)


def test_two_records_of_one_name_are_refused(tmp_path):
    """torch takes the last of two data.pkl records, stagesafe took the first: the same file, two readings."""
    src, path = _checkpoint(tmp_path)
    duplicate_pickle(path, b"\x80\x02}.")
    with pytest.raises(CheckpointFormatError, match=rf"{NAME}: it holds two zip records named '[^']*/data.pkl'"):
        open_zero_checkpoint(src)


def test_a_rewritten_archive_without_damage_still_reads(tmp_path):
    """The helper that writes the crafted archives writes ones the reader accepts when nothing is changed."""
    src, path = _checkpoint(tmp_path)
    rewrite_rank_file(path, lambda records: None)
    with open_zero_checkpoint(src) as ckpt:
        assert torch.equal(ckpt.read("w"), torch.arange(6.0))
