"""TokenMassRecorder: a summary token's attention over the prompt, summed over layers, its top positions kept."""

from __future__ import annotations

import torch

from unlimisum.decoder_only.token_mass import DENSE_BYTES, TokenMassRecorder, rows_per_forward


def test_layers_add_up_per_position_and_the_strongest_are_kept():
    record = TokenMassRecorder(10, top=3)
    # row 0 (one forward, two layers; position 4 twice in one layer: two KV heads retrieved it)
    record.add(0, torch.tensor([[4, 4, 7]]), torch.tensor([[0.2, 0.3, 0.1]]))
    record.add(0, torch.tensor([[7, 1]]), torch.tensor([[0.6, 0.05]]))
    # rows 1-2 in one forward (the reread pass's chunks), then row 3
    record.add(1, torch.tensor([[2, 3], [9, 9]]), torch.tensor([[1.0, 0.5], [0.25, 0.25]]))
    record.add(3, torch.tensor([[0]]), torch.tensor([[2.0]]))
    coverage, token_mass = record.results(4)
    assert token_mass.positions.shape == token_mass.mass.shape == (4, 3)
    assert token_mass.positions[0].tolist()[:2] == [7, 4]  # 0.7 and 0.5: summed over layers and heads
    torch.testing.assert_close(token_mass.mass[0], torch.tensor([0.7, 0.5, 0.05]))
    assert token_mass.positions[1].tolist()[:2] == [2, 3] and token_mass.positions[2, 0] == 9
    torch.testing.assert_close(token_mass.mass[2, 0], torch.tensor(0.5))
    expected = torch.zeros(10)
    expected[[0, 1, 2, 3, 4, 7, 9]] = torch.tensor([2.0, 0.05, 1.0, 0.5, 0.5, 0.7, 0.5])
    torch.testing.assert_close(coverage, expected)


def test_rows_past_the_summary_are_left_out_and_missing_ones_have_no_mass():
    record = TokenMassRecorder(5, top=2)
    for row in range(3):
        record.add(row, torch.tensor([[row]]), torch.tensor([[1.0]]))
    _, token_mass = record.results(2)
    assert token_mass.positions.shape == (2, 2)
    record = TokenMassRecorder(5, top=2)
    record.add(0, torch.tensor([[1]]), torch.tensor([[1.0]]))
    _, token_mass = record.results(3)
    assert token_mass.mass.shape == (3, 2) and float(token_mass.mass[1:].abs().sum()) == 0.0


def test_the_reread_reads_no_more_rows_than_its_dense_mass_allows():
    assert rows_per_forward(4_096, 64) == 64
    long = rows_per_forward(1_000_000, 64)
    assert long * 4 * 1_000_000 <= DENSE_BYTES and long >= 1
    assert rows_per_forward(10**12, 64) == 1
