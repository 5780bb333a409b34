"""Stop strings: finding them as they complete, for the rows of a running batch that have some.

A string counts when an occurrence ends in the newest token's text (as vLLM does) and at least
``min_tokens`` tokens were generated. Only a window of recent tokens is decoded (the longest stop
string plus a few tokens), so the cost does not grow with the output length; a stop string split
by more than that many empty-text tokens would be missed.
"""

from __future__ import annotations

import torch

from arctic_platform.contract.sampling_params import SamplingParams

# Tokens decoded around the newest one when looking for stop strings, beyond the string's length.
WINDOW_SLACK = 8


def stop_string_hits(
    tokenizer,
    params: list[SamplingParams | None],
    tokens_out: torch.Tensor,
    column: torch.Tensor,
    candidates: torch.Tensor,
) -> tuple[torch.Tensor, dict[int, str]]:
    """Which rows just completed a stop string: ``(bool [rows], {row: the string})``.

    ``params[row]`` holds the row's stop strings (None: it has none), ``tokens_out[row,
    column[row]]`` is its newest token, and only rows marked in ``candidates`` are looked at.
    """
    hit = torch.zeros_like(candidates)
    rows = [row for row, p in enumerate(params) if p is not None]
    if not rows:
        return hit, {}
    wanted = candidates[rows].tolist()
    rows = [row for row, keep in zip(rows, wanted, strict=True) if keep]
    if not rows:
        return hit, {}
    # Each row's own window (so a row's result does not depend on the others in the batch).
    windows = [max(len(s) for s in params[row].stop) + WINDOW_SLACK for row in rows]
    window = max(windows)
    index = torch.tensor(rows, device=tokens_out.device)
    ends = column[index] + 1
    columns = ends[:, None] - window + torch.arange(window, device=tokens_out.device)[None]
    tails = tokens_out[index[:, None], columns.clamp(min=0)].tolist()
    matched: dict[int, str] = {}
    for row, own, end, tail in zip(rows, windows, ends.tolist(), tails, strict=True):
        ids = tail[window - min(own, end) :]
        skip_special = params[row].skip_special_tokens
        text, before = (
            tokenizer.decode(
                part, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
            )
            for part in (ids, ids[:-1])
        )
        for stop in params[row].stop:
            if find_new(stop, text, before) >= 0:
                hit[row] = True
                matched[row] = stop
                break
    return hit, matched


def find_new(stop: str, text: str, before: str) -> int:
    """Where ``stop`` occurs in ``text`` ending within its newest token (``before`` is the text
    without that token), as vLLM matches stop strings; -1 if it does not."""
    return text.find(stop, max(0, len(before) - len(stop) + 1))
