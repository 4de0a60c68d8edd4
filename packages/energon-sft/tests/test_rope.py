"""M-RoPE position ids per packed part, against ids worked out by hand from the Qwen2-VL rule."""

from __future__ import annotations

import pytest
import torch

from energon_sft import mrope_position_ids


def _row(*values: int) -> torch.Tensor:
    return torch.tensor([values])


def test_text_image_text_then_a_second_part_and_padding() -> None:
    # Part 1: 2 text tokens, a (1, 4, 6) image at merge 2 (a 2 x 3 grid: 6 tokens), 2 text.
    # Part 2: 1 text token, a (1, 2, 2) image (1 token), 1 text. Then 2 padding tokens.
    positions = _row(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 0, 0)
    image = _row(0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0).bool()
    grids = torch.tensor([[1, 4, 6], [1, 2, 2]])
    got = mrope_position_ids(positions, image, grids, spatial_merge_size=2)
    # The image starts at 2; rows 0-1 and columns 0-2 of its grid add to 2; text resumes at
    # 2 + max(2, 3) = 5. Part 2 restarts at 0; its image sits at 1 and text resumes at 2.
    time = _row(0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 0, 1, 2, 0, 0)
    height = _row(0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 0, 1, 2, 0, 0)
    width = _row(0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0)
    assert torch.equal(got, torch.stack([time, height, width]))


def test_text_only_rows_repeat_the_1d_ids_and_grids_follow_row_order() -> None:
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 3, 4]])
    image = torch.tensor([[0, 0, 0, 0, 0], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool()
    grids = torch.tensor([[1, 2, 4], [1, 2, 2]])  # row 1's image first, then row 2's
    got = mrope_position_ids(positions, image, grids, spatial_merge_size=2)
    assert torch.equal(got[:, 0], positions[0].expand(3, -1))
    # Row 1: a 1 x 2 merged grid at 1, text resumes at 1 + 2 = 3; padding stays 0.
    assert got[:, 1].tolist() == [[0, 1, 1, 3, 0], [0, 1, 1, 3, 0], [0, 1, 2, 3, 0]]
    # Row 2: a 1 x 1 grid at 0, text resumes at 0 + 1 = 1 (no shift).
    assert torch.equal(got[:, 2], positions[2].expand(3, -1))


def test_two_adjacent_images_in_one_run_are_split_by_their_grids() -> None:
    positions = _row(0, 1, 2, 3, 4, 5)
    image = _row(0, 1, 1, 1, 1, 0).bool()
    got = mrope_position_ids(
        positions, image, torch.tensor([[1, 2, 4], [1, 2, 4]]), spatial_merge_size=2
    )
    # Each (1, 2, 4) image is a 1 x 2 grid: 2 tokens, advancing by max(1, 2) = 2.
    assert got[:, 0].tolist() == [
        [0, 1, 1, 3, 3, 5],
        [0, 1, 1, 3, 3, 5],
        [0, 1, 2, 3, 4, 5],
    ]


@pytest.mark.parametrize(
    ("image", "grids", "match"),
    [
        (_row(0, 1, 0, 0).bool(), torch.tensor([[1, 2, 4]]), "do not match"),
        (_row(0, 1, 0, 0).bool(), torch.zeros((0, 3), dtype=torch.int64), "grids of every"),
        (_row(0, 0, 0, 0).bool(), torch.tensor([[1, 2, 2]]), "every grid needs"),
    ],
)
def test_mismatched_tokens_and_grids_raise(
    image: torch.Tensor, grids: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        mrope_position_ids(_row(0, 1, 2, 3), image, grids, spatial_merge_size=2)


def test_bad_shapes_and_merge_size_raise() -> None:
    with pytest.raises(ValueError, match="must both be"):
        mrope_position_ids(
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(4).bool(),
            torch.zeros((0, 3)),
            spatial_merge_size=2,
        )
    with pytest.raises(ValueError, match="spatial_merge_size"):
        mrope_position_ids(_row(0, 1), _row(0, 0).bool(), torch.zeros((0, 3)), spatial_merge_size=0)
