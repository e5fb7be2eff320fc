"""What the thinker hands the talker (QWEN3_OMNI.md §1 steps 4–7), built incrementally.

* the talker prefill, once the first reply token exists: the user turns' rows (text rows through
  ``talker.text_projection`` of the thinker embeddings, placeholder rows through
  ``talker.hidden_projection`` of the accept-layer states) followed by the 9 assistant positions;
* one projected text embedding per later reply token (the talker's ``trailing_text_hidden``);
* ``tts_eos`` once the reply is over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engines.qwen3_omni.model import LoadedModel
from engines.qwen3_omni.prompt import user_mask


def thinker_embed(loaded: LoadedModel, ids: Sequence[int]) -> torch.Tensor:
    """``thinker.embed_tokens`` of ``ids``: [1, len(ids), thinker_hidden]."""
    embed = loaded.model.thinker.model.language_model.embed_tokens
    return embed(torch.tensor([list(ids)], dtype=torch.long))


def thinker_embed_rows(loaded: LoadedModel, ids: Sequence[int]) -> torch.Tensor:
    """``thinker.embed_tokens`` of one id per row: [len(ids), 1, thinker_hidden]."""
    embed = loaded.model.thinker.model.language_model.embed_tokens
    return embed(torch.tensor([[i] for i in ids], dtype=torch.long))


def project_text(loaded: LoadedModel, embeds: torch.Tensor) -> torch.Tensor:
    return loaded.model.talker.text_projection(embeds)


def project_tokens(loaded: LoadedModel, ids: Sequence[int]) -> torch.Tensor:
    """``talker.text_projection(thinker.embed_tokens(ids))``: [1, len(ids), talker_hidden]."""
    return project_text(loaded, thinker_embed(loaded, ids))


def special_text_rows(loaded: LoadedModel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tts_bos, tts_eos, tts_pad rows, each [1, 1, talker_hidden]."""
    ids = loaded.ids
    rows = project_tokens(loaded, [ids.tts_bos, ids.tts_eos, ids.tts_pad])
    return rows[:, 0:1], rows[:, 1:2], rows[:, 2:3]


def talker_prefill(
    loaded: LoadedModel,
    prompt_ids: Sequence[int],
    accept_hidden: Mapping[int, torch.Tensor],
    first_token: int,
    speaker_id: int,
    special: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The talker's prompt embeddings [1, L_user + 9, talker_hidden]. ``special``: the
    :func:`special_text_rows` when the caller keeps them (they never change)."""
    ids = loaded.ids
    talker = loaded.model.talker
    mask = user_mask(prompt_ids, ids.im_start, ids.user)
    user_positions = [p for p, is_user in enumerate(mask) if is_user]
    hidden = loaded.talker_hidden
    user_rows = torch.empty((1, len(user_positions), hidden), dtype=loaded.dtype)
    text_at = [i for i, p in enumerate(user_positions) if prompt_ids[p] not in ids.multimodal]
    mm_at = [i for i, p in enumerate(user_positions) if prompt_ids[p] in ids.multimodal]
    if text_at:
        text_ids = [prompt_ids[user_positions[i]] for i in text_at]
        user_rows[0, text_at] = project_tokens(loaded, text_ids)[0].to(loaded.dtype)
    if mm_at:
        missing = [user_positions[i] for i in mm_at if user_positions[i] not in accept_hidden]
        if missing:
            raise RuntimeError(f"qwen3_omni: no accept-layer state for placeholder positions {missing[:4]}")
        states = torch.stack([accept_hidden[user_positions[i]] for i in mm_at]).unsqueeze(0)
        user_rows[0, mm_at] = talker.hidden_projection(states)[0].to(loaded.dtype)

    tts_bos, _tts_eos, tts_pad = special if special is not None else special_text_rows(loaded)
    header = project_tokens(loaded, [*prompt_ids[-3:], first_token])  # im_start assistant \n tok0
    text_channel = torch.cat([header[:, :3], tts_pad.expand(1, 4, -1), tts_bos, header[:, 3:4]], dim=1)
    codec_ids = torch.tensor(
        [
            [
                ids.codec_nothink,
                ids.codec_think_bos,
                ids.codec_think_eos,
                speaker_id,
                ids.codec_pad,
                ids.codec_bos,
            ]
        ]
    )
    codec_rows = talker.get_input_embeddings()(codec_ids)
    codec_channel = torch.cat([torch.zeros((1, 3, hidden), dtype=codec_rows.dtype), codec_rows], dim=1)
    return torch.cat([user_rows, (text_channel + codec_channel).to(loaded.dtype)], dim=1)


def resolve_speaker(loaded: LoadedModel, name: str | None) -> int:
    if not loaded.speakers:
        raise ValueError("qwen3_omni: the talker config declares no speakers")
    if name is None:
        return loaded.speakers.get("ethan", next(iter(loaded.speakers.values())))
    key = name.lower()
    if key not in loaded.speakers:
        raise ValueError(f"qwen3_omni: unknown speaker {name!r}; known: {sorted(loaded.speakers)}")
    return loaded.speakers[key]
