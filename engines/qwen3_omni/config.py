"""The tiny random-weight Qwen3-Omni configuration, built in code.

Same architecture as the checkpoint (thinker with audio tower, MoE talker with its 16-group code
predictor, code2wav with the 1920× upsampler and 72-frame window), scaled down so the whole model
builds in well under a second on a CPU. The talker's codec vocabulary keeps the checkpoint's layout:
real codes in ``[0, codebook)`` and 1024 special ids above them (``generate`` suppresses
``[vocab - 1024, vocab)`` except codec EOS), with pad/bos/eos/speakers at the checkpoint's offsets.
"""

from __future__ import annotations

from transformers import Qwen3OmniMoeConfig

from engines.qwen3_omni.tokenizer import VOCAB_SIZE, tiny_token_ids

TINY_CODEBOOK = 128
TINY_NUM_CODE_GROUPS = 16
TINY_THINKER_HIDDEN = 64
TINY_TALKER_HIDDEN = 64


def tiny_config() -> Qwen3OmniMoeConfig:
    """A 2-layer Qwen3-Omni with a byte-level vocabulary; ids match :mod:`tokenizer`."""
    ids = tiny_token_ids()
    rope = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [4, 2, 2],
        "interleaved": True,
    }
    thinker_text = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": TINY_THINKER_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": dict(rope),
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "pad_token_id": ids.endoftext,
        "eos_token_id": ids.im_end,
    }
    audio = {
        "num_mel_bins": 128,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": TINY_THINKER_HIDDEN,
        "downsample_hidden_size": 16,
        "max_source_positions": 1500,
        "n_window": 50,
        "n_window_infer": 800,
        "conv_chunksize": 500,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": TINY_THINKER_HIDDEN,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }
    thinker = {
        "text_config": thinker_text,
        "audio_config": audio,
        "vision_config": vision,
        "audio_token_id": ids.audio_pad,
        "image_token_id": ids.image_pad,
        "video_token_id": ids.video_pad,
        "audio_start_token_id": ids.audio_start,
        "user_token_id": ids.user,
        # Read by get_rope_index but not a declared field (see CPU_MODELS.md).
        "vision_start_token_id": ids.vision_start,
    }
    cb = TINY_CODEBOOK
    talker_text = {
        "vocab_size": cb + 1024,
        "hidden_size": TINY_TALKER_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        # Read by the sparse MoE block but not a declared field.
        "shared_expert_intermediate_size": 64,
    }
    predictor = {
        "vocab_size": cb,
        "hidden_size": TINY_TALKER_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "num_code_groups": TINY_NUM_CODE_GROUPS,
    }
    talker = {
        "text_config": talker_text,
        "code_predictor_config": predictor,
        "num_code_groups": TINY_NUM_CODE_GROUPS,
        "thinker_hidden_size": TINY_THINKER_HIDDEN,
        "accept_hidden_layer": 1,
        "codec_pad_id": cb + 100,
        "codec_bos_id": cb + 101,
        "codec_eos_token_id": cb + 102,
        "codec_nothink_id": cb + 107,
        "codec_think_bos_id": cb + 108,
        "codec_think_eos_id": cb + 109,
        "speaker_id": {"ethan": cb + 253, "chelsie": cb + 254, "aiden": cb + 255},
        "audio_token_id": ids.audio_pad,
        "image_token_id": ids.image_pad,
        "video_token_id": ids.video_pad,
        "vision_start_token_id": ids.vision_start,
        "audio_start_token_id": ids.audio_start,
        # Read by get_rope_index but not a declared field.
        "spatial_merge_size": 2,
    }
    code2wav = {
        "codebook_size": cb,
        "hidden_size": 64,
        "max_position_embeddings": 8000,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "sliding_window": 72,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_quantizers": TINY_NUM_CODE_GROUPS,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 64,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=ids.im_start,
        im_end_token_id=ids.im_end,
        tts_pad_token_id=ids.tts_pad,
        tts_bos_token_id=ids.tts_bos,
        tts_eos_token_id=ids.tts_eos,
        system_token_id=ids.system,
        user_token_id=ids.user,
        assistant_token_id=ids.assistant,
    )
